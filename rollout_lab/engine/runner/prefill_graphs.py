"""CUDA graphs of the bucketed prefill forward, one per shape class: the fixed cost without Python.

An eager prefill forward of a small bucket costs about the same whatever its shape: Python and
kernel launches, several times its GPU work (the fixed term of an eager calibration,
data/calibration/qwen2.5-3b_bfloat16_cuda.json). With ``RolloutConfig(prefill_classes=...,
prefill_graphs=True)`` every bucket runs at a class shape (``planner.shape_classes``), and each
class is captured once, on first use, into a CUDA graph that later buckets of that class replay:

- static inputs per class: ids, positions and a 4-D additive mask ``[rows, 1, width, width]``
  (causal and left padding; HF takes a 4-D mask as is, so no mask is built inside the graph);
- the forward writes into a fresh ``DynamicCache`` during capture, so its KV and logits live in the
  graph's memory and are read (copied into the aligned cache) before the next replay;
- all classes share one memory pool; ``max_graphs`` bounds how many are captured, and a class of more
  than ``max_tokens`` (rows x width, ``MAX_GRAPH_TOKENS``) is never captured: its forward is long
  enough that launches do not matter, and each graph keeps its KV output alive (at most
  ``max_graphs x max_tokens`` tokens of KV, ``graph_reserve_bytes``); such classes run eagerly;
  ``capture_ms`` and ``num_captures`` report what capturing cost, ``class_capture_ms`` each class's
  (its compile included: what a new class costs a call); with ``compiled="layers"`` those eager
  forwards run the compiled layers (the trace of nano-vllm's shape shows the eager prefill of its
  large buckets as a visible share of the call, much of it unfused elementwise kernels:
  data/diagnostics/trace_nano_h100_037603b.txt);
- ``compiled=True`` captures ``torch.compile(model, dynamic=True)`` instead of the model
  (``compiled="layers"``: each decoder layer compiled, ``engine.runner.compiling``). A replay
  removes the launches but not the GPU time of ~1,000 small unfused kernels, so an uncompiled
  replay stays well above the time to stream the weights, as the uncompiled decode step does
  (data/calibration/qwen2.5-3b_bfloat16_cuda_prefill-graphs.json against ..._compiled-graphs.json;
  data/results/decode_step_qwen2.5-3b_bfloat16_cuda.json). Symbolic sizes let one compile serve
  the classes.

    graphs = PrefillGraphs(model, cache_kwarg="cache", max_graphs=32)
    logits, layer_kv = graphs.run(prompts, rows=8, width=128, pad_token_id=0)   # like prefill_bucket

CUDA only; CPU keeps the eager ``prefill_bucket``.
"""
from __future__ import annotations

import statistics
import time
from typing import Sequence

import torch
from transformers import DynamicCache

from rollout_lab.engine.runner.compiling import compile_forward, tracing
from rollout_lab.engine.runner.prefill import check_class_shape, class_batch, prefill_bucket


MAX_GRAPH_TOKENS = 8192  # rows x width of the largest class captured (module docstring)


def graph_reserve_bytes(max_graphs: int, kv_bytes_per_token: int, max_tokens: int = MAX_GRAPH_TOKENS) -> int:
    """The most memory the captured classes' KV outputs can hold (what a KV pool sized before them
    must leave free)."""
    return max_graphs * max_tokens * kv_bytes_per_token


