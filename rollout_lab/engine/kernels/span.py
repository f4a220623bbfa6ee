"""Decode attention over each row's live span: a split-K Triton kernel, and its torch reference.

In the aligned cache (``engine.kv.aligned``) row ``i`` holds its tokens at the contiguous columns
``[start_i, front]`` (the prompt, what it generated, and the token written this step); everything
else in its slot is masked. A masked SDPA over the window reads every row × every column of the
window, so a step costs slots × capacity whatever the rows hold. This kernel reads only
``[start_i, front]``, so a step costs Σ live tokens:

- one program per (row, KV head, split): the row's span is cut into ``num_splits`` parts of whole
  ``BLOCK_N`` blocks, and a program runs an online softmax over its part for all ``group`` query
  heads that share the KV head (GQA without repeating the cache), writing its max, sum and
  unnormalised output. It computes in fp32: half-precision inputs are upcast and multiplied as TF32,
  which holds bf16 and fp16 values exactly (fp32 inputs use IEEE products);
- a second kernel merges the splits of each (row, KV head).

``starts`` and ``front`` are device tensors read inside the kernels, and the grid depends only on
the shapes, so the launch can be captured in a CUDA graph and replayed while the spans move. It is a
``torch.library`` custom op, so ``torch.compile`` treats it as one opaque call.

    out = span_attention(query, key, value, starts, front, scale)   # [rows, 1, heads, head_dim]

``query`` is ``[rows, heads, 1, head_dim]``, ``key``/``value`` ``[rows, kv_heads, width, head_dim]``
(views of the cache are fine), ``starts`` ``[>= rows]`` int32 and ``front`` ``[1]`` int64 with
``front < width``; a start past the front means "only the front column" (a dead slot). The kernel
runs on CUDA, and on CPU tensors under ``TRITON_INTERPRET=1`` (how the CPU tests check it);
``span_attention_reference`` is the same computation in torch, for any device.

"""
from __future__ import annotations

import torch

from rollout_lab.engine.kernels.available import kernel_available, tl, triton

BLOCK_N = 64  # key columns per inner step
MAX_SPLITS = 32
OP_NAME = "rollout_lab::span_attention"


