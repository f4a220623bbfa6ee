"""Shared prompt blocks on the paged route, measured (issue 54): the samples of a prompt each holding
a copy of its KV (today's route) against pointing at its blocks once, and the decode reading a
group's shared blocks once per step against once per row.

    from rollout_lab.measure.prefix_sharing import run_prefix_sharing
    record = run_prefix_sharing(model, model_name="qwen2.5-3b", dtype="bfloat16")   # grpo_long_prompt
    sweep = run_prefix_sharing(model, model_name="qwen2.5-3b", dtype="bfloat16", prompt_lengths=[256, 1024, 2048])

The workload (``measure.workloads.SAMPLED_WORKLOADS``): ``grpo_long_prompt`` (32 random-token
prompts of 1,500-2,500 tokens x 16 samples x 512 new tokens, T=1, set for Qwen2.5-3B) or
``many_samples_short`` (128 GSM8K-length prompts x 32 x 256, set for Llama-3.2-1B), EOS ignored.
``num_prompts`` (the workload's first ones), ``num_samples`` and ``max_new_tokens`` override the
workload's; ``scale`` multiplies its prompt lengths; ``prompt_lengths`` replaces them with a sweep:
one case per length, every prompt that long (notebook 03's figure over prefix length).

Paths (``PREFIX_SHARING_PATHS``), all on the paged route (``mode="paged"``):

- ``copies``: ``share_prompt_blocks=False``, every sample holding its own copy of its prompt's blocks;
- ``shared``: ``share_prompt_blocks=True``, the decode's read as the engine picks it;
- ``shared_read_off`` / ``shared_read_on``: shared blocks, the decode reading them per row / once
  per group (``shared_prefix_attention``).

Each path keeps one Rollout across its calls: per case a warm-up call (compile and capture, kept as
``first_call_ms``), ``reps`` timed calls and one profiled call. Every call of a case gets prompts of
its own (round r's drawn from ``(seed, case, r)``), the same for every path in that round, and
samples at ``seed``, so the paths sample the same tokens in exact arithmetic; the record says what
fraction of rows equal the copies'. The paths run round by round, interleaved (drift hits them
alike), each keeping its pool between its calls, so their pools share the device; with
``sequential=True`` each path runs alone, its memory released before the next, for a workload whose
pools do not fit the device together (each path's ``num_kv_blocks`` and ``num_slots`` say what it
got). Every call is timed whole with the device synchronised, with no progress bar.

Per path: output tok/s, wall ms, the pool's peak blocks and tokens, the unique KV tokens and the
blocks held by more than one row at the peak, the KV bytes the decode read per step (where the
profile has them); per case the ratios of each path over ``copies`` and the peak KV over the unique
tokens. The record holds the numbers and the issue's targets (``ISSUE_TARGETS``) beside them, and
claims nothing. ``rollout-lab bench prefix-sharing`` is its command line (``--out
data/results/prefix_sharing_qwen2.5-3b_bfloat16_cuda`` on a GPU; ``--tiny qwen2 --scale 0.1
--num-prompts 4 --num-samples 4 --max-new-tokens 16 --reps 1`` is a CPU check in seconds);
``scripts/gpu/prefix_sharing.sh`` runs the issue's three shapes.
"""
from __future__ import annotations

import dataclasses
import math
import statistics
import sys
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from rollout_lab.engine.api.config import RolloutConfig
from rollout_lab.engine.api.rollout import Rollout
from rollout_lab.engine.limits import ModelLimits, check_call_rows, rows_at_once
from rollout_lab.engine.profile import synchronize, timed_ms
from rollout_lab.measure.grpo import check_samples
from rollout_lab.measure.models import special_token_ids
from rollout_lab.measure.paths import check_timed_calls, release_memory
from rollout_lab.measure.provenance import provenance
from rollout_lab.measure.sections import measure_or_load
from rollout_lab.measure.workloads import (SAMPLED_WORKLOADS, get_workload, lengths_to_prompts, padding_share,
                                           scale_keeping_prompts)
from rollout_lab.planner.checks import check_int, is_int

