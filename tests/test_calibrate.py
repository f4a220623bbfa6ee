import dataclasses
import itertools
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from rollout_lab.cli.main import main as cli_main
from rollout_lab.measure.calibrate import CalibrationGrid, CalibrationResult, calibrate, load_calibration
from rollout_lab.measure.models import tiny_model
from rollout_lab.planner.cost import CostCoefficients, CostFile, ModelGeometry, attention_gflops, kv_mib
from rollout_lab.planner.fit import decode_costs, fit_coefficients, nnls, paged_decode_cost
from rollout_lab.planner.routes import choose_route

ROOT = Path(__file__).resolve().parents[1]

QWEN3B_BF16 = ModelGeometry.qwen25_3b(2)


def _brute_force_nnls(a, b):
    """Best unconstrained solution over every support set whose solution is non-negative."""
    best, best_x = np.inf, None
    for k in range(a.shape[1] + 1):
        for support in itertools.combinations(range(a.shape[1]), k):
            x = np.zeros(a.shape[1])
            if support:
                x[list(support)] = np.linalg.lstsq(a[:, support], b, rcond=None)[0]
            if (x >= -1e-12).all():
                res = np.linalg.norm(a @ x - b)
                if res < best - 1e-12:
                    best, best_x = res, x
    return best_x


@pytest.mark.parametrize("seed", range(20))
def test_nnls_matches_brute_force(seed):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((12, 4)) * rng.uniform(0.01, 100, size=4)  # badly scaled columns
    b = rng.standard_normal(12)
    x = nnls(a, b)
    assert (x >= 0).all()
    assert np.linalg.norm(a @ x - b) == pytest.approx(np.linalg.norm(a @ _brute_force_nnls(a, b) - b), rel=1e-8)


def test_nnls_exact_nonnegative_solution_and_zero_column():
    a = np.array([[1.0, 0.0, 2.0], [1.0, 0.0, 5.0], [1.0, 0.0, 9.0]])
    x = nnls(a, a @ np.array([3.0, 7.0, 0.5]))
    assert x == pytest.approx([3.0, 0.0, 0.5])
    with pytest.raises(ValueError, match="matching rows"):
        nnls(a, np.ones(2))


def _synthetic(costs, copy_fixed_ms, noise, seed):
    shapes = CalibrationGrid().shapes()
    rng = np.random.default_rng(seed)
    fwd_fixed = costs.prefill_fixed_cost_ms - copy_fixed_ms
    forward = [(fwd_fixed + costs.prefill_token_cost_ms * b * w
                + costs.prefill_attention_cost_ms * attention_gflops(b, w, QWEN3B_BF16))
               * (1 + noise * rng.standard_normal()) for b, w in shapes]
    copy = [(copy_fixed_ms + costs.prefill_kv_cost_ms * kv_mib(b, w, QWEN3B_BF16))
            * (1 + noise * rng.standard_normal()) for b, w in shapes]
    return shapes, forward, copy


@pytest.mark.parametrize("seed", range(5))
def test_synthetic_coefficients_are_recovered(seed):
    true = CostCoefficients(20.0, 0.004, 0.02, 0.05, 3.0)
    shapes, forward, copy = _synthetic(true, copy_fixed_ms=1.0, noise=0.02, seed=seed)
    costs, fit, r2 = fit_coefficients(shapes, forward, copy, QWEN3B_BF16, continuous_decode_cost_ms=3.0)
    assert costs.prefill_fixed_cost_ms == pytest.approx(20.0, rel=0.05)
    assert costs.prefill_token_cost_ms == pytest.approx(0.004, rel=0.1)
    assert costs.prefill_attention_cost_ms == pytest.approx(0.02, rel=0.2)
    assert costs.prefill_kv_cost_ms == pytest.approx(0.05, rel=0.1)
    assert costs.continuous_decode_cost_ms == 3.0
    assert r2 > 0.99 and max(abs(r["rel_error"]) for r in fit) < 0.1
    assert {"batch", "width", "measured_ms", "predicted_ms", "rel_error"} <= set(fit[0])


