"""measure.tool_episodes on a tiny CPU model: the record's runs and ratios, the environment's answers
the same at every latency (so are the tokens), the call tokens a share of the vocabulary."""
from __future__ import annotations

import pytest
import torch
from conftest import get_tiny

from rollout_lab.measure.tool_episodes import ToolEnv, call_ids, run_tool_episodes

TINY = dict(num_prompts=4, min_len=4, max_len=20, max_new_tokens=24, max_turns=3, answer_min=2, answer_max=5)


@pytest.mark.slow
def test_tool_episodes_record_on_a_tiny_model():
    record = run_tool_episodes(get_tiny("qwen2"), model_name="tiny-qwen2", dtype="float32", latencies_ms=(0.0, 5.0),
                               config={"kv_block_size": 16}, **TINY)
    assert set(record["runs"]) == {"episodes_0ms", "episodes_5ms", "single_turn"}
    episodes, single = record["runs"]["episodes_0ms"], record["runs"]["single_turn"]
    assert episodes["num_env_calls"] > 0 and episodes["env_tokens"] > 0 and episodes["mean_turns"] > 1
    assert 0 <= episodes["env_tokens_decoded"] <= episodes["env_tokens"] and episodes["num_prefill_forwards"] > 0
    assert single["model_tokens"] == episodes["model_tokens"] + episodes["env_tokens"]  # the same total tokens
    assert record["same_tokens_at_every_latency"]
    assert set(record["ratios"]) == {"episodes_over_single_turn", "latency_5ms_over_0ms"}
    assert "git_sha" in record["provenance"] and record["settings"]["num_call_ids"] == 384 // 8


def test_the_environment_answers_are_a_function_of_the_row_and_its_call():
    env = ToolEnv(384, answer_min=2, answer_max=5, latency_ms=0.0, seed=1)
    first, second = env(0, 1, [5]), env(0, 1, [5, 6])
    again = ToolEnv(384, answer_min=2, answer_max=5, latency_ms=0.0, seed=1)
    assert [again(0, 1, [9]), again(0, 1, [])] == [first, second] and 2 <= len(first) <= 5
    assert len(call_ids(384, 6.0, 0)) == 64 and call_ids(384, 1e9, 0) and max(call_ids(384, 6.0, 0)) < 384


def test_unknown_settings_are_refused_before_any_work(no_forward):
    with pytest.raises(ValueError, match="unknown tool_episodes settings \\['turns'\\]"):
        run_tool_episodes(no_forward, model_name="tiny-qwen2", dtype="float32", turns=3)


def test_tool_episode_settings_are_checked_before_any_work():
    from rollout_lab.engine.limits import ModelLimits
    from rollout_lab.measure.tool_episodes import TOOL_EPISODES, check_tool_episodes_settings

    assert check_tool_episodes_settings() == TOOL_EPISODES
    limits = ModelLimits(512, 1024, 384, torch.device("cpu"))
    for kwargs, message in ((dict(num_prompts=0), "num_prompts must be an int >= 1, got 0"),
                            (dict(min_len=40, max_len=20), "min_len=40 is above max_len=20"),
                            (dict(latencies_ms=(0.0, -5.0)), "latencies_ms must be one or more numbers"),
                            (dict(warp=1), r"unknown tool_episodes settings \['warp'\]"),
                            (dict(limits=limits), "max_new_tokens=512: a prompt of 512 tokens")):
        with pytest.raises(ValueError, match=message):
            check_tool_episodes_settings(**kwargs)


def test_bench_tool_episodes_refuses_bad_settings_before_the_model(tmp_path, monkeypatch, capsys):
    from rollout_lab.cli.main import main

    monkeypatch.setattr("rollout_lab.cli.bench.build_model", lambda *a, **k: pytest.fail("built a model"))
    base = ["bench", "tool-episodes", "--tiny", "qwen2", "--out", str(tmp_path / "rec")]
    for extra, message in ((["--min-len", "40", "--max-len", "20"], "min_len=40 is above max_len=20"),
                           ([], "past the model's context of 512")):
        assert main(base + extra) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err and len(err.strip().splitlines()) == 1, err
