"""Named prompt-length workloads: the seed's five, uniform, real distributions, and synthetic ones.

A workload is a list of prompt lengths in tokens. The real ones are sampled with a fixed seed from
the CSVs shipped in ``rollout_lab/measure/prompt_lengths/`` (built by ``scripts/build_prompt_lengths.py``: Qwen2.5 BPE,
chat template included). ``lengths_to_prompts`` turns lengths into deterministic token-id prompts.
Torch-free, so the planner, notebooks and CPU tests can use it anywhere::

    from rollout_lab.measure.workloads import get_workload, padding_share
    lengths = get_workload("gsm8k_32")            # 32 GSM8K prompt lengths, seed 0
    tiny = get_workload("long_tail", scale=0.05)  # 1x26 + 31x1 for CPU tests

``eos_long_tail(vocab_size)`` (shape ``EOS_LONG_TAIL``) adds the EOS ids that end sampled rows at a
constant hazard: 512 GPQA prompts whose responses have geometric lengths (``measure.long_tail``).

``SAMPLED_WORKLOADS`` are prompts each sampled ``num_samples`` times, the shapes whose samples share
their prompt's KV (``measure.prefix_sharing``): ``grpo_long_prompt`` (32 prompts of 1,500-2,500
tokens x 16 samples x 512 new tokens), ``many_samples_short`` (128 GSM8K prompts x 32 x 256) and
``grpo_gsm8k`` (64 GSM8K prompts x 8 x 512); their prompt lengths are named workloads too
(``get_workload("grpo_long_prompt")``).

Prompt-length distributions the planner is studied on: specs resolved to lengths, per seed.

A spec is a small dict (the ``distributions`` parameter of ``notebooks/02_bucket_choices.ipynb``):
a seed workload, a lognormal or bimodal draw, or a sample of a real dataset's lengths. Torch-free
and pure (the real ones read the shipped CSVs above)::

    from rollout_lab.measure.workloads import resolve_distribution, resolve_distributions
    label, lengths = resolve_distribution({"kind": "real", "dataset": "gsm8k"}, batch_size=32, seed=0)
    dists = resolve_distributions([{"kind": "seed", "name": "long_tail"}], batch_size=32, seeds=[0, 1])

"""
from __future__ import annotations

import csv
import io
import math
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

# The shipped prompt-length CSVs: package data, so an installed copy reads them from any folder.
PROMPT_LENGTHS = resources.files("rollout_lab.measure") / "prompt_lengths"
SAMPLE_SEED = 0  # the fixed seed behind every named real workload ("gsm8k_32", ...)
DATASETS = ("gsm8k", "humaneval", "gpqa_diamond", "aime2025")

_SEED_WORKLOADS: dict[str, Callable[[], list[int]]] = {
    "short_similar": lambda: [n for n in range(20, 12, -1) for _ in range(4)],
    "long_tail": lambda: [512] + [16] * 31,
    "short_tail": lambda: [20] + [1] * 31,
    "moderate_tail": lambda: [128] + [4] * 31,
    "spread": lambda: list(range(16, 513, 16)),
    "uniform_128x16": lambda: [16] * 128,
}
_REAL_WORKLOADS: dict[str, tuple[str, int]] = {
    "gsm8k_32": ("gsm8k", 32),
    "gsm8k_64": ("gsm8k", 64),
    "gsm8k_128": ("gsm8k", 128),
    "humaneval_32": ("humaneval", 32),
    "gpqa_diamond_32": ("gpqa_diamond", 32),
    "gpqa_diamond_128": ("gpqa_diamond", 128),
    "aime2025_30": ("aime2025", 30),
}
# prompts each sampled num_samples times (issue 54's shapes): their lengths (uniform in [min_len,
# max_len] at SAMPLE_SEED, or drawn from a dataset), samples, new tokens, temperature and the preset
# whose geometry they were set for
SAMPLED_WORKLOADS: dict[str, dict[str, Any]] = {
    "grpo_long_prompt": {"num_prompts": 32, "min_len": 1500, "max_len": 2500, "num_samples": 16,
                         "max_new_tokens": 512, "temperature": 1.0, "preset": "qwen2.5-3b"},
    "many_samples_short": {"num_prompts": 128, "dataset": "gsm8k", "num_samples": 32, "max_new_tokens": 256,
                           "temperature": 1.0, "preset": "llama-3.2-1b"},
    # bench grpo's issue shape (64 GSM8K prompts x 8 x 512): its lengths are measure.grpo's at seed 0
    "grpo_gsm8k": {"num_prompts": 64, "dataset": "gsm8k", "num_samples": 8, "max_new_tokens": 512,
                   "temperature": 1.0, "preset": "qwen2.5-3b"},
}
# appended last: a workload's index (measure.defaults.prompt_seed) stays what it was
WORKLOADS: tuple[str, ...] = tuple(_SEED_WORKLOADS) + tuple(_REAL_WORKLOADS) + tuple(SAMPLED_WORKLOADS)


