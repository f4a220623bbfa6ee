"""Every committed measurement record agrees with itself: its means, medians and spreads are those of
its own samples, its ratios are those of its own means, and it names where it was measured.

A record edited by hand, or written by a script whose summary drifted from its samples, fails here.
Runs on the CPU: the GPU records are only read.
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from rollout_lab.engine.api.config import MANUAL_ROUTES
from rollout_lab.measure.prefill_routes import PREFILL_ROUTES
from rollout_lab.measure.records import PEER_PATHS
from rollout_lab.planner.cost import CostCoefficients, CostFile, ModelGeometry
from rollout_lab.planner.shape_classes import ShapeClasses, plan_buckets_classed

ROOT = Path(__file__).resolve().parents[1]
RESULTS = sorted(p for p in (ROOT / "data" / "results").rglob("*.json") if p.name != "index.json")  # archive/ too
CALIBRATIONS = sorted((ROOT / "data" / "calibration").glob("*.json"))
PROVENANCE = ("git_sha", "date", "device_type", "device_name", "torch", "transformers", "dtype")


def load(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def close(a: float, b: float) -> bool:
    return a == pytest.approx(b, rel=1e-9, abs=1e-9)


def test_there_are_records_to_check():
    assert len(RESULTS) >= 10 and len(CALIBRATIONS) >= 2


@pytest.mark.parametrize("path", RESULTS + CALIBRATIONS, ids=lambda p: p.name)
def test_every_record_names_where_it_was_measured(path):
    record = load(path)
    provenance = record.get("provenance", record.get("metadata"))
    missing = [k for k in PROVENANCE if not provenance.get(k)]
    assert not missing, f"{path.name} lacks provenance fields {missing}"
    kind = provenance["device_type"]
    assert f"_{kind}" in path.stem, f"{path.name} was measured on {kind}"
    assert provenance["dtype"] in path.stem


def _check_samples(name: str, entry: dict, samples_key: str, mean_key: str, std_key: str | None) -> None:
    samples = entry[samples_key]
    assert samples, f"{name}: no samples"
    assert close(entry[mean_key], statistics.fmean(samples)), f"{name}: {mean_key} is not the samples' mean"
    if std_key is not None and len(samples) > 1:
        spreads = (statistics.pstdev(samples), statistics.stdev(samples))
        assert any(close(entry[std_key], s) for s in spreads), f"{name}: {std_key} is not the samples' spread"


SWEEPS = [p for p in RESULTS if load(p).get("kind") == "sweep"]


@pytest.mark.parametrize("path", SWEEPS, ids=lambda p: p.name)
def test_sweep_means_and_ratios_follow_from_the_samples(path):
    record = load(path)
    assert record["workloads"], f"{path.name} has no workloads"
    for workload, entry in record["workloads"].items():
        paths = entry["paths"]
        for name, result in paths.items():
            if result.get("skipped"):
                continue
            _check_samples(f"{workload}/{name}", result, "samples_ms", "mean_ms", "std_ms")
            if "median_ms" in result:
                assert close(result["median_ms"], statistics.median(result["samples_ms"])), f"{workload}/{name}"
            tokens = result["tokens_per_s"] * result["mean_ms"] / 1e3
            assert tokens == pytest.approx(round(tokens), abs=1e-6), f"{workload}/{name}: tokens/s is not tokens / mean"
        summary = entry["summary"]
        # records since the medians were added rank by median, earlier ones by mean
        key = "median_ms" if any("median_ms" in r for r in paths.values()) else "mean_ms"
        means = {p: r[key] for p, r in paths.items() if r.get(key) is not None}
        manual = [means[p] for p in MANUAL_ROUTES if p in means]
        peers = [means[p] for p in PEER_PATHS if p in means]
        if "auto" in means and manual:
            assert close(summary["auto_over_best_manual"], means["auto"] / min(manual)), workload
            assert summary["auto_route"] == paths["auto"]["route"]
        if "auto" in means and peers:
            assert close(summary["auto_over_best_peer"], means["auto"] / min(peers)), workload


CLASSED = [p for p in SWEEPS  # bucketed at the class ladder, priced by a calibration
           if (config := load(p)["config"]).get("costs") and (config.get("engine") or {}).get("prefill_classes")
           and "bucketed" in config["paths"]]


@pytest.mark.parametrize("path", CLASSED, ids=lambda p: p.name)
def test_each_bucket_plan_a_sweep_ran_is_the_planners_under_the_records_own_costs(path):
    """The buckets (prompts, class width) that the bucketed route ran at the class ladder are
    ``plan_buckets_classed``'s for the workload's lengths under the coefficients the record holds: a
    plan or a cost edited by hand, or a planner that no longer plans as it did, fails here."""
    record = load(path)
    engine, costs = record["config"]["engine"], CostCoefficients.from_dict(record["config"]["costs"])
    geometry = ModelGeometry(**record["provenance"]["geometry"])
    classes = ShapeClasses(tuple(engine["prefill_classes"]["widths"]), tuple(engine["prefill_classes"]["rows"]))
    checked = 0
    for workload, entry in record["workloads"].items():
        ran = entry["paths"].get("bucketed")
        if ran is None or ran.get("skipped"):
            continue
        plan = plan_buckets_classed(entry["lengths"], geometry, costs, classes)
        assert [[len(b), w] for b, w in zip(plan.buckets, plan.widths)] == ran["buckets"], workload
        checked += 1
    assert checked, f"{path.name}: no bucketed run to check"


def test_the_eager_calibration_merged_the_buckets_that_01s_keeps_apart():
    """The README's account of the a315127 notebook run: priced by the calibration of eager prefill
    forwards (fixed cost 26.9 ms), moderate tail and GSM8K 32 ran one bucket each and spread one
    packed forward; priced by notebook 01's calibration of captured forwards (6.85 ms, the 204468e
    run), two buckets, two, and three."""
    results = ROOT / "data" / "results"
    eager = load(results / "sweep_qwen2.5-3b_bfloat16_cuda_notebook-03_eager-costs.json")
    captured = load(results / "sweep_qwen2.5-3b_bfloat16_cuda_notebook-03.json")
    assert eager["config"]["costs"]["prefill_fixed_cost_ms"] > 3 * captured["config"]["costs"]["prefill_fixed_cost_ms"]
    assert captured["config"]["costs_source"].endswith("qwen2.5-3b_bfloat16_cuda_notebook-01.json")
    for workload, merged, kept in (("moderate_tail", 1, 2), ("gsm8k_32", 1, 2), ("spread", 1, 3)):
        assert len(eager["workloads"][workload]["paths"]["auto"]["buckets"]) == merged, workload
        assert len(captured["workloads"][workload]["paths"]["auto"]["buckets"]) == kept, workload
    assert eager["workloads"]["spread"]["paths"]["auto"]["route"] == "packed"


def test_the_gpqa_row_joins_every_route_and_peer():
    """h200_notebooks.sh's default GPQA-like 128 x 256 row: 03's own run, HF static, and the more:<routes>
    records join into one workload with every route and peer once, and Auto / best route follows."""
    from rollout_lab.measure.paths import PATHS
    from rollout_lab.measure.records import join_sweeps, load_results

    stem = ROOT / "data" / "results" / "sweep_qwen2.5-3b_bfloat16_cuda_gpqa"
    files = [f"{stem}_diamond_128x256_notebook-03.json", f"{stem}128x256_hf_static.json",
             *map(str, sorted(stem.parent.glob(f"{stem.name}_diamond_128x256_routes-*.json")))]
    record = join_sweeps([load_results(f) for f in files], files)
    (entry,) = record["workloads"].values()
    assert sorted(entry["paths"]) == sorted(p for p in PATHS if p != "paged")  # paged came after this run
    medians = {p: e["median_ms"] for p, e in entry["paths"].items()}
    best = min(medians[p] for p in MANUAL_ROUTES if p in medians)
    assert close(entry["summary"]["auto_over_best_manual"], medians["auto"] / best)
    assert close(entry["summary"]["auto_over_best_peer"], medians["auto"] / min(medians[p] for p in PEER_PATHS))


RL = [p for p in RESULTS if load(p).get("kind") == "rl_throughput"]


@pytest.mark.parametrize("path", RL, ids=lambda p: p.name)
def test_rl_throughput_is_the_workloads_tokens_over_the_mean(path):
    record = load(path)
    tokens = record["workload"]["num_output_tokens"]
    assert tokens == sum(record["workload"]["budgets"]) or tokens <= sum(record["workload"]["budgets"])
    for name, result in record["results"].items():
        _check_samples(name, result, "samples_ms", "mean_ms", None)
        assert close(result["output_tokens_per_s"], tokens / (result["mean_ms"] / 1e3)), name


STEPS = [p for p in RESULTS if load(p).get("kind") == "decode_step"]


@pytest.mark.parametrize("path", STEPS, ids=lambda p: p.name)
def test_decode_step_statistics_are_the_samples(path):
    for case, variants in load(path)["cases"].items():
        for name, result in variants.items():
            samples = result["step_ms_samples"]
            _check_samples(f"{case}/{name}", result, "step_ms_samples", "step_ms_mean", "step_ms_stdev")
            assert close(result["step_ms_median"], statistics.median(samples)), f"{case}/{name}"


LOGITS = [p for p in RESULTS if load(p).get("kind") == "teacher_forced_logits"]


@pytest.mark.parametrize("path", LOGITS, ids=lambda p: p.name)
def test_logit_errors_are_the_worst_step(path):
    for name, result in load(path)["variants"].items():
        assert close(result["max_abs_error"], max(result["per_step_max_abs_error"])), name
        assert 0.0 <= result["top1_agreement"] <= 1.0 and result["num_decided"] <= result["num_positions"]


PREFILL_RECORDS = [p for p in RESULTS if load(p).get("kind") == "prefill_routes"]


@pytest.mark.parametrize("path", PREFILL_RECORDS, ids=lambda p: p.name)
def test_prefill_route_statistics_are_the_samples(path):
    record = load(path)
    assert record["rows"], path.name
    for row in record["rows"]:
        name = f"{row['distribution']} x{row['batch_size']} {row['route']}"
        samples = [float(x) for x in row["samples_ms"].split(";")]  # kept to 3 decimals
        assert len(samples) == record["config"]["repetitions"], name
        assert row["mean_ms"] == pytest.approx(statistics.fmean(samples), abs=1e-3), name
        assert row["median_ms"] == pytest.approx(statistics.median(samples), abs=1e-3), name
        assert row["q1_ms"] <= row["median_ms"] <= row["q3_ms"], name
        assert row["route"] in record["config"].get("routes", PREFILL_ROUTES), name
    done = {r["batch_size"] for r in record["rows"]}  # a size is done when both its batches are
    assert set(record["batch_sizes_done"]) <= done <= set(record["config"]["batch_sizes"]), path.name


GRPO = [p for p in RESULTS if p.name.startswith("grpo_")]


@pytest.mark.parametrize("path", GRPO, ids=lambda p: p.name)
def test_grpo_ratios_follow_from_the_means(path):
    record = load(path)
    results = record["results"]
    for name, result in results.items():
        _check_samples(name, result, "ms", "mean_ms", None)
    for key, ratio in record["ratios"].items():
        num, den = key.split("_over_")
        assert close(ratio, results[num]["mean_ms"] / results[den]["mean_ms"]), key
    from rollout_lab.measure.records import grpo_rows, load_grpo_results

    rows = grpo_rows(load_grpo_results(path))  # what notebook 03 renders
    tokens = record["workload"]["num_generated_tokens"]
    assert len(rows) == sum(len(r["ms"]) + 1 for r in results.values())
    for row in rows:
        assert row["tokens_per_s"] == pytest.approx(tokens / (row["ms"] / 1e3), rel=1e-3), row


@pytest.mark.parametrize("path", CALIBRATIONS, ids=lambda p: p.name)
def test_every_committed_cost_file_loads_with_its_measured_numbers(path):
    """A committed calibration stays readable by ``CostFile.read`` (a field the cost model gained
    later is migrated into the file, never left to break it), and what it reads is the file's own."""
    cost_file = CostFile.read(path)
    saved = load(path)["coefficients"]
    assert {k: v for k, v in cost_file.costs.to_dict().items() if k in saved} == saved


