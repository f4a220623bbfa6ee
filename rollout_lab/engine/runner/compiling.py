"""``torch.compile`` of a causal LM's forward, whole or one decoder layer at a time.

The captured decode step and the prefill graphs replay compiled code (``RolloutConfig(compile=...)``):

- ``"model"`` compiles the whole forward as one graph with symbolic sizes. Inductor fuses across
  layer boundaries, but its first compile grows with the depth and is paid again on every fresh
  machine (data/results/decode_step_qwen2.5-3b_bfloat16_cuda_h100_one-trace.json: Qwen2.5-3B's 36
  layers, whole and layer by layer).
- ``"layers"`` compiles each decoder layer instead and runs the rest (embedding, final norm, head)
  eagerly inside the same captured graph. The layers share one code object, and one trace serves
  them all: each layer is called with a view of its own cache layer (``_LayerCache``) instead of
  the model's cache, so the attention's ``cache.update(..., self.layer_idx)`` no longer indexes a
  list by the layer's index, which made dynamo specialise on it and trace every layer again (36
  traces for Qwen2.5-3B, inductor's cache serving 35 of the compiles). Fusions stop at layer
  boundaries (a residual add and the next norm), so the step costs a little more than the whole
  model's, for a first call many times shorter (the same record).
  ``RolloutConfig(compile="auto")`` picks it wherever the model has a decoder-layer list
  (``steppers.resolve_compile``).

Both modes trace without duck shapes (``torch.fx.experimental._config.use_duck_shape``): by
default dynamo gives two sizes that are equal at the first trace one symbol, so a step first traced
with as many rows as cache slots (16 and 16) holds only while they stay equal, and 8 rows compile
again. With a symbol per size one graph serves every row count past 1 (a size of 1 still
specialises; ``steppers.graph_ladder`` starts at 2 rows when the step is compiled). The setting is
process-wide, as dynamo's recompile caps are.

Their first calls trace under ``tracing()``, which makes dynamo treat Python floats as constants
(``specialize_float``). By default it traces them as symbols, and a model's float attributes (rope's
``attention_scaling``, the embedding's ``norm_type``) then fail AOTAutograd's pass that turns scalars
into tensors: dynamo restarts the whole frame with them specialised, after a full trace and most
of AOTAutograd. That wasted first attempt is a large share of a first compile, cold or warm
(loaded artifacts do not skip it: the attempt fails before its cache entry), by the compile phases
of data/results/defaults_qwen2.5-3b_bfloat16_cuda_cold.json and ..._warm.json; on the CPU,
data/results/compile_cost_tiny-qwen2-36l_float32_cpu_float-constants.json against
..._symbolic-floats.json (``scripts/compile_cost.py``, with and without ``--symbolic-floats``). The
setting is scoped to our traces (the CUDA-graph captures' warm-ups), so a trainer's own compiled
code in the process keeps torch's default, where a float that changes (a learning rate) does not
recompile.

The model itself is left alone (its other callers, HF's peers among them, stay eager): ``"layers"``
returns a shallow copy of the path from the model to its layer list, sharing every parameter, whose
list holds the compiled layers.

    forward = compile_forward(model, "layers")      # call it like the model
"""
from __future__ import annotations

import copy
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
import torch.fx.experimental._config as fx_config
from torch._dynamo.utils import counters

from rollout_lab.engine.kernels.batch_invariant import suspended
from rollout_lab.engine.sample.processors import select_tokens, token_logprobs
from rollout_lab.engine.sample.sampler import token_salts

COMPILE_MODES = ("model", "layers")


def decoder_layers(model: torch.nn.Module) -> str:
    """The dotted name of the model's decoder-layer list: the longest ``ModuleList`` whose items are
    all of one class (``model.layers`` for qwen2/qwen3/llama, ``model.decoder.layers`` for opt)."""
    best, best_len = None, 0
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) > best_len \
                and len({type(m) for m in module}) == 1:
            best, best_len = name, len(module)
    if best is None:
        raise ValueError(f"{type(model).__name__} has no list of decoder layers to compile one by one; "
                         "use compile=True (the whole model) or False")
    return best


def compile_forward(model: torch.nn.Module, mode: bool | str, *, backend: str = "inductor") -> Callable[..., Any]:
    """A callable like ``model`` whose forward is compiled (``mode``: one of ``COMPILE_MODES``; True
    is ``"model"``, as ``resolve_compile`` gives it)."""
    mode = "model" if mode is True else mode
    if mode not in COMPILE_MODES:
        raise ValueError(f"compile mode must be one of {list(COMPILE_MODES)}, got {mode!r}")
    fx_config.use_duck_shape = False  # a symbol per size: one graph for every row count > 1 (docstring)
    if mode == "model":
        return torch.compile(model, dynamic=True, backend=backend)
    name = decoder_layers(model)
    layers = model.get_submodule(name)
    *path, last = name.split(".")
    # the layers are one code object, each with its own guards, and every specialised size (a row
    # count of 1, the prefill classes) adds an entry per layer: raise dynamo's caps (8 entries per
    # code object, 256 in all) past what a depth of layers needs, or the last layers run eagerly
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, 8 * len(layers))
    config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, 16 * len(layers))
    root = shallow_copy(model)
    parent = root
    for part in path:  # copy the path down to the list's owner; the originals keep their modules
        child = shallow_copy(parent._modules[part])
        parent._modules[part] = child
        parent = child
    parent._modules[last] = torch.nn.ModuleList(
        [_LayerCall(torch.compile(layer, dynamic=True, backend=backend), index, layer)
         for index, layer in enumerate(layers)])
    return root


