"""Teacher-forced logits of our decode step against a plain forward (measure.fidelity), per lever.

    # GPU (H200): Qwen3-0.6B in bf16, 16 prompts of 100..1024 tokens, 64 forced tokens each
    PYTHONPATH=. python3 scripts/check_logits.py --out data/results/fidelity_qwen3-0.6b_bfloat16_cuda
    # CPU check in seconds
    PYTHONPATH=. python3 scripts/check_logits.py --tiny qwen3 --num-seqs 4 --min-len 4 --max-len 20 --steps 6 --out /tmp/fid

The forced tokens are the oracle's: HF ``generate`` (greedy, EOS ignored), one request at a time.
For each variant of ``measure.sweep.DECODE_VARIANTS`` the record has the largest absolute logit error
over every position and the top-1 agreement where the reference's top-2 margin exceeds that error.
Written after every variant, atomically; an existing ``--out`` is an error.
"""
from __future__ import annotations

import argparse
import sys
from typing import Any

import torch
from transformers import GenerationConfig

from rollout_lab.cli import positive_int, record_out
from rollout_lab.engine.config import RolloutConfig
from rollout_lab.measure.fidelity import teacher_forced_check
from rollout_lab.measure.models import (add_model_options, load_model,
                                        resolve_model_options,
                                        special_token_ids)
from rollout_lab.measure.provenance import provenance
from rollout_lab.measure.sweep import DECODE_VARIANTS
from rollout_lab.measure.workloads import lengths_to_prompts, uniform_workload
from rollout_lab.workspace import write_record


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, type=record_out,
                   help="output stem: writes <out>.json and <out>.csv (neither may exist)")
    add_model_options(p, default_preset="qwen3-0.6b")
    p.add_argument("--num-seqs", type=positive_int, default=16)
    p.add_argument("--min-len", type=positive_int, default=100)
    p.add_argument("--max-len", type=positive_int, default=1024)
    p.add_argument("--steps", type=positive_int, default=64, help="forced tokens per request")
    p.add_argument("--variants", nargs="+", default=["ours", "ours_no_compile", "ours_masked"],
                   choices=sorted(DECODE_VARIANTS))
    p.add_argument("--cache", default="aligned", choices=("aligned", "paged"),
                   help="the KV cache the decode step reads: the aligned one, or the paged route's")
    args = p.parse_args(argv)
    if args.max_len < args.min_len:
        p.error(f"--max-len {args.max_len} is below --min-len {args.min_len}")
    args.model = resolve_model_options(args)
    return args


@torch.no_grad()
def oracle_tokens(model, prompts, steps: int) -> list[list[int]]:
    device = next(model.parameters()).device
    config = GenerationConfig(max_new_tokens=steps, min_new_tokens=steps, do_sample=False, eos_token_id=None,
                              pad_token_id=0)
    return [model.generate(torch.tensor([p], device=device), generation_config=config)[0, len(p):].tolist()
            for p in prompts]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    paths = args.out
    model, name = load_model(args.model, dtype=args.dtype, device=args.device)
    model.generation_config = GenerationConfig()  # nothing from the model's defaults (EOS) stops the oracle
    cfg = model.config.get_text_config(decoder=True)
    vocab = model.get_input_embeddings().weight.shape[0]
    lengths, _ = uniform_workload(args.num_seqs, low=args.min_len, high=args.max_len, seed=0)
    prompts = lengths_to_prompts(lengths, vocab_size=vocab, seed=0, special_ids=special_token_ids(cfg))
    forced = oracle_tokens(model, prompts, args.steps)
    device = next(model.parameters()).device
    record: dict[str, Any] = {
        "kind": "teacher_forced_logits",
        "provenance": provenance(device=device, dtype=args.dtype, script="scripts/check_logits.py", argv=sys.argv[1:]),
        "config": {"model": name, "lengths": lengths, "steps": args.steps, "cache": args.cache}, "variants": {},
    }
    rows = []
    for variant in args.variants:
        mode = {"mode": "paged"} if args.cache == "paged" else {}
        settings = DECODE_VARIANTS[variant] | mode
        if args.cache == "paged" and "decode_attention" in settings:
            settings = {k: v for k, v in settings.items() if k not in ("decode_attention", "decode_widths")}
        report = teacher_forced_check(model, prompts, forced, RolloutConfig(**settings))
        record["variants"][variant] = report | {"settings": settings}
        rows.append({"variant": variant, "cache": args.cache, "max_abs_error": report["max_abs_error"],
                     "top1_agreement": report["top1_agreement"], "num_decided": report["num_decided"],
                     "num_positions": report["num_positions"], "spans": report["stepper"]["spans"],
                     "compiled": report["stepper"]["compiled"], "kind": report["stepper"]["kind"]})
        print(f"{variant:16s} max |err| {report['max_abs_error']:.4g}  top-1 {report['top1_agreement']}",
              file=sys.stderr)
        csv_body = write_record(paths, record, rows)
    print(csv_body, end="")
    print(f"wrote {paths[0]} and {paths[1]}")


if __name__ == "__main__":
    main()
