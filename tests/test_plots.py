"""rollout_lab.plots and rollout_lab.explore: every figure builds and saves, without a notebook."""
from __future__ import annotations

import math

import pytest

pytest.importorskip("matplotlib")
import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from conftest import one_fast  # noqa: E402

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
from rollout_lab.plots.style import output_tag, save_figure, slug

GEO = geometry_for("qwen2.5-3b")
COSTS = CostCoefficients()


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


def test_output_tag_names_model_dtype_and_device_kind():
    assert output_tag("qwen2.5-3b", "bfloat16", "cuda:0") == "qwen2_5_3b_bfloat16_cuda"
    assert output_tag("tiny-qwen2", "float32", "cpu") == "tiny_qwen2_float32_cpu"


@pytest.mark.slow  # five figures drawn and saved: over 0.5 s on 2 CPU cores
def test_bucket_figures_save(tmp_path, dists):
    items = [(d.label, d.lengths, plan_buckets(d.lengths, GEO, COSTS)) for d in dists]
    written = save_figure(plot_bucket_grid(items), tmp_path, "grid")
    assert [p.suffix for p in written] == [".png", ".svg"] and all(p.stat().st_size > 0 for p in written)
    fig = plot_buckets(*items[0][1:], title="long_tail")
    assert "2 buckets, padding 0%" in fig.axes[0].get_title()


@pytest.mark.slow  # two grids of every workload saved as PNG and SVG
def test_svg_is_the_same_on_every_save(tmp_path, dists):
    items = [(d.label, d.lengths, plan_buckets(d.lengths, GEO, COSTS)) for d in dists[:2]]
    first = save_figure(plot_bucket_grid(items), tmp_path / "a", "grid")[1].read_bytes()
    second = save_figure(plot_bucket_grid(items), tmp_path / "b", "grid")[1].read_bytes()
    assert first == second and matplotlib.rcParams["svg.hashsalt"] is None  # the user's setting untouched


@pytest.mark.slow  # the bucket DP over every workload at many fixed costs
def test_curve_sweep_and_route_figures(dists):
    rows = num_buckets_rows(dists, GEO, COSTS, max_num_buckets=5)
    assert len(plot_num_buckets_curves(rows).axes) == 2
    sweep = fixed_cost_rows(dists, GEO, COSTS, fixed_costs_ms=[0.1, 10, 1000])
    plot_fixed_cost_sweep(sweep)
    plot_bucket_map_vs_fixed_cost("gsm8k", dists[1].lengths, sweep)
    with pytest.raises(ValueError, match="no fixed-cost rows"):
        plot_bucket_map_vs_fixed_cost("nope", [1], sweep)
    maps = [route_map(d.label, d.lengths, GEO, COSTS, max_lengths=[16, 256, 2048], budgets=[1, 64, 1024])
            for d in dists]
    plot_route_maps(maps)


def _texts(fig) -> str:
    return " | ".join(t.get_text() for ax in fig.axes for t in ax.texts) + " | " + " | ".join(
        t.get_text() for t in fig.texts) + " | " + " | ".join(ax.get_title() for ax in fig.axes)


@pytest.mark.slow  # a two-panel figure
def test_calibration_figure_draws_every_sample_and_the_warnings():
    fit = [{"batch": b, "width": w, "measured_ms": 1 + b * w / 100, "predicted_ms": 1 + b * w / 110,
            "rel_error": 0.05, "forward_samples_ms": [b * w / 100, 1.1 * b * w / 100, 0.9 * b * w / 100],
            "kv_copy_samples_ms": [1.0, 1.0, 1.0]} for b in (1, 4) for w in (8, 32)]
    fig = plot_calibration_fit(fit, warnings=["R² 0.5 is below 0.9"])
    ax_fit, ax_res = fig.axes
    points = sum(len(c.get_offsets()) for c in ax_fit.collections)
    assert points == 4 * 3 + 4  # every sample, and each shape's median
    assert "warning: R² 0.5 is below 0.9" in _texts(fig)
    assert ax_fit.get_xscale() == "linear"  # 2.1 .. 2.3 ms: less than 10x, so linear
    assert [t.get_text() for t in ax_res.get_xticklabels()] == ["8", "32"]  # widths, no crowded minor labels
    wide = [dict(r, measured_ms=r["measured_ms"] * 10 ** k, predicted_ms=r["predicted_ms"] * 10 ** k,
                 forward_samples_ms=[], kv_copy_samples_ms=[]) for k, r in enumerate(fit)]
    assert plot_calibration_fit(wide).axes[0].get_yscale() == "log"


