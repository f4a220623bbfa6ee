"""Split a global batch of prompts across data-parallel ranks so the predicted makespan is minimal.

An RL step's rollout takes as long as its slowest rank. A rank's predicted cost is its own Auto
plan: ``min(nocb, bucketed CB)`` as ``planner.routes.choose_route`` computes it for the rank's
prompts. Pure Python (no torch), deterministic, no I/O::

    from rollout_lab.planner.sharding import shard_requests, predicted_makespan
    shards = shard_requests(lengths, 8, geometry, costs, max_new_tokens=16)

The API is ``shard_requests``, ``predicted_rank_costs``, ``predicted_makespan`` and
``check_partition``. A rank is empty (``[]``, cost 0) when world_size exceeds the number of prompts.

- ``RankCost``: a rank's cost, called with its prompt lengths as a sorted tuple and memoised;
  ``row``/``row_nokv`` are per-prompt row costs and ``lower_bound`` a bound from a rank's count,
  longest length and row-cost sum that needs no DP.
- The baselines: ``round_robin_shards`` (prompt i to rank i % world_size) and
  ``karmarkar_karp_shards``, verl's ``get_seqlen_balanced_partitions(..., equal_size=True)``:
  largest differencing on the workload proxy ``L^2 + 24576 L`` (``verl_workload``), equal counts
  per rank (zero-weight placeholders fill the last group when world_size does not divide n).
- ``balanced``: (1) the best split of the length-sorted order into contiguous ranges (bisection on
  the makespan, each rank greedily taking the longest range that fits: exact for contiguous splits,
  since a rank's cost only grows when a prompt is added); (2) local search that moves one prompt,
  or swaps two, off the most expensive rank while that strictly lowers the pair's maximum, every
  candidate priced exactly through ``RankCost``, within a fixed budget of priced rows. Adding a
  prompt of length L raises a rank's cost by at least L's nocb row cost (nocb pays a row at a width
  >= L; the DP's plan minus that row is a plan for the rest, cheaper by >= its row cost), which
  prunes most candidates without a DP. Round-robin and Karmarkar-Karp are polished the same way
  when they start out better, so ``balanced`` is never worse than either.

Budgets: ``max_new_tokens`` is one for every request or one per request; the search sees each
request as a (length, budget) item, and a rank's cost prices its own budgets.
"""
from __future__ import annotations

import bisect
import heapq
from typing import Callable, Sequence

from rollout_lab.planner.bucket_dp import validate_lengths
from rollout_lab.planner.checks import budgets_of
from rollout_lab.planner.cost import CostCoefficients, ModelGeometry, check_pricing, per_row_cost_ms
from rollout_lab.planner.routes import cb_decode_cost_ms, choose_route

METHODS = ("balanced", "round_robin", "karmarkar_karp")
Item = tuple[int, int]  # a request as the search sees it: (prompt length, generation budget)


def shard_requests(
    lengths: Sequence[int],
    world_size: int,
    geometry: ModelGeometry,
    costs: CostCoefficients,
    *,
    max_new_tokens: int | Sequence[int] = 16,
    continuous_batch_size: int | None = None,
    nocb_allowed: bool = True,
    method: str = "balanced",
) -> list[list[int]]:
    """``world_size`` lists of indices into ``lengths`` (each sorted); every index on one rank.

    ``continuous_batch_size`` and ``nocb_allowed`` are what each rank's Auto will see (nocb is
    not allowed with an explicit cache capacity or trimming), so the predicted costs match its plan.
    ``max_new_tokens``: one budget, or one per request.
    """
    check_pricing(geometry, costs)
    lengths = _validate(lengths, world_size, costs, method)
    budgets = budgets_of(max_new_tokens, len(lengths))
    if method == "round_robin":
        return round_robin_shards(len(lengths), world_size)
    if method == "karmarkar_karp":
        return karmarkar_karp_shards(lengths, world_size)
    cost = RankCost(geometry, costs, min_budget=min(budgets, default=1),
                    continuous_batch_size=continuous_batch_size, nocb_allowed=nocb_allowed)
    return balanced_shards(list(zip(lengths, budgets)), world_size, cost)


