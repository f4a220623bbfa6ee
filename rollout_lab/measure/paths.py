"""The paths a measurement runs: our routes and the HF peers, and how one call is made and timed.

    from rollout_lab.measure.paths import PathRunner, timed_call
    runner = PathRunner(model, "auto", prompts, max_new_tokens=16, costs=None, pad=0,
                        repetition_penalty=1.0, decode=None)
    ms, out, peak_bytes = timed_call(runner.call, device)

Each call is timed whole, the device synchronised before and after. Our paths keep one Rollout
across the warm-up, the timed calls and the profiling call. ``DECODE_VARIANTS`` are the decode
levers the benchmarks (rl, decode-step, logits) take away one at a time.
"""
from __future__ import annotations

import gc
from typing import Any, Callable, Sequence

import torch

from rollout_lab.engine.api.config import MODES, RolloutConfig
from rollout_lab.engine.profile import timed_ms
from rollout_lab.engine.api.rollout import Rollout
from rollout_lab.measure.peers import hf_generate, hf_generate_batch
from rollout_lab.measure.records import PEER_PATHS
from rollout_lab.planner.checks import check_int

PATHS = MODES + PEER_PATHS  # our routes, then the HF peers
# timed calls of one measurement (reps, repetitions, iterations): each is kept in the record, and
# past this many a run takes days, not a better estimate
MAX_TIMED_CALLS = 10_000
# the decode levers, as RolloutConfig settings over the engine's defaults (on CUDA: span attention,
# the compiled step, the row ladder); each ablation takes one more away (rollout-lab bench rl,
# decode-step, logits)
DECODE_VARIANTS: dict[str, dict[str, Any]] = {
    "ours": {},
    "ours_no_compile": {"compile": False},
    "ours_masked": {"compile": False, "decode_attention": "masked"},  # attention windows, not spans
    "ours_full_width": {"compile": False, "decode_attention": "masked", "decode_widths": 1},
    "ours_one_graph": {"compile": False, "decode_attention": "masked", "decode_widths": 1,
                       "max_decode_graphs": 1},
    # "ours" with the whole model compiled as one graph instead of each decoder layer (compile=True,
    # engine.runner.compiling): inductor fuses across layers, at a far longer first compile (CUDA only)
    "ours_compile_model": {"compile": True},
    # "ours" with q/k/v and gate/up as separate matmuls (engine.runner.fusing's fusion off): what it saves
    "ours_unfused": {"fuse_projections": False},
    # the same saving on the uncompiled step: seconds to build, where a compile takes minutes
    "ours_no_compile_fused": {"compile": False, "fuse_projections": True},
    # the paged route, and the same with its pool in e4m3 (RolloutConfig(kv_cache_dtype="fp8"),
    # engine.kernels.kv_fp8): half the KV bytes each step reads, and the logprobs it moves (bench logits)
    "ours_paged": {"mode": "paged"},
    "ours_fp8_kv": {"mode": "paged", "kv_cache_dtype": "fp8"},
}
# the variants that run the paged route (the decode-step bench times the aligned cache's step)
PAGED_VARIANTS = tuple(name for name, settings in DECODE_VARIANTS.items() if settings.get("mode") == "paged")
# the levers the decode-step and logits benches compare unless told: ours, then the compile and the spans taken away
LEVER_VARIANTS = ("ours", "ours_no_compile", "ours_masked")


def check_timed_calls(value: object, *, name: str) -> int:
    """``value`` as an int; ValueError naming ``name`` unless it is an int in [1, ``MAX_TIMED_CALLS``]."""
    number = check_int(value, name=name)
    if number > MAX_TIMED_CALLS:
        raise ValueError(f"{name}={number}: more timed calls than one record keeps; give at most {MAX_TIMED_CALLS}")
    return number


def check_paths(paths: Sequence[str] | None) -> tuple[str, ...]:
    paths = PATHS if paths is None else tuple(paths)
    unknown = [p for p in paths if p not in PATHS]
    if unknown or not paths:
        raise ValueError(f"unknown paths {unknown or '(none given)'}; valid: {', '.join(PATHS)}")
    return tuple(dict.fromkeys(paths))


def release_memory(device: Any) -> None:
    """After generate_batch: drop its paged cache (~all free GPU memory) before the next path runs."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def timed_call(fn: Callable[[], Any], device: Any) -> tuple[float, Any, int | None]:
    """(ms, output, peak allocated bytes or None) of one whole call."""
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

    def __init__(self, model, path, prompts, *, max_new_tokens, costs, pad, repetition_penalty, decode,
                 engine=None):
        self.model, self.path, self.prompts, self.max_new_tokens = model, path, prompts, max_new_tokens
        self.pad, self.repetition_penalty = pad, repetition_penalty
        self.settings = dict(engine or {}, mode=path, ignore_eos=True, pad_token_id=pad,
                             repetition_penalty=repetition_penalty)
        if costs is not None:
            self.settings["costs"] = costs
        if decode is not None:
            self.settings["decode"] = decode
        self._rollout = None

    def _engine(self) -> Rollout:
        if self._rollout is None:
            self._rollout = Rollout(self.model, RolloutConfig(**self.settings))
        return self._rollout

    def call(self) -> Any:
        if self.path in MODES:
            return self._engine().generate(self.prompts, max_new_tokens=self.max_new_tokens, progress=False)
        if self.path == "hf_static":
            return hf_generate(self.model, self.prompts, max_new_tokens=self.max_new_tokens,
                                     pad_token_id=self.pad, cache_implementation="static",
                                     repetition_penalty=self.repetition_penalty)
        return hf_generate_batch(self.model, self.prompts, max_new_tokens=self.max_new_tokens,
                                       pad_token_id=self.pad)

    def profile(self) -> dict[str, Any]:
        if self.path not in MODES:  # peers have no profile: no extra call
            return {"route": None, "buckets": None, "profile": None}
        # The timed calls' Rollout, profiling this call: its decode graph is already captured, so
        # the profile is a steady-state call's and no capture happens after the peers compiled.
        result = self._engine().generate(self.prompts, max_new_tokens=self.max_new_tokens, profile=True,
                                         progress=False)
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