def get_workload(name: str, *, scale: float = 1.0) -> list[int]:
    """Prompt lengths of the named workload; ``scale`` multiplies every length (rounded, min 1)."""
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a finite number > 0, got {scale!r}")
    if name in _SEED_WORKLOADS:
        lengths = _SEED_WORKLOADS[name]()
    elif name in _REAL_WORKLOADS:
        dataset, n = _REAL_WORKLOADS[name]
        lengths = sample_lengths(dataset, n, seed=SAMPLE_SEED)
    elif name in SAMPLED_WORKLOADS:
        spec = SAMPLED_WORKLOADS[name]
        lengths = sample_lengths(spec["dataset"], spec["num_prompts"], seed=SAMPLE_SEED) if "dataset" in spec \
            else uniform_workload(spec["num_prompts"], low=spec["min_len"], high=spec["max_len"], seed=SAMPLE_SEED)[0]
    else:
        raise ValueError(f"unknown workload {name!r}; valid names: {', '.join(WORKLOADS)}")
    return scale_lengths(lengths, scale) if scale != 1.0 else lengths


def scale_lengths(lengths: Sequence[int], scale: float) -> list[int]:
    """Each length times ``scale``, rounded half up, never below 1."""
    return [max(1, int(math.floor(n * scale + 0.5))) for n in lengths]


def scale_keeping_prompts(lengths: Sequence[int], scale: float, *, what: str) -> list[int]:
    """``scale_lengths(lengths, scale)``; ValueError when ``scale`` makes the shortest of ``lengths``
    (``what`` names them: "of grpo_long_prompt") shorter than one token, which ``scale_lengths``
    would clip to 1 silently, naming the smallest scale that keeps every prompt."""
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a finite number > 0, got {scale!r}")
    shortest = min(lengths)
    if shortest * scale < 1:
        smallest = 1 / shortest
        digits = 2 - math.floor(math.log10(smallest))  # three significant digits, rounded up
        raise ValueError(f"scale={scale:g} makes the shortest of these prompts ({shortest} tokens {what}) "
                         f"{shortest * scale:.3g} tokens, which would be clipped to 1 (as would every prompt under "
                         f"1 token); give scale >= {math.ceil(smallest * 10**digits) / 10**digits:g} (1/{shortest})")
    return scale_lengths(lengths, scale)


def load_lengths(dataset: str) -> list[int]:
    """All prompt lengths of ``dataset`` from the shipped ``prompt_lengths/<dataset>.csv``, in source order."""
    path = PROMPT_LENGTHS / f"{dataset}.csv"
    if not path.is_file():
        available = sorted(p.name[:-4] for p in PROMPT_LENGTHS.iterdir() if p.name.endswith(".csv"))
        raise ValueError(
            f"no prompt-length file for dataset {dataset!r}; available: {', '.join(available)} "
            "(regenerate with scripts/build_prompt_lengths.py)"
        )
    rows = list(csv.DictReader(io.StringIO(path.read_text(encoding="utf-8"))))
    lengths = []
    for i, row in enumerate(rows):
        if row["name"] != dataset or int(row["index"]) != i or int(row["num_tokens"]) < 1:
            raise ValueError(f"{dataset}.csv: bad row {i}: {row}")
        lengths.append(int(row["num_tokens"]))
    return lengths


