"""The matrix form in float64 NumPy, every stage materialized: the truth other engines match.

    Q = X W_Q,  K = X W_K,  V = X W_V,  S = Q Kᵀ / √d_k,  Z = S + M,
    A = softmax_last(Z),  H = A V,  C[i, j] = A_ij v_j,  O = H W_O

Rows are queries, columns are keys. The mask is applied before the softmax; blocked
entries get exactly 0 weight whatever M's fill, and a row with no readable key is a
zero row (never NaN). Values at unreadable positions, even NaN or inf, never reach a
readable output.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np

from . import masks as _masks
from ._trace import Trace

if TYPE_CHECKING:
    from .arrays import ArrayLike

__all__ = ["trace", "stages", "softmax_last", "weighted_values"]

# C is T×T×d_v; past this many bytes it is left out of the Trace (explain() needs only A, V).
C_LIMIT_BYTES = 256 * 2**20


def _as_float(name: str, stage: str, a, min_ndim: int, exact_ndim: int | None = None) -> np.ndarray:
    try:
        arr = np.asarray(a)
    except Exception as exc:  # ragged lists and the like
        raise ValueError(f"{stage}: {name} is not an array ({exc})") from exc
    if (
        arr.dtype == object
        or not (np.issubdtype(arr.dtype, np.number) or arr.dtype == np.bool_)
        or np.issubdtype(arr.dtype, np.complexfloating)
    ):
        raise ValueError(f"{stage}: {name} must be a real numeric array, got dtype {arr.dtype}")
    if exact_ndim is not None and arr.ndim != exact_ndim:
        raise ValueError(f"{stage}: {name} must be 2-D, got shape {arr.shape}")
    if arr.ndim < min_ndim:
        raise ValueError(
            f"{stage}: {name} must have at least {min_ndim} axes, got shape {arr.shape}"
        )
    return arr.astype(np.float64)


def softmax_last(Z: np.ndarray, allowed: np.ndarray, sinks=None) -> np.ndarray:
    """Stable softmax over the last (key) axis, restricted to ``allowed`` entries.

    The row maximum is taken over readable entries only, so neither a finite fill nor a
    NaN at a blocked position can move it; blocked entries are set to exactly 0, and a
    row with no readable key gives a zero row. ``sinks``, broadcastable to Z's rows
    ``(..., T_q, 1)``, are logits that join each row's denominator and take no value.
    """
    allowed = np.broadcast_to(allowed, Z.shape)
    Zr = np.where(allowed, Z, -np.inf)
    m = Zr.max(axis=-1, keepdims=True, initial=-np.inf)  # -inf in a row with no key
    if sinks is not None:
        m = np.maximum(m, sinks)
    # a row with no key (and no sink) meets -inf - -inf and 0 / 0 here: NaN, zeroed below
    with np.errstate(invalid="ignore", over="ignore"):
        E = np.where(allowed, np.exp(Zr - m), 0.0)
        denom = E.sum(axis=-1, keepdims=True)
        if sinks is not None:
            denom = denom + np.exp(sinks - m)
        A = E / denom  # a row that reads NaN is NaN where it reads...
    return np.where(allowed, A, 0.0)  # ...and exactly 0 where it may not (found by fuzzing)


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


def split_heads(Y: np.ndarray, n_heads: int | None) -> np.ndarray:
    """(..., T, h·d) -> (..., h, T, d); unchanged when n_heads is None."""
    if n_heads is None:
        return Y
    *lead, T, hd = Y.shape
    return np.moveaxis(Y.reshape(*lead, T, n_heads, hd // n_heads), -2, -3)


def merge_heads(Y: np.ndarray) -> np.ndarray:
    """(..., h, T, d) -> (..., T, h·d): the heads side by side (split_heads undone)."""
    return np.moveaxis(Y, -3, -2).reshape(*Y.shape[:-3], Y.shape[-2], -1)


@_masks.takes_pattern
def trace(
    X: ArrayLike,
    W_q: ArrayLike,
    W_k: ArrayLike,
    W_v: ArrayLike,
    W_o: ArrayLike | None = None,
    *,
    pattern: _masks.Pattern | None = None,
    scale: float | None = None,
    n_heads: int | None = None,
    fill: str = "-inf",
    tokens: list[str] | None = None,
    dropout_p: float = 0.0,
    dropout_seed: tuple[int, int] | None = None,
    **keywords,
) -> Trace:
    """Run causal self-attention in float64 with every stage kept.

    X: ``(..., T, d_model)``; W_q, W_k: ``d_model×(h·d_k)``; W_v: ``d_model×(h·d_v)``;
    W_o: ``(h·d_v)×d_model'``. The pattern is ``pattern`` or its keywords, as for
    :func:`causalattn.attention` (see :class:`causalattn.masks.Pattern`): per-sequence ones
    (``lengths``, ``key_padding_mask``, ``prefix_lengths``, a per-sequence ``mask``) need X
    of shape ``(B, T, d_model)``. ``mask`` may also be any boolean array broadcastable to
    S ``(..., [h,] T, T)``; it is ANDed with the rest (``causal=False`` for a mask that is
    the whole M). ``scale`` defaults to 1/√d_k.
    ``n_heads`` splits the projections into heads; each head's stages then carry a head
    axis before T. ``fill`` chooses M's blocked value ('-inf' or 'finite'); weights are the
    same either way. Modifiers are stages of their own: ``S_cap`` (softcap) and ``E``
    (ALiBi, and the biases ``rel_bias`` and ``bias``), ``S_mod`` (a ``score_mod``); a
    ``mask_mod`` is ANDed into M and named as the reason of the cells it blocks. With
    ``dropout_p`` > 0 the stage ``A_drop`` (A with the dropout pattern of
    :mod:`causalattn.dropout` for ``dropout_seed`` = (seed, offset), drawn from torch's
    RNG when None) follows A, and H = A_drop V.
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
        Q = split_heads(X @ W["W_q"], n_heads)
        K = split_heads(X @ W["W_k"], n_heads)
        V = split_heads(X @ W["W_v"], n_heads)

    if scale is None:
        scale = _masks.default_scale(d_k)
    kw = _masks.keywords_of(pattern, keywords, "trace")
    general = kw["mask"]  # a mask broadcastable to S, not the Pattern's shape, is ANDed in
    if general is not None and not _is_pattern_mask(general, X.ndim, n_heads):
        kw["mask"] = None
    else:
        general = None
    pattern = _masks.Pattern.from_kwargs(where="trace", **kw)
    arrays, allowed, reasons = _stages(
        Q, K, V, pattern, scale, X.shape[:-2], n_heads, general, fill, dropout_p, dropout_seed
    )
    arrays = {"X": X, **W, "Q": Q, "K": K, "V": V, **arrays}
    H = arrays["H"]
    if W_o is not None:
        Wo = _as_float("W_o", "output projection", W_o, 2, exact_ndim=2)
        H_cat = H if n_heads is None else merge_heads(H)
        if Wo.shape[0] != H_cat.shape[-1]:
            raise ValueError(
                f"output projection: H is T×(h·d_v) = {T}×{H_cat.shape[-1]} but W_o is "
                f"{Wo.shape[0]}×{Wo.shape[1]}; its rows must be h·d_v = {H_cat.shape[-1]}"
            )
        arrays["W_o"] = Wo
        arrays["O"] = H_cat @ Wo
    return Trace(
        arrays,
        allowed=allowed,
        scale=float(scale),
        n_heads=n_heads,
        tokens=tokens,
        pattern=pattern,
        reasons=reasons,
    )


