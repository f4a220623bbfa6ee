"""Models to roll out: tiny random ones for tests, real architectures with random weights, checkpoints.

    from rollout_lab.measure.models import tiny_model, from_preset
    model = tiny_model("qwen3")                                   # 2 layers, fp32, CPU, no download
    model = from_preset("qwen2.5-3b", dtype=torch.bfloat16, device="cuda")  # real shapes, random weights

Random weights give honest timings (shapes decide speed) but not natural EOS behaviour.

"""
from __future__ import annotations

import os
from typing import Any

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, OPTConfig, Qwen2Config, Qwen3Config

from rollout_lab.engine.api.loading import check_model, load_model_and_tokenizer
from rollout_lab.measure.presets import PRESETS, model_name

TINY_VOCAB_SIZE = 384
TINY_MAX_POSITIONS = 512
TINY_FAMILIES = ("qwen2", "qwen3", "llama", "opt")

_TINY_COMMON = dict(
    vocab_size=TINY_VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=TINY_MAX_POSITIONS,
    pad_token_id=0,
    bos_token_id=None,
    eos_token_id=None,
    tie_word_embeddings=False,
)
_PRESET_COMMON = dict(
    vocab_size=151936, rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    bos_token_id=151643, eos_token_id=151645, pad_token_id=151643,
)
_CONFIG_CLASSES = {"qwen2": Qwen2Config, "qwen3": Qwen3Config, "llama": LlamaConfig}


def tiny_config(family: str, num_layers: int = 2) -> Any:
    """The config of a hidden-64 model of ``family``, ``num_layers`` decoder layers deep (2 unless
    a check needs a real model's depth, as the layer-wise compile's do)."""
    if family == "opt":
        return OPTConfig(
            vocab_size=TINY_VOCAB_SIZE, hidden_size=64, ffn_dim=128, num_hidden_layers=num_layers,
            num_attention_heads=4, max_position_embeddings=TINY_MAX_POSITIONS,
            word_embed_proj_dim=64, do_layer_norm_before=True, pad_token_id=0,
            bos_token_id=None, eos_token_id=None, dropout=0.0, tie_word_embeddings=False,
        )
    if family not in _CONFIG_CLASSES:
        raise ValueError(f"unknown tiny model family {family!r}; expected one of {list(TINY_FAMILIES)}")
    extra = {"head_dim": 16} if family == "qwen3" else {}
    return _CONFIG_CLASSES[family](**(_TINY_COMMON | {"num_hidden_layers": num_layers}), **extra)


def tiny_model(
    family: str,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "sdpa",
) -> torch.nn.Module:
    """A tiny randomly initialised causal LM of ``family`` (qwen2, qwen3, llama, opt), in eval mode."""
    config = tiny_config(family)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    with torch.no_grad():
        # HF's default std 0.02 gives near-flat logits; a wider init makes greedy paths varied
        for name, param in model.named_parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.2)
    _clear_generation_defaults(model)
    # named as load_model and the CLI name it: a cost file is checked against this name
    # (engine.model_info.model_name_of reads it back, as it reads a checkpoint's folder)
    model.config.name_or_path = f"tiny-{family}"
    return model.eval()


def from_preset(
    name: str,
    *,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    attn_implementation: str = "sdpa",
    num_hidden_layers: int | None = None,
    seed: int = 0,
) -> torch.nn.Module:
    """A real architecture with random weights, built on 'meta' and materialised on ``device``.

    ``num_hidden_layers`` overrides the depth (for quick checks of a big preset).
    """
    config = preset_config(name, num_hidden_layers=num_hidden_layers)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    model.to_empty(device=device)
    _init_random_(model, seed=seed)
    _clear_generation_defaults(model)
    model.config.name_or_path = name  # as tiny_model: the name a cost file is checked against
    return model.eval()


