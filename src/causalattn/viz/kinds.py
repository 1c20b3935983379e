"""What the pictures share: mask cell kinds, padding positions, one trace per sequence.

A blocked cell is drawn as *padding* when its query or key is a padding position, and
as *causally blocked* otherwise (the future, or any other rule of the mask). Padding
positions are read off the mask itself (a padding query has no readable key) and the
``<PAD>`` token of :mod:`causalattn.text`, so a Trace loaded from a file is drawn the
same way as one built from sentences.
"""

from __future__ import annotations

import numpy as np

from ..trace import Trace

__all__ = ["ALLOWED", "CAUSAL", "PADDING", "KIND_NAMES", "padding_positions", "mask_kinds", "sequences"]

ALLOWED, CAUSAL, PADDING = 0, 1, 2
KIND_NAMES = ("allowed (M = 0)", "blocked: causal (M = -∞)", "blocked: padding (M = -∞)")
PAD_TOKEN = "<PAD>"  # text.PAD; repeated here so viz does not import text for a constant


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
        pad = pad | np.array([t == PAD_TOKEN for t in tokens], dtype=bool)
    return pad


def mask_kinds(allowed, pad=None) -> np.ndarray:
    """``T×T`` int8: ALLOWED, CAUSAL (blocked, no padding involved) or PADDING (blocked)."""
    a = _square(allowed, "mask kinds")
    if a.shape[0] != a.shape[1]:
        raise ValueError(f"mask kinds: self-attention mask must be T×T, got {a.shape}")
    pad = padding_positions(a) if pad is None else np.asarray(pad, dtype=bool)
    kinds = np.full(a.shape, CAUSAL, dtype=np.int8)
    kinds[pad[:, None] | pad[None, :]] = PADDING
    kinds[a] = ALLOWED
    return kinds


def sequences(tr: Trace) -> list[tuple[str, Trace]]:
    """Split a Trace along its batch axes: ``[(name, trace of one sequence)]``.

    Each returned Trace has ``A`` of shape ``T×T``, or ``(h, T, T)`` when it has heads.
    """
    if not isinstance(tr, Trace):
        raise ValueError(f"viz: expected a causalattn Trace, got {type(tr).__name__}")
    for name in ("S", "A", "V"):
        if name not in tr:
            raise ValueError(f"viz: the trace has no stage {name}; it has {tr.names}")
    A = tr["A"]
    head_axes = 1 if tr.n_heads is not None else 0
    lead = A.shape[: A.ndim - 2 - head_axes]
    if A.ndim < 2 + head_axes or A.shape[-1] != A.shape[-2]:
        raise ValueError(f"viz: A must end in T×T, got shape {A.shape}")
    if not lead:
        return [("sequence 1", tr)]
    return [
        ("sequence " + ",".join(str(i + 1) for i in idx), tr.select(*idx))
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
