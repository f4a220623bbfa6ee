"""A GRPO loop on ONE model object: rollout, rewards, group-normalised advantages, the policy-gradient
loss on the trainer's logprobs, an AdamW step; per iteration its rollout time, train time and peak memory.

    python examples/grpo_loop.py                                   # a tiny random model on the CPU, seconds
    python examples/grpo_loop.py --preset qwen2.5-0.5b --device cuda --num-prompts 64 --num-samples 8 \\
        --max-new-tokens 256 --train-rows 64                       # the issue's shape on a GPU (random weights)

There is no weight sync: the rollout decodes with the parameters the optimizer updates in place (its
captured graphs read the same storage). It returns ``logprobs_mode="trainer"`` logprobs, the trainer's
own forward (``engine.trainer.sequence_logprobs``) of the same padded batch, so they equal the trainer's
bit for bit when it runs that batch whole (``--train-rows`` micro-batches run other kernel shapes:
in bf16 their rounding can differ; ``rollout-lab bench trainer-loop`` measures it).
"""
from __future__ import annotations

import argparse
from typing import Sequence

import torch

from rollout_lab import Rollout, RolloutConfig
from rollout_lab.engine.profile import timed_ms
from rollout_lab.engine.trainer import group_advantages, policy_gradient_loss, sequence_logprobs
from rollout_lab.measure.models import load_model
from rollout_lab.measure.presets import PRESETS


def reward(response: Sequence[int], vocab_size: int) -> float:
    """The toy reward: the share of the response's tokens in the lower half of the vocabulary."""
    return sum(t < vocab_size // 2 for t in response) / max(1, len(response))


def train_step(model, optimizer, batch, advantages, *, train_rows: int) -> torch.Tensor:
    """One policy-gradient step over ``batch`` (``result.to_tensors()``: prompts left-padded, responses
    right-padded) in micro-batches of ``train_rows`` rows; the forward's logprobs [rows, R], detached."""
    ids, mask, response_mask = batch["input_ids"], batch["attention_mask"], batch["response_mask"]
    model.train()
    pieces = []
    for start in range(0, ids.shape[0], train_rows):
        rows = slice(start, start + train_rows)
        logprobs = sequence_logprobs(model, ids[rows], mask[rows], response_mask[rows])  # with autograd
        loss = policy_gradient_loss(logprobs, advantages[rows], response_mask[rows])
        (loss * response_mask[rows].sum() / response_mask.sum()).backward()  # the mean over every token
        pieces.append(logprobs.detach())
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    model.eval()
    return torch.cat(pieces)


def positive_int(text: str) -> int:
    """An argparse type: an int >= 1."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {text!r}")
    return int(text)


def main(argv: Sequence[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), help="a real architecture, random weights (default: tiny)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    parser.add_argument("--num-prompts", type=positive_int, default=4)
    parser.add_argument("--num-samples", type=positive_int, default=4)
    parser.add_argument("--max-new-tokens", type=positive_int, default=16)
    parser.add_argument("--train-rows", type=positive_int, default=None, help="rows per micro-batch (default: all)")
    parser.add_argument("--iterations", type=positive_int, default=3)
    parser.add_argument("--lr", type=float, default=1e-4)
    args = parser.parse_args(argv)

    model, name = load_model(args.preset or "tiny-qwen2", dtype="bfloat16" if args.preset else "float32",
                             device=args.device)
    vocab = model.get_input_embeddings().weight.shape[0]
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, vocab, (int(n),), generator=generator).tolist()
               for n in torch.randint(4, 32, (args.num_prompts,), generator=generator)]
    rollout = Rollout(model, RolloutConfig(ignore_eos=True, pad_token_id=0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    device = torch.device(args.device)
    print(f"{name} on {device}: {args.num_prompts} prompts x {args.num_samples} samples x {args.max_new_tokens} tokens")
    stats = []
    for iteration in range(args.iterations):
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        rollout_ms, result = timed_ms(lambda: rollout.generate(
            prompts, max_new_tokens=args.max_new_tokens, num_samples=args.num_samples, do_sample=True,
            temperature=1.0, seed=iteration, return_logprobs=True, logprobs_mode="trainer"), device)
        rewards = torch.tensor([reward(s, vocab) for s in result.sequences])
        advantages = group_advantages(rewards, num_samples=args.num_samples).to(device)
        batch = result.to_tensors(device=device)  # rows request-major, as the rewards
        train_ms, logprobs = timed_ms(lambda: train_step(model, optimizer, batch, advantages,
                                                         train_rows=args.train_rows or len(rewards)), device)
        mismatch = (logprobs - batch["logprobs"]).abs().max().item()
        peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
        stats.append({"iteration": iteration, "rollout_ms": rollout_ms, "train_ms": train_ms, "peak_gib": peak,
                      "mean_reward": float(rewards.mean()), "max_abs_logprob_diff": mismatch})
        print(f"iteration {iteration}: rollout {rollout_ms:8.1f} ms  train {train_ms:8.1f} ms  peak "
              f"{'-' if peak is None else f'{peak:.1f} GiB'}  reward {rewards.mean():.3f}  "
              f"max |rollout - trainer logprob| {mismatch:.1e}")
    rollout.close()
    return stats


if __name__ == "__main__":
    main()
