"""What a rollout keeps on disk per setting: the coefficients of ``costs="auto"`` and the compiled
artifacts of its CUDA graphs, so that the next process starts where this one ended.

**Costs.** On CUDA, ``costs="auto"`` (the default) looks in the cache folder for a cost file whose
provenance matches the model as it runs (``planner.cost.CostFile.check``: model geometry, dtype,
device name, attention implementation, torch and transformers releases, TF32, captured prefill).
Found, its coefficients price the first call. Not found, the first calls start from the reference's
prefill coefficients with CB decode priced below nocb's (``engine.api.rollout.captured_decode_prior``:
the captured step is the fast one here, the reverse of the reference's gap). Either way the rollout then refines them from its own timed forwards
(``planner.fit.OnlineCalibrator``, as ``online_recalibration=True`` does, without exploring other
routes) and saves the refit here after each call. Elsewhere (a CPU) "auto" is the reference's
coefficients: CPU timings are too noisy to learn from, and a test suite must not plan by what an
earlier run left on disk.

**Compiled artifacts.** With ``RolloutConfig(compile_cache=True)`` (the default) a CUDA rollout that
compiles loads torch.compile's portable cache (``torch.compiler.load_cache_artifacts``: inductor's
kernels, AOTAutograd's graphs, autotuning) from here before its first compile, and saves it
(``save_cache_artifacts``) after a call that compiled something new. Torch checks the artifacts'
torch, Triton and GPU itself; a fresh machine with this folder copied skips inductor's code
generation (dynamo still traces).

The folder is ``$ROLLOUT_LAB_CACHE``, else ``~/.cache/rollout_lab``: ``costs/`` and ``compiled/``. A
file's name is the model's dtype, device and a hash of its checked provenance; writes are atomic,
and a file that does not read is skipped with a warning (never deleted).

**Trust.** Compiled artifacts are code: whoever can write ``compiled/`` runs code in every process
that loads it. So they are loaded and saved only when the cache folder, ``compiled/`` and the file
are owned by the current user and not writable by group or others (``untrusted_cache``); otherwise
the rollout compiles fresh, with one warning per folder naming it and why. The folders this module
creates are mode 0700.

    path = cached_cost_file(model_metadata(model, prefill_graphs=True))   # None when none matches
    save_costs(costs, metadata, source="...")                            # the path written
    load_compiled(metadata); ...; save_compiled(metadata)                 # around the first compile
"""
from __future__ import annotations

import hashlib
import json
import os
import stat
import warnings
from pathlib import Path
from typing import Any, Mapping

import torch

from rollout_lab.planner.cost import CHECKED_FIELDS, CostCoefficients, CostFile, metadata_mismatches
from rollout_lab.workspace import write_bytes_atomic

CACHE_ENV = "ROLLOUT_LAB_CACHE"
COST_NAMES = ("auto", "reference")  # RolloutConfig(costs=...) names; any other string is a cost file's path


def cache_root() -> Path:
    """The cache folder: ``$ROLLOUT_LAB_CACHE``, else ``~/.cache/rollout_lab``."""
    root = os.environ.get(CACHE_ENV)
    return Path(root) if root else Path.home() / ".cache" / "rollout_lab"


def cache_dir() -> Path:
    """Where ``costs="auto"`` keeps its cost files (module docstring)."""
    return cache_root() / "costs"


def _key(metadata: Mapping[str, Any]) -> str:
    checked = {name: metadata.get(name) for name in CHECKED_FIELDS + ("prefill_graphs",)}
    return hashlib.sha256(json.dumps(checked, sort_keys=True, default=str).encode()).hexdigest()[:12]


def _name(metadata: Mapping[str, Any]) -> str:
    device = str(metadata.get("device_name") or metadata.get("device_type") or "device")
    slug = "".join(c if c.isalnum() or c in "._-" else "-" for c in f"{metadata.get('dtype')}_{device}").lower()
    return f"{slug}_{_key(metadata)}"


def cost_cache_path(metadata: Mapping[str, Any]) -> Path:
    """The file the coefficients of the setting ``metadata`` describes are saved to."""
    return cache_dir() / f"{_name(metadata)}.json"


