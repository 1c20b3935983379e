"""Trace: the named stages of one attention computation, in dependency order.

A Trace is what :func:`causalattn.trace` returns and what :func:`causalattn.audit`
checks. Each stage keeps the seeds' symbol, its formula and its shape in the seeds'
notation, and is reachable by attribute or by name::

    tr.S, tr["A"], [st.name for st in tr]   # X, W_q, ..., Q, K, V, S, M, Z, A, H, C, O

Arrays may carry leading batch axes, and a head axis just before ``T`` when the
trace was built with ``n_heads``: ``Q`` is then ``(..., h, T, d_k)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from .masks import Pattern

__all__ = ["Stage", "Trace", "Explanation", "STAGES"]

# name -> (symbol, formula, shape in the seeds' notation). The order is the dependency order.
STAGES: dict[str, tuple[str, str, str]] = {
    "X": ("X", "token representations", "T×d_model"),
    "W_q": ("W_Q", "query weights", "d_model×d_k"),
    "W_k": ("W_K", "key weights", "d_model×d_k"),
    "W_v": ("W_V", "value weights", "d_model×d_v"),
    "Q": ("Q", "Q = X W_Q", "T×d_k"),
    "K": ("K", "K = X W_K", "T×d_k"),
    "V": ("V", "V = X W_V", "T×d_v"),
    "S": ("S", "S = Q Kᵀ / √d_k", "T×T"),
    "S_cap": ("S_cap", "S_cap = c·tanh(S / c) (softcap)", "T×T"),
    "E": ("E", "E_ij = -slope_h·|i - j| (ALiBi) + rel_bias + bias", "T×T"),
    "S_mod": ("S_mod", "S_mod = score_mod(S + E) (a function of the scores)", "T×T"),
    "M": ("M", "M_ij = 0 if j may be read, -∞ otherwise", "T×T"),
    "Z": (
        "Z",
        "Z = S + M (S_cap for S with softcap; + E with ALiBi or biases; S_mod with a score_mod)",
        "T×T",
    ),
    "A": ("A", "A = softmax_last(Z) (sinks join the denominator)", "T×T"),
    "A_drop": ("A_drop", "A with dropout: kept A_ij / (1 - p), dropped 0", "T×T"),
    "H": ("H", "H = A V", "T×d_v"),
    "C": ("C", "C[i, j] = A_ij v_j", "T×T×d_v"),
    "W_o": ("W_O", "output weights", "h·d_v×d_model"),
    "O": ("O", "O = H W_O", "T×d_model"),
}


@dataclass(frozen=True)
class Stage:
    """One named array of a Trace with its symbol, formula and seeds'-notation shape."""

    name: str
    symbol: str
    formula: str
    notation: str
    value: np.ndarray

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.value.shape)

    def __repr__(self) -> str:
        return f"Stage({self.name}: {self.formula}, {self.notation} = {self.shape})"


