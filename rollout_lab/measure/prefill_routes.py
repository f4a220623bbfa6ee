"""The three prefill routes measured: one padded forward (nocb), the DP's buckets, one packed forward.

Notebook 02 shows from the cost model where packed and bucketed prefill cross; this measures it. For
the lognormal and bimodal batches of each size (``measure.workloads.crossing_batches``, as notebook
02's), every route runs whole calls with one new token,
so a call is its prefill (plus the first token's choice), interleaved, after one warm-up. The
warm-up is kept as ``first_call_ms``: the compiles and captures that batch is first to need.

    rows = prefill_route_rows(model, batch_sizes=(32, 64, 128), repetitions=3)
    # distribution, batch_size, num_tokens, route, mean_ms, stdev_ms, median_ms, q1_ms, q3_ms, iqr_ms,
    # samples_ms, first_call_ms, num_forwards, backend

``run_prefill_routes`` makes the rows a record (kind "prefill_routes"), saved after every batch.
``rollout-lab bench prefill-routes`` is its command line (``--preset qwen2.5-3b --prefill-graphs --out
data/results/prefill_routes_qwen2.5-3b_bfloat16_cuda`` on the H200; ``--tiny qwen2 --batch-sizes 4 8``
is a CPU check in seconds); notebook 03 renders the record with ``prefill_routes_file=...`` (or
measures live with ``prefill_batch_sizes``).
"""
from __future__ import annotations

import statistics
import sys
from typing import Any, Callable, Sequence

import torch

from rollout_lab.engine.api.config import RolloutConfig
from rollout_lab.engine.limits import ModelLimits
from rollout_lab.engine.profile import timed_ms
from rollout_lab.engine.api.rollout import Rollout
from rollout_lab.measure.models import special_token_ids
from rollout_lab.measure.paths import check_timed_calls
from rollout_lab.measure.provenance import provenance
from rollout_lab.measure.spread import sample_spread
from rollout_lab.measure.workloads import crossing_batches, lengths_to_prompts
from rollout_lab.planner.checks import is_int
from rollout_lab.planner.cost import CostCoefficients
from rollout_lab.planner.shape_classes import ShapeClasses

PREFILL_ROUTES = ("nocb", "bucketed", "packed")
# run_prefill_routes's settings and their defaults (its signature's)
PREFILL_ROUTES_DEFAULTS: dict[str, Any] = {"batch_sizes": (32, 64, 128, 256, 512), "repetitions": 3,
                                           "routes": PREFILL_ROUTES}


def longest_prompt(model: torch.nn.Module) -> int:
    """The longest prompt the crossing batches draw: the context less one token, at most 2048."""
    return longest_prompt_within(ModelLimits.of_model(model).max_positions)


def longest_prompt_within(max_positions: int | None) -> int:
    """``longest_prompt`` of a model whose context is ``max_positions`` (None: no limit)."""
    return min((max_positions or 2049) - 1, 2048)


def check_prefill_routes_settings(*, batch_sizes: Sequence[int], repetitions: int, routes: Sequence[str],
                                  limits: ModelLimits | None = None) -> None:
    """ValueError naming the first bad setting of ``prefill_route_rows`` and what would be valid; with
    ``limits`` (the model's) every batch's prompts (up to ``longest_prompt`` tokens each) within the
    host's memory and its KV cache, every row at once, within the device's."""
    if not batch_sizes or not all(is_int(n) and n >= 1 for n in batch_sizes) or not is_int(repetitions) \
            or repetitions < 1:
        raise ValueError(f"need repetitions >= 1 and batch sizes >= 1, got {repetitions}, {list(batch_sizes)}")
    check_timed_calls(repetitions, name="repetitions")
    if not routes or not set(routes) <= set(PREFILL_ROUTES):
        raise ValueError(f"routes must be some of {list(PREFILL_ROUTES)}, got {list(routes)}")
    if limits is None:
        return
    longest, largest = longest_prompt_within(limits.max_positions), max(batch_sizes)
    limits.check_kv("batch_sizes", largest, rows=largest, positions=longest + 1)
    limits.check_host_tokens("batch_sizes", largest, rows=largest, tokens_per_row=longest)


