"""The RL-regime throughput benchmark: nano-vllm's ``bench.py`` shape, with per-request budgets.

    from rollout_lab.measure.rl import NANO_VLLM_SHAPE, run_rl
    record = run_rl(model, model_name="qwen3-0.6b", dtype="bfloat16", **NANO_VLLM_SHAPE)

The workload (``measure.workloads.uniform_workload``): distinct random-token prompts whose lengths,
and whose output budgets, are drawn uniformly from ``[min_len, max_len]`` (seeded); EOS is ignored,
so every request generates exactly its budget and output tok/s counts those tokens only.

Paths (``RL_PATHS``; ``RL_DEFAULT_PATHS`` leave out the CUDA-only ``ours_compile_model``): ``ours`` (``Rollout.generate(prompts, max_new_tokens=budgets)`` in ``mode``;
one warm-up call, its compile and graph capture included, then ``reps`` timed calls and one profiled
call), the ablations of ``measure.paths.DECODE_VARIANTS`` that take the levers away one at a time,
and, last, HF ``generate_batch``'s manager with the same per-request budgets (``hf_generate_batch``).
Every call is timed whole with the device synchronised; peak memory is over the weights (cache and
graphs included). ``rollout-lab bench rl`` is its command line (``--preset qwen3-0.6b --out
data/results/rl_qwen3-0.6b_bfloat16_cuda`` on the H200: nano-vllm's shape; ``--tiny qwen2 --num-seqs 16
--min-len 8 --max-len 48`` is a CPU check in seconds); notebook 03 runs it with ``rl_shape``.
"""
from __future__ import annotations

import statistics
import sys
import time
from typing import Any, Callable, Mapping, Sequence

import torch
from transformers import GenerationConfig

from rollout_lab.engine.runner.compiling import compile_counts
from rollout_lab.engine.api.config import MODES, RolloutConfig
from rollout_lab.engine.profile import synchronize, timed_ms
from rollout_lab.engine.api.rollout import Rollout
from rollout_lab.engine.limits import ModelLimits, rows_at_once
from rollout_lab.measure.models import special_token_ids
from rollout_lab.measure.provenance import provenance
from rollout_lab.measure.paths import DECODE_VARIANTS, PAGED_VARIANTS, check_timed_calls, release_memory
from rollout_lab.measure.peers import cb_sizing
from rollout_lab.measure.trainer_loop import decode_captures
from rollout_lab.measure.workloads import lengths_to_prompts, uniform_workload
from rollout_lab.planner.checks import check_int, is_int

RL_PATHS = (*DECODE_VARIANTS, "hf_generate_batch")
# what runs by default: every ablation and the peer, not the whole-model compile (a CUDA-only variant
# of ours) nor the variants that set the route themselves (ours_paged, ours_fp8_kv: --paths names them)
RL_DEFAULT_PATHS = tuple(p for p in RL_PATHS if p != "ours_compile_model" and p not in PAGED_VARIANTS)
# nano-vllm's bench.py: 256 sequences, prompt lengths and budgets uniform in 100..1024, on Qwen3-0.6B
NANO_VLLM_SHAPE = {"num_seqs": 256, "min_len": 100, "max_len": 1024, "seed": 0}
NANO_VLLM_MODEL = "qwen3-0.6b"


