"""The EOS long-tail benchmark: RL rows that end at EOS at very different times, on fixed slots or
on the paged pool.

    from rollout_lab.measure.long_tail import run_long_tail
    record = run_long_tail(model, model_name="qwen2.5-0.5b", dtype="bfloat16")   # EOS_LONG_TAIL's shape

The workload (``measure.workloads.eos_long_tail``): 512 random-token prompts of GPQA's lengths
(drawn with replacement) and ``round(hazard * vocab)`` EOS ids; sampled at temperature 1 a
random-weight model ends a row with probability ~hazard per step, so response lengths are geometric
(hazard 1/295: p50 ~204, p90 ~680, the longest of 512 ~1,800 of the 2048-token budget).

Paths (``LONG_TAIL_PATHS``): the aligned cache (``mode="bucketed"``) and the paged pool
(``mode="paged"``), each on ``slots`` slots (``*_128``; the names keep 128, the record the slots
used), the paged pool with as many slots as its memory holds (``paged_memory``) and the aligned cache
with every row at once (``aligned_all``); ``paged_128_eos_every_step`` is ``paged_128`` reading the
tokens back after every step (``eos_check_interval=1``) instead of every few, and
``paged_128_admit_256`` with each turn's prefill bounded to 256 tokens (``admit_tokens_per_step``;
not run by default), and ``paged_128_fp8_kv`` with its pool in e4m3 (``kv_cache_dtype="fp8"``; not
run by default). Each path: one warm-up
call (compile and capture, timed as ``first_call_ms``), ``reps`` timed calls and one profiled call, all with the same seed, so every path
samples the same tokens in exact arithmetic (bf16 kernels may differ). Output tok/s counts the tokens
generated; the profile says why: decode steps, live rows per step, occupancy of the slots (over every
step, and over the steps taken while rows still waited: the route's own effect), preemptions, and the
paged pool's peak blocks against its live tokens. Every call is timed whole with the device
synchronised; peak memory is over the weights. ``rollout-lab bench long-tail`` is its command line
(``--preset qwen2.5-0.5b --out data/results/long_tail_qwen2.5-0.5b_bfloat16_cuda`` on the H200; ``--tiny
qwen2 --dataset gsm8k --num-prompts 16 --max-new-tokens 128 --hazard 0.05 --slots 4`` is a CPU check in
seconds: GSM8K's prompts fit the tiny model's 512 positions).
"""
from __future__ import annotations

import statistics
import sys
from collections import Counter
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from rollout_lab.engine.api.config import RolloutConfig
from rollout_lab.engine.profile import synchronize, timed_ms
from rollout_lab.engine.api.rollout import Rollout
from rollout_lab.engine.limits import ModelLimits, rows_at_once
from rollout_lab.measure.models import special_token_ids
from rollout_lab.measure.provenance import provenance
from rollout_lab.measure.rl import peak_memory_over
from rollout_lab.measure.paths import check_timed_calls, release_memory
from rollout_lab.measure.sections import measure_or_load
from rollout_lab.measure.workloads import DATASETS, EOS_LONG_TAIL, eos_long_tail, lengths_to_prompts, load_lengths
from rollout_lab.planner.checks import check_int, is_int

# path name -> engine settings; ``slots`` replaces the continuous_batch_size of the *_128 paths
LONG_TAIL_PATHS: dict[str, dict[str, Any]] = {
    "aligned_128": dict(mode="bucketed", continuous_batch_size=128),
    "paged_128": dict(mode="paged", continuous_batch_size=128),
    # the same with the host reading the sampled tokens after every step (eos_check_interval=1): what
    # the default interval's fewer reads save, side by side
    "paged_128_eos_every_step": dict(mode="paged", continuous_batch_size=128, eos_check_interval=1),
    # the same with each turn's prefill bounded (longer prompts in chunks between steps): what the
    # bounded stall costs in throughput
    "paged_128_admit_256": dict(mode="paged", continuous_batch_size=128, admit_tokens_per_step=256),
    # the same with the decode step's projections unfused (engine.runner.fusing off): what the fusion saves
    "paged_128_unfused": dict(mode="paged", continuous_batch_size=128, fuse_projections=False),
    # the same with the whole model compiled as one graph (compile=True) instead of each decoder
    # layer (engine.runner.compiling): its step and first call against the layers'
    "paged_128_compile_model": dict(mode="paged", continuous_batch_size=128, compile=True),
    # the same with the pool in e4m3 (kv_cache_dtype="fp8", engine.kernels.kv_fp8): half the KV bytes a step reads
    "paged_128_fp8_kv": dict(mode="paged", continuous_batch_size=128, kv_cache_dtype="fp8"),
    "paged_memory": dict(mode="paged"),  # as many slots as the pool holds
    "aligned_all": dict(mode="bucketed"),  # every row at once
}
LONG_TAIL_DEFAULT_PATHS = ("paged_128", "paged_128_eos_every_step", "aligned_128", "paged_memory", "aligned_all")
# run_long_tail's settings and their defaults (its signature's): the shape, one timed call per path
LONG_TAIL_DEFAULTS: dict[str, Any] = {**EOS_LONG_TAIL, "reps": 1, "paths": LONG_TAIL_DEFAULT_PATHS}