def num_splits(rows: int, kv_heads: int, width: int, device: torch.device | str) -> int:
    """Splits per (row, KV head): enough programs to fill the GPU about four times over, and no more
    than the window has blocks (each split must be able to hold one)."""
    device = torch.device(device)
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
    wanted = -(-4 * sms // max(1, rows * kv_heads))
    return max(1, min(wanted, MAX_SPLITS, -(-width // BLOCK_N)))


def span_attention_reference(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, starts: torch.Tensor,
    front: torch.Tensor, scale: float,
) -> torch.Tensor:
    """Torch reference: softmax attention of each row's query over its columns ``[start, front]``."""
    rows, heads, _, head_dim = query.shape
    kv_heads, width = key.shape[1], key.shape[2]
    group = heads // kv_heads
    front_col = int(front.reshape(-1)[0])
    start = torch.clamp(starts[:rows].to(torch.long), max=front_col)  # [rows]
    cols = torch.arange(width, device=query.device)
    live = (cols[None, :] >= start[:, None]) & (cols[None, :] <= front_col)  # [rows, width]
    q = query.reshape(rows, kv_heads, group, head_dim).float()
    scores = torch.einsum("bhgd,bhnd->bhgn", q, key.float()) * scale  # [rows, kv_heads, group, width]
    scores = scores.masked_fill(~live[:, None, None, :], float("-inf"))
    out = torch.einsum("bhgn,bhnd->bhgd", scores.softmax(-1), value.float())
    return out.reshape(rows, 1, heads, head_dim).to(query.dtype)


if triton is not None:

    @triton.jit
    def _store_split(M, L, Acc, Out, stride_ob, stride_oh, m, s, acc, pid, split, row, head,
                     GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, SPLITS: tl.constexpr):
        """A split's max, sum and unnormalised output into the partial buffers; with one split, the
        output itself (``acc / s``, the bits ``_span_merge`` would make of one split: its weight is
        exp(0) = 1), so no merge runs."""
        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, HEAD_DIM)
        real = g < GROUP  # the padded group members' partials are never read: not written either
        if SPLITS == 1:
            o_ptrs = Out + row * stride_ob + (head * GROUP + g)[:, None] * stride_oh + d[None, :]
            tl.store(o_ptrs, (acc / s[:, None]).to(Out.dtype.element_ty), mask=real[:, None])
        else:
            out = (pid * SPLITS + split) * GROUP_PAD + g  # [GROUP_PAD] rows of the partial buffers
            tl.store(M + out, m, mask=real)
            tl.store(L + out, s, mask=real)
            tl.store(Acc + out[:, None] * HEAD_DIM + d[None, :], acc, mask=real[:, None])

    @triton.jit
    def _span_partial(
        Q, K, V, Starts, Front, M, L, Acc, Out,
        stride_qb, stride_qh, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
        stride_ob, stride_oh, scale,
        KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, SPLITS: tl.constexpr, PRECISION: tl.constexpr,
    ):
        pid = tl.program_id(0)  # row * KV_HEADS + kv head
        split = tl.program_id(1)
        row = pid // KV_HEADS
        head = pid % KV_HEADS
        front = tl.load(Front).to(tl.int32)
        start = tl.minimum(tl.load(Starts + row).to(tl.int32), front)
        end = front + 1
        part = tl.cdiv(tl.cdiv(end - start, SPLITS), BLOCK) * BLOCK
        lo = start + split * part
        hi = tl.minimum(lo + part, end)

        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, HEAD_DIM)
        q_ptrs = Q + row * stride_qb + (head * GROUP + g)[:, None] * stride_qh + d[None, :]
        q = tl.load(q_ptrs, mask=g[:, None] < GROUP, other=0.0).to(tl.float32)  # [GROUP_PAD, HEAD_DIM]
        m = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
        s = tl.zeros([GROUP_PAD], dtype=tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], dtype=tl.float32)
        k_base = K + row * stride_kb + head * stride_kh
        v_base = V + row * stride_vb + head * stride_vh
        for col in range(lo, hi, BLOCK):
            n = col + tl.arange(0, BLOCK)
            live = n < hi
            k = tl.load(k_base + n[:, None] * stride_kn + d[None, :], mask=live[:, None], other=0.0).to(tl.float32)
            qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [GROUP_PAD, BLOCK]
            qk = tl.where(live[None, :], qk, float("-inf"))
            m_new = tl.maximum(m, tl.max(qk, 1))
            p = tl.exp(qk - m_new[:, None])
            alpha = tl.exp(m - m_new)
            v = tl.load(v_base + n[:, None] * stride_vn + d[None, :], mask=live[:, None], other=0.0).to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
            s = s * alpha + tl.sum(p, 1)
            m = m_new
        _store_split(M, L, Acc, Out, stride_ob, stride_oh, m, s, acc, pid, split, row, head,
                     GROUP, GROUP_PAD, HEAD_DIM, SPLITS)

    @triton.jit
    def _span_merge(
        M, L, Acc, Out, stride_ob, stride_oh,
        KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr, SPLITS: tl.constexpr,
    ):
        pid = tl.program_id(0)
        row = pid // KV_HEADS
        head = pid % KV_HEADS
        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, HEAD_DIM)
        real = g < GROUP  # only the real group members' partials were written (and are read)
        top = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
        for split in tl.static_range(SPLITS):
            top = tl.maximum(top, tl.load(M + (pid * SPLITS + split) * GROUP_PAD + g, mask=real, other=0.0))
        total = tl.zeros([GROUP_PAD], dtype=tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], dtype=tl.float32)
        for split in tl.static_range(SPLITS):
            part = (pid * SPLITS + split) * GROUP_PAD + g
            weight = tl.exp(tl.load(M + part, mask=real, other=0.0) - top)  # an empty split has max -inf: weight 0
            total += weight * tl.load(L + part, mask=real, other=1.0)
            partial = tl.load(Acc + part[:, None] * HEAD_DIM + d[None, :], mask=real[:, None], other=0.0)
            acc += weight[:, None] * partial
        out = acc / total[:, None]
        o_ptrs = Out + row * stride_ob + (head * GROUP + g)[:, None] * stride_oh + d[None, :]
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=real[:, None])


