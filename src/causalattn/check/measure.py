"""Measuring: what the function did on each probe, as records — pure functions of a probe
and the raw outputs (:class:`~.observe.Run`), no verdicts.

A function that computes H = A V returns A itself for V = I (one-hot value rows). From
that measured A (B, H, T_q, T_k), per (b, h) slice (:class:`SliceMeasure`): the read
pattern (nonzero weight), the row sums, the normalization (rows, columns, all, none), the
scale (log A_ij - log A_ik against the raw Q Kᵀ differences, a least-squares fit; also
against Q K where T = d_k), the weights against the reference (error, relative error), the
softmax over all keys masked after (mask after softmax), and the value map R with A = A_ref R
(which value rows each key's weight multiplies). Per probe (:class:`ProbeMeasure`): the
tolerance of the accuracy rule in the function's own dtype, the read-back noise, and on
the main probe whether it is deterministic (V = I twice), linearity (H for random V
against the measured A V), the weights with d_v doubled, the output projection; the largest
score on the stability probes; the long fp16 rows' sums (of the last rows that read a key).
:mod:`.judge` turns the records into findings.

Tolerances follow the accuracy rule: twice what plain math in the function's own dtype
makes on the same probe, plus a floor.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .. import masks
from ..matrix_form import merge_heads, softmax_last, split_heads
from .observe import Run
from .probes import Probe

__all__ = [
    "SliceMeasure",
    "ProbeMeasure",
    "Linearity",
    "Width",
    "RowSums",
    "Projection",
    "measure",
    "expected_weights",
    "plain_weights",
    "tolerance",
    "read_pattern",
    "fit_scale",
    "normalization",
]


# -- the records ---------------------------------------------------------------------------
@dataclass(frozen=True)
class SliceMeasure:
    """One (b, h) slice of a probe's weights. Arrays are T_q×T_k (``value_map``: T_k×T_k).

    ``A``: measured (V = I); ``ref``: the reference's; ``allowed``: the reference's read
    pattern; ``read``: keys read (above the read-back noise; NaN counts as read); ``mode``:
    the normalization at the tolerance ('rows', 'cols', 'all', 'none'); ``fit``: (c, misfit)
    of log A against c·Q Kᵀ on the keys read, None when too few; ``fit_kt``: the same
    against Q K (T_q = T_k = d_k only); ``full_err``: max |A - softmax over all keys (at the
    fitted c) zeroed where not read|; ``value_map``: R with A = ref R (a square ``ref``
    that can be inverted only), ``value_misfit``: max |R - round(R)|."""

    index: tuple
    A: np.ndarray
    ref: np.ndarray
    allowed: np.ndarray
    read: np.ndarray
    mode: str = "rows"
    fit: tuple | None = None
    fit_kt: tuple | None = None
    full_err: float | None = None
    value_map: np.ndarray | None = None
    value_misfit: float | None = None

    @property
    def has_key(self) -> np.ndarray:
        return self.allowed.any(-1)

    @property
    def nonfinite_rows(self) -> np.ndarray:
        """Rows that can read a key but hold NaN or inf."""
        return np.flatnonzero(self.has_key & ~np.isfinite(self.A).all(-1))

    @property
    def empty_nan_rows(self) -> np.ndarray:
        """Rows with no readable key that come out NaN."""
        return np.flatnonzero(~self.has_key & np.isnan(self.A).any(-1))

    @property
    def sums(self) -> np.ndarray:
        return np.where(np.isfinite(self.A), self.A, 0).sum(-1)

    @property
    def ref_sums(self) -> np.ndarray:
        return self.ref.sum(-1)

    @property
    def err(self) -> float:
        """max |A - ref| over the rows that read a key."""
        d = np.where(self.has_key[:, None], self.A - self.ref, 0)
        return float(np.abs(d).max()) if d.size else 0.0

    @property
    def rel_err(self) -> float:
        """max |A/ref - 1| over the entries the reference weights at least 1e-3 of a row."""
        big = self.ref > 1e-3
        return float(np.abs(self.A[big] / self.ref[big] - 1).max()) if big.any() else 0.0


@dataclass(frozen=True)
class Linearity:
    """H for random V (``err``: max |H - A V| with the measured A), its ``tol``, and the
    largest output for V = 0 (``zero``): a function of V that is not A V shows here."""

    err: float
    tol: float
    zero: float


@dataclass(frozen=True)
class Width:
    """The weights read back with d_v doubled (V = [I, 0]): ``diff`` max |A' - A| against
    ``tol``; ``fit`` (c, misfit) of A'; ``d_v`` the main probe's."""

    diff: float
    tol: float
    fit: tuple | None
    d_v: int


@dataclass(frozen=True)
class RowSums:
    """The long fp16 rows: the sums of the last rows (V = ones), the keys they read, and
    what plain fp16 math with fp32 accumulation is off by."""

    sums: np.ndarray
    keys: int
    plain_err: float
    tol: float


@dataclass(frozen=True)
class Projection:
    """O with the probe's W_V, W_O against H W_O (H from the measured weights): ``err``,
    ``err_missing`` (O = H), ``err_transposed`` (O = H W_Oᵀ; None unless W_O is square),
    ``tol``; the shapes; ``error``: what the function raised."""

    err: float | None = None
    err_missing: float | None = None
    err_transposed: float | None = None
    tol: float = 0.0
    shape: tuple = ()
    expected_shape: tuple = ()
    error: str | None = None


@dataclass(frozen=True)
class ProbeMeasure:
    """What one probe showed. ``probe``/``kind`` name it (kinds: :data:`~.probes.KINDS`);
    ``dtype``: the function's working precision on it; ``scale0``: the declared scale;
    ``tol``: the accuracy rule's bound on the weights; ``noise``: the read-back error of
    weights measured through W_V = pinv(x)·V (0 for fn(q, k, v)); ``pattern``: the
    reference's; ``S_max``: the largest |scaled score|; ``d_v``: the value width the
    function saw with V = I (0: T_k); ``repeat``: max |H - H'| of two calls with the same input
    (main probe; NaN where one is NaN and the other not counts as inf); the rest as the
    records say."""

    probe: str
    kind: str
    T_q: int
    T_k: int
    d_k: int
    B: int
    H: int
    dtype: str
    scale0: float
    pattern: masks.Pattern = field(default_factory=masks.Pattern)
    tol: float = 0.0
    noise: float = 0.0
    S_max: float = 0.0
    d_v: int = 0
    repeat: float | None = None
    slices: tuple = ()
    linearity: Linearity | None = None
    width: Width | None = None
    sums: RowSums | None = None
    projection: Projection | None = None
    recorded: tuple | None = None  # SliceMeasures of the weights the function computed

    def fitted_scale(self, s: SliceMeasure) -> float | None:
        """A slice's fitted scale when log A fits c·Q Kᵀ tightly (2e-3 in log space, plus
        what the dtype rounds), else None."""
        tight = 2e-3 + 1e3 * float(np.finfo(np.dtype(self.dtype)).eps)
        return s.fit[0] if s.fit is not None and s.fit[1] <= tight else None

    @property
    def read(self) -> np.ndarray:
        """(B, H, T_q, T_k): every slice's read pattern."""
        out = np.zeros((self.B, self.H, self.T_q, self.T_k), bool)
        for s in self.slices:
            out[s.index] = s.read
        return out


