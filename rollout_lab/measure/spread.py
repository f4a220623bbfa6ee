"""How timed samples are summarised: the median, the quartiles and the IQR, and whether two paths
differ by more than their spread. Sweeps, calibration and the plots all use these, so "faster"
means the same everywhere::

    stats = sample_spread([12.1, 11.8, 12.4, 30.0, 12.0])   # median_ms 12.1, iqr_ms 0.4, ...
    beyond_spread(stats, other)   # True when the two interquartile ranges do not overlap
"""
from __future__ import annotations

import statistics
from typing import Any, Mapping, Sequence


def sample_spread(samples_ms: Sequence[float]) -> dict[str, float]:
    """``median_ms``, ``q1_ms``, ``q3_ms`` and ``iqr_ms`` of non-empty samples (inclusive quartiles:
    one sample is its own quartiles)."""
    samples = [float(x) for x in samples_ms]
    if not samples:
        raise ValueError("no samples to summarise")
    q1, median, q3 = statistics.quantiles(samples, n=4, method="inclusive") if len(samples) > 1 else samples * 3
    return {"median_ms": median, "q1_ms": q1, "q3_ms": q3, "iqr_ms": q3 - q1}


def beyond_spread(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool | None:
    """Whether two summaries' interquartile ranges are disjoint (None when either has none)."""
    if any(s.get(k) is None for s in (a, b) for k in ("q1_ms", "q3_ms")):
        return None
    return a["q3_ms"] < b["q1_ms"] or b["q3_ms"] < a["q1_ms"]
