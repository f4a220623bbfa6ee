"""The three prefill routes side by side (measure.prefill_routes), written as a record.

    # GPU (H200): Qwen2.5-3B bf16, lognormal and bimodal batches of 32..512 prompts
    PYTHONPATH=. python3 scripts/bench_prefill_routes.py --prefill-graphs --out data/results/prefill_routes_qwen2.5-3b_bfloat16_cuda
    # CPU check in seconds
    PYTHONPATH=. python3 scripts/bench_prefill_routes.py --tiny qwen2 --batch-sizes 4 8 --out /tmp/prefill

Notebook 03 renders the record with ``prefill_routes_file=...`` (or measures live with
``prefill_batch_sizes``). ``--costs`` gives Auto's planner a calibration (for the bucketed plan).
"""
from __future__ import annotations

import argparse
import sys

from rollout_lab.cli import positive_int, record_out
from rollout_lab.measure.calibrate import load_calibration
from rollout_lab.measure.models import add_model_options, load_model, resolve_model_options
from rollout_lab.measure.prefill_routes import PREFILL_ROUTES, longest_prompt, prefill_route_rows
from rollout_lab.measure.provenance import provenance
from rollout_lab.measure.workloads import crossing_batches
from rollout_lab.planner.shape_classes import ShapeClasses
from rollout_lab.workspace import write_record


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, type=record_out,
                   help="output stem: writes <out>.json and <out>.csv (neither may exist)")
    add_model_options(p, default_preset="qwen2.5-3b")
    p.add_argument("--batch-sizes", nargs="+", type=positive_int, default=[32, 64, 128, 256, 512])
    p.add_argument("--repetitions", type=positive_int, default=3, help="timed rounds after one warm-up")
    p.add_argument("--routes", nargs="+", default=list(PREFILL_ROUTES), choices=PREFILL_ROUTES,
                   help="prefill routes to run (default all three)")
    p.add_argument("--costs", default=None, help="a calibration for the bucketed plan (default: reference coefficients)")
    p.add_argument("--prefill-graphs", action="store_true",
                   help="CUDA: buckets at the shape-class ladder, each class's forward captured (as sweep --prefill-graphs)")
    args = p.parse_args(argv)
    if args.prefill_graphs and args.tiny:
        p.error("--prefill-graphs captures CUDA graphs: give a preset on a CUDA device, not --tiny")
    name = resolve_model_options(args)
    model, model_name = load_model(name, dtype=args.dtype, device=args.device)
    costs = load_calibration(args.costs, model=model, model_name=model_name,
                             prefill_graphs=args.prefill_graphs) if args.costs else None
    engine = {}
    if args.prefill_graphs:  # the ladder over every batch this bench draws
        engine = {"prefill_classes": ShapeClasses.ladder(max_width=longest_prompt(model), max_rows=max(args.batch_sizes)),
                  "prefill_graphs": True}
    device = next(model.parameters()).device
    record = {
        "kind": "prefill_routes",
        "provenance": provenance(device=device, dtype=args.dtype, script="scripts/bench_prefill_routes.py",
                                 argv=sys.argv[1:]),
        "config": {"model": model_name, "batch_sizes": args.batch_sizes, "repetitions": args.repetitions,
                   "costs": args.costs, "routes": args.routes, "prefill_graphs": args.prefill_graphs},
    }

    kinds = set(crossing_batches(1, 0))  # the distributions every batch size runs

    def write(rows: list[dict]) -> None:  # after every batch: a cut run keeps them
        done = sorted({r["batch_size"] for r in rows  # a size is done when all its distributions are
                       if {q["distribution"] for q in rows if q["batch_size"] == r["batch_size"]} == kinds})
        complete = set(done) == set(args.batch_sizes)
        write_record(args.out, record | {"rows": rows, "complete": complete, "batch_sizes_done": done}, rows)
        print(f"batch sizes {done} written to {args.out[0]}", file=sys.stderr)

    prefill_route_rows(model, batch_sizes=args.batch_sizes, repetitions=args.repetitions, costs=costs,
                       engine=engine, routes=args.routes, on_batch_size=write,
                       log=lambda line: print(line, file=sys.stderr))
    print(f"wrote {args.out[0]} and {args.out[1]}")


if __name__ == "__main__":
    main()
