"""Multi-turn episodes (generate(env=...), engine.sched.episodes): an episode's tokens equal a
one-request oracle fed the same environment answers (greedy HF generate turn by turn over the
concatenated history), seeded episodes draw the same tokens however they are scheduled, a slow
environment does not stop the other rows, the history's full blocks are read from the cache when a
row comes back, env_mask / loss_mask / num_turns / logprobs, max_turns and the budgets, and the
errors before any work (tiny fp32 models, CPU)."""
from __future__ import annotations

import random
import time

import pytest
import torch
from conftest import get_tiny, one_fast

from rollout_lab import Rollout, RolloutConfig, SamplingParams
from rollout_lab.engine.runner.runner import ModelRunner
from rollout_lab.engine.sched.episodes import EpisodeBatcher
from rollout_lab.measure.models import TINY_FAMILIES, TINY_VOCAB_SIZE

EOS = 2
BLOCK = 16
PAGED = dict(mode="paged", kv_block_size=BLOCK, eos_token_id=EOS, profile=True)


def make_prompts(lengths, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, TINY_VOCAB_SIZE) for _ in range(n)] for n in lengths]


def answer(request, sample, tokens):
    """A deterministic environment: 1-3 tokens, a function of the row and its last token."""
    return [(tokens[-1] * 7 + request * 3 + sample + k) % (TINY_VOCAB_SIZE - 3) + 3
            for k in range(1 + (tokens[-1] + len(tokens)) % 3)]


def frequent_stops(model, prompts, count=3):
    """Stop ids the model makes early on these prompts (its greedy tokens at step 2)."""
    plain = Rollout(model, RolloutConfig(**PAGED)).generate(prompts, max_new_tokens=4)
    return sorted({s[2] for s in plain.sequences if len(s) > 2 and s[2] != EOS})[:count]


def oracle_episode(oracle, model, prompt, *, stops, budget, env, request=0, sample=0, max_turns=None):
    """(tokens, env mask, turns) of one episode: HF greedy generate turn by turn over the history."""
    tokens, mask, turns = [], [], 0
    while True:
        turn = oracle.one(model, prompt + tokens, budget - mask.count(False), [EOS, *stops], 1.0)
        turns += 1
        tokens, mask = tokens + turn, mask + [False] * len(turn)
        if not turn or turn[-1] not in stops or mask.count(False) >= budget or turns == max_turns:
            return tokens, mask, turns
        got = env(request, sample, list(tokens))
        if got is None:
            return tokens, mask, turns
        tokens, mask = tokens + got, mask + [True] * len(got)


@pytest.mark.parametrize("family", one_fast(TINY_FAMILIES, "qwen2"))
def test_episodes_equal_the_turn_by_turn_oracle(family, oracle):
    model = get_tiny(family)
    prompts = make_prompts([20, 5, 33, 12])
    stops = frequent_stops(model, prompts)
    rollout = Rollout(model, RolloutConfig(continuous_batch_size=2, **PAGED))
    out = rollout.generate(prompts, max_new_tokens=24, stop_token_ids=stops, env=answer, max_turns=4,
                           return_logprobs=True)
    calls = 0
    for r, (prompt, request) in enumerate(zip(prompts, out.requests)):
        got = request.outputs[0]
        tokens, mask, turns = oracle_episode(oracle, model, prompt, stops=stops, budget=24, env=answer,
                                             request=r, max_turns=4)
        assert (got.token_ids, got.env_mask, got.num_turns) == (tokens, mask, turns), r
        assert all(lp == 0.0 for lp, env in zip(got.logprobs, got.env_mask) if env)
        assert all(lp < 0.0 for lp, env in zip(got.logprobs, got.env_mask) if not env)
        calls += turns - 1
    profile = out.profile
    assert calls >= 2 and profile.num_env_calls >= calls
    assert profile.env_tokens == sum(sum(s.outputs[0].env_mask) for s in out.requests)
    # nothing before an answer is prefilled again: full blocks from the cache, the partial one kept aside
    assert profile.prefilled_history_tokens == 0
    tensors = out.to_tensors()
    env = torch.zeros_like(tensors["response_mask"])
    for row, request in enumerate(out.requests):
        env[row, : len(request.outputs[0].env_mask)] = torch.tensor(request.outputs[0].env_mask)
    assert torch.equal(tensors["loss_mask"], tensors["response_mask"] & ~env)
    assert env.any()


