"""The RL-regime throughput benchmark's command line (``rollout_lab.measure.rl``): nano-vllm's
bench.py shape, with per-request budgets.

    # GPU (H200): Qwen3-0.6B, 256 sequences, prompt lengths and budgets each uniform in 100..1024
    PYTHONPATH=. python3 scripts/bench_rl.py --out data/results/rl_qwen3-0.6b_bfloat16_cuda
    # CPU check in seconds
    PYTHONPATH=. python3 scripts/bench_rl.py --tiny qwen2 --num-seqs 16 --min-len 8 --max-len 48 --out /tmp/rl

The workload, the paths and what is timed are ``measure.rl``'s. Writes ``<out>.json`` (record with
provenance: tok/s, decode ms per step, slots, peak memory per path) and ``<out>.csv`` after every
path; an existing ``<out>`` is an error, never overwritten.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from rollout_lab.cli import positive_int, record_out
from rollout_lab.engine.config import MODES
from rollout_lab.measure.models import add_model_options, load_model, resolve_model_options
from rollout_lab.measure.rl import RL_DEFAULTS, RL_PATHS, check_rl_settings, run_rl
from rollout_lab.measure.sweep import rl_throughput_rows
from rollout_lab.workspace import write_record


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, type=record_out,
                   help="output stem: writes <out>.json and <out>.csv (neither may exist)")
    add_model_options(p, default_preset="qwen3-0.6b")
    d = RL_DEFAULTS  # run_rl's own defaults
    p.add_argument("--num-seqs", type=positive_int, default=d["num_seqs"], help="requests (default %(default)s)")
    p.add_argument("--min-len", type=positive_int, default=d["min_len"],
                   help="smallest prompt length and budget (default %(default)s)")
    p.add_argument("--max-len", type=positive_int, default=d["max_len"],
                   help="largest prompt length and budget (default %(default)s)")
    p.add_argument("--seed", type=int, default=d["seed"], help="workload seed")
    p.add_argument("--mode", default=d["mode"], choices=MODES, help="our route (default %(default)s)")
    p.add_argument("--slots", type=positive_int, default=d["slots"], help="continuous_batch_size (default: every request)")
    p.add_argument("--decode", default=d["decode"], choices=("auto", "graph", "eager"), help="our decode stepper")
    p.add_argument("--decode-widths", type=int, default=d["decode_widths"],
                   help="attention windows of 'ours' (default: the engine's)")
    p.add_argument("--reps", type=positive_int, default=d["reps"], help="our timed calls after the warm-up (default %(default)s)")
    p.add_argument("--peer-calls", type=positive_int, default=d["peer_calls"], help="HF's timed calls, no warm-up (default %(default)s)")
    p.add_argument("--paths", nargs="+", default=list(d["paths"]), choices=RL_PATHS,
                   help="paths to run, in order (default: all but ours_compile_layers, which needs CUDA)")
    args = p.parse_args(argv)
    try:
        check_rl_settings(num_seqs=args.num_seqs, min_len=args.min_len, max_len=args.max_len, mode=args.mode,
                          slots=args.slots, reps=args.reps, peer_calls=args.peer_calls, paths=args.paths)
    except ValueError as err:
        p.error(str(err))
    args.model = resolve_model_options(args)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    paths = args.out

    def save(record: dict[str, Any]) -> str:
        return write_record(paths, record, rl_throughput_rows(record))

    model, model_name = load_model(args.model, dtype=args.dtype, device=args.device)
    record = run_rl(model, model_name=model_name, dtype=args.dtype, save=save,
                    config={"preset": args.preset, "tiny": args.tiny, "device": args.device},
                    script="scripts/bench_rl.py", argv=(sys.argv[1:] if argv is None else argv),
                    **{k: getattr(args, k) for k in RL_DEFAULTS})
    print(save(record), end="")
    print(f"wrote {paths[0]} and {paths[1]}")


if __name__ == "__main__":
    main()
