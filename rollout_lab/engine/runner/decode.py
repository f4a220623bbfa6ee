"""The fixed-slot decode step and the per-slot state it reads and updates.

``decode_step`` touches only static buffers (``DecodeState``, the KV cache) and updates them in
place, with no host sync, so a CUDA-graph-captured version can replace it one-for-one (one graph per
row count). The host reads the returned tokens afterwards, outside the step. The token choice is the
sampling room's (``engine.sample.processors.select_tokens``).

Forced inputs (``DecodeState(forced=True)``, a call with episodes: ``engine.sched.episodes``): a row
with tokens queued in ``forced_ids`` takes the next of them as its step's token instead of its draw
(log-probability 0.0), so an environment's answer enters the row through decode steps, with no
prefill forward; the draw at the step whose input is the last queued token is the row's own.

"""
from __future__ import annotations

from typing import Sequence

import torch

from rollout_lab.engine.kernels.attention import rollout_attention
from rollout_lab.engine.kv.aligned import AlignedKVCache, device_tensor
from rollout_lab.engine.kv.paged import PagedKVCache
from rollout_lab.engine.sample.processors import RowPenalties, note_tokens, select_tokens
from rollout_lab.engine.sample.sampler import RowSampling

FORCE_WIDTH = 256  # forced tokens a row holds on the device at once; the host refills a longer answer

