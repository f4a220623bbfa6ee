"""Fixed-slot decode steppers: eager, and CUDA-graph-captured over the aligned static cache.

A stepper owns the aligned cache, the decode buffers and (for the graph) a ladder of captured decode
steps: one per row count of ``graph_ladder`` (1, 2, 4, 8, then every 16 up to the slot count, thinned
to ``max_graphs``; from 2 when the step is compiled), all in one memory pool. Slots stay dense
(compaction), so a step replays the smallest graph that covers the live rows: retired rows stop
costing. ``Rollout`` keeps its stepper
across calls: the graphs are captured once and replayed while the slot count, the capacity, the
penalty, the filters that run (``StepperKey``) and the weights' storage are unchanged; each row's
temperature, top-k, top-p, seed and min_new_tokens are buffers the graph reads, so they never
recapture. Replacing a parameter or buffer (a new tensor, dtype, shape or layout) triggers a
recapture. ``Rollout.close()`` releases them.

Attention reads a window of the first ``width`` columns, the smallest of ``width_ladder`` (the
capacity cut in ``num_widths`` even parts) that covers the front: early in a call, while the front
is far from the capacity, a step reads a fraction of the cache. Eager and graph steps use the same
windows, so they compute the same thing; the graph ladder is row counts x widths. With span
attention (``key.spans``, ``engine.kernels.span``) each row reads only its live columns, so there
is one window, the capacity, and the ladder is row counts only; so with the paged cache
(``key.paged``, ``engine.kv.paged``), where each row reads its own blocks.

With ``key.compiled`` the graph stepper runs the compiled model (``engine.runner.compiling``: whole, or
``"layers"`` one decoder layer at a time) inside each captured step: inductor fuses the norms,
rotary and activations, and symbolic sizes (a symbol per size, no 1-row rung) let one compile serve
every rung. Every shape runs once before any capture, so compiling never happens while a graph
records; ``build_ms`` is that first-call cost, paid once per stepper. With ``key.fused`` the step
runs ``engine.runner.fusing``'s copy of the model, whose q/k/v and gate/up projections are one matmul each
(compiled or not); ``sync_weights()`` refreshes its stacked weights from the model.

    stepper = make_stepper(model, settings, decode="auto")   # graph on CUDA, eager elsewhere
    tokens = stepper.step(num_rows, front)                    # [num_rows] ids, device tensor

Capture happens on a fresh cache: the warm-up steps write one column and open one mask column, so
everything they touched is reset afterwards, and every call starts from ``reset()``.

"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from rollout_lab.engine.kv.aligned import AlignedKVCache
from rollout_lab.engine.runner.compiling import (
    compile_forward,
    compile_invariant_select,
    compile_select,
    decoder_layers,
    tracing,
)
from rollout_lab.engine.runner.decode import DecodeState, decode_step
from rollout_lab.engine.runner.fusing import FUSE_MEMORY_FRACTION, FusedProjections, fused_nbytes
from rollout_lab.engine.kv.paged import PagedKVCache
from rollout_lab.engine.sample.processors import RowPenalties
from rollout_lab.engine.sample.sampler import RowSampling
from rollout_lab.engine.kernels.available import kernel_available

GRAPH_CAPACITY_STEP = 64  # graph capacities are rounded up so that nearby shapes share a capture


def graph_supported(device: torch.device | str) -> bool:
    """CUDA graphs need a CUDA device; decided before any routing decision."""
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.is_available()


DECODE_MODES = ("auto", "eager", "graph")  # "auto": graph replay on CUDA, eager elsewhere
# decode attention: "span" reads each row's live columns (engine.kernels.span), "masked" the
# window with a mask; "auto": span where its kernel runs (CUDA with Triton), masked elsewhere
DECODE_ATTENTIONS = ("auto", "span", "masked")

def resolve_decode_mode(decode: str, device: torch.device | str) -> str:
    if decode not in DECODE_MODES:
        raise ValueError(f"decode must be one of {list(DECODE_MODES)}, got {decode!r}")
    if decode == "auto":
        return "graph" if graph_supported(device) else "eager"
    if decode == "graph" and not graph_supported(device):
        raise ValueError(f"decode='graph' needs a CUDA device, the model is on {torch.device(device)}")
    return decode


def resolve_spans(choice: str, model: torch.nn.Module, device: torch.device | str) -> bool:
    """Whether decode attends over live spans: "span" always (on a CPU without Triton that runs the
    torch reference, the same numbers with no saving), "auto" where the kernel runs and the model
    uses ``sdpa`` (the implementation ``engine.kernels.attention`` replaces)."""
    if choice not in DECODE_ATTENTIONS:
        raise ValueError(f"decode_attention must be one of {list(DECODE_ATTENTIONS)}, got {choice!r}")
    if choice == "auto":
        sdpa = getattr(model.config, "_attn_implementation", None) == "sdpa"
        return sdpa and kernel_available(device)
    return choice == "span"


def resolve_compile(choice: bool | str, decode_mode: str, model: torch.nn.Module) -> bool | str:
    """How the captured step is compiled: "layers" layer by layer (engine.runner.compiling) for "auto"
    wherever graphs run and the model has a decoder-layer list, else True (the whole model); False
    for the eager step, which never is. "auto" takes the layers because their one trace serves every
    layer: a first call a small fraction of the whole model's, for a step slightly slower
    (data/results/decode_step_qwen2.5-3b_bfloat16_cuda_h100_one-trace.json)."""
    if (choice is True or choice == "layers") and decode_mode != "graph":
        raise ValueError(f"compile={choice!r} compiles the graph-captured step, which needs decode='graph' "
                         f"on a CUDA device (decode is {decode_mode!r}); use compile='auto' or False")
    if decode_mode != "graph" or choice is False:
        return False
    if choice == "layers":
        return "layers"
    if choice is True:
        return True
    try:
        decoder_layers(model)
    except ValueError:  # no list of decoder layers to compile one by one
        return True
    return "layers"


def resolve_fuse(choice: bool | str, decode_mode: str, model: torch.nn.Module) -> bool:
    """Whether the decode step runs fused projections (``engine.runner.fusing``): "auto" for the
    graph-captured step when the model has groups to fuse and their stacked copy is at most
    ``FUSE_MEMORY_FRACTION`` of the device's memory; True wherever the model has groups to fuse."""
    if choice is False:
        return False
    nbytes = fused_nbytes(model)
    if nbytes == 0:
        return False
    if choice is True:
        return True
    if decode_mode != "graph":
        return False
    device = next(model.parameters()).device
    return nbytes <= FUSE_MEMORY_FRACTION * torch.cuda.get_device_properties(device).total_memory


