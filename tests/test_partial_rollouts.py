"""Partial rollouts on the paged route (issue 55): ``generate(..., finish_fraction=f)`` returns once
enough rows finished, the others as ``result.unfinished`` continuations; a later call continues them
to the tokens (and logprobs) of one uninterrupted call, budgets counting their earlier tokens, beside
new prompts; every bad input is refused before any work (tiny fp32 models, CPU)."""
from __future__ import annotations

import dataclasses
import math
import random
import re

import pytest
import torch
from conftest import get_tiny

from rollout_lab import Rollout, RolloutConfig, SamplingParams
from rollout_lab.engine.sched.request import Continuation
from rollout_lab.measure.models import TINY_VOCAB_SIZE

PAGED = dict(mode="paged", kv_block_size=16, profile=True)
# 3 slots and a pool of 4 blocks of 16: rows of 10-21 + 24 tokens wait, grow, are preempted and prefilled across turns
TIGHT = dict(PAGED, continuous_batch_size=3, kv_cache_tokens=64, refill_rows=1, admit_tokens_per_step=12)
BUDGET = 24
SAMPLED = dict(do_sample=True, temperature=0.9, top_k=40, seed=5, return_logprobs=True)


def make_prompts(count: int, seed: int = 0, lengths: tuple[int, int] = (2, 14)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, TINY_VOCAB_SIZE) for _ in range(rng.randrange(*lengths))] for _ in range(count)]


