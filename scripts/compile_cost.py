"""First-call cost of the compiled decode step, the whole model against one decoder layer at a time.

    # the record in data/results: a 36-layer tiny qwen2 (Qwen2.5-3B's depth), inductor, this CPU
    PYTHONPATH=. python3 scripts/compile_cost.py --out data/results/compile_cost_tiny-qwen2-36l_float32_cpu
    PYTHONPATH=. python3 scripts/compile_cost.py --layers 2 --rows 4 1 --out /tmp/cc   # seconds
    PYTHONPATH=. python3 scripts/compile_cost.py --symbolic-floats --out ...   # torch's default floats (a restart)

For each mode of ``engine.runner.compiling`` (``model``, ``layers``) the decode step of a tiny model deepened
to ``--layers`` runs once at each row count of ``--rows``, compiled with ``--backend``, in a process
of its own with an empty inductor cache (so neither mode inherits the other's warm-up or cache);
each call's seconds (a compile where dynamo specialises a new size, a cache hit
otherwise) and whether its tokens equal the eager step's are recorded. What a GPU adds (CUDA-graph
capture, the step's ms) is ``rollout-lab bench decode-step``'s ``ours`` (layer by layer) and ``ours_compile_model`` variants.
"""
from __future__ import annotations

import argparse
from contextlib import nullcontext
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from rollout_lab.cli.options import positive_int, record_out
from rollout_lab.engine.runner.compiling import COMPILE_MODES, compile_forward, tracing
from rollout_lab.engine.runner.prefill import cache_kwarg_name
from rollout_lab.engine.runner.steppers import EagerStepper, StepperKey
from rollout_lab.measure.models import TINY_FAMILIES, tiny_config
from rollout_lab.measure.provenance import provenance
from rollout_lab.workspace import write_record

CAPACITY = 64  # cache columns: the step's cost here is the compile, not the attention


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=record_out,
                   help="output stem: writes <out>.json and <out>.csv (neither may exist)")
    p.add_argument("--family", default="qwen2", choices=sorted(TINY_FAMILIES), help="tiny family (default qwen2)")
    p.add_argument("--layers", type=positive_int, default=36, help="decoder layers (default 36, Qwen2.5-3B's)")
    p.add_argument("--rows", type=positive_int, nargs="+", default=[16, 8, 4, 2, 1],
                   help="row counts stepped in turn, the first one the slot count (default 16 8 4 2 1)")
    p.add_argument("--modes", nargs="+", default=list(COMPILE_MODES), choices=COMPILE_MODES)
    p.add_argument("--backend", default="inductor", help="torch.compile backend (default inductor)")
    p.add_argument("--symbolic-floats", action="store_true",
                   help="trace outside engine.runner.compiling.tracing(), with torch's default symbolic floats "
                        "(the frame restarts once): the baseline of the float constants the engine traces with")
    p.add_argument("--child", choices=COMPILE_MODES, help=argparse.SUPPRESS)  # one mode, its rows on stdout
    args = p.parse_args(argv)
    if args.out is None and args.child is None:
        p.error("the following arguments are required: --out")
    if max(args.rows) != args.rows[0]:
        p.error(f"--rows must start with the largest (the slot count), got {args.rows}")
    return args


def deep_tiny(family: str, layers: int) -> torch.nn.Module:
    config = tiny_config(family, num_layers=layers)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()


def run_mode(model: torch.nn.Module, mode: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    torch._dynamo.reset()
    key = StepperKey(num_slots=args.rows[0], capacity=CAPACITY, cache_kwarg=cache_kwarg_name(model), spans=False)
    eager, compiled = EagerStepper(model, key), EagerStepper(model, key)
    compiled.forward = compile_forward(model, mode, backend=args.backend)
    rows_out = []
    with torch.no_grad(), (nullcontext() if args.symbolic_floats else tracing()):  # as the engine's captures trace
        for rows in args.rows:
            eager.reset()
            want = eager.step(rows, 0).clone()
            compiled.reset()
            started = time.perf_counter()
            got = compiled.step(rows, 0).clone()
            seconds = time.perf_counter() - started
            graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
            rows_out.append({"mode": mode, "rows": rows, "seconds": seconds, "unique_graphs": graphs,
                             "equal_to_eager": bool(torch.equal(got, want))})
            print(f"{mode:7s} {rows:4d} rows {seconds:7.1f} s  graphs so far {graphs:4d}  "
                  f"equal {rows_out[-1]['equal_to_eager']}", file=sys.stderr, flush=True)
    return rows_out


def in_own_process(mode: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """``run_mode`` in a fresh interpreter with an empty inductor cache; its rows."""
    child = ["--family", args.family, "--layers", str(args.layers), "--rows", *map(str, args.rows),
             "--backend", args.backend, "--child", mode, *(["--symbolic-floats"] if args.symbolic_floats else [])]
    with tempfile.TemporaryDirectory(prefix="compile_cost_") as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
        done = subprocess.run([sys.executable, __file__, *child], env=env, stdout=subprocess.PIPE, text=True)
    if done.returncode != 0:
        raise SystemExit(f"the {mode} run failed with status {done.returncode}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.child:
        print(json.dumps(run_mode(deep_tiny(args.family, args.layers), args.child, args)))
        return
    record: dict[str, Any] = {
        "kind": "compile_cost",
        "provenance": provenance(device=torch.device("cpu"), dtype="float32", script="scripts/compile_cost.py",
                                 argv=argv),
        "config": {"model": f"tiny-{args.family}", "layers": args.layers, "rows": args.rows,
                   "modes": args.modes, "backend": args.backend, "symbolic_floats": args.symbolic_floats},
        "rows": [], "total_seconds": {},
    }
    for mode in args.modes:
        rows = in_own_process(mode, args)
        record["rows"] += rows
        record["total_seconds"][mode] = sum(r["seconds"] for r in rows)
        write_record(args.out, record, record["rows"])  # after every mode: a cut run keeps the first
        print(f"{mode}: {record['total_seconds'][mode]:.1f} s over {len(rows)} calls")
    print(f"wrote {args.out[0]} and {args.out[1]}")


if __name__ == "__main__":
    main()
