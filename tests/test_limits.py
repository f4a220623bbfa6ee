"""engine.limits: every size is checked against the model's context and the memory that will hold
it before anything is allocated, by the API (Rollout, the measure runs) and the CLI alike."""
from __future__ import annotations

import re

import pytest
import torch

from rollout_lab import Rollout, RolloutConfig
from rollout_lab.cli.main import main
from rollout_lab.engine import limits as limits_module
from rollout_lab.engine.limits import FALLBACK_MEMORY_BYTES, ModelLimits, available_memory, format_bytes
from rollout_lab.measure.models import model_config
from tests.conftest import get_tiny

GIB = 2**30


@pytest.fixture
def host_of(monkeypatch):
    """Make the host (and a CPU device) report ``bytes`` available."""
    def set_bytes(num_bytes: int | None) -> None:
        monkeypatch.setattr(limits_module, "host_available_bytes", lambda: num_bytes)
    return set_bytes


@pytest.fixture
def no_model(monkeypatch):
    """Building the bench's model fails the test: the limits must come first."""
    monkeypatch.setattr("rollout_lab.cli.bench.build_model", lambda *a, **k: pytest.fail("built a model before the limits"))


def preset_limits(name: str = "qwen2.5-3b") -> ModelLimits:
    return ModelLimits.of_config(model_config(name)[0], dtype="bfloat16", device="cpu")


@pytest.mark.parametrize("config, message", [
    (dict(mode="aligned", cache_capacity=10**6), "cache_capacity=1000000 is wider than the model's context of 512 "
                                                 "positions, which no request can use: give at most 512"),
    (dict(mode="aligned", cache_capacity=10**12), "cache_capacity=1000000000000 is wider than the model's context"),
    (dict(mode="paged", kv_cache_tokens=10**12), "kv_cache_tokens=1000000000000: a paged pool of 1000000000000 "
                                                 "tokens would take 465.7 TiB; this host has 8.0 GiB available: "
                                                 "at most 16777216 tokens"),
])
def test_rollout_refuses_a_cache_past_the_context_or_the_memory_before_allocating(config, message, host_of):
    host_of(8 * GIB)  # the tiny model's 512 bytes of KV a token: 8 GiB hold 2**24 tokens
    with pytest.raises(ValueError, match=re.escape(message)):
        Rollout(get_tiny("qwen2"), RolloutConfig(**config))


def test_rollout_takes_a_cache_as_wide_as_the_context():
    rollout = Rollout(get_tiny("qwen2"), RolloutConfig(mode="aligned", cache_capacity=512))
    assert rollout.generate([[5, 6, 7]], max_new_tokens=3).sequences[0].__len__() == 3


def test_the_most_that_fits_is_exact(host_of):
    limits = preset_limits()  # 36 layers x 2 KV heads x 128 x bf16 x (K, V): 36864 bytes a token
    assert limits.kv_bytes_per_token == 36864 and limits.max_positions == 32768
    host_of(24 * GIB)
    most = 24 * GIB // (640 * 36864)
    limits.check_kv("num_seqs", most, rows=most, positions=640)
    with pytest.raises(ValueError, match=rf"num_seqs={most + 1}: the KV cache of {most + 1} rows x 640 positions "
                                         rf"would take 24.0 GiB; this host has 24.0 GiB available: at most {most} rows"):
        limits.check_kv("num_seqs", most + 1, rows=most + 1, positions=640)


def test_a_device_without_a_memory_query_gets_the_documented_cap(host_of):
    host_of(None)
    assert available_memory("cpu") == (FALLBACK_MEMORY_BYTES, "this host answers no memory query, so rollout_lab "
                                                              "assumes")
    assert available_memory(torch.device("meta"))[0] == FALLBACK_MEMORY_BYTES
    limits = ModelLimits(512, 512, 384, torch.device("meta"))
    with pytest.raises(ValueError, match="kv_cache_tokens=1000000000000: .* meta answers no memory query, so "
                                         "rollout_lab assumes 64.0 GiB available: at most 134217728 tokens"):
        limits.check_memory("kv_cache_tokens", 10**12, unit_bytes=512, unit="tokens", what="a paged pool")


