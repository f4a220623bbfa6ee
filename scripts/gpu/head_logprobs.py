"""The trainer logprobs' head, old form against new, on one chunk of positions: ``F.linear`` then an
fp32 copy, ``gather`` and ``torch.logsumexp`` (``sequence_logprobs`` before ea3da18) against
``F.linear`` then ``engine.trainer.token_logprobs`` (one Triton program per row), and the matmul
alone; interleaved, after a warm-up, with each one's peak memory and their largest difference.

    python scripts/gpu/head_logprobs.py                       # Qwen2.5-0.5B's head, 8,192 positions
    python scripts/gpu/head_logprobs.py --positions 64 --vocab 1000 --hidden 64   # a CPU check

A diagnostic: the records that show speed are the benchmarks' (``rollout-lab bench trainer-loop``).
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from rollout_lab.engine.trainer import token_logprobs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--positions", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--hidden", type=int, default=896)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(args.positions, args.hidden, generator=gen).to(device, dtype)
    weight = (torch.randn(args.vocab, args.hidden, generator=gen) * 0.05).to(device, dtype)
    targets = torch.randint(0, args.vocab, (args.positions,), generator=gen).to(device)

    def old() -> torch.Tensor:
        logits = F.linear(hidden, weight).float()
        return logits.gather(-1, targets[:, None])[:, 0] - torch.logsumexp(logits, -1)

    def new() -> torch.Tensor:
        return token_logprobs(F.linear(hidden, weight), targets)

    def matmul() -> torch.Tensor:
        return F.linear(hidden, weight)

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    for fn in (old, new, matmul):
        fn()
    for name, fn in (("old", old), ("new", new), ("matmul only", matmul), ("old", old), ("new", new)):
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        sync()
        started = time.perf_counter()
        for _ in range(args.iters):
            fn()
        sync()
        ms = (time.perf_counter() - started) / args.iters * 1e3
        peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else float("nan")
        print(f"{name:12s} {ms:8.2f} ms per {args.positions} positions, peak {peak:.1f} GiB")
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(f"max |old - new| {(old() - new()).abs().max().item():.2e} on {name}")


if __name__ == "__main__":
    main()
