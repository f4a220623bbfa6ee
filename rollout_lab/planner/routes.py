"""Route planner: nocb, bucketed (the exactly optimal bucket DP), packed (``planner.packing``) or
paged (the bucketed prefill into the paged cache, when refill makes the aligned cache wait:
``planner.occupancy``).

Pure Python (no torch), deterministic, no I/O. Run ``rollout-lab plan 512 16 16 ...`` to try it.

The DP itself (``plan_buckets``, exactly optimal, and its oracle ``plan_buckets_quadratic``)
lives in ``planner.bucket_dp``, chunked prefill in ``planner.chunks``; this module chooses the route.

Chunked prefill (``plan_chunked``). A prompt of L > limit tokens (limit = ``prefill_max_tokens``)
is cut into m = ceil(L / limit) chunks: a *head* of h = L - (m - 1) * limit tokens (1 <= h <= limit)
and m - 1 *tail* chunks of exactly ``limit`` tokens, run in order into one cache so that chunk k
attends to chunks < k. The head has no past, so it enters the DP as a prompt of length h and may
share a bucket with short prompts (its logits are dropped). Each tail chunk is its own one-row
forward at exactly the limit (a second row would exceed it); the last one carries the logits of the
first token. Tails are the fewest forwards a long prompt can take and hold no padding, so given
them the DP over heads and short prompts is exactly optimal. A tail chunk of width c after o tokens
is priced by ``chunk_cost_ms``: C(1, c) with the attention term over o + c keys.

EOS-aware decode: ``planner.decode_steps`` (``expected_decode_steps``)
prices the expected decode steps under a response-length prior instead of ``max_new_tokens - 1``.

Shared prefill: rows (request, sample) grouped by identical prompt, and the route it implies.

A call of n requests with ``num_samples`` = S has n * S rows, request-major (row = request * S +
sample, like HF's ``num_return_sequences``). Rows whose prompts are identical token lists (the S
samples of one request, or repeated requests) form a group: continuous batching prefills one row
per group per admission and copies its KV into the group's other slots. nocb (HF ``generate``)
cannot share and prefills every row. Pure Python, no torch, like the planner.

    groups = prompt_groups(prompts, num_samples=8)        # group id (first row) of every row
    plan = choose_shared_route(lengths_of_groups, replicas, max_new_tokens=128, ...)

"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from rollout_lab.planner.bucket_dp import BucketPlan, plan_buckets, validate_lengths
from rollout_lab.planner.checks import as_int, budgets_of
from rollout_lab.planner.chunks import plan_chunked
from rollout_lab.planner.cost import (CostCoefficients, ModelGeometry, check_pricing, kv_mib, per_row_cost_ms,
                                      prefill_cost_ms)
from rollout_lab.planner.decode_steps import LengthPrior, budget_decode_steps, expected_decode_steps
from rollout_lab.planner.occupancy import pool_misfit, response_quantiles, simulate_refill
from rollout_lab.planner.packing import plan_packed
from rollout_lab.planner.shape_classes import ShapeClasses, plan_buckets_classed

ROUTES = ("nocb", "bucketed", "packed", "paged")


@dataclass(frozen=True)
class RoutePlan:
    """The route Auto takes for one admission, with both estimates."""

    route: str
    buckets: tuple[tuple[int, ...], ...]
    nocb_cost_ms: float | None  # None when nocb is not eligible
    cb_cost_ms: float
    cb_cost_is_lower_bound: bool = False  # True when the DP was skipped because nocb wins anyway
    packed_cost_ms: float | None = None  # None when packed is not a candidate (not calibrated)
    paged_cost_ms: float | None = None  # None when paged is not a candidate (no refill, or not allowed)
    # the bucketed or paged route's prefill plan over these lengths, as ``plan_admission`` makes it
    # for them (``plan_chunked``): an admission of exactly these prompts runs it, not a second DP
    plan: BucketPlan | None = None

    @property
    def widths(self) -> tuple[int, ...]:
        return tuple(len(b) for b in self.buckets)


def nocb_cost_ms(
    lengths: Sequence[int], geometry: ModelGeometry, costs: CostCoefficients, *, max_new_tokens: int = 1,
    decode_steps: float | None = None,
) -> float:
    """nocb's estimate: one left-padded forward of every prompt at the longest width (no KV term),
    plus ``nocb_decode_cost_ms`` per remaining decode step (0 with the reference coefficients).
    ``decode_steps`` (e.g. from ``expected_decode_steps``) replaces ``max_new_tokens - 1``."""
    if not lengths:
        return 0.0
    prefill = prefill_cost_ms(len(lengths), max(lengths), geometry, costs, include_kv=False)
    steps = max(0, max_new_tokens - 1) if decode_steps is None else decode_steps
    return prefill + costs.nocb_decode_cost_ms * steps


def cb_decode_cost_ms(
    max_new_tokens: int, costs: CostCoefficients, *, decode_steps: float | None = None
) -> float:
    """CB's decode overhead over nocb: one ``continuous_decode_cost_ms`` per remaining step
    (``decode_steps`` of them when given, else ``max_new_tokens - 1``)."""
    steps = max(0, max_new_tokens - 1) if decode_steps is None else decode_steps
    return costs.continuous_decode_cost_ms * steps


def choose_route(
    lengths: Sequence[int],
    *,
    max_new_tokens: int | Sequence[int],
    continuous_batch_size: int | None,
    geometry: ModelGeometry,
    costs: CostCoefficients,
    nocb_allowed: bool = True,
    response_lengths: LengthPrior | None = None,
    chunk_long_prompts: bool = False,
    classes: ShapeClasses | None = None,
    paged_allowed: bool = False,
    paged_pool_blocks: int | None = None,
    kv_block_size: int = 16,
    rows_per_prompt: Sequence[int] | None = None,
    refill_rows: int = 1,
    read_interval: int = 1,
    share_prompt_blocks: bool = False,
) -> RoutePlan:
    """Compare nocb, bucketed CB and packed CB by the cost model and take the cheapest (on a tie
    nocb, then bucketed). Packed is a candidate when ``costs.packed_prompt_cost_ms`` is set
    (a calibration measured it); its plan is ``planner.packing.plan_packed``; its decode is CB's.
    Paged is a candidate when ``paged_allowed`` and rows refill (more requests than slots): its
    prefill is the bucketed plan's, and both caches' decode steps come from a replay of their
    admission rules (``planner.occupancy.simulate_refill``, on the prior's response lengths, else
    the budgets), priced at ``continuous_decode_cost_ms`` a step (paged's plus its
    ``paged_decode_cost_ms``); it wins only when strictly cheaper.
    ``paged_pool_blocks`` (usable blocks of ``kv_block_size`` tokens; None: the pool holds every
    live row) replays the pool too: each preemption's recompute is priced as a one-row prefill of its
    prompt and tokens, and a pool that cannot hold one row leaves paged out. ``refill_rows`` (the
    fewest rows a paged admission takes) and ``read_interval`` (the most steps between two reads of
    the tokens) replay the engine's turns (``simulate_refill``).

    nocb is eligible when ``nocb_allowed`` (no explicit capacity or trimming), every request
    fits the slots at once and the padded batch fits ``prefill_max_tokens``.
    ``response_lengths`` (a prior, see ``expected_decode_steps``) prices the expected decode steps
    instead of ``max_new_tokens - 1``. ``chunk_long_prompts`` plans over-limit prompts with
    ``plan_chunked`` instead of raising (nocb is then not eligible). With ``classes`` the bucketed
    plan runs, and is priced, at class shapes (``planner.shape_classes``).

    ``max_new_tokens`` is one budget for all, or one per request. Without a prior, CB's decode
    steps are ``budget_decode_steps`` (max budget - 1 with every request admitted; with refill, the
    rows' steps shared over the slots), and nocb (HF ``generate`` to the largest budget, each row
    cut at its own) pays the steps to the largest, wasted ones included. With a prior, both take
    its expected steps, the prior clipped at the largest budget.

    ``rows_per_prompt`` (``choose_shared_route``): prompt i fills that many rows of the decode, so
    the decode steps, refill and the paged replay count rows while the prefill plans count prompts;
    with ``share_prompt_blocks`` the paged replay holds each prompt's full blocks once for its rows, as
    the engine does (``RolloutConfig.share_prompt_blocks``).
    """
    check_pricing(geometry, costs)
    lengths = validate_lengths(lengths, None if chunk_long_prompts else costs)
    budgets = budgets_of(max_new_tokens, len(lengths))
    if classes is not None and not isinstance(classes, ShapeClasses):
        raise ValueError(f"classes must be a ShapeClasses or None, got {classes!r}")
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
    if rows_per_prompt is not None and len(rows_per_prompt) != n:
        raise ValueError(f"rows_per_prompt must hold one count per prompt ({n}), got {len(rows_per_prompt)}")
    if rows_per_prompt is not None and any(as_int(k) is None or k < 1 for k in rows_per_prompt):
        raise ValueError(f"rows_per_prompt must hold ints >= 1, got {list(rows_per_prompt)!r}")
    if rows_per_prompt is None:
        row_lengths, row_budgets = lengths, budgets
    else:  # the decode's rows: prompt i's length and budget, rows_per_prompt[i] times
        row_lengths = [x for x, k in zip(lengths, rows_per_prompt) for _ in range(k)]
        row_budgets = [b for b, k in zip(budgets, rows_per_prompt) for _ in range(k)]
    num_rows = len(row_lengths)
    limit = costs.prefill_max_tokens
    eligible = (
        nocb_allowed
        and (continuous_batch_size is None or n <= continuous_batch_size)
        and (limit is None or n * max(lengths) <= limit)
    )
    longest_budget = max(budgets)
    steps = nocb_steps = None
    if response_lengths is not None:
        steps = expected_decode_steps(response_lengths, num_rows, longest_budget, num_slots=continuous_batch_size)
        nocb_steps = steps
    else:
        steps = budget_decode_steps(row_budgets, num_slots=continuous_batch_size)
    paged_decode = None
    if paged_allowed and continuous_batch_size is not None and continuous_batch_size < num_rows:
        # refill: both caches' decode steps from a replay of their admission rules (planner.occupancy)
        responses = row_budgets if response_lengths is None else response_quantiles(response_lengths, row_budgets)
        steps = simulate_refill(row_lengths, responses, row_budgets, num_slots=continuous_batch_size,
                                layout="aligned", read_interval=read_interval).steps
        if paged_pool_blocks is None or pool_misfit(row_lengths, row_budgets, pool_blocks=paged_pool_blocks,
                                                     block_size=kv_block_size) is None:  # else the engine refuses it
            groups = None  # the samples of a prompt hold its full blocks once (RolloutConfig.share_prompt_blocks)
            if share_prompt_blocks and rows_per_prompt is not None:
                groups = [i for i, k in enumerate(rows_per_prompt) for _ in range(k)]
            paged_run = simulate_refill(row_lengths, responses, row_budgets, num_slots=continuous_batch_size,
                                        layout="paged", pool_blocks=paged_pool_blocks, block_size=kv_block_size,
                                        refill_rows=refill_rows, read_interval=read_interval, groups=groups)
            paged_decode = cb_decode_cost_ms(longest_budget, costs, decode_steps=paged_run.steps) \
                + costs.paged_decode_cost_ms * paged_run.steps \
                + sum(prefill_cost_ms(1, width, geometry, costs) for width in paged_run.recompute_widths)
    decode = cb_decode_cost_ms(longest_budget, costs, decode_steps=steps)
    nocb = None
    if eligible:
        nocb = nocb_cost_ms(lengths, geometry, costs, max_new_tokens=longest_budget, decode_steps=nocb_steps)
    packed, packs = None, ()
    if costs.packed_prompt_cost_ms is not None:
        packing = plan_packed(lengths, geometry, costs)
        packed, packs = packing.cost_ms + decode, packing.buckets
    if nocb is not None:
        # cheapest conceivable CB: one fixed cost, every prompt at its own width (packed's too)
        bound = costs.prefill_fixed_cost_ms + decode
        bound += sum(per_row_cost_ms(length, geometry, costs) for length in lengths)
        if nocb <= bound:
            return RoutePlan("nocb", (tuple(range(n)),), nocb, bound, cb_cost_is_lower_bound=True,
                             packed_cost_ms=packed)
    if chunk_long_prompts:
        plan = plan_chunked(lengths, geometry, costs, classes)
    elif classes is not None:
        plan = plan_buckets_classed(lengths, geometry, costs, classes)
    else:
        plan = plan_buckets(lengths, geometry, costs)
    cb = plan.cost_ms + decode
    paged = None if paged_decode is None else plan.cost_ms + paged_decode
    if nocb is not None and nocb <= cb and (packed is None or nocb <= packed):
        return RoutePlan("nocb", (tuple(range(n)),), nocb, cb, packed_cost_ms=packed, paged_cost_ms=paged)
    admission = plan if chunk_long_prompts else None  # plan_admission's plan for these prompts
    if paged is not None and paged < cb and (packed is None or paged < packed):
        return RoutePlan("paged", plan.buckets, nocb, cb, packed_cost_ms=packed, paged_cost_ms=paged, plan=admission)
    if packed is not None and packed < cb:
        return RoutePlan("packed", packs, nocb, cb, packed_cost_ms=packed, paged_cost_ms=paged)
    return RoutePlan("bucketed", plan.buckets, nocb, cb, packed_cost_ms=packed, paged_cost_ms=paged, plan=admission)


def plan_admission(
    route: str, requests: Sequence[int], lengths: Sequence[int],
    geometry: ModelGeometry, costs: CostCoefficients, classes: ShapeClasses | None = None,
) -> BucketPlan:
    """The buckets, as tuples of request indices, for the requests admitted together on a
    continuous-batching ``route``: one bucket (``equal_width``), one per request (``aligned``), as
    few packed forwards as the limit allows (``packed``), else the DP (``bucketed``, ``paged``),
    with over-long prompts chunked."""
    widths = [lengths[r] for r in requests]
    if route == "equal_width":
        width = max(widths)
        return BucketPlan((tuple(requests),), (width,), prefill_cost_ms(len(requests), width, geometry, costs))
    if route == "aligned":
        cost = sum(prefill_cost_ms(1, w, geometry, costs) for w in widths)
        return BucketPlan(tuple((r,) for r in requests), tuple(widths), cost)
    if route == "packed":  # as few packed forwards as prefill_max_tokens allows (planner.packing)
        plan = plan_packed(widths, geometry, costs)
    else:
        plan = plan_chunked(widths, geometry, costs, classes)  # plan_buckets unless a prompt is over the limit
    buckets = tuple(tuple(requests[i] for i in bucket) for bucket in plan.buckets)
    chunks = tuple((requests[i], tail) for i, tail in plan.chunks)
    return BucketPlan(buckets, plan.widths, plan.cost_ms, chunks, packed=plan.packed, rows=plan.rows)


# -- shared prefill --------------------------------------------------------------------------------

def prompt_groups(
    prompts: Sequence[Sequence[int]], *, num_samples: int | Sequence[int], share: bool = True
) -> list[int]:
    """Per row (request-major: ``num_samples`` rows per request, one count for all or one per
    request), the first row with the same prompt; every row its own if not ``share``."""
    counts = [num_samples] * len(prompts) if isinstance(num_samples, int) else list(num_samples)
    num_rows = sum(counts)
    if not share:
        return list(range(num_rows))
    first: dict[tuple[int, ...], int] = {}
    groups: list[int] = []
    for prompt, count in zip(prompts, counts):
        group = first.setdefault(tuple(prompt), len(groups))
        groups.extend([group] * count)
    return groups


def group_sizes(groups: Sequence[int]) -> dict[int, int]:
    """{group id: rows}, in order of first appearance."""
    sizes: dict[int, int] = {}
    for group in groups:
        sizes[group] = sizes.get(group, 0) + 1
    return sizes


def replication_cost_ms(
    lengths: Sequence[int], replicas: Sequence[int], geometry: ModelGeometry, costs: CostCoefficients
) -> float:
    """``prefill_replicate_cost_ms`` per MiB of KV copied: (replicas - 1) rows of each length."""
    mib = sum((k - 1) * kv_mib(1, length, geometry) for length, k in zip(lengths, replicas))
    return costs.prefill_replicate_cost_ms * mib


def choose_shared_route(
    lengths: Sequence[int],
    replicas: Sequence[int],
    *,
    max_new_tokens: int | Sequence[int],
    continuous_batch_size: int | None,
    geometry: ModelGeometry,
    costs: CostCoefficients,
    nocb_allowed: bool = True,
    **route_options: Any,
) -> RoutePlan:
    """``choose_route`` for unique prompts of ``lengths`` that fill ``replicas[i]`` rows each.

    CB's estimate: the DP over the unique prompts plus ``replication_cost_ms``; nocb's: every row
    prefilled (n x samples). ``route_options`` go to both ``choose_route`` calls. Without any
    replica (all 1) this is ``choose_route`` itself. ``max_new_tokens``: one budget, or one per
    unique prompt (its rows share it).
    """
    if len(replicas) != len(lengths) or any(
        isinstance(k, bool) or not isinstance(k, int) or k < 1 for k in replicas
    ):
        raise ValueError(f"replicas must hold one int >= 1 per length ({len(lengths)}), got {list(replicas)!r}")
    budgets = budgets_of(max_new_tokens, len(lengths))
    common = dict(continuous_batch_size=continuous_batch_size, geometry=geometry, costs=costs, **route_options)
    if all(k == 1 for k in replicas):
        return choose_route(lengths, max_new_tokens=budgets, nocb_allowed=nocb_allowed, **common)
    rows = [length for length, k in zip(lengths, replicas) for _ in range(k)]
    row_budgets = [budget for budget, k in zip(budgets, replicas) for _ in range(k)]
    nocb = None
    if nocb_allowed:
        nocb = choose_route(rows, max_new_tokens=row_budgets, nocb_allowed=True, **common).nocb_cost_ms
    shared = choose_route(lengths, max_new_tokens=budgets, nocb_allowed=False, rows_per_prompt=replicas, **common)
    copies = replication_cost_ms(lengths, replicas, geometry, costs)
    cb = shared.cb_cost_ms + copies
    packed = None if shared.packed_cost_ms is None else shared.packed_cost_ms + copies
    paged = None if shared.paged_cost_ms is None else shared.paged_cost_ms + copies
    best_cb = min(c for c in (cb, packed, paged) if c is not None)
    if nocb is not None and nocb <= best_cb:
        return RoutePlan("nocb", (tuple(range(len(lengths))),), nocb, cb, packed_cost_ms=packed, paged_cost_ms=paged)
    return RoutePlan(shared.route, shared.buckets, nocb, cb, packed_cost_ms=packed, paged_cost_ms=paged,
                     plan=shared.plan)
