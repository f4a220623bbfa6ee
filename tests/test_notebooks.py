"""Every notebook, executed by papermill with smoke parameters into tmp_path; its outputs checked.

The notebooks run once per module (a fixture); each test then reads what they wrote. About a
minute on 2 CPU cores in all. Also static checks of the committed notebooks (the top-level
``notebooks/`` folder, which the wheel ships by pyproject.toml's mapping; no outputs, a ``parameters``
cell, no def/class) and that the kernel papermill picks is this interpreter.
"""
from __future__ import annotations

import ast
import csv
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

# papermill and nbformat take seconds to import, and make test-fast collects this module only to
# deselect it: here they are looked for, and the fixtures pm and nbformat import them
for _extra in ("papermill", "nbformat", "matplotlib"):  # the [notebooks] extra
    if importlib.util.find_spec(_extra) is None:
        pytest.skip(f"{_extra} is not installed: the [notebooks] extra", allow_module_level=True)
pytestmark = pytest.mark.slow  # the module fixture executes every notebook: ~1.5 min of the suite

from rollout_lab.notebooks import (NOTEBOOKS, SMOKE_PARAMETERS,  # noqa: E402
                                   calibration_of, notebook_path, run_notebooks)
from rollout_lab.workspace import Workspace  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
ROOT = Path(__file__).resolve().parents[1]


def read_csv(path: Path) -> list[dict[str, str]]:
    assert path.is_file(), f"missing table {path}"
    with path.open(newline="", encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle))
    assert rows, f"empty table {path}"
    return rows


def assert_figure(directory: Path, stem: str, *, svg: bool = True) -> None:
    png = directory / f"{stem}.png"
    assert png.is_file(), f"missing figure {png}; have {sorted(p.name for p in directory.iterdir())}"
    assert png.read_bytes()[:8] == PNG_MAGIC and png.stat().st_size > 5000
    if svg:
        assert (directory / f"{stem}.svg").read_text(encoding="utf-8").lstrip().startswith("<?xml")


@pytest.fixture(scope="module")
def pm():
    import papermill  # optional, heavy: the [notebooks] extra

    return papermill


@pytest.fixture(scope="module")
def nbformat():
    import nbformat  # optional, heavy: the [notebooks] extra

    return nbformat


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    out = tmp_path_factory.mktemp("notebooks")
    notebooks = run_notebooks(out_dir=out, extra=SMOKE_PARAMETERS, progress=False)
    return out, notebooks


# ---------------------------------------------------------------- the committed notebooks

@pytest.mark.parametrize("name", NOTEBOOKS)
def test_committed_notebook_is_clean(name, pm, nbformat):
    nb = nbformat.read(notebook_path(name), as_version=4)
    assert nb.cells[0].cell_type == "markdown"
    tagged = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(tagged) == 1 and tagged[0] is nb.cells[1]
    for node in ast.walk(ast.parse(tagged[0].source)):  # literals only
        if isinstance(node, ast.Assign):
            ast.literal_eval(node.value)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, f"{name}: commit without outputs"
            tree = ast.parse(cell.source)
            defs = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef, ast.Lambda))]
            assert not defs, f"{name}: notebooks define no functions or classes"
    declared = pm.inspect_notebook(str(notebook_path(name)))
    assigned = {t.id for node in ast.parse(tagged[0].source).body if isinstance(node, ast.Assign) for t in node.targets}
    assert set(declared) == assigned, "papermill could not parse a parameter line (its comment?)"
    assert {"output_dir", "interactive"} <= set(declared)
    assert set(SMOKE_PARAMETERS[name]) <= set(declared)