def eos_of(model, prompts, config=PAGED, **generate) -> int:
    """A token that many rows reach in their first half: rows end at many lengths."""
    free = Rollout(model, RolloutConfig(**config)).generate(prompts, max_new_tokens=BUDGET, **generate).sequences
    generate.pop("return_logprobs", None)
    return max(range(1, TINY_VOCAB_SIZE), key=lambda t: sum(t in s[: BUDGET // 2] for s in free))


def continued(rollout: Rollout, prompts, fractions, **generate):
    """The first call over ``prompts`` with ``fractions[0]``, then calls of its unfinished rows with
    the next fractions (None: to the end) until none is left; per row of the first call, its final
    tokens, logprobs and segments, and the results."""
    result = rollout.generate(prompts, finish_fraction=fractions[0], **generate)
    results = [result]
    final = {i: (s, lp, seg) for i, (s, lp, seg, reason) in enumerate(
        zip(result.sequences, result.logprobs or [None] * len(result.sequences), result.segments,
            result.finish_reasons)) if reason != "unfinished"}
    rows = [i for i, reason in enumerate(result.finish_reasons) if reason == "unfinished"]
    for fraction in fractions[1:]:
        if not result.unfinished:
            break
        call = {k: v for k, v in generate.items() if k in ("max_new_tokens", "return_logprobs")}
        result = rollout.generate(result.unfinished, finish_fraction=fraction, **call)
        results.append(result)
        assert len(result.sequences) == len(rows)  # a continuation is one row
        left = []
        for j, row in enumerate(rows):
            if result.finish_reasons[j] == "unfinished":
                left.append(row)
            else:
                final[row] = (result.sequences[j], None if result.logprobs is None else result.logprobs[j],
                              result.segments[j])
        rows = left
    assert not rows, "the last call runs every row to its end"
    return [final[i] for i in range(len(final))], results


def assert_logprobs_close(got, want):
    assert len(got) == len(want)
    worst = max((abs(a - b) for g, w in zip(got, want) for a, b in zip(g, w)), default=0.0)
    assert worst < 1e-4, worst  # recompute of the KV: fp32 rounding, as a preempted row's


def test_finish_fraction_returns_once_enough_rows_finished():
    model = get_tiny("qwen2")
    prompts = make_prompts(8)
    eos = eos_of(model, prompts, **SAMPLED)
    config = RolloutConfig(**PAGED, eos_token_id=eos)
    full = Rollout(model, config).generate(prompts, max_new_tokens=BUDGET, **SAMPLED)
    assert len(set(map(len, full.sequences))) >= 4
    part = Rollout(model, config).generate(prompts, max_new_tokens=BUDGET, finish_fraction=0.5, **SAMPLED)
    finished = [i for i, reason in enumerate(part.finish_reasons) if reason != "unfinished"]
    assert len(finished) >= math.ceil(0.5 * 8) and len(part.unfinished) == 8 - len(finished) > 0
    assert part.profile.num_unfinished_rows == len(part.unfinished)
    assert part.profile.num_decode_forwards < full.profile.num_decode_forwards  # it returned early
    for i in finished:  # a finished row is the full call's
        assert part.sequences[i] == full.sequences[i] and part.finish_reasons[i] == full.finish_reasons[i]
    unfinished_rows = [i for i in range(8) if i not in finished]
    for continuation, i in zip(part.unfinished, unfinished_rows):
        assert isinstance(continuation, Continuation)
        assert list(continuation.prompt_token_ids) == prompts[i] and (continuation.request, continuation.sample) == (i, 0)
        assert list(continuation.token_ids) == part.sequences[i] == full.sequences[i][: len(part.sequences[i])]
        assert list(continuation.logprobs) == part.logprobs[i]
        assert continuation.num_steps == len(part.sequences[i]) < BUDGET and continuation.params.max_tokens == BUDGET
        assert continuation.segments == ((0, continuation.num_steps),) and continuation.key != 0
        assert part.requests[i].outputs[0].finish_reason == "unfinished"


@pytest.mark.parametrize("fractions, config", [
    ((0.3, None), PAGED),
    pytest.param((0.25, 0.5, None), TIGHT, marks=pytest.mark.slow),
    pytest.param((0.2, 0.3, 0.5, None), PAGED, marks=pytest.mark.slow),
])
def test_continuing_gives_the_uninterrupted_calls_tokens(fractions, config):
    """Seeded sampling with EOS, two samples per prompt and the repetition penalty: rows continued
    over 1-3 later calls draw the tokens and logprobs of one call (the tight pool preempts and
    prefills across turns as they resume)."""
    model = get_tiny("qwen2")
    prompts = make_prompts(6, seed=1, lengths=(10, 22) if config is TIGHT else (2, 14))
    eos = eos_of(model, prompts, dict(PAGED, repetition_penalty=1.3), num_samples=2, **SAMPLED)
    cfg = RolloutConfig(**config, eos_token_id=eos, repetition_penalty=1.3)
    generate = dict(max_new_tokens=BUDGET, num_samples=2, **SAMPLED)
    full = Rollout(model, cfg).generate(prompts, **generate)
    got, results = continued(Rollout(model, cfg), prompts, fractions, **generate)
    # a row never admitted comes back without tokens and starts afresh with its own key
    assert len(results) >= 2
    assert results[1].profile.num_continued_rows == sum(c.num_steps > 0 for c in results[0].unfinished)
    assert [s for s, _, _ in got] == full.sequences
    assert_logprobs_close([lp for _, lp, _ in got], full.logprobs)
    for (tokens, _, segments), reason in zip(got, full.finish_reasons):
        assert sum(n for _, n in segments) == len(tokens)
        assert [c for c, _ in segments] == sorted({c for c, _ in segments})  # earlier calls first
    assert any(len(segments) > 1 for _, _, segments in got)
    if config is TIGHT:
        assert sum(r.profile.num_preemptions for r in results) > 0


def test_continuing_greedy_rows():
    model = get_tiny("opt")
    prompts = make_prompts(6, seed=2)
    eos = eos_of(model, prompts)
    cfg = RolloutConfig(**PAGED, eos_token_id=eos)
    full = Rollout(model, cfg).generate(prompts, max_new_tokens=BUDGET, return_logprobs=True)
    got, _ = continued(Rollout(model, cfg), prompts, (0.4, None), max_new_tokens=BUDGET, return_logprobs=True)
    assert [s for s, _, _ in got] == full.sequences
    assert_logprobs_close([lp for _, lp, _ in got], full.logprobs)


def test_budgets_count_the_earlier_tokens():
    model = get_tiny("qwen2")
    prompts = make_prompts(6, seed=3)
    eos = eos_of(model, prompts, **SAMPLED)
    cfg = RolloutConfig(**PAGED, eos_token_id=eos)
    rollout = Rollout(model, cfg)
    part = rollout.generate(prompts, max_new_tokens=BUDGET, finish_fraction=0.3, **SAMPLED)
    assert part.unfinished
    have = [c.num_steps for c in part.unfinished]
    budgets = [n + 3 for n in have]  # three more tokens each, at most
    more = rollout.generate(part.unfinished, max_new_tokens=budgets, return_logprobs=True)
    # an uninterrupted call of these rows at those budgets: the same tokens (the budget draws nothing)
    rows = [i for i, reason in enumerate(part.finish_reasons) if reason == "unfinished"]
    per_row = [BUDGET] * len(prompts)
    for i, budget in zip(rows, budgets):
        per_row[i] = budget
    want = Rollout(model, cfg).generate(prompts, max_new_tokens=per_row, **SAMPLED)
    assert more.sequences == [want.sequences[i] for i in rows]
    assert more.finish_reasons == [want.finish_reasons[i] for i in rows]
    assert all(len(s) <= b for s, b in zip(more.sequences, budgets))
    assert more.profile.num_generated_tokens == sum(map(len, more.sequences)) - sum(have)
    assert more.profile.num_continued_tokens == sum(have)
    # a sampling entry may give a continuation its budget alone
    again = rollout.generate(part.unfinished, sampling=[SamplingParams(max_tokens=b) for b in budgets])
    assert again.sequences == more.sequences


@pytest.mark.slow  # about 1 s on 2 CPU cores
def test_new_prompts_beside_continuations():
    model = get_tiny("qwen2")
    prompts, fresh = make_prompts(6, seed=4), make_prompts(3, seed=5)
    eos = eos_of(model, prompts, **SAMPLED)
    cfg = RolloutConfig(**PAGED, eos_token_id=eos)
    full = Rollout(model, cfg).generate(prompts, max_new_tokens=BUDGET, **SAMPLED)
    fresh_alone = Rollout(model, cfg).generate(fresh, max_new_tokens=BUDGET, num_samples=2, **dict(SAMPLED, seed=9))
    rollout = Rollout(model, cfg)
    part = rollout.generate(prompts, max_new_tokens=BUDGET, finish_fraction=0.5, **SAMPLED)
    rows = [i for i, reason in enumerate(part.finish_reasons) if reason == "unfinished"]
    # new prompts first (their keys are their indices in this call), num_samples=2: a continuation is one row
    mixed = rollout.generate([*fresh, *part.unfinished], max_new_tokens=BUDGET, num_samples=2, **dict(SAMPLED, seed=9))
    assert mixed.samples == [2] * len(fresh) + [1] * len(rows)
    assert mixed.sequences[: 2 * len(fresh)] == fresh_alone.sequences
    assert mixed.sequences[2 * len(fresh):] == [full.sequences[i] for i in rows]
    assert mixed.segments[: 2 * len(fresh)] == [((1, len(s)),) for s in fresh_alone.sequences]
    for segments, i in zip(mixed.segments[2 * len(fresh):], rows):
        assert segments[0] == (0, len(part.sequences[i])) and sum(n for _, n in segments) == len(full.sequences[i])
    assert [o.segments for q in mixed.requests for o in q.outputs] == mixed.segments
    assert mixed.prompt_token_ids[len(fresh):] == [prompts[i] for i in rows]
    assert mixed.to_tensors()["response_ids"].shape[0] == len(mixed.sequences)


@pytest.mark.slow  # about 1 s on 2 CPU cores
def test_interleaved_continuations_with_a_shared_prompt():
    """Greedy: continuations between new prompts, one of them the continuation's own prompt (its
    row resumes and shares no prefill with the new one)."""
    model = get_tiny("qwen2")
    prompts = make_prompts(5, seed=6)
    eos = eos_of(model, prompts)
    cfg = RolloutConfig(**PAGED, eos_token_id=eos)
    full = Rollout(model, cfg).generate(prompts, max_new_tokens=BUDGET)
    rollout = Rollout(model, cfg)
    part = rollout.generate(prompts, max_new_tokens=BUDGET, finish_fraction=0.2)
    first = part.unfinished[0]
    row = first.request
    mixed = rollout.generate([prompts[row], first, [5, 6, 7], *part.unfinished[1:]], max_new_tokens=BUDGET)
    assert mixed.sequences[0] == mixed.sequences[1] == full.sequences[row]
    assert mixed.profile.num_continued_rows == len(part.unfinished)
    # mode="auto" takes the paged route for both; finish_fraction=1 waits for every row
    auto = Rollout(model, RolloutConfig(eos_token_id=eos))
    assert auto.generate(part.unfinished, max_new_tokens=BUDGET).route == "paged"
    whole = auto.generate(prompts, max_new_tokens=BUDGET, finish_fraction=1)
    assert whole.route == "paged" and whole.sequences == full.sequences and whole.unfinished == []


@pytest.fixture
def made():
    """(model, a continuation made on it with logprobs, the config it was made with)."""
    model = get_tiny("qwen2")
    prompts = make_prompts(6, seed=7)
    eos = eos_of(model, prompts, **SAMPLED)
    cfg = RolloutConfig(**PAGED, eos_token_id=eos)
    part = Rollout(model, cfg).generate(prompts, max_new_tokens=BUDGET, finish_fraction=0.2, **SAMPLED)
    return model, part.unfinished[0], cfg


def test_bad_inputs_are_refused_before_any_work(made, monkeypatch):
    model, continuation, cfg = made
    monkeypatch.setattr(model, "forward", lambda *a, **k: pytest.fail("a forward ran despite bad input"))
    rollout = Rollout(model, cfg)
    for bad in (0, 0.0, -0.5, 1.5, True, "0.5", float("nan"), [0.5]):
        with pytest.raises(ValueError, match=r"finish_fraction must be a number in \(0, 1\].*got " + re.escape(repr(bad))):
            rollout.generate([[1, 2]], max_new_tokens=4, finish_fraction=bad)
    for mode in ("bucketed", "nocb", "aligned"):
        other = Rollout(model, dataclasses.replace(cfg, mode=mode))
        with pytest.raises(ValueError, match=f"finish_fraction needs the paged route.*mode='{mode}'"):
            other.generate([[1, 2]], max_new_tokens=4, finish_fraction=0.5)
        with pytest.raises(ValueError, match=f"continuations needs the paged route.*mode='{mode}'"):
            other.generate([continuation], max_new_tokens=BUDGET)
    aligned = Rollout(model, dataclasses.replace(cfg, mode="auto", trim_cache=True))
    with pytest.raises(ValueError, match="finish_fraction needs the paged route.*trim_cache"):
        aligned.generate([[1, 2]], max_new_tokens=4, finish_fraction=0.5)
    have = continuation.num_steps
    for budget in (have, have - 1):
        with pytest.raises(ValueError, match=f"holds {have} tokens, and max_new_tokens={budget}.*more than {have}"):
            rollout.generate([continuation], max_new_tokens=budget)
    minimum = dataclasses.replace(continuation, params=dataclasses.replace(continuation.params, min_tokens=have + 5,
                                                                                      max_tokens=have + 5))
    with pytest.raises(ValueError, match=f"has min_tokens={have + 5}, more than max_new_tokens={have + 2}"):
        rollout.generate([minimum], max_new_tokens=have + 2)
    length = len(continuation.prompt_token_ids)
    with pytest.raises(ValueError, match=f"request 1: prompt length {length} \\+ max_new_tokens 10000 exceeds"):
        rollout.generate([[1, 2], continuation], max_new_tokens=[4, 10_000])
    other_model = dataclasses.replace(continuation, model_type="llama")
    with pytest.raises(ValueError, match="model_type='llama'.*model_type='qwen2'"):
        rollout.generate([other_model], max_new_tokens=BUDGET)
    other_vocab = dataclasses.replace(continuation, vocab_size=continuation.vocab_size + 1)
    with pytest.raises(ValueError, match=f"vocabulary of {continuation.vocab_size + 1}"):
        rollout.generate([other_vocab], max_new_tokens=BUDGET)
    with pytest.raises(ValueError, match=r"sampling\[0\]=.*sets more than max_tokens"):
        rollout.generate([continuation], sampling=[SamplingParams(max_tokens=40, temperature=0.5)])
    with pytest.raises(ValueError, match="carries 'raw' logprobs.*logprobs_mode='processed'"):
        rollout.generate([continuation], max_new_tokens=BUDGET, return_logprobs=True, logprobs_mode="processed")
    without = dataclasses.replace(continuation, logprobs=None, logprobs_mode=None)
    with pytest.raises(ValueError, match="carries no logprobs.*logprobs_mode='raw'"):
        rollout.generate([without], max_new_tokens=BUDGET, return_logprobs=True)
    with pytest.raises(ValueError, match="give no attention_mask"):
        rollout.generate([continuation], attention_mask=[[1, 1]], max_new_tokens=BUDGET)


@pytest.mark.slow  # about 1 s on 2 CPU cores
def test_a_continuation_keeps_its_stop_strings(tokenizer):
    """Rows that end at a stop string (its tokenizer's text) continue to the tokens and texts of one
    call: the continuation carries the rule of the call that made it."""
    model = get_tiny("qwen2")
    prompts = make_prompts(6, seed=8)
    free = Rollout(model, RolloutConfig(**PAGED, ignore_eos=True)).generate(prompts, max_new_tokens=BUDGET, **SAMPLED)
    often = max(range(3, TINY_VOCAB_SIZE), key=lambda t: sum(t in s[: BUDGET // 2] for s in free.sequences))
    cfg = RolloutConfig(**PAGED, ignore_eos=True)
    generate = dict(max_new_tokens=BUDGET, stop=[f"w{often}"], **SAMPLED)
    full = Rollout(model, cfg, tokenizer=tokenizer).generate(prompts, **generate)
    assert "stop" in full.finish_reasons and "length" in full.finish_reasons
    rollout = Rollout(model, cfg, tokenizer=tokenizer)
    part = rollout.generate(prompts, finish_fraction=0.3, **generate)
    rows = [i for i, reason in enumerate(part.finish_reasons) if reason == "unfinished"]
    assert rows and all(c.stop_strings is not None for c in part.unfinished)
    more = rollout.generate(part.unfinished, max_new_tokens=BUDGET, return_logprobs=True)
    assert more.sequences == [full.sequences[i] for i in rows]
    assert more.texts == [full.texts[i] for i in rows]
    assert more.finish_reasons == [full.finish_reasons[i] for i in rows]


@pytest.mark.slow  # about 2 s on 2 CPU cores
def test_the_long_tail_measurement_runs_tiny():
    from rollout_lab.measure.partial_rollouts import partial_rollout_rows, run_partial_rollouts

    saved = []
    record = run_partial_rollouts(get_tiny("qwen2"), model_name="tiny-qwen2", dtype="float32", dataset="gsm8k",
                                  num_prompts=8, max_new_tokens=32, hazard=0.05, slots=4, num_calls=3,
                                  finish_fraction=0.75, save=saved.append)
    assert record["kind"] == "partial_rollouts" and len(saved) == 3  # after the one call, the trace, the loops
    for name in ("full", "partial"):  # the live rows over a profiled call: from none to the slots, ending at none
        trace = record["results"]["trace"][name]
        assert trace[0] == [0.0, 0] and trace[-1][1] == 0 and max(r for _, r in trace) == 4
        assert [t for t, _ in trace] == sorted(t for t, _ in trace)
    one, loop = record["results"]["one_call"], record["results"]["loop"]
    assert one["full"]["num_unfinished_rows"] == 0 and one["full"]["finish_reasons"].get("unfinished") is None
    assert one["partial"]["finish_reasons"].get("unfinished", 0) == one["partial"]["num_unfinished_rows"] <= 2
    assert one["time_ratio"] > 0 and loop["speedup"] > 0
    for name in ("full", "partial"):
        calls = loop[name]["calls"]
        assert [c["rows"] for c in calls] == [8, 8, 8]
        assert loop[name]["delivered_tokens"] == sum(c["delivered_tokens"] for c in calls)
    assert loop["full"]["left_unfinished"] == 0 and all(c["continued_rows"] == 0 for c in loop["full"]["calls"])
    partial = loop["partial"]["calls"]
    assert [c["continued_rows"] for c in partial[1:]] == [c["unfinished_rows"] for c in partial[:-1]]
    rows = partial_rollout_rows(record)
    assert [(r["part"], r["loop"]) for r in rows[:2]] == [("one_call", "full"), ("one_call", "partial")]
    assert len(rows) == 2 + 6
    one_part = {"results": {"one_call": record["results"]["one_call"]}}  # as saved after the one-call part
    assert len(partial_rollout_rows(one_part)) == 2


def test_partial_rollout_defaults_are_the_run_functions():
    import inspect

    from rollout_lab.measure.partial_rollouts import PARTIAL_ROLLOUT_DEFAULTS, run_partial_rollouts

    params = inspect.signature(run_partial_rollouts).parameters
    assert PARTIAL_ROLLOUT_DEFAULTS == {k: params[k].default for k in PARTIAL_ROLLOUT_DEFAULTS}


def test_bench_partial_rollouts_refuses_bad_settings_before_the_model(tmp_path, monkeypatch, capsys):
    from rollout_lab.cli.main import main

    monkeypatch.setattr("rollout_lab.cli.bench.build_model", lambda *a, **k: pytest.fail("built a model"))
    base = ["bench", "partial-rollouts", "--tiny", "qwen2", "--dataset", "gsm8k", "--max-new-tokens", "64",
            "--out", str(tmp_path / "rec")]
    for extra, message in ((["--finish-fraction", "1.5"], "finish_fraction must be a number in (0, 1]"),
                           (["--num-calls", "65"], "num_calls must be an int >= 1 and <= 64, got 65"),
                           (["--hazard", "0.9"], "hazard")):
        assert main(base + extra) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err and len(err.strip().splitlines()) == 1, err


def test_the_long_tail_measurement_refuses_bad_settings():
    from rollout_lab.measure.partial_rollouts import check_partial_settings

    good = dict(num_prompts=8, dataset="gsm8k", hazard=0.05, max_new_tokens=32, slots=4, seed=0, reps=1,
                finish_fraction=0.9, num_calls=4)
    for name, bad, message in (("finish_fraction", 0, r"finish_fraction must be a number in \(0, 1\].*got 0"),
                               ("finish_fraction", None, "finish_fraction must be a number in .*got None"),
                               ("num_calls", 0, "num_calls must be an int >= 1 and <= 64, got 0"),
                               ("slots", 0, "slots must be an int >= 1, got 0")):
        with pytest.raises(ValueError, match=message):
            check_partial_settings(**(good | {name: bad}))
    check_partial_settings(**good)


@pytest.mark.slow  # about 1 s on 2 CPU cores
def test_a_continuation_resumes_under_the_current_weights():
    """After a weight update (another Rollout over the updated model, as a trainer's next step), a
    greedy continuation's new tokens are the updated model's continuation of its prompt and earlier
    tokens: its KV is computed again under the weights of the call that continues it."""
    import copy

    model = get_tiny("qwen2")
    prompts = make_prompts(6, seed=9)
    eos = eos_of(model, prompts)
    cfg = RolloutConfig(**PAGED, eos_token_id=eos)
    part = Rollout(model, cfg).generate(prompts, max_new_tokens=BUDGET, finish_fraction=0.3)
    assert part.unfinished
    updated = copy.deepcopy(model)
    with torch.no_grad():
        for param in updated.parameters():
            param.mul_(1.05)
    more = Rollout(updated, cfg).generate(part.unfinished, max_new_tokens=BUDGET)
    for continuation, tokens in zip(part.unfinished, more.sequences):
        earlier = list(continuation.token_ids)
        again = Rollout(updated, cfg).generate([list(continuation.prompt_token_ids) + earlier],
                                               max_new_tokens=BUDGET - len(earlier)).sequences[0]
        assert tokens == earlier + again
    full = Rollout(model, cfg).generate(prompts, max_new_tokens=BUDGET).sequences
    rows = [i for i, reason in enumerate(part.finish_reasons) if reason == "unfinished"]
    assert any(tokens != full[i] for tokens, i in zip(more.sequences, rows)), "the update changes some row"


def test_live_rows_trace_follows_the_decode_bursts():
    from rollout_lab.measure.partial_rollouts import live_rows_trace

    forwards = [{"kind": "prefill", "ms": 2.0}, {"kind": "decode", "rows": 4, "steps": 8, "ms": 3.0},
                {"kind": "prefill", "ms": 1.0}, {"kind": "decode", "rows": 4, "steps": 1, "ms": 0.5},
                {"kind": "decode", "rows": 2, "steps": 8, "ms": 2.0}]
    assert live_rows_trace(forwards) == [[0.0, 0], [2.0, 4], [6.5, 2], [8.5, 0]]
    assert live_rows_trace([]) == [[0.0, 0]]


@pytest.mark.slow  # ~0.5 s: a figure laid out
def test_the_figure_draws_live_rows_and_the_loop():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from rollout_lab.plots.partial_rollouts import plot_partial_rollouts

    record = {"config": {"finish_fraction": 0.9}, "results": {
        "trace": {"full": [[0.0, 4], [10.0, 1], [30.0, 0]], "partial": [[0.0, 4], [10.0, 0]]},
        "loop": {"full": {"calls": [{}, {}], "delivered_tokens_per_s": 100.0},
                 "partial": {"calls": [{}, {}], "delivered_tokens_per_s": 150.0}, "speedup": 1.5}}}
    fig = plot_partial_rollouts(record, title="t")
    live, loop = fig.axes
    assert len(live.get_lines()) == 3  # two step lines and the partial call's end
    assert [p.get_height() for p in loop.patches] == [100.0, 150.0] and loop.texts[0].get_text() == "1.50×"
    plt.close(fig)
    fig = plot_partial_rollouts({"results": {}})
    assert all(not ax.axison for ax in fig.axes)
    plt.close(fig)