def test_a_long_history_is_read_from_the_cache(oracle):
    """A history of several full blocks comes back prefilling at most its partial last block."""
    model = get_tiny("qwen2")
    prompt = make_prompts([45], seed=3)[0]
    stop = frequent_stops(model, [prompt], count=1)
    env = lambda r, s, tokens: list(range(40, 60))  # noqa: E731 - 20 tokens: the history grows by blocks
    out = Rollout(model, RolloutConfig(**PAGED)).generate([prompt], max_new_tokens=20, stop_token_ids=stop,
                                                          env=env, max_turns=3, max_env_tokens=40)
    tokens, mask, turns = oracle_episode(oracle, model, prompt, stops=stop, budget=20, env=env, max_turns=3)
    assert out.sequences[0] == tokens and out.num_turns == [turns]
    assert out.profile.num_env_calls == turns - 1 >= 1
    assert out.profile.prefilled_history_tokens == 0


@pytest.mark.slow
def test_episodes_through_preemption_and_eviction(oracle):
    """A pool that preempts rows and takes idle history blocks back: the tokens stay the oracle's."""
    model = get_tiny("llama")
    prompts = make_prompts([20, 5, 33, 12, 18, 9])
    stops = frequent_stops(model, prompts)
    config = RolloutConfig(continuous_batch_size=3, kv_cache_tokens=96, refill_rows=1, **PAGED)
    out = Rollout(model, config).generate(prompts, max_new_tokens=40, stop_token_ids=stops, env=answer,
                                          max_turns=4, max_env_tokens=9)
    for r, prompt in enumerate(prompts):
        tokens, _, _ = oracle_episode(oracle, model, prompt, stops=stops, budget=40, env=answer, request=r,
                                      max_turns=4)
        assert out.sequences[r] == tokens, r
    profile = out.profile
    assert profile.num_env_calls >= 2 and profile.num_preemptions and profile.prefix_cache_evicted_blocks


@pytest.mark.slow
def test_seeded_episodes_draw_the_same_tokens_however_scheduled():
    """Sampling steps go on across turns: one slot or four, a slow or a fast environment, the tokens
    are the same."""
    model = get_tiny("qwen2")
    prompts = make_prompts([9, 17, 4])
    stops = frequent_stops(model, prompts)
    rng = random.Random(0)

    def slow(request, sample, tokens):
        time.sleep(rng.random() * 0.02)
        return answer(request, sample, tokens)

    runs = []
    for slots, env in ((1, answer), (4, slow)):
        rollout = Rollout(model, RolloutConfig(continuous_batch_size=slots, **PAGED))
        runs.append(rollout.generate(prompts, max_new_tokens=16, num_samples=2, do_sample=True, temperature=0.9,
                                     seed=5, stop_token_ids=stops, env=env, max_turns=3, return_logprobs=True))
    assert runs[0].sequences == runs[1].sequences
    assert runs[0].env_masks == runs[1].env_masks
    assert max(runs[0].num_turns) > 1


def test_a_slow_environment_does_not_stop_the_other_rows():
    """Row 0's env call waits until the model has run more forwards: it returns only if the decode
    loop went on without it (else it times out and says so)."""
    model = get_tiny("qwen2")
    prompts = make_prompts([6, 8])
    stop = frequent_stops(model, prompts[:1], count=1)
    forwards = []
    hook = model.register_forward_hook(lambda *args: forwards.append(1))
    waited = {}

    def env(request, sample, tokens):
        if request == 0 and not waited:
            start, deadline = len(forwards), time.monotonic() + 20
            while len(forwards) < start + 5 and time.monotonic() < deadline:
                time.sleep(0.005)
            waited["forwards"] = len(forwards) - start
        return [7]

    sampling = [SamplingParams(temperature=0, stop_token_ids=stop), SamplingParams(temperature=0, max_tokens=40)]
    try:
        out = Rollout(model, RolloutConfig(**PAGED)).generate(prompts, max_new_tokens=12, sampling=sampling, env=env,
                                                              max_turns=2)
    finally:
        hook.remove()
    assert waited["forwards"] >= 5
    assert out.num_turns[0] == 2


