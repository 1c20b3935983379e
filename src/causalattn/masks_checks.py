"""The checks of :class:`causalattn.masks.Pattern`: its arguments when it is made
(``__post_init__``) and against the shapes of a problem (``check``), with the small
argument checks the rest of masks uses (``check_lengths``, ``shape_str``, ...).

Part of :mod:`causalattn.masks` (its public face): ``Pattern`` takes these methods from
:class:`PatternChecks`. Imports no torch at module level.
"""

from __future__ import annotations

import math

import numpy as np

from . import masks_mod as _mod


def _is_torch(x) -> bool:
    return type(x).__module__.startswith("torch")


def default_scale(d_k: int) -> float:
    """The default scale of S = Q Kᵀ·scale, 1/√d_k (1.0 for an empty head, d_k = 0): the
    one place the engines, the trace, the audit, diagnose and the HF capture take it from."""
    return 1.0 / float(np.sqrt(d_k)) if d_k else 1.0


def shape_str(x) -> str:
    """An array's shape for messages, as Python writes a tuple: ``(2, 5)``, ``(3,)``. The
    one formatter (masks, problem, layer, hf_pattern)."""
    return str(tuple(int(s) for s in x.shape))


def _numpy(x) -> np.ndarray:
    """Host NumPy copy of a small array argument (lengths, offsets, slopes)."""
    if _is_torch(x):
        return x.detach().cpu().numpy()
    return np.asarray(x)


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"mask: {name} must be a positive integer, got {value!r}")
    if value < 1:
        raise ValueError(f"mask: {name} must be >= 1, got {value}")
    return int(value)


def _ints(value) -> np.ndarray:
    """``_numpy(value)``, an empty 1-D one as int64: [] is float64 to NumPy, and is no
    sequences whatever its dtype."""
    arr = _numpy(value)
    return arr.astype(np.int64) if arr.ndim == 1 and arr.size == 0 else arr


def _int_vector(name: str, value) -> np.ndarray:
    arr = _ints(value)
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer) or arr.dtype == np.bool_:
        raise ValueError(
            f"mask: {name} must be a 1-D integer array, got shape {arr.shape} and dtype {arr.dtype}"
        )
    return arr.astype(np.int64)


def _float_array(name: str, value, ndims: tuple[int, ...]):
    if _is_torch(value):
        ok = value.dtype.is_floating_point
        if ok and value.dim() in ndims and value.numel() and not value.device.type == "meta":
            if not bool(value.detach().isfinite().all()):
                raise ValueError(f"mask: {name} must be finite, got non-finite entries")
        arr = value
    else:
        arr = np.asarray(value)
        ok = np.issubdtype(arr.dtype, np.floating) or (
            np.issubdtype(arr.dtype, np.integer) and arr.dtype != np.bool_
        )
        if ok and arr.ndim in ndims and not np.isfinite(arr.astype(np.float64)).all():
            raise ValueError(f"mask: {name} must be finite, got non-finite entries")
        arr = arr.astype(np.float64) if ok else arr
    if not ok or arr.ndim not in ndims:
        raise ValueError(
            f"mask: {name} must be a real array with {' or '.join(map(str, ndims))} axes, "
            f"got shape {tuple(arr.shape)} and dtype {arr.dtype}"
        )
    return arr


