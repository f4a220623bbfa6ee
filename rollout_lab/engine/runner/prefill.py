"""Prefill of one bucket: left-pad its prompts, run one forward into a temporary cache, and return
the last logits and each layer's KV for the aligned cache to admit.
"""
from __future__ import annotations

import inspect
from typing import Sequence

import torch
from transformers import DynamicCache

from rollout_lab.engine.kernels.attention import rollout_attention


def cache_kwarg_name(model: torch.nn.Module) -> str:
    """transformers renamed ``past_key_values`` to ``cache`` in the forward signatures (5.2x)."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


@torch.no_grad()
def left_padded(
    prompts: Sequence[Sequence[int]], pad_token_id: int, device: torch.device | str, width: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)``, both ``[rows, width]`` long on ``device``, padded on the left
    (``width``: default the longest prompt)."""
    width = max(len(p) for p in prompts) if width is None else width
    ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(list(prompt), dtype=torch.long)
        mask[row, width - len(prompt):] = 1
    return ids.to(device), mask.to(device)


def check_class_shape(prompts: Sequence[Sequence[int]], rows: int | None, width: int | None) -> None:
    """A ``ValueError`` unless the (``rows``, ``width``) class holds ``prompts`` (None: any)."""
    longest = max(len(p) for p in prompts)
    if (rows is not None and rows < len(prompts)) or (width is not None and width < longest):
        raise ValueError(f"class shape ({rows}, {width}) cannot hold {len(prompts)} prompts of up to {longest} tokens")


def class_batch(
    prompts: Sequence[Sequence[int]], pad_token_id: int, device: torch.device | str,
    rows: int | None = None, width: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask, position_ids)`` of a bucket at its (``rows``, ``width``) class:
    left-padded to ``width``, the first prompt repeated up to ``rows`` (None: as they are)."""
    check_class_shape(prompts, rows, width)
    padded = list(prompts) + [prompts[0]] * ((rows or len(prompts)) - len(prompts))
    ids, attention = left_padded(padded, pad_token_id, device, width)
    return ids, attention, (attention.cumsum(-1) - 1).clamp_(min=0)  # each [rows, width]


def prefill_bucket(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    *,
    pad_token_id: int,
    cache_kwarg: str,
    rows: int | None = None,
    width: int | None = None,
) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """One left-padded forward of ``prompts``: (last logits [rows, vocab], per-layer (keys, values)).

    ``rows``/``width`` (a shape class, ``planner.shape_classes``): the forward runs at that shape,
    left-padded to ``width`` and with the first prompt repeated up to ``rows``; what it returns
    covers the real prompts only, and the KV only the columns of the longest one."""
    longest, real = max(len(p) for p in prompts), len(prompts)
    ids, attention, positions = class_batch(prompts, pad_token_id, next(model.parameters()).device, rows, width)
    has_padding = bool((attention == 0).any())
    temp = DynamicCache(config=model.config)
    out = model(
        input_ids=ids,
        attention_mask=attention if has_padding else None,
        position_ids=positions,
        use_cache=True,
        logits_to_keep=1,
        **{cache_kwarg: temp},
    )
    layer_kv = [(layer.keys[:real, :, -longest:], layer.values[:real, :, -longest:]) for layer in temp.layers]
    return out.logits[:real, -1], layer_kv


PACKED_BACKENDS = ("segments", "masked")


def packed_backend(model: torch.nn.Module) -> str:
    """How a packed prefill attends: "segments" (``engine.kernels.attention``: causal SDPA per prompt, no
    mask) for ``sdpa`` models, else "masked" (one forward with a block-diagonal causal mask, which
    any attention implementation that takes an additive 4-D mask runs)."""
    return "segments" if getattr(model.config, "_attn_implementation", None) == "sdpa" else "masked"


def block_diagonal_mask(lengths: Sequence[int], dtype: torch.dtype, device) -> torch.Tensor:
    """``[1, 1, T, T]`` additive mask: token t of prompt i sees prompt i's tokens up to t only."""
    total = sum(lengths)
    doc = torch.repeat_interleave(torch.arange(len(lengths), device=device),
                                  torch.tensor(list(lengths), device=device))  # [T]
    pos = torch.arange(total, device=device)
    keep = (doc[:, None] == doc[None, :]) & (pos[None, :] <= pos[:, None])
    mask = torch.zeros(total, total, dtype=dtype, device=device)
    return mask.masked_fill_(~keep, torch.finfo(dtype).min)[None, None]


@torch.no_grad()
def prefill_packed(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    *,
    cache_kwarg: str,
    backend: str | None = None,
) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]], list[int]]:
    """One forward of ``prompts`` packed into one row of sum(L) tokens, positions restarting per
    prompt: (last logits [n, vocab], per-layer (keys, values) ``[1, kv_heads, T, head_dim]``, each
    prompt's first token offset). ``backend``: ``PACKED_BACKENDS`` (default ``packed_backend``)."""
    backend = packed_backend(model) if backend is None else backend
    if backend not in PACKED_BACKENDS:
        raise ValueError(f"backend must be one of {list(PACKED_BACKENDS)}, got {backend!r}")
    device = next(model.parameters()).device
    lengths = [len(p) for p in prompts]
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    ids = torch.tensor([[t for p in prompts for t in p]], dtype=torch.long, device=device)  # [1, T]
    positions = torch.cat([torch.arange(n, device=device) for n in lengths])[None]  # [1, T]
    last = torch.tensor(offsets[1:], device=device) - 1  # [n]
    temp = DynamicCache(config=model.config)
    common = dict(input_ids=ids, position_ids=positions, use_cache=True, logits_to_keep=last,
                  **{cache_kwarg: temp})
    if backend == "segments":
        with rollout_attention(model, every_sdpa_model=True):
            out = model(attention_mask=None, packed_offsets=tuple(offsets), **common)
    else:
        dtype = next(model.parameters()).dtype
        out = model(attention_mask=block_diagonal_mask(lengths, dtype, device), **common)
    layer_kv = [(layer.keys, layer.values) for layer in temp.layers]
    return out.logits[0], layer_kv, offsets[:-1]
