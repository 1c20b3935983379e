"""The offline explorer: one self-contained HTML page (or notebook fragment).

All script and style are inline and nothing is fetched: the page works from a file,
behind a firewall, in an e-mail. Data travel as JSON in ``<script type="application/json">``
blocks, with ``<``, ``>`` and ``&`` escaped, and the page's script touches tokens only through
``textContent`` and canvas text, so a token is always shown as text. The canvas, not the
DOM, draws the cells.

What is shown: sequences (sentences) × layers × heads. A list of Traces that share their
tokens is read as the layers of one model (what
:func:`causalattn.integrations.transformers.capture` returns) and gets a *model view*: a grid
of layers × heads thumbnails with a summary per head; any other list is read as one sequence
per Trace (``layers=`` decides explicitly).

Paging: the first block holds the index (names and lengths); each sequence's tokens, mask
kinds and thumbnails, and each layer's heads, are blocks of their own, parsed only when
opened, so a page of 10,000 sentences opens as fast as one of ten.

What is stored, per head: when the trace's S and A are what Q, K, the scale and the mask
give, the page carries Q and K and recomputes S and the masked softmax itself (Q, K are
T×d_k, far smaller than T×T); otherwise S and A themselves (readable entries only). The
precision follows the page's size budget (``max_bytes``, the file size aimed at): float64
while it fits, else float32, else float16 with V cut to its first :data:`V_SHOWN` components plus
its exact norms (the side
panel shows no more). The page says which, and how far its recomputed A is from the
trace's (measured here, in float64). Thumbnails are max-pooled to at most 48×48. Should
the sequences still not fit, the page keeps the first ones and says so (one sequence is
never cut).
"""

from __future__ import annotations

import base64
import html
import json
import secrets
from importlib import resources
from pathlib import Path
from typing import NamedTuple

import numpy as np

from ..reference import softmax_last
from ..trace import Trace
from .kinds import KINDS, PAD, pad_of, sequences, tokens_of
from .learnpanel import learn_data
from .sentences import batch_traces, sentence_names
from .summary import head_summary, thumbnail

__all__ = [
    "explorer_data",
    "explorer_html",
    "explorer_fragment",
    "write_explorer",
    "MAX_BYTES",
    "V_SHOWN",
]

MAX_BYTES = 18 * 2**20  # the size a page aims at (see the module docstring)
V_SHOWN = 4  # float16 pages keep v_j's first components (the side panel shows 3, then "…")
THUMB = 48
_TOL = {"f8": 1e-9, "f4": 2e-5, "f2": 2e-2}  # largest |A_page - A_trace| accepted per precision
_DTYPE = {"f8": "<f8", "f4": "<f4", "f2": "<f2"}


def _b64(a: np.ndarray, dtype: str = "<f4") -> str:
    return base64.b64encode(np.ascontiguousarray(a, dtype=dtype).tobytes()).decode("ascii")


def _finite_or_none(x) -> float | None:
    return float(x) if x is not None and np.isfinite(x) else None


def _rle(codes: np.ndarray) -> dict:
    """Run-length form of a T×T uint8 array, row-major: {"codes": b64 u8, "runs": b64 u32}."""
    flat = np.ascontiguousarray(codes, dtype=np.uint8).ravel()
    cut = np.flatnonzero(flat[1:] != flat[:-1]) + 1
    starts = np.concatenate([[0], cut])
    runs = np.diff(np.concatenate([starts, [flat.size]]))
    return {"codes": _b64(flat[starts], "u1"), "runs": _b64(runs, "<u4")}


class _Layer(NamedTuple):
    name: str
    trace: Trace  # one sequence, heads (if any) on the leading axis
    kinds: np.ndarray  # T×T uint8


class _Seq(NamedTuple):
    name: str
    layers: list[_Layer]


# -- what a head carries ---------------------------------------------------------------------
def _src_prec(a: np.ndarray) -> str:
    return "f8" if a.dtype == np.float64 else "f4" if a.dtype.itemsize >= 4 else "f2"


def _narrower(p: str, q: str) -> str:
    return p if "f8f4f2".index(p) > "f8f4f2".index(q) else q


