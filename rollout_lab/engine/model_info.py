"""The setting a measurement depends on, read from a live model: its geometry, dtype, device,
attention implementation, the library versions and the TF32 mode (``model_metadata``).

    model_metadata(model)["device_name"]    # "NVIDIA H200", or the CPU's processor name
    model_name_of(model)                    # "Qwen2.5-3B" (loaded from that folder), or "qwen2-2L-64h"

A cost file measured in one setting is checked against another through ``planner.cost.CostFile.check``
with this dict; calibration records it as the file's provenance (``measure.calibrate.run_metadata``).
"""
from __future__ import annotations

import platform
from pathlib import Path
from typing import Any

import torch
import transformers

from rollout_lab.planner.cost import ModelGeometry, setting_metadata


def device_name(device: torch.device) -> str:
    """The GPU's name on CUDA, else the host's processor."""
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine()


def model_name_of(model: torch.nn.Module) -> str:
    """The name ``model`` goes by where none is given (a calibration's provenance, the model a cost
    file is checked against): the checkpoint it was loaded from, by the folder's own name as the CLI
    names ``--model`` (HF records it as ``config.name_or_path``), else its family and size
    ("qwen2-2L-64h") for a model built from a config. Setting ``model.config.name_or_path`` names it."""
    config = model.config
    loaded = getattr(config, "name_or_path", "") or ""
    if loaded:
        return Path(loaded).name or loaded
    return f"{config.model_type}-{config.num_hidden_layers}L-{config.hidden_size}h"


def model_metadata(model: torch.nn.Module, *, model_name: str | None = None,
                   prefill_graphs: bool | None = None) -> dict[str, Any]:
    """Every field of ``planner.cost.CHECKED_FIELDS`` for ``model`` as it is now (its parameters'
    dtype and device); ``model_name`` only when given (callers that check a cost file give
    ``model_name_of(model)`` or the name they loaded it by), and ``prefill_graphs``
    (``setting_metadata``'s) only when given too."""
    param = next(model.parameters())
    info = setting_metadata(geometry=ModelGeometry.from_config(model.config, param.dtype), dtype=param.dtype,
                            model_name=model_name, device_type=param.device.type, prefill_graphs=prefill_graphs)
    info["device_name"] = device_name(param.device)
    info["attn_implementation"] = getattr(model.config, "_attn_implementation", None)
    info["torch"] = torch.__version__
    info["transformers"] = transformers.__version__
    info["tf32_matmul"] = bool(torch.backends.cuda.matmul.allow_tf32)
    return info
