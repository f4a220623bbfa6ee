"""measure.bucket_choices and planner.bucket_dp.plan_buckets_k: the k-bucket DP against brute force, the tables' invariants, the route map."""
from __future__ import annotations

import itertools
import math
import random

import pytest

from rollout_lab.measure.bucket_choices import (
    fixed_cost_rows,
    num_buckets_rows,
    plan_padding_share,
    route_map,
    summary_rows,
)
from rollout_lab.measure.presets import geometry_for
from rollout_lab.measure.workloads import resolve_distribution, resolve_distributions, scale_lengths
from rollout_lab.planner.bucket_dp import plan_buckets, plan_buckets_k, plans_by_num_buckets
from rollout_lab.planner.cost import CostCoefficients, CostFile, prefill_cost_ms
from rollout_lab.planner.routes import choose_route
from rollout_lab.workspace import write_csv

GEO = geometry_for("qwen2.5-3b", "float32")


def brute_force_k(lengths, costs, k):
    """Cheapest exactly-k contiguous split of the sorted lengths, or None."""
    srt, n, limit = sorted(lengths), len(lengths), costs.prefill_max_tokens
    best = None
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds, total = [0, *cuts, n], 0.0
        for i, j in zip(bounds, bounds[1:]):
            if limit is not None and (j - i) * srt[j - 1] > limit:
                total = None
                break
            total += prefill_cost_ms(j - i, srt[j - 1], GEO, costs)
        if total is not None and (best is None or total < best):
            best = total
    return best


@pytest.mark.parametrize("seed", range(60))
def test_k_bucket_dp_equals_brute_force(seed):
    rng = random.Random(seed)
    costs = CostCoefficients(prefill_fixed_cost_ms=rng.choice([0.0, 5.0, 25.0, 400.0]),
                             prefill_max_tokens=rng.choice([None, 256, 1024]))
    n = rng.randint(1, 8)
    lengths = [rng.randint(1, 200) for _ in range(n)]
    plans = plans_by_num_buckets(lengths, GEO, costs, n + 2)
    assert len(plans) == n and plan_buckets_k(lengths, GEO, costs, n + 1) is None  # no k past the prompts
    for k in range(1, n + 1):
        expected, plan = brute_force_k(lengths, costs, k), plans[k - 1]
        assert (expected is None) == (plan is None), (lengths, k)
        if plan is not None:
            assert plan.num_buckets == k
            assert math.isclose(plan.cost_ms, expected, rel_tol=1e-9)
            assert sorted(i for b in plan.buckets for i in b) == list(range(n))
    optimum = plan_buckets(lengths, GEO, costs)
    assert math.isclose(min(p.cost_ms for p in plans if p), optimum.cost_ms, rel_tol=1e-9)


def test_plan_buckets_k_worked_example():
    lengths = [512] + [16] * 31
    two = plan_buckets_k(lengths, GEO, CostCoefficients(), 2)
    assert two.widths == (16, 512) and math.isclose(two.cost_ms, 154.43, abs_tol=0.01)
    one = plan_buckets_k(lengths, GEO, CostCoefficients(), 1)
    assert math.isclose(one.cost_ms, 1734.22, abs_tol=0.01)
    assert plan_padding_share(lengths, two) == 0.0
    assert math.isclose(plan_padding_share(lengths, one), 1 - (512 + 31 * 16) / (32 * 512))


def test_errors_name_the_bad_value():
    with pytest.raises(ValueError, match="max_num_buckets"):
        plans_by_num_buckets([1, 2], GEO, CostCoefficients(), 0)
    with pytest.raises(ValueError, match="kind must be one of"):
        resolve_distribution({"kind": "zipf"}, batch_size=4, seed=0)
    with pytest.raises(ValueError, match="unknown preset"):
        geometry_for("gpt-5")
    with pytest.raises(ValueError, match="does not exist"):
        CostFile.read("/nonexistent/costs.json")


def test_distributions_resolve():
    specs = [{"kind": "seed", "name": "long_tail"}, {"kind": "lognormal", "median": 50, "sigma": 0.5},
             {"kind": "bimodal", "short_median": 20, "long_median": 300, "long_share": 0.25},
             {"kind": "real", "dataset": "humaneval", "label": "HE"}]
    dists = resolve_distributions(specs, batch_size=16, seeds=[0, 1])
    assert [len(d.samples) for d in dists] == [1, 2, 2, 2]
    assert dists[0].lengths == [512] + [16] * 31 and dists[3].label == "HE"
    assert all(len(s) == 16 for d in dists[1:] for s in d.samples)
    assert dists[1].samples[0] != dists[1].samples[1]


