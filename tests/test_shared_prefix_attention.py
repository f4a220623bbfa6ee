"""Shared-prefix decode attention (engine.kernels.shared_prefix): its torch reference against a dense
softmax attention and the plain paged read, the Triton kernel against both, the checks on its inputs,
and its place behind the decode kernels' door.

The Triton kernel runs on CPU under ``TRITON_INTERPRET=1``, in a subprocess (the flag is read when
the kernels are defined), as in test_paged_attention.
"""
from __future__ import annotations

import textwrap

import pytest
import torch
from conftest import run_interpreted
from test_paged_attention import HAS_TRITON, dense_attention

from rollout_lab.engine.kernels.attention import DECODE_KERNELS, decode_layout, gqa_decode_attention
from rollout_lab.engine.kernels.paged import paged_attention_reference
from rollout_lab.engine.kernels.shared_prefix import (
    OP_NAME, prefix_splits, shared_prefix_attention, shared_prefix_attention_reference, shared_tables,
)


def shared_case(group_sizes=(3, 1), prefix=(2, 1), ungrouped=1, dead=1, kv_heads=2, per_kv=4, block_size=16,
                max_blocks=4, dim=16, dtype=torch.float32, seed=0, device="cpu", inside_prefix=True):
    """A paged pool where the rows of group g share ``prefix[g]`` full blocks (their tables point at
    them first, then at blocks of their own), ``ungrouped`` rows hold only their own blocks and
    ``dead`` rows point at the scratch block 0 at position 0; the rows in a shuffled order, at
    positions past their prefix (with ``inside_prefix``, one grouped row before its prefix's end).

    Returns (query, key_pool, value_pool, tables, positions, group_of_row, prefix_blocks, prefix_len,
    keys, values): the last two each row's dense [rows, max_blocks * block_size, kv_heads, dim]."""
    gen = torch.Generator().manual_seed(seed)
    width = max_blocks * block_size
    groups = len(group_sizes)
    grouped = sum(group_sizes)
    rows = grouped + ungrouped + dead
    num_blocks = 1 + sum(prefix) + rows * max_blocks + 2
    order = (1 + torch.randperm(num_blocks - 1, generator=gen)).tolist()  # physical blocks, shuffled
    key_pool = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen).to(dtype)
    value_pool = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen).to(dtype)
    max_prefix = max(max(prefix), 1)
    prefix_blocks = torch.zeros(groups, max_prefix, dtype=torch.int32)
    for g, n in enumerate(prefix):
        prefix_blocks[g, :n] = torch.tensor([order.pop() for _ in range(n)], dtype=torch.int32)
    prefix_len = torch.tensor([n * block_size for n in prefix])
    tables = torch.zeros(rows, max_blocks, dtype=torch.int32)
    group_of_row = torch.full((rows,), -1, dtype=torch.int32)
    positions = torch.zeros(rows, dtype=torch.long)
    row = 0
    for g, size in enumerate(group_sizes):
        for member in range(size):
            n = prefix[g]
            tables[row, :n] = prefix_blocks[g, :n]
            tables[row, n:] = torch.tensor([order.pop() for _ in range(max_blocks - n)], dtype=torch.int32)
            group_of_row[row] = g
            if inside_prefix and member == 1 and n:  # its prefix's last tokens not yet attended to
                positions[row] = block_size - 3  # and past the first block, none of it
            else:
                positions[row] = int(torch.randint(n * block_size, width, (1,), generator=gen))
            row += 1
    for _ in range(ungrouped):
        tables[row] = torch.tensor([order.pop() for _ in range(max_blocks)], dtype=torch.int32)
        positions[row] = int(torch.randint(0, width, (1,), generator=gen))
        row += 1
    shuffle = torch.randperm(rows, generator=gen)
    tables, group_of_row, positions = tables[shuffle], group_of_row[shuffle], positions[shuffle]
    keys = key_pool[tables.long()].reshape(rows, width, kv_heads, dim)  # each row's logical tokens
    values = value_pool[tables.long()].reshape(rows, width, kv_heads, dim)
    query = torch.randn(rows, kv_heads * per_kv, 1, dim + 8, generator=gen).to(dtype)[..., :dim]  # strided
    tables = torch.cat([tables, torch.zeros(2, max_blocks, dtype=torch.int32)])  # more table rows than the step
    put = lambda t: t.to(device)  # noqa: E731
    return tuple(map(put, (query, key_pool, value_pool, tables, positions, group_of_row, prefix_blocks,
                           prefix_len, keys, values)))


