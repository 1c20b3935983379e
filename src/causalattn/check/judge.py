"""Judging: the measurement records (:mod:`.measure`) against the declared pattern, as
:class:`~.report.Finding` s — pure, no function is run, nothing is kept between calls.

``judge(measures)`` returns every distinct fault measured: the main probe's findings
first, in dependency order (S, M, A, H, O), then each further probe's findings that the
main probe does not already explain (the same fault; an unnamed difference at a stage the
main probe already flags; anything S, M or A when the main probe found its weights cannot
be read back as A, at stage H), each once.

A function that returns different outputs for the same input is not deterministic (H), and
nothing else is judged. Per slice of a probe's weights: NaN or inf in rows that can read a
key (A); rows with no readable key that come out NaN (A: nan-on-empty-rows); values taken
from the wrong rows with the weights right, or through the transposed weights (H); the read
pattern against the reference's (M, the catalogue's forms
matched on every row but a patched first row or a patched row with no readable key); the
scale (S: named by the one size it equals, a coincidence of sizes names none; none
measured when the weights are impossible for any softmax: negative, or rows that do not sum
as a softmax's); the normalization (A); weights right in shape but off beyond the accuracy rule
for the function's own dtype (A: lost precision). Per probe: linearity in V and the d_v
dependence of the scale (main), overflow and leaks at large scores, the long fp16 rows' sums,
the output projection (O). A fault in some heads only of a multi-head probe becomes
``some-heads-only`` at that stage. ``verdict`` turns the findings into the Diagnosis.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

import numpy as np

from .. import masks
from .faults import CATALOGUE
from .measure import ProbeMeasure, SliceMeasure
from .probes import KINDS
from .report import Diagnosis, Finding, Status
from .words import describe_difference, few, own_key, rows_text, verb

__all__ = [
    "judge",
    "further_kinds",
    "reads_back",
    "probe_findings",
    "match_pattern",
    "untested",
    "verdict",
    "MAIN_KINDS",
]

MAIN_KINDS = ("main", "T = d_k")
SCALE_RTOL = 2e-3  # a fitted scale within this of the expected one is the expected one
# weights right "in shape" (pattern, scale, sums) are off by precision, not by a fault, when
# they are within these of the reference: relative error, row sums, scale, log-space misfit
SHAPE_RTOL, SUM_ATOL, SHAPE_SCALE_RTOL, SHAPE_MISFIT = 0.02, 0.02, 5e-3, 0.02


def judge(measures: Sequence[ProbeMeasure], *, d_model: int | None = None) -> list[Finding]:
    """Every finding, ordered: see the module docstring. ``measures``: the main probe's
    record first (kind "main" or "T = d_k"), then the further probes' in probe order;
    ``d_model`` names the 1/√d_model scale for code that has one (x-weights, module)."""
    if not measures:
        return []
    main, further = measures[0], list(measures[1:])
    random = _nondeterministic(main)
    if random is not None:  # two calls disagree: no record of one call says what it computes
        return [random]
    nonlinear = _nonlinear(main)
    if nonlinear is not None:  # V = I does not give A: only the weights it computed say more
        rec = _slice_findings(main, main.recorded or (), d_model)
        return _merge(main, rec) or [nonlinear]
    out = _merge(main, _slice_findings(main, main.slices, d_model))
    out += _width(main) + _projection(main)
    out = sorted(out, key=Finding.key)  # stable: slice order within a stage
    shown = list(out)
    for pm in further:
        for f in sorted(probe_findings(pm, main, d_model), key=Finding.key):
            if not _explained(f, out) and not _duplicate(f, shown):
                shown.append(f)
    return shown


def further_kinds(main: ProbeMeasure) -> tuple[str, ...]:
    """The further probes that can still show something new, given the main probe's record:
    none when V = I does not read its weights back; the long fp16 rows only where short
    rows sum as they should."""
    if not reads_back(main):
        return ()
    kinds = tuple(k for k in KINDS if k not in MAIN_KINDS)
    if not all(s.mode == "rows" and not s.nonfinite_rows.size for s in main.slices):
        kinds = tuple(k for k in kinds if k != "long fp16")
    return kinds


def reads_back(main: ProbeMeasure) -> bool:
    """Whether V = I reads the main probe's weights back (the function is linear in V)."""
    return _nondeterministic(main) is None and _nonlinear(main) is None


