"""Is ``RolloutConfig()`` with nothing set as fast as the tuned setting, and what does its first call
cost?

    from rollout_lab.measure.defaults import run_defaults
    record = run_defaults(model, model_name="qwen2.5-3b", dtype="bfloat16")   # seven workloads x 16 tokens

Two engines, each ONE ``Rollout`` kept for the whole run, as a user keeps one object across calls:

- "default": ``RolloutConfig(ignore_eos=True, pad_token_id=pad)``, nothing else set (EOS ignored and
  the pad id given only so that every call generates the same ``max_new_tokens`` tokens);
- "tuned": the README's tuned setting: ``costs=tuned_costs`` (a calibration file; None: the
  reference's coefficients), prefill at the shape-class ladder of every workload's prompts
  (``measure.sweep.class_ladder_settings``), each class a captured graph on CUDA.

Per workload (distinct random-token prompts of its lengths, times ``scale``): the first call of each
engine, the default's first, timed alone as ``first_call_ms`` (the default's on the first workload
is the process's first call: compiles and captures included; on later workloads it is what a new
shape costs); then ``repetitions`` rounds, which engine goes first alternating, each call timed whole
with the device synchronised. Each engine's median and IQR, the routes it chose, and ``ratio``, the
default's median over the tuned one's (``within_1_05``: at most 1.05). The record's
``process_first_call_ms`` is the wall time from the model loaded to the default's first result
(building its Rollout, which loads what earlier processes cached, included). ``rollout-lab bench
defaults`` is its command line (``--preset qwen2.5-3b --tuned-costs
data/calibration/qwen2.5-3b_bfloat16_cuda_prefill-graphs.json --out data/results/defaults_qwen2.5-3b``
on the H200, run twice: the second process starts with the caches warm; ``--tiny qwen2 --scale 0.1
--max-new-tokens 4 --repetitions 1`` is a CPU check in seconds).
"""
from __future__ import annotations

import dataclasses
import math
import os
import sys
from typing import Any, Callable, Mapping, Sequence

from rollout_lab.engine.api.config import RolloutConfig
from rollout_lab.engine.profile import timed_ms
from rollout_lab.engine.api.rollout import Rollout
from rollout_lab.engine.limits import ModelLimits
from rollout_lab.measure.calibrate import load_calibration
from rollout_lab.measure.models import special_token_ids
from rollout_lab.measure.paths import check_timed_calls, timed_call
from rollout_lab.measure.provenance import provenance
from rollout_lab.measure.spread import sample_spread
from rollout_lab.measure.sweep import class_ladder_settings, resolve_workloads
from rollout_lab.measure.workloads import SEED_FIVE, WORKLOADS, lengths_to_prompts
from rollout_lab.planner.checks import check_context, check_int
from rollout_lab.planner.cost import CostFile

ENGINES = ("default", "tuned")
DEFAULTS_WORKLOADS = (*SEED_FIVE, "gsm8k_32", "gpqa_diamond_32")
WITHIN = 1.05  # "as fast": the default's median at most 5% over the tuned one's
# run_defaults's settings and their defaults (its signature's)
DEFAULTS_BENCH_DEFAULTS: dict[str, Any] = {
    "workloads": DEFAULTS_WORKLOADS, "max_new_tokens": 16, "repetitions": 3, "scale": 1.0, "tuned_costs": None,
    "seed": 0}


def check_defaults_settings(*, workloads: Sequence[str], max_new_tokens: int, repetitions: int, scale: float,
                            tuned_costs: str | os.PathLike | None, seed: int, limits: ModelLimits | None = None) -> None:
    """ValueError naming the first bad setting of ``run_defaults`` and what would be valid; a
    ``tuned_costs`` file is read (it must exist and hold a cost file), not yet checked against a model.
    With ``limits`` (the model's) every workload's longest prompt and ``max_new_tokens`` within the
    context, and its rows at once within the device's memory."""
    if isinstance(workloads, (str, Mapping)) or not isinstance(workloads, Sequence):
        raise ValueError(f"workloads must be a list of workload names, got {workloads!r}")
    check_int(max_new_tokens, name="max_new_tokens")
    check_timed_calls(repetitions, name="repetitions")
    check_int(seed, name="seed", minimum=0)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a number > 0, got {scale!r}")
    lengths = resolve_workloads(list(workloads), scale=scale)  # unknown or repeated names, or none
    if tuned_costs is not None:
        if not isinstance(tuned_costs, (str, os.PathLike)):
            raise ValueError(f"tuned_costs must be None (the reference's coefficients) or a cost file path, "
                             f"got {tuned_costs!r}")
        CostFile.read(tuned_costs)  # "cost file '<path>' does not exist", or what is wrong in it
    if limits is None:
        return
    for name, lens in lengths.items():
        check_context(max(lens), max_new_tokens, limits.max_positions, what=f"workload {name!r}")
        limits.check_kv("max_new_tokens", max_new_tokens, rows=len(lens), positions=max(lens) + max_new_tokens)


