"""Calibrate the prefill cost model per model, device and dtype, and save it with its provenance.

    rollout-lab calibrate --tiny qwen2                     # CPU, seconds -> <out-dir>/data/calibration/
    rollout-lab calibrate --preset qwen2.5-3b --dtype bfloat16 --device cuda

    from rollout_lab.measure.calibrate import calibrate, load_calibration, CalibrationGrid
    result = calibrate(model, grid=CalibrationGrid.tiny(), model_name="tiny-qwen2")
    result.r2, result.worst_rel_error; result.save(path)
    costs = load_calibration(path, model=model)   # ValueError naming the fields that differ

What is measured, with the engine's own code paths (warm-up passes are never timed, and the device
is synchronised around every clock read):
- ``forward_ms``: one prefill forward of a uniform (batch, width) bucket (``prefill.prefill_bucket``);
- ``kv_copy_ms``: copying that bucket's KV into the aligned cache (``AlignedKVCache.admit``);
- CB and nocb decode per step, each from whole ``Rollout.generate`` calls with ``decode_steps + 1``
  and 1 new tokens; the decode coefficients come from them (``planner.fit.decode_costs``); with
  ``CalibrationGrid(paged_decode=True)`` the paged route's too, whose step over the aligned one is
  ``paged_decode_cost_ms`` (``planner.fit.paged_decode_cost``).
KV MiB is proportional to B*L, so ``token`` and ``kv`` cannot be told apart from forwards alone:
fixed/token/attention are fitted (NNLS, relative weights, ``planner.fit.fit_coefficients``) to the
forwards, and kv (plus the copy's own per-call cost, added to ``fixed``) to the copies. The reported
fit compares the sum forward + copy with C(B, L). ``prefill_replicate_cost_ms`` (shared prefill's KV
copies into the other samples' slots) is the same copy, so it takes kv's slope.
- ``packed``: the packed forward of each shape with batch >= 2 (its prompts in one row) plus its KV
  scatter; ``packed_fixed_cost_ms`` and ``packed_prompt_cost_ms`` are what a packed forward costs
  beyond the shared coefficients, once and per prompt (``fit_packed_costs``). Without them Auto
  never considers packed.

On a CPU every timing runs on one torch thread by default (``threads=``, ``measure.threads``): more
only contend on a shared host. The fit's quality is checked (``fit_warnings``): R², the worst shape,
and each decode cost per step against its calls' spread (``decode_warnings``).

The metadata: the fields in ``planner.cost.CHECKED_FIELDS`` (model, geometry, dtype, device, attention
implementation, library versions, TF32) must agree between a cost file and the run that loads it:
coefficients measured on another setting would steer the planner wrongly without any error.
"""
from __future__ import annotations

import dataclasses
import os
import statistics
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from rollout_lab.engine.kv.aligned import AlignedKVCache
from rollout_lab.engine.limits import ModelLimits, available_memory
from rollout_lab.engine.api.config import RolloutConfig
from rollout_lab.engine.runner.prefill import cache_kwarg_name, packed_backend, prefill_bucket, prefill_packed
from rollout_lab.engine.runner.prefill_graphs import PrefillGraphs
from rollout_lab.engine.profile import timed_ms
from rollout_lab.engine.api.rollout import Rollout
from rollout_lab.engine.model_info import model_metadata, model_name_of
from rollout_lab.measure.models import load_model, model_config, special_token_ids
from rollout_lab.measure.provenance import git_sha, provenance
from rollout_lab.measure.spread import sample_spread
from rollout_lab.measure.threads import MEASUREMENT_THREADS, measurement_threads
from rollout_lab.measure.workloads import lengths_to_prompts
from rollout_lab.planner.cost import CostCoefficients, CostFile, ModelGeometry, packed_prefill_cost_ms
from rollout_lab.planner.fit import decode_costs, fit_coefficients, nnls, paged_decode_cost
from rollout_lab.planner.shape_classes import ShapeClasses
from rollout_lab.workspace import Workspace, output_lock, run_tag


