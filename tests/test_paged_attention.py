"""Paged attention (engine.kernels.paged): the torch reference against a dense computation over
contiguous per-row keys, the Triton kernel against the reference, and the checks on its inputs.

The Triton kernel runs on CPU under ``TRITON_INTERPRET=1``, in a subprocess (the flag is read when
the kernels are defined), as in test_span_attention.
"""
from __future__ import annotations

import textwrap

import pytest
import torch

from conftest import run_interpreted
from rollout_lab.engine.kernels.paged import (
    OP_NAME, paged_attention, paged_attention_reference, paged_splits,
)

try:
    import triton  # noqa: F401
    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False


def paged_case(rows=5, kv_heads=2, groups=4, block_size=16, max_blocks=4, dim=16, dtype=torch.float32,
               seed=0, device="cpu"):
    """Contiguous per-row keys and values scattered into a shuffled pool (block 0 the scratch block),
    the block table that finds them, and positions on and around block boundaries; the last row is
    dead (its table points at block 0, its position 0). Returns the paged inputs, and the dense
    per-row keys and values [rows, max_blocks * block_size, kv_heads, dim]."""
    gen = torch.Generator().manual_seed(seed)
    width = max_blocks * block_size
    query = torch.randn(rows, kv_heads * groups, 1, dim + 8, generator=gen).to(dtype)[..., :dim]  # a strided view
    keys = torch.randn(rows, width, kv_heads, dim, generator=gen).to(dtype)
    values = torch.randn(rows, width, kv_heads, dim, generator=gen).to(dtype)
    num_blocks = 1 + rows * max_blocks + 3  # scratch, the rows' blocks, and some unused ones
    key_pool = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen).to(dtype)
    value_pool = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen).to(dtype)
    tables = (1 + torch.randperm(num_blocks - 1, generator=gen)[: rows * max_blocks]).reshape(rows, max_blocks)
    tables[-1] = 0  # the dead row
    for i in range(rows - 1):
        for j in range(max_blocks):
            blk = slice(j * block_size, (j + 1) * block_size)
            key_pool[tables[i, j]] = keys[i, blk]
            value_pool[tables[i, j]] = values[i, blk]
    keys[-1] = key_pool[0].repeat(max_blocks, 1, 1)
    values[-1] = value_pool[0].repeat(max_blocks, 1, 1)
    boundaries = [block_size - 1, block_size, 0, width - 1, block_size + 1, 2 * block_size - 1]
    positions = torch.tensor([min(boundaries[i % len(boundaries)], width - 1) for i in range(rows - 1)] + [0, 7])
    extra = torch.zeros(2, max_blocks, dtype=torch.long)  # the table may have more rows than the step
    tables = torch.cat([tables, extra]).to(torch.int32)
    put = lambda t: t.to(device)  # noqa: E731
    return tuple(map(put, (query, key_pool, value_pool, tables, positions, keys, values)))


def dense_attention(query, keys, values, positions, scale):
    """Plain softmax attention of each row over its first positions[i] + 1 tokens, one row at a time,
    with the KV heads repeated for the query heads that share them."""
    rows, heads, _, dim = query.shape
    out = torch.empty(rows, 1, heads, dim)
    group = heads // keys.shape[2]
    for i in range(rows):
        n = int(positions[i]) + 1
        k = keys[i, :n].float().repeat_interleave(group, dim=1)  # [n, heads, dim]
        v = values[i, :n].float().repeat_interleave(group, dim=1)
        q = query[i, :, 0].float()  # [heads, dim]
        weights = (torch.einsum("hd,nhd->hn", q, k) * scale).softmax(-1)
        out[i, 0] = torch.einsum("hn,nhd->hd", weights, v)
    return out


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("groups", [1, 4])
def test_reference_equals_dense_attention(block_size, groups):
    query, key_pool, value_pool, tables, positions, keys, values = paged_case(groups=groups, block_size=block_size)
    assert not query.is_contiguous()
    got = paged_attention_reference(query, key_pool, value_pool, tables, positions, 0.25)
    assert got.shape == (5, 1, 2 * groups, 16) and got.dtype == torch.float32
    torch.testing.assert_close(got, dense_attention(query, keys, values, positions, 0.25))


