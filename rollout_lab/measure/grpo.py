"""GRPO-shaped rollouts, measured: N prompts x S sampled responses, shared prefill against HF.

    from rollout_lab.measure.grpo import run_grpo
    record = run_grpo(model, model_name="qwen2.5-3b", dtype="bfloat16", max_new_tokens=512)

The workload: ``num_prompts`` distinct random-token prompts whose lengths are drawn from a real
dataset's prompt lengths (``measure.workloads.sample_lengths``, seeded), each sampled ``num_samples``
times at ``temperature`` / ``top_p`` with EOS disabled, so every row generates ``max_new_tokens``.

Paths (``GRPO_PATHS``), every one sampled with the same seed:

- ``shared``: ``Rollout.generate(prompts, num_samples=S, do_sample=True, ...)``, each prompt
  prefilled once and its KV replicated into its S slots;
- ``unshared``: the same with ``share_prefill=False`` (every (prompt, sample) row prefilled);
- ``hf_generate``: HF ``generate(..., do_sample=True, num_return_sequences=S)`` (dynamic cache);
- ``shared_unfused``: ``shared`` with the decode step's projections unfused
  (``fuse_projections=False``, engine.runner.fusing), what the default fusion saves; not run unless asked.

One warm-up round (graph capture included) and ``reps`` interleaved timed rounds, every call timed
whole with the device synchronised before and after. Then one pass per path alone on the device
(the other paths' caches released) for its peak memory over the weights and, for ours, the profile
(rows prefilled, phase times). ``rollout-lab bench grpo`` is its command line (``--preset qwen2.5-3b
--out data/results/grpo_qwen2.5-3b_bf16_cuda``: 64 GSM8K prompts x 8 samples, on the H200;
``--tiny qwen2 --scale 0.1`` is a CPU check in seconds); notebook 03 runs it with ``grpo_shape``.
"""
from __future__ import annotations

import math
import statistics
import sys
from typing import Any, Callable, Mapping, Sequence

import torch

from rollout_lab.engine.api.config import MODES, RolloutConfig
from rollout_lab.engine.runner.prefill import left_padded
from rollout_lab.engine.profile import synchronize, timed_ms
from rollout_lab.engine.api.rollout import Rollout
from rollout_lab.engine.limits import LOGIT_BYTES, ModelLimits, check_call_rows, rows_at_once
from rollout_lab.engine.sample.params import MAX_SAMPLES
from rollout_lab.measure.models import special_token_ids
from rollout_lab.measure.provenance import provenance
from rollout_lab.measure.paths import check_timed_calls, release_memory
from rollout_lab.measure.workloads import (DATASETS, lengths_to_prompts, padding_share, sample_lengths,
                                           scale_keeping_prompts)
from rollout_lab.planner.checks import check_int
from rollout_lab.planner.cost import CostCoefficients

GRPO_PATHS = ("shared", "unshared", "hf_generate", "shared_unfused")
GRPO_DEFAULT_PATHS = GRPO_PATHS[:3]
# run_grpo's settings and their defaults (its signature's), as notebook 03's grpo_shape and
# rollout-lab bench grpo give them
GRPO_DEFAULTS: dict[str, Any] = {"dataset": "gsm8k", "num_prompts": 64, "num_samples": 8, "max_new_tokens": 128,
                                 "scale": 1.0, "temperature": 1.0, "top_p": 1.0, "seed": 0, "mode": "bucketed",
                                 "reps": 2, "paths": GRPO_DEFAULT_PATHS}


def check_grpo_settings(*, dataset: str, num_prompts: int, num_samples: int, max_new_tokens: int, scale: float,
                        temperature: float, top_p: float, seed: int, mode: str, reps: int,
                        paths: Sequence[str], limits: ModelLimits | None = None) -> None:
    """ValueError naming the first bad setting of ``run_grpo`` and what would be valid; with
    ``limits`` (the model's) the sizes too (``check_group_limits``)."""
    if dataset not in DATASETS:
        raise ValueError(f"dataset must be one of {list(DATASETS)}, got {dataset!r}")
    for name, value in (("num_prompts", num_prompts), ("max_new_tokens", max_new_tokens)):
        check_int(value, name=name)
    check_samples(num_samples)
    check_timed_calls(reps, name="reps")
    check_int(seed, name="seed", minimum=0)
    for name, value in (("scale", scale), ("temperature", temperature)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"{name} must be a number > 0, got {value!r}")
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {list(MODES)}, got {mode!r}")
    unknown = [p for p in paths if p not in GRPO_PATHS]
    if unknown or not paths or len(set(paths)) != len(paths):
        raise ValueError(f"GRPO paths must be distinct names from {', '.join(GRPO_PATHS)}; got {list(paths)}")
    lengths = scaled_prompt_lengths(dataset, num_prompts, scale=scale, seed=seed)
    if limits is not None:
        check_group_limits(limits, lengths, num_samples=num_samples, max_new_tokens=max_new_tokens, scale=scale,
                           mode="bucketed" if "hf_generate" in paths else mode)