@dataclass(frozen=True)
class CalibrationResult:
    """Fitted coefficients, the run's metadata, and the fit per shape (JSON-ready dicts)."""

    costs: CostCoefficients
    metadata: dict[str, Any]
    fit: tuple[dict[str, Any], ...]  # batch, width, measured_ms, predicted_ms, rel_error, ...
    decode: tuple[dict[str, Any], ...] = field(default=())  # batch, nocb/cb ms per step, overhead
    r2: float = float("nan")
    packed: tuple[dict[str, Any], ...] = field(default=())  # prompts, width, measured/predicted ms
    warnings: tuple[str, ...] = field(default=())  # the fit's quality problems (fit_warnings)

    @property
    def worst_rel_error(self) -> float:
        return max((abs(r["rel_error"]) for r in self.fit), default=float("nan"))

    def save(self, path: str | os.PathLike) -> Path:
        """Atomically write coefficients + metadata + fit (readable by ``CostFile.read``)."""
        metadata = dict(self.metadata)
        metadata["fit"] = {
            "r2": self.r2, "worst_rel_error": self.worst_rel_error, "warnings": list(self.warnings),
            "shapes": list(self.fit), "decode": list(self.decode), "packed": list(self.packed),
        }
        return self.costs.to_json(path, metadata=metadata)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "CalibrationResult":
        """Read a saved calibration back as a result (no metadata check: for plots and reports;
        ``load_calibration`` checks it against a model)."""
        cost_file = CostFile.read(path)
        costs, metadata = cost_file.costs, dict(cost_file.metadata)
        fit = metadata.pop("fit", None) or {}
        return cls(costs, metadata, tuple(fit.get("shapes", ())), tuple(fit.get("decode", ())),
                   float(fit.get("r2", float("nan"))), tuple(fit.get("packed", ())),
                   tuple(fit.get("warnings", ())))


MIN_R2 = 0.9  # below this the fitted terms are mostly noise: recalibrate on a quieter host
MAX_REL_ERROR = 0.25  # a shape predicted this far off steers the planner wrongly for that shape


MAX_DECODE_SPREAD = 0.5  # of a decode step: its calls' IQRs past this make the per-step cost a guess


def fit_warnings(r2: float, worst_rel_error: float, *, num_shapes: int | None = None,
                 decode: Sequence[Mapping[str, Any]] = ()) -> list[str]:
    """What is wrong with a fit's quality, in words (empty when R² >= MIN_R2, every shape is
    within MAX_REL_ERROR and every decode probe is clear of its noise, ``decode_warnings``)."""
    found = []
    if not r2 >= MIN_R2:  # NaN included
        found.append(f"R² {r2:.3f} is below {MIN_R2}: the fitted coefficients are mostly noise")
    if not worst_rel_error <= MAX_REL_ERROR:
        shapes = f" of {num_shapes} shapes" if num_shapes else ""
        found.append(f"the worst shape{shapes} is predicted {worst_rel_error:.0%} off (limit {MAX_REL_ERROR:.0%})")
    found += decode_warnings(decode)
    if found:
        found.append("recalibrate with more --repetitions on an idle host (or --threads 1) before trusting it")
    return found


def decode_warnings(decode: Sequence[Mapping[str, Any]]) -> list[str]:
    """The decode terms' quality, per probe batch and route (``measure_decode_overhead``'s records):
    a cost per step is the difference of two calls' medians over the steps between them, so it is
    noise when the longer calls were not slower, or when the two calls' IQRs add up to more than
    MAX_DECODE_SPREAD of it."""
    found = []
    for record in decode:
        steps, samples = record["steps"], record.get("samples_ms", {})
        for route, key in (("nocb", "nocb"), ("CB", "cb")):
            per_step = record[f"{key}_ms_per_step"]
            where = f"{route} decode at batch {record['batch']}"
            if not per_step > 0:
                found.append(f"{where}: the calls with {steps + 1} new tokens were not slower than those with 1 "
                             f"({per_step:.3f} ms a step): the decode term is noise")
                continue
            calls = [samples.get(f"{key}_{n}") for n in (1, steps + 1)]
            if not all(calls):
                continue
            spread = sum(sample_spread(c)["iqr_ms"] for c in calls) / steps
            if spread > MAX_DECODE_SPREAD * per_step:
                found.append(f"{where}: {per_step:.3f} ms a step, but its calls spread {spread:.3f} ms a step "
                             f"(IQRs; limit {MAX_DECODE_SPREAD:.0%} of the step)")
    return found


