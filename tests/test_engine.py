"""Every route gives the tokens of independent, unpadded, one-request HF generate (tiny fp32 models)."""
from __future__ import annotations

import dataclasses
import random
from collections import Counter

import pytest
import torch
from conftest import get_tiny, one_fast

from rollout_lab import Rollout, RolloutConfig, RolloutResult
from rollout_lab.measure.models import TINY_FAMILIES, TINY_VOCAB_SIZE
from rollout_lab.planner.cost import CostCoefficients

ROUTES = ("nocb", "equal_width", "aligned", "bucketed", "packed", "paged", "auto")
CB_ROUTES = ("equal_width", "aligned", "bucketed", "packed", "paged", "auto")
# a small fixed cost so that the DP splits tiny batches into several buckets
SPLIT_COSTS = CostCoefficients(prefill_fixed_cost_ms=0.05, continuous_decode_cost_ms=0.0)

# the seed's five workload shapes, scaled down to 8 requests, plus length-1 and random mixes
WORKLOADS = {
    "short_similar": [5, 4, 3, 2, 5, 4, 3, 2],
    "long_tail": [48] + [4] * 7,
    "short_tail": [8] + [1] * 7,
    "moderate_tail": [24] + [2] * 7,
    "spread": [4, 8, 12, 16, 20, 24, 28, 32],
    "length_one": [1] * 5,
    "random_mix": [17, 1, 9, 30, 3, 3, 22, 6],
}


def make_prompts(lengths, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(1, TINY_VOCAB_SIZE) for _ in range(n)] for n in lengths]


def run(model, prompts, max_new_tokens, **config) -> RolloutResult:
    config.setdefault("costs", SPLIT_COSTS)
    return Rollout(model, RolloutConfig(**config)).generate(prompts, max_new_tokens=max_new_tokens)


@pytest.mark.parametrize("family", one_fast(TINY_FAMILIES, "qwen2"))
@pytest.mark.parametrize("workload", one_fast(sorted(WORKLOADS), "random_mix"))
def test_routes_match_oracle(family, workload, oracle):
    model = get_tiny(family)
    prompts = make_prompts(WORKLOADS[workload], seed=len(workload))
    expected = oracle(model, prompts, max_new_tokens=5)
    for mode in ROUTES:
        result = run(model, prompts, 5, mode=mode)
        assert result.sequences == expected, (mode, result.route)
        if mode != "auto":
            assert result.route == mode


def test_bucketed_uses_several_buckets(oracle):
    model = get_tiny("qwen2")
    prompts = make_prompts(WORKLOADS["long_tail"])
    result = run(model, prompts, 4, mode="bucketed", profile=True)
    assert result.plans[0].num_buckets >= 2
    assert result.sequences == oracle(model, prompts, max_new_tokens=4)


@pytest.mark.parametrize("family", one_fast(TINY_FAMILIES, "llama"))
@pytest.mark.parametrize("slots", one_fast([1, 3], 3))
def test_refill_with_fewer_slots(family, slots, oracle):
    model = get_tiny(family)
    prompts = make_prompts([7, 2, 15, 1, 9, 4, 11], seed=3)
    expected = oracle(model, prompts, max_new_tokens=6)
    for mode in CB_ROUTES:
        result = run(model, prompts, 6, mode=mode, continuous_batch_size=slots)
        assert result.sequences == expected, mode
        assert result.route != "nocb"
        assert len(result.plans) >= len(prompts) // slots  # one plan per admission


