"""Name the bug in someone else's attention: probes, a catalogue of faulty variants, op recording.

``diagnose(fn)`` runs ``fn`` on probe inputs built to separate faults (distinct scales,
T ≠ d_k and T = d_k, large scores, padding, fp16) and compares its outputs with the
reference and with every faulty variant in :data:`CATALOGUE` — each variant is the
reference pipeline (:mod:`causalattn.masks`, :func:`causalattn.reference.softmax_last`)
with one stage changed. The answer names the matching fault (or ``None``: "no known
fault: matches the reference") and its stage; when no single fault fits, pairs are
tried and the earliest fault in dependency order is named. A white-box pass records the
operations — a ``TorchFunctionMode`` for torch, an ndarray subclass for NumPy: the
softmax and its axis, the mask op and whether it comes before or after the softmax, the
scale — and points at the user's ``file:line``. When nothing in the catalogue fits, the
softmax weights it recorded (or that the function returned as ``(out, weights)``) go
through :func:`causalattn.audit`, which names the first stage that diverges.

Calling conventions (``signature=``): ``"qkv"`` — ``fn(q, k, v)`` with q, k: ``T×d_k``,
v: ``T×d_v`` (optionally a ``key_padding_mask=`` (B, T) keyword, True = may read, or
``lengths=`` (B,)); ``"x-weights"`` — ``fn(x, w_q, w_k, w_v[, w_o])`` in the seeds'
``X W`` layout, one head; ``"module"`` — an ``nn.Module`` whose ``forward(x)`` takes ``(1, T, d_model)``:
its projection weights are found by name and replaced (on a copy) by probe weights.

``diagnose("path/file.py:name")`` EXECUTES that file, in a subprocess with a timeout, so
a hang or a crash in it is reported, not inherited; ``name`` may be a function, a module
instance, an nn.Module class constructible without arguments, or a function without
arguments that returns one of those. ``diagnose(callable)`` runs in-process.
"""

from __future__ import annotations

import copy
import inspect
import itertools
import json
import os
import subprocess
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from . import masks as _masks

__all__ = ["diagnose", "Diagnosis", "Fault", "CATALOGUE", "SIGNATURES"]

SIGNATURES = ("qkv", "x-weights", "module")
_MARK = "@@causalattn-diagnosis@@"


@dataclass(frozen=True)
class Fault:
    """One catalogued fault: the reference with ``knob`` set to ``value``."""

    id: str
    stage: str
    description: str
    knob: str
    value: str

    def variant(self, probe: _Probe):
        """The faulty variant's output on ``probe`` (the reference with this one change)."""
        return _attend(probe, {self.knob: self.value})


# In dependency order: the earliest stage first (two faults at once -> the first listed).
CATALOGUE: tuple[Fault, ...] = (
    Fault("k-not-transposed", "S", "S = Q K instead of Q Kᵀ (only runs when T = d_k)", "kt", "no"),
    Fault("missing-scale", "S", "S = Q Kᵀ without the 1/√d_k factor", "scale", "none"),
    Fault("scale-by-dk", "S", "S = Q Kᵀ / d_k instead of / √d_k", "scale", "dk"),
    Fault("diagonal-blocked", "M", "mask blocks j = i (j < i allowed): a token cannot read itself",
          "mask", "diag"),
    Fault("no-mask", "M", "no causal mask: queries read future keys", "mask", "none"),
    Fault("anti-causal-mask", "M", "mask transposed: queries read j >= i", "mask", "anti"),
    Fault("padding-ignored", "M", "the padding mask is not applied", "pad", "ignored"),
    Fault("padding-queries-only", "M", "padding blocks query rows, not key columns", "pad",
          "queries"),
    Fault("finite-min-added-twice", "M", "causal and padding masks added as finite minimums: "
          "they overflow to -inf and rows with no readable key weight forbidden keys",
          "fill", "min-twice"),
    Fault("softmax-query-axis", "A", "softmax over the query axis (columns sum to 1)", "softmax",
          "query"),
    Fault("softmax-all-entries", "A", "softmax over all T×T entries at once", "softmax", "all"),
    Fault("mask-after-softmax", "A", "mask applied after the softmax without renormalizing",
          "softmax", "after"),
    Fault("unstable-softmax", "A", "no max subtraction: exp overflows at large scores (NaN)",
          "stable", "no"),
    Fault("nan-on-empty-rows", "A", "-inf on every entry of a row with no readable key gives NaN",
          "empty", "nan"),
    Fault("output-projection-missing", "O", "O = H: W_O is never applied", "out", "missing"),
    Fault("output-projection-transposed", "O", "O = H W_Oᵀ instead of H W_O", "out", "transposed"),
)
_BY_ID = {f.id: f for f in CATALOGUE}
# faults whose signature lives on rows with no readable key: compare every row for them
_EMPTY_ROW_FAULTS = {"padding-ignored", "padding-queries-only", "finite-min-added-twice",
                     "nan-on-empty-rows"}