# -- the whole calibration ---------------------------------------------------------------------


def calibrate(
    model: Any,
    *,
    grid: CalibrationGrid | None = None,
    dtype: Any = None,
    device: Any = None,
    model_name: str | None = None,
    progress: bool = True,
    threads: int | None = MEASUREMENT_THREADS,
) -> CalibrationResult:
    """Measure the grid on ``model`` (already on its device, in its dtype) and fit the coefficients.

    ``dtype``/``device`` default to the model's; when given they must match it. On a CPU the
    forwards are timed on ``threads`` torch threads (None: the process's; ``measure.threads``), and
    the process's count is restored after; the metadata records the count used (``num_threads``).
    """
    grid = CalibrationGrid() if grid is None else grid
    param = next(model.parameters())
    if dtype is not None and param.dtype != dtype:
        raise ValueError(f"dtype={dtype} but the model's parameters are {param.dtype}; convert the model first")
    if device is not None and torch.device(device).type != param.device.type:
        raise ValueError(f"device={device} but the model is on {param.device}; move the model first")
    grid.check_limits(ModelLimits.of_model(model))
    with measurement_threads(threads, param.device):
        metadata = run_metadata(model, model_name=model_name)
        prefill = measure_prefill(model, grid, progress=progress)
        decode = measure_decode_overhead(model, grid, progress=progress)
        packed = measure_packed(model, grid, progress=progress) if grid.packed else []
    metadata["grid"] = grid.to_dict()
    cb_ms, nocb_ms = decode_costs(decode)
    geometry = ModelGeometry(**metadata["geometry"])
    costs, fit, r2 = fit_coefficients(
        [(r["batch"], r["width"]) for r in prefill], [r["forward_ms"] for r in prefill],
        [r["kv_copy_ms"] for r in prefill], geometry,
        continuous_decode_cost_ms=cb_ms, nocb_decode_cost_ms=nocb_ms,
    )
    if grid.paged_decode:
        costs = replace(costs, paged_decode_cost_ms=paged_decode_cost(decode))
    for record, measured in zip(fit, prefill):
        record.update({k: v for k, v in measured.items() if k.endswith(("_samples_ms", "_iqr_ms"))})
    packed_records: tuple[dict[str, Any], ...] = ()
    if packed:
        costs, packed_records = with_packed_costs(packed, geometry, costs)
    result = CalibrationResult(costs, metadata, fit, tuple(decode), r2, packed_records)
    problems = fit_warnings(r2, result.worst_rel_error, num_shapes=len(fit), decode=decode)
    if problems:  # on the console too, not only in the record
        warnings.warn(f"calibration of {metadata['model_name']}: " + "; ".join(problems), stacklevel=2)
    return replace(result, warnings=tuple(problems))


# -- what notebook 01 calls ------------------------------------------------------------------------

def calibration_grid(grid: str | Mapping[str, Any]) -> Any:
    """"tiny", "default", or a dict of ``CalibrationGrid`` fields over the tiny grid (lists allowed)."""
    if grid == "tiny":
        return CalibrationGrid.tiny()
    if grid == "default":
        return CalibrationGrid()
    if not isinstance(grid, Mapping):
        raise ValueError(f"grid must be 'tiny', 'default' or a dict of CalibrationGrid fields, got {grid!r}")
    fields = {k: tuple(v) if isinstance(v, (list, tuple)) else v for k, v in grid.items()}
    return replace(CalibrationGrid.tiny(), **fields)


def calibration_path(name: str, dtype: str, device: str, workspace: Workspace) -> Path:
    """``<workspace>/data/calibration/<name>_<dtype>_<device type>.json``."""
    return workspace.calibration / f"{run_tag(name, dtype, device)}.json"


