"""Bucket planner: the exactly optimal DP over length-sorted prompts, and the nocb/bucketed route choice.

Pure Python (no torch), deterministic, no I/O. Run ``rollout-lab plan 512 16 16 ...`` to try it.

The cost of a bucket (i, j] of the sorted lengths is C(j - i, w_j) = fixed + (j - i) * f(w_j),
with w_j the bucket's longest prompt and f non-decreasing. So

    best[j] = fixed + j * f_j + min_{lo_j <= i < j} (best[i] - i * f_j)

is a minimum over lines of slope -i queried at the non-decreasing points f_j: a convex-hull
trick with a sliding window (lo_j, from the token limit, is non-decreasing too). Lines that the
window uncovers are put back at the front of the hull, so the result stays exactly optimal.
``plan_buckets_quadratic`` is the plain O(n^2) DP, kept as the oracle.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Sequence

from rollout_lab.cost import CostCoefficients, ModelGeometry, per_row_cost_ms, prefill_cost_ms

ROUTES = ("nocb", "bucketed")
# Tie-break: each bucket carries an extra TIE_REL * (one-bucket cost of all prompts), so that on
# equal cost (to that tolerance, well above float noise) fewer buckets win.
TIE_REL = 1e-10


@dataclass(frozen=True)
class BucketPlan:
    """Buckets as tuples of indices into the input lengths, shortest bucket first."""

    buckets: tuple[tuple[int, ...], ...]
    widths: tuple[int, ...]
    cost_ms: float

    @property
    def num_buckets(self) -> int:
        return len(self.buckets)

    @property
    def num_padded_tokens(self) -> int:
        return sum(len(b) * w for b, w in zip(self.buckets, self.widths))


@dataclass(frozen=True)
class RoutePlan:
    """The route Auto takes for one admission, with both estimates."""

    route: str
    buckets: tuple[tuple[int, ...], ...]
    nocb_cost_ms: float | None  # None when nocb is not eligible
    cb_cost_ms: float
    cb_cost_is_lower_bound: bool = False  # True when the DP was skipped because nocb wins anyway

    @property
    def widths(self) -> tuple[int, ...]:
        return tuple(len(b) for b in self.buckets)


def validate_lengths(lengths: Sequence[int], coeffs: CostCoefficients | None = None) -> list[int]:
    """Positive ints, each within ``prefill_max_tokens``; the error names the index and value."""
    out = []
    for index, length in enumerate(lengths):
        if isinstance(length, bool) or not isinstance(length, int) and not _is_integral(length):
            raise ValueError(f"length at index {index} must be a positive int, got {length!r}")
        length = int(length)
        if length < 1:
            raise ValueError(f"length at index {index} must be a positive int, got {length!r}")
        limit = None if coeffs is None else coeffs.prefill_max_tokens
        if limit is not None and length > limit:
            raise ValueError(
                f"prompt at index {index} has length {length}, over prefill_max_tokens={limit}; "
                "raise the limit or set it to None"
            )
        out.append(length)
    return out


def _is_integral(value: object) -> bool:
    try:
        return int(value) == value and not isinstance(value, float)  # numpy ints pass
    except (TypeError, ValueError):
        return False


def _sorted_problem(lengths, geometry, coeffs):
    lengths = validate_lengths(lengths, coeffs)
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    widths = [lengths[i] for i in order]
    per_row = {}
    for w in widths:
        if w not in per_row:
            per_row[w] = per_row_cost_ms(w, geometry, coeffs)
    f = [per_row[w] for w in widths]
    return order, widths, f


def _window_starts(widths: list[int], limit: int | None) -> list[int]:
    """lo[j] for j = 1..n (index j-1 in the list): the first i allowed for bucket (i, j]."""
    if limit is None:
        return [0] * len(widths)
    return [max(0, j + 1 - limit // w) for j, w in enumerate(widths)]


def _fixed_with_tie_break(coeffs: CostCoefficients, f: list[float]) -> float:
    fixed = coeffs.prefill_fixed_cost_ms
    return fixed + TIE_REL * (1e-6 + fixed + len(f) * f[-1])


def _assemble(order, widths, cut, geometry, coeffs) -> BucketPlan:
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
    cost = sum(prefill_cost_ms(len(b), w, geometry, coeffs) for b, w in zip(buckets, bucket_widths))
    return BucketPlan(buckets, bucket_widths, cost)


def plan_buckets(
    lengths: Sequence[int], geometry: ModelGeometry, coeffs: CostCoefficients
) -> BucketPlan:
    """Exactly optimal contiguous bucketing of the sorted lengths (convex-hull trick, ~O(n))."""
    order, widths, f = _sorted_problem(lengths, geometry, coeffs)
    n = len(order)
    if n == 0:
        return BucketPlan((), (), 0.0)
    fixed = _fixed_with_tie_break(coeffs, f)
    lo = _window_starts(widths, coeffs.prefill_max_tokens)
    best = [0.0] * (n + 1)
    cut = [0] * (n + 1)
    hull: deque[int] = deque()

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
        if hull[0] < start:
            while hull and hull[0] < start:
                hull.popleft()
            # put back the lines in [start, hull[0]) that the departed front had hidden
            k = hull[0] - 1 if hull else j - 1
            while k >= start:
                while len(hull) >= 2 and useless(k, hull[0], hull[1]):
                    hull.popleft()
                hull.appendleft(k)
                k -= 1
        x = f[j - 1]
        while len(hull) >= 2 and best[hull[1]] - hull[1] * x <= best[hull[0]] - hull[0] * x:
            hull.popleft()
        i = hull[0]
        best[j] = best[i] + fixed + (j - i) * x
        cut[j] = i
    return _assemble(order, widths, cut, geometry, coeffs)


def plan_buckets_quadratic(
    lengths: Sequence[int], geometry: ModelGeometry, coeffs: CostCoefficients
) -> BucketPlan:
    """The plain O(n^2) time, O(n) space DP; the oracle for ``plan_buckets``."""
    order, widths, f = _sorted_problem(lengths, geometry, coeffs)
    n = len(order)
    if n == 0:
        return BucketPlan((), (), 0.0)
    fixed = _fixed_with_tie_break(coeffs, f)
    lo = _window_starts(widths, coeffs.prefill_max_tokens)
    best = [0.0] + [float("inf")] * n
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        x = f[j - 1]
        for i in range(lo[j - 1], j):
            cost = best[i] + fixed + (j - i) * x
            if cost < best[j]:
                best[j], cut[j] = cost, i
    return _assemble(order, widths, cut, geometry, coeffs)


def nocb_cost_ms(
    lengths: Sequence[int], geometry: ModelGeometry, coeffs: CostCoefficients, *, max_new_tokens: int = 1
) -> float:
    """nocb's estimate: one left-padded forward of every prompt at the longest width (no KV term),
    plus ``nocb_decode_cost_ms`` per remaining decode step (0 with the reference coefficients)."""
    if not lengths:
        return 0.0
    prefill = prefill_cost_ms(len(lengths), max(lengths), geometry, coeffs, include_kv=False)
    return prefill + coeffs.nocb_decode_cost_ms * max(0, max_new_tokens - 1)


def cb_decode_cost_ms(max_new_tokens: int, coeffs: CostCoefficients) -> float:
    """CB's decode overhead over nocb: one ``continuous_decode_cost_ms`` per remaining step."""
    return coeffs.continuous_decode_cost_ms * max(0, max_new_tokens - 1)