def _staggered_eos(model, prompts, oracle, max_new_tokens):
    """A token that the model emits early in some rows and late or never in others."""
    free = oracle(model, prompts, max_new_tokens=max_new_tokens)
    first = {}
    for row, tokens in enumerate(free):
        for pos, token in enumerate(tokens):
            first.setdefault(token, {}).setdefault(row, pos)
    scores = Counter()
    for token, rows in first.items():
        early = sum(1 for pos in rows.values() if pos < max_new_tokens // 2)
        if early and len(rows) < len(prompts):
            scores[token] = early + len({*rows.values()})
    assert scores, "no token to stop on early"
    return scores.most_common(1)[0][0]


STAGGERED_PROMPTS = make_prompts([6, 1, 13, 4, 9, 2, 20, 5], seed=11)


@pytest.mark.parametrize("family", one_fast(TINY_FAMILIES, "opt"))
@pytest.mark.parametrize("mode, slots", one_fast([(mode, None) for mode in ROUTES] + [(mode, 3) for mode in CB_ROUTES],
                                                 ("aligned", 3)))
def test_staggered_eos(family, mode, slots, oracle):
    model = get_tiny(family)
    prompts = STAGGERED_PROMPTS
    eos = _staggered_eos(model, prompts, oracle, 12)
    expected = oracle(model, prompts, max_new_tokens=12, eos_token_id=eos)
    lengths = [len(s) for s in expected]
    assert min(lengths) < 12 and max(lengths) == 12 and len(set(lengths)) >= 2, lengths
    assert all(s[-1] == eos for s in expected if len(s) < 12)
    result = run(model, prompts, 12, mode=mode, eos_token_id=eos, continuous_batch_size=slots)
    assert result.sequences == expected


@pytest.mark.parametrize("family", one_fast(TINY_FAMILIES, "opt"))
def test_a_list_of_eos_ids_stops_on_any_of_them(family, oracle):
    model = get_tiny(family)
    prompts = STAGGERED_PROMPTS
    eos = _staggered_eos(model, prompts, oracle, 12)
    second = next(t for t in range(1, TINY_VOCAB_SIZE) if t != eos)
    expected = oracle(model, prompts, max_new_tokens=12, eos_token_id=[second, eos])
    result = run(model, prompts, 12, mode="bucketed", eos_token_id=[second, eos], continuous_batch_size=3)
    assert result.sequences == expected


def test_no_eos_runs_the_full_budget():
    model = get_tiny("opt")
    prompts = make_prompts([3, 8, 1])
    result = run(model, prompts, 7, mode="aligned", eos_token_id=None)
    assert [len(s) for s in result.sequences] == [7, 7, 7]


def test_pad_valued_tokens_are_kept(oracle):
    model = get_tiny("opt")  # the tiny OPT emits its pad id 0 often
    prompts = make_prompts([3, 8, 1, 5, 10, 6], seed=0)
    expected = oracle(model, prompts, max_new_tokens=8)
    assert any(0 in s for s in expected)
    for mode in ROUTES:
        assert run(model, prompts, 8, mode=mode, pad_token_id=0).sequences == expected


@pytest.mark.parametrize("family", one_fast(TINY_FAMILIES, "qwen3"))
@pytest.mark.parametrize("trim", one_fast([False, True], True))
def test_trimming_and_capacity(family, trim, oracle):
    model = get_tiny(family)
    prompts = make_prompts([20, 2, 3, 1, 18, 2, 4, 9], seed=5)
    eos = _staggered_eos(model, prompts, oracle, 10)
    expected = oracle(model, prompts, max_new_tokens=10, eos_token_id=eos)
    for capacity in (None, 29, 40):  # 29 = longest prompt + max_new_tokens - 1: the tightest
        result = run(
            model, prompts, 10, mode="bucketed", eos_token_id=eos, continuous_batch_size=3,
            trim_cache=trim, cache_capacity=capacity, profile=True,
        )
        assert result.sequences == expected, capacity
        assert result.profile.peak_cache_columns <= (capacity or 30)


def _trim_scenario(model, oracle, max_new_tokens):
    """A long prompt A and 1-token prompts b, c, d, e where only b stops, on its 3rd token x."""
    long_prompt = make_prompts([20], seed=21)[0]
    free = {t: oracle.one(model, [t], max_new_tokens, None, 1.0) for t in range(1, 40)}
    long_free = oracle.one(model, long_prompt, max_new_tokens, None, 1.0)
    for b, tokens in free.items():
        x = tokens[2]
        if x in tokens[:2] or x in long_free:
            continue
        others = [t for t in free if t != b and x not in free[t]][:3]
        if len(others) == 3:
            return [long_prompt, [b]] + [[t] for t in others], x
    raise AssertionError("no trimming scenario found")


@pytest.mark.parametrize(
    "trim, capacity, num_trims, trimmed_columns",
    [(False, 40, 0, 0), (False, 31, 1, 7), (True, 40, 2, 28)],
)
def test_trim_accounting(trim, capacity, num_trims, trimmed_columns, oracle):
    # slots 3: A, b, c admitted at front 20; b stops after 2 steps; d joins at front 22 (capacity
    # 31 or 40 holds it to the end of its budget); A and c end at front 29 with d live (span 8);
    # e's admission needs front + 9 <= capacity: capacity 31 forces a trim to 22, trim_cache to 8
    # (and trim_cache trims again, 7 columns, when d ends and e is alone).
    model = get_tiny("qwen2")
    prompts, eos = _trim_scenario(model, oracle, 10)
    expected = oracle(model, prompts, max_new_tokens=10, eos_token_id=eos)
    assert [len(s) for s in expected] == [10, 3, 10, 10, 10]
    result = run(
        model, prompts, 10, mode="aligned", eos_token_id=eos, continuous_batch_size=3,
        trim_cache=trim, cache_capacity=capacity, profile=True,
    )
    assert result.sequences == expected
    assert (result.profile.num_trims, result.profile.trimmed_columns) == (num_trims, trimmed_columns)
    assert result.profile.moved_bytes > 0  # compaction moves rows even without trims
    assert result.profile.peak_cache_columns <= capacity


@pytest.mark.parametrize("family", one_fast(TINY_FAMILIES, "qwen2"))
def test_repetition_penalty(family, oracle):
    model = get_tiny(family)
    prompts = make_prompts([6, 1, 14, 3, 9], seed=7)
    expected = oracle(model, prompts, max_new_tokens=8, repetition_penalty=1.3)
    assert expected != oracle(model, prompts, max_new_tokens=8)  # the penalty changes something
    for mode in ROUTES:
        result = run(model, prompts, 8, mode=mode, repetition_penalty=1.3)
        assert result.sequences == expected, mode
    result = run(model, prompts, 8, mode="bucketed", repetition_penalty=1.3, continuous_batch_size=2)
    assert result.sequences == expected


@pytest.mark.slow  # an eager-attention model through every route and the oracle
def test_eager_attention_with_additive_mask(oracle):
    model = get_tiny("llama", attn_implementation="eager")
    prompts = make_prompts(WORKLOADS["random_mix"], seed=2)
    expected = oracle(model, prompts, max_new_tokens=6)
    for mode in ROUTES:
        assert run(model, prompts, 6, mode=mode, continuous_batch_size=None).sequences == expected
    assert run(model, prompts, 6, mode="bucketed", continuous_batch_size=3).sequences == expected


def test_tensor_input_matches_lists():
    model = get_tiny("qwen3")
    prompts = make_prompts([4, 1, 6])
    ids = torch.zeros(3, 6, dtype=torch.long)
    mask = torch.zeros(3, 6, dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, 6 - len(p):] = torch.tensor(p)
        mask[row, 6 - len(p):] = 1
    rollout = Rollout(model, RolloutConfig(mode="aligned"))
    assert rollout.generate(ids, attention_mask=mask, max_new_tokens=4).sequences == \
        rollout.generate(prompts, max_new_tokens=4).sequences


def test_profile_counts():
    model = get_tiny("qwen2")
    prompts = make_prompts(WORKLOADS["spread"])
    n, steps = len(prompts), 5
    result = run(model, prompts, steps, mode="bucketed", profile=True)
    bucketed, plans = result.profile, result.plans
    assert bucketed.num_prefill_forwards == sum(p.num_buckets for p in plans) >= 2
    assert bucketed.num_decode_forwards == steps - 1
    assert bucketed.num_generated_tokens == n * steps
    assert bucketed.cache_bytes > 0 and bucketed.peak_cache_columns == max(WORKLOADS["spread"]) + steps - 1
    aligned = run(model, prompts, steps, mode="aligned", profile=True).profile
    assert aligned.num_prefill_forwards == n and aligned.num_decode_forwards == steps - 1
    equal = run(model, prompts, steps, mode="equal_width", profile=True).profile
    assert equal.num_prefill_forwards == 1
    nocb = run(model, prompts, steps, mode="nocb", profile=True).profile
    assert (nocb.num_prefill_forwards, nocb.num_decode_forwards) == (1, steps - 1)
    refill = run(model, prompts, steps, mode="aligned", continuous_batch_size=3, profile=True)
    # 8 requests through 3 slots with no EOS: waves of 3, 3, 2, each steps - 1 decode forwards
    assert refill.profile.num_prefill_forwards == n
    assert refill.profile.num_decode_forwards == 3 * (steps - 1)
    for p in (bucketed, aligned, equal, nocb, refill.profile):
        assert p.total_ms >= p.prefill_ms + p.decode_ms - 1e-6
        assert p.total_ms > 0
    assert run(model, prompts, steps, mode="aligned").profile is None
    assert run(model, prompts, 1, mode="aligned", profile=True).profile.num_decode_forwards == 0


def test_auto_picks_by_cost_model():
    model = get_tiny("qwen2")
    prompts = make_prompts(WORKLOADS["long_tail"])
    assert run(model, prompts, 3, mode="auto", costs=CostCoefficients()).route == "nocb"
    # trimming or an explicit capacity rules nocb out; so do more requests than slots
    assert run(model, prompts, 3, mode="auto", trim_cache=True).route == "bucketed"
    assert run(model, prompts, 3, mode="auto", continuous_batch_size=4).route == "bucketed"


def test_empty_prompt_list():
    result = Rollout(get_tiny("qwen2"), RolloutConfig(profile=True)).generate([], max_new_tokens=3)
    assert result.sequences == [] and result.plans == ()


# -- bad input ----------------------------------------------------------------------------------
@pytest.fixture
def forward_counter():
    model = get_tiny("qwen2")
    calls = []
    handle = model.register_forward_pre_hook(lambda *args: calls.append(1))
    yield model, calls
    handle.remove()


BAD_CALLS = {
    "empty_prompt": (dict(), [[1, 2], []], dict(max_new_tokens=3), "request 1"),
    "id_over_vocab": (dict(), [[1, TINY_VOCAB_SIZE]], dict(max_new_tokens=3), "vocabulary"),
    "negative_id": (dict(), [[1, -1]], dict(max_new_tokens=3), "vocabulary"),
    "float_id": (dict(), [[1, 2.0]], dict(max_new_tokens=3), "ints"),
    "over_context": (dict(), [[1] * 500], dict(max_new_tokens=20), "context"),
    "zero_new_tokens": (dict(), [[1]], dict(max_new_tokens=0), "max_new_tokens"),
    "bool_new_tokens": (dict(), [[1]], dict(max_new_tokens=True), "max_new_tokens"),
    "capacity_too_small": (dict(mode="aligned", cache_capacity=5), [[1] * 4], dict(max_new_tokens=3), "cache_capacity"),
    "beams": (dict(), [[1]], dict(max_new_tokens=3, num_beams=2), "num_beams"),
    "return_sequences": (dict(), [[1]], dict(max_new_tokens=3, num_return_sequences=2), "num_return_sequences"),
    "sampling": (dict(), [[1]], dict(max_new_tokens=3, temperature=0.7), "do_sample=True"),
    "nocb_over_slots": (dict(mode="nocb", continuous_batch_size=1), [[1], [2]], dict(max_new_tokens=3), "continuous_batch_size"),
    "eos_over_vocab": (dict(eos_token_id=10**6), [[1]], dict(max_new_tokens=3), "eos_token_id"),
    "mask_with_a_hole": (dict(), torch.tensor([[1, 5, 2]]), dict(max_new_tokens=3, attention_mask=torch.tensor([[1, 0, 1]])), "has a hole"),
}


@pytest.mark.parametrize("case", sorted(BAD_CALLS))
def test_bad_input_raises_before_any_forward(case, forward_counter):
    model, calls = forward_counter
    config, prompts, kwargs, message = BAD_CALLS[case]
    with pytest.raises(ValueError, match=message):
        Rollout(model, RolloutConfig(**config)).generate(prompts, **kwargs)
    assert calls == []


@pytest.mark.parametrize(
    "field, value",
    [("mode", "beam"), ("continuous_batch_size", 0), ("cache_capacity", -1), ("eos_token_id", "2"),
     ("pad_token_id", -1), ("repetition_penalty", 0.0), ("trim_cache", 1), ("costs", 3)],
)
def test_bad_config(field, value):
    with pytest.raises(ValueError, match=field):
        RolloutConfig(**{field: value})


def test_config_is_frozen_and_nocb_conflicts():
    config = RolloutConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.mode = "nocb"
    assert dataclasses.replace(config, mode="aligned").mode == "aligned"
    with pytest.raises(ValueError, match="nocb"):
        RolloutConfig(mode="nocb", trim_cache=True)


# ---------------------------------------------------------------- per-request budgets

def budget_oracle(oracle, model, prompts, budgets, **kw):
    """The one-request oracle, each request with its own max_new_tokens."""
    return [oracle(model, [p], max_new_tokens=b, **kw)[0] for p, b in zip(prompts, budgets)]


@pytest.mark.parametrize("family", one_fast(TINY_FAMILIES, "qwen3"))
@pytest.mark.parametrize("slots", one_fast([None, 1, 3], 3))
def test_per_request_budgets_match_oracle(family, slots, oracle):
    model = get_tiny(family)
    prompts = make_prompts([7, 2, 15, 1, 9, 4, 11], seed=5)
    budgets = [9, 1, 4, 12, 2, 7, 3]
    expected = budget_oracle(oracle, model, prompts, budgets)
    assert [len(s) for s in expected] == budgets  # no EOS: every row runs its own budget
    for mode in ROUTES if slots is None else CB_ROUTES:
        result = run(model, prompts, budgets, mode=mode, continuous_batch_size=slots)
        assert result.sequences == expected, (mode, slots, result.route)


@pytest.mark.slow  # every route and the oracle, with EOS, the penalty and samples
def test_per_request_budgets_with_eos_penalty_and_samples(oracle):
    model = get_tiny("qwen3")
    prompts = make_prompts([6, 1, 13, 4, 9], seed=13)
    budgets = [10, 3, 12, 1, 6]
    eos = _staggered_eos(model, prompts, oracle, 12)
    expected = budget_oracle(oracle, model, prompts, budgets, eos_token_id=eos, repetition_penalty=1.3)
    for mode in ROUTES:
        result = run(model, prompts, budgets, mode=mode, eos_token_id=eos, repetition_penalty=1.3)
        assert result.sequences == expected, mode
    # num_samples: a request's samples share its budget (greedy samples are its oracle, repeated)
    config = RolloutConfig(mode="bucketed", costs=SPLIT_COSTS, eos_token_id=eos, repetition_penalty=1.3,
                           continuous_batch_size=4)
    result = Rollout(model, config).generate(prompts, max_new_tokens=budgets, num_samples=3)
    assert result.grouped() == [[s] * 3 for s in expected]


def test_per_request_budgets_accept_numpy_and_tensors(oracle):
    model = get_tiny("qwen2")
    prompts = make_prompts([5, 3], seed=2)
    expected = budget_oracle(oracle, model, prompts, [2, 4])
    for budgets in ([2, 4], (2, 4), torch.tensor([2, 4]), __import__("numpy").array([2, 4])):
        assert run(model, prompts, budgets, mode="bucketed").sequences == expected


@pytest.mark.parametrize("budgets, message", [
    ([3, 4], "2 budgets for 3 requests"),
    ([3, 0, 4], r"max_new_tokens\[1\] must be an int >= 1, got 0"),
    ([3, 2.0, 4], r"max_new_tokens\[1\] must be an int >= 1, got 2.0"),
    ([3, 4, 600], "request 2: prompt length 1 \\+ max_new_tokens 600 exceeds the model's context"),
])
def test_bad_budgets_fail_before_any_forward(budgets, message):
    model = get_tiny("qwen2")
    calls = []
    handle = model.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        for mode in ("nocb", "bucketed", "auto"):
            with pytest.raises(ValueError, match=message):
                run(model, [[5, 6], [7], [8]], budgets, mode=mode)
    finally:
        handle.remove()
    assert not calls


def test_explicit_capacity_names_the_request_that_cannot_fit():
    model = get_tiny("qwen2")
    with pytest.raises(ValueError, match=r"request 1 \(prompt 2 \+ max_new_tokens 9\); it needs at least 10"):
        run(model, [[5, 6, 7], [8, 9]], [3, 9], mode="bucketed", cache_capacity=8)


@pytest.mark.parametrize("slots", [None, 3])
def test_auto_plans_once_and_its_first_admission_runs_the_plan_it_priced(monkeypatch, slots):
    """Auto prices the bucketed route with the DP over the call's unique prompts; the first admission
    of all of them runs that plan (one DP a call, not two). With fewer slots than rows the first
    admission is a subset: it plans its own, as before. Tokens are the other routes'."""
    import rollout_lab.planner.chunks as chunks
    import rollout_lab.planner.routes as routes

    calls = []
    real = chunks.plan_chunked
    monkeypatch.setattr(routes, "plan_chunked", lambda *a, **k: calls.append(list(a[0])) or real(*a, **k))
    model = get_tiny("qwen2")
    rng = random.Random(3)
    prompts = [[rng.randrange(1, TINY_VOCAB_SIZE) for _ in range(n)] for n in (40, 3, 5, 38, 4, 6)]
    costs = CostCoefficients(prefill_fixed_cost_ms=5.0, continuous_decode_cost_ms=0.0)
    auto = Rollout(model, RolloutConfig(costs=costs, continuous_batch_size=slots)).generate(
        prompts, max_new_tokens=5, num_samples=2)
    assert auto.route == "bucketed"
    planned = [c for c in calls if len(c) == len(prompts)]  # the DPs over every unique prompt
    if slots is None:  # every row in the first admission: the route's DP is the admission's
        assert len(planned) == 1 and len(auto.plans) == 1 and len(auto.plans[0].buckets) == 2
    else:  # three slots: the first admission (two prompts) plans its own
        assert len(planned) == 1 and any(len(c) == 2 for c in calls)
    bucketed = Rollout(model, RolloutConfig(mode="bucketed", costs=costs, continuous_batch_size=slots)).generate(
        prompts, max_new_tokens=5, num_samples=2)
    assert auto.plans == bucketed.plans and auto.sequences == bucketed.sequences