LENGTH_COLUMNS = ("num_tokens", "tokens", "length")  # a lengths CSV's column, by name (the first present)
# a lengths file is read whole: 8 MiB holds ~300k CSV rows like the shipped ones, far past any batch
MAX_LENGTHS_FILE_BYTES = 8 * 2**20
LENGTHS_FILE = f"numbers, or a CSV with a {', '.join(LENGTH_COLUMNS[:-1])} or {LENGTH_COLUMNS[-1]} column"


def read_lengths_file(path: str | Path) -> list[int]:
    """Prompt lengths from a file: numbers separated by whitespace or commas, or a CSV with a header
    whose ``num_tokens``, ``tokens`` or ``length`` (``LENGTH_COLUMNS``, or only) column holds them,
    such as the shipped prompt-length CSVs; one over ``MAX_LENGTHS_FILE_BYTES`` is refused unread."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"lengths file {str(path)!r} is a folder; give a file of prompt lengths ({LENGTHS_FILE})")
    if not path.is_file():
        raise ValueError(f"lengths file {str(path)!r} does not exist")
    size = path.stat().st_size
    if size > MAX_LENGTHS_FILE_BYTES:
        raise ValueError(f"lengths file {str(path)!r} is {size} bytes, over the {MAX_LENGTHS_FILE_BYTES} "
                         "a lengths file may hold; give a batch's lengths, not a corpus's")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"lengths file {str(path)!r} is not UTF-8 text: {err}") from None
    first = text.lstrip().split("\n", 1)[0].strip()
    fields = [f.strip() for f in first.split(",")]
    is_header = ("," in first or len(first.split()) == 1) and not all(f.lstrip("-").isdigit() for f in fields)
    if is_header:  # a CSV: its header names the column
        reader = csv.DictReader(io.StringIO(text.lstrip()))
        columns = reader.fieldnames or []
        named = [c for c in LENGTH_COLUMNS if c in columns]
        column = named[0] if named else (columns[0] if len(columns) == 1 else None)
        if column is None:
            raise ValueError(f"{path}: a CSV of lengths needs a column named one of {list(LENGTH_COLUMNS)}, "
                             f"or a single column; got columns {columns}")
        tokens = [row[column] for row in reader]
    else:
        tokens = text.replace(",", " ").split()
    lengths = []
    for token in tokens:
        try:
            lengths.append(int(token))
        except (TypeError, ValueError):
            raise ValueError(f"{path}: prompt length {token!r} is not an integer") from None
    if not lengths:
        raise ValueError(f"lengths file {str(path)!r} holds no prompt lengths; give {LENGTHS_FILE}, a prompt's "
                         "length a number or a row")
    return lengths


def sample_lengths(dataset: str, n: int, seed: int = SAMPLE_SEED, *, replace: bool = False) -> list[int]:
    """``n`` lengths drawn from ``dataset`` with ``np.random.default_rng(seed)``, in draw order."""
    lengths = load_lengths(dataset)
    if n < 1 or (n > len(lengths) and not replace):
        raise ValueError(
            f"cannot draw n={n} prompts from {dataset!r} ({len(lengths)} prompts) "
            f"{'with' if replace else 'without'} replacement; need 1 <= n"
            + ("" if replace else f" <= {len(lengths)}, or replace=True")
        )
    picks = np.random.default_rng(seed).choice(len(lengths), size=n, replace=replace)
    return [lengths[i] for i in picks]


def lognormal_lengths(n: int, median: float, sigma: float, seed: int, max_len: int) -> list[int]:
    """``n`` lengths ~ median * exp(sigma * N(0, 1)), rounded and clipped to [1, max_len]."""
    _check_synthetic(n, median, sigma, max_len)
    z = np.random.default_rng(seed).standard_normal(n)
    return np.clip(np.rint(median * np.exp(sigma * z)), 1, max_len).astype(int).tolist()


def bimodal_lengths(
    n: int, short_median: float, long_median: float, *, long_share: float, sigma: float = 0.1,
    seed: int = 0, max_len: int = 4096,
) -> list[int]:
    """A mix of two lognormal modes: round(n * long_share) long prompts, the rest short, shuffled."""
    if not 0.0 <= long_share <= 1.0:
        raise ValueError(f"long_share must be in [0, 1], got {long_share!r}")
    _check_synthetic(n, short_median, sigma, max_len)
    _check_synthetic(n, long_median, sigma, max_len)
    rng = np.random.default_rng(seed)
    num_long = int(round(n * long_share))
    medians = np.array([long_median] * num_long + [short_median] * (n - num_long), dtype=float)
    raw = medians * np.exp(sigma * rng.standard_normal(n))
    return np.clip(np.rint(rng.permutation(raw)), 1, max_len).astype(int).tolist()


def crossing_batches(n: int, seed: int, *, max_len: int = 2048) -> dict[str, list[int]]:
    """The lognormal and bimodal batches of ``n`` prompts on which packed and bucketed prefill are
    compared (``measure.bucket_choices.packed_crossing_rows`` from the cost model,
    ``measure.prefill_routes`` measured): median 120 tokens, sigma 0.8; or 10% long prompts of
    ~600 among short ones of ~40. A ``max_len`` under 2048 shrinks every length in proportion."""
    scale = min(1.0, max_len / 2048)
    return {
        "lognormal": lognormal_lengths(n, 120.0 * scale, 0.8, seed, max_len),
        "bimodal": bimodal_lengths(n, 40.0 * scale, 600.0 * scale, long_share=0.1, sigma=0.2, seed=seed,
                                   max_len=max_len),
    }


def uniform_workload(num_requests: int, *, low: int, high: int, seed: int = 0) -> tuple[list[int], list[int]]:
    """(prompt lengths, output budgets), each drawn uniformly from ``[low, high]`` with one seeded
    generator: nano-vllm's ``bench.py`` shape (256 requests, 100..1024) when called with its numbers."""
    if num_requests < 1 or low < 1 or high < low:
        raise ValueError(f"need num_requests >= 1 and 1 <= low <= high, got {num_requests}, {low}, {high}")
    rng = np.random.default_rng(seed)
    lengths = rng.integers(low, high + 1, size=num_requests).tolist()
    budgets = rng.integers(low, high + 1, size=num_requests).tolist()
    return lengths, budgets