def test_max_turns_budgets_and_eos_end_episodes(oracle):
    model = get_tiny("qwen2")
    prompts = make_prompts([20, 5, 33, 12])
    stops = frequent_stops(model, prompts)
    rollout = Rollout(model, RolloutConfig(**PAGED))
    # one turn: the plain call with those stop ids, no env call
    never = lambda r, s, tokens: pytest.fail("max_turns=1 called the environment")  # noqa: E731
    one = rollout.generate(prompts, max_new_tokens=10, stop_token_ids=stops, env=never, max_turns=1)
    plain = rollout.generate(prompts, max_new_tokens=10, stop_token_ids=stops)
    assert one.sequences == plain.sequences and one.num_turns == [1] * 4
    # an env that always answers: the model's tokens stay within the budget, a "length" row spent it
    out = rollout.generate(prompts, max_new_tokens=10, stop_token_ids=stops, env=lambda r, s, t: [5, 6], max_turns=3)
    for tokens, mask, turns, reason in zip(out.sequences, out.env_masks, out.num_turns, out.finish_reasons):
        model_tokens = mask.count(False)
        assert model_tokens <= 10 and turns <= 3 and mask.count(True) == 2 * (turns - 1)
        assert (reason == "length") == (model_tokens == 10 and tokens[-1] not in [EOS, *stops])
    # None ends the episode at once; EOS ends it without a call
    done = rollout.generate(prompts, max_new_tokens=10, stop_token_ids=stops, env=lambda r, s, t: None)
    assert done.sequences == plain.sequences and done.profile.num_env_calls == sum(
        1 for s in plain.sequences if s[-1] in stops)
    eos_only = Rollout(model, RolloutConfig(**(PAGED | dict(eos_token_id=stops[0]))))
    ended = eos_only.generate(prompts, max_new_tokens=10, env=never)
    assert ended.sequences == eos_only.generate(prompts, max_new_tokens=10).sequences


def test_auto_takes_the_paged_route_for_episodes():
    model = get_tiny("qwen2")
    prompts = make_prompts([7, 3])
    out = Rollout(model, RolloutConfig(mode="auto", eos_token_id=EOS)).generate(
        prompts, max_new_tokens=6, stop_token_ids=frequent_stops(model, prompts), env=answer)
    assert out.route == "paged"


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(env="calculator"), TypeError, ["env must be a callable", "'calculator'"]),
    (dict(env=answer, max_turns=0), ValueError, ["max_turns must be an int >= 1", "got 0"]),
    (dict(env=answer, max_turns=2.5), ValueError, ["max_turns", "got 2.5"]),
    (dict(env=answer, max_env_tokens=-1), ValueError, ["max_env_tokens must be an int >= 0", "got -1"]),
    (dict(max_turns=3), ValueError, ["max_turns=3", "pass env="]),
    (dict(env=answer, finish_fraction=0.5), ValueError, ["env=", "finish_fraction="]),
    (dict(env=answer, max_new_tokens=300), ValueError, ["request 0", "max_env_tokens", "context"]),
])
def test_bad_episode_arguments_fail_before_any_work(no_forward, kwargs, error, words):
    call = dict(max_new_tokens=4, stop_token_ids=[5]) | kwargs
    with pytest.raises(error) as caught:
        Rollout(no_forward, RolloutConfig(**PAGED)).generate([[3, 4, 5]], **call)
    for word in words:
        assert word in str(caught.value)


def test_episodes_refuse_other_routes(no_forward):
    with pytest.raises(ValueError, match="env=.*mode='bucketed'.*use mode='paged' or 'auto'"):
        Rollout(no_forward, RolloutConfig(mode="bucketed")).generate([[3, 4]], max_new_tokens=4, env=answer)


@pytest.mark.parametrize("bad, words", [
    ("w5", ["'w5'"]),
    ([1.5], ["[1.5]"]),
    ([TINY_VOCAB_SIZE], [f"[{TINY_VOCAB_SIZE}]", f"[0, {TINY_VOCAB_SIZE})"]),
    ([True], ["[True]"]),
    (list(range(3, 40)), ["37 tokens", "max_env_tokens"]),
])
def test_a_bad_answer_names_the_request_sample_and_value(bad, words):
    model = get_tiny("qwen2")
    prompts = make_prompts([6, 8])
    stops = frequent_stops(model, prompts)

    def env(request, sample, tokens):  # sample 1's answer is fine: the error names sample 0, whichever comes first
        return bad if (request, sample) == (1, 0) else [7]

    with pytest.raises(ValueError) as caught:
        Rollout(model, RolloutConfig(**PAGED)).generate(prompts, max_new_tokens=12, sampling=[
            SamplingParams(temperature=0, max_tokens=12), SamplingParams(temperature=0, stop_token_ids=stops, n=2)], env=env,
            max_env_tokens=20)
    for word in ["request_index=1", "sample_index=0", *words]:
        assert word in str(caught.value)


