"""Continuous batching over the aligned cache: admit, prefill buckets, decode, retire, compact, trim.

Slots stay dense: live rows occupy slots ``[0, num_live)``; retiring rows leave holes that the last
live rows fill (compaction), and queued requests are admitted, in input order, into the free tail.
Each admission is re-planned (``equal_width``: one bucket; ``aligned``: one per request;
``bucketed``: the DP). A request is admitted only when the cache can hold it and every live row to
the end of their budgets; otherwise it waits for rows to retire. Dead left columns are trimmed when
``trim_cache`` is set or when the front would otherwise run past the capacity.

Here a "request" is one row of the call: (request, sample) of ``Rollout.generate``. Shared
prefill: rows of one ``groups`` id (identical prompts) admitted together are planned and
prefilled as one row whose KV (and first-token logits) are replicated into their slots; a group
split across admissions (fewer free slots than its rows) is prefilled once per admission.

Chunked prefill of one over-long prompt: its tail chunks, run in order after its head.

The planner (``planner.chunks.plan_chunked``) cuts a prompt of more than ``prefill_max_tokens`` tokens into
a head, prefilled in an ordinary bucket (``prefill.prefill_bucket``, possibly beside short prompts),
and tail chunks of exactly the limit. ``extend_prefill`` runs the tails one forward each over a
``DynamicCache`` that already holds the head (and then every earlier chunk), with position ids
continuing from it, so chunk k attends to chunks < k; the caller copies the whole span into the
prompt's slot (``AlignedKVCache.admit``) and takes the first token from the last chunk's logits.

    logits, layer_kv = extend_prefill(model, head_kv, [prompt[h:h + c], ...], cache_kwarg="cache")

"""
from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from transformers import DynamicCache

from rollout_lab.engine.sample.processors import (
    RowPenalties,
    counts_from_ids,
    ids_tensor,
    note_tokens,
    seen_from_ids,
    select_tokens,
    stop_id_mask,
)
from rollout_lab.engine.sample.stopping import stop_string_hits
from rollout_lab.engine.sched.request import Request
from rollout_lab.engine.runner.prefill import packed_backend, prefill_bucket, prefill_packed
from rollout_lab.engine.runner.prefill_graphs import PrefillGraphs
from rollout_lab.engine.profile import Profile, Timer
from rollout_lab.engine.sample.sampler import RowSampling
from rollout_lab.engine.runner.steppers import EagerStepper, StepperKey
from rollout_lab.planner.bucket_dp import BucketPlan
from rollout_lab.planner.cost import CostCoefficients, ModelGeometry
from rollout_lab.planner.routes import plan_admission
from rollout_lab.planner.shape_classes import ShapeClasses


@dataclass(frozen=True)
class BatchSettings:
    """What one ``generate`` call asks of the batcher beyond its requests (checked by ``RolloutConfig``
    and the call spec)."""

    route: str
    num_slots: int
    capacity: int
    trim_cache: bool
    pad_token_id: int
    cache_kwarg: str
    sampling: RowSampling | None = None  # each row's settings; None: every row greedy
    penalties: RowPenalties | None = None  # each row's penalties; None: no row has one
    holds_stops_back: bool = False  # a row's min_tokens holds its stop ids back (processors.holds_stops_back)
    prefill_classes: ShapeClasses | None = None  # bucketed prefill at class shapes
    logprobs_mode: str | None = None  # processors.LOGPROB_MODES: each token's log-probability too
    # decode steps between reads of the tokens while rows can end at EOS (RolloutConfig.eos_check_interval)
    eos_check_interval: int = 1
    # Auto's prefill plan over the call's unique prompts (in order of first appearance): the first
    # admission of all of them runs it instead of planning again (``planner.routes.RoutePlan.plan``)
    first_plan: BucketPlan | None = None
    # called after each retirement pass with the rows it retired, maybe none (the call's progress bar)
    on_retire: Callable[[Sequence[Request]], None] | None = None
    # the call returns once this many rows finished, the others as they are (generate's
    # finish_fraction; the paged route's preemption resumes them in a later call); None: all
    finish_rows: int | None = None


