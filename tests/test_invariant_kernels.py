"""Batch-invariant kernels (engine.kernels.invariant): a row's bits whatever else is in the call, and
the prefill's attention equal to the paged decode's, bit for bit; each against a torch reference.

The kernels run on CPU only under ``TRITON_INTERPRET=1``, read when the kernels are defined, so the
CPU checks run in a subprocess (as in test_paged_attention); on a CUDA machine the same checks run
on the GPU in bf16 and fp32. The input checks run in process (they raise before any launch).
"""
from __future__ import annotations

import textwrap

import pytest
import torch
import torch.nn.functional as F

from conftest import run_interpreted
from rollout_lab.engine.kernels.invariant import (
    INVARIANT_BLOCK_N, invariant_attention, invariant_bmm, invariant_matmul, invariant_paged_attention,
    invariant_rms_norm, invariant_rope, invariant_row_mean, matmul_splits, rms_norm_reference, rope_reference,
)

try:
    import triton  # noqa: F401
    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> None:
    """Within the dtype's tolerance (``scale`` times it: sums of more terms round further)."""
    tol = TOLERANCE[dtype] * scale
    torch.testing.assert_close(got.float(), want.float().to(got.device), atol=tol, rtol=tol)


def randn(*shape, gen, dtype=torch.float32, device="cpu") -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(dtype).to(device)


def check_matmul(device: str, dtype: torch.dtype) -> None:
    """One row of a, alone (M=1), among 7 others, among 127 others and at another index (another
    place in its tile): the same bits; with a bias and b a transposed weight view; M=0; bmm. K of 80
    (one range) and 2100 (two ranges of split-K, the last one short)."""
    assert matmul_splits(200, 80) == 1 and matmul_splits(200, 2100) == 2
    for k in (80, 2100):
        check_matmul_shape(device, dtype, k, 200)  # neither a multiple of the tile: masked K and N edges


def check_matmul_shape(device: str, dtype: torch.dtype, k: int, n: int) -> None:
    gen = torch.Generator().manual_seed(k)
    weight = randn(n, k, gen=gen, dtype=dtype, device=device)
    bias = randn(n, gen=gen, dtype=dtype, device=device)
    a = randn(128, k, gen=gen, dtype=dtype, device=device)
    b = weight.t()  # [K, N], a transposed view as nn.Linear's weight gives it
    assert not b.is_contiguous()
    for with_bias in (None, bias):
        alone = invariant_matmul(a[5:6], b, with_bias)[0]
        moved = randn(128, k, gen=gen, dtype=dtype, device=device)
        moved[70] = a[5]  # the second M tile, another row of it
        for got in (invariant_matmul(a[:8], b, with_bias)[5], invariant_matmul(a, b, with_bias)[5],
                    invariant_matmul(moved, b, with_bias)[70]):
            assert torch.equal(got, alone), (dtype, with_bias is not None)
        want = a.float() @ b.float() + (0 if with_bias is None else with_bias.float())
        got = invariant_matmul(a, b, with_bias)
        assert got.dtype == dtype and got.shape == (128, n)
        close(got, want, dtype, scale=k / 80)
    empty = invariant_matmul(a[:0], b, bias)
    assert empty.shape == (0, n) and empty.dtype == dtype
    batched_a = randn(3, 9, k, gen=gen, dtype=dtype, device=device)
    batched_b = randn(3, n, k, gen=gen, dtype=dtype, device=device).transpose(1, 2)
    got = invariant_bmm(batched_a, batched_b)
    close(got, torch.bmm(batched_a.float(), batched_b.float()), dtype, scale=k / 80)
    for i in range(3):
        assert torch.equal(got[i], invariant_matmul(batched_a[i], batched_b[i]))
    assert torch.equal(got[1, 4], invariant_matmul(batched_a[1, 4:5], batched_b[1])[0])


