"""The sharding baselines that ``balanced`` is compared with (and polishes when they start better).

- ``round_robin_shards``: prompt i goes to rank i % world_size.
- ``karmarkar_karp_shards``: verl's ``get_seqlen_balanced_partitions(..., equal_size=True)``:
  largest differencing on the workload proxy ``L^2 + 24576 L`` (``verl_workload``), equal counts
  per rank (counts differ by at most one when world_size does not divide n: zero-weight
  placeholders fill the last group).

Pure Python, deterministic, no I/O.
"""
from __future__ import annotations

import heapq
from typing import Callable, Sequence

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
