"""Figures of ``notebooks/02_bucket_choices.ipynb``: DP buckets, k-bucket curves, fixed-cost sweeps,
route maps, and where packed prefill beats the buckets.

Each takes plans or the rows of ``rollout_lab.measure.bucket_choices`` and returns a matplotlib ``Figure``; save
it with ``plots.style.save_figure``. No torch import::

    from rollout_lab.plots.buckets import plot_buckets
    fig = plot_buckets(lengths, plan, title="gsm8k")

"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.colors import TwoSlopeNorm
from matplotlib.figure import Figure

from rollout_lab.planner.bucket_dp import BucketPlan
from rollout_lab.plots.style import PALETTE, subplot_grid


def draw_buckets(ax, lengths: Sequence[int], plan: BucketPlan, *, title: str | None = None) -> None:
    """Sorted prompts as bars (real tokens solid, padding hatched up to the bucket's width)."""
    x0 = 0
    for k, (bucket, width) in enumerate(zip(plan.buckets, plan.widths)):
        own = sorted(lengths[i] for i in bucket)
        xs = np.arange(x0, x0 + len(own))
        color = PALETTE(k % 10)
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
    fig, axes = subplot_grid(len(items), ncols=ncols)
    for ax, (label, lengths, plan) in zip(axes, items):
        draw_buckets(ax, lengths, plan, title=label)
    fig.tight_layout()
    return fig


def plot_num_buckets_curves(rows: Sequence[Mapping[str, Any]]) -> Figure:
    """Padding share and cost (relative to one bucket) of the best k-bucket plan against k.

    Rows from ``measure.bucket_choices.num_buckets_rows``; seeds are averaged (band = min..max); the DP's
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


def both_sides_ticks(lo: float, hi: float, *, per_side: int = 4) -> list[float]:
    """Colour-bar ticks for a ``TwoSlopeNorm`` centred on 0 over ``lo < 0 < hi``: 0 and, on each side,
    at most ``per_side`` multiples of a step of its own (the side's end where it is shorter than the
    smallest step). Each side fills half the bar however long it is, so matplotlib's locator, which
    spaces ticks by value, numbered the short side once or not at all."""
    ticks = [0.0]
    for sign, extent in ((-1, -lo), (1, hi)):
        step = next((s for s in (0.25, 0.5, 1, 2, 3, 4, 5, 10, 20, 50) if extent / s <= per_side), extent / per_side)
        count = int(extent / step + 1e-9)
        ticks += [sign * k * step for k in range(1, count + 1)] if count else [sign * extent]
    return sorted(ticks)


def plot_route_maps(maps: Sequence[Any], *, ncols: int = 3) -> Figure:
    """log2(nocb / bucketed CB) over max prompt length × generation budget; the line is the switch.

    Blue: bucketed is cheaper; red: nocb is cheaper. ``maps`` are ``measure.bucket_choices.RouteMap``.
    """
    fig, axes = subplot_grid(len(maps), ncols=ncols, size=(4.6, 3.4))
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
        bar = fig.colorbar(mesh, ax=ax, label="log2(nocb / bucketed)")
        ticks = both_sides_ticks(lo, hi)
        bar.set_ticks(ticks, labels=[f"{t:g}" for t in ticks])
    fig.suptitle("Route map: blue = bucketed CB cheaper, red = nocb cheaper; black line: Auto's switch; "
                 "dashed: the unscaled lengths", fontsize=10)
    fig.tight_layout()
    return fig


def plot_packed_crossing(rows: Sequence[Mapping[str, Any]], *, calibrated_ms: float | None = None) -> Figure:
    """The per-prompt overhead below which packed prefill beats the bucket DP, against the batch size
    (``measure.bucket_choices.packed_crossing_rows``; points: seeds, line: their mean), with the
    calibrated overhead as a horizontal line when there is one."""
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for k, kind in enumerate(dict.fromkeys(r["distribution"] for r in rows)):
        mine = [r for r in rows if r["distribution"] == kind]
        sizes = sorted({r["batch_size"] for r in mine})
        ax.scatter([r["batch_size"] for r in mine], [r["crossing_ms_per_prompt"] for r in mine],
                   s=10, color=PALETTE(k), alpha=0.6)
        ax.plot(sizes, [np.mean([r["crossing_ms_per_prompt"] for r in mine if r["batch_size"] == n]) for n in sizes],
                color=PALETTE(k), label=kind)
    if calibrated_ms is not None:
        ax.axhline(calibrated_ms, color="0.3", linestyle="--", linewidth=1,
                   label=f"calibrated: {calibrated_ms:.3g} ms/prompt")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("prompts in the batch")
    ax.set_ylabel("packed wins below (ms per prompt)")
    ax.set_title("Packed vs bucketed prefill: the break-even per-prompt overhead", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