@pytest.mark.slow
def test_a_stop_string_calls_the_environment_as_its_stop_id_does(tokenizer):
    """The tiny tokenizer's words: "w123" is token 123's text alone, so a stop string of it ends each
    turn where the stop id does; each turn is checked past the last answer, and the episode's text is
    whole."""
    model = get_tiny("qwen2")
    prompts = make_prompts([20, 5, 33, 12])
    stop = next(t for t in frequent_stops(model, prompts, count=9) if t >= 100)
    rollout = Rollout(model, RolloutConfig(**PAGED), tokenizer=tokenizer)
    call = dict(max_new_tokens=16, env=answer, max_turns=3, return_logprobs=True)
    by_string = rollout.generate(prompts, stop=[f"w{stop}"], **call)
    by_id = rollout.generate(prompts, stop_token_ids=[stop], **call)
    assert by_string.sequences == by_id.sequences and by_string.num_turns == by_id.num_turns
    assert by_string.finish_reasons == by_id.finish_reasons and max(by_string.num_turns) > 1
    assert by_string.texts == tokenizer.batch_decode(by_string.sequences, skip_special_tokens=True)


@pytest.mark.slow
def test_trainer_logprobs_are_zero_on_the_environment_tokens():
    model = get_tiny("qwen2")
    prompts = make_prompts([20, 5])
    stops = frequent_stops(model, prompts)
    rollout = Rollout(model, RolloutConfig(**PAGED))
    raw, trainer = (rollout.generate(prompts, max_new_tokens=12, stop_token_ids=stops, env=answer, max_turns=3,
                                     return_logprobs=True, logprobs_mode=mode) for mode in ("raw", "trainer"))
    assert raw.sequences == trainer.sequences and any(any(m) for m in raw.env_masks)
    for mask, lps, want in zip(trainer.env_masks, trainer.logprobs, raw.logprobs):
        assert [lp for lp, env in zip(lps, mask) if env] == [0.0] * sum(mask)
        assert max(abs(a - b) for a, b in zip(lps, want)) < 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("config, num_samples, calls", [
    (dict(admit_tokens_per_step=16, continuous_batch_size=3), 1, 1),  # long histories prefilled across turns
    (dict(prefix_cache=True), 1, 2),  # the second call reads the first's prompts and histories
    (dict(share_prompt_blocks=True), 3, 1),  # samples reading their prompt's blocks leave and come back
])
def test_episodes_equal_the_oracle_under_the_paged_settings(oracle, config, num_samples, calls):
    model = get_tiny("qwen2")
    prompts = make_prompts([20, 5, 33, 12, 40])
    stops = frequent_stops(model, prompts)
    rollout = Rollout(model, RolloutConfig(**config, **PAGED))
    for _ in range(calls):
        out = rollout.generate(prompts, max_new_tokens=24, num_samples=num_samples, stop_token_ids=stops, env=answer,
                               max_turns=4)
        for row, tokens in enumerate(out.sequences):
            r, s = divmod(row, num_samples)
            want, _, _ = oracle_episode(oracle, model, prompts[r], stops=stops, budget=24, env=answer, request=r,
                                        sample=s, max_turns=4)
            assert tokens == want, (r, s)
        assert out.profile.num_env_calls >= 2


# -- answers through the decode step (forced inputs) ------------------------------------------------

def with_forced_inputs(monkeypatch, forced: bool) -> None:
    """Steppers with forced inputs (``StepperKey.forced``) or without (every answer is then
    prefilled), whatever the call asks: the tests pick the answer path."""
    original = ModelRunner.stepper_for.__wrapped__ if hasattr(ModelRunner.stepper_for, "__wrapped__") \
        else ModelRunner.stepper_for

    def stepper_for(self, *args, **kwargs):
        return original(self, *args, **kwargs | {"forced": forced})

    stepper_for.__wrapped__ = original
    monkeypatch.setattr(ModelRunner, "stepper_for", stepper_for)