def probe_findings(pm: ProbeMeasure, main: ProbeMeasure, d_model=None) -> list[Finding]:
    """One further probe's findings (``main``: the main probe's record, to tell what is new)."""
    if pm.sums is not None:
        return _long_rows(pm) if "long fp16" in further_kinds(main) else []
    if pm.kind in ("large", "huge", "negative"):
        return _stability(pm, main)
    fs = _slice_findings(pm, pm.slices, d_model)
    if pm.kind == "fp16":  # rounding the inputs to fp16 moves the fitted scale: not S
        fs = [f for f in fs if f.stage != "S"]
    return _merge(pm, fs)


# -- per slice ---------------------------------------------------------------------------------
def _slice_findings(pm: ProbeMeasure, slices, d_model) -> list[Finding]:
    out: list[Finding] = []
    for s in slices:
        out += _one_slice(pm, s, d_model)
    return out


def _finding(pm, s, stage, fault, message, rows=(), **measurement) -> Finding:
    return Finding(
        stage,
        fault,
        message,
        probe=pm.probe,
        measurement=measurement,
        rows=tuple(int(r) for r in rows),
        slice=tuple(s.index) if s is not None else (),
    )


def _one_slice(pm: ProbeMeasure, s: SliceMeasure, d_model) -> list[Finding]:
    out = []
    on = f"on {pm.probe}"
    bad = s.nonfinite_rows
    values = _values_from_wrong_rows(pm, s) or _transposed_weights(pm, s)
    if values is not None:  # the weights are right: everything else follows from it
        return [values]
    m = _pattern(pm, s)
    if m is not None:
        out.append(m)
    if bad.size:
        msg = (
            f"A: {rows_text(bad)} {verb(bad, 'holds', 'hold')} NaN or inf weights at ordinary "
            f"scores ({on})"
        )
        return out + [_finding(pm, s, "A", None, msg, bad)]
    empty = s.empty_nan_rows
    if empty.size:
        msg = (
            f"A: {rows_text(empty)} {verb(empty, 'has', 'have')} no readable key and "
            f"{verb(empty, 'comes', 'come')} out NaN, not zero ({on})"
        )
        out.append(_finding(pm, s, "A", "nan-on-empty-rows", msg, empty))
    fit_ok = pm.fitted_scale(s) is not None
    if m is None and not (fit_ok and abs(s.fit[0] / pm.scale0 - 1) > SCALE_RTOL):
        lost = _lost_precision(pm, s)  # (a scale that fits tightly but differs is S's)
        if lost is not None:
            return out + [lost]
    if fit_ok or not _not_a_softmax(pm, s):  # (no scale to measure in what no softmax gives)
        out += _scale(pm, s, fit_ok, d_model)
    out += _normalization(pm, s, s.fit if fit_ok else None)
    return out


def _negative(pm: ProbeMeasure, s: SliceMeasure) -> np.ndarray:
    """T_q×T_k: finite weights below zero by more than the tolerance."""
    with np.errstate(invalid="ignore"):
        return np.isfinite(s.A) & (s.A < -pm.tol)


def _not_a_softmax(pm: ProbeMeasure, s: SliceMeasure) -> bool:
    """No softmax of any scores gives these weights: some are negative, or rows that read
    keys do not sum as the reference's (nor sum to 1 down the columns or over all)."""
    return bool(_negative(pm, s).any()) or s.mode == "none"


def _transposed_weights(pm: ProbeMeasure, s: SliceMeasure) -> Finding | None:
    """H: A V with A transposed (Aᵀ V): V = I reads back exactly the reference's weights,
    transposed."""
    if pm.T_q != pm.T_k or not np.isfinite(s.A).all() or s.err <= pm.tol:
        return None
    if float(np.abs(s.A - s.ref.T).max()) > pm.tol:
        return None
    msg = (
        "H: the output is Aᵀ V: V = I reads back the reference's weights A = softmax(S + M) "
        f"transposed (query row i gets column i of A): the values are read through the "
        f"transposed weights (on {pm.probe})"
    )
    return _finding(pm, s, "H", None, msg, transposed=True)


