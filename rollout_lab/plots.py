"""Every figure the notebooks draw: bucket choices, k-bucket curves, route maps, calibration, latency.

Each function takes plain data (plans, rows from ``rollout_lab.analysis`` or the records of
``calibrate``/``bench``) and returns a matplotlib ``Figure``; ``save_figure`` writes PNG (+ SVG).
No torch import. Notebooks call these and define nothing themselves::

    from rollout_lab import plots
    fig = plots.plot_buckets(lengths, plan, title="gsm8k")
    plots.save_figure(fig, figures_dir, "buckets_gsm8k")
"""
from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, Mapping, Sequence

import matplotlib

matplotlib.rcParams.setdefault("svg.hashsalt", "rollout_lab")  # reproducible SVG ids
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.colors import TwoSlopeNorm  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from rollout_lab import paths  # noqa: E402
from rollout_lab.planner import BucketPlan  # noqa: E402

PATH_ORDER = ("nocb", "equal_width", "aligned", "bucketed", "auto")
_PALETTE = plt.get_cmap("tab10")


def output_dirs(output_dir: str | Path | None) -> tuple[Path, Path]:
    """(figures, tables) folders: the repo's ``figures/`` and ``data/tables/``, or under ``output_dir``."""
    if output_dir is None:
        figures, tables = paths.FIGURES, paths.TABLES
    else:
        figures, tables = Path(output_dir) / "figures", Path(output_dir) / "tables"
    figures.mkdir(parents=True, exist_ok=True)
    tables.mkdir(parents=True, exist_ok=True)
    return figures, tables


def slug(text: str) -> str:
    """A file-name-safe version of a label."""
    return re.sub(r"[^A-Za-z0-9]+", "_", text).strip("_").lower() or "x"


