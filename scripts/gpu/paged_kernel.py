"""How close the paged decode-attention kernel comes to the GPU's memory bandwidth, and which launch
settings (warps, pipeline stages) and dot dtypes get it there: one layer's attention for a batch of
rows whose contexts are drawn like nano-vllm's shape (Qwen3-0.6B heads, prompts plus tokens so far
up to 2,048).

    python scripts/gpu/paged_kernel.py --out $OUT/paged_kernel.txt                 # the H200
    TRITON_INTERPRET=1 python scripts/gpu/paged_kernel.py --tiny --out /tmp/k.txt  # a CPU check

Each case times ``engine.kernels.paged``'s partial kernel and merge under every (num_warps,
num_stages) pair and three dot modes: TF32 products of upcast values ("tf32", the kernel before
13cf8de), q·k in the cache's dtype ("qk"), and p·v too ("qk+pv": p rounded to bf16, as flash
attention does; the op ships this since, with 4 warps and 2 stages). It
times ``--iters`` launches after a warm-up by CUDA events and prints the KV bytes read per launch
over the time (GB/s), with each variant's largest difference from the op's own output (warps and
stages change the schedule, not the arithmetic; the dot modes round differently). A diagnostic: the records that
show speed are the benchmarks' (``rollout-lab bench``).
"""
from __future__ import annotations

import argparse
import itertools
import time
from pathlib import Path

import torch

from rollout_lab.engine.kernels.paged import _paged_partial, paged_attention, paged_splits
from rollout_lab.engine.kernels.span import merge_splits, split_buffers


def make_case(rows: int, contexts: torch.Tensor, *, heads: int, kv_heads: int, head_dim: int, block_size: int,
              dtype: torch.dtype, device: str, seed: int = 0):
    """A pool holding every row's blocks in a shuffled order, the tables, positions and a query."""
    gen = torch.Generator().manual_seed(seed)
    blocks = (contexts + block_size - 1) // block_size
    max_blocks = int(blocks.max())
    total = int(blocks.sum()) + 1  # block 0: scratch
    order = torch.randperm(total - 1, generator=gen) + 1
    tables = torch.zeros(rows, max_blocks, dtype=torch.int32)
    at = 0
    for row, n in enumerate(blocks.tolist()):
        tables[row, :n] = order[at: at + n].to(torch.int32)
        at += n
    shape = (total, block_size, kv_heads, head_dim)
    key = torch.randn(shape, generator=gen).to(dtype).to(device)
    value = torch.randn(shape, generator=gen).to(dtype).to(device)
    query = torch.randn(rows, heads, 1, head_dim, generator=gen).to(dtype).to(device)
    positions = (contexts - 1).to(torch.long).to(device)
    return query, key, value, tables.to(device), positions


def launch(query, key, value, tables, positions, scale, *, num_warps: int, num_stages: int, native: str = ""):
    rows, heads, _, head_dim = query.shape
    block_size, kv_heads = key.shape[1], key.shape[2]
    group = heads // kv_heads
    group_pad = max(16, 1 << (group - 1).bit_length())
    splits = paged_splits(rows, kv_heads, tables.shape[1], query.device)
    m, s, acc, out = split_buffers(query, kv_heads, splits, group_pad)
    precision = "ieee" if query.dtype == torch.float32 else "tf32"
    _paged_partial[(rows * kv_heads, splits)](
        query, key, value, tables, positions, m, s, acc, out,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2), tables.stride(0), tables.stride(1),
        positions.stride(0), out.stride(0), out.stride(2), tables.shape[1], scale,
        KV_HEADS=kv_heads, GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        SPLITS=splits, PRECISION=precision, NATIVE_QK="qk" in native, NATIVE_PV="pv" in native,
        num_warps=num_warps, num_stages=num_stages,
    )
    return merge_splits(m, s, acc, out, kv_heads=kv_heads, group=group, group_pad=group_pad, splits=splits)


def timed_ms(fn, iters: int, device: str) -> float:
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / iters
    started = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - started) * 1e3 / iters


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="small shapes, for TRITON_INTERPRET=1 on the CPU")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    heads, kv_heads, head_dim = (16, 8, 128) if not args.tiny else (4, 2, 16)
    gen = torch.Generator().manual_seed(1)
    if args.tiny:
        cases = {"tiny 4 rows": torch.randint(5, 90, (4,), generator=gen)}
        variants, iters = [(4, 2, ""), (8, 3, "qk"), (4, 1, "qk+pv")], 1
    else:  # nano's rows mid-rollout: contexts U(100, 1024) prompts + up to 1,024 tokens
        cases = {
            "256 rows, U(100, 2048)": torch.randint(100, 2049, (256,), generator=gen),
            "256 rows, 1,024 each": torch.full((256,), 1024),
            "128 rows, U(100, 2048)": torch.randint(100, 2049, (128,), generator=gen),
            "16 rows, 2,048 each": torch.full((16,), 2048),
        }
        variants, iters = list(itertools.product((2, 4, 8), (1, 2, 3), ("", "qk", "qk+pv"))), args.iters
    lines = [f"{torch.cuda.get_device_name() if device == 'cuda' else 'cpu'} {dtype} heads {heads}/{kv_heads} "
             f"head_dim {head_dim}; GB/s = K and V bytes of the live blocks read per launch / time"]
    for block_size in ((64,) if args.tiny else (64, 128)):
        for name, contexts in cases.items():
            query, key, value, tables, positions = make_case(
                len(contexts), contexts, heads=heads, kv_heads=kv_heads, head_dim=head_dim, block_size=block_size,
                dtype=dtype, device=device)
            scale = head_dim ** -0.5
            live_blocks = int(((contexts + block_size - 1) // block_size).sum())
            nbytes = 2 * live_blocks * block_size * kv_heads * head_dim * key.element_size()
            reference = paged_attention(query, key, value, tables, positions, scale)
            op_ms = timed_ms(lambda: paged_attention(query, key, value, tables, positions, scale), iters, device)
            lines.append(f"\n{name}, block {block_size}: {nbytes / 2**20:.0f} MiB of KV; "
                         f"the op as shipped {op_ms * 1e3:.1f} us = {nbytes / op_ms / 1e6:.0f} GB/s")
            for warps, stages, native in variants:
                label = f"warps {warps} stages {stages} {native or 'tf32':6}"
                try:
                    out = launch(query, key, value, tables, positions, scale, num_warps=warps, num_stages=stages,
                                 native=native)
                    ms = timed_ms(lambda: launch(query, key, value, tables, positions, scale, num_warps=warps,
                                                 num_stages=stages, native=native), iters, device)
                except Exception as error:  # a variant that does not fit the SM (shared memory, registers)
                    lines.append(f"  {label}: failed ({type(error).__name__}: "
                                 f"{str(error).splitlines()[0][:80]})")
                    continue
                diff = float((out.float() - reference.float()).abs().max())
                lines.append(f"  {label}: {ms * 1e3:8.1f} us  {nbytes / ms / 1e6:6.0f} GB/s"
                             f"  max |diff| {diff:.2e}")
    text = "\n".join(lines)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
