"""Interleaved sweeps of every route against the HF peers, written as JSON + CSV with provenance.

    rollout-lab sweep --tiny qwen2 --workloads long_tail spread --scale 0.25 --out data/results/tiny
    rollout-lab sweep --preset qwen2.5-3b --costs data/calibration/qwen2.5-3b_bfloat16_cuda.json

    from rollout_lab.bench import run_sweep, write_results, results_table
    record = run_sweep(model, workloads={"lt": get_workload("long_tail", scale=0.05)}, repetitions=2)

Per workload: one warm-up call of every path, then ``repetitions`` interleaved rounds (each call
timed whole, device synchronised before and after), then one profiling call per path. EOS is
disabled (``eos_token_id=None`` for ours, ``min_new_tokens = max_new_tokens`` for HF), so every
path generates the same number of tokens. Peers that fail are skipped with the reason recorded.

This module runs the sweep and its CLI; the path names and one timed call are in ``bench_runner``,
the summaries, tables and files in ``bench_records`` (both re-exported here).
"""
from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path
from typing import Any, Mapping, Sequence

from rollout_lab.bench_records import (
    PROFILE_FIELDS, load_results, results_table, summarize, summary_table, workload_summary,
    write_results,
)
from rollout_lab.bench_runner import (
    MANUAL_PATHS, OUR_PATHS, PATHS, PEER_PATHS, PathRunner, check_attn_implementation, check_paths,
    output_sequences, release_memory, timed_call,
)
from rollout_lab.model_cli import add_model_arguments, positive_int
from rollout_lab.workloads import WORKLOADS, get_workload, lengths_to_prompts, padding_share

__all__ = [
    "DEFAULT_ORACLE_MAX_TOKENS", "MANUAL_PATHS", "OUR_PATHS", "PATHS", "PEER_PATHS", "PROFILE_FIELDS",
    "SEED_WORKLOADS", "check_paths", "cmd_sweep", "load_results", "register_cli", "resolve_workloads",
    "results_table", "run_sweep", "summarize", "summary_table", "write_results",
]

SEED_WORKLOADS = ("short_similar", "long_tail", "short_tail", "moderate_tail", "spread")
DEFAULT_ORACLE_MAX_TOKENS = 1024  # prompt + generated tokens of a workload, for the oracle check


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
    runners = {p: PathRunner(model, p, prompts, max_new_tokens=max_new_tokens, costs=costs, pad=pad,
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
            _, out, _ = timed_call(runners[path].call, device)
            outputs[path] = output_sequences(out)
            results[path] = {"samples_ms": [], "peak_mem_bytes": None, "skipped": None}
        except Exception as err:  # noqa: BLE001 - recorded, and only for peers
            if path in OUR_PATHS:
                raise
            results[path] = {"skipped": f"{type(err).__name__}: {err}"[:500]}
        if path == "hf_generate_batch":
            release_memory(device)
            check_attn_implementation(model, attn_implementation)
        bar.update()
    live = [p for p in paths if results[p].get("skipped") is None]
    for _ in range(repetitions):
        for path in live:
            ms, _, peak = timed_call(runners[path].call, device)
            if path == "hf_generate_batch":
                release_memory(device)
                check_attn_implementation(model, attn_implementation)
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
            "paths": results, "summary": workload_summary(results)}


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
    parser.add_argument("--repetitions", type=positive_int, default=3, help="timed rounds after the warm-up")
    parser.add_argument("--max-new-tokens", type=positive_int, default=16, help="tokens generated per request")
    parser.add_argument("--costs", help="cost file from `rollout-lab calibrate` (default: reference coefficients)")
    parser.add_argument("--override-costs", action="store_true",
                        help="use --costs even if its metadata does not match this run")
    parser.add_argument("--oracle-max-tokens", type=int, default=DEFAULT_ORACLE_MAX_TOKENS,
                        help="check the one-request oracle on workloads up to this many tokens (0 = never)")
    parser.add_argument("--decode", choices=("auto", "graph", "eager"), default=None,
                        help="our CB decode stepper (default: the engine's, graph on CUDA)")
    parser.add_argument("--out", help="output stem (default data/results/sweep_<model>_<dtype>_<device>)")
    parser.set_defaults(func=cmd_sweep)
