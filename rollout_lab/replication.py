"""Shared prefill: rows (request, sample) grouped by identical prompt, and the route it implies.

A call of n requests with ``num_samples`` = S has n * S rows, request-major (row = request * S +
sample, like HF's ``num_return_sequences``). Rows whose prompts are identical token lists (the S
samples of one request, or repeated requests) form a group: continuous batching prefills one row
per group per admission and copies its KV into the group's other slots. nocb (HF ``generate``)
cannot share and prefills every row. Pure Python, no torch, like the planner.

    groups = prompt_groups(prompts, num_samples=8)        # group id (first row) of every row
    plan = choose_shared_route(lengths_of_groups, replicas, max_new_tokens=128, ...)
"""
from __future__ import annotations

from typing import Any, Sequence

from rollout_lab.cost import CostCoefficients, ModelGeometry, kv_mib
from rollout_lab.planner import RoutePlan, choose_route


def prompt_groups(
    prompts: Sequence[Sequence[int]], *, num_samples: int, share: bool = True
) -> list[int]:
    """Per row (request-major), the first row with the same prompt; every row its own if not ``share``."""
    num_rows = len(prompts) * num_samples
    if not share:
        return list(range(num_rows))
    first: dict[tuple[int, ...], int] = {}
    groups = []
    for request, prompt in enumerate(prompts):
        group = first.setdefault(tuple(prompt), request * num_samples)
        groups.extend([group] * num_samples)
    return groups


def group_sizes(groups: Sequence[int]) -> dict[int, int]:
    """{group id: rows}, in order of first appearance."""
    sizes: dict[int, int] = {}
    for group in groups:
        sizes[group] = sizes.get(group, 0) + 1
    return sizes


def replication_cost_ms(
    lengths: Sequence[int], replicas: Sequence[int], geometry: ModelGeometry, coeffs: CostCoefficients
) -> float:
    """``prefill_replicate_cost_ms`` per MiB of KV copied: (replicas - 1) rows of each length."""
    mib = sum((k - 1) * kv_mib(1, length, geometry) for length, k in zip(lengths, replicas))
    return coeffs.prefill_replicate_cost_ms * mib


def choose_shared_route(
    lengths: Sequence[int],
    replicas: Sequence[int],
    *,
    max_new_tokens: int,
    continuous_batch_size: int | None,
    geometry: ModelGeometry,
    coeffs: CostCoefficients,
    nocb_allowed: bool = True,
    **route_options: Any,
) -> RoutePlan:
    """``choose_route`` for unique prompts of ``lengths`` that fill ``replicas[i]`` rows each.

    CB's estimate: the DP over the unique prompts plus ``replication_cost_ms``; nocb's: every row
    prefilled (n x samples). ``route_options`` go to both ``choose_route`` calls. Without any
    replica (all 1) this is ``choose_route`` itself.
    """
    if len(replicas) != len(lengths) or any(
        isinstance(k, bool) or not isinstance(k, int) or k < 1 for k in replicas
    ):
        raise ValueError(f"replicas must hold one int >= 1 per length ({len(lengths)}), got {list(replicas)!r}")
    common = dict(max_new_tokens=max_new_tokens, continuous_batch_size=continuous_batch_size,
                  geometry=geometry, coeffs=coeffs, **route_options)
    if all(k == 1 for k in replicas):
        return choose_route(lengths, nocb_allowed=nocb_allowed, **common)
    rows = [length for length, k in zip(lengths, replicas) for _ in range(k)]
    nocb = None
    if nocb_allowed:
        nocb = choose_route(rows, nocb_allowed=True, **common).nocb_cost_ms
    shared = choose_route(lengths, nocb_allowed=False, **common)
    cb = shared.cb_cost_ms + replication_cost_ms(lengths, replicas, geometry, coeffs)
    if nocb is not None and nocb <= cb:
        return RoutePlan("nocb", (tuple(range(len(lengths))),), nocb, cb)
    return RoutePlan("bucketed", shared.buckets, nocb, cb)
