"""Shape classes (planner.shape_classes): the ladders, and the DP over class shapes against every
set partition."""
from __future__ import annotations

import random

import pytest

from rollout_lab.planner.cost import CostCoefficients, ModelGeometry
from rollout_lab.planner.shape_classes import (
    CAPTURE_PAYBACK_CALLS,
    ShapeClasses,
    class_shape,
    classed_cost_ms,
    plan_buckets_classed,
)

GEO = ModelGeometry.qwen25_3b(2)


def set_partitions(items):
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in set_partitions(rest):
        for k in range(len(part)):
            yield part[:k] + [[first] + part[k]] + part[k + 1:]
        yield [[first]] + part


def brute_force(lengths, costs, classes):
    best = float("inf")
    for part in set_partitions(list(range(len(lengths)))):
        shapes = [(classes.rows_for(len(b)), classes.width_for(max(lengths[i] for i in b))) for b in part]
        if costs.prefill_max_tokens is not None and any(r * w > costs.prefill_max_tokens for r, w in shapes):
            continue
        best = min(best, sum(classed_cost_ms(len(b), max(lengths[i] for i in b), GEO, costs, classes) for b in part))
    return best


def test_ladders():
    classes = ShapeClasses.ladder(max_width=1000, max_rows=40)
    assert classes.widths == (16, 32, 64, 128, 256, 512, 768, 1000)
    assert classes.rows == (1, 2, 4, 8, 16, 24, 32, 40)
    assert classes.width_for(17) == 32 and classes.width_for(1000) == 1000 and classes.width_for(1500) == 1500
    assert classes.rows_for(3) == 4 and classes.rows_for(41) == 41
    assert ShapeClasses((16, 64)).rows_for(7) == 7 and ShapeClasses((16, 64)).num_shapes == 2
    for bad in ((), (16, 16), (32, 16), (0, 16)):
        with pytest.raises(ValueError, match="ShapeClasses.widths"):
            ShapeClasses(bad)
    with pytest.raises(ValueError, match="ShapeClasses.rows"):
        ShapeClasses((16,), (4, 2))


@pytest.mark.parametrize("seed", range(60))
def test_classed_dp_equals_brute_force(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 7)
    lengths = [rng.choice([rng.randint(1, 40), rng.randint(1, 600)]) for _ in range(n)]
    classes = ShapeClasses(tuple(sorted(rng.sample([8, 16, 32, 64, 100, 128, 256, 512, 640], 4))),
                           rng.choice([(), (1, 2, 4, 8), (2, 3, 5)]))
    costs = CostCoefficients(prefill_fixed_cost_ms=rng.choice([0.5, 5.0, 25.0]),
                             prefill_max_tokens=rng.choice([None, 4096]))
    plan = plan_buckets_classed(lengths, GEO, costs, classes)
    assert sorted(i for b in plan.buckets for i in b) == list(range(n))
    assert plan.cost_ms == pytest.approx(brute_force(lengths, costs, classes), rel=1e-9)
    for bucket, width, rows in zip(plan.buckets, plan.widths, plan.rows):
        assert width == classes.width_for(max(lengths[i] for i in bucket))
        assert rows == classes.rows_for(len(bucket))


@pytest.mark.parametrize("seed", range(60))
def test_classed_dp_with_captured_shapes_equals_brute_force(seed):
    """With some class shapes captured and a new one priced at its first use, a bucket runs at its
    class shape (first use included) or a larger captured shape, whichever costs less; the DP is
    still the cheapest of every set partition."""
    rng = random.Random(1000 + seed)
    n = rng.randint(1, 7)
    lengths = [rng.choice([rng.randint(1, 40), rng.randint(1, 600)]) for _ in range(n)]
    ladder = ShapeClasses(tuple(sorted(rng.sample([8, 16, 32, 64, 100, 128, 256, 512, 640], 4))),
                          rng.choice([(), (1, 2, 4, 8), (2, 3, 5)]))
    shapes = [(r, w) for r in (ladder.rows or (1, 2, 3, 4, 5, 6, 7)) for w in ladder.widths]
    costs = CostCoefficients(prefill_fixed_cost_ms=rng.choice([0.5, 5.0, 25.0]),
                             prefill_max_tokens=rng.choice([None, 4096]))
    classes = ladder.priced_captures(frozenset(rng.sample(shapes, rng.randint(1, min(6, len(shapes))))),
                                     rng.choice([1.0, 40.0, 4000.0]), max_tokens=rng.choice([None, 2048]))
    plan = plan_buckets_classed(lengths, GEO, costs, classes)
    assert sorted(i for b in plan.buckets for i in b) == list(range(n))
    assert plan.cost_ms == pytest.approx(brute_force(lengths, costs, classes), rel=1e-9)
    for bucket, width, rows in zip(plan.buckets, plan.widths, plan.rows):
        longest = max(lengths[i] for i in bucket)
        assert (rows, width) == class_shape(len(bucket), longest, GEO, costs, classes)[:2]
        assert rows >= len(bucket) and width >= longest
        assert (rows, width) in classes.captured or (rows, width) == (ladder.rows_for(len(bucket)), ladder.width_for(longest))


