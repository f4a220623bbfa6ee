"""Continuous batching over the paged cache: rows never wait for a shared front.

The ``paged`` route (``engine.paged_cache``). Every loop turn, before a decode step:

- **admission**: queued rows enter free slots, in input order, as long as the pool keeps one free block
  per live row after their prompts' blocks (a watermark, so the live rows can grow). A turn admits
  only when at least ``refill_rows`` rows can come in (or the queue is that short, or nothing is
  live): one prefill forward then serves several rows, instead of one eager forward per retired row.
  ``admit_tokens`` bounds the prompt tokens (a resuming row's: its prompt and tokens) one turn
  prefills, so the live rows never wait for more than that between two steps; a row longer than the
  bound comes in alone, and a turn the bound cut short admits its rows even if fewer than ``refill_rows``.
  The admitted rows are planned and prefilled as on the aligned cache (``ContinuousBatcher``:
  bucketed DP, packed, shared prefill, chunked long prompts), their KV copied into their blocks.
- **growth**: each live row gets the blocks its next tokens need; a burst of steps without EOS
  reserves them all at once.
- **preemption**: when the pool cannot hold the next step, the most recently admitted row gives its
  blocks back and returns to the head of the queue, its tokens kept. When it is admitted again its
  prompt and all but its last token are prefilled (recompute), its last token is the next input and
  its sampling step continues from its count, so its tokens are those it would have made unpreempted.

Slots stay dense by compaction, which moves block-table rows only (no KV). The profile counts the
live rows of every decode step (occupancy), the preemptions and the peak of blocks in use.

"""
from __future__ import annotations

from typing import Sequence

import torch

from rollout_lab.engine.batching import ContinuousBatcher, _Row
from rollout_lab.engine.paged_cache import PagedKVCache
from rollout_lab.engine.prefill import prefill_bucket


