"""Prefill of one bucket, the fixed-slot decode step, and the token choice they share.

``decode_step`` touches only static buffers (``DecodeState``, ``AlignedKVCache``) and updates them in
place, with no host sync, so a CUDA-graph-captured version can replace it one-for-one (one graph
per row count). The host reads the returned tokens afterwards, outside the step.

"""
from __future__ import annotations

from typing import Sequence

import torch

from rollout_lab.engine.attention import rollout_attention
from rollout_lab.engine.cache import AlignedKVCache
from rollout_lab.engine.paged_cache import PagedKVCache
from rollout_lab.engine.sampling import SamplingParams, draw, filter_logits

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


def seen_from_ids(ids: torch.Tensor, valid: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, vocab] bool: which ids occur at the ``valid`` positions of ``ids`` [rows, T]."""
    seen = torch.zeros(ids.shape[0], vocab_size + 1, dtype=torch.bool, device=ids.device)
    seen.scatter_(1, torch.where(valid, ids, vocab_size), True)  # invalid -> spare column
    return seen[:, :vocab_size]


class DecodeState:
    """Static per-slot decode inputs: next input id, logical position, ids seen (for the penalty),
    and for seeded sampling each row's key and step (the number of tokens it has generated).
    With ``keep_logits`` the step also leaves each row's fp32 logits in ``logits`` [slots, vocab]
    (before the penalty), for teacher-forced checks (``measure.fidelity``)."""

    def __init__(self, num_slots: int, vocab_size: int, *, track_seen: bool, device, keep_logits: bool = False,
                 logprobs_mode: str | None = None):
        self.input_ids = torch.zeros(num_slots, 1, dtype=torch.long, device=device)  # [slots, 1]
        self.position_ids = torch.zeros(num_slots, 1, dtype=torch.long, device=device)  # [slots, 1]
        self.seen = (
            torch.zeros(num_slots, vocab_size, dtype=torch.bool, device=device)
            if track_seen else None
        )  # [slots, vocab]
        self.sample_keys = torch.zeros(num_slots, dtype=torch.long, device=device)  # [slots]
        self.steps = torch.zeros(num_slots, dtype=torch.long, device=device)  # [slots]
        self.logits = (
            torch.zeros(num_slots, vocab_size, dtype=torch.float32, device=device) if keep_logits else None
        )  # [slots, vocab]
        self.logprobs_mode = logprobs_mode  # LOGPROB_MODES or None: the step leaves each token's in logprobs
        self.logprobs = (
            torch.zeros(num_slots, dtype=torch.float32, device=device) if logprobs_mode else None
        )  # [slots]

    def _buffers(self) -> list[torch.Tensor]:
        seen = [self.seen] if self.seen is not None else []
        return [self.input_ids, self.position_ids, self.sample_keys, self.steps] + seen

    def reset(self) -> None:
        for buf in self._buffers():
            buf.zero_()

    def admit(
        self, slots: Sequence[int], first_tokens: torch.Tensor, positions: Sequence[int],
        seen: torch.Tensor | None, sample_keys: torch.Tensor | None = None,
        steps: Sequence[int] | None = None,
    ) -> None:
        """Rows enter ``slots`` with their next input id and position; ``steps``: tokens each has
        generated (default 1, the prefill's; a preempted row resumes with its own count)."""
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

    def move_rows(self, src: Sequence[int], dst: Sequence[int]) -> None:
        if not src:
            return
        device = self.input_ids.device
        src_t = torch.tensor(list(src), dtype=torch.long, device=device)
        dst_t = torch.tensor(list(dst), dtype=torch.long, device=device)
        for buf in self._buffers():
            buf.index_copy_(0, dst_t, buf.index_select(0, src_t))


def processed_scores(
    logits: torch.Tensor, seen: torch.Tensor | None, repetition_penalty: float,
    sampling: SamplingParams | None,
) -> torch.Tensor:
    """The fp32 scores a token is chosen from: the penalty over ``seen`` (the ids so far), then,
    when sampling, temperature and top-k/top-p (HF's order)."""
    scores = logits.float()
    if seen is not None and repetition_penalty != 1.0:
        scores = apply_repetition_penalty(scores, seen, repetition_penalty)
    return scores if sampling is None else filter_logits(scores, sampling)


def logprobs_of(scores: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """[rows] log-softmax of ``scores`` at ``tokens``: a logsumexp and a gather."""
    scores = scores.float()
    return scores.gather(1, tokens[:, None])[:, 0] - torch.logsumexp(scores, dim=-1)


def token_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, *, mode: str, seen: torch.Tensor | None,
    repetition_penalty: float, sampling: SamplingParams | None,
) -> torch.Tensor:
    """[rows] fp32 log-probability of each chosen token: "raw", the model's log-softmax; or
    "processed", the distribution it was drawn from (``processed_scores``). ``seen``: the ids
    before this token."""
    if mode == "processed":
        return logprobs_of(processed_scores(logits, seen, repetition_penalty, sampling), tokens)
    return logprobs_of(logits, tokens)


def select_tokens(
    logits: torch.Tensor, seen: torch.Tensor | None, repetition_penalty: float, *,
    sampling: SamplingParams | None = None, sample_keys: torch.Tensor | None = None,
    steps: torch.Tensor | None = None, logprobs_mode: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Greedy (``sampling`` None) or seeded sampling from ``processed_scores``; ``logits``
    [rows, vocab], ``sample_keys`` and ``steps`` [rows] int64. Returns ([rows] ids, their
    log-probabilities in ``logprobs_mode`` or None), the processed scores computed once for both."""
    scores = processed_scores(logits, seen, repetition_penalty, sampling)
    tokens = scores.argmax(dim=-1) if sampling is None else draw(scores, sample_keys, steps)
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
    sampling: SamplingParams | None = None,
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
    tokens, logprobs = (select_tokens if select is None else select)(
        out.logits[:, -1], seen, repetition_penalty, sampling=sampling,
        sample_keys=state.sample_keys[:num_rows], steps=steps, logprobs_mode=state.logprobs_mode,
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
