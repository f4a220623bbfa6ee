"""measure.grpo: the GRPO benchmark behind `rollout-lab bench grpo` and notebook 03's grpo_shape."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rollout_lab.measure import grpo as grpo_module
from rollout_lab.measure.grpo import GRPO_DEFAULT_PATHS, GRPO_DEFAULTS, check_grpo_settings, grpo_or_load, run_grpo
from rollout_lab.measure.models import tiny_model
from rollout_lab.measure.records import grpo_rows, load_grpo_results
from rollout_lab.workspace import write_record

SHAPE = {"num_prompts": 3, "num_samples": 2, "max_new_tokens": 4, "scale": 0.05, "reps": 1}
ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_run_grpo_samples_every_row_and_shares_each_prompts_prefill():
    record = run_grpo(tiny_model("qwen2"), model_name="tiny-qwen2", dtype="float32", config={"device": "cpu"},
                      progress=lambda line: None, **SHAPE)
    results = record["results"]
    assert list(results) == list(GRPO_DEFAULT_PATHS)
    assert record["workload"]["num_rows"] == 6 and record["workload"]["num_generated_tokens"] == 24
    for path, res in results.items():
        assert len(res["ms"]) == 1 and res["tokens_per_s"] == pytest.approx(24 / (res["mean_ms"] / 1e3))
        assert res["num_generated_tokens"] == 24
    # shared prefill runs each prompt once and copies its KV into the other sample's slot
    assert results["shared"]["num_prefill_rows"] == 3 and results["shared"]["num_replicated_rows"] == 3
    assert results["unshared"]["num_prefill_rows"] == 6 and results["unshared"]["num_replicated_rows"] == 0
    assert record["checks"]["shared_equals_unshared_fraction"] == 1.0  # seeded sampling, the same tokens
    assert record["ratios"]["hf_generate_over_shared"] == pytest.approx(
        results["hf_generate"]["mean_ms"] / results["shared"]["mean_ms"])
    assert record["config"]["model"] == "tiny-qwen2" and record["config"]["device"] == "cpu"
    assert record["config"]["costs"] is None and record["kind"] == "grpo"


@pytest.mark.parametrize("bad, message", [
    ({"dataset": "mmlu"}, "dataset must be one of"),
    ({"num_samples": 0}, "num_samples must be an int >= 1, got 0"),
    ({"max_new_tokens": 2.5}, "max_new_tokens must be an int >= 1"),
    ({"temperature": 0}, "temperature must be a number > 0, got 0"),
    ({"top_p": 1.5}, r"top_p must be in \(0, 1\], got 1.5"),
    ({"mode": "fast"}, "mode must be one of"),
    ({"paths": ["shared", "vllm"]}, "GRPO paths must be distinct names"),
    ({"paths": ["shared", "shared"]}, "GRPO paths must be distinct names"),
    ({"paths": []}, "GRPO paths must be distinct names"),
])
def test_bad_settings_are_errors_before_any_work(bad, message, monkeypatch):
    with pytest.raises(ValueError, match=message):
        check_grpo_settings(**(GRPO_DEFAULTS | bad))
    monkeypatch.setattr(grpo_module, "sample_lengths", lambda *a, **k: pytest.fail("work began"))
    with pytest.raises(ValueError, match=message):
        run_grpo(tiny_model("qwen2"), model_name="tiny-qwen2", dtype="float32", **(GRPO_DEFAULTS | bad))


def test_more_rows_than_one_call_takes_are_refused_before_the_model_is_built():
    """check_group_limits (grpo, trainer-loop) asks engine.limits.check_call_rows, as generate would
    after the model, the prompts and a Rollout were built."""
    from rollout_lab.engine.limits import ModelLimits
    from rollout_lab.measure.models import model_config

    config, _ = model_config("tiny-qwen2")
    limits = ModelLimits.of_config(config, dtype="float32", device="cpu")
    with pytest.raises(ValueError, match=r"num_samples=32768 x 64 requests = 2097152 rows, more than the 1048576 "
                                         r"rows one call takes: give at most num_samples=16384 for 64 requests"):
        check_grpo_settings(**(GRPO_DEFAULTS | {"num_samples": 2**15, "scale": 0.1}), limits=limits)
    check_grpo_settings(**(GRPO_DEFAULTS | {"num_samples": 2**14, "scale": 0.1, "max_new_tokens": 1}), limits=limits)


def test_a_scale_that_clips_a_prompt_to_one_token_is_refused_naming_the_smallest_that_works(monkeypatch):
    """run_grpo(scale=1e-9) clipped every prompt to one token silently; the check the CLI shares names
    the shortest drawn prompt (70 tokens of gsm8k's first 64 at seed 0) and scale >= 1/70."""
    message = (r"scale=1e-09 makes the shortest of these prompts \(70 tokens of gsm8k\) 7e-08 tokens, which would "
               r"be clipped to 1 .*give scale >= 0.0143 \(1/70\)")
    with pytest.raises(ValueError, match=message):
        check_grpo_settings(**(GRPO_DEFAULTS | {"scale": 1e-9}))
    check_grpo_settings(**(GRPO_DEFAULTS | {"scale": 0.0143}))  # 1.001 tokens: kept
    monkeypatch.setattr(grpo_module, "lengths_to_prompts", lambda *a, **k: pytest.fail("work began"))
    with pytest.raises(ValueError, match=message):
        run_grpo(tiny_model("qwen2"), model_name="tiny-qwen2", dtype="float32", **(GRPO_DEFAULTS | {"scale": 1e-9}))


@pytest.mark.slow
def test_grpo_or_load_measures_the_shape_or_renders_a_record(tmp_path, monkeypatch):
    assert grpo_or_load(grpo_shape=None, grpo_results_file=None, model="tiny-qwen2", dtype="float32",
                        device="cpu") is None
    name, record = grpo_or_load(grpo_shape={**SHAPE, "paths": ["shared", "hf_generate"]}, grpo_results_file=None,
                                model="tiny-qwen2", dtype="float32", device="cpu", output_dir=tmp_path)
    assert name == str(tmp_path / "data" / "results" / "grpo_tiny-qwen2_float32_cpu.json")
    assert load_grpo_results(name)["results"].keys() == {"shared", "hf_generate"}  # written, with its CSV pair
    assert record["provenance"]["script"] == "notebook 03 (grpo_shape)"
    saved = tmp_path / "saved.json"
    write_record((saved, tmp_path / "saved.csv"), json.loads(json.dumps(record)), grpo_rows(record))
    monkeypatch.setattr(grpo_module, "run_grpo", lambda *a, **k: pytest.fail("measured again"))
    assert grpo_or_load(grpo_shape=None, grpo_results_file=str(saved), model="tiny-qwen2", dtype="float32",
                        device="cpu")[0] == str(saved)
    # refused before the model is built: both given, a record in the way, an unknown or a bad setting
    monkeypatch.setattr("rollout_lab.measure.models.load_model", lambda *a, **k: pytest.fail("built a model"))
    with pytest.raises(ValueError, match="not both"):
        grpo_or_load(grpo_shape=SHAPE, grpo_results_file=str(saved), model="tiny-qwen2", dtype="float32",
                     device="cpu", output_dir=tmp_path / "other")
    with pytest.raises(ValueError, match="already exist"):
        grpo_or_load(grpo_shape=SHAPE, grpo_results_file=None, model="tiny-qwen2", dtype="float32", device="cpu",
                     output_dir=tmp_path)
    with pytest.raises(ValueError, match=r"grpo_shape has unknown settings \['num_prompt'\]"):
        grpo_or_load(grpo_shape={"num_prompt": 4}, grpo_results_file=None, model="tiny-qwen2", dtype="float32",
                     device="cpu", output_dir=tmp_path / "third")
    with pytest.raises(ValueError, match="num_samples must be an int >= 1"):
        grpo_or_load(grpo_shape={"num_samples": 0}, grpo_results_file=None, model="tiny-qwen2", dtype="float32",
                     device="cpu", output_dir=tmp_path / "fourth")


@pytest.mark.slow
def test_bench_grpo_writes_the_record_and_refuses_bad_settings(tmp_path):
    """In a process of its own: --tiny sets torch's threads to 1 for the process."""
    out = tmp_path / "grpo"
    env = {"PYTHONPATH": str(ROOT), "PATH": ""}
    bench = [sys.executable, "-m", "rollout_lab.cli", "bench", "grpo"]
    done = subprocess.run([*bench, "--tiny", "qwen2", "--scale", "0.05",
                           "--num-prompts", "2", "--num-samples", "2", "--max-new-tokens", "3", "--reps", "1",
                           "--paths", "shared", "hf_generate", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    record = load_grpo_results(f"{out}.json")
    assert record["config"]["tiny"] == "qwen2" and record["provenance"]["script"] == "rollout-lab bench grpo"
    assert set(record["results"]) == {"shared", "hf_generate"}
    bad = subprocess.run([*bench, "--tiny", "qwen2", "--top-p", "0", "--out", str(tmp_path / "x")],
                         capture_output=True, text=True, timeout=300, env=env)
    assert bad.returncode == 2 and bad.stderr == "error: top_p must be in (0, 1], got 0.0\n"
    assert not (tmp_path / "x.json").exists()


def test_grpo_defaults_are_run_grpos_own():
    import inspect

    signature = inspect.signature(run_grpo).parameters
    assert {k: signature[k].default for k in GRPO_DEFAULTS} == GRPO_DEFAULTS
