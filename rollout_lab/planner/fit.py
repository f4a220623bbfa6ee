"""Non-negative least squares (Lawson–Hanson active set) in numpy, for the cost-model fit.

    x = nnls(A, b)          # argmin ||A x - b||_2  subject to  x >= 0

scipy is not a dependency, so this is the textbook algorithm (Lawson & Hanson 1974, ch. 23) with
column scaling for conditioning: the cost-model columns (1, tokens, GFLOPs, MiB) differ by orders
of magnitude.

Online recalibration: refit the cost coefficients from the forwards of every call.

    rollout = Rollout(model, RolloutConfig(online_recalibration=True, online_window=256))
    rollout.generate(prompts, max_new_tokens=16)
    rollout.costs                 # the refitted CostCoefficients (a new frozen object each call)
    rollout.prediction_errors     # per call: predicted vs measured prefill / decode ms

Each call's ``Profile.forwards`` (prefill buckets, tail chunks and HF ``generate``'s prefill with
their shapes; decode bursts with their rows and steps) goes into a ring buffer of the last
``window`` observations, so memory stays bounded. A forward marked ``first_use`` captured a graph
or compiled code for its shape, so its ms say nothing about the shape's cost and it is left out
(of the prediction error too): fitted as forward time, a warm-up call's captures and compiles
would price every shape by what capturing one cost. After the call:

- prefill: NNLS (``nnls`` above), rows divided by the measurement (relative error, as
  ``fit_coefficients``), over the columns of C(B, L): 1, B*L, attention GFLOPs (a chunk's
  over its past too) and KV MiB (0 for nocb's forward, which writes no aligned cache). KV MiB is
  proportional to B*L, so ``kv`` is fitted only when both kinds of forward are in the window;
  otherwise its term is kept from the current coefficients and the rest is fitted to what remains.
  Fewer than 3 prefill observations keep the prefill coefficients. Where the window's shapes do
  not identify the terms (its columns have less than full rank: one shape, or one width at several
  batch sizes) the current terms are scaled by one factor to the measured level: a full fit on
  such a window (the few shapes of a process's first timed calls) prices other shapes anyhow, and
  the DP then cuts a batch into small buckets, each a new class to capture
  (data/results/defaults_qwen2.5-3b_bfloat16_cuda_h100_sampled_warm.json, moderate_tail).
- decode: ``continuous_decode_cost_ms`` / ``nocb_decode_cost_ms`` become the measured ms per step
  of each route (absolute costs, as a calibration that measures both gives). While one route is
  unmeasured, its cost keeps the starting coefficients' difference to the measured one.

Timing a call costs it: every phase synchronises the device, so the host no longer runs ahead of
the GPU (data/results/defaults_qwen2.5-3b_bfloat16_cuda_h100_rung_warm.json: ``RolloutConfig()``'s
timed long_tail calls against the tuned setting's untimed ones at the same shapes). ``due()`` says
whether the next call is worth timing: every call until the last ``settled_after`` observed calls
were predicted within ``SETTLED_ERROR`` (1 call when the coefficients come from an earlier refit,
``SETTLED_CALLS`` otherwise), then one call in ``check_every``; a check that misses unsettles it.
``Rollout`` skips the calls it is not due for under the implicit ``costs="auto"``;
``online_recalibration=True`` times every call.

Before a route's decode cost is measured its estimate is a guess, so ``Rollout`` (mode auto)
explores: while nocb is eligible and either route has no decode observation, it runs that route
once (``explored`` in ``prediction_errors``). Coefficients are never changed in place:
``dataclasses.replace`` gives a new ``CostCoefficients``. Pure numpy, no torch.

"""
from __future__ import annotations

import dataclasses
import statistics
from collections import deque
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from rollout_lab.planner.cost import (
    CostCoefficients,
    ModelGeometry,
    attention_gflops,
    kv_mib,
    prefill_cost_ms,
)


