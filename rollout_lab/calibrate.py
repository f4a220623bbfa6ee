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
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from rollout_lab.cost import (
    CostCoefficients,
    ModelGeometry,
    attention_gflops,
    kv_mib,
    prefill_cost_ms,
    read_cost_file,
)
from rollout_lab.nnls import nnls

# Metadata fields that must agree between a cost file and the run that loads it.
CHECKED_FIELDS = (
    "model_name", "geometry", "dtype", "device_name", "attn_implementation",
    "torch", "transformers", "tf32_matmul",
)
DEFAULT_MAX_BATCH_TOKENS = 32768
STATISTICS = {"median": statistics.median, "min": min}


@dataclass(frozen=True)
class CalibrationGrid:
    """Uniform (batch, width) prefill shapes and the decode probe; shapes over the limits are skipped."""

    batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    widths: tuple[int, ...] = (16, 32, 64, 128, 256, 512, 1024)
    repeats: int = 5  # timed passes over the whole grid (median per shape), after one warm-up pass
    max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS  # skip shapes with batch * width above this
    decode_batches: tuple[int, ...] = (8, 32)  # requests in the decode probe; () = not measured
    decode_width: int = 64  # prompt length in the decode probe
    decode_steps: int = 8  # decode steps measured (calls with decode_steps + 1 and 1 new tokens)
    decode_repeats: int = 3
    statistic: str = "median"  # of the timed samples per shape; "min" resists a busy host's noise

    def __post_init__(self) -> None:
        if self.statistic not in STATISTICS:
            raise ValueError(f"CalibrationGrid.statistic must be one of {list(STATISTICS)}, got {self.statistic!r}")
        for name in ("batches", "widths", "decode_batches"):
            value = getattr(self, name)
            if not isinstance(value, tuple) or any(
                isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in value
            ):
                raise ValueError(f"CalibrationGrid.{name} must be a tuple of positive ints, got {value!r}")
        if len(self.batches) < 2 or len(self.widths) < 2:
            raise ValueError(
                f"CalibrationGrid needs >= 2 batches and >= 2 widths to separate the terms, "
                f"got batches={self.batches}, widths={self.widths}"
            )
        for name in ("repeats", "max_batch_tokens", "decode_width", "decode_steps", "decode_repeats"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"CalibrationGrid.{name} must be a positive int, got {value!r}")

    @classmethod
    def tiny(cls) -> "CalibrationGrid":
        """A few seconds on CPU with a tiny model: for tests and the notebooks' tiny default."""
        return cls(batches=(1, 4, 16), widths=(8, 32, 128), repeats=5, decode_batches=(4,),
                   decode_width=8, decode_steps=4, decode_repeats=3, statistic="min")

    def shapes(self, max_width: int | None = None) -> list[tuple[int, int]]:
        """(batch, width) pairs within ``max_batch_tokens`` and the model's ``max_width``."""
        return [
            (b, w) for w in sorted(set(self.widths)) for b in sorted(set(self.batches))
            if b * w <= self.max_batch_tokens and (max_width is None or w <= max_width)
        ]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


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


# -- measuring (torch) -------------------------------------------------------------------------


def _synchronize(device: Any) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def timed_ms(fn: Callable[[], Any], device: Any) -> tuple[float, Any]:
    """Wall-clock milliseconds of ``fn()`` with the device synchronised before and after."""
    _synchronize(device)
    start = time.perf_counter()
    out = fn()
    _synchronize(device)
    return (time.perf_counter() - start) * 1e3, out


def _random_prompts(batch: int, width: int, config: Any, seed: int) -> list[list[int]]:
    from rollout_lab.workloads import lengths_to_prompts

    special = [t for t in (config.pad_token_id, config.eos_token_id, config.bos_token_id)
               if isinstance(t, int)]
    return lengths_to_prompts([width] * batch, vocab_size=config.vocab_size, seed=seed, special_ids=special)


def measure_prefill(model: Any, grid: CalibrationGrid, *, progress: bool = True) -> list[dict[str, Any]]:
    """Median forward and KV-copy milliseconds per grid shape, interleaved over the passes."""
    import torch
    from tqdm.auto import tqdm

    from rollout_lab.cache import AlignedKVCache
    from rollout_lab.decode import cache_kwarg_name, prefill_bucket

    config = model.config.get_text_config(decoder=True)
    device = next(model.parameters()).device
    shapes = grid.shapes(getattr(config, "max_position_embeddings", None))
    if len(shapes) < 3:
        raise ValueError(f"the grid leaves {len(shapes)} shapes within the limits; need >= 3: {grid}")
    max_width = max(w for _, w in shapes)
    cache = AlignedKVCache.for_model(model, num_slots=max(b for b, _ in shapes), capacity=max_width + 1)
    cache.set_front(max_width)
    kwarg = cache_kwarg_name(model)
    pad = config.pad_token_id if config.pad_token_id is not None else 0
    prompts = {s: _random_prompts(*s, config, seed=i) for i, s in enumerate(shapes)}
    samples: dict[tuple[int, int], list[tuple[float, float]]] = {s: [] for s in shapes}
    bar = tqdm(total=(grid.repeats + 1) * len(shapes), desc="calibrate prefill", disable=not progress)
    with torch.no_grad():
        for repeat in range(grid.repeats + 1):  # pass 0 is the warm-up
            for shape in shapes:
                batch, width = shape
                fwd_ms, (_, layer_kv) = timed_ms(
                    lambda: prefill_bucket(model, prompts[shape], pad_token_id=pad, cache_kwarg=kwarg), device)
                copy_ms, _ = timed_ms(lambda: cache.admit(range(batch), layer_kv, [width] * batch), device)
                del layer_kv
                if repeat > 0:
                    samples[shape].append((fwd_ms, copy_ms))
                bar.update()
    bar.close()
    stat = STATISTICS[grid.statistic]
    return [
        {"batch": b, "width": w,
         "forward_ms": stat([f for f, _ in samples[(b, w)]]),
         "kv_copy_ms": stat([c for _, c in samples[(b, w)]]),
         "forward_samples_ms": [f for f, _ in samples[(b, w)]],
         "kv_copy_samples_ms": [c for _, c in samples[(b, w)]]}
        for b, w in shapes
    ]


