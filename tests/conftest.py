"""Shared fixtures: tiny fp32 models (one per family, built once) and the single-request HF oracle;
``one_fast``, which keeps one case of a costly parametrized test in make test-fast."""
from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from transformers import GenerationConfig

from rollout_lab.measure.models import TINY_FAMILIES, TINY_VOCAB_SIZE, tiny_model

ROOT = Path(__file__).resolve().parents[1]


def run_interpreted(script: str) -> str:
    """Run ``script`` in a fresh interpreter with ``TRITON_INTERPRET=1`` (read when Triton kernels are
    defined, so a CPU test of a kernel runs in its own process), the repository and tests/ on its
    path; its stdout (it must exit 0)."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'tests'}")
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout

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


def one_fast(cases: Sequence, fast) -> list:
    """``cases`` to parametrize a costly test with: ``fast`` runs in make test-fast, every other case is
    marked slow (make test runs them all). A case is a value, or a tuple of values for several argnames."""
    if fast not in cases:
        raise ValueError(f"the fast case {fast!r} is not one of the cases {cases!r}")
    return [case if case == fast else pytest.param(*(case if isinstance(case, tuple) else (case,)),
                                                   marks=pytest.mark.slow)
            for case in cases]


class Oracle:
    """Independent, unpadded, one-request-at-a-time HF ``generate`` (greedy), memoised."""

    def __init__(self) -> None:
        self._memo: dict = {}

    def __call__(self, model, prompts, *, max_new_tokens, eos_token_id=None, repetition_penalty=1.0,
                 min_new_tokens=0):
        """``max_new_tokens`` and ``min_new_tokens``: an int for all, or one per prompt."""
        budgets = max_new_tokens if isinstance(max_new_tokens, list) else [max_new_tokens] * len(prompts)
        minimums = min_new_tokens if isinstance(min_new_tokens, list) else [min_new_tokens] * len(prompts)
        return [
            self.one(model, p, b, eos_token_id, repetition_penalty, m) for p, b, m in zip(prompts, budgets, minimums)
        ]

    def one(self, model, prompt, max_new_tokens, eos_token_id, repetition_penalty, min_new_tokens=0):
        eos = tuple(eos_token_id) if isinstance(eos_token_id, (list, tuple)) else eos_token_id
        key = (id(model), tuple(prompt), max_new_tokens, eos, repetition_penalty, min_new_tokens)
        if key not in self._memo:
            config = GenerationConfig(
                max_new_tokens=max_new_tokens, do_sample=False, num_beams=1,
                eos_token_id=list(eos) if isinstance(eos, tuple) else eos,
                pad_token_id=0, repetition_penalty=float(repetition_penalty),
                min_new_tokens=min_new_tokens or None,
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


@pytest.fixture
def no_forward(monkeypatch):
    """The tiny qwen2 with a forward that fails the test: for checks that must run before any model work."""
    model = get_tiny("qwen2")
    monkeypatch.setattr(model, "forward", lambda *a, **k: pytest.fail("a forward ran despite bad input"))
    return model


@pytest.fixture(scope="session")
def tokenizer():
    """A real HF fast tokenizer over the tiny models' ids ("w0", "w1", ...), with a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(TINY_VOCAB_SIZE)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="w1"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="w1", pad_token="w0", eos_token="w2")
    tok.chat_template = ("{% for m in messages %}w3 {{ m['content'] }} {% endfor %}"
                         "{% if add_generation_prompt %}w4{% endif %}")
    return tok


class CharTokenizer:
    """A tokenizer stand-in for stop strings: id i decodes to ``PIECES[i % 7]`` (one or two characters,
    so a stop string can end inside a token or span several); id 0 is special (skipped when asked)."""

    PIECES = ("a", "b", "#", "\n", "ab", "##", "b\n")

    def decode(self, ids, skip_special_tokens=False) -> str:
        return "".join(self.PIECES[t % len(self.PIECES)] for t in ids if not (skip_special_tokens and t == 0))

    def batch_decode(self, rows, skip_special_tokens=False) -> list[str]:
        return [self.decode(row, skip_special_tokens) for row in rows]