def test_noise_free_fit_is_exact_and_negative_decode_overhead_clips():
    true = CostCoefficients(12.0, 0.01, 0.5, 0.2, 0.0)
    shapes, forward, copy = _synthetic(true, copy_fixed_ms=0.5, noise=0.0, seed=0)
    costs, fit, r2 = fit_coefficients(shapes, forward, copy, QWEN3B_BF16, continuous_decode_cost_ms=-4.0)
    assert costs.prefill_fixed_cost_ms == pytest.approx(12.0, rel=1e-6)
    assert costs.prefill_attention_cost_ms == pytest.approx(0.5, rel=1e-6)
    assert costs.continuous_decode_cost_ms == 0.0
    assert r2 == pytest.approx(1.0) and max(abs(r["rel_error"]) for r in fit) < 1e-6


def test_grid_validation_and_shapes():
    with pytest.raises(ValueError, match="batches"):
        CalibrationGrid(batches=(0, 4))
    with pytest.raises(ValueError, match=">= 2 batches"):
        CalibrationGrid(batches=(4,))
    with pytest.raises(ValueError, match="repeats"):
        CalibrationGrid(repeats=0)
    grid = CalibrationGrid(batches=(1, 32), widths=(16, 1024), max_batch_tokens=4096)
    assert grid.shapes() == [(1, 16), (32, 16), (1, 1024)]
    assert grid.shapes(max_width=512) == [(1, 16), (32, 16)]


@pytest.fixture(scope="module")
def tiny():
    return tiny_model("qwen2")


@pytest.fixture(scope="module")
def calibrated(tiny, tmp_path_factory):
    result = calibrate(tiny, grid=CalibrationGrid.tiny(), model_name="tiny-qwen2", progress=False)
    path = result.save(tmp_path_factory.mktemp("cal") / "tiny.json")
    return result, path


def test_tiny_calibration_end_to_end(calibrated):
    result, path = calibrated
    c = result.costs
    assert all(np.isfinite(v) and v >= 0 for k, v in c.to_dict().items() if k != "prefill_max_tokens")
    # the packed route: every shape with >= 2 prompts timed, and its per-prompt cost fitted
    multi = [(b, w) for b, w in CalibrationGrid.tiny().shapes() if b >= 2]
    assert [(r["prompts"], r["width"]) for r in result.packed] == multi
    assert c.packed_prompt_cost_ms is not None and all(r["measured_ms"] > 0 for r in result.packed)
    assert all(r["backend"] == "segments" for r in result.packed)
    assert len(result.fit) == len(CalibrationGrid.tiny().shapes())
    assert np.isfinite(result.r2) and result.worst_rel_error >= 0
    assert result.decode and result.decode[0]["nocb_ms_per_step"] > 0
    meta = result.metadata
    for field in ("model_name", "geometry", "dtype", "device_name", "attn_implementation", "torch",
                  "transformers", "tf32_matmul", "git_sha", "date", "grid"):
        assert field in meta, field
    assert meta["dtype"] == "float32" and meta["attn_implementation"] == "sdpa"
    read = CostFile.read(path)  # the parser alone, before any check
    assert read.costs == c and read.metadata["fit"]["shapes"][0]["measured_ms"] > 0
    again = CalibrationResult.load(path)
    assert again.costs == c and again.fit == result.fit and again.r2 == pytest.approx(result.r2)
    assert again.packed == result.packed


def test_load_accepts_the_same_run(calibrated, tiny):
    result, path = calibrated
    assert load_calibration(path, model=tiny) == result.costs
    assert load_calibration(path, model=tiny, model_name="tiny-qwen2") == result.costs


