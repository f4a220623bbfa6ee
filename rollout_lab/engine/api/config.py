"""How to run a rollout: ``RolloutConfig`` (checked whole in ``__post_init__``) and the names of the
routes, decode modes and attention kinds it chooses among."""
from __future__ import annotations

import os
from dataclasses import dataclass


from rollout_lab.engine.kernels.paged import BLOCK_SIZES
from rollout_lab.engine.kernels.shared_prefix import SHARED_PREFIX_ATTENTIONS
from rollout_lab.engine.kv.paged import KV_DTYPES
from rollout_lab.engine.runner.steppers import DECODE_ATTENTIONS, DECODE_MODES
from rollout_lab.engine.sched.progress import check_progress
from rollout_lab.planner.checks import MAX_INT, as_int, check_int, is_int
from rollout_lab.planner.cost import CostCoefficients, CostFile
from rollout_lab.planner.decode_steps import check_prior_settings
from rollout_lab.planner.shape_classes import ShapeClasses
from rollout_lab.planner.fit import check_window

# The routes, in the order tables and figures show them: those a user can force, then Auto's choice.
MANUAL_ROUTES = ("nocb", "equal_width", "aligned", "bucketed", "packed", "paged")
CB_ROUTES = MANUAL_ROUTES[1:]  # continuous batching: the aligned cache, or the paged one (engine.kv.paged)
MODES = MANUAL_ROUTES + ("auto",)
# decode_widths at most: the windows are rounded to 16 columns, so past capacity / 16 they coincide
# (4096 covers a 64K-token capacity), and the ladder is built by a loop over them
MAX_DECODE_WIDTHS = 4096
# eos_check_interval: "auto" with a captured decode step, and the most a user may give. At 8, a row
# ending at EOS computes 3.5 discarded steps on average; with the long tail's 128 slots and ~0.4 rows
# ending a step that is ~1% of the row-steps, against a host read after every step with the GPU idle
# meanwhile (data/results/long_tail_qwen2.5-0.5b_bfloat16_cuda_decode-by-rows.json, paged_128_eos_every_step)
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
    # (engine.runner.disk_cache), elsewhere the reference's; "reference": the reference's (CostCoefficients())
    costs: CostCoefficients | CostFile | str = "auto"
    override_costs: bool = False
    eos_token_id: int | list[int] | None = None  # None: the model's
    ignore_eos: bool = False  # True: no EOS stops a row (benchmarks)
    pad_token_id: int | None = None  # None: the model's, else the first EOS, else 0
    repetition_penalty: float = 1.0
    cache_capacity: int | None = None  # columns; None = longest prompt + max_new_tokens
    trim_cache: bool = False
    profile: bool = False
    # a tqdm bar on calls longer than sched.progress.DELAY_S: True, False, or None (auto) where a
    # person watches (stderr a terminal, or a Jupyter kernel) and CI is not set; generate(progress=) overrides
    progress: bool | None = None
    decode: str = "auto"  # "graph" (CUDA-graph replay), "eager", or "auto": graph on CUDA
    max_decode_graphs: int = 24  # graph decode: row counts captured (1 = one graph over every slot)
    decode_widths: int = 8  # masked attention: windows over the capacity (1 = always the whole capacity)
    decode_attention: str = "auto"  # "span", "masked" or "auto" (DECODE_ATTENTIONS)
    # torch.compile the graph-captured decode step and prefill graphs: "layers" each decoder layer
    # (one trace for all of them, engine.runner.compiling), True the whole model (a far longer first compile),
    # "auto" the layers where the model has a decoder-layer list, else the whole model; False to debug
    compile: bool | str = "auto"
    # the decode step's q/k/v and gate/up projections as one matmul each, over a stacked copy of their
    # weights refreshed at every call (engine.runner.fusing): "auto" for the graph-captured step when the
    # copy is at most FUSE_MEMORY_FRACTION of the device, True always (the eager step too), False
    # never ("auto": faster on the long tail and on nano-vllm's shape, the same bf16 logits: in
    # data/results/, long_tail_qwen2.5-0.5b_bfloat16_cuda_fused.json, rl_qwen3-0.6b_bfloat16_cuda_nano-paged-fused.json
    # and logits_qwen3-0.6b_bfloat16_cuda_paged-fused.json; paged_128_unfused and ours_unfused measure it off)
    fuse_projections: bool | str = "auto"
    # CUDA: load torch.compile's artifacts for this setting from the rollout cache before compiling,
    # and save them after a call that compiled (engine.runner.disk_cache); False leaves the disk alone
    compile_cache: bool = True
    # bucketed prefill at a bounded set of shapes (planner.shape_classes), planned and priced there;
    # "auto": on CUDA the standard ladder grown to each call's prompts and slots
    # (ShapeClasses.covering), elsewhere none; None: every bucket at its own shape
    prefill_classes: ShapeClasses | str | None = "auto"
    # CUDA: capture each class's prefill forward (engine.runner.prefill_graphs); "auto": wherever classes
    # run on CUDA, unless a cost file given as ``costs`` was calibrated without them
    prefill_graphs: bool | str = "auto"
    max_prefill_graphs: int = 32  # classes captured at most; past it a class runs eagerly
    share_prefill: bool = True  # prefill identical prompts (samples of a request) once per admission
    # the paged route: the samples of a prompt prefilled together read its full KV blocks (reference
    # counts) instead of each holding a copy, so the pool holds a prompt once and more rows run at
    # once; each copies only the partial last block. False: a copy per sample (needs share_prefill)
    share_prompt_blocks: bool = True
    # the paged route: a prompt's full KV blocks stay in the pool after its rows finish (LRU, taken
    # back only when the pool has no free block), keyed by a hash chain of their tokens, and a later
    # call's prompt (the next epoch, the next turn) reads its longest cached chain and prefills only
    # the rest; dropped when the weights change (new tensors, or written in place) or the pool is
    # rebuilt. Needs mode "paged" or "auto" (which then takes paged)
    prefix_cache: bool = False
    # the paged route's decode attention over shared prompt blocks: "on" reads each group's shared blocks
    # once per step (engine.kernels.shared_prefix: the prefix once per group, each row's own suffix,
    # merged by log-sum-exp), "off" once per row (the plain paged read), "auto" "on" where its kernel
    # runs (CUDA with Triton) and planner.kv_reads.shared_prefix_pays says the call's groups save more
    # bytes than its partials and launches cost. "on" needs share_prompt_blocks and mode "paged" or
    # "auto" (which then takes paged)
    shared_prefix_attention: str = "auto"
    # every op of the forward gives a row the same bits whatever else is in the batch
    # (engine.kernels.batch_invariant): the decode step's logprobs (logprobs_mode "raw") are then
    # bit for bit those of the trainer's sequence_logprobs(..., batch_invariant=True), in any
    # micro-batch, and a row's tokens do not depend on the slots. Needs the Triton kernels (CUDA, or
    # TRITON_INTERPRET=1 on CPU), mode "paged" or "auto" (which then takes paged), and no compiled
    # graphs: compile and prefill_graphs "auto" are off under it
    batch_invariant: bool = False
    # EOS-aware decode (planner.decode_steps): recent response lengths; with prior_ewma the
    # Rollout folds each call's lengths into an EWMA histogram used by the next call's route choice
    response_length_prior: tuple[int, ...] | None = None
    prior_ewma: float | None = None
    # refit the coefficients from every call's forwards (planner.fit); state on the Rollout
    online_recalibration: bool = False
    online_window: int = 256  # observations kept (a ring buffer)
    # the paged route (engine.kv.paged): tokens per KV block (a power of two in 16..128); the
    # pool's size in tokens (None: on CUDA what gpu_memory_fraction of the device leaves after the
    # weights and a reserve, capped at what the call's rows could use at once; elsewhere that cap);
    # rows admitted together at least (None: slots // 16, at least 1; fewer when the queue is shorter)
    kv_block_size: int = 64
    # what the paged pool stores (engine.kv.paged.KV_DTYPES): "auto" the model's dtype; "fp8" e4m3
    # with a scale per token and KV head (engine.kernels.kv_fp8): half the KV bytes a decode step
    # reads and twice the tokens the pool holds, at a logprob mismatch against the model's dtype
    # (lossy: not for users who need exact logprobs; batch_invariant refuses it)
    kv_cache_dtype: str = "auto"
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
        check_progress(self.progress)
        check_window(self.online_window)
        for name in ("trim_cache", "profile", "share_prefill", "share_prompt_blocks", "prefix_cache",
                     "online_recalibration", "override_costs", "compile_cache", "batch_invariant"):
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
        if self.prefix_cache:
            self.check_paged_route("prefix_cache keeps prompts' blocks in the paged pool across calls")
        if self.shared_prefix_attention not in SHARED_PREFIX_ATTENTIONS:
            raise ValueError(f"shared_prefix_attention must be one of {list(SHARED_PREFIX_ATTENTIONS)}, "
                             f"got {self.shared_prefix_attention!r}")
        if self.shared_prefix_attention == "on":
            if not self.share_prompt_blocks:
                raise ValueError("shared_prefix_attention='on' reads the prompt blocks a prompt's samples share, "
                                 "and share_prompt_blocks=False gives each sample a copy: turn "
                                 "share_prompt_blocks on, or shared_prefix_attention to 'auto' or 'off'")
            self.check_paged_route("shared_prefix_attention='on' reads the paged pool's shared blocks")
        if self.kv_cache_dtype not in KV_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {list(KV_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.kv_cache_dtype == "fp8":
            self.check_paged_route("kv_cache_dtype='fp8' quantizes the paged pool")
            if self.batch_invariant:
                raise ValueError("batch_invariant=True gives the trainer's exact logprobs and kv_cache_dtype='fp8' "
                                 "rounds the KV: use kv_cache_dtype='auto' with batch_invariant")
            if self.shared_prefix_attention == "on":
                raise ValueError("kv_cache_dtype='fp8' pools are read row by row: shared_prefix_attention='on' "
                                 "must be 'auto' or 'off'")
        if self.batch_invariant:
            self.check_paged_route("batch_invariant=True serves the paged route's decode step")
            for name in ("compile", "prefill_graphs"):
                if getattr(self, name) not in ("auto", False):
                    raise ValueError(f"batch_invariant=True runs its own kernels, which compiled graphs would replace: "
                                     f"{name}={getattr(self, name)!r} must be 'auto' or False")
            if self.shared_prefix_attention == "on":
                raise ValueError("batch_invariant=True reads each row's blocks with the invariant kernel: "
                                 "shared_prefix_attention='on' must be 'auto' or 'off'")
        if self.mode == "paged" and (self.cache_capacity is not None or self.trim_cache):
            raise ValueError(
                "mode='paged' keeps each row in its own blocks: cache_capacity and trim_cache set the "
                "aligned cache; size the paged pool with kv_cache_tokens or gpu_memory_fraction")

    def check_paged_route(self, what: str) -> None:
        """A ValueError saying ``what`` needs the paged route when the mode or the aligned cache's
        settings rule it out: the one check of every paged-only feature (the prefix cache, the shared
        read, batch invariance, and a call's partial rollouts and episodes)."""
        if self.mode not in ("paged", "auto") or self.cache_capacity is not None or self.trim_cache:
            raise ValueError(f"{what}; mode={self.mode!r}" + (", cache_capacity" if self.cache_capacity is not None else "")
                             + (", trim_cache" if self.trim_cache else "") + " rule the paged route out: use "
                             "mode='paged' or 'auto' (which then takes paged), without the aligned cache's "
                             "cache_capacity and trim_cache")

    @property
    def eos_token_ids(self) -> tuple[int, ...] | None:
        """The explicit EOS ids: () with ``ignore_eos``, None when the model's apply."""
        if self.ignore_eos:
            return ()
        eos = self.eos_token_id
        if eos is None:
            return None
        return tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