def _check_synthetic(n: int, median: float, sigma: float, max_len: int) -> None:
    if n < 1 or median <= 0 or sigma < 0 or max_len < 1:
        raise ValueError(
            f"need n >= 1, median > 0, sigma >= 0, max_len >= 1; got n={n}, median={median}, "
            f"sigma={sigma}, max_len={max_len}"
        )


def padding_share(lengths: Sequence[int]) -> float:
    """Fraction of padded positions when all ``lengths`` are left-padded to the longest one."""
    if len(lengths) == 0:
        raise ValueError("padding_share needs at least one length")
    return 1.0 - sum(lengths) / (len(lengths) * max(lengths))


def mean_padding_share(
    lengths: Sequence[int], batch_size: int, *, num_batches: int = 1000, seed: int = 0
) -> float:
    """Mean ``padding_share`` of ``num_batches`` random batches (without replacement) of ``lengths``."""
    if not 1 <= batch_size <= len(lengths):
        raise ValueError(f"batch_size must be in [1, {len(lengths)}], got {batch_size}")
    rng = np.random.default_rng(seed)
    pool = np.asarray(lengths)
    shares = [padding_share(pool[rng.choice(len(pool), batch_size, replace=False)].tolist())
              for _ in range(num_batches)]
    return float(np.mean(shares))


