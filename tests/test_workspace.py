"""The workspace: where outputs go (argument, then $ROLLOUT_LAB_OUT, then ./rollout_lab_out), its
layout, the one CSV writer, record pairs and their run id, killed writers, and the output lock."""
from __future__ import annotations

import csv
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rollout_lab.workspace import (OUT_DIR_ENV, RUN_ID, Workspace, check_record_pair, csv_text, lock_path,
                                   output_lock, record_paths, write_csv, write_json_atomic, write_record)


def test_resolve_precedence(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(OUT_DIR_ENV, raising=False)
    assert Workspace.resolve().root == tmp_path / "rollout_lab_out"
    monkeypatch.setenv(OUT_DIR_ENV, str(tmp_path / "env"))
    assert Workspace.resolve().root == tmp_path / "env"
    assert Workspace.resolve("given").root == tmp_path / "given"  # relative to the current folder
    assert not (tmp_path / "given").exists()  # resolving creates nothing


def test_layout_mirrors_the_repository(tmp_path):
    ws = Workspace.resolve(tmp_path)
    assert ws.calibration == tmp_path / "data" / "calibration"
    assert ws.results == tmp_path / "data" / "results"
    assert ws.tables == tmp_path / "data" / "tables"
    assert ws.figures == tmp_path / "figures"
    assert ws.executed_notebooks == tmp_path / "build" / "notebooks"


def test_a_file_is_not_a_workspace(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match="is not a folder"):
        Workspace.resolve(tmp_path / "f")


def test_csv_text_columns_and_none():
    rows = [{"a": 1, "b": None}, {"b": 2.5, "c": "x"}]
    assert csv_text(rows) == "a,b,c\n1,,\n,2.5,x\n"
    assert csv_text(rows, columns=["c", "a", "b"]) == "c,a,b\n,1,\nx,,2.5\n"
    with pytest.raises(ValueError, match="extra keys|dict contains fields not in fieldnames"):
        csv_text(rows, columns=["a"])
    with pytest.raises(ValueError, match="no rows"):
        csv_text([])


def test_writes_are_atomic_and_leave_no_temporary_files(tmp_path):
    path = write_csv([{"a": 1}], tmp_path / "t" / "x.csv")
    assert path.read_text() == "a\n1\n"
    write_json_atomic(tmp_path / "t" / "x.json", {"v": (1, 2)})
    assert (tmp_path / "t" / "x.json").read_text() == '{\n  "v": [\n    1,\n    2\n  ]\n}\n'
    with pytest.raises(TypeError):
        write_json_atomic(tmp_path / "t" / "x.json", {"v": object()})
    assert (tmp_path / "t" / "x.json").read_text().startswith("{")  # the old file survives
    assert sorted(p.name for p in (tmp_path / "t").iterdir()) == ["x.csv", "x.json"]


def test_record_paths_refuse_to_overwrite_and_write_both(tmp_path):
    from rollout_lab.workspace import record_paths, write_record

    paths = record_paths(tmp_path / "bench.json")
    assert [p.name for p in paths] == ["bench.json", "bench.csv"]
    text = write_record(paths, {"kind": "x", "n": 1}, [{"a": 1, "b": None}])
    assert text == paths[1].read_text() and '"kind": "x"' in paths[0].read_text()
    with pytest.raises(ValueError, match="bench.json and .*bench.csv already exist"):
        record_paths(tmp_path / "bench")
    paths[1].unlink()
    with pytest.raises(ValueError, match="bench.json already exist"):
        record_paths(tmp_path / "bench.csv")


def test_a_record_pair_shares_a_run_id_and_a_mismatch_is_detected(tmp_path):
    paths = record_paths(tmp_path / "pair")
    record = {"kind": "x"}
    write_record(paths, record, [{"a": 1}, {"a": 2}])
    run_id = record[RUN_ID]
    assert check_record_pair(paths[0]) == run_id
    assert paths[1].read_text().splitlines() == [f"{RUN_ID},a", f"{run_id},1", f"{run_id},2"]
    assert [oct(p.stat().st_mode & 0o777) for p in paths] == ["0o644", "0o644"]  # not mkstemp's 0600
    stale = paths[1].read_text()
    write_record(paths, {"kind": "x"}, [{"a": 3}])  # a second write: a new run id
    assert check_record_pair(paths[0]) != run_id
    paths[1].write_text(stale)  # the CSV of the first write beside the JSON of the second
    with pytest.raises(ValueError, match=f"run_id {run_id}.* is not the CSV of .*pair.json"):
        check_record_pair(paths[0])
    paths[1].unlink()
    assert check_record_pair(paths[0]) is None  # the JSON alone is the record


WRITER = """
import sys
from rollout_lab.workspace import write_record
stem = sys.argv[1]
for i in range(10**9):
    rows = [{"i": i, "j": j, "pad": "x" * 40} for j in range(3000)]
    write_record((stem + ".json", stem + ".csv"), {"kind": "loop", "i": i, "pad": "y" * 200000}, rows)
"""


def test_a_killed_writer_leaves_no_temporary_file_and_no_undetected_mismatch(tmp_path):
    """A subprocess rewriting a record in a loop, SIGKILLed at random points: the JSON always parses,
    a pair whose run ids agree holds the same write, one that disagrees is reported, and the next
    write removes the dead writer's temporary files and leaves a matching pair."""
    stem = tmp_path / "rec"
    paths = (tmp_path / "rec.json", tmp_path / "rec.csv")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]))
    rng = random.Random(0)
    outcomes = set()
    for _ in range(6):
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(stem)], env=env)
        while not paths[0].exists():  # the first write is done
            assert proc.poll() is None, "the writer died on its own"
            time.sleep(0.01)
        time.sleep(rng.uniform(0.0, 0.3))  # then a random point of a later write
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        record = json.loads(paths[0].read_text())  # never a torn JSON
        try:
            check_record_pair(paths[0])
            with paths[1].open(newline="") as handle:
                assert {int(r["i"]) for r in csv.DictReader(handle)} == {record["i"]}, "same run id, other data"
            outcomes.add("pair")
        except ValueError as err:
            assert "a write was interrupted" in str(err)
            outcomes.add("detected")
        # the window a kill leaves a temporary file in is short: leave one for sure, as that kill would
        (tmp_path / f".rec.csv.{proc.pid}.abc123.tmp").write_text("run_id,i\n")
        live = tmp_path / f".rec.json.{os.getpid()}.def456.tmp"  # a live writer's: left alone
        live.write_text("{")
        write_record(paths, {"kind": "loop", "i": -1}, [{"i": -1}])
        assert live.exists()
        live.unlink()
        assert sorted(p.name for p in tmp_path.iterdir()) == ["rec.csv", "rec.json"], "temporary files left"
        assert check_record_pair(paths[0]) is not None
    assert outcomes, outcomes  # at least one kill observed


