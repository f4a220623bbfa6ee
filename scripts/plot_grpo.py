"""Render a GRPO benchmark record (``rollout-lab bench grpo``) as a figure.

    python scripts/plot_grpo.py data/results/grpo_tiny-qwen2_float32_cpu.json [--out figures]

Writes ``<out>/<record stem>.png`` and ``.svg``. No torch, no device: it reads the record only.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

from rollout_lab.plots.grpo import plot_grpo  # noqa: E402
from rollout_lab.plots.style import save_figure  # noqa: E402
from rollout_lab.workspace import Workspace  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("record", type=Path, help="a .json record written by rollout-lab bench grpo")
    parser.add_argument("--out", type=Path, default=Workspace.resolve(Path(__file__).resolve().parents[1]).figures, help="figure folder (default: this checkout's figures/)")
    args = parser.parse_args()
    if not args.record.is_file():
        parser.error(f"record {args.record} does not exist")
    record = json.loads(args.record.read_text())
    if "results" not in record or "workload" not in record:
        parser.error(f"{args.record} is not a GRPO record (needs 'results' and 'workload')")
    for path in save_figure(plot_grpo(record), args.out, args.record.stem):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