def test_a_call_past_max_rows_is_refused_before_any_row_is_built(monkeypatch):
    from rollout_lab import SamplingParams

    monkeypatch.setattr(limits_module, "MAX_ROWS", 8)
    monkeypatch.setattr("rollout_lab.engine.api.call.CallSpec.requests", lambda *_: pytest.fail("built the rows"))
    rollout = Rollout(get_tiny("qwen2"))
    with pytest.raises(ValueError, match=re.escape("num_samples=3 x 3 requests = 9 rows, more than the 8 rows one "
                                                   "call takes: give at most num_samples=2 for 3 requests, or split")):
        rollout.generate([[1, 2]] * 3, max_new_tokens=2, num_samples=3)
    with pytest.raises(ValueError, match=re.escape("num_samples (SamplingParams.n) up to 7 x 2 requests = 9 rows")):
        rollout.generate([[1], [2]], max_new_tokens=2, sampling=[SamplingParams(n=7), SamplingParams()], num_samples=2)
    with pytest.raises(ValueError, match=re.escape("num_samples=1 x 9 requests = 9 rows, more than the 8 rows one "
                                                   "call takes: split the requests over calls of at most 8 rows")):
        rollout.generate([[1]] * 9, max_new_tokens=2)


def test_format_bytes():
    assert [format_bytes(n) for n in (512, 1536, 24 * GIB, 2.1e12)] == ["512 B", "1.5 KiB", "24.0 GiB", "1.9 TiB"]


