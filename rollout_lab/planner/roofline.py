"""A card's floor for decoding a workload: what the fastest possible engine could do on it.

A decode step reads every weight once and each live row's keys and values, and multiplies every
weight once per row, so it takes at least

    step_s = max((weight bytes + KV bytes read) / bandwidth, 2 * params * rows / peak FLOP/s)

and a workload takes at least the sum of its decode steps' floors plus its prefill's FLOPs over the
peak (``2 * params * prompt tokens``)::

    card = card_spec("NVIDIA H100 80GB HBM3")                 # None for a card not in CARDS
    model = RooflineModel.from_config(hf_config, "bfloat16")  # any object with HF's config fields
    decode_floor(model, [700, 900], card)                     # one step at two rows' contexts
    workload_floor(model, lengths, budgets, card)             # the whole call: seconds, tok/s, KV share

Spec numbers, not measured ones: a fraction of this floor says how far an engine is from the card.
Pure Python (``measure.roofline`` reads a record's workload into it).
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Any, Sequence

from rollout_lab.planner.checks import check_int
from rollout_lab.planner.cost import ModelGeometry, dtype_bytes
from rollout_lab.planner.kv_reads import kv_bytes_read


@dataclass(frozen=True)
class Card:
    """A card's spec sheet: HBM bandwidth and dense bf16 tensor-core peak (no sparsity)."""

    name: str
    bandwidth_bytes_per_s: float
    peak_flop_per_s: float


# keyed by torch.cuda.get_device_name(), as provenance records it; NVIDIA's H100 SXM and H200 data sheets
CARDS: dict[str, Card] = {card.name: card for card in (
    Card("NVIDIA H100 80GB HBM3", bandwidth_bytes_per_s=3.35e12, peak_flop_per_s=989e12),
    Card("NVIDIA H200", bandwidth_bytes_per_s=4.8e12, peak_flop_per_s=989e12),
)}


def card_spec(device_name: str | None) -> Card | None:
    """The spec of the card torch names ``device_name``; None for any card not in ``CARDS`` (its
    numbers are not guessed from a similar name)."""
    return CARDS.get(device_name) if isinstance(device_name, str) else None


@dataclass(frozen=True)
class RooflineModel:
    """What a decode step reads and multiplies: ``num_params`` weights of ``weight_element_bytes``
    each, and the KV of ``geometry`` (its ``kv_bytes_per_token``) times ``kv_fraction``: the stored
    KV's bytes over the model dtype's (an FP8 pool's, scales included, about 0.53 of bf16's)."""

    geometry: ModelGeometry
    num_params: int  # the weights a decode step reads: the layers, the final norm and the LM head
    weight_element_bytes: int
    kv_fraction: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.geometry, ModelGeometry):
            raise ValueError(f"geometry must be a ModelGeometry, got {self.geometry!r}")
        check_int(self.num_params, name="num_params")
        check_int(self.weight_element_bytes, name="weight_element_bytes")
        if not isinstance(self.kv_fraction, (int, float)) or not 0 < self.kv_fraction <= 4:
            raise ValueError(f"kv_fraction must be a number in (0, 4], got {self.kv_fraction!r}")

    @property
    def weight_bytes(self) -> int:
        return self.num_params * self.weight_element_bytes

    @classmethod
    def from_config(cls, hf_config: Any, dtype: Any) -> "RooflineModel":
        """A decoder of Hugging Face config fields (Qwen2, Qwen3, Llama: RMSNorm, gated MLP) with
        weights and KV in ``dtype``. The step reads each layer's projections and norms, the final
        norm and the LM head (vocabulary x hidden: tied or not, it is read once per step; the input
        embedding is only indexed). Biases and per-head norms are left out: under 0.1% of the bytes.
        ValueError naming the field a config lacks."""
        cfg = getattr(hf_config, "text_config", None) or hf_config
        needed = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
        missing = [name for name in needed if not isinstance(getattr(cfg, name, None), int)]
        if missing:
            raise ValueError(f"the config lacks {', '.join(missing)}: the roofline counts the weights of a decoder "
                             f"with {', '.join(needed)} (Qwen2, Qwen3, Llama)")
        geometry = ModelGeometry.from_config(cfg, dtype)
        hidden, heads, kv_heads, head_dim = (cfg.hidden_size, geometry.num_query_heads, geometry.num_kv_heads,
                                             geometry.head_dim)
        attention = hidden * head_dim * (2 * heads + 2 * kv_heads)  # q, o and k, v
        mlp = 3 * hidden * cfg.intermediate_size  # gate, up, down
        per_layer = attention + mlp + 2 * hidden  # and its two norms
        params = geometry.num_layers * per_layer + hidden + cfg.vocab_size * hidden
        return cls(geometry, params, dtype_bytes(dtype))


