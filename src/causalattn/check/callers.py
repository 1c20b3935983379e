"""Calling the user's code: loading a ``file.py:name`` target, its signature, framework,
layout; nn.Module projections."""

from __future__ import annotations

import copy
import inspect
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np

from ..io.files import read_source
from . import conventions
from .probes import Probe, merge_heads

SIGNATURES = ("qkv", "qkv-mask", "x-weights", "module")
TAKEN = "fn(q, k, v), fn(q, k, v, mask), fn(x, w_q, w_k, w_v[, w_o]) or an nn.Module"
# parameter names that say fn(q, k, v, ...) and fn(..., mask) (lower case)
_QKV_NAMES = (
    ("q", "query", "queries", "xq", "q_states", "query_states"),
    ("k", "key", "keys", "xk", "k_states", "key_states"),
    ("v", "value", "values", "xv", "v_states", "value_states"),
)
_MASK_NAMES = ("mask", "attn_mask", "attention_mask", "causal_mask", "attn_bias", "bias")


@dataclass(frozen=True)
class Target:
    """A ``path/file.py:name`` target, its source read (in the caller's process) by the one
    reader of user files; :func:`load_target` executes it, in the worker."""

    path: str
    name: str
    source: bytes


def read_target(spec: str) -> Target:
    """Split ``path/file.py:name`` and read the file (a regular file of Python source)."""
    path, _, name = spec.rpartition(":")
    if not path or not name:
        raise ValueError(f"diagnose: expected path/to/file.py:function_or_class, got {spec!r}")
    if not Path(path).is_file():
        raise ValueError(f"diagnose: {path}: no such file")
    return Target(path, name, read_source(path))


def exec_source(path: str, source: bytes, module_name: str, *, keep: bool = True) -> dict:
    """Execute ``source`` (read from ``path``) as a module named ``module_name``; its globals.
    Line numbers and tracebacks point at ``path``. ``keep``: leave the module in sys.modules
    and its folder on sys.path (a worker, as ``python file.py`` would); otherwise both only
    while it runs (as runpy does)."""
    mod = types.ModuleType(module_name)
    mod.__file__ = str(Path(path).resolve())
    folder = str(Path(mod.__file__).parent)
    sys.modules[module_name] = mod  # dataclasses, pickling and typing look modules up
    sys.path.insert(0, folder)  # its own imports, next to it
    try:
        exec(compile(source, mod.__file__, "exec"), mod.__dict__)
    finally:
        if not keep:
            sys.modules.pop(module_name, None)
            if folder in sys.path:
                sys.path.remove(folder)
    return mod.__dict__


def load_target(t: Target):
    """The object named by a target: a function, a module instance, an nn.Module class
    constructible without arguments, or a function without arguments returning one."""
    ns = exec_source(t.path, t.source, f"_diagnosed_{Path(t.path).stem}")
    if t.name not in ns:
        raise ValueError(f"diagnose: {t.path} has no {t.name!r}")
    obj = ns[t.name]
    if inspect.isfunction(obj) and not any(
        q.default is q.empty and q.kind in (q.POSITIONAL_ONLY, q.POSITIONAL_OR_KEYWORD)
        for q in inspect.signature(obj).parameters.values()
    ):
        obj = obj()  # a factory: returns the configured function or module
    if inspect.isclass(obj):
        try:
            obj = obj()
        except TypeError as exc:
            raise ValueError(
                f"diagnose: cannot construct {t.name}() without arguments ({exc}); "
                "name a function without arguments that returns a configured module"
            ) from None
    return obj


def framework(fn) -> str:
    """ "torch" when ``fn`` is an nn.Module or its code names torch (or anything from it:
    its globals, its closure, nested functions included), else "numpy". A guess: the
    Subject tries the other framework when the first call fails."""
    try:
        import torch

        if isinstance(fn, torch.nn.Module):
            return "torch"
    except ImportError:
        return "numpy"
    target = fn if hasattr(fn, "__code__") else type(fn).__call__  # a callable object
    code = getattr(target, "__code__", None)
    if code is None:
        return "numpy"
    scope = dict(getattr(target, "__globals__", {}))
    for n, cell in zip(code.co_freevars, getattr(target, "__closure__", None) or ()):
        try:
            scope[n] = cell.cell_contents
        except ValueError:  # an empty cell
            pass

    def names(c):
        yield from c.co_names
        yield from c.co_freevars
        for k in c.co_consts:
            if hasattr(k, "co_names"):
                yield from names(k)

    for n in names(code):
        v = scope.get(n)
        mod = v.__name__ if isinstance(v, types.ModuleType) else getattr(v, "__module__", "")
        if n in ("torch", "F") or (isinstance(mod, str) and mod.split(".")[0] == "torch"):
            return "torch"
    return "numpy"