# path name -> the engine settings it adds to the paged route's
PREFIX_SHARING_PATHS: dict[str, dict[str, Any]] = {
    "copies": {"share_prompt_blocks": False},
    "shared": {"share_prompt_blocks": True},
    "shared_read_off": {"share_prompt_blocks": True, "shared_prefix_attention": "off"},
    "shared_read_on": {"share_prompt_blocks": True, "shared_prefix_attention": "on"},
}
BASELINE_PATH = "copies"  # the path every ratio divides by: today's paged route
PREFIX_SHARING_DEFAULT_PATHS = ("copies", "shared")
# run_prefix_sharing's settings and their defaults (its signature's); None: the workload's own
PREFIX_SHARING_DEFAULTS: dict[str, Any] = {
    "workload": "grpo_long_prompt", "num_prompts": None, "num_samples": None, "max_new_tokens": None, "scale": 1.0,
    "prompt_lengths": None, "seed": 0, "reps": 2, "paths": PREFIX_SHARING_DEFAULT_PATHS, "sequential": False}
# issue 54's targets on grpo_long_prompt, kept beside the numbers: the pool's peak KV tokens over the
# unique tokens it held (at most), and the shared path's output tok/s over the copies' (at least)
ISSUE_TARGETS = {"peak_kv_over_unique_at_most": 1.2, "tokens_per_s_over_copies_at_least": 2.0}
# the profile fields each path's result keeps (None where this engine's profile has none);
# prefix_cache_hits says no call read an earlier call's prompt blocks (each call's prompts are its own)
PROFILE_FIELDS = ("num_slots", "kv_block_size", "num_kv_blocks", "peak_kv_blocks", "peak_live_tokens",
                  "unique_kv_tokens", "shared_kv_blocks", "kv_bytes_read_per_step", "prefix_cache_hits",
                  "num_preemptions", "num_decode_forwards", "prefill_ms", "decode_ms", "cache_ms")
# the path results whose ratio over copies each case keeps
RATIO_FIELDS = ("output_tokens_per_s", "mean_ms", "peak_kv_tokens", "unique_kv_tokens", "kv_bytes_read_per_step")


def check_prefix_sharing_settings(*, workload: str, num_prompts: int | None, num_samples: int | None,
                                  max_new_tokens: int | None, scale: float, prompt_lengths: Sequence[int] | None,
                                  seed: int, reps: int, paths: Sequence[str], sequential: bool,
                                  limits: ModelLimits | None = None) -> None:
    """ValueError naming the first bad setting of ``run_prefix_sharing`` and what would be valid
    (a path whose setting this engine's ``RolloutConfig`` lacks too); with ``limits`` (the model's)
    the rows of one call (``engine.limits.check_call_rows``), the longest prompt and its budget
    within the context, one row's KV within the device's memory and every row's tokens within the
    host's."""
    shape = resolve_shape(workload=workload, num_prompts=num_prompts, num_samples=num_samples,
                          max_new_tokens=max_new_tokens, scale=scale, prompt_lengths=prompt_lengths)
    check_int(seed, name="seed", minimum=0)
    check_timed_calls(reps, name="reps")
    if not isinstance(sequential, bool):
        raise ValueError(f"sequential must be True or False, got {sequential!r}")
    if isinstance(paths, str) or not paths or len(set(paths)) != len(paths) \
            or any(p not in PREFIX_SHARING_PATHS for p in paths):
        raise ValueError(f"prefix-sharing paths must be distinct names from {', '.join(PREFIX_SHARING_PATHS)}; "
                         f"got {paths if isinstance(paths, str) else list(paths)}")
    engine_fields = {f.name for f in dataclasses.fields(RolloutConfig)}
    for path in paths:
        missing = [k for k in PREFIX_SHARING_PATHS[path] if k not in engine_fields]
        if missing:
            raise ValueError(f"path {path!r} sets RolloutConfig.{missing[0]}, which this engine does not have; "
                             f"leave it out (paths this engine runs: "
                             f"{', '.join(p for p, s in PREFIX_SHARING_PATHS.items() if set(s) <= engine_fields)})")
    if limits is None:
        return
    lengths = [n for case in shape["cases"] for n in case["lengths"]]
    samples, budget = shape["num_samples"], shape["max_new_tokens"]
    check_call_rows([samples] * len(shape["cases"][0]["lengths"]))  # what generate would refuse, before the model
    longest = max(lengths)
    positions = longest + budget
    room = None if limits.max_positions is None else limits.max_positions - budget  # the longest prompt that fits
    valid = None
    if budget >= longest:
        name, value = "max_new_tokens", budget
        most = None if limits.max_positions is None else limits.max_positions - longest
    else:
        name, value, most = ("prompt_lengths", list(prompt_lengths), None) if prompt_lengths is not None \
            else ("scale", scale, None)
        if room is not None and room < 1:
            valid = f"fewer than {limits.max_positions} max_new_tokens, and shorter prompts"
        elif room is not None and prompt_lengths is not None:
            valid = f"prompt lengths of at most {room}"
        elif room is not None:  # the largest scale keeping the longest prompt within room, rounded down
            fit = room / max(get_workload(workload)[:len(shape["cases"][0]["lengths"])])
            digits = 2 - math.floor(math.log10(fit))
            valid = f"scale <= {math.floor(fit * 10**digits) / 10**digits:g}, or fewer max_new_tokens"
    limits.check_context(name, value, positions=positions, most=most, valid=valid,
                         what=f"the longest prompt ({longest} tokens) and {budget} new tokens")
    rows = len(shape["cases"][0]["lengths"]) * samples
    limits.check_kv("num_samples", samples, rows=rows_at_once(rows, mode="paged", slots=None), positions=positions)
    limits.check_host_tokens("num_samples", samples, rows=rows, tokens_per_row=positions)


