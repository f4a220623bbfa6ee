"""Reading, summarising and tabulating saved records (sweeps, and the benchmarks' records); torch-free.

    from rollout_lab.measure.records import load_results, results_table, summary_table
    record = load_results("data/results/tiny")  # the stem, or the .json file
    rows = results_table(record)  # one row per (workload, path), profile fields inlined

A sweep record's summaries (Auto against the best manual path and the best HF peer, as ratios of
medians, and whether they differ by more than their spread), its flat tables and its JSON + CSV
files; the loaders of every kind of record, and the rows the notebooks and ``rollout-lab table``
draw from them. ``write_results`` writes the pair through ``workspace.write_record`` (CSV first,
JSON last, one ``run_id``); the loaders check the pair agrees, and ``recover_results`` (a sweep to
resume) rebuilds a CSV that does not from the JSON.
"""
from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path
from typing import Any, Mapping, Sequence

from rollout_lab.measure.spread import beyond_spread, sample_spread
from rollout_lab.workspace import (check_record_pair, pair_paths, read_json_file, restore_record_csv,
                                   write_record)

# the HF peers a sweep times beside our routes (measure.paths runs them): a record's paths that are
# neither Auto nor a peer are our manual routes
PEER_PATHS = ("hf_static", "hf_generate_batch")
# the engine profile's fields a results row inlines
PROFILE_FIELDS = ("planning_ms", "prefill_ms", "decode_ms", "cache_ms", "total_ms",
                  "num_prefill_forwards", "num_decode_forwards", "num_generated_tokens")


