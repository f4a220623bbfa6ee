"""The nocb route: one left-padded HF ``generate`` call over all rows, greedy or with our sampler.

HF's own ``generate`` (dynamic cache) is the no-continuous-batching reference. Our seeded sampler,
a padding-aware repetition penalty and each row's min_new_tokens go in as logits processors, so
nocb gives the same tokens as the continuous-batching routes; forward hooks time its prefill and
decode for the profile.

"""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator, Sequence

import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

from rollout_lab.engine.decode import (
    apply_repetition_penalty,
    holds_stops_back,
    seen_from_ids,
    stop_id_mask,
    suppress_stop_ids,
    token_logprobs,
)
from rollout_lab.engine.prefill import left_padded
from rollout_lab.engine.profile import Profile, Timer
from rollout_lab.engine.sampling import RowSampling, filter_logits, with_noise
from rollout_lab.engine.stopping import StopStrings
from rollout_lab.planner.bucket_dp import BucketPlan
from rollout_lab.planner.cost import CostCoefficients, ModelGeometry, prefill_cost_ms


def run_nocb(
    model: torch.nn.Module, prompts: list[list[int]], *, budgets: Sequence[int], eos_ids: Sequence[int],
    pad_id: int, repetition_penalty: float, vocab_size: int, geometry: ModelGeometry,
    costs: CostCoefficients, profile: Profile, timer: Timer, sampling: RowSampling | None = None,
    keys: Sequence[int] = (), logprobs_mode: str | None = None, stop_strings: StopStrings | None = None,
    min_new_tokens: Sequence[int] | None = None,
) -> tuple[list[list[int]], list[BucketPlan], list[list[float]] | None]:
    """(sequences cut after the first EOS, the one-bucket plan) of one HF ``generate`` call.

    HF gives every row the same budget, so it generates to the largest of ``budgets`` (one per row)
    and each row is cut at its own: the tokens are the same as a call with that row's budget (a
    row's token at step t depends only on its own earlier tokens), the extra steps are wasted.
    With ``logprobs_mode``, the third item holds each kept token's log-probability, from HF's raw
    logits of every step (``decode.token_logprobs``); else None. ``eos_ids``: every id that ends a
    row (EOS and stop ids); ``stop_strings`` are checked after each token as the other routes do
    (``_StopStringCriteria``), and a row is cut at the token that completed one. ``min_new_tokens``
    (one per row) holds ``eos_ids`` back (``_MinNewTokens``) and stop strings until a row has that many."""
    device = next(model.parameters()).device
    ids, mask = left_padded(prompts, pad_id, device)
    width = ids.shape[1]
    gen_config = GenerationConfig(
        max_new_tokens=max(budgets), do_sample=False, num_beams=1,
        eos_token_id=list(eos_ids) or None, pad_token_id=pad_id, repetition_penalty=1.0,
        output_logits=logprobs_mode is not None, return_dict_in_generate=logprobs_mode is not None,
    )
    processors = LogitsProcessorList()
    penalty = float(repetition_penalty)
    if penalty != 1.0:
        processors.append(_PaddedRepetitionPenalty(penalty, mask.bool(), vocab_size))
    minimum = stop_mask = None  # [rows] int64 and [vocab] bool, when a row holds stop ids back
    if holds_stops_back(eos_ids, min_new_tokens):  # after the penalty, before sampling: our decode's order
        minimum = torch.tensor(list(min_new_tokens), dtype=torch.long, device=device)
        stop_mask = stop_id_mask(eos_ids, vocab_size, device)
        processors.append(_MinNewTokens(minimum, stop_mask, width))
    if sampling is not None:  # HF's greedy argmax then picks our tokens
        key_t = torch.tensor(list(keys), dtype=torch.long, device=device)
        processors.append(_HashGumbelSampler(sampling, key_t, width))
    criteria = None if stop_strings is None else _StopStringCriteria(stop_strings, width, budgets, eos_ids,
                                                                     min_new_tokens)
    with _neutral_generation_config(model), _count_forwards(model, profile, timer):
        out = model.generate(
            input_ids=ids, attention_mask=mask, generation_config=gen_config,
            logits_processor=processors, stopping_criteria=StoppingCriteriaList([criteria] if criteria else []),
        )
    logprobs = None
    if logprobs_mode is not None:
        out, logprobs = out.sequences, _logprobs_of(out.sequences, out.logits, mask.bool(), width, vocab_size,
                                                    mode=logprobs_mode, penalty=penalty, sampling=sampling,
                                                    min_new_tokens=minimum, stop_mask=stop_mask)
    eos = set(eos_ids)
    sequences = [_cut_at_eos(row[:budget], eos) for row, budget in zip(out[:, width:].tolist(), budgets)]
    if criteria is not None:
        sequences = [seq if n is None else seq[:n] for seq, n in zip(sequences, criteria.lengths)]
    if logprobs is not None:
        logprobs = [row[: len(seq)] for row, seq in zip(logprobs, sequences)]
    profile.decode_ms = max(0.0, profile.decode_ms - profile.prefill_ms)
    if profile.forwards is not None and profile.num_decode_forwards:  # HF's loop overhead included
        profile.forwards.append({"kind": "nocb_decode", "rows": len(prompts),
                                 "steps": profile.num_decode_forwards, "ms": profile.decode_ms})
    profile.peak_cache_columns = width + profile.num_decode_forwards
    profile.cache_bytes = len(prompts) * profile.peak_cache_columns * 2 * geometry.num_layers \
        * geometry.num_kv_heads * geometry.head_dim * geometry.element_bytes
    profile.num_prefill_rows = len(prompts)  # HF generate prefills every row
    profile.prefill_backend = "hf_padded"  # one left-padded forward inside HF generate
    cost = prefill_cost_ms(len(prompts), width, geometry, costs, include_kv=False)
    return sequences, [BucketPlan((tuple(range(len(prompts))),), (width,), cost)], logprobs


