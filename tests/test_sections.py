"""measure.sections.measure_or_load, the one choice between measuring a notebook section and
rendering its saved record, through the sections that use it."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from rollout_lab.measure import sections
from rollout_lab.measure.long_tail import long_tail_or_load
from rollout_lab.measure.partial_rollouts import partial_rollouts_or_load
from rollout_lab.measure.prefix_sharing import prefix_sharing_or_load
from rollout_lab.measure.trainer_loop import trainer_loop_or_load

SECTIONS = {"long_tail": long_tail_or_load, "trainer_loop": trainer_loop_or_load,
            "partial_rollouts": partial_rollouts_or_load, "prefix_sharing": prefix_sharing_or_load}
KWARGS = dict(model="tiny-qwen2", dtype="float32", device="cpu")


@pytest.fixture
def no_model(monkeypatch):
    monkeypatch.setattr(sections, "load_model", lambda *a, **k: pytest.fail("built a model"))


@pytest.mark.parametrize("name", sorted(SECTIONS))
def test_both_given_nothing_given_and_unknown_settings(name, tmp_path, no_model):
    or_load = SECTIONS[name]
    assert or_load(**{f"{name}_shape": None, f"{name}_results_file": None}, **KWARGS, output_dir=tmp_path) is None
    with pytest.raises(ValueError, match=f"give {name}_shape \\(measure\\) or {name}_results_file \\(render\\), not both"):
        or_load(**{f"{name}_shape": {}, f"{name}_results_file": "x.json"}, **KWARGS, output_dir=tmp_path)
    with pytest.raises(ValueError, match=f"{name}_shape has unknown settings \\['nonsense'\\]"):
        or_load(**{f"{name}_shape": {"nonsense": 1}, f"{name}_results_file": None}, **KWARGS, output_dir=tmp_path)
    assert not (tmp_path / "data").exists()


@pytest.mark.parametrize("name", sorted(SECTIONS))
def test_a_missing_saved_record_is_an_error_naming_it(name, tmp_path, no_model):
    missing = tmp_path / "nowhere.json"
    with pytest.raises((ValueError, FileNotFoundError), match="nowhere"):
        SECTIONS[name](**{f"{name}_shape": None, f"{name}_results_file": str(missing)}, **KWARGS)


def test_the_model_is_let_go_of_even_when_the_run_fails(tmp_path, monkeypatch):
    released, built = [], []
    monkeypatch.setattr(sections, "load_model", lambda model, **k: (built.append(model) or object(), "tiny-qwen2"))
    monkeypatch.setattr(sections, "release_memory", lambda device: released.append(str(device)))

    def run(net, name, settings, save, script):
        assert (name, settings, script) == ("tiny-qwen2", {"a": 2, "b": 1}, "notebook 03 (demo_shape)")
        raise RuntimeError("out of memory")

    with pytest.raises(RuntimeError, match="out of memory"):
        sections.measure_or_load("demo", shape={"a": 2}, results_file=None, kind="demo", defaults={"a": 1, "b": 1},
                                 check=lambda settings, limits: None, run=run, rows=lambda r: [], output_dir=tmp_path,
                                 **KWARGS)
    assert built == ["tiny-qwen2"] and released == ["cpu"]


def test_a_measured_record_is_written_after_every_part_and_the_check_runs_first(tmp_path, monkeypatch):
    order = []
    monkeypatch.setattr(sections, "release_memory", lambda device: order.append("released"))

    def check(settings, limits):
        order.append(("checked", settings["a"], limits.max_positions > 0))

    def run(net, name, settings, save, script):
        order.append("ran")
        for part in range(2):
            save({"kind": "demo", "parts": part + 1})
        return {"kind": "demo", "parts": 2}

    name, record = sections.measure_or_load(
        "demo", shape={}, results_file=None, kind="demo", defaults={"a": 1}, check=check, run=run,
        rows=lambda r: [{"parts": r["parts"]}], output_dir=tmp_path, **KWARGS)
    assert order == [("checked", 1, True), "ran", "released"]
    assert name == str(tmp_path / "data" / "results" / "demo_tiny-qwen2_float32_cpu.json")
    header, row = (tmp_path / "data" / "results" / "demo_tiny-qwen2_float32_cpu.csv").read_text().splitlines()
    assert header == "run_id,parts" and row.endswith(",2")  # the last save's record
    assert json.loads(Path(name).read_text())["parts"] == 2
    with pytest.raises(ValueError, match="already exist"):  # never silently overwritten
        sections.measure_or_load("demo", shape={}, results_file=None, kind="demo", defaults={"a": 1}, check=check,
                                 run=run, rows=lambda r: [], output_dir=tmp_path, **KWARGS)
