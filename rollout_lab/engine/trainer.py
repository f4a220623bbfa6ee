"""The trainer's side of a rollout: the padded batch an RL trainer steps on, its teacher-forced
log-probabilities, and the GRPO losses over them (on-policy, and PPO's clipped surrogate with the
rollout's logprobs as the old policy's).

    t = result.to_tensors(device=device)      # padded_batch's layout, response_mask [rows, R]
    logprobs = sequence_logprobs(model, t["input_ids"], t["attention_mask"], t["response_mask"])  # [rows, R]
    loss = policy_gradient_loss(logprobs, group_advantages(rewards, num_samples=8), t["response_mask"])
    loss = clipped_policy_loss(logprobs, t["logprobs"], advantages, t["response_mask"], clip=0.2)  # several steps

The layout (``padded_batch``): prompts left-padded to the longest, P, responses right-padded after
them to the longest, R, so every response starts at column P. ``Rollout.generate(...,
return_logprobs=True, logprobs_mode="trainer")`` returns ``sequence_logprobs`` of exactly that batch
(``rollout_logprobs``), bit-identical to the trainer's own call on it (``t["logprobs"]`` equals
``logprobs`` above); ``examples/grpo_loop.py`` runs the whole loop.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from rollout_lab.engine.kernels.batch_invariant import batch_invariant as invariant_forward
from rollout_lab.engine.kernels.token_logprobs import row_logprobs
from rollout_lab.planner.checks import MAX_INT, as_int, check_int

# LM-head positions per chunk: [8192, 151936] logits are 2.5 GB in bf16, 5 GB in fp32 (fp32_head, and the
# backward's probabilities); the chunks are rows of the batch
HEAD_CHUNK_TOKENS = 8192
# config fields that make a model's logits something other than head(last hidden state)
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def padded_batch(
    prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], *, pad_token_id: int,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask, response_mask), each [rows, P + R] for the longest prompt P and
    response R: row i is ``prompts[i]`` left-padded to P, then ``responses[i]`` right-padded to R.
    ``attention_mask`` is 1 on every real token; ``response_mask`` (bool) on the response tokens."""
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses: give one prompt per row")
    pad_token_id = check_int(pad_token_id, name="pad_token_id", minimum=0)
    width_p = max((len(p) for p in prompts), default=0)
    width_r = max((len(r) for r in responses), default=0)
    ids = torch.full((len(prompts), width_p + width_r), pad_token_id, dtype=torch.long)  # [rows, P + R]
    mask = torch.zeros_like(ids)
    response_mask = torch.zeros_like(ids, dtype=torch.bool)
    for row, (prompt, response) in enumerate(zip(prompts, responses)):
        start, end = width_p - len(prompt), width_p + len(response)
        if end > start:
            ids[row, start:end] = _id_row(prompt, response, row)
        mask[row, start:end] = 1
        response_mask[row, width_p:end] = True
    if ids.numel() and int(ids.min()) < 0:  # on the CPU, before the copy to ``device``: no device sync
        _check_ids(prompts, "prompts")
        _check_ids(responses, "responses")
    return ids.to(device), mask.to(device), response_mask.to(device)


def _id_row(prompt: Sequence[int], response: Sequence[int], row: int) -> torch.Tensor:
    """[len(prompt) + len(response)] int64 of one row's ids. ``torch.tensor`` infers the dtype (one C
    pass over the row); only a row it refuses, infers as float or bool, or that holds a bool or a
    0-d tensor (inferred int64 among ints: ``[1, True]``, ``[1, torch.tensor(True)]``) is scanned id
    by id for the ValueError naming the bad one (``dtype=torch.long`` would truncate 2.5 to 2)."""
    ids = [*prompt, *response]
    try:
        tokens = torch.tensor(ids)
    except (TypeError, ValueError, RuntimeError, OverflowError):
        tokens = None
    kinds = set(map(type, ids))  # a C pass too: no Python bytecode per id
    if tokens is None or tokens.dtype != torch.long or bool in kinds or torch.Tensor in kinds:
        _check_ids([prompt], f"prompts[{row}]", single=True)
        _check_ids([response], f"responses[{row}]", single=True)
        if tokens is None or tokens.dtype != torch.long:  # 0-d int tensors alone are ids
            raise ValueError(f"row {row}: its ids must be ints >= 0, got {ids!r:.200}")
    return tokens


