"""rollout_lab.plots and rollout_lab.explore: every figure builds and saves, without a notebook."""
from __future__ import annotations

import pytest

pytest.importorskip("matplotlib")
import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from rollout_lab.measure.bucket_choices import fixed_cost_rows, num_buckets_rows, route_map
from rollout_lab.measure.presets import geometry_for
from rollout_lab.measure.workloads import resolve_distributions
from rollout_lab.planner.bucket_dp import plan_buckets  # noqa: E402
from rollout_lab.planner.cost import CostCoefficients  # noqa: E402
from rollout_lab.plots.buckets import (
    plot_bucket_grid,
    plot_bucket_map_vs_fixed_cost,
    plot_buckets,
    plot_fixed_cost_sweep,
    plot_num_buckets_curves,
    plot_route_maps,
)
from rollout_lab.plots.calibration import plot_calibration_fit
from rollout_lab.plots.explorer import KINDS, Settings, explorer_widget, show
from rollout_lab.plots.latency import plot_breakdown, plot_e2e, plot_throughput_memory
from rollout_lab.plots.style import save_figure, slug

GEO = geometry_for("qwen2.5-3b")
COEFFS = CostCoefficients()


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


@pytest.fixture(scope="module")
def dists():
    return resolve_distributions(
        [{"kind": "seed", "name": "long_tail"}, {"kind": "real", "dataset": "gsm8k"}], batch_size=16, seeds=[0, 1])


def test_slug():
    assert slug("lognormal(med 120, σ 0.6)") == "lognormal_med_120_0_6"


def test_bucket_figures_save(tmp_path, dists):
    items = [(d.label, d.lengths, plan_buckets(d.lengths, GEO, COEFFS)) for d in dists]
    written = save_figure(plot_bucket_grid(items), tmp_path, "grid")
    assert [p.suffix for p in written] == [".png", ".svg"] and all(p.stat().st_size > 0 for p in written)
    fig = plot_buckets(*items[0][1:], title="long_tail")
    assert "2 buckets, padding 0%" in fig.axes[0].get_title()


def test_svg_is_the_same_on_every_save(tmp_path, dists):
    items = [(d.label, d.lengths, plan_buckets(d.lengths, GEO, COEFFS)) for d in dists[:2]]
    first = save_figure(plot_bucket_grid(items), tmp_path / "a", "grid")[1].read_bytes()
    second = save_figure(plot_bucket_grid(items), tmp_path / "b", "grid")[1].read_bytes()
    assert first == second and matplotlib.rcParams["svg.hashsalt"] is None  # the user's setting untouched


def test_curve_sweep_and_route_figures(dists):
    rows = num_buckets_rows(dists, GEO, COEFFS, max_num_buckets=5)
    assert len(plot_num_buckets_curves(rows).axes) == 2
    sweep = fixed_cost_rows(dists, GEO, COEFFS, fixed_costs_ms=[0.1, 10, 1000])
    plot_fixed_cost_sweep(sweep)
    plot_bucket_map_vs_fixed_cost("gsm8k", dists[1].lengths, sweep)
    with pytest.raises(ValueError, match="no fixed-cost rows"):
        plot_bucket_map_vs_fixed_cost("nope", [1], sweep)
    maps = [route_map(d.label, d.lengths, GEO, COEFFS, max_lengths=[16, 256, 2048], budgets=[1, 64, 1024])
            for d in dists]
    plot_route_maps(maps)


def test_calibration_and_latency_figures():
    fit = [{"batch": b, "width": w, "measured_ms": 1 + b * w / 100, "predicted_ms": 1 + b * w / 110,
            "rel_error": 0.05} for b in (1, 4) for w in (8, 32)]
    plot_calibration_fit(fit)
    rows = [{"workload": w, "path": p, "mean_ms": 10.0 + i, "tokens_per_s": 100.0, "peak_mem_bytes": None,
             "prefill_ms": 4.0, "decode_ms": 5.0, "cache_ms": 0.5, "num_prefill_forwards": 1 + i}
            for w in ("a", "b") for i, p in enumerate(("nocb", "bucketed", "auto"))]
    summary = [{"workload": "a", "auto_vs_best": 1.2, "auto_route": "bucketed"}]
    plot_e2e(rows, summary)
    plot_throughput_memory(rows)
    assert len(plot_breakdown(rows).axes) == 2


@pytest.mark.parametrize("kind", KINDS)
def test_explorer_static_view_every_kind(kind):
    fig = show(coeffs=COEFFS, geometry=GEO, settings=Settings(kind=kind, batch_size=12))
    assert len(fig.axes) >= 3


def test_explorer_widget_builds_without_frontend():
    pytest.importorskip("ipywidgets")
    widget = explorer_widget(Settings(), GEO, COEFFS)
    sliders = [c for box in widget.children[0].children for c in box.children]
    assert len(sliders) == 15  # 6 coefficients (packed included) + 9 settings
    sliders[0].value = 100.0  # a redraw must not raise
    with pytest.raises(ValueError, match="kind must be one of"):
        Settings(kind="zipf")


def test_grpo_figure_from_a_record(tmp_path):
    from rollout_lab.plots.grpo import plot_grpo

    ours = {"prefill_ms": 40.0, "cache_ms": 5.0, "decode_ms": 900.0}
    record = {
        "config": {"model": "tiny-qwen2", "dtype": "float32", "device": "cpu", "max_new_tokens": 8},
        "workload": {"num_prompts": 4, "num_samples": 2},
        "results": {
            "shared": {"ms": [950.0, 960.0], "mean_ms": 955.0, "num_prefill_rows": 4, **ours},
            "unshared": {"ms": [990.0, 1000.0], "mean_ms": 995.0, "num_prefill_rows": 8, **ours},
            "hf_generate": {"ms": [1500.0], "mean_ms": 1500.0, "num_prefill_rows": 8},
        },
    }
    fig = plot_grpo(record)
    left, right = fig.axes[:2]
    assert [round(p.get_height()) for p in left.patches] == [955, 995, 1500]
    assert len(right.patches) == 3 * 2  # three phases for each of our two paths, none for HF
    assert "4 prompts x 2 samples x 8 tokens" in left.get_title()
    with pytest.raises(ValueError, match="no results"):
        plot_grpo(dict(record, results={}))
    written = save_figure(fig, tmp_path, "grpo")
    assert all(p.stat().st_size > 0 for p in written)