def nnls(a: np.ndarray, b: np.ndarray, *, max_iter: int | None = None) -> np.ndarray:
    """The x >= 0 that minimises ||a @ x - b||; all-zero columns get x = 0."""
    a = np.asarray(a, dtype=float)
    b = np.asarray(b, dtype=float)
    if a.ndim != 2 or b.ndim != 1 or a.shape[0] != b.shape[0]:
        raise ValueError(f"nnls needs a 2-D a and a 1-D b of matching rows, got {a.shape} and {b.shape}")
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        raise ValueError("nnls inputs must be finite")
    norms = np.linalg.norm(a, axis=0)
    usable = norms > 0
    scale = np.where(usable, norms, 1.0)
    x_scaled = _lawson_hanson(a[:, usable] / scale[usable], b, max_iter=max_iter)
    x = np.zeros(a.shape[1])
    x[usable] = x_scaled / scale[usable]
    return x


def _lawson_hanson(a: np.ndarray, b: np.ndarray, *, max_iter: int | None) -> np.ndarray:
    num_rows, num_cols = a.shape
    x = np.zeros(num_cols)
    passive = np.zeros(num_cols, dtype=bool)
    tol = 10 * np.finfo(float).eps * max(num_rows, num_cols) * max(1.0, np.abs(a).sum(axis=0).max(initial=0.0))
    max_iter = 30 * num_cols + 10 if max_iter is None else max_iter
    gradient = a.T @ (b - a @ x)
    for _ in range(max_iter):
        if passive.all() or (gradient[~passive] <= tol).all():
            break
        j = int(np.argmax(np.where(passive, -np.inf, gradient)))
        passive[j] = True
        while True:
            s = np.zeros(num_cols)
            s[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (s[passive] > tol).all():
                x = s
                break
            # step back towards x until the first passive variable hits zero, then drop it
            blocking = passive & (s <= tol)
            alpha = np.min(x[blocking] / (x[blocking] - s[blocking]))
            x = x + alpha * (s - x)
            passive &= x > tol
            x[~passive] = 0.0
            if not passive.any():
                break
        gradient = a.T @ (b - a @ x)
    return np.maximum(x, 0.0)

# -- online recalibration --------------------------------------------------------------------------

PREFILL_KINDS = ("prefill", "chunk", "nocb_prefill")
DECODE_KINDS = {"bucketed": "decode", "nocb": "nocb_decode"}
MIN_PREFILL_OBSERVATIONS = 3
# the prefill coefficients, in design_row's order of columns
PREFILL_TERMS = ("prefill_fixed_cost_ms", "prefill_token_cost_ms", "prefill_attention_cost_ms", "prefill_kv_cost_ms")
SETTLED_ERROR = 0.25  # |predicted / measured - 1| of a call's prefill + decode under which it counts as settled
SETTLED_CALLS = 3  # observed calls in a row within it before the calibrator only checks (module docstring)
CHECK_EVERY = 8  # a settled calibrator observes one call in this many


def check_window(window: object) -> None:
    if isinstance(window, bool) or not isinstance(window, int) or window < 4:
        raise ValueError(f"online_window must be an int >= 4 (observations kept), got {window!r}")


def design_row(record: Mapping[str, Any], geometry: ModelGeometry) -> list[float]:
    """[1, B*L, attention GFLOPs, KV MiB] of one prefill forward record."""
    batch, width = int(record["batch"]), int(record["width"])
    gflops = attention_gflops(batch, width, geometry)
    if record["kind"] == "chunk":
        gflops *= 1.0 + record.get("offset", 0) / width  # queries of the chunk over its past too
    mib = 0.0 if record["kind"] == "nocb_prefill" else kv_mib(batch, width, geometry)
    return [1.0, float(batch * width), gflops, mib]


def prefill_terms(costs: CostCoefficients) -> np.ndarray:
    """The prefill coefficients in ``design_row``'s order (``PREFILL_TERMS``)."""
    return np.array([getattr(costs, name) for name in PREFILL_TERMS])


def predicted_ms(records: Iterable[Mapping[str, Any]], geometry: ModelGeometry,
                 costs: CostCoefficients) -> tuple[float, float]:
    """(prefill ms, decode ms) that ``costs`` predict for these forwards (the measured shapes)."""
    weights = prefill_terms(costs)
    prefill = decode = 0.0
    for r in records:
        if r["kind"] in PREFILL_KINDS:
            prefill += float(np.dot(design_row(r, geometry), weights))
        elif r["kind"] == "decode":
            decode += costs.continuous_decode_cost_ms * r["steps"]
        elif r["kind"] == "nocb_decode":
            decode += costs.nocb_decode_cost_ms * r["steps"]
    return prefill, decode


def measured_ms(records: Iterable[Mapping[str, Any]]) -> tuple[float, float]:
    """(prefill ms, decode ms) measured."""
    prefill = decode = 0.0
    for r in records:
        if r["kind"] in PREFILL_KINDS:
            prefill += r["ms"]
        else:
            decode += r["ms"]
    return prefill, decode


def _rel(predicted: float, measured: float) -> float:
    return (predicted - measured) / measured if measured > 0 else float("nan")


class OnlineCalibrator:
    """The ring buffer of observations, the refit, and the per-call prediction errors."""

    def __init__(self, geometry: ModelGeometry, start: CostCoefficients, *, window: int = 256,
                 settled_after: int = SETTLED_CALLS, check_every: int = CHECK_EVERY):
        check_window(window)
        for name, value in (("settled_after", settled_after), ("check_every", check_every)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        self.geometry, self.start, self.window = geometry, start, window
        self.settled_after, self.check_every = settled_after, check_every
        self.observations: deque[dict[str, Any]] = deque(maxlen=window)
        self.errors: deque[dict[str, Any]] = deque(maxlen=window)
        self.num_calls = 0  # observed calls
        self.num_skipped = 0  # calls not observed since the last observed one

    @property
    def settled(self) -> bool:
        """Whether the last ``settled_after`` observed calls were all predicted within ``SETTLED_ERROR``."""
        recent = list(self.errors)[-self.settled_after:]
        return len(recent) == self.settled_after and all(abs(e["rel_error"]) <= SETTLED_ERROR for e in recent)

    def due(self) -> bool:
        """Whether the next call should be timed and observed (module docstring)."""
        return not self.settled or self.num_skipped >= self.check_every - 1

    def skip(self) -> None:
        """Note a call that was not observed."""
        self.num_skipped += 1

    def has_decode(self, route: str) -> bool:
        kind = DECODE_KINDS["nocb" if route == "nocb" else "bucketed"]
        return any(r["kind"] == kind for r in self.observations)

    def observe(self, records: Sequence[Mapping[str, Any]], costs: CostCoefficients, *,
                route: str, explored: bool, total_ms: float) -> dict[str, Any]:
        """Note one call: its prediction error under ``costs`` (the ones it was planned with). A
        forward marked ``first_use`` (it captured or compiled its shape) is left out of both."""
        records = [r for r in records if r["ms"] >= 0 and not r.get("first_use")]
        pred_prefill, pred_decode = predicted_ms(records, self.geometry, costs)
        meas_prefill, meas_decode = measured_ms(records)
        error = {
            "call": self.num_calls, "route": route, "explored": explored,
            "predicted_prefill_ms": pred_prefill, "measured_prefill_ms": meas_prefill,
            "prefill_rel_error": _rel(pred_prefill, meas_prefill),
            "predicted_decode_ms": pred_decode, "measured_decode_ms": meas_decode,
            "decode_rel_error": _rel(pred_decode, meas_decode),
            "predicted_ms": pred_prefill + pred_decode, "measured_ms": meas_prefill + meas_decode,
            "rel_error": _rel(pred_prefill + pred_decode, meas_prefill + meas_decode),
            "total_ms": total_ms,
        }
        self.errors.append(error)
        self.observations.extend(dict(r) for r in records)
        self.num_calls += 1
        self.num_skipped = 0
        return error

    def refit(self, costs: CostCoefficients) -> CostCoefficients:
        """New coefficients from the window (``costs`` where the window says nothing)."""
        changes = {**self._prefill_fit(costs), **self._decode_fit(costs)}
        return dataclasses.replace(costs, **changes) if changes else costs

    def _prefill_fit(self, costs: CostCoefficients) -> dict[str, float]:
        rows = [r for r in self.observations if r["kind"] in PREFILL_KINDS]
        if len(rows) < MIN_PREFILL_OBSERVATIONS:
            return {}
        a = np.array([design_row(r, self.geometry) for r in rows])
        y = np.array([r["ms"] for r in rows])
        weights = 1.0 / np.maximum(y, 1e-3)
        with_kv = {r["kind"] == "nocb_prefill" for r in rows} == {True, False}
        columns = a[:, :4 if with_kv else 3]
        if np.linalg.matrix_rank(columns / np.maximum(np.abs(columns).max(axis=0), 1e-12)) < columns.shape[1]:
            # the window's shapes cannot tell the terms apart (one shape, or shapes on a line): a fit
            # would put their cost on any one term and price other shapes anyhow, so the terms are
            # scaled together to the observed level and keep their shape (module docstring)
            current = prefill_terms(costs)
            predicted, w2 = a @ current, weights ** 2
            if not np.sum(w2 * predicted ** 2) > 0:
                return {}
            scale = float(np.sum(w2 * predicted * y) / np.sum(w2 * predicted ** 2))
            return {name: float(value * scale) for name, value in zip(PREFILL_TERMS, current)}
        if with_kv:
            x = nnls(a * weights[:, None], y * weights)
            kv = float(x[3])
        else:
            kv = costs.prefill_kv_cost_ms
            x = nnls(a[:, :3] * weights[:, None], (y - kv * a[:, 3]) * weights)
        return dict(zip(PREFILL_TERMS, (float(x[0]), float(x[1]), float(x[2]), kv)))

    def _decode_fit(self, costs: CostCoefficients) -> dict[str, float]:
        per_step = {}
        for route, kind in DECODE_KINDS.items():
            rows = [r for r in self.observations if r["kind"] == kind]
            steps = sum(r["steps"] for r in rows)
            if steps:
                per_step[route] = sum(r["ms"] for r in rows) / steps
        if not per_step:
            return {}
        gap = self.start.continuous_decode_cost_ms - self.start.nocb_decode_cost_ms
        cb = per_step.get("bucketed", per_step.get("nocb", 0.0) + gap)
        nocb = per_step.get("nocb", cb - gap)
        return {"continuous_decode_cost_ms": max(0.0, cb), "nocb_decode_cost_ms": max(0.0, nocb)}


# -- the calibration fit (offline, pure numpy) -----------------------------------------------------


def fit_coefficients(
    shapes: Sequence[tuple[int, int]],
    forward_ms: Sequence[float],
    kv_copy_ms: Sequence[float],
    geometry: ModelGeometry,
    *,
    continuous_decode_cost_ms: float,
    nocb_decode_cost_ms: float = 0.0,
    prefill_max_tokens: int | None = CostCoefficients.prefill_max_tokens,
) -> tuple[CostCoefficients, tuple[dict[str, Any], ...], float]:
    """NNLS fit of C(B, L) to measured forwards and KV copies: (costs, per-shape fit, R^2).

    Rows are divided by the measurement, so the fit minimises relative error: the small,
    launch-bound shapes (where the fixed cost decides the DP) count as much as the large ones.
    """
    forward = np.asarray(forward_ms, dtype=float)
    copy = np.asarray(kv_copy_ms, dtype=float)
    if not (len(shapes) == len(forward) == len(copy)) or len(shapes) < 3:
        raise ValueError(
            f"need >= 3 shapes with one forward and one copy time each, got {len(shapes)} shapes, "
            f"{len(forward)} forwards, {len(copy)} copies"
        )
    if not (np.all(forward > 0) and np.all(copy >= 0) and np.isfinite(forward).all() and np.isfinite(copy).all()):
        raise ValueError("measured times must be finite, forwards > 0 and copies >= 0")
    tokens = np.array([b * w for b, w in shapes], dtype=float)
    gflops = np.array([attention_gflops(b, w, geometry) for b, w in shapes])
    mib = np.array([kv_mib(b, w, geometry) for b, w in shapes])
    weights = 1.0 / forward
    fixed, token, attention = nnls(np.column_stack([np.ones_like(tokens), tokens, gflops]) * weights[:, None],
                                   forward * weights)
    copy_weights = 1.0 / np.maximum(copy, 1e-6 * max(copy.max(), 1e-9))
    copy_fixed, kv = nnls(np.column_stack([np.ones_like(mib), mib]) * copy_weights[:, None], copy * copy_weights)
    costs = CostCoefficients(
        prefill_fixed_cost_ms=float(fixed + copy_fixed), prefill_token_cost_ms=float(token),
        prefill_attention_cost_ms=float(attention), prefill_kv_cost_ms=float(kv),
        continuous_decode_cost_ms=float(max(0.0, continuous_decode_cost_ms)),
        nocb_decode_cost_ms=float(max(0.0, nocb_decode_cost_ms)),
        prefill_max_tokens=prefill_max_tokens,
        # shared prefill's replication is the same ``admit`` copy (from a repeated source row)
        prefill_replicate_cost_ms=float(kv),
    )
    records = []
    for (b, w), f_ms, c_ms in zip(shapes, forward, copy):
        measured = float(f_ms + c_ms)
        predicted = prefill_cost_ms(b, w, geometry, costs)
        records.append({
            "batch": b, "width": w, "measured_ms": measured, "predicted_ms": predicted,
            "rel_error": (predicted - measured) / measured,
            "forward_ms": float(f_ms), "kv_copy_ms": float(c_ms),
        })
    return costs, tuple(records), r_squared([r["measured_ms"] for r in records],
                                            [r["predicted_ms"] for r in records])


def r_squared(measured: Sequence[float], predicted: Sequence[float]) -> float:
    """1 - SS_res / SS_tot (nan when the measurements do not vary)."""
    y, p = np.asarray(measured, dtype=float), np.asarray(predicted, dtype=float)
    ss_tot = float(((y - y.mean()) ** 2).sum())
    return float("nan") if ss_tot == 0 else 1.0 - float(((y - p) ** 2).sum()) / ss_tot


def decode_costs(records: Sequence[Mapping[str, Any]]) -> tuple[float, float]:
    """(continuous_decode_cost_ms, nocb_decode_cost_ms) from the decode probe, each >= 0.

    When CB decode per step is slower than nocb's, the reference form: (CB - nocb, 0). When it is
    faster (a graph-captured CB step against HF's eager loop) the overhead would be negative, so
    both per-step costs are given and the planner compares them. No probe: (0, 0).
    """
    if not records:
        return 0.0, 0.0
    cb = max(0.0, statistics.mean(r["cb_ms_per_step"] for r in records))
    nocb = max(0.0, statistics.mean(r["nocb_ms_per_step"] for r in records))
    return (cb - nocb, 0.0) if cb >= nocb else (cb, nocb)


def paged_decode_cost(records: Sequence[Mapping[str, Any]]) -> float:
    """``paged_decode_cost_ms`` from the decode probe's records that timed the paged route: what its
    step costs over the aligned one, mean over the probe's batches, >= 0 (0 without such records)."""
    gaps = [r["paged_ms_per_step"] - r["cb_ms_per_step"] for r in records if "paged_ms_per_step" in r]
    return max(0.0, statistics.mean(gaps)) if gaps else 0.0
