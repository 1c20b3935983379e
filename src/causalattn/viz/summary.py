"""Per-head summaries and thumbnails of A, for the explorer's model view (layers × heads).

    head_summary(A, kinds) -> {"entropy": (h,), "first": (h,), "distance": (h,)}
    thumbnail(A, n)        -> (n', n') uint8, n' = min(n, T)

Computed from the trace's own float64/float32 A, exactly, over the query rows that read at
least one key (padding queries read nothing and are left out):

- entropy: mean over rows of -Σ_j A_ij log A_ij, in nats (0 = one key takes all the weight;
  log(i) = spread evenly over i keys);
- first: mean weight on the sequence's first real (non-padding) token, the "attention sink";
- distance: mean over rows of Σ_j A_ij (i - j), how far back a head reads (0 = itself).
"""

from __future__ import annotations

import numpy as np

from .kinds import READABLE, pad_of

__all__ = ["head_summary", "thumbnail"]


def head_summary(A: np.ndarray, kinds: np.ndarray) -> dict[str, np.ndarray]:
    """A ``(h, T, T)`` (or ``(T, T)``) weights with the ``T×T`` kinds of their mask."""
    A = np.asarray(A, dtype=np.float64)
    if A.ndim == 2:
        A = A[None]
    T = A.shape[-1]
    readable = kinds == READABLE
    rows = readable.any(axis=-1)  # queries that read something
    pad = pad_of(kinds)
    real = np.flatnonzero(~pad)
    first = int(real[0]) if real.size else 0
    with np.errstate(divide="ignore", invalid="ignore"):
        plogp = np.where(readable & (A > 0), A * np.log(np.where(A > 0, A, 1.0)), 0.0)
    entropy = -plogp.sum(axis=-1)  # (h, T)
    dist = (A * (np.arange(T)[:, None] - np.arange(T)[None, :])).sum(axis=-1)
    n = max(int(rows.sum()), 1)

    def mean(x):
        return np.where(rows, x, 0.0).sum(axis=-1) / n

    return {"entropy": mean(entropy), "first": mean(A[:, :, first]), "distance": mean(dist)}


def thumbnail(A: np.ndarray, n: int = 48) -> np.ndarray:
    """``A`` (T×T, weights >= 0) as an ``n'×n'`` uint8 picture, n' = min(n, T).

    Each row is scaled to its largest weight first (so a long row's small weights stay
    visible next to a short row's), then cells are max-pooled into n' bins per axis, so a
    sharp line (the diagonal, a sink column) survives the downsampling.
    """
    A = np.asarray(A, dtype=np.float64)
    T = A.shape[-1]
    m = min(n, T)
    with np.errstate(invalid="ignore", divide="ignore"):
        top = A.max(axis=-1, keepdims=True)
        rel = np.where(top > 0, A / np.where(top > 0, top, 1.0), 0.0)
    rel = np.nan_to_num(rel, nan=0.0, posinf=1.0, neginf=0.0)
    starts = np.unique((np.arange(m) * T) // m)
    P = np.maximum.reduceat(np.maximum.reduceat(rel, starts, axis=0), starts, axis=1)
    return np.clip(np.rint(P * 255), 0, 255).astype(np.uint8)
