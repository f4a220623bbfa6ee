"""Bucket planner: the nocb/bucketed route choice over the exactly optimal bucket DP.

Pure Python (no torch), deterministic, no I/O. Run ``rollout-lab plan 512 16 16 ...`` to try it.

The DP itself (``plan_buckets``, exactly optimal, and its oracle ``plan_buckets_quadratic``)
lives in ``rollout_lab.bucket_dp``; this module re-exports it and adds chunked prefill and the
route choice.

Chunked prefill (``plan_chunked``). A prompt of L > limit tokens (limit = ``prefill_max_tokens``)
is cut into m = ceil(L / limit) chunks: a *head* of h = L - (m - 1) * limit tokens (1 <= h <= limit)
and m - 1 *tail* chunks of exactly ``limit`` tokens, run in order into one cache so that chunk k
attends to chunks < k. The head has no past, so it enters the DP as a prompt of length h and may
share a bucket with short prompts (its logits are dropped). Each tail chunk is its own one-row
forward at exactly the limit (a second row would exceed it); the last one carries the logits of the
first token. Tails are the fewest forwards a long prompt can take and hold no padding, so given
them the DP over heads and short prompts is exactly optimal. A tail chunk of width c after o tokens
is priced by ``chunk_cost_ms``: C(1, c) with the attention term over o + c keys.

EOS-aware decode: ``rollout_lab.decode_steps`` (``expected_decode_steps``, re-exported here)
prices the expected decode steps under a response-length prior instead of ``max_new_tokens - 1``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from rollout_lab.bucket_dp import BucketPlan, plan_buckets, plan_buckets_quadratic, validate_lengths
from rollout_lab.cost import (
    CostCoefficients, ModelGeometry, attention_gflops, per_row_cost_ms, prefill_cost_ms,
)
from rollout_lab.decode_steps import LengthPrior, expected_decode_steps, length_cdf

__all__ = [
    "BucketPlan", "LengthPrior", "ROUTES", "RoutePlan", "cb_decode_cost_ms", "choose_route",
    "chunk_cost_ms", "expected_decode_steps", "length_cdf", "nocb_cost_ms", "plan_buckets",
    "plan_buckets_quadratic", "plan_chunked", "split_prompt", "validate_lengths",
]

ROUTES = ("nocb", "bucketed")


@dataclass(frozen=True)
class RoutePlan:
    """The route Auto takes for one admission, with both estimates."""

    route: str
    buckets: tuple[tuple[int, ...], ...]
    nocb_cost_ms: float | None  # None when nocb is not eligible
    cb_cost_ms: float
    cb_cost_is_lower_bound: bool = False  # True when the DP was skipped because nocb wins anyway

    @property
    def widths(self) -> tuple[int, ...]:
        return tuple(len(b) for b in self.buckets)


def nocb_cost_ms(
    lengths: Sequence[int], geometry: ModelGeometry, coeffs: CostCoefficients, *, max_new_tokens: int = 1,
    decode_steps: float | None = None,
) -> float:
    """nocb's estimate: one left-padded forward of every prompt at the longest width (no KV term),
    plus ``nocb_decode_cost_ms`` per remaining decode step (0 with the reference coefficients).
    ``decode_steps`` (e.g. from ``expected_decode_steps``) replaces ``max_new_tokens - 1``."""
    if not lengths:
        return 0.0
    prefill = prefill_cost_ms(len(lengths), max(lengths), geometry, coeffs, include_kv=False)
    steps = max(0, max_new_tokens - 1) if decode_steps is None else decode_steps
    return prefill + coeffs.nocb_decode_cost_ms * steps


def cb_decode_cost_ms(
    max_new_tokens: int, coeffs: CostCoefficients, *, decode_steps: float | None = None
) -> float:
    """CB's decode overhead over nocb: one ``continuous_decode_cost_ms`` per remaining step
    (``decode_steps`` of them when given, else ``max_new_tokens - 1``)."""
    steps = max(0, max_new_tokens - 1) if decode_steps is None else decode_steps
    return coeffs.continuous_decode_cost_ms * steps


# -- chunked prefill ---------------------------------------------------------------------------

def split_prompt(length: int, limit: int | None) -> tuple[int, ...]:
    """Chunk widths of a prompt, head first: (length,) within the limit, else the head and tails."""
    if limit is None or length <= limit:
        return (length,)
    num_tails = (length - 1) // limit
    return (length - num_tails * limit,) + (limit,) * num_tails


def chunk_cost_ms(
    width: int, offset: int, geometry: ModelGeometry, coeffs: CostCoefficients
) -> float:
    """A one-row forward of ``width`` tokens after ``offset`` cached ones: C(1, width) with the
    attention term over ``offset + width`` keys."""
    cost = prefill_cost_ms(1, width, geometry, coeffs)
    extra = attention_gflops(1, width, geometry) * offset / width  # 4 * w * o * ... / 1e9
    return cost + coeffs.prefill_attention_cost_ms * extra


def plan_chunked(
    lengths: Sequence[int], geometry: ModelGeometry, coeffs: CostCoefficients
) -> BucketPlan:
    """``plan_buckets`` with over-limit prompts chunked (module docstring): the DP buckets the
    heads with the short prompts; ``chunks`` lists each long prompt's tail widths."""
    lengths = validate_lengths(lengths, None)
    limit = coeffs.prefill_max_tokens
    splits = [split_prompt(n, limit) for n in lengths]
    plan = plan_buckets([s[0] for s in splits], geometry, coeffs)
    chunks = tuple((i, s[1:]) for i, s in enumerate(splits) if len(s) > 1)
    cost = plan.cost_ms
    for i, tail in chunks:
        offset = splits[i][0]
        for width in tail:
            cost += chunk_cost_ms(width, offset, geometry, coeffs)
            offset += width
    return BucketPlan(plan.buckets, plan.widths, cost, chunks)


