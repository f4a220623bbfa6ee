"""What the planner chooses, and why: k-bucket DP, fixed-cost sweeps, route maps, tables.

The numbers behind ``notebooks/02_bucket_choices.ipynb`` and the explorer. Torch-free, pure
functions over prompt lengths (plus ``write_csv``). The distributions they run on live in
``rollout_lab.distributions`` and are re-exported here::

    from rollout_lab.analysis import plan_buckets_k, resolve_distribution
    label, lengths = resolve_distribution({"kind": "real", "dataset": "gsm8k"}, batch_size=32, seed=0)
    plan = plan_buckets_k(lengths, geometry, coeffs, 3)   # the best plan with exactly 3 buckets
"""
from __future__ import annotations

import csv
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import numpy as np

from rollout_lab.cost import CostCoefficients, ModelGeometry, dtype_bytes, per_row_cost_ms, prefill_cost_ms
from rollout_lab.distributions import (  # noqa: F401 (re-exported: the notebooks call analysis.*)
    DISTRIBUTION_KINDS, SEED_FIVE, Distribution, resolve_distribution, resolve_distributions,
)
from rollout_lab.planner import (
    BucketPlan, cb_decode_cost_ms, choose_route, nocb_cost_ms, plan_buckets, validate_lengths,
)

# (layers, query heads, kv heads, head_dim); the same table as ``rollout-lab plan --preset``
PRESET_GEOMETRY = {
    "qwen2.5-0.5b": (24, 14, 2, 64),
    "qwen2.5-3b": (36, 16, 2, 128),
    "qwen3-0.6b": (28, 16, 8, 128),
    "qwen3-32b": (64, 64, 8, 128),
}


def geometry_for(preset: str, dtype: str = "float32") -> ModelGeometry:
    """The cost model's geometry of a named preset with ``dtype`` KV elements."""
    if preset not in PRESET_GEOMETRY:
        raise ValueError(f"unknown preset {preset!r}; expected one of {sorted(PRESET_GEOMETRY)}")
    return ModelGeometry(*PRESET_GEOMETRY[preset], dtype_bytes(dtype))


def load_coeffs(cost_file: str | Path | None) -> CostCoefficients:
    """Coefficients from a cost file (``CostCoefficients.to_json`` or a calibration JSON); None = defaults."""
    if cost_file is None:
        return CostCoefficients()
    import json

    path = Path(cost_file)
    if not path.is_file():
        raise ValueError(f"cost file {str(path)!r} does not exist")
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict) or not isinstance(data.get("coefficients", data.get("coeffs")), dict):
        raise ValueError(f"cost file {str(path)!r} has no 'coefficients' object")
    return CostCoefficients.from_dict(data.get("coefficients", data.get("coeffs")))



# ---------------------------------------------------------------- k-bucket DP

def plans_by_num_buckets(
    lengths: Sequence[int], geometry: ModelGeometry, coeffs: CostCoefficients, max_num_buckets: int
) -> list[BucketPlan | None]:
    """The cheapest plan with exactly k buckets, for k = 1..max_num_buckets (None: infeasible).

    Layered DP over the sorted lengths: best_k[j] = min_i best_{k-1}[i] + C(j - i, w_j), with each
    bucket within ``prefill_max_tokens``. O(k n^2) time, numpy over i. k is capped at n.
    """
    lengths = validate_lengths(lengths, coeffs)
    if max_num_buckets < 1:
        raise ValueError(f"max_num_buckets must be >= 1, got {max_num_buckets}")
    n = len(lengths)
    if n == 0:
        return [BucketPlan((), (), 0.0)] + [None] * (max_num_buckets - 1)
    order = sorted(range(n), key=lengths.__getitem__)
    widths = np.array([lengths[i] for i in order])
    f = np.array([per_row_cost_ms(int(w), geometry, coeffs) for w in widths])
    limit = coeffs.prefill_max_tokens
    i_idx = np.arange(n)
    num_layers = min(max_num_buckets, n)
    best = np.full(n + 1, math.inf)
    best[0] = 0.0
    cuts = []  # cuts[k][j]: start of the last bucket in the best k+1-bucket plan of the first j
    is_feasible = []
    for _ in range(num_layers):
        nxt = np.full(n + 1, math.inf)
        cut = np.zeros(n + 1, dtype=int)
        for j in range(1, n + 1):
            rows = j - i_idx[:j]
            cand = best[:j] + coeffs.prefill_fixed_cost_ms + rows * f[j - 1]
            if limit is not None:
                cand = np.where(rows * widths[j - 1] <= limit, cand, math.inf)
            i = int(np.argmin(cand))
            nxt[j], cut[j] = cand[i], i
        cuts.append(cut)
        is_feasible.append(math.isfinite(nxt[n]))
        best = nxt
    plans = [_backtrack(order, widths, cuts[:k], geometry, coeffs) if is_feasible[k - 1] else None
             for k in range(1, num_layers + 1)]
    return plans + [None] * (max_num_buckets - num_layers)


def _backtrack(order, widths, cuts, geometry, coeffs) -> BucketPlan:
    j, bounds = len(order), []
    for cut in reversed(cuts):
        i = int(cut[j])
        bounds.append((i, j))
        j = i
    bounds.reverse()
    buckets = tuple(tuple(order[i:j]) for i, j in bounds)
    bucket_widths = tuple(int(widths[j - 1]) for _, j in bounds)
    cost = sum(prefill_cost_ms(len(b), w, geometry, coeffs) for b, w in zip(buckets, bucket_widths))
    return BucketPlan(buckets, bucket_widths, cost)