def _logprobs_of(sequences: torch.Tensor, logits: Sequence[torch.Tensor], prompt_mask: torch.Tensor,
                 width: int, vocab_size: int, *, mode: str, penalty: float, sampling: RowSampling | None,
                 min_new_tokens: torch.Tensor | None, stop_mask: torch.Tensor | None) -> list[list[float]]:
    """Per row, the log-probability of each generated token, step by step from HF's raw logits; the
    ids seen before a step (for the penalty) exclude the left padding and grow by one per step."""
    seen = seen_from_ids(sequences[:, :width], prompt_mask, vocab_size) if penalty != 1.0 else None
    steps = []
    for t, step_logits in enumerate(logits):
        tokens = sequences[:, width + t]
        steps.append(token_logprobs(step_logits, tokens, mode=mode, seen=seen, repetition_penalty=penalty,
                                    sampling=sampling, steps=torch.full_like(tokens, t),
                                    min_new_tokens=min_new_tokens, stop_mask=stop_mask))
        if seen is not None:
            seen.scatter_(1, tokens[:, None], True)
    return torch.stack(steps, 1).tolist()


def _cut_at_eos(tokens: list[int], eos: set[int]) -> list[int]:
    for i, token in enumerate(tokens):
        if token in eos:
            return tokens[: i + 1]
    return tokens


class _StopStringCriteria(StoppingCriteria):
    """Stop strings inside HF ``generate``: after each token, the rows still open (no stop id, within
    their budget) are checked (``StopStrings.hits``, from each row's ``min_new_tokens`` on); a row
    that hits is done, and ``lengths`` keeps its tokens at that hit. A row past its own budget is
    done too, so generate can end early."""

    def __init__(self, stops: StopStrings, prompt_width: int, budgets: Sequence[int], stop_ids: Sequence[int],
                 min_new_tokens: Sequence[int] | None = None):
        self.stops, self.prompt_width, self.budgets, self.stop_ids = stops, prompt_width, list(budgets), set(stop_ids)
        self.min_new_tokens = None if min_new_tokens is None else list(min_new_tokens)
        self.lengths: list[int | None] = [None] * len(self.budgets)  # tokens kept, per row that hit
        self.closed = [False] * len(self.budgets)  # hit, ended by a stop id, or at its budget

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        generated = input_ids[:, self.prompt_width:].tolist()
        open_rows = [i for i, closed in enumerate(self.closed) if not closed]
        minimum = None if self.min_new_tokens is None else [self.min_new_tokens[i] for i in open_rows]
        hits = self.stops.hits([generated[i] for i in open_rows], minimum)
        for i, hit in zip(open_rows, hits):
            if hit:
                self.lengths[i] = len(generated[i])
            if hit or generated[i][-1] in self.stop_ids or len(generated[i]) >= self.budgets[i]:
                self.closed[i] = True
        return torch.tensor(self.closed, dtype=torch.bool, device=input_ids.device)


