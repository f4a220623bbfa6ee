"""Prefill cost model C(B, L) and the model geometry it needs.

    C(B, L) = fixed + token * B*L + attention * attn_GFLOPs(B, L) + kv * KV_MiB(B, L)

and for a packed forward of prompts L_1..L_n (``packed_prefill_cost_ms``):

    P(L_1..L_n) = fixed + packed_fixed + sum_i [C(1, L_i) - fixed] + packed_prompt * n

Every term is linear in the batch B, so C(B, L) = fixed + B * per_row_cost_ms(L); the planner
relies on that. Pure Python: no torch import (``ModelGeometry.from_config`` takes any dtype-like).

A cost file (``CostCoefficients.to_json``) is read by ``CostFile.read`` (JSON only, size-limited) and
used only after ``CostFile.check`` finds its provenance (``CHECKED_FIELDS``) equal to the setting's:

    CostFile.read(path).check(setting_metadata(geometry=g, dtype="bfloat16", model_name="qwen3-32b"))

"""
from __future__ import annotations

import math
import re
import warnings
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Mapping, Sequence

from rollout_lab.workspace import read_json_file, write_json_atomic

MIB = float(2**20)
MAX_COEFFICIENT = 1e12  # ms per unit; far past any device, and the sums of the model stay finite


@dataclass(frozen=True)
class CostCoefficients:
    """Coefficients of the prefill cost model, in milliseconds (defaults: the reference's).

    The reference prices CB decode as an overhead over nocb's (``nocb_decode_cost_ms = 0``). With a
    graph-captured CB decode that is faster than HF's own loop the overhead would be negative, so a
    calibration may instead give both decode costs per step, each >= 0. Shared prefill (several
    samples of one prompt) prefills the prompt once and copies its KV into the other samples' slots,
    priced by ``prefill_replicate_cost_ms`` per MiB copied (0 by default: the reference has none).
    """

    prefill_fixed_cost_ms: float = 25.0
    prefill_token_cost_ms: float = 0.1  # per padded token
    prefill_attention_cost_ms: float = 0.01  # per attention GFLOP
    prefill_kv_cost_ms: float = 0.04  # per MiB of KV written
    continuous_decode_cost_ms: float = 10.0  # CB decode cost per remaining step (over nocb's)
    nocb_decode_cost_ms: float = 0.0  # nocb's own decode cost per remaining step
    prefill_replicate_cost_ms: float = 0.0  # per MiB of KV copied from a shared prefill row
    prefill_max_tokens: int | None = 65536  # padded positions per forward; None = no limit
    # the packed route (planner.packing): what one prompt adds to a packed forward beyond the shared
    # terms (its own attention call, its KV scatter). None = not calibrated: Auto does not consider
    # packed (mode="packed" still runs, priced with 0); a calibration measures and fits it
    packed_prompt_cost_ms: float | None = None
    # what a packed forward adds to the fixed cost: the padded forwards' fixed cost may be a graph
    # replay's while the packed forward runs eagerly, several times dearer
    # (data/calibration/qwen2.5-3b_bfloat16_cuda_compiled-graphs_refit.json)
    packed_fixed_cost_ms: float = 0.0
    # what a paged decode step (block-table attention, engine.kv.paged) adds over an aligned one;
    # 0 = not measured (a calibration with CalibrationGrid(paged_decode=True) measures it)
    paged_decode_cost_ms: float = 0.0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "packed_prompt_cost_ms" and value is None:
                continue
            if f.name == "prefill_max_tokens":
                if value is None:
                    continue
                if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                    raise ValueError(
                        f"prefill_max_tokens must be a positive int or None, got {value!r}"
                    )
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{f.name} must be a number, got {value!r}")
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{f.name} must be finite and >= 0, got {value!r}")
            if value > MAX_COEFFICIENT:
                raise ValueError(f"{f.name}={value!r} is over {MAX_COEFFICIENT:g} ms per unit: costs built "
                                 "from it overflow; measure the coefficients (rollout-lab calibrate)")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "CostCoefficients":
        names = {f.name for f in fields(cls)}
        optional = {"packed_prompt_cost_ms", "packed_fixed_cost_ms",  # added later: older files lack them
                    "paged_decode_cost_ms"}
        unknown = sorted(set(data) - names)
        missing = sorted(names - set(data) - optional)
        if unknown or missing:
            raise ValueError(
                f"cost coefficients: unknown keys {unknown}, missing keys {missing}; "
                f"expected exactly {sorted(names)}"
            )
        return cls(**dict(data))

    def to_json(self, path: str | os.PathLike, metadata: Mapping[str, Any] | None = None) -> Path:
        """Write ``{"coefficients": ..., "metadata": ...}`` atomically."""
        return write_json_atomic(
            path, {"coefficients": self.to_dict(), "metadata": dict(metadata or {})}
        )

    @classmethod
    def from_json(cls, path: str | os.PathLike, *, expected: Mapping[str, Any],
                  override: bool = False) -> "CostCoefficients":
        """The coefficients of a cost file whose provenance agrees with ``expected`` (the setting
        in use: ``setting_metadata``, or ``engine.model_info.model_metadata`` of a live model);
        ``CostFile.read`` then ``CostFile.check``."""
        return CostFile.read(path).check(expected, override=override)


