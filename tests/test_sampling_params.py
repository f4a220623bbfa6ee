"""vLLM's per-request sampling (``engine.sample.params.SamplingParams``): every field honoured per
request on every route, equal to an independent one-request oracle in fp32.

The oracle runs one request alone with a plain forward over its whole sequence at every step (no
cache, no padding, no batch) and applies vLLM's definitions in its own code: the repetition
penalty over the prompt and output ids, the frequency and presence penalties over the output's
counts, min_tokens holding stop ids back, then temperature, min-p, top-k and top-p, and the draw
from the request's seeded Gumbel noise (``sampler.gumbel_noise``: the seeding is the contract).
"""
from __future__ import annotations

import dataclasses
import functools
import random
from collections import Counter

import pytest
import torch
from conftest import CharTokenizer, get_tiny, one_fast

from rollout_lab import Rollout, RolloutConfig, SamplingParams
from rollout_lab.engine.sample.sampler import gumbel_noise, sample_key
from rollout_lab.measure.models import TINY_VOCAB_SIZE

ROUTES = ("nocb", "equal_width", "aligned", "bucketed", "packed", "paged", "auto")
TIGHT_PAGED = dict(kv_block_size=16, continuous_batch_size=3, kv_cache_tokens=64, refill_rows=1)  # preempts


def make_prompts(lengths, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(1, TINY_VOCAB_SIZE) for _ in range(n)] for n in lengths]


@torch.no_grad()
def oracle(model, prompt, params: SamplingParams, *, key: int, stop_ids=(), stop=None, tokenizer=None):
    """One request alone, vLLM's rules in plain code (module docstring); its tokens."""
    tokens: list[int] = []
    min_tokens = params.min_tokens or 0
    for t in range(params.max_tokens):
        scores = model(input_ids=torch.tensor([prompt + tokens])).logits[0, -1].float().clone()
        rep = params.repetition_penalty
        if rep != 1.0:
            for i in set(prompt + tokens):
                scores[i] = scores[i] * rep if scores[i] < 0 else scores[i] / rep
        for i, count in Counter(tokens).items():
            scores[i] = scores[i] - params.frequency_penalty * count
            scores[i] = scores[i] - params.presence_penalty
        if t < min_tokens and stop_ids:
            scores[list(stop_ids)] = float("-inf")
        if params.is_greedy:
            token = int(scores.argmax())
        else:
            f = scores / params.temperature
            if params.min_p > 0:
                probs = torch.softmax(f, -1)
                f[probs < params.min_p * probs.max()] = float("-inf")
            if params.top_k > 0:
                kth = torch.sort(f, descending=True).values[min(params.top_k, f.numel()) - 1]
                f[f < kth] = float("-inf")
            if params.top_p < 1:
                ordered = torch.sort(f, descending=True).values
                probs = torch.softmax(ordered, -1)
                kept = max(1, int(((torch.cumsum(probs, -1) - probs) < params.top_p).sum()))
                f[f < ordered[kept - 1]] = float("-inf")
            noise = gumbel_noise(torch.tensor([key]), torch.tensor([t]), f.numel())[0]
            token = int((f + noise).argmax())
        tokens.append(token)
        if token in stop_ids:
            break
        if stop is not None and len(tokens) >= min_tokens and any(s in tokenizer.decode(tokens, True) for s in stop):
            break
    return tokens


# one call, every request its own settings: greedy and sampled, penalties of both signs, min-p,
# budgets, minimums, sample counts and stop ids of its own, and fields left to the call (None)
PARAMS = [
    SamplingParams(temperature=0.0, presence_penalty=1.5, frequency_penalty=0.5, n=2),
    SamplingParams(temperature=0.9, top_k=40, min_p=0.05, frequency_penalty=-0.75, seed=3, n=3, max_tokens=9),
    SamplingParams(temperature=1.3, top_p=0.9, repetition_penalty=1.5, presence_penalty=0.25, seed=8, min_tokens=4),
    SamplingParams(temperature=0.7, min_p=0.2, seed=11, n=1, max_tokens=5),
    SamplingParams(temperature=1.0, repetition_penalty=0.75, n=2),  # keyed by the call's seed
]
CALL = dict(max_new_tokens=32, num_samples=1, seed=5)


