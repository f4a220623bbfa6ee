"""Stop ids and stop strings (vLLM's ``stop_token_ids`` and ``stop``): every route ends a row where the
one-request oracle's tokens first hold a stop id or, decoded, a stop string; bad values are one
ValueError before any forward."""
from __future__ import annotations

import random

import pytest
import torch
from conftest import CharTokenizer, get_tiny, one_fast

from rollout_lab import Rollout, RolloutConfig
from rollout_lab.engine.sample.stopping import StopStrings
from rollout_lab.measure.models import TINY_FAMILIES, TINY_VOCAB_SIZE
from rollout_lab.planner.cost import CostCoefficients

ROUTES = ("nocb", "equal_width", "aligned", "bucketed", "packed", "paged", "auto")
SPLIT_COSTS = CostCoefficients(prefill_fixed_cost_ms=0.05, continuous_decode_cost_ms=0.0)
_rng = random.Random(0)
PROMPTS = [[_rng.randrange(1, TINY_VOCAB_SIZE) for _ in range(n)] for n in (5, 1, 9, 3, 12, 2, 7, 4)]
STOPS = (["b#", "a\n"], ["##", "\n\n"])


def rollout(model, mode, slots=None, tokenizer=None, **config) -> Rollout:
    config = RolloutConfig(mode=mode, continuous_batch_size=slots, costs=SPLIT_COSTS, **config)
    return Rollout(model, config, tokenizer=tokenizer)


# every route at once, and the continuous-batching ones on 3 slots (rows retire and refill); each test
# keeps one (route, slots) case and one family in make test-fast, a different one per test
ROUTES_AND_SLOTS = [(mode, None) for mode in ROUTES] + [(mode, 3) for mode in ROUTES[1:]]


def cut_at_stop(tokens, stops, tokenizer):
    """Brute force: the shortest prefix whose text holds a stop string, else all the tokens."""
    for t in range(1, len(tokens) + 1):
        if any(s in tokenizer.decode(tokens[:t], skip_special_tokens=True) for s in stops):
            return tokens[:t]
    return tokens


def text_before_stop(tokens, stops, tokenizer):
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    return text[: min((text.find(s) for s in stops if s in text), default=len(text))]


@pytest.mark.parametrize("family", one_fast(TINY_FAMILIES, "qwen2"))
@pytest.mark.parametrize("mode, slots", one_fast(ROUTES_AND_SLOTS, ("paged", 3)))
def test_stop_token_ids_end_rows_on_every_route(family, mode, slots, oracle):
    model = get_tiny(family)
    free = oracle(model, PROMPTS, max_new_tokens=10)
    eos, stop_ids = free[1][2], [free[0][3], free[2][1]]
    expected = oracle(model, PROMPTS, max_new_tokens=10, eos_token_id=[eos, *stop_ids])
    assert expected != free
    reasons = ["stop" if s[-1] in {eos, *stop_ids} else "length" for s in expected]
    result = rollout(model, mode, slots, eos_token_id=eos).generate(
        PROMPTS, max_new_tokens=10, stop_token_ids=stop_ids)
    assert result.sequences == expected
    assert result.finish_reasons == reasons
    # ignore_eos drops EOS, not the call's stop ids (and without EOS the batcher would burst)
    result = rollout(model, mode, slots, ignore_eos=True).generate(PROMPTS, max_new_tokens=10, stop_token_ids=stop_ids)
    assert result.sequences == oracle(model, PROMPTS, max_new_tokens=10, eos_token_id=stop_ids)


