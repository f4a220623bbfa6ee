"""The Hugging Face peers of a sweep, and the one-request oracle: each returns generated ids per prompt.

    hf_generate(model, prompts, max_new_tokens=16, pad_token_id=0, cache_implementation="static")
    hf_generate_batch(model, prompts, max_new_tokens=16, pad_token_id=0)
    oracle_sequences(model, prompts, max_new_tokens=16)

EOS is disabled for timings: ``min_new_tokens = max_new_tokens`` (and the tiny/preset models carry
no EOS id), so every row generates exactly ``max_new_tokens`` tokens.

"""
from __future__ import annotations

from typing import Sequence

import torch
from transformers import GenerationConfig

from rollout_lab.engine.runner.prefill import left_padded


@torch.no_grad()
def hf_generate(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    pad_token_id: int,
    cache_implementation: str | None = None,
    repetition_penalty: float = 1.0,
) -> list[list[int]]:
    """Greedy HF ``generate`` of the left-padded batch; ``"static"`` auto-compiles on CUDA."""
    device = next(model.parameters()).device
    ids, mask = left_padded(prompts, pad_token_id, device)
    extra = {"cache_implementation": cache_implementation} if cache_implementation else {}
    if repetition_penalty != 1.0:
        extra["repetition_penalty"] = repetition_penalty
    out = model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad_token_id, **extra,
    )  # [rows, width + max_new_tokens]
    return out[:, ids.shape[1]:].tolist()


def hf_generate_batch(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    pad_token_id: int,
) -> list[list[int]]:
    """HF continuous batching (``model.generate_batch``); it drops the repetition penalty.

    generate_batch logs failures and returns what it has, so a missing, failed or short request
    is raised here as a RuntimeError (the sweep records it as the reason the path was skipped).
    Not under ``inference_mode``: its worker thread updates tensors that the caller's thread makes.
    """
    if not hasattr(model, "generate_batch"):
        raise RuntimeError("this transformers version has no model.generate_batch")
    config = GenerationConfig(
        max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
        eos_token_id=None, pad_token_id=pad_token_id,
    )
    results = model.generate_batch(inputs=[list(p) for p in prompts], generation_config=config,
                                   progress_bar=False, **cb_sizing(model, prompts, max_new_tokens))
    outputs = list(results.values())
    if len(outputs) != len(prompts):
        raise RuntimeError(f"generate_batch returned {len(outputs)} of {len(prompts)} requests")
    sequences = []
    for out in outputs:
        if out.error is not None:
            raise RuntimeError(f"generate_batch request {out.request_id} failed: {out.error}")
        if len(out.generated_tokens) != max_new_tokens:
            raise RuntimeError(
                f"generate_batch request {out.request_id} generated {len(out.generated_tokens)} "
                f"tokens, expected {max_new_tokens}"
            )
        sequences.append(list(out.generated_tokens))
    return sequences


def cb_sizing(model: torch.nn.Module, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> dict:
    """The keyword arguments that size HF continuous batching's paged cache to ``prompts`` and
    ``max_new_tokens`` off CUDA, where HF sizes it to host memory (14.7 GB for four tiny prompts, or
    an OOM kill); on CUDA none (HF's own sizing, as its users get it)."""
    if next(model.parameters()).device.type == "cuda":
        return {}
    return {"continuous_batching_config": _sized_cb_config(prompts, max_new_tokens)}


def _sized_cb_config(prompts: Sequence[Sequence[int]], max_new_tokens: int):
    try:  # its home moved between transformers 5.x releases
        from transformers import ContinuousBatchingConfig
    except ImportError:
        from transformers.generation.configuration_utils import ContinuousBatchingConfig
    page = 64
    num_blocks = sum(-(-(len(p) + max_new_tokens) // page) for p in prompts) + 4
    return ContinuousBatchingConfig(
        page_size=page, num_blocks=num_blocks, max_batch_tokens=max(256, sum(len(p) for p in prompts)),
        max_requests_per_batch=len(prompts),
    )


@torch.no_grad()
def oracle_sequences(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    repetition_penalty: float = 1.0,
) -> list[list[int]]:
    """The correctness oracle: unpadded, one-request-at-a-time greedy HF ``generate``."""
    device = next(model.parameters()).device
    extra = {"repetition_penalty": repetition_penalty} if repetition_penalty != 1.0 else {}
    sequences = []
    for prompt in prompts:
        ids = torch.tensor([list(prompt)], dtype=torch.long, device=device)
        out = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens, do_sample=False, **extra,
        )
        sequences.append(out[0, ids.shape[1]:].tolist())
    return sequences
