"""What a calibration measures and how: the shape grid, and timed probes on the engine's own code paths.

    from rollout_lab.calibrate_measure import CalibrationGrid, measure_prefill, measure_decode_overhead
    grid = CalibrationGrid.tiny()
    prefill = measure_prefill(model, grid)          # forward and KV-copy ms per (batch, width)
    decode = measure_decode_overhead(model, grid)   # nocb and CB ms per decode step

- ``forward_ms``: one prefill forward of a uniform (batch, width) bucket (``decode.prefill_bucket``);
- ``kv_copy_ms``: copying that bucket's KV into the aligned cache (``AlignedKVCache.admit``);
- CB and nocb decode per step, each from whole ``Rollout.generate`` calls with ``decode_steps + 1``
  and 1 new tokens.
Warm-up passes are never timed and the device is synchronised around every clock read. The fit of
these times to C(B, L) is ``calibrate.fit_coefficients``; torch is imported only when a probe runs.
"""
from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass
from typing import Any

from rollout_lab.timing import timed_ms

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
