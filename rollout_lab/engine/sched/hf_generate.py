"""The nocb route: one left-padded HF ``generate`` call over all rows, greedy or with our sampler.

HF's own ``generate`` (dynamic cache) is the no-continuous-batching reference. Our seeded sampler,
each row's penalties (padding-aware) and min_tokens go in as logits processors and each row's stops
as a stopping criterion, so nocb gives the same tokens as the continuous-batching routes; forward
hooks time its prefill and decode for the profile.

"""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Callable, Iterator, Sequence

import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

from rollout_lab.engine.profile import Profile, Timer
from rollout_lab.engine.runner.prefill import left_padded
from rollout_lab.engine.sample.processors import (
    RowPenalties,
    apply_penalties,
    counts_from_ids,
    note_tokens,
    seen_from_ids,
    stop_id_mask,
    suppress_stop_ids,
    token_logprobs,
)
from rollout_lab.engine.sample.sampler import RowSampling, filter_logits, with_noise
from rollout_lab.engine.sample.stopping import stop_string_hits
from rollout_lab.engine.sched.request import Request
from rollout_lab.planner.bucket_dp import BucketPlan
from rollout_lab.planner.cost import CostCoefficients, ModelGeometry, prefill_cost_ms


def run_nocb(
    model: torch.nn.Module, requests: Sequence[Request], *, pad_id: int, vocab_size: int, geometry: ModelGeometry,
    costs: CostCoefficients, profile: Profile, timer: Timer, sampling: RowSampling | None = None,
    penalties: RowPenalties | None = None, holds_stops_back: bool = False, logprobs_mode: str | None = None,
    on_retire: Callable[[Sequence[Request]], None] | None = None,
) -> list[BucketPlan]:
    """One HF ``generate`` call over every row of ``requests``: fills each request's tokens (cut after
    its own first stop id, at its own budget, or at the token completing one of its stop strings)
    and, with ``logprobs_mode``, their log-probabilities from HF's raw logits of every step
    (``processors.token_logprobs``); returns the one-bucket plan.

    HF gives every row the same budget and stop ids, so each row's own are ours: a stopping
    criterion (``_RowStops``) ends a row at its stop ids, its budget or its stop strings, and each
    row is cut at its own afterwards. A row's token at step t depends only on its own earlier tokens,
    so the tokens are those of a call of that row alone; the extra steps are wasted. With
    ``holds_stops_back`` each row's stop ids are held back until its ``min_tokens``
    (``_MinNewTokens``), stop strings too (``StopStrings.hits``). ``on_retire``, as the batchers'
    (``BatchSettings.on_retire``), hears after every step which rows it ended."""
    device = next(model.parameters()).device
    prompts = [r.prompt for r in requests]
    budgets = [r.max_tokens for r in requests]
    ids, mask = left_padded(prompts, pad_id, device)
    width = ids.shape[1]
    gen_config = GenerationConfig(
        max_new_tokens=max(budgets), do_sample=False, num_beams=1, eos_token_id=None, pad_token_id=pad_id,
        repetition_penalty=1.0, output_logits=logprobs_mode is not None,
        return_dict_in_generate=logprobs_mode is not None,
    )
    processors = LogitsProcessorList()
    if penalties is not None:
        processors.append(_Penalties(penalties, mask.bool()))
    minimum = stop_mask = None  # [rows] int64 and [rows, vocab] bool, when a row holds stop ids back
    if holds_stops_back:  # after the penalties, before sampling: our decode's order
        minimum = torch.tensor([r.min_tokens for r in requests], dtype=torch.long, device=device)
        stop_mask = stop_id_mask([sorted(r.stop_ids) for r in requests], vocab_size, device)
        processors.append(_MinNewTokens(minimum, stop_mask, width))
    if sampling is not None:  # HF's greedy argmax then picks our tokens
        key_t = torch.tensor([r.key for r in requests], dtype=torch.long, device=device)
        processors.append(_HashGumbelSampler(sampling, key_t, width))
    criteria = _RowStops(requests, width, vocab_size, device, on_retire=on_retire)
    with _neutral_generation_config(model), _count_forwards(model, profile, timer):
        out = model.generate(
            input_ids=ids, attention_mask=mask, generation_config=gen_config,
            logits_processor=processors, stopping_criteria=StoppingCriteriaList([criteria]),
        )
    logprobs = None
    if logprobs_mode is not None:
        out, logprobs = out.sequences, _logprobs_of(out.sequences, out.logits, mask.bool(), width, vocab_size,
                                                    mode=logprobs_mode, penalties=penalties, sampling=sampling,
                                                    min_new_tokens=minimum, stop_mask=stop_mask)
    for i, (request, row) in enumerate(zip(requests, out[:, width:].tolist())):
        tokens = _cut_at_eos(row[: request.max_tokens], request.stop_ids)
        if criteria.lengths[i] is not None:
            tokens = tokens[: criteria.lengths[i]]
        request.tokens[:] = tokens
        request.num_generated = len(tokens)
        if logprobs is not None:
            request.logprobs[:] = logprobs[i][: len(tokens)]
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
    return [BucketPlan((tuple(range(len(prompts))),), (width,), cost)]


