"""Stage A: rows sum to 1, blocked entries are exactly 0, rows are finite, empty rows are zero, and
A = softmax(S + M) (modifiers and sinks as declared)."""

from __future__ import annotations

import numpy as np

from .. import masks as _masks
from ..matrix_form import softmax_last
from .numerics import (
    _MAX_LIST,
    _close,
    _locate,
    _rtol,
)
from .stage_mask import softmax_expected
from .state import AuditState
from .words import counted


def weights(st: AuditState) -> None:
    """A over ``st.allowed``: rows sum to 1, blocked entries are 0, readable rows finite,
    empty rows zero, and A = softmax(S + M) when S is known."""
    a = st.arrays
    allowed = st.allowed
    if "A" not in a:
        if "S" in a and allowed is not None:
            with np.errstate(invalid="ignore"):
                st.recompute("A", softmax_expected(st, allowed), "S")
        return
    A = a["A"]
    if "S" in a and a["S"].shape[-2:] != A.shape[-2:]:
        st.add(
            "A",
            "A has S's shape",
            False,
            f"A is {A.shape[-2]}×{A.shape[-1]} but S (Q Kᵀ) is "
            f"{a['S'].shape[-2]}×{a['S'].shape[-1]} (T_q×T_k)",
            {"shape": A.shape},
            "A must be T_q×T_k like the scores: was it transposed or sliced?",
        )
        return
    if allowed is None:
        T_q, T_k = A.shape[-2:]
        if T_q > T_k:
            st.add("A", "A is T×T", False, f"A is {T_q}×{T_k}: more query rows than keys")
            return
        allowed = np.broadcast_to(_masks.causal(T_q, T_k), A.shape)
    if allowed.shape != A.shape:
        st.add(
            "A",
            "A matches the mask's shape",
            False,
            f"A is {A.shape} but the mask/scores are {allowed.shape}",
        )
        return
    lead = A.ndim - 2
    tol = _rtol(st.eps["A"])
    has_key = allowed.any(-1)
    finite_row = np.isfinite(A).all(-1)
    # rows with no readable key: listed, and they must be zero (never NaN)
    for idx in np.ndindex(*A.shape[:-2]) if lead else [()]:
        rows = np.flatnonzero(~has_key[idx])
        if rows.size:
            st.empty_rows.append({"index": list(idx), "rows": rows.tolist()})
    sums = np.where(allowed, A, 0.0).sum(-1)
    sinks = "sinks" in st.inp.pattern  # rows sum to less than 1: the sink takes the rest
    row_bad = has_key & finite_row & ((sums > 1 + tol) if sinks else (np.abs(sums - 1) > tol))
    if row_bad.any():
        fault, hint = _softmax_hint(st, A, allowed, has_key, tol)
        st.add(
            "A",
            "rows sum to 1",
            False,
            counted(
                row_bad.sum(),
                "readable row does not sum to 1 over its readable columns",
                "readable rows do not sum to 1 over their readable columns",
            )
            + f" (e.g. {float(sums[row_bad][0]):.4g})",
            {
                **_locate(row_bad, lead, False),
                "row_sums": np.round(sums[np.nonzero(row_bad)][:_MAX_LIST], 4).tolist(),
            },
            hint,
            fault,
        )
    else:
        st.add("A", "rows sum to 1", True, "every readable row sums to 1 over its readable columns")
    forb = ~allowed & has_key[..., None] & (A != 0)
    st.add(
        "A",
        "forbidden entries exactly 0",
        not forb.any(),
        "blocked entries have exactly zero weight"
        if not forb.any()
        else f"{counted(forb.sum(), 'blocked entry has', 'blocked entries have')} nonzero weight "
        f"(max {float(np.abs(np.where(forb & np.isfinite(A), A, 0)).max()):.3g})",
        _locate(forb, lead),
        None
        if not forb.any()
        else "the mask must be applied before the softmax, with "
        "-inf (or a fill whose weight comes out exactly 0)",
    )
    nonfinite = has_key & ~finite_row
    hint = fault = None
    if nonfinite.any():
        S = a.get("S")
        if S is not None and np.abs(np.where(allowed & np.isfinite(S), S, 0)).max() > 80:
            hint = (
                "scores this large overflow exp(): subtract the row maximum before "
                "exponentiating (stable softmax)"
            )
            fault = "unstable-softmax"
        else:
            hint = "NaN/inf weights in rows that can read a key"
    st.add(
        "A",
        "readable rows finite",
        not nonfinite.any(),
        "every readable row is finite"
        if not nonfinite.any()
        else f"{counted(nonfinite.sum(), 'readable row holds', 'readable rows hold')} NaN or inf",
        _locate(nonfinite, lead, False),
        hint,
        fault,
    )
    if (~has_key).any():
        empty_bad = ~has_key & (~np.isfinite(A).all(-1) | (A != 0).any(-1))
        st.add(
            "A",
            "rows with no readable key are zero",
            not empty_bad.any(),
            "rows with no readable key have zero weight"
            if not empty_bad.any()
            else f"{int(empty_bad.sum())} rows with no readable key are not zero"
            + (" (NaN)" if np.isnan(A[empty_bad]).any() else ""),
            _locate(empty_bad, lead, False),
            None
            if not empty_bad.any()
            else "a row whose keys are all blocked must give zero weights; -inf on every "
            "entry makes softmax NaN (0/0), a finite fill spreads weight over "
            "forbidden keys",
            "nan-on-empty-rows",
        )
    if "S" in a and not st.failures_in("A"):
        with np.errstate(invalid="ignore"):
            ref = softmax_expected(st, allowed)
        ok, e, bad = _close(
            A, ref, _rtol(st.eps["A"], st.eps.get("S", 0)), has_key[..., None] & allowed
        )
        st.add(
            "A",
            "A = softmax_last(S + M)",
            ok,
            f"max |A - softmax(S + M)| = {e:.3g}",
            None if ok else {**_locate(bad, lead), "max_err": e},
            None
            if ok
            else "A is a distribution per row but not the softmax of these "
            "scores: check the scale and which scores were used",
        )


