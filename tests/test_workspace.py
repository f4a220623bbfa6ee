"""The workspace: where outputs go (argument, then $ROLLOUT_LAB_OUT, then ./rollout_lab_out), its
layout, the one CSV writer, record pairs and their run id, killed writers, and the output lock."""
from __future__ import annotations

import csv
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rollout_lab.workspace import (OUT_DIR_ENV, RUN_ID, Workspace, check_not_locked, check_record_pair, csv_text,
                                   lock_path, output_lock, record_paths, write_csv, write_json_atomic, write_record)


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


@pytest.mark.slow  # six writer subprocesses
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


@pytest.mark.slow  # two subprocesses
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
    # a holder killed while holding it: its lock goes with its process, its file names it until taken
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]))
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from rollout_lab.workspace import output_lock\n"
                               "with output_lock(sys.argv[1]):\n    print('held', flush=True); time.sleep(600)",
                               str(tmp_path / "res")], env=env, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline() == "held\n"
    with pytest.raises(ValueError, match=f"being written by pid {holder.pid} "):
        check_not_locked(tmp_path / "res")
    holder.kill()
    holder.wait()
    check_not_locked(tmp_path / "res")
    with output_lock(tmp_path / "res"):
        pass
    assert f"its holder (pid {holder.pid}," in capsys.readouterr().err and not path.exists()


RACER = """
import os, sys, time
from pathlib import Path
from rollout_lab.workspace import output_lock

folder, trials = Path(sys.argv[1]), int(sys.argv[2])
me = str(os.getpid())
for trial in range(trials):
    go = folder / f"go.{trial}"
    while not go.exists():  # every racer starts a trial at once, on a stale lock the test left
        time.sleep(0.0005)
    try:
        with output_lock(folder / "out"):
            try:  # the one holder, or two at a time: then this fails
                os.close(os.open(folder / "inside", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                print(f"trial {trial}: two holders", flush=True)
                sys.exit(3)
            (folder / f"held.{trial}.{me}").touch()
            time.sleep(0.002)
            os.unlink(folder / "inside")
    except ValueError as err:
        assert "is being written by" in str(err), err
    (folder / f"done.{trial}.{me}").touch()
"""


@pytest.mark.slow
def test_four_racing_writers_never_hold_one_lock_together_stale_locks_included(tmp_path):
    """4 processes start each of 200 trials at once on a lock file a dead writer left (the old
    O_EXCL lock with a pid check let two of them take it over in 29 of 100 trials): at no time do
    two hold it, some one holds it in every trial, and the last holder removes it."""
    num_racers, num_trials = 4, 200
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = json.dumps({"pid": int(dead.stdout), "started": "earlier"})
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]))
    racers = [subprocess.Popen([sys.executable, "-c", RACER, str(tmp_path), str(num_trials)], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) for _ in range(num_racers)]
    try:
        for trial in range(num_trials):
            (tmp_path / "out.lock").write_text(stale)  # what a killed writer leaves
            (tmp_path / f"go.{trial}").touch()
            while len(list(tmp_path.glob(f"done.{trial}.*"))) < num_racers:
                assert all(r.poll() in (None, 0) for r in racers), [r.stdout.read() for r in racers if r.poll()]
                time.sleep(0.001)
            assert list(tmp_path.glob(f"held.{trial}.*")), f"trial {trial}: nobody took the stale lock"
            assert not (tmp_path / "out.lock").exists() and not (tmp_path / "inside").exists()
        assert [r.wait(timeout=60) for r in racers] == [0] * num_racers
    finally:
        for racer in racers:
            if racer.poll() is None:
                racer.kill()


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


def test_output_lock_never_follows_a_symlink_at_its_lock_file(tmp_path):
    """A link at <out>.lock had its target overwritten (a dangling one: created outside the folder)."""
    target, missing = tmp_path / "elsewhere.txt", tmp_path / "outside" / "created.txt"
    target.write_text("precious\n")
    (tmp_path / "out").mkdir()
    for pointed in (target, missing):
        link = lock_path(tmp_path / "out" / "res")
        link.symlink_to(pointed)
        message = f"lock file {str(link)!r} is a symbolic link (to {str(pointed)!r}); a lock is never followed"
        with pytest.raises(ValueError, match=re.escape(message)):
            with output_lock(tmp_path / "out" / "res"):
                pytest.fail("took a lock through a symlink")
        with pytest.raises(ValueError, match=re.escape(message)):
            check_not_locked(tmp_path / "out" / "res")
        link.unlink()
    assert target.read_text() == "precious\n" and not missing.parent.exists()


def test_output_lock_takes_a_left_lock_file_without_truncating_it_first(tmp_path, capsys):
    left = lock_path(tmp_path / "res")
    left.write_text(json.dumps({"pid": 2**22 + 7, "started": "then"}))  # a pid no process has here
    with output_lock(tmp_path / "res"):
        assert json.loads(left.read_text())["pid"] == os.getpid()
    assert "its holder (pid 4194311, started then) is no longer running" in capsys.readouterr().err