def scaled_prompt_lengths(dataset: str, num_prompts: int, *, scale: float, seed: int) -> list[int]:
    """The ``num_prompts`` prompt lengths of ``dataset`` drawn at ``seed``, times ``scale`` (a GRPO
    group's, and the trainer loop's); ValueError when ``scale`` makes a drawn prompt shorter than one
    token before ``scale_lengths`` clips it to 1 (at scale 1e-9 every prompt would be one token,
    whatever the dataset), naming the smallest scale that keeps every prompt."""
    return scale_keeping_prompts(sample_lengths(dataset, num_prompts, seed=seed), scale, what=f"of {dataset}")


def check_samples(num_samples: object) -> int:
    """``num_samples`` (samples of each prompt) as an int; ValueError unless it is in [1, ``MAX_SAMPLES``]."""
    number = check_int(num_samples, name="num_samples")
    if number > MAX_SAMPLES:
        raise ValueError(f"num_samples={number}: more samples of one prompt than a call takes (each is a row with "
                         f"its own slot); give at most {MAX_SAMPLES}")
    return number


def check_group_limits(limits: ModelLimits, lengths: Sequence[int], *, num_samples: int, max_new_tokens: int,
                       scale: float, mode: str, trainer: bool = False, train_rows: int | None = None) -> None:
    """The sizes of ``num_samples`` samples of each prompt of ``lengths`` (a GRPO group each),
    ``max_new_tokens`` each, against ``limits``: the longest prompt and its budget within the
    context, every row's prompt and output within the host's memory, the rows ``mode`` decodes at
    once within the device's; with ``trainer`` also the fp32 logits of the trainer's micro-batch
    (``train_rows``; None: every row). The rows one generate call takes (``check_call_rows``) first.
    ValueError naming the setting and the most that fits."""
    check_call_rows([num_samples] * len(lengths))  # what generate would refuse, before the model is built
    longest = max(lengths)
    positions = longest + max_new_tokens
    if max_new_tokens >= longest:
        name, value, most = "max_new_tokens", max_new_tokens, \
            None if limits.max_positions is None else limits.max_positions - longest
    else:
        name, value, most = "scale", scale, None
    limits.check_context(name, value, positions=positions, most=most,
                         what=f"the longest prompt ({longest} tokens at scale {scale:g}) and {max_new_tokens} new tokens")
    rows = len(lengths) * num_samples
    limits.check_kv("num_samples", num_samples, rows=rows_at_once(rows, mode=mode, slots=None), positions=positions)
    limits.check_host_tokens("num_samples", num_samples, rows=rows, tokens_per_row=positions)
    if trainer:
        batch = rows if train_rows is None else min(train_rows, rows)
        name, value = ("num_samples", num_samples) if batch == rows else ("train_rows", train_rows)
        limits.check_memory(name, value, count=batch, unit_bytes=positions * limits.vocab_size * LOGIT_BYTES,
                            unit="rows", what=f"the trainer's fp32 logits of {batch} rows x {positions} positions x "
                                              f"{limits.vocab_size} ids")


