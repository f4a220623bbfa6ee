"""Decode attention over a paged KV cache: a split-K Triton kernel, and its torch reference.

In a paged cache a layer's keys and values live in a pool of fixed-size blocks,
``[num_blocks, block_size, kv_heads, head_dim]``, and each row owns a list of blocks, its row of the
block table: row ``i``'s logical position ``p`` lives at ``pool[block_tables[i, p // block_size],
p % block_size]``. Row ``i`` attends to its logical positions ``[0, positions[i]]`` (inclusive: the
token at ``positions[i]`` was written this step). Block 0 is the scratch block that dead rows point
at; nothing in the kernel treats it specially. The kernel follows ``engine.kernels.span``:

- one program per (row, KV head, split): the row's live blocks ``[0, positions[i] // block_size]``
  are cut into ``num_splits`` contiguous ranges of whole blocks, and a program runs an online
  softmax over its range, one paged block (``block_size`` tokens) per step, for all ``group`` query
  heads that share the KV head (GQA without repeating the cache), writing its max, sum and
  unnormalised output. Half-precision caches go into the tensor cores as they are, with fp32
  accumulation and an fp32 softmax; the probabilities enter ``p @ v`` rounded to the cache's dtype,
  as flash attention does. fp32 inputs use IEEE products throughout. Half operands read the KV
  faster than both upcast to TF32, and ``num_warps=4, num_stages=2`` is best or close to it across
  the measured shapes (data/diagnostics/paged_kernel_h100_b24dedb.txt, from
  ``scripts/gpu/paged_kernel.py``, run by ``h200_paged.sh kernel``). Under
  Triton's CPU interpreter, whose bf16 products are wrong, half inputs are upcast to fp32 instead;
- the merge kernel of ``span_attention`` combines the splits of each (row, KV head); an empty split
  (past the row's last live block) has weight 0. With one split (enough rows fill the GPU: rows
  times KV heads at least four times its SMs, ``span.num_splits``) the partial kernel writes the
  output itself, the bits the merge would make, and no merge runs.

FP8 pools (``RolloutConfig(kv_cache_dtype="fp8")``: ``engine.kernels.kv_fp8``'s uint8 layout of e4m3
values and a scale per token and KV head) are read as they are stored, each tile dequantized to the
query's dtype in registers (``FP8``): the step reads half the KV bytes.

``positions`` and ``block_tables`` are device tensors read inside the kernels, and the grid depends
only on the shapes (rows, KV heads, blocks per row), so the launch can be captured in a CUDA graph
and replayed while the positions grow and the tables change. It is a ``torch.library`` custom op, so
``torch.compile`` treats it as one opaque call.

    out = paged_attention(query, key_pool, value_pool, block_tables, positions, scale)   # [rows, 1, heads, head_dim]

``query`` is ``[rows, heads, 1, head_dim]``, ``key_pool``/``value_pool``
``[num_blocks, block_size, kv_heads, head_dim]`` (one layer's pool, last dimension contiguous;
``block_size`` a power of two in 16..128), ``block_tables`` ``[>= rows, max_blocks]`` int32 and
``positions`` ``[>= rows]`` int64 with ``positions[i] < max_blocks * block_size``. The kernel runs on
CUDA, and on CPU tensors under ``TRITON_INTERPRET=1`` (how the CPU tests check it);
``paged_attention_reference`` is the same computation in torch, for any device.

"""
from __future__ import annotations

import torch

from rollout_lab.engine.kernels import kv_fp8
from rollout_lab.engine.kernels.available import kernel_available, tl, triton
from rollout_lab.engine.kernels.kv_fp8 import is_fp8_pool
from rollout_lab.engine.kernels.span import BLOCK_N, merge_splits, num_splits, split_buffers

BLOCK_SIZES = (16, 32, 64, 128)  # tokens per paged block the kernel supports
OP_NAME = "rollout_lab::paged_attention"


def paged_splits(rows: int, kv_heads: int, max_blocks: int, device: torch.device | str) -> int:
    """Splits per (row, KV head): ``num_splits``'s rule (fill the GPU about four times over, at most
    ``MAX_SPLITS``), and no more than a row has blocks (each split must be able to hold one)."""
    return num_splits(rows, kv_heads, max_blocks * BLOCK_N, device)  # its cap is then max_blocks


