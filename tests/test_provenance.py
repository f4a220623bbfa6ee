"""Provenance: the sha the sender names wins over a (possibly stale) .git; versions are recorded."""
from __future__ import annotations

from rollout_lab.measure.provenance import git_sha, provenance


def test_an_explicit_sha_wins(monkeypatch):
    monkeypatch.setenv("ROLLOUT_LAB_GIT_SHA", "abc123")
    assert git_sha() == "abc123"
    assert provenance()["git_sha"] == "abc123"


def test_without_it_the_checkout_is_read(monkeypatch):
    monkeypatch.delenv("ROLLOUT_LAB_GIT_SHA", raising=False)
    sha = git_sha()
    assert sha == "unknown" or len(sha.split("+")[0]) == 40


# ---------------------------------------------------------------- a cost file meets the model it is used with

def test_rollout_config_costs_path_is_checked_against_the_model(tmp_path):
    """RolloutConfig(costs=path) is read at once and checked by Rollout against the live model: a file
    from another model (geometry, dtype, device) or without metadata is refused, naming the fields,
    unless override_costs=True; a plain CostCoefficients is used as given."""
    import json

    import pytest

    from rollout_lab.engine.api.config import RolloutConfig
    from rollout_lab.engine.api.rollout import Rollout
    from rollout_lab.engine.model_info import model_metadata, model_name_of
    from rollout_lab.measure.models import tiny_model
    from rollout_lab.planner.cost import CostCoefficients

    tiny = tiny_model("qwen2")
    mine = CostCoefficients(prefill_fixed_cost_ms=0.5)
    matching = mine.to_json(tmp_path / "tiny.json", metadata=model_metadata(tiny, model_name=model_name_of(tiny)))
    assert Rollout(tiny, RolloutConfig(costs=str(matching))).costs == mine
    assert Rollout(tiny, RolloutConfig(costs=matching, mode="bucketed")).generate(
        [[5, 6, 7]], max_new_tokens=2).sequences[0]

    other = json.loads(matching.read_text())
    other["metadata"].update(dtype="bfloat16", device_type="cuda", device_name="NVIDIA H200")
    other["metadata"]["geometry"]["num_layers"] = 36
    (tmp_path / "h200.json").write_text(json.dumps(other))
    config = RolloutConfig(costs=tmp_path / "h200.json")
    with pytest.raises(ValueError) as err:
        Rollout(tiny, config)
    for name in ("geometry", "dtype", "device_type", "device_name"):
        assert f"{name}: file has" in str(err.value), name
    assert "h200.json" in str(err.value) and "override" in str(err.value)
    assert Rollout(tiny, RolloutConfig(costs=tmp_path / "h200.json", override_costs=True)).costs == mine

    bare = mine.to_json(tmp_path / "bare.json")
    with pytest.raises(ValueError, match="bare.json.*has no provenance metadata"):
        Rollout(tiny, RolloutConfig(costs=bare))
    assert Rollout(tiny, RolloutConfig(costs=bare, override_costs=True)).costs == mine
    assert Rollout(tiny, RolloutConfig(costs=CostCoefficients(prefill_fixed_cost_ms=99.0))).costs.prefill_fixed_cost_ms == 99.0
    with pytest.raises(ValueError, match="'metadata' must be an object"):
        (tmp_path / "five.json").write_text(json.dumps({"coefficients": mine.to_dict(), "metadata": 5}))
        RolloutConfig(costs=tmp_path / "five.json")


def test_rollout_refuses_a_calibration_of_captured_prefill_for_its_eager_forwards(tmp_path):
    """A calibration whose grid timed captured prefill forwards (calibrate --prefill-graphs) prices a
    fixed cost that eager forwards do not have: Rollout without prefill_graphs refuses it, naming the
    field, unless override_costs=True; a grid of eager forwards is accepted."""
    import pytest

    from rollout_lab.engine.api.config import RolloutConfig
    from rollout_lab.engine.api.rollout import Rollout
    from rollout_lab.engine.model_info import model_metadata, model_name_of
    from rollout_lab.measure.models import tiny_model
    from rollout_lab.planner.cost import CostCoefficients

    tiny = tiny_model("qwen2")
    mine = CostCoefficients(prefill_fixed_cost_ms=0.5)
    for graphs in (True, False):
        mine.to_json(tmp_path / f"{graphs}.json", metadata=model_metadata(tiny, model_name=model_name_of(tiny))
                     | {"grid": {"prefill_graphs": graphs}})
    assert Rollout(tiny, RolloutConfig(costs=tmp_path / "False.json")).costs == mine
    with pytest.raises(ValueError, match="prefill_graphs: file has True, this setting has False"):
        Rollout(tiny, RolloutConfig(costs=tmp_path / "True.json"))
    assert Rollout(tiny, RolloutConfig(costs=tmp_path / "True.json", override_costs=True)).costs == mine


def test_rollout_checks_the_model_name_of_a_cost_file_as_the_cli_does(tmp_path):
    """Issue 36: RolloutConfig(costs=path) accepted a cost file of another model with the same shapes,
    or one naming another model; the CLI refuses both (its model's name is in the metadata it checks).
    Rollout checks the name too (engine.model_info.model_name_of): a checkpoint goes by its folder's name,
    as `--model` does, tiny_model/from_preset by their CLI names, another model built from a config by
    its family and size; override_costs accepts a mismatch."""
    import pytest

    from rollout_lab.engine.api.config import RolloutConfig
    from rollout_lab.engine.api.rollout import Rollout
    from rollout_lab.engine.model_info import model_metadata, model_name_of
    from rollout_lab.measure.calibrate import load_calibration
    from rollout_lab.measure.models import tiny_model
    from rollout_lab.planner.cost import CostCoefficients

    qwen, llama = tiny_model("qwen2"), tiny_model("llama")
    assert model_metadata(qwen)["geometry"] == model_metadata(llama)["geometry"]  # the same shapes
    mine = CostCoefficients(prefill_fixed_cost_ms=0.5)
    other = mine.to_json(tmp_path / "llama.json", metadata=model_metadata(llama, model_name=model_name_of(llama)))
    named = mine.to_json(tmp_path / "named.json", metadata=model_metadata(qwen, model_name="qwen3-32b"))
    for path, file_name in ((other, "tiny-llama"), (named, "qwen3-32b")):
        for check in (lambda: Rollout(qwen, RolloutConfig(costs=path)), lambda: load_calibration(path, model=qwen)):
            with pytest.raises(ValueError, match=f"model_name: file has '{file_name}', this setting has 'tiny-qwen2'"):
                check()
        assert Rollout(qwen, RolloutConfig(costs=path, override_costs=True)).costs == mine
    assert Rollout(llama, RolloutConfig(costs=other)).costs == mine
    cli = mine.to_json(tmp_path / "cli.json", metadata=model_metadata(qwen, model_name="tiny-qwen2"))
    assert Rollout(qwen, RolloutConfig(costs=cli)).costs == mine  # what `rollout-lab calibrate --tiny qwen2` names

    built = tiny_model("qwen2")
    built.config.name_or_path = ""  # built from a config by hand: its family and size
    assert model_name_of(built) == "qwen2-2L-64h"
    with pytest.raises(ValueError, match="model_name: file has 'tiny-qwen2', this setting has 'qwen2-2L-64h'"):
        Rollout(built, RolloutConfig(costs=cli))
