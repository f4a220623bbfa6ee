"""A bench record against its card's floor (``planner.roofline``): how far each path is from the limit.

    from rollout_lab.measure.roofline import record_roofline
    figures, reason = record_roofline(record)   # (dict, None), or (None, why there is no floor)
    figures["fraction_of_floor"]                # the main path's output tok/s over the floor's

The floor is the record's workload on its model and card: every row decoded to its budget, all rows
resident unless the record ran fewer slots, the samples of a prompt reading its KV once a step
(and prefilling it once), each row its own tokens. Covered (``ROOFLINE_KINDS``): kinds whose record holds every
row's prompt length and budget, and ``bench decode-step``'s, whose cases are single steps (each case
its own step floor: S rows over L tokens each). ``bench`` commands write it into each record as its "roofline" field
(None with a "roofline_reason"); an older record gets the same figures read through this function
(``rollout-lab roofline <record.json>``; notebook 03 draws ``roofline_rows``).
"""
from __future__ import annotations

import dataclasses
import os
import statistics
from pathlib import Path
from typing import Any, Mapping, Sequence

from rollout_lab.engine.kernels import kv_fp8
from rollout_lab.measure.models import model_config as model_config_of
from rollout_lab.measure.records import MAX_RECORD_BYTES
from rollout_lab.planner.roofline import CARDS, RooflineModel, card_spec, decode_floor, workload_floor
from rollout_lab.workspace import read_json_file

# kind -> the path whose tok/s is the record's headline (the others get their fractions too)
ROOFLINE_KINDS = {"rl_throughput": "ours", "grpo": "shared", "trainer_loop": "steady_rollout",
                  "prefix_sharing": "shared", "decode_step": "ours"}
# kinds a floor is wanted for whose records lack what it needs
NO_FLOOR_KINDS = {
    "eos_long_tail": "its rows end at EOS and the record holds no per-row response lengths",
    "partial_rollouts": "its rows end at EOS and the record holds no per-row response lengths",
}


def record_roofline(record: Mapping[str, Any], *, model_config: Any = None) -> tuple[dict[str, Any] | None,
                                                                                      str | None]:
    """``(figures, None)`` for a record of a ``ROOFLINE_KINDS`` kind run on a card in ``CARDS``:
    card, floor seconds and tok/s, the bound that holds most of it, the KV share of its bytes, the
    main path and its measured tok/s and fraction of the floor, and every path's fraction;
    ``(None, reason)`` for a record run on the CPU, on another card, of a model whose weights are
    not known (``model_config``, the model's HF config, stands in for the record's model name) or
    of a kind in ``NO_FLOOR_KINDS``. ValueError for any other kind, naming the covered ones."""
    if not isinstance(record, Mapping):
        raise ValueError(f"a record is a JSON object, got {type(record).__name__}")
    kind = record.get("kind")
    if kind in NO_FLOOR_KINDS:
        return None, f"{kind}: {NO_FLOOR_KINDS[kind]}"
    if kind not in ROOFLINE_KINDS:
        raise ValueError(f"no floor for a record of kind {kind!r}; covered: {', '.join(ROOFLINE_KINDS)} "
                         f"(and without one: {', '.join(NO_FLOOR_KINDS)})")
    prov = record.get("provenance") or {}
    if prov.get("device_type") != "cuda":
        return None, f"a {prov.get('device_type') or 'device-less'} record: a floor is a GPU card's"
    card = card_spec(prov.get("device_name"))
    if card is None:
        return None, (f"card {prov.get('device_name')!r} has no spec in planner.roofline.CARDS "
                      f"(known: {', '.join(CARDS)})")
    config = record.get("config") or {}
    dtype = prov.get("dtype") or config.get("dtype")
    try:
        if model_config is None:
            model_config = model_config_of(str(config.get("model")))[0]
        model = RooflineModel.from_config(model_config, dtype)
    except ValueError as err:
        return None, f"model {config.get('model')!r}: {err}"
    if kind == "decode_step":
        return _step_figures(record, model, card), None
    lengths, budgets, samples, slots, measured = _workload(record)
    floor = workload_floor(model, lengths, budgets, card, num_slots=slots, samples_per_prompt=samples)
    floors = {path: floor.tokens_per_s for path in measured}
    for path, fraction in _stored_kv_fractions(record, model).items():  # a path whose pool stores less: its own floor
        if path in floors:
            floors[path] = workload_floor(dataclasses.replace(model, kv_fraction=fraction), lengths, budgets, card,
                                          num_slots=slots, samples_per_prompt=samples).tokens_per_s
    fractions = {path: tok_s / floors[path] for path, tok_s in measured.items()}
    main = ROOFLINE_KINDS[kind] if ROOFLINE_KINDS[kind] in measured else next(iter(measured), None)
    return {"card": card.name, "floor_s": floor.seconds, "floor_tok_s": floor.tokens_per_s, "bound": floor.bound,
            "floors_tok_s": floors,
            "kv_share": floor.kv_share, "prefill_floor_s": floor.prefill_seconds,
            "num_decode_steps": floor.num_decode_steps, "num_slots": slots, "samples_per_prompt": samples,
            "path": main,
            "measured_tok_s": measured.get(main), "fraction_of_floor": fractions.get(main),
            "fractions": fractions}, None