def test_reference_keeps_the_dtype():
    query, key_pool, value_pool, tables, positions, keys, values = paged_case(dtype=torch.bfloat16)
    got = paged_attention_reference(query, key_pool, value_pool, tables, positions, 0.25)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), dense_attention(query, keys, values, positions, 0.25),
                               atol=2e-2, rtol=0)


def test_custom_op_is_registered():
    query, key_pool, value_pool, tables, positions, _, _ = paged_case(groups=2)
    assert OP_NAME == "rollout_lab::paged_attention"
    op = torch.ops.rollout_lab.paged_attention
    got = op(query, key_pool, value_pool, tables, positions, 0.3)
    want = paged_attention_reference(query, key_pool, value_pool, tables, positions, 0.3)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:  # the fake: shape and dtype only
        fake = op(*(mode.from_tensor(t) for t in (query, key_pool, value_pool, tables, positions)), 0.3)
    assert fake.shape == (5, 1, 4, 16) and fake.dtype == query.dtype


def test_bad_inputs_are_named():
    query, key_pool, value_pool, tables, positions, _, _ = paged_case()
    args = (tables, positions, 1.0)
    with pytest.raises(ValueError, match="one decode token per row, got 2"):
        paged_attention(query.expand(-1, -1, 2, -1), key_pool, value_pool, *args)
    with pytest.raises(ValueError, match="block size in .* got 24"):
        pool = torch.zeros(3, 24, 2, 16)
        paged_attention(query, pool, pool, *args)
    with pytest.raises(ValueError, match="block size in .* got 256"):
        pool = torch.zeros(3, 256, 2, 16)
        paged_attention(query, pool, pool, *args)
    with pytest.raises(ValueError, match="must both be"):
        paged_attention(query, key_pool, value_pool[:, :, :1], *args)
    with pytest.raises(ValueError, match="head_dim 32 does not match"):
        pool = torch.zeros(3, 16, 2, 32)
        paged_attention(query, pool, pool, *args)
    with pytest.raises(ValueError, match="8 query heads are not a multiple of 3 KV heads"):
        pool = torch.zeros(3, 16, 3, 16)
        paged_attention(query, pool, pool, *args)
    with pytest.raises(ValueError, match="power-of-two head_dim >= 16, got 12"):
        paged_attention(query[..., :12], key_pool[..., :12], value_pool[..., :12], *args)
    with pytest.raises(ValueError, match="block_tables has 2 rows of 4 blocks for 5 rows"):
        paged_attention(query, key_pool, value_pool, tables[:2], positions, 1.0)
    with pytest.raises(ValueError, match="integer"):
        paged_attention(query, key_pool, value_pool, tables.float(), positions, 1.0)
    with pytest.raises(ValueError, match="positions has 3 entries for 5 rows"):
        paged_attention(query, key_pool, value_pool, tables, positions[:3], 1.0)


def test_splits_fill_the_device_and_fit_the_table():
    assert paged_splits(1, 1, 1, "cpu") == 1  # one block: one split
    assert paged_splits(1, 1, 3, "cpu") == 3  # no more splits than blocks
    assert paged_splits(1, 1, 100, "cpu") == 32  # capped
    assert paged_splits(64, 8, 100, "cpu") == 1  # enough programs already


def check_kernel(cases, device):
    """The kernel (called directly and through ``torch.ops``) against the reference on ``device``,
    fp32 and bf16, for cases (rows, kv_heads, groups, block_size, max_blocks, head_dim); the numbers
    of splits the cases ran with (one split writes the output without the merge)."""
    from rollout_lab.engine.kernels.available import kernel_available

    assert kernel_available(device)
    splits = set()
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        for seed, case in enumerate(cases):
            rows, kv_heads, groups, block_size, max_blocks, dim = case
            q, kp, vp, tables, positions, _, _ = paged_case(rows, kv_heads, groups, block_size, max_blocks, dim,
                                                             dtype, seed, device)
            want = paged_attention_reference(q, kp, vp, tables, positions, dim ** -0.5)
            for got in (paged_attention(q, kp, vp, tables, positions, dim ** -0.5),
                        torch.ops.rollout_lab.paged_attention(q, kp, vp, tables, positions, dim ** -0.5)):
                err = (got.float() - want.float()).abs().max().item()
                assert got.dtype == dtype and got.shape == want.shape and err < tol, (dtype, case, err)
            splits.add(paged_splits(rows, kv_heads, max_blocks, device))
    return splits


