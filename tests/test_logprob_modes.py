"""Notebook 03's logprob modes (issue 56): ``measure.trainer_loop.logprob_mode_rows`` and
``load_logprob_mode_records``, ``plots.latency.plot_logprob_modes``, and the notebook parameter
``logprob_modes_results_file`` (its check, its files, the section run by papermill)."""
from __future__ import annotations

import copy
import csv
import json
from pathlib import Path

import matplotlib
import pytest

matplotlib.use("Agg")

from rollout_lab.measure.trainer_loop import load_logprob_mode_records, logprob_mode_rows  # noqa: E402
from rollout_lab.notebooks import check_inputs, check_parameter, resolve_path_parameters  # noqa: E402
from rollout_lab.plots.latency import plot_logprob_modes  # noqa: E402
from rollout_lab.workspace import write_record  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
COMMITTED = ROOT / "data" / "results"
H100_RAW = COMMITTED / "trainer_loop_qwen2.5-0.5b_bfloat16_cuda_h100_head-kernel.json"
H100_TRAINER = COMMITTED / "trainer_loop_qwen2.5-0.5b_bfloat16_cuda_h100_trainer_head-kernel.json"
NB = "03_latency_tables"
ZERO = {"mean_abs": 0.0, "p50_abs": 0.0, "p99_abs": 0.0, "max_abs": 0.0, "equal_share": 1.0}
MICRO_ZERO = {"1": 0.0, "8": 0.0, "64": 0.0, "all": 0.0}


def iteration(i: int, *, steady_ms: float, train_ms: float, mismatch: dict, micro: dict | None) -> dict:
    """One iteration shaped as ``run_trainer_loop`` writes it (the fields the rows read, and a few more)."""
    return {"iteration": i, "first_rollout_ms": steady_ms + 1.0, "steady_rollout_ms": steady_ms,
            "sync_ms": 1.0, "train_ms": train_ms, "assign_ms": None, "decode_captures": 0, "stepper_rebuilt": False,
            "compiled_frames": 0, "mean_reward": 0.5, "route": "paged", "peak_rollout_bytes": None,
            "peak_train_bytes": None, "logprob_mismatch": dict(mismatch), "micro_batch_max_abs": micro}


def record(logprobs_mode: str, iterations: list[dict], *, batch_invariant: bool = False,
           device_name: str = "NVIDIA H100 80GB HBM3") -> dict:
    """A trainer-loop record shaped as the CPU run of the issue's command writes it."""
    return {"kind": "trainer_loop",
            "provenance": {"git_sha": "260907e0000", "device_type": "cuda", "device_name": device_name,
                           "dtype": "bfloat16"},
            "config": {"dataset": "gsm8k", "num_prompts": 4, "num_samples": 2, "max_new_tokens": 8, "scale": 0.1,
                       "iterations": len(iterations), "lr": 1e-5, "train_rows": None, "logprobs_mode": logprobs_mode,
                       "train_mode": "toggle", "gradient_checkpointing": False, "assign": False, "mode": "paged",
                       "seed": 0, "batch_invariant": batch_invariant, "dtype": "bfloat16", "model": "tiny-qwen2"},
            "workload": {"lengths": [11, 8, 15, 10], "num_rows": 8, "num_generated_tokens": 64},
            "results": {"iterations": iterations, "first_call_ms": 100.0, "stepper": {"kind": None}}}


def three_modes() -> dict[str, dict]:
    raw = [{"mean_abs": 0.009, "p50_abs": 0.008, "p99_abs": 0.031, "max_abs": 0.055, "equal_share": 0.001},
           {"mean_abs": 0.011, "p50_abs": 0.010, "p99_abs": 0.033, "max_abs": 0.062, "equal_share": 0.003}]
    return {
        "default": record("raw", [iteration(0, steady_ms=100.0, train_ms=300.0, mismatch=raw[0],
                                            micro={"1": 0.05, "8": 0.06, "64": 0.055, "all": 0.055}),
                                  iteration(1, steady_ms=120.0, train_ms=200.0, mismatch=raw[1], micro=None)]),
        "trainer recompute": record("trainer", [iteration(0, steady_ms=170.0, train_ms=250.0, mismatch=ZERO,
                                                          micro={"1": 0.01, "8": 0.0, "64": 0.0, "all": 0.0})]),
        "invariant": record("raw", [iteration(0, steady_ms=121.0, train_ms=280.0, mismatch=ZERO, micro=MICRO_ZERO)],
                            batch_invariant=True),
    }


# ---------------------------------------------------------------- the rows