# -- measuring -------------------------------------------------------------------------------
def measure(run: Run, *, scale: float | None, sig: str) -> ProbeMeasure:
    """The records of one run. ``scale``: the declared one (None: 1/√d_k); ``sig``: the
    calling convention (weights come back through pinv(x) for all but fn(q, k, v))."""
    p = run.probe
    c0 = scale if scale is not None else masks.default_scale(p.d_k)
    t = _work_dtype(p, run.dtype)
    base = dict(
        probe=p.name,
        kind=p.kind,
        T_q=p.T_q,
        T_k=p.T_k,
        d_k=p.d_k,
        B=p.B,
        H=p.H,
        dtype=t.name,
        scale0=c0,
        pattern=p.pattern,
        S_max=float(np.abs(p.G() * c0).max()) if p.G().size else 0.0,
        d_v=p.d_v or p.T_k,
    )
    if "ones" in run.outputs:
        return ProbeMeasure(**base, sums=_row_sums(p, run.outputs["ones"], c0))
    A = run.outputs["eye"]
    ref = expected_weights(p, c0)
    noise = _noise(A, t, sig)
    tol = tolerance(ref, plain_weights(p, c0, t), t) + noise
    slices = _slices(p, A, ref, tol, noise)
    extra = {}
    if "again" in run.outputs:
        extra["repeat"] = _repeat(A, run.outputs["again"])
    if "random" in run.outputs:
        extra["linearity"] = _linearity(p, A, run.outputs, t, noise)
    if "wide" in run.outputs:
        extra["width"] = _width(p, A, run.outputs["wide"], t, noise)
    if p.projection is not None:
        extra["projection"] = _projection(p, A, run, t, noise)
    w = run.weights
    if w is not None and np.asarray(w).size == p.B * p.H * p.T_q * p.T_k:
        W = np.asarray(w, np.float64).reshape(p.B, p.H, p.T_q, p.T_k)
        extra["recorded"] = tuple(_slices(p, W, ref, tol, _noise(W, t, sig)))
    return ProbeMeasure(**base, tol=tol, noise=noise, slices=tuple(slices), **extra)


