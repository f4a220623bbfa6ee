"""The response-length prior that prices EOS-aware decode (``planner.expected_decode_steps``).

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
from typing import Sequence


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
        check_prior_settings(None if initial is None else tuple(initial), ewma)
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
