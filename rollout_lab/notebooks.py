"""The papermill runner of the notebooks: ``notebooks/NN_topic.ipynb`` at the top of the checkout, what
JupyterLab opens and what the runner executes there; the wheel ships that folder as the data-only package
``rollout_lab._notebooks`` (pyproject.toml maps the package onto the folder), which it executes when installed.

    rollout-lab notebooks                                   # tiny CPU default, all four notebooks
    rollout-lab notebooks --device cuda --preset qwen2.5-3b --dtype bfloat16
    rollout-lab notebooks --only 02 --param batch_size=64   # one notebook, one parameter changed

    from rollout_lab.notebooks import run_notebooks
    run_notebooks(device="cuda", preset="qwen2.5-3b", dtype="bfloat16", out_dir="runs/h200")

Every output goes to the workspace (``rollout_lab.workspace``: ``--out-dir``, else
``$ROLLOUT_LAB_OUT``, else ``./rollout_lab_out``): figures to ``figures/``, tables to
``data/tables/``, calibrations to ``data/calibration/``, sweeps to ``data/results/``, and the
executed copies, with their outputs, to ``build/notebooks/``. Parameters that are paths
(``PATH_PARAMETERS``) are made absolute from the caller's folder before papermill runs, so relative
paths in ``--param`` values mean what they say; a file to read that is missing is an error naming
the parameter. What every parameter of every notebook takes (type, bounds, choices) is
``NOTEBOOK_PARAMETERS``; each value is checked against it before papermill starts. Equivalent plain
papermill command (the kernel is the running interpreter's ``python3``)::

    papermill notebooks/03_latency_tables.ipynb out.ipynb -k python3 \
        -p device cuda -p model qwen2.5-3b -p dtype bfloat16 -p paths None -p output_dir $PWD/rollout_lab_out
"""
from __future__ import annotations

import ast
import math
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from rollout_lab.workspace import Workspace

NOTEBOOKS = ("01_calibrate", "02_bucket_choices", "03_latency_tables", "04_adaptation")
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
                          "max_new_tokens": 3,
                          "rl_shape": {"num_seqs": 4, "min_len": 4, "max_len": 12, "paths": ["ours", "hf_generate_batch"]},
                          "long_tail_shape": {"num_prompts": 16, "dataset": "gsm8k", "max_new_tokens": 128, "hazard": 0.05,
                                              "slots": 4, "paths": ["paged_128", "aligned_128"]},
                          "grpo_shape": {"num_prompts": 2, "num_samples": 2, "max_new_tokens": 3, "scale": 0.05,
                                         "reps": 1},
                          "prefix_sharing_shape": {"num_prompts": 2, "num_samples": 2, "max_new_tokens": 4, "reps": 1,
                                                   "prompt_lengths": [16, 80]},
                          "partial_rollouts_shape": {"num_prompts": 8, "dataset": "gsm8k", "max_new_tokens": 32,
                                                     "hazard": 0.05, "slots": 4, "num_calls": 2, "finish_fraction": 0.75},
                          "trainer_loop_shape": {"num_prompts": 2, "num_samples": 2, "max_new_tokens": 4, "scale": 0.05,
                                                 "iterations": 2, "logprobs_mode": "trainer"},
                          "more_shape": {"workloads": ["short_tail"], "max_new_tokens": 2, "paths": ["bucketed", "auto"]},
                          "fp8_kv_shape": {"num_seqs": 3, "min_len": 4, "max_len": 20, "steps": 5}},
    "04_adaptation": {"eos_budgets": [32], "scripted_budgets": [64, 1024], "scripted_rounds": 20,
                      "online_calls": 6, "repetitions": 1},
}




# -- what every parameter of every notebook takes -------------------------------------------------

MAX_PROMPTS = 65536  # prompts in a batch: the bucket DP over more takes seconds a plan, and the notebooks plan many
MAX_TOKENS = 2**20  # a prompt's or a budget's tokens: past every preset's context (the model's is checked in the notebook)
MAX_ROUNDS = 10_000  # timed repetitions, rounds and calls: hours of a GPU past this
MAX_SEED = 2**63 - 1


