"""A calibration's metadata: what it was measured on, and the check that a cost file fits this run.

    from rollout_lab.calibrate_meta import load_calibration, metadata_mismatches, run_metadata
    info = run_metadata(model, model_name="tiny-qwen2")   # the checked fields plus provenance
    coeffs = load_calibration(path, model=model)          # ValueError naming the fields that differ

The fields in ``CHECKED_FIELDS`` (model, geometry, dtype, device, attention implementation, library
versions, TF32) must agree between a cost file and the run that loads it: coefficients measured on
another setting would steer the planner wrongly without any error.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping

from rollout_lab.cost import CostCoefficients, ModelGeometry, read_cost_file

# Metadata fields that must agree between a cost file and the run that loads it.
CHECKED_FIELDS = (
    "model_name", "geometry", "dtype", "device_name", "attn_implementation",
    "torch", "transformers", "tf32_matmul",
)


def run_metadata(model: Any, *, dtype: Any = None, device: Any = None, model_name: str | None = None) -> dict[str, Any]:
    """The checked fields (see ``CHECKED_FIELDS``) plus provenance, for the current process."""
    import torch

    from rollout_lab.provenance import provenance

    param = next(model.parameters())
    dtype = param.dtype if dtype is None else dtype
    device = param.device if device is None else torch.device(device)
    info = provenance(device=device, dtype=dtype)
    info["model_name"] = model_name or _default_model_name(model)
    info["geometry"] = dataclasses.asdict(ModelGeometry.from_config(model.config, dtype))
    info["attn_implementation"] = getattr(model.config, "_attn_implementation", None)
    info["tf32_matmul"] = bool(torch.backends.cuda.matmul.allow_tf32)
    info["float32_matmul_precision"] = torch.get_float32_matmul_precision()
    return info


def _default_model_name(model: Any) -> str:
    config = model.config
    return getattr(config, "name_or_path", "") or f"{config.model_type}-{config.num_hidden_layers}L-{config.hidden_size}h"


def metadata_mismatches(saved: Mapping[str, Any], current: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """{field: (saved, current)} for every checked field present in ``current`` that differs."""
    return {
        name: (saved.get(name, "<missing>"), current[name])
        for name in CHECKED_FIELDS
        if name in current and saved.get(name, "<missing>") != current[name]
    }


def load_calibration(
    path: str | os.PathLike,
    *,
    model: Any = None,
    dtype: Any = None,
    device: Any = None,
    model_name: str | None = None,
    override: bool = False,
) -> CostCoefficients:
    """Coefficients of a cost file, after checking its metadata against this run.

    Without ``model`` only what is known is checked: library versions, and dtype/device when given.
    A mismatch raises ValueError naming each differing field; ``override=True`` accepts it.
    """
    coeffs, saved = read_cost_file(path)
    if model is not None:
        current = run_metadata(model, dtype=dtype, device=device, model_name=model_name)
        if model_name is None:
            current.pop("model_name")  # a default name is a guess; geometry is checked instead
    else:
        current = _library_metadata(dtype=dtype, device=device)
        if model_name is not None:
            current["model_name"] = model_name
    diffs = metadata_mismatches(saved, current)
    if diffs and not override:
        detail = "; ".join(f"{k}: file has {v[0]!r}, this run has {v[1]!r}" for k, v in diffs.items())
        raise ValueError(
            f"cost file {str(path)!r} was calibrated for a different setting ({detail}). "
            "Recalibrate with `rollout-lab calibrate`, or pass override=True (--override-costs)."
        )
    return coeffs


def _library_metadata(*, dtype: Any, device: Any) -> dict[str, Any]:
    import torch

    from rollout_lab.provenance import provenance

    info = provenance(device=device)
    current = {"torch": info["torch"], "transformers": info["transformers"]}
    if device is not None:
        current["device_name"] = info["device_name"]
    if dtype is not None:
        current["dtype"] = str(dtype).replace("torch.", "")
    if device is not None and torch.device(device).type == "cuda":
        current["tf32_matmul"] = bool(torch.backends.cuda.matmul.allow_tf32)
    return current
