import json
import math
from dataclasses import asdict

import pytest

from rollout_lab.planner.cost import (
    MAX_COST_FILE_BYTES,
    CostCoefficients,
    CostFile,
    ModelGeometry,
    attention_gflops,
    kv_mib,
    prefill_cost_ms,
    setting_metadata,
)

QWEN3B_FP32 = ModelGeometry(36, 16, 2, 128, 4)


def test_defaults_are_the_reference_values():
    c = CostCoefficients()
    assert (c.prefill_fixed_cost_ms, c.prefill_token_cost_ms) == (25.0, 0.1)
    assert (c.prefill_attention_cost_ms, c.prefill_kv_cost_ms) == (0.01, 0.04)
    assert c.continuous_decode_cost_ms == 10.0 and c.prefill_max_tokens == 65536
    assert c.prefill_replicate_cost_ms == 0.0  # shared prefill's copies: free in the reference


def test_formulas_by_hand():
    # 4 * 1 * 512^2 * 36 * 16 * 128 / 1e9 and 2 * 1 * 512 * 36 * 2 * 128 * 4 / 2^20
    assert attention_gflops(1, 512, QWEN3B_FP32) == pytest.approx(77.309411328)
    assert kv_mib(1, 512, QWEN3B_FP32) == pytest.approx(36.0)
    c = CostCoefficients()
    expected = 25.0 + 0.1 * 512 + 0.01 * 77.309411328 + 0.04 * 36.0
    assert prefill_cost_ms(1, 512, QWEN3B_FP32, c) == pytest.approx(expected)
    assert prefill_cost_ms(1, 512, QWEN3B_FP32, c, include_kv=False) == pytest.approx(expected - 1.44)
    assert prefill_cost_ms(0, 512, QWEN3B_FP32, c) == 0.0


def test_worked_example_one_bucket_is_1734_ms():
    assert prefill_cost_ms(32, 512, QWEN3B_FP32, CostCoefficients()) == pytest.approx(1734.2, abs=0.1)


@pytest.mark.parametrize("field", [
    "prefill_fixed_cost_ms", "prefill_token_cost_ms", "prefill_attention_cost_ms",
    "prefill_kv_cost_ms", "continuous_decode_cost_ms", "nocb_decode_cost_ms",
    "prefill_replicate_cost_ms",
])
@pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf, "3"])
def test_bad_coefficient_names_the_field(field, bad):
    with pytest.raises(ValueError, match=field):
        CostCoefficients(**{field: bad})


@pytest.mark.parametrize("bad", [0, -5, 1.5, True])
def test_bad_token_limit(bad):
    with pytest.raises(ValueError, match="prefill_max_tokens"):
        CostCoefficients(prefill_max_tokens=bad)


def test_json_round_trip_and_strict_keys(tmp_path):
    c = CostCoefficients(prefill_fixed_cost_ms=3.5, prefill_max_tokens=None, prefill_replicate_cost_ms=0.02)
    setting = setting_metadata(geometry=QWEN3B_FP32, dtype="float32", model_name="qwen2.5-3b")
    path = c.to_json(tmp_path / "c.json", metadata={**setting, "note": "mine"})
    assert CostCoefficients.from_json(path, expected=setting) == c
    assert "prefill_replicate_cost_ms" in c.to_dict()
    assert CostFile.read(path).metadata["note"] == "mine"
    data = path.read_text().replace('"prefill_kv_cost_ms"', '"prefill_kv_cost"')
    (tmp_path / "bad.json").write_text(data)
    with pytest.raises(ValueError, match="unknown keys \\['prefill_kv_cost'\\].*missing keys \\['prefill_kv_cost_ms'\\]"):
        CostCoefficients.from_json(tmp_path / "bad.json", expected=setting)
    with pytest.raises(ValueError, match="does not exist"):
        CostCoefficients.from_json(tmp_path / "nope.json", expected=setting)


def test_a_cost_file_is_checked_against_the_setting_it_is_used_in(tmp_path):
    """Every differing field is named; a file without provenance is refused; override accepts both;
    plain CostCoefficients objects are the user's own numbers and never checked."""
    tiny = ModelGeometry(2, 4, 2, 16, 4)
    path = CostCoefficients().to_json(tmp_path / "tiny.json", metadata={
        **setting_metadata(geometry=tiny, dtype="float32", model_name="tiny-qwen2", device_type="cpu"),
        "torch": "2.0"})
    qwen32 = setting_metadata(geometry=ModelGeometry(64, 64, 8, 128, 2), dtype="bfloat16",
                              model_name="qwen3-32b", device_type="cuda")
    with pytest.raises(ValueError) as err:
        CostFile.read(path).check(qwen32)
    message = str(err.value)
    for name in ("model_name", "geometry", "dtype", "device_type"):
        assert f"{name}: file has" in message, name
    assert "torch" not in message.split("(")[1]  # only the fields the setting knows are compared
    assert "tiny.json" in message
    # right wherever it reaches: CostFile.check and load_calibration, RolloutConfig and the notebooks, the CLI
    assert message.endswith("or use it anyway: override=True (override_costs=True in RolloutConfig and the "
                            "notebooks, --override-costs beside a command's --costs)")
    assert CostFile.read(path).check(qwen32, override=True) == CostCoefficients()
    bare = CostCoefficients().to_json(tmp_path / "bare.json")  # no metadata: cannot be checked
    with pytest.raises(ValueError, match="bare.json.*has no provenance metadata"):
        CostFile.read(bare).check(setting_metadata(geometry=tiny))
    assert CostFile.read(bare).check(setting_metadata(geometry=tiny), override=True) == CostCoefficients()