def test_output_lock_refuses_a_second_writer_and_takes_over_a_dead_ones(tmp_path, capsys):
    with output_lock(tmp_path / "res.json") as path:
        assert path == lock_path(tmp_path / "res") == tmp_path / "res.lock"
        holder = json.loads(path.read_text())
        assert holder["pid"] == os.getpid() and holder["started"]
        with pytest.raises(ValueError, match=f"being written by pid {os.getpid()} .*res.lock"):
            with output_lock(tmp_path / "res"):
                pass
    assert not path.exists()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    path.write_text(json.dumps({"pid": int(dead.stdout), "started": "earlier"}))
    with output_lock(tmp_path / "res"):
        assert json.loads(path.read_text())["pid"] == os.getpid()
    assert f"its holder (pid {int(dead.stdout)}, started earlier) is no longer running" in capsys.readouterr().err


@pytest.mark.parametrize("body, message", [
    (b'{"kind": "sweep", "x": NaN}', "not valid JSON: NaN is not a JSON number"),
    (b"\xff\xfe{}", "not UTF-8 text"),
    (b"[" * 100_000 + b"]" * 100_000, "not valid JSON"),
    (b'{"kind": "sweep"} trailing', "not valid JSON"),
    (b" " * 2048 + b"{}", "2050 bytes, over the 1024"),
])
def test_json_files_are_read_with_limits(tmp_path, body, message):
    from rollout_lab.workspace import read_json_file

    path = tmp_path / "r.json"
    path.write_bytes(body)
    with pytest.raises(ValueError, match=f"results file '.*r.json' (is )?{message}"):
        read_json_file(path, what="results file", max_bytes=1024 if b" " * 2048 in body else 10**7)
    with pytest.raises(ValueError, match="does not exist"):
        read_json_file(tmp_path / "none.json", what="results file", max_bytes=10)
    path.write_text('{"kind": "sweep", "n": [1, 2.5]}')
    assert read_json_file(path, what="results file", max_bytes=1024) == {"kind": "sweep", "n": [1, 2.5]}


def test_run_tag_names_model_dtype_and_device_type_for_every_record_kind(tmp_path):
    from rollout_lab.measure.calibrate import calibration_path
    from rollout_lab.workspace import run_tag

    assert run_tag("qwen2.5-3b", "bfloat16", "cuda:1") == "qwen2.5-3b_bfloat16_cuda"  # the card's index dropped
    assert run_tag("tiny-qwen2", "float32", "cpu") == "tiny-qwen2_float32_cpu"
    assert calibration_path("m", "bfloat16", "cuda:0", Workspace(tmp_path)).name == "m_bfloat16_cuda.json"