def weights_signature(model: torch.nn.Module) -> tuple:
    """Address, dtype, shape and strides of every parameter and buffer: what a graph bakes in."""
    return tuple((t.data_ptr(), t.dtype, tuple(t.shape), t.stride(), t.device) for t in graph_tensors(model))


def weights_state(model: torch.nn.Module) -> tuple:
    """Address and version counter of every parameter and buffer: it changes when one is replaced
    (``load_state_dict(assign=True)``) or written in place (an optimizer step, ``copy_`` under
    no_grad). A write through ``.data`` bumps no counter, so it goes unseen."""
    return tuple((t.data_ptr(), tensor_version(t)) for t in graph_tensors(model))


def tensor_version(tensor: torch.Tensor) -> int:
    """``tensor``'s version counter (bumped by every in-place write); -1 for an inference tensor,
    which keeps none (and cannot be written outside inference mode)."""
    return -1 if tensor.is_inference() else tensor._version


def graph_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """What a capture reads of the model: every parameter, then every buffer."""
    return [*model.parameters(), *model.buffers()]


def graph_weights(model: torch.nn.Module) -> list[torch.Tensor]:
    """The memory a capture reads: every parameter and buffer, detached (the same storage)."""
    return [t.detach() for t in graph_tensors(model)]


def rebind_weights(model: torch.nn.Module, captured: Sequence[torch.Tensor]) -> bool:
    """Point a model whose parameters or buffers were replaced (``load_state_dict(assign=True)``, a
    trainer's weight sync into new tensors) back at the memory its graphs were captured on: each new
    tensor is copied into the captured one and the model's tensor then reads it (``.data``), so the
    kept graphs replay the new values and nothing is captured again (a copy of the weights, far
    cheaper than a recapture: data/results/trainer_loop_qwen2.5-0.5b_bfloat16_cuda_assign-checkpointing_rebind.json
    against trainer_loop_qwen2.5-0.5b_bfloat16_cuda_assign-checkpointing.json). The parameters stay the
    same objects (an optimizer holding them keeps working). True when the model reads ``captured``
    (again); False, with nothing changed, when its tensors no longer pair one to one in dtype, shape,
    strides and device (a resized vocabulary, a cast, weights tied or untied): then the graphs must be
    captured again."""
    tensors = graph_tensors(model)
    if len(tensors) != len(captured):
        return False
    moved = [(t, c) for t, c in zip(tensors, captured) if t.data_ptr() != c.data_ptr()]
    if any(t.dtype != c.dtype or t.shape != c.shape or t.stride() != c.stride() or t.device != c.device
           for t, c in moved):
        return False
    with torch.no_grad():
        for t, c in moved:
            c.copy_(t)
            t.data = c
    return True


