"""Device-synchronised wall-clock timing of one call: the one helper calibration, sweeps, the
data-parallel rollout and the benchmark scripts share.

    ms, out = timed_ms(lambda: rollout.generate(prompts, max_new_tokens=16), device)

torch is imported only when a call runs, so the CLI modules that use this stay torch-free at import.
"""
from __future__ import annotations

import time
from typing import Any, Callable


def synchronize(device: Any) -> None:
    """Wait for the device's queued work (a no-op off CUDA); ``device`` may be a string."""
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def timed_ms(fn: Callable[[], Any], device: Any) -> tuple[float, Any]:
    """Wall-clock milliseconds of ``fn()`` with the device synchronised before and after."""
    synchronize(device)
    start = time.perf_counter()
    out = fn()
    synchronize(device)
    return (time.perf_counter() - start) * 1e3, out
