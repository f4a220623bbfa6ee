"""The packed route's plan: prompts concatenated into as few forwards as ``prefill_max_tokens`` allows.

A packed forward runs its prompts as one row of sum(L) tokens with per-prompt positions, each prompt
attending only to itself, so it pays no padding and its cost is one fixed cost plus every prompt's
own terms (``cost.packed_prefill_cost_ms``). Only the number of forwards depends on the grouping,
so the plan packs first-fit decreasing: with a limit of T tokens it never needs more than
11/9 * OPT + 1 forwards, and it reaches the bound ceil(sum(L) / T) whenever the prompts are short
next to T (``min_forwards`` states that bound). Prompts over the limit are chunked as for the
bucketed route (``planner.chunks``): the head is packed, the tails run after it. Pure Python.

    plan = plan_packed([512, 16, 16, 700], geometry, costs)   # BucketPlan with packed=True
"""
from __future__ import annotations

import math
from typing import Sequence

from rollout_lab.planner.bucket_dp import BucketPlan, validate_lengths
from rollout_lab.planner.chunks import chunk_cost_ms, split_prompt
from rollout_lab.planner.cost import CostCoefficients, ModelGeometry, check_pricing, packed_prefill_cost_ms


def pack_first_fit(lengths: Sequence[int], limit: int | None) -> list[list[int]]:
    """Indices of ``lengths`` grouped into packs of at most ``limit`` tokens (None: one pack),
    first-fit decreasing; within a pack, in input order."""
    if limit is None:
        return [list(range(len(lengths)))] if lengths else []
    packs: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        slot = next((k for k, free in enumerate(room) if free >= lengths[i]), None)
        if slot is None:
            packs.append([i])
            room.append(limit - lengths[i])
        else:
            packs[slot].append(i)
            room[slot] -= lengths[i]
    return [sorted(p) for p in packs]


def min_forwards(lengths: Sequence[int], limit: int | None) -> int:
    """The fewest packed forwards any grouping needs: ceil(sum / limit) (1 without a limit)."""
    if not lengths:
        return 0
    return 1 if limit is None else math.ceil(sum(lengths) / limit)


def plan_packed(lengths: Sequence[int], geometry: ModelGeometry, costs: CostCoefficients) -> BucketPlan:
    """Packs of prompt indices (``buckets``), the tokens of each (``widths``), the estimated cost,
    and the tail chunks of prompts over the limit."""
    check_pricing(geometry, costs)
    lengths = validate_lengths(lengths, None)
    limit = costs.prefill_max_tokens
    splits = [split_prompt(n, limit) for n in lengths]
    heads = [s[0] for s in splits]
    packs = pack_first_fit(heads, limit)
    buckets = tuple(tuple(p) for p in packs)
    widths = tuple(sum(heads[i] for i in p) for p in packs)
    cost = sum(packed_prefill_cost_ms([heads[i] for i in p], geometry, costs) for p in packs)
    chunks = tuple((i, s[1:]) for i, s in enumerate(splits) if len(s) > 1)
    for i, tail in chunks:
        offset = splits[i][0]
        for width in tail:
            cost += chunk_cost_ms(width, offset, geometry, costs)
            offset += width
    return BucketPlan(buckets, widths, cost, chunks, packed=True)