@dataclass(frozen=True)
class StepFloor:
    """One decode step's floor: seconds, which bound binds ("bandwidth" or "compute"), its bytes."""

    seconds: float
    bound: str
    weight_bytes: int
    kv_bytes: int


def decode_floor(model: RooflineModel, contexts: Sequence[int], card: Card) -> StepFloor:
    """The floor of one decode step whose rows attend to ``contexts`` tokens each (position + 1)."""
    _check_model_card(model, card)
    contexts = [check_int(c, name=f"contexts[{i}]") for i, c in enumerate(contexts)]
    return _step(model, card, rows=len(contexts), context_tokens=sum(contexts))


@dataclass(frozen=True)
class WorkloadFloor:
    """A workload's floor: ``seconds`` (decode steps and prefill), the output tokens per second at it,
    the bound that holds the most of its decode time, the share of the bytes read that are KV, and
    its decode steps and output tokens."""

    seconds: float
    tokens_per_s: float
    bound: str
    kv_share: float
    num_decode_steps: int
    num_output_tokens: int
    prefill_seconds: float


def workload_floor(model: RooflineModel, prompt_lengths: Sequence[int], budgets: Sequence[int], card: Card, *,
                   num_slots: int | None = None, samples_per_prompt: int = 1) -> WorkloadFloor:
    """The floor of generating ``budgets[i]`` tokens after prompt ``i`` (EOS ignored).

    A row's first token comes from its prefill; each decode step then adds one token to every live
    row (its context grows by one) and a row leaves at its budget. With ``num_slots`` None or at
    least the rows, every row is resident from the first step; else rows enter in order, each taking
    the first slot that frees, and decode from the step after the one that freed it (their prefill
    costs only its FLOPs, in no step). With ``samples_per_prompt`` > 1 the rows come in consecutive
    groups of that many samples of one prompt, which share its KV: a step reads a group's prompt once
    while any of its rows is live, and the prefill runs each prompt once. The prefill's floor is
    ``2 * params * prompt tokens`` over the peak."""
    _check_model_card(model, card)
    lengths = [check_int(n, name=f"prompt_lengths[{i}]") for i, n in enumerate(prompt_lengths)]
    budgets = [check_int(b, name=f"budgets[{i}]") for i, b in enumerate(budgets)]
    if not lengths or len(lengths) != len(budgets):
        raise ValueError(f"give one budget per prompt, and at least one prompt: got {len(lengths)} prompt lengths "
                         f"and {len(budgets)} budgets")
    slots = len(lengths) if num_slots is None else check_int(num_slots, name="num_slots")
    samples = check_int(samples_per_prompt, name="samples_per_prompt")
    groups = [range(start, min(start + samples, len(lengths))) for start in range(0, len(lengths), samples)]
    for group in groups:
        if len({lengths[i] for i in group}) > 1:
            raise ValueError(f"rows {group.start}..{group.stop - 1} are samples of one prompt (samples_per_prompt="
                             f"{samples}) but their prompt lengths differ: {[lengths[i] for i in group]}")
    first_steps = _first_steps(budgets, slots)
    # per step: live rows and the KV tokens they read, by difference arrays. A row at its first step
    # attends to its prompt and its prefill's token, one more each step after: its own tokens at
    # step t are t + 1 - first; its group's prompt is read once in every step one of the group is live
    num_steps = max(first + budget - 1 for first, budget in zip(first_steps, budgets)) - 1
    rows = [0] * (num_steps + 2)
    offset = [0] * (num_steps + 2)  # the tokens read at step t: t * live rows + the offsets summed to t
    for budget, first in zip(budgets, first_steps):
        last = first + budget - 2
        if last < first:
            continue
        rows[first] += 1
        rows[last + 1] -= 1
        offset[first] += 1 - first
        offset[last + 1] -= 1 - first
    for group in groups:
        for first, last in _live_spans([(first_steps[i], first_steps[i] + budgets[i] - 2) for i in group]):
            offset[first] += lengths[group.start]
            offset[last + 1] -= lengths[group.start]
    seconds = {"bandwidth": 0.0, "compute": 0.0}
    kv = weights = 0
    live = running = 0
    for step in range(1, num_steps + 1):
        live += rows[step]
        running += offset[step]
        step_floor = _step(model, card, rows=live, context_tokens=running + step * live)
        seconds[step_floor.bound] += step_floor.seconds
        kv += step_floor.kv_bytes
        weights += step_floor.weight_bytes
    prefill = 2.0 * model.num_params * sum(lengths[group.start] for group in groups) / card.peak_flop_per_s
    total = seconds["bandwidth"] + seconds["compute"] + prefill
    tokens = sum(budgets)
    return WorkloadFloor(seconds=total, tokens_per_s=tokens / total,
                         bound=max(seconds, key=lambda name: seconds[name]),
                         kv_share=kv / (kv + weights) if kv + weights else 0.0, num_decode_steps=num_steps,
                         num_output_tokens=tokens, prefill_seconds=prefill)


