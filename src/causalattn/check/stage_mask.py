"""Stage M: the declared pattern (causalattn.masks.Pattern) against the given mask, M, Z or the keys
A reads; padding inferred only when unambiguous."""

from __future__ import annotations

import numpy as np

from .. import masks as _masks
from ..matrix_form import softmax_last
from . import faults
from .conventions import additive_allowed
from .numerics import BLOCKED_BELOW, _locate
from .report import AuditInputError
from .state import AuditState
from .words import describe_difference


def mask(st: AuditState) -> None:
    """M: the given mask, M or Z agree with each other and with the declared pattern;
    with none of them, the keys A reads. Sets ``st.allowed`` (..., T_q, T_k), True = may read."""
    a = st.arrays
    shape = None
    for s in ("S", "Z", "M", "A"):
        if s in a:
            shape = a[s].shape
            break
    if shape is None:
        if "Q" in a and "K" in a:
            shape = np.broadcast_shapes(a["Q"].shape[:-2], a["K"].shape[:-2]) + (
                a["Q"].shape[-2],
                a["K"].shape[-2],
            )
        else:
            return
    T_q, T_k = shape[-2:]
    if T_q > T_k:
        _more_queries_than_keys(st, shape)
        return
    lead = shape[:-2]
    sources: list[tuple[str, np.ndarray]] = []
    if st.inp.allowed is not None:
        sources.append(("declared mask", _bcast(st, st.inp.allowed, shape, "mask")))
    if "M" in a:
        M = _bcast(st, a["M"], shape, "M")
        R_M, odd = additive_allowed(M)
        if odd.any():
            st.add(
                "M",
                "M is 0 or blocked",
                False,
                "M has entries that are neither 0 nor -inf (or a large negative fill)",
                _locate(odd, len(lead)),
                "M must be 0 where a key may be read and -inf (or a large negative "
                "fill) where it may not; a bias belongs in S",
            )
        sources.append(("M", R_M))
    if "Z" in a:
        Z = _bcast(st, a["Z"], shape, "Z")
        sources.append(("Z", np.isfinite(Z) & (Z > BLOCKED_BELOW)))
        if "S" not in a:
            st.recompute("S", np.where(sources[-1][1], Z, 0.0), "Z")
    if not sources and "A" in a and a["A"].shape == shape:
        _pattern_from_weights(st, a["A"], shape)
        return
    if not sources:
        st.allowed = declared_allowed(st, shape)
        st.recomputed.append("M")
        return
    name0, allowed = sources[0]
    for name, other in sources[1:]:
        same = allowed == other
        st.add(
            "M",
            f"{name} agrees with {name0}",
            same.all(),
            f"{name} and {name0} " + ("agree" if same.all() else "disagree"),
            _locate(~same, len(lead)),
        )
    st.allowed = allowed
    if name0 != "M" and "M" not in a:
        st.recomputed.append("M")
    _structure(st, allowed, name0)


def _more_queries_than_keys(st: AuditState, shape) -> None:
    """T_q > T_k: no causal mask has more query rows than keys, so stage M reads none. A given
    mask, M or Z must still fit the stages' shape (else AuditInputError, as with T_q <= T_k),
    and is a failing check naming its shape, and A's where A's T_q×T_k differs (stage A then
    checks A against the plain causal mask of its own shape)."""
    a = st.arrays
    given = []
    if st.inp.allowed is not None:
        _bcast(st, st.inp.allowed, shape, "mask")
        given.append("the declared mask")
    for s in ("M", "Z"):
        if s in a:
            _bcast(st, a[s], shape, s)
            given.append(s)
    if not given:
        return
    T_q, T_k = shape[-2:]
    msg = f"{' and '.join(given)} {'is' if len(given) == 1 else 'are'} {T_q}×{T_k}"
    if "A" in a and a["A"].shape[-2:] != shape[-2:]:
        msg += f" (more query rows than keys) but A is {a['A'].shape[-2]}×{a['A'].shape[-1]}"
    else:
        msg += ": more query rows than keys"
    st.add(
        "M",
        "mask is T×T",
        False,
        msg,
        {"shape": shape},
        "more query rows than key columns: is it transposed?",
    )


