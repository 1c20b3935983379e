"""The one reader of a user's mask: how a dense mask someone hands us is read (audit,
compare_masks, the CLI's audit, all through :func:`decide`) and written (diagnose's
``fn(q, k, v, mask)``, through :func:`encode`). The conventions:

    bool      True = may read
    additive  0 = may read; -inf or a large negative fill blocks (at or below -1e4:
              -1e9, -1e4, the dtype's finfo.min)
    1/0       1 = may read, 0 = blocked (``np.tril(np.ones((T, T)))``)

The values decide, whatever the dtype (an integer 0/1 mask is 1/0; a float mask of 0 and
-1e9 is additive). Where the values fit no convention, or fit two that disagree, the mask
is named ambiguous with the reason and never judged: an all-zero mask (additive: every key
readable; 1/0: none), entries that are neither 0, 1 nor a blocking fill (0.5, -100, NaN,
+inf), or 1s next to blocking fills. A bool is never ambiguous.

Works on NumPy arrays and torch tensors alike (elementwise comparisons only: no float64
copy of a large mask); the reading's ``allowed`` is of the input's kind.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "BOOL",
    "ADDITIVE",
    "ONE_ZERO",
    "CONVENTIONS",
    "MEANING",
    "BLOCKED_BELOW",
    "AmbiguousMask",
    "Reading",
    "read",
    "decide",
    "additive_allowed",
    "encode",
]

BOOL, ADDITIVE, ONE_ZERO = "bool", "additive", "1/0"
CONVENTIONS = (BOOL, ADDITIVE, ONE_ZERO)
MEANING = {
    BOOL: "bool (True = may read)",
    ADDITIVE: "additive (0 = may read, -inf or a fill at or below -1e4 blocks)",
    ONE_ZERO: "1/0 (1 = may read, 0 = blocked)",
}
BLOCKED_BELOW = -1e4  # an additive entry at or below this (or -inf) blocks the key


class AmbiguousMask(ValueError):
    """A mask whose convention its values do not decide (the reason is the message)."""


@dataclass(frozen=True)
class Reading:
    """How a mask was read: ``convention`` (one of :data:`CONVENTIONS`, None when
    ambiguous), ``allowed`` (the input's shape, True = may read; None when ambiguous) and
    ``reason`` (why it is ambiguous; empty otherwise)."""

    convention: str | None
    allowed: Any
    reason: str = ""

    @property
    def ambiguous(self) -> bool:
        return self.convention is None

    @property
    def meaning(self) -> str:
        return MEANING[self.convention] if self.convention else f"ambiguous: {self.reason}"


def _is_torch(x) -> bool:
    return type(x).__module__.startswith("torch")


def _dtype_kind(m) -> str:
    """'b' bool, 'n' a real number, '' anything else (complex, strings, objects)."""
    if _is_torch(m):
        if m.dtype.is_complex:
            return ""
        return "b" if str(m.dtype) == "torch.bool" else "n"
    k = m.dtype.kind
    return "b" if k == "b" else ("n" if k in "iuf" else "")


def additive_allowed(M):
    """The additive convention alone (an array named as the additive M): (allowed, odd),
    odd the entries that are neither 0 nor blocking."""
    blocked = M <= BLOCKED_BELOW  # -inf included; NaN is neither
    allowed = M == 0
    return allowed, ~(blocked | allowed)


def _first(where, m) -> str:
    """'m[i, j] = value' for the first True of ``where``, for the reason."""
    w = where.cpu().numpy() if _is_torch(where) else np.asarray(where)
    idx = tuple(int(i) for i in np.argwhere(w)[0])
    v = float(m[idx])
    return f"[{', '.join(map(str, idx))}] = {v:g}"


def read(m) -> Reading:
    """Read ``m`` (a NumPy array or torch tensor, any shape): its convention and the
    booleans it means, or ambiguous with the reason. ValueError for a non-numeric dtype."""
    if not _is_torch(m):
        m = np.asarray(m)
    kind = _dtype_kind(m)
    if kind == "b":
        return Reading(BOOL, m)
    if not kind:
        raise ValueError(
            f"must be boolean (True = may read), additive (0 / -inf) or 1/0 numbers, "
            f"got dtype {m.dtype}"
        )
    if (m.numel() if _is_torch(m) else m.size) == 0:
        return Reading(None, None, "it has no entries")
    zero, one, blocked = m == 0, m == 1, m <= BLOCKED_BELOW
    if bool((zero | blocked).all()) and bool(blocked.any()):
        return Reading(ADDITIVE, zero)
    if bool((zero | one).all()) and bool(one.any()):
        return Reading(ONE_ZERO, one)
    if bool(zero.all()):
        return Reading(
            None,
            None,
            "every entry is 0: read as additive every key is readable, read as 1/0 none is",
        )
    odd = ~(zero | one | blocked)
    if bool(odd.any()):
        return Reading(
            None,
            None,
            f"entries that are neither 0, 1 nor a blocking fill (-inf or at or below "
            f"{BLOCKED_BELOW:g}), first at {_first(odd, m)}",
        )
    return Reading(
        None,
        None,
        f"1s (1/0's may read) next to blocking fills (additive's blocked), first 1 at "
        f"{_first(one, m)}, first fill at {_first(blocked, m)}",
    )


def decide(m, what: str = "mask") -> Reading:
    """:func:`read`, refusing what it cannot read: ValueError naming ``what`` for a
    non-numeric dtype, :class:`AmbiguousMask` (a ValueError) with the reason when the
    values do not decide the convention."""
    try:
        r = read(m)
    except ValueError as exc:
        raise ValueError(f"{what}: {exc}") from None
    if r.ambiguous:
        raise AmbiguousMask(
            f"{what}: ambiguous mask convention, not judged: {r.reason}; give booleans "
            "(True = may read), additive 0 / -inf, or 1/0 with both values present"
        )
    return r


def encode(allowed_mask: np.ndarray, convention: str, dtype) -> np.ndarray:
    """The booleans ``allowed_mask`` (True = may read) written in ``convention``: bool,
    additive 0 / -inf in ``dtype``, or 1/0 in ``dtype`` (a float dtype, as
    ``np.tril(np.ones(...))`` makes it)."""
    a = np.asarray(allowed_mask, dtype=bool)
    if convention == BOOL:
        return a.copy()
    if convention == ADDITIVE:
        return np.where(a, 0.0, -np.inf).astype(dtype)
    if convention == ONE_ZERO:
        return a.astype(dtype)
    raise ValueError(f"encode: convention must be one of {CONVENTIONS}, got {convention!r}")
