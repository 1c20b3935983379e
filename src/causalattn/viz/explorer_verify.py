"""The explorer's third step: what the page may recompute, checked here.

The page carries Q and K instead of S and A (T×d_k, not T×T) only where it is checked here
that S = Q Kᵀ·scale and A = softmax_last(S + M) with the pattern's score modifiers, as the
page recomputes them from the Q and K it is given (at the precision they travel), reproduce
the trace's own S and A; and Q, K, V as X W from shared weights only where that reproduces
them too. H is checked against A V: an H that is not (a recorded bug) travels as it is.

The modifiers are applied as the reference applies them (:meth:`causalattn.masks.Pattern.
modify_scores`, :func:`causalattn.matrix_form.softmax_last`); the page's own recompute is
pinned to the reference, modifier by modifier, by ``tests/viz/test_explorer_browser.py``.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .. import masks
from .._trace import Trace
from ..masks import _numpy
from ..matrix_form import softmax_last
from .explorer_read import Layer

__all__ = ["CHUNK_CELLS", "Scores", "modifiers", "from_weights", "check_scores", "check_values"]

CHUNK_CELLS = 4 * 2**20  # T×T cells per vectorized step (a few float64 arrays of 32 MiB)


def modifiers(tr: Trace, H: int) -> dict | None:
    """The score modifiers of the trace's pattern the page applies itself: ``{"softcap": c,
    "slopes": (h,), "sinks": (h,)}`` (None entries when absent); None when the pattern has
    one the page cannot apply (ALiBi slopes per sequence)."""
    pat = getattr(tr, "pattern", None)
    out = {"softcap": None, "slopes": None, "sinks": None}
    if pat is None or not getattr(pat, "has_modifiers", False):
        return out
    out["softcap"] = None if pat.softcap is None else float(pat.softcap)
    for name, key in (("alibi_slopes", "slopes"), ("sinks", "sinks")):
        v = getattr(pat, name)
        if v is None:
            continue
        v = np.asarray(_numpy(v), dtype=np.float64)
        if v.ndim == 2 and v.shape[0] == 1:
            v = v[0]
        if v.shape != (H,) or not np.isfinite(v).all():
            return None
        out[key] = [float(x) for x in v]
    return out


def from_weights(layers: list[Layer], st: dict) -> np.ndarray:
    """Per layer: whether its Q, K, V are exactly X W (split into heads), as the page computes."""
    tr0 = layers[0].trace
    if not all(n in tr0 for n in ("X", "W_q", "W_k", "W_v")) or st["Q"].shape != st["K"].shape:
        return np.zeros(len(layers), bool)
    W = [tr0[n] for n in ("W_q", "W_k", "W_v")]
    same = np.array(
        [
            all(
                lay.trace[n] is w or np.array_equal(lay.trace[n], w)
                for n, w in zip(("W_q", "W_k", "W_v"), W)
            )
            for lay in layers
        ]
    )
    X = np.stack([np.asarray(lay.trace["X"], dtype=np.float64) for lay in layers])
    if X.ndim != 3 or X.shape[1] != st["Q"].shape[2]:
        return np.zeros(len(layers), bool)
    H = st["Q"].shape[1]
    ok = same & np.isfinite(X).all(axis=(1, 2))
    with np.errstate(all="ignore"):
        for name, w in zip(("Q", "K", "V"), W):
            Y = X @ np.asarray(w, dtype=np.float64)  # (n, T, h·d) -> (n, h, T, d)
            Y = np.moveaxis(Y.reshape(Y.shape[0], Y.shape[1], H, -1), 2, 1)
            if Y.shape != st[name].shape:
                return np.zeros(len(layers), bool)
            ok &= np.isclose(Y, st[name], rtol=1e-12, atol=1e-12).all(axis=(1, 2, 3))
    return ok


def _score_pattern(mods: dict, hs: slice) -> masks.Pattern | None:
    """softcap and ALiBi of heads ``hs`` as a Pattern (positions 0..T-1, as the page's)."""
    if mods["softcap"] is None and mods["slopes"] is None:
        return None
    slopes = None if mods["slopes"] is None else np.asarray(mods["slopes"][hs], np.float64)
    return masks.Pattern(softcap=mods["softcap"], alibi_slopes=slopes)


class Scores(NamedTuple):
    """Per (layer, head): whether the page may recompute S and A from the cast Q and K
    (``ok``), and then how far its A is from the trace's (``err``, NaN where not ok)."""

    ok: np.ndarray  # (n, h) bool
    err: np.ndarray  # (n, h) float


def check_scores(Qc, Kc, Q, K, st: dict, al: np.ndarray, scale, mods: dict, tol: float) -> Scores:
    """What the page computes from ``Qc``, ``Kc`` (the travelling Q, K; ``Q``, ``K`` the
    trace's own), against the trace's S and A (``st``, stacked ``(n, h, T, ·)``) under the
    readable cells ``al`` ``(n, 1, T, T)``: within ``tol`` on A, ``tol``·max(1, |S|) on S."""
    n, H, T = st["A"].shape[:3]
    S, A = st["S"], st["A"]
    # What the page computes (in float64); float32 is as good a check for float32 or
    # float16 Q and K (its rounding, ~1e-7, is far below their tolerance), and faster.
    # A few heads at a time, so a 2048-token layer never holds more than a few T×T arrays.
    dt = np.float64 if Qc.dtype == np.float64 and Kc.dtype == np.float64 else np.float32
    e, es, smax = (np.zeros((n, H)) for _ in range(3))
    hstep = max(1, CHUNK_CELLS // max(1, n * T * T))
    for h0 in range(0, H, hstep):
        hs = slice(h0, h0 + hstep)
        pat = _score_pattern(mods, hs)
        with np.errstate(all="ignore"):
            S2 = (Qc[:, hs].astype(dt) @ np.swapaxes(Kc[:, hs].astype(dt), -1, -2)) * dt(scale)
            Z2 = S2 if pat is None else pat.modify_scores(S2)  # softcap, then ALiBi
            sinks = (
                None
                if mods["sinks"] is None
                else np.asarray(mods["sinks"][hs], np.float64)[:, None, None]
            )
            A2 = softmax_last(Z2, al, sinks=sinks)
            e[:, hs] = np.nan_to_num(np.abs(A2 - A[:, hs]), nan=np.inf).max(axis=(-2, -1))
            es[:, hs] = np.where(al, np.nan_to_num(np.abs(S2 - S[:, hs]), nan=np.inf), 0).max(
                axis=(-2, -1)
            )
            smax[:, hs] = np.where(al, np.abs(S[:, hs]), 0).max(axis=(-2, -1))
        del S2, Z2, A2
    finite = np.isfinite(Q).all(axis=(-2, -1)) & np.isfinite(K).all(axis=(-2, -1))
    ok = finite & (e <= tol) & (es <= tol * np.maximum(1.0, smax))
    return Scores(ok, np.where(ok, e, np.nan))


def check_values(st: dict, al: np.ndarray) -> np.ndarray:
    """Per (layer, head): whether the trace's H is *not* A V (a recorded bug), ``(n, h)``."""
    A, V = st["A"], st["V"]
    n, H, T = A.shape[:3]
    notAV = np.zeros((n, H), bool)
    if "H" not in st:
        return notAV
    hstep = max(1, CHUNK_CELLS // max(1, n * T * T))
    for h0 in range(0, H, hstep):
        hs = slice(h0, h0 + hstep)
        with np.errstate(all="ignore"):
            AV = np.where(al, A[:, hs], 0.0) @ np.where(np.isfinite(V[:, hs]), V[:, hs], 0.0)
            notAV[:, hs] = ~np.isclose(
                AV, st["H"][:, hs], rtol=1e-6, atol=1e-9, equal_nan=True
            ).all(axis=(-2, -1))
    return notAV
