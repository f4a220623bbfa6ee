"""Shared fixtures: tiny fp32 models (one per family, built once) and the single-request HF oracle."""
from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig

from rollout_lab.measure.models import TINY_FAMILIES, tiny_model

torch.set_num_threads(1)  # tiny models: threads only contend on a shared 2-core machine

_MODELS: dict[tuple[str, str], torch.nn.Module] = {}


def get_tiny(family: str, attn_implementation: str = "sdpa") -> torch.nn.Module:
    key = (family, attn_implementation)
    if key not in _MODELS:
        _MODELS[key] = tiny_model(family, seed=0, attn_implementation=attn_implementation)
    return _MODELS[key]


@pytest.fixture(params=TINY_FAMILIES)
def family(request) -> str:
    return request.param


class Oracle:
    """Independent, unpadded, one-request-at-a-time HF ``generate`` (greedy), memoised."""

    def __init__(self) -> None:
        self._memo: dict = {}

    def __call__(self, model, prompts, *, max_new_tokens, eos_token_id=None, repetition_penalty=1.0):
        return [
            self.one(model, p, max_new_tokens, eos_token_id, repetition_penalty) for p in prompts
        ]

    def one(self, model, prompt, max_new_tokens, eos_token_id, repetition_penalty):
        eos = tuple(eos_token_id) if isinstance(eos_token_id, (list, tuple)) else eos_token_id
        key = (id(model), tuple(prompt), max_new_tokens, eos, repetition_penalty)
        if key not in self._memo:
            config = GenerationConfig(
                max_new_tokens=max_new_tokens, do_sample=False, num_beams=1,
                eos_token_id=list(eos) if isinstance(eos, tuple) else eos,
                pad_token_id=0, repetition_penalty=float(repetition_penalty),
            )
            saved = model.generation_config
            model.generation_config = GenerationConfig()  # no eos from the model's defaults
            try:
                with torch.no_grad():
                    out = model.generate(torch.tensor([list(prompt)]), generation_config=config)
            finally:
                model.generation_config = saved
            tokens = out[0, len(prompt):].tolist()
            stop = {eos} if isinstance(eos, int) else set(eos or ())
            for i, token in enumerate(tokens):
                if token in stop:
                    tokens = tokens[: i + 1]
                    break
            self._memo[key] = tokens
        return self._memo[key]


_ORACLE = Oracle()


@pytest.fixture
def oracle() -> Oracle:
    return _ORACLE
