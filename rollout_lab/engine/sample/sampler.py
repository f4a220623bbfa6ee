"""Seeded sampling that gives the same tokens on every route: counter-based Gumbel-max on device.

A sampled row's randomness is a pure function of (seed, request index, sample index, step), never
of its slot, its batch, the bucket plan or the refill order. Each (request, sample) pair has a
64-bit key, ``sample_key(seed, request, sample)``; at step t (the number of tokens the row has
generated so far, 0 for the token chosen from the prefill logits) token v gets the uniform

    u[v] = splitmix64(mix64(key + mix64(t)) + (v + 1) * GOLDEN) >> 11, over 2^53, in (0, 1)

and the token is ``argmax(filtered_logits / temperature - log(-log(u)))`` (Gumbel-max: an exact
draw from softmax(filtered_logits / temperature)). It is all elementwise int64 / float ops of a
static shape, with no generator objects and no host syncs, so the CUDA-graph-captured decode step
can run it. Filtering follows vLLM's order: penalties (``engine.sample.processors``), temperature, min-p,
top-k, top-p; ties at a top-k / top-p threshold are kept (the threshold is a value, not a sorted position). Every row has
its own settings (``RowSampling``: [rows] tensors), so rows of different temperatures, top-k and
top-p share one step; a row of temperature 0 takes the argmax.

    rows = RowSampling.of([SamplingParams(temperature=0.8, top_p=0.95), SamplingParams(0)], "cpu")
    tokens = sample_tokens(logits, keys, steps, rows)   # [rows] ids; row 1 greedy

"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

import torch

from rollout_lab.engine.sample.params import SamplingParams

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


def uniforms(keys: torch.Tensor, steps: torch.Tensor, vocab_size: int, salts: torch.Tensor | None = None
             ) -> torch.Tensor:
    """[rows, vocab] float64 in (0, 1): the uniforms of each row's (key, step), per token id.
    ``salts``: ``token_salts(vocab_size, device)``, given by a compiled caller (``compile_select``)
    so that nothing in its trace breaks the graph."""
    base = _mix64(keys + _mix64(steps))  # [rows]
    salts = token_salts(vocab_size, keys.device) if salts is None else salts  # [vocab]
    bits = _shr(_mix64(base[:, None] + salts[None, :]), 11)  # [rows, vocab], 53 bits
    return (bits.to(torch.float64) + 0.5) * (1.0 / 2**53)


def gumbel_noise(keys: torch.Tensor, steps: torch.Tensor, vocab_size: int, salts: torch.Tensor | None = None
                 ) -> torch.Tensor:
    """[rows, vocab] float32 standard Gumbel noise, -log(-log(u)) (``salts`` as ``uniforms``)."""
    u = uniforms(keys, steps, vocab_size, salts)
    return (-torch.log(-torch.log(u))).to(torch.float32)


def top_k_width(top_k: int) -> int:
    """The top-k a step computes for rows of at most ``top_k``: the next power of two (0 stays 0),
    so calls of nearby top-k share a captured step. Any width >= a row's k gives the same threshold
    (the k-th largest value)."""
    return 0 if top_k == 0 else 1 << (top_k - 1).bit_length()


@dataclass(frozen=True)
class RowSampling:
    """Each row's sampling settings as ``[rows]`` tensors, and the filters a step runs for them.

    ``max_top_k`` (a ``top_k_width``; 0: no top-k), ``top_p_filter`` and ``min_p_filter`` are
    static: a captured step bakes them in. The tensors are buffers it reads, so rows of different
    settings share one graph, and a row whose settings turn a filter off (k = 0, p = 1, min-p 0) is
    left as that filter would leave it."""

    temperature: torch.Tensor  # [rows] float32; 0: a greedy row (argmax, unfiltered)
    top_k: torch.Tensor  # [rows] int64; 0: off
    top_p: torch.Tensor  # [rows] float32; 1: off
    min_p: torch.Tensor  # [rows] float32; 0: off
    max_top_k: int = 0
    top_p_filter: bool = False
    min_p_filter: bool = False

    @classmethod
    def of(cls, params: Sequence[SamplingParams], device: torch.device | str) -> "RowSampling":
        """One row per item of ``params``; a greedy row's top-k, top-p and min-p are off."""
        top_k = [0 if p.is_greedy else p.top_k for p in params]
        top_p = [1.0 if p.is_greedy else p.top_p for p in params]
        min_p = [0.0 if p.is_greedy else p.min_p for p in params]
        return cls(torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device),
                   torch.tensor(top_k, dtype=torch.long, device=device),
                   torch.tensor(top_p, dtype=torch.float32, device=device),
                   torch.tensor(min_p, dtype=torch.float32, device=device),
                   max_top_k=top_k_width(max(top_k, default=0)), top_p_filter=any(p < 1 for p in top_p),
                   min_p_filter=any(p > 0 for p in min_p))

    @classmethod
    def zeros(cls, num_rows: int, device: torch.device | str, *, max_top_k: int,
              top_p_filter: bool, min_p_filter: bool = False) -> "RowSampling":
        """Buffers for ``num_rows`` slots (``DecodeState``): greedy rows until rows are admitted."""
        return cls(torch.zeros(num_rows, dtype=torch.float32, device=device),
                   torch.zeros(num_rows, dtype=torch.long, device=device),
                   torch.ones(num_rows, dtype=torch.float32, device=device),
                   torch.zeros(num_rows, dtype=torch.float32, device=device),
                   max_top_k=max_top_k, top_p_filter=top_p_filter, min_p_filter=min_p_filter)

    def rows(self, index: torch.Tensor | slice) -> "RowSampling":
        """The rows at ``index`` (a slice gives views of these tensors, an index tensor a copy)."""
        return dataclasses.replace(self, temperature=self.temperature[index], top_k=self.top_k[index],
                                   top_p=self.top_p[index], min_p=self.min_p[index])

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [self.temperature, self.top_k, self.top_p, self.min_p]

    @property
    def greedy(self) -> torch.Tensor:
        """[rows] bool: the rows that take the argmax."""
        return self.temperature == 0


