"""The figure of a partial-rollouts record (``measure.partial_rollouts``, issue 55): the live rows over
one call's time, the full call against the call that returns at ``finish_fraction``, and each loop's
delivered tokens per second.

    save_figure(plot_partial_rollouts(load_record(path, "partial_rollouts")), "figures", "03_partial_rollouts")

No torch import.
"""
from __future__ import annotations

from typing import Any, Mapping

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from rollout_lab.plots.style import PALETTE, draw_not_measured

LOOPS = ("full", "partial")


def plot_partial_rollouts(record: Mapping[str, Any], *, title: str = "") -> Figure:
    """Two panels: the live rows over the profiled call's time (``results.trace``: a step line per
    call, the partial call's end marked), and the delivered tokens/s of the loop of calls (bars);
    a part the record lacks is said in words."""
    results = record.get("results") or {}
    fraction = (record.get("config") or {}).get("finish_fraction")
    fig, (live, loop) = plt.subplots(1, 2, figsize=(12, 3.8), gridspec_kw={"width_ratios": [2.2, 1]})
    trace = results.get("trace") or {}
    if trace:
        for k, name in enumerate(LOOPS):
            if name not in trace:
                continue
            times = [t / 1e3 for t, _ in trace[name]]
            rows = [r for _, r in trace[name]]
            label = "full call" if name == "full" else f"returns at finish_fraction={fraction}"
            live.step(times, rows, where="post", color=PALETTE(k), label=label)
            if name == "partial":
                live.axvline(times[-1], color=PALETTE(k), linestyle=":", linewidth=1)
        live.set_xlabel("seconds of the profiled call (timed forwards)")
        live.set_ylabel("live rows")
        live.set_ylim(bottom=0)
        live.grid(alpha=0.3)
        live.legend(fontsize=8, frameon=False)
    else:
        draw_not_measured(live, "live rows over a call\n(the record has no trace)")
    loops = results.get("loop") or {}
    if all(name in loops for name in LOOPS):
        values = [loops[name]["delivered_tokens_per_s"] for name in LOOPS]
        loop.bar(range(2), values, color=[PALETTE(0), PALETTE(1)])
        loop.set_xticks(range(2), ["full calls", "partial calls"])
        loop.set_ylabel(f"delivered tokens / s, {len(loops['full']['calls'])} calls")
        loop.annotate(f"{loops['speedup']:.2f}×", (1, values[1]), xytext=(0, 3), textcoords="offset points",
                      ha="center", fontsize=8)
        loop.set_ylim(bottom=0)
        loop.grid(axis="y", alpha=0.3)
    else:
        draw_not_measured(loop, "the loop of calls\n(not in the record)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig
