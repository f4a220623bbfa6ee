"""The main job behind ``make reproduce``: the planner's worked example (more steps join later)."""
from __future__ import annotations

from rollout_lab.cli import main as cli_main


def main(*, quick: bool = False) -> int:
    print("== The planner's worked example: 1x512 + 31x16 on Qwen2.5-3B fp32 geometry ==")
    cli_main(["plan", "512", *["16"] * 31, "--max-new-tokens", "16"])
    return 0
