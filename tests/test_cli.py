"""The command line: plan from a dataset or a file with a header, cost files checked against the
setting, every user error one line ``error: ...`` with status 2 before any work, and a missing
optional dependency named with the extra that installs it."""
from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rollout_lab.cli.main import main
from rollout_lab.measure.presets import geometry_for
from rollout_lab.planner.cost import CostCoefficients, setting_metadata
from rollout_lab.workspace import Workspace

REPO = Path(__file__).resolve().parents[1]


def one_error_line(capsys) -> str:
    """The command's stderr, which must be exactly one line starting with "error:"."""
    err = capsys.readouterr().err
    assert err.startswith("error:") and err.count("\n") == 1, err
    return err


def test_plan_a_real_dataset_batch(capsys):
    assert main(["plan", "--dataset", "gsm8k", "--num-prompts", "32"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("32 prompts, qwen2.5-3b float32 geometry")
    assert "bucketed prefill" in out and "route for 16 new tokens" in out


def test_plan_prices_the_packed_route_once_calibrated(tmp_path, capsys):
    from rollout_lab.planner.cost import CostCoefficients

    assert main(["plan", "512", "16", "16", "16"]) == 0
    out = capsys.readouterr().out
    assert "packed prefill" in out and "1 forwards of 560 tokens" in out and "not calibrated" in out
    assert "packed CB not a candidate" in out
    setting = setting_metadata(geometry=geometry_for("qwen2.5-3b", "float32"), dtype="float32", model_name="qwen2.5-3b")
    CostCoefficients(packed_prompt_cost_ms=0.1).to_json(tmp_path / "c.json", metadata=setting)
    assert main(["plan", "512", "16", "16", "16", "--costs", str(tmp_path / "c.json"), "--max-new-tokens", "1"]) == 0
    out = capsys.readouterr().out
    assert "route for 1 new tokens: packed" in out and "not calibrated" not in out
    assert f"costs: {tmp_path / 'c.json'} (checked: model_name, geometry, dtype;" in out


def test_plan_prices_the_paged_route_under_refill(capsys):
    """With fewer slots than prompts and a long-tailed prior, the aligned cache would wait: paged."""
    lengths = ["100"] * 64
    assert main(["plan", *lengths, "--continuous-batch-size", "16", "--max-new-tokens", "1024",
                 "--response-lengths", "20", "30", "40", "1024"]) == 0
    out = capsys.readouterr().out
    assert "route for 1024 new tokens: paged" in out
    assert main(["plan", *lengths, "--max-new-tokens", "1024"]) == 0
    assert "paged CB not a candidate: no refill" in capsys.readouterr().out


def test_plan_reads_a_csv_with_a_header_and_plain_numbers(tmp_path, capsys):
    (tmp_path / "h.csv").write_text("name,index,num_tokens\nx,0,512\nx,1,16\nx,2,16\n")
    (tmp_path / "t.csv").write_text("id,tokens\n0,512\n1,16\n")
    (tmp_path / "l.csv").write_text("length,id\n512,0\n16,1\n9,2\n7,3\n")
    (tmp_path / "n.txt").write_text("512, 16\n16 16")
    assert main(["plan", "--file", str(tmp_path / "h.csv")]) == 0
    assert capsys.readouterr().out.startswith("3 prompts")
    assert main(["plan", "--file", str(tmp_path / "t.csv")]) == 0
    assert capsys.readouterr().out.startswith("2 prompts")
    assert main(["plan", "--file", str(tmp_path / "l.csv")]) == 0
    assert capsys.readouterr().out.startswith("4 prompts")
    assert main(["plan", "--file", str(tmp_path / "n.txt"), "20"]) == 0
    assert capsys.readouterr().out.startswith("5 prompts")
    shipped = REPO / "rollout_lab" / "measure" / "prompt_lengths" / "gsm8k.csv"  # the README's example
    assert main(["plan", "--file", str(shipped)]) == 0
    assert capsys.readouterr().out.startswith("1319 prompts")


@pytest.mark.parametrize("content, message", [
    ("a,b\n1,2\n", "needs a column named one of \\['num_tokens', 'tokens', 'length'\\]"),
    ("num_tokens\n12\nmany\n", "'many' is not an integer"),
    ("12 x", "'x' is not an integer"),
])
def test_plan_file_errors_are_one_line(tmp_path, content, message, capsys):
    (tmp_path / "f.csv").write_text(content)
    assert main(["plan", "--file", str(tmp_path / "f.csv")]) == 2
    assert re.search(message, one_error_line(capsys))


def test_plan_refuses_a_huge_file_and_too_many_lengths_before_planning(tmp_path, monkeypatch, capsys):
    """A 200 MB lengths file once ran past 300 s: an oversized file is refused unread, and more
    lengths than a batch would hold (from any source) before the DP."""
    from rollout_lab.cli.main import MAX_PLAN_PROMPTS
    from rollout_lab.measure.workloads import MAX_LENGTHS_FILE_BYTES

    monkeypatch.setattr("rollout_lab.cli.main.plan_buckets", lambda *a, **k: pytest.fail("planned anyway"))
    with (tmp_path / "huge.txt").open("wb") as handle:
        handle.truncate(MAX_LENGTHS_FILE_BYTES + 1)  # sparse: its size, not its bytes
    assert main(["plan", "--file", str(tmp_path / "huge.txt")]) == 2
    assert f"is {MAX_LENGTHS_FILE_BYTES + 1} bytes, over the {MAX_LENGTHS_FILE_BYTES}" in one_error_line(capsys)
    (tmp_path / "many.txt").write_text("16 " * MAX_PLAN_PROMPTS)
    assert main(["plan", "--file", str(tmp_path / "many.txt"), "512"]) == 2
    assert f"at most {MAX_PLAN_PROMPTS} prompt lengths, got {MAX_PLAN_PROMPTS + 1}" in one_error_line(capsys)


def test_plan_without_lengths_or_with_an_unknown_file(tmp_path, capsys):
    assert main(["plan"]) == 2
    assert "give prompt lengths" in one_error_line(capsys)
    assert main(["plan", "--file", str(tmp_path / "missing.csv")]) == 2
    assert "does not exist" in one_error_line(capsys)


def test_plan_refuses_a_prompt_and_budget_past_the_context_before_planning(monkeypatch, capsys):
    monkeypatch.setattr("rollout_lab.cli.main.plan_buckets", lambda *a, **k: pytest.fail("planned anyway"))
    assert main(["plan", "10", "--max-new-tokens", "10000000000"]) == 2
    err = one_error_line(capsys)
    assert "--max-new-tokens 10000000000" in err and "context of 32768" in err and "--max-new-tokens <= 32758" in err
    assert main(["plan", "100000000"]) == 2  # no API advice (prefill_max_tokens, plan_chunked) the CLI lacks
    err = one_error_line(capsys)
    assert "(100000000 tokens)" in err and "prompts of at most 32752 tokens" in err and "plan_chunked" not in err
    monkeypatch.undo()
    assert main(["plan", "40000", "--preset", "qwen3-0.6b", "--max-new-tokens", "960"]) == 0  # its own 40960
    capsys.readouterr()


def test_plan_context_of_a_preset_is_the_one_its_model_has():
    """plan reads a preset's context without torch (presets.context_for), from the table the built
    model's config is made from."""
    from rollout_lab.measure.models import model_config
    from rollout_lab.measure.presets import PRESETS, context_for

    for preset in PRESETS:
        assert context_for(preset) == model_config(preset)[0].max_position_embeddings, preset


def test_plan_refuses_a_prompt_over_one_forward_in_the_clis_words(tmp_path, capsys):
    folder = tmp_path / "long-context"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 64,
        "max_position_embeddings": 131072}))
    assert main(["plan", "70000", "--model", str(folder)]) == 2
    err = one_error_line(capsys)
    assert "70000 tokens, over the 65536" in err and "prompts of at most 65536 tokens" in err
    assert "set it to None" not in err


