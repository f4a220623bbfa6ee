"""Interleaved sweeps of every route against the HF peers, written as JSON + CSV with provenance.

    rollout-lab sweep --tiny qwen2 --workloads long_tail spread --scale 0.25 --out data/results/tiny
    rollout-lab sweep --preset qwen2.5-3b --costs data/calibration/qwen2.5-3b_bfloat16_cuda.json

    from rollout_lab.measure.sweep import run_sweep, write_results, results_table
    record = run_sweep(model, workloads={"lt": get_workload("long_tail", scale=0.05)}, repetitions=2)

Per workload: one warm-up call of every path (its time kept as ``first_call_ms``: the compiles and captures
the workload is first to need), then ``repetitions`` interleaved rounds (each call
timed whole, device synchronised before and after), then one profiling call per path. Every sample
is recorded with its median and IQR (``measure.spread``); Auto / best is a ratio of medians, and
each workload's summary says which paths differ from Auto by more than their spread. EOS is
disabled (``ignore_eos=True`` for ours, ``min_new_tokens = max_new_tokens`` for HF), so every
path generates the same number of tokens. Peers that fail are skipped with the reason recorded.

The sweep, the paths it times and how one call is timed, and the record it writes (summaries,
tables, JSON + CSV) are all here; ``rollout-lab sweep`` is its command.

The paths a sweep times (our routes and the HF peers), and how one call of a path is made and timed.

    runner = PathRunner(model, "auto", prompts, max_new_tokens=16, costs=None, pad=0,
                        repetition_penalty=1.0, decode=None)
    ms, out, peak_bytes = timed_call(runner.call, device)

Each call is timed whole, the device synchronised before and after. Our paths keep one Rollout
across the warm-up, the timed calls and the profiling call; torch is imported only when a call runs.

A sweep record once measured: its summaries, its flat tables, and its JSON + CSV files.

    from rollout_lab.measure.sweep import load_results, results_table, summary_table
    record = load_results("data/results/tiny")  # the stem, or the .json file
    rows = results_table(record)  # one row per (workload, path), profile fields inlined

``write_results`` writes the pair through ``workspace.write_record`` (CSV first, JSON last, one
``run_id``); the loaders check the pair agrees. A sweep with ``out`` holds ``<out>.lock`` from
before its first workload to its last write, so a second sweep to the same output is refused;
``resume=True`` keeps the workloads an earlier record of the same settings holds.

"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import os
import statistics
import warnings
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch
from tqdm.auto import tqdm

from rollout_lab.engine.attention import set_attn_implementation
from rollout_lab.engine.config import MANUAL_ROUTES, MODES, RolloutConfig
from rollout_lab.engine.profile import timed_ms
from rollout_lab.engine.rollout import Rollout
from rollout_lab.measure.calibrate import load_calibration, run_metadata
from rollout_lab.measure.models import (TINY_VOCAB_SIZE, load_model, model_config,
                                        special_token_ids, tiny_model)
from rollout_lab.measure.peers import (hf_generate, hf_generate_batch,
                                       oracle_sequences)
from rollout_lab.measure.spread import beyond_spread, sample_spread
from rollout_lab.measure.workloads import (WORKLOADS, get_workload,
                                           lengths_to_prompts, padding_share)
from rollout_lab.planner.checks import check_max_new_tokens
from rollout_lab.planner.cost import CostCoefficients
from rollout_lab.planner.shape_classes import ShapeClasses
from rollout_lab.workspace import (RUN_ID, Workspace, check_record_pair,
                                   json_text, output_lock, pair_paths, read_json_file,
                                   run_tag, write_record)

PEER_PATHS = ("hf_static", "hf_generate_batch")
PATHS = MODES + PEER_PATHS  # our routes, then the HF peers
PROFILE_FIELDS = ("planning_ms", "prefill_ms", "decode_ms", "cache_ms", "total_ms",
                  "num_prefill_forwards", "num_decode_forwards", "num_generated_tokens")
# the decode levers, as RolloutConfig settings over the engine's defaults (on CUDA: span attention,
# the compiled step, the row ladder); each ablation takes one more away (rollout-lab bench rl,
# decode-step, logits)
DECODE_VARIANTS: dict[str, dict[str, Any]] = {
    "ours": {},
    "ours_no_compile": {"compile": False},
    "ours_masked": {"compile": False, "decode_attention": "masked"},  # attention windows, not spans
    "ours_full_width": {"compile": False, "decode_attention": "masked", "decode_widths": 1},
    "ours_one_graph": {"compile": False, "decode_attention": "masked", "decode_widths": 1,
                       "max_decode_graphs": 1},
    # not an ablation: "ours" with each decoder layer compiled instead of the whole model (a shorter
    # first compile, engine.compiling), to weigh its step against the whole model's
    "ours_compile_layers": {"compile": "layers"},
}
# the levers the decode-step and logits benches compare unless told: ours, then the compile and the spans taken away
LEVER_VARIANTS = ("ours", "ours_no_compile", "ours_masked")
DEFAULT_ORACLE_MAX_TOKENS = 1024  # prompt + generated tokens of a workload, for the oracle check
DEFAULT_REPETITIONS = 5  # timed rounds after the warm-up: enough for a median and an IQR on a CPU


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
    return {name: get_workload(name, scale=scale) for name in workloads}


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
    repetition_penalty: float = 1.0,
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
    must be this sweep's (a ValueError names those that differ).

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
    if resume and out is None:
        raise ValueError("resume=True needs out (the record to resume)")
    with contextlib.ExitStack() as stack:
        if out is not None:
            stack.enter_context(output_lock(out))
        return _sweep(model, lengths_by_name, paths, repetitions=repetitions, max_new_tokens=max_new_tokens,
                      costs=costs, model_name=model_name, progress=progress, out=out,
                      workload_scale=workload_scale, repetition_penalty=repetition_penalty,
                      oracle_max_tokens=oracle_max_tokens, costs_source=costs_source, decode=decode,
                      engine=engine, resume=resume)


def _sweep(model, lengths_by_name, paths, *, repetitions, max_new_tokens, costs, model_name, progress, out,
           workload_scale, repetition_penalty, oracle_max_tokens, costs_source, decode, engine,
           resume) -> dict[str, Any]:
    config = model.config.get_text_config(decoder=True)
    device = next(model.parameters()).device
    pad = config.pad_token_id if config.pad_token_id is not None else 0
    special = special_token_ids(config)
    record: dict[str, Any] = {
        "kind": "sweep",
        "provenance": run_metadata(model, model_name=model_name),
        "config": {
            "paths": list(paths), "repetitions": repetitions, "max_new_tokens": max_new_tokens,
            "repetition_penalty": repetition_penalty, "workload_scale": workload_scale,
            "oracle_max_tokens": oracle_max_tokens, "decode": decode or "engine default",
            "engine": {k: dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v for k, v in engine.items()},
            "costs": None if costs is None else costs.to_dict(), "costs_source": costs_source or (
                "engine defaults" if costs is None else "given"),
        },
        "workloads": {},
    }
    if resume and pair_paths(out)[0].is_file():
        saved = load_results(out)
        done = resumable_workloads(saved, record, lengths_by_name)
        record["workloads"].update(done)
        record["resumed"] = {"run_id": saved.get(RUN_ID), "date": saved["provenance"].get("date"),
                             "git_sha": saved["provenance"].get("git_sha"), "workloads": list(done)}
        lengths_by_name = {k: v for k, v in lengths_by_name.items() if k not in done}
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


RESUME_PROVENANCE = ("model_name", "dtype", "device_type", "device_name", "geometry", "attn_implementation")


def resumable_workloads(saved: Mapping[str, Any], record: Mapping[str, Any],
                        lengths_by_name: Mapping[str, Sequence[int]]) -> dict[str, Any]:
    """The workloads of a saved sweep that a sweep with ``record``'s settings may keep; ValueError
    naming every setting that differs (config, provenance, or a kept workload's lengths)."""
    diffs = [f"config.{k}: saved {saved['config'].get(k)!r}, now {v!r}"
             for k, v in _as_read_back(record["config"]).items() if saved["config"].get(k) != v]
    diffs += [f"provenance.{k}: saved {saved['provenance'].get(k)!r}, now {record['provenance'].get(k)!r}"
              for k in RESUME_PROVENANCE if saved["provenance"].get(k) != record["provenance"].get(k)]
    done = {k: w for k, w in saved["workloads"].items() if k in lengths_by_name}
    diffs += [f"workload {k!r}: saved lengths differ from this sweep's"
              for k, w in done.items() if list(w["lengths"]) != list(lengths_by_name[k])]
    if diffs:
        raise ValueError("cannot resume the saved sweep: its settings differ from this one's ("
                         + "; ".join(diffs) + "); choose another --out, or run without --resume to replace it")
    return {**{k: w for k, w in saved["workloads"].items() if k not in lengths_by_name}, **done}


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


# -- the paths, and how one call is made and timed -------------------------------------------------

def check_paths(paths: Sequence[str] | None) -> tuple[str, ...]:
    paths = PATHS if paths is None else tuple(paths)
    unknown = [p for p in paths if p not in PATHS]
    if unknown or not paths:
        raise ValueError(f"unknown paths {unknown or '(none given)'}; valid: {', '.join(PATHS)}")
    return tuple(dict.fromkeys(paths))


def release_memory(device: Any) -> None:
    """After generate_batch: drop its paged cache (~all free GPU memory) before the next path runs."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def timed_call(fn: Callable[[], Any], device: Any) -> tuple[float, Any, int | None]:
    """(ms, output, peak allocated bytes or None) of one whole call."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    ms, out = timed_ms(fn, device)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return ms, out, peak


class PathRunner:
    """One path's calls: ``call()`` (timed), ``profile()`` -> info or None, ``close()``.

    Our paths keep one Rollout (its captured decode graph and cache) for the warm-up, the timed
    calls and the profiling call after them; it is closed when the workload ends.
    """

    def __init__(self, model, path, prompts, *, max_new_tokens, costs, pad, repetition_penalty, decode,
                 engine=None):
        self.model, self.path, self.prompts, self.max_new_tokens = model, path, prompts, max_new_tokens
        self.pad, self.repetition_penalty = pad, repetition_penalty
        self.settings = dict(engine or {}, mode=path, ignore_eos=True, pad_token_id=pad,
                             repetition_penalty=repetition_penalty)
        if costs is not None:
            self.settings["costs"] = costs
        if decode is not None:
            self.settings["decode"] = decode
        self._rollout = None

    def _engine(self) -> Rollout:
        if self._rollout is None:
            self._rollout = Rollout(self.model, RolloutConfig(**self.settings))
        return self._rollout

    def call(self) -> Any:
        if self.path in MODES:
            return self._engine().generate(self.prompts, max_new_tokens=self.max_new_tokens)
        if self.path == "hf_static":
            return hf_generate(self.model, self.prompts, max_new_tokens=self.max_new_tokens,
                                     pad_token_id=self.pad, cache_implementation="static",
                                     repetition_penalty=self.repetition_penalty)
        return hf_generate_batch(self.model, self.prompts, max_new_tokens=self.max_new_tokens,
                                       pad_token_id=self.pad)

    def profile(self) -> dict[str, Any]:
        if self.path not in MODES:  # peers have no profile: no extra call
            return {"route": None, "buckets": None, "profile": None}
        # The timed calls' Rollout, profiling this call: its decode graph is already captured, so
        # the profile is a steady-state call's and no capture happens after the peers compiled.
        result = self._engine().generate(self.prompts, max_new_tokens=self.max_new_tokens, profile=True)
        self.close()
        return _engine_info(result)

    def close(self) -> None:
        if self._rollout is not None:
            close = getattr(self._rollout, "close", None)
            if close is not None:
                close()
            self._rollout = None


def _engine_info(result: Any) -> dict[str, Any]:
    profile = result.profile
    profile = profile.to_dict() if hasattr(profile, "to_dict") else (dict(vars(profile)) if profile else None)
    buckets = [[len(b), int(w)] for plan in (result.plans or []) for b, w in zip(plan.buckets, plan.widths)]
    return {"route": result.route, "buckets": buckets, "num_admissions": len(result.plans or []),
            "profile": profile}


def output_sequences(out: Any) -> list[list[int]]:
    seqs = getattr(out, "sequences", out)
    return [list(map(int, s)) for s in seqs]


# -- the record: summaries, tables, files ----------------------------------------------------------

def workload_summary(results: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """One workload's Auto route, and Auto against the best manual path and the best peer, as
    ratios of medians; ``beyond_spread`` says, per path, whether its IQR and Auto's are disjoint
    (a ratio whose paths overlap is noise, not a ranking)."""
    def best(names):
        timed = [(results[p]["median_ms"], p) for p in names if results.get(p, {}).get("median_ms") is not None]
        return min(timed) if timed else (None, None)

    auto_entry = results.get("auto", {})
    auto = auto_entry.get("median_ms")
    manual_ms, manual = best(MANUAL_ROUTES)
    peer_ms, peer = best(PEER_PATHS)
    over_manual = auto / manual_ms if auto is not None and manual_ms else None
    separated = {p: beyond_spread(auto_entry, r) for p, r in results.items()
                 if p != "auto" and auto is not None and r.get("median_ms") is not None}
    return {
        "auto_route": auto_entry.get("route"),
        "best_manual_path": manual, "best_peer_path": peer,
        "auto_over_best_manual": over_manual,
        "auto_over_best_peer": auto / peer_ms if auto is not None and peer_ms else None,
        "regression": None if over_manual is None else max(0.0, over_manual - 1.0),
        "auto_vs_best_manual_beyond_spread": separated.get(manual),
        "auto_vs_best_peer_beyond_spread": separated.get(peer),
        "beyond_spread": separated,
    }


def summarize(record: Mapping[str, Any]) -> dict[str, Any]:
    """Per-workload summaries, and the worst regression of Auto against the best manual path."""
    rows = summary_table(record)
    rated = [r for r in rows if r["regression"] is not None]
    worst = max(rated, key=lambda r: r["regression"], default=None)
    return {
        "workloads": rows,
        "worst_regression": None if worst is None else {
            "workload": worst["workload"], "regression": worst["regression"],
            "auto_over_best_manual": worst["auto_over_best_manual"],
        },
    }


def summary_table(record: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One flat row per workload: Auto / best manual (also as ``auto_vs_best``), Auto / best peer."""
    rows = []
    for name, w in record["workloads"].items():
        s = w["summary"]
        flat = {k: v for k, v in s.items() if k != "beyond_spread"}  # a dict: the record keeps it
        rows.append({"workload": name, "num_requests": w["num_requests"], **flat,
                     "auto_vs_best": s["auto_over_best_manual"]})
    return rows


def results_table(record: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One flat row per (workload, path), profile fields inlined: for plots and the CSV."""
    rows = []
    for name, w in record["workloads"].items():
        for path, r in w["paths"].items():
            profile = r.get("profile") or {}
            rows.append({
                "workload": name, "path": path, "num_requests": w["num_requests"],
                "padding_share": w["padding_share"], "median_ms": r.get("median_ms"),
                "q1_ms": r.get("q1_ms"), "q3_ms": r.get("q3_ms"), "iqr_ms": r.get("iqr_ms"),
                "mean_ms": r.get("mean_ms"), "std_ms": r.get("std_ms"),
                "samples_ms": ";".join(f"{x:.3f}" for x in r.get("samples_ms") or []),
                "tokens_per_s": r.get("tokens_per_s"), "peak_mem_bytes": r.get("peak_mem_bytes"),
                "route": r.get("route"), "num_buckets": None if r.get("buckets") is None else len(r["buckets"]),
                "buckets": None if r.get("buckets") is None else " ".join(f"{b}x{wd}" for b, wd in r["buckets"]),
                "matches_nocb": r.get("matches_nocb"), "matches_oracle": r.get("matches_oracle"),
                "skipped": r.get("skipped"),
                **{f: profile.get(f) for f in PROFILE_FIELDS},
            })
    return rows


def write_results(record: dict[str, Any], stem: str | os.PathLike) -> tuple[Path, Path]:
    """Write ``<stem>.json`` and ``<stem>.csv`` as a pair (``workspace.write_record``: CSV first,
    JSON last, one ``run_id``, set in ``record``)."""
    paths = pair_paths(stem)
    write_record(paths, record, results_table(record))
    return paths


def load_results(path: str | os.PathLike) -> dict[str, Any]:
    """A record written by ``write_results`` (``path`` may be the stem or the .json file)."""
    return load_record(pair_paths(path)[0], "sweep")


def join_sweeps(records: Sequence[Mapping[str, Any]], names: Sequence[str]) -> dict[str, Any]:
    """One record from sweeps of the same workloads run in separate processes (HF's compiled peer
    runs in its own: its CUDA-graph trees must not share a process with our captures).

    The joined record holds the workloads that every record holds (a sweep cut by a time limit
    lacks its last ones), in the first record's order; ``dropped_workloads`` names the others per
    record, with a warning. A shared workload must have the same prompt lengths in every record, and
    no path may come twice. Entries without a median (records before the medians) get it from
    their samples; each workload's summary is recomputed over the joined paths. ``provenance`` is
    the first record's; ``joined`` names every source (``names``) with its git sha, date and paths."""
    if not records or len(records) != len(names):
        raise ValueError(f"join_sweeps needs one name per record, got {len(records)} records and {len(names)} names")
    first = records[0]
    common = [w for w in first["workloads"] if all(w in r["workloads"] for r in records)]
    if not common:
        raise ValueError("the records share no workload: " + "; ".join(
            f"{name} has {list(r['workloads'])}" for r, name in zip(records, names)))
    dropped = {name: [w for w in r["workloads"] if w not in common] for r, name in zip(records, names)}
    dropped = {name: ws for name, ws in dropped.items() if ws}
    if dropped:
        warnings.warn("join_sweeps keeps the workloads every record holds; left out: " + "; ".join(
            f"{ws} of {name}" for name, ws in dropped.items()), stacklevel=2)
    joined = {"kind": "sweep", "provenance": dict(first["provenance"]), "config": dict(first["config"]),
              "workloads": {}, "joined": [], "dropped_workloads": dropped}
    for record, name in zip(records, names):
        for workload in common:
            entry = record["workloads"][workload]
            if entry["lengths"] != first["workloads"][workload]["lengths"]:
                raise ValueError(f"{name} ran other prompt lengths for {workload!r} than {names[0]}")
            target = joined["workloads"].setdefault(workload, {k: v for k, v in entry.items() if k != "summary"}
                                                    | {"paths": {}})
            for path, result in entry["paths"].items():
                if path in target["paths"]:
                    raise ValueError(f"path {path!r} of {workload!r} is in {name} and in an earlier record")
                spread = {} if result.get("median_ms") is not None or not result.get("samples_ms") \
                    else sample_spread(result["samples_ms"])
                target["paths"][path] = {**result, **spread}
        prov = record["provenance"]
        joined["joined"].append({"file": name, "git_sha": prov.get("git_sha"), "date": prov.get("date"),
                                 "paths": list(next(iter(record["workloads"].values()))["paths"])})
    joined["config"]["paths"] = [p for j in joined["joined"] for p in j["paths"]]
    for entry in joined["workloads"].values():
        entry["summary"] = workload_summary(entry["paths"])
    joined["summary"] = summarize(joined)
    return joined


def load_rl_results(path: str | os.PathLike) -> dict[str, Any]:
    """A record written by ``rollout-lab bench rl`` (kind "rl_throughput")."""
    return load_record(Path(path), "rl_throughput")


def load_prefill_routes_results(path: str | os.PathLike) -> dict[str, Any]:
    """A record written by ``rollout-lab bench prefill-routes`` (kind "prefill_routes")."""
    return load_record(Path(path), "prefill_routes")


def load_decode_step_results(path: str | os.PathLike) -> dict[str, Any]:
    """A record written by ``rollout-lab bench decode-step`` (kind "decode_step")."""
    return load_record(Path(path), "decode_step")


def load_grpo_results(path: str | os.PathLike) -> dict[str, Any]:
    """A GRPO record (kind "grpo") of ``measure.grpo.run_grpo``: ``rollout-lab bench grpo`` or notebook 03."""
    return load_record(Path(path), "grpo")


MAX_RECORD_BYTES = 256 * 2**20  # a sweep with every profile is ~100 KiB; refuse anything absurd


def load_record(path: Path, kind: str) -> dict[str, Any]:
    """A record of ``kind`` read from ``path`` and checked against its CSV twin."""
    record = read_json_file(path, what="results file", max_bytes=MAX_RECORD_BYTES)
    if not isinstance(record, dict) or record.get("kind") != kind:
        raise ValueError(f"{str(path)!r} is not a {kind} record (kind != {kind!r})")
    check_record_pair(path, record=record)
    return record


def rl_throughput_rows(record: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One row per path of an RL throughput record: E2E, output tok/s, decode ms per step, memory;
    ``git_sha`` (7 characters) names the code that ran, for tables that join several records."""
    rows = []
    sha = str(record.get("provenance", {}).get("git_sha") or "")[:7]
    for path, res in record["results"].items():
        peak = res.get("peak_memory_bytes")
        rows.append({"path": path, "git_sha": sha, "mean_ms": res.get("mean_ms"),
                     "output_tokens_per_s": res.get("output_tokens_per_s"),
                     "first_call_ms": res.get("first_call_ms"), "decode_ms_per_step": res.get("decode_ms_per_step"),
                     "num_slots": res.get("num_slots"), "peak_memory_gb": None if peak is None else peak / 1e9,
                     "skipped": res.get("skipped")})
    return rows


def decode_step_rows(record: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One row per (case, variant) of a decode-step record: median ms per step and its spread, the
    first-call cost (compile and capture) and which levers were on."""
    return [{"case": case, "variant": variant, "step_ms_median": r["step_ms_median"],
             "step_ms_stdev": r["step_ms_stdev"], "first_call_ms": r["first_call_ms"],
             "spans": r["spans"], "compiled": r["compiled"]}
            for case, variants in record["cases"].items() for variant, r in variants.items()]


def grpo_rows(record: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One row per timed sample and one mean row per path of a GRPO record: E2E ms, output tokens/s,
    the peak memory over the weights and how many rows each path prefilled."""
    rows = []
    tokens = record["workload"]["num_generated_tokens"]
    for path, res in record["results"].items():
        peak = res["peak_memory_bytes"]
        common = {"peak_memory_mib": None if peak is None else round(peak / 2**20, 1),
                  "num_prefill_rows": res["num_prefill_rows"], "num_replicated_rows": res["num_replicated_rows"],
                  "route": res["route"]}
        for rep, ms in enumerate(res["ms"], 1):
            rows.append({"path": path, "statistic": "sample", "rep": rep, "ms": round(ms, 3),
                         "tokens_per_s": round(tokens / (ms / 1e3), 1), **common})
        rows.append({"path": path, "statistic": "mean", "rep": None, "ms": round(res["mean_ms"], 3),
                     "tokens_per_s": round(res["tokens_per_s"], 1), **common})
    return rows


HF_COLUMNS = {"nocb": "hf_generate", "hf_static": "hf_static", "hf_generate_batch": "hf_generate_batch"}


def whole_table_rows(
    sweeps: Sequence[tuple[str, Mapping[str, Any]]] = (), *, rl: Sequence[tuple[str, Mapping[str, Any]]] = (),
    grpo: Sequence[tuple[str, Mapping[str, Any]]] = (),
) -> list[dict[str, Any]]:
    """The whole table: one row per workload of every record given as (name, record), ours against
    each HF peer that record holds, in ms of the whole call (a sweep's median, a benchmark's mean).

    Ours is Auto in a sweep, ``ours`` in an RL record and shared prefill in a GRPO one. The HF columns
    are ``hf_generate`` (a sweep's nocb route is HF ``generate`` on the padded batch; a GRPO record's
    ``generate(num_return_sequences)``), ``hf_static`` and ``hf_generate_batch``; a peer that the
    record lacks is None. ``speedup_over_best_hf`` is the fastest HF column over ours, and every row
    names its record (the file names) and git sha."""
    def ms(result: Mapping[str, Any] | None) -> float | None:
        if result is None or result.get("skipped"):
            return None
        return result.get("median_ms") if result.get("median_ms") is not None else result.get("mean_ms")

    def row(workload, record, name, *, requests, tokens, ours_path, ours, peers):
        hf = {col: ms(peers.get(col)) for col in HF_COLUMNS.values()}
        ours_ms = ms(ours)
        best = min(((v, k) for k, v in hf.items() if v), default=None)
        prov = record.get("provenance", {})
        return {"workload": workload, "model": record["config"].get("model") or prov.get("model_name"),
                "requests": requests, "output_tokens": tokens, "ours": ours_path, "ours_ms": ours_ms,
                **{f"{col}_ms": v for col, v in hf.items()},
                "ours_tokens_per_s": None if not ours_ms else tokens / (ours_ms / 1e3),
                "best_hf": None if best is None else best[1],
                "speedup_over_best_hf": None if best is None or not ours_ms else best[0] / ours_ms,
                "record": " + ".join(Path(part).name for part in name.split(" + ")),
                "git_sha": str(prov.get("git_sha") or "")[:7]}

    rows = []
    for name, record in sweeps:
        new_tokens = record["config"]["max_new_tokens"]
        for workload, entry in record["workloads"].items():
            paths = entry["paths"]
            rows.append(row(f"{workload} x {new_tokens}", record, name, requests=entry["num_requests"],
                            tokens=entry["num_requests"] * new_tokens, ours_path="auto", ours=paths.get("auto"),
                            peers={HF_COLUMNS[p]: r for p, r in paths.items() if p in HF_COLUMNS}))
    for name, record in rl:
        work = record["workload"]
        rows.append(row(f"RL shape ({work['num_requests']} requests)", record, name, requests=work["num_requests"],
                        tokens=work["num_output_tokens"], ours_path="ours", ours=record["results"].get("ours"),
                        peers={"hf_generate_batch": record["results"].get("hf_generate_batch")}))
    for name, record in grpo:
        work = record["workload"]
        rows.append(row(f"GRPO {work['num_prompts']} x {work['num_samples']} x {record['config']['max_new_tokens']}",
                        record, name, requests=work["num_rows"], tokens=work["num_generated_tokens"],
                        ours_path="shared", ours=record["results"].get("shared"),
                        peers={"hf_generate": record["results"].get("hf_generate")}))
    return rows


def load_sweeps(files: str | Sequence[str | Sequence[str]] | None) -> list[tuple[str, dict[str, Any]]]:
    """(name, record) for each entry of ``files``: a sweep JSON, or a list of them joined by
    ``join_sweeps`` (e.g. a sweep and its HF peer run in its own process); None gives none."""
    if files is None:
        return []
    out = []
    for entry in [files] if isinstance(files, (str, os.PathLike)) else files:
        if isinstance(entry, (str, os.PathLike)):
            out.append((str(entry), load_results(entry)))
        else:
            names = [str(f) for f in entry]
            out.append((" + ".join(names), join_sweeps([load_results(f) for f in names], names)))
    return out


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
            rollout.generate(prompts, max_new_tokens=max_new_tokens)
    rows, reference = [], None
    for mode, rollout in rollouts.items():
        result = rollout.generate(prompts, max_new_tokens=max_new_tokens)
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
        net, name = load_model(model, dtype=dtype, device=device)
        costs = None
        if cost_file is not None:
            costs = load_calibration(cost_file, model=net, model_name=name, override=override_costs,
                                     prefill_graphs=prefill_graphs)
        if results_stem is None:
            results_stem = str(Workspace.resolve(output_dir).results / f"sweep_{run_tag(name, dtype, device)}")
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


def e2e_table(record: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The reference's table: one row per workload, median E2E ms per path, Auto's route and
    Auto/best (and whether Auto and the best manual path differ by more than their spread)."""
    rows = results_table(record)
    summary = {r["workload"]: r for r in summary_table(record)}
    out = []
    for name, w in record["workloads"].items():
        row: dict[str, Any] = {"workload": name, "num_requests": w["num_requests"],
                               "padding_share": round(w["padding_share"], 3)}
        for r in rows:
            if r["workload"] == name:
                row[f"{r['path']}_ms"] = r["median_ms"] if r.get("median_ms") is not None else r["mean_ms"]
        s = summary[name]
        row.update({"auto_route": s["auto_route"], "best_manual_path": s["best_manual_path"],
                    "auto_vs_best": s["auto_vs_best"], "auto_over_best_peer": s["auto_over_best_peer"],
                    "auto_vs_best_beyond_spread": s.get("auto_vs_best_manual_beyond_spread")})
        out.append(row)
    return out
