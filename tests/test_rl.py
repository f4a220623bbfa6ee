"""measure.rl: the RL-shape benchmark behind `rollout-lab bench rl` and notebook 03's rl_shape."""
from __future__ import annotations

import json

import pytest
import torch

from rollout_lab.cli.main import main
from rollout_lab.measure import rl as rl_module
from rollout_lab.measure.models import tiny_model
from rollout_lab.measure.rl import RL_DEFAULT_PATHS, check_rl_settings, rl_or_load, run_rl
from rollout_lab.measure.records import load_rl_results, rl_throughput_rows
from rollout_lab.measure.workloads import uniform_workload
from rollout_lab.workspace import write_record

SHAPE = {"num_seqs": 5, "min_len": 3, "max_len": 9, "seed": 1}


def test_run_rl_runs_every_request_to_its_own_budget_and_saves_after_each_path():
    saved = []
    record = run_rl(tiny_model("qwen2"), model_name="tiny-qwen2", dtype="float32", paths=["ours", "ours_no_compile"],
                    save=lambda r: saved.append(list(r["results"])), config={"device": "cpu"}, **SHAPE)
    lengths, budgets = uniform_workload(5, low=3, high=9, seed=1)
    assert record["workload"]["lengths"] == lengths and record["workload"]["budgets"] == budgets
    assert record["workload"]["num_output_tokens"] == sum(budgets)
    assert saved == [["ours"], ["ours", "ours_no_compile"]]  # the record after every path
    ours = record["results"]["ours"]
    assert ours["output_tokens_per_s"] == pytest.approx(sum(budgets) / (ours["mean_ms"] / 1e3))
    assert ours["num_slots"] == 5 and ours["settings"] == {} and record["results"]["ours_no_compile"]["settings"] == {
        "compile": False}
    assert record["config"]["model"] == "tiny-qwen2" and record["config"]["device"] == "cpu"
    assert record["config"]["paths"] == ["ours", "ours_no_compile"]
    # each call's account: the warm-up, then every timed call (CPU: no graphs, no online costs)
    calls = ours["calls"]
    assert [c["ms"] for c in calls] == [ours["first_call_ms"], *ours["samples_ms"]]
    assert all(c["prefill_captures"] == c["decode_captures"] == 0 and c["observed"] is False for c in calls)
    assert calls[0]["prefill_widths"] and all(w >= 3 for w in calls[0]["prefill_widths"])


@pytest.mark.parametrize("bad, message", [
    ({"num_seqs": 0}, "num_seqs must be an int >= 1, got 0"),
    ({"min_len": 9, "max_len": 3}, "max_len 3 is below min_len 9"),
    ({"mode": "fast"}, "mode must be one of"),
    ({"slots": 1.5}, "slots must be None or an int >= 1"),
    ({"paths": ["ours", "vllm"]}, r"unknown RL paths \['vllm'\]"),
    ({"paths": []}, "unknown RL paths"),
])
def test_bad_settings_are_errors_before_any_work(bad, message):
    settings = {"num_seqs": 4, "min_len": 2, "max_len": 8, "mode": "bucketed", "slots": None, "reps": 1,
                "peer_calls": 1, "paths": list(RL_DEFAULT_PATHS)} | bad
    with pytest.raises(ValueError, match=message):
        check_rl_settings(**settings)


def test_the_paged_variants_set_their_route_and_leave_the_default_paths():
    record = run_rl(tiny_model("qwen2"), model_name="tiny-qwen2", dtype="float32", paths=["ours_paged", "ours_fp8_kv"],
                    **SHAPE)  # SHAPE's mode is the bench's default, bucketed: each variant's own mode wins
    paged, fp8 = record["results"]["ours_paged"], record["results"]["ours_fp8_kv"]
    assert paged["route"] == fp8["route"] == "paged"
    assert (paged["stepper"]["kv_dtype"], fp8["stepper"]["kv_dtype"]) == ("auto", "fp8")
    assert fp8["profile"]["cache_bytes"] < paged["profile"]["cache_bytes"] / 3  # fp32 values to e4m3 and scales
    assert not {"ours_paged", "ours_fp8_kv"} & set(RL_DEFAULT_PATHS)


def test_the_whole_model_compile_is_refused_off_cuda_before_any_work(monkeypatch):
    monkeypatch.setattr(rl_module, "Rollout", lambda *a, **k: pytest.fail("a rollout was built"))
    with pytest.raises(ValueError, match="ours_compile_model compiles the CUDA-graph decode step"):
        run_rl(tiny_model("qwen2"), model_name="tiny-qwen2", dtype="float32", paths=["ours_compile_model"], **SHAPE)
    assert "ours_compile_model" not in RL_DEFAULT_PATHS