def test_plan_file_that_is_empty_or_a_folder_says_so(tmp_path, capsys):
    (tmp_path / "empty.txt").write_text("")
    assert main(["plan", "--file", str(tmp_path / "empty.txt")]) == 2
    assert f"lengths file {str(tmp_path / 'empty.txt')!r} holds no prompt lengths; give numbers" \
        in one_error_line(capsys)
    assert main(["plan", "--file", str(tmp_path)]) == 2
    assert f"lengths file {str(tmp_path)!r} is a folder; give a file of prompt lengths" in one_error_line(capsys)


def test_out_dir_that_is_a_file_fails_before_any_work(tmp_path, capsys):
    (tmp_path / "f").write_text("x")
    assert main(["notebooks", "--only", "02", "--out-dir", str(tmp_path / "f")]) == 2
    assert "is not a folder" in one_error_line(capsys)


def test_a_missing_extra_is_named_in_one_line(tmp_path):
    code = ("import sys; sys.modules['papermill'] = None\n"
            "from rollout_lab.cli.main import main\n"
            f"sys.exit(main(['notebooks', '--only', '02', '--out-dir', {str(tmp_path)!r}]))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 2
    assert done.stderr.strip() == "error: papermill is not installed: pip install 'rollout_lab[notebooks]'"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from rollout_lab.measure.models import tiny_model

    path = tmp_path_factory.mktemp("ckpt") / "tiny-qwen3-ckpt"
    tiny_model("qwen3").save_pretrained(path)
    return path


@pytest.mark.slow  # plan, calibrate and sweep a saved checkpoint
def test_commands_take_a_local_checkpoint(checkpoint, tmp_path, capsys):
    import json

    from rollout_lab.measure.presets import geometry_for

    assert main(["plan", "480", "16", "--model", str(checkpoint)]) == 0  # within the tiny context of 512
    assert capsys.readouterr().out.startswith(f"2 prompts, {checkpoint} float32 geometry")
    config = json.loads((checkpoint / "config.json").read_text())
    geometry = geometry_for(str(checkpoint))
    assert (geometry.num_layers, geometry.num_kv_heads) == (config["num_hidden_layers"], config["num_key_value_heads"])
    cal = tmp_path / "cal.json"
    assert main(["calibrate", "--model", str(checkpoint), "--dtype", "float32", "--device", "cpu", "--grid", "tiny",
                 "--no-progress", "--out", str(cal)]) == 0
    assert json.loads(cal.read_text())["metadata"]["model_name"] == checkpoint.name
    out = tmp_path / "sweep"
    assert main(["sweep", "--model", str(checkpoint), "--dtype", "float32", "--device", "cpu", "--workloads",
                 "long_tail", "--scale", "0.1", "--paths", "bucketed", "--repetitions", "1", "--max-new-tokens", "2",
                 "--no-progress", "--out", str(out)]) == 0


def test_a_bad_checkpoint_is_one_line(tmp_path, capsys, monkeypatch):
    for argv, message in ((["sweep", "--model", str(tmp_path / "missing")], "no model folder at"),
                          (["calibrate", "--model", str(tmp_path)], "has no config.json, so it is not a model folder")):
        assert main(argv) == 2
        assert message in one_error_line(capsys)
    assert main(["plan", "16", "--model", str(tmp_path)]) == 2
    assert "no config.json" in one_error_line(capsys)
    assert main(["notebooks", "--preset", "qwen2.5-3b", "--model", str(tmp_path), "--out-dir", str(tmp_path / "o")]) == 2
    assert "give --preset or --model, not both" in one_error_line(capsys)
    # notebooks --model gets the loader's checks too: a folder is not enough
    monkeypatch.setattr("rollout_lab.cli.main.run_notebooks", lambda *a, **k: pytest.fail("ran the notebooks"))
    assert main(["notebooks", "--model", str(tmp_path), "--out-dir", str(tmp_path / "o")]) == 2
    assert f"{str(tmp_path)!r} has no config.json, so it is not a model folder; expected a folder" in \
        one_error_line(capsys)


# ---------------------------------------------------------------- cost files checked, errors before work

def tiny_cpu_cost_file(path: Path) -> Path:
    """A cost file with the provenance of the tiny qwen2 on CPU in fp32 (as `calibrate --tiny qwen2` writes)."""
    from rollout_lab.measure.calibrate import run_metadata
    from rollout_lab.measure.models import tiny_model

    return CostCoefficients(prefill_fixed_cost_ms=0.5).to_json(
        path, metadata=run_metadata(tiny_model("qwen2"), model_name="tiny-qwen2"))


def test_plan_refuses_costs_measured_for_another_model_unless_overridden(tmp_path, capsys):
    cost_file = tiny_cpu_cost_file(tmp_path / "tiny.json")
    argv = ["plan", "16", "512", "--costs", str(cost_file), "--preset", "qwen3-32b", "--dtype", "bfloat16",
            "--device", "cuda"]
    assert main(argv) == 2
    err = one_error_line(capsys)
    for name in ("model_name", "geometry", "dtype", "device_type"):
        assert f"{name}: file has" in err, name
    assert "--override-costs" in err
    assert main([*argv, "--override-costs"]) == 0
    assert "provenance not checked: --override-costs" in capsys.readouterr().out


def test_sweep_refuses_a_calibration_of_captured_prefill_forwards_before_the_model(tmp_path, capsys, no_model):
    cost_file = tiny_cpu_cost_file(tmp_path / "tiny.json")
    data = json.loads(cost_file.read_text())
    data["metadata"]["grid"] = {"prefill_graphs": True}  # calibrate --prefill-graphs: replays, not eager forwards
    cost_file.write_text(json.dumps(data))
    assert main(["sweep", "--device", "cpu", "--costs", str(cost_file), "--out", str(tmp_path / "s")]) == 2
    err = one_error_line(capsys)
    assert "prefill_graphs: file has True, this setting has False" in err and "--override-costs" in err
    assert not list(tmp_path.glob("s*"))


@pytest.fixture
def no_model(monkeypatch):
    """Any attempt to build or load a model fails the test: the errors must come first."""
    for where in ("main", "bench"):  # calibrate and sweep build it in cli.main, every bench in cli.bench
        monkeypatch.setattr(f"rollout_lab.cli.{where}.build_model",
                            lambda *a, **k: pytest.fail("built a model before the checks"))


@pytest.mark.parametrize("argv, message", [
    (["plan", "16", "--costs", "/nonexistent.json"], "cost file '/nonexistent.json' does not exist"),
    (["plan", "16", "--costs", "{null}"], "'coefficients' must be an object, got None"),
    (["plan", "16", "--costs", "{meta5}"], "'metadata' must be an object, got 5"),
    (["plan", "16", "--costs", "{latin1}"], "is not UTF-8 text"),
    (["plan", "16", "--device", "tpu"], "bad --device 'tpu'"),
    (["sweep", "--device", "cpu", "--max-new-tokens", "600"], "+ max_new_tokens 600 exceeds the model's context of 512"),
    (["sweep", "--device", "cpu", "--scale", "100"], "at --scale 100: prompt length"),
    (["sweep", "--device", "cpu", "--scale", "-1"], "scale must be a finite number > 0"),
    (["sweep", "--device", "cpu", "--oracle-max-tokens", "-5"], "argument --oracle-max-tokens: must be >= 0, got -5"),
    (["sweep", "--device", "cpu", "--costs", "{null}"], "'coefficients' must be an object"),
    (["sweep", "--device", "cpu", "--out", "{file}/sub/x"], "is a file, not a folder"),
    (["sweep", "--device", "cpu", "--workloads", "nope"], "unknown workloads"),
    (["calibrate", "--device", "cpu", "--out", "{file}/sub/x.json"], "is not writable"),
    (["calibrate", "--device", "cpu", "--out", "."], "is a folder; give the cost file's path"),
    (["calibrate", "--device", "cpu", "--max-batch-tokens", "8"], "the grid leaves 1 shapes within max_batch_tokens=8"),
    (["notebooks", "--preset", "qwen9", "--out-dir", "ws"], "unknown --preset 'qwen9'"),
    (["notebooks", "--device", "tpu", "--out-dir", "ws"], "bad --device 'tpu'"),
    (["notebooks", "--only", "02", "--out-dir", "{file}/sub"], "is not writable"),
    pytest.param(["notebooks", "--only", "03", "--param", "03:results_file=missing.json"], "results_file=",
                 marks=pytest.mark.slow),  # papermill: seconds to import
    (["reproduce", "--out-dir", "{file}/sub"], "is not writable"),
    (["sweep", "--threads", "0"], "argument --threads: must be >= 1"),
    (["bench", "nope"], "argument bench: invalid choice: 'nope'"),
    (["bench", "rl", "--tiny", "qwen2"], "the following arguments are required: --out"),
    (["bench", "rl", "--tiny", "qwen2", "--min-len", "9", "--max-len", "3", "--out", "x"], "max_len 3 is below min_len 9"),
    (["bench", "rl", "--tiny", "qwen2", "--reps", "0", "--out", "x"], "argument --reps: must be >= 1, got 0"),
    (["bench", "grpo", "--tiny", "qwen2", "--top-p", "0", "--out", "x"], "top_p must be in (0, 1], got 0.0"),
    (["bench", "decode-step", "--tiny", "qwen2", "--cases", "4x30", "--out", "x"],
     "every case's span must exceed steps 32, got 4x30"),
    (["bench", "decode-step", "--tiny", "qwen2", "--cases", "4by30", "--out", "x"], "a case is SLOTSxSPAN"),
    (["bench", "prefill-routes", "--tiny", "qwen2", "--prefill-graphs", "--out", "x"],
     "--prefill-graphs captures CUDA graphs"),
    (["bench", "logits", "--tiny", "qwen3", "--min-len", "30", "--max-len", "20", "--out", "x"],
     "max_len 20 is below min_len 30"),
    (["bench", "logits", "--tiny", "qwen3", "--cache", "disk", "--out", "x"], "argument --cache: invalid choice: 'disk'"),
    (["bench", "long-tail", "--tiny", "qwen2", "--hazard", "0.9", "--out", "x"], "in (0, 0.5], got 0.9"),
])
def test_every_bad_input_is_one_line_and_status_2_before_any_work(argv, message, tmp_path, capsys, no_model,
                                                                   monkeypatch):
    files = {"{file}": tmp_path / "a_file", "{null}": tmp_path / "null.json", "{meta5}": tmp_path / "meta5.json",
             "{latin1}": tmp_path / "latin1.json"}
    files["{file}"].write_text("x")
    files["{null}"].write_text(json.dumps({"coefficients": None, "metadata": {}}))
    files["{meta5}"].write_text(json.dumps({"coefficients": CostCoefficients().to_dict(), "metadata": 5}))
    files["{latin1}"].write_bytes('{"metadata": {"model_name": "caf\u00e9"}}'.encode("latin-1"))
    monkeypatch.chdir(tmp_path)
    for key, path in files.items():
        argv = [a.replace(key, str(path)) for a in argv]
    assert main(argv) == 2
    assert message in one_error_line(capsys)


BENCHES = ("rl", "grpo", "decode-step", "prefill-routes", "logits", "long-tail", "trainer-loop", "defaults",
           "prefix-sharing")


def test_bench_lists_the_benchmarks_without_importing_torch():
    code = ("import sys\nfrom rollout_lab.cli.main import main\n"
            "assert main(['bench', '--help']) == 0\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert done.returncode == 0, done.stderr
    for name in BENCHES:
        assert re.search(rf"^ +{name} +\S", done.stdout, re.M), name


@pytest.mark.parametrize("name", BENCHES)
def test_each_bench_has_its_options_and_the_shared_ones(name, capsys):
    assert main(["bench", name, "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: rollout-lab bench {name} ")
    for option in ("--out", "--preset", "--tiny", "--dtype", "--device", "--debug"):
        assert option in out, option


@pytest.mark.parametrize("argv", [
    ["sweep", "--tiny", "qwen2", "--device", "cpu", "--out="], ["calibrate", "--tiny", "qwen2", "--out="],
    ["notebooks", "--out-dir="], ["reproduce", "--out-dir", " "], ["sweep", "--tiny", "qwen2", "--out-dir="],
    ["bench", "rl", "--tiny", "qwen2", "--out="], ["bench", "long-tail", "--tiny", "qwen2", "--out", ""],
])
def test_an_empty_out_is_refused_not_taken_for_the_default(argv, tmp_path, monkeypatch, capsys, no_model):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    option = "--out-dir" if any(a.startswith("--out-dir") for a in argv) else "--out"
    err = one_error_line(capsys)
    assert f"argument {option}: '" in err and "' is empty; give " in err
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="out_dir '' is empty; give a folder, or None"):
        Workspace.resolve("")


@pytest.mark.parametrize("argv", [["plan", "16", "--costs", ""], ["sweep", "--device", "cpu", "--costs", " "],
                                  ["bench", "grpo", "--tiny", "qwen2", "--out", "r", "--costs", ""],
                                  ["bench", "prefill-routes", "--tiny", "qwen2", "--out", "r", "--costs="]])
def test_an_empty_costs_is_refused_by_the_shared_input_path_type(argv, tmp_path, monkeypatch, capsys, no_model):
    """--costs of every command is options.cost_file_path, the input-path type beside out_path."""
    from rollout_lab.cli import options

    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = one_error_line(capsys)
    assert "argument --costs: '" in err and "is empty; give a cost file's path, or leave --costs out" in err
    assert options.cost_file_path("costs.json") == "costs.json"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command, folder", [
    (["sweep", "--device", "cpu", "--workloads", "long_tail"], "rec.json"),
    (["sweep", "--device", "cpu", "--workloads", "long_tail"], "rec.csv"),
    (["sweep", "--device", "cpu", "--workloads", "long_tail"], "rec.lock"),
    (["calibrate", "--device", "cpu"], "rec.lock"),
])
def test_an_output_file_that_is_a_folder_is_refused_before_any_work(command, folder, tmp_path, capsys, no_model,
                                                                     monkeypatch):
    """rec.json a folder was found only when the finished sweep wrote its record."""
    (tmp_path / folder).mkdir()
    out = tmp_path / ("rec" if command[0] == "sweep" else "rec.json")
    assert main([command[0], "--tiny", "qwen2", *command[1:], "--out", str(out)]) == 2
    assert f"output {str(tmp_path / folder)!r} is a folder; give a file's path" in one_error_line(capsys)