def _check(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, starts: torch.Tensor) -> None:
    rows, heads, q_len, head_dim = query.shape
    if q_len != 1:
        raise ValueError(f"span attention is for one decode token per row, got {q_len}")
    if key.shape != value.shape or key.shape[0] != rows or key.shape[-1] != head_dim:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} do not match query {tuple(query.shape)}")
    if heads % key.shape[1]:
        raise ValueError(f"{heads} query heads are not a multiple of {key.shape[1]} KV heads")
    if head_dim & (head_dim - 1) or head_dim < 16:
        raise ValueError(f"the span kernel needs a power-of-two head_dim >= 16, got {head_dim}")
    if starts.shape[0] < rows:
        raise ValueError(f"starts has {starts.shape[0]} entries for {rows} rows")


def split_buffers(query: torch.Tensor, kv_heads: int, splits: int, group_pad: int):
    """The split-K kernels' fp32 partials (max, sum, unnormalised output, one per (row, KV head,
    split, padded group member); the kernels write and read only the real members', so a group of 2
    padded to 16 moves 2/16 of the bytes) and the output ``[rows, 1, heads, head_dim]``: (m, s, acc, out)."""
    rows, heads, _, head_dim = query.shape
    parts = rows * kv_heads * splits * group_pad
    m = torch.empty(parts, dtype=torch.float32, device=query.device)
    s = torch.empty(parts, dtype=torch.float32, device=query.device)
    acc = torch.empty(parts, head_dim, dtype=torch.float32, device=query.device)
    out = torch.empty(rows, 1, heads, head_dim, dtype=query.dtype, device=query.device)
    return m, s, acc, out


def merge_splits(m: torch.Tensor, s: torch.Tensor, acc: torch.Tensor, out: torch.Tensor, *, kv_heads: int,
                 group: int, group_pad: int, splits: int) -> torch.Tensor:
    """Combine the splits of each (row, KV head) into ``out`` (``_span_merge``); returns ``out``.
    The span and the paged kernels write the same partials, so they share this step. With one split
    the partial kernel wrote ``out`` itself (``_store_split``): nothing runs."""
    if splits == 1:
        return out
    rows, _, _, head_dim = out.shape
    _span_merge[(rows * kv_heads,)](
        m, s, acc, out, out.stride(0), out.stride(2),
        KV_HEADS=kv_heads, GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, SPLITS=splits,
        num_warps=4,
    )
    return out


@torch.library.custom_op(OP_NAME, mutates_args=())
def span_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, starts: torch.Tensor,
    front: torch.Tensor, scale: float,
) -> torch.Tensor:
    """Attention of each row's one query token over its live columns ``[start, front]``;
    [rows, 1, heads, head_dim], in ``query``'s dtype."""
    _check(query, key, value, starts)
    if not kernel_available(query.device):
        return span_attention_reference(query, key, value, starts, front, scale)
    rows, heads, _, head_dim = query.shape
    kv_heads, width = key.shape[1], key.shape[2]
    group = heads // kv_heads
    group_pad = max(16, triton.next_power_of_2(group))
    splits = num_splits(rows, kv_heads, width, query.device)
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        key, value = key.contiguous(), value.contiguous()
    query = query.contiguous()
    m, s, acc, out = split_buffers(query, kv_heads, splits, group_pad)
    precision = "ieee" if query.dtype == torch.float32 else "tf32"
    _span_partial[(rows * kv_heads, splits)](
        query, key, value, starts, front, m, s, acc, out,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2), out.stride(0), out.stride(2), scale,
        KV_HEADS=kv_heads, GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, BLOCK=BLOCK_N,
        SPLITS=splits, PRECISION=precision, num_warps=4,
    )
    return merge_splits(m, s, acc, out, kv_heads=kv_heads, group=group, group_pad=group_pad, splits=splits)


@span_attention.register_fake
def _(query, key, value, starts, front, scale):
    rows, heads, _, head_dim = query.shape
    return query.new_empty(rows, 1, heads, head_dim)
