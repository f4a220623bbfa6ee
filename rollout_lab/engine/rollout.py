"""The rollout engine: five routes over a Hugging Face causal LM that give the same tokens.

    from rollout_lab import Rollout, RolloutConfig
    result = Rollout(model, RolloutConfig(mode="auto", eos_token_id=2)).generate(
        [[5, 6, 7], [8]], max_new_tokens=16)
    result.sequences, result.route, result.plans, result.profile

Routes: ``nocb`` (one left-padded HF ``generate``), ``equal_width`` (one prefill at the common
width), ``aligned`` (one prefill per request), ``bucketed`` (the DP's buckets), ``packed`` (prompts
packed into one row) -- these four decode by continuous batching over the right-aligned cache --,
``paged`` (the DP's buckets into a paged cache: rows refill as soon as a slot is free,
``engine.paged_batching``) and ``auto`` (``choose_route``).

Greedy by default. ``do_sample=True`` samples with ``temperature``/``top_k``/``top_p`` from a
counter-based hash of (``seed``, request, sample, step) (``engine.sampling``), so every
route, slot count and refill order gives the same tokens; ``sampling=[SamplingParams(...), ...]``
gives each request its own settings and seed, read per row inside one decode step.
``num_samples`` rows per request share one prefill (``planner.routes.prompt_groups``). nocb runs HF
``generate`` with our sampler as a logits processor (then HF's greedy argmax), so it gives the same
tokens too.

"""
from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Mapping, Sequence

import torch

from rollout_lab.engine.batching import BatchSettings, ContinuousBatcher
from rollout_lab.engine.disk_cache import cached_cost_file, load_compiled, save_compiled, save_costs
from rollout_lab.engine.config import (
    EOS_CHECK_INTERVAL,
    RolloutConfig,
    RolloutResult,
    encode_texts,
    from_generation_config,
    min_new_tokens_of,
    prompt_lists,
    sampling_params,
    stop_conditions,
)
from rollout_lab.engine.decode import LOGPROB_MODES, STEP_LOGPROB_MODES, holds_stops_back
from rollout_lab.engine.nocb import run_nocb
from rollout_lab.engine.fusing import fused_nbytes
from rollout_lab.engine.paged_batching import PagedBatcher
from rollout_lab.engine.prefill import cache_kwarg_name
from rollout_lab.engine.compiling import compile_counts
from rollout_lab.engine.profile import Profile, Timer
from rollout_lab.engine.sampling import RowSampling, SamplingParams, sample_key
from rollout_lab.engine.setting import model_metadata, model_name_of
from rollout_lab.engine.steppers import (
    EagerStepper,
    StepperKey,
    describe,
    graph_capacity,
    make_stepper,
    resolve_compile,
    resolve_fuse,
    resolve_decode_mode,
    graph_weights,
    rebind_weights,
    resolve_spans,
    weights_signature,
)
from rollout_lab.engine.prefill_graphs import PrefillGraphs, graph_reserve_bytes
from rollout_lab.engine.trainer import rollout_logprobs
from rollout_lab.planner.bucket_dp import BucketPlan
from rollout_lab.planner.checks import as_int, budgets_of, check_context, is_int
from rollout_lab.planner.cost import CHECKED_GRID_FIELDS, CostCoefficients, CostFile, ModelGeometry
from rollout_lab.planner.decode_steps import ResponseLengthPrior
from rollout_lab.planner.fit import SETTLED_CALLS, OnlineCalibrator
from rollout_lab.planner.occupancy import blocks_for, simulate_refill
from rollout_lab.planner.routes import choose_shared_route, group_sizes, prompt_groups
from rollout_lab.planner.shape_classes import ShapeClasses


MAX_SAMPLES = 2**16  # num_samples at most: rows are request x sample, each with its own slot and state
MAX_PAGED_SLOTS = 1024  # the paged route's slots when the pool alone would choose more
PAGED_RESERVE_FRACTION = 0.05  # of the device's memory, kept out of the paged pool for activations
# a kept paged pool too small for a call is replaced by one at least this much larger (within what
# the call could use), so calls whose peaks wander upwards rebuild (and recapture) it rarely
PAGED_POOL_GROWTH = 1.25


def model_eos_ids(model: torch.nn.Module) -> tuple[int, ...]:
    """The EOS ids HF ``generate`` would stop at: ``model.generation_config``'s, else the config's."""
    for source in (getattr(model, "generation_config", None), model.config.get_text_config(decoder=True)):
        eos = getattr(source, "eos_token_id", None)
        if eos is not None:
            ids = tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
            return tuple(int(i) for i in ids if is_int(i))
    return ()


def compiled_graphs() -> int:
    """Graphs torch.compile has compiled in this process so far (dynamo's counter)."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def resolve_prefill_graphs(config: RolloutConfig, device: torch.device) -> bool:
    """Whether a rollout captures its prefill forwards: ``prefill_graphs`` as given, or for "auto"
    wherever classes run on CUDA, unless ``costs`` is a calibration made without captured forwards
    (its coefficients price eager forwards, so the rollout runs them as they were timed)."""
    if config.prefill_graphs != "auto":
        return bool(config.prefill_graphs)
    if device.type != "cuda" or config.prefill_classes is None:
        return False
    grid = config.costs.metadata.get("grid") if isinstance(config.costs, CostFile) else None
    return bool(grid.get("prefill_graphs", CHECKED_GRID_FIELDS["prefill_graphs"])) \
        if isinstance(grid, Mapping) else True


def check_causal_lm(model: object) -> None:
    """A ``ValueError`` naming what ``model`` lacks of a Hugging Face causal LM (the config with its
    text geometry, input embeddings, parameters), before anything uses it."""
    missing = []
    config = getattr(model, "config", None)
    if not callable(getattr(config, "get_text_config", None)):
        missing.append("a transformers config (model.config)")
    if not callable(getattr(model, "get_input_embeddings", None)):
        missing.append("get_input_embeddings()")
    if not isinstance(model, torch.nn.Module) or next(model.parameters(), None) is None:
        missing.append("parameters (a torch.nn.Module with weights)")
    if missing:
        raise ValueError(f"Rollout needs a Hugging Face causal LM (AutoModelForCausalLM); "
                         f"{type(model).__name__} lacks {', '.join(missing)}")


# What costs="auto" prices a CUDA rollout's first calls with before anything is measured or cached
# for its setting (engine.disk_cache). The reference prices CB decode 10 ms a step over HF's own loop
# (nocb), true of DeepSpeed's CB and false of ours: a captured, compiled step is the faster one (on
# the H200, 3B: ~6 ms a step against nocb's ~30). Under the reference's gap Auto chose nocb for short
# batches and never measured CB (1.8-11x slower than tuned, issue 33). The prior reverses the gap;
# the first calls' timed forwards then replace it (planner.fit.OnlineCalibrator: nocb stays priced
# at CB's measured step plus this gap until nocb itself is measured).
CAPTURED_DECODE_GAP_MS = 10.0


def captured_decode_prior() -> CostCoefficients:
    """The reference's prefill coefficients, with CB decode ``CAPTURED_DECODE_GAP_MS`` a step
    cheaper than nocb's: the starting point of ``costs="auto"`` on CUDA with a captured decode."""
    return dataclasses.replace(CostCoefficients(), continuous_decode_cost_ms=0.0,
                               nocb_decode_cost_ms=CAPTURED_DECODE_GAP_MS)


