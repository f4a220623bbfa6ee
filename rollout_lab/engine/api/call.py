"""One call's arguments, checked once: prompts in every form a caller may give them, a
``GenerationConfig``'s settings, sampling, minimums and stop rules. Every check here runs before any
model work and names the bad value."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from rollout_lab.engine.limits import check_call_rows
from rollout_lab.engine.sample.params import MAX_SAMPLES, SamplingParams, check_seed
from rollout_lab.engine.sample.processors import STEP_LOGPROB_MODES
from rollout_lab.engine.sample.sampler import sample_key
from rollout_lab.engine.sample.stopping import StopStrings
from rollout_lab.engine.sched.request import Continuation, Request
from rollout_lab.planner.checks import as_int, budgets_of, check_context, ints_per_request, is_int
from rollout_lab.planner.routes import prompt_groups

# generate's own keywords a GenerationConfig may set, with their neutral values, and its fields that
# go to the RolloutConfig for the call; what else a GenerationConfig may carry without effect here
CALL_DEFAULTS = {"max_new_tokens": None, "min_new_tokens": 0, "num_samples": 1, "do_sample": False,
                 "temperature": 1.0, "top_k": 0, "top_p": 1.0}
CONFIG_FIELDS = ("repetition_penalty", "eos_token_id", "pad_token_id")
HARMLESS_FIELDS = {"transformers_version", "bos_token_id", "decoder_start_token_id", "use_cache",
                   "_from_model_config", "max_length"}
# HF's global defaults of the sampling fields (GenerationConfig._get_default_generation_params): a
# GenerationConfig that samples without setting them samples with these, top-k 50 included
HF_SAMPLING_DEFAULTS = {"temperature": 1.0, "top_k": 50, "top_p": 1.0}


def from_generation_config(generation_config: Any, call: Mapping[str, Any]) -> tuple[dict, dict]:
    """(generate's keywords, RolloutConfig overrides) from a ``transformers.GenerationConfig``.

    Read: max_new_tokens, min_new_tokens, do_sample, temperature, top_k, top_p, num_return_sequences (as
    ``num_samples``), repetition_penalty and the EOS/PAD ids. A keyword that the call also set
    away from its default is an error, and so is any other setting (beams, ``no_repeat_ngram_size``,
    stop strings, ...): never silently ignored. ``max_length`` counts only beside ``max_new_tokens``.
    As in HF, a call that samples takes the temperature, top_k and top_p the config leaves unset
    from HF's defaults (``HF_SAMPLING_DEFAULTS``: top-k 50) unless the call itself sets them;
    to sample without top-k, set ``top_k=0`` in the config.
    """
    if not callable(getattr(generation_config, "to_diff_dict", None)):
        raise ValueError(f"generation_config must be a transformers.GenerationConfig, got {generation_config!r}")
    given = {k: v for k, v in generation_config.to_diff_dict().items() if v is not None}
    given = {("num_samples" if k == "num_return_sequences" else k): v for k, v in given.items()}
    neutral = _neutral_values(generation_config)
    unsupported = sorted(k for k in given if k not in CALL_DEFAULTS and k not in CONFIG_FIELDS
                         and k not in HARMLESS_FIELDS and not _is_neutral(given[k], neutral.get(k)))
    if unsupported:
        raise ValueError(f"generation_config sets {', '.join(f'{k}={given[k]!r}' for k in unsupported)}, "
                         f"which rollout_lab does not support; supported: {', '.join([*CALL_DEFAULTS, *CONFIG_FIELDS])}")
    if "max_length" in given and "max_new_tokens" not in given and call.get("max_new_tokens") is None:
        raise ValueError(f"generation_config sets max_length={given['max_length']!r}: give max_new_tokens instead")
    keywords = dict(call)
    for name, default in CALL_DEFAULTS.items():
        if name not in given:
            continue
        if not _is_number(call.get(name, default), default) and not _is_number(call[name], given[name]):
            raise ValueError(f"{name} is set twice: {call[name]!r} in the call and {given[name]!r} in generation_config")
        keywords[name] = given[name]
    if keywords.get("do_sample") is True:
        for name, value in HF_SAMPLING_DEFAULTS.items():
            if name not in given and _is_number(call.get(name, CALL_DEFAULTS[name]), CALL_DEFAULTS[name]):
                keywords[name] = value
    return keywords, {k: given[k] for k in CONFIG_FIELDS if k in given}


def _neutral_values(generation_config: Any) -> dict[str, Any]:
    """The values a GenerationConfig's fields hold when nothing is asked of them: an empty config's
    (all None in transformers 5), overlaid with the defaults HF ``generate`` applies to the unset
    ones (``_get_default_generation_params``: ``num_beams=1``, ``no_repeat_ngram_size=0``, ...)."""
    neutral = type(generation_config)().to_dict()
    defaults = getattr(type(generation_config), "_get_default_generation_params", None)
    return neutral | (defaults() if callable(defaults) else {})


def _is_neutral(value: Any, neutral: Any) -> bool:
    """Whether a field's ``value`` asks nothing of generate: its neutral value, or False where that is
    None (an unset flag is off). ``to_diff_dict`` lists every value unlike an empty config's, so a
    model's own ``generation_config`` and ``GenerationConfig.from_model_config`` carry
    ``output_attentions=False`` and ``output_hidden_states=False`` from the model config."""
    if neutral is None:
        return value is None or value is False
    return isinstance(value, bool) == isinstance(neutral, bool) and value == neutral


def sampling_params(do_sample, temperature, top_k, top_p, seed, sampling=None, *,
                    num_requests: int) -> list[SamplingParams] | None:
    """Each request's own ``SamplingParams`` (``sampling``, or the call-wide sampling settings for
    every request), or None when the call gives none (every request greedy).

    Call-wide: ``do_sample`` with ``temperature``, ``top_k`` and ``top_p``; setting them without
    ``do_sample=True`` is an error, except ``temperature=0``: as vLLM, it is greedy with or without
    ``do_sample`` (top_k, top_p and seed are still checked, then have nothing to filter or key). Per request: ``sampling``, a list of one
    ``SamplingParams`` per request (temperature 0: a greedy request), which the call-wide
    arguments must then leave at their defaults; ``seed`` keys the requests without their own.

    They are Python numbers, as ``SamplingParams`` takes them: a numpy or tensor scalar is refused
    by name (the seed is used as given, and a numpy int overflows the 64-bit key arithmetic)."""
    if not isinstance(do_sample, bool):
        raise ValueError(f"do_sample must be a bool, got {do_sample!r}")
    check_seed(seed)
    given = {name: value for name, value, default in (
        ("do_sample", do_sample, False), ("temperature", temperature, 1.0), ("top_k", top_k, 0),
        ("top_p", top_p, 1.0)) if not _is_number(value, default)}
    if sampling is not None:
        if given:
            raise ValueError(f"sampling=[...] sets each request's temperature, top_k and top_p: leave "
                             f"{', '.join(f'{k}={v!r}' for k, v in given.items())} at the default "
                             "(seed= still keys the requests without a seed of their own)")
        if isinstance(sampling, SamplingParams) or isinstance(sampling, (str, bytes)) \
                or not isinstance(sampling, Sequence):
            raise ValueError(f"sampling must be a list of SamplingParams, one per request, got {sampling!r}; "
                             "for one setting of every request use do_sample, temperature, top_k and top_p")
        if len(sampling) != num_requests:
            raise ValueError(f"sampling has {len(sampling)} SamplingParams for {num_requests} requests: "
                             "give one per request")
        for index, params in enumerate(sampling):
            if not isinstance(params, SamplingParams):
                raise ValueError(f"sampling[{index}] must be a SamplingParams "
                                 f"(rollout_lab.SamplingParams), got {params!r}")
        return list(sampling)
    if not do_sample and _is_number(temperature, 0.0):
        do_sample = True  # vLLM's greedy: SamplingParams(temperature=0) checks top_k and top_p, draws nothing
    if not do_sample:
        given.pop("do_sample", None)
        if seed is not None:
            given["seed"] = seed
        if given:
            raise ValueError(
                f"{', '.join(f'{k}={v!r}' for k, v in given.items())} only apply to sampling: "
                "pass do_sample=True (greedy is the default)")
        return None
    return [SamplingParams(temperature, top_k, top_p)] * num_requests  # their checks; temperature 0 is greedy


def stop_conditions(stop: Any, stop_token_ids: Any, *, tokenizer: Any,
                    vocab_size: int) -> tuple[StopStrings | None, tuple[int, ...]]:
    """A call's (stop strings, stop ids), checked. ``stop``: None or a list of non-empty strings,
    which need the Rollout's tokenizer to decode rows; ``stop_token_ids``: None or a list of ids in
    the vocabulary, which end a row as EOS does."""
    strings = None
    if stop is not None:
        if isinstance(stop, (str, bytes)) or not isinstance(stop, Sequence) or \
                not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop must be a list of non-empty strings or None, got {stop!r}")
        if stop and tokenizer is None:
            raise ValueError(f"stop={list(stop)!r} needs a tokenizer to decode rows: "
                             "Rollout(model, config, tokenizer=tokenizer), or give stop_token_ids")
        strings = StopStrings(tuple(stop), tokenizer) if stop else None
    if stop_token_ids is None:
        return strings, ()
    if isinstance(stop_token_ids, (str, bytes)) or not isinstance(stop_token_ids, Sequence):
        raise ValueError(f"stop_token_ids must be a list of token ids or None, got {stop_token_ids!r}")
    ids = tuple(as_int(t) for t in stop_token_ids)
    for token, number in zip(stop_token_ids, ids):
        if number is None or not 0 <= number < vocab_size:
            raise ValueError(f"stop_token_ids must hold ids in the vocabulary [0, {vocab_size}), "
                             f"got {token!r} in {stop_token_ids!r}")
    return strings, ids


def _is_number(value: Any, number: Any) -> bool:
    """``value`` is ``number`` (None: is None), compared only as a Python number: an array's ``==``
    is elementwise, a tensor's is a tensor, and either in an ``if`` is an error."""
    if number is None or isinstance(number, bool) or isinstance(value, bool):
        return value is number
    integer = as_int(value)  # a numpy int equals its int
    if integer is not None:
        return integer == number
    return isinstance(value, float) and value == number


