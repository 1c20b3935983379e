"""Measure what an attention function does, stage by stage, and compare with the reference.

A function that computes H = A V returns A itself for V = I (one-hot value rows). From
that measured A (B, H, T_q, T_k):

- the read pattern: which keys each query reads (nonzero weight);
- the normalization: row sums, column sums, the total;
- the scale: log A_ij - log A_ik against the raw Q Kᵀ differences (a least-squares fit);
- linearity: H for random V must be A V (else the function does not compute A V);
- stability: large scores in fp32, fp16, long rows in fp16.

Each comparison gives :class:`Finding` s (stage, fault id or None, message with the
measurement); the first in dependency order is the diagnosis. Tolerances follow the
accuracy rule: an error counts when it exceeds twice what plain math in the function's
own dtype makes on the same probe, plus a floor.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import masks
from ..reference import softmax_last
from .probes import Probe

__all__ = [
    "Finding",
    "STAGES",
    "expected_weights",
    "fit_scale",
    "pattern_findings",
    "normalization",
    "plain_weights",
    "tolerance",
    "read_pattern",
    "rows_text",
]

STAGES = ("S", "M", "A", "H", "O")


@dataclass
class Finding:
    stage: str
    fault: str | None
    message: str
    slice: tuple = ()  # (b, h) of the probe slice where it was measured
    probe: str = ""

    def key(self):
        return STAGES.index(self.stage) if self.stage in STAGES else len(STAGES)


# -- the reference on a probe ------------------------------------------------------------
def expected_weights(p: Probe, scale: float, allowed: np.ndarray | None = None) -> np.ndarray:
    """softmax_last(modify(Q Kᵀ·scale) + M), sinks in the denominator; float64 (B,H,T_q,T_k)."""
    pat = p.pattern
    allowed = p.allowed() if allowed is None else allowed
    S = pat.modify_scores(p.G() * scale)
    if pat.sinks is None:
        return softmax_last(np.where(allowed, S, 0.0), allowed)
    # a sink is one more allowed logit per row that takes no value: append it as a column
    sink = np.broadcast_to(
        np.asarray(pat.sinks, np.float64)[None, :, None, None], S.shape[:2] + (S.shape[2], 1)
    )
    has_key = allowed.any(-1, keepdims=True)
    A = softmax_last(
        np.concatenate([np.where(allowed, S, 0.0), sink], -1),
        np.concatenate([allowed, has_key], -1),
    )
    return A[..., :-1]


def plain_weights(p: Probe, scale: float, dtype) -> np.ndarray:
    """The same softmax in plain math in ``dtype`` (torch when present, as the accuracy
    rule says; NumPy otherwise): what ordinary code in that precision gets."""
    allowed = p.allowed()
    Z = np.where(allowed, p.pattern.modify_scores(p.G() * scale), -np.inf)
    if p.pattern.sinks is not None:  # the sink logit joins the denominator as a column
        sink = np.broadcast_to(
            np.asarray(p.pattern.sinks, np.float64)[None, :, None, None], Z.shape[:3] + (1,)
        )
        Z = np.concatenate([Z, sink], -1)
    try:
        import torch

        tdt = {np.dtype(np.float16): torch.float16, np.dtype(np.float32): torch.float32}.get(
            np.dtype(dtype), torch.float64
        )
        A = torch.softmax(torch.from_numpy(Z).to(tdt), -1).double().numpy()
    except ImportError:
        Zt = Z.astype(dtype)
        with np.errstate(invalid="ignore"):
            E = np.exp(Zt - Zt.max(-1, keepdims=True))
            A = (E / E.sum(-1, keepdims=True)).astype(np.float64)
    A = A[..., : allowed.shape[-1]]
    return np.where(allowed.any(-1, keepdims=True), np.nan_to_num(A), 0.0)


def tolerance(ref: np.ndarray, plain: np.ndarray, dtype) -> float:
    """The accuracy rule's bound for |got - ref|: 2·max|plain - ref| + a floor."""
    eps = float(np.finfo(np.dtype(dtype)).eps) if np.dtype(dtype).kind == "f" else 2.2e-16
    mag = max(1.0, float(np.abs(ref).max()) if ref.size else 1.0)
    return 2.0 * float(np.abs(plain - ref).max()) + 8 * eps * mag


# -- reading the measured weights --------------------------------------------------------
def read_pattern(A: np.ndarray, noise: float = 0.0) -> np.ndarray:
    """Keys read: nonzero weight, above ``noise`` (the read-back error of weights measured
    through W_V = pinv(x)·V; 0 when V is given directly). NaN counts as read."""
    return (np.abs(A) > noise) | np.isnan(A)


