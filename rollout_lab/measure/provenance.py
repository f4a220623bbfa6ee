"""Provenance of a measurement: git sha, host, device, library versions, date.

Every record under data/ carries one of these. torch is optional (the planner benchmark has none).
"""
from __future__ import annotations

import datetime as _dt
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

# The checkout this package was imported from (an installed copy has no .git above it: sha "unknown").
CHECKOUT = Path(__file__).resolve().parents[2]


def git_sha() -> str:
    """``$ROLLOUT_LAB_GIT_SHA`` when set (a copy sent to the GPU machine can carry a stale ``.git``),
    else the checkout's HEAD sha with '+dirty' when tracked files are modified, else a ``GIT_SHA``
    file at the root (``git archive`` snapshots), else "unknown"."""
    explicit = os.environ.get("ROLLOUT_LAB_GIT_SHA")
    if explicit:  # said by whoever sent the code (a device copy's .git can be stale)
        return explicit
    stamp = CHECKOUT / "GIT_SHA"
    if not (CHECKOUT / ".git").exists():
        if stamp.is_file():
            return stamp.read_text().strip()
        return "unknown"
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=CHECKOUT, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=CHECKOUT, capture_output=True, text=True, check=True,
        ).stdout.strip()
        return sha + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def provenance(device: Any = None, dtype: Any = None, **extra: Any) -> dict[str, Any]:
    """A JSON-ready dict describing where and with what a measurement ran."""
    info: dict[str, Any] = {
        "git_sha": git_sha(),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
    }
    try:  # provenance stays importable without numpy and torch (the planner benchmark's records)
        import numpy

        info["numpy"] = numpy.__version__
    except ImportError:
        pass
    if "torch" in sys.modules or device is not None or dtype is not None:
        info.update(_torch_info(device))
    if dtype is not None:
        info["dtype"] = str(dtype).replace("torch.", "")
    info.update(extra)
    return info


def _torch_info(device: Any) -> dict[str, Any]:
    import torch  # only when the measurement used torch: the planner benchmark does not
    import transformers

    from rollout_lab.engine.model_info import device_name  # torch, as above

    info: dict[str, Any] = {"torch": torch.__version__, "transformers": transformers.__version__}
    dev = torch.device(device) if device is not None else torch.device("cpu")
    info["device_type"] = dev.type
    info["device_name"] = device_name(dev)
    if dev.type == "cuda" and torch.cuda.is_available():
        info["cuda"] = torch.version.cuda
        info["tf32_matmul"] = bool(torch.backends.cuda.matmul.allow_tf32)
    else:
        info["num_threads"] = torch.get_num_threads()
    return info