def paged_attention_reference(
    query: torch.Tensor, key_pool: torch.Tensor, value_pool: torch.Tensor, block_tables: torch.Tensor,
    positions: torch.Tensor, scale: float,
) -> torch.Tensor:
    """Torch reference: gathers each row's blocks and runs softmax attention of its query over its
    logical positions ``[0, positions[i]]``."""
    rows, heads, _, head_dim = query.shape
    block_size, kv_heads = key_pool.shape[1], key_pool.shape[2]
    group = heads // kv_heads
    table = block_tables[:rows].to(torch.long)  # [rows, max_blocks]
    width = table.shape[1] * block_size
    key = key_pool[table].reshape(rows, width, kv_heads, head_dim).float()
    value = value_pool[table].reshape(rows, width, kv_heads, head_dim).float()
    cols = torch.arange(width, device=query.device)
    live = cols[None, :] <= positions[:rows].to(torch.long)[:, None]  # [rows, width]
    q = query.reshape(rows, kv_heads, group, head_dim).float()
    scores = torch.einsum("bhgd,bnhd->bhgn", q, key) * scale  # [rows, kv_heads, group, width]
    scores = scores.masked_fill(~live[:, None, None, :], float("-inf"))
    out = torch.einsum("bhgn,bnhd->bhgd", scores.softmax(-1), value)
    return out.reshape(rows, 1, heads, head_dim).to(query.dtype)


if triton is not None:
    from rollout_lab.engine.kernels.span import _store_split

    @triton.jit
    def _paged_blocks(
        q, k_head, v_head, table, stride_kb, stride_vb, stride_tn, lo, hi, end, scale,
        GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, PRECISION: tl.constexpr,
        NATIVE_QK: tl.constexpr, NATIVE_PV: tl.constexpr, ks_head, vs_head, stride_sb, FP8: tl.constexpr,
    ):
        """The online softmax of one row's ``q`` (its ``GROUP_PAD`` query heads of one KV head) over its
        table's blocks ``[lo, hi)`` whose logical positions are ``< end``: (max, sum, unnormalised
        output). ``k_head``/``v_head`` point at the KV head's ``[BLOCK_SIZE, HEAD_DIM]`` tile of block 0;
        ``engine.kernels.shared_prefix`` runs the same loop over a row's suffix. ``FP8``: the tiles are
        e4m3 (``engine.kernels.kv_fp8``), each token's row times its scale at ``ks_head``/``vs_head``
        ``[BLOCK_SIZE]`` (block stride ``stride_sb``), dequantized to ``q``'s dtype as it is read."""
        t = tl.arange(0, BLOCK_SIZE)
        m = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
        s = tl.zeros([GROUP_PAD], dtype=tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], dtype=tl.float32)
        for block in range(lo, hi):
            phys = tl.load(table + block * stride_tn).to(tl.int64)  # int64: a big pool's offsets
            live = block * BLOCK_SIZE + t < end  # only the row's last block is partly live
            k = tl.load(k_head + phys * stride_kb, mask=live[:, None], other=0.0)
            if FP8:
                k_scale = tl.load(ks_head + phys * stride_sb, mask=live, other=0.0)
                k = (k.to(tl.float32) * k_scale[:, None]).to(q.dtype)
            if NATIVE_QK:  # the cache's dtype into the tensor cores, fp32 accumulation
                qk = tl.dot(q, tl.trans(k)) * scale  # [GROUP_PAD, BLOCK_SIZE]
            else:
                qk = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision=PRECISION) * scale
            qk = tl.where(live[None, :], qk, float("-inf"))
            m_new = tl.maximum(m, tl.max(qk, 1))
            p = tl.exp(qk - m_new[:, None])
            alpha = tl.exp(m - m_new)
            v = tl.load(v_head + phys * stride_vb, mask=live[:, None], other=0.0)
            if FP8:
                v_scale = tl.load(vs_head + phys * stride_sb, mask=live, other=0.0)
                v = (v.to(tl.float32) * v_scale[:, None]).to(q.dtype)
            if NATIVE_PV:  # the probabilities rounded to the cache's dtype, as flash attention does
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            else:
                acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision=PRECISION)
            s = s * alpha + tl.sum(p, 1)
            m = m_new
        return m, s, acc

    @triton.jit
    def _paged_partial(
        Q, K, V, KS, VS, Tables, Positions, M, L, Acc, Out,
        stride_qb, stride_qh, stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh,
        stride_sb, stride_sn, stride_sh,
        stride_tb, stride_tn, stride_p, stride_ob, stride_oh, max_blocks, scale,
        KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, SPLITS: tl.constexpr, PRECISION: tl.constexpr,
        NATIVE_QK: tl.constexpr = False, NATIVE_PV: tl.constexpr = False, FP8: tl.constexpr = False,
    ):
        pid = tl.program_id(0)  # row * KV_HEADS + kv head
        split = tl.program_id(1)
        row = pid // KV_HEADS
        head = pid % KV_HEADS
        end = tl.load(Positions + row * stride_p).to(tl.int32) + 1  # logical positions [0, end)
        blocks = tl.minimum(tl.cdiv(end, BLOCK_SIZE), max_blocks)  # never read past the table's row
        part = tl.cdiv(blocks, SPLITS)
        lo = split * part
        hi = tl.minimum(lo + part, blocks)

        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, HEAD_DIM)
        t = tl.arange(0, BLOCK_SIZE)
        q_ptrs = Q + row * stride_qb + (head * GROUP + g)[:, None] * stride_qh + d[None, :]
        q = tl.load(q_ptrs, mask=g[:, None] < GROUP, other=0.0)  # [GROUP_PAD, HEAD_DIM]
        if not NATIVE_QK:
            q = q.to(tl.float32)
        k_head = K + head * stride_kh + t[:, None] * stride_kn + d[None, :]  # [BLOCK_SIZE, HEAD_DIM]
        v_head = V + head * stride_vh + t[:, None] * stride_vn + d[None, :]
        ks_head = KS + head * stride_sh + t * stride_sn  # [BLOCK_SIZE] scales (FP8 pools only)
        vs_head = VS + head * stride_sh + t * stride_sn
        m, s, acc = _paged_blocks(q, k_head, v_head, Tables + row * stride_tb, stride_kb, stride_vb, stride_tn,
                                  lo, hi, end, scale, GROUP_PAD, HEAD_DIM, BLOCK_SIZE, PRECISION,
                                  NATIVE_QK, NATIVE_PV, ks_head, vs_head, stride_sb, FP8)
        _store_split(M, L, Acc, Out, stride_ob, stride_oh, m, s, acc, pid, split, row, head,
                     GROUP, GROUP_PAD, HEAD_DIM, SPLITS)