def test_the_notebooks_are_the_top_level_folder_which_the_wheel_ships():
    """In a checkout the runner executes notebooks/*.ipynb, the files JupyterLab opens; the wheel ships that
    folder as rollout_lab._notebooks by pyproject.toml's package-dir, not by a copy inside the package."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    folder = ROOT / "notebooks"
    assert sorted(p.stem for p in folder.glob("*.ipynb")) == sorted(NOTEBOOKS)
    for name in NOTEBOOKS:
        assert notebook_path(name) == folder / f"{name}.ipynb"
        assert notebook_path(name).read_bytes() == (folder / f"{name}.ipynb").read_bytes()
    package = ROOT / "rollout_lab"
    copies = sorted(str(p.relative_to(ROOT)) for p in package.rglob("*.ipynb"))
    assert not copies, f"notebooks inside the package: {copies}; they live in notebooks/ only"
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
    assert setuptools["package-dir"] == {"rollout_lab._notebooks": "notebooks"}
    assert setuptools["package-data"]["rollout_lab._notebooks"] == ["*.ipynb"]
    # the packages are listed (find cannot map a folder outside rollout_lab/): every folder of the
    # package, as find would have found it, and the notebooks
    folders = {".".join(("rollout_lab", *p.relative_to(package).parts)) for p in package.rglob("*")
               if p.is_dir() and all(s.isidentifier() and s != "__pycache__" for s in p.relative_to(package).parts)}
    assert sorted(setuptools["packages"]) == sorted({"rollout_lab", "rollout_lab._notebooks", *folders})


def test_gpu_preset_parameters_run_the_engine_as_the_records_do(pm):
    """`rollout-lab notebooks --device cuda --preset ...`: each notebook gets the settings the H200
    records used, and every one of them is a parameter that notebook declares."""
    from rollout_lab.measure.paths import PATHS
    from rollout_lab.notebooks import notebook_parameters

    gpu = {n: notebook_parameters(n, device="cuda", preset="qwen2.5-3b", output_dir="w") for n in NOTEBOOKS}
    from rollout_lab.measure.calibrate import CalibrationGrid, calibration_grid
    grid = calibration_grid(gpu["01_calibrate"]["grid"])  # the default grid's shapes, not the tiny one's
    assert grid.prefill_graphs and grid.repeats == 3 and grid.shapes() == CalibrationGrid().shapes()
    assert gpu["03_latency_tables"]["prefill_graphs"] is True
    assert gpu["03_latency_tables"]["paths"] == [p for p in PATHS if p != "hf_static"]  # its peer: own process
    assert gpu["02_bucket_choices"]["crossing_at_classes"] is True
    assert gpu["02_bucket_choices"]["kv_dtype"] == "bfloat16" == gpu["03_latency_tables"]["dtype"]
    declared = {n: set(pm.inspect_notebook(str(notebook_path(n)))) for n in NOTEBOOKS}
    for key in ("grid", "prefill_graphs", "crossing_at_classes", "kv_dtype", "paths"):
        assert any(key in declared[n] for n in NOTEBOOKS), key
    assert "rl_shape" not in gpu["03_latency_tables"]  # the RL shape is measured on its own model only
    rl = notebook_parameters("03_latency_tables", device="cuda", preset="qwen3-0.6b", output_dir="w")["rl_shape"]
    assert (rl["num_seqs"], rl["min_len"], rl["max_len"]) == (256, 100, 1024) and rl["paths"][-1] == "hf_generate_batch"
    assert "rl_shape" in declared["03_latency_tables"]
    cpu = notebook_parameters("03_latency_tables", device="cpu", preset="qwen2.5-3b", output_dir="w")
    assert cpu["paths"] is None and "prefill_graphs" not in cpu and cpu["grid"] == "default"


def test_kernel_is_this_interpreter(tmp_path, pm, nbformat):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("import sys; print(sys.executable)")])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    source, target = tmp_path / "k.ipynb", tmp_path / "k_out.ipynb"
    nbformat.write(nb, source)
    pm.execute_notebook(str(source), str(target), kernel_name="python3", progress_bar=False)
    text = nbformat.read(target, as_version=4).cells[0].outputs[0]["text"].strip()
    assert Path(text).resolve() == Path(sys.executable).resolve()


# ---------------------------------------------------------------- 02: bucket choices

def test_02_figures(executed):
    out, _ = executed
    figures = out / "figures"
    for stem in ("02_buckets_all", "02_buckets_gsm8k", "02_cost_by_num_buckets", "02_fixed_cost_sweep",
                 "02_fixed_cost_buckets_gsm8k", "02_route_maps", "02_packed_crossing"):
        assert_figure(figures, stem)
    crossing = read_csv(out / "data" / "tables" / "02_packed_crossing.csv")
    assert {r["distribution"] for r in crossing} == {"lognormal", "bimodal"}
    assert {int(r["batch_size"]) for r in crossing} == {32, 64, 128, 256, 512}
    assert all(float(r["packed_zero_ms"]) <= float(r["bucketed_ms"]) for r in crossing)  # packed's floor
    assert_figure(figures, "02_explorer_static", svg=False)


def test_02_bucket_costs_never_above_one_bucket(executed):
    out, _ = executed
    rows = read_csv(out / "data" / "tables" / "02_cost_by_num_buckets.csv")
    groups: dict[tuple[str, str], list[dict[str, str]]] = {}
    for r in rows:
        groups.setdefault((r["distribution"], r["seed"]), []).append(r)
    labels = {d for d, _ in groups}
    assert {"long_tail", "gsm8k"} <= labels and any(d.startswith("lognormal") for d in labels)
    assert any(d.startswith("bimodal") for d in labels)
    for key, group in groups.items():
        costs = {int(r["num_buckets"]): float(r["cost_ms"]) for r in group}
        shares = [float(r["padding_share"]) for r in group]
        assert all(0.0 <= s <= 1.0 for s in shares), key
        chosen = [r for r in group if r["is_dp_choice"] == "True"]
        assert len(chosen) == 1, key
        best = float(chosen[0]["cost_ms"])
        assert best <= costs[1] * (1 + 1e-9), key
        assert best <= min(costs.values()) * (1 + 1e-9), key
        assert all(float(r["cost_vs_one_bucket"]) > 0 for r in group)
    summary = read_csv(out / "data" / "tables" / "02_summary.csv")
    for r in summary:
        assert float(r["dp_cost_ms"]) <= float(r["one_bucket_cost_ms"]) * (1 + 1e-9)
        assert 0.0 <= float(r["dp_padding_share"]) <= float(r["one_bucket_padding_share"]) + 1e-12 <= 1.0 + 1e-12
        assert r["route"] in ("nocb", "bucketed")
    long_tail = next(r for r in summary if r["distribution"] == "long_tail")
    assert long_tail["dp_widths"] == "16;512" and long_tail["route"] == "bucketed"  # the worked example
    assert math.isclose(float(long_tail["dp_cost_ms"]), 154.43, abs_tol=0.01)


def test_02_fixed_cost_sweep_and_route_map(executed):
    out, _ = executed
    sweep = read_csv(out / "data" / "tables" / "02_fixed_cost_sweep.csv")
    for label in {r["distribution"] for r in sweep}:
        mine = sorted((r for r in sweep if r["distribution"] == label), key=lambda r: float(r["fixed_cost_ms"]))
        ks = [int(r["num_buckets"]) for r in mine]
        assert ks == sorted(ks, reverse=True), f"{label}: a higher fixed cost never adds buckets: {ks}"
        for r in mine:
            assert float(r["cost_ms"]) <= float(r["one_bucket_cost_ms"]) * (1 + 1e-9)
        sizes = {sum(int(s) for s in r["bucket_sizes"].split(";")) for r in mine}
        assert len(sizes) == 1, f"{label}: every plan covers every prompt"
    route = read_csv(out / "data" / "tables" / "02_route_map.csv")
    assert {r["route"] for r in route} == {"nocb", "bucketed"}
    for r in route:
        nocb, cb = float(r["nocb_cost_ms"]), float(r["cb_cost_ms"])
        assert r["route"] == ("nocb" if nocb <= cb else "bucketed")


# ---------------------------------------------------------------- 01: calibration

def test_01_calibration_outputs(executed, nbformat):
    out, _ = executed
    cost_file = out / "data" / "calibration" / "tiny-qwen2_float32_cpu.json"
    data = json.loads(cost_file.read_text())
    assert all(v is None or (math.isfinite(v) and v >= 0) for v in data["coefficients"].values())
    assert data["metadata"]["model_name"] == "tiny-qwen2"
    fit_quality = data["metadata"]["fit"]
    assert isinstance(fit_quality["warnings"], list)  # said in the file, and printed by the notebook:
    printed = "".join(o.get("text", "") for c in nbformat.read(out / "build" / "notebooks" / "01_calibrate.ipynb",
                                                                as_version=4).cells if c.cell_type == "code"
                      for o in c.get("outputs", []))
    assert all(f"WARNING: {w}" in printed for w in fit_quality["warnings"])
    assert fit_quality["warnings"] or "fit quality: R² >= 0.9" in printed
    fit = read_csv(out / "data" / "tables" / "01_calibration_fit_tiny_qwen2_float32_cpu.csv")
    assert len(fit) == 4  # smoke grid: 2 batches x 2 widths
    for r in fit:
        assert float(r["measured_ms"]) > 0 and float(r["predicted_ms"]) >= 0
        assert math.isfinite(float(r["rel_error"]))
    assert_figure(out / "figures", "01_calibration_tiny_qwen2_float32_cpu")
    packed = read_csv(out / "data" / "tables" / "01_calibration_packed_tiny_qwen2_float32_cpu.csv")
    assert len(packed) == len(data["metadata"]["fit"]["packed"]) > 0  # the packed fit, shown
    assert all(int(r["prompts"]) >= 2 and math.isfinite(float(r["rel_error"])) for r in packed)
    assert_figure(out / "figures", "01_calibration_packed_tiny_qwen2_float32_cpu")


# ---------------------------------------------------------------- 03: latency tables

def test_03_latency_outputs(executed):
    out, _ = executed
    record = json.loads((out / "data" / "results" / "sweep_tiny-qwen2_float32_cpu.json").read_text())
    assert set(record["workloads"]) == {"long_tail", "spread"}
    table = read_csv(out / "data" / "tables" / "03_e2e_tiny_qwen2_float32_cpu.csv")
    assert [r["workload"] for r in table] == ["long_tail", "spread"]
    for r in table:
        assert r["auto_route"] in ("nocb", "bucketed", "packed")  # priced by 01's calibration, which times packed
        assert all(float(r[f"{p}_ms"]) > 0 for p in ("nocb", "equal_width", "aligned", "bucketed", "auto"))
        assert float(r["auto_vs_best"]) > 0
    assert all(r["auto_vs_best_beyond_spread"] in ("True", "False") for r in table)
    saved = read_csv(out / "data" / "results" / "sweep_tiny-qwen2_float32_cpu.csv")
    assert {r["run_id"] for r in saved} == {record["run_id"]}  # the record's pair, from one write
    rows = read_csv(out / "data" / "tables" / "03_results_tiny_qwen2_float32_cpu.csv")
    for r in rows:
        assert float(r["q1_ms"]) <= float(r["median_ms"]) <= float(r["q3_ms"])
        assert r["matches_nocb"] == "True"
        assert int(r["num_prefill_forwards"]) >= 1
    for stem in ("03_e2e", "03_throughput_memory", "03_breakdown"):
        assert_figure(out / "figures", f"{stem}_tiny_qwen2_float32_cpu")
    prefill = read_csv(out / "data" / "tables" / "03_prefill_routes_tiny_qwen2_float32_cpu.csv")
    assert {(r["route"], r["backend"]) for r in prefill} == {("nocb", "hf_padded"), ("bucketed", "padded"),
                                                            ("packed", "segments")}
    assert {int(r["batch_size"]) for r in prefill} == {8, 16, 32} and all(float(r["mean_ms"]) > 0 for r in prefill)
    assert_figure(out / "figures", "03_prefill_routes_tiny_qwen2_float32_cpu")
    # rl_shape: the RL shape measured on the notebook's model, written as a record, drawn, and in the whole table
    rl = read_csv(out / "data" / "tables" / "03_rl_throughput_tiny_qwen2_float32_cpu.csv")
    assert [r["path"] for r in rl] == ["ours", "hf_generate_batch"] and float(rl[0]["output_tokens_per_s"]) > 0
    assert json.loads((out / "data" / "results" / "rl_tiny-qwen2_float32_cpu.json").read_text())["workload"][
        "num_requests"] == SMOKE_PARAMETERS["03_latency_tables"]["rl_shape"]["num_seqs"]
    # long_tail_shape: the EOS long tail measured on the notebook's model, written as a record and drawn;
    # the paged cache kept its slots full while rows waited, the aligned one did not
    tail = {r["path"]: r for r in read_csv(out / "data" / "tables" / "03_long_tail_tiny_qwen2_float32_cpu.csv")}
    assert set(tail) == {"paged_128", "aligned_128"} and tail["paged_128"]["output_tokens"] == tail["aligned_128"]["output_tokens"]
    assert float(tail["paged_128"]["queued_occupancy"]) > 0.95 > float(tail["aligned_128"]["queued_occupancy"])
    assert (out / "data" / "results" / "long_tail_tiny-qwen2_float32_cpu.json").is_file()
    assert_figure(out / "figures", "03_long_tail_tiny_qwen2_float32_cpu")
    # trainer_loop_shape: rollouts alternated with GRPO steps on one model, as a record and drawn; the
    # trainer-mode logprobs are the trainer forward's, bit for bit
    loop = read_csv(out / "data" / "tables" / "03_trainer_loop_tiny_qwen2_float32_cpu.csv")
    assert [int(r["iteration"]) for r in loop] == [0, 1]
    assert all(float(r["logprob_max_abs"]) == 0 and float(r["train_ms"]) > 0 for r in loop)
    assert (out / "data" / "results" / "trainer_loop_tiny-qwen2_float32_cpu.json").is_file()
    assert_figure(out / "figures", "03_trainer_loop_tiny_qwen2_float32_cpu")
    # grpo_shape: GRPO measured on the notebook's model, written as a record, drawn, and in the whole table
    grpo = json.loads((out / "data" / "results" / "grpo_tiny-qwen2_float32_cpu.json").read_text())
    assert set(grpo["results"]) == {"shared", "unshared", "hf_generate"} and grpo["workload"]["num_rows"] == 4
    assert grpo["checks"]["shared_equals_unshared_fraction"] == 1.0  # seeded sampling: the same tokens
    assert_figure(out / "figures", "03_grpo_tiny_qwen2_float32_cpu")
    # more_shape: more workloads at their own generation length, through the paths it names, as a record
    more = json.loads((out / "data" / "results" / "sweep_tiny-qwen2_float32_cpu_short_tailx2.json").read_text())
    assert more["config"]["max_new_tokens"] == 2 and more["config"]["paths"] == ["bucketed", "auto"]
    assert list(more["workloads"]) == ["short_tail"] and more["config"]["repetitions"] == 1  # the run's
    whole = read_csv(out / "data" / "tables" / "03_whole_table_tiny_qwen2_float32_cpu.csv")
    assert [r["workload"] for r in whole] == ["long_tail x 3", "spread x 3", "short_tail x 2", "RL shape (4 requests)",
                                              "GRPO 2 x 2 x 3"]
    assert whole[2]["best_hf"] == "" and float(whole[2]["ours_ms"]) > 0  # no HF peer in that record
    assert whole[4]["ours"] == "shared" and whole[4]["best_hf"] == "hf_generate"
    # fp8_kv_shape (the notebook's default): the paged pool's bf16/fp32 KV against e4m3, teacher-forced
    kv = {r["variant"]: r for r in read_csv(out / "data" / "tables" / "03_kv_dtypes_tiny_qwen2_float32_cpu.csv")}
    assert (kv["ours_paged"]["kv_dtype"], kv["ours_fp8_kv"]["kv_dtype"]) == ("auto", "fp8")
    assert float(kv["ours_paged"]["max_logprob_error"]) < 1e-4 < float(kv["ours_fp8_kv"]["mean_logprob_error"])
    assert (out / "data" / "results" / "logits_tiny-qwen2_float32_cpu_kv-dtypes.json").is_file()
    assert_figure(out / "figures", "03_kv_dtypes_tiny_qwen2_float32_cpu")


def test_03_renders_a_saved_results_file(executed, tmp_path):
    out, _ = executed
    saved = out / "data" / "results" / "sweep_tiny-qwen2_float32_cpu.json"
    committed = Path(__file__).resolve().parents[1] / "data" / "results"
    rl_records = [str(committed / "rl_qwen3-0.6b_bfloat16_cuda_levers.json"),
                  str(committed / "rl_qwen3-0.6b_bfloat16_cuda.json")]  # the same workload, two runs
    steps = committed / "decode_step_qwen2.5-3b_bfloat16_cuda.json"
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-m", "rollout_lab.cli", "bench", "prefill-routes", "--tiny", "llama",
                           "--batch-sizes", "4", "--repetitions", "1", "--out", str(tmp_path / "prefill")],
                          env=dict(os.environ, PYTHONPATH=str(root)), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    gpqa = [str(committed / "archive" / "sweep_qwen2.5-3b_bfloat16_cuda_gpqa128x256.json"),
            str(committed / "sweep_qwen2.5-3b_bfloat16_cuda_gpqa128x256_hf_static.json")]  # joined
    grpo = committed / "grpo_qwen2.5-3b_bfloat16_cuda.json"
    tail = committed / "long_tail_qwen2.5-0.5b_bfloat16_cuda.json"
    run_notebooks(names=["03_latency_tables"], out_dir=tmp_path,
                  extra={"03_latency_tables": {"results_file": str(saved), "rl_results_file": rl_records,
                                               "long_tail_results_file": str(tail),
                                               "decode_step_file": str(steps), "grpo_results_file": str(grpo),
                                               "more_results_file": [gpqa],
                                               "prefill_routes_file": str(tmp_path / "prefill.json")}},
                  progress=False)
    rendered = read_csv(tmp_path / "data" / "tables" / "03_prefill_routes_tiny_llama_float32_cpu.csv")
    assert {r["route"] for r in rendered} == {"nocb", "bucketed", "packed"}  # the record's, not a new run
    assert not (tmp_path / "data" / "results").exists() or not any((tmp_path / "data" / "results").iterdir())
    assert_figure(tmp_path / "figures", "03_e2e_tiny_qwen2_float32_cpu")
    assert read_csv(tmp_path / "data" / "tables" / "03_e2e_tiny_qwen2_float32_cpu.csv")
    # the committed H200 RL records, joined: a row per path and run, each lever faster than none
    rl = {(r["path"], r["git_sha"]): float(r["output_tokens_per_s"])
          for r in read_csv(tmp_path / "data" / "tables" / "03_rl_throughput_qwen3_0_6b_bfloat16_cuda.csv")}
    shas = sorted({sha for _, sha in rl})
    assert len(shas) == 2 and {p for p, _ in rl} == {"ours", "ours_no_compile", "ours_masked", "hf_generate_batch"}
    ours = max(v for (p, _), v in rl.items() if p == "ours")
    no_compile, masked, hf = (next(v for (p, _), v in rl.items() if p == name)
                              for name in ("ours_no_compile", "ours_masked", "hf_generate_batch"))
    assert ours > no_compile > masked > hf > 0
    assert_figure(tmp_path / "figures", "03_rl_throughput_qwen3_0_6b_bfloat16_cuda")
    # the committed H200 EOS long tail: paged against aligned at 128 slots, as the record says
    tail_rows = {r["path"]: r for r in read_csv(tmp_path / "data" / "tables" / "03_long_tail_qwen2_5_0_5b_bfloat16_cuda.csv")}
    assert float(tail_rows["paged_128"]["output_tokens_per_s"]) > float(tail_rows["aligned_128"]["output_tokens_per_s"])
    assert float(tail_rows["paged_128"]["queued_occupancy"]) > 0.9 > float(tail_rows["aligned_128"]["queued_occupancy"])
    assert_figure(tmp_path / "figures", "03_long_tail_qwen2_5_0_5b_bfloat16_cuda")
    # the decode-step record: every case and variant, the compiled span step the fastest
    steps = read_csv(tmp_path / "data" / "tables" / "03_decode_step_qwen2_5_3b_bfloat16_cuda.csv")
    assert {r["case"] for r in steps} == {"32x80", "128x710"}
    for case in ("32x80", "128x710"):
        ms = {r["variant"]: float(r["step_ms_median"]) for r in steps if r["case"] == case}
        assert ms["ours"] < ms["ours_no_compile"] < ms["ours_masked"]
    assert_figure(tmp_path / "figures", "03_decode_step_qwen2_5_3b_bfloat16_cuda")
    # the whole table: the saved sweep's workloads, GPQA-like 128 x 256 against its own-process peer,
    # each RL record and the GRPO record, every row with the fastest HF peer it was measured against
    whole = read_csv(tmp_path / "data" / "tables" / "03_whole_table_tiny_qwen2_float32_cpu.csv")
    assert [r["workload"] for r in whole] == ["long_tail x 3", "spread x 3", "gpqa_diamond_128 x 256",
                                              "RL shape (256 requests)", "RL shape (256 requests)", "GRPO 64 x 8 x 512"]
    gpqa_row = whole[2]
    assert gpqa_row["best_hf"] == "hf_static" and float(gpqa_row["speedup_over_best_hf"]) > 1
    assert {r["best_hf"] for r in whole[3:5]} == {"hf_generate_batch", ""}  # the levers record has no peer
    assert whole[5]["ours"] == "shared" and float(whole[5]["speedup_over_best_hf"]) > 1
    assert_figure(tmp_path / "figures", "03_whole_table_tiny_qwen2_float32_cpu")


# ---------------------------------------------------------------- 04: beyond the reference planner

def test_04_adaptation_outputs(executed):
    out, _ = executed
    for r in read_csv(out / "data" / "tables" / "04_chunked.csv"):
        assert r["matches_reference"] == "True" and r["within_limit"] == "True"
        assert int(r["max_forward_tokens"]) <= int(r["limit"]) and int(r["num_chunked_prompts"]) >= 1
    eos = read_csv(out / "data" / "tables" / "04_eos_prior.csv")
    assert {r["source"] for r in eos} == {"tiny model, natural EOS", "scripted geometric lengths, cost model"}
    for r in eos:
        assert float(r["eos_aware_e2e_ms"]) > 0 and float(r["reference_e2e_ms"]) > 0
    scripted = [r for r in eos if r["source"].startswith("scripted")]
    assert all(float(r["eos_aware_vs_reference"]) <= 1 + 1e-9 for r in scripted)  # priced by the model itself
    online = read_csv(out / "data" / "tables" / "04_online.csv")
    assert len(online) == 6 and all(math.isfinite(float(r["prefill_rel_error"])) for r in online)
    for stem in ("04_chunked_plan", "04_eos_prior", "04_online_convergence"):
        assert_figure(out / "figures", stem)


def test_executed_copies_have_outputs(executed, nbformat):
    _, notebooks = executed
    assert [p.stem for p in notebooks] == list(NOTEBOOKS)
    for path in notebooks:
        nb = nbformat.read(path, as_version=4)
        assert any(c.get("outputs") for c in nb.cells if c.cell_type == "code")
        assert any("injected-parameters" in c.metadata.get("tags", []) for c in nb.cells)


def test_01_cost_file_feeds_02_and_03(executed):
    out, _ = executed
    from rollout_lab.planner.cost import CostCoefficients, CostFile

    cost_file = out / "data" / "calibration" / "tiny-qwen2_float32_cpu.json"
    costs = CostFile.read(cost_file).costs
    assert costs == CostCoefficients.from_dict(json.loads(cost_file.read_text())["coefficients"])
    # the runner gave 03 that calibration (01 and 03 ran together, no cost_file of 03's own)
    sweep = json.loads((out / "data" / "results" / "sweep_tiny-qwen2_float32_cpu.json").read_text())
    assert sweep["config"]["costs"] == costs.to_dict() and sweep["config"]["costs_source"] == str(cost_file)


def test_calibration_of_names_what_01_writes_or_renders(tmp_path):
    assert calibration_of({"model": "tiny-qwen3", "dtype": "float32", "device": "cpu", "calibration_file": None,
                           "output_path": None}, Workspace.resolve(tmp_path)) == \
        str(tmp_path / "data" / "calibration" / "tiny-qwen3_float32_cpu.json")
    assert calibration_of({"model": "tiny-qwen3", "dtype": "float32", "device": "cpu", "calibration_file": "c.json"},
                          Workspace.resolve(tmp_path)) == "c.json"


def _read_strictly(path: Path, nbformat):
    """``path`` read and validated with every warning an error (nbformat's MissingIDFieldWarning among
    them: a cell without an id, which nbformat 4.5 requires and papermill's runs used to print)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        nb = nbformat.read(path, as_version=4)
        nbformat.validate(nb)
    return nb


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_committed_notebook_cells_have_ids(name, nbformat):
    raw = json.loads(notebook_path(name).read_text(encoding="utf-8"))
    assert (raw["nbformat"], raw["nbformat_minor"]) >= (4, 5), (name, raw["nbformat"], raw["nbformat_minor"])
    missing = [i for i, cell in enumerate(raw["cells"]) if "id" not in cell]
    assert not missing, f"{name}: cells {missing} have no id; give them one with nbformat.validator.normalize"
    ids = [cell["id"] for cell in raw["cells"]]
    assert len(set(ids)) == len(ids), f"{name}: repeated cell ids {sorted(i for i in ids if ids.count(i) > 1)}"
    _read_strictly(notebook_path(name), nbformat)


def test_executed_copies_have_cell_ids(executed, nbformat):
    _, notebooks = executed
    for path in notebooks:
        raw = json.loads(path.read_text(encoding="utf-8"))
        assert all("id" in cell for cell in raw["cells"]), path
        _read_strictly(path, nbformat)
