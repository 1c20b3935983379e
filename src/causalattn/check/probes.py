"""Probe inputs for diagnose."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class _Probe:
    name: str
    sig: str
    inputs: dict  # numpy arrays in our layout
    dtype: np.dtype
    heads: int | None = None
    pad_kind: str | None = None  # "lengths" | "key_padding_mask"
    pad: np.ndarray | None = None  # lengths (B,) or key_padding_mask (B, T)
    optional: bool = False  # the user's fn may refuse it (padding, fp16): then it is dropped


def _split(Y, h):
    if h is None:
        return Y
    T, hd = Y.shape[-2:]
    return np.moveaxis(Y.reshape(*Y.shape[:-2], T, h, hd // h), -2, -3)


def _merge(Y, h):
    if h is None:
        return Y
    return np.moveaxis(Y, -3, -2).reshape(*Y.shape[:-3], Y.shape[-2], -1)


def _rand(rng, shape, scale=1.0):
    return rng.normal(size=shape) * scale


def _probes(sig: str, dims: dict, pad_kind: str | None, dtype) -> list[_Probe]:
    """Inputs that separate the catalogue: T = d_k, T ≠ d_k, large scores, padding, fp16."""
    rng = np.random.default_rng(1234)
    out = []

    def make(name, T, d_k, d_v, scale=1.0, B=None, pad=None, dt=dtype, optional=False):
        lead = () if B is None else (B,)
        if sig == "qkv":
            inputs = {"q": _rand(rng, lead + (T, d_k), scale), "k": _rand(rng, lead + (T, d_k), scale),
                      "v": _rand(rng, lead + (T, d_v))}
            heads = None
        else:
            dm, h = dims["d_model"], dims.get("heads")
            hk, hv = dims["hd_k"], dims["hd_v"]
            inputs = {"x": _rand(rng, lead + (T, dm)),
                      "w_q": _rand(rng, (dm, hk), scale / np.sqrt(dm)),
                      "w_k": _rand(rng, (dm, hk), scale / np.sqrt(dm)),
                      "w_v": _rand(rng, (dm, hv), 1 / np.sqrt(dm))}
            if dims.get("w_o"):
                inputs["w_o"] = _rand(rng, (hv, dims["d_out"]), 1 / np.sqrt(hv))
            heads = h
        inputs = {k: v.astype(dt) for k, v in inputs.items()}
        out.append(_Probe(name, sig, inputs, np.dtype(dt), heads, pad_kind if pad is not None
                          else None, pad, optional))

    if sig == "qkv":
        make("T=d_k", 4, 4, 3, 1.3)
        make("T≠d_k", 6, 3, 5, 1.5)
        make("large scores", 5, 2, 3, 40.0)
    else:
        dk = dims["d_k"]
        if dk <= 16:
            make("T=d_k", dk, dk, None, 1.3)
        make("T≠d_k", dk + 2 if dk < 6 else 5, dk, None, 1.5)
        make("large scores", 5, dk, None, 40.0 / max(1.0, dk ** 0.25))
    if pad_kind is None and sig != "module":  # a module keeps its own weights' dtype
        if sig == "qkv":
            make("fp16", 6, 3, 5, 1.5, dt=np.float16, optional=True)
        else:
            make("fp16", dims["d_k"] + 2, dims["d_k"], None, 1.5, dt=np.float16, optional=True)
    if pad_kind == "lengths":
        make("padding", 6, 3, 4, 1.3, B=2, pad=np.array([6, 3]), optional=True)
        make("padding fp16", 6, 3, 4, 1.3, B=2, pad=np.array([5, 2]), dt=np.float16, optional=True)
    elif pad_kind == "key_padding_mask":
        kpm = np.array([[True] * 6, [False, False] + [True] * 4])  # left padding
        make("padding", 6, 3, 4, 1.3, B=2, pad=kpm, optional=True)
        make("padding fp16", 6, 3, 4, 1.3, B=2, pad=kpm[::-1].copy(), dt=np.float16, optional=True)
    return out