@pytest.fixture(params=[True])
def forced(request, monkeypatch):
    """``with_forced_inputs`` (param True unless a test asks otherwise)."""
    with_forced_inputs(monkeypatch, request.param)
    return request.param


def burst_spy(monkeypatch):
    """The bursts' rows, split by whether forced inputs gave them tokens: a list of (forced, drawn) counts."""
    bursts = []
    original = EpisodeBatcher._take_burst

    def spy(self, rows, tokens, logprobs):
        forced = sum(1 for row in rows if self._loaded.get(row.index))
        bursts.append((forced, len(rows) - forced))
        return original(self, rows, tokens, logprobs)

    monkeypatch.setattr(EpisodeBatcher, "_take_burst", spy)
    return bursts


def test_answers_enter_through_decode_steps(oracle, forced, monkeypatch):
    """No prefill forward after the fresh prompts': every answer's tokens are decode steps' inputs,
    a forced row decodes beside rows drawing their tokens, and the tokens are the oracle's (the
    environment's with log-probability 0.0)."""
    model = get_tiny("qwen2")
    prompts = make_prompts([20, 5, 33, 12])
    stops = frequent_stops(model, prompts)
    bursts = burst_spy(monkeypatch)
    rollout = Rollout(model, RolloutConfig(**PAGED))
    out = rollout.generate(prompts, max_new_tokens=24, stop_token_ids=stops, env=answer, max_turns=4,
                           return_logprobs=True)
    for r, prompt in enumerate(prompts):
        tokens, mask, turns = oracle_episode(oracle, model, prompt, stops=stops, budget=24, env=answer, request=r,
                                             max_turns=4)
        got = out.requests[r].outputs[0]
        assert (got.token_ids, got.env_mask, got.num_turns) == (tokens, mask, turns), r
        assert [lp for lp, env in zip(got.logprobs, mask) if env] == [0.0] * sum(mask)
    profile = out.profile
    plain = rollout.generate(prompts, max_new_tokens=24, stop_token_ids=stops).profile
    assert profile.num_env_calls >= 2 and profile.env_tokens_decoded == profile.env_tokens > 0
    assert (profile.num_prefill_forwards, profile.num_prefill_rows) == (plain.num_prefill_forwards, len(prompts))
    assert profile.prefilled_history_tokens == 0
    assert any(f and d for f, d in bursts)  # a forced row beside drawing rows in one burst


@pytest.mark.parametrize("forced", [False], indirect=True)
def test_without_forced_inputs_answers_are_prefilled(oracle, forced):
    model = get_tiny("qwen2")
    prompts = make_prompts([20, 5])
    stops = frequent_stops(model, prompts)
    out = Rollout(model, RolloutConfig(**PAGED)).generate(prompts, max_new_tokens=16, stop_token_ids=stops,
                                                          env=answer, max_turns=3)
    for r, prompt in enumerate(prompts):
        tokens, _, _ = oracle_episode(oracle, model, prompt, stops=stops, budget=16, env=answer, request=r,
                                      max_turns=3)
        assert out.sequences[r] == tokens, r
    assert out.profile.env_tokens_decoded == 0 and out.profile.env_tokens > 0
    assert out.profile.prefilled_history_tokens == 0


def test_an_answer_longer_than_the_forced_inputs_is_refilled(oracle, forced, monkeypatch):
    monkeypatch.setattr("rollout_lab.engine.runner.decode.FORCE_WIDTH", 3)
    model = get_tiny("qwen2")
    prompts = make_prompts([20, 5, 12], seed=1)
    stops = frequent_stops(model, prompts)
    env = lambda r, s, tokens: [(tokens[-1] + k) % (TINY_VOCAB_SIZE - 3) + 3 for k in range(8)]  # noqa: E731
    out = Rollout(model, RolloutConfig(continuous_batch_size=2, **PAGED)).generate(
        prompts, max_new_tokens=20, stop_token_ids=stops, env=env, max_turns=3, max_env_tokens=16)
    for r, prompt in enumerate(prompts):
        tokens, mask, _ = oracle_episode(oracle, model, prompt, stops=stops, budget=20, env=env, request=r,
                                         max_turns=3)
        assert (out.sequences[r], out.env_masks[r]) == (tokens, mask), r
    assert out.profile.env_tokens_decoded == out.profile.env_tokens >= 16


