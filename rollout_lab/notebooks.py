"""Run the notebooks headlessly with papermill, and the few library calls they need to load models.

    rollout-lab notebooks                                   # tiny CPU default, all three notebooks
    rollout-lab notebooks --device cuda --preset qwen2.5-3b --dtype bfloat16
    rollout-lab notebooks --only 02 --param batch_size=64   # one notebook, one parameter changed

    from rollout_lab.notebooks import run_notebooks
    run_notebooks(device="cuda", preset="qwen2.5-3b", dtype="bfloat16")

Executed copies go to ``build/notebooks/`` (ignored); figures to ``figures/``, tables to
``data/tables/``, calibrations to ``data/calibration/``, sweeps to ``data/results/``. Equivalent
plain papermill command (the kernel is the running interpreter's ``python3``)::

    papermill notebooks/03_latency_tables.ipynb build/notebooks/03_latency_tables.ipynb \
        -k python3 -p device cuda -p model qwen2.5-3b -p dtype bfloat16 -p paths None -p interactive False
"""
from __future__ import annotations

import argparse
import ast
import os
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Mapping, Sequence

from rollout_lab import paths

NOTEBOOKS = ("01_calibrate", "02_bucket_choices", "03_latency_tables", "04_beyond")
OUR_PATHS = ["nocb", "equal_width", "aligned", "bucketed", "auto"]
# Parameters for the test suite: seconds per notebook on CPU.
SMOKE_PARAMETERS: dict[str, dict[str, Any]] = {
    "01_calibrate": {"grid": {"batches": [1, 4], "widths": [8, 32], "repeats": 1, "decode_batches": [2],
                              "decode_width": 8, "decode_steps": 2, "decode_repeats": 1}},
    "02_bucket_choices": {
        "batch_size": 16, "seeds": [0, 1], "max_num_buckets": 6,
        "distributions": [
            {"kind": "seed", "name": "long_tail"},
            {"kind": "lognormal", "median": 60, "sigma": 0.6, "max_len": 512},
            {"kind": "bimodal", "short_median": 20, "long_median": 300, "long_share": 0.2},
            {"kind": "real", "dataset": "gsm8k"},
        ],
        "fixed_costs_ms": [0.1, 10, 1000], "route_max_lengths": [16, 128, 1024], "route_budgets": [1, 16, 256],
    },
    "03_latency_tables": {"workloads": ["long_tail", "spread"], "workload_scale": 0.05, "repetitions": 1,
                          "max_new_tokens": 3},
    "04_beyond": {"eos_budgets": [32], "scripted_budgets": [64, 1024], "scripted_rounds": 20, "online_calls": 6,
                  "repetitions": 1},
}


# ---------------------------------------------------------------- what the notebooks call

def load_model(model: str, *, dtype: str = "float32", device: str = "cpu") -> tuple[Any, str]:
    """(model, name) for ``model`` = "tiny-<family>", a preset name, or a local checkpoint folder."""
    import torch

    from rollout_lab import models

    if not hasattr(torch, dtype) or not isinstance(getattr(torch, dtype), torch.dtype):
        raise ValueError(f"dtype must name a torch dtype such as float32 or bfloat16, got {dtype!r}")
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but CUDA is not available here; use device='cpu'")
    torch_dtype = getattr(torch, dtype)
    if model.startswith("tiny-"):
        return models.tiny_model(model[len("tiny-"):], dtype=torch_dtype).to(device), model
    if model in models.PRESETS:
        return models.from_preset(model, dtype=torch_dtype, device=device), model
    if os.path.isdir(model):
        return models.load_pretrained(model, dtype=torch_dtype, device=device), Path(model).name
    raise ValueError(
        f"model must be 'tiny-<family>' ({', '.join(models.TINY_FAMILIES)}), a preset "
        f"({', '.join(sorted(models.PRESETS))}) or a checkpoint folder; got {model!r}"
    )


def calibration_grid(grid: str | Mapping[str, Any]) -> Any:
    """"tiny", "default", or a dict of ``CalibrationGrid`` fields over the tiny grid (lists allowed)."""
    from rollout_lab.calibrate import CalibrationGrid

    if grid == "tiny":
        return CalibrationGrid.tiny()
    if grid == "default":
        return CalibrationGrid()
    if not isinstance(grid, Mapping):
        raise ValueError(f"grid must be 'tiny', 'default' or a dict of CalibrationGrid fields, got {grid!r}")
    fields = {k: tuple(v) if isinstance(v, (list, tuple)) else v for k, v in grid.items()}
    return replace(CalibrationGrid.tiny(), **fields)


