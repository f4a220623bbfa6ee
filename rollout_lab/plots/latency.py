"""The latency figures of notebook 03: end-to-end time per path, throughput and memory, and the
phase breakdown of our routes, from a sweep record's rows (``measure.records.results_table``).
Timings are drawn as medians with their interquartile range and every sample (seaborn), on a linear
axis unless they span 10x; what was not measured is said in words::

    from rollout_lab.plots.latency import plot_e2e
    fig = plot_e2e(results_table(record), summary_table(record))
"""
from __future__ import annotations

import math
import textwrap
from typing import Any, Mapping, Sequence

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import seaborn as sns
from matplotlib.figure import Figure

from rollout_lab.engine.api.config import MODES
from rollout_lab.plots.style import (PALETTE, choose_scale, draw_not_measured, slanted_ticks, speed_words,
                                     subplot_grid)

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


def _grouped_bars(ax, rows, key, *, scale: float = 1.0) -> None:
    workloads, path_names = _by_workload(rows)
    width = 0.8 / max(1, len(path_names))
    x = np.arange(len(workloads))
    values = []
    for c, path in enumerate(path_names):
        vals = [_value(rows, w, path, key) * scale for w in workloads]
        values += vals
        ax.bar(x + (c - (len(path_names) - 1) / 2) * width, vals, width=width, label=path, color=PALETTE(c % 10))
    ax.set_xticks(x, workloads)
    slanted_ticks(ax)
    choose_scale(ax, values)
    ax.grid(axis="y", alpha=0.3)


def samples_of(row: Mapping[str, Any]) -> list[float]:
    """A row's timed samples: a list, or the CSV's "1.0;2.0" text; [] for a path not measured."""
    value = row.get("samples_ms")
    if value in (None, ""):
        return []
    return [float(x) for x in (value.split(";") if isinstance(value, str) else value) if x != ""]


def plot_e2e(rows: Sequence[Mapping[str, Any]], summary: Sequence[Mapping[str, Any]] = ()) -> Figure:
    """End-to-end ms per path and workload: bars at the median, the interquartile range as an
    interval and every timed sample as a point (seaborn). Above each group: Auto / best manual path
    (of medians) and Auto's route, marked "within spread" when their IQRs overlap."""
    workloads, path_names = _by_workload(rows)
    fig, ax = plt.subplots(figsize=(max(7, 1.3 * len(workloads) + 3), 4.6))
    long = pd.DataFrame([{"workload": r["workload"], "path": r["path"], "ms": x} for r in rows for x in samples_of(r)])
    if long.empty:
        draw_not_measured(ax, "end-to-end time (no timed samples in these rows)")
        return fig
    timed = [p for p in path_names if p in set(long["path"])]
    colors = {p: PALETTE(path_names.index(p) % 10) for p in timed}
    sns.barplot(data=long, x="workload", y="ms", hue="path", order=workloads, hue_order=timed, palette=colors,
                estimator="median", errorbar=("pi", 50), capsize=0.15, err_kws={"linewidth": 1.0, "color": "0.2"},
                alpha=0.75, ax=ax)
    sns.stripplot(data=long, x="workload", y="ms", hue="path", order=workloads, hue_order=timed,
                  palette={p: "black" for p in timed}, dodge=True, size=2.5, alpha=0.6, legend=False, ax=ax)
    scale = choose_scale(ax, long.groupby(["workload", "path"])["ms"].median())
    ax.set_ylim(top=long["ms"].max() * (4.0 if scale == "log" else 1.35))  # room for the legend, inside
    ax.set_xlabel("")
    ax.set_ylabel("end-to-end ms (bar: median; line: IQR; dots: samples)")
    slanted_ticks(ax)
    ax.grid(axis="y", alpha=0.3)
    for i, w in enumerate(workloads):
        s = next((r for r in summary if r["workload"] == w), None)
        if s is not None and s.get("auto_vs_best") not in (None, ""):
            beyond = s.get("auto_vs_best_manual_beyond_spread")
            noise = "\n(within spread)" if beyond in (False, "False") else ""
            # auto_vs_best is Auto's time over the best manual path's: its inverse is Auto's speedup
            ax.annotate(f"{speed_words(1 / float(s['auto_vs_best']))}\n{s.get('auto_route', '')}{noise}", (i, 1.0),
                        xycoords=("data", "axes fraction"), ha="center", va="bottom", fontsize=7)
    ax.legend(fontsize=7, ncol=min(len(timed), 4), loc="upper left")
    missing = [p for p in path_names if p not in timed]
    note = f"\nnot measured: {', '.join(missing)}" if missing else ""
    within = any(s.get("auto_vs_best_manual_beyond_spread") in (False, "False") for s in summary)
    ax.set_title(f"E2E per path (above: Auto against the best manual path, of medians, and Auto's route){note}",
                 fontsize=10, pad=30 + 9 * within)  # room for the two or three lines above each group
    fig.tight_layout()
    return fig


