"""The figure of a prefix-sharing record (``measure.prefix_sharing``, issue 54): per path, over the
prompt (prefix) length, the KV bytes the decode read per step, the output tokens/s and the pool's
peak KV tokens; shared prompt blocks against today's copies.

    rows = prefix_sharing_rows(load_record(path, "prefix_sharing"))
    save_figure(plot_prefix_sharing(rows, title="qwen2.5-3b on H100"), "figures", "03_prefix_sharing")

No torch import.
"""
from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from rollout_lab.plots.style import PALETTE, choose_scale, draw_not_measured, speed_words

BYTE_UNITS = (("B", 1), ("KiB", 2**10), ("MiB", 2**20), ("GiB", 2**30), ("TiB", 2**40))


def byte_unit(values: Sequence[float]) -> tuple[str, int]:
    """(name, bytes) of the largest binary unit that keeps the largest of ``values`` >= 1."""
    top = max((v for v in values if v), default=1)
    return next(((name, size) for name, size in reversed(BYTE_UNITS) if top >= size), BYTE_UNITS[0])


def plot_prefix_sharing(rows: Sequence[Mapping[str, Any]], *, title: str = "") -> Figure:
    """Three panels over the prompt length (``measure.prefix_sharing.prefix_sharing_rows``), one
    line per path: the KV bytes the decode read per step (said in words where the profile kept
    none), output tokens/s with each path's speed against the copies beside its points, and the pool's
    peak KV tokens with the unique ones they held dashed."""
    if not rows:
        raise ValueError("no prefix-sharing rows to draw")
    paths = list(dict.fromkeys(r["path"] for r in rows))
    lengths = sorted({float(r["prompt_length"]) for r in rows})
    read_values = [r["kv_bytes_read_per_step"] for r in rows if r.get("kv_bytes_read_per_step") is not None]
    unit, size = byte_unit(read_values)
    if len(lengths) == 1:
        return _plot_one_length(rows, paths, unit, size, title=title)
    fig, (reads, speed, memory) = plt.subplots(1, 3, figsize=(14, 3.9))
    for k, path in enumerate(paths):
        mine = sorted((r for r in rows if r["path"] == path), key=lambda r: float(r["prompt_length"]))
        x = [float(r["prompt_length"]) for r in mine]
        style = dict(marker="o", color=PALETTE(k), label=path)
        if read_values:
            reads.plot(x, [math.nan if r.get("kv_bytes_read_per_step") is None else r["kv_bytes_read_per_step"] / size
                           for r in mine], **style)
        speed.plot(x, [r["output_tokens_per_s"] for r in mine], **style)
        for r in mine:
            ratio = r.get("tokens_per_s_over_copies")
            if ratio is not None and r["path"] != "copies":
                speed.annotate(speed_words(ratio), (float(r["prompt_length"]), r["output_tokens_per_s"]), xytext=(4, 4),
                               textcoords="offset points", fontsize=7, color=PALETTE(k))
        memory.plot(x, [r["peak_kv_tokens"] for r in mine], **style)
        memory.plot(x, [r["unique_kv_tokens"] for r in mine], color=PALETTE(k), linestyle="--", marker=".")
    if read_values:
        reads.set_ylabel(f"KV {unit} read per decode step")
        choose_scale(reads, read_values)
    else:
        draw_not_measured(reads, "KV bytes read per decode step\n(the profile keeps none)")
    speed.set_ylabel("output tokens / s")
    speed.set_ylim(bottom=0)
    speed.margins(x=0.15)  # room for the speed words right of the last point
    memory.set_ylabel("peak KV tokens (dashed: unique)")
    memory.set_ylim(bottom=0)
    for ax in (reads, speed, memory):
        if not ax.axison:
            continue
        ax.set_xlabel("prompt tokens (mean where they vary)")
        if len(lengths) > 1 and lengths[-1] / lengths[0] >= 8:
            ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, [f"{n:g}" for n in lengths])
        ax.grid(alpha=0.3)
    speed.legend(loc="lower left", fontsize=8, frameon=False)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def _plot_one_length(rows: Sequence[Mapping[str, Any]], paths: Sequence[str], unit: str, size: int, *,
                     title: str) -> Figure:
    """A record of one prompt length: the same three panels as bars, one per path."""
    by_path = {r["path"]: r for r in rows}
    fig, (reads, speed, memory) = plt.subplots(1, 3, figsize=(13, 3.6))
    x = range(len(paths))
    colors = [PALETTE(k) for k in x]
    read = [by_path[p].get("kv_bytes_read_per_step") for p in paths]
    if any(v is not None for v in read):
        reads.bar(x, [math.nan if v is None else v / size for v in read], color=colors)
        reads.set_ylabel(f"KV {unit} read per decode step")
    else:
        draw_not_measured(reads, "KV bytes read per decode step\n(the profile keeps none)")
    speed.bar(x, [by_path[p]["output_tokens_per_s"] for p in paths], color=colors)
    for k, path in enumerate(paths):
        ratio = by_path[path].get("tokens_per_s_over_copies")
        if ratio is not None and path != "copies":
            speed.annotate(speed_words(ratio), (k, by_path[path]["output_tokens_per_s"]), xytext=(0, 3),
                           textcoords="offset points", ha="center", fontsize=8)
    speed.set_ylabel("output tokens / s")
    memory.bar(x, [by_path[p]["peak_kv_tokens"] for p in paths], color=colors, alpha=0.45, label="peak")
    memory.bar(x, [by_path[p]["unique_kv_tokens"] for p in paths], color=colors, width=0.4, label="unique")
    memory.set_ylabel("peak KV tokens (narrow: unique)")
    length = float(rows[0]["prompt_length"])
    for ax in (reads, speed, memory):
        if ax.axison:
            ax.set_xticks(list(x), paths, fontsize=8)
            ax.set_ylim(bottom=0)
            ax.grid(axis="y", alpha=0.3)
    fig.suptitle(f"{title} (prompts of {length:,.0f} tokens on average)" if title else
                 f"prompts of {length:,.0f} tokens on average", fontsize=10)
    fig.tight_layout()
    return fig