def resolve_shape(*, workload: str, num_prompts: int | None = None, num_samples: int | None = None,
                  max_new_tokens: int | None = None, scale: float = 1.0,
                  prompt_lengths: Sequence[int] | None = None) -> dict[str, Any]:
    """The run's shape: ``num_samples``, ``max_new_tokens`` and ``temperature`` (the workload's where
    None), and its cases, each ``{"prompt_length", "lengths"}``: the workload's first
    ``num_prompts`` lengths times ``scale`` (one case, prompt_length None), or with
    ``prompt_lengths`` one case per length, ``num_prompts`` prompts of it. ValueError naming a bad
    setting."""
    if workload not in SAMPLED_WORKLOADS:
        raise ValueError(f"workload must be one of {list(SAMPLED_WORKLOADS)}, got {workload!r}")
    spec = SAMPLED_WORKLOADS[workload]
    for name, value in (("num_prompts", num_prompts), ("max_new_tokens", max_new_tokens)):
        if value is not None:
            check_int(value, name=name)
    samples = spec["num_samples"] if num_samples is None else check_samples(num_samples)
    count = spec["num_prompts"] if num_prompts is None else num_prompts
    if count > spec["num_prompts"]:
        raise ValueError(f"num_prompts={count}: {workload} has {spec['num_prompts']} prompts; give at most "
                         f"{spec['num_prompts']}, or None (all of them)")
    if prompt_lengths is None:
        lengths = scale_keeping_prompts(get_workload(workload)[:count], scale, what=f"of {workload}")
        cases = [{"prompt_length": None, "lengths": lengths}]
    else:
        if isinstance(prompt_lengths, (str, bytes)) or not isinstance(prompt_lengths, Sequence) or not prompt_lengths \
                or not all(is_int(n) and n >= 1 for n in prompt_lengths) or len(set(prompt_lengths)) != len(prompt_lengths):
            raise ValueError(f"prompt_lengths must be distinct ints >= 1 (one case each), or None (the workload's "
                             f"lengths), got {prompt_lengths!r}")
        if scale != 1.0:
            raise ValueError(f"scale={scale!r} multiplies the workload's lengths, which prompt_lengths "
                             f"{list(prompt_lengths)} replace; give one of them (scale=1.0 with prompt_lengths)")
        cases = [{"prompt_length": int(n), "lengths": [int(n)] * count} for n in sorted(prompt_lengths)]
    return {"num_samples": samples, "max_new_tokens": spec["max_new_tokens"] if max_new_tokens is None else max_new_tokens,
            "temperature": spec["temperature"], "cases": cases}


