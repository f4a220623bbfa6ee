"""measure.defaults: ``RolloutConfig()`` with nothing set against the tuned setting, behind
`rollout-lab bench defaults` (tiny fp32 models, CPU)."""
from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest
from conftest import get_tiny

from rollout_lab.cli.main import main
from rollout_lab.measure import defaults as defaults_module
from rollout_lab.measure.defaults import (DEFAULTS_BENCH_DEFAULTS, ENGINES, check_defaults_settings, compile_seconds,
                                          compile_text, defaults_rows, prompt_seed, run_defaults)
from rollout_lab.measure.workloads import WORKLOADS
from rollout_lab.workspace import check_record_pair

# a calibration of another model (Qwen2.5-3B, bf16, the H200): never this tiny model's
OTHER_COSTS = Path(__file__).resolve().parents[1] / "data/calibration/qwen2.5-3b_bfloat16_cuda_prefill-graphs.json"
TINY_SHAPE = {"workloads": ["long_tail", "gsm8k_32"], "scale": 0.1, "max_new_tokens": 4, "repetitions": 2}


def quiet(line: str) -> None:
    pass


@pytest.mark.slow  # a dynamo trace
def test_compile_seconds_are_the_phases_a_compile_between_two_snapshots_spent():
    import torch

    before = compile_seconds()
    torch.compile(lambda x: x * 3 - 1, backend="eager")(torch.ones(3))  # dynamo's trace, no inductor
    spent = compile_seconds(since=before)
    assert spent and all(v > 0 for v in spent.values()) and "_compile.compile_inner" in spent
    assert compile_seconds(since=compile_seconds()) == {}  # nothing compiled between
    assert compile_text({"a": 1.0, "b": 12.34, "c": 0.5}, top=2) == "b 12.3 s, a 1.0 s" and compile_text({}) == "none"


def test_the_record_holds_both_engines_per_workload_and_their_ratio():
    saved, lines = [], []
    record = run_defaults(get_tiny("qwen2"), model_name="tiny-qwen2", dtype="float32", script="test",
                          save=lambda r: saved.append(json.loads(json.dumps(r))), progress=lines.append, **TINY_SHAPE)
    assert [list(r["results"]) for r in saved] == [["long_tail"], ["long_tail", "gsm8k_32"]]  # after every workload
    assert record["kind"] == "defaults" and record["provenance"]["script"] == "test"
    assert record["config"]["workloads"] == ["long_tail", "gsm8k_32"] and record["config"]["tuned_costs"] is None
    assert record["engines"]["default"]["settings"] == {"ignore_eos": True, "pad_token_id": 0}  # nothing else set
    tuned = record["engines"]["tuned"]["settings"]
    assert tuned["costs"] == "reference" and tuned["prefill_graphs"] is False  # no captures off CUDA
    assert tuned["prefill_classes"]["widths"][-1] == 51 and tuned["prefill_classes"]["rows"][-1] == 32  # 512 x 0.1
    for which in ENGINES:
        engine = record["engines"][which]
        assert engine["build_ms"] > 0 and engine["compiled_artifacts_loaded"] == 0 and engine["costs_source"]
        assert engine["prefill_graph_info"] == {}  # no captures off CUDA
        assert engine["prediction_rel_errors"] == []  # off CUDA neither side learns online
    for name, res in record["results"].items():
        for which in ENGINES:
            e = res[which]
            assert len(e["samples_ms"]) == len(e["routes"]) == 2 and e["first_call_ms"] > 0
            assert e["median_ms"] == sum(e["samples_ms"]) / 2 and e["iqr_ms"] >= 0 and e["first_call_route"]
            assert e["first_call_compile_s"] == {}  # nothing compiles off CUDA
            # the last call's prefill forwards: every prompt in one, at most 32 rows, at least as wide as the longest
            assert e["prefill_shapes"] and sum(r for r, _ in e["prefill_shapes"]) >= 32
            assert max(w for _, w in e["prefill_shapes"]) >= max(record["workloads"][name]["lengths"])
        assert res["ratio"] == res["default"]["median_ms"] / res["tuned"]["median_ms"]
        assert res["within_1_05"] == (res["ratio"] <= 1.05)
    first = record["results"]["long_tail"]["default"]["first_call_ms"]
    assert record["process_first_call_ms"] == record["engines"]["default"]["build_ms"] + first
    # distinct prompts: one seed per workload name
    assert [w["prompt_seed"] for w in record["workloads"].values()] == [prompt_seed("long_tail", 0),
                                                                        prompt_seed("gsm8k_32", 0)]
    assert len({prompt_seed(w, s) for w in WORKLOADS for s in (0, 1)}) == 2 * len(WORKLOADS)
    summaries = [line for line in lines if "ratio" in line]
    assert [line.split()[0] for line in summaries] == ["long_tail", "gsm8k_32"]
    firsts = [line.split()[:2] for line in lines if "ratio" not in line]  # each first call, as it ends
    assert firsts == [[w, e] for w in ("long_tail", "gsm8k_32") for e in ENGINES]
    assert all(line.endswith("compile: none") for line in lines if "ratio" not in line)
    rows = defaults_rows(record)
    assert [r["workload"] for r in rows] == ["long_tail", "gsm8k_32"]
    assert rows[1]["ratio"] == record["results"]["gsm8k_32"]["ratio"]
    assert rows[0]["tuned_first_call_ms"] == record["results"]["long_tail"]["tuned"]["first_call_ms"]


