"""Multi-turn tool episodes, measured (issue 55): ``generate(env=...)`` against a single-turn call of
the same total tokens, and with an environment that takes ``latency_ms`` per answer against one that
answers at once.

    from rollout_lab.measure.tool_episodes import run_tool_episodes
    record = run_tool_episodes(model, model_name="qwen2.5-0.5b", dtype="bfloat16")   # TOOL_EPISODES

The workload (``TOOL_EPISODES``): 256 random-token prompts of 64-512 tokens, episodes of up to 4
model turns and 512 model tokens, sampled at T=1, EOS ignored. A random-weights model writes no tool
calls of its own, so a random ``1 / mean_turn_tokens`` share of the vocabulary are the call tokens
(a turn then ends after ``mean_turn_tokens`` tokens on average); the environment (``ToolEnv``)
answers each call with 20-200 random tokens, drawn from ``(seed, request, sample, call)`` (the
same answers at every latency, so the runs make the same tokens).

Runs, on one Rollout (paged route), after an untimed warm-up episode call: the episodes at each
latency of ``latencies_ms``, then ``single_turn``: the same prompts, each row generating as many
tokens as its episode held in all (model and environment tokens), in one turn. Per run: wall ms,
tokens (the model's, the environment's), tok/s over all of them and over the model's, env calls,
the history tokens prefilled again (``Profile.prefilled_history_tokens``), the environment's tokens
fed through decode steps (``Profile.env_tokens_decoded``), the prefill forwards and the mean turns. The
record holds the ratios beside the issue's targets (``ISSUE_TARGETS``) and claims nothing.
"""
from __future__ import annotations

import time
from typing import Any, Sequence

import numpy as np
import torch

from rollout_lab.engine.api.config import RolloutConfig
from rollout_lab.engine.api.rollout import Rollout
from rollout_lab.engine.limits import ModelLimits, check_call_rows
from rollout_lab.engine.profile import timed_ms
from rollout_lab.measure.provenance import provenance
from rollout_lab.planner.checks import check_int

TOOL_EPISODES: dict[str, Any] = {"num_prompts": 256, "min_len": 64, "max_len": 512, "max_new_tokens": 512,
                                 "max_turns": 4, "answer_min": 20, "answer_max": 200, "temperature": 1.0,
                                 "preset": "qwen2.5-0.5b"}
ISSUE_TARGETS = {"episodes_over_single_turn": 0.85, "prefilled_history_tokens": 0, "latency_over_zero": 0.8}


class ToolEnv:
    """The workload's environment: each call answered with ``answer_min``-``answer_max`` random ids in
    ``[low, vocab_size)``, a function of (seed, request, sample, the row's calls so far), after
    ``latency_ms``."""

    def __init__(self, vocab_size: int, *, answer_min: int, answer_max: int, latency_ms: float, seed: int,
                 low: int = 0):
        self.vocab_size, self.low = vocab_size, low
        self.answer_min, self.answer_max, self.latency_ms, self.seed = answer_min, answer_max, latency_ms, seed
        self.calls: dict[tuple[int, int], int] = {}

    def __call__(self, request: int, sample: int, tokens: list[int]) -> list[int]:
        call = self.calls[request, sample] = self.calls.get((request, sample), 0) + 1  # one thread per row at a time
        rng = np.random.default_rng([self.seed, request, sample, call])
        if self.latency_ms:
            time.sleep(self.latency_ms / 1e3)
        length = int(rng.integers(self.answer_min, self.answer_max + 1))
        return rng.integers(self.low, self.vocab_size, length).tolist()


def check_tool_episodes_settings(*, seed: int = 0, latencies_ms: Sequence[float] = (0.0, 50.0),
                                 limits: ModelLimits | None = None, **overrides: Any) -> dict[str, Any]:
    """The workload ``TOOL_EPISODES`` with ``overrides``, checked: ValueError naming the first bad setting
    and what would be valid (with ``limits``, a row's prompt, model tokens and environment answers
    within the model's context, and one call's rows); before any model or prompt is built."""
    unknown = sorted(set(overrides) - set(TOOL_EPISODES))
    if unknown:
        raise ValueError(f"unknown tool_episodes settings {unknown}; valid: {sorted(TOOL_EPISODES)}")
    spec = TOOL_EPISODES | overrides
    for name in ("num_prompts", "min_len", "max_len", "max_new_tokens", "max_turns", "answer_min", "answer_max"):
        check_int(spec[name], name=name, minimum=1)
    for low, high in (("min_len", "max_len"), ("answer_min", "answer_max")):
        if spec[low] > spec[high]:
            raise ValueError(f"{low}={spec[low]} is above {high}={spec[high]}: give {low} <= {high}")
    check_int(seed, name="seed", minimum=0)
    if isinstance(latencies_ms, str) or not latencies_ms or any(
            isinstance(x, bool) or not isinstance(x, (int, float)) or not 0 <= x <= 60_000 for x in latencies_ms):
        raise ValueError(f"latencies_ms must be one or more numbers of milliseconds in [0, 60000], got {latencies_ms!r}")
    if limits is not None:
        check_call_rows([1] * spec["num_prompts"])
        env = spec["answer_max"] * (spec["max_turns"] - 1)
        limits.check_context("max_new_tokens", spec["max_new_tokens"], positions=spec["max_len"] + spec["max_new_tokens"] + env,
                             what=f"a prompt of {spec['max_len']} tokens, {spec['max_new_tokens']} model tokens and "
                                  f"{spec['max_turns'] - 1} answers of up to {spec['answer_max']} tokens",
                             most=limits.max_positions - spec["max_len"] - env)
    return spec


