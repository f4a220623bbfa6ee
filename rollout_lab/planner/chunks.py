"""Chunked prefill planning: a prompt over ``prefill_max_tokens`` becomes a head the DP buckets and
tail chunks of exactly the limit, each priced with its attention over the chunks before it
(the full rule is in ``planner.routes``' docstring). Pure Python.
"""
from __future__ import annotations

from typing import Sequence

from rollout_lab.planner.bucket_dp import BucketPlan, plan_buckets, validate_lengths
from rollout_lab.planner.cost import CostCoefficients, ModelGeometry, attention_gflops, check_pricing, prefill_cost_ms
from rollout_lab.planner.shape_classes import ShapeClasses, plan_buckets_classed

# -- chunked prefill ---------------------------------------------------------------------------

def split_prompt(length: int, limit: int | None) -> tuple[int, ...]:
    """Chunk widths of a prompt, head first: (length,) within the limit, else the head and tails."""
    if limit is None or length <= limit:
        return (length,)
    num_tails = (length - 1) // limit
    return (length - num_tails * limit,) + (limit,) * num_tails


def chunk_cost_ms(
    width: int, offset: int, geometry: ModelGeometry, costs: CostCoefficients
) -> float:
    """A one-row forward of ``width`` tokens after ``offset`` cached ones: C(1, width) with the
    attention term over ``offset + width`` keys."""
    cost = prefill_cost_ms(1, width, geometry, costs)
    extra = attention_gflops(1, width, geometry) * offset / width  # 4 * w * o * ... / 1e9
    return cost + costs.prefill_attention_cost_ms * extra


def plan_chunked(
    lengths: Sequence[int], geometry: ModelGeometry, costs: CostCoefficients,
    classes: ShapeClasses | None = None,
) -> BucketPlan:
    """``plan_buckets`` with over-limit prompts chunked (module docstring): the DP buckets the
    heads with the short prompts; ``chunks`` lists each long prompt's tail widths. With
    ``classes`` the heads are bucketed at their class shapes (``plan_buckets_classed``)."""
    check_pricing(geometry, costs)
    lengths = validate_lengths(lengths, None)
    limit = costs.prefill_max_tokens
    splits = [split_prompt(n, limit) for n in lengths]
    heads = [s[0] for s in splits]
    plan = plan_buckets(heads, geometry, costs) if classes is None else \
        plan_buckets_classed(heads, geometry, costs, classes)
    chunks = tuple((i, s[1:]) for i, s in enumerate(splits) if len(s) > 1)
    cost = plan.cost_ms
    for i, tail in chunks:
        offset = splits[i][0]
        for width in tail:
            cost += chunk_cost_ms(width, offset, geometry, costs)
            offset += width
    return BucketPlan(plan.buckets, plan.widths, cost, chunks, rows=plan.rows)
