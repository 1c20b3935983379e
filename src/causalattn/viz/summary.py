"""Per-head summaries and thumbnails of A, for the explorer's model view (layers × heads).

    head_summary(A, kinds, ids) -> {"entropy", "first", "distance", "previous", "induction":
                                    (h,) floats, "role": [h strings]}
    thumbnail(A, n)             -> (n', n') uint8, n' = min(n, T)

The scores are :func:`causalattn.inspect.head_scores` (defined there and in docs/design.md),
computed from the trace's own float64/float32 A over the query rows that read at least one
key (padding queries read nothing and are left out); the role is the inspect module's.
"""

from __future__ import annotations

import numpy as np

from ..inspect import head_scores, role_of
from .kinds import READABLE

__all__ = ["head_summary", "thumbnail"]

# the page's short names for the scores
_PAGE = {
    "entropy": "entropy",
    "first_token": "first",
    "mean_distance": "distance",
    "previous_token": "previous",
    "induction": "induction",
}


def head_summary(A: np.ndarray, kinds: np.ndarray, ids=None) -> dict:
    """A ``(h, T, T)`` (or ``(T, T)``) weights with the ``T×T`` kinds of their mask and the
    tokens (ids or strings) that find each token's earlier copy."""
    sc = head_scores(A, kinds == READABLE, ids)
    out: dict = {_PAGE[k]: v for k, v in sc.items()}
    heads = range(len(sc["entropy"]))
    out["role"] = [role_of({k: float(v[h]) for k, v in sc.items()}) for h in heads]
    return out


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