def save_figure(fig: Figure, directory: str | Path, stem: str, *, svg: bool = True, dpi: int = 130) -> list[Path]:
    """Write ``stem.png`` (and ``stem.svg``) into ``directory``; returns the paths."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    out = [directory / f"{stem}.png"]
    fig.savefig(out[0], dpi=dpi, bbox_inches="tight", metadata={"Software": None})
    if svg:
        out.append(directory / f"{stem}.svg")
        fig.savefig(out[1], bbox_inches="tight", metadata={"Date": None, "Creator": None})
    return out


def _grid(num: int, *, ncols: int = 3, size: tuple[float, float] = (4.6, 3.0), **kw: Any):
    ncols = max(1, min(ncols, num))
    nrows = math.ceil(num / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(size[0] * ncols, size[1] * nrows), squeeze=False, **kw)
    for ax in axes.flat[num:]:
        ax.set_visible(False)
    return fig, list(axes.flat[:num])


# ---------------------------------------------------------------- 02: bucket choices

def draw_buckets(ax, lengths: Sequence[int], plan: BucketPlan, *, title: str | None = None) -> None:
    """Sorted prompts as bars (real tokens solid, padding hatched up to the bucket's width)."""
    x0 = 0
    for k, (bucket, width) in enumerate(zip(plan.buckets, plan.widths)):
        own = sorted(lengths[i] for i in bucket)
        xs = np.arange(x0, x0 + len(own))
        color = _PALETTE(k % 10)
        ax.bar(xs, own, width=1.0, color=color, edgecolor="none", align="edge")
        ax.bar(xs, [width - n for n in own], bottom=own, width=1.0, align="edge",
               facecolor="none", edgecolor=color, hatch="////", linewidth=0.0, alpha=0.6)
        ax.plot([x0, x0 + len(own)], [width, width], color=color, linewidth=1.5)
        x0 += len(own)
        if k + 1 < plan.num_buckets:
            ax.axvline(x0, color="0.3", linewidth=0.6, linestyle=":")
    n = len(lengths)
    share = 0.0 if plan.num_padded_tokens == 0 else 1.0 - sum(lengths) / plan.num_padded_tokens
    one = 1.0 - sum(lengths) / (n * max(lengths)) if n else 0.0
    ax.set_xlim(0, max(n, 1))
    ax.set_xlabel("prompt (sorted by length)")
    ax.set_ylabel("tokens")
    head = f"{title}: " if title else ""
    noun = "bucket" if plan.num_buckets == 1 else "buckets"
    ax.set_title(f"{head}{plan.num_buckets} {noun}, padding {share:.0%} (one bucket {one:.0%})", fontsize=9)


def plot_buckets(lengths: Sequence[int], plan: BucketPlan, *, title: str | None = None) -> Figure:
    """One distribution's DP buckets over its sorted lengths."""
    fig, ax = plt.subplots(figsize=(6.4, 3.4))
    draw_buckets(ax, lengths, plan, title=title)
    fig.tight_layout()
    return fig


def plot_bucket_grid(items: Sequence[tuple[str, Sequence[int], BucketPlan]], *, ncols: int = 3) -> Figure:
    """``plot_buckets`` for several (label, lengths, plan) side by side."""
    fig, axes = _grid(len(items), ncols=ncols)
    for ax, (label, lengths, plan) in zip(axes, items):
        draw_buckets(ax, lengths, plan, title=label)
    fig.tight_layout()
    return fig


def plot_num_buckets_curves(rows: Sequence[Mapping[str, Any]]) -> Figure:
    """Padding share and cost (relative to one bucket) of the best k-bucket plan against k.

    Rows from ``analysis.num_buckets_rows``; seeds are averaged (band = min..max); the DP's
    choice is marked with a dot.
    """
    labels = list(dict.fromkeys(r["distribution"] for r in rows))
    fig, (ax_pad, ax_cost) = plt.subplots(1, 2, figsize=(12, 4.2))
    for c, label in enumerate(labels):
        mine = [r for r in rows if r["distribution"] == label]
        ks = sorted({r["num_buckets"] for r in mine})
        color = plt.get_cmap("tab20")(c % 20)
        for ax, key in ((ax_pad, "padding_share"), (ax_cost, "cost_vs_one_bucket")):
            vals = [[r[key] for r in mine if r["num_buckets"] == k] for k in ks]
            mean = [float(np.mean(v)) for v in vals]
            ax.plot(ks, mean, color=color, label=label, linewidth=1.4)
            if any(len(v) > 1 for v in vals):
                ax.fill_between(ks, [min(v) for v in vals], [max(v) for v in vals], color=color, alpha=0.15)
            chosen = [r for r in mine if r["is_dp_choice"]]
            ax.scatter([r["num_buckets"] for r in chosen], [r[key] for r in chosen], color=color, s=18, zorder=3)
    ax_pad.set_ylabel("padded-token share")
    ax_pad.set_ylim(0, 1)
    ax_cost.set_ylabel("estimated prefill cost / one bucket")
    ax_cost.set_yscale("log")
    ax_cost.axhline(1.0, color="0.5", linewidth=0.6)
    for ax in (ax_pad, ax_cost):
        ax.set_xlabel("number of buckets k (best plan with exactly k)")
        ax.grid(alpha=0.3)
    ax_cost.legend(fontsize=7, ncol=2, loc="best")
    ax_pad.set_title("padding falls with k ...", fontsize=10)
    ax_cost.set_title("... while each bucket costs a forward (dots: the DP's choice)", fontsize=10)
    fig.tight_layout()
    return fig


def plot_fixed_cost_sweep(rows: Sequence[Mapping[str, Any]]) -> Figure:
    """Number of buckets and padding share the DP chooses as the fixed cost per forward moves."""
    labels = list(dict.fromkeys(r["distribution"] for r in rows))
    fig, (ax_k, ax_pad) = plt.subplots(1, 2, figsize=(12, 4.0))
    for c, label in enumerate(labels):
        mine = sorted((r for r in rows if r["distribution"] == label), key=lambda r: r["fixed_cost_ms"])
        xs = [max(r["fixed_cost_ms"], 1e-3) for r in mine]
        color = plt.get_cmap("tab20")(c % 20)
        ax_k.step(xs, [r["num_buckets"] for r in mine], where="post", color=color, label=label)
        ax_pad.step(xs, [r["padding_share"] for r in mine], where="post", color=color, label=label)
    for ax in (ax_k, ax_pad):
        ax.set_xscale("log")
        ax.set_xlabel("prefill fixed cost per forward (ms)")
        ax.grid(alpha=0.3)
    ax_k.set_yscale("log")
    ax_k.set_ylabel("buckets the DP chooses")
    ax_pad.set_ylabel("padded-token share")
    ax_pad.set_ylim(0, 1)
    ax_pad.legend(fontsize=7, ncol=2)
    fig.suptitle("How the choice moves with the fixed cost (other coefficients held)", fontsize=10)
    fig.tight_layout()
    return fig


def plot_bucket_map_vs_fixed_cost(label: str, lengths: Sequence[int], rows: Sequence[Mapping[str, Any]]) -> Figure:
    """For one distribution: each sorted prompt's padded width (colour) at each fixed cost (x)."""
    mine = sorted((r for r in rows if r["distribution"] == label), key=lambda r: r["fixed_cost_ms"])
    if not mine:
        raise ValueError(f"no fixed-cost rows for distribution {label!r}")
    srt = sorted(lengths)
    grid = np.zeros((len(srt), len(mine)))
    for c, r in enumerate(mine):
        widths = [int(w) for w in r["widths"].split(";")]
        sizes = [int(s) for s in r["bucket_sizes"].split(";")]
        grid[:, c] = np.repeat(widths, sizes)
    xs = np.array([max(r["fixed_cost_ms"], 1e-3) for r in mine])
    edges = np.concatenate([[xs[0] / 1.2], np.sqrt(xs[:-1] * xs[1:]), [xs[-1] * 1.2]]) if len(xs) > 1 else np.array([xs[0] / 2, xs[0] * 2])
    fig, (ax, ax_len) = plt.subplots(1, 2, figsize=(10, 4.0), gridspec_kw={"width_ratios": [4, 1]}, sharey=True)
    mesh = ax.pcolormesh(edges, np.arange(len(srt) + 1), grid, cmap="viridis", shading="flat")
    fig.colorbar(mesh, ax=ax, label="padded width of the prompt's bucket")
    ax.set_xscale("log")
    ax.set_xlabel("prefill fixed cost per forward (ms)")
    ax.set_ylabel("prompt (sorted by length)")
    ax.set_title(f"{label}: bucket boundaries as the fixed cost grows", fontsize=10)
    ax_len.barh(np.arange(len(srt)) + 0.5, srt, height=1.0, color="0.5")
    ax_len.set_xlabel("prompt length")
    fig.tight_layout()
    return fig


def plot_route_maps(maps: Sequence[Any], *, ncols: int = 3) -> Figure:
    """log2(nocb / bucketed CB) over max prompt length × generation budget; the line is the switch.

    Blue: bucketed is cheaper; red: nocb is cheaper. ``maps`` are ``analysis.RouteMap``.
    """
    fig, axes = _grid(len(maps), ncols=ncols, size=(4.6, 3.4))
    for ax, m in zip(axes, maps):
        nocb, cb = np.array(m.nocb_ms), np.array(m.cb_ms)
        ratio = np.log2(np.where(np.isfinite(nocb), nocb, np.nan) / cb)
        finite = ratio[np.isfinite(ratio)]
        # each side saturates on its own: the bucketed side is often much shallower than the nocb side
        lo = min(-0.25, float(finite.min())) if finite.size else -1.0
        hi = max(0.25, float(finite.max())) if finite.size else 1.0
        xs, ys = np.array(m.max_lengths, dtype=float), np.array(m.budgets, dtype=float)
        mesh = ax.pcolormesh(xs, ys, ratio, cmap="RdBu", norm=TwoSlopeNorm(0.0, lo, hi), shading="nearest")
        base = m.max_lengths[0] / m.scales[0]
        ax.axvline(base, color="0.2", linestyle="--", linewidth=0.8)
        is_cb = np.array([[r == "bucketed" for r in row] for row in m.routes], dtype=float)
        if 0 < is_cb.sum() < is_cb.size and len(xs) > 1 and len(ys) > 1:
            ax.contour(xs, ys, is_cb, levels=[0.5], colors="k", linewidths=1.2)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("longest prompt (tokens; lengths scaled)")
        ax.set_ylabel("max_new_tokens")
        ax.set_title(f"{m.label}: bucketed {is_cb.mean():.0%} of the map", fontsize=9)
        fig.colorbar(mesh, ax=ax, label="log2(nocb / bucketed)")
    fig.suptitle("Route map: blue = bucketed CB cheaper, red = nocb cheaper; black line: Auto's switch; "
                 "dashed: the unscaled lengths", fontsize=10)
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------- 01: calibration

def plot_calibration_fit(fit: Sequence[Mapping[str, Any]], *, title: str = "") -> Figure:
    """Measured against predicted prefill time per (batch, width), and the relative residuals."""
    measured = np.array([r["measured_ms"] for r in fit], dtype=float)
    predicted = np.array([r["predicted_ms"] for r in fit], dtype=float)
    rel = np.array([r["rel_error"] for r in fit], dtype=float)
    batches = sorted({int(r["batch"]) for r in fit})
    widths = np.array([r["width"] for r in fit], dtype=float)
    fig, (ax_fit, ax_res) = plt.subplots(1, 2, figsize=(11, 4.2))
    lo = max(min(measured.min(), predicted.min()) * 0.8, 1e-4)
    hi = max(measured.max(), predicted.max()) * 1.25
    ax_fit.plot([lo, hi], [lo, hi], color="0.5", linewidth=0.8, linestyle="--")
    for c, b in enumerate(batches):
        sel = np.array([int(r["batch"]) == b for r in fit])
        ax_fit.scatter(predicted[sel], measured[sel], s=22, color=_PALETTE(c % 10), label=f"B={b}")
        order = np.argsort(widths[sel])
        ax_res.plot(widths[sel][order], 100 * rel[sel][order], marker="o", markersize=4, color=_PALETTE(c % 10), label=f"B={b}")
    ax_fit.set_xscale("log")
    ax_fit.set_yscale("log")
    ax_fit.set_xlim(lo, hi)
    ax_fit.set_ylim(lo, hi)
    ax_fit.set_xlabel("predicted C(B, L) (ms)")
    ax_fit.set_ylabel("measured prefill (ms)")
    ax_fit.legend(fontsize=7)
    ax_res.axhline(0, color="0.5", linewidth=0.8)
    ax_res.set_xscale("log")
    ax_res.set_xlabel("width L (tokens)")
    ax_res.set_ylabel("relative error (%)")
    for ax in (ax_fit, ax_res):
        ax.grid(alpha=0.3)
    fig.suptitle(title or "Calibration: measured vs predicted prefill time", fontsize=10)
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------- 03: latency tables

def _by_workload(rows: Sequence[Mapping[str, Any]]) -> tuple[list[str], list[str]]:
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    found = list(dict.fromkeys(r["path"] for r in rows))
    ordered = [p for p in PATH_ORDER if p in found] + [p for p in found if p not in PATH_ORDER]
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
        ax.bar(x + (c - (len(path_names) - 1) / 2) * width, vals, width=width, label=path, color=_PALETTE(c % 10))
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
    ax.legend(fontsize=7, ncol=len(PATH_ORDER), loc="upper left", bbox_to_anchor=(0, -0.28))
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
    fig, axes = _grid(len(workloads), ncols=3, size=(4.4, 3.4))
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
