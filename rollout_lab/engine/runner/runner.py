"""The model runner: how a rollout runs its model, and what it keeps across calls to run it fast.

It decides once, before any routing decision, how the decode runs (graph replay on CUDA, eager
elsewhere; span attention, torch.compile, fused projections) and whether prefill forwards replay
captured graphs; then it owns what those choices build: the decode stepper (its cache and captured
graphs, ``stepper_for``), the prefill graphs (``captured_prefill``) and the memory of the weights
both read, which a call whose model holds new tensors copies in (``refresh_weights``) instead of
capturing again. The paged pool it keeps holds the prefix cache across calls (``engine.kv.paged``):
``refresh_weights`` drops it when the weights changed since the last call.

    runner = ModelRunner(model, decode="auto", decode_attention="auto", compile="auto", ...)
    stepper = runner.stepper_for(num_slots=8, capacity=512, explicit_capacity=False, ...)

"""
from __future__ import annotations

import math
from typing import Mapping

import torch

from rollout_lab.engine.runner.compiling import compile_counts
from rollout_lab.engine.runner.fusing import fused_nbytes
from rollout_lab.engine.runner.prefill import cache_kwarg_name
from rollout_lab.engine.runner.prefill_graphs import PrefillGraphs, graph_reserve_bytes
from rollout_lab.engine.runner.steppers import (
    EagerStepper,
    StepperKey,
    describe,
    graph_capacity,
    graph_weights,
    make_stepper,
    rebind_weights,
    resolve_compile,
    resolve_decode_mode,
    resolve_fuse,
    resolve_spans,
    weights_signature,
    weights_state,
)
from rollout_lab.engine.sample.processors import RowPenalties
from rollout_lab.engine.sample.sampler import RowSampling
from rollout_lab.planner.cost import CHECKED_GRID_FIELDS, CostFile
from rollout_lab.planner.shape_classes import ShapeClasses

# a kept paged pool too small for a call is replaced by one at least this much larger (within what
# the call could use), so calls whose peaks wander upwards rebuild (and recapture) it rarely
PAGED_POOL_GROWTH = 1.25


def resolve_prefill_graphs(choice: bool | str, *, classes: object, costs: object, device: torch.device) -> bool:
    """Whether a rollout captures its prefill forwards: ``choice`` as given, or for "auto" wherever
    shape ``classes`` run on CUDA, unless ``costs`` is a calibration made without captured forwards
    (its coefficients price eager forwards, so the rollout runs them as they were timed)."""
    if choice != "auto":
        return bool(choice)
    if device.type != "cuda" or classes is None:
        return False
    grid = costs.metadata.get("grid") if isinstance(costs, CostFile) else None
    return bool(grid.get("prefill_graphs", CHECKED_GRID_FIELDS["prefill_graphs"])) \
        if isinstance(grid, Mapping) else True