def workload_summary(results: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """One workload's Auto route, and Auto against the best manual path and the best peer, as
    ratios of medians; ``beyond_spread`` says, per path, whether its IQR and Auto's are disjoint
    (a ratio whose paths overlap is noise, not a ranking)."""
    def best(names):
        timed = [(results[p]["median_ms"], p) for p in names if results.get(p, {}).get("median_ms") is not None]
        return min(timed) if timed else (None, None)

    auto_entry = results.get("auto", {})
    auto = auto_entry.get("median_ms")
    manual_ms, manual = best([p for p in results if p != "auto" and p not in PEER_PATHS])  # our manual routes
    peer_ms, peer = best(PEER_PATHS)
    over_manual = auto / manual_ms if auto is not None and manual_ms else None
    separated = {p: beyond_spread(auto_entry, r) for p, r in results.items()
                 if p != "auto" and auto is not None and r.get("median_ms") is not None}
    return {
        "auto_route": auto_entry.get("route"),
        "best_manual_path": manual, "best_peer_path": peer,
        "auto_over_best_manual": over_manual,
        "auto_over_best_peer": auto / peer_ms if auto is not None and peer_ms else None,
        "regression": None if over_manual is None else max(0.0, over_manual - 1.0),
        "auto_vs_best_manual_beyond_spread": separated.get(manual),
        "auto_vs_best_peer_beyond_spread": separated.get(peer),
        "beyond_spread": separated,
    }


def summarize(record: Mapping[str, Any]) -> dict[str, Any]:
    """Per-workload summaries, and the worst regression of Auto against the best manual path."""
    rows = summary_table(record)
    rated = [r for r in rows if r["regression"] is not None]
    worst = max(rated, key=lambda r: r["regression"], default=None)
    return {
        "workloads": rows,
        "worst_regression": None if worst is None else {
            "workload": worst["workload"], "regression": worst["regression"],
            "auto_over_best_manual": worst["auto_over_best_manual"],
        },
    }


def summary_table(record: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One flat row per workload: Auto / best manual (also as ``auto_vs_best``), Auto / best peer."""
    rows = []
    for name, w in record["workloads"].items():
        s = w["summary"]
        flat = {k: v for k, v in s.items() if k != "beyond_spread"}  # a dict: the record keeps it
        rows.append({"workload": name, "num_requests": w["num_requests"], **flat,
                     "auto_vs_best": s["auto_over_best_manual"]})
    return rows


def results_table(record: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One flat row per (workload, path), profile fields inlined: for plots and the CSV."""
    rows = []
    for name, w in record["workloads"].items():
        for path, r in w["paths"].items():
            profile = r.get("profile") or {}
            rows.append({
                "workload": name, "path": path, "num_requests": w["num_requests"],
                "padding_share": w["padding_share"], "median_ms": r.get("median_ms"),
                "q1_ms": r.get("q1_ms"), "q3_ms": r.get("q3_ms"), "iqr_ms": r.get("iqr_ms"),
                "mean_ms": r.get("mean_ms"), "std_ms": r.get("std_ms"),
                "samples_ms": ";".join(f"{x:.3f}" for x in r.get("samples_ms") or []),
                "tokens_per_s": r.get("tokens_per_s"), "peak_mem_bytes": r.get("peak_mem_bytes"),
                "route": r.get("route"), "num_buckets": None if r.get("buckets") is None else len(r["buckets"]),
                "buckets": None if r.get("buckets") is None else " ".join(f"{b}x{wd}" for b, wd in r["buckets"]),
                "matches_nocb": r.get("matches_nocb"), "matches_oracle": r.get("matches_oracle"),
                "skipped": r.get("skipped"),
                **{f: profile.get(f) for f in PROFILE_FIELDS},
            })
    return rows


def write_results(record: dict[str, Any], stem: str | os.PathLike) -> tuple[Path, Path]:
    """Write ``<stem>.json`` and ``<stem>.csv`` as a pair (``workspace.write_record``: CSV first,
    JSON last, one ``run_id``, set in ``record``)."""
    paths = pair_paths(stem)
    write_record(paths, record, results_table(record))
    return paths


def load_results(path: str | os.PathLike) -> dict[str, Any]:
    """A record written by ``write_results`` (``path`` may be the stem or the .json file)."""
    return load_record(pair_paths(path)[0], "sweep")


def recover_results(stem: str | os.PathLike) -> dict[str, Any]:
    """The sweep record at ``stem`` to resume, read from its JSON (the commit point of a pair); a
    CSV that is not the one the JSON derives (a sweep killed between the two writes, a file cut
    short or missing) is rebuilt from it, said on stderr. Call it holding the output's lock."""
    paths = pair_paths(stem)
    record = read_record(paths[0], "sweep")
    if restore_record_csv(paths, record, results_table(record)):
        print(f"rebuilt {paths[1]} from {paths[0]}: it was not that record's CSV (a write was interrupted "
              "between the two files)", file=sys.stderr)
    return record


def join_sweeps(records: Sequence[Mapping[str, Any]], names: Sequence[str]) -> dict[str, Any]:
    """One record from sweeps of the same workloads run in separate processes (HF's compiled peer
    runs in its own: its CUDA-graph trees must not share a process with our captures).

    The joined record holds the workloads that every record holds (a sweep cut by a time limit
    lacks its last ones), in the first record's order; ``dropped_workloads`` names the others per
    record, with a warning. A shared workload must have the same prompt lengths in every record, and
    no path may come twice. Entries without a median (records before the medians) get it from
    their samples; each workload's summary is recomputed over the joined paths. ``provenance`` is
    the first record's; ``joined`` names every source (``names``) with its git sha, date and paths."""
    if not records or len(records) != len(names):
        raise ValueError(f"join_sweeps needs one name per record, got {len(records)} records and {len(names)} names")
    first = records[0]
    common = [w for w in first["workloads"] if all(w in r["workloads"] for r in records)]
    if not common:
        raise ValueError("the records share no workload: " + "; ".join(
            f"{name} has {list(r['workloads'])}" for r, name in zip(records, names)))
    dropped = {name: [w for w in r["workloads"] if w not in common] for r, name in zip(records, names)}
    dropped = {name: ws for name, ws in dropped.items() if ws}
    if dropped:
        warnings.warn("join_sweeps keeps the workloads every record holds; left out: " + "; ".join(
            f"{ws} of {name}" for name, ws in dropped.items()), stacklevel=2)
    joined = {"kind": "sweep", "provenance": dict(first["provenance"]), "config": dict(first["config"]),
              "workloads": {}, "joined": [], "dropped_workloads": dropped}
    for record, name in zip(records, names):
        for workload in common:
            entry = record["workloads"][workload]
            if entry["lengths"] != first["workloads"][workload]["lengths"]:
                raise ValueError(f"{name} ran other prompt lengths for {workload!r} than {names[0]}")
            target = joined["workloads"].setdefault(workload, {k: v for k, v in entry.items() if k != "summary"}
                                                    | {"paths": {}})
            for path, result in entry["paths"].items():
                if path in target["paths"]:
                    raise ValueError(f"path {path!r} of {workload!r} is in {name} and in an earlier record")
                spread = {} if result.get("median_ms") is not None or not result.get("samples_ms") \
                    else sample_spread(result["samples_ms"])
                target["paths"][path] = {**result, **spread}
        prov = record["provenance"]
        joined["joined"].append({"file": name, "git_sha": prov.get("git_sha"), "date": prov.get("date"),
                                 "paths": list(next(iter(record["workloads"].values()))["paths"])})
    joined["config"]["paths"] = [p for j in joined["joined"] for p in j["paths"]]
    for entry in joined["workloads"].values():
        entry["summary"] = workload_summary(entry["paths"])
    joined["summary"] = summarize(joined)
    return joined


def load_rl_results(path: str | os.PathLike) -> dict[str, Any]:
    """A record written by ``rollout-lab bench rl`` (kind "rl_throughput")."""
    return load_record(Path(path), "rl_throughput")


def load_prefill_routes_results(path: str | os.PathLike) -> dict[str, Any]:
    """A record written by ``rollout-lab bench prefill-routes`` (kind "prefill_routes")."""
    return load_record(Path(path), "prefill_routes")


def load_decode_step_results(path: str | os.PathLike) -> dict[str, Any]:
    """A record written by ``rollout-lab bench decode-step`` (kind "decode_step")."""
    return load_record(Path(path), "decode_step")


def load_grpo_results(path: str | os.PathLike) -> dict[str, Any]:
    """A GRPO record (kind "grpo") of ``measure.grpo.run_grpo``: ``rollout-lab bench grpo`` or notebook 03."""
    return load_record(Path(path), "grpo")


MAX_RECORD_BYTES = 256 * 2**20  # a sweep with every profile is ~100 KiB; refuse anything absurd


def shape_settings(name: str, shape: Mapping[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
    """A notebook's ``<name>`` parameter (a benchmark's settings, e.g. ``grpo_shape``) over the
    benchmark's ``defaults``; ValueError naming the settings it does not know and the valid ones."""
    unknown = sorted(set(shape) - set(defaults))
    if unknown:
        raise ValueError(f"{name} has unknown settings {unknown}; valid: {', '.join(defaults)}")
    return {**defaults, **shape}


def load_record(path: Path, kind: str) -> dict[str, Any]:
    """A record of ``kind`` read from ``path`` and checked against its CSV twin."""
    record = read_record(path, kind)
    check_record_pair(path, record=record)
    return record


def read_record(path: Path, kind: str | tuple[str, ...]) -> dict[str, Any]:
    """A record of ``kind`` (or of one of several kinds) read from its JSON ``path`` alone (its CSV
    twin is not looked at)."""
    kinds = (kind,) if isinstance(kind, str) else tuple(kind)
    record = read_json_file(path, what="results file", max_bytes=MAX_RECORD_BYTES)
    if not isinstance(record, dict) or record.get("kind") not in kinds:
        raise ValueError(f"{str(path)!r} is not a {' or '.join(kinds)} record (kind not in {list(kinds)})"
                         if len(kinds) > 1 else f"{str(path)!r} is not a {kind} record (kind != {kind!r})")
    return record


def rl_throughput_rows(record: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One row per path of an RL throughput record: E2E, output tok/s, decode ms per step, memory;
    ``git_sha`` (7 characters) names the code that ran, for tables that join several records."""
    rows = []
    sha = str(record.get("provenance", {}).get("git_sha") or "")[:7]
    for path, res in record["results"].items():
        peak = res.get("peak_memory_bytes")
        rows.append({"path": path, "git_sha": sha, "mean_ms": res.get("mean_ms"),
                     "output_tokens_per_s": res.get("output_tokens_per_s"),
                     "first_call_ms": res.get("first_call_ms"), "decode_ms_per_step": res.get("decode_ms_per_step"),
                     "num_slots": res.get("num_slots"), "peak_memory_gb": None if peak is None else peak / 1e9,
                     "skipped": res.get("skipped")})
    return rows


def decode_step_rows(record: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One row per (case, variant) of a decode-step record: median ms per step and its spread, the
    first-call cost (compile and capture) and which levers were on."""
    return [{"case": case, "variant": variant, "step_ms_median": r["step_ms_median"],
             "step_ms_stdev": r["step_ms_stdev"], "first_call_ms": r["first_call_ms"],
             "spans": r["spans"], "compiled": r["compiled"]}
            for case, variants in record["cases"].items() for variant, r in variants.items()]


def grpo_rows(record: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One row per timed sample and one mean row per path of a GRPO record: E2E ms, output tokens/s,
    the peak memory over the weights and how many rows each path prefilled."""
    rows = []
    tokens = record["workload"]["num_generated_tokens"]
    for path, res in record["results"].items():
        peak = res["peak_memory_bytes"]
        common = {"peak_memory_mib": None if peak is None else round(peak / 2**20, 1),
                  "num_prefill_rows": res["num_prefill_rows"], "num_replicated_rows": res["num_replicated_rows"],
                  "route": res["route"]}
        for rep, ms in enumerate(res["ms"], 1):
            rows.append({"path": path, "statistic": "sample", "rep": rep, "ms": round(ms, 3),
                         "tokens_per_s": round(tokens / (ms / 1e3), 1), **common})
        rows.append({"path": path, "statistic": "mean", "rep": None, "ms": round(res["mean_ms"], 3),
                     "tokens_per_s": round(res["tokens_per_s"], 1), **common})
    return rows


HF_COLUMNS = {"nocb": "hf_generate", "hf_static": "hf_static", "hf_generate_batch": "hf_generate_batch"}


def whole_table_rows(
    sweeps: Sequence[tuple[str, Mapping[str, Any]]] = (), *, rl: Sequence[tuple[str, Mapping[str, Any]]] = (),
    grpo: Sequence[tuple[str, Mapping[str, Any]]] = (),
) -> list[dict[str, Any]]:
    """The whole table: one row per workload of every record given as (name, record), ours against
    each HF peer that record holds, in ms of the whole call (a sweep's median, a benchmark's mean).

    Ours is Auto in a sweep, ``ours`` in an RL record and shared prefill in a GRPO one. The HF columns
    are ``hf_generate`` (a sweep's nocb route is HF ``generate`` on the padded batch; a GRPO record's
    ``generate(num_return_sequences)``), ``hf_static`` and ``hf_generate_batch``; a peer that the
    record lacks is None. ``speedup_over_best_hf`` is the fastest HF column over ours, and every row
    names its record (the file names) and git sha."""
    def ms(result: Mapping[str, Any] | None) -> float | None:
        if result is None or result.get("skipped"):
            return None
        return result.get("median_ms") if result.get("median_ms") is not None else result.get("mean_ms")

    def row(workload, record, name, *, requests, tokens, ours_path, ours, peers):
        hf = {col: ms(peers.get(col)) for col in HF_COLUMNS.values()}
        ours_ms = ms(ours)
        best = min(((v, k) for k, v in hf.items() if v), default=None)
        prov = record.get("provenance", {})
        return {"workload": workload, "model": record["config"].get("model") or prov.get("model_name"),
                "requests": requests, "output_tokens": tokens, "ours": ours_path, "ours_ms": ours_ms,
                **{f"{col}_ms": v for col, v in hf.items()},
                "ours_tokens_per_s": None if not ours_ms else tokens / (ours_ms / 1e3),
                "best_hf": None if best is None else best[1],
                "speedup_over_best_hf": None if best is None or not ours_ms else best[0] / ours_ms,
                "record": " + ".join(Path(part).name for part in name.split(" + ")),
                "git_sha": str(prov.get("git_sha") or "")[:7]}

    rows = []
    for name, record in sweeps:
        new_tokens = record["config"]["max_new_tokens"]
        for workload, entry in record["workloads"].items():
            paths = entry["paths"]
            rows.append(row(f"{workload} x {new_tokens}", record, name, requests=entry["num_requests"],
                            tokens=entry["num_requests"] * new_tokens, ours_path="auto", ours=paths.get("auto"),
                            peers={HF_COLUMNS[p]: r for p, r in paths.items() if p in HF_COLUMNS}))
    for name, record in rl:
        work = record["workload"]
        rows.append(row(f"RL shape ({work['num_requests']} requests)", record, name, requests=work["num_requests"],
                        tokens=work["num_output_tokens"], ours_path="ours", ours=record["results"].get("ours"),
                        peers={"hf_generate_batch": record["results"].get("hf_generate_batch")}))
    for name, record in grpo:
        work = record["workload"]
        rows.append(row(f"GRPO {work['num_prompts']} x {work['num_samples']} x {record['config']['max_new_tokens']}",
                        record, name, requests=work["num_rows"], tokens=work["num_generated_tokens"],
                        ours_path="shared", ours=record["results"].get("shared"),
                        peers={"hf_generate": record["results"].get("hf_generate")}))
    return rows


def load_sweeps(files: str | Sequence[str | Sequence[str]] | None) -> list[tuple[str, dict[str, Any]]]:
    """(name, record) for each entry of ``files``: a sweep JSON, or a list of them joined by
    ``join_sweeps`` (e.g. a sweep and its HF peer run in its own process); None gives none."""
    if files is None:
        return []
    out = []
    for entry in [files] if isinstance(files, (str, os.PathLike)) else files:
        if isinstance(entry, (str, os.PathLike)):
            out.append((str(entry), load_results(entry)))
        else:
            names = [str(f) for f in entry]
            out.append((" + ".join(names), join_sweeps([load_results(f) for f in names], names)))
    return out


def e2e_table(record: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The reference's table: one row per workload, median E2E ms per path, Auto's route and
    Auto/best (and whether Auto and the best manual path differ by more than their spread)."""
    rows = results_table(record)
    summary = {r["workload"]: r for r in summary_table(record)}
    out = []
    for name, w in record["workloads"].items():
        row: dict[str, Any] = {"workload": name, "num_requests": w["num_requests"],
                               "padding_share": round(w["padding_share"], 3)}
        for r in rows:
            if r["workload"] == name:
                row[f"{r['path']}_ms"] = r["median_ms"] if r.get("median_ms") is not None else r["mean_ms"]
        s = summary[name]
        row.update({"auto_route": s["auto_route"], "best_manual_path": s["best_manual_path"],
                    "auto_vs_best": s["auto_vs_best"], "auto_over_best_peer": s["auto_over_best_peer"],
                    "auto_vs_best_beyond_spread": s.get("auto_vs_best_manual_beyond_spread")})
        out.append(row)
    return out
