"""measure.long_tail and workloads.eos_long_tail: the EOS long-tail benchmark behind
`rollout-lab bench long-tail` (tiny fp32 models, CPU)."""
from __future__ import annotations

import inspect
import json
import math

import pytest
from conftest import get_tiny

from rollout_lab.cli.main import main
from rollout_lab.measure import long_tail as long_tail_module
from rollout_lab.measure.long_tail import (LONG_TAIL_DEFAULTS, LONG_TAIL_PATHS, check_long_tail_settings, decode_by_rows,
                                           long_tail_rows, run_long_tail, step_cost_rows)
from rollout_lab.measure.workloads import EOS_LONG_TAIL, eos_long_tail, sample_lengths
from rollout_lab.workspace import check_record_pair

# GSM8K's prompts fit the tiny model's 512 positions; a budget long beside the prompts, ended at EOS
# after ~15 tokens, so rows end at very different times. Measured (qwen2, seed 0): paged_128 runs its
# 4 slots at 85% over 55 decode steps (100% while rows wait), aligned_128 at 63% over 74 (70%);
# every path 202 tokens.
TINY_SHAPE = {"num_prompts": 16, "dataset": "gsm8k", "hazard": 0.05, "max_new_tokens": 128, "slots": 4, "seed": 0}


def test_eos_long_tail_draws_k_distinct_ids_outside_the_special_ones_deterministically():
    special = [0, 5, 7]
    lengths, eos = eos_long_tail(1000, num_prompts=300, hazard=0.01, seed=3, special_ids=special)
    assert lengths == sample_lengths("gpqa_diamond", 300, seed=3, replace=True)  # more than its 198 prompts
    assert len(eos) == 10 and eos == sorted(set(eos)) and not set(eos) & set(special)
    assert all(isinstance(t, int) and 0 <= t < 1000 for t in eos)
    assert (lengths, eos) == eos_long_tail(1000, num_prompts=300, hazard=0.01, seed=3, special_ids=special)
    assert eos != eos_long_tail(1000, num_prompts=300, hazard=0.01, seed=4, special_ids=special)[1]
    assert eos_long_tail(20, num_prompts=1, hazard=0.5, special_ids=range(10))[1] == list(range(10, 20))
    assert len(eos_long_tail(1000, num_prompts=1, hazard=1e-6)[1]) == 1  # at least one id


def test_the_issues_shape_gives_its_geometric_lengths():
    shape = {k: EOS_LONG_TAIL[k] for k in ("num_prompts", "dataset", "hazard", "seed")}
    lengths, eos = eos_long_tail(151936, special_ids=[151643, 151645], **shape)  # Qwen2.5's vocabulary
    hazard = len(eos) / 151936
    assert len(lengths) == 512 and hazard == pytest.approx(1 / 295, rel=1e-3)
    p50, p90 = (math.log(1 - q) / math.log(1 - hazard) for q in (0.5, 0.9))  # geometric quantiles
    assert round(p50) == 204 and 675 <= p90 <= 685
    signature = inspect.signature(eos_long_tail).parameters
    assert {k: signature[k].default for k in shape} == shape


@pytest.mark.parametrize("bad, message", [
    ({"hazard": 0.0}, r"hazard .* must be a number in \(0, 0.5\], got 0.0"),
    ({"hazard": 0.6}, r"in \(0, 0.5\], got 0.6"),
    ({"hazard": float("nan")}, r"in \(0, 0.5\], got nan"),
    ({"num_prompts": 0}, "num_prompts must be an int >= 1, got 0"),
    ({"num_prompts": 2.0}, "num_prompts must be an int >= 1, got 2.0"),
    ({"dataset": "mmlu"}, r"dataset must be one of \['gsm8k', .*got 'mmlu'"),
    ({"vocab_size": 10, "hazard": 0.5, "special_ids": range(6)}, "needs 5 EOS ids; only 4 of"),
    ({"vocab_size": 0}, "vocab_size must be an int >= 1, got 0"),
])
def test_eos_long_tail_bad_arguments_name_the_value(bad, message):
    args = {"vocab_size": 100, "num_prompts": 4} | bad
    with pytest.raises(ValueError, match=message):
        eos_long_tail(args.pop("vocab_size"), **args)


