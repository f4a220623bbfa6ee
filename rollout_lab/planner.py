"""Bucket planner: the exactly optimal DP over length-sorted prompts, and the nocb/bucketed route choice.

Pure Python (no torch), deterministic, no I/O. Run ``rollout-lab plan 512 16 16 ...`` to try it.

The cost of a bucket (i, j] of the sorted lengths is C(j - i, w_j) = fixed + (j - i) * f(w_j),
with w_j the bucket's longest prompt and f non-decreasing. So

    best[j] = fixed + j * f_j + min_{lo_j <= i < j} (best[i] - i * f_j)

is a minimum over lines of slope -i queried at the non-decreasing points f_j: a convex-hull
trick with a sliding window (lo_j, from the token limit, is non-decreasing too). Lines that the
window uncovers are put back at the front of the hull, so the result stays exactly optimal.
``plan_buckets_quadratic`` is the plain O(n^2) DP, kept as the oracle.

Chunked prefill (``plan_chunked``). A prompt of L > limit tokens (limit = ``prefill_max_tokens``)
is cut into m = ceil(L / limit) chunks: a *head* of h = L - (m - 1) * limit tokens (1 <= h <= limit)
and m - 1 *tail* chunks of exactly ``limit`` tokens, run in order into one cache so that chunk k
attends to chunks < k. The head has no past, so it enters the DP as a prompt of length h and may
share a bucket with short prompts (its logits are dropped). Each tail chunk is its own one-row
forward at exactly the limit (a second row would exceed it); the last one carries the logits of the
first token. Tails are the fewest forwards a long prompt can take and hold no padding, so given
them the DP over heads and short prompts is exactly optimal. A tail chunk of width c after o tokens
is priced by ``chunk_cost_ms``: C(1, c) with the attention term over o + c keys.

EOS-aware decode (``expected_decode_steps``). With a response-length prior (recent response
lengths l, clipped at the budget T; the empirical CDF F), a call of n requests pays, per route:

- nocb (HF ``generate``): decode steps until the last row stops, max_i l_i - 1 (the prefill gives
  the first token), so E[steps] = E[max of n draws] - 1 = sum_{k=1}^{T-1} (1 - F(k)^n);
- CB with every request admitted at once (slots >= n): rows retire, but the cost model prices a
  step the same however many rows are live, and steps run while any row is live: the same
  E[max of n] - 1;
- CB with refill (s < n slots; nocb is not eligible then): each slot serves about n / s requests
  back to back and a refill costs no step, so steps ~ (n - s) / s * (E[l] - 1) + E[max of s] - 1
  (an estimate: admission order and the cache capacity shift it).

Both routes' decode terms use these steps instead of T - 1; without a prior they are T - 1.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Mapping, Sequence

from rollout_lab.cost import (
    CostCoefficients, ModelGeometry, attention_gflops, per_row_cost_ms, prefill_cost_ms,
)

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
    # chunked prefill: (request index, widths of its tail chunks); its bucket entry is its head
    chunks: tuple[tuple[int, tuple[int, ...]], ...] = ()

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
        return sum(len(b) * w for b, w in zip(self.buckets, self.widths)) + tails


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
    """Positive ints, each within ``prefill_max_tokens`` (no limit when ``coeffs`` is None);
    the error names the index and value."""
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
                "raise the limit, set it to None, or plan it with plan_chunked"
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
    lengths: Sequence[int], geometry: ModelGeometry, coeffs: CostCoefficients, *, max_new_tokens: int = 1,
    decode_steps: float | None = None,
) -> float:
    """nocb's estimate: one left-padded forward of every prompt at the longest width (no KV term),
    plus ``nocb_decode_cost_ms`` per remaining decode step (0 with the reference coefficients).
    ``decode_steps`` (e.g. from ``expected_decode_steps``) replaces ``max_new_tokens - 1``."""
    if not lengths:
        return 0.0
    prefill = prefill_cost_ms(len(lengths), max(lengths), geometry, coeffs, include_kv=False)
    steps = max(0, max_new_tokens - 1) if decode_steps is None else decode_steps
    return prefill + coeffs.nocb_decode_cost_ms * steps


def cb_decode_cost_ms(
    max_new_tokens: int, coeffs: CostCoefficients, *, decode_steps: float | None = None
) -> float:
    """CB's decode overhead over nocb: one ``continuous_decode_cost_ms`` per remaining step
    (``decode_steps`` of them when given, else ``max_new_tokens - 1``)."""
    steps = max(0, max_new_tokens - 1) if decode_steps is None else decode_steps
    return coeffs.continuous_decode_cost_ms * steps


# -- EOS-aware decode steps --------------------------------------------------------------------

LengthPrior = Sequence[int] | Mapping[int, float]  # response lengths, or length -> weight


def length_cdf(prior: LengthPrior, max_new_tokens: int) -> list[float]:
    """F(k) = P(l <= k) for k = 0..max_new_tokens, lengths clipped at ``max_new_tokens``."""
    weights = _prior_weights(prior)
    mass = [0.0] * (max_new_tokens + 1)
    for length, weight in weights.items():
        mass[min(length, max_new_tokens)] += weight
    total = sum(mass)
    cdf, running = [], 0.0
    for m in mass:
        running += m
        cdf.append(min(1.0, running / total))
    return cdf


def _prior_weights(prior: LengthPrior) -> dict[int, float]:
    items = prior.items() if isinstance(prior, Mapping) else ((length, 1.0) for length in prior)
    weights: dict[int, float] = {}
    for length, weight in items:
        if isinstance(length, bool) or not _is_integral(length) or int(length) < 1:
            raise ValueError(f"response lengths must be positive ints, got {length!r}")
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight >= 0 \
                or weight == float("inf"):
            raise ValueError(f"response-length weights must be finite and >= 0, got {weight!r}")
        weights[int(length)] = weights.get(int(length), 0.0) + float(weight)
    if not weights or sum(weights.values()) <= 0:
        raise ValueError("a response-length prior needs at least one length with positive weight")
    return weights


def expected_decode_steps(
    prior: LengthPrior | None, num_requests: int, max_new_tokens: int, *, num_slots: int | None = None
) -> float:
    """Expected decode forwards of one call (see the module docstring); ``max_new_tokens - 1``
    without a prior. ``num_slots`` below ``num_requests`` means refill (an estimate)."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if prior is None or num_requests <= 0:
        return float(max(0, max_new_tokens - 1)) if num_requests > 0 else 0.0
    cdf = length_cdf(prior, max_new_tokens)
    slots = num_requests if num_slots is None else min(num_slots, num_requests)
    steps_max = sum(1.0 - cdf[k] ** slots for k in range(1, max_new_tokens))
    if slots >= num_requests:
        return steps_max
    steps_mean = sum(1.0 - cdf[k] for k in range(1, max_new_tokens))
    return (num_requests - slots) / slots * steps_mean + steps_max


