"""The figure of a GRPO benchmark record (``measure.grpo.run_grpo``): E2E per path, and where the
time of our two paths goes.

    record = json.load(open("data/results/grpo_tiny-qwen2_float32_cpu.json"))
    save_figure(plot_grpo(record), "figures", "grpo_tiny-qwen2_float32_cpu")

No torch import.

"""
from __future__ import annotations

from typing import Any, Mapping

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from rollout_lab.plots.style import PALETTE

PATH_LABELS = {"shared": "shared prefill", "unshared": "unshared", "hf_generate": "HF generate\n(num_return_sequences)"}
PHASES = ("prefill_ms", "cache_ms", "decode_ms")


def plot_grpo(record: Mapping[str, Any]) -> Figure:
    """Left: mean E2E ms per path with every timed sample; right: our paths' profiled phases, with
    the prefill rows each one ran."""
    results = record["results"]
    paths = list(results)
    if not paths:
        raise ValueError("the record holds no results")
    work, config = record["workload"], record["config"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8), gridspec_kw={"width_ratios": [3, 2]})
    for x, path in enumerate(paths):
        res = results[path]
        left.bar(x, res["mean_ms"], color=PALETTE(x), alpha=0.85)
        left.scatter([x] * len(res["ms"]), res["ms"], color="black", s=10, zorder=3)
        top = max([res["mean_ms"], *res["ms"]])
        left.annotate(f"{res['mean_ms']:.0f} ms", (x, top), xytext=(0, 4), textcoords="offset points",
                      ha="center", va="bottom", fontsize=8)
    left.margins(y=0.12)
    left.set_xticks(range(len(paths)), [PATH_LABELS.get(p, p) for p in paths], fontsize=8)
    left.set_ylabel("E2E ms (bar: mean; dots: samples)")
    left.set_title(f"{config.get('model', '?')} {config.get('dtype', '')} {config.get('device', '')}: "
                   f"{work['num_prompts']} prompts x {work['num_samples']} samples x "
                   f"{config.get('max_new_tokens', '?')} tokens", fontsize=9)
    ours = [p for p in paths if all(k in results[p] for k in PHASES)]
    bottom = [0.0] * len(ours)
    for k, phase in enumerate(PHASES):
        values = [results[p][phase] for p in ours]
        right.bar(range(len(ours)), values, bottom=bottom, color=PALETTE(k + 3), label=phase[:-3])
        bottom = [b + v for b, v in zip(bottom, values)]
    for x, path in enumerate(ours):
        right.annotate(f"{results[path]['num_prefill_rows']} prefill rows", (x, bottom[x]),
                       ha="center", va="bottom", fontsize=8)
    right.set_xticks(range(len(ours)), [PATH_LABELS.get(p, p) for p in ours], fontsize=8)
    right.set_ylabel("profiled ms")
    right.set_title("where our paths' time goes", fontsize=9)
    if ours:
        right.margins(y=0.12)
        right.legend(fontsize=8, loc="upper left")  # inside the axes: nothing drawn outside the figure
    fig.tight_layout()
    return fig
