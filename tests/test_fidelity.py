"""Teacher-forced logits (measure.fidelity): our step against a plain forward, position by position."""
from __future__ import annotations

import inspect
import json
import random

import pytest
from conftest import get_tiny

from rollout_lab import RolloutConfig
from rollout_lab.cli.main import main
from rollout_lab.engine.kernels import span as span_module
from rollout_lab.measure.fidelity import (
    LOGITS_DEFAULTS, kv_dtype_or_load, kv_dtype_rows, run_logits_check, teacher_forced_check,
)
from rollout_lab.measure.models import TINY_VOCAB_SIZE
from rollout_lab.workspace import check_record_pair


def _case(seed=0, lengths=(5, 12, 1, 8), steps=7):
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, TINY_VOCAB_SIZE) for _ in range(n)] for n in lengths]
    forced = [[rng.randrange(1, TINY_VOCAB_SIZE) for _ in range(steps)] for _ in lengths]
    return prompts, forced


@pytest.mark.parametrize("attention", ["masked", "span"])
def test_fp32_step_equals_plain_forward(family, attention):
    prompts, forced = _case()
    report = teacher_forced_check(get_tiny(family), prompts, forced, RolloutConfig(decode_attention=attention))
    assert report["max_abs_error"] < 1e-4, report
    assert report["max_logprob_error"] < 1e-4 and report["mean_logprob_error"] <= report["max_logprob_error"]
    assert report["top1_agreement"] == 1.0 and report["num_decided"] > 20
    assert report["num_positions"] == 28 and len(report["per_step_max_abs_error"]) == 7
    assert report["stepper"]["spans"] is (attention == "span")


def test_a_wrong_attention_is_caught(monkeypatch):
    real = span_module.span_attention_reference

    def off_by_one(query, key, value, starts, front, scale):  # drops each row's first live column
        return real(query, key, value, starts + 1, front, scale)

    monkeypatch.setattr(span_module, "span_attention_reference", off_by_one)
    prompts, forced = _case(seed=1)
    report = teacher_forced_check(get_tiny("qwen2"), prompts, forced, RolloutConfig(decode_attention="span"))
    assert report["max_abs_error"] > 1e-3


def test_forced_sequences_must_match():
    prompts, forced = _case()
    with pytest.raises(ValueError, match="one forced sequence per prompt"):
        teacher_forced_check(get_tiny("qwen2"), prompts, [forced[0], forced[1][:3]] + forced[2:])


@pytest.mark.parametrize("cache", ["aligned", "paged"])
def test_bench_logits_forces_the_oracles_tokens_through_every_variant(tmp_path, cache):
    out = tmp_path / "fid"
    argv = ["--tiny", "qwen3", "--num-seqs", "3", "--min-len", "4", "--max-len", "20", "--steps", "5",
            "--variants", "ours", "ours_masked", "--cache", cache, "--out", str(out)]
    assert main(["bench", "logits", *argv]) == 0
    record = json.loads((tmp_path / "fid.json").read_text())
    assert check_record_pair(tmp_path / "fid.json", tmp_path / "fid.csv") == record["run_id"]
    assert record["kind"] == "teacher_forced_logits" and record["config"]["cache"] == cache
    assert record["provenance"]["script"] == "rollout-lab bench logits" and record["provenance"]["argv"] == argv
    assert list(record["variants"]) == ["ours", "ours_masked"]
    for report in record["variants"].values():  # fp32: our step is the plain forward
        assert report["max_abs_error"] < 1e-3 and report["top1_agreement"] == 1.0
        assert report["num_positions"] == 3 * 5 and report["stepper"]["paged"] == (cache == "paged")


def test_bench_logits_measures_what_an_fp8_pool_moves(tmp_path):
    out = tmp_path / "fp8"
    argv = ["--tiny", "qwen3", "--num-seqs", "3", "--min-len", "4", "--max-len", "20", "--steps", "5",
            "--variants", "ours_paged", "ours_fp8_kv", "--out", str(out)]
    assert main(["bench", "logits", *argv]) == 0
    variants = json.loads((tmp_path / "fp8.json").read_text())["variants"]
    exact, fp8 = variants["ours_paged"], variants["ours_fp8_kv"]
    assert exact["stepper"]["paged"] and fp8["stepper"]["paged"]  # the variants set the route themselves
    assert (exact["stepper"]["kv_dtype"], fp8["stepper"]["kv_dtype"]) == ("auto", "fp8")
    assert exact["max_logprob_error"] < 1e-4 < fp8["mean_logprob_error"] <= fp8["max_logprob_error"] < 2.0
    # notebook 03 renders it (fp8_kv_results_files): a row per variant with its KV dtype; another kind is refused
    runs = kv_dtype_or_load(fp8_kv_shape=None, fp8_kv_results_files=str(tmp_path / "fp8.json"), model="tiny-qwen3",
                            dtype="float32", device="cpu")
    rows = {r["variant"]: r for r in kv_dtype_rows(runs)}
    assert (rows["ours_paged"]["kv_dtype"], rows["ours_fp8_kv"]["kv_dtype"]) == ("auto", "fp8")
    assert rows["ours_fp8_kv"]["mean_logprob_error"] == fp8["mean_logprob_error"]
    (tmp_path / "other.json").write_text(json.dumps({"kind": "grpo"}))
    with pytest.raises(ValueError, match="is not a teacher_forced_logits or rl_throughput record"):
        kv_dtype_or_load(fp8_kv_shape=None, fp8_kv_results_files=[str(tmp_path / "other.json")], model="tiny-qwen3",
                         dtype="float32", device="cpu")


def test_logits_defaults_are_run_logits_checks_own():
    signature = inspect.signature(run_logits_check).parameters
    assert {k: signature[k].default for k in LOGITS_DEFAULTS} == LOGITS_DEFAULTS