class PagedBatcher(ContinuousBatcher):
    """Runs one call's rows through the paged cache; ``run()`` -> (sequences, plans)."""

    def __init__(self, *args, refill_rows: int = 1, admit_tokens: int | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        if not isinstance(self.cache, PagedKVCache):
            raise ValueError("PagedBatcher needs a stepper over the paged cache (StepperKey.block_size)")
        self.refill_rows = max(1, refill_rows)
        self.admit_tokens = admit_tokens
        self.admitted_order: dict[int, int] = {}  # request -> admission counter (the newest is preempted first)
        self.resuming: set[int] = set()  # preempted requests waiting in the queue with their tokens
        self._counter = 0
        self.profile.kv_block_size = self.cache.block_size
        self.profile.num_kv_blocks = self.cache.num_blocks

    # -- the loop's hooks (ContinuousBatcher.run) ---------------------------------------------
    def _admit_queued(self) -> None:
        while self._admit_paged() and not self.rows:
            pass  # every admitted row finished on its first token: admit again

    def _decode_front(self) -> int:
        return 0  # every row writes at its own position (the stepper's one window holds any)

    def _advance_front(self, burst: int) -> None:
        """Nothing: the step advanced each row's position on the device."""

    def _note_peak(self) -> None:
        allocator = self.cache.allocator
        self.profile.peak_kv_blocks = max(self.profile.peak_kv_blocks, allocator.peak_used)
        live = sum(self._cached_tokens(row) for row in self.rows)
        self.profile.peak_live_tokens = max(self.profile.peak_live_tokens, live)

    def _cached_tokens(self, row: _Row) -> int:
        """Tokens of ``row`` in its blocks: its prompt and every generated token but the last (the
        next step's input)."""
        return self.lengths[row.request] + row.num_generated - 1

    # -- admission --------------------------------------------------------------------------
    def _entry_tokens(self, request: int) -> int:
        """Positions a queued row needs on entry: its prompt (and, resuming, its tokens but the
        last) plus the first decode step's."""
        return self.lengths[request] + max(1, len(self.outputs[request]))

    def _admissible_paged(self) -> tuple[list[int], bool]:
        """The longest queue prefix that fits the free slots and the pool, keeping one free block
        per live row (the watermark), and within ``admit_tokens`` (at least one row); whether that
        token bound cut it short."""
        allocator = self.cache.allocator
        free_slots = self.settings.num_slots - len(self.rows)
        budget = allocator.num_free
        chosen: list[int] = []
        tokens = 0
        for request in self.queue[:free_slots]:
            need = allocator.blocks_for(self._entry_tokens(request))
            if need > budget - (len(self.rows) + len(chosen) + 1):
                break
            tokens += self._entry_tokens(request) - 1  # its prefill: all but the first step's position
            if self.admit_tokens is not None and chosen and tokens > self.admit_tokens:
                return chosen, True
            budget -= need
            chosen.append(request)
        return chosen, False

    def _admit_paged(self) -> bool:
        """Admit the rows ``_admissible_paged`` allows, if at least ``refill_rows`` (or nothing is
        live); whether any came in."""
        if not self.queue or len(self.rows) >= self.settings.num_slots:
            return False
        chosen, bounded = self._admissible_paged()
        if not chosen and not self.rows:  # the watermark never blocks an empty cache
            request = self.queue[0]
            if self.cache.allocator.blocks_for(self._entry_tokens(request)) <= self.cache.allocator.num_free:
                chosen = [request]
        wanted = min(self.refill_rows, len(self.queue), self.settings.num_slots)
        if not chosen or (self.rows and len(chosen) < wanted and not bounded):
            return False
        del self.queue[: len(chosen)]
        resumed = [r for r in chosen if r in self.resuming]
        fresh = [r for r in chosen if r not in self.resuming]
        if resumed:
            self._resume(resumed)
        if fresh:
            start = len(self.rows)
            with self.timer.phase("cache_ms"):
                for i, request in enumerate(fresh):
                    self.cache.grow(start + i, self._entry_tokens(request))
            self._mark_admitted(fresh)
            self._admit_requests(fresh)  # plans, prefills, first tokens; retires rows done at once
        self._note_peak()
        return True

    def _mark_admitted(self, requests: Sequence[int]) -> None:
        for request in requests:
            self.admitted_order[request] = self._counter
            self._counter += 1

    def _resume(self, requests: Sequence[int]) -> None:
        """Preempted rows come back: one padded prefill of each prompt with its tokens but the last,
        which is the next input; positions, the ids seen, the sampling step and settings continue."""
        start = len(self.rows)
        slots = list(range(start, start + len(requests)))
        with self.timer.phase("cache_ms"):
            for slot, request in zip(slots, requests):
                self.cache.grow(slot, self._entry_tokens(request))
        ids = [list(self.prompts[r]) + self.outputs[r][:-1] for r in requests]
        with self.timer.phase("prefill_ms"), self.timer.record("prefill", batch=len(ids), width=max(map(len, ids))):
            _, layer_kv = prefill_bucket(self.model, ids, pad_token_id=self.settings.pad_token_id,
                                         cache_kwarg=self.settings.cache_kwarg)
            seen = None
            if self.state.seen is not None:
                seen = self._seen_of([list(self.prompts[r]) + self.outputs[r] for r in requests])
        self.profile.num_prefill_forwards += 1
        self.profile.num_prefill_rows += len(requests)
        with self.timer.phase("cache_ms"):
            self.cache.admit(slots, layer_kv, [len(i) for i in ids])
            last = torch.tensor([self.outputs[r][-1] for r in requests], dtype=torch.long, device=self.device)
            index = torch.tensor(list(requests), dtype=torch.long, device=self.device)
            sampling = None if self.settings.sampling is None else self.settings.sampling.rows(index)
            minimum = None if self.min_new_tokens is None else self.min_new_tokens[index]
            self.state.admit(slots, last, [len(i) for i in ids], seen, sample_keys=self.sample_keys[index],
                             steps=[len(self.outputs[r]) for r in requests], sampling=sampling,
                             min_new_tokens=minimum)
        self.rows.extend(_Row(r, len(self.outputs[r])) for r in requests)
        self.resuming.difference_update(requests)
        self._mark_admitted(requests)

    # -- growth and preemption ----------------------------------------------------------------
    def _reserve(self, burst: int) -> int:
        """Blocks for ``burst`` more tokens of every live row, preempting the newest rows while the
        pool cannot hold one more step; returns the burst it reserved (1 when it had to shrink)."""
        allocator = self.cache.allocator
        while True:
            needs = [allocator.missing(slot, self._cached_tokens(row) + burst) for slot, row in enumerate(self.rows)]
            if sum(needs) <= allocator.num_free:
                break
            if burst > 1:
                burst = 1
                continue
            if len(self.rows) == 1:
                raise RuntimeError(f"one row needs {sum(needs)} more blocks and the pool has {allocator.num_free}: "
                                   "the pool is smaller than one row's prompt and budget (pool check missed)")
            self._preempt()
        with self.timer.phase("cache_ms"):
            entries = []
            for slot, (row, need) in enumerate(zip(self.rows, needs)):
                if need:
                    entries.extend((slot, index, block) for index, block in
                                   allocator.grow(slot, self._cached_tokens(row) + burst))
            self.cache.set_blocks(entries)
        return burst

    def _preempt(self) -> None:
        """The most recently admitted live row gives its blocks back and waits at the head of the queue."""
        slot = max(range(len(self.rows)), key=lambda s: self.admitted_order[self.rows[s].request])
        request = self.rows[slot].request
        self.resuming.add(request)
        self.queue.insert(0, request)
        self.profile.num_preemptions += 1
        self._compact([s for s in range(len(self.rows)) if s != slot])

    # -- retirement -------------------------------------------------------------------------
    def _retire(self) -> None:
        keep = self._live_slots()
        if len(keep) < len(self.rows):
            self._compact(keep)

    def _compact(self, keep: Sequence[int]) -> None:
        """Free the blocks of the rows that leave, then keep the slots dense (table moves only)."""
        kept = set(keep)
        self.cache.release([slot for slot in range(len(self.rows)) if slot not in kept])
        super()._compact(keep)
