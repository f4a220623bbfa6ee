"""Print sweep records as one README markdown table: E2E ms per path, Auto's choice, Auto/best.

    python scripts/results_table.py data/results/sweep_qwen2.5-3b_bfloat16_cuda.json [more.json ...]

Several records (e.g. one process per workload) give one table, a row per workload, with the
paths of the first record as columns.
"""
from __future__ import annotations

import sys

from rollout_lab.measure.sweep import PATHS, load_results


def markdown(records: list[dict]) -> str:
    paths = [p for p in PATHS if p in records[0]["config"]["paths"]]
    head = "| workload | " + " | ".join(paths) + " | Auto's route | Auto / best manual | Auto / best peer |"
    lines = [head, "|---|" + "---:|" * len(paths) + "---|---:|---:|"]
    for record in records:
        lines += _rows(record, paths)
    return "\n".join(lines)


def _rows(record: dict, paths: list[str]) -> list[str]:
    lines = []
    summary = {w["workload"]: w for w in record["summary"]["workloads"]}
    for name, workload in record["workloads"].items():
        cells = []
        for p in paths:
            r = workload["paths"].get(p, {})
            cells.append(f"{r['mean_ms']:.0f}" if r.get("mean_ms") is not None else "—")
        s = summary[name]
        route = workload["paths"]["auto"].get("route", "?")
        buckets = workload["paths"]["auto"].get("buckets") or ""
        peer = s.get("auto_over_best_peer")
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {route} {buckets} | "
                     f"{s['auto_over_best_manual']:.3f} | {'—' if peer is None else f'{peer:.2f}'} |")
    return lines


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: results_table.py SWEEP.json [SWEEP.json ...]")
    print(markdown([load_results(path) for path in sys.argv[1:]]))
