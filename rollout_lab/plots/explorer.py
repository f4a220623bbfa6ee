"""The interactive explorer of ``02_bucket_choices``: move the cost coefficients, the batch size and a
distribution's parameters, and watch the DP's buckets, the route choice and the estimates redraw.

In JupyterLab (``interactive=True``) ``show`` displays ipywidgets sliders over a live figure. Under
papermill, or without a widget frontend (``interactive=False``), it renders the same view for the
given settings as a static figure. Either way it returns that static figure, for ``save_figure``::

    from rollout_lab.plots.explorer import show
    fig = show(costs=costs, geometry=geometry, interactive=True)

"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from rollout_lab.measure.bucket_choices import plan_padding_share
from rollout_lab.measure.workloads import DATASETS, bimodal_lengths, lognormal_lengths, sample_lengths
from rollout_lab.planner.bucket_dp import plan_buckets, plans_by_num_buckets
from rollout_lab.planner.cost import CostCoefficients, ModelGeometry, prefill_cost_ms
from rollout_lab.planner.packing import plan_packed
from rollout_lab.planner.routes import cb_decode_cost_ms, choose_route, nocb_cost_ms
from rollout_lab.plots.buckets import draw_buckets

KINDS = ("lognormal", "bimodal", "long_tail") + DATASETS


@dataclass(frozen=True)
class Settings:
    """Everything a view depends on besides the geometry."""

    kind: str = "lognormal"
    batch_size: int = 32
    seed: int = 0
    median: float = 120.0  # lognormal
    sigma: float = 0.6  # lognormal; the bimodal modes use sigma / 4
    short_median: float = 40.0  # bimodal, and the short prompts of long_tail
    long_median: float = 600.0  # bimodal, and the long prompt of long_tail
    long_share: float = 0.1  # bimodal
    max_new_tokens: int = 16
    max_len: int = 2048

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        if self.batch_size < 1 or self.max_new_tokens < 1:
            raise ValueError(f"batch_size and max_new_tokens must be >= 1, got {self.batch_size}, {self.max_new_tokens}")


def settings_lengths(s: Settings) -> list[int]:
    """The prompt lengths a ``Settings`` describes."""
    if s.kind == "lognormal":
        return lognormal_lengths(s.batch_size, s.median, s.sigma, s.seed, s.max_len)
    if s.kind == "bimodal":
        return bimodal_lengths(s.batch_size, s.short_median, s.long_median, long_share=s.long_share,
                               sigma=s.sigma / 4, seed=s.seed, max_len=s.max_len)
    if s.kind == "long_tail":
        return [int(s.long_median)] + [int(s.short_median)] * (s.batch_size - 1)
    return sample_lengths(s.kind, s.batch_size, s.seed, replace=True)


def explorer_figure(settings: Settings, geometry: ModelGeometry, costs: CostCoefficients) -> Figure:
    """Three panels: the DP's buckets, cost/padding of the best k-bucket plans, and the route estimates."""
    lengths = settings_lengths(settings)
    plan = plan_buckets(lengths, geometry, costs)
    route = choose_route(lengths, max_new_tokens=settings.max_new_tokens, continuous_batch_size=None,
                         geometry=geometry, costs=costs)
    plans = [p for p in plans_by_num_buckets(lengths, geometry, costs, min(16, len(lengths))) if p]
    fig, (ax_b, ax_k, ax_r) = plt.subplots(1, 3, figsize=(14, 3.8), gridspec_kw={"width_ratios": [3, 2, 1.7]})
    draw_buckets(ax_b, lengths, plan, title=f"{settings.kind}, B={len(lengths)}")
    ks = [p.num_buckets for p in plans]
    ax_k.plot(ks, [p.cost_ms for p in plans], marker="o", markersize=3, label="prefill cost (ms)")
    ax_k.axvline(plan.num_buckets, color="0.4", linestyle=":", linewidth=1)
    ax_k.set_xlabel("buckets k")
    ax_k.xaxis.set_major_locator(MaxNLocator(integer=True))  # k counts buckets: no 2.5
    ax_k.set_ylabel("best k-bucket prefill estimate (ms)")
    ax_pad = ax_k.twinx()
    ax_pad.plot(ks, [plan_padding_share(lengths, p) for p in plans], color="C1", linewidth=1, label="padding share")
    ax_pad.set_ylim(0, 1)
    ax_pad.set_ylabel("padded share", color="C1")
    nocb = nocb_cost_ms(lengths, geometry, costs) if route.nocb_cost_ms is not None else None
    decode = cb_decode_cost_ms(settings.max_new_tokens, costs)
    cb = plan.cost_ms + decode
    packed = plan_packed(lengths, geometry, costs).cost_ms + decode  # priced with 0 per prompt if unset
    names, values = ["nocb", "bucketed", "packed"], [nocb or 0.0, cb, packed]
    colors = {"nocb": "C3", "bucketed": "C0", "packed": "C2"}
    bars = ax_r.bar(names, values, color=[colors[n] if route.route == n else "0.7" for n in names])
    for bar, v, name in zip(bars, values, names):
        text = "n/a" if name == "nocb" and nocb is None else f"{v:.0f}"
        if name == "packed" and route.packed_cost_ms is None:
            text += "\n(not calibrated)"
        ax_r.annotate(text, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=8)
    ax_r.set_ylabel("estimated ms")
    ax_r.margins(x=0.08, y=0.2)  # room for the two-line labels over the bars
    ax_r.set_title(f"Auto: {route.route} (budget {settings.max_new_tokens})", fontsize=9)
    one = prefill_cost_ms(len(lengths), max(lengths), geometry, costs)
    ax_k.set_title(f"DP {plan.cost_ms:.0f} ms vs one bucket {one:.0f} ms", fontsize=9)
    fig.tight_layout()
    return fig


