"""The calibration figure of notebook 01: measured against predicted ms per shape, and the residuals.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.figure import Figure

from rollout_lab.plots.style import PALETTE

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
        ax_fit.scatter(predicted[sel], measured[sel], s=22, color=PALETTE(c % 10), label=f"B={b}")
        order = np.argsort(widths[sel])
        ax_res.plot(widths[sel][order], 100 * rel[sel][order], marker="o", markersize=4, color=PALETTE(c % 10), label=f"B={b}")
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