def plot_throughput_memory(rows: Sequence[Mapping[str, Any]]) -> Figure:
    """Generated tokens/s and peak memory (MiB) per path and workload. Peak memory is a CUDA
    allocator reading: where no row has one (a CPU run) the figure is tokens/s alone, and says why."""
    has_memory = any(r.get("peak_mem_bytes") not in (None, "") for r in rows)
    if has_memory:
        fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(13, 4.2))
        _grouped_bars(ax_m, rows, "peak_mem_bytes", scale=1 / 2**20)
        ax_m.set_ylabel("peak memory (MiB)")
    else:  # an empty half was drawn here: the reason goes in the title instead
        fig, ax_t = plt.subplots(figsize=(8, 4.2))
        ax_t.set_title("peak memory not measured: it is read from the CUDA allocator", fontsize=9, color="0.3")
    _grouped_bars(ax_t, rows, "tokens_per_s")
    ax_t.set_ylabel("generated tokens / s")
    # one legend above the panels: inside either one it covered bars of every path
    handles, labels = ax_t.get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 1.0), ncol=min(len(labels), 9),
               fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
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
            label = f"{int(n)} fwd" if math.isfinite(n) else "not\nprofiled"  # HF peers have no profile
            ax.annotate(label, (i, bottom[i]), ha="center", va="bottom", fontsize=7)
        ax.set_title(w, fontsize=9)
        ax.set_ylabel("ms")
        slanted_ticks(ax, fontsize=7)
        ax.margins(y=0.15)
    # one legend above the panels (in the first one it sat on its bars and their labels)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 1.0), ncol=len(labels), fontsize=8,
               frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.3 / fig.get_figheight()))
    return fig


def plot_rl_throughput(rows: Sequence[Mapping[str, Any]], *, title: str = "") -> Figure:
    """Output tok/s and decode ms per step per path of an RL throughput record
    (``measure.records.rl_throughput_rows``); a skipped path is named, not drawn."""
    ran = [r for r in rows if r.get("output_tokens_per_s") is not None]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 0.9 + 0.45 * max(4, len(ran))))
    several = len({r.get("git_sha") for r in rows}) > 1  # rows from several records: name the code
    names = [f"{r['path']} @{r['git_sha']}" if several else r["path"] for r in ran]
    left.barh(names, [r["output_tokens_per_s"] for r in ran], color=[PALETTE(i) for i in range(len(ran))])
    for i, r in enumerate(ran):
        left.annotate(f"{r['output_tokens_per_s']:,.0f}", (r["output_tokens_per_s"], i), xytext=(3, 0),
                      textcoords="offset points", va="center", fontsize=8)
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


