"""The EOS long-tail benchmark's command line (``rollout_lab.measure.long_tail``): sampled RL rows that
end at EOS at very different times, on the aligned cache and on the paged pool.

    # GPU (H200): Qwen2.5-0.5B, 512 GPQA prompts, 2048-token budgets, EOS hazard 1/295, all four paths
    PYTHONPATH=. python3 scripts/bench_long_tail.py --out data/results/long_tail_qwen2.5-0.5b_bfloat16_cuda
    # CPU check in seconds (GSM8K's prompts fit the tiny model's 512 positions)
    PYTHONPATH=. python3 scripts/bench_long_tail.py --tiny qwen2 --dataset gsm8k --num-prompts 16 \\
        --max-new-tokens 128 --hazard 0.05 --slots 4 --out /tmp/long_tail

The workload, the paths and what is timed are ``measure.long_tail``'s. Writes ``<out>.json`` (record
with provenance: tok/s, occupancy, decode steps, preemptions, response lengths, peak memory per path)
and ``<out>.csv`` after every path; an existing ``<out>`` is an error, never overwritten.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from rollout_lab.cli import positive_int, record_out
from rollout_lab.measure.long_tail import (LONG_TAIL_DEFAULTS, LONG_TAIL_PATHS, check_long_tail_settings,
                                          long_tail_rows, run_long_tail)
from rollout_lab.measure.models import add_model_options, load_model, resolve_model_options
from rollout_lab.measure.workloads import DATASETS
from rollout_lab.workspace import write_record


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, type=record_out,
                   help="output stem: writes <out>.json and <out>.csv (neither may exist)")
    add_model_options(p, default_preset="qwen2.5-0.5b")
    d = LONG_TAIL_DEFAULTS  # run_long_tail's own defaults
    p.add_argument("--num-prompts", type=positive_int, default=d["num_prompts"],
                   help="prompts, drawn with replacement (default %(default)s)")
    p.add_argument("--dataset", default=d["dataset"], choices=DATASETS,
                   help="whose prompt lengths (default %(default)s)")
    p.add_argument("--hazard", type=float, default=d["hazard"],
                   help="per-step EOS probability, in (0, 0.5] (default 1/295)")
    p.add_argument("--max-new-tokens", type=positive_int, default=d["max_new_tokens"],
                   help="every row's budget (default %(default)s)")
    p.add_argument("--slots", type=positive_int, default=d["slots"],
                   help="slots of aligned_128 and paged_128 (default %(default)s)")
    p.add_argument("--seed", type=int, default=d["seed"], help="workload and sampling seed")
    p.add_argument("--reps", type=positive_int, default=d["reps"],
                   help="timed calls per path after the warm-up (default %(default)s)")
    p.add_argument("--paths", nargs="+", default=list(d["paths"]), choices=LONG_TAIL_PATHS,
                   help="paths to run, in order (default: %(default)s)")
    args = p.parse_args(argv)
    try:
        check_long_tail_settings(**{k: getattr(args, k) for k in LONG_TAIL_DEFAULTS})
    except ValueError as err:
        p.error(str(err))
    args.model = resolve_model_options(args)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    paths = args.out

    def save(record: dict[str, Any]) -> str:
        return write_record(paths, record, long_tail_rows(record))

    model, model_name = load_model(args.model, dtype=args.dtype, device=args.device)
    record = run_long_tail(model, model_name=model_name, dtype=args.dtype, save=save,
                           config={"preset": args.preset, "tiny": args.tiny, "device": args.device},
                           script="scripts/bench_long_tail.py", argv=(sys.argv[1:] if argv is None else argv),
                           **{k: getattr(args, k) for k in LONG_TAIL_DEFAULTS})
    print(save(record), end="")
    print(f"wrote {paths[0]} and {paths[1]}")


if __name__ == "__main__":
    main()