CACHE_KWARGS = ("cache", "past_key_values", "past_key_value")  # the cache argument's names across transformers


class _LayerCache:
    """One layer's view of a transformers ``Cache``: ``update`` writes to that layer whatever index
    it is given; anything else is the whole cache's. What a compiled layer is given instead of the
    cache, so its trace never depends on the layer's index (module docstring)."""

    def __init__(self, cache: Any, layer: Any):
        self._cache, self._layer = cache, layer

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        return self._layer.update(key_states, value_states, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cache, name)


class _LayerCall(torch.nn.Module):
    """A compiled decoder layer called with its own cache layer's view (``_LayerCache``). A cache
    without a layer at this index (one that grows its layers as they are written, or offloads them)
    is passed whole, as is any cache of a layer whose ``layer_idx`` is not its place in the list."""

    def __init__(self, compiled: Callable[..., Any], index: int, layer: torch.nn.Module):
        super().__init__()
        self.compiled, self.index = compiled, index
        attention_index = next((m.layer_idx for m in layer.modules() if isinstance(getattr(m, "layer_idx", None), int)),
                               index)
        self.viewable = attention_index == index

    def forward(self, *args, **kwargs):
        for name in CACHE_KWARGS:
            cache = kwargs.get(name)
            layers = getattr(cache, "layers", None)
            if self.viewable and layers is not None and self.index < len(layers) \
                    and not getattr(cache, "offloading", False):
                kwargs[name] = _LayerCache(cache, layers[self.index])
        return self.compiled(*args, **kwargs)


def compile_select(*, backend: str = "inductor") -> Callable[..., Any]:
    """``processors.select_tokens`` compiled with symbolic sizes: the penalty, the sampling filters, the
    seeded Gumbel noise and the argmax fused over the logits, instead of one kernel per op over
    ``[rows, vocab]`` int64 and float64 temporaries. For the CUDA-graph step only: Triton's int64
    arithmetic wraps as eager's does, so the draws equal eager's (``tests/test_compiling.py``);
    inductor's CPU C++ code does not (signed overflow is undefined there).

    The sampler's per-token salts (``sampling.token_salts``, made outside any trace) come in as an
    argument. Looked up inside the trace they break the graph, and the break splits the noise into
    one graph per function it passes through (uniforms, noise, noise added, argmax): four
    ``[rows, vocab]`` passes, each written to memory (``data/diagnostics/trace_long_tail_h100_037603b.txt``).
    One graph fuses them into the argmax's first stage."""
    fx_config.use_duck_shape = False
    compiled = torch.compile(select_tokens, dynamic=True, backend=backend)

    def select(logits: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        salts = token_salts(logits.shape[-1], logits.device) if kwargs.get("sampling") is not None else None
        return compiled(logits, *args, salts=salts, **kwargs)

    return select


def compile_invariant_select(*, backend: str = "inductor") -> Callable[..., Any]:
    """``select_tokens`` for a batch-invariant step (``RolloutConfig(batch_invariant=True)``): the
    token choice by ``compile_select`` with the invariant mode suspended, the log-probabilities
    after it under the mode (``processors.token_logprobs``: ``logsumexp`` by the trainer's row
    kernel, as ``sequence_logprobs(batch_invariant=True)`` takes it).

    Eager under the mode the choice is ~25 passes over ``[rows, vocab]`` int64 and float64
    temporaries, most of the invariant step at hundreds of rows. Compiled it stays invariant: the
    penalties, stop ids, temperature, top-k and the seeded Gumbel noise are element by element (the
    same expression for every row count, a row's bits its own) and its reductions take no sums
    (``row_argmax``, ``topk``). Top-p (a cumulative sum) and min-p (a softmax) do sum: a step whose
    rows use them keeps the eager choice, which the mode covers or refuses (``steppers.GraphStepper``)."""
    choose = compile_select(backend=backend)

    def select(logits: torch.Tensor, *, logprobs_mode: str | None = None, **kwargs: Any) -> Any:
        with suspended():
            tokens, _ = choose(logits, logprobs_mode=None, **kwargs)
        if logprobs_mode is None:
            return tokens, None
        processing = {k: kwargs.get(k) for k in ("penalties", "seen", "counts", "sampling", "steps",
                                                 "min_new_tokens", "stop_mask")}
        return tokens, token_logprobs(logits, tokens, mode=logprobs_mode, **processing)

    return select


@contextmanager
def tracing() -> Iterator[None]:
    """Dynamo's settings while a ``compile_forward`` / ``compile_select`` callable first runs (and
    traces): Python floats as constants, so no frame restarts (module docstring)."""
    with torch._dynamo.config.patch(specialize_float=True):
        yield


def shallow_copy(module: torch.nn.Module) -> torch.nn.Module:
    """A copy sharing parameters, buffers and hooks, with its own table of submodules."""
    twin = copy.copy(module)
    twin._modules = dict(module._modules)
    return twin


def compile_counts() -> dict[str, int]:
    """torch.compile's process-wide counts so far: frames compiled and graphs made."""
    return {"frames": int(counters["frames"]["ok"]), "graphs": int(counters["stats"]["unique_graphs"])}