def expected(model, prompts, params, *, seed, call_max, eos=()):
    out = []
    for r, (prompt, p) in enumerate(zip(prompts, params)):
        resolved = SamplingParams(**{**p.__dict__, "n": p.n or 1, "max_tokens": p.max_tokens or call_max,
                                     "min_tokens": p.min_tokens or 0,
                                     "repetition_penalty": p.repetition_penalty or 1.0})
        stop_ids = tuple(eos) + tuple(p.stop_token_ids or ())
        for s in range(resolved.n):
            key = 0 if p.is_greedy else sample_key(seed, r, s) if p.seed is None else sample_key(p.seed, 0, s)
            out.append(oracle(model, prompt, resolved, key=key, stop_ids=stop_ids))
    return out


@functools.cache
def every_field_case(family):
    """(prompts, params, the oracle's tokens) for the every-field test: computed once per family, read
    by every route's case."""
    model = get_tiny(family)
    prompts = make_prompts([5, 17, 3, 9, 12], seed=7)
    prompts[4] = list(prompts[0])  # the same prompt, other settings: a shared prefill, its own rows
    params = list(PARAMS)
    free = expected(model, prompts, params, seed=CALL["seed"], call_max=CALL["max_new_tokens"])[5]
    # request 2 stops at its own id, its 6th token (held back before its min_tokens, which changes
    # nothing there: it was not chosen before)
    stop = next(token for token in free[4:] if token not in free[:4])
    params[2] = dataclasses.replace(params[2], stop_token_ids=(stop,))
    return prompts, params, expected(model, prompts, params, seed=CALL["seed"], call_max=CALL["max_new_tokens"])


@pytest.mark.slow  # over 1 s on 2 CPU cores: make test runs it
@pytest.mark.parametrize("family", one_fast(["qwen2", "llama"], "qwen2"))
@pytest.mark.parametrize("mode, slots", one_fast(
    [(mode, None) for mode in ROUTES] + [("bucketed", 2), ("paged", 2), ("paged", "tight")], ("paged", None)))
def test_every_field_per_request_equals_the_one_request_oracle_on_every_route(family, mode, slots):
    model = get_tiny(family)
    prompts, params, want = every_field_case(family)
    stop = params[2].stop_token_ids[0]
    assert [len(w) for w in want][:2] == [32, 32] and [len(w) for w in want[2:5]] == [9, 9, 9]
    assert 4 < len(want[5]) < 32 and want[5][-1] == stop and len(want[6]) == 5
    extra = TIGHT_PAGED if slots == "tight" else dict(continuous_batch_size=slots)
    rollout = Rollout(model, RolloutConfig(mode=mode, profile=True, **extra))
    got = rollout.generate(prompts, sampling=params, return_logprobs=True, **CALL)
    assert got.sequences == want
    assert got.samples == [2, 3, 1, 1, 2] and [len(g) for g in got.grouped()] == [2, 3, 1, 1, 2]
    assert [len(r.outputs) for r in got.requests] == [2, 3, 1, 1, 2]
    if slots == "tight":
        assert got.profile.num_preemptions > 0


def test_penalties_change_tokens_and_the_neutral_values_change_nothing():
    """A penalty that is on changes the tokens; its neutral value (and None: the config's) does not."""
    model = get_tiny("qwen3")
    prompts = make_prompts([6, 11], seed=1)
    plain = Rollout(model, RolloutConfig(mode="bucketed")).generate(prompts, max_new_tokens=16)
    neutral = [SamplingParams(0.0, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0)] * 2
    same = Rollout(model, RolloutConfig(mode="bucketed")).generate(prompts, max_new_tokens=16, sampling=neutral)
    assert same.sequences == plain.sequences
    for field in ("presence_penalty", "frequency_penalty"):
        params = [SamplingParams(0.0, **{field: 2.0})] * 2
        got = Rollout(model, RolloutConfig(mode="paged")).generate(prompts, max_new_tokens=16, sampling=params)
        assert got.sequences != plain.sequences, field
        # with a strong presence penalty a greedy row rarely repeats an id: fewer repeats than without
        repeats = sum(len(s) - len(set(s)) for s in got.sequences)
        assert repeats <= sum(len(s) - len(set(s)) for s in plain.sequences), field
    # the config's repetition penalty is every request's unless it sets its own
    config = Rollout(model, RolloutConfig(mode="aligned", repetition_penalty=1.5)).generate(prompts, max_new_tokens=16)
    own = Rollout(model, RolloutConfig(mode="aligned")).generate(
        prompts, max_new_tokens=16, sampling=[SamplingParams(0.0, repetition_penalty=1.5)] * 2)
    assert config.sequences == own.sequences != plain.sequences


