"""Calibrate the prefill cost model per model, device and dtype; save it with its provenance.

    rollout-lab calibrate --tiny qwen2 --out data/calibration/tiny-qwen2.json         # CPU, seconds
    rollout-lab calibrate --preset qwen2.5-3b --dtype bfloat16 --device cuda

    from rollout_lab.calibrate import calibrate, load_calibration, CalibrationGrid
    result = calibrate(model, grid=CalibrationGrid.tiny(), model_name="tiny-qwen2")
    result.r2, result.worst_rel_error; result.save(path)
    coeffs = load_calibration(path, model=model)   # ValueError naming the fields that differ

What is measured, with the engine's own code paths:
- ``forward_ms``: one prefill forward of a uniform (batch, width) bucket (``decode.prefill_bucket``);
- ``kv_copy_ms``: copying that bucket's KV into the aligned cache (``AlignedKVCache.admit``);
- CB and nocb decode per step, each from whole ``Rollout.generate`` calls with ``decode_steps + 1``
  and 1 new tokens; the decode coefficients come from them (``decode_costs``).
KV MiB is proportional to B*L, so ``token`` and ``kv`` cannot be told apart from forwards alone:
fixed/token/attention are fitted (NNLS, relative weights) to the forwards, and kv (plus the
copy's own per-call cost, added to ``fixed``) to the copies. The reported fit compares the sum
forward + copy with C(B, L). ``prefill_replicate_cost_ms`` (shared prefill's KV copies into the
other samples' slots, ``admit`` with ``source_rows``) is the same copy, so it takes kv's slope.

This module holds the result, the fit, ``calibrate()`` and the ``calibrate`` command; the grid and
the timed probes are in ``calibrate_measure``, the metadata check and ``load_calibration`` in
``calibrate_meta``, the model options shared with ``sweep`` in ``model_cli`` (all re-exported here).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from rollout_lab.calibrate_measure import (
    DEFAULT_MAX_BATCH_TOKENS, STATISTICS, CalibrationGrid, measure_decode_overhead, measure_prefill,
    timed_ms,
)
from rollout_lab.calibrate_meta import CHECKED_FIELDS, load_calibration, metadata_mismatches, run_metadata
from rollout_lab.cost import (
    CostCoefficients,
    ModelGeometry,
    attention_gflops,
    kv_mib,
    prefill_cost_ms,
    read_cost_file,
)
from rollout_lab.model_cli import (
    DTYPES, add_model_arguments, build_model, check_device, positive_int, resolve_model_arguments,
)
from rollout_lab.nnls import nnls

__all__ = [
    "CHECKED_FIELDS", "DEFAULT_MAX_BATCH_TOKENS", "DTYPES", "STATISTICS", "CalibrationGrid",
    "CalibrationResult", "add_model_arguments", "build_model", "calibrate", "check_device",
    "cmd_calibrate", "decode_costs", "default_calibration_path", "fit_coefficients", "load_calibration",
    "measure_decode_overhead", "measure_prefill", "metadata_mismatches", "r_squared", "register_cli",
    "resolve_model_arguments", "run_metadata", "timed_ms",
]



@dataclass(frozen=True)
class CalibrationResult:
    """Fitted coefficients, the run's metadata, and the fit per shape (JSON-ready dicts)."""

    coeffs: CostCoefficients
    metadata: dict[str, Any]
    fit: tuple[dict[str, Any], ...]  # batch, width, measured_ms, predicted_ms, rel_error, ...
    decode: tuple[dict[str, Any], ...] = field(default=())  # batch, nocb/cb ms per step, overhead
    r2: float = float("nan")

    @property
    def worst_rel_error(self) -> float:
        return max((abs(r["rel_error"]) for r in self.fit), default=float("nan"))

    def save(self, path: str | os.PathLike) -> Path:
        """Atomically write coefficients + metadata + fit (readable by ``read_cost_file``)."""
        metadata = dict(self.metadata)
        metadata["fit"] = {
            "r2": self.r2, "worst_rel_error": self.worst_rel_error,
            "shapes": list(self.fit), "decode": list(self.decode),
        }
        return self.coeffs.to_json(path, metadata=metadata)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "CalibrationResult":
        """Read a saved calibration back as a result (no metadata check: for plots and reports)."""
        coeffs, metadata = read_cost_file(path)
        fit = metadata.pop("fit", None) or {}
        return cls(coeffs, metadata, tuple(fit.get("shapes", ())), tuple(fit.get("decode", ())),
                   float(fit.get("r2", float("nan"))))