def test_rl_or_load_measures_the_shape_and_joins_saved_records_of_the_same_workload(tmp_path, monkeypatch):
    shape = {**SHAPE, "paths": ["ours"]}
    runs = rl_or_load(rl_shape=shape, rl_results_file=None, model="tiny-qwen2", dtype="float32", device="cpu",
                      output_dir=tmp_path)
    (name, record), = runs
    assert name == str(tmp_path / "data" / "results" / "rl_tiny-qwen2_float32_cpu.json")
    assert load_rl_results(name)["results"].keys() == {"ours"}  # written, with its CSV pair
    saved = tmp_path / "saved.json"
    write_record((saved, tmp_path / "saved.csv"), json.loads(json.dumps(record)), rl_throughput_rows(record))
    monkeypatch.setattr(rl_module, "run_rl", lambda *a, **k: pytest.fail("measured again"))
    loaded = rl_or_load(rl_shape=None, rl_results_file=[str(saved)], model="tiny-qwen2", dtype="float32",
                        device="cpu")
    assert [n for n, _ in loaded] == [str(saved)]
    # refused before the model is built: a record in the way, another workload, an unknown setting
    monkeypatch.setattr("rollout_lab.measure.models.load_model", lambda *a, **k: pytest.fail("built a model"))
    with pytest.raises(ValueError, match="already exist"):
        rl_or_load(rl_shape=shape, rl_results_file=None, model="tiny-qwen2", dtype="float32", device="cpu",
                   output_dir=tmp_path)
    with pytest.raises(ValueError, match="measured another workload.*one workload only"):
        rl_or_load(rl_shape={**shape, "seed": 2}, rl_results_file=str(saved), model="tiny-qwen2", dtype="float32",
                   device="cpu", output_dir=tmp_path / "other")
    with pytest.raises(ValueError, match=r"rl_shape has unknown settings \['num_seq'\]"):
        rl_or_load(rl_shape={"num_seq": 4}, rl_results_file=None, model="tiny-qwen2", dtype="float32",
                   device="cpu", output_dir=tmp_path / "third")


def test_bench_rl_writes_the_record(tmp_path, capsys):
    out = tmp_path / "rl"
    argv = ["--tiny", "qwen2", "--num-seqs", "4", "--min-len", "3", "--max-len", "8", "--paths", "ours", "--out", str(out)]
    assert main(["bench", "rl", *argv]) == 0
    record = load_rl_results(f"{out}.json")
    assert record["config"]["tiny"] == "qwen2" and record["config"]["device"] == "cpu"
    assert record["provenance"]["script"] == "rollout-lab bench rl" and record["provenance"]["argv"] == argv
    assert f"wrote {out}.json and {out}.csv" in capsys.readouterr().out
    assert main(["bench", "rl", "--tiny", "qwen2", "--min-len", "9", "--max-len", "3", "--out", str(tmp_path / "x")]) == 2
    assert capsys.readouterr().err == "error: max_len 3 is below min_len 9\n"


def test_rl_defaults_are_run_rls_own():
    import inspect

    from rollout_lab.measure.rl import RL_DEFAULTS

    signature = inspect.signature(run_rl).parameters
    assert {k: signature[k].default for k in RL_DEFAULTS} == RL_DEFAULTS


@pytest.mark.slow  # HF's continuous batching, twice
def test_hf_continuous_batching_is_sized_to_the_work_off_cuda(monkeypatch):
    """Off CUDA, HF sizes its paged cache to host memory (14.7 GB for notebook 03's four tiny RL
    prompts): both of our ways into it (generate_batch, the per-budget manager) pass a config sized
    to the prompts and the largest budget."""
    from rollout_lab.measure.peers import cb_sizing
    from rollout_lab.measure.rl import hf_generate_batch_budgets

    from conftest import get_tiny

    model = get_tiny("qwen2")
    prompts = [[5, 6, 7], list(range(3, 70))]
    config = cb_sizing(model, prompts, 8)["continuous_batching_config"]
    assert config.num_blocks == 1 + 2 + 4 and config.max_requests_per_batch == 2  # 11 and 75 tokens in pages of 64
    seen = {}
    real = model.init_continuous_batching

    def spy(**kwargs):
        seen.update(kwargs)
        return real(**kwargs)

    monkeypatch.setattr(model, "init_continuous_batching", spy)
    out = hf_generate_batch_budgets(model, prompts, [8, 3], pad_id=0)
    assert [len(s) for s in out] == [8, 3]
    assert seen["continuous_batching_config"].num_blocks == config.num_blocks


def test_a_calls_account_says_what_it_captured_and_whether_it_was_timed():
    """``_account``: the prefill classes and decode graphs captured during the call (a rebuilt stepper
    counts all of its own), whether the online costs timed it, and its prefill widths."""
    from types import SimpleNamespace

    from rollout_lab.measure.rl import _account

    rollout = SimpleNamespace(prefill_graph_info={"num_captures": 2, "capture_ms": 10.0},
                              stepper_info={"kind": "graph", "num_captures": 1, "build_ms": 5.0},
                              online=SimpleNamespace(num_calls=1))

    def call():
        rollout.prefill_graph_info = {"num_captures": 3, "capture_ms": 14.5}
        rollout.stepper_info = {"kind": "graph", "num_captures": 1, "build_ms": 7.0}  # a new stepper
        rollout.online.num_calls = 2
        return SimpleNamespace(plans=[SimpleNamespace(widths=(64, 128)), SimpleNamespace(widths=(64,))])

    calls = []
    _, result = _account(rollout, calls, call, torch.device("cpu"))
    assert len(result.plans) == 2
    (account,) = calls
    assert account["prefill_captures"] == 1 and account["prefill_capture_ms"] == pytest.approx(4.5)
    assert account["decode_captures"] == 1 and account["observed"] is True
    assert account["prefill_widths"] == [64, 128] and account["compiled_frames"] == 0
    _account(rollout, calls, lambda: SimpleNamespace(plans=[]), torch.device("cpu"))
    assert calls[1]["prefill_captures"] == calls[1]["decode_captures"] == 0 and calls[1]["observed"] is False
