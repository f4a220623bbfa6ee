"""The rollout profile: device-synchronised phase times and the counts that explain them.

Device-synchronised wall-clock timing of one call: the one helper calibration, sweeps, the
data-parallel rollout and the benchmark scripts share.

    ms, out = timed_ms(lambda: rollout.generate(prompts, max_new_tokens=16), device)

torch is imported only when a call runs, so the CLI modules that use this stay torch-free at import.

"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterator

import torch


@dataclass
class Profile:
    """Times in ms (device-synchronised); counts of one ``generate`` call.

    ``moved_bytes`` counts every KV byte the cache moved: trims, right shifts and compaction.
    ``peak_cache_columns`` is the highest front column reached (+1 per decode step past it);
    ``cache_bytes`` the KV memory allocated for the call. ``num_prefill_rows`` counts the rows
    actually prefilled (one per unique prompt per admission with shared prefill) and
    ``num_replicated_rows`` the rows whose KV was copied from such a row instead.
    ``forwards`` (only when profiling or recalibrating online) lists every prefill forward
    (``kind`` prefill/chunk/nocb_prefill/packed_prefill, ``batch``, ``width``, ``ms``; a chunk also
    ``offset``; a packed forward's ``width`` is its tokens, and the online refit skips it)
    and decode burst (``kind`` decode/nocb_decode, ``rows``, ``steps``, ``ms``), for the online refit (``planner.fit``).
    """

    planning_ms: float = 0.0
    prefill_ms: float = 0.0
    decode_ms: float = 0.0
    cache_ms: float = 0.0
    stepper_build_ms: float = 0.0  # a new decode stepper: cache, compile and capture (first call of a shape)
    total_ms: float = 0.0
    num_prefill_forwards: int = 0
    num_decode_forwards: int = 0
    num_generated_tokens: int = 0
    num_trims: int = 0
    trimmed_columns: int = 0
    moved_bytes: int = 0
    peak_cache_columns: int = 0
    cache_bytes: int = 0
    num_prefill_rows: int = 0
    num_replicated_rows: int = 0
    # occupancy: live rows summed over decode steps, of num_slots per step (decode_row_steps /
    # (num_decode_forwards * num_slots)); a row that ended at EOS inside an eos_check_interval is
    # not live for the interval's later steps (they compute for it, not its tokens); the paged route adds its pool: blocks of kv_block_size
    # tokens, the most in use, the most tokens its live rows held, and the rows it preempted
    num_slots: int = 0
    decode_row_steps: int = 0
    queued_decode_steps: int = 0  # the steps taken while rows waited in the queue, and their live rows
    queued_row_steps: int = 0
    kv_block_size: int | None = None
    num_kv_blocks: int = 0
    peak_kv_blocks: int = 0
    peak_live_tokens: int = 0
    num_preemptions: int = 0
    # shared prompt blocks (RolloutConfig.share_prompt_blocks): the most blocks read by more than one
    # row at once, and the most tokens the live rows held in distinct blocks (a shared block once;
    # peak_live_tokens counts it once per reader)
    shared_kv_blocks: int = 0
    unique_kv_tokens: int = 0
    # the KV bytes the decode's attention read per step, keys and values over every layer (the paged
    # route; planner.kv_reads: each row its context, or a group's shared prefix once per tile of its
    # rows with the shared-prefix read); None on the other routes
    kv_bytes_read_per_step: float | None = None
    # the prefix cache across calls (RolloutConfig.prefix_cache): prompt tokens read from cached blocks
    # instead of prefilled, idle cached blocks taken back for rows' blocks, and why the cached blocks
    # of earlier calls were dropped at this call's start: "weights" (they changed), "pool" (this call
    # needed a pool of another layout); None: kept (or none)
    prefix_cache_hits: int = 0
    prefix_cache_evicted_blocks: int = 0
    prefix_cache_dropped: str | None = None
    # the most prompt tokens one admission turn prefilled while rows were live (the paged route): the
    # longest stall of the live rows between two decode steps, in tokens (admit_tokens_per_step bounds it)
    max_turn_prefill_tokens: int = 0
    # partial rollouts (generate's finish_fraction, continuations): the rows this call continued from
    # an earlier one and the tokens they brought (prefilled again with their prompts), and the rows
    # it returned unfinished
    num_continued_rows: int = 0
    num_continued_tokens: int = 0
    num_unfinished_rows: int = 0
    # episodes (generate(env=...), sched.episodes): the environment's tokens appended, its calls, the
    # tokens before an answer that a resuming row prefilled again (its history's KV was written
    # before it left and no cached block held it: its partial last block, or blocks taken back), and
    # the answers' tokens fed through decode steps (forced inputs; the others were prefilled)
    env_tokens: int = 0
    num_env_calls: int = 0
    prefilled_history_tokens: int = 0
    env_tokens_decoded: int = 0
    prefill_backend: str | None = None  # "padded"/"graph" (bucketed), "segments"/"masked" (packed), "hf_padded" (nocb)
    forwards: list[dict[str, Any]] | None = None

    @property
    def live_rows_per_step(self) -> float:
        """Mean live rows of a decode step (0 without one)."""
        return self.decode_row_steps / self.num_decode_forwards if self.num_decode_forwards else 0.0

    @property
    def occupancy(self) -> float:
        """Mean share of the slots a decode step ran live rows in (0 without one)."""
        return self.live_rows_per_step / self.num_slots if self.num_slots else 0.0

    @property
    def queued_occupancy(self) -> float:
        """The occupancy of the steps taken while rows waited (until the queue drained)."""
        steps = self.queued_decode_steps * self.num_slots
        return self.queued_row_steps / steps if steps else 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"live_rows_per_step": self.live_rows_per_step, "occupancy": self.occupancy,
                               "queued_occupancy": self.queued_occupancy}


class Timer:
    """Adds wall-clock ms to ``Profile`` fields; synchronises the device only when enabled.

    ``one_time`` (optional) returns a snapshot of the one-time work done so far (graph captures,
    compiled frames). A record during which it changed paid for that work too, a first use of its
    shape, so it is marked ``first_use``: its ms are not what the shape costs (the online costs leave
    it out, ``planner.fit``)."""

    def __init__(self, profile: Profile, device: torch.device, *, enabled: bool,
                 one_time: Callable[[], Any] | None = None):
        self.profile = profile
        self.device = torch.device(device)
        self.enabled = enabled
        self.one_time = one_time

    def sync(self) -> None:
        if self.enabled and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextmanager
    def phase(self, field: str) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        self.sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            self.sync()
            elapsed_ms = (time.perf_counter() - start) * 1e3
            setattr(self.profile, field, getattr(self.profile, field) + elapsed_ms)

    @contextmanager
    def record(self, kind: str, **shape: int) -> Iterator[None]:
        """Append ``{kind, **shape, ms}`` to ``profile.forwards`` (when it is a list); the ms exclude
        records nested inside (a bucket's tail chunks). ``first_use: True`` is added when the
        one-time work changed during it (class docstring)."""
        forwards = self.profile.forwards
        if forwards is None:
            yield
            return
        self.sync()
        before = None if self.one_time is None else self.one_time()
        first, start = len(forwards), time.perf_counter()
        try:
            yield
        finally:
            self.sync()
            elapsed = (time.perf_counter() - start) * 1e3 - sum(r["ms"] for r in forwards[first:])
            first_use = self.one_time is not None and self.one_time() != before
            forwards.append({"kind": kind, **shape, "ms": elapsed} | ({"first_use": True} if first_use else {}))


# -- timing ----------------------------------------------------------------------------------------

def synchronize(device: Any) -> None:
    """Wait for the device's queued work (a no-op off CUDA); ``device`` may be a string."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def timed_ms(fn: Callable[[], Any], device: Any) -> tuple[float, Any]:
    """Wall-clock milliseconds of ``fn()`` with the device synchronised before and after."""
    synchronize(device)
    start = time.perf_counter()
    out = fn()
    synchronize(device)
    return (time.perf_counter() - start) * 1e3, out
