"""A decode attention for grouped-query models that never repeats the KV heads.

HF's ``sdpa`` path (5.17) materialises ``repeat_kv`` of the whole static cache twice per layer and
step, under CUDA-graph replay a large share of the decode step
(data/results/sweep_qwen2.5-3b_bfloat16_cuda_graph.json, with this attention, against
..._graph_sdpa.json, without). For one query token, the ``group`` query heads that share a KV head
can instead be treated as ``group`` query rows of that head: view the query as
``[B, kv_heads, group, head_dim]`` and call SDPA on the unrepeated cache; a ``[B, 1, 1, S]`` mask
broadcasts over the group. Prefill (q_len > 1) and anything unusual go to HF's own ``sdpa``
function unchanged. A packed prefill (one row of several prompts, ``packed_offsets``) attends per
prompt. When the decode step passes
``span_starts`` and ``span_front`` (``RolloutConfig(decode_attention="span")``), a decode token
attends with ``engine.kernels.span`` instead, over its row's live columns only; when it passes
``paged_tables`` and ``paged_positions`` (the ``paged`` route, ``engine.kv.paged``), the key and
value are a layer's block pools and it attends with ``engine.kernels.paged`` through the row's
block table; with ``prefix_group_of_row``, ``prefix_blocks`` and ``prefix_len`` as well, with
``engine.kernels.shared_prefix`` (each group's shared prompt blocks read once per group).

    use_gqa_decode_attention(model)   # registers ``rollout_gqa`` and switches the model to it

"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from rollout_lab.engine.kernels.paged import paged_attention
from rollout_lab.engine.kernels.shared_prefix import shared_prefix_attention
from rollout_lab.engine.kernels.span import span_attention

NAME = "rollout_gqa"
# engine.kernels.batch_invariant's attention: a model switched to it keeps it through our decode step
INVARIANT_NAME = "rollout_invariant"
_registered = False


# The one door to the decode kernels: each cache layout's attention over one query token, chosen by
# the keywords the decode step passes (engine.runner.decode): the paged route's block pools read
# through each row's block table (with its groups' shared prompt blocks read once per group when the
# step passes them too), or the aligned cache's live span of each row. Anything else (a prefill, the
# masked window) goes to SDPA. The first layout whose every keyword the step passes is taken.
DECODE_KERNELS = {
    "shared_prefix": (("paged_tables", "paged_positions", "prefix_group_of_row", "prefix_blocks", "prefix_len"),
                      shared_prefix_attention),  # key/value: [blocks, block, kv_heads, D]
    "paged": (("paged_tables", "paged_positions"), paged_attention),  # key/value: [blocks, block, kv_heads, D]
    "span": (("span_starts", "span_front"), span_attention),  # key/value: [rows, kv_heads, width, D]
}
POOL_LAYOUTS = ("shared_prefix", "paged")  # key and value are a layer's block pools


def decode_layout(kwargs: dict) -> tuple[str | None, tuple]:
    """(the first cache layout whose keywords ``kwargs`` all carry, their values); (None, ()) for
    none. Every layout's keywords are popped: HF's SDPA must not see them."""
    names = dict.fromkeys(name for keys, _ in DECODE_KERNELS.values() for name in keys)
    given = {name: kwargs.pop(name) for name in names if name in kwargs}
    given = {name: value for name, value in given.items() if value is not None}
    for layout, (keys, _) in DECODE_KERNELS.items():
        if all(name in given for name in keys):
            return layout, tuple(given[name] for name in keys)
    return None, ()


def gqa_decode_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                         is_causal=None, **kwargs):
    layout, args = decode_layout(kwargs)
    offsets = kwargs.pop("packed_offsets", None)
    groups = getattr(module, "num_key_value_groups", 1)
    batch, heads, q_len, head_dim = query.shape  # [B, H, q, D]
    scale = head_dim ** -0.5 if scaling is None else scaling
    if layout in POOL_LAYOUTS:  # key/value are the layer's pools: no other attention can read them
        return DECODE_KERNELS[layout][1](query, key, value, *args, scale), None  # [B, 1, H, D]
    if offsets is not None:  # a packed prefill: each prompt attends causally to itself only
        return packed_segments_attention(query, key, value, offsets, scaling), None
    plain = (
        q_len != 1 or dropout or kwargs.get("softcap") is not None
        or kwargs.get("position_bias") is not None or key.shape[-1] != value.shape[-1]
        or kwargs.get("sliding_window") is not None
        or (attention_mask is not None and (attention_mask.dim() != 4 or attention_mask.shape[1] != 1))
    )
    if not plain and layout is not None:  # each row's live span only (engine.kernels.span)
        return DECODE_KERNELS[layout][1](query, key, value, *args, scale), None  # [B, 1, H, D]
    if plain or groups == 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    q = query.reshape(batch, heads // groups, groups, head_dim)  # [B, kv_heads, group, D]
    out = F.scaled_dot_product_attention(q, key, value, attn_mask=attention_mask, scale=scaling)
    return out.reshape(batch, heads, 1, head_dim).transpose(1, 2).contiguous(), None  # [B, 1, H, D]


def packed_segments_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                              offsets: tuple[int, ...], scaling: float | None) -> torch.Tensor:
    """Causal SDPA per prompt of a packed row: ``query`` ``[1, H, T, D]``, ``key``/``value``
    ``[1, KVH, T, D]``, prompt i at tokens ``[offsets[i], offsets[i + 1])``; ``[1, T, H, D]``."""
    if query.shape[0] != 1 or offsets[0] != 0 or offsets[-1] != query.shape[2]:
        raise ValueError(f"a packed prefill is one row of {offsets[-1]} tokens, got query {tuple(query.shape)}")
    gqa = key.shape[1] != query.shape[1]
    parts = [
        F.scaled_dot_product_attention(query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], is_causal=True,
                                       scale=scaling, enable_gqa=gqa)
        for a, b in zip(offsets[:-1], offsets[1:])
    ]
    return torch.cat(parts, dim=2).transpose(1, 2).contiguous()


def register() -> str:
    """Register ``rollout_gqa`` with transformers' attention and mask interfaces (idempotent)."""
    global _registered
    if not _registered:
        AttentionInterface.register(NAME, gqa_decode_attention)
        AttentionMaskInterface.register(NAME, sdpa_mask)
        _registered = True
    return NAME