class ContinuousBatcher:
    """Runs one call's requests (``sched.request.Request``, one per row, request-major) through the
    aligned cache; ``run()`` fills each request's tokens (and logprobs) and returns the plans."""

    def __init__(
        self, model: torch.nn.Module, requests: Sequence[Request], settings: BatchSettings, *,
        geometry: ModelGeometry, costs: CostCoefficients, profile: Profile, timer: Timer,
        stepper: "EagerStepper | None" = None, prefill_graphs: "PrefillGraphs | None" = None,
    ):
        self.model, self.requests, self.settings = model, list(requests), settings
        self.prefill_graphs = prefill_graphs  # bucketed forwards at class shapes by graph replay
        self.geometry, self.costs = geometry, costs
        self.profile, self.timer = profile, timer
        self.lengths = [len(r.prompt) for r in self.requests]  # what the planner plans over
        self.vocab_size = model.get_input_embeddings().weight.shape[0]
        self.device = next(model.parameters()).device
        # what can end a row early: its stop ids (read every eos_check_interval steps) or stop strings
        self.can_stop = any(r.stop_ids for r in self.requests)
        self.has_stop_strings = any(r.stop_strings is not None for r in self.requests)
        with timer.phase("cache_ms"):
            if stepper is None:
                stepper = EagerStepper(model, StepperKey.for_rows(
                    settings.num_slots, settings.capacity, settings.cache_kwarg, sampling=settings.sampling,
                    penalties=settings.penalties, min_new_tokens=settings.holds_stops_back,
                    logprobs_mode=settings.logprobs_mode))
            else:
                stepper.reset()
        self.stepper, self.cache, self.state = stepper, stepper.cache, stepper.state
        profile.cache_bytes = self.cache.num_bytes
        profile.num_slots = settings.num_slots
        self.rows: list[Request] = []  # index = slot
        self.queue = list(range(len(self.requests)))  # row indices not yet admitted, input order
        self.plans: list[BucketPlan] = []
        self.tails: dict[int, tuple[int, ...]] = {}  # request -> tail chunk widths (this admission)
        self._spans: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # bucket row -> whole KV
        self._in_flight: tuple | None = None  # a burst whose tokens are read late (``_send_burst``)
        self.finished: set[int] = set()  # the rows retired (their index)

    # -- the loop ---------------------------------------------------------------------------
    def run(self) -> tuple[list[list[int]], list[BucketPlan]]:
        while (self.queue or self.rows or self._pending()) and not self._finished_enough():
            if self.queue or self._pending():
                self._read_burst()  # admission may read a row's tokens (a preempted row resuming)
            self._admit_queued()
            if self._finished_enough():
                break  # rows that finished on their first token reached it
            if not self.rows:
                if not self.queue and not self._pending():
                    break  # the last admissions all finished on their first token
                raise RuntimeError("no request is admissible into an empty cache (capacity or pool check missed)")
            # Without EOS ids or stop strings nothing retires before the nearest budget: run those
            # steps without reading tokens back, so the host never waits on the device in between.
            # With EOS ids, eos_check_interval steps at most: a row that ends inside them computes
            # the rest (not kept). Stop strings are read after every token.
            burst = 1
            if not self.has_stop_strings:
                burst = min(row.remaining for row in self.rows)
                if self.can_stop:
                    burst = min(burst, self.settings.eos_check_interval)
            burst = self._reserve(self._cap_burst(burst))
            num_rows = len(self.rows)
            self._before_burst(num_rows, burst)
            with self.timer.phase("decode_ms"), self.timer.record("decode", rows=num_rows, steps=burst):
                front = self._decode_front()
                steps, step_logprobs = [], []
                for k in range(burst):
                    steps.append(self.stepper.step(num_rows, front + k))
                    if self.settings.logprobs_mode:  # read before the next step overwrites them
                        step_logprobs.append(self.stepper.logprobs(num_rows))
                tokens = torch.stack(steps, 1)
                logprobs = torch.stack(step_logprobs, 1) if step_logprobs else None
                self._advance_front(burst)
                if self._reads_late():
                    kept = self._send_burst(tokens, logprobs)
                else:
                    self._read_burst()
                    kept = self._take_burst(list(self.rows), tokens.tolist(),
                                            None if logprobs is None else logprobs.tolist())
            self._note_peak()
            self.profile.num_decode_forwards += burst
            self.profile.decode_row_steps += kept
            if self.queue or self._pending():
                self.profile.queued_decode_steps += burst
                self.profile.queued_row_steps += kept
            self._retire()
        self._read_burst()
        return self.plans

    def _finished_enough(self) -> bool:
        """Whether ``settings.finish_rows`` rows have finished (never without it)."""
        return self.settings.finish_rows is not None and len(self.finished) >= self.settings.finish_rows

    @property
    def sequences(self) -> list[list[int]]:
        """Each row's tokens, in row order."""
        return [r.tokens for r in self.requests]

    @property
    def logprobs(self) -> list[list[float]]:
        """Each row's tokens' log-probabilities (with ``settings.logprobs_mode``), in row order."""
        return [r.logprobs for r in self.requests]

    # -- reading the tokens one burst late ------------------------------------------------------
    # When no token can end a row (no EOS or stop ids, no stop strings), which rows live, retire and
    # grow follows from the budgets alone, so the host need not wait for a burst's tokens before it
    # queues the next: it counts them at once, copies them to pinned memory behind the burst, and
    # reads them after the next burst is queued. The device never idles while the host retires,
    # compacts and reserves (every host-to-device copy on that path is asynchronous:
    # ``cache.device_tensor``). Admission reads them first (a preempted row resumes with its tokens).
    def _reads_late(self) -> bool:
        return not self.has_stop_strings and not self.can_stop

    def _send_burst(self, tokens: torch.Tensor, logprobs: torch.Tensor | None) -> int:
        """Start the copy of a burst's tokens (and logprobs) to the host, read the burst before it,
        and count this one's tokens on its rows; the row-steps it made."""
        host, copied = [tokens, logprobs], None  # off CUDA the stacked tensors are the host's already
        if tokens.device.type == "cuda":
            host = [t if t is None else torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                    for t in host]
            copied = torch.cuda.Event()
            copied.record()
        self._read_burst()
        rows = list(self.rows)
        self._in_flight = (rows, host[0], host[1], copied)
        burst = tokens.shape[1]
        for row in rows:
            row.num_generated += burst
        return len(rows) * burst

    def _read_burst(self) -> None:
        """Append the tokens of the burst in flight (``_send_burst``) to their rows' outputs."""
        if self._in_flight is None:
            return
        rows, tokens, logprobs, copied = self._in_flight
        self._in_flight = None
        if copied is not None:
            copied.synchronize()
        for i, row in enumerate(rows):
            row.tokens.extend(tokens[i].tolist())
            if logprobs is not None:
                row.logprobs.extend(logprobs[i].tolist())

    def _take_burst(self, rows: Sequence[Request], tokens: list[list[int]], logprobs: list[list[float]] | None) -> int:
        """Append a burst's tokens read at once; a row that ended inside it (EOS, read every
        ``eos_check_interval`` steps) keeps none after its end. The row-steps that made a row's token."""
        kept = 0
        for i, (row, row_tokens) in enumerate(zip(rows, tokens)):
            for k, token in enumerate(row_tokens):
                row.append(token, None if logprobs is None else logprobs[i][k])
                kept += 1
                if k + 1 < len(row_tokens) and row.is_done:
                    break  # ended inside the interval: the steps after its EOS are not its tokens
        return kept

    # What the paged cache (engine.sched.paged) does its own way: admission, reserving memory for
    # the next steps, and where a step writes.
    def _admit_queued(self) -> None:
        """Admit queued rows while slots are free and the cache holds them."""
        while self.queue and len(self.rows) < self.settings.num_slots and self._admit():
            pass

    def _pending(self) -> bool:
        """Whether a row is on its way in outside the queue (the paged route's prefill across turns)."""
        return False

    def _cap_burst(self, burst: int) -> int:
        """The decode steps to run before the next admission turn, of the ``burst`` the reads allow
        (here all of them)."""
        return burst

    def _reserve(self, burst: int) -> int:
        """Make room for ``burst`` more tokens of every live row; the burst that fits (here all of it:
        admission already kept the columns every live row's budget needs)."""
        return burst

    def _before_burst(self, num_rows: int, burst: int) -> None:
        """What the cache's step needs and the profile counts before ``burst`` steps over ``num_rows``
        rows; nothing on the aligned cache."""

    def _decode_front(self) -> int:
        """The column the next step writes (the shared front)."""
        return self.cache.front_int

    def _advance_front(self, burst: int) -> None:
        self.cache.front_int += burst  # the steps advanced the device front

    def _live_slots(self) -> list[int]:
        """The slots of rows still generating: not done (``Request.is_done``), nor stopped by a stop string,
        which is checked only on the rows still live (one batched decode of their tails) and, with
        min_new_tokens, only from their minimum on."""
        live = [slot for slot, row in enumerate(self.rows) if not row.is_done]
        if not self.has_stop_strings or not live:
            return live
        rows = [self.rows[slot] for slot in live]
        hits = stop_string_hits([r.stop_strings for r in rows], [r.turn_tokens for r in rows],
                                [r.min_tokens for r in rows])
        return [slot for slot, hit in zip(live, hits) if not hit]

    def _note_peak(self) -> None:
        self.profile.peak_cache_columns = max(self.profile.peak_cache_columns, self.cache.front_int)

    # -- admission --------------------------------------------------------------------------
    def _admissible(self) -> tuple[list[int], int | None]:
        """The longest queue prefix that fits the free slots and the cache, and the front it needs."""
        free = self.settings.num_slots - len(self.rows)
        live_span, live_remaining = self._live_needs()
        best: tuple[list[int], int | None] = ([], None)
        longest_new = most_new_steps = 0
        for count in range(1, min(free, len(self.queue)) + 1):
            longest_new = max(longest_new, self.lengths[self.queue[count - 1]])
            most_new_steps = max(most_new_steps, self.requests[self.queue[count - 1]].max_tokens - 1)
            front = self._choose_front(max(live_span, longest_new), max(live_remaining, most_new_steps))
            if front is None:
                break
            best = (self.queue[:count], front)
        return best

    def _live_needs(self) -> tuple[int, int]:
        """(widest live span, most decode columns a live row still needs)."""
        front = self.cache.front_int
        span = max((front - self.cache.row_starts[slot] for slot in range(len(self.rows))), default=0)
        remaining = max((row.remaining for row in self.rows), default=0)
        return span, remaining

    def _choose_front(self, span: int, remaining: int) -> int | None:
        """The front column that holds ``span`` columns left of it and ``remaining`` right of it.

        None if the capacity cannot; with ``trim_cache`` the lowest such front, else the nearest.
        """
        lower, upper = span, self.settings.capacity - remaining
        if lower > upper:
            return None
        if self.settings.trim_cache:
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
        self._admit_requests(requests)
        return True

    def _admit_requests(self, requests: Sequence[int]) -> None:
        """Plan the prefill of ``requests`` (new rows, in the free tail of the slots), run it, write
        their KV and first tokens; rows that finished on their first token retire."""
        members: dict[int, list[int]] = {}  # first admitted row of a group -> its admitted rows
        first_of: dict[int, int] = {}
        for r in requests:
            members.setdefault(first_of.setdefault(self.requests[r].group, r), []).append(r)
        with self.timer.phase("planning_ms"):
            plan = self._first_plan(list(members)) or plan_admission(
                self.settings.route, list(members), self.lengths, self.geometry, self.costs,
                self.settings.prefill_classes)
        self.plans.append(plan)
        self.tails = dict(plan.chunks)
        slot_of = {r: len(self.rows) + i for i, r in enumerate(requests)}
        self.rows.extend(self.requests[r] for r in requests)
        kind = "packed_prefill" if plan.packed else "prefill"  # a packed width is its tokens
        rows = plan.rows or tuple(len(b) for b in plan.buckets)
        for bucket, width, batch in zip(plan.buckets, plan.widths, rows):
            with self.timer.record(kind, batch=batch, width=width):
                self._prefill(bucket, [members[r] for r in bucket], slot_of,
                              shape=(batch, width) if plan.rows else None)
        self._note_peak()
        self._retire()

    def _first_plan(self, members: list[int]) -> BucketPlan | None:
        """``settings.first_plan`` restated over ``members`` (one row per group), when this is the
        call's first admission and it admits every group: the plan ``plan_admission`` would make
        again (the same DP over the same prompts and classes), made once, when Auto priced the route."""
        plan = self.settings.first_plan
        if plan is None or self.plans or members != list(dict.fromkeys(r.group for r in self.requests)):
            return None
        buckets = tuple(tuple(members[i] for i in bucket) for bucket in plan.buckets)
        chunks = tuple((members[i], tail) for i, tail in plan.chunks)
        return BucketPlan(buckets, plan.widths, plan.cost_ms, chunks, packed=plan.packed, rows=plan.rows)

    def _prefill(
        self, requests: Sequence[int], members: Sequence[Sequence[int]], slot_of: dict[int, int],
        shape: tuple[int, int] | None = None,
    ) -> None:
        """Prefill ``requests`` (one per group) and fill the slots of every row in ``members``;
        ``shape``: the (rows, width) class the bucket runs at (``planner.shape_classes``)."""
        rows = [m for group in members for m in group]  # the rows that get a slot
        source = [i for i, group in enumerate(members) for _ in group]  # their prefilled row
        slots = [slot_of[r] for r in rows]
        lengths = [self.lengths[r] for r in rows]
        packed = self.settings.route == "packed"
        with self.timer.phase("prefill_ms"):
            if packed:
                logits, layer_kv, offsets = self._packed_forward(requests)
            else:
                logits, layer_kv = self._bucket_forward(requests, shape)
            index = None
            if len(rows) != len(requests):
                index = torch.tensor(source, dtype=torch.long, device=logits.device)
                logits = logits.index_select(0, index)  # [rows, vocab]
            first, first_logprobs, settings = self._first_tokens(rows, logits)
        self.profile.num_prefill_forwards += 1
        self.profile.num_prefill_rows += len(requests)
        self.profile.num_replicated_rows += len(rows) - len(requests)
        with self.timer.phase("cache_ms"):
            self._write_kv(requests, slots, source, layer_kv, offsets if packed else None)
            self.state.admit(slots, first, lengths, **settings)
        for j, (slot, token) in enumerate(zip(slots, first.tolist())):
            self.rows[slot].append(token, None if first_logprobs is None else first_logprobs[j])

    def _write_kv(self, requests: Sequence[int], slots: Sequence[int], source: Sequence[int], layer_kv,
                  offsets: Sequence[int] | None) -> None:
        """Write the prefill of ``requests`` into ``slots``: slot ``slots[j]`` gets the KV of
        ``requests[source[j]]`` (``offsets``: a packed forward's token offsets, else a left-padded bucket)."""
        if offsets is not None:  # each prompt's head from its offset (a chunked prompt's whole KV follows)
            heads = [self._head_length(requests[s]) for s in source]
            self.cache.admit_packed(slots, layer_kv, [offsets[s] for s in source], heads)
        else:
            self.cache.admit(slots, layer_kv, [self.lengths[requests[s]] for s in source], source_rows=source)
        self._admit_spans(slots, source)

    def _first_tokens(self, rows: Sequence[int], logits: torch.Tensor) -> tuple[torch.Tensor, list[float] | None, dict]:
        """The token of step 0 of each of ``rows`` (call rows) from its prefill's last ``logits``
        ([rows, vocab]): ([rows] ids, their logprobs or None, the rows' ``DecodeState.admit``
        settings: keys, sampling, penalties with the ids seen and counted (the token among them),
        minimums and stop ids)."""
        settings = self._row_settings([self.requests[r] for r in rows])
        first, first_logprobs = select_tokens(
            logits, seen=settings.get("seen"), counts=settings.get("counts"), penalties=settings.get("penalties"),
            sampling=settings.get("sampling"), sample_keys=settings["sample_keys"],
            steps=torch.zeros_like(settings["sample_keys"]), logprobs_mode=self.settings.logprobs_mode,
            min_new_tokens=settings.get("min_new_tokens"), stop_mask=settings.get("stop_mask"),
        )
        note_tokens(first, seen=settings.get("seen"), counts=settings.get("counts"))
        return first, None if first_logprobs is None else first_logprobs.tolist(), settings

    def _row_settings(self, rows: Sequence[Request]) -> dict:
        """The ``DecodeState.admit`` keywords of ``rows`` as the state keeps them: sampling keys,
        settings and penalties (with the ids each has seen, its prompt and tokens so far, and its
        tokens' counts), minimums and stop masks."""
        index = torch.tensor([r.index for r in rows], dtype=torch.long, device=self.device)
        out: dict = {"sample_keys": torch.tensor([r.key for r in rows], dtype=torch.long, device=self.device)}
        if self.settings.sampling is not None:
            out["sampling"] = self.settings.sampling.rows(index)
        penalties = self.settings.penalties
        if penalties is not None:
            out["penalties"] = penalties.rows(index)
            if penalties.track_seen:
                out["seen"] = seen_from_ids(*ids_tensor([r.prompt + r.tokens for r in rows], self.device),
                                            self.vocab_size)
            if penalties.track_counts:
                out["counts"] = counts_from_ids(*ids_tensor([r.tokens for r in rows], self.device), self.vocab_size)
        if self.settings.holds_stops_back:
            out["min_new_tokens"] = torch.tensor([r.min_tokens for r in rows], dtype=torch.long, device=self.device)
            out["stop_mask"] = stop_id_mask([sorted(r.stop_ids) for r in rows], self.vocab_size, self.device)
        return out

    # -- chunked prefill (planner.chunks.plan_chunked) ---------------------------------------------
    def _head_length(self, request: int) -> int:
        return self.lengths[request] - sum(self.tails.get(request, ()))

    def _packed_forward(self, requests: Sequence[int]) -> tuple[torch.Tensor, list, list[int]]:
        """One packed forward over each request's head (``engine.runner.prefill.prefill_packed``); a chunked
        request's tails run after it as in ``_bucket_forward``. Returns (last logits, packed
        per-layer KV, each request's token offset)."""
        heads = [self.requests[r].prompt[: self._head_length(r)] for r in requests]
        backend = packed_backend(self.model)
        self.profile.prefill_backend = backend
        logits, layer_kv, offsets = prefill_packed(self.model, heads, cache_kwarg=self.settings.cache_kwarg,
                                                   backend=backend)
        logits = self._run_tails(requests, heads, logits, lambda row: [
            (k[:, :, offsets[row]: offsets[row] + len(heads[row])],
             v[:, :, offsets[row]: offsets[row] + len(heads[row])]) for k, v in layer_kv])
        return logits, layer_kv, offsets

    def _bucket_forward(self, requests: Sequence[int], shape: tuple[int, int] | None = None) -> tuple[torch.Tensor, list]:
        """The bucket's forward over each request's head; a chunked request's tails run after it
        (chunk k over a cache of chunks < k), its logits replace the head's and its whole KV
        waits in ``_spans`` for ``_admit_spans``."""
        heads = [self.requests[r].prompt[: self._head_length(r)] for r in requests]
        rows, width = shape if shape is not None else (None, None)
        if self.prefill_graphs is not None and shape is not None:
            logits, layer_kv = self.prefill_graphs.run(heads, rows=rows, width=width,
                                                       pad_token_id=self.settings.pad_token_id)
            self.profile.prefill_backend = "graph"
        else:
            logits, layer_kv = prefill_bucket(
                self.model, heads, pad_token_id=self.settings.pad_token_id, cache_kwarg=self.settings.cache_kwarg,
                rows=rows, width=width,
            )
            self.profile.prefill_backend = "padded"
        return self._run_tails(requests, heads, logits,
                               lambda row: head_kv_of_row(layer_kv, row, len(heads[row]))), layer_kv

    def _run_tails(self, requests, heads, logits: torch.Tensor, head_kv) -> torch.Tensor:
        """Each chunked request's tail chunks after its head (``head_kv(row)``: its per-layer KV);
        its logits replace the head's (in ``logits``, returned) and its whole KV waits in
        ``_spans`` for ``_admit_spans``."""
        self._spans = {}
        for row, r in enumerate(requests):
            if r not in self.tails:
                continue
            start, chunks = len(heads[row]), []
            for width in self.tails[r]:
                chunks.append(self.requests[r].prompt[start : start + width])
                start += width
            row_logits, kv = extend_prefill(
                self.model, head_kv(row), chunks, cache_kwarg=self.settings.cache_kwarg,
                record=lambda w, o: self.timer.record("chunk", batch=1, width=w, offset=o),
            )
            logits = logits.clone() if not self._spans else logits
            logits[row] = row_logits[0]
            self._spans[row] = kv
            self.profile.num_prefill_forwards += len(chunks)
        return logits

    def _admit_spans(self, slots: Sequence[int], source_rows: Sequence[int] | None = None) -> None:
        """Overwrite each chunked request's slot with its whole prompt (``admit`` wrote the head)."""
        for j, slot in enumerate(slots):
            kv = self._spans.get(j if source_rows is None else source_rows[j])
            if kv is not None:
                self.cache.admit([slot], kv, [kv[0][0].shape[2]])

    # -- retirement -------------------------------------------------------------------------
    def _retire(self) -> None:
        """Drop finished rows, fill their holes with the last live rows, then trim if asked."""
        keep = self._live_slots()
        self._report_retired(keep)
        if len(keep) == len(self.rows):
            return
        self._compact(keep)
        if self.settings.trim_cache and self.rows and not self.queue:
            front = self._choose_front(*self._live_needs())
            if front is not None:
                self._set_front(front)

    def _report_retired(self, keep: Sequence[int]) -> None:
        """Count the rows that leave, those outside the slots ``keep``, as finished and tell
        ``settings.on_retire`` which they are."""
        kept = set(keep)
        retired = [row for slot, row in enumerate(self.rows) if slot not in kept]
        self.finished.update(row.index for row in retired)
        if self.settings.on_retire is not None:
            self.settings.on_retire(retired)

    def _compact(self, keep: Sequence[int]) -> None:
        """Only the rows in slots ``keep`` stay; the last of them fill the holes the others left."""
        num_live = len(keep)
        kept = set(keep)
        holes = [slot for slot in range(num_live) if slot not in kept]
        movers = [slot for slot in keep if slot >= num_live]
        with self.timer.phase("cache_ms"):
            self.profile.moved_bytes += self.cache.move_rows(movers, holes)
            self.state.move_rows(movers, holes)
            self.cache.retire(num_live)
            self.stepper.retire_tail(num_live)
        rows = self.rows
        for src, dst in zip(movers, holes):
            rows[dst] = rows[src]
        self.rows = rows[:num_live]


