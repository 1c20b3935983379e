"""What each head does, measured from its weights A: previous-token, induction and sink heads.

    roles = head_roles(capture(model, ids))   # one HeadRole per (layer, head), 0-based
    best = max(roles, key=lambda r: r.induction)
    ids = repeated_tokens(range(3, 259), n=8, length=24, seed=0, first=1)  # a probe input

The scores (docs/design.md defines them), per head, averaged over the query rows they are
defined on, over every sequence of the batch; A is the trace's, rows are queries:

- ``previous_token``: A[i, i−1], over the rows i ≥ 1 that may read key i−1;
- ``induction``: A[i, j+1], where j < i is the last earlier position holding the same token as
  i (so j+1 is the token that followed its earlier copy), over the rows whose token occurred
  before; on a repeated random sequence, those are the second repeat's rows. NaN when no
  token repeats;
- ``first_token``: A[i, f], f the first key any query may read (the first real token: the
  "attention sink"), over the rows that read a key;
- ``mean_distance``: Σ_j A_ij (i − j), how far back the head reads (0 = itself), over the
  rows that read a key;
- ``entropy``: −Σ_j A_ij log A_ij in nats (0 = one key takes all the weight; log n = spread
  evenly over n keys), over the rows that read a key.

A head's ``role`` is the name of its largest score among previous-token, induction and
first-token when that score is at least :data:`ROLE_THRESHOLD`, else "".
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

__all__ = [
    "HeadRole",
    "head_roles",
    "head_scores",
    "role_of",
    "repeated_tokens",
    "ROLE_THRESHOLD",
    "ROLES",
    "SCORES",
]

ROLE_THRESHOLD = 0.5
ROLES = {"previous_token": "previous-token", "induction": "induction", "first_token": "first-token"}
SCORES = ("previous_token", "induction", "first_token", "mean_distance", "entropy")


@dataclass(frozen=True)
class HeadRole:
    """One head's scores (module docstring); fields by attribute or by name (``r["induction"]``)."""

    layer: int  # 0-based
    head: int  # 0-based
    previous_token: float
    induction: float  # NaN when no token of the input repeats
    first_token: float
    mean_distance: float
    entropy: float
    role: str  # "previous-token", "induction", "first-token" or ""

    def __getitem__(self, name: str):
        return getattr(self, name)

    def to_dict(self) -> dict:
        return asdict(self)


def role_of(scores: dict[str, float]) -> str:
    """The role the scores give a head (module docstring): "previous-token", ... or ""."""
    finite = {k: v for k, v in scores.items() if k in ROLES and np.isfinite(v)}
    if not finite:
        return ""
    best = max(finite, key=finite.get)
    return ROLES[best] if finite[best] >= ROLE_THRESHOLD else ""


def _earlier_copy(ids) -> np.ndarray:
    """``(T,)`` the last position j < i holding the same token as i, or -1."""
    last: dict = {}
    out = np.full(len(ids), -1, dtype=np.int64)
    for i, tok in enumerate(ids):
        key = tok.item() if isinstance(tok, np.generic) else tok
        out[i] = last.get(key, -1)
        last[key] = i
    return out


