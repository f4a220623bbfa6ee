"""What turns a row's logits into the scores its token is chosen from, and the token and its
log-probability: the penalties, the stop ids held back before a row's minimum, then the sampler.

Every setting is per row (``RowPenalties``, ``sampler.RowSampling``: ``[rows]`` tensors), so rows of
different requests share one decode step; everything is elementwise over static shapes with no host
sync, so the CUDA-graph-captured step runs it, and the prefill's first token, HF ``generate``'s
processors (the nocb route) and a one-request oracle compute the same scores.

    scores = processed_scores(logits, penalties=rows_penalties, seen=seen, counts=counts, sampling=rows)
    tokens, logprobs = select_tokens(logits, seen=seen, counts=counts, penalties=rows_penalties, ...)

"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

import torch

from rollout_lab.engine.sample.sampler import RowSampling, draw, filter_logits, row_argmax

# "raw" and "processed" are computed in the decode step (STEP_LOGPROB_MODES); "trainer" and
# "trainer_fp32" by one teacher-forced forward after it (engine.trainer.rollout_logprobs; the LM head
# in the model's dtype, or in fp32)
LOGPROB_MODES = ("raw", "processed", "trainer", "trainer_fp32")
STEP_LOGPROB_MODES = LOGPROB_MODES[:2]


@dataclass(frozen=True)
class RowPenalties:
    """Each row's penalties as ``[rows]`` fp32 tensors (vLLM's definitions, ``sample.params``):
    ``repetition`` (1: off) over the ids of its prompt and output (``seen``), ``presence`` and
    ``frequency`` (0: off) over its output's ids and their counts (``counts``). ``track_seen`` and
    ``track_counts`` are static (a captured step bakes them in): whether any row needs ``seen`` or
    ``counts`` at all."""

    repetition: torch.Tensor  # [rows] float32
    presence: torch.Tensor  # [rows] float32
    frequency: torch.Tensor  # [rows] float32
    track_seen: bool = False
    track_counts: bool = False

    @classmethod
    def of(cls, values: Sequence[tuple[float, float, float]], device: torch.device | str) -> "RowPenalties":
        """One row per (repetition, presence, frequency) of ``values``."""
        rep, presence, frequency = (list(v) for v in zip(*values)) if values else ([], [], [])
        return cls(torch.tensor(rep, dtype=torch.float32, device=device),
                   torch.tensor(presence, dtype=torch.float32, device=device),
                   torch.tensor(frequency, dtype=torch.float32, device=device),
                   track_seen=any(r != 1.0 for r in rep), track_counts=any(p != 0 or f != 0
                                                                           for p, f in zip(presence, frequency)))

    @classmethod
    def zeros(cls, num_rows: int, device: torch.device | str, *, track_seen: bool, track_counts: bool
              ) -> "RowPenalties":
        """Buffers for ``num_rows`` slots (``DecodeState``): every penalty off until rows are admitted."""
        return cls(torch.ones(num_rows, dtype=torch.float32, device=device),
                   torch.zeros(num_rows, dtype=torch.float32, device=device),
                   torch.zeros(num_rows, dtype=torch.float32, device=device),
                   track_seen=track_seen, track_counts=track_counts)

    def rows(self, index: torch.Tensor | slice) -> "RowPenalties":
        """The rows at ``index`` (a slice gives views, an index tensor a copy)."""
        return dataclasses.replace(self, repetition=self.repetition[index], presence=self.presence[index],
                                   frequency=self.frequency[index])

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [self.repetition, self.presence, self.frequency]

    def reset(self) -> None:
        self.repetition.fill_(1.0)
        self.presence.zero_()
        self.frequency.zero_()


def apply_penalties(scores: torch.Tensor, penalties: RowPenalties, *, seen: torch.Tensor | None,
                    counts: torch.Tensor | None) -> torch.Tensor:
    """vLLM's penalties on fp32 ``scores`` [rows, vocab]: each row's repetition penalty on the ids it
    has ``seen`` (prompt and output; HF's rule: a score < 0 times it, else divided by it), then its
    frequency penalty times each id's ``counts`` in its output and its presence penalty on every id
    the output holds. ``seen`` [rows, vocab] bool and ``counts`` [rows, vocab] int32: None where no
    row needs them (``track_seen``, ``track_counts``)."""
    if seen is not None:
        rep = penalties.repetition[:, None]  # [rows, 1]
        scores = torch.where(seen, torch.where(scores < 0, scores * rep, scores / rep), scores)
    if counts is not None:
        scores = scores - penalties.frequency[:, None] * counts - penalties.presence[:, None] * (counts > 0)
    return scores


def suppress_stop_ids(
    scores: torch.Tensor, steps: torch.Tensor, min_new_tokens: torch.Tensor, stop_mask: torch.Tensor
) -> torch.Tensor:
    """HF's ``MinNewTokensLengthLogitsProcessor`` (vLLM's ``min_tokens``) per row: while a row has
    generated fewer tokens (``steps``) than its ``min_new_tokens`` (both [rows] int64), the ids of its
    row of ``stop_mask`` ([rows, vocab] bool: its EOS and stop ids) are -inf."""
    early = (steps < min_new_tokens)[:, None]  # [rows, 1]
    return scores.masked_fill(early & stop_mask, float("-inf"))


def stop_id_mask(stop_ids: Sequence[Sequence[int]], vocab_size: int, device: torch.device | str) -> torch.Tensor:
    """[rows, vocab] bool, True at each row's ``stop_ids``: the ``stop_mask`` of ``suppress_stop_ids``."""
    mask = torch.zeros(len(stop_ids), vocab_size, dtype=torch.bool, device=device)
    pairs = [(row, token) for row, ids in enumerate(stop_ids) for token in ids]
    if pairs:
        index = torch.tensor(pairs, dtype=torch.long, device=device)
        mask[index[:, 0], index[:, 1]] = True
    return mask