def check_block_tables(block_tables: torch.Tensor, rows: int) -> None:
    """ValueError unless ``block_tables`` is an integer [>= rows, >= 1] tensor: the block table every
    paged decode kernel (this one, ``invariant_paged_attention``) reads."""
    if block_tables.dim() != 2 or block_tables.dtype.is_floating_point or block_tables.dtype == torch.bool:
        raise ValueError(f"block_tables must be an integer [rows, max_blocks] tensor, got "
                         f"{block_tables.dtype} {tuple(block_tables.shape)}")
    if block_tables.shape[0] < rows or block_tables.shape[1] < 1:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows of {block_tables.shape[1]} blocks "
                         f"for {rows} rows")


def _check(
    query: torch.Tensor, key_pool: torch.Tensor, value_pool: torch.Tensor, block_tables: torch.Tensor,
    positions: torch.Tensor,
) -> None:
    rows, heads, q_len, head_dim = query.shape
    if q_len != 1:
        raise ValueError(f"paged attention is for one decode token per row, got {q_len}")
    if key_pool.dim() != 4 or key_pool.shape != value_pool.shape:
        raise ValueError(f"key_pool {tuple(key_pool.shape)} and value_pool {tuple(value_pool.shape)} must both be "
                         "[num_blocks, block_size, kv_heads, head_dim]")
    if key_pool.shape[-1] != head_dim:
        raise ValueError(f"the pools' head_dim {key_pool.shape[-1]} does not match query {tuple(query.shape)}")
    if heads % key_pool.shape[2]:
        raise ValueError(f"{heads} query heads are not a multiple of {key_pool.shape[2]} KV heads")
    if head_dim & (head_dim - 1) or head_dim < 16:
        raise ValueError(f"the paged kernel needs a power-of-two head_dim >= 16, got {head_dim}")
    if key_pool.shape[1] not in BLOCK_SIZES:
        raise ValueError(f"the paged kernel needs a block size in {BLOCK_SIZES}, got {key_pool.shape[1]}")
    check_block_tables(block_tables, rows)
    if positions.dim() != 1 or positions.shape[0] < rows:
        raise ValueError(f"positions has {positions.shape[0] if positions.dim() else 0} entries for {rows} rows")


