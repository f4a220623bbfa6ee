"""Decode steps and occupancy of a call with refill, on the aligned cache and on the paged one.

With fewer slots than rows, rows come and go: the decode steps a call pays, and how full each step
is, depend on when a queued row can enter. ``simulate_refill`` replays the two admission rules on
the rows' prompt lengths, response lengths and budgets, turn by turn as the engine runs: an
admission (the prefill giving each row its first token), then a burst of decode steps with no read
of the tokens between them (``read_interval``), after which rows that ended retire:

- ``"aligned"`` (``engine.sched.aligned``): every live row's next token goes to one shared front column,
  so a row enters only when the widest live span (and its own prompt) fits left of some front and
  every live row's remaining *budget* (and its own) fits right of it: ``max span <= capacity -
  max remaining``. The budget is what the cache must hold, whatever the row's actual length: one
  long row keeps the front far right and blocks refill until it retires.
- ``"paged"`` (``engine.sched.paged``): each row lives in its own blocks, so a row enters as soon
  as a slot is free (in admissions of ``refill_rows`` at least). Without ``pool_blocks`` the pool
  is assumed to hold the live rows; with it, the engine's block accounting is replayed too: a row
  enters only while one free block per live row remains after its prompt's (the watermark), every
  row's blocks for the next burst are reserved before it (one step when they do not fit), and when
  one step does not fit the most recently admitted row is preempted (back to the head of the queue,
  its tokens kept) and later recomputed by a prefill of its prompt and tokens. The schedule counts
  those preemptions and the recomputed widths, which Auto prices as prefill. With ``groups`` (each
  row's prompt group) the rows of a group admitted in one turn hold their prompt's full blocks once
  (``RolloutConfig.share_prompt_blocks``): each holds its own blocks past them, and the shared ones
  stay until the cohort's last row leaves; a preempted row returns into blocks of its own.

Response lengths come from a prior when there is one (``response_quantiles``: its quantiles spread
over the rows, each clipped at its budget), else they are the budgets. Auto prices the two layouts'
decode by these steps (``planner.routes.choose_route``). Pure Python, no torch::

    aligned = simulate_refill(prompts, lengths, budgets, num_slots=128, layout="aligned")
    paged = simulate_refill(prompts, lengths, budgets, num_slots=128, layout="paged")
    aligned.steps, paged.steps, paged.occupancy

"""
from __future__ import annotations

import bisect
import heapq
from dataclasses import dataclass
from typing import Sequence

from rollout_lab.planner.bucket_dp import validate_lengths
from rollout_lab.planner.checks import check_int
from rollout_lab.planner.decode_steps import LengthPrior, cdf_steps

LAYOUTS = ("aligned", "paged")


@dataclass(frozen=True)
class RefillSchedule:
    """What a call's decode pays: ``steps`` forwards, ``row_steps`` live rows summed over them."""

    steps: int
    row_steps: int
    num_slots: int
    queued_steps: int = 0  # the steps taken while rows still waited in the queue
    queued_row_steps: int = 0
    preemptions: int = 0  # rows that gave their blocks back (paged with ``pool_blocks`` only)
    peak_blocks: int = 0  # paged: the most blocks of ``block_size`` tokens the live rows held at once
    recompute_widths: tuple[int, ...] = ()  # the prefill width of each preempted row's return

    @property
    def occupancy(self) -> float:
        """Mean share of the slots a step runs live rows in."""
        return self.row_steps / (self.steps * self.num_slots) if self.steps else 0.0

    @property
    def queued_occupancy(self) -> float:
        """The same over the steps taken while rows waited (until the queue drained)."""
        return self.queued_row_steps / (self.queued_steps * self.num_slots) if self.queued_steps else 0.0


def response_quantiles(prior: LengthPrior, budgets: Sequence[int]) -> list[int]:
    """One response length per row: the prior's quantiles at (i + 0.5) / n, spread over the rows in
    a fixed interleaved order (so that long and short rows mix in the queue), each clipped at its budget."""
    n = len(budgets)
    if n == 0:
        return []
    points, values = cdf_steps(prior, max(budgets))
    quantiles = []
    for i in range(n):
        q = (i + 0.5) / n
        index = bisect.bisect_left(values, q - 1e-12)  # the first length whose F reaches q
        quantiles.append(points[index] if index < len(points) else max(budgets) + 1)
    order = sorted(range(n), key=lambda i: (i * 0.6180339887) % 1.0)  # golden-ratio spread of the ranks
    return [max(1, min(quantiles[rank], budget)) for rank, budget in zip(order, budgets)]