def _check_len(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"mask: {name} must be an integer, got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"mask: {name} must be >= 0, got {value}")
    return int(value)


def check_lengths(lengths, T: int, what: str, B: int | None = None, note: str = "") -> np.ndarray:
    """``lengths`` as int64 NumPy (B,), each in [0, T]; else a ValueError from ``what``
    naming the shape (B,) = (``B``,) when given. The one lengths check (masks, layer, ring)."""
    arr = _ints(lengths)
    if (
        arr.ndim != 1
        or not np.issubdtype(arr.dtype, np.integer)
        or arr.dtype == np.bool_
        or (B is not None and arr.shape[0] != B)
    ):
        want = "(B,)" if B is None else f"(B,) = ({B},)"
        raise ValueError(
            f"{what}: lengths must be a 1-D integer array {want}, got shape "
            f"{tuple(arr.shape)} and dtype {arr.dtype}"
        )
    if arr.size and (arr.min() < 0 or arr.max() > T):
        raise ValueError(f"{what}: lengths must lie in [0, T={T}]{note}, got {arr.tolist()}")
    return arr.astype(np.int64)


class PatternChecks:
    """Pattern's checks: a mixin without fields (they are :class:`~causalattn.masks.Pattern`'s)."""

    def __post_init__(self):
        set_ = object.__setattr__
        if not isinstance(self.causal, (bool, np.bool_)):
            raise ValueError(f"mask: causal must be True or False, got {self.causal!r}")
        set_(self, "causal", bool(self.causal))
        for name in ("q_start", "k_start"):
            v = getattr(self, name)
            if v is not None and (
                isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0
            ):
                raise ValueError(f"mask: {name} must be a non-negative integer, got {v!r}")
        if self.window is not None:
            set_(self, "window", _positive_int("window", self.window))
        if self.chunk is not None:
            set_(self, "chunk", _positive_int("chunk", self.chunk))
        for name in ("lengths", "prefix_lengths", "cu_seqlens"):
            v = getattr(self, name)
            if v is not None:
                arr = _int_vector(name, v)
                if arr.size and arr.min() < 0:
                    raise ValueError(f"mask: {name} must be >= 0, got {arr.tolist()[:8]}")
                set_(self, name, arr)
        if self.cu_seqlens is not None:
            cu = self.cu_seqlens
            if cu.size < 2 or cu[0] != 0 or (np.diff(cu) < 0).any():
                raise ValueError(
                    f"cu_seqlens: must have >= 2 entries, start at 0 and never decrease; "
                    f"got {cu.tolist()[:8]}"
                )
            if self.lengths is not None or self.key_padding_mask is not None:
                raise ValueError(
                    "cu_seqlens: give either packed sequences or lengths/key_padding_mask, not both"
                )
            if self.mask is not None:
                raise ValueError(
                    "cu_seqlens: a dense mask and packed sequences contradict; "
                    "give the document rule inside the mask, or cu_seqlens alone"
                )
            if self.prefix_lengths is not None:
                raise ValueError("cu_seqlens: prefix_lengths per packed document is not supported")
        for name, ndim in (("key_padding_mask", (2,)), ("mask", (2, 3, 4))):
            v = getattr(self, name)
            if v is None:
                continue
            if not _is_torch(v):
                v = np.asarray(v)
                set_(self, name, v)
            is_bool = str(v.dtype) in ("torch.bool", "bool")
            if not is_bool or v.ndim not in ndim:
                raise ValueError(
                    f"mask: {name} must be boolean (True = may read) with "
                    f"{' or '.join(map(str, ndim))} axes, got shape {tuple(v.shape)} "
                    f"and dtype {v.dtype}"
                )
        if self.alibi_slopes is not None:
            set_(self, "alibi_slopes", _float_array("alibi_slopes", self.alibi_slopes, (1, 2)))
        if self.sinks is not None:
            set_(self, "sinks", _float_array("sinks", self.sinks, (1,)))
        _mod.check_callable("mask_mod", self.mask_mod)
        _mod.check_callable("score_mod", self.score_mod)
        if self.rel_bias is not None:
            set_(self, "rel_bias", _float_array("rel_bias", self.rel_bias, (2,)))
        if self.bias is not None:
            b = self.bias if _is_torch(self.bias) else np.asarray(self.bias)
            ok = b.dtype.is_floating_point if _is_torch(b) else np.issubdtype(b.dtype, np.floating)
            if not ok or b.ndim > 4:
                raise ValueError(
                    f"bias: must be a float array broadcastable to (B, H, T_q, T_k) (at most 4 "
                    f"axes), got shape {tuple(b.shape)} and dtype {b.dtype}"
                )
            set_(self, "bias", b)
        if self.softcap is not None:
            c = self.softcap
            if isinstance(c, bool) or not isinstance(c, (int, float, np.floating, np.integer)):
                raise ValueError(f"mask: softcap must be a positive number, got {c!r}")
            if not (math.isfinite(float(c)) and c > 0):
                raise ValueError(f"mask: softcap must be finite and > 0, got {c}")
            set_(self, "softcap", float(c))

    # ---- shapes ----------------------------------------------------------------------
    def check(self, B: int, H: int, T_q: int, T_k: int) -> None:
        """Raise ValueError, naming the argument and the shapes, where the pattern does not
        fit queries (B, H, T_q) against keys (B, ·, T_k)."""
        placed = self.q_start is not None or self.k_start != 0
        T_all = max(T_k + self.k_start, T_q + self.query_start(T_q, T_k))  # whole sequence
        if T_q > T_k and not placed:
            raise ValueError(
                f"mask: T_q={T_q} queries but only T_k={T_k} keys; queries are the last T_q "
                "positions, so T_q must be <= T_k"
            )
        for name in ("lengths", "prefix_lengths"):
            v = getattr(self, name)
            if v is None:
                continue
            if v.shape != (B,):
                raise ValueError(f"{name}: expected shape (B,) = ({B},), got {shape_str(v)}")
            if v.size and v.max() > T_all and not placed:
                raise ValueError(f"{name}: each must lie in [0, T_k={T_k}], got {v.tolist()[:8]}")
        if self.prefix_lengths is not None and self.lengths is not None:
            if (self.prefix_lengths > self.lengths).any():
                raise ValueError(
                    f"prefix_lengths: each must lie in [0, length]; got prefix "
                    f"{self.prefix_lengths.tolist()[:8]} for lengths {self.lengths.tolist()[:8]}"
                )
        key_padding = self.key_padding_mask
        if key_padding is not None and tuple(key_padding.shape) != (B, T_k):
            raise ValueError(
                f"key_padding_mask: expected a bool array (B, T_k) = ({B}, {T_k}), True = may "
                f"read; got shape {shape_str(key_padding)}"
            )
        cu = self.cu_seqlens
        if cu is not None:
            if (cu[-1] != T_k and not placed) or cu[-1] < T_all:
                end = f"end at T={T_k}" if not placed else f"reach this block's end, {T_all}"
                raise ValueError(f"cu_seqlens: must {end}; got {cu.tolist()[:8]}")
            if B != 1 or (T_q != T_k and not placed):
                raise ValueError(
                    f"cu_seqlens: packed sequences need B = 1 and T_q = T_k; got B={B}, "
                    f"T_q={T_q}, T_k={T_k}"
                )
        m = self.mask
        if m is not None:
            full = (1,) * (4 - m.ndim) + tuple(m.shape)
            if full[2:] != (T_q, T_k) or full[0] not in (1, B) or full[1] not in (1, H):
                raise ValueError(
                    f"mask: expected a bool array (B|1, H|1, T_q, T_k) with B={B}, H={H}, "
                    f"T_q={T_q}, T_k={T_k}; got shape {shape_str(m)}"
                )
        a = self.alibi_slopes
        if a is not None and tuple(a.shape) not in ((H,), (B, H)):
            raise ValueError(
                f"alibi_slopes: expected shape (H,) = ({H},) or (B, H) = ({B}, {H}), "
                f"got {shape_str(a)}"
            )
        s = self.sinks
        if s is not None and tuple(s.shape) != (H,):
            raise ValueError(
                f"sinks: expected one logit per head, shape (H,) = ({H},), got {shape_str(s)}"
            )
        self._check_user(B, H, T_q, T_k)

    def _check_user(self, B: int, H: int, T_q: int, T_k: int) -> None:
        """bias, rel_bias, mask_mod and score_mod against the shapes: the mask_mod and
        score_mod are called on one small block (the mask_mod twice: a pure function answers
        the same)."""
        b = self.bias
        if b is not None and not _mod._fits(tuple(b.shape), (B, H, T_q, T_k)):
            raise ValueError(
                f"bias: shape {shape_str(b)} does not broadcast to (B, H, T_q, T_k) = "
                f"({B}, {H}, {T_q}, {T_k}); give (B|1, H|1, T_q|1, T_k|1)"
            )
        r = self.rel_bias
        if r is not None:
            qs, ks = self.query_start(T_q, T_k), self.k_start
            reach = max(qs + T_q - 1 - ks, ks + T_k - 1 - qs, 0)  # the largest |j - pos(i)|
            if r.shape[0] != H or r.shape[1] % 2 == 0 or (r.shape[1] - 1) // 2 < reach:
                raise ValueError(
                    f"rel_bias: expected (H, 2·T−1) = ({H}, {2 * reach + 1}) or wider (odd, "
                    f"centred on j = pos(i)), got {shape_str(r)}"
                )
        fn = self.mask_mod
        if fn is not None and hasattr(fn, "mismatch"):
            why = fn.mismatch(B, H, T_q, T_k)
            if why:
                raise ValueError(why)
        if T_q == 0 or T_k == 0 or (fn is None and self.score_mod is None):
            return
        qs, ks = self.query_start(T_q, T_k), self.k_start
        pos, j = np.arange(min(T_q, 16)) + qs, np.arange(min(T_k, 16)) + ks
        rows = np.arange(B)
        if fn is not None:
            import torch

            _mod.evaluate_mask(fn, torch, rows, H, pos, j, twice=True)  # pure: the same twice
        if self.score_mod is not None:
            import torch

            b4, h4, q4, k4 = _mod.indices(torch, rows, H, pos, j)
            S = torch.zeros((B, H, len(pos), len(j)), dtype=torch.float64)
            with torch.no_grad():
                _mod.apply_score_mod(self.score_mod, S, b4, h4, q4, k4)