def prompt_seed(seed: int, case: int, call: int) -> int:
    """The seed of the prompts of ``case``'s call ``call`` (0: the warm-up; reps + 1: the profiled
    one): one per (seed, case, call), so no two calls of a run share prompts."""
    return int(np.random.SeedSequence([seed, case, call]).generate_state(1)[0])


def run_prefix_sharing(
    model: Any, *, model_name: str, dtype: str, workload: str = "grpo_long_prompt", num_prompts: int | None = None,
    num_samples: int | None = None, max_new_tokens: int | None = None, scale: float = 1.0,
    prompt_lengths: Sequence[int] | None = None, seed: int = 0, reps: int = 2,
    paths: Sequence[str] = PREFIX_SHARING_DEFAULT_PATHS, sequential: bool = False,
    config: Mapping[str, Any] | None = None, save: Callable[[dict[str, Any]], Any] = lambda record: None,
    **prov: Any,
) -> dict[str, Any]:
    """Every path of ``paths`` on ``model`` (built, on its device) over each case of the shape; the
    record (kind "prefix_sharing"). ``save(record)`` runs after each case (each path with
    ``sequential``), so a later failure loses nothing. ``config`` adds to the record's settings (a
    command line's model options); ``prov`` to its provenance. Bad settings are a ValueError before
    any work."""
    settings = {"workload": workload, "num_prompts": num_prompts, "num_samples": num_samples,
                "max_new_tokens": max_new_tokens, "scale": scale, "prompt_lengths": prompt_lengths, "seed": seed,
                "reps": reps, "paths": paths, "sequential": sequential}
    check_prefix_sharing_settings(**settings, limits=ModelLimits.of_model(model))  # as given: a str is refused
    paths = settings["paths"] = list(paths)
    settings["prompt_lengths"] = None if prompt_lengths is None else list(prompt_lengths)
    shape = resolve_shape(workload=workload, num_prompts=num_prompts, num_samples=num_samples,
                          max_new_tokens=max_new_tokens, scale=scale, prompt_lengths=prompt_lengths)
    device = next(model.parameters()).device
    cfg = model.config.get_text_config(decoder=True)
    vocab = model.get_input_embeddings().weight.shape[0]
    pad_id = cfg.pad_token_id if cfg.pad_token_id is not None else 0
    special = special_token_ids(cfg)
    samples, budget = shape["num_samples"], shape["max_new_tokens"]
    cases = [{"prompt_length": c["prompt_length"], "lengths": c["lengths"],
              "mean_prompt_length": statistics.fmean(c["lengths"]), "num_prompt_tokens": sum(c["lengths"]),
              "padding_share": padding_share(c["lengths"]), "results": {}, "ratios": {}, "checks": {}}
             for c in shape["cases"]]
    record = {
        "kind": "prefix_sharing",
        "provenance": provenance(device=device, dtype=dtype, **prov),
        "config": settings | {"dtype": dtype} | dict(config or {}) | {"model": model_name},
        "workload": {"name": workload, "num_prompts": len(cases[0]["lengths"]), "num_samples": samples,
                     "max_new_tokens": budget, "temperature": shape["temperature"],
                     "num_rows": len(cases[0]["lengths"]) * samples,
                     "num_generated_tokens": len(cases[0]["lengths"]) * samples * budget},
        "targets": dict(ISSUE_TARGETS),
        "cases": cases,
    }
    generate = dict(num_samples=samples, max_new_tokens=budget, do_sample=True, temperature=shape["temperature"],
                    seed=seed)

    def prompts_of(case: int, call: int) -> list[list[int]]:
        return lengths_to_prompts(cases[case]["lengths"], vocab_size=vocab, seed=prompt_seed(seed, case, call),
                                  special_ids=special)

    def rollout_of(path: str) -> Rollout:
        return Rollout(model, RolloutConfig(mode="paged", ignore_eos=True, pad_token_id=pad_id,
                                            **PREFIX_SHARING_PATHS[path]))

    outputs: dict[tuple[int, str], list[list[int]]] = {}
    if sequential:
        for path in paths:
            rollout = rollout_of(path)
            for c in range(len(cases)):
                cases[c]["results"].update(_run_case({path: rollout}, c, prompts_of, generate, device, reps=reps,
                                                     outputs=outputs))
            rollout.close()
            release_memory(device)
            synchronize(device)
            for c in range(len(cases)):
                _compare(cases[c], c, outputs)
            save(record)
    else:
        rollouts = {path: rollout_of(path) for path in paths}
        for c in range(len(cases)):
            cases[c]["results"].update(_run_case(rollouts, c, prompts_of, generate, device, reps=reps,
                                                 outputs=outputs))
            _compare(cases[c], c, outputs)
            save(record)
        for rollout in rollouts.values():
            rollout.close()
        release_memory(device)
    return record


