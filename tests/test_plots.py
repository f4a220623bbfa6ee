"""rollout_lab.plots and rollout_lab.explore: every figure builds and saves, without a notebook."""
from __future__ import annotations

import pytest

pytest.importorskip("matplotlib")
import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from rollout_lab import analysis, explore, plots  # noqa: E402
from rollout_lab.cost import CostCoefficients  # noqa: E402
from rollout_lab.planner import plan_buckets  # noqa: E402

GEO = analysis.geometry_for("qwen2.5-3b")
COEFFS = CostCoefficients()


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


@pytest.fixture(scope="module")
def dists():
    return analysis.resolve_distributions(
        [{"kind": "seed", "name": "long_tail"}, {"kind": "real", "dataset": "gsm8k"}], batch_size=16, seeds=[0, 1])


def test_output_dirs(tmp_path):
    figures, tables = plots.output_dirs(tmp_path)
    assert figures == tmp_path / "figures" and tables == tmp_path / "tables" and figures.is_dir()
    assert plots.slug("lognormal(med 120, σ 0.6)") == "lognormal_med_120_0_6"


def test_bucket_figures_save(tmp_path, dists):
    items = [(d.label, d.lengths, plan_buckets(d.lengths, GEO, COEFFS)) for d in dists]
    written = plots.save_figure(plots.plot_bucket_grid(items), tmp_path, "grid")
    assert [p.suffix for p in written] == [".png", ".svg"] and all(p.stat().st_size > 0 for p in written)
    fig = plots.plot_buckets(*items[0][1:], title="long_tail")
    assert "2 buckets, padding 0%" in fig.axes[0].get_title()


def test_svg_is_the_same_on_every_save(tmp_path, dists):
    items = [(d.label, d.lengths, plan_buckets(d.lengths, GEO, COEFFS)) for d in dists[:2]]
    first = plots.save_figure(plots.plot_bucket_grid(items), tmp_path / "a", "grid")[1].read_bytes()
    second = plots.save_figure(plots.plot_bucket_grid(items), tmp_path / "b", "grid")[1].read_bytes()
    assert first == second and matplotlib.rcParams["svg.hashsalt"] is None  # the user's setting untouched


def test_curve_sweep_and_route_figures(dists):
    rows = analysis.num_buckets_rows(dists, GEO, COEFFS, max_num_buckets=5)
    assert len(plots.plot_num_buckets_curves(rows).axes) == 2
    sweep = analysis.fixed_cost_rows(dists, GEO, COEFFS, fixed_costs_ms=[0.1, 10, 1000])
    plots.plot_fixed_cost_sweep(sweep)
    plots.plot_bucket_map_vs_fixed_cost("gsm8k", dists[1].lengths, sweep)
    with pytest.raises(ValueError, match="no fixed-cost rows"):
        plots.plot_bucket_map_vs_fixed_cost("nope", [1], sweep)
    maps = [analysis.route_map(d.label, d.lengths, GEO, COEFFS, max_lengths=[16, 256, 2048], budgets=[1, 64, 1024])
            for d in dists]
    plots.plot_route_maps(maps)


def test_calibration_and_latency_figures():
    fit = [{"batch": b, "width": w, "measured_ms": 1 + b * w / 100, "predicted_ms": 1 + b * w / 110,
            "rel_error": 0.05} for b in (1, 4) for w in (8, 32)]
    plots.plot_calibration_fit(fit)
    rows = [{"workload": w, "path": p, "mean_ms": 10.0 + i, "tokens_per_s": 100.0, "peak_mem_bytes": None,
             "prefill_ms": 4.0, "decode_ms": 5.0, "cache_ms": 0.5, "num_prefill_forwards": 1 + i}
            for w in ("a", "b") for i, p in enumerate(("nocb", "bucketed", "auto"))]
    summary = [{"workload": "a", "auto_vs_best": 1.2, "auto_route": "bucketed"}]
    plots.plot_e2e(rows, summary)
    plots.plot_throughput_memory(rows)
    assert len(plots.plot_breakdown(rows).axes) == 2


@pytest.mark.parametrize("kind", explore.KINDS)
def test_explorer_static_view_every_kind(kind):
    fig = explore.show(coeffs=COEFFS, geometry=GEO, settings=explore.Settings(kind=kind, batch_size=12))
    assert len(fig.axes) >= 3


def test_explorer_widget_builds_without_frontend():
    pytest.importorskip("ipywidgets")
    widget = explore.explorer_widget(explore.Settings(), GEO, COEFFS)
    sliders = [c for box in widget.children[0].children for c in box.children]
    assert len(sliders) == 14
    sliders[0].value = 100.0  # a redraw must not raise
    with pytest.raises(ValueError, match="kind must be one of"):
        explore.Settings(kind="zipf")


def test_grpo_figure_from_a_record(tmp_path):
    from rollout_lab.plots_grpo import plot_grpo

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
    written = plots.save_figure(fig, tmp_path, "grpo")
    assert all(p.stat().st_size > 0 for p in written)
