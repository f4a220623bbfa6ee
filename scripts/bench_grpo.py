"""GRPO-shaped rollout benchmark: N prompts x S sampled responses, shared prefill vs unshared vs HF.

    # GPU (H200, ~1-2 min): 64 GSM8K prompts x 8 samples, 128 new tokens, Qwen2.5-3B shapes, bf16
    PYTHONPATH=. python3 scripts/bench_grpo.py --out data/results/grpo_qwen2.5-3b_bf16_cuda
    # CPU check in seconds
    PYTHONPATH=. python3 scripts/bench_grpo.py --tiny qwen2 --scale 0.1 --out /tmp/grpo_tiny

Paths, all with seeded sampling at the same temperature / top-p and EOS disabled (every row
generates ``--max-new-tokens`` tokens):

- ``shared``: ``Rollout.generate(prompts, num_samples=S, do_sample=True, ...)``, each prompt
  prefilled once and its KV replicated into its S slots;
- ``unshared``: the same with ``share_prefill=False`` (every (prompt, sample) row prefilled);
- ``hf_generate``: HF ``generate(..., do_sample=True, num_return_sequences=S)`` (dynamic cache).

One warm-up round (graph capture included) and ``--reps`` interleaved timed rounds, every call
timed whole with the device synchronised before and after. Then one pass per path, alone on the
device (the other paths' caches released), for its peak memory over the weights and, for ours,
the profile (prefill rows, phase times). Writes ``<out>.json`` (record with provenance) and
``<out>.csv`` (one row per timed sample and one mean row per path).
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
from typing import Any

import torch

from rollout_lab.cli import record_out
from rollout_lab.engine.config import RolloutConfig
from rollout_lab.engine.prefill import left_padded
from rollout_lab.engine.profile import synchronize, timed_ms
from rollout_lab.engine.rollout import Rollout
from rollout_lab.measure.calibrate import load_calibration
from rollout_lab.measure.models import (add_model_options, load_model,
                                        resolve_model_options,
                                        special_token_ids)
from rollout_lab.measure.provenance import provenance
from rollout_lab.measure.sweep import grpo_rows
from rollout_lab.measure.workloads import (DATASETS, lengths_to_prompts,
                                           padding_share, sample_lengths,
                                           scale_lengths)
from rollout_lab.planner.cost import CostCoefficients
from rollout_lab.workspace import write_record

PATHS = ("shared", "unshared", "hf_generate")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, type=record_out,
                   help="output stem: writes <out>.json and <out>.csv (neither may exist)")
    add_model_options(p, default_preset="qwen2.5-3b")
    p.add_argument("--dataset", default="gsm8k", choices=DATASETS, help="prompt-length distribution")
    p.add_argument("--num-prompts", type=int, default=64, help="unique prompts (default 64)")
    p.add_argument("--num-samples", type=int, default=8, help="samples per prompt (default 8)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens per sample (default 128)")
    p.add_argument("--scale", type=float, default=1.0, help="multiply every prompt length (CPU checks)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default 1.0)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus mass (default 1.0 = off)")
    p.add_argument("--seed", type=int, default=0, help="workload and sampling seed")
    p.add_argument("--mode", default="bucketed", help="our route (default bucketed)")
    p.add_argument("--costs", default=None, help="cost file for our planner (default: reference coefficients)")
    p.add_argument("--reps", type=int, default=2, help="timed interleaved rounds after one warm-up (default 2)")
    p.add_argument("--paths", nargs="+", default=list(PATHS), choices=PATHS, help="paths to run")
    args = p.parse_args(argv)
    for name in ("num_prompts", "num_samples", "max_new_tokens", "reps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 0 < args.top_p <= 1 or not args.temperature > 0:
        p.error("--top-p must be in (0, 1] and --temperature > 0")
    args.model = resolve_model_options(args)
    return args


def build_model(args: argparse.Namespace) -> tuple[torch.nn.Module, str]:
    if args.tiny:
        torch.set_num_threads(1)  # tiny shapes: more threads only contend (this script's process only)
    return load_model(args.model, dtype=args.dtype, device=args.device)


class Paths:
    """The three calls; ours keep their Rollout (and its captured graph) across rounds."""

    def __init__(self, model, prompts, args, pad_id: int, costs: CostCoefficients):
        self.model, self.prompts, self.args, self.pad_id, self.costs = model, prompts, args, pad_id, costs
        self.rollouts: dict[str, Rollout] = {}

    def rollout(self, path: str, *, profile: bool = False) -> Rollout:
        key = path + ("+profile" if profile else "")
        if key not in self.rollouts:
            config = RolloutConfig(mode=self.args.mode, ignore_eos=True, pad_token_id=self.pad_id,
                                   costs=self.costs, share_prefill=path == "shared", profile=profile)
            self.rollouts[key] = Rollout(self.model, config)
        return self.rollouts[key]

    def call(self, path: str, *, profile: bool = False) -> tuple[list[list[int]], Any]:
        a = self.args
        if path == "hf_generate":
            return self._hf(), None
        result = self.rollout(path, profile=profile).generate(
            self.prompts, max_new_tokens=a.max_new_tokens, num_samples=a.num_samples, do_sample=True,
            temperature=a.temperature, top_p=a.top_p, seed=a.seed)
        return result.sequences, result

    @torch.no_grad()
    def _hf(self) -> list[list[int]]:
        a = self.args
        device = next(self.model.parameters()).device
        ids, mask = left_padded(self.prompts, self.pad_id, device)
        torch.manual_seed(a.seed)
        out = self.model.generate(
            input_ids=ids, attention_mask=mask, do_sample=True, temperature=a.temperature,
            top_p=a.top_p, top_k=0, num_return_sequences=a.num_samples, max_new_tokens=a.max_new_tokens,
            min_new_tokens=a.max_new_tokens, pad_token_id=self.pad_id,
        )  # [prompts * samples, width + max_new_tokens], request-major like ours
        return out[:, ids.shape[1]:].tolist()

    def release(self) -> None:
        for rollout in self.rollouts.values():
            rollout.close()
        self.rollouts.clear()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def memory_pass(paths: Paths, path: str, device: torch.device) -> dict[str, Any]:
    """The path alone on the device: peak allocated over the weights, and our profile."""
    paths.release()
    baseline = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    sequences, result = paths.call(path, profile=path != "hf_generate")
    synchronize(device)
    info: dict[str, Any] = {"peak_memory_bytes": None, "num_generated_tokens": sum(map(len, sequences))}
    if baseline is not None:
        info["peak_memory_bytes"] = int(torch.cuda.max_memory_allocated(device) - baseline)
    num_rows = len(sequences)
    if result is None:
        info.update(route="hf_generate", num_prefill_rows=num_rows, num_replicated_rows=0)
    else:
        prof = result.profile
        info.update(route=result.route, num_prefill_rows=prof.num_prefill_rows,
                    num_replicated_rows=prof.num_replicated_rows, num_prefill_forwards=prof.num_prefill_forwards,
                    prefill_ms=prof.prefill_ms, decode_ms=prof.decode_ms, cache_ms=prof.cache_ms,
                    planning_ms=prof.planning_ms, profiled_total_ms=prof.total_ms,
                    num_buckets=sum(p.num_buckets for p in result.plans))
    paths.release()
    return info


def run(args: argparse.Namespace) -> dict[str, Any]:
    model, model_name = build_model(args)
    device = next(model.parameters()).device
    cfg = model.config.get_text_config(decoder=True)
    vocab = model.get_input_embeddings().weight.shape[0]
    pad_id = cfg.pad_token_id if cfg.pad_token_id is not None else 0
    special = special_token_ids(cfg)
    lengths = sample_lengths(args.dataset, args.num_prompts, seed=args.seed)
    if args.scale != 1.0:
        lengths = scale_lengths(lengths, args.scale)
    prompts = lengths_to_prompts(lengths, vocab_size=vocab, seed=args.seed, special_ids=special)
    costs = load_calibration(args.costs, model=model, model_name=model_name) if args.costs else CostCoefficients()
    paths = Paths(model, prompts, args, pad_id, costs)

    samples: dict[str, list[float]] = {p: [] for p in args.paths}
    outputs: dict[str, list[list[int]]] = {}
    for rep in range(args.reps + 1):  # round 0 is the warm-up
        for path in args.paths:
            ms, (sequences, _) = timed_ms(lambda: paths.call(path), device)
            outputs[path] = sequences
            if rep > 0:
                samples[path].append(ms)
            print(f"{'warm-up' if rep == 0 else f'rep {rep}'}  {path:12s} {ms:10.1f} ms", file=sys.stderr)
    num_tokens = args.num_prompts * args.num_samples * args.max_new_tokens
    results: dict[str, Any] = {}
    for path in args.paths:
        mean = statistics.fmean(samples[path])
        results[path] = {"ms": samples[path], "mean_ms": mean, "tokens_per_s": num_tokens / (mean / 1e3),
                         **memory_pass(paths, path, device)}
        assert results[path]["num_generated_tokens"] == num_tokens, path
    checks: dict[str, Any] = {}
    if "shared" in outputs and "unshared" in outputs:
        same = sum(a == b for a, b in zip(outputs["shared"], outputs["unshared"]))
        checks["shared_equals_unshared_fraction"] = same / len(outputs["shared"])
    ratios = {f"{p}_over_shared": results[p]["mean_ms"] / results["shared"]["mean_ms"]
              for p in args.paths if p != "shared" and "shared" in results}
    return {
        "kind": "grpo",
        "provenance": provenance(device=device, dtype=args.dtype, script="scripts/bench_grpo.py",
                                 argv=sys.argv[1:]),
        "config": {k: v for k, v in vars(args).items() if k != "out"} | {"model": model_name},
        "workload": {"lengths": lengths, "num_prompts": len(prompts), "num_samples": args.num_samples,
                     "num_rows": len(prompts) * args.num_samples, "padding_share": padding_share(lengths),
                     "num_generated_tokens": num_tokens},
        "results": results, "ratios": ratios, "checks": checks,
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    paths = args.out
    record = run(args)
    print(write_record(paths, record, grpo_rows(record)), end="")
    print(f"ratios: {record['ratios']}  checks: {record['checks']}")
    print(f"wrote {paths[0]} and {paths[1]}")


if __name__ == "__main__":
    main()
