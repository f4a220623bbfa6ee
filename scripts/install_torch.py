"""Install the torch build that fits this machine into the Python that runs this script, before the
package itself: the package asks only for ``torch>=2.4``, which pip answers on Linux with PyPI's CUDA
build of several GB, CPU-only machine or not. ``make install`` runs it in .venv::

    .venv/bin/python scripts/install_torch.py            # install (nothing when torch imports)
    .venv/bin/python scripts/install_torch.py --dry-run  # print the choice and the pip command only

- torch already imports: kept, nothing installed.
- An NVIDIA driver (``nvidia-smi`` on PATH, or /proc/driver/nvidia): PyPI's ``torch==TORCH_VERSION``,
  the CUDA build.
- Linux without one: ``torch==TORCH_VERSION+cpu``, the CPU build. pip's own sources (pip.conf, PIP_*
  variables: its indexes and find-links) are asked first with ``pip install --dry-run``; PyTorch's CPU
  index is added only where they lack that build, so a machine whose pip already serves it needs no
  other host, and a laptop gets it from PyTorch. The ``+cpu`` pin makes a missing CPU build an error
  instead of a silent CUDA download.
- macOS and Windows: PyPI's ``torch==TORCH_VERSION``, a CPU build there.

Standard library only: it runs before anything else is installed.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys

TORCH_VERSION = "2.13.0"  # environment.yml pins the same (tests/test_install_torch.py checks)
CPU_INDEX = "https://download.pytorch.org/whl/cpu"  # PyTorch's index of CPU builds


def has_nvidia_driver() -> bool:
    """Whether this machine has an NVIDIA driver, the condition for a CUDA build to be of any use."""
    return shutil.which("nvidia-smi") is not None or os.path.exists("/proc/driver/nvidia/version")


def pip_sources_have(requirement: str) -> bool:
    """Whether pip, configured as it is here, resolves ``requirement`` without another index (a dry
    run: nothing is downloaded beyond the index pages, nothing installed)."""
    probe = [sys.executable, "-m", "pip", "install", "--dry-run", "--no-deps", "--ignore-installed", "--quiet",
             requirement]
    return subprocess.run(probe, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode == 0


def torch_pip_args(*, platform: str, nvidia: bool, pip_has_cpu_build: bool | None = None,
                   version: str = TORCH_VERSION) -> list[str]:
    """The arguments after ``pip install`` for this machine: ``platform`` is ``sys.platform``,
    ``nvidia`` whether it has an NVIDIA driver, ``pip_has_cpu_build`` whether pip's own sources hold
    ``torch==version+cpu`` (asked only for Linux without a driver; None: ask pip)."""
    if nvidia or not platform.startswith("linux"):
        return [f"torch=={version}"]
    requirement = f"torch=={version}+cpu"
    if pip_has_cpu_build is None:
        pip_has_cpu_build = pip_sources_have(requirement)
    return [requirement] if pip_has_cpu_build else [requirement, "--extra-index-url", CPU_INDEX]


def importable_torch() -> str | None:
    """The version of the torch that imports here, or None."""
    try:
        import torch  # only to learn whether one is there to keep
    except ImportError:
        return None
    return torch.__version__


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="print the pip command instead of running it")
    args = parser.parse_args(argv)
    kept = importable_torch()
    if kept is not None:
        print(f"torch {kept} already imports: kept")
        return 0
    command = [sys.executable, "-m", "pip", "install", "-q",
               *torch_pip_args(platform=sys.platform, nvidia=has_nvidia_driver())]
    print(" ".join(command), flush=True)
    return 0 if args.dry_run else subprocess.run(command).returncode


if __name__ == "__main__":
    sys.exit(main())
