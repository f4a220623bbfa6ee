"""Predicted makespans of the sharding methods across workloads and world sizes: table and figure.

    python scripts/plot_makespans.py   # -> data/tables/makespans.csv, figures/makespans.png

Pure cost-model numbers (no torch, no device): each rank's cost is its own Auto plan.
"""
from __future__ import annotations

import csv
import io
import os
import time
from pathlib import Path
from typing import Sequence

from rollout_lab.cost import CostCoefficients, ModelGeometry
from rollout_lab.io import write_text_atomic
from rollout_lab.sharding import METHODS, predicted_makespan, shard_requests
from rollout_lab.workloads import get_workload

WORKLOADS = ("short_similar", "long_tail", "short_tail", "moderate_tail", "spread",
             "gsm8k_64", "gsm8k_128", "humaneval_32", "gpqa_diamond_32")
WORLD_SIZES = (2, 3, 4, 8)
COLUMNS = ("workload", "num_prompts", "world_size", "method", "predicted_makespan_ms",
           "vs_balanced", "sharding_ms")


def makespan_rows(
    workloads: Sequence[str] = WORKLOADS,
    world_sizes: Sequence[int] = WORLD_SIZES,
    *,
    geometry: ModelGeometry | None = None,
    coeffs: CostCoefficients | None = None,
    max_new_tokens: int = 16,
    continuous_batch_size: int | None = None,
) -> list[dict]:
    """One row per (workload, world size, method); ``vs_balanced`` = makespan / balanced's."""
    geometry = geometry or ModelGeometry.qwen25_3b()
    coeffs = coeffs or CostCoefficients()
    kw = dict(max_new_tokens=max_new_tokens, continuous_batch_size=continuous_batch_size)
    rows = []
    for name in workloads:
        lengths = get_workload(name)
        for world_size in world_sizes:
            spans = {}
            for method in METHODS:
                start = time.perf_counter()
                shards = shard_requests(lengths, world_size, geometry, coeffs, method=method, **kw)
                elapsed_ms = (time.perf_counter() - start) * 1e3
                spans[method] = (predicted_makespan(shards, lengths, geometry, coeffs, **kw), elapsed_ms)
            for method, (span, elapsed_ms) in spans.items():
                rows.append(dict(
                    workload=name, num_prompts=len(lengths), world_size=world_size, method=method,
                    predicted_makespan_ms=round(span, 3),
                    vs_balanced=round(span / spans["balanced"][0], 4), sharding_ms=round(elapsed_ms, 2),
                ))
    return rows


def write_rows_csv(rows: Sequence[dict], path: str | os.PathLike) -> Path:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=COLUMNS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return write_text_atomic(path, buffer.getvalue())


def plot_makespans(rows: Sequence[dict], path: str | os.PathLike) -> Path:
    """One panel per workload: predicted makespan (ms) against world size, a bar per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
