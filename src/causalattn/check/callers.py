"""Calling the user's code: its signature, framework, layout; nn.Module projections."""

from __future__ import annotations

import copy
import inspect

import numpy as np

from .probes import _Probe

SIGNATURES = ("qkv", "x-weights", "module")


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

