"""Data-parallel rollout on several GPUs (or CPU processes): measured vs predicted per-rank times
of cost-balanced sharding against round-robin (and verl KK), interleaved in one run.

    torchrun --nproc_per_node 2 scripts/dp_rollout.py --preset qwen2.5-3b --dtype bfloat16 \\
        --workload gsm8k_64 --method balanced --out $OUT/dp_rollout_gsm8k_64.json

NCCL when CUDA is available (each rank on cuda:LOCAL_RANK), else gloo on CPU. Every rank builds
the same random-weight model (same seed) and the same prompts; rank 0 writes one JSON record with
provenance, every sample of every method, and per-rank measured seconds and predicted ms.
"""
from __future__ import annotations

import argparse
import os
import statistics

import torch
import torch.distributed as dist

from rollout_lab.engine.api.config import RolloutConfig
from rollout_lab.engine.distributed import distributed_generate
from rollout_lab.measure.models import from_preset, tiny_model
from rollout_lab.measure.presets import PRESETS
from rollout_lab.measure.provenance import provenance
from rollout_lab.measure.workloads import (WORKLOADS, get_workload,
                                           lengths_to_prompts)
from rollout_lab.planner.sharding import METHODS
from rollout_lab.workspace import write_json_atomic

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen2.5-3b",
                        help=f"model shapes (random weights): {', '.join(PRESETS)} or 'tiny'")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--workload", default="gsm8k_64", help=f"one of {', '.join(WORKLOADS)}")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every prompt length")
    parser.add_argument("--method", default="balanced", choices=METHODS,
                        help="the method under test; round_robin is always run beside it")
    parser.add_argument("--also", nargs="*", default=["round_robin"], choices=METHODS,
                        help="other methods run interleaved with --method")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--continuous-batch-size", type=int, default=None, help="slots per rank")
    parser.add_argument("--costs", default=None, help="a cost file (default: seed coefficients)")
    parser.add_argument("--repeats", type=int, default=3, help="timed repetitions per method")
    parser.add_argument("--layers", type=int, default=None, help="override the preset's depth")
    parser.add_argument("--out", required=True, help="JSON record to write (rank 0)")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    use_cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    dtype = DTYPES[args.dtype]
    if args.preset == "tiny":
        model = tiny_model("qwen2", dtype=dtype).to(device)
    else:
        model = from_preset(args.preset, dtype=dtype, device=device, num_hidden_layers=args.layers)
    vocab = model.get_input_embeddings().weight.shape[0]
    special = {t for t in (model.config.bos_token_id, model.config.eos_token_id,
                           model.config.pad_token_id) if isinstance(t, int)}
    lengths = get_workload(args.workload, scale=args.scale)
    prompts = lengths_to_prompts(lengths, vocab_size=vocab, seed=0, special_ids=sorted(special))
    # no EOS: every request runs the full budget, so timings depend on shapes only
    config = RolloutConfig(mode="auto", continuous_batch_size=args.continuous_batch_size,
                           ignore_eos=True, costs=args.costs or RolloutConfig().costs)
    methods = [args.method] + [m for m in args.also if m != args.method]

    def run(method: str):
        return distributed_generate(model, prompts, max_new_tokens=args.max_new_tokens,
                                    config=config, method=method)

    for method in methods:  # warm-up, untimed: kernels, allocator, HF caches
        run(method)
    samples: dict[str, list] = {m: [] for m in methods}
    for _ in range(args.repeats):
        for method in methods:  # interleaved, so drift hits every method alike
            samples[method].append(run(method))

    if rank == 0:
        record = {
            "provenance": provenance(device=device, dtype=dtype, world_size=world_size,
                                     backend=dist.get_backend(), config=dict(
                preset=args.preset, layers=args.layers, workload=args.workload, scale=args.scale,
                num_prompts=len(prompts), max_new_tokens=args.max_new_tokens,
                continuous_batch_size=args.continuous_batch_size, costs=config.costs.to_dict(),
                repeats=args.repeats, methods=methods)),
            "lengths": lengths,
            "methods": {m: summarise(samples[m], lengths) for m in methods},
        }
        base = record["methods"].get("round_robin")
        if base is not None:
            for m, entry in record["methods"].items():
                entry["measured_makespan_vs_round_robin"] = (
                    entry["measured_makespan_s_mean"] / base["measured_makespan_s_mean"])
                entry["predicted_makespan_vs_round_robin"] = (
                    entry["predicted_makespan_ms"] / base["predicted_makespan_ms"])
        write_json_atomic(args.out, record)
        for m, entry in record["methods"].items():
            print(f"{m:15s} measured makespan {entry['measured_makespan_s_mean'] * 1e3:8.1f} ms "
                  f"(samples {[round(s * 1e3, 1) for s in entry['measured_makespan_s']]}), "
                  f"predicted {entry['predicted_makespan_ms']:8.1f} ms; per rank measured "
                  f"{[round(t * 1e3, 1) for t in entry['rank_times_s_mean']]} ms, predicted "
                  f"{[round(c, 1) for c in entry['predicted_rank_costs_ms']]} ms, "
                  f"routes {entry['routes']}")
        print(f"wrote {args.out}")
    dist.barrier()
    dist.destroy_process_group()


def summarise(results: list, lengths: list[int]) -> dict:
    first = results[0]
    per_rank = list(zip(*(r.rank_times_s for r in results)))
    return {
        "shards": first.shards,
        "shard_lengths": [[lengths[i] for i in shard] for shard in first.shards],
        "routes": first.routes,
        "predicted_rank_costs_ms": first.predicted_rank_costs_ms,
        "predicted_makespan_ms": first.predicted_makespan_ms,
        "rank_times_s": [list(r.rank_times_s) for r in results],
        "rank_times_s_mean": [statistics.fmean(t) for t in per_rank],
        "measured_makespan_s": [r.makespan_s for r in results],
        "measured_makespan_s_mean": statistics.fmean(r.makespan_s for r in results),
        "wall_s": [r.wall_s for r in results],
    }


if __name__ == "__main__":
    main()
