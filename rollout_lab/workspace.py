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
or the complete new one, mode 0644 under the usual umask; a temporary file is removed on error, and
ones a killed writer left (``.<name>.*.tmp``) are removed by the next write of that file.

A record is a JSON and the CSV derived from it, written as a pair (``write_record``): the CSV first,
then the JSON, whose rename is the commit point. Both carry one ``run_id`` (a JSON field and a CSV
column), so ``check_record_pair`` tells a reader whether they come from the same write, and
``restore_record_csv`` rebuilds a CSV that is not the JSON's (the JSON is the record). One writer
at a time per output: ``output_lock`` holds ``<out>.lock`` (the kernel's ``flock``, which a killed
holder's process releases; the file names the holder's pid and start time); a second writer is
refused. Standard library only (POSIX: ``fcntl``), so every layer may use it.
"""
from __future__ import annotations

import contextlib
import csv
import errno
import fcntl
import glob
import io
import json
import os
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

OUT_DIR_ENV = "ROLLOUT_LAB_OUT"
DEFAULT_OUT_DIR = "rollout_lab_out"


@dataclass(frozen=True)
class Workspace:
    """An output folder; ``root`` is absolute."""

    root: Path

    @classmethod
    def resolve(cls, out_dir: str | os.PathLike | None = None) -> "Workspace":
        """``out_dir``, else ``$ROLLOUT_LAB_OUT``, else ``./rollout_lab_out`` (relative to the current folder)."""
        if isinstance(out_dir, str) and not out_dir.strip():  # not "." by accident: None is the default
            raise ValueError(f"out_dir {out_dir!r} is empty; give a folder, or None for ${OUT_DIR_ENV}, "
                             f"else ./{DEFAULT_OUT_DIR}")
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


def check_writable(folder: str | os.PathLike, *, what: str = "output folder") -> Path:
    """Create ``folder`` and write and remove a probe file in it, so that an unwritable output fails
    before any work; ValueError naming ``what`` and the folder."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"{what} {str(folder)!r} exists and is not a folder")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-probe.", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        raise ValueError(f"{what} {str(folder)!r} is not writable: {err.strerror or err}") from None
    return folder