def _cast(a: np.ndarray, prec: str) -> tuple[np.ndarray, str]:
    """``a`` at precision ``prec`` (never wider than its own), float32 if float16 overflows."""
    p = _narrower(prec, _src_prec(a))
    c = a.astype(_DTYPE[p])
    if p == "f2" and not np.isfinite(c[np.isfinite(a)]).all():
        p, c = "f4", a.astype("<f4")
    return c, p


def _stacked(tr: Trace, name: str) -> np.ndarray:
    """A per-head stage of a one-sequence trace as ``(h, T, ·)`` (h = 1 without heads)."""
    a = np.asarray(tr[name])
    return a if tr.n_heads is not None else a[None]


_CHUNK_CELLS = 4 * 2**20  # T×T cells per vectorized step (a few float64 arrays of 32 MiB)


class _Shared:
    """Weights shared by many traces, and a table of their distinct rows of X.

    Sentences traced with one set of weights (:func:`batch_traces`) differ only in their
    tokens: the page gets W_Q, W_K, W_V and each distinct embedding row once, and each
    sentence as row numbers; it computes Q, K, V = X W per head itself, in float64, exactly
    as the trace did. 10,000 sentences then cost a few bytes each.
    """

    def __init__(self):
        self.sets: list[dict] = []
        self._by_key: dict = {}
        self._by_id: dict = {}  # keeps the arrays alive, so their ids stay theirs

    def set_for(self, tr: Trace) -> int:
        ids = (tr.n_heads,) + tuple(id(tr[n]) for n in ("W_q", "W_k", "W_v"))
        if ids in self._by_id:  # the same arrays again (sentences of one batch_traces call)
            return self._by_id[ids][0]
        W = tuple(np.ascontiguousarray(tr[n], dtype=np.float64) for n in ("W_q", "W_k", "W_v"))
        key = (tr.n_heads,) + tuple((w.shape, w.tobytes()) for w in W)
        if key not in self._by_key:
            self._by_key[key] = len(self.sets)
            self.sets.append({"W": W, "n_heads": tr.n_heads or 1, "rows": {}, "table": []})
        self._by_id[ids] = (self._by_key[key], tuple(tr[n] for n in ("W_q", "W_k", "W_v")))
        return self._by_key[key]

    def rows(self, k: int, X: np.ndarray) -> np.ndarray:
        """Row numbers of X's rows in set k's table (new rows are added)."""
        st = self.sets[k]
        out = np.empty(len(X), dtype=np.int64)
        for t, row in enumerate(np.ascontiguousarray(X, dtype=np.float64)):
            key = row.tobytes()
            if key not in st["rows"]:
                st["rows"][key] = len(st["table"])
                st["table"].append(row)
            out[t] = st["rows"][key]
        return out

    def block(self, k: int) -> dict:
        st = self.sets[k]
        Wq, Wk, Wv = st["W"]
        table = np.stack(st["table"]) if st["table"] else np.zeros((0, Wq.shape[0]))
        return {
            "n_heads": st["n_heads"],
            "d_model": int(Wq.shape[0]),
            "X": _b64(table, "<f8"),
            "W_q": _b64(Wq, "<f8"),
            "W_k": _b64(Wk, "<f8"),
            "W_v": _b64(Wv, "<f8"),
            "cols": [int(Wq.shape[1]), int(Wk.shape[1]), int(Wv.shape[1])],
        }


def _from_weights(layers: list[_Layer], st: dict) -> np.ndarray:
    """Per layer: whether its Q, K, V are exactly X W (split into heads), as the page computes."""
    tr0 = layers[0].trace
    if not all(n in tr0 for n in ("X", "W_q", "W_k", "W_v")) or st["Q"].shape != st["K"].shape:
        return np.zeros(len(layers), bool)
    W = [tr0[n] for n in ("W_q", "W_k", "W_v")]
    same = np.array(
        [
            all(
                lay.trace[n] is w or np.array_equal(lay.trace[n], w)
                for n, w in zip(("W_q", "W_k", "W_v"), W)
            )
            for lay in layers
        ]
    )
    X = np.stack([np.asarray(lay.trace["X"], dtype=np.float64) for lay in layers])
    if X.ndim != 3 or X.shape[1] != st["Q"].shape[2]:
        return np.zeros(len(layers), bool)
    H = st["Q"].shape[1]
    ok = same & np.isfinite(X).all(axis=(1, 2))
    with np.errstate(all="ignore"):
        for name, w in zip(("Q", "K", "V"), W):
            Y = X @ np.asarray(w, dtype=np.float64)  # (n, T, h·d) -> (n, h, T, d)
            Y = np.moveaxis(Y.reshape(Y.shape[0], Y.shape[1], H, -1), 2, 1)
            if Y.shape != st[name].shape:
                return np.zeros(len(layers), bool)
            ok &= np.isclose(Y, st[name], rtol=1e-12, atol=1e-12).all(axis=(1, 2, 3))
    return ok


