"""The paths a sweep times (our routes and the HF peers), and how one call of a path is made and timed.

    runner = PathRunner(model, "auto", prompts, max_new_tokens=16, costs=None, pad=0,
                        repetition_penalty=1.0, decode=None)
    ms, out, peak_bytes = timed_call(runner.call, device)

Each call is timed whole, the device synchronised before and after. Our paths keep one Rollout
across the warm-up, the timed calls and the profiling call; torch is imported only when a call runs.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

from rollout_lab.timing import timed_ms

OUR_PATHS = ("nocb", "equal_width", "aligned", "bucketed", "auto")
MANUAL_PATHS = ("nocb", "equal_width", "aligned", "bucketed")
PEER_PATHS = ("hf_static", "hf_generate_batch")
PATHS = OUR_PATHS + PEER_PATHS


def check_paths(paths: Sequence[str] | None) -> tuple[str, ...]:
    paths = PATHS if paths is None else tuple(paths)
    unknown = [p for p in paths if p not in PATHS]
    if unknown or not paths:
        raise ValueError(f"unknown paths {unknown or '(none given)'}; valid: {', '.join(PATHS)}")
    return tuple(dict.fromkeys(paths))


def check_attn_implementation(model: Any, expected: Any) -> None:
    """generate_batch may switch the model to a paged attention; put the sweep's own back."""
    if expected is not None and getattr(model.config, "_attn_implementation", None) != expected:
        model.set_attn_implementation(expected) if hasattr(model, "set_attn_implementation") \
            else setattr(model.config, "_attn_implementation", expected)


def release_memory(device: Any) -> None:
    """After generate_batch: drop its paged cache (~all free GPU memory) before the next path runs."""
    import gc

    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def timed_call(fn: Callable[[], Any], device: Any) -> tuple[float, Any, int | None]:
    """(ms, output, peak allocated bytes or None) of one whole call."""
    import torch

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    ms, out = timed_ms(fn, device)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return ms, out, peak


class PathRunner:
    """One path's calls: ``call()`` (timed), ``profile()`` -> info or None, ``close()``.

    Our paths keep one Rollout (its captured decode graph and cache) for the warm-up, the timed
    calls and the profiling call after them; it is closed when the workload ends.
    """

    def __init__(self, model, path, prompts, *, max_new_tokens, costs, pad, repetition_penalty, decode):
        self.model, self.path, self.prompts, self.max_new_tokens = model, path, prompts, max_new_tokens
        self.pad, self.repetition_penalty = pad, repetition_penalty
        self.settings = dict(mode=path, eos_token_id=None, pad_token_id=pad,
                             repetition_penalty=repetition_penalty)
        if costs is not None:
            self.settings["costs"] = costs
        if decode is not None:
            self.settings["decode"] = decode
        self._rollout = None

    def _engine(self, *, profile: bool):
        from rollout_lab.engine import Rollout, RolloutConfig

        if self._rollout is None:
            self._rollout = Rollout(self.model, RolloutConfig(**self.settings, profile=profile))
        return self._rollout

    def call(self) -> Any:
        from rollout_lab import peers

        if self.path in OUR_PATHS:
            return self._engine(profile=False).generate(self.prompts, max_new_tokens=self.max_new_tokens)
        if self.path == "hf_static":
            return peers.hf_generate(self.model, self.prompts, max_new_tokens=self.max_new_tokens,
                                     pad_token_id=self.pad, cache_implementation="static",
                                     repetition_penalty=self.repetition_penalty)
        return peers.hf_generate_batch(self.model, self.prompts, max_new_tokens=self.max_new_tokens,
                                       pad_token_id=self.pad)

    def profile(self) -> dict[str, Any]:
        if self.path not in OUR_PATHS:  # peers have no profile: no extra call
            return {"route": None, "buckets": None, "profile": None}
        # The timed calls' Rollout, with profiling switched on: its decode graph is already captured,
        # so the profile is a steady-state call's and no capture happens after the peers compiled.
        rollout = self._engine(profile=True)
        rollout.config = dataclasses.replace(rollout.config, profile=True)
        result = rollout.generate(self.prompts, max_new_tokens=self.max_new_tokens)
        self.close()
        return _engine_info(result)

    def close(self) -> None:
        if self._rollout is not None:
            close = getattr(self._rollout, "close", None)
            if close is not None:
                close()
            self._rollout = None


def _engine_info(result: Any) -> dict[str, Any]:
    profile = result.profile
    profile = profile.to_dict() if hasattr(profile, "to_dict") else (dict(vars(profile)) if profile else None)
    buckets = [[len(b), int(w)] for plan in (result.plans or []) for b, w in zip(plan.buckets, plan.widths)]
    return {"route": result.route, "buckets": buckets, "num_admissions": len(result.plans or []),
            "profile": profile}


def output_sequences(out: Any) -> list[list[int]]:
    seqs = getattr(out, "sequences", out)
    return [list(map(int, s)) for s in seqs]