def test_load_refuses_a_mismatch_naming_fields(calibrated, tiny, tmp_path):
    result, path = calibrated
    data = json.loads(path.read_text())
    data["metadata"]["torch"] = "0.0.1"
    data["metadata"]["attn_implementation"] = "eager"
    other = tmp_path / "other.json"
    other.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="torch") as err:
        load_calibration(other, model=tiny)
    assert "attn_implementation" in str(err.value) and "dtype" not in str(err.value)
    with pytest.raises(ValueError, match="geometry.*dtype"):
        load_calibration(path, model=tiny_model("qwen2", dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="model_name"):
        load_calibration(path, model=tiny, model_name="qwen2.5-3b")
    assert load_calibration(other, model=tiny, override=True) == result.costs
    data["metadata"] = {}
    other.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="has no provenance metadata"):
        load_calibration(other, model=tiny)
    assert load_calibration(other, model=tiny, override=True) == result.costs


def test_load_refuses_a_calibration_of_the_other_prefill_mode(calibrated, tiny, tmp_path):
    result, path = calibrated  # the tiny grid timed eager prefill forwards
    assert load_calibration(path, model=tiny, prefill_graphs=False) == result.costs
    with pytest.raises(ValueError, match=r"prefill_graphs: file has False, this setting has True.*calibrate --prefill-graphs"):
        load_calibration(path, model=tiny, prefill_graphs=True)
    data = json.loads(path.read_text())
    del data["metadata"]["grid"]["prefill_graphs"]  # a calibration older than the key: eager forwards
    older = tmp_path / "older.json"
    older.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="prefill_graphs: file has False"):
        load_calibration(older, model=tiny, prefill_graphs=True)
    data["metadata"]["grid"]["prefill_graphs"] = True
    captured = tmp_path / "captured.json"
    captured.write_text(json.dumps(data))
    assert load_calibration(captured, model=tiny, prefill_graphs=True) == result.costs
    with pytest.raises(ValueError, match="prefill_graphs: file has True, this setting has False"):
        load_calibration(captured, model=tiny, prefill_graphs=False)
    assert load_calibration(captured, model=tiny, prefill_graphs=False, override=True) == result.costs
    assert load_calibration(captured, model=tiny) == result.costs  # a setting that does not say is not checked
    del data["metadata"]["grid"]
    bare = tmp_path / "bare.json"  # no grid (not written by calibrate): nothing to check it against
    bare.write_text(json.dumps(data))
    assert load_calibration(bare, model=tiny, prefill_graphs=True) == result.costs


def test_calibrate_rejects_a_dtype_that_is_not_the_models(tiny):
    with pytest.raises(ValueError, match="dtype"):
        calibrate(tiny, dtype=torch.bfloat16, progress=False)


