"""Batch invariance of a whole forward: every op a model runs gives a row the same bits whatever else
is in the batch, so the decode step's logprobs are the trainer's forward's.

``batch_invariant(model)`` is the one door. Inside it:

- the model attends with ``rollout_invariant`` (``invariant_attention_forward``): a prefill or a
  teacher-forced forward with ``engine.kernels.invariant.invariant_attention``, a paged decode step
  with ``invariant_paged_attention``; both walk a row's keys in the same 16-position blocks from its
  logical position 0, so a token's attention is the same bits whether its keys were seen in one
  forward or one step at a time;
- Llama's, Mistral's and Qwen's RMSNorm modules (``RMS_NORMS``) run ``invariant_rms_norm``, one kernel
  instead of eight, and their modeling modules' ``apply_rotary_pos_emb`` (looked up by their attention
  at each call) runs ``invariant_rope``, one kernel for the queries and one for the keys instead of
  ten (another model's norm and rotary embedding go through the mode, op by op);
- a ``TorchDispatchMode`` (``InvariantOps``) sees every aten op below autograd. Matmuls (``mm``,
  ``addmm``, ``bmm``) go to ``invariant_matmul``'s one tile configuration, a mean over the last
  dimension (RMSNorm's) to ``invariant_row_mean``, ``logsumexp`` and the log-softmax over the last
  dimension to the trainer's row kernel (``engine.kernels.token_logprobs``). Element-wise ops, data
  movement and order-free reductions (max, argmax, sort, integer sums) pass as they are; any other
  floating-point reduction, attention or normalisation is a ValueError naming the op: nothing falls
  back silently to a batch-dependent kernel.

``addmm`` is computed as the matmul rounded to the output dtype, then the bias added, which is what
``linear`` gives by either of its aten paths (``addmm``, or ``mm`` then ``add``), so a layer's bits
do not depend on which path a shape takes. The backward of a forward run inside is autograd's as
usual (the mode sits below autograd): the trainer's backward may use any kernel.

    with batch_invariant(model):
        logits = model(input_ids).logits    # each row's bits as if it were alone

Needs the Triton kernels (CUDA, or ``TRITON_INTERPRET=1`` on CPU): ``check_invariant_model`` says
what a model lacks before any work. Compiled graphs (``torch.compile``) cannot run under the mode:
the engine turns compilation and prefill graphs off with ``RolloutConfig(batch_invariant=True)``.

"""
from __future__ import annotations

import weakref
from contextlib import contextmanager
from typing import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes, _get_current_dispatch_mode_stack
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.models.llama import modeling_llama
from transformers.models.mistral import modeling_mistral
from transformers.models.qwen2 import modeling_qwen2
from transformers.models.qwen3 import modeling_qwen3

from rollout_lab.engine.kernels.attention import INVARIANT_NAME, POOL_LAYOUTS, decode_layout
from rollout_lab.engine.kernels.available import kernel_available
from rollout_lab.engine.kernels.invariant import (
    invariant_attention,
    invariant_bmm,
    invariant_matmul,
    invariant_paged_attention,
    invariant_rms_norm,
    invariant_rope,
    invariant_row_mean,
    rope_supported,
)
from rollout_lab.engine.kernels.token_logprobs import row_logprobs

aten = torch.ops.aten

# Reductions whose result does not depend on the order they are taken in (no rounding): they pass.
ORDER_FREE = {"max", "min", "amax", "amin", "argmax", "argmin", "aminmax", "any", "all", "topk", "sort",
              "argsort", "kthvalue", "median", "mode", "_local_scalar_dense", "equal"}
# Ops that add up floating-point numbers in a batch-dependent order and are not covered: a ValueError.
UNCOVERED = {"baddbmm", "addbmm", "addmv", "mv", "dot", "vdot", "addr", "_addmm_activation", "convolution",
             "_convolution", "cudnn_convolution", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
             "_scaled_dot_product_flash_attention_for_cpu", "_flash_attention_forward",
             "_efficient_attention_forward", "native_layer_norm", "native_group_norm", "native_batch_norm",
             "_native_batch_norm_legit", "_native_batch_norm_legit_no_training", "_fused_rms_norm", "cumsum",
             "cumprod", "logcumsumexp", "_cdist_forward", "embedding_bag", "_embedding_bag", "nll_loss_forward",
             "nll_loss2d_forward", "_fft_r2c", "_fft_c2c", "histc", "bincount"}
_active = False


