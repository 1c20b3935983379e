"""Which tiles the tiled engine touches, and their masks (from the one M), with the guards
that keep a blocked weight from meeting a non-finite value (0·NaN = NaN). Part of
:mod:`causalattn.engines.tiled`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .problem import Problem

NEG_INF = float("-inf")
# exp2 is about twice as fast as exp here (torch's exp goes through MKL's VML, which has no
# fast path on some CPUs): scores are kept in base 2, S₂ = S·log₂e, and P = 2^(S₂ - m₂)
# (LOG2E, LN2: causalattn.constants).


# ---- non-finite guards ---------------------------------------------------------------------
def _finite(X: torch.Tensor):
    """(X0, bad): X with non-finite entries zeroed and the prefix count of positions along
    axis 1 holding one ((n+1,) int64), or (X, None) when all is finite (one read: a sum)."""
    if X.numel() == 0 or bool(torch.isfinite(X.sum())):
        return X, None
    bad_pos = ~torch.isfinite(X).all(-1).all(0)  # (n,)
    if not bool(bad_pos.any()):  # the sum overflowed, the entries are finite
        return X, None
    cum = torch.zeros(bad_pos.numel() + 1, dtype=torch.int64)
    torch.cumsum(bad_pos.cpu(), 0, out=cum[1:])
    return torch.nan_to_num(X, nan=0.0, posinf=0.0, neginf=0.0), cum


def _flag(bad, c: int, c2: int) -> bool | None:
    """None when the whole operand is finite, else whether positions c:c2 hold a non-finite."""
    return None if bad is None else bool(bad[c2] > bad[c])


def _nonfinite_terms(out: torch.Tensor, A: torch.Tensor, X: torch.Tensor) -> None:
    """out += A @ X restricted to X's non-finite entries, where an exact 0 in A adds nothing.

    The product with the zeroed X0 gave every finite term; this adds the rest without
    ever forming 0·NaN, so an unreadable NaN/inf never reaches a readable row.
    """
    bad = ~torch.isfinite(X)
    cols = bad.any(-1).any(0).nonzero().squeeze(-1)
    Xb = torch.where(bad[:, cols], X[:, cols], 0.0)
    step = max(1, (1 << 22) // max(1, A.shape[0] * A.shape[1] * X.shape[-1]))
    for s in range(0, cols.numel(), step):
        a = A[:, :, cols[s : s + step]].unsqueeze(-1)  # (N, r, c, 1)
        x = Xb[:, s : s + step].unsqueeze(1)  # (N, 1, c, e)
        out += torch.where(a != 0, a * x, 0.0).sum(-2)


def _acc(out, A, X, X0, flag: bool | None, masked: bool):
    """out += A @ X; where A has exact zeros (masked tile, dropout) they must not meet
    non-finite rows of X. ``flag``: None when X is finite everywhere, else whether this
    block of X holds a non-finite entry (X0 is X with those zeroed)."""
    if not masked or flag is None:
        out.baddbmm_(A, X)
        return
    out.baddbmm_(A, X0)
    if flag:
        _nonfinite_terms(out, A, X)


def _tile(buf: torch.Tensor, N: int, r: int, w: int) -> torch.Tensor:
    """A contiguous (N, r, w) view at the start of a reused flat buffer."""
    return buf[: N * r * w].view(N, r, w)


def _stack(x: torch.Tensor, N: int, r: int) -> torch.Tensor:
    """(N, g, bq, e) -> (N, g·bq, e): grouped-query heads as extra rows (a view when g = 1)."""
    return x.reshape(N, r, x.shape[-1])


# ---- which tiles to touch, and their masks (from the one M) ---------------------------------
@dataclass
class _Mask:
    """A partly readable tile: ``allowed`` (H'|1, rows, cols) bool and ``bias`` (0 / -inf,
    same shape, compute dtype). H' = H_q when the dense mask differs by head."""

    allowed: torch.Tensor
    bias: torch.Tensor

    def pick(self, x: torch.Tensor, heads: torch.Tensor | None) -> torch.Tensor:
        """x (bias or allowed) for a head chunk: (M, g, rows, cols), or (rows, cols)."""
        return x[0] if heads is None or x.shape[0] == 1 else x[heads]