@dataclass
class Diagnosis:
    """``fault``: a catalogue id, or None (matches the reference, or nothing fits: see
    ``status``); ``stage``: the first stage that diverges; ``location``: ``file:line`` of
    the user's code (torch white-box pass) when found."""

    fault: str | None
    stage: str | None
    message: str
    location: str | None = None
    status: str = "fault"  # clean | fault | unknown | error | timeout | crashed
    also: list[str] = field(default_factory=list)  # a second fault, or faults that look the same
    untested: list[str] = field(default_factory=list)  # faults these probes cannot tell apart
    details: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == "clean"

    def to_dict(self) -> dict:
        return {"fault": self.fault, "stage": self.stage, "message": self.message,
                "location": self.location, "status": self.status, "also": self.also,
                "untested": self.untested, "details": self.details}

    @classmethod
    def from_dict(cls, d: dict) -> Diagnosis:
        return cls(**{k: d[k] for k in ("fault", "stage", "message", "location", "status",
                                        "also", "untested", "details") if k in d})

    def __str__(self) -> str:
        head = {"clean": "clean", "fault": f"fault {self.fault} (stage {self.stage})",
                "unknown": f"unknown fault (first diverging stage {self.stage})"}.get(
            self.status, self.status)
        lines = [f"diagnose: {head}", f"  {self.message}"]
        if self.location:
            lines.append(f"  at {self.location}")
            if self.details.get("code"):
                lines.append(f"     {self.details['code']}")
        if self.also:
            lines.append(f"  also: {', '.join(self.also)}")
        if self.untested:
            lines.append(f"  not testable with this signature: {', '.join(self.untested)}")
        for k, v in self.details.get("whitebox", {}).items():
            lines.append(f"  white-box: {k} = {v}")
        return "\n".join(lines)


# -- probes and the parametrized reference --------------------------------------------
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


# -- probes --------------------------------------------------------------------------------
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


# -- calling the user's code ------------------------------------------------------------
def _framework(fn) -> str:
    try:
        import torch

        if isinstance(fn, torch.nn.Module):
            return "torch"
    except ImportError:
        return "numpy"
    target = fn if hasattr(fn, "__code__") else type(fn).__call__  # a callable object
    code = getattr(target, "__code__", None)
    if code is not None:
        g = getattr(target, "__globals__", {})
        for n in code.co_names:
            mod = getattr(g.get(n), "__name__", "") or ""
            if n in ("torch", "F") or mod.startswith("torch"):
                return "torch"
    return "numpy"


def _pad_kind(fn) -> str | None:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return None
    for k in ("key_padding_mask", "lengths"):
        if k in params:
            return k
    return None


def _discover_signature(fn) -> str:
    try:
        import torch

        if isinstance(fn, torch.nn.Module):
            return "module"
    except ImportError:
        pass
    try:
        params = [p for p in inspect.signature(fn).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty]
    except (TypeError, ValueError):
        raise ValueError("diagnose: cannot read the function's signature; pass signature=") from None
    if len(params) == 3:
        return "qkv"
    if len(params) in (4, 5):
        return "x-weights"
    raise ValueError(
        f"diagnose: {len(params)} required arguments ({', '.join(p.name for p in params)}); "
        "expected fn(q, k, v), fn(x, w_q, w_k, w_v[, w_o]) or an nn.Module; pass signature=")


_PROJ_NAMES = {
    "q": ("q", "q_proj", "query", "w_q", "wq", "to_q", "q_lin"),
    "k": ("k", "k_proj", "key", "w_k", "wk", "to_k", "k_lin"),
    "v": ("v", "v_proj", "value", "w_v", "wv", "to_v", "v_lin"),
    "o": ("o", "o_proj", "out", "out_proj", "proj", "c_proj", "w_o", "wo", "to_out", "out_lin"),
    "qkv": ("qkv", "c_attn", "in_proj", "to_qkv", "wqkv"),
}
_HEAD_ATTRS = ("n_heads", "n_head", "num_heads", "heads", "h", "nhead")