def check_rl_settings(*, num_seqs: int, min_len: int, max_len: int, mode: str, slots: int | None, reps: int,
                      peer_calls: int, paths: Sequence[str], seed: int = 0, decode: str = "auto",
                      decode_widths: int | None = None, limits: ModelLimits | None = None) -> None:
    """ValueError naming the first bad setting of ``run_rl`` and what would be valid; with ``limits``
    (the model's, read before it is built or from it) the sizes too: every request's prompt and
    budget (each up to ``max_len``) within the context, the prompts and outputs within the host's
    memory and the rows decoded at once (``slots``, else every request on an aligned route) within
    the device's."""
    for name, value in (("num_seqs", num_seqs), ("min_len", min_len), ("max_len", max_len)):
        if not is_int(value) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    check_timed_calls(reps, name="reps")
    check_timed_calls(peer_calls, name="peer_calls")
    check_int(seed, name="seed", minimum=0)
    if max_len < min_len:
        raise ValueError(f"max_len {max_len} is below min_len {min_len}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {list(MODES)}, got {mode!r}")
    if slots is not None and (not is_int(slots) or slots < 1):
        raise ValueError(f"slots must be None or an int >= 1, got {slots!r}")
    RolloutConfig(mode=mode, decode=decode, **({} if decode_widths is None else {"decode_widths": decode_widths}))
    unknown = [p for p in paths if p not in RL_PATHS]
    if unknown or not paths:
        raise ValueError(f"unknown RL paths {unknown or '(none given)'}; valid: {', '.join(RL_PATHS)}")
    if limits is None:
        return
    positions = 2 * max_len  # a prompt and a budget, each drawn up to max_len
    limits.check_context("max_len", max_len, positions=positions, what="a request's prompt and budget, each up to "
                         "max_len,", most=None if limits.max_positions is None else limits.max_positions // 2)
    at_once = rows_at_once(num_seqs, mode=mode, slots=slots)
    limits.check_kv("num_seqs" if at_once == num_seqs else "slots", num_seqs if at_once == num_seqs else slots,
                    rows=at_once, positions=positions)
    limits.check_host_tokens("num_seqs", num_seqs, rows=num_seqs, tokens_per_row=positions)


def run_rl(
    model: Any, *, model_name: str, dtype: str, num_seqs: int = 256, min_len: int = 100, max_len: int = 1024,
    seed: int = 0, mode: str = "bucketed", slots: int | None = None, decode: str = "auto",
    decode_widths: int | None = None, reps: int = 1, peer_calls: int = 1, paths: Sequence[str] = RL_DEFAULT_PATHS,
    config: Mapping[str, Any] | None = None, save: Callable[[dict[str, Any]], Any] = lambda record: None,
    **prov: Any,
) -> dict[str, Any]:
    """Every path of ``paths`` in order on ``model`` (built, on its device); the record (kind
    "rl_throughput"). ``save(record)`` runs after each path, so a later failure loses nothing.
    ``config`` adds to the record's settings (a command line's model options); ``prov`` to its
    provenance (the script and its argv). Bad settings are a ValueError before any work."""
    paths = list(paths)
    check_rl_settings(num_seqs=num_seqs, min_len=min_len, max_len=max_len, mode=mode, slots=slots, reps=reps,
                      peer_calls=peer_calls, paths=paths, seed=seed, decode=decode, decode_widths=decode_widths,
                      limits=ModelLimits.of_model(model))
    device = next(model.parameters()).device
    if "ours_compile_model" in paths and device.type != "cuda":
        raise ValueError(f"ours_compile_model compiles the CUDA-graph decode step; the model is on {device}")
    cfg = model.config.get_text_config(decoder=True)
    vocab = model.get_input_embeddings().weight.shape[0]
    pad_id = cfg.pad_token_id if cfg.pad_token_id is not None else 0
    lengths, budgets = uniform_workload(num_seqs, low=min_len, high=max_len, seed=seed)
    prompts = lengths_to_prompts(lengths, vocab_size=vocab, seed=seed, special_ids=special_token_ids(cfg))
    num_tokens = sum(budgets)
    settings = {"num_seqs": num_seqs, "min_len": min_len, "max_len": max_len, "seed": seed, "mode": mode,
                "slots": slots, "decode": decode, "decode_widths": decode_widths, "reps": reps,
                "peer_calls": peer_calls, "paths": paths, "dtype": dtype}
    results: dict[str, Any] = {}
    record = {
        "kind": "rl_throughput",
        "provenance": provenance(device=device, dtype=dtype, **prov),
        "config": settings | dict(config or {}) | {"model": model_name},
        "workload": {"num_requests": len(prompts), "lengths": lengths, "budgets": budgets,
                     "num_output_tokens": num_tokens, "num_prompt_tokens": sum(lengths)},
        "results": results,
    }
    for path in paths:  # ours first: HF's manager last, after our graphs are captured
        if path == "hf_generate_batch":
            results[path] = _run_peer(model, prompts, budgets, pad_id, device, calls=peer_calls)
        else:
            settings_ = dict(DECODE_VARIANTS[path])
            if decode_widths is not None:
                settings_.setdefault("decode_widths", decode_widths)
            engine = RolloutConfig(**({"mode": mode} | settings_), ignore_eos=True, pad_token_id=pad_id,
                                   continuous_batch_size=slots, decode=decode)  # a variant's route wins
            results[path] = _run_ours(model, prompts, budgets, engine, device, variant=path, reps=reps) \
                | {"settings": settings_, "num_slots": slots or len(prompts)}
        if "mean_ms" in results[path]:
            results[path]["output_tokens_per_s"] = num_tokens / (results[path]["mean_ms"] / 1e3)
        synchronize(device)
        save(record)
    return record


def peak_memory_over(device: torch.device, baseline: int | None) -> int | None:
    """Peak CUDA bytes allocated since the last reset, over ``baseline`` (None off CUDA)."""
    return None if baseline is None else int(torch.cuda.max_memory_allocated(device) - baseline)


def _run_ours(model, prompts, budgets, config: RolloutConfig, device: torch.device, *, variant: str,
              reps: int) -> dict[str, Any]:
    baseline = torch.cuda.memory_allocated(device) if device.type == "cuda" else None  # the weights
    if baseline is not None:
        torch.cuda.reset_peak_memory_stats(device)
    rollout = Rollout(model, config)
    calls: list[dict[str, Any]] = []  # the warm-up, then each timed call: what it captured or was timed for
    first_ms, _ = _account(rollout, calls, lambda: rollout.generate(prompts, max_new_tokens=budgets, progress=False), device)
    print(f"{variant:16s} warm-up {first_ms:10.1f} ms (compile and capture included)", file=sys.stderr)
    samples = []
    for rep in range(reps):
        ms, result = _account(rollout, calls, lambda: rollout.generate(prompts, max_new_tokens=budgets, progress=False), device)
        samples.append(ms)
        extra = calls[-1]
        print(f"{variant:16s} rep {rep + 1}  {ms:10.1f} ms ({extra['prefill_captures']} prefill captures, "
              f"{extra['decode_captures']} decode, {extra['compiled_frames']} frames compiled, "
              f"{'timed by the online costs' if extra['observed'] else 'untimed'})", file=sys.stderr)
    peak = peak_memory_over(device, baseline)
    if [len(s) for s in result.sequences] != list(budgets):
        raise RuntimeError(f"{variant}: a row did not run its own budget")
    profiled = rollout.generate(prompts, max_new_tokens=budgets, profile=True, progress=False)
    prof = profiled.profile
    stepper = rollout.stepper_info
    rollout.close()
    return {
        "samples_ms": samples, "mean_ms": statistics.fmean(samples), "first_call_ms": first_ms, "calls": calls,
        "peak_memory_bytes": peak, "route": profiled.route, "decode": rollout.runner.decode_mode,
        "num_decode_steps": prof.num_decode_forwards, "stepper": stepper,
        "decode_ms_per_step": prof.decode_ms / max(1, prof.num_decode_forwards),
        "profile": {k: getattr(prof, k) for k in ("planning_ms", "prefill_ms", "decode_ms", "cache_ms",
                                                  "stepper_build_ms", "total_ms", "num_prefill_forwards",
                                                  "peak_cache_columns", "cache_bytes", "num_slots",
                                                  "occupancy", "queued_occupancy", "kv_block_size",
                                                  "num_kv_blocks", "peak_kv_blocks", "peak_live_tokens",
                                                  "num_preemptions")},
    }


def _account(rollout: Rollout, calls: list[dict[str, Any]], call, device: torch.device) -> tuple[float, Any]:
    """Time ``call`` and append what it did besides decoding to ``calls``: the prefill classes it
    captured (their ms, compile included), the decode graphs it captured (a rebuilt stepper's all),
    torch.compile's frames, whether the online costs timed it (a timed call synchronises every phase)
    and its prefill widths. A call slower than its neighbours says here whether a capture, a compile
    or a new plan's first shapes cost it."""
    prefill, stepper, compiles = rollout.prefill_graph_info, rollout.stepper_info, compile_counts()
    observed = _observed_calls(rollout)
    ms, result = timed_ms(call, device)
    after = rollout.prefill_graph_info
    calls.append({
        "ms": ms, "prefill_captures": after.get("num_captures", 0) - prefill.get("num_captures", 0),
        "prefill_capture_ms": after.get("capture_ms", 0.0) - prefill.get("capture_ms", 0.0),
        "decode_captures": decode_captures(stepper, rollout.stepper_info)[0],
        "compiled_frames": compile_counts()["frames"] - compiles["frames"],
        "observed": _observed_calls(rollout) > observed,
        "prefill_widths": sorted({w for plan in result.plans for w in plan.widths})})
    return ms, result


def _observed_calls(rollout: Rollout) -> int:
    """Calls the online costs timed so far (their calibrator's count: ``prediction_errors`` is a
    window, which stops growing once full)."""
    return 0 if rollout.online is None else rollout.online.num_calls


def hf_generate_batch_budgets(model: Any, prompts: Sequence[Sequence[int]], budgets: Sequence[int],
                              pad_id: int) -> list[list[int]]:
    """HF continuous batching with per-request budgets: its manager, one request per prompt."""
    config = GenerationConfig(max_new_tokens=max(budgets), do_sample=False, eos_token_id=None, pad_token_id=pad_id)
    manager = model.init_continuous_batching(generation_config=config,
                                             **cb_sizing(model, prompts, max(budgets)))
    manager.start()
    try:
        for i, (prompt, budget) in enumerate(zip(prompts, budgets)):
            manager.add_request(input_ids=list(prompt), request_id=f"r{i}", max_new_tokens=budget)
        outputs: dict[str, list[int]] = {}
        deadline = time.monotonic() + 1800
        while len(outputs) < len(prompts):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                if result.error is not None:
                    raise RuntimeError(f"request {result.request_id} failed: {result.error}")
                outputs[result.request_id] = list(result.generated_tokens)
            if time.monotonic() > deadline or not manager.is_running():
                raise RuntimeError(f"generate_batch finished {len(outputs)} of {len(prompts)} requests")
    finally:
        manager.stop(block=True)
    return [outputs[f"r{i}"] for i in range(len(prompts))]


def _run_peer(model, prompts, budgets, pad_id: int, device: torch.device, *, calls: int) -> dict[str, Any]:
    release_memory(device)
    baseline = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
    if baseline is not None:
        torch.cuda.reset_peak_memory_stats(device)
    try:  # no warm-up: HF's manager captures nothing, and one call of it takes minutes
        samples = []
        for _ in range(calls):
            ms, sequences = timed_ms(lambda: hf_generate_batch_budgets(model, prompts, budgets, pad_id), device)
            samples.append(ms)
            print(f"hf        {ms:10.1f} ms", file=sys.stderr)
    except Exception as err:  # noqa: BLE001 - a peer that cannot run is recorded, not fatal
        return {"skipped": f"{type(err).__name__}: {err}"[:500]}
    if [len(s) for s in sequences] != list(budgets):
        return {"skipped": "generate_batch did not run every request to its own budget"}
    return {"samples_ms": samples, "mean_ms": statistics.fmean(samples), "first_call_ms": samples[0],
            "peak_memory_bytes": peak_memory_over(device, baseline)}


# run_rl's settings and their defaults (its signature's), as notebook 03's rl_shape gives them
RL_DEFAULTS: dict[str, Any] = {"num_seqs": 256, "min_len": 100, "max_len": 1024, "seed": 0, "mode": "bucketed",
                               "slots": None, "decode": "auto", "decode_widths": None, "reps": 1, "peer_calls": 1,
                               "paths": RL_DEFAULT_PATHS}


def rl_or_load(
    *, rl_shape: Mapping[str, Any] | None, rl_results_file: str | Sequence[str] | None, model: str, dtype: str,
    device: str, output_dir: Any = None,
) -> list[tuple[str, dict[str, Any]]]:
    """(name, record) of the RL runs notebook 03 shows: ``rl_shape`` (``run_rl``'s settings,
    ``RL_DEFAULTS`` where it says nothing) measured on ``model`` into ``<workspace>/data/results/rl_<model>_<dtype>_<device>``
    (written after every path; an existing record there is an error), then the saved records of
    ``rl_results_file``. They must all run one workload (the same lengths and budgets). Bad settings,
    a record in the way or another workload are a ValueError raised before the model is built."""
    from rollout_lab.measure.models import load_model, model_config
    from rollout_lab.measure.records import load_rl_results, rl_throughput_rows, shape_settings
    from rollout_lab.workspace import Workspace, record_paths, run_tag, write_record

    files = [] if rl_results_file is None else \
        [str(rl_results_file)] if isinstance(rl_results_file, str) else [str(f) for f in rl_results_file]
    runs = [(f, load_rl_results(f)) for f in files]
    workloads = [(name, (r["workload"]["lengths"], r["workload"]["budgets"])) for name, r in runs]
    if rl_shape is not None:
        shape = shape_settings("rl_shape", rl_shape, RL_DEFAULTS)
        config, name = model_config(model)
        check_rl_settings(**{k: shape[k] for k in ("num_seqs", "min_len", "max_len", "mode", "slots", "reps",
                                                   "peer_calls", "paths", "seed", "decode", "decode_widths")},
                          limits=ModelLimits.of_config(config, dtype=dtype, device=device))
        out = record_paths(Workspace.resolve(output_dir).results / f"rl_{run_tag(name, dtype, device)}")
        lengths, budgets = uniform_workload(shape["num_seqs"], low=shape["min_len"], high=shape["max_len"],
                                            seed=shape["seed"])
        workloads.insert(0, (str(out[0]), (lengths, budgets)))
    for name, workload in workloads[1:]:
        if workload != workloads[0][1]:
            raise ValueError(f"{name} measured another workload than {workloads[0][0]}; "
                             "join RL records of one workload only")
    if rl_shape is not None:
        net, name = load_model(model, dtype=dtype, device=device)
        record = run_rl(net, model_name=name, dtype=dtype, save=lambda r: write_record(out, r, rl_throughput_rows(r)),
                        script="notebook 03 (rl_shape)", **shape)
        runs.insert(0, (str(out[0]), record))
    return runs