def _logprobs_of(sequences: torch.Tensor, logits: Sequence[torch.Tensor], prompt_mask: torch.Tensor,
                 width: int, vocab_size: int, *, mode: str, penalties: RowPenalties | None,
                 sampling: RowSampling | None, min_new_tokens: torch.Tensor | None,
                 stop_mask: torch.Tensor | None) -> list[list[float]]:
    """Per row, the log-probability of each generated token, step by step from HF's raw logits; the
    ids seen and counted before a step (for the penalties) exclude the left padding and grow by one
    per step."""
    seen = counts = None
    if penalties is not None and penalties.track_seen:
        seen = seen_from_ids(sequences[:, :width], prompt_mask, vocab_size)
    if penalties is not None and penalties.track_counts:
        counts = torch.zeros(sequences.shape[0], vocab_size, dtype=torch.int32, device=sequences.device)
    steps = []
    for t, step_logits in enumerate(logits):
        tokens = sequences[:, width + t]
        steps.append(token_logprobs(step_logits, tokens, mode=mode, penalties=penalties, seen=seen, counts=counts,
                                    sampling=sampling, steps=torch.full_like(tokens, t),
                                    min_new_tokens=min_new_tokens, stop_mask=stop_mask))
        note_tokens(tokens, seen=seen, counts=counts)
    return torch.stack(steps, 1).tolist()


def _cut_at_eos(tokens: list[int], eos: frozenset[int]) -> list[int]:
    for i, token in enumerate(tokens):
        if token in eos:
            return tokens[: i + 1]
    return tokens


class _RowStops(StoppingCriteria):
    """Each row's own stops inside HF ``generate``: after each token a row is done at one of its stop
    ids or its budget (on the device), or, checked on the host for the rows still open, at the token
    that completes one of its stop strings (``StopStrings.hits``, from its ``min_tokens`` on);
    ``lengths`` keeps a row's tokens at such a hit. Generate ends once every row is done. With
    ``on_retire`` each open row's ``num_generated`` follows the steps and the rows each step ends are
    reported (one host read of the closed rows a step)."""

    def __init__(self, requests: Sequence[Request], prompt_width: int, vocab_size: int, device: torch.device, *,
                 on_retire: Callable[[Sequence[Request]], None] | None = None):
        self.requests, self.prompt_width, self.on_retire = list(requests), prompt_width, on_retire
        self.stop_mask = stop_id_mask([sorted(r.stop_ids) for r in requests], vocab_size, device)  # [rows, vocab]
        self.budgets = torch.tensor([r.max_tokens for r in requests], dtype=torch.long, device=device)
        self.has_strings = any(r.stop_strings is not None for r in requests)
        self.lengths: list[int | None] = [None] * len(self.requests)  # tokens kept, per row that hit a string
        self.closed = torch.zeros(len(self.requests), dtype=torch.bool, device=device)

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        last = input_ids[:, -1:]  # [rows, 1]
        generated = input_ids.shape[1] - self.prompt_width
        done = self.stop_mask.gather(1, last)[:, 0] | (self.budgets <= generated)
        if self.has_strings:
            closed = self.closed.tolist()
            open_rows = [i for i, r in enumerate(self.requests) if not closed[i] and r.stop_strings is not None]
            tails = input_ids[:, self.prompt_width:].tolist() if open_rows else []
            hits = stop_string_hits([self.requests[i].stop_strings for i in open_rows], [tails[i] for i in open_rows],
                                    [self.requests[i].min_tokens for i in open_rows])
            hit_rows = [i for i, hit in zip(open_rows, hits) if hit]
            for i in hit_rows:
                self.lengths[i] = generated
            if hit_rows:
                done[torch.tensor(hit_rows, dtype=torch.long, device=done.device)] = True
        if self.on_retire is not None:
            self._report(done)
        self.closed |= done
        return self.closed.clone()

    def _report(self, done: torch.Tensor) -> None:
        """Count the step's token on every open row, then report the rows ``done`` ends."""
        was_closed, now_done = self.closed.tolist(), done.tolist()
        ended = []
        for i, request in enumerate(self.requests):
            if was_closed[i]:
                continue
            request.num_generated += 1
            if now_done[i]:
                ended.append(request)
        self.on_retire(ended)


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
    """Each row's min_tokens inside HF ``generate`` (``processors.suppress_stop_ids``): HF's own
    processor takes one minimum and one set of stop ids for every row."""

    def __init__(self, min_new_tokens: torch.Tensor, stop_mask: torch.Tensor, prompt_width: int):
        self.min_new_tokens, self.stop_mask, self.prompt_width = min_new_tokens, stop_mask, prompt_width

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        steps = torch.full_like(self.min_new_tokens, input_ids.shape[1] - self.prompt_width)
        return suppress_stop_ids(scores, steps, self.min_new_tokens, self.stop_mask)


class _Penalties(LogitsProcessor):
    """Each row's penalties inside HF ``generate`` (``processors.apply_penalties``): the repetition
    penalty over its own prompt and output ids, left padding excluded (HF's processor counts pad
    ids), the presence and frequency penalties over its output's counts."""

    def __init__(self, penalties: RowPenalties, prompt_mask: torch.Tensor):
        self.penalties, self.prompt_mask = penalties, prompt_mask

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        width, vocab = self.prompt_mask.shape[1], scores.shape[-1]
        seen = counts = None
        if self.penalties.track_seen:
            valid = torch.ones_like(input_ids, dtype=torch.bool)
            valid[:, :width] = self.prompt_mask
            seen = seen_from_ids(input_ids, valid, vocab)
        if self.penalties.track_counts:
            output = input_ids[:, width:]
            counts = counts_from_ids(output, torch.ones_like(output, dtype=torch.bool), vocab)
        return apply_penalties(scores.float(), self.penalties, seen=seen, counts=counts)


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