def lengths_to_prompts(
    lengths: Sequence[int], *, vocab_size: int, seed: int = 0, special_ids: Sequence[int] = ()
) -> list[list[int]]:
    """Deterministic random token-id prompts of the given lengths, drawn uniformly from the ids in
    ``[0, vocab_size)`` that are not in ``special_ids`` (so no prompt contains a PAD/EOS/BOS id)."""
    allowed = np.setdiff1d(np.arange(vocab_size), np.asarray(special_ids, dtype=int))
    if allowed.size == 0:
        raise ValueError(f"no token ids left in [0, {vocab_size}) after removing special ids {list(special_ids)}")
    if any(n < 1 for n in lengths):
        raise ValueError(f"every prompt length must be >= 1, got {list(lengths)}")
    rng = np.random.default_rng(seed)
    return [allowed[rng.integers(0, allowed.size, size=n)].tolist() for n in lengths]

# -- distributions: specs resolved to lengths, per seed --------------------------------------------

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


# -- EOS long tail: prompts of a real dataset, responses ending at a constant per-step hazard -------

# the shape: 512 GPQA prompts (drawn with replacement), 2048-token budgets, 128 slots
EOS_LONG_TAIL = {"num_prompts": 512, "dataset": "gpqa_diamond", "hazard": 1 / 295, "max_new_tokens": 2048,
                 "slots": 128, "seed": 0}


def eos_long_tail(vocab_size: int, *, num_prompts: int = 512, dataset: str = "gpqa_diamond", hazard: float = 1 / 295,
                  seed: int = 0, special_ids: Sequence[int] = ()) -> tuple[list[int], list[int]]:
    """(prompt lengths, EOS ids) of an RL rollout whose rows end at very different times.

    Sampled at temperature 1, a random-weight model's next token is near uniform over the
    vocabulary, so ``k = max(1, round(hazard * vocab_size))`` EOS ids end a row with probability
    ~k/V per step: geometric response lengths (hazard 1/295: p50 ~204, p90 ~680, the max of 512
    ~1,800). The lengths are ``sample_lengths(dataset, num_prompts, seed=seed, replace=True)``; the
    ids are distinct, drawn with ``default_rng(seed)`` from ``[0, vocab_size)`` less ``special_ids``,
    sorted."""
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, (int, np.integer)) or vocab_size < 1:
        raise ValueError(f"vocab_size must be an int >= 1, got {vocab_size!r}")
    if isinstance(num_prompts, bool) or not isinstance(num_prompts, (int, np.integer)) or num_prompts < 1:
        raise ValueError(f"num_prompts must be an int >= 1, got {num_prompts!r}")
    if dataset not in DATASETS:
        raise ValueError(f"dataset must be one of {list(DATASETS)}, got {dataset!r}")
    if isinstance(hazard, bool) or not isinstance(hazard, (int, float)) or not 0 < hazard <= 0.5:
        raise ValueError(f"hazard (the per-step end probability) must be a number in (0, 0.5], got {hazard!r}")
    allowed = np.setdiff1d(np.arange(vocab_size), np.asarray(special_ids, dtype=int))
    num_eos = max(1, round(hazard * vocab_size))
    if num_eos > allowed.size:
        raise ValueError(f"hazard {hazard!r} needs {num_eos} EOS ids; only {allowed.size} of [0, {vocab_size}) "
                         f"are not special ids {list(special_ids)}")
    lengths = sample_lengths(dataset, int(num_prompts), seed=seed, replace=True)
    eos_ids = np.random.default_rng(seed).choice(allowed, size=num_eos, replace=False)
    return lengths, sorted(int(t) for t in eos_ids)