def check_row_mean(device: str, dtype: torch.dtype) -> None:
    """A row's mean alone and among others (3-D input, rows longer than one strip); against torch."""
    gen = torch.Generator().manual_seed(1)
    x = randn(2, 3, 1100, gen=gen, dtype=dtype, device=device)
    got = invariant_row_mean(x)
    assert got.shape == (2, 3, 1) and got.dtype == dtype
    assert torch.equal(got[1, 2], invariant_row_mean(x[1, 2:3])[0])
    close(got, x.float().mean(-1, keepdim=True), dtype)


def check_rms_norm(device: str, dtype: torch.dtype) -> None:
    """A row's norm alone and among others (3-D input, rows longer than one strip, an fp32 weight on
    half rows: the output promotes as the module's does); against the module's formula; gradients."""
    gen = torch.Generator().manual_seed(2)
    x = randn(2, 3, 1100, gen=gen, dtype=dtype, device=device)
    for weight in (randn(1100, gen=gen, dtype=dtype, device=device), randn(1100, gen=gen, device=device)):
        got = invariant_rms_norm(x, weight, 1e-6)
        assert got.shape == x.shape and got.dtype == torch.promote_types(weight.dtype, dtype)
        assert torch.equal(got[1, 2], invariant_rms_norm(x[1, 2:3], weight, 1e-6)[0])
        close(got, rms_norm_reference(x, weight, 1e-6), dtype)
    x, weight = x.float().requires_grad_(), weight.float().requires_grad_()
    invariant_rms_norm(x, weight, 1e-6).square().sum().backward()
    want = [t.detach().clone().requires_grad_() for t in (x, weight)]
    rms_norm_reference(*want, 1e-6).square().sum().backward()
    close(x.grad, want[0].grad, torch.float32)
    close(weight.grad, want[1].grad, torch.float32)


def check_rope(device: str, dtype: torch.dtype) -> None:
    """Queries and keys as HF gives them (transposed views), cos and sin per row and shared by the
    rows: HF's formula with its roundings (bit for bit where no fused multiply-add can enter: half
    types on a GPU, fp32 in the interpreter); gradients through the reference."""
    gen = torch.Generator().manual_seed(3)
    q = randn(3, 5, 4, 64, gen=gen, dtype=dtype, device=device).transpose(1, 2)  # [B, H, T, D]
    k = randn(3, 5, 2, 64, gen=gen, dtype=dtype, device=device).transpose(1, 2)
    for rows in (3, 1):
        cos, sin = (randn(rows, 5, 64, gen=gen, dtype=dtype, device=device) for _ in range(2))
        got, want = invariant_rope(q, k, cos, sin), rope_reference(q, k, cos, sin)
        for g, w in zip(got, want):
            assert g.shape == w.shape and g.dtype == dtype
            if device == "cpu" or dtype != torch.float32:
                assert torch.equal(g, w), float((g.float() - w.float()).abs().max())
            close(g, w, dtype)
    q, k = q.float().requires_grad_(), k.float().requires_grad_()
    out_q, out_k = invariant_rope(q, k, cos.float(), sin.float())
    (out_q.square().sum() + out_k.sum()).backward()
    twin = [t.detach().clone().requires_grad_() for t in (q, k)]
    want_q, want_k = rope_reference(*twin, cos.float(), sin.float())
    (want_q.square().sum() + want_k.sum()).backward()
    close(q.grad, twin[0].grad, torch.float32)
    close(k.grad, twin[1].grad, torch.float32)


def probe(kv_heads: int, group: int, dim: int, length: int, dtype: torch.dtype, seed: int):
    """One sequence: the query at each of its logical positions [H, length, D] and its keys and
    values [KVH, length, D]."""
    gen = torch.Generator().manual_seed(seed)
    return tuple(randn(*shape, gen=gen, dtype=dtype) for shape in
                 ((kv_heads * group, length, dim), (kv_heads, length, dim), (kv_heads, length, dim)))