def test_a_refit_keeps_to_the_captured_shapes_unless_new_ones_pay_their_capture_back():
    """The plan a warm-up's costs gave is captured; a refit that makes a forward nearly free of fixed
    cost would split the prompts into many small buckets, each a new class to capture. Priced at
    what a capture costs over CAPTURE_PAYBACK_CALLS calls, the plan keeps the captured shapes when
    captures are dear and moves when they are cheap."""
    rng = random.Random(7)
    lengths = [rng.randint(100, 1024) for _ in range(256)]
    ladder = ShapeClasses.covering(max(lengths), 256)
    warm = plan_buckets_classed(lengths, GEO, CostCoefficients(), ladder)
    refit = CostCoefficients(prefill_fixed_cost_ms=0.05)
    moved = plan_buckets_classed(lengths, GEO, refit, ladder)
    captured = frozenset(zip(warm.rows, warm.widths))
    assert not set(zip(moved.rows, moved.widths)) <= captured  # unpriced, the refit needs new classes
    dear = plan_buckets_classed(lengths, GEO, refit, ladder.priced_captures(captured, 3000.0, max_tokens=None))
    assert set(zip(dear.rows, dear.widths)) <= captured
    free = plan_buckets_classed(lengths, GEO, refit, ladder.priced_captures(captured, 0.0, max_tokens=None))
    assert (free.rows, free.widths, free.cost_ms) == (moved.rows, moved.widths, moved.cost_ms)
    cheap = plan_buckets_classed(lengths, GEO, refit, ladder.priced_captures(captured, 1e-3, max_tokens=None))
    assert not set(zip(cheap.rows, cheap.widths)) <= captured
    assert moved.cost_ms <= cheap.cost_ms <= moved.cost_ms + 1e-3 * len(moved.buckets)
    # a class past max_capture_tokens is never captured, so its first use costs nothing more
    priced = ladder.priced_captures(captured, 3000.0, max_tokens=4096)
    assert priced.first_use_ms == 3000.0 / CAPTURE_PAYBACK_CALLS
    assert priced.first_use_cost_ms(16, 512) == 0.0 and priced.first_use_cost_ms(4, 512) == priced.first_use_ms
    assert priced.first_use_cost_ms(*next(iter(captured))) == 0.0
    for field, bad in (("captured", {(1, 16)}), ("captured", ((0, 16),)), ("captured", ((True, 16),)), ("first_use_ms", -1.0),
                       ("first_use_ms", float("inf")), ("max_capture_tokens", 0)):
        with pytest.raises(ValueError, match=f"ShapeClasses.{field}"):
            ShapeClasses((16,), **{field: bad})


