"""Stages Q, K, V (projections) and S (Q Kᵀ, its shape and its scale; the scale read back from A
when S is absent). Each check is a function of the audit state ``st``."""

from __future__ import annotations

import numpy as np

from .. import masks as _masks
from ..matrix_form import split_heads
from .numerics import BLOCKED_BELOW, _close, _locate, _looks_masked, _rtol
from .state import AuditState


def projections(st: AuditState) -> None:
    """Q, K, V against X W_Q, X W_K, X W_V (recomputed when absent); the T's agree."""
    a = st.arrays
    X = a.get("X")
    if st.n_heads is None and X is not None:
        for s in ("Q", "K", "V", "A", "S"):
            if s in a and a[s].ndim == X.ndim + 1:
                st.n_heads = a[s].shape[-3]
                break
    for s, w in (("Q", "W_q"), ("K", "W_k"), ("V", "W_v")):
        if X is None or w not in a:
            continue
        W = a[w]
        if W.shape[0] != X.shape[-1]:
            st.add(
                s,
                f"{s} = X {w}",
                False,
                f"X is T×d_model = {X.shape[-2]}×{X.shape[-1]} but {w} is "
                f"{W.shape[0]}×{W.shape[1]}; its rows must be d_model = {X.shape[-1]}",
            )
            continue
        if st.n_heads is not None and W.shape[1] % st.n_heads:
            st.add(
                s,
                f"{s} = X {w}",
                False,
                f"{w} has {W.shape[1]} columns, not divisible by {st.n_heads} heads",
            )
            continue
        ref = split_heads(X @ W, st.n_heads)
        if s not in a:
            st.recompute(s, ref, "X", w)
            continue
        if (
            st.n_heads is None
            and a[s].shape[:-1] == ref.shape[:-1]
            and ref.shape[-1] % a[s].shape[-1] == 0
            and ref.shape[-1] > a[s].shape[-1]
        ):
            # one head of a multi-head projection (Trace.select(b, h)): find which
            heads = split_heads(ref, ref.shape[-1] // a[s].shape[-1])
            tol = _rtol(st.eps[s], st.eps["X"], st.eps[w])
            hit = [j for j in range(heads.shape[-3]) if _close(a[s], heads[..., j, :, :], tol)[0]]
            st.add(
                s,
                f"{s} = X {w}",
                bool(hit),
                f"{s} is head {hit[0]} of X {w}"
                if hit
                else f"{s} ({a[s].shape}) is no head of X {w} ({ref.shape})",
            )
            continue
        if a[s].shape != ref.shape:
            st.add(
                s, f"{s} = X {w}", False, f"{s} has shape {a[s].shape} but X {w} gives {ref.shape}"
            )
            continue
        tol = _rtol(st.eps[s], st.eps["X"], st.eps[w])
        ok, e, bad = _close(a[s], ref, tol)
        lead = ref.ndim - 2
        st.add(
            s,
            f"{s} = X {w}",
            ok,
            f"max |{s} - X {w}| = {e:.3g}" + ("" if ok else " (too far off)"),
            None if ok else {**_locate(bad.any(-1), lead, False), "max_err": e},
            None
            if ok
            else f"{s} was not computed as X {w}; check which weight "
            "was used and whether a bias or a transpose slipped in",
        )
    # sequence lengths agree across Q, K, V, X
    Tk = {s: a[s].shape[-2] for s in ("K", "V") if s in a}
    if X is not None:
        Tk["X"] = X.shape[-2]
    if len(set(Tk.values())) > 1:
        stage = "X" if "X" in Tk else "V"
        st.add(
            stage,
            "sequence lengths agree",
            False,
            "T differs between " + ", ".join(f"{k}: {v}" for k, v in Tk.items()),
        )


def scores(st: AuditState) -> None:
    """S against Q Kᵀ·scale: its shape T_q×T_k, its scale (1/√d_k unless given)."""
    a = st.arrays
    if "S" in a and "Z" not in a and _looks_masked(a["S"]):
        a["Z"] = a.pop("S")
        st.eps["Z"] = st.eps.pop("S")
        st.given = ["Z" if g == "S" else g for g in st.given]
        st.notes.append("the given scores carry the mask already; read as Z = S + M")
    if "S" not in a and "Z" in a and ("Q" not in a or "K" not in a):
        return  # S (at readable entries) is taken from Z in the mask stage
    Q, K = a.get("Q"), a.get("K")
    if Q is None or K is None:
        if "S" in a:
            _square(st, "S", a["S"])
        return
    d_k = Q.shape[-1]
    c0 = st.inp.scale if st.inp.scale is not None else _masks.default_scale(d_k)
    if K.shape[-1] != d_k:
        st.add(
            "S",
            "Q Kᵀ shapes",
            False,
            f"Q is T×d_k = {Q.shape[-2]}×{d_k} but K is {K.shape[-2]}×{K.shape[-1]}; "
            "the inner d_k axes must match",
        )
        return
    try:
        G = Q @ np.swapaxes(K, -1, -2)
    except ValueError:
        st.add(
            "S", "Q Kᵀ shapes", False, f"Q {Q.shape} and K {K.shape}: leading axes do not broadcast"
        )
        return
    if "S" not in a:
        st.recompute("S", G * c0, "Q", "K")
        st.pending = (G, c0, d_k)  # read the scale back from A once the mask is known
        Z = a.get("Z")
        if Z is not None and Z.shape[-2:] == G.shape[-2:]:
            try:
                Z, G = np.broadcast_arrays(Z, G)
            except ValueError:
                return  # a Z that does not fit is stage M's to report
            _scale(st, Z, "Z", G, Q, K, c0)  # Z = S + M: its readable entries are S's
        return
    S = a["S"]
    if S.shape[-2:] != G.shape[-2:]:
        st.add(
            "S",
            "S is T×T",
            False,
            f"S is {S.shape[-2]}×{S.shape[-1]} but Q Kᵀ is {G.shape[-2]}×{G.shape[-1]} (T_q×T_k)",
            {"shape": S.shape},
        )
        return
    try:
        S, G = np.broadcast_arrays(S, G)
    except ValueError:
        st.add(
            "S",
            "S is T×T",
            False,
            f"S is {S.shape} but Q Kᵀ is {G.shape}: the batch/head axes do not match",
            {"shape": S.shape},
        )
        return
    st.add("S", "S is T×T", True, f"S is {S.shape[-2]}×{S.shape[-1]}")
    _scale(st, S, "S", G, Q, K, c0)


def _scale(st, S, src, G, Q, K, c0):
    """The scale check: S (or Z, ``src``) at its readable entries against Q Kᵀ·c0, G = Q Kᵀ
    broadcast to S's shape (..., T_q, T_k); a failure names the scale it finds instead."""
    d_k = Q.shape[-1]
    what = "S" if src == "S" else "S (Z's readable entries)"
    finite = np.isfinite(S) & (S > BLOCKED_BELOW)
    tol = _rtol(st.eps[src], st.eps["Q"], st.eps["K"])
    ok, e, bad = _close(S, G * c0, tol, finite)
    if ok:
        st.add(
            "S", "scale 1/√d_k", True, f"{what} = Q Kᵀ · {c0:.4g} (d_k = {d_k}); max error {e:.3g}"
        )
        return
    cands = [
        (1.0, "missing-scale", "the 1/√d_k scale is missing (S = Q Kᵀ)"),
        (1.0 / d_k, "scale-by-dk", f"S was divided by d_k = {d_k} instead of √d_k"),
    ]
    hint = fault = None
    for c, fid, text in cands:
        if abs(c - c0) > 1e-12 * c0 and _close(S, G * c, tol, finite)[0]:
            hint, fault = text, fid
            break
    if hint is None and K.shape[-2] == d_k:
        try:
            if _close(S, (Q @ K) * c0, tol, finite)[0] or _close(S, Q @ K, tol, finite)[0]:
                hint = "S = Q K, not Q Kᵀ: K was not transposed (shapes hid it: T = d_k)"
                fault = "k-not-transposed"
        except ValueError:
            pass
    if hint is None:
        g = G[finite]
        c = float(np.dot(S[finite], g) / max(np.dot(g, g), 1e-300))
        if _close(S, G * c, tol, finite)[0]:
            hint = f"S = Q Kᵀ · {c:.4g}, expected · {c0:.4g} (1/√d_k, d_k = {d_k})"
    st.add(
        "S",
        "scale 1/√d_k",
        False,
        f"{what} differs from Q Kᵀ/√d_k by up to {e:.3g}",
        {**_locate(bad, S.ndim - 2), "max_err": e},
        hint,
        fault,
    )


def _square(st, name, S):
    T_q, T_k = S.shape[-2:]
    ok = T_q <= T_k
    st.add(
        "S",
        f"{name} is T×T",
        ok,
        f"{name} is {T_q}×{T_k}",
        None if ok else {"shape": S.shape},
        None if ok else "more query rows than key columns: is it transposed?",
    )


def scale_from_weights(st, G, c0, d_k):
    """S is absent: read its scale back from A (log A_ij − log A_ik = S_ij − S_ik)."""
    A = st.arrays.get("A")
    if A is None or A.shape[-2:] != G.shape[-2:]:
        return
    with np.errstate(divide="ignore", invalid="ignore"):
        L = np.log(A)
    use = np.isfinite(L) & (A > 1e-30)
    if st.allowed is not None and st.allowed.shape == A.shape:
        use &= st.allowed
    Gb = np.broadcast_to(G, A.shape)
    n = use.sum(-1, keepdims=True)
    if (n >= 2).sum() < 2:
        return
    Lc = np.where(use, L - np.where(use, L, 0).sum(-1, keepdims=True) / np.maximum(n, 1), 0)
    Gc = np.where(use, Gb - np.where(use, Gb, 0).sum(-1, keepdims=True) / np.maximum(n, 1), 0)
    gg = float((Gc * Gc).sum())
    if gg < 1e-12:
        return
    c = float((Lc * Gc).sum() / gg)
    resid = float(np.abs(Lc - c * Gc).max())
    spread = float(np.abs(Lc).max())
    if resid > 1e-2 * max(1.0, spread):
        return  # A is not a softmax of any multiple of Q Kᵀ; the A checks will say why
    rel = abs(c / c0 - 1)
    ok = rel < 1e-3
    hint = fault = None
    if not ok:
        if abs(c - 1) < 1e-3:
            hint, fault = "the 1/√d_k scale is missing (softmax of Q Kᵀ)", "missing-scale"
        elif abs(c * d_k - 1) < 1e-3:
            hint, fault = f"S was divided by d_k = {d_k} instead of √d_k", "scale-by-dk"
        else:
            hint = f"A is the softmax of Q Kᵀ · {c:.4g}, expected · {c0:.4g}"
    st.add(
        "S",
        "scale 1/√d_k (read back from A)",
        ok,
        f"log A matches Q Kᵀ · {c:.4g}; expected · {c0:.4g}",
        None if ok else {"factor": c, "expected": c0},
        hint,
        fault,
    )