class _ModuleAdapter:
    """Find an nn.Module's W_Q/W_K/W_V/W_O, and run it with probe weights on a copy."""

    def __init__(self, module):
        import torch

        self.torch = torch
        self.module = module
        found = {}
        for name, sub in module.named_children():
            low = name.lower()
            for role, names in _PROJ_NAMES.items():
                if low in names and isinstance(sub, torch.nn.Linear):
                    found[role] = ("linear", name)
        for name, par in module.named_parameters(recurse=False):
            low = name.lower()
            for role, names in _PROJ_NAMES.items():
                if low in names and par.ndim == 2:
                    found[role] = ("param", name)
        if "qkv" in found:
            found.pop("q", None), found.pop("k", None), found.pop("v", None)
        elif not {"q", "k", "v"} <= set(found):
            raise ValueError("diagnose: cannot find the module's query/key/value projections "
                             "(looked for Linear children or parameters named q/k/v, q_proj, "
                             "W_q, c_attn, qkv ...); wrap it as fn(x, w_q, w_k, w_v, w_o)")
        self.found = found
        h = next((getattr(module, a) for a in _HEAD_ATTRS if isinstance(getattr(module, a, None), int)),
                 None)
        self.heads = h if h and h > 1 else None
        shapes = {r: self._ours(r).shape for r in found}
        if "qkv" in found:
            dm, three = shapes["qkv"]
            hk = hv = three // 3
        else:
            dm, hk = shapes["q"]
            hv = shapes["v"][1]
        self.dims = {"d_model": dm, "hd_k": hk, "hd_v": hv, "heads": self.heads,
                     "d_k": hk // (self.heads or 1), "w_o": "o" in found,
                     "d_out": shapes["o"][1] if "o" in found else None}

    def _get(self, mod, role):
        kind, name = self.found[role]
        return getattr(mod, name).weight if kind == "linear" else getattr(mod, name)

    def _ours(self, role, mod=None):
        """The weight in the seeds' layout (d_in×d_out: X W)."""
        w = self._get(mod or self.module, role).detach()
        return (w.T if self.found[role][0] == "linear" else w).cpu().numpy()

    def instance(self, p: _Probe):
        torch = self.torch
        mod = copy.deepcopy(self.module).eval()
        with torch.no_grad():
            for role, key in (("q", "w_q"), ("k", "w_k"), ("v", "w_v"), ("o", "w_o")):
                if role == "o" and "o" not in self.found:
                    continue
                if role in "qkv" and "qkv" in self.found:
                    continue
                self._set(mod, role, p.inputs[key])
            if "qkv" in self.found:
                self._set(mod, "qkv", np.concatenate([p.inputs[k] for k in ("w_q", "w_k", "w_v")], 1))
            for sub in mod.modules():  # biases would move every stage: zero them
                if isinstance(sub, torch.nn.Linear) and sub.bias is not None:
                    sub.bias.zero_()
        return mod

    def _set(self, mod, role, ours):
        torch = self.torch
        par = self._get(mod, role)
        val = torch.as_tensor(ours.T if self.found[role][0] == "linear" else ours)
        par.copy_(val.to(par.dtype))


def _as_array(out, dtype=np.float64):
    if type(out).__module__.startswith("torch"):
        out = out.detach().cpu().double().numpy()
    return np.asarray(out, dtype=dtype)


def _to_numpy(out):
    """The output H (or O); a tuple's first element (``(out, weights)`` is common)."""
    return _as_array(out[0] if isinstance(out, (tuple, list)) and out else out)


def _returned_weights(out):
    """A ``(..., T, T)`` second element of a returned tuple: the weights A, or None."""
    if isinstance(out, (tuple, list)) and len(out) > 1:
        try:
            w = _as_array(out[1])
        except (TypeError, ValueError):
            return None
        if w.ndim >= 2 and w.shape[-1] == w.shape[-2]:
            return w
    return None


class _Caller:
    """Calls the user's code on a probe, in its framework, with its input layout."""

    def __init__(self, fn, sig, framework, adapter=None):
        self.fn, self.sig, self.framework, self.adapter = fn, sig, framework, adapter
        self.lead = 0  # extra leading unit axes the function needs
        self.weights = None  # A, when the function returns (out, weights)
        self.wrap = None  # NumPy op recording: a view of each input array

    def _conv(self, a):
        if self.framework == "torch":
            import torch

            return torch.from_numpy(np.ascontiguousarray(a))
        return a if self.wrap is None else self.wrap(a)

    def __call__(self, p: _Probe, lead: int | None = None):
        lead = self.lead if lead is None else lead
        if self.sig == "module":
            mod = self.adapter.instance(p)
            x = p.inputs["x"]
            x = x[None] if x.ndim == 2 else x
            import torch

            with torch.no_grad():
                out = mod(self._conv(x.astype(np.float32)).to(next(mod.parameters()).dtype))
            return _to_numpy(out)
        batched = p.pad_kind is not None
        names = ("q", "k", "v") if self.sig == "qkv" else ("x", "w_q", "w_k", "w_v", "w_o")
        args = []
        for n in names:
            if n not in p.inputs:
                continue
            a = p.inputs[n].copy()  # the user's code may write into its inputs
            if n in ("q", "k", "v", "x"):  # (B, T, d) -> (B, 1, T, d) for (B, H, T, d) code
                a = (a.reshape(a.shape[:1] + (1,) * (lead - 1) + a.shape[1:]) if batched
                     else a.reshape((1,) * lead + a.shape))
            args.append(self._conv(a))
        kwargs = {}
        if p.pad_kind is not None:
            kwargs[p.pad_kind] = self._conv(p.pad.copy())
        out = self.fn(*args, **kwargs)
        self.weights = _returned_weights(out)
        return _to_numpy(out)