def pattern_kw(st, padding: bool = True) -> dict:
    kw = dict(st.inp.pattern)
    if st.inp.lengths is not None and "lengths" not in kw:
        kw["lengths"] = st.inp.lengths
    if st.inp.key_padding is not None and "key_padding_mask" not in kw:
        kw["key_padding_mask"] = st.inp.key_padding
    if not padding:
        kw.pop("lengths", None)
        kw.pop("key_padding_mask", None)
    return kw


def _padding_declared(st) -> bool:
    kw = pattern_kw(st)
    return "lengths" in kw or "key_padding_mask" in kw


def declared_allowed(st, shape, padding: bool = True) -> np.ndarray:
    """The declared pattern (default plain causal; padding from the inputs) broadcast to
    the stages' shape (..., T_q, T_k): leading axes are (B, H), (B,) or (H,)."""
    kw = pattern_kw(st, padding)
    lead, (T_q, T_k) = shape[:-2], shape[-2:]
    try:
        pat = _masks.Pattern(**kw)
        batchy = pat.per_batch
        if not lead:
            allowed = pat.allowed(1, 1, T_q, T_k)[0, 0]
        elif len(lead) == 1:
            heads = st.n_heads is not None and lead[0] == st.n_heads and not batchy
            allowed = (
                pat.allowed(1, lead[0], T_q, T_k)[0]
                if heads
                else pat.allowed(lead[0], 1, T_q, T_k)[:, 0]
            )
        else:
            allowed = pat.allowed(lead[-2], lead[-1], T_q, T_k)
        return np.broadcast_to(allowed, shape)
    except ValueError as exc:
        raise AuditInputError(
            f"mask: the declared pattern does not fit the stages {shape}: {exc}"
        ) from None


def _fit_lead(st, allowed):
    # a (B, T, T) mask with a head axis in the stages: insert it
    if st.n_heads is not None and allowed.ndim == 3:
        allowed = allowed[:, None]
    return allowed


def _bcast(st, m, shape, name):
    m = np.asarray(m)
    for cand in (m, _fit_lead(st, m)):  # as given, or a (B, T, T) mask missing its head axis
        try:
            return np.broadcast_to(cand, shape)
        except ValueError:
            pass
    raise AuditInputError(f"{name}: shape {m.shape} does not broadcast to {shape}")


