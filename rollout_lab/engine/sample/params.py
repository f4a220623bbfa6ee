"""One request's sampling settings, vLLM's ``SamplingParams``: how its tokens are drawn, how many
samples it gets, their budgets and minimums, their penalties and what stops them.

    SamplingParams(temperature=0.8, top_p=0.95, min_p=0.05, n=4, max_tokens=256,
                   presence_penalty=0.5, frequency_penalty=0.2, stop=["\\n\\n"], stop_token_ids=[7])

A field left at None takes the call's value (``Rollout.generate``'s ``num_samples``,
``max_new_tokens``, ``min_new_tokens``, ``stop``, ``stop_token_ids``; the config's
``repetition_penalty``), so a list of them can set only what differs per request. Every field is
honoured per request on every route (``engine.sample.processors`` for the penalties,
``engine.sample.sampler`` for the filters and the draw, the schedulers for the stops).

The penalties follow vLLM's definitions: ``repetition_penalty`` (HF's rule, > 1 discourages) over the
ids of the prompt and the output, ``presence_penalty`` subtracted once from every id the output holds,
``frequency_penalty`` subtracted once per occurrence in the output (both in [-2, 2], 0 = off).
``min_p`` (in [0, 1], 0 = off) drops the ids whose probability, after the temperature, is below
``min_p`` times the most likely id's.

"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from rollout_lab.planner.checks import MAX_INT, as_int, check_int

MIN_TEMPERATURE = 1e-5  # logits of |x| <= ~1e30 stay finite in fp32 after dividing by it
MAX_PENALTY = 2.0  # presence and frequency penalties lie in [-MAX_PENALTY, MAX_PENALTY] (vLLM's range)
MAX_SAMPLES = 2**16  # samples of one request at most: each is a row with its own slot and state


def check_seed(seed: object, *, name: str = "seed") -> int | None:
    """``seed`` when it is None or a Python int in [0, 2**64); else a ValueError naming it. A numpy or
    tensor int is refused by name: the seed is used as given, and a numpy int overflows the 64-bit
    key arithmetic."""
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**64):
        hint = " (pass int(seed))" if as_int(seed) is not None else ""
        raise ValueError(f"{name} must be an int in [0, 2**64) or None, got {seed!r}{hint}")
    return seed


def _number(value: Any, *, name: str, low: float, high: float, what: str) -> float:
    """``value`` as a float in [low, high]; a ValueError naming ``name`` and the range otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not low <= value <= high:
        raise ValueError(f"{name} must be {what}, got {value!r}")
    return float(value)


def _strings(value: Any, *, name: str) -> tuple[str, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)) or \
            not all(isinstance(s, str) and s for s in value):
        raise ValueError(f"{name} must be a list of non-empty strings or None, got {value!r}")
    return tuple(value)


def _ids(value: Any, *, name: str) -> tuple[int, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
        raise ValueError(f"{name} must be a list of token ids or None, got {value!r}")
    ids = tuple(as_int(t) for t in value)
    if any(i is None or i < 0 for i in ids):
        raise ValueError(f"{name} must hold non-negative token ids, got {value!r}")
    return ids


@dataclass(frozen=True)
class SamplingParams:
    """One request's sampling (vLLM's fields and defaults; module docstring).

    ``temperature`` 0 is greedy (vLLM's rule: top-k, top-p and min-p then have nothing to filter; the
    penalties still apply); ``top_k`` 0 (or vLLM's -1) and ``top_p`` 1.0 are off. A request's own
    ``seed`` keys its draws as request 0 of a call with that seed (``sample_key(seed, 0, sample)``),
    so it draws the same tokens wherever it sits in a batch; without one it is keyed by the call's
    seed and its index."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None  # None: RolloutConfig.repetition_penalty
    n: int | None = None  # samples of this request; None: the call's num_samples
    max_tokens: int | None = None  # None: the call's max_new_tokens
    min_tokens: int | None = None  # None: the call's min_new_tokens
    stop: tuple[str, ...] | None = None  # None: the call's stop strings
    stop_token_ids: tuple[int, ...] | None = None  # None: the call's stop ids

    def __post_init__(self) -> None:
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
        if 0 < t < MIN_TEMPERATURE:
            raise ValueError(f"temperature={t!r} is below {MIN_TEMPERATURE}: the logits divided by it overflow "
                             "fp32; for its limit use greedy decoding (temperature=0)")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be an int >= 0 (0 or -1 = off), got {self.top_k!r}")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
            raise ValueError(f"top_p must be a number in (0, 1] (1 = off), got {p!r}")
        check_seed(self.seed)
        set_ = object.__setattr__
        set_(self, "temperature", float(t))
        set_(self, "top_p", float(p))
        set_(self, "top_k", max(0, self.top_k))  # vLLM's -1 is off, as 0
        set_(self, "min_p", _number(self.min_p, name="min_p", low=0.0, high=1.0, what="a number in [0, 1] (0 = off)"))
        for name in ("presence_penalty", "frequency_penalty"):
            set_(self, name, _number(getattr(self, name), name=name, low=-MAX_PENALTY, high=MAX_PENALTY,
                                     what=f"a number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}] (0 = off)"))
        penalty = self.repetition_penalty
        if penalty is not None:
            if isinstance(penalty, bool) or not isinstance(penalty, (int, float)) or not 0 < penalty < math.inf:
                raise ValueError(f"repetition_penalty must be a finite number > 0 (1 = off) or None, got {penalty!r}")
            set_(self, "repetition_penalty", float(penalty))
        if self.n is not None:
            set_(self, "n", check_int(self.n, name="n", maximum=MAX_SAMPLES, or_none=True))
        if self.max_tokens is not None:
            set_(self, "max_tokens", check_int(self.max_tokens, name="max_tokens", or_none=True))
        if self.min_tokens is not None:
            set_(self, "min_tokens", check_int(self.min_tokens, name="min_tokens", minimum=0, maximum=MAX_INT,
                                               or_none=True))
        if self.max_tokens is not None and self.min_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens={self.min_tokens} exceeds max_tokens={self.max_tokens}")
        if self.stop is not None:
            set_(self, "stop", _strings(self.stop, name="stop"))
        if self.stop_token_ids is not None:
            set_(self, "stop_token_ids", _ids(self.stop_token_ids, name="stop_token_ids"))

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        """Whether any penalty changes the scores (a repetition penalty of None is the config's)."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or \
            (self.repetition_penalty is not None and self.repetition_penalty != 1.0)
