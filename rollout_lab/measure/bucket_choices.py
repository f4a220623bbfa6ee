"""What the planner chooses, and why: k-bucket DP, fixed-cost sweeps, route maps, tables.

The numbers behind ``notebooks/02_bucket_choices.ipynb`` and the explorer. Torch-free, pure
functions over prompt lengths (plus ``write_csv``). The distributions they run on live in
``rollout_lab.measure.workloads``::

    from rollout_lab.planner.bucket_dp import plan_buckets_k
    from rollout_lab.measure.workloads import resolve_distribution
    label, lengths = resolve_distribution({"kind": "real", "dataset": "gsm8k"}, batch_size=32, seed=0)
    plan = plan_buckets_k(lengths, geometry, costs, 3)   # the best plan with exactly 3 buckets

"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Iterator, Sequence

import numpy as np

from rollout_lab.measure.workloads import Distribution, crossing_batches, scale_lengths
from rollout_lab.planner.bucket_dp import BucketPlan, plan_buckets, plans_by_num_buckets
from rollout_lab.planner.cost import CostCoefficients, ModelGeometry, prefill_cost_ms
from rollout_lab.planner.packing import plan_packed
from rollout_lab.planner.routes import cb_decode_cost_ms, choose_route, nocb_cost_ms
from rollout_lab.planner.shape_classes import ShapeClasses, plan_buckets_classed


def plan_padding_share(lengths: Sequence[int], plan: BucketPlan) -> float:
    """Padded positions / all positions of the plan's forwards."""
    total = plan.num_padded_tokens
    return 0.0 if total == 0 else 1.0 - sum(lengths) / total


# ---------------------------------------------------------------- tables

def _samples(distributions: Sequence[Distribution]) -> Iterator[tuple[Distribution, int, list[int]]]:
    """(distribution, seed, lengths) for every seed's sample of every distribution, in order."""
    for dist in distributions:
        for seed, sample in zip(dist.seeds, dist.samples):
            yield dist, seed, list(sample)


def num_buckets_rows(
    distributions: Sequence[Distribution], geometry: ModelGeometry, costs: CostCoefficients,
    *, max_num_buckets: int,
) -> list[dict[str, Any]]:
    """Per distribution, seed and k: cost, padded tokens and padding share of the best k-bucket plan."""
    rows = []
    for dist, seed, lengths in _samples(distributions):
        optimum = plan_buckets(lengths, geometry, costs)
        plans = plans_by_num_buckets(lengths, geometry, costs, max_num_buckets)
        one = plans[0]
        for k, plan in enumerate(plans, start=1):
            if plan is None:
                continue
            rows.append({
                "distribution": dist.label, "seed": seed, "num_prompts": len(lengths),
                "num_buckets": k, "cost_ms": plan.cost_ms,
                "cost_vs_one_bucket": plan.cost_ms / one.cost_ms if one else math.nan,
                "num_padded_tokens": plan.num_padded_tokens,
                "padding_share": plan_padding_share(lengths, plan),
                "is_dp_choice": k == optimum.num_buckets,
            })
    return rows


def fixed_cost_rows(
    distributions: Sequence[Distribution], geometry: ModelGeometry, costs: CostCoefficients,
    *, fixed_costs_ms: Sequence[float],
) -> list[dict[str, Any]]:
    """The DP's choice (first seed) as ``prefill_fixed_cost_ms`` moves; widths as 'w1;w2;...'."""
    rows = []
    for dist in distributions:
        lengths = dist.lengths
        for fixed in fixed_costs_ms:
            swept = replace(costs, prefill_fixed_cost_ms=float(fixed))
            plan = plan_buckets(lengths, geometry, swept)
            rows.append({
                "distribution": dist.label, "fixed_cost_ms": float(fixed),
                "num_buckets": plan.num_buckets, "cost_ms": plan.cost_ms,
                "one_bucket_cost_ms": prefill_cost_ms(len(lengths), max(lengths), geometry, swept),
                "padding_share": plan_padding_share(lengths, plan),
                "widths": ";".join(str(w) for w in plan.widths),
                "bucket_sizes": ";".join(str(len(b)) for b in plan.buckets),
            })
    return rows