def _softmax_hint(st, A, allowed, has_key, tol) -> tuple[str | None, str]:
    """(catalogue id or None, hint) for rows that do not sum to 1."""
    Af = np.where(np.isfinite(A), A, 0.0)
    col = Af.sum(-2)
    any_read = allowed.any(-2)
    if any_read.any() and np.all(np.abs(col[any_read] - 1) <= tol * 4):
        return "softmax-query-axis", (
            "columns sum to 1, rows do not: softmax ran over the query axis"
        )
    tot = Af.sum(axis=(-1, -2))
    if np.all(np.abs(tot - 1) <= tol * 4):
        return "softmax-all-entries", (
            "the whole matrix sums to 1: softmax ran over all entries at once"
        )
    sums = np.where(allowed, Af, 0).sum(-1)
    if np.all(sums[has_key] <= 1 + tol) and not (~allowed & (Af != 0)).any():
        S = st.arrays.get("S")
        if S is not None:
            with np.errstate(invalid="ignore", over="ignore"):
                full = softmax_last(np.broadcast_to(S, A.shape), np.ones(A.shape, bool))
            if _close(A, np.where(allowed, full, 0), _rtol(st.eps["A"]) * 4, allowed)[0]:
                return "mask-after-softmax", (
                    "mask applied after softmax without renormalizing: rows sum to "
                    "less than 1 (the forbidden weight was dropped, not redistributed)"
                )
        return "mask-after-softmax", (
            "rows sum to less than 1 with zeros in the right place: the mask was "
            "likely applied after the softmax without renormalizing"
        )
    return None, "rows are not normalized over the key axis"