@dataclass(frozen=True)
class Parameter:
    """The values one notebook parameter takes, ``what`` in words: an instance of ``types`` (an int
    where a float is taken; never a bool for a number), numbers in [``minimum``, ``maximum``], one of
    ``choices``; with ``items`` a non-empty list (or tuple) of such values; None when ``or_none``.
    ``check``, when given, is the library's own check of a structured value (a ValueError, KeyError or
    TypeError from it says what is wrong), called after the type check."""

    what: str
    types: tuple[type, ...] = ()
    minimum: float | None = None
    maximum: float | None = None
    choices: tuple[Any, ...] | None = None
    items: bool = False
    or_none: bool = False
    check: Callable[[Any], Any] | None = None

    def problem(self, value: Any, *, types_only: bool = False) -> str | None:
        """What is wrong with ``value`` (None: nothing); with ``types_only`` its type alone (None where
        it is not ``or_none``, not a list where ``items``), not its range, choices or ``check``."""
        if value is None:
            return None if self.or_none else "is None"
        if self.items:
            if not isinstance(value, (list, tuple)) or not value:
                return "is not a non-empty list"
            wrong = next(((k, p) for k, p in ((k, self._scalar_problem(v, types_only=types_only))
                                             for k, v in enumerate(value)) if p), None)
            if wrong is not None:
                return f"has item {wrong[0]} {value[wrong[0]]!r}, which {wrong[1]}"
        elif (found := self._scalar_problem(value, types_only=types_only)) is not None:
            return found
        if self.check is not None and not types_only:
            try:
                self.check(value)
            except (ValueError, KeyError, TypeError) as err:
                return f"is not valid ({type(err).__name__ + ': ' if not isinstance(err, ValueError) else ''}{err})"
        return None

    def _scalar_problem(self, value: Any, *, types_only: bool = False) -> str | None:
        types = self.types + ((int,) if float in self.types else ())
        if types and (not isinstance(value, types) or (isinstance(value, bool) and bool not in types)):
            return f"has type {type(value).__name__}"
        if types_only:
            return None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(value) or (self.minimum is not None and value < self.minimum) \
                    or (self.maximum is not None and value > self.maximum):
                return "is out of range"
        if self.choices is not None and value not in self.choices:
            return "is not one of them"
        return None


def _number(kind: type, minimum: float, maximum: float, *, or_none: bool = False, items: bool = False) -> Parameter:
    noun = {int: "int", float: "number"}[kind]
    bounds = f"[{minimum}, {maximum}]" if kind is int else f"[{minimum:g}, {maximum:g}]"
    what = f"{'a non-empty list of ' if items else 'an ' if kind is int else 'a '}{noun}{'s' if items else ''} in {bounds}"
    return Parameter(what + (", or None" if or_none else ""), (kind,), minimum, maximum, items=items, or_none=or_none)


def _choice(choices: Sequence[Any], *, items: bool = False, or_none: bool = False, what: str = "") -> Parameter:
    listed = ", ".join(map(repr, choices))
    what = what or (f"a non-empty list of {listed}" if items else f"one of {listed}")
    return Parameter(what + (", or None" if or_none else ""), (type(choices[0]),), choices=tuple(choices),
                     items=items, or_none=or_none)


def _checked(what: str, check: Callable[[Any], Any], *types: type, or_none: bool = False) -> Parameter:
    return Parameter(what + (", or None" if or_none else ""), types, check=check, or_none=or_none)


FLAG = Parameter("True or False", (bool,))
PATH = Parameter("a path (str), or None", (str,), or_none=True)
PATH_LIST = _checked("a path (str) or a list of paths, or None", lambda v: _all_paths(v), str, list, tuple,
                     or_none=True)
