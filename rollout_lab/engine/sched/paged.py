"""Continuous batching over the paged cache: rows never wait for a shared front.

The ``paged`` route (``engine.kv.paged``). Every loop turn, before a decode step:

- **admission**: queued rows enter free slots, in input order, as long as the pool keeps one free block
  per live row after their prompts' blocks (a watermark, so the live rows can grow). A turn admits
  only when at least ``refill_rows`` rows can come in (or the queue is that short, or nothing is
  live): one prefill forward then serves several rows, instead of one eager forward per retired row.
  ``admit_tokens`` bounds the prompt tokens (a resuming row's: its prompt and tokens) one turn
  prefills, so the live rows never wait for more than that between two steps, and a turn the bound
  cut short admits its rows even if fewer than ``refill_rows``. The admitted rows are planned and
  prefilled as on the aligned cache (``ContinuousBatcher``: bucketed DP, packed, shared prefill,
  chunked long prompts), their KV copied into their blocks.
- **shared prompt blocks** (``share_prompt_blocks``): the samples of a prompt admitted together (one
  shared prefill) hold its KV once. The first takes blocks and the prompt's KV; each other reads the
  first's full prompt blocks (reference counts, ``BlockAllocator.share``) and holds its own copy of
  the partial last block and its own blocks for its tokens, so no row ever writes a shared block
  (its first decode token lands at position ``len(prompt)``, past the full blocks). Admission counts
  the shared blocks once, so more rows enter; a block is free when its last reader retires or is
  preempted, and a preempted row comes back into blocks of its own (recompute).
- **prefix cache across calls** (``prefix_cache``): the first row of a prompt, once prefilled, keys
  its full prompt blocks in the pool's cache (``BlockAllocator.register``), where they stay after
  its rows leave (idle, counted as free, taken back least recently used first). A new prompt
  (not a resuming row) reads the longest cached chain of its blocks (``attach``), at most the
  blocks before its last token (whose logits pick the first token), and is prefilled past them, one
  forward per prompt over the cached KV (``extend_prefill``, as a chunk over earlier chunks);
  its samples read its blocks as above. Admission counts a cached block a live row reads as held
  already, an idle one as taken. A prompt prefilled across turns starts from its cached KV
  (copied out of the pool) and enters into blocks of its own.
- **prefill across turns**: under ``admit_tokens``, a row whose prefill is longer than the bound (a
  new prompt, or a preempted row's prompt and tokens) reaching the head of the queue is prefilled
  ``admit_tokens`` tokens a turn, one chunk between two decode steps, each chunk attending to the
  earlier ones (``batching.extend_prefill``); its KV waits outside the pool until the last chunk,
  then it takes a slot and its blocks like any admitted row, a new prompt with the samples of it that
  follow in the queue (they share its KV). The rows behind it wait (input order); a turn's tokens
  left after a chunk admit them. So no turn prefills more than ``admit_tokens`` tokens
  (``Profile.max_turn_prefill_tokens``), and while rows wait for free slots or a prompt is between
  chunks, a turn comes after every decode step (no burst of steps between two reads).
- **growth**: each live row gets the blocks its next tokens need; a burst of steps without EOS
  reserves them all at once.
- **preemption**: when the pool cannot hold the next step, the most recently admitted row gives its
  blocks back and returns to the head of the queue, its tokens kept. When it is admitted again its
  prompt and all but its last token are prefilled (recompute), its last token is the next input and
  its sampling step continues from its count, so its tokens are those it would have made unpreempted.
- **continuations** (``generate``'s ``finish_fraction``): a call that returns once enough rows
  finished leaves the others as they are; a later call's continuation of one (a row with tokens
  from the start) enters as a preempted row resumes.

Slots stay dense by compaction, which moves block-table rows only (no KV). The profile counts the
live rows of every decode step (occupancy), the preemptions, the peak of blocks in use, of blocks
read by several rows and of tokens held in distinct blocks (on the host, no device read).

"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from rollout_lab.engine.sched.aligned import ContinuousBatcher, extend_prefill
from rollout_lab.engine.sched.request import Request
from rollout_lab.engine.kv.paged import PagedKVCache, block_keys
from rollout_lab.engine.runner.prefill import prefill_bucket
from rollout_lab.planner.bucket_dp import BucketPlan
from rollout_lab.planner.kv_reads import kv_bytes_read


@dataclass
class _Prefilling:
    """A prompt longer than ``admit_tokens`` being prefilled across turns: its first ``done`` tokens'
    per-layer KV (outside the pool) and the logits after them."""

    request: int
    ids: list[int]  # what it prefills (``PagedBatcher._prefill_ids``, fixed while it waits)
    done: int
    chunks: list[int]
    kv: list[tuple[torch.Tensor, torch.Tensor]]
    logits: torch.Tensor  # [1, vocab]


class PagedBatcher(ContinuousBatcher):
    """Runs one call's requests through the paged cache; ``run()`` fills their tokens, returns the plans."""

    def __init__(self, *args, refill_rows: int = 1, admit_tokens: int | None = None,
                 share_prompt_blocks: bool = True, prefix_cache: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        if not isinstance(self.cache, PagedKVCache):
            raise ValueError("PagedBatcher needs a stepper over the paged cache (StepperKey.block_size)")
        self.refill_rows = max(1, refill_rows)
        self.admit_tokens = admit_tokens
        self.share_prompt_blocks = share_prompt_blocks
        self.prefix_cache = prefix_cache
        if not prefix_cache:  # a call without the cache starts from an empty one
            self.cache.allocator.clear_cached()
        self._keys: dict[int, list[bytes]] = {}  # group -> its prompt's full blocks' keys (block_keys)
        self._hits: dict[int, list[int]] = {}  # a new prompt's first row this turn -> the cached blocks it reads
        self.admitted_order: dict[int, int] = {}  # request -> admission counter (the newest is preempted first)
        # preempted requests waiting in the queue with their tokens; a continuation of an earlier
        # call (``Request`` with tokens from the start) resumes as one
        self.resuming: set[int] = {r.index for r in self.requests if r.tokens}
        self.prefilling: _Prefilling | None = None  # a long prompt prefilled across turns
        self._turn_tokens = 0  # prompt tokens this turn prefilled so far
        self._turn_stalls = False  # whether rows were live when this turn began (they wait for it)
        self._counter = 0
        self._kv_bytes_read = 0  # by the decode's attention, over the call's steps so far
        self.profile.kv_block_size = self.cache.block_size
        self.profile.num_kv_blocks = self.cache.num_blocks

    # -- the loop's hooks (ContinuousBatcher.run) ---------------------------------------------
    def _admit_queued(self) -> None:
        while self._admit_paged() and not self.rows:
            pass  # nothing live yet (every admitted row finished on its first token, or a long
            # prompt's prefill goes on): the next turn comes at once, no step waits for it

    def _pending(self) -> bool:
        return self.prefilling is not None

    def _cap_burst(self, burst: int) -> int:
        """Under ``admit_tokens``, one step while a prompt is prefilling across turns or queued rows
        could fill free slots: each turn admits a bounded share, so turns come after every step, not
        after a burst (a burst of 8, or to the nearest budget without EOS, would leave the slots the
        bound kept empty for all of it)."""
        if self.admit_tokens is not None and (
                self.prefilling is not None or (self.queue and len(self.rows) < self.settings.num_slots)):
            return 1
        return burst

    def _before_burst(self, num_rows: int, burst: int) -> None:
        """The groups of the shared-prefix read as the rows hold their blocks now (found again only
        when they changed), and the KV bytes the burst's steps read (``planner.kv_reads``: each row's
        context, a group's shared prefix once per tile of its rows where the step reads it so; the
        context grows by a token per row and step; an FP8 pool's bytes) into ``Profile.kv_bytes_read_per_step``."""
        cache = self.cache
        cache.refresh_prefix_groups(num_rows)
        context = sum(self._cached_tokens(row) + 1 for row in self.rows)  # each row attends to its new token too
        groups = dict(prefix_tokens=cache.group_tokens, group_rows=cache.group_rows) if cache.prefix_groups else {}
        first = kv_bytes_read(context, self.geometry, **groups)
        tokens_read = burst * first + num_rows * (burst * (burst - 1) // 2) * self.geometry.kv_bytes_per_token
        # in the model's dtype; a pool that stores less (FP8: e4m3 and scales) reads its own bytes
        self._kv_bytes_read += tokens_read * (cache.token_bytes / self.geometry.kv_bytes_per_token)
        self.profile.kv_bytes_read_per_step = self._kv_bytes_read / (self.profile.num_decode_forwards + burst)

    def _decode_front(self) -> int:
        return 0  # every row writes at its own position (the stepper's one window holds any)

    def _advance_front(self, burst: int) -> None:
        """Nothing: the step advanced each row's position on the device."""

    def _note_peak(self) -> None:
        allocator = self.cache.allocator
        self.profile.peak_kv_blocks = max(self.profile.peak_kv_blocks, allocator.peak_used)
        self.profile.shared_kv_blocks = max(self.profile.shared_kv_blocks, allocator.peak_shared)
        live = sum(self._cached_tokens(row) for row in self.rows)
        self.profile.peak_live_tokens = max(self.profile.peak_live_tokens, live)
        # a shared block is a full prompt block: each reader past the first counts its tokens again
        unique = live - allocator.extra_refs * self.cache.block_size
        self.profile.unique_kv_tokens = max(self.profile.unique_kv_tokens, unique)
        self.profile.prefix_cache_evicted_blocks = allocator.num_evicted

    def _cached_tokens(self, row: Request) -> int:
        """Tokens of ``row`` in its blocks: its prompt and every generated token but the last (the
        next step's input)."""
        return self.lengths[row.index] + row.num_generated - 1

    # -- admission --------------------------------------------------------------------------
    def _entry_tokens(self, request: int) -> int:
        """Positions a queued row needs on entry: its prompt (and, resuming, its tokens but the
        last) plus the first decode step's."""
        return self.lengths[request] + max(1, len(self.requests[request].tokens))

    def _prefill_tokens(self, request: int) -> int:
        """Tokens entering ``request`` prefills (what ``admit_tokens`` bounds): its entry positions
        but the first step's."""
        return self._entry_tokens(request) - 1

    def _shared_blocks(self, request: int) -> int:
        """Blocks a sample of ``request``'s prompt reads from the first sample admitted with it
        instead of holding its own: the prompt's full blocks (none without ``share_prompt_blocks``)."""
        return self.lengths[request] // self.cache.block_size if self.share_prompt_blocks else 0

    def _prompt_keys(self, request: int) -> list[bytes]:
        """The prefix-cache keys of ``request``'s full prompt blocks (one computation per prompt)."""
        group = self.requests[request].group
        if group not in self._keys:
            self._keys[group] = block_keys(self.requests[request].prompt, self.cache.block_size)
        return self._keys[group]

    def _cached_prefix(self, request: int) -> list[int]:
        """The cached blocks a new prompt's first row reads (``prefix_cache``): its longest cached
        chain, within the blocks before its last token, which is always prefilled (its logits pick
        the first token)."""
        if not self.prefix_cache or request in self.resuming:
            return []
        usable = (self.lengths[request] - 1) // self.cache.block_size
        return self.cache.allocator.match(self._prompt_keys(request)[:usable])

    def _register(self, slot: int, request: int) -> None:
        """Key the full prompt blocks of ``slot``, which holds ``request``'s prompt written (``prefix_cache``)."""
        if self.prefix_cache:
            self.cache.allocator.register(slot, self._prompt_keys(request)[: self.lengths[request] // self.cache.block_size])

    def _splits(self, request: int) -> bool:
        """Whether entering ``request`` is prefilled across turns: more than ``admit_tokens`` tokens."""
        return self.admit_tokens is not None and self._prefill_tokens(request) > self.admit_tokens

    def _admissible_paged(self, limit: int | None) -> tuple[list[int], bool]:
        """The longest queue prefix that fits the free slots and the pool, keeping one free block
        per live row (the watermark), and within ``limit`` prompt tokens; whether that token bound
        cut it short. It stops at a row prefilled across turns (``_splits``). A new row of a prompt
        whose first new row is chosen before it needs only its own blocks (``_grow_admitted``); the
        first new row of a prompt reads its cached blocks (``_cached_prefix``, kept in ``_hits``), of
        which only the idle ones are taken from the free count."""
        allocator = self.cache.allocator
        free_slots = self.settings.num_slots - len(self.rows)
        budget = allocator.num_free
        chosen: list[int] = []
        groups: set[int] = set()  # the prompts (groups) of the new rows chosen
        claimed: set[int] = set()  # idle cached blocks the chosen rows read
        self._hits = {}
        tokens = 0
        for request in self.queue[:free_slots]:
            if self._splits(request):
                return chosen, bool(chosen)
            need = allocator.blocks_for(self._entry_tokens(request))
            group = None if request in self.resuming else self.requests[request].group  # resumed: its own blocks
            hits: list[int] = []
            if group in groups:
                need -= self._shared_blocks(request)
            else:
                hits = self._cached_prefix(request)
                idle = {b for b in hits if not allocator.refs[b]} - claimed
                need -= len(hits) - len(idle)
            if need > budget - (len(self.rows) + len(chosen) + 1):
                break
            tokens += self._prefill_tokens(request)
            if limit is not None and tokens > limit:
                return chosen, True
            budget -= need
            chosen.append(request)
            if hits:
                self._hits[request] = hits
                claimed |= idle
            if group is not None:
                groups.add(group)
        return chosen, False

    def _admit_paged(self) -> bool:
        """One turn's admission: the next chunk of a prompt prefilled across turns (and its entry
        once whole), then the rows ``_admissible_paged`` allows within the turn's tokens left, if
        at least ``refill_rows`` (or nothing is live), else a long prompt's first chunk; whether
        anything was done."""
        self._turn_tokens, self._turn_stalls = 0, bool(self.rows)
        spent, done = 0, False
        if self.prefilling is not None:
            spent = self._prefill_chunk()
            done = spent > 0
            if self._prefilled():
                done = self._enter_prefilled() or done
        limit = None if self.admit_tokens is None else self.admit_tokens - spent
        if limit is not None and limit <= 0:
            return done
        if not self.queue or len(self.rows) >= self.settings.num_slots:
            return self._start_prefilling(spent) or done
        chosen, bounded = self._admissible_paged(limit)
        if not chosen and not self.rows:  # the watermark never blocks an empty cache
            request = self.queue[0]
            if not self._splits(request) and \
                    self.cache.allocator.blocks_for(self._entry_tokens(request)) <= self.cache.allocator.num_free:
                chosen = [request]
                self._hits = {request: hits} if (hits := self._cached_prefix(request)) else {}
        wanted = min(self.refill_rows, len(self.queue), self.settings.num_slots)
        if not chosen or (self.rows and len(chosen) < wanted and not bounded):
            return self._start_prefilling(spent) or done
        del self.queue[: len(chosen)]
        self._note_turn(sum(self._prefill_tokens(r) for r in chosen))
        resumed = [r for r in chosen if r in self.resuming]
        fresh = [r for r in chosen if r not in self.resuming]
        # the prompts with cached blocks first: they are prefilled one by one over their cached KV
        hit_groups = {self.requests[r].group for r in self._hits}
        cached = [r for r in fresh if self.requests[r].group in hit_groups]
        fresh = cached + [r for r in fresh if self.requests[r].group not in hit_groups]
        if cached:  # before the resumed rows grow: those may take idle cached blocks back
            with self.timer.phase("cache_ms"):
                self._attach_cached(cached, len(self.rows) + len(resumed))
        if resumed:
            self._resume(resumed)
        if fresh:
            with self.timer.phase("cache_ms"):
                self._grow_admitted(fresh, len(self.rows))
            self._mark_admitted(fresh)
            if cached:
                self._admit_cached(cached)
            if len(fresh) > len(cached):
                self._admit_requests(fresh[len(cached):])  # plans, prefills, first tokens; retires rows done at once
            else:
                self._retire()
        self._note_peak()
        return True

    def _attach_cached(self, requests: Sequence[int], start: int) -> None:
        """The first row of each prompt in ``requests`` (entering slots from ``start``) reads its
        cached blocks (``_hits``)."""
        seen: set[int] = set()
        for slot, request in enumerate(requests, start):
            group = self.requests[request].group
            if group not in seen:
                seen.add(group)
                self.cache.attach(slot, self._hits[request])

    def _admit_cached(self, requests: Sequence[int]) -> None:
        """New rows whose prompts read cached blocks (their slots' blocks attached and grown, in
        order from ``len(self.rows)``): each prompt is prefilled past its cached blocks, one forward
        over their KV (``extend_prefill``), written from there into its first row's blocks (and, with
        copies, whole into the others'); the first tokens come from its logits. Rows that finish on
        their first token retire later (the caller)."""
        start = len(self.rows)
        members: dict[int, list[int]] = {}  # group -> its slots here, the first reading the cached blocks
        for slot, request in enumerate(requests, start):
            members.setdefault(self.requests[request].group, []).append(slot)
        self.rows.extend(self.requests[r] for r in requests)
        size = self.cache.block_size
        for slots in members.values():
            rows = [self.rows[slot].index for slot in slots]
            first, length = rows[0], self.lengths[rows[0]]
            done = len(self._hits[first]) * size
            suffix = self.requests[first].prompt[done:]
            with self.timer.phase("prefill_ms"):
                logits, layer_kv = extend_prefill(
                    self.model, self.cache.gather(self._hits[first]), [suffix], cache_kwarg=self.settings.cache_kwarg,
                    record=lambda w, o: self.timer.record("chunk", batch=1, width=w, offset=o))
                logits = logits.index_select(0, torch.zeros(len(rows), dtype=torch.long, device=logits.device))
                tokens, token_logprobs, settings = self._first_tokens(rows, logits)
            self.plans.append(BucketPlan(buckets=((first,),), widths=(len(suffix),), cost_ms=0.0))
            self.profile.num_prefill_forwards += 1
            self.profile.num_prefill_rows += 1
            self.profile.num_replicated_rows += len(rows) - 1
            self.profile.prefix_cache_hits += done
            with self.timer.phase("cache_ms"):
                written = slots[:1] if self.share_prompt_blocks else slots  # the others read its blocks
                self.cache.admit(written, layer_kv, [length] * len(written), source_rows=[0] * len(written),
                                 starts=[done] + [0] * (len(written) - 1))
                self._copy_partial_blocks(slots, [slots[0]] * len(slots), [length] * len(slots))
                self.state.admit(slots, tokens, [length] * len(rows), **settings)
                self._register(slots[0], first)
            for j, (slot, token) in enumerate(zip(slots, tokens.tolist())):
                self.rows[slot].append(token, None if token_logprobs is None else token_logprobs[j])

    # -- prefill across turns -----------------------------------------------------------------
    def _prefill_ids(self, request: int) -> list[int]:
        """What entering ``request`` prefills: its prompt, and a preempted row's tokens but the last."""
        row = self.requests[request]
        return row.prompt + row.tokens[:-1] if request in self.resuming else list(row.prompt)

    def _start_prefilling(self, spent: int) -> bool:
        """With nothing prefilling and the turn's tokens untouched, a long prompt at the head of the
        queue leaves it and runs its first chunk; whether it did."""
        if self.prefilling is not None or spent or not self.queue or not self._splits(self.queue[0]):
            return False
        request = self.queue.pop(0)
        ids = self._prefill_ids(request)
        hits = self._cached_prefix(request)
        if hits:  # its cached KV, copied out of the pool (the blocks may be taken back while it waits)
            done = len(hits) * self.cache.block_size
            head = ids[done : done + self.admit_tokens]
            self.profile.prefix_cache_hits += done
            with self.timer.phase("prefill_ms"):
                logits, layer_kv = extend_prefill(
                    self.model, self.cache.gather(hits), [head], cache_kwarg=self.settings.cache_kwarg,
                    record=lambda w, o: self.timer.record("chunk", batch=1, width=w, offset=o))
        else:
            done, head = 0, ids[: self.admit_tokens]
            with self.timer.phase("prefill_ms"), self.timer.record("prefill", batch=1, width=len(head)):
                logits, layer_kv = prefill_bucket(self.model, [head], pad_token_id=self.settings.pad_token_id,
                                                  cache_kwarg=self.settings.cache_kwarg)
        self.profile.num_prefill_forwards += 1
        self.prefilling = _Prefilling(request, ids, done + len(head), [], list(layer_kv), logits)
        self._note_turn(len(head))
        return True

    def _prefill_chunk(self) -> int:
        """The prefilling prompt's next chunk (at most ``admit_tokens`` tokens); the tokens run."""
        pending = self.prefilling
        chunk = pending.ids[pending.done : pending.done + self.admit_tokens]
        if not chunk:
            return 0
        with self.timer.phase("prefill_ms"):
            logits, pending.kv = extend_prefill(
                self.model, pending.kv, [chunk], cache_kwarg=self.settings.cache_kwarg,
                record=lambda w, o: self.timer.record("chunk", batch=1, width=w, offset=o))
        pending.logits = logits
        pending.done += len(chunk)
        pending.chunks.append(len(chunk))
        self.profile.num_prefill_forwards += 1
        self._note_turn(len(chunk))
        return len(chunk)

    def _prefilled(self) -> bool:
        pending = self.prefilling
        return pending is not None and pending.done == len(pending.ids)

    def _enter_prefilled(self) -> bool:
        """The fully prefilled row takes a slot and its blocks, a new prompt with the samples of it
        next in the queue (they share its KV and logits), as many as free slots and blocks allow
        (the watermark kept unless nothing is live); whether it entered."""
        pending, allocator = self.prefilling, self.cache.allocator
        resuming = pending.request in self.resuming
        group = self.requests[pending.request].group
        members, budget = [], allocator.num_free
        for request in [pending.request, *self.queue]:
            if request != pending.request and (resuming or self.requests[request].group != group
                                               or request in self.resuming):
                break
            need = allocator.blocks_for(self._entry_tokens(request))
            if members:  # a sample after the first reads its prompt's full blocks
                need -= self._shared_blocks(request)
            floor = len(self.rows) + len(members) + 1 if self.rows or members else 0
            if len(self.rows) + len(members) >= self.settings.num_slots or need > budget - floor:
                break
            budget -= need
            members.append(request)
        if not members:
            return False
        self.prefilling = None
        del self.queue[: len(members) - 1]
        start = len(self.rows)
        slots = list(range(start, start + len(members)))
        with self.timer.phase("cache_ms"):
            self._grow_admitted(members, start)
        self.plans.append(BucketPlan(buckets=((pending.request,),), widths=(self.admit_tokens,), cost_ms=0.0,
                                     chunks=((pending.request, tuple(pending.chunks)),)))
        if resuming:
            self._place_resumed([pending.request], slots, pending.kv)
            return True
        self._mark_admitted(members)
        self.rows.extend(self.requests[r] for r in members)
        length = self.lengths[pending.request]
        with self.timer.phase("prefill_ms"):
            logits = pending.logits.index_select(0, torch.zeros(len(members), dtype=torch.long, device=self.device))
            first, first_logprobs, settings = self._first_tokens(members, logits)
        self.profile.num_prefill_rows += 1
        self.profile.num_replicated_rows += len(members) - 1
        with self.timer.phase("cache_ms"):
            written = slots[:1] if self.share_prompt_blocks else slots  # the others read its blocks
            self.cache.admit(written, pending.kv, [length] * len(written), source_rows=[0] * len(written))
            self._copy_partial_blocks(slots, [slots[0]] * len(slots), [length] * len(slots))
            self.state.admit(slots, first, [length] * len(members), **settings)
            self._register(slots[0], pending.request)
        for j, (slot, token) in enumerate(zip(slots, first.tolist())):
            self.rows[slot].append(token, None if first_logprobs is None else first_logprobs[j])
        self._note_peak()
        self._retire()
        return True

    def _grow_admitted(self, requests: Sequence[int], start: int) -> None:
        """Blocks for new rows ``requests`` entering slots from ``start`` (their prompts and first
        step): the first row of a prompt here gets all of its own; with ``share_prompt_blocks`` each
        later one reads the first's full prompt blocks and gets its own for the rest (the partial
        block it copies, ``_copy_partial_blocks``, and its tokens)."""
        first: dict[int, int] = {}  # group -> the slot of its first row here (maybe reading cached blocks)
        for slot, request in enumerate(requests, start):
            source = first.setdefault(self.requests[request].group, slot)
            if source != slot and self.share_prompt_blocks:
                self.cache.share(slot, source, self.lengths[request])
            self.cache.grow(slot, self._entry_tokens(request))

    def _write_kv(self, requests: Sequence[int], slots: Sequence[int], source: Sequence[int], layer_kv,
                  offsets: Sequence[int] | None) -> None:
        """With ``share_prompt_blocks`` the prefill is written into the first slot of each prompt only;
        the others read its full blocks already and copy its partial last block. With ``prefix_cache``
        the first slot's full prompt blocks are keyed in the cache."""
        first: dict[int, int] = {}  # prefilled row -> its first slot
        for slot, row in zip(slots, source):
            first.setdefault(row, slot)
        if self.share_prompt_blocks:
            super()._write_kv(requests, list(first.values()), list(first), layer_kv, offsets)
            self._copy_partial_blocks(slots, [first[row] for row in source],
                                      [self.lengths[requests[row]] for row in source])
        else:
            super()._write_kv(requests, slots, source, layer_kv, offsets)
        for row, slot in first.items():
            self._register(slot, requests[row])

    def _copy_partial_blocks(self, slots: Sequence[int], sources: Sequence[int], lengths: Sequence[int]) -> None:
        """Each slot reading the full prompt blocks of ``sources[j]`` (``lengths[j]`` prompt tokens) gets
        the prompt's positions past them, its partial last block, from there (none when the prompt
        fills its blocks)."""
        if not self.share_prompt_blocks:
            return
        size = self.cache.block_size
        copies = [(slot, source, n // size * size, n) for slot, source, n in zip(slots, sources, lengths)
                  if slot != source and n % size]
        if copies:
            self.cache.copy_positions(*(list(column) for column in zip(*copies)))

    def _note_turn(self, tokens: int) -> None:
        """Count a turn's prefill tokens toward the longest stall, if rows were live to wait for it."""
        self._turn_tokens += tokens
        if self._turn_stalls:
            self.profile.max_turn_prefill_tokens = max(self.profile.max_turn_prefill_tokens, self._turn_tokens)

    def _mark_admitted(self, requests: Sequence[int]) -> None:
        for request in requests:
            self.admitted_order[request] = self._counter
            self._counter += 1

    def _resume(self, requests: Sequence[int]) -> None:
        """Preempted rows come back: one padded prefill of each prompt with its tokens but the last,
        which is the next input (``_place_resumed``)."""
        start = len(self.rows)
        slots = list(range(start, start + len(requests)))
        with self.timer.phase("cache_ms"):
            for slot, request in zip(slots, requests):
                self.cache.grow(slot, self._entry_tokens(request))
        ids = [self._prefill_ids(r) for r in requests]
        with self.timer.phase("prefill_ms"), self.timer.record("prefill", batch=len(ids), width=max(map(len, ids))):
            _, layer_kv = prefill_bucket(self.model, ids, pad_token_id=self.settings.pad_token_id,
                                         cache_kwarg=self.settings.cache_kwarg)
        self.profile.num_prefill_forwards += 1
        self._place_resumed(requests, slots, layer_kv)

    def _place_resumed(self, requests: Sequence[int], slots: Sequence[int], layer_kv,
                       starts: Sequence[int] | None = None) -> None:
        """Preempted rows whose prefill ``layer_kv`` (left-padded, one row each) ran enter ``slots``
        (their blocks grown; ``starts``: the positions before them are cached blocks they read, not
        written; ``layer_kv`` None: their blocks hold all of it, nothing was prefilled): positions,
        the ids seen and counted, the sampling step and settings continue."""
        ids = [self._prefill_ids(r) for r in requests]
        rows = [self.requests[r] for r in requests]
        with self.timer.phase("prefill_ms"):
            settings = self._row_settings(rows)
        with self.timer.phase("cache_ms"):
            if layer_kv is not None:
                self.profile.num_prefill_rows += len(requests)
                self.cache.admit(slots, layer_kv, [len(i) for i in ids], starts=starts)
            last = torch.tensor([row.tokens[-1] for row in rows], dtype=torch.long, device=self.device)
            self.state.admit(slots, last, [len(i) for i in ids], steps=[len(row.tokens) for row in rows], **settings)
        for row in rows:
            row.num_generated = len(row.tokens)
        self.rows.extend(rows)
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
        slot = max(range(len(self.rows)), key=lambda s: self.admitted_order[self.rows[s].index])
        request = self.rows[slot].index
        self.resuming.add(request)
        self.queue.insert(0, request)
        self.profile.num_preemptions += 1
        self._compact([s for s in range(len(self.rows)) if s != slot])

    # -- retirement -------------------------------------------------------------------------
    def _retire(self) -> None:
        keep = self._live_slots()
        self._report_retired(keep)
        if len(keep) < len(self.rows):
            self._compact(keep)

    def _compact(self, keep: Sequence[int]) -> None:
        """Free the blocks of the rows that leave, then keep the slots dense (table moves only)."""
        kept = set(keep)
        self.cache.release([slot for slot in range(len(self.rows)) if slot not in kept])
        super()._compact(keep)
