"""Chunked prefill of one over-long prompt: its tail chunks, run in order after its head.

The planner (``planner.plan_chunked``) cuts a prompt of more than ``prefill_max_tokens`` tokens into
a head, prefilled in an ordinary bucket (``decode.prefill_bucket``, possibly beside short prompts),
and tail chunks of exactly the limit. ``extend_prefill`` runs the tails one forward each over a
``DynamicCache`` that already holds the head (and then every earlier chunk), with position ids
continuing from it, so chunk k attends to chunks < k; the caller copies the whole span into the
prompt's slot (``AlignedKVCache.admit``) and takes the first token from the last chunk's logits.

    logits, layer_kv = extend_prefill(model, head_kv, [prompt[h:h + c], ...], cache_kwarg="cache")
"""
from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Callable, Sequence

import torch
from transformers import DynamicCache


def head_kv_of_row(
    layer_kv: Sequence[tuple[torch.Tensor, torch.Tensor]], row: int, head_length: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Row ``row``'s effective (last ``head_length``) columns of a left-padded bucket's KV."""
    return [(k[row : row + 1, :, -head_length:], v[row : row + 1, :, -head_length:]) for k, v in layer_kv]


@torch.no_grad()
def extend_prefill(
    model: torch.nn.Module,
    head_kv: Sequence[tuple[torch.Tensor, torch.Tensor]],
    chunks: Sequence[Sequence[int]],
    *,
    cache_kwarg: str,
    record: Callable[[int, int], AbstractContextManager] | None = None,
) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Forwards of ``chunks`` after ``head_kv`` (per layer, ``[1, kv_heads, head, head_dim]``):
    (last logits ``[1, vocab]``, per-layer (keys, values) of the whole prompt). Each forward runs
    inside ``record(width, offset)`` (the profile's ``Timer.record``) when given."""
    if not chunks:
        raise ValueError("extend_prefill needs at least one chunk")
    device = next(model.parameters()).device
    cache = DynamicCache(config=model.config)
    for layer, (keys, values) in enumerate(head_kv):
        cache.update(keys, values, layer)
    offset = head_kv[0][0].shape[2]
    out = None
    for chunk in chunks:
        ids = torch.tensor([list(chunk)], dtype=torch.long, device=device)  # [1, width]
        positions = torch.arange(offset, offset + len(chunk), device=device)[None]  # [1, width]
        with record(len(chunk), offset) if record is not None else nullcontext():
            out = model(input_ids=ids, position_ids=positions, use_cache=True, logits_to_keep=1,
                        **{cache_kwarg: cache})
        offset += len(chunk)
    return out.logits[:, -1], [(layer.keys, layer.values) for layer in cache.layers]