@pytest.mark.parametrize("argv, message", [
    (["--device", "tpu"], "--device"),
    (["--device", "cuda:0"] if not torch.cuda.is_available() else ["--device", "nope"], "--device"),
    (["--tiny", "gpt5"], "unknown --tiny family"),
    (["--preset", "qwen9"], "unknown --preset"),
    (["--tiny", "qwen2", "--device", "cpu", "--prefill-graphs"], "--prefill-graphs captures CUDA graphs"),
])
def test_cli_errors_before_any_work(argv, message, monkeypatch, capsys):
    monkeypatch.setattr("rollout_lab.measure.calibrate.calibrate", lambda *a, **k: pytest.fail("calibrated despite bad arguments"))
    assert cli_main(["calibrate", *argv, "--out", "/nonexistent/x.json"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and err.count("\n") == 1 and message in err


def test_cli_rejects_a_bad_dtype(capsys):
    assert cli_main(["calibrate", "--tiny", "qwen2", "--dtype", "float12"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "invalid choice" in err and err.count("\n") == 1


def test_decode_costs_keep_the_reference_form_or_give_both():
    slower = [{"cb_ms_per_step": 12.0, "nocb_ms_per_step": 10.0}, {"cb_ms_per_step": 14.0, "nocb_ms_per_step": 10.0}]
    assert decode_costs(slower) == pytest.approx((3.0, 0.0))
    faster = [{"cb_ms_per_step": 6.0, "nocb_ms_per_step": 30.0}]
    assert decode_costs(faster) == (6.0, 30.0)
    assert decode_costs([]) == (0.0, 0.0)


def test_paged_decode_cost_is_the_paged_steps_surplus():
    records = [{"cb_ms_per_step": 5.0, "paged_ms_per_step": 6.0}, {"cb_ms_per_step": 4.0, "paged_ms_per_step": 5.5}]
    assert paged_decode_cost(records) == pytest.approx(1.25)
    assert paged_decode_cost([{"cb_ms_per_step": 5.0, "paged_ms_per_step": 4.0}]) == 0.0  # never below 0
    assert paged_decode_cost([{"cb_ms_per_step": 5.0}]) == 0.0  # not measured


@pytest.mark.slow  # two calibrations
def test_tiny_calibration_with_the_paged_probe(tiny):
    """paged_decode=True times the paged route in the decode probe: its per-step time is in every
    record, its surplus over the aligned step is the coefficient, and the cost file keeps it."""
    grid = dataclasses.replace(CalibrationGrid.tiny(), paged_decode=True, packed=False, repeats=1, decode_repeats=2)
    result = calibrate(tiny, grid=grid, model_name="tiny-qwen2", progress=False)
    assert all(r["paged_ms_per_step"] > 0 and "paged_5" in r["samples_ms"] for r in result.decode)
    assert result.costs.paged_decode_cost_ms == paged_decode_cost(result.decode)
    assert result.metadata["grid"]["paged_decode"] is True
    plain = calibrate(tiny, grid=dataclasses.replace(grid, paged_decode=False), model_name="tiny-qwen2", progress=False)
    assert plain.costs.paged_decode_cost_ms == 0.0 and all("paged_ms_per_step" not in r for r in plain.decode)
    with pytest.raises(ValueError, match="CalibrationGrid.paged_decode must be True or False, got 1"):
        CalibrationGrid(paged_decode=1)


def test_auto_adds_the_paged_steps_surplus():
    """A paged step dearer than the aligned one by more than the saved steps are worth keeps Auto on
    the aligned cache; the older cost files without the term read as 0."""
    geometry = ModelGeometry.qwen25_3b()
    common = dict(max_new_tokens=100, geometry=geometry, continuous_batch_size=4, paged_allowed=True,
                  response_lengths={5: 0.9, 100: 0.1})
    free = choose_route([10] * 40, costs=CostCoefficients(), **common)
    dear = choose_route([10] * 40, costs=CostCoefficients(paged_decode_cost_ms=50.0), **common)
    assert free.route == "paged" and dear.route != "paged" and dear.paged_cost_ms > free.paged_cost_ms
    data = CostCoefficients().to_dict()
    del data["paged_decode_cost_ms"]
    assert CostCoefficients.from_dict(data).paged_decode_cost_ms == 0.0


@pytest.mark.parametrize("fixed", [0.0, 20.0])
def test_fit_packed_costs_recovers_known_costs(fixed):
    from rollout_lab.measure.calibrate import fit_packed_costs
    from rollout_lab.planner.cost import CostCoefficients, ModelGeometry, packed_prefill_cost_ms

    geometry, costs = ModelGeometry.qwen25_3b(2), CostCoefficients()
    truth = CostCoefficients(packed_prompt_cost_ms=0.8, packed_fixed_cost_ms=fixed)
    packed = [{"prompts": b, "width": w, "measured_ms": packed_prefill_cost_ms([w] * b, geometry, truth)}
              for b, w in [(2, 16), (8, 64), (32, 128)]]
    got_fixed, per_prompt, records = fit_packed_costs(packed, geometry, costs)
    assert got_fixed == pytest.approx(fixed, abs=1e-6) and per_prompt == pytest.approx(0.8)
    assert all(abs(r["rel_error"]) < 1e-9 for r in records)
    cheaper = [dict(r, measured_ms=r["measured_ms"] - 100.0) for r in packed]  # faster than shared terms
    assert fit_packed_costs(cheaper, geometry, costs)[:2] == (0.0, 0.0)  # clipped at zero


def test_the_packed_fixed_cost_prices_every_packed_forward():
    from rollout_lab.planner.cost import CostCoefficients, ModelGeometry, packed_prefill_cost_ms

    geometry = ModelGeometry.qwen25_3b(2)
    base = CostCoefficients(packed_prompt_cost_ms=0.5)
    dearer = CostCoefficients(packed_prompt_cost_ms=0.5, packed_fixed_cost_ms=20.0)
    assert packed_prefill_cost_ms([30, 40], geometry, dearer) == pytest.approx(
        packed_prefill_cost_ms([30, 40], geometry, base) + 20.0)
    assert packed_prefill_cost_ms([], geometry, dearer) == 0.0
    assert CostCoefficients.from_dict({k: v for k, v in dearer.to_dict().items()
                                       if k != "packed_fixed_cost_ms"}).packed_fixed_cost_ms == 0.0  # older files
    with pytest.raises(ValueError, match="packed_fixed_cost_ms must be finite and >= 0"):
        CostCoefficients(packed_fixed_cost_ms=-1.0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="prefill graphs are CUDA graphs")
def test_measure_prefill_by_graph_replay_times_every_shape_and_keeps_the_kv():
    from rollout_lab.measure.calibrate import CalibrationGrid, measure_prefill
    from rollout_lab.measure.models import tiny_model

    model = tiny_model("qwen2").to("cuda")
    grid = CalibrationGrid(batches=(1, 4), widths=(8, 32), repeats=2, prefill_graphs=True)
    records = measure_prefill(model, grid, progress=False)
    assert [(r["batch"], r["width"]) for r in records] == [(1, 8), (4, 8), (1, 32), (4, 32)]
    assert all(len(r["forward_samples_ms"]) == 2 and r["forward_ms"] > 0 for r in records)


def test_a_bad_fit_warns_in_the_record_and_on_the_console(tiny, tmp_path, monkeypatch):
    """Synthetic prefill times no C(B, L) can fit (noise, not a cost model): R² and the worst shape
    error are past their limits, so the result, its saved file and a warning all say so."""
    from rollout_lab.measure import calibrate as calibrate_module
    from rollout_lab.measure.calibrate import MAX_REL_ERROR, MIN_R2, fit_warnings

    noisy = [30.0, 1.0, 25.0, 2.0, 40.0, 0.5, 28.0, 3.0, 35.0]  # ms, unrelated to batch and width
    shapes = [(b, w) for w in (8, 32, 128) for b in (1, 4, 16)]
    prefill = [{"batch": b, "width": w, "forward_ms": ms, "kv_copy_ms": 0.01, "forward_iqr_ms": 0.0,
                "kv_copy_iqr_ms": 0.0, "forward_samples_ms": [ms], "kv_copy_samples_ms": [0.01]}
               for (b, w), ms in zip(shapes, noisy)]
    monkeypatch.setattr(calibrate_module, "measure_prefill", lambda *a, **k: prefill)
    monkeypatch.setattr(calibrate_module, "measure_decode_overhead", lambda *a, **k: [])
    grid = CalibrationGrid(batches=(1, 4, 16), widths=(8, 32, 128), packed=False)
    with pytest.warns(UserWarning, match="R² .* below 0.9.*predicted .* off"):
        result = calibrate(tiny, grid=grid, model_name="tiny-qwen2", progress=False)
    assert result.r2 < MIN_R2 and result.worst_rel_error > MAX_REL_ERROR
    assert len(result.warnings) == 3 and "recalibrate" in result.warnings[-1]
    path = result.save(tmp_path / "bad.json")
    assert json.loads(path.read_text())["metadata"]["fit"]["warnings"] == list(result.warnings)
    assert CalibrationResult.load(path).warnings == result.warnings
    assert fit_warnings(0.95, 0.10) == []  # a good fit says nothing
    assert len(fit_warnings(float("nan"), 0.10)) == 2  # no R² is not a good R²


def _decode_record(batch, *, nocb, cb, steps=4):
    """A decode probe's record from its calls' samples (ms): {"nocb_1": [...], "nocb_5": [...], ...}."""
    samples = {"nocb_1": nocb[0], f"nocb_{steps + 1}": nocb[1], "cb_1": cb[0], f"cb_{steps + 1}": cb[1]}
    per_step = {k: (float(np.median(v[1])) - float(np.median(v[0]))) / steps for k, v in (("nocb", nocb), ("cb", cb))}
    return {"batch": batch, "width": 8, "steps": steps, "nocb_ms_per_step": per_step["nocb"],
            "cb_ms_per_step": per_step["cb"], "overhead_ms_per_step": per_step["cb"] - per_step["nocb"],
            "samples_ms": samples}


def test_noisy_decode_terms_warn_as_the_prefill_fit_does(tiny, monkeypatch):
    """Issue 36: three calibrations fitted nocb decode at 199, 0 and 18 ms a step without a warning.
    A per-step cost is the difference of two calls' medians: it is flagged when the longer calls were
    not slower, or when the calls' IQRs add up to more than MAX_DECODE_SPREAD of it."""
    from rollout_lab.measure import calibrate as calibrate_module
    from rollout_lab.measure.calibrate import MAX_DECODE_SPREAD, decode_warnings, fit_warnings
    from rollout_lab.planner.cost import prefill_cost_ms

    steady = _decode_record(4, nocb=([2.0, 2.1, 2.0], [4.4, 4.5, 4.4]), cb=([1.5, 1.5, 1.6], [3.7, 3.8, 3.7]))
    assert decode_warnings([steady]) == [] and fit_warnings(0.99, 0.05, decode=[steady]) == []
    noisy = _decode_record(4, nocb=([3.0, 200.0, 4.0], [228.0, 80.0, 5.0]), cb=([6.0, 6.1, 6.0], [5.9, 6.0, 6.0]))
    found = decode_warnings([noisy])
    assert found[0].startswith("nocb decode at batch 4: 19.000 ms a step, but its calls spread")
    assert f"limit {MAX_DECODE_SPREAD:.0%} of the step" in found[0]
    assert found[1].startswith("CB decode at batch 4: the calls with 5 new tokens were not slower than those with 1")

    truth = CostCoefficients(prefill_fixed_cost_ms=2.0, prefill_token_cost_ms=0.01)  # a clean prefill fit
    shapes = [(b, w) for w in (8, 32, 128) for b in (1, 4, 16)]
    geometry = ModelGeometry.from_config(tiny.config, torch.float32)
    prefill = [{"batch": b, "width": w, "forward_ms": prefill_cost_ms(b, w, geometry, truth), "kv_copy_ms": 0.0}
               for b, w in shapes]
    monkeypatch.setattr(calibrate_module, "measure_prefill", lambda *a, **k: prefill)
    monkeypatch.setattr(calibrate_module, "measure_decode_overhead", lambda *a, **k: [noisy])
    grid = CalibrationGrid(batches=(1, 4, 16), widths=(8, 32, 128), packed=False)
    with pytest.warns(UserWarning, match="nocb decode at batch 4: 19.000 ms a step"):
        result = calibrate(tiny, grid=grid, model_name="tiny-qwen2", progress=False)
    assert result.r2 > 0.99 and result.warnings[:2] == tuple(found) and "recalibrate" in result.warnings[-1]


def test_cpu_timings_run_on_one_thread_and_the_count_is_restored(tiny, monkeypatch):
    """Issue 36: a tiny forward took 2.6-4.8 ms on 1 thread and 200-228 ms on 2 busy threads. A CPU
    calibration times on one thread by default (threads=None: the process's), restores the process's
    count after, and records the count it used."""
    from rollout_lab.measure import calibrate as calibrate_module
    from rollout_lab.measure.threads import measurement_threads

    seen = []

    def fake_prefill(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return [{"batch": b, "width": w, "forward_ms": 1.0 + 0.01 * b * w, "kv_copy_ms": 0.0}
                for w in (8, 32, 128) for b in (1, 4, 16)]

    monkeypatch.setattr(calibrate_module, "measure_prefill", fake_prefill)
    monkeypatch.setattr(calibrate_module, "measure_decode_overhead", lambda *a, **k: [])
    grid = CalibrationGrid(batches=(1, 4, 16), widths=(8, 32, 128), packed=False)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        result = calibrate(tiny, grid=grid, progress=False)
        assert seen == [1] and result.metadata["num_threads"] == 1 and torch.get_num_threads() == 2
        assert calibrate(tiny, grid=grid, progress=False, threads=None).metadata["num_threads"] == 2
        with pytest.raises(ValueError, match="threads must be an int >= 1, or None, got 0"):
            calibrate(tiny, grid=grid, progress=False, threads=0)
        with measurement_threads(1, "cuda"):  # a GPU's timings are left as they are
            assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_a_second_calibration_to_one_cost_file_is_refused(tmp_path, monkeypatch, capsys):
    from rollout_lab.workspace import output_lock

    out = tmp_path / "costs.json"
    monkeypatch.setattr("rollout_lab.cli.main.build_model", lambda *a, **k: pytest.fail("built a model"))
    with output_lock(out):  # as a running calibration holds it
        assert cli_main(["calibrate", "--tiny", "qwen2", "--device", "cpu", "--out", str(out)]) == 2
    assert "is being written by pid" in capsys.readouterr().err and not out.exists()


def test_refit_packed_fits_a_saved_calibration_again(tmp_path, capsys):
    import dataclasses
    import importlib.util

    from rollout_lab.measure.calibrate import refit_packed
    from rollout_lab.planner.cost import packed_prefill_cost_ms

    geometry = ModelGeometry.qwen25_3b(2)
    truth = CostCoefficients(packed_prompt_cost_ms=0.8, packed_fixed_cost_ms=20.0)
    packed = tuple({"prompts": b, "width": w, "measured_ms": packed_prefill_cost_ms([w] * b, geometry, truth)}
                   for b, w in [(2, 16), (8, 64), (32, 128)])
    old = CalibrationResult(CostCoefficients(packed_prompt_cost_ms=2.2), {"geometry": dataclasses.asdict(geometry)},
                            fit=({"batch": 1, "width": 16, "rel_error": 0.0},), r2=0.99, packed=packed)
    src = old.save(tmp_path / "old.json")
    spec = importlib.util.spec_from_file_location("refit_packed", ROOT / "scripts" / "refit_packed.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    script.main([str(src), "--out", str(tmp_path / "new.json")])
    assert "fixed 0.000 -> 20.000 ms, per prompt 2.200 -> 0.800 ms" in capsys.readouterr().out
    new = CostFile.read(tmp_path / "new.json")
    assert new.costs.packed_fixed_cost_ms == pytest.approx(20.0) and new.costs.packed_prompt_cost_ms == pytest.approx(0.8)
    assert new.metadata["refit"]["previous"]["packed_prompt_cost_ms"] == 2.2 and new.metadata["fit"]["packed"]
    with pytest.raises(SystemExit):  # never overwritten
        script.main([str(src), "--out", str(tmp_path / "new.json")])
    with pytest.raises(ValueError, match="no packed measurements"):
        refit_packed(dataclasses.replace(old, packed=()))


@pytest.mark.slow  # a CLI calibration
def test_no_compile_reaches_the_decode_probe_and_the_cost_file(tmp_path, monkeypatch):
    """`calibrate --no-compile` prices what a sweep with --no-compile runs: the decode probe's
    engines are built with compile=False, and the cost file's grid says so."""
    from rollout_lab.measure import calibrate as calibrate_module

    built = []
    real = calibrate_module.Rollout
    monkeypatch.setattr(calibrate_module, "Rollout", lambda model, config: built.append(config.compile) or real(model, config))
    out = tmp_path / "costs.json"
    assert cli_main(["calibrate", "--tiny", "qwen2", "--no-compile", "--repeats", "1", "--no-progress",
                     "--out", str(out)]) == 0
    assert built and set(built) == {False}
    assert json.loads(out.read_text())["metadata"]["grid"]["compile"] is False
    built.clear()
    calibrate_module.measure_decode_overhead(tiny_model("qwen2"), CalibrationGrid.tiny(), progress=False)
    assert set(built) == {"auto"}  # the default: the engine's own compile setting
    with pytest.raises(ValueError, match="CalibrationGrid.compile must be True or False, got 'no'"):
        CalibrationGrid(compile="no")


def test_the_grid_is_checked_against_the_devices_memory_naming_the_max_batch_tokens_that_fits(monkeypatch):
    import re

    from rollout_lab.engine import limits as limits_module
    from rollout_lab.engine.limits import ModelLimits

    monkeypatch.setattr(limits_module, "host_available_bytes", lambda: 20000 * 1024)
    limits = ModelLimits(max_positions=None, kv_bytes_per_token=1024, vocab_size=384, device=torch.device("cpu"))
    with pytest.raises(ValueError, match=re.escape(
            "max_batch_tokens=32768: the prefill probe's KV (32 rows x 1025 columns, and its largest forward's 32768 "
            "tokens) would take 64.0 MiB; this host has 19.5 MiB available: at most 20000 KV tokens; "
            "max_batch_tokens=512 fits")):
        CalibrationGrid().check_limits(limits)
    CalibrationGrid(max_batch_tokens=512).check_limits(limits)  # 32 x 513 + 512 KV tokens
    with pytest.raises(ValueError, match=re.escape(
            "decode_batches=(8, 1000): the KV cache of 1000 rows x 73 positions would take 71.3 MiB; this host has "
            "19.5 MiB available: at most 273 rows")):
        CalibrationGrid(max_batch_tokens=512, decode_batches=(8, 1000)).check_limits(limits)
    with pytest.raises(ValueError, match="max_batch_tokens=32768: .*; no 3 of the grid's shapes fit: give smaller"):
        CalibrationGrid().check_limits(dataclasses.replace(limits, kv_bytes_per_token=2**30))


def test_calibrate_checks_the_grid_before_any_measuring_or_model(monkeypatch, tmp_path, capsys):
    from rollout_lab.engine import limits as limits_module
    from rollout_lab.measure import calibrate as calibrate_module

    monkeypatch.setattr(limits_module, "host_available_bytes", lambda: 2**30)
    monkeypatch.setattr(calibrate_module, "measure_prefill", lambda *a, **k: pytest.fail("measured first"))
    monkeypatch.setattr(calibrate_module, "load_model", lambda *a, **k: pytest.fail("built the model first"))
    monkeypatch.setattr("rollout_lab.cli.main.build_model", lambda *a, **k: pytest.fail("built the model first"))
    # qwen2.5-3b in bfloat16 holds 36 KiB of KV a token: the default grid's 65568 tokens take 2.3 GiB
    assert cli_main(["calibrate", "--preset", "qwen2.5-3b", "--device", "cpu", "--out", str(tmp_path / "c.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: max_batch_tokens=32768: the prefill probe's KV (32 rows x 1025 columns") \
        and err.rstrip().endswith("this host has 1.0 GiB available: at most 29127 KV tokens; max_batch_tokens=512 fits")
    with pytest.raises(ValueError, match="max_batch_tokens=32768: the prefill probe's KV"):
        calibrate_module.calibrate_or_load(calibration_file=None, model="qwen2.5-3b", dtype="bfloat16", device="cpu",
                                           grid="default", output_path=None, output_dir=tmp_path)
    monkeypatch.setattr(limits_module, "host_available_bytes", lambda: 2**10)
    with pytest.raises(ValueError, match="max_batch_tokens=32768: the prefill probe's KV"):
        calibrate(tiny_model("qwen2"), grid=CalibrationGrid.tiny())
