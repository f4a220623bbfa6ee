"""Which cost coefficients a rollout plans with, and where they came from: the user's, a cost file's
(checked against the model), or for ``costs="auto"`` the cost cache's for this setting, else a prior.

    resolved = resolve_costs(config.costs, model, captures_prefill=True, decode_mode="graph", override=False)
    resolved.costs, resolved.source

"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from rollout_lab.engine.model_info import model_metadata, model_name_of
from rollout_lab.engine.runner.disk_cache import cached_cost_file
from rollout_lab.planner.cost import CostCoefficients, CostFile


# What costs="auto" prices a CUDA rollout's first calls with before anything is measured or cached
# for its setting (engine.runner.disk_cache). The reference prices CB decode 10 ms a step over HF's own loop
# (nocb), true of DeepSpeed's CB and false of ours: a captured, compiled step is the faster one
# (data/calibration/qwen2.5-3b_bfloat16_cuda_notebook-01.json: its two decode terms). Under the
# reference's gap Auto would send short batches to nocb and never measure CB. The prior reverses the gap;
# the first calls' timed forwards then replace it (planner.fit.OnlineCalibrator: nocb stays priced
# at CB's measured step plus this gap until nocb itself is measured).
CAPTURED_DECODE_GAP_MS = 10.0


def captured_decode_prior() -> CostCoefficients:
    """The reference's prefill coefficients, with CB decode ``CAPTURED_DECODE_GAP_MS`` a step
    cheaper than nocb's: the starting point of ``costs="auto"`` on CUDA with a captured decode."""
    return dataclasses.replace(CostCoefficients(), continuous_decode_cost_ms=0.0,
                               nocb_decode_cost_ms=CAPTURED_DECODE_GAP_MS)


def with_unmeasured_decode(costs: CostCoefficients, metadata: Mapping[str, Any],
                           decode_mode: str) -> tuple[CostCoefficients, str]:
    """A cost file's coefficients for a Rollout decoding in ``decode_mode``, and what was changed
    ("" when nothing). A calibration whose grid ran no decode probe (``decode_batches`` empty)
    wrote both decode terms as 0, as if CB decode cost what nocb's (HF's eager loop) does; with a
    captured step that sends short batches to nocb at several times the cost
    (data/results/archive/defaults_qwen2.5-3b_bfloat16_cuda.json: short_similar, tuned against
    default). There the captured prior's decode terms replace them.
    A file without a grid is taken as it is."""
    grid = metadata.get("grid")
    if decode_mode != "graph" or not isinstance(grid, Mapping) or grid.get("decode_batches", None) != []:
        return costs, ""
    prior = captured_decode_prior()
    return (dataclasses.replace(costs, continuous_decode_cost_ms=prior.continuous_decode_cost_ms,
                                nocb_decode_cost_ms=prior.nocb_decode_cost_ms),
            "; its calibration measured no decode: CB decode priced below nocb's (captured step)")


@dataclass(frozen=True)
class ResolvedCosts:
    """A rollout's starting coefficients; ``source`` says where they came from, ``cache_metadata`` is
    the cost cache's key for this setting (``costs="auto"`` on CUDA: the online refit is saved there),
    ``refitted`` whether they are an earlier process's online refit."""

    costs: CostCoefficients
    source: str
    cache_metadata: dict | None = None
    refitted: bool = False


def resolve_costs(costs: CostCoefficients | CostFile | str, model: torch.nn.Module, *, captures_prefill: bool,
                  decode_mode: str, override: bool) -> ResolvedCosts:
    """The coefficients for ``RolloutConfig.costs``: the user's as given; a cost file's once its
    provenance matches this model, its name included as the CLI checks it (``model_name_of``: the
    checkpoint's folder name, else family and size; ``CostFile.check`` names every field that
    differs, ``override`` accepts a mismatch); for "auto" on CUDA the cost cache's file for this
    setting, else the captured-decode prior (``captured_decode_prior``), elsewhere the reference's."""
    device = next(model.parameters()).device
    if isinstance(costs, CostCoefficients):
        return ResolvedCosts(costs, "the user's coefficients")
    if isinstance(costs, CostFile):
        checked = costs.check(model_metadata(model, model_name=model_name_of(model), prefill_graphs=captures_prefill),
                              override=override)
        checked, note = with_unmeasured_decode(checked, costs.metadata, decode_mode)
        return ResolvedCosts(checked, f"cost file {str(costs.path)!r}" + note)
    metadata = model_metadata(model, prefill_graphs=captures_prefill) if device.type == "cuda" else None
    found = cached_cost_file(metadata) if metadata is not None else None
    if found is not None:
        return ResolvedCosts(found.costs, f"cached cost file {str(found.path)!r}", metadata, refitted=True)
    if metadata is not None and decode_mode == "graph":
        return ResolvedCosts(captured_decode_prior(), "the reference's prefill coefficients, CB decode priced "
                             "below nocb's (captured step), refined online (cost cache: nothing for this setting yet)",
                             metadata)
    source = "the reference's coefficients"
    if metadata is not None:
        source += ", refined online (cost cache: nothing for this setting yet)"
    return ResolvedCosts(CostCoefficients(), source, metadata)
