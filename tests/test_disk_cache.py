"""costs="auto" (engine.runner.disk_cache): the cache of coefficients per setting, found by provenance,
refined online and saved back; on a CPU the reference's coefficients, and nothing written."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import get_tiny

from rollout_lab import Rollout, RolloutConfig
from rollout_lab.engine.runner.disk_cache import CACHE_ENV, cache_dir, cached_cost_file, cost_cache_path, save_costs
from rollout_lab.engine.model_info import model_metadata
from rollout_lab.planner.cost import CostCoefficients
from rollout_lab.planner.fit import OnlineCalibrator


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    return tmp_path / "costs"


def test_a_saved_setting_is_found_by_its_provenance_only(cache):
    meta = model_metadata(get_tiny("qwen2"), prefill_graphs=True)
    assert cache_dir() == cache and cached_cost_file(meta) is None
    costs = dataclasses.replace(CostCoefficients(), prefill_fixed_cost_ms=3.25)
    path = save_costs(costs, meta, source="test")
    assert path == cost_cache_path(meta) and path.parent == cache
    assert cached_cost_file(meta).costs == costs
    assert cached_cost_file({**meta, "dtype": "bfloat16"}) is None  # another dtype
    assert cached_cost_file({**meta, "prefill_graphs": False}) is None  # priced captured forwards
    major, minor, *_ = torch.__version__.split(".")
    patched = {**meta, "torch": f"{major}.{minor}.99"}  # a patch release apart: the same file serves
    assert cached_cost_file(patched).costs == costs and cost_cache_path(patched) != path
    (cache / "broken.json").write_text("{not json")
    with pytest.warns(UserWarning, match="skipping an unreadable cached cost file"):
        assert cached_cost_file({**meta, "dtype": "float16"}) is None
    assert (cache / "broken.json").exists()  # never deleted


def test_cost_names_and_errors():
    assert RolloutConfig().costs == "auto"
    assert RolloutConfig(costs="reference").costs == CostCoefficients()
    with pytest.raises(ValueError, match="cost file 'no-such-costs.json' does not exist|no-such-costs.json"):
        RolloutConfig(costs="no-such-costs.json")
    with pytest.raises(ValueError, match="costs must be 'auto', 'reference', a CostCoefficients or a cost file path"):
        RolloutConfig(costs=3)


def test_auto_on_a_cpu_is_the_reference_and_writes_nothing(cache):
    rollout = Rollout(get_tiny("qwen2"))
    assert rollout.costs == CostCoefficients() and rollout.online is None
    assert rollout.costs_source == "the reference's coefficients"
    rollout.generate([[5, 6, 7], [8, 9]], max_new_tokens=4)
    assert not cache.exists()


def test_auto_learning_saves_the_refit_for_the_next_process(cache):
    """What a CUDA rollout with costs="auto" does after each call, run on the CPU by giving the
    rollout the setting's metadata and learner that CUDA would: the refit lands in the cache and is
    what the next lookup finds."""
    model = get_tiny("qwen2")
    rollout = Rollout(model)
    meta = model_metadata(model, prefill_graphs=False)
    rollout._cache_metadata = meta
    rollout.online = OnlineCalibrator(rollout.geometry, rollout.costs, window=256)
    prompts = [[3 + i] * n for i, n in enumerate((5, 9, 14, 30, 7, 21, 2, 11))]
    for _ in range(3):
        rollout.generate(prompts, max_new_tokens=6)
    assert rollout.costs != CostCoefficients()  # refitted from its own forwards
    found = cached_cost_file(meta)
    assert found is not None and found.costs == rollout.costs
    assert found.metadata["source"].startswith("online refit")
    assert not rollout.online.errors[-1]["explored"]  # the default never detours to measure another route


@pytest.mark.slow  # an inductor compile on the CPU
def test_compiled_artifacts_round_trip_through_the_cache(cache):
    """compile_cache: what this process compiled is saved per setting and loaded back (torch.compile's
    portable cache); nothing saved, nothing loaded; a damaged file is skipped with a warning."""
    from rollout_lab.engine.runner.disk_cache import compiled_cache_path, load_compiled, save_compiled

    meta = model_metadata(get_tiny("qwen2"), prefill_graphs=True)
    assert load_compiled(meta) == 0  # no file yet
    torch._dynamo.reset()
    square = torch.compile(lambda x: x * x + 1, backend="inductor")
    assert torch.equal(square(torch.arange(4.0)), torch.arange(4.0) ** 2 + 1)
    path = save_compiled(meta)
    assert path == compiled_cache_path(meta) and path.is_file() and path.stat().st_size > 0
    torch._dynamo.reset()
    assert load_compiled(meta) > 0
    path.write_bytes(b"not a cache")
    with pytest.warns(UserWarning, match="skipping the compile cache"):
        assert load_compiled(meta) == 0
    assert path.exists()  # never deleted


def test_compile_cache_is_a_cuda_compile_setting(cache):
    rollout = Rollout(get_tiny("qwen2"))  # a CPU: no compile, so nothing is loaded or saved
    assert rollout._compiled_metadata is None and rollout.compiled_artifacts_loaded == 0
    rollout.generate([[5, 6, 7]], max_new_tokens=3)
    assert not (cache.parent / "compiled").exists()
    with pytest.raises(ValueError, match="compile_cache must be a bool"):
        RolloutConfig(compile_cache="yes")


def test_the_captured_decode_prior_runs_short_batches_on_cb_and_learns_from_them(cache):
    """costs="auto" on CUDA with nothing cached (issue 33): the reference's gap sends 32 short prompts
    x 16 tokens to nocb (HF's eager loop) and nothing there ever measures CB; the prior for a captured
    step prices CB below nocb, and the refit keeps the prior's gap until nocb itself is measured."""
    from rollout_lab.engine.api.costs import CAPTURED_DECODE_GAP_MS, captured_decode_prior

    prior = captured_decode_prior()
    assert prior.nocb_decode_cost_ms - prior.continuous_decode_cost_ms == CAPTURED_DECODE_GAP_MS
    assert prior.prefill_fixed_cost_ms == CostCoefficients().prefill_fixed_cost_ms  # prefill: the reference's
    lengths = [n for n in range(20, 12, -1) for _ in range(4)]  # the seed's short_similar
    model = get_tiny("qwen2")
    assert Rollout(model, RolloutConfig(costs="reference")).route_for(lengths, [16] * 32) == "nocb"
    assert Rollout(model, RolloutConfig(costs=prior)).route_for(lengths, [16] * 32) != "nocb"
    learner = OnlineCalibrator(Rollout(model).geometry, prior, window=16)
    learner.observations.append({"kind": "decode", "ms": 60.0, "steps": 10, "rows": 32, "width": 40})
    refit = learner.refit(prior)
    assert refit.continuous_decode_cost_ms == 6.0 and refit.nocb_decode_cost_ms == 6.0 + CAPTURED_DECODE_GAP_MS


def test_a_calibration_without_a_decode_probe_prices_a_captured_decode_by_the_prior():
    """The H200 calibration of Qwen2.5-3B ran no decode probe (grid decode_batches []) and wrote both
    decode terms as 0: with a captured step Auto took nocb on 32 x 16 tokens (629 ms against 95 on
    CB). A captured decode takes the prior's terms instead; an eager one, or a probed file, as written."""
    from rollout_lab.engine.api.costs import captured_decode_prior, with_unmeasured_decode

    file_costs = CostCoefficients(prefill_fixed_cost_ms=8.5, continuous_decode_cost_ms=0.0, nocb_decode_cost_ms=0.0)
    unprobed = {"grid": {"decode_batches": [], "prefill_graphs": True}}
    costs, note = with_unmeasured_decode(file_costs, unprobed, "graph")
    prior = captured_decode_prior()
    assert (costs.continuous_decode_cost_ms, costs.nocb_decode_cost_ms) == (
        prior.continuous_decode_cost_ms, prior.nocb_decode_cost_ms)
    assert costs.prefill_fixed_cost_ms == 8.5 and "measured no decode" in note  # the prefill terms stay the file's
    for metadata, mode in ((unprobed, "eager"), ({"grid": {"decode_batches": [8, 32]}}, "graph"), ({}, "graph")):
        assert with_unmeasured_decode(file_costs, metadata, mode) == (file_costs, "")
    lengths = [n for n in range(20, 12, -1) for _ in range(4)]  # the seed's short_similar
    model = get_tiny("qwen2")
    assert Rollout(model, RolloutConfig(costs=file_costs)).route_for(lengths, [16] * 32) == "nocb"
    assert Rollout(model, RolloutConfig(costs=costs)).route_for(lengths, [16] * 32) != "nocb"


def test_the_compile_cache_is_used_only_when_no_one_else_can_write_it(cache, monkeypatch):
    """compile_cache loads code from the cache folder: one another user owns or can write is warned of
    once (naming it and why) and neither loaded from nor saved to; a private one is used."""
    from types import SimpleNamespace

    from rollout_lab.engine.runner import disk_cache
    from rollout_lab.engine.runner.disk_cache import compiled_cache_path, load_compiled, save_compiled

    loaded, saved = [], []
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts",
                        lambda data: loaded.append(data) or SimpleNamespace(artifacts={"inductor": ["k"]}))
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: saved.append(1) or (b"artifacts", None))
    monkeypatch.setattr(disk_cache, "_WARNED", set())
    meta = model_metadata(get_tiny("qwen2"), prefill_graphs=True)
    path = save_compiled(meta)
    assert path == compiled_cache_path(meta) and path.stat().st_mode & 0o777 == 0o600
    assert path.parent.stat().st_mode & 0o777 == 0o700
    assert load_compiled(meta) == 1 and loaded == [b"artifacts"]
    root = cache.parent
    root.chmod(0o777)
    try:
        with pytest.warns(UserWarning, match=f"not using the compile cache .*: {str(root)!r} is writable by group "
                                             "and others \\(mode 777\\)") as warned:
            assert load_compiled(meta) == 0 and save_compiled(meta) is None
        assert len(warned) == 1  # once for both, and for every later call
        assert loaded == [b"artifacts"] and saved == [1]
    finally:
        root.chmod(0o700)
    (path.parent).chmod(0o720)
    with pytest.warns(UserWarning, match=f"{str(path.parent)!r} is writable by group \\(mode 720\\)"):
        assert load_compiled(meta) == 0
    path.parent.chmod(0o700)
    me = disk_cache.os.getuid()
    monkeypatch.setattr(disk_cache.os, "getuid", lambda: me + 1)
    with pytest.warns(UserWarning, match=f"{str(root)!r} is owned by uid {me}, not this user \\(uid {me + 1}\\)"):
        assert load_compiled(meta) == 0
    assert loaded == [b"artifacts"]