class DecodeState:
    """Static per-slot decode inputs: next input id, logical position, each row's step (the number of
    tokens it has generated) and for seeded sampling its key and settings (``sampling``: a
    ``RowSampling`` over the slots, None when the step is greedy). With ``penalties`` (a
    ``RowPenalties`` over the slots) the ids each row has ``seen`` (prompt and output) and its
    output's ``counts``, as its penalties need them. With ``min_new_tokens`` each row's minimum and
    ``stop_mask`` its EOS and stop ids, which it holds back until then. With ``keep_logits`` the step
    also leaves each row's fp32 logits in ``logits`` [slots, vocab] (before the penalties), for
    teacher-forced checks (``measure.fidelity``). With ``forced`` each row's queued forced tokens
    (module docstring): ``forced_ids`` [slots, FORCE_WIDTH], the next one at ``forced_at``, ``forced_left``
    of them left."""

    def __init__(self, num_slots: int, vocab_size: int, *, device, keep_logits: bool = False,
                 logprobs_mode: str | None = None, sampling: RowSampling | None = None,
                 penalties: RowPenalties | None = None, min_new_tokens: bool = False, forced: bool = False):
        self.input_ids = torch.zeros(num_slots, 1, dtype=torch.long, device=device)  # [slots, 1]
        self.position_ids = torch.zeros(num_slots, 1, dtype=torch.long, device=device)  # [slots, 1]
        self.sample_keys = torch.zeros(num_slots, dtype=torch.long, device=device)  # [slots]
        self.steps = torch.zeros(num_slots, dtype=torch.long, device=device)  # [slots]
        self.sampling = sampling  # [slots] temperature, top-k, top-p, min-p
        self.penalties = penalties  # [slots] repetition, presence, frequency
        track_seen = penalties is not None and penalties.track_seen
        track_counts = penalties is not None and penalties.track_counts
        self.seen = (
            torch.zeros(num_slots, vocab_size, dtype=torch.bool, device=device) if track_seen else None
        )  # [slots, vocab]: prompt and output ids
        self.counts = (
            torch.zeros(num_slots, vocab_size, dtype=torch.int32, device=device) if track_counts else None
        )  # [slots, vocab]: output ids' counts
        self.min_new_tokens = (
            torch.zeros(num_slots, dtype=torch.long, device=device) if min_new_tokens else None
        )  # [slots]
        self.stop_mask = (
            torch.zeros(num_slots, vocab_size, dtype=torch.bool, device=device) if min_new_tokens else None
        )  # [slots, vocab]: the ids a row cannot choose before its min_new_tokens
        self.logits = (
            torch.zeros(num_slots, vocab_size, dtype=torch.float32, device=device) if keep_logits else None
        )  # [slots, vocab]
        self.logprobs_mode = logprobs_mode  # LOGPROB_MODES or None: the step leaves each token's in logprobs
        self.logprobs = (
            torch.zeros(num_slots, dtype=torch.float32, device=device) if logprobs_mode else None
        )  # [slots]
        self.forced_ids = (
            torch.zeros(num_slots, FORCE_WIDTH, dtype=torch.long, device=device) if forced else None
        )  # [slots, FORCE_WIDTH]
        self.forced_at = torch.zeros(num_slots, dtype=torch.long, device=device) if forced else None  # [slots]
        self.forced_left = torch.zeros(num_slots, dtype=torch.long, device=device) if forced else None  # [slots]

    @property
    def force_width(self) -> int:
        """Forced tokens a row holds at once (0: the state has no forced inputs)."""
        return 0 if self.forced_ids is None else self.forced_ids.shape[1]

    def _buffers(self) -> list[torch.Tensor]:
        """The per-slot buffers (moved with their rows)."""
        optional = [self.seen, self.counts, self.min_new_tokens, self.stop_mask, self.forced_ids, self.forced_at,
                    self.forced_left]
        sampling = self.sampling.tensors if self.sampling is not None else []
        penalties = self.penalties.tensors if self.penalties is not None else []
        return [self.input_ids, self.position_ids, self.sample_keys, self.steps] + sampling + penalties + \
            [b for b in optional if b is not None]

    def reset(self) -> None:
        for buf in self._buffers():
            buf.zero_()
        if self.sampling is not None:
            self.sampling.top_p.fill_(1.0)  # free slots are greedy rows, with every filter off
        if self.penalties is not None:
            self.penalties.reset()

    def admit(
        self, slots: Sequence[int], first_tokens: torch.Tensor, positions: Sequence[int], *,
        seen: torch.Tensor | None = None, counts: torch.Tensor | None = None,
        sample_keys: torch.Tensor | None = None, steps: Sequence[int] | None = None,
        sampling: RowSampling | None = None, penalties: RowPenalties | None = None,
        min_new_tokens: torch.Tensor | None = None, stop_mask: torch.Tensor | None = None,
    ) -> None:
        """Rows enter ``slots`` with their next input id and position; ``steps``: tokens each has
        generated (default 1, the prefill's; a preempted row resumes with its own count); the rest:
        their rows of the state's buffers, where the state keeps them. They have no forced tokens
        (``force``)."""
        index = torch.tensor(list(slots), dtype=torch.long, device=self.input_ids.device)
        if self.forced_left is not None:  # a slot's earlier row may have left some
            self.forced_left.index_fill_(0, index, 0)
        self.input_ids.index_copy_(0, index, first_tokens[:, None])
        pos = torch.tensor(list(positions), dtype=torch.long, device=self.input_ids.device)
        self.position_ids.index_copy_(0, index, pos[:, None])
        if steps is None:
            self.steps.index_fill_(0, index, 1)  # the first token (step 0) came from the prefill
        else:
            self.steps.index_copy_(0, index, torch.tensor(list(steps), dtype=torch.long, device=index.device))
        for buf, rows in ((self.seen, seen), (self.counts, counts), (self.sample_keys, sample_keys),
                          (self.min_new_tokens, min_new_tokens), (self.stop_mask, stop_mask)):
            if buf is not None and rows is not None:
                buf.index_copy_(0, index, rows)
        for mine, theirs in ((self.sampling, sampling), (self.penalties, penalties)):
            if mine is not None and theirs is not None:
                for buf, rows in zip(mine.tensors, theirs.tensors):
                    buf.index_copy_(0, index, rows)

    def force(self, slots: Sequence[int], tokens: Sequence[Sequence[int]]) -> None:
        """Queue ``tokens[j]`` (at most ``force_width``, replacing what the slot held) as the forced
        tokens of ``slots[j]``: its next steps take them in order instead of their draws."""
        width = self.force_width
        if any(len(t) > width for t in tokens):
            raise ValueError(f"at most {width} forced tokens a row, got {max(map(len, tokens))}")
        device = self.input_ids.device
        ids = torch.zeros(len(slots), width, dtype=torch.long)  # [rows, FORCE_WIDTH], built on the host
        for j, row in enumerate(tokens):
            ids[j, : len(row)] = torch.tensor(list(row), dtype=torch.long)
        index = torch.tensor(list(slots), dtype=torch.long, device=device)
        self.forced_ids.index_copy_(0, index, ids.to(device))
        self.forced_at.index_fill_(0, index, 0)
        self.forced_left.index_copy_(0, index, torch.tensor([len(t) for t in tokens], dtype=torch.long, device=device))

    def move_rows(self, src: Sequence[int], dst: Sequence[int]) -> None:
        if not src:
            return
        src_t, dst_t = (device_tensor(i, torch.long, self.input_ids.device) for i in (src, dst))
        for buf in self._buffers():
            buf.index_copy_(0, dst_t, buf.index_select(0, src_t))