def test_a_bench_output_where_a_folder_cannot_be_is_refused_at_parsing(tmp_path, capsys, no_model):
    (tmp_path / "a_file").write_text("x")
    assert main(["bench", "rl", "--tiny", "qwen2", "--out", str(tmp_path / "a_file" / "sub" / "rec")]) == 2
    assert f"{str(tmp_path / 'a_file')!r} is a file, not a folder" in one_error_line(capsys)
    assert not (tmp_path / "a_file" / "sub").exists()


def test_reproduce_checks_its_gpu_table_before_any_work(tmp_path, capsys, monkeypatch):
    from rollout_lab.cli.main import HEADLINE_TABLE

    monkeypatch.setattr("rollout_lab.measure.sweep.route_table", lambda *a, **k: pytest.fail("ran the routes"))
    (tmp_path / "data" / "tables" / HEADLINE_TABLE).mkdir(parents=True)
    assert main(["reproduce", "--out-dir", str(tmp_path)]) == 2
    assert f"reproduce's GPU table {str(tmp_path / 'data' / 'tables' / HEADLINE_TABLE)!r} is a folder" \
        in one_error_line(capsys)


def _tiny_costs(path: Path, *, prefill_graphs: bool | None = None, **changed) -> str:
    """A cost file whose provenance is the tiny qwen2's in fp32 on the CPU (``changed``: its fields changed)."""
    from rollout_lab.engine.model_info import model_metadata
    from rollout_lab.measure.models import load_model

    model, name = load_model("tiny-qwen2", dtype="float32", device="cpu")
    metadata = model_metadata(model, model_name=name, prefill_graphs=prefill_graphs)
    CostCoefficients().to_json(path, metadata={**metadata, **changed})
    return str(path)


