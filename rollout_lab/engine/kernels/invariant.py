"""Batch-invariant Triton kernels: a row's output bits do not depend on the rest of the call.

A row's bits must not change with how many other rows share the call, what they hold, where the row
sits in the batch (hence in a tile) or how it is padded. Library kernels break this by choosing
tiles, split-K and reduction trees from the shapes; every kernel here has ONE configuration for all
shapes, walks its reduction in one fixed order and accumulates in fp32:

- ``invariant_matmul`` / ``invariant_bmm``: one tile config whatever M (no autotune), K walked in
  order, bias added to the fp32 accumulator at the end. A long K over few output columns (a
  down-projection) is cut into ``matmul_splits(N, K)`` ranges, a count set by the weight's shape
  alone (never by M), each range's fp32 sum written apart and the ranges then added in order: a
  small-M decode step then reads the weight with several programs per column tile instead of one;
- ``invariant_row_mean``: one program per row, fixed strips over N, then ``tl.sum``;
- ``invariant_rms_norm``: an RMSNorm (Llama's, Qwen's) in one kernel, the sum of squares taken as
  ``invariant_row_mean`` takes its sum; the eager norm is eight kernels (fp32 copy, square, mean,
  add, rsqrt, scale, cast, weight), a share of a small decode step paid launch by launch;
- ``invariant_rope``: rotary embedding of the queries and keys (HF's ``apply_rotary_pos_emb``) in
  one kernel each, with eager's roundings (each product, then the sum, in the inputs' dtype);
  element-wise, so invariant however it is launched: it replaces ten eager kernels a layer;
- ``invariant_attention`` (a prefill or teacher-forced forward, causal, left padding) and
  ``invariant_paged_attention`` (decode over the paged pool): the same query vector over the same
  keys gives the same bits in both, by construction. Both walk keys in blocks of
  ``INVARIANT_BLOCK_N`` logical positions aligned at the row's position 0, and both call one shared
  inner step (``_attend_block``: scores by ``tl.dot``, mask, online-softmax update, ``p @ v``) on
  the same tile shapes (16 query rows: 16 query positions of one head in a prefill, the GQA group of
  query heads padded to 16 in a decode; 16 keys; head_dim padded to a power of two), with the same
  precision flags, warps and final division. A block with no live key for a query row leaves that
  row's state untouched (``tl.where``), so a prefill tile that walks past a row's last block and a
  decode that stops at it agree.

Half-precision inputs go into the tensor cores as they are (fp32 accumulation, the probabilities
rounded to the value dtype before ``p @ v``, as ``engine.kernels.paged`` does); fp32 inputs use IEEE
products. Under Triton's CPU interpreter (``TRITON_INTERPRET=1``, how the CPU tests run them) half
inputs are upcast to fp32 (its half products are wrong), and products are summed per output element
instead of ``tl.dot`` (numpy's matmul, which rounds a row by its index in the tile): the CPU tests
check the blocking, masking and softmax; the GPU tests check ``tl.dot``'s bits. The attention's backward
recomputes plain masked attention in torch (the trainer's backward may use any kernel).

    out = invariant_matmul(a, b, bias)                                     # [M, N]
    out = invariant_rms_norm(x, weight, eps)                                # [..., N]
    q, k = invariant_rope(q, k, cos, sin)                                   # as apply_rotary_pos_emb
    out = invariant_attention(query, key, value, starts, scale)            # [B, q, H, D]
    out = invariant_paged_attention(query, key_pool, value_pool, tables, positions, scale)  # [rows, 1, H, D]

"""
from __future__ import annotations

import torch

from rollout_lab.engine.kernels.available import kernel_available, tl, triton
from rollout_lab.engine.kernels.paged import BLOCK_SIZES, check_block_tables

INVARIANT_BLOCK_N = 16  # keys per attention step; divides every paged block size (16..128)
BLOCK_ROWS = 16  # query rows of an attention tile: prefill positions of one head, or a GQA group's heads
MAX_HEAD_DIM = 256
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# One GEMM config for every M. 64 x 128 output tiles with 64-deep K steps keep the tensor cores busy
# in bf16 at M in the hundreds, while at small M (decode) the GEMM is bound by reading b, which a
# 64-row tile reads once for up to 64 rows; 3 stages of (64x64 + 64x128) operands take 72 KiB of
# shared memory in bf16 (144 KiB in fp32), within an H100's; 4 warps make one Hopper warpgroup.
# Chosen, not tuned: any fixed choice is invariant.
MATMUL_BLOCK_M, MATMUL_BLOCK_N, MATMUL_BLOCK_K = 64, 128, 64
MATMUL_WARPS, MATMUL_STAGES = 4, 3
# Split-K by the weight's shape (matmul_splits): K of at least SPLIT_MIN_K over fewer than
# SPLIT_TILES column tiles is cut into ranges of at least SPLIT_MIN_K // 2, so that one M tile keeps
# about SPLIT_TILES programs busy. Qwen2.5-0.5B's down_proj (N 896, K 4864): 4 ranges, 28 programs
# where one tile of rows had 7; its LM head and gate/up projections: none.
SPLIT_MIN_K, SPLIT_TILES = 2048, 32
ATTENTION_WARPS, ATTENTION_STAGES = 4, 2  # the same for both attention kernels: the reductions' layout
MEAN_BLOCK = 1024  # elements of a row summed per strip