def encode_texts(tokenizer: Any, prompts: Any, *, apply_chat_template: bool) -> Any:
    """Token ids for text prompts: strings (``tokenizer(texts)``), or with ``apply_chat_template``
    conversations (lists of ``{"role", "content"}`` messages, with the generation prompt added).
    Anything that is not text is returned as it came, for ``prompt_lists``."""
    is_texts = isinstance(prompts, Sequence) and not isinstance(prompts, (str, bytes)) and len(prompts) > 0 \
        and all(isinstance(p, str) for p in prompts)
    if not apply_chat_template and not is_texts:
        if isinstance(prompts, str):
            raise ValueError("prompts is one string: pass a list of strings (one per request)")
        return prompts
    if tokenizer is None:
        raise ValueError("text prompts need a tokenizer: Rollout(model, config, tokenizer=tokenizer)")
    if not apply_chat_template:
        return [list(ids) for ids in tokenizer(list(prompts))["input_ids"]]
    if not isinstance(prompts, Sequence) or not all(
            isinstance(c, Sequence) and all(isinstance(m, Mapping) and "content" in m for m in c) for c in prompts):
        raise ValueError("apply_chat_template=True takes a list of conversations, each a list of "
                         "{'role': ..., 'content': ...} messages")
    out = []
    for conversation in prompts:
        ids = tokenizer.apply_chat_template(list(conversation), add_generation_prompt=True, tokenize=True)
        out.append(list(ids["input_ids"] if isinstance(ids, Mapping) else ids))
    return out


