"""The workspace: where outputs go (argument, then $ROLLOUT_LAB_OUT, then ./rollout_lab_out), its
layout, and the one CSV writer."""
from __future__ import annotations

import pytest

from rollout_lab.workspace import OUT_DIR_ENV, Workspace, csv_text, write_csv, write_json_atomic


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