def simulate_refill(
    prompt_lengths: Sequence[int], response_lengths: Sequence[int], budgets: Sequence[int], *,
    num_slots: int, layout: str, capacity: int | None = None, pool_blocks: int | None = None, block_size: int = 16,
    refill_rows: int = 1, read_interval: int = 1, groups: Sequence[int] | None = None,
) -> RefillSchedule:
    """Replay one call's admissions (queue order) and decode steps on ``layout`` (``LAYOUTS``).
    ``capacity``: the aligned cache's columns (default: longest prompt + largest budget, the engine's).
    ``pool_blocks``: the paged pool's usable blocks of ``block_size`` tokens (None: it holds every
    live row); a pool smaller than one row's prompt and response is a ValueError.

    The engine's loop is replayed turn by turn: an admission, then a burst of steps
    with no read between them, at most ``read_interval`` (``RolloutConfig.eos_check_interval`` when
    rows can end at EOS) and never past a live row's budget; a row that ends inside a burst keeps
    its slot to the burst's end. On ``"paged"`` a turn admits only when at least ``refill_rows`` rows
    can come in (or the queue is that short, or nothing is live), and a row done at its prefill frees
    its slot for the next turn. With a pool the same turns, its blocks replayed too (``_simulate_pool``).
    ``groups`` (paged): each row's prompt group, rows of one group admitted in one turn sharing their
    prompt's full blocks (module docstring); None: every row holds its own.
    Turns that change nothing but the step count (full bursts, no admission, no row's end, no
    preemption) are taken together in one jump, so a replay costs its rows' events, not their tokens:
    a budget of 10**9 is as quick as one of 10. ``capacity`` (aligned) must hold every row alone."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {list(LAYOUTS)}, got {layout!r}")
    if pool_blocks is not None and layout != "paged":
        raise ValueError(f"pool_blocks is the paged pool's size; layout {layout!r} has no pool")
    if groups is not None and layout != "paged":
        raise ValueError(f"groups share the paged pool's prompt blocks; layout {layout!r} has no blocks")
    prompt_lengths = validate_lengths(prompt_lengths)
    n = len(prompt_lengths)
    if not (len(response_lengths) == len(budgets) == n):
        raise ValueError(f"one response length and budget per prompt: {n} prompts, "
                         f"{len(response_lengths)} lengths, {len(budgets)} budgets")
    if groups is not None and len(groups) != n:
        raise ValueError(f"one group per prompt: {n} prompts, {len(groups)} groups")
    # the full prompt blocks a row's cohort holds once (without groups every row is its own cohort)
    shared = [p // block_size for p in prompt_lengths] if groups is not None else [0] * n
    for name, value in (("num_slots", num_slots), ("refill_rows", refill_rows), ("read_interval", read_interval)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if any(not 1 <= r <= b for r, b in zip(response_lengths, budgets)):
        raise ValueError("every response length must be in [1, its budget]")
    if n == 0:
        return RefillSchedule(0, 0, num_slots)
    if pool_blocks is not None:
        return _simulate_pool(prompt_lengths, response_lengths, budgets, num_slots, pool_blocks, block_size,
                              refill_rows, read_interval, groups)
    if capacity is None:
        capacity = max(prompt_lengths) + max(budgets)
    elif layout == "aligned":  # a row that cannot enter an empty cache would be waited for forever
        capacity = check_int(capacity, name="capacity")
        row = max(range(n), key=lambda r: prompt_lengths[r] + budgets[r])
        if prompt_lengths[row] + budgets[row] - 1 > capacity:
            raise ValueError(f"capacity={capacity} columns cannot hold row {row} alone ({prompt_lengths[row]} prompt + "
                             f"{budgets[row]} budget - 1 = {prompt_lengths[row] + budgets[row] - 1} columns): give at "
                             f"least {prompt_lengths[row] + budgets[row] - 1}")
    # a row that enters before step t's token has made 1 token (its prefill's) and makes one per step:
    # it makes its last token at step t + length - 1 and reaches its budget at t + budget - 1. The
    # aligned check only needs two maxima over the live rows: span = L + steps since entry =
    # (L - t) + step, remaining budget = (B - 1 + t) - step.
    live: dict[int, int] = {}  # row -> the step count when it entered
    ends: list[tuple[int, int]] = []  # heap of (last step, row)
    budget_ends: list[tuple[int, int]] = []  # heap of (the step its budget runs out, row); stale rows skipped
    queue = step = row_steps = queued_steps = queued_row_steps = peak = 0
    span_key = remaining_key = None  # max over live rows of L - t and B - 1 + t (None: recompute)
    cohort_of: dict[int, tuple[int, int]] = {}  # live row -> (its group, its admission turn)
    cohort_rows: dict[tuple[int, int], int] = {}  # live rows of each cohort
    held_once = 0  # the live cohorts' shared blocks

    def enter(row: int, turn: int = 0) -> None:
        nonlocal held_once
        if response_lengths[row] > 1:  # a row done at its prefill never takes a step
            live[row] = step
            heapq.heappush(ends, (step + response_lengths[row] - 1, row))
            heapq.heappush(budget_ends, (step + budgets[row] - 1, row))
            cohort = cohort_of[row] = (row if groups is None else groups[row], turn)
            cohort_rows[cohort] = cohort_rows.get(cohort, 0) + 1
            held_once += shared[row] if cohort_rows[cohort] == 1 else 0

    def leave(row: int) -> None:
        nonlocal held_once
        del live[row]
        cohort = cohort_of.pop(row)
        cohort_rows[cohort] -= 1
        if not cohort_rows[cohort]:
            del cohort_rows[cohort]
            held_once -= shared[row]

    def blocks_held(ahead: int) -> int:
        """The live rows' blocks with ``ahead`` more tokens each, a cohort's shared blocks once."""
        return held_once + sum(blocks_for(prompt_lengths[r] + step - t + ahead, block_size) - shared[r]
                               for r, t in live.items())

    while queue < n or live:
        if layout == "paged":  # one admission a turn, the next turn at once while nothing is live
            while queue < n:
                take = min(num_slots - len(live), n - queue)
                if take == 0 or (live and take < min(refill_rows, n - queue, num_slots)):
                    break
                for row in range(queue, queue + take):
                    enter(row, queue)
                queue += take
                if live:
                    break
        else:
            while queue < n and len(live) < num_slots:
                if span_key is None:
                    span_key = max((prompt_lengths[r] - t for r, t in live.items()), default=None)
                    remaining_key = max((budgets[r] - 1 + t for r, t in live.items()), default=None)
                span = max(prompt_lengths[queue], step + span_key if live else 0)
                remaining = max(budgets[queue] - 1, remaining_key - step if live else 0)
                if span > capacity - remaining:
                    break
                enter(queue)
                span_key = None
                queue += 1
        if not live:
            continue
        while budget_ends[0][1] not in live:
            heapq.heappop(budget_ends)  # a row that retired
        quiet = _quiet_turns(step, read_interval, first_end=ends[0][0], budget_end=budget_ends[0][0])
        if quiet and queue < n:  # and no admission at their starts
            if layout == "paged":
                take = min(num_slots - len(live), n - queue)
                quiet = 0 if take and take >= min(refill_rows, n - queue, num_slots) else quiet
            elif len(live) < num_slots:
                if span_key is None:
                    span_key = max(prompt_lengths[r] - t for r, t in live.items())
                    remaining_key = max(budgets[r] - 1 + t for r, t in live.items())
                admits = _first_aligned_admission(step + read_interval, prompt=prompt_lengths[queue],
                                                  budget=budgets[queue], span_key=span_key,
                                                  remaining_key=remaining_key, capacity=capacity)
                if admits is not None:
                    quiet = min(quiet, (admits - step - 1) // read_interval)
        if quiet:  # turns of full bursts with no admission and no row's end: one jump over them all
            step += quiet * read_interval
            if layout == "paged":  # the blocks grow with the steps: the last of these turns holds the most
                peak = max(peak, blocks_held(0))
            row_steps += quiet * read_interval * len(live)
            if queue < n:
                queued_steps += quiet * read_interval
                queued_row_steps += quiet * read_interval * len(live)
        burst = min(budget_ends[0][0] - step, read_interval)  # a burst: every live row makes a token a step
        if layout == "paged":  # each live row's blocks for its tokens so far and the burst's, reserved before it
            peak = max(peak, blocks_held(burst))
        step += burst
        kept = burst * len(live)  # row-steps that made a row's token (not those after its end)
        while ends and ends[0][0] <= step:
            last, row = heapq.heappop(ends)
            kept -= step - last
            leave(row)
            span_key = None
        row_steps += kept
        if queue < n:
            queued_steps += burst
            queued_row_steps += kept
    return RefillSchedule(step, row_steps, num_slots, queued_steps, queued_row_steps, peak_blocks=peak)


def _quiet_turns(step: int, read_interval: int, *, first_end: int, budget_end: int) -> int:
    """The turns from ``step`` on that run a full burst of ``read_interval`` steps and end before the
    first live row's end (``first_end``, its last step) and within the first live budget
    (``budget_end``): the replay jumps over them at once, its cost following the rows, not the steps.
    The caller bounds them by the admissions too."""
    return max(0, min((first_end - step - 1) // read_interval, (budget_end - step) // read_interval))


def _first_aligned_admission(start: int, *, prompt: int, budget: int, span_key: int, remaining_key: int,
                             capacity: int) -> int | None:
    """The first step >= ``start`` at which the aligned cache admits the queue's head (``prompt``,
    ``budget``) beside the live rows as they are (``span_key``, ``remaining_key``: ``simulate_refill``'s
    maxima), else None. Its need, max(prompt, step + span_key) + max(budget - 1, remaining_key - step),
    is convex in the step (slopes -1, 0, 1): it falls, as prompt + remaining_key - step, only while the
    head's prompt and the live rows' remaining budget lead both terms, and never again after."""
    def need(step: int) -> int:
        return max(prompt, step + span_key) + max(budget - 1, remaining_key - step)

    if need(start) <= capacity:
        return start
    falls_until = min(prompt - span_key, remaining_key - (budget - 1))  # past it the need never falls again
    reaches = prompt + remaining_key - capacity  # where prompt + remaining_key - step meets the capacity
    return max(start, reaches) if start < falls_until and reaches <= falls_until else None


def blocks_for(tokens: int, block_size: int) -> int:
    """Blocks of ``block_size`` tokens that ``tokens`` positions take."""
    return -(-tokens // block_size)


def pool_misfit(prompts: Sequence[int], lengths: Sequence[int], *, pool_blocks: int, block_size: int) -> int | None:
    """The first row whose prompt and response alone need more than ``pool_blocks`` blocks of
    ``block_size`` tokens, else None (the pool can run every row)."""
    for name, value in (("pool_blocks", pool_blocks), ("block_size", block_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return next((r for r, (p, n) in enumerate(zip(prompts, lengths)) if blocks_for(p + n, block_size) > pool_blocks),
                None)


def _simulate_pool(
    prompts: Sequence[int], lengths: Sequence[int], budgets: Sequence[int], num_slots: int, pool: int, size: int,
    refill_rows: int, read_interval: int, groups: Sequence[int] | None = None,
) -> RefillSchedule:
    """The paged layout with its pool replayed block by block, as ``engine.sched.paged`` runs it,
    turn by turn: one admission (the queue's longest head that fits the free slots and the
    watermark, if at least ``refill_rows`` rows), then a burst of at most ``read_interval`` steps
    and never past a live budget, for which every live row's blocks are reserved at once (one step
    if the burst does not fit; preempting the newest row while one does not), then retirement.
    With ``groups`` the new rows of a group admitted in one turn (a cohort) hold its prompt's full
    blocks once, until the cohort's last row leaves."""
    def blocks(tokens: int) -> int:
        return blocks_for(tokens, size)

    worst = pool_misfit(prompts, lengths, pool_blocks=pool, block_size=size)
    if worst is not None:
        raise ValueError(f"a pool of {pool} blocks of {size} tokens cannot hold row {worst} alone "
                         f"({prompts[worst]} prompt + {lengths[worst]} tokens)")
    n = len(prompts)
    fresh = 0  # the next row never admitted
    waiting: list[int] = []  # preempted rows, the next to return first
    made = [0] * n  # tokens each row has made
    held: dict[int, int] = {}  # live row -> the blocks it reads, in admission order (dicts keep it)
    shared = [p // size for p in prompts] if groups is not None else [0] * n  # a cohort's blocks held once
    cohort_of: dict[int, int] = {}  # live row -> its cohort (the cohort's first row)
    cohort_rows: dict[int, int] = {}  # cohort -> its live rows
    free = pool
    step = row_steps = queued_steps = queued_row_steps = peak = 0
    recompute: list[int] = []

    def queue_head(count: int) -> list[int]:
        """The first ``count`` rows of the queue: the preempted ones (the newest first), then the fresh."""
        head = waiting[::-1][:count]
        return head + list(range(fresh, min(n, fresh + count - len(head))))

    def admission() -> list[tuple[int, int, int | None]]:
        """The (row, blocks it reads, its cohort: None for a preempted row) this turn admits; none
        while fewer than ``refill_rows`` rows can come in beside live ones. With fewer free blocks
        it admits a prefix of these (so none when these are none)."""
        queued = n - fresh + len(waiting)
        chosen, budget = [], free
        firsts: dict[int, int] = {}  # group -> its first new row chosen
        for row in queue_head(num_slots - len(held)):
            need = blocks(prompts[row] + max(1, made[row]))  # its prompt (and tokens) + the next step's
            cohort = None if groups is None or made[row] else firsts.setdefault(groups[row], row)
            taken = need - shared[row] if cohort not in (None, row) else need  # a later one reads the first's
            # the watermark: one free block per live row stays after it (never blocking an empty pool)
            if taken > budget - (len(held) + len(chosen) + 1):
                break
            budget -= taken
            chosen.append((row, need, cohort))
        if not chosen and not held:
            row = queue_head(1)[0]
            need = blocks(prompts[row] + max(1, made[row]))
            if need <= free:
                chosen = [(row, need, None if groups is None or made[row] else row)]
        return [] if held and len(chosen) < min(refill_rows, queued, num_slots) else chosen

    def hold(row: int, need: int, cohort: int | None) -> None:
        nonlocal free
        held[row] = need
        free -= need
        if cohort is not None:
            cohort_of[row] = cohort
            cohort_rows[cohort] = cohort_rows.get(cohort, 0) + 1
            free += shared[row] if cohort_rows[cohort] > 1 else 0  # the cohort's blocks are taken once

    def leave(row: int) -> None:
        nonlocal free
        free += held.pop(row)
        cohort = cohort_of.pop(row, None)
        if cohort is not None:
            cohort_rows[cohort] -= 1
            if cohort_rows[cohort]:
                free -= shared[row]  # still read by the cohort's other rows
            else:
                del cohort_rows[cohort]

    def growth(steps: int) -> int:
        """The blocks the live rows add to hold ``steps`` more tokens each."""
        return sum(blocks(prompts[row] + made[row] - 1 + steps) - b for row, b in held.items())

    while fresh < n or waiting or held:
        while fresh < n or waiting:  # one admission a turn, the next turn at once while nothing is live
            chosen = admission()
            if not chosen:
                break
            for row, need, cohort in chosen:
                if waiting and row == waiting[-1]:
                    waiting.pop()
                    recompute.append(prompts[row] + made[row] - 1)  # its prompt and all but its last token
                else:
                    fresh += 1
                    made[row] = 1  # the prefill's token
                    if lengths[row] == 1:
                        continue  # done at its prefill: never takes a step (nor keeps its blocks)
                hold(row, need, cohort)
            if held:
                break
        if not held:
            continue
        quiet = _quiet_turns(0, read_interval, first_end=min(lengths[row] - made[row] for row in held),
                             budget_end=min(budgets[row] - made[row] for row in held))
        if quiet and (fresh < n or waiting) and admission():  # the free blocks only fall until a row ends
            quiet = 0
        if quiet and growth(quiet * read_interval) > free:  # the most turns whose blocks fit, reserved a turn at a time
            low, high = 0, quiet
            while low < high:
                middle = (low + high + 1) // 2
                low, high = (middle, high) if growth(middle * read_interval) <= free else (low, middle - 1)
            quiet = low
        if quiet:  # turns of full bursts with no admission, no row's end and no preemption: one jump over them all
            steps = quiet * read_interval
            for row in held:
                grown = blocks(prompts[row] + made[row] - 1 + steps)
                free -= grown - held[row]
                held[row] = grown
                made[row] += steps
            peak = max(peak, pool - free)
            step += steps
            row_steps += steps * len(held)
            if fresh < n or waiting:
                queued_steps += steps
                queued_row_steps += steps * len(held)
        burst = min(min(budgets[row] - made[row] for row in held), read_interval)
        while True:  # growth: every live row's blocks for the burst, else one step, else preempt the newest
            needs = {row: blocks(prompts[row] + made[row] - 1 + burst) - b for row, b in held.items()}
            if sum(needs.values()) <= free:
                break
            if burst > 1:
                burst = 1
                continue
            newest = next(reversed(held))
            leave(newest)
            waiting.append(newest)
        for row, need in needs.items():
            held[row] += need
            free -= need
        peak = max(peak, pool - free)
        step += burst
        kept = 0
        for row in list(held):
            run = min(burst, lengths[row] - made[row])  # a row that ends inside the burst keeps its slot to its end
            made[row] += run
            kept += run
        row_steps += kept
        if fresh < n or waiting:
            queued_steps += burst
            queued_row_steps += kept
        for row in list(held):
            if made[row] == lengths[row]:
                leave(row)
    # every preempted row came back, once per preemption
    return RefillSchedule(step, row_steps, num_slots, queued_steps, queued_row_steps,
                          preemptions=len(recompute), recompute_widths=tuple(recompute), peak_blocks=peak)
