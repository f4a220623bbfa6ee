"""The calibration figure of notebook 01: measured against predicted ms per shape (every sample
drawn), the residuals, and the fit's quality warnings.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import seaborn as sns
from matplotlib.figure import Figure
from matplotlib.ticker import NullFormatter

from rollout_lab.plots.style import PALETTE, choose_scale

# ---------------------------------------------------------------- 01: calibration

def plot_calibration_fit(fit: Sequence[Mapping[str, Any]], *, title: str = "",
                         warnings: Sequence[str] = ()) -> Figure:
    """Measured against predicted prefill time per (batch, width), every timed sample as a point
    (seaborn) around its median, and the relative residuals; the fit's ``warnings`` in red below."""
    measured = np.array([r["measured_ms"] for r in fit], dtype=float)
    predicted = np.array([r["predicted_ms"] for r in fit], dtype=float)
    rel = np.array([r["rel_error"] for r in fit], dtype=float)
    batches = sorted({int(r["batch"]) for r in fit})
    widths = np.array([r["width"] for r in fit], dtype=float)
    samples = pd.DataFrame([
        {"predicted_ms": r["predicted_ms"], "sample_ms": f + c, "batch": f"B={r['batch']}"}
        for r in fit for f, c in zip(r.get("forward_samples_ms") or (), r.get("kv_copy_samples_ms") or ())])
    fig, (ax_fit, ax_res) = plt.subplots(1, 2, figsize=(11, 4.2 + 0.25 * len(warnings)))
    values = [*measured, *predicted, *([] if samples.empty else samples["sample_ms"])]
    lo, hi = max(min(values) * 0.8, 1e-4), max(values) * 1.25
    ax_fit.plot([lo, hi], [lo, hi], color="0.5", linewidth=0.8, linestyle="--")
    colors = {f"B={b}": PALETTE(c % 10) for c, b in enumerate(batches)}
    if not samples.empty:
        sns.scatterplot(data=samples, x="predicted_ms", y="sample_ms", hue="batch", palette=colors, s=10,
                        alpha=0.45, linewidth=0, legend=False, ax=ax_fit)
    for c, b in enumerate(batches):
        sel = np.array([int(r["batch"]) == b for r in fit])
        ax_fit.scatter(predicted[sel], measured[sel], s=28, color=PALETTE(c % 10), edgecolor="black",
                       linewidth=0.5, label=f"B={b}", zorder=3)
        order = np.argsort(widths[sel])
        ax_res.plot(widths[sel][order], 100 * rel[sel][order], marker="o", markersize=4, color=PALETTE(c % 10), label=f"B={b}")
    for axis in ("x", "y"):
        choose_scale(ax_fit, [lo, hi], axis=axis)
    ax_fit.set_xlim(lo, hi)
    ax_fit.set_ylim(lo, hi)
    ax_fit.set_xlabel("predicted C(B, L) (ms)")
    ax_fit.set_ylabel("measured prefill (ms; large: median, small: samples)")
    ax_fit.legend(fontsize=7, loc="upper left")
    ax_res.axhline(0, color="0.5", linewidth=0.8)
    ax_res.set_xscale("log", base=2)
    ticks = sorted(set(widths.tolist()))
    ax_res.set_xticks(ticks, [f"{w:g}" for w in ticks])
    ax_res.xaxis.set_minor_formatter(NullFormatter())
    ax_res.set_xlabel("width L (tokens)")
    ax_res.set_ylabel("relative error of the median (%)")
    ax_res.legend(fontsize=7, loc="best")
    for ax in (ax_fit, ax_res):
        ax.grid(alpha=0.3)
    fig.suptitle(title or "Calibration: measured vs predicted prefill time", fontsize=10)
    if warnings:
        fig.text(0.01, 0.01, "\n".join(f"warning: {w}" for w in warnings), color="firebrick", fontsize=8,
                 ha="left", va="bottom")
    fig.tight_layout(rect=(0, 0.06 * bool(warnings) + 0.02 * len(warnings), 1, 1))
    return fig
