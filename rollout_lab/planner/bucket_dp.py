"""The exactly optimal bucket DP over length-sorted prompts, and its O(n^2) oracle.

The cost of a bucket (i, j] of the sorted lengths is C(j - i, w_j) = fixed + (j - i) * f(w_j),
with w_j the bucket's longest prompt and f non-decreasing. So

    best[j] = fixed + j * f_j + min_{lo_j <= i < j} (best[i] - i * f_j)

is a minimum over lines of slope -i queried at the non-decreasing points f_j: a convex-hull
trick with a sliding window (lo_j, from the token limit, is non-decreasing too). Lines that the
window uncovers are put back at the front of the hull, so the result stays exactly optimal.
``plan_buckets_quadratic`` is the plain O(n^2) DP, kept as the oracle.

Pure Python (no torch), deterministic, no I/O.

"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

import numpy as np

from rollout_lab.planner.checks import as_int, check_int
from rollout_lab.planner.cost import CostCoefficients, ModelGeometry, check_pricing, per_row_cost_ms, prefill_cost_ms

# Tie-break: each bucket carries an extra TIE_REL * (one-bucket cost of all prompts), so that on
# equal cost (to that tolerance, well above float noise) fewer buckets win.
TIE_REL = 1e-10


@dataclass(frozen=True)
class BucketPlan:
    """Buckets as tuples of indices into the input lengths, shortest bucket first."""

    buckets: tuple[tuple[int, ...], ...]
    widths: tuple[int, ...]
    cost_ms: float
    # chunked prefill: (request index, widths of its tail chunks); its bucket entry is its head
    chunks: tuple[tuple[int, tuple[int, ...]], ...] = ()
    # packed route (planner.packing): each bucket is one packed forward and its width the tokens
    # in it (no padding), not a padded width
    packed: bool = False
    # shape classes (planner.shape_classes): each bucket's class row count (its prompts, then
    # repeats of one of them); empty: every bucket runs at its own row count
    rows: tuple[int, ...] = ()

    @property
    def num_buckets(self) -> int:
        return len(self.buckets)

    @property
    def num_forwards(self) -> int:
        """Prefill forwards: one per bucket plus one per tail chunk."""
        return len(self.buckets) + sum(len(tail) for _, tail in self.chunks)

    @property
    def num_padded_tokens(self) -> int:
        tails = sum(sum(tail) for _, tail in self.chunks)
        if self.packed:
            return sum(self.widths) + tails
        rows = self.rows or tuple(len(b) for b in self.buckets)
        return sum(r * w for r, w in zip(rows, self.widths)) + tails


def validate_lengths(lengths: Sequence[int], costs: CostCoefficients | None = None) -> list[int]:
    """Positive ints, each within ``prefill_max_tokens`` (no limit when ``costs`` is None);
    the error names the index and value."""
    if isinstance(lengths, (str, bytes, Mapping)) or not isinstance(lengths, Iterable):
        raise ValueError(f"lengths must be a list of prompt lengths (ints >= 1), got {lengths!r}")
    out = []
    for index, length in enumerate(lengths):
        if as_int(length) is None:
            raise ValueError(f"length at index {index} must be a positive int, got {length!r}")
        length = int(length)
        if length < 1:
            raise ValueError(f"length at index {index} must be a positive int, got {length!r}")
        limit = None if costs is None else costs.prefill_max_tokens
        if limit is not None and length > limit:
            raise ValueError(
                f"prompt at index {index} has length {length}, over prefill_max_tokens={limit}; "
                "raise the limit, set it to None, or plan it with plan_chunked"
            )
        out.append(length)
    return out


def _sorted_problem(lengths, geometry, costs):
    """The DP's inputs: sort order, sorted widths, per-row costs f, fixed cost (with the
    tie-break), and the token window's starts."""
    check_pricing(geometry, costs)
    lengths = validate_lengths(lengths, costs)
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    widths = [lengths[i] for i in order]
    per_row = {}
    for w in widths:
        if w not in per_row:
            per_row[w] = per_row_cost_ms(w, geometry, costs)
    f = [per_row[w] for w in widths]
    if not f:
        return order, widths, f, 0.0, []
    return order, widths, f, _fixed_with_tie_break(costs, f), _window_starts(widths, costs.prefill_max_tokens)


