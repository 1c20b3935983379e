"""One attention problem, checked once and handed to every engine in the same form.

Every engine takes a :class:`Problem` and returns ``H`` ``(B, H_q, T_q, d_v)`` and, when
asked, the fp32 log-sum-exp of each query row ``(B, H_q, T_q)`` (-inf for a row with
no readable key; with sinks the sink's term is part of it). Who may read whom, and the
score modifiers (softcap, ALiBi, sinks), is ``p.pattern``, a :class:`causalattn.masks.Pattern`
validated against the shapes here; see :mod:`causalattn.masks` for each rule.

Dropout on the weights A (after the softmax) with probability ``dropout_p``: the keep
pattern of cell (b, h, i, j) is :func:`causalattn.dropout.keep_mask` of ``dropout_seed``
(drawn once per call) and the cell's global row and column (the pattern's ``q_start`` /
``k_start`` placement: :meth:`Problem.dropout_rows`, :meth:`Problem.dropout_cols`), so every
engine, every split of the work and every ring rank draws the same pattern, and a backward
regenerates it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from .. import dropout as _dropout
from ..masks import Pattern, default_scale, takes_pattern
from ..masks import shape_str as _shape_str

FLOAT_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


def check_generator(generator) -> None:
    """The dropout generator: None or a CPU torch.Generator (the seed is drawn on the host)."""
    if generator is not None and (
        not isinstance(generator, torch.Generator) or generator.device.type != "cpu"
    ):
        raise ValueError(
            f"attention: generator must be a CPU torch.Generator (the dropout seed is drawn "
            f"on the host), got {generator!r}"
        )


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Where engines compute and merge: fp32, or fp64 for fp64 inputs (tiled, ring)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass
class Problem:
    q: torch.Tensor  # (B, H_q, T_q, d_k)
    k: torch.Tensor  # (B, H_kv, T_k, d_k)
    v: torch.Tensor  # (B, H_kv, T_k, d_v)
    scale: float
    pattern: Pattern  # M and the score modifiers, checked against (B, H_q, T_q, T_k)
    dropout_p: float = 0.0
    dropout_seed: tuple[int, int] | None = None  # (seed, offset); set iff dropout_p > 0

    @property
    def group(self) -> int:
        """Query heads per key/value head (grouped-query attention)."""
        return self.q.shape[1] // self.k.shape[1]

    @property
    def offset(self) -> int:
        """Query i sits at key index i + offset (bottom-right unless the pattern is placed)."""
        B, H, T_q, T_k = self.dims
        return self.pattern.query_start(T_q, T_k) - self.pattern.k_start

    @property
    def dims(self) -> tuple[int, int, int, int]:
        """(B, H_q, T_q, T_k): the shape the pattern is read at."""
        B, H, T_q, _ = self.q.shape
        return B, H, T_q, self.k.shape[2]

    def allowed(self) -> torch.Tensor:
        """The dense boolean mask ``(B', H', T_q, T_k)`` on q's device, True = may read
        (B' in {1, B}, H' in {1, H_q}). O(T_q·T_k): only materializing engines call it."""
        return self.pattern.allowed(*self.dims, like=self.q)

    # ---- dropout -------------------------------------------------------------------
    def dropout_rows(self, i0: int = 0, i1: int | None = None) -> torch.Tensor:
        """Global positions (int64, CPU) of query rows i0:i1 for the dropout hash: the
        pattern's placement (``q_start``; bottom-right by default)."""
        B, H, T_q, T_k = self.dims
        i1 = T_q if i1 is None else i1
        return torch.arange(i0, i1) + self.pattern.query_start(T_q, T_k)

    def dropout_cols(self, j0: int = 0, j1: int | None = None) -> torch.Tensor:
        """Global positions (int64, CPU) of key columns j0:j1 (``k_start`` + j)."""
        j1 = self.k.shape[2] if j1 is None else j1
        return torch.arange(j0, j1) + self.pattern.k_start

    def keep(self, b, h, i0: int = 0, i1: int | None = None, j0: int = 0, j1: int | None = None):
        """Bool keep pattern for batch rows b, query heads h (ints or broadcastable int
        tensors), rows i0:i1, columns j0:j1: shape (b·h broadcast, rows, cols), on CPU."""
        seed, off = self.dropout_seed
        return _dropout.keep_mask(
            seed, off, b, h, self.dropout_rows(i0, i1), self.dropout_cols(j0, j1), self.dropout_p
        )

    # ---- the legacy view (engines not yet on the pattern: triton, ring) ----------------
    @property
    def causal(self) -> bool:
        return self.pattern.causal

    @property
    def lengths(self) -> torch.Tensor | None:
        L = self.pattern.lengths
        return None if L is None else torch.as_tensor(L, device=self.q.device)

    @property
    def key_padding_mask(self) -> torch.Tensor | None:
        m = self.pattern.key_padding_mask
        return None if m is None else torch.as_tensor(m, device=self.q.device)

    @property
    def cu_seqlens(self) -> torch.Tensor | None:
        cu = self.pattern.cu_seqlens
        return None if cu is None else torch.as_tensor(cu, device=self.q.device)

    @property
    def is_legacy(self) -> bool:
        """Whether causal, lengths, key_padding_mask and cu_seqlens say everything (no
        window, chunk, prefix, dense mask, modifier or dropout)."""
        pt = self.pattern
        return (
            self.dropout_p == 0
            and not pt.has_modifiers
            and pt.window is None
            and pt.chunk is None
            and pt.prefix_lengths is None
            and pt.mask is None
            and pt.mask_mod is None
            and pt.q_start is None
            and pt.k_start == 0
        )