@pytest.mark.parametrize("path", CALIBRATIONS, ids=lambda p: p.name)
def test_calibration_fit_errors_follow_from_its_shapes(path):
    metadata = load(path)["metadata"]
    fit = metadata["fit"]
    statistic = {"median": statistics.median, "min": min}[metadata["grid"]["statistic"]]
    errors = []
    for shape in fit["shapes"]:
        assert close(shape["forward_ms"], statistic(shape["forward_samples_ms"])), shape
        assert close(shape["measured_ms"], shape["forward_ms"] + shape["kv_copy_ms"]), shape
        assert close(shape["rel_error"], (shape["predicted_ms"] - shape["measured_ms"]) / shape["measured_ms"]), shape
        errors.append(abs(shape["rel_error"]))
    assert close(fit["worst_rel_error"], max(errors))
    assert 0.0 <= fit["r2"] <= 1.0


def test_a_record_of_another_kind_is_not_read_as_grpo():
    from rollout_lab.measure.records import load_grpo_results

    other = next(p for p in RESULTS if load(p).get("kind") not in (None, "grpo"))
    with pytest.raises(ValueError, match="is not a grpo record"):
        load_grpo_results(other)


COMPILE_COSTS = [p for p in RESULTS if load(p).get("kind") == "compile_cost"]