@pytest.mark.parametrize("bench", ["grpo", "prefill-routes"])
def test_a_bench_checks_its_costs_before_the_model(bench, tmp_path, capsys, no_model):
    costs = _tiny_costs(tmp_path / "bf16.json", dtype="bfloat16")
    assert main(["bench", bench, "--tiny", "qwen2", "--costs", costs, "--out", str(tmp_path / "rec")]) == 2
    err = one_error_line(capsys)
    assert f"cost file {costs!r} was calibrated for a different setting" in err
    assert "--override-costs beside a command's --costs" in err  # the benches that read --costs have it
    with pytest.raises(pytest.fail.Exception, match="built a model before the checks"):  # accepted: on to the model
        main(["bench", bench, "--tiny", "qwen2", "--costs", costs, "--override-costs", "--out", str(tmp_path / "rec")])
    assert main(["bench", bench, "--tiny", "qwen2", "--override-costs", "--out", str(tmp_path / "rec")]) == 2
    assert "--override-costs accepts a --costs file of another setting, and no --costs is given" \
        in one_error_line(capsys)


@pytest.mark.parametrize("override", [False, True])
def test_a_bench_runs_on_costs_that_match(override, tmp_path):
    """Or on costs of another setting, with --override-costs. (prefill-routes: grpo --tiny sets the
    process's torch threads, so test_grpo runs it in a process of its own)"""
    changed = {"dtype": "bfloat16"} if override else {}
    costs = _tiny_costs(tmp_path / "costs.json", prefill_graphs=False, **changed)
    assert main(["bench", "prefill-routes", "--tiny", "qwen2", "--costs", costs, "--batch-sizes", "2",
                 "--repetitions", "1", "--routes", "bucketed", "--out", str(tmp_path / "rec"),
                 *(["--override-costs"] if override else [])]) == 0
    assert json.loads((tmp_path / "rec.json").read_text())["config"]["costs"] == costs


