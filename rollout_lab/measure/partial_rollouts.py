"""Partial rollouts on the EOS long tail (issue 55): a call that returns once ``finish_fraction`` of
its rows finished against the full call, and a loop of consecutive calls that each carry the last
call's unfinished rows beside new prompts against a loop of full calls.

    from rollout_lab.measure.partial_rollouts import run_partial_rollouts
    record = run_partial_rollouts(model, model_name="qwen2.5-0.5b", dtype="bfloat16")   # EOS_LONG_TAIL's shape

The workload is ``measure.long_tail``'s (``measure.workloads.eos_long_tail``: random-token prompts
of a dataset's lengths, geometric response lengths), on the paged pool with ``slots`` slots.

- **one call**: the full call and the call with ``finish_fraction`` on the same prompts and seed, each
  warmed up once and timed ``reps`` times; the issue's target is the partial call in at most 0.6x
  the full call's time.
- **the loop**: ``num_calls`` calls of ``num_prompts`` rows each. The full loop runs call k's prompts
  (seed + k) to the end; the partial loop runs the last call's continuations first, then as many of
  call k's prompts as keep the call at ``num_prompts`` rows, with ``finish_fraction``. Delivered tokens
  are the finished rows' whole responses (a continued row's earlier tokens included, as the trainer
  gets them); the rows still unfinished after the last call are not delivered. The issue's target is
  the partial loop's delivered tokens per second at least 1.4x the full loop's.

Every call is timed whole with the device synchronised. ``--tiny`` shapes run on the CPU in seconds:
``run_partial_rollouts(tiny, model_name="tiny-qwen2", dtype="float32", dataset="gsm8k", num_prompts=16,
max_new_tokens=64, hazard=0.05, slots=4)``.
"""
from __future__ import annotations

import statistics
import sys
from collections import Counter
from typing import Any, Callable, Mapping, Sequence

import torch

from rollout_lab.engine.api.call import check_finish_fraction
from rollout_lab.engine.api.config import RolloutConfig
from rollout_lab.engine.api.rollout import Rollout
from rollout_lab.engine.limits import ModelLimits
from rollout_lab.engine.profile import timed_ms
from rollout_lab.engine.sched.request import Continuation
from rollout_lab.measure.long_tail import check_long_tail_settings
from rollout_lab.measure.models import special_token_ids
from rollout_lab.measure.provenance import provenance
from rollout_lab.measure.sections import measure_or_load
from rollout_lab.measure.workloads import eos_long_tail, lengths_to_prompts
from rollout_lab.planner.checks import check_int

# the targets: the partial call's time over the full call's (at most), the partial loop's
# delivered tokens per second over the full loop's (at least)
PARTIAL_CALL_TIME_TARGET = 0.6
PARTIAL_LOOP_SPEEDUP_TARGET = 1.4
MAX_LOOP_CALLS = 64
# run_partial_rollouts' settings and their defaults (its signature's): the command line's defaults
PARTIAL_ROLLOUT_DEFAULTS: dict[str, Any] = {
    "num_prompts": 512, "dataset": "gpqa_diamond", "hazard": 1 / 295, "max_new_tokens": 2048, "slots": 128,
    "seed": 0, "reps": 1, "finish_fraction": 0.9, "num_calls": 4}


def check_partial_settings(*, num_prompts: int, dataset: str, hazard: float, max_new_tokens: int, slots: int,
                           seed: int, reps: int, finish_fraction: float, num_calls: int,
                           limits: ModelLimits | None = None) -> None:
    """ValueError naming the first bad setting of ``run_partial_rollouts`` and what would be valid
    (the long tail's checks, on the paged path, and the model's ``limits`` when given)."""
    check_long_tail_settings(num_prompts=num_prompts, dataset=dataset, hazard=hazard, max_new_tokens=max_new_tokens,
                             slots=slots, seed=seed, reps=reps, paths=["paged_128"], limits=limits)
    check_finish_fraction(finish_fraction)
    if finish_fraction is None:
        raise ValueError("finish_fraction must be a number in (0, 1] here, got None: the benchmark compares it")
    check_int(num_calls, name="num_calls", minimum=1, maximum=MAX_LOOP_CALLS)