@dataclass(frozen=True)
class Explanation:
    """The four quantities for one query i, one row per key j.

    ``score[j] = S_ij``, ``weight[j] = A_ij``, ``value[j] = v_j``,
    ``contribution[j] = A_ij v_j`` and ``norm[j] = ‖A_ij v_j‖``; the ``rank_*`` arrays
    give each column's rank (1 = largest) among readable keys, 0 for unreadable ones.
    """

    query: int
    readable: np.ndarray  # (T,) bool
    score: np.ndarray  # (T,)
    weight: np.ndarray  # (T,)
    value: np.ndarray  # (T, d_v)
    contribution: np.ndarray  # (T, d_v)
    norm: np.ndarray  # (T,)
    rank_score: np.ndarray
    rank_weight: np.ndarray
    rank_norm: np.ndarray
    h: np.ndarray  # (d_v,) = sum_j contribution[j]
    blocked_by: tuple[str, ...] = ()  # per key: "" if readable, else why (future, window, ...)

    def _why(self, j: int) -> str:
        if self.readable[j]:
            return ""
        return self.blocked_by[j] if self.blocked_by else "blocked"

    def rows(self) -> list[dict]:
        """One dict per key j, for tables and JSON."""
        out = []
        for j in range(len(self.readable)):
            out.append(
                {
                    "key": j,
                    "readable": bool(self.readable[j]),
                    "blocked_by": self._why(j),
                    "score": float(self.score[j]),
                    "weight": float(self.weight[j]),
                    "value": self.value[j].tolist(),
                    "contribution": self.contribution[j].tolist(),
                    "norm": float(self.norm[j]),
                    "rank_score": int(self.rank_score[j]),
                    "rank_weight": int(self.rank_weight[j]),
                    "rank_norm": int(self.rank_norm[j]),
                }
            )
        return out

    def __str__(self) -> str:
        return self.format()

    def format(self, base: int = 0) -> str:
        """The table as text; positions counted from ``base`` (0 as in Python, 1 as the CLI)."""
        lines = [f"query i={self.query + base}: h_i = {np.array2string(self.h, precision=3)}"]
        lines.append("  j  S_ij      A_ij     ‖A_ij v_j‖  ranks(S,A,‖·‖)  v_j")
        for r in self.rows():
            if not r["readable"]:
                lines.append(
                    f"{r['key'] + base:>3}  (blocked: {r['blocked_by']}; weight exactly 0)"
                )
                continue
            lines.append(
                f"{r['key'] + base:>3}  {r['score']:>8.3f}  {r['weight']:>7.3f}  {r['norm']:>10.3f}"
                f"  {r['rank_score']:>4} {r['rank_weight']:>3} {r['rank_norm']:>3}"
                f"     {np.array2string(self.value[r['key']], precision=3)}"
            )
        return "\n".join(lines)


def _kept(a, dtype):
    """An array as kept by a Trace: None, a function computing it on each read, or an array."""
    return a if a is None or callable(a) else np.asarray(a, dtype=dtype)


def _read(a, dtype):
    return np.asarray(a(), dtype=dtype) if callable(a) else a


def _rank(x: np.ndarray, readable: np.ndarray) -> np.ndarray:
    """1 = largest among readable entries; 0 where unreadable."""
    r = np.zeros(x.shape, dtype=np.int64)
    idx = np.flatnonzero(readable)
    order = idx[np.argsort(-x[idx], kind="stable")]
    r[order] = np.arange(1, len(order) + 1)
    return r