def _values_from_wrong_rows(pm: ProbeMeasure, s: SliceMeasure) -> Finding | None:
    """H: A V = ref G V with G a gather of value rows other than I: the weights are right
    and each key's weight multiplies another key's value."""
    R = s.value_map
    if R is None or s.value_misfit > 1e-3:
        return None
    G = np.rint(R)
    if not (np.isin(G, (0, 1)).all() and (G.sum(-1) == 1).all()) or (G == np.eye(len(G))).all():
        return None
    src = G.argmax(-1)  # key j's weight multiplies v_src[j]
    moved = np.flatnonzero(src != np.arange(len(src)))
    pairs = ", ".join(f"key {j + 1} → v_{src[j] + 1}" for j in moved[:4])
    msg = (
        f"H: the weights are right (V = I reads back A = softmax(S + M)) but H takes the "
        f"values from the wrong rows: {pairs}{' ...' if moved.size > 4 else ''} "
        f"(on {pm.probe})"
    )
    return _finding(pm, s, "H", None, msg, value_rows=[int(x) for x in src])


def _pattern(pm: ProbeMeasure, s: SliceMeasure) -> Finding | None:
    """M: the read pattern against the reference's. Rows holding NaN or inf are left to
    stage A; with read-back noise, keys whose reference weight is below it count as read."""
    P, E = s.read.copy(), s.allowed
    bad = ~np.isfinite(s.A).all(-1)
    P[bad] = E[bad]
    if pm.noise:
        P[E & ~P & (s.ref <= 10 * pm.noise)] = True
    if (P == E).all():
        return None
    fault, patched = match_pattern(pm, P, E, *s.index[:2])
    msg = (
        f"M: {describe_difference(P, E, pm.T_q, pm.T_k)}; expected {pm.pattern.describe()}"
        f" (on {pm.probe}, T_q×T_k = {pm.T_q}×{pm.T_k})"
    )
    if patched:
        it = verb(patched, "it is", "they are")
        msg += f"; every row but {rows_text(patched)} has {fault}'s form ({it} patched)"
    rows = np.flatnonzero((P != E).any(-1))
    return _finding(pm, s, "M", fault, msg, rows, patched_rows=list(patched))


def match_pattern(pm: ProbeMeasure, P: np.ndarray, E: np.ndarray, b: int = 0, h: int = 0):
    """(catalogue id or None, patched rows): the catalogued fault whose read pattern P is,
    exactly, else on every row but a patched first row or patched rows with no readable key
    (in the fault's form or in the reference). P, E: T_q×T_k; ``b``, ``h``: the batch row and
    head (a per-head mask gives each head its own form)."""
    forms = _forms(pm, P, E, b, h)
    for fid, F in forms:
        if F is not None and (P == F).all():
            return fid, []
    for fid, F in forms:
        if F is None:
            continue
        diff = (P != F).any(-1)
        patchable = ~F.any(-1) | ~E.any(-1)
        patchable[0] = True
        shows = (F != E).any(-1) & ~diff  # the fault is seen on rows that are not patched
        if diff.any() and not (diff & ~patchable).any() and shows.any():
            return fid, [int(r) for r in np.flatnonzero(diff)]
    return None, []


def _forms(pm: ProbeMeasure, P, E, b, h=0) -> list:
    """(id, the read pattern of that fault on this probe) in the catalogue's order of
    preference; a form None was decided otherwise (finite-min-added-twice: by its rows)."""
    pat, T_q, T_k = pm.pattern, pm.T_q, pm.T_k
    if not pat.causal:
        return []
    nopad = masks.Pattern(causal=True, window=pat.window, chunk=pat.chunk).allowed(1, 1, T_q, T_k)
    nopad = nopad[0, 0]
    out = [("no-mask", np.ones_like(P))]
    empty = ~E.any(-1)
    if pat.lengths is not None or pat.key_padding_mask is not None:
        out.append(("padding-ignored", nopad))
        twice = (P[~empty] == E[~empty]).all() and P[empty].any()
        out.append(("finite-min-added-twice", P if twice else None))
        keys = (
            masks.Pattern(causal=False, lengths=pat.lengths, key_padding_mask=pat.key_padding_mask)
            .allowed(pm.B, 1, T_q, T_k)[b, 0]
            .any(0)
        )  # the keys that are not padding
        if T_q == T_k:
            out.append(("padding-queries-only", nopad & keys[:, None]))
    if T_q == T_k:
        out.append(("anti-causal-mask", nopad.T))
    out.append(("diagonal-blocked", E & ~own_key(T_q, T_k)))
    if T_q < T_k and pat.window is None:
        top_left = np.pad(masks.Pattern().allowed(1, 1, T_q, T_q)[0, 0], ((0, 0), (0, T_k - T_q)))
        out.append(("causal-top-left", top_left & (E | ~nopad)))
    if pat.window is not None:
        for w in (pat.window - 1, pat.window + 1):
            if w >= 1:
                fields = {n: getattr(pat, n) for n in masks.PATTERN_KEYWORDS}
                F = masks.Pattern(**{**fields, "window": w}).allowed(pm.B, pm.H, T_q, T_k)
                out.append(("window-off-by-one", np.broadcast_to(F, (pm.B, pm.H, T_q, T_k))[b, h]))
    return out