def prefill_outputs(query, key, value, *, pad: int, chunk: int, batch: int, at: int, device: str, seed: int):
    """``invariant_attention``'s outputs [chunk, H, D] for the probe's last ``chunk`` positions: the
    probe is batch row ``at``, left-padded by ``pad`` (junk keys), among random rows with random
    left padding; the keys before the chunk are cached columns (S > q)."""
    heads, length, dim = query.shape
    kv_heads = key.shape[0]
    gen = torch.Generator().manual_seed(seed)
    width = pad + length
    queries = randn(batch, heads, chunk, dim, gen=gen, dtype=query.dtype)
    keys = randn(batch, kv_heads, width, dim, gen=gen, dtype=query.dtype)
    values = randn(batch, kv_heads, width, dim, gen=gen, dtype=query.dtype)
    queries[at] = query[:, length - chunk:]
    keys[at, :, pad:] = key
    values[at, :, pad:] = value
    starts = torch.randint(0, width, (batch,), generator=gen)
    starts[at] = pad
    put = lambda t: t.to(device)  # noqa: E731
    out = invariant_attention(put(queries), put(keys), put(values), put(starts), dim ** -0.5)
    assert out.shape == (batch, chunk, heads, dim) and out.dtype == query.dtype
    return out[at]


def decode_outputs(query, key, value, positions: list[int], *, block_size: int, device: str, seed: int):
    """``invariant_paged_attention``'s outputs [len(positions), H, D]: the probe's query at each of
    its logical ``positions``, one row each (its table's blocks shuffled in the pool), a random row
    beside them."""
    heads, length, dim = query.shape
    kv_heads = key.shape[0]
    gen = torch.Generator().manual_seed(seed)
    rows = len(positions) + 1  # row 1 is the stranger
    max_blocks = -(-length // block_size) + 1  # one table entry more than the probe needs
    num_blocks = 1 + rows * max_blocks
    key_pool = randn(num_blocks, block_size, kv_heads, dim, gen=gen, dtype=query.dtype)
    value_pool = randn(num_blocks, block_size, kv_heads, dim, gen=gen, dtype=query.dtype)
    tables = (1 + torch.randperm(num_blocks - 1, generator=gen)).reshape(rows, max_blocks).to(torch.int32)
    width = max_blocks * block_size
    padded_key = torch.zeros(width, kv_heads, dim, dtype=query.dtype)
    padded_value = torch.zeros(width, kv_heads, dim, dtype=query.dtype)
    padded_key[:length], padded_value[:length] = key.transpose(0, 1), value.transpose(0, 1)
    probe_rows = [r for r in range(rows) if r != 1]
    for r in probe_rows:
        key_pool[tables[r].long()] = padded_key.reshape(max_blocks, block_size, kv_heads, dim)
        value_pool[tables[r].long()] = padded_value.reshape(max_blocks, block_size, kv_heads, dim)
    queries = randn(rows, heads, 1, dim, gen=gen, dtype=query.dtype)
    row_positions = torch.full((rows,), 2 * block_size - 3, dtype=torch.long)  # the stranger's
    for p, r in zip(positions, probe_rows):
        queries[r, :, 0] = query[:, p]
        row_positions[r] = p
    put = lambda t: t.to(device)  # noqa: E731
    out = invariant_paged_attention(put(queries), put(key_pool), put(value_pool), put(tables), put(row_positions),
                                    dim ** -0.5)
    assert out.shape == (rows, 1, heads, dim) and out.dtype == query.dtype
    return out[probe_rows, 0]


def probe_reference(query, key, value) -> torch.Tensor:
    """Plain causal attention of the probe, fp32 [length, H, D], the KV heads repeated."""
    heads, length, dim = query.shape
    group = heads // key.shape[0]
    k = key.float().repeat_interleave(group, 0)
    v = value.float().repeat_interleave(group, 0)
    return F.scaled_dot_product_attention(query.float(), k, v, is_causal=True, scale=dim ** -0.5).transpose(0, 1)


LENGTH = 40  # the probe: three INVARIANT_BLOCK_N blocks, the last one partial
DECODED = [0, 7, 15, 16, 20, 31, 32, 35, 39]  # positions on and around the blocks' edges
# (pad, chunk, batch, at): q-tiles of other sizes (a position at another row of its tile), left
# padding 0/3/17, one row or five, keys cached before the chunk
PREFILLS = ((0, 40, 1, 0), (3, 40, 5, 2), (17, 5, 2, 1), (17, 1, 2, 0), (3, 21, 2, 1))


def check_attention(device: str, dtype: torch.dtype, cases) -> None:
    """For each (kv_heads, group, head_dim): the probe's outputs at ``DECODED`` from the paged decode
    (block sizes 16 and 64) and from every prefill in ``PREFILLS`` are the same bits, and close to
    the reference."""
    for seed, (kv_heads, group, dim) in enumerate(cases):
        query, key, value = probe(kv_heads, group, dim, LENGTH, dtype, seed)
        decoded = decode_outputs(query, key, value, DECODED, block_size=16, device=device, seed=seed)
        close(decoded, probe_reference(query, key, value)[DECODED], dtype)
        other = decode_outputs(query, key, value, DECODED, block_size=64, device=device, seed=seed + 100)
        assert torch.equal(decoded, other), (kv_heads, group, dim)
        for pad, chunk, batch, at in PREFILLS:
            got = prefill_outputs(query, key, value, pad=pad, chunk=chunk, batch=batch, at=at, device=device,
                                  seed=seed)
            covered = [i for i, p in enumerate(DECODED) if p >= LENGTH - chunk]
            rows = [DECODED[i] - (LENGTH - chunk) for i in covered]
            assert torch.equal(got[rows], decoded[covered]), (kv_heads, group, dim, pad, chunk, batch, at)


def dense_prefill(query, key, value, starts, scale):
    """Causal attention one batch row at a time over its unpadded keys (SDPA, autograd through it),
    [B, q, H, D]; left-padding queries 0."""
    batch, heads, q_len, dim = query.shape
    group = heads // key.shape[1]
    width = key.shape[2]
    outs = []
    for b in range(batch):
        start = int(starts[b])
        k = key[b, :, start:].repeat_interleave(group, 0)  # [H, S - start, D]
        v = value[b, :, start:].repeat_interleave(group, 0)
        first = max(0, start - (width - q_len))  # the first query that is not padding
        pos = torch.arange(width - q_len + first, width) - start  # logical positions of the real queries
        mask = torch.arange(width - start)[None, :] <= pos[:, None]
        out = F.scaled_dot_product_attention(query[b, :, first:], k, v, attn_mask=mask, scale=scale)
        outs.append(torch.cat([query.new_zeros(heads, first, dim), out], 1).transpose(0, 1))
    return torch.stack(outs)


def check_backward(device: str) -> None:
    """Forward and gradients (query, key, value) against ``dense_prefill``'s, fp32, left padding that
    covers some queries."""
    gen = torch.Generator().manual_seed(5)
    query = randn(3, 4, 6, 16, gen=gen, device=device).requires_grad_()
    key = randn(3, 2, 10, 16, gen=gen, device=device).requires_grad_()
    value = randn(3, 2, 10, 16, gen=gen, device=device).requires_grad_()
    starts = torch.tensor([0, 3, 7], device=device)  # row 2: its first three queries are padding
    grad = randn(3, 6, 4, 16, gen=gen, device=device)
    got = invariant_attention(query, key, value, starts, 0.3)
    grads = torch.autograd.grad(got, (query, key, value), grad)
    want = dense_prefill(query, key, value, starts, 0.3)
    want_grads = torch.autograd.grad(want, (query, key, value), grad)
    torch.testing.assert_close(got.detach(), want.detach(), atol=1e-5, rtol=1e-5)
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)


