"""``Rollout``, the engine's facade: a call is checked once (``api.call.check_call``), routed, its
cache sized (``kv.sizing``), its rows scheduled (``sched``) on the kept model runner (``runner``),
and learned from. Every route gives the same tokens.

    from rollout_lab import Rollout, RolloutConfig
    result = Rollout(model, RolloutConfig(mode="auto", eos_token_id=2)).generate(
        [[5, 6, 7], [8]], max_new_tokens=16)
    result.sequences, result.route, result.plans, result.profile

Routes: ``nocb`` (one left-padded HF ``generate``), ``equal_width`` (one prefill at the common
width), ``aligned`` (one prefill per request), ``bucketed`` (the DP's buckets), ``packed`` (prompts
packed into one row) -- these four decode by continuous batching over the right-aligned cache --,
``paged`` (the DP's buckets into a paged cache: rows refill as soon as a slot is free,
``engine.sched.paged``) and ``auto`` (``choose_route``; always paged with ``prefix_cache``, the one
route whose pool keeps prompts' blocks across calls).

Greedy by default. ``do_sample=True`` samples with ``temperature``/``top_k``/``top_p`` from a
counter-based hash of (``seed``, request, sample, step) (``engine.sample.sampler``), so every
route, slot count and refill order gives the same tokens; ``sampling=[SamplingParams(...), ...]``
gives each request its own settings (vLLM's fields: samples, budget, minimum, penalties, min-p,
stops, seed), read per row inside one decode step.
``num_samples`` rows per request share one prefill (``planner.routes.prompt_groups``). nocb runs HF
``generate`` with our sampler as a logits processor (then HF's greedy argmax), so it gives the same
tokens too.

"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import time
from typing import Any, Callable, Mapping, Sequence

import torch

from rollout_lab.engine.api.call import CallSpec, check_call, encode_texts, from_generation_config
from rollout_lab.engine.api.config import EOS_CHECK_INTERVAL, RolloutConfig
from rollout_lab.engine.api.costs import resolve_costs
from rollout_lab.engine.api.loading import load_model_and_tokenizer, rollout_config
from rollout_lab.engine.api.result import RolloutResult
from rollout_lab.engine.kernels import kv_fp8
from rollout_lab.engine.kernels.available import kernel_available
from rollout_lab.engine.kernels.batch_invariant import batch_invariant, check_invariant_model
from rollout_lab.engine.kernels.shared_prefix import prefix_splits
from rollout_lab.engine.kv.sizing import PagedLayout, aligned_capacity, kv_budget_bytes, paged_layout
from rollout_lab.engine.limits import ModelLimits, check_cache_sizes
from rollout_lab.engine.model_info import model_metadata
from rollout_lab.engine.profile import Profile, Timer
from rollout_lab.engine.runner.disk_cache import load_compiled, save_compiled, save_costs
from rollout_lab.engine.runner.runner import ModelRunner
from rollout_lab.engine.sample.params import SamplingParams
from rollout_lab.engine.sample.processors import LOGPROB_MODES, STEP_LOGPROB_MODES, RowPenalties, holds_stops_back
from rollout_lab.engine.sample.sampler import RowSampling
from rollout_lab.engine.sched.aligned import BatchSettings, ContinuousBatcher
from rollout_lab.engine.sched.episodes import EpisodeBatcher, Episodes, env_mask
from rollout_lab.engine.sched.hf_generate import run_nocb
from rollout_lab.engine.sched.paged import PagedBatcher
from rollout_lab.engine.sched.progress import check_progress, progress_hook, shows_progress
from rollout_lab.engine.sched.request import Continuation, Request
from rollout_lab.engine.trainer import eval_mode, rollout_logprobs
from rollout_lab.planner.bucket_dp import BucketPlan
from rollout_lab.planner.checks import check_context, is_int
from rollout_lab.planner.cost import CostCoefficients, ModelGeometry
from rollout_lab.planner.decode_steps import ResponseLengthPrior
from rollout_lab.planner.fit import SETTLED_CALLS, OnlineCalibrator
from rollout_lab.planner.kv_reads import shared_prefix_pays
from rollout_lab.planner.routes import choose_shared_route, group_sizes
from rollout_lab.planner.shape_classes import ShapeClasses


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


def check_causal_lm(model: object) -> None:
    """A ``ValueError`` naming what ``model`` lacks of a Hugging Face causal LM (the config with its
    text geometry, input embeddings, an LM head, parameters), before anything uses it."""
    missing = []
    config = getattr(model, "config", None)
    if not callable(getattr(config, "get_text_config", None)):
        missing.append("a transformers config (model.config)")
    if not callable(getattr(model, "get_input_embeddings", None)):
        missing.append("get_input_embeddings()")
    head = getattr(model, "get_output_embeddings", None)
    if not callable(head):
        missing.append("an LM head (get_output_embeddings())")
    elif head() is None:  # a bare decoder (model.model) has the embeddings and weights but no head
        missing.append("an LM head (its get_output_embeddings() is None: a bare decoder such as model.model? "
                       "pass the AutoModelForCausalLM around it)")
    if not isinstance(model, torch.nn.Module) or next(model.parameters(), None) is None:
        missing.append("parameters (a torch.nn.Module with weights)")
    if missing:
        raise ValueError(f"Rollout needs a Hugging Face causal LM (AutoModelForCausalLM); "
                         f"{type(model).__name__} lacks {', '.join(missing)}")


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
        cfg = self.config
        # the pool's bytes a token (an FP8 pool's fewer): kv_cache_tokens is the paged pool's size
        limits = ModelLimits(self.max_positions, self.pool_bytes_per_token, self.vocab_size, self.device)
        check_cache_sizes(limits, cache_capacity=cfg.cache_capacity, kv_cache_tokens=cfg.kv_cache_tokens)
        if cfg.batch_invariant:  # before any allocation: the device's kernels and the model's ops
            check_invariant_model(model)
        # chosen before any routing decision: graph replay on CUDA, eager elsewhere
        self.runner = ModelRunner(model, decode=cfg.decode, decode_attention=cfg.decode_attention,
                                  compile=False if cfg.batch_invariant else cfg.compile,
                                  fuse_projections=cfg.fuse_projections,
                                  prefill_graphs=False if cfg.batch_invariant else cfg.prefill_graphs,
                                  prefill_classes=cfg.prefill_classes,
                                  costs=cfg.costs, max_prefill_graphs=cfg.max_prefill_graphs,
                                  max_decode_graphs=cfg.max_decode_graphs, decode_widths=cfg.decode_widths,
                                  batch_invariant=cfg.batch_invariant)
        interval = cfg.eos_check_interval  # "auto": a captured step's host read is what is saved
        self.eos_check_interval = (EOS_CHECK_INTERVAL if self.runner.decode_mode == "graph" else 1) \
            if interval == "auto" else interval
        # learned across calls; the frozen config is never changed
        resolved = resolve_costs(cfg.costs, model, captures_prefill=self.runner.captures_prefill,
                                 decode_mode=self.runner.decode_mode, override=cfg.override_costs)
        self.costs: CostCoefficients = resolved.costs
        self.costs_source = resolved.source
        self._cache_metadata = resolved.cache_metadata  # costs="auto" on CUDA: the refit is saved there
        # compile_cache on CUDA: torch.compile's artifacts of this setting, loaded before the first compile
        self._compiled_metadata = model_metadata(model, prefill_graphs=self.runner.captures_prefill) \
            if self.runner.compiled and cfg.compile_cache and self.device.type == "cuda" else None
        self.compiled_artifacts_loaded = load_compiled(self._compiled_metadata) \
            if self._compiled_metadata is not None else 0
        self.length_prior = ResponseLengthPrior(cfg.response_length_prior, cfg.prior_ewma)
        learn = cfg.online_recalibration or self._cache_metadata is not None
        # costs from an earlier refit need one call predicted within SETTLED_ERROR to be trusted, the
        # defaults SETTLED_CALLS of them; then only one call in CHECK_EVERY is timed (planner.fit)
        self.online = OnlineCalibrator(self.geometry, self.costs, window=cfg.online_window,
                                       settled_after=1 if resolved.refitted else SETTLED_CALLS) if learn else None
        self._explored = False
        self._layout_memo: tuple[tuple, PagedLayout] | None = None  # paged_layout's last (args, answer)
        self.num_calls = 0  # generate calls run so far; the next one's index (RolloutResult.segments)

    @classmethod
    def from_pretrained(cls, name_or_path: str | os.PathLike, *, dtype: torch.dtype | str | None = None,
                        device: str | torch.device | None = None, tokenizer: Any = None,
                        **config_fields: Any) -> "Rollout":
        """A Rollout over the causal LM in a local folder (what ``save_pretrained`` writes, read with no
        network) or of a Hugging Face hub name, as vLLM's ``LLM(model=...)``; ``config_fields`` are
        RolloutConfig's (checked before the model loads).

        ``device``: None is cuda when available, else cpu. ``dtype``: None is bfloat16 on CUDA and
        float32 on CPU, "auto" the checkpoint's own, else a torch dtype or its name ("bfloat16").
        ``tokenizer``: None loads the folder's own; a folder without tokenizer files still loads, with
        no tokenizer (prompts as token ids; text prompts then raise generate's "needs a tokenizer"
        error); False loads none; a path or hub name loads that one; a tokenizer object is used as is.
        A bad path, name or value is a one-line ValueError (an OSError when the hub cannot give a
        name) before any weights are read (``engine.api.loading``)."""
        config = rollout_config(config_fields)
        model, found = load_model_and_tokenizer(name_or_path, dtype=dtype, device=device, tokenizer=tokenizer)
        return cls(model, config, tokenizer=found)

    @property
    def prediction_errors(self) -> list[dict]:
        """Per call (online recalibration): predicted vs measured prefill and decode ms."""
        return [] if self.online is None else list(self.online.errors)

    def close(self) -> None:
        """Release the captured graphs, the cache and the weight memory the graphs read (kept for
        refreshing the weights); the rollout stays usable."""
        self.runner.close()

    def clear_prefix_cache(self) -> int:
        """Drop the prefix cache's blocks (``RolloutConfig.prefix_cache``); the number dropped. A
        change of the weights drops them by itself, except a write through ``.data``, which leaves
        no trace on the tensors (``runner.steppers.weights_state``): call this after one."""
        return self.runner.drop_prefix_cache()

    def prefill_classes(self, lengths: Sequence[int], num_slots: int) -> ShapeClasses | None:
        """The shape classes a call over prompts of ``lengths`` on ``num_slots`` slots prefills at:
        the config's, or for "auto" on CUDA the ladder covering the call (``ShapeClasses.covering``),
        either with the kept prefill graphs' captures priced (``_priced``); "auto"'s ladder comes
        without its 1-row rung where the prefill graphs compile the whole model (one compile serves
        every other class; a 1-row one would compile the model again). Layer by layer that second
        compile is one layer's trace, paid once, where a padded second row is paid on every call, so
        a lone long prompt is not padded to two rows
        (data/results/defaults_qwen2.5-3b_bfloat16_cuda_h100_layers_warm.json: long_tail's 1x512
        prompt run as 2x512; ..._h100_rung_warm.json: as 1x512)."""
        classes = self.config.prefill_classes
        if classes is None:
            return None
        if isinstance(classes, ShapeClasses):
            return self.runner.priced(classes)
        if self.device.type != "cuda" or not lengths:
            return None
        return self.runner.priced(ShapeClasses.covering(max(lengths), max(1, num_slots),
                                                  smallest_rows=2 if self.runner.captures_prefill and self.runner.compiled is True else 1))

    def __enter__(self) -> "Rollout":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def stepper_info(self) -> dict:
        """What decodes: kind, captures and replays so far, slots and capacity."""
        return self.runner.stepper_info

    @property
    def prefill_graph_info(self) -> dict:
        """The kept prefill graphs' captures (each class's ms, its compile included), replays and
        eager runs; {} when none are kept."""
        return self.runner.prefill_graph_info

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
        logprobs_mode: str | None = None,
        apply_chat_template: bool = False,
        stop: Sequence[str] | None = None,
        stop_token_ids: Sequence[int] | None = None,
        progress: bool | None = None,
        finish_fraction: float | None = None,
        env: Callable[[int, int, list[int]], list[int] | None] | None = None,
        max_turns: int | None = None,
        max_env_tokens: int | None = None,
    ) -> RolloutResult:
        """``num_samples`` responses per prompt, greedy unless ``do_sample``; every check runs
        before the first forward. The model runs in eval mode for the call (dropout off, as vLLM and
        HF pipelines run it), whatever mode it is in; each module's train/eval flag is restored
        afterwards, also when the call raises. A trainer calling ``engine.trainer.sequence_logprobs``
        in train mode with dropout on computes other logprobs than the rollout's.

        ``prompts`` (or ``input_ids=``, HF's name; one of the two) are id lists, a 2-D integer
        tensor with its ``attention_mask`` padded on either side (without one, the mask is inferred
        from the pad id as HF does), or a tokenizer's ``BatchEncoding`` (``config.prompt_lists``).
        With ``Rollout(..., tokenizer=tok)`` they may be strings, or conversations with
        ``apply_chat_template=True``; the result then carries ``texts``.

        ``max_new_tokens`` is one budget for every request, or one per request (its samples share
        it); a row stops at EOS or at its own budget. As vLLM's, ``stop_token_ids`` (ids) stop a row as
        EOS does, and ``stop`` (strings; they need the tokenizer) stop it at the token whose text
        completes one (``engine.sample.stopping``): the tokens end with it, the text ends before the string.
        Each stopped row's ``finish_reasons`` entry is "stop", each row at its budget "length".
        ``min_new_tokens`` (one for all, or one per request, at most its budget; HF's name) holds
        them back: before a row has that many tokens its EOS and stop ids are -inf (HF's
        ``MinNewTokensLengthLogitsProcessor``, on every route) and stop strings do not end it.

        With ``do_sample=True``, ``temperature``, ``top_k`` (0 = off) and ``top_p`` (1.0 = off)
        shape the distribution and ``seed`` (an int >= 0; None draws one from torch's global
        generator) fixes the draws: sample s of request r is a pure function of (seed, r, s). Setting
        any of them without ``do_sample=True`` is an error, not a silent greedy run, except
        ``temperature=0``, which is greedy with or without ``do_sample`` (vLLM's rule; a
        GenerationConfig's too). ``sampling`` instead gives each request its own:
        a list of one ``rollout_lab.SamplingParams`` per request, vLLM's fields (``temperature``,
        ``top_k``, ``top_p``, ``min_p``, ``seed``, ``n``, ``max_tokens``, ``min_tokens``, ``stop``,
        ``stop_token_ids``, ``presence_penalty``, ``frequency_penalty``, ``repetition_penalty``);
        a field left None takes the call's argument (``num_samples``, ``max_new_tokens``, ...), and
        the call-wide temperature/top_k/top_p must then stay at their defaults. Temperature 0 is
        greedy; a request's own seed makes its tokens those of a call of it alone with that seed;
        ``seed=`` keys the others. ``profile`` overrides ``config.profile`` for this call (None keeps it).

        ``return_logprobs=True`` adds ``result.logprobs``: per sequence, each token's log-probability,
        computed inside the decode step (a logsumexp and a gather). ``logprobs_mode`` (None: "raw";
        given without ``return_logprobs=True`` it is an error, as it would change nothing) "raw" is the fp32 log-softmax of the model's logits; "processed" is the distribution the
        token was drawn from (after the penalties, then temperature, min-p, top-k and top-p when sampling).
        "trainer" is ``engine.trainer.sequence_logprobs`` of the padded batch (prompts left-padded,
        responses right-padded: ``engine.trainer.padded_batch``), one teacher-forced forward after the
        decode, in eval mode under no_grad: bit-identical to a trainer's call of it on that batch in
        the same dtype ("trainer_fp32": with ``fp32_head=True``), at the cost of that forward.

        ``generation_config`` (a ``transformers.GenerationConfig``) sets those keywords, and the
        repetition penalty and EOS/PAD ids for this call (``call.from_generation_config``); a
        setting it carries that rollout_lab does not support is an error; fields at their defaults
        (a model's own ``generation_config`` lists ``output_attentions=False``) are accepted.

        ``progress`` draws a tqdm bar of the generated tokens on stderr once the call has run
        ``sched.progress.DELAY_S`` seconds: True always, False never, None keeps
        ``config.progress`` (None there: where a person watches, a terminal or a Jupyter kernel, and
        not when the environment variable CI is set).

        Partial rollouts (the paged route; ``mode="auto"`` takes it): ``finish_fraction=f`` (in
        (0, 1]; None: off) returns once ceil(f x rows) rows have finished. The others keep the tokens
        they have, with the finish reason "unfinished", and come back as ``result.unfinished``, one
        ``Continuation`` each. A later call takes continuations among its prompts (beside id lists):
        each is one row (whatever ``num_samples``) that keeps its sampling settings, key and stop
        rules, and goes on to the budget this call gives it (``max_new_tokens`` counts the tokens it
        has): it resumes as a preempted row does (its prompt and tokens prefilled again under the
        current weights), so with unchanged weights it draws the tokens it would have drawn in one
        call. Its output holds its whole response; ``segments`` tell which call made which tokens.

        ``env`` makes each row a multi-turn episode (``engine.sched.episodes``; the paged route, which
        ``mode="auto"`` then takes): ``env(request_index, sample_index, token_ids) -> list[int] | None``
        is called, in a thread pool off the decode loop, when a row stops at one of its stop ids that
        is not an EOS id (``stop_token_ids``) or at a stop string, with the row's tokens so far; the ids
        it returns are appended as environment tokens and the model goes on after them, None ends the
        episode. EOS, ``max_new_tokens`` (the model's tokens of the whole episode) and ``max_turns``
        (the model's turns; None: no bound) end it too. ``max_env_tokens`` bounds the environment's
        tokens of one episode (None: its ``max_new_tokens``; they size the row's cache); an answer
        past it, or one that is not a list of ids in the vocabulary, is a ValueError. A row's
        ``sequences`` entry then holds the model's and the environment's tokens in order (logprobs 0.0
        on the environment's); ``result.env_masks`` marks the environment's, ``num_turns`` counts the
        model's turns.
        """
        call = dict(max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens, num_samples=num_samples,
                    do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p)
        config = self.config
        if generation_config is not None:
            call, overrides = from_generation_config(generation_config, call)
            config = dataclasses.replace(config, **overrides)  # checked as any RolloutConfig; this call only
        if not isinstance(apply_chat_template, bool):
            raise ValueError(f"apply_chat_template must be a bool, got {apply_chat_template!r}")
        if (prompts is None) == (input_ids is None):
            raise ValueError("give the prompts either positionally or as input_ids=, not "
                             + ("both" if prompts is not None else "neither"))
        if prompts is not None:
            prompts = encode_texts(self.tokenizer, prompts, apply_chat_template=apply_chat_template)
        elif apply_chat_template:
            raise ValueError("apply_chat_template=True takes the conversations as the prompts argument")
        if not isinstance(return_logprobs, bool):
            raise ValueError(f"return_logprobs must be a bool, got {return_logprobs!r}")
        if logprobs_mode is not None and logprobs_mode not in LOGPROB_MODES:
            raise ValueError(f"logprobs_mode must be one of {list(LOGPROB_MODES)}, got {logprobs_mode!r}")
        if logprobs_mode is not None and not return_logprobs:
            raise ValueError(f"logprobs_mode={logprobs_mode!r} chooses which logprobs to return, and this call "
                             "returns none: pass return_logprobs=True")
        if profile is not None and not isinstance(profile, bool):
            raise ValueError(f"profile must be a bool or None, got {profile!r}")
        check_progress(progress)
        eos_ids = self._eos_ids(config)
        episodes = self._check_episodes(config, env, max_turns, max_env_tokens, eos_ids)
        spec = check_call(
            input_ids if prompts is None else prompts, attention_mask=attention_mask, **call, seed=seed,
            sampling=sampling, stop=stop, stop_token_ids=stop_token_ids, num_beams=num_beams,
            num_return_sequences=num_return_sequences,
            logprobs_mode=(logprobs_mode or "raw") if return_logprobs else None,
            profile=config.profile if profile is None else profile,
            repetition_penalty=float(config.repetition_penalty), eos_token_ids=eos_ids,
            pad_token_id=self._pad_token_id(config, eos_ids), vocab_size=self.vocab_size,
            max_positions=self.max_positions, tokenizer=self.tokenizer, share_prefill=config.share_prefill,
            finish_fraction=finish_fraction, model_type=self._model_type)
        if spec.finish_fraction is not None or spec.continuations is not None:
            self.config.check_paged_route(("finish_fraction" if spec.finish_fraction is not None else "continuations")
                                          + " needs the paged route, which resumes rows across calls")
        if episodes is not None:
            if spec.finish_fraction is not None or spec.continuations is not None:
                raise ValueError("env= runs whole episodes in one call: finish_fraction= and continuations "
                                 "among the prompts do not combine with it yet")
            for index, (prompt, params) in enumerate(zip(spec.prompts, spec.params)):  # the env's tokens take positions too
                check_context(len(prompt), params.max_tokens + episodes.env_budget(params.max_tokens),
                              self.max_positions, what=f"request {index} (max_new_tokens includes max_env_tokens)")
        invariant = batch_invariant(self.model) if self.config.batch_invariant else contextlib.nullcontext()
        with eval_mode(self.model), invariant:  # dropout off for the decode and the "trainer" logprobs alike
            return self._run(spec, progress=shows_progress(config.progress if progress is None else progress),
                             episodes=episodes)

    @property
    def _model_type(self) -> str:
        """The model's kind as a continuation records it (``Continuation.model_type``)."""
        return str(getattr(self.model_config, "model_type", ""))

    def _check_episodes(self, config: RolloutConfig, env: Any, max_turns: Any, max_env_tokens: Any,
                        eos_ids: Sequence[int]) -> Episodes | None:
        """``generate``'s episode arguments checked (``Episodes``, ending at ``eos_ids``); None without ``env``."""
        if env is None:
            for name, value in (("max_turns", max_turns), ("max_env_tokens", max_env_tokens)):
                if value is not None:
                    raise ValueError(f"{name}={value!r} bounds an episode and this call has none: pass env= too")
            return None
        episodes = Episodes(env, max_turns, max_env_tokens, eos_ids=frozenset(eos_ids))
        self.config.check_paged_route("env= needs the paged route, which keeps a row's blocks while its "
                                      "environment answers")
        return episodes

    def _run(self, spec: CallSpec, *, progress: bool = False, episodes: Episodes | None = None) -> RolloutResult:
        """Run a checked call: route it, size its cache, schedule its requests, learn from it;
        ``progress``: with its bar (``sched.progress``); ``episodes``: its rows call that environment."""
        start = time.perf_counter()
        compiled_before = compiled_graphs() if self._compiled_metadata is not None else None
        cfg = self.config
        self._layout_memo = None  # paged_layout's answer holds for this call only (the device's memory moves)
        stats = Profile()
        call_index = self.num_calls
        self.num_calls += 1
        if self.runner.refresh_weights() and self.runner.drop_prefix_cache():
            stats.prefix_cache_dropped = "weights"
        # timed (the device synchronised at every phase) when profiled or when the costs learn from
        # it: every call with online_recalibration=True, else while the calibrator is due (planner.fit)
        observing = self.online is not None and (cfg.online_recalibration or self.online.due())
        if self.online is not None and not observing:
            self.online.skip()
        timer = Timer(stats, self.device, enabled=spec.profile or observing, one_time=self.runner.one_time_work)
        if spec.profile or observing:
            stats.forwards = []
        requests = spec.requests()  # the rows, request-major
        lengths = [len(r.prompt) for r in requests]
        budgets = [r.max_tokens for r in requests]
        can_stop = any(r.stop_ids for r in requests)
        has_strings = any(r.stop_strings is not None for r in requests)
        holds_back = holds_stops_back([r.stop_ids for r in requests], [r.min_tokens for r in requests])
        sampled = [r.params for r in requests]
        sampling = RowSampling.of(sampled, self.device) if any(not p.is_greedy for p in sampled) else None
        penalties = None
        if any(p.has_penalties for p in sampled):
            penalties = RowPenalties.of([(p.repetition_penalty, p.presence_penalty, p.frequency_penalty)
                                         for p in sampled], self.device)
        with timer.phase("planning_ms"):
            # the most steps between two reads of the tokens, as the engine runs them: 1 with stop
            # strings, eos_check_interval with EOS or stop ids, else a burst goes to the nearest budget
            bursts = 1 if has_strings else self.eos_check_interval if can_stop else max(budgets, default=1)
            # Auto's replay reads as often where rows can end early; without it rows run to their
            # budgets and it reads every step (its reads then change nothing)
            read_interval = bursts if can_stop or has_strings else 1
            route, first_plan = self._choose_route(lengths, budgets, groups=[r.group for r in requests],
                                                   read_interval=read_interval, bursts=bursts,
                                                   uniform_stops=len(set(spec.stop_ids)) <= 1,
                                                   resumes=spec.finish_fraction is not None
                                                   or spec.continuations is not None)
            if episodes is not None:  # paged only (checked); each row's positions hold the env's tokens too
                route, first_plan = "paged", None
                budgets = [b + episodes.env_budget(b) for b in budgets]
        if not requests:
            return RolloutResult([], route, (), stats if spec.profile else None, spec.num_samples or 1, spec.seed,
                                 logprobs=[] if spec.logprobs_mode else None, pad_token_id=spec.pad_token_id,
                                 samples=spec.samples)
        capacity = aligned_capacity(lengths, budgets, cache_capacity=cfg.cache_capacity, route=route)
        num_rows = len(requests)
        num_slots = min(cfg.continuous_batch_size or num_rows, num_rows)
        stepper = None
        # the "trainer" modes take no logprobs in the step: one teacher-forced forward after it
        step_logprobs = spec.logprobs_mode if spec.logprobs_mode in STEP_LOGPROB_MODES else None
        rows = dict(sampling=sampling, penalties=penalties, logprobs_mode=step_logprobs, min_new_tokens=holds_back,
                    forced=episodes is not None)  # an episode's answers enter as forced inputs of the step
        if route == "paged":  # the paged pool and its slots; its stepper even for budgets of 1
            layout = self.paged_layout(lengths, budgets, bursts, groups=[r.group for r in requests])
            num_slots = layout.num_slots
            kept, cached = self.runner.stepper, self.runner.num_cached_blocks
            prefix_groups = self.shared_prefix_groups(lengths, [r.group for r in requests], num_slots,
                                                      -(-capacity // cfg.kv_block_size))
            with timer.phase("stepper_build_ms"):
                stepper = self.runner.stepper_for(num_slots, capacity, False, num_blocks=layout.num_blocks,
                                                  block_size=cfg.kv_block_size, max_blocks=layout.max_blocks,
                                                  prefix_groups=prefix_groups, kv_dtype=cfg.kv_cache_dtype, **rows)
            if cached and stepper is not kept:
                stats.prefix_cache_dropped = "pool"
        # A call whose every budget is 1 takes its tokens from the prefill and runs no decode step: the
        # batcher then allocates a plain cache for this call alone, and the kept stepper (its graphs,
        # its compile) is neither built nor replaced.
        elif route != "nocb" and max(budgets) > 1:
            with timer.phase("stepper_build_ms"):  # ~0 when the kept stepper fits
                stepper = self.runner.stepper_for(num_slots, capacity, cfg.cache_capacity is not None, **rows)
            capacity = stepper.key.capacity
        with torch.no_grad(), progress_hook(requests, enabled=progress) as on_retire:
            if route == "nocb":
                plans = run_nocb(self.model, requests, pad_id=spec.pad_token_id, vocab_size=self.vocab_size,
                                 geometry=self.geometry, costs=self.costs, profile=stats, timer=timer,
                                 sampling=sampling, penalties=penalties, holds_stops_back=holds_back,
                                 logprobs_mode=step_logprobs, on_retire=on_retire)
            else:
                settings = BatchSettings(
                    route=route, num_slots=num_slots, capacity=capacity, trim_cache=cfg.trim_cache,
                    pad_token_id=spec.pad_token_id, cache_kwarg=self.runner.cache_kwarg, sampling=sampling,
                    penalties=penalties, holds_stops_back=holds_back,
                    prefill_classes=self.prefill_classes(lengths, min(num_rows, cfg.continuous_batch_size or num_rows)),
                    logprobs_mode=step_logprobs, eos_check_interval=self.eos_check_interval,
                    first_plan=first_plan if route in ("bucketed", "paged") else None, on_retire=on_retire,
                    finish_rows=None if spec.finish_fraction is None else math.ceil(spec.finish_fraction * num_rows),
                )
                common = dict(geometry=self.geometry, costs=self.costs, profile=stats, timer=timer, stepper=stepper,
                              prefill_graphs=self.runner.captured_prefill())
                if route == "paged":
                    paged = dict(refill_rows=cfg.refill_rows_for(num_slots), admit_tokens=cfg.admit_tokens_per_step,
                                 share_prompt_blocks=cfg.share_prompt_blocks, prefix_cache=cfg.prefix_cache)
                    batcher = PagedBatcher(self.model, requests, settings, **paged, **common) if episodes is None \
                        else EpisodeBatcher(self.model, requests, settings, episodes=episodes, **paged, **common)
                else:
                    batcher = ContinuousBatcher(self.model, requests, settings, **common)
                plans = batcher.run()
        finished = batcher.finished if spec.finish_fraction is not None else None
        sequences = [r.tokens for r in requests]
        logprobs = [r.logprobs for r in requests] if step_logprobs else None
        if spec.logprobs_mode is not None and step_logprobs is None:
            logprobs = rollout_logprobs(self.model, [r.prompt for r in requests], sequences,
                                        pad_token_id=spec.pad_token_id, fp32_head=spec.logprobs_mode == "trainer_fp32")
        env_masks = None if episodes is None else [env_mask(r) for r in requests]
        if env_masks is not None and logprobs is not None:  # the environment's tokens were not drawn
            logprobs = [[0.0 if env else lp for lp, env in zip(lps, mask)] for lps, mask in zip(logprobs, env_masks)]
        plans = [_plan_of_requests(plan, [r.request for r in requests]) for plan in plans]  # plans name rows
        continued = spec.continuations or (None,) * len(spec.prompts)
        earlier = sum(c.num_steps for c in continued if c is not None)  # tokens earlier calls made
        stats.num_generated_tokens = sum(len(s) for s in sequences) - earlier
        timer.sync()
        stats.total_ms = (time.perf_counter() - start) * 1e3
        # an unfinished row's length is not a response length
        self._learn(route, [s for r, s in zip(requests, sequences) if finished is None or r.index in finished], stats)
        if self._compiled_metadata is not None and compiled_graphs() != compiled_before:
            save_compiled(self._compiled_metadata)  # this call compiled: the next process loads it
        reasons = [r.finish_reason for r in requests]
        texts = None if self.tokenizer is None else self.tokenizer.batch_decode(sequences, skip_special_tokens=True)
        if has_strings:  # the rows that ended on a stop string: their text stops before it
            for i, r in enumerate(requests):
                if r.stop_strings is None:
                    continue
                if episodes is not None:  # an episode's text is whole; its last turn's string ended it
                    turn = self.tokenizer.decode(r.turn_tokens, skip_special_tokens=True)
                    reasons[i] = "stop" if r.stop_strings.find(turn) is not None else reasons[i]
                    continue
                floor = r.stop_strings.floor(r.tokens, r.min_tokens)
                if r.stop_strings.find(texts[i], floor) is not None:
                    reasons[i] = "stop"
                texts[i] = r.stop_strings.cut(texts[i], floor)
        segments = [_segments(continued[r.request], len(r.tokens), call_index) for r in requests]
        unfinished = []
        if finished is not None:
            for i, r in enumerate(requests):
                if r.index not in finished:
                    reasons[i] = "unfinished"
                    unfinished.append(self._continuation(r, segments[i], logprobs=None if logprobs is None else logprobs[i],
                                                          logprobs_mode=spec.logprobs_mode))
        stats.num_continued_rows = sum(c is not None and bool(c.token_ids) for c in continued)
        stats.num_continued_tokens = earlier
        stats.num_unfinished_rows = len(unfinished)
        return RolloutResult(sequences, route, tuple(plans), stats if spec.profile else None, spec.num_samples or 1,
                             spec.seed, reasons, logprobs, texts, spec.prompts, spec.pad_token_id,
                             samples=spec.samples, segments=segments, unfinished=unfinished, env_masks=env_masks,
                             num_turns=None if episodes is None else [1 + len(r.env_spans) for r in requests])

    def _continuation(self, row: Request, segments: tuple[tuple[int, int], ...], *, logprobs: list[float] | None,
                      logprobs_mode: str | None) -> Continuation:
        """An unfinished ``row`` as a later call continues it."""
        return Continuation(tuple(row.prompt), tuple(row.tokens), None if logprobs is None else tuple(logprobs),
                            dataclasses.replace(row.params, n=1), row.key, row.request, row.sample, segments,
                            stop_ids=row.stop_ids, stop_strings=row.stop_strings,
                            logprobs_mode=None if logprobs is None else logprobs_mode,
                            model_type=self._model_type, vocab_size=self.vocab_size)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The ids that stop a row: the config's (``()`` with ``ignore_eos``), else the model's."""
        return self._eos_ids(self.config)

    def _eos_ids(self, config: RolloutConfig) -> tuple[int, ...]:
        """``config``'s EOS ids (a call's, with a GenerationConfig's overrides), else the model's."""
        return model_eos_ids(self.model) if config.eos_token_ids is None else config.eos_token_ids

    @property
    def pad_token_id(self) -> int:
        """The id that pads prompts: the config's, else the model's (as HF ``generate``), else the
        first EOS id, else 0."""
        return self._pad_token_id(self.config, self.eos_token_ids)

    def _pad_token_id(self, config: RolloutConfig, eos_ids: Sequence[int]) -> int:
        if config.pad_token_id is not None:
            return config.pad_token_id
        for source in (getattr(self.model, "generation_config", None), self.model_config):  # as HF generate
            model_pad = getattr(source, "pad_token_id", None)
            if is_int(model_pad) and 0 <= model_pad < self.vocab_size:
                return model_pad
        return eos_ids[0] if eos_ids else 0

    def route_for(
        self, lengths: Sequence[int], budgets: Sequence[int], *, groups: Sequence[int] | None = None,
        read_interval: int = 1, bursts: int = 1, uniform_stops: bool = True,
    ) -> str:
        """The route a call over rows of ``lengths`` and ``budgets`` takes (request-major; ``groups``:
        each row's shared-prefill group, None: each its own): the config's mode, or Auto's choice
        (``read_interval`` and ``bursts``: how often the engine reads tokens; ``uniform_stops``:
        whether every row stops at the same ids, which nocb needs to be priced)."""
        return self._choose_route(lengths, budgets, groups=groups, read_interval=read_interval, bursts=bursts,
                                  uniform_stops=uniform_stops)[0]

    def _choose_route(
        self, lengths: Sequence[int], budgets: Sequence[int], *, groups: Sequence[int] | None,
        read_interval: int, bursts: int, uniform_stops: bool, resumes: bool = False,
    ) -> tuple[str, BucketPlan | None]:
        """``route_for``'s route, and Auto's prefill plan over the unique prompts (in order of first
        appearance) when it priced one: the first admission of all of them runs it (plan once).
        ``resumes``: the call returns or continues unfinished rows, which only paged does."""
        cfg = self.config
        n, slots = len(lengths), cfg.continuous_batch_size
        if cfg.mode == "nocb":
            if slots is not None and n > slots:
                raise ValueError(
                    f"mode='nocb' runs all {n} rows (requests x num_samples) at once, more than "
                    f"continuous_batch_size={slots}"
                )
            return "nocb", None
        if cfg.mode != "auto":
            return cfg.mode, None  # bucketed: a prompt over prefill_max_tokens is chunked (planner.chunks)
        if cfg.prefix_cache or cfg.shared_prefix_attention == "on" or resumes or cfg.batch_invariant \
                or cfg.kv_cache_dtype == "fp8":
            self._explored = False  # only the paged pool keeps prompts' blocks across calls, shares them,
            # resumes rows, decodes with the invariant kernels, or stores FP8
            return "paged", None
        sizes = group_sizes(range(n) if groups is None else groups)
        free_layout = cfg.cache_capacity is None and not cfg.trim_cache  # nocb and paged need no fixed columns
        # every row at once, unless that cache cannot fit the device: the paged pool then takes as
        # many rows at once as the memory holds
        budget = self.kv_budget_bytes(n) if slots is None and free_layout and n else None
        if budget is not None and n * (max(lengths) + max(budgets)) * self.geometry.kv_bytes_per_token > budget:
            self._explored = False
            return "paged", None
        paged_allowed, pool = free_layout, None
        if cfg.admit_tokens_per_step is not None and free_layout and slots is not None and slots < n:
            self._explored = False
            return "paged", None  # rows refill and their admissions must stay bounded: only paged bounds them
        if paged_allowed and slots is not None and slots < n:  # paged is a candidate: price its pool too
            try:
                pool = self.paged_layout(lengths, budgets, bursts, groups=groups).num_blocks - 1  # less the scratch block
            except ValueError:  # the pool cannot hold the longest row: the paged route would refuse this call
                paged_allowed = False
        plan = choose_shared_route(
            [lengths[g] for g in sizes], list(sizes.values()),
            max_new_tokens=[budgets[g] for g in sizes], continuous_batch_size=slots,
            geometry=self.geometry, costs=self.costs,
            nocb_allowed=free_layout and uniform_stops, response_lengths=self.length_prior.current(),
            chunk_long_prompts=True, classes=self.prefill_classes(lengths, min(n, slots or n)),
            paged_allowed=paged_allowed, paged_pool_blocks=pool, kv_block_size=cfg.kv_block_size,
            refill_rows=cfg.refill_rows_for(min(slots or n, n)), read_interval=read_interval,
            share_prompt_blocks=cfg.share_prompt_blocks,
        )
        self._explored = False
        if self.online is not None and cfg.online_recalibration and plan.nocb_cost_ms is not None:
            other = "bucketed" if plan.route == "nocb" else "nocb"
            if not self.online.has_decode(other):  # its decode cost is still a guess: measure it
                self._explored = True
                return other, None
        return plan.route, plan.plan

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

    def kv_budget_bytes(self, num_slots: int) -> float | None:
        """The bytes of KV cache a call on ``num_slots`` slots may allocate (``kv.sizing``): on CUDA
        ``gpu_memory_fraction`` of the device less what is allocated now and what the runner will
        still allocate (the kept stepper's cache counts as free); None elsewhere (no bound)."""
        return kv_budget_bytes(self.device, num_slots=num_slots, gpu_memory_fraction=self.config.gpu_memory_fraction,
                               vocab_size=self.vocab_size, free_extra_bytes=self.runner.kept_cache_bytes,
                               reserve_extra_bytes=self.runner.pending_bytes(self.geometry.kv_bytes_per_token))

    @property
    def pool_bytes_per_token(self) -> int:
        """Bytes the paged pool spends on one token over all layers, keys and values: the model's
        ``kv_bytes_per_token``, or with ``kv_cache_dtype="fp8"`` its e4m3 bytes and scales (rounded up)."""
        if self.config.kv_cache_dtype != "fp8":
            return self.geometry.kv_bytes_per_token
        return math.ceil(kv_fp8.kv_bytes_per_token(self.geometry, self.config.kv_block_size))

    def shared_prefix_groups(self, lengths: Sequence[int], groups: Sequence[int], num_slots: int,
                             max_blocks_per_row: int) -> int:
        """The groups the paged decode reads shared prompt blocks of once per step
        (``RolloutConfig.shared_prefix_attention``; 0: the plain read) for rows of prompt ``lengths``
        and shared-prefill ``groups`` on ``num_slots`` slots: at most the prompts with two samples or
        more, and half the slots, rounded up to a power of two (nearby calls share a captured step).
        "auto" reads them so where the kernel runs and ``planner.kv_reads.shared_prefix_pays`` for the
        groups the slots hold at first (each prompt's full blocks, once per tile of its rows)."""
        cfg = self.config
        if cfg.shared_prefix_attention == "off" or not cfg.share_prompt_blocks or cfg.batch_invariant \
                or cfg.kv_cache_dtype == "fp8":  # each row reads its own blocks
            return 0
        size = cfg.kv_block_size
        sizes = group_sizes(groups)  # first row of each prompt -> its rows
        shared = [(lengths[g] // size * size, n) for g, n in sizes.items() if n > 1 and lengths[g] >= size]
        if not shared:
            return 0
        count = min(len(shared), max(1, num_slots // 2))
        count = 1 << (count - 1).bit_length()
        if cfg.shared_prefix_attention == "on":
            return count
        if not kernel_available(self.device):
            return 0
        prefix, rows, room = [], [], num_slots  # the groups the slots hold at first, in input order
        for tokens, n in shared:
            if room <= 1:
                break
            prefix.append(tokens)
            rows.append(min(n, room))
            room -= rows[-1]
        splits = prefix_splits(count, self.geometry.num_kv_heads, max_blocks_per_row, self.device)
        return count if shared_prefix_pays(prefix, rows, self.geometry, prefix_splits=splits) else 0

    def paged_layout(self, lengths: Sequence[int], budgets: Sequence[int], bursts: int = 1, *,
                     groups: Sequence[int] | None = None) -> PagedLayout:
        """The paged layout (``kv.sizing.paged_layout``) of a call over rows of ``lengths`` and
        ``budgets`` (``groups``: each row's shared-prefill group, whose rows share their prompt's full
        blocks with ``share_prompt_blocks``). Within one call the route's pricing and the layout ask
        the same question: the answer is kept for the call (its worst-case replay is tens of ms for
        hundreds of rows)."""
        if not self.config.share_prompt_blocks:
            groups = None
        key = (tuple(lengths), tuple(budgets), bursts, None if groups is None else tuple(groups))
        if self._layout_memo is not None and self._layout_memo[0] == key:
            return self._layout_memo[1]
        cfg = self.config
        layout = paged_layout(lengths, budgets, bursts=bursts, block_size=cfg.kv_block_size,
                              kv_bytes_per_token=self.pool_bytes_per_token, budget_bytes=self.kv_budget_bytes,
                              kv_cache_tokens=cfg.kv_cache_tokens, num_slots=cfg.continuous_batch_size,
                              refill_rows=cfg.refill_rows_for,
                              budget_name=f"gpu_memory_fraction={cfg.gpu_memory_fraction}", groups=groups)
        self._layout_memo = (key, layout)
        return layout


def _segments(continued: Continuation | None, num_tokens: int, call_index: int) -> tuple[tuple[int, int], ...]:
    """A row's (call index, tokens) runs: a continuation's earlier ones, then this call's tokens."""
    earlier = () if continued is None else continued.segments
    made = num_tokens - (0 if continued is None else continued.num_steps)
    return earlier + ((call_index, made),) if made > 0 else earlier


def _plan_of_requests(plan: BucketPlan, request_of: Sequence[int]) -> BucketPlan:
    """A plan over rows restated over request indices (``request_of``: each row's request)."""
    buckets = tuple(tuple(request_of[r] for r in bucket) for bucket in plan.buckets)
    chunks = tuple((request_of[r], widths) for r, widths in plan.chunks)
    return dataclasses.replace(plan, buckets=buckets, chunks=chunks)