# -- chunked prefill -------------------------------------------------------------------------------

def head_kv_of_row(
    layer_kv: Sequence[tuple[torch.Tensor, torch.Tensor]], row: int, head_length: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Row ``row``'s effective (last ``head_length``) columns of a left-padded bucket's KV."""
    return [(k[row : row + 1, :, -head_length:], v[row : row + 1, :, -head_length:]) for k, v in layer_kv]


@torch.no_grad()
def extend_prefill(
    model: torch.nn.Module,
    head_kv: Sequence[tuple[torch.Tensor, torch.Tensor]],
    chunks: Sequence[Sequence[int]],
    *,
    cache_kwarg: str,
    record: Callable[[int, int], AbstractContextManager] | None = None,
) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Forwards of ``chunks`` after ``head_kv`` (per layer, ``[1, kv_heads, head, head_dim]``):
    (last logits ``[1, vocab]``, per-layer (keys, values) of the whole prompt). Each forward runs
    inside ``record(width, offset)`` (the profile's ``Timer.record``) when given."""
    if not chunks:
        raise ValueError("extend_prefill needs at least one chunk")
    device = next(model.parameters()).device
    cache = DynamicCache(config=model.config)
    for layer, (keys, values) in enumerate(head_kv):
        cache.update(keys, values, layer)
    offset = head_kv[0][0].shape[2]
    out = None
    for chunk in chunks:
        ids = torch.tensor([list(chunk)], dtype=torch.long, device=device)  # [1, width]
        positions = torch.arange(offset, offset + len(chunk), device=device)[None]  # [1, width]
        with record(len(chunk), offset) if record is not None else nullcontext():
            out = model(input_ids=ids, position_ids=positions, use_cache=True, logits_to_keep=1,
                        **{cache_kwarg: cache})
        offset += len(chunk)
    return out.logits[:, -1], [(layer.keys, layer.values) for layer in cache.layers]