def _check_ids(rows: Sequence[Sequence[int]], name: str, *, single: bool = False) -> None:
    """ValueError naming the first id of ``rows`` that is not an int >= 0, and where it is."""
    for row, tokens in enumerate(rows):
        for column, token in enumerate(tokens):
            number = as_int(token)
            if number is None or not 0 <= number <= MAX_INT:
                where = f"{name}[{column}]" if single else f"{name}[{row}][{column}]"
                raise ValueError(f"{where} is {token!r}: a token id must be an int >= 0 (and < 2**63)")


def check_batch(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                response_mask: torch.Tensor, fp32_head: bool) -> None:
    """ValueError naming what is wrong with ``sequence_logprobs``'s arguments, before any forward."""
    if not callable(getattr(model, "get_decoder", None)) or not callable(getattr(model, "get_output_embeddings", None)) \
            or model.get_output_embeddings() is None:
        raise ValueError(f"sequence_logprobs needs a Hugging Face causal LM with get_decoder() and an LM head; "
                         f"got {type(model).__name__}")
    config = model.config.get_text_config(decoder=True)
    transformed = [f"{name}={getattr(config, name)!r}" for name in LOGIT_TRANSFORMS
                   if getattr(config, name, None) not in (None, 0, 1, 1.0)]
    if transformed:
        raise ValueError(f"{type(model).__name__} transforms its logits ({', '.join(transformed)}); "
                         "sequence_logprobs applies only the LM head")
    if not isinstance(fp32_head, bool):
        raise ValueError(f"fp32_head must be a bool, got {fp32_head!r}")
    for name, tensor in (("input_ids", input_ids), ("attention_mask", attention_mask),
                         ("response_mask", response_mask)):
        if not isinstance(tensor, torch.Tensor) or tensor.dim() != 2:
            raise ValueError(f"{name} must be a 2-D tensor [rows, width], got "
                             f"{tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__}")
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}, input_ids "
                         f"{tuple(input_ids.shape)}: they must match")
    if response_mask.shape[0] != input_ids.shape[0] or response_mask.shape[1] > input_ids.shape[1]:
        raise ValueError(f"response_mask has shape {tuple(response_mask.shape)}, input_ids {tuple(input_ids.shape)}: "
                         "it must be [rows, width], or [rows, R] for the last R columns")
    if input_ids.is_floating_point() or input_ids.dtype == torch.bool:
        raise ValueError(f"input_ids must be an integer tensor, got {input_ids.dtype}")
    if response_mask.dtype != torch.bool:
        raise ValueError(f"response_mask must be a bool tensor, got {response_mask.dtype}")
    vocab_size = min(model.get_input_embeddings().weight.shape[0], model.get_output_embeddings().weight.shape[0])
    check_ids_in_vocabulary(input_ids, vocab_size, name="input_ids")
    response_mask = full_width(response_mask, input_ids.shape[1])
    if input_ids.numel() and bool(response_mask[:, 0].any()):
        raise ValueError("response_mask is set in column 0: a response token needs a prompt token before it")
    if bool((response_mask & (attention_mask == 0)).any()):
        raise ValueError("response_mask is set where attention_mask is 0: response tokens must be attended to")


def check_ids_in_vocabulary(ids: torch.Tensor, vocab_size: int, *, name: str) -> None:
    """ValueError naming the smallest or largest of ``ids`` (an integer tensor) when it is outside
    [0, vocab_size): the embedding's IndexError, or the kernel's read past a row, otherwise.
    A trainer calls this every step on device tensors: reading the bounds is a host sync, so they
    come in one reduction (``aminmax``) and one ``.tolist()``."""
    if ids.numel() == 0:
        return
    low, high = torch.stack(torch.aminmax(ids)).tolist()
    if low < 0 or high >= vocab_size:
        raise ValueError(f"{name} holds token id {low if low < 0 else high}, outside the vocabulary "
                         f"[0, {vocab_size})")


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """[N] fp32 ``logits[i, targets[i]] - logsumexp(logits[i])`` of ``logits`` [N, vocab] (any float
    dtype, computed in fp32), differentiable in ``logits``.

    On CUDA one Triton program per row reads the row twice (its max, then its sum of exponentials)
    in the logits' own dtype: 4 bytes an entry for bf16, where ``.float()`` and ``torch.logsumexp``
    move ~32 (an fp32 copy, then the max, the shifted copy, its exponential and the sum). The head
    of a 512 x 256-token batch is 20 G entries. The kernel's result for a row depends only on that
    row, not on the rows beside it, so a trainer's call and the rollout's agree bit for bit on the
    same row and dtype. Elsewhere (CPU; ``TRITON_INTERPRET=1`` runs the kernel there) the same
    computation in torch.
    The backward is ``grad * (onehot(target) - softmax)``, from the saved logits and logsumexp."""
    if logits.dim() != 2 or targets.shape != logits.shape[:1]:
        raise ValueError(f"token_logprobs takes logits [N, vocab] and targets [N], got {tuple(logits.shape)} "
                         f"and {tuple(targets.shape)}")
    if targets.is_floating_point() or targets.is_complex() or targets.dtype == torch.bool:
        raise ValueError(f"targets must be an integer tensor, got {targets.dtype}")
    check_ids_in_vocabulary(targets, logits.shape[1], name="targets")
    return _TokenLogprobs.apply(logits, targets)