# a CPU test: on a CUDA machine the compiled kernels are checked instead
interpreted = pytest.mark.skipif(not HAS_TRITON or torch.cuda.is_available(),
                                 reason="needs Triton (make test installs it) on a machine without CUDA")
on_cuda = pytest.mark.skipif(not torch.cuda.is_available() or not HAS_TRITON, reason="needs a CUDA GPU and Triton")


@pytest.mark.slow
@interpreted
def test_matmul_and_row_mean_rows_are_invariant_in_the_interpreter():
    script = textwrap.dedent("""
        import torch
        from test_invariant_kernels import check_matmul, check_row_mean, check_rms_norm, check_rope
        check_matmul("cpu", torch.float32)
        check_row_mean("cpu", torch.float32)
        check_rms_norm("cpu", torch.float32)
        check_rope("cpu", torch.float32)
        print("ok")
    """)
    assert "ok" in run_interpreted(script)


@pytest.mark.slow
@interpreted
def test_prefill_equals_paged_decode_in_the_interpreter():
    # (kv_heads, group, head_dim): GQA groups 1, 2 and 4, head_dim 64 and 32
    script = textwrap.dedent("""
        import torch
        from test_invariant_kernels import check_attention, check_backward
        check_attention("cpu", torch.float32, [(2, 1, 32), (1, 2, 64), (1, 4, 32)])
        check_backward("cpu")
        print("ok")
    """)
    assert "ok" in run_interpreted(script)


