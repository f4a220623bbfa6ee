"""Prefill of one bucket, the fixed-slot decode step, and the token choice they share.

``decode_step`` touches only static buffers (``DecodeState``, ``AlignedKVCache``) and updates them in
place, with no host sync, so a CUDA-graph-captured version can replace it one-for-one (one graph
per row count). The host reads the returned tokens afterwards, outside the step.

"""
from __future__ import annotations

from typing import Sequence

import torch

from rollout_lab.engine.attention import rollout_attention
from rollout_lab.engine.cache import AlignedKVCache, device_tensor
from rollout_lab.engine.paged_cache import PagedKVCache
from rollout_lab.engine.sampling import RowSampling, draw, filter_logits, row_argmax

# "raw" and "processed" are computed in the decode step (STEP_LOGPROB_MODES); "trainer" and
# "trainer_fp32" by one teacher-forced forward after it (engine.trainer.rollout_logprobs; the LM head
# in the model's dtype, or in fp32)
LOGPROB_MODES = ("raw", "processed", "trainer", "trainer_fp32")
STEP_LOGPROB_MODES = LOGPROB_MODES[:2]


def apply_repetition_penalty(
    logits: torch.Tensor, seen: torch.Tensor, penalty: float
) -> torch.Tensor:
    """HF's rule on the ids present so far: logit < 0 ? logit * p : logit / p. ``seen``: [rows, vocab] bool."""
    penalized = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(seen, penalized, logits)


def suppress_stop_ids(
    scores: torch.Tensor, steps: torch.Tensor, min_new_tokens: torch.Tensor, stop_mask: torch.Tensor
) -> torch.Tensor:
    """HF's ``MinNewTokensLengthLogitsProcessor`` per row: while a row has generated fewer tokens
    (``steps``) than its ``min_new_tokens`` (both [rows] int64), the ids of ``stop_mask`` ([vocab]
    bool: EOS and the call's stop ids) are -inf. One elementwise pass, no host sync."""
    early = (steps < min_new_tokens)[:, None]  # [rows, 1]
    return scores.masked_fill(early & stop_mask[None, :], float("-inf"))


def stop_id_mask(stop_ids: Sequence[int], vocab_size: int, device: torch.device | str) -> torch.Tensor:
    """[vocab] bool, True at ``stop_ids``: the ``stop_mask`` of ``suppress_stop_ids``."""
    mask = torch.zeros(vocab_size, dtype=torch.bool, device=device)
    mask[torch.tensor(list(stop_ids), dtype=torch.long, device=device)] = True
    return mask


def holds_stops_back(stop_ids: Sequence[int], min_new_tokens: Sequence[int] | None) -> bool:
    """Whether a call runs ``suppress_stop_ids``: it has stop ids and some row's min_new_tokens > 0."""
    return bool(stop_ids) and min_new_tokens is not None and max(min_new_tokens, default=0) > 0