def _lost_precision(pm: ProbeMeasure, s: SliceMeasure) -> Finding | None:
    """A: right in shape (pattern, scale, sums) but beyond the accuracy rule for the
    function's dtype: precision lost inside the function."""
    if s.fit is None or s.err <= pm.tol or not (s.read == s.allowed).all():
        return None
    c, misfit = s.fit
    has = s.has_key
    sums_off = float(np.abs(s.sums - s.ref_sums)[has].max()) if has.any() else 0.0
    if (
        abs(c / pm.scale0 - 1) > SHAPE_SCALE_RTOL
        or misfit > SHAPE_MISFIT
        or sums_off > SUM_ATOL
        or s.rel_err > SHAPE_RTOL
        or _row_scaled(s)
    ):
        return None
    bits = -math.log2(max(s.rel_err, 2.0**-60))
    msg = (
        f"A: the weights have the reference's pattern, scale and sums, but are off by up to "
        f"{s.err:.3g} (relative {s.rel_err:.2g}: about {bits:.0f} significant bits; the "
        f"accuracy rule allows {pm.tol:.2g} in {pm.dtype}): precision is lost inside the "
        f"function (on {pm.probe})"
    )
    m = dict(err=s.err, rel_err=s.rel_err, tol=pm.tol, dtype=pm.dtype, bits=bits, scale=c)
    return _finding(pm, s, "A", None, msg, **m)


def _row_scaled(s: SliceMeasure) -> bool:
    """Each row is the reference times one factor of its own (a normalization fault, such
    as an epsilon in the denominator), not scattered rounding."""
    big = s.ref > 1e-3
    ratio = np.where(big, s.A / np.where(big, s.ref, 1), np.nan)
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a row with no weight above 1e-3
        off = np.nanmax(np.abs(ratio - 1), -1)
        spread = np.nanmax(ratio, -1) - np.nanmin(ratio, -1)
    rows = np.isfinite(off) & (off > 0)
    return bool(rows.any() and (spread[rows] <= 1e-3 * off[rows] + 1e-12).all())


def _scale(pm: ProbeMeasure, s: SliceMeasure, fit_ok: bool, d_model) -> list[Finding]:
    if s.fit is None:
        return []
    c0, dk, on = pm.scale0, pm.d_k, f"on {pm.probe}"
    if fit_ok:
        c = s.fit[0]
        if abs(c / c0 - 1) <= SCALE_RTOL:
            return []
        name, said = _scale_name(pm, c, d_model)
        msg = (
            f"S: the weights are the softmax of Q Kᵀ · {c:.4g}; expected · {c0:.4g} "
            f"({_expected_is(pm)}){said} ({on})"
        )
        return [_finding(pm, s, "S", name, msg, scale=c, expected=c0)]
    kt = s.fit_kt
    if kt is not None and kt[1] <= 2e-3 + 1e3 * float(np.finfo(np.float32).eps):
        msg = (
            f"S: the weights are the softmax of Q K · {kt[0]:.4g} (K not transposed; only "
            f"runs when T = d_k = {dk})"
        )
        return [_finding(pm, s, "S", "k-not-transposed", msg, scale=kt[0])]
    msg = (
        f"S: log A is not c·Q Kᵀ plus a constant per row on the keys each row reads (misfit "
        f"{s.fit[1]:.3g} in log space): the scores are not a multiple of Q Kᵀ ({on})"
    )
    return [_finding(pm, s, "S", None, msg, misfit=s.fit[1])]


