"""What the pictures share: why each cell is blocked, padding positions, one trace per sequence.

Every blocked cell is drawn by its *kind*, the first reason it is blocked, with the codes of
:data:`causalattn.masks.REASONS` (0 = readable; padding, document, future, window, chunk,
mask). When a Trace carries its :class:`~causalattn.masks.Pattern` (``trace.pattern``), the
kinds are the pattern's own :meth:`~causalattn.masks.Pattern.reasons` (or the ``reasons`` the
trace recorded). A Trace with only a
boolean mask (a file, an older trace) is read as well as a mask can be: a blocked cell is
*padding* when its query or key is a padding position (a query with no readable key, or a
``<PAD>`` token), *future* when the key lies after the query, and *mask* otherwise.

The colours and labels live here, once: the matplotlib heatmaps use them and the explorer
receives them in its data.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .. import masks
from .._trace import Trace
from ..masks import CHUNK, DOCUMENT, FUTURE, MASK, MASK_MOD, PADDING, READABLE, REASONS, WINDOW
from ..text import PAD

__all__ = [
    "READABLE",
    "PADDING",
    "DOCUMENT",
    "FUTURE",
    "WINDOW",
    "CHUNK",
    "MASK",
    "KINDS",
    "Kind",
    "padding_positions",
    "mask_kinds",
    "pattern_kinds",
    "trace_kinds",
    "sequences",
    "Sequence",
]


class Kind(NamedTuple):
    """How one kind of cell is drawn: its legend label, colour, muted colour (under the value
    panels S, A, ‖A_ij v_j‖) and whether it is hatched."""

    code: int
    name: str
    label: str
    color: str
    muted: str
    hatch: bool


# One entry per masks.REASONS code, in that order. Readable cells are green on the mask;
# each blocked kind has its own hue, light enough for the value panels to stay readable.
KINDS: dict[int, Kind] = {
    k.code: k
    for k in (
        Kind(READABLE, "readable", "may read (M = 0)", "#2f9e44", "#ffffff", False),
        Kind(PADDING, "padding", "blocked: padding (M = −∞)", "#6c757d", "#9aa1a8", True),
        Kind(DOCUMENT, "document", "blocked: another document", "#9775fa", "#d0bfff", False),
        Kind(FUTURE, "future", "blocked: future, j after i", "#e9ecef", "#e4e7ea", False),
        Kind(WINDOW, "window", "blocked: outside the window", "#ffa94d", "#ffe8cc", False),
        Kind(CHUNK, "chunk", "blocked: another chunk", "#4dabf7", "#d0ebff", False),
        Kind(MASK, "mask", "blocked: by the mask", "#f783ac", "#fcc2d7", False),
        Kind(MASK_MOD, "mask_mod", "blocked: by the mask_mod", "#e599f7", "#f3d9fa", False),
    )
}
assert {c: k.name for c, k in KINDS.items()} == REASONS, "viz.kinds must follow masks.REASONS"


def _square(allowed, what: str) -> np.ndarray:
    a = np.asarray(allowed)
    if a.dtype != np.bool_ or a.ndim != 2:
        raise ValueError(
            f"{what}: the mask must be a boolean T_q×T_k matrix (True = may read), "
            f"got dtype {a.dtype} and shape {a.shape}"
        )
    return a


def padding_positions(allowed, tokens=None) -> np.ndarray:
    """``(T,)`` bool: query rows with no readable key, or ``<PAD>`` tokens."""
    a = _square(allowed, "padding")
    pad = ~a.any(axis=-1)
    if tokens is not None:
        if len(tokens) != a.shape[0]:
            raise ValueError(f"padding: {len(tokens)} tokens for a mask of {a.shape[0]} rows")
        pad = pad | np.array([t == PAD for t in tokens], dtype=bool)
    return pad


def mask_kinds(allowed, pad=None) -> np.ndarray:
    """``T_q×T_k`` uint8 kinds read off a boolean mask: READABLE, PADDING (blocked, its query or
    key is padding), FUTURE (blocked, key after the query) or MASK (blocked otherwise).

    Queries sit at key positions ``i + T_k - T_q`` (bottom-right), as in :mod:`masks`.
    """
    a = _square(allowed, "mask kinds")
    T_q, T_k = a.shape
    if T_q > T_k:
        raise ValueError(f"mask kinds: T_q={T_q} queries but only T_k={T_k} keys")
    pad = padding_positions(a) if pad is None else np.asarray(pad, dtype=bool)
    if pad.shape not in ((T_q,), (T_k,)):
        raise ValueError(f"mask kinds: pad has shape {pad.shape}, want ({T_k},)")
    pad_k = pad if pad.shape == (T_k,) else np.concatenate([np.zeros(T_k - T_q, bool), pad])
    pad_q = pad_k[T_k - T_q :]
    pos = np.arange(T_q)[:, None] + (T_k - T_q)
    kinds = np.where(np.arange(T_k)[None, :] > pos, FUTURE, MASK).astype(np.uint8)
    kinds[pad_q[:, None] | pad_k[None, :]] = PADDING
    kinds[a] = READABLE
    return kinds


def pattern_kinds(pattern: masks.Pattern, T: int, *, b: int = 0, B: int | None = None):
    """``T×T`` uint8 kinds of one sequence ``b`` of a :class:`~causalattn.masks.Pattern`
    (its :meth:`~causalattn.masks.Pattern.reasons`, first head). ``B`` defaults to the
    pattern's own batch size (its lengths), else 1."""
    if B is None:
        B = next(
            (len(v) for v in (pattern.lengths, pattern.prefix_lengths) if v is not None),
            pattern.key_padding_mask.shape[0] if pattern.key_padding_mask is not None else 1,
        )
    r = pattern.reasons(B, 1, T, T)
    return r[b if r.shape[0] > 1 else 0, 0]