def test_the_case_shares_what_it_says():
    q, kp, vp, tables, positions, group_of_row, prefix_blocks, prefix_len, keys, _ = shared_case()
    assert q.shape[0] == 6 and int((group_of_row == 0).sum()) == 3 and int((group_of_row == -1).sum()) == 2
    members = (group_of_row == 0).nonzero()[:, 0]
    assert (tables[members, :2] == prefix_blocks[0, :2]).all()  # the group's prefix: the same blocks
    assert torch.equal(keys[members[0], :32], keys[members[1], :32])
    assert (positions[members] < 32).any()  # a row before its prefix's end
    dead = ((group_of_row == -1) & (tables[:6] == 0).all(1)).nonzero()
    assert len(dead) == 1 and positions[dead[0, 0]] == 0


@pytest.mark.parametrize("per_kv", [1, 4])
def test_reference_equals_dense_attention_and_the_plain_read(per_kv):
    q, kp, vp, tables, positions, group_of_row, prefix_blocks, prefix_len, keys, values = shared_case(per_kv=per_kv)
    got = shared_prefix_attention_reference(q, kp, vp, tables, positions, group_of_row, prefix_blocks,
                                            prefix_len, 0.25)
    assert got.shape == (6, 1, 2 * per_kv, 16) and got.dtype == torch.float32
    torch.testing.assert_close(got, dense_attention(q, keys, values, positions, 0.25))
    torch.testing.assert_close(got, paged_attention_reference(q, kp, vp, tables, positions, 0.25))


def test_reference_reads_the_prefix_from_the_groups_blocks():
    """The rows' own prefix entries are not read: pointing them elsewhere changes the plain read, not
    the shared one."""
    q, kp, vp, tables, positions, group_of_row, prefix_blocks, prefix_len, _, _ = shared_case()
    want = paged_attention_reference(q, kp, vp, tables, positions, 0.25)
    moved = tables.clone()
    moved[:6][group_of_row >= 0, :1] = 0  # the first prefix block of every grouped row: the scratch block
    got = shared_prefix_attention_reference(q, kp, vp, moved, positions, group_of_row, prefix_blocks, prefix_len, 0.25)
    torch.testing.assert_close(got, want)
    assert not torch.allclose(paged_attention_reference(q, kp, vp, moved, positions, 0.25), want)


def test_shared_tables_put_each_groups_prefix_in_front():
    tables = torch.tensor([[5, 6, 7], [8, 9, 10], [11, 12, 13]], dtype=torch.int32)
    prefix_blocks = torch.tensor([[1, 2, 3, 4], [20, 0, 0, 0]], dtype=torch.int32)
    got = shared_tables(tables, torch.tensor([1, -1, 0]), prefix_blocks, torch.tensor([64, 16]), rows=3,
                        block_size=16)
    assert got.tolist() == [[20, 6, 7, 0], [8, 9, 10, 0], [1, 2, 3, 4]]  # widened to the prefix table
    got = shared_tables(tables, torch.tensor([7, 0, 1]), prefix_blocks, torch.tensor([40, 16]), rows=3,
                        block_size=16)  # a group past the last: none; 40 tokens: 2 full blocks
    assert got.tolist() == [[5, 6, 7, 0], [1, 2, 10, 0], [20, 12, 13, 0]]


def test_reference_keeps_the_dtype():
    q, kp, vp, tables, positions, group_of_row, prefix_blocks, prefix_len, keys, values = shared_case(
        dtype=torch.bfloat16)
    got = shared_prefix_attention_reference(q, kp, vp, tables, positions, group_of_row, prefix_blocks,
                                            prefix_len, 0.25)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), dense_attention(q, keys, values, positions, 0.25), atol=2e-2, rtol=0)