def plot_occupancy(rows: Sequence[Mapping[str, Any]], *, title: str = "") -> Figure:
    """Output tok/s, and how full the slots ran, per path of an EOS long-tail record
    (``measure.long_tail.long_tail_rows``): live rows per step over the slots for the whole call and
    for the steps taken while rows still waited in the queue (the route's own effect; none when
    every row fits at once)."""
    names = [f"{r['path']} ({r['slots']} slots)" for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 0.9 + 0.55 * max(3, len(rows))))
    left.barh(names, [r["output_tokens_per_s"] for r in rows], color=[PALETTE(i) for i in range(len(rows))])
    for i, r in enumerate(rows):
        left.annotate(f"{r['output_tokens_per_s']:,.0f}", (r["output_tokens_per_s"], i), xytext=(3, 0),
                      textcoords="offset points", va="center", fontsize=8)
    left.set_xlabel("output tokens / s")
    left.margins(x=0.2)
    y = np.arange(len(rows))
    whole = [r["occupancy"] for r in rows]
    queued = [r["queued_occupancy"] if r["queued_occupancy"] else np.nan for r in rows]
    right.barh(y - 0.2, whole, height=0.4, color="0.55", label="every decode step")
    right.barh(y + 0.2, queued, height=0.4, color=PALETTE(0), label="while rows waited")
    for i, (w, q) in enumerate(zip(whole, queued)):
        right.annotate(f"{w:.0%}", (w, i - 0.2), xytext=(3, 0), textcoords="offset points", va="center", fontsize=8)
        if not np.isnan(q):
            right.annotate(f"{q:.0%}", (q, i + 0.2), xytext=(3, 0), textcoords="offset points", va="center",
                           fontsize=8)
    right.set_yticks(y, [""] * len(rows))
    right.set_xlim(0, 1.2)
    right.set_xlabel("live rows per step / slots")
    # beside the axes: below them it sat on the x label
    right.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def plot_step_cost(rows: Sequence[Mapping[str, Any]], *, title: str = "") -> Figure:
    """Where an EOS long-tail call's decode time goes (``measure.long_tail.step_cost_rows``): ms per
    decode step against the live rows it ran (power-of-two bins, drawn at each bin's top), and each
    bin's share of the path's decode ms. A flat left end is the step's floor at few rows (launches,
    not bytes); the right panel shows how much of the call the tail's few-row steps take."""
    paths = list(dict.fromkeys(r["path"] for r in rows))
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    tops = sorted({r["rows_max"] for r in rows})
    width = 0.8 / max(1, len(paths))
    for k, path in enumerate(paths):
        mine = [r for r in rows if r["path"] == path]
        left.plot([r["rows_max"] for r in mine], [r["ms_per_step"] for r in mine], marker="o", color=PALETTE(k),
                  label=f"{path} ({mine[0]['slots']} slots)")
        at = {r["rows_max"]: r["share_of_decode_ms"] for r in mine}
        right.bar(np.arange(len(tops)) + (k - (len(paths) - 1) / 2) * width, [at.get(t, 0.0) for t in tops], width,
                  color=PALETTE(k))
    left.set_xscale("log", base=2)
    left.set_xticks(tops, [str(t) for t in tops])
    left.set_xlabel("live rows in the step (bin top)")
    left.set_ylabel("ms per decode step")
    left.set_ylim(bottom=0)
    left.legend(loc="upper left", fontsize=8, frameon=False)
    left.set_ylim(top=left.get_ylim()[1] * 1.35)  # room for the legend above the lines
    right.set_xticks(np.arange(len(tops)), [str(t) for t in tops])
    right.set_xlabel("live rows in the step (bin top)")
    right.set_ylabel("share of the decode ms")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def plot_trainer_loop(rows: Sequence[Mapping[str, Any]], *, title: str = "") -> Figure:
    """Per iteration of a trainer-loop record (``measure.trainer_loop.trainer_loop_rows``): the first
    rollout after an optimizer step against the same call again (what a weight sync costs) and the
    train step, in ms; and the rollout's logprobs against the trainer's forward (mean and max |Δ|,
    nats; 0 is drawn at the axis floor)."""
    its = [r["iteration"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.4))
    x = np.arange(len(rows))
    for k, (key, label) in enumerate((("first_rollout_ms", "rollout after a step"),
                                      ("steady_rollout_ms", "the same rollout again"), ("train_ms", "train step"))):
        left.bar(x + (k - 1) * 0.27, [r[key] for r in rows], 0.27, color=PALETTE(k), label=label)
    left.set_xticks(x, [str(i) for i in its])
    left.set_xlabel("iteration")
    left.set_ylabel("ms")
    left.legend(loc="lower left", bbox_to_anchor=(0, 1.02), ncol=3, fontsize=8, frameon=False)
    floor = 1e-9
    for key, label, marker in (("logprob_mean_abs", "mean |Δ|", "o"), ("logprob_max_abs", "max |Δ|", "^")):
        right.plot(x, [max(r[key], floor) for r in rows], marker=marker, label=label)
    if all(r["logprob_max_abs"] == 0 for r in rows):
        right.text(0.5, 0.5, "exactly 0 on every token\n(drawn at the floor)", transform=right.transAxes,
                   ha="center", va="center", fontsize=9)
    right.set_yscale("log")
    right.set_ylim(bottom=floor / 2)
    right.set_xticks(x, [str(i) for i in its])
    right.set_xlabel("iteration")
    right.set_ylabel("rollout − trainer logprob (nats)")
    right.legend(loc="lower left", bbox_to_anchor=(0, 1.02), ncol=2, fontsize=8, frameon=False)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def plot_logprob_modes(rows: Sequence[Mapping[str, Any]], *, title: str = "") -> Figure:
    """Ways of getting the rollout's logprobs, one per row of ``measure.trainer_loop.logprob_mode_rows``.
    Left: what each costs, the steady rollout and the train step in ms (means over the iterations),
    the rollout's time over the first mode's written on its bar. Right: how far the rollout's
    logprobs are from the trainer's forward (nats, log axis): the mean, p99 and max |Δ|, and the max
    with the trainer's forward in micro-batches of 1, 8, 64 and all rows where the record has them;
    an exact 0 is drawn at the axis floor and said in words."""
    names = [textwrap.fill(r["mode"], 14) for r in rows]
    x = np.arange(len(rows))
    fig, (left, right) = plt.subplots(1, 2, figsize=(max(10, 3 + 2.2 * len(rows)), 3.8))
    for k, (key, label) in enumerate((("steady_rollout_ms", "rollout (steady)"), ("train_ms", "train step"))):
        bars = left.bar(x + (k - 0.5) * 0.38, [r[key] for r in rows], 0.38, color=PALETTE(k), label=label)
        if key == "steady_rollout_ms":
            for bar, r in zip(bars, rows):
                left.annotate(f"{r['rollout_vs_first']:.2f}x", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                              ha="center", va="bottom", fontsize=8)
    left.set_xticks(x, names)
    left.set_ylabel("ms (mean over iterations)")
    left.margins(y=0.15)  # room for the ratios above the bars
    left.legend(loc="lower left", bbox_to_anchor=(0, 1.02), ncol=2, fontsize=8, frameon=False)
    left.set_xlabel(f"above the rollout: its time over {rows[0]['mode']}'s", fontsize=8, color="0.3")

    floor = 1e-9
    markers = (("mean_abs", "mean |Δ|", "o"), ("p99_abs", "p99 |Δ|", "s"), ("max_abs", "max |Δ|", "^"))
    for k, (key, label, marker) in enumerate(markers):
        right.scatter(x - 0.12, [max(r[key], floor) for r in rows], marker=marker, color=PALETTE(k), label=label,
                      zorder=3)
    micro_keys = (("micro_1", "1"), ("micro_8", "8"), ("micro_64", "64"), ("micro_all", "all"))
    has_micro = [any(r.get(key) is not None for key, _ in micro_keys) for r in rows]
    for k, (key, size) in enumerate(micro_keys):
        at = [(i + 0.06 + 0.06 * k, max(r[key], floor)) for i, r in enumerate(rows) if r.get(key) is not None]
        if at:
            right.scatter(*zip(*at), marker="x", color=PALETTE(3 + k), s=22,
                          label=f"max, trainer's forward {'on all rows at once' if size == 'all' else f'in {size}-row micro-batches'}")
    values = [r[key] for r in rows for key, _, _ in markers] + \
        [r[key] for r in rows for key, _ in micro_keys if r.get(key) is not None]
    right.set_yscale("log")
    right.set_ylim(floor / 2, max([*values, 1e-6]) * 20)
    for i, r in enumerate(rows):
        zero = r["max_abs"] == 0 and all(r.get(key) in (None, 0) for key, _ in micro_keys)
        words = "exactly 0 on\nevery token\n(at the floor)" if zero else f"{r['equal_share']:.1%} of\ntokens equal"
        right.annotate(words, (i, floor), xytext=(0, 8), textcoords="offset points", ha="center", va="bottom",
                       fontsize=7, color="0.3")
    right.set_xticks(x, names)
    right.set_xlim(-0.6, len(rows) - 0.4)
    right.set_ylabel("|rollout − trainer| logprob (nats)")
    if not any(has_micro):
        right.set_title("micro-batch maxima: not in these records", fontsize=8, loc="right", color="0.3")
    right.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7, frameon=False)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def plot_kv_dtypes(rows: Sequence[Mapping[str, Any]], *, title: str = "") -> Figure:
    """The paged pool's KV dtypes, one per row of ``measure.fidelity.kv_dtype_rows``. Left: output
    tok/s where an RL record gave it, the speed-up over the first measured row written on each bar
    (else says none was given). Right: what the stored dtype moves, teacher-forced (log axis, nats):
    each forced token's mean and max |Δ logprob| against the model's own forward."""
    names = [textwrap.fill(f"{r['variant']} ({r.get('kv_dtype', '?')})", 16) for r in rows]
    x = np.arange(len(rows))
    fig, (left, right) = plt.subplots(1, 2, figsize=(max(9, 3 + 2.0 * len(rows)), 3.6))
    speeds = [r.get("output_tokens_per_s") for r in rows]
    if any(v is not None for v in speeds):
        first = next(v for v in speeds if v is not None)
        bars = left.bar(x, [v or 0 for v in speeds], 0.6, color=PALETTE(0))
        for bar, v in zip(bars, speeds):
            if v is not None:
                left.annotate(f"{v / first:.2f}x", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                              ha="center", va="bottom", fontsize=8)
        left.margins(y=0.15)
        left.set_ylabel("output tok/s")
    else:
        left.text(0.5, 0.5, "no RL record given\n(bench rl --paths ours_paged ours_fp8_kv)", ha="center",
                  va="center", transform=left.transAxes, fontsize=9, color="0.3")
    left.set_xticks(x, names)
    floor = 1e-9
    for k, (key, label, marker) in enumerate((("mean_logprob_error", "mean |Δ logprob|", "o"),
                                              ("max_logprob_error", "max |Δ logprob|", "^"))):
        at = [(i, max(r[key], floor)) for i, r in enumerate(rows) if r.get(key) is not None]
        if at:
            right.scatter(*zip(*at), marker=marker, color=PALETTE(k + 1), label=label, zorder=3)
    right.set_yscale("log")
    right.set_xticks(x, names)
    right.set_xlim(-0.6, len(rows) - 0.4)
    right.set_ylabel("teacher-forced, against the model (nats)")
    right.legend(loc="upper left", fontsize=8, frameon=False)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def plot_decode_steps(rows: Sequence[Mapping[str, Any]], *, title: str = "") -> Figure:
    """Median decode ms per step (error bar: one standard deviation over the timed steps) per case
    and variant of a decode-step record (``measure.records.decode_step_rows``)."""
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
    slanted_ticks(ax)
    ax.set_ylabel("ms per decode step (median)")
    ax.legend(fontsize=7)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return fig


