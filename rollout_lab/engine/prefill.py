"""Prefill of one bucket: left-pad its prompts, run one forward into a temporary cache, and return
the last logits and each layer's KV for the aligned cache to admit.
"""
from __future__ import annotations

import inspect
from typing import Sequence

import torch
from transformers import DynamicCache


def cache_kwarg_name(model: torch.nn.Module) -> str:
    """transformers renamed ``past_key_values`` to ``cache`` in the forward signatures (5.2x)."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


@torch.no_grad()
def left_padded(
    prompts: Sequence[Sequence[int]], pad_token_id: int, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)``, both ``[rows, width]`` long on ``device``, padded on the left."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(list(prompt), dtype=torch.long)
        mask[row, width - len(prompt):] = 1
    return ids.to(device), mask.to(device)


def prefill_bucket(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    *,
    pad_token_id: int,
    cache_kwarg: str,
) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """One left-padded forward of ``prompts``: (last logits [rows, vocab], per-layer (keys, values))."""
    ids, attention = left_padded(prompts, pad_token_id, next(model.parameters()).device)
    has_padding = any(len(p) != ids.shape[1] for p in prompts)
    positions = (attention.cumsum(-1) - 1).clamp_(min=0)  # [rows, width]
    temp = DynamicCache(config=model.config)
    out = model(
        input_ids=ids,
        attention_mask=attention if has_padding else None,
        position_ids=positions,
        use_cache=True,
        logits_to_keep=1,
        **{cache_kwarg: temp},
    )
    layer_kv = [(layer.keys, layer.values) for layer in temp.layers]
    return out.logits[:, -1], layer_kv
