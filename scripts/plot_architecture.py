"""Draw the package's layers as a picture: the folders, the modules in each, the one-way arrows; and
the engine's rooms the same way.

    python scripts/plot_architecture.py          # -> figures/architecture.png/.svg and figures/engine.png/.svg

The modules are read from the tree and each arrow is an import that the code has (found by
parsing every module, subfolders included), so the picture cannot drift from the code.
Deterministic: a rerun writes the same files.
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
# the engine's rooms, top to bottom (engine/__init__.py says the same in words)
ENGINE_ROWS = {
    "distributed": "the data-parallel rollout: one Rollout per rank, the requests split by the planner",
    "api": "Rollout (the facade), RolloutConfig, the call spec checked once, the result, the costs, the loader",
    "sched": "a Request per row; one scheduler per cache (aligned, paged) over one loop; HF generate (nocb)",
    "runner": "the model runner: prefill (plain, captured), the captured and compiled decode step, weights",
    "trainer": "the padded batch a trainer steps on, its teacher-forced logprobs, the GRPO losses",
    "kv": "the aligned and the paged KV caches, and the one module that sizes them",
    "sample": "SamplingParams (vLLM's fields), penalties and processors, the seeded sampler, stop strings",
    "kernels": "the one door to the decode-attention kernels; Triton imported and checked in one place",
    "profile": "the phase times and forwards a call reports",
    "limits": "every size against the model's context and the device's memory, for the API and the CLI",
    "model_info": "a model's name and provenance (cost files, compile caches)",
}
ENGINE_COLORS = {"distributed": 7, "api": 0, "sched": 2, "runner": 4, "trainer": 7, "kv": 1, "sample": 3,
                 "kernels": 5, "profile": 7, "limits": 7, "model_info": 7}
LEFT, WIDTH, ROW_HEIGHT, GAP = 0.27, 0.72, 0.118, 0.022


def part_of(module: str, root: str, rows: dict) -> str | None:
    """'rollout_lab.engine.api.rollout' -> 'engine' under root 'rollout_lab' ('api' under
    'rollout_lab.engine'); None outside ``root`` or for a part not in ``rows``."""
    prefix = root.split(".")
    names = module.split(".")
    if names[: len(prefix)] != prefix or len(names) <= len(prefix):
        return None
    return names[len(prefix)] if names[len(prefix)] in rows else None


def files_of(folder: Path, part: str) -> list[Path]:
    """Every module of ``part`` (a folder's, subfolders included, or one file)."""
    return sorted((folder / part).rglob("*.py")) if (folder / part).is_dir() else [folder / f"{part}.py"]


def modules_of(folder: Path, part: str) -> list[Path]:
    """The modules a box lists: a folder's own, its subfolders as one entry each (``api/``)."""
    if (folder / part).is_dir():
        own = sorted(p for p in (folder / part).glob("*.py") if p.name not in ("__init__.py", "__main__.py"))
        subs = sorted(p for p in (folder / part).iterdir() if p.is_dir() and (p / "__init__.py").exists())
        return own + subs or [folder / part / "__init__.py"]
    return [folder / f"{part}.py"]


def arrows(folder: Path, root: str, rows: dict) -> dict[tuple[str, str], int]:
    """(importer part, imported part) -> number of import statements, every module parsed."""
    found: dict[tuple[str, str], int] = {}
    for part in rows:
        for path in files_of(folder, part):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.ImportFrom) and node.module:
                    target = part_of(node.module, root, rows)
                    if target is not None and target != part:
                        found[(part, target)] = found.get((part, target), 0) + 1
    return found