class ModelRunner:
    """Runs one model's prefill and decode for a ``Rollout``: the decode stepper and the prefill
    graphs it keeps across calls, and the weights they read."""

    def __init__(self, model: torch.nn.Module, *, decode: str, decode_attention: str, compile: bool | str,
                 fuse_projections: bool | str, prefill_graphs: bool | str, prefill_classes: object,
                 costs: object, max_prefill_graphs: int, max_decode_graphs: int, decode_widths: int,
                 batch_invariant: bool = False):
        self.model = model
        self.invariant = batch_invariant  # the steps run inside engine.kernels.batch_invariant
        self.device = next(model.parameters()).device
        self.cache_kwarg = cache_kwarg_name(model)
        self.decode_mode = resolve_decode_mode(decode, self.device)
        self.spans = resolve_spans(decode_attention, model, self.device)
        self.compiled = resolve_compile(compile, self.decode_mode, model)
        self.fused = resolve_fuse(fuse_projections, self.decode_mode, model)
        self.fused_nbytes = fused_nbytes(model) if self.fused else 0  # the fused copy's memory, once
        if prefill_graphs is True and self.device.type != "cuda":
            raise ValueError(f"prefill_graphs=True needs a CUDA device, the model is on {self.device}")
        # whether buckets run at class shapes and replay captured graphs ("auto": on CUDA)
        self.captures_prefill = resolve_prefill_graphs(prefill_graphs, classes=prefill_classes, costs=costs,
                                                       device=self.device)
        self.max_prefill_graphs = max_prefill_graphs
        self.max_decode_graphs = max_decode_graphs
        self.decode_widths = decode_widths
        self.stepper: EagerStepper | None = None  # the kept decode stepper: its cache and graphs
        self.prefill_graphs: PrefillGraphs | None = None  # the kept prefill graphs
        self._prefill_signature: tuple | None = None
        # the parameters and buffers the kept graphs read (steppers.graph_weights); a call whose
        # model holds new tensors copies them in (rebind_weights) instead of capturing again
        self.graph_weights: list[torch.Tensor] | None = None
        self._weights_state: tuple | None = None  # steppers.weights_state after the last call's refresh

    # -- weights --------------------------------------------------------------------------------
    def refresh_weights(self) -> bool:
        """Before a call: copy the model's tensors into the memory the kept graphs read, when the
        model holds new ones (a trainer's step replaced them); where their layout changed, the graphs
        are captured again instead. Whether the weights changed since the last call (replaced or
        written in place: ``steppers.weights_state``); the caller then drops the prefix cache, whose
        KV the old weights computed (``drop_prefix_cache``)."""
        changed = self._weights_state is not None and weights_state(self.model) != self._weights_state
        if self.graph_weights is not None and not rebind_weights(self.model, self.graph_weights):
            self.graph_weights = None
        self._weights_state = weights_state(self.model)
        return changed

    @property
    def num_cached_blocks(self) -> int:
        """Blocks the kept paged pool holds in its prefix cache."""
        return 0 if self.stepper is None or not self.stepper.key.paged else self.stepper.cache.allocator.num_cached

    def drop_prefix_cache(self) -> int:
        """Drop the kept paged pool's prefix cache; the blocks it held."""
        return self.stepper.cache.allocator.clear_cached() if self.num_cached_blocks else 0

    def _keep_graph_weights(self) -> None:
        """Note the memory the graphs about to be captured read, unless the kept graphs already do."""
        if self.graph_weights is None:
            self.graph_weights = graph_weights(self.model)

    def close(self) -> None:
        """Release the captured graphs, the cache and the weight memory the graphs read."""
        if self.device.type == "cuda" and (self.stepper is not None or self.prefill_graphs is not None):
            torch.cuda.synchronize(self.device)
        if self.stepper is not None:
            self.stepper.close()
            self.stepper = None
        if self.prefill_graphs is not None:
            self.prefill_graphs.close()
            self.prefill_graphs = None
        self.graph_weights = None

    # -- prefill --------------------------------------------------------------------------------
    def captured_prefill(self) -> PrefillGraphs | None:
        """The kept prefill graphs (``captures_prefill``), recaptured when the weights' storage changed."""
        if not self.captures_prefill:
            return None
        signature = weights_signature(self.model)
        if self.prefill_graphs is not None and signature != self._prefill_signature:
            self.prefill_graphs.close()
            self.prefill_graphs = None
        if self.prefill_graphs is None:
            self._keep_graph_weights()
            self.prefill_graphs = PrefillGraphs(self.model, cache_kwarg=self.cache_kwarg,
                                                max_graphs=self.max_prefill_graphs, compiled=self.compiled)
            self._prefill_signature = signature
        return self.prefill_graphs

    def priced(self, classes: ShapeClasses) -> ShapeClasses:
        """``classes`` with the kept prefill graphs' shapes and a new class priced at what capturing
        one cost them (``ShapeClasses.priced_captures``): once the online costs refit, the plan they
        give moves to new class shapes only where those pay their captures back. Unchanged before
        any capture and once no more classes can be captured."""
        graphs = self.prefill_graphs
        estimate = None if graphs is None else graphs.capture_estimate_ms()
        if estimate is None:
            return classes
        return classes.priced_captures(graphs.shapes, estimate, max_tokens=graphs.max_tokens)

    # -- decode ---------------------------------------------------------------------------------
    def stepper_for(
        self, num_slots: int, capacity: int, explicit_capacity: bool, *, sampling: RowSampling | None = None,
        penalties: RowPenalties | None = None, logprobs_mode: str | None = None, num_blocks: int | None = None,
        block_size: int | None = None, min_new_tokens: bool = False, max_blocks: int | None = None,
        prefix_groups: int = 0, forced: bool = False, kv_dtype: str = "auto",
    ) -> EagerStepper:
        """Reuse the kept stepper when it fits this call, else build (and capture) a new one;
        ``num_blocks``: a paged pool of that many blocks of ``block_size`` (``capacity``: the
        longest row's tokens), grown to ``PAGED_POOL_GROWTH`` times a kept pool that is too small, up
        to ``max_blocks``; ``sampling`` and ``penalties``: the call's rows (the key takes which
        filters and penalty state they need), ``min_new_tokens``: whether rows hold stop ids back;
        ``prefix_groups``: groups of the paged pool's shared-prefix read (0: the plain read);
        ``forced``: the step takes queued forced tokens (a call with episodes, ``DecodeState.force``);
        ``kv_dtype``: what the paged pool stores (``engine.kv.paged.KV_DTYPES``)."""
        old = self.stepper
        if self.decode_mode == "graph" and not explicit_capacity:
            capacity = graph_capacity(capacity)
            if old is not None and old.key.num_slots == num_slots and \
                    capacity <= old.key.capacity <= 2 * capacity:
                capacity = old.key.capacity
        if num_blocks is not None and old is not None and old.key.paged and old.key.num_slots == num_slots:
            if capacity <= old.key.capacity <= 2 * capacity:
                capacity = old.key.capacity  # a wider table costs nothing: keep the pool (and its prefix cache)
            if num_blocks <= old.key.num_blocks <= 2 * num_blocks:
                num_blocks = old.key.num_blocks  # a pool that holds this call's rows: keep it (and its graphs)
            elif old.key.num_blocks < num_blocks:  # too small: grow it by a quarter at least, within the uncut pool
                num_blocks = max(num_blocks, min(math.ceil(old.key.num_blocks * PAGED_POOL_GROWTH),
                                                 max_blocks or num_blocks))
        key = StepperKey.for_rows(num_slots, capacity, self.cache_kwarg, sampling=sampling, penalties=penalties,
                                  min_new_tokens=min_new_tokens,
                                  max_graphs=self.max_decode_graphs if self.decode_mode == "graph" else 1,
                                  num_widths=self.decode_widths, spans=self.spans, compiled=self.compiled,
                                  fused=self.fused, logprobs_mode=logprobs_mode,
                                  block_size=None if num_blocks is None else block_size, num_blocks=num_blocks or 0,
                                  prefix_groups=prefix_groups if num_blocks is not None else 0, forced=forced,
                                  invariant=self.invariant, kv_dtype=kv_dtype if num_blocks is not None else "auto")
        if old is not None and old.fits(self.model, key):
            old.sync_weights()  # its fused projections' copy of the weights, as the model holds them now
            return old
        if old is not None:  # drop the old cache and graphs before allocating their replacement
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            old.close()
            self.stepper = None
        if self.decode_mode == "graph":
            self._keep_graph_weights()
        self.stepper = make_stepper(self.model, key, decode=self.decode_mode)
        return self.stepper

    # -- what the memory sizing and the profile ask -----------------------------------------------
    @property
    def kept_cache_bytes(self) -> int:
        """The kept stepper's cache: free for a call, which reuses it or drops it first."""
        return 0 if self.stepper is None else self.stepper.cache.num_bytes

    def pending_bytes(self, kv_bytes_per_token: int) -> float:
        """Memory this runner will still allocate beside a call's KV: the prefill graphs' outputs
        before they exist, and the fused projections' copy before a stepper holds one."""
        extra = 0.0
        if self.captures_prefill and self.prefill_graphs is None:
            extra += graph_reserve_bytes(self.max_prefill_graphs, kv_bytes_per_token)
        if self.fused and (self.stepper is None or self.stepper.fusion is None):
            extra += self.fused_nbytes
        return extra

    def one_time_work(self) -> tuple:
        """A snapshot of the captures and compiles done so far: the prefill graphs' and the decode
        stepper's (each object with its count, so a rebuilt one differs) and torch.compile's frames.
        A timed forward during which it changed paid for them (``Timer``'s ``first_use``), and the
        online costs leave it out: fitted as forward time, the warm-up call's captures and compiles
        would price every shape by what capturing one cost."""
        graphs, stepper = self.prefill_graphs, self.stepper
        return (graphs, 0 if graphs is None else graphs.num_captures,
                stepper, 0 if stepper is None else stepper.num_captures, compile_counts()["frames"])

    @property
    def stepper_info(self) -> dict:
        """What decodes: kind, captures and replays so far, slots and capacity."""
        return describe(self.stepper)

    @property
    def prefill_graph_info(self) -> dict:
        """The kept prefill graphs' captures (each class's ms, its compile included), replays and
        eager runs; {} when none are kept."""
        return {} if self.prefill_graphs is None else self.prefill_graphs.info