def choose_route(
    lengths: Sequence[int],
    *,
    max_new_tokens: int,
    continuous_batch_size: int | None,
    geometry: ModelGeometry,
    coeffs: CostCoefficients,
    nocb_allowed: bool = True,
) -> RoutePlan:
    """Compare nocb with bucketed CB by the cost model and take the cheaper (nocb on a tie).

    nocb is eligible when ``nocb_allowed`` (no explicit capacity or trimming), every request
    fits the slots at once and the padded batch fits ``prefill_max_tokens``.
    """
    lengths = validate_lengths(lengths, coeffs)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if continuous_batch_size is not None and (
        isinstance(continuous_batch_size, bool)
        or not isinstance(continuous_batch_size, int)
        or continuous_batch_size < 1
    ):
        raise ValueError(
            f"continuous_batch_size must be a positive int or None, got {continuous_batch_size!r}"
        )
    n = len(lengths)
    if n == 0:
        return RoutePlan("bucketed", (), None, 0.0)
    limit = coeffs.prefill_max_tokens
    eligible = (
        nocb_allowed
        and (continuous_batch_size is None or n <= continuous_batch_size)
        and (limit is None or n * max(lengths) <= limit)
    )
    decode = cb_decode_cost_ms(max_new_tokens, coeffs)
    nocb = nocb_cost_ms(lengths, geometry, coeffs, max_new_tokens=max_new_tokens) if eligible else None
    if nocb is not None:
        # cheapest conceivable CB: one fixed cost, every prompt at its own width
        bound = coeffs.prefill_fixed_cost_ms + decode
        bound += sum(per_row_cost_ms(length, geometry, coeffs) for length in lengths)
        if nocb <= bound:
            return RoutePlan("nocb", (tuple(range(n)),), nocb, bound, cb_cost_is_lower_bound=True)
    plan = plan_buckets(lengths, geometry, coeffs)
    cb = plan.cost_ms + decode
    if nocb is not None and nocb <= cb:
        return RoutePlan("nocb", (tuple(range(n)),), nocb, cb)
    return RoutePlan("bucketed", plan.buckets, nocb, cb)
