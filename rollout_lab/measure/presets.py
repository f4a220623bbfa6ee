"""The real architectures we emulate with random weights, by name: one table for the models, the CLI
and the cost model's geometry. Pure data, no torch, so ``rollout-lab plan --preset`` stays fast.

    geometry_for("qwen2.5-3b", "bfloat16")   # ModelGeometry(36, 16, 2, 128, 2)
    context_for("qwen2.5-3b")                # 32768 positions
    from rollout_lab.measure.models import from_preset   # builds the model itself (torch)
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from rollout_lab.planner.cost import ModelGeometry

# hidden / layers / heads / kv heads / head_dim / intermediate / context from the published configs
# (measure.models adds what the Qwen ones share: vocabulary, norms, rope, special tokens; a preset's
# own value of those wins, as Llama's do)
PRESETS: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": dict(
        family="qwen2", hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, intermediate_size=4864, tie_word_embeddings=True,
        max_position_embeddings=32768,
    ),
    "qwen2.5-3b": dict(
        family="qwen2", hidden_size=2048, num_hidden_layers=36, num_attention_heads=16,
        num_key_value_heads=2, intermediate_size=11008, tie_word_embeddings=True,
        max_position_embeddings=32768,
    ),
    "qwen3-0.6b": dict(
        family="qwen3", hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, intermediate_size=3072, tie_word_embeddings=True,
        max_position_embeddings=40960,
    ),
    "qwen3-32b": dict(
        family="qwen3", hidden_size=5120, num_hidden_layers=64, num_attention_heads=64,
        num_key_value_heads=8, head_dim=128, intermediate_size=25600, tie_word_embeddings=False,
        max_position_embeddings=40960,
    ),
    # Llama-3.2-1B's geometry (issue 54's many-samples shape): its own vocabulary, rope and special ids
    "llama-3.2-1b": dict(
        family="llama", hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, intermediate_size=8192, tie_word_embeddings=True,
        max_position_embeddings=131072, vocab_size=128256, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        bos_token_id=128000, eos_token_id=128001, pad_token_id=128004,
    ),
}


def model_name(model: str) -> str:
    """The name a model goes by in file names and provenance: a checkpoint folder's own name, else
    ``model`` as given (a preset, "tiny-<family>")."""
    return Path(model).name if Path(model).is_dir() else model


def geometry_for(preset: str, dtype: str = "float32") -> ModelGeometry:
    """The cost model's geometry, with ``dtype`` KV elements, of a named preset or of a local
    checkpoint folder (only its ``config.json`` is read: no weights, no torch)."""
    return ModelGeometry.from_config(SimpleNamespace(**_config_of(preset)), dtype)


def context_for(preset: str) -> int | None:
    """The context (``max_position_embeddings``, positions) of a named preset or of a local checkpoint
    folder (its ``config.json``, no torch); None where the folder's config gives none."""
    context = _config_of(preset).get("max_position_embeddings")
    return context if isinstance(context, int) and not isinstance(context, bool) and context > 0 else None


def _config_of(preset: str) -> dict[str, Any]:
    """The config fields of a named preset, or of a checkpoint folder's decoder (its ``config.json``);
    a ValueError naming ``preset`` and what would be valid."""
    if preset in PRESETS:
        return PRESETS[preset]
    path = Path(preset)
    if path.is_dir():
        config = path / "config.json"
        if not config.is_file():
            raise ValueError(f"checkpoint folder {preset!r} has no config.json")
        try:
            data = json.loads(config.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ValueError(f"{config} is not a readable JSON config: {err}") from None
        if not isinstance(data, dict):
            raise ValueError(f"{config} holds a JSON {type(data).__name__}, not a config (a JSON object)")
        if isinstance(data.get("text_config"), dict):  # multimodal: the decoder's
            data = data["text_config"]
        return data
    if path.exists():
        raise ValueError(f"{preset!r} is a file, not a checkpoint folder; expected a folder with config.json "
                         f"or a preset, one of {sorted(PRESETS)}")
    if _looks_like_path(preset):
        raise ValueError(f"no model folder at {preset!r}; expected a checkpoint folder (with config.json) "
                         f"or a preset, one of {sorted(PRESETS)}")
    raise ValueError(f"unknown preset {preset!r}; expected one of {sorted(PRESETS)} or a checkpoint folder")


def _looks_like_path(name: str) -> bool:
    """Whether ``name`` reads as a filesystem path (a separator, or a leading "." or "~") rather than a
    preset's name, which has neither."""
    return any(sep in name for sep in (os.sep, os.altsep) if sep) or name.startswith((".", "~"))