# -- fitting (pure numpy) ----------------------------------------------------------------------


def fit_coefficients(
    shapes: Sequence[tuple[int, int]],
    forward_ms: Sequence[float],
    kv_copy_ms: Sequence[float],
    geometry: ModelGeometry,
    *,
    continuous_decode_cost_ms: float,
    nocb_decode_cost_ms: float = 0.0,
    prefill_max_tokens: int | None = CostCoefficients.prefill_max_tokens,
) -> tuple[CostCoefficients, tuple[dict[str, Any], ...], float]:
    """NNLS fit of C(B, L) to measured forwards and KV copies: (coeffs, per-shape fit, R^2).

    Rows are divided by the measurement, so the fit minimises relative error: the small,
    launch-bound shapes (where the fixed cost decides the DP) count as much as the large ones.
    """
    forward = np.asarray(forward_ms, dtype=float)
    copy = np.asarray(kv_copy_ms, dtype=float)
    if not (len(shapes) == len(forward) == len(copy)) or len(shapes) < 3:
        raise ValueError(
            f"need >= 3 shapes with one forward and one copy time each, got {len(shapes)} shapes, "
            f"{len(forward)} forwards, {len(copy)} copies"
        )
    if not (np.all(forward > 0) and np.all(copy >= 0) and np.isfinite(forward).all() and np.isfinite(copy).all()):
        raise ValueError("measured times must be finite, forwards > 0 and copies >= 0")
    tokens = np.array([b * w for b, w in shapes], dtype=float)
    gflops = np.array([attention_gflops(b, w, geometry) for b, w in shapes])
    mib = np.array([kv_mib(b, w, geometry) for b, w in shapes])
    weights = 1.0 / forward
    fixed, token, attention = nnls(np.column_stack([np.ones_like(tokens), tokens, gflops]) * weights[:, None],
                                   forward * weights)
    copy_weights = 1.0 / np.maximum(copy, 1e-6 * max(copy.max(), 1e-9))
    copy_fixed, kv = nnls(np.column_stack([np.ones_like(mib), mib]) * copy_weights[:, None], copy * copy_weights)
    coeffs = CostCoefficients(
        prefill_fixed_cost_ms=float(fixed + copy_fixed), prefill_token_cost_ms=float(token),
        prefill_attention_cost_ms=float(attention), prefill_kv_cost_ms=float(kv),
        continuous_decode_cost_ms=float(max(0.0, continuous_decode_cost_ms)),
        nocb_decode_cost_ms=float(max(0.0, nocb_decode_cost_ms)),
        prefill_max_tokens=prefill_max_tokens,
        # shared prefill's replication is the same ``admit`` copy (from a repeated source row)
        prefill_replicate_cost_ms=float(kv),
    )
    records = []
    for (b, w), f_ms, c_ms in zip(shapes, forward, copy):
        measured = float(f_ms + c_ms)
        predicted = prefill_cost_ms(b, w, geometry, coeffs)
        records.append({
            "batch": b, "width": w, "measured_ms": measured, "predicted_ms": predicted,
            "rel_error": (predicted - measured) / measured,
            "forward_ms": float(f_ms), "kv_copy_ms": float(c_ms),
        })
    return coeffs, tuple(records), r_squared([r["measured_ms"] for r in records],
                                             [r["predicted_ms"] for r in records])


def r_squared(measured: Sequence[float], predicted: Sequence[float]) -> float:
    """1 - SS_res / SS_tot (nan when the measurements do not vary)."""
    y, p = np.asarray(measured, dtype=float), np.asarray(predicted, dtype=float)
    ss_tot = float(((y - y.mean()) ** 2).sum())
    return float("nan") if ss_tot == 0 else 1.0 - float(((y - p) ** 2).sum()) / ss_tot


def decode_costs(records: Sequence[Mapping[str, Any]]) -> tuple[float, float]:
    """(continuous_decode_cost_ms, nocb_decode_cost_ms) from the decode probe, each >= 0.

    When CB decode per step is slower than nocb's, the reference form: (CB - nocb, 0). When it is
    faster (a graph-captured CB step against HF's eager loop) the overhead would be negative, so
    both per-step costs are given and the planner compares them. No probe: (0, 0).
    """
    if not records:
        return 0.0, 0.0
    cb = max(0.0, statistics.mean(r["cb_ms_per_step"] for r in records))
    nocb = max(0.0, statistics.mean(r["nocb_ms_per_step"] for r in records))
    return (cb - nocb, 0.0) if cb >= nocb else (cb, nocb)


# -- the whole calibration ---------------------------------------------------------------------