def _expected_is(pm: ProbeMeasure) -> str:
    """What the expected factor is: 1/√d_k, or the scale the caller declared instead."""
    if abs(pm.scale0 * math.sqrt(pm.d_k) - 1) <= SCALE_RTOL:
        return f"1/√d_k, d_k = {pm.d_k}"
    return "the declared scale"


def _scale_name(pm: ProbeMeasure, c: float, d_model) -> tuple[str | None, str]:
    """(catalogue id or None, words): the sizes of the probe the factor ``c`` equals. An id
    only when one size fits and holds where the sizes move: 1/√d_v only when the run with
    d_v doubled follows it (with V = I, d_v = T_k); two sizes that fit name neither."""
    dk, dv, T, H = pm.d_k, pm.d_v or pm.T_k, pm.T_k, pm.H
    exprs = [
        ("1", 1.0, "missing-scale"),
        (f"1/d_k (d_k = {dk})", 1.0 / dk, "scale-by-dk"),
        (f"1/√d_v (d_v = {dv})", dv**-0.5, "scale-by-sqrt-dv"),
        (f"1/√T_k (T_k = {T})", T**-0.5, None),
    ]
    if d_model is not None:
        exprs.append((f"1/√d_model (d_model = {d_model})", d_model**-0.5, "scale-by-sqrt-dmodel"))
    if H > 1 and H * dk != d_model:  # (= d_model: the model's width, named as such)
        exprs.append((f"1/√(H·d_k) (H·d_k = {H * dk})", (H * dk) ** -0.5, None))
    fits = [(w, fid) for w, want, fid in exprs if abs(c / want - 1) <= SCALE_RTOL]
    note = ""
    w = pm.width
    if w is not None and any(fid == "scale-by-sqrt-dv" for _, fid in fits):
        follows = w.fit is not None and abs(w.fit[0] * math.sqrt(2 * dv) - 1) <= SCALE_RTOL
        if follows:  # the factor moved with d_v, not with T_k
            fits = [f for f in fits if not f[0].startswith("1/√T_k")]
        else:
            fits = [f for f in fits if f[1] != "scale-by-sqrt-dv"]
            if w.diff <= w.tol:
                note = f"; with d_v = {2 * dv} the weights do not change"
    if not fits:
        return None, note
    words = " or ".join(f[0] for f in fits)
    name = fits[0][1] if len(fits) == 1 else None
    return name, f"; the factor is {words}{note}"


def _normalization(pm: ProbeMeasure, s: SliceMeasure, fit) -> list[Finding]:
    mode, a, r, tol = s.mode, s.A, s.ref, pm.tol
    on = f"on {pm.probe}"
    neg = _negative(pm, s)
    if neg.any():
        rows = np.flatnonzero(neg.any(-1))
        low = float(a[neg].min())
        msg = (
            f"A: {rows_text(rows)} {verb(rows, 'holds', 'hold')} negative weights (down to "
            f"{low:.3g}): no softmax gives a negative weight, so the normalization is not "
            f"a softmax (is the exp missing?) ({on})"
        )
        return [_finding(pm, s, "A", None, msg, rows, min_weight=low)]
    if mode == "rows" or not s.has_key.any():  # (no row has a key: nothing to normalize)
        return []
    # a row that reads no key sums to 0: M already says why (it reads nothing)
    has, sums = s.has_key & s.read.any(-1), s.sums
    # the rows' common factor; where no row reads a key above the noise, the rows with one
    base = has if has.any() else s.has_key
    k = float(np.median(sums[base] / r.sum(-1)[base]))
    if mode == "none" and k > 0 and np.abs(a - k * r).max() <= tol * max(1.0, k):
        msg = (
            f"H: the output is {k:.6g}·A V: every row's weights sum to {k:.6g}, and divided "
            f"by that they are right ({on})"
        )
        return [_finding(pm, s, "H", None, msg, factor=k)]
    if mode == "cols":
        msg = (
            f"A: columns sum to 1, rows do not (row sums {few(a.sum(-1))}): the softmax ran "
            "over the query axis"
        )
        return [_finding(pm, s, "A", "softmax-query-axis", msg, row_sums=a.sum(-1).tolist())]
    if mode == "all":
        msg = (
            f"A: the whole {pm.T_q}×{pm.T_k} matrix sums to 1 (row sums {few(a.sum(-1))}): "
            "one softmax over all entries"
        )
        return [_finding(pm, s, "A", "softmax-all-entries", msg, row_sums=a.sum(-1).tolist())]
    if fit is not None and (sums[has] <= 1 + tol).all() and (sums[has] < 1 - tol).any():
        if s.full_err is not None and s.full_err <= max(tol, 1e-6):
            msg = (
                f"A: rows sum to less than 1 ({few(sums)}): the weights are softmax over all "
                "keys, then zeroed at blocked keys without renormalizing"
            )
            rows = np.flatnonzero(has & (sums < 1 - tol))
            return [_finding(pm, s, "A", "mask-after-softmax", msg, rows, row_sums=sums.tolist())]
    off = has & (np.abs(sums - r.sum(-1)) > tol)
    if not off.any():
        return []
    rows = np.flatnonzero(off)
    over = " (more than 1: no softmax sums so)" if (sums[off] > 1 + tol).any() else ""
    msg = (
        f"A: {rows_text(rows)} {verb(rows, 'sums', 'sum')} to {few(sums[off])} instead of "
        f"{few(r.sum(-1)[off])}{over} ({on})"
    )
    return [_finding(pm, s, "A", None, msg, rows, row_sums=sums.tolist())]


