"""A rank's predicted cost for sharding: its own Auto plan's cost, memoised, with cheap bounds.

``RankCost(geometry, coeffs, max_new_tokens=16, continuous_batch_size=None)`` is called with a
rank's prompt lengths as a sorted tuple and returns ``min(nocb, bucketed CB)`` in ms, as
``planner.choose_route`` prices it; ``row``/``row_nokv`` are per-prompt row costs and
``lower_bound`` a bound from a rank's count, longest length and row-cost sum that needs no DP.
Pure Python (no torch), deterministic, no I/O.
"""
from __future__ import annotations

from rollout_lab.cost import CostCoefficients, ModelGeometry, per_row_cost_ms
from rollout_lab.planner import cb_decode_cost_ms, choose_route

class RankCost:
    """Memoised predicted cost of one rank's prompt lengths (a sorted tuple), with cheap bounds."""

    def __init__(
        self, geometry: ModelGeometry, coeffs: CostCoefficients, *, max_new_tokens: int,
        continuous_batch_size: int | None, nocb_allowed: bool = True,
    ) -> None:
        self.geometry, self.coeffs = geometry, coeffs
        self.nocb_allowed = nocb_allowed
        self.max_new_tokens, self.continuous_batch_size = max_new_tokens, continuous_batch_size
        self.decode_ms = cb_decode_cost_ms(max_new_tokens, coeffs)
        self._memo: dict[tuple[int, ...], float] = {}
        self._row: dict[int, float] = {}
        self._row_nokv: dict[int, float] = {}
        self.num_evaluations = 0
        self.num_rows_evaluated = 0

    def __call__(self, sorted_lengths: tuple[int, ...]) -> float:
        cost = self._memo.get(sorted_lengths)
        if cost is None:
            cost = self._exact(sorted_lengths)
            self._memo[sorted_lengths] = cost
        return cost

    def _exact(self, lengths: tuple[int, ...]) -> float:
        if not lengths:
            return 0.0
        self.num_evaluations += 1
        self.num_rows_evaluated += len(lengths)
        plan = choose_route(
            lengths, max_new_tokens=self.max_new_tokens,
            continuous_batch_size=self.continuous_batch_size, geometry=self.geometry,
            coeffs=self.coeffs, nocb_allowed=self.nocb_allowed,
        )
        return plan.nocb_cost_ms if plan.route == "nocb" else plan.cb_cost_ms

    def is_known(self, sorted_lengths: tuple[int, ...]) -> bool:
        return sorted_lengths in self._memo

    def row(self, length: int) -> float:
        if length not in self._row:
            self._row[length] = per_row_cost_ms(length, self.geometry, self.coeffs)
        return self._row[length]

    def row_nokv(self, length: int) -> float:
        if length not in self._row_nokv:
            self._row_nokv[length] = per_row_cost_ms(
                length, self.geometry, self.coeffs, include_kv=False
            )
        return self._row_nokv[length]

    def lower_bound(self, count: int, max_length: int, row_sum: float) -> float:
        """A bound <= the exact cost from the count, longest length and sum of per-row costs."""
        if count == 0:
            return 0.0
        cb = self.coeffs.prefill_fixed_cost_ms + self.decode_ms + row_sum
        if self._nocb_eligible(count, max_length):
            return min(cb, self.coeffs.prefill_fixed_cost_ms + count * self.row_nokv(max_length))
        return cb

    def _nocb_eligible(self, count: int, max_length: int) -> bool:
        limit, slots = self.coeffs.prefill_max_tokens, self.continuous_batch_size
        return (
            self.nocb_allowed
            and (slots is None or count <= slots)
            and (limit is None or count * max_length <= limit)
        )