def holds_stops_back(stop_ids: Sequence[Sequence[int]], min_new_tokens: Sequence[int]) -> bool:
    """Whether a call runs ``suppress_stop_ids``: some row has stop ids and a minimum > 0."""
    return any(ids and minimum > 0 for ids, minimum in zip(stop_ids, min_new_tokens))


def seen_from_ids(ids: torch.Tensor, valid: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, vocab] bool: which ids occur at the ``valid`` positions of ``ids`` [rows, T]."""
    seen = torch.zeros(ids.shape[0], vocab_size + 1, dtype=torch.bool, device=ids.device)
    seen.scatter_(1, torch.where(valid, ids, vocab_size), True)  # invalid -> spare column
    return seen[:, :vocab_size]


def counts_from_ids(ids: torch.Tensor, valid: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, vocab] int32: how often each id occurs at the ``valid`` positions of ``ids`` [rows, T]."""
    counts = torch.zeros(ids.shape[0], vocab_size + 1, dtype=torch.int32, device=ids.device)
    counts.scatter_add_(1, torch.where(valid, ids, vocab_size), valid.to(torch.int32))
    return counts[:, :vocab_size]


def ids_tensor(rows: Sequence[Sequence[int]], device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [rows, T] int64, valid [rows, T] bool) of ragged id lists, right-padded (T >= 1)."""
    width = max((len(r) for r in rows), default=0) or 1
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    valid = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, row in enumerate(rows):
        if row:
            ids[i, : len(row)] = torch.tensor(list(row), dtype=torch.long)
            valid[i, : len(row)] = True
    return ids.to(device), valid.to(device)


def processed_scores(
    logits: torch.Tensor, *, penalties: RowPenalties | None = None, seen: torch.Tensor | None = None,
    counts: torch.Tensor | None = None, sampling: RowSampling | None = None, steps: torch.Tensor | None = None,
    min_new_tokens: torch.Tensor | None = None, stop_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The fp32 scores a token is chosen from: the penalties (``apply_penalties``), the stop ids held
    back from rows short of their ``min_new_tokens`` (``suppress_stop_ids``), then, when sampling,
    each row's temperature, min-p, top-k and top-p (``sampler.filter_logits``)."""
    scores = logits.float()
    if penalties is not None:
        scores = apply_penalties(scores, penalties, seen=seen, counts=counts)
    if min_new_tokens is not None:
        scores = suppress_stop_ids(scores, steps, min_new_tokens, stop_mask)
    return scores if sampling is None else filter_logits(scores, sampling)


def logprobs_of(scores: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """[rows] log-softmax of ``scores`` at ``tokens``: a logsumexp and a gather."""
    scores = scores.float()
    return scores.gather(1, tokens[:, None])[:, 0] - torch.logsumexp(scores, dim=-1)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, *, mode: str, **processing) -> torch.Tensor:
    """[rows] fp32 log-probability of each chosen token: "raw", the model's log-softmax; or
    "processed", the distribution it was drawn from (``processed_scores`` with ``processing``, the
    ids seen and counted before this token)."""
    if mode == "processed":
        return logprobs_of(processed_scores(logits, **processing), tokens)
    return logprobs_of(logits, tokens)


def select_tokens(
    logits: torch.Tensor, *, penalties: RowPenalties | None = None, seen: torch.Tensor | None = None,
    counts: torch.Tensor | None = None, sampling: RowSampling | None = None,
    sample_keys: torch.Tensor | None = None, steps: torch.Tensor | None = None, logprobs_mode: str | None = None,
    min_new_tokens: torch.Tensor | None = None, stop_mask: torch.Tensor | None = None,
    salts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Greedy (``sampling`` None) or seeded sampling from ``processed_scores`` (its greedy rows:
    the argmax); ``logits`` [rows, vocab], ``sample_keys``, ``steps`` and ``min_new_tokens`` [rows]
    int64, ``stop_mask`` [rows, vocab] bool. Returns ([rows] ids, their log-probabilities in
    ``logprobs_mode`` or None), the processed scores computed once for both. ``salts``: the sampler's
    ``token_salts``, which ``compile_select`` passes in (``sampler.uniforms``)."""
    scores = processed_scores(logits, penalties=penalties, seen=seen, counts=counts, sampling=sampling, steps=steps,
                              min_new_tokens=min_new_tokens, stop_mask=stop_mask)
    tokens = row_argmax(scores) if sampling is None else draw(scores, sample_keys, steps, sampling.greedy, salts)
    if logprobs_mode is None:
        return tokens, None
    return tokens, logprobs_of(scores if logprobs_mode == "processed" else logits, tokens)


def note_tokens(tokens: torch.Tensor, *, seen: torch.Tensor | None, counts: torch.Tensor | None) -> None:
    """Add each row's new token to its ``seen`` ids and ``counts`` (in place; None: not kept)."""
    if seen is not None:
        seen.scatter_(1, tokens[:, None], True)
    if counts is not None:
        counts.scatter_add_(1, tokens[:, None], torch.ones_like(tokens[:, None], dtype=counts.dtype))