# -- per probe ---------------------------------------------------------------------------------
def _nondeterministic(main: ProbeMeasure) -> Finding | None:
    """H: two calls with the same input (V = I) return different outputs."""
    if main.repeat is None or main.repeat <= main.tol:
        return None
    msg = (
        f"H: the function is not deterministic: called twice on the same input ({main.probe}, "
        f"V = I) its outputs differ by up to {main.repeat:.3g} (the accuracy rule allows "
        f"{main.tol:.2g}); something random runs in it (dropout left on in eval?)"
    )
    return Finding("H", None, msg, probe=main.probe, measurement={"repeat": main.repeat})


def _nonlinear(main: ProbeMeasure) -> Finding | None:
    lin = main.linearity
    if lin is None or lin.err <= lin.tol or any(s.nonfinite_rows.size for s in main.slices):
        return None  # (NaN weights: stage A says it)
    zero = (
        f"; with V = 0 the output is up to {lin.zero:.3g}, not 0"
        if lin.zero > lin.tol
        else "; with V = 0 it is 0"
    )
    msg = (
        f"H: the output is not A V: with random values it differs from (its weights measured "
        f"with V = I) · V by up to {lin.err:.3g} (the accuracy rule allows {lin.tol:.2g})"
        f"{zero}"
    )
    return Finding("H", None, msg, probe=main.probe, measurement={"err": lin.err, "zero": lin.zero})


def _width(main: ProbeMeasure) -> list[Finding]:
    w = main.width
    if w is None or any(s.nonfinite_rows.size for s in main.slices) or w.diff <= w.tol:
        return []
    c1 = main.fitted_scale(main.slices[0]) if main.slices else None
    name = None
    if (
        w.fit is not None
        and c1 is not None
        and abs(w.fit[0] * math.sqrt(2 * w.d_v) - 1) < SCALE_RTOL
        and abs(c1 * math.sqrt(w.d_v) - 1) < SCALE_RTOL
    ):
        name = "scale-by-sqrt-dv"
    msg = "S: the weights change with the width of V (d_v)"
    if w.fit is not None and c1 is not None:
        msg += (
            f": Q Kᵀ · {c1:.4g} with d_v = {w.d_v}, · {w.fit[0]:.4g} with d_v = {2 * w.d_v}; "
            f"expected · {main.scale0:.4g} ({_expected_is(main)})"
        )
    return [Finding("S", name, msg, probe=main.probe, measurement={"diff": w.diff})]


def _projection(main: ProbeMeasure) -> list[Finding]:
    pr = main.projection
    if pr is None:
        return []
    if pr.error is not None:
        msg = f"O: with random W_V, W_O the function raised {pr.error}"
        return [Finding("O", None, msg, probe=main.probe)]
    if pr.err is not None and pr.err <= pr.tol:
        return []
    if pr.err_missing is not None and pr.err_missing <= pr.tol:
        fid, what = "output-projection-missing", "O equals H: W_O is never applied"
    elif pr.err_transposed is not None and pr.err_transposed <= pr.tol:
        fid, what = "output-projection-transposed", "O equals H W_Oᵀ"
    elif pr.err is None:
        fid, what = None, f"O has shape {pr.shape}, H W_O is {pr.expected_shape}"
    else:
        fid, what = None, f"O differs from H W_O by up to {pr.err:.3g}"
    msg = f"O: {what} (H from the measured weights)"
    return [Finding("O", fid, msg, probe=main.probe, measurement={"err": pr.err})]