class _Tiles:
    """The tiles of one job (batch rows b0:b1 sharing one pattern): per query block, its
    readable key blocks with a mask for the partly readable ones (None = fully readable).

    Only what the pattern allows is listed: key blocks outside ``Pattern.key_range`` are
    never touched, so a window costs O(T·w) and documents or chunks the sum of their squares.
    Tiles of patterns that look the same along every diagonal (causal, window) are computed
    once per offset and shared.
    """

    def __init__(self, p: Problem, b: int, bq: int, bk: int, dt: torch.dtype, aligned: bool):
        pt = p.pattern
        B, H, T_q, T_k = p.dims
        self.p, self.b, self.dt = p, b, dt
        shift = not (
            pt.per_batch
            or pt.per_head
            or pt.mask is not None
            or pt.chunk
            or pt.cu_seqlens is not None
            or pt.prefix_lengths is not None
            or pt.mask_mod is not None
        )
        self.table = self.rest = None
        if pt.mask_mod is not None:  # its cells from the kept table (evaluated once, kept)
            from dataclasses import replace

            from ..masks_table import kept

            qs, ks = pt.query_start(T_q, T_k), pt.k_start
            self.table = kept(pt.mask_mod, B, H, bq, bk, qs, ks)
            self.rest, self.qs, self.ks = replace(pt, mask_mod=None), qs, ks
        cache: dict = {}
        self.blocks = []  # per query block: (a, a2, [(c, c2, _Mask | None), ...])
        for a, a2 in _row_blocks(p, b, bq):
            lo, hi = pt.key_range(b, a, a2, T_q, T_k)
            tiles = []
            if hi > lo:
                c = lo // bk * bk if aligned else lo
                while c < hi:
                    c2 = min(T_k if aligned else hi, c + bk)
                    key = (a - c, a2 - a, c2 - c) if shift else None
                    kind = cache.get(key) if key is not None else None
                    if kind is None:
                        kind = self._kind(a, a2, c, c2)
                        if key is not None:
                            cache[key] = kind
                    if kind != "skip":
                        tiles.append((c, c2, kind))
                    c = c2
            self.blocks.append((a, a2, tiles))

    def _kind(self, a, a2, c, c2):
        p = self.p
        if self.table is None:
            t = p.pattern.tile(*p.dims, a, a2, c, c2, like=_CPU, batch=[self.b])[0]  # (H'|1, r, c)
        else:
            t = self.rest.tile(*p.dims, a, a2, c, c2, like=_CPU, batch=[self.b])[0]
            t = t & self.table.cells(self.b, self.qs + a, self.qs + a2, self.ks + c, self.ks + c2)
        if bool(t.all()):
            return None
        if not bool(t.any()):
            return "skip"
        bias = torch.zeros(t.shape, dtype=self.dt).masked_fill_(~t, NEG_INF)
        return _Mask(t, bias)

    def work(self, ai: int) -> int:
        a, a2, tiles = self.blocks[ai]
        return (a2 - a) * sum(c2 - c for c, c2, _ in tiles)


_CPU = torch.zeros(())
MIN_PIECE = 32  # chunks shorter than this are masked inside blocks rather than cut out


def _row_blocks(p: Problem, b: int, bq: int) -> list[tuple[int, int]]:
    """Query blocks of at most bq rows that never straddle a document, a chunk, the end of
    a prefix or of a sequence's length: a block on both sides of such an edge would read
    (and mask) the union of both sides' keys."""
    pt = p.pattern
    B, H, T_q, T_k = p.dims
    qs = pt.query_start(T_q, T_k)
    edges = set()  # key positions where the readable set changes
    cu = pt.cu_seqlens
    starts = [0] if cu is None else [int(x) for x in cu[:-1]]
    ends = [qs + T_q] if cu is None else [int(x) for x in cu[1:]]
    edges.update(starts)
    if pt.chunk is not None and pt.chunk >= MIN_PIECE:
        for s0, e0 in zip(starts, ends):
            edges.update(range(s0, e0, pt.chunk))
    for v in (pt.lengths, pt.prefix_lengths):
        if v is not None:
            edges.add(int(v[b]))
    cuts = sorted({0, T_q} | {x - qs for x in edges if 0 < x - qs < T_q})
    out = []
    for s0, e0 in zip(cuts, cuts[1:]):
        n = -(-(e0 - s0) // bq)  # pieces of equal size, at most bq rows
        out.extend((s0 + (e0 - s0) * i // n, s0 + (e0 - s0) * (i + 1) // n) for i in range(n))
    return out


def _jobs(p: Problem) -> list[tuple[int, int]]:
    """Batch row ranges that share one pattern (all rows, unless it differs by row)."""
    B = p.q.shape[0]
    if B == 0:
        return []
    return [(b, b + 1) for b in range(B)] if p.pattern.per_batch else [(0, B)]