def calibrate_or_load(
    *, calibration_file: str | None, model: str, dtype: str, device: str, grid: Any,
    output_path: str | None, output_dir: str | Path | None, progress: bool = False,
    threads: int | None = MEASUREMENT_THREADS,
) -> tuple[Any, Path]:
    """Render a saved calibration (``calibration_file``), or measure one on ``threads`` CPU threads
    (``calibrate``) and save it: (result, path)."""
    if calibration_file is not None:
        path = Path(calibration_file)
        if not path.is_file():
            raise ValueError(f"calibration_file {str(path)!r} does not exist")
        return CalibrationResult.load(path), path
    grid = calibration_grid(grid)
    config, _ = model_config(model)
    grid.check_limits(ModelLimits.of_config(config, dtype=dtype, device=device))  # before the model is built
    net, name = load_model(model, dtype=dtype, device=device)
    path = Path(output_path) if output_path else calibration_path(name, dtype, device, Workspace.resolve(output_dir))
    with output_lock(path):  # one calibration at a time per cost file: a second one is refused
        result = calibrate(net, grid=grid, model_name=name, progress=progress, threads=threads)
        result.save(path)
    return result, path

# -- the grid and the timed probes -----------------------------------------------------------------

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
    decode_repeats: int = 5  # timed passes of the decode probe, after one warm-up pass
    statistic: str = "median"  # of the timed samples per shape; "min" resists a busy host's noise
    packed: bool = True  # also time packed forwards of the shapes with batch >= 2 (the packed route)
    prefill_graphs: bool = False  # CUDA: time each shape as a compiled graph's replay (engine.runner.prefill_graphs)
    compile: bool = True  # CUDA: False captures the eager model (prefill graphs and decode step), as sweep --no-compile
    paged_decode: bool = False  # the decode probe also times the paged route: paged_decode_cost_ms (one more compile on CUDA)

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
        for name in ("packed", "prefill_graphs", "compile", "paged_decode"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"CalibrationGrid.{name} must be True or False, got {getattr(self, name)!r}")
        for name in ("repeats", "max_batch_tokens", "decode_width", "decode_steps", "decode_repeats"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"CalibrationGrid.{name} must be a positive int, got {value!r}")

    @classmethod
    def tiny(cls) -> "CalibrationGrid":
        """A few seconds on CPU with a tiny model: for tests and the notebooks' tiny default."""
        return cls(batches=(1, 4, 16), widths=(8, 32, 128), repeats=5, decode_batches=(4,),
                   decode_width=8, decode_steps=4, decode_repeats=5)

    @classmethod
    def for_classes(cls, classes: ShapeClasses, **settings: Any) -> "CalibrationGrid":
        """The grid of the shapes a ``RolloutConfig(prefill_classes=classes)`` runs, so that the
        fitted fixed cost is the one those forwards pay (rows default to the grid's batches)."""
        return cls(batches=classes.rows or cls.batches, widths=classes.widths, **settings)

    def shapes(self, max_width: int | None = None) -> list[tuple[int, int]]:
        """(batch, width) pairs within ``max_batch_tokens`` and the model's ``max_width``."""
        return [
            (b, w) for w in sorted(set(self.widths)) for b in sorted(set(self.batches))
            if b * w <= self.max_batch_tokens and (max_width is None or w <= max_width)
        ]

    def fitting_shapes(self, max_width: int | None = None) -> list[tuple[int, int]]:
        """``shapes(max_width)``; ValueError when fewer than 3 are left (the fit has 3 prefill terms)."""
        shapes = self.shapes(max_width)
        if len(shapes) < 3:
            raise ValueError(f"the grid leaves {len(shapes)} shapes within max_batch_tokens={self.max_batch_tokens} "
                             f"and the model's context of {max_width} positions; need >= 3: {self}")
        return shapes

    def check_limits(self, limits: ModelLimits) -> None:
        """This grid on a model of ``limits`` (before it is built, or before any measuring):
        ``fitting_shapes`` within its context; within the device's available memory, the KV the
        prefill probe holds (``prefill_kv_tokens``) and the decode probe's cache (its most rows by
        ``decode_width + decode_steps + 1`` columns). ValueError naming the setting and what fits."""
        shapes = self.fitting_shapes(limits.max_positions)
        need = prefill_kv_tokens(shapes)
        try:
            limits.check_memory("max_batch_tokens", self.max_batch_tokens, count=need,
                                unit_bytes=limits.kv_bytes_per_token, unit="KV tokens",
                                what=f"the prefill probe's KV ({max(b for b, _ in shapes)} rows x "
                                     f"{max(w for _, w in shapes) + 1} columns, and its largest forward's "
                                     f"{max(b * w for b, w in shapes)} tokens)")
        except ValueError as err:
            available, _ = available_memory(limits.device)
            smaller = (replace(self, max_batch_tokens=t).shapes(limits.max_positions)
                       for t in sorted({b * w for b, w in shapes}, reverse=True)[1:])
            fits = next((max(b * w for b, w in kept) for kept in smaller
                         if len(kept) >= 3 and prefill_kv_tokens(kept) * limits.kv_bytes_per_token <= available), None)
            raise ValueError(f"{err}; " + (f"max_batch_tokens={fits} fits" if fits is not None else
                                           "no 3 of the grid's shapes fit: give smaller batches or widths")) from None
        if self.decode_batches:
            limits.check_kv("decode_batches", self.decode_batches, rows=max(self.decode_batches),
                            positions=self.decode_width + self.decode_steps + 1)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def prefill_kv_tokens(shapes: Sequence[tuple[int, int]]) -> int:
    """The KV tokens the prefill probe holds at once over ``shapes``: its cache of the most rows by
    the widest shape's columns + 1, and the largest forward's own KV beside it."""
    return max(b for b, _ in shapes) * (max(w for _, w in shapes) + 1) + max(b * w for b, w in shapes)