def test_the_rollout_prices_new_classes_by_its_graphs_captures():
    """Rollout.prefill_classes adds the kept graphs' shapes and their capture estimate (the median of
    the captures after the first, which compiled), and leaves the ladder unpriced before any capture
    and once no more classes can be captured."""
    from types import SimpleNamespace

    from conftest import get_tiny

    from rollout_lab import Rollout, RolloutConfig
    from rollout_lab.engine.runner.prefill_graphs import PrefillGraphs

    def graphs(captures: dict[str, float], max_graphs: int = 32):
        shapes = {tuple(map(int, key.split("x"))): None for key in captures}
        fake = SimpleNamespace(class_capture_ms=captures, shapes=shapes, max_graphs=max_graphs, max_tokens=8192)
        fake.capture_estimate_ms = lambda: PrefillGraphs.capture_estimate_ms(fake)
        return fake

    assert graphs({}).capture_estimate_ms() is None
    assert graphs({"8x256": 30000.0}).capture_estimate_ms() == 30000.0
    assert graphs({"8x256": 30000.0, "4x512": 300.0, "2x128": 100.0, "16x64": 200.0}).capture_estimate_ms() == 200.0
    assert graphs({"8x256": 30000.0, "4x512": 300.0}, max_graphs=2).capture_estimate_ms() is None
    ladder = ShapeClasses((64, 256, 512), (2, 4, 8, 16))
    rollout = Rollout(get_tiny("qwen2"), RolloutConfig(prefill_classes=ladder))
    assert rollout.prefill_classes([10, 20], 2) == ladder  # nothing captured yet
    rollout.runner.prefill_graphs = graphs({"8x256": 30000.0, "4x512": 300.0})
    priced = rollout.prefill_classes([10, 20], 2)
    assert priced.captured == ((4, 512), (8, 256)) and priced.max_capture_tokens == 8192
    assert priced.first_use_ms == 300.0 / CAPTURE_PAYBACK_CALLS and priced.widths == ladder.widths


def test_classes_change_the_plan():
    """Unrounded, two buckets; at a width ladder of (64, 1024) the short prompts' class is 64 anyway
    but a 300-token prompt pays 1024: it joins the long bucket."""
    from rollout_lab.planner.bucket_dp import plan_buckets

    lengths = [1000, 300] + [20] * 30
    costs = CostCoefficients()
    plain = plan_buckets(lengths, GEO, costs)
    classed = plan_buckets_classed(lengths, GEO, costs, ShapeClasses((64, 1024)))
    assert classed.widths[-1] == 1024 and all(w in (64, 1024) for w in classed.widths)
    assert plain != classed
    assert classed.num_padded_tokens >= sum(lengths)


def test_a_class_over_the_limit_is_named():
    with pytest.raises(ValueError, match="runs at class width 512, over prefill_max_tokens=400"):
        plan_buckets_classed([300], GEO, CostCoefficients(prefill_max_tokens=400), ShapeClasses((16, 512)))


# ---------------------------------------------------------------- the engine at class shapes

def _prompts(lengths, seed=0):
    from rollout_lab.measure.models import TINY_VOCAB_SIZE

    rng = random.Random(seed)
    return [[rng.randrange(1, TINY_VOCAB_SIZE) for _ in range(n)] for n in lengths]


@pytest.mark.parametrize("slots", [None, 3])
def test_engine_at_class_shapes_matches_oracle(family, slots, oracle):
    from conftest import get_tiny

    from rollout_lab import Rollout, RolloutConfig

    model = get_tiny(family)
    prompts = _prompts([7, 2, 15, 1, 9, 4, 11, 30], seed=2)
    budgets = [5, 9, 2, 7, 1, 6, 3, 4]
    expected = [oracle(model, [p], max_new_tokens=b, repetition_penalty=1.2)[0] for p, b in zip(prompts, budgets)]
    classes = ShapeClasses((8, 16, 32), (1, 2, 4, 8))
    for mode in ("bucketed", "auto"):
        config = RolloutConfig(mode=mode, prefill_classes=classes, continuous_batch_size=slots, profile=True,
                               repetition_penalty=1.2,
                               costs=CostCoefficients(prefill_fixed_cost_ms=0.05, continuous_decode_cost_ms=0.0))
        result = Rollout(model, config).generate(prompts, max_new_tokens=budgets)
        assert result.sequences == expected, (mode, slots)
        if result.route == "bucketed":
            shapes = {(f["batch"], f["width"]) for f in result.profile.forwards if f["kind"] == "prefill"}
            assert all(b in classes.rows and w in classes.widths for b, w in shapes), shapes