def check_paged_write(device):
    """``paged_write`` (its one-launch kernel where Triton runs) against ``index_copy_`` into copies of
    the pools: strided [rows, kv_heads, head_dim] views as the decode step passes them, untouched
    tokens kept; tokens of another dtype than the pools' (``index_copy_`` casts them) too."""
    from rollout_lab.engine.kv.paged import paged_write
    from rollout_lab.engine.kernels.available import kernel_available

    assert kernel_available(device)
    gen = torch.Generator().manual_seed(3)
    for pool_dtype, new_dtype, (kv_heads, dim) in ((torch.float32, torch.float32, (2, 16)),
                                                   (torch.bfloat16, torch.bfloat16, (3, 32)),
                                                   (torch.bfloat16, torch.float32, (1, 64))):
        keys_pool = torch.randn(5, 4, kv_heads, dim, generator=gen).to(pool_dtype).to(device)
        values_pool = torch.randn(5, 4, kv_heads, dim, generator=gen).to(pool_dtype).to(device)
        states = torch.randn(6, kv_heads, 2, dim, generator=gen).to(new_dtype).to(device)  # [rows, heads, q, dim]
        keys, values = states[:, :, 0], states[:, :, 1]  # strided, as key_states[:, :, 0]
        slots = torch.tensor([7, 0, 19, 3, 12, 8], device=device)
        want_k, want_v = keys_pool.clone(), values_pool.clone()
        for pool, new in ((want_k, keys), (want_v, values)):
            pool.view(-1, kv_heads, dim).index_copy_(0, slots, new.to(pool_dtype))
        paged_write(keys_pool, values_pool, keys, values, slots)
        assert torch.equal(keys_pool, want_k) and torch.equal(values_pool, want_v), (pool_dtype, new_dtype)


INTERPRETED = textwrap.dedent("""
    from test_paged_attention import check_kernel, check_paged_write
    check_paged_write("cpu")
    # (rows, kv_heads, groups, block_size, max_blocks, head_dim)
    cases = [(3, 2, 4, 16, 5, 32), (4, 1, 1, 32, 3, 16), (2, 2, 2, 64, 2, 16), (2, 1, 1, 16, 1, 16)]
    splits = check_kernel(cases, "cpu")
    assert 1 in splits and max(splits) > 1  # the direct write and split-K covered
    print("kernel ok")
""")


# a CPU test: on a CUDA machine the compiled kernel is checked instead, as in test_span_attention
interpreted = pytest.mark.skipif(not HAS_TRITON or torch.cuda.is_available(),
                                 reason="needs Triton (make test installs it) on a machine without CUDA")


@pytest.mark.slow
@interpreted
def test_kernel_equals_reference_in_the_triton_interpreter():
    assert "kernel ok" in run_interpreted(INTERPRETED)


@pytest.mark.skipif(not torch.cuda.is_available() or not HAS_TRITON, reason="needs a CUDA GPU and Triton")
def test_cuda_kernel_equals_reference():
    # Qwen2.5-3B and Qwen3-0.6B decode shapes among them, and every block size
    cases = [(32, 2, 8, 16, 48, 128), (256, 8, 2, 32, 48, 128), (7, 4, 1, 64, 5, 64), (3, 2, 4, 128, 3, 32),
             (1, 1, 1, 16, 1, 16)]
    splits = check_kernel(cases, "cuda")
    assert 1 in splits and max(splits) > 1
    check_paged_write("cuda")