@pytest.mark.parametrize("family", one_fast(TINY_FAMILIES, "llama"))
@pytest.mark.parametrize("stops", one_fast(STOPS, STOPS[1]))
@pytest.mark.parametrize("mode, slots", one_fast(ROUTES_AND_SLOTS, ("bucketed", 3)))
def test_stop_strings_cut_rows_where_the_oracle_text_first_holds_one(family, stops, mode, slots, oracle):
    model, tokenizer = get_tiny(family), CharTokenizer()
    free = oracle(model, PROMPTS, max_new_tokens=12)
    expected = [cut_at_stop(tokens, stops, tokenizer) for tokens in free]
    assert expected != free  # some rows stop (with STOPS[0] others run their budget)
    texts = [text_before_stop(e, stops, tokenizer) for e in expected]
    reasons = ["stop" if any(s in tokenizer.decode(e, skip_special_tokens=True) for s in stops) else "length"
               for e in expected]
    engine = rollout(model, mode, slots, tokenizer=tokenizer)
    result = engine.generate(PROMPTS, max_new_tokens=12, stop=stops, return_logprobs=True)
    assert result.sequences == expected
    assert result.texts == texts and result.finish_reasons == reasons
    unstopped = engine.generate(PROMPTS, max_new_tokens=12, return_logprobs=True).logprobs
    for got, full in zip(result.logprobs, unstopped):  # trimmed with the tokens
        assert got == pytest.approx(full[: len(got)], abs=1e-5)


@pytest.mark.parametrize("mode, slots", one_fast(ROUTES_AND_SLOTS, ("aligned", None)))
def test_sampled_rows_stop_where_their_unstopped_tokens_first_hold_a_stop_string(mode, slots):
    model, tokenizer, stops = get_tiny("llama"), CharTokenizer(), STOPS[0]
    call = dict(max_new_tokens=12, do_sample=True, seed=7, num_samples=3)
    free = rollout(model, "bucketed").generate(PROMPTS, **call).sequences
    expected = [cut_at_stop(tokens, stops, tokenizer) for tokens in free]
    assert expected != free
    result = rollout(model, mode, slots, tokenizer=tokenizer).generate(PROMPTS, stop=stops, **call)
    assert result.sequences == expected


@pytest.mark.slow  # three routes and the oracle
def test_stop_strings_and_ids_together_with_a_real_tokenizer(tokenizer, oracle):
    """An HF fast tokenizer ("w0", "w1", ...; "w2" special); a stop id and a stop string in one call."""
    model = get_tiny("qwen2")
    free = oracle(model, PROMPTS, max_new_tokens=10)
    stop_id, stop = free[0][4], [f" w{free[3][2]} "]
    expected = [cut_at_stop(tokens, stop, tokenizer) for tokens in oracle(
        model, PROMPTS, max_new_tokens=10, eos_token_id=[stop_id])]
    assert sum(len(e) < 10 for e in expected) > sum(len(e) < 10 for e in oracle(
        model, PROMPTS, max_new_tokens=10, eos_token_id=[stop_id]))  # the string stops rows the id does not
    for mode in ("nocb", "bucketed", "paged"):
        result = rollout(model, mode, tokenizer=tokenizer).generate(PROMPTS, max_new_tokens=10, stop=stop,
                                                                    stop_token_ids=[stop_id])
        assert result.sequences == expected, mode
        assert result.texts == [text_before_stop(e, stop, tokenizer) for e in expected]


def test_a_stop_string_is_confirmed_on_the_whole_text():
    """A tail that decodes to a stop string the whole text does not hold is no hit."""

    class LeadingSpace(CharTokenizer):  # like sentencepiece: a text's first "a" decodes as "#"
        def decode(self, ids, skip_special_tokens=False):
            text = super().decode(ids, skip_special_tokens)
            return "#" + text[1:] if text.startswith("a") else text

    stops = StopStrings(("##",), LeadingSpace())
    row = [1] * 5 + [7, 2] + [1] * 8  # "bbbbba#bbbbbbbb"; its last 10 tokens decode to "##bbbbbbbb"
    assert stops.hits([row, [7, 2]]) == [False, True]  # "a#" as a whole text decodes to "##"
    assert stops.cut("xx##y") == "xx" and stops.cut("xy") == "xy"