# -- white-box pass (torch) --------------------------------------------------------------
_SCORED = {"softmax", "log_softmax", "exp", "matmul", "__matmul__", "bmm", "einsum", "linear",
           "masked_fill", "masked_fill_", "where", "add", "__add__", "__iadd__", "__radd__", "add_",
           "div", "__truediv__", "__itruediv__", "div_", "mul", "__mul__", "__rmul__", "mul_",
           "transpose", "permute", "t", "scaled_dot_product_attention", "baddbmm", "sum"}


def _record(call, probe):
    """Run ``call(probe)`` under a TorchFunctionMode; a list of op events in call order."""
    import torch
    from torch.overrides import TorchFunctionMode

    torch_dir = os.path.dirname(torch.__file__)
    here = os.path.abspath(__file__)
    events: list[dict] = []

    def where():
        for fr in reversed(traceback.extract_stack()[:-2]):  # less where() and the handler
            f = os.path.abspath(fr.filename)
            if f.startswith(torch_dir) or f == here or "contextlib" in f or f.startswith("<"):
                continue
            return f"{fr.filename}:{fr.lineno}", (fr.line or "").strip()
        return None, ""

    def neg_fill(x):
        if isinstance(x, (int, float)):
            return x <= -1e4
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.numel():
            return bool((x <= -1e4).any())
        return False

    class Rec(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            name = getattr(func, "__name__", "")
            if name == "__get__":
                name = getattr(getattr(func, "__self__", None), "__name__", "")
                if name in ("T", "mT"):
                    name = "transpose"
            if name not in _SCORED:
                return out
            ev = {"op": name}
            if name in ("softmax", "log_softmax"):
                dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
                nd = args[0].ndim
                ev["dim"] = dim
                ev["last"] = dim is not None and dim % nd == nd - 1
                if not any("weights" in e for e in events) and isinstance(out, torch.Tensor):
                    t = out.detach().cpu()
                    ev["weights"] = (t.float() if t.dtype == torch.bfloat16 else t).numpy().copy()
            elif name == "sum":
                ev["axis"] = kwargs.get("dim", args[1] if len(args) > 1 else None)
                ev["ndim"] = args[0].ndim if isinstance(args[0], torch.Tensor) else None
            elif name in ("masked_fill", "masked_fill_"):
                ev["kind"] = "mask"
                ev["value"] = float(args[2] if len(args) > 2 else kwargs.get("value", 0))
            elif name == "where":
                if any(neg_fill(a) for a in args[1:]):
                    ev["kind"] = "mask"
                elif len(args) > 2 and any(isinstance(a, (int, float)) and a == 0 for a in args[1:]):
                    ev["kind"] = "guard"  # where(cond, A, 0): often a guard for empty rows
            elif name in ("add", "__add__", "__iadd__", "__radd__", "add_"):
                if any(neg_fill(a) for a in args):
                    ev["kind"] = "mask"
            elif name in ("div", "__truediv__", "__itruediv__", "div_", "mul", "__mul__",
                          "__rmul__", "mul_"):
                sc = [a for a in args[1:] if isinstance(a, (int, float))]
                if sc:
                    ev["scalar"] = float(sc[0])
                    ev["kind"] = "scale"
                elif any(isinstance(a, torch.Tensor) and a.dtype == torch.bool for a in args):
                    ev["kind"] = "zero"  # A * mask
            if isinstance(out, torch.Tensor):
                ev["shape"] = tuple(out.shape)
            ev["at"], ev["code"] = where()
            events.append(ev)
            return out

    with Rec():
        call(probe)
    return events


def _record_numpy(caller, probe):
    """Run the NumPy ``caller(probe)`` with inputs viewed as a recording ndarray subclass
    (``__array_ufunc__`` / ``__array_function__``); op events in call order, as _record."""
    np_dir = os.path.dirname(np.__file__)
    here = os.path.abspath(__file__)
    events: list[dict] = []

    def where():
        for fr in reversed(traceback.extract_stack()[:-2]):  # less where() and the hook
            f = os.path.abspath(fr.filename)
            if f.startswith(np_dir) or f == here or f.startswith("<"):
                continue
            return f"{fr.filename}:{fr.lineno}", (fr.line or "").strip()
        return None, ""

    def plain(x):
        if isinstance(x, Rec):
            return x.view(np.ndarray)
        if isinstance(x, (tuple, list)):
            return type(x)(plain(v) for v in x)
        if isinstance(x, dict):
            return {k: plain(v) for k, v in x.items()}
        return x

    def wrap(x):
        if isinstance(x, np.ndarray) and not isinstance(x, Rec):
            return x.view(Rec)
        if isinstance(x, tuple):
            return tuple(wrap(v) for v in x)
        return x

    def scalar(a):
        return np.ndim(a) == 0 and isinstance(a, (int, float, np.number, np.ndarray))

    def neg_fill(a):
        a = np.asarray(a)
        return a.dtype.kind == "f" and a.size > 0 and bool((a <= -1e4).any())

    class Rec(np.ndarray):
        def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
            inputs, kwargs = plain(inputs), plain(kwargs)
            out = getattr(ufunc, method)(*inputs, **kwargs)
            name, ev = ufunc.__name__, None
            if method == "__call__":
                if name == "exp":
                    ev = {"op": "exp"}
                elif name == "matmul":
                    ev = {"op": "matmul", "shape": np.shape(out)}
                elif name in ("add", "subtract") and any(neg_fill(a) for a in inputs):
                    ev = {"op": "add", "kind": "mask"}
                elif name in ("divide", "true_divide", "multiply"):
                    op = "mul" if name == "multiply" else "div"
                    sc = [a for a in (inputs if op == "mul" else inputs[1:]) if scalar(a)]
                    if sc:
                        ev = {"op": op, "kind": "scale", "scalar": float(sc[0])}
                    elif any(np.asarray(a).dtype == bool for a in inputs):
                        ev = {"op": op, "kind": "zero"}
            elif method == "reduce" and name == "add":
                ev = {"op": "sum", "axis": kwargs.get("axis"), "ndim": np.ndim(inputs[0])}
            if ev is not None:
                ev["at"], ev["code"] = where()
                events.append(ev)
            return wrap(out)

        def __array_function__(self, func, types, args, kwargs):
            args, kwargs = plain(args), plain(kwargs)
            out = func(*args, **kwargs)
            if func.__name__ == "where" and len(args) == 3:
                kind = ("mask" if any(neg_fill(a) for a in args[1:]) else
                        "guard" if any(scalar(a) and a == 0 for a in args[1:]) else None)
                if kind:
                    ev = {"op": "where", "kind": kind}
                    ev["at"], ev["code"] = where()
                    events.append(ev)
            return wrap(out)

    caller.wrap = lambda a: a.view(Rec)
    try:
        with np.errstate(all="ignore"):
            caller(probe)
    finally:
        caller.wrap = None
    return events


def _whitebox(events: list[dict], fault: str | None) -> tuple[str | None, str, dict]:
    """(location, code, facts) for the fault from the recorded ops."""
    sm = [i for i, e in enumerate(events) if e["op"] in ("softmax", "log_softmax")]
    exp = [i for i, e in enumerate(events) if e["op"] == "exp"]
    maskops = [i for i, e in enumerate(events) if e.get("kind") == "mask"]
    zeroing = [i for i, e in enumerate(events) if e.get("kind") == "zero"]
    scores = [i for i, e in enumerate(events)
              if e["op"] in ("matmul", "__matmul__", "bmm", "einsum", "baddbmm")
              and len(e.get("shape", ())) >= 2 and e["shape"][-1] == e["shape"][-2]]
    sdpa = [i for i, e in enumerate(events) if e["op"] == "scaled_dot_product_attention"]
    norm_at = sm[0] if sm else (exp[0] if exp else (sdpa[0] if sdpa else None))
    facts: dict = {}
    if sm:
        facts["softmax dim"] = events[sm[0]]["dim"]
        facts["softmax over the key axis"] = events[sm[0]]["last"]
    elif exp:
        facts["softmax"] = "written by hand (exp)"
        norm = [e for e in events[exp[0]:] if e["op"] == "sum"]
        if norm:
            ax, nd = norm[0].get("axis"), norm[0].get("ndim")
            facts["normalized over axis"] = ax
            if isinstance(ax, int) and nd:
                facts["softmax over the key axis"] = ax % nd == nd - 1
    elif sdpa:
        facts["softmax"] = "inside scaled_dot_product_attention"
    if norm_at is not None and not (sdpa and norm_at == sdpa[0]):
        before = [i for i in maskops if i < norm_at]
        after = [i for i in maskops + zeroing if i > norm_at]
        facts["mask before softmax"] = bool(before)
        if after:
            facts["mask after softmax"] = True
    scales = [e["scalar"] for i, e in enumerate(events) if e.get("kind") == "scale"
              and (norm_at is None or i < norm_at)]
    if scales:
        facts["scale op"] = scales[0]

    def at(i):
        return (events[i]["at"], events[i]["code"]) if i is not None and 0 <= i < len(events) else (None, "")

    pick = None
    stage = _BY_ID[fault].stage if fault in _BY_ID else None
    if fault in ("softmax-query-axis", "softmax-all-entries"):
        norm = [i for i in range(norm_at or 0, len(events)) if events[i]["op"] == "sum"]
        pick = norm[0] if not sm and norm else norm_at  # a hand-written softmax: its sum
    elif fault == "unstable-softmax":
        pick = norm_at
    elif fault == "mask-after-softmax":
        guards = [i for i, e in enumerate(events) if e.get("kind") == "guard"]
        after = sorted(i for i in maskops + zeroing + guards if norm_at is not None and i > norm_at)
        pick = after[0] if after else norm_at
    elif fault == "no-mask":
        pick = norm_at  # no causal mask reaches this softmax
    elif fault == "nan-on-empty-rows":
        pick = norm_at  # the softmax that divides 0 by 0 on a row of -inf
    elif stage == "M":
        before = [i for i in maskops if norm_at is None or i < norm_at]
        # the second finite minimum is where the overflow happens: point at the last mask op
        pick = (before[-1] if fault == "finite-min-added-twice" else before[0]) if before else norm_at
    elif fault in ("missing-scale", "scale-by-dk", "k-not-transposed"):
        sc = [i for i, e in enumerate(events) if e.get("kind") == "scale"
              and (norm_at is None or i < norm_at)]
        pick = sc[0] if sc and fault == "scale-by-dk" else (scores[0] if scores else norm_at)
    elif stage == "O":
        mm = [i for i, e in enumerate(events) if e["op"] in ("matmul", "__matmul__", "linear")]
        pick = mm[-1] if mm and (norm_at is None or mm[-1] > norm_at) else None
        if pick is None and events:
            pick = len(events) - 1
    loc, code = at(pick)
    return loc, code, facts


# -- the diagnosis ---------------------------------------------------------------------
def _candidates(fault_ids):
    yield (), {}
    for f in fault_ids:
        yield (f,), {_BY_ID[f].knob: _BY_ID[f].value}


def _pairs(fault_ids):
    for a, b in itertools.combinations(fault_ids, 2):
        fa, fb = _BY_ID[a], _BY_ID[b]
        if fa.knob != fb.knob:
            yield (a, b), {fa.knob: fa.value, fb.knob: fb.value}


def _safe(fn, *a):
    try:
        with np.errstate(all="ignore"):
            return fn(*a)
    except Exception as exc:  # the variant (or the user's fn) refuses these shapes
        return exc


def diagnose(fn, *, signature: str | None = None, timeout: float = 60.0) -> Diagnosis:
    """Name the fault in ``fn``'s attention (see the module docstring).

    ``fn``: a callable, an ``nn.Module``, or ``"path/file.py:name"`` (a function, a
    module instance or an nn.Module class constructible without arguments) — the path
    form runs in a subprocess killed after ``timeout`` seconds. ``signature``: one of
    ``"qkv"``, ``"x-weights"``, ``"module"``; discovered when None.
    """
    if signature is not None and signature not in SIGNATURES:
        raise ValueError(f"diagnose: signature must be one of {SIGNATURES}, got {signature!r}")
    if isinstance(fn, (str, Path)):
        return _diagnose_path(str(fn), signature, timeout)
    if not callable(fn):
        raise ValueError(f"diagnose: expected a callable, an nn.Module or 'file.py:name', got "
                         f"{type(fn).__name__}")
    return _diagnose_callable(fn, signature)


def _diagnose_callable(fn, signature) -> Diagnosis:
    sig = signature or _discover_signature(fn)
    framework = _framework(fn)
    adapter = None
    if sig == "module":
        adapter = _ModuleAdapter(fn)
        dims = adapter.dims
        pad_kind = None
    else:
        pad_kind = _pad_kind(fn)
        dims = {}
        if sig == "x-weights":
            n = len([p for p in inspect.signature(fn).parameters.values()
                     if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY,
                                                            p.POSITIONAL_OR_KEYWORD)])
            dims = {"d_model": 4, "hd_k": 4, "hd_v": 4, "d_k": 4, "heads": None,
                    "w_o": n >= 5, "d_out": 4}
    dtype = np.float32 if framework == "torch" else np.float64
    probes = _probes(sig, dims, pad_kind, dtype)
    caller = _Caller(fn, sig, framework, adapter)

    # the input layout: 2-D first, then with unit batch/head axes
    base = probes[0]
    first = None
    for lead in ((0, 1, 2) if sig != "module" else (0,)):
        first = _safe(caller, base, lead)
        if not isinstance(first, BaseException):
            caller.lead = lead
            break
    details = {"signature": sig, "framework": framework, "padding": pad_kind}
    if isinstance(first, BaseException):
        return Diagnosis(None, None, f"the function raised on the first probe ({base.name}): "
                         f"{type(first).__name__}: {first}", status="error", details=details)

    user = {p.name: (first if p is base else _safe(caller, p)) for p in probes}
    dropped = [p.name for p in probes if p.optional and isinstance(user[p.name], BaseException)]
    probes = [p for p in probes if p.name not in dropped]
    if dropped:
        details["dropped probes"] = dropped
    testable = [f.id for f in CATALOGUE if not (f.stage == "O" and not dims.get("w_o"))
                and not (f.knob in ("pad",) and pad_kind is None)]

    cache: dict = {}

    def outputs(knobs):
        key = tuple(sorted(knobs.items()))
        if key not in cache:
            cache[key] = {p.name: _safe(_attend, p, knobs) for p in probes}
        return cache[key]

    def distance(ids, knobs):
        outs = outputs(knobs)
        every_row = not ids or any(i in _EMPTY_ROW_FAULTS for i in ids)
        worst, wild, total = 0.0, 0, 0
        for p in probes:
            c = outs[p.name]
            rows = None
            if not isinstance(c, BaseException):
                rows = np.ones(c.shape[:-1], bool) if every_row else _real_rows(p, c.shape)
            e, w = _distance(user[p.name], c, rows, _rtol(p.dtype))
            worst, wild = max(worst, e), wild + w
            total += 0 if isinstance(c, BaseException) else c.size
        if wild > total / 2:  # a variant that is mostly NaN says nothing about the user's code
            worst = np.inf
        return worst, wild

    ref_out = outputs({})
    untested = []
    for ids, knobs in _candidates(testable):
        if ids and all(_distance(outputs(knobs)[p.name], ref_out[p.name],
                                 np.ones(ref_out[p.name].shape[:-1], bool)
                                 if not isinstance(ref_out[p.name], BaseException) else None,
                                 _rtol(p.dtype))[0] == 0.0 for p in probes):
            untested.append(ids[0])
    untested += [f.id for f in CATALOGUE if f.id not in testable]
    candidates = [i for i in testable if i not in untested]

    fault = None
    also: list[str] = []
    pair = False
    def matches(cands):
        """Matching candidates, exact ones (fewest NaN wildcards) first, then in catalogue order."""
        found = [(distance(ids, kn)[1], n, ids) for n, (ids, kn) in enumerate(cands)
                 if ids and distance(ids, kn)[0] == 0.0]
        found.sort()
        return [ids for w, _, ids in found if w == found[0][0]] if found else []

    if distance((), {})[0] == 0.0:
        status = "clean"
    else:
        status = "fault"
        singles = matches(list(_candidates(candidates)))
        if singles:
            fault, also = singles[0][0], [s[0] for s in singles[1:]]
        else:
            pairs = matches(list(_pairs(candidates)))
            if pairs:
                fault, also, pair = pairs[0][0], [pairs[0][1]], True
            else:
                status = "unknown"

    location, code, facts, events, rec = None, "", {}, [], base
    try:
        # the richest probe the function ran on: padding (every branch taken), else T ≠ d_k
        ran = [p for p in probes if not isinstance(user[p.name], BaseException)]
        rec = next((p for p in ran if p.pad_kind and p.dtype != np.float16),
                   ran[1] if len(ran) > 1 else base)
        events = (_record if framework == "torch" else _record_numpy)(caller, rec)
        location, code, facts = _whitebox(events, fault)
    except Exception as exc:  # recording is a bonus; never let it hide the diagnosis
        facts = {"error": f"{type(exc).__name__}: {exc}"}
    details.update({"whitebox": facts, "code": code, "probes": [p.name for p in probes]})

    if status == "clean":
        msg = "no known fault: matches the reference"
        return Diagnosis(None, None, msg, None, "clean", [], untested, details)
    if status == "unknown":
        A = next((e["weights"] for e in events if "weights" in e), None)
        if A is None and not isinstance(_safe(caller, rec), BaseException):
            A = caller.weights  # the function returned (out, weights)
        check = _audit_weights(A, rec, sig) if A is not None else None
        msg = ("the output differs from the reference and from every catalogued fault (and "
               "every pair of them)")
        if check is not None and check.ok:
            stage = "O" if sig != "qkv" and dims.get("w_o") else "H"
            msg += "; the softmax weights pass the audit, so the divergence is after A"
        elif check is not None:
            stage = check.stage
            msg += f"; the softmax weights fail the audit at {check.stage}: {check.message}"
            msg += f" ({check.hint})" if check.hint else ""
        else:
            stage = _unknown_stage(facts, sig, dims)
        return Diagnosis(None, stage, msg, location, "unknown", [], untested, details)
    f = _BY_ID[fault]
    msg = f"{f.id}: {f.description}"
    if pair:
        msg += f"; together with {also[0]} ({_BY_ID[also[0]].description})"
    elif also:
        msg += f" (these probes cannot tell it from: {', '.join(also)})"
    return Diagnosis(f.id, f.stage, msg, location, "fault", also, untested, details)


