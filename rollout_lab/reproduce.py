"""The main job behind ``make reproduce``: the planner's worked example, a CPU rollout through every
route with its profile table, then every notebook.

    python -m rollout_lab.cli reproduce           # tiny CPU default: figures/, data/tables/, data/...
    python -m rollout_lab.cli reproduce --quick   # the tests' smoke parameters (seconds per notebook)

The notebooks run with papermill on their embedded defaults (the tiny CPU model); executed copies
go to ``build/notebooks/``. GPU runs: ``rollout-lab notebooks --device cuda --preset qwen2.5-3b``.
"""
from __future__ import annotations

import time

from rollout_lab.cli import main as cli_main

PROFILE_COLUMNS = ("planning_ms", "prefill_ms", "decode_ms", "cache_ms", "total_ms",
                   "num_prefill_forwards", "num_decode_forwards", "num_generated_tokens")


def route_table(*, max_new_tokens: int = 8) -> list[dict]:
    """Run the long-tail shape (1x48 + 15x4) through every route on the tiny qwen2 model."""
    from rollout_lab import Rollout, RolloutConfig
    from rollout_lab.cost import CostCoefficients
    from rollout_lab.models import TINY_VOCAB_SIZE, tiny_model
    from rollout_lab.workloads import lengths_to_prompts

    model = tiny_model("qwen2")
    prompts = lengths_to_prompts([48] + [4] * 15, vocab_size=TINY_VOCAB_SIZE, seed=0, special_ids=[0])
    costs = CostCoefficients(prefill_fixed_cost_ms=0.5, continuous_decode_cost_ms=0.0)  # tiny-model scale
    rows, reference = [], None
    for mode in ("nocb", "equal_width", "aligned", "bucketed", "auto"):
        config = RolloutConfig(mode=mode, costs=costs, profile=True, pad_token_id=0)
        result = Rollout(model, config).generate(prompts, max_new_tokens=max_new_tokens)
        reference = result.sequences if reference is None else reference
        row = {"mode": mode, "route": result.route, "same_tokens": result.sequences == reference}
        row.update({k: getattr(result.profile, k) for k in PROFILE_COLUMNS})
        rows.append(row)
    return rows


def print_route_table(rows: list[dict]) -> None:
    header = ["mode", "route", "same_tokens", *PROFILE_COLUMNS]
    print("  ".join(f"{h:>12}" for h in header))
    for row in rows:
        cells = [f"{row[h]:12.2f}" if isinstance(row[h], float) else f"{str(row[h]):>12}" for h in header]
        print("  ".join(cells))


def main(*, quick: bool = False) -> int:
    from rollout_lab.notebooks import SMOKE_PARAMETERS, run_notebooks

    start = time.perf_counter()
    print("== The planner's worked example: 1x512 + 31x16 on Qwen2.5-3B fp32 geometry ==")
    cli_main(["plan", "512", *["16"] * 31, "--max-new-tokens", "16"])
    print("\n== A CPU rollout (tiny qwen2, 1x48 + 15x4 prompts, 8 new tokens) through every route ==")
    rows = route_table()
    print_route_table(rows)
    if not all(row["same_tokens"] for row in rows):
        raise SystemExit("error: the routes disagree on the generated tokens")
    print("\n== The notebooks, with papermill (tiny CPU default) ==", flush=True)
    # 03 prices Auto with the calibration 01 has just written, not the reference defaults
    from rollout_lab.paths import CALIBRATION

    extra = dict(SMOKE_PARAMETERS) if quick else {}
    extra["03_latency_tables"] = {**extra.get("03_latency_tables", {}),
                                  "cost_file": str(CALIBRATION / "tiny-qwen2_float32_cpu.json")}
    executed = run_notebooks(extra=extra)
    print(f"== done in {time.perf_counter() - start:.0f} s: {len(executed)} notebooks in "
          f"{executed[0].parent}; figures in figures/, tables in data/tables/ ==")
    return 0