def prompt_seed(workload: str, seed: int) -> int:
    """The seed of ``workload``'s prompts: one per workload name and ``seed``, so that no two
    workloads share prompts, whichever of them a run takes."""
    return seed * len(WORKLOADS) + WORKLOADS.index(workload)


def run_defaults(
    model: Any, *, model_name: str, dtype: str, workloads: Sequence[str] = DEFAULTS_WORKLOADS,
    max_new_tokens: int = 16, repetitions: int = 3, scale: float = 1.0, tuned_costs: str | os.PathLike | None = None,
    seed: int = 0, config: Mapping[str, Any] | None = None,
    save: Callable[[dict[str, Any]], Any] = lambda record: None,
    progress: Callable[[str], Any] = lambda line: print(line, file=sys.stderr), **prov: Any,
) -> dict[str, Any]:
    """The comparison of the module docstring on ``model`` (built, on its device); the record (kind
    "defaults"). ``save(record)`` runs after every workload, so a later failure loses nothing.
    ``config`` adds to the record's settings; ``prov`` to its provenance. Bad settings, a workload
    longer than the model's context and a cost file that is not this model's are a ValueError
    before any work."""
    check_defaults_settings(workloads=workloads, max_new_tokens=max_new_tokens, repetitions=repetitions, scale=scale,
                            tuned_costs=tuned_costs, seed=seed, limits=ModelLimits.of_model(model))
    workloads = list(workloads)
    settings = {"workloads": workloads, "max_new_tokens": max_new_tokens, "repetitions": repetitions,
                "scale": scale, "tuned_costs": None if tuned_costs is None else str(tuned_costs), "seed": seed}
    device = next(model.parameters()).device
    cfg = model.config.get_text_config(decoder=True)
    vocab = model.get_input_embeddings().weight.shape[0]
    pad_id = cfg.pad_token_id if cfg.pad_token_id is not None else 0
    special = special_token_ids(cfg)
    lengths = resolve_workloads(workloads, scale=scale)
    prompts = {name: lengths_to_prompts(lens, vocab_size=vocab, seed=prompt_seed(name, seed), special_ids=special)
               for name, lens in lengths.items()}
    graphs = device.type == "cuda"
    tuned = class_ladder_settings(lengths, graphs=graphs) | {"costs": "reference" if tuned_costs is None
                                                             else str(tuned_costs)}
    if tuned_costs is not None:  # the file's provenance against this model, as the tuned Rollout will check it
        load_calibration(tuned_costs, model=model, prefill_graphs=graphs)
    same_tokens = {"ignore_eos": True, "pad_token_id": pad_id}  # every call generates max_new_tokens
    configs = {"default": RolloutConfig(**same_tokens), "tuned": RolloutConfig(**same_tokens, **tuned)}
    engines: dict[str, dict[str, Any]] = {
        "default": {"settings": dict(same_tokens)},
        "tuned": {"settings": same_tokens | {
            k: dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v for k, v in tuned.items()}}}
    results: dict[str, Any] = {}
    record = {
        "kind": "defaults",
        "provenance": provenance(device=device, dtype=dtype, **prov),
        "config": settings | {"dtype": dtype} | dict(config or {}) | {"model": model_name},
        "workloads": {name: {"lengths": lens, "prompt_seed": prompt_seed(name, seed), "num_prompt_tokens": sum(lens)}
                      for name, lens in lengths.items()},
        "engines": engines,
        "process_first_call_ms": None,
        "results": results,
    }
    rollouts: dict[str, Rollout] = {}

    def engine(name: str) -> Rollout:
        """The engine's one Rollout, built (and its build timed) before its first call: the tuned one
        after the default's first call, so nothing it loads warms the process's first call."""
        if name not in rollouts:
            build_ms, rollouts[name] = timed_ms(lambda: Rollout(model, configs[name]), device)
            engines[name] |= {"build_ms": build_ms, "costs_source": rollouts[name].costs_source,
                              "compiled_artifacts_loaded": rollouts[name].compiled_artifacts_loaded,
                              "prefill_graphs": rollouts[name].runner.captures_prefill}
        return rollouts[name]

    try:
        for name in workloads:
            def call(which: str, batch: list[list[int]] = prompts[name]) -> tuple[float, Any]:
                rollout = engine(which)
                ms, result, _ = timed_call(lambda: rollout.generate(batch, max_new_tokens=max_new_tokens, progress=False), device)
                return ms, result

            out = {which: {"samples_ms": [], "routes": []} for which in ENGINES}
            for which in ENGINES:  # the default's first: on the first workload, the process's first call
                before = compile_seconds()
                out[which]["first_call_ms"], result = call(which)
                out[which]["first_call_route"] = result.route
                # where a first call's time went: torch.compile's phases during it (s, summed)
                out[which]["first_call_compile_s"] = compile_seconds(since=before)
                # shown as it ends: a run cut short before the workload's record still tells its first calls
                progress(f"{name:16s} {which} first call {out[which]['first_call_ms']:9.1f} ms ({result.route}); "
                         f"compile: {compile_text(out[which]['first_call_compile_s'])}")
            if record["process_first_call_ms"] is None:
                record["process_first_call_ms"] = engines["default"]["build_ms"] + out["default"]["first_call_ms"]
            for round_ in range(repetitions):
                for which in (ENGINES if round_ % 2 == 0 else ENGINES[::-1]):  # who goes first alternates
                    ms, result = call(which)
                    out[which]["samples_ms"].append(ms)
                    out[which]["routes"].append(result.route)
                    out[which]["prefill_shapes"] = prefill_shapes(result.plans)  # the last call's
            for which in ENGINES:
                out[which] |= sample_spread(out[which]["samples_ms"])
            ratio = out["default"]["median_ms"] / out["tuned"]["median_ms"]
            results[name] = out | {"ratio": ratio, "within_1_05": ratio <= WITHIN}
            for which in ENGINES:
                engines[which]["stepper"] = rollouts[which].stepper_info
                engines[which]["prefill_graph_info"] = rollouts[which].prefill_graph_info  # a new class's cost
                # the calls its costs learned from (timed: planner.fit's due), each one's prediction error
                engines[which]["prediction_rel_errors"] = [e["rel_error"] for e in rollouts[which].prediction_errors]
            save(record)
            progress(defaults_line(name, results[name]))
    finally:
        for rollout in rollouts.values():
            rollout.close()
    return record