def test_a_patch_release_apart_is_used_with_a_warning(tmp_path):
    """torch / transformers a patch release apart (and another local build tag): accepted, warned;
    another minor release, or another dtype or device: refused as before."""
    tiny = ModelGeometry(2, 4, 2, 16, 4)
    setting = setting_metadata(geometry=tiny, dtype="float32", model_name="tiny-qwen2", device_type="cuda")
    path = CostCoefficients(prefill_fixed_cost_ms=6.0).to_json(tmp_path / "c.json", metadata={
        **setting, "torch": "2.11.0+cu130", "transformers": "5.17.0"})
    here = {**setting, "torch": "2.11.1+cu128", "transformers": "5.17.2"}
    with pytest.warns(UserWarning, match=r"torch 2\.11\.0\+cu130, transformers 5\.17\.0; this setting runs torch 2\.11\.1"):
        assert CostFile.read(path).check(here).prefill_fixed_cost_ms == 6.0
    with pytest.raises(ValueError, match="transformers: file has '5.17.0', this setting has '5.18.0'"):
        CostFile.read(path).check({**here, "transformers": "5.18.0"})
    with pytest.raises(ValueError, match="dtype: file has 'float32', this setting has 'bfloat16'"):
        CostFile.read(path).check({**here, "dtype": "bfloat16"})
    with pytest.raises(ValueError, match="device_type: file has 'cuda', this setting has 'cpu'"):
        CostFile.read(path).check({**here, "device_type": "cpu"})


GOOD = {"coefficients": CostCoefficients().to_dict(), "metadata": {}}


@pytest.mark.parametrize("content, message", [
    (None, "does not exist"),
    (b"\xff\xfe not utf-8", "is not UTF-8 text"),
    (b"{not json", "is not valid JSON"),
    (b"[1, 2]", "must hold an object with keys 'coefficients' and 'metadata'"),
    (json.dumps({**GOOD, "extra": 1}).encode(), "must hold an object with keys"),
    (json.dumps({**GOOD, "coefficients": None}).encode(), "'coefficients' must be an object, got None"),
    (json.dumps({**GOOD, "metadata": 5}).encode(), "'metadata' must be an object, got 5"),
    (json.dumps({**GOOD, "coefficients": {k: v for k, v in GOOD["coefficients"].items()
                                          if k != "prefill_token_cost_ms"}}).encode(),
     "missing keys \\['prefill_token_cost_ms'\\]"),
    (json.dumps({**GOOD, "coefficients": {**GOOD["coefficients"], "prefill_kv_cost_ms": -1}}).encode(),
     "prefill_kv_cost_ms must be finite and >= 0, got -1"),
    (json.dumps({**GOOD, "coefficients": {**GOOD["coefficients"], "prefill_kv_cost_ms": "NaN"}}).encode(),
     "prefill_kv_cost_ms must be a number"),
    (b'{"coefficients": {"prefill_kv_cost_ms": NaN}}', "NaN is not a JSON number"),
    (b"[" * 100000 + b"]" * 100000, "is not valid JSON"),
])
def test_a_malformed_cost_file_names_the_file_and_the_field(tmp_path, content, message):
    path = tmp_path / "costs.json"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(ValueError, match=message) as err:
        CostFile.read(path)
    assert "costs.json" in str(err.value)


def test_a_huge_cost_file_is_refused_before_it_is_parsed(tmp_path):
    path = tmp_path / "huge.json"
    with open(path, "wb") as f:
        f.truncate(MAX_COST_FILE_BYTES + 1)
    with pytest.raises(ValueError, match=f"huge.json.*{MAX_COST_FILE_BYTES + 1} bytes, over the"):
        CostFile.read(path)


def test_setting_metadata_is_shaped_as_a_calibration_records_it():
    assert setting_metadata(geometry=QWEN3B_FP32, dtype="torch.bfloat16", device_type="cuda:1") == {
        "geometry": asdict(QWEN3B_FP32), "dtype": "bfloat16", "device_type": "cuda"}


class _Cfg:
    def __init__(self, **kw):
        self.__dict__.update(kw)


def test_geometry_from_config_prefers_explicit_head_dim():
    cfg = _Cfg(num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, hidden_size=1024, head_dim=128)
    assert ModelGeometry.from_config(cfg, "bfloat16") == ModelGeometry(28, 16, 8, 128, 2)
    cfg = _Cfg(num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2, hidden_size=2048, head_dim=None)
    assert ModelGeometry.from_config(cfg, "float32") == QWEN3B_FP32
    cfg = _Cfg(num_hidden_layers=2, num_attention_heads=4, hidden_size=64)  # no GQA: kv = query heads
    assert ModelGeometry.from_config(cfg, "float16").num_kv_heads == 4
    with pytest.raises(ValueError, match="num_layers"):
        ModelGeometry(0, 1, 1, 1, 4)