def attach_roofline(record: dict[str, Any], *, model_config: Any = None) -> None:
    """Set ``record["roofline"]`` (``record_roofline``'s figures, else None) and
    ``record["roofline_reason"]`` (None, else why there is no floor); a kind with no floor is said
    so, never an error: writing a record never fails for its roofline."""
    try:
        figures, reason = record_roofline(record, model_config=model_config)
    except ValueError as err:
        figures, reason = None, str(err)
    record["roofline"] = figures
    record["roofline_reason"] = reason


def read_roofline_record(path: str | os.PathLike) -> dict[str, Any]:
    """The record at ``path`` (its JSON), of a kind this module prices (``ROOFLINE_KINDS``) or says
    has no floor (``NO_FLOOR_KINDS``); a ValueError naming the file, its kind and the covered ones."""
    record = read_json_file(path, what="record", max_bytes=MAX_RECORD_BYTES)
    kind = record.get("kind") if isinstance(record, dict) else None
    if kind not in ROOFLINE_KINDS and kind not in NO_FLOOR_KINDS:
        raise ValueError(f"{str(path)!r} is a record of kind {kind!r}, which has no floor here; covered: "
                         f"{', '.join(ROOFLINE_KINDS)} (said to have none: {', '.join(NO_FLOOR_KINDS)})")
    return record


def roofline_rows(records: Sequence[tuple[str, Mapping[str, Any]]]) -> list[dict[str, Any]]:
    """One row per path of each (name, record), with its card, the floor and its fraction of it
    (``headline`` marks the record's main path); one row with the reason for a record without a
    floor. ``label`` names the record (its file name) and the path, for a chart's axis."""
    rows = []
    for name, record in records:
        figures, reason = record_roofline(record)
        prov, config = record.get("provenance") or {}, record.get("config") or {}
        common = {"record": Path(name).name, "kind": record.get("kind"), "model": config.get("model"),
                  "card": prov.get("device_name"), "git_sha": str(prov.get("git_sha") or "")[:7]}
        if figures is None:
            rows.append({**common, "label": Path(name).stem, "path": None, "floor_tok_s": None, "measured_tok_s": None,
                         "fraction_of_floor": None, "bound": None, "kv_share": None, "headline": None,
                         "reason": reason})
            continue
        for path, fraction in figures["fractions"].items():
            path_floor = figures["floors_tok_s"][path]  # a path's own floor (an FP8 pool, a step's case)
            rows.append({**common, "label": f"{Path(name).stem}: {path}", "path": path,
                         "floor_tok_s": path_floor, "measured_tok_s": fraction * path_floor,
                         "fraction_of_floor": fraction, "bound": figures["bound"], "kv_share": figures["kv_share"],
                         "headline": path == figures["path"], "reason": None})
    return rows


