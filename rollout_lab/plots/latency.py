"""The latency figures of notebook 03: end-to-end time per path, throughput and memory, and the
phase breakdown of our routes, from a sweep record's rows (``measure.sweep.results_table``)::

    from rollout_lab.plots.latency import plot_e2e
    fig = plot_e2e(results_table(record), summary_table(record))
"""
from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.figure import Figure

from rollout_lab.engine.config import MODES
from rollout_lab.plots.style import PALETTE, subplot_grid

# ---------------------------------------------------------------- 03: latency tables

def _by_workload(rows: Sequence[Mapping[str, Any]]) -> tuple[list[str], list[str]]:
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    found = list(dict.fromkeys(r["path"] for r in rows))
    ordered = [p for p in MODES if p in found] + [p for p in found if p not in MODES]
    return workloads, ordered


def _value(rows, workload, path, key):
    for r in rows:
        if r["workload"] == workload and r["path"] == path:
            v = r.get(key)
            return math.nan if v is None or v == "" else float(v)
    return math.nan


def _grouped_bars(ax, rows, key, *, scale: float = 1.0, log: bool = False) -> None:
    workloads, path_names = _by_workload(rows)
    width = 0.8 / max(1, len(path_names))
    x = np.arange(len(workloads))
    for c, path in enumerate(path_names):
        vals = [_value(rows, w, path, key) * scale for w in workloads]
        ax.bar(x + (c - (len(path_names) - 1) / 2) * width, vals, width=width, label=path, color=PALETTE(c % 10))
    ax.set_xticks(x)
    ax.set_xticklabels(workloads, rotation=30, ha="right", fontsize=8)
    if log:
        ax.set_yscale("log")
    ax.grid(axis="y", alpha=0.3)


def plot_e2e(rows: Sequence[Mapping[str, Any]], summary: Sequence[Mapping[str, Any]] = ()) -> Figure:
    """End-to-end ms per path and workload; Auto/best and Auto's route annotated above each group."""
    fig, ax = plt.subplots(figsize=(max(7, 1.3 * len({r['workload'] for r in rows}) + 3), 4.4))
    _grouped_bars(ax, rows, "mean_ms", log=True)
    ax.set_ylabel("end-to-end ms (mean)")
    workloads, _ = _by_workload(rows)
    for i, w in enumerate(workloads):
        s = next((r for r in summary if r["workload"] == w), None)
        if s is not None and s.get("auto_vs_best") not in (None, ""):
            ax.annotate(f"{float(s['auto_vs_best']):.2f}x\n{s.get('auto_route', '')}", (i, 1.0),
                        xycoords=("data", "axes fraction"), ha="center", va="bottom", fontsize=7)
    ax.legend(fontsize=7, ncol=len(MODES), loc="upper left", bbox_to_anchor=(0, -0.28))
    ax.set_title("E2E per path (annotation: Auto / best manual path, and Auto's route)", fontsize=10, pad=24)
    fig.tight_layout()
    return fig


def plot_throughput_memory(rows: Sequence[Mapping[str, Any]]) -> Figure:
    """Generated tokens/s and peak memory (MiB) per path and workload."""
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(13, 4.2))
    _grouped_bars(ax_t, rows, "tokens_per_s")
    ax_t.set_ylabel("generated tokens / s")
    _grouped_bars(ax_m, rows, "peak_mem_bytes", scale=1 / 2**20)
    ax_m.set_ylabel("peak memory (MiB)")
    if all(r.get("peak_mem_bytes") in (None, "") for r in rows):
        ax_m.text(0.5, 0.5, "peak memory not measured on this device (CUDA only)", transform=ax_m.transAxes,
                  ha="center", va="center", fontsize=9, color="0.4")
    ax_t.legend(fontsize=7)
    fig.tight_layout()
    return fig