def _check_tensors(q, k, v) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(
                f"attention: {name} must be a torch.Tensor (B, H, T, d), got {type(t).__name__}"
            )
        if t.dim() != 4:
            raise ValueError(
                f"attention: {name} must be 4-D (B, H, T, d), got shape {_shape_str(t)}"
            )
        if t.dtype not in FLOAT_DTYPES:
            raise ValueError(
                f"attention: {name} {_shape_str(t)} has dtype {t.dtype}; expected one of fp64, "
                "fp32, "
                "bf16, fp16"
            )
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"attention: q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"attention: q, k, v devices differ: {q.device}, {k.device}, {v.device}")
    B, H_q, T_q, d_k = q.shape
    if k.shape[0] != B or v.shape[0] != B:
        raise ValueError(
            f"attention: batch sizes differ: q {_shape_str(q)}, k {_shape_str(k)}, v "
            f"{_shape_str(v)}"
        )
    if k.shape[3] != d_k:
        raise ValueError(
            f"scores: q is (B, H, T_q, d_k) = {_shape_str(q)} but k is {_shape_str(k)}; "
            "the inner d_k axes must match"
        )
    if k.shape[1] != v.shape[1] or k.shape[2] != v.shape[2]:
        raise ValueError(
            f"attention: k {_shape_str(k)} and v {_shape_str(v)} must agree on (B, H_kv, T_k)"
        )
    if d_k == 0 or v.shape[3] == 0:
        raise ValueError(
            f"attention: q {_shape_str(q)} and v {_shape_str(v)} need d_k >= 1 and d_v >= 1 (a "
            "head "
            "of width 0 has no scores or values)"
        )
    H_kv = k.shape[1]
    if H_kv == 0 or H_q % H_kv:
        raise ValueError(
            f"attention: q has H_q={H_q} heads and k, v have H_kv={H_kv}; grouped-query "
            "attention needs H_q to be a multiple of H_kv"
        )


def _check_lengths(q, k, pattern) -> None:
    T_q, T_k = q.shape[2], k.shape[2]
    if T_q > T_k and pattern.q_start is None and pattern.k_start == 0:
        raise ValueError(
            f"attention: q has T_q={T_q} positions but k has T_k={T_k}; queries are the "
            "last T_q positions, so T_q must be <= T_k"
        )


@takes_pattern
def make_problem(
    q,
    k,
    v,
    *,
    pattern: Pattern | None = None,
    scale=None,
    dropout_p=0.0,
    generator=None,
    **keywords,
) -> Problem:
    """Check inputs and build a :class:`Problem`; every error names the argument and shapes.

    ``pattern``: a ready :class:`Pattern` instead of the pattern keywords (not both).
    """
    _check_tensors(q, k, v)
    B, H_q, T_q, d_k = q.shape
    T_k = k.shape[2]
    pattern = Pattern.from_kwargs(pattern, **keywords)
    _check_lengths(q, k, pattern)
    placed = pattern.q_start is not None or pattern.k_start != 0
    if pattern.cu_seqlens is not None and (B != 1 or (T_q != T_k and not placed)):
        raise ValueError(
            f"cu_seqlens: packed sequences need q, k, v of shape (1, H, T, d) with one T; "
            f"got q {_shape_str(q)}, k {_shape_str(k)}"
        )
    pattern.check(B, H_q, T_q, T_k)
    if scale is None:
        scale = default_scale(d_k)
    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating, np.integer)):
        raise ValueError(f"attention: scale must be a number, got {scale!r}")
    scale = float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"attention: scale must be finite, got {scale}")
    p = _dropout.check_p(dropout_p)
    check_generator(generator)
    seed = _dropout.seed_from(generator) if p > 0 else None
    return Problem(q, k, v, scale, pattern, p, seed)