if triton is not None:

    @triton.jit
    def _dot(a, b, PRECISION: tl.constexpr, NATIVE: tl.constexpr, SERIAL: tl.constexpr):
        """a @ b in fp32. NATIVE: half operands into the tensor cores. SERIAL (the CPU interpreter):
        products summed per output element, because the interpreter's ``tl.dot`` is numpy's matmul,
        whose BLAS kernel rounds a row differently by its index in the tile; a GPU's dot does not."""
        if NATIVE:
            out = tl.dot(a, b)
        elif SERIAL:
            out = tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], 1)
        else:
            out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=PRECISION)
        return out

    @triton.jit(do_not_specialize=["M"])  # one compiled kernel whatever M (its divisibility included)
    def _matmul(
        A, B, Bias, C, M, N, K, K_PER_SPLIT,
        stride_ab, stride_am, stride_ak, stride_bb, stride_bk, stride_bn, stride_cb, stride_cm, stride_cn,
        stride_cs, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        PRECISION: tl.constexpr, NATIVE: tl.constexpr, SERIAL: tl.constexpr,
    ):
        """C[batch] = A[batch] @ B[batch] over K's range ``split`` (axis 2 of the grid) of
        ``K_PER_SPLIT`` (a multiple of BLOCK_K): with one range C is the output (+ bias); with several
        it is the fp32 workspace, range ``split`` at ``stride_cs`` (``_sum_splits`` adds them)."""
        pid = tl.program_id(0)
        batch = tl.program_id(1).to(tl.int64)
        split = tl.program_id(2)
        tiles_m = tl.cdiv(M, BLOCK_M)
        pid_m = pid % tiles_m  # M fastest: neighbouring programs share b's [K, BLOCK_N] strip in L2
        pid_n = pid // tiles_m
        rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        rk = tl.arange(0, BLOCK_K)
        first = split * K_PER_SPLIT
        last = tl.minimum(first + K_PER_SPLIT, K)
        a_ptrs = A + batch * stride_ab + rm[:, None] * stride_am + (first + rk)[None, :] * stride_ak
        b_ptrs = B + batch * stride_bb + (first + rk)[:, None] * stride_bk + rn[None, :] * stride_bn
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(first, last, BLOCK_K):  # K in order, the same steps for every M
            a = tl.load(a_ptrs, mask=(rm[:, None] < M) & (k0 + rk[None, :] < last), other=0.0)
            b = tl.load(b_ptrs, mask=(k0 + rk[:, None] < last) & (rn[None, :] < N), other=0.0)
            acc += _dot(a, b, PRECISION, NATIVE, SERIAL)
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk
        if HAS_BIAS:
            acc += tl.load(Bias + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        c_ptrs = C + split * stride_cs + batch * stride_cb + rm[:, None] * stride_cm + rn[None, :] * stride_cn
        tl.store(c_ptrs, acc.to(C.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))

    @triton.jit
    def _sum_splits(W, Bias, C, total, N, stride_ws, SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr,
                    BLOCK: tl.constexpr):
        """C (flat, contiguous) = the SPLITS fp32 ranges of W added in order (+ bias), rounded once."""
        i = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
        live = i < total
        acc = tl.load(W + i, mask=live, other=0.0)
        for split in range(1, SPLITS):
            acc += tl.load(W + split * stride_ws + i, mask=live, other=0.0)
        if HAS_BIAS:
            acc += tl.load(Bias + i % N, mask=live, other=0.0).to(tl.float32)
        tl.store(C + i, acc.to(C.dtype.element_ty), mask=live)

    @triton.jit
    def _row_mean(X, Out, N, stride_x, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for n0 in range(0, N, BLOCK):  # strips in order, each lane summing its column of the strips
            acc += tl.load(X + row * stride_x + n0 + cols, mask=n0 + cols < N, other=0.0).to(tl.float32)
        tl.store(Out + row, (tl.sum(acc, 0) / N).to(Out.dtype.element_ty))

    @triton.jit
    def _rms_norm(X, W, Out, N, stride_x, stride_o, eps, BLOCK: tl.constexpr):
        """Llama's RMSNorm of one row: y = x * rsqrt(mean(x^2) + eps) rounded to x's dtype, then
        w * y rounded to the output's, as the eager module rounds them."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for n0 in range(0, N, BLOCK):  # strips in order, each lane summing its column of the strips
            x = tl.load(X + row * stride_x + n0 + cols, mask=n0 + cols < N, other=0.0).to(tl.float32)
            acc += x * x
        scale = 1.0 / tl.sqrt(tl.sum(acc, 0) / N + eps)
        for n0 in range(0, N, BLOCK):
            live = n0 + cols < N
            x = tl.load(X + row * stride_x + n0 + cols, mask=live, other=0.0)
            y = (x.to(tl.float32) * scale).to(x.dtype).to(tl.float32)
            w = tl.load(W + n0 + cols, mask=live, other=0.0).to(tl.float32)
            tl.store(Out + row * stride_o + n0 + cols, (w * y).to(Out.dtype.element_ty), mask=live)

    @triton.jit
    def _rope(X, Cos, Sin, Out, T, stride_xb, stride_xh, stride_xt, stride_cb, stride_ct, stride_ob, stride_oh,
              stride_ot, HALF: tl.constexpr, HALF_PAD: tl.constexpr, ROUND: tl.constexpr):
        """Program (b * T + t, head): out = x * cos + rotate_half(x) * sin over one head vector, each
        product rounded to x's dtype (ROUND: a half type) before the sum, as eager computes it."""
        bt = tl.program_id(0)
        head = tl.program_id(1).to(tl.int64)
        b = (bt // T).to(tl.int64)
        t = (bt % T).to(tl.int64)
        i = tl.arange(0, HALF_PAD)
        live = i < HALF
        x_at = X + b * stride_xb + head * stride_xh + t * stride_xt
        c_at = b * stride_cb + t * stride_ct
        x1 = tl.load(x_at + i, mask=live, other=0.0)
        x2 = tl.load(x_at + HALF + i, mask=live, other=0.0)
        cos1 = tl.load(Cos + c_at + i, mask=live, other=0.0).to(tl.float32)
        cos2 = tl.load(Cos + c_at + HALF + i, mask=live, other=0.0).to(tl.float32)
        sin1 = tl.load(Sin + c_at + i, mask=live, other=0.0).to(tl.float32)
        sin2 = tl.load(Sin + c_at + HALF + i, mask=live, other=0.0).to(tl.float32)
        a1 = x1.to(tl.float32) * cos1
        a2 = x2.to(tl.float32) * cos2
        b1 = -x2.to(tl.float32) * sin1  # rotate_half(x) = cat(-x2, x1)
        b2 = x1.to(tl.float32) * sin2
        if ROUND:
            a1, a2 = a1.to(x1.dtype).to(tl.float32), a2.to(x1.dtype).to(tl.float32)
            b1, b2 = b1.to(x1.dtype).to(tl.float32), b2.to(x1.dtype).to(tl.float32)
        o_at = Out + b * stride_ob + head * stride_oh + t * stride_ot
        tl.store(o_at + i, (a1 + b1).to(Out.dtype.element_ty), mask=live)
        tl.store(o_at + HALF + i, (a2 + b2).to(Out.dtype.element_ty), mask=live)

    @triton.jit
    def _attend_block(q, k, v, live, m, s, acc, scale,
                      PRECISION: tl.constexpr, NATIVE: tl.constexpr, SERIAL: tl.constexpr):
        """One block of keys for a tile of query rows: q [BLOCK_ROWS, D], k and v [INVARIANT_BLOCK_N, D]
        (masked keys loaded as 0), live [BLOCK_ROWS, INVARIANT_BLOCK_N]; the updated (max, sum,
        unnormalised output). A row with no live key in the block keeps its state bit for bit."""
        qk = _dot(q, tl.trans(k), PRECISION, NATIVE, SERIAL)  # [BLOCK_ROWS, INVARIANT_BLOCK_N]
        qk = tl.where(live, qk * scale, float("-inf"))
        block_max = tl.max(qk, 1)
        seen = block_max > float("-inf")  # the row has a live key in this block
        m_new = tl.where(seen, tl.maximum(m, block_max), m)
        m_use = tl.where(seen, m_new, 0.0)  # no -inf - -inf for the rows left as they are
        p = tl.exp(qk - m_use[:, None])  # masked keys: exp(-inf) = 0
        alpha = tl.exp(m - m_use)  # the first live block: exp(-inf) = 0
        if NATIVE:  # the probabilities rounded to v's dtype, as flash attention does
            p_v = p.to(v.dtype)
        else:
            p_v = p
        pv = _dot(p_v, v, PRECISION, NATIVE, SERIAL)
        acc = tl.where(seen[:, None], acc * alpha[:, None] + pv, acc)
        s = tl.where(seen, s * alpha + tl.sum(p, 1), s)
        return m_new, s, acc

    @triton.jit
    def _attend_finish(acc, s):
        """The output of a tile's rows; a row that saw no key (left padding) gets 0."""
        return acc / tl.where(s > 0, s, 1.0)[:, None]

    @triton.jit
    def _prefill(
        Q, K, V, Starts, Out,
        stride_qb, stride_qh, stride_qn, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,
        stride_vb, stride_vh, stride_vn, stride_vd, stride_ob, stride_on, stride_oh, stride_od, stride_s,
        q_len, S, scale,
        HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, NATIVE: tl.constexpr,
        SERIAL: tl.constexpr,
    ):
        pid = tl.program_id(0)  # batch row * HEADS + head
        tile = tl.program_id(1)  # BLOCK_M query positions
        b = (pid // HEADS).to(tl.int64)
        h = pid % HEADS
        kvh = h // GROUP
        start = tl.load(Starts + b * stride_s).to(tl.int32)  # the key column of logical position 0
        i = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        real = i < q_len
        pos = S - q_len + i - start  # [BLOCK_M] logical positions of the queries
        d = tl.arange(0, HEAD_DIM_PAD)
        dim = d[None, :] < HEAD_DIM
        t = tl.arange(0, BLOCK_N)
        q = tl.load(Q + b * stride_qb + h * stride_qh + i[:, None] * stride_qn + d[None, :] * stride_qd,
                    mask=real[:, None] & dim, other=0.0)
        if not NATIVE:
            q = q.to(tl.float32)
        k_base = K + b * stride_kb + kvh * stride_kh + d[None, :] * stride_kd
        v_base = V + b * stride_vb + kvh * stride_vh + d[None, :] * stride_vd
        m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        s = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
        last = S - 1 - start - tl.maximum(q_len - 1 - (tile * BLOCK_M + BLOCK_M - 1), 0)  # the tile's last position
        blocks = tl.where(last >= 0, last // BLOCK_N + 1, 0)
        for j in range(0, blocks):
            key_pos = j * BLOCK_N + t  # logical positions, block j aligned at the row's position 0
            col = start + key_pos
            inside = (col < S)[:, None] & dim
            k = tl.load(k_base + col[:, None] * stride_kn, mask=inside, other=0.0)
            v = tl.load(v_base + col[:, None] * stride_vn, mask=inside, other=0.0)
            live = (key_pos[None, :] <= pos[:, None]) & real[:, None]  # causal
            m, s, acc = _attend_block(q, k, v, live, m, s, acc, scale, PRECISION, NATIVE, SERIAL)
        out = _attend_finish(acc, s)
        o_ptrs = Out + b * stride_ob + i[:, None] * stride_on + h * stride_oh + d[None, :] * stride_od
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=real[:, None] & dim)

    @triton.jit
    def _paged_decode(
        Q, K, V, Tables, Positions, Out,
        stride_qb, stride_qh, stride_qd, stride_kb, stride_kn, stride_kh, stride_kd,
        stride_vb, stride_vn, stride_vh, stride_vd, stride_tb, stride_tn, stride_p, stride_ob, stride_oh, stride_od,
        max_blocks, scale,
        KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        PRECISION: tl.constexpr, NATIVE: tl.constexpr, SERIAL: tl.constexpr,
    ):
        pid = tl.program_id(0)  # row * KV_HEADS + KV head
        chunk = tl.program_id(1)  # BLOCK_M query heads of the group
        row = (pid // KV_HEADS).to(tl.int64)
        head = pid % KV_HEADS
        end = tl.load(Positions + row * stride_p).to(tl.int32) + 1  # logical positions [0, end)
        g = chunk * BLOCK_M + tl.arange(0, BLOCK_M)
        real = g < GROUP
        d = tl.arange(0, HEAD_DIM_PAD)
        dim = d[None, :] < HEAD_DIM
        t = tl.arange(0, BLOCK_N)
        qh = head * GROUP + g
        q = tl.load(Q + row * stride_qb + qh[:, None] * stride_qh + d[None, :] * stride_qd,
                    mask=real[:, None] & dim, other=0.0)
        if not NATIVE:
            q = q.to(tl.float32)
        k_base = K + head * stride_kh + d[None, :] * stride_kd
        v_base = V + head * stride_vh + d[None, :] * stride_vd
        table = Tables + row * stride_tb
        m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        s = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
        SUB = BLOCK_SIZE // BLOCK_N  # key blocks per paged block
        blocks = tl.minimum(tl.cdiv(end, BLOCK_N), max_blocks * SUB)  # never read past the table's row
        for j in range(0, blocks):
            phys = tl.load(table + (j // SUB) * stride_tn).to(tl.int64)  # int64: a big pool's offsets
            slot = (j % SUB) * BLOCK_N + t
            key_pos = j * BLOCK_N + t
            key_live = key_pos < end
            k = tl.load(k_base + phys * stride_kb + slot[:, None] * stride_kn, mask=key_live[:, None] & dim, other=0.0)
            v = tl.load(v_base + phys * stride_vb + slot[:, None] * stride_vn, mask=key_live[:, None] & dim, other=0.0)
            live = key_live[None, :] & real[:, None]
            m, s, acc = _attend_block(q, k, v, live, m, s, acc, scale, PRECISION, NATIVE, SERIAL)
        out = _attend_finish(acc, s)
        o_ptrs = Out + row * stride_ob + qh[:, None] * stride_oh + d[None, :] * stride_od
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=real[:, None] & dim)


def _check_device(*tensors: torch.Tensor) -> None:
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise ValueError(f"the invariant kernels need all tensors on one device, got {sorted(map(str, devices))}")
    device = tensors[0].device
    if not kernel_available(device):
        raise ValueError(f"invariant kernels need CUDA, or TRITON_INTERPRET=1 on CPU; got a {device} tensor"
                         + ("" if triton is not None else " and no Triton installed"))


def _check_dtype(name: str, tensor: torch.Tensor, dtype: torch.dtype | None = None) -> None:
    if tensor.dtype not in DTYPES:
        raise ValueError(f"{name} has dtype {tensor.dtype}; the invariant kernels take {DTYPES}")
    if dtype is not None and tensor.dtype != dtype:
        raise ValueError(f"{name} has dtype {tensor.dtype}, expected {dtype} like the first operand")


def _native(dtype: torch.dtype, device: torch.device) -> bool:
    """Half inputs into the tensor cores; on the CPU interpreter (wrong half products) upcast instead."""
    return dtype in (torch.bfloat16, torch.float16) and device.type == "cuda"


def _launch_matmul(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
    """a [batch, M, K] @ b [batch, K, N] (+ bias [N]) into out [batch, M, N]."""
    batch, m, k = a.shape
    n = b.shape[2]
    if out.numel() == 0:
        return out
    if k == 0:  # an empty reduction: the bias, or zeros
        return out.copy_((bias if bias is not None else out.new_zeros(n)).expand_as(out))
    splits = matmul_splits(n, k)
    per_split = triton.cdiv(triton.cdiv(k, splits), MATMUL_BLOCK_K) * MATMUL_BLOCK_K
    # several ranges: each into its own fp32 slice of a workspace, added in order after
    target = out if splits == 1 else torch.empty(splits, batch, m, n, dtype=torch.float32, device=out.device)
    grid = (triton.cdiv(m, MATMUL_BLOCK_M) * triton.cdiv(n, MATMUL_BLOCK_N), batch, splits)
    _matmul[grid](
        a, b, bias if bias is not None and splits == 1 else a, target, m, n, k, per_split,
        a.stride(0), a.stride(1), a.stride(2), b.stride(0), b.stride(1), b.stride(2),
        target.stride(-3), target.stride(-2), target.stride(-1), target.stride(0) if splits > 1 else 0,
        HAS_BIAS=bias is not None and splits == 1, BLOCK_M=MATMUL_BLOCK_M, BLOCK_N=MATMUL_BLOCK_N,
        BLOCK_K=MATMUL_BLOCK_K, PRECISION="ieee", NATIVE=_native(a.dtype, a.device), SERIAL=a.device.type == "cpu",
        num_warps=MATMUL_WARPS, num_stages=MATMUL_STAGES,
    )
    if splits > 1:
        dense = out if out.is_contiguous() else torch.empty(out.shape, dtype=out.dtype, device=out.device)
        total = dense.numel()
        _sum_splits[(triton.cdiv(total, MEAN_BLOCK),)](
            target, bias if bias is not None else target, dense, total, n, target.stride(0), SPLITS=splits,
            HAS_BIAS=bias is not None, BLOCK=MEAN_BLOCK, num_warps=4)
        if dense is not out:
            out.copy_(dense)
    return out


def matmul_splits(n: int, k: int) -> int:
    """K ranges of an [M, K] @ [K, N] product, from the weight's shape alone (so a row's bits never
    depend on M): 1 under ``SPLIT_MIN_K`` or from ``SPLIT_TILES`` column tiles on, else enough ranges
    for about ``SPLIT_TILES`` programs per tile of rows, each at least ``SPLIT_MIN_K // 2`` deep."""
    tiles = -(-n // MATMUL_BLOCK_N)
    if k < SPLIT_MIN_K or tiles >= SPLIT_TILES:
        return 1
    return max(1, min(-(-SPLIT_TILES // tiles), k // (SPLIT_MIN_K // 2)))


def invariant_matmul(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """[M, N] = a [M, K] @ b [K, N] (+ bias [N]), in a's dtype; any strides (b is often a transposed
    weight view); fp32 accumulation, one tile config whatever M, K walked in order, so a row's bits
    depend only on that row of a. The bias is added to the fp32 accumulator at the end."""
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"invariant_matmul takes a [M, K] and b [K, N], got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"invariant_matmul: a {tuple(a.shape)} has K={a.shape[1]} but b {tuple(b.shape)} has "
                         f"K={b.shape[0]}; they must match")
    _check_dtype("a", a)
    _check_dtype("b", b, a.dtype)
    if bias is not None:
        if bias.shape != (b.shape[1],):
            raise ValueError(f"bias {tuple(bias.shape)} must be [N] = [{b.shape[1]}]")
        _check_dtype("bias", bias)
    _check_device(a, b, *(() if bias is None else (bias,)))
    out = torch.empty(a.shape[0], b.shape[1], dtype=a.dtype, device=a.device)
    _launch_matmul(a.unsqueeze(0), b.unsqueeze(0), bias, out.unsqueeze(0))
    return out


def invariant_bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[B, M, N] = a [B, M, K] @ b [B, K, N], each batch by ``invariant_matmul``'s tiles (one launch,
    the batch on the grid's second axis)."""
    if a.dim() != 3 or b.dim() != 3:
        raise ValueError(f"invariant_bmm takes a [B, M, K] and b [B, K, N], got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.shape[0] != b.shape[0] or a.shape[2] != b.shape[1]:
        raise ValueError(f"invariant_bmm: a {tuple(a.shape)} and b {tuple(b.shape)} must be [B, M, K] and [B, K, N] "
                         "with the same B and K")
    _check_dtype("a", a)
    _check_dtype("b", b, a.dtype)
    _check_device(a, b)
    out = torch.empty(a.shape[0], a.shape[1], b.shape[2], dtype=a.dtype, device=a.device)
    return _launch_matmul(a, b, None, out)


def invariant_row_mean(x: torch.Tensor) -> torch.Tensor:
    """``x.mean(-1, keepdim=True)`` for x [..., N], in x's dtype: one program per row, the row summed
    in fp32 in one fixed order (strips of ``MEAN_BLOCK`` in order, then ``tl.sum``), divided by N."""
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"invariant_row_mean needs x [..., N] with N >= 1, got {tuple(x.shape)}")
    _check_dtype("x", x)
    _check_device(x)
    n = x.shape[-1]
    rows = x.reshape(-1, n)
    if rows.stride(-1) != 1:  # the kernel walks a row's elements contiguously
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        _row_mean[(rows.shape[0],)](rows, out, n, rows.stride(0), BLOCK=MEAN_BLOCK, num_warps=4)
    return out.reshape(*x.shape[:-1], 1)


def _reference_grads(reference, tensors, needs_input_grad, grad_outputs, *constants) -> tuple:
    """The backward of a kernel whose forward is ``reference(*tensors, *constants)`` (one output or a
    tuple): the reference recomputed under autograd, and the gradient of each of ``tensors`` that
    needs one (None for the others). An output whose gradient is None (a dropped one) takes no part."""
    inputs = [t.detach().requires_grad_(need) for t, need in zip(tensors, needs_input_grad)]
    with torch.enable_grad():
        outs = reference(*inputs, *constants)
    outs = outs if isinstance(outs, tuple) else (outs,)
    pairs = [(out, grad) for out, grad in zip(outs, grad_outputs) if grad is not None]
    wanted = [t for t in inputs if t.requires_grad]
    grads = iter(torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs],
                                     allow_unused=len(pairs) < len(outs)) if wanted and pairs else ())
    return tuple(next(grads) if t.requires_grad else None for t in inputs)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's and Qwen's RMSNorm in torch (autograd through it): the backward of ``invariant_rms_norm``."""
    y = x.float()
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype)


class _InvariantRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        n = x.shape[-1]
        rows = x.reshape(-1, n)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        out = torch.empty(rows.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
        if rows.shape[0]:
            _rms_norm[(rows.shape[0],)](rows, weight, out, n, rows.stride(0), out.stride(0), eps,
                                        BLOCK=MEAN_BLOCK, num_warps=4)
        return out.reshape(x.shape)

    @staticmethod
    def backward(ctx, grad_out):
        return (*_reference_grads(rms_norm_reference, ctx.saved_tensors, ctx.needs_input_grad, (grad_out,), ctx.eps),
                None)


def invariant_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm of x [..., N] with weight [N] (``rms_norm_reference``'s formula and roundings)
    in one kernel: one program a row, its sum of squares in ``invariant_row_mean``'s fixed order.
    The output's dtype is ``weight * x``'s. Differentiable in x and weight (the backward recomputes
    ``rms_norm_reference``)."""
    if x.dim() < 1 or x.shape[-1] == 0 or weight.shape != (x.shape[-1],):
        raise ValueError(f"invariant_rms_norm takes x [..., N] (N >= 1) and weight [N], got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    _check_dtype("x", x)
    _check_dtype("weight", weight)
    _check_device(x, weight)
    if weight.stride(0) != 1:
        weight = weight.contiguous()
    return _InvariantRMSNorm.apply(x, weight, float(eps))


def rope_reference(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's ``apply_rotary_pos_emb`` (``unsqueeze_dim=1``) in torch: the backward of ``invariant_rope``."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)

    def rotate_half(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def _rope_launch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    batch, heads, seq, dim = x.shape
    out = torch.empty(batch, heads, seq, dim, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    if x.stride(-1) != 1:
        x = x.contiguous()
    cb = cos.stride(0) if cos.shape[0] > 1 else 0  # one row of positions shared by the batch
    _rope[(batch * seq, heads)](
        x, cos, sin, out, seq, x.stride(0), x.stride(1), x.stride(2), cb, cos.stride(1),
        out.stride(0), out.stride(1), out.stride(2), HALF=dim // 2, HALF_PAD=triton.next_power_of_2(dim // 2),
        ROUND=x.dtype in (torch.bfloat16, torch.float16), num_warps=1)
    return out


class _InvariantRope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin):
        ctx.save_for_backward(q, k, cos, sin)
        return _rope_launch(q, cos, sin), _rope_launch(k, cos, sin)

    @staticmethod
    def backward(ctx, grad_q, grad_k):
        return _reference_grads(rope_reference, ctx.saved_tensors, ctx.needs_input_grad, (grad_q, grad_k))


def rope_supported(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether ``invariant_rope`` takes these: q [B, H, T, D] and k [B, KVH, T, D] of one half or
    float dtype, cos and sin [B or 1, T, D] of the same dtype, D even."""
    return (q.dim() == k.dim() == 4 and cos.dim() == sin.dim() == 3 and cos.shape == sin.shape
            and q.dtype == k.dtype == cos.dtype == sin.dtype and q.dtype in DTYPES
            and q.shape[0] == k.shape[0] and q.shape[2:] == k.shape[2:] and q.shape[-1] % 2 == 0
            and cos.shape[0] in (1, q.shape[0]) and cos.shape[1:] == q.shape[2:]
            and cos.stride(-1) == 1 and sin.stride() == cos.stride())


def invariant_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``rope_reference`` (HF's ``apply_rotary_pos_emb``, ``unsqueeze_dim=1``) in one kernel for the
    queries and one for the keys, eager's roundings kept; contiguous outputs. Differentiable (the
    backward recomputes ``rope_reference``). ValueError unless ``rope_supported``."""
    if not rope_supported(q, k, cos, sin):
        raise ValueError(f"invariant_rope takes q [B, H, T, D], k [B, KVH, T, D] and cos, sin [B or 1, T, D] of "
                         f"one dtype, D even; got {tuple(q.shape)} {q.dtype}, {tuple(k.shape)} {k.dtype}, "
                         f"{tuple(cos.shape)} {cos.dtype}")
    _check_device(q, k, cos, sin)
    return _InvariantRope.apply(q, k, cos, sin)


def _head_dim_pad(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


def _check_head_dim(head_dim: int) -> None:
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"the invariant attention kernels take head_dim in 1..{MAX_HEAD_DIM}, got {head_dim}")


def _check_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, starts: torch.Tensor) -> None:
    if query.dim() != 4 or key.dim() != 4 or key.shape != value.shape:
        raise ValueError(f"invariant_attention takes query [B, H, q, D] and key, value [B, KVH, S, D], got "
                         f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}")
    batch, heads, q_len, head_dim = query.shape
    if key.shape[0] != batch or key.shape[3] != head_dim:
        raise ValueError(f"key {tuple(key.shape)} does not match query {tuple(query.shape)} in B or D")
    if heads % key.shape[1]:
        raise ValueError(f"{heads} query heads are not a multiple of {key.shape[1]} KV heads")
    if q_len > key.shape[2]:
        raise ValueError(f"{q_len} queries but only {key.shape[2]} key columns; the queries are the last columns")
    _check_head_dim(head_dim)
    _check_dtype("query", query)
    _check_dtype("key", key, query.dtype)
    _check_dtype("value", value, query.dtype)
    if starts.shape != (batch,) or starts.dtype.is_floating_point or starts.dtype == torch.bool:
        raise ValueError(f"starts must be an integer [B] = [{batch}] tensor, got {starts.dtype} {tuple(starts.shape)}")
    _check_device(query, key, value, starts)


def _prefill_attention(query, key, value, starts, scale: float) -> torch.Tensor:
    batch, heads, q_len, head_dim = query.shape
    out = torch.empty(batch, q_len, heads, head_dim, dtype=query.dtype, device=query.device)
    if out.numel() == 0:
        return out
    grid = (batch * heads, triton.cdiv(q_len, BLOCK_ROWS))
    _prefill[grid](
        query, key, value, starts, out,
        *query.stride(), *key.stride(), *value.stride(), out.stride(0), out.stride(1), out.stride(2), out.stride(3),
        starts.stride(0), q_len, key.shape[2], scale,
        HEADS=heads, GROUP=heads // key.shape[1], HEAD_DIM=head_dim, HEAD_DIM_PAD=_head_dim_pad(head_dim),
        BLOCK_M=BLOCK_ROWS, BLOCK_N=INVARIANT_BLOCK_N, PRECISION="ieee", NATIVE=_native(query.dtype, query.device),
        SERIAL=query.device.type == "cpu",
        num_warps=ATTENTION_WARPS, num_stages=ATTENTION_STAGES,
    )
    return out


def attention_reference(query, key, value, starts, scale: float) -> torch.Tensor:
    """Plain causal attention with left padding, in torch (autograd through it): [B, q, H, D]. A
    query with no key (left padding) gets 0. The backward of ``invariant_attention``."""
    batch, heads, q_len, head_dim = query.shape
    kv_heads, width = key.shape[1], key.shape[2]
    group = heads // kv_heads
    cols = torch.arange(width, device=query.device)
    qcols = cols[width - q_len:]
    start = starts.to(torch.long)[:, None, None]  # [B, 1, 1]
    live = (cols[None, None, :] >= start) & (cols[None, None, :] <= qcols[None, :, None])  # [B, q, S]
    k = key.repeat_interleave(group, dim=1)  # [B, H, S, D]
    v = value.repeat_interleave(group, dim=1)
    scores = torch.matmul(query, k.transpose(-1, -2)).float() * scale  # [B, H, q, S]
    scores = scores.masked_fill(~live[:, None], torch.finfo(torch.float32).min)  # finite: no NaN rows
    probs = scores.softmax(-1).to(value.dtype)
    out = torch.matmul(probs, v) * live.any(-1)[:, None, :, None]  # [B, H, q, D]; padding queries 0
    return out.transpose(1, 2)


class _InvariantAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, starts, scale):
        ctx.save_for_backward(query, key, value, starts)
        ctx.scale = scale
        return _prefill_attention(query, key, value, starts, scale)

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, starts = ctx.saved_tensors
        return (*_reference_grads(attention_reference, (query, key, value), ctx.needs_input_grad, (grad_out,), starts,
                                  ctx.scale), None, None)


def invariant_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, starts: torch.Tensor,
                        scale: float) -> torch.Tensor:
    """Causal attention of a prefill or teacher-forced forward: query [B, H, q, D], key/value
    [B, KVH, S, D] (GQA: H a multiple of KVH), ``starts`` [B] the key column of each row's logical
    position 0. Query i of row b sits at column S - q + i and attends to columns [starts[b], itself].
    Returns [B, q, H, D] in query's dtype, the same bits as ``invariant_paged_attention`` for the
    same query over the same keys; left-padding queries get 0. Differentiable in query, key and
    value (the backward recomputes ``attention_reference``)."""
    _check_attention(query, key, value, starts)
    return _InvariantAttention.apply(query, key, value, starts, float(scale))


def _check_paged(query, key_pool, value_pool, block_tables, positions) -> None:
    if query.dim() != 4 or query.shape[2] != 1:
        raise ValueError(f"invariant_paged_attention takes query [rows, H, 1, D], got {tuple(query.shape)}")
    rows, heads, _, head_dim = query.shape
    if key_pool.dim() != 4 or key_pool.shape != value_pool.shape:
        raise ValueError(f"key_pool {tuple(key_pool.shape)} and value_pool {tuple(value_pool.shape)} must both be "
                         "[num_blocks, block_size, kv_heads, head_dim]")
    if key_pool.shape[3] != head_dim:
        raise ValueError(f"the pools' head_dim {key_pool.shape[3]} does not match query {tuple(query.shape)}")
    if heads % key_pool.shape[2]:
        raise ValueError(f"{heads} query heads are not a multiple of {key_pool.shape[2]} KV heads")
    _check_head_dim(head_dim)
    if key_pool.shape[1] not in BLOCK_SIZES:
        raise ValueError(f"the invariant paged kernel needs a block size in {BLOCK_SIZES}, got {key_pool.shape[1]}")
    _check_dtype("query", query)
    _check_dtype("key_pool", key_pool, query.dtype)
    _check_dtype("value_pool", value_pool, query.dtype)
    check_block_tables(block_tables, rows)
    if positions.dim() != 1 or positions.dtype.is_floating_point or positions.dtype == torch.bool:
        raise ValueError(f"positions must be an integer [>= {rows}] tensor, got {positions.dtype} "
                         f"{tuple(positions.shape)}")
    if positions.shape[0] < rows:
        raise ValueError(f"positions has {positions.shape[0]} entries for {rows} rows")
    _check_device(query, key_pool, value_pool, block_tables, positions)


def invariant_paged_attention(query: torch.Tensor, key_pool: torch.Tensor, value_pool: torch.Tensor,
                              block_tables: torch.Tensor, positions: torch.Tensor, scale: float) -> torch.Tensor:
    """Decode over the paged pool, as ``paged.paged_attention`` (query [rows, H, 1, D], pools
    [num_blocks, block_size, KVH, D], block_tables [>= rows, max_blocks], positions [>= rows]; returns
    [rows, 1, H, D]): row i attends to its logical positions [0, positions[i]] in blocks of
    ``INVARIANT_BLOCK_N``, one program per (row, KV head, 16 heads of its GQA group), no splits, so
    each K/V byte is read once per (row, KV head) for groups up to 16. The same bits as
    ``invariant_attention`` for the same query over the same keys."""
    _check_paged(query, key_pool, value_pool, block_tables, positions)
    rows, heads, _, head_dim = query.shape
    block_size, kv_heads = key_pool.shape[1], key_pool.shape[2]
    group = heads // kv_heads
    out = torch.empty(rows, 1, heads, head_dim, dtype=query.dtype, device=query.device)
    if rows == 0:
        return out
    grid = (rows * kv_heads, triton.cdiv(group, BLOCK_ROWS))
    _paged_decode[grid](
        query, key_pool, value_pool, block_tables, positions, out,
        query.stride(0), query.stride(1), query.stride(3), *key_pool.stride(), *value_pool.stride(),
        block_tables.stride(0), block_tables.stride(1), positions.stride(0),
        out.stride(0), out.stride(2), out.stride(3),
        block_tables.shape[1], float(scale),
        KV_HEADS=kv_heads, GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_PAD=_head_dim_pad(head_dim),
        BLOCK_SIZE=block_size, BLOCK_M=BLOCK_ROWS, BLOCK_N=INVARIANT_BLOCK_N, PRECISION="ieee",
        NATIVE=_native(query.dtype, query.device), SERIAL=query.device.type == "cpu",
        num_warps=ATTENTION_WARPS, num_stages=ATTENTION_STAGES,
    )
    return out
