"""What a rollout is asked to do and what it gives back: ``RolloutConfig``, ``RolloutResult``
(per request, a ``RequestOutput`` of ``SampleOutput``s).

Every check of a user's value lives here, so a bad value fails before any model work:
``RolloutConfig.__post_init__`` for the config, ``sampling_params`` for ``generate``'s sampling
arguments, ``min_new_tokens_of`` for its minimums, ``stop_conditions`` for its stop strings and
ids, ``prompt_lists`` for the prompts.

"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch

from rollout_lab.engine.paged_attention import BLOCK_SIZES
from rollout_lab.engine.profile import Profile
from rollout_lab.engine.sampling import SamplingParams, check_seed
from rollout_lab.engine.stopping import StopStrings
from rollout_lab.engine.trainer import padded_batch
from rollout_lab.planner.bucket_dp import BucketPlan
from rollout_lab.planner.checks import MAX_INT, as_int, check_int, ints_per_request, is_int
from rollout_lab.planner.cost import CostCoefficients, CostFile
from rollout_lab.planner.decode_steps import check_prior_settings
from rollout_lab.planner.shape_classes import ShapeClasses
from rollout_lab.planner.fit import check_window

# The routes, in the order tables and figures show them: those a user can force, then Auto's choice.
MANUAL_ROUTES = ("nocb", "equal_width", "aligned", "bucketed", "packed", "paged")
CB_ROUTES = MANUAL_ROUTES[1:]  # continuous batching: the aligned cache, or the paged one (engine.paged_cache)
MODES = MANUAL_ROUTES + ("auto",)
DECODE_MODES = ("auto", "eager", "graph")  # "auto": graph replay on CUDA, eager elsewhere
# decode attention: "span" reads each row's live columns (engine.span_attention), "masked" the
# window with a mask; "auto": span where its kernel runs (CUDA with Triton), masked elsewhere
DECODE_ATTENTIONS = ("auto", "span", "masked")
# decode_widths at most: the windows are rounded to 16 columns, so past capacity / 16 they coincide
# (4096 covers a 64K-token capacity), and the ladder is built by a loop over them
MAX_DECODE_WIDTHS = 4096
# eos_check_interval: "auto" with a captured decode step, and the most a user may give. At 8, a row
# ending at EOS computes 3.5 discarded steps on average; with the long tail's 128 slots and ~0.4 rows
# ending a step that is ~1% of the row-steps, against a host read after every step (~0.4 ms of a
# 2.6 ms step on the H200, 0.5B, the GPU idle meanwhile)
EOS_CHECK_INTERVAL = 8
MAX_EOS_CHECK_INTERVAL = 64


@dataclass(frozen=True)
class RolloutConfig:
    """How to run a rollout.

    EOS, as HF ``generate``: ``eos_token_id`` None (the default) stops rows at the model's EOS ids
    (``model.generation_config``, then ``model.config``); an int or a list of ints overrides them;
    ``ignore_eos=True`` (vLLM's name) stops rows only at their budgets, as benchmarks need.
    """

    mode: str = "auto"
    # slots; None = all requests at once, or on the paged route as many as its pool holds
    continuous_batch_size: int | None = None
    # the user's own CostCoefficients (used as given), or a cost file's path: read here, and checked
    # against the model by Rollout (its provenance must match; override_costs=True accepts a mismatch)
    # "auto": on CUDA the cost cache's coefficients for this model, refined online and saved back
    # (engine.disk_cache), elsewhere the reference's; "reference": the reference's (CostCoefficients())
    costs: CostCoefficients | CostFile | str = "auto"
    override_costs: bool = False
    eos_token_id: int | list[int] | None = None  # None: the model's
    ignore_eos: bool = False  # True: no EOS stops a row (benchmarks)
    pad_token_id: int | None = None  # None: the model's, else the first EOS, else 0
    repetition_penalty: float = 1.0
    cache_capacity: int | None = None  # columns; None = longest prompt + max_new_tokens
    trim_cache: bool = False
    profile: bool = False
    decode: str = "auto"  # "graph" (CUDA-graph replay), "eager", or "auto": graph on CUDA
    max_decode_graphs: int = 24  # graph decode: row counts captured (1 = one graph over every slot)
    decode_widths: int = 8  # masked attention: windows over the capacity (1 = always the whole capacity)
    decode_attention: str = "auto"  # "span", "masked" or "auto" (DECODE_ATTENTIONS)
    # torch.compile the graph-captured decode step and prefill graphs: "layers" each decoder layer
    # (one trace for all of them, engine.compiling), True the whole model (a first compile ~20x longer),
    # "auto" the layers where the model has a decoder-layer list, else the whole model; False to debug
    compile: bool | str = "auto"
    # the decode step's q/k/v and gate/up projections as one matmul each, over a stacked copy of their
    # weights refreshed at every call (engine.fusing): "auto" for the graph-captured step when the
    # copy is at most FUSE_MEMORY_FRACTION of the device, True always (the eager step too), False
    # never ("auto": +14% output tok/s on the H200's long tail, +4% on nano-vllm's shape, the same
    # bf16 logits; paged_128_unfused and ours_unfused measure it off)
    fuse_projections: bool | str = "auto"
    # CUDA: load torch.compile's artifacts for this setting from the rollout cache before compiling,
    # and save them after a call that compiled (engine.disk_cache); False leaves the disk alone
    compile_cache: bool = True
    # bucketed prefill at a bounded set of shapes (planner.shape_classes), planned and priced there;
    # "auto": on CUDA the standard ladder grown to each call's prompts and slots
    # (ShapeClasses.covering), elsewhere none; None: every bucket at its own shape
    prefill_classes: ShapeClasses | str | None = "auto"
    # CUDA: capture each class's prefill forward (engine.prefill_graphs); "auto": wherever classes
    # run on CUDA, unless a cost file given as ``costs`` was calibrated without them
    prefill_graphs: bool | str = "auto"
    max_prefill_graphs: int = 32  # classes captured at most; past it a class runs eagerly
    share_prefill: bool = True  # prefill identical prompts (samples of a request) once per admission
    # EOS-aware decode (planner.decode_steps): recent response lengths; with prior_ewma the
    # Rollout folds each call's lengths into an EWMA histogram used by the next call's route choice
    response_length_prior: tuple[int, ...] | None = None
    prior_ewma: float | None = None
    # refit the coefficients from every call's forwards (planner.fit); state on the Rollout
    online_recalibration: bool = False
    online_window: int = 256  # observations kept (a ring buffer)
    # the paged route (engine.paged_cache): tokens per KV block (a power of two in 16..128); the
    # pool's size in tokens (None: on CUDA what gpu_memory_fraction of the device leaves after the
    # weights and a reserve, capped at what the call's rows could use at once; elsewhere that cap);
    # rows admitted together at least (None: slots // 16, at least 1; fewer when the queue is shorter)
    kv_block_size: int = 64
    gpu_memory_fraction: float = 0.9
    kv_cache_tokens: int | None = None
    refill_rows: int | None = None
    # prompt tokens prefilled between two decode steps at most (the paged route; None: no bound): a
    # turn admits the longest queue prefix within it, and a prompt longer than the bound is prefilled
    # in chunks of it, one a turn, so the live rows never wait for more than one such prefill. Auto
    # takes paged whenever rows refill (more rows than slots) and the bound is set
    admit_tokens_per_step: int | None = None
    # decode steps run between two reads of the tokens when rows can end at EOS or a stop id: the host
    # reads the device once per interval, not after every step, so the GPU never idles while the host
    # appends tokens, retires and admits rows. A row that ends inside an interval computes the rest of
    # it (discarded: its tokens and logprobs end at its EOS, as with 1), and admission waits for the
    # interval's end. "auto": EOS_CHECK_INTERVAL with a captured decode step, else 1 (every step).
    # Stop strings are always checked after every token.
    eos_check_interval: int | str = "auto"

    def refill_rows_for(self, num_slots: int) -> int:
        """Rows a paged admission takes at least on ``num_slots`` slots: ``refill_rows``, else
        ``num_slots // 16`` (at least 1)."""
        return self.refill_rows or max(1, num_slots // 16)

    def __post_init__(self) -> None:
        if self.decode not in DECODE_MODES:
            raise ValueError(f"decode must be one of {list(DECODE_MODES)}, got {self.decode!r}")
        if self.decode_attention not in DECODE_ATTENTIONS:
            raise ValueError(
                f"decode_attention must be one of {list(DECODE_ATTENTIONS)}, got {self.decode_attention!r}")
        if not any(self.compile is c for c in (True, False)) and self.compile not in ("auto", "layers"):  # 1 is not True
            raise ValueError(f"compile must be 'auto', 'layers', True or False, got {self.compile!r}")
        if not any(self.fuse_projections is c for c in (True, False)) and self.fuse_projections != "auto":
            raise ValueError(f"fuse_projections must be 'auto', True or False, got {self.fuse_projections!r}")
        classes = self.prefill_classes
        if classes is not None and not isinstance(classes, ShapeClasses) and not (
                isinstance(classes, str) and classes == "auto"):
            raise ValueError(f"prefill_classes must be a ShapeClasses, 'auto' or None, got {classes!r}")
        if not any(self.prefill_graphs is c for c in (True, False)) and self.prefill_graphs != "auto":
            raise ValueError(f"prefill_graphs must be 'auto', True or False, got {self.prefill_graphs!r}")
        if self.prefill_graphs is True and classes is None:
            raise ValueError("prefill_graphs=True captures one graph per shape class: give prefill_classes "
                             "(a ShapeClasses or 'auto') too")
        if not is_int(self.max_prefill_graphs) or self.max_prefill_graphs < 1:
            raise ValueError(f"max_prefill_graphs must be an int >= 1, got {self.max_prefill_graphs!r}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {list(MODES)}, got {self.mode!r}")
        # the int fields are kept as Python ints: a numpy int overflows in later arithmetic, a tensor
        # hashes by identity (an EOS id given as a tensor would never stop a row)
        object.__setattr__(self, "max_decode_graphs", check_int(self.max_decode_graphs, name="max_decode_graphs"))
        object.__setattr__(self, "decode_widths", check_int(
            self.decode_widths, name="decode_widths", maximum=MAX_DECODE_WIDTHS))
        size = as_int(self.kv_block_size)
        if size not in BLOCK_SIZES:
            raise ValueError(f"kv_block_size must be one of {list(BLOCK_SIZES)}, got {self.kv_block_size!r}")
        object.__setattr__(self, "kv_block_size", size)
        fraction = self.gpu_memory_fraction
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
            raise ValueError(f"gpu_memory_fraction must be a number in (0, 1], got {fraction!r}")
        interval = self.eos_check_interval
        if not (isinstance(interval, str) and interval == "auto"):
            number = as_int(interval)
            if number is None or not 1 <= number <= MAX_EOS_CHECK_INTERVAL:
                raise ValueError(f"eos_check_interval must be 'auto' or an int in 1..{MAX_EOS_CHECK_INTERVAL}, "
                                 f"got {interval!r}")
            object.__setattr__(self, "eos_check_interval", number)
        for name in ("continuous_batch_size", "cache_capacity", "kv_cache_tokens", "refill_rows", "admit_tokens_per_step"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, check_int(value, name=name, or_none=True))
        if self.costs == "reference":
            object.__setattr__(self, "costs", CostCoefficients())
        elif isinstance(self.costs, (str, os.PathLike)) and not (isinstance(self.costs, str) and self.costs == "auto"):
            object.__setattr__(self, "costs", CostFile.read(self.costs))
        if not isinstance(self.costs, (CostCoefficients, CostFile)) and not (
                isinstance(self.costs, str) and self.costs == "auto"):
            raise ValueError(f"costs must be 'auto', 'reference', a CostCoefficients or a cost file path, "
                             f"got {self.costs!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if self.ignore_eos and self.eos_token_id is not None:
            raise ValueError(f"ignore_eos=True conflicts with eos_token_id={self.eos_token_id!r}: "
                             "give one or the other")
        eos = self.eos_token_id
        if isinstance(eos, (list, tuple)):
            ids = [as_int(e) for e in eos]
            if not all(e is not None and 0 <= e <= MAX_INT for e in ids):
                raise ValueError(f"eos_token_id must hold non-negative ints, got {eos!r}")
            object.__setattr__(self, "eos_token_id", type(eos)(ids))
        elif eos is not None:
            if as_int(eos) is None:
                raise ValueError(f"eos_token_id must be an int, a list of ints or None, got {eos!r}")
            object.__setattr__(self, "eos_token_id", check_int(eos, name="eos_token_id", minimum=0))
        if self.pad_token_id is not None:
            object.__setattr__(self, "pad_token_id", check_int(
                self.pad_token_id, name="pad_token_id", minimum=0, or_none=True))
        penalty = self.repetition_penalty
        if isinstance(penalty, bool) or not isinstance(penalty, (int, float)) or not penalty > 0 \
                or penalty == float("inf"):
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {penalty!r}")
        check_prior_settings(self.response_length_prior, self.prior_ewma)
        check_window(self.online_window)
        for name in ("trim_cache", "profile", "share_prefill", "online_recalibration", "override_costs",
                     "compile_cache"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.mode == "nocb" and (self.cache_capacity is not None or self.trim_cache):
            raise ValueError(
                "mode='nocb' runs HF generate and has no aligned cache: "
                "cache_capacity and trim_cache need a continuous-batching mode"
            )
        if self.admit_tokens_per_step is not None and self.mode not in ("paged", "auto"):
            raise ValueError(
                f"admit_tokens_per_step bounds the paged route's admissions; mode={self.mode!r} would ignore "
                f"it: use mode='paged' or 'auto' (which then takes paged whenever rows refill)")
        if self.mode == "paged" and (self.cache_capacity is not None or self.trim_cache):
            raise ValueError(
                "mode='paged' keeps each row in its own blocks: cache_capacity and trim_cache set the "
                "aligned cache; size the paged pool with kv_cache_tokens or gpu_memory_fraction")

    @property
    def eos_token_ids(self) -> tuple[int, ...] | None:
        """The explicit EOS ids: () with ``ignore_eos``, None when the model's apply."""
        if self.ignore_eos:
            return ()
        eos = self.eos_token_id
        if eos is None:
            return None
        return tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)


@dataclass(frozen=True)
class SampleOutput:
    """One response of a request (vLLM's ``CompletionOutput``): a view of ``RolloutResult``'s rows."""

    token_ids: list[int]
    logprobs: list[float] | None  # with generate(return_logprobs=True)
    finish_reason: str  # "stop" or "length"
    text: str | None  # with a tokenizer


@dataclass(frozen=True)
class RequestOutput:
    """One request (vLLM's ``RequestOutput``): its prompt's ids and its ``num_samples`` responses."""

    prompt_token_ids: list[int]
    outputs: list[SampleOutput]


@dataclass(frozen=True)
class RolloutResult:
    """Per (request, sample), request-major, the generated ids up to and including the token that
    stopped the row (an EOS or stop id, or the one completing a stop string).

    ``sequences[r * num_samples + s]`` is sample s of request r (HF's ``num_return_sequences``
    order); ``grouped()`` gives one list of samples per request, ``requests`` one ``RequestOutput``
    per request, ``to_tensors()`` the padded tensors of a loss. ``seed`` is the seed sampling used
    (drawn from torch's global generator when none was given), None for greedy or when every
    sampled request brought its own (``SamplingParams.seed``).
    """

    sequences: list[list[int]]
    route: str
    plans: tuple[BucketPlan, ...]  # one per admission; buckets hold request indices
    profile: Profile | None
    num_samples: int = 1
    seed: int | None = None
    # per sequence: "stop" (an EOS id, a stop id or a stop string ended it) or "length" (its budget)
    finish_reasons: list[str] = field(default_factory=list)
    # with generate(return_logprobs=True): per sequence, each token's log-probability
    logprobs: list[list[float]] | None = None
    # with a tokenizer: per sequence, its decoded text (special tokens skipped), cut before a stop string
    texts: list[str] | None = None
    prompt_token_ids: list[list[int]] = field(default_factory=list)  # per request, the ids prefilled
    pad_token_id: int = 0  # the call's pad id: to_tensors' padding unless it is given one

    def grouped(self) -> list[list[list[int]]]:
        """Per request, its ``num_samples`` sequences."""
        k = self.num_samples
        return [self.sequences[i : i + k] for i in range(0, len(self.sequences), k)]

    @property
    def requests(self) -> list[RequestOutput]:
        """Per request, in input order, its prompt and its samples in sample order."""
        k = self.num_samples

        def sample(row: int) -> SampleOutput:
            return SampleOutput(self.sequences[row], None if self.logprobs is None else self.logprobs[row],
                                self.finish_reasons[row], None if self.texts is None else self.texts[row])

        return [RequestOutput(prompt, [sample(r * k + s) for s in range(k)])
                for r, prompt in enumerate(self._prompts())]

    def to_tensors(self, pad_token_id: int | None = None,
                   device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
        """Every row (``request * num_samples + sample``) padded into the tensors of a policy-gradient
        loss, in ``engine.trainer.padded_batch``'s layout: with P the longest prompt and R the longest
        response, row i is its prompt left-padded to P, then its response right-padded to R.

        - ``input_ids`` [rows, P + R] int64 (``pad_token_id`` as padding; None: the call's pad id) and
          ``attention_mask`` [rows, P + R] int64, 1 on every prompt and response token;
        - ``prompt_ids`` [rows, P] and ``response_ids`` [rows, R]: its two blocks;
        - ``response_mask`` [rows, R] bool: True on generated tokens (the stopping token included);
        - ``logprobs`` [rows, R] fp32, 0 where ``response_mask`` is False (with ``return_logprobs=True``).

        A forward over ``input_ids`` predicts ``response_ids`` with its logits at columns
        ``P - 1 .. P + R - 2``; ``engine.trainer.sequence_logprobs`` runs it with each row's own positions.
        """
        pad = self.pad_token_id if pad_token_id is None else check_int(pad_token_id, name="pad_token_id", minimum=0)
        prompts = [prompt for prompt in self._prompts() for _ in range(self.num_samples)]
        ids, attention_mask, response_mask = padded_batch(prompts, self.sequences, pad_token_id=pad,
                                                          device=device or "cpu")
        width = max(map(len, prompts), default=0)  # P
        out = {"input_ids": ids, "attention_mask": attention_mask, "prompt_ids": ids[:, :width].contiguous(),
               "response_ids": ids[:, width:].contiguous(), "response_mask": response_mask[:, width:].contiguous()}
        if self.logprobs is not None:
            length = ids.shape[1] - width  # R
            out["logprobs"] = torch.tensor([list(lp) + [0.0] * (length - len(lp)) for lp in self.logprobs],
                                           dtype=torch.float32).reshape(len(prompts), length).to(ids.device)
        return out

    def _prompts(self) -> list[list[int]]:
        """``prompt_token_ids``, one per request (a result built without them has none to give)."""
        num_requests = len(self.sequences) // self.num_samples
        if len(self.prompt_token_ids) != num_requests:
            raise ValueError(f"this result holds {len(self.prompt_token_ids)} prompt_token_ids for "
                             f"{num_requests} requests: build it with one prompt per request")
        return self.prompt_token_ids


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
    if given.get("num_beams", 1) == 1:
        given.pop("num_beams", None)
    unsupported = sorted(k for k in given if k not in CALL_DEFAULTS and k not in CONFIG_FIELDS
                         and k not in HARMLESS_FIELDS)
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


def sampling_params(do_sample, temperature, top_k, top_p, seed, sampling=None, *,
                    num_requests: int) -> list[SamplingParams] | None:
    """Each request's ``SamplingParams``, or None when every request is greedy.

    Call-wide: ``do_sample`` with ``temperature``, ``top_k`` and ``top_p``; setting them without
    ``do_sample=True`` is an error. As vLLM, ``temperature=0`` is greedy (top_k and top_p are
    still checked, then have nothing to filter). Per request: ``sampling``, a list of one
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
                                 f"(rollout_lab.engine.sampling), got {params!r}")
        return None if all(p.is_greedy for p in sampling) else list(sampling)
    if not do_sample:
        given.pop("do_sample", None)
        if seed is not None:
            given["seed"] = seed
        if given:
            raise ValueError(
                f"{', '.join(f'{k}={v!r}' for k, v in given.items())} only apply to sampling: "
                "pass do_sample=True (greedy is the default)")
        return None
    params = SamplingParams(temperature, top_k, top_p)  # their checks; temperature 0 is greedy
    return None if params.is_greedy else [params] * num_requests


def min_new_tokens_of(min_new_tokens: Any, budgets: Sequence[int]) -> list[int] | None:
    """One minimum per request (an int for all, or one per request, as ``max_new_tokens``), each in
    [0, that request's max_new_tokens]; None when every one is 0."""
    minimum = ints_per_request(min_new_tokens, len(budgets), name="min_new_tokens", minimum=0, what="minimums")
    for index, (low, high) in enumerate(zip(minimum, budgets)):
        if low > high:
            raise ValueError(f"min_new_tokens={low} of request {index} exceeds its max_new_tokens={high}")
    return minimum if any(minimum) else None


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