@dataclass(frozen=True)
class StepperKey:
    """What a captured decode step bakes in. Each row's sampling settings, penalties, seed,
    min_new_tokens and stop ids are buffers the step reads (``DecodeState``); the key holds only which
    code runs: sampling at all, the top-k width, the top-p and min-p filters (``RowSampling``'s static
    fields: they only count when ``do_sample``), which penalties (``RowPenalties``'s static fields)
    and holding stop ids back (``min_new_tokens``)."""

    num_slots: int
    capacity: int
    cache_kwarg: str
    do_sample: bool = False
    max_top_k: int = 0  # sampling.top_k_width of the rows' largest top-k (0: no top-k)
    top_p_filter: bool = False
    min_p_filter: bool = False
    track_seen: bool = False  # a row has a repetition penalty: the ids of its prompt and output are kept
    track_counts: bool = False  # a row has a presence or frequency penalty: its output's counts are kept
    min_new_tokens: bool = False  # rows hold EOS and stop ids back until their min_new_tokens
    max_graphs: int = 1  # row counts captured (graph decode only)
    num_widths: int = 1  # masked attention: windows over the capacity
    spans: bool = False  # span attention: each row's live columns (the window is then the capacity)
    compiled: bool | str = False  # compile the forward inside the captured step: True, "layers" (graph decode only)
    fused: bool = False  # q/k/v and gate/up as one matmul each (engine.runner.fusing)
    keep_logits: bool = False  # the step leaves its logits in state.logits (teacher-forced checks)
    logprobs_mode: str | None = None  # the step leaves each token's log-probability in state.logprobs
    # the paged cache (engine.kv.paged): blocks of block_size tokens, num_blocks in the pool (block 0
    # scratch); capacity is then the most tokens one row holds (its table's blocks x block_size)
    block_size: int | None = None
    num_blocks: int = 0
    # the shared-prefix read (engine.kernels.shared_prefix): the groups of rows sharing prompt blocks
    # the step reads once each (0: the plain paged read, every row its own blocks)
    prefix_groups: int = 0
    # forced inputs (DecodeState.force): rows take queued tokens instead of their draws (a call with episodes)
    forced: bool = False
    # what the paged pool stores (engine.kv.paged.KV_DTYPES): "fp8" quantizes it (engine.kernels.kv_fp8)
    kv_dtype: str = "auto"
    # the step runs inside engine.kernels.batch_invariant (RolloutConfig(batch_invariant=True)): the forward
    # is never compiled, the token choice is where it takes no sums (compiling.compile_invariant_select)
    invariant: bool = False

    @property
    def paged(self) -> bool:
        return self.block_size is not None

    @classmethod
    def for_rows(cls, num_slots: int, capacity: int, cache_kwarg: str, *, sampling: RowSampling | None,
                 penalties: RowPenalties | None, **fields: Any) -> "StepperKey":
        """The key of a step over rows of these ``sampling`` settings and ``penalties`` (their
        static fields: which filters and which penalty state it runs); ``fields``: the rest."""
        return cls(num_slots, capacity, cache_kwarg, do_sample=sampling is not None,
                   max_top_k=sampling.max_top_k if sampling else 0,
                   top_p_filter=sampling is not None and sampling.top_p_filter,
                   min_p_filter=sampling is not None and sampling.min_p_filter,
                   track_seen=penalties is not None and penalties.track_seen,
                   track_counts=penalties is not None and penalties.track_counts, **fields)