def test_rows_one_per_mode_costs_mismatch_and_micro_batches():
    rows = logprob_mode_rows(three_modes())
    assert [r["mode"] for r in rows] == ["default", "trainer recompute", "invariant"]
    default, trainer, invariant = rows
    assert default["steady_rollout_ms"] == pytest.approx(110.0) and default["train_ms"] == pytest.approx(250.0)
    assert default["mean_abs"] == pytest.approx(0.010) and default["p99_abs"] == pytest.approx(0.032)
    assert default["max_abs"] == 0.062  # the worst iteration's, not a mean
    assert default["equal_share"] == pytest.approx(0.002) and default["iterations"] == 2
    assert (default["micro_1"], default["micro_8"], default["micro_64"], default["micro_all"]) == (0.05, 0.06, 0.055, 0.055)
    assert [r["rollout_vs_first"] for r in rows] == pytest.approx([1.0, 170 / 110, 121 / 110])
    assert (trainer["logprobs_mode"], trainer["batch_invariant"], trainer["micro_1"]) == ("trainer", False, 0.01)
    assert invariant["batch_invariant"] is True and invariant["max_abs"] == 0 and invariant["micro_all"] == 0
    assert default["git_sha"] == "260907e" and default["route"] == "paged"


def test_rows_of_old_records_without_micro_batches():
    """Records written before micro_batch_max_abs (absent or None, as the committed H100 ones) give None."""
    modes = three_modes()
    for it in modes["default"]["results"]["iterations"]:
        del it["micro_batch_max_abs"]
    modes["trainer recompute"]["results"]["iterations"][0]["micro_batch_max_abs"] = None
    del modes["invariant"]["config"]["batch_invariant"]
    rows = logprob_mode_rows(modes)
    assert all(r[f"micro_{k}"] is None for r in rows[:2] for k in (1, 8, 64, "all"))
    assert rows[2]["batch_invariant"] is False
    committed = logprob_mode_rows(load_logprob_mode_records({"default": str(H100_RAW), "trainer": str(H100_TRAINER)}))
    assert committed[0]["micro_1"] is None and committed[1]["max_abs"] == 0 and committed[1]["rollout_vs_first"] > 1


@pytest.mark.parametrize("change, message", [
    (lambda m: m["invariant"]["config"].update(num_prompts=64),
     r"mode 'invariant' ran num_prompts=64, mode 'default' 4: their costs do not compare"),
    (lambda m: m["invariant"]["provenance"].update(device_name="NVIDIA H200"),
     r"mode 'invariant' ran on 'NVIDIA H200', mode 'default' on 'NVIDIA H100 80GB HBM3': give records of one card"),
    (lambda m: m["invariant"].update(kind="grpo"), r"mode 'invariant' is not a trainer_loop record \(kind 'grpo'\)"),
    (lambda m: m["invariant"]["results"].update(iterations=[]), r"mode 'invariant': the record has no iterations"),
])
def test_rows_refuse_records_that_do_not_compare(change, message):
    modes = three_modes()
    change(modes)
    with pytest.raises(ValueError, match=message):
        logprob_mode_rows(modes)


def test_rows_and_loader_refuse_no_records(tmp_path):
    with pytest.raises(ValueError, match=r"expected a non-empty dict of \{mode name: trainer-loop record\}, got \{\}"):
        logprob_mode_rows({})
    with pytest.raises(ValueError, match=r"expected a non-empty dict .* got \['a.json'\]"):
        load_logprob_mode_records(["a.json"])


def test_loader_names_the_mode_of_a_record_of_another_kind(tmp_path):
    paths = write_records(tmp_path, three_modes())
    records = load_logprob_mode_records(paths)
    assert list(records) == list(paths) and records["invariant"]["config"]["batch_invariant"] is True
    grpo = tmp_path / "grpo.json"
    grpo.write_text(json.dumps({"kind": "grpo"}))
    with pytest.raises(ValueError, match=r"logprobs mode 'invariant': '.*grpo.json' is not a trainer_loop record"):
        load_logprob_mode_records({**paths, "invariant": str(grpo)})


# ---------------------------------------------------------------- the figure

def test_figure_draws_cost_ratios_and_says_exact_zeros():
    fig = plot_logprob_modes(logprob_mode_rows(three_modes()), title="three modes")
    left, right = fig.axes
    texts = [t.get_text() for t in left.texts]
    assert texts == ["1.00x", f"{170 / 110:.2f}x", f"{121 / 110:.2f}x"]
    words = [t.get_text() for t in right.texts]
    assert words[0].startswith("0.2% of") and all("exactly 0" in w for w in words[2:])
    assert "exactly 0" not in words[1]  # the trainer's 1-row micro-batches differ: not exactly 0
    assert right.get_yscale() == "log"
    labels = right.get_legend_handles_labels()[1]
    assert "max, trainer's forward in 1-row micro-batches" in labels and "max |Δ|" in labels
    assert fig.texts[0].get_text() == "three modes"


