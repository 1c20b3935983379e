"""Diagnose someone else's attention: measure what it does, then name the first stage that
differs from the reference (and the catalogued fault, when one fits).

``diagnose(fn)`` runs ``fn`` on probes (:mod:`.probes`) and measures (:mod:`.measure`)
its effective weights (values V = I give A itself), read pattern, normalization, scale,
linearity in V, stability at large scores and in fp16, per head. What is expected is
declared with the keywords of :func:`causalattn.attention` (``window=``, ``chunk=``,
``softcap=``, ``sinks=`` ...; default plain causal) and built by
:class:`causalattn.masks.Pattern` and :mod:`causalattn.reference`. The first stage in
dependency order (S, M, A, H, O) that differs is reported with its measurement; the
fault id comes from the one catalogue (:mod:`.faults`) or is None. A white-box pass
records the operations (torch: a TorchFunctionMode; NumPy: an ndarray subclass) and
points at the user's ``file:line``.

Calling conventions (``signature=``): ``"qkv"`` — ``fn(q, k, v)``, q, k: ``T×d_k``,
v: ``T×d_v``, or with leading (B, H) axes, optionally taking ``key_padding_mask=`` (B, T)
or ``lengths=`` (B,); ``"x-weights"`` — ``fn(x, w_q, w_k, w_v[, w_o])`` in the seeds'
``X W`` layout, one head; ``"module"`` — an ``nn.Module`` whose ``forward(x)`` takes
``(1, T, d_model)``: its projections are found by name and replaced (on a copy).

Isolation: by default the probes run in a worker process with a deadline (``timeout``),
in a session of its own that is killed whole; ``"path/file.py:name"`` always does.
``isolate=False`` runs a callable in this process (no deadline).
"""

from __future__ import annotations

import inspect
import math
from pathlib import Path

import numpy as np

from .. import masks
from .callers import SIGNATURES, Subject, _discover_signature, _framework, _ModuleAdapter, _pad_kind
from .faults import BY_ID, CATALOGUE
from .measure import (
    Finding,
    expected_weights,
    fit_scale,
    normalization,
    pattern_findings,
    plain_weights,
    read_pattern,
    rows_text,
    tolerance,
)
from .probes import Probe, merge_heads, qkv_probe, split_heads, x_probe
from .record import _record, _record_numpy, _whitebox
from .report import Diagnosis, Status, check_declared_scale

__all__ = ["diagnose", "PATTERN_KEYWORDS"]

# the declared pattern: the keywords of causalattn.attention / masks.Pattern
PATTERN_KEYWORDS = masks.PATTERN_KEYWORDS
_LONG_T = 2500  # fp16 rows this long lose their sums when accumulated in fp16


def diagnose(
    fn,
    *,
    signature: str | None = None,
    timeout: float = 60.0,
    isolate: bool = True,
    scale: float | None = None,
    causal: bool = True,
    window: int | None = None,
    chunk: int | None = None,
    lengths=None,
    key_padding_mask=None,
    cu_seqlens=None,
    prefix_lengths=None,
    mask=None,
    alibi_slopes=None,
    softcap: float | None = None,
    sinks=None,
    mask_mod=None,
    score_mod=None,
    max_memory: int = 4 * 2**30,
) -> Diagnosis:
    """Measure ``fn``'s attention and name the first stage that differs from the declared one.

    ``fn``: a callable, an ``nn.Module`` or ``"path/file.py:name"`` (a function, a module
    instance, an nn.Module class constructible without arguments, or a function without
    arguments returning one). ``signature``: ``"qkv"``, ``"x-weights"`` or ``"module"``
    (discovered when None). The pattern keywords and ``scale`` (default 1/√d_k) declare what
    ``fn`` should compute, as for :func:`causalattn.attention` (``mask_mod`` and
    ``score_mod`` too: evaluated on every probe's shape). ``timeout`` (seconds) and
    ``max_memory`` (bytes) bound the worker process; ``isolate=False`` runs a callable here.
    """
    if signature is not None and signature not in SIGNATURES:
        raise ValueError(f"diagnose: signature must be one of {SIGNATURES}, got {signature!r}")
    timeout = _check_timeout(timeout)
    declared = {
        "causal": causal,
        "window": window,
        "chunk": chunk,
        "lengths": lengths,
        "key_padding_mask": key_padding_mask,
        "cu_seqlens": cu_seqlens,
        "prefix_lengths": prefix_lengths,
        "mask": mask,
        "alibi_slopes": alibi_slopes,
        "softcap": softcap,
        "sinks": sinks,
        "mask_mod": mask_mod,
        "score_mod": score_mod,
    }
    declared = {k: _plain(v) for k, v in declared.items() if v is not None}
    masks.Pattern(**declared)  # refuse a bad declaration here, naming the argument
    if isinstance(fn, (str, Path)):  # a fresh interpreter: the declaration is pickled
        _check_picklable({k: v for k, v in declared.items() if k in masks.CALLABLES})
    check_declared_scale("diagnose", scale)
    from . import runner

    if isinstance(fn, (str, Path)):
        return runner.diagnose_path(str(fn), signature, declared, scale, timeout, max_memory)
    if not callable(fn):
        raise ValueError(
            f"diagnose: expected a callable, an nn.Module or 'file.py:name', got "
            f"{type(fn).__name__}"
        )
    if signature is None:
        signature = _discover_signature(fn)  # bad signatures are refused here, not in a worker
    if not isolate:
        return diagnose_here(fn, signature, declared, scale)
    return runner.diagnose_isolated(fn, signature, declared, scale, timeout, max_memory)


