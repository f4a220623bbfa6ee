"""examples/: each runs end to end on a tiny CPU model with small settings, its numbers asserted."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def load_example(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_grpo_loop_trains_one_model_with_the_rollouts_logprobs_equal_to_the_trainers(capsys):
    stats = load_example("grpo_loop").main(["--iterations", "2", "--train-rows", "8"])
    assert [s["iteration"] for s in stats] == [0, 1]
    assert all(s["rollout_ms"] > 0 and s["train_ms"] > 0 and s["peak_gib"] is None for s in stats)
    assert all(s["max_abs_logprob_diff"] == 0 for s in stats)  # fp32 on the CPU: micro-batches change nothing
    assert all(0 <= s["mean_reward"] <= 1 for s in stats)
    out = capsys.readouterr().out
    assert out.startswith("tiny-qwen2 on cpu: 4 prompts x 4 samples x 16 tokens") and "iteration 1: rollout" in out


@pytest.mark.slow
def test_tool_grpo_loop_runs_episodes_and_trains_on_the_models_tokens(capsys):
    stats = load_example("tool_grpo_loop").main(["--iterations", "1", "--num-prompts", "2", "--num-samples", "2",
                                                 "--max-new-tokens", "12"])
    assert [s["iteration"] for s in stats] == [0]
    assert stats[0]["mean_turns"] > 1 and 0 < stats[0]["env_token_share"] < 1
    assert stats[0]["max_abs_logprob_diff"] == 0  # fp32 on the CPU: the trainer's logprobs on the model's tokens
    assert 0 <= stats[0]["mean_reward"] <= 1
    assert capsys.readouterr().out.startswith("tiny-qwen2 on cpu: 2 prompts x 2 samples")