DTYPE = _choice(("float32", "bfloat16", "float16"))
THREADS = _number(int, 1, os.cpu_count() or 1, or_none=True)
COUNT = _number(int, 1, MAX_ROUNDS)
TOKENS = _number(int, 1, MAX_TOKENS)
TOKEN_LISTS = _number(int, 1, MAX_TOKENS, items=True)


def _all_paths(value: Any) -> None:
    """A path, or lists of paths (nested: more_results_file joins the JSONs of one entry)."""
    if isinstance(value, (list, tuple)):
        if not value:
            raise ValueError("an empty list")
        for v in value:
            _all_paths(v)
    elif not isinstance(value, str) or not value:
        raise ValueError(f"{value!r} is not a path")


def _check_mode_records(value: Any) -> None:
    """A non-empty dict of {mode name: trainer-loop record path}, both non-empty strings."""
    if not value:
        raise ValueError("an empty dict")
    for name, path in value.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"mode name {name!r} is not a non-empty str")
        if not isinstance(path, str) or not path:
            raise ValueError(f"mode {name!r}: {path!r} is not a path")


def _check_record_list(value: Any) -> None:
    """A non-empty list of paths (each a non-empty str), not nested."""
    if not value:
        raise ValueError("an empty list")
    for path in value:
        if not isinstance(path, str) or not path:
            raise ValueError(f"{path!r} is not a path")


def _check_device(device: str) -> None:
    """cpu, or cuda[:N] where this machine has that GPU."""
    kind, _, index = device.partition(":")
    if kind not in ("cpu", "cuda") or (index and (kind == "cpu" or not index.isdigit())):
        raise ValueError("expected cpu or cuda[:N]")
    if kind == "cuda":
        import torch  # only to ask for the GPU: the notebook would find it missing after minutes

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError("CUDA is not available here; use device cpu")
        if index and int(index) >= count:
            raise ValueError(f"this machine has {count} CUDA device(s): cuda:0 to cuda:{count - 1}")


def _check_model(model: str) -> None:
    from rollout_lab.measure.models import model_config  # transformers: only when a notebook is run

    model_config(model)


def _check_geometry(preset: str) -> None:
    from rollout_lab.measure.presets import geometry_for

    geometry_for(preset)


def _check_grid(grid: Any) -> None:
    from rollout_lab.measure.calibrate import calibration_grid  # torch: only when a notebook is run

    calibration_grid(grid)


def _check_paths(paths: Sequence[str]) -> None:
    from rollout_lab.measure.paths import check_paths  # torch: only when a notebook is run

    check_paths(paths)


def _check_workloads(names: Sequence[str]) -> None:
    from rollout_lab.measure.sweep import resolve_workloads  # torch: only when a notebook is run

    resolve_workloads(list(names))


def _check_distribution(spec: Any) -> None:
    from rollout_lab.measure.workloads import resolve_distribution

    if not isinstance(spec, Mapping):
        raise ValueError(f"{spec!r} is not a dict")
    resolve_distribution(spec, batch_size=1, seed=0)


def _check_online_workloads(workloads: Mapping[str, Any]) -> None:
    if not workloads:
        raise ValueError("an empty dict")
    for name, lengths in workloads.items():
        if TOKEN_LISTS.problem(lengths) is not None:
            raise ValueError(f"workload {name!r} is not {TOKEN_LISTS.what}")


def _shape(name: str, module: str, defaults: str) -> Parameter:
    """A benchmark's settings as a dict over its defaults: its keys are checked here, its values by
    the benchmark before its model is built."""
    def check(shape: Mapping[str, Any]) -> None:
        import importlib

        from rollout_lab.measure.records import shape_settings

        shape_settings(name, shape, getattr(importlib.import_module(module), defaults))  # torch: when run

    return _checked(f"a dict of {module}.{defaults}'s settings", check, dict, or_none=True)


def _check_more_shape(shape: Mapping[str, Any]) -> None:
    from rollout_lab.measure.sweep import MORE_SHAPE_KEYS  # torch: only when a notebook is run

    unknown = sorted(set(shape) - set(MORE_SHAPE_KEYS))
    missing = [k for k in MORE_SHAPE_KEYS[:2] if k not in shape]
    if unknown or missing:
        raise ValueError(f"unknown settings {unknown}, missing {missing}")


