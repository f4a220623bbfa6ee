"""The ``rollout-lab`` command: plan, reproduce, and the subcommands later modules register.

    rollout-lab plan 512 16 16 16 --max-new-tokens 16
    rollout-lab plan --file lengths.txt --preset qwen2.5-3b --dtype float32
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

from rollout_lab.cost import CostCoefficients, ModelGeometry, prefill_cost_ms

# Geometry of the presets without importing torch or building a model.
PRESET_GEOMETRY = {
    "qwen2.5-0.5b": (24, 14, 2, 64),
    "qwen2.5-3b": (36, 16, 2, 128),
    "qwen3-0.6b": (28, 16, 8, 128),
    "qwen3-32b": (64, 64, 8, 128),
}
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def _read_lengths(args: argparse.Namespace) -> list[int]:
    tokens = list(args.lengths)
    if args.file:
        path = Path(args.file)
        if not path.is_file():
            raise SystemExit(f"error: --file {str(path)!r} does not exist")
        tokens += path.read_text().replace(",", " ").split()
    lengths = []
    for token in tokens:
        try:
            lengths.append(int(token))
        except ValueError:
            raise SystemExit(f"error: prompt length {token!r} is not an integer") from None
    return lengths


def _coeffs(args: argparse.Namespace) -> CostCoefficients:
    if args.costs:
        return CostCoefficients.from_json(args.costs)
    return CostCoefficients()


def cmd_plan(args: argparse.Namespace) -> int:
    from rollout_lab.planner import choose_route, plan_buckets

    lengths = _read_lengths(args)
    if not lengths:
        raise SystemExit("error: give prompt lengths as arguments or with --file")
    geometry = ModelGeometry(*PRESET_GEOMETRY[args.preset], DTYPE_BYTES[args.dtype])
    coeffs = _coeffs(args)
    try:
        plan = plan_buckets(lengths, geometry, coeffs)
        route = choose_route(lengths, max_new_tokens=args.max_new_tokens,
                             continuous_batch_size=args.continuous_batch_size,
                             geometry=geometry, coeffs=coeffs)
    except ValueError as err:
        raise SystemExit(f"error: {err}") from None
    print(f"{len(lengths)} prompts, {args.preset} {args.dtype} geometry")
    print(f"{'bucket':>6} {'rows':>6} {'width':>6} {'padded':>7} {'est ms':>9}")
    for k, (bucket, width) in enumerate(zip(plan.buckets, plan.widths)):
        pad = len(bucket) * width - sum(lengths[i] for i in bucket)
        print(f"{k:>6} {len(bucket):>6} {width:>6} {pad:>7} {prefill_cost_ms(len(bucket), width, geometry, coeffs):>9.2f}")
    one = prefill_cost_ms(len(lengths), max(lengths), geometry, coeffs)
    print(f"bucketed prefill {plan.cost_ms:.2f} ms in {plan.num_buckets} forwards "
          f"(one bucket: {one:.2f} ms)")
    nocb = "not eligible" if route.nocb_cost_ms is None else f"{route.nocb_cost_ms:.2f} ms"
    print(f"route for {args.max_new_tokens} new tokens: {route.route} "
          f"(nocb {nocb}, bucketed CB {route.cb_cost_ms:.2f} ms)")
    return 0


def cmd_reproduce(args: argparse.Namespace) -> int:
    from rollout_lab import reproduce

    return reproduce.main(quick=args.quick)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rollout-lab", description="rollout_lab: fast RL rollouts for prompts of varying length")
    sub = parser.add_subparsers(dest="command", required=True)
    plan = sub.add_parser("plan", help="print the DP's buckets and the route choice for prompt lengths")
    plan.add_argument("lengths", nargs="*", help="prompt lengths in tokens")
    plan.add_argument("--file", help="a file of lengths (whitespace- or comma-separated)")
    plan.add_argument("--preset", choices=sorted(PRESET_GEOMETRY), default="qwen2.5-3b", help="model geometry")
    plan.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default="float32", help="KV element type")
    plan.add_argument("--costs", help="a cost file from `rollout-lab calibrate` (default: reference coefficients)")
    plan.add_argument("--max-new-tokens", type=int, default=16, help="generation budget for the route choice")
    plan.add_argument("--continuous-batch-size", type=int, default=None, help="number of slots (default: all)")
    plan.set_defaults(func=cmd_plan)
    rep = sub.add_parser("reproduce", help="the main job that `make reproduce` runs")
    rep.add_argument("--quick", action="store_true", help="smallest parameters")
    rep.set_defaults(func=cmd_reproduce)
    for module in ("calibrate", "bench", "notebooks"):
        try:
            register = __import__(f"rollout_lab.{module}", fromlist=["register_cli"]).register_cli
        except (ImportError, AttributeError):
            continue
        register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