def use_gqa_decode_attention(model: torch.nn.Module) -> torch.nn.Module:
    """Switch ``model`` (in place) to the ``rollout_gqa`` attention; returns the model."""
    register()
    set_attn_implementation(model, NAME)
    return model


def set_attn_implementation(model: torch.nn.Module, name: str) -> None:
    """Switch ``model`` to HF's attention ``name``: with the rest of this module, the one place that
    changes a model's attention (HF's ``generate_batch`` switches to a paged one; a sweep puts its
    own back with this)."""
    if getattr(model.config, "_attn_implementation", None) == name:
        return
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    else:  # older 5.x
        model.config._attn_implementation = name


def is_grouped_query(model: torch.nn.Module) -> bool:
    cfg = model.config.get_text_config(decoder=True)
    heads = cfg.num_attention_heads
    return (getattr(cfg, "num_key_value_heads", None) or heads) < heads


@contextmanager
def rollout_attention(model: torch.nn.Module, *, every_sdpa_model: bool = False,
                      every_model: bool = False) -> Iterator[None]:
    """Within the block, an ``sdpa`` grouped-query model attends with ``rollout_gqa``; with
    ``every_sdpa_model``, every ``sdpa`` model does (for span decode and packed prefill, which
    pass ``span_starts``/``span_front`` or ``packed_offsets``); with ``every_model`` every model
    does, whatever its implementation (paged decode: no other attention reads block pools).

    Used around our own decode step (and so baked into its CUDA graph) and packed prefill only,
    so that HF's own paths on the same model (nocb, the peers) keep the stock ``sdpa``.
    """
    config = model.config
    current = getattr(config, "_attn_implementation", None)
    if current == INVARIANT_NAME:  # inside engine.kernels.batch_invariant: it serves every layout
        yield
        return
    if not every_model and (current != "sdpa" or not (every_sdpa_model or is_grouped_query(model))):
        yield
        return
    register()
    config._attn_implementation = NAME
    try:
        yield
    finally:
        config._attn_implementation = current