def calibration_path(name: str, dtype: str, device: str, output_dir: str | Path | None) -> Path:
    """``data/calibration/<name>_<dtype>_<device>.json``, or under ``output_dir/calibration``."""
    stem = f"{name}_{dtype}_{str(device).split(':')[0]}.json"
    return (paths.CALIBRATION if output_dir is None else Path(output_dir) / "calibration") / stem


def calibrate_or_load(
    *, calibration_file: str | None, model: str, dtype: str, device: str, grid: Any,
    output_path: str | None, output_dir: str | Path | None, progress: bool = False,
) -> tuple[Any, Path]:
    """Render a saved calibration (``calibration_file``), or measure one and save it: (result, path)."""
    from rollout_lab.calibrate import CalibrationResult, calibrate

    if calibration_file is not None:
        path = Path(calibration_file)
        if not path.is_file():
            raise ValueError(f"calibration_file {str(path)!r} does not exist")
        return CalibrationResult.load(path), path
    net, name = load_model(model, dtype=dtype, device=device)
    result = calibrate(net, grid=calibration_grid(grid), model_name=name, progress=progress)
    path = Path(output_path) if output_path else calibration_path(name, dtype, device, output_dir)
    result.save(path)
    return result, path


def sweep_or_load(
    *, results_file: str | None, model: str, dtype: str, device: str, workloads: Sequence[str],
    workload_scale: float, paths_: Sequence[str] | None, repetitions: int, max_new_tokens: int,
    cost_file: str | None, override_costs: bool, results_stem: str | None,
    output_dir: str | Path | None, progress: bool = False,
) -> tuple[dict[str, Any], Path]:
    """Render a saved sweep (``results_file``), or run one and write JSON + CSV: (record, json path)."""
    from rollout_lab import bench

    if results_file is not None:
        return bench.load_results(results_file), Path(results_file)
    net, name = load_model(model, dtype=dtype, device=device)
    costs = None
    if cost_file is not None:
        from rollout_lab.calibrate import load_calibration

        costs = load_calibration(cost_file, model=net, model_name=name, override=override_costs)
    if results_stem is None:
        base = paths.RESULTS if output_dir is None else Path(output_dir) / "results"
        results_stem = str(base / f"sweep_{name}_{dtype}_{str(device).split(':')[0]}")
    record = bench.run_sweep(
        net, workloads=list(workloads), paths=paths_, repetitions=repetitions, max_new_tokens=max_new_tokens,
        costs=costs, model_name=name, progress=progress, workload_scale=workload_scale,
        costs_source=cost_file or "engine defaults",
    )
    json_path, _ = bench.write_results(record, results_stem)
    return record, json_path


