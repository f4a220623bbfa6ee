"""Each row's log-softmax at one token: the kernel under the trainer's ``token_logprobs`` and the
batch-invariant decode step's logprobs.

On CUDA one Triton program per row reads the row twice (its max, then its sum of exponentials) in
the logits' own dtype, BLOCK-wide strips in order: a row's result depends on that row alone, not on
the rows beside it or how many there are, so a trainer's call and a rollout's agree bit for bit on
the same row and dtype (``engine.kernels.batch_invariant`` routes ``logsumexp`` here for that
reason). Elsewhere (CPU; ``TRITON_INTERPRET=1`` runs the kernel there) the same computation in torch.

    out, lse = row_logprobs(logits, targets)   # [N] fp32 each

"""
from __future__ import annotations

import torch

from rollout_lab.engine.kernels.available import kernel_available, tl, triton

LOGPROB_BLOCK = 4096  # vocabulary entries a program reads per inner step

if triton is not None:

    @triton.jit
    def _row_logprob(Logits, Targets, Out, Lse, stride_row, vocab, BLOCK: tl.constexpr):
        """One row: its max, then its sum of exp(x - max), both in fp32 over BLOCK-wide strips in
        order; out = x[target] - (max + log(sum))."""
        row = tl.program_id(0)
        base = Logits + row.to(tl.int64) * stride_row
        cols = tl.arange(0, BLOCK)
        top = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
        for start in range(0, vocab, BLOCK):
            x = tl.load(base + start + cols, mask=start + cols < vocab, other=float("-inf")).to(tl.float32)
            top = tl.maximum(top, x)
        peak = tl.max(top, 0)
        total = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, vocab, BLOCK):
            x = tl.load(base + start + cols, mask=start + cols < vocab, other=float("-inf")).to(tl.float32)
            total += tl.exp(x - peak)
        lse = peak + tl.log(tl.sum(total, 0))
        target = tl.load(Targets + row)
        chosen = tl.load(base + target).to(tl.float32)
        tl.store(Out + row, chosen - lse)
        tl.store(Lse + row, lse)


def row_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen - lse, lse), each [N] fp32: ``logits[i, targets[i]] - logsumexp(logits[i])`` and the
    logsumexp of ``logits`` [N, vocab] (any float dtype, read as it is, computed in fp32)."""
    if not kernel_available(logits.device) or logits.shape[0] == 0:
        lse = torch.logsumexp(logits.float(), dim=-1)
        return logits.gather(-1, targets[:, None])[:, 0].float() - lse, lse
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.float32, device=logits.device)
    lse = torch.empty(rows, dtype=torch.float32, device=logits.device)
    _row_logprob[(rows,)](logits, targets, out, lse, logits.stride(0), vocab,
                          BLOCK=LOGPROB_BLOCK, num_warps=8)
    return out, lse