def prompt_lists(prompts, attention_mask=None, *, pad_token_id: int | None = None,
                 eos_token_ids: Sequence[int] = ()) -> list[list[int]]:
    """Token-id lists from what a caller may give; every error names the request.

    - a list of id lists (tensors and numpy ints accepted);
    - a 2-D integer ``input_ids`` tensor, or a list of equal-length id lists, with its
      ``attention_mask`` padded on either side (each row's ones must be contiguous);
    - a tokenizer's ``BatchEncoding`` or a dict with ``input_ids`` (and ``attention_mask``);
    - a 2-D tensor without a mask: as HF ``generate``, the mask is inferred from ``pad_token_id``
      when the tensor holds it; where the pad id is also an EOS id that is ambiguous, an error.
    """
    if isinstance(prompts, Mapping):  # BatchEncoding is a Mapping
        if "input_ids" not in prompts:
            raise ValueError(f"a dict of inputs needs 'input_ids', got keys {sorted(prompts)}")
        if attention_mask is not None and prompts.get("attention_mask") is not None:
            raise ValueError("attention_mask is given twice: in the dict and as an argument")
        attention_mask = prompts.get("attention_mask") if attention_mask is None else attention_mask
        prompts = prompts["input_ids"]
    _check_has_data(attention_mask, "attention_mask")
    if isinstance(prompts, torch.Tensor):
        _check_has_data(prompts, "input_ids")
        if prompts.dtype == torch.bool or prompts.is_floating_point() or prompts.is_complex():
            raise ValueError(f"input_ids must be an integer tensor, got {prompts.dtype}")
        if prompts.dim() != 2:
            raise ValueError(f"input_ids must be 2-D [batch, width], got shape {tuple(prompts.shape)}")
        if attention_mask is None and pad_token_id is not None and bool((prompts == pad_token_id).any()):
            if pad_token_id in eos_token_ids:
                raise ValueError(
                    f"input_ids holds the pad id {pad_token_id}, which is also an EOS id: padding cannot "
                    "be told from tokens; pass attention_mask")
            attention_mask = prompts != pad_token_id  # HF's inference
    if attention_mask is not None:
        return _unpadded(prompts, attention_mask)
    if isinstance(prompts, torch.Tensor):
        return [list(map(int, row)) for row in prompts.tolist()]
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise ValueError(f"prompts must be a list of token-id lists or a tensor, got {type(prompts).__name__}")
    out = []
    for index, prompt in enumerate(prompts):
        if isinstance(prompt, torch.Tensor):
            _check_has_data(prompt, f"request {index}: the prompt")
            prompt = prompt.tolist()
        if isinstance(prompt, (str, bytes)) or not isinstance(prompt, Sequence):
            raise ValueError(f"request {index}: a prompt must be a list of token ids, got {prompt!r}")
        ids = [as_int(t) for t in prompt]
        if None in ids:
            raise ValueError(f"request {index}: token ids must be ints, got {list(prompt)[:8]!r}")
        out.append(ids)
    return out


