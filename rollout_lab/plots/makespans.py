"""The sharding figure: predicted rollout makespan per workload and world size, a bar per method.

    rows = makespan_rows()                      # rollout_lab.measure.makespans
    plot_makespans(rows, "figures/makespans.png")
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

import matplotlib.pyplot as plt

from rollout_lab.planner.sharding import METHODS


def plot_makespans(rows: Sequence[dict], path: str | os.PathLike) -> Path:
    """One panel per workload: predicted makespan (ms) against world size, a bar per method."""
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    world_sizes = sorted({r["world_size"] for r in rows})
    ncols = 3
    nrows = -(-len(workloads) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, 3.0 * nrows), squeeze=False)
    width = 0.8 / len(METHODS)
    for ax, name in zip(axes.flat, workloads):
        for m, method in enumerate(METHODS):
            values = {r["world_size"]: r["predicted_makespan_ms"] for r in rows
                      if r["workload"] == name and r["method"] == method}
            xs = [i + (m - (len(METHODS) - 1) / 2) * width for i in range(len(world_sizes))]
            ax.bar(xs, [values[w] for w in world_sizes], width, label=method.replace("_", " "))
        ax.set_xticks(range(len(world_sizes)), [str(w) for w in world_sizes])
        n = next(r["num_prompts"] for r in rows if r["workload"] == name)
        ax.set_title(f"{name} ({n} prompts)", fontsize=10)
        ax.set_xlabel("ranks")
        ax.set_ylabel("predicted makespan (ms)")
    for ax in list(axes.flat)[len(workloads):]:
        ax.set_visible(False)
    axes.flat[0].legend(fontsize=8)
    fig.suptitle("Predicted rollout makespan: cost-balanced vs round-robin vs verl KK "
                 "(Qwen2.5-3B geometry, seed coefficients, each rank runs Auto)", fontsize=11)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path
