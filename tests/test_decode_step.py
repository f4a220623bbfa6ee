"""measure.decode_step: the decode step alone, per lever, through `rollout-lab bench decode-step` (tiny, CPU)."""
from __future__ import annotations

import inspect

import pytest

from rollout_lab.cli.main import main
from rollout_lab.measure.decode_step import DECODE_STEP_DEFAULTS, check_decode_step_settings, run_decode_step
from rollout_lab.measure.records import load_decode_step_results


def test_bench_decode_step_times_every_case_and_variant(tmp_path):
    out = tmp_path / "step"
    argv = ["--tiny", "qwen2", "--cases", "4x40", "6x60", "--steps", "8", "--variants", "ours", "ours_masked",
            "--out", str(out)]
    assert main(["bench", "decode-step", *argv]) == 0
    record = load_decode_step_results(f"{out}.json")
    assert list(record["cases"]) == ["4x40", "6x60"]
    assert all(list(variants) == ["ours", "ours_masked"] for variants in record["cases"].values())
    step = record["cases"]["6x60"]["ours_masked"]
    assert len(step["step_ms_samples"]) == 8 and step["step_ms_median"] > 0 and step["first_call_ms"] > 0
    assert record["config"] == {"model": "tiny-qwen2", "steps": 8, "variants": ["ours", "ours_masked"]}
    assert record["provenance"]["script"] == "rollout-lab bench decode-step" and record["provenance"]["argv"] == argv


def test_paged_variants_are_sent_to_the_benches_that_run_them():
    with pytest.raises(ValueError, match=r"\['ours_fp8_kv'\] run the paged route.*bench rl --paths"):
        check_decode_step_settings(cases=[(4, 40)], variants=["ours", "ours_fp8_kv"], steps=8)


def test_decode_step_defaults_are_run_decode_steps_own():
    signature = inspect.signature(run_decode_step).parameters
    assert {k: signature[k].default for k in DECODE_STEP_DEFAULTS} == DECODE_STEP_DEFAULTS
