"""Render a bench record that has a figure of its own (prefix sharing, partial rollouts) as a figure.

    python scripts/plot_record.py data/results/prefix_sharing_qwen2.5-3b_bfloat16_cuda_h100_read-2-splits.json
    python scripts/plot_record.py data/results/partial_rollouts_qwen2.5-0.5b_bfloat16_cuda_h100.json

Writes ``<out>/<record stem>.png`` and ``.svg`` (default out: this checkout's figures/). No device:
it reads the record only; its ``kind`` picks the figure.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

from rollout_lab.measure.prefix_sharing import prefix_sharing_rows  # noqa: E402
from rollout_lab.measure.records import load_record  # noqa: E402
from rollout_lab.plots.partial_rollouts import plot_partial_rollouts  # noqa: E402
from rollout_lab.plots.prefix_sharing import plot_prefix_sharing  # noqa: E402
from rollout_lab.plots.style import save_figure  # noqa: E402
from rollout_lab.workspace import Workspace  # noqa: E402

FIGURES = {  # a record's kind -> its figure, from the loaded record
    "prefix_sharing": lambda record, title: plot_prefix_sharing(prefix_sharing_rows(record), title=title),
    "partial_rollouts": lambda record, title: plot_partial_rollouts(record, title=title),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("record", type=Path, help=f"a .json record of one of the kinds {list(FIGURES)}")
    parser.add_argument("--out", type=Path, default=Workspace.resolve(Path(__file__).resolve().parents[1]).figures,
                        help="figure folder (default: this checkout's figures/)")
    parser.add_argument("--title", default="", help="the figure's title")
    args = parser.parse_args()
    if not args.record.is_file():
        parser.error(f"record {args.record} does not exist")
    try:
        kind = json.loads(args.record.read_text()).get("kind")
    except (ValueError, AttributeError) as err:
        parser.error(f"record {args.record} is not a JSON record: {err}")
    if kind not in FIGURES:
        parser.error(f"record {args.record} is of kind {kind!r}; this script draws {list(FIGURES)}")
    try:
        record = load_record(args.record, kind)
    except ValueError as err:
        parser.error(str(err))
    for path in save_figure(FIGURES[kind](record, args.title), args.out, args.record.stem):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