class EagerStepper:
    """The plain decode step over the first ``num_rows`` slots."""

    kind = "eager"

    def __init__(self, model: torch.nn.Module, key: StepperKey):
        self.model, self.key = model, key
        device = next(model.parameters()).device
        vocab = model.get_input_embeddings().weight.shape[0]
        if key.paged:
            self.cache = PagedKVCache.for_model(model, num_slots=key.num_slots, num_blocks=key.num_blocks,
                                                block_size=key.block_size,
                                                max_blocks_per_row=-(-key.capacity // key.block_size),
                                                prefix_groups=key.prefix_groups, kv_dtype=key.kv_dtype)
        else:
            self.cache = AlignedKVCache.for_model(model, num_slots=key.num_slots, capacity=key.capacity)
        sampling = RowSampling.zeros(key.num_slots, device, max_top_k=key.max_top_k, top_p_filter=key.top_p_filter,
                                     min_p_filter=key.min_p_filter) if key.do_sample else None
        penalties = RowPenalties.zeros(key.num_slots, device, track_seen=key.track_seen,
                                       track_counts=key.track_counts) if key.track_seen or key.track_counts else None
        self.state = DecodeState(key.num_slots, vocab, device=device, keep_logits=key.keep_logits,
                                 logprobs_mode=key.logprobs_mode, sampling=sampling, penalties=penalties,
                                 min_new_tokens=key.min_new_tokens, forced=key.forced)
        # attention windows, ascending; span and paged attention read live tokens whatever the window
        self.widths = (key.capacity,) if key.spans or key.paged else width_ladder(key.capacity, key.num_widths)
        # the fused projections' copy of the model (engine.runner.fusing), which the step then runs
        self.fusion = FusedProjections(model) if key.fused else None
        self.forward = None if self.fusion is None else self.fusion.model  # None: the model itself
        self.select = None  # processors.select_tokens, unless compiled
        self.num_captures = 0
        self.num_replays = 0
        self.build_ms = 0.0  # compile + capture when the stepper was made

    def fits(self, model: torch.nn.Module, key: StepperKey) -> bool:
        return model is self.model and key == self.key

    def reset(self) -> None:
        self.cache.reset()
        self.state.reset()

    def sync_weights(self) -> None:
        """Bring what the step reads besides the model up to its weights: the fused projections'
        stacked copy (a call that reuses the step runs this first)."""
        if self.fusion is not None:
            self.fusion.refresh()

    def width_for(self, front: int) -> int:
        """The smallest window that holds the column ``front`` this step writes and attends to."""
        return next(w for w in self.widths if w > front)

    def step(self, num_rows: int, front: int) -> torch.Tensor:
        return self._run(num_rows, self.width_for(front))

    def _run(self, num_rows: int, width: int) -> torch.Tensor:
        return decode_step(
            self.model, self.cache, self.state, num_rows,
            cache_kwarg=self.key.cache_kwarg,
            width=width, spans=self.key.spans, forward=self.forward, select=self.select,
        )

    def logprobs(self, num_rows: int) -> torch.Tensor:
        """[num_rows] log-probabilities of the last step's tokens (a copy: the next step overwrites)."""
        return self.state.logprobs[:num_rows].clone()

    def retire_tail(self, num_live: int) -> None:
        """Slots past ``num_live`` are dead; nothing to do when they are not computed."""

    def close(self) -> None:
        self.cache = self.state = self.fusion = None  # type: ignore[assignment]


class GraphStepper(EagerStepper):
    """CUDA graphs of the decode step, one per row count of the ladder; a step replays the smallest
    that covers the live rows (the dead slots it still covers compute ignored tokens)."""

    kind = "graph"

    def __init__(self, model: torch.nn.Module, key: StepperKey, *, num_warmups: int = 2):
        super().__init__(model, key)
        started = time.perf_counter()
        if key.compiled:  # one compile with symbolic sizes serves every rung of the ladder (it has no 1-row rung)
            self.forward = compile_forward(model if self.forward is None else self.forward, key.compiled)
            self.select = compile_select()
        elif key.invariant and not (key.top_p_filter or key.min_p_filter):  # top-p and min-p sum: eager
            self.select = compile_invariant_select()
        self.signature = weights_signature(model)
        self.ladder = graph_ladder(key.num_slots, key.max_graphs, smallest=2 if key.compiled else 1)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}  # (rows, width) -> graph
        self.tokens: dict[tuple[int, int], torch.Tensor] = {}
        self.replays_by_rows: dict[int, int] = {}  # ladder row count -> replays
        self.replays_by_width: dict[int, int] = {}
        self._capture(num_warmups)
        self.build_ms = (time.perf_counter() - started) * 1e3

    def fits(self, model: torch.nn.Module, key: StepperKey) -> bool:
        return super().fits(model, key) and weights_signature(model) == self.signature

    def _capture(self, num_warmups: int) -> None:
        with tracing():  # the warm-ups trace the compiled step (engine.runner.compiling)
            self._capture_ladder(num_warmups)

    def _capture_ladder(self, num_warmups: int) -> None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        shapes = [(rows, width) for rows in self.ladder for width in self.widths]
        with torch.cuda.stream(side):
            for width in self.widths:
                for _ in range(num_warmups):
                    self._run(self.key.num_slots, width)
            if self.key.compiled:  # every shape compiles (or hits the cache) before any capture
                for shape in shapes:
                    self.reset()
                    self._run(*shape)
        torch.cuda.current_stream().wait_stream(side)
        pool = None
        for shape in sorted(shapes, reverse=True):  # the largest first: the others fit its pool
            self.reset()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                tokens = self._run(*shape)  # recorded, not run: the buffers keep their reset values
            pool = graph.pool() if pool is None else pool
            self.graphs[shape], self.tokens[shape] = graph, tokens
        self.num_captures += 1
        torch.cuda.synchronize()
        self.reset()

    def step(self, num_rows: int, front: int) -> torch.Tensor:
        rows, width = next(r for r in self.ladder if r >= num_rows), self.width_for(front)
        self.graphs[rows, width].replay()
        self.num_replays += 1
        self.replays_by_rows[rows] = self.replays_by_rows.get(rows, 0) + 1
        self.replays_by_width[width] = self.replays_by_width.get(width, 0) + 1
        return self.tokens[rows, width][:num_rows].clone()  # the static output is overwritten by the next replay

    def retire_tail(self, num_live: int) -> None:
        # dead slots that a graph still covers keep decoding: keep their positions in range
        self.state.position_ids[num_live:].zero_()

    def close(self) -> None:
        self.graphs, self.tokens = {}, {}
        super().close()


