"""Predicted makespans of the sharding methods across workloads and world sizes: table and figure.

    python scripts/plot_makespans.py   # -> data/tables/makespans.csv, figures/makespans.png

Pure cost-model numbers (no torch, no device): each rank's cost is its own Auto plan.

"""
from __future__ import annotations

import time
from typing import Sequence

from rollout_lab.measure.workloads import get_workload
from rollout_lab.planner.cost import CostCoefficients, ModelGeometry
from rollout_lab.planner.sharding import METHODS, predicted_makespan, shard_requests

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
    costs: CostCoefficients | None = None,
    max_new_tokens: int = 16,
    continuous_batch_size: int | None = None,
) -> list[dict]:
    """One row per (workload, world size, method); ``vs_balanced`` = makespan / balanced's."""
    geometry = geometry or ModelGeometry.qwen25_3b()
    costs = costs or CostCoefficients()
    kw = dict(max_new_tokens=max_new_tokens, continuous_batch_size=continuous_batch_size)
    rows = []
    for name in workloads:
        lengths = get_workload(name)
        for world_size in world_sizes:
            spans = {}
            for method in METHODS:
                start = time.perf_counter()
                shards = shard_requests(lengths, world_size, geometry, costs, method=method, **kw)
                elapsed_ms = (time.perf_counter() - start) * 1e3
                spans[method] = (predicted_makespan(shards, lengths, geometry, costs, **kw), elapsed_ms)
            for method, (span, elapsed_ms) in spans.items():
                rows.append(dict(
                    workload=name, num_prompts=len(lengths), world_size=world_size, method=method,
                    predicted_makespan_ms=round(span, 3),
                    vs_balanced=round(span / spans["balanced"][0], 4), sharding_ms=round(elapsed_ms, 2),
                ))
    return rows