@pytest.mark.parametrize("bad, message", [
    ({"workloads": ["long_tail", "mmlu"]}, r"unknown workloads \['mmlu'\]; valid names: short_similar"),
    ({"workloads": []}, r"unknown workloads \(none given\)"),
    ({"workloads": "long_tail"}, "workloads must be a list of workload names, got 'long_tail'"),
    ({"workloads": ["spread", "spread"]}, r"workloads names 'spread' more than once"),
    ({"repetitions": 0}, "repetitions must be an int >= 1, got 0"),
    ({"max_new_tokens": 2.5}, "max_new_tokens must be an int >= 1, got 2.5"),
    ({"scale": 0}, "scale must be a number > 0, got 0"),
    ({"seed": -1}, "seed must be an int >= 0, got -1"),
    ({"tuned_costs": "/no/such/costs.json"}, "cost file '/no/such/costs.json' does not exist"),
    ({"tuned_costs": 3}, "tuned_costs must be None .* or a cost file path, got 3"),
])
def test_bad_settings_are_errors_before_any_work(bad, message, monkeypatch):
    monkeypatch.setattr(defaults_module, "Rollout", lambda *a, **k: pytest.fail("a rollout was built"))
    with pytest.raises(ValueError, match=message):
        check_defaults_settings(**(dict(DEFAULTS_BENCH_DEFAULTS) | bad))
    with pytest.raises(ValueError, match=message):
        run_defaults(get_tiny("qwen2"), model_name="tiny-qwen2", dtype="float32", **bad)


def test_a_workload_past_the_context_or_another_models_costs_are_errors_before_any_work(monkeypatch):
    monkeypatch.setattr(defaults_module, "Rollout", lambda *a, **k: pytest.fail("a rollout was built"))
    with pytest.raises(ValueError, match="workload 'long_tail': prompt length 512 .* context of 512"):
        run_defaults(get_tiny("qwen2"), model_name="tiny-qwen2", dtype="float32", workloads=["long_tail"])
    with pytest.raises(ValueError, match="calibrated for a different setting"):
        run_defaults(get_tiny("qwen2"), model_name="tiny-qwen2", dtype="float32", workloads=["long_tail"], scale=0.1,
                     tuned_costs=OTHER_COSTS)


def test_defaults_bench_defaults_are_run_defaults_own():
    signature = inspect.signature(run_defaults).parameters
    assert {k: signature[k].default for k in DEFAULTS_BENCH_DEFAULTS} == DEFAULTS_BENCH_DEFAULTS
    assert DEFAULTS_BENCH_DEFAULTS["workloads"] == ("short_similar", "long_tail", "short_tail", "moderate_tail",
                                                    "spread", "gsm8k_32", "gpqa_diamond_32")


def test_bench_defaults_writes_the_record_and_refuses_an_existing_one_or_bad_settings(tmp_path, capsys, monkeypatch):
    out = tmp_path / "defaults"
    argv = ["--tiny", "qwen2", "--workloads", "short_tail", "spread", "--scale", "0.1", "--max-new-tokens", "4",
            "--repetitions", "1", "--out", str(out)]
    assert main(["bench", "defaults", *argv]) == 0
    printed = capsys.readouterr()
    record = json.loads((tmp_path / "defaults.json").read_text())
    assert check_record_pair(tmp_path / "defaults.json", tmp_path / "defaults.csv") == record["run_id"]
    assert record["provenance"]["script"] == "rollout-lab bench defaults" and record["provenance"]["argv"] == argv
    assert record["config"]["tiny"] == "qwen2" and list(record["results"]) == ["short_tail", "spread"]
    assert (tmp_path / "defaults.csv").read_text().splitlines()[0].startswith("run_id,workload,git_sha,ratio")
    assert [line.split()[0] for line in printed.err.splitlines() if " ratio " in line] == ["short_tail", "spread"]
    assert "process first call:" in printed.out
    monkeypatch.setattr("rollout_lab.cli.bench.build_model", lambda *a, **k: pytest.fail("a model was built"))
    assert main(["bench", "defaults", *argv]) == 2
    assert "already exist" in capsys.readouterr().err
    for bad, message in ((["--tuned-costs", str(tmp_path / "nope.json")], f"cost file '{tmp_path / 'nope.json'}' does "
                                                                          "not exist"),
                         (["--repetitions", "0"], "argument --repetitions: must be >= 1, got 0"),
                         (["--workloads", "mmlu"], "invalid choice: 'mmlu'"),
                         (["--scale", "-1"], "scale must be a number > 0, got -1.0")):
        assert main(["bench", "defaults", "--tiny", "qwen2", "--out", str(tmp_path / "x"), *bad]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and message in err
    assert not (tmp_path / "x.json").exists()
