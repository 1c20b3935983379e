"""How measurements are worded: query rows and keys 1-based, runs folded, what differs
between two read patterns. Pure text; the audit, diagnose's judge and learn's questions
use it."""

from __future__ import annotations

import numpy as np

from .. import masks

__all__ = [
    "spans",
    "rows_text",
    "keys_text",
    "few",
    "counted",
    "verb",
    "own_key",
    "describe_difference",
]


def spans(numbers, dash: str = "..") -> list[str]:
    """Runs of consecutive integers folded, in the order given: [2, 3, 4, 7] -> ['2..4', '7']
    (the one folding: rows_text here, the question texts of :mod:`causalattn.learn`)."""
    numbers = [int(n) for n in numbers]
    if not numbers:
        return []
    parts, start, prev = [], numbers[0], numbers[0]
    for n in numbers[1:] + [None]:
        if n is not None and n == prev + 1:
            prev = n
            continue
        parts.append(f"{start}" if start == prev else f"{start}{dash}{prev}")
        if n is not None:
            start = prev = n
    return parts


def rows_text(rows) -> str:
    """0-based rows as 1-based query numbers, ranges folded: 'rows 2..8', 'row 1'."""
    rows = [int(r) + 1 for r in rows]
    if not rows:
        return "no rows"
    parts = spans(rows)
    return (
        ("row " if len(rows) == 1 else "rows ")
        + ", ".join(parts[:6])
        + (" ..." if len(parts) > 6 else "")
    )


def keys_text(cols) -> str:
    """0-based keys as 1-based key numbers: 'key 2', 'keys 1, 4, 5 ...'."""
    cols = [int(c) + 1 for c in cols]
    return (
        ("key " if len(cols) == 1 else "keys ")
        + ", ".join(map(str, cols[:6]))
        + (" ..." if len(cols) > 6 else "")
    )


def few(x) -> str:
    """The first four numbers of ``x``, 4 significant digits: '0.5, 0.25 ...'."""
    x = np.ravel(x)
    s = ", ".join(f"{v:.4g}" for v in x[:4])
    return s + (" ..." if x.size > 4 else "")


def counted(n: int, one: str, many: str) -> str:
    """A count and its noun phrase in agreement: '1 readable row holds', '3 readable rows hold'."""
    return f"{int(n)} {one if int(n) == 1 else many}"


def verb(rows, one: str, many: str) -> str:
    """The singular or plural phrase, by how many rows (or keys) ``rows`` holds."""
    return one if len(rows) == 1 else many


def own_key(T_q: int, T_k: int) -> np.ndarray:
    """T_q×T_k bool: True at each query's own key, position i + T_k - T_q (bottom-right)."""
    diag = np.zeros((T_q, T_k), bool)
    diag[np.arange(T_q), np.arange(T_q) + T_k - T_q] = True
    return diag


def describe_difference(P: np.ndarray, E: np.ndarray, T_q: int, T_k: int) -> str:
    """What differs between a measured read pattern P and the expected E (T_q×T_k)."""
    diag = own_key(T_q, T_k)
    parts = []
    own_missing = np.flatnonzero((diag & E & ~P).any(-1))
    if own_missing.size:
        own_ok = np.flatnonzero((diag & E & P).any(-1))
        does = verb(own_missing, "does not read its", "do not read their")
        s = f"{rows_text(own_missing)} {does} own key"
        if own_ok.size:
            s += f" ({rows_text(own_ok)} {'does' if own_ok.size == 1 else 'do'})"
        parts.append(s)
    extra = P & ~E
    rows = np.flatnonzero(extra.any(-1))
    if rows.size:
        i = rows[0]
        fut = extra & ~masks.causal(T_q, T_k)
        kind = "future keys" if fut.any() else "keys they may not"
        parts.append(
            f"{rows_text(rows)} {verb(rows, 'reads', 'read')} {kind} (row {i + 1} reads "
            f"{keys_text(np.flatnonzero(extra[i]))})"
        )
    miss = E & ~P & ~diag
    rows = np.flatnonzero(miss.any(-1))
    if rows.size:
        i = rows[0]
        parts.append(
            f"{rows_text(rows)} {verb(rows, 'does not read keys it', 'do not read keys they')} "
            f"may (row {i + 1} skips "
            f"{keys_text(np.flatnonzero(miss[i]))})"
        )
    return "; ".join(parts)
