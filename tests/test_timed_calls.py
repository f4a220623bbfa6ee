"""The measure runs time ``Rollout.generate`` calls: none of them may draw a progress bar
(engine.sched.progress, on by default where a person watches), whose drawing would be timed too."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

import rollout_lab
from rollout_lab.measure.models import tiny_model

PACKAGE = Path(rollout_lab.__file__).parent
HF_MODELS = ("model", "self.model", "net")  # a transformers model's own generate (the peers, the oracle)


def rollout_generate_calls(folder: Path) -> list[tuple[str, int, ast.Call]]:
    """(file, line, call) of every ``<x>.generate(...)`` under ``folder`` whose ``x`` is not an HF model."""
    calls = []
    for path in sorted(folder.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "generate" \
                    and ast.unparse(node.func.value) not in HF_MODELS:
                calls.append((path.name, node.lineno, node))
    return calls


@pytest.mark.parametrize("folder", ["measure", "cli"])
def test_every_rollout_generate_call_of_the_measure_runs_passes_progress_false(folder):
    calls = rollout_generate_calls(PACKAGE / folder)
    drawn = [f"{name}:{line}" for name, line, call in calls
             if not any(k.arg == "progress" and isinstance(k.value, ast.Constant) and k.value.value is False
                        for k in call.keywords)]
    assert not drawn, f"Rollout.generate without progress=False: {drawn}"
    if folder == "measure":
        assert len(calls) >= 20  # the walk found them (adaptation, calibrate, rl, sweep, ...)


def test_a_measured_call_draws_no_bar_where_a_person_watches(monkeypatch):
    """With a person watching (the auto setting on), a bench's timed calls still draw nothing."""
    from rollout_lab.engine.api import rollout as rollout_module
    from rollout_lab.measure.rl import run_rl

    asked = []

    def shows_progress(progress):
        asked.append(progress)
        return progress is not False  # None (auto) would draw: a person watches

    monkeypatch.setattr(rollout_module, "shows_progress", shows_progress)
    run_rl(tiny_model("qwen2"), model_name="tiny-qwen2", dtype="float32", paths=["ours_no_compile"], reps=1,
           num_seqs=3, min_len=3, max_len=6, seed=1)
    assert asked and set(asked) == {False}