# The modeling modules whose attention calls their global ``apply_rotary_pos_emb`` (HF's: q * cos +
# rotate_half(q) * sin, ``invariant.rope_reference``), and their RMSNorm modules, whose forward is
# ``invariant.rms_norm_reference`` (x * rsqrt(mean(x^2) + eps) in fp32, rounded to x's dtype, times the
# weight; Gemma's 1 + weight is not among them)
ROPE_MODULES = (modeling_llama, modeling_mistral, modeling_qwen2, modeling_qwen3)
RMS_NORMS = (modeling_llama.LlamaRMSNorm, modeling_mistral.MistralRMSNorm, modeling_qwen2.Qwen2RMSNorm,
             modeling_qwen3.Qwen3RMSNorm)


def _rope_function(original):
    """``apply_rotary_pos_emb`` by ``invariant_rope`` where it takes the inputs, else ``original``."""
    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1, **kwargs):
        if unsqueeze_dim == 1 and not kwargs and rope_supported(q, k, cos, sin):
            return invariant_rope(q, k, cos, sin)
        return original(q, k, cos, sin, unsqueeze_dim, **kwargs)
    apply_rotary_pos_emb.original = original
    return apply_rotary_pos_emb


def _norm_forward(module: torch.nn.Module):
    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        return invariant_rms_norm(hidden_states, module.weight, module.variance_epsilon)
    return forward


def active() -> bool:
    """Whether a ``batch_invariant`` block is running."""
    return _active


def _floating(args, kwargs) -> bool:
    """Whether any tensor among an op's arguments holds floating-point numbers."""
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    tensors += [t for a in args if isinstance(a, (list, tuple)) for t in a if isinstance(t, torch.Tensor)]
    return any(t.is_floating_point() or t.is_complex() for t in tensors)


def _last_dim(x: torch.Tensor, dim) -> bool:
    """Whether ``dim`` (an int or a one-element list) is ``x``'s last dimension."""
    dims = [dim] if isinstance(dim, int) else list(dim or [])
    return len(dims) == 1 and dims[0] % max(x.dim(), 1) == x.dim() - 1


def _mean(x, dim=None, keepdim=False, *, dtype=None):
    if dtype is not None:
        x = x.to(dtype)
    if not _last_dim(x, dim):
        raise ValueError(f"batch_invariant covers a mean over the last dimension only (RMSNorm's), got dim={dim} "
                         f"of a {tuple(x.shape)} tensor")
    out = invariant_row_mean(x)
    return out if keepdim else out.squeeze(-1)


def _lse_rows(x: torch.Tensor, dim) -> torch.Tensor:
    """[..., 1] fp32 logsumexp of ``x`` over its last dimension, by the trainer's row kernel."""
    if not _last_dim(x, dim):
        raise ValueError(f"batch_invariant covers logsumexp and log-softmax over the last dimension only, got "
                         f"dim={dim} of a {tuple(x.shape)} tensor")
    rows = x.reshape(-1, x.shape[-1])
    targets = torch.zeros(rows.shape[0], dtype=torch.long, device=x.device)
    return row_logprobs(rows, targets)[1].reshape(*x.shape[:-1], 1)


def _logsumexp(x, dim, keepdim=False):
    out = _lse_rows(x, dim).to(x.dtype)
    return out if keepdim else out.squeeze(-1)


def _log_softmax(x, dim, half_to_float):
    out = x.float() - _lse_rows(x, dim)
    return out if half_to_float else out.to(x.dtype)


def _softmax(x, dim, half_to_float):
    out = torch.exp(x.float() - _lse_rows(x, dim))
    return out if half_to_float else out.to(x.dtype)


def _addmm(bias, a, b, *, beta=1, alpha=1):
    if beta != 1 or alpha != 1:
        raise ValueError(f"batch_invariant covers addmm with beta=1 and alpha=1 (a linear layer), got beta={beta}, "
                         f"alpha={alpha}")
    return invariant_matmul(a, b) + bias  # linear's bits whichever aten path it takes (module docstring)


COVERED = {
    aten.mm.default: invariant_matmul,
    aten.addmm.default: _addmm,
    aten.bmm.default: invariant_bmm,
    aten.mean.dim: _mean,
    aten.logsumexp.default: _logsumexp,
    aten._log_softmax.default: _log_softmax,
    aten._softmax.default: _softmax,
}


