"""Probe inputs for diagnose: queries and keys that separate the faults, and the pattern
the reference reads on each.

A probe fixes Q (B, H, T_q, d_k) and K (B, H, T_k, d_k); the values are chosen later by
the measurement (V = I gives A itself). For the ``x-weights`` and ``module`` signatures
Q and K come from x (T×d_model, the same in every batch row) and random W_Q, W_K, and
values are reached through W_V = pinv(x)·V, which needs T <= d_model.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from .. import masks
from ..reference import merge_heads, split_heads

__all__ = ["Probe", "split_heads", "merge_heads", "qkv_probe", "x_probe"]


@dataclass
class Probe:
    name: str
    Q: np.ndarray  # (B, H, T_q, d_k) float64, as the function sees it (after the dtype cast)
    K: np.ndarray  # (B, H, T_k, d_k)
    dtype: np.dtype
    pattern: masks.Pattern  # what the reference reads on this probe
    inputs: dict = field(default_factory=dict)  # x, w_q, w_k (x-weights, module) in dtype
    kwargs: dict = field(default_factory=dict)  # passed to the function (lengths= ...)
    optional: bool = True  # the function may refuse it (fp16, T_q < T_k, padding, heads)

    @property
    def B(self):
        return self.Q.shape[0]

    @property
    def H(self):
        return self.Q.shape[1]

    @property
    def T_q(self):
        return self.Q.shape[2]

    @property
    def T_k(self):
        return self.K.shape[2]

    @property
    def d_k(self):
        return self.Q.shape[3]

    def allowed(self) -> np.ndarray:
        """The reference's read pattern, (B, H, T_q, T_k)."""
        a = self.pattern.allowed(self.B, self.H, self.T_q, self.T_k)
        return np.broadcast_to(a, (self.B, self.H, self.T_q, self.T_k))

    def G(self) -> np.ndarray:
        """Q Kᵀ in float64, (B, H, T_q, T_k): the raw scores the scale multiplies."""
        return self.Q @ np.swapaxes(self.K, -1, -2)

    def with_pattern(self, **kw) -> Probe:
        return replace(self, pattern=masks.Pattern(**{**_fields(self.pattern), **kw}))


def _fields(p: masks.Pattern) -> dict:
    return {n: getattr(p, n) for n in masks.PATTERN_KEYWORDS}


def _cast(a, dtype):
    return np.asarray(a, dtype=np.float64).astype(dtype)


def qkv_probe(
    name, rng, *, B=1, H=1, T_q, T_k, d_k, mag, dtype, pattern, kwargs=None, negative=False
):
    """q, k ~ N(0, mag²), so the scaled scores spread over about ±mag². ``negative``: every
    query points away from every key, so all scores are about -mag²·d_k (below any fill
    that replaces a blocked score by a constant such as -1e4)."""
    if negative:
        u = rng.normal(size=d_k)
        u /= np.linalg.norm(u)
        q = -(u + 0.05 * rng.normal(size=(B, H, T_q, d_k))) * mag
        k = (u + 0.05 * rng.normal(size=(B, H, T_k, d_k))) * mag
    else:
        q = rng.normal(size=(B, H, T_q, d_k)) * mag
        k = rng.normal(size=(B, H, T_k, d_k)) * mag
    q, k = _cast(q, dtype), _cast(k, dtype)
    return Probe(
        name,
        q.astype(np.float64),
        k.astype(np.float64),
        np.dtype(dtype),
        pattern,
        {"q": q, "k": k},
        kwargs or {},
    )


def x_probe(name, rng, *, B=1, T, d_model, heads, d_k, mag, dtype, pattern, kwargs=None):
    """x (B, T, d_model) with the same T×d_model rows in every batch row; W_Q, W_K random."""
    x0 = rng.normal(size=(T, d_model))
    x = _cast(np.broadcast_to(x0, (B, T, d_model)), dtype)
    w_q = _cast(rng.normal(size=(d_model, heads * d_k)) * mag / np.sqrt(d_model), dtype)
    w_k = _cast(rng.normal(size=(d_model, heads * d_k)) * mag / np.sqrt(d_model), dtype)
    x64, wq, wk = (a.astype(np.float64) for a in (x, w_q, w_k))
    Q = split_heads(x64 @ wq, heads)
    K = split_heads(x64 @ wk, heads)
    return Probe(
        name, Q, K, np.dtype(dtype), pattern, {"x": x, "w_q": w_q, "w_k": w_k}, kwargs or {}
    )