def test_per_request_stop_strings_and_stop_ids_end_only_their_own_rows():
    model, tokenizer = get_tiny("qwen2"), CharTokenizer()
    prompts = make_prompts([4, 8, 6], seed=3)
    free = Rollout(model, RolloutConfig(mode="aligned")).generate(prompts, max_new_tokens=20).sequences
    stop_id = free[1][3]  # request 1's fourth token stops it; the others never stop at it unless they make it
    params = [SamplingParams(0.0, stop=["#"]), SamplingParams(0.0, stop_token_ids=[stop_id]), SamplingParams(0.0)]
    for mode in ROUTES:
        got = Rollout(model, RolloutConfig(mode=mode), tokenizer=tokenizer).generate(
            prompts, max_new_tokens=20, sampling=params)
        text = tokenizer.decode(free[0], True)
        cut = next((t for t in range(1, 21) if "#" in tokenizer.decode(free[0][:t], True)), 20)
        assert got.sequences[0] == free[0][:cut], mode
        assert got.sequences[1] == free[1][: free[1].index(stop_id) + 1], mode
        assert got.sequences[2] == free[2], mode  # the others' stops are not its own
        assert got.finish_reasons[1] == "stop" and got.finish_reasons[2] == "length", mode
        if "#" in text:
            assert got.finish_reasons[0] == "stop" and "#" not in got.texts[0], mode


def test_call_wide_arguments_fill_what_a_request_leaves_none():
    model = get_tiny("qwen2")
    prompts = make_prompts([5, 7], seed=2)
    params = [SamplingParams(0.0), SamplingParams(0.0, max_tokens=3, n=2)]
    got = Rollout(model, RolloutConfig(mode="bucketed")).generate(prompts, max_new_tokens=6, num_samples=3,
                                                                   sampling=params)
    assert got.samples == [3, 2] and [len(s) for s in got.sequences] == [6, 6, 6, 3, 3]
    batch = got.to_tensors()
    assert batch["input_ids"].shape[0] == 5 and batch["response_mask"].sum().item() == 6 * 3 + 3 * 2
    # every budget from the requests: max_new_tokens may be left out
    own = Rollout(model, RolloutConfig(mode="bucketed")).generate(
        prompts, sampling=[SamplingParams(0.0, max_tokens=4)] * 2)
    assert [len(s) for s in own.sequences] == [4, 4]
    with pytest.raises(ValueError, match="max_new_tokens is required"):
        Rollout(model).generate(prompts, sampling=[SamplingParams(0.0, max_tokens=4), SamplingParams(0.0)])


@pytest.mark.parametrize("field, value, message", [
    ("min_p", 1.5, "min_p must be a number in"), ("min_p", -0.1, "min_p must be"),
    ("presence_penalty", 2.5, "presence_penalty must be a number in"),
    ("frequency_penalty", float("nan"), "frequency_penalty must be"),
    ("repetition_penalty", 0.0, "repetition_penalty must be a finite number > 0"),
    ("n", 0, "n must be an int >= 1"), ("max_tokens", 0, "max_tokens must be an int >= 1"),
    ("min_tokens", -1, "min_tokens must be an int >= 0"), ("stop", "\n", "stop must be a list"),
    ("stop_token_ids", [-3], "stop_token_ids must hold non-negative"), ("top_k", -2, "top_k must be"),
])
def test_bad_fields_are_named(field, value, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{field: value})


def test_bad_combinations_are_named_before_any_forward():
    model = get_tiny("qwen2")
    with pytest.raises(ValueError, match="min_tokens=5 exceeds max_tokens=3"):
        SamplingParams(max_tokens=3, min_tokens=5)
    with pytest.raises(ValueError, match="min_new_tokens=5 of request 0 exceeds its max_new_tokens=3"):
        Rollout(model).generate([[5, 6]], max_new_tokens=3, sampling=[SamplingParams(0.0, min_tokens=5)])
    with pytest.raises(ValueError, match=r"stop_token_ids must hold ids in the vocabulary \[0, 384\)"):
        Rollout(model).generate([[5, 6]], max_new_tokens=3, sampling=[SamplingParams(0.0, stop_token_ids=[999])])
    with pytest.raises(ValueError, match="needs a tokenizer"):
        Rollout(model).generate([[5, 6]], max_new_tokens=3, sampling=[SamplingParams(0.0, stop=["a"])])
    assert SamplingParams(top_k=-1).top_k == 0  # vLLM's "off"