def with_unmeasured_decode(coeffs: CostCoefficients, metadata: Mapping[str, Any],
                           decode_mode: str) -> tuple[CostCoefficients, str]:
    """A cost file's coefficients for a Rollout decoding in ``decode_mode``, and what was changed
    ("" when nothing). A calibration whose grid ran no decode probe (``decode_batches`` empty)
    wrote both decode terms as 0, as if CB decode cost what nocb's (HF's eager loop) does; with a
    captured step that sent short batches to nocb at several times the cost (H200, Qwen2.5-3B,
    32 x 16 tokens: 629 ms against 95 on CB). There the captured prior's decode terms replace them.
    A file without a grid is taken as it is."""
    grid = metadata.get("grid")
    if decode_mode != "graph" or not isinstance(grid, Mapping) or grid.get("decode_batches", None) != []:
        return coeffs, ""
    prior = captured_decode_prior()
    return (dataclasses.replace(coeffs, continuous_decode_cost_ms=prior.continuous_decode_cost_ms,
                                nocb_decode_cost_ms=prior.nocb_decode_cost_ms),
            "; its calibration measured no decode: CB decode priced below nocb's (captured step)")


class Rollout:
    """Generates responses (greedy, or seeded sampling) for a batch of prompts through the configured
    route; keeps the captured decode graph, the learned costs and the length prior across calls."""

    def __init__(self, model: torch.nn.Module, config: RolloutConfig | None = None, *, tokenizer: Any = None):
        check_causal_lm(model)
        if tokenizer is not None and not callable(getattr(tokenizer, "batch_decode", None)):
            raise ValueError(f"tokenizer must be a transformers tokenizer, got {type(tokenizer).__name__}")
        self.model = model
        self.tokenizer = tokenizer  # text in (strings, chat messages) and result.texts out
        self.config = config if config is not None else RolloutConfig()
        if not isinstance(self.config, RolloutConfig):
            raise ValueError(f"config must be a RolloutConfig, got {type(self.config).__name__}")
        self.model_config = model.config.get_text_config(decoder=True)
        param = next(model.parameters())
        self.device = param.device
        self.geometry = ModelGeometry.from_config(self.model_config, param.dtype)
        self.vocab_size = model.get_input_embeddings().weight.shape[0]
        self.max_positions = getattr(self.model_config, "max_position_embeddings", None)
        self.cache_kwarg = cache_kwarg_name(model)
        # chosen before any routing decision: graph replay on CUDA, eager elsewhere
        self.decode_mode = resolve_decode_mode(self.config.decode, self.device)
        self.spans = resolve_spans(self.config.decode_attention, model, self.device)
        self.compiled = resolve_compile(self.config.compile, self.decode_mode, model)
        self.fused = resolve_fuse(self.config.fuse_projections, self.decode_mode, model)
        self._fused_nbytes = fused_nbytes(model) if self.fused else 0  # the fused copy's memory, once
        interval = self.config.eos_check_interval  # "auto": a captured step's host read is what is saved
        self.eos_check_interval = (EOS_CHECK_INTERVAL if self.decode_mode == "graph" else 1) \
            if interval == "auto" else interval
        self._stepper: EagerStepper | None = None
        if self.config.prefill_graphs is True and self.device.type != "cuda":
            raise ValueError(f"prefill_graphs=True needs a CUDA device, the model is on {self.device}")
        # whether buckets run at class shapes and replay captured graphs ("auto": on CUDA)
        self.prefill_graphs = resolve_prefill_graphs(self.config, self.device)
        self._prefill_graphs: PrefillGraphs | None = None
        self._prefill_signature: tuple | None = None
        # the parameters and buffers the kept graphs read (steppers.graph_weights); a call whose
        # model holds new tensors copies them in (rebind_weights) instead of capturing again
        self._graph_weights: list[torch.Tensor] | None = None
        # learned across calls; the frozen config is never changed. A cost file is used only once its
        # provenance matches this model, its name included as the CLI checks it (model_name_of: the
        # checkpoint's folder name, else family and size); CostFile.check names every field that differs
        costs = self.config.costs
        # costs="auto" on CUDA: the cost cache's file for this setting, refined online and saved back
        self._cache_metadata = model_metadata(model, prefill_graphs=self.prefill_graphs) \
            if isinstance(costs, str) and self.device.type == "cuda" else None
        self.costs_source = "the user's coefficients" if isinstance(costs, CostCoefficients) else \
            f"cost file {str(costs.path)!r}" if isinstance(costs, CostFile) else "the reference's coefficients"
        refitted = False  # whether the costs are an earlier process's online refit (costs="auto")
        if isinstance(costs, CostCoefficients):
            self.costs: CostCoefficients = costs
        elif isinstance(costs, CostFile):
            self.costs = costs.check(model_metadata(model, model_name=model_name_of(model),
                                                    prefill_graphs=self.prefill_graphs),
                                     override=self.config.override_costs)
            self.costs, note = with_unmeasured_decode(self.costs, costs.metadata, self.decode_mode)
            self.costs_source += note
        else:  # "auto"
            found = cached_cost_file(self._cache_metadata) if self._cache_metadata is not None else None
            self.costs = found.coeffs if found is not None else CostCoefficients()
            if found is not None:
                refitted = True
                self.costs_source = f"cached cost file {str(found.path)!r}"
            elif self._cache_metadata is not None and self.decode_mode == "graph":
                self.costs = captured_decode_prior()
                self.costs_source = ("the reference's prefill coefficients, CB decode priced below nocb's "
                                     "(captured step), refined online (cost cache: nothing for this setting yet)")
            elif self._cache_metadata is not None:
                self.costs_source += ", refined online (cost cache: nothing for this setting yet)"
        # compile_cache on CUDA: torch.compile's artifacts of this setting, loaded before the first compile
        self._compiled_metadata = model_metadata(model, prefill_graphs=self.prefill_graphs) \
            if self.compiled and self.config.compile_cache and self.device.type == "cuda" else None
        self.compiled_artifacts_loaded = load_compiled(self._compiled_metadata) \
            if self._compiled_metadata is not None else 0
        self.length_prior = ResponseLengthPrior(self.config.response_length_prior, self.config.prior_ewma)
        learn = self.config.online_recalibration or self._cache_metadata is not None
        # costs from an earlier refit need one call predicted within SETTLED_ERROR to be trusted, the
        # defaults SETTLED_CALLS of them; then only one call in CHECK_EVERY is timed (planner.fit)
        self.online = OnlineCalibrator(self.geometry, self.costs, window=self.config.online_window,
                                       settled_after=1 if refitted else SETTLED_CALLS) if learn else None
        self._explored = False
        self._layout_memo: tuple[tuple, tuple[int, int, int]] | None = None  # _paged_layout's last (args, answer)

    @property
    def prediction_errors(self) -> list[dict]:
        """Per call (online recalibration): predicted vs measured prefill and decode ms."""
        return [] if self.online is None else list(self.online.errors)

    def close(self) -> None:
        """Release the captured graphs, the cache and the weight memory the graphs read (kept for
        rebind_weights); the rollout stays usable."""
        if self.device.type == "cuda" and (self._stepper is not None or self._prefill_graphs is not None):
            torch.cuda.synchronize(self.device)
        if self._stepper is not None:
            self._stepper.close()
            self._stepper = None
        if self._prefill_graphs is not None:
            self._prefill_graphs.close()
            self._prefill_graphs = None
        self._graph_weights = None

    def _keep_graph_weights(self) -> None:
        """Note the memory the graphs about to be captured read, unless the kept graphs already do."""
        if self._graph_weights is None:
            self._graph_weights = graph_weights(self.model)

    def _captured_prefill(self) -> PrefillGraphs | None:
        """The kept prefill graphs (``prefill_graphs``), recaptured when the weights' storage changed."""
        if not self.prefill_graphs:
            return None
        signature = weights_signature(self.model)
        if self._prefill_graphs is not None and signature != self._prefill_signature:
            self._prefill_graphs.close()
            self._prefill_graphs = None
        if self._prefill_graphs is None:
            self._keep_graph_weights()
            self._prefill_graphs = PrefillGraphs(self.model, cache_kwarg=self.cache_kwarg,
                                                 max_graphs=self.config.max_prefill_graphs, compiled=self.compiled)
            self._prefill_signature = signature
        return self._prefill_graphs

    def prefill_classes(self, lengths: Sequence[int], num_slots: int) -> ShapeClasses | None:
        """The shape classes a call over prompts of ``lengths`` on ``num_slots`` slots prefills at:
        the config's, or for "auto" on CUDA the ladder covering the call (``ShapeClasses.covering``),
        either with the kept prefill graphs' captures priced (``_priced``); "auto"'s ladder comes
        without its 1-row rung where the prefill graphs compile the whole model (one compile serves
        every other class; a 1-row one would compile the model again). Layer by layer that second
        compile is one layer's trace (~1 s for Qwen2.5-3B, H100), so a lone long prompt is not padded
        to two rows: on the H100 the long_tail workload's 1x512 prompt prefilled as 2x512 made
        ``RolloutConfig()`` 1.07x the tuned setting, which ran it as 1x512
        (data/results/defaults_qwen2.5-3b_bfloat16_cuda_h100_layers_warm.json)."""
        classes = self.config.prefill_classes
        if classes is None:
            return None
        if isinstance(classes, ShapeClasses):
            return self._priced(classes)
        if self.device.type != "cuda" or not lengths:
            return None
        return self._priced(ShapeClasses.covering(max(lengths), max(1, num_slots),
                                                  smallest_rows=2 if self.prefill_graphs and self.compiled is True else 1))

    def _priced(self, classes: ShapeClasses) -> ShapeClasses:
        """``classes`` with the kept prefill graphs' shapes and a new class priced at what capturing
        one cost them (``ShapeClasses.priced_captures``): once the online costs refit, the plan they
        give moves to new class shapes only where those pay their captures back. Unchanged before
        any capture and once no more classes can be captured."""
        graphs = self._prefill_graphs
        estimate = None if graphs is None else graphs.capture_estimate_ms()
        if estimate is None:
            return classes
        return classes.priced_captures(graphs.shapes, estimate, max_tokens=graphs.max_tokens)

    def __enter__(self) -> "Rollout":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def stepper_info(self) -> dict:
        """What decodes: kind, captures and replays so far, slots and capacity."""
        return describe(self._stepper)

    @property
    def prefill_graph_info(self) -> dict:
        """The kept prefill graphs' captures (each class's ms, its compile included), replays and
        eager runs; {} when none are kept."""
        return {} if self._prefill_graphs is None else self._prefill_graphs.info

    def _one_time_work(self) -> tuple:
        """A snapshot of the captures and compiles done so far: the prefill graphs' and the decode
        stepper's (each object with its count, so a rebuilt one differs) and torch.compile's frames.
        A timed forward during which it changed paid for them (``Timer``'s ``first_use``), and the
        online costs leave it out: fitted as forward time, the warm-up call's captures and compiles
        would price every shape by what capturing one cost."""
        graphs, stepper = self._prefill_graphs, self._stepper
        return (graphs, 0 if graphs is None else graphs.num_captures,
                stepper, 0 if stepper is None else stepper.num_captures, compile_counts()["frames"])

    def _stepper_for(
        self, num_slots: int, capacity: int, explicit_capacity: bool,
        sampling: RowSampling | None = None, logprobs_mode: str | None = None, num_blocks: int | None = None,
        min_new_tokens: bool = False, max_blocks: int | None = None,
    ) -> EagerStepper:
        """Reuse the kept stepper when it fits this call, else build (and capture) a new one;
        ``num_blocks``: a paged pool of that many blocks (``capacity``: the longest row's tokens),
        grown to ``PAGED_POOL_GROWTH`` times a kept pool that is too small, up to ``max_blocks``;
        ``sampling``: the call's rows (the key takes its filters), ``min_new_tokens``: whether rows
        hold stop ids back."""
        penalty = float(self.config.repetition_penalty)
        old = self._stepper
        if self.decode_mode == "graph" and not explicit_capacity:
            capacity = graph_capacity(capacity)
            if old is not None and old.key.num_slots == num_slots and \
                    capacity <= old.key.capacity <= 2 * capacity:
                capacity = old.key.capacity
        block_size = None if num_blocks is None else self.config.kv_block_size
        if num_blocks is not None and old is not None and old.key.paged and old.key.num_slots == num_slots:
            if num_blocks <= old.key.num_blocks <= 2 * num_blocks:
                num_blocks = old.key.num_blocks  # a pool that holds this call's rows: keep it (and its graphs)
            elif old.key.num_blocks < num_blocks:  # too small: grow it by a quarter at least, within the uncut pool
                num_blocks = max(num_blocks, min(math.ceil(old.key.num_blocks * PAGED_POOL_GROWTH),
                                                 max_blocks or num_blocks))
        key = StepperKey(num_slots, capacity, penalty, penalty != 1.0, self.cache_kwarg,
                         do_sample=sampling is not None, max_top_k=sampling.max_top_k if sampling else 0,
                         top_p_filter=sampling is not None and sampling.top_p_filter, min_new_tokens=min_new_tokens,
                         max_graphs=self.config.max_decode_graphs if self.decode_mode == "graph" else 1,
                         num_widths=self.config.decode_widths, spans=self.spans, compiled=self.compiled,
                         fused=self.fused,
                         logprobs_mode=logprobs_mode, block_size=block_size, num_blocks=num_blocks or 0)
        if old is not None and old.fits(self.model, key):
            old.sync_weights()  # its fused projections' copy of the weights, as the model holds them now
            return old
        if old is not None:  # drop the old cache and graphs before allocating their replacement
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            old.close()
            self._stepper = None
        if self.decode_mode == "graph":
            self._keep_graph_weights()
        self._stepper = make_stepper(self.model, key, decode=self.decode_mode)
        return self._stepper

    # -- public -----------------------------------------------------------------------------
    def generate(
        self,
        prompts: Sequence[Sequence[int]] | torch.Tensor | Mapping[str, Any] | None = None,
        *,
        max_new_tokens: int | Sequence[int] | None = None,
        min_new_tokens: int | Sequence[int] = 0,
        input_ids: Sequence[Sequence[int]] | torch.Tensor | None = None,
        generation_config: Any = None,
        num_samples: int = 1,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        sampling: Sequence[SamplingParams] | None = None,
        attention_mask: torch.Tensor | None = None,
        num_beams: int = 1,
        num_return_sequences: int = 1,
        profile: bool | None = None,
        return_logprobs: bool = False,
        logprobs_mode: str = "raw",
        apply_chat_template: bool = False,
        stop: Sequence[str] | None = None,
        stop_token_ids: Sequence[int] | None = None,
    ) -> RolloutResult:
        """``num_samples`` responses per prompt, greedy unless ``do_sample``; every check runs
        before the first forward.

        ``prompts`` (or ``input_ids=``, HF's name; one of the two) are id lists, a 2-D integer
        tensor with its ``attention_mask`` padded on either side (without one, the mask is inferred
        from the pad id as HF does), or a tokenizer's ``BatchEncoding`` (``config.prompt_lists``).
        With ``Rollout(..., tokenizer=tok)`` they may be strings, or conversations with
        ``apply_chat_template=True``; the result then carries ``texts``.

        ``max_new_tokens`` is one budget for every request, or one per request (its samples share
        it); a row stops at EOS or at its own budget. As vLLM's, ``stop_token_ids`` (ids) stop a row as
        EOS does, and ``stop`` (strings; they need the tokenizer) stop it at the token whose text
        completes one (``engine.stopping``): the tokens end with it, the text ends before the string.
        Each stopped row's ``finish_reasons`` entry is "stop", each row at its budget "length".
        ``min_new_tokens`` (one for all, or one per request, at most its budget; HF's name) holds
        them back: before a row has that many tokens its EOS and stop ids are -inf (HF's
        ``MinNewTokensLengthLogitsProcessor``, on every route) and stop strings do not end it.

        With ``do_sample=True``, ``temperature``, ``top_k`` (0 = off) and ``top_p`` (1.0 = off)
        shape the distribution and ``seed`` (an int >= 0; None draws one from torch's global
        generator) fixes the draws: sample s of request r is a pure function of (seed, r, s). Setting
        any of them without ``do_sample=True`` is an error, not a silent greedy run;
        ``temperature=0`` is greedy (vLLM's rule). ``sampling`` instead gives each request its own:
        a list of one ``engine.sampling.SamplingParams(temperature, top_k, top_p, seed)`` per request
        (temperature 0: greedy; a request's own seed makes its tokens those of a call of it alone
        with that seed; ``seed=`` keys the others). ``profile``
        overrides ``config.profile`` for this call (None keeps it).

        ``return_logprobs=True`` adds ``result.logprobs``: per sequence, each token's log-probability,
        computed inside the decode step (a logsumexp and a gather). ``logprobs_mode`` "raw" (the
        default) is the fp32 log-softmax of the model's logits; "processed" is the distribution the
        token was drawn from (after the penalty, then temperature and top-k/top-p when sampling).
        "trainer" is ``engine.trainer.sequence_logprobs`` of the padded batch (prompts left-padded,
        responses right-padded: ``engine.trainer.padded_batch``), one teacher-forced forward after the
        decode, in eval mode under no_grad: bit-identical to a trainer's call of it on that batch in
        the same dtype ("trainer_fp32": with ``fp32_head=True``), at the cost of that forward.

        ``generation_config`` (a ``transformers.GenerationConfig``) sets those keywords, and the
        repetition penalty and EOS/PAD ids for this call (``config.from_generation_config``); a
        setting it carries that rollout_lab does not support is an error.
        """
        call = dict(max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens, num_samples=num_samples,
                    do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p)
        overrides: dict[str, Any] = {}
        if generation_config is not None:
            call, overrides = from_generation_config(generation_config, call)
        if call["max_new_tokens"] is None:
            raise ValueError("max_new_tokens is required (as a keyword or in generation_config)")
        if not isinstance(apply_chat_template, bool):
            raise ValueError(f"apply_chat_template must be a bool, got {apply_chat_template!r}")
        if prompts is not None:
            prompts = encode_texts(self.tokenizer, prompts, apply_chat_template=apply_chat_template)
        elif apply_chat_template:
            raise ValueError("apply_chat_template=True takes the conversations as the prompts argument")
        if not isinstance(return_logprobs, bool):
            raise ValueError(f"return_logprobs must be a bool, got {return_logprobs!r}")
        if logprobs_mode not in LOGPROB_MODES:
            raise ValueError(f"logprobs_mode must be one of {list(LOGPROB_MODES)}, got {logprobs_mode!r}")
        rest = dict(input_ids=input_ids, seed=seed, sampling=sampling, attention_mask=attention_mask,
                    num_beams=num_beams, num_return_sequences=num_return_sequences, profile=profile,
                    logprobs_mode=logprobs_mode if return_logprobs else None, stop=stop,
                    stop_token_ids=stop_token_ids)
        if not overrides:
            return self._generate(prompts, **call, **rest)
        saved = self.config
        self.config = dataclasses.replace(saved, **overrides)  # checked as any RolloutConfig; this call only
        try:
            return self._generate(prompts, **call, **rest)
        finally:
            self.config = saved

    def _generate(
        self, prompts, *, max_new_tokens, min_new_tokens, input_ids, num_samples, do_sample, temperature, top_k,
        top_p, seed, sampling, attention_mask, num_beams, num_return_sequences, profile, logprobs_mode, stop,
        stop_token_ids,
    ) -> RolloutResult:
        start = time.perf_counter()
        compiled_before = compiled_graphs() if self._compiled_metadata is not None else None
        cfg = self.config
        self._layout_memo = None  # _paged_layout's answer holds for this call only (the device's memory moves)
        if (prompts is None) == (input_ids is None):
            raise ValueError("give the prompts either positionally or as input_ids=, not "
                             + ("both" if prompts is not None else "neither"))
        prompts = input_ids if prompts is None else prompts
        if profile is not None and not isinstance(profile, bool):
            raise ValueError(f"profile must be a bool or None, got {profile!r}")
        profiling = cfg.profile if profile is None else profile
        prompts, budgets, minimums, params, seed, stop_ids, stop_strings, pad_id = self._check_call(
            prompts, attention_mask, max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens,
            num_samples=num_samples, do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p,
            seed=seed, sampling=sampling, num_beams=num_beams, num_return_sequences=num_return_sequences,
            stop=stop, stop_token_ids=stop_token_ids)
        if self._graph_weights is not None and not rebind_weights(self.model, self._graph_weights):
            self._graph_weights = None  # the model's tensors changed layout: its graphs are captured again
        stats = Profile()
        # timed (the device synchronised at every phase) when profiled or when the costs learn from
        # it: every call with online_recalibration=True, else while the calibrator is due (planner.fit)
        observing = self.online is not None and (cfg.online_recalibration or self.online.due())
        if self.online is not None and not observing:
            self.online.skip()
        timer = Timer(stats, self.device, enabled=profiling or observing, one_time=self._one_time_work)
        if profiling or observing:
            stats.forwards = []
        lengths = [len(p) for p in prompts]
        # rows, request-major: row = request * num_samples + sample
        row_prompts = [p for p in prompts for _ in range(num_samples)]
        row_budgets = [b for b in budgets for _ in range(num_samples)]
        row_minimums = None if minimums is None else tuple(m for m in minimums for _ in range(num_samples))
        holds_back = holds_stops_back(stop_ids, row_minimums)  # the decode step masks stop ids
        groups = prompt_groups(prompts, num_samples=num_samples, share=cfg.share_prefill)
        keys = [0] * len(row_prompts)
        sampling = None  # each row's settings, on the device
        if params is not None:  # a request's own seed keys it as request 0 of a call with that seed
            keys = [0 if p.is_greedy else sample_key(seed, r, s) if p.seed is None else sample_key(p.seed, 0, s)
                    for r, p in enumerate(params) for s in range(num_samples)]
            sampling = RowSampling.of([p for p in params for _ in range(num_samples)], self.device)
        with timer.phase("planning_ms"):
            # the most steps between two reads of the tokens, as the engine runs them: 1 with stop
            # strings, eos_check_interval with EOS or stop ids, else a burst goes to the nearest budget
            bursts = 1 if stop_strings is not None else self.eos_check_interval if stop_ids else max(budgets, default=1)
            # Auto's replay reads as often where rows can end early; without it rows run to their
            # budgets and it reads every step (its reads then change nothing)
            read_interval = bursts if stop_ids or stop_strings is not None else 1
            route = self._route(lengths, budgets, num_samples=num_samples, groups=groups, read_interval=read_interval,
                                bursts=bursts)
        if not prompts:
            return RolloutResult([], route, (), stats if profiling else None, num_samples, seed,
                                 logprobs=[] if logprobs_mode else None, pad_token_id=pad_id)
        capacity = self._capacity(lengths, budgets, route)
        num_rows = len(row_prompts)
        num_slots = min(cfg.continuous_batch_size or num_rows, num_rows)
        stepper = None
        # the "trainer" modes take no logprobs in the step: one teacher-forced forward after it
        step_logprobs = logprobs_mode if logprobs_mode in STEP_LOGPROB_MODES else None
        if route == "paged":  # the paged pool and its slots; its stepper even for budgets of 1
            num_slots, num_blocks, max_blocks = self._paged_layout([len(p) for p in row_prompts], row_budgets,
                                                                   bursts)
            with timer.phase("stepper_build_ms"):
                stepper = self._stepper_for(num_slots, capacity, False, sampling, step_logprobs, num_blocks,
                                            holds_back, max_blocks)
        # A call whose every budget is 1 takes its tokens from the prefill and runs no decode step: the
        # batcher then allocates a plain cache for this call alone, and the kept stepper (its graphs,
        # its compile) is neither built nor replaced.
        elif route != "nocb" and max(row_budgets) > 1:
            with timer.phase("stepper_build_ms"):  # ~0 when the kept stepper fits
                stepper = self._stepper_for(num_slots, capacity, cfg.cache_capacity is not None, sampling,
                                            step_logprobs, min_new_tokens=holds_back)
            capacity = stepper.key.capacity
        with torch.no_grad():
            if route == "nocb":
                sequences, plans, logprobs = run_nocb(
                    self.model, row_prompts, budgets=row_budgets, eos_ids=stop_ids,
                    pad_id=pad_id, repetition_penalty=float(cfg.repetition_penalty),
                    vocab_size=self.vocab_size, geometry=self.geometry, costs=self.costs,
                    profile=stats, timer=timer, sampling=sampling, keys=keys, logprobs_mode=step_logprobs,
                    stop_strings=stop_strings, min_new_tokens=row_minimums)
            else:
                settings = BatchSettings(
                    route=route, budgets=tuple(row_budgets), num_slots=num_slots,
                    capacity=capacity, trim_cache=cfg.trim_cache, eos_token_ids=frozenset(stop_ids),
                    pad_token_id=pad_id, repetition_penalty=float(cfg.repetition_penalty),
                    cache_kwarg=self.cache_kwarg, sampling=sampling,
                    prefill_classes=self.prefill_classes(lengths, min(num_rows, cfg.continuous_batch_size or num_rows)),
                    logprobs_mode=step_logprobs, stop_strings=stop_strings, min_new_tokens=row_minimums,
                    eos_check_interval=self.eos_check_interval,
                )
                common = dict(geometry=self.geometry, costs=self.costs, profile=stats, timer=timer, stepper=stepper,
                              groups=groups, sample_keys=keys, prefill_graphs=self._captured_prefill())
                if route == "paged":
                    refill = cfg.refill_rows_for(num_slots)
                    batcher = PagedBatcher(self.model, row_prompts, settings, refill_rows=refill,
                                           admit_tokens=cfg.admit_tokens_per_step, **common)
                else:
                    batcher = ContinuousBatcher(self.model, row_prompts, settings, **common)
                sequences, plans = batcher.run()
                logprobs = batcher.logprobs if step_logprobs else None
        if logprobs_mode is not None and step_logprobs is None:
            logprobs = rollout_logprobs(self.model, row_prompts, sequences, pad_token_id=pad_id,
                                        fp32_head=logprobs_mode == "trainer_fp32")
        if num_samples > 1:  # plans name rows; report requests
            plans = [_plan_of_requests(plan, num_samples) for plan in plans]
        stats.num_generated_tokens = sum(len(s) for s in sequences)
        timer.sync()
        stats.total_ms = (time.perf_counter() - start) * 1e3
        self._learn(route, sequences, stats)
        if self._compiled_metadata is not None and compiled_graphs() != compiled_before:
            save_compiled(self._compiled_metadata)  # this call compiled: the next process loads it
        reasons = ["stop" if s and s[-1] in stop_ids else "length" for s in sequences]
        texts = None if self.tokenizer is None else self.tokenizer.batch_decode(sequences, skip_special_tokens=True)
        if stop_strings is not None:  # the rows that ended on a stop string: their text stops before it
            floors = [stop_strings.floor(seq, m) for seq, m in zip(sequences, row_minimums or [0] * len(sequences))]
            reasons = ["stop" if stop_strings.find(text, f) is not None else r
                       for r, text, f in zip(reasons, texts, floors)]
            texts = [stop_strings.cut(text, f) for text, f in zip(texts, floors)]
        return RolloutResult(sequences, route, tuple(plans), stats if profiling else None,
                             num_samples, seed, reasons, logprobs, texts, prompts, pad_id)

    # -- checks -----------------------------------------------------------------------------
    def _check_call(self, prompts, attention_mask, *, max_new_tokens, min_new_tokens, num_samples, do_sample,
                    temperature, top_k, top_p, seed, sampling, num_beams, num_return_sequences, stop,
                    stop_token_ids):
        """Every check of a call, before any forward: (prompt lists, budgets and minimums per
        request (None: none), SamplingParams per request (None: all greedy), the call's seed (None
        when no request draws with it), the ids that end a row (EOS and stop ids), stop strings,
        pad id)."""
        stop_strings, extra_ids = stop_conditions(stop, stop_token_ids, tokenizer=self.tokenizer,
                                                  vocab_size=self.vocab_size)
        if as_int(num_beams) != 1:
            raise ValueError(f"num_beams={num_beams!r} is not supported (1): no beam search")
        if as_int(num_return_sequences) != 1:
            raise ValueError(
                f"num_return_sequences={num_return_sequences!r} is not supported: use num_samples")
        if not is_int(num_samples) or not 1 <= num_samples <= MAX_SAMPLES:
            raise ValueError(f"num_samples must be an int in [1, {MAX_SAMPLES}], got {num_samples!r}")
        prompts = prompt_lists(prompts, attention_mask, pad_token_id=self._pad_token_id(),
                               eos_token_ids=self.eos_token_ids)
        budgets = budgets_of(max_new_tokens, len(prompts))
        minimums = min_new_tokens_of(min_new_tokens, budgets)
        params = sampling_params(do_sample, temperature, top_k, top_p, seed, sampling, num_requests=len(prompts))
        self._check_prompts(prompts, budgets)
        eos_ids = self.eos_token_ids
        pad_id = self._pad_token_id()
        for name, ids in (("eos_token_id", eos_ids), ("pad_token_id", (pad_id,))):
            for token in ids:
                if token >= self.vocab_size:
                    raise ValueError(f"{name} {token} is outside the vocabulary [0, {self.vocab_size})")
        if params is None or all(p.is_greedy or p.seed is not None for p in params):
            seed = None  # greedy (temperature=0 among it) draws nothing; own seeds key their requests
        elif seed is None:
            seed = int(torch.randint(0, 2**63 - 1, ()).item())  # torch.manual_seed reproduces it
        stop_ids = tuple(dict.fromkeys((*eos_ids, *extra_ids)))
        return prompts, budgets, minimums, params, seed, stop_ids, stop_strings, pad_id

    def _check_prompts(self, prompts: list[list[int]], budgets: list[int]) -> None:
        for index, (ids, max_new_tokens) in enumerate(zip(prompts, budgets)):
            if not ids:
                raise ValueError(f"request {index}: the prompt is empty")
            bad = [t for t in ids if t < 0 or t >= self.vocab_size]
            if bad:
                raise ValueError(
                    f"request {index}: token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})"
                )
            check_context(len(ids), max_new_tokens, self.max_positions, what=f"request {index}")

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The ids that stop a row: the config's (``()`` with ``ignore_eos``), else the model's."""
        explicit = self.config.eos_token_ids
        return model_eos_ids(self.model) if explicit is None else explicit

    def _pad_token_id(self) -> int:
        if self.config.pad_token_id is not None:
            return self.config.pad_token_id
        for source in (getattr(self.model, "generation_config", None), self.model_config):  # as HF generate
            model_pad = getattr(source, "pad_token_id", None)
            if is_int(model_pad) and 0 <= model_pad < self.vocab_size:
                return model_pad
        eos = self.eos_token_ids
        return eos[0] if eos else 0

    def _route(
        self, lengths: list[int], budgets: list[int], *, num_samples: int = 1,
        groups: Sequence[int] | None = None, read_interval: int = 1, bursts: int = 1,
    ) -> str:
        cfg = self.config
        n, slots = len(lengths) * num_samples, cfg.continuous_batch_size
        if cfg.mode == "nocb":
            if slots is not None and n > slots:
                raise ValueError(
                    f"mode='nocb' runs all {n} rows (requests x num_samples) at once, more than "
                    f"continuous_batch_size={slots}"
                )
            return "nocb"
        if cfg.mode == "bucketed":
            # a prompt over prefill_max_tokens is chunked (planner.chunks.plan_chunked)
            return "bucketed"
        if cfg.mode != "auto":
            return cfg.mode
        sizes = group_sizes(groups if groups is not None else range(n))
        free_layout = cfg.cache_capacity is None and not cfg.trim_cache  # nocb and paged need no fixed columns
        # every row at once, unless that cache cannot fit the device: the paged pool then takes as
        # many rows at once as the memory holds
        budget = self._kv_budget_bytes(n) if slots is None and free_layout and n else None
        if budget is not None and n * (max(lengths) + max(budgets)) * self.geometry.kv_bytes_per_token > budget:
            self._explored = False
            return "paged"
        paged_allowed, pool = free_layout, None
        if cfg.admit_tokens_per_step is not None and free_layout and slots is not None and slots < n:
            self._explored = False
            return "paged"  # rows refill and their admissions must stay bounded: only paged bounds them
        if paged_allowed and slots is not None and slots < n:  # paged is a candidate: price its pool too
            rows = range(n)
            try:
                pool = self._paged_layout([lengths[r // num_samples] for r in rows],
                                          [budgets[r // num_samples] for r in rows], bursts)[1] - 1  # less the scratch block
            except ValueError:  # the pool cannot hold the longest row: the paged route would refuse this call
                paged_allowed = False
        plan = choose_shared_route(
            [lengths[g // num_samples] for g in sizes], list(sizes.values()),
            max_new_tokens=[budgets[g // num_samples] for g in sizes], continuous_batch_size=slots,
            geometry=self.geometry, coeffs=self.costs,
            nocb_allowed=free_layout, response_lengths=self.length_prior.current(), chunk_long_prompts=True,
            classes=self.prefill_classes(lengths, min(n, slots or n)), paged_allowed=paged_allowed,
            paged_pool_blocks=pool, kv_block_size=cfg.kv_block_size,
            refill_rows=cfg.refill_rows_for(min(slots or n, n)), read_interval=read_interval,
        )
        self._explored = False
        if self.online is not None and cfg.online_recalibration and plan.nocb_cost_ms is not None:
            other = "bucketed" if plan.route == "nocb" else "nocb"
            if not self.online.has_decode(other):  # its decode cost is still a guess: measure it
                self._explored = True
                return other
        return plan.route

    def _learn(self, route: str, sequences: list[list[int]], profile: Profile) -> None:
        """After a call: fold its response lengths into the prior; refit the costs online."""
        self.length_prior.update([len(s) for s in sequences])
        if self.online is not None and profile.forwards is not None:
            self.online.observe(profile.forwards, self.costs, route=route, explored=self._explored,
                                total_ms=profile.total_ms)
            refit = self.online.refit(self.costs)
            if self._cache_metadata is not None and refit != self.costs:  # costs="auto": the next process starts here
                save_costs(refit, self._cache_metadata, source="online refit (costs='auto')")
            self.costs = refit

    def _kv_budget_bytes(self, num_slots: int) -> float | None:
        """The bytes of KV cache a call on ``num_slots`` slots may allocate: on CUDA
        ``gpu_memory_fraction`` of the device less what is allocated now and a reserve for activations
        and logits (``PAGED_RESERVE_FRACTION`` of the device, plus 16 bytes x vocab per slot) and,
        before the prefill graphs exist, for their outputs (``graph_reserve_bytes``); None elsewhere
        (no bound). The kept stepper's cache counts as free: the call reuses it, or ``_stepper_for``
        drops it before allocating its replacement."""
        if self.device.type != "cuda":
            return None
        cfg = self.config
        free, total = torch.cuda.mem_get_info(self.device)
        if self._stepper is not None:
            free += self._stepper.cache.num_bytes
        reserve = PAGED_RESERVE_FRACTION * total + 16 * self.vocab_size * num_slots
        if self.prefill_graphs and self._prefill_graphs is None:  # the graphs come after the cache
            reserve += graph_reserve_bytes(cfg.max_prefill_graphs, self.geometry.kv_bytes_per_token)
        if self.fused and (self._stepper is None or self._stepper.fusion is None):  # so does the fused copy
            reserve += self._fused_nbytes
        return cfg.gpu_memory_fraction * total - (total - free) - reserve

    def _paged_layout(self, lengths: Sequence[int], budgets: Sequence[int], bursts: int = 1) -> tuple[int, int, int]:
        """(slots, blocks in the pool, blocks the pool may grow to) of a paged call over rows of
        ``lengths`` and ``budgets``.

        The pool: ``kv_cache_tokens`` when set; else what every row could use at once (its prompt and
        budget), on CUDA no more than ``_kv_budget_bytes`` allows. The slots:
        ``continuous_batch_size``, else as many rows as the pool holds at their worst case
        (at most ``MAX_PAGED_SLOTS``). A pool that cannot hold the longest row is a ValueError.

        Without ``kv_cache_tokens`` the pool is then cut to what the call's rows can hold at once on
        those slots: the peak of blocks in ``simulate_refill``'s replay with every row running to its
        budget (bursts of at most ``bursts`` steps, as the engine reserves them), plus one block per
        slot (the admission watermark). Rows rarely run to their budgets all at once, so the pool
        follows the live tokens rather than every row's prompt and budget; a call whose rows end
        early stays within it, and where refill lets a longer prompt in sooner, preemption covers it.
        The pool may grow (``_stepper_for``) up to the uncut size: every row's prompt and budget, or
        what the memory allows.

        Within one call the route's pricing and the layout ask the same question: the answer is kept
        for the call (its worst-case replay is tens of ms for hundreds of rows)."""
        key = (tuple(lengths), tuple(budgets), bursts)
        if self._layout_memo is not None and self._layout_memo[0] == key:
            return self._layout_memo[1]
        cfg = self.config
        size = cfg.kv_block_size
        row_blocks = [blocks_for(n + b, size) for n, b in zip(lengths, budgets)]
        wanted = sum(row_blocks) + 1  # + the scratch block
        block_bytes = size * self.geometry.kv_bytes_per_token
        allowed = None if cfg.kv_cache_tokens is not None else \
            self._kv_budget_bytes(min(len(lengths), cfg.continuous_batch_size or MAX_PAGED_SLOTS))
        if cfg.kv_cache_tokens is not None:
            num_blocks, source = blocks_for(cfg.kv_cache_tokens, size) + 1, f"kv_cache_tokens={cfg.kv_cache_tokens}"
        elif allowed is not None:
            num_blocks = min(wanted, max(0, int(allowed // block_bytes)))
            source = f"gpu_memory_fraction={cfg.gpu_memory_fraction} ({allowed / 2**30:.1f} GiB for KV)"
        else:
            num_blocks, source = wanted, "every row at once"
        longest = max(row_blocks)
        if num_blocks - 1 < longest:
            row = row_blocks.index(longest)
            raise ValueError(f"the paged pool ({source}) holds {max(0, num_blocks - 1) * size} tokens, fewer than "
                             f"row {row} needs ({lengths[row]} prompt + {budgets[row]} new tokens, in blocks of "
                             f"{size}): raise kv_cache_tokens or gpu_memory_fraction")
        slots = cfg.continuous_batch_size or max(1, min(MAX_PAGED_SLOTS, (num_blocks - 1) * len(row_blocks)
                                                        // sum(row_blocks)))
        slots = min(slots, len(lengths))
        uncut = num_blocks
        if cfg.kv_cache_tokens is None:
            worst = simulate_refill(lengths, budgets, budgets, num_slots=slots, layout="paged", block_size=size,
                                    refill_rows=cfg.refill_rows_for(slots), read_interval=max(1, bursts))
            num_blocks = min(num_blocks, max(worst.peak_blocks + slots, longest) + 1)  # + the scratch block
        self._layout_memo = (key, (slots, num_blocks, uncut))
        return slots, num_blocks, uncut

    def _capacity(self, lengths: list[int], budgets: list[int], route: str) -> int:
        capacity = self.config.cache_capacity
        if capacity is None:
            return max(lengths) + max(budgets)
        # a single request needs its prompt and budget (the last token is never written back)
        needs = [length + budget - 1 for length, budget in zip(lengths, budgets)]
        needed = max(needs)
        if route != "nocb" and capacity < needed:
            index = needs.index(needed)
            raise ValueError(
                f"cache_capacity={capacity} is too small for request {index} (prompt {lengths[index]} "
                f"+ max_new_tokens {budgets[index]}); it needs at least {needed} columns, "
                "and trimming cannot free columns a single request needs"
            )
        return capacity


def _plan_of_requests(plan: BucketPlan, num_samples: int) -> BucketPlan:
    """A plan over rows (request * num_samples + sample) restated over request indices."""
    buckets = tuple(tuple(r // num_samples for r in bucket) for bucket in plan.buckets)
    return dataclasses.replace(plan, buckets=buckets)
