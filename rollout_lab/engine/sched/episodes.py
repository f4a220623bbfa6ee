"""Multi-turn episodes on the paged route: ``generate(..., env=, max_turns=)``.

A row is an episode: the model's turns and the environment's answers, one token list. When a row
stops at one of its stop ids that is not an EOS id, or at a stop string, with its budget and turns
left, it leaves its slot (the other rows keep decoding) and ``env(request, sample, tokens)`` runs in a
thread pool off the decode loop, with the row's tokens so far. Its answer (a list of token ids) opens
the row's next environment span and the row waits at the head of the queue as a resuming row
(``PagedBatcher``'s resume path). ``None`` ends the episode; EOS, the budget (``max_new_tokens``
counts the model's tokens of the whole episode) or ``max_turns`` (the model's turns) end it too.

The history's KV is kept across the wait: a row that leaves keys its full blocks in the pool's prefix
cache (``BlockAllocator.register``, as a prompt's; with ``prefix_cache`` off, for this call only),
where they stay idle (counted as free, taken back least recently used first), and keeps its partial
last block's KV aside, outside the pool (``PagedKVCache.read_positions``). A resuming row reads its
longest cached chain (``attach``, every row of the turn before any grows, so none takes back the
idle blocks another reads); where the chain reaches the partial block, that block's KV is written
back and the whole history is in its blocks: it enters with no prefill forward. Where blocks were
taken back meanwhile, the rest of the history is prefilled again, the rows back in one admission
turn in one left-padded forward over their KV (``resume_prefill``). Under ``admit_tokens_per_step``
what a row prefills counts against the bound (nothing, its chain kept); a row whose missing history
is longer than the bound is prefilled again across turns, all of it.

The answer enters through decode steps where the stepper has forced inputs (``StepperKey.forced``,
``ModelRunner.stepper_for(forced=True)``): the row's next input is its last model token (the
stop, whose KV is not written yet) at its position, and its steps take the answer's tokens, in order,
instead of their draws (``DecodeState.force``; at most ``FORCE_WIDTH`` on the device, the rest
loaded between bursts, and no burst runs a row past what its slot holds). The draw at the step whose
input is the answer's last token is the next turn's first token; the sampling step goes on from the
row's count through the answer, so seeded sampling draws the tokens it would draw however the rows
were scheduled, and as the prefill path below does. The tokens a burst gives a row from its forced
inputs are environment tokens (never a stop, log-probability 0.0, not counted against
``max_new_tokens``). A row preempted in the middle of its answer takes the rest of it at once and
resumes as a preempted row (all of it prefilled). Without forced inputs (a stepper built without
them) the answer is appended when it comes and prefilled with the row's last history token, its
last token being the next input. The profile counts the history tokens prefilled again
(``Profile.prefilled_history_tokens``), the environment's tokens (``Profile.env_tokens``), those fed
through decode steps (``Profile.env_tokens_decoded``) and its calls (``Profile.num_env_calls``).

Penalties and ``min_new_tokens`` see an episode's tokens as its output: the environment's count too
(frequency and presence, and toward the minimum).

    episodes = Episodes(env=calculator, max_turns=4, eos_ids=frozenset({2}))
    batcher = EpisodeBatcher(model, requests, settings, episodes=episodes, ...)

"""
from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from transformers import DynamicCache

from rollout_lab.engine.kv.paged import block_keys
from rollout_lab.engine.runner.prefill import prefill_bucket
from rollout_lab.engine.sched.paged import PagedBatcher
from rollout_lab.engine.sched.request import Request
from rollout_lab.planner.checks import check_int, is_int

ENV_WORKERS = 32  # threads that run env calls: rows waiting on a slow environment at once


@dataclass(frozen=True)
class Episodes:
    """A call's environment: ``env(request_index, sample_index, token_ids) -> list[int] | None``,
    ``max_turns`` (the model's turns an episode may take; None: no bound) and ``max_env_tokens`` (the
    environment's tokens one episode may take in all, which sizes each row's positions; None: as
    many as its ``max_new_tokens``); ``eos_ids`` end an episode where other stop ids call ``env``."""

    env: Callable[[int, int, list[int]], "list[int] | None"]
    max_turns: int | None = None
    max_env_tokens: int | None = None
    eos_ids: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        if not callable(self.env):
            raise TypeError("env must be a callable env(request_index, sample_index, token_ids) -> "
                            f"list[int] | None, got {self.env!r}")
        if self.max_turns is not None:
            check_int(self.max_turns, name="max_turns", or_none=True)
        if self.max_env_tokens is not None:
            check_int(self.max_env_tokens, name="max_env_tokens", minimum=0, or_none=True)

    def env_budget(self, max_tokens: int) -> int:
        """The environment tokens a row of budget ``max_tokens`` may take in its episode."""
        return max_tokens if self.max_env_tokens is None else self.max_env_tokens


