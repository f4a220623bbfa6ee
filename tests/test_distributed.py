"""Sharding (pure) and data-parallel rollout over gloo with 2 and 3 spawned CPU processes."""
import itertools
import random
from collections import Counter

import pytest

from rollout_lab.measure.workloads import get_workload, sample_lengths
from rollout_lab.planner.cost import CostCoefficients, ModelGeometry
from rollout_lab.planner.routes import choose_route
from rollout_lab.planner.sharding import (
    METHODS,
    RankCost,
    check_partition,
    contiguous_shards,
    predicted_makespan,
    predicted_rank_costs,
    shard_requests,
)

GEO = ModelGeometry.qwen25_3b()  # fp32
COSTS = CostCoefficients()
SEED_WORKLOADS = ("short_similar", "long_tail", "short_tail", "moderate_tail", "spread")
WORLD_SIZES = (2, 3, 4, 8)


def makespan(shards, lengths, **kw):
    return predicted_makespan(shards, lengths, GEO, COSTS, **kw)


def random_lengths(rng, n):
    kind = rng.choice(["gsm8k", "wide", "tail", "equal"])
    if kind == "gsm8k":
        return [rng.randint(23, 188) for _ in range(n)]
    if kind == "wide":
        return [rng.randint(1, 1024) for _ in range(n)]
    if kind == "tail":
        return [rng.choice([1, 4, 16, 16, 16, 512]) for _ in range(n)]
    return [rng.choice([7, 8])] * n


# ---------------------------------------------------------------- sharding


@pytest.mark.slow  # 120 random cases, every method
def test_every_request_on_exactly_one_rank():
    rng = random.Random(0)
    for _ in range(120):
        n = rng.randint(0, 70)
        lengths = random_lengths(rng, n) if n else []
        world_size = rng.choice([1, 2, 3, 4, 5, 7, 8, 16, 80])
        kw = dict(max_new_tokens=rng.choice([1, 16, 64]),
                  continuous_batch_size=rng.choice([None, 4, 32]))
        for method in METHODS:
            shards = shard_requests(lengths, world_size, GEO, COSTS, method=method, **kw)
            assert len(shards) == world_size
            check_partition(shards, n)
            assert all(shard == sorted(shard) for shard in shards)
            if method == "karmarkar_karp":  # verl's equal_size: counts differ by at most one
                counts = [len(s) for s in shards]
                assert max(counts) - min(counts) <= 1


def test_more_ranks_than_requests_leaves_ranks_empty():
    shards = shard_requests([5, 300, 17], 5, GEO, COSTS)
    assert sorted(len(s) for s in shards) == [0, 0, 1, 1, 1]
    assert predicted_rank_costs(shards, [5, 300, 17], GEO, COSTS).count(0.0) == 2
    assert shard_requests([], 3, GEO, COSTS) == [[], [], []]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize(
    "name", SEED_WORKLOADS + ("gsm8k_32", "gsm8k_64")
    + tuple(pytest.param(name, marks=pytest.mark.slow) for name in ("gsm8k_128", "gsm8k_512_s1", "gsm8k_256_s2"))
)
def test_balanced_beats_round_robin_and_kk(name, world_size):
    if name.startswith("gsm8k_") and "_s" in name:
        n, seed = name[len("gsm8k_"):].split("_s")
        lengths = sample_lengths("gsm8k", int(n), seed=int(seed))
    else:
        lengths = get_workload(name)
    for kw in (dict(max_new_tokens=16), dict(max_new_tokens=128, continuous_batch_size=16)):
        spans = {m: makespan(shard_requests(lengths, world_size, GEO, COSTS, method=m, **kw),
                             lengths, **kw) for m in METHODS}
        assert spans["balanced"] <= spans["round_robin"] * (1 + 1e-12), spans
        assert spans["balanced"] <= spans["karmarkar_karp"] * (1 + 1e-12), spans


def test_contiguous_split_is_optimal_among_contiguous_splits():
    rng = random.Random(1)
    for _ in range(25):
        lengths = random_lengths(rng, rng.randint(2, 11))
        world_size = rng.choice([2, 3, 4])
        cost = RankCost(GEO, COSTS, min_budget=16, continuous_batch_size=None)
        items = [(length, 16) for length in lengths]
        order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
        widths = [items[i] for i in order]
        best = min(
            max(cost(tuple(widths[i:j])) for i, j in zip((0,) + cuts, cuts + (len(widths),)))
            for cuts in itertools.combinations_with_replacement(range(len(widths) + 1), world_size - 1)
        )
        got = contiguous_shards(items, order, world_size, cost)
        assert max(cost(tuple(sorted(items[i] for i in s))) for s in got) <= best * (1 + 1e-8)