def _audit_weights(A, p: _Probe, sig: str):
    """The audit's first failing Check given the weights A the user's softmax produced
    (a passing Check when the audit is clean; None when A cannot be placed)."""
    from .audit import audit

    if sig == "qkv":
        data = {"Q": p.inputs["q"], "K": p.inputs["k"], "V": p.inputs["v"]}
        lead = p.inputs["q"].shape[:-2]
    else:
        data = {"X": p.inputs["x"], "W_q": p.inputs["w_q"], "W_k": p.inputs["w_k"],
                "W_v": p.inputs["w_v"]}
        lead = p.inputs["x"].shape[:-2] + ((p.heads,) if p.heads else ())
        if p.heads:
            data["n_heads"] = p.heads
    T = p.inputs["q" if sig == "qkv" else "x"].shape[-2]
    want = lead + (T, T)
    if A.size != int(np.prod(want)):
        return None
    data["A"] = A.reshape(want)
    if p.pad_kind is not None:
        data[p.pad_kind] = p.pad
    try:
        rep = audit(data)
    except ValueError:
        return None
    return rep.first_failure or rep.checks[-1]


def _unknown_stage(facts: dict, sig: str, dims: dict) -> str:
    if facts.get("softmax over the key axis") is False:
        return "A"
    if facts.get("mask after softmax"):
        return "A"
    if facts.get("mask before softmax") is False:
        return "M"
    return "O" if sig != "qkv" and dims.get("w_o") else "H"


