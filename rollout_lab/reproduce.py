"""The main job behind ``make reproduce``: the planner's worked example, then every notebook.

    python -m rollout_lab.cli reproduce           # tiny CPU default: figures/, data/tables/, data/...
    python -m rollout_lab.cli reproduce --quick   # the tests' smoke parameters (seconds per notebook)

The notebooks run with papermill on their embedded defaults (the tiny CPU model); executed copies
go to ``build/notebooks/``. GPU runs: ``rollout-lab notebooks --device cuda --preset qwen2.5-3b``.
"""
from __future__ import annotations

import time

from rollout_lab.cli import main as cli_main


def main(*, quick: bool = False) -> int:
    from rollout_lab.notebooks import SMOKE_PARAMETERS, run_notebooks

    start = time.perf_counter()
    print("== The planner's worked example: 1x512 + 31x16 on Qwen2.5-3B fp32 geometry ==")
    cli_main(["plan", "512", *["16"] * 31, "--max-new-tokens", "16"])
    print("== The notebooks, with papermill (tiny CPU default) ==", flush=True)
    executed = run_notebooks(extra=SMOKE_PARAMETERS if quick else None)
    print(f"== done in {time.perf_counter() - start:.0f} s: {len(executed)} notebooks in "
          f"{executed[0].parent}; figures in figures/, tables in data/tables/ ==")
    return 0
