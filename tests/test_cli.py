"""The command line: plan from a dataset or a file with a header, errors as one line, and a missing
optional dependency named with the extra that installs it."""
from __future__ import annotations

import subprocess
import sys

import pytest

from rollout_lab.cli import main


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
    CostCoefficients(packed_prompt_cost_ms=0.1).to_json(tmp_path / "c.json")
    assert main(["plan", "512", "16", "16", "16", "--costs", str(tmp_path / "c.json"), "--max-new-tokens", "1"]) == 0
    out = capsys.readouterr().out
    assert "route for 1 new tokens: packed" in out and "not calibrated" not in out


def test_plan_reads_a_csv_with_a_header_and_plain_numbers(tmp_path, capsys):
    (tmp_path / "h.csv").write_text("name,index,num_tokens\nx,0,512\nx,1,16\nx,2,16\n")
    (tmp_path / "n.txt").write_text("512, 16\n16 16")
    main(["plan", "--file", str(tmp_path / "h.csv")])
    assert capsys.readouterr().out.startswith("3 prompts")
    main(["plan", "--file", str(tmp_path / "n.txt"), "20"])
    assert capsys.readouterr().out.startswith("5 prompts")


@pytest.mark.parametrize("content, message", [
    ("a,b\n1,2\n", "needs a 'num_tokens' column"),
    ("num_tokens\n12\nmany\n", "'many' is not an integer"),
    ("12 x", "'x' is not an integer"),
])
def test_plan_file_errors_are_one_line(tmp_path, content, message):
    (tmp_path / "f.csv").write_text(content)
    with pytest.raises(SystemExit) as err:
        main(["plan", "--file", str(tmp_path / "f.csv")])
    assert message in str(err.value) and str(err.value).startswith("error:")


def test_plan_without_lengths_or_with_an_unknown_file(tmp_path):
    with pytest.raises(SystemExit, match="give prompt lengths"):
        main(["plan"])
    with pytest.raises(SystemExit, match="does not exist"):
        main(["plan", "--file", str(tmp_path / "missing.csv")])


def test_out_dir_that_is_a_file_fails_before_any_work(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(SystemExit, match="is not a folder"):
        main(["notebooks", "--only", "02", "--out-dir", str(tmp_path / "f")])


def test_a_missing_extra_is_named_in_one_line(tmp_path):
    code = ("import sys; sys.modules['papermill'] = None\n"
            "from rollout_lab.cli import main\n"
            f"main(['notebooks', '--only', '02', '--out-dir', {str(tmp_path)!r}])\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 1
    assert done.stderr.strip() == "error: papermill is not installed: pip install 'rollout_lab[notebooks]'"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from rollout_lab.measure.models import tiny_model

    path = tmp_path_factory.mktemp("ckpt") / "tiny-qwen3-ckpt"
    tiny_model("qwen3").save_pretrained(path)
    return path


def test_commands_take_a_local_checkpoint(checkpoint, tmp_path, capsys):
    import json

    from rollout_lab.measure.presets import geometry_for

    assert main(["plan", "512", "16", "--model", str(checkpoint)]) == 0
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


def test_a_bad_checkpoint_is_one_line(tmp_path):
    for argv in (["sweep", "--model", str(tmp_path / "missing")], ["calibrate", "--model", str(tmp_path)]):
        with pytest.raises(SystemExit, match="is not a checkpoint folder"):
            main(argv)
    with pytest.raises(SystemExit, match="no config.json"):
        main(["plan", "16", "--model", str(tmp_path)])
    with pytest.raises(SystemExit, match="give --preset or --model, not both"):
        main(["notebooks", "--preset", "qwen2.5-3b", "--model", str(tmp_path), "--out-dir", str(tmp_path / "o")])
