"""The RL-regime throughput benchmark: nano-vllm's bench.py shape, with per-request budgets.

    # GPU (H200): Qwen3-0.6B, 256 sequences, prompt lengths and budgets each uniform in 100..1024
    PYTHONPATH=. python3 scripts/bench_rl.py --out data/results/rl_qwen3-0.6b_bfloat16_cuda
    # CPU check in seconds
    PYTHONPATH=. python3 scripts/bench_rl.py --tiny qwen2 --num-seqs 16 --min-len 8 --max-len 48 --out /tmp/rl

The workload (``measure.workloads.uniform_workload``): distinct random-token prompts whose lengths,
and whose output budgets, are drawn uniformly from ``[--min-len, --max-len]`` (seeded); EOS is
ignored, so every request generates exactly its budget and output tok/s counts those tokens only.

Paths: ``ours`` (``Rollout.generate(prompts, max_new_tokens=budgets)`` in ``--mode``; one warm-up
call, its compile and graph capture included, then ``--reps`` timed calls and one profiled call),
four ablations that take the levers away one at a time (``ours_no_compile``; ``ours_masked``:
masked attention over windows instead of live spans; ``ours_full_width``: over the whole capacity;
``ours_one_graph``: one captured graph over every slot as well) and, last, HF
``generate_batch``'s manager with the same per-request budgets (``hf_generate_batch``). Every call is
timed whole with the device synchronised; peak memory is over the weights (cache and graphs included).
Writes ``<out>.json`` (record with provenance: tok/s,
decode ms per step, slots, peak memory per path) and ``<out>.csv`` after every path; an existing
``<out>`` is an error, never overwritten.
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from typing import Any

import torch
from transformers import GenerationConfig

from rollout_lab.cli import positive_int, record_out
from rollout_lab.engine.config import MODES, RolloutConfig
from rollout_lab.engine.profile import synchronize, timed_ms
from rollout_lab.engine.rollout import Rollout
from rollout_lab.measure.models import (add_model_options, load_model,
                                        resolve_model_options,
                                        special_token_ids)
from rollout_lab.measure.provenance import provenance
from rollout_lab.measure.sweep import DECODE_VARIANTS, rl_throughput_rows
from rollout_lab.measure.workloads import lengths_to_prompts, uniform_workload
from rollout_lab.workspace import write_record

PATHS = (*DECODE_VARIANTS, "hf_generate_batch")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, type=record_out,
                   help="output stem: writes <out>.json and <out>.csv (neither may exist)")
    add_model_options(p, default_preset="qwen3-0.6b")
    p.add_argument("--num-seqs", type=positive_int, default=256, help="requests (default 256)")
    p.add_argument("--min-len", type=positive_int, default=100, help="smallest prompt length and budget (default 100)")
    p.add_argument("--max-len", type=positive_int, default=1024, help="largest prompt length and budget (default 1024)")
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument("--mode", default="bucketed", choices=MODES, help="our route (default bucketed)")
    p.add_argument("--slots", type=positive_int, default=None, help="continuous_batch_size (default: every request)")
    p.add_argument("--decode", default="auto", choices=("auto", "graph", "eager"), help="our decode stepper")
    p.add_argument("--decode-widths", type=int, default=None, help="attention windows of 'ours' (default: the engine's)")
    p.add_argument("--reps", type=positive_int, default=1, help="our timed calls after the warm-up (default 1)")
    p.add_argument("--peer-calls", type=positive_int, default=1, help="HF's timed calls, no warm-up (default 1)")
    p.add_argument("--paths", nargs="+", default=list(PATHS), choices=PATHS, help="paths to run, in order")
    args = p.parse_args(argv)
    if args.max_len < args.min_len:
        p.error(f"--max-len {args.max_len} is below --min-len {args.min_len}")
    args.model = resolve_model_options(args)
    return args


def peak_memory(device: torch.device, baseline: int | None) -> int | None:
    return None if baseline is None else int(torch.cuda.max_memory_allocated(device) - baseline)


def run_ours(model, prompts, budgets, args, pad_id: int, device: torch.device, *, variant: str) -> dict[str, Any]:
    settings = dict(DECODE_VARIANTS[variant])
    if args.decode_widths is not None:
        settings.setdefault("decode_widths", args.decode_widths)
    config = RolloutConfig(mode=args.mode, ignore_eos=True, pad_token_id=pad_id,
                           continuous_batch_size=args.slots, decode=args.decode, **settings)
    baseline = torch.cuda.memory_allocated(device) if device.type == "cuda" else None  # the weights
    if baseline is not None:
        torch.cuda.reset_peak_memory_stats(device)
    rollout = Rollout(model, config)
    first_ms, _ = timed_ms(lambda: rollout.generate(prompts, max_new_tokens=budgets), device)
    print(f"{variant:16s} warm-up {first_ms:10.1f} ms (compile and capture included)", file=sys.stderr)
    samples = []
    for rep in range(args.reps):
        ms, result = timed_ms(lambda: rollout.generate(prompts, max_new_tokens=budgets), device)
        samples.append(ms)
        print(f"{variant:16s} rep {rep + 1}  {ms:10.1f} ms", file=sys.stderr)
    peak = peak_memory(device, baseline)
    assert [len(s) for s in result.sequences] == budgets, "ours: a row did not run its own budget"
    profiled = rollout.generate(prompts, max_new_tokens=budgets, profile=True)
    prof = profiled.profile
    stepper = rollout.stepper_info
    rollout.close()
    return {
        "settings": settings, "samples_ms": samples, "mean_ms": statistics.fmean(samples),
        "first_call_ms": first_ms,
        "peak_memory_bytes": peak, "route": profiled.route, "decode": rollout.decode_mode,
        "num_slots": args.slots or len(prompts), "num_decode_steps": prof.num_decode_forwards,
        "stepper": stepper,
        "decode_ms_per_step": prof.decode_ms / max(1, prof.num_decode_forwards),
        "profile": {k: getattr(prof, k) for k in ("planning_ms", "prefill_ms", "decode_ms", "cache_ms",
                                                  "stepper_build_ms",
                                                  "total_ms", "num_prefill_forwards", "peak_cache_columns",
                                                  "cache_bytes")},
    }


def hf_generate_batch(model, prompts, budgets, pad_id: int) -> list[list[int]]:
    """HF continuous batching with per-request budgets: its manager, one request per prompt."""
    config = GenerationConfig(max_new_tokens=max(budgets), do_sample=False, eos_token_id=None,
                              pad_token_id=pad_id)
    manager = model.init_continuous_batching(generation_config=config)
    manager.start()
    try:
        for i, (prompt, budget) in enumerate(zip(prompts, budgets)):
            manager.add_request(input_ids=list(prompt), request_id=f"r{i}", max_new_tokens=budget)
        outputs: dict[str, list[int]] = {}
        deadline = time.monotonic() + 1800
        while len(outputs) < len(prompts):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                if result.error is not None:
                    raise RuntimeError(f"request {result.request_id} failed: {result.error}")
                outputs[result.request_id] = list(result.generated_tokens)
            if time.monotonic() > deadline or not manager.is_running():
                raise RuntimeError(f"generate_batch finished {len(outputs)} of {len(prompts)} requests")
    finally:
        manager.stop(block=True)
    return [outputs[f"r{i}"] for i in range(len(prompts))]


def run_peer(model, prompts, budgets, args, pad_id: int, device: torch.device) -> dict[str, Any]:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    baseline = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
    if baseline is not None:
        torch.cuda.reset_peak_memory_stats(device)
    try:  # no warm-up: HF's manager captures nothing, and one call of it takes minutes
        samples = []
        for _ in range(args.peer_calls):
            ms, sequences = timed_ms(lambda: hf_generate_batch(model, prompts, budgets, pad_id), device)
            samples.append(ms)
            print(f"hf        {ms:10.1f} ms", file=sys.stderr)
    except Exception as err:  # noqa: BLE001 - a peer that cannot run is recorded, not fatal
        return {"skipped": f"{type(err).__name__}: {err}"[:500]}
    if [len(s) for s in sequences] != budgets:
        return {"skipped": "generate_batch did not run every request to its own budget"}
    return {"samples_ms": samples, "mean_ms": statistics.fmean(samples), "first_call_ms": samples[0],
            "peak_memory_bytes": peak_memory(device, baseline)}


def run(args: argparse.Namespace, save=lambda record: None) -> dict[str, Any]:
    """Every path in order; ``save(record)`` after each, so a later failure loses nothing."""
    model, model_name = load_model(args.model, dtype=args.dtype,
                                   device=args.device)
    device = next(model.parameters()).device
    cfg = model.config.get_text_config(decoder=True)
    vocab = model.get_input_embeddings().weight.shape[0]
    pad_id = cfg.pad_token_id if cfg.pad_token_id is not None else 0
    special = special_token_ids(cfg)
    lengths, budgets = uniform_workload(args.num_seqs, low=args.min_len, high=args.max_len, seed=args.seed)
    prompts = lengths_to_prompts(lengths, vocab_size=vocab, seed=args.seed, special_ids=special)
    num_tokens = sum(budgets)
    results: dict[str, Any] = {}
    record = {
        "kind": "rl_throughput",
        "provenance": provenance(device=device, dtype=args.dtype, script="scripts/bench_rl.py", argv=sys.argv[1:]),
        "config": {k: v for k, v in vars(args).items() if k != "out"} | {"model": model_name},
        "workload": {"num_requests": len(prompts), "lengths": lengths, "budgets": budgets,
                     "num_output_tokens": num_tokens, "num_prompt_tokens": sum(lengths)},
        "results": results,
    }
    for path in args.paths:  # ours first: HF's manager last, after our graphs are captured
        if path == "hf_generate_batch":
            results[path] = run_peer(model, prompts, budgets, args, pad_id, device)
        else:
            results[path] = run_ours(model, prompts, budgets, args, pad_id, device, variant=path)
        if "mean_ms" in results[path]:
            results[path]["output_tokens_per_s"] = num_tokens / (results[path]["mean_ms"] / 1e3)
        synchronize(device)
        save(record)
    return record


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    paths = args.out

    def save(record: dict[str, Any]) -> str:
        return write_record(paths, record, rl_throughput_rows(record))

    print(save(run(args, save)), end="")
    print(f"wrote {paths[0]} and {paths[1]}")


if __name__ == "__main__":
    main()
