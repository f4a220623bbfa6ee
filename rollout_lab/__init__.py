"""rollout_lab: fast RL rollout generation for prompts of varying length.

``Rollout``, ``RolloutConfig`` and ``RolloutResult`` are imported lazily, so that the torch-free
modules (``rollout_lab.planner``, ``rollout_lab.cost``) stay importable without torch.
"""
from __future__ import annotations

from typing import Any

__all__ = ["Rollout", "RolloutConfig", "RolloutResult"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from rollout_lab import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'rollout_lab' has no attribute {name!r}")