def preset_config(name: str, *, num_hidden_layers: int | None = None) -> Any:
    """The Hugging Face config of preset ``name`` (optionally with fewer layers)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; expected one of {sorted(PRESETS)}")
    spec = dict(PRESETS[name])
    family = spec.pop("family")
    spec = {**_PRESET_COMMON, **spec}
    if num_hidden_layers is not None:
        spec["num_hidden_layers"] = num_hidden_layers
    return _CONFIG_CLASSES[family](**spec)


def load_pretrained(
    path: str | os.PathLike,
    *,
    dtype: torch.dtype | str = "auto",
    device: str | torch.device = "cpu",
) -> torch.nn.Module:
    """A local checkpoint folder (no hub access), in eval mode, loaded as ``Rollout.from_pretrained``
    loads it (``engine.api.loading``: safetensors only, no code from the checkpoint, the same checks
    and messages); ``dtype`` "auto" is the checkpoint's own."""
    return load_model_and_tokenizer(path, dtype=dtype, device=device, tokenizer=False, hub=False)[0]


@torch.no_grad()
def _init_random_(model: torch.nn.Module, *, seed: int) -> None:
    """Cheap in-place init on the model's device: N(0, 0.02) matrices, unit norms, zero biases."""
    device = next(model.parameters()).device
    if device.type == "meta":
        return
    generator = torch.Generator(device=device).manual_seed(seed)
    for name, param in model.named_parameters():
        if param.dim() >= 2:
            param.normal_(0.0, 0.02, generator=generator)
        elif "norm" in name or "layernorm" in name:
            param.fill_(1.0)
        else:
            param.zero_()
    # non-persistent buffers (rotary inv_freq) were left uninitialised by to_empty: rebuild them
    for module in model.modules():
        if hasattr(module, "inv_freq") and hasattr(module, "config"):
            fresh = type(module)(module.config)
            for buffer_name, buffer in fresh.named_buffers(recurse=False):
                setattr(module, buffer_name, buffer.to(device))
    if hasattr(model, "tie_weights"):
        model.tie_weights()


def _clear_generation_defaults(model: torch.nn.Module) -> None:
    """Random models have no natural EOS: keep ``generate`` from stopping on a config default."""
    gen = getattr(model, "generation_config", None)
    if gen is not None:
        gen.eos_token_id = None
        gen.bos_token_id = None


# ---------------------------------------------------------------- what the notebooks call

def special_token_ids(config: Any) -> list[int]:
    """PAD, EOS and BOS ids of a model config (those that are set): never drawn into random prompts."""
    ids = (getattr(config, "pad_token_id", None), getattr(config, "eos_token_id", None),
           getattr(config, "bos_token_id", None))
    return [t for t in ids if isinstance(t, int)]


def model_config(model: str) -> tuple[Any, str]:
    """(config, name) of ``model`` as ``load_model`` would build and name it, without any weights: for
    the checks made before a model is loaded (its context, its geometry)."""
    if model.startswith("tiny-"):
        return tiny_config(model[len("tiny-"):]), model
    if model in PRESETS:
        return preset_config(model), model
    if os.path.exists(model):  # a folder gets the loader's checks; a file, its message
        return check_model(model, hub=False)[1], model_name(model)
    raise ValueError(
        f"model must be 'tiny-<family>' ({', '.join(TINY_FAMILIES)}), a preset "
        f"({', '.join(sorted(PRESETS))}) or a checkpoint folder; got {model!r}"
    )


def load_model(model: str, *, dtype: str = "float32", device: str = "cpu") -> tuple[Any, str]:
    """(model, name) for ``model`` = "tiny-<family>", a preset name, or a local checkpoint folder."""
    if not hasattr(torch, dtype) or not isinstance(getattr(torch, dtype), torch.dtype):
        raise ValueError(f"dtype must name a torch dtype such as float32 or bfloat16, got {dtype!r}")
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but CUDA is not available here; use device='cpu'")
    torch_dtype = getattr(torch, dtype)
    _, name = model_config(model)  # a bad name is an error before any weights are built
    if model.startswith("tiny-"):
        return tiny_model(model[len("tiny-"):], dtype=torch_dtype).to(device), name
    if model in PRESETS:
        return from_preset(model, dtype=torch_dtype, device=device), name
    return load_pretrained(model, dtype=torch_dtype, device=device), name