def _check_timeout(timeout) -> float:
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise ValueError(f"diagnose: timeout must be a number of seconds, got {timeout!r}")
    t = float(timeout)
    if not math.isfinite(t) or t <= 0:
        raise ValueError(f"diagnose: timeout must be a finite number of seconds > 0, got {t:g}")
    return t


def _check_picklable(fns: dict) -> None:
    import pickle

    for name, fn in fns.items():
        try:
            pickle.dumps(fn)
        except Exception as exc:  # noqa: BLE001 - any pickling failure is named
            raise ValueError(
                f"diagnose: the declared {name} cannot travel to the worker interpreter "
                f"({exc}); define it at module level"
            ) from None


def _plain(v):
    """Arrays as NumPy (the declaration travels to a worker process as JSON)."""
    if type(v).__module__.startswith("torch"):
        return v.detach().cpu().numpy()
    return np.asarray(v) if isinstance(v, (list, tuple)) else v


# -- the measurement plan -----------------------------------------------------------------
class _Plan:
    """The probes for one function, and what was measured on them."""

    def __init__(self, sig, dims, pad_kind, declared, dtype, has_wo):
        self.sig, self.dims, self.pad_kind, self.declared = sig, dims, pad_kind, declared
        self.dtype, self.has_wo = dtype, has_wo
        self.rng = np.random.default_rng(1234)
        fixed = [k for k in ("lengths", "key_padding_mask", "prefix_lengths") if k in declared]
        self.B = len(declared[fixed[0]]) if fixed else 1
        key_padding = declared.get("key_padding_mask")
        self.T_fixed = None if key_padding is None else int(np.asarray(key_padding).shape[-1])
        if "mask" in declared:
            self.T_fixed = int(np.asarray(declared["mask"]).shape[-1])
        self.per_batch = bool(fixed) or "mask" in declared or "cu_seqlens" in declared
        self.H = (
            len(np.asarray(declared["sinks"]))
            if "sinks" in declared
            else (
                np.asarray(declared["alibi_slopes"]).shape[-1] if "alibi_slopes" in declared else 1
            )
        )

    def pattern(self, **extra) -> masks.Pattern:
        return masks.Pattern(**{**self.declared, **extra})

    def make(
        self,
        name,
        *,
        T_q=None,
        T=6,
        d_k=4,
        mag=1.2,
        dtype=None,
        B=None,
        H=None,
        pattern=None,
        kwargs=None,
        negative=False,
    ):
        dtype = dtype or self.dtype
        B = self.B if B is None else B
        if kwargs is None and self.pad_kind in self.declared:  # the function takes it: pass it
            kwargs = {self.pad_kind: np.asarray(self.declared[self.pad_kind])}
        T = self.T_fixed or T
        pat = pattern or self.pattern()
        if self.sig == "qkv":
            return qkv_probe(
                name,
                self.rng,
                B=B,
                H=H or self.H,
                T_q=T_q or T,
                T_k=T,
                d_k=d_k,
                mag=mag,
                dtype=dtype,
                pattern=pat,
                kwargs=kwargs,
                negative=negative,
            )
        d = self.dims
        return x_probe(
            name,
            self.rng,
            B=B,
            T=T,
            d_model=d["d_model"],
            heads=d["heads"] or 1,
            d_k=d["d_k"],
            mag=mag,
            dtype=dtype,
            pattern=pat,
            kwargs=kwargs,
        )

    def main_probes(self) -> list[Probe]:
        """The main probe (T ≠ d_k), and T = d_k for code that only runs there."""
        if self.sig == "module":
            d_k, dm = self.dims["d_k"], self.dims["d_model"]
            T = min(6, dm)
            T = T - 1 if T == d_k and T > 2 else T
            return [self.make("main probe", T=T, d_k=d_k)]
        if self.sig == "x-weights":
            self.dims = {"d_model": 8, "d_k": 3, "heads": None, "hd_v": 6, "d_out": 6}
        T = self.T_fixed or 6
        d_k = 3 if T != 3 else 4
        return [self.make("main probe", T=T, d_k=d_k), self.make("T = d_k probe", T=T, d_k=T)]