def plot_prefill_routes(rows: Sequence[Mapping[str, Any]], *, title: str = "") -> Figure:
    """Measured prefill ms against the batch's prompt tokens, one line per route and distribution
    (``measure.prefill_routes.prefill_route_rows``): the median and its interquartile range where the
    rows have them, else the mean and one standard deviation (older records)."""
    if any(r.get("median_ms") not in (None, "") for r in rows):
        rows = [dict(r, mean_ms=float(r["median_ms"]), low=float(r["median_ms"]) - float(r["q1_ms"]),
                     high=float(r["q3_ms"]) - float(r["median_ms"])) for r in rows]
        center = "median (IQR)"
    else:
        rows = [dict(r, low=r["stdev_ms"], high=r["stdev_ms"]) for r in rows]
        center = "mean (±1 sd)"
    fig, ax = plt.subplots(figsize=(6.8, 3.8))
    styles = {"lognormal": "-", "bimodal": "--"}
    for k, route in enumerate(dict.fromkeys(r["route"] for r in rows)):
        for kind, style in styles.items():
            mine = sorted((r for r in rows if r["route"] == route and r["distribution"] == kind),
                          key=lambda r: r["num_tokens"])
            if mine:
                ax.errorbar([r["num_tokens"] for r in mine], [r["mean_ms"] for r in mine],
                            yerr=[[r["low"] for r in mine], [r["high"] for r in mine]], color=PALETTE(k),
                            linestyle=style, marker="o", markersize=3, capsize=2, label=f"{route}, {kind}")
        workloads = [r for r in rows if r["route"] == route and r["distribution"] not in styles]
        if workloads:  # a sweep's workloads (measure.prefill_routes.sweep_prefill_rows): points, no line
            ax.scatter([r["num_tokens"] for r in workloads], [r["mean_ms"] for r in workloads], color=PALETTE(k),
                       marker="D", s=18, label=f"{route}, sweep workloads")
    choose_scale(ax, [r["num_tokens"] for r in rows], axis="x")
    choose_scale(ax, [r["mean_ms"] for r in rows], axis="y")
    ax.set_xlabel("prompt tokens in the batch")
    sweep_only = all(r["distribution"] not in styles for r in rows)
    ax.set_ylabel("prefill + KV admission, one profiled call (ms)" if sweep_only else f"prefill call (ms, {center})")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, ncol=2, loc="best")
    fig.tight_layout()
    return fig