def test_engine_at_class_shapes_with_chunked_prompts(oracle):
    from conftest import get_tiny

    from rollout_lab import Rollout, RolloutConfig

    model = get_tiny("qwen3")
    prompts = _prompts([40, 5, 3, 70, 16, 17, 1], seed=7)
    config = RolloutConfig(mode="bucketed", prefill_classes=ShapeClasses((8, 16, 32), (1, 2, 4)),
                           costs=CostCoefficients(prefill_max_tokens=32), continuous_batch_size=3)
    result = Rollout(model, config).generate(prompts, max_new_tokens=5)
    assert sum(len(t) for plan in result.plans for _, t in plan.chunks) > 0
    assert result.sequences == oracle(model, prompts, max_new_tokens=5)


def test_engine_replays_a_larger_captured_shape_with_the_oracle_tokens(oracle):
    """With a new class priced dear, buckets run at a captured shape wider and with more rows than
    they need (left padding and repeated rows, dropped), and the tokens are the one-request oracle's."""
    from types import SimpleNamespace

    from conftest import get_tiny

    from rollout_lab import Rollout, RolloutConfig

    model = get_tiny("qwen2")
    prompts = _prompts([7, 2, 15, 1, 9, 4, 11, 30], seed=4)
    budgets = [5, 9, 2, 7, 1, 6, 3, 4]
    expected = [oracle(model, [p], max_new_tokens=b)[0] for p, b in zip(prompts, budgets)]
    rollout = Rollout(model, RolloutConfig(mode="bucketed", prefill_classes=ShapeClasses((8, 16, 32), (1, 2, 4, 8)),
                                           costs=CostCoefficients(prefill_fixed_cost_ms=0.05), profile=True))
    # what the kept graphs would say: one 8x32 class captured, a capture costs a second
    rollout.runner.prefill_graphs = SimpleNamespace(shapes={(8, 32): None}, max_tokens=8192, num_captures=1,
                                              capture_estimate_ms=lambda: 1000.0, close=lambda: None)
    result = rollout.generate(prompts, max_new_tokens=budgets)
    shapes = [(f["batch"], f["width"]) for f in result.profile.forwards if f["kind"] == "prefill"]
    assert shapes == [(8, 32)]
    assert result.sequences == expected


def test_bad_class_settings_are_named():
    from conftest import get_tiny

    from rollout_lab import RolloutConfig
    from rollout_lab.engine.runner.prefill import prefill_bucket

    with pytest.raises(ValueError, match="prefill_classes must be a ShapeClasses, 'auto' or None"):
        RolloutConfig(prefill_classes=(16, 32))
    with pytest.raises(ValueError, match="prefill_classes must be a ShapeClasses, 'auto' or None, got 'ladder'"):
        RolloutConfig(prefill_classes="ladder")
    for bad in ("yes", 1, None):
        with pytest.raises(ValueError, match="prefill_graphs must be 'auto', True or False"):
            RolloutConfig(prefill_graphs=bad)
    with pytest.raises(ValueError, match=r"class shape \(1, 16\) cannot hold 2 prompts"):
        prefill_bucket(get_tiny("qwen2"), [[1, 2], [3]], pad_token_id=0, cache_kwarg="cache", rows=1, width=16)


def test_calibration_grid_of_the_classes():
    from rollout_lab.measure.calibrate import CalibrationGrid

    classes = ShapeClasses((16, 64, 256), (1, 4, 16))
    grid = CalibrationGrid.for_classes(classes, repeats=2)
    assert grid.widths == classes.widths and grid.batches == classes.rows and grid.repeats == 2
    assert CalibrationGrid.for_classes(ShapeClasses((16, 64))).batches == CalibrationGrid().batches


def test_covering_ladders_grow_by_rungs_on_top():
    """A call's "auto" ladder: its top rungs hold the call (widths to 256s, rows to 32 or 16s), and
    a larger call's ladder keeps every rung of a smaller one's (so earlier graphs stay in use)."""
    small, large = ShapeClasses.covering(300, 20), ShapeClasses.covering(1500, 200)
    assert small == ShapeClasses.ladder(max_width=512, max_rows=32)
    assert small.widths == (16, 32, 64, 128, 256, 512) and small.rows == (1, 2, 4, 8, 16, 24, 32)
    assert large.widths[-1] == 1536 and large.rows[-1] == 208
    assert set(small.widths) <= set(large.widths) and set(small.rows) <= set(large.rows)
    assert ShapeClasses.covering(256, 32) == ShapeClasses.covering(1, 1)
    for longest in (1, 255, 256, 257, 2049):
        for rows in (1, 31, 33, 100):
            classes = ShapeClasses.covering(longest, rows)
            assert classes.widths[-1] >= longest and classes.rows[-1] >= rows
            assert classes.width_for(longest) <= longest + 255
    with pytest.raises(ValueError, match="longest and max_rows must be >= 1"):
        ShapeClasses.covering(0, 4)