class EpisodeBatcher(PagedBatcher):
    """``PagedBatcher`` whose rows call the environment ``episodes`` (module docstring)."""

    def __init__(self, *args, episodes: Episodes, **kwargs):
        super().__init__(*args, **kwargs)
        self.episodes = episodes
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=ENV_WORKERS, thread_name_prefix="env")
        self._waiting: dict[concurrent.futures.Future, int] = {}  # env call -> its row
        self._answered: dict[int, int] = {}  # resuming row -> the positions its KV held when it left
        self._history_keys: dict[int, list[bytes]] = {}  # resuming row -> those positions' full blocks' keys
        # a waiting row's partial last block: its positions' KV, outside the pool (per layer [1, kv_heads, n, head_dim])
        self._partials: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        # whether answers enter through decode steps (the stepper's forced inputs); else they are prefilled
        self.forces = self.state.force_width > 0
        self._answers: dict[int, list[int]] = {}  # row -> its answer's tokens not read back from its steps yet
        self._loaded: dict[int, int] = {}  # live row -> of those, how many its slot's forced inputs hold

    def run(self):
        try:
            return super().run()
        finally:  # an error (a bad answer) leaves calls in flight: the call returns without them
            self._pool.shutdown(wait=False, cancel_futures=True)
            if not self.prefix_cache:  # the histories were keyed for this call alone
                self.cache.allocator.clear_cached()

    # -- the loop's hooks ---------------------------------------------------------------------
    def _pending(self) -> bool:
        return super()._pending() or bool(self._waiting)

    def _admit_queued(self) -> None:
        """The answers in so far join the queue, then admission; with nothing live it waits for the
        next answer (nothing else can run)."""
        self._take_answers(wait=False)
        super()._admit_queued()
        while not self.rows and self._waiting:
            self._take_answers(wait=True)
            super()._admit_queued()

    def _retire(self) -> None:
        """Rows that stopped for the environment leave their slots (``_leave``) as finished rows do,
        but only the finished ones are reported."""
        keep = self._live_slots()
        kept = set(keep)
        leaving = [slot for slot, row in enumerate(self.rows) if slot not in kept and self._calls_env(row)]
        for slot in leaving:
            self._leave(slot)
        self._report_retired(sorted(kept.union(leaving)))
        if len(keep) < len(self.rows):
            self._compact(keep)

    def _cap_burst(self, burst: int) -> int:
        """Rows whose answer's forced inputs ran out with tokens of it left get the next ones; no
        burst runs a row past its forced inputs while its answer goes on (its draw would be taken)."""
        burst = super()._cap_burst(burst)
        refill = [(slot, row.index) for slot, row in enumerate(self.rows)
                  if row.index in self._answers and not self._loaded.get(row.index)]
        if refill:
            with self.timer.phase("cache_ms"):
                self._load_answers(*zip(*refill))
        for row in self.rows:
            if len(self._answers.get(row.index, ())) > self._loaded.get(row.index, 0):
                burst = min(burst, self._loaded[row.index])
        return burst

    def _take_burst(self, rows: Sequence[Request], tokens: list[list[int]], logprobs: list[list[float]] | None) -> int:
        """A row's tokens of the burst that its forced inputs gave are its answer's (environment
        tokens, never a stop); the rest are the model's, as on any row."""
        fed = 0
        for i, row in enumerate(rows):
            n = min(self._loaded.get(row.index, 0), len(tokens[i]))
            if not n:
                continue
            if tokens[i][:n] != self._answers[row.index][:n]:
                raise RuntimeError(f"row {row.index}'s forced steps gave {tokens[i][:n]}, its answer is "
                                   f"{self._answers[row.index][:n]}")
            self._append_answer(row, n)
            tokens[i] = tokens[i][n:]
            if logprobs is not None:
                logprobs[i] = logprobs[i][n:]
            fed += n
        self.profile.env_tokens_decoded += fed
        return fed + super()._take_burst(rows, tokens, logprobs)

    def _preempt(self) -> None:
        """A preempted row in the middle of its answer takes the rest at once, as a resuming row
        whose answer is prefilled (its blocks are given back: its history is prefilled anyway)."""
        super()._preempt()
        request = self.queue[0]  # the row it sent back
        if request in self._answers:
            self._append_answer(self.requests[request], len(self._answers[request]))

    # -- leaving and coming back --------------------------------------------------------------
    def _calls_env(self, row: Request) -> bool:
        """Whether ``row``, no longer live, stopped for the environment: at a stop id other than
        EOS or at a stop string (the only other way a row with budget left stops), with a turn left."""
        if row.remaining <= 0 or row.ends_with_env:
            return False
        if self.episodes.max_turns is not None and len(row.env_spans) + 1 >= self.episodes.max_turns:
            return False
        last = row.tokens[-1]
        return last not in self.episodes.eos_ids if last in row.stop_ids else row.stop_strings is not None

    def _leave(self, slot: int) -> None:
        """Key the full blocks of ``slot``'s history in the prefix cache (they stay when it releases
        them), keep its partial last block's KV aside, and call the environment with its tokens."""
        row = self.rows[slot]
        written = self._cached_tokens(row)  # its last token is the next input: not written
        keys = block_keys((row.prompt + row.tokens)[:written], self.cache.block_size)
        self.cache.allocator.register(slot, keys)
        self._history_keys[row.index] = keys
        full = written // self.cache.block_size * self.cache.block_size
        if written > full:
            self._partials[row.index] = self.cache.read_positions(slot, full, written)
        self._answered[row.index] = written
        self.profile.num_env_calls += 1
        future = self._pool.submit(self.episodes.env, row.request, row.sample, list(row.tokens))
        self._waiting[future] = row.index

    def _take_answers(self, *, wait: bool) -> None:
        """The env calls done (with ``wait``, at least one): each answer is the row's next
        environment span (with forced inputs fed through its steps once it is back, else appended
        now, to be prefilled), and the row joins the head of the queue in row order; a None ends the
        row's episode."""
        if not self._waiting:
            return
        if wait:
            done, _ = concurrent.futures.wait(self._waiting, return_when=concurrent.futures.FIRST_COMPLETED)
        else:
            done = [future for future in self._waiting if future.done()]
        answered = sorted((self._waiting.pop(future), future) for future in done)
        # in row order, the env's own exception or a bad answer raised before any row moves on
        answers = {request: future.result() for request, future in answered}
        checked = {request: None if answer is None else self._check_answer(self.requests[request], answer)
                   for request, answer in answers.items()}
        for request, _ in reversed(answered):  # inserted at the head: the first row ends first
            row = self.requests[request]
            ids = checked[request]
            if ids is None:
                self._answered.pop(request)
                self._partials.pop(request, None)
                self._history_keys.pop(request, None)
                if self.settings.on_retire is not None:
                    self.settings.on_retire([row])
                continue
            row.env_spans.append((len(row.tokens), len(row.tokens)))
            self.profile.env_tokens += len(ids)
            if self.forces and ids:
                self._answers[request] = ids
            else:
                self._append_answer(row, len(ids), ids)
            self.resuming.add(request)
            self.queue.insert(0, request)

    def _append_answer(self, row: Request, n: int, ids: Sequence[int] | None = None) -> None:
        """The next ``n`` tokens of ``row``'s answer (``ids``, else those not read back yet) extend its
        last environment span (log-probability 0.0), counted as its positions."""
        if ids is None:
            pending = self._answers[row.index]
            ids = pending[:n]
            del pending[:n]
            if not pending:
                del self._answers[row.index]
            left = self._loaded.pop(row.index, 0) - n
            if left > 0:
                self._loaded[row.index] = left
        start, stop = row.env_spans[-1]
        row.tokens.extend(ids)
        row.env_spans[-1] = (start, stop + n)
        if self.settings.logprobs_mode:
            row.logprobs.extend([0.0] * n)
        row.num_generated += n

    def _check_answer(self, row: Request, answer: object) -> list[int]:
        """``answer`` as token ids; a ValueError naming the request, the sample and the value unless
        it is a list of ids in the vocabulary within the row's environment budget."""
        where = f"env(request_index={row.request}, sample_index={row.sample}, ...)"
        if not isinstance(answer, (list, tuple)) or not all(is_int(t) and 0 <= t < self.vocab_size for t in answer):
            raise ValueError(f"{where} returned {answer!r:.200}: it must return a list of token ids in "
                             f"[0, {self.vocab_size}) to append, or None to end the episode")
        budget = self.episodes.env_budget(row.max_tokens)
        if row.num_env_tokens + len(answer) > budget:
            raise ValueError(f"{where} returned {len(answer)} tokens after {row.num_env_tokens}, more than the "
                             f"{budget} environment tokens an episode may take: raise max_env_tokens")
        return [int(t) for t in answer]

    def _history_hits(self, request: int) -> list[int]:
        """The cached blocks of ``request``'s longest cached chain of prefilled ids (a row back from
        the environment: keyed when it left)."""
        keys = self._history_keys.get(request)
        if keys is None:
            ids = self._prefill_ids(request)
            keys = block_keys(ids, self.cache.block_size)
        return self.cache.allocator.match(keys)

    def _cached_history(self, request: int, hits: Sequence[int]) -> int:
        """The positions of ``request``'s prefilled ids that ``hits`` hold, with its partial last
        block kept aside where the chain reaches it."""
        size, written = self.cache.block_size, self._answered.get(request)
        if written is not None and len(hits) == written // size and (request in self._partials
                                                                     or written == len(hits) * size):
            return written
        return len(hits) * size

    def _prefill_tokens(self, request: int) -> int:
        """A row back from the environment prefills what no cached block or kept partial block holds."""
        tokens = super()._prefill_tokens(request)
        if request not in self._history_keys:
            return tokens
        return tokens - self._cached_history(request, self._history_hits(request))

    def _resume(self, requests: Sequence[int]) -> None:
        """Resuming rows come back: each reads its longest cached chain of blocks; a row back from
        the environment whose chain reaches its partial last block gets that block's KV back
        (``_partials``). Rows whose blocks then hold all they prefill run no forward (with forced
        inputs, every row whose chain was kept); one left-padded forward prefills the rest of the
        others over their KV (``resume_prefill``; a preempted row without cached blocks: all of it)."""
        size, start = self.cache.block_size, len(self.rows)
        hits = {r: self._history_hits(r) for r in requests}
        done = {r: self._cached_history(r, hits[r]) for r in requests}
        ids = {r: self._prefill_ids(r) for r in requests}
        prefilled = [r for r in requests if done[r] < len(ids[r])]
        requests = prefilled + [r for r in requests if done[r] >= len(ids[r])]
        slots = list(range(start, start + len(requests)))
        with self.timer.phase("cache_ms"):
            for slot, request in zip(slots, requests):  # all first: a row's growth takes no idle block another reads
                if hits[request]:
                    self.cache.attach(slot, hits[request])
            for slot, request in zip(slots, requests):
                self.cache.grow(slot, self._entry_tokens(request))
                if done[request] > len(hits[request]) * size:
                    self.cache.write_positions(slot, len(hits[request]) * size, self._partials.pop(request))
        layer_kv = None
        if prefilled:
            starts = [done[r] for r in prefilled]
            suffixes = [ids[r][n:] for r, n in zip(prefilled, starts)]
            past = None
            if any(starts):
                with self.timer.phase("cache_ms"):  # the rows' pasts, one after the other
                    pasts = [self.cache.read_positions(slot, 0, n) for slot, n in zip(slots, starts) if n]
                    past = [tuple(torch.cat([p[layer][i] for p in pasts], 2) for i in (0, 1))
                            for layer in range(len(pasts[0]))]
            with self.timer.phase("prefill_ms"), \
                    self.timer.record("prefill", batch=len(prefilled), width=max(map(len, suffixes))):
                if past is not None:
                    layer_kv = resume_prefill(self.model, past, starts, suffixes,
                                              pad_token_id=self.settings.pad_token_id,
                                              cache_kwarg=self.settings.cache_kwarg)
                else:
                    _, layer_kv = prefill_bucket(self.model, [ids[r] for r in prefilled],
                                                 pad_token_id=self.settings.pad_token_id,
                                                 cache_kwarg=self.settings.cache_kwarg)
            self.profile.num_prefill_forwards += 1
            self._place_resumed(prefilled, slots[: len(prefilled)], layer_kv, starts=starts)
        if len(prefilled) < len(requests):
            self._place_resumed(requests[len(prefilled):], slots[len(prefilled):], None)

    def _place_resumed(self, requests: Sequence[int], slots: Sequence[int], layer_kv,
                       starts: Sequence[int] | None = None) -> None:
        """Count, for rows back from the environment, the history positions they prefilled again
        (written before they left, read from no cached block); rows with an answer left to feed get
        its first tokens as their forced inputs."""
        for j, request in enumerate(requests):
            self._partials.pop(request, None)  # prefilled again (across turns, or its chain broken)
            self._history_keys.pop(request, None)
            if request in self._answered:
                written = self._answered.pop(request)
                start = written if layer_kv is None else 0 if starts is None else starts[j]
                self.profile.prefilled_history_tokens += max(0, written - start)
        super()._place_resumed(requests, slots, layer_kv, starts)
        forced = [(slot, r) for slot, r in zip(slots, requests) if r in self._answers]
        if forced:
            with self.timer.phase("cache_ms"):
                self._load_answers(*zip(*forced))

    def _load_answers(self, slots: Sequence[int], requests: Sequence[int]) -> None:
        """The next tokens of each row's answer (at most the forced inputs' width) into its slot's
        forced inputs."""
        chunks = [self._answers[r][: self.state.force_width] for r in requests]
        self.state.force(slots, chunks)
        for request, chunk in zip(requests, chunks):
            self._loaded[request] = len(chunk)