def e2e_table(record: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The reference's table: one row per workload, E2E ms per path, Auto's route and Auto/best."""
    from rollout_lab.bench import results_table, summary_table

    rows = results_table(record)
    summary = {r["workload"]: r for r in summary_table(record)}
    out = []
    for name, w in record["workloads"].items():
        row: dict[str, Any] = {"workload": name, "num_requests": w["num_requests"],
                               "padding_share": round(w["padding_share"], 3)}
        for r in rows:
            if r["workload"] == name:
                row[f"{r['path']}_ms"] = r["mean_ms"]
        s = summary[name]
        row.update({"auto_route": s["auto_route"], "best_manual_path": s["best_manual_path"],
                    "auto_vs_best": s["auto_vs_best"], "auto_over_best_peer": s["auto_over_best_peer"]})
        out.append(row)
    return out


# ---------------------------------------------------------------- running them

def notebook_parameters(
    name: str, *, device: str = "cpu", preset: str | None = None, dtype: str | None = None,
    output_dir: str | Path | None = None, extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The papermill parameters of one notebook: only those the notebook declares are passed."""
    params: dict[str, Any] = {"interactive": False, "device": device}
    if preset is not None:
        params["model"] = preset
        params["geometry_preset"] = preset
        params["paths"] = None  # real models: every path, HF peers included
        params["workload_scale"] = 1.0
        params["grid"] = "default"
        params["dtype"] = dtype or "bfloat16"
    elif dtype is not None:
        params["dtype"] = dtype
    if output_dir is not None:
        params["output_dir"] = str(output_dir)
    params.update(extra or {})
    return params


def run_notebooks(
    *, names: Sequence[str] | None = None, device: str = "cpu", preset: str | None = None,
    dtype: str | None = None, out_dir: str | Path = paths.BUILD / "notebooks",
    output_dir: str | Path | None = None, extra: Mapping[str, Mapping[str, Any]] | None = None,
    kernel_name: str = "python3", progress: bool = True,
) -> list[Path]:
    """Execute each notebook with papermill into ``out_dir``; returns the executed copies.

    ``extra`` maps a notebook name (or "*") to parameters that override the defaults. A
    parameter the notebook does not declare is dropped. ``output_dir`` redirects figures, tables
    and records (the tests' tmp folder).
    """
    import papermill as pm

    names = list(NOTEBOOKS if names is None else names)
    unknown = [n for n in names if n not in NOTEBOOKS]
    if unknown:
        raise ValueError(f"unknown notebooks {unknown}; expected some of {list(NOTEBOOKS)}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    extra = dict(extra or {})
    executed = []
    for name in names:
        source = paths.NOTEBOOKS / f"{name}.ipynb"
        declared = {p for p in pm.inspect_notebook(str(source))}
        more = {**extra.get("*", {}), **extra.get(name, {})}
        wanted = notebook_parameters(name, device=device, preset=preset, dtype=dtype,
                                     output_dir=output_dir, extra=more)
        bad = sorted(set(more) - declared)
        if bad:
            raise ValueError(f"{name} has no parameters {bad}; it declares {sorted(declared)}")
        params = {k: v for k, v in wanted.items() if k in declared}
        target = out_dir / f"{name}.ipynb"
        start = time.perf_counter()
        if progress:
            print(f"== {name}: {params}", flush=True)
        pm.execute_notebook(str(source), str(target), parameters=params, kernel_name=kernel_name,
                            cwd=str(paths.NOTEBOOKS), progress_bar=False, log_output=False)
        if progress:
            print(f"   {target} in {time.perf_counter() - start:.1f} s", flush=True)
        executed.append(target)
    return executed


def _parse_param(text: str) -> tuple[str, str, Any]:
    """"[NB:]name=value" with a Python literal value (strings may be bare)."""
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"--param needs name=value, got {text!r}")
    key, raw = text.split("=", 1)
    notebook, _, name = key.rpartition(":")
    try:
        value = ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        value = raw
    return notebook or "*", name, value


def cmd_notebooks(args: argparse.Namespace) -> int:
    extra: dict[str, dict[str, Any]] = {}
    for notebook, name, value in args.param or []:
        key = notebook if notebook == "*" else next((n for n in NOTEBOOKS if n.startswith(notebook)), notebook)
        extra.setdefault(key, {})[name] = value
    names = None if not args.only else [next((n for n in NOTEBOOKS if n.startswith(o)), o) for o in args.only]
    try:
        run_notebooks(names=names, device=args.device, preset=args.preset, dtype=args.dtype,
                      out_dir=args.out_dir, output_dir=args.output_dir, extra=extra, kernel_name=args.kernel)
    except ValueError as err:
        raise SystemExit(f"error: {err}") from None
    return 0


def register_cli(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "notebooks", help="execute the notebooks headlessly with papermill (tiny CPU default)",
        description="Run notebooks/NN_*.ipynb with papermill; executed copies go to build/notebooks.",
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N] for 01 and 03")
    parser.add_argument("--preset", default=None,
                        help="a preset model (e.g. qwen2.5-3b): full grid, unscaled workloads, HF peers included")
    parser.add_argument("--dtype", default=None, help="model dtype (default float32 tiny, bfloat16 presets)")
    parser.add_argument("--only", nargs="+", help="notebook names or prefixes, e.g. 02")
    parser.add_argument("--param", action="append", type=_parse_param, metavar="[NB:]NAME=VALUE",
                        help="override a parameter (Python literal), e.g. 02:batch_size=64; repeatable")
    parser.add_argument("--out-dir", default=str(paths.BUILD / "notebooks"), help="executed copies go here")
    parser.add_argument("--output-dir", default=None,
                        help="write figures/tables/records under this folder instead of figures/ and data/")
    parser.add_argument("--kernel", default="python3", help=f"Jupyter kernel (default python3 = {sys.executable})")
    parser.set_defaults(func=cmd_notebooks)