def calibrate(
    model: Any,
    *,
    grid: CalibrationGrid | None = None,
    dtype: Any = None,
    device: Any = None,
    model_name: str | None = None,
    progress: bool = True,
) -> CalibrationResult:
    """Measure the grid on ``model`` (already on its device, in its dtype) and fit the coefficients.

    ``dtype``/``device`` default to the model's; when given they must match it.
    """
    import torch

    grid = CalibrationGrid() if grid is None else grid
    param = next(model.parameters())
    if dtype is not None and param.dtype != dtype:
        raise ValueError(f"dtype={dtype} but the model's parameters are {param.dtype}; convert the model first")
    if device is not None and torch.device(device).type != param.device.type:
        raise ValueError(f"device={device} but the model is on {param.device}; move the model first")
    metadata = run_metadata(model, dtype=param.dtype, device=param.device, model_name=model_name)
    metadata["grid"] = grid.to_dict()
    prefill = measure_prefill(model, grid, progress=progress)
    decode = measure_decode_overhead(model, grid, progress=progress)
    cb_ms, nocb_ms = decode_costs(decode)
    geometry = ModelGeometry(**metadata["geometry"])
    coeffs, fit, r2 = fit_coefficients(
        [(r["batch"], r["width"]) for r in prefill], [r["forward_ms"] for r in prefill],
        [r["kv_copy_ms"] for r in prefill], geometry,
        continuous_decode_cost_ms=cb_ms, nocb_decode_cost_ms=nocb_ms,
    )
    for record, measured in zip(fit, prefill):
        record["forward_samples_ms"] = measured["forward_samples_ms"]
        record["kv_copy_samples_ms"] = measured["kv_copy_samples_ms"]
    return CalibrationResult(coeffs, metadata, fit, tuple(decode), r2)


# -- CLI ---------------------------------------------------------------------------------------


def cmd_calibrate(args: argparse.Namespace) -> int:
    resolve_model_arguments(args)
    grid = CalibrationGrid.tiny() if args.grid == "tiny" else CalibrationGrid()
    if args.repeats is not None:
        grid = dataclasses.replace(grid, repeats=args.repeats)
    if args.max_batch_tokens is not None:
        grid = dataclasses.replace(grid, max_batch_tokens=args.max_batch_tokens)
    model, name = build_model(args)
    out = Path(args.out) if args.out else default_calibration_path(name, args.dtype, args.device)
    result = calibrate(model, grid=grid, model_name=name, progress=not args.no_progress)
    result.save(out)
    c = result.coeffs
    print(f"{name} {args.dtype} on {result.metadata.get('device_name')}: {len(result.fit)} shapes, "
          f"R^2 {result.r2:.4f}, worst relative error {result.worst_rel_error:.1%}")
    print(f"  fixed {c.prefill_fixed_cost_ms:.4g} ms, token {c.prefill_token_cost_ms:.4g} ms, "
          f"attention {c.prefill_attention_cost_ms:.4g} ms/GFLOP, kv {c.prefill_kv_cost_ms:.4g} ms/MiB, "
          f"decode per step: CB {c.continuous_decode_cost_ms:.4g} ms, nocb {c.nocb_decode_cost_ms:.4g} ms")
    print(f"wrote {out}")
    return 0


def default_calibration_path(name: str, dtype: str, device: str) -> Path:
    from rollout_lab.paths import CALIBRATION

    return CALIBRATION / f"{name}_{dtype}_{device.split(':')[0]}.json"


def register_cli(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "calibrate", help="fit the prefill cost model on this model/device/dtype and save it",
        description="Measure prefill forwards, KV copies and CB decode overhead; fit C(B, L) by NNLS.",
    )
    add_model_arguments(parser)
    parser.add_argument("--grid", choices=("default", "tiny"), default=None,
                        help="shape grid (default: tiny for --tiny models, default for presets)")
    parser.add_argument("--repeats", type=positive_int, default=None, help="timed passes over the grid")
    parser.add_argument("--max-batch-tokens", type=positive_int, default=None,
                        help=f"skip shapes with batch*width above this (default {DEFAULT_MAX_BATCH_TOKENS})")
    parser.add_argument("--out", help="cost file to write (default data/calibration/<name>_<dtype>_<device>.json)")
    parser.set_defaults(func=_cmd_calibrate_with_grid_default)


def _cmd_calibrate_with_grid_default(args: argparse.Namespace) -> int:
    if args.grid is None:
        args.grid = "default" if args.preset else "tiny"
    return cmd_calibrate(args)