def call_ids(vocab_size: int, mean_turn_tokens: float, seed: int) -> list[int]:
    """A random ``1 / mean_turn_tokens`` share of the vocabulary (at least one id): the call tokens."""
    count = max(1, round(vocab_size / mean_turn_tokens))
    return sorted(np.random.default_rng([seed, 55]).choice(vocab_size, count, replace=False).tolist())


def run_tool_episodes(model: torch.nn.Module, *, model_name: str, dtype: str, seed: int = 0,
                      latencies_ms: tuple[float, ...] = (0.0, 50.0), config: dict[str, Any] | None = None,
                      **overrides: Any) -> dict[str, Any]:
    """The record of ``TOOL_EPISODES`` (``overrides`` replace its fields) on ``model`` (module
    docstring); ``config``: more ``RolloutConfig`` fields."""
    spec = check_tool_episodes_settings(seed=seed, latencies_ms=latencies_ms, limits=ModelLimits.of_model(model),
                                        **overrides)
    device = next(model.parameters()).device
    vocab = model.get_input_embeddings().weight.shape[0]
    rng = np.random.default_rng([seed, 0])
    lengths = rng.integers(spec["min_len"], spec["max_len"] + 1, spec["num_prompts"])
    prompts = [rng.integers(0, vocab, int(n)).tolist() for n in lengths]
    stops = call_ids(vocab, spec["max_new_tokens"] / spec["max_turns"], seed)
    rollout = Rollout(model, RolloutConfig(**({"mode": "paged", "ignore_eos": True, "profile": True} | (config or {}))))
    sampling = dict(do_sample=True, temperature=spec["temperature"], seed=seed)

    def episodes(latency_ms: float, rows: list[list[int]]):
        env = ToolEnv(vocab, answer_min=spec["answer_min"], answer_max=spec["answer_max"], latency_ms=latency_ms,
                      seed=seed)
        return rollout.generate(rows, max_new_tokens=spec["max_new_tokens"], stop_token_ids=stops, env=env,
                                max_turns=spec["max_turns"], max_env_tokens=spec["answer_max"] * (spec["max_turns"] - 1),
                                progress=False, **sampling)

    # warm-up at full size, untimed: the compile and every row count's decode graph, for the episodes'
    # stepper (forced inputs) and the single turn's
    episodes(0.0, prompts)
    rollout.generate(prompts, max_new_tokens=spec["max_new_tokens"], progress=False, **sampling)
    runs: dict[str, dict[str, Any]] = {}
    outputs = {}
    for latency in latencies_ms:
        wall_ms, result = timed_ms(lambda: episodes(latency, prompts), device)
        outputs[latency] = result.sequences
        env_tokens = sum(sum(mask) for mask in result.env_masks)
        runs[f"episodes_{latency:g}ms"] = _run_fields(wall_ms, result, env_tokens) | {
            "latency_ms": latency, "num_env_calls": result.profile.num_env_calls,
            "prefilled_history_tokens": result.profile.prefilled_history_tokens,
            "env_tokens_decoded": result.profile.env_tokens_decoded,
            "num_prefill_forwards": result.profile.num_prefill_forwards,
            "mean_turns": sum(result.num_turns) / len(result.num_turns)}
    totals = [len(s) for s in outputs[latencies_ms[0]]]
    wall_ms, single = timed_ms(lambda: rollout.generate(prompts, max_new_tokens=totals, progress=False,
                                                                     **sampling), device)
    runs["single_turn"] = _run_fields(wall_ms, single, 0)
    base = runs[f"episodes_{latencies_ms[0]:g}ms"]
    ratios = {"episodes_over_single_turn": base["tok_s"] / runs["single_turn"]["tok_s"]}
    for latency in latencies_ms[1:]:
        ratios[f"latency_{latency:g}ms_over_{latencies_ms[0]:g}ms"] = runs[f"episodes_{latency:g}ms"]["tok_s"] / base["tok_s"]
    rollout.close()
    return {"kind": "tool_episodes", "model": model_name, "dtype": dtype,
            "settings": spec | {"seed": seed, "latencies_ms": list(latencies_ms), "num_call_ids": len(stops)},
            "runs": runs, "ratios": ratios, "issue_targets": ISSUE_TARGETS,
            "same_tokens_at_every_latency": all(outputs[x] == outputs[latencies_ms[0]] for x in latencies_ms),
            "provenance": provenance(device=device, dtype=dtype)}


def _run_fields(wall_ms: float, result: Any, env_tokens: int) -> dict[str, Any]:
    tokens = sum(len(s) for s in result.sequences)
    return {"wall_ms": wall_ms, "model_tokens": tokens - env_tokens, "env_tokens": env_tokens,
            "tok_s": tokens / wall_ms * 1e3, "model_tok_s": (tokens - env_tokens) / wall_ms * 1e3}


def tool_episode_rows(record: dict[str, Any]) -> list[dict[str, Any]]:
    """The record's runs as table rows (run, wall ms, tokens, tok/s, env calls, history prefilled again)."""
    return [{"run": name, **fields} for name, fields in record["runs"].items()]