@on_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_kernels_are_invariant(dtype):
    check_matmul("cuda", dtype)
    check_row_mean("cuda", dtype)
    check_rms_norm("cuda", dtype)
    check_rope("cuda", dtype)
    # Qwen2.5 shapes among them (head_dim 64 and 128, groups 7 and 6), a group over 16 (two chunks), head_dim 80
    check_attention("cuda", dtype, [(2, 1, 32), (1, 2, 64), (2, 4, 32), (2, 7, 64), (2, 6, 128), (1, 20, 80)])


@on_cuda
def test_cuda_backward():
    check_backward("cuda")


def test_split_k_is_set_by_the_weight_alone():
    # Qwen2.5-0.5B: down_proj cut in 4, the rest whole; Qwen2.5-3B's down_proj and o_proj in 2
    assert [matmul_splits(n, k) for n, k in ((896, 4864), (896, 896), (1152, 896), (9728, 896), (151936, 896))] \
        == [4, 1, 1, 1, 1]
    assert [matmul_splits(n, k) for n, k in ((2048, 11008), (2048, 2048), (22016, 2048))] == [2, 2, 1]
    assert matmul_splits(128, 1 << 20) == 32  # at most SPLIT_TILES programs a tile of rows


def test_block_size_divides_every_paged_block_size():
    from rollout_lab.engine.kernels.paged import BLOCK_SIZES
    assert all(size % INVARIANT_BLOCK_N == 0 for size in BLOCK_SIZES)


