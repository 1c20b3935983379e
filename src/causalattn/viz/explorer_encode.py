"""The explorer's last step: the page's JSON blocks, as the verify and precision steps decided.

Matrices travel as base64 little-endian numbers; a layer's kinds as runs (:func:`rle`);
sentences traced with one set of weights as rows of one table (:class:`Shared`). Every
block is JSON that cannot end its ``<script>`` element (:func:`json_for_script`).
"""

from __future__ import annotations

import base64
import json

import numpy as np

from .._trace import Trace
from .explorer_precision import DTYPE, V_SHOWN, cast, narrower, v_at
from .explorer_read import Layer, Seq
from .explorer_verify import Scores
from .kinds import PAD, pad_of, tokens_of
from .summary import head_summary, thumbnail

__all__ = ["THUMB", "Shared", "encode_group", "sequence_meta", "json_for_script"]

THUMB = 48


def _b64(a: np.ndarray, dtype: str = "<f4") -> str:
    return base64.b64encode(np.ascontiguousarray(a, dtype=dtype).tobytes()).decode("ascii")


def _finite_or_none(x) -> float | None:
    return float(x) if x is not None and np.isfinite(x) else None


def rle(codes: np.ndarray) -> dict:
    """Run-length form of a T×T uint8 array, row-major: {"codes": b64 u8, "runs": b64 u32}."""
    flat = np.ascontiguousarray(codes, dtype=np.uint8).ravel()
    cut = np.flatnonzero(flat[1:] != flat[:-1]) + 1
    starts = np.concatenate([[0], cut])
    runs = np.diff(np.concatenate([starts, [flat.size]]))
    return {"codes": _b64(flat[starts], "u1"), "runs": _b64(runs, "<u4")}


class Shared:
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


def encode_group(
    layers: list[Layer],
    st: dict,
    al: np.ndarray,
    prec: str,
    mods: dict | None,
    qk: tuple | None,
    scores: Scores,
    not_av: np.ndarray,
    xform: np.ndarray,
    shared: Shared | None,
) -> list[tuple[dict, list[float | None]]]:
    """Each layer's block (scale, modifiers, heads) and the page's error on A per head (None:
    S and A carried as they are). ``st``: the layers' stages stacked ``(n, h, T, ·)``; ``al``
    their readable cells; ``prec`` the page's precision; ``qk`` the travelling
    ``(Qc, pq, Kc, pk)`` (None when the page recomputes nothing); ``scores``, ``not_av`` and
    ``xform`` (Q, K, V = X W from ``shared``) what the verify step found."""
    scale = layers[0].trace.scale
    V = st["V"]
    n, H, T, dv = V.shape
    with np.errstate(invalid="ignore", over="ignore"):
        vnorm = np.linalg.norm(V.astype(np.float64), axis=-1)
    Vc, pv, cut = v_at(V, prec)
    ok, err = scores
    Qc, pq, Kc, pk = qk if qk is not None else (None, None, None, None)
    sendH = not_av & (not cut)  # with part of V, the page computes part of h_i, and says so
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
                "V": _b64(Vc[i, h], DTYPE[pv]),
                "vprec": pv,
                "v_shown": V_SHOWN if cut else int(dv),
            }
            if cut:
                d["vnorm"] = _b64(vnorm[i, h], "<f4")
            if ok[i, h]:
                d.update(
                    form="qk",
                    Q=_b64(Qc[i, h], DTYPE[pq]),
                    K=_b64(Kc[i, h], DTYPE[pk]),
                    qprec=narrower(pq, pk),
                    d_k=int(Qc.shape[-1]),
                )
                errs.append(float(err[i, h]))
            else:  # readable entries only, row-major
                Sc, ps = cast(st["S"][i, h][a], narrower(prec, "f4"))
                Ac, pa = cast(st["A"][i, h][a], narrower(prec, "f4"))
                d.update(
                    form="dense", S=_b64(Sc, DTYPE[ps]), A=_b64(Ac, DTYPE[pa]), sprec=ps, aprec=pa
                )
                errs.append(None)
            if sendH[i, h]:  # H is not A V (a recorded bug): it travels as it is
                Hc, ph = cast(st["H"][i, h], narrower(prec, "f4"))
                d.update(H=_b64(Hc, DTYPE[ph]), hprec=ph)
            heads_out.append(d)
        res.append(({"scale": _finite_or_none(scale), "mods": mods, "heads": heads_out}, errs))
    return res


def sequence_meta(seq: Seq, block_of_layer, rle_cache: dict) -> dict:
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
            rle_cache[kb] = rle(lay.kinds)
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


def json_for_script(data) -> str:
    """JSON that cannot end its <script> element or open a comment: < > & as \\uXXXX."""
    text = json.dumps(data, ensure_ascii=True, separators=(",", ":"), allow_nan=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