def check_output_file(path: str | os.PathLike, *, what: str = "output file") -> Path:
    """ValueError naming ``what`` and ``path`` when a file cannot be written there, found before any
    work: a folder (or anything but a regular file) in its place, a file where a folder on its way
    should be, or a nearest existing folder that is not writable (a probe file is written and
    removed there; no folder is created)."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{what} {str(path)!r} is a folder; give a file's path (or remove the folder)")
    if path.exists() and not path.is_file():
        raise ValueError(f"{what} {str(path)!r} exists and is not a regular file; give another path")
    folder = path.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        raise ValueError(f"{what} {str(path)!r} cannot be written: {str(folder)!r} is a file, not a folder")
    try:
        fd, probe = tempfile.mkstemp(prefix=".write-probe.", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        raise ValueError(f"{what} {str(path)!r} cannot be written: {str(folder)!r} is not writable: "
                         f"{err.strerror or err}") from None
    return path


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` through a temporary file in the same folder and ``os.replace``."""
    return write_bytes_atomic(path, text.encode("utf-8"))


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` to ``path`` through a temporary file in the same folder and ``os.replace``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(path)
    tmp = _write_temporary(path, data)
    try:
        os.replace(tmp, path)
    except BaseException:
        _unlink_quietly(tmp)
        raise
    return path


def _write_temporary(path: Path, data: bytes) -> str:
    """``data`` in a fsynced ``.<name>.*.tmp`` beside ``path``, mode 0666 less the umask (mkstemp's
    0600 would make results unreadable to the rest of a team); removed again on any error."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.{os.getpid()}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
    except BaseException:
        _unlink_quietly(tmp)
        raise
    return tmp


def _umask() -> int:
    mask = os.umask(0o022)  # reading the umask means setting it; put it straight back
    os.umask(mask)
    return mask


def remove_stale_temporaries(path: str | os.PathLike) -> list[Path]:
    """Remove the ``.<name>.<pid>.*.tmp`` files that killed writers of ``path`` left behind (their
    pid is no longer running); returns them. A live writer's temporary file is left alone."""
    path = Path(path)
    if not path.parent.is_dir():
        return []
    stale = []
    for tmp in path.parent.glob(f".{glob.escape(path.name)}.*.tmp"):
        pid = tmp.name[len(path.name) + 2:].split(".", 1)[0]  # not a pid: another file's, or not ours
        if pid.isdigit() and not _is_alive(int(pid)):
            _unlink_quietly(tmp)
            stale.append(tmp)
    return stale


def _unlink_quietly(path: str | os.PathLike) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def read_json_file(path: str | os.PathLike, *, what: str, max_bytes: int) -> Any:
    """The JSON value in ``path``, read with limits: at most ``max_bytes``, UTF-8, no NaN/Infinity,
    no nesting deep enough to exhaust the parser. Every failure is a ValueError naming ``what`` and
    the file; nothing but JSON is ever parsed (no pickle anywhere)."""
    path = Path(path)
    where = f"{what} {str(path)!r}"
    if not path.is_file():
        raise ValueError(f"{where} does not exist (or is not a file)")
    size = path.stat().st_size
    if size > max_bytes:
        raise ValueError(f"{where} is {size} bytes, over the {max_bytes} a {what} may hold")
    try:
        return json.loads(path.read_bytes().decode("utf-8"), parse_constant=_no_constant)
    except UnicodeDecodeError as err:
        raise ValueError(f"{where} is not UTF-8 text: {err}") from None
    except (ValueError, RecursionError) as err:  # JSONDecodeError, NaN/Infinity, nesting too deep
        raise ValueError(f"{where} is not valid JSON: {err}") from None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


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


def run_tag(model: Any, dtype: Any, device: Any) -> str:
    """``<model>_<dtype>_<device type>``, what every output's name says of its run:
    ``run_tag("qwen2.5-3b", "bfloat16", "cuda:0")`` is ``qwen2.5-3b_bfloat16_cuda`` (a device index
    is dropped: the name says what ran, not on which card)."""
    return f"{model}_{dtype}_{str(device).split(':')[0]}"


def record_stem(out: str | os.PathLike) -> Path:
    """A record's output stem: ``out`` with a .json or .csv suffix dropped."""
    stem = Path(out)
    return stem.with_suffix("") if stem.suffix in (".json", ".csv") else stem


def pair_paths(out: str | os.PathLike) -> tuple[Path, Path]:
    """``(<stem>.json, <stem>.csv)``: the two files of the record at ``out`` (``record_stem``)."""
    stem = record_stem(out)
    return stem.with_name(stem.name + ".json"), stem.with_name(stem.name + ".csv")


def record_paths(out: str | os.PathLike) -> tuple[Path, Path]:
    """``pair_paths(out)`` for a benchmark script's ``--out``; an existing one is an error, so a
    record is never silently overwritten."""
    paths = pair_paths(out)
    existing = [str(p) for p in paths if p.exists()]
    if existing:
        raise ValueError(f"{' and '.join(existing)} already exist; choose another --out")
    return paths


RUN_ID = "run_id"  # the JSON field and the CSV column that tie a record's two files together


def new_run_id() -> str:
    """A fresh id for one write of a record (random: two writers never share one)."""
    return uuid.uuid4().hex[:16]


def write_record(paths: tuple[Path, Path], record: Mapping[str, Any], rows: Sequence[Mapping[str, Any]]) -> str:
    """Write a record's JSON and its rows' CSV as a pair; returns the CSV text.

    Both texts are made first, with one fresh ``run_id`` (set in the record, which is updated in
    place, and as the CSV's first column); then the CSV is written, and the JSON last: its rename
    commits the pair. A kill between the two renames leaves a CSV that ``check_record_pair``
    reports as not the JSON's; ``restore_record_csv`` rebuilds it from the JSON, and the next
    write replaces both."""
    run_id = new_run_id()
    stamped = {RUN_ID: run_id, **{k: v for k, v in record.items() if k != RUN_ID}}
    json_body = json_text(stamped)
    csv_body = record_csv_text(run_id, rows)
    json_path, csv_path = (Path(p) for p in paths)
    write_text_atomic(csv_path, csv_body)
    write_text_atomic(json_path, json_body)
    if isinstance(record, dict):
        record.clear()
        record.update(stamped)
    return csv_body


def record_csv_text(run_id: str | None, rows: Sequence[Mapping[str, Any]]) -> str:
    """A record's CSV: its rows, with its ``run_id`` as the first column (none for a record written
    before run ids existed)."""
    return csv_text(rows if run_id is None else [{RUN_ID: run_id, **row} for row in rows])


def restore_record_csv(paths: tuple[Path, Path], record: Mapping[str, Any],
                       rows: Sequence[Mapping[str, Any]]) -> bool:
    """Make a record's CSV the one its JSON derives: ``rows`` (of ``record``, the JSON as read) with
    its ``run_id``. The JSON's rename commits a pair, so a CSV that differs from that text (missing,
    left by a write killed between the two renames, cut short, edited) is rewritten from the JSON;
    True when it was. Call it holding the output's lock (``output_lock``)."""
    csv_path = Path(paths[1])
    text = record_csv_text(record.get(RUN_ID), rows)
    try:
        if csv_path.read_text(encoding="utf-8") == text:
            return False
    except (FileNotFoundError, UnicodeDecodeError):
        pass
    write_text_atomic(csv_path, text)
    return True


def check_record_pair(json_path: str | os.PathLike, csv_path: str | os.PathLike | None = None,
                      *, record: Mapping[str, Any] | None = None) -> str | None:
    """The ``run_id`` a record's JSON and CSV share; ValueError naming both files when they differ.

    ``csv_path`` defaults to the JSON's with a .csv suffix; ``record`` is the parsed JSON when the
    caller has it. A record written before run ids existed (no ``run_id`` field) returns None, and so
    does a JSON without its CSV (the JSON is the record; the CSV is only derived from it)."""
    json_path = Path(json_path)
    csv_path = json_path.with_suffix(".csv") if csv_path is None else Path(csv_path)
    if record is None:
        record = json.loads(json_path.read_text(encoding="utf-8"))
    run_id = record.get(RUN_ID) if isinstance(record, Mapping) else None
    if run_id is None or not csv_path.is_file():
        return None
    with csv_path.open(newline="", encoding="utf-8") as handle:
        ids = {row.get(RUN_ID) for row in csv.DictReader(handle)}
    if ids != {run_id}:
        found = ", ".join(sorted(str(i) for i in ids)) or "no rows"
        raise ValueError(
            f"{str(csv_path)!r} (run_id {found}) is not the CSV of {str(json_path)!r} (run_id {run_id}): "
            "a write was interrupted between the two files; the JSON is the record (a sweep's --resume "
            "rebuilds its CSV from it)")
    return run_id


# -- one writer per output -------------------------------------------------------------------------

def lock_path(out: str | os.PathLike) -> Path:
    """``<out>.lock`` for an output stem (a .json or .csv suffix is dropped)."""
    stem = record_stem(out)
    return stem.with_name(stem.name + ".lock")


LOCK_GRACE_S = 0.2  # a lock found taken is tried again for this long: ``check_not_locked`` only probes it


@contextlib.contextmanager
def output_lock(out: str | os.PathLike) -> Iterator[Path]:
    """Hold ``<out>.lock`` while writing ``out``: exactly one process holds it at a time.

    The lock is the kernel's ``flock`` on the file, not the file's existence: a killed holder's lock
    is released with its process, so a stale lock file is simply taken (no pid check, no takeover
    race). The holder writes its pid and start time into the file and removes it on exit; another
    live holder is a ValueError naming it (after ``LOCK_GRACE_S``: a ``check_not_locked`` probe
    holds it for an instant). A lock file a dead holder left is reported on stderr when taken. The
    lock file is opened with ``O_NOFOLLOW`` and created without truncating one that is there: a
    symlink at ``<out>.lock`` is refused with a ValueError (its target is never written or created)."""
    path = lock_path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + LOCK_GRACE_S
    while True:
        fd = _try_lock(path)
        if fd is not None:
            break
        if time.monotonic() > deadline:
            raise ValueError(_held_message(out, path, _read_lock(path)))
        time.sleep(0.01)
    try:
        left = _read_fd(fd)
        if left.get("pid") is not None:
            print(f"taking over {path}: its holder (pid {left.get('pid')}, started {left.get('started')}) "
                  "is no longer running", file=sys.stderr)
        mine = json.dumps({"pid": os.getpid(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                           "argv": sys.argv[:8]})
        os.ftruncate(fd, 0)
        os.pwrite(fd, (mine + "\n").encode("utf-8"), 0)
        yield path
    finally:
        if _same_file(path, fd):  # removed while still held: the next writer makes a new one
            _unlink_quietly(path)
        os.close(fd)  # releases the lock


def check_not_locked(out: str | os.PathLike) -> None:
    """ValueError naming the live holder of ``<out>.lock``: a command refuses before any work, and
    ``output_lock`` checks again when its writing starts. It probes the lock (takes and releases it
    at once), so it never reports a dead holder."""
    path = lock_path(out)
    if not os.path.lexists(path):  # lexists: a dangling symlink is refused here too, before any work
        return
    try:
        fd = _open_lock(path, os.O_RDONLY)  # flock needs no write access: another user's lock is probed too
    except FileNotFoundError:  # its holder has just removed it
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise ValueError(_held_message(out, path, _read_fd(fd))) from None
    finally:
        os.close(fd)


def _try_lock(path: Path) -> int | None:
    """An open descriptor holding the ``flock`` of ``path`` (created if missing), or None when
    another holds it. A file its holder removed after we opened it is not the lock: opened again."""
    while True:
        fd = _open_lock(path, os.O_RDWR | os.O_CREAT)  # never O_TRUNC: the holder's name stays until we hold it
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        except BaseException:
            os.close(fd)
            raise
        if _same_file(path, fd):
            return fd
        os.close(fd)  # we locked a removed file: its holder had just released it


def _open_lock(path: Path, flags: int) -> int:
    """``os.open`` of a lock file that is never a symlink (``O_NOFOLLOW``): its holder truncates and
    writes it, so a link planted at ``<out>.lock`` would have another file overwritten, or a dangling
    one created outside the output's folder. A symlink is a ValueError naming it and its target."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW, 0o644)
    except OSError as err:
        if err.errno != errno.ELOOP:
            raise
        raise ValueError(f"lock file {str(path)!r} is a symbolic link (to {os.readlink(path)!r}); a lock is never "
                         "followed: remove the link, or choose another --out") from None


def _same_file(path: Path, fd: int) -> bool:
    try:
        here = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (here.st_dev, here.st_ino) == (held.st_dev, held.st_ino)


def _held_message(out: str | os.PathLike, path: Path, holder: Mapping[str, Any]) -> str:
    who = (f"pid {holder.get('pid')} (started {holder.get('started')}, lock {str(path)!r})" if holder.get("pid")
           else f"another process (lock {str(path)!r}, its holder not yet named)")
    return f"{str(out)!r} is being written by {who}; wait for it, or choose another --out"


def _read_fd(fd: int) -> dict[str, Any]:
    """The holder a lock file names ({} when empty or being written)."""
    try:
        holder = json.loads(os.pread(fd, 64 * 1024, 0).decode("utf-8"))
    except (ValueError, UnicodeDecodeError):
        return {}
    return holder if isinstance(holder, dict) else {}


def _read_lock(path: Path) -> dict[str, Any]:
    try:
        fd = _open_lock(path, os.O_RDONLY)
    except FileNotFoundError:
        return {}
    try:
        return _read_fd(fd)
    finally:
        os.close(fd)


def _is_alive(pid: Any) -> bool:
    if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def write_csv(rows: Sequence[Mapping[str, Any]], path: str | os.PathLike,
              columns: Sequence[str] | None = None) -> Path:
    """Write ``csv_text(rows, columns)`` to ``path`` atomically (the folder is created)."""
    if not rows:
        raise ValueError(f"no rows to write to {path}")
    return write_text_atomic(path, csv_text(rows, columns))
