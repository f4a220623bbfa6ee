"""The FP8 paged KV cache's layout (``RolloutConfig(kv_cache_dtype="fp8")``): e4m3 values with one
fp32 scale per (token, KV head), and its write.

A decode step at hundreds of rows reads the KV more than the weights (nano-vllm's shape: 112 KiB
per token on Qwen3-0.6B); e4m3 halves those bytes. Each token's key (and value) vector of one KV head
is scaled by its own ``amax / 448`` (e4m3's largest finite value) before rounding, so a head whose
values are large does not flatten one whose values are small, and a token never changes once
written: a scale per block or per head would move as the block fills (requantising the block) or
need a calibration pass. The scale costs 4 bytes per 64 or 128 values (6% or 3%). Rounding to e4m3
keeps 3 mantissa bits: a value moves by at most 1/16 of its magnitude (half an ulp, ``2**-4``
relative) plus, below the scale's subnormal range, ``2**-10`` of its vector's largest. This is lossy:
the logprobs move (``measure.fidelity``), so it is not for users who need the trainer's exact
numbers (``RolloutConfig(batch_invariant=True)`` refuses it).

A layer's pool is one uint8 tensor ``[num_blocks, block_size + scale_rows, kv_heads, head_dim]``:
each block's ``block_size`` rows of e4m3 values, then ``scale_rows(block_size, head_dim)`` rows
holding its ``block_size x kv_heads`` fp32 scales. One tensor per pool keeps the cache's interface
(``PagedLayer.update`` hands the attention its key and value pools, nothing else), and the block
size is read back from the shape (``pool_block_size``). ``split(pool)`` gives the two views:

    pool = allocate(num_blocks, block_size, kv_heads, head_dim, device)
    values, scales = split(pool)        # [blocks, block_size, kv_heads, head_dim] e4m3, [blocks, block_size, kv_heads] fp32
    q, s = quantize(x)                  # x [..., head_dim] -> e4m3 values, fp32 scales [...]
    x_back = dequantize(q, s, x.dtype)

"""
from __future__ import annotations

import torch

from rollout_lab.engine.kernels.available import kernel_available, tl, triton
from rollout_lab.planner.cost import ModelGeometry

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3's largest finite value
SCALE_BYTES = 4  # an fp32 scale per (token, KV head)
TINY_SCALE = 2.0 ** -126  # an all-zero vector's scale (any positive value maps it to zeros)