def stages(
    Q, K, V, pattern: _masks.Pattern, *, scale: float | None = None, with_C: bool = True
) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
    """The stages after the projections, from given Q, K, V: what :func:`trace` computes.

    Q ``(B, H, T, d_k)``, K ``(B, H, T, d_k)``, V ``(B, H, T, d_v)`` (grouped-query K, V
    expanded to every head), one :class:`causalattn.masks.Pattern`; float64. Returns
    (``{"S", ["S_cap", "E",] "M", "Z", "A", "H", ["C"]}``, allowed, reasons), the last
    two ``(B|1, H|1, T, T)``. ``with_C=False`` leaves C out (T×T×d_v; callers that
    keep the trace small compute it when asked).
    """
    Q, K, V = (_as_float(n, "scores", a, 4) for n, a in (("Q", Q), ("K", K), ("V", V)))
    if Q.ndim != 4 or Q.shape != K.shape or Q.shape[:3] != V.shape[:3]:
        raise ValueError(
            f"scores: Q, K must be (B, H, T, d_k) alike and V (B, H, T, d_v); got Q "
            f"{Q.shape}, K {K.shape}, V {V.shape}"
        )
    if scale is None:
        scale = _masks.default_scale(Q.shape[-1])
    arrays, allowed, reasons = _stages(
        Q, K, V, pattern, scale, Q.shape[:1], Q.shape[1], None, "-inf", 0.0, None, with_C
    )
    return arrays, allowed, reasons