def test_figure_of_old_records_says_the_micro_batches_are_missing():
    rows = logprob_mode_rows(three_modes())
    for r in rows:
        r.update(micro_1=None, micro_8=None, micro_64=None, micro_all=None)
    right = plot_logprob_modes(rows).axes[1]
    assert right.get_title(loc="right") == "micro-batch maxima: not in these records"
    assert not any("micro-batches" in label for label in right.get_legend_handles_labels()[1])


# ---------------------------------------------------------------- notebook 03's parameter

def write_records(folder: Path, modes: dict[str, dict]) -> dict[str, str]:
    paths = {}
    for k, (name, rec) in enumerate(modes.items()):
        stem = folder / f"trainer_loop_{k}"
        write_record((stem.with_suffix(".json"), stem.with_suffix(".csv")), copy.deepcopy(rec), [{"mode": name}])
        paths[name] = str(stem.with_suffix(".json"))
    return paths


def test_the_parameter_takes_a_dict_of_record_paths(tmp_path):
    check_parameter(NB, "logprob_modes_results_file", None)
    check_parameter(NB, "logprob_modes_results_file", {"default": "a.json", "invariant": "b.json"})
    for bad, problem in (({}, "an empty dict"), ("a.json", "has type str"),
                         ({"default": 3}, "mode 'default': 3 is not a path"),
                         ({"": "a.json"}, "mode name '' is not a non-empty str")):
        with pytest.raises(ValueError, match=(f"03_latency_tables: parameter logprob_modes_results_file={bad!r} .*"
                                              f"{problem}.*takes a dict of {{mode name: trainer-loop record path}}")
                           .replace("{", r"\{").replace("}", r"\}").replace("(", r"\(").replace(")", r"\)")):
            check_parameter(NB, "logprob_modes_results_file", bad)


def test_the_parameters_files_are_resolved_and_checked_before_the_notebook(tmp_path, monkeypatch):
    paths = write_records(tmp_path, three_modes())
    monkeypatch.chdir(tmp_path)
    relative = {name: Path(p).name for name, p in paths.items()}
    resolved = resolve_path_parameters({"logprob_modes_results_file": relative}, cwd=tmp_path)
    assert resolved["logprob_modes_results_file"] == paths
    check_inputs(NB, resolved)
    with pytest.raises(ValueError, match=r"03_latency_tables: logprob_modes_results_file='.*missing.json' does not exist"):
        check_inputs(NB, {"logprob_modes_results_file": {**paths, "invariant": str(tmp_path / "missing.json")}})
    grpo = tmp_path / "grpo.json"
    grpo.write_text(json.dumps({"kind": "grpo"}))
    with pytest.raises(ValueError, match=r"03_latency_tables: logprob_modes_results_file: '.*grpo.json' is not a "
                                         r"trainer_loop record \(kind != 'trainer_loop'\)"):
        check_inputs(NB, {"logprob_modes_results_file": {**paths, "invariant": str(grpo)}})


@pytest.mark.slow
def test_notebook_03_renders_the_logprob_modes(tmp_path):
    """The section run by papermill on the committed H100 records (no micro-batch maxima) and the
    synthetic invariant one: its table and figure; every other section renders a committed record
    or is skipped, so nothing is measured."""
    pytest.importorskip("papermill")
    from rollout_lab.notebooks import run_notebooks

    invariant = three_modes()["invariant"]
    base = json.loads(H100_RAW.read_text())
    invariant["config"] = {**base["config"], "batch_invariant": True}
    invariant["provenance"] = base["provenance"]
    files = {"default": str(H100_RAW), "trainer recompute": str(H100_TRAINER),
             "invariant": write_records(tmp_path, {"invariant": invariant})["invariant"]}
    run_notebooks(names=[NB], out_dir=tmp_path, progress=False,
                  extra={NB: {"results_file": str(COMMITTED / "sweep_qwen2.5-3b_bfloat16_cuda.json"),
                              "prefill_batch_sizes": None, "logprob_modes_results_file": files}})
    with (tmp_path / "data" / "tables" / "03_logprob_modes_qwen2_5_0_5b_bfloat16_cuda.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert [r["mode"] for r in rows] == list(files)
    assert rows[0]["micro_1"] == "" and float(rows[1]["max_abs"]) == 0 and rows[2]["micro_all"] == "0.0"
    assert float(rows[1]["rollout_vs_first"]) > 1
    png = tmp_path / "figures" / "03_logprob_modes_qwen2_5_0_5b_bfloat16_cuda.png"
    assert png.is_file() and png.stat().st_size > 5000