def plan_buckets_k(
    lengths: Sequence[int], geometry: ModelGeometry, coeffs: CostCoefficients, num_buckets: int
) -> BucketPlan | None:
    """The cheapest plan with exactly ``num_buckets`` contiguous buckets; None when infeasible."""
    return plans_by_num_buckets(lengths, geometry, coeffs, num_buckets)[num_buckets - 1]


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
    distributions: Sequence[Distribution], geometry: ModelGeometry, coeffs: CostCoefficients,
    *, max_num_buckets: int,
) -> list[dict[str, Any]]:
    """Per distribution, seed and k: cost, padded tokens and padding share of the best k-bucket plan."""
    rows = []
    for dist, seed, lengths in _samples(distributions):
        optimum = plan_buckets(lengths, geometry, coeffs)
        plans = plans_by_num_buckets(lengths, geometry, coeffs, max_num_buckets)
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
    distributions: Sequence[Distribution], geometry: ModelGeometry, coeffs: CostCoefficients,
    *, fixed_costs_ms: Sequence[float],
) -> list[dict[str, Any]]:
    """The DP's choice (first seed) as ``prefill_fixed_cost_ms`` moves; widths as 'w1;w2;...'."""
    rows = []
    for dist in distributions:
        lengths = dist.lengths
        for fixed in fixed_costs_ms:
            swept = replace(coeffs, prefill_fixed_cost_ms=float(fixed))
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
    distributions: Sequence[Distribution], geometry: ModelGeometry, coeffs: CostCoefficients,
    *, max_new_tokens: int,
) -> list[dict[str, Any]]:
    """One row per distribution and seed: one bucket against the DP, and the route Auto takes."""
    rows = []
    for dist, seed, lengths in _samples(distributions):
        plan = plan_buckets(lengths, geometry, coeffs)
        one = prefill_cost_ms(len(lengths), max(lengths), geometry, coeffs)
        route = choose_route(lengths, max_new_tokens=max_new_tokens, continuous_batch_size=None,
                             geometry=geometry, coeffs=coeffs)
        rows.append({
            "distribution": dist.label, "kind": dist.kind, "seed": seed, "num_prompts": len(lengths),
            "min_len": min(lengths), "median_len": float(np.median(lengths)), "max_len": max(lengths),
            "one_bucket_padding_share": 1.0 - sum(lengths) / (len(lengths) * max(lengths)),
            "dp_padding_share": plan_padding_share(lengths, plan),
            "dp_num_buckets": plan.num_buckets, "dp_widths": ";".join(map(str, plan.widths)),
            "one_bucket_cost_ms": one, "dp_cost_ms": plan.cost_ms, "dp_speedup": one / plan.cost_ms,
            "max_new_tokens": max_new_tokens, "route": route.route,
            "nocb_cost_ms": route.nocb_cost_ms,
            "cb_cost_ms": plan.cost_ms + cb_decode_cost_ms(max_new_tokens, coeffs),
        })
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
    label: str, lengths: Sequence[int], geometry: ModelGeometry, coeffs: CostCoefficients,
    *, max_lengths: Sequence[int], budgets: Sequence[int],
) -> RouteMap:
    """Rescale the lengths so the longest is each of ``max_lengths``; choose a route for each budget.

    All prompts form one batch (every request fits the slots). The route follows ``choose_route``'s
    rule (tests check they agree); both estimates are exact; nocb is inf where not eligible.
    """
    from rollout_lab.workloads import scale_lengths

    longest = max(lengths)
    scales = [int(m) / longest for m in max_lengths]
    columns = [scale_lengths(lengths, s) for s in scales]
    limit = coeffs.prefill_max_tokens
    # the DP's cost does not depend on the budget: plan each column once
    nocb_cols = [nocb_cost_ms(c, geometry, coeffs) if limit is None or len(c) * max(c) <= limit else math.inf
                 for c in columns]
    dp_cols = [plan_buckets(c, geometry, coeffs).cost_ms for c in columns]
    nocb, cb, routes = [], [], []
    for budget in budgets:
        decode = cb_decode_cost_ms(int(budget), coeffs)
        row_c = tuple(d + decode for d in dp_cols)
        nocb.append(tuple(nocb_cols))
        cb.append(row_c)
        # choose_route's rule: nocb when eligible and not dearer (ties go to nocb)
        routes.append(tuple("nocb" if n <= c else "bucketed" for n, c in zip(nocb_cols, row_c)))
    return RouteMap(label, tuple(scales), tuple(max(c) for c in columns),
                    tuple(int(b) for b in budgets), tuple(nocb), tuple(cb), tuple(routes))


def write_csv(rows: Sequence[Mapping[str, Any]], path: str | Path) -> Path:
    """Rows of flat dicts as CSV (columns in first-seen order); the folder is created."""
    path = Path(path)
    if not rows:
        raise ValueError(f"no rows to write to {path}")
    columns: list[str] = []
    for row in rows:
        columns += [k for k in row if k not in columns]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    tmp.replace(path)
    return path