# -- chunked prefill ---------------------------------------------------------------------------

def split_prompt(length: int, limit: int | None) -> tuple[int, ...]:
    """Chunk widths of a prompt, head first: (length,) within the limit, else the head and tails."""
    if limit is None or length <= limit:
        return (length,)
    num_tails = (length - 1) // limit
    return (length - num_tails * limit,) + (limit,) * num_tails


def chunk_cost_ms(
    width: int, offset: int, geometry: ModelGeometry, coeffs: CostCoefficients
) -> float:
    """A one-row forward of ``width`` tokens after ``offset`` cached ones: C(1, width) with the
    attention term over ``offset + width`` keys."""
    cost = prefill_cost_ms(1, width, geometry, coeffs)
    extra = attention_gflops(1, width, geometry) * offset / width  # 4 * w * o * ... / 1e9
    return cost + coeffs.prefill_attention_cost_ms * extra


def plan_chunked(
    lengths: Sequence[int], geometry: ModelGeometry, coeffs: CostCoefficients
) -> BucketPlan:
    """``plan_buckets`` with over-limit prompts chunked (module docstring): the DP buckets the
    heads with the short prompts; ``chunks`` lists each long prompt's tail widths."""
    lengths = validate_lengths(lengths, None)
    limit = coeffs.prefill_max_tokens
    splits = [split_prompt(n, limit) for n in lengths]
    plan = plan_buckets([s[0] for s in splits], geometry, coeffs)
    chunks = tuple((i, s[1:]) for i, s in enumerate(splits) if len(s) > 1)
    cost = plan.cost_ms
    for i, tail in chunks:
        offset = splits[i][0]
        for width in tail:
            cost += chunk_cost_ms(width, offset, geometry, coeffs)
            offset += width
    return BucketPlan(plan.buckets, plan.widths, cost, chunks)


def choose_route(
    lengths: Sequence[int],
    *,
    max_new_tokens: int,
    continuous_batch_size: int | None,
    geometry: ModelGeometry,
    coeffs: CostCoefficients,
    nocb_allowed: bool = True,
    response_lengths: LengthPrior | None = None,
    chunk_long_prompts: bool = False,
) -> RoutePlan:
    """Compare nocb with bucketed CB by the cost model and take the cheaper (nocb on a tie).

    nocb is eligible when ``nocb_allowed`` (no explicit capacity or trimming), every request
    fits the slots at once and the padded batch fits ``prefill_max_tokens``.
    ``response_lengths`` (a prior, see ``expected_decode_steps``) prices the expected decode steps
    instead of ``max_new_tokens - 1``. ``chunk_long_prompts`` plans over-limit prompts with
    ``plan_chunked`` instead of raising (nocb is then not eligible).
    """
    lengths = validate_lengths(lengths, None if chunk_long_prompts else coeffs)
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
    steps = None
    if response_lengths is not None:
        steps = expected_decode_steps(response_lengths, n, max_new_tokens, num_slots=continuous_batch_size)
    decode = cb_decode_cost_ms(max_new_tokens, coeffs, decode_steps=steps)
    nocb = None
    if eligible:
        nocb = nocb_cost_ms(lengths, geometry, coeffs, max_new_tokens=max_new_tokens, decode_steps=steps)
    if nocb is not None:
        # cheapest conceivable CB: one fixed cost, every prompt at its own width
        bound = coeffs.prefill_fixed_cost_ms + decode
        bound += sum(per_row_cost_ms(length, geometry, coeffs) for length in lengths)
        if nocb <= bound:
            return RoutePlan("nocb", (tuple(range(n)),), nocb, bound, cb_cost_is_lower_bound=True)
    plan = plan_chunked(lengths, geometry, coeffs) if chunk_long_prompts else plan_buckets(lengths, geometry, coeffs)
    cb = plan.cost_ms + decode
    if nocb is not None and nocb <= cb:
        return RoutePlan("nocb", (tuple(range(n)),), nocb, cb)
    return RoutePlan("bucketed", plan.buckets, nocb, cb)
