"""Probing, its inputs: queries and keys that separate the faults, the values to run them
with, and the pattern the reference reads on each; :class:`Plan` chooses the probes for one
function (its calling convention and what was declared).

A probe fixes Q (B, H, T_q, d_k) and K (B, H, T_k, d_k) and names the values V it is run
with (``values``: V = I gives A itself; random V, V = 0 and a wider V on the main probe;
ones for the long fp16 rows), and for code with an output projection the W_V, W_O to run
it with (``projection``). For the ``x-weights`` and ``module`` signatures Q and K come
from x (T×d_model, the same in every batch row) and random W_Q, W_K, and values are
reached through W_V = pinv(x)·V, which needs T <= d_model; a module with fewer key/value
heads than query heads (grouped-query attention) gets W_K, W_V of its own width, query
head i reading key/value head i // (H / H_kv).

The sizes are chosen apart (T, d_k, d_v, H·d_k and d_model differ where the function lets
them) so that a measured scale factor names one size, not a coincidence of two.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from .. import masks
from ..matrix_form import merge_heads, split_heads

__all__ = ["Probe", "Plan", "split_heads", "merge_heads", "qkv_probe", "x_probe", "KINDS"]

# what each probe is for, in the order they run (the main probe, or T = d_k when the main
# probe does not run, first)
KINDS = (
    "main",  # T ≠ d_k
    "T = d_k",  # for code that only runs there (K not transposed)
    "two-head",
    "decoding",  # T_q < T_k
    "padding",  # through the function's key_padding_mask= or lengths=
    "large",  # large scores (|S| about 40)
    "huge",  # |S| about 550: exp overflows even in float64
    "negative",  # every score about -400: below a finite fill
    "fp16",
    "long fp16",  # rows of 2500 keys in fp16
)
LONG_T = 2500  # fp16 rows this long lose their sums when accumulated in fp16


def eye(T: int) -> np.ndarray:
    """V = I (1, 1, T, T): the function returns its weights A."""
    return np.eye(T)[None, None]


@dataclass
class Probe:
    name: str
    Q: np.ndarray  # (B, H, T_q, d_k) float64, as the function sees it (after the dtype cast)
    K: np.ndarray  # (B, H, T_k, d_k)
    dtype: np.dtype
    pattern: masks.Pattern  # what the reference reads on this probe
    inputs: dict = field(default_factory=dict)  # x, w_q, w_k (x-weights, module) in dtype
    kwargs: dict = field(default_factory=dict)  # passed to the function (lengths= ...)
    kind: str = "main"  # one of KINDS
    values: dict = field(default_factory=dict)  # name -> V (1|B, H, T_k, n) it is run with
    projection: tuple | None = None  # (W_V, W_O) to run code with an output projection
    d_v: int | None = None  # the value width the function sees with V = I (None: T_k)

    @property
    def B(self):
        return self.Q.shape[0]

    @property
    def H(self):
        return self.Q.shape[1]

    @property
    def T_q(self):
        return self.Q.shape[2]

    @property
    def T_k(self):
        return self.K.shape[2]

    @property
    def d_k(self):
        return self.Q.shape[3]

    def allowed(self) -> np.ndarray:
        """The reference's read pattern, (B, H, T_q, T_k)."""
        a = self.pattern.allowed(self.B, self.H, self.T_q, self.T_k)
        return np.broadcast_to(a, (self.B, self.H, self.T_q, self.T_k))

    def G(self) -> np.ndarray:
        """Q Kᵀ in float64, (B, H, T_q, T_k): the raw scores the scale multiplies."""
        return self.Q @ np.swapaxes(self.K, -1, -2)

    def with_pattern(self, **kw) -> Probe:
        return replace(self, pattern=masks.Pattern(**{**_fields(self.pattern), **kw}))

    def slice(self, b: int, h: int) -> Probe:
        """One (b, h) slice as a (1, 1, T_q, T_k) probe, its pattern fitted to it."""
        E = self.allowed()[b : b + 1, h : h + 1]
        pat = self.pattern
        kw = {"causal": False, "mask": E}
        if pat.softcap is not None:
            kw["softcap"] = pat.softcap
        if pat.alibi_slopes is not None:
            sl = np.asarray(pat.alibi_slopes)
            kw["alibi_slopes"] = (sl[b] if sl.ndim == 2 else sl)[h : h + 1]
        if pat.sinks is not None:
            kw["sinks"] = np.asarray(pat.sinks)[h : h + 1]
        return replace(
            self,
            Q=self.Q[b : b + 1, h : h + 1],
            K=self.K[b : b + 1, h : h + 1],
            pattern=masks.Pattern(**kw),
        )