def prefill_route_rows(
    model: torch.nn.Module, *, batch_sizes: Sequence[int], repetitions: int = 3, costs: CostCoefficients | None = None,
    seed: int = 0, engine: dict[str, Any] | None = None, routes: Sequence[str] = PREFILL_ROUTES,
    on_batch_size: Callable[[list[dict[str, Any]]], None] | None = None,
    log: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """One row per (distribution, batch size, route): the measured prefill call (module doc).
    ``engine`` holds more ``RolloutConfig`` settings for every route (e.g. ``prefill_classes`` and
    ``prefill_graphs``, as ``rollout-lab sweep --prefill-graphs`` runs); ``on_batch_size`` gets the
    rows so far after each batch of each size and distribution (a caller writes its record there, so a
    cut run keeps them); ``routes`` picks some of ``PREFILL_ROUTES`` (a padded nocb forward of 512
    prompts up to 2048 tokens does not fit an H200); ``log`` gets a line per warm-up call (where a
    long compile went)."""
    limits = ModelLimits.of_model(model)
    check_prefill_routes_settings(batch_sizes=batch_sizes, repetitions=repetitions, routes=routes, limits=limits)
    config = model.config.get_text_config(decoder=True)
    limit = longest_prompt_within(limits.max_positions)
    vocab = model.get_input_embeddings().weight.shape[0]
    special = special_token_ids(config)
    settings = dict(ignore_eos=True, **({} if costs is None else {"costs": costs}), **(engine or {}))
    rollouts = {route: Rollout(model, RolloutConfig(mode=route, profile=True, **settings)) for route in routes}
    rows = []
    for n in batch_sizes:
        for kind, lengths in crossing_batches(n, seed, max_len=limit).items():
            prompts = lengths_to_prompts(lengths, vocab_size=vocab, seed=seed + n, special_ids=special)
            samples: dict[str, list[float]] = {route: [] for route in routes}
            first, last = {}, {}
            for rep in range(repetitions + 1):  # pass 0 is the warm-up
                for route, rollout in rollouts.items():
                    ms, result = timed_ms(lambda: rollout.generate(prompts, max_new_tokens=1, progress=False), rollout.device)
                    if rep > 0:
                        samples[route].append(ms)
                    else:
                        first[route] = ms
                        if log is not None:
                            log(f"{kind} x{n} ({sum(lengths)} tokens) {route}: warm-up {ms / 1e3:.1f} s")
                    last[route] = result
            for route in routes:
                profile = last[route].profile
                rows.append({
                    "distribution": kind, "batch_size": n, "num_tokens": sum(lengths), "route": route,
                    "mean_ms": statistics.fmean(samples[route]),
                    "stdev_ms": statistics.stdev(samples[route]) if len(samples[route]) > 1 else 0.0,
                    **sample_spread(samples[route]), "samples_ms": ";".join(f"{x:.3f}" for x in samples[route]),
                    "first_call_ms": first[route], "num_forwards": profile.num_prefill_forwards,
                    "backend": profile.prefill_backend,
                })
            if on_batch_size is not None:
                on_batch_size(list(rows))
    for rollout in rollouts.values():
        rollout.close()
    return rows


def run_prefill_routes(
    model: torch.nn.Module, *, model_name: str, dtype: str, batch_sizes: Sequence[int] = (32, 64, 128, 256, 512),
    repetitions: int = 3, routes: Sequence[str] = PREFILL_ROUTES, costs: CostCoefficients | None = None,
    costs_source: str | None = None, prefill_graphs: bool = False,
    save: Callable[[dict[str, Any]], Any] = lambda record: None, **prov: Any,
) -> dict[str, Any]:
    """``prefill_route_rows`` on ``model`` (built, on its device) as a record (kind
    "prefill_routes"): ``save(record)`` runs after every batch, the record saying which batch sizes
    are done and whether all are, so a cut run keeps them. ``costs`` price the bucketed plan
    (``costs_source`` names where they came from); ``prefill_graphs`` buckets at the shape-class
    ladder of every batch drawn, each class's forward captured (CUDA, as ``rollout-lab sweep
    --prefill-graphs`` runs); ``prov`` adds to the provenance (the command and its argv)."""
    batch_sizes, routes = list(batch_sizes), list(routes)
    check_prefill_routes_settings(batch_sizes=batch_sizes, repetitions=repetitions, routes=routes,
                                  limits=ModelLimits.of_model(model))
    engine: dict[str, Any] = {}
    if prefill_graphs:  # the ladder over every batch this bench draws
        engine = {"prefill_classes": ShapeClasses.ladder(max_width=longest_prompt(model), max_rows=max(batch_sizes)),
                  "prefill_graphs": True}
    record: dict[str, Any] = {
        "kind": "prefill_routes",
        "provenance": provenance(device=next(model.parameters()).device, dtype=dtype, **prov),
        "config": {"model": model_name, "batch_sizes": batch_sizes, "repetitions": repetitions,
                   "costs": costs_source, "routes": routes, "prefill_graphs": prefill_graphs},
    }
    kinds = set(crossing_batches(1, 0))  # the distributions every batch size runs

    def save_rows(rows: list[dict[str, Any]]) -> None:
        done = sorted({r["batch_size"] for r in rows  # a size is done when all its distributions are
                       if {q["distribution"] for q in rows if q["batch_size"] == r["batch_size"]} == kinds})
        record.update(rows=rows, complete=set(done) == set(batch_sizes), batch_sizes_done=done)
        save(record)
        print(f"batch sizes {done} saved", file=sys.stderr)

    prefill_route_rows(model, batch_sizes=batch_sizes, repetitions=repetitions, costs=costs, engine=engine,
                       routes=routes, on_batch_size=save_rows, log=lambda line: print(line, file=sys.stderr))
    return record


def sweep_prefill_rows(record: dict[str, Any]) -> list[dict[str, Any]]:
    """The same rows from a sweep record's profiled calls (``rollout-lab sweep``): per workload and
    prefill route that it ran, the profiled call's prefill plus KV admission (``prefill_ms +
    cache_ms``) against the workload's prompt tokens; ``distribution`` is "sweep" and ``workload``
    names it. One profiled call each, so no spread (``stdev_ms`` 0)."""
    rows = []
    for workload, entry in record["workloads"].items():
        for route in PREFILL_ROUTES:
            profile = (entry["paths"].get(route) or {}).get("profile")
            if not profile:
                continue
            rows.append({
                "distribution": "sweep", "workload": workload, "batch_size": entry["num_requests"],
                "num_tokens": sum(entry["lengths"]), "route": route,
                "mean_ms": profile["prefill_ms"] + profile["cache_ms"], "stdev_ms": 0.0,
                "num_forwards": profile["num_prefill_forwards"], "backend": profile["prefill_backend"],
            })
    return rows
