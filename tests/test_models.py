"""Tiny models, preset architectures with random weights, and local checkpoints."""
from __future__ import annotations

import pytest
import torch

from rollout_lab.measure.models import (
    TINY_FAMILIES,
    TINY_MAX_POSITIONS,
    TINY_VOCAB_SIZE,
    from_preset,
    load_model,
    load_pretrained,
    model_config,
    preset_config,
    tiny_model,
)
from rollout_lab.engine.model_info import model_name_of
from rollout_lab.measure.presets import PRESETS, context_for, geometry_for
from rollout_lab.planner.cost import ModelGeometry

# hidden / layers / heads / kv heads / head_dim / intermediate / vocab (DESIGN.md)
PRESET_SHAPES = {
    "qwen2.5-0.5b": (896, 24, 14, 2, 64, 4864, 151936),
    "qwen2.5-3b": (2048, 36, 16, 2, 128, 11008, 151936),
    "qwen3-0.6b": (1024, 28, 16, 8, 128, 3072, 151936),
    "qwen3-32b": (5120, 64, 64, 8, 128, 25600, 151936),
}


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_tiny_model(family):
    model = tiny_model(family)
    assert not model.training
    assert next(model.parameters()).dtype == torch.float32
    assert model.config.num_hidden_layers == 2
    assert model.get_input_embeddings().weight.shape[0] == TINY_VOCAB_SIZE
    same = tiny_model(family, seed=0)
    other = tiny_model(family, seed=1)
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, same(ids).logits)
        assert not torch.equal(model(ids).logits, other(ids).logits)


def test_unknown_names_list_the_valid_ones():
    with pytest.raises(ValueError, match="qwen2.*qwen3.*llama.*opt"):
        tiny_model("gpt2")
    with pytest.raises(ValueError, match="qwen2.5-0.5b"):
        from_preset("qwen-7b")
    with pytest.raises(ValueError, match="no model folder at '/nonexistent/checkpoint'; expected a folder"):
        load_pretrained("/nonexistent/checkpoint")


@pytest.mark.parametrize("name", sorted(PRESET_SHAPES))
def test_preset_shapes(name):
    assert name in PRESETS
    cfg = preset_config(name)
    shape = (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
             ModelGeometry.from_config(cfg, "bfloat16").head_dim, cfg.intermediate_size, cfg.vocab_size)
    assert shape == PRESET_SHAPES[name]


def test_a_folders_context_is_its_config_json(tmp_path):
    tiny_model("qwen3").config.save_pretrained(tmp_path / "ckpt")
    assert context_for(str(tmp_path / "ckpt")) == TINY_MAX_POSITIONS
    (tmp_path / "ckpt" / "config.json").write_text('{"model_type": "qwen3"}')
    assert context_for(str(tmp_path / "ckpt")) is None  # none given: no context to check against
    (tmp_path / "ckpt" / "config.json").write_text("[1, 2]")
    for read in (context_for, geometry_for):
        with pytest.raises(ValueError, match=r"config.json holds a JSON list, not a config \(a JSON object\)"):
            read(str(tmp_path / "ckpt"))
    with pytest.raises(ValueError, match="unknown preset 'qwen9'; expected one of .*'qwen2.5-3b'"):
        context_for("qwen9")


def test_qwen3_32b_builds_on_meta_with_the_right_size():
    model = from_preset("qwen3-32b", dtype=torch.bfloat16, device="meta")
    assert abs(sum(p.numel() for p in model.parameters()) / 1e9 - 32.76) < 0.01
    assert hasattr(model.model.layers[0].self_attn, "q_norm")  # Qwen3's q/k norm


@pytest.mark.slow
def test_preset_random_weights_are_finite_in_bf16():
    model = from_preset("qwen2.5-0.5b", dtype=torch.bfloat16, device="cpu", num_hidden_layers=2)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied
    assert model.model.layers[0].self_attn.q_proj.bias is not None  # Qwen2's qkv bias
    inv_freq = model.model.rotary_emb.inv_freq
    assert torch.isfinite(inv_freq).all() and inv_freq[0] == 1.0
    with torch.no_grad():
        logits = model(torch.randint(0, 151936, (2, 16))).logits
    assert torch.isfinite(logits).all() and logits.float().std() > 0


def test_load_pretrained_round_trip(tmp_path):
    model = tiny_model("llama")
    model.save_pretrained(tmp_path)
    loaded = load_pretrained(tmp_path, dtype=torch.float32)
    ids = torch.tensor([[4, 5, 6]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits)


def test_a_checkpoint_folder_gets_the_loaders_checks(tmp_path):
    """load_model's and model_config's folders go through engine.api.loading, as
    Rollout.from_pretrained's do: a folder without safetensors weights, or a file, is refused by name
    before any weights are read."""
    model = tiny_model("qwen2")
    model.config.save_pretrained(tmp_path / "no-weights")
    (tmp_path / "no-weights" / "pytorch_model.bin").write_bytes(b"")
    for check in (model_config, load_model):
        with pytest.raises(ValueError, match="'.*no-weights' has no safetensors weights .*pytorch_model.bin"):
            check(str(tmp_path / "no-weights"))
    (tmp_path / "file").write_text("{}")
    with pytest.raises(ValueError, match="'.*file' is a file, not a model folder; expected a folder"):
        load_model(str(tmp_path / "file"))


def test_a_model_goes_by_the_name_load_model_gives_it(tmp_path):
    """The name a cost file is checked against (engine.model_info.model_name_of) is the one load_model
    and the CLI give: tiny-<family>, the preset, a checkpoint folder's own name (issue 36)."""
    tiny_model("qwen2").save_pretrained(tmp_path / "my-checkpoint")
    for spec in ("tiny-qwen2", "tiny-opt", str(tmp_path / "my-checkpoint")):
        model, name = load_model(spec)
        assert model_name_of(model) == name, spec
    preset = from_preset("qwen3-32b", dtype=torch.bfloat16, device="meta")
    assert model_name_of(preset) == "qwen3-32b"
