"""The stage checks, in dependency order."""

from __future__ import annotations

import numpy as np

from .. import masks as _masks
from ..reference import softmax_last, weighted_values
from . import faults
from .inputs import _Inputs
from .numerics import (
    _MAX_LIST,
    BLOCKED_BELOW,
    _close,
    _locate,
    _looks_masked,
    _mask_from_additive,
    _merge_heads,
    _rtol,
    _split_heads,
)
from .report import STAGE_ORDER, AuditInputError, Check, Report

# The catalogued fault each of the audit's hints describes (stage, words of the hint).
_HINT_FAULTS = (
    ("k-not-transposed", "S", "not transposed"), ("missing-scale", "S", "scale is missing"),
    ("scale-by-dk", "S", "divided by d_k"), ("no-mask", "M", "no causal mask"),
    ("anti-causal-mask", "M", "anti-causal"), ("diagonal-blocked", "M", "diagonal is blocked"),
    ("padding-ignored", "M", "padding mask was not applied"),
    ("softmax-query-axis", "A", "query axis"), ("softmax-all-entries", "A", "all entries"),
    ("mask-after-softmax", "A", "after softmax"), ("mask-after-softmax", "A", "after the softmax"),
    ("unstable-softmax", "A", "overflow exp"), ("nan-on-empty-rows", "A", "makes softmax NaN"),
    ("output-projection-missing", "O", "projection is missing"),
    ("output-projection-transposed", "O", "projection is transposed"),
)