def spans(numbers, dash: str = "..") -> list[str]:
    """Runs of consecutive integers folded, in the order given: [2, 3, 4, 7] -> ['2..4', '7']
    (the one folding: rows_text here, the question texts of :mod:`causalattn.learn`)."""
    numbers = [int(n) for n in numbers]
    if not numbers:
        return []
    parts, start, prev = [], numbers[0], numbers[0]
    for n in numbers[1:] + [None]:
        if n is not None and n == prev + 1:
            prev = n
            continue
        parts.append(f"{start}" if start == prev else f"{start}{dash}{prev}")
        if n is not None:
            start = prev = n
    return parts


def rows_text(rows) -> str:
    """1-based query numbers, ranges folded: 'rows 2..8', 'row 1', 'rows 1, 3, 5'."""
    rows = [int(r) + 1 for r in rows]
    if not rows:
        return "no rows"
    parts = spans(rows)
    return (
        ("row " if len(rows) == 1 else "rows ")
        + ", ".join(parts[:6])
        + (" ..." if len(parts) > 6 else "")
    )


def _keys_text(cols) -> str:
    cols = [int(c) + 1 for c in cols]
    return (
        ("key " if len(cols) == 1 else "keys ")
        + ", ".join(map(str, cols[:6]))
        + (" ..." if len(cols) > 6 else "")
    )


def _verb(rows, one: str, many: str) -> str:
    return one if len(rows) == 1 else many


def _own_key(T_q: int, T_k: int) -> np.ndarray:
    """T_q×T_k bool: True at each query's own key, position i + T_k - T_q (bottom-right)."""
    diag = np.zeros((T_q, T_k), bool)
    diag[np.arange(T_q), np.arange(T_q) + T_k - T_q] = True
    return diag


def describe_difference(P: np.ndarray, E: np.ndarray, T_q: int, T_k: int) -> str:
    """What differs between a measured read pattern P and the expected E (T_q×T_k)."""
    diag = _own_key(T_q, T_k)
    parts = []
    own_missing = np.flatnonzero((diag & E & ~P).any(-1))
    if own_missing.size:
        own_ok = np.flatnonzero((diag & E & P).any(-1))
        verb = _verb(own_missing, "does not read its", "do not read their")
        s = f"{rows_text(own_missing)} {verb} own key"
        if own_ok.size:
            s += f" ({rows_text(own_ok)} {'does' if own_ok.size == 1 else 'do'})"
        parts.append(s)
    extra = P & ~E
    rows = np.flatnonzero(extra.any(-1))
    if rows.size:
        i = rows[0]
        fut = extra & ~masks.causal(T_q, T_k)
        kind = "future keys" if fut.any() else "keys they may not"
        parts.append(
            f"{rows_text(rows)} {_verb(rows, 'reads', 'read')} {kind} (row {i + 1} reads "
            f"{_keys_text(np.flatnonzero(extra[i]))})"
        )
    miss = E & ~P & ~diag
    rows = np.flatnonzero(miss.any(-1))
    if rows.size:
        i = rows[0]
        parts.append(
            f"{rows_text(rows)} {_verb(rows, 'does not read keys it', 'do not read keys they')} "
            f"may (row {i + 1} skips "
            f"{_keys_text(np.flatnonzero(miss[i]))})"
        )
    return "; ".join(parts)


# -- M: the read pattern ---------------------------------------------------------------
def _top_left(p: Probe) -> np.ndarray:
    """Causal aligned top-left (query i reads j <= i) for T_q < T_k: SDPA's is_causal."""
    sq = masks.Pattern().allowed(1, 1, p.T_q, p.T_q)[0, 0]
    return np.pad(sq, ((0, 0), (0, p.T_k - p.T_q)))


def pattern_findings(
    p: Probe, A: np.ndarray, E_full: np.ndarray, noise: float = 0.0, ref: np.ndarray | None = None
) -> list[Finding]:
    """Stage M per slice: the measured read pattern against the reference's. Rows holding
    NaN or inf are left to stage A; with read-back ``noise``, keys whose reference weight is
    below it are not counted as skipped."""
    out = []
    P_full = read_pattern(A, noise)
    for b, h in np.ndindex(p.B, p.H):
        P, E = P_full[b, h].copy(), E_full[b, h]
        bad_rows = ~np.isfinite(A[b, h]).all(-1)
        P[bad_rows] = E[bad_rows]
        if noise and ref is not None:
            tiny = E & ~P & (ref[b, h] <= 10 * noise)
            P[tiny] = True
        if (P == E).all():
            continue
        out.append(
            Finding("M", _name_pattern(p, P, E, b, h), _pattern_message(p, P, E), (b, h), p.name)
        )
    return out