class _HashGumbelSampler(LogitsProcessor):
    """Our seeded sampler inside HF ``generate``: each row's filtered scores + its hash-Gumbel noise
    at step = tokens generated so far (a greedy row's scores unchanged), so HF's greedy argmax draws
    our tokens."""

    def __init__(self, sampling: RowSampling, sample_keys: torch.Tensor, prompt_width: int):
        self.sampling, self.sample_keys, self.prompt_width = sampling, sample_keys, prompt_width

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        steps = torch.full_like(self.sample_keys, input_ids.shape[1] - self.prompt_width)
        scores = filter_logits(scores.float(), self.sampling)
        return with_noise(scores, self.sample_keys, steps, self.sampling.greedy)


class _MinNewTokens(LogitsProcessor):
    """Each row's min_new_tokens inside HF ``generate`` (``decode.suppress_stop_ids``): HF's own
    processor takes one minimum for every row."""

    def __init__(self, min_new_tokens: torch.Tensor, stop_mask: torch.Tensor, prompt_width: int):
        self.min_new_tokens, self.stop_mask, self.prompt_width = min_new_tokens, stop_mask, prompt_width

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        steps = torch.full_like(self.min_new_tokens, input_ids.shape[1] - self.prompt_width)
        return suppress_stop_ids(scores, steps, self.min_new_tokens, self.stop_mask)


class _PaddedRepetitionPenalty(LogitsProcessor):
    """HF's repetition penalty over each row's own ids, left padding excluded (HF's counts pad ids)."""

    def __init__(self, penalty: float, prompt_mask: torch.Tensor, vocab_size: int):
        self.penalty, self.prompt_mask, self.vocab_size = penalty, prompt_mask, vocab_size

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        width = self.prompt_mask.shape[1]
        valid = torch.ones_like(input_ids, dtype=torch.bool)
        valid[:, :width] = self.prompt_mask
        seen = seen_from_ids(input_ids, valid, scores.shape[-1])
        return apply_repetition_penalty(scores, seen, self.penalty)


@contextmanager
def _neutral_generation_config(model: torch.nn.Module) -> Iterator[None]:
    """generate() fills unset (None) fields from model.generation_config -- eos among them."""
    saved = model.generation_config
    model.generation_config = GenerationConfig()
    try:
        yield
    finally:
        model.generation_config = saved


@contextmanager
def _count_forwards(model: torch.nn.Module, profile: Profile, timer: Timer) -> Iterator[None]:
    """Count generate's forwards: the first is the prefill, the rest decode steps."""
    starts: list[float] = []

    def before(module, args, kwargs):
        timer.sync()
        starts.append(time.perf_counter())

    def after(module, args, kwargs, output):
        timer.sync()
        elapsed = (time.perf_counter() - starts[-1]) * 1e3
        if profile.num_prefill_forwards == 0:
            profile.num_prefill_forwards, profile.prefill_ms = 1, elapsed
            if profile.forwards is not None:
                batch, width = (kwargs.get("input_ids") if "input_ids" in kwargs else args[0]).shape
                profile.forwards.append({"kind": "nocb_prefill", "batch": batch, "width": width, "ms": elapsed})
        else:
            profile.num_decode_forwards += 1

    handles = [
        model.register_forward_pre_hook(before, with_kwargs=True),
        model.register_forward_hook(after, with_kwargs=True),
    ]
    try:
        with timer.phase("decode_ms"):
            yield
    finally:
        for handle in handles:
            handle.remove()