class _Auditor:
    def __init__(self, inp: _Inputs):
        self.inp = inp
        self.a = dict(inp.arrays)
        self.eps = dict(inp.eps)
        self.given = [s for s in ("X", "W_q", "W_k", "W_v", "Q", "K", "V", "S", "M", "Z", "A",
                                  "H", "C", "W_o", "O") if s in self.a]
        self.recomputed: list[str] = []
        self.checks: list[Check] = []
        self.empty_rows: list[dict] = []
        self.notes = list(inp.notes)
        self.h = inp.n_heads
        self.R: np.ndarray | None = None  # allowed, broadcast to (..., T_q, T_k)
        self._pending = None

    def add(self, stage, name, ok, message, evidence=None, hint=None):
        fault = None
        if hint and not ok:
            fault = next((fid for fid, st, key in _HINT_FAULTS if st == stage and key in hint),
                         None)
            if fault and not hint.startswith(fault):
                hint = f"{fault}: {hint}"
        self.checks.append(Check(stage, name, bool(ok), message, evidence or {}, hint, fault))
        return ok

    def recompute(self, stage, value, *from_stages):
        self.a[stage] = value
        self.eps[stage] = max((self.eps.get(s, 0.0) for s in from_stages), default=0.0)
        self.recomputed.append(stage)

    # ---- projections
    def projections(self):
        a = self.a
        X = a.get("X")
        if self.h is None and X is not None:
            for s in ("Q", "K", "V", "A", "S"):
                if s in a and a[s].ndim == X.ndim + 1:
                    self.h = a[s].shape[-3]
                    break
        for s, w in (("Q", "W_q"), ("K", "W_k"), ("V", "W_v")):
            if X is None or w not in a:
                continue
            W = a[w]
            if W.shape[0] != X.shape[-1]:
                self.add(s, f"{s} = X {w}", False,
                         f"X is T×d_model = {X.shape[-2]}×{X.shape[-1]} but {w} is "
                         f"{W.shape[0]}×{W.shape[1]}; its rows must be d_model = {X.shape[-1]}")
                continue
            if self.h is not None and W.shape[1] % self.h:
                self.add(s, f"{s} = X {w}", False,
                         f"{w} has {W.shape[1]} columns, not divisible by {self.h} heads")
                continue
            ref = _split_heads(X @ W, self.h)
            if s not in a:
                self.recompute(s, ref, "X", w)
                continue
            if (self.h is None and a[s].shape[:-1] == ref.shape[:-1]
                    and ref.shape[-1] % a[s].shape[-1] == 0 and ref.shape[-1] > a[s].shape[-1]):
                # one head of a multi-head projection (Trace.select(b, h)): find which
                heads = _split_heads(ref, ref.shape[-1] // a[s].shape[-1])
                tol = _rtol(self.eps[s], self.eps["X"], self.eps[w])
                hit = [j for j in range(heads.shape[-3])
                       if _close(a[s], heads[..., j, :, :], tol)[0]]
                self.add(s, f"{s} = X {w}", bool(hit),
                         f"{s} is head {hit[0]} of X {w}" if hit else
                         f"{s} ({a[s].shape}) is no head of X {w} ({ref.shape})")
                continue
            if a[s].shape != ref.shape:
                self.add(s, f"{s} = X {w}", False,
                         f"{s} has shape {a[s].shape} but X {w} gives {ref.shape}")
                continue
            tol = _rtol(self.eps[s], self.eps["X"], self.eps[w])
            ok, e, bad = _close(a[s], ref, tol)
            lead = ref.ndim - 2
            self.add(s, f"{s} = X {w}", ok,
                     f"max |{s} - X {w}| = {e:.3g}" + ("" if ok else " (too far off)"),
                     None if ok else {**_locate(bad.any(-1), lead, False), "max_err": e},
                     None if ok else f"{s} was not computed as X {w}; check which weight "
                     "was used and whether a bias or a transpose slipped in")
        # sequence lengths agree across Q, K, V, X
        Tk = {s: a[s].shape[-2] for s in ("K", "V") if s in a}
        if X is not None:
            Tk["X"] = X.shape[-2]
        if len(set(Tk.values())) > 1:
            stage = "X" if "X" in Tk else "V"
            self.add(stage, "sequence lengths agree", False,
                     "T differs between " + ", ".join(f"{k}: {v}" for k, v in Tk.items()))

    # ---- scores
    def scores(self):
        a = self.a
        if "S" in a and "Z" not in a and _looks_masked(a["S"]):
            a["Z"] = a.pop("S")
            self.eps["Z"] = self.eps.pop("S")
            self.given = ["Z" if g == "S" else g for g in self.given]
            self.notes.append("the given scores carry the mask already; read as Z = S + M")
        if "S" not in a and "Z" in a and ("Q" not in a or "K" not in a):
            return  # S (at readable entries) is taken from Z in the mask stage
        Q, K = a.get("Q"), a.get("K")
        if Q is None or K is None:
            if "S" in a:
                self._square("S", a["S"])
            return
        d_k = Q.shape[-1]
        c0 = self.inp.scale if self.inp.scale is not None else 1.0 / np.sqrt(d_k)
        if K.shape[-1] != d_k:
            self.add("S", "Q Kᵀ shapes", False,
                     f"Q is T×d_k = {Q.shape[-2]}×{d_k} but K is {K.shape[-2]}×{K.shape[-1]}; "
                     "the inner d_k axes must match")
            return
        try:
            G = Q @ np.swapaxes(K, -1, -2)
        except ValueError:
            self.add("S", "Q Kᵀ shapes", False,
                     f"Q {Q.shape} and K {K.shape}: leading axes do not broadcast")
            return
        if "S" not in a:
            self.recompute("S", G * c0, "Q", "K")
            self._pending = (G, c0, d_k)  # read the scale back from A once the mask is known
            return
        S = a["S"]
        if S.shape[-2:] != G.shape[-2:]:
            hint = None
            if S.shape[-2:] == (Q.shape[-2], K.shape[-1]) and K.shape[-2] == d_k:
                hint = "S is T×d_k: K was not transposed (Q K instead of Q Kᵀ)"
            self.add("S", "S is T×T", False,
                     f"S is {S.shape[-2]}×{S.shape[-1]} but Q Kᵀ is "
                     f"{G.shape[-2]}×{G.shape[-1]} (T_q×T_k)", {"shape": S.shape}, hint)
            return
        try:
            S, G = np.broadcast_arrays(S, G)
        except ValueError:
            self.add("S", "S is T×T", False, f"S is {S.shape} but Q Kᵀ is {G.shape}: the "
                     "batch/head axes do not match", {"shape": S.shape})
            return
        self.add("S", "S is T×T", True, f"S is {S.shape[-2]}×{S.shape[-1]}")
        finite = np.isfinite(S) & (S > BLOCKED_BELOW)
        tol = _rtol(self.eps["S"], self.eps["Q"], self.eps["K"])
        ok, e, bad = _close(S, G * c0, tol, finite)
        if ok:
            self.add("S", "scale 1/√d_k", True, f"S = Q Kᵀ · {c0:.4g} (d_k = {d_k}); "
                     f"max error {e:.3g}")
            return
        cands = [(1.0, "the 1/√d_k scale is missing (S = Q Kᵀ)"),
                 (1.0 / d_k, f"S was divided by d_k = {d_k} instead of √d_k")]
        hint = None
        for c, text in cands:
            if abs(c - c0) > 1e-12 * c0 and _close(S, G * c, tol, finite)[0]:
                hint = text
                break
        if hint is None and K.shape[-2] == d_k:
            try:
                if _close(S, (Q @ K) * c0, tol, finite)[0] or _close(S, Q @ K, tol, finite)[0]:
                    hint = "S = Q K, not Q Kᵀ: K was not transposed (shapes hid it: T = d_k)"
            except ValueError:
                pass
        if hint is None:
            g = G[finite]
            c = float(np.dot(S[finite], g) / max(np.dot(g, g), 1e-300))
            if _close(S, G * c, tol, finite)[0]:
                hint = f"S = Q Kᵀ · {c:.4g}, expected · {c0:.4g} (1/√d_k, d_k = {d_k})"
        self.add("S", "scale 1/√d_k", False,
                 f"S differs from Q Kᵀ/√d_k by up to {e:.3g}",
                 {**_locate(bad, S.ndim - 2), "max_err": e}, hint)

    def _square(self, name, S):
        T_q, T_k = S.shape[-2:]
        ok = T_q <= T_k
        self.add("S", f"{name} is T×T", ok, f"{name} is {T_q}×{T_k}",
                 None if ok else {"shape": S.shape},
                 None if ok else "more query rows than key columns: is it transposed?")

    def _scale_from_weights(self, G, c0, d_k):
        """S is absent: read its scale back from A (log A_ij − log A_ik = S_ij − S_ik)."""
        A = self.a.get("A")
        if A is None or A.shape[-2:] != G.shape[-2:]:
            return
        with np.errstate(divide="ignore", invalid="ignore"):
            L = np.log(A)
        use = np.isfinite(L) & (A > 1e-30)
        if self.R is not None and self.R.shape == A.shape:
            use &= self.R
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
        hint = None
        if not ok:
            if abs(c - 1) < 1e-3:
                hint = "the 1/√d_k scale is missing (softmax of Q Kᵀ)"
            elif abs(c * d_k - 1) < 1e-3:
                hint = f"S was divided by d_k = {d_k} instead of √d_k"
            else:
                hint = f"A is the softmax of Q Kᵀ · {c:.4g}, expected · {c0:.4g}"
        self.add("S", "scale 1/√d_k (read back from A)", ok,
                 f"log A matches Q Kᵀ · {c:.4g}; expected · {c0:.4g}",
                 None if ok else {"factor": c, "expected": c0}, hint)

    # ---- mask
    def mask(self):
        a = self.a
        shape = None
        for s in ("S", "Z", "M", "A"):
            if s in a:
                shape = a[s].shape
                break
        if shape is None:
            if "Q" in a and "K" in a:
                shape = np.broadcast_shapes(a["Q"].shape[:-2], a["K"].shape[:-2]) + (
                    a["Q"].shape[-2], a["K"].shape[-2])
            else:
                return
        T_q, T_k = shape[-2:]
        if T_q > T_k:
            return
        lead = shape[:-2]
        sources: list[tuple[str, np.ndarray]] = []
        if self.inp.allowed is not None:
            sources.append(("declared mask", self._bcast(self.inp.allowed, shape, "mask")))
        if "M" in a:
            M = self._bcast(a["M"], shape, "M")
            R_M, odd = _mask_from_additive(M)
            if odd.any():
                self.add("M", "M is 0 or blocked", False,
                         "M has entries that are neither 0 nor -inf (or a large negative fill)",
                         _locate(odd, len(lead)),
                         "M must be 0 where a key may be read and -inf (or a large negative "
                         "fill) where it may not; a bias belongs in S")
            sources.append(("M", R_M))
        if "Z" in a:
            Z = np.broadcast_to(a["Z"], shape)
            sources.append(("Z", np.isfinite(Z) & (Z > BLOCKED_BELOW)))
            if "S" not in a:
                self.recompute("S", np.where(sources[-1][1], Z, 0.0), "Z")
        if not sources and "A" in a and a["A"].shape == shape:
            self._pattern_from_weights(a["A"], shape)
            return
        if not sources:
            self.R = self._declared_allowed(shape)
            self.recomputed.append("M")
            return
        name0, R = sources[0]
        for name, other in sources[1:]:
            same = R == other
            self.add("M", f"{name} agrees with {name0}", same.all(),
                     f"{name} and {name0} " + ("agree" if same.all() else "disagree"),
                     _locate(~same, len(lead)))
        self.R = R
        if name0 != "M" and "M" not in a:
            self.recomputed.append("M")
        self._structure(R, name0)

    def _pattern_kw(self, padding: bool = True) -> dict:
        kw = dict(self.inp.pattern)
        if self.inp.lengths is not None and "lengths" not in kw:
            kw["lengths"] = self.inp.lengths
        if self.inp.key_padding is not None and "key_padding_mask" not in kw:
            kw["key_padding_mask"] = self.inp.key_padding
        if not padding:
            kw.pop("lengths", None)
            kw.pop("key_padding_mask", None)
        return kw

    def _padding_declared(self) -> bool:
        kw = self._pattern_kw()
        return "lengths" in kw or "key_padding_mask" in kw

    def _declared_allowed(self, shape, padding: bool = True) -> np.ndarray:
        """The declared pattern (default plain causal; padding from the inputs) broadcast to
        the stages' shape (..., T_q, T_k): leading axes are (B, H), (B,) or (H,)."""
        kw = self._pattern_kw(padding)
        lead, (T_q, T_k) = shape[:-2], shape[-2:]
        try:
            pat = _masks.Pattern(**kw)
            batchy = pat.per_batch
            if not lead:
                R = pat.allowed(1, 1, T_q, T_k)[0, 0]
            elif len(lead) == 1:
                heads = self.h is not None and lead[0] == self.h and not batchy
                R = pat.allowed(1, lead[0], T_q, T_k)[0] if heads else \
                    pat.allowed(lead[0], 1, T_q, T_k)[:, 0]
            else:
                R = pat.allowed(lead[-2], lead[-1], T_q, T_k)
            return np.broadcast_to(R, shape)
        except ValueError as exc:
            raise AuditInputError(f"mask: the declared pattern does not fit the stages "
                                  f"{shape}: {exc}") from None

    def _fit_lead(self, R):
        # a (B, T, T) mask with a head axis in the stages: insert it
        if self.h is not None and R.ndim == 3:
            R = R[:, None]
        return R

    def _bcast(self, m, shape, name):
        m = np.asarray(m)
        for cand in (m, self._fit_lead(m)):  # as given, or a (B, T, T) mask missing its head axis
            try:
                return np.broadcast_to(cand, shape)
            except ValueError:
                pass
        raise AuditInputError(f"{name}: shape {m.shape} does not broadcast to {shape}")

    def _pattern_from_weights(self, A, shape):
        """No mask given: compare the keys A reads (nonzero weights) with the declared
        pattern. Padding is inferred only when unambiguous — keys from L on read by no query
        and query rows from L on reading nothing, L >= 1 — and the audit notes it. Rows
        that read nothing are left to stage A (they must sum to 1 unless the pattern
        leaves them empty)."""
        lead = shape[:-2]
        T_q, T_k = shape[-2:]
        off = T_k - T_q
        E = self._declared_allowed(shape).copy()
        P = (A != 0) & ~np.isnan(A).all(-1, keepdims=True)
        if "S" in self.a:  # a weight that underflowed to 0 is not a blocked key
            with np.errstate(all="ignore"):
                ref = softmax_last(np.where(E, self._modified_scores(shape), 0.0), E)
            P |= E & (A == 0) & (ref < 1e-30)
        inferred = []
        if not self._padding_declared():
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
            self.notes.append(
                "padding assumed from A (keys and query rows from L on read nothing): "
                + "; ".join(f"{list(i) if i else ''} L = {L}".strip() for i, L in inferred[:4])
                + (" ..." if len(inferred) > 4 else "") + "; declare lengths= to state it")
        self.R = E
        self.recomputed.append("M")
        reads = P.any(-1, keepdims=True)
        Pc = np.where(reads, P, E)  # rows that read nothing: stage A says so
        bad = Pc != E
        declared = _masks.Pattern(**self._pattern_kw()).describe()
        if not bad.any():
            self.add("M", "A reads what the pattern allows", True,
                     f"the keys A reads match the declared pattern ({declared})")
            return
        flat = int(np.flatnonzero(bad.reshape(-1, T_q * T_k).any(-1))[0])
        first = tuple(int(i) for i in np.unravel_index(flat, lead)) if lead else ()
        from .measure import describe_difference

        what = describe_difference(Pc[first], E[first], T_q, T_k)
        never = np.flatnonzero(~P[first].any(-2) & E[first].any(-2))
        msg = f"the keys A reads differ from the declared pattern ({declared}): {what}" + (
            f" (at index {list(first)})" if first else "")
        hint = self._pattern_hint(Pc[first], E[first], T_q, T_k, reads[first])
        if never.size:
            hint += (f"; key{'s' if never.size > 1 else ''} "
                     f"{', '.join(str(j + 1) for j in never[:6])} {'are' if never.size > 1 else 'is'}"
                     " read by no query: if that is padding, declare key_padding_mask= or "
                     "lengths=")
        self.add("M", "A reads what the pattern allows", False, msg,
                 _locate(bad, len(lead)), hint)

    def _pattern_hint(self, P, E, T_q, T_k, reads) -> str:
        """The catalogue's hint when the read pattern is a catalogued fault."""
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
            return f"{fid}: {f.description}; {f.hint}"
        if (P & ~E).any():
            return "A gives weight to keys the pattern blocks: the mask is too weak or wrong"
        return ("A leaves out keys the pattern allows: the mask is stricter than declared (a "
                "window or a padding rule nobody declared?)")

    def _softmax(self, R):
        """softmax_last(modified S + M) over ``R`` (..., T_q, T_k), the declared sinks in the
        denominator: what A must be."""
        Z = np.where(R, self._modified_scores(R.shape), 0.0)
        sinks = self.inp.pattern.get("sinks")
        if sinks is None:
            return softmax_last(Z, R)
        sk = np.asarray(sinks, np.float64)
        lead = R.shape[:-2]
        col = np.broadcast_to(sk[:, None, None] if lead and lead[-1] == sk.size else sk[:1, None],
                              R.shape[:-1] + (1,)) if lead else np.full(R.shape[:-1] + (1,),
                                                                        float(sk[0]))
        has = R.any(-1, keepdims=True)
        A = softmax_last(np.concatenate([Z, col], -1), np.concatenate([R, has], -1))
        return A[..., :-1]

    def _modified_scores(self, shape):
        """S broadcast to ``shape``, with the declared softcap / ALiBi applied."""
        S = np.broadcast_to(self.a["S"], shape)
        pat = _masks.Pattern(**{k: v for k, v in self.inp.pattern.items()
                                if k in ("softcap", "alibi_slopes")})
        if not pat.has_modifiers:
            return S
        lead = shape[:-2]
        S4 = S.reshape((-1,) + (lead[-1:] if lead else (1,)) + shape[-2:]) if lead else \
            S.reshape((1, 1) + shape[-2:])
        return np.asarray(pat.modify_scores(S4)).reshape(shape)

    def _structure(self, R, source):
        """Compare the mask with causal ∧ padding, padding read from the mask itself."""
        shape = R.shape
        T_q, T_k = shape[-2:]
        off = T_k - T_q
        lead = shape[:-2]
        base_all = self._declared_allowed(shape, padding=False)
        plain = bool(_masks.Pattern(**self._pattern_kw(False)).is_plain_causal)
        declared_pad = None
        if self._padding_declared():
            declared_pad = ~self._declared_allowed(shape).any(-2)
        bad = np.zeros(shape, bool)
        kinds = set()
        padded = False
        for idx in np.ndindex(*lead) if lead else [()]:
            r = R[idx]
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
                elif plain and (r == causal.T).all() and T_q == T_k:
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
        described = _masks.Pattern(**self._pattern_kw(False)).describe()
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
        self.add("M", "mask is causal (+ padding)", ok,
                 f"{source}: " + (("0 on and below the diagonal, blocked above" if plain else
                                   f"as declared ({described})")
                                  + (", padding blocked" if declared_pad is not None else
                                     ", padding keys (read by no query) blocked" if padded else "")
                                  if ok else "does not match causal ∧ padding"),
                 None if ok else _locate(bad, len(lead)),
                 None if ok else hints[kind])

    # ---- weights
    def weights(self):
        a = self.a
        R = self.R
        if "A" not in a:
            if "S" in a and R is not None:
                with np.errstate(invalid="ignore"):
                    self.recompute("A", self._softmax(R), "S")
            return
        A = a["A"]
        if "S" in a and a["S"].shape[-2:] != A.shape[-2:]:
            self.add("A", "A has S's shape", False,
                     f"A is {A.shape[-2]}×{A.shape[-1]} but S (Q Kᵀ) is "
                     f"{a['S'].shape[-2]}×{a['S'].shape[-1]} (T_q×T_k)", {"shape": A.shape},
                     "A must be T_q×T_k like the scores: was it transposed or sliced?")
            return
        if R is None:
            T_q, T_k = A.shape[-2:]
            if T_q > T_k:
                self.add("A", "A is T×T", False, f"A is {T_q}×{T_k}: more query rows than keys")
                return
            R = np.broadcast_to(_masks.causal(T_q, T_k), A.shape)
        if R.shape != A.shape:
            self.add("A", "A matches the mask's shape", False,
                     f"A is {A.shape} but the mask/scores are {R.shape}")
            return
        lead = A.ndim - 2
        tol = _rtol(self.eps["A"])
        has_key = R.any(-1)
        finite_row = np.isfinite(A).all(-1)
        # rows with no readable key: listed, and they must be zero (never NaN)
        for idx in np.ndindex(*A.shape[:-2]) if lead else [()]:
            rows = np.flatnonzero(~has_key[idx])
            if rows.size:
                self.empty_rows.append({"index": list(idx), "rows": rows.tolist()})
        sums = np.where(R, A, 0.0).sum(-1)
        sinks = "sinks" in self.inp.pattern  # rows sum to less than 1: the sink takes the rest
        row_bad = has_key & finite_row & ((sums > 1 + tol) if sinks else (np.abs(sums - 1) > tol))
        if row_bad.any():
            hint = self._softmax_hint(A, R, has_key, tol)
            self.add("A", "rows sum to 1", False,
                     f"{int(row_bad.sum())} readable rows do not sum to 1 over their readable "
                     f"columns (e.g. {float(sums[row_bad][0]):.4g})",
                     {**_locate(row_bad, lead, False),
                      "row_sums": np.round(sums[np.nonzero(row_bad)][:_MAX_LIST], 4).tolist()},
                     hint)
        else:
            self.add("A", "rows sum to 1", True, "every readable row sums to 1 over its readable "
                     "columns")
        forb = ~R & has_key[..., None] & (A != 0)
        self.add("A", "forbidden entries exactly 0", not forb.any(),
                 "blocked entries have exactly zero weight" if not forb.any()
                 else f"{int(forb.sum())} blocked entries have nonzero weight "
                 f"(max {float(np.abs(np.where(forb & np.isfinite(A), A, 0)).max()):.3g})",
                 _locate(forb, lead),
                 None if not forb.any() else "the mask must be applied before the softmax, with "
                 "-inf (or a fill whose weight comes out exactly 0)")
        nonfinite = has_key & ~finite_row
        hint = None
        if nonfinite.any():
            S = a.get("S")
            if S is not None and np.abs(np.where(R & np.isfinite(S), S, 0)).max() > 80:
                hint = ("scores this large overflow exp(): subtract the row maximum before "
                        "exponentiating (stable softmax)")
            else:
                hint = "NaN/inf weights in rows that can read a key"
        self.add("A", "readable rows finite", not nonfinite.any(),
                 "every readable row is finite" if not nonfinite.any()
                 else f"{int(nonfinite.sum())} readable rows hold NaN or inf",
                 _locate(nonfinite, lead, False), hint)
        if (~has_key).any():
            empty_bad = ~has_key & (~np.isfinite(A).all(-1) | (A != 0).any(-1))
            self.add("A", "rows with no readable key are zero", not empty_bad.any(),
                     "rows with no readable key have zero weight" if not empty_bad.any()
                     else f"{int(empty_bad.sum())} rows with no readable key are not zero"
                     + (" (NaN)" if np.isnan(A[empty_bad]).any() else ""),
                     _locate(empty_bad, lead, False),
                     None if not empty_bad.any() else
                     "a row whose keys are all blocked must give zero weights; -inf on every "
                     "entry makes softmax NaN (0/0), a finite fill spreads weight over "
                     "forbidden keys")
        if "S" in a and not self.failures_in("A"):
            with np.errstate(invalid="ignore"):
                ref = self._softmax(R)
            ok, e, bad = _close(A, ref, _rtol(self.eps["A"], self.eps.get("S", 0)),
                                has_key[..., None] & R)
            self.add("A", "A = softmax_last(S + M)", ok,
                     f"max |A - softmax(S + M)| = {e:.3g}",
                     None if ok else {**_locate(bad, lead), "max_err": e},
                     None if ok else "A is a distribution per row but not the softmax of these "
                     "scores: check the scale and which scores were used")

    def failures_in(self, stage):
        return [c for c in self.checks if c.stage == stage and not c.ok]

    def _softmax_hint(self, A, R, has_key, tol):
        Af = np.where(np.isfinite(A), A, 0.0)
        col = Af.sum(-2)
        any_read = R.any(-2)
        if any_read.any() and np.all(np.abs(col[any_read] - 1) <= tol * 4):
            return "columns sum to 1, rows do not: softmax ran over the query axis"
        tot = Af.sum(axis=(-1, -2))
        if np.all(np.abs(tot - 1) <= tol * 4):
            return "the whole matrix sums to 1: softmax ran over all entries at once"
        sums = np.where(R, Af, 0).sum(-1)
        if np.all(sums[has_key] <= 1 + tol) and not (~R & (Af != 0)).any():
            S = self.a.get("S")
            if S is not None:
                with np.errstate(invalid="ignore", over="ignore"):
                    full = softmax_last(np.broadcast_to(S, A.shape), np.ones(A.shape, bool))
                if _close(A, np.where(R, full, 0), _rtol(self.eps["A"]) * 4, R)[0]:
                    return ("mask applied after softmax without renormalizing: rows sum to "
                            "less than 1 (the forbidden weight was dropped, not redistributed)")
            return ("rows sum to less than 1 with zeros in the right place: the mask was "
                    "likely applied after the softmax without renormalizing")
        return "rows are not normalized over the key axis"

    # ---- values, contributions, output
    def values(self):
        a = self.a
        R = self.R
        A, V = a.get("A"), a.get("V")
        if "H" in a and A is not None and V is not None and a["H"].ndim == A.ndim - 1 and self.h:
            a["H"] = _split_heads(a["H"], A.shape[-3])  # concatenated heads (..., T, h·d_v)
        if A is None or V is None:
            return
        if R is None or R.shape != A.shape:
            R = np.ones(A.shape, bool)
        try:
            lead = np.broadcast_shapes(A.shape[:-2], V.shape[:-2])
            Hr = weighted_values(np.broadcast_to(A, lead + A.shape[-2:]),
                                 np.broadcast_to(V, lead + V.shape[-2:]),
                                 np.broadcast_to(R, lead + A.shape[-2:]))
        except ValueError:
            self.add("H", "H = A V shapes", False, f"A is {A.shape} but V is {V.shape}; "
                     "A's key axis must match V's T")
            return
        if "H" not in a:
            self.recompute("H", Hr, "A", "V")
            return
        H = a["H"]
        if H.shape != Hr.shape:
            self.add("H", "H = A V", False, f"H has shape {H.shape} but A V is {Hr.shape}")
            return
        has_key = R.any(-1)
        ok, e, bad = _close(H, Hr, _rtol(self.eps["H"], self.eps["A"], self.eps.get("V", 0)),
                            has_key[..., None])
        self.add("H", "H = A V", ok, f"max |H - A V| = {e:.3g}",
                 None if ok else {**_locate(bad.any(-1), H.ndim - 2, False), "max_err": e},
                 None if ok else "H is not A V for these weights and values")
        if (~has_key).any():
            zb = ~has_key & ~(H == 0).all(-1)
            self.add("H", "rows with no readable key are zero", not zb.any(),
                     "zero output on rows with no readable key" if not zb.any()
                     else f"{int(zb.sum())} rows with no readable key are not zero",
                     _locate(zb, H.ndim - 2, False),
                     None if not zb.any() else "a padding query must output zeros, never NaN")

    def contributions(self):
        a = self.a
        if "C" not in a or "H" not in a:
            return
        C, H = a["C"], a["H"]
        if C.shape[:-2] != H.shape[:-1] or C.shape[-1] != H.shape[-1]:
            self.add("C", "Σ_j C[i, j] = H_i", False, f"C is {C.shape} but H is {H.shape} "
                     "(C must be T×T×d_v)")
            return
        ok, e, bad = _close(C.sum(-2), H, _rtol(self.eps["C"], self.eps["H"]))
        self.add("C", "Σ_j C[i, j] = H_i", ok, f"max |Σ_j C[i, j] - H_i| = {e:.3g}",
                 None if ok else {**_locate(bad.any(-1), H.ndim - 2, False), "max_err": e},
                 None if ok else "the contributions do not add up to the output")

    def output(self):
        a = self.a
        if "O" not in a or "H" not in a:
            return
        H, O = a["H"], a["O"]
        Hc = _merge_heads(H) if (self.h and H.ndim >= 3 and H.shape[-3] == self.h
                                 and H.ndim == O.ndim + 1) else H
        if "W_o" not in a:
            return
        W = a["W_o"]
        tol = _rtol(self.eps["O"], self.eps["H"], self.eps["W_o"])
        if Hc.shape[-1] != W.shape[0]:
            self.add("O", "O = H W_O", False, f"H is T×(h·d_v) = {Hc.shape[-2]}×{Hc.shape[-1]} "
                     f"but W_O is {W.shape[0]}×{W.shape[1]}")
            return
        ref = Hc @ W
        if O.shape != ref.shape:
            hint = ("O has H's shape: the output projection is missing"
                    if O.shape == Hc.shape else None)
            self.add("O", "O = H W_O", False, f"O has shape {O.shape} but H W_O is {ref.shape}",
                     {"shape": O.shape}, hint)
            return
        ok, e, bad = _close(O, ref, tol)
        hint = None
        if not ok:
            if W.shape[0] == W.shape[1] and _close(O, Hc @ W.T, tol)[0]:
                hint = "O = H W_Oᵀ: the output projection is transposed"
            elif O.shape == Hc.shape and _close(O, Hc, tol)[0]:
                hint = "O = H: the output projection is missing"
        self.add("O", "O = H W_O", ok, f"max |O - H W_O| = {e:.3g}",
                 None if ok else {**_locate(bad.any(-1), O.ndim - 2, False), "max_err": e}, hint)

    def run(self) -> Report:
        self.projections()
        self.scores()
        self.mask()
        if self._pending is not None:
            self._scale_from_weights(*self._pending)
        self.weights()
        self.values()
        self.contributions()
        self.output()
        if not self.checks:
            raise AuditInputError(
                f"nothing to check: given {', '.join(self.given)}, every later stage would be "
                "computed from them; give at least one computed stage (S, M, A, H, C or O) "
                "to check, or X with W_Q, W_K, W_V and Q, K or V")
        order = {s: i for i, s in enumerate(STAGE_ORDER)}
        checks = sorted(self.checks, key=lambda c: order[c.stage])
        return Report(checks, self.given, self.recomputed, self.empty_rows, self.notes)