def _stages(
    Q, K, V, pattern, scale, lead, n_heads, general, fill, dropout_p, dropout_seed, with_C=True
):
    """S through H (and C) of :func:`trace`, for Q, K, V laid out ``(*lead, [h,] T, d)``;
    ``general`` is a boolean mask broadcast against S and ANDed (not the Pattern's)."""
    T = Q.shape[-2]
    if (
        isinstance(scale, bool)
        or not isinstance(scale, (int, float, np.number))
        or not (np.isfinite(scale))
    ):
        raise ValueError(f"scores: scale must be a finite number, got {scale!r}")
    with np.errstate(invalid="ignore", over="ignore"):
        S = (Q @ np.swapaxes(K, -1, -2)) * scale
    reasons = _pattern_cells(pattern, lead, n_heads, T)
    while reasons.ndim > 2 and reasons.shape[0] == 1:  # T×T when the same for every sequence/head
        reasons = reasons[0]

    if general is not None:  # a general broadcastable mask, ANDed
        allowed = np.asarray(general)
        if allowed.dtype != np.bool_:
            raise ValueError(f"mask: must be boolean (True = may read), got dtype {allowed.dtype}")
        if allowed.ndim < 2 or allowed.shape[-2:] != (T, T):
            raise ValueError(f"mask: must end in T×T = {T}×{T}, got shape {allowed.shape}")
        if n_heads is not None and allowed.ndim == len(lead) + 2:
            allowed = np.expand_dims(allowed, -3)  # (..., T, T) -> (..., 1, T, T) over heads
        elif n_heads is not None and allowed.ndim not in (2, len(lead) + 3):
            # a (B, T, T) mask with a single T×d_model X would silently be read per head
            raise ValueError(
                f"mask: with n_heads={n_heads} and X of leading axes {tuple(lead)}, give T×T, "
                f"X's leading axes + T×T, or X's leading axes + (h, T, T); got shape "
                f"{allowed.shape}"
            )
        try:
            shape = np.broadcast_shapes(allowed.shape, S.shape)  # reasons are laid out like S
        except ValueError as exc:
            raise ValueError(
                f"mask: shape {allowed.shape} does not broadcast to S {S.shape}"
            ) from exc
        reasons = np.where(
            np.broadcast_to(allowed, shape),
            np.broadcast_to(reasons, shape),
            np.where(
                np.broadcast_to(reasons, shape) == 0, _masks.MASK, np.broadcast_to(reasons, shape)
            ),
        ).astype(np.uint8)
    allowed = reasons == 0

    stages: dict[str, np.ndarray] = {"S": S}
    Sm = S
    if pattern.softcap is not None:
        with np.errstate(invalid="ignore", over="ignore"):
            Sm = stages["S_cap"] = pattern.only("softcap").modify_scores(S)
    if pattern.has_additive:  # ALiBi, rel_bias, bias
        # (1, h): a per-sequence slope or bias broadcasts its own batch axis in
        E = pattern.only("alibi_slopes", "rel_bias", "bias").modify_scores(
            np.zeros((1, n_heads or 1, T, T))
        )
        stages["E"] = E = E.reshape(_lead_shape(E.shape, lead, n_heads))
        with np.errstate(invalid="ignore", over="ignore"):
            Sm = Sm + E
    if pattern.score_mod is not None:
        stages["S_mod"] = Sm = _score_mod(pattern, Sm, lead, n_heads)
    M = stages["M"] = np.broadcast_to(
        _masks.additive(allowed, fill=fill), np.broadcast_shapes(allowed.shape, S.shape)
    )
    with np.errstate(invalid="ignore"):
        Z = stages["Z"] = Sm + M
    sink_logits = None
    if pattern.sinks is not None:
        sk = _masks._numpy(pattern.sinks).astype(np.float64)
        sink_logits = sk[:, None, None] if n_heads is not None else sk  # (h, 1, 1) or (1,)
    A = stages["A"] = softmax_last(Z, allowed, sinks=sink_logits)
    A_read = A
    if dropout_p:
        from . import dropout as _dropout

        p = _dropout.check_p(dropout_p, "dropout")
        keep = _keep_cells(dropout_seed, A.shape, lead, n_heads, p)
        A_read = stages["A_drop"] = np.where(keep, A / (1.0 - p) if p < 1 else 0.0, 0.0)
    stages["H"] = weighted_values(A_read, V, allowed)
    if with_C and A.size * V.shape[-1] * 8 <= C_LIMIT_BYTES:
        al = np.broadcast_to(allowed, A.shape)[..., None]
        with np.errstate(invalid="ignore"):
            stages["C"] = np.where(al, A_read[..., None] * V[..., None, :, :], 0.0)
    return stages, allowed, reasons