def prefill_shapes(plans: Sequence[Any]) -> list[list[int]]:
    """The (rows, width) each prefill forward of a call ran at, admission by admission: a bucket's
    class shape where classes are set, else its prompts and padded width (a packed forward's width
    is its tokens)."""
    shapes = []
    for plan in plans:
        rows = plan.rows or tuple(len(b) for b in plan.buckets)
        shapes += [[int(r), int(w)] for r, w in zip(rows, plan.widths)]
    return shapes


def compile_seconds(since: Mapping[str, float] | None = None) -> dict[str, float]:
    """torch.compile's time so far in this process by phase (dynamo's ``compilation_time_metrics``:
    its trace, inductor's compile, code generation..., seconds summed over every compile), less
    ``since`` (an earlier snapshot): the phases a call between the two spent. Phases it did not
    spend in are left out."""
    from torch._dynamo.utils import compilation_time_metrics

    since = since or {}
    now = {str(k): float(sum(v)) for k, v in compilation_time_metrics.items()}
    return {k: round(v - since.get(k, 0.0), 3) for k, v in now.items() if v - since.get(k, 0.0) > 1e-3}


def compile_text(seconds: Mapping[str, float], top: int = 4) -> str:
    """The ``top`` largest phases of ``compile_seconds`` as "name 12.3 s, ..." ("none" without any)."""
    largest = sorted(seconds.items(), key=lambda kv: -kv[1])[:top]
    return ", ".join(f"{k} {v:.1f} s" for k, v in largest) or "none"


def routes_text(routes: Sequence[str]) -> str:
    """The distinct routes of an engine's timed calls, in order, joined by "/"."""
    return "/".join(dict.fromkeys(routes))


def defaults_line(name: str, result: Mapping[str, Any]) -> str:
    """One workload's line: each engine's median, the ratio, the routes and the first calls."""
    d, t = result["default"], result["tuned"]
    return (f"{name:16s} default {d['median_ms']:9.1f} ms  tuned {t['median_ms']:9.1f} ms  ratio "
            f"{result['ratio']:5.2f}{'' if result['within_1_05'] else ' (over 1.05)'}  routes "
            f"{routes_text(d['routes'])} | {routes_text(t['routes'])}  first call {d['first_call_ms']:9.1f} | "
            f"{t['first_call_ms']:9.1f} ms")


def defaults_rows(record: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One row per workload of a defaults record: each engine's median, IQR, first call and routes,
    the ratio; ``git_sha`` (7 characters) names the code."""
    sha = str(record.get("provenance", {}).get("git_sha") or "")[:7]
    rows = []
    for name, res in record["results"].items():
        row: dict[str, Any] = {"workload": name, "git_sha": sha, "ratio": res["ratio"], "within_1_05": res["within_1_05"]}
        for which in ENGINES:
            e = res[which]
            row |= {f"{which}_median_ms": e["median_ms"], f"{which}_iqr_ms": e["iqr_ms"],
                    f"{which}_first_call_ms": e["first_call_ms"], f"{which}_route": routes_text(e["routes"])}
        rows.append(row)
    return rows