class Trace:
    """Named stages of attention in dependency order (see module docstring).

    ``arrays`` maps stage names (keys of :data:`STAGES`) to arrays; any subset may be
    present. ``allowed`` is the boolean mask (True = may read) the stages were built
    with; ``scale`` the factor applied to Q Kᵀ; ``n_heads`` is set when the arrays carry
    a head axis; ``tokens`` optionally labels the T positions. ``pattern`` is the declared
    :class:`causalattn.masks.Pattern` and ``reasons`` (uint8, shaped like ``allowed``) says
    why each blocked cell is blocked (:data:`causalattn.masks.REASONS`).

    A stage, ``allowed`` or ``reasons`` may also be given as a function of no arguments:
    it is then computed on each read and never kept (a captured model layer's T×T stages,
    which would not fit in memory for every layer at once).
    """

    def __init__(
        self,
        arrays: dict[str, np.ndarray],
        *,
        allowed: np.ndarray | None = None,
        scale: float | None = None,
        n_heads: int | None = None,
        tokens: list[str] | None = None,
        pattern: Pattern | None = None,
        reasons: np.ndarray | None = None,
    ):
        unknown = set(arrays) - set(STAGES)
        if unknown:
            raise ValueError(f"trace: unknown stage names {sorted(unknown)}; known: {list(STAGES)}")
        self._arrays = {k: _kept(arrays[k], None) for k in STAGES if k in arrays}
        self._allowed = _kept(allowed, bool)
        self.scale = scale
        self.n_heads = n_heads
        self.tokens = None if tokens is None else [str(t) for t in tokens]
        self.pattern = pattern
        self._reasons = _kept(reasons, np.uint8)

    @property
    def allowed(self) -> np.ndarray | None:
        """The boolean mask the stages were built with (True = may read), or None."""
        return _read(self._allowed, bool)

    @property
    def reasons(self) -> np.ndarray | None:
        """Why each blocked cell is blocked (uint8 codes of ``masks.REASONS``), or None."""
        return _read(self._reasons, np.uint8)

    # -- access -----------------------------------------------------------------
    def __contains__(self, name: str) -> bool:
        return name in self._arrays

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self._arrays:
            raise KeyError(f"trace has no stage {name!r}; it has {list(self._arrays)}")
        return _read(self._arrays[name], None)

    def __getattr__(self, name: str) -> np.ndarray:
        if name.startswith("_"):
            raise AttributeError(name)
        arrays = self.__dict__.get("_arrays", {})
        if name in arrays:
            return self[name]
        raise AttributeError(f"trace has no stage {name!r}; it has {list(arrays)}")

    def stage(self, name: str) -> Stage:
        """The stage ``name`` (``"A"``, ...): its symbol, formula and array (``(..., T, T)``
        for S, M, Z, A)."""
        symbol, formula, notation = STAGES[name]
        return Stage(name, symbol, formula, notation, self[name])

    def __iter__(self):
        return (self.stage(n) for n in self._arrays)

    @property
    def names(self) -> list[str]:
        """The names of the stages this trace holds, in dependency order."""
        return list(self._arrays)

    def __repr__(self) -> str:
        parts = ", ".join(f"{n}{tuple(self[n].shape)}" for n in self._arrays)
        return f"Trace({parts})"

    def select(self, *index: int) -> Trace:
        """The trace of one sequence / head: ``tr.select(b, h)`` indexes the leading axes.

        Stages without those axes (the weights) are kept as they are; ``O`` mixes heads
        and is dropped from a per-head selection.
        """
        arrays = {}
        n = len(index)
        lead = self["A"].ndim - 2 if "A" in self else None
        head_pick = self.n_heads is not None and lead is not None and n == lead
        for name in self._arrays:
            a = self[name]
            if name.startswith("W_"):
                arrays[name] = a
                continue
            if name in ("O", "X") and self.n_heads is not None:
                if head_pick:
                    if name == "X":
                        arrays[name] = a[index[:-1]]
                    continue
                arrays[name] = a[index]
                continue
            # a stage that broadcasts over an axis (E is (1, h, T, T) beside a batch) keeps it
            arrays[name] = a[tuple(0 if a.shape[k] == 1 else i for k, i in enumerate(index))]
        want = (lead if lead is not None else n) + 2

        def pick(a):  # index the leading axes of a mask-shaped array, broadcasting 1s
            if a is None:
                return None
            a = a.reshape((1,) * (want - a.ndim) + a.shape)
            return a[tuple(0 if a.shape[k] == 1 else i for k, i in enumerate(index))]

        n_heads = None if head_pick or self.n_heads is None else self.n_heads
        return Trace(
            arrays,
            allowed=pick(self.allowed),
            scale=self.scale,
            n_heads=n_heads,
            tokens=self.tokens,
            pattern=self.pattern,
            reasons=pick(self.reasons),
        )

    @property
    def heads(self) -> list[Trace]:
        """Each head as its own Trace (single sequence traces only)."""
        if self.n_heads is None:
            return [self]
        if self["A"].ndim != 3:
            raise ValueError("trace.heads: select a sequence first, e.g. tr.select(b).heads")
        return [self.select(h) for h in range(self.n_heads)]

    # -- the four quantities --------------------------------------------------------
    def explain(self, i: int) -> Explanation:
        """Score S_ij, weight A_ij, value v_j and contribution A_ij v_j for query i (0-based).

        Works on a single sequence and head; use :meth:`select` first otherwise.
        """
        if isinstance(i, bool) or not isinstance(i, (int, np.integer)):
            raise ValueError(f"explain: query i must be an integer, got {i!r}")
        A, V, S = self["A"], self["V"], self["S"]
        if A.ndim != 2:
            raise ValueError(
                f"explain: A has leading axes {A.shape[:-2]}; select one sequence/head first "
                "with trace.select(...)"
            )
        T = A.shape[0]
        if isinstance(i, bool) or not isinstance(i, (int, np.integer)):
            raise ValueError(f"explain: query i must be an integer 0..{T - 1}, got {i!r}")
        i = int(i)
        if not (0 <= i < T):
            raise ValueError(f"explain: query i={i} is outside 0..{T - 1} (A is {T}×{A.shape[1]})")
        readable = (
            np.ones(A.shape[1], bool)
            if self.allowed is None
            else np.broadcast_to(self.allowed, A.shape)[i]
        )
        weights = self["A_drop"] if "A_drop" in self else A  # what H really read
        contribution = np.where(readable[:, None], weights[i][:, None] * V, 0.0)
        why = ()
        if self.reasons is not None:
            from .masks import REASONS

            codes = np.broadcast_to(self.reasons, A.shape)[i]
            pat = getattr(self, "pattern", None)
            name = pat.reason_name if pat is not None else (lambda c: REASONS[int(c)])
            why = tuple("" if c == 0 else name(int(c)) for c in codes)
        norm = np.linalg.norm(contribution, axis=-1)
        score = np.where(readable, S[i], np.nan)
        return Explanation(
            query=i,
            readable=readable.copy(),
            score=score,
            weight=A[i].copy(),
            value=V.copy(),
            contribution=contribution,
            norm=norm,
            rank_score=_rank(np.nan_to_num(score, nan=-np.inf), readable),
            rank_weight=_rank(A[i], readable),
            rank_norm=_rank(norm, readable),
            h=contribution.sum(axis=0),
            blocked_by=why,
        )

    # -- files ----------------------------------------------------------------------
    def save(self, path: str | Path) -> None:
        """Write a .npz of named arrays (no pickled objects)."""
        extra: dict[str, np.ndarray] = {}
        if self.allowed is not None:
            extra["allowed"] = self.allowed
        if self.reasons is not None:
            extra["reasons"] = self.reasons
        if self.scale is not None:
            extra["scale"] = np.asarray(self.scale, dtype=np.float64)
        if self.n_heads is not None:
            extra["n_heads"] = np.asarray(self.n_heads, dtype=np.int64)
        if self.tokens is not None:
            extra["tokens"] = np.asarray(self.tokens, dtype=str)
        np.savez(Path(path), **{n: self[n] for n in self._arrays}, **extra)

    @classmethod
    def load(cls, path: str | Path, max_bytes: int = 2**30) -> Trace:
        """Read a .npz written by :meth:`save` with the one reader of user files
        (:mod:`causalattn.io.files`: headers first, ``max_bytes`` for all arrays,
        numbers only, ``tokens`` as text; nothing executed), then :meth:`from_arrays`."""
        from .io.files import read_arrays

        try:
            data = read_arrays(path, max_bytes, formats=("npz",), text=("tokens",))
        except ValueError as exc:
            raise ValueError(f"trace file cannot be read: {exc}") from None
        return cls.from_arrays(data)

    @classmethod
    def from_arrays(cls, data: dict) -> Trace:
        """A Trace from the named arrays :meth:`save` writes (stages, ``allowed``,
        ``reasons``, ``scale``, ``n_heads``, ``tokens``); other names are ignored."""
        arrays = {k: v for k, v in data.items() if k in STAGES}
        tokens = data.get("tokens")
        if tokens is not None and np.ndim(tokens) != 1:
            raise ValueError(f"trace file: tokens must be 1-D, got shape {np.shape(tokens)}")
        try:
            return cls(
                arrays,
                allowed=data.get("allowed"),
                reasons=data.get("reasons"),
                scale=float(data["scale"]) if "scale" in data else None,
                n_heads=int(data["n_heads"]) if "n_heads" in data else None,
                tokens=np.asarray(tokens).tolist() if tokens is not None else None,
            )
        except TypeError as exc:  # a scale or n_heads that is not one number
            raise ValueError(
                f"trace file: scale and n_heads must be single numbers ({exc})"
            ) from None