def _run_case(rollouts: Mapping[str, Rollout], case: int, prompts_of: Callable[[int, int], list[list[int]]],
              generate: Mapping[str, Any], device: torch.device, *, reps: int,
              outputs: dict[tuple[int, str], list[list[int]]]) -> dict[str, dict[str, Any]]:
    """Every path's Rollout of ``rollouts`` on case ``case``, round by round: a warm-up, ``reps``
    timed calls, a profiled call, each round's prompts the same for every path; each path's result,
    its last timed call's sequences into ``outputs``."""
    paths = list(rollouts)
    times: dict[str, list[float]] = {p: [] for p in paths}
    for call in range(reps + 1):  # call 0 is the warm-up
        prompts = prompts_of(case, call)
        for path in paths:
            ms, result = timed_ms(lambda: rollouts[path].generate(prompts, progress=False, **generate), device)
            times[path].append(ms)
            outputs[case, path] = result.sequences
            print(f"case {case}  {path:15s} {'warm-up' if call == 0 else f'rep {call}':8s} {ms:10.1f} ms",
                  file=sys.stderr)
    prompts = prompts_of(case, reps + 1)
    out = {}
    for path in paths:
        result = rollouts[path].generate(prompts, profile=True, progress=False, **generate)
        samples = times[path][1:]
        mean_ms = statistics.fmean(samples)
        num_tokens = sum(map(len, outputs[case, path]))
        out[path] = {"samples_ms": samples, "mean_ms": mean_ms, "first_call_ms": times[path][0],
                     "route": result.route, "output_tokens": num_tokens,
                     "output_tokens_per_s": num_tokens / (mean_ms / 1e3),
                     **_profile_fields(result.profile), "settings": dict(PREFIX_SHARING_PATHS[path])}
        print(f"case {case}  {path:15s} {out[path]['output_tokens_per_s']:10.0f} tok/s  peak "
              f"{out[path]['peak_kv_tokens']} KV tokens, {out[path]['unique_kv_tokens']} unique", file=sys.stderr)
    return out


def _profile_fields(profile: Any) -> dict[str, Any]:
    """A profiled call's pool and reads (``PROFILE_FIELDS``; None where the profile has no such
    field), its peak KV tokens (blocks x block size) and their ratio to the unique tokens."""
    fields = {name: getattr(profile, name, None) for name in PROFILE_FIELDS}
    block = fields["kv_block_size"]
    fields["peak_kv_tokens"] = None if block is None else fields["peak_kv_blocks"] * block
    unique = fields["unique_kv_tokens"]
    fields["peak_kv_over_unique"] = fields["peak_kv_tokens"] / unique \
        if fields["peak_kv_tokens"] is not None and unique else None
    return fields