def test_the_preflight_on_an_unwritable_output_is_fast(tmp_path, capsys, no_model):
    (tmp_path / "a_file").write_text("x")
    start = time.perf_counter()
    assert main(["sweep", "--device", "cpu", "--workloads", "long_tail", "--out", str(tmp_path / "a_file" / "o" / "x")]) == 2
    assert time.perf_counter() - start < 5.0
    assert "sweep's output" in one_error_line(capsys)


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root writes through chmod 0o500")
def test_the_preflight_on_a_read_only_folder(tmp_path, capsys, no_model):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        start = time.perf_counter()
        assert main(["calibrate", "--device", "cpu", "--out", str(locked / "x.json")]) == 2
        assert time.perf_counter() - start < 5.0
        assert "is not writable" in one_error_line(capsys)
    finally:
        locked.chmod(0o700)


@pytest.mark.slow  # two subprocess runs of the CLI
def test_one_line_from_a_subprocess_and_the_traceback_with_debug(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    command = [sys.executable, "-m", "rollout_lab.cli", "plan", "16", "--costs", str(tmp_path / "none.json")]
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == f"error: cost file {str(tmp_path / 'none.json')!r} does not exist (or is not a file)\n"
    done = subprocess.run([*command, "--debug"], capture_output=True, text=True, env=env)
    assert done.returncode == 1 and "Traceback (most recent call last)" in done.stderr
    assert done.stderr.rstrip().endswith("does not exist (or is not a file)")


@pytest.mark.slow  # two CLI sweeps
def test_sweep_uses_the_workspace_calibration_of_its_model_and_says_so(tmp_path, capsys):
    workspace = tmp_path / "ws"
    cost_file = tiny_cpu_cost_file(workspace / "data" / "calibration" / "tiny-qwen2_float32_cpu.json")
    out = tmp_path / "sweep"
    argv = ["sweep", "--tiny", "qwen2", "--device", "cpu", "--workloads", "short_tail", "--scale", "0.05",
            "--paths", "bucketed", "--repetitions", "1", "--max-new-tokens", "2", "--no-progress",
            "--out-dir", str(workspace), "--out", str(out)]
    assert main(argv) == 0
    assert f"costs: {cost_file} (this model's calibration in the workspace)" in capsys.readouterr().out
    assert json.loads(out.with_suffix(".json").read_text())["config"]["costs_source"] == str(cost_file)
    assert "compile" not in json.loads(out.with_suffix(".json").read_text())["config"]["engine"]
    assert main([*argv[:-2], "--no-compile", "--out", str(tmp_path / "eager")]) == 0
    assert json.loads((tmp_path / "eager.json").read_text())["config"]["engine"] == {"compile": False}
    capsys.readouterr()
    data = json.loads(cost_file.read_text())
    data["metadata"]["geometry"]["num_layers"] = 36  # the file no longer describes this model
    cost_file.write_text(json.dumps(data))
    assert main([*argv[:-2], "--out", str(tmp_path / "again")]) == 2
    assert "geometry: file has" in one_error_line(capsys)


def test_notebook_path_parameters_are_resolved_from_the_callers_folder(tmp_path, monkeypatch):
    from rollout_lab.notebooks import check_inputs, resolve_path_parameters

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "x.json").write_text("{}")
    (tmp_path / "ckpt").mkdir()
    params = {"results_file": "data/x.json", "rl_results_file": ["data/x.json", "data/y.json"],
              "results_stem": "out/s", "model": "ckpt", "geometry_preset": "qwen2.5-3b", "workloads": ["spread"],
              "cost_file": None}
    resolved = resolve_path_parameters(params, cwd=tmp_path)
    assert resolved["results_file"] == str(tmp_path / "data" / "x.json")
    assert resolved["rl_results_file"] == [str(tmp_path / "data" / "x.json"), str(tmp_path / "data" / "y.json")]
    assert resolved["results_stem"] == str(tmp_path / "out" / "s") and resolved["model"] == str(tmp_path / "ckpt")
    assert resolved["geometry_preset"] == "qwen2.5-3b" and resolved["workloads"] == ["spread"]
    assert resolved["cost_file"] is None
    with pytest.raises(ValueError, match=r"03: rl_results_file='.*y.json' does not exist"):
        check_inputs("03", resolved)
    check_inputs("03", {**resolved, "rl_results_file": None})


