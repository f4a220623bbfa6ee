"""Non-negative least squares (Lawson–Hanson active set) in numpy, for the cost-model fit.

    x = nnls(A, b)          # argmin ||A x - b||_2  subject to  x >= 0

scipy is not a dependency, so this is the textbook algorithm (Lawson & Hanson 1974, ch. 23) with
column scaling for conditioning: the cost-model columns (1, tokens, GFLOPs, MiB) differ by orders
of magnitude.
"""
from __future__ import annotations

import numpy as np


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