def cached_cost_file(metadata: Mapping[str, Any]) -> CostFile | None:
    """The cached cost file of the setting ``metadata`` describes: its own file when it reads and
    still matches, else any other file of the folder that matches (a patch release of torch or
    transformers apart); None when none does."""
    folder = cache_dir()
    own = cost_cache_path(metadata)
    candidates = [own] + (sorted(p for p in folder.glob("*.json") if p != own) if folder.is_dir() else [])
    for path in candidates:
        if not path.is_file():
            continue
        try:
            found = CostFile.read(path)
        except ValueError as err:
            warnings.warn(f"skipping an unreadable cached cost file: {err}", stacklevel=2)
            continue
        if not metadata_mismatches(found.metadata, metadata):
            return found
    return None


def save_costs(costs: CostCoefficients, metadata: Mapping[str, Any], *, source: str) -> Path:
    """Write ``costs`` with ``metadata`` (and ``source``: how they were found) to the setting's
    cache file, atomically; returns its path."""
    path = cost_cache_path(metadata)
    _private_folder(path.parent)
    grid = {"prefill_graphs": bool(metadata.get("prefill_graphs", False))}  # checked as a calibration's grid
    return costs.to_json(path, {**metadata, "grid": grid, "source": source})


# -- compiled artifacts ----------------------------------------------------------------------------

def compiled_cache_path(metadata: Mapping[str, Any]) -> Path:
    """The file of torch.compile's portable cache for the setting ``metadata`` describes."""
    return cache_root() / "compiled" / f"{_name(metadata)}.bin"


def untrusted_cache(path: Path) -> str | None:
    """Why ``path`` under the cache folder may not be trusted as code (None: it may): the cache
    folder, ``compiled/`` or ``path`` itself, where it exists, owned by another user or writable by
    group or others. Symlinks are followed: what counts is the folder that would be read."""
    root = cache_root()
    for where in (root, root / "compiled", path):
        try:
            status = where.stat()
        except FileNotFoundError:
            continue
        if status.st_uid != os.getuid():
            return f"{str(where)!r} is owned by uid {status.st_uid}, not this user (uid {os.getuid()})"
        if status.st_mode & 0o022:
            who = " and ".join(w for w, bit in (("group", 0o020), ("others", 0o002)) if status.st_mode & bit)
            return f"{str(where)!r} is writable by {who} (mode {stat.S_IMODE(status.st_mode):o})"
    return None


_WARNED: set[str] = set()  # the reasons already warned of: once per folder and process


def _trusted(path: Path) -> bool:
    """False, warning once per reason, when ``untrusted_cache(path)`` finds a reason."""
    reason = untrusted_cache(path)
    if reason is None:
        return True
    if reason not in _WARNED:
        _WARNED.add(reason)
        warnings.warn(f"not using the compile cache {str(path.parent)!r}: {reason}, so another user could "
                      f"plant code there; compiling fresh (chmod go-w the folder, or set ${CACHE_ENV} to a "
                      "private one)", stacklevel=3)
    return False


def _private_folder(folder: Path) -> None:
    """Create ``folder`` and the cache folder above it, each mode 0700 (an existing one is left as it is)."""
    for where in (cache_root(), folder):
        if not where.is_dir():
            where.mkdir(mode=0o700, parents=True, exist_ok=True)


def load_compiled(metadata: Mapping[str, Any]) -> int:
    """Load the setting's saved compile artifacts into torch.compile's caches (before compiling);
    how many artifacts it loaded (0 when there is no file, when the cache may not be trusted
    (``untrusted_cache``: warned once), or torch refused it: with a warning)."""
    path = compiled_cache_path(metadata)
    if not path.is_file() or not _trusted(path):
        return 0
    try:
        info = torch.compiler.load_cache_artifacts(path.read_bytes())
    except Exception as err:  # a file of another torch, Triton or GPU, or a damaged one: compile anew
        warnings.warn(f"skipping the compile cache {str(path)!r}: {type(err).__name__}: {err}", stacklevel=2)
        return 0
    if info is None:  # torch logs why (a checksum, another torch or Triton) and loads nothing
        warnings.warn(f"skipping the compile cache {str(path)!r}: torch did not load it", stacklevel=2)
        return 0
    return sum(len(keys) for keys in info.artifacts.values())


def save_compiled(metadata: Mapping[str, Any]) -> Path | None:
    """Write every compile artifact this process made so far to the setting's file, atomically;
    its path, or None when there is nothing to save or the cache may not be trusted (``untrusted_cache``)."""
    path = compiled_cache_path(metadata)
    if not _trusted(path):
        return None
    saved = torch.compiler.save_cache_artifacts()
    if saved is None:
        return None
    _private_folder(path.parent)
    written = write_bytes_atomic(path, saved[0])
    os.chmod(written, 0o600)  # never group-writable, whatever the umask: untrusted_cache would refuse it
    return written
