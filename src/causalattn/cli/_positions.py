"""Positions on the command line count from 1 (h_1 … h_T, sentence 1, layer 1), as in the
chapter; the Python API counts from 0. This is the one place that converts, both ways:
:func:`shown` for everything a command prints (text and JSON), :func:`given` and
:func:`given_list` for what it reads (``--query``, ``--layers``)."""

from __future__ import annotations

from ._app import _fail

BASE = 1


def shown(pos):
    """A 0-based position (an int, or a list/tuple of them, nested) as the command line
    shows it; None stays None."""
    if pos is None:
        return None
    if isinstance(pos, (list, tuple)):
        return [shown(p) for p in pos]
    return int(pos) + BASE


def given(n: int, flag: str, count: int | None = None, what: str = "position") -> int:
    """A 1-based ``n`` from ``flag`` as a 0-based index; 0 (or less), or past ``count``, is
    one ``error:`` line that says ``what``s count from 1."""
    if n < BASE or (count is not None and n > count):
        span = f"{BASE}..{count}" if count is not None else f">= {BASE}"
        _fail(f"{flag} must be a {what} {span} ({what}s count from {BASE}), got {n}")
    return n - BASE


def given_list(spec: str | None, flag: str, what: str = "layer") -> list[int] | None:
    """'1,3,5-7' -> 0-based [0, 2, 4, 5, 6]; None -> None (every one). The range against
    the model is checked by :func:`given` once its size is known."""
    if spec is None:
        return None
    out = []
    for part in spec.split(","):
        lo, dash, hi = part.strip().partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()):
            _fail(f"{flag}: {spec!r} is not a list of {what}s such as '1,3,5-7' (from {BASE})")
        for n in range(int(lo), int(hi or lo) + 1):
            out.append(given(n, flag, what=what))
    if not out:
        _fail(f"{flag}: {spec!r} names no {what}")
    return out