@pytest.mark.parametrize("kwargs, message", [
    (dict(stop="###"), r"stop must be a list of non-empty strings or None, got '###'"),
    (dict(stop=["a", 3]), r"stop must be a list of non-empty strings or None, got \['a', 3\]"),
    (dict(stop=[""]), "stop must be a list of non-empty strings"),
    (dict(stop_token_ids=[TINY_VOCAB_SIZE]), rf"stop_token_ids must hold ids in the vocabulary \[0, {TINY_VOCAB_SIZE}\), "
                                             rf"got {TINY_VOCAB_SIZE} in"),
    (dict(stop_token_ids=[3, -1]), r"got -1 in \[3, -1\]"),
    (dict(stop_token_ids=[True]), "stop_token_ids must hold ids in the vocabulary"),
    (dict(stop_token_ids=[2.0]), "stop_token_ids must hold ids in the vocabulary"),
    (dict(stop_token_ids=5), "stop_token_ids must be a list of token ids or None, got 5"),
    (dict(stop_token_ids="5"), "stop_token_ids must be a list of token ids or None"),
])
def test_bad_stop_values_fail_before_any_forward(no_forward, kwargs, message):
    with pytest.raises(ValueError, match=message):
        Rollout(no_forward, tokenizer=CharTokenizer()).generate([[1, 2]], max_new_tokens=2, **kwargs)


def test_stop_strings_need_a_tokenizer(no_forward):
    with pytest.raises(ValueError, match=r"stop=\['###'\] needs a tokenizer"):
        Rollout(no_forward).generate([[1, 2]], max_new_tokens=2, stop=["###"])
    Rollout(get_tiny("llama")).generate([[1, 2]], max_new_tokens=2, stop=[])  # no stop strings: no tokenizer needed


# -- min_new_tokens ------------------------------------------------------------------------------
def masked_logprobs(model, prompts, sequences, stop_ids, minimums):
    """Teacher-forced "processed" logprobs: each step's log-softmax with the stop ids at -inf
    before the row's minimum (HF's MinNewTokensLengthLogitsProcessor), one request at a time."""
    out = []
    with torch.no_grad():
        for prompt, seq, minimum in zip(prompts, sequences, minimums):
            logits = model(input_ids=torch.tensor([prompt + seq[:-1]])).logits[0, len(prompt) - 1:].float()
            logits[:minimum, stop_ids] = float("-inf")
            out.append(torch.log_softmax(logits, -1).gather(1, torch.tensor(seq)[:, None])[:, 0].tolist())
    return out


@pytest.mark.parametrize("family", one_fast(TINY_FAMILIES, "opt"))
@pytest.mark.parametrize("mode, slots", one_fast(ROUTES_AND_SLOTS, ("nocb", None)))
def test_min_new_tokens_hold_eos_and_stop_ids_back_on_every_route(family, mode, slots, oracle):
    """Before a row has min_new_tokens tokens its EOS and stop ids cannot be chosen, the first one
    (from the prefill logits) included: HF generate(min_new_tokens=N), one request at a time."""
    model = get_tiny(family)
    free = oracle(model, PROMPTS, max_new_tokens=10)
    common = max(range(TINY_VOCAB_SIZE), key=lambda t: sum(t in s[3:] for s in free))  # ends rows later
    eos, stop_ids = free[1][0], [free[5][0], common]  # rows 1 and 5 would stop on their first token
    ids = [eos, *stop_ids]
    early = oracle(model, PROMPTS, max_new_tokens=10, eos_token_id=ids)
    minimums = [3, 1, 0, 4, 2, 10, 3, 5]
    expected = oracle(model, PROMPTS, max_new_tokens=10, eos_token_id=ids, min_new_tokens=minimums)
    assert len(early[1]) == 1 and len(expected[1]) > 1 and len(expected[5]) == 10
    assert all(len(e) > m or len(e) == 10 for e, m in zip(expected, minimums))
    assert any(len(e) < 10 for e in expected)  # the ids still stop rows past their minimum
    uniform = oracle(model, PROMPTS, max_new_tokens=10, eos_token_id=ids, min_new_tokens=7)
    assert uniform != early
    reasons = ["stop" if s[-1] in ids else "length" for s in expected]
    engine = rollout(model, mode, slots, eos_token_id=eos)
    result = engine.generate(PROMPTS, max_new_tokens=10, stop_token_ids=stop_ids, min_new_tokens=minimums,
                             return_logprobs=True, logprobs_mode="processed")
    assert result.sequences == expected
    assert result.finish_reasons == reasons
    want = masked_logprobs(model, PROMPTS, expected, ids, minimums)
    assert max(abs(a - b) for g, w in zip(result.logprobs, want) for a, b in zip(g, w)) < 1e-5
    assert engine.generate(PROMPTS, max_new_tokens=10, stop_token_ids=stop_ids, min_new_tokens=7).sequences == uniform


