"""What every figure shares: the palette, file-name slugs, byte-stable saving and subplot grids.

    from rollout_lab.plots.style import save_figure
    save_figure(fig, workspace.figures, "buckets_gsm8k")   # -> buckets_gsm8k.png and .svg

"""
from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import matplotlib
import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.ticker import NullFormatter

from rollout_lab.workspace import run_tag

PALETTE = plt.get_cmap("tab10")
LOG_SPAN = 10.0  # values spanning at least this ratio get a log axis; narrower ones read better linear


def slug(text: str) -> str:
    """A file-name-safe version of a label."""
    return re.sub(r"[^A-Za-z0-9]+", "_", text).strip("_").lower() or "x"


def output_tag(model: Any, dtype: Any, device: Any) -> str:
    """``run_tag`` as a figure's or a table's name takes it: ``output_tag("qwen2.5-3b", "bfloat16", "cuda:0")``
    is ``qwen2_5_3b_bfloat16_cuda``."""
    return slug(run_tag(model, dtype, device))


def save_figure(fig: Figure, directory: str | Path, stem: str, *, svg: bool = True, dpi: int = 130) -> list[Path]:
    """Write ``stem.png`` (and ``stem.svg``) into ``directory``; returns the paths."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    out = [directory / f"{stem}.png"]
    fig.savefig(out[0], dpi=dpi, bbox_inches="tight", metadata={"Software": None})
    if svg:
        out.append(directory / f"{stem}.svg")
        # a fixed salt makes the SVG's element ids, and so the file, the same on every run
        with matplotlib.rc_context({"svg.hashsalt": "rollout_lab"}):
            fig.savefig(out[1], bbox_inches="tight", metadata={"Date": None, "Creator": None})
    return out


def subplot_grid(num: int, *, ncols: int = 3, size: tuple[float, float] = (4.6, 3.0), **kw: Any):
    """A figure with ``num`` axes in rows of ``ncols`` (spare cells hidden); returns (fig, axes)."""
    ncols = max(1, min(ncols, num))
    nrows = math.ceil(num / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(size[0] * ncols, size[1] * nrows), squeeze=False, **kw)
    for ax in axes.flat[num:]:
        ax.set_visible(False)
    return fig, list(axes.flat[:num])


def choose_scale(ax: Any, values: Any, *, axis: str = "y") -> str:
    """Set ``axis`` linear where the positive finite ``values`` span less than ``LOG_SPAN``, else log
    with only the decades labelled (minor labels crowd into each other); returns the scale."""
    finite = [float(v) for v in values if v is not None and math.isfinite(float(v)) and float(v) > 0]
    scale = "log" if finite and max(finite) / min(finite) >= LOG_SPAN else "linear"
    (ax.set_yscale if axis == "y" else ax.set_xscale)(scale)
    if scale == "log":
        (ax.yaxis if axis == "y" else ax.xaxis).set_minor_formatter(NullFormatter())
    return scale


def slanted_ticks(ax: Any, *, fontsize: float = 8, rotation: float = 30) -> None:
    """Slant the x tick labels, each anchored at its tick by its right end, so that long names
    (workloads, paths) neither overlap each other nor drift off their bars."""
    ax.tick_params(axis="x", labelsize=fontsize)
    plt.setp(ax.get_xticklabels(), rotation=rotation, ha="right", rotation_mode="anchor")


def speed_words(speedup: float, *, digits: int = 2, than: str | None = None) -> str:
    """A speedup (the other's time over ours) in words, the one wording of every figure: 2.5 is
    "2.5× faster", 0.4 "2.5× slower" (never "0.4x faster"), and one at ``digits`` "as fast". With
    ``than`` the other is named in the grammar each takes: "2.5× faster than hf_generate", "as fast as
    hf_generate". ValueError unless ``speedup`` is a finite number > 0."""
    if isinstance(speedup, bool) or not isinstance(speedup, (int, float)) or not 0 < speedup < math.inf:
        raise ValueError(f"speedup must be a finite number > 0 (the other's time over ours), got {speedup!r}")
    factor = speedup if speedup >= 1 else 1 / speedup
    shown = f"{factor:.{digits}f}"
    if shown == f"{1:.{digits}f}":
        return "as fast" if than is None else f"as fast as {than}"
    words = f"{shown}× {'faster' if speedup >= 1 else 'slower'}"
    return words if than is None else f"{words} than {than}"


def draw_not_measured(ax: Any, what: str) -> None:
    """Say in words that ``what`` was not measured, instead of drawing empty axes."""
    ax.set_axis_off()
    ax.text(0.5, 0.5, f"{what}: not measured", transform=ax.transAxes, ha="center", va="center",
            fontsize=9, color="0.3", wrap=True)
