"""Prompt-length distributions the planner is studied on: specs resolved to lengths, per seed.

A spec is a small dict (the ``distributions`` parameter of ``notebooks/02_bucket_choices.ipynb``):
a seed workload, a lognormal or bimodal draw, or a sample of a real dataset's lengths. Torch-free
and pure (the real ones read the CSVs of ``rollout_lab.workloads``)::

    from rollout_lab.distributions import resolve_distribution, resolve_distributions
    label, lengths = resolve_distribution({"kind": "real", "dataset": "gsm8k"}, batch_size=32, seed=0)
    dists = resolve_distributions([{"kind": "seed", "name": "long_tail"}], batch_size=32, seeds=[0, 1])
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from rollout_lab.workloads import bimodal_lengths, get_workload, lognormal_lengths, sample_lengths

SEED_FIVE = ("short_similar", "long_tail", "short_tail", "moderate_tail", "spread")
DISTRIBUTION_KINDS = ("seed", "lognormal", "bimodal", "real")


def resolve_distribution(spec: Mapping[str, Any], *, batch_size: int, seed: int) -> tuple[str, list[int]]:
    """(label, lengths) of one distribution spec; the notebook's ``distributions`` are a list of these.

    {"kind": "seed", "name": "long_tail"}                      fixed lengths (batch and seed ignored)
    {"kind": "lognormal", "median": 120, "sigma": 0.6, "max_len": 2048}
    {"kind": "bimodal", "short_median": 40, "long_median": 600, "long_share": 0.1, "sigma": 0.1}
    {"kind": "real", "dataset": "gsm8k"}                       ``batch_size`` draws from the CSV
    An optional "label" overrides the default label.
    """
    kind = spec.get("kind")
    params = {k: v for k, v in spec.items() if k not in ("kind", "label")}
    if kind == "seed":
        name = params.get("name")
        if name is None:
            raise ValueError(f"seed distribution needs a 'name', got {dict(spec)}")
        return spec.get("label", name), get_workload(name, scale=float(params.get("scale", 1.0)))
    if kind == "lognormal":
        lengths = lognormal_lengths(batch_size, float(params["median"]), float(params["sigma"]), seed,
                                    int(params.get("max_len", 4096)))
        label = f"lognormal(med {params['median']:g}, σ {params['sigma']:g})"
        return spec.get("label", label), lengths
    if kind == "bimodal":
        lengths = bimodal_lengths(
            batch_size, float(params["short_median"]), float(params["long_median"]),
            long_share=float(params["long_share"]), sigma=float(params.get("sigma", 0.1)), seed=seed,
            max_len=int(params.get("max_len", 4096)),
        )
        label = f"bimodal({params['short_median']:g}/{params['long_median']:g}, {params['long_share']:g} long)"
        return spec.get("label", label), lengths
    if kind == "real":
        dataset = params.get("dataset")
        if dataset is None:
            raise ValueError(f"real distribution needs a 'dataset', got {dict(spec)}")
        return spec.get("label", dataset), sample_lengths(dataset, batch_size, seed)
    raise ValueError(f"distribution kind must be one of {DISTRIBUTION_KINDS}, got {kind!r} in {dict(spec)}")


@dataclass(frozen=True)
class Distribution:
    """One distribution's prompt-length samples, one per seed (a single one for fixed lengths)."""

    label: str
    kind: str
    samples: tuple[tuple[int, ...], ...]
    seeds: tuple[int, ...]

    @property
    def lengths(self) -> list[int]:
        """The first seed's sample: the one the figures draw."""
        return list(self.samples[0])


def resolve_distributions(
    specs: Sequence[Mapping[str, Any]], *, batch_size: int, seeds: Sequence[int]
) -> list[Distribution]:
    """Every spec resolved for every seed; seed workloads (fixed lengths) keep one sample."""
    if not seeds:
        raise ValueError("seeds must hold at least one seed")
    out = []
    for spec in specs:
        use = (seeds[0],) if spec.get("kind") == "seed" else tuple(seeds)
        resolved = [resolve_distribution(spec, batch_size=batch_size, seed=s) for s in use]
        out.append(Distribution(resolved[0][0], str(spec["kind"]), tuple(tuple(x) for _, x in resolved), use))
    return out