@pytest.mark.slow  # 8 rows of 30 tokens through the one-request oracle, three times
def test_min_new_tokens_through_preemption_and_a_generation_config(oracle):
    """The paged route's preempted rows resume with their minimum; a GenerationConfig's
    min_new_tokens is the call's."""
    from transformers import GenerationConfig

    model = get_tiny("qwen2")
    prompts = [[_rng.randrange(1, TINY_VOCAB_SIZE) for _ in range(n)] for n in (7, 2, 15, 1, 9, 4, 11, 20)]
    free = oracle(model, prompts, max_new_tokens=30)
    eos = max(range(1, TINY_VOCAB_SIZE), key=lambda t: sum(t in s[:12] for s in free))
    minimums = [12, 0, 20, 6, 15, 30, 9, 3]
    expected = oracle(model, prompts, max_new_tokens=30, eos_token_id=eos, min_new_tokens=minimums)
    assert expected != oracle(model, prompts, max_new_tokens=30, eos_token_id=eos)
    tight = rollout(model, "paged", 3, eos_token_id=eos, kv_block_size=16, kv_cache_tokens=64, refill_rows=1,
                    profile=True).generate(prompts, max_new_tokens=30, min_new_tokens=minimums)
    assert tight.sequences == expected and tight.profile.num_preemptions > 0
    config = GenerationConfig(max_new_tokens=30, min_new_tokens=12)
    got = rollout(model, "bucketed", 3, eos_token_id=eos).generate(prompts, generation_config=config)
    assert got.sequences == oracle(model, prompts, max_new_tokens=30, eos_token_id=eos, min_new_tokens=12)
    with pytest.raises(ValueError, match="min_new_tokens is set twice"):
        rollout(model, "bucketed").generate(prompts, generation_config=config, min_new_tokens=3)


def cut_after_minimum(tokens, stops, tokenizer, minimum):
    """Brute force: the shortest prefix of at least ``minimum`` tokens whose text holds a stop string
    ending past the text of the first ``minimum - 1`` tokens; the text before that string."""
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    floor = len(decode(tokens[: minimum - 1])) if minimum > 1 else 0
    for t in range(max(1, minimum), len(tokens) + 1):
        text = decode(tokens[:t])
        starts = [i for s in stops for i in range(len(text)) if text.startswith(s, i) and i + len(s) > floor]
        if starts:
            return tokens[:t], text[: min(starts)]
    return tokens, decode(tokens)


@pytest.mark.parametrize("family", one_fast(TINY_FAMILIES, "qwen3"))
@pytest.mark.parametrize("mode, slots", one_fast(ROUTES_AND_SLOTS, ("packed", 3)))
def test_min_new_tokens_hold_stop_strings_back(family, mode, slots, oracle):
    model, tokenizer, stops = get_tiny(family), CharTokenizer(), STOPS[0]
    free = oracle(model, PROMPTS, max_new_tokens=12)
    unheld = [cut_at_stop(tokens, stops, tokenizer) for tokens in free]
    # past the first stop of every other row that has one: it goes on to a later one or its budget
    minimums = [len(u) + 1 if i % 2 == 0 and len(u) < 12 else i for i, u in enumerate(unheld)]
    expected = [cut_after_minimum(tokens, stops, tokenizer, m) for tokens, m in zip(free, minimums)]
    assert [e[0] for e in expected] != unheld
    reasons = ["length" if len(tokens) == 12 and text == tokenizer.decode(tokens, skip_special_tokens=True)
               else "stop" for tokens, text in expected]
    assert "stop" in reasons
    result = rollout(model, mode, slots, tokenizer=tokenizer).generate(
        PROMPTS, max_new_tokens=12, stop=stops, min_new_tokens=minimums)
    assert result.sequences == [e[0] for e in expected]
    assert result.texts == [e[1] for e in expected] and result.finish_reasons == reasons