class InvariantOps(TorchDispatchMode):
    """Routes a forward's aten ops to the batch-invariant kernels (module docstring)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handler = COVERED.get(func)
        if handler is not None and _floating(args, kwargs):
            return handler(*args, **kwargs)
        name = func.overloadpacket.__name__
        if func.namespace == "rollout_lab" and "attention" in name:  # the batch-dependent decode kernels
            raise ValueError(f"batch_invariant: the decode kernel {func} ran inside the block; the invariant "
                             "attention (rollout_invariant) must serve every attention")
        if _floating(args, kwargs) and name not in ORDER_FREE and (
                name in UNCOVERED or torch.Tag.reduction in func.tags or handler is not None):
            raise ValueError(f"batch_invariant does not cover {func} (on {_shapes(args)}): its floating-point "
                             "sums could depend on the batch. Covered: matmuls (mm, addmm, bmm), a mean, "
                             "logsumexp, softmax or log-softmax over the last dimension, and the invariant "
                             "attention; models with RMSNorm and rotary attention (Qwen2, Qwen3, Llama)")
        return func(*args, **kwargs)


def _shapes(args) -> str:
    return ", ".join(f"{a.dtype} {tuple(a.shape)}" for a in args if isinstance(a, torch.Tensor)) or "no tensors"


def key_starts(attention_mask: torch.Tensor | None, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """[B] int64: the key column of each row's logical position 0 under HF's 4-D attention mask
    ``[B, 1, q, S]`` (bool, or additive float with 0 where attended), or zeros without one. A row's
    attended keys must be one run of columns from there to each query's own column (left padding,
    a causal mask, cached keys before the chunk); any other mask is a ValueError (checked once per
    mask tensor, outside CUDA-graph capture, where it would need a host sync)."""
    batch, _, q_len, _ = query.shape
    width = key.shape[2]
    if attention_mask is None:
        return torch.zeros(batch, dtype=torch.long, device=query.device)
    if attention_mask.dim() != 4 or attention_mask.shape[1] != 1 or attention_mask.shape[-1] < width:
        raise ValueError(f"batch_invariant: an attention mask of shape {tuple(attention_mask.shape)} for keys "
                         f"{tuple(key.shape)}; the invariant attention takes HF's [B, 1, q, S] mask")
    attended = attention_mask[..., :width]
    attended = attended if attended.dtype == torch.bool else attended == 0  # [B, 1, q, S]
    attended = attended.expand(batch, 1, q_len, width)
    starts = attended[:, 0, -1].to(torch.int8).argmax(-1)  # [B]: the first key the last query attends to
    _check_runs(attention_mask, attended, starts, q_len, width)
    return starts


_checked: tuple | None = None  # the last mask checked: (a weak reference to it, its version, the width)


def _check_runs(mask: torch.Tensor, attended: torch.Tensor, starts: torch.Tensor, q_len: int, width: int) -> None:
    """ValueError unless each query attends to exactly the columns from its row's start to itself
    (queries before the start, left padding, are not read). Every layer of a forward passes the same
    ``mask``: it is checked at the first."""
    global _checked
    if attended.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return
    if _checked is not None and _checked[0]() is mask and _checked[1:] == (mask._version, width):
        return
    cols = torch.arange(width, device=attended.device)
    own = cols[width - q_len:]  # [q]: each query's own column
    want = (cols[None, None, :] >= starts[:, None, None]) & (cols[None, None, :] <= own[None, :, None])  # [B, q, S]
    real = own[None, :] >= starts[:, None]  # [B, q]: queries past the left padding
    wrong = (attended[:, 0] != want) & real[:, :, None]
    if bool(wrong.any()):
        row = int(wrong.any(2).any(1).nonzero()[0, 0])
        raise ValueError(f"batch_invariant: row {row}'s attention mask is not one run of keys from its first "
                         "token to each query (padding inside a row, a window, or a non-causal mask); the "
                         "invariant attention covers left padding and causal masks only")
    _checked = (weakref.ref(mask), mask._version, width)


def invariant_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                                is_causal=None, **kwargs):
    """HF attention function ``rollout_invariant``: the paged decode step's pools through
    ``invariant_paged_attention``, any other forward through ``invariant_attention``."""
    layout, args = decode_layout(kwargs)
    if kwargs.get("packed_offsets") is not None:
        raise ValueError("batch_invariant does not cover a packed prefill (several prompts in one row): use "
                         "mode='paged' or a left-padded route")
    for name in ("softcap", "sliding_window", "position_bias"):
        if kwargs.get(name) is not None:
            raise ValueError(f"batch_invariant does not cover attention with {name}={kwargs[name]!r}")
    if dropout:
        raise ValueError(f"batch_invariant: attention dropout {dropout} draws a batch-dependent mask; run the "
                         "forward in eval mode (or with attention_dropout=0)")
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    if layout in POOL_LAYOUTS:  # the shared-prefix read is a speed-up of the same rows: each row reads its own
        return invariant_paged_attention(query, key, value, args[0], args[1], scale), None
    if layout is not None:
        raise ValueError(f"batch_invariant covers the paged route's decode step, not the {layout} decode of the "
                         "aligned cache: use mode='paged' (or 'auto')")
    return invariant_attention(query, key, value, key_starts(attention_mask, query, key), scale), None


def register() -> str:
    """Register ``rollout_invariant`` with transformers' attention and mask interfaces (idempotent)."""
    if INVARIANT_NAME not in AttentionInterface._global_mapping:
        AttentionInterface.register(INVARIANT_NAME, invariant_attention_forward)
        AttentionMaskInterface.register(INVARIANT_NAME, sdpa_mask)
    return INVARIANT_NAME