def _pattern_from_weights(st, A, shape):
    """No mask given: compare the keys A reads (nonzero weights) with the declared
    pattern. Padding is inferred only when unambiguous — keys from L on read by no query
    and query rows from L on reading nothing, L >= 1 — and the audit notes it. Rows
    that read nothing are left to stage A (they must sum to 1 unless the pattern
    leaves them empty)."""
    lead = shape[:-2]
    T_q, T_k = shape[-2:]
    off = T_k - T_q
    E = declared_allowed(st, shape).copy()
    P = (A != 0) & ~np.isnan(A).all(-1, keepdims=True)
    if "S" in st.arrays:  # a weight that underflowed to 0 is not a blocked key
        with np.errstate(all="ignore"):
            ref = softmax_last(np.where(E, modified_scores(st, shape), 0.0), E)
        P |= E & (A == 0) & (ref < 1e-30)
    inferred = []
    if not _padding_declared(st):
        for idx in np.ndindex(*lead) if lead else [()]:
            keys = P[idx].any(-2)
            L = int(np.argmin(keys)) if not keys.all() else T_k
            pos = np.arange(T_q) + off
            if 1 <= L < T_k and not keys[L:].any() and not P[idx][pos >= L].any():
                kp = _masks.key_padding([L], T_k)[0]
                qp = _masks.query_padding([L], T_k)[0][off:]
                E[idx] &= kp[None, :] & qp[:, None]
                inferred.append((idx, L))
    if inferred:
        st.notes.append(
            "padding assumed from A (keys and query rows from L on read nothing): "
            + "; ".join(f"{list(i) if i else ''} L = {L}".strip() for i, L in inferred[:4])
            + (" ..." if len(inferred) > 4 else "")
            + "; declare lengths= to state it"
        )
    st.allowed = E
    st.recomputed.append("M")
    reads = P.any(-1, keepdims=True)
    Pc = np.where(reads, P, E)  # rows that read nothing: stage A says so
    bad = Pc != E
    declared = _masks.Pattern(**pattern_kw(st)).describe()
    if not bad.any():
        st.add(
            "M",
            "A reads what the pattern allows",
            True,
            f"the keys A reads match the declared pattern ({declared})",
        )
        return
    flat = int(np.flatnonzero(bad.reshape(-1, T_q * T_k).any(-1))[0])
    first = tuple(int(i) for i in np.unravel_index(flat, lead)) if lead else ()
    what = describe_difference(Pc[first], E[first], T_q, T_k)
    never = np.flatnonzero(~P[first].any(-2) & E[first].any(-2))
    msg = f"the keys A reads differ from the declared pattern ({declared}): {what}" + (
        f" (at index {list(first)})" if first else ""
    )
    fault, hint = _pattern_hint(st, Pc[first], E[first], T_q, T_k, reads[first])
    if never.size:
        hint += (
            f"; key{'s' if never.size > 1 else ''} "
            f"{', '.join(str(j + 1) for j in never[:6])} {'are' if never.size > 1 else 'is'}"
            " read by no query: if that is padding, declare key_padding_mask= or "
            "lengths="
        )
    st.add("M", "A reads what the pattern allows", False, msg, _locate(bad, len(lead)), hint, fault)


def _pattern_hint(st, P, E, T_q, T_k, reads) -> tuple[str | None, str]:
    """(catalogue id, its hint) when the read pattern is a catalogued fault; else (None,
    what differs)."""
    base = _masks.Pattern().allowed(1, 1, T_q, T_k)[0, 0]
    r = reads[:, 0]

    def same(X):
        return bool((P[r] == X[r]).all())

    fid = None
    if P[r].all():
        fid = "no-mask"
    elif T_q == T_k and same(base.T):
        fid = "anti-causal-mask"
    elif T_q == T_k and same(E & ~np.eye(T_q, dtype=bool)):
        fid = "diagonal-blocked"
    if fid is not None:
        f = faults.BY_ID[fid]
        return fid, f"{fid}: {f.description}; {f.hint}"
    if (P & ~E).any():
        return None, "A gives weight to keys the pattern blocks: the mask is too weak or wrong"
    return None, (
        "A leaves out keys the pattern allows: the mask is stricter than declared (a "
        "window or a padding rule nobody declared?)"
    )


def softmax_expected(st, allowed):
    """softmax_last(modified S + M) over ``allowed`` (..., T_q, T_k), the declared sinks in the
    denominator: what A must be."""
    Z = np.where(allowed, modified_scores(st, allowed.shape), 0.0)
    sinks = st.inp.pattern.get("sinks")
    if sinks is None:
        return softmax_last(Z, allowed)
    sk = np.asarray(sinks, np.float64)
    lead = allowed.shape[:-2]
    col = (
        np.broadcast_to(
            sk[:, None, None] if lead and lead[-1] == sk.size else sk[:1, None],
            allowed.shape[:-1] + (1,),
        )
        if lead
        else np.full(allowed.shape[:-1] + (1,), float(sk[0]))
    )
    has = allowed.any(-1, keepdims=True)
    A = softmax_last(np.concatenate([Z, col], -1), np.concatenate([allowed, has], -1))
    return A[..., :-1]


