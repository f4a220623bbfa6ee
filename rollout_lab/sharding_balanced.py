"""The ``balanced`` sharding search: a contiguous split, then local search on the exact costs.

(1) The best split of the length-sorted order into contiguous ranges (bisection on the makespan,
each rank greedily taking the longest range that fits: exact for contiguous splits since a rank's
cost only grows when a prompt is added); (2) local search that moves one prompt, or swaps two,
off the most expensive rank while that strictly lowers the pair's maximum, every candidate priced
exactly by ``choose_route`` (through ``RankCost``), within a fixed budget of priced rows.
Adding a prompt of length L raises a rank's cost by at least L's nocb row cost (nocb pays a row at
a width >= L; the DP's plan minus that row is a plan for the rest, cheaper by >= its row cost),
which prunes most candidates without a DP. Round-robin and Karmarkar-Karp are also polished the
same way when they start out better, so ``balanced`` is never worse than either.

Pure Python (no torch), deterministic, no I/O.
"""
from __future__ import annotations

import bisect
from typing import Sequence

from rollout_lab.sharding_baselines import karmarkar_karp_shards, round_robin_shards
from rollout_lab.sharding_cost import RankCost

_REL_EPS = 1e-9  # an improvement must beat float noise by this relative margin
_BISECTION_STEPS = 40
_MAX_SEARCH_STEPS = 2000  # accepted local-search moves
# Local search prices at most this many prompt rows exactly (about 2 us each in choose_route):
# a deterministic cap on runtime. The contiguous seed is usually a local optimum already.
_SEARCH_ROW_BUDGET = 40_000


def balanced_shards(lengths: list[int], world_size: int, cost: RankCost) -> list[list[int]]:
    n = len(lengths)
    if world_size == 1 or n == 0:
        return [list(range(n))] + [[] for _ in range(world_size - 1)]
    order = sorted(range(n), key=lambda i: (lengths[i], i))
    best = _LocalSearch(contiguous_shards(lengths, order, world_size, cost), lengths, cost).run()
    best_makespan = max(cost(_key(s, lengths)) for s in best)
    for seed in (round_robin_shards(n, world_size), karmarkar_karp_shards(lengths, world_size)):
        if max(cost(_key(s, lengths)) for s in seed) < best_makespan:
            polished = _LocalSearch(seed, lengths, cost).run()
            makespan = max(cost(_key(s, lengths)) for s in polished)
            if makespan < best_makespan:
                best, best_makespan = polished, makespan
    return [sorted(shard) for shard in best]


def _key(shard: Sequence[int], lengths: Sequence[int]) -> tuple[int, ...]:
    return tuple(sorted(lengths[i] for i in shard))


def contiguous_shards(
    lengths: Sequence[int], order: list[int], world_size: int, cost: RankCost
) -> list[list[int]]:
    """The best split of ``order`` into world_size contiguous ranges, to bisection precision."""
    widths = [lengths[i] for i in order]
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

    def __init__(self, shards: list[list[int]], lengths: list[int], cost: RankCost) -> None:
        self.lengths, self.cost = lengths, cost
        # per rank: lengths sorted, and for each length the indices holding it
        self.sorted_lengths = [sorted(lengths[i] for i in s) for s in shards]
        self.members: list[dict[int, list[int]]] = []
        for shard in shards:
            by_length: dict[int, list[int]] = {}
            for i in sorted(shard):
                by_length.setdefault(lengths[i], []).append(i)
            self.members.append(by_length)
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

    def _candidate(self, rank: int, remove: int | None, add: int | None) -> tuple[int, int, float]:
        """(count, longest, row-cost sum) of ``rank`` after removing/adding one length."""
        lens = self.sorted_lengths[rank]
        count, row_sum = len(lens), self.row_sums[rank]
        longest = lens[-1] if lens else 0
        if remove is not None:
            count, row_sum = count - 1, row_sum - self.cost.row(remove)
            if remove == longest and (len(lens) < 2 or lens[-2] != longest):
                longest = lens[-2] if len(lens) >= 2 else 0
        if add is not None:
            count, row_sum, longest = count + 1, row_sum + self.cost.row(add), max(longest, add)
        return count, longest, row_sum

    def _price(self, rank: int, remove: int | None, add: int | None, limit: float) -> float | None:
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
                for take in sorted(self.members[other]):
                    if take >= give:
                        break
                    if self._try_exchange(top, other, give, take, limit):
                        return True
        return False

    def _try_exchange(self, top: int, other: int, give: int, take: int | None, limit: float) -> bool:
        """Give a prompt of length ``give`` from ``top`` to ``other`` (and take one of length
        ``take`` back, unless None) when both ranks' new costs are below ``limit``."""
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

    def _transfer(self, src: int, dst: int, length: int) -> None:
        ids = self.members[src][length]
        index = ids.pop()  # the largest index of that length: deterministic
        if not ids:
            del self.members[src][length]
        bisect.insort(self.members[dst].setdefault(length, []), index)
        self.sorted_lengths[src].pop(bisect.bisect_left(self.sorted_lengths[src], length))
        bisect.insort(self.sorted_lengths[dst], length)
        self.row_sums[src] -= self.cost.row(length)
        self.row_sums[dst] += self.cost.row(length)