def _rows(medians, samples=5):
    return [{"workload": w, "path": p, "median_ms": m, "mean_ms": m, "tokens_per_s": 100.0, "peak_mem_bytes": None,
             "samples_ms": ";".join(f"{m + d:.3f}" for d in range(samples)) if samples else "",
             "prefill_ms": 4.0, "decode_ms": 5.0, "cache_ms": 0.5, "num_prefill_forwards": 1 + i}
            for w in ("a", "b") for i, (p, m) in enumerate(medians.items())]


@pytest.mark.slow  # three sweep tables drawn
def test_latency_figures_draw_medians_spreads_and_samples():
    rows = _rows({"nocb": 20.0, "bucketed": 10.0, "auto": 10.5})
    rows.append({"workload": "a", "path": "hf_static", "samples_ms": "", "skipped": "no static cache"})
    summary = [{"workload": "a", "auto_vs_best": 1.05, "auto_route": "bucketed",
                "auto_vs_best_manual_beyond_spread": False}]
    fig = plot_e2e(rows, summary)
    ax = fig.axes[0]
    heights = sorted(round(p.get_height(), 3) for p in ax.patches if p.get_height() > 0)
    assert heights == sorted([12.0, 22.0, 12.5] * 2)  # medians of the samples m..m+4
    assert sum(len(c.get_offsets()) for c in ax.collections) == 6 * 5  # every sample a point
    assert ax.get_yscale() == "linear"  # 10 .. 24 ms
    assert "within spread" in _texts(fig) and "not measured: hf_static" in _texts(fig)
    assert ax.get_legend() is not None and ax.get_legend().get_bbox_to_anchor().bounds == ax.bbox.bounds
    assert plot_e2e(_rows({"nocb": 1.0, "auto": 100.0})).axes[0].get_yscale() == "log"  # 100x apart
    cpu = plot_throughput_memory(rows)  # no peak memory in any row: no empty panel, the reason in words
    assert len(cpu.axes) == 1 and "peak memory not measured: it is read from the CUDA allocator" in _texts(cpu)
    assert len(plot_breakdown(rows[:6]).axes) == 2


def test_figures_say_not_measured_instead_of_drawing_empty_axes():
    fig = plot_e2e(_rows({"nocb": 20.0}, samples=0))
    assert not fig.axes[0].axison and "not measured" in _texts(fig)


@pytest.mark.parametrize("kind", one_fast(KINDS, KINDS[0]))
def test_explorer_static_view_every_kind(kind):
    fig = show(costs=COSTS, geometry=GEO, settings=Settings(kind=kind, batch_size=12))
    assert len(fig.axes) >= 3


@pytest.mark.slow  # ipywidgets, and a redraw
def test_explorer_widget_builds_without_frontend():
    pytest.importorskip("ipywidgets")
    widget = explorer_widget(Settings(), GEO, COSTS)
    sliders = [c for box in widget.children[0].children for c in box.children]
    assert len(sliders) == 15  # 6 coefficients (packed included) + 9 settings
    sliders[0].value = 100.0  # a redraw must not raise
    with pytest.raises(ValueError, match="kind must be one of"):
        Settings(kind="zipf")


@pytest.mark.slow  # a figure saved as PNG and SVG
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


def test_prefill_routes_draw_a_sweeps_workloads_as_points():
    from rollout_lab.plots.latency import plot_prefill_routes

    rows = [{"distribution": "sweep", "workload": w, "num_tokens": n, "route": route, "mean_ms": ms, "stdev_ms": 0.0}
            for w, n in (("a", 50), ("b", 900)) for route, ms in (("bucketed", n / 10), ("packed", n / 20 + 30))]
    fig = plot_prefill_routes(rows)
    ax = fig.axes[0]
    points = [c for c in ax.collections if len(c.get_offsets()) == 2]
    assert len(points) == 2 and "profiled call" in ax.get_ylabel()
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["bucketed, sweep workloads", "packed, sweep workloads"]