def summary_rows(
    distributions: Sequence[Distribution], geometry: ModelGeometry, costs: CostCoefficients,
    *, max_new_tokens: int,
) -> list[dict[str, Any]]:
    """One row per distribution and seed: one bucket against the DP, and the route Auto takes."""
    rows = []
    for dist, seed, lengths in _samples(distributions):
        plan = plan_buckets(lengths, geometry, costs)
        one = prefill_cost_ms(len(lengths), max(lengths), geometry, costs)
        route = choose_route(lengths, max_new_tokens=max_new_tokens, continuous_batch_size=None,
                             geometry=geometry, costs=costs)
        rows.append({
            "distribution": dist.label, "kind": dist.kind, "seed": seed, "num_prompts": len(lengths),
            "min_len": min(lengths), "median_len": float(np.median(lengths)), "max_len": max(lengths),
            "one_bucket_padding_share": 1.0 - sum(lengths) / (len(lengths) * max(lengths)),
            "dp_padding_share": plan_padding_share(lengths, plan),
            "dp_num_buckets": plan.num_buckets, "dp_widths": ";".join(map(str, plan.widths)),
            "one_bucket_cost_ms": one, "dp_cost_ms": plan.cost_ms, "dp_speedup": one / plan.cost_ms,
            "max_new_tokens": max_new_tokens, "route": route.route,
            "nocb_cost_ms": route.nocb_cost_ms,
            "cb_cost_ms": plan.cost_ms + cb_decode_cost_ms(max_new_tokens, costs),
        })
    return rows


def plan_comparison_rows(
    distributions: Sequence[Distribution], geometry: ModelGeometry, calibrated: CostCoefficients,
    reference: CostCoefficients | None = None, *, max_new_tokens: int,
) -> list[dict[str, Any]]:
    """One row per distribution and seed: the DP's plan and Auto's route under the reference
    coefficients and under a calibration, and what the reference plan would cost on the calibrated
    device (``regret``: that cost over the calibrated plan's, >= 1 since the DP is optimal there)."""
    reference = CostCoefficients() if reference is None else reference
    rows = []
    for dist, seed, lengths in _samples(distributions):
        row: dict[str, Any] = {"distribution": dist.label, "kind": dist.kind, "seed": seed, "num_prompts": len(lengths)}
        plans = {}
        for name, costs in (("reference", reference), ("calibrated", calibrated)):
            plan = plans[name] = plan_buckets(lengths, geometry, costs)
            route = choose_route(lengths, max_new_tokens=max_new_tokens, continuous_batch_size=None,
                                 geometry=geometry, costs=costs)
            row |= {f"{name}_num_buckets": plan.num_buckets, f"{name}_widths": ";".join(map(str, plan.widths)),
                    f"{name}_padding_share": plan_padding_share(lengths, plan), f"{name}_route": route.route}
        on_device = sum(prefill_cost_ms(len(bucket), width, geometry, calibrated)
                        for bucket, width in zip(plans["reference"].buckets, plans["reference"].widths))
        row |= {"calibrated_cost_ms": plans["calibrated"].cost_ms, "reference_plan_on_calibrated_ms": on_device,
                "regret": on_device / plans["calibrated"].cost_ms}
        rows.append(row)
    return rows


@dataclass(frozen=True)
class RouteMap:
    """nocb against bucketed CB over rescaled prompt lengths (columns) and generation budgets (rows)."""

    label: str
    scales: tuple[float, ...]
    max_lengths: tuple[int, ...]
    budgets: tuple[int, ...]
    nocb_ms: tuple[tuple[float, ...], ...]  # [budget][scale]
    cb_ms: tuple[tuple[float, ...], ...]
    routes: tuple[tuple[str, ...], ...]

    def rows(self) -> list[dict[str, Any]]:
        return [
            {"distribution": self.label, "scale": s, "max_len": m, "max_new_tokens": b,
             "nocb_cost_ms": self.nocb_ms[r][c], "cb_cost_ms": self.cb_ms[r][c], "route": self.routes[r][c]}
            for r, b in enumerate(self.budgets) for c, (s, m) in enumerate(zip(self.scales, self.max_lengths))
        ]


