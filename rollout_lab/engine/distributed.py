"""Data-parallel rollout over torch.distributed: shard the prompts by predicted cost, run Auto on
each rank, gather the responses in the original order.

Every rank is given the same prompts and computes the same sharding (``planner.sharding``,
pure and deterministic); an all-gather of a hash of the inputs and of the shards checks that.
gloo on CPU, NCCL on GPUs (set the CUDA device before the process group is made)::

    # torchrun --nproc_per_node 2 scripts/dp_rollout.py ...   (or launch(fn, 2) in tests)
    result = distributed_generate(model, prompts, max_new_tokens=16, config=RolloutConfig())
    result.sequences, result.shards, result.rank_times_s, result.predicted_rank_costs_ms

"""
from __future__ import annotations

import hashlib
import json
import os
import socket
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rollout_lab.engine.api.config import RolloutConfig
from rollout_lab.engine.api.call import prompt_lists
from rollout_lab.engine.profile import synchronize
from rollout_lab.engine.api.rollout import Rollout
from rollout_lab.planner.checks import budgets_of
from rollout_lab.planner.sharding import predicted_rank_costs, shard_requests


@dataclass(frozen=True)
class DistributedResult:
    """Every rank holds the same result: responses in input order, and per-rank facts by rank."""

    sequences: list[list[int]]
    shards: list[list[int]]  # request indices per rank
    routes: list[str]  # each rank's Auto route ("bucketed" for an empty rank)
    rank_times_s: list[float]  # each rank's own generate, from a common barrier, device-synchronised
    predicted_rank_costs_ms: list[float]
    method: str
    wall_s: float  # this rank's whole call: sharding, checks, generate, gather

    @property
    def makespan_s(self) -> float:
        """Measured: the slowest rank's generate."""
        return max(self.rank_times_s)

    @property
    def predicted_makespan_ms(self) -> float:
        return max(self.predicted_rank_costs_ms)


def distributed_generate(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int | Sequence[int],
    config: RolloutConfig | None = None,
    group: Any = None,
    method: str = "balanced",
) -> DistributedResult:
    """Run ``Rollout(model, config)`` on this rank's shard of ``prompts``; gather on every rank.

    Collective: every rank of ``group`` (default: the world) must call it with the same prompts,
    ``max_new_tokens`` (one, or one per request), config and method. The shards are costed as
    Auto would plan them, with each request's budget.
    """
    start = time.perf_counter()
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("distributed_generate needs an initialised torch.distributed process group")
    config = config if config is not None else RolloutConfig()
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    rollout = Rollout(model, config)
    prompts = prompt_lists(prompts)  # the checks of generate: integer ids only, named by request
    lengths = [len(p) for p in prompts]
    budgets = budgets_of(max_new_tokens, len(prompts))
    cost_args = dict(
        max_new_tokens=budgets, continuous_batch_size=config.continuous_batch_size,
        nocb_allowed=config.cache_capacity is None and not config.trim_cache,
    )
    shards = shard_requests(lengths, world_size, rollout.geometry, rollout.costs, method=method,
                            **cost_args)
    _check_same_everywhere(prompts, shards, method, budgets, group, world_size)
    mine = shards[rank]

    device = rollout.device
    synchronize(device)
    dist.barrier(group)
    begin = time.perf_counter()
    result = rollout.generate([prompts[i] for i in mine], max_new_tokens=[budgets[i] for i in mine])
    synchronize(device)
    elapsed_s = time.perf_counter() - begin

    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, (rank, result.sequences, result.route, elapsed_s), group=group)
    sequences: list[list[int] | None] = [None] * len(prompts)
    routes, times = [""] * world_size, [0.0] * world_size
    for r, rank_sequences, route, seconds in gathered:
        for index, sequence in zip(shards[r], rank_sequences):
            sequences[index] = sequence
        routes[r], times[r] = route, seconds
    if any(s is None for s in sequences):
        missing = [i for i, s in enumerate(sequences) if s is None]
        raise RuntimeError(f"requests {missing[:10]} came back from no rank")
    predicted = predicted_rank_costs(shards, lengths, rollout.geometry, rollout.costs, **cost_args)
    return DistributedResult(
        sequences, shards, routes, times, predicted, method, time.perf_counter() - start
    )


def _check_same_everywhere(prompts, shards, method, max_new_tokens, group, world_size) -> None:
    """Every rank must have had the same inputs and computed the same shards."""
    inputs = _digest([prompts, method, max_new_tokens])
    split = _digest(shards)
    digests: list[Any] = [None] * world_size
    dist.all_gather_object(digests, (inputs, split), group=group)
    if len({d[0] for d in digests}) > 1:
        raise RuntimeError(
            "ranks were given different prompts, method or max_new_tokens: input digests "
            f"by rank {[d[0][:12] for d in digests]}"
        )
    if len({d[1] for d in digests}) > 1:
        raise RuntimeError(
            f"ranks computed different shardings from the same inputs: {[d[1][:12] for d in digests]}"
        )


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, separators=(",", ":")).encode()).hexdigest()


# ---------------------------------------------------------------- launching

def launch(
    fn: Callable[..., Any],
    world_size: int,
    backend: str = "gloo",
    *,
    args: Sequence[Any] = (),
    num_threads: int | None = 1,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` spawned processes that share an
    initialised process group on a free local port; return each rank's return value, by rank.

    ``fn`` and its return value must be picklable (a module-level function). ``num_threads``
    caps torch's intra-op threads per process (1 keeps several CPU ranks from oversubscribing).
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    results = mp.get_context("spawn").SimpleQueue()
    port = _free_port()
    context = mp.start_processes(
        _worker, args=(fn, world_size, backend, port, tuple(args), num_threads, results),
        nprocs=world_size, join=False, start_method="spawn",
    )
    out: list[Any] = [None] * world_size
    received = 0
    # read while the workers run (a big return value would block a worker's put on a full pipe);
    # join() raises, and stops the others, as soon as one worker fails
    while received < world_size:
        if results.empty():
            if context.join(timeout=0.05) and results.empty():
                raise RuntimeError("every worker exited but not all of them returned a value")
            continue
        rank, value = results.get()
        out[rank] = value
        received += 1
    while not context.join():
        pass
    return out


def _worker(rank, fn, world_size, backend, port, args, num_threads, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world_size)
    try:
        value = fn(rank, world_size, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    results.put((rank, value))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
