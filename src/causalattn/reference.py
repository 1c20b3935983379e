"""The matrix form in float64 NumPy, every stage materialized: the truth other engines match.

    Q = X W_Q,  K = X W_K,  V = X W_V,  S = Q Kᵀ / √d_k,  Z = S + M,
    A = softmax_last(Z),  H = A V,  C[i, j] = A_ij v_j,  O = H W_O

Rows are queries, columns are keys. The mask is applied before the softmax; blocked
entries get exactly 0 weight whatever M's fill, and a row with no readable key is a
zero row (never NaN). Values at unreadable positions, even NaN or inf, never reach a
readable output.
"""

from __future__ import annotations

import numpy as np

from . import masks as _masks
from .trace import Trace

__all__ = ["trace", "softmax_last", "weighted_values"]

# C is T×T×d_v; past this many bytes it is left out of the Trace (explain() needs only A, V).
C_LIMIT_BYTES = 256 * 2**20


def _as_float(name: str, stage: str, a, min_ndim: int, exact_ndim: int | None = None) -> np.ndarray:
    try:
        arr = np.asarray(a)
    except Exception as exc:  # ragged lists and the like
        raise ValueError(f"{stage}: {name} is not an array ({exc})") from exc
    if arr.dtype == object or not (
        np.issubdtype(arr.dtype, np.number) or arr.dtype == np.bool_
    ) or np.issubdtype(arr.dtype, np.complexfloating):
        raise ValueError(f"{stage}: {name} must be a real numeric array, got dtype {arr.dtype}")
    if exact_ndim is not None and arr.ndim != exact_ndim:
        raise ValueError(f"{stage}: {name} must be 2-D, got shape {arr.shape}")
    if arr.ndim < min_ndim:
        raise ValueError(f"{stage}: {name} must have at least {min_ndim} axes, got shape {arr.shape}")
    return arr.astype(np.float64)