def test_tables_and_route_map(tmp_path):
    costs = CostCoefficients()
    dists = resolve_distributions([{"kind": "real", "dataset": "gsm8k"}, {"kind": "seed", "name": "spread"}],
                                  batch_size=24, seeds=[0])
    rows = num_buckets_rows(dists, GEO, costs, max_num_buckets=8)
    assert sum(r["is_dp_choice"] for r in rows) == 2
    assert all(0 <= r["padding_share"] <= 1 for r in rows)
    sweep = fixed_cost_rows(dists, GEO, costs, fixed_costs_ms=[0.0, 1.0, 100.0, 1e4])
    for label in ("gsm8k", "spread"):
        ks = [r["num_buckets"] for r in sweep if r["distribution"] == label]
        assert ks == sorted(ks, reverse=True) and ks[-1] == 1
    summary = summary_rows(dists, GEO, costs, max_new_tokens=16)
    assert all(r["dp_cost_ms"] <= r["one_bucket_cost_ms"] for r in summary)
    lengths = dists[0].lengths
    m = route_map("gsm8k", lengths, GEO, costs, max_lengths=[16, 128, 1024, 2048], budgets=[1, 16, 512])
    for r, budget in enumerate(m.budgets):
        for c, scale in enumerate(m.scales):
            expected = choose_route(scale_lengths(lengths, scale), max_new_tokens=budget,
                                    continuous_batch_size=None, geometry=GEO, costs=costs).route
            assert m.routes[r][c] == expected
    assert m.max_lengths == (16, 128, 1024, 2048)
    path = write_csv(m.rows(), tmp_path / "t" / "route.csv")
    assert path.read_text().splitlines()[0].startswith("distribution,scale,max_len")


def test_packed_crossing_is_where_the_two_prices_meet():
    from dataclasses import replace

    from rollout_lab.measure.bucket_choices import packed_crossing_rows
    from rollout_lab.planner.bucket_dp import plan_buckets
    from rollout_lab.planner.cost import CostCoefficients, ModelGeometry
    from rollout_lab.planner.packing import plan_packed
    from rollout_lab.measure.workloads import lognormal_lengths

    geometry = ModelGeometry.qwen25_3b(2)
    rows = packed_crossing_rows(geometry, CostCoefficients(), batch_sizes=(32,), seeds=(0,))
    assert [r["packed_wins"] for r in rows] == [None, None]  # no calibrated overhead
    row = next(r for r in rows if r["distribution"] == "lognormal")
    lengths = lognormal_lengths(32, 120.0, 0.8, 0, 2048)
    at_crossing = replace(CostCoefficients(), packed_prompt_cost_ms=row["crossing_ms_per_prompt"])
    assert plan_packed(lengths, geometry, at_crossing).cost_ms == pytest.approx(
        plan_buckets(lengths, geometry, CostCoefficients()).cost_ms)
    cheap = packed_crossing_rows(geometry, CostCoefficients(packed_prompt_cost_ms=0.01), batch_sizes=(32,), seeds=(0,))
    assert all(r["packed_wins"] for r in cheap)
    # at the engine's class ladder the buckets pay the padding up to their class widths
    from rollout_lab.planner.shape_classes import ShapeClasses, plan_buckets_classed
    classes = ShapeClasses.ladder(max_width=2048, max_rows=32)
    classed = packed_crossing_rows(geometry, CostCoefficients(), batch_sizes=(32,), seeds=(0,), classes=classes)
    for plain, at_class in zip(rows, classed):
        assert at_class["bucketed_ms"] >= plain["bucketed_ms"] - 1e-9
        assert at_class["packed_zero_ms"] == plain["packed_zero_ms"]
    assert next(r for r in classed if r["distribution"] == "lognormal")["bucketed_ms"] == pytest.approx(
        plan_buckets_classed(lengths, geometry, CostCoefficients(), classes).cost_ms)


def test_plan_comparison_prices_the_reference_plan_on_the_calibrated_device():
    from rollout_lab.measure.bucket_choices import plan_comparison_rows
    geometry = geometry_for("qwen2.5-3b", "bfloat16")
    dists = resolve_distributions([{"kind": "real", "dataset": "gsm8k"}, {"kind": "seed", "name": "spread"}],
                                  batch_size=32, seeds=[0, 1])
    cheap_forwards = CostCoefficients(prefill_fixed_cost_ms=1.0, packed_prompt_cost_ms=0.5)
    rows = plan_comparison_rows(dists, geometry, cheap_forwards, max_new_tokens=16)
    assert len(rows) == sum(len(d.samples) for d in dists)
    for row in rows:
        assert row["regret"] >= 1 - 1e-9  # the DP is optimal for the calibrated costs
        assert row["calibrated_num_buckets"] >= row["reference_num_buckets"]  # a cheaper forward buys more buckets
    assert any(row["regret"] > 1.001 for row in rows)  # and the reference plan pays for it somewhere
    same = plan_comparison_rows(dists, geometry, CostCoefficients(), max_new_tokens=16)
    assert all(r["regret"] == pytest.approx(1.0) and r["reference_widths"] == r["calibrated_widths"] for r in same)