def _check_has_data(value: Any, what: str) -> None:
    """ValueError when ``value`` is a tensor on the meta device: it has a shape but no values to read."""
    if isinstance(value, torch.Tensor) and value.is_meta:
        raise ValueError(f"{what} is on the meta device (a tensor without values, shape "
                         f"{tuple(value.shape)}): give it on the CPU or the model's device")


def _unpadded(input_ids, attention_mask) -> list[list[int]]:
    """Each row's ids under its mask's ones, which must be one contiguous run (left or right padding)."""
    ids_rows = input_ids.tolist() if isinstance(input_ids, torch.Tensor) else [list(r) for r in input_ids]
    if isinstance(attention_mask, torch.Tensor):
        if attention_mask.is_floating_point():
            raise ValueError(f"attention_mask must hold 0 and 1 as ints or bools, got {attention_mask.dtype}")
        mask_rows = attention_mask.tolist()
    else:
        mask_rows = [list(r) for r in attention_mask]
    if len(mask_rows) != len(ids_rows) or any(len(m) != len(i) for m, i in zip(mask_rows, ids_rows)):
        raise ValueError("attention_mask must have the shape of input_ids")
    out = []
    for index, (ids, row) in enumerate(zip(ids_rows, mask_rows)):
        if any(v not in (0, 1) for v in row):
            raise ValueError(f"request {index}: attention_mask holds values other than 0 and 1")
        ones = [j for j, v in enumerate(row) if v]
        if ones and ones[-1] - ones[0] + 1 != len(ones):
            raise ValueError(f"request {index}: attention_mask has a hole; padding must be on the left or right")
        prompt = [as_int(t) for t in ids[ones[0]: ones[-1] + 1]] if ones else []
        if None in prompt:
            raise ValueError(f"request {index}: token ids must be ints, got {ids[:8]!r}")
        out.append(prompt)
    return out