@pytest.mark.parametrize("num_rows", one_fast([1, 2, 9], 2))  # two rows once put the legend over the label
def test_whole_table_legend_names_only_the_peers_drawn_and_stays_clear_of_the_axes(num_rows):
    from rollout_lab.plots.latency import plot_whole_table

    rows = [{"workload": f"w{i}", "model": "m", "git_sha": "abc1234", "ours_ms": 50.0 + i, "hf_generate_ms": 600.0,
             "hf_static_ms": None, "hf_generate_batch_ms": 4000.0 if i else None, "best_hf": "hf_generate",
             "speedup_over_best_hf": 12.0} for i in range(num_rows)]
    fig = plot_whole_table(rows, title="t")
    ax = fig.axes[0]
    legend = ax.get_legend()
    drawn = ["ours", "HF generate"] + (["HF generate_batch"] if num_rows > 1 else [])
    assert [t.get_text() for t in legend.get_texts()] == drawn  # no entry for a peer no record holds
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    box = legend.get_window_extent(renderer)
    for other in (ax.get_window_extent(renderer), ax.xaxis.label.get_window_extent(renderer)):
        assert not box.overlaps(other)  # two rows once put the legend over the axis label


# ---------------------------------------------------------------- issue 36: speed words, nothing drawn over anything

def test_speed_words_say_slower_below_one():
    """"0.4x faster" was drawn for 2.5x slower: a speedup under one is the inverse, slower."""
    from rollout_lab.plots.style import speed_words

    assert speed_words(2.5) == "2.50× faster" and speed_words(0.4) == "2.50× slower"
    assert speed_words(0.4, digits=1) == "2.5× slower" and speed_words(1.001) == "as fast"
    # "as fast than hf_generate" was drawn: the other is named in each wording's own grammar
    assert speed_words(1.001, than="hf_generate") == "as fast as hf_generate"
    assert speed_words(2.5, digits=1, than="hf_generate") == "2.5× faster than hf_generate"
    assert speed_words(0.4, digits=1, than="hf_generate") == "2.5× slower than hf_generate"
    for bad in (0, -1.0, float("nan"), float("inf"), True, None, "2"):
        with pytest.raises(ValueError, match="speedup must be a finite number > 0"):
            speed_words(bad)


def test_figures_word_every_speed_ratio_as_slower_or_faster():
    from rollout_lab.plots.latency import plot_whole_table

    rows = [{"workload": w, "model": "m", "git_sha": "abc1234", "ours_ms": ours, "hf_generate_ms": 1000.0,
             "hf_static_ms": None, "hf_generate_batch_ms": None, "best_hf": "hf_generate",
             "speedup_over_best_hf": 1000.0 / ours} for w, ours in (("slow", 2500.0), ("fast", 400.0))]
    texts = _texts(plot_whole_table(rows, title="t"))
    assert "2.5× slower than hf_generate" in texts and "2.5× faster than hf_generate" in texts
    assert "0.4" not in texts
    summary = [{"workload": "a", "auto_vs_best": 2.5, "auto_route": "bucketed"},  # Auto's time over the best's
               {"workload": "b", "auto_vs_best": 0.8, "auto_route": "packed"}]
    texts = _texts(plot_e2e(_rows({"nocb": 20.0, "bucketed": 10.0, "auto": 25.0}), summary))
    assert "2.50× slower\nbucketed" in texts and "1.25× faster\npacked" in texts


def _text_boxes(fig, renderer):
    """(what, box) of every tick label, axis label, title and annotation drawn, per axes."""
    boxes = []
    for k, ax in enumerate(fig.axes):
        if not ax.get_visible() or not ax.axison:
            continue
        labels = [t for t in ax.get_xticklabels() + ax.get_yticklabels() if t.get_visible() and t.get_text()]
        labels += [t for t in (ax.xaxis.label, ax.yaxis.label, ax.title) if t.get_text()]
        labels += [t for t in ax.texts if t.get_text()]
        boxes += [(f"axes {k} {t.get_text()!r}", t.get_window_extent(renderer)) for t in labels]
    return boxes


