"""One row of a call and its whole state: ``Request``, what the schedulers admit, decode, preempt and
retire, and what the result is built from.

A ``generate`` call of R prompts with n_r samples each has sum(n_r) rows, request-major: the rows of
prompt r are its samples 0..n_r-1, one after the other. Each row is a ``Request``: its prompt, its
resolved ``SamplingParams`` (budget, minimum, penalties, filters), its sampling key, what stops it
(stop ids, stop strings) and, as it runs, its tokens and their log-probabilities.

    request = Request(index=3, request=1, sample=1, prompt=[5, 6, 7], params=SamplingParams(max_tokens=16))
    request.is_done    # its budget spent, or its last token one of its stop ids

A row that a call with ``finish_fraction`` returned before it finished comes back as a
``Continuation``: what a later call needs to make it a row again that goes on where it stopped.

"""
from __future__ import annotations

from dataclasses import dataclass, field

from rollout_lab.engine.sample.params import SamplingParams
from rollout_lab.engine.sample.stopping import StopStrings


@dataclass(eq=False)
class Request:
    """Sample ``sample`` of prompt ``request``: row ``index`` of its call (``module docstring``).

    ``params`` is resolved: ``max_tokens``, ``min_tokens`` and ``repetition_penalty`` are set (the
    call's values where the request left them None). ``num_generated`` counts the tokens the decode
    made for it and, in an episode (``sched.episodes``), the environment's tokens appended to it
    (``env_spans``: each answer's (start, stop) in ``tokens``): the positions past its prompt, whereas
    its budget counts the model's tokens only; ``tokens`` holds those read back so far (a burst read
    one burst late counts first)."""

    index: int
    request: int
    sample: int
    prompt: list[int]
    params: SamplingParams
    key: int = 0  # the sampling key (sampler.sample_key); 0 for a greedy row
    group: int = -1  # the first row with the same prompt (shared prefill); -1: its own index
    stop_ids: frozenset[int] = frozenset()  # EOS and the request's stop ids: any ends the row
    stop_strings: StopStrings | None = None
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    num_generated: int = 0
    env_spans: list[tuple[int, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.group < 0:
            self.group = self.index

    @property
    def max_tokens(self) -> int:
        return self.params.max_tokens

    @property
    def min_tokens(self) -> int:
        return self.params.min_tokens or 0

    @property
    def num_env_tokens(self) -> int:
        return sum(stop - start for start, stop in self.env_spans)

    @property
    def turn_tokens(self) -> list[int]:
        """Its tokens since the environment's last answer (all of them outside an episode)."""
        return self.tokens[self.env_spans[-1][1]:] if self.env_spans else self.tokens

    @property
    def remaining(self) -> int:
        """Decode steps left before its budget (the model's tokens)."""
        return self.max_tokens - self.num_generated + self.num_env_tokens

    @property
    def ends_with_env(self) -> bool:
        """Whether its last tokens are an environment's answer (the model's turn comes next)."""
        return bool(self.env_spans) and self.env_spans[-1][1] == len(self.tokens)

    @property
    def is_done(self) -> bool:
        """Its budget is spent or its last token read is one of its stop ids (stop strings are the
        scheduler's: they need the tokenizer, one batched decode for the live rows)."""
        if self.remaining <= 0:
            return True
        return bool(self.stop_ids) and bool(self.tokens) and self.tokens[-1] in self.stop_ids and not self.ends_with_env

    def append(self, token: int, logprob: float | None = None) -> None:
        """One token read back (and its log-probability), counted."""
        self.tokens.append(token)
        if logprob is not None:
            self.logprobs.append(logprob)
        self.num_generated += 1

    @property
    def finish_reason(self) -> str:
        """"stop" when its last token is one of its stop ids, else "length" (a stop string's
        "stop" is decided on its text, by the result)."""
        return "stop" if self.tokens and self.tokens[-1] in self.stop_ids else "length"


@dataclass(frozen=True)
class Continuation:
    """A row a call returned unfinished (``generate(..., finish_fraction=f)``): a later call takes it
    among its prompts and continues it (``Rollout.generate``).

    It keeps what makes its next tokens those it would have drawn uninterrupted: its resolved
    ``params`` (sampling, penalties, minimum), its sampling ``key`` (its step count is
    ``num_steps``), its stop ids and strings, and its tokens (with their log-probabilities when its
    call returned them, in ``logprobs_mode``). ``request`` and ``sample`` are its indices in the call
    that made it; ``segments`` are (call index, tokens) runs: which of its tokens each call made, in
    order (``Rollout.num_calls`` counts the calls). ``model_type`` and ``vocab_size`` name the model
    whose tokens these are: another model's continuation is refused."""

    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...] | None
    params: SamplingParams  # resolved (n=1: a continuation is one row); a later call sets max_tokens
    key: int
    request: int
    sample: int
    segments: tuple[tuple[int, int], ...]
    stop_ids: frozenset[int] = frozenset()
    stop_strings: StopStrings | None = None
    logprobs_mode: str | None = None  # processors.LOGPROB_MODES of its logprobs; None without them
    model_type: str = ""
    vocab_size: int = 0

    @property
    def num_steps(self) -> int:
        """The sampling steps it has taken: its tokens."""
        return len(self.token_ids)
