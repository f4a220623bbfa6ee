"""A tool-use GRPO loop: multi-turn episodes (``generate(env=...)``) with a toy calculator, the loss
on the model's tokens only (``to_tensors()["loss_mask"]``), on ONE model object.

    python examples/tool_grpo_loop.py                              # a tiny random model on the CPU, seconds
    python examples/tool_grpo_loop.py --preset qwen2.5-0.5b --device cuda --num-prompts 64 --num-samples 8 \\
        --max-new-tokens 256                                       # a GPU (random weights)

The protocol is token-level (token in, token out: nothing is re-tokenised): any of the ``CALL_IDS``
tokens is a calculator call, and the calculator answers with one result token, the sum of the two
tokens before the call (mod the result range). The episode goes on after the answer; EOS, the budget
or ``--max-turns`` end it. The toy reward is the share of answers the model copied as its next token.
The rollout's ``logprobs_mode="trainer"`` logprobs equal the trainer's forward on the model's tokens
(0.0 on the calculator's).
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

CALL_IDS = tuple(range(10, 42))  # a call token: a random tiny model makes one every dozen tokens or so
RESULT_START = 64  # results are tokens from here on


def calculator(vocab_size: int):
    """The environment: ``env(request, sample, tokens)`` answers a call with one result token."""
    def env(request: int, sample: int, tokens: list[int]) -> list[int]:
        a, b = [0, 0, *tokens[:-1]][-2:]  # the two tokens before the call (0 before the response)
        return [RESULT_START + (a + b) % (vocab_size - RESULT_START)]
    return env


def reward(tokens: Sequence[int], env_mask: Sequence[bool]) -> float:
    """The share of the calculator's answers the model copied as its next token (0 without a call)."""
    answers = [i for i, env in enumerate(env_mask) if env]
    return sum(i + 1 < len(tokens) and tokens[i + 1] == tokens[i] for i in answers) / max(1, len(answers))


def train_step(model, optimizer, batch, advantages) -> torch.Tensor:
    """One policy-gradient step over ``batch`` (``result.to_tensors()``), the loss over the model's
    tokens (``loss_mask``); the forward's logprobs [rows, R] on them, detached."""
    model.train()
    logprobs = sequence_logprobs(model, batch["input_ids"], batch["attention_mask"], batch["response_mask"])
    loss = policy_gradient_loss(logprobs, advantages, batch["loss_mask"])
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    model.eval()
    return torch.where(batch["loss_mask"], logprobs.detach(), 0.0)


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
    parser.add_argument("--max-new-tokens", type=positive_int, default=24)
    parser.add_argument("--max-turns", type=positive_int, default=4)
    parser.add_argument("--iterations", type=positive_int, default=3)
    parser.add_argument("--lr", type=float, default=1e-4)
    args = parser.parse_args(argv)

    model, name = load_model(args.preset or "tiny-qwen2", dtype="bfloat16" if args.preset else "float32",
                             device=args.device)
    vocab = model.get_input_embeddings().weight.shape[0]
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(RESULT_START, vocab, (int(n),), generator=generator).tolist()
               for n in torch.randint(4, 32, (args.num_prompts,), generator=generator)]
    rollout = Rollout(model, RolloutConfig(mode="paged", ignore_eos=True, pad_token_id=0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    device = torch.device(args.device)
    env = calculator(vocab)
    print(f"{name} on {device}: {args.num_prompts} prompts x {args.num_samples} samples, episodes of up to "
          f"{args.max_turns} turns and {args.max_new_tokens} model tokens")
    stats = []
    for iteration in range(args.iterations):
        rollout_ms, result = timed_ms(lambda: rollout.generate(
            prompts, max_new_tokens=args.max_new_tokens, num_samples=args.num_samples, do_sample=True,
            temperature=1.0, seed=iteration, stop_token_ids=list(CALL_IDS), env=env, max_turns=args.max_turns,
            return_logprobs=True, logprobs_mode="trainer"), device)
        rewards = torch.tensor([reward(s, m) for s, m in zip(result.sequences, result.env_masks)])
        advantages = group_advantages(rewards, num_samples=args.num_samples).to(device)
        batch = result.to_tensors(device=device)
        train_ms, logprobs = timed_ms(lambda: train_step(model, optimizer, batch, advantages), device)
        mismatch = (logprobs - batch["logprobs"]).abs().max().item()
        turns = sum(result.num_turns) / len(result.num_turns)
        env_share = float((batch["response_mask"] & ~batch["loss_mask"]).sum() / batch["response_mask"].sum())
        stats.append({"iteration": iteration, "rollout_ms": rollout_ms, "train_ms": train_ms,
                      "mean_reward": float(rewards.mean()), "mean_turns": turns, "env_token_share": env_share,
                      "max_abs_logprob_diff": mismatch})
        print(f"iteration {iteration}: rollout {rollout_ms:8.1f} ms  train {train_ms:8.1f} ms  turns {turns:.2f}  "
              f"env tokens {env_share:.1%}  reward {rewards.mean():.3f}  max |rollout - trainer logprob| {mismatch:.1e}")
    rollout.close()
    return stats


if __name__ == "__main__":
    main()
