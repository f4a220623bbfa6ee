"""Multi-turn episodes on the paged route: ``generate(..., env=, max_turns=)``.

A row is an episode: the model's turns and the environment's answers, one token list. When a row
stops at one of its stop ids that is not an EOS id, or at a stop string, with its budget and turns
left, it leaves its slot (the other rows keep decoding) and ``env(request, sample, tokens)`` runs in a
thread pool off the decode loop, with the row's tokens so far. Its answer (a list of token ids) is
appended to the row as environment tokens and the row waits at the head of the queue as a resuming
row (``PagedBatcher``'s resume path): its prompt and all its tokens but the last are its history, the
last (an environment token) is its next input, so the next turn's first token is drawn from the logits
after the answer, and its sampling step goes on from its count (seeded sampling draws the same tokens
however the rows were scheduled). ``None`` ends the episode; EOS, the budget (``max_new_tokens``
counts the model's tokens of the whole episode) or ``max_turns`` (the model's turns) end it too.

The history's KV is kept across the wait: a row that leaves keys its full blocks in the pool's prefix
cache (``BlockAllocator.register``, as a prompt's; with ``prefix_cache`` off, for this call only),
where they stay idle (counted as free, taken back least recently used first), and keeps its partial
last block's KV aside, outside the pool (``PagedKVCache.read_positions``). A resuming row reads its
longest cached chain (``attach``); where the chain reaches the partial block, that block's KV is
written back and only the answer is prefilled, over them; where blocks were taken back meanwhile,
the rest of the history is prefilled again. The rows back in one admission turn are prefilled in one
left-padded forward (``resume_prefill``). Under ``admit_tokens_per_step`` a history longer than the
bound is prefilled again across turns (its whole length counts against the bound). The profile
counts the history tokens prefilled again (``Profile.prefilled_history_tokens``) and the
environment's tokens (``Profile.env_tokens``) and calls (``Profile.num_env_calls``).

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
        # a waiting row's partial last block: its positions' KV, outside the pool (per layer [1, kv_heads, n, head_dim])
        self._partials: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}

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
        self.cache.allocator.register(slot, block_keys((row.prompt + row.tokens)[:written], self.cache.block_size))
        full = written // self.cache.block_size * self.cache.block_size
        if written > full:
            self._partials[row.index] = self.cache.read_positions(slot, full, written)
        self._answered[row.index] = written
        self.profile.num_env_calls += 1
        future = self._pool.submit(self.episodes.env, row.request, row.sample, list(row.tokens))
        self._waiting[future] = row.index

    def _take_answers(self, *, wait: bool) -> None:
        """The env calls done (with ``wait``, at least one): each answer is appended to its row,
        which joins the head of the queue in row order; a None ends the row's episode."""
        if not self._waiting:
            return
        if wait:
            done, _ = concurrent.futures.wait(self._waiting, return_when=concurrent.futures.FIRST_COMPLETED)
        else:
            done = [future for future in self._waiting if future.done()]
        answered = sorted((self._waiting.pop(future), future) for future in done)
        for request, future in reversed(answered):  # inserted at the head: the first row ends first
            row = self.requests[request]
            answer = future.result()  # the env's own exception, raised here
            if answer is None:
                self._answered.pop(request)
                self._partials.pop(request, None)
                if self.settings.on_retire is not None:
                    self.settings.on_retire([row])
                continue
            ids = self._check_answer(row, answer)
            start = len(row.tokens)
            row.tokens.extend(ids)
            row.env_spans.append((start, len(row.tokens)))
            if self.settings.logprobs_mode:
                row.logprobs.extend([0.0] * len(ids))
            row.num_generated += len(ids)
            self.profile.env_tokens += len(ids)
            self.resuming.add(request)
            self.queue.insert(0, request)

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

    def _resume(self, requests: Sequence[int]) -> None:
        """Resuming rows come back: each reads its longest cached chain of history blocks (at most
        those before its last prefilled id); a row back from the environment whose chain reaches its
        partial last block gets that block's KV back (``_partials``) and prefills the answer alone.
        One left-padded forward prefills the rest of each over its KV (``resume_prefill``; a
        preempted row without cached blocks: all of it)."""
        size, start = self.cache.block_size, len(self.rows)
        slots = list(range(start, start + len(requests)))
        ids = [self._prefill_ids(r) for r in requests]
        pasts, done = [], []
        with self.timer.phase("cache_ms"):
            for slot, request, row_ids in zip(slots, requests, ids):
                hits = self.cache.allocator.match(block_keys(row_ids, size)[: (len(row_ids) - 1) // size])
                if hits:
                    self.cache.attach(slot, hits)
                self.cache.grow(slot, self._entry_tokens(request))
                past = self.cache.gather(hits) if hits else []
                partial = self._partials.pop(request, None)
                if partial is not None and len(hits) == self._answered[request] // size:  # the chain reaches it
                    self.cache.write_positions(slot, len(hits) * size, partial)
                    past = [(torch.cat([k, pk], 2), torch.cat([v, pv], 2)) for (k, v), (pk, pv) in zip(past, partial)] \
                        if past else partial
                # at least its last id is prefilled (an empty answer leaves none past its KV)
                done.append(min(past[0][0].shape[2] if past else 0, len(row_ids) - 1))
                pasts.append([(k[:, :, : done[-1]], v[:, :, : done[-1]]) for k, v in past])
        suffixes = [row_ids[n:] for row_ids, n in zip(ids, done)]
        with self.timer.phase("prefill_ms"), self.timer.record("prefill", batch=len(ids), width=max(map(len, suffixes))):
            if any(done):
                past = [tuple(torch.cat([p[layer][i] for p in pasts if p], 2) for i in (0, 1))
                        for layer in range(len(next(p for p in pasts if p)))]  # the rows' pasts, one after the other
                layer_kv = resume_prefill(self.model, past, done, suffixes, pad_token_id=self.settings.pad_token_id,
                                          cache_kwarg=self.settings.cache_kwarg)
            else:
                _, layer_kv = prefill_bucket(self.model, ids, pad_token_id=self.settings.pad_token_id,
                                             cache_kwarg=self.settings.cache_kwarg)
        self.profile.num_prefill_forwards += 1
        self._place_resumed(requests, slots, layer_kv, starts=done)

    def _place_resumed(self, requests: Sequence[int], slots: Sequence[int], layer_kv,
                       starts: Sequence[int] | None = None) -> None:
        """Count, for rows back from the environment, the history positions they prefilled again
        (written before they left, read from no cached block)."""
        for j, request in enumerate(requests):
            self._partials.pop(request, None)  # prefilled across turns: recomputed
            if request in self._answered:
                written = self._answered.pop(request)
                self.profile.prefilled_history_tokens += max(0, written - (0 if starts is None else starts[j]))
        super()._place_resumed(requests, slots, layer_kv, starts)


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