def test_auto_prefill_is_classes_and_graphs_on_cuda_only(tmp_path):
    """RolloutConfig() prefills at the covering ladder with captured graphs on CUDA; on a CPU it runs
    every bucket at its own shape; a calibration made without graphs keeps "auto" graphs off."""
    import json

    import torch
    from conftest import get_tiny

    from rollout_lab import Rollout, RolloutConfig
    from rollout_lab.engine.runner.runner import resolve_prefill_graphs as resolve

    def resolve_prefill_graphs(config, device):
        return resolve(config.prefill_graphs, classes=config.prefill_classes, costs=config.costs, device=device)

    config = RolloutConfig()
    assert config.prefill_classes == "auto" and config.prefill_graphs == "auto"
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert resolve_prefill_graphs(config, cuda) and not resolve_prefill_graphs(config, cpu)
    assert not resolve_prefill_graphs(RolloutConfig(prefill_classes=None), cuda)
    assert not resolve_prefill_graphs(RolloutConfig(prefill_graphs=False), cuda)
    eager_file, graph_file = tmp_path / "eager.json", tmp_path / "graph.json"
    for path, graphs in ((eager_file, False), (graph_file, True)):
        path.write_text(json.dumps({"coefficients": CostCoefficients().to_dict(),
                                    "metadata": {"grid": {"prefill_graphs": graphs}}}))
    assert not resolve_prefill_graphs(RolloutConfig(costs=eager_file), cuda)
    assert resolve_prefill_graphs(RolloutConfig(costs=graph_file), cuda)
    rollout = Rollout(get_tiny("qwen2"))
    assert rollout.runner.captures_prefill is False and rollout.prefill_classes([5, 300], 64) is None
    fixed = ShapeClasses((16, 64))
    assert Rollout(get_tiny("qwen2"), RolloutConfig(prefill_classes=fixed)).prefill_classes([5], 4) is fixed
    rollout.device = cuda  # what a CUDA rollout would plan at (no GPU needed to ask)
    assert rollout.prefill_classes([5, 300], 64) == ShapeClasses.covering(300, 64)
    # captured with the whole model compiled: no 1-row class, which would compile the model again
    rollout.runner.captures_prefill, rollout.runner.compiled = True, True
    assert rollout.prefill_classes([5, 300], 64) == ShapeClasses.covering(300, 64, smallest_rows=2)
    # layer by layer (CUDA's default) a 1-row class costs one layer's trace: one prompt runs alone
    for compiled in ("layers", False):
        rollout.runner.compiled = compiled
        assert rollout.prefill_classes([5, 300], 64) == ShapeClasses.covering(300, 64), compiled


def test_smallest_rows_two_drops_the_one_row_rung_and_runs_one_prompt_as_two_rows():
    classes = ShapeClasses.covering(300, 20, smallest_rows=2)
    assert classes.rows == (2, 4, 8, 16, 24, 32) and classes.widths == ShapeClasses.covering(300, 20).widths
    assert classes.rows_for(1) == 2 and classes.rows_for(3) == 4
    assert ShapeClasses.ladder(64, 1, smallest_rows=2).rows == (2,)
    geometry, costs = ModelGeometry.qwen25_3b(), CostCoefficients()
    plan = plan_buckets_classed([300], geometry, costs, classes)  # one prompt, priced and run at 2 rows
    assert plan.rows == (2,) and plan.widths == (512,)
    with pytest.raises(ValueError, match="smallest_rows must be 1 or 2, got 0"):
        ShapeClasses.ladder(64, 8, smallest_rows=0)


