"""Refit a saved calibration's packed terms from its own packed measurements, without a device.

    python scripts/refit_packed.py data/calibration/qwen2.5-3b_bfloat16_cuda_compiled-graphs.json \
        --out data/calibration/qwen2.5-3b_bfloat16_cuda_compiled-graphs_refit.json

A calibration written before ``packed_fixed_cost_ms`` existed priced a packed forward with one
per-prompt term; ``measure.calibrate.refit_packed`` fits both packed terms on the same samples. The
new file keeps every measurement and provenance field and adds ``refit`` (the code's git sha and the
previous coefficients). ``--out`` must not exist.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from rollout_lab.measure.calibrate import CalibrationResult, refit_packed


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("calibration", type=Path, help="a cost file written by rollout-lab calibrate")
    p.add_argument("--out", type=Path, required=True, help="the refitted cost file to write (must not exist)")
    args = p.parse_args(argv)
    if args.out.exists():
        p.error(f"--out {args.out} exists: choose a new name (a record is never overwritten)")
    try:
        result = refit_packed(CalibrationResult.load(args.calibration))
    except ValueError as err:
        p.error(str(err))
    result.save(args.out)
    before, after = result.metadata["refit"]["previous"], result.costs
    worst = max(abs(r["rel_error"]) for r in result.packed)
    print(f"packed: fixed {before.get('packed_fixed_cost_ms', 0.0):.3f} -> {after.packed_fixed_cost_ms:.3f} ms, "
          f"per prompt {before['packed_prompt_cost_ms']:.3f} -> {after.packed_prompt_cost_ms:.3f} ms; "
          f"worst packed shape now {worst:.1%} off")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
