import random

import pytest

from rollout_lab.planner.bucket_dp import plan_buckets, plan_buckets_quadratic
from rollout_lab.planner.cost import CostCoefficients, ModelGeometry, prefill_cost_ms
from rollout_lab.planner.routes import choose_route, plan_admission

GEO = ModelGeometry(36, 16, 2, 128, 4)  # Qwen2.5-3B, fp32


def exhaustive(lengths, costs):
    """Every contiguous cut pattern of the sorted lengths: (min cost, fewest buckets at that cost)."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    n, limit = len(order), costs.prefill_max_tokens
    results = []
    for mask in range(2 ** (n - 1)):
        cuts = [0] + [k + 1 for k in range(n - 1) if mask >> k & 1] + [n]
        total = 0.0
        for i, j in zip(cuts, cuts[1:]):
            width = lengths[order[j - 1]]
            if limit is not None and (j - i) * width > limit:
                total = None
                break
            total += prefill_cost_ms(j - i, width, GEO, costs)
        if total is not None:
            results.append((total, len(cuts) - 1))
    best = min(cost for cost, _ in results)
    scale = prefill_cost_ms(n, max(lengths), GEO, costs)
    fewest = min(k for cost, k in results if cost <= best + 1e-11 * scale)
    return best, fewest


def random_costs(rng):
    return CostCoefficients(
        prefill_fixed_cost_ms=rng.choice([0.0, 0.3, 5.0, 25.0, 400.0]),
        prefill_token_cost_ms=rng.choice([0.0, 0.01, 0.1]),
        prefill_attention_cost_ms=rng.choice([0.0, 0.01, 0.5]),
        prefill_kv_cost_ms=rng.choice([0.0, 0.04]),
        prefill_max_tokens=rng.choice([None, 256, 1024, 65536]),
    )


def recomputed_cost(plan, lengths, costs):
    total = 0.0
    for bucket, width in zip(plan.buckets, plan.widths):
        assert width == max(lengths[i] for i in bucket)
        total += prefill_cost_ms(len(bucket), width, GEO, costs)
    return total


@pytest.mark.parametrize("seed", range(300))
def test_dp_equals_exhaustive_enumeration(seed):
    rng = random.Random(seed)
    costs = random_costs(rng)
    n = rng.randint(1, 10)
    cap = costs.prefill_max_tokens or 600
    lengths = [rng.choice([rng.randint(1, 16), rng.randint(1, min(cap, 600))]) for _ in range(n)]
    best, fewest = exhaustive(lengths, costs)
    for planner in (plan_buckets, plan_buckets_quadratic):
        plan = planner(lengths, GEO, costs)
        assert plan.cost_ms == pytest.approx(best, rel=1e-9, abs=1e-9)
        assert plan.num_buckets == fewest
        assert plan.cost_ms == pytest.approx(recomputed_cost(plan, lengths, costs), rel=1e-12)
        assert sorted(i for b in plan.buckets for i in b) == list(range(n))
        limit = costs.prefill_max_tokens
        assert all(limit is None or len(b) * w <= limit for b, w in zip(plan.buckets, plan.widths))


@pytest.mark.parametrize("seed", range(40))
def test_fast_dp_equals_quadratic_oracle(seed):
    rng = random.Random(1000 + seed)
    costs = random_costs(rng)
    n = rng.choice([50, 200, 700])
    hi = min(rng.choice([16, 512, 8192]), costs.prefill_max_tokens or 8192)
    lengths = [rng.randint(1, hi) for _ in range(n)]
    if seed % 4 == 0:
        lengths = [rng.choice([4, 16, hi]) for _ in range(n)]  # many exact ties
    fast = plan_buckets(lengths, GEO, costs)
    slow = plan_buckets_quadratic(lengths, GEO, costs)
    assert fast.cost_ms == pytest.approx(slow.cost_ms, rel=1e-9)
    assert fast.num_buckets == slow.num_buckets


def test_worked_example():
    lengths = [512] + [16] * 31
    plan = plan_buckets(lengths, GEO, CostCoefficients())
    assert sorted((len(b), w) for b, w in zip(plan.buckets, plan.widths)) == [(1, 512), (31, 16)]
    assert plan.buckets[1] == (0,)
    assert plan.cost_ms == pytest.approx(154.43, abs=0.01)


def test_fixed_cost_extremes():
    lengths = [5, 40, 300, 1000, 17]
    huge = plan_buckets(lengths, GEO, CostCoefficients(prefill_fixed_cost_ms=1e9))
    assert huge.num_buckets == 1
    tiny = plan_buckets(lengths, GEO, CostCoefficients(prefill_fixed_cost_ms=1e-6))
    assert tiny.num_buckets == len(set(lengths))  # singletons: padding is never free
    same = plan_buckets([8] * 6, GEO, CostCoefficients(prefill_fixed_cost_ms=0.0))
    assert same.num_buckets == 1  # equal cost: fewer buckets win


def test_token_limit_forces_splits():
    costs = CostCoefficients(prefill_fixed_cost_ms=1e6, prefill_max_tokens=64)
    plan = plan_buckets([16] * 10, GEO, costs)
    # at most 4 rows of 16 per forward: three buckets ([4, 4, 2] and [4, 3, 3] cost the same)
    assert plan.num_buckets == 3 and sum(len(b) for b in plan.buckets) == 10
    assert all(len(b) * w <= 64 for b, w in zip(plan.buckets, plan.widths))
    assert plan.cost_ms == pytest.approx(3 * 1e6 + 10 * (prefill_cost_ms(1, 16, GEO, costs) - 1e6))


def test_empty_and_bad_input():
    assert plan_buckets([], GEO, CostCoefficients()).buckets == ()
    with pytest.raises(ValueError, match="index 2 has length 70000"):
        plan_buckets([1, 2, 70000], GEO, CostCoefficients())
    for bad in ([0], [3, -1], [2.5], ["7"], [True]):
        with pytest.raises(ValueError, match="must be a positive int"):
            plan_buckets(bad, GEO, CostCoefficients())


def test_choose_route_rules():
    costs = CostCoefficients()
    long_tail = [512] + [16] * 31
    plan = choose_route(long_tail, max_new_tokens=16, continuous_batch_size=None, geometry=GEO, costs=costs)
    assert plan.route == "bucketed" and plan.nocb_cost_ms > plan.cb_cost_ms
    assert plan.cb_cost_ms == pytest.approx(154.43 + 150, abs=0.01)
    similar = [20, 19, 18, 17] * 8
    plan = choose_route(similar, max_new_tokens=16, continuous_batch_size=None, geometry=GEO, costs=costs)
    assert plan.route == "nocb" and plan.buckets == (tuple(range(32)),)
    assert plan.nocb_cost_ms == pytest.approx(prefill_cost_ms(32, 20, GEO, costs, include_kv=False))
    # not eligible: too many requests for the slots, explicit cache settings, or over the token limit
    for kwargs in ({"continuous_batch_size": 8}, {"nocb_allowed": False}):
        args = {"continuous_batch_size": None, **kwargs}
        plan = choose_route(similar, max_new_tokens=16, geometry=GEO, costs=costs, **args)
        assert plan.route == "bucketed" and plan.nocb_cost_ms is None
    small_limit = CostCoefficients(prefill_max_tokens=600)
    plan = choose_route(similar, max_new_tokens=1, continuous_batch_size=None, geometry=GEO, costs=small_limit)
    assert plan.route == "bucketed" and plan.nocb_cost_ms is None


def test_lower_bound_never_changes_the_choice():
    rng = random.Random(7)
    for _ in range(200):
        costs = random_costs(rng)
        costs = CostCoefficients(**{**costs.to_dict(), "prefill_max_tokens": None,
                                    "continuous_decode_cost_ms": rng.choice([0.0, 1.0, 10.0])})
        lengths = [rng.randint(1, rng.choice([8, 64, 512])) for _ in range(rng.randint(1, 40))]
        new = rng.randint(1, 64)
        plan = choose_route(lengths, max_new_tokens=new, continuous_batch_size=None, geometry=GEO, costs=costs)
        cb = plan_buckets(lengths, GEO, costs).cost_ms + costs.continuous_decode_cost_ms * (new - 1)
        assert plan.route == ("nocb" if plan.nocb_cost_ms <= cb else "bucketed")
        assert plan.cb_cost_ms <= cb * (1 + 1e-12)


def test_nocb_decode_cost_moves_the_choice():
    similar = [20, 19, 18, 17] * 8
    base = dict(max_new_tokens=16, continuous_batch_size=None, geometry=GEO)
    assert choose_route(similar, costs=CostCoefficients(), **base).route == "nocb"
    # a fast graph decode (1 ms/step) against HF's eager loop (25 ms/step): CB wins
    fast_cb = CostCoefficients(continuous_decode_cost_ms=1.0, nocb_decode_cost_ms=25.0)
    plan = choose_route(similar, costs=fast_cb, **base)
    assert plan.route == "bucketed"
    assert plan.nocb_cost_ms == pytest.approx(prefill_cost_ms(32, 20, GEO, fast_cb, include_kv=False) + 25.0 * 15)


@pytest.mark.parametrize("kwargs, match", [
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"continuous_batch_size": 0}, "continuous_batch_size"),
])
def test_choose_route_bad_settings(kwargs, match):
    args = {"max_new_tokens": 4, "continuous_batch_size": None, **kwargs}
    with pytest.raises(ValueError, match=match):
        choose_route([3, 4], geometry=GEO, costs=CostCoefficients(), **args)


# ---------------------------------------------------------------- per-request budgets

def _schedule_brute_force(budgets, slots):
    """Step-by-step continuous batching without EOS: admit in order into free slots, one token per
    live row per step (the prefill gave the first), count the steps."""
    queue, live, steps = list(budgets), [], 0
    while queue or live:
        while queue and len(live) < slots:
            live.append(queue.pop(0) - 1)  # tokens still to decode
            live = [r for r in live if r > 0]  # a budget of 1 is done at its prefill
        if not live:
            continue
        live = [r - 1 for r in live if r > 1]  # one step; rows that are done retire at once
        steps += 1
    return steps


def test_budget_decode_steps_bounds_a_step_by_step_schedule():
    from rollout_lab.planner.decode_steps import budget_decode_steps

    rng = random.Random(5)
    for _ in range(300):
        budgets = [rng.randint(1, 40) for _ in range(rng.randint(1, 12))]
        slots = rng.randint(1, 14)
        steps = budget_decode_steps(budgets, num_slots=slots)
        schedule = min(_schedule_brute_force(order, slots) for order in (budgets, sorted(budgets, reverse=True)))
        assert steps <= schedule, (budgets, slots)  # a lower bound on any admission order
        if slots >= len(budgets) or len(set(budgets)) == 1 and len(budgets) % slots == 0:
            assert steps == schedule, (budgets, slots)  # exact when nothing waits, or it packs evenly
        assert budget_decode_steps(list(reversed(budgets)), num_slots=slots) == steps  # order-free
    assert budget_decode_steps([5, 3, 8]) == 7 and budget_decode_steps([]) == 0
    assert budget_decode_steps([5, 3, 8], num_slots=1) == 4 + 2 + 7


def test_choose_route_prices_per_request_budgets():
    lengths = [64] * 8
    costs = CostCoefficients(continuous_decode_cost_ms=1.0, nocb_decode_cost_ms=3.0)
    same = choose_route(lengths, max_new_tokens=100, continuous_batch_size=None, geometry=GEO, costs=costs)
    assert choose_route(lengths, max_new_tokens=[100] * 8, continuous_batch_size=None, geometry=GEO,
                        costs=costs) == same
    mixed = choose_route(lengths, max_new_tokens=[100] + [2] * 7, continuous_batch_size=None, geometry=GEO,
                         costs=costs)
    assert mixed.nocb_cost_ms == pytest.approx(same.nocb_cost_ms)  # nocb runs every row to the largest
    # with 2 slots CB decodes the schedule: 99 steps on one slot, 7 x 1 on the other
    refill = choose_route(lengths, max_new_tokens=[100] + [2] * 7, continuous_batch_size=2, geometry=GEO,
                          costs=costs)
    assert refill.nocb_cost_ms is None
    assert refill.cb_cost_ms == pytest.approx(plan_buckets(lengths, GEO, costs).cost_ms + 99 * 1.0)
    with pytest.raises(ValueError, match="3 budgets for 8 requests"):
        choose_route(lengths, max_new_tokens=[1, 2, 3], continuous_batch_size=None, geometry=GEO, costs=costs)


def test_plan_admission_by_route():
    """The buckets of one admission, as request indices: one (equal_width), one per request
    (aligned), the DP's (bucketed, paged: the same plan)."""
    geometry, costs = ModelGeometry.qwen25_3b(), CostCoefficients()
    requests, lengths = [3, 5, 7], {3: 512, 5: 16, 7: 16}
    lengths = [lengths.get(i, 1) for i in range(8)]
    assert plan_admission("equal_width", requests, lengths, geometry, costs).buckets == ((3, 5, 7),)
    assert plan_admission("aligned", requests, lengths, geometry, costs).buckets == ((3,), (5,), (7,))
    bucketed = plan_admission("bucketed", requests, lengths, geometry, costs)
    assert sorted(bucketed.buckets) == [(3,), (5, 7)]
    assert plan_admission("paged", requests, lengths, geometry, costs).buckets == bucketed.buckets