@dataclass(frozen=True)
class CallSpec:
    """One ``generate`` call, checked once (``check_call``) before any model work: its prompts, each
    request's resolved ``SamplingParams`` (every None field set from the call's arguments), the seed
    that keys the requests without their own, the pad id and each request's stop ids and strings.
    ``requests()`` makes its rows."""

    prompts: list[list[int]]  # per request, the ids prefilled
    params: list[SamplingParams]  # per request; n, max_tokens, min_tokens, repetition_penalty set
    seed: int | None  # None: no request draws with the call's seed
    pad_token_id: int
    stop_ids: list[frozenset[int]]  # per request: EOS and its stop ids
    stop_strings: list[StopStrings | None]  # per request
    logprobs_mode: str | None = None  # LOGPROB_MODES, or None without return_logprobs
    profile: bool = False
    share_prefill: bool = True
    # per request, the Continuation it continues (None: a new prompt); None: the call continues none
    continuations: tuple[Continuation | None, ...] | None = None
    finish_fraction: float | None = None  # the call returns once this share of its rows finished

    @property
    def samples(self) -> list[int]:
        """Samples per request (``SamplingParams.n``)."""
        return [p.n for p in self.params]

    @property
    def num_samples(self) -> int | None:
        """The samples of every request when they all have as many, else None."""
        counts = set(self.samples)
        return counts.pop() if len(counts) == 1 else None

    def requests(self) -> list[Request]:
        """The call's rows, request-major: sample s of request r, keyed for sampling by the call's
        seed and its indices, or by its own seed as request 0 of a call with that seed. A
        continuation is one row that goes on from its tokens, with its own key and stop rules."""
        continuations = self.continuations or (None,) * len(self.prompts)
        # a continued row resumes with its tokens: it shares no prefill with a new prompt's rows
        grouped = [prompt if c is None or not c.token_ids else (-1 - r,)
                   for r, (prompt, c) in enumerate(zip(self.prompts, continuations))]
        groups = prompt_groups(grouped, num_samples=self.samples, share=self.share_prefill)
        rows = []
        for r, (prompt, params, continued) in enumerate(zip(self.prompts, self.params, continuations)):
            if continued is not None:
                logprobs = list(continued.logprobs or ()) if self.logprobs_mode in STEP_LOGPROB_MODES else []
                rows.append(Request(len(rows), r, 0, prompt, params, key=continued.key, group=groups[len(rows)],
                                    stop_ids=continued.stop_ids, stop_strings=continued.stop_strings,
                                    tokens=list(continued.token_ids), logprobs=logprobs,
                                    num_generated=continued.num_steps))
                continue
            for s in range(params.n):
                key = 0 if params.is_greedy else \
                    sample_key(self.seed, r, s) if params.seed is None else sample_key(params.seed, 0, s)
                rows.append(Request(len(rows), r, s, prompt, params, key=key, group=groups[len(rows)],
                                    stop_ids=self.stop_ids[r], stop_strings=self.stop_strings[r]))
        return rows