def measure_decode_overhead(
    model: Any, grid: CalibrationGrid, *, progress: bool = True
) -> list[dict[str, Any]]:
    """Per decode step: nocb and CB ms (from whole calls with steps+1 and 1 tokens), and CB - nocb."""
    import torch
    from tqdm.auto import tqdm

    from rollout_lab.engine import Rollout, RolloutConfig

    config = model.config.get_text_config(decoder=True)
    device = next(model.parameters()).device
    pad = config.pad_token_id if config.pad_token_id is not None else 0
    modes = ("nocb", "bucketed")
    budgets = (1, grid.decode_steps + 1)
    engines = {m: Rollout(model, RolloutConfig(mode=m, eos_token_id=None, pad_token_id=pad)) for m in modes}
    records = []
    bar = tqdm(total=len(grid.decode_batches) * (grid.decode_repeats + 1) * 4,
               desc="calibrate decode", disable=not progress)
    with torch.no_grad():
        for batch in grid.decode_batches:
            prompts = _random_prompts(batch, grid.decode_width, config, seed=1000 + batch)
            times: dict[tuple[str, int], list[float]] = {(m, n): [] for m in modes for n in budgets}
            for repeat in range(grid.decode_repeats + 1):
                for mode in modes:
                    for n in budgets:
                        ms, _ = timed_ms(lambda: engines[mode].generate(prompts, max_new_tokens=n), device)
                        if repeat > 0:
                            times[(mode, n)].append(ms)
                        bar.update()
            stat = STATISTICS[grid.statistic]
            per_step = {
                m: (stat(times[(m, budgets[1])]) - stat(times[(m, budgets[0])]))
                / grid.decode_steps
                for m in modes
            }
            records.append({
                "batch": batch, "width": grid.decode_width, "steps": grid.decode_steps,
                "nocb_ms_per_step": per_step["nocb"], "cb_ms_per_step": per_step["bucketed"],
                "overhead_ms_per_step": per_step["bucketed"] - per_step["nocb"],
            })
    bar.close()
    for engine in engines.values():
        if hasattr(engine, "close"):
            engine.close()
    return records


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


# -- metadata ----------------------------------------------------------------------------------


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

DTYPES = ("float32", "bfloat16", "float16")


def build_model(args: argparse.Namespace) -> tuple[Any, str]:
    """The model of --preset/--tiny in --dtype on --device, and its name; validates first."""
    import torch

    from rollout_lab import models

    check_device(args.device)
    dtype = getattr(torch, args.dtype)
    if args.tiny:
        if args.tiny not in models.TINY_FAMILIES:
            raise SystemExit(f"error: unknown --tiny family {args.tiny!r}; expected one of {list(models.TINY_FAMILIES)}")
        return models.tiny_model(args.tiny, dtype=dtype).to(args.device), f"tiny-{args.tiny}"
    if args.preset not in models.PRESETS:
        raise SystemExit(f"error: unknown --preset {args.preset!r}; expected one of {sorted(models.PRESETS)}")
    return models.from_preset(args.preset, dtype=dtype, device=args.device), args.preset


def check_device(device: str) -> None:
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise SystemExit(f"error: bad --device {device!r}: {err}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"error: --device {device!r} but CUDA is not available here; use --device cpu")
    if dev.type not in ("cpu", "cuda"):
        raise SystemExit(f"error: --device {device!r}: expected cpu or cuda[:N]")


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--preset", help="a real architecture with random weights, e.g. qwen2.5-3b")
    group.add_argument("--tiny", metavar="FAMILY", help="a tiny random model: qwen2, qwen3, llama, opt (default qwen2)")
    parser.add_argument("--dtype", choices=DTYPES, default=None,
                        help="model dtype (default: float32 for --tiny, bfloat16 for --preset)")
    parser.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda when available)")
    parser.add_argument("--threads", type=_positive_int, default=None,
                        help="torch CPU threads (default: torch's); 1 steadies timings on a busy host")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def resolve_model_arguments(args: argparse.Namespace) -> None:
    import torch

    if not args.preset and not args.tiny:
        args.tiny = "qwen2"
    if args.dtype is None:
        args.dtype = "float32" if args.tiny else "bfloat16"
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.threads is not None:
        torch.set_num_threads(args.threads)


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
    parser.add_argument("--repeats", type=_positive_int, default=None, help="timed passes over the grid")
    parser.add_argument("--max-batch-tokens", type=_positive_int, default=None,
                        help=f"skip shapes with batch*width above this (default {DEFAULT_MAX_BATCH_TOKENS})")
    parser.add_argument("--out", help="cost file to write (default data/calibration/<name>_<dtype>_<device>.json)")
    parser.set_defaults(func=_cmd_calibrate_with_grid_default)


def _cmd_calibrate_with_grid_default(args: argparse.Namespace) -> int:
    if args.grid is None:
        args.grid = "default" if args.preset else "tiny"
    return cmd_calibrate(args)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value
