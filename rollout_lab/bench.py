"""Interleaved sweeps of every route against the HF peers, written as JSON + CSV with provenance.

    rollout-lab sweep --tiny qwen2 --workloads long_tail spread --scale 0.25 --out data/results/tiny
    rollout-lab sweep --preset qwen2.5-3b --costs data/calibration/qwen2.5-3b_bfloat16_cuda.json

    from rollout_lab.bench import run_sweep, write_results, results_table
    record = run_sweep(model, workloads={"lt": get_workload("long_tail", scale=0.05)}, repetitions=2)

Per workload: one warm-up call of every path, then ``repetitions`` interleaved rounds (each call
timed whole, device synchronised before and after), then one profiling call per path. EOS is
disabled (``eos_token_id=None`` for ours, ``min_new_tokens = max_new_tokens`` for HF), so every
path generates the same number of tokens. Peers that fail are skipped with the reason recorded.
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import io
import json
import os
import statistics
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from rollout_lab.io import write_text_atomic
from rollout_lab.workloads import WORKLOADS, get_workload, lengths_to_prompts, padding_share

OUR_PATHS = ("nocb", "equal_width", "aligned", "bucketed", "auto")
MANUAL_PATHS = ("nocb", "equal_width", "aligned", "bucketed")
PEER_PATHS = ("hf_static", "hf_generate_batch")
PATHS = OUR_PATHS + PEER_PATHS
SEED_WORKLOADS = ("short_similar", "long_tail", "short_tail", "moderate_tail", "spread")
DEFAULT_ORACLE_MAX_TOKENS = 1024  # prompt + generated tokens of a workload, for the oracle check
PROFILE_FIELDS = ("planning_ms", "prefill_ms", "decode_ms", "cache_ms", "total_ms",
                  "num_prefill_forwards", "num_decode_forwards", "num_generated_tokens")


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


def check_paths(paths: Sequence[str] | None) -> tuple[str, ...]:
    paths = PATHS if paths is None else tuple(paths)
    unknown = [p for p in paths if p not in PATHS]
    if unknown or not paths:
        raise ValueError(f"unknown paths {unknown or '(none given)'}; valid: {', '.join(PATHS)}")
    return tuple(dict.fromkeys(paths))


def _check_attn_implementation(model: Any, expected: Any) -> None:
    """generate_batch may switch the model to a paged attention; put the sweep's own back."""
    if expected is not None and getattr(model.config, "_attn_implementation", None) != expected:
        model.set_attn_implementation(expected) if hasattr(model, "set_attn_implementation") \
            else setattr(model.config, "_attn_implementation", expected)