def test_hf_continuous_batching_warnings_are_silenced_in_our_commands(capsys):
    import logging

    logger = logging.getLogger("ContinuousBatchingLogger")
    logger.setLevel(logging.NOTSET)
    assert main(["plan", "16"]) == 0
    assert logger.getEffectiveLevel() == logging.ERROR


@pytest.mark.slow  # papermill: seconds to import
def test_notebooks_get_absolute_paths_and_an_ipc_kernel(tmp_path, monkeypatch):
    """What papermill is handed: the caller's relative paths made absolute, and a kernel on IPC
    sockets (ipykernel warns on every start that TCP is unencrypted)."""
    papermill = pytest.importorskip("papermill")
    from rollout_lab.notebooks import run_notebooks

    calls = []
    monkeypatch.setattr(papermill, "execute_notebook", lambda *a, **k: calls.append(k))
    monkeypatch.chdir(tmp_path)
    Path("costs.json").write_text("{}")
    run_notebooks(names=["02_bucket_choices"], out_dir="ws", extra={"02_bucket_choices": {"cost_file": "costs.json"}},
                  progress=False)
    (call,) = calls
    assert call["parameters"]["cost_file"] == str(tmp_path / "costs.json")
    assert call["parameters"]["output_dir"] == str(tmp_path / "ws")
    assert call["config"].KernelManager.transport == "ipc"


@pytest.mark.parametrize("argv, message", [
    (["--kernel", "nope"], "no Jupyter kernel named 'nope'; installed kernels: python3"),
    (["--param", "02:batch_size=abc"],
     "02_bucket_choices: parameter batch_size='abc' has type str; batch_size takes an int in [1, 65536]"),
    (["--param", "seeds=5"], "parameter seeds=5 is not a non-empty list; seeds takes a non-empty list of ints"),
    (["--param", "02:interactive=1"], "parameter interactive=1 has type int; interactive takes True or False"),
    (["--param", "9:batch_size=1"], "parameters given for unknown notebooks ['9']"),
])
@pytest.mark.slow  # papermill: seconds to import
def test_a_bad_kernel_or_parameter_is_one_line_before_any_notebook_runs(argv, message, tmp_path, monkeypatch, capsys):
    papermill = pytest.importorskip("papermill")
    monkeypatch.setattr(papermill, "execute_notebook", lambda *a, **k: pytest.fail("ran a notebook"))
    assert main(["notebooks", "--only", "02", "--out-dir", str(tmp_path), *argv]) == 2
    assert message in one_error_line(capsys)