def filter_logits(scores: torch.Tensor, sampling: RowSampling) -> torch.Tensor:
    """fp32 scores / each row's temperature, then its min-p, top-k and top-p as -inf (vLLM's
    order); a greedy row's scores as they came. Static shapes, no host sync, no branch on a tensor's
    values."""
    greedy = sampling.greedy[:, None]  # [rows, 1]
    filtered = scores / torch.where(greedy, 1.0, sampling.temperature[:, None])
    vocab = scores.shape[-1]
    if sampling.min_p_filter:  # below min_p x the likeliest id's probability; min_p 0 keeps every id
        probs = torch.softmax(filtered, dim=-1)  # [rows, vocab]
        floor = sampling.min_p[:, None] * probs.max(dim=-1, keepdim=True).values  # [rows, 1]
        filtered = filtered.masked_fill(probs < floor, float("-inf"))
    if sampling.max_top_k:
        width = min(sampling.max_top_k, vocab)
        top = torch.topk(filtered, width, dim=-1).values  # [rows, width], descending
        k = sampling.top_k[:, None]  # [rows, 1]
        kth = top.gather(1, k.clamp(1, width) - 1)  # [rows, 1]: the k-th largest value
        kth = torch.where(k > 0, kth, float("-inf"))
        filtered = filtered.masked_fill(filtered < kth, float("-inf"))
    if sampling.top_p_filter:
        p = sampling.top_p[:, None]  # [rows, 1]
        ordered = torch.sort(filtered, dim=-1, descending=True).values  # [rows, vocab]
        probs = torch.softmax(ordered, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # mass strictly above each rank
        num_kept = (before < p).sum(dim=-1, keepdim=True).clamp(min=1)  # rank 0 has 0 before (p > 0)
        threshold = ordered.gather(1, num_kept - 1)  # [rows, 1], the smallest kept value
        threshold = torch.where(p < 1, threshold, float("-inf"))  # p = 1 is off, rounding aside
        filtered = filtered.masked_fill(filtered < threshold, float("-inf"))
    return torch.where(greedy, scores, filtered)


def with_noise(scores: torch.Tensor, keys: torch.Tensor, steps: torch.Tensor, greedy: torch.Tensor,
               salts: torch.Tensor | None = None) -> torch.Tensor:
    """``scores`` plus each sampled row's Gumbel noise (a ``greedy`` row's unchanged): each row's
    argmax is its token (``salts`` as ``uniforms``)."""
    noise = gumbel_noise(keys, steps, scores.shape[-1], salts).masked_fill(greedy[:, None], 0.0)
    return scores + noise


# row_argmax's first stage reduces the vocabulary in pieces of this many ids
ARGMAX_CHUNK = 1024


def row_argmax(scores: torch.Tensor) -> torch.Tensor:
    """[rows] the first index of each row's largest value, as ``scores.argmax(dim=-1)`` gives it, in
    two stages: each ``ARGMAX_CHUNK`` ids' max and its first index, then the first chunk holding the
    row's max. Compiled, inductor does not split an argmax over a vocabulary (it does a sum's): one
    program a row reduces the whole vocabulary alone, a large share of a sampled step at 128 rows
    (data/diagnostics/trace_long_tail_h100_037603b.txt). In chunks the rows times the chunks fill
    the GPU. Padding is -inf, never a row's first max."""
    rows, vocab = scores.shape
    pad = -vocab % ARGMAX_CHUNK
    if pad:
        scores = torch.nn.functional.pad(scores, (0, pad), value=float("-inf"))
    best, where = scores.view(rows, (vocab + pad) // ARGMAX_CHUNK, ARGMAX_CHUNK).max(dim=-1)  # [rows, chunks]: first max in each
    chunk = best.argmax(dim=-1, keepdim=True)  # [rows, 1]: the first chunk holding the row's max
    return (chunk * ARGMAX_CHUNK + where.gather(1, chunk)).squeeze(1)


def draw(scores: torch.Tensor, keys: torch.Tensor, steps: torch.Tensor, greedy: torch.Tensor,
         salts: torch.Tensor | None = None) -> torch.Tensor:
    """[rows] ids drawn from softmax(``scores``), already filtered (Gumbel-max with the rows' keys);
    the argmax for ``greedy`` rows (``salts`` as ``uniforms``)."""
    return row_argmax(with_noise(scores, keys, steps, greedy, salts))


def sample_tokens(logits: torch.Tensor, keys: torch.Tensor, steps: torch.Tensor, sampling: RowSampling) -> torch.Tensor:
    """[rows] ids drawn from softmax(filtered logits); ``logits`` fp32 after the penalty."""
    return draw(filter_logits(logits.float(), sampling), keys, steps, sampling.greedy)