def test_an_answer_holding_stop_and_eos_ids_does_not_stop_the_row(oracle, forced):
    """EOS and the stop ids inside an answer (last too) are the environment's tokens: the model's turn
    goes on after them, and only the model's own stop id calls the environment again."""
    model = get_tiny("qwen2")
    prompts = make_prompts([20, 5, 33])
    stops = frequent_stops(model, prompts)
    env = lambda r, s, tokens: [EOS, stops[0], 9, *stops, EOS]  # noqa: E731
    out = Rollout(model, RolloutConfig(**PAGED)).generate(prompts, max_new_tokens=24, stop_token_ids=stops,
                                                          env=env, max_turns=3, max_env_tokens=20)
    for r, prompt in enumerate(prompts):
        tokens, mask, turns = oracle_episode(oracle, model, prompt, stops=stops, budget=24, env=env, request=r,
                                             max_turns=3)
        assert (out.sequences[r], out.env_masks[r], out.num_turns[r]) == (tokens, mask, turns), r
    assert max(out.num_turns) > 1 and out.profile.env_tokens_decoded == out.profile.env_tokens


@pytest.mark.slow
def test_seeded_answers_through_decode_steps_draw_as_prefilled_ones(monkeypatch):
    """Sampling, penalties, a minimum and logprobs: the decode path draws the tokens the prefill path
    does (each row's sampling step goes on across its answer)."""
    model = get_tiny("qwen2")
    prompts = make_prompts([9, 17, 4, 30])
    stops = frequent_stops(model, prompts)
    sampling = [SamplingParams(temperature=0.9, repetition_penalty=1.2, frequency_penalty=0.3, n=2),
                SamplingParams(temperature=0.7, top_k=20, presence_penalty=0.5, n=2),
                SamplingParams(temperature=1.0, top_p=0.9, n=2), SamplingParams(temperature=0.8, min_p=0.05, n=2)]
    runs = []
    for forced in (False, True):
        with_forced_inputs(monkeypatch, forced)
        rollout = Rollout(model, RolloutConfig(continuous_batch_size=3, **PAGED))
        runs.append(rollout.generate(prompts, max_new_tokens=20, sampling=sampling, seed=5, stop_token_ids=stops,
                                     env=answer, max_turns=4, return_logprobs=True, min_new_tokens=3))
    prefilled, decoded = runs
    assert decoded.sequences == prefilled.sequences and decoded.env_masks == prefilled.env_masks
    assert decoded.profile.env_tokens_decoded == decoded.profile.env_tokens > 0
    assert prefilled.profile.env_tokens_decoded == 0 and max(decoded.num_turns) > 1
    for a, b in zip(decoded.logprobs, prefilled.logprobs):
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4


def test_a_row_preempted_in_the_middle_of_its_answer_resumes_with_all_of_it(oracle, forced, monkeypatch):
    """The pool preempts the newest row once, while forced inputs feed its answer: it comes back with
    its whole answer prefilled, and its tokens are the oracle's."""
    monkeypatch.setattr("rollout_lab.engine.runner.decode.FORCE_WIDTH", 2)
    model = get_tiny("qwen2")
    prompts = make_prompts([20, 5, 33])
    stops = frequent_stops(model, prompts)
    env = lambda r, s, tokens: [(tokens[-1] + 5 * k) % (TINY_VOCAB_SIZE - 3) + 3 for k in range(6)]  # noqa: E731
    preempted = []
    original = EpisodeBatcher._reserve

    def reserve(self, burst):
        newest = max(self.rows, key=lambda row: self.admitted_order[row.index])
        if not preempted and len(self.rows) > 1 and newest.index in self._loaded:
            self._preempt()
            preempted.append(len(newest.tokens) - newest.env_spans[-1][0])  # its answer's tokens, once back
        return original(self, burst)

    monkeypatch.setattr(EpisodeBatcher, "_reserve", reserve)
    out = Rollout(model, RolloutConfig(**PAGED)).generate(prompts, max_new_tokens=20, stop_token_ids=stops, env=env,
                                                          max_turns=3, max_env_tokens=12)
    for r, prompt in enumerate(prompts):
        tokens, mask, _ = oracle_episode(oracle, model, prompt, stops=stops, budget=20, env=env, request=r,
                                         max_turns=3)
        assert (out.sequences[r], out.env_masks[r]) == (tokens, mask), r
    assert preempted == [6] and out.profile.num_preemptions == 1
    assert 0 < out.profile.env_tokens_decoded < out.profile.env_tokens