def check_call(prompts: Any, *, attention_mask: Any = None, max_new_tokens: Any, min_new_tokens: Any = 0,
               num_samples: Any = 1, do_sample: Any = False, temperature: Any = 1.0, top_k: Any = 0,
               top_p: Any = 1.0, seed: Any = None, sampling: Any = None, stop: Any = None,
               stop_token_ids: Any = None, num_beams: Any = 1, num_return_sequences: Any = 1,
               logprobs_mode: str | None = None, profile: bool = False, repetition_penalty: float = 1.0,
               eos_token_ids: Sequence[int], pad_token_id: int, vocab_size: int, max_positions: int | None,
               tokenizer: Any = None, share_prefill: bool = True, finish_fraction: Any = None,
               model_type: str = "") -> CallSpec:
    """Every check of a call, before any forward, into one ``CallSpec``.

    The call-wide arguments (``max_new_tokens``: one budget or one per request, ``min_new_tokens``
    likewise, ``num_samples``, ``stop``, ``stop_token_ids``, ``repetition_penalty``, and
    ``do_sample`` with ``temperature``/``top_k``/``top_p``) set each request's ``SamplingParams``;
    with ``sampling=[...]`` (one per request) a request's own fields win and its None fields take the
    call's. ``eos_token_ids`` end every row, as its stop ids do.

    A ``Continuation`` among the prompts (``continuations``) keeps its own sampling settings and
    stop rules and is one row, whatever ``num_samples``; the call gives it only its budget, which
    counts the tokens it has (``max_new_tokens``, or a ``sampling`` entry that sets max_tokens alone).
    ``model_type`` (the model's config) and ``vocab_size`` must be the continuation's."""
    finish_fraction = check_finish_fraction(finish_fraction)
    if as_int(num_beams) != 1:
        raise ValueError(f"num_beams={num_beams!r} is not supported (1): no beam search")
    if as_int(num_return_sequences) != 1:
        raise ValueError(f"num_return_sequences={num_return_sequences!r} is not supported: use num_samples")
    if not is_int(num_samples) or not 1 <= num_samples <= MAX_SAMPLES:
        raise ValueError(f"num_samples must be an int in [1, {MAX_SAMPLES}], got {num_samples!r}")
    for name, ids in (("eos_token_id", eos_token_ids), ("pad_token_id", (pad_token_id,))):
        for token in ids:
            if token >= vocab_size:
                raise ValueError(f"{name} {token} is outside the vocabulary [0, {vocab_size})")
    call_strings, call_ids = stop_conditions(stop, stop_token_ids, tokenizer=tokenizer, vocab_size=vocab_size)
    prompts, continuations = split_continuations(prompts, attention_mask)
    prompts = prompt_lists(prompts, attention_mask, pad_token_id=pad_token_id, eos_token_ids=eos_token_ids)
    own = sampling_params(do_sample, temperature, top_k, top_p, seed, sampling, num_requests=len(prompts))
    continued = continuations or (None,) * len(prompts)
    # each request's n (its own, else the call's; a continuation's 1): before its SamplingParams and its rows are built
    check_call_rows([1 if c is not None else num_samples if mine is None or mine.n is None else mine.n
                     for c, mine in zip(continued, own or [None] * len(prompts))])
    if max_new_tokens is None and not (own is not None and sampling is not None and prompts
                                       and all(p.max_tokens is not None for p in own)):
        raise ValueError("max_new_tokens is required (as a keyword, in generation_config, or as every "
                         "request's SamplingParams.max_tokens)")
    budgets = [None] * len(prompts) if max_new_tokens is None else budgets_of(max_new_tokens, len(prompts))
    minimums = ints_per_request(min_new_tokens, len(prompts), name="min_new_tokens", minimum=0, what="minimums")
    params, stop_ids, stop_strings = [], [], []
    for index, (prompt, mine) in enumerate(zip(prompts, own or [SamplingParams(temperature=0.0)] * len(prompts))):
        if continued[index] is not None:
            resolved = _continued_params(continued[index], mine if sampling is not None else None, budgets[index],
                                         index=index, vocab_size=vocab_size, model_type=model_type,
                                         logprobs_mode=logprobs_mode)
            _check_prompt(prompt, resolved.max_tokens, index=index, vocab_size=vocab_size, max_positions=max_positions)
            params.append(resolved)
            stop_ids.append(continued[index].stop_ids)
            stop_strings.append(continued[index].stop_strings)
            continue
        filled = {"n": num_samples, "max_tokens": budgets[index], "min_tokens": minimums[index],
                  "repetition_penalty": float(repetition_penalty)}
        if (mine.min_tokens if mine.min_tokens is not None else minimums[index]) > \
                (mine.max_tokens if mine.max_tokens is not None else budgets[index]):
            raise ValueError(f"min_new_tokens={mine.min_tokens or minimums[index]} of request {index} exceeds its "
                             f"max_new_tokens={mine.max_tokens or budgets[index]}")
        resolved = dataclasses.replace(mine, **{k: v for k, v in filled.items() if getattr(mine, k) is None})
        _check_prompt(prompt, resolved.max_tokens, index=index, vocab_size=vocab_size, max_positions=max_positions)
        strings, ids = call_strings, call_ids
        if mine.stop is not None or mine.stop_token_ids is not None:
            own_strings, own_ids = stop_conditions(mine.stop, mine.stop_token_ids, tokenizer=tokenizer,
                                                   vocab_size=vocab_size)
            strings = own_strings if mine.stop is not None else strings
            ids = own_ids if mine.stop_token_ids is not None else ids
        params.append(resolved)
        stop_ids.append(frozenset((*eos_token_ids, *ids)))
        stop_strings.append(strings)
    if all(p.is_greedy or p.seed is not None for p, c in zip(params, continued) if c is None):
        seed = None  # greedy (temperature=0 among it) draws nothing; own seeds key their requests
    elif seed is None:
        seed = int(torch.randint(0, 2**63 - 1, ()).item())  # torch.manual_seed reproduces it
    return CallSpec(prompts, params, seed, pad_token_id, stop_ids, stop_strings, logprobs_mode=logprobs_mode,
                    profile=profile, share_prefill=share_prefill, continuations=continuations,
                    finish_fraction=finish_fraction)


