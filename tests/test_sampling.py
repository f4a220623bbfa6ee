"""Seeded sampling and shared prefill: the same tokens on every route, sane distributions, and
num_samples sharing one prefill (tiny fp32 models, CPU)."""
from __future__ import annotations

import functools
import random

import pytest
import torch
from conftest import get_tiny, one_fast

from rollout_lab import Rollout, RolloutConfig
from rollout_lab.engine.sample.sampler import RowSampling, _mix64, _mix64_int, _signed, ARGMAX_CHUNK, filter_logits, row_argmax, sample_key, sample_tokens, uniforms
from rollout_lab.engine.sample.params import SamplingParams
from rollout_lab.measure.models import TINY_VOCAB_SIZE
from rollout_lab.planner.cost import CostCoefficients, ModelGeometry
from rollout_lab.planner.routes import choose_shared_route, prompt_groups, replication_cost_ms

ROUTES = ("nocb", "equal_width", "aligned", "bucketed", "paged", "auto")
CB_ROUTES = ("equal_width", "aligned", "bucketed", "paged", "auto")
SPLIT_COSTS = CostCoefficients(prefill_fixed_cost_ms=0.05, continuous_decode_cost_ms=0.0)
SAMPLE = dict(do_sample=True, temperature=0.9, top_k=40, top_p=0.9)


def make_prompts(lengths, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(1, TINY_VOCAB_SIZE) for _ in range(n)] for n in lengths]


def run(model, prompts, max_new_tokens, *, generate=None, **config):
    config.setdefault("costs", SPLIT_COSTS)
    return Rollout(model, RolloutConfig(**config)).generate(
        prompts, max_new_tokens=max_new_tokens, **(generate or {}))


# -- the hash ------------------------------------------------------------------------------------
def test_hash_matches_the_integer_reference_and_is_row_local():
    values = [0, 1, 12345678901234567, 2**63, 2**64 - 1]
    z = torch.tensor([_signed(v) for v in values])
    assert _mix64(z).tolist() == [_signed(_mix64_int(v)) for v in values]
    keys = torch.tensor([sample_key(s, r, k) for s in (0, 1) for r in range(3) for k in range(2)])
    steps = torch.arange(len(keys)) % 4
    u = uniforms(keys, steps, 1000)
    assert 0 < u.min() and u.max() < 1 and abs(u.mean() - 0.5) < 0.01
    perm = torch.randperm(len(keys), generator=torch.Generator().manual_seed(0))
    assert torch.equal(uniforms(keys[perm], steps[perm], 1000), u[perm])  # no batch dependence
    assert len(set(keys.tolist())) == len(keys)


