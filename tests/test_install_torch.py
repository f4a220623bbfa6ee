"""scripts/install_torch.py, which make install runs before the package: the CPU build on a machine
without an NVIDIA driver (from pip's own sources where they hold it, else PyTorch's CPU index), PyPI's
build where there is a driver or where PyPI's is a CPU build, nothing where torch imports; and the
Makefile and environment.yml agree with it. Nothing is installed."""
from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("install_torch", ROOT / "scripts" / "install_torch.py")
install_torch = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(install_torch)

VERSION = install_torch.TORCH_VERSION


def test_linux_without_a_driver_takes_the_cpu_build_from_pytorchs_cpu_index_where_pip_lacks_it():
    args = install_torch.torch_pip_args(platform="linux", nvidia=False, pip_has_cpu_build=False)
    assert args == [f"torch=={VERSION}+cpu", "--extra-index-url", install_torch.CPU_INDEX]


def test_linux_without_a_driver_takes_the_cpu_build_from_pips_own_sources_where_they_hold_it():
    assert install_torch.torch_pip_args(platform="linux", nvidia=False, pip_has_cpu_build=True) == [
        f"torch=={VERSION}+cpu"]


def test_pip_is_asked_for_the_cpu_build_only_on_linux_without_a_driver(monkeypatch):
    asked = []
    monkeypatch.setattr(install_torch, "pip_sources_have", lambda req: asked.append(req) or False)
    assert install_torch.torch_pip_args(platform="linux", nvidia=True) == [f"torch=={VERSION}"]  # CUDA build
    assert install_torch.torch_pip_args(platform="darwin", nvidia=False) == [f"torch=={VERSION}"]  # CPU there
    assert install_torch.torch_pip_args(platform="win32", nvidia=False) == [f"torch=={VERSION}"]
    assert asked == []
    install_torch.torch_pip_args(platform="linux", nvidia=False)
    assert asked == [f"torch=={VERSION}+cpu"]


def test_dry_run_prints_the_cpu_choice_and_installs_nothing(monkeypatch, capsys):
    ran = []
    monkeypatch.setattr(install_torch, "importable_torch", lambda: None)
    monkeypatch.setattr(install_torch, "has_nvidia_driver", lambda: False)
    monkeypatch.setattr(install_torch, "pip_sources_have", lambda req: False)
    monkeypatch.setattr(install_torch.sys, "platform", "linux")
    monkeypatch.setattr(install_torch.subprocess, "run", lambda *a, **k: ran.append(a))
    assert install_torch.main(["--dry-run"]) == 0
    assert capsys.readouterr().out.strip().endswith(
        f"pip install -q torch=={VERSION}+cpu --extra-index-url {install_torch.CPU_INDEX}")
    assert ran == []


def test_an_importable_torch_is_kept(monkeypatch, capsys):
    monkeypatch.setattr(install_torch, "importable_torch", lambda: "9.9.9")
    monkeypatch.setattr(install_torch.subprocess, "run", lambda *a, **k: pytest.fail("ran pip"))
    assert install_torch.main([]) == 0
    assert capsys.readouterr().out == "torch 9.9.9 already imports: kept\n"


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_the_makefile_installs_torch_with_the_script_before_the_package():
    recipe = subprocess.run(["make", "-n", "-B", "-f", "Makefile", ".venv/.installed"], cwd=ROOT, text=True,
                            capture_output=True, check=True).stdout.splitlines()
    torch_line = next(i for i, line in enumerate(recipe) if line.endswith("scripts/install_torch.py"))
    package_line = next(i for i, line in enumerate(recipe) if '-e ".[notebooks,test]"' in line)
    assert torch_line < package_line
    assert not any("torch==" in line or "pip install -q torch" in line for line in recipe), recipe


def test_environment_yml_pins_the_scripts_torch_beside_the_cpu_index():
    text = (ROOT / "environment.yml").read_text(encoding="utf-8")
    pins = re.findall(r"^\s*- torch==(\S+)$", text, re.M)
    assert pins == [VERSION], pins
    assert f"- --extra-index-url {install_torch.CPU_INDEX}" in text


@pytest.mark.slow
def test_without_pips_local_sources_the_cpu_index_is_chosen(tmp_path):
    """As on a laptop: no pip.conf and no PIP_* variables, so the probe asks PyPI alone, which has no
    +cpu build (skipped where PyPI can't be reached). A torch that fails to import hides this one."""
    (tmp_path / "torch.py").write_text("raise ImportError('hidden from the script')\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE=os.devnull, PYTHONPATH=str(tmp_path))
    pypi = subprocess.run([sys.executable, "-m", "pip", "index", "versions", "torch"], env=env, capture_output=True)
    if pypi.returncode != 0:
        pytest.skip("PyPI not reachable")
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "install_torch.py"), "--dry-run"], env=env,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    if install_torch.has_nvidia_driver() or not sys.platform.startswith("linux"):
        pytest.skip("the CPU index is chosen only on Linux without an NVIDIA driver")
    assert out.stdout.strip().endswith(f"torch=={VERSION}+cpu --extra-index-url {install_torch.CPU_INDEX}"), out.stdout
