"""The GRPO-shaped rollout benchmark's command line (``rollout_lab.measure.grpo``): N prompts x S
sampled responses, shared prefill against unshared and HF ``num_return_sequences``.

    # GPU (H200, ~1-2 min): 64 GSM8K prompts x 8 samples, 128 new tokens, Qwen2.5-3B shapes, bf16
    PYTHONPATH=. python3 scripts/bench_grpo.py --out data/results/grpo_qwen2.5-3b_bf16_cuda
    # CPU check in seconds
    PYTHONPATH=. python3 scripts/bench_grpo.py --tiny qwen2 --scale 0.1 --out /tmp/grpo_tiny

The workload, the paths and what is timed are ``measure.grpo``'s. Writes ``<out>.json`` (record
with provenance) and ``<out>.csv`` (one row per timed sample and one mean row per path); an
existing ``<out>`` is an error, never overwritten.
"""
from __future__ import annotations

import argparse
import sys

import torch

from rollout_lab.cli import record_out
from rollout_lab.engine.config import MODES
from rollout_lab.measure.calibrate import load_calibration
from rollout_lab.measure.grpo import GRPO_DEFAULTS, GRPO_PATHS, check_grpo_settings, run_grpo
from rollout_lab.measure.models import add_model_options, load_model, resolve_model_options
from rollout_lab.measure.sweep import grpo_rows
from rollout_lab.measure.workloads import DATASETS
from rollout_lab.workspace import write_record


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, type=record_out,
                   help="output stem: writes <out>.json and <out>.csv (neither may exist)")
    add_model_options(p, default_preset="qwen2.5-3b")
    d = GRPO_DEFAULTS  # run_grpo's own defaults
    p.add_argument("--dataset", default=d["dataset"], choices=DATASETS, help="prompt-length distribution")
    p.add_argument("--num-prompts", type=int, default=d["num_prompts"], help="unique prompts (default %(default)s)")
    p.add_argument("--num-samples", type=int, default=d["num_samples"], help="samples per prompt (default %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=d["max_new_tokens"], help="tokens per sample (default %(default)s)")
    p.add_argument("--scale", type=float, default=d["scale"], help="multiply every prompt length (CPU checks)")
    p.add_argument("--temperature", type=float, default=d["temperature"], help="sampling temperature (default %(default)s)")
    p.add_argument("--top-p", type=float, default=d["top_p"], help="nucleus mass (default %(default)s = off)")
    p.add_argument("--seed", type=int, default=d["seed"], help="workload and sampling seed")
    p.add_argument("--mode", default=d["mode"], choices=MODES, help="our route (default %(default)s)")
    p.add_argument("--costs", default=None, help="cost file for our planner (default: reference coefficients)")
    p.add_argument("--reps", type=int, default=d["reps"], help="timed interleaved rounds after one warm-up (default %(default)s)")
    p.add_argument("--paths", nargs="+", default=list(d["paths"]), choices=GRPO_PATHS, help="paths to run")
    args = p.parse_args(argv)
    try:
        check_grpo_settings(**{k: getattr(args, k) for k in GRPO_DEFAULTS})
    except ValueError as err:
        p.error(str(err))
    args.model = resolve_model_options(args)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    paths = args.out
    if args.tiny:
        torch.set_num_threads(1)  # tiny shapes: more threads only contend (this script's process only)
    model, model_name = load_model(args.model, dtype=args.dtype, device=args.device)
    costs = load_calibration(args.costs, model=model, model_name=model_name) if args.costs else None
    record = run_grpo(model, model_name=model_name, dtype=args.dtype, costs=costs, costs_source=args.costs,
                      config={"preset": args.preset, "tiny": args.tiny, "device": args.device},
                      script="scripts/bench_grpo.py", argv=(sys.argv[1:] if argv is None else argv),
                      **{k: getattr(args, k) for k in GRPO_DEFAULTS})
    print(write_record(paths, record, grpo_rows(record)), end="")
    print(f"ratios: {record['ratios']}  checks: {record['checks']}")
    print(f"wrote {paths[0]} and {paths[1]}")


if __name__ == "__main__":
    main()
