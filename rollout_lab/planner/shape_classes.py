"""Shape classes: the bounded set of prefill shapes the engine runs, and the DP that plans over them.

A compiled or CUDA-graph-captured prefill forward costs a compile or a capture per shape, so the
engine runs a bucket at a *class* shape: its width rounded up to a ladder of widths, its rows to a
ladder of row counts (the extra rows repeat a real prompt and are dropped). The DP must then price
a bucket of longest prompt L and B rows at its class shape, C(rows_for(B), width_for(L)), not at
(B, L): the buckets that look cheapest unrounded can cost more once rounded.

``plan_buckets_classed`` is exactly optimal for that priced cost. Rounding is monotone in L and in B,
so given any partition, re-filling its buckets (same sizes, ordered by their longest prompt) with
the sorted lengths never raises a bucket's longest prompt: contiguous buckets of the sorted lengths
are enough, and the O(n^2) DP over them is exact (checked against every set partition in the
tests). A length or row count above the ladder's top runs at its own size. Pure Python.

    classes = ShapeClasses.ladder(max_width=2048, max_rows=64)
    plan = plan_buckets_classed(lengths, geometry, costs, classes)   # widths/rows: the class shapes
"""
from __future__ import annotations

import bisect
import dataclasses
from dataclasses import dataclass
from typing import Iterable, Sequence

from rollout_lab.planner.bucket_dp import BucketPlan, _fixed_with_tie_break, validate_lengths
from rollout_lab.planner.checks import check_int, is_int
from rollout_lab.planner.cost import CostCoefficients, ModelGeometry, check_pricing, per_row_cost_ms, prefill_cost_ms


def _ascending(name: str, values: Sequence[int]) -> tuple[int, ...]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise ValueError(f"ShapeClasses.{name} must be strictly ascending positive ints, got {values!r}")
    values = tuple(values)
    if any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in values) or \
            list(values) != sorted(set(values)):
        raise ValueError(f"ShapeClasses.{name} must be strictly ascending positive ints, got {values!r}")
    return values


# the largest width or row count a ladder reaches: 65536 width rungs (past any model's context), and
# its lists stay small where a mistyped 10**12 would build billions of rungs
MAX_LADDER_TOP = 2**24
CAPTURE_PAYBACK_CALLS = 16  # a class not captured yet is priced at a capture's ms over this many calls


