"""Interleaved sweeps of every route against the HF peers, written as JSON + CSV with provenance.

    rollout-lab sweep --tiny qwen2 --workloads long_tail spread --scale 0.25 --out data/results/tiny
    rollout-lab sweep --preset qwen2.5-3b --costs data/calibration/qwen2.5-3b_bfloat16_cuda.json

    from rollout_lab.measure.sweep import run_sweep
    record = run_sweep(model, workloads={"lt": get_workload("long_tail", scale=0.05)}, repetitions=2)

Per workload: one warm-up call of every path (its time kept as ``first_call_ms``: the compiles and captures
the workload is first to need), then ``repetitions`` interleaved rounds (each call
timed whole, device synchronised before and after), then one profiling call per path. Every sample
is recorded with its median and IQR (``measure.spread``); Auto / best is a ratio of medians, and
each workload's summary says which paths differ from Auto by more than their spread. EOS is
disabled (``ignore_eos=True`` for ours, ``min_new_tokens = max_new_tokens`` for HF), so every
path generates the same number of tokens. Peers that fail are skipped with the reason recorded.

The paths and how one call is timed are ``measure.paths``; the record's summaries, tables and files
are ``measure.records``; ``rollout-lab sweep`` is its command. A sweep with ``out`` holds
``<out>.lock`` from before its first workload to its last write, so a second sweep to the same
output is refused; ``resume=True`` keeps the workloads an earlier record of the same settings holds
(its JSON: a sweep killed at any point of a write loses none, and its CSV is rebuilt from it).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import statistics
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
from tqdm.auto import tqdm

from rollout_lab.engine.kernels.attention import set_attn_implementation
from rollout_lab.engine.api.config import MODES, RolloutConfig
from rollout_lab.engine.api.rollout import Rollout
from rollout_lab.engine.limits import ModelLimits, rows_at_once
from rollout_lab.engine.model_info import device_name
from rollout_lab.engine.runner.steppers import resolve_decode_mode
from rollout_lab.measure.calibrate import load_calibration, run_metadata
from rollout_lab.measure.models import (TINY_VOCAB_SIZE, load_model, model_config,
                                        special_token_ids, tiny_model)
from rollout_lab.measure.paths import PathRunner, check_paths, output_sequences, release_memory, timed_call
from rollout_lab.measure.peers import oracle_sequences
from rollout_lab.measure.records import (PROFILE_FIELDS, join_sweeps, load_results, load_sweeps, read_record,
                                         recover_results, summarize, workload_summary, write_results)
from rollout_lab.measure.spread import sample_spread
from rollout_lab.measure.workloads import (WORKLOADS, get_workload,
                                           lengths_to_prompts, padding_share)
from rollout_lab.planner.checks import check_max_new_tokens
from rollout_lab.planner.cost import CostCoefficients, CostFile, ModelGeometry, setting_metadata
from rollout_lab.planner.shape_classes import ShapeClasses
from rollout_lab.workspace import RUN_ID, Workspace, json_text, output_lock, pair_paths, run_tag

DEFAULT_ORACLE_MAX_TOKENS = 1024  # prompt + generated tokens of a workload, for the oracle check
DEFAULT_REPETITIONS = 5  # timed rounds after the warm-up: enough for a median and an IQR on a CPU
DEFAULT_REPETITION_PENALTY = 1.0  # none: greedy tokens, as the oracle check needs


def resolve_workloads(
    workloads: Sequence[str] | Mapping[str, Sequence[int]], *, scale: float = 1.0
) -> dict[str, list[int]]:
    """Names (scaled by ``scale``) or explicit {name: lengths}; raises ValueError before any work."""
    if isinstance(workloads, str):
        workloads = [workloads]
    if isinstance(workloads, Mapping):
        out = {}
        for name, lengths in workloads.items():
            lengths = list(lengths)
            if not lengths or any(isinstance(n, bool) or int(n) != n or n < 1 for n in lengths):
                raise ValueError(f"workload {name!r} must be a non-empty list of positive ints")
            out[str(name)] = [int(n) for n in lengths]
        return out
    unknown = [w for w in workloads if w not in WORKLOADS]
    if unknown or not workloads:
        raise ValueError(f"unknown workloads {unknown or '(none given)'}; valid names: {', '.join(WORKLOADS)}")
    repeated = sorted({w for w in workloads if workloads.count(w) > 1})
    if repeated:  # keyed by name below: a repeat would run once
        raise ValueError(f"workloads names {', '.join(map(repr, repeated))} more than once; give each workload once")
    return {name: get_workload(name, scale=scale) for name in workloads}


# the route whose cache an HF peer's is like: a static cache of every row, or continuous batching's pool
PEER_CACHES = {"hf_static": "aligned", "hf_generate_batch": "paged"}


def check_sweep_limits(limits: ModelLimits, lengths_by_name: Mapping[str, Sequence[int]], *, paths: Sequence[str],
                       max_new_tokens: int) -> None:
    """Each workload of ``lengths_by_name`` against ``limits`` (the model's), before any work: its
    longest prompt and ``max_new_tokens`` within the context; the rows the widest of ``paths`` holds
    at once (every row on an aligned route and in HF's static cache; one on the paged and auto routes
    and in HF's continuous batching, whose caches follow the memory) within the device's available
    memory; every row's tokens within the host's. ValueError naming the workload and what fits."""
    for name, lengths in lengths_by_name.items():
        longest = max(lengths)
        positions = longest + max_new_tokens
        limits.check_context("max_new_tokens", max_new_tokens, positions=positions,
                             what=f"workload {name!r}'s longest prompt ({longest} tokens) and max_new_tokens",
                             most=None if limits.max_positions is None else limits.max_positions - longest)
        rows = max(rows_at_once(len(lengths), mode=PEER_CACHES.get(path, path), slots=None) for path in paths)
        limits.check_kv("workload", repr(name), rows=rows, positions=positions)
        limits.check_host_tokens("workload", repr(name), rows=len(lengths), tokens_per_row=positions)


def class_ladder_settings(lengths: Mapping[str, Sequence[int]], *, graphs: bool = False) -> dict[str, Any]:
    """The ``RolloutConfig`` settings that run our prefill at the shape-class ladder of these
    workloads (their longest prompt, their most rows), captured as CUDA graphs when ``graphs``: what
    ``rollout-lab sweep --prefill-classes`` / ``--prefill-graphs`` and notebook 03 pass as ``engine``."""
    longest = max(max(v) for v in lengths.values())
    rows = max(len(v) for v in lengths.values())
    return {"prefill_classes": ShapeClasses.ladder(max_width=longest, max_rows=rows), "prefill_graphs": bool(graphs)}


def run_sweep(
    model: Any,
    *,
    workloads: Sequence[str] | Mapping[str, Sequence[int]],
    paths: Sequence[str] | None = None,
    repetitions: int = DEFAULT_REPETITIONS,
    max_new_tokens: int = 16,
    costs: Any = None,
    model_name: str | None = None,
    progress: bool = True,
    out: str | os.PathLike | None = None,
    workload_scale: float = 1.0,
    repetition_penalty: float = DEFAULT_REPETITION_PENALTY,
    oracle_max_tokens: int = DEFAULT_ORACLE_MAX_TOKENS,
    costs_source: str | None = None,
    decode: str | None = None,
    engine: Mapping[str, Any] | None = None,
    resume: bool = False,
) -> dict[str, Any]:
    """Time every path on every workload; a JSON-ready record (also written to ``out`` after each
    workload, when given, so an interrupted sweep keeps what it finished).

    With ``out``, ``<out>.lock`` is held for the whole sweep (a second writer is refused before any
    work). ``resume=True`` starts from the record at ``out`` and skips its workloads; its settings
    must be this sweep's (a ValueError names those that differ; ``check_resume`` checks them before
    a model is built). The record's JSON is what it finished: a kill at any point of a write loses
    no workload it holds, and a CSV the kill left stale is rebuilt from it (``recover_results``).

    ``costs`` (CostCoefficients, default: the engine's) drive auto and bucketed; ``decode``
    ("graph", "eager", "auto"; None = the engine's default) picks our CB decode stepper; ``engine``
    holds any other ``RolloutConfig`` settings for our paths (``prefill_classes``,
    ``prefill_graphs``, ...), checked before any work and recorded. The oracle
    (one-request unpadded HF generate) is checked on workloads whose prompt + generated tokens
    are at most ``oracle_max_tokens`` (0 = never); elsewhere ``matches_oracle`` is None.
    """
    lengths_by_name = resolve_workloads(workloads, scale=workload_scale)
    paths = check_paths(paths)
    engine = dict(engine or {})
    try:
        RolloutConfig(**engine)  # a bad setting fails here, before any model call
    except TypeError as err:
        raise ValueError(f"engine settings: {err}") from None
    if isinstance(repetitions, bool) or not isinstance(repetitions, int) or repetitions < 1:
        raise ValueError(f"repetitions must be an int >= 1, got {repetitions!r}")
    check_max_new_tokens(max_new_tokens)
    check_sweep_limits(ModelLimits.of_model(model), lengths_by_name, paths=paths, max_new_tokens=max_new_tokens)
    if resume and out is None:
        raise ValueError("resume=True needs out (the record to resume)")
    if decode is not None:
        resolve_decode_mode(decode, next(model.parameters()).device)  # decode="graph" off CUDA: an error now
    config = sweep_settings(paths=paths, repetitions=repetitions, max_new_tokens=max_new_tokens,
                            repetition_penalty=repetition_penalty, workload_scale=workload_scale,
                            oracle_max_tokens=oracle_max_tokens, decode=decode, engine=engine, costs=costs,
                            costs_source=costs_source)
    with contextlib.ExitStack() as stack:
        if out is not None:
            stack.enter_context(output_lock(out))
        record: dict[str, Any] = {"kind": "sweep", "provenance": run_metadata(model, model_name=model_name),
                                  "config": config, "workloads": {}}
        if resume and pair_paths(out)[0].is_file():
            check_saved_sweep(read_record(pair_paths(out)[0], "sweep"), pair_paths(out)[0])  # before its CSV is rebuilt
            saved = recover_results(out)  # the JSON; a CSV a kill left stale is rebuilt from it
            done = resumable_workloads(saved, config=config, provenance=record["provenance"],
                                       lengths_by_name=lengths_by_name)
            record["workloads"].update(done)
            record["resumed"] = {"run_id": saved.get(RUN_ID), "date": saved["provenance"].get("date"),
                                 "git_sha": saved["provenance"].get("git_sha"), "workloads": list(done)}
            lengths_by_name = {k: v for k, v in lengths_by_name.items() if k not in done}
        return _sweep(model, record, lengths_by_name, paths, repetitions=repetitions,
                      max_new_tokens=max_new_tokens, costs=costs, progress=progress, out=out,
                      repetition_penalty=repetition_penalty, oracle_max_tokens=oracle_max_tokens, decode=decode,
                      engine=engine)


def sweep_settings(*, paths: Sequence[str], repetitions: int, max_new_tokens: int, workload_scale: float,
                   oracle_max_tokens: int, engine: Mapping[str, Any],
                   repetition_penalty: float = DEFAULT_REPETITION_PENALTY, decode: str | None = None,
                   costs: CostCoefficients | None = None, costs_source: str | None = None) -> dict[str, Any]:
    """A sweep record's ``config`` (``run_sweep``'s settings, ``paths`` checked): what ``resume``
    requires of a saved record."""
    return {
        "paths": list(paths), "repetitions": repetitions, "max_new_tokens": max_new_tokens,
        "repetition_penalty": repetition_penalty, "workload_scale": workload_scale,
        "oracle_max_tokens": oracle_max_tokens, "decode": decode or "engine default",
        "engine": {k: dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v for k, v in engine.items()},
        "costs": None if costs is None else costs.to_dict(), "costs_source": costs_source or (
            "engine defaults" if costs is None else "given"),
    }


def _sweep(model, record, lengths_by_name, paths, *, repetitions, max_new_tokens, costs, progress, out,
           repetition_penalty, oracle_max_tokens, decode, engine) -> dict[str, Any]:
    config = model.config.get_text_config(decoder=True)
    device = next(model.parameters()).device
    pad = config.pad_token_id if config.pad_token_id is not None else 0
    special = special_token_ids(config)
    calls_per_workload = len(paths) * (repetitions + 2)
    bar = tqdm(total=calls_per_workload * len(lengths_by_name), desc="sweep", disable=not progress)
    # no_grad, not inference_mode: generate_batch's worker thread must update tensors made here
    with torch.no_grad():
        for name, lengths in lengths_by_name.items():
            prompts = lengths_to_prompts(lengths, vocab_size=config.vocab_size, seed=0, special_ids=special)
            bar.set_postfix_str(name)
            record["workloads"][name] = _sweep_workload(
                model, prompts, paths, device=device, repetitions=repetitions,
                max_new_tokens=max_new_tokens, costs=costs, pad=pad,
                repetition_penalty=repetition_penalty, oracle_max_tokens=oracle_max_tokens,
                decode=decode, engine=engine, bar=bar,
            )
            record["summary"] = summarize(record)
            if out is not None:
                write_results(record, out)
    bar.close()
    record["summary"] = summarize(record)
    if out is not None and not lengths_by_name:  # resumed with nothing left to run: still one write
        write_results(record, out)
    return record


def check_saved_sweep(saved: Mapping[str, Any], path: str | os.PathLike) -> None:
    """ValueError naming the part of the sweep record at ``path`` (read as JSON) that does not have
    the shape ``run_sweep`` writes: ``config`` and ``provenance`` dicts, ``workloads`` a dict of
    name -> {"lengths": [ints], "paths": {path: dict}}. What ``resume`` checks before it reads one."""
    def wrong(where: str, value: Any, expected: str) -> ValueError:
        shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
        return ValueError(f"cannot resume {str(path)!r}: its {where} is {type(value).__name__} {shown}, not "
                          f"{expected}; it is not a sweep record as run_sweep writes one: choose another --out, "
                          "or run without --resume to replace it")

    for key, expected in (("config", "a dict of settings"), ("provenance", "a dict"),
                          ("workloads", "a dict of workload name -> its results")):
        if not isinstance(saved.get(key), dict):
            raise wrong(key, saved.get(key), expected)
    for name, workload in saved["workloads"].items():
        if not isinstance(workload, dict):
            raise wrong(f"workload {name!r}", workload, "a dict with lengths and paths")
        lengths = workload.get("lengths")
        if not isinstance(lengths, list) or not all(isinstance(n, int) and not isinstance(n, bool) for n in lengths):
            raise wrong(f"workload {name!r} lengths", lengths, "a list of prompt lengths (ints)")
        paths = workload.get("paths")
        if not isinstance(paths, dict) or not all(isinstance(r, dict) for r in paths.values()):
            raise wrong(f"workload {name!r} paths", paths, "a dict of path name -> its results")


RESUME_PROVENANCE = ("model_name", "dtype", "device_type", "device_name", "geometry", "attn_implementation")


def resumable_workloads(saved: Mapping[str, Any], *, config: Mapping[str, Any], provenance: Mapping[str, Any],
                        lengths_by_name: Mapping[str, Sequence[int]]) -> dict[str, Any]:
    """The workloads of a saved sweep that a sweep with ``config`` (``sweep_settings``) and
    ``provenance`` may keep; ValueError naming every setting that differs (config, the
    ``RESUME_PROVENANCE`` fields ``provenance`` holds, or a kept workload's lengths). ``saved`` has
    passed ``check_saved_sweep``."""
    diffs = [f"config.{k}: saved {saved['config'].get(k)!r}, now {v!r}"
             for k, v in _as_read_back(config).items() if saved["config"].get(k) != v]
    diffs += [f"provenance.{k}: saved {saved['provenance'].get(k)!r}, now {v!r}"
              for k, v in _as_read_back(provenance).items() if k in RESUME_PROVENANCE and saved["provenance"].get(k) != v]
    done = {k: w for k, w in saved["workloads"].items() if k in lengths_by_name}
    diffs += [f"workload {k!r}: saved lengths differ from this sweep's"
              for k, w in done.items() if list(w["lengths"]) != list(lengths_by_name[k])]
    if diffs:
        raise ValueError("cannot resume the saved sweep: its settings differ from this one's ("
                         + "; ".join(diffs) + "); choose another --out, or run without --resume to replace it")
    return {**{k: w for k, w in saved["workloads"].items() if k not in lengths_by_name}, **done}


def check_resume(out: str | os.PathLike, *, config: Mapping[str, Any], model: str, dtype: str, device: str,
                 lengths_by_name: Mapping[str, Sequence[int]]) -> list[str]:
    """Before the model is built: the workloads a ``resume`` of the record at ``out`` keeps (none
    when it has no JSON), checked as ``resumable_workloads`` checks them on ``config`` and on what
    is known of the model without building it (``model``, a ``load_model`` spec: its name and
    geometry; ``dtype``; ``device``: its type and name). Reads the JSON only: a CSV a kill left stale
    is rebuilt when the sweep resumes, under the output's lock."""
    json_path = pair_paths(out)[0]
    if not json_path.is_file():
        return []
    model_settings, name = model_config(model)
    known = setting_metadata(geometry=ModelGeometry.from_config(model_settings, dtype), dtype=dtype,
                             model_name=name, device_type=torch.device(device).type)
    known["device_name"] = device_name(torch.device(device))
    saved = read_record(json_path, "sweep")
    check_saved_sweep(saved, json_path)
    return list(resumable_workloads(saved, config=config, provenance=known, lengths_by_name=lengths_by_name))


def _as_read_back(value: Any) -> Any:
    """``value`` as it reads back from a record (tuples as lists), for comparing with a saved one."""
    return json.loads(json_text(value))


def _sweep_workload(model, prompts, paths, *, device, repetitions, max_new_tokens, costs, pad,
                    repetition_penalty, oracle_max_tokens, decode, engine, bar) -> dict[str, Any]:
    runners = {p: PathRunner(model, p, prompts, max_new_tokens=max_new_tokens, costs=costs, pad=pad,
                             repetition_penalty=repetition_penalty, decode=decode, engine=engine) for p in paths}
    try:
        return _run_workload(model, prompts, paths, runners, device=device, repetitions=repetitions,
                             max_new_tokens=max_new_tokens, repetition_penalty=repetition_penalty,
                             oracle_max_tokens=oracle_max_tokens, bar=bar)
    finally:
        for runner in runners.values():
            runner.close()


def _run_workload(model, prompts, paths, runners, *, device, repetitions, max_new_tokens,
                  repetition_penalty, oracle_max_tokens, bar) -> dict[str, Any]:
    lengths = [len(p) for p in prompts]
    attn_implementation = getattr(model.config, "_attn_implementation", None)
    results: dict[str, dict[str, Any]] = {}
    outputs: dict[str, list[list[int]]] = {}
    for path in paths:  # warm-up (compiles, allocator); a failing peer is skipped with its reason
        try:
            first_ms, out, _ = timed_call(runners[path].call, device)
            outputs[path] = output_sequences(out)
            # the warm-up's time: compiles and captures of the shapes this workload is first to use
            results[path] = {"samples_ms": [], "peak_mem_bytes": None, "skipped": None, "first_call_ms": first_ms}
        except Exception as err:  # noqa: BLE001 - recorded, and only for peers
            if path in MODES:
                raise
            results[path] = {"skipped": f"{type(err).__name__}: {err}"[:500]}
        if path == "hf_generate_batch":
            release_memory(device)
            set_attn_implementation(model, attn_implementation)
        bar.update()
    live = [p for p in paths if results[p].get("skipped") is None]
    for _ in range(repetitions):
        for path in live:
            ms, _, peak = timed_call(runners[path].call, device)
            if path == "hf_generate_batch":
                release_memory(device)
                set_attn_implementation(model, attn_implementation)
            results[path]["samples_ms"].append(ms)
            if peak is not None:
                results[path]["peak_mem_bytes"] = max(peak, results[path]["peak_mem_bytes"] or 0)
            bar.update()
        bar.update(len(paths) - len(live))
    num_tokens = len(prompts) * max_new_tokens
    is_small = oracle_max_tokens > 0 and sum(lengths) + num_tokens <= oracle_max_tokens
    oracle = None
    if is_small:

        oracle = oracle_sequences(model, prompts, max_new_tokens=max_new_tokens,
                                  repetition_penalty=repetition_penalty)
    for path in paths:
        entry = results[path]
        if entry.get("skipped") is not None:
            entry.update({"mean_ms": None, "median_ms": None, "q1_ms": None, "q3_ms": None, "iqr_ms": None,
                          "samples_ms": [], "tokens_per_s": None, "peak_mem_bytes": None, "first_call_ms": None,
                          "route": None, "buckets": None, "profile": None,
                          "matches_nocb": None, "matches_oracle": None})
            bar.update()
            continue
        info = runners[path].profile()
        bar.update()
        seqs = outputs[path]
        mean_ms = statistics.fmean(entry["samples_ms"])
        entry.update({
            "mean_ms": mean_ms,
            "std_ms": statistics.pstdev(entry["samples_ms"]),
            **sample_spread(entry["samples_ms"]),
            "tokens_per_s": sum(len(s) for s in seqs) / (mean_ms / 1e3),  # throughput over all the time spent
            **info,
            "matches_nocb": (seqs == outputs["nocb"]) if "nocb" in outputs else None,
            "matches_oracle": (seqs == oracle) if oracle is not None else None,
        })
    return {"lengths": lengths, "num_requests": len(lengths), "padding_share": padding_share(lengths),
            "paths": results, "summary": workload_summary(results)}


# -- what make reproduce and notebook 03 call ------------------------------------------------------

ROUTE_TABLE_WARMUP_ROUNDS = 2  # nocb's HF generate on CPU: ~1300 ms, then ~400 ms, then ~20 ms a call


def route_table(*, max_new_tokens: int = 8) -> list[dict]:
    """Run the long-tail shape (1x48 + 15x4) through every route on the tiny qwen2 model."""
    model = tiny_model("qwen2")
    prompts = lengths_to_prompts([48] + [4] * 15, vocab_size=TINY_VOCAB_SIZE, seed=0, special_ids=[0])
    costs = CostCoefficients(prefill_fixed_cost_ms=0.5, continuous_decode_cost_ms=0.0)  # tiny-model scale
    rollouts = {mode: Rollout(model, RolloutConfig(mode=mode, costs=costs, profile=True, pad_token_id=0))
                for mode in MODES}
    for _ in range(ROUTE_TABLE_WARMUP_ROUNDS):  # warm every route up first: first calls are slow
        for rollout in rollouts.values():
            rollout.generate(prompts, max_new_tokens=max_new_tokens, progress=False)
    rows, reference = [], None
    for mode, rollout in rollouts.items():
        result = rollout.generate(prompts, max_new_tokens=max_new_tokens, progress=False)
        reference = result.sequences if reference is None else reference
        row = {"mode": mode, "route": result.route, "same_tokens": result.sequences == reference}
        row.update({k: getattr(result.profile, k) for k in PROFILE_FIELDS})
        rows.append(row)
    for rollout in rollouts.values():
        rollout.close()
    return rows


def sweep_or_load(
    *, results_file: str | Sequence[str] | None, model: str, dtype: str, device: str, workloads: Sequence[str],
    workload_scale: float, paths_: Sequence[str] | None, repetitions: int, max_new_tokens: int,
    cost_file: str | None, override_costs: bool, results_stem: str | None,
    output_dir: str | Path | None, progress: bool = False, prefill_classes: bool = False,
    prefill_graphs: bool = False, resume: bool = False, peer_results_file: str | Sequence[str] | None = None,
    oracle_max_tokens: int = DEFAULT_ORACLE_MAX_TOKENS,
) -> tuple[dict[str, Any], Path]:
    """Render a saved sweep (``results_file``; several are joined by ``join_sweeps``), or run one and
    write JSON + CSV: (record, json path of the first).

    A run takes our prefill at the workloads' shape-class ladder with ``prefill_classes``, captured
    on CUDA with ``prefill_graphs`` (``class_ladder_settings``), and with ``resume`` keeps the
    workloads that the record at ``results_stem`` already holds. ``peer_results_file`` (one or
    several sweeps of HF's compiled peer, run in their own process) is joined to the record, loaded
    or measured, after it; every file is checked before the model is built. ``oracle_max_tokens``
    is ``run_sweep``'s."""
    peers = load_sweeps(peer_results_file)
    if isinstance(results_file, (list, tuple)):
        files = [str(f) for f in results_file]
        record, first = join_sweeps([load_results(f) for f in files], files), Path(files[0])
    elif results_file is not None:
        record, first = load_results(results_file), Path(results_file)
    else:
        lengths = resolve_workloads(list(workloads), scale=workload_scale)
        engine = class_ladder_settings(lengths, graphs=prefill_graphs) if prefill_classes or prefill_graphs else {}
        if prefill_graphs and torch.device(device).type != "cuda":
            raise ValueError(f"prefill_graphs=True captures CUDA graphs; device is {device!r}")
        config, name = model_config(model)
        check_sweep_limits(ModelLimits.of_config(config, dtype=dtype, device=device), lengths, paths=check_paths(paths_),
                           max_new_tokens=max_new_tokens)  # before the model is built
        if results_stem is None:
            results_stem = str(Workspace.resolve(output_dir).results / f"sweep_{run_tag(name, dtype, device)}")
        if resume:  # the saved record's settings, before the model is built
            file_costs = None if cost_file is None else CostFile.read(cost_file).costs  # unchecked: no model yet
            config = sweep_settings(paths=check_paths(paths_), repetitions=repetitions, max_new_tokens=max_new_tokens,
                                    workload_scale=workload_scale, oracle_max_tokens=oracle_max_tokens,
                                    engine=engine, costs=file_costs, costs_source=cost_file or "engine defaults")
            check_resume(results_stem, config=config, model=model, dtype=dtype, device=device, lengths_by_name=lengths)
        net, name = load_model(model, dtype=dtype, device=device)
        costs = None
        if cost_file is not None:
            costs = load_calibration(cost_file, model=net, model_name=name, override=override_costs,
                                     prefill_graphs=prefill_graphs)
        record = run_sweep(
            net, workloads=lengths, paths=paths_, repetitions=repetitions, max_new_tokens=max_new_tokens,
            costs=costs, model_name=name, progress=progress, workload_scale=workload_scale,
            costs_source=cost_file or "engine defaults", out=results_stem, engine=engine, resume=resume,
            oracle_max_tokens=oracle_max_tokens,
        )
        first = pair_paths(results_stem)[0]
    if peers:
        record = join_sweeps([record, *(r for _, r in peers)], [str(first), *(name for name, _ in peers)])
    return record, first


# the settings of notebook 03's more_shape: what it must give, then what it may (the run's otherwise)
MORE_SHAPE_KEYS = ("workloads", "max_new_tokens", "paths", "repetitions")


def more_sweep_or_load(
    more_shape: Mapping[str, Any], *, model: str, dtype: str, device: str, output_dir: str | Path | None,
    more_peer_results_file: str | Sequence[str] | None = None, **sweep: Any,
) -> tuple[str, dict[str, Any]]:
    """(json path, record) of the workloads of ``more_shape`` measured at their own generation length
    (``max_new_tokens``; ``paths`` and ``repetitions`` when given) with the rest of ``sweep_or_load``'s
    settings as notebook 03's sweep has them (``sweep``), into
    ``<workspace>/data/results/sweep_<model>_<dtype>_<device>_<workloads>x<max_new_tokens>``, HF's
    compiled peer of the same shape joined from ``more_peer_results_file``: GPQA-like 128 x 256 beside
    the 16-token workloads in one notebook run. Unknown or missing settings, an unknown workload and a
    bad length are errors before the model is built."""
    if not isinstance(more_shape, Mapping):
        raise ValueError(f"more_shape must be a dict of {', '.join(MORE_SHAPE_KEYS)}, got {more_shape!r}")
    unknown = sorted(set(more_shape) - set(MORE_SHAPE_KEYS))
    missing = [k for k in MORE_SHAPE_KEYS[:2] if k not in more_shape]
    if unknown or missing:
        raise ValueError(f"more_shape has unknown settings {unknown} and lacks {missing}; it takes "
                         f"{', '.join(MORE_SHAPE_KEYS[:2])} and may take {', '.join(MORE_SHAPE_KEYS[2:])}")
    workloads = more_shape["workloads"]
    if not isinstance(workloads, (list, tuple)) or not workloads:
        raise ValueError(f"more_shape's workloads must be a list of workload names, got {workloads!r}")
    try:
        new_tokens = check_max_new_tokens(more_shape["max_new_tokens"])
        resolve_workloads(list(workloads), scale=sweep.get("workload_scale", 1.0))
    except ValueError as err:
        raise ValueError(f"more_shape: {err}") from None
    _, name = model_config(model)
    shape = f"{'-'.join(workloads)}x{new_tokens}"
    stem = Workspace.resolve(output_dir).results / f"sweep_{run_tag(name, dtype, device)}_{shape}"
    settings = {**sweep, "paths_": more_shape.get("paths", sweep.get("paths_")),
                "repetitions": more_shape.get("repetitions", sweep.get("repetitions"))}
    record, path = sweep_or_load(
        **settings, results_file=None, model=model, dtype=dtype, device=device, workloads=workloads,
        max_new_tokens=new_tokens, results_stem=str(stem), output_dir=output_dir, resume=False,
        peer_results_file=more_peer_results_file)
    return str(path), record
