"""Draw the package's layers as a picture: the four folders, the modules in each, the one-way arrows.

    python scripts/plot_architecture.py          # -> figures/architecture.png and .svg

The modules are read from the tree and each arrow is an import that the code has (found by
parsing every module), so the picture cannot drift from the code. Deterministic: a rerun writes the
same files.
"""
from __future__ import annotations

import argparse
import ast
from pathlib import Path

import matplotlib.pyplot as plt
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

from rollout_lab.plots.style import PALETTE, save_figure

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "rollout_lab"
# the parts, top to bottom: every import of the code points from a row to a row below it
ROWS = {
    "cli": "rollout-lab: plan, calibrate, sweep, notebooks, reproduce, bench",
    "notebooks": "the papermill runner of notebooks/01-04 .ipynb (top level; the wheel ships them)",
    "plots": "one module per figure family; draws records, measures nothing",
    "measure": "models, workloads, calibration, sweeps, HF peers, the benchmarks, the studies behind the notebooks",
    "engine": "Rollout over a Hugging Face model (torch, transformers)",
    "planner": "cost model, DP, routes, fits, sharding: pure Python + numpy, never torch",
    "workspace": "where outputs go; atomic record pairs, locks, JSON read with limits (standard library only)",
}
COLORS = {"cli": 7, "notebooks": 7, "plots": 4, "measure": 2, "engine": 0, "planner": 1, "workspace": 7}
LEFT, WIDTH, ROW_HEIGHT, GAP = 0.27, 0.72, 0.118, 0.022


def part_of(module: str) -> str | None:
    """'rollout_lab.engine.api.rollout' -> 'engine'; None outside the package."""
    names = module.split(".")
    if names[0] != "rollout_lab" or len(names) < 2:
        return None
    return names[1] if names[1] in ROWS else None


def modules_of(part: str) -> list[Path]:
    folder = PACKAGE / part
    if folder.is_dir():
        return sorted(p for p in folder.glob("*.py") if p.name != "__init__.py") or [folder / "__init__.py"]
    return [PACKAGE / f"{part}.py"]


def arrows() -> dict[tuple[str, str], int]:
    """(importer part, imported part) -> number of import statements, every module parsed."""
    found: dict[tuple[str, str], int] = {}
    for part in ROWS:
        files = list((PACKAGE / part).glob("*.py")) if (PACKAGE / part).is_dir() else [PACKAGE / f"{part}.py"]
        for path in files:
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.ImportFrom) and node.module:
                    target = part_of(node.module)
                    if target is not None and target != part:
                        found[(part, target)] = found.get((part, target), 0) + 1
    return found


def draw() -> plt.Figure:
    fig, ax = plt.subplots(figsize=(13, 8.2))
    ax.set_axis_off()
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    top = {part: 0.93 - i * (ROW_HEIGHT + GAP) for i, part in enumerate(ROWS)}  # y of each box's top
    for part, what in ROWS.items():
        y, color = top[part] - ROW_HEIGHT, PALETTE(COLORS[part])
        ax.add_patch(FancyBboxPatch((LEFT, y), WIDTH, ROW_HEIGHT, boxstyle="round,pad=0.004",
                                    facecolor=(*color[:3], 0.12), edgecolor=color, linewidth=1.4))
        is_folder = (PACKAGE / part).is_dir()
        lines = sum(len(p.read_text(encoding="utf-8").splitlines()) for p in modules_of(part))
        ax.text(LEFT + 0.01, top[part] - 0.02, f"{part}/" if is_folder else f"{part}.py", fontsize=12,
                fontweight="bold", va="top")
        ax.text(LEFT + WIDTH - 0.01, top[part] - 0.02, f"{lines} lines", fontsize=8, va="top", ha="right",
                color="0.35")
        ax.text(LEFT + 0.01, top[part] - 0.05, what, fontsize=8.5, va="top", style="italic", color="0.25")
        if is_folder:  # module names, wrapped to the box (about 112 characters)
            rows: list[list[str]] = [[]]
            for name in (p.stem for p in modules_of(part)):
                if rows[-1] and len("  ".join(rows[-1] + [name])) > 112:
                    rows.append([])
                rows[-1].append(name)
            ax.text(LEFT + 0.01, y + 0.008, "\n".join("  ".join(r) for r in rows), fontsize=7.2,
                    va="bottom", family="monospace", linespacing=1.25)
    found = arrows()
    order = list(ROWS)
    edges = sorted(found, key=lambda e: (order.index(e[0]), -order.index(e[1])))
    lane_step = (LEFT - 0.04) / max(1, len(edges))
    for k, (src, dst) in enumerate(edges):
        lane = 0.02 + k * lane_step
        out_y = top[src] - ROW_HEIGHT * (0.25 + 0.5 * (k % 5) / 5)
        in_y = top[dst] - ROW_HEIGHT * (0.25 + 0.5 * ((k + 2) % 5) / 5)
        color = PALETTE(COLORS[dst])
        ax.plot([LEFT, lane, lane], [out_y, out_y, in_y], color=color, linewidth=1.0, alpha=0.85)
        ax.add_patch(FancyArrowPatch((lane, in_y), (LEFT, in_y), arrowstyle="-|>", mutation_scale=10,
                                     linewidth=1.0, color=color, alpha=0.85))
    up = [f"{s} -> {d}" for (s, d) in found if order.index(d) < order.index(s)]
    ax.set_title("rollout_lab: every import points down" + (f" (except {', '.join(up)})" if up else "")
                 + f"; {len(found)} arrows between parts, read from the code", fontsize=12, loc="left")
    return fig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "figures", help="figure folder (default figures/)")
    args = parser.parse_args()
    for path in save_figure(draw(), args.out, "architecture"):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
