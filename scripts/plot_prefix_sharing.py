"""Render a prefix-sharing record (``rollout-lab bench prefix-sharing``) as a figure.

    python scripts/plot_prefix_sharing.py data/results/prefix_sharing_qwen2.5-3b_bfloat16_cuda_h100_read-2-splits.json

Writes ``<out>/<record stem>.png`` and ``.svg`` (default out: this checkout's figures/). No device:
it reads the record only.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

from rollout_lab.measure.prefix_sharing import prefix_sharing_rows  # noqa: E402
from rollout_lab.measure.records import load_record  # noqa: E402
from rollout_lab.plots.prefix_sharing import plot_prefix_sharing  # noqa: E402
from rollout_lab.plots.style import save_figure  # noqa: E402
from rollout_lab.workspace import Workspace  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("record", type=Path, help="a .json record written by rollout-lab bench prefix-sharing")
    parser.add_argument("--out", type=Path, default=Workspace.resolve(Path(__file__).resolve().parents[1]).figures,
                        help="figure folder (default: this checkout's figures/)")
    parser.add_argument("--title", default="", help="the figure's title")
    args = parser.parse_args()
    if not args.record.is_file():
        parser.error(f"record {args.record} does not exist")
    try:
        record = load_record(args.record, "prefix_sharing")
    except ValueError as err:
        parser.error(str(err))
    for path in save_figure(plot_prefix_sharing(prefix_sharing_rows(record), title=args.title), args.out,
                            args.record.stem):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