@pytest.mark.parametrize("vocab", [1, ARGMAX_CHUNK - 1, ARGMAX_CHUNK, ARGMAX_CHUNK + 1, 3 * ARGMAX_CHUNK + 17])
def test_row_argmax_is_argmax_with_its_first_index_on_ties(vocab):
    gen = torch.Generator().manual_seed(vocab)
    for dtype in (torch.float32, torch.bfloat16):
        scores = torch.randint(-3, 4, (9, vocab), generator=gen).to(dtype)  # many ties, across chunks too
        scores[1] = float("-inf")
        scores[1, -1] = 0.0  # the only finite value, in the padded chunk
        scores[2] = 7.0  # every id ties: the first wins
        scores[3, :] = float("-inf")
        scores[3, vocab // 2] = float("inf")
        scores[4] = torch.randn(vocab, generator=gen).to(dtype)
        got = row_argmax(scores)
        assert got.dtype == torch.long and torch.equal(got, scores.argmax(dim=-1)), dtype
        assert got[2].item() == 0 and got[1].item() == vocab - 1
    assert row_argmax(torch.zeros(0, vocab)).shape == (0,)


def test_sampler_distribution_over_seeds():
    # many seeds, one row each: the draws follow softmax(logits / T), and not a wrong T
    logits = torch.randn(12, generator=torch.Generator().manual_seed(1)) * 1.5
    temperature, num_draws = 0.7, 3000
    keys = torch.tensor([sample_key(seed, 0, 0) for seed in range(num_draws)])
    tokens = sample_tokens(logits.expand(num_draws, -1), keys, torch.zeros_like(keys),
                           RowSampling.of([SamplingParams(temperature)] * num_draws, "cpu"))
    counts = torch.bincount(tokens, minlength=12).double()
    assert _chi_square(counts, torch.softmax(logits / temperature, -1)) < _critical(12)
    assert _chi_square(counts, torch.softmax(logits / (temperature * 1.3), -1)) > _critical(12)


def _chi_square(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """Pearson's statistic; cells with fewer than ``min_expected`` expected draws are pooled."""
    expected = probs.double() * counts.sum()
    small = expected < min_expected
    obs = torch.cat([counts[~small], counts[small].sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = exp > 0
    return float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())


def _critical(num_cells: int) -> float:
    """About the 1e-5 upper quantile of chi-square with num_cells - 1 dof (normal approximation)."""
    dof = num_cells - 1
    return dof + 4.5 * (2 * dof) ** 0.5


def test_top_k_and_top_p_filters_keep_ties_and_at_least_one():
    scores = torch.tensor([[3.0, 1.0, 1.0, 0.0, -2.0]])

    def kept(**params):
        return filter_logits(scores, RowSampling.of([SamplingParams(**params)], "cpu")).isfinite()

    assert kept(top_k=2).tolist() == [[True, True, True, False, False]]  # the tie at the k-th value stays
    assert kept(top_p=1e-9).sum() == 1
    probs = torch.softmax(scores, -1)[0]
    top_p = float(probs[0] + 1e-4)  # just above the top token's mass: the ties at rank 1 join
    assert kept(top_p=top_p).sum() == 3


# -- the engine ----------------------------------------------------------------------------------
def test_first_token_distribution_matches_softmax():
    model = get_tiny("qwen2")
    prompt = make_prompts([7])[0]
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, -1].float()
    temperature, num_draws = 0.5, 4000
    result = run(model, [prompt], 1, mode="aligned",
                 generate=dict(num_samples=num_draws, do_sample=True, temperature=temperature, seed=3))
    counts = torch.bincount(torch.tensor([s[0] for s in result.sequences]), minlength=TINY_VOCAB_SIZE)
    cells = int((torch.softmax(logits / temperature, -1) * num_draws >= 5).sum()) + 1
    assert cells >= 10  # a meaningful spread
    assert _chi_square(counts.double(), torch.softmax(logits / temperature, -1)) < _critical(cells)
    wrong = torch.softmax(logits / (temperature * 1.3), -1)
    assert _chi_square(counts.double(), wrong) > _critical(cells)


def _eos_for(model, prompts):
    """A token the sampled runs emit early in some rows, so that EOS retires rows at varied steps."""
    free = run(model, prompts, 10, mode="aligned", generate=dict(num_samples=2, seed=11, **SAMPLE))
    counts: dict[int, int] = {}
    for tokens in free.sequences:
        for token in set(tokens[1:6]):
            counts[token] = counts.get(token, 0) + 1
    return max(counts, key=counts.get)


@pytest.mark.parametrize("family", one_fast(["qwen2", "llama"], "qwen2"))
@pytest.mark.parametrize("mode, slots", one_fast([(mode, slots) for mode in CB_ROUTES for slots in (None, 5, 1)],
                                                 ("paged", 5)))
def test_sampling_is_identical_on_every_route(family, mode, slots):
    model = get_tiny(family)
    prompts = make_prompts([5, 17, 1, 9, 30, 3, 3, 12], seed=4)
    prompts[6] = list(prompts[5])  # a repeated request shares the prefill of the earlier one
    eos = _eos_for(model, prompts)
    gen = dict(num_samples=2, seed=11, **SAMPLE)
    expected = None
    for penalty in (1.0, 1.3):
        expected = run(model, prompts, 10, mode="nocb", eos_token_id=eos, repetition_penalty=penalty,
                       generate=gen).sequences
        assert len(expected) == 16 and (penalty != 1.0 or any(len(s) < 10 for s in expected))
        for share in (True, False):
            result = run(model, prompts, 10, mode=mode, continuous_batch_size=slots,
                         eos_token_id=eos, repetition_penalty=penalty, share_prefill=share,
                         generate=gen)
            assert result.sequences == expected, (share, penalty)
    other = run(model, prompts, 10, mode="bucketed", eos_token_id=eos, repetition_penalty=1.3,
                generate=dict(gen, seed=12)).sequences
    assert other != expected
    assert sum(a != b for a, b in zip(other, expected)) >= len(expected) // 2


def test_sampling_is_independent_of_input_order():
    # keys follow (request, sample), so moving a request moves its samples with it
    model = get_tiny("qwen3")
    prompts = make_prompts([4, 11, 2, 8], seed=2)
    gen = dict(num_samples=3, seed=1, **SAMPLE)
    forward = run(model, prompts, 6, mode="bucketed", continuous_batch_size=4, generate=gen)
    groups = forward.grouped()
    assert len(groups) == 4 and all(len(g) == 3 for g in groups)
    assert len({tuple(s) for s in groups[1]}) > 1  # the samples of one request differ


@pytest.mark.parametrize("mode", ROUTES)
def test_top_k_one_and_tiny_top_p_are_greedy(mode, oracle):
    model = get_tiny("opt")
    prompts = make_prompts([6, 1, 14, 3], seed=7)
    expected = oracle(model, prompts, max_new_tokens=6)
    for params in (dict(top_k=1, temperature=0.3), dict(top_p=1e-6, temperature=2.0)):
        result = run(model, prompts, 6, mode=mode, generate=dict(do_sample=True, seed=0, **params))
        assert result.sequences == expected, params


@pytest.mark.parametrize("mode", ROUTES)
def test_temperature_zero_is_greedy(mode, oracle):
    """vLLM's rule: do_sample=True at temperature 0 is greedy, whatever top_k, top_p and seed say."""
    from transformers import GenerationConfig

    model = get_tiny("qwen3")
    prompts = make_prompts([5, 1, 11], seed=3)
    expected = oracle(model, prompts, max_new_tokens=6)
    for params in (dict(temperature=0), dict(temperature=0.0, top_k=5, top_p=0.5, seed=4)):
        result = run(model, prompts, 6, mode=mode, generate=dict(do_sample=True, num_samples=2, **params))
        assert result.grouped() == [[e] * 2 for e in expected] and result.seed is None, params
    config = GenerationConfig(do_sample=True, temperature=0.0, max_new_tokens=6)
    assert run(model, prompts, None, mode=mode, generate=dict(generation_config=config)).sequences == expected


def test_greedy_samples_all_equal_the_oracle(oracle):
    model = get_tiny("qwen2")
    prompts = make_prompts([9, 2, 5], seed=1)
    expected = oracle(model, prompts, max_new_tokens=5)
    for mode in ROUTES:
        result = run(model, prompts, 5, mode=mode, generate=dict(num_samples=3))
        assert result.num_samples == 3 and result.seed is None
        assert result.grouped() == [[e] * 3 for e in expected], mode


@pytest.mark.parametrize("slots", one_fast([None, 3], None))
def test_shared_prefill_equals_prefilling_every_sample(slots):
    model = get_tiny("llama")
    prompts = make_prompts([12, 3, 7], seed=9)
    gen = dict(num_samples=4, seed=21, **SAMPLE)
    for mode in ("equal_width", "aligned", "bucketed"):
        shared = run(model, prompts, 6, mode=mode, continuous_batch_size=slots, profile=True, generate=gen)
        alone = run(model, prompts, 6, mode=mode, continuous_batch_size=slots, profile=True,
                    share_prefill=False, generate=gen)
        assert shared.sequences == alone.sequences, mode
        assert alone.profile.num_prefill_rows == 12 and alone.profile.num_replicated_rows == 0
        p = shared.profile
        assert p.num_prefill_rows + p.num_replicated_rows == 12
        if slots is None:  # one prefill row per unique prompt
            assert (p.num_prefill_rows, p.num_replicated_rows) == (3, 9), mode
        else:  # a prompt whose samples straddle two admissions is prefilled in each
            assert 3 < p.num_prefill_rows < 12, mode
    nocb = run(model, prompts, 6, mode="nocb", profile=True, generate=gen)
    assert nocb.sequences == shared.sequences and nocb.profile.num_prefill_rows == 12


def test_more_samples_extend_fewer():
    # sample s of request r depends on (seed, r, s) only: num_samples=2 is a prefix of 4
    model = get_tiny("qwen2")
    prompts = make_prompts([5, 10], seed=6)
    two = run(model, prompts, 6, mode="bucketed", generate=dict(num_samples=2, seed=4, **SAMPLE))
    four = run(model, prompts, 6, mode="bucketed", generate=dict(num_samples=4, seed=4, **SAMPLE))
    assert [g[:2] for g in four.grouped()] == two.grouped()
    one = run(model, prompts[:1], 6, mode="aligned", generate=dict(seed=4, **SAMPLE))
    assert one.sequences[0] == two.sequences[0]


def test_repeated_requests_share_one_prefill_row():
    model = get_tiny("qwen2")
    p, q = make_prompts([8, 5], seed=3)
    prompts = [p, q, list(p), list(p)]
    gen = dict(seed=2, **SAMPLE)
    shared = run(model, prompts, 6, mode="bucketed", profile=True, generate=gen)
    assert (shared.profile.num_prefill_rows, shared.profile.num_replicated_rows) == (2, 2)
    assert shared.sequences == run(model, prompts, 6, mode="bucketed", share_prefill=False,
                                   generate=gen).sequences
    assert len({tuple(shared.sequences[i]) for i in (0, 2, 3)}) == 3  # own keys: own samples
    assert shared.plans[0].buckets and sorted(r for b in shared.plans[0].buckets for r in b) == [0, 1]


def test_seed_none_draws_from_torch_generator():
    model = get_tiny("qwen2")
    prompts = make_prompts([4, 6], seed=8)
    torch.manual_seed(123)
    first = run(model, prompts, 5, mode="aligned", generate=dict(do_sample=True))
    torch.manual_seed(123)
    again = run(model, prompts, 5, mode="aligned", generate=dict(do_sample=True))
    assert first.seed is not None and first.seed == again.seed and first.sequences == again.sequences
    fixed = run(model, prompts, 5, mode="aligned", generate=dict(do_sample=True, seed=first.seed))
    assert fixed.sequences == first.sequences


def test_graph_key_holds_the_filters_not_their_values():
    model = get_tiny("qwen2")
    prompts = make_prompts([4, 6], seed=8)
    with Rollout(model, RolloutConfig(mode="aligned")) as rollout:
        rollout.generate(prompts, max_new_tokens=3)
        greedy = rollout.runner.stepper
        rollout.generate(prompts, max_new_tokens=3, do_sample=True, seed=1, top_k=5)
        sampled = rollout.runner.stepper
        assert sampled is not greedy and sampled.key.do_sample and sampled.key.max_top_k == 8
        assert not sampled.key.top_p_filter
        # a new seed, temperature or top-k of the same width needs no new stepper (they are buffers)
        rollout.generate(prompts, max_new_tokens=3, do_sample=True, seed=2, top_k=7, temperature=0.5)
        rollout.generate(prompts, max_new_tokens=3, sampling=[SamplingParams(0.3, 6, seed=4), SamplingParams(0)])
        assert rollout.runner.stepper is sampled
        rollout.generate(prompts, max_new_tokens=3, do_sample=True, top_k=5, top_p=0.9)
        assert rollout.runner.stepper is not sampled and rollout.runner.stepper.key.top_p_filter


# -- per-request settings ------------------------------------------------------------------------
PER_REQUEST = [SamplingParams(0.9, 40, 0.9, seed=3), SamplingParams(0), SamplingParams(1.3, 5, seed=8),
               SamplingParams(0.7, top_p=0.8, seed=11), SamplingParams(seed=2), SamplingParams(0.5, 300, 0.95, seed=3)]
TIGHT_PAGED = dict(kv_block_size=16, continuous_batch_size=3, kv_cache_tokens=64, refill_rows=1)  # preempts


def alone(model, prompt, params, max_new_tokens, minimum=0, **config):
    """One request in a call of its own, with its settings as the call-wide arguments."""
    call = dict(num_samples=3, min_new_tokens=minimum, return_logprobs=True, logprobs_mode="processed")
    if not params.is_greedy:
        call |= dict(do_sample=True, temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                     seed=params.seed)
    return run(model, [prompt], max_new_tokens, mode="aligned", generate=call, **config)


@functools.cache
def each_request_alone(family):
    """(prompts, the call's settings, minimums, each request's call of its own) for the per-request
    test: computed once per family, read by every route's case."""
    model = get_tiny(family)
    prompts = make_prompts([5, 17, 1, 9, 12, 5], seed=4)
    prompts[5] = list(prompts[0])  # the same prompt, other settings: a shared prefill, its own rows
    eos = alone(model, prompts[1], PER_REQUEST[1], 24, repetition_penalty=1.3).sequences[0][4]  # the greedy one's
    minimums = [0, 3, 0, 6, 2, 0]
    config = dict(eos_token_id=eos, repetition_penalty=1.3)
    singles = [alone(model, p, q, 24, m, **config) for p, q, m in zip(prompts, PER_REQUEST, minimums)]
    return prompts, config, minimums, singles


@pytest.mark.parametrize("family", one_fast(["qwen2", "llama"], "qwen2"))
@pytest.mark.parametrize("mode, slots", one_fast(
    [(mode, None) for mode in ROUTES + ("packed",)] + [("bucketed", 2), ("paged", 2), ("paged", "tight")],
    ("paged", None)))
def test_per_request_settings_equal_each_request_alone(family, mode, slots):
    """Rows of different temperature, top-k, top-p and seed (greedy ones among them) share each step
    and still draw what each request draws alone with those settings, on every route; with EOS, the
    penalty, min_new_tokens, samples, refill and preemption."""
    model = get_tiny(family)
    prompts, config, minimums, singles = each_request_alone(family)
    expected = [s for single in singles for s in single.sequences]
    assert any(len(s) < 24 for s in expected) and len({tuple(s) for s in singles[0].sequences}) > 1
    extra = TIGHT_PAGED if slots == "tight" else dict(continuous_batch_size=slots)
    got = run(model, prompts, 24, mode=mode, profile=True, **config, **extra,
              generate=dict(num_samples=3, sampling=PER_REQUEST, min_new_tokens=minimums, return_logprobs=True,
                            logprobs_mode="processed"))
    assert got.sequences == expected
    want = [lp for single in singles for lp in single.logprobs]
    worst = max(abs(a - b) for g, w in zip(got.logprobs, want) for a, b in zip(g, w))
    assert worst < 1e-4, worst  # other batches and padding: fp32 rounding
    if slots == "tight":
        assert got.profile.num_preemptions > 0
    assert got.seed is None  # every sampled request brought its own


def test_requests_without_a_seed_of_their_own_take_the_calls():
    model = get_tiny("qwen3")
    prompts = make_prompts([4, 11, 2], seed=2)
    call_wide = run(model, prompts, 6, mode="bucketed", generate=dict(num_samples=2, seed=5, **SAMPLE))
    params = SamplingParams(SAMPLE["temperature"], SAMPLE["top_k"], SAMPLE["top_p"])
    for mode in ("nocb", "bucketed", "paged"):
        got = run(model, prompts, 6, mode=mode, generate=dict(num_samples=2, seed=5, sampling=[params] * 3))
        assert got.sequences == call_wide.sequences and got.seed == 5, mode
    greedy = run(model, prompts, 6, mode="bucketed", generate=dict(sampling=[SamplingParams(0)] * 3))
    assert greedy.sequences == run(model, prompts, 6, mode="bucketed").sequences and greedy.seed is None


# -- route choice --------------------------------------------------------------------------------
def test_shared_route_counts_rows_for_nocb_and_unique_prompts_for_cb():
    geometry = ModelGeometry.qwen25_3b()
    costs = CostCoefficients()
    lengths = [40, 60, 80, 100]
    plan = choose_shared_route(lengths, [8] * 4, max_new_tokens=16, continuous_batch_size=None,
                               geometry=geometry, costs=costs)
    rows = choose_shared_route([n for n in lengths for _ in range(8)], [1] * 32, max_new_tokens=16,
                               continuous_batch_size=None, geometry=geometry, costs=costs)
    assert plan.nocb_cost_ms == pytest.approx(rows.nocb_cost_ms)  # n x samples rows either way
    assert plan.cb_cost_ms < rows.cb_cost_ms  # CB prefills 4 rows, not 32
    priced = CostCoefficients(prefill_replicate_cost_ms=0.5)
    costly = choose_shared_route(lengths, [8] * 4, max_new_tokens=16, continuous_batch_size=None,
                                 geometry=geometry, costs=priced)
    extra = replication_cost_ms(lengths, [8] * 4, geometry, priced)
    assert extra > 0 and costly.cb_cost_ms == pytest.approx(plan.cb_cost_ms + extra)
    over = choose_shared_route(lengths, [8] * 4, max_new_tokens=16, continuous_batch_size=16,
                               geometry=geometry, costs=costs)
    assert over.route == "bucketed" and over.nocb_cost_ms is None  # 32 rows > 16 slots
    assert prompt_groups([[1, 2], [3], [1, 2]], num_samples=2) == [0, 0, 2, 2, 0, 0]
    assert prompt_groups([[1, 2], [1, 2]], num_samples=1, share=False) == [0, 1]


# -- bad input -----------------------------------------------------------------------------------
BAD_SAMPLING = {
    "temperature_without_sampling": (dict(temperature=0.5), "do_sample=True"),
    "seed_without_sampling": (dict(seed=3), "do_sample=True"),
    "top_p_without_sampling": (dict(top_p=0.9), "do_sample=True"),
    "negative_temperature": (dict(do_sample=True, temperature=-0.5), "temperature"),
    "bad_top_k_at_zero_temperature": (dict(do_sample=True, temperature=0, top_k=-2), "top_k"),
    "nan_temperature": (dict(do_sample=True, temperature=float("nan")), "temperature"),
    "negative_top_k": (dict(do_sample=True, top_k=-2), "top_k"),
    "float_top_k": (dict(do_sample=True, top_k=2.0), "top_k"),
    "zero_top_p": (dict(do_sample=True, top_p=0.0), "top_p"),
    "big_top_p": (dict(do_sample=True, top_p=1.5), "top_p"),
    "negative_seed": (dict(do_sample=True, seed=-1), "seed"),
    "float_seed": (dict(do_sample=True, seed=1.0), "seed"),
    "do_sample_not_bool": (dict(do_sample="yes"), "do_sample"),
    "zero_samples": (dict(num_samples=0), "num_samples"),
    "bool_samples": (dict(num_samples=True), "num_samples"),
    "return_sequences": (dict(num_return_sequences=2), "num_samples"),
    "one_sampling": (dict(sampling=SamplingParams()), "sampling must be a list of SamplingParams, one per request"),
    "sampling_per_sample": (dict(sampling=[SamplingParams()] * 2), "sampling has 2 SamplingParams for 1 requests"),
    "sampling_of_dicts": (dict(sampling=[dict(temperature=0.5)]), r"sampling\[0\] must be a SamplingParams"),
    "sampling_and_temperature": (dict(sampling=[SamplingParams()], do_sample=True, temperature=0.5),
                                 "leave do_sample=True, temperature=0.5 at the default"),
    "negative_min_new_tokens": (dict(min_new_tokens=-1), "min_new_tokens must be an int >= 0"),
    "float_min_new_tokens": (dict(min_new_tokens=2.0), "min_new_tokens must be an int >= 0"),
    "min_new_tokens_per_sample": (dict(min_new_tokens=[1, 2]), "min_new_tokens has 2 minimums for 1 requests"),
    "min_new_tokens_past_budget": (dict(min_new_tokens=[4]), "min_new_tokens=4 of request 0 exceeds its max_new_tokens=3"),
}


@pytest.mark.parametrize("case", sorted(BAD_SAMPLING))
def test_bad_sampling_arguments_raise_before_any_forward(case):
    model = get_tiny("qwen2")
    calls = []
    handle = model.register_forward_pre_hook(lambda *args: calls.append(1))
    kwargs, message = BAD_SAMPLING[case]
    try:
        with pytest.raises(ValueError, match=message):
            Rollout(model, RolloutConfig()).generate([[1, 2]], max_new_tokens=3, **kwargs)
    finally:
        handle.remove()
    assert calls == []


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-0.5), "temperature must be a finite number >= 0"),
    (dict(temperature=1e-7), "below 1e-05"),
    (dict(top_k=1.5), "top_k must be an int >= 0"),
    (dict(top_p=0), r"top_p must be a number in \(0, 1\]"),
    (dict(seed=-1), r"seed must be an int in \[0, 2\*\*64\) or None, got -1"),
    (dict(seed=2**64), "seed must be an int"),
])
def test_bad_sampling_params_fail_where_they_are_made(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_nocb_over_slots_counts_samples():
    with pytest.raises(ValueError, match="requests x num_samples"):
        Rollout(get_tiny("qwen2"), RolloutConfig(mode="nocb", continuous_batch_size=3)).generate(
            [[1], [2]], max_new_tokens=2, num_samples=2)
    with pytest.raises(ValueError, match="share_prefill"):
        RolloutConfig(share_prefill=1)
