"""measure.prefix_sharing and its workloads: the shared-prompt-block benchmark behind `rollout-lab
bench prefix-sharing` (issue 54; tiny fp32 models, CPU), its figure and notebook 03's parameter."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from rollout_lab.measure.models import from_preset
from rollout_lab.measure.presets import geometry_for
from rollout_lab.measure.workloads import (SAMPLED_WORKLOADS, WORKLOADS, get_workload, sample_lengths,
                                           scale_keeping_prompts)
from rollout_lab.planner.cost import ModelGeometry


def test_grpo_long_prompt_is_32_seeded_uniform_lengths_in_1500_2500():
    lengths = get_workload("grpo_long_prompt")
    assert len(lengths) == 32 and all(1500 <= n <= 2500 for n in lengths)
    assert lengths == np.random.default_rng(0).integers(1500, 2501, size=32).tolist()  # seeded: the same every run
    assert len(set(lengths)) > 16  # drawn, not one length
    spec = SAMPLED_WORKLOADS["grpo_long_prompt"]
    assert (spec["num_samples"], spec["max_new_tokens"], spec["temperature"], spec["preset"]) == (16, 512, 1.0,
                                                                                               "qwen2.5-3b")
    assert all(150 <= n <= 250 for n in get_workload("grpo_long_prompt", scale=0.1))  # within the tiny model's 512


def test_many_samples_short_is_128_gsm8k_prompts_x_32_x_256_on_llama_3_2_1b():
    assert get_workload("many_samples_short") == sample_lengths("gsm8k", 128, seed=0)
    spec = SAMPLED_WORKLOADS["many_samples_short"]
    assert (spec["num_samples"], spec["max_new_tokens"], spec["preset"]) == (32, 256, "llama-3.2-1b")
    # appended after the others: measure.defaults.prompt_seed's index of every older workload stays
    assert WORKLOADS[-2:] == ("grpo_long_prompt", "many_samples_short") and WORKLOADS.index("gsm8k_32") == 6


def test_llama_3_2_1b_preset_has_its_geometry_and_size():
    assert geometry_for("llama-3.2-1b", "bfloat16") == ModelGeometry(16, 32, 8, 64, 2)
    model = from_preset("llama-3.2-1b", dtype=torch.bfloat16, device="meta")
    assert abs(sum(p.numel() for p in model.parameters()) / 1e9 - 1.236) < 0.001  # tied embeddings
    config = model.config
    assert (config.vocab_size, config.pad_token_id, config.rope_parameters["rope_type"]) == (128256, 128004, "llama3")


def test_a_scale_that_clips_a_prompt_to_one_token_is_refused_naming_the_smallest_that_works():
    with pytest.raises(ValueError, match=r"scale=0.0001 makes the shortest of these prompts \(1502 tokens of "
                                         r"grpo_long_prompt\) 0.15 tokens, .*give scale >= 0.000666 \(1/1502\)"):
        scale_keeping_prompts(get_workload("grpo_long_prompt"), 1e-4, what="of grpo_long_prompt")
    for bad in (0, -1.0, float("nan"), True, "0.1"):
        with pytest.raises(ValueError, match=f"scale must be a finite number > 0, got {bad!r}"):
            scale_keeping_prompts([10], bad, what="")
    assert scale_keeping_prompts([10, 30], 0.1, what="") == [1, 3]
