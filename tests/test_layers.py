"""The architecture, checked: planner/ <- engine/ <- measure/ <- plots/, no torch in the planner, no
re-export shims, and a non-editable install that works from another folder."""
from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "rollout_lab"
REPO = PACKAGE.parent
LAYERS = ("planner", "engine", "measure", "plots")
# what each layer must never import (anything of rollout_lab not listed is allowed below it)
FORBIDDEN = {"planner": ("engine", "measure", "plots", "cli", "notebooks"),
             "engine": ("measure", "plots", "cli", "notebooks"),
             "measure": ("plots", "cli", "notebooks"),
             "plots": ("cli", "notebooks")}


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in the file, function-level ones included."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.append((node.lineno, node.module))
            if node.module == "rollout_lab":  # from rollout_lab import engine
                out += [(node.lineno, f"rollout_lab.{a.name}") for a in node.names]
    return out


def layer_files(layer: str) -> list[Path]:
    return sorted((PACKAGE / layer).rglob("*.py"))


@pytest.mark.parametrize("layer", LAYERS)
def test_no_import_against_the_layering(layer):
    files = layer_files(layer)
    assert files, f"no modules under rollout_lab/{layer}"
    bad = [f"{path.relative_to(REPO)}:{line} imports {module}"
           for path in files for line, module in imports_of(path)
           if any(module == f"rollout_lab.{f}" or module.startswith(f"rollout_lab.{f}.") for f in FORBIDDEN[layer])]
    assert not bad, "\n".join(bad)


def test_the_planner_never_imports_torch_even_lazily():
    bad = [f"{path.relative_to(REPO)}:{line} imports {module}" for path in layer_files("planner")
           for line, module in imports_of(path) if module.split(".")[0] in ("torch", "transformers")]
    assert not bad, "\n".join(bad)


@pytest.mark.slow
def test_planner_and_cli_import_without_torch():
    code = ("import importlib, pkgutil, sys, rollout_lab, rollout_lab.planner, rollout_lab.cli\n"
            "for package in (rollout_lab.planner, rollout_lab.cli):\n"
            "    for m in pkgutil.walk_packages(package.__path__, package.__name__ + '.'):\n"
            "        if not m.name.endswith('.__main__'):  # runs the command\n"
            "            importlib.import_module(m.name)\n"
            "from rollout_lab import CostCoefficients, ModelGeometry, plan_buckets, choose_route\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n"
            "from rollout_lab import Rollout\n"
            "assert 'torch' in sys.modules\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_no_module_re_exports_names_defined_elsewhere():
    """A name is imported from the module that defines it: no ``__all__`` of imported names, no
    ``noqa: F401`` imports kept alive for others (``__init__`` files may expose the public API)."""
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "__init__.py":
            continue
        text = path.read_text(encoding="utf-8")
        tree = ast.parse(text)
        imported = {(a.asname or a.name).split(".")[0] for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))
                    for a in n.names}
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
                names = [e.value for e in getattr(node.value, "elts", []) if isinstance(e, ast.Constant)]
                bad += [f"{path.relative_to(REPO)} re-exports {n}" for n in names if n in imported]
        if "noqa: F401" in text:
            bad.append(f"{path.relative_to(REPO)} keeps an unused import (noqa: F401)")
    assert not bad, "\n".join(bad)


@pytest.mark.slow
def test_non_editable_install_runs_from_another_folder(tmp_path):
    """pip install . into a target folder, then plan a real GSM8K batch and read a shipped CSV from
    an unrelated folder; nothing is written into the installed package."""
    target, elsewhere = tmp_path / "site", tmp_path / "elsewhere"
    elsewhere.mkdir()
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--target", str(target), str(REPO)], check=True, cwd=tmp_path,
                   env={**os.environ, "PIP_NO_INDEX": "1"})
    installed = target / "rollout_lab"
    assert (installed / "measure" / "prompt_lengths" / "gsm8k.csv").is_file()
    assert sorted(p.name for p in (installed / "_notebooks").glob("*.ipynb")) == [  # notebooks/, by pyproject
        "01_calibrate.ipynb", "02_bucket_choices.ipynb", "03_latency_tables.ipynb", "04_adaptation.ipynb"]
    before = sorted(str(p.relative_to(target)) for p in target.rglob("*") if "__pycache__" not in p.parts)
    env = {**os.environ, "PYTHONPATH": str(target)}
    env.pop("ROLLOUT_LAB_OUT", None)

    def cli(*argv: str) -> str:
        done = subprocess.run([sys.executable, "-m", "rollout_lab.cli", *argv], cwd=elsewhere, env=env,
                              capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        return done.stdout

    out = cli("plan", "--dataset", "gsm8k", "--num-prompts", "32")
    assert out.startswith("32 prompts, qwen2.5-3b float32 geometry") and "bucketed prefill" in out
    shipped = cli("plan", "--file", str(installed / "measure" / "prompt_lengths" / "humaneval.csv"))
    assert shipped.startswith("164 prompts")
    (elsewhere / "mine.csv").write_text("name,num_tokens\na,120\nb,7\nc,512\n")
    assert cli("plan", "--file", "mine.csv").startswith("3 prompts")
    where = subprocess.run([sys.executable, "-c", "import rollout_lab; print(rollout_lab.__file__)"],
                           cwd=elsewhere, env=env, capture_output=True, text=True, check=True).stdout
    assert Path(where.strip()).parent == installed
    notebook = subprocess.run([sys.executable, "-c", "from rollout_lab.notebooks import notebook_path\n"
                               "print(notebook_path('01_calibrate'))"],
                              cwd=elsewhere, env=env, capture_output=True, text=True, check=True).stdout
    assert Path(notebook.strip()) == installed / "_notebooks" / "01_calibrate.ipynb"
    after = sorted(str(p.relative_to(target)) for p in target.rglob("*") if "__pycache__" not in p.parts)
    assert after == before, "the installed package was written to"
