"""Attention dropout from a counter: the pattern is a pure function of (seed, offset, b, h, i, j).

Dropout acts on the weights A after the softmax (after M and every modifier): a kept
weight is scaled by 1/(1-p), a dropped one is 0, as in SDPA and FlashAttention-2. The
keep/drop decision of cell (b, h, i, j) — i and j *global* query and key positions — is a
hash of those integers and of (seed, offset), not a draw from a stream. So every engine,
block size, thread count, work split and ring rank draws the same pattern, and the backward
regenerates it instead of storing a T×T mask (memory stays O(T)). The Triton kernels write
the same hash with the same 32-bit integer arithmetic.

The hash is MurmurHash3's 32-bit finalizer (fmix32), applied in three levels: a key for
(seed, offset, b, h), then a key per row i, then one mix per cell of (row key XOR column key).
The top 24 bits of the cell's hash, compared with round(p·2²⁴), decide: dropped when smaller.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .constants import HASH_C1 as _C1
from .constants import HASH_C2 as _C2
from .constants import HASH_COL as _COL
from .constants import HASH_GOLD as _GOLD
from .constants import HASH_OFFSET as _OFFSET
from .constants import HASH_ROW as _ROW

__all__ = ["check_p", "seed_from", "seed_tensor", "keep_mask", "apply", "M32"]

M32 = 0xFFFFFFFF


def check_p(dropout_p, where: str = "attention") -> float:
    """dropout_p as a float in [0, 1], or a ValueError naming the argument."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)):
        raise ValueError(f"{where}: dropout_p must be a float in [0, 1], got {dropout_p!r}")
    p = float(dropout_p)
    if not (0.0 <= p <= 1.0) or math.isnan(p):
        raise ValueError(f"{where}: dropout_p must lie in [0, 1], got {dropout_p}")
    return p


def seed_tensor(generator: torch.Generator | None = None) -> torch.Tensor:
    """(seed, offset) as an int64 CPU tensor (2,): the draw of :func:`seed_from`, left in a
    tensor so that a compiled graph draws it anew on every call (the attention operator
    reads it inside)."""
    return torch.randint(0, 2**31 - 1, (2,), generator=generator, device="cpu")


def seed_from(generator: torch.Generator | None = None) -> tuple[int, int]:
    """(seed, offset), two 31-bit integers drawn from torch's CPU RNG (or ``generator``),
    so ``torch.manual_seed(s)`` makes a call reproducible."""
    r = seed_tensor(generator)
    return int(r[0]), int(r[1])


def _fmix(x: torch.Tensor) -> torch.Tensor:
    """fmix32 on int64 tensors holding uint32 values (products wrap mod 2⁶⁴: low bits exact)."""
    x = x ^ (x >> 16)
    x = (x * _C1) & M32
    x = x ^ (x >> 13)
    x = (x * _C2) & M32
    return x ^ (x >> 16)


def _int(x, device) -> torch.Tensor:
    return torch.as_tensor(x, dtype=torch.int64, device=device)


def threshold(p: float) -> int:
    """Cells whose 24-bit hash is below this are dropped."""
    return int(round(p * (1 << 24)))


def keep_mask(seed: int, offset: int, b, h, i, j, p: float, device=None) -> torch.Tensor:
    """Bool (..., rows, cols): True where cell (b, h, i, j) is kept.

    ``b`` and ``h`` are ints or int tensors broadcastable together (e.g. (nb, 1) and (1, nh));
    ``i`` (rows,) global query positions, ``j`` (cols,) global key positions. The result has
    b's and h's broadcast shape followed by (rows, cols).
    """
    dev = device if device is not None else (i.device if isinstance(i, torch.Tensor) else None)
    b, h, i, j = (_int(x, dev) for x in (b, h, i, j))
    head = _fmix((b * _GOLD + h + offset * _OFFSET) & M32)
    head = _fmix(head ^ (seed & M32))  # (...)
    row = _fmix(head[..., None] ^ ((i * _GOLD + _ROW) & M32))  # (..., rows)
    col = _fmix((j * _GOLD + _COL) & M32)  # (cols,)
    if row.device.type == "cpu":
        return _cells_numpy(row, col, threshold(p))
    return _cells_torch(row, col, threshold(p))


def _cells_torch(row: torch.Tensor, col: torch.Tensor, thr: int) -> torch.Tensor:
    cell = _fmix(row[..., :, None] ^ col)  # (..., rows, cols)
    return (cell >> 8) >= thr


def _cells_numpy(row: torch.Tensor, col: torch.Tensor, thr: int) -> torch.Tensor:
    """The per-cell step of :func:`keep_mask` in NumPy uint32 (multiplies wrap mod 2³², shifts
    are logical): the same bits as the int64 torch form, several times faster per cell, in
    place, and the GIL is released (the tiled engine hashes tiles on many threads)."""
    r = row.numpy().astype(np.uint32)
    c = col.numpy().astype(np.uint32)
    x = np.bitwise_xor(r[..., :, None], c)  # (..., rows, cols)
    t = np.empty_like(x)
    for shift, mul in ((16, _C1), (13, _C2), (16, None)):  # fmix32
        np.right_shift(x, shift, out=t)
        np.bitwise_xor(x, t, out=x)
        if mul is not None:
            np.multiply(x, np.uint32(mul), out=x)
    np.right_shift(x, 8, out=x)
    return torch.from_numpy(np.greater_equal(x, thr))


def apply(A: torch.Tensor, keep: torch.Tensor, p: float) -> torch.Tensor:
    """Dropped weights to exactly 0, kept ones scaled by 1/(1-p) (p = 1: all zero)."""
    if p >= 1.0:
        return torch.zeros_like(A)
    return torch.where(keep, A * (1.0 / (1.0 - p)), torch.zeros((), dtype=A.dtype, device=A.device))
