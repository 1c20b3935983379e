"""Probing, white-box: record the operations the user's code runs (torch: a
TorchFunctionMode; NumPy: an ndarray subclass), each with its ``file:line``, as a list of
events in call order (what :mod:`.locate` reads)."""

from __future__ import annotations

import os
import traceback

import numpy as np

__all__ = ["record_torch", "record_numpy"]

# torch's spellings of the operations a mask or a scale can hide in
_ADDS = ("add", "__add__", "__iadd__", "__radd__", "add_")
_SCALES = ("div", "__truediv__", "__itruediv__", "div_", "mul", "__mul__", "__rmul__", "mul_")
_SCORED = {
    "softmax",
    "log_softmax",
    "exp",
    "matmul",
    "__matmul__",
    "bmm",
    "einsum",
    "linear",
    "masked_fill",
    "masked_fill_",
    "where",
    *_ADDS,
    *_SCALES,
    "transpose",
    "permute",
    "t",
    "scaled_dot_product_attention",
    "baddbmm",
    "sum",
}


def _shown(path: str) -> str:
    """A location's file relative to the current directory (as the docs promise)."""
    try:
        return os.path.relpath(path)
    except ValueError:  # another drive (Windows): keep it absolute
        return path


def _user_line(lib_dir: str, skip=()) -> tuple[str | None, str]:
    """``(file:line, code)`` of the innermost frame outside ``lib_dir``, this file and
    ``skip``, less this call and the hook that called it; ``(None, "")`` when none is."""
    here = os.path.abspath(__file__)
    for fr in reversed(traceback.extract_stack()[:-2]):
        f = os.path.abspath(fr.filename)
        if f.startswith(lib_dir) or f == here or f.startswith("<") or any(s in f for s in skip):
            continue
        return f"{_shown(f)}:{fr.lineno}", (fr.line or "").strip()
    return None, ""


def record_torch(call):
    """Run ``call()`` under a TorchFunctionMode; a list of op events in call order."""
    import torch
    from torch.overrides import TorchFunctionMode

    torch_dir = os.path.dirname(torch.__file__)
    events: list[dict] = []

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
                elif len(args) > 2 and any(
                    isinstance(a, (int, float)) and a == 0 for a in args[1:]
                ):
                    ev["kind"] = "guard"  # where(cond, A, 0): often a guard for empty rows
            elif name in _ADDS:
                if any(neg_fill(a) for a in args):
                    ev["kind"] = "mask"
            elif name in _SCALES:
                sc = [a for a in args[1:] if isinstance(a, (int, float))]
                if sc:
                    ev["scalar"] = float(sc[0])
                    ev["kind"] = "scale"
                elif any(isinstance(a, torch.Tensor) and a.dtype == torch.bool for a in args):
                    ev["kind"] = "zero"  # A * mask
            if isinstance(out, torch.Tensor):
                ev["shape"] = tuple(out.shape)
            ev["at"], ev["code"] = _user_line(torch_dir, skip=("contextlib",))
            events.append(ev)
            return out

    with Rec():
        call()
    return events


def record_numpy(call):
    """Run the NumPy ``call(wrap)`` — ``wrap`` views each input as a recording ndarray
    subclass (``__array_ufunc__`` / ``__array_function__``); op events in call order."""
    np_dir = os.path.dirname(np.__file__)
    events: list[dict] = []

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
                ev["at"], ev["code"] = _user_line(np_dir)
                events.append(ev)
            return wrap(out)

        def __array_function__(self, func, types, args, kwargs):
            args, kwargs = plain(args), plain(kwargs)
            out = func(*args, **kwargs)
            if func.__name__ == "where" and len(args) == 3:
                kind = (
                    "mask"
                    if any(neg_fill(a) for a in args[1:])
                    else "guard"
                    if any(scalar(a) and a == 0 for a in args[1:])
                    else None
                )
                if kind:
                    ev = {"op": "where", "kind": kind}
                    ev["at"], ev["code"] = _user_line(np_dir)
                    events.append(ev)
            return wrap(out)

    with np.errstate(all="ignore"):
        call(lambda a: a.view(Rec))
    return events