def path_settings(path: str, *, slots: int) -> dict[str, Any]:
    """The engine settings of ``path``, ``slots`` in place of a fixed slot count."""
    settings = dict(LONG_TAIL_PATHS[path])
    if "continuous_batch_size" in settings:
        settings["continuous_batch_size"] = slots
    return settings


def check_long_tail_settings(*, num_prompts: int, dataset: str, hazard: float, max_new_tokens: int, slots: int,
                             seed: int, reps: int, paths: Sequence[str], limits: ModelLimits | None = None) -> None:
    """ValueError naming the first bad setting of ``run_long_tail`` and what would be valid; with
    ``limits`` (the model's) the dataset's longest prompt and ``max_new_tokens`` within the context,
    the prompts and outputs within the host's memory, and the rows the paths decode at once (their
    slots; every row for ``aligned_all``) within the device's."""
    for name, value in (("max_new_tokens", max_new_tokens), ("slots", slots)):
        if not is_int(value) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    check_timed_calls(reps, name="reps")
    if not is_int(seed) or seed < 0:
        raise ValueError(f"seed must be an int >= 0, got {seed!r}")
    unknown = [p for p in paths if p not in LONG_TAIL_PATHS]
    if unknown or not paths:
        raise ValueError(f"unknown long-tail paths {unknown or '(none given)'}; valid: {', '.join(LONG_TAIL_PATHS)}")
    # the workload's own checks (num_prompts, dataset, hazard) on one prompt and a vocabulary of one id:
    # drawing num_prompts lengths waits for the limits below
    check_int(num_prompts, name="num_prompts")
    eos_long_tail(1, num_prompts=1, dataset=dataset, hazard=hazard, seed=seed)
    if limits is None:
        return
    longest = {name: max(load_lengths(name)) for name in DATASETS}  # drawn with replacement: any may come
    positions = longest[dataset] + max_new_tokens
    what = f"{dataset}'s longest prompt ({longest[dataset]} tokens) and {max_new_tokens} new tokens"
    if limits.max_positions is not None and longest[dataset] >= limits.max_positions:
        fitting = [name for name, n in longest.items() if n < limits.max_positions]
        limits.check_context("dataset", dataset, positions=positions, what=what,
                             valid=f"a dataset whose prompts fit: {', '.join(fitting)}" if fitting
                             else "a model with a longer context")
    limits.check_context("max_new_tokens", max_new_tokens, positions=positions, what=what,
                         most=None if limits.max_positions is None else limits.max_positions - longest[dataset])
    at_once = max(rows_at_once(num_prompts, mode=settings["mode"], slots=settings.get("continuous_batch_size"))
                  for settings in (path_settings(path, slots=slots) for path in paths))
    limits.check_kv("num_prompts" if at_once == num_prompts else "slots",
                    num_prompts if at_once == num_prompts else slots, rows=at_once, positions=positions)
    limits.check_host_tokens("num_prompts", num_prompts, rows=num_prompts, tokens_per_row=positions)


