"""Predicted makespans of balanced vs round-robin vs verl-KK sharding across workloads and ranks.

    .venv/bin/python scripts/plot_makespans.py [--max-new-tokens 16] [--costs data/calibration/x.json]

Writes data/tables/makespans.csv, data/tables/makespans.json (with provenance) and
figures/makespans.png. Cost-model numbers only: no torch, no device.
"""
from __future__ import annotations

import argparse

from rollout_lab.cost import CostCoefficients, ModelGeometry
from rollout_lab.io import write_json_atomic
from rollout_lab.paths import FIGURES, TABLES
from rollout_lab.plots_distributed import (
    WORKLOADS, WORLD_SIZES, makespan_rows, plot_makespans, write_rows_csv,
)
from rollout_lab.provenance import provenance


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-new-tokens", type=int, default=16, help="decode budget per request")
    parser.add_argument("--continuous-batch-size", type=int, default=None, help="slots per rank")
    parser.add_argument("--costs", default=None, help="a cost file (default: the seed coefficients)")
    parser.add_argument("--element-bytes", type=int, default=4, help="KV element size (4 = fp32)")
    args = parser.parse_args()
    coeffs = CostCoefficients.from_json(args.costs) if args.costs else CostCoefficients()
    geometry = ModelGeometry.qwen25_3b(args.element_bytes)
    rows = makespan_rows(WORKLOADS, WORLD_SIZES, geometry=geometry, coeffs=coeffs,
                         max_new_tokens=args.max_new_tokens,
                         continuous_batch_size=args.continuous_batch_size)
    write_rows_csv(rows, TABLES / "makespans.csv")
    write_json_atomic(TABLES / "makespans.json", {
        "provenance": provenance(config=dict(
            geometry=geometry.__dict__, coefficients=coeffs.to_dict(),
            max_new_tokens=args.max_new_tokens, continuous_batch_size=args.continuous_batch_size,
        )),
        "rows": rows,
    })
    plot_makespans(rows, FIGURES / "makespans.png")
    for r in rows:
        print(f"{r['workload']:16s} ranks={r['world_size']} {r['method']:15s} "
              f"{r['predicted_makespan_ms']:9.1f} ms  x{r['vs_balanced']:.3f}")


if __name__ == "__main__":
    main()