def run_partial_rollouts(
    model: Any, *, model_name: str, dtype: str, num_prompts: int = 512, dataset: str = "gpqa_diamond",
    hazard: float = 1 / 295, max_new_tokens: int = 2048, slots: int = 128, seed: int = 0, reps: int = 1,
    finish_fraction: float = 0.9, num_calls: int = 4, config: Mapping[str, Any] | None = None,
    save: Callable[[dict[str, Any]], Any] = lambda record: None, **prov: Any,
) -> dict[str, Any]:
    """The one-call comparison, then the loops, on ``model`` (built, on its device); the record (kind
    "partial_rollouts"), ``save``d after each part. Bad settings are a ValueError before any work."""
    check_partial_settings(num_prompts=num_prompts, dataset=dataset, hazard=hazard, max_new_tokens=max_new_tokens,
                           slots=slots, seed=seed, reps=reps, finish_fraction=finish_fraction, num_calls=num_calls,
                           limits=ModelLimits.of_model(model))
    device = next(model.parameters()).device
    cfg = model.config.get_text_config(decoder=True)
    vocab = model.get_input_embeddings().weight.shape[0]
    special = special_token_ids(cfg)
    pad_id = cfg.pad_token_id if cfg.pad_token_id is not None else 0
    calls = []  # per loop call k: its new prompts (seed + k); call 0's are the one-call comparison's
    eos_ids: list[int] = []
    for k in range(num_calls):
        lengths, eos_ids = eos_long_tail(vocab, num_prompts=num_prompts, dataset=dataset, hazard=hazard,
                                         seed=seed + k, special_ids=special)
        calls.append(lengths_to_prompts(lengths, vocab_size=vocab, seed=seed + k, special_ids=special))
    settings = {"num_prompts": num_prompts, "dataset": dataset, "hazard": hazard, "max_new_tokens": max_new_tokens,
                "slots": slots, "seed": seed, "reps": reps, "finish_fraction": finish_fraction,
                "num_calls": num_calls, "dtype": dtype}
    results: dict[str, Any] = {}
    record = {
        "kind": "partial_rollouts",
        "provenance": provenance(device=device, dtype=dtype, **prov),
        "config": settings | dict(config or {}) | {"model": model_name},
        "workload": {"eos_token_ids": eos_ids, "num_prompt_tokens": [sum(map(len, p)) for p in calls]},
        "targets": {"partial_call_time": PARTIAL_CALL_TIME_TARGET, "partial_loop_speedup": PARTIAL_LOOP_SPEEDUP_TARGET},
        "results": results,
    }
    engine = RolloutConfig(mode="paged", continuous_batch_size=slots, eos_token_id=eos_ids, pad_token_id=pad_id)
    generate = dict(max_new_tokens=max_new_tokens, do_sample=True, temperature=1.0)
    rollout = Rollout(model, engine)
    one = {}
    for name, fraction in (("full", None), ("partial", finish_fraction)):
        one[name] = _time_call(rollout, calls[0], device, reps=reps, name=name,
                               finish_fraction=fraction, seed=seed, **generate)
    one["time_ratio"] = one["partial"]["mean_ms"] / one["full"]["mean_ms"]
    results["one_call"] = one
    save(record)
    # one profiled call of each on the same prompts: the live rows over its time (the profile's forwards)
    results["trace"] = {}
    for name, fraction in (("full", None), ("partial", finish_fraction)):
        result = rollout.generate(calls[0], finish_fraction=fraction, seed=seed, profile=True, progress=False,
                                  **generate)
        results["trace"][name] = live_rows_trace(result.profile.forwards)
    save(record)
    loops = {"full": _run_loop(rollout, calls, device, finish_fraction=None, seed=seed, **generate),
             "partial": _run_loop(rollout, calls, device, finish_fraction=finish_fraction, seed=seed, **generate)}
    loops["speedup"] = loops["partial"]["delivered_tokens_per_s"] / loops["full"]["delivered_tokens_per_s"]
    results["loop"] = loops
    rollout.close()
    save(record)
    print(f"one call: partial {one['time_ratio']:.2f}x the full call's time (target <= {PARTIAL_CALL_TIME_TARGET}); "
          f"loop of {num_calls}: {loops['speedup']:.2f}x the delivered tok/s (target >= {PARTIAL_LOOP_SPEEDUP_TARGET})",
          file=sys.stderr)
    return record


def _time_call(rollout: Rollout, prompts: Sequence[Sequence[int]], device: torch.device, *, reps: int, name: str,
               **generate: Any) -> dict[str, Any]:
    """One warm-up and ``reps`` timed calls of ``prompts``: their times, tokens and finish reasons."""
    rollout.generate(prompts, progress=False, **generate)
    samples, result = [], None
    for _ in range(reps):
        ms, result = timed_ms(lambda: rollout.generate(prompts, progress=False, **generate), device)
        samples.append(ms)
    mean_ms = statistics.fmean(samples)
    tokens = sum(map(len, result.sequences))
    print(f"{name:8s} {mean_ms:10.1f} ms  {tokens} tokens", file=sys.stderr)
    return {"samples_ms": samples, "mean_ms": mean_ms, "output_tokens": tokens,
            "output_tokens_per_s": tokens / (mean_ms / 1e3), "finish_reasons": dict(Counter(result.finish_reasons)),
            "num_unfinished_rows": len(result.unfinished)}