def measure_prefill(model: Any, grid: CalibrationGrid, *, progress: bool = True) -> list[dict[str, Any]]:
    """Median forward and KV-copy milliseconds per grid shape, interleaved over the passes."""
    config = model.config.get_text_config(decoder=True)
    device = next(model.parameters()).device
    shapes = grid.fitting_shapes(getattr(config, "max_position_embeddings", None))
    max_width = max(w for _, w in shapes)
    cache = AlignedKVCache.for_model(model, num_slots=max(b for b, _ in shapes), capacity=max_width + 1)
    cache.set_front(max_width)
    kwarg = cache_kwarg_name(model)
    pad = config.pad_token_id if config.pad_token_id is not None else 0
    special = special_token_ids(config)
    prompts = {(b, w): lengths_to_prompts([w] * b, vocab_size=config.vocab_size, seed=i, special_ids=special)
               for i, (b, w) in enumerate(shapes)}
    samples: dict[tuple[int, int], list[tuple[float, float]]] = {s: [] for s in shapes}
    # compiled, as a Rollout's prefill graphs are under its default compile="auto" (unless grid.compile is off)
    graphs = PrefillGraphs(model, cache_kwarg=kwarg, max_graphs=len(shapes), compiled=grid.compile) \
        if grid.prefill_graphs else None

    def forward(batch: int, width: int):
        if graphs is None:
            return prefill_bucket(model, prompts[(batch, width)], pad_token_id=pad, cache_kwarg=kwarg)
        return graphs.run(prompts[(batch, width)], rows=batch, width=width, pad_token_id=pad)

    bar = tqdm(total=(grid.repeats + 1) * len(shapes), desc="calibrate prefill", disable=not progress)
    with torch.no_grad():
        for repeat in range(grid.repeats + 1):  # pass 0 is the warm-up (and, with graphs, the capture)
            for shape in shapes:
                batch, width = shape
                fwd_ms, (_, layer_kv) = timed_ms(lambda: forward(batch, width), device)
                # the lambda runs inside timed_ms, before the del below (F821 reads the del as unbinding it)
                copy_ms, _ = timed_ms(lambda: cache.admit(range(batch), layer_kv, [width] * batch), device)  # noqa: F821
                del layer_kv
                if repeat > 0:
                    samples[shape].append((fwd_ms, copy_ms))
                bar.update()
    bar.close()
    if graphs is not None:
        graphs.close()
    stat = STATISTICS[grid.statistic]
    records = []
    for b, w in shapes:
        forwards, copies = [f for f, _ in samples[(b, w)]], [c for _, c in samples[(b, w)]]
        records.append({"batch": b, "width": w, "forward_ms": stat(forwards), "kv_copy_ms": stat(copies),
                        "forward_iqr_ms": sample_spread(forwards)["iqr_ms"],
                        "kv_copy_iqr_ms": sample_spread(copies)["iqr_ms"],
                        "forward_samples_ms": forwards, "kv_copy_samples_ms": copies})
    return records