def test_close_to_exhaustive_optimum_on_small_cases():
    rng = random.Random(2)
    ratios = []
    for _ in range(15):
        lengths = random_lengths(rng, rng.randint(3, 8))
        world_size = rng.choice([2, 3])
        cost = RankCost(GEO, COSTS, min_budget=16, continuous_batch_size=None)
        best = min(
            max(cost(tuple(sorted((lengths[i], 16) for i in range(len(lengths)) if a[i] == r)))
                for r in range(world_size))
            for a in itertools.product(range(world_size), repeat=len(lengths)) if a[0] == 0
        )
        ratios.append(makespan(shard_requests(lengths, world_size, GEO, COSTS), lengths) / best)
    assert min(ratios) >= 1 - 1e-12
    assert max(ratios) <= 1.06, ratios  # a heuristic: within 6% of the optimum on these


def test_rank_cost_is_autos_choose_route():
    lengths = sample_lengths("gsm8k", 48, seed=3)
    shards = shard_requests(lengths, 3, GEO, COSTS, max_new_tokens=8)
    for shard, cost in zip(shards, predicted_rank_costs(shards, lengths, GEO, COSTS, max_new_tokens=8)):
        plan = choose_route([lengths[i] for i in shard], max_new_tokens=8, continuous_batch_size=None,
                            geometry=GEO, costs=COSTS)
        assert cost == pytest.approx(min(c for c in (plan.nocb_cost_ms, plan.cb_cost_ms) if c is not None))


def test_deterministic():
    lengths = sample_lengths("gsm8k", 512, seed=0)
    first = shard_requests(lengths, 8, GEO, COSTS)
    assert first == shard_requests(list(lengths), 8, GEO, COSTS)
    assert sorted(i for shard in first for i in shard) == list(range(512))


