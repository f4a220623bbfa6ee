"""Planner speed: plan_buckets on random lengths, written to data/benchmarks/planner.{json,csv}.

    .venv/bin/python benchmarks/bench_planner.py [--quick]

Lengths are uniform random ints in [1, max_len] (seeded; max_len 0 means all 300), Qwen2.5-3B fp32 geometry, default
coefficients (token limit 65536). Each case is timed `repeats` times after one warm-up; the record
keeps every sample, the median and the minimum. The quadratic DP is timed beside it up to n = 4096.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

from rollout_lab.measure.provenance import provenance
from rollout_lab.planner.bucket_dp import plan_buckets, plan_buckets_quadratic
from rollout_lab.planner.cost import CostCoefficients, ModelGeometry
from rollout_lab.workspace import write_json_atomic, write_text_atomic

CASES = [(32, 65536), (128, 65536), (256, 65536), (4096, 65536), (65536, 65536),
         (4096, 512), (65536, 512), (4096, 4096), (65536, 4096),
         (4096, 0), (65536, 0)]  # max_len 0: every prompt 300 tokens, the slowest shape we found


def time_call(fn, repeats: int) -> list[float]:
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer repeats, skip n = 65536")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "data" / "benchmarks" / "planner"), help="output path stem")
    args = parser.parse_args()
    geometry, costs = ModelGeometry.qwen25_3b(), CostCoefficients()
    rows = []
    for n, max_len in CASES:
        if args.quick and n > 4096:
            continue
        rng = random.Random(n * 7 + max_len)
        lengths = [rng.randint(1, max_len) for _ in range(n)] if max_len > 0 else [300] * n
        repeats = 200 if n <= 256 else (20 if n <= 4096 else 5)
        fast = time_call(lambda: plan_buckets(lengths, geometry, costs), repeats)
        row = {"n": n, "max_len": max_len, "repeats": repeats,
               "num_buckets": plan_buckets(lengths, geometry, costs).num_buckets,
               "median_ms": statistics.median(fast), "min_ms": min(fast), "samples_ms": fast}
        if n <= 4096:
            slow = time_call(lambda: plan_buckets_quadratic(lengths, geometry, costs), 3 if n > 256 else repeats // 4)
            row["quadratic_median_ms"] = statistics.median(slow)
        rows.append(row)
        quad = f"{row.get('quadratic_median_ms', float('nan')):9.2f}"
        print(f"n={n:6d} max_len={max_len:6d} median {row['median_ms']:8.3f} ms  min {row['min_ms']:8.3f} ms  quadratic {quad} ms")
    record = {"benchmark": "plan_buckets", "provenance": provenance(), "rows": rows}
    write_json_atomic(args.out + ".json", record)
    header = "n,max_len,num_buckets,median_ms,min_ms,quadratic_median_ms\n"
    lines = [f"{r['n']},{r['max_len']},{r['num_buckets']},{r['median_ms']:.4f},{r['min_ms']:.4f},"
             f"{r.get('quadratic_median_ms', '')}" for r in rows]
    write_text_atomic(args.out + ".csv", header + "\n".join(lines) + "\n")
    print(f"wrote {args.out}.json and .csv")


if __name__ == "__main__":
    main()