def softmax_last(Z: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    """Stable softmax over the last (key) axis, restricted to ``allowed`` entries.

    The row maximum is taken over readable entries only, so neither a finite fill nor a
    NaN at a blocked position can move it; blocked entries are set to exactly 0, and a
    row with no readable key gives a zero row.
    """
    allowed = np.broadcast_to(allowed, Z.shape)
    has_key = allowed.any(axis=-1, keepdims=True)
    Zr = np.where(allowed, Z, -np.inf)
    m = np.where(has_key, Zr.max(axis=-1, keepdims=True, initial=-np.inf), 0.0)
    with np.errstate(invalid="ignore", over="ignore"):
        E = np.where(allowed, np.exp(Zr - m), 0.0)
    denom = E.sum(axis=-1, keepdims=True)
    return np.where(has_key, E / np.where(has_key, denom, 1.0), 0.0)


def weighted_values(A: np.ndarray, V: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    """H = A V, computed so that a non-finite value at an unreadable key cannot leak.

    ``0 * NaN`` is NaN, so the plain product would let a future NaN poison every row.
    Non-finite value rows are zeroed for the product; the few query rows that really
    read one are recomputed entry by entry over their readable keys only.
    """
    finite = np.isfinite(V).all(axis=-1)  # (..., T_k)
    H = A @ np.where(finite[..., None], V, 0.0)
    if finite.all():
        return H
    allowed = np.broadcast_to(allowed, A.shape)
    reads_bad = (allowed & ~finite[..., None, :]).any(axis=-1)  # (..., T_q)
    for idx in zip(*np.nonzero(reads_bad)):
        lead, i = idx[:-1], idx[-1]
        cols = allowed[lead + (i,)]
        H[lead + (i,)] = A[lead + (i,)][cols] @ V[lead][cols]
    return H


def _check_heads(stage: str, name: str, width: int, n_heads: int) -> int:
    if width % n_heads:
        raise ValueError(
            f"{stage}: {name} has {width} columns, not divisible by n_heads={n_heads} "
            f"(it must be d_model×(h·d))"
        )
    return width // n_heads


def _split_heads(Y: np.ndarray, n_heads: int | None) -> np.ndarray:
    """(..., T, h·d) -> (..., h, T, d); unchanged when n_heads is None."""
    if n_heads is None:
        return Y
    *lead, T, hd = Y.shape
    return np.moveaxis(Y.reshape(*lead, T, n_heads, hd // n_heads), -2, -3)


def trace(
    X,
    W_q,
    W_k,
    W_v,
    W_o=None,
    *,
    mask=None,
    scale: float | None = None,
    n_heads: int | None = None,
    fill: str = "-inf",
    tokens: list[str] | None = None,
) -> Trace:
    """Run causal self-attention in float64 with every stage kept.

    X: ``(..., T, d_model)``; W_q, W_k: ``d_model×(h·d_k)``; W_v: ``d_model×(h·d_v)``;
    W_o: ``(h·d_v)×d_model'``. ``mask`` is the boolean mask (True = may read),
    broadcastable to ``(..., T, T)``; default :func:`causalattn.masks.causal`.
    ``scale`` defaults to 1/√d_k. ``n_heads`` splits the projections into heads; each
    head's stages then carry a head axis before T. ``fill`` chooses M's blocked value
    ('-inf' or 'finite'); weights are the same either way.
    """
    X = _as_float("X", "projections", X, min_ndim=2)
    W = {
        n: _as_float(n, "projections", w, 2, exact_ndim=2)
        for n, w in (("W_q", W_q), ("W_k", W_k), ("W_v", W_v))
    }
    T, d_model = X.shape[-2:]
    if T == 0:
        raise ValueError(f"projections: X is {T}×{d_model}; a sequence needs T >= 1 token")
    for n, w in W.items():
        if w.shape[0] != d_model:
            raise ValueError(
                f"projections: X is T×d_model = {T}×{d_model} but {n} is "
                f"{w.shape[0]}×{w.shape[1]}; its rows must be d_model = {d_model}"
            )
    if W["W_q"].shape[1] != W["W_k"].shape[1]:
        raise ValueError(
            f"scores: W_q gives d_k = {W['W_q'].shape[1]} but W_k gives {W['W_k'].shape[1]}; "
            "Q Kᵀ contracts the inner d_k axes, which must match"
        )
    if n_heads is not None:
        if isinstance(n_heads, bool) or not isinstance(n_heads, (int, np.integer)) or n_heads < 1:
            raise ValueError(f"projections: n_heads must be a positive integer, got {n_heads!r}")
        d_k = _check_heads("projections", "W_q", W["W_q"].shape[1], n_heads)
        _check_heads("projections", "W_v", W["W_v"].shape[1], n_heads)
    else:
        d_k = W["W_q"].shape[1]

    with np.errstate(invalid="ignore", over="ignore"):  # NaN/inf at unreadable positions is allowed
        Q = _split_heads(X @ W["W_q"], n_heads)
        K = _split_heads(X @ W["W_k"], n_heads)
        V = _split_heads(X @ W["W_v"], n_heads)

    if scale is None:
        scale = 1.0 / np.sqrt(d_k)
    with np.errstate(invalid="ignore", over="ignore"):
        S = (Q @ np.swapaxes(K, -1, -2)) * scale

    if mask is None:
        allowed = _masks.causal(T)
    else:
        allowed = np.asarray(mask)
        if allowed.dtype != np.bool_:
            raise ValueError(f"mask: must be boolean (True = may read), got dtype {allowed.dtype}")
        if allowed.ndim < 2 or allowed.shape[-2:] != (T, T):
            raise ValueError(f"mask: must end in T×T = {T}×{T}, got shape {allowed.shape}")
        if n_heads is not None and allowed.ndim == X.ndim:
            allowed = np.expand_dims(allowed, -3)  # (..., T, T) -> (..., 1, T, T) over heads
        elif n_heads is not None and allowed.ndim not in (2, X.ndim + 1):
            # a (B, T, T) mask with a single T×d_model X would silently be read per head
            raise ValueError(
                f"mask: with n_heads={n_heads} and X of shape {X.shape}, give T×T, X's leading "
                f"axes + T×T, or X's leading axes + (h, T, T); got shape {allowed.shape}"
            )
    try:
        np.broadcast_shapes(allowed.shape, S.shape)
    except ValueError as exc:
        raise ValueError(f"mask: shape {allowed.shape} does not broadcast to S {S.shape}") from exc

    M = np.broadcast_to(_masks.additive(allowed, fill=fill), S.shape)
    with np.errstate(invalid="ignore"):
        Z = S + M
    A = softmax_last(Z, allowed)
    H = weighted_values(A, V, allowed)

    arrays = {"X": X, **W, "Q": Q, "K": K, "V": V, "S": S, "M": M, "Z": Z, "A": A, "H": H}
    if A.size * V.shape[-1] * 8 <= C_LIMIT_BYTES:
        al = np.broadcast_to(allowed, A.shape)[..., None]
        with np.errstate(invalid="ignore"):
            arrays["C"] = np.where(al, A[..., None] * V[..., None, :, :], 0.0)
    if W_o is not None:
        Wo = _as_float("W_o", "output projection", W_o, 2, exact_ndim=2)
        H_cat = H if n_heads is None else np.moveaxis(H, -3, -2).reshape(*H.shape[:-3], T, -1)
        if Wo.shape[0] != H_cat.shape[-1]:
            raise ValueError(
                f"output projection: H is T×(h·d_v) = {T}×{H_cat.shape[-1]} but W_o is "
                f"{Wo.shape[0]}×{Wo.shape[1]}; its rows must be h·d_v = {H_cat.shape[-1]}"
            )
        arrays["W_o"] = Wo
        arrays["O"] = H_cat @ Wo
    return Trace(arrays, allowed=allowed, scale=float(scale), n_heads=n_heads, tokens=tokens)