def measure_packed(model: Any, grid: CalibrationGrid, *, progress: bool = True) -> list[dict[str, Any]]:
    """Per grid shape with batch >= 2: the packed forward of ``batch`` prompts of ``width`` tokens
    (``prefill.prefill_packed``, one row of batch * width tokens) plus its KV scatter into the cache
    (``AlignedKVCache.admit_packed``), in ms (the grid's statistic over its repeats)."""
    config = model.config.get_text_config(decoder=True)
    device = next(model.parameters()).device
    shapes = [(b, w) for b, w in grid.shapes(getattr(config, "max_position_embeddings", None)) if b >= 2]
    if not shapes:
        return []
    max_width = max(w for _, w in shapes)
    cache = AlignedKVCache.for_model(model, num_slots=max(b for b, _ in shapes), capacity=max_width + 1)
    cache.set_front(max_width)
    kwarg = cache_kwarg_name(model)
    special = special_token_ids(config)
    prompts = {(b, w): lengths_to_prompts([w] * b, vocab_size=config.vocab_size, seed=500 + i, special_ids=special)
               for i, (b, w) in enumerate(shapes)}
    samples: dict[tuple[int, int], list[float]] = {s: [] for s in shapes}
    backend = packed_backend(model)

    def run(batch: int, width: int) -> None:
        _, layer_kv, offsets = prefill_packed(model, prompts[(batch, width)], cache_kwarg=kwarg, backend=backend)
        cache.admit_packed(range(batch), layer_kv, offsets, [width] * batch)

    bar = tqdm(total=(grid.repeats + 1) * len(shapes), desc="calibrate packed", disable=not progress)
    with torch.no_grad():
        for repeat in range(grid.repeats + 1):  # pass 0 is the warm-up
            for shape in shapes:
                ms, _ = timed_ms(lambda: run(*shape), device)
                if repeat > 0:
                    samples[shape].append(ms)
                bar.update()
    bar.close()
    stat = STATISTICS[grid.statistic]
    return [{"prompts": b, "width": w, "backend": backend, "measured_ms": stat(samples[(b, w)]),
             "iqr_ms": sample_spread(samples[(b, w)])["iqr_ms"], "samples_ms": samples[(b, w)]}
            for b, w in shapes]


def fit_packed_costs(
    packed: list[dict[str, Any]], geometry: ModelGeometry, costs: CostCoefficients
) -> tuple[float, float, tuple[dict[str, Any], ...]]:
    """``packed_fixed_cost_ms`` and ``packed_prompt_cost_ms``: with the shared coefficients fitted on
    the padded forwards, what a packed forward costs beyond them, once and per prompt (NNLS on
    relative error, both >= 0), and the per-shape fit. Two terms because the padded forwards may be
    graph replays while the packed one runs eagerly, and one per-prompt term alone misses the packed
    shapes both ways (data/calibration/qwen2.5-3b_bfloat16_cuda_compiled-graphs.json, one term,
    against its refit with two, ..._compiled-graphs_refit.json)."""
    shared = replace(costs, packed_prompt_cost_ms=0.0, packed_fixed_cost_ms=0.0)
    base = np.array([packed_prefill_cost_ms([r["width"]] * r["prompts"], geometry, shared) for r in packed])
    measured = np.array([r["measured_ms"] for r in packed], dtype=float)
    prompts = np.array([r["prompts"] for r in packed], dtype=float)
    weight = 1.0 / measured
    fixed, per_prompt = (float(v) for v in nnls(np.stack([weight, weight * prompts], 1), weight * (measured - base)))
    records = []
    for r, b in zip(packed, base):
        predicted = float(b) + fixed + per_prompt * r["prompts"]
        records.append({**r, "predicted_ms": predicted,
                        "rel_error": (predicted - r["measured_ms"]) / r["measured_ms"]})
    return fixed, per_prompt, tuple(records)


def with_packed_costs(
    packed: list[dict[str, Any]], geometry: ModelGeometry, costs: CostCoefficients
) -> tuple[CostCoefficients, tuple[dict[str, Any], ...]]:
    """``costs`` with both packed terms from ``fit_packed_costs``, and the per-shape fit."""
    fixed, per_prompt, records = fit_packed_costs(packed, geometry, costs)
    return replace(costs, packed_fixed_cost_ms=fixed, packed_prompt_cost_ms=per_prompt), records


