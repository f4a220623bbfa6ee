"""measure.sweep and the sweep command: the record, its summaries and files, skipped peers, errors before any work."""
from __future__ import annotations

import csv
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import get_tiny, one_fast

from rollout_lab.cli.main import main as cli_main
from rollout_lab.engine.api.config import MANUAL_ROUTES, MODES
from rollout_lab.measure.models import tiny_model
from rollout_lab.measure.paths import PATHS
from rollout_lab.measure.records import (
    PEER_PATHS,
    load_results,
    results_table,
    summary_table,
    workload_summary,
    write_results,
)
from rollout_lab.measure.sweep import run_sweep
from rollout_lab.measure.workloads import get_workload
from rollout_lab.workspace import check_record_pair, record_csv_text

WORKLOADS = {
    "long_tail": get_workload("long_tail", scale=0.05),  # 1x26 + 31x1
    "spread": get_workload("spread", scale=0.02)[:8],  # 8 prompts, 1..3 tokens
}


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    out = tmp_path_factory.mktemp("sweep") / "tiny"
    record = run_sweep(tiny_model("qwen2"), workloads=WORKLOADS, repetitions=1, max_new_tokens=3,
                             model_name="tiny-qwen2", progress=False, out=out)
    return record, out


@pytest.mark.slow
def test_sweep_writes_json_and_csv(sweep):
    record, out = sweep
    assert load_results(out) == json.loads(json.dumps(record))
    assert load_results(out.with_suffix(".json"))["kind"] == "sweep"
    with out.with_name("tiny.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == len(WORKLOADS) * len(PATHS)
    assert {"workload", "path", "mean_ms", "tokens_per_s", "route", "matches_nocb", "prefill_ms"} <= set(rows[0])
    prov = record["provenance"]
    assert prov["model_name"] == "tiny-qwen2" and prov["git_sha"] and prov["dtype"] == "float32"


@pytest.mark.slow
def test_sweep_record_per_path(sweep):
    record, _ = sweep
    for name, w in record["workloads"].items():
        assert w["lengths"] == WORKLOADS[name]
        for path in MODES:
            r = w["paths"][path]
            assert len(r["samples_ms"]) == 1 and r["mean_ms"] > 0 and r["tokens_per_s"] > 0
            assert r["matches_nocb"] is True and r["matches_oracle"] is True, (name, path)
            assert r["profile"]["num_generated_tokens"] == 3 * len(WORKLOADS[name])
            assert r["buckets"] and sum(b for b, _ in r["buckets"]) <= len(WORKLOADS[name])  # shared prefill dedups
            assert r["peak_mem_bytes"] is None  # CPU
            assert r["first_call_ms"] > 0  # the warm-up call, timed apart from the samples
        assert w["paths"]["auto"]["route"] in ("nocb", "bucketed")
        assert all(rows == 1 for rows, _ in w["paths"]["aligned"]["buckets"])  # one forward per prompt
        for peer in PEER_PATHS:
            r = w["paths"][peer]
            assert r["skipped"] is not None or r["matches_nocb"] is True, (name, peer, r)
        s = w["summary"]
        assert s["best_manual_path"] in MANUAL_ROUTES
        assert s["auto_over_best_manual"] > 0 and s["regression"] >= 0
    worst = record["summary"]["worst_regression"]
    assert worst["workload"] in WORKLOADS
    rows = results_table(record)
    assert len(rows) == len(WORKLOADS) * len(PATHS)
    assert summary_table(record)[0]["auto_vs_best"] == record["workloads"]["long_tail"]["summary"]["auto_over_best_manual"]


@pytest.mark.slow  # a sweep of our routes and the peers
def test_failing_peer_is_skipped_with_reason(monkeypatch):

    def broken(*args, **kwargs):
        raise RuntimeError("no paged cache today")

    monkeypatch.setattr("rollout_lab.measure.paths.hf_generate_batch", broken)
    record = run_sweep(tiny_model("qwen2"), workloads={"two": [3, 1]}, paths=["nocb", "auto", "hf_generate_batch"],
                             repetitions=1, max_new_tokens=2, progress=False)
    r = record["workloads"]["two"]["paths"]["hf_generate_batch"]
    assert r["skipped"] == "RuntimeError: no paged cache today" and r["mean_ms"] is None
    assert record["workloads"]["two"]["summary"]["best_peer_path"] is None


def test_bad_workload_or_path_errors_before_work(tmp_path):
    with pytest.raises(ValueError, match="unknown workloads.*nope"):
        run_sweep(None, workloads=["long_tail", "nope"])  # never touches the model
    with pytest.raises(ValueError, match="unknown paths"):
        run_sweep(None, workloads=["long_tail"], paths=["nocb", "vllm"])
    with pytest.raises(ValueError, match="positive ints"):
        run_sweep(None, workloads={"bad": [3, 0]})
    with pytest.raises(ValueError, match="workloads names 'long_tail' more than once; give each workload once"):
        run_sweep(None, workloads=["long_tail", "spread", "long_tail"])  # keyed by name, it would run once
    with pytest.raises(ValueError, match="decode='graph' needs a CUDA device"):  # before the lock and any call
        run_sweep(get_tiny("qwen2"), workloads={"a": [3]}, decode="graph", out=tmp_path / "g")
    assert not list(tmp_path.iterdir())


@pytest.mark.slow
def test_atomic_write_leaves_no_partial_file(sweep, tmp_path):
    record, _ = sweep
    stem = tmp_path / "res"
    write_results(record, stem)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    broken = dict(record, provenance={**record["provenance"], "oops": object()})  # unserialisable
    with pytest.raises(TypeError):
        write_results(broken, stem)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # no temp files, no truncation
    fresh = tmp_path / "fresh"
    with pytest.raises(TypeError):
        write_results(broken, fresh)
    assert not any(p.name.startswith("fresh") or p.name.startswith(".fresh") for p in tmp_path.iterdir())


def test_load_results_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_results(tmp_path / "missing")
    (tmp_path / "x.json").write_text('{"kind": "other"}')
    with pytest.raises(ValueError, match="not a sweep record"):
        load_results(tmp_path / "x.json")


@pytest.mark.parametrize("argv, message", [
    (["--workloads", "long_tail", "nope"], "unknown workloads"),
    (["--paths", "nocb", "vllm"], "unknown paths"),
    (["--costs", "/nonexistent/costs.json"], "does not exist"),
    (["--device", "tpu"], "--device"),
    (["--prefill-graphs", "--device", "cpu"], "--prefill-graphs captures CUDA graphs"),
    (["--decode", "graph", "--device", "cpu"], "decode='graph' needs a CUDA device, the model is on cpu"),
])
def test_cli_errors_before_any_work(argv, message, monkeypatch, capsys):
    monkeypatch.setattr("rollout_lab.cli.main.build_model", lambda *a, **k: pytest.fail("built a model despite bad arguments"))
    assert cli_main(["sweep", "--tiny", "qwen2", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and err.count("\n") == 1 and message in err


def test_cli_tiny_sweep(tmp_path, capsys):
    out = tmp_path / "cli"
    assert cli_main(["sweep", "--tiny", "qwen2", "--workloads", "short_tail", "--scale", "0.1",
                     "--paths", "nocb", "bucketed", "auto", "--repetitions", "1", "--max-new-tokens", "2",
                     "--no-progress", "--out", str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    record = load_results(out)
    assert record["config"]["paths"] == ["nocb", "bucketed", "auto"]
    assert record["workloads"]["short_tail"]["lengths"] == get_workload("short_tail", scale=0.1)


def test_cli_sweep_at_shape_classes(tmp_path):
    out = tmp_path / "classes"
    assert cli_main(["sweep", "--tiny", "qwen2", "--workloads", "long_tail", "--scale", "0.1",
                     "--paths", "bucketed", "packed", "--repetitions", "1", "--max-new-tokens", "2",
                     "--prefill-classes", "--no-progress", "--out", str(out)]) == 0
    record = load_results(out)
    engine = record["config"]["engine"]
    longest = max(get_workload("long_tail", scale=0.1))
    assert engine["prefill_graphs"] is False and engine["prefill_classes"]["widths"][-1] == longest
    with pytest.raises(ValueError, match="engine settings"):
        run_sweep(None, workloads=["long_tail"], engine={"prefill_clases": None})


# ---------------------------------------------------------------- spread, resume, one writer per output

SMALL = dict(paths=["nocb", "bucketed", "auto"], max_new_tokens=2, model_name="tiny-qwen2", progress=False)


def test_median_iqr_and_ratios_are_recomputed_from_the_samples(tmp_path):
    record = run_sweep(tiny_model("qwen2"), workloads={"a": [5, 1, 1]}, repetitions=4, out=tmp_path / "s", **SMALL)
    for name, r in record["workloads"]["a"]["paths"].items():
        samples = sorted(r["samples_ms"])
        assert len(samples) == 4
        assert r["median_ms"] == pytest.approx((samples[1] + samples[2]) / 2)
        q1, _, q3 = statistics.quantiles(samples, n=4, method="inclusive")
        assert (r["q1_ms"], r["q3_ms"], r["iqr_ms"]) == pytest.approx((q1, q3, q3 - q1)), name
    paths = record["workloads"]["a"]["paths"]
    s = record["workloads"]["a"]["summary"]
    best = min(("nocb", "bucketed"), key=lambda p: paths[p]["median_ms"])
    assert s["best_manual_path"] == best
    assert s["auto_over_best_manual"] == pytest.approx(paths["auto"]["median_ms"] / paths[best]["median_ms"])
    disjoint = paths["auto"]["q3_ms"] < paths[best]["q1_ms"] or paths[best]["q3_ms"] < paths["auto"]["q1_ms"]
    assert s["auto_vs_best_manual_beyond_spread"] is disjoint and s["beyond_spread"][best] is disjoint
    assert check_record_pair(tmp_path / "s.json") == record["run_id"]
    with (tmp_path / "s.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert {r["run_id"] for r in rows} == {record["run_id"]} and {"median_ms", "iqr_ms"} <= set(rows[0])


def test_auto_best_is_on_medians_and_overlapping_spreads_are_said_to_be_noise():
    def entry(samples):
        from rollout_lab.measure.spread import sample_spread
        return {"samples_ms": samples, **sample_spread(samples), "route": "bucketed"}

    # auto's mean is the worst (one slow outlier) but its median is the best
    results = {"auto": entry([10.0, 10.2, 10.1, 10.3, 90.0]), "nocb": entry([20.0, 20.5, 21.0, 20.2, 20.1]),
               "bucketed": entry([10.2, 10.4, 10.1, 10.6, 10.3])}
    s = workload_summary(results)
    assert s["best_manual_path"] == "bucketed" and s["auto_over_best_manual"] == pytest.approx(10.2 / 10.3)
    assert s["beyond_spread"] == {"nocb": True, "bucketed": False}  # bucketed vs auto: within the noise
    assert s["auto_vs_best_manual_beyond_spread"] is False


def test_resume_skips_the_workloads_done_and_refuses_other_settings(tmp_path, monkeypatch):
    from rollout_lab.measure import sweep as sweep_module

    model, out = tiny_model("qwen2"), tmp_path / "r"
    first = run_sweep(model, workloads={"a": [3, 1]}, repetitions=1, out=out, **SMALL)
    ran = []
    real = sweep_module._sweep_workload
    monkeypatch.setattr(sweep_module, "_sweep_workload",
                        lambda model, prompts, *a, **k: ran.append(len(prompts)) or real(model, prompts, *a, **k))
    record = run_sweep(model, workloads={"a": [3, 1], "b": [2, 2, 2]}, repetitions=1, out=out, resume=True, **SMALL)
    assert ran == [3]  # only b ran
    assert record["workloads"]["a"] == json.loads(json.dumps(first["workloads"]["a"]))
    assert load_results(out)["workloads"].keys() == {"a", "b"} and record["resumed"]["workloads"] == ["a"]
    with pytest.raises(ValueError, match="cannot resume.*config.repetitions: saved 1, now 2"):
        run_sweep(model, workloads={"c": [1]}, repetitions=2, out=out, resume=True, **SMALL)
    with pytest.raises(ValueError, match="workload 'a': saved lengths differ"):
        run_sweep(model, workloads={"a": [4, 1]}, repetitions=1, out=out, resume=True, **SMALL)
    assert ran == [3] and load_results(out)["workloads"].keys() == {"a", "b"}  # refused before any work


class Killed(BaseException):
    """The process dying at a write point: nothing after it runs (not an Exception: no handler takes it)."""


# every write point of the record pair of a two-workload sweep: each of its four files (the CSV, then
# the JSON, after each workload) before its write, with its temporary file written, and once renamed
WRITE_POINTS = [(call, phase) for call in range(4) for phase in ("before", "temporary", "renamed")]


@pytest.fixture(scope="module")
def dead_pid():
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(done.stdout)


def kill_at(monkeypatch, call: int, phase: str, dead_pid: int) -> list[str]:
    """Make the ``call``-th file write of the record pair die at ``phase``, leaving what a SIGKILL
    there leaves (a dead writer's temporary file; its lock file naming it); the suffixes written."""
    from rollout_lab import workspace

    real, written = workspace.write_text_atomic, []

    def dying(path, text):
        path = Path(path)
        written.append(path.suffix)
        if len(written) - 1 != call:
            return real(path, text)
        if phase == "temporary":
            (path.parent / f".{path.name}.{dead_pid}.k1ll3d.tmp").write_text(text[: len(text) // 2])
        if phase == "renamed":
            real(path, text)
        (path.parent / f"{path.stem}.lock").write_text(json.dumps({"pid": dead_pid, "started": "then"}))
        raise Killed

    monkeypatch.setattr(workspace, "write_text_atomic", dying)
    return written


@pytest.mark.parametrize("call, phase", one_fast(WRITE_POINTS, (2, "temporary")))
def test_a_sweep_killed_at_any_write_point_resumes_without_losing_or_redoing_a_workload(
        call, phase, tmp_path, monkeypatch, dead_pid):
    """The JSON is the commit point: a kill anywhere in a write keeps every workload the JSON holds,
    and ``resume`` runs exactly the others, rebuilding a CSV the kill left stale (the resume used
    to refuse a record whose CSV was a write ahead of its JSON, and a rerun overwrote it)."""
    from rollout_lab.measure import sweep as sweep_module

    model, out, workloads = get_tiny("qwen2"), tmp_path / "k", {"a": [3, 1], "b": [2, 2, 2]}
    with monkeypatch.context() as patch:
        written = kill_at(patch, call, phase, dead_pid)
        with pytest.raises(Killed):
            run_sweep(model, workloads=workloads, repetitions=1, out=out, **SMALL)
    assert written == [".csv", ".json", ".csv", ".json"][: call + 1]  # the CSV first, the JSON last
    json_path = out.with_suffix(".json")
    committed = json.loads(json_path.read_text())["workloads"] if json_path.exists() else {}
    assert list(committed) == ["a", "b"][: (call + (phase == "renamed")) // 2]
    ran = []
    real = sweep_module._sweep_workload
    monkeypatch.setattr(sweep_module, "_sweep_workload",
                        lambda model, prompts, *a, **k: ran.append(len(prompts)) or real(model, prompts, *a, **k))
    record = run_sweep(model, workloads=workloads, repetitions=1, out=out, resume=True, **SMALL)
    assert ran == [len(v) for k, v in workloads.items() if k not in committed]  # none lost, none redone
    assert all(record["workloads"][k] == v for k, v in committed.items())
    saved = load_results(out)  # checks the pair
    assert list(saved["workloads"]) == ["a", "b"] and saved["run_id"] == record["run_id"]
    assert out.with_suffix(".csv").read_text() == record_csv_text(record["run_id"], results_table(saved))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["k.csv", "k.json"]  # no temporary file, no lock


def test_resume_rebuilds_a_stale_or_cut_csv_before_anything_else(tmp_path, monkeypatch, capsys):
    """A CSV that is not the JSON's (stale, cut short, missing) is rebuilt from the JSON when the
    sweep resumes, even with nothing left to run."""
    from rollout_lab.measure import sweep as sweep_module

    model, out = get_tiny("qwen2"), tmp_path / "c"
    first = run_sweep(model, workloads={"a": [3, 1]}, repetitions=1, out=out, **SMALL)
    monkeypatch.setattr(sweep_module, "_sweep_workload", lambda *a, **k: pytest.fail("ran a workload again"))
    csv_path = out.with_suffix(".csv")
    for damage in (lambda text, run_id: csv_path.write_text(text[: len(text) // 2]),  # cut short
                   lambda text, run_id: csv_path.unlink(),
                   lambda text, run_id: csv_path.write_text(text.replace(run_id, "0" * 16))):  # another write's
        damage(csv_path.read_text(), load_results(out)["run_id"])
        assert "rebuilt" not in capsys.readouterr().err
        record = run_sweep(model, workloads={"a": [3, 1]}, repetitions=1, out=out, resume=True, **SMALL)
        assert "rebuilt " + str(csv_path) in capsys.readouterr().err
        assert record["workloads"]["a"] == json.loads(json.dumps(first["workloads"]["a"]))
        load_results(out)  # the pair agrees again


@pytest.mark.slow  # three CLI sweeps
def test_cli_resume_recovers_a_kill_and_checks_its_settings_before_the_model(tmp_path, monkeypatch, capsys, dead_pid):
    """``rollout-lab sweep --resume`` after a kill between the CSV and the JSON of its second write
    (it used to exit 2): the first workload is kept, the second run; a resume with other settings,
    and --decode graph on a CPU, are one error line before the model is built."""
    from rollout_lab.measure import sweep as sweep_module

    out = tmp_path / "cli"
    argv = ["sweep", "--tiny", "qwen2", "--device", "cpu", "--workloads", "short_tail", "spread", "--scale", "0.05",
            "--paths", "nocb", "auto", "--repetitions", "1", "--max-new-tokens", "2", "--no-progress",
            "--out", str(out), "--out-dir", str(tmp_path)]
    with monkeypatch.context() as patch:
        kill_at(patch, 2, "renamed", dead_pid)  # the second CSV written, its JSON not
        with pytest.raises(Killed):
            cli_main(argv)
    assert list(json.loads(out.with_suffix(".json").read_text())["workloads"]) == ["short_tail"]
    with monkeypatch.context() as patch:
        patch.setattr("rollout_lab.cli.main.build_model", lambda *a, **k: pytest.fail("built a model before the checks"))
        for more, message in ((["--repetitions", "2"], "config.repetitions: saved 1, now 2"),
                              (["--max-new-tokens", "3"], "config.max_new_tokens: saved 2, now 3"),
                              (["--tiny", "llama"], "provenance.model_name: saved 'tiny-qwen2', now 'tiny-llama'"),
                              (["--decode", "graph"], "decode='graph' needs a CUDA device")):
            capsys.readouterr()
            assert cli_main([*argv, "--resume", *more]) == 2
            err = capsys.readouterr().err
            assert err.startswith("error:") and err.count("\n") == 1 and message in err, err
    ran = []
    real = sweep_module._sweep_workload
    monkeypatch.setattr(sweep_module, "_sweep_workload",
                        lambda model, prompts, *a, **k: ran.append(len(prompts)) or real(model, prompts, *a, **k))
    capsys.readouterr()
    assert cli_main([*argv, "--resume"]) == 0
    captured = capsys.readouterr()
    assert "keeps short_tail" in captured.out and "rebuilt" in captured.err
    assert ran == [len(get_workload("spread", scale=0.05))]
    assert list(load_results(out)["workloads"]) == ["short_tail", "spread"]


GATED_SWEEP = """
import pathlib, sys, time
from rollout_lab.measure import sweep
from rollout_lab.measure.models import tiny_model

out, held, go = sys.argv[1:4]
real = sweep._sweep


def gated(*args, **kwargs):  # the lock is held here: say so, and wait for the test's go
    pathlib.Path(held).touch()
    while not pathlib.Path(go).exists():
        time.sleep(0.02)
    return real(*args, **kwargs)


sweep._sweep = gated
sweep.run_sweep(tiny_model("qwen2"), workloads={"first": [3, 1]}, paths=["nocb", "auto"], repetitions=1,
                max_new_tokens=2, progress=False, out=out)
"""


@pytest.mark.slow
def test_two_sweeps_to_one_output_lose_nothing(tmp_path, monkeypatch, capsys):
    """A second sweep to an output another process is writing is refused, naming the holder; once
    the first is done, the second resumes into the same record and both results are there."""
    out, held, go = tmp_path / "shared", tmp_path / "held", tmp_path / "go"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                                       os.environ.get("PYTHONPATH", "")]))
    first = subprocess.Popen([sys.executable, "-c", GATED_SWEEP, str(out), str(held), str(go)], env=env,
                             stderr=subprocess.PIPE, text=True)
    try:
        while not held.exists():
            assert first.poll() is None, first.stderr.read()[-2000:]
            time.sleep(0.05)
        with pytest.raises(ValueError, match=f"being written by pid {first.pid} .*shared.lock"):
            run_sweep(tiny_model("qwen2"), workloads={"second": [2, 2]}, paths=["nocb"], repetitions=1,
                      max_new_tokens=2, progress=False, out=out)
        with monkeypatch.context() as patch:  # the command refuses before it builds a model
            patch.setattr("rollout_lab.cli.main.build_model", lambda *a, **k: pytest.fail("built a model"))
            assert cli_main(["sweep", "--tiny", "qwen2", "--workloads", "short_tail", "--scale", "0.05", "--paths",
                             "nocb", "--repetitions", "1", "--max-new-tokens", "2", "--no-progress",
                             "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error:") and f"being written by pid {first.pid}" in err and "shared.lock" in err
    finally:
        go.touch()
        assert first.wait(timeout=300) == 0, first.stderr.read()[-2000:]
    assert not out.with_suffix(".lock").exists()
    record = run_sweep(tiny_model("qwen2"), workloads={"first": [3, 1], "second": [2, 2]}, paths=["nocb", "auto"],
                       repetitions=1, max_new_tokens=2, progress=False, out=out, resume=True)
    assert record["resumed"]["workloads"] == ["first"]
    assert load_results(out)["workloads"].keys() == {"first", "second"}


@pytest.mark.slow  # a sweep of every route
def test_route_table_warms_every_route_up_before_timing_any(monkeypatch):
    from rollout_lab.measure import sweep as sweep_module

    calls = []
    real = sweep_module.Rollout

    class Counted(real):
        def generate(self, *args, **kwargs):
            calls.append(self.config.mode)
            return super().generate(*args, **kwargs)

    monkeypatch.setattr(sweep_module, "Rollout", Counted)
    rows = sweep_module.route_table(max_new_tokens=2)
    assert [r["mode"] for r in rows] == list(MODES) and all(r["same_tokens"] for r in rows)
    rounds = sweep_module.ROUTE_TABLE_WARMUP_ROUNDS
    assert rounds >= 1 and calls == list(MODES) * (rounds + 1)  # warm-up rounds of every route, then the measured


def test_join_sweeps_puts_separate_processes_paths_in_one_record():
    from rollout_lab.measure.records import join_sweeps

    def record(paths, lengths=(3, 9), sha="a"):
        entry = {"num_requests": len(lengths), "lengths": list(lengths), "padding_share": 0.0,
                 "paths": {p: {"samples_ms": list(ms), "mean_ms": sum(ms) / len(ms), "route": p} for p, ms in paths.items()}}
        return {"kind": "sweep", "provenance": {"git_sha": sha, "date": "d"}, "config": {"paths": list(paths)},
                "workloads": {"w": entry}}

    ours = record({"bucketed": (10.0, 11.0, 12.0), "auto": (10.0, 10.5, 11.0)})
    peer = record({"hf_static": (40.0, 44.0, 48.0)}, sha="b")
    joined = join_sweeps([ours, peer], ["ours.json", "peer.json"])
    paths = joined["workloads"]["w"]["paths"]
    assert list(paths) == ["bucketed", "auto", "hf_static"] and paths["hf_static"]["median_ms"] == 44.0
    summary = joined["workloads"]["w"]["summary"]
    assert summary["auto_over_best_manual"] == pytest.approx(10.5 / 11.0)
    assert summary["auto_over_best_peer"] == pytest.approx(10.5 / 44.0) and summary["best_peer_path"] == "hf_static"
    assert [j["git_sha"] for j in joined["joined"]] == ["a", "b"] and joined["config"]["paths"][-1] == "hf_static"
    assert "summary" not in ours["workloads"]["w"] and "median_ms" not in ours["workloads"]["w"]["paths"]["auto"]
    with pytest.raises(ValueError, match="other prompt lengths"):
        join_sweeps([ours, record({"hf_static": (1.0,)}, lengths=(3, 8))], ["ours.json", "other.json"])
    with pytest.raises(ValueError, match="'auto' of 'w' is in again.json"):
        join_sweeps([ours, record({"auto": (1.0,)})], ["ours.json", "again.json"])
    assert joined["dropped_workloads"] == {}
    longer = record({"hf_static": (40.0,)}, sha="b")
    longer["workloads"]["v"] = longer["workloads"]["w"]  # a workload that the cut sweep lacks
    with pytest.warns(UserWarning, match=r"left out: \['v'\] of peer.json"):
        cut = join_sweeps([ours, longer], ["ours.json", "peer.json"])
    assert list(cut["workloads"]) == ["w"] and cut["dropped_workloads"] == {"peer.json": ["v"]}
    other = record({"hf_static": (40.0,)})
    other["workloads"] = {"v": other["workloads"]["w"]}
    with pytest.raises(ValueError, match="share no workload"):
        join_sweeps([ours, other], ["ours.json", "other.json"])


@pytest.mark.slow  # three sweeps, one a peer's
def test_sweep_or_load_runs_at_the_class_ladder_resumes_and_joins_a_peer_record(tmp_path, monkeypatch):
    """Notebook 03's sweep: our prefill at the workloads' class ladder, a second call resuming the
    record the first left, and a peer sweep from another process joined to the table."""
    from rollout_lab.measure import sweep as sweep_module
    from rollout_lab.measure.sweep import sweep_or_load

    common = dict(results_file=None, model="tiny-qwen2", dtype="float32", device="cpu", workload_scale=0.05,
                  repetitions=1, max_new_tokens=2, cost_file=None, override_costs=False, output_dir=tmp_path)
    peer_stem = tmp_path / "peer"
    sweep_or_load(workloads=["long_tail"], paths_=["packed"], results_stem=str(peer_stem), **common)
    ours = tmp_path / "ours"
    first, path = sweep_or_load(workloads=["long_tail"], paths_=["nocb", "bucketed", "auto"],
                                results_stem=str(ours), prefill_classes=True, **common)
    assert path == ours.with_suffix(".json")
    engine = first["config"]["engine"]
    assert engine["prefill_graphs"] is False
    assert engine["prefill_classes"]["widths"][-1] == max(get_workload("long_tail", scale=0.05))
    ran = []
    real = sweep_module._sweep_workload
    monkeypatch.setattr(sweep_module, "_sweep_workload",
                        lambda model, prompts, *a, **k: ran.append(len(prompts)) or real(model, prompts, *a, **k))
    again, _ = sweep_or_load(workloads=["long_tail"], paths_=["nocb", "bucketed", "auto"], results_stem=str(ours),
                             prefill_classes=True, resume=True, peer_results_file=str(peer_stem) + ".json", **common)
    assert ran == []  # the saved workload was kept, not rerun
    assert list(again["workloads"]["long_tail"]["paths"]) == ["nocb", "bucketed", "auto", "packed"]
    assert [j["file"] for j in again["joined"]] == [str(ours) + ".json", str(peer_stem) + ".json"]
    assert again["workloads"]["long_tail"]["summary"]["best_manual_path"] in ("nocb", "bucketed", "packed")
    loaded, _ = sweep_or_load(workloads=["long_tail"], paths_=None, results_stem=None,
                              **{**common, "results_file": str(ours) + ".json"},
                              peer_results_file=[str(peer_stem) + ".json"])
    assert loaded["workloads"] == again["workloads"]
    # errors before a model is built: a missing peer record, graphs on a CPU
    monkeypatch.setattr(sweep_module, "load_model", lambda *a, **k: pytest.fail("the model was built"))
    with pytest.raises(ValueError, match="missing.json"):
        sweep_or_load(workloads=["long_tail"], paths_=["nocb"], results_stem=str(tmp_path / "x"),
                      peer_results_file=str(tmp_path / "missing.json"), **common)
    with pytest.raises(ValueError, match="prefill_graphs=True captures CUDA graphs; device is 'cpu'"):
        sweep_or_load(workloads=["long_tail"], paths_=["nocb"], results_stem=str(tmp_path / "x"),
                      prefill_graphs=True, **common)
    with pytest.raises(ValueError, match="cannot resume.*config.max_new_tokens: saved 2, now 3"):  # resume too
        sweep_or_load(workloads=["long_tail"], paths_=["nocb", "bucketed", "auto"], results_stem=str(ours),
                      prefill_classes=True, resume=True, **{**common, "max_new_tokens": 3})


def test_more_sweep_measures_its_own_generation_length_and_refuses_bad_settings_before_the_model(tmp_path, monkeypatch):
    """Notebook 03's more_shape: its workloads at its max_new_tokens (and its paths), every other
    setting the run's, into a record named after the shape, HF's peer of that shape joined; a bad
    shape is an error naming the setting before any model is built."""
    from rollout_lab.measure import sweep as sweep_module
    from rollout_lab.measure.sweep import more_sweep_or_load, sweep_or_load

    run = dict(model="tiny-qwen2", dtype="float32", device="cpu", output_dir=tmp_path, workload_scale=0.05,
               paths_=["nocb", "bucketed", "auto"], repetitions=1, cost_file=None, override_costs=False,
               prefill_classes=True, oracle_max_tokens=0)
    sweep_or_load(results_file=None, workloads=["short_tail"], max_new_tokens=4, results_stem=str(tmp_path / "peer"),
                            **{**run, "paths_": ["packed"]})
    path, record = more_sweep_or_load({"workloads": ["short_tail"], "max_new_tokens": 4, "paths": ["bucketed", "auto"]},
                                      more_peer_results_file=str(tmp_path / "peer.json"), **run)
    assert Path(path) == tmp_path / "data" / "results" / "sweep_tiny-qwen2_float32_cpu_short_tailx4.json"
    saved = load_results(path)
    assert saved["config"]["max_new_tokens"] == 4 and saved["config"]["paths"] == ["bucketed", "auto"]
    assert saved["config"]["engine"]["prefill_classes"] and saved["config"]["oracle_max_tokens"] == 0  # the run's
    assert list(record["workloads"]["short_tail"]["paths"]) == ["bucketed", "auto", "packed"]  # the peer joined
    monkeypatch.setattr(sweep_module, "load_model", lambda *a, **k: pytest.fail("the model was built"))
    for shape, message in [
        ({"workloads": ["short_tail"]}, r"lacks \['max_new_tokens'\]"),
        ({"workloads": ["short_tail"], "max_new_tokens": 4, "temperature": 1.0}, r"unknown settings \['temperature'\]"),
        ({"workloads": "short_tail", "max_new_tokens": 4}, "must be a list of workload names"),
        ({"workloads": ["gpqa"], "max_new_tokens": 4}, "more_shape: unknown workloads \\['gpqa'\\]"),
        ({"workloads": ["short_tail"], "max_new_tokens": 0}, "more_shape: max_new_tokens must be an int >= 1, got 0"),
        (["short_tail"], "more_shape must be a dict"),
    ]:
        with pytest.raises(ValueError, match=message):
            more_sweep_or_load(shape, **run)


def test_whole_table_puts_every_record_against_its_hf_peers(tmp_path):
    """One row per workload of sweeps (joined with an own-process peer), RL and GRPO records: ours
    against each HF peer the record holds, the speedup over the fastest, and the record's name."""
    from rollout_lab.measure.records import load_sweeps, whole_table_rows

    def sweep(paths, sha):
        entry = {"num_requests": 4, "lengths": [3, 9, 2, 2], "padding_share": 0.0,
                 "paths": {p: {"samples_ms": [ms], "mean_ms": ms, "median_ms": ms} for p, ms in paths.items()}}
        return {"kind": "sweep", "provenance": {"git_sha": sha, "model_name": "m"},
                "config": {"paths": list(paths), "max_new_tokens": 8}, "workloads": {"w": entry}}

    ours, peer = tmp_path / "ours", tmp_path / "peer"
    write_results(sweep({"nocb": 300.0, "bucketed": 110.0, "auto": 100.0, "hf_generate_batch": 900.0}, "aaaaaaa1"), ours)
    write_results(sweep({"hf_static": 250.0}, "bbbbbbb2"), peer)
    rl = {"provenance": {"git_sha": "ccccccc3"}, "config": {"model": "rl-model"},
          "workload": {"num_requests": 256, "num_output_tokens": 10_000},
          "results": {"ours": {"mean_ms": 1000.0}, "hf_generate_batch": {"mean_ms": 30_000.0}}}
    grpo = {"provenance": {"git_sha": "ddddddd4"}, "config": {"model": "g", "max_new_tokens": 5},
            "workload": {"num_prompts": 2, "num_samples": 3, "num_rows": 6, "num_generated_tokens": 30},
            "results": {"shared": {"mean_ms": 50.0}, "unshared": {"mean_ms": 60.0}, "hf_generate": {"mean_ms": 200.0}}}
    sweeps = load_sweeps([[f"{ours}.json", f"{peer}.json"]])
    assert sweeps[0][0] == f"{ours}.json + {peer}.json"
    rows = whole_table_rows(sweeps, rl=[("rl.json", rl)], grpo=[("grpo.json", grpo)])
    first, second, third = rows
    assert first["workload"] == "w x 8" and first["ours_ms"] == 100.0 and first["output_tokens"] == 32
    assert (first["hf_generate_ms"], first["hf_static_ms"], first["hf_generate_batch_ms"]) == (300.0, 250.0, 900.0)
    assert first["best_hf"] == "hf_static" and first["speedup_over_best_hf"] == pytest.approx(2.5)
    assert first["ours_tokens_per_s"] == pytest.approx(320.0) and first["git_sha"] == "aaaaaaa"
    assert first["record"] == "ours.json + peer.json"  # file names, not the caller's folders
    assert second["hf_static_ms"] is None and second["speedup_over_best_hf"] == pytest.approx(30.0)
    assert second["ours_tokens_per_s"] == pytest.approx(10_000.0) and second["model"] == "rl-model"
    assert third["workload"] == "GRPO 2 x 3 x 5" and third["ours"] == "shared" and third["best_hf"] == "hf_generate"
    assert third["speedup_over_best_hf"] == pytest.approx(4.0) and third["record"] == "grpo.json"
    rl["results"].pop("hf_generate_batch")  # a record without a peer: its row says so, with no ratio
    assert whole_table_rows(rl=[("rl.json", rl)])[0]["speedup_over_best_hf"] is None
    assert load_sweeps(None) == [] and load_sweeps(f"{ours}.json")[0][1]["workloads"]["w"]["paths"].keys() == {
        "nocb", "bucketed", "auto", "hf_generate_batch"}


@pytest.mark.parametrize("edit, message", [
    (lambda r: r.update(workloads=[]), "its workloads is list [], not a dict of workload name -> its results"),
    (lambda r: r.pop("workloads"), "its workloads is NoneType None, not a dict"),
    (lambda r: r.update(config=[1]), "its config is list [1], not a dict of settings"),
    (lambda r: r["workloads"]["a"].pop("lengths"), "its workload 'a' lengths is NoneType None, not a list of prompt"),
    (lambda r: r["workloads"].update(a=[3, 1]), "its workload 'a' is list [3, 1], not a dict with lengths and paths"),
    (lambda r: r["workloads"]["a"].update(paths=["nocb"]), "its workload 'a' paths is list ['nocb'], not a dict"),
])
def test_resume_of_a_record_of_another_shape_says_what_is_wrong_before_any_work(edit, message, tmp_path, monkeypatch,
                                                                                capsys):
    """A record whose workloads are a list or missing ended a resume in AttributeError/KeyError."""
    argv = ["sweep", "--tiny", "qwen2", "--device", "cpu", "--workloads", "short_tail", "--scale", "0.05",
            "--paths", "nocb", "--repetitions", "1", "--max-new-tokens", "2", "--no-progress",
            "--out", str(tmp_path / "r"), "--out-dir", str(tmp_path)]
    json_path = tmp_path / "r.json"
    record = {"kind": "sweep", "config": {}, "provenance": {},
              "workloads": {"a": {"lengths": [3, 1], "paths": {"nocb": {}}}}}
    edit(record)
    json_path.write_text(json.dumps(record))
    monkeypatch.setattr("rollout_lab.cli.main.build_model", lambda *a, **k: pytest.fail("built a model"))
    assert cli_main([*argv, "--resume"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot resume {str(json_path)!r}: ") and err.count("\n") == 1 and message in err, err
    with pytest.raises(ValueError, match="not a sweep record as run_sweep writes one"):
        run_sweep(tiny_model("qwen2"), workloads={"a": [3, 1]}, repetitions=1, out=tmp_path / "r", resume=True, **SMALL)
    assert not (tmp_path / "r.csv").exists()


def test_each_workloads_rows_are_checked_against_the_memory_before_the_model(monkeypatch, tmp_path, capsys):
    """sweep's sizes meet engine.limits' checks, as the benches' do: the rows a path holds at once
    (every row on an aligned route and HF's static cache) in the device's memory, from the config."""
    from rollout_lab.engine import limits as limits_module
    from rollout_lab.engine.limits import ModelLimits
    from rollout_lab.measure import sweep as sweep_module
    from rollout_lab.measure.models import model_config

    monkeypatch.setattr(limits_module, "host_available_bytes", lambda: 2**20)
    monkeypatch.setattr("rollout_lab.cli.main.build_model", lambda *a, **k: pytest.fail("built the model first"))
    monkeypatch.setattr(sweep_module, "load_model", lambda *a, **k: pytest.fail("built the model first"))
    monkeypatch.setattr(sweep_module, "_sweep", lambda *a, **k: pytest.fail("swept first"))
    # tiny qwen2 in fp32 holds 512 bytes of KV a token; long_tail at scale 0.25 is 32 prompts up to 128 tokens
    assert cli_main(["sweep", "--tiny", "qwen2", "--device", "cpu", "--workloads", "long_tail", "--scale", "0.25",
                     "--out", str(tmp_path / "s")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: workload='long_tail': the KV cache of 32 rows x 144 positions would take 2.2 MiB; "
                          "this host has 1.0 MiB available: at most 14 rows; lower --scale or --max-new-tokens, give "
                          "--paths that hold fewer rows at once (paged, auto), or leave the workload out"), err
    limits = ModelLimits.of_config(model_config("tiny-qwen2")[0], dtype="float32", device="cpu")
    lengths = sweep_module.resolve_workloads(["long_tail"], scale=0.25)
    sweep_module.check_sweep_limits(limits, lengths, paths=("paged", "auto", "hf_generate_batch"), max_new_tokens=16)
    with pytest.raises(ValueError, match="workload='long_tail': the KV cache of 32 rows"):
        sweep_module.check_sweep_limits(limits, lengths, paths=("paged", "hf_static"), max_new_tokens=16)
    with pytest.raises(ValueError, match=r"max_new_tokens=500: workload 'long_tail'.s longest prompt \(128 tokens\) "
                                         r"and max_new_tokens would take 628 positions, past the model's context of 512: "
                                         r"at most max_new_tokens=384"):
        sweep_module.check_sweep_limits(limits, lengths, paths=("paged",), max_new_tokens=500)
    with pytest.raises(ValueError, match="workload='long_tail': the KV cache of 32 rows"):
        run_sweep(get_tiny("qwen2"), workloads=lengths, paths=["bucketed"], max_new_tokens=16)
    with pytest.raises(ValueError, match="workload='long_tail': the KV cache of 32 rows"):
        sweep_module.sweep_or_load(results_file=None, model="tiny-qwen2", dtype="float32", device="cpu",
                                   workloads=["long_tail"], workload_scale=0.25, paths_=None, repetitions=1,
                                   max_new_tokens=16, cost_file=None, override_costs=False, results_stem=None,
                                   output_dir=tmp_path)