def scale_rows(block_size: int, head_dim: int) -> int:
    """Rows of ``kv_heads x head_dim`` bytes that hold a block's ``block_size x kv_heads`` fp32 scales."""
    return -(-SCALE_BYTES * block_size // head_dim)


def pool_block_size(rows: int, head_dim: int) -> int:
    """The block size of an FP8 pool whose blocks have ``rows`` rows (``block_size + scale_rows``)."""
    guess = rows * head_dim // (head_dim + SCALE_BYTES)  # rows ~ block_size * (1 + 4 / head_dim)
    for block_size in (guess - 1, guess, guess + 1):  # asked at every decode step's write and read: no search
        if block_size >= 1 and block_size + scale_rows(block_size, head_dim) == rows:
            return block_size
    raise ValueError(f"{rows} rows per block is no FP8 pool's block (block_size + scale_rows) for head_dim {head_dim}")


def kv_bytes_per_token(geometry: ModelGeometry, block_size: int) -> float:
    """Bytes of one token's keys and values over all layers in FP8 pools of ``block_size``, its share
    of the scale rows included (``ModelGeometry.kv_bytes_per_token``'s FP8 counterpart)."""
    rows = block_size + scale_rows(block_size, geometry.head_dim)
    return 2 * geometry.num_layers * rows * geometry.num_kv_heads * geometry.head_dim / block_size


def allocate(num_blocks: int, block_size: int, kv_heads: int, head_dim: int, device) -> torch.Tensor:
    """One layer's key (or value) pool, zeros: [num_blocks, block_size + scale_rows, kv_heads, head_dim] uint8."""
    return torch.zeros(num_blocks, block_size + scale_rows(block_size, head_dim), kv_heads, head_dim,
                       dtype=torch.uint8, device=device)


def is_fp8_pool(pool: torch.Tensor) -> bool:
    return pool.dtype == torch.uint8


def split(pool: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of an FP8 pool (no copy): its values [blocks, block_size, kv_heads, head_dim] e4m3 and
    its scales [blocks, block_size, kv_heads] fp32."""
    if pool.dim() != 4 or pool.dtype != torch.uint8 or not pool.is_contiguous():
        raise ValueError(f"an FP8 pool is a contiguous uint8 [blocks, rows, kv_heads, head_dim] tensor, got "
                         f"{pool.dtype} {tuple(pool.shape)}")
    blocks, rows, kv_heads, head_dim = pool.shape
    block_size = pool_block_size(rows, head_dim)
    values = pool[:, :block_size].view(FP8_DTYPE)
    scales = pool[:, block_size:].flatten(1).view(torch.float32)[:, : block_size * kv_heads]
    return values, scales.view(blocks, block_size, kv_heads)


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 values, fp32 scales [...]) of ``x`` [..., head_dim]: each vector over its own amax / 448.
    A dequantized vector quantizes back to the same bits (its amax is 448 x its scale)."""
    x = x.float()
    scales = (x.abs().amax(-1) / FP8_MAX).clamp(min=TINY_SCALE)
    return (x / scales[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scales


def dequantize(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``values`` [..., head_dim] e4m3 times their ``scales`` [...], in ``dtype``."""
    return (values.float() * scales[..., None]).to(dtype)


@torch.library.custom_op("rollout_lab::paged_write_fp8", mutates_args=("key_pool", "value_pool"))
def paged_write_fp8(key_pool: torch.Tensor, value_pool: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                    slot_mapping: torch.Tensor) -> None:
    """``engine.kv.paged.paged_write`` into FP8 pools: each row's token (``keys``/``values`` ``[rows,
    kv_heads, head_dim]``) quantized (``quantize``) into flat token ``slot_mapping[row]`` (block
    ``index // block_size``, row ``index % block_size``) with its scales. On CUDA one launch writes
    both pools, bit for bit ``quantize``'s (IEEE divisions, e4m3 rounding to nearest even); torch ops
    elsewhere (Triton's CPU interpreter rounds to e4m3 wrongly where the mantissa carries)."""
    rows = keys.shape[0]
    if not rows:
        return
    block_size = pool_block_size(key_pool.shape[1], key_pool.shape[3])
    if keys.device.type == "cuda" and kernel_available(keys.device) and keys.stride(2) == 1 \
            and values.stride(2) == 1:
        kv_heads, head_dim = keys.shape[1], keys.shape[2]
        _write_fp8_kernel[(rows, kv_heads)](
            key_pool, value_pool, keys, values, slot_mapping, keys.stride(0), keys.stride(1), values.stride(0),
            values.stride(1), key_pool.stride(0), key_pool.stride(1), key_pool.stride(2),
            BLOCK_SIZE=block_size, KV_HEADS=kv_heads, HEAD_DIM=head_dim, num_warps=1)
        return
    block, row = slot_mapping // block_size, slot_mapping % block_size
    for pool, new in ((key_pool, keys), (value_pool, values)):
        pool_values, pool_scales = split(pool)
        q, s = quantize(new)
        pool_values[block, row] = q
        pool_scales[block, row] = s


if triton is not None:

    @triton.jit
    def _write_fp8_kernel(KeyPool, ValuePool, Keys, Values, SlotMapping, stride_kr, stride_kh, stride_vr, stride_vh,
                          stride_pb, stride_pn, stride_ph, BLOCK_SIZE: tl.constexpr, KV_HEADS: tl.constexpr,
                          HEAD_DIM: tl.constexpr):
        """Row ``r``'s key and value of KV head ``h`` (program (r, h)): scaled by amax / 448, rounded
        to e4m3 into the value rows of its block, the scale into the block's scale rows."""
        row = tl.program_id(0)
        head = tl.program_id(1)
        d = tl.arange(0, HEAD_DIM)
        slot = tl.load(SlotMapping + row).to(tl.int64)
        block = slot // BLOCK_SIZE
        token = slot % BLOCK_SIZE
        value_at = block * stride_pb + token * stride_pn + head * stride_ph + d
        scale_at = block * stride_pb + BLOCK_SIZE * stride_pn + (token * KV_HEADS + head) * 4  # bytes
        for which in tl.static_range(2):
            if which == 0:
                x = tl.load(Keys + row * stride_kr + head * stride_kh + d).to(tl.float32)
                pool = KeyPool
            else:
                x = tl.load(Values + row * stride_vr + head * stride_vh + d).to(tl.float32)
                pool = ValuePool
            scale = tl.maximum(tl.div_rn(tl.max(tl.abs(x), 0), 448.0), 1.1754943508222875e-38)
            q = tl.minimum(tl.maximum(tl.div_rn(x, scale), -448.0), 448.0).to(tl.float8e4nv)
            tl.store(pool + value_at, q.to(tl.uint8, bitcast=True))
            tl.store((pool + scale_at).to(tl.pointer_type(tl.float32)), scale)