def choose_route(
    lengths: Sequence[int],
    *,
    max_new_tokens: int,
    continuous_batch_size: int | None,
    geometry: ModelGeometry,
    coeffs: CostCoefficients,
    nocb_allowed: bool = True,
    response_lengths: LengthPrior | None = None,
    chunk_long_prompts: bool = False,
) -> RoutePlan:
    """Compare nocb with bucketed CB by the cost model and take the cheaper (nocb on a tie).

    nocb is eligible when ``nocb_allowed`` (no explicit capacity or trimming), every request
    fits the slots at once and the padded batch fits ``prefill_max_tokens``.
    ``response_lengths`` (a prior, see ``expected_decode_steps``) prices the expected decode steps
    instead of ``max_new_tokens - 1``. ``chunk_long_prompts`` plans over-limit prompts with
    ``plan_chunked`` instead of raising (nocb is then not eligible).
    """
    lengths = validate_lengths(lengths, None if chunk_long_prompts else coeffs)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if continuous_batch_size is not None and (
        isinstance(continuous_batch_size, bool)
        or not isinstance(continuous_batch_size, int)
        or continuous_batch_size < 1
    ):
        raise ValueError(
            f"continuous_batch_size must be a positive int or None, got {continuous_batch_size!r}"
        )
    n = len(lengths)
    if n == 0:
        return RoutePlan("bucketed", (), None, 0.0)
    limit = coeffs.prefill_max_tokens
    eligible = (
        nocb_allowed
        and (continuous_batch_size is None or n <= continuous_batch_size)
        and (limit is None or n * max(lengths) <= limit)
    )
    steps = None
    if response_lengths is not None:
        steps = expected_decode_steps(response_lengths, n, max_new_tokens, num_slots=continuous_batch_size)
    decode = cb_decode_cost_ms(max_new_tokens, coeffs, decode_steps=steps)
    nocb = None
    if eligible:
        nocb = nocb_cost_ms(lengths, geometry, coeffs, max_new_tokens=max_new_tokens, decode_steps=steps)
    if nocb is not None:
        # cheapest conceivable CB: one fixed cost, every prompt at its own width
        bound = coeffs.prefill_fixed_cost_ms + decode
        bound += sum(per_row_cost_ms(length, geometry, coeffs) for length in lengths)
        if nocb <= bound:
            return RoutePlan("nocb", (tuple(range(n)),), nocb, bound, cb_cost_is_lower_bound=True)
    plan = plan_chunked(lengths, geometry, coeffs) if chunk_long_prompts else plan_buckets(lengths, geometry, coeffs)
    cb = plan.cost_ms + decode
    if nocb is not None and nocb <= cb:
        return RoutePlan("nocb", (tuple(range(n)),), nocb, cb)
    return RoutePlan("bucketed", plan.buckets, nocb, cb)