def _score_mod(pattern, Sm, lead: tuple, n_heads) -> np.ndarray:
    """The score_mod on scores laid out like S (lead axes, [h,] T, T), as (B, H, T, T)."""
    if len(lead) > 1:
        raise ValueError(f"score_mod: X needs at most one batch axis, got leading axes {lead}")
    B, H = (lead[0] if lead else 1), (n_heads or 1)
    full = np.broadcast_to(Sm, (*lead, *((H,) if n_heads else ()), *Sm.shape[-2:]))
    S4 = np.ascontiguousarray(full).reshape(B, H, *Sm.shape[-2:])
    with np.errstate(invalid="ignore", over="ignore"):
        return pattern.only("score_mod").modify_scores(S4).reshape(full.shape)


def _is_pattern_mask(mask, x_ndim: int, n_heads) -> bool:
    """Whether a given mask is the Pattern's (B|1, H|1, T, T) form rather than a general
    array broadcast against S: only a 4-D mask beside a batched, multi-head X."""
    return mask is not None and np.ndim(mask) == 4 and x_ndim == 3 and n_heads is not None


def _lead_shape(shape4, lead: tuple, n_heads) -> tuple:
    """(B', H', T, T) from the Pattern -> the layout of S: lead axes, [h,] T, T."""
    Bp, Hp = shape4[:2]  # Bp is 1 unless X has one batch axis (Pattern.check holds B = 1)
    tail = ((Hp,) if n_heads is not None else ()) + tuple(shape4[2:])
    return ((Bp,) if len(lead) == 1 else (1,) * len(lead)) + tail


def _pattern_cells(pattern, lead: tuple, n_heads, T: int) -> np.ndarray:
    """The Pattern's blocked-reason codes laid out like S (lead axes, [h,] T, T)."""
    B = lead[0] if len(lead) == 1 else 1
    by_row = dataclasses.replace(pattern, mask_mod=None).per_batch  # a mask_mod may read b
    if by_row and len(lead) != 1:
        raise ValueError(
            f"mask: lengths, key_padding_mask, prefix_lengths or a per-sequence mask need X of "
            f"shape (B, T, d_model); got leading axes {lead}"
        )
    H = n_heads or 1
    pattern.check(B, H, T, T)
    codes = pattern.reasons(B, H, T, T)  # (B|1, H|1, T, T); H is 1 without n_heads
    return codes.reshape(_lead_shape(codes.shape, lead, n_heads))


def _keep_cells(seed, shape, lead: tuple, n_heads, p: float) -> np.ndarray:
    """The dropout keep pattern laid out like A (global positions: b, h, i, j)."""
    import torch

    from . import dropout as _dropout

    if seed is None:
        seed = _dropout.seed_from()
    s, off = seed
    T = shape[-1]
    B = lead[0] if len(lead) == 1 else 1
    H = n_heads or 1
    b = torch.arange(B)[:, None]
    h = torch.arange(H)[None, :]
    pos = torch.arange(T)
    keep = _dropout.keep_mask(s, off, b, h, pos, pos, p).numpy()  # (B, H, T, T)
    keep = keep.reshape(_lead_shape(keep.shape, lead, n_heads))
    return np.broadcast_to(keep, shape)