def head_scores(A, readable=None, ids=None) -> dict[str, np.ndarray]:
    """The five scores of each head: ``{name: (h,) float64}``.

    A ``(B, h, T, T)``, ``(h, T, T)`` or ``(T, T)`` weights; ``readable`` the boolean mask they
    were computed with, broadcastable to A (None: every key); ``ids`` the tokens, ``(T,)`` or
    ``(B, T)`` of anything comparable (None: induction is NaN).
    """
    A = np.asarray(A, dtype=np.float64)
    A = A.reshape((1,) * (4 - A.ndim) + A.shape)  # (B, h, T, T)
    B, H, T, _ = A.shape
    R = np.ones(A.shape, bool) if readable is None else np.broadcast_to(readable, A.shape)
    rows = R.any(-1)  # (B, h, T): the queries that read a key
    i = np.arange(T)

    def mean(x, where):
        n = where.sum(axis=(0, 2))
        with np.errstate(invalid="ignore"):
            return np.where(
                n > 0, np.where(where, x, 0.0).sum(axis=(0, 2)) / np.maximum(n, 1), np.nan
            )

    prev = np.zeros((B, H, T))
    prev_ok = np.zeros((B, H, T), bool)
    prev[..., 1:] = A[..., i[1:], i[1:] - 1]
    prev_ok[..., 1:] = R[..., i[1:], i[1:] - 1]
    first = R.any(-2).argmax(-1)  # (B, h): the first key some query may read
    first_w = np.take_along_axis(A, first[:, :, None, None].repeat(T, 2), axis=-1)[..., 0]
    with np.errstate(divide="ignore", invalid="ignore"):
        plogp = np.where(R & (A > 0), A * np.log(np.where(A > 0, A, 1.0)), 0.0)
    out = {
        "previous_token": mean(prev, prev_ok),
        "first_token": mean(first_w, rows),
        "mean_distance": mean((A * (i[:, None] - i[None, :])).sum(-1), rows),
        "entropy": mean(-plogp.sum(-1), rows),
        "induction": np.full(H, np.nan),
    }
    if ids is not None:
        ids = np.asarray(ids, dtype=object).reshape(-1, T)
        if ids.shape[0] not in (1, B):
            raise ValueError(f"head_scores: ids are {ids.shape} but A has B = {B} sequences")
        j = np.stack([_earlier_copy(list(row)) for row in ids])  # (B|1, T)
        j = np.broadcast_to(j, (B, T))
        target = np.where(j >= 0, j + 1, 0)
        ind = np.take_along_axis(A, np.broadcast_to(target[:, None, :, None], (B, H, T, 1)), -1)
        ok = np.take_along_axis(R, np.broadcast_to(target[:, None, :, None], (B, H, T, 1)), -1)
        out["induction"] = mean(ind[..., 0], ok[..., 0] & (j >= 0)[:, None, :])
    return {k: out[k] for k in SCORES}


def _ids_of(tr):
    ids = getattr(tr, "ids", None)
    return ids if ids is not None else tr.tokens


def head_roles(traces) -> list[HeadRole]:
    """One :class:`HeadRole` per head of each trace, in order (layer, head); a trace's
    ``layer`` attribute (a captured one's) names its layer, else its place in the list.

    ``traces``: what :func:`causalattn.integrations.transformers.capture` returns (or any
    Traces with A, one per layer); the token ids (``tr.ids``) or else the token strings
    (``tr.tokens``) find each token's earlier copy for the induction score.
    """
    from ._trace import Trace

    traces = [traces] if isinstance(traces, Trace) else list(traces)
    if not traces:
        raise ValueError("head_roles: no traces; give the traces of a model's layers")
    out = []
    for k, tr in enumerate(traces):
        if not isinstance(tr, Trace) or "A" not in tr:
            raise ValueError(f"head_roles: item {k} is not a Trace with weights A")
        layer = getattr(tr, "layer", k)
        sc = head_scores(tr.A, tr.allowed, _ids_of(tr))
        for h in range(len(sc["entropy"])):
            one = {name: float(sc[name][h]) for name in SCORES}
            out.append(HeadRole(layer=int(layer), head=h, **one, role=role_of(one)))
    return out


def repeated_tokens(vocab, n: int, length: int, seed: int = 0, first=None) -> np.ndarray:
    """``n`` probe sequences ``(n, [1 +] 2·length)`` int64: ``length`` distinct tokens drawn at
    random from ``vocab`` (ids), then the same again; ``first`` (e.g. a BOS id) in front."""
    vocab = np.asarray(list(vocab), dtype=np.int64)
    for name, v in (("n", n), ("length", length)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"repeated_tokens: {name} must be a positive integer, got {v!r}")
    if len(vocab) < length:
        raise ValueError(
            f"repeated_tokens: length {length} needs at least {length} distinct tokens; "
            f"the vocabulary has {len(vocab)}"
        )
    rng = np.random.default_rng(seed)
    x = np.stack([rng.choice(vocab, size=length, replace=False) for _ in range(n)])
    seqs = np.concatenate([x, x], axis=1)
    if first is not None:
        seqs = np.concatenate([np.full((n, 1), int(first), np.int64), seqs], axis=1)
    return seqs