def _parameters_cell(name: str) -> dict:
    """The defaults of a notebook's ``parameters`` cell (literals), read without papermill."""
    import ast

    from rollout_lab.notebooks import notebook_path

    cells = json.loads(notebook_path(name).read_text(encoding="utf-8"))["cells"]
    (cell,) = [c for c in cells if "parameters" in c.get("metadata", {}).get("tags", [])]
    tree = ast.parse("".join(cell["source"]))
    return {t.id: ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
            for t in node.targets}


def test_every_notebook_parameter_has_a_range_its_default_and_the_runs_fit():
    from rollout_lab.notebooks import (NOTEBOOK_PARAMETERS, NOTEBOOKS, SMOKE_PARAMETERS, check_parameter,
                                       notebook_parameters)

    for name in NOTEBOOKS:
        defaults = _parameters_cell(name)
        assert set(NOTEBOOK_PARAMETERS[name]) == set(defaults), name
        runs = [defaults, SMOKE_PARAMETERS[name], notebook_parameters(name, preset="qwen2.5-3b", output_dir="w")]
        gpu = notebook_parameters(name, device="cuda", preset="qwen2.5-3b", output_dir="w")
        runs.append({k: v for k, v in gpu.items() if k != "device"})  # this machine may have no GPU
        for params in runs:
            for parameter, value in params.items():
                if parameter in NOTEBOOK_PARAMETERS[name]:
                    check_parameter(name, parameter, value)


@pytest.mark.parametrize("param, message", [
    ("02:batch_size=-5", "02_bucket_choices: parameter batch_size=-5 is out of range; batch_size takes an int in "
                         "[1, 65536]"),
    ("02:batch_size=0", "parameter batch_size=0 is out of range; batch_size takes an int in [1, 65536]"),
    ("02:batch_size=1000000000", "parameter batch_size=1000000000 is out of range"),
    ("02:batch=3", "02_bucket_choices has no parameter 'batch' (given batch=3); its parameters: batch_size, cost_file,"),
    ("02:fixed_costs_ms=[1, -2]", "fixed_costs_ms=[1, -2] has item 1 -2, which is out of range; fixed_costs_ms "
                                  "takes a non-empty list of numbers in [0, 1e+06]"),
    ("02:route_budgets=[16, 0]", "route_budgets=[16, 0] has item 1 0, which is out of range; route_budgets takes a "
                                 "non-empty list of ints in [1, 1048576]"),
    ("02:distributions=[{'kind': 'lognormal'}]", "distributions=[{'kind': 'lognormal'}] is not valid (KeyError: "
                                                 "'median')"),
    ("02:geometry_preset='nope'", "geometry_preset='nope' is not valid (unknown preset 'nope'"),
    ("03:repetitions=10**9", "repetitions='10**9' has type str; repetitions takes an int in [1, 10000]"),
    ("03:workloads=['nope']", "workloads=['nope'] is not valid (unknown workloads ['nope']"),
    ("03:rl_shape={'rows': 3}", "rl_shape={'rows': 3} is not valid (rl_shape has unknown settings ['rows']; valid: "
                                "num_seqs"),
    ("03:threads=0", "threads=0 is out of range; threads takes an int in [1, "),
    ("04:online_workloads={'a': [0]}", "online_workloads={'a': [0]} is not valid (workload 'a' is not a non-empty "
                                       "list of ints in [1, 1048576])"),
    ("04:model='tiny-nope'", "model='tiny-nope' is not valid (unknown tiny model family 'nope'"),
])
def test_a_notebook_parameter_out_of_its_range_is_one_line_before_papermill(param, message, tmp_path, monkeypatch,
                                                                            capsys):
    monkeypatch.setitem(sys.modules, "papermill", None)  # imported after the checks, or this test fails
    assert main(["notebooks", "--out-dir", str(tmp_path), "--param", param]) == 2
    assert message in one_error_line(capsys)
    assert not (tmp_path / "build").exists()


def test_notebook_parameters_take_no_nan_bool_or_none_where_a_number_is():
    from rollout_lab.notebooks import check_parameter

    for value, problem in [([1.0, float("nan")], "has item 1 nan, which is out of range"),
                           (True, "has type bool"), (None, "is None")]:
        with pytest.raises(ValueError, match=re.escape(f"parameter max_num_buckets={value!r} {problem}")
                           if not isinstance(value, list) else re.escape(problem)):
            check_parameter("02_bucket_choices", "fixed_costs_ms" if isinstance(value, list) else "max_num_buckets",
                            value)