def check_finish_fraction(value: Any) -> float | None:
    """``generate``'s ``finish_fraction``: None (off) or a number in (0, 1]."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ValueError(f"finish_fraction must be a number in (0, 1] (the share of the call's rows that finish "
                         f"before it returns; 1 waits for all) or None (off), got {value!r}")
    return float(value)


def split_continuations(prompts: Any, attention_mask: Any) -> tuple[Any, tuple[Continuation | None, ...] | None]:
    """(the prompts with each ``Continuation`` replaced by its prompt's ids, per request its
    continuation or None); (``prompts``, None) when it holds none."""
    if isinstance(prompts, (str, bytes, Mapping, torch.Tensor)) or not isinstance(prompts, Sequence) \
            or not any(isinstance(p, Continuation) for p in prompts):
        return prompts, None
    if attention_mask is not None:
        raise ValueError("prompts with continuations are id lists and continuations: give no attention_mask")
    continuations = tuple(p if isinstance(p, Continuation) else None for p in prompts)
    return [list(p.prompt_token_ids) if isinstance(p, Continuation) else p for p in prompts], continuations


def _continued_params(continued: Continuation, mine: SamplingParams | None, budget: int | None, *, index: int,
                      vocab_size: int, model_type: str, logprobs_mode: str | None) -> SamplingParams:
    """A continuation's ``SamplingParams`` in this call: its own, with the budget this call gives it
    (``budget``, or its ``sampling`` entry's max_tokens, which may set nothing else), counting the
    tokens it has. Its model, its budget and its logprobs are checked."""
    where = f"request {index} (a continuation of request {continued.request}, sample {continued.sample})"
    if (continued.model_type, continued.vocab_size) != (model_type, vocab_size):
        raise ValueError(f"{where} comes from a model_type={continued.model_type!r} with a vocabulary of "
                         f"{continued.vocab_size}; this rollout's model is model_type={model_type!r} with "
                         f"{vocab_size}: continue it on the model that made it")
    if mine is not None:
        if dataclasses.replace(mine, max_tokens=None) != SamplingParams():
            raise ValueError(f"{where}: sampling[{index}]={mine!r} sets more than max_tokens; a continuation keeps "
                             "its own settings: give SamplingParams(max_tokens=...) or SamplingParams()")
        budget = mine.max_tokens if mine.max_tokens is not None else budget
    if budget is None:
        raise ValueError(f"{where} needs a budget: max_new_tokens, or max_tokens in its sampling entry")
    if budget <= continued.num_steps:
        raise ValueError(f"{where} holds {continued.num_steps} tokens, and max_new_tokens={budget} counts them: "
                         f"give it more than {continued.num_steps}")
    if (continued.params.min_tokens or 0) > budget:
        raise ValueError(f"{where} has min_tokens={continued.params.min_tokens}, more than max_new_tokens={budget}: "
                         f"give it at least {continued.params.min_tokens}")
    if logprobs_mode in STEP_LOGPROB_MODES and (continued.logprobs is None or continued.logprobs_mode != logprobs_mode):
        raise ValueError(f"{where} carries {'no' if continued.logprobs is None else repr(continued.logprobs_mode)} "
                         f"logprobs and this call returns logprobs_mode={logprobs_mode!r}: continue it with the mode "
                         "of the call that made it, a 'trainer' mode (recomputed) or without return_logprobs")
    return dataclasses.replace(continued.params, n=1, max_tokens=budget)


def _check_prompt(ids: list[int], max_new_tokens: int, *, index: int, vocab_size: int,
                  max_positions: int | None) -> None:
    if not ids:
        raise ValueError(f"request {index}: the prompt is empty")
    bad = [t for t in ids if t < 0 or t >= vocab_size]
    if bad:
        raise ValueError(f"request {index}: token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    check_context(len(ids), max_new_tokens, max_positions, what=f"request {index}")