def predicted_rank_costs(
    shards: Sequence[Sequence[int]],
    lengths: Sequence[int],
    geometry: ModelGeometry,
    costs: CostCoefficients,
    *,
    max_new_tokens: int | Sequence[int] = 16,
    continuous_batch_size: int | None = None,
    nocb_allowed: bool = True,
) -> list[float]:
    """Each rank's predicted Auto cost in ms (0 for an empty rank)."""
    lengths = validate_lengths(lengths, costs)
    budgets = budgets_of(max_new_tokens, len(lengths))
    check_partition(shards, len(lengths))
    cost = RankCost(geometry, costs, min_budget=min(budgets, default=1),
                    continuous_batch_size=continuous_batch_size, nocb_allowed=nocb_allowed)
    items = list(zip(lengths, budgets))
    return [cost(_key(shard, items)) for shard in shards]


def predicted_makespan(
    shards: Sequence[Sequence[int]],
    lengths: Sequence[int],
    geometry: ModelGeometry,
    costs: CostCoefficients,
    *,
    max_new_tokens: int | Sequence[int] = 16,
    continuous_batch_size: int | None = None,
    nocb_allowed: bool = True,
) -> float:
    """The slowest rank's predicted cost in ms (0 for no requests)."""
    return max(predicted_rank_costs(
        shards, lengths, geometry, costs, max_new_tokens=max_new_tokens,
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


def _validate(lengths, world_size, costs, method) -> list[int]:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if method not in METHODS:
        raise ValueError(f"unknown sharding method {method!r}; valid methods: {', '.join(METHODS)}")
    return validate_lengths(lengths, costs)

# -- a rank's predicted cost -----------------------------------------------------------------------

class RankCost:
    """Memoised predicted cost of one rank's prompts, given as a sorted tuple of (length, budget)
    items, with cheap bounds; ``min_budget`` (the smallest budget of any request) bounds decode."""

    def __init__(
        self, geometry: ModelGeometry, costs: CostCoefficients, *, continuous_batch_size: int | None,
        nocb_allowed: bool = True, min_budget: int = 1,
    ) -> None:
        self.geometry, self.costs = geometry, costs
        self.nocb_allowed, self.continuous_batch_size = nocb_allowed, continuous_batch_size
        self.decode_ms = cb_decode_cost_ms(min_budget, costs)
        self._memo: dict[tuple[Item, ...], float] = {}
        self._row: dict[int, float] = {}
        self._row_nokv: dict[int, float] = {}
        self.num_evaluations = 0
        self.num_rows_evaluated = 0

    def __call__(self, sorted_items: tuple[Item, ...]) -> float:
        cost = self._memo.get(sorted_items)
        if cost is None:
            cost = self._exact(sorted_items)
            self._memo[sorted_items] = cost
        return cost

    def _exact(self, items: tuple[Item, ...]) -> float:
        if not items:
            return 0.0
        self.num_evaluations += 1
        self.num_rows_evaluated += len(items)
        plan = choose_route(
            [length for length, _ in items], max_new_tokens=[budget for _, budget in items],
            continuous_batch_size=self.continuous_batch_size, geometry=self.geometry,
            costs=self.costs, nocb_allowed=self.nocb_allowed,
        )
        return plan.nocb_cost_ms if plan.route == "nocb" else plan.cb_cost_ms

    def is_known(self, sorted_items: tuple[Item, ...]) -> bool:
        return sorted_items in self._memo

    def row(self, item: Item) -> float:
        """The prefill row cost of an item's length."""
        length = item[0]
        if length not in self._row:
            self._row[length] = per_row_cost_ms(length, self.geometry, self.costs)
        return self._row[length]

    def row_nokv(self, item: Item) -> float:
        length = item[0]
        if length not in self._row_nokv:
            self._row_nokv[length] = per_row_cost_ms(
                length, self.geometry, self.costs, include_kv=False
            )
        return self._row_nokv[length]

    def lower_bound(self, count: int, longest: Item, row_sum: float) -> float:
        """A bound <= the exact cost from the count, the longest item and the sum of row costs."""
        if count == 0:
            return 0.0
        cb = self.costs.prefill_fixed_cost_ms + self.decode_ms + row_sum
        if self._nocb_eligible(count, longest[0]):
            return min(cb, self.costs.prefill_fixed_cost_ms + count * self.row_nokv(longest))
        return cb

    def _nocb_eligible(self, count: int, max_length: int) -> bool:
        limit, slots = self.costs.prefill_max_tokens, self.continuous_batch_size
        return (
            self.nocb_allowed
            and (slots is None or count <= slots)
            and (limit is None or count * max_length <= limit)
        )

# -- the baselines ---------------------------------------------------------------------------------

VERL_LINEAR_WORKLOAD = 24576  # verl's calculate_workload: 24576 * L + L^2 (7B, hidden 4096)


def round_robin_shards(num_requests: int, world_size: int) -> list[list[int]]:
    return [list(range(rank, num_requests, world_size)) for rank in range(world_size)]


def verl_workload(length: int) -> int:
    return length * length + VERL_LINEAR_WORKLOAD * length


def karmarkar_karp_shards(
    lengths: Sequence[int], world_size: int, workload: Callable[[int], float] = verl_workload
) -> list[list[int]]:
    """Largest differencing with equal counts: groups of world_size consecutive sorted items each
    start as a k-way partial partition; the two with the largest spread merge, heaviest set with
    lightest, until one partition is left. Ranks in order of decreasing workload."""
    k, n = world_size, len(lengths)
    pad = (-n) % k
    items = [(0, -1 - p) for p in range(pad)]  # zero-weight placeholders, dropped at the end
    items += sorted((workload(length), i) for i, length in enumerate(lengths))
    heap = []
    for start in range(0, len(items), k):
        sets = sorted(((w, [i]) for w, i in items[start:start + k]), reverse=True)
        heapq.heappush(heap, _kk_entry(sets, start))
    while len(heap) > 1:
        *_, a = heapq.heappop(heap)
        *_, b = heapq.heappop(heap)
        merged = [(wa + wb, ia + ib) for (wa, ia), (wb, ib) in zip(a, reversed(b))]
        merged.sort(reverse=True)
        heapq.heappush(heap, _kk_entry(merged, min(min(i) for _, i in merged if i)))
    if not heap:
        return [[] for _ in range(k)]
    return [sorted(i for i in ids if i >= 0) for _, ids in heap[0][-1]]


def _kk_entry(sets, tie):
    # heapq pops the smallest: largest spread first, then the heaviest set, then a stable id
    return (-(sets[0][0] - sets[-1][0]), -sets[0][0], tie, sets)

# -- the balanced search ---------------------------------------------------------------------------

_REL_EPS = 1e-9  # an improvement must beat float noise by this relative margin
_BISECTION_STEPS = 40
_MAX_SEARCH_STEPS = 2000  # accepted local-search moves
# Local search prices at most this many prompt rows exactly (about 2 us each in choose_route):
# a deterministic cap on runtime. The contiguous seed is usually a local optimum already.
_SEARCH_ROW_BUDGET = 40_000


def balanced_shards(items: list[Item], world_size: int, cost: RankCost) -> list[list[int]]:
    """The balanced split of requests given as (length, budget) items."""
    n = len(items)
    if world_size == 1 or n == 0:
        return [list(range(n))] + [[] for _ in range(world_size - 1)]
    order = sorted(range(n), key=lambda i: (items[i], i))
    best = _LocalSearch(contiguous_shards(items, order, world_size, cost), items, cost).run()
    best_makespan = max(cost(_key(s, items)) for s in best)
    seeds = (round_robin_shards(n, world_size), karmarkar_karp_shards([length for length, _ in items], world_size))
    for seed in seeds:
        if max(cost(_key(s, items)) for s in seed) < best_makespan:
            polished = _LocalSearch(seed, items, cost).run()
            makespan = max(cost(_key(s, items)) for s in polished)
            if makespan < best_makespan:
                best, best_makespan = polished, makespan
    return [sorted(shard) for shard in best]


def _key(shard: Sequence[int], items: Sequence[Item]) -> tuple[Item, ...]:
    return tuple(sorted(items[i] for i in shard))


def contiguous_shards(
    items: Sequence[Item], order: list[int], world_size: int, cost: RankCost
) -> list[list[int]]:
    """The best split of ``order`` into world_size contiguous ranges, to bisection precision."""
    widths = [items[i] for i in order]
    n = len(widths)
    prefix = [0.0]
    for w in widths:
        prefix.append(prefix[-1] + cost.row(w))

    def range_cost(i: int, j: int) -> float:
        return cost(tuple(widths[i:j]))

    def fits(i: int, j: int, limit: float) -> bool:
        if cost.lower_bound(j - i, widths[j - 1], prefix[j] - prefix[i]) > limit:
            return False
        return range_cost(i, j) <= limit

    def split(limit: float) -> list[int] | None:
        """Cut points when each rank greedily takes its longest fitting range, else None."""
        cuts, start = [0], 0
        for _ in range(world_size):
            if start == n:
                break
            lo, hi = start, n  # fits(start, lo + 1) may fail; the largest fitting end is in [lo, hi]
            guess = min(n, start + max(1, (n - start) // (world_size - len(cuts) + 1)))
            if fits(start, guess, limit):
                lo = guess
            else:
                hi = guess - 1
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if fits(start, mid, limit):
                    lo = mid
                else:
                    hi = mid - 1
            if lo == start:
                return None
            cuts.append(lo)
            start = lo
        return cuts if start == n else None

    low = max(cost((w,)) for w in set(widths))  # every prompt sits on some rank
    high = range_cost(0, n)
    best = split(high)
    for _ in range(_BISECTION_STEPS):
        if high - low <= _REL_EPS * high:
            break
        mid = 0.5 * (low + high)
        cuts = split(mid)
        if cuts is None:
            low = mid
        else:
            high = max(range_cost(i, j) for i, j in zip(cuts, cuts[1:]))
            best = cuts
    shards = [order[i:j] for i, j in zip(best, best[1:])]
    return shards + [[] for _ in range(world_size - len(shards))]


class _BudgetSpent(Exception):
    pass


class _LocalSearch:
    """Move or swap prompts off an expensive rank onto a cheaper one while that strictly lowers
    the maximum of the two ranks involved; the sorted cost vector falls lexicographically, so it
    terminates. The most expensive rank is tried first."""

    def __init__(self, shards: list[list[int]], items: list[Item], cost: RankCost) -> None:
        self.cost = cost
        # per rank: its (length, budget) items sorted, and for each item the indices holding it
        self.sorted_lengths = [sorted(items[i] for i in s) for s in shards]
        self.members: list[dict[Item, list[int]]] = []
        for shard in shards:
            by_item: dict[Item, list[int]] = {}
            for i in sorted(shard):
                by_item.setdefault(items[i], []).append(i)
            self.members.append(by_item)
        self.row_sums = [sum(cost.row(w) for w in s) for s in self.sorted_lengths]
        self.costs = [cost(tuple(s)) for s in self.sorted_lengths]

    def run(self) -> list[list[int]]:
        self.row_limit = self.cost.num_rows_evaluated + _SEARCH_ROW_BUDGET
        try:
            for _ in range(_MAX_SEARCH_STEPS):
                # the most expensive rank first; once it is stuck, the next ones (so ranks off
                # the critical path are balanced too, e.g. when one long prompt fixes the makespan)
                ranks = sorted(range(len(self.costs)), key=lambda r: (-self.costs[r], r))
                if not any(self._try_moves(r) or self._try_swaps(r) for r in ranks):
                    break
        except _BudgetSpent:
            pass
        return [sorted(i for ids in m.values() for i in ids) for m in self.members]

    def _others(self, top: int) -> list[int]:
        target = self.costs[top] * (1 - _REL_EPS)
        ranks = [r for r in range(len(self.costs)) if r != top and self.costs[r] < target]
        return sorted(ranks, key=lambda r: (self.costs[r], r))

    def _candidate(self, rank: int, remove: Item | None, add: Item | None) -> tuple[int, Item, float]:
        """(count, longest item, row-cost sum) of ``rank`` after removing/adding one item."""
        lens = self.sorted_lengths[rank]
        count, row_sum = len(lens), self.row_sums[rank]
        longest = lens[-1] if lens else (0, 0)
        if remove is not None:
            count, row_sum = count - 1, row_sum - self.cost.row(remove)
            if remove == longest and (len(lens) < 2 or lens[-2] != longest):
                longest = lens[-2] if len(lens) >= 2 else (0, 0)
        if add is not None:
            count, row_sum, longest = count + 1, row_sum + self.cost.row(add), max(longest, add)
        return count, longest, row_sum

    def _price(self, rank: int, remove: Item | None, add: Item | None, limit: float) -> float | None:
        """The exact new cost of ``rank`` if it is below ``limit``, else None."""
        if self.cost.lower_bound(*self._candidate(rank, remove, add)) >= limit:
            return None
        # adding a row of length L costs at least its nocb row cost (see the module docstring)
        if remove is None and add is not None and self.costs[rank] + self.cost.row_nokv(add) >= limit:
            return None
        lens = list(self.sorted_lengths[rank])
        if remove is not None:
            lens.pop(bisect.bisect_left(lens, remove))
        if add is not None:
            bisect.insort(lens, add)
        key = tuple(lens)
        if not self.cost.is_known(key) and self.cost.num_rows_evaluated >= self.row_limit:
            raise _BudgetSpent
        new = self.cost(key)
        return new if new < limit else None


    def _try_moves(self, top: int) -> bool:
        limit = self.costs[top] * (1 - _REL_EPS)
        for other in self._others(top):
            for length in sorted(self.members[top], reverse=True):
                if self._try_exchange(top, other, length, None, limit):
                    return True
        return False

    def _try_swaps(self, top: int) -> bool:
        limit = self.costs[top] * (1 - _REL_EPS)
        for other in self._others(top):
            for give in sorted(self.members[top], reverse=True):
                # a rank's cost never falls when a prompt gets longer: only shorter ones come back
                # (with budgets, items order by length then budget: a heuristic cut, not a proof)
                for take in sorted(self.members[other]):
                    if take >= give:
                        break
                    if self._try_exchange(top, other, give, take, limit):
                        return True
        return False

    def _try_exchange(self, top: int, other: int, give: Item, take: Item | None, limit: float) -> bool:
        """Give a prompt ``give`` (its item) from ``top`` to ``other`` (and take one ``take`` back,
        unless None) when both ranks' new costs are below ``limit``."""
        new_other = self._price(other, take, give, limit)
        if new_other is None:
            return False
        new_top = self._price(top, give, take, limit)
        if new_top is None:
            return False
        self._apply(top, other, give, take, new_top, new_other)
        return True

    def _apply(self, top, other, give, take, new_top, new_other) -> None:
        self._transfer(top, other, give)
        if take is not None:
            self._transfer(other, top, take)
        self.costs[top], self.costs[other] = new_top, new_other

    def _transfer(self, src: int, dst: int, length: Item) -> None:
        ids = self.members[src][length]
        index = ids.pop()  # the largest index of that length: deterministic
        if not ids:
            del self.members[src][length]
        bisect.insort(self.members[dst].setdefault(length, []), index)
        self.sorted_lengths[src].pop(bisect.bisect_left(self.sorted_lengths[src], length))
        bisect.insort(self.sorted_lengths[dst], length)
        self.row_sums[src] -= self.cost.row(length)
        self.row_sums[dst] += self.cost.row(length)