def _stability(pm: ProbeMeasure, main: ProbeMeasure) -> list[Finding]:
    """Large scores: NaN or inf where ordinary scores gave none (exp overflows); weight on
    blocked keys that the main probe did not read (a finite fill the scores overcome)."""
    if any(s.nonfinite_rows.size for s in main.slices):
        return []  # NaN at ordinary scores already
    bad = np.zeros(pm.T_q, bool)
    for s in pm.slices:
        bad[s.nonfinite_rows] = True
    if bad.any():
        rows = np.flatnonzero(bad)
        msg = (
            f"A: at scores up to |S| = {pm.S_max:.3g} {rows_text(rows)} "
            f"{verb(rows, 'comes', 'come')} out NaN or inf: exp overflows without the row "
            "maximum subtracted"
        )
        return [Finding("A", "unstable-softmax", msg, probe=pm.probe, rows=_rows(bad))]
    seen = main.read if main.read.shape == pm.read.shape else np.zeros_like(pm.read)
    leak = np.zeros((pm.B, pm.H, pm.T_q, pm.T_k), bool)
    wmax = 0.0
    for s in pm.slices:
        cells = ~s.allowed & s.has_key[:, None] & (np.abs(s.A) > pm.noise) & ~seen[s.index]
        leak[s.index] = cells
        if cells.any():
            wmax = max(wmax, float(np.abs(np.where(cells, s.A, 0)).max()))
    if not leak.any():
        return []
    rows = leak.any((0, 1, 3))
    msg = (
        f"M: at scores up to |S| = {pm.S_max:.3g} blocked keys get weight (up to {wmax:.3g}) "
        f"on {rows_text(np.flatnonzero(rows))}: the fill that blocks them is finite and the "
        "scores overcome it"
    )
    return [
        Finding(
            "M",
            "finite-fill-too-weak",
            msg,
            probe=pm.probe,
            rows=_rows(rows),
            measurement={"weight": wmax, "S_max": pm.S_max},
        )
    ]


def _rows(mask) -> tuple:
    return tuple(int(r) for r in np.flatnonzero(mask))


def _long_rows(pm: ProbeMeasure) -> list[Finding]:
    r = pm.sums
    err = np.abs(r.sums - 1)
    if np.isfinite(err).all() and err.max() <= r.tol:
        return []
    msg = (
        f"A: in fp16, rows reading {r.keys} keys sum to {few(r.sums)} instead of 1 (plain fp16 "
        f"math with fp32 accumulation is off by {r.plain_err:.2g}): the softmax accumulates in "
        "fp16"
    )
    m = {"sums": r.sums.tolist(), "keys": r.keys, "plain_err": r.plain_err}
    return [Finding("A", "softmax-fp16-accumulation", msg, probe=pm.probe, measurement=m)]


# -- merging and ordering --------------------------------------------------------------------
def _merge(pm: ProbeMeasure, fs: list[Finding]) -> list[Finding]:
    """One finding per (stage, fault) of a probe (the first slice's, in dependency order);
    findings in some heads only of a multi-head probe become one ``some-heads-only``."""
    fs = sorted(fs, key=Finding.key)
    heads_bad = sorted({f.slice[1] for f in fs if f.slice})
    if pm.H > 1 and 0 < len(heads_bad) < pm.H:
        top = fs[0]
        ok = [h for h in range(pm.H) if h not in heads_bad]
        msg = (
            f"{'head' if len(heads_bad) == 1 else 'heads'} "
            f"{', '.join(str(h + 1) for h in heads_bad)} of {pm.H}: {top.message}; "
            f"{'head' if len(ok) == 1 else 'heads'} {', '.join(str(h + 1) for h in ok)}"
            f" {'matches' if len(ok) == 1 else 'match'} the reference"
        )
        m = {**top.measurement, "heads": heads_bad, "fault": top.fault}
        return [Finding(top.stage, "some-heads-only", msg, top.probe, m, top.rows, top.slice)]
    out: list[Finding] = []
    for f in fs:
        if not any((g.stage, g.fault) == (f.stage, f.fault) for g in out):
            out.append(f)
    return out