class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        out, lse = row_logprobs(logits, targets)
        ctx.save_for_backward(logits, targets, lse)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logits, targets, lse = ctx.saved_tensors
        probs = torch.exp(logits.float() - lse[:, None])  # [N, vocab]
        grad_logits = probs.mul_(-grad[:, None])
        grad_logits.scatter_add_(-1, targets[:, None], grad[:, None].float())
        return grad_logits.to(logits.dtype), None


def full_width(response_mask: torch.Tensor, width: int) -> torch.Tensor:
    """[rows, width]: a response mask of the last R columns (``RolloutResult.to_tensors()``'s) padded
    on the left with False; a full-width one as it is."""
    return F.pad(response_mask, (width - response_mask.shape[1], 0))


def sequence_logprobs(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, response_mask: torch.Tensor,
    *, fp32_head: bool = False, batch_invariant: bool = False,
) -> torch.Tensor:
    """fp32 log p(input_ids[t] | input_ids[:t]) at each ``response_mask`` column t, 0 elsewhere, by one
    teacher-forced forward of the whole batch; shaped as ``response_mask``: [rows, width], or [rows, R]
    for the last R columns (``RolloutResult.to_tensors()``'s). Differentiable: a trainer calls it
    under autograd for its loss, as the rollout calls it under ``no_grad``.

    Positions are each row's own (``cumsum(attention_mask) - 1``, as HF ``generate``), so padding on
    either side gives the unpadded sequence's values up to kernel rounding. The LM head runs on the
    response columns only, in chunks of rows (``HEAD_CHUNK_TOKENS``), in the model's dtype then a
    fp32 log-softmax (``token_logprobs``), or with ``fp32_head`` in fp32 throughout.

    Guarantee: two calls on the same tensors, in the same dtype, head precision and train/eval state,
    give the same bits. Another batch holding the same sequences (other rows beside them, another
    width, a micro-batch of it) runs other kernel shapes and in bf16 can differ by their rounding.
    With ``batch_invariant`` the forward runs inside ``engine.kernels.batch_invariant``: a row's
    values are the same bits in any batch, micro-batch or padding, and equal the logprobs of a
    ``RolloutConfig(batch_invariant=True)`` rollout's decode (``logprobs_mode="raw"``); the
    backward is autograd's usual one.
    """
    if not isinstance(batch_invariant, bool):
        raise ValueError(f"batch_invariant must be a bool, got {batch_invariant!r}")
    check_batch(model, input_ids, attention_mask, response_mask, fp32_head)
    if batch_invariant:
        with invariant_forward(model):
            return _sequence_logprobs(model, input_ids, attention_mask, response_mask, fp32_head, fp32_logits=True)
    return _sequence_logprobs(model, input_ids, attention_mask, response_mask, fp32_head)


