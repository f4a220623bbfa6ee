"""Expected decode steps of one call under a response-length prior (EOS-aware decode cost).

With a response-length prior (recent response
lengths l, clipped at the budget T; the empirical CDF F), a call of n requests pays, per route:

- nocb (HF ``generate``): decode steps until the last row stops, max_i l_i - 1 (the prefill gives
  the first token), so E[steps] = E[max of n draws] - 1 = sum_{k=1}^{T-1} (1 - F(k)^n);
- CB with every request admitted at once (slots >= n): rows retire, but the cost model prices a
  step the same however many rows are live, and steps run while any row is live: the same
  E[max of n] - 1;
- CB with refill (s < n slots; nocb is not eligible then): each slot serves about n / s requests
  back to back and a refill costs no step, so steps ~ (n - s) / s * (E[l] - 1) + E[max of s] - 1
  (an estimate: admission order and the cache capacity shift it).

Both routes' decode terms use these steps instead of T - 1; without a prior they are T - 1.
Pure Python, no torch.
"""
from __future__ import annotations

from typing import Mapping, Sequence

LengthPrior = Sequence[int] | Mapping[int, float]  # response lengths, or length -> weight


def length_cdf(prior: LengthPrior, max_new_tokens: int) -> list[float]:
    """F(k) = P(l <= k) for k = 0..max_new_tokens, lengths clipped at ``max_new_tokens``."""
    weights = _prior_weights(prior)
    mass = [0.0] * (max_new_tokens + 1)
    for length, weight in weights.items():
        mass[min(length, max_new_tokens)] += weight
    total = sum(mass)
    cdf, running = [], 0.0
    for m in mass:
        running += m
        cdf.append(min(1.0, running / total))
    return cdf


def _prior_weights(prior: LengthPrior) -> dict[int, float]:
    items = prior.items() if isinstance(prior, Mapping) else ((length, 1.0) for length in prior)
    weights: dict[int, float] = {}
    for length, weight in items:
        if isinstance(length, bool) or not is_integral(length) or int(length) < 1:
            raise ValueError(f"response lengths must be positive ints, got {length!r}")
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight >= 0 \
                or weight == float("inf"):
            raise ValueError(f"response-length weights must be finite and >= 0, got {weight!r}")
        weights[int(length)] = weights.get(int(length), 0.0) + float(weight)
    if not weights or sum(weights.values()) <= 0:
        raise ValueError("a response-length prior needs at least one length with positive weight")
    return weights


def expected_decode_steps(
    prior: LengthPrior | None, num_requests: int, max_new_tokens: int, *, num_slots: int | None = None
) -> float:
    """Expected decode forwards of one call (see the module docstring); ``max_new_tokens - 1``
    without a prior. ``num_slots`` below ``num_requests`` means refill (an estimate)."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if prior is None or num_requests <= 0:
        return float(max(0, max_new_tokens - 1)) if num_requests > 0 else 0.0
    cdf = length_cdf(prior, max_new_tokens)
    slots = num_requests if num_slots is None else min(num_slots, num_requests)
    steps_max = sum(1.0 - cdf[k] ** slots for k in range(1, max_new_tokens))
    if slots >= num_requests:
        return steps_max
    steps_mean = sum(1.0 - cdf[k] for k in range(1, max_new_tokens))
    return (num_requests - slots) / slots * steps_mean + steps_max


def is_integral(value: object) -> bool:
    """An int, numpy ints included; not a bool-like float."""
    try:
        return int(value) == value and not isinstance(value, float)  # numpy ints pass
    except (TypeError, ValueError):
        return False