class _Paths:
    """The three calls; ours keep their Rollout (and its captured graphs) across rounds."""

    def __init__(self, model, prompts, settings: Mapping[str, Any], pad_id: int, costs: CostCoefficients):
        self.model, self.prompts, self.s, self.pad_id, self.costs = model, prompts, settings, pad_id, costs
        self.rollouts: dict[str, Rollout] = {}

    def rollout(self, path: str, *, profile: bool = False) -> Rollout:
        key = path + ("+profile" if profile else "")
        if key not in self.rollouts:
            config = RolloutConfig(mode=self.s["mode"], ignore_eos=True, pad_token_id=self.pad_id, costs=self.costs,
                                   share_prefill=path != "unshared", profile=profile,
                                   **({"fuse_projections": False} if path == "shared_unfused" else {}))
            self.rollouts[key] = Rollout(self.model, config)
        return self.rollouts[key]

    def call(self, path: str, *, profile: bool = False) -> tuple[list[list[int]], Any]:
        s = self.s
        if path == "hf_generate":
            return self._hf(), None
        result = self.rollout(path, profile=profile).generate(
            self.prompts, max_new_tokens=s["max_new_tokens"], num_samples=s["num_samples"], do_sample=True,
            temperature=s["temperature"], top_p=s["top_p"], seed=s["seed"], progress=False)
        return result.sequences, result

    @torch.no_grad()
    def _hf(self) -> list[list[int]]:
        s = self.s
        device = next(self.model.parameters()).device
        ids, mask = left_padded(self.prompts, self.pad_id, device)
        torch.manual_seed(s["seed"])
        out = self.model.generate(
            input_ids=ids, attention_mask=mask, do_sample=True, temperature=s["temperature"], top_p=s["top_p"],
            top_k=0, num_return_sequences=s["num_samples"], max_new_tokens=s["max_new_tokens"],
            min_new_tokens=s["max_new_tokens"], pad_token_id=self.pad_id,
        )  # [prompts * samples, width + max_new_tokens], request-major like ours
        return out[:, ids.shape[1]:].tolist()

    def release(self) -> None:
        for rollout in self.rollouts.values():
            rollout.close()
        self.rollouts.clear()
        release_memory(next(self.model.parameters()).device)


def _memory_pass(paths: _Paths, path: str, device: torch.device) -> dict[str, Any]:
    """The path alone on the device: peak allocated over the weights, and our profile."""
    paths.release()
    baseline = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
    if baseline is not None:
        torch.cuda.reset_peak_memory_stats(device)
    sequences, result = paths.call(path, profile=path != "hf_generate")
    synchronize(device)
    info: dict[str, Any] = {"peak_memory_bytes": None, "num_generated_tokens": sum(map(len, sequences))}
    if baseline is not None:
        info["peak_memory_bytes"] = int(torch.cuda.max_memory_allocated(device) - baseline)
    if result is None:
        info.update(route="hf_generate", num_prefill_rows=len(sequences), num_replicated_rows=0)
    else:
        prof = result.profile
        info.update(route=result.route, num_prefill_rows=prof.num_prefill_rows,
                    num_replicated_rows=prof.num_replicated_rows, num_prefill_forwards=prof.num_prefill_forwards,
                    prefill_ms=prof.prefill_ms, decode_ms=prof.decode_ms, cache_ms=prof.cache_ms,
                    planning_ms=prof.planning_ms, profiled_total_ms=prof.total_ms,
                    num_buckets=sum(p.num_buckets for p in result.plans))
    paths.release()
    return info


