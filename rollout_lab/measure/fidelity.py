"""Teacher-forced logits: does our decode step compute the model's logits, whatever the dtype?

On random weights in bf16 the logits are nearly flat, so any change of kernel flips an argmax
somewhere and token match rates say nothing (DESIGN.md). Instead, feed both sides the same tokens
and compare each step's logits:

- the reference is one plain forward of the model (its own attention, no cache) over each prompt
  followed by the forced tokens, one request at a time, so no padding enters;
- ours prefills the prompts as the engine does, then runs the decode stepper of ``config`` (graph,
  compiled, span attention, the paged cache with ``mode="paged"``: whatever the config resolves to
  on this device) with the forced token
  written into each row before every step, and reads the step's logits.

    report = teacher_forced_check(model, prompts, forced, RolloutConfig())
    report["max_abs_error"], report["top1_agreement"]

``top1_agreement`` counts only the positions where the reference's top-2 margin exceeds the step's
error there: where the margin is smaller, either argmax is right within the error.

``run_logits_check`` makes it a record (kind "teacher_forced_logits"): random-token prompts of
lengths uniform in ``[min_len, max_len]``, forced with the oracle's tokens (HF ``generate``, greedy,
EOS ignored, one request at a time), one report per variant of ``measure.paths.DECODE_VARIANTS``.
``rollout-lab bench logits`` is its command line (``--preset qwen3-0.6b --out
data/results/fidelity_qwen3-0.6b_bfloat16_cuda`` on the H200; ``--tiny qwen3 --num-seqs 4 --min-len 4
--max-len 20 --steps 6`` is a CPU check in seconds).
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch
from transformers import GenerationConfig

from rollout_lab.engine.api.config import RolloutConfig
from rollout_lab.engine.runner.prefill import cache_kwarg_name, prefill_bucket
from rollout_lab.engine.api.rollout import Rollout
from rollout_lab.engine.limits import LOGIT_BYTES, ModelLimits
from rollout_lab.engine.runner.steppers import StepperKey, graph_capacity, make_stepper
from rollout_lab.measure.models import load_model, model_config, special_token_ids
from rollout_lab.measure.provenance import provenance
from rollout_lab.measure.paths import DECODE_VARIANTS, LEVER_VARIANTS, release_memory
from rollout_lab.measure.records import read_record, shape_settings
from rollout_lab.measure.workloads import lengths_to_prompts, uniform_workload
from rollout_lab.planner.checks import is_int
from rollout_lab.workspace import Workspace, record_paths, run_tag, write_record

CACHES = ("aligned", "paged")  # the KV cache the decode step reads: the aligned one, or the paged route's
# run_logits_check's settings and their defaults (its signature's)
LOGITS_DEFAULTS: dict[str, Any] = {"num_seqs": 16, "min_len": 100, "max_len": 1024, "steps": 64,
                                   "variants": LEVER_VARIANTS, "cache": "aligned"}
# the paged pool in the model's dtype and in e4m3 (RolloutConfig(kv_cache_dtype=...)): notebook 03's
# "Half the KV bytes" compares them, its fp8_kv_shape taking these settings of run_logits_check
KV_DTYPE_VARIANTS = ("ours_paged", "ours_fp8_kv")
KV_DTYPE_DEFAULTS: dict[str, Any] = {"num_seqs": 4, "min_len": 8, "max_len": 40, "steps": 8}


@torch.no_grad()
def reference_logits(model: torch.nn.Module, prompts: Sequence[Sequence[int]],
                     forced: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """Per request, fp32 ``[len(forced), vocab]``: the logits that predict each forced token."""
    device = next(model.parameters()).device
    out = []
    for prompt, tokens in zip(prompts, forced):
        ids = torch.tensor([list(prompt) + list(tokens[:-1])], device=device)
        logits = model(input_ids=ids, use_cache=False).logits[0].float()  # [len, vocab]
        out.append(logits[len(prompt) - 1:])
    return out


@torch.no_grad()
def stepper_logits(model: torch.nn.Module, prompts: Sequence[Sequence[int]],
                   forced: Sequence[Sequence[int]], config: RolloutConfig) -> tuple[list[torch.Tensor], dict]:
    """Per request, fp32 ``[len(forced), vocab]`` from our prefill and decode step; and the stepper's
    description. Every request is forced for the same number of tokens."""
    steps = {len(t) for t in forced}
    if len(steps) != 1 or len(prompts) != len(forced):
        raise ValueError("teacher forcing needs one forced sequence per prompt, all of the same length")
    num_forced = steps.pop()
    rollout = Rollout(model, config)  # resolves the decode mode, span attention and compile
    rows = len(prompts)
    longest = max(len(p) for p in prompts)
    capacity = longest + num_forced
    if rollout.runner.decode_mode == "graph":
        capacity = graph_capacity(capacity)
    paged = config.mode == "paged"  # the paged cache (engine.kv.paged): every row in its own blocks
    size = config.kv_block_size
    num_blocks = 1 + sum(-(-(len(p) + num_forced) // size) for p in prompts) if paged else 0
    key = StepperKey(rows, capacity, rollout.runner.cache_kwarg,
                     max_graphs=config.max_decode_graphs if rollout.runner.decode_mode == "graph" else 1,
                     num_widths=config.decode_widths, spans=rollout.runner.spans, compiled=rollout.runner.compiled,
                     fused=rollout.runner.fused, keep_logits=True, block_size=size if paged else None, num_blocks=num_blocks,
                     kv_dtype=config.kv_cache_dtype if paged else "auto")
    stepper = make_stepper(model, key, decode=rollout.runner.decode_mode)
    try:
        stepper.reset()
        cache, state = stepper.cache, stepper.state
        pad = model.config.get_text_config(decoder=True).pad_token_id or 0
        first, layer_kv = prefill_bucket(model, prompts, pad_token_id=pad, cache_kwarg=cache_kwarg_name(model))
        slots = list(range(rows))
        if paged:
            for slot, prompt in zip(slots, prompts):
                cache.grow(slot, len(prompt) + num_forced)
        else:
            cache.set_front(longest)
        cache.admit(slots, layer_kv, [len(p) for p in prompts])
        device = first.device
        forced_t = torch.tensor([list(t) for t in forced], dtype=torch.long, device=device)  # [rows, steps]
        state.admit(slots, forced_t[:, 0], [len(p) for p in prompts])
        logits = [first.float()]  # [rows, vocab] per step
        for step in range(1, num_forced):
            if paged:
                stepper.step(rows, 0)  # each row writes at its own position
            else:
                stepper.step(rows, cache.front_int)
                cache.front_int += 1  # the step advanced the device front
            logits.append(state.logits[:rows].clone())
            state.input_ids[:rows, 0].copy_(forced_t[:, step])  # force the next input
        info = {"kind": stepper.kind, "spans": key.spans, "compiled": key.compiled,
                "build_ms": stepper.build_ms, "paged": paged, "kv_dtype": key.kv_dtype}
    finally:
        stepper.close()
    stacked = torch.stack(logits, dim=1)  # [rows, steps, vocab]
    return [stacked[r] for r in range(rows)], info


def teacher_forced_check(model: torch.nn.Module, prompts: Sequence[Sequence[int]],
                         forced: Sequence[Sequence[int]], config: RolloutConfig | None = None) -> dict[str, Any]:
    """Our step's logits against the reference's, position by position (see the module doc)."""
    config = config or RolloutConfig()
    ours, info = stepper_logits(model, prompts, forced, config)
    theirs = reference_logits(model, prompts, forced)
    errors, agree, decided, logprob_gaps = [], 0, 0, []
    per_step: list[float] = [0.0] * len(forced[0])
    for a, b, tokens in zip(ours, theirs, forced):
        err = (a - b.to(a.device)).abs().amax(dim=-1)  # [steps]
        # the log-probability of each forced token (the model's next one), ours against the reference
        index = torch.tensor(list(tokens), device=a.device)[:, None]
        gap = a.log_softmax(-1).gather(1, index) - b.to(a.device).log_softmax(-1).gather(1, index)
        logprob_gaps.append(gap.abs().flatten())
        top2 = b.topk(2, dim=-1).values
        margin = top2[:, 0] - top2[:, 1]
        clear = margin > err.to(margin.device)
        agree += int((a.argmax(-1).to(b.device) == b.argmax(-1))[clear].sum())
        decided += int(clear.sum())
        errors.append(float(err.max()))
        per_step = [max(x, float(e)) for x, e in zip(per_step, err)]
    gaps = torch.cat(logprob_gaps)
    return {
        "max_abs_error": max(errors), "per_step_max_abs_error": per_step,
        "max_logprob_error": float(gaps.max()), "mean_logprob_error": float(gaps.mean()),
        "top1_agreement": agree / decided if decided else None, "num_decided": decided,
        "num_positions": sum(len(t) for t in forced), "stepper": info,
    }


def check_logits_settings(*, num_seqs: int, min_len: int, max_len: int, steps: int, variants: Sequence[str],
                          cache: str, limits: ModelLimits | None = None) -> None:
    """ValueError naming the first bad setting of ``run_logits_check`` and what would be valid; with
    ``limits`` (the model's) the longest prompt and its forced steps within the context, the prompts
    within the host's memory, and every row's KV cache and fp32 logits (ours and the reference's)
    within the device's."""
    for name, value in (("num_seqs", num_seqs), ("min_len", min_len), ("max_len", max_len), ("steps", steps)):
        if not is_int(value) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if max_len < min_len:
        raise ValueError(f"max_len {max_len} is below min_len {min_len}")
    unknown = [v for v in variants if v not in DECODE_VARIANTS]
    if unknown or not variants:
        raise ValueError(f"unknown decode variants {unknown or '(none given)'}; valid: {', '.join(DECODE_VARIANTS)}")
    if cache not in CACHES:
        raise ValueError(f"cache must be one of {list(CACHES)}, got {cache!r}")
    if limits is None:
        return
    positions = max_len + steps
    name, value, other = ("steps", steps, max_len) if steps >= max_len else ("max_len", max_len, steps)
    limits.check_context(name, value, positions=positions, what=f"a prompt of max_len {max_len} and {steps} forced steps",
                         most=None if limits.max_positions is None else limits.max_positions - other)
    row_bytes = positions * limits.kv_bytes_per_token + 2 * steps * limits.vocab_size * LOGIT_BYTES
    limits.check_memory("num_seqs", num_seqs, unit_bytes=row_bytes, unit="rows",
                        what=f"the KV cache ({positions} positions) and fp32 logits ({steps} steps x "
                             f"{limits.vocab_size} ids, ours and the reference's) of {num_seqs} rows")
    limits.check_host_tokens("num_seqs", num_seqs, rows=num_seqs, tokens_per_row=positions)


@torch.no_grad()
def oracle_tokens(model: torch.nn.Module, prompts: Sequence[Sequence[int]], steps: int) -> list[list[int]]:
    """The ``steps`` tokens HF ``generate`` picks after each prompt (greedy, EOS ignored, unpadded)."""
    device = next(model.parameters()).device
    config = GenerationConfig(max_new_tokens=steps, min_new_tokens=steps, do_sample=False, eos_token_id=None,
                              pad_token_id=0)
    return [model.generate(torch.tensor([p], device=device), generation_config=config)[0, len(p):].tolist()
            for p in prompts]


def run_logits_check(
    model: torch.nn.Module, *, model_name: str, dtype: str, num_seqs: int = 16, min_len: int = 100,
    max_len: int = 1024, steps: int = 64, variants: Sequence[str] = LEVER_VARIANTS, cache: str = "aligned",
    save: Callable[[dict[str, Any]], Any] = lambda record: None, **prov: Any,
) -> dict[str, Any]:
    """``teacher_forced_check`` of every variant of ``variants`` on ``model`` (built, on its device)
    reading the ``cache`` KV cache; the record (kind "teacher_forced_logits"). ``save(record)`` runs
    after each variant; ``prov`` adds to its provenance (the command and its argv)."""
    variants = list(variants)
    check_logits_settings(num_seqs=num_seqs, min_len=min_len, max_len=max_len, steps=steps, variants=variants,
                          cache=cache, limits=ModelLimits.of_model(model))
    model.generation_config = GenerationConfig()  # nothing from the model's defaults (EOS) stops the oracle
    cfg = model.config.get_text_config(decoder=True)
    vocab = model.get_input_embeddings().weight.shape[0]
    lengths, _ = uniform_workload(num_seqs, low=min_len, high=max_len, seed=0)
    prompts = lengths_to_prompts(lengths, vocab_size=vocab, seed=0, special_ids=special_token_ids(cfg))
    forced = oracle_tokens(model, prompts, steps)
    device = next(model.parameters()).device
    record: dict[str, Any] = {
        "kind": "teacher_forced_logits",
        "provenance": provenance(device=device, dtype=dtype, **prov),
        "config": {"model": model_name, "lengths": lengths, "steps": steps, "cache": cache}, "variants": {},
    }
    for variant in variants:
        settings = DECODE_VARIANTS[variant] | ({"mode": "paged"} if cache == "paged" else {})
        if cache == "paged" and "decode_attention" in settings:
            settings = {k: v for k, v in settings.items() if k not in ("decode_attention", "decode_widths")}
        report = teacher_forced_check(model, prompts, forced, RolloutConfig(**settings))
        record["variants"][variant] = report | {"settings": settings}
        print(f"{variant:16s} max |err| {report['max_abs_error']:.4g}  top-1 {report['top1_agreement']}  "
              f"|dlogp| mean {report['mean_logprob_error']:.3g} max {report['max_logprob_error']:.3g}",
              file=sys.stderr)
        save(record)
    return record


def logits_rows(record: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One row per variant of a teacher-forced logits record: the largest error, the top-1
    agreement where decided, and the stepper that ran."""
    cache = record["config"]["cache"]
    return [{"variant": variant, "cache": cache, "max_abs_error": r["max_abs_error"],
             "top1_agreement": r["top1_agreement"], "num_decided": r["num_decided"],
             "max_logprob_error": r.get("max_logprob_error"), "mean_logprob_error": r.get("mean_logprob_error"),
             "kv_dtype": r["stepper"].get("kv_dtype", "auto"),
             "num_positions": r["num_positions"], "spans": r["stepper"]["spans"],
             "compiled": r["stepper"]["compiled"], "kind": r["stepper"]["kind"]}
            for variant, r in record["variants"].items()]


def kv_dtype_or_load(
    *, fp8_kv_shape: Mapping[str, Any] | None, fp8_kv_results_files: Sequence[str] | None, model: str, dtype: str,
    device: str, output_dir: Any = None,
) -> list[tuple[str, dict[str, Any]]]:
    """The (name, record) pairs notebook 03's "Half the KV bytes" shows: ``fp8_kv_shape``
    (``KV_DTYPE_DEFAULTS`` where it says nothing) measured on ``model`` by ``run_logits_check`` with
    ``KV_DTYPE_VARIANTS`` into ``<workspace>/data/results/logits_<model>_<dtype>_<device>_kv-dtypes``
    (an existing record there is an error), else the saved ``fp8_kv_results_files`` (teacher-forced
    logits records and RL throughput records, ``bench logits`` and ``bench rl --paths ours_paged
    ours_fp8_kv``), else []. Giving both is an error; so are bad settings, a record in the way and a
    file of another kind, all raised before the model is built."""
    if fp8_kv_shape is not None and fp8_kv_results_files is not None:
        raise ValueError("give fp8_kv_shape (measure) or fp8_kv_results_files (render), not both")
    if fp8_kv_shape is None:
        files = [fp8_kv_results_files] if isinstance(fp8_kv_results_files, (str, Path)) else fp8_kv_results_files
        # bench logits (--variants ours_paged ours_fp8_kv) and bench rl (--paths ours_paged ours_fp8_kv) records
        return [(str(f), read_record(Path(f), ("teacher_forced_logits", "rl_throughput"))) for f in files or []]
    shape = shape_settings("fp8_kv_shape", fp8_kv_shape, KV_DTYPE_DEFAULTS)
    config, name = model_config(model)
    check_logits_settings(**shape, variants=KV_DTYPE_VARIANTS, cache="paged",
                          limits=ModelLimits.of_config(config, dtype=dtype, device=device))
    out = record_paths(Workspace.resolve(output_dir).results / f"logits_{run_tag(name, dtype, device)}_kv-dtypes")
    net, name = load_model(model, dtype=dtype, device=device)
    record = run_logits_check(net, model_name=name, dtype=dtype, variants=KV_DTYPE_VARIANTS, cache="paged",
                              script="notebook 03 (fp8_kv_shape)",
                              save=lambda r: write_record(out, r, logits_rows(r)), **shape)
    del net
    release_memory(torch.device(device))
    return [(str(out[0]), record)]


def kv_dtype_rows(records: Sequence[tuple[str, Mapping[str, Any]]]) -> list[dict[str, Any]]:
    """One row per variant of the records (teacher-forced logits: its logit and logprob errors; RL
    throughput: its output tok/s), joined by variant name, each with the KV dtype it stored and the card."""
    rows: dict[str, dict[str, Any]] = {}
    for _, record in records:
        card = (record.get("provenance") or {}).get("device_name")
        if record["kind"] == "teacher_forced_logits":
            for variant, r in record["variants"].items():
                rows.setdefault(variant, {"variant": variant}).update(
                    kv_dtype=r["stepper"].get("kv_dtype", "auto"), card=card, max_logit_error=r["max_abs_error"],
                    mean_logprob_error=r.get("mean_logprob_error"), max_logprob_error=r.get("max_logprob_error"))
        else:
            for path, r in record["results"].items():
                if "output_tokens_per_s" not in r:
                    continue
                row = rows.setdefault(path, {"variant": path})
                row.setdefault("kv_dtype", (r.get("stepper") or {}).get("kv_dtype", "auto"))
                row.update(card=card, output_tokens_per_s=r["output_tokens_per_s"])
    return list(rows.values())