@torch.library.custom_op(OP_NAME, mutates_args=())
def paged_attention(
    query: torch.Tensor, key_pool: torch.Tensor, value_pool: torch.Tensor, block_tables: torch.Tensor,
    positions: torch.Tensor, scale: float,
) -> torch.Tensor:
    """Attention of each row's one query token over its paged positions ``[0, positions[i]]``;
    [rows, 1, heads, head_dim], in ``query``'s dtype. FP8 pools (uint8, ``engine.kernels.kv_fp8``)
    are dequantized as they are read."""
    fp8 = is_fp8_pool(key_pool)
    if fp8 != is_fp8_pool(value_pool):
        raise ValueError(f"key_pool is {key_pool.dtype} and value_pool {value_pool.dtype}: both FP8 (uint8) or neither")
    if fp8:
        (key_pool, key_scales), (value_pool, value_scales) = kv_fp8.split(key_pool), kv_fp8.split(value_pool)
    _check(query, key_pool, value_pool, block_tables, positions)
    if not kernel_available(query.device):
        if fp8:
            key_pool = kv_fp8.dequantize(key_pool, key_scales, query.dtype)
            value_pool = kv_fp8.dequantize(value_pool, value_scales, query.dtype)
        return paged_attention_reference(query, key_pool, value_pool, block_tables, positions, scale)
    rows, heads, _, head_dim = query.shape
    block_size, kv_heads = key_pool.shape[1], key_pool.shape[2]
    max_blocks = block_tables.shape[1]
    group = heads // kv_heads
    group_pad = max(16, triton.next_power_of_2(group))
    splits = paged_splits(rows, kv_heads, max_blocks, query.device)
    if key_pool.stride(-1) != 1 or value_pool.stride(-1) != 1:  # a copy of the pool: avoid on the hot path
        key_pool, value_pool = key_pool.contiguous(), value_pool.contiguous()
    if not fp8:  # not read
        key_scales = value_scales = key_pool[:, :, :, 0]
    if key_scales.stride() != value_scales.stride():
        raise ValueError("the key and value pools' scales must share a layout")
    query = query.contiguous()
    m, s, acc, out = split_buffers(query, kv_heads, splits, group_pad)
    # half precision into the tensor cores (module docstring); Triton's interpreter multiplies bf16
    # wrongly, so on the CPU the kernel upcasts, and the native dots are checked on a GPU
    native = query.dtype in (torch.bfloat16, torch.float16) and query.device.type == "cuda"
    _paged_partial[(rows * kv_heads, splits)](
        query, key_pool, value_pool, key_scales, value_scales, block_tables, positions, m, s, acc, out,
        query.stride(0), query.stride(1),
        key_pool.stride(0), key_pool.stride(1), key_pool.stride(2),
        value_pool.stride(0), value_pool.stride(1), value_pool.stride(2),
        key_scales.stride(0), key_scales.stride(1), key_scales.stride(2),
        block_tables.stride(0), block_tables.stride(1), positions.stride(0), out.stride(0), out.stride(2),
        max_blocks, scale,
        KV_HEADS=kv_heads, GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        SPLITS=splits, PRECISION="ieee", NATIVE_QK=native, NATIVE_PV=native, FP8=fp8, num_warps=4, num_stages=2,
    )
    return merge_splits(m, s, acc, out, kv_heads=kv_heads, group=group, group_pad=group_pad, splits=splits)


@paged_attention.register_fake
def _(query, key_pool, value_pool, block_tables, positions, scale):
    rows, heads, _, head_dim = query.shape
    return query.new_empty(rows, 1, heads, head_dim)