# -- cost files: read with limits, then checked against the setting they are used in --------------

# how a caller accepts a file of another setting, named for every layer the mismatch reaches: this
# module's and load_calibration's keyword, RolloutConfig's and the notebooks' field, and the flag of
# the commands that read --costs (plan, sweep, bench grpo and prefill-routes)
OVERRIDE_HINT = ("or use it anyway: override=True (override_costs=True in RolloutConfig and the notebooks, "
                 "--override-costs beside a command's --costs)")

MAX_COST_FILE_BYTES = 10 * 2**20  # a calibration with its fit is ~100 KiB; refuse anything absurd
# The provenance fields that must agree between a cost file and the setting that uses it:
# coefficients measured on another model, dtype, device or library would steer the planner wrongly
# without any error.
CHECKED_FIELDS = (
    "model_name", "geometry", "dtype", "device_type", "device_name", "attn_implementation",
    "torch", "transformers", "tf32_matmul",
)
# How the calibration ran its prefill forwards (its grid, written by `rollout-lab calibrate`) against
# how the setting runs them, checked where the setting says: a calibration of eager forwards prices a
# captured forward's fixed cost several times too high (data/calibration/qwen2.5-3b_bfloat16_cuda.json,
# eager, against qwen2.5-3b_bfloat16_cuda_notebook-01.json, captured), and the DP then merges buckets
# it should keep apart. A grid without the key predates it: the default.
CHECKED_GRID_FIELDS = {"prefill_graphs": False}


@dataclass(frozen=True)
class CostFile:
    """A cost file as written by ``CostCoefficients.to_json``: its coefficients and its provenance.

    Only JSON is read (never pickle), at most ``MAX_COST_FILE_BYTES``; every malformed part is a
    ValueError naming the file and the field. ``check`` is the one provenance check of the project.
    """

    path: Path
    costs: CostCoefficients
    metadata: Mapping[str, Any]

    @classmethod
    def read(cls, path: str | os.PathLike) -> "CostFile":
        path = Path(path)
        where = f"cost file {str(path)!r}"
        data = read_json_file(path, what="cost file", max_bytes=MAX_COST_FILE_BYTES)
        if not isinstance(data, dict) or set(data) - {"coefficients", "metadata"} or "coefficients" not in data:
            keys = sorted(data) if isinstance(data, dict) else type(data).__name__
            raise ValueError(f"{where} must hold an object with keys 'coefficients' and 'metadata', got {keys}")
        coefficients, metadata = data["coefficients"], data.get("metadata", {})
        if not isinstance(coefficients, dict):
            raise ValueError(f"{where}: 'coefficients' must be an object, got {coefficients!r}")
        if metadata is None:
            metadata = {}
        if not isinstance(metadata, dict):
            raise ValueError(f"{where}: 'metadata' must be an object, got {metadata!r}")
        try:
            costs = CostCoefficients.from_dict(coefficients)
        except (TypeError, ValueError) as err:
            raise ValueError(f"{where}: {err}") from None
        return cls(path, costs, metadata)

    def check(self, expected: Mapping[str, Any], *, override: bool = False) -> CostCoefficients:
        """The coefficients, if the file's provenance agrees with ``expected`` on every checked field
        ``expected`` holds (torch and transformers a patch release apart: with a warning); else a
        ValueError naming each differing field (a file without metadata differs in all of them).
        ``override=True`` accepts the file as it is."""
        if override:
            return self.costs
        diffs = metadata_mismatches(self.metadata, expected)
        if not diffs:
            patches = patch_differences(self.metadata, expected)
            if patches:  # the same minor release: the kernels a calibration timed are the same ones
                warnings.warn(f"cost file {str(self.path)!r} was calibrated with " + ", ".join(
                    f"{k} {v[0]}" for k, v in patches.items()) + "; this setting runs " + ", ".join(
                    f"{k} {v[1]}" for k, v in patches.items()) + " (a patch release apart: used as it is)",
                    stacklevel=2)
            return self.costs
        where = f"cost file {str(self.path)!r}"
        if not any(name in self.metadata for name in CHECKED_FIELDS):
            raise ValueError(f"{where} has no provenance metadata ({', '.join(sorted(diffs))} unknown), so "
                             "it cannot be checked against this setting; recalibrate with `rollout-lab "
                             f"calibrate`, {OVERRIDE_HINT}")
        detail = "; ".join(f"{k}: file has {v[0]!r}, this setting has {v[1]!r}" for k, v in diffs.items())
        graphs = " --prefill-graphs" if diffs.get("prefill_graphs", (None, False))[1] else ""
        raise ValueError(f"{where} was calibrated for a different setting ({detail}); recalibrate with "
                         f"`rollout-lab calibrate{graphs}`, {OVERRIDE_HINT}")


