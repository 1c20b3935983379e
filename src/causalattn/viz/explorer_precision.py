"""The explorer's second step: the precision each array travels at.

The page aims at a file size (``max_bytes``). Its yardstick is the Q/K/V form: while those
numbers fit in float64 (base64, 4/3 of their bytes), everything travels as float64; else
float32; else float16, with V cut to its first :data:`V_SHOWN` components (the side panel
shows no more) beside its exact norms. An array never travels wider than it is, and a
float16 that would overflow travels as float32. What the page recomputes from the cast Q
and K must stay within :func:`tolerance` of the trace's A (the verify step measures it).
"""

from __future__ import annotations

import numpy as np

from .explorer_read import Seq

__all__ = ["V_SHOWN", "DTYPE", "page_precision", "cast", "narrower", "tolerance", "qk_at", "v_at"]

V_SHOWN = 4  # float16 pages keep v_j's first components (the side panel shows 3, then "…")
DTYPE = {"f8": "<f8", "f4": "<f4", "f2": "<f2"}
_TOL = {"f8": 1e-9, "f4": 2e-5, "f2": 2e-2}  # largest |A_page - A_trace| accepted per precision


def _elements(seqs: list[Seq]) -> int:
    """Numbers per page in the Q/K/V form (the budget's yardstick)."""
    n = 0
    for s in seqs:
        for lay in s.layers:
            tr = lay.trace
            H = tr.n_heads or 1
            T = lay.kinds.shape[0]
            d_k = tr["Q"].shape[-1] if "Q" in tr else T
            n += H * T * (2 * d_k + tr["V"].shape[-1])
    return n


def page_precision(seqs: list[Seq], max_bytes: int) -> str:
    """The widest precision whose matrices, in base64 (4/3), fit in ``max_bytes``."""
    n = _elements(seqs) * 4 / 3
    return "f8" if 8 * n <= max_bytes else "f4" if 4 * n <= max_bytes else "f2"


def _src_prec(a: np.ndarray) -> str:
    return "f8" if a.dtype == np.float64 else "f4" if a.dtype.itemsize >= 4 else "f2"


def narrower(p: str, q: str) -> str:
    return p if "f8f4f2".index(p) > "f8f4f2".index(q) else q


def cast(a: np.ndarray, prec: str) -> tuple[np.ndarray, str]:
    """``a`` at precision ``prec`` (never wider than its own), float32 if float16 overflows."""
    p = narrower(prec, _src_prec(a))
    c = a.astype(DTYPE[p])
    if p == "f2" and not np.isfinite(c[np.isfinite(a)]).all():
        p, c = "f4", a.astype("<f4")
    return c, p


def tolerance(pq: str, pk: str) -> float:
    """The largest |A_page - A_trace| accepted for Q and K at precisions ``pq``, ``pk``."""
    return _TOL[narrower(pq, pk)]


def qk_at(Q: np.ndarray, K: np.ndarray, prec: str, from_weights: bool):
    """Q and K as they travel: ``(Qc, pq, Kc, pk)``. From shared weights (the page computes
    Q, K = X W itself) the page works in float64, whatever the page's precision."""
    qprec = "f8" if from_weights else prec
    Qc, pq = cast(Q, qprec)
    Kc, pk = cast(K, qprec)
    return Qc, pq, Kc, pk


def v_at(V: np.ndarray, prec: str) -> tuple[np.ndarray, str, bool]:
    """V as it travels, ``(Vc, pv, cut)``: on a float16 page, its first :data:`V_SHOWN`
    components only (``cut``; the page gets its exact norms beside them)."""
    cut = prec == "f2" and V.shape[-1] > V_SHOWN
    Vc, pv = cast(V[..., :V_SHOWN] if cut else V, prec)
    return Vc, pv, cut