def _modifiers(tr: Trace, H: int) -> dict | None:
    """The score modifiers of the trace's pattern the page applies itself: ``{"softcap": c,
    "slopes": (h,), "sinks": (h,)}`` (None entries when absent); None when the pattern has
    one the page cannot apply (ALiBi slopes per sequence)."""
    pat = getattr(tr, "pattern", None)
    out = {"softcap": None, "slopes": None, "sinks": None}
    if pat is None or not getattr(pat, "has_modifiers", False):
        return out
    from ..masks import _numpy

    out["softcap"] = None if pat.softcap is None else float(pat.softcap)
    for name, key in (("alibi_slopes", "slopes"), ("sinks", "sinks")):
        v = getattr(pat, name)
        if v is None:
            continue
        v = np.asarray(_numpy(v), dtype=np.float64)
        if v.ndim == 2 and v.shape[0] == 1:
            v = v[0]
        if v.shape != (H,) or not np.isfinite(v).all():
            return None
        out[key] = [float(x) for x in v]
    return out


def _layers_data(
    layers: list[_Layer], prec: str, shared: _Shared | None = None
) -> list[tuple[dict, list[float | None]]]:
    """Each layer's block (scale and heads) at precision ``prec``, with the page's error on A
    per head (None: S and A carried as they are). Layers of the same shapes are done
    together, a few million cells at a time: 10,000 sentences cost about as much as one."""
    groups: dict[tuple, list[int]] = {}
    for k, lay in enumerate(layers):
        tr = lay.trace
        A = _stacked(tr, "A")
        al = np.broadcast_to(lay.kinds == 0, A.shape)
        if tr.allowed is not None and not np.array_equal(np.broadcast_to(tr.allowed, A.shape), al):
            raise ValueError(
                f"explorer: {lay.name}: a head has another mask than the layer's "
                "kinds; the explorer draws one mask per layer"
            )
        names = tuple(n for n in ("Q", "K", "V", "S", "A", "H") if n in tr)
        key = (names, tr.scale, json.dumps(_modifiers(tr, A.shape[0]))) + tuple(
            (_stacked(tr, n).shape, _stacked(tr, n).dtype.str) for n in names
        )
        groups.setdefault(key, []).append(k)
    out: list = [None] * len(layers)
    for members in groups.values():
        H, T = _stacked(layers[members[0]].trace, "A").shape[:2]
        step = max(1, _CHUNK_CELLS // max(1, H * T * T))
        for c in range(0, len(members), step):
            part = members[c : c + step]
            for k, res in zip(part, _group_data([layers[k] for k in part], prec, shared)):
                out[k] = res
    return out


def _group_data(
    layers: list[_Layer], prec: str, shared: _Shared | None = None
) -> list[tuple[dict, list[float | None]]]:
    """:func:`_layers_data` for layers of identical shapes, stacked to ``(n, h, T, ·)``."""
    tr0 = layers[0].trace
    scale = tr0.scale
    st = {
        n: (
            _stacked(tr0, n)[None]
            if len(layers) == 1  # a view: no copy of a big layer
            else np.stack([_stacked(lay.trace, n) for lay in layers])
        )
        for n in ("Q", "K", "V", "S", "A", "H")
        if n in tr0
    }
    al = np.stack([lay.kinds == 0 for lay in layers])[:, None]  # (n, 1, T, T)
    V = st["V"]
    n, H, T, dv = V.shape
    with np.errstate(invalid="ignore", over="ignore"):
        vnorm = np.linalg.norm(V.astype(np.float64), axis=-1)
    cut = prec == "f2" and dv > V_SHOWN
    Vc, pv = _cast(V[..., :V_SHOWN] if cut else V, prec)
    ok = np.zeros((n, H), bool)
    err = np.full((n, H), np.nan)
    mods = _modifiers(tr0, H)
    fromW = np.zeros(n, bool)
    if shared is not None and "Q" in st and "K" in st:
        fromW = _from_weights(layers, st)
    if (
        scale is not None
        and mods is not None
        and all(k in st for k in ("Q", "K", "S", "A"))
        and st["Q"].shape == st["K"].shape
    ):
        Q, K, S, A = st["Q"], st["K"], st["S"], st["A"]
        qprec = "f8" if fromW.all() else prec  # from weights, the page works in float64
        Qc, pq = _cast(Q, qprec)
        Kc, pk = _cast(K, qprec)
        # What the page computes (in float64); float32 is as good a check for float32 or
        # float16 Q and K (its rounding, ~1e-7, is far below their tolerance), and faster.
        # A few heads at a time, so a 2048-token layer never holds more than a few T×T arrays.
        dt = np.float64 if Qc.dtype == np.float64 and Kc.dtype == np.float64 else np.float32
        e, es, smax = (np.zeros((n, H)) for _ in range(3))
        hstep = max(1, _CHUNK_CELLS // max(1, n * T * T))
        dist = np.abs(np.arange(T)[:, None] - np.arange(T)[None, :])
        for h0 in range(0, H, hstep):
            hs = slice(h0, h0 + hstep)
            with np.errstate(all="ignore"):
                S2 = (Qc[:, hs].astype(dt) @ np.swapaxes(Kc[:, hs].astype(dt), -1, -2)) * dt(scale)
                Z2 = S2
                if mods["softcap"] is not None:  # softcap, then ALiBi
                    Z2 = mods["softcap"] * np.tanh(Z2 / mods["softcap"])
                if mods["slopes"] is not None:
                    Z2 = Z2 - np.asarray(mods["slopes"][hs], dt)[:, None, None] * dist
                sinks = (
                    None
                    if mods["sinks"] is None
                    else np.asarray(mods["sinks"][hs], np.float64)[:, None, None]
                )
                A2 = softmax_last(Z2, al, sinks=sinks)
                e[:, hs] = np.nan_to_num(np.abs(A2 - A[:, hs]), nan=np.inf).max(axis=(-2, -1))
                es[:, hs] = np.where(al, np.nan_to_num(np.abs(S2 - S[:, hs]), nan=np.inf), 0).max(
                    axis=(-2, -1)
                )
                smax[:, hs] = np.where(al, np.abs(S[:, hs]), 0).max(axis=(-2, -1))
            del S2, Z2, A2
        finite = np.isfinite(Q).all(axis=(-2, -1)) & np.isfinite(K).all(axis=(-2, -1))
        tol = _TOL[_narrower(pq, pk)]
        ok = finite & (e <= tol) & (es <= tol * np.maximum(1.0, smax))
        err = np.where(ok, e, np.nan)
    notAV = np.zeros((n, H), bool)  # H is not A V (a recorded bug)
    if "H" in st:
        hstep = max(1, _CHUNK_CELLS // max(1, n * T * T))
        for h0 in range(0, H, hstep):
            hs = slice(h0, h0 + hstep)
            with np.errstate(all="ignore"):
                AV = np.where(al, st["A"][:, hs], 0.0) @ np.where(
                    np.isfinite(V[:, hs]), V[:, hs], 0.0
                )
                notAV[:, hs] = ~np.isclose(
                    AV, st["H"][:, hs], rtol=1e-6, atol=1e-9, equal_nan=True
                ).all(axis=(-2, -1))
    sendH = notAV & (not cut)  # with part of V, the page computes part of h_i, and says so
    xform = fromW & ok.all(axis=1) & ~notAV.any(axis=1)
    res = []
    for i in range(n):
        heads_out, errs = [], []
        a = al[i, 0]
        if xform[i]:  # Q, K, V = X W: the page computes them from the shared weights
            tr = layers[i].trace
            k = shared.set_for(tr)
            rows = shared.rows(k, tr["X"])
            rp = "u2" if rows.max(initial=0) < 2**16 else "<u4"
            errs = [0.0] * H  # float64 throughout, as the trace itself
            heads_out = [
                {"form": "x", "d_k": int(st["Q"].shape[-1]), "d_v": int(dv), "v_shown": int(dv)}
                for _ in range(H)
            ]
            res.append(
                (
                    {
                        "scale": _finite_or_none(scale),
                        "xset": k,
                        "rows": _b64(rows, rp),
                        "rprec": "u2" if rp == "u2" else "u4",
                        "mods": mods,
                        "heads": heads_out,
                    },
                    errs,
                )
            )
            continue
        for h in range(H):
            d = {
                "d_v": int(dv),
                "V": _b64(Vc[i, h], _DTYPE[pv]),
                "vprec": pv,
                "v_shown": V_SHOWN if cut else int(dv),
            }
            if cut:
                d["vnorm"] = _b64(vnorm[i, h], "<f4")
            if ok[i, h]:
                d.update(
                    form="qk",
                    Q=_b64(Qc[i, h], _DTYPE[pq]),
                    K=_b64(Kc[i, h], _DTYPE[pk]),
                    qprec=_narrower(pq, pk),
                    d_k=int(Qc.shape[-1]),
                )
                errs.append(float(err[i, h]))
            else:  # readable entries only, row-major
                Sc, ps = _cast(st["S"][i, h][a], _narrower(prec, "f4"))
                Ac, pa = _cast(st["A"][i, h][a], _narrower(prec, "f4"))
                d.update(
                    form="dense", S=_b64(Sc, _DTYPE[ps]), A=_b64(Ac, _DTYPE[pa]), sprec=ps, aprec=pa
                )
                errs.append(None)
            if sendH[i, h]:  # H is not A V (a recorded bug): it travels as it is
                Hc, ph = _cast(st["H"][i, h], _narrower(prec, "f4"))
                d.update(H=_b64(Hc, _DTYPE[ph]), hprec=ph)
            heads_out.append(d)
        res.append(({"scale": _finite_or_none(scale), "mods": mods, "heads": heads_out}, errs))
    return res


def _elements(seqs: list[_Seq]) -> int:
    """Numbers per page in the Q/K/V form (the budget's yardstick)."""
    n = 0
    for s in seqs:
        for lay in s.layers:
            tr = lay.trace
            H = tr.n_heads or 1
            T = lay.kinds.shape[0]
            d_k = tr["Q"].shape[-1] if "Q" in tr else T
            n += H * T * (2 * d_k + tr["V"].shape[-1])
    return n


def _precision(seqs: list[_Seq], max_bytes: int) -> str:
    """The widest precision whose matrices, in base64 (4/3), fit in ``max_bytes``."""
    n = _elements(seqs) * 4 / 3
    return "f8" if 8 * n <= max_bytes else "f4" if 4 * n <= max_bytes else "f2"


def _sequence_meta(seq: _Seq, block_of_layer, rle_cache: dict) -> dict:
    """A sequence's block: tokens, padding, and per layer its kinds (and thumbnails and head
    summaries when there are several layers). Sentences of one length share their kinds:
    ``rle_cache`` encodes each distinct kinds matrix once."""
    first = seq.layers[0]
    T = first.kinds.shape[0]
    tokens = tokens_of(first.trace, T)
    pad = pad_of(first.kinds) | np.array([t == PAD for t in tokens], dtype=bool)
    layers = []
    model = len(seq.layers) > 1
    for k, lay in enumerate(seq.layers):
        kb = lay.kinds.tobytes() + bytes(lay.kinds.shape[0] % 256)
        if kb not in rle_cache:
            rle_cache[kb] = _rle(lay.kinds)
        d = {
            "name": lay.name,
            "n_heads": lay.trace.n_heads or 1,
            "kinds": rle_cache[kb],
            "block": block_of_layer(k),
        }
        if model:
            A = np.asarray(lay.trace["A"])
            A3 = A if A.ndim == 3 else A[None]
            ids = getattr(lay.trace, "ids", None)
            per = [head_summary(a, lay.kinds, tokens if ids is None else ids) for a in A3]
            d["summary"] = {  # one head at a time: bounded
                k2: [
                    p[k2][0] if k2 == "role" else _finite_or_none(round(float(p[k2][0]), 4))
                    for p in per
                ]
                for k2 in per[0]
            }
            th = np.stack([thumbnail(a, THUMB) for a in A3])
            d["thumb"] = {"n": int(th.shape[-1]), "px": _b64(th, "u1")}
        layers.append(d)
    gen = int(getattr(first.trace, "generated", 0) or 0)  # the last `gen` were generated
    return {"tokens": tokens, "pad": pad.astype(int).tolist(), "gen": gen, "layers": layers}


# -- reading what was given ------------------------------------------------------------------
def _is_model(traces: list[Trace]) -> bool:
    """A list of Traces is one model's layers when they share tokens and shapes."""
    if len(traces) < 2 or traces[0].tokens is None or "A" not in traces[0]:
        return False
    t0, s0 = traces[0].tokens, traces[0]["A"].shape
    return all(t.tokens == t0 and "A" in t and t["A"].shape == s0 for t in traces[1:])


def _plain(tr: Trace) -> Trace:
    """The stages the explorer reads, each read once: a Trace may compute its T×T stages on
    every read (a captured Hugging Face layer does), and the explorer looks at them often."""
    arrays = {
        n: np.asarray(tr[n])
        for n in ("X", "W_q", "W_k", "W_v", "Q", "K", "V", "S", "A", "H")
        if n in tr
    }
    out = Trace(
        arrays,
        allowed=tr.allowed,
        scale=tr.scale,
        n_heads=tr.n_heads,
        tokens=tr.tokens,
        pattern=getattr(tr, "pattern", None),
        reasons=getattr(tr, "reasons", None),
    )
    return out


def _layer_name(tr: Trace, k: int) -> str:
    """ "layer N", 1-based: the model's own index when the trace knows it (``tr.layer``)."""
    idx = getattr(tr, "layer", None)
    return f"layer {int(idx) + 1}" if isinstance(idx, (int, np.integer)) else f"layer {k + 1}"


def _named_sequences(obj, names, layers) -> list[_Seq]:
    """Accept a Trace, a list of Traces (layers or sequences), or a text.Batch."""
    from ..text import Batch

    if isinstance(obj, Batch):
        names = sentence_names(obj) if names is None else names
        obj = batch_traces(obj)
    traces = [obj] if isinstance(obj, Trace) else list(obj)
    if not traces:
        raise ValueError("explorer: nothing to show; give at least one Trace")
    for k, tr in enumerate(traces):
        if not isinstance(tr, Trace):
            raise ValueError(f"explorer: item {k + 1} is a {type(tr).__name__}, not a Trace")
    as_model = _is_model(traces) if layers is None else bool(layers)
    if as_model:
        per_layer = [sequences(_plain(tr)) for tr in traces]
        n = len(per_layer[0])
        shapes = {(len(p), p[0].kinds.shape) for p in per_layer}
        if len(shapes) != 1:
            raise ValueError(
                f"explorer: layers=True needs layers of the same sequences and "
                f"length; got (sequences, T×T) {sorted(shapes)}"
            )
        batch_tokens = getattr(traces[0], "batch_tokens", None)  # a capture's, per sequence
        ids = getattr(traces[0], "ids", None)
        ids = None if ids is None else np.asarray(ids).reshape(n, -1)
        for b in range(n):
            for p in per_layer:
                if batch_tokens is not None and len(batch_tokens) == n:
                    p[b].trace.tokens = [str(t) for t in batch_tokens[b]]
                p[b].trace.ids = None if ids is None else ids[b]
                p[b].trace.generated = getattr(traces[0], "generated", 0)
        out = [
            _Seq(
                per_layer[0][b].name if n > 1 else "sequence 1",
                [
                    _Layer(_layer_name(tr, k), p[b].trace, p[b].kinds)
                    for k, (tr, p) in enumerate(zip(traces, per_layer))
                ],
            )
            for b in range(n)
        ]
    else:
        out = []
        for k, tr in enumerate(traces):
            parts = sequences(_plain(tr))
            for part in parts:
                label = (
                    part.name
                    if len(traces) == 1
                    else (f"trace {k + 1}" + (f" {part.name}" if len(parts) > 1 else ""))
                )
                out.append(_Seq(label, [_Layer("layer 1", part.trace, part.kinds)]))
    if names is not None:
        names = [str(n) for n in names]
        if len(names) != len(out):
            raise ValueError(f"explorer: {len(names)} names for {len(out)} sequences")
        out = [_Seq(n, s.layers) for n, s in zip(names, out)]
    return out


# -- the page's data -------------------------------------------------------------------------
_NOTE_PREC = {
    "f8": "",
    "f4": "Q, K and V are stored as float32 to keep the file small",
    "f2": (
        "Q and K are stored as float16 and v_j as its first {v} components (float16) with "
        "its exact norm, to keep the file small"
    ),
}


def _build(obj, *, names, title, layers, max_bytes, questions):
    """(index, blocks): the page's first JSON block and its paged blocks, in order."""
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, (int, np.integer)) or max_bytes < 1:
        raise ValueError(f"explorer: max_bytes must be a positive integer, got {max_bytes!r}")
    seqs = _named_sequences(obj, names, layers)
    prec = _precision(seqs, max_bytes)
    blocks: list[str] = []
    index, notes, errs, cache, shared = [], [], [], {}, _Shared()
    used, chunk = 0, 256  # sequences prepared together (see _layers_data)
    for c0 in range(0, len(seqs), chunk):
        part = seqs[c0 : c0 + chunk]
        done = iter(_layers_data([lay for seq in part for lay in seq.layers], prec, shared))
        for seq in part:
            if used > max_bytes:
                break
            first = len(blocks) + 1  # the layers' blocks follow the sequence's own block
            blocks.append(_json_for_script(_sequence_meta(seq, lambda k, f=first: f + k, cache)))
            for data, e in (next(done) for _ in seq.layers):
                errs += e
                blocks.append(_json_for_script(data))
            used += sum(len(b) for b in blocks[first - 1 :])
            index.append(
                {
                    "name": seq.name,
                    "T": int(seq.layers[0].kinds.shape[0]),
                    "n_layers": len(seq.layers),
                    "block": first - 1,
                }
            )
        if used > max_bytes and len(index) < len(seqs):
            notes.append(
                f"Showing the first {len(index)} of {len(seqs)} sequences: the page "
                f"would pass its size limit (max_bytes = {max_bytes}). Give fewer, or "
                "raise it."
            )
            break
    xsets = []
    for k in range(len(shared.sets)):  # after the sequences, but sent before the script
        xsets.append(len(blocks))
        blocks.append(_json_for_script(shared.block(k)))
    uses_prec = any('"form":"qk"' in b or '"form":"dense"' in b for b in blocks)
    if prec != "f8" and uses_prec:
        notes.append(_NOTE_PREC[prec].format(v=V_SHOWN) + ".")
    done = [e for e in errs if e is not None]
    if done and max(done) > 1e-9:
        notes.append(
            f"S and A are recomputed in the page from Q and K: at most "
            f"{max(done):.1e} from the trace's own A."
        )
    data = {
        "version": 2,
        "title": str(title),
        "notes": notes,
        "kinds": [k._asdict() for k in KINDS.values()],
        "sequences": index,
        "xsets": xsets,
        "learn": None if questions is None else learn_data(questions),
    }
    return data, blocks


def explorer_data(
    obj,
    *,
    names=None,
    title: str = "causalattn explorer",
    layers=None,
    max_bytes: int = MAX_BYTES,
    questions=None,
) -> dict:
    """The JSON-ready data the page draws, every block parsed: ``{"sequences": [{"name", "T",
    "tokens", "pad", "layers": [{"name", "kinds", "heads": [...], ...}]}], ...}``."""
    index, blocks = _build(
        obj, names=names, title=title, layers=layers, max_bytes=max_bytes, questions=questions
    )
    parsed = [json.loads(b) for b in blocks]
    for s in index["sequences"]:
        meta = parsed[s["block"]]
        s.update(tokens=meta["tokens"], pad=meta["pad"], layers=meta["layers"])
        for lay in s["layers"]:
            lay.update(parsed[lay["block"]])
    index["xsets"] = [parsed[k] for k in index["xsets"]]
    return index


def _json_for_script(data) -> str:
    """JSON that cannot end its <script> element or open a comment: < > & as \\uXXXX."""
    text = json.dumps(data, ensure_ascii=True, separators=(",", ":"), allow_nan=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def _asset(name: str) -> str:
    text = resources.files(__package__).joinpath(name).read_text(encoding="utf-8")
    if "</script" in text.lower() or "</style" in text.lower():
        raise RuntimeError(f"explorer asset {name} must not contain a closing script/style tag")
    return text


def explorer_fragment(
    obj,
    *,
    names=None,
    title: str = "causalattn explorer",
    nonce: str | None = None,
    layers=None,
    max_bytes: int = MAX_BYTES,
    questions=None,
) -> str:
    """A ``<div>`` with its own style, data and script: for notebooks and for the page."""
    index, blocks = _build(
        obj, names=names, title=title, layers=layers, max_bytes=max_bytes, questions=questions
    )
    uid = "ca-x-" + secrets.token_hex(6)
    n = f' nonce="{nonce}"' if nonce else ""
    T = max(s["T"] for s in index["sequences"])
    L = max(s["n_layers"] for s in index["sequences"])
    summary = html.escape(
        f"{title}: {len(index['sequences'])} sequence(s), up to {T} tokens"
        + (f", {L} layers" if L > 1 else ""),
        quote=True,
    )
    # The blocks of the first view come before the script, the rest after it: the page
    # draws while the browser is still reading the other layers and sentences.
    paged = [
        f'<script type="application/json" class="ca-block" data-k="{k}">{b}</script>'
        for k, b in enumerate(blocks)
    ]
    first = 1 + index["sequences"][0]["n_layers"] if blocks else 0
    early = set(range(first)) | set(index["xsets"])  # what the first view needs
    return (
        f'<div class="ca-explorer" id="{uid}">'
        f"<style{n}>{_asset('explorer.css')}</style>"
        f'<div class="ca-fallback">{summary} (the explorer needs JavaScript; in Jupyter, trust '
        "the notebook)</div>"
        f'<script type="application/json" class="ca-data">{_json_for_script(index)}</script>'
        + "".join(b for k, b in enumerate(paged) if k in early)
        + f"<script{n}>(function () {{\n{_asset('explorer.js')}\n"
        f'var root = document.getElementById("{uid}");\n'
        'causalattnExplorer(root, JSON.parse(root.querySelector("script.ca-data").textContent));\n'
        "})();</script>" + "".join(b for k, b in enumerate(paged) if k not in early) + "</div>"
    )


def explorer_html(
    obj,
    *,
    names=None,
    title: str = "causalattn explorer",
    layers=None,
    max_bytes: int = MAX_BYTES,
    questions=None,
) -> str:
    """A complete, self-contained HTML page; its CSP forbids every network request."""
    nonce = secrets.token_urlsafe(16)
    csp = (
        f"default-src 'none'; script-src 'nonce-{nonce}'; style-src 'unsafe-inline'; "
        "img-src data:; connect-src 'none'; base-uri 'none'; form-action 'none'"
    )
    body = explorer_fragment(
        obj,
        names=names,
        title=title,
        nonce=nonce,
        layers=layers,
        max_bytes=max_bytes,
        questions=questions,
    )
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f'<meta http-equiv="Content-Security-Policy" content="{csp}">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{html.escape(str(title))}</title></head>\n<body>{body}</body></html>\n"
    )


def write_explorer(
    traces,
    path,
    *,
    names=None,
    title: str = "causalattn explorer",
    layers=None,
    max_bytes: int = MAX_BYTES,
    questions=None,
) -> Path:
    """Write the explorer page for ``traces`` to ``path`` (UTF-8) and return the path.

    ``traces``: a Trace (any batch/head axes), a :class:`causalattn.text.Batch`, or a list
    of Traces: the layers of one model (heads on a leading axis, the same tokens; what
    ``capture()`` returns) or one Trace per sentence (what ``batch_traces`` returns);
    ``layers=True/False`` says which when the guess (shared tokens = layers) would be wrong.
    ``questions``: check questions (``causalattn.learn.questions(...)``) for the page's
    "check yourself" panel. ``max_bytes``: see the module docstring.
    """
    path = Path(path)
    if not path.parent.is_dir():  # as Trace.save: no folder is created behind the caller's back
        raise ValueError(f"explorer: the folder {path.parent} does not exist (create it first)")
    path.write_text(
        explorer_html(
            traces,
            names=names,
            title=title,
            layers=layers,
            max_bytes=max_bytes,
            questions=questions,
        ),
        encoding="utf-8",
    )
    return path
