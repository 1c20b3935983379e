"""Stages H (= A V), C (Σ_j C[i, j] = H_i) and O (= H W_O)."""

from __future__ import annotations

import numpy as np

from ..matrix_form import merge_heads, split_heads, weighted_values
from .numerics import _close, _locate, _rtol
from .state import AuditState


def values(st: AuditState) -> None:
    """H = A V (heads split when H is concatenated); empty rows give zero output."""
    a = st.arrays
    allowed = st.allowed
    A, V = a.get("A"), a.get("V")
    if "H" in a and A is not None and V is not None and a["H"].ndim == A.ndim - 1 and st.n_heads:
        a["H"] = split_heads(a["H"], A.shape[-3])  # concatenated heads (..., T, h·d_v)
    if A is None or V is None:
        return
    if allowed is None or allowed.shape != A.shape:
        allowed = np.ones(A.shape, bool)
    try:
        lead = np.broadcast_shapes(A.shape[:-2], V.shape[:-2])
        Hr = weighted_values(
            np.broadcast_to(A, lead + A.shape[-2:]),
            np.broadcast_to(V, lead + V.shape[-2:]),
            np.broadcast_to(allowed, lead + A.shape[-2:]),
        )
    except ValueError:
        st.add(
            "H",
            "H = A V shapes",
            False,
            f"A is {A.shape} but V is {V.shape}; A's key axis must match V's T",
        )
        return
    if "H" not in a:
        st.recompute("H", Hr, "A", "V")
        return
    H = a["H"]
    if H.shape != Hr.shape:
        st.add("H", "H = A V", False, f"H has shape {H.shape} but A V is {Hr.shape}")
        return
    has_key = allowed.any(-1)
    ok, e, bad = _close(
        H, Hr, _rtol(st.eps["H"], st.eps["A"], st.eps.get("V", 0)), has_key[..., None]
    )
    st.add(
        "H",
        "H = A V",
        ok,
        f"max |H - A V| = {e:.3g}",
        None if ok else {**_locate(bad.any(-1), H.ndim - 2, False), "max_err": e},
        None if ok else "H is not A V for these weights and values",
    )
    if (~has_key).any():
        zb = ~has_key & ~(H == 0).all(-1)
        st.add(
            "H",
            "rows with no readable key are zero",
            not zb.any(),
            "zero output on rows with no readable key"
            if not zb.any()
            else f"{int(zb.sum())} rows with no readable key are not zero",
            _locate(zb, H.ndim - 2, False),
            None if not zb.any() else "a padding query must output zeros, never NaN",
        )


def contributions(st: AuditState) -> None:
    """Σ_j C[i, j] = H_i."""
    a = st.arrays
    if "C" not in a or "H" not in a:
        return
    C, H = a["C"], a["H"]
    if C.shape[:-2] != H.shape[:-1] or C.shape[-1] != H.shape[-1]:
        st.add(
            "C",
            "Σ_j C[i, j] = H_i",
            False,
            f"C is {C.shape} but H is {H.shape} (C must be T×T×d_v)",
        )
        return
    ok, e, bad = _close(C.sum(-2), H, _rtol(st.eps["C"], st.eps["H"]))
    st.add(
        "C",
        "Σ_j C[i, j] = H_i",
        ok,
        f"max |Σ_j C[i, j] - H_i| = {e:.3g}",
        None if ok else {**_locate(bad.any(-1), H.ndim - 2, False), "max_err": e},
        None if ok else "the contributions do not add up to the output",
    )


def output(st: AuditState) -> None:
    """O = H W_O (H's heads merged)."""
    a = st.arrays
    if "O" not in a or "H" not in a:
        return
    H, O = a["H"], a["O"]
    Hc = (
        merge_heads(H)
        if (st.n_heads and H.ndim >= 3 and H.shape[-3] == st.n_heads and H.ndim == O.ndim + 1)
        else H
    )
    if "W_o" not in a:
        return
    W = a["W_o"]
    tol = _rtol(st.eps["O"], st.eps["H"], st.eps["W_o"])
    if Hc.shape[-1] != W.shape[0]:
        st.add(
            "O",
            "O = H W_O",
            False,
            f"H is T×(h·d_v) = {Hc.shape[-2]}×{Hc.shape[-1]} but W_O is {W.shape[0]}×{W.shape[1]}",
        )
        return
    ref = Hc @ W
    if O.shape != ref.shape:
        missing = O.shape == Hc.shape
        st.add(
            "O",
            "O = H W_O",
            False,
            f"O has shape {O.shape} but H W_O is {ref.shape}",
            {"shape": O.shape},
            "O has H's shape: the output projection is missing" if missing else None,
            "output-projection-missing" if missing else None,
        )
        return
    ok, e, bad = _close(O, ref, tol)
    hint = fault = None
    if not ok:
        if W.shape[0] == W.shape[1] and _close(O, Hc @ W.T, tol)[0]:
            hint = "O = H W_Oᵀ: the output projection is transposed"
            fault = "output-projection-transposed"
        elif O.shape == Hc.shape and _close(O, Hc, tol)[0]:
            hint, fault = "O = H: the output projection is missing", "output-projection-missing"
    st.add(
        "O",
        "O = H W_O",
        ok,
        f"max |O - H W_O| = {e:.3g}",
        None if ok else {**_locate(bad.any(-1), O.ndim - 2, False), "max_err": e},
        hint,
        fault,
    )