def _pattern_message(p: Probe, P, E) -> str:
    return (
        f"M: {describe_difference(P, E, p.T_q, p.T_k)}; expected {p.pattern.describe()}"
        f" (on {p.name}, T_q×T_k = {p.T_q}×{p.T_k})"
    )


def _name_pattern(p: Probe, P, E, b, h) -> str | None:
    pat = p.pattern
    T_q, T_k = p.T_q, p.T_k
    empty = ~E.any(-1)
    if not pat.causal:
        return None
    nopad = masks.Pattern(causal=True, window=pat.window, chunk=pat.chunk).allowed(1, 1, T_q, T_k)[
        0, 0
    ]
    if P.all():
        return "no-mask"
    if pat.lengths is not None or pat.key_padding_mask is not None:
        if (P == nopad).all():
            return "padding-ignored"
        if (P[~empty] == E[~empty]).all() and P[empty].any():
            return "finite-min-added-twice"
        keys = (
            masks.Pattern(causal=False, lengths=pat.lengths, key_padding_mask=pat.key_padding_mask)
            .allowed(p.B, 1, T_q, T_k)[b, 0]
            .any(0)
        )  # the keys that are not padding
        if T_q == T_k and (P == (nopad & keys[:, None])).all():
            return "padding-queries-only"
    if T_q == T_k and (P == nopad.T).all():
        return "anti-causal-mask"
    diag = _own_key(T_q, T_k)
    if (P == (E & ~diag)).all():
        return "diagonal-blocked"
    if T_q < T_k and pat.window is None and (P == (_top_left(p) & (E | ~nopad))).all():
        return "causal-top-left"
    if pat.window is not None:
        for w in (pat.window - 1, pat.window + 1):
            if w >= 1 and (P == p.with_pattern(window=w).allowed()[b, h]).all():
                return "window-off-by-one"
    return None


# -- S: the scale ------------------------------------------------------------------------
def _centered(X, use, mode):
    """X minus its mean over the used entries of each normalization group."""
    axes = {"rows": (-1,), "cols": (-2,), "all": (-2, -1)}[mode]
    n = use.sum(axis=axes, keepdims=True)
    mean = np.where(use, X, 0.0).sum(axis=axes, keepdims=True) / np.maximum(n, 1)
    return np.where(use, X - mean, 0.0)


def fit_scale(p: Probe, A: np.ndarray, use: np.ndarray, mode: str, G=None):
    """(c, residual): the factor c with log A ≈ modify(c·G) + const per normalization group
    over the ``use`` entries, and the largest misfit in log space. None when too few entries."""
    G = p.G() if G is None else G
    with np.errstate(divide="ignore", invalid="ignore"):
        L = np.log(np.where(use, A, 1.0))
    use = use & np.isfinite(L)
    if use.sum() < 3:
        return None
    Lc = _centered(L, use, mode)
    pat = p.pattern
    if pat.softcap is None:
        alibi = pat.modify_scores(np.zeros_like(G))  # the ALiBi bias alone (no scale)
        Lc = Lc - _centered(alibi, use, mode)
        Gc = _centered(G, use, mode)
        gg = float((Gc * Gc).sum())
        if gg < 1e-24:
            return None
        c = float((Lc * Gc).sum() / gg)
        return c, float(np.abs(Lc - c * Gc).max())

    def resid(c):
        return float(((Lc - _centered(pat.modify_scores(G * c), use, mode)) ** 2).sum())

    grid = np.logspace(-4, 2, 241)
    k = int(np.argmin([resid(c) for c in grid]))
    lo, hi = grid[max(k - 1, 0)], grid[min(k + 1, len(grid) - 1)]
    for _ in range(60):  # golden section in the bracket
        m1, m2 = lo + 0.382 * (hi - lo), lo + 0.618 * (hi - lo)
        lo, hi = (lo, m2) if resid(m1) < resid(m2) else (m1, hi)
    c = (lo + hi) / 2
    return c, float(np.abs(Lc - _centered(pat.modify_scores(G * c), use, mode)).max())


# -- A: normalization ---------------------------------------------------------------------
def normalization(A: np.ndarray, A_ref: np.ndarray, E: np.ndarray, tol: float) -> str:
    """'rows' (each readable row sums as the reference's), 'cols', 'all', or 'none'."""
    fin = np.where(np.isfinite(A), A, 0.0)
    has = E.any(-1)
    rows = np.abs(fin.sum(-1) - A_ref.sum(-1))[has]
    if rows.size == 0 or rows.max() <= tol:
        return "rows"
    read = E.any(-2)
    cols = np.abs(fin.sum(-2) - 1)[read]
    if cols.size and cols.max() <= tol:
        return "cols"
    if np.abs(fin.sum((-2, -1)) - 1).max() <= tol:
        return "all"
    return "none"
