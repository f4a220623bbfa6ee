"""How much KV cache a call gets: the device memory it may take, the paged pool's blocks and slots,
and the aligned cache's columns. One module decides every size, before any cache is allocated.

    budget = kv_budget_bytes(device, num_slots=64, gpu_memory_fraction=0.9, vocab_size=151936)
    layout = paged_layout(lengths, budgets, bursts=8, block_size=64, kv_bytes_per_token=..., budget_bytes=...)
    columns = aligned_capacity(lengths, budgets, cache_capacity=None, route="bucketed")

"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from rollout_lab.planner.occupancy import blocks_for, simulate_refill

MAX_PAGED_SLOTS = 1024  # the paged route's slots when the pool alone would choose more
PAGED_RESERVE_FRACTION = 0.05  # of the device's memory, kept out of the KV cache for activations


def kv_budget_bytes(device: torch.device, *, num_slots: int, gpu_memory_fraction: float, vocab_size: int,
                    free_extra_bytes: float = 0.0, reserve_extra_bytes: float = 0.0) -> float | None:
    """The bytes of KV cache a call on ``num_slots`` slots may allocate: on CUDA
    ``gpu_memory_fraction`` of the device, less what is allocated now (of which
    ``free_extra_bytes``, a kept cache the call replaces, counts as free) and a reserve for
    activations and logits (``PAGED_RESERVE_FRACTION`` of the device, plus 16 bytes x vocab per slot,
    plus ``reserve_extra_bytes``: what the runner will still allocate). None elsewhere (no bound)."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    free += free_extra_bytes
    reserve = PAGED_RESERVE_FRACTION * total + 16 * vocab_size * num_slots + reserve_extra_bytes
    return gpu_memory_fraction * total - (total - free) - reserve


@dataclass(frozen=True)
class PagedLayout:
    """A paged call's slots, the blocks of its pool (the scratch block included) and the blocks the
    pool may grow to."""

    num_slots: int
    num_blocks: int
    max_blocks: int


def paged_layout(lengths: Sequence[int], budgets: Sequence[int], *, bursts: int = 1, block_size: int,
                 kv_bytes_per_token: int, budget_bytes: Callable[[int], float | None],
                 kv_cache_tokens: int | None = None, num_slots: int | None = None,
                 refill_rows: Callable[[int], int], budget_name: str = "the memory budget",
                 groups: Sequence[int] | None = None) -> PagedLayout:
    """The layout of a paged call over rows of ``lengths`` and ``budgets``; ``groups``: each row's
    prompt group when the samples of a prompt share its full blocks (``share_prompt_blocks``), which
    every count below then takes once per group (None: every row holds its own).

    The pool: ``kv_cache_tokens`` when set; else what every row could use at once (its prompt and
    budget), no more than ``budget_bytes(slots)`` allows (None: no bound; ``budget_name`` names it
    in errors). The slots: ``num_slots``
    (``continuous_batch_size``), else as many rows as the pool holds at their worst case (at most
    ``MAX_PAGED_SLOTS``). A pool that cannot hold the longest row is a ValueError naming it.

    Without ``kv_cache_tokens`` the pool is then cut to what the call's rows can hold at once on
    those slots: the peak of blocks in ``simulate_refill``'s replay with every row running to its
    budget (bursts of at most ``bursts`` steps, as the engine reserves them), plus one block per slot
    (the admission watermark). Rows rarely run to their budgets all at once, so the pool follows the
    live tokens rather than every row's prompt and budget; where refill lets a longer prompt in
    sooner, preemption covers it. The pool may grow (``ModelRunner.stepper_for``) up to the uncut
    size (``max_blocks``)."""
    row_blocks = [blocks_for(n + b, block_size) for n, b in zip(lengths, budgets)]
    held = sum(row_blocks)  # every row at once
    if groups is not None:  # a group's later rows read its first row's full prompt blocks
        seen: set[int] = set()
        for n, group in zip(lengths, groups):
            held -= n // block_size if group in seen else 0
            seen.add(group)
    wanted = held + 1  # + the scratch block
    block_bytes = block_size * kv_bytes_per_token
    allowed = None if kv_cache_tokens is not None else budget_bytes(min(len(lengths), num_slots or MAX_PAGED_SLOTS))
    if kv_cache_tokens is not None:
        pool, source = blocks_for(kv_cache_tokens, block_size) + 1, f"kv_cache_tokens={kv_cache_tokens}"
    elif allowed is not None:
        pool = min(wanted, max(0, int(allowed // block_bytes)))
        source = f"{budget_name} ({allowed / 2**30:.1f} GiB for KV)"
    else:
        pool, source = wanted, "every row at once"
    longest = max(row_blocks)
    if pool - 1 < longest:
        row = row_blocks.index(longest)
        raise ValueError(f"the paged pool ({source}) holds {max(0, pool - 1) * block_size} tokens, fewer than "
                         f"row {row} needs ({lengths[row]} prompt + {budgets[row]} new tokens, in blocks of "
                         f"{block_size}): raise kv_cache_tokens or gpu_memory_fraction")
    slots = num_slots or max(1, min(MAX_PAGED_SLOTS, (pool - 1) * len(row_blocks) // held))
    slots = min(slots, len(lengths))
    uncut = pool
    if kv_cache_tokens is None:
        worst = simulate_refill(lengths, budgets, budgets, num_slots=slots, layout="paged", block_size=block_size,
                                refill_rows=refill_rows(slots), read_interval=max(1, bursts), groups=groups)
        pool = min(pool, max(worst.peak_blocks + slots, longest) + 1)  # + the scratch block
    return PagedLayout(slots, pool, uncut)


def aligned_capacity(lengths: Sequence[int], budgets: Sequence[int], *, cache_capacity: int | None,
                     route: str) -> int:
    """The aligned cache's columns: ``cache_capacity`` when given (a ValueError naming the request it
    cannot hold), else the longest prompt plus the largest budget."""
    if cache_capacity is None:
        return max(lengths) + max(budgets)
    # a single request needs its prompt and budget (the last token is never written back)
    needs = [length + budget - 1 for length, budget in zip(lengths, budgets)]
    needed = max(needs)
    if route != "nocb" and cache_capacity < needed:
        index = needs.index(needed)
        raise ValueError(
            f"cache_capacity={cache_capacity} is too small for request {index} (prompt {lengths[index]} "
            f"+ max_new_tokens {budgets[index]}); it needs at least {needed} columns, "
            "and trimming cannot free columns a single request needs"
        )
    return cache_capacity