def _overlaps(fig):
    """What is drawn over what: x tick labels of one axes over each other, and a legend over any text,
    over another legend, or over the bars of an axes it does not belong inside."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    found = []
    for k, ax in enumerate(fig.axes):
        labels = [t for t in ax.get_xticklabels() if t.get_visible() and t.get_text()]
        boxes = [t.get_window_extent(renderer) for t in labels]
        if labels and labels[0].get_rotation() % 180:  # slanted labels are parallel: the gap across them counts
            xs = sorted(b.x1 for b in boxes)
            height = labels[0].get_fontsize() * fig.dpi / 72
            gap = min((b - a for a, b in zip(xs, xs[1:])), default=math.inf) * math.sin(math.radians(labels[0].get_rotation()))
            found += [f"axes {k}: slanted x tick labels {gap:.1f} px apart, {height:.1f} px high"] if gap < height else []
        else:
            found += [f"axes {k}: x tick labels {i} and {j}" for i in range(len(boxes)) for j in range(i + 1, len(boxes))
                      if boxes[i].overlaps(boxes[j])]
    legends = [lg for lg in [*fig.legends, *(ax.get_legend() for ax in fig.axes)] if lg is not None]
    texts = _text_boxes(fig, renderer)
    for n, legend in enumerate(legends):
        box = legend.get_window_extent(renderer)
        found += [f"legend {n} over {what}" for what, other in texts if box.overlaps(other)]
        found += [f"legends {n} and {m}" for m in range(n + 1, len(legends))
                  if box.overlaps(legends[m].get_window_extent(renderer))]
        for ax in fig.axes:
            bars = [p.get_window_extent(renderer) for p in ax.patches if p.get_height() > 0 and p.get_width() > 0]
            found += [f"legend {n} over a bar" for bar in bars if box.overlaps(bar)][:1]
    return found


@pytest.mark.slow  # five workloads x nine paths drawn, every text measured
def test_the_latency_figures_draw_nothing_over_anything():
    """Five workloads x nine paths of long names (a GPU sweep's table), and the long-tail record: tick
    labels clear of each other, legends clear of every text, each other and the bars."""
    from rollout_lab.plots.latency import plot_occupancy, plot_step_cost, plot_trainer_loop

    paths = ["nocb", "equal_width", "aligned", "bucketed", "packed", "paged", "auto", "hf_generate",
             "hf_generate_batch"]
    rows = [{"workload": w, "path": p, "samples_ms": ";".join(str(10.0 + 3 * i + d) for d in range(3)),
             "tokens_per_s": 1000.0 * (1 + i % 4), "peak_mem_bytes": 2**30 * (1 + i), "prefill_ms": 4.0 + i,
             "decode_ms": 5.0, "cache_ms": 0.5, "num_prefill_forwards": 1 + i}
            for w in ("short_similar", "long_tail", "short_tail", "moderate_tail", "spread") for i, p in enumerate(paths)]
    summary = [{"workload": "long_tail", "auto_vs_best": 1.3, "auto_route": "bucketed",
                "auto_vs_best_manual_beyond_spread": False}]
    tail = [{"path": p, "slots": 128, "output_tokens_per_s": tps, "occupancy": occ, "queued_occupancy": queued}
            for p, tps, occ, queued in (("paged_128", 12200.0, 0.85, 0.97), ("aligned_128", 7300.0, 0.63, 0.29))]
    steps = [{"path": p, "slots": slots, "rows_max": top, "ms_per_step": 1.5 + 0.1 * k, "share_of_decode_ms": 0.1}
             for p, slots in (("paged_128", 128), ("paged_memory", 512)) for k, top in enumerate((1, 2, 4, 8, 128, slots))]
    loop = [{"iteration": i, "first_rollout_ms": 3000.0 + i, "steady_rollout_ms": 2990.0, "train_ms": 900.0,
             "logprob_mean_abs": mean, "logprob_max_abs": top} for i, (mean, top) in enumerate(((0.0, 0.0), (0.009, 0.055)))]
    for fig in (plot_e2e(rows, summary), plot_throughput_memory(rows), plot_breakdown(rows),
                plot_occupancy(tail, title="EOS long tail"), plot_trainer_loop(loop, title="trainer loop"),
                plot_step_cost(steps, title="EOS long tail: decode time by live rows"),
                plot_trainer_loop(loop[:1], title="trainer mode: exact")):
        assert _overlaps(fig) == [], fig.axes[0].get_ylabel()


# ---------------------------------------------------------------- issue 53: words, axes and colour bars of the figures

def _whole_rows(ours_and_best):
    return [{"workload": f"w{i}", "model": "m", "git_sha": "abc1234", "ours_ms": ours, "hf_generate_ms": best,
             "hf_static_ms": None, "hf_generate_batch_ms": None, "best_hf": "hf_generate",
             "speedup_over_best_hf": best / ours} for i, (ours, best) in enumerate(ours_and_best)]


def test_whole_table_says_as_fast_as_and_draws_speedups_linear_from_zero_around_one():
    from rollout_lab.plots.latency import plot_whole_table

    fig = plot_whole_table(_whole_rows([(121.5, 123.5), (89.3, 58.6), (78.8, 203.2)]), title="t")
    texts = _texts(fig)
    assert "as fast as hf_generate" in texts and "as fast than" not in texts
    seconds, ratios = fig.axes
    assert seconds.get_xscale() == "linear" and seconds.get_xlim()[0] == 0  # 0.06 .. 0.2 s: bars from 0
    assert ratios.get_xscale() == "linear" and ratios.get_xlim()[0] == 0 < 1 < ratios.get_xlim()[1]
    widths = sorted(round(p.get_width(), 3) for p in ratios.patches)
    assert widths == sorted(round(b / o, 3) for o, b in ((121.5, 123.5), (89.3, 58.6), (78.8, 203.2)))
    assert any(line.get_xdata()[0] == 1.0 for line in ratios.get_lines())  # the "as fast" line
    assert _overlaps(fig) == []


def test_whole_table_seconds_spanning_decades_start_at_a_decade():
    """The seconds' log axis started at matplotlib's margin (0.018 s), so bar lengths meant nothing:
    it starts at the decade below the fastest call."""
    from rollout_lab.plots.latency import plot_whole_table

    seconds = plot_whole_table(_whole_rows([(18.0, 600.0), (40.0, 4000.0)])).axes[0]
    assert seconds.get_xscale() == "log" and seconds.get_xlim()[0] == pytest.approx(0.01)


def test_throughput_memory_draws_both_panels_where_memory_was_measured():
    rows = [dict(r, peak_mem_bytes=2**30 * (1 + i)) for i, r in enumerate(_rows({"nocb": 20.0, "auto": 10.0}))]
    fig = plot_throughput_memory(rows)
    assert len(fig.axes) == 2 and all(ax.axison and ax.patches for ax in fig.axes)
    assert fig.axes[1].get_ylabel() == "peak memory (MiB)" and "not measured" not in _texts(fig)


@pytest.mark.parametrize("lo, hi, want", [(-7.0, 3.6, [-6, -4, -2, 0, 1, 2, 3]), (-7.0, 0.25, [-6, -4, -2, 0, 0.25]),
                                          (-0.25, 0.25, [-0.25, 0, 0.25]), (-0.1, 0.2, [-0.1, 0, 0.2])])
def test_colour_bar_ticks_number_both_sides(lo, hi, want):
    from rollout_lab.plots.buckets import both_sides_ticks

    assert both_sides_ticks(lo, hi) == pytest.approx(want)


@pytest.mark.slow  # three route maps drawn and measured
def test_route_map_colour_bars_are_numbered_on_both_sides(dists):
    """The two slopes fill half a bar each: the shallow bucketed side had one number or none
    (short_similar's had none)."""
    similar = resolve_distributions([{"kind": "seed", "name": "short_similar"}], batch_size=16, seeds=[0, 1])
    maps = [route_map(d.label, d.lengths, GEO, COSTS, max_lengths=[16, 64, 256, 1024, 2048], budgets=[1, 8, 64, 1024])
            for d in [*similar, *dists]]
    fig = plot_route_maps(maps)
    bars = [ax for ax in fig.axes if ax.get_label() == "<colorbar>"]
    assert len(bars) == len(maps)
    fig.canvas.draw()
    for bar in bars:
        low, high = bar.get_ylim()
        shown = [float(t.get_text().replace("−", "-")) for t, y in zip(bar.get_yticklabels(), bar.get_yticks())
                 if t.get_text() and low - 1e-9 <= y <= high + 1e-9]  # the locator also lists ticks off the bar
        assert min(shown) < 0 < max(shown) and 0 in shown, (shown, low, high)
