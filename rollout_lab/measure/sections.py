"""A notebook section's record: measured on a model into the workspace, or read from a saved file.

Each of notebook 03's measured sections takes ``<name>_shape`` (the run's settings: measure now) or
``<name>_results_file`` (a saved record: render it), never both. ``measure_or_load`` makes that
choice once for every section: both given, bad settings, a saved file of another kind and a record
already in the way are each a ValueError raised before the model is built; a measured record is
written after every part the run reports (``save``), and the model is let go of afterwards, so the
notebook's next section starts with the device's memory free.

    name, record = measure_or_load("long_tail", shape=long_tail_shape, results_file=long_tail_results_file,
                                   kind="eos_long_tail", defaults=LONG_TAIL_DEFAULTS, check=..., run=...,
                                   rows=long_tail_rows, model=model, dtype=dtype, device=device)

"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from rollout_lab.engine.limits import ModelLimits
from rollout_lab.measure.models import load_model, model_config
from rollout_lab.measure.paths import release_memory
from rollout_lab.measure.records import load_record, shape_settings
from rollout_lab.workspace import Workspace, record_paths, run_tag, write_record

# check(settings, limits): a ValueError for settings this model cannot run
Check = Callable[[dict[str, Any], ModelLimits], None]
# run(model, model_name, settings, save, script) -> the record; save(record) writes it (after every part)
Run = Callable[[torch.nn.Module, str, dict[str, Any], Callable[[dict[str, Any]], None], str], dict[str, Any]]


def measure_or_load(
    name: str, *, shape: Mapping[str, Any] | None, results_file: str | Path | None, kind: str,
    defaults: Mapping[str, Any], check: Check, run: Run, rows: Callable[[dict[str, Any]], list],
    model: str, dtype: str, device: str, output_dir: Any = None,
) -> tuple[str, dict[str, Any]] | None:
    """(file name, record) of section ``name``: ``shape`` (``defaults`` where it says nothing) checked,
    then measured on ``model`` into ``<workspace>/data/results/<name>_<model>_<dtype>_<device>``; else
    the saved record ``results_file`` of ``kind``; else None."""
    if shape is not None and results_file is not None:
        raise ValueError(f"give {name}_shape (measure) or {name}_results_file (render), not both")
    if shape is None:
        return None if results_file is None else (str(results_file), load_record(Path(results_file), kind))
    settings = shape_settings(f"{name}_shape", shape, defaults)
    config, model_name = model_config(model)
    check(settings, ModelLimits.of_config(config, dtype=dtype, device=device))
    out = record_paths(Workspace.resolve(output_dir).results / f"{name}_{run_tag(model_name, dtype, device)}")
    net, model_name = load_model(model, dtype=dtype, device=device)
    try:
        record = run(net, model_name, settings, lambda r: write_record(out, r, rows(r)),
                     f"notebook 03 ({name}_shape)")
    finally:
        del net
        release_memory(torch.device(device))
    return str(out[0]), record