MODEL = _checked("'tiny-<family>', a preset or a checkpoint folder", _check_model, str)
DEVICE = _checked("'cpu' or 'cuda[:N]' (a GPU this machine has)", _check_device, str)
RUNNER = {"interactive": FLAG, "output_dir": PATH}  # every notebook's runner flags
# Every parameter of every notebook (their ``parameters`` cells): what it takes. run_notebooks checks
# each value it passes against this before papermill starts, so a bad one is one line, not a kernel's
# traceback; tests/test_cli.py holds it to the cells and their defaults.
NOTEBOOK_PARAMETERS: dict[str, dict[str, Parameter]] = {
    "01_calibrate": {
        "model": MODEL, "dtype": DTYPE, "device": DEVICE, "threads": THREADS,
        "grid": _checked("'tiny', 'default' or a dict of CalibrationGrid fields", _check_grid, str, dict),
        "calibration_file": PATH, "output_path": PATH, **RUNNER},
    "02_bucket_choices": {
        "cost_file": PATH, "override_costs": FLAG,
        "geometry_preset": _checked("a preset or a checkpoint folder", _check_geometry, str), "kv_dtype": DTYPE,
        "batch_size": _number(int, 1, MAX_PROMPTS), "seeds": _number(int, 0, MAX_SEED, items=True),
        "distributions": Parameter("a non-empty list of distribution dicts (kind: seed, lognormal, bimodal or real; "
                                   "measure.workloads.resolve_distribution)", (dict,), items=True,
                                   check=lambda v: [_check_distribution(d) for d in v]),
        "max_num_buckets": _number(int, 1, 1024), "fixed_costs_ms": _number(float, 0, 1e6, items=True),
        "focus_distribution": Parameter("a distribution's label (str)", (str,)),
        "summary_max_new_tokens": TOKENS, "route_max_lengths": TOKEN_LISTS, "route_budgets": TOKEN_LISTS,
        "crossing_at_classes": FLAG, **RUNNER},
    "03_latency_tables": {
        "model": MODEL, "dtype": DTYPE, "device": DEVICE, "threads": THREADS,
        "workloads": _checked("a non-empty list of workload names (measure.workloads.WORKLOADS)", _check_workloads,
                              list, tuple),
        "workload_scale": _number(float, 1e-3, 64), "paths": _checked(
            "a non-empty list of path names (measure.paths.PATHS)", _check_paths, list, tuple, or_none=True),
        "repetitions": COUNT, "max_new_tokens": TOKENS, "cost_file": PATH, "override_costs": FLAG,
        "results_file": PATH_LIST, "results_stem": PATH, "resume": FLAG, "prefill_classes": FLAG,
        "prefill_graphs": FLAG, "peer_results_file": PATH_LIST, "oracle_max_tokens": _number(int, 0, MAX_TOKENS),
        "rl_shape": _shape("rl_shape", "rollout_lab.measure.rl", "RL_DEFAULTS"), "rl_results_file": PATH_LIST,
        "long_tail_shape": _shape("long_tail_shape", "rollout_lab.measure.long_tail", "LONG_TAIL_DEFAULTS"),
        "long_tail_results_file": PATH,
        "trainer_loop_shape": _shape("trainer_loop_shape", "rollout_lab.measure.trainer_loop",
                                     "TRAINER_LOOP_DEFAULTS"),
        "trainer_loop_results_file": PATH, "decode_step_file": PATH,
        "fp8_kv_shape": _shape("fp8_kv_shape", "rollout_lab.measure.fidelity", "KV_DTYPE_DEFAULTS"),
        "fp8_kv_results_files": PATH_LIST,
        "logprob_modes_results_file": _checked("a dict of {mode name: trainer-loop record path}", _check_mode_records,
                                               dict, or_none=True),
        "grpo_shape": _shape("grpo_shape", "rollout_lab.measure.grpo", "GRPO_DEFAULTS"), "grpo_results_file": PATH,
        "prefix_sharing_shape": _shape("prefix_sharing_shape", "rollout_lab.measure.prefix_sharing",
                                       "PREFIX_SHARING_DEFAULTS"),
        "prefix_sharing_results_file": PATH,
        "partial_rollouts_shape": _shape("partial_rollouts_shape", "rollout_lab.measure.partial_rollouts",
                                         "PARTIAL_ROLLOUT_DEFAULTS"),
        "partial_rollouts_results_file": PATH,
        "prefill_batch_sizes": _number(int, 1, MAX_PROMPTS, items=True, or_none=True), "prefill_routes_file": PATH_LIST,
        "more_results_file": PATH_LIST,
        "more_shape": _checked("a dict of workloads, max_new_tokens and optionally paths, repetitions "
                               "(measure.sweep.MORE_SHAPE_KEYS)", _check_more_shape, dict, or_none=True),
        "more_peer_results_file": PATH_LIST,
        "roofline_results_files": _checked("a non-empty list of bench record paths (rl, grpo, trainer-loop, decode-step, "
                                           "prefix-sharing)", _check_record_list, list, tuple, or_none=True),
        **RUNNER},
    "04_adaptation": {
        "model": MODEL, "dtype": DTYPE, "device": DEVICE, "threads": _number(int, 1, os.cpu_count() or 1),
        "chunk_lengths": TOKEN_LISTS, "chunk_limit": TOKENS, "chunk_new_tokens": TOKENS,
        "eos_lengths": TOKEN_LISTS, "eos_budgets": TOKEN_LISTS, "scripted_lengths": _number(int, 1, MAX_TOKENS, items=True),
        "scripted_budgets": TOKEN_LISTS, "scripted_mean_response": _number(float, 1, MAX_TOKENS),
        "scripted_rounds": COUNT,
        "online_workloads": _checked("a non-empty dict of workload name: list of prompt lengths",
                                     _check_online_workloads, dict),
        "online_calls": COUNT, "online_new_tokens": TOKENS, "online_window": _number(int, 1, MAX_ROUNDS),
        "repetitions": COUNT, **RUNNER},
}


