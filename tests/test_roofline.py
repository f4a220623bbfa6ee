"""The card's floor (planner.roofline): the spec table, one step, a workload against a step-by-step
count, and DESIGN.md's floors reproduced."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from rollout_lab.measure.models import preset_config
from rollout_lab.measure.workloads import uniform_workload
from rollout_lab.planner.cost import ModelGeometry
from rollout_lab.planner.roofline import CARDS, Card, RooflineModel, card_spec, decode_floor, workload_floor

H100 = card_spec("NVIDIA H100 80GB HBM3")
H200 = card_spec("NVIDIA H200")
# 2 layers, 1 KV head of 4 dims, fp32: 64 KV bytes a token; 1,000 parameters of 4 bytes
TOY = RooflineModel(ModelGeometry(2, 2, 1, 4, 4), num_params=1_000, weight_element_bytes=4)
TOY_CARD = Card("toy", bandwidth_bytes_per_s=1e6, peak_flop_per_s=1e8)


def test_cards_are_keyed_by_the_name_torch_reports_and_an_unknown_one_is_none():
    assert H100.bandwidth_bytes_per_s == 3.35e12 and H200.bandwidth_bytes_per_s == 4.8e12
    assert H100.peak_flop_per_s == H200.peak_flop_per_s == 989e12
    assert set(CARDS) == {"NVIDIA H100 80GB HBM3", "NVIDIA H200"}
    assert card_spec("NVIDIA H100 PCIe") is None  # another H100: its own numbers, never guessed
    assert card_spec(None) is None and card_spec("cpu") is None


def test_a_step_is_bound_by_its_bytes_or_by_its_flops():
    step = decode_floor(TOY, [10, 20], TOY_CARD)
    assert step.kv_bytes == 30 * 64 and step.weight_bytes == 4_000
    assert step.bound == "bandwidth" and step.seconds == pytest.approx((4_000 + 30 * 64) / 1e6)
    slow_math = Card("slow math", bandwidth_bytes_per_s=1e12, peak_flop_per_s=1e3)
    step = decode_floor(TOY, [10, 20], slow_math)
    assert step.bound == "compute" and step.seconds == pytest.approx(2 * 1_000 * 2 / 1e3)


def _brute_force(model, lengths, budgets, card, *, slots, samples):
    """Step by step: a row's first token from its prefill, then one per step; rows enter in order on
    the first free slot; a group's prompt read once a step."""
    waiting = list(range(len(lengths)))
    live: dict[int, int] = {}  # row -> tokens generated
    seconds = 0.0
    while waiting or live:
        while waiting and len(live) < slots:
            row = waiting.pop(0)
            if budgets[row] > 1:
                live[row] = 1
        if not live:
            continue
        groups = {row // samples for row in live}
        tokens = sum(live[row] for row in live) + sum(lengths[g * samples] for g in groups)
        seconds += max((model.weight_bytes + tokens * model.geometry.kv_bytes_per_token) / card.bandwidth_bytes_per_s,
                       2 * model.num_params * len(live) / card.peak_flop_per_s)
        for row in list(live):
            live[row] += 1
            if live[row] == budgets[row]:
                del live[row]
    return seconds + 2 * model.num_params * sum(lengths[::samples]) / card.peak_flop_per_s


@pytest.mark.parametrize("slots,samples", [(None, 1), (3, 1), (1, 1), (None, 2), (2, 2)])
def test_a_workloads_floor_is_the_sum_of_its_steps(slots, samples):
    lengths = [5, 5, 9, 9, 3, 3, 7, 7]
    budgets = [4, 1, 6, 2, 3, 8, 2, 5]
    floor = workload_floor(TOY, lengths, budgets, TOY_CARD, num_slots=slots, samples_per_prompt=samples)
    expected = _brute_force(TOY, lengths, budgets, TOY_CARD, slots=slots or len(lengths), samples=samples)
    assert floor.seconds == pytest.approx(expected)
    assert floor.num_output_tokens == sum(budgets) and floor.tokens_per_s == pytest.approx(sum(budgets) / expected)
    assert floor.bound == "bandwidth" and 0 < floor.kv_share < 1


def test_workload_floor_names_a_bad_input():
    with pytest.raises(ValueError, match="one budget per prompt.*2 prompt lengths and 1 budgets"):
        workload_floor(TOY, [5, 6], [3], TOY_CARD)
    with pytest.raises(ValueError, match=r"budgets\[1\] must be"):
        workload_floor(TOY, [5, 6], [3, 0], TOY_CARD)
    with pytest.raises(ValueError, match=r"samples of one prompt \(samples_per_prompt=2\).*\[5, 6\]"):
        workload_floor(TOY, [5, 6], [3, 3], TOY_CARD, samples_per_prompt=2)
    with pytest.raises(ValueError, match="card must be a Card.*NVIDIA H200"):
        workload_floor(TOY, [5], [3], "NVIDIA H200")
    with pytest.raises(ValueError, match="model must be a RooflineModel"):
        decode_floor(ModelGeometry(2, 2, 1, 4, 4), [5], TOY_CARD)
    with pytest.raises(ValueError, match="lacks intermediate_size, vocab_size"):
        RooflineModel.from_config(SimpleNamespace(hidden_size=8, num_hidden_layers=1, num_attention_heads=2),
                                  "bfloat16")


def test_design_md_floors_are_reproduced():
    """DESIGN.md, "What the H100 has shown, and the floors": nano-vllm's shape ~28.2k tok/s on an
    H100 and ~39.6k on an H200, KV ~90% of the bytes; one step's weight read ~0.30 ms for
    Qwen2.5-0.5B and ~1.85 ms for Qwen2.5-3B (H100)."""
    qwen3 = RooflineModel.from_config(preset_config("qwen3-0.6b"), "bfloat16")
    assert qwen3.geometry.kv_bytes_per_token == 112 * 1024
    lengths, budgets = uniform_workload(256, low=100, high=1024, seed=0)  # measure.rl's NANO_VLLM_SHAPE
    h100 = workload_floor(qwen3, lengths, budgets, H100)
    assert h100.tokens_per_s == pytest.approx(28.2e3, rel=0.02) and h100.bound == "bandwidth"
    assert h100.kv_share == pytest.approx(0.9, abs=0.04)
    assert workload_floor(qwen3, lengths, budgets, H200).tokens_per_s == pytest.approx(39.6e3, rel=0.02)
    for preset, ms in (("qwen2.5-0.5b", 0.30), ("qwen2.5-3b", 1.85)):
        model = RooflineModel.from_config(preset_config(preset), "bfloat16")
        assert model.weight_bytes / H100.bandwidth_bytes_per_s * 1e3 == pytest.approx(ms, rel=0.03)
        assert decode_floor(model, [1], H100).seconds * 1e3 == pytest.approx(ms, rel=0.03)
