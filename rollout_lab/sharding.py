"""Split a global batch of prompts across data-parallel ranks so the predicted makespan is minimal.

An RL step's rollout takes as long as its slowest rank. A rank's predicted cost is its own Auto
plan: ``min(nocb, bucketed CB)`` as ``planner.choose_route`` computes it for the rank's prompts.
Pure Python (no torch), deterministic, no I/O::

    from rollout_lab.sharding import shard_requests, predicted_makespan
    shards = shard_requests(lengths, 8, geometry, coeffs, max_new_tokens=16)

This module is the API (``shard_requests``, ``predicted_rank_costs``, ``predicted_makespan``,
``check_partition``); the methods live in their own modules and are re-exported here:

- ``balanced`` (``sharding_balanced``): the best contiguous split of the sorted order, polished by
  local search on exact per-rank costs; never worse than either baseline.
- ``round_robin``, ``karmarkar_karp`` (``sharding_baselines``): prompt i to rank i % world_size;
  verl's equal-size largest differencing on ``L^2 + 24576 L``.
- ``RankCost`` (``sharding_cost``): a rank's memoised predicted cost, with cheap bounds.

A rank is empty (``[]``, cost 0) when world_size exceeds the number of prompts.
"""
from __future__ import annotations

from typing import Sequence

from rollout_lab.cost import CostCoefficients, ModelGeometry
from rollout_lab.planner import validate_lengths
from rollout_lab.sharding_balanced import balanced_shards, contiguous_shards
from rollout_lab.sharding_baselines import (
    VERL_LINEAR_WORKLOAD, karmarkar_karp_shards, round_robin_shards, verl_workload,
)
from rollout_lab.sharding_cost import RankCost

__all__ = [
    "METHODS", "RankCost", "VERL_LINEAR_WORKLOAD", "balanced_shards", "check_partition",
    "contiguous_shards", "karmarkar_karp_shards", "predicted_makespan", "predicted_rank_costs",
    "round_robin_shards", "shard_requests", "verl_workload",
]

METHODS = ("balanced", "round_robin", "karmarkar_karp")


def shard_requests(
    lengths: Sequence[int],
    world_size: int,
    geometry: ModelGeometry,
    coeffs: CostCoefficients,
    *,
    max_new_tokens: int = 16,
    continuous_batch_size: int | None = None,
    nocb_allowed: bool = True,
    method: str = "balanced",
) -> list[list[int]]:
    """``world_size`` lists of indices into ``lengths`` (each sorted); every index on one rank.

    ``continuous_batch_size`` and ``nocb_allowed`` are what each rank's Auto will see (nocb is
    not allowed with an explicit cache capacity or trimming), so the predicted costs match its plan.
    """
    lengths = _validate(lengths, world_size, coeffs, method, max_new_tokens)
    if method == "round_robin":
        return round_robin_shards(len(lengths), world_size)
    if method == "karmarkar_karp":
        return karmarkar_karp_shards(lengths, world_size)
    cost = RankCost(geometry, coeffs, max_new_tokens=max_new_tokens,
                    continuous_batch_size=continuous_batch_size, nocb_allowed=nocb_allowed)
    return balanced_shards(lengths, world_size, cost)


def predicted_rank_costs(
    shards: Sequence[Sequence[int]],
    lengths: Sequence[int],
    geometry: ModelGeometry,
    coeffs: CostCoefficients,
    *,
    max_new_tokens: int = 16,
    continuous_batch_size: int | None = None,
    nocb_allowed: bool = True,
) -> list[float]:
    """Each rank's predicted Auto cost in ms (0 for an empty rank)."""
    lengths = validate_lengths(lengths, coeffs)
    check_partition(shards, len(lengths))
    cost = RankCost(geometry, coeffs, max_new_tokens=max_new_tokens,
                    continuous_batch_size=continuous_batch_size, nocb_allowed=nocb_allowed)
    return [cost(tuple(sorted(lengths[i] for i in shard))) for shard in shards]


def predicted_makespan(
    shards: Sequence[Sequence[int]],
    lengths: Sequence[int],
    geometry: ModelGeometry,
    coeffs: CostCoefficients,
    *,
    max_new_tokens: int = 16,
    continuous_batch_size: int | None = None,
    nocb_allowed: bool = True,
) -> float:
    """The slowest rank's predicted cost in ms (0 for no requests)."""
    return max(predicted_rank_costs(
        shards, lengths, geometry, coeffs, max_new_tokens=max_new_tokens,
        continuous_batch_size=continuous_batch_size, nocb_allowed=nocb_allowed,
    ), default=0.0)


def check_partition(shards: Sequence[Sequence[int]], num_requests: int) -> None:
    """Raise ValueError unless every index in [0, num_requests) sits on exactly one rank."""
    seen = [0] * num_requests
    for rank, shard in enumerate(shards):
        for index in shard:
            if not isinstance(index, int) or not 0 <= index < num_requests:
                raise ValueError(f"rank {rank} holds index {index!r}, outside [0, {num_requests})")
            seen[index] += 1
    bad = [i for i, count in enumerate(seen) if count != 1]
    if bad:
        raise ValueError(
            f"requests {bad[:10]} are on {[seen[i] for i in bad[:10]]} ranks; each must be on one"
        )


def _validate(lengths, world_size, coeffs, method, max_new_tokens) -> list[int]:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if method not in METHODS:
        raise ValueError(f"unknown sharding method {method!r}; valid methods: {', '.join(METHODS)}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    return validate_lengths(lengths, coeffs)