@pytest.mark.parametrize(
    "args, kwargs, match",
    [
        (([4, 5], 0), {}, "world_size must be an int >= 1, got 0"),
        (([4, 5], 2.0), {}, "world_size must be an int >= 1"),
        (([4, 5], 2), {"method": "lpt"}, "valid methods: balanced, round_robin, karmarkar_karp"),
        (([4, 0], 2), {}, "length at index 1 must be a positive int, got 0"),
        (([4, 2.5], 2), {}, "length at index 1"),
        (([70000], 2), {}, "prefill_max_tokens"),
        (([4, 5], 2), {"max_new_tokens": 0}, "max_new_tokens must be an int >= 1"),
    ],
)
def test_errors(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        shard_requests(*args[:2], GEO, COSTS, **kwargs)


def test_check_partition_names_the_problem():
    with pytest.raises(ValueError, match=r"requests \[1\] are on \[2\] ranks"):
        check_partition([[0, 1], [1, 2]], 3)
    with pytest.raises(ValueError, match="outside"):
        check_partition([[0, 3]], 3)


# ---------------------------------------------------------------- distributed (gloo, spawned)

torch = pytest.importorskip("torch")
from rollout_lab.engine.api.config import RolloutConfig  # noqa: E402
from rollout_lab.engine.distributed import distributed_generate, launch  # noqa: E402
from rollout_lab.engine.api.rollout import Rollout  # noqa: E402
from rollout_lab.measure.models import TINY_VOCAB_SIZE, tiny_model  # noqa: E402
from rollout_lab.measure.workloads import lengths_to_prompts  # noqa: E402

LENGTHS = [3, 40, 5, 5, 17, 2, 60, 9, 9, 9, 31, 4]
MAX_NEW = 10


def _prompts(lengths):
    return lengths_to_prompts(lengths, vocab_size=TINY_VOCAB_SIZE, seed=0, special_ids=[0])


def _dp_worker(rank, world_size, prompts, configs, methods, few_prompts):
    model = tiny_model("qwen2", seed=0)
    out = {}
    for name, config in configs.items():
        for method in methods:
            out[name, method] = distributed_generate(model, prompts, max_new_tokens=MAX_NEW,
                                                     config=config, method=method)
    # fewer prompts than ranks: some ranks run an empty shard
    out["few"] = distributed_generate(model, few_prompts, max_new_tokens=MAX_NEW,
                                      config=configs["plain"])
    # the same prompts on every rank is a precondition, and it is checked
    try:
        distributed_generate(model, prompts[: len(prompts) - rank], max_new_tokens=MAX_NEW)
        out["mismatch"] = None
    except RuntimeError as err:
        out["mismatch"] = str(err)
    # generate's prompt checks, before any collective: floats and strings are not token ids
    out["bad"] = []
    for bad in ([[1.5, 2]], [["5", "6"]]):
        try:
            distributed_generate(model, bad, max_new_tokens=MAX_NEW)
            out["bad"].append(None)
        except ValueError as err:
            out["bad"].append(str(err))
    return out


def _reference(prompts, config):
    return Rollout(tiny_model("qwen2", seed=0), config).generate(prompts, max_new_tokens=MAX_NEW).sequences


@pytest.fixture(scope="module")
def eos_id():
    """A token the tiny model often generates mid-sequence, so requests stop at different steps."""
    sequences = _reference(_prompts(LENGTHS), RolloutConfig(pad_token_id=0))
    counts = Counter(t for s in sequences for t in s[1:-1])
    return min(counts, key=lambda t: (-counts[t], t))


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3])
def test_distributed_matches_single_process(world_size, eos_id):
    prompts = _prompts(LENGTHS)
    configs = {
        "plain": RolloutConfig(pad_token_id=0),
        "eos_cb": RolloutConfig(pad_token_id=0, eos_token_id=eos_id, continuous_batch_size=2),
    }
    methods = ("balanced", "round_robin") if world_size == 2 else METHODS
    few_prompts = _prompts([6, 3, 11][: world_size - 1])
    results = launch(_dp_worker, world_size, args=(prompts, configs, methods, few_prompts))
    for name, config in configs.items():
        expected = _reference(prompts, config)
        if name == "eos_cb":
            assert len({len(s) for s in expected}) > 1  # EOS really cut some requests short
        for method in methods:
            by_rank = [r[name, method] for r in results]
            for result in by_rank:
                assert result.sequences == expected, (name, method)
                assert result.shards == by_rank[0].shards
                assert result.rank_times_s == by_rank[0].rank_times_s
                check_partition(result.shards, len(prompts))
                assert len(result.rank_times_s) == world_size and result.makespan_s > 0
                assert len(result.predicted_rank_costs_ms) == world_size
    few_expected = _reference(few_prompts, configs["plain"])
    for r in results:
        assert "different prompts" in r["mismatch"]
        assert r["few"].sequences == few_expected
        assert sorted(len(s) for s in r["few"].shards) == [0] + [1] * (world_size - 1)
        assert all(m is not None and "token ids must be ints" in m for m in r["bad"]), r["bad"]


def test_per_request_budgets_are_priced_per_rank():
    """Each rank's cost is Auto's with that rank's own budgets; balanced stays no worse than the
    baselines, and splits the long budgets rather than stacking them."""
    rng = random.Random(7)
    costs = CostCoefficients(continuous_decode_cost_ms=1.0)
    for _ in range(10):
        n = rng.randint(4, 24)
        lengths = random_lengths(rng, n)
        budgets = [rng.choice([4, 64, 512]) for _ in range(n)]
        for slots in (None, 3):
            kw = dict(max_new_tokens=budgets, continuous_batch_size=slots)
            shards = shard_requests(lengths, 2, GEO, costs, **kw)
            for shard, cost in zip(shards, predicted_rank_costs(shards, lengths, GEO, costs, **kw)):
                plan = choose_route([lengths[i] for i in shard], max_new_tokens=[budgets[i] for i in shard],
                                    continuous_batch_size=slots, geometry=GEO, costs=costs) if shard else None
                assert cost == (0.0 if plan is None else plan.nocb_cost_ms if plan.route == "nocb" else plan.cb_cost_ms)
            spans = {m: predicted_makespan(shard_requests(lengths, 2, GEO, costs, method=m, **kw), lengths, GEO,
                                           costs, **kw) for m in METHODS}
            assert spans["balanced"] <= min(spans.values()) * (1 + 1e-12), spans
    # two 512-token requests among short ones, one slot per rank: they must not share a rank
    lengths, budgets = [16] * 8, [512, 512] + [4] * 6
    shards = shard_requests(lengths, 2, GEO, costs, max_new_tokens=budgets, continuous_batch_size=1)
    assert sorted(sum(budgets[i] == 512 for i in shard) for shard in shards) == [1, 1]
    with pytest.raises(ValueError, match="3 budgets for 8 requests"):
        shard_requests(lengths, 2, GEO, costs, max_new_tokens=[1, 2, 3])