@torch.no_grad()
def decode_step(
    model: torch.nn.Module,
    cache: AlignedKVCache | PagedKVCache,
    state: DecodeState,
    num_rows: int,
    *,
    cache_kwarg: str,
    width: int | None = None,
    spans: bool = False,
    forward=None,
    select=None,
) -> torch.Tensor:
    """One token for each of the first ``num_rows`` slots at the shared front column (a paged cache:
    at each row's own position, ``engine.kv.paged``); [num_rows] ids.

    Attention reads the first ``width`` columns (default: the capacity); they must cover the front.
    With ``spans`` it reads only each row's live columns (``engine.kernels.span``); the mask is
    kept up to date either way. ``forward`` replaces ``model`` as the callable (a compiled one),
    ``select`` replaces ``select_tokens`` (a compiled one: eager, seeded sampling runs ~25 kernels
    over [rows, vocab] int64 and float64 tensors; compiled it is one pass over the logits).
    """
    width = cache.capacity if width is None else width
    paged = isinstance(cache, PagedKVCache)
    positions = state.position_ids[:num_rows]  # [rows, 1]: where each row's token goes
    if paged:  # each row writes at its own position, through its block table
        cache.prepare_step(num_rows, positions[:, 0])
        mask, view = cache.mask[:num_rows], cache.hf_cache(num_rows)  # [rows, 1, 1, 1]: attention reads the tables
        extra = {"paged_tables": cache.block_tables[:num_rows], "paged_positions": positions[:, 0]}
        if cache.prefix_groups:  # each group's shared prompt blocks read once (engine.kernels.shared_prefix)
            extra.update(prefix_group_of_row=cache.group_of_row[:num_rows], prefix_blocks=cache.prefix_blocks,
                         prefix_len=cache.prefix_len)
    else:
        mask = cache.mask[:num_rows]  # [rows, 1, 1, capacity]
        mask.index_fill_(3, cache.front, 0.0)  # each row's new token attends to itself
        mask, view = mask[..., :width], cache.hf_cache(num_rows, width)  # [rows, 1, 1, width]
        extra = {"span_starts": cache.starts[:num_rows], "span_front": cache.front} if spans else {}
    with rollout_attention(model, every_sdpa_model=spans, every_model=paged):  # GQA without repeat_kv
        out = (model if forward is None else forward)(
            input_ids=state.input_ids[:num_rows],
            position_ids=positions,
            attention_mask=mask,
            use_cache=True,
            **{cache_kwarg: view},
            **extra,
        )
    seen = None if state.seen is None else state.seen[:num_rows]
    counts = None if state.counts is None else state.counts[:num_rows]
    steps = state.steps[:num_rows]
    if state.logits is not None:
        state.logits[:num_rows].copy_(out.logits[:, -1])
    rows = slice(0, num_rows)
    tokens, logprobs = (select_tokens if select is None else select)(
        out.logits[:, -1], seen=seen, counts=counts,
        penalties=None if state.penalties is None else state.penalties.rows(rows),
        sampling=None if state.sampling is None else state.sampling.rows(rows),
        sample_keys=state.sample_keys[:num_rows], steps=steps, logprobs_mode=state.logprobs_mode,
        min_new_tokens=None if state.min_new_tokens is None else state.min_new_tokens[:num_rows],
        stop_mask=None if state.stop_mask is None else state.stop_mask[:num_rows],
    )  # [rows]
    if state.forced_left is not None:  # a row with forced tokens left takes the next instead of its draw
        left, at = state.forced_left[:num_rows], state.forced_at[:num_rows]  # [rows]
        forcing = left > 0  # [rows]
        # at reaches the width once a full buffer is spent (then nothing is forced): clamp the read
        queued = state.forced_ids[:num_rows].gather(1, at.clamp(max=state.force_width - 1)[:, None])[:, 0]  # [rows]
        tokens = torch.where(forcing, queued, tokens)
        if logprobs is not None:
            logprobs = logprobs.masked_fill(forcing, 0.0)
        step = forcing.long()
        at.add_(step)
        left.sub_(step)
    if logprobs is not None:
        state.logprobs[:num_rows].copy_(logprobs)
    state.input_ids[:num_rows, 0].copy_(tokens)
    state.position_ids[:num_rows].add_(1)
    steps.add_(1)
    note_tokens(tokens, seen=seen, counts=counts)
    if not paged:
        cache.front.add_(1)
    return tokens