def modified_scores(st, shape):
    """S broadcast to ``shape``, with the declared softcap, ALiBi, biases and score_mod."""
    S = np.broadcast_to(st.arrays["S"], shape)
    mods = ("softcap", "alibi_slopes", "rel_bias", "bias", "score_mod")
    pat = _masks.Pattern(**{k: v for k, v in st.inp.pattern.items() if k in mods})
    if not pat.has_modifiers:
        return S
    lead = shape[:-2]
    S4 = (
        S.reshape((-1,) + (lead[-1:] if lead else (1,)) + shape[-2:])
        if lead
        else S.reshape((1, 1) + shape[-2:])
    )
    return np.asarray(pat.modify_scores(S4)).reshape(shape)


def _structure(st, allowed, source):
    """Compare the mask with causal ∧ padding, padding read from the mask itself."""
    shape = allowed.shape
    T_q, T_k = shape[-2:]
    off = T_k - T_q
    lead = shape[:-2]
    base_all = declared_allowed(st, shape, padding=False)
    plain = bool(_masks.Pattern(**pattern_kw(st, False)).is_plain_causal)
    declared_pad = None
    if _padding_declared(st):
        declared_pad = ~declared_allowed(st, shape).any(-2)
    bad = np.zeros(shape, bool)
    kinds = set()
    padded = False
    for idx in np.ndindex(*lead) if lead else [()]:
        r = allowed[idx]
        causal = base_all[idx]
        pad = ~r.any(0) if declared_pad is None else declared_pad[idx]
        padded |= bool(pad.any())
        E = causal & ~pad[None, :]
        pad_query = pad[np.arange(T_q) + off]
        row_ok = (r == E).all(-1) | (pad_query & ((~r.any(-1)) | (r == (causal & ~pad)).all(-1)))
        # a padding query may also read the real keys before it (key-padding-only style)
        row_ok |= pad_query & ~(r & ~causal).any(-1) & ~(r & pad[None, :]).any(-1)
        wrong = (r != E) & ~row_ok[:, None]
        bad[idx] = wrong
        if wrong.any():
            if r.all():
                kinds.add("none")
            elif plain and T_q == T_k and (r == causal.T).all():  # causal.T is T_k×T_q
                kinds.add("anti")
            elif plain and T_q == T_k and (r == (causal & ~np.eye(T_q, dtype=bool))).all():
                kinds.add("diag")
            elif (r & ~causal).any():
                kinds.add("future")
            elif declared_pad is not None and (r & pad[None, :] & causal).any():
                kinds.add("padding")
            else:
                kinds.add("over")
    ok = not bad.any()
    described = _masks.Pattern(**pattern_kw(st, False)).describe()
    ids = {  # the catalogue id each kind is
        "none": "no-mask",
        "anti": "anti-causal-mask",
        "diag": "diagonal-blocked",
        "padding": "padding-ignored",
    }
    hints = {
        "none": "no causal mask: every query reads future keys (add M before the softmax)",
        "anti": "the mask is transposed (anti-causal): queries read j >= i instead of j <= i",
        "diag": "the diagonal is blocked (j < i): each token must be able to read itself",
        "future": "some queries read future keys (j > i): the causal mask is wrong",
        "padding": "padding keys are readable: the padding mask was not applied to keys",
        "over": "the mask blocks keys that should be readable (j <= i, not padding)",
    }
    order = ["none", "anti", "diag", "future", "padding", "over"]
    kind = next((k for k in order if k in kinds), None)
    st.add(
        "M",
        "mask is causal (+ padding)",
        ok,
        f"{source}: "
        + (
            (
                "0 on and below the diagonal, blocked above"
                if plain
                else f"as declared ({described})"
            )
            + (
                ", padding blocked"
                if declared_pad is not None
                else ", padding keys (read by no query) blocked"
                if padded
                else ""
            )
            if ok
            else "does not match causal ∧ padding"
        ),
        None if ok else _locate(bad, len(lead)),
        None if ok else hints[kind],
        None if ok else ids.get(kind),
    )