def refit_packed(result: CalibrationResult) -> CalibrationResult:
    """``result`` with its packed terms fitted again from its own packed measurements by
    ``fit_packed_costs`` (a calibration saved before the packed fixed cost existed); the metadata
    names the code that refitted it under ``refit``. No device, no model."""
    if not result.packed:
        raise ValueError("the calibration holds no packed measurements (grid.packed was off): nothing to refit")
    geometry = ModelGeometry(**result.metadata["geometry"])
    costs, records = with_packed_costs(list(result.packed), geometry, result.costs)
    metadata = dict(result.metadata, refit={"what": "packed_fixed_cost_ms, packed_prompt_cost_ms (fit_packed_costs)",
                                            "git_sha": git_sha(), "previous": result.costs.to_dict()})
    return replace(result, costs=costs, metadata=metadata, packed=records)


def measure_decode_overhead(
    model: Any, grid: CalibrationGrid, *, progress: bool = True
) -> list[dict[str, Any]]:
    """Per decode step: nocb and CB ms (from whole calls with steps+1 and 1 tokens), and CB - nocb."""
    config = model.config.get_text_config(decoder=True)
    device = next(model.parameters()).device
    pad = config.pad_token_id if config.pad_token_id is not None else 0
    modes = ("nocb", "bucketed", "paged") if grid.paged_decode else ("nocb", "bucketed")
    budgets = (1, grid.decode_steps + 1)
    engines = {m: Rollout(model, RolloutConfig(mode=m, ignore_eos=True, pad_token_id=pad,
                                               compile="auto" if grid.compile else False)) for m in modes}
    records = []
    bar = tqdm(total=len(grid.decode_batches) * (grid.decode_repeats + 1) * 2 * len(modes),
               desc="calibrate decode", disable=not progress)
    with torch.no_grad():
        for batch in grid.decode_batches:
            prompts = lengths_to_prompts([grid.decode_width] * batch, vocab_size=config.vocab_size,
                                         seed=1000 + batch, special_ids=special_token_ids(config))
            times: dict[tuple[str, int], list[float]] = {(m, n): [] for m in modes for n in budgets}
            for repeat in range(grid.decode_repeats + 1):
                for mode in modes:
                    for n in budgets:
                        ms, _ = timed_ms(lambda: engines[mode].generate(prompts, max_new_tokens=n, progress=False), device)
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
                **({"paged_ms_per_step": per_step["paged"]} if "paged" in per_step else {}),
                # every timed call, per mode and token budget ("nocb_1", "nocb_<steps + 1>", ...)
                "samples_ms": {f"{'cb' if m == 'bucketed' else m}_{n}": times[(m, n)] for m in modes for n in budgets},
            })
    bar.close()
    for engine in engines.values():
        if hasattr(engine, "close"):
            engine.close()
    return records

# -- the metadata, and the check that a cost file fits this run ------------------------------------


def run_metadata(model: Any, *, model_name: str | None = None) -> dict[str, Any]:
    """The checked fields (``planner.cost.CHECKED_FIELDS``, from ``engine.model_info.model_metadata``)
    plus provenance, for ``model`` in the current process."""
    param = next(model.parameters())
    info = provenance(device=param.device, dtype=param.dtype)
    info.update(model_metadata(model, model_name=model_name or model_name_of(model)))
    info["float32_matmul_precision"] = torch.get_float32_matmul_precision()
    return info


def load_calibration(
    path: str | os.PathLike, *, model: Any, model_name: str | None = None, override: bool = False,
    prefill_graphs: bool | None = None,
) -> CostCoefficients:
    """Coefficients of a cost file, after checking its provenance against ``model`` as it is now
    (``CostFile.check`` with ``model_metadata``; the name as given, else ``model_name_of(model)``, as
    ``Rollout`` checks ``RolloutConfig(costs=path)``; and whether the setting captures its prefill
    forwards when ``prefill_graphs`` is given). A mismatch, or a file without metadata, raises
    ValueError naming each differing field; ``override=True`` accepts it."""
    expected = model_metadata(model, model_name=model_name or model_name_of(model), prefill_graphs=prefill_graphs)
    return CostFile.read(path).check(expected, override=override)
