"""Whether rollout_lab's Triton kernels run here: the one place that imports Triton and decides.

Every kernel (span and paged decode attention, the paged KV write, the trainer's token log-probs)
asks ``kernel_available(device)`` before it launches, and falls back to its torch reference where it
says no (CPU-only installs, or a CPU tensor outside ``TRITON_INTERPRET=1``).

"""
from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch references and the masked SDPA remain
    triton = tl = None


def kernel_available(device: torch.device | str) -> bool:
    """Whether the Triton kernels run for tensors on ``device``: on CUDA with Triton, and on CPU
    tensors under ``TRITON_INTERPRET=1`` (how the CPU tests check them)."""
    if triton is None:
        return False
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available()
    return device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"
