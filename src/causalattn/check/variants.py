"""The catalogue's faulty variants: the reference pipeline with one stage changed."""

from __future__ import annotations

import numpy as np

from .. import masks as _masks
from .probes import _merge, _Probe, _split


def _softmax(Z, axis, stable, dtype):
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        if stable:
            E = np.exp(Z - np.max(Z, axis=axis, keepdims=True))
        else:
            E = np.exp(Z.astype(dtype)).astype(np.float64)  # overflows where the dtype does
        return E / E.sum(axis=axis, keepdims=True)


def _padding(p: _Probe, T: int):
    """(key may-read (B, T), query is-real (B, T) or None) for the probe's padding."""
    if p.pad_kind is None:
        return None, None
    if p.pad_kind == "lengths":
        kp = _masks.key_padding(p.pad, T)
        return kp, _masks.query_padding(p.pad, T)
    return p.pad.astype(bool), None


def _attend(p: _Probe, knobs: dict) -> np.ndarray:
    """The reference pipeline with some stages changed (see CATALOGUE); float64 out."""
    kn = {"kt": "ok", "scale": "ok", "mask": "ok", "pad": "ok", "fill": "ok", "softmax": "ok",
          "stable": "ok", "empty": "ok", "out": "ok", **knobs}
    f = {k: v.astype(np.float64) for k, v in p.inputs.items()}
    if p.sig == "qkv":
        Q, K, V = f["q"], f["k"], f["v"]
    else:
        X = f["x"]
        Q, K, V = (_split(X @ f[w], p.heads) for w in ("w_q", "w_k", "w_v"))
    d_k = Q.shape[-1]
    G = Q @ (K if kn["kt"] == "no" else np.swapaxes(K, -1, -2))  # ValueError when shapes refuse
    S = G * {"ok": 1 / np.sqrt(d_k), "none": 1.0, "dk": 1.0 / d_k}[kn["scale"]]
    T = S.shape[-1]
    causal = _masks.causal(T)
    causal = {"ok": causal, "diag": np.tril(causal, -1), "none": np.ones_like(causal),
              "anti": causal.T}[kn["mask"]]
    kp, qp = _padding(p, T)
    parts = [causal]
    if kp is not None:
        if kn["pad"] == "ok":
            parts.append(kp[:, None, :])
            if qp is not None:
                parts.append(qp[:, :, None])
        elif kn["pad"] == "queries":
            parts.append(kp[:, :, None])
    allowed = np.broadcast_to(_masks.combine(*parts), S.shape)
    stable = kn["stable"] == "ok"
    if kn["softmax"] == "after":
        A = _softmax(S, -1, stable, p.dtype) * allowed
    else:
        if kn["fill"] == "min-twice":  # each mask its own finite minimum, summed in the dtype
            mn = np.finfo(p.dtype).min
            Zd = S.astype(p.dtype)
            with np.errstate(over="ignore", invalid="ignore"):
                for m in parts:
                    Zd = Zd + np.where(m, 0, mn).astype(p.dtype)
            Z = Zd.astype(np.float64)
        else:
            Z = np.where(allowed, S, -np.inf)
        axis = {"ok": -1, "query": -2, "all": (-2, -1)}[kn["softmax"]]
        A = _softmax(Z, axis, stable, p.dtype)
        if kn["softmax"] == "ok" and kn["empty"] == "ok" and kn["fill"] == "ok":
            A = np.where(allowed.any(-1, keepdims=True), A, 0.0)  # empty rows: zero, not NaN
    H = A @ V
    if p.sig == "qkv":
        return H
    H = _merge(H, p.heads)
    W_o = f.get("w_o")
    if W_o is None or kn["out"] == "missing":
        return H
    return H @ (W_o.T if kn["out"] == "transposed" else W_o)


def _real_rows(p: _Probe, out_shape) -> np.ndarray:
    """Rows (..., T) that can read a key under the reference mask."""
    T = out_shape[-2]
    kp, qp = _padding(p, T)
    if kp is None:
        return np.ones(out_shape[:-1], bool)
    real = _masks.combine(_masks.causal(T), kp[:, None, :]).any(-1)
    if qp is not None:
        real &= qp
    return np.broadcast_to(real, out_shape[:-1])


def _rtol(dtype) -> float:
    return {np.dtype(np.float16): 3e-2, np.dtype(np.float32): 2e-3}.get(np.dtype(dtype), 1e-6)


def _distance(user, cand, rows, rtol) -> tuple[float, int]:
    """(how far off, 0 when equal within tolerance; inf: shape or NaN) and how many entries
    matched only because the variant is NaN there (a NaN in the variant is left open: code
    may guard it, e.g. nan_to_num; a NaN only in the user's output is a mismatch)."""
    if isinstance(user, BaseException) or isinstance(cand, BaseException):
        both = isinstance(user, BaseException) and isinstance(cand, BaseException)
        return (0.0 if both else np.inf), 0
    if user.shape != cand.shape:
        if user.size == cand.size and [s for s in user.shape if s != 1] == [
                s for s in cand.shape if s != 1]:
            user = user.reshape(cand.shape)
        else:
            return np.inf, 0
    rows = np.broadcast_to(rows[..., None], cand.shape)
    r = rows & ~np.isnan(cand)
    wild = int((rows & np.isnan(cand) & ~np.isnan(user)).sum())
    if np.isnan(user)[r].any() or (np.isinf(user) != np.isinf(cand))[r].any():
        return np.inf, wild
    with np.errstate(invalid="ignore"):
        d = np.abs(np.where(r & np.isfinite(cand) & np.isfinite(user), user - cand, 0.0))
    mag = max(1.0, float(np.abs(np.where(r & np.isfinite(cand), cand, 0)).max()))
    e = float(d.max()) / mag if d.size else 0.0
    return (0.0 if e <= rtol else e), wild