WHOLE_TABLE_COLUMNS = (("ours_ms", "ours"), ("hf_static_ms", "HF static + compile"), ("hf_generate_ms", "HF generate"),
                    ("hf_generate_batch_ms", "HF generate_batch"))


def plot_whole_table(rows: Sequence[Mapping[str, Any]], *, title: str = "") -> Figure:
    """The whole table (``measure.records.whole_table_rows``), one row per workload. Left: seconds of the
    whole call for ours and each HF peer its record holds, bars from 0 (a log axis, from the decade
    below the fastest, only where the seconds span ``LOG_SPAN``). Right: the speedup over the fastest
    peer, its time over ours, on a linear axis from 0 with a line at 1 (as fast), in words beside it."""
    fig, (ax, ratio_ax) = plt.subplots(1, 2, sharey=True, figsize=(12, 1.6 + 0.55 * max(3, len(rows))),
                                       gridspec_kw={"width_ratios": (3, 2)})
    height = 0.8 / len(WHOLE_TABLE_COLUMNS)
    labels = [f"{r['workload']} ({r['model']}, @{r['git_sha']})" for r in rows]
    seconds = []
    for j, (key, name) in enumerate(WHOLE_TABLE_COLUMNS):
        xs = [math.nan if r.get(key) in (None, "") else float(r[key]) / 1e3 for r in rows]
        if all(math.isnan(x) for x in xs):  # no record holds this peer: no bars, no legend entry
            continue
        seconds += xs
        ys = [i - 0.4 + height * (j + 0.5) for i in range(len(rows))]
        ax.barh(ys, xs, height=height, color=PALETTE(j), label=name)
    if choose_scale(ax, seconds, axis="x") == "log":  # bars then start at a round decade, not at matplotlib's margin
        ax.set_xlim(left=10 ** math.floor(math.log10(min(x for x in seconds if x > 0))))
    ax.set_yticks(range(len(rows)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("seconds of the whole call")
    ax.grid(axis="x", alpha=0.3)
    # above the axes, left-aligned: beside them it named bars a whole panel away
    ax.legend(fontsize=8, loc="lower left", bbox_to_anchor=(0.0, 1.0), ncol=len(WHOLE_TABLE_COLUMNS), frameon=False)

    speedups = [float(r["speedup_over_best_hf"]) if r.get("speedup_over_best_hf") not in (None, "") else math.nan
                for r in rows]
    ratio_ax.barh(range(len(rows)), speedups, height=0.5, color=PALETTE(0))
    ratio_ax.axvline(1.0, color="0.2", linewidth=1.0, linestyle="--")
    for i, (r, speedup) in enumerate(zip(rows, speedups)):
        if math.isnan(speedup):
            ratio_ax.annotate("no HF peer in this record", (1.0, i), xytext=(4, 0), textcoords="offset points",
                              va="center", fontsize=7, color="0.4")
        else:  # right of the bar, or of the line at 1 for a shorter bar
            ratio_ax.annotate(speed_words(speedup, digits=1, than=r["best_hf"]), (max(speedup, 1.0), i),
                              xytext=(4, 0), textcoords="offset points", va="center", fontsize=7)
    drawn = [x for x in speedups if not math.isnan(x)]
    ratio_ax.set_xlim(0, max([1.0, *drawn]) * 1.7)  # room for the words right of the longest bar
    ratio_ax.set_xlabel("speedup over the fastest HF peer (its time / ours; dashed: as fast)")
    ratio_ax.grid(axis="x", alpha=0.3)
    ratio_ax.tick_params(axis="y", left=False)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig
