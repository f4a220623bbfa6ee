"""The packed route: its plan and price (planner.packing), the route choice, and the engine's packed
prefill against the one-request oracle (both attention backends, shared prefill, sampling)."""
from __future__ import annotations

import itertools
import random

import pytest
import torch
from conftest import get_tiny

from rollout_lab import Rollout, RolloutConfig
from rollout_lab.engine.runner.prefill import block_diagonal_mask, cache_kwarg_name, prefill_packed
from rollout_lab.measure.models import TINY_VOCAB_SIZE
from rollout_lab.planner.cost import CostCoefficients, ModelGeometry, packed_prefill_cost_ms, prefill_cost_ms
from rollout_lab.planner.packing import min_forwards, pack_first_fit, plan_packed
from rollout_lab.planner.routes import choose_route

GEO = ModelGeometry.qwen25_3b(2)


def _prompts(lengths, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(1, TINY_VOCAB_SIZE) for _ in range(n)] for n in lengths]


# ---------------------------------------------------------------- planner

def test_packed_price_is_one_fixed_cost_plus_each_prompt_alone():
    costs = CostCoefficients(packed_prompt_cost_ms=0.7)
    lengths = [512, 16, 16, 100]
    alone = sum(prefill_cost_ms(1, n, GEO, costs) - costs.prefill_fixed_cost_ms for n in lengths)
    assert packed_prefill_cost_ms(lengths, GEO, costs) == pytest.approx(
        costs.prefill_fixed_cost_ms + alone + 0.7 * 4)
    assert packed_prefill_cost_ms([], GEO, costs) == 0.0


@pytest.mark.parametrize("seed", range(30))
def test_first_fit_packs_within_the_limit_and_near_the_bound(seed):
    rng = random.Random(seed)
    limit = rng.choice([64, 100, 512])
    lengths = [rng.randint(1, limit) for _ in range(rng.randint(1, 40))]
    packs = pack_first_fit(lengths, limit)
    assert sorted(itertools.chain(*packs)) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in p) <= limit for p in packs)
    bound = min_forwards(lengths, limit)
    assert bound <= len(packs) <= 11 * bound / 9 + 1
    assert pack_first_fit(lengths, None) == [list(range(len(lengths)))]


def test_plan_packed_chunks_prompts_over_the_limit():
    costs = CostCoefficients(prefill_max_tokens=32, packed_prompt_cost_ms=0.0)
    plan = plan_packed([40, 5, 3, 70, 16], GEO, costs)
    assert plan.packed and dict(plan.chunks) == {0: (32,), 3: (32, 32)}
    assert all(w <= 32 for w in plan.widths) and plan.num_padded_tokens == sum([40, 5, 3, 70, 16])
    with pytest.raises(ValueError, match="length at index 1 must be a positive int, got 0"):
        plan_packed([3, 0], GEO, costs)


def test_route_choice_with_and_without_a_packed_price():
    lengths = [512] + [16] * 31
    uncalibrated = choose_route(lengths, max_new_tokens=16, continuous_batch_size=None, geometry=GEO,
                                costs=CostCoefficients())
    assert uncalibrated.packed_cost_ms is None and uncalibrated.route == "bucketed"
    cheap = choose_route(lengths, max_new_tokens=16, continuous_batch_size=None, geometry=GEO,
                         costs=CostCoefficients(packed_prompt_cost_ms=0.1))
    assert cheap.route == "packed" and cheap.packed_cost_ms < cheap.cb_cost_ms
    assert cheap.buckets == (tuple(range(32)),)
    dear = choose_route(lengths, max_new_tokens=16, continuous_batch_size=None, geometry=GEO,
                        costs=CostCoefficients(packed_prompt_cost_ms=50.0))
    assert dear.route == "bucketed" and dear.packed_cost_ms > dear.cb_cost_ms


# ---------------------------------------------------------------- engine

def test_block_diagonal_mask():
    mask = block_diagonal_mask([2, 1, 3], torch.float32, "cpu")[0, 0]
    keep = mask == 0
    expected = torch.zeros(6, 6, dtype=torch.bool)
    for a, b in ((0, 2), (2, 3), (3, 6)):
        expected[a:b, a:b] = torch.ones(b - a, b - a).tril().bool()
    assert torch.equal(keep, expected)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_forward_equals_one_forward_per_prompt(family, attn):
    model = get_tiny(family, attn)
    prompts = _prompts([5, 1, 12, 7], seed=3)
    logits, layer_kv, offsets = prefill_packed(model, prompts, cache_kwarg=cache_kwarg_name(model))
    assert offsets == [0, 5, 6, 18]
    for i, prompt in enumerate(prompts):
        out = model(input_ids=torch.tensor([prompt]), use_cache=True)
        torch.testing.assert_close(logits[i], out.logits[0, -1], atol=1e-5, rtol=1e-5)
        keys = out.past_key_values.layers[0].keys
        torch.testing.assert_close(layer_kv[0][0][:, :, offsets[i]: offsets[i] + len(prompt)], keys,
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_route_backend_is_in_the_profile(attn, oracle):
    model = get_tiny("llama", attn)
    prompts = _prompts([9, 3, 14, 1, 6], seed=4)
    result = Rollout(model, RolloutConfig(mode="packed", profile=True, continuous_batch_size=2)).generate(
        prompts, max_new_tokens=5)
    assert result.route == "packed"
    assert result.profile.prefill_backend == ("segments" if attn == "sdpa" else "masked")
    assert result.sequences == oracle(model, prompts, max_new_tokens=5)
    assert all(plan.packed for plan in result.plans) and len(result.plans) >= 3  # refills packed too
    kinds = {f["kind"] for f in result.profile.forwards}
    assert "packed_prefill" in kinds and "prefill" not in kinds


def test_packed_shared_prefill_and_sampling_equal_bucketed():
    model = get_tiny("qwen3")
    prompts = _prompts([6, 11, 2, 9], seed=6)
    prompts[2] = list(prompts[0])  # a repeated request: one group
    gen = dict(num_samples=3, do_sample=True, temperature=0.9, top_k=40, top_p=0.9, seed=11)
    runs = {}
    for mode in ("bucketed", "packed"):
        config = RolloutConfig(mode=mode, profile=True, repetition_penalty=1.2, continuous_batch_size=5)
        runs[mode] = Rollout(model, config).generate(prompts, max_new_tokens=7, **gen)
    assert runs["packed"].sequences == runs["bucketed"].sequences
    assert runs["packed"].profile.num_replicated_rows > 0  # samples copied from one packed prompt


def test_prefill_routes_are_measured_side_by_side():
    from rollout_lab.measure.prefill_routes import PREFILL_ROUTES, prefill_route_rows

    seen, lines = [], []
    rows = prefill_route_rows(get_tiny("qwen2"), batch_sizes=(4, 8), repetitions=1, on_batch_size=seen.append,
                              log=lines.append)
    assert len(rows) == 2 * 2 * len(PREFILL_ROUTES)  # sizes x distributions x routes
    step = len(PREFILL_ROUTES)  # after each batch (size and distribution): a cut run keeps what it finished
    assert [len(s) for s in seen] == [step, 2 * step, 3 * step, 4 * step] and seen[-1] == rows
    assert len(lines) == len(rows) and all("warm-up" in line for line in lines)  # one per warm-up call
    for r in rows:
        assert r["mean_ms"] > 0 and r["num_tokens"] >= r["batch_size"] and r["first_call_ms"] > 0
        assert r["num_forwards"] == 1 or r["route"] == "bucketed"
    with pytest.raises(ValueError, match="repetitions >= 1"):
        prefill_route_rows(get_tiny("qwen2"), batch_sizes=(4,), repetitions=0)
    with pytest.raises(ValueError, match="routes must be some of"):
        prefill_route_rows(get_tiny("qwen2"), batch_sizes=(4,), repetitions=1, routes=("nocb", "hf_static"))
    some = prefill_route_rows(get_tiny("qwen2"), batch_sizes=(4,), repetitions=1, routes=("packed",))
    assert {r["route"] for r in some} == {"packed"} and len(some) == 2
    with pytest.raises(ValueError, match="prefill_graphs must be 'auto', True or False"):  # engine settings reach every route
        prefill_route_rows(get_tiny("qwen2"), batch_sizes=(4,), repetitions=1, engine={"prefill_graphs": "on"})


def test_bench_prefill_routes_writes_the_record_after_every_batch(tmp_path):
    from rollout_lab.cli.main import main
    from rollout_lab.measure.records import load_prefill_routes_results

    out = tmp_path / "prefill"
    argv = ["--tiny", "qwen2", "--batch-sizes", "4", "--repetitions", "1", "--routes", "bucketed", "packed",
            "--out", str(out)]
    assert main(["bench", "prefill-routes", *argv]) == 0
    record = load_prefill_routes_results(f"{out}.json")
    assert record["complete"] and record["batch_sizes_done"] == [4]
    assert {r["route"] for r in record["rows"]} == {"bucketed", "packed"} and len(record["rows"]) == 2 * 2
    assert record["config"]["routes"] == ["bucketed", "packed"] and record["config"]["costs"] is None
    assert record["provenance"]["script"] == "rollout-lab bench prefill-routes" and record["provenance"]["argv"] == argv


def test_sweep_prefill_rows_read_the_profiled_calls_of_the_prefill_routes():
    from rollout_lab.measure.prefill_routes import sweep_prefill_rows

    def path(prefill_ms, cache_ms, forwards, backend):
        return {"profile": {"prefill_ms": prefill_ms, "cache_ms": cache_ms,
                            "num_prefill_forwards": forwards, "prefill_backend": backend}}

    record = {"workloads": {"w": {"num_requests": 3, "lengths": [4, 5, 6], "paths": {
        "nocb": path(10.0, 0.0, 1, "hf_padded"), "packed": path(7.0, 1.5, 1, "segments"),
        "auto": path(1.0, 1.0, 1, "graph"), "hf_static": {"profile": None}}}}}
    rows = sweep_prefill_rows(record)
    assert [(r["route"], r["mean_ms"], r["num_tokens"], r["backend"]) for r in rows] == [
        ("nocb", 10.0, 15, "hf_padded"), ("packed", 8.5, 15, "segments")]
    assert all(r["distribution"] == "sweep" and r["workload"] == "w" for r in rows)