def test_bad_inputs_are_named_before_any_launch(monkeypatch):
    a, b = torch.zeros(4, 8), torch.zeros(8, 3)
    with pytest.raises(ValueError, match=r"a \[M, K\] and b \[K, N\], got \(4, 8, 1\)"):
        invariant_matmul(a[..., None], b)
    with pytest.raises(ValueError, match="K=8 but b .* has K=7; they must match"):
        invariant_matmul(a, torch.zeros(7, 3))
    with pytest.raises(ValueError, match=r"bias \(4,\) must be \[N\] = \[3\]"):
        invariant_matmul(a, b, torch.zeros(4))
    with pytest.raises(ValueError, match=r"a has dtype torch.int64; the invariant kernels take \(torch.float32"):
        invariant_matmul(a.long(), b)
    with pytest.raises(ValueError, match="b has dtype torch.float16, expected torch.float32"):
        invariant_matmul(a, b.half())
    with pytest.raises(ValueError, match=r"b \[B, K, N\], got \(1, 4, 8\) and \(8, 3\)"):
        invariant_bmm(a[None], b)
    with pytest.raises(ValueError, match="the same B and K"):
        invariant_bmm(a[None], b[None].expand(2, -1, -1))
    with pytest.raises(ValueError, match=r"N >= 1, got \(4, 0\)"):
        invariant_row_mean(a[:, :0])
    with pytest.raises(ValueError, match="x has dtype torch.int32"):
        invariant_row_mean(a.int())
    with pytest.raises(ValueError, match=r"x \[..., N\] \(N >= 1\) and weight \[N\], got \(4, 8\) and \(7,\)"):
        invariant_rms_norm(a, torch.ones(7), 1e-6)
    q = torch.zeros(1, 2, 3, 8)
    with pytest.raises(ValueError, match=r"invariant_rope takes q \[B, H, T, D\].*got \(1, 2, 3, 8\) torch.float32"):
        invariant_rope(q, q, torch.zeros(1, 3, 8, dtype=torch.float64), torch.zeros(1, 3, 8, dtype=torch.float64))

    query, key, starts = torch.zeros(2, 4, 3, 16), torch.zeros(2, 2, 5, 16), torch.zeros(2, dtype=torch.long)
    with pytest.raises(ValueError, match=r"query \[B, H, q, D\] and key, value \[B, KVH, S, D\], got \(4, 3, 16\)"):
        invariant_attention(query[0], key, key, starts, 1.0)
    with pytest.raises(ValueError, match="4 query heads are not a multiple of 3 KV heads"):
        invariant_attention(query, torch.zeros(2, 3, 5, 16), torch.zeros(2, 3, 5, 16), starts, 1.0)
    with pytest.raises(ValueError, match="head_dim in 1..256, got 272"):
        big = torch.zeros(2, 2, 5, 272)
        invariant_attention(torch.zeros(2, 4, 3, 272), big, big, starts, 1.0)
    with pytest.raises(ValueError, match="does not match query"):
        invariant_attention(query, key[..., :8], key[..., :8], starts, 1.0)
    with pytest.raises(ValueError, match="query has dtype torch.float64"):
        invariant_attention(query.double(), key.double(), key.double(), starts, 1.0)
    with pytest.raises(ValueError, match=r"starts must be an integer \[B\] = \[2\] tensor, got torch.float32"):
        invariant_attention(query, key, key, starts.float(), 1.0)
    with pytest.raises(ValueError, match="7 queries but only 5 key columns"):
        invariant_attention(torch.zeros(2, 4, 7, 16), key, key, starts, 1.0)

    pool, tables = torch.zeros(4, 16, 2, 16), torch.zeros(2, 3, dtype=torch.int32)
    positions = torch.zeros(2, dtype=torch.long)
    decode = query[:, :, :1]
    with pytest.raises(ValueError, match=r"query \[rows, H, 1, D\], got \(2, 4, 3, 16\)"):
        invariant_paged_attention(query, pool, pool, tables, positions, 1.0)
    with pytest.raises(ValueError, match="block size in .* got 24"):
        invariant_paged_attention(decode, torch.zeros(4, 24, 2, 16), torch.zeros(4, 24, 2, 16), tables, positions, 1.0)
    with pytest.raises(ValueError, match="4 query heads are not a multiple of 3 KV heads"):
        invariant_paged_attention(decode, torch.zeros(4, 16, 3, 16), torch.zeros(4, 16, 3, 16), tables, positions, 1.0)
    with pytest.raises(ValueError, match="head_dim in 1..256, got 512"):
        big = torch.zeros(4, 16, 2, 512)
        invariant_paged_attention(torch.zeros(2, 4, 1, 512), big, big, tables, positions, 1.0)
    with pytest.raises(ValueError, match="key_pool has dtype torch.bfloat16, expected torch.float32"):
        invariant_paged_attention(decode, pool.bfloat16(), pool.bfloat16(), tables, positions, 1.0)
    with pytest.raises(ValueError, match="block_tables has 1 rows of 3 blocks for 2 rows"):
        invariant_paged_attention(decode, pool, pool, tables[:1], positions, 1.0)
    with pytest.raises(ValueError, match=r"positions must be an integer \[>= 2\] tensor, got torch.float32 \(2,\)"):
        invariant_paged_attention(decode, pool, pool, tables, positions.float(), 1.0)

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # a CPU tensor outside the interpreter
    if not torch.cuda.is_available():
        for call in (lambda: invariant_matmul(a, b), lambda: invariant_row_mean(a),
                     lambda: invariant_attention(query, key, key, starts, 1.0),
                     lambda: invariant_paged_attention(decode, pool, pool, tables, positions, 1.0)):
            with pytest.raises(ValueError, match="invariant kernels need CUDA, or TRITON_INTERPRET=1 on CPU; "
                                                 "got a cpu tensor"):
                call()