def draw(folder: Path = PACKAGE, root: str = "rollout_lab", rows: dict = ROWS, colors: dict = COLORS,
         title: str = "rollout_lab") -> plt.Figure:
    parts = {p.stem for p in folder.iterdir() if p.name != "__init__.py" and (p.suffix == ".py" or
                                                                          (p / "__init__.py").exists())}
    if parts - set(rows):  # a part the drawing would leave out: give it a row (and words)
        raise SystemExit(f"{folder} has parts with no row to draw them in: {sorted(parts - set(rows))}")
    height = max(1.0, 0.1 + len(rows) * (ROW_HEIGHT + GAP))  # more rows: a taller figure, the same boxes
    fig, ax = plt.subplots(figsize=(13, 8.2 * height))
    ax.set_axis_off()
    ax.set_xlim(0, 1)
    ax.set_ylim(0, height)
    top = {part: height - 0.07 - i * (ROW_HEIGHT + GAP) for i, part in enumerate(rows)}  # y of each box's top
    for part, what in rows.items():
        y, color = top[part] - ROW_HEIGHT, PALETTE(colors[part])
        ax.add_patch(FancyBboxPatch((LEFT, y), WIDTH, ROW_HEIGHT, boxstyle="round,pad=0.004",
                                    facecolor=(*color[:3], 0.12), edgecolor=color, linewidth=1.4))
        is_folder = (folder / part).is_dir()
        lines = sum(len(p.read_text(encoding="utf-8").splitlines()) for p in files_of(folder, part))
        ax.text(LEFT + 0.01, top[part] - 0.02, f"{part}/" if is_folder else f"{part}.py", fontsize=12,
                fontweight="bold", va="top")
        ax.text(LEFT + WIDTH - 0.01, top[part] - 0.02, f"{lines} lines", fontsize=8, va="top", ha="right",
                color="0.35")
        ax.text(LEFT + 0.01, top[part] - 0.05, what, fontsize=8.5, va="top", style="italic", color="0.25")
        if is_folder:  # module names, wrapped to the box (about 122 characters)
            wrapped: list[list[str]] = [[]]
            for name in (p.stem if p.suffix else f"{p.name}/" for p in modules_of(folder, part)):
                if wrapped[-1] and len("  ".join(wrapped[-1] + [name])) > 122:
                    wrapped.append([])
                wrapped[-1].append(name)
            ax.text(LEFT + 0.01, y + 0.008, "\n".join("  ".join(r) for r in wrapped), fontsize=7.2,
                    va="bottom", family="monospace", linespacing=1.25)
    found = arrows(folder, root, rows)
    order = list(rows)
    edges = sorted(found, key=lambda e: (order.index(e[0]), -order.index(e[1])))
    lane_step = (LEFT - 0.04) / max(1, len(edges))
    for k, (src, dst) in enumerate(edges):
        lane = 0.02 + k * lane_step
        out_y = top[src] - ROW_HEIGHT * (0.25 + 0.5 * (k % 5) / 5)
        in_y = top[dst] - ROW_HEIGHT * (0.25 + 0.5 * ((k + 2) % 5) / 5)
        color = PALETTE(colors[dst])
        ax.plot([LEFT, lane, lane], [out_y, out_y, in_y], color=color, linewidth=1.0, alpha=0.85)
        ax.add_patch(FancyArrowPatch((lane, in_y), (LEFT, in_y), arrowstyle="-|>", mutation_scale=10,
                                     linewidth=1.0, color=color, alpha=0.85))
    up = [f"{s} -> {d}" for (s, d) in found if order.index(d) < order.index(s)]
    ax.set_title(f"{title}: every import points down" + (f" (except {', '.join(up)})" if up else "")
                 + f"; {len(found)} arrows between parts, read from the code", fontsize=12, loc="left")
    return fig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "figures", help="figure folder (default figures/)")
    args = parser.parse_args()
    for path in save_figure(draw(), args.out, "architecture"):
        print(f"wrote {path}")
    engine = draw(PACKAGE / "engine", "rollout_lab.engine", ENGINE_ROWS, ENGINE_COLORS, "rollout_lab/engine")
    for path in save_figure(engine, args.out, "engine"):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