def _compare(case: dict[str, Any], index: int, outputs: Mapping[tuple[int, str], list[list[int]]]) -> None:
    """A case's ratios of every path over ``copies`` (``RATIO_FIELDS``; None where either is
    missing) and the fraction of each path's rows that equal the copies' tokens, in place."""
    results = case["results"]
    base = results.get(BASELINE_PATH)
    if base is None:
        return
    for path, res in results.items():
        if path == BASELINE_PATH:
            continue
        case["ratios"][path] = {f"{field}_over_copies": None if not base.get(field) or res.get(field) is None
                                else res[field] / base[field] for field in RATIO_FIELDS}
        mine, theirs = outputs.get((index, path)), outputs.get((index, BASELINE_PATH))
        if mine is not None and theirs is not None:
            case["checks"][f"{path}_equals_copies_fraction"] = sum(a == b for a, b in zip(mine, theirs)) / len(theirs)


def prefix_sharing_rows(record: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One row per (case, path) of a prefix-sharing record: the case's prompt length (its mean where
    the workload's lengths ran), output tok/s and its ratio over copies, the pool's peak KV tokens,
    the unique ones and their ratio, shared blocks, KV bytes read per step and its ratio over
    copies, tokens equal to the copies'; ``git_sha`` (7 characters) names the code."""
    sha = str(record.get("provenance", {}).get("git_sha") or "")[:7]
    rows = []
    for case in record["cases"]:
        length = case["prompt_length"] if case["prompt_length"] is not None else case["mean_prompt_length"]
        for path, res in case["results"].items():
            ratios = case["ratios"].get(path, {})
            rows.append({
                "workload": record["workload"]["name"], "prompt_length": length, "path": path, "git_sha": sha,
                "output_tokens_per_s": res["output_tokens_per_s"], "mean_ms": res["mean_ms"],
                "first_call_ms": res["first_call_ms"],
                "tokens_per_s_over_copies": 1.0 if path == BASELINE_PATH else ratios.get("output_tokens_per_s_over_copies"),
                "peak_kv_blocks": res["peak_kv_blocks"], "peak_kv_tokens": res["peak_kv_tokens"],
                "unique_kv_tokens": res["unique_kv_tokens"], "peak_kv_over_unique": res["peak_kv_over_unique"],
                "shared_kv_blocks": res["shared_kv_blocks"], "kv_bytes_read_per_step": res["kv_bytes_read_per_step"],
                "kv_bytes_read_over_copies": ratios.get("kv_bytes_read_per_step_over_copies") if path != BASELINE_PATH
                else None if res["kv_bytes_read_per_step"] is None else 1.0,
                "num_slots": res["num_slots"], "num_kv_blocks": res["num_kv_blocks"],
                "num_preemptions": res["num_preemptions"],
                "equals_copies_fraction": 1.0 if path == BASELINE_PATH
                else case["checks"].get(f"{path}_equals_copies_fraction"),
            })
    return rows


def prefix_sharing_or_load(
    *, prefix_sharing_shape: Mapping[str, Any] | None, prefix_sharing_results_file: str | None, model: str,
    dtype: str, device: str, output_dir: Any = None,
) -> tuple[str, dict[str, Any]] | None:
    """(name, record) of the prefix-sharing run notebook 03 shows: ``prefix_sharing_shape``
    (``run_prefix_sharing``'s settings, ``PREFIX_SHARING_DEFAULTS`` where it says nothing) measured on
    ``model`` into ``<workspace>/data/results/prefix_sharing_<model>_<dtype>_<device>`` (written after
    every case), else the saved record ``prefix_sharing_results_file``, else None
    (``sections.measure_or_load``: giving both, bad settings and a record in the way are errors raised
    before the model is built)."""
    def run(net, name, shape, save, script):
        return run_prefix_sharing(net, model_name=name, dtype=dtype, script=script, save=save, **shape)

    return measure_or_load("prefix_sharing", shape=prefix_sharing_shape, results_file=prefix_sharing_results_file,
                           kind="prefix_sharing", defaults=PREFIX_SHARING_DEFAULTS,
                           check=lambda shape, limits: check_prefix_sharing_settings(**shape, limits=limits),
                           run=run, rows=prefix_sharing_rows, model=model, dtype=dtype, device=device,
                           output_dir=output_dir)