def run_grpo(
    model: Any, *, model_name: str, dtype: str, dataset: str = "gsm8k", num_prompts: int = 64, num_samples: int = 8,
    max_new_tokens: int = 128, scale: float = 1.0, temperature: float = 1.0, top_p: float = 1.0, seed: int = 0,
    mode: str = "bucketed", reps: int = 2, paths: Sequence[str] = GRPO_DEFAULT_PATHS, costs: CostCoefficients | None = None,
    costs_source: str | None = None, config: Mapping[str, Any] | None = None,
    progress: Callable[[str], Any] = lambda line: print(line, file=sys.stderr), **prov: Any,
) -> dict[str, Any]:
    """Every path of ``paths`` on ``model`` (built, on its device); the record (kind "grpo").
    ``costs`` price our planner (the reference coefficients when None; ``costs_source`` names
    where they came from); ``config`` adds to the record's settings (a command line's model
    options); ``prov`` to its provenance. Bad settings are a ValueError before any work."""
    paths = list(paths)
    settings = {"dataset": dataset, "num_prompts": num_prompts, "num_samples": num_samples,
                "max_new_tokens": max_new_tokens, "scale": scale, "temperature": temperature, "top_p": top_p,
                "seed": seed, "mode": mode, "reps": reps, "paths": paths}
    check_grpo_settings(**settings, limits=ModelLimits.of_model(model))
    device = next(model.parameters()).device
    cfg = model.config.get_text_config(decoder=True)
    vocab = model.get_input_embeddings().weight.shape[0]
    pad_id = cfg.pad_token_id if cfg.pad_token_id is not None else 0
    lengths = scaled_prompt_lengths(dataset, num_prompts, scale=scale, seed=seed)
    prompts = lengths_to_prompts(lengths, vocab_size=vocab, seed=seed, special_ids=special_token_ids(cfg))
    calls = _Paths(model, prompts, settings, pad_id, costs or CostCoefficients())

    samples: dict[str, list[float]] = {p: [] for p in paths}
    outputs: dict[str, list[list[int]]] = {}
    for rep in range(reps + 1):  # round 0 is the warm-up
        for path in paths:
            ms, (sequences, _) = timed_ms(lambda: calls.call(path), device)
            outputs[path] = sequences
            if rep > 0:
                samples[path].append(ms)
            progress(f"{'warm-up' if rep == 0 else f'rep {rep}'}  {path:12s} {ms:10.1f} ms")
    num_tokens = num_prompts * num_samples * max_new_tokens
    results: dict[str, Any] = {}
    for path in paths:
        mean = statistics.fmean(samples[path])
        results[path] = {"ms": samples[path], "mean_ms": mean, "tokens_per_s": num_tokens / (mean / 1e3),
                         **_memory_pass(calls, path, device)}
        if results[path]["num_generated_tokens"] != num_tokens:
            raise RuntimeError(f"{path} generated {results[path]['num_generated_tokens']} tokens, not {num_tokens}")
    checks: dict[str, Any] = {}
    if "shared" in outputs and "unshared" in outputs:
        same = sum(a == b for a, b in zip(outputs["shared"], outputs["unshared"]))
        checks["shared_equals_unshared_fraction"] = same / len(outputs["shared"])
    ratios = {f"{p}_over_shared": results[p]["mean_ms"] / results["shared"]["mean_ms"]
              for p in paths if p != "shared" and "shared" in results}
    return {
        "kind": "grpo",
        "provenance": provenance(device=device, dtype=dtype, **prov),
        "config": settings | {"dtype": dtype, "costs": costs_source} | dict(config or {}) | {"model": model_name},
        "workload": {"lengths": lengths, "num_prompts": len(prompts), "num_samples": num_samples,
                     "num_rows": len(prompts) * num_samples, "padding_share": padding_share(lengths),
                     "num_generated_tokens": num_tokens},
        "results": results, "ratios": ratios, "checks": checks,
    }


def grpo_or_load(
    *, grpo_shape: Mapping[str, Any] | None, grpo_results_file: str | None, model: str, dtype: str, device: str,
    cost_file: str | None = None, override_costs: bool = False, output_dir: Any = None,
) -> tuple[str, dict[str, Any]] | None:
    """(name, record) of the GRPO run notebook 03 shows, or None: ``grpo_shape`` (``run_grpo``'s
    settings, ``GRPO_DEFAULTS`` where it says nothing) measured on ``model``, priced by ``cost_file``,
    into ``<workspace>/data/results/grpo_<model>_<dtype>_<device>`` (an existing record there is an
    error), else the saved record of ``grpo_results_file``. Giving both is an error; so are bad
    settings and a record in the way, all raised before the model is built."""
    from rollout_lab.measure.calibrate import load_calibration
    from rollout_lab.measure.models import load_model, model_config
    from rollout_lab.measure.records import grpo_rows, load_grpo_results, shape_settings
    from rollout_lab.workspace import Workspace, record_paths, run_tag, write_record

    if grpo_shape is not None and grpo_results_file is not None:
        raise ValueError("give grpo_shape (measure) or grpo_results_file (render), not both")
    if grpo_results_file is not None:
        return str(grpo_results_file), load_grpo_results(grpo_results_file)
    if grpo_shape is None:
        return None
    shape = shape_settings("grpo_shape", grpo_shape, GRPO_DEFAULTS)
    config, name = model_config(model)
    check_grpo_settings(**shape, limits=ModelLimits.of_config(config, dtype=dtype, device=device))
    out = record_paths(Workspace.resolve(output_dir).results / f"grpo_{run_tag(name, dtype, device)}")
    net, name = load_model(model, dtype=dtype, device=device)
    costs = None if cost_file is None else load_calibration(cost_file, model=net, model_name=name,
                                                            override=override_costs)
    record = run_grpo(net, model_name=name, dtype=dtype, costs=costs, costs_source=cost_file,
                      script="notebook 03 (grpo_shape)", **shape)
    write_record(out, record, grpo_rows(record))
    del net
    release_memory(torch.device(device))
    return str(out[0]), record
