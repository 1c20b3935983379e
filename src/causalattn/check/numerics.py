"""Tolerances, comparisons and evidence shared by the stage checks (the head reshapes are
:func:`causalattn.matrix_form.split_heads` / ``merge_heads``)."""

from __future__ import annotations

import numpy as np

from .. import masks as _masks
from .conventions import BLOCKED_BELOW  # the one reader of masks defines the blocking fill

_MAX_LIST = 8  # rows/cols shown as evidence


def _rtol(*eps: float) -> float:
    return float(min(0.03, max(1e-9, 100 * max(eps, default=0.0))))


def _diff(got: np.ndarray, want: np.ndarray, where: np.ndarray | None = None):
    """(max abs error, magnitude, error map) over ``where``; NaN on either side counts."""
    with np.errstate(invalid="ignore"):
        err = np.abs(got - want)
    bad_nan = np.isnan(got) != np.isnan(want)
    err = np.where(np.isnan(err), np.where(bad_nan, np.inf, 0.0), err)
    if where is not None:
        err = np.where(where, err, 0.0)
    mag = np.abs(np.where(np.isfinite(want), want, 0.0)).max() if want.size else 0.0
    return float(err.max()) if err.size else 0.0, max(1.0, float(mag)), err


def _close(got, want, tol_rel, where=None) -> tuple[bool, float, np.ndarray]:
    e, mag, err = _diff(got, want, where)
    return e <= tol_rel * mag, e, err > tol_rel * mag


def _locate(bad: np.ndarray, lead_ndim: int, with_cols: bool = True) -> dict:
    """Evidence for a boolean map of failures (..., rows[, cols])."""
    idx = np.argwhere(bad)
    if not idx.size:
        return {}
    first = tuple(int(i) for i in idx[0][:lead_ndim])
    sel = idx[(idx[:, :lead_ndim] == first).all(axis=1)] if lead_ndim else idx
    ev: dict = {}
    if lead_ndim:
        ev["index"] = first
        n_slices = len({tuple(r[:lead_ndim]) for r in idx.tolist()})
        if n_slices > 1:
            ev["slices_failing"] = n_slices
    ev["rows"] = sorted({int(r) for r in sel[:, lead_ndim]})[:_MAX_LIST]
    if with_cols and sel.shape[1] > lead_ndim + 1:
        ev["cols"] = sorted({int(c) for c in sel[:, lead_ndim + 1]})[:_MAX_LIST]
    return ev


def _looks_masked(S: np.ndarray) -> bool:
    """True when S already carries a mask (-inf or a large negative fill above the diagonal)."""
    T_q, T_k = S.shape[-2:]
    fut = ~_masks.causal(T_q, T_k) if T_q <= T_k else np.zeros((T_q, T_k), bool)
    return bool(fut.any()) and bool((np.isneginf(S) | (S <= BLOCKED_BELOW))[..., fut].all())