def run_long_tail(
    model: Any, *, model_name: str, dtype: str, num_prompts: int = 512, dataset: str = "gpqa_diamond",
    hazard: float = 1 / 295, max_new_tokens: int = 2048, slots: int = 128, seed: int = 0, reps: int = 1,
    paths: Sequence[str] = LONG_TAIL_DEFAULT_PATHS, config: Mapping[str, Any] | None = None,
    save: Callable[[dict[str, Any]], Any] = lambda record: None, **prov: Any,
) -> dict[str, Any]:
    """Every path of ``paths`` in order on ``model`` (built, on its device); the record (kind
    "eos_long_tail"). ``save(record)`` runs after each path, so a later failure loses nothing.
    ``config`` adds to the record's settings (a command line's model options); ``prov`` to its
    provenance (the script and its argv). Bad settings are a ValueError before any work."""
    paths = list(paths)
    check_long_tail_settings(num_prompts=num_prompts, dataset=dataset, hazard=hazard, max_new_tokens=max_new_tokens,
                             slots=slots, seed=seed, reps=reps, paths=paths, limits=ModelLimits.of_model(model))
    device = next(model.parameters()).device
    cfg = model.config.get_text_config(decoder=True)
    vocab = model.get_input_embeddings().weight.shape[0]
    pad_id = cfg.pad_token_id if cfg.pad_token_id is not None else 0
    special = special_token_ids(cfg)
    lengths, eos_ids = eos_long_tail(vocab, num_prompts=num_prompts, dataset=dataset, hazard=hazard, seed=seed,
                                     special_ids=special)
    prompts = lengths_to_prompts(lengths, vocab_size=vocab, seed=seed, special_ids=special)
    settings = {"num_prompts": num_prompts, "dataset": dataset, "hazard": hazard, "max_new_tokens": max_new_tokens,
                "slots": slots, "seed": seed, "reps": reps, "paths": paths, "dtype": dtype}
    results: dict[str, Any] = {}
    record = {
        "kind": "eos_long_tail",
        "provenance": provenance(device=device, dtype=dtype, **prov),
        "config": settings | dict(config or {}) | {"model": model_name},
        "workload": {"lengths": lengths, "eos_token_ids": eos_ids, "max_new_tokens": max_new_tokens,
                     "hazard": hazard, "dataset": dataset, "num_prompt_tokens": sum(lengths)},
        "results": results,
    }
    generate = dict(max_new_tokens=max_new_tokens, do_sample=True, temperature=1.0, seed=seed)
    for path in paths:
        engine_settings = path_settings(path, slots=slots)
        engine = RolloutConfig(eos_token_id=eos_ids, pad_token_id=pad_id, **engine_settings)
        results[path] = _run_path(model, prompts, engine, generate, device, path=path, reps=reps) \
            | {"settings": engine_settings}
        release_memory(device)
        synchronize(device)
        save(record)
    return record


def _run_path(model, prompts, config: RolloutConfig, generate: Mapping[str, Any], device: torch.device, *,
              path: str, reps: int) -> dict[str, Any]:
    baseline = torch.cuda.memory_allocated(device) if device.type == "cuda" else None  # the weights
    if baseline is not None:
        torch.cuda.reset_peak_memory_stats(device)
    rollout = Rollout(model, config)
    first_ms, _ = timed_ms(lambda: rollout.generate(prompts, progress=False, **generate), device)
    print(f"{path:13s} warm-up {first_ms:10.1f} ms (compile and capture included)", file=sys.stderr)
    samples = []
    for rep in range(reps):
        ms, result = timed_ms(lambda: rollout.generate(prompts, progress=False, **generate), device)
        samples.append(ms)
        print(f"{path:13s} rep {rep + 1}  {ms:10.1f} ms", file=sys.stderr)
    peak = peak_memory_over(device, baseline)
    prof = rollout.generate(prompts, profile=True, progress=False, **generate).profile
    rollout.close()
    response_lengths = [len(s) for s in result.sequences]
    num_tokens = sum(response_lengths)
    mean_ms = statistics.fmean(samples)
    paged = prof.kv_block_size is not None
    out = {
        "samples_ms": samples, "mean_ms": mean_ms, "first_call_ms": first_ms, "route": result.route,
        "output_tokens": num_tokens, "output_tokens_per_s": num_tokens / (mean_ms / 1e3),
        "response_p50": float(np.percentile(response_lengths, 50)),
        "response_p90": float(np.percentile(response_lengths, 90)), "response_max": max(response_lengths),
        "finish_reasons": dict(Counter(result.finish_reasons)),
        "num_decode_steps": prof.num_decode_forwards, "live_rows_per_step": prof.live_rows_per_step,
        "occupancy": prof.occupancy, "queued_occupancy": prof.queued_occupancy, "num_slots": prof.num_slots,
        "num_preemptions": prof.num_preemptions, "max_turn_prefill_tokens": prof.max_turn_prefill_tokens,
        "kv_block_size": prof.kv_block_size, "num_kv_blocks": prof.num_kv_blocks,
        "peak_kv_blocks": prof.peak_kv_blocks, "peak_live_tokens": prof.peak_live_tokens,
        # the pool's blocks at their peak over the tokens its live rows held: what paging wastes
        "peak_kv_bytes_over_live": prof.peak_kv_blocks * prof.kv_block_size / prof.peak_live_tokens
        if paged and prof.peak_live_tokens else None,
        "cache_bytes": prof.cache_bytes, "prefill_ms": prof.prefill_ms, "decode_ms": prof.decode_ms,
        # the profiled call's other phases, and its decode time by live rows: where a step's ms go
        "cache_ms": prof.cache_ms, "planning_ms": prof.planning_ms, "profiled_total_ms": prof.total_ms,
        "decode_by_rows": decode_by_rows(prof.forwards or []),
        "peak_memory_bytes": peak,
    }
    print(f"{path:13s} {out['output_tokens_per_s']:10.0f} tok/s  {out['num_slots']} slots at "
          f"{out['occupancy']:.0%}  {out['num_decode_steps']} decode steps  "
          f"{out['num_preemptions']} preemptions", file=sys.stderr)
    return out