# Modules whose forward reduces across features with kernels the mode does not cover.
UNCOVERED_MODULES = (torch.nn.LayerNorm, torch.nn.GroupNorm, torch.nn.modules.batchnorm._BatchNorm,
                     torch.nn.modules.conv._ConvNd)


def check_invariant_model(model: torch.nn.Module) -> None:
    """ValueError naming what keeps ``model`` from a batch-invariant forward, before any work: no
    Triton kernels on its device, a normalisation the mode does not cover (LayerNorm: OPT, GPT-2), a
    sliding window or logit softcapping."""
    for path, module in model.named_modules():
        if isinstance(module, UNCOVERED_MODULES):
            raise ValueError(f"batch_invariant does not cover {type(model).__name__}'s {type(module).__name__} "
                             f"({path}); it covers models with RMSNorm and rotary attention (Qwen2, Qwen3, Llama)")
    config = model.config.get_text_config(decoder=True)
    windowed = getattr(config, "use_sliding_window", False) and getattr(config, "sliding_window", None)
    if windowed or "sliding_attention" in (getattr(config, "layer_types", None) or ()):
        raise ValueError(f"batch_invariant does not cover sliding-window attention "
                         f"(sliding_window={getattr(config, 'sliding_window', None)})")
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(config, name, None):
            raise ValueError(f"batch_invariant does not cover {name}={getattr(config, name)}")
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    if not kernel_available(device):
        raise ValueError(f"batch_invariant needs the Triton kernels: a CUDA device, or TRITON_INTERPRET=1 on CPU; "
                         f"the model is on {device}")


@contextmanager
def suspended() -> Iterator[None]:
    """Within a ``batch_invariant`` block, run ops as they are (no ``InvariantOps``), for code that is
    invariant by construction and that the mode would keep from compiling (a dispatch mode stops
    dynamo): ``engine.runner.compiling.compile_invariant_select``. The model keeps its attention.
    Outside an ``InvariantOps`` mode it changes nothing (another tool's modes stay)."""
    if not any(isinstance(mode, InvariantOps) for mode in _get_current_dispatch_mode_stack()):
        yield
        return
    with _disable_current_modes():
        yield


@contextmanager
def batch_invariant(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Within the block, ``model``'s forwards (and any op run there) are batch-invariant (module
    docstring); its attention is put back after. Nested blocks are one block."""
    global _active
    if _active:
        yield model
        return
    check_invariant_model(model)
    register()
    config = model.config
    previous = getattr(config, "_attn_implementation", None)
    config._attn_implementation = INVARIANT_NAME
    norms = [m for m in model.modules() if type(m) in RMS_NORMS and "forward" not in vars(m)]
    used = {type(m).__module__ for m in model.modules()}
    ropes = [m for m in ROPE_MODULES if m.__name__ in used and hasattr(m, "apply_rotary_pos_emb")]
    _active = True
    try:
        for module in norms:  # on the module objects: the decode step's fused copy shares them
            module.forward = _norm_forward(module)
        for module in ropes:  # the attention looks the function up in its module at each call
            module.apply_rotary_pos_emb = _rope_function(module.apply_rotary_pos_emb)
        with InvariantOps():
            yield model
    finally:
        _active = False
        config._attn_implementation = previous
        for module in norms:
            vars(module).pop("forward", None)
        for module in ropes:
            module.apply_rotary_pos_emb = module.apply_rotary_pos_emb.original