def _window_starts(widths: list[int], limit: int | None) -> list[int]:
    """lo[j] for j = 1..n (index j-1 in the list): the first i allowed for bucket (i, j]."""
    if limit is None:
        return [0] * len(widths)
    return [max(0, j + 1 - limit // w) for j, w in enumerate(widths)]


def _fixed_with_tie_break(costs: CostCoefficients, f: list[float]) -> float:
    fixed = costs.prefill_fixed_cost_ms
    return fixed + TIE_REL * (1e-6 + fixed + len(f) * f[-1])


def _assemble(order, widths, cut, geometry, costs) -> BucketPlan:
    n = len(order)
    bounds = []
    j = n
    while j > 0:
        i = cut[j]
        bounds.append((i, j))
        j = i
    bounds.reverse()
    buckets = tuple(tuple(order[i:j]) for i, j in bounds)
    bucket_widths = tuple(widths[j - 1] for _, j in bounds)
    cost = sum(prefill_cost_ms(len(b), w, geometry, costs) for b, w in zip(buckets, bucket_widths))
    return BucketPlan(buckets, bucket_widths, cost)


def plan_buckets(
    lengths: Sequence[int], geometry: ModelGeometry, costs: CostCoefficients
) -> BucketPlan:
    """Exactly optimal contiguous bucketing of the sorted lengths (convex-hull trick, ~O(n))."""
    order, widths, f, fixed, lo = _sorted_problem(lengths, geometry, costs)
    n = len(order)
    if n == 0:
        return BucketPlan((), (), 0.0)
    best = [0.0] * (n + 1)
    cut = [0] * (n + 1)
    hull: deque[int] = deque()
    dead = bytearray(n + 1)  # lines dominated for every later query point

    def useless(a: int, b: int, c: int) -> bool:
        # lines a < b < c: b never strictly below both a and c
        return (best[c] - best[a]) * (b - a) <= (best[b] - best[a]) * (c - a)

    for j in range(1, n + 1):
        # add line i = j - 1 at the back
        i = j - 1
        while len(hull) >= 2 and useless(hull[-2], hull[-1], i):
            hull.pop()
        hull.append(i)
        start = lo[j - 1]
        x = f[j - 1]
        if hull[0] < start:
            while hull and hull[0] < start:
                hull.popleft()
            # put back the lines in [start, hull[0]) that the departed front had hidden; a line no
            # better than the front at x stays worse for every later (larger) x: drop it for good
            k = hull[0] - 1 if hull else j - 1
            while k >= start:
                if not dead[k]:
                    front = hull[0]
                    if best[k] - k * x >= best[front] - front * x:
                        dead[k] = 1
                    else:
                        while len(hull) >= 2 and useless(k, hull[0], hull[1]):
                            hull.popleft()
                        hull.appendleft(k)
                k -= 1
        while len(hull) >= 2 and best[hull[1]] - hull[1] * x <= best[hull[0]] - hull[0] * x:
            dead[hull.popleft()] = 1
        i = hull[0]
        best[j] = best[i] + fixed + (j - i) * x
        cut[j] = i
    return _assemble(order, widths, cut, geometry, costs)


def plan_buckets_quadratic(
    lengths: Sequence[int], geometry: ModelGeometry, costs: CostCoefficients
) -> BucketPlan:
    """The plain O(n^2) time, O(n) space DP; the oracle for ``plan_buckets``."""
    order, widths, f, fixed, lo = _sorted_problem(lengths, geometry, costs)
    n = len(order)
    if n == 0:
        return BucketPlan((), (), 0.0)
    best = [0.0] + [float("inf")] * n
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        x = f[j - 1]
        for i in range(lo[j - 1], j):
            cost = best[i] + fixed + (j - i) * x
            if cost < best[j]:
                best[j], cut[j] = cost, i
    return _assemble(order, widths, cut, geometry, costs)


# ---------------------------------------------------------------- k-bucket DP

def plans_by_num_buckets(
    lengths: Sequence[int], geometry: ModelGeometry, costs: CostCoefficients, max_num_buckets: int
) -> list[BucketPlan | None]:
    """The cheapest plan with exactly k buckets, for k = 1..min(max_num_buckets, n) of n prompts
    (None: infeasible within ``prefill_max_tokens``). A bucket holds a prompt at least, so no k past n
    has a plan and the list stops at n (one empty plan for no prompts): its length is the prompts',
    not ``max_num_buckets``'s.

    Layered DP over the sorted lengths: best_k[j] = min_i best_{k-1}[i] + C(j - i, w_j), with each
    bucket within ``prefill_max_tokens``. O(k n^2) time, numpy over i.
    """
    check_pricing(geometry, costs)
    lengths = validate_lengths(lengths, costs)
    max_num_buckets = check_int(max_num_buckets, name="max_num_buckets")
    n = len(lengths)
    if n == 0:
        return [BucketPlan((), (), 0.0)]
    order = sorted(range(n), key=lengths.__getitem__)
    widths = np.array([lengths[i] for i in order])
    f = np.array([per_row_cost_ms(int(w), geometry, costs) for w in widths])
    limit = costs.prefill_max_tokens
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
            cand = best[:j] + costs.prefill_fixed_cost_ms + rows * f[j - 1]
            if limit is not None:
                cand = np.where(rows * widths[j - 1] <= limit, cand, math.inf)
            i = int(np.argmin(cand))
            nxt[j], cut[j] = cand[i], i
        cuts.append(cut)
        is_feasible.append(math.isfinite(nxt[n]))
        best = nxt
    return [_backtrack(order, widths, cuts[:k], geometry, costs) if is_feasible[k - 1] else None
            for k in range(1, num_layers + 1)]


def _backtrack(order, widths, cuts, geometry, costs) -> BucketPlan:
    j, bounds = len(order), []
    for cut in reversed(cuts):
        i = int(cut[j])
        bounds.append((i, j))
        j = i
    bounds.reverse()
    buckets = tuple(tuple(order[i:j]) for i, j in bounds)
    bucket_widths = tuple(int(widths[j - 1]) for _, j in bounds)
    cost = sum(prefill_cost_ms(len(b), w, geometry, costs) for b, w in zip(buckets, bucket_widths))
    return BucketPlan(buckets, bucket_widths, cost)


def plan_buckets_k(
    lengths: Sequence[int], geometry: ModelGeometry, costs: CostCoefficients, num_buckets: int
) -> BucketPlan | None:
    """The cheapest plan with exactly ``num_buckets`` contiguous buckets; None when infeasible (more
    buckets than prompts among it)."""
    num_buckets = check_int(num_buckets, name="num_buckets")
    plans = plans_by_num_buckets(lengths, geometry, costs, num_buckets)
    return plans[num_buckets - 1] if num_buckets <= len(plans) else None
