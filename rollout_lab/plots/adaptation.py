"""Figures of ``notebooks/04_adaptation.ipynb``: chunk layout, EOS-aware route choice, online convergence.

Each takes the rows of ``rollout_lab.measure.adaptation`` and returns a matplotlib ``Figure``; save it with
``plots.save_figure``. No torch import.

"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from rollout_lab.planner.bucket_dp import BucketPlan
from rollout_lab.planner.chunks import split_prompt
from rollout_lab.plots.style import PALETTE


def plot_chunked_plan(lengths: Sequence[int], plan: BucketPlan, *, limit: int) -> Figure:
    """One bar per prompt: its head coloured by its DP bucket, its tail chunks hatched (one forward each)."""
    fig, ax = plt.subplots(figsize=(7.5, 0.45 * len(lengths) + 1.4))
    bucket_of = {r: k for k, bucket in enumerate(plan.buckets) for r in bucket}
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    for y, r in enumerate(order):
        widths = split_prompt(lengths[r], limit)
        color = PALETTE(bucket_of[r] % 10)
        ax.barh(y, widths[0], color=color, edgecolor="black", linewidth=0.5)
        left = widths[0]
        for width in widths[1:]:
            ax.barh(y, width, left=left, color="white", edgecolor=color, hatch="//", linewidth=1.0)
            left += width
    ax.set_yticks(range(len(order)), [f"#{r} ({lengths[r]})" for r in order])
    ax.set_xlabel("prompt tokens (solid: head, in a DP bucket; hatched: one tail chunk forward each)")
    ax.set_title(f"chunked prefill, prefill_max_tokens={limit}: {plan.num_buckets} buckets + "
                 f"{plan.num_forwards - plan.num_buckets} chunk forwards")
    return fig


def plot_eos_prior(rows: Sequence[Mapping[str, Any]]) -> Figure:
    """E2E ms of reference Auto (budget-priced) vs EOS-aware Auto, per source and budget."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.6))
    for ax, source in zip(axes, sorted({r["source"] for r in rows}, reverse=True)):
        mine = [r for r in rows if r["source"] == source]
        xs = range(len(mine))
        ref = [r["reference_e2e_ms"] for r in mine]
        aware = [r["eos_aware_e2e_ms"] for r in mine]
        ax.bar([x - 0.2 for x in xs], ref, width=0.4, label="reference Auto (T - 1 steps)", color=PALETTE(0))
        ax.bar([x + 0.2 for x in xs], aware, width=0.4, label="EOS-aware Auto (prior)", color=PALETTE(2))
        for x, r in zip(xs, mine):
            ax.text(x - 0.2, r["reference_e2e_ms"], r["reference_route"], ha="center", va="bottom", fontsize=7)
            ax.text(x + 0.2, r["eos_aware_e2e_ms"], r["eos_aware_route"], ha="center", va="bottom", fontsize=7)
        ax.set_xticks(list(xs), [f"T={r['max_new_tokens']}" for r in mine])
        ax.set_ylabel("E2E ms" + (" (cost model)" if "cost model" in source else " (measured)"))
        ax.set_title(source, fontsize=9)
        ax.margins(y=0.3)  # headroom: the route names over the bars, and the legend clear of them
        ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    return fig


def plot_online(rows: Sequence[Mapping[str, Any]]) -> Figure:
    """|relative prediction error| per call, and whether Auto (online / defaults) took the wrong route."""
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(7.5, 5.0), sharex=True, height_ratios=(3, 1))
    calls = [r["call"] for r in rows]
    for key, label, k in (("prefill_rel_error", "prefill", 0), ("decode_rel_error", "decode", 1),
                          ("rel_error", "prefill + decode", 2)):
        ax.plot(calls, [abs(r[key]) for r in rows], marker="o", label=label, color=PALETTE(k))
    ax.set_yscale("log")
    ax.set_ylabel("|predicted - measured| / measured")
    ax.set_title("online recalibration from the default coefficients")
    ax.legend(fontsize=8)
    ax2.scatter(calls, [1 if r["is_wrong"] else 0 for r in rows], label="online Auto", marker="o", color=PALETTE(2))
    ax2.scatter(calls, [0.5 if r["default_is_wrong"] else -0.5 for r in rows], label="default Auto",
                marker="x", color=PALETTE(3))
    ax2.set_yticks([-0.5, 0, 0.5, 1], ["defaults right", "online right", "defaults wrong", "online wrong"], fontsize=7)
    ax2.set_xlabel("call")
    fig.tight_layout()
    return fig