def _lead_shape(tr: Trace) -> tuple[int, ...]:
    A = tr["A"]
    return A.shape[: A.ndim - 2 - (1 if tr.n_heads is not None else 0)]


def _inferred(allowed: np.ndarray, tr: Trace, lead: tuple) -> np.ndarray:
    """Kinds read off a boolean mask (padding, future, mask), per sequence."""
    T = allowed.shape[-1]
    out = np.empty(lead + (T, T), dtype=np.uint8)
    has_tokens = tr.tokens is not None and len(tr.tokens) == T
    for idx in np.ndindex(*lead):
        pad = padding_positions(allowed[idx], tr.tokens if has_tokens else None)
        out[idx] = mask_kinds(allowed[idx], pad)
    return out


def _declared(tr: Trace, lead: tuple, allowed: np.ndarray) -> np.ndarray | None:
    """The trace's recorded ``reasons``, else its ``pattern``'s, if they match ``allowed``."""
    A = tr["A"]
    T = A.shape[-1]
    r = getattr(tr, "reasons", None)
    if r is not None:
        try:
            r = np.broadcast_to(r, A.shape)
            r = r[..., 0, :, :] if tr.n_heads is not None else r
        except ValueError:
            r = None
    pat = getattr(tr, "pattern", None)
    if r is None and isinstance(pat, masks.Pattern) and len(lead) <= 1:
        try:
            r = pat.reasons(lead[0] if lead else 1, tr.n_heads or 1, T, T)[:, 0]
            r = np.broadcast_to(r if lead else r[0], lead + (T, T))
        except ValueError:
            r = None
    if r is None or not np.array_equal(r == READABLE, allowed):
        return None
    return np.array(r, dtype=np.uint8)


def trace_kinds(tr: Trace) -> np.ndarray:
    """Kinds for a Trace: ``lead + (T, T)`` uint8 (lead = its batch axes, heads excluded).

    From ``tr.reasons`` (what :func:`causalattn.trace` records), else from ``tr.pattern``,
    when their readable cells agree with ``tr.allowed``; cells they can only call "mask" (an
    explicit boolean mask), and traces with neither, are read off the boolean mask (see the
    module docstring), so padding given as a mask is still drawn as padding.
    """
    A = tr["A"]
    lead = _lead_shape(tr)
    allowed = np.ones(A.shape, bool) if tr.allowed is None else np.broadcast_to(tr.allowed, A.shape)
    if tr.n_heads is not None:
        allowed = allowed[..., 0, :, :]  # the heads share one mask (checked by the explorer)
    r = _declared(tr, lead, allowed)
    if r is None:
        return _inferred(allowed, tr, lead)
    unsure = r == MASK
    if unsure.any():
        r[unsure] = _inferred(allowed, tr, lead)[unsure]
    return r


class Sequence(NamedTuple):
    """One sequence of a Trace: its name, its Trace (no batch axes) and its ``T×T`` kinds."""

    name: str
    trace: Trace
    kinds: np.ndarray


def sequences(tr: Trace) -> list[Sequence]:
    """Split a Trace along its batch axes: ``[Sequence(name, trace, kinds)]``.

    Each returned Trace has ``A`` of shape ``T×T``, or ``(h, T, T)`` when it has heads.
    """
    if not isinstance(tr, Trace):
        raise ValueError(f"viz: expected a causalattn Trace, got {type(tr).__name__}")
    for name in ("S", "A", "V"):
        if name not in tr:
            raise ValueError(f"viz: the trace has no stage {name}; it has {tr.names}")
    A = tr["A"]
    head_axes = 1 if tr.n_heads is not None else 0
    if A.ndim < 2 + head_axes or A.shape[-1] != A.shape[-2]:
        raise ValueError(f"viz: A must end in T×T, got shape {A.shape}")
    lead = _lead_shape(tr)
    kinds = trace_kinds(tr)
    if not lead:
        return [Sequence("sequence 1", tr, kinds)]
    return [
        Sequence("sequence " + ",".join(str(i + 1) for i in idx), tr.select(*idx), kinds[idx])
        for idx in np.ndindex(*lead)
    ]


def heads(tr: Trace) -> list[Trace]:
    """The per-head traces of a one-sequence Trace (itself when it has no head axis)."""
    return tr.heads if tr.n_heads is not None else [tr]


def allowed_2d(tr: Trace) -> np.ndarray:
    """The ``T×T`` mask of a one-sequence, one-head Trace (all True when it has none)."""
    A = tr["A"]
    if tr.allowed is None:
        return np.ones(A.shape, dtype=bool)
    return np.broadcast_to(tr.allowed, A.shape).astype(bool)


def pad_of(kinds: np.ndarray) -> np.ndarray:
    """``(T,)`` bool padding positions of a ``T×T`` kinds matrix: a query row or key column
    that is padding everywhere it is blocked, and blocked as padding somewhere."""
    p = kinds == PADDING
    return p.all(axis=1) | p.all(axis=0)


def tokens_of(tr: Trace, T: int) -> list[str]:
    """The trace's tokens, or 1-based positions when it has none."""
    if tr.tokens is not None and len(tr.tokens) == T:
        return list(tr.tokens)
    return [str(i + 1) for i in range(T)]


def contribution_norms(tr: Trace) -> np.ndarray:
    """‖A_ij v_j‖ for a one-head trace: ``A_ij ‖v_j‖`` (A ≥ 0), exactly 0 where blocked."""
    A, V = tr["A"], tr["V"]
    with np.errstate(invalid="ignore", over="ignore"):
        n = A * np.linalg.norm(V, axis=-1)[..., None, :]
    return np.where(allowed_2d(tr), n, 0.0)
