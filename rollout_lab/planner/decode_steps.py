"""Expected decode steps of one call under a response-length prior (EOS-aware decode cost).

With a response-length prior (recent response
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
Pure Python, no torch.

The response-length prior that prices EOS-aware decode (``expected_decode_steps`` above).

    prior = ResponseLengthPrior(initial=(12, 40, 7), ewma=0.5)
    prior.current()                 # {7: 1/3, 12: 1/3, 40: 1/3}: length -> weight
    prior.update([9, 9, 64])        # after a call: h = (1 - a) h + a * histogram(new lengths)

Without ``ewma`` the prior is the fixed ``initial`` lengths (or None: price the full budget). With
it, each call's response lengths are folded into a normalised histogram, so the prior follows the
policy as it changes between rollout rounds. A response that hit the budget is recorded at the
budget (its true length is only known to be >= it): a later call with a larger budget
underestimates the long tail until the budget-length responses fade from the histogram.
Pure Python; the state lives on ``Rollout``, never on the frozen config.

"""
from __future__ import annotations

import math
from typing import Mapping, Sequence

from rollout_lab.planner.checks import as_int, check_int, check_max_new_tokens

LengthPrior = Sequence[int] | Mapping[int, float]  # response lengths, or length -> weight


def cdf_steps(prior: LengthPrior, max_new_tokens: int) -> tuple[list[int], list[float]]:
    """F(k) = P(l <= k), lengths clipped at ``max_new_tokens``, as its steps: the ascending lengths
    where it rises and its value from each on (0 before the first). Its size is the prior's, not
    the budget's: a budget of 10**9 tokens costs nothing more."""
    weights = _prior_weights(prior)
    mass: dict[int, float] = {}
    for length, weight in weights.items():
        clipped = min(length, max_new_tokens)
        mass[clipped] = mass.get(clipped, 0.0) + weight
    points = sorted(mass)
    total = sum(mass[k] for k in points)
    values, running = [], 0.0
    for k in points:
        running += mass[k]
        values.append(min(1.0, running / total))
    return points, values


def _sum_over_steps(points: list[int], values: list[float], end: int, term) -> float:
    """sum of term(F(k)) for k = 1..end - 1, run by run of F's steps."""
    total, k, f = 0.0, 1, 0.0
    for point, value in [*zip(points, values), (end, 0.0)]:
        stop = min(point, end)
        if stop > k:
            total += (stop - k) * term(f)
            k = stop
        f = value
    return total


def _prior_weights(prior: LengthPrior) -> dict[int, float]:
    items = prior.items() if isinstance(prior, Mapping) else ((length, 1.0) for length in prior)
    weights: dict[int, float] = {}
    for length, weight in items:
        if as_int(length) is None or as_int(length) < 1:
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
    check_max_new_tokens(max_new_tokens)
    if num_slots is not None:
        check_int(num_slots, name="num_slots", or_none=True)
    if prior is None or num_requests <= 0:
        return float(max(0, max_new_tokens - 1)) if num_requests > 0 else 0.0
    points, values = cdf_steps(prior, max_new_tokens)
    slots = num_requests if num_slots is None else min(num_slots, num_requests)
    steps_max = _sum_over_steps(points, values, max_new_tokens, lambda f: 1.0 - f ** slots)
    if slots >= num_requests:
        return steps_max
    steps_mean = _sum_over_steps(points, values, max_new_tokens, lambda f: 1.0 - f)
    return (num_requests - slots) / slots * steps_mean + steps_max


def budget_decode_steps(budgets: Sequence[int], *, num_slots: int | None = None) -> int:
    """Decode forwards of one call whose rows stop at their own budgets (no EOS), whatever their
    order: a row of budget b needs b - 1 steps (the prefill gives its first token) and a step
    serves at most ``num_slots`` rows, so at least max(b) - 1 steps and at least the rows' steps
    shared over the slots. Exact with every row admitted at once (max(b) - 1); with refill, a lower
    bound that a well-packed schedule reaches (the aligned cache can make admissions wait)."""
    if not budgets:
        return 0
    slots = len(budgets) if num_slots is None else min(num_slots, len(budgets))
    longest = max(budgets) - 1
    total = sum(budget - 1 for budget in budgets)
    return max(longest, -(-total // slots))


# -- the response-length prior ---------------------------------------------------------------------

def check_prior_settings(initial: object, ewma: object) -> None:
    """ValueError naming the bad field: ``initial`` a tuple of ints >= 1 (or None), ``ewma`` in (0, 1]."""
    if initial is not None and (
        not isinstance(initial, tuple) or not initial
        or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in initial)
    ):
        raise ValueError(
            f"response_length_prior must be a non-empty tuple of ints >= 1 or None, got {initial!r}")
    if ewma is not None and (
        isinstance(ewma, bool) or not isinstance(ewma, (int, float)) or not math.isfinite(ewma)
        or not 0 < ewma <= 1
    ):
        raise ValueError(f"prior_ewma must be a number in (0, 1] or None, got {ewma!r}")


def histogram(lengths: Sequence[int]) -> dict[int, float]:
    """Normalised histogram {length: share}."""
    out: dict[int, float] = {}
    for n in lengths:
        out[n] = out.get(n, 0.0) + 1.0 / len(lengths)
    return out


class ResponseLengthPrior:
    """A fixed prior, or an EWMA of the normalised response-length histogram across calls."""

    def __init__(self, initial: Sequence[int] | None = None, ewma: float | None = None):
        check_prior_settings(tuple(initial) if isinstance(initial, (list, tuple)) else initial, ewma)
        self.initial = None if initial is None else tuple(initial)
        self.ewma = ewma
        self.weights: dict[int, float] | None = None if initial is None else histogram(self.initial)
        self.num_updates = 0

    def current(self) -> dict[int, float] | None:
        """{length: weight} for ``choose_route(response_lengths=...)``; None prices the budget."""
        return None if self.weights is None else dict(self.weights)

    def update(self, lengths: Sequence[int]) -> None:
        """Fold one call's response lengths in (a no-op without ``ewma`` or without lengths)."""
        if self.ewma is None or not lengths:
            return
        new = histogram([max(1, int(n)) for n in lengths])
        if self.weights is None:
            self.weights = new
        else:
            a = float(self.ewma)
            keys = set(self.weights) | set(new)
            merged = {k: (1 - a) * self.weights.get(k, 0.0) + a * new.get(k, 0.0) for k in keys}
            self.weights = {k: w for k, w in merged.items() if w > 1e-12}  # bounded by the budget
        self.num_updates += 1