def test_a_notebook_parameters_type_is_checked_by_its_table_entry():
    """check_parameter_type reads NOTEBOOK_PARAMETERS, as check_parameter does (one set of rules):
    the type alone, so a value of the right type out of its range passes it."""
    from rollout_lab.notebooks import NOTEBOOK_PARAMETERS, check_parameter, check_parameter_type

    takes = NOTEBOOK_PARAMETERS["02_bucket_choices"]["max_num_buckets"].what
    for value in ("4", True, 4.0, None):
        with pytest.raises(ValueError, match=re.escape(f"02_bucket_choices: parameter max_num_buckets={value!r} "
                                                       f"{'is None' if value is None else 'has type'}")
                           + ".*" + re.escape(f"; max_num_buckets takes {takes}")):
            check_parameter_type("02_bucket_choices", "max_num_buckets", value)
    check_parameter_type("02_bucket_choices", "max_num_buckets", 10**9)  # the type is right
    with pytest.raises(ValueError, match="max_num_buckets=1000000000 is out of range"):
        check_parameter("02_bucket_choices", "max_num_buckets", 10**9)
    check_parameter_type("02_bucket_choices", "fixed_costs_ms", [1, 2.5])  # an int where a float is
    with pytest.raises(ValueError, match=re.escape("fixed_costs_ms=[1, 'a'] has item 1 'a', which has type str")):
        check_parameter_type("02_bucket_choices", "fixed_costs_ms", [1, "a"])
    with pytest.raises(ValueError, match="02_bucket_choices has no parameter 'nope'"):
        check_parameter_type("02_bucket_choices", "nope", 1)


@pytest.mark.parametrize("device", ["cuda", "cuda:7"])
def test_notebooks_on_a_gpu_this_machine_lacks_is_one_line_before_papermill(device, tmp_path, monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: device == "cuda:7")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setitem(sys.modules, "papermill", None)
    assert main(["notebooks", "--device", device, "--only", "01", "--out-dir", str(tmp_path)]) == 2
    err = one_error_line(capsys)
    assert f"01_calibrate: parameter device={device!r} is not valid (" in err
    assert ("CUDA is not available here; use device cpu" if device == "cuda"
            else "this machine has 1 CUDA device(s): cuda:0 to cuda:0") in err
    assert main(["notebooks", "--device", device, "--only", "02", "--out-dir", str(tmp_path)]) == 2  # 02: no device
    assert "papermill is not installed" in one_error_line(capsys)


@pytest.mark.slow  # papermill: seconds to import
def test_a_value_error_in_a_notebook_is_one_line_naming_the_cell(tmp_path, monkeypatch, capsys):
    papermill = pytest.importorskip("papermill")
    from papermill.exceptions import PapermillExecutionError

    def fail(*args, **kwargs):
        raise PapermillExecutionError(cell_index=4, exec_count=3, source="x", ename="ValueError",
                                      evalue="need n >= 1", traceback=["43 lines"])

    monkeypatch.setattr(papermill, "execute_notebook", fail)
    assert main(["notebooks", "--only", "02", "--out-dir", str(tmp_path)]) == 2
    assert "02_bucket_choices stopped in cell 3: ValueError: need n >= 1 (the executed copy " in one_error_line(capsys)


def test_a_reader_that_goes_away_is_not_an_error(tmp_path):
    """`rollout-lab plan ... | head`: the closed pipe ends the command quietly with status 0."""
    root = Path(__file__).resolve().parents[1]
    done = subprocess.Popen([sys.executable, "-m", "rollout_lab.cli", "plan", "--dataset", "gsm8k", "--num-prompts", "64"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path,
                            env={**os.environ, "PYTHONPATH": str(root)})
    done.stdout.close()  # before the command writes anything
    err = done.stderr.read()
    assert done.wait() == 0 and err == b""


def test_reproduce_renders_the_committed_gpu_records_without_a_gpu(tmp_path, monkeypatch, capsys):
    from rollout_lab.cli.main import HEADLINE_ROLES, _committed_gpu_table
    from rollout_lab.measure.evidence import records_with_role
    from rollout_lab.measure.records import load_results
    from rollout_lab.workspace import Workspace

    COMMITTED_GPU_SWEEPS = [p for role in HEADLINE_ROLES  # the index names them
                            for p in records_with_role(REPO / "data" / "results", role)]
    assert [p.name for p in COMMITTED_GPU_SWEEPS] == ["sweep_qwen2.5-3b_bfloat16_cuda_notebook-03.json",
                                                      "sweep_qwen2.5-3b_bfloat16_cuda_hf_static_notebook-03.json"]
    monkeypatch.chdir(REPO)
    _committed_gpu_table(Workspace.resolve(tmp_path))
    with (tmp_path / "data/tables/h200_e2e_qwen2_5_3b_bfloat16_cuda.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    ours = load_results(COMMITTED_GPU_SWEEPS[0])
    assert [r["workload"] for r in rows] == list(ours["workloads"])
    assert all(float(r["hf_static_ms"]) > 0 and r["auto_route"] in ("bucketed", "packed", "nocb") for r in rows)
    out = capsys.readouterr().out
    assert "NVIDIA H200" in out
    for name in load_results(COMMITTED_GPU_SWEEPS[1])["workloads"]:
        assert (name in ours["workloads"]) or (name in out.split("not in every record")[1])  # said, not dropped silently
    monkeypatch.chdir(tmp_path)  # an installed package, away from a checkout: said, not an error
    _committed_gpu_table(Workspace.resolve(tmp_path / "elsewhere"))
    assert "not in this folder" in capsys.readouterr().out


def test_measuring_commands_time_on_one_cpu_thread_unless_told(monkeypatch):
    """issue 36: CPU timings on 2 busy threads were noise; calibrate, sweep and bench default to 1."""
    import torch

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert main(["sweep", "--tiny", "qwen2", "--device", "cpu", "--workloads", "no_such_workload"]) == 2
        assert torch.get_num_threads() == 1
        torch.set_num_threads(2)
        assert main(["sweep", "--tiny", "qwen2", "--device", "cpu", "--threads", "2",
                     "--workloads", "no_such_workload"]) == 2
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