@pytest.mark.parametrize("path", COMPILE_COSTS, ids=lambda p: p.name)
def test_compile_cost_totals_follow_from_the_calls(path):
    record = load(path)
    assert set(record["total_seconds"]) == {r["mode"] for r in record["rows"]}
    for mode, total in record["total_seconds"].items():
        calls = [r for r in record["rows"] if r["mode"] == mode]
        assert [r["rows"] for r in calls] == record["config"]["rows"], f"{path.name}: {mode} lacks calls"
        assert close(total, sum(r["seconds"] for r in calls)), f"{path.name}: {mode}'s total is not its calls' sum"
        assert all(r["equal_to_eager"] for r in calls), f"{path.name}: {mode} changed a token"


LONG_TAIL = [p for p in RESULTS if load(p).get("kind") == "eos_long_tail"]


@pytest.mark.parametrize("path", LONG_TAIL, ids=lambda p: p.name)
def test_long_tail_figures_follow_from_the_samples(path):
    """tok/s is the timed call's tokens over its mean, occupancy its live rows over its slots, and the
    paged cache kept its slots fuller than the aligned one at the same slot count."""
    results = load(path)["results"]
    for name, r in results.items():
        _check_samples(name, r, "samples_ms", "mean_ms", None)
        assert close(r["output_tokens_per_s"], r["output_tokens"] / (r["mean_ms"] / 1e3)), name
        assert close(r["occupancy"], r["live_rows_per_step"] / r["num_slots"]), name
        if r["route"] == "paged":
            assert close(r["peak_kv_bytes_over_live"], r["peak_kv_blocks"] * r["kv_block_size"] / r["peak_live_tokens"])
    if {"paged_128", "aligned_128"} <= set(results):
        paged, aligned = results["paged_128"], results["aligned_128"]
        assert paged["queued_occupancy"] > aligned["queued_occupancy"]
        assert paged["num_decode_steps"] < aligned["num_decode_steps"]


def test_the_records_index_is_current():
    """data/results/index.json and its README are what regeneration gives (every record, its status
    from where it is cited, the hand-kept roles), so neither can go stale."""
    from rollout_lab.measure.evidence import INDEX_PAGE, build_index, index_markdown, read_index

    results = ROOT / "data" / "results"
    fresh = build_index(ROOT)
    assert fresh == read_index(results), "run: python -m rollout_lab.measure.evidence"
    assert (results / INDEX_PAGE).read_text(encoding="utf-8") == index_markdown(fresh)
    assert sorted(fresh["records"]) == sorted(str(p.relative_to(results)) for p in RESULTS)
    assert {n for n, e in fresh["records"].items() if e["status"] == "archived"} == \
        {str(p.relative_to(results)) for p in (results / "archive").glob("*.json")}
    roles = [r for e in fresh["records"].values() for r in e["roles"]]
    assert sorted(roles) == ["headline", "headline_peer"]