def explorer_widget(settings: Settings, geometry: ModelGeometry, costs: CostCoefficients) -> Any:
    """ipywidgets sliders over ``explorer_figure``, starting at ``settings`` and ``costs``."""
    import ipywidgets as w  # optional: the [notebooks] extra, and only for the live explorer
    from IPython.display import display  # comes with ipywidgets (the [notebooks] extra)

    style = {"description_width": "150px"}
    layout = w.Layout(width="420px")

    def log_slider(desc, value, lo, hi):
        return w.FloatLogSlider(value=max(value, 10**lo), min=lo, max=hi, step=0.05, description=desc,
                                style=style, layout=layout, continuous_update=False)

    def int_slider(desc, value, lo, hi):
        return w.IntSlider(value=value, min=lo, max=hi, description=desc, style=style, layout=layout,
                           continuous_update=False)

    controls = {
        "fixed": log_slider("fixed (ms/forward)", costs.prefill_fixed_cost_ms, -2, 3),
        "token": log_slider("token (ms/token)", costs.prefill_token_cost_ms, -4, 0),
        "attention": log_slider("attention (ms/GFLOP)", costs.prefill_attention_cost_ms, -5, 0),
        "kv": log_slider("kv (ms/MiB)", costs.prefill_kv_cost_ms, -5, 0),
        "decode": log_slider("CB decode (ms/step)", costs.continuous_decode_cost_ms, -2, 2),
        "packed": log_slider("packed (ms/prompt)", costs.packed_prompt_cost_ms or 0.0, -4, 2),
        "kind": w.Dropdown(options=KINDS, value=settings.kind, description="distribution", style=style, layout=layout),
        "batch_size": int_slider("batch size", settings.batch_size, 1, 256),
        "seed": int_slider("seed", settings.seed, 0, 20),
        "median": log_slider("median (lognormal)", settings.median, 0, 3.5),
        "sigma": w.FloatSlider(value=settings.sigma, min=0.0, max=2.0, step=0.05, description="sigma",
                               style=style, layout=layout, continuous_update=False),
        "short_median": log_slider("short length", settings.short_median, 0, 3.5),
        "long_median": log_slider("long length", settings.long_median, 0, 3.5),
        "long_share": w.FloatSlider(value=settings.long_share, min=0.0, max=1.0, step=0.01,
                                    description="long share (bimodal)", style=style, layout=layout,
                                    continuous_update=False),
        "max_new_tokens": int_slider("max_new_tokens", settings.max_new_tokens, 1, 1024),
    }

    def redraw(fixed, token, attention, kv, decode, packed, **rest):
        c = replace(costs, prefill_fixed_cost_ms=fixed, prefill_token_cost_ms=token,
                    prefill_attention_cost_ms=attention, prefill_kv_cost_ms=kv, continuous_decode_cost_ms=decode,
                    packed_prompt_cost_ms=packed)
        s = replace(settings, **{k: (int(v) if k in ("batch_size", "seed", "max_new_tokens") else v)
                                 for k, v in rest.items()})
        fig = explorer_figure(s, geometry, c)
        display(fig)
        plt.close(fig)

    out = w.interactive_output(redraw, controls)
    names = list(controls)
    left = w.VBox([controls[n] for n in names[:7]])
    right = w.VBox([controls[n] for n in names[7:]])
    return w.VBox([w.HBox([left, right]), out])


def show(
    *, costs: CostCoefficients, geometry: ModelGeometry, settings: Settings | None = None,
    interactive: bool = False,
) -> Figure:
    """Display the widget explorer (``interactive``) or the static view; return the static view.

    The static figure is closed (not auto-displayed) in interactive mode, so only the widget shows.
    """
    settings = settings or Settings()
    fig = explorer_figure(settings, geometry, costs)
    if interactive:
        from IPython.display import display  # comes with ipywidgets (the [notebooks] extra)

        plt.close(fig)
        display(explorer_widget(settings, geometry, costs))
    return fig