def _work_dtype(p: Probe, out) -> np.dtype:
    """The function's working precision: the lower of its inputs' and its output's."""
    if out is None or out.kind != "f" or np.finfo(out).eps < np.finfo(p.dtype).eps:
        return np.dtype(p.dtype)
    return np.dtype(out)


def _noise(A: np.ndarray, t: np.dtype, sig: str) -> float:
    """Read-back error of weights measured through W_V = pinv(x)·V (0 for fn(q, k, v))."""
    if sig == "qkv":
        return 0.0
    fin = np.abs(A[np.isfinite(A)])
    return 1e3 * float(np.finfo(t).eps) * max(1.0, float(fin.max()) if fin.size else 1.0)


def _slices(p: Probe, A, ref, tol, noise) -> list[SliceMeasure]:
    out = []
    E = p.allowed()
    with np.errstate(all="ignore"):
        for b, h in np.ndindex(p.B, p.H):
            a, e, r = A[b, h], E[b, h], ref[b, h]
            mode = normalization(a, r, e, tol)
            read = read_pattern(a, noise)
            fin = np.abs(a[np.isfinite(a)])
            top = float(fin.max()) if fin.size else 0.0
            use = read & e & (np.abs(a) > 1e-3 * max(1e-300, top))
            sub = p.slice(b, h)
            fit_mode = "rows" if mode == "none" else mode
            fit = fit_scale(sub, a[None, None], use[None, None], fit_mode)
            fit_kt = None
            if p.T_q == p.T_k == p.d_k:  # Q K instead of Q Kᵀ?
                fit_kt = fit_scale(sub, a[None, None], use[None, None], fit_mode, G=sub.Q @ sub.K)
            full_err = None
            if fit is not None:  # the softmax over all keys, zeroed where not read
                full = expected_weights(sub, fit[0], np.ones((1, 1, p.T_q, p.T_k), bool))[0, 0]
                full_err = float(np.nan_to_num(np.abs(a - full * read), nan=np.inf).max())
            R, misfit = _value_map(r, a, e)
            out.append(SliceMeasure((b, h), a, r, e, read, mode, fit, fit_kt, full_err, R, misfit))
    return out


def _value_map(ref: np.ndarray, a: np.ndarray, e: np.ndarray):
    """R with a = ref R, for a square ref with a key on every row that is well conditioned
    (the causal reference is triangular with a positive diagonal); (None, None) otherwise."""
    T_q, T_k = ref.shape
    if T_q != T_k or not e.any(-1).all() or not np.isfinite(a).all():
        return None, None
    if np.linalg.cond(ref) > 1e8:
        return None, None
    R = np.linalg.solve(ref, a)
    return R, float(np.abs(R - np.rint(R)).max())


def _repeat(first: np.ndarray, second: np.ndarray) -> float:
    """max |first - second| (NaN in the same places is equal; NaN against a number: inf)."""
    same_nan = np.isnan(first) & np.isnan(second)
    with np.errstate(invalid="ignore"):
        d = np.where(same_nan, 0.0, np.abs(first - second))
    return float(np.nan_to_num(d, nan=np.inf).max()) if d.size else 0.0


def _linearity(p: Probe, A, outputs: dict, t, noise) -> Linearity:
    V = p.values["random"]
    ref = A @ V
    plain = (A.astype(t) @ V.astype(t)).astype(np.float64)
    tol = tolerance(ref, plain, t) + noise * p.T_k * float(np.abs(V).max())
    with np.errstate(invalid="ignore"):
        err = np.abs(outputs["random"] - ref)
    e = float(np.nanmax(err)) if np.isfinite(err).any() else np.inf
    if np.isnan(err).any():
        e = np.inf
    zero = outputs["zero"]
    z = float(np.nanmax(np.abs(zero))) if zero.size else 0.0
    return Linearity(e, tol, z)