class _Captured:
    def __init__(self, rows: int, width: int, device, dtype):
        self.ids = torch.zeros(rows, width, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, width, dtype=torch.long, device=device)
        self.mask = torch.zeros(rows, 1, width, width, dtype=dtype, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None  # [rows, vocab]
        self.layer_kv: list[tuple[torch.Tensor, torch.Tensor]] = []


class PrefillGraphs:
    """Captured prefill forwards by class shape (module docstring)."""

    def __init__(self, model: torch.nn.Module, *, cache_kwarg: str, max_graphs: int = 32, num_warmups: int = 2,
                 compiled: bool | str = False, max_tokens: int = MAX_GRAPH_TOKENS):
        if max_graphs < 1 or max_tokens < 1:
            raise ValueError(f"max_graphs and max_tokens must be >= 1, got {max_graphs}, {max_tokens}")
        self.max_tokens = max_tokens
        param = next(model.parameters())
        if param.device.type != "cuda":
            raise ValueError(f"prefill graphs need a CUDA model, this one is on {param.device}")
        self.model, self.cache_kwarg = model, cache_kwarg
        self.compiled = compiled
        self.forward = compile_forward(model, compiled) if compiled else model  # what the graphs capture
        # what runs a class past the caps: the compiled layers too (their symbolic sizes take any shape,
        # a new mask form costs one layer's trace), not the whole compiled model (a new form recompiles it)
        self.eager = self.forward if compiled == "layers" else model
        self.max_graphs, self.num_warmups = max_graphs, num_warmups
        self.device, self.dtype = param.device, param.dtype
        self.shapes: dict[tuple[int, int], _Captured] = {}
        self.pool = None
        self.num_captures = self.num_replays = self.num_eager = 0
        self.capture_ms = 0.0
        self.class_capture_ms: dict[str, float] = {}  # "<rows>x<width>" -> its capture's ms

    def _fill(self, entry: _Captured, prompts: Sequence[Sequence[int]], pad_token_id: int) -> None:
        rows, width = entry.ids.shape
        ids, attention, positions = class_batch(prompts, pad_token_id, self.device, rows, width)
        entry.ids.copy_(ids)
        entry.positions.copy_(positions)
        keep = attention[:, None, None, :].bool() & torch.ones(width, width, dtype=torch.bool, device=self.device).tril()
        keep |= torch.eye(width, dtype=torch.bool, device=self.device)  # a pad query sees itself: no empty row
        entry.mask.copy_(torch.where(keep, 0.0, torch.finfo(self.dtype).min).to(self.dtype))

    def _forward(self, entry: _Captured) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        temp = DynamicCache(config=self.model.config)
        out = self.forward(input_ids=entry.ids, attention_mask=entry.mask, position_ids=entry.positions,
                           use_cache=True, logits_to_keep=1, **{self.cache_kwarg: temp})
        return out.logits[:, -1], [(layer.keys, layer.values) for layer in temp.layers]

    def _capture(self, entry: _Captured) -> None:
        started = time.perf_counter()  # with compiled=True the warm-ups compile (or hit the cache)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), tracing():  # a compiled forward traces in its warm-ups
            for _ in range(self.num_warmups):
                self._forward(entry)
        torch.cuda.current_stream().wait_stream(side)
        entry.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(entry.graph, pool=self.pool):
            entry.logits, entry.layer_kv = self._forward(entry)
        self.pool = entry.graph.pool() if self.pool is None else self.pool
        torch.cuda.synchronize(self.device)
        ms = (time.perf_counter() - started) * 1e3
        self.num_captures += 1
        self.capture_ms += ms
        rows, width = entry.ids.shape
        self.class_capture_ms[f"{rows}x{width}"] = ms

    def capture_estimate_ms(self) -> float | None:
        """What capturing one more class would cost: the median of the captures after the first
        (the first also compiled what they share), the first's alone while it is the only one;
        None before any capture, or once ``max_graphs`` are kept (a new class then runs eagerly)."""
        if not self.class_capture_ms or len(self.shapes) >= self.max_graphs:
            return None
        ms = list(self.class_capture_ms.values())
        return statistics.median(ms[1:] or ms)

    @property
    def info(self) -> dict:
        """Captures (count, ms in all and per class), replays, eager runs and what was compiled."""
        return {"num_captures": self.num_captures, "capture_ms": self.capture_ms,
                "class_capture_ms": dict(self.class_capture_ms), "num_replays": self.num_replays,
                "num_eager": self.num_eager, "compiled": self.compiled}

    @torch.no_grad()
    def run(self, prompts: Sequence[Sequence[int]], *, rows: int, width: int, pad_token_id: int
            ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """``prefill_bucket(prompts, rows=rows, width=width)`` by graph replay (eager past the caps).
        The returned tensors are the graph's: use them before the next ``run``."""
        check_class_shape(prompts, rows, width)  # before a buffer is made for the shape
        longest = max(len(p) for p in prompts)
        key = (rows, width)
        if key not in self.shapes and (len(self.shapes) >= self.max_graphs or rows * width > self.max_tokens):
            self.num_eager += 1
            with tracing():
                return prefill_bucket(self.eager, prompts, pad_token_id=pad_token_id, cache_kwarg=self.cache_kwarg,
                                      rows=rows, width=width)
        entry = self.shapes.get(key)
        fresh = entry is None
        if fresh:
            entry = self.shapes[key] = _Captured(rows, width, self.device, self.dtype)
        self._fill(entry, prompts, pad_token_id)
        if fresh:
            self._capture(entry)  # the capture records; the replay below computes
        entry.graph.replay()
        self.num_replays += 1
        real = len(prompts)
        kv = [(k[:real, :, -longest:], v[:real, :, -longest:]) for k, v in entry.layer_kv]
        return entry.logits[:real], kv

    def close(self) -> None:
        self.shapes, self.pool = {}, None