def width_ladder(capacity: int, num_widths: int) -> tuple[int, ...]:
    """Attention windows, ascending, ending at ``capacity``: the capacity cut in ``num_widths``
    even parts, each rounded up to 16 columns (``num_widths=1``: the whole capacity)."""
    if num_widths < 1:
        raise ValueError(f"num_widths must be >= 1, got {num_widths}")
    parts = {min(capacity, -(-capacity * k // num_widths // 16) * 16) for k in range(1, num_widths + 1)}
    return tuple(sorted(parts | {capacity}))


def graph_ladder(num_slots: int, max_graphs: int, *, smallest: int = 1) -> tuple[int, ...]:
    """The row counts to capture, ascending, always ending at ``num_slots``: 1, 2, 4, 8, then every
    16, thinned evenly to at most ``max_graphs`` (``max_graphs=1``: one graph over every slot).
    ``smallest=2`` leaves out the 1-row rung (one live row replays the 2-row graph): a compiled step
    specialises a size of 1, and that rung would cost a whole compile of its own."""
    if max_graphs < 1:
        raise ValueError(f"max_graphs must be >= 1, got {max_graphs}")
    if smallest not in (1, 2):
        raise ValueError(f"smallest must be 1 or 2, got {smallest}")
    rungs = [r for r in (1, 2, 4, 8) if smallest <= r < num_slots] + list(range(16, num_slots, 16)) + [num_slots]
    if len(rungs) > max_graphs:
        stride = len(rungs) / max_graphs
        rungs = sorted({rungs[min(len(rungs) - 1, int(round((i + 1) * stride)) - 1)] for i in range(max_graphs)})
    return tuple(rungs)


def graph_capacity(needed: int) -> int:
    step = GRAPH_CAPACITY_STEP
    return -(-needed // step) * step


def make_stepper(model: torch.nn.Module, key: StepperKey, *, decode: str) -> EagerStepper:
    if decode == "graph":
        return GraphStepper(model, key)
    return EagerStepper(model, key)


def describe(stepper: Any) -> dict[str, Any]:
    if stepper is None:
        return {"kind": None}
    return {"kind": stepper.kind, "num_captures": stepper.num_captures,
            "num_replays": stepper.num_replays, "num_slots": stepper.key.num_slots,
            "num_graphs": len(getattr(stepper, "graphs", ())),
            "widths": list(stepper.widths), "spans": stepper.key.spans,
            "compiled": stepper.key.compiled, "fused": stepper.key.fused, "build_ms": stepper.build_ms,
            "replays_by_rows": dict(getattr(stepper, "replays_by_rows", {})),
            "replays_by_width": dict(getattr(stepper, "replays_by_width", {})),
            "capacity": stepper.key.capacity, "block_size": stepper.key.block_size,
            "num_blocks": stepper.key.num_blocks, "prefix_groups": stepper.key.prefix_groups,
            "forced": stepper.key.forced, "invariant": stepper.key.invariant, "kv_dtype": stepper.key.kv_dtype,
            "select": "eager" if stepper.select is None else "compiled"}