def test_decode_by_rows_bins_bursts_by_live_rows_in_powers_of_two():
    forwards = [{"kind": "decode", "rows": 1, "steps": 4, "ms": 4.0}, {"kind": "prefill", "batch": 3, "width": 9, "ms": 50.0},
                {"kind": "decode", "rows": 3, "steps": 2, "ms": 3.0}, {"kind": "decode", "rows": 4, "steps": 2, "ms": 5.0},
                {"kind": "decode", "rows": 5, "steps": 1, "ms": 2.0}, {"kind": "decode", "rows": 2, "steps": 1, "ms": 1.5}]
    assert decode_by_rows(forwards) == [
        {"rows_min": 1, "rows_max": 1, "steps": 4, "ms": 4.0, "ms_per_step": 1.0},
        {"rows_min": 2, "rows_max": 2, "steps": 1, "ms": 1.5, "ms_per_step": 1.5},
        {"rows_min": 3, "rows_max": 4, "steps": 4, "ms": 8.0, "ms_per_step": 2.0},
        {"rows_min": 5, "rows_max": 8, "steps": 1, "ms": 2.0, "ms_per_step": 2.0}]
    assert decode_by_rows([]) == []


@pytest.mark.slow
def test_run_long_tail_fills_the_slots_better_paged_and_every_path_samples_the_same_tokens():
    saved = []
    record = run_long_tail(get_tiny("qwen2"), model_name="tiny-qwen2", dtype="float32", config={"device": "cpu"},
                           save=lambda r: saved.append(json.loads(json.dumps(r))), script="test", **TINY_SHAPE)
    paths = list(LONG_TAIL_DEFAULTS["paths"])
    assert [list(r["results"]) for r in saved] == [paths[: i + 1] for i in range(len(paths))]  # saved after every path
    assert record["kind"] == "eos_long_tail" and record["provenance"]["script"] == "test"
    assert record["provenance"]["git_sha"] and record["provenance"]["dtype"] == "float32"
    assert record["config"]["model"] == "tiny-qwen2" and record["config"]["slots"] == 4
    lengths, eos = eos_long_tail(384, num_prompts=16, dataset="gsm8k", hazard=0.05, seed=0, special_ids=[0])
    assert record["workload"] | {"lengths": lengths, "eos_token_ids": eos} == record["workload"]
    results = record["results"]
    assert all(r["output_tokens_per_s"] > 0 and r["mean_ms"] > 0 for r in results.values())
    # fp32 on CPU is exact arithmetic: every route samples the same tokens from the same seed
    assert len({r["output_tokens"] for r in results.values()}) == 1
    assert len({(r["response_p50"], r["response_p90"], r["response_max"]) for r in results.values()}) == 1
    tails = results["paged_128"]
    assert 1 < tails["response_max"] and tails["response_p50"] < tails["response_max"] <= 128
    assert sum(tails["finish_reasons"].values()) == 16 and tails["finish_reasons"]["stop"] > 8
    paged, aligned = results["paged_128"], results["aligned_128"]
    assert paged["num_slots"] == aligned["num_slots"] == 4
    assert paged["settings"] == {"mode": "paged", "continuous_batch_size": 4}
    assert paged["occupancy"] > aligned["occupancy"] + 0.1, (paged["occupancy"], aligned["occupancy"])
    # while rows wait, the paged pool refills every freed slot; the aligned cache leaves some empty
    assert paged["queued_occupancy"] > 0.95 and aligned["queued_occupancy"] < 0.9, (paged, aligned)
    assert paged["num_decode_steps"] < aligned["num_decode_steps"]
    every = results["paged_128_eos_every_step"]  # the same rows, steps and tokens; only the reads differ
    assert every["settings"] == paged["settings"] | {"eos_check_interval": 1}
    assert (every["num_decode_steps"], every["occupancy"]) == (paged["num_decode_steps"], paged["occupancy"])
    by_rows = paged["decode_by_rows"]  # the profiled call's decode steps by live rows, every step counted once
    assert sum(b["steps"] for b in by_rows) == paged["num_decode_steps"] and by_rows[-1]["rows_max"] == 4
    assert sum(b["ms"] for b in by_rows) == pytest.approx(paged["decode_ms"], rel=0.05)
    costs = step_cost_rows(record)  # every path keeps its bins; each path's shares sum to 1
    assert {r["path"] for r in costs} == set(results)
    for path in results:
        mine = [r for r in costs if r["path"] == path]
        assert sum(r["share_of_steps"] for r in mine) == pytest.approx(1.0)
        assert sum(r["share_of_decode_ms"] for r in mine) == pytest.approx(1.0)
    assert step_cost_rows({"results": {"old": {"num_slots": 4}}}) == []  # a record from before the bins
    assert results["paged_memory"]["num_slots"] == results["aligned_all"]["num_slots"] == 16  # the pool holds all
    assert paged["route"] == "paged" and paged["num_preemptions"] == 0 and paged["peak_kv_bytes_over_live"] >= 1
    assert aligned["route"] == "bucketed" and aligned["peak_kv_bytes_over_live"] is None
    rows = long_tail_rows(record)
    assert [(r["path"], r["mode"], r["slots"]) for r in rows] == [
        ("paged_128", "paged", 4), ("paged_128_eos_every_step", "paged", 4), ("aligned_128", "bucketed", 4),
        ("paged_memory", "paged", 16),
        ("aligned_all", "bucketed", 16)]
    assert rows[0]["occupancy"] == paged["occupancy"] and rows[0]["peak_memory_gb"] is None