# -- running a file's function in a subprocess ------------------------------------------
def _load_target(spec: str):
    path, _, name = spec.rpartition(":")
    if not path or not name:
        raise ValueError(f"diagnose: expected path/to/file.py:function_or_class, got {spec!r}")
    import importlib.util

    p = Path(path)
    if not p.is_file():
        raise ValueError(f"diagnose: {path}: no such file")
    sys.path.insert(0, str(p.parent.resolve()))
    mod_spec = importlib.util.spec_from_file_location(f"_diagnosed_{p.stem}", p)
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    if not hasattr(mod, name):
        raise ValueError(f"diagnose: {path} has no {name!r}")
    obj = getattr(mod, name)
    if inspect.isfunction(obj) and not any(
            q.default is q.empty and q.kind in (q.POSITIONAL_ONLY, q.POSITIONAL_OR_KEYWORD)
            for q in inspect.signature(obj).parameters.values()):
        obj = obj()  # a factory: returns the configured function or module
    if inspect.isclass(obj):
        try:
            obj = obj()
        except TypeError as exc:
            raise ValueError(f"diagnose: cannot construct {name}() without arguments ({exc}); "
                             "name a function without arguments that returns a configured "
                             "module") from None
    return obj


def _worker(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    spec, sig = argv[0], (argv[1] if len(argv) > 1 and argv[1] != "-" else None)
    try:
        d = _diagnose_callable(_load_target(spec), sig)
    except Exception as exc:
        d = Diagnosis(None, None, f"{type(exc).__name__}: {exc}", status="error")
    sys.stdout.flush()
    print(_MARK + json.dumps(d.to_dict(), default=str))


def _diagnose_path(spec: str, signature: str | None, timeout: float) -> Diagnosis:
    cmd = [sys.executable, "-c", "import sys; from causalattn.diagnose import _worker; _worker()",
           spec, signature or "-"]
    env = dict(os.environ)
    pkg_root = str(Path(__file__).resolve().parent.parent)  # so the child finds causalattn
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [pkg_root, env.get("PYTHONPATH")]))
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                             stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return Diagnosis(None, None, f"{spec} did not finish within {timeout:g} s (a hang?); "
                         "it was stopped", status="timeout")
    for line in reversed(res.stdout.splitlines()):
        if line.startswith(_MARK):
            return Diagnosis.from_dict(json.loads(line[len(_MARK):]))
    tail = (res.stderr or res.stdout).strip().splitlines()[-3:]
    return Diagnosis(None, None, f"{spec} crashed (exit code {res.returncode}): "
                     + " | ".join(tail), status="crashed")