def _run_loop(rollout: Rollout, calls: Sequence[Sequence[Sequence[int]]], device: torch.device, *,
              finish_fraction: float | None, seed: int, **generate: Any) -> dict[str, Any]:
    """``len(calls)`` consecutive calls of ``len(calls[0])`` rows: the last call's continuations
    first, then call k's first new prompts (sampled with seed + k); per call its ms, rows, generated
    and delivered tokens, and the totals."""
    carried: list[Continuation] = []
    per_call = []
    for k, prompts in enumerate(calls):
        batch = [*carried, *prompts[: len(prompts) - len(carried)]]
        ms, result = timed_ms(lambda: rollout.generate(batch, finish_fraction=finish_fraction, seed=seed + k,
                                                       profile=True, progress=False, **generate), device)
        delivered = sum(len(s) for s, reason in zip(result.sequences, result.finish_reasons) if reason != "unfinished")
        per_call.append({"ms": ms, "rows": len(batch), "continued_rows": len(carried),
                         "generated_tokens": result.profile.num_generated_tokens, "delivered_tokens": delivered,
                         "unfinished_rows": len(result.unfinished), "decode_steps": result.profile.num_decode_forwards,
                         "live_rows_per_step": result.profile.live_rows_per_step})
        carried = list(result.unfinished)
    total_ms = sum(c["ms"] for c in per_call)
    delivered = sum(c["delivered_tokens"] for c in per_call)
    generated = sum(c["generated_tokens"] for c in per_call)
    return {"calls": per_call, "total_ms": total_ms, "delivered_tokens": delivered, "generated_tokens": generated,
            "delivered_tokens_per_s": delivered / (total_ms / 1e3), "generated_tokens_per_s": generated / (total_ms / 1e3),
            "left_unfinished": len(carried)}


def live_rows_trace(forwards: Sequence[Mapping[str, Any]]) -> list[list[float]]:
    """The live rows over a profiled call's time from its ``Profile.forwards``: [ms, rows] where a decode
    burst changes them (a prefill keeps the rows before it, 0 at the start: they wait for it), and
    [its end, 0]; ms count every timed forward from the first (the host's time between them is left out)."""
    points, clock = [], 0.0
    for forward in forwards:
        rows = forward.get("rows", 0) if forward["kind"] == "decode" else (points[-1][1] if points else 0)
        if not points or points[-1][1] != rows:
            points.append([clock, rows])
        clock += forward["ms"]
    return points + [[clock, 0]]


def partial_rollout_rows(record: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The record as table rows: the one-call comparison's two calls (part "one_call", loop "full" or
    "partial", call 0), then each loop's calls (part "loop": ms, rows, continued, delivered tokens),
    as far as the record got (it is saved after each part)."""
    results = record["results"]
    rows = [{"part": "one_call", "loop": name, "call": 0, "ms": results["one_call"][name]["mean_ms"],
             "output_tokens": results["one_call"][name]["output_tokens"]}
            for name in ("full", "partial") if name in results.get("one_call", {})]
    return rows + [{"part": "loop", "loop": name, "call": k, **call} for name in ("full", "partial")
                   if name in results.get("loop", {}) for k, call in enumerate(results["loop"][name]["calls"])]



def partial_rollouts_or_load(
    *, partial_rollouts_shape: Mapping[str, Any] | None, partial_rollouts_results_file: str | None, model: str,
    dtype: str, device: str, output_dir: Any = None,
) -> tuple[str, dict[str, Any]] | None:
    """(name, record) of the partial-rollouts run notebook 03 shows: ``partial_rollouts_shape``
    (``run_partial_rollouts``' settings, ``PARTIAL_ROLLOUT_DEFAULTS`` where it says nothing) measured on
    ``model`` into ``<workspace>/data/results/partial_rollouts_<model>_<dtype>_<device>`` (written after
    each part), else the saved record ``partial_rollouts_results_file``, else None
    (``sections.measure_or_load``: giving both, bad settings and a record in the way are errors raised
    before the model is built)."""
    def run(net, name, shape, save, script):
        return run_partial_rollouts(net, model_name=name, dtype=dtype, script=script, save=save, **shape)

    return measure_or_load("partial_rollouts", shape=partial_rollouts_shape,
                           results_file=partial_rollouts_results_file, kind="partial_rollouts",
                           defaults=PARTIAL_ROLLOUT_DEFAULTS,
                           check=lambda shape, limits: check_partial_settings(**shape, limits=limits), run=run,
                           rows=partial_rollout_rows, model=model, dtype=dtype, device=device, output_dir=output_dir)
