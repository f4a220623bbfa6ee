import math

import pytest

from rollout_lab.planner.cost import (
    CostCoefficients,
    ModelGeometry,
    attention_gflops,
    kv_mib,
    prefill_cost_ms,
    read_cost_file,
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
    path = c.to_json(tmp_path / "c.json", metadata={"model": "tiny"})
    assert CostCoefficients.from_json(path) == c
    assert "prefill_replicate_cost_ms" in c.to_dict()
    assert read_cost_file(path)[1] == {"model": "tiny"}
    data = path.read_text().replace('"prefill_kv_cost_ms"', '"prefill_kv_cost"')
    (tmp_path / "bad.json").write_text(data)
    with pytest.raises(ValueError, match="unknown keys \\['prefill_kv_cost'\\].*missing keys \\['prefill_kv_cost_ms'\\]"):
        CostCoefficients.from_json(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="does not exist"):
        CostCoefficients.from_json(tmp_path / "nope.json")


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