def seen_from_ids(ids: torch.Tensor, valid: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, vocab] bool: which ids occur at the ``valid`` positions of ``ids`` [rows, T]."""
    seen = torch.zeros(ids.shape[0], vocab_size + 1, dtype=torch.bool, device=ids.device)
    seen.scatter_(1, torch.where(valid, ids, vocab_size), True)  # invalid -> spare column
    return seen[:, :vocab_size]


class DecodeState:
    """Static per-slot decode inputs: next input id, logical position, ids seen (for the penalty),
    each row's step (the number of tokens it has generated) and for seeded sampling its key and
    settings (``sampling``: a ``RowSampling`` over the slots, None when the step is greedy). With
    ``min_new_tokens`` each row's minimum, and ``stop_mask`` the ids it holds back (one per call).
    With ``keep_logits`` the step also leaves each row's fp32 logits in ``logits`` [slots, vocab]
    (before the penalty), for teacher-forced checks (``measure.fidelity``)."""

    def __init__(self, num_slots: int, vocab_size: int, *, track_seen: bool, device, keep_logits: bool = False,
                 logprobs_mode: str | None = None, sampling: RowSampling | None = None,
                 min_new_tokens: bool = False):
        self.input_ids = torch.zeros(num_slots, 1, dtype=torch.long, device=device)  # [slots, 1]
        self.position_ids = torch.zeros(num_slots, 1, dtype=torch.long, device=device)  # [slots, 1]
        self.seen = (
            torch.zeros(num_slots, vocab_size, dtype=torch.bool, device=device)
            if track_seen else None
        )  # [slots, vocab]
        self.sample_keys = torch.zeros(num_slots, dtype=torch.long, device=device)  # [slots]
        self.steps = torch.zeros(num_slots, dtype=torch.long, device=device)  # [slots]
        self.sampling = sampling  # [slots] temperature, top-k, top-p
        self.min_new_tokens = (
            torch.zeros(num_slots, dtype=torch.long, device=device) if min_new_tokens else None
        )  # [slots]
        self.stop_mask = (
            torch.zeros(vocab_size, dtype=torch.bool, device=device) if min_new_tokens else None
        )  # [vocab]: the ids a row cannot choose before its min_new_tokens (set_stop_ids)
        self.logits = (
            torch.zeros(num_slots, vocab_size, dtype=torch.float32, device=device) if keep_logits else None
        )  # [slots, vocab]
        self.logprobs_mode = logprobs_mode  # LOGPROB_MODES or None: the step leaves each token's in logprobs
        self.logprobs = (
            torch.zeros(num_slots, dtype=torch.float32, device=device) if logprobs_mode else None
        )  # [slots]

    def _buffers(self) -> list[torch.Tensor]:
        """The per-slot buffers (moved with their rows)."""
        seen = [self.seen] if self.seen is not None else []
        sampling = self.sampling.tensors if self.sampling is not None else []
        minimum = [self.min_new_tokens] if self.min_new_tokens is not None else []
        return [self.input_ids, self.position_ids, self.sample_keys, self.steps] + seen + sampling + minimum

    def reset(self) -> None:
        for buf in self._buffers():
            buf.zero_()
        if self.sampling is not None:
            self.sampling.top_p.fill_(1.0)  # free slots are greedy rows, with every filter off
        if self.stop_mask is not None:
            self.stop_mask.zero_()

    def set_stop_ids(self, ids: Sequence[int]) -> None:
        """The ids ``min_new_tokens`` holds back this call (EOS and the call's stop ids)."""
        self.stop_mask.copy_(stop_id_mask(ids, self.stop_mask.shape[0], self.stop_mask.device))

    def admit(
        self, slots: Sequence[int], first_tokens: torch.Tensor, positions: Sequence[int],
        seen: torch.Tensor | None, sample_keys: torch.Tensor | None = None,
        steps: Sequence[int] | None = None, sampling: RowSampling | None = None,
        min_new_tokens: torch.Tensor | None = None,
    ) -> None:
        """Rows enter ``slots`` with their next input id and position; ``steps``: tokens each has
        generated (default 1, the prefill's; a preempted row resumes with its own count);
        ``sampling`` and ``min_new_tokens`` ([rows] int64): their settings, where the state keeps them."""
        index = torch.tensor(list(slots), dtype=torch.long, device=self.input_ids.device)
        self.input_ids.index_copy_(0, index, first_tokens[:, None])
        pos = torch.tensor(list(positions), dtype=torch.long, device=self.input_ids.device)
        self.position_ids.index_copy_(0, index, pos[:, None])
        if self.seen is not None:
            self.seen.index_copy_(0, index, seen)
        if sample_keys is not None:
            self.sample_keys.index_copy_(0, index, sample_keys)
        if steps is None:
            self.steps.index_fill_(0, index, 1)  # the first token (step 0) came from the prefill
        else:
            self.steps.index_copy_(0, index, torch.tensor(list(steps), dtype=torch.long, device=index.device))
        if self.sampling is not None and sampling is not None:
            for buf, rows in zip(self.sampling.tensors, sampling.tensors):
                buf.index_copy_(0, index, rows)
        if self.min_new_tokens is not None and min_new_tokens is not None:
            self.min_new_tokens.index_copy_(0, index, min_new_tokens)

    def move_rows(self, src: Sequence[int], dst: Sequence[int]) -> None:
        if not src:
            return
        src_t, dst_t = (device_tensor(i, torch.long, self.input_ids.device) for i in (src, dst))
        for buf in self._buffers():
            buf.index_copy_(0, dst_t, buf.index_select(0, src_t))


def processed_scores(
    logits: torch.Tensor, seen: torch.Tensor | None, repetition_penalty: float,
    sampling: RowSampling | None, *, steps: torch.Tensor | None = None,
    min_new_tokens: torch.Tensor | None = None, stop_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The fp32 scores a token is chosen from: the penalty over ``seen`` (the ids so far), the stop
    ids held back from rows short of their ``min_new_tokens`` (``suppress_stop_ids``), then, when
    sampling, each row's temperature and top-k/top-p (HF's order)."""
    scores = logits.float()
    if seen is not None and repetition_penalty != 1.0:
        scores = apply_repetition_penalty(scores, seen, repetition_penalty)
    if min_new_tokens is not None:
        scores = suppress_stop_ids(scores, steps, min_new_tokens, stop_mask)
    return scores if sampling is None else filter_logits(scores, sampling)


def logprobs_of(scores: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """[rows] log-softmax of ``scores`` at ``tokens``: a logsumexp and a gather."""
    scores = scores.float()
    return scores.gather(1, tokens[:, None])[:, 0] - torch.logsumexp(scores, dim=-1)


def token_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, *, mode: str, seen: torch.Tensor | None,
    repetition_penalty: float, sampling: RowSampling | None, steps: torch.Tensor | None = None,
    min_new_tokens: torch.Tensor | None = None, stop_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """[rows] fp32 log-probability of each chosen token: "raw", the model's log-softmax; or
    "processed", the distribution it was drawn from (``processed_scores``). ``seen``: the ids
    before this token."""
    if mode == "processed":
        return logprobs_of(processed_scores(logits, seen, repetition_penalty, sampling, steps=steps,
                                            min_new_tokens=min_new_tokens, stop_mask=stop_mask), tokens)
    return logprobs_of(logits, tokens)


def select_tokens(
    logits: torch.Tensor, seen: torch.Tensor | None, repetition_penalty: float, *,
    sampling: RowSampling | None = None, sample_keys: torch.Tensor | None = None,
    steps: torch.Tensor | None = None, logprobs_mode: str | None = None,
    min_new_tokens: torch.Tensor | None = None, stop_mask: torch.Tensor | None = None,
    salts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Greedy (``sampling`` None) or seeded sampling from ``processed_scores`` (its greedy rows:
    the argmax); ``logits`` [rows, vocab], ``sample_keys``, ``steps`` and ``min_new_tokens``
    [rows] int64, ``stop_mask`` [vocab] bool. Returns ([rows] ids, their log-probabilities in
    ``logprobs_mode`` or None), the processed scores computed once for both. ``salts``: the
    sampler's ``token_salts``, which ``compile_select`` passes in (``sampling.uniforms``)."""
    scores = processed_scores(logits, seen, repetition_penalty, sampling, steps=steps,
                              min_new_tokens=min_new_tokens, stop_mask=stop_mask)
    tokens = row_argmax(scores) if sampling is None else draw(scores, sample_keys, steps, sampling.greedy, salts)
    if logprobs_mode is None:
        return tokens, None
    return tokens, logprobs_of(scores if logprobs_mode == "processed" else logits, tokens)


@torch.no_grad()
def decode_step(
    model: torch.nn.Module,
    cache: AlignedKVCache | PagedKVCache,
    state: DecodeState,
    num_rows: int,
    *,
    repetition_penalty: float,
    cache_kwarg: str,
    width: int | None = None,
    spans: bool = False,
    forward=None,
    select=None,
) -> torch.Tensor:
    """One token for each of the first ``num_rows`` slots at the shared front column (a paged cache:
    at each row's own position, ``engine.paged_cache``); [num_rows] ids.

    Attention reads the first ``width`` columns (default: the capacity); they must cover the front.
    With ``spans`` it reads only each row's live columns (``engine.span_attention``); the mask is
    kept up to date either way. ``forward`` replaces ``model`` as the callable (a compiled one),
    ``select`` replaces ``select_tokens`` (a compiled one: eager, seeded sampling runs ~25 kernels
    over [rows, vocab] int64 and float64 tensors, ~1.5 ms a step at 128 rows of a 152k vocabulary
    on an H200; compiled it is one pass over the logits).
    """
    width = cache.capacity if width is None else width
    paged = isinstance(cache, PagedKVCache)
    positions = state.position_ids[:num_rows]  # [rows, 1]: where each row's token goes
    if paged:  # each row writes at its own position, through its block table
        cache.prepare_step(num_rows, positions[:, 0])
        mask, view = cache.mask[:num_rows], cache.hf_cache(num_rows)  # [rows, 1, 1, 1]: attention reads the tables
        extra = {"paged_tables": cache.block_tables[:num_rows], "paged_positions": positions[:, 0]}
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
    steps = state.steps[:num_rows]
    if state.logits is not None:
        state.logits[:num_rows].copy_(out.logits[:, -1])
    sampling = None if state.sampling is None else state.sampling.rows(slice(0, num_rows))
    min_new_tokens = None if state.min_new_tokens is None else state.min_new_tokens[:num_rows]
    tokens, logprobs = (select_tokens if select is None else select)(
        out.logits[:, -1], seen, repetition_penalty, sampling=sampling,
        sample_keys=state.sample_keys[:num_rows], steps=steps, logprobs_mode=state.logprobs_mode,
        min_new_tokens=min_new_tokens, stop_mask=state.stop_mask,
    )  # [rows]
    if logprobs is not None:
        state.logprobs[:num_rows].copy_(logprobs)
    state.input_ids[:num_rows, 0].copy_(tokens)
    state.position_ids[:num_rows].add_(1)
    steps.add_(1)
    if seen is not None:
        seen.scatter_(1, tokens[:, None], True)
    if not paged:
        cache.front.add_(1)
    return tokens