def decode_by_rows(forwards: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """A profiled call's decode bursts grouped by live rows in power-of-two bins (1, 2, 3-4, 5-8, ...):
    each bin's steps, ms and ms per step, so the tail's few-row steps and the full ones are priced
    apart (``Profile.forwards``' ``decode`` records; the ms include the host's work between steps)."""
    bins: dict[int, list[float]] = {}
    for f in forwards:
        if f["kind"] != "decode":
            continue
        top = 1 << max(int(f["rows"]) - 1, 0).bit_length()  # the bin's largest row count
        steps_ms = bins.setdefault(top, [0, 0.0])
        steps_ms[0] += int(f["steps"])
        steps_ms[1] += float(f["ms"])
    return [{"rows_min": top // 2 + 1 if top > 1 else 1, "rows_max": top, "steps": steps, "ms": ms,
             "ms_per_step": ms / steps if steps else None}
            for top, (steps, ms) in sorted(bins.items())]


def long_tail_rows(record: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One row per path of an EOS long-tail record: output tok/s, slots and their occupancy, decode
    steps, preemptions, response lengths and peak memory; ``git_sha`` (7 characters) names the code."""
    sha = str(record.get("provenance", {}).get("git_sha") or "")[:7]
    rows = []
    for path, res in record["results"].items():
        peak = res.get("peak_memory_bytes")
        rows.append({"path": path, "git_sha": sha, "mode": res["settings"]["mode"], "slots": res["num_slots"],
                     "output_tokens_per_s": res["output_tokens_per_s"], "mean_ms": res["mean_ms"],
                     "first_call_ms": res["first_call_ms"], "output_tokens": res["output_tokens"],
                     "occupancy": res["occupancy"], "queued_occupancy": res["queued_occupancy"],
                     "live_rows_per_step": res["live_rows_per_step"],
                     "num_decode_steps": res["num_decode_steps"], "num_preemptions": res["num_preemptions"],
                     "response_p50": res["response_p50"], "response_p90": res["response_p90"],
                     "response_max": res["response_max"], "peak_memory_gb": None if peak is None else peak / 1e9})
    return rows


def step_cost_rows(record: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One row per (path, live-rows bin) of an EOS long-tail record's ``decode_by_rows`` (records
    made before it was kept have none): the steps, their ms and ms per step, and the bin's share of
    the path's decode steps and decode ms."""
    rows = []
    for path, res in record["results"].items():
        bins = res.get("decode_by_rows") or []
        steps, ms = sum(b["steps"] for b in bins), sum(b["ms"] for b in bins)
        rows += [{"path": path, "slots": res["num_slots"], "rows_min": b["rows_min"], "rows_max": b["rows_max"],
                  "steps": b["steps"], "ms": b["ms"], "ms_per_step": b["ms_per_step"],
                  "share_of_steps": b["steps"] / steps, "share_of_decode_ms": b["ms"] / ms}
                 for b in bins]
    return rows


def long_tail_or_load(
    *, long_tail_shape: Mapping[str, Any] | None, long_tail_results_file: str | None, model: str, dtype: str,
    device: str, output_dir: Any = None,
) -> tuple[str, dict[str, Any]] | None:
    """(name, record) of the EOS long-tail run notebook 03 shows: ``long_tail_shape`` (``run_long_tail``'s
    settings, ``LONG_TAIL_DEFAULTS`` where it says nothing) measured on ``model`` into
    ``<workspace>/data/results/long_tail_<model>_<dtype>_<device>`` (written after every path), else the
    saved record ``long_tail_results_file``, else None (``sections.measure_or_load``: giving both, bad
    settings and a record in the way are errors raised before the model is built)."""
    def check(shape, limits):
        check_long_tail_settings(**{k: shape[k] for k in ("num_prompts", "dataset", "hazard", "max_new_tokens",
                                                          "slots", "seed", "reps", "paths")}, limits=limits)

    def run(net, name, shape, save, script):
        return run_long_tail(net, model_name=name, dtype=dtype, save=save, script=script, **shape)

    return measure_or_load("long_tail", shape=long_tail_shape, results_file=long_tail_results_file,
                           kind="eos_long_tail", defaults=LONG_TAIL_DEFAULTS, check=check, run=run,
                           rows=long_tail_rows, model=model, dtype=dtype, device=device, output_dir=output_dir)
