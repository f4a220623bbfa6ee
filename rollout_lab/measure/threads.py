"""How many torch CPU threads a measurement runs on: one by default, the previous count restored after.

On a shared CPU more threads only contend, and the timings become noise: a tiny forward on two busy
threads takes many times its one-thread time, and calibrations of one model then disagree on the
decode terms by more than the terms themselves. GPU measurements are left as they are.

    with measurement_threads(1, device="cpu"):
        calibrate(model)          # calibrate and calibrate_or_load take threads= and do this themselves
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch

from rollout_lab.planner.checks import check_int

MEASUREMENT_THREADS = 1  # the default of every entry point that times on the CPU


@contextmanager
def measurement_threads(threads: int | None, device: Any) -> Iterator[None]:
    """Run the block on ``threads`` torch intra-op threads when ``device`` is a CPU (None: as the
    process has them), then restore the process's count. ValueError unless ``threads`` is an int >= 1
    or None."""
    count = None if threads is None else check_int(threads, name="threads", or_none=True)
    if count is None or torch.device(device).type != "cpu":
        yield
        return
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