def test_custom_op_is_registered():
    case = shared_case()[:8]
    assert OP_NAME == "rollout_lab::shared_prefix_attention"
    op = torch.ops.rollout_lab.shared_prefix_attention
    got = op(*case, 0.3)
    torch.testing.assert_close(got, shared_prefix_attention_reference(*case, 0.3), atol=1e-5, rtol=1e-5)
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:  # the fake: shape and dtype only
        fake = op(*(mode.from_tensor(t) for t in case), 0.3)
    assert fake.shape == (6, 1, 8, 16) and fake.dtype == torch.float32


def test_bad_inputs_are_named():
    q, kp, vp, tables, positions, group_of_row, prefix_blocks, prefix_len, _, _ = shared_case()
    paged = (q, kp, vp, tables, positions)
    with pytest.raises(ValueError, match="one decode token per row, got 2"):  # paged's checks first
        shared_prefix_attention(q.expand(-1, -1, 2, -1), kp, vp, tables, positions, group_of_row, prefix_blocks,
                                prefix_len, 1.0)
    with pytest.raises(ValueError, match=r"group_of_row must be an integer \[>= rows\].* for 6 rows, got "
                                         r"torch.int32 \(3,\)"):
        shared_prefix_attention(*paged, group_of_row[:3], prefix_blocks, prefix_len, 1.0)
    with pytest.raises(ValueError, match="group_of_row must be an integer.*got torch.float32"):
        shared_prefix_attention(*paged, group_of_row.float(), prefix_blocks, prefix_len, 1.0)
    with pytest.raises(ValueError, match=r"prefix_blocks must be an integer \[groups >= 1, max_prefix_blocks >= 1\]"
                                         r" tensor, got torch.int32 \(2, 0\)"):
        shared_prefix_attention(*paged, group_of_row, prefix_blocks[:, :0], prefix_len, 1.0)
    with pytest.raises(ValueError, match="prefix_blocks must be .* got torch.int32 \\(4,\\)"):
        shared_prefix_attention(*paged, group_of_row, prefix_blocks.reshape(-1), prefix_len, 1.0)
    with pytest.raises(ValueError, match=r"prefix_len must be an integer \[groups\] tensor, 2 entries .* got "
                                         r"torch.int64 \(1,\)"):
        shared_prefix_attention(*paged, group_of_row, prefix_blocks, prefix_len[:1], 1.0)
    with pytest.raises(ValueError, match="prefix_len must be .* got torch.bool"):
        shared_prefix_attention(*paged, group_of_row, prefix_blocks, prefix_len > 0, 1.0)


def test_prefix_splits_fill_the_device_and_fit_the_prefix():
    assert prefix_splits(1, 1, 1, "cpu") == 1  # one block: one split
    assert prefix_splits(1, 1, 3, "cpu") == 3
    assert prefix_splits(1, 1, 100, "cpu") == 8  # one wave of the CPU's 8 "multiprocessors"
    assert prefix_splits(3, 1, 100, "cpu") == 2
    assert prefix_splits(32, 2, 31, "cpu") == 1  # enough programs already


def test_the_decode_door_routes_the_shared_keywords():
    """Behind DECODE_KERNELS: the step's paged keywords with the groups' take the shared read; the
    paged keywords alone the plain one; every layout's keywords are popped."""
    q, kp, vp, tables, positions, group_of_row, prefix_blocks, prefix_len, keys, values = shared_case()
    names = DECODE_KERNELS["shared_prefix"][0]
    assert names == ("paged_tables", "paged_positions", "prefix_group_of_row", "prefix_blocks", "prefix_len")
    kwargs = dict(zip(names, (tables, positions, group_of_row, prefix_blocks, prefix_len)), other=1)
    layout, args = decode_layout(dict(kwargs))
    assert layout == "shared_prefix" and len(args) == 5
    layout, _ = decode_layout({"paged_tables": tables, "paged_positions": positions})
    assert layout == "paged"

    class Module(torch.nn.Module):
        num_key_value_groups = 4

    moved = tables.clone()
    moved[:6][group_of_row >= 0, :1] = 0  # only the shared read still finds the prefix
    kwargs["paged_tables"] = moved
    out, _ = gqa_decode_attention(Module(), q, kp, vp, None, scaling=0.25, **kwargs)
    torch.testing.assert_close(out, dense_attention(q, keys, values, positions, 0.25))


