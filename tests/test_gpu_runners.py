"""The scripts/gpu step runners on a tiny CPU model (TINY=1): a step writes its record, and PACK_TO
brings every record back as one archive per script, replaced after each step."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile

from conftest import ROOT


def _run(script: str, *steps: str, out, pack_to=None, deadline=None) -> subprocess.CompletedProcess:
    env = dict(os.environ, OUT=str(out), TINY="1", PY=sys.executable, PYTHONPATH=str(ROOT))
    env.pop("PACK_TO", None)
    env.pop("DEADLINE", None)
    if pack_to is not None:
        env["PACK_TO"] = str(pack_to)
    if deadline is not None:
        env["DEADLINE"] = str(deadline)
    return subprocess.run(["bash", str(ROOT / "scripts" / "gpu" / script), *steps], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


def test_decode_floor_steps_pack_their_records(tmp_path):
    out, back = tmp_path / "scratch", tmp_path / "back"
    back.mkdir()
    done = _run("decode_floor.sh", "small", "trace", out=out, pack_to=back)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.count("== rc 0") == 2, done.stdout[-2000:]
    assert sorted(p.name for p in back.iterdir()) == ["decode_floor.tgz"]  # the part file was renamed
    with tarfile.open(back / "decode_floor.tgz") as archive:
        names = {os.path.basename(n) for n in archive.getnames()}
        assert {"decode_step_05b_small.json", "decode_step_05b_small.csv", "log_decode_floor_1.txt",
                "trace_small_batch.txt"} <= names
        trace = archive.extractfile(next(m for m in archive.getmembers() if m.name.endswith("trace_small_batch.txt")))
        assert "per layer and step (2 layers" in trace.read().decode()  # trace_step.py's launch count
        member = next(m for m in archive.getmembers() if m.name.endswith("decode_step_05b_small.json"))
        record = json.load(archive.extractfile(member))
    assert {case: sorted(variants) for case, variants in record["cases"].items()} == {
        case: ["ours", "ours_no_compile"] for case in ("1x24", "4x24", "16x24")}
    assert all(v["step_ms_median"] > 0 for variants in record["cases"].values() for v in variants.values())


def test_without_pack_to_nothing_is_packed_and_an_unknown_step_is_refused(tmp_path):
    out = tmp_path / "scratch"
    done = _run("decode_floor.sh", "nonsense", out=out)
    assert done.returncode == 2
    assert "unknown step nonsense (small, step3b, trace, nano, tail)" in done.stdout
    assert not list(out.glob("*.tgz"))


def test_a_step_the_deadline_cannot_fit_is_skipped_and_said(tmp_path):
    out, back = tmp_path / "scratch", tmp_path / "back"
    back.mkdir()
    done = _run("decode_floor.sh", "small", out=out, pack_to=back, deadline=30)  # under the 60 s floor
    assert done.returncode == 0
    assert "== skipped, " in done.stderr and "DEADLINE=30" in done.stderr
    assert not (out / "decode_step_05b_small.json").exists()
    assert not list(back.iterdir())  # a skipped step packs nothing


def test_pack_to_must_be_a_folder_other_than_out(tmp_path):
    out = tmp_path / "scratch"
    done = _run("decode_floor.sh", "small", out=out, pack_to=out)
    assert done.returncode == 2
    assert f"PACK_TO and OUT are both {out}" in done.stdout
    done = _run("decode_floor.sh", "small", out=out, pack_to=tmp_path / "missing")
    assert done.returncode == 2
    assert "is not a folder" in done.stdout
    assert not (out / "decode_step_05b_small.json").exists()  # refused before any step


def test_the_documented_order_of_pack_to_and_out(tmp_path):
    """README's ``PACK_TO=$OUT OUT=/tmp/o``: PACK_TO takes the tool's OUT; the other order gives both
    the scratch folder, which is refused."""
    back, scratch = tmp_path / "back", tmp_path / "scratch"
    back.mkdir()
    script = ROOT / "scripts" / "gpu" / "decode_floor.sh"
    env = {k: v for k, v in os.environ.items() if k not in ("PACK_TO", "DEADLINE")}
    env.update(OUT=str(back), TINY="1", PY=sys.executable)

    def run(line: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", "-c", line], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)

    wrong = run(f'OUT={scratch} PACK_TO=$OUT bash {script} nonsense')
    assert wrong.returncode == 2 and "PACK_TO and OUT are both" in wrong.stdout
    right = run(f'PACK_TO=$OUT OUT={scratch} bash {script} nonsense')
    assert right.returncode == 2 and "unknown step nonsense" in right.stdout  # past the check