def diagnose_here(fn, sig, declared, scale) -> Diagnosis:
    """The diagnosis, in this process."""
    framework = _framework(fn)
    adapter = _ModuleAdapter(fn) if sig == "module" else None
    dims = adapter.dims if adapter else {}
    if adapter and dims["w_o"] and dims["d_out"] < dims["hd_v"]:
        raise ValueError(
            f"diagnose: W_O maps h·d_v = {dims['hd_v']} to d_out = "
            f"{dims['d_out']}; the weights cannot be read back through it"
        )
    pad_kind = _pad_kind(fn) if sig != "module" else None
    subject = Subject(fn, sig, framework, adapter)
    has_wo = sig == "module" and dims["w_o"] or sig == "x-weights" and _n_required(fn) >= 5
    subject.has_wo = has_wo
    dtype = np.float32 if framework == "torch" else np.float64
    if adapter is not None:
        dtype = np.dtype(str(next(fn.parameters()).dtype).replace("torch.", ""))
    plan = _Plan(sig, dims, pad_kind, declared, dtype, has_wo)
    details = {
        "signature": sig,
        "framework": framework,
        "padding": pad_kind,
        "declared": plan.pattern().describe(),
    }
    return _Measurement(subject, plan, scale, details).run()


def _n_required(fn) -> int:
    return len(
        [
            p
            for p in inspect.signature(fn).parameters.values()
            if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
    )


def _eye(T):
    return np.eye(T)[None, None]


class _Measurement:
    def __init__(self, subject: Subject, plan: _Plan, scale, details):
        self.s, self.plan, self.scale, self.details = subject, plan, scale, details
        self.findings: list[Finding] = []
        self.ran: list[str] = []
        self.dropped: list[str] = []
        self.scales: dict = {}  # (probe, b, h) -> measured scale
        self.measured: dict = {}  # probe name -> (probe, A)

    def work_dtype(self, p: Probe) -> np.dtype:
        """The function's working precision: the lower of its inputs' and its output's."""
        o = self.s.out_dtype
        if o is None or o.kind != "f" or np.finfo(o).eps < np.finfo(p.dtype).eps:
            return np.dtype(p.dtype)
        return np.dtype(o)

    def noise(self, A: np.ndarray, p: Probe) -> float:
        """Read-back error of weights measured through W_V = pinv(x)·V (0 for fn(q, k, v))."""
        if self.plan.sig == "qkv":
            return 0.0
        fin = np.abs(A[np.isfinite(A)])
        return (
            1e3
            * float(np.finfo(self.work_dtype(p)).eps)
            * max(1.0, float(fin.max()) if fin.size else 1.0)
        )

    def c0(self, p: Probe) -> float:
        return self.scale if self.scale is not None else masks.default_scale(p.d_k)

    def weights(self, p: Probe) -> np.ndarray:
        A = self.s.values(p, _eye(p.T_k))
        self.measured[p.name] = (p, A)
        return A

    def try_weights(self, p: Probe):
        try:
            with np.errstate(all="ignore"):
                A = self.weights(p)
            self.ran.append(p.name)
            return A
        except MemoryError:
            raise
        except Exception:  # the function refuses this probe: note it, go on
            self.dropped.append(p.name)
            return None

    # -- the stages on one probe's measured weights
    def analyze(self, p: Probe, A: np.ndarray) -> list[Finding]:
        """S, M and A findings per (b, h) slice of a probe."""
        out: list[Finding] = []
        E = p.allowed()
        c0 = self.c0(p)
        t = self.work_dtype(p)
        ref = expected_weights(p, c0)
        tol = tolerance(ref, plain_weights(p, c0, t), t) + self.noise(A, p)
        noise = self.noise(A, p)
        out += pattern_findings(p, A, E, noise, ref)
        for b, h in np.ndindex(p.B, p.H):
            a, e, r = A[b, h], E[b, h], ref[b, h]
            has = e.any(-1)
            bad = has & ~np.isfinite(a).all(-1)
            if bad.any():
                out.append(
                    Finding(
                        "A",
                        None,
                        f"A: {rows_text(np.flatnonzero(bad))} hold NaN or "
                        f"inf weights at ordinary scores (on {p.name})",
                        (b, h),
                        p.name,
                    )
                )
                continue
            empty_nan = ~has & np.isnan(a).any(-1)
            if empty_nan.any():
                rows = rows_text(np.flatnonzero(empty_nan))
                out.append(
                    Finding(
                        "A",
                        "nan-on-empty-rows",
                        f"A: {rows} have no readable key and come out NaN, not zero (on {p.name})",
                        (b, h),
                        p.name,
                    )
                )
            mode = normalization(a, r, e, tol)
            use = read_pattern(a, noise) & e & (np.abs(a) > 1e-3 * max(1e-300, np.abs(a).max()))
            sub = _slice(p, b, h)
            fit = fit_scale(sub, a[None, None], use[None, None], "rows" if mode == "none" else mode)
            fit_ok = fit is not None and fit[1] <= 2e-3 + 1e3 * float(np.finfo(t).eps)
            if fit is not None and fit_ok:
                self.scales[(p.name, b, h)] = fit[0]
            out += self._scale_findings(sub, fit, fit_ok, c0, b, h, a, use, mode)
            out += self._norm_findings(p, a, e, r, tol, mode, b, h, fit if fit_ok else None, noise)
            if fit_ok and mode == "rows" and (read_pattern(a, noise) == e).all():
                err = float(np.abs(np.where(has[:, None], a - r, 0)).max())
                if err > tol and abs(fit[0] / c0 - 1) <= 2e-3:
                    out.append(
                        Finding(
                            "A",
                            None,
                            f"A: the weights differ from softmax(S + M) "
                            f"by up to {err:.3g} (the accuracy rule allows {tol:.2g} "
                            f"in {np.dtype(t).name}; on {p.name})",
                            (b, h),
                            p.name,
                        )
                    )
        return out

    def _scale_findings(self, p, fit, fit_ok, c0, b, h, a, use, mode):
        dk = p.d_k
        if fit is None:
            return []
        if fit_ok:
            c = fit[0]
            if abs(c / c0 - 1) <= 2e-3:
                return []
            name = None
            cands = [
                ("missing-scale", 1.0),
                ("scale-by-dk", 1.0 / dk),
                ("scale-by-sqrt-dv", 1.0 / math.sqrt(p.T_k)),
            ]
            if self.plan.sig != "qkv":
                cands.append(("scale-by-sqrt-dmodel", 1.0 / math.sqrt(self.plan.dims["d_model"])))
            for fid, want in cands:
                if abs(c / want - 1) <= 2e-3 and abs(want / c0 - 1) > 2e-3:
                    name = fid
                    break
            return [
                Finding(
                    "S",
                    name,
                    f"S: the weights are the softmax of Q Kᵀ · {c:.4g}; "
                    f"expected · {c0:.4g} (1/√d_k, d_k = {dk}) (on {p.name})",
                    (b, h),
                    p.name,
                )
            ]
        if p.T_q == p.T_k == dk:  # Q K instead of Q Kᵀ?
            G2 = p.Q @ p.K
            f2 = fit_scale(
                p, a[None, None], use[None, None], mode if mode != "none" else "rows", G=G2
            )
            if f2 is not None and f2[1] <= 2e-3 + 1e3 * float(np.finfo(np.float32).eps):
                return [
                    Finding(
                        "S",
                        "k-not-transposed",
                        f"S: the weights are the softmax of "
                        f"Q K · {f2[0]:.4g} (K not transposed; only runs when T = d_k "
                        f"= {dk})",
                        (b, h),
                        p.name,
                    )
                ]
        return [
            Finding(
                "S",
                None,
                f"S: log A is not c·Q Kᵀ plus a constant per row on the "
                f"keys each row reads (misfit {fit[1]:.3g} in log space): the scores "
                f"are not a multiple of Q Kᵀ (on {p.name})",
                (b, h),
                p.name,
            )
        ]

    def _norm_findings(self, p, a, e, r, tol, mode, b, h, fit, noise):
        if mode == "rows":
            return []
        has = e.any(-1)
        sums = np.where(np.isfinite(a), a, 0).sum(-1)
        k = float(np.median(sums[has] / r.sum(-1)[has])) if has.any() else 1.0
        if mode == "none" and k > 0 and np.abs(a - k * r).max() <= tol * max(1.0, k):
            return [
                Finding(
                    "H",
                    None,
                    f"H: the output is {k:.6g}·A V: every row's weights "
                    f"sum to {k:.6g}, and divided by that they are right (on {p.name})",
                    (b, h),
                    p.name,
                )
            ]
        if mode == "cols":
            return [
                Finding(
                    "A",
                    "softmax-query-axis",
                    "A: columns sum to 1, rows do not "
                    f"(row sums {_few(a.sum(-1))}): the softmax ran over the query axis",
                    (b, h),
                    p.name,
                )
            ]
        if mode == "all":
            return [
                Finding(
                    "A",
                    "softmax-all-entries",
                    f"A: the whole {p.T_q}×{p.T_k} matrix "
                    f"sums to 1 (row sums {_few(a.sum(-1))}): one softmax over all "
                    "entries",
                    (b, h),
                    p.name,
                )
            ]
        if fit is not None and (sums[has] <= 1 + tol).all() and (sums[has] < 1 - tol).any():
            full = expected_weights(_slice(p, b, h), fit[0], np.ones((1, 1, p.T_q, p.T_k), bool))[
                0, 0
            ]
            if np.abs(a - full * read_pattern(a, noise)).max() <= max(tol, 1e-6):
                return [
                    Finding(
                        "A",
                        "mask-after-softmax",
                        f"A: rows sum to less than 1 "
                        f"({_few(sums)}): the weights are softmax over all keys, then "
                        "zeroed at blocked keys without renormalizing",
                        (b, h),
                        p.name,
                    )
                ]
        off = has & (np.abs(sums - r.sum(-1)) > tol)
        return [
            Finding(
                "A",
                None,
                f"A: {rows_text(np.flatnonzero(off))} sum to "
                f"{_few(sums[off])} instead of {_few(r.sum(-1)[off])} (on {p.name})",
                (b, h),
                p.name,
            )
        ]

    # -- linearity in V (stage H) and the d_v dependence of the scale (stage S)
    def linearity(self, p: Probe, A: np.ndarray) -> list[Finding]:
        rng = np.random.default_rng(7)
        n = p.T_k
        V = rng.normal(size=(1, p.H, p.T_k, n))
        got = self.s.values(p, V)
        t = self.work_dtype(p)
        ref = A @ V
        At, Vt = A.astype(t), V.astype(t)
        plain = (At @ Vt).astype(np.float64)
        tol = tolerance(ref, plain, t) + self.noise(A, p) * p.T_k * float(np.abs(V).max())
        with np.errstate(invalid="ignore"):
            err = np.abs(got - ref)
        e = float(np.nanmax(err)) if np.isfinite(err).any() else np.inf
        if np.isnan(err).any():
            e = np.inf
        if e <= tol:
            return []
        zero = self.s.values(p, np.zeros((1, p.H, p.T_k, n)))
        z = float(np.nanmax(np.abs(zero))) if zero.size else 0.0
        return [
            Finding(
                "H",
                None,
                f"H: the output is not A V: with random values it differs "
                f"from (its weights measured with V = I) · V by up to {e:.3g} (the "
                f"accuracy rule allows {tol:.2g}); with V = 0 the output is up to "
                f"{z:.3g}, not 0",
                (),
                p.name,
            )
        ]

    def dv_dependence(self, p: Probe, A: np.ndarray) -> list[Finding]:
        if self.plan.sig == "module" or not np.isfinite(A).all():
            return []
        V = np.concatenate([_eye(p.T_k), np.zeros((1, 1, p.T_k, p.T_k))], -1)
        A2 = self.s.values(p, V)[..., : p.T_k]
        t = self.work_dtype(p)
        if np.abs(A2 - A).max() <= 1e3 * float(np.finfo(t).eps) + self.noise(A, p):
            return []
        E = p.allowed()
        use = read_pattern(A2) & E & (A2 > 1e-3 * A2.max())
        fit = fit_scale(p, A2, use, "rows")
        c1 = self.scales.get((p.name, 0, 0))
        name = None
        if (
            fit is not None
            and c1 is not None
            and abs(fit[0] * math.sqrt(2 * p.T_k) - 1) < 2e-3
            and abs(c1 * math.sqrt(p.T_k) - 1) < 2e-3
        ):
            name = "scale-by-sqrt-dv"
        msg = "S: the weights change with the width of V (d_v)"
        if fit is not None and c1 is not None:
            msg += (
                f": Q Kᵀ · {c1:.4g} with d_v = {p.T_k}, · {fit[0]:.4g} with d_v = "
                f"{2 * p.T_k}; expected · {self.c0(p):.4g} (1/√d_k, d_k = {p.d_k})"
            )
        return [Finding("S", name, msg, (), p.name)]

    # -- stability
    def stability(self, base: Probe) -> list[Finding]:
        out: list[Finding] = []
        plan = self.plan
        probes = [("large-score probe", 40.0, False), ("huge-score probe", 550.0, False)]
        if plan.sig == "qkv":
            probes.append(("negative-score probe", 400.0, True))
        for name, mag, neg in probes:
            p = plan.make(
                name,
                T=base.T_k,
                d_k=base.d_k,
                mag=mag / max(1.0, base.d_k**0.25),
                H=base.H,
                negative=neg,
            )
            A = self.try_weights(p)
            if A is None:
                continue
            E = p.allowed()
            has = E.any(-1)
            S_max = float(np.abs(p.G() * self.c0(p)).max())
            bad = has & ~np.isfinite(A).all(-1)
            if bad.any():
                out.append(
                    Finding(
                        "A",
                        "unstable-softmax",
                        f"A: at scores up to |S| = "
                        f"{S_max:.3g} {rows_text(np.flatnonzero(bad.any((0, 1))))} "
                        "come out NaN or inf: exp overflows without the row maximum "
                        "subtracted",
                        (),
                        p.name,
                    )
                )
                continue
            leak = ~E & has[..., None] & (np.abs(A) > self.noise(A, p))
            if leak.any():
                wmax = float(np.abs(np.where(leak, A, 0)).max())
                out.append(
                    Finding(
                        "M",
                        "finite-fill-too-weak",
                        f"M: at scores up to |S| = "
                        f"{S_max:.3g} blocked keys get weight (up to {wmax:.3g}) on "
                        f"{rows_text(np.flatnonzero(leak.any((0, 1, 3))))}: the fill "
                        "that blocks them is finite and the scores overcome it",
                        (),
                        p.name,
                    )
                )
        return out

    def fp16(self, base: Probe) -> list[Finding]:
        if self.plan.sig == "module":
            return []
        out: list[Finding] = []
        p = self.plan.make("fp16 probe", T=base.T_k, d_k=base.d_k, dtype=np.float16, H=base.H)
        A = self.try_weights(p)
        if A is not None:
            out += [f for f in self.analyze(p, A) if f.stage != "S"]
        if self.plan.sig != "qkv" or self.plan.T_fixed or self.plan.per_batch:
            return out
        if self.plan.declared.get("sinks") is not None:
            return out  # rows do not sum to 1 with sinks; the fp16 probe above covers them
        for T_q in (4, _LONG_T):  # decoding layout first: 4 long rows are cheap to run
            p = self.plan.make(
                "long fp16 rows", T_q=T_q, T=_LONG_T, d_k=3, mag=0.1, dtype=np.float16, H=1
            )
            try:
                sums = self.s.values(p, np.ones((1, 1, p.T_k, 1)))[0, 0, :, 0]
                self.ran.append(p.name)
                break
            except Exception:
                continue
        else:
            self.dropped.append("long fp16 rows")
            return out
        rows = np.arange(p.T_q - min(4, p.T_q), p.T_q)  # the longest rows
        E = p.allowed()[0, 0, rows]
        S = (p.Q[0, 0, rows] @ p.K[0, 0].T) * self.c0(p)
        plain = _plain_fp16_row_sums(np.where(E, S, -np.inf))
        got = sums[rows]
        tol = 2 * float(np.abs(plain - 1).max()) + 8 * float(np.finfo(np.float16).eps)
        err = np.abs(got - 1)
        if not np.isfinite(err).all() or err.max() > tol:
            out.append(
                Finding(
                    "A",
                    "softmax-fp16-accumulation",
                    f"A: in fp16, rows reading "
                    f"{int(E[-1].sum())} keys sum to {_few(got)} instead of 1 "
                    f"(plain fp16 math with fp32 accumulation is off by "
                    f"{float(np.abs(plain - 1).max()):.2g}): the softmax "
                    "accumulates in fp16",
                    (),
                    p.name,
                )
            )
        return out

    # -- the output projection
    def projection(self, p: Probe, A: np.ndarray) -> list[Finding]:
        if not self.plan.has_wo:
            return []
        rng = np.random.default_rng(11)
        d = self.s.adapter.dims if self.s.adapter else self.plan.dims
        h = p.H
        w_v = (rng.normal(size=(d["d_model"], d["hd_v"])) / 2).astype(p.dtype)
        w_o = (rng.normal(size=(d["hd_v"], d["d_out"])) / 2).astype(p.dtype)
        try:
            got = self.s.output(p, w_v, w_o)
        except Exception as exc:
            return [
                Finding(
                    "O",
                    None,
                    f"O: with random W_V, W_O the function raised {type(exc).__name__}: {exc}",
                    (),
                    p.name,
                )
            ]
        Vh = split_heads(p.inputs["x"].astype(np.float64) @ w_v.astype(np.float64), h)
        Hm = merge_heads(A @ Vh)
        ref = Hm @ w_o.astype(np.float64)
        t = self.work_dtype(p)
        plain = (merge_heads(A.astype(t) @ Vh.astype(t)) @ w_o.astype(t)).astype(np.float64)
        tol = tolerance(ref, plain, t) + self.noise(A, p) * float(np.abs(ref).max())

        def close(x, y):
            return x.shape == y.shape and float(np.abs(x - y).max()) <= tol

        if close(got, ref):
            return []
        if got.shape == Hm.shape and close(got, Hm):
            fid, what = "output-projection-missing", "O equals H: W_O is never applied"
        elif w_o.shape[0] == w_o.shape[1] and close(got, Hm @ w_o.T.astype(np.float64)):
            fid, what = "output-projection-transposed", "O equals H W_Oᵀ"
        else:
            fid, what = (
                None,
                (
                    f"O has shape {got.shape[1:]}, H W_O is {ref.shape[1:]}"
                    if got.shape != ref.shape
                    else f"O differs from H W_O by up to {np.abs(got - ref).max():.3g}"
                ),
            )
        return [Finding("O", fid, f"O: {what} (H from the measured weights)", (), p.name)]

    # -- the whole run
    def run(self) -> Diagnosis:
        plan = self.plan
        main, A, first_err = None, None, None
        for p in plan.main_probes():
            try:
                with np.errstate(all="ignore"):
                    A = self.weights(p)
                main = p
                self.ran.append(p.name)
                break
            except MemoryError:
                raise
            except Exception as exc:
                first_err = first_err or (p, exc)
        if main is None:
            p, exc = first_err
            return Diagnosis(
                None,
                None,
                f"the function raised on the first probe ({p.name}, "
                f"T×d_k = {p.T_k}×{p.d_k}): {type(exc).__name__}: {exc}",
                status=Status.ERROR,
                details=self.details,
                d_k=p.d_k,
            )
        with np.errstate(all="ignore"):
            lin = self.linearity(main, A) if np.isfinite(A).all() else []  # NaN: stage A says
            if lin:
                rec = self._recorded_weights(main)
                found = self.analyze(main, rec) if rec is not None else []
                self.findings += found or lin
            else:
                self.findings += self.analyze(main, A)
                self.findings += self.dv_dependence(main, A)
                self._more_probes(main)
                if not self.findings:  # at ordinary scores all is right: now the extremes
                    self.findings += self.stability(main)
                if not self.findings:
                    self.findings += self.fp16(main)
                self.findings += self.projection(main, A)
        return self._verdict(main, A, bool(lin))

    def _more_probes(self, main: Probe):
        plan = self.plan
        if plan.sig != "qkv":
            return
        per_head = "sinks" in plan.declared or "alibi_slopes" in plan.declared
        if main.H == 1 and not per_head and not plan.per_batch:  # (sinks, slopes fix H;
            # (B, T) padding next to (B, H, T, d) inputs is read as (H, T) by (B, T, d) code)
            p = plan.make("two-head probe", T=main.T_k, d_k=main.d_k, H=2)
            A = self.try_weights(p)
            if A is not None:
                self.findings += self.analyze(p, A)
        if not plan.per_batch and not plan.T_fixed:
            p = plan.make("decoding probe (T_q < T_k)", T_q=3, T=7, d_k=main.d_k)
            A = self.try_weights(p)
            if A is not None:
                self.findings += self.analyze(p, A)
        if plan.pad_kind and not plan.per_batch:
            if plan.pad_kind == "lengths":
                pad = np.array([6, 3])
                pat = plan.pattern(lengths=pad)
            else:
                pad = np.array([[True] * 6, [False, False] + [True] * 4])  # left padding
                pat = plan.pattern(key_padding_mask=pad)
            p = plan.make(
                "padding probe", T=6, d_k=main.d_k, B=2, pattern=pat, kwargs={plan.pad_kind: pad}
            )
            A = self.try_weights(p)
            if A is not None:
                self.findings += self.analyze(p, A)

    def _recorded_weights(self, p: Probe):
        """The softmax weights the function computed (recorded, or returned as
        ``(out, weights)``), shaped (B, H, T_q, T_k); None when there are none."""
        A = None
        try:
            self.s.values(p, _eye(p.T_k))
            A = self.s.weights
            if A is None and self.s.framework == "torch":
                ev = _record(self.s, p)
                A = next((e["weights"] for e in ev if "weights" in e), None)
        except Exception:
            return None
        if A is None or np.asarray(A).size != p.B * p.H * p.T_q * p.T_k:
            return None
        return np.asarray(A, np.float64).reshape(p.B, p.H, p.T_q, p.T_k)

    def _verdict(self, main: Probe, A: np.ndarray, nonlinear: bool) -> Diagnosis:
        f = sorted(self.findings, key=lambda x: x.key())  # stable: probe order within a stage
        self.details["probes"] = self.ran
        if self.dropped:
            self.details["dropped probes"] = self.dropped
        sl = f[0].slice if f and f[0].probe == main.name and f[0].slice else (0, 0)
        P = None if nonlinear else read_pattern(A[sl])
        E = main.allowed()[sl]
        c = self.scales.get((main.name,) + tuple(sl))
        untested = self._untested(main)
        base = dict(
            untested=untested, details=self.details, pattern=P, expected=E, scale=c, d_k=main.d_k
        )
        if not f:
            return Diagnosis(
                None,
                None,
                "matches the reference on every probe (" + ", ".join(self.ran) + ")",
                status=Status.CLEAN,
                **base,
            )
        top = f[0]
        fault, stage, msg = top.fault, top.stage, top.message
        also = []
        heads = self._heads_only(f)
        if heads is not None:
            also = [fault] if fault else []
            msg = heads
            fault = "some-heads-only"
        for x in f[1:]:
            if x.fault and x.fault != fault and x.fault not in also:
                also.append(x.fault)
        if top.probe != main.name and top.probe in self.measured and top.slice:
            pr, Ar = self.measured[top.probe]
            self.details["pattern_of"] = {
                "probe": top.probe,
                "slice": list(top.slice),
                "pattern": read_pattern(Ar[top.slice]).tolist(),
                "expected": pr.allowed()[top.slice].tolist(),
            }
        if fault and fault in BY_ID:
            msg = f"{fault}: {msg}"
        location, code, facts = None, "", {}
        self.s.last = (main, _eye(main.T_k))  # the white-box pass replays the main probe
        try:
            events = (_record if self.s.framework == "torch" else _record_numpy)(self.s, main)
            location, code, facts = _whitebox(events, fault if fault in BY_ID else None)
        except Exception as exc:  # the white-box pass is a bonus; never let it hide the verdict
            facts = {"error": f"{type(exc).__name__}: {exc}"}
        self.details.update({"whitebox": facts, "code": code})
        return Diagnosis(
            fault, stage, msg, location, Status.FAULT if fault else Status.UNKNOWN, also, **base
        )

    def _heads_only(self, f: list[Finding]):
        """A message when the first stage's findings sit in some heads of a multi-head
        probe while its other heads match; None otherwise."""
        top = f[0]
        same = [x for x in f if x.probe == top.probe]
        heads_bad = sorted({x.slice[1] for x in same if x.slice})
        H = self.measured[top.probe][0].H if top.probe in self.measured else 1
        if H > 1 and 0 < len(heads_bad) < H:
            ok = [h for h in range(H) if h not in heads_bad]
            return (
                f"{'head' if len(heads_bad) == 1 else 'heads'} "
                f"{', '.join(str(h + 1) for h in heads_bad)} of {H}: {top.message}; "
                f"{'head' if len(ok) == 1 else 'heads'} {', '.join(str(h + 1) for h in ok)}"
                f" {'matches' if len(ok) == 1 else 'match'} the reference"
            )
        return None

    def _untested(self, main: Probe) -> list[str]:
        out = []
        if not self.plan.has_wo:
            out += ["output-projection-missing", "output-projection-transposed"]
        if (
            not self.plan.pad_kind
            and "lengths" not in self.plan.declared
            and "key_padding_mask" not in self.plan.declared
        ):
            out += [
                "padding-ignored",
                "padding-queries-only",
                "finite-min-added-twice",
                "nan-on-empty-rows",
            ]
        if not any(n.startswith("decoding") for n in self.ran):
            out.append("causal-top-left")
        if "window" not in self.plan.declared:
            out.append("window-off-by-one")
        if "long fp16 rows" not in self.ran:
            out.append("softmax-fp16-accumulation")
        if self.plan.sig != "qkv" or main.name == "T = d_k probe":
            pass
        elif "T = d_k probe" not in self.ran:
            out.append("k-not-transposed")
        if self.plan.sig == "qkv":
            out.append("scale-by-sqrt-dmodel")
        return [f.id for f in CATALOGUE if f.id in out]


def _slice(p: Probe, b: int, h: int) -> Probe:
    """One (b, h) slice of a probe as a (1, 1, T_q, T_k) probe, its pattern fitted to it."""
    from dataclasses import replace

    E = p.allowed()[b : b + 1, h : h + 1]
    pat = p.pattern
    kw = {"causal": False, "mask": E}
    if pat.softcap is not None:
        kw["softcap"] = pat.softcap
    if pat.alibi_slopes is not None:
        sl = np.asarray(pat.alibi_slopes)
        kw["alibi_slopes"] = (sl[b] if sl.ndim == 2 else sl)[h : h + 1]
    if pat.sinks is not None:
        kw["sinks"] = np.asarray(pat.sinks)[h : h + 1]
    return replace(
        p, Q=p.Q[b : b + 1, h : h + 1], K=p.K[b : b + 1, h : h + 1], pattern=masks.Pattern(**kw)
    )


def _plain_fp16_row_sums(Z: np.ndarray) -> np.ndarray:
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


def _few(x) -> str:
    x = np.ravel(x)
    s = ", ".join(f"{v:.4g}" for v in x[:4])
    return s + (" ..." if x.size > 4 else "")
