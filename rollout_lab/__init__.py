"""rollout_lab: fast RL rollout generation for prompts of varying length.

Four layers, imports pointing one way (each folder's ``__init__`` says what it may import):

    planner/  cost model, bucket DP, route choice, fits, sharding   pure Python + numpy, no torch
    engine/   Rollout over a Hugging Face model                      imports planner/
    measure/  models, workloads, calibration, sweeps, peers          imports engine/, planner/
    plots/    one module per figure family, the explorer             imports measure/ and below

The public API: ``Rollout``, ``RolloutConfig``, ``RolloutResult``, ``SamplingParams``, ``Continuation`` (loaded on first use, so that
``import rollout_lab.planner`` never imports torch), ``CostCoefficients``, ``ModelGeometry``,
``plan_buckets`` and ``choose_route``.
"""
from __future__ import annotations

from typing import Any

from rollout_lab.planner.bucket_dp import plan_buckets
from rollout_lab.planner.cost import CostCoefficients, ModelGeometry
from rollout_lab.planner.routes import choose_route

__all__ = ["Rollout", "RolloutConfig", "RolloutResult", "SamplingParams", "Continuation", "CostCoefficients",
           "ModelGeometry", "plan_buckets", "choose_route"]
_ENGINE = {"Rollout": "rollout_lab.engine.api.rollout", "RolloutConfig": "rollout_lab.engine.api.config",
           "RolloutResult": "rollout_lab.engine.api.result", "SamplingParams": "rollout_lab.engine.sample.params",
           "Continuation": "rollout_lab.engine.sched.request"}


def __getattr__(name: str) -> Any:
    if name in _ENGINE:
        import importlib  # torch loads with the engine, on first use only

        return getattr(importlib.import_module(_ENGINE[name]), name)
    raise AttributeError(f"module 'rollout_lab' has no attribute {name!r}")
