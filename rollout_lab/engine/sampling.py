"""Seeded sampling that gives the same tokens on every route: counter-based Gumbel-max on device.

A sampled row's randomness is a pure function of (seed, request index, sample index, step), never
of its slot, its batch, the bucket plan or the refill order. Each (request, sample) pair has a
64-bit key, ``sample_key(seed, request, sample)``; at step t (the number of tokens the row has
generated so far, 0 for the token chosen from the prefill logits) token v gets the uniform

    u[v] = splitmix64(mix64(key + mix64(t)) + (v + 1) * GOLDEN) >> 11, over 2^53, in (0, 1)

and the token is ``argmax(filtered_logits / temperature - log(-log(u)))`` (Gumbel-max: an exact
draw from softmax(filtered_logits / temperature)). It is all elementwise int64 / float ops of a
static shape, with no generator objects and no host syncs, so the CUDA-graph-captured decode step
can run it. Filtering follows HF's order: repetition penalty, temperature, top-k, top-p; ties at
a top-k / top-p threshold are kept (the threshold is a value, not a sorted position).

    params = SamplingParams(temperature=0.8, top_p=0.95)
    tokens = sample_tokens(logits, keys, steps, params)   # [rows] ids

"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_MUL1 = 0xBF58476D1CE4E5B9
_MUL2 = 0x94D049BB133111EB


def _signed(value: int) -> int:
    """A 64-bit pattern as the int64 that holds it."""
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


def _mix64_int(z: int) -> int:
    """splitmix64's finaliser on Python ints (64-bit wrap)."""
    z &= _MASK64
    z = ((z ^ (z >> 30)) * _MUL1) & _MASK64
    z = ((z ^ (z >> 27)) * _MUL2) & _MASK64
    return z ^ (z >> 31)


def sample_key(seed: int, request: int, sample: int) -> int:
    """The int64 key of (seed, request index, sample index); a pure function of the three."""
    z = _mix64_int(seed + _GOLDEN)
    z = _mix64_int(z + (request + 1) * _GOLDEN)
    z = _mix64_int(z + (sample + 1) * _GOLDEN)
    return _signed(z)


def _shr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's ``>>`` is arithmetic)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def _mix64(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 tensors; int64 multiplication wraps like uint64's."""
    z = (z ^ _shr(z, 30)) * _signed(_MUL1)
    z = (z ^ _shr(z, 27)) * _signed(_MUL2)
    return z ^ _shr(z, 31)


_SALTS: dict[tuple[int, torch.device], torch.Tensor] = {}


@torch.compiler.disable
def token_salts(vocab_size: int, device: torch.device) -> torch.Tensor:
    """[vocab] int64 ``(id + 1) * GOLDEN`` (64-bit wrap), each token id's term of the hash, made once
    per vocabulary and device. A tensor that compiled code loads: traced as ``arange * GOLDEN``,
    inductor folds the 64-bit constant into its 32-bit index arithmetic, which Triton refuses."""
    key = (vocab_size, torch.device(device))
    if key not in _SALTS:
        _SALTS[key] = torch.arange(1, vocab_size + 1, dtype=torch.long, device=device) * _signed(_GOLDEN)
    return _SALTS[key]


def uniforms(keys: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, vocab] float64 in (0, 1): the uniforms of each row's (key, step), per token id."""
    base = _mix64(keys + _mix64(steps))  # [rows]
    salts = token_salts(vocab_size, keys.device)  # [vocab]
    bits = _shr(_mix64(base[:, None] + salts[None, :]), 11)  # [rows, vocab], 53 bits
    return (bits.to(torch.float64) + 0.5) * (1.0 / 2**53)


def gumbel_noise(keys: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, vocab] float32 standard Gumbel noise, -log(-log(u))."""
    u = uniforms(keys, steps, vocab_size)
    return (-torch.log(-torch.log(u))).to(torch.float32)


MIN_TEMPERATURE = 1e-5  # logits of |x| <= ~1e30 stay finite in fp32 after dividing by it


@dataclass(frozen=True)
class SamplingParams:
    """Temperature, top-k (0 = off) and top-p (1.0 = off) of seeded sampling."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
            raise ValueError(f"temperature must be a finite number > 0, got {t!r}")
        if t < MIN_TEMPERATURE:
            raise ValueError(f"temperature={t!r} is below {MIN_TEMPERATURE}: the logits divided by it overflow "
                             "fp32; for its limit use greedy decoding (do_sample=False)")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
            raise ValueError(f"top_p must be a number in (0, 1] (1 = off), got {p!r}")
        object.__setattr__(self, "temperature", float(t))
        object.__setattr__(self, "top_p", float(p))


def filter_logits(scores: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """fp32 scores / temperature, then top-k and top-p as -inf; static shapes, no host sync."""
    scores = scores / params.temperature
    vocab = scores.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(scores, params.top_k, dim=-1).values[:, -1:]  # [rows, 1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        ordered = torch.sort(scores, dim=-1, descending=True).values  # [rows, vocab]
        probs = torch.softmax(ordered, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # mass strictly above each rank
        num_kept = (before < params.top_p).sum(dim=-1, keepdim=True)  # >= 1: rank 0 has 0 before
        threshold = ordered.gather(1, num_kept - 1)  # [rows, 1], the smallest kept value
        scores = scores.masked_fill(scores < threshold, float("-inf"))
    return scores


def sample_tokens(
    logits: torch.Tensor, keys: torch.Tensor, steps: torch.Tensor, params: SamplingParams
) -> torch.Tensor:
    """[rows] ids drawn from softmax(filtered logits); ``logits`` fp32 after the penalty."""
    return draw(filter_logits(logits.float(), params), keys, steps)


def draw(scores: torch.Tensor, keys: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """[rows] ids drawn from softmax(``scores``), already filtered (Gumbel-max with the rows' keys)."""
    return (scores + gumbel_noise(keys, steps, scores.shape[-1])).argmax(dim=-1)
