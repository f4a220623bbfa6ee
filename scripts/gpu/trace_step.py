"""Where a rollout's time goes, kernel by kernel: torch.profiler over one warm ``Rollout.generate`` on
one route, of the EOS long-tail workload (``measure.workloads.eos_long_tail``, sampled at T=1) or of
nano-vllm's shape (``--workload nano``: ``uniform_workload``, greedy, EOS ignored, every slot free), or
of the trainer loop's rollout (``--workload grpo``: GSM8K-length prompts x 8 samples x 256 tokens,
T=1, EOS ignored, logprobs of ``--logprobs-mode``, as ``rollout-lab bench trainer-loop``).

    python scripts/gpu/trace_step.py --preset qwen2.5-0.5b --mode paged --slots 128 --out $OUT/trace_paged.txt
    python scripts/gpu/trace_step.py --preset qwen3-0.6b --workload nano --out $OUT/trace_nano.txt
    python scripts/gpu/trace_step.py --preset qwen2.5-0.5b --workload grpo --logprobs-mode trainer --out $OUT/t.txt
    python scripts/gpu/trace_step.py --tiny qwen2 --num-prompts 16 --max-new-tokens 32 --out /tmp/t.txt   # CPU check

Prints (and writes to ``--out``) the wall time, the profile's phases, the device time summed over
kernels (CUDA: kernels replayed inside CUDA graphs included), and the top kernels and host ops by
their total time. A diagnostic: the records that show speed are the benchmarks' (``rollout-lab bench``).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from rollout_lab.engine.api.config import RolloutConfig
from rollout_lab.engine.profile import synchronize
from rollout_lab.engine.api.rollout import Rollout
from rollout_lab.engine.trainer import rollout_logprobs
from rollout_lab.measure.models import load_model, special_token_ids
from rollout_lab.measure.workloads import eos_long_tail, lengths_to_prompts, sample_lengths, uniform_workload


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--preset")
    which.add_argument("--tiny")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--workload", choices=("eos_long_tail", "nano", "grpo"), default="eos_long_tail")
    parser.add_argument("--mode", default="paged")
    parser.add_argument("--slots", type=int, default=None,
                        help="continuous_batch_size (default 128 for eos_long_tail, every row for nano)")
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--max-new-tokens", type=int, default=None,
                        help="eos_long_tail's budget (default 512); nano's prompts and budgets are U(100, this) "
                             "(default 1,024)")
    parser.add_argument("--logprobs-mode", default="raw",
                        help="grpo's logprobs_mode (raw, processed, trainer, trainer_fp32)")
    parser.add_argument("--hazard", type=float, default=1 / 295)
    parser.add_argument("--dataset", default="gpqa_diamond")
    parser.add_argument("--no-fuse-projections", action="store_true",
                        help="run the decode step unfused (RolloutConfig(fuse_projections=False); default 'auto')")
    parser.add_argument("--batch-invariant", action="store_true",
                        help="RolloutConfig(batch_invariant=True): the invariant kernels' step (issue 56)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8"),
                        help="RolloutConfig(kv_cache_dtype=...): the paged pool in e4m3 (issue 57)")
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model_name = args.preset or f"tiny-{args.tiny}"
    dtype = args.dtype if device == "cuda" else "float32"
    model, name = load_model(model_name, dtype=dtype, device=device)
    cfg = model.config.get_text_config(decoder=True)
    vocab = model.get_input_embeddings().weight.shape[0]
    special = special_token_ids(cfg)
    if args.workload == "nano":  # as rollout-lab bench rl: U(100, max) prompts and budgets, seed 0
        high = args.max_new_tokens or 1024
        lengths, budgets = uniform_workload(args.num_prompts, low=min(100, high), high=high, seed=0)
        eos, slots, call = None, args.slots, dict(max_new_tokens=budgets)
    elif args.workload == "grpo":  # as rollout-lab bench trainer-loop: 64 GSM8K lengths x 8 samples
        lengths, eos, slots = sample_lengths("gsm8k", args.num_prompts, seed=0), None, args.slots
        call = dict(max_new_tokens=args.max_new_tokens or 256, num_samples=8, do_sample=True, temperature=1.0,
                    seed=0, return_logprobs=True, logprobs_mode=args.logprobs_mode)
    else:
        lengths, eos = eos_long_tail(vocab, num_prompts=args.num_prompts, dataset=args.dataset,
                                     hazard=args.hazard, special_ids=special)
        slots = args.slots or 128
        call = dict(max_new_tokens=args.max_new_tokens or 512, do_sample=True, temperature=1.0, seed=0)
    prompts = lengths_to_prompts(lengths, vocab_size=vocab, seed=0, special_ids=special)
    rollout = Rollout(model, RolloutConfig(mode=args.mode, continuous_batch_size=slots, eos_token_id=eos,
                                           ignore_eos=args.workload == "grpo",
                                           pad_token_id=cfg.pad_token_id or 0,
                                           batch_invariant=args.batch_invariant, kv_cache_dtype=args.kv_cache_dtype,
                                           **({"fuse_projections": False} if args.no_fuse_projections else {})))
    started = time.perf_counter()
    rollout.generate(prompts, **call)
    synchronize(device)
    first_s = time.perf_counter() - started
    prof_result = rollout.generate(prompts, profile=True, **call).profile  # the phases (synchronised)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as trace:
        started = time.perf_counter()
        result = rollout.generate(prompts, **call)
        synchronize(device)
        wall_ms = (time.perf_counter() - started) * 1e3
    events = trace.key_averages()
    device_us = sum(e.self_device_time_total for e in events if e.device_type.name == "CUDA")
    launches = sum(e.count for e in events if e.device_type.name == "CUDA")  # graph replays' kernels included
    steps = max(prof_result.num_decode_forwards, 1)
    layers = cfg.num_hidden_layers
    lines = [
        f"{name} {dtype} {device} {args.workload} mode={args.mode} slots={slots} prompts={args.num_prompts} "
        f"max_new={args.max_new_tokens} logprobs={call.get('logprobs_mode')} fused={rollout.runner.fused} "
        f"invariant={args.batch_invariant} kv={args.kv_cache_dtype} decode={rollout.runner.decode_mode}: "
        f"route {result.route}, "
        f"{sum(map(len, result.sequences))} tokens",
        f"first call {first_s:.1f} s; traced call {wall_ms:.1f} ms; kernels {device_us / 1e3:.1f} ms summed",
        "profiled call phases (ms): " + ", ".join(
            f"{k} {getattr(prof_result, k):.1f}" for k in ("total_ms", "prefill_ms", "decode_ms", "cache_ms",
                                                            "planning_ms", "stepper_build_ms")),
        f"decode steps {prof_result.num_decode_forwards}, live rows per step {prof_result.live_rows_per_step:.1f}, "
        f"prefill forwards {prof_result.num_prefill_forwards}, backend {prof_result.prefill_backend}",
        f"kernel launches {launches}: {launches / steps:.0f} per decode step, {launches / steps / layers:.1f} per "
        f"layer and step ({layers} layers; the prefill forwards' launches counted in)",
        "", "== by device time ==",
        events.table(sort_by="self_cuda_time_total" if device == "cuda" else "self_cpu_time_total",
                     row_limit=args.top, max_name_column_width=70),
        "== by host time ==", events.table(sort_by="self_cpu_time_total", row_limit=args.top,
                                            max_name_column_width=70),
    ]
    if str(call.get("logprobs_mode", "")).startswith("trainer"):  # the recompute alone, profiled apart
        lines += recompute_lines(model, prompts, result.sequences, pad_id=cfg.pad_token_id or 0,
                                 fp32_head=call["logprobs_mode"] == "trainer_fp32", device=device, top=args.top)
    text = "\n".join(lines)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print("\n".join(lines[:6]), file=sys.stderr)
    return 0


def recompute_lines(model, prompts, sequences, *, pad_id: int, fp32_head: bool, device: str, top: int) -> list[str]:
    """The "trainer" logprobs' teacher-forced forward (``engine.trainer.rollout_logprobs``) of the
    traced call's rows on its own: its wall time (a warm-up first) and its kernels."""
    num_samples = len(sequences) // len(prompts)
    rows = [list(p) for p in prompts for _ in range(num_samples)]
    run = lambda: rollout_logprobs(model, rows, sequences, pad_token_id=pad_id, fp32_head=fp32_head)  # noqa: E731
    run()
    synchronize(device)
    started = time.perf_counter()
    run()
    synchronize(device)
    wall_ms = (time.perf_counter() - started) * 1e3
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as trace:
        run()
        synchronize(device)
    events = trace.key_averages()
    device_us = sum(e.self_device_time_total for e in events if e.device_type.name == "CUDA")
    return ["", f"== the trainer logprobs' forward alone: {wall_ms:.1f} ms wall, kernels {device_us / 1e3:.1f} ms "
                f"summed, {len(rows)} rows ==",
            events.table(sort_by="self_cuda_time_total" if device == "cuda" else "self_cpu_time_total",
                         row_limit=top, max_name_column_width=70)]


if __name__ == "__main__":
    sys.exit(main())
