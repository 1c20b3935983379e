"""Boolean attention masks: True = the query (row) may read the key (column).

The seeds write the causal mask additively, M_ij = 0 for j <= i and -inf for j > i.
We build masks as booleans and derive that additive view only at the end
(:func:`additive`), because booleans combine safely with logical AND, while adding
two finite minimums overflows to -inf in fp16/fp32 and can hand weight to a
forbidden key.

Shapes use the seeds' notation: a causal mask is ``T_q×T_k``; padding masks are
``(B, T)``; :func:`combine` broadcasts them together, e.g. to ``(B, T, T)``.
"""

from __future__ import annotations

from typing import Literal

import numpy as np

__all__ = ["causal", "key_padding", "query_padding", "combine", "additive"]


def _check_len(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"mask: {name} must be an integer, got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"mask: {name} must be >= 0, got {value}")
    return int(value)


def causal(T_q: int, T_k: int | None = None) -> np.ndarray:
    """Causal mask, ``T_q×T_k`` booleans: query i may read key j when j <= i + (T_k - T_q).

    With T_q == T_k this is the lower triangle (diagonal included). With T_q < T_k
    (decoding against a KV cache) the queries are the *last* T_q positions, so the
    mask is aligned to the bottom-right corner.
    """
    T_q = _check_len("T_q", T_q)
    T_k = T_q if T_k is None else _check_len("T_k", T_k)
    if T_q > T_k:
        raise ValueError(
            f"causal mask: T_q={T_q} queries but only T_k={T_k} keys; with bottom-right "
            "alignment T_q must be <= T_k"
        )
    i = np.arange(T_q)[:, None]
    j = np.arange(T_k)[None, :]
    return j <= i + (T_k - T_q)


def _lengths(lengths, T: int, what: str) -> np.ndarray:
    T = _check_len("T", T)
    arr = np.asarray(lengths)
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(
            f"{what}: lengths must be a 1-D integer array (B,), got shape {arr.shape} "
            f"and dtype {arr.dtype}"
        )
    if arr.size and (arr.min() < 0 or arr.max() > T):
        raise ValueError(f"{what}: lengths must lie in [0, T={T}], got {arr.tolist()}")
    return arr


def key_padding(lengths, T: int) -> np.ndarray:
    """Key-padding mask ``(B, T)``: key j of sequence b may be read when j < lengths[b]."""
    arr = _lengths(lengths, T, "key padding mask")
    return np.arange(T)[None, :] < arr[:, None]


def query_padding(lengths, T: int) -> np.ndarray:
    """Query-padding mask ``(B, T)``: query i of sequence b is real when i < lengths[b].

    Combined with a ``(B, T, T)`` mask it is broadcast over the key axis, so a padding
    query row has no readable key (its output row is zero, never NaN).
    """
    arr = _lengths(lengths, T, "query padding mask")
    return np.arange(T)[None, :] < arr[:, None]


def combine(*masks):
    """Logical AND of boolean masks, broadcast together (NumPy or torch, not mixed).

    Padding masks of shape ``(B, T)`` are read as key masks; to use one over queries,
    give it a trailing axis: ``q_mask[:, :, None]``.
    """
    if not masks:
        raise ValueError("combine: at least one mask is required")
    is_torch = [type(m).__module__.startswith("torch") for m in masks]
    if any(is_torch):
        import torch

        if not all(is_torch):
            raise ValueError("combine: masks must be all NumPy or all torch, not mixed")
        out = masks[0]
        for m in masks:
            if m.dtype != torch.bool:
                raise ValueError(f"combine: masks must be boolean (True = may read), got {m.dtype}")
        try:
            for m in masks[1:]:
                out = torch.logical_and(out, m)
        except RuntimeError as exc:
            shapes = " and ".join(str(tuple(m.shape)) for m in masks)
            raise ValueError(f"combine: masks of shapes {shapes} do not broadcast") from exc
        return out
    arrs = [np.asarray(m) for m in masks]
    for a in arrs:
        if a.dtype != np.bool_:
            raise ValueError(f"combine: masks must be boolean (True = may read), got {a.dtype}")
    try:
        out = arrs[0]
        for a in arrs[1:]:
            out = np.logical_and(out, a)
    except ValueError as exc:
        shapes = " and ".join(str(a.shape) for a in arrs)
        raise ValueError(f"combine: masks of shapes {shapes} do not broadcast") from exc
    return out


def additive(
    allowed, fill: Literal["-inf", "finite"] = "-inf", dtype=np.float64
) -> np.ndarray:
    """The seeds' additive mask M: 0 where allowed, -inf (or dtype's finite minimum) where blocked.

    A finite fill is written once per blocked entry, never summed from two masks, so it
    cannot overflow. Softmax in this package still forces blocked entries to exactly 0
    (see :mod:`causalattn.reference`), so a finite fill changes no weight.
    """
    a = np.asarray(allowed)
    if a.dtype != np.bool_:
        raise ValueError(f"additive: mask must be boolean (True = may read), got {a.dtype}")
    dt = np.dtype(dtype)
    if not np.issubdtype(dt, np.floating):
        raise ValueError(f"additive: dtype must be floating, got {dt}")
    if fill == "-inf":
        blocked = -np.inf
    elif fill == "finite":
        blocked = np.finfo(dt).min
    else:
        raise ValueError(f"additive: fill must be '-inf' or 'finite', got {fill!r}")
    return np.where(a, dt.type(0), dt.type(blocked)).astype(dt)