def _first_steps(budgets: Sequence[int], slots: int) -> list[int]:
    """The decode step each row first takes part in (1-based): 1 for the first ``slots`` rows; a
    later row the step after the slot it takes frees (a row of budget 1 frees it at once)."""
    free = [1] * min(slots, len(budgets))  # the step from which each slot is free
    heapq.heapify(free)
    first_steps = []
    for budget in budgets:
        first = heapq.heappop(free)
        first_steps.append(first)
        heapq.heappush(free, first + budget - 1)  # its decode steps are first .. first + budget - 2
    return first_steps


def _live_spans(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The steps (first, last) in which any of ``spans`` is live, as disjoint spans (an empty span,
    last < first, is no step)."""
    merged: list[list[int]] = []
    for first, last in sorted(span for span in spans if span[1] >= span[0]):
        if merged and first <= merged[-1][1] + 1:
            merged[-1][1] = max(merged[-1][1], last)
        else:
            merged.append([first, last])
    return [(first, last) for first, last in merged]


def _step(model: RooflineModel, card: Card, *, rows: int, context_tokens: int) -> StepFloor:
    kv = round(kv_bytes_read(context_tokens, model.geometry) * model.kv_fraction)
    read_s = (model.weight_bytes + kv) / card.bandwidth_bytes_per_s
    compute_s = 2.0 * model.num_params * rows / card.peak_flop_per_s
    bound = "bandwidth" if read_s >= compute_s else "compute"
    return StepFloor(seconds=max(read_s, compute_s), bound=bound, weight_bytes=model.weight_bytes, kv_bytes=kv)


def _check_model_card(model: object, card: object) -> None:
    if not isinstance(model, RooflineModel):
        raise ValueError(f"model must be a RooflineModel (RooflineModel.from_config(hf_config, dtype)), got {model!r}")
    if not isinstance(card, Card):
        raise ValueError(f"card must be a Card (card_spec(device name), one of {sorted(CARDS)}), got {card!r}")