# the commands and their kin: each one line, status 2, naming the value and what fits, before
# the model (or a prompt) is built
@pytest.mark.parametrize("argv, message", [
    (["decode-step", "--cases", "1000000000x1000000000"],
     "error: case=1000000000x1000000000: a cache of span 1000000000 + 1 columns would take 1000000001 positions, "
     "past the model's context of 512: at most case=1000000000x511"),
    (["decode-step", "--cases", "1000000000x100"],
     "error: case=1000000000x100: the KV cache of 1000000000 rows x 101 positions would take 47.0 TiB; this host has "
     "8.0 GiB available: at most 166111 slots"),
    (["rl", "--num-seqs", "1000000000", "--min-len", "8", "--max-len", "40"],
     "error: num_seqs=1000000000: the KV cache of 1000000000 rows x 80 positions would take 37.3 TiB; this host "
     "has 8.0 GiB available: at most 209715 rows"),
    (["rl", "--num-seqs", "1000000000", "--slots", "4", "--min-len", "8", "--max-len", "40"],
     "error: num_seqs=1000000000: 1000000000 rows of 80 token ids on the host would take 2.6 TiB; this host has "
     "8.0 GiB available: at most 2982616 rows"),
    (["rl", "--max-len", "1000"], "error: max_len=1000: a request's prompt and budget, each up to max_len, would "
                                  "take 2000 positions, past the model's context of 512: at most max_len=256"),
    (["rl", "--reps", "1000000000"], "error: reps=1000000000: more timed calls than one record keeps; give at most 10000"),
    (["rl", "--seed", "-1"], "error: seed must be an int >= 0, got -1"),
    (["long-tail", "--num-prompts", "1000000000", "--dataset", "gsm8k", "--max-new-tokens", "128"],
     "error: num_prompts=1000000000: the KV cache of 1000000000 rows x 360 positions would take 167.6 TiB"),
    (["long-tail", "--max-new-tokens", "128"],
     "error: dataset=gpqa_diamond: gpqa_diamond's longest prompt (2840 tokens) and 128 new tokens would take 2968 "
     "positions, past the model's context of 512: a dataset whose prompts fit: gsm8k, humaneval, aime2025"),
    (["long-tail", "--dataset", "gsm8k", "--max-new-tokens", "1000000000"],
     "error: max_new_tokens=1000000000: gsm8k's longest prompt (232 tokens) and 1000000000 new tokens would take "
     "1000000232 positions, past the model's context of 512: at most max_new_tokens=280"),
    (["logits", "--num-seqs", "1000000000", "--min-len", "4", "--max-len", "40", "--steps", "4"],
     "error: num_seqs=1000000000: the KV cache (44 positions) and fp32 logits (4 steps x 384 ids, ours and the "
     "reference's) of 1000000000 rows would take 31.7 TiB; this host has 8.0 GiB available: at most 246723 rows"),
    (["logits", "--steps", "1000000000", "--max-len", "40", "--min-len", "4"],
     "error: steps=1000000000: a prompt of max_len 40 and 1000000000 forced steps would take 1000000040 positions, "
     "past the model's context of 512: at most steps=472"),
    (["grpo", "--num-samples", "1000000000"], "error: num_samples=1000000000: more samples of one prompt than a call takes (each is a row "
                                              "with its own slot); give at most 65536"),
    (["grpo", "--num-samples", "4096"],
     "error: num_samples=4096: the KV cache of 262144 rows x 284 positions would take 35.5 GiB; this host "
     "has 8.0 GiB available: at most 59074 rows"),
    (["grpo", "--scale", "1e9"], "error: scale=1000000000.0: the longest prompt (156000000000 tokens at scale 1e+09) "
                                 "and 128 new tokens would take 156000000128 positions, past the model's context"),
    (["grpo", "--num-prompts", "1000000000"], "error: cannot draw n=1000000000 prompts from 'gsm8k' (1319 prompts)"),
    (["trainer-loop", "--num-samples", "2", "--max-new-tokens", "200"],
     "error: num_samples=2: the trainer's fp32 logits of 128 rows x 356 positions x 384 ids would take 66.8 MiB; "
     "this host has 64.0 MiB available: at most 122 rows"),
    (["trainer-loop", "--iterations", "1000000000"], "error: iterations=1000000000: more timed calls than one record keeps"),
    (["prefill-routes", "--batch-sizes", "1000000000"],
     "error: batch_sizes=1000000000: the KV cache of 1000000000 rows x 512 positions would take 238.4 TiB"),
    (["prefill-routes", "--repetitions", "1000000000"], "error: repetitions=1000000000: more timed calls than one record keeps"),
    (["defaults", "--max-new-tokens", "1000000000"], "error: workload 'short_similar': prompt length 20 + "
                                                     "max_new_tokens 1000000000 exceeds the model's context of 512"),
])
def test_a_bench_size_past_the_context_or_the_memory_is_one_line_before_the_model(argv, message, tmp_path, capsys,
                                                                                   no_model, host_of):
    host_of(64 * 2**20 if argv[0] == "trainer-loop" and "--num-samples" in argv else 8 * GIB)
    assert main(["bench", *argv, "--tiny", "qwen2", "--out", str(tmp_path / "rec")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.endswith("\n") and err.count("\n") == 1, err


def test_the_runs_check_their_sizes_before_any_prompt(host_of, monkeypatch):
    from rollout_lab.measure import decode_step, long_tail, rl

    host_of(8 * GIB)
    for module in (rl, long_tail, decode_step):
        monkeypatch.setattr(module, "lengths_to_prompts", lambda *a, **k: pytest.fail("built prompts first"))
    model = get_tiny("qwen2")
    with pytest.raises(ValueError, match="num_seqs=1000000000: the KV cache of 1000000000 rows"):
        rl.run_rl(model, model_name="tiny", dtype="float32", num_seqs=10**9, min_len=8, max_len=40)
    with pytest.raises(ValueError, match="num_prompts=1000000000: the KV cache of 1000000000 rows"):
        long_tail.run_long_tail(model, model_name="tiny", dtype="float32", num_prompts=10**9, dataset="gsm8k",
                                max_new_tokens=128)
    with pytest.raises(ValueError, match=r"case=1000000000x100: the KV cache"):
        decode_step.run_decode_step(model, model_name="tiny", dtype="float32", cases=[(10**9, 100)])


def test_the_notebook_shapes_are_checked_before_the_model_loads(host_of, monkeypatch, tmp_path):
    from rollout_lab.measure import grpo, long_tail, rl

    host_of(8 * GIB)
    for module in (rl, long_tail):
        monkeypatch.setattr(module, "load_model", lambda *a, **k: pytest.fail("loaded the model first"), raising=False)
    monkeypatch.setattr("rollout_lab.measure.models.load_model", lambda *a, **k: pytest.fail("loaded the model first"))
    with pytest.raises(ValueError, match="num_seqs=1000000000: the KV cache"):
        rl.rl_or_load(rl_shape={"num_seqs": 10**9, "min_len": 8, "max_len": 40}, rl_results_file=None,
                      model="tiny-qwen2", dtype="float32", device="cpu", output_dir=tmp_path)
    with pytest.raises(ValueError, match="max_new_tokens=1000000000: gsm8k's longest prompt"):
        long_tail.long_tail_or_load(long_tail_shape={"dataset": "gsm8k", "max_new_tokens": 10**9},
                                    long_tail_results_file=None, model="tiny-qwen2", dtype="float32", device="cpu",
                                    output_dir=tmp_path)
    with pytest.raises(ValueError, match="num_samples=4096: the KV cache of 262144 rows"):
        grpo.grpo_or_load(grpo_shape={"num_samples": 4096}, grpo_results_file=None, model="tiny-qwen2",
                          dtype="float32", device="cpu", output_dir=tmp_path)