def _release_memory(device: Any) -> None:
    """After generate_batch: drop its paged cache (~all free GPU memory) before the next path runs."""
    import gc

    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _synchronize(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed_call(fn: Callable[[], Any], device: Any) -> tuple[float, Any, int | None]:
    """(ms, output, peak allocated bytes or None) of one whole call."""
    import time

    import torch

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    _synchronize(device)
    start = time.perf_counter()
    out = fn()
    _synchronize(device)
    ms = (time.perf_counter() - start) * 1e3
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return ms, out, peak


class _PathRunner:
    """One path's calls: ``call()`` (timed), ``profile()`` -> info or None, ``close()``.

    Our paths keep one Rollout (its captured decode graph and cache) for the warm-up, the timed
    calls and the profiling call after them; it is closed when the workload ends.
    """

    def __init__(self, model, path, prompts, *, max_new_tokens, costs, pad, repetition_penalty, decode):
        self.model, self.path, self.prompts, self.max_new_tokens = model, path, prompts, max_new_tokens
        self.pad, self.repetition_penalty = pad, repetition_penalty
        self.settings = dict(mode=path, eos_token_id=None, pad_token_id=pad,
                             repetition_penalty=repetition_penalty)
        if costs is not None:
            self.settings["costs"] = costs
        if decode is not None:
            self.settings["decode"] = decode
        self._rollout = None

    def _engine(self, *, profile: bool):
        from rollout_lab.engine import Rollout, RolloutConfig

        if self._rollout is None:
            self._rollout = Rollout(self.model, RolloutConfig(**self.settings, profile=profile))
        return self._rollout

    def call(self) -> Any:
        from rollout_lab import peers

        if self.path in OUR_PATHS:
            return self._engine(profile=False).generate(self.prompts, max_new_tokens=self.max_new_tokens)
        if self.path == "hf_static":
            return peers.hf_generate(self.model, self.prompts, max_new_tokens=self.max_new_tokens,
                                     pad_token_id=self.pad, cache_implementation="static",
                                     repetition_penalty=self.repetition_penalty)
        return peers.hf_generate_batch(self.model, self.prompts, max_new_tokens=self.max_new_tokens,
                                       pad_token_id=self.pad)

    def profile(self) -> dict[str, Any]:
        if self.path not in OUR_PATHS:  # peers have no profile: no extra call
            return {"route": None, "buckets": None, "profile": None}
        # The timed calls' Rollout, with profiling switched on: its decode graph is already captured,
        # so the profile is a steady-state call's and no capture happens after the peers compiled.
        rollout = self._engine(profile=True)
        rollout.config = dataclasses.replace(rollout.config, profile=True)
        result = rollout.generate(self.prompts, max_new_tokens=self.max_new_tokens)
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


def _sequences(out: Any) -> list[list[int]]:
    seqs = getattr(out, "sequences", out)
    return [list(map(int, s)) for s in seqs]


def run_sweep(
    model: Any,
    *,
    workloads: Sequence[str] | Mapping[str, Sequence[int]],
    paths: Sequence[str] | None = None,
    repetitions: int = 3,
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
) -> dict[str, Any]:
    """Time every path on every workload; a JSON-ready record (also written to ``out`` after each
    workload, when given, so an interrupted sweep keeps what it finished).

    ``costs`` (CostCoefficients, default: the engine's) drive auto and bucketed; ``decode``
    ("graph", "eager", "auto"; None = the engine's default) picks our CB decode stepper. The oracle
    (one-request unpadded HF generate) is checked on workloads whose prompt + generated tokens
    are at most ``oracle_max_tokens`` (0 = never); elsewhere ``matches_oracle`` is None.
    """
    import torch
    from tqdm.auto import tqdm

    from rollout_lab.calibrate import run_metadata

    lengths_by_name = resolve_workloads(workloads, scale=workload_scale)
    paths = check_paths(paths)
    if isinstance(repetitions, bool) or not isinstance(repetitions, int) or repetitions < 1:
        raise ValueError(f"repetitions must be an int >= 1, got {repetitions!r}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    config = model.config.get_text_config(decoder=True)
    device = next(model.parameters()).device
    pad = config.pad_token_id if config.pad_token_id is not None else 0
    special = [t for t in (config.pad_token_id, config.eos_token_id, config.bos_token_id) if isinstance(t, int)]
    record: dict[str, Any] = {
        "kind": "sweep",
        "provenance": run_metadata(model, model_name=model_name),
        "config": {
            "paths": list(paths), "repetitions": repetitions, "max_new_tokens": max_new_tokens,
            "repetition_penalty": repetition_penalty, "workload_scale": workload_scale,
            "oracle_max_tokens": oracle_max_tokens, "decode": decode or "engine default",
            "costs": None if costs is None else costs.to_dict(), "costs_source": costs_source or (
                "engine defaults" if costs is None else "given"),
        },
        "workloads": {},
    }
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
                decode=decode, bar=bar,
            )
            record["summary"] = summarize(record)
            if out is not None:
                write_results(record, out)
    bar.close()
    record["summary"] = summarize(record)
    return record


def _sweep_workload(model, prompts, paths, *, device, repetitions, max_new_tokens, costs, pad,
                    repetition_penalty, oracle_max_tokens, decode, bar) -> dict[str, Any]:
    runners = {p: _PathRunner(model, p, prompts, max_new_tokens=max_new_tokens, costs=costs, pad=pad,
                              repetition_penalty=repetition_penalty, decode=decode) for p in paths}
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
            _, out, _ = _timed_call(runners[path].call, device)
            outputs[path] = _sequences(out)
            results[path] = {"samples_ms": [], "peak_mem_bytes": None, "skipped": None}
        except Exception as err:  # noqa: BLE001 - recorded, and only for peers
            if path in OUR_PATHS:
                raise
            results[path] = {"skipped": f"{type(err).__name__}: {err}"[:500]}
        if path == "hf_generate_batch":
            _release_memory(device)
            _check_attn_implementation(model, attn_implementation)
        bar.update()
    live = [p for p in paths if results[p].get("skipped") is None]
    for _ in range(repetitions):
        for path in live:
            ms, _, peak = _timed_call(runners[path].call, device)
            if path == "hf_generate_batch":
                _release_memory(device)
                _check_attn_implementation(model, attn_implementation)
            results[path]["samples_ms"].append(ms)
            if peak is not None:
                results[path]["peak_mem_bytes"] = max(peak, results[path]["peak_mem_bytes"] or 0)
            bar.update()
        bar.update(len(paths) - len(live))
    num_tokens = len(prompts) * max_new_tokens
    is_small = oracle_max_tokens > 0 and sum(lengths) + num_tokens <= oracle_max_tokens
    oracle = None
    if is_small:
        from rollout_lab.peers import oracle_sequences

        oracle = oracle_sequences(model, prompts, max_new_tokens=max_new_tokens,
                                  repetition_penalty=repetition_penalty)
    for path in paths:
        entry = results[path]
        if entry.get("skipped") is not None:
            entry.update({"mean_ms": None, "samples_ms": [], "tokens_per_s": None, "peak_mem_bytes": None,
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
            "tokens_per_s": sum(len(s) for s in seqs) / (mean_ms / 1e3),
            **info,
            "matches_nocb": (seqs == outputs["nocb"]) if "nocb" in outputs else None,
            "matches_oracle": (seqs == oracle) if oracle is not None else None,
        })
    return {"lengths": lengths, "num_requests": len(lengths), "padding_share": padding_share(lengths),
            "paths": results, "summary": _workload_summary(results)}


def _workload_summary(results: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    def best(names):
        timed = [(results[p]["mean_ms"], p) for p in names if results.get(p, {}).get("mean_ms") is not None]
        return min(timed) if timed else (None, None)

    auto = results.get("auto", {}).get("mean_ms")
    manual_ms, manual = best(MANUAL_PATHS)
    peer_ms, peer = best(PEER_PATHS)
    over_manual = auto / manual_ms if auto is not None and manual_ms else None
    return {
        "auto_route": results.get("auto", {}).get("route"),
        "best_manual_path": manual, "best_peer_path": peer,
        "auto_over_best_manual": over_manual,
        "auto_over_best_peer": auto / peer_ms if auto is not None and peer_ms else None,
        "regression": None if over_manual is None else max(0.0, over_manual - 1.0),
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
        rows.append({"workload": name, "num_requests": w["num_requests"], **s,
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
                "padding_share": w["padding_share"], "mean_ms": r.get("mean_ms"),
                "std_ms": r.get("std_ms"), "samples_ms": ";".join(f"{x:.3f}" for x in r.get("samples_ms") or []),
                "tokens_per_s": r.get("tokens_per_s"), "peak_mem_bytes": r.get("peak_mem_bytes"),
                "route": r.get("route"), "num_buckets": None if r.get("buckets") is None else len(r["buckets"]),
                "buckets": None if r.get("buckets") is None else " ".join(f"{b}x{wd}" for b, wd in r["buckets"]),
                "matches_nocb": r.get("matches_nocb"), "matches_oracle": r.get("matches_oracle"),
                "skipped": r.get("skipped"),
                **{f: profile.get(f) for f in PROFILE_FIELDS},
            })
    return rows


def _csv_text(rows: Sequence[Mapping[str, Any]]) -> str:
    buffer = io.StringIO()
    fieldnames = list(dict.fromkeys(k for row in rows for k in row))
    writer = csv.DictWriter(buffer, fieldnames=fieldnames, lineterminator="\n")
    writer.writeheader()
    writer.writerows({k: "" if v is None else v for k, v in row.items()} for row in rows)
    return buffer.getvalue()


def write_results(record: Mapping[str, Any], stem: str | os.PathLike) -> tuple[Path, Path]:
    """Write ``<stem>.json`` and ``<stem>.csv`` atomically; both are serialised before either is written."""
    from rollout_lab.io import _jsonable

    stem = Path(stem)
    if stem.suffix in (".json", ".csv"):
        stem = stem.with_suffix("")
    json_text = json.dumps(record, indent=2, default=_jsonable) + "\n"
    csv_text = _csv_text(results_table(record))
    json_path = write_text_atomic(stem.with_name(stem.name + ".json"), json_text)
    csv_path = write_text_atomic(stem.with_name(stem.name + ".csv"), csv_text)
    return json_path, csv_path


def load_results(path: str | os.PathLike) -> dict[str, Any]:
    """A record written by ``write_results`` (``path`` may be the stem or the .json file)."""
    path = Path(path)
    if path.suffix != ".json":
        path = path.with_name(path.name + ".json") if path.suffix != ".csv" else path.with_suffix(".json")
    if not path.is_file():
        raise ValueError(f"results file {str(path)!r} does not exist")
    record = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(record, dict) or record.get("kind") != "sweep":
        raise ValueError(f"{str(path)!r} is not a sweep record (kind != 'sweep')")
    return record


# -- CLI ---------------------------------------------------------------------------------------


def cmd_sweep(args: argparse.Namespace) -> int:
    from rollout_lab.calibrate import build_model, check_device, load_calibration, resolve_model_arguments
    from rollout_lab.cost import read_cost_file
    from rollout_lab.paths import RESULTS

    resolve_model_arguments(args)
    if args.scale is None:
        args.scale = 0.25 if args.tiny else 1.0
    try:  # every check before the model is built
        lengths = resolve_workloads(args.workloads, scale=args.scale)
        paths = check_paths(args.paths)
        if args.costs:
            read_cost_file(args.costs)
    except ValueError as err:
        raise SystemExit(f"error: {err}") from None
    check_device(args.device)
    model, name = build_model(args)
    costs = None
    if args.costs:
        try:
            costs = load_calibration(args.costs, model=model, model_name=name, override=args.override_costs)
        except ValueError as err:
            raise SystemExit(f"error: {err}") from None
    out = Path(args.out) if args.out else RESULTS / f"sweep_{name}_{args.dtype}_{args.device.split(':')[0]}"
    record = run_sweep(
        model, workloads=lengths, paths=paths, repetitions=args.repetitions,
        max_new_tokens=args.max_new_tokens, costs=costs, model_name=name, progress=not args.no_progress,
        out=out, workload_scale=args.scale, oracle_max_tokens=args.oracle_max_tokens,
        costs_source=args.costs or "engine defaults", decode=args.decode,
    )
    json_path, csv_path = write_results(record, out)
    print(f"{'workload':<16} {'auto route':<10} {'auto/best manual':>17} {'auto/best peer':>15}")
    for row in summary_table(record):
        fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
        print(f"{row['workload']:<16} {str(row['auto_route']):<10} {fmt(row['auto_over_best_manual']):>17} "
              f"{fmt(row['auto_over_best_peer']):>15}")
    print(f"wrote {json_path} and {csv_path}")
    return 0


def register_cli(subparsers: Any) -> None:
    from rollout_lab.calibrate import add_model_arguments

    parser = subparsers.add_parser(
        "sweep", help="time every route and the HF peers on named workloads; JSON + CSV",
        description="One warm-up, then interleaved timed repetitions of each path; a profiling call per path.",
    )
    add_model_arguments(parser)
    parser.add_argument("--workloads", nargs="+", default=list(SEED_WORKLOADS),
                        help=f"workload names (default: the seed five); valid: {', '.join(WORKLOADS)}")
    parser.add_argument("--scale", type=float, default=None,
                        help="multiply every prompt length (default 0.25 for --tiny, 1 for presets)")
    parser.add_argument("--paths", nargs="+", default=None, help=f"paths to run (default all: {', '.join(PATHS)})")
    parser.add_argument("--repetitions", type=_positive_int, default=3, help="timed rounds after the warm-up")
    parser.add_argument("--max-new-tokens", type=_positive_int, default=16, help="tokens generated per request")
    parser.add_argument("--costs", help="cost file from `rollout-lab calibrate` (default: reference coefficients)")
    parser.add_argument("--override-costs", action="store_true",
                        help="use --costs even if its metadata does not match this run")
    parser.add_argument("--oracle-max-tokens", type=int, default=DEFAULT_ORACLE_MAX_TOKENS,
                        help="check the one-request oracle on workloads up to this many tokens (0 = never)")
    parser.add_argument("--decode", choices=("auto", "graph", "eager"), default=None,
                        help="our CB decode stepper (default: the engine's, graph on CUDA)")
    parser.add_argument("--out", help="output stem (default data/results/sweep_<model>_<dtype>_<device>)")
    parser.set_defaults(func=cmd_sweep)


def _positive_int(text: str) -> int:
    from rollout_lab.calibrate import _positive_int as parse

    return parse(text)