def _faults(f: Finding) -> set:
    return {f.fault, f.measurement.get("fault")} - {None}


def _explained(f: Finding, main: list[Finding]) -> bool:
    """Whether the main probe's findings already account for ``f`` (a further probe's)."""
    if any(_faults(f) & _faults(m) for m in main):
        return True
    if f.fault is None and any(m.stage == f.stage for m in main):
        return True
    if f.stage not in ("S", "M", "A"):
        return False
    # the values come from other rows (or through Aᵀ): what later probes read back is not A
    if any("value_rows" in m.measurement or "transposed" in m.measurement for m in main):
        return True
    # the weights read back through V = I are not A there: unnamed S, M, A follow
    return f.fault is None and any(m.stage == "H" for m in main)


def _duplicate(f: Finding, shown: list[Finding]) -> bool:
    return any(
        (_faults(f) & _faults(g)) or (f.fault is None and g.fault is None and f.stage == g.stage)
        for g in shown
    )


# -- what these probes cannot show -------------------------------------------------------------
def untested(
    sig: str, has_wo: bool, pad_kind, declared: dict, ran: list[str], main_kind: str
) -> list[str]:
    """The catalogued faults the probes that ran cannot show (in catalogue order)."""
    out = []
    if not has_wo:
        out += ["output-projection-missing", "output-projection-transposed"]
    if not pad_kind and "lengths" not in declared and "key_padding_mask" not in declared:
        out += ["padding-ignored", "padding-queries-only", "finite-min-added-twice"]
        out.append("nan-on-empty-rows")
    if not any(n.startswith("decoding") for n in ran):
        out.append("causal-top-left")
    if "window" not in declared:
        out.append("window-off-by-one")
    if "long fp16 rows" not in ran:
        out.append("softmax-fp16-accumulation")
    if sig == "qkv" and main_kind != "T = d_k" and "T = d_k probe" not in ran:
        out.append("k-not-transposed")
    if sig == "qkv":
        out.append("scale-by-sqrt-dmodel")
    return [f.id for f in CATALOGUE if f.id in out]


def verdict(
    findings: list[Finding],
    measures: Sequence[ProbeMeasure],
    *,
    details: dict,
    untested: list[str],
    reads_back: bool = True,
    located: tuple = (None, "", {}),
) -> Diagnosis:
    """The Diagnosis of the judge's ``findings``: the first names fault, stage, message and
    location (``located``: file:line, code, facts of the white-box pass); the read pattern,
    the expected one and the scale of the main probe (``measures[0]``), on the slice of the
    first finding (none when V = I does not read the weights back); which probes ran."""
    main = measures[0]
    top = findings[0] if findings else None
    index = top.slice if top is not None and top.probe == main.probe and top.slice else (0, 0)
    s = next((x for x in main.slices if tuple(x.index) == tuple(index)), None)
    top_m = top.measurement if top is not None else {}
    base = dict(
        untested=untested,
        details=details,
        # (read back through Aᵀ, the pattern is not the one the queries read)
        pattern=None if s is None or not reads_back or "transposed" in top_m else s.read,
        expected=None if s is None else s.allowed,
        scale=None if s is None else main.fitted_scale(s),
        d_k=main.d_k,
    )
    ran = details.get("probes", [])
    if top is None:
        message = "matches the reference on every probe (" + ", ".join(ran) + ")"
        return Diagnosis(None, None, message, status=Status.CLEAN, **base)
    shown = next((m for m in measures if m.probe == top.probe), None)
    if shown is not main and shown is not None and top.slice:
        t = next((x for x in shown.slices if tuple(x.index) == tuple(top.slice)), None)
        if t is not None:
            details["pattern_of"] = {
                "probe": top.probe,
                "slice": list(top.slice),
                "pattern": t.read.tolist(),
                "expected": t.allowed.tolist(),
            }
    location, code, facts = located
    details.update({"whitebox": facts, "code": code})
    status = Status.FAULT if top.fault else Status.UNKNOWN
    return Diagnosis(top.fault, top.stage, top.text, location, status, list(findings), **base)
