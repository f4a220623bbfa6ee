"""A sweep record once measured: its summaries, its flat tables, and its JSON + CSV files.

    from rollout_lab.bench_records import load_results, results_table, summary_table
    record = load_results("data/results/tiny")  # the stem, or the .json file
    rows = results_table(record)  # one row per (workload, path), profile fields inlined

``write_results`` serialises both files before writing either, and writes each atomically.
No torch; the record is plain JSON data.
"""
from __future__ import annotations

import csv
import io
import json
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

from rollout_lab.bench_runner import MANUAL_PATHS, PEER_PATHS
from rollout_lab.io import write_text_atomic

PROFILE_FIELDS = ("planning_ms", "prefill_ms", "decode_ms", "cache_ms", "total_ms",
                  "num_prefill_forwards", "num_decode_forwards", "num_generated_tokens")


def workload_summary(results: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """One workload's Auto route, and Auto against the best manual path and the best peer."""
    def best(names):
        timed = [(results[p]["mean_ms"], p) for p in names if results.get(p, {}).get("mean_ms") is not None]
        return min(timed) if timed else (None, None)

    auto = results.get("auto", {}).get("mean_ms")
    manual_ms, manual = best(MANUAL_PATHS)
    peer_ms, peer = best(PEER_PATHS)
    over_manual = auto / manual_ms if auto is not None and manual_ms else None
    return {
        "auto_route": results.get("auto", {}).get("route"),
        "best_manual_path": manual, "best_peer_path": peer,
        "auto_over_best_manual": over_manual,
        "auto_over_best_peer": auto / peer_ms if auto is not None and peer_ms else None,
        "regression": None if over_manual is None else max(0.0, over_manual - 1.0),
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
        rows.append({"workload": name, "num_requests": w["num_requests"], **s,
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
                "padding_share": w["padding_share"], "mean_ms": r.get("mean_ms"),
                "std_ms": r.get("std_ms"), "samples_ms": ";".join(f"{x:.3f}" for x in r.get("samples_ms") or []),
                "tokens_per_s": r.get("tokens_per_s"), "peak_mem_bytes": r.get("peak_mem_bytes"),
                "route": r.get("route"), "num_buckets": None if r.get("buckets") is None else len(r["buckets"]),
                "buckets": None if r.get("buckets") is None else " ".join(f"{b}x{wd}" for b, wd in r["buckets"]),
                "matches_nocb": r.get("matches_nocb"), "matches_oracle": r.get("matches_oracle"),
                "skipped": r.get("skipped"),
                **{f: profile.get(f) for f in PROFILE_FIELDS},
            })
    return rows


def _csv_text(rows: Sequence[Mapping[str, Any]]) -> str:
    buffer = io.StringIO()
    fieldnames = list(dict.fromkeys(k for row in rows for k in row))
    writer = csv.DictWriter(buffer, fieldnames=fieldnames, lineterminator="\n")
    writer.writeheader()
    writer.writerows({k: "" if v is None else v for k, v in row.items()} for row in rows)
    return buffer.getvalue()


def write_results(record: Mapping[str, Any], stem: str | os.PathLike) -> tuple[Path, Path]:
    """Write ``<stem>.json`` and ``<stem>.csv`` atomically; both are serialised before either is written."""
    from rollout_lab.io import _jsonable

    stem = Path(stem)
    if stem.suffix in (".json", ".csv"):
        stem = stem.with_suffix("")
    json_text = json.dumps(record, indent=2, default=_jsonable) + "\n"
    csv_text = _csv_text(results_table(record))
    json_path = write_text_atomic(stem.with_name(stem.name + ".json"), json_text)
    csv_path = write_text_atomic(stem.with_name(stem.name + ".csv"), csv_text)
    return json_path, csv_path


def load_results(path: str | os.PathLike) -> dict[str, Any]:
    """A record written by ``write_results`` (``path`` may be the stem or the .json file)."""
    path = Path(path)
    if path.suffix != ".json":
        path = path.with_name(path.name + ".json") if path.suffix != ".csv" else path.with_suffix(".json")
    if not path.is_file():
        raise ValueError(f"results file {str(path)!r} does not exist")
    record = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(record, dict) or record.get("kind") != "sweep":
        raise ValueError(f"{str(path)!r} is not a sweep record (kind != 'sweep')")
    return record