def check_parameter(name: str, parameter: str, value: Any, *, types_only: bool = False) -> None:
    """ValueError naming notebook ``name``, ``parameter``, ``value`` and what it takes
    (``NOTEBOOK_PARAMETERS``), or the notebook's parameters when it has no ``parameter``; with
    ``types_only`` only ``value``'s type is checked (``Parameter.problem``)."""
    if name not in NOTEBOOK_PARAMETERS:
        raise ValueError(f"unknown notebook {name!r}; expected one of {list(NOTEBOOKS)}")
    spec = NOTEBOOK_PARAMETERS[name].get(parameter)
    if spec is None:
        raise ValueError(f"{name} has no parameter {parameter!r} (given {parameter}={value!r}); its parameters: "
                         f"{', '.join(sorted(NOTEBOOK_PARAMETERS[name]))}")
    problem = spec.problem(value, types_only=types_only)
    if problem is not None:
        raise ValueError(f"{name}: parameter {parameter}={value!r} {problem}; {parameter} takes {spec.what}")


def notebook_parameters(
    name: str, *, device: str = "cpu", preset: str | None = None, dtype: str | None = None,
    output_dir: str | Path, extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The papermill parameters of one notebook: only those the notebook declares are passed."""
    params: dict[str, Any] = {"interactive": False, "device": device, "output_dir": str(output_dir)}
    if preset is not None:
        params["model"] = preset
        params["geometry_preset"] = preset
        params["paths"] = None  # real models: every path, HF peers included
        params["workload_scale"] = 1.0
        params["grid"] = "default"
        params["dtype"] = dtype or "bfloat16"
        params["kv_dtype"] = params["dtype"]  # 02's geometry stores the KV in the model's dtype
        if str(device).startswith("cuda"):  # the engine as the README's H200 records run it
            import dataclasses  # torch below: only for a GPU run

            from rollout_lab.measure.calibrate import CalibrationGrid
            from rollout_lab.measure.rl import NANO_VLLM_MODEL, NANO_VLLM_SHAPE
            from rollout_lab.measure.paths import PATHS
            grid = dataclasses.replace(CalibrationGrid(), prefill_graphs=True, repeats=3)  # 01: as the compiled graphs run
            params["grid"] = {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(grid).items()}
            params["prefill_graphs"] = True  # 03: captured prefill at the workloads' class ladder
            params["crossing_at_classes"] = True  # 02: buckets priced at that ladder
            # HF's static + compile peer breaks later captures in its process: 03 joins its own-process
            # sweep through peer_results_file (scripts/gpu/notebooks.sh runs it first)
            params["paths"] = [p for p in PATHS if p != "hf_static"]
            if preset == NANO_VLLM_MODEL:  # 03 also measures nano-vllm's RL shape, on its own model
                params["rl_shape"] = {**NANO_VLLM_SHAPE, "paths": ["ours", "hf_generate_batch"]}
    elif dtype is not None:
        params["dtype"] = dtype
    params.update(extra or {})
    return params


# the parameters that name files or folders: those read (a path, a list of paths, or a dict of them), and
# those written
INPUT_PARAMETERS = ("calibration_file", "cost_file", "results_file", "rl_results_file", "long_tail_results_file",
                    "trainer_loop_results_file", "logprob_modes_results_file", "decode_step_file", "fp8_kv_results_files",
                    "prefill_routes_file", "grpo_results_file", "prefix_sharing_results_file", "partial_rollouts_results_file",
                    "peer_results_file",
                    "more_results_file", "more_peer_results_file", "roofline_results_files")
PATH_PARAMETERS = INPUT_PARAMETERS + ("output_path", "results_stem", "output_dir")
# the input parameters whose files check_inputs also reads: the record kind each must hold (render-only
# sections, whose records come from the GPU: a wrong file is found before the notebook's measurements run)
INPUT_KINDS = {"logprob_modes_results_file": "trainer_loop"}


def resolve_path_parameters(params: Mapping[str, Any], *, cwd: str | Path) -> dict[str, Any]:
    """``params`` with every path (``PATH_PARAMETERS``, a path, a list or a dict of paths; and ``model`` or
    ``geometry_preset`` when they name an existing checkpoint folder) made absolute from ``cwd``."""
    cwd = Path(cwd)

    def absolute(value: Any) -> Any:
        if isinstance(value, Mapping):
            return {k: absolute(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [absolute(v) for v in value]
        return str((cwd / Path(value).expanduser()).resolve()) if isinstance(value, (str, os.PathLike)) else value

    out = dict(params)
    for name, value in params.items():
        if name in PATH_PARAMETERS:
            out[name] = absolute(value)
        elif name in ("model", "geometry_preset") and isinstance(value, str) and (cwd / value).is_dir():
            out[name] = absolute(value)
    return out


def check_inputs(name: str, params: Mapping[str, Any]) -> None:
    """ValueError naming the parameter of notebook ``name`` whose file to read does not exist, or,
    for a parameter of ``INPUT_KINDS``, is not a record of its kind."""
    def paths(value: Any) -> list[Any]:  # a path, or lists of paths (more_results_file nests them), or a dict's
        if isinstance(value, Mapping):
            value = list(value.values())
        return [p for v in value for p in paths(v)] if isinstance(value, (list, tuple)) else [value]

    for parameter in INPUT_PARAMETERS:
        for path in paths(params.get(parameter)):
            if path is not None and not Path(path).is_file():
                raise ValueError(f"{name}: {parameter}={str(path)!r} does not exist (or is not a file)")
            if path is not None and parameter in INPUT_KINDS:
                from rollout_lab.measure.records import read_record  # the record's reader: only when a notebook is run

                try:
                    read_record(Path(path), INPUT_KINDS[parameter])
                except ValueError as err:
                    raise ValueError(f"{name}: {parameter}: {err}") from None
            if path is not None and parameter == "roofline_results_files":  # several kinds: the section's reader
                from rollout_lab.measure.roofline import read_roofline_record  # torch: only when a notebook is run

                try:
                    read_roofline_record(path)
                except ValueError as err:
                    raise ValueError(f"{name}: {parameter}: {err}") from None


def check_kernel(kernel_name: str) -> None:
    """ValueError naming ``kernel_name`` and the installed Jupyter kernels when it is not one of them."""
    from jupyter_client.kernelspec import KernelSpecManager  # installed with papermill: the [notebooks] extra

    installed = sorted(KernelSpecManager().find_kernel_specs())
    if kernel_name not in installed:
        raise ValueError(f"no Jupyter kernel named {kernel_name!r}; installed kernels: {', '.join(installed) or 'none'}")


def check_parameter_type(name: str, parameter: str, value: Any) -> None:
    """ValueError naming notebook ``name``, ``parameter``, ``value`` and what it takes when ``value``
    is not of a type ``NOTEBOOK_PARAMETERS`` gives the parameter (an int where a float is; never a
    bool for a number); its range is ``check_parameter``'s, which ``run_notebooks`` makes."""
    check_parameter(name, parameter, value, types_only=True)


def calibration_of(params: Mapping[str, Any], workspace: Workspace) -> str:
    """The cost file notebook 01 renders or writes with ``params``: its ``calibration_file``, else its
    ``output_path``, else the workspace's calibration of its model (``measure.calibrate.calibration_path``)."""
    from rollout_lab.measure.calibrate import calibration_path  # torch: only when 01 and 03 run together
    from rollout_lab.measure.models import model_config

    for given in ("calibration_file", "output_path"):
        if params.get(given):
            return str(params[given])
    _, name = model_config(params["model"])
    return str(calibration_path(name, params["dtype"], params["device"], workspace))


def run_notebooks(
    *, names: Sequence[str] | None = None, device: str = "cpu", preset: str | None = None,
    dtype: str | None = None, out_dir: str | Path | None = None,
    extra: Mapping[str, Mapping[str, Any]] | None = None, kernel_name: str = "python3", progress: bool = True,
) -> list[Path]:
    """Execute each notebook with papermill; returns the executed copies (``<out_dir>/build/notebooks``).

    ``out_dir`` is the workspace every output goes to (see the module docstring). ``extra`` maps a
    notebook name (or "*") to parameters that override the defaults; a parameter the notebook does
    not declare is an error, and so is a value outside its range (``NOTEBOOK_PARAMETERS``: ``device``
    cuda on a machine without one too), raised before papermill starts. A ValueError or TypeError a
    notebook raises is one ValueError naming it, the cell and the executed copy. When 01 and 03 run together, 03 prices Auto with 01's calibration
    (``calibration_of``) unless ``extra`` gives 03 a ``cost_file``.
    """
    names = list(NOTEBOOKS if names is None else names)
    unknown = [n for n in names if n not in NOTEBOOKS]
    if unknown:
        raise ValueError(f"unknown notebooks {unknown}; expected some of {list(NOTEBOOKS)}")
    extra = dict(extra or {})
    unknown = sorted(set(extra) - {"*", *NOTEBOOKS})
    if unknown:
        raise ValueError(f"parameters given for unknown notebooks {unknown}; expected some of {list(NOTEBOOKS)}")
    workspace = Workspace.resolve(out_dir)
    planned = []  # (name, the parameters given, every value it would get): checked before papermill starts
    for name in names:
        more = {**extra.get("*", {}), **extra.get(name, {})}
        wanted = notebook_parameters(name, device=device, preset=preset, dtype=dtype,
                                     output_dir=workspace.root, extra=more)
        for parameter, value in wanted.items():
            if parameter in more or parameter in NOTEBOOK_PARAMETERS[name]:
                check_parameter(name, parameter, value)
        planned.append((name, more, wanted))
    try:
        import papermill as pm  # optional: the [notebooks] extra
        from papermill.exceptions import PapermillExecutionError
        from traitlets.config import Config  # installed with papermill (jupyter_client)
    except ModuleNotFoundError as err:
        raise ModuleNotFoundError(f"{err.name} is not installed: pip install 'rollout_lab[notebooks]'",
                                  name=err.name) from None
    check_kernel(kernel_name)
    runs = []  # every notebook's parameters are checked before the first one runs
    calibrated = None  # 01's parameters, when it runs
    for name, more, wanted in planned:
        source = notebook_path(name)
        declared = pm.inspect_notebook(str(source))  # name -> its default (source text) and help
        bad = sorted(set(more) - set(declared))
        if bad:
            raise ValueError(f"{name} has no parameters {bad}; it declares {sorted(declared)}")
        params = resolve_path_parameters({k: v for k, v in wanted.items() if k in declared}, cwd=os.getcwd())
        if name == "01_calibrate":  # what it runs with: its own defaults (literals) where nothing is passed
            calibrated = {**{k: ast.literal_eval(v["default"]) for k, v in declared.items()}, **params}
        if name == "03_latency_tables" and "cost_file" not in more and calibrated is not None:
            params["cost_file"] = calibration_of(calibrated, workspace)  # 03 prices Auto with 01's calibration
        runs.append((name, source, params))
    executed_dir = workspace.executed_notebooks
    executed_dir.mkdir(parents=True, exist_ok=True)
    # The kernel talks to us over IPC sockets in a private folder, not TCP: ipykernel warns on every
    # start that TCP is unencrypted (and any local user could reach the port)
    kernel_config = Config()
    kernel_config.KernelManager.transport = "ipc"
    executed = []
    for name, source, params in runs:
        check_inputs(name, params)  # here: 03's cost_file may be the one 01 has just written
        target = executed_dir / f"{name}.ipynb"
        start = time.perf_counter()
        if progress:
            print(f"== {name}: {params}", flush=True)
        with tempfile.TemporaryDirectory(prefix="rollout-lab-kernel-") as sockets:
            kernel_config.KernelManager.ip = os.path.join(sockets, "kernel")
            try:
                pm.execute_notebook(str(source), str(target), parameters=params, kernel_name=kernel_name,
                                    cwd=os.getcwd(), progress_bar=False, log_output=False, config=kernel_config)
            except PapermillExecutionError as err:  # a user error the library found in the kernel: one line
                if err.ename not in ("ValueError", "TypeError"):
                    raise
                raise ValueError(f"{name} stopped in cell {err.exec_count}: {err.ename}: {err.evalue} "
                                 f"(the executed copy {target} holds the traceback)") from None
        if progress:
            print(f"   {target} in {time.perf_counter() - start:.1f} s", flush=True)
        executed.append(target)
    return executed


def notebooks_folder() -> Path:
    """Where the notebooks are: ``_notebooks/`` in the package when it is an installed wheel, else the
    top-level ``notebooks/`` of the checkout the package is imported from (an editable install, or the
    checkout on PYTHONPATH as scripts/gpu runs it). Found beside this file, not imported as
    ``rollout_lab._notebooks``: setuptools' editable install cannot import a folder without
    ``__init__.py`` mapped outside its parent package (pypa/setuptools#4943), and PYTHONPATH maps nothing."""
    package = Path(__file__).resolve().parent
    shipped = package / "_notebooks"
    return shipped if shipped.is_dir() else package.parent / "notebooks"


def notebook_path(name: str) -> Path:
    """``<name>.ipynb`` in ``notebooks_folder()``; FileNotFoundError naming the path when it is missing."""
    if name not in NOTEBOOKS:
        raise ValueError(f"unknown notebook {name!r}; expected one of {list(NOTEBOOKS)}")
    path = notebooks_folder() / f"{name}.ipynb"
    if not path.is_file():
        raise FileNotFoundError(f"notebook {name!r} is missing: {path} (a checkout keeps it in notebooks/, "
                                "a wheel in rollout_lab/_notebooks/)")
    return path