@pytest.mark.parametrize("bad, message", [
    ({"paths": ["paged_128", "vllm"]}, r"unknown long-tail paths \['vllm'\]; valid: aligned_128, paged_128"),
    ({"paths": []}, r"unknown long-tail paths \(none given\)"),
    ({"slots": 0}, "slots must be an int >= 1, got 0"),
    ({"reps": 1.5}, "reps must be an int >= 1, got 1.5"),
    ({"max_new_tokens": 0}, "max_new_tokens must be an int >= 1, got 0"),
    ({"seed": -1}, "seed must be an int >= 0, got -1"),
    ({"hazard": 0.7}, r"hazard .* in \(0, 0.5\], got 0.7"),
    ({"num_prompts": 0}, "num_prompts must be an int >= 1, got 0"),
    ({"dataset": "mmlu"}, "dataset must be one of"),
])
def test_bad_settings_are_errors_before_any_work(bad, message, monkeypatch):
    monkeypatch.setattr(long_tail_module, "Rollout", lambda *a, **k: pytest.fail("a rollout was built"))
    with pytest.raises(ValueError, match=message):
        check_long_tail_settings(**(dict(LONG_TAIL_DEFAULTS) | bad))
    with pytest.raises(ValueError, match=message):
        run_long_tail(get_tiny("qwen2"), model_name="tiny-qwen2", dtype="float32", **bad)


def test_long_tail_defaults_are_run_long_tails_own():
    signature = inspect.signature(run_long_tail).parameters
    assert {k: signature[k].default for k in LONG_TAIL_DEFAULTS} == LONG_TAIL_DEFAULTS
    # every path runs by default but the bounded admission's, the unfused step's, the whole-model
    # compile's and the FP8 pool's (their costs are questions of their own)
    assert set(LONG_TAIL_PATHS) - set(LONG_TAIL_DEFAULTS["paths"]) == {"paged_128_admit_256", "paged_128_unfused",
                                                                         "paged_128_compile_model", "paged_128_fp8_kv"}
    assert LONG_TAIL_PATHS["paged_128_admit_256"] == LONG_TAIL_PATHS["paged_128"] | {"admit_tokens_per_step": 256}
    assert LONG_TAIL_PATHS["paged_128_unfused"] == LONG_TAIL_PATHS["paged_128"] | {"fuse_projections": False}
    assert LONG_TAIL_PATHS["paged_128_compile_model"] == LONG_TAIL_PATHS["paged_128"] | {"compile": True}
    assert LONG_TAIL_PATHS["paged_128_fp8_kv"] == LONG_TAIL_PATHS["paged_128"] | {"kv_cache_dtype": "fp8"}


@pytest.mark.slow  # the bench on a tiny model
def test_bench_long_tail_writes_the_record_and_refuses_an_existing_one_or_bad_settings(tmp_path, capsys,
                                                                                       monkeypatch):
    out = tmp_path / "long_tail"
    argv = ["--tiny", "qwen2", "--dataset", "gsm8k", "--num-prompts", "6", "--max-new-tokens", "12", "--hazard", "0.1",
            "--slots", "2", "--paths", "paged_128", "aligned_128", "--out", str(out)]
    assert main(["bench", "long-tail", *argv]) == 0
    record = json.loads((tmp_path / "long_tail.json").read_text())
    assert check_record_pair(tmp_path / "long_tail.json", tmp_path / "long_tail.csv") == record["run_id"]
    assert record["provenance"]["script"] == "rollout-lab bench long-tail" and record["provenance"]["argv"] == argv
    assert record["config"]["tiny"] == "qwen2" and list(record["results"]) == ["paged_128", "aligned_128"]
    assert (tmp_path / "long_tail.csv").read_text().splitlines()[0].startswith("run_id,path,git_sha,mode,slots")
    capsys.readouterr()
    monkeypatch.setattr("rollout_lab.cli.bench.build_model", lambda *a, **k: pytest.fail("a model was built"))
    assert main(["bench", "long-tail", *argv]) == 2
    assert "already exist" in capsys.readouterr().err
    for bad, message in ((["--hazard", "0.9"], "in (0, 0.5], got 0.9"), (["--seed", "-2"], "seed must be an int >= 0"),
                         (["--paths", "vllm"], "invalid choice: 'vllm'"),
                         (["--paths", "paged_128_compile_model"], "compile the CUDA-graph decode step; --device is cpu")):
        assert main(["bench", "long-tail", "--tiny", "qwen2", "--dataset", "gsm8k", "--max-new-tokens", "12",
                     "--out", str(tmp_path / "x"), *bad]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and message in err
    assert not (tmp_path / "x.json").exists()