def route_map(
    label: str, lengths: Sequence[int], geometry: ModelGeometry, costs: CostCoefficients,
    *, max_lengths: Sequence[int], budgets: Sequence[int],
) -> RouteMap:
    """Rescale the lengths so the longest is each of ``max_lengths``; choose a route for each budget.

    All prompts form one batch (every request fits the slots). The route follows ``choose_route``'s
    rule (tests check they agree); both estimates are exact; nocb is inf where not eligible.
    """
    longest = max(lengths)
    scales = [int(m) / longest for m in max_lengths]
    columns = [scale_lengths(lengths, s) for s in scales]
    limit = costs.prefill_max_tokens
    # the DP's cost does not depend on the budget: plan each column once
    nocb_cols = [nocb_cost_ms(c, geometry, costs) if limit is None or len(c) * max(c) <= limit else math.inf
                 for c in columns]
    dp_cols = [plan_buckets(c, geometry, costs).cost_ms for c in columns]
    nocb, cb, routes = [], [], []
    for budget in budgets:
        decode = cb_decode_cost_ms(int(budget), costs)
        row_c = tuple(d + decode for d in dp_cols)
        nocb.append(tuple(nocb_cols))
        cb.append(row_c)
        # choose_route's rule: nocb when eligible and not dearer (ties go to nocb)
        routes.append(tuple("nocb" if n <= c else "bucketed" for n, c in zip(nocb_cols, row_c)))
    return RouteMap(label, tuple(scales), tuple(max(c) for c in columns),
                    tuple(int(b) for b in budgets), tuple(nocb), tuple(cb), tuple(routes))


# ---------------------------------------------------------------- packed against bucketed

PACKED_BATCH_SIZES = (32, 64, 128, 256, 512)


def packed_crossing_rows(
    geometry: ModelGeometry, costs: CostCoefficients, *, batch_sizes: Sequence[int] = PACKED_BATCH_SIZES,
    seeds: Sequence[int] = (0, 1, 2), classes: ShapeClasses | None = None,
) -> list[dict[str, Any]]:
    """Where packed and bucketed prefill cross, from the cost model, on the lognormal and bimodal
    batches of each size (``measure.workloads.crossing_batches``; a row per distribution, size, seed).

    Packed costs ``packed_zero_ms + n * c`` with ``c`` = ``packed_prompt_cost_ms``, so it wins while
    ``c`` < ``crossing_ms_per_prompt`` = (bucketed - packed_zero) / n; ``packed_wins`` applies the
    coefficients' own ``c`` (None when they have none: not calibrated). With ``classes`` every bucket
    is priced at its class shape (``plan_buckets_classed``), as the engine plans and runs it with
    ``RolloutConfig(prefill_classes=...)``: the padding up to the class widths is in the price."""
    zero = replace(costs, packed_prompt_cost_ms=0.0)
    rows = []
    for n in batch_sizes:
        for seed in seeds:
            for kind, lengths in crossing_batches(n, seed).items():
                bucketed = (plan_buckets(lengths, geometry, costs) if classes is None
                            else plan_buckets_classed(lengths, geometry, costs, classes))
                packed = plan_packed(lengths, geometry, zero)
                crossing = (bucketed.cost_ms - packed.cost_ms) / n
                c = costs.packed_prompt_cost_ms
                rows.append({
                    "distribution": kind, "batch_size": n, "seed": seed, "num_tokens": sum(lengths),
                    "bucketed_ms": bucketed.cost_ms, "bucketed_forwards": bucketed.num_buckets,
                    "bucketed_padding_share": plan_padding_share(lengths, bucketed),
                    "packed_zero_ms": packed.cost_ms, "packed_forwards": packed.num_buckets,
                    "crossing_ms_per_prompt": crossing,
                    "packed_wins": None if c is None else c < crossing,
                })
    return rows