def plot_breakdown(rows: Sequence[Mapping[str, Any]]) -> Figure:
    """Stacked prefill / decode / cache ms per path, one panel per workload; prefill forwards on top."""
    workloads, path_names = _by_workload(rows)
    fig, axes = subplot_grid(len(workloads), ncols=3, size=(4.4, 3.4))
    parts = (("prefill_ms", "prefill"), ("decode_ms", "decode"), ("cache_ms", "cache"))
    for ax, w in zip(axes, workloads):
        bottom = np.zeros(len(path_names))
        for c, (key, name) in enumerate(parts):
            vals = np.nan_to_num([_value(rows, w, p, key) for p in path_names])
            ax.bar(path_names, vals, bottom=bottom, label=name, color=plt.get_cmap("Set2")(c))
            bottom += vals
        for i, p in enumerate(path_names):
            n = _value(rows, w, p, "num_prefill_forwards")
            if math.isfinite(n):
                ax.annotate(f"{int(n)} fwd", (i, bottom[i]), ha="center", va="bottom", fontsize=7)
        ax.set_title(w, fontsize=9)
        ax.set_ylabel("ms")
        ax.tick_params(axis="x", labelrotation=30, labelsize=7)
        ax.margins(y=0.15)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    return fig


def plot_rl_throughput(rows: Sequence[Mapping[str, Any]], *, title: str = "") -> Figure:
    """Output tok/s and decode ms per step per path of an RL throughput record
    (``measure.sweep.rl_throughput_rows``); a skipped path is named, not drawn."""
    ran = [r for r in rows if r.get("output_tokens_per_s") is not None]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 0.9 + 0.45 * max(4, len(ran))))
    several = len({r.get("git_sha") for r in rows}) > 1  # rows from several records: name the code
    names = [f"{r['path']} @{r['git_sha']}" if several else r["path"] for r in ran]
    left.barh(names, [r["output_tokens_per_s"] for r in ran], color=[PALETTE(i) for i in range(len(ran))])
    for i, r in enumerate(ran):
        left.annotate(f"{r['output_tokens_per_s']:,.0f}", (r["output_tokens_per_s"], i), va="center", fontsize=8)
    left.set_xlabel("output tokens / s")
    left.margins(x=0.2)
    steps = [r for r in ran if r.get("decode_ms_per_step") is not None]
    right.barh([names[ran.index(r)] for r in steps], [r["decode_ms_per_step"] for r in steps], color="0.5")
    right.set_xlabel("decode ms per step (mean over the call)")
    skipped = [r["path"] for r in rows if r.get("skipped")]
    if skipped:
        left.set_title(f"skipped: {', '.join(skipped)}", fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def plot_decode_steps(rows: Sequence[Mapping[str, Any]], *, title: str = "") -> Figure:
    """Median decode ms per step (error bar: one standard deviation over the timed steps) per case
    and variant of a decode-step record (``measure.sweep.decode_step_rows``)."""
    cases = list(dict.fromkeys(r["case"] for r in rows))
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    fig, ax = plt.subplots(figsize=(3 + 1.6 * len(cases), 3.4))
    width = 0.8 / len(variants)
    for j, variant in enumerate(variants):
        for i, case in enumerate(cases):
            r = next((r for r in rows if r["case"] == case and r["variant"] == variant), None)
            if r is None:
                continue
            x = i + (j - (len(variants) - 1) / 2) * width
            ax.bar(x, r["step_ms_median"], width, yerr=r["step_ms_stdev"], color=PALETTE(j),
                   label=variant if i == 0 else None)
            ax.annotate(f"{r['step_ms_median']:.2f}", (x, r["step_ms_median"]), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(cases)), [f"{c} (slots x span)" for c in cases])
    ax.set_ylabel("ms per decode step (median)")
    ax.legend(fontsize=7)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return fig


def plot_prefill_routes(rows: Sequence[Mapping[str, Any]], *, title: str = "") -> Figure:
    """Measured prefill ms against the batch's prompt tokens, one line per route and distribution
    (``measure.prefill_routes.prefill_route_rows``); error bars: one standard deviation."""
    fig, ax = plt.subplots(figsize=(6.8, 3.8))
    styles = {"lognormal": "-", "bimodal": "--"}
    for k, route in enumerate(dict.fromkeys(r["route"] for r in rows)):
        for kind, style in styles.items():
            mine = sorted((r for r in rows if r["route"] == route and r["distribution"] == kind),
                          key=lambda r: r["num_tokens"])
            if mine:
                ax.errorbar([r["num_tokens"] for r in mine], [r["mean_ms"] for r in mine],
                            yerr=[r["stdev_ms"] for r in mine], color=PALETTE(k), linestyle=style, marker="o",
                            markersize=3, capsize=2, label=f"{route}, {kind}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens in the batch")
    ax.set_ylabel("prefill call (ms)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    return fig