def _fields(p: masks.Pattern) -> dict:
    return {n: getattr(p, n) for n in masks.PATTERN_KEYWORDS}


def _cast(a, dtype):
    return np.asarray(a, dtype=np.float64).astype(dtype)


def qkv_probe(
    name, rng, *, B=1, H=1, T_q, T_k, d_k, mag, dtype, pattern, kwargs=None, negative=False
):
    """q, k ~ N(0, mag²), so the scaled scores spread over about ±mag². ``negative``: every
    query points away from every key, so all scores are about -mag²·d_k (below any fill
    that replaces a blocked score by a constant such as -1e4)."""
    if negative:
        u = rng.normal(size=d_k)
        u /= np.linalg.norm(u)
        q = -(u + 0.05 * rng.normal(size=(B, H, T_q, d_k))) * mag
        k = (u + 0.05 * rng.normal(size=(B, H, T_k, d_k))) * mag
    else:
        q = rng.normal(size=(B, H, T_q, d_k)) * mag
        k = rng.normal(size=(B, H, T_k, d_k)) * mag
    q, k = _cast(q, dtype), _cast(k, dtype)
    return Probe(
        name,
        q.astype(np.float64),
        k.astype(np.float64),
        np.dtype(dtype),
        pattern,
        {"q": q, "k": k},
        kwargs or {},
    )