def _step_figures(record: Mapping[str, Any], model: RooflineModel, card: Any) -> dict[str, Any]:
    """A ``bench decode-step`` record against the floor of each of its steps: case ``SxL`` is S rows
    each attending to L tokens (``decode_floor``), a path is ``"<case> <variant>"``, and a step's
    rate is its rows' tokens over its median ms, so a path's fraction is its case's floor ms over the
    measured ms. The headline is the first case's ``ours`` (else its first variant)."""
    floors, measured, steps = {}, {}, {}
    for case, variants in record["cases"].items():
        slots, span = (int(part) for part in case.split("x"))
        steps[case] = decode_floor(model, [span] * slots, card)
        for variant, result in variants.items():
            floors[f"{case} {variant}"] = slots / steps[case].seconds
            measured[f"{case} {variant}"] = slots * 1e3 / result["step_ms_median"]
    first_case = next(iter(record["cases"]), "")
    main = f"{first_case} ours" if f"{first_case} ours" in measured else next(iter(measured), None)
    step = steps.get(first_case)  # the headline's case (the first)
    return {"card": card.name, "floor_s": None if step is None else step.seconds,
            "floor_tok_s": floors.get(main), "bound": None if step is None else step.bound, "floors_tok_s": floors,
            "kv_share": None if step is None else step.kv_bytes / (step.kv_bytes + step.weight_bytes),
            "prefill_floor_s": 0.0, "num_decode_steps": 1, "num_slots": None, "samples_per_prompt": 1,
            "path": main, "measured_tok_s": measured.get(main),
            "fraction_of_floor": None if main is None else measured[main] / floors[main],
            "fractions": {path: measured[path] / floors[path] for path in measured}}


def _workload(record: Mapping[str, Any]) -> tuple[list[int], list[int], int, int | None, dict[str, float]]:
    """(prompt lengths and budgets per row, samples per prompt, slots or None, {path: measured output
    tok/s}) of a covered record."""
    kind, work, config = record["kind"], record["workload"], record.get("config") or {}
    if kind == "rl_throughput":
        results = record["results"]
        return (list(work["lengths"]), list(work["budgets"]), 1, config.get("slots"),
                _rates(results, "output_tokens_per_s"))
    if kind == "prefix_sharing":
        cases = record["cases"]
        if len(cases) != 1:
            raise ValueError(f"a prefix_sharing record of {len(cases)} cases (prompt lengths); its floor is one "
                             "case's: give a record of one case")
        case = cases[0]
        lengths = [n for n in case["lengths"] for _ in range(work["num_samples"])]
        return (lengths, [work["max_new_tokens"]] * len(lengths), work["num_samples"], None,
                _rates(case["results"], "output_tokens_per_s"))
    samples = work.get("num_samples", config.get("num_samples"))
    lengths = [n for n in work["lengths"] for _ in range(samples)]
    budgets = [config["max_new_tokens"]] * len(lengths)
    if kind == "grpo":
        return lengths, budgets, samples, None, _rates(record["results"], "tokens_per_s")
    # trainer_loop: its rollouts once the weights are synced (each iteration's second call)
    steady = [it["steady_rollout_ms"] for it in record["results"]["iterations"] if it.get("steady_rollout_ms")]
    tokens = work["num_generated_tokens"]
    return lengths, budgets, samples, None, ({"steady_rollout": tokens / (statistics.mean(steady) / 1e3)} if steady else {})


def _stored_kv_fractions(record: Mapping[str, Any], model: RooflineModel) -> dict[str, float]:
    """{path: its pool's KV bytes over the model dtype's} for the paths of an RL record that stored
    their KV in FP8 (``kv_cache_dtype="fp8"``, ``engine.kernels.kv_fp8``: e4m3 and a scale per token
    and KV head, at the block size the path ran)."""
    if record.get("kind") != "rl_throughput":
        return {}
    g = model.geometry
    out = {}
    for path, res in record["results"].items():
        if not isinstance(res, Mapping) or (res.get("settings") or {}).get("kv_cache_dtype") != "fp8":
            continue
        block = (res.get("profile") or {}).get("kv_block_size") or 64
        out[path] = kv_fp8.kv_bytes_per_token(g, int(block)) / g.kv_bytes_per_token
    return out


def _rates(results: Mapping[str, Any], field: str) -> dict[str, float]:
    return {path: res[field] for path, res in results.items()
            if isinstance(res, Mapping) and not res.get("skipped") and res.get(field)}