def env_mask(row: Request) -> list[bool]:
    """Per token of ``row``, whether the environment gave it."""
    mask = [False] * len(row.tokens)
    for start, stop in row.env_spans:
        mask[start:stop] = [True] * (stop - start)
    return mask


@torch.no_grad()
def resume_prefill(model: torch.nn.Module, past: Sequence[tuple[torch.Tensor, torch.Tensor]], done: Sequence[int],
                   suffixes: Sequence[Sequence[int]], *, pad_token_id: int,
                   cache_kwarg: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One forward of each row's ``suffixes[i]`` after its first ``done[i]`` positions, whose KV
    ``past`` holds, the rows' one after the other (per layer ``[1, kv_heads, sum(done), head_dim]``):
    per layer (keys, values) ``[rows, kv_heads, C + S, head_dim]``, row i's positions right-aligned
    (C = max(done), S = the longest suffix; its past at columns ``C - done[i]`` on, its suffix
    left-padded to S), so ``PagedKVCache.admit`` from ``done[i]`` writes its suffix."""
    device = next(model.parameters()).device
    rows, most, longest = len(suffixes), max(done), max(map(len, suffixes))
    cache = DynamicCache(config=model.config)
    offsets = [0]
    for n in done:
        offsets.append(offsets[-1] + n)
    for layer, pair in enumerate(past):
        padded = []
        for tensor in pair:  # [1, kv_heads, sum(done), head_dim] -> [rows, kv_heads, C, head_dim]
            out = tensor.new_zeros(rows, tensor.shape[1], most, tensor.shape[3])
            for i, n in enumerate(done):
                if n:
                    out[i, :, most - n:] = tensor[0, :, offsets[i]: offsets[i] + n]
            padded.append(out)
        cache.update(padded[0], padded[1], layer)
    ids = torch.full((rows, longest), pad_token_id, dtype=torch.long, device=device)  # [rows, S]
    attention = torch.zeros(rows, most + longest, dtype=torch.long, device=device)  # [rows, C + S]
    positions = torch.zeros(rows, longest, dtype=torch.long, device=device)  # [rows, S]
    for i, (n, suffix) in enumerate(zip(done, suffixes)):
        ids[i, longest - len(suffix):] = torch.tensor(list(suffix), dtype=torch.long, device=device)
        attention[i, most - n: most] = 1
        attention[i, most + longest - len(suffix):] = 1
        positions[i, longest - len(suffix):] = torch.arange(n, n + len(suffix), device=device)
    model(input_ids=ids, attention_mask=attention, position_ids=positions, use_cache=True, logits_to_keep=1,
          **{cache_kwarg: cache})
    return [(layer.keys, layer.values) for layer in cache.layers]