def test_prefill_graphs_need_classes_and_cuda():
    from conftest import get_tiny

    from rollout_lab import Rollout, RolloutConfig

    with pytest.raises(ValueError, match=r"give prefill_classes \(a ShapeClasses or 'auto'\) too"):
        RolloutConfig(prefill_graphs=True, prefill_classes=None)
    with pytest.raises(ValueError, match="prefill_graphs=True needs a CUDA device"):
        Rollout(get_tiny("qwen2"), RolloutConfig(prefill_graphs=True))  # "auto" classes: graphs only on CUDA
    with pytest.raises(ValueError, match="max_prefill_graphs must be an int >= 1"):
        RolloutConfig(max_prefill_graphs=0)
    config = RolloutConfig(prefill_graphs=True, prefill_classes=ShapeClasses((16, 64)))
    with pytest.raises(ValueError, match="prefill_graphs=True needs a CUDA device"):
        Rollout(get_tiny("qwen2"), config)


cuda = pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU")


@cuda
@pytest.mark.parametrize("compile", [False, True, "layers"])
@pytest.mark.parametrize("family", ["qwen2", "opt"])
def test_cuda_prefill_graphs_equal_eager(family, compile, oracle):
    """fp32: class-shape prefill by graph replay gives eager's tokens (and the oracle's), with refill,
    chunked prompts and per-request budgets; weights replaced in the same layout are copied in, another layout is recaptured; past the cap
    a class runs eagerly."""
    import torch
    from conftest import get_tiny

    from rollout_lab import Rollout, RolloutConfig
    from rollout_lab.measure.models import tiny_model

    model = tiny_model(family, seed=0).to("cuda")
    prompts = _prompts([40, 5, 3, 70, 16, 17, 1, 9, 12, 2], seed=3)
    budgets = [4, 7, 2, 5, 9, 1, 3, 6, 8, 2]
    expected = [oracle(get_tiny(family), [p], max_new_tokens=b)[0] for p, b in zip(prompts, budgets)]
    classes = ShapeClasses((8, 16, 32), (1, 2, 4))
    common = dict(mode="bucketed", prefill_classes=classes, continuous_batch_size=4, profile=True,
                  costs=CostCoefficients(prefill_max_tokens=32, prefill_fixed_cost_ms=0.05))
    eager = Rollout(model, RolloutConfig(**common)).generate(prompts, max_new_tokens=budgets)
    with Rollout(model, RolloutConfig(prefill_graphs=True, compile=compile, **common)) as rollout:
        graph = rollout.generate(prompts, max_new_tokens=budgets)
        again = rollout.generate(prompts, max_new_tokens=budgets)
        graphs = rollout.runner.prefill_graphs
        assert graphs.num_captures >= 2 and graphs.num_replays > graphs.num_captures
        info = rollout.prefill_graph_info  # each class's capture, its compile included
        assert len(info["class_capture_ms"]) == info["num_captures"] == graphs.num_captures
        assert sum(info["class_capture_ms"].values()) == pytest.approx(info["capture_ms"])
        captures = graphs.num_captures
        assert again.sequences == graph.sequences and graphs.num_captures == captures  # replayed, not recaptured
        head = model.get_output_embeddings()
        model.load_state_dict({k: v.detach().clone() for k, v in model.state_dict().items()}, assign=True)
        assert rollout.generate(prompts, max_new_tokens=budgets).sequences == graph.sequences
        assert rollout.runner.prefill_graphs is graphs and graphs.num_captures == captures  # copied in, not recaptured
        head.weight = torch.nn.Parameter(head.weight.detach().t().contiguous().t())  # another layout
        assert rollout.generate(prompts, max_new_tokens=budgets).sequences == graph.sequences
        assert rollout.runner.prefill_graphs is not graphs
    assert graph.profile.prefill_backend == "graph" and graphs.compiled == compile
    assert graph.sequences == eager.sequences == expected
    capped = Rollout(model, RolloutConfig(prefill_graphs=True, max_prefill_graphs=1, compile=compile, **common))
    assert capped.generate(prompts, max_new_tokens=budgets).sequences == expected
    assert capped.runner.prefill_graphs.num_captures == 1 and capped.runner.prefill_graphs.num_eager > 0
    # past the cap the compiled layers run (their symbolic sizes serve any class), the model otherwise
    expected_eager = capped.runner.prefill_graphs.forward if compile == "layers" else model
    assert capped.runner.prefill_graphs.eager is expected_eager
    capped.close()
