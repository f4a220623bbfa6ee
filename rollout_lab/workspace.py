"""The workspace: the one folder every output goes to, and the way every file is written.

    ws = Workspace.resolve()              # --out-dir, else $ROLLOUT_LAB_OUT, else ./rollout_lab_out
    ws.calibration / "tiny-qwen2_float32_cpu.json"
    write_csv(rows, ws.tables / "02_summary.csv")

A workspace is laid out like this repository, so ``--out-dir .`` in a checkout writes the repo's own
``data/`` and ``figures/``:

    <root>/data/calibration/   cost files from ``rollout-lab calibrate`` and notebook 01
    <root>/data/results/       sweep records (JSON + CSV)
    <root>/data/tables/        the notebooks' tables
    <root>/figures/            the notebooks' figures (PNG + SVG)
    <root>/build/notebooks/    executed notebooks

Nothing is ever written into the installed package. Writes are atomic: a file is either the old one
or the complete new one. Standard library only, so every layer may use it.
"""
from __future__ import annotations

import csv
import io
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

OUT_DIR_ENV = "ROLLOUT_LAB_OUT"
DEFAULT_OUT_DIR = "rollout_lab_out"


@dataclass(frozen=True)
class Workspace:
    """An output folder; ``root`` is absolute."""

    root: Path

    @classmethod
    def resolve(cls, out_dir: str | os.PathLike | None = None) -> "Workspace":
        """``out_dir``, else ``$ROLLOUT_LAB_OUT``, else ``./rollout_lab_out`` (relative to the current folder)."""
        chosen = out_dir if out_dir is not None else os.environ.get(OUT_DIR_ENV) or DEFAULT_OUT_DIR
        root = Path(chosen).expanduser()
        if root.exists() and not root.is_dir():
            raise ValueError(f"out_dir {str(root)!r} exists and is not a folder")
        return cls(root.resolve())

    @property
    def calibration(self) -> Path:
        return self.root / "data" / "calibration"

    @property
    def results(self) -> Path:
        return self.root / "data" / "results"

    @property
    def tables(self) -> Path:
        return self.root / "data" / "tables"

    @property
    def figures(self) -> Path:
        return self.root / "figures"

    @property
    def executed_notebooks(self) -> Path:
        return self.root / "build" / "notebooks"


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` to ``path`` through a temporary file in the same folder and ``os.replace``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def write_json_atomic(path: str | os.PathLike, obj: Any) -> Path:
    """Serialise ``obj`` as indented JSON and write it atomically."""
    return write_text_atomic(path, json_text(obj))


def json_text(obj: Any) -> str:
    """``obj`` as indented JSON (numpy arrays, tuples and sets as lists)."""
    return json.dumps(obj, indent=2, sort_keys=False, default=_jsonable) + "\n"


def _jsonable(value: Any) -> Any:
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    raise TypeError(f"cannot serialise {type(value).__name__} to JSON")


def csv_text(rows: Sequence[Mapping[str, Any]], columns: Sequence[str] | None = None) -> str:
    """Rows of flat dicts as CSV text: ``columns``, or every key in first-seen order; None as ""."""
    if not rows:
        raise ValueError("no rows to write as CSV")
    fieldnames = list(columns) if columns is not None else list(dict.fromkeys(k for row in rows for k in row))
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=fieldnames, lineterminator="\n")
    writer.writeheader()
    writer.writerows({k: "" if v is None else v for k, v in row.items()} for row in rows)
    return buffer.getvalue()


def record_paths(out: str | os.PathLike) -> tuple[Path, Path]:
    """``(<out>.json, <out>.csv)`` for a benchmark script's ``--out`` stem (a .json or .csv suffix
    is dropped); an existing one is an error, so a record is never silently overwritten."""
    stem = Path(out)
    if stem.suffix in (".json", ".csv"):
        stem = stem.with_suffix("")
    paths = stem.with_name(stem.name + ".json"), stem.with_name(stem.name + ".csv")
    existing = [str(p) for p in paths if p.exists()]
    if existing:
        raise ValueError(f"{' and '.join(existing)} already exist; choose another --out")
    return paths


def write_record(paths: tuple[Path, Path], record: Any, rows: Sequence[Mapping[str, Any]]) -> str:
    """Write a record's JSON and its rows' CSV atomically, both texts made before either file is
    written; returns the CSV text."""
    json_body, csv_body = json_text(record), csv_text(rows)
    write_text_atomic(paths[0], json_body)
    write_text_atomic(paths[1], csv_body)
    return csv_body


def write_csv(rows: Sequence[Mapping[str, Any]], path: str | os.PathLike,
              columns: Sequence[str] | None = None) -> Path:
    """Write ``csv_text(rows, columns)`` to ``path`` atomically (the folder is created)."""
    if not rows:
        raise ValueError(f"no rows to write to {path}")
    return write_text_atomic(path, csv_text(rows, columns))