# library versions whose patch releases (x.y.Z, and local tags such as +cu130) keep a cost file valid
PATCH_TOLERANT_FIELDS = ("torch", "transformers")


def release_of(version: Any) -> tuple[int, ...] | None:
    """(major, minor) of a version string such as "2.11.0+cu130" or "5.17.0.dev0"; None if unparsable."""
    parts = re.match(r"^\s*(\d+)\.(\d+)", str(version))
    return None if parts is None else (int(parts[1]), int(parts[2]))


def patch_differences(saved: Mapping[str, Any], expected: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """{field: (saved, expected)} for the library versions that differ only below their minor release."""
    out = {}
    for name in PATCH_TOLERANT_FIELDS:
        if name in expected and name in saved and saved[name] != expected[name]:
            same = release_of(saved[name])
            if same is not None and same == release_of(expected[name]):
                out[name] = (saved[name], expected[name])
    return out


def metadata_mismatches(saved: Mapping[str, Any], expected: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """{field: (saved, expected)} for every checked field present in ``expected`` that differs; the
    grid fields (``CHECKED_GRID_FIELDS``) only when ``saved`` has a grid (a calibration's). A library
    version that differs only in its patch release is not a mismatch (``patch_differences``)."""
    patches = patch_differences(saved, expected)
    diffs = {
        name: (saved.get(name, "<missing>"), expected[name])
        for name in CHECKED_FIELDS
        if name in expected and saved.get(name, "<missing>") != expected[name] and name not in patches
    }
    grid = saved.get("grid")
    if isinstance(grid, Mapping):
        for name, default in CHECKED_GRID_FIELDS.items():
            if name in expected and grid.get(name, default) != expected[name]:
                diffs[name] = (grid.get(name, default), expected[name])
    return diffs


def setting_metadata(
    *, geometry: "ModelGeometry | None" = None, dtype: Any = None, model_name: str | None = None,
    device_type: str | None = None, prefill_graphs: bool | None = None,
) -> dict[str, Any]:
    """The checked fields a setting without a live model knows (``plan``: a preset's geometry, its
    dtype and name, the device type; whether it captures its prefill forwards, checked against a
    calibration's grid), shaped as a cost file's metadata records them."""
    known: dict[str, Any] = {}
    if model_name is not None:
        known["model_name"] = model_name
    if geometry is not None:
        known["geometry"] = asdict(geometry)
    if dtype is not None:
        known["dtype"] = str(dtype).replace("torch.", "")
    if device_type is not None:
        known["device_type"] = str(device_type).split(":")[0]
    if prefill_graphs is not None:
        known["prefill_graphs"] = bool(prefill_graphs)
    return known


_DTYPE_BYTES = {
    "float32": 4, "float": 4, "fp32": 4, "float16": 2, "half": 2, "fp16": 2,
    "bfloat16": 2, "bf16": 2, "float64": 8, "double": 8, "float8_e4m3fn": 1, "float8_e5m2": 1,
}


def dtype_bytes(dtype: Any) -> int:
    """Bytes per element of a torch dtype, numpy dtype or dtype name."""
    size = getattr(dtype, "itemsize", None)
    if isinstance(size, int) and size > 0:
        return size
    name = str(dtype).replace("torch.", "")
    if name not in _DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(_DTYPE_BYTES)}")
    return _DTYPE_BYTES[name]


def check_pricing(geometry: object, costs: object) -> None:
    """ValueError naming ``geometry`` or ``costs`` unless they are a ``ModelGeometry`` and a
    ``CostCoefficients``, the two every planner function prices with."""
    if not isinstance(geometry, ModelGeometry):
        raise ValueError(f"geometry must be a ModelGeometry, got {geometry!r}")
    if not isinstance(costs, CostCoefficients):
        raise ValueError(f"costs must be a CostCoefficients (a cost file's: CostFile.read(path).check(...)), "
                         f"got {costs!r}")


@dataclass(frozen=True)
class ModelGeometry:
    """The shape facts of a decoder that the cost model needs."""

    num_layers: int
    num_query_heads: int
    num_kv_heads: int
    head_dim: int
    element_bytes: int

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelGeometry.{f.name} must be a positive int, got {value!r}")

    @classmethod
    def from_config(cls, hf_config: Any, dtype: Any) -> "ModelGeometry":
        """Read a Hugging Face config; an explicit ``head_dim`` wins over hidden / heads."""
        cfg = getattr(hf_config, "text_config", None) or hf_config
        layers = getattr(cfg, "num_hidden_layers", None)
        heads = getattr(cfg, "num_attention_heads", None)
        if layers is None or heads is None:
            raise ValueError("config needs num_hidden_layers and num_attention_heads")
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        return cls(int(layers), int(heads), int(kv_heads), int(head_dim), dtype_bytes(dtype))

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of one token's keys and values over every layer."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.element_bytes

    @classmethod
    def qwen25_3b(cls, element_bytes: int = 4) -> "ModelGeometry":
        """Qwen2.5-3B (36 layers, 16 query heads, 2 KV heads, head_dim 128): the worked example."""
        return cls(36, 16, 2, 128, element_bytes)


def attention_gflops(batch: int, width: int, geometry: ModelGeometry) -> float:
    """4 * B * L^2 * layers * query_heads * head_dim / 1e9."""
    g = geometry
    return 4.0 * batch * width * width * g.num_layers * g.num_query_heads * g.head_dim / 1e9


def kv_mib(batch: int, width: int, geometry: ModelGeometry) -> float:
    """2 * B * L * layers * kv_heads * head_dim * element_bytes / 2^20 (``kv_bytes_per_token``)."""
    return float(batch * width * geometry.kv_bytes_per_token) / MIB


def prefill_cost_ms(
    batch: int,
    width: int,
    geometry: ModelGeometry,
    costs: CostCoefficients,
    include_kv: bool = True,
) -> float:
    """Estimated time of one left-padded prefill forward of ``batch`` rows of ``width`` tokens."""
    if batch <= 0:
        return 0.0
    return costs.prefill_fixed_cost_ms + batch * per_row_cost_ms(
        width, geometry, costs, include_kv=include_kv
    )


def packed_prefill_cost_ms(
    lengths: Sequence[int], geometry: ModelGeometry, costs: CostCoefficients
) -> float:
    """Estimated time of one packed forward of ``lengths`` (one row of sum(lengths) tokens, each
    prompt attending to itself): fixed + packed_fixed + token * sum(L) + attention * sum attn(1, L_i)
    + kv * sum KV(1, L_i) + packed_prompt * n."""
    if not lengths:
        return 0.0
    per_prompt = costs.packed_prompt_cost_ms or 0.0
    return costs.prefill_fixed_cost_ms + costs.packed_fixed_cost_ms + sum(
        per_row_cost_ms(length, geometry, costs) + per_prompt for length in lengths)


def per_row_cost_ms(
    width: int, geometry: ModelGeometry, costs: CostCoefficients, *, include_kv: bool = True
) -> float:
    """The part of C(B, L) that one row of width L adds: (C(B, L) - fixed) / B."""
    cost = costs.prefill_token_cost_ms * width
    cost += costs.prefill_attention_cost_ms * attention_gflops(1, width, geometry)
    if include_kv:
        cost += costs.prefill_kv_cost_ms * kv_mib(1, width, geometry)
    return cost
