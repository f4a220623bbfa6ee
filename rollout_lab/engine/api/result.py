"""What a rollout gives back: ``RolloutResult`` (per request, a ``RequestOutput`` of
``SampleOutput``s) and its tensors for a policy-gradient loss (``to_tensors``)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rollout_lab.engine.api.loading import resolve_device
from rollout_lab.engine.profile import Profile
from rollout_lab.engine.sched.request import Continuation
from rollout_lab.engine.trainer import padded_batch
from rollout_lab.planner.bucket_dp import BucketPlan
from rollout_lab.planner.checks import check_int

@dataclass(frozen=True)
class SampleOutput:
    """One response of a request (vLLM's ``CompletionOutput``): a view of ``RolloutResult``'s rows."""

    token_ids: list[int]
    logprobs: list[float] | None  # with generate(return_logprobs=True)
    finish_reason: str  # "stop", "length", or "unfinished" (a call with finish_fraction returned first)
    text: str | None  # with a tokenizer
    # (call index, tokens) runs: which call made which of its tokens (RolloutResult.segments); not
    # compared: two outputs of the same tokens from different calls are equal
    segments: tuple[tuple[int, int], ...] = field(default=(), compare=False)
    env_mask: list[bool] | None = None  # with generate(env=...): True on the environment's tokens
    num_turns: int = 1  # the model's turns (an episode's: one more than the environment's answers)


@dataclass(frozen=True)
class RequestOutput:
    """One request (vLLM's ``RequestOutput``): its prompt's ids and its responses (its samples)."""

    prompt_token_ids: list[int]
    outputs: list[SampleOutput]


@dataclass(frozen=True)
class RolloutResult:
    """Per (request, sample), request-major, the generated ids up to and including the token that
    stopped the row (an EOS or stop id, or the one completing a stop string); in an episode
    (``generate(env=...)``) the model's and the environment's ids in order, up to the token that
    ended the episode (``env_masks`` tells them apart).

    ``sequences[r * num_samples + s]`` is sample s of request r (HF's ``num_return_sequences``
    order); where requests have their own sample counts (``SamplingParams.n``) ``samples`` holds
    them and the rows of request r follow those of the requests before it. ``grouped()`` gives one
    list of samples per request, ``requests`` one ``RequestOutput`` per request, ``to_tensors()``
    the padded tensors of a loss. ``seed`` is the seed sampling used
    (drawn from torch's global generator when none was given), None for greedy or when every
    sampled request brought its own (``SamplingParams.seed``).
    """

    sequences: list[list[int]]
    route: str
    plans: tuple[BucketPlan, ...]  # one per admission; buckets hold request indices
    profile: Profile | None
    num_samples: int = 1
    seed: int | None = None
    # per sequence: "stop" (an EOS id, a stop id or a stop string ended it), "length" (its budget) or
    # "unfinished" (generate's finish_fraction returned before it ended: it is in ``unfinished``)
    finish_reasons: list[str] = field(default_factory=list)
    # with generate(return_logprobs=True): per sequence, each token's log-probability
    logprobs: list[list[float]] | None = None
    # with a tokenizer: per sequence, its decoded text (special tokens skipped), cut before a stop string
    texts: list[str] | None = None
    prompt_token_ids: list[list[int]] = field(default_factory=list)  # per request, the ids prefilled
    pad_token_id: int = 0  # the call's pad id: to_tensors' padding unless it is given one
    samples: list[int] | None = None  # per request, its samples; None: num_samples each
    # per sequence, (call index, tokens) runs in order: which call of the Rollout (Rollout.num_calls)
    # made which of its tokens; a continued row's earlier calls first
    segments: list[tuple[tuple[int, int], ...]] = field(default_factory=list)
    # the rows generate(..., finish_fraction=f) returned before they ended, in row order: pass them
    # among a later call's prompts to continue them
    unfinished: list[Continuation] = field(default_factory=list)
    # with generate(env=...): per sequence, True on the environment's tokens, and its model turns
    env_masks: list[list[bool]] | None = None
    num_turns: list[int] | None = None

    def sample_counts(self) -> list[int]:
        """Per request, its samples (rows)."""
        if self.samples is not None:
            return list(self.samples)
        return [self.num_samples] * (len(self.sequences) // self.num_samples)

    def _row_ranges(self) -> list[range]:
        """Per request, its rows."""
        out, start = [], 0
        for count in self.sample_counts():
            out.append(range(start, start + count))
            start += count
        return out

    def grouped(self) -> list[list[list[int]]]:
        """Per request, its sequences (one per sample)."""
        return [[self.sequences[i] for i in rows] for rows in self._row_ranges()]

    @property
    def requests(self) -> list[RequestOutput]:
        """Per request, in input order, its prompt and its samples in sample order."""
        def sample(row: int) -> SampleOutput:
            return SampleOutput(self.sequences[row], None if self.logprobs is None else self.logprobs[row],
                                self.finish_reasons[row], None if self.texts is None else self.texts[row],
                                env_mask=None if self.env_masks is None else self.env_masks[row],
                                num_turns=1 if self.num_turns is None else self.num_turns[row],
                                segments=self.segments[row] if self.segments else ())

        return [RequestOutput(prompt, [sample(row) for row in rows])
                for prompt, rows in zip(self._prompts(), self._row_ranges())]

    def to_tensors(self, pad_token_id: int | None = None,
                   device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
        """Every row (request-major: ``request * num_samples + sample``) padded into the tensors of a policy-gradient
        loss, in ``engine.trainer.padded_batch``'s layout: with P the longest prompt and R the longest
        response, row i is its prompt left-padded to P, then its response right-padded to R.

        - ``input_ids`` [rows, P + R] int64 (``pad_token_id`` as padding; None: the call's pad id) and
          ``attention_mask`` [rows, P + R] int64, 1 on every prompt and response token;
        - ``prompt_ids`` [rows, P] and ``response_ids`` [rows, R]: its two blocks;
        - ``response_mask`` [rows, R] bool: True on generated tokens (the stopping token included);
        - ``loss_mask`` [rows, R] bool: True on the model's tokens: ``response_mask`` less an episode's
          environment tokens (``env_masks``);
        - ``logprobs`` [rows, R] fp32, 0 where ``response_mask`` is False (with ``return_logprobs=True``).

        A forward over ``input_ids`` predicts ``response_ids`` with its logits at columns
        ``P - 1 .. P + R - 2``; ``engine.trainer.sequence_logprobs`` runs it with each row's own positions.
        """
        pad = self.pad_token_id if pad_token_id is None else check_int(pad_token_id, name="pad_token_id", minimum=0)
        device = resolve_device("cpu" if device is None else device)  # torch's own error is a RuntimeError
        prompts = [prompt for prompt, count in zip(self._prompts(), self.sample_counts()) for _ in range(count)]
        ids, attention_mask, response_mask = padded_batch(prompts, self.sequences, pad_token_id=pad,
                                                          device=device)
        width = max(map(len, prompts), default=0)  # P
        out = {"input_ids": ids, "attention_mask": attention_mask, "prompt_ids": ids[:, :width].contiguous(),
               "response_ids": ids[:, width:].contiguous(), "response_mask": response_mask[:, width:].contiguous()}
        out["loss_mask"] = out["response_mask"].clone()
        for row, mask in enumerate(self.env_masks or ()):
            out["loss_mask"][row, : len(mask)] &= ~torch.tensor(mask, dtype=torch.bool, device=ids.device)
        if self.logprobs is not None:
            length = ids.shape[1] - width  # R
            out["logprobs"] = torch.tensor([list(lp) + [0.0] * (length - len(lp)) for lp in self.logprobs],
                                           dtype=torch.float32).reshape(len(prompts), length).to(ids.device)
        return out

    def _prompts(self) -> list[list[int]]:
        """``prompt_token_ids``, one per request (a result built without them has none to give)."""
        num_requests = len(self.sample_counts())
        if len(self.prompt_token_ids) != num_requests:
            raise ValueError(f"this result holds {len(self.prompt_token_ids)} prompt_token_ids for "
                             f"{num_requests} requests: build it with one prompt per request")
        return self.prompt_token_ids


# generate's own keywords a GenerationConfig may set, with their neutral values, and its fields that