def _width(p: Probe, A, wide, t, noise) -> Width:
    A2 = wide[..., : p.T_k]
    with np.errstate(invalid="ignore"):
        diff = float(np.nan_to_num(np.abs(A2 - A), nan=np.inf).max())
    fit = None
    if np.isfinite(A2).all():
        use = read_pattern(A2) & p.allowed() & (A2 > 1e-3 * A2.max())
        fit = fit_scale(p, A2, use, "rows")
    return Width(diff, 1e3 * float(np.finfo(t).eps) + noise, fit, p.T_k)


def _projection(p: Probe, A, run: Run, t, noise) -> Projection:
    if run.O_error is not None:
        return Projection(error=run.O_error)
    w_v, w_o = p.projection
    kv = w_v.shape[1] // (w_o.shape[0] // p.H)  # key/value heads, each read by H / kv heads
    Vh = split_heads(p.inputs["x"].astype(np.float64) @ w_v.astype(np.float64), kv)
    Vh = np.repeat(Vh, p.H // kv, axis=1)
    Hm = merge_heads(A @ Vh)
    ref = Hm @ w_o.astype(np.float64)
    plain = (merge_heads(A.astype(t) @ Vh.astype(t)) @ w_o.astype(t)).astype(np.float64)
    tol = tolerance(ref, plain, t) + noise * float(np.abs(ref).max())
    got = run.O

    def err(x, y):
        return float(np.abs(x - y).max()) if x.shape == y.shape else None

    transposed = None
    if w_o.shape[0] == w_o.shape[1]:
        transposed = err(got, Hm @ w_o.T.astype(np.float64))
    return Projection(err(got, ref), err(got, Hm), transposed, tol, got.shape[1:], ref.shape[1:])


def _row_sums(p: Probe, ones: np.ndarray, c0: float) -> RowSums:
    E = p.allowed()[0, 0]
    rows = np.flatnonzero(E.any(-1))[-4:]  # the last rows that read a key (a row of none sums 0)
    E = E[rows]
    S = p.pattern.modify_scores(p.G() * c0)[0, 0, rows]  # (ALiBi, softcap: as the reference)
    plain = plain_fp16_row_sums(np.where(E, S, -np.inf))
    eps = float(np.finfo(np.float16).eps)
    plain_err = float(np.abs(plain - 1).max()) if rows.size else 0.0
    keys = int(E[-1].sum()) if rows.size else 0
    return RowSums(ones[0, 0, rows, 0], keys, plain_err, 2 * plain_err + 8 * eps)


def plain_fp16_row_sums(Z: np.ndarray) -> np.ndarray:
    """Row sums of softmax(Z) computed in fp16 with fp32 accumulation (torch's way)."""
    try:
        import torch

        A = torch.softmax(torch.from_numpy(Z).half(), -1)
        return A.float().sum(-1).double().numpy()
    except ImportError:
        Z32 = Z.astype(np.float16).astype(np.float32)
        E = np.exp(Z32 - Z32.max(-1, keepdims=True))
        A = (E / E.sum(-1, keepdims=True)).astype(np.float16)
        return A.astype(np.float32).sum(-1).astype(np.float64)


# -- the reference on a probe ---------------------------------------------------------
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
    # a row with no key (and no sink) is 0 / 0 = NaN in the softmax: its weights are 0
    return np.nan_to_num(A[..., : allowed.shape[-1]])


def tolerance(ref: np.ndarray, plain: np.ndarray, dtype) -> float:
    """The accuracy rule's bound for |got - ref|: 2·max|plain - ref| + a floor."""
    eps = float(np.finfo(np.dtype(dtype)).eps) if np.dtype(dtype).kind == "f" else 2.2e-16
    if ref.size == 0:  # no weights (no query rows): the floor alone
        return 8 * eps
    mag = max(1.0, float(np.abs(ref).max()))
    return 2.0 * float(np.abs(plain - ref).max()) + 8 * eps * mag


def read_pattern(A: np.ndarray, noise: float = 0.0) -> np.ndarray:
    """Keys read: nonzero weight, above ``noise`` (the read-back error of weights measured
    through W_V = pinv(x)·V; 0 when V is given directly). NaN counts as read."""
    return (np.abs(A) > noise) | np.isnan(A)


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
