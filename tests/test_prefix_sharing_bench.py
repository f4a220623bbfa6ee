"""measure.prefix_sharing and its workloads: the shared-prompt-block benchmark behind `rollout-lab
bench prefix-sharing` (issue 54; tiny fp32 models, CPU), its figure and notebook 03's parameter."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import get_tiny

from rollout_lab.cli.main import main
from rollout_lab.engine.limits import ModelLimits
from rollout_lab.measure import prefix_sharing, sections
from rollout_lab.measure.grpo import scaled_prompt_lengths
from rollout_lab.measure.models import from_preset, model_config
from rollout_lab.measure.prefix_sharing import (ISSUE_TARGETS, PREFIX_SHARING_DEFAULTS, PREFIX_SHARING_PATHS,
                                                PROFILE_FIELDS, check_prefix_sharing_settings, prefix_sharing_or_load,
                                                prefix_sharing_rows, prompt_seed, resolve_shape, run_prefix_sharing)
from rollout_lab.measure.records import load_record
from rollout_lab.measure.presets import geometry_for
from rollout_lab.measure.workloads import (SAMPLED_WORKLOADS, WORKLOADS, get_workload, sample_lengths,
                                           scale_keeping_prompts)
from rollout_lab.planner.cost import ModelGeometry


def test_grpo_long_prompt_is_32_seeded_uniform_lengths_in_1500_2500():
    lengths = get_workload("grpo_long_prompt")
    assert len(lengths) == 32 and all(1500 <= n <= 2500 for n in lengths)
    assert lengths == np.random.default_rng(0).integers(1500, 2501, size=32).tolist()  # seeded: the same every run
    assert len(set(lengths)) > 16  # drawn, not one length
    spec = SAMPLED_WORKLOADS["grpo_long_prompt"]
    assert (spec["num_samples"], spec["max_new_tokens"], spec["temperature"], spec["preset"]) == (16, 512, 1.0,
                                                                                               "qwen2.5-3b")
    assert all(150 <= n <= 250 for n in get_workload("grpo_long_prompt", scale=0.1))  # within the tiny model's 512


def test_many_samples_short_is_128_gsm8k_prompts_x_32_x_256_on_llama_3_2_1b():
    assert get_workload("many_samples_short") == sample_lengths("gsm8k", 128, seed=0)
    spec = SAMPLED_WORKLOADS["many_samples_short"]
    assert (spec["num_samples"], spec["max_new_tokens"], spec["preset"]) == (32, 256, "llama-3.2-1b")
    # appended after the others: measure.defaults.prompt_seed's index of every older workload stays
    assert WORKLOADS[-3:] == tuple(SAMPLED_WORKLOADS) and WORKLOADS.index("gsm8k_32") == 6


def test_grpo_gsm8k_is_bench_grpos_issue_shape():
    """64 GSM8K prompts x 8 x 512 (scripts/gpu's GRPO check): the prompt lengths bench grpo draws at seed 0."""
    assert get_workload("grpo_gsm8k") == scaled_prompt_lengths("gsm8k", 64, scale=1.0, seed=0)
    spec = SAMPLED_WORKLOADS["grpo_gsm8k"]
    assert (spec["num_samples"], spec["max_new_tokens"], spec["preset"]) == (8, 512, "qwen2.5-3b")


def test_llama_3_2_1b_preset_has_its_geometry_and_size():
    assert geometry_for("llama-3.2-1b", "bfloat16") == ModelGeometry(16, 32, 8, 64, 2)
    model = from_preset("llama-3.2-1b", dtype=torch.bfloat16, device="meta")
    assert abs(sum(p.numel() for p in model.parameters()) / 1e9 - 1.236) < 0.001  # tied embeddings
    config = model.config
    assert (config.vocab_size, config.pad_token_id, config.rope_parameters["rope_type"]) == (128256, 128004, "llama3")


def test_a_scale_that_clips_a_prompt_to_one_token_is_refused_naming_the_smallest_that_works():
    with pytest.raises(ValueError, match=r"scale=0.0001 makes the shortest of these prompts \(1502 tokens of "
                                         r"grpo_long_prompt\) 0.15 tokens, .*give scale >= 0.000666 \(1/1502\)"):
        scale_keeping_prompts(get_workload("grpo_long_prompt"), 1e-4, what="of grpo_long_prompt")
    for bad in (0, -1.0, float("nan"), True, "0.1"):
        with pytest.raises(ValueError, match=f"scale must be a finite number > 0, got {bad!r}"):
            scale_keeping_prompts([10], bad, what="")
    assert scale_keeping_prompts([10, 30], 0.1, what="") == [1, 3]


# ---------------------------------------------------------------- the bench: settings, record, figure, CLI

def tiny_limits():
    return ModelLimits.of_config(model_config("tiny-qwen2")[0], dtype="float32", device="cpu")


TINY = {"scale": 0.1, "num_prompts": 3, "num_samples": 3, "max_new_tokens": 6, "reps": 1}  # within 512 positions


@pytest.mark.parametrize("bad, message", [
    ({"workload": "gsm8k_32"}, r"workload must be one of \['grpo_long_prompt', 'many_samples_short', 'grpo_gsm8k'\], "
                               r"got 'gsm8k_32'"),
    ({"num_prompts": 0}, "num_prompts must be an int >= 1, got 0"),
    ({"num_prompts": 33}, r"num_prompts=33: grpo_long_prompt has 32 prompts; give at most 32, or None"),
    ({"num_samples": 0}, "num_samples must be an int >= 1, got 0"),
    ({"max_new_tokens": 1.5}, "max_new_tokens must be an int >= 1"),
    ({"scale": 0.0}, "scale must be a finite number > 0, got 0.0"),
    ({"scale": 1e-4}, r"scale=0.0001 makes the shortest of these prompts \(\d+ tokens of grpo_long_prompt\)"),
    ({"prompt_lengths": []}, r"prompt_lengths must be distinct ints >= 1 \(one case each\), or None"),
    ({"prompt_lengths": [16, 16]}, "prompt_lengths must be distinct ints >= 1"),
    ({"prompt_lengths": [0]}, "prompt_lengths must be distinct ints >= 1"),
    ({"prompt_lengths": [16], "scale": 0.5}, r"scale=0.5 multiplies the workload's lengths, which prompt_lengths \[16\] "
                                             r"replace; give one of them"),
    ({"seed": -1}, "seed must be an int >= 0, got -1"),
    ({"reps": 0}, "reps must be an int >= 1, got 0"),
    ({"paths": ["copies", "copies"]}, "prefix-sharing paths must be distinct names from copies, shared"),
    ({"paths": ["copies", "vllm"]}, r"prefix-sharing paths must be distinct names .*got \['copies', 'vllm'\]"),
    ({"paths": []}, "prefix-sharing paths must be distinct names"),
    ({"paths": "copies"}, "prefix-sharing paths must be distinct names .*got copies"),
    ({"sequential": "yes"}, "sequential must be True or False, got 'yes'"),
])
def test_bad_settings_are_errors_before_any_work(bad, message, monkeypatch):
    with pytest.raises(ValueError, match=message):
        check_prefix_sharing_settings(**(PREFIX_SHARING_DEFAULTS | bad))
    monkeypatch.setattr(prefix_sharing, "lengths_to_prompts", lambda *a, **k: pytest.fail("work began"))
    monkeypatch.setattr(prefix_sharing, "Rollout", lambda *a, **k: pytest.fail("work began"))
    with pytest.raises(ValueError, match=message):
        run_prefix_sharing(get_tiny("qwen2"), model_name="tiny-qwen2", dtype="float32",
                           **(PREFIX_SHARING_DEFAULTS | TINY | bad))


def test_a_path_whose_engine_setting_is_missing_is_refused_naming_it(monkeypatch):
    monkeypatch.setitem(PREFIX_SHARING_PATHS, "warp", {"share_prompt_blocks": True, "warp_read": "on"})
    with pytest.raises(ValueError, match=r"path 'warp' sets RolloutConfig.warp_read, which this engine does not have; "
                                         r"leave it out \(paths this engine runs: copies, shared"):
        check_prefix_sharing_settings(**(PREFIX_SHARING_DEFAULTS | {"paths": ["copies", "warp"]}))


@pytest.mark.parametrize("bad, message", [
    ({}, r"scale=1.0: the longest prompt \(2471 tokens\) and 512 new tokens would take 2983 positions, past the "
         r"model's context of 512: fewer than 512 max_new_tokens, and shorter prompts"),
    ({"max_new_tokens": 16}, r"scale=1.0: .* 2487 positions, .*: scale <= 0.2, or fewer max_new_tokens"),
    ({"max_new_tokens": 16, "prompt_lengths": [16, 600]}, r"prompt_lengths=\[16, 600\]: .*prompt lengths of at most 496"),
    ({"max_new_tokens": 500, "scale": 0.01}, "max_new_tokens=500: .*at most max_new_tokens=487"),
    ({"num_samples": 2**16, "scale": 0.1, "max_new_tokens": 1},
     r"num_samples=65536 x 32 requests = 2097152 rows, more than the 1048576 rows one call takes"),
])
def test_the_model_limits_are_checked_naming_what_fits(bad, message):
    with pytest.raises(ValueError, match=message):
        check_prefix_sharing_settings(**(PREFIX_SHARING_DEFAULTS | bad), limits=tiny_limits())
    check_prefix_sharing_settings(**(PREFIX_SHARING_DEFAULTS | {"scale": 0.2, "max_new_tokens": 16}),
                                  limits=tiny_limits())  # the scale it names fits


def test_the_shape_takes_the_workloads_own_unless_overridden():
    shape = resolve_shape(workload="grpo_long_prompt")
    assert (shape["num_samples"], shape["max_new_tokens"], shape["temperature"]) == (16, 512, 1.0)
    assert [c["prompt_length"] for c in shape["cases"]] == [None] and shape["cases"][0]["lengths"] == \
        get_workload("grpo_long_prompt")
    sweep = resolve_shape(workload="many_samples_short", num_prompts=4, prompt_lengths=[1024, 256])
    assert [(c["prompt_length"], c["lengths"]) for c in sweep["cases"]] == [(256, [256] * 4), (1024, [1024] * 4)]
    assert (sweep["num_samples"], sweep["max_new_tokens"]) == (32, 256)
    # every call of a run draws prompts of its own
    assert len({prompt_seed(0, case, call) for case in range(3) for call in range(4)}) == 12
    assert prompt_seed(1, 0, 0) != prompt_seed(0, 0, 1)


@pytest.mark.slow  # ~1.5 s: two paths x (warm-up, a timed call, a profiled one) on the tiny model
def test_run_prefix_sharing_records_each_path_and_the_ratios_over_copies():
    saved = []
    record = run_prefix_sharing(get_tiny("qwen2"), model_name="tiny-qwen2", dtype="float32", save=saved.append,
                                config={"device": "cpu"}, script="test", **TINY)
    assert record["kind"] == "prefix_sharing" and record["provenance"]["script"] == "test" and saved
    assert record["config"]["model"] == "tiny-qwen2" and record["config"]["sequential"] is False
    assert record["targets"] == ISSUE_TARGETS
    work = record["workload"]
    assert (work["name"], work["num_prompts"], work["num_samples"], work["max_new_tokens"], work["num_rows"]) == \
        ("grpo_long_prompt", 3, 3, 6, 9)
    (case,) = record["cases"]
    assert case["lengths"] == get_workload("grpo_long_prompt", scale=0.1)[:3] and case["prompt_length"] is None
    assert set(case["results"]) == {"copies", "shared"}
    for path, res in case["results"].items():
        assert res["output_tokens"] == 9 * 6 and res["route"] == "paged" and len(res["samples_ms"]) == 1
        assert res["output_tokens_per_s"] == pytest.approx(54 / (res["mean_ms"] / 1e3))
        assert res["first_call_ms"] > 0 and res["peak_kv_tokens"] == res["peak_kv_blocks"] * res["kv_block_size"]
        assert res["peak_kv_over_unique"] == pytest.approx(res["peak_kv_tokens"] / res["unique_kv_tokens"])
        assert set(PROFILE_FIELDS) <= set(res) and res["settings"] == PREFIX_SHARING_PATHS[path]
    copies, shared = case["results"]["copies"], case["results"]["shared"]
    assert copies["shared_kv_blocks"] == 0 < shared["shared_kv_blocks"]  # 3 samples of prompts over one block
    assert shared["unique_kv_tokens"] < copies["unique_kv_tokens"]
    ratios = case["ratios"]["shared"]
    assert ratios["output_tokens_per_s_over_copies"] == pytest.approx(shared["output_tokens_per_s"]
                                                                      / copies["output_tokens_per_s"])
    assert ratios["peak_kv_tokens_over_copies"] < 1
    assert case["checks"] == {"shared_equals_copies_fraction": 1.0}  # fp32: the same tokens
    rows = prefix_sharing_rows(record)
    assert [(r["path"], r["prompt_length"]) for r in rows] == [("copies", case["mean_prompt_length"]),
                                                              ("shared", case["mean_prompt_length"])]
    assert rows[0]["tokens_per_s_over_copies"] == 1.0 and rows[1]["equals_copies_fraction"] == 1.0


@pytest.mark.slow  # ~2 s: a sweep of two prompt lengths, each path alone
def test_a_prompt_length_sweep_runs_one_case_per_length_each_path_alone():
    record = run_prefix_sharing(get_tiny("qwen2"), model_name="tiny-qwen2", dtype="float32", prompt_lengths=[80, 16],
                                num_prompts=2, num_samples=2, max_new_tokens=4, reps=1, sequential=True)
    assert [c["prompt_length"] for c in record["cases"]] == [16, 80]
    assert [c["lengths"] for c in record["cases"]] == [[16, 16], [80, 80]]
    for case in record["cases"]:
        assert set(case["results"]) == {"copies", "shared"} and case["checks"]["shared_equals_copies_fraction"] == 1.0
    assert [r["prompt_length"] for r in prefix_sharing_rows(record)] == [16, 16, 80, 80]


def synthetic_rows(*, reads: bool = True):
    return [{"path": p, "prompt_length": n, "output_tokens_per_s": tps * (2.0 if p != "copies" else 1.0),
             "tokens_per_s_over_copies": 2.0 if p != "copies" else 1.0, "peak_kv_tokens": n * 16 * share,
             "unique_kv_tokens": n * 12 * share,
             "kv_bytes_read_per_step": (n * 16 * share * 36864 if reads else None)}
            for p, share in (("copies", 1.0), ("shared", 0.25)) for n, tps in ((256, 9000.0), (1024, 6000.0), (2048, 4000.0))]


@pytest.mark.slow  # ~0.6 s: two figures laid out
def test_the_figure_draws_reads_speed_and_memory_over_the_prompt_length():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from rollout_lab.plots.prefix_sharing import plot_prefix_sharing

    fig = plot_prefix_sharing(synthetic_rows(), title="synthetic")
    reads, speed, memory = fig.axes
    assert reads.get_ylabel() == "KV GiB read per decode step" and reads.get_xscale() == "log"
    assert [t.get_text() for t in speed.get_xticklabels()] == ["256", "1024", "2048"]
    assert [len(ax.get_lines()) for ax in (reads, speed, memory)] == [2, 2, 4]  # memory: peak and unique per path
    assert {t.get_text() for t in speed.texts} == {"2.00× faster"}
    plt.close(fig)
    fig = plot_prefix_sharing(synthetic_rows(reads=False))
    assert not fig.axes[0].axison and "not measured" in fig.axes[0].texts[0].get_text()
    plt.close(fig)


@pytest.mark.slow  # ~0.4 s: a figure laid out
def test_a_record_of_one_prompt_length_is_drawn_as_bars_per_path():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from rollout_lab.plots.prefix_sharing import plot_prefix_sharing

    rows = [r for r in synthetic_rows() if r["prompt_length"] == 1024]
    fig = plot_prefix_sharing(rows, title="one")
    reads, speed, memory = fig.axes
    assert [len(ax.patches) for ax in (reads, speed, memory)] == [2, 2, 4]  # memory: peak and unique per path
    assert [p.get_height() for p in speed.patches] == [6000.0, 12000.0]
    assert [t.get_text() for t in speed.get_xticklabels()] == ["copies", "shared"]
    assert {t.get_text() for t in speed.texts} == {"2.00× faster"} and "1,024 tokens" in fig.texts[0].get_text()
    plt.close(fig)


def test_the_figure_reads_in_the_largest_byte_unit_and_refuses_no_rows():
    from rollout_lab.plots.prefix_sharing import byte_unit, plot_prefix_sharing

    assert byte_unit([512.0, 3 * 2**30]) == ("GiB", 2**30) and byte_unit([1023.0]) == ("B", 1)
    assert byte_unit([]) == ("B", 1)
    with pytest.raises(ValueError, match="no prefix-sharing rows"):
        plot_prefix_sharing([])


def test_bench_prefix_sharing_refuses_bad_settings_before_the_model_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("rollout_lab.cli.bench.build_model", lambda *a, **k: pytest.fail("built a model before the checks"))
    bench = ["bench", "prefix-sharing", "--out", str(tmp_path / "rec")]
    for argv, message in (
        (["--tiny", "qwen2"], "error: scale=1.0: the longest prompt (2471 tokens) and 512 new tokens"),
        (["--tiny", "qwen2", "--prompt-lengths", "16", "--scale", "0.1"], "error: scale=0.1 multiplies"),
        # no --preset: the workload's (Llama-3.2-1B: 131072 positions)
        (["--workload", "many_samples_short", "--device", "cpu", "--max-new-tokens", "200000"],
         "error: max_new_tokens=200000: the longest prompt (164 tokens) and 200000 new tokens would take 200164 "
         "positions, past the model's context of 131072"),
    ):
        assert main([*bench, *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith(message) and err.count("\n") == 1, err
    assert not list(tmp_path.iterdir())
    assert main(["bench", "prefix-sharing", "--help"]) == 0
    out = capsys.readouterr().out
    for option in ("--workload", "--prompt-lengths", "--sequential", "--paths", "--reps", "--num-samples"):
        assert option in out, option


@pytest.mark.slow  # ~3 s: the command on the tiny model, in this process
def test_bench_prefix_sharing_writes_the_record(tmp_path, capsys):
    out = tmp_path / "rec"
    assert main(["bench", "prefix-sharing", "--tiny", "qwen2", "--scale", "0.1", "--num-prompts", "2",
                 "--num-samples", "2", "--max-new-tokens", "4", "--reps", "1", "--out", str(out)]) == 0
    record = load_record(Path(f"{out}.json"), "prefix_sharing")
    assert record["provenance"]["script"] == "rollout-lab bench prefix-sharing"
    assert record["config"]["tiny"] == "qwen2" and set(record["cases"][0]["results"]) == {"copies", "shared"}
    assert "ratios" in capsys.readouterr().out


# ---------------------------------------------------------------- notebook 03: prefix_sharing_shape / _results_file

def test_notebook_03_takes_a_prefix_sharing_shape_or_record():
    from rollout_lab.notebooks import INPUT_PARAMETERS, NOTEBOOK_PARAMETERS, SMOKE_PARAMETERS, check_parameter

    check_parameter("03_latency_tables", "prefix_sharing_shape", {"workload": "many_samples_short", "reps": 1})
    check_parameter("03_latency_tables", "prefix_sharing_shape", SMOKE_PARAMETERS["03_latency_tables"]["prefix_sharing_shape"])
    check_parameter("03_latency_tables", "prefix_sharing_shape", None)
    with pytest.raises(ValueError, match=r"prefix_sharing_shape=\{'workloads': 'x'\} .*unknown settings \['workloads'\]"):
        check_parameter("03_latency_tables", "prefix_sharing_shape", {"workloads": "x"})
    with pytest.raises(ValueError, match="prefix_sharing_shape=7 .*takes a dict of rollout_lab.measure.prefix_sharing"):
        check_parameter("03_latency_tables", "prefix_sharing_shape", 7)
    assert "prefix_sharing_results_file" in INPUT_PARAMETERS and \
        "prefix_sharing_results_file" in NOTEBOOK_PARAMETERS["03_latency_tables"]


def test_prefix_sharing_or_load_refuses_before_the_model_is_built(tmp_path, monkeypatch):
    monkeypatch.setattr(sections, "load_model", lambda *a, **k: pytest.fail("built a model"))
    kwargs = dict(model="tiny-qwen2", dtype="float32", device="cpu", output_dir=tmp_path)
    assert prefix_sharing_or_load(prefix_sharing_shape=None, prefix_sharing_results_file=None, **kwargs) is None
    with pytest.raises(ValueError, match="not both"):
        prefix_sharing_or_load(prefix_sharing_shape={}, prefix_sharing_results_file="x.json", **kwargs)
    with pytest.raises(ValueError, match=r"prefix_sharing_shape has unknown settings \['samples'\]"):
        prefix_sharing_or_load(prefix_sharing_shape={"samples": 2}, prefix_sharing_results_file=None, **kwargs)
    with pytest.raises(ValueError, match="scale=1.0: the longest prompt"):  # the defaults are past 512 positions
        prefix_sharing_or_load(prefix_sharing_shape={}, prefix_sharing_results_file=None, **kwargs)
    assert not (tmp_path / "data").exists()


@pytest.mark.slow  # ~1 s: the tiny shape measured, written, then rendered from its file
def test_prefix_sharing_or_load_measures_into_the_workspace_then_renders_the_record(tmp_path, monkeypatch):
    shape = {"num_prompts": 2, "num_samples": 2, "max_new_tokens": 4, "reps": 1, "prompt_lengths": [16, 80]}
    name, record = prefix_sharing_or_load(prefix_sharing_shape=shape, prefix_sharing_results_file=None,
                                          model="tiny-qwen2", dtype="float32", device="cpu", output_dir=tmp_path)
    assert name == str(tmp_path / "data" / "results" / "prefix_sharing_tiny-qwen2_float32_cpu.json")
    assert record["provenance"]["script"] == "notebook 03 (prefix_sharing_shape)"
    monkeypatch.setattr(prefix_sharing, "run_prefix_sharing", lambda *a, **k: pytest.fail("measured again"))
    again = prefix_sharing_or_load(prefix_sharing_shape=None, prefix_sharing_results_file=name, model="tiny-qwen2",
                                   dtype="float32", device="cpu")
    assert again[1]["cases"] == json.loads(json.dumps(record["cases"]))
    with pytest.raises(ValueError, match="already exist"):
        prefix_sharing_or_load(prefix_sharing_shape=shape, prefix_sharing_results_file=None, model="tiny-qwen2",
                               dtype="float32", device="cpu", output_dir=tmp_path)


def test_prefix_sharing_defaults_are_run_prefix_sharings_own():
    import inspect

    signature = inspect.signature(run_prefix_sharing).parameters
    assert {k: signature[k].default for k in PREFIX_SHARING_DEFAULTS} == PREFIX_SHARING_DEFAULTS
    signature = inspect.signature(check_prefix_sharing_settings).parameters
    assert set(PREFIX_SHARING_DEFAULTS) | {"limits"} == set(signature)