def _sequence_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                       response_mask: torch.Tensor, fp32_head: bool, fp32_logits: bool = False) -> torch.Tensor:
    """``sequence_logprobs`` of checked arguments; ``fp32_logits``: the head's logits go to the row
    kernel as fp32, as the decode step's do (``processors.logprobs_of``): the kernel compiled for
    another input dtype lays a row out otherwise across its threads and sums it in another order."""
    rows, width = input_ids.shape
    num_columns = response_mask.shape[1]  # the result's width
    response_mask = full_width(response_mask, width)  # [rows, width]
    columns = response_mask.any(0).nonzero()[:, 0]  # host sync: the response columns bound the head
    out = torch.zeros(rows, width, dtype=torch.float32, device=input_ids.device)
    if columns.numel() == 0:
        return out[:, width - num_columns:]
    lo, hi = int(columns[0]), int(columns[-1]) + 1
    positions = (attention_mask.long().cumsum(1) - 1).clamp(min=0)  # [rows, width]
    hidden = model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions,
                                 use_cache=False).last_hidden_state  # [rows, width, hidden]
    hidden = hidden[:, lo - 1: hi - 1]  # [rows, span, hidden]: the position before each response column
    targets = input_ids[:, lo:hi]  # [rows, span]
    head = model.get_output_embeddings()
    weight, bias = head.weight, getattr(head, "bias", None)
    if fp32_head:
        weight, bias = weight.float(), None if bias is None else bias.float()
    step = max(1, HEAD_CHUNK_TOKENS // (hi - lo))
    pieces = []
    for start in range(0, rows, step):
        h = hidden[start: start + step]
        logits = F.linear(h.float() if fp32_head else h, weight, bias)  # [chunk, span, vocab]
        logits = logits.float() if fp32_logits else logits
        chunk = _TokenLogprobs.apply(logits.flatten(0, 1), targets[start: start + step].flatten())  # ids checked
        pieces.append(chunk.view(logits.shape[:2]))  # [chunk, span]
    full = F.pad(torch.cat(pieces), (lo, width - hi))  # [rows, width]
    return torch.where(response_mask, full, out)[:, width - num_columns:]


@contextmanager
def eval_mode(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """``model`` in eval mode inside the block; every module's own train/eval flag restored after."""
    flags = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield model
    finally:
        for module, training in flags:
            module.training = training


def rollout_logprobs(
    model: torch.nn.Module, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], *,
    pad_token_id: int, fp32_head: bool = False,
) -> list[list[float]]:
    """Per row, ``sequence_logprobs`` of its response tokens in ``padded_batch(prompts, responses)``,
    in eval mode under ``no_grad`` (the model's train/eval state is restored after), the mode
    ``Rollout.generate`` decodes in: what it returns for ``logprobs_mode`` "trainer" ("trainer_fp32":
    ``fp32_head``).

    Cost: one forward over prompt + response of every row, after the decode (~ the prefill's cost
    plus a forward over the generated tokens; the head only over the response columns)."""
    device = next(model.parameters()).device
    ids, mask, response_mask = padded_batch(prompts, responses, pad_token_id=pad_token_id, device=device)
    width_p = max((len(p) for p in prompts), default=0)
    with torch.no_grad(), eval_mode(model):  # [rows, R]: the mask of to_tensors(), as a trainer gives it
        logprobs = sequence_logprobs(model, ids, mask, response_mask[:, width_p:], fp32_head=fp32_head)
    return [row[: len(r)] for row, r in zip(logprobs.tolist(), responses)]


def _row_values(values: torch.Tensor | np.ndarray | Sequence[float], *, name: str) -> torch.Tensor:
    """[rows] ``values``, one real number per row (rewards, advantages), as a tensor: a tensor as it
    is (its device kept), a list, tuple or numpy array converted on the CPU; TypeError for any other
    type, ValueError unless 1-D and real."""
    if isinstance(values, (list, tuple, np.ndarray)):
        try:
            values = torch.as_tensor(np.asarray(values, dtype=np.float64) if not isinstance(values, np.ndarray)
                                     else values)
        except (TypeError, ValueError) as error:
            raise ValueError(f"{name} must hold one real number per row, got {values!r:.200}") from error
    elif not isinstance(values, torch.Tensor):
        raise TypeError(f"{name} must be a 1-D tensor, a numpy array or a list of numbers, "
                        f"got {type(values).__name__}")
    if values.dim() != 1 or values.is_complex():
        raise ValueError(f"{name} must be 1-D real numbers, one per row, got shape {tuple(values.shape)} "
                         f"of {values.dtype}")
    return values


def group_advantages(rewards: torch.Tensor | np.ndarray | Sequence[float], *, num_samples: int,
                     eps: float = 1e-6) -> torch.Tensor:
    """[rows] float32 GRPO advantages: each reward minus its group's mean, over the group's std (+ ``eps``);
    rows request-major (row = request * num_samples + sample), as ``Rollout.generate`` returns them.
    ``rewards``: a 1-D tensor (its device kept), a numpy array or a list of numbers."""
    num_samples = check_int(num_samples, name="num_samples")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 <= eps < float("inf"):
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
    rewards = _row_values(rewards, name="rewards")
    finite = torch.isfinite(rewards) if rewards.is_floating_point() else None
    if finite is not None and not bool(finite.all()):  # one NaN would make its whole group's advantages NaN
        row = int((~finite).nonzero()[0, 0])
        raise ValueError(f"rewards[{row}] is {rewards[row].item()}: every reward must be a finite number")
    if rewards.shape[0] % num_samples:
        raise ValueError(f"rewards has {rewards.shape[0]} rows, not a multiple of num_samples={num_samples}: "
                         "give every request's num_samples rewards, request-major")
    groups = rewards.float().view(-1, num_samples)  # [requests, samples]
    std = groups.std(dim=1, keepdim=True) if num_samples > 1 else torch.ones_like(groups[:, :1])
    return ((groups - groups.mean(dim=1, keepdim=True)) / (std + eps)).view(-1)


def policy_gradient_loss(logprobs: torch.Tensor, advantages: torch.Tensor | Sequence[float],
                         response_mask: torch.Tensor) -> torch.Tensor:
    """The on-policy GRPO loss: minus each row's advantage times its response tokens' log-probabilities,
    averaged over the response tokens. ``logprobs``, ``response_mask`` [rows, width] or [rows, R];
    ``advantages`` [rows] (a tensor, a numpy array or a list)."""
    advantages = _row_advantages(advantages, logprobs, response_mask)
    weighted = advantages[:, None].to(logprobs.dtype) * torch.where(response_mask, logprobs, 0.0)  # [rows, width]
    return -weighted.sum() / response_mask.sum().clamp(min=1)


def _row_advantages(advantages: torch.Tensor | Sequence[float], logprobs: torch.Tensor,
                    response_mask: torch.Tensor) -> torch.Tensor:
    """[rows] ``advantages`` as a tensor on ``logprobs``' device, one per row of ``logprobs``; a
    ValueError unless ``response_mask`` is a bool tensor of ``logprobs``' shape."""
    advantages = _row_values(advantages, name="advantages").to(logprobs.device)
    if logprobs.dim() != 2 or advantages.shape[0] != logprobs.shape[0]:
        raise ValueError(f"advantages has {advantages.shape[0]} rows, logprobs shape {tuple(logprobs.shape)}: "
                         "give one advantage per row of a 2-D [rows, width] logprobs")
    if not isinstance(response_mask, torch.Tensor) or response_mask.dtype != torch.bool \
            or response_mask.shape != logprobs.shape:
        raise ValueError(f"response_mask must be a bool tensor of logprobs' shape {tuple(logprobs.shape)}, got "
                         + (f"{response_mask.dtype} {tuple(response_mask.shape)}" if isinstance(response_mask, torch.Tensor)
                            else type(response_mask).__name__))
    return advantages


def clipped_policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor | Sequence[float],
                        response_mask: torch.Tensor, *, clip: float = 0.2) -> torch.Tensor:
    """PPO's clipped surrogate, as GRPO trainers run it over several steps per rollout: the ratio
    r = exp(logprobs - old_logprobs) of each response token, and minus min(r A, clip(r, 1 - clip,
    1 + clip) A) averaged over the response tokens. ``old_logprobs`` are the rollout's
    (``to_tensors()["logprobs"]``): with ``logprobs_mode="trainer"`` they equal the trainer's first
    forward bit for bit where that forward runs as the rollout did, in eval mode (or without
    dropout: a dropout mask in train mode changes it), so the first step's ratio is exactly 1 and its gradient is
    ``policy_gradient_loss``'s; with the decode step's own logprobs the ratio starts off by their
    bf16 gap (the importance weight that corrects it). Shapes as ``policy_gradient_loss``."""
    if isinstance(clip, bool) or not isinstance(clip, (int, float)) or not 0 < clip < 1:
        raise ValueError(f"clip must be a number in (0, 1), got {clip!r}")
    if logprobs.shape != old_logprobs.shape or logprobs.shape != response_mask.shape:
        raise ValueError(f"logprobs {tuple(logprobs.shape)}, old_logprobs {tuple(old_logprobs.shape)} and "
                         f"response_mask {tuple(response_mask.shape)} must have one shape")
    advantages = _row_advantages(advantages, logprobs, response_mask)
    old = old_logprobs.detach().to(logprobs.dtype)
    ratio = torch.exp(torch.where(response_mask, logprobs - old, 0.0))  # [rows, width]: 1 off the responses
    gain = advantages[:, None].to(logprobs.dtype)
    surrogate = torch.minimum(ratio * gain, ratio.clamp(1 - clip, 1 + clip) * gain)
    return -torch.where(response_mask, surrogate, 0.0).sum() / response_mask.sum().clamp(min=1)