def check_kernel(cases, device, dtypes=((torch.float32, 1e-5), (torch.bfloat16, 2e-2))):
    """The kernel against the plain paged read of the rows' own tables (which hold the same prefix
    blocks) on ``device``: called directly, and through ``torch.ops`` with the grouped rows' own
    prefix entries pointed at the scratch block (the kernel reads the group's ``prefix_blocks``).
    Cases are ``shared_case`` keywords."""
    from rollout_lab.engine.kernels.available import kernel_available

    assert kernel_available(device)
    for dtype, tol in dtypes:
        for seed, case in enumerate(cases):
            q, kp, vp, tables, positions, group_of_row, prefix_blocks, prefix_len, _, _ = shared_case(
                **case, dtype=dtype, seed=seed, device=device)
            scale = q.shape[-1] ** -0.5
            shared = (group_of_row, prefix_blocks, prefix_len)
            plain = paged_attention_reference(q, kp, vp, tables, positions, scale)
            moved = tables.clone()
            for row, group in enumerate(group_of_row.tolist()):
                if group >= 0:
                    moved[row, : int(prefix_len[group]) // kp.shape[1]] = 0
            for got in (shared_prefix_attention(q, kp, vp, tables, positions, *shared, scale),
                        torch.ops.rollout_lab.shared_prefix_attention(q, kp, vp, moved, positions, *shared, scale)):
                err = (got.float() - plain.float()).abs().max().item()
                assert got.dtype == dtype and got.shape == plain.shape and err < tol, (dtype, case, err)


INTERPRETED = textwrap.dedent("""
    import torch
    from rollout_lab.engine.kernels import shared_prefix
    from test_shared_prefix_attention import check_kernel
    cases = [
        dict(group_sizes=(3, 1), prefix=(2, 1)),  # GQA 4 per KV head, a row inside its prefix
        dict(group_sizes=(2, 5), prefix=(0, 3), per_kv=1, kv_heads=3, block_size=32, max_blocks=5),  # MHA
        dict(group_sizes=(16,), prefix=(2,), ungrouped=2, dead=2, per_kv=2, dim=32, inside_prefix=False),
    ]
    check_kernel(cases, "cpu")
    # a group over several tiles, and rows found over several scans of group_of_row
    shared_prefix.PREFIX_TILE_QUERIES, shared_prefix.SCAN_ROWS = 16, 16
    check_kernel([dict(group_sizes=(9, 4, 1), prefix=(2, 3, 1), ungrouped=3, dead=3, per_kv=4)], "cpu",
                 dtypes=((torch.float32, 1e-5),))
    print("kernel ok")
""")


# a CPU test: on a CUDA machine the compiled kernel is checked instead, as in test_paged_attention
interpreted = pytest.mark.skipif(not HAS_TRITON or torch.cuda.is_available(),
                                 reason="needs Triton (make test installs it) on a machine without CUDA")


@pytest.mark.slow
@interpreted
def test_kernel_equals_the_plain_read_in_the_triton_interpreter():
    assert "kernel ok" in run_interpreted(INTERPRETED)


@pytest.mark.skipif(not torch.cuda.is_available() or not HAS_TRITON, reason="needs a CUDA GPU and Triton")
def test_cuda_kernel_equals_the_plain_read():
    cases = [dict(group_sizes=(16, 16, 3), prefix=(4, 2, 0), ungrouped=5, dead=3, kv_heads=2, per_kv=8,
                  block_size=64, max_blocks=6, dim=128),  # Qwen2.5-3B's heads
             dict(group_sizes=(1, 7, 20), prefix=(1, 3, 2), per_kv=1, kv_heads=4, block_size=16, max_blocks=5,
                  dim=64),
             dict(group_sizes=(130,), prefix=(2,), per_kv=2, kv_heads=2, block_size=128, max_blocks=3, dim=32)]
    check_kernel(cases, "cuda")
