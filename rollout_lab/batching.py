"""Continuous batching over the aligned cache: admit, prefill buckets, decode, retire, compact, trim.

Slots stay dense: live rows occupy slots ``[0, num_live)``; retiring rows leave holes that the last
live rows fill (compaction), and queued requests are admitted, in input order, into the free tail.
Each admission is re-planned (``equal_width``: one bucket; ``aligned``: one per request;
``bucketed``: the DP). A request is admitted only when the cache can hold it and every live row to
the end of their budgets; otherwise it waits for rows to retire. Dead left columns are trimmed when
``trim_cache`` is set or when the front would otherwise run past the capacity.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from rollout_lab.cost import CostCoefficients, ModelGeometry, prefill_cost_ms
from rollout_lab.decode import prefill_bucket, seen_from_ids, select_tokens
from rollout_lab.graph import EagerStepper, StepperKey
from rollout_lab.planner import BucketPlan, plan_buckets
from rollout_lab.profile import Profile, Timer

CB_ROUTES = ("equal_width", "aligned", "bucketed")


@dataclass
class _Row:
    request: int
    num_generated: int


@dataclass(frozen=True)
class BatchSettings:
    route: str
    max_new_tokens: int
    num_slots: int
    capacity: int
    trim_cache: bool
    eos_token_ids: frozenset[int]
    pad_token_id: int
    repetition_penalty: float
    cache_kwarg: str


def plan_admission(
    route: str, requests: Sequence[int], lengths: Sequence[int],
    geometry: ModelGeometry, costs: CostCoefficients,
) -> BucketPlan:
    """The buckets, as tuples of request indices, for the requests admitted together."""
    widths = [lengths[r] for r in requests]
    if route == "equal_width":
        width = max(widths)
        return BucketPlan((tuple(requests),), (width,), prefill_cost_ms(len(requests), width, geometry, costs))
    if route == "aligned":
        cost = sum(prefill_cost_ms(1, w, geometry, costs) for w in widths)
        return BucketPlan(tuple((r,) for r in requests), tuple(widths), cost)
    plan = plan_buckets(widths, geometry, costs)
    buckets = tuple(tuple(requests[i] for i in bucket) for bucket in plan.buckets)
    return BucketPlan(buckets, plan.widths, plan.cost_ms)


class ContinuousBatcher:
    """Runs one call's requests through the aligned cache; ``run()`` -> (sequences, plans)."""

    def __init__(
        self, model: torch.nn.Module, prompts: Sequence[Sequence[int]], settings: BatchSettings, *,
        geometry: ModelGeometry, costs: CostCoefficients, profile: Profile, timer: Timer,
        stepper: "EagerStepper | None" = None,
    ):
        self.model, self.prompts, self.s = model, prompts, settings
        self.geometry, self.costs = geometry, costs
        self.profile, self.timer = profile, timer
        self.lengths = [len(p) for p in prompts]
        self.vocab_size = model.get_input_embeddings().weight.shape[0]
        self.device = next(model.parameters()).device
        with timer.phase("cache_ms"):
            if stepper is None:
                stepper = EagerStepper(model, StepperKey(
                    settings.num_slots, settings.capacity, settings.repetition_penalty,
                    settings.repetition_penalty != 1.0, settings.cache_kwarg))
            else:
                stepper.reset()
        self.stepper, self.cache, self.state = stepper, stepper.cache, stepper.state
        profile.cache_bytes = self.cache.num_bytes
        self.rows: list[_Row] = []  # index = slot
        self.queue = list(range(len(prompts)))  # not yet admitted, input order
        self.outputs: list[list[int]] = [[] for _ in prompts]
        self.plans: list[BucketPlan] = []

    # -- the loop ---------------------------------------------------------------------------
    def run(self) -> tuple[list[list[int]], list[BucketPlan]]:
        while self.queue or self.rows:
            while self.queue and len(self.rows) < self.s.num_slots and self._admit():
                pass
            if not self.rows:
                if not self.queue:
                    break  # the last admissions all finished on their first token
                raise RuntimeError("no request is admissible into an empty cache (capacity check missed)")
            # Without EOS ids nothing retires before the nearest budget: run those steps without
            # reading tokens back, so the host never waits on the device in between.
            burst = 1
            if not self.s.eos_token_ids:
                burst = min(self.s.max_new_tokens - row.num_generated for row in self.rows)
            with self.timer.phase("decode_ms"):
                num_rows = len(self.rows)
                steps = [self.stepper.step(num_rows) for _ in range(burst)]
                tokens = (steps[0][:, None] if burst == 1 else torch.stack(steps, 1)).tolist()
                self.cache.front_int += burst
            self.profile.num_decode_forwards += burst
            self._note_peak()
            for row, row_tokens in zip(self.rows, tokens):
                for token in row_tokens:
                    self._append(row, token)
            self._retire()
        return self.outputs, self.plans

    def _append(self, row: _Row, token: int) -> None:
        self.outputs[row.request].append(token)
        row.num_generated += 1

    def _is_done(self, row: _Row) -> bool:
        last = self.outputs[row.request][-1]
        return last in self.s.eos_token_ids or row.num_generated >= self.s.max_new_tokens

    def _note_peak(self) -> None:
        self.profile.peak_cache_columns = max(self.profile.peak_cache_columns, self.cache.front_int)

    # -- admission --------------------------------------------------------------------------
    def _admissible(self) -> tuple[list[int], int | None]:
        """The longest queue prefix that fits the free slots and the cache, and the front it needs."""
        free = self.s.num_slots - len(self.rows)
        live_span, live_remaining = self._live_needs()
        best: tuple[list[int], int | None] = ([], None)
        longest_new = 0
        for count in range(1, min(free, len(self.queue)) + 1):
            longest_new = max(longest_new, self.lengths[self.queue[count - 1]])
            front = self._choose_front(
                max(live_span, longest_new), max(live_remaining, self.s.max_new_tokens - 1)
            )
            if front is None:
                break
            best = (self.queue[:count], front)
        return best

    def _live_needs(self) -> tuple[int, int]:
        """(widest live span, most decode columns a live row still needs)."""
        front, budget = self.cache.front_int, self.s.max_new_tokens
        span = max((front - self.cache.row_starts[slot] for slot in range(len(self.rows))), default=0)
        remaining = max((budget - row.num_generated for row in self.rows), default=0)
        return span, remaining

    def _choose_front(self, span: int, remaining: int) -> int | None:
        """The front column that holds ``span`` columns left of it and ``remaining`` right of it.

        None if the capacity cannot; with ``trim_cache`` the lowest such front, else the nearest.
        """
        lower, upper = span, self.s.capacity - remaining
        if lower > upper:
            return None
        if self.s.trim_cache:
            return lower
        return min(max(self.cache.front_int, lower), upper)

    def _set_front(self, new_front: int) -> None:
        delta = new_front - self.cache.front_int
        if delta == 0:
            return
        with self.timer.phase("cache_ms"):
            self.profile.moved_bytes += self.cache.shift_columns(len(self.rows), delta)
        if delta < 0 and self.rows:
            self.profile.num_trims += 1
            self.profile.trimmed_columns += -delta

    def _admit(self) -> bool:
        requests, front = self._admissible()
        if not requests:
            return False
        del self.queue[: len(requests)]
        self._set_front(front)
        with self.timer.phase("planning_ms"):
            plan = plan_admission(self.s.route, requests, self.lengths, self.geometry, self.costs)
        self.plans.append(plan)
        slot_of = {r: len(self.rows) + i for i, r in enumerate(requests)}
        self.rows.extend(_Row(r, 0) for r in requests)
        for bucket in plan.buckets:
            self._prefill(bucket, [slot_of[r] for r in bucket])
        self._note_peak()
        self._retire()
        return True

    def _prefill(self, requests: Sequence[int], slots: Sequence[int]) -> None:
        prompts = [self.prompts[r] for r in requests]
        lengths = [self.lengths[r] for r in requests]
        with self.timer.phase("prefill_ms"):
            logits, layer_kv = prefill_bucket(
                self.model, prompts, pad_token_id=self.s.pad_token_id, cache_kwarg=self.s.cache_kwarg
            )
            seen = None
            if self.state.seen is not None:
                seen = self._seen_of(prompts)
            first = select_tokens(logits, seen, self.s.repetition_penalty)  # [rows]
            if seen is not None:
                seen.scatter_(1, first[:, None], True)
        self.profile.num_prefill_forwards += 1
        with self.timer.phase("cache_ms"):
            self.cache.admit(slots, layer_kv, lengths)
            self.state.admit(slots, first, lengths, seen)
        for slot, token in zip(slots, first.tolist()):
            self._append(self.rows[slot], token)

    def _seen_of(self, prompts: Sequence[Sequence[int]]) -> torch.Tensor:
        width = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        valid = torch.zeros(len(prompts), width, dtype=torch.bool)
        for row, prompt in enumerate(prompts):
            ids[row, : len(prompt)] = torch.tensor(prompt, dtype=torch.long)
            valid[row, : len(prompt)] = True
        return seen_from_ids(ids.to(self.device), valid.to(self.device), self.vocab_size)

    # -- retirement -------------------------------------------------------------------------
    def _retire(self) -> None:
        """Drop finished rows, fill their holes with the last live rows, then trim if asked."""
        keep = [slot for slot, row in enumerate(self.rows) if not self._is_done(row)]
        if len(keep) == len(self.rows):
            return
        num_live = len(keep)
        kept = set(keep)
        holes = [slot for slot in range(num_live) if slot not in kept]
        movers = [slot for slot in keep if slot >= num_live]
        with self.timer.phase("cache_ms"):
            self.profile.moved_bytes += self.cache.move_rows(movers, holes)
            self.state.move_rows(movers, holes)
            self.stepper.retire_tail(num_live)
        rows = self.rows
        for src, dst in zip(movers, holes):
            rows[dst] = rows[src]
        self.rows = rows[:num_live]
        if self.s.trim_cache and self.rows and not self.queue:
            front = self._choose_front(*self._live_needs())
            if front is not None:
                self._set_front(front)
