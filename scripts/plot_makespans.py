"""Predicted makespans of balanced vs round-robin vs verl-KK sharding across workloads and ranks.

    .venv/bin/python scripts/plot_makespans.py [--max-new-tokens 16] [--costs data/calibration/x.json]

Writes data/tables/makespans.csv, data/tables/makespans.json (with provenance) and
figures/makespans.png. Cost-model numbers only: no torch, no device.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from rollout_lab.measure.makespans import (COLUMNS, WORKLOADS, WORLD_SIZES,
                                           makespan_rows)
from rollout_lab.measure.provenance import provenance
from rollout_lab.planner.cost import CostCoefficients, ModelGeometry, setting_metadata
from rollout_lab.plots.makespans import plot_makespans
from rollout_lab.workspace import Workspace, write_csv, write_json_atomic

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-new-tokens", type=int, default=16, help="decode budget per request")
    parser.add_argument("--continuous-batch-size", type=int, default=None, help="slots per rank")
    parser.add_argument("--costs", default=None, help="a cost file (default: the seed coefficients)")
    parser.add_argument("--override-costs", action="store_true", help="use --costs whatever its provenance")
    parser.add_argument("--element-bytes", type=int, default=4, help="KV element size (4 = fp32)")
    parser.add_argument("--out-dir", default=str(REPO), help="workspace (default: this checkout)")
    args = parser.parse_args()
    ws = Workspace.resolve(args.out_dir)
    geometry = ModelGeometry.qwen25_3b(args.element_bytes)
    # the costs must have been measured on Qwen2.5-3B geometry (--override-costs: use them anyway)
    costs = CostCoefficients.from_json(args.costs, expected=setting_metadata(geometry=geometry),
                                       override=args.override_costs) if args.costs else CostCoefficients()
    rows = makespan_rows(WORKLOADS, WORLD_SIZES, geometry=geometry, costs=costs,
                         max_new_tokens=args.max_new_tokens,
                         continuous_batch_size=args.continuous_batch_size)
    write_csv(rows, ws.tables / "makespans.csv", columns=COLUMNS)
    write_json_atomic(ws.tables / "makespans.json", {
        "provenance": provenance(config=dict(
            geometry=geometry.__dict__, coefficients=costs.to_dict(),
            max_new_tokens=args.max_new_tokens, continuous_batch_size=args.continuous_batch_size,
        )),
        "rows": rows,
    })
    plot_makespans(rows, ws.figures / "makespans.png")
    for r in rows:
        print(f"{r['workload']:16s} ranks={r['world_size']} {r['method']:15s} "
              f"{r['predicted_makespan_ms']:9.1f} ms  x{r['vs_balanced']:.3f}")


if __name__ == "__main__":
    main()