@dataclass(frozen=True)
class ShapeClasses:
    """Ladders of prefill widths and row counts (``rows=()``: rows run as they are).

    ``captured`` (the (rows, width) class shapes whose forward is captured already), ``first_use_ms``
    and ``max_capture_tokens`` price a class's first use: each bucket at a class shape not captured
    yet, of at most ``max_capture_tokens`` rows x width (a larger one runs eagerly, never captured),
    costs ``first_use_ms`` more (``priced_captures``). Without it a refit of the costs that moves the
    plan to other classes makes the next call capture each of them (seconds, a compile included).
    The charge is per bucket, so two buckets of one new class pay it twice: an upper bound."""

    widths: tuple[int, ...]
    rows: tuple[int, ...] = ()
    captured: tuple[tuple[int, int], ...] = ()
    first_use_ms: float = 0.0
    max_capture_tokens: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "widths", _ascending("widths", self.widths))
        object.__setattr__(self, "rows", _ascending("rows", self.rows))
        if not self.widths:
            raise ValueError("ShapeClasses.widths must hold at least one width")
        if not isinstance(self.captured, (tuple, frozenset)) or any(
                not (isinstance(s, tuple) and len(s) == 2 and
                     all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in s))
                for s in self.captured):
            raise ValueError(f"ShapeClasses.captured must hold (rows, width) pairs of ints >= 1, got {self.captured!r}")
        object.__setattr__(self, "captured", tuple(sorted(set(self.captured))))  # a record's JSON holds it
        object.__setattr__(self, "_captured", frozenset(self.captured))  # for membership, not a field
        if isinstance(self.first_use_ms, bool) or not isinstance(self.first_use_ms, (int, float)) \
                or not 0 <= self.first_use_ms < float("inf"):
            raise ValueError(f"ShapeClasses.first_use_ms must be a finite number >= 0, got {self.first_use_ms!r}")
        if self.max_capture_tokens is not None and (isinstance(self.max_capture_tokens, bool) or
                                                    not isinstance(self.max_capture_tokens, int) or
                                                    self.max_capture_tokens < 1):
            raise ValueError(f"ShapeClasses.max_capture_tokens must be None or an int >= 1, "
                             f"got {self.max_capture_tokens!r}")

    def priced_captures(self, captured: Iterable[tuple[int, int]], capture_ms: float, *,
                        max_tokens: int | None) -> "ShapeClasses":
        """These ladders with ``captured`` kept and a class not in it priced at ``capture_ms`` (what
        capturing one costs) over ``CAPTURE_PAYBACK_CALLS`` calls: a plan moves to new class shapes
        only when they save their capture back within that many calls."""
        return dataclasses.replace(self, captured=tuple(captured), first_use_ms=capture_ms / CAPTURE_PAYBACK_CALLS,
                                   max_capture_tokens=max_tokens)

    def first_use_cost_ms(self, rows: int, width: int) -> float:
        """What a bucket at class shape (``rows``, ``width``) costs on top of its forward: its
        capture's share (``first_use_ms``) unless it is captured already or too large to capture."""
        if not self.first_use_ms or (rows, width) in self._captured or \
                (self.max_capture_tokens is not None and rows * width > self.max_capture_tokens):
            return 0.0
        return self.first_use_ms

    @classmethod
    def ladder(cls, max_width: int, max_rows: int | None = None, *, smallest_rows: int = 1) -> "ShapeClasses":
        """Widths 16, 32, 64, 128, 256, then every 256 up to ``max_width``; rows 1, 2, 4, 8, then
        every 8 up to 32 and every 16 after, up to ``max_rows`` (None: rows unclassed).
        ``smallest_rows=2`` leaves out the 1-row rung (one prompt runs as two rows, the second a
        repeat): a compiled forward specialises a size of 1, so that rung alone would cost a whole
        compile of its own (data/results/defaults_qwen2.5-3b_bfloat16_cuda_warm.json: long_tail's 1x512
        class), where every other class shares one."""
        max_width = check_int(max_width, name="max_width", maximum=MAX_LADDER_TOP)
        max_rows = None if max_rows is None else check_int(max_rows, name="max_rows", maximum=MAX_LADDER_TOP,
                                                           or_none=True)
        if smallest_rows not in (1, 2):
            raise ValueError(f"smallest_rows must be 1 or 2, got {smallest_rows!r}")
        widths = [w for w in (16, 32, 64, 128) if w < max_width] + list(range(256, max_width, 256)) + [max_width]
        rows: list[int] = []
        if max_rows is not None:
            rows = [r for r in (1, 2, 4, 8, 16, 24) if smallest_rows <= r < max_rows] + \
                list(range(32, max_rows, 16)) + [max(max_rows, smallest_rows)]
        return cls(tuple(sorted(set(widths))), tuple(sorted(set(rows))))

    @classmethod
    def covering(cls, longest: int, max_rows: int, *, smallest_rows: int = 1) -> "ShapeClasses":
        """The ``ladder`` whose top rungs hold a prompt of ``longest`` tokens and ``max_rows`` rows,
        rounded up (widths to a multiple of 256, rows to 32 or a multiple of 16): calls of similar
        shapes get the same ladder, and a larger call only adds rungs on top, so the shapes (and the
        graphs captured at them) of earlier calls stay in use. ``RolloutConfig(prefill_classes="auto")``
        (``smallest_rows=2`` where the prefill graphs are compiled)."""
        if not is_int(longest) or not is_int(max_rows) or longest < 1 or max_rows < 1:
            raise ValueError(f"longest and max_rows must be >= 1, got {longest!r}, {max_rows!r}")
        longest = check_int(longest, name="longest", maximum=MAX_LADDER_TOP)
        max_rows = check_int(max_rows, name="max_rows", maximum=MAX_LADDER_TOP)
        return cls.ladder(max_width=-(-longest // 256) * 256, max_rows=max(32, -(-max_rows // 16) * 16),
                          smallest_rows=smallest_rows)

    def width_for(self, length: int) -> int:
        """The smallest class width that holds ``length`` (the length itself above the top)."""
        i = bisect.bisect_left(self.widths, length)
        return self.widths[i] if i < len(self.widths) else length

    def rows_for(self, batch: int) -> int:
        """The smallest class row count that holds ``batch`` (``batch`` itself above the top, or
        without a row ladder)."""
        i = bisect.bisect_left(self.rows, batch)
        return self.rows[i] if i < len(self.rows) else batch

    @property
    def num_shapes(self) -> int:
        """The most distinct prefill shapes a rollout can run within the ladders."""
        return len(self.widths) * max(1, len(self.rows))


def class_shape(batch: int, longest: int, geometry: ModelGeometry, costs: CostCoefficients,
                classes: ShapeClasses) -> tuple[int, int, float]:
    """(rows, width, ms) of a bucket of ``batch`` prompts whose longest has ``longest`` tokens: its
    class shape, priced with its first use (``ShapeClasses.first_use_cost_ms``), or a larger shape
    in ``classes.captured`` where that costs less (a replay at more rows or a wider width than the
    bucket needs, instead of a new capture)."""
    rows, width = classes.rows_for(batch), classes.width_for(longest)
    best = (rows, width, prefill_cost_ms(rows, width, geometry, costs) + classes.first_use_cost_ms(rows, width))
    limit = costs.prefill_max_tokens
    for r, w in classes.captured if classes.first_use_ms else ():  # unpriced, a class shape is the cheapest
        if r >= batch and w >= longest and (limit is None or r * w <= limit):
            ms = prefill_cost_ms(r, w, geometry, costs)
            if ms < best[2]:
                best = (r, w, ms)
    return best


def classed_cost_ms(batch: int, longest: int, geometry: ModelGeometry, costs: CostCoefficients,
                    classes: ShapeClasses) -> float:
    """C of a bucket of ``batch`` prompts whose longest has ``longest`` tokens at the shape it runs
    at (``class_shape``): its class shape, a class's first use included."""
    return class_shape(batch, longest, geometry, costs, classes)[2]


def plan_buckets_classed(
    lengths: Sequence[int], geometry: ModelGeometry, costs: CostCoefficients, classes: ShapeClasses
) -> BucketPlan:
    """The cheapest contiguous bucketing of the sorted lengths when every bucket runs (and is
    priced) at the shape ``class_shape`` gives it: its class shape with its first use, or a larger
    captured one; ``widths`` and ``rows`` hold those shapes. That cost stays monotone in the bucket's
    rows and longest prompt (a captured shape that holds a bucket holds every smaller one), so the
    contiguous DP stays exact. O(n^2 log k) for k captured shapes."""
    check_pricing(geometry, costs)
    if not isinstance(classes, ShapeClasses):
        raise ValueError(f"classes must be a ShapeClasses, got {classes!r}")
    lengths = validate_lengths(lengths, costs)
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    widths = [lengths[i] for i in order]
    n = len(widths)
    if n == 0:
        return BucketPlan((), (), 0.0, rows=())
    limit = costs.prefill_max_tokens
    per_row = {w: per_row_cost_ms(classes.width_for(w), geometry, costs) for w in set(widths)}
    fixed = _fixed_with_tie_break(costs, [per_row[widths[-1]]])
    # the captured shapes a bucket may replay at instead of its class shape (none while nothing is priced)
    captured = [(r, w, r * per_row_cost_ms(w, geometry, costs)) for r, w in classes.captured
                if classes.first_use_ms and (limit is None or r * w <= limit)]
    best = [0.0] + [float("inf")] * n
    cut = [0] * (n + 1)
    shape = [(0, 0)] * (n + 1)
    for j in range(1, n + 1):
        width = classes.width_for(widths[j - 1])
        # the captured shapes that hold the bucket's longest prompt, by rows, with the cheapest of
        # those of at least each row count (a suffix minimum)
        holding = sorted((r, ms, w) for r, w, ms in captured if w >= widths[j - 1])
        held_rows = [r for r, _, _ in holding]
        cheapest = holding[:]
        for k in range(len(cheapest) - 2, -1, -1):
            cheapest[k] = min(cheapest[k], cheapest[k + 1], key=lambda c: c[1])
        for i in range(j - 1, -1, -1):
            rows = classes.rows_for(j - i)
            if limit is not None and rows * width > limit:
                if i == j - 1:
                    raise ValueError(f"a prompt of {widths[j - 1]} tokens runs at class width {width}, "
                                     f"over prefill_max_tokens={limit}; add a smaller class or raise the limit")
                break  # fewer rows fit for every smaller i too
            run, ms = (rows, width), rows * per_row[widths[j - 1]] + classes.first_use_cost_ms(rows, width)
            k = bisect.bisect_left(held_rows, j - i)
            if k < len(cheapest) and cheapest[k][1] < ms:
                run, ms = (cheapest[k][0], cheapest[k][2]), cheapest[k][1]
            cost = best[i] + fixed + ms
            if cost < best[j]:
                best[j], cut[j], shape[j] = cost, i, run
    bounds, j = [], n
    while j > 0:
        bounds.append((cut[j], j))
        j = cut[j]
    bounds.reverse()
    buckets = tuple(tuple(order[i:j]) for i, j in bounds)
    class_rows = tuple(shape[j][0] for _, j in bounds)
    class_widths = tuple(shape[j][1] for _, j in bounds)
    cost = sum(prefill_cost_ms(r, w, geometry, costs) + classes.first_use_cost_ms(r, w)
               for r, w in zip(class_rows, class_widths))
    return BucketPlan(buckets, class_widths, cost, rows=class_rows)