def _pad_kind(fn) -> str | None:
    """The padding keyword the function accepts (key_padding_mask= or lengths=), if any."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return None
    for k in ("key_padding_mask", "lengths"):
        if k in params:
            return k
    return None


def _required(fn) -> list:
    """The parameters ``fn`` must be given positionally; ValueError when it has no signature."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        raise ValueError(
            "diagnose: cannot read the function's signature; pass signature="
        ) from None
    return [
        p
        for p in params
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty
    ]


def takes_wo(fn) -> bool:
    """fn(x, w_q, w_k, w_v, w_o): five required positional arguments, W_O the fifth."""
    return len(_required(fn)) >= 5


def _discover_signature(fn) -> str:
    try:
        import torch

        if isinstance(fn, torch.nn.Module):
            return "module"
    except ImportError:
        pass
    params = _required(fn)
    names = [p.name.lower() for p in params]
    qkv = len(names) >= 3 and all(n in ok for n, ok in zip(names, _QKV_NAMES))
    if len(params) == 3:
        return "qkv"
    if len(params) == 4 and qkv and names[3] in _MASK_NAMES:
        return "qkv-mask"
    if len(params) in (4, 5) and not qkv:
        return "x-weights"
    raise ValueError(
        f"diagnose: fn({', '.join(p.name for p in params)}) is not a signature diagnose "
        f"takes; it takes {TAKEN} (pass signature= to say which)"
    )


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

    def __init__(self, module, heads: int | None = None):
        """``heads``: the head count a declared per-head pattern fixes, for a module that
        names none of its own."""
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
            raise ValueError(
                "diagnose: cannot find the module's query/key/value projections "
                "(looked for Linear children or parameters named q/k/v, q_proj, "
                "W_q, c_attn, qkv ...); wrap it as fn(x, w_q, w_k, w_v, w_o)"
            )
        self.found = found
        h = next(
            (getattr(module, a) for a in _HEAD_ATTRS if isinstance(getattr(module, a, None), int)),
            None,
        )
        h = h or heads
        self.heads = h if h and h > 1 else None
        shapes = {r: self._ours(r).shape for r in found}
        if "qkv" in found:
            dm, three = shapes["qkv"]
            hk = kv_k = kv_v = three // 3
        else:
            dm, hk = shapes["q"]
            kv_k, kv_v = shapes["k"][1], shapes["v"][1]
        n = self.heads or 1
        d_k = hk // n
        # grouped-query attention: fewer key/value heads, each read by n / kv query heads
        kv = kv_k // d_k if d_k and kv_k % d_k == 0 else 0
        if not kv or n % kv or kv_v % kv:
            raise ValueError(
                f"diagnose: the module's key projection is {kv_k} wide, its query projection "
                f"{hk} = {n} heads × d_k = {d_k}: the key/value heads do not divide the "
                "query heads"
            )
        self.dims = {
            "d_model": dm,
            "hd_k": hk,
            "hd_v": n * (kv_v // kv),  # what W_O reads: every query head's d_v
            "d_v": kv_v // kv,
            "heads": self.heads,
            "kv_heads": kv,
            "d_k": d_k,
            "w_o": "o" in found,
            "d_out": shapes["o"][1] if "o" in found else None,
        }

    def _get(self, mod, role):
        kind, name = self.found[role]
        return getattr(mod, name).weight if kind == "linear" else getattr(mod, name)

    def _ours(self, role, mod=None):
        """The weight in the seeds' layout (d_in×d_out: X W)."""
        w = self._get(mod or self.module, role).detach()
        return (w.T if self.found[role][0] == "linear" else w).cpu().numpy()

    def instance(self, weights: dict):
        torch = self.torch
        mod = copy.deepcopy(self.module).eval()
        with torch.no_grad():
            for role, key in (("q", "w_q"), ("k", "w_k"), ("v", "w_v"), ("o", "w_o")):
                if role == "o" and "o" not in self.found:
                    continue
                if role in "qkv" and "qkv" in self.found:
                    continue
                self._set(mod, role, weights[key])
            if "qkv" in self.found:
                self._set(
                    mod, "qkv", np.concatenate([weights[k] for k in ("w_q", "w_k", "w_v")], 1)
                )
            for sub in mod.modules():  # biases would move every stage: zero them
                if isinstance(sub, torch.nn.Linear) and sub.bias is not None:
                    sub.bias.zero_()
        return mod

    def _set(self, mod, role, ours):
        torch = self.torch
        par = self._get(mod, role)
        val = torch.as_tensor(ours.T if self.found[role][0] == "linear" else ours)
        par.copy_(val.to(par.dtype))


def _as_array(out) -> np.ndarray:
    if type(out).__module__.startswith("torch"):
        out = out.detach().cpu().double().numpy()
    arr = np.asarray(out)
    if arr.dtype == object or not np.issubdtype(arr.dtype, np.number):
        raise TypeError(f"the function returned {type(out).__name__}, not an array")
    return arr


def _first(out):
    """The output H (or O): a tuple's first element (``(out, weights)`` is common)."""
    return out[0] if isinstance(out, (tuple, list)) and out else out


def _lead_layouts(B: int, H: int) -> list[tuple[int, ...]]:
    """Leading axes to try for a (B, H) probe: squeezed first, then with unit axes."""
    if B == 1 and H == 1:
        return [(), (1,), (1, 1)]
    if H == 1:
        return [(B,), (B, 1)]
    if B == 1:
        return [(1, H), (H,)]
    return [(B, H)]


class Output(NamedTuple):
    """What one call returned: ``H`` (B, H, T_q, n) float64, the weights ``A`` when it
    returned ``(out, weights)`` (else None), and the output's ``dtype`` (its precision)."""

    H: np.ndarray
    weights: np.ndarray | None
    dtype: np.dtype | None


class Subject:
    """The user's code, called on a probe with chosen values V: ``values(probe, V)`` returns
    an :class:`Output` whose ``H`` is per head, (B, H, T_q, n), for V (1|B, H, T_k, n).
    The input layout (unit axes) and the framework (NumPy or torch) are found on the first
    call that runs and kept; ``has_wo``: the function takes W_O (x-weights, 5 arguments)."""

    def __init__(self, fn, sig, framework, adapter=None, has_wo=False):
        self.fn, self.sig, self.framework, self.adapter = fn, sig, framework, adapter
        self.has_wo = has_wo if sig != "module" else "o" in adapter.found
        self.layouts: dict = {}  # (B == 1, H == 1) -> leading axes that worked
        # fn(q, k, v, mask): the convention its mask is written in (conventions); None: no mask
        self.mask_convention: str | None = None

    # -- conversion
    def _conv(self, a, framework=None, wrap=None):
        if (framework or self.framework) == "torch":
            import torch

            return torch.from_numpy(np.ascontiguousarray(a))
        return a if wrap is None else wrap(a)

    @staticmethod
    def _raw(out) -> tuple[np.ndarray, np.dtype]:
        out = _first(out)
        if type(out).__module__.startswith("torch"):
            dtype = np.dtype(str(out.dtype).replace("torch.", "").replace("bfloat16", "float32"))
        else:
            dtype = np.asarray(out).dtype
        return _as_array(out).astype(np.float64), dtype

    # -- calls
    def values(self, p: Probe, V: np.ndarray, wrap=None) -> Output:
        """Call the function on probe ``p`` with values ``V``; ``wrap``: a view for each
        NumPy input (the white-box recorder's)."""
        if self.sig == "qkv":
            return self._qkv(p, V, wrap)
        if self.sig == "x-weights":
            return self._xw(p, V, wrap)
        return self._module(p, V)

    def _qkv(self, p: Probe, V, wrap):
        B, H = p.B, p.H
        V = np.broadcast_to(V, (B, H) + V.shape[2:]).astype(p.dtype)
        n = V.shape[-1]
        key = (B == 1, H == 1)
        layouts = [self.layouts[key]] if key in self.layouts else _lead_layouts(B, H)
        frameworks = [self.framework]
        if key not in self.layouts and not self.layouts:
            frameworks.append("numpy" if self.framework == "torch" else "torch")
        err = None
        for fw in frameworks:
            for lead in layouts:
                try:
                    args = [
                        self._conv(a.reshape(lead + a.shape[2:]).copy(), fw, wrap)
                        for a in (p.inputs["q"], p.inputs["k"], V)
                    ]
                    if self.mask_convention is not None:  # the probe's pattern, q's layout
                        m = np.ascontiguousarray(p.allowed()).reshape(lead + (p.T_q, p.T_k))
                        m = conventions.encode(m, self.mask_convention, p.dtype)
                        args.append(self._conv(m, fw))  # (never wrapped: it is no stage)
                    kwargs = {
                        k: self._conv(np.asarray(v).copy(), fw, wrap) for k, v in p.kwargs.items()
                    }
                    out = self.fn(*args, **kwargs)
                    res, dtype = self._raw(out)
                    if res.size != B * H * p.T_q * n:
                        raise ValueError(
                            f"output has shape {res.shape}, expected {lead + (p.T_q, n)}"
                        )
                    self.layouts[key], self.framework = lead, fw
                    return Output(res.reshape(B, H, p.T_q, n), _returned_weights(out), dtype)
                except MemoryError:  # not a layout problem: the worker reports it
                    raise
                except Exception as exc:  # the next layout, or the caller reports it
                    if err is None or fw == self.framework:
                        err = exc if err is None else err
                    if key in self.layouts:
                        raise
        raise err

    def _xw(self, p: Probe, V, wrap):
        x = p.inputs["x"]
        B = p.B
        pinv = np.linalg.pinv(x[0].astype(np.float64))  # (d_model, T): x pinv(x) = I_T
        w_v = (pinv @ np.asarray(V, np.float64)[0, 0]).astype(p.dtype)
        n = V.shape[-1]
        args = [x if B > 1 else x[0], p.inputs["w_q"], p.inputs["w_k"], w_v]
        if self.has_wo:
            args.append(np.eye(n, dtype=p.dtype))
        out = self.fn(*[self._conv(np.ascontiguousarray(a).copy(), wrap=wrap) for a in args])
        res, dtype = self._raw(out)
        if res.size != B * p.T_q * n:
            raise ValueError(f"output has shape {res.shape}, expected {(B, p.T_q, n)}")
        return Output(res.reshape(B, 1, p.T_q, n), _returned_weights(out), dtype)

    def output(self, p: Probe, w_v: np.ndarray, w_o: np.ndarray) -> np.ndarray:
        """The function's output with chosen W_V and W_O (x-weights, module): (B, T, d_out)."""
        if self.sig == "x-weights":
            x = p.inputs["x"]
            args = [x if p.B > 1 else x[0], p.inputs["w_q"], p.inputs["w_k"], w_v, w_o]
            out = self.fn(*[self._conv(np.ascontiguousarray(a).copy()) for a in args])
        else:
            out = self._run_module(p, w_v, w_o)
        return self._raw(out)[0].reshape(p.B, p.T_q, -1)

    def _run_module(self, p: Probe, w_v, w_o):
        import torch

        mod = self.adapter.instance(
            {"w_q": p.inputs["w_q"], "w_k": p.inputs["w_k"], "w_v": w_v, "w_o": w_o}
        )
        x = p.inputs["x"]
        dt = next(mod.parameters()).dtype
        with torch.no_grad():
            return mod(torch.from_numpy(np.ascontiguousarray(x)).to(dt))

    def _module(self, p: Probe, V):
        d = self.adapter.dims
        h, g, dv, d_out = d["heads"] or 1, d["kv_heads"], d["d_v"], d["d_out"]
        x0 = p.inputs["x"][0].astype(np.float64)
        pinv = np.linalg.pinv(x0)
        V = np.asarray(V, np.float64)[0][:: h // g]  # (kv heads, T_k, n): one per group
        n = V.shape[-1]
        cols, dtype = [], None
        for c0 in range(0, n, dv):
            chunk = np.zeros((g, V.shape[1], dv))
            chunk[..., : min(dv, n - c0)] = V[..., c0 : c0 + dv]
            w_v = merge_heads(pinv @ chunk)  # (d_model, h·d_v)
            w_o = np.eye(h * dv, d_out) if d["w_o"] else None
            out, dtype = self._raw(self._run_module(p, w_v, w_o))
            Hc = out.reshape(p.T_q, -1)[:, : h * dv]
            cols.append(np.moveaxis(Hc.reshape(p.T_q, h, dv), 1, 0)[..., : min(dv, n - c0)])
        return Output(np.concatenate(cols, -1)[None], None, dtype)


def _returned_weights(out):
    """A ``(..., T_q, T_k)`` second element of a returned tuple: the weights A, or None."""
    if isinstance(out, (tuple, list)) and len(out) > 1:
        try:
            w = _as_array(out[1]).astype(np.float64)
        except (TypeError, ValueError):
            return None
        if w.ndim >= 2:
            return w
    return None