def x_probe(
    name, rng, *, B=1, T, d_model, heads, d_k, mag, dtype, pattern, kwargs=None, kv_heads=None
):
    """x (B, T, d_model) with the same T×d_model rows in every batch row; W_Q, W_K random
    (W_K for ``kv_heads`` heads, each read by heads / kv_heads query heads; K per query head)."""
    kv = kv_heads or heads
    x0 = rng.normal(size=(T, d_model))
    x = _cast(np.broadcast_to(x0, (B, T, d_model)), dtype)
    w_q = _cast(rng.normal(size=(d_model, heads * d_k)) * mag / np.sqrt(d_model), dtype)
    w_k = _cast(rng.normal(size=(d_model, kv * d_k)) * mag / np.sqrt(d_model), dtype)
    x64, wq, wk = (a.astype(np.float64) for a in (x, w_q, w_k))
    Q = split_heads(x64 @ wq, heads)
    K = np.repeat(split_heads(x64 @ wk, kv), heads // kv, axis=1)
    return Probe(
        name, Q, K, np.dtype(dtype), pattern, {"x": x, "w_q": w_q, "w_k": w_k}, kwargs or {}
    )


def apart(T: int, H: int, first: int = 3) -> int:
    """A d_k for a T-key probe with H heads, ``first`` if it will do: d_k, H·d_k and T
    (= d_v with V = I) all differ, so that no scale factor fits two of them."""
    for d_k in (first, 3, 4, 5, 2, 7):
        if d_k != T and (H == 1 or H * d_k != T):
            return d_k
    return first


class Plan:
    """The probes for one function: its signature (``"qkv"``, ``"x-weights"``,
    ``"module"``), its sizes (``dims``: d_model, d_k, heads, kv_heads, d_v, hd_v = h·d_v,
    d_out), the padding
    keyword it takes, the declared pattern keywords, its dtype and whether it applies W_O.
    ``main_probes()`` first (the first that runs is the main probe), then ``further(main)``:
    groups of alternatives (the first of a group that runs counts)."""

    def __init__(self, sig, dims, pad_kind, declared, dtype, has_wo):
        self.sig, self.pad_kind, self.declared = sig, pad_kind, declared
        self.dtype, self.has_wo = dtype, has_wo
        self.dims = dims or {
            "d_model": 8,
            "d_k": 3,
            "heads": None,
            "kv_heads": None,
            "d_v": 6,
            "hd_v": 6,
            "d_out": 6,
        }
        self.rng = np.random.default_rng(1234)
        fixed = [k for k in ("lengths", "key_padding_mask", "prefix_lengths") if k in declared]
        self.B = len(declared[fixed[0]]) if fixed else 1
        key_padding = declared.get("key_padding_mask")
        self.T_fixed = None if key_padding is None else int(np.asarray(key_padding).shape[-1])
        if "mask" in declared:
            self.T_fixed = int(np.asarray(declared["mask"]).shape[-1])
        # (B, T) padding next to (B, H, T, d) inputs is read as (H, T) by (B, T, d) code
        self.per_batch = bool(fixed) or "mask" in declared or "cu_seqlens" in declared
        if "sinks" in declared:  # sinks and slopes fix H
            self.H = len(np.asarray(declared["sinks"]))
        elif "alibi_slopes" in declared:
            self.H = np.asarray(declared["alibi_slopes"]).shape[-1]
        else:
            self.H = 1
        per_head = "sinks" in declared or "alibi_slopes" in declared
        if sig != "qkv" and per_head and self.H != (self.dims["heads"] or 1):
            what = "sinks" if "sinks" in declared else "alibi_slopes"
            raise ValueError(
                f"diagnose: the declared {what} are for {self.H} heads, but the "
                f"{'module has' if sig == 'module' else 'x-weights signature has'} "
                f"{self.dims['heads'] or 1}"
            )

    def pattern(self, **extra) -> masks.Pattern:
        return masks.Pattern(**{**self.declared, **extra})

    def make(
        self,
        name,
        kind,
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
    ) -> Probe:
        dtype = dtype or self.dtype
        B = self.B if B is None else B
        if kwargs is None and self.pad_kind in self.declared:  # the function takes it: pass it
            kwargs = {self.pad_kind: np.asarray(self.declared[self.pad_kind])}
        T = self.T_fixed or T
        pat = pattern or self.pattern()
        if self.sig == "qkv":
            p = qkv_probe(
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
        else:
            d = self.dims
            p = x_probe(
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
                kv_heads=d.get("kv_heads"),
            )
        d_v = self.dims["d_v"] if self.sig == "module" else None
        return replace(p, kind=kind, values={"eye": eye(p.T_k)}, d_v=d_v)

    def main_probes(self) -> list[Probe]:
        """The main probe (T ≠ d_k), and T = d_k for code that only runs there; each with
        the values that measure linearity (random, zero) and the d_v dependence (wide)."""
        if self.sig == "module":
            d = self.dims
            d_k, dm, h = d["d_k"], d["d_model"], d["heads"] or 1
            taken = {d_k, d["d_v"], h * d_k, h * d["d_v"], dm}  # T = pinv(x)'s rank: <= d_model
            T = next((t for t in (6, 5, 7, 4, 3) if t < dm and t not in taken), min(6, dm))
            probes = [self.make("main probe", "main", T=T, d_k=d_k)]
        else:
            T = self.T_fixed or 6
            d_k = apart(T, self.H)
            probes = [
                self.make("main probe", "main", T=T, d_k=d_k),
                self.make("T = d_k probe", "T = d_k", T=T, d_k=T),
            ]
        out = []
        g = self.dims.get("kv_heads") or 1 if self.sig == "module" else None
        for p in probes:
            n, H = p.T_k, p.H
            kv = g or H  # one random V per key/value head, shared by its query heads
            rand = np.repeat(np.random.default_rng(7).normal(size=(1, kv, n, n)), H // kv, 1)
            values = {
                **p.values,
                "again": p.values["eye"],  # the same input twice: is it deterministic?
                "random": rand,
                "zero": np.zeros((1, H, n, n)),
            }
            if self.sig != "module":  # with d_v doubled: does the scale follow d_v?
                values["wide"] = np.concatenate([eye(n), np.zeros((1, 1, n, n))], -1)
            out.append(replace(p, values=values, projection=self._projection(p)))
        return out

    def _projection(self, p: Probe):
        if not self.has_wo:
            return None
        rng, d = np.random.default_rng(11), self.dims
        kv_width = (d.get("kv_heads") or 1) * d["d_v"] if self.sig == "module" else d["hd_v"]
        w_v = (rng.normal(size=(d["d_model"], kv_width)) / 2).astype(p.dtype)
        w_o = (rng.normal(size=(d["hd_v"], d["d_out"])) / 2).astype(p.dtype)
        return w_v, w_o

    def further(self, main: Probe) -> list[list[Probe]]:
        """The probes after the main one, in order; each group: alternatives."""
        out: list[list[Probe]] = []
        per_head = "sinks" in self.declared or "alibi_slopes" in self.declared
        qkv = self.sig == "qkv"
        if qkv and main.H == 1 and not per_head and not self.per_batch:
            d_k = main.d_k if main.kind == "T = d_k" else apart(main.T_k, 2, main.d_k)
            out.append([self.make("two-head probe", "two-head", T=main.T_k, d_k=d_k, H=2)])
        if qkv and not self.per_batch and not self.T_fixed:
            out.append(
                [self.make("decoding probe (T_q < T_k)", "decoding", T_q=3, T=7, d_k=main.d_k)]
            )
        if qkv and self.pad_kind and not self.per_batch:
            if self.pad_kind == "lengths":
                pad = np.array([6, 3])
                pat = self.pattern(lengths=pad)
            else:
                pad = np.array([[True] * 6, [False, False] + [True] * 4])  # left padding
                pat = self.pattern(key_padding_mask=pad)
            kw = {self.pad_kind: pad}
            p = self.make(
                "padding probe", "padding", T=6, d_k=main.d_k, B=2, pattern=pat, kwargs=kw
            )
            out.append([p])
        stability = [
            ("large-score probe", "large", 40.0, False),
            ("huge-score probe", "huge", 550.0, False),
        ]
        if qkv:
            stability.append(("negative-score probe", "negative", 400.0, True))
        for name, kind, mag, neg in stability:
            mag = mag / max(1.0, main.d_k**0.25)
            p = self.make(name, kind, T=main.T_k, d_k=main.d_k, mag=mag, H=main.H, negative=neg)
            out.append([p])
        if self.sig == "module":
            return out
        out.append(
            [self.make("fp16 probe", "fp16", T=main.T_k, d_k=main.d_k, dtype=np.float16, H=main.H)]
        )
        if not qkv or self.T_fixed or self.per_batch or "sinks" in self.declared:
            return out  # (rows do not sum to 1 with sinks; the fp16 probe above covers them)
        long_rows = []
        for T_q in (4, LONG_T):  # decoding layout first: 4 long rows are cheap to run
            p = self.make(
                "long fp16 rows",
                "long fp16",
                T_q=T_q,
                T=LONG_T,
                d_k=3,
                mag=0.1,
                dtype=np.float16,
                H=self.H,  # (declared slopes or sinks fix it)
            )
            long_rows.append(replace(p, values={"ones": np.ones((1, 1, LONG_T, 1))}))
        out.append(long_rows)
        return out
