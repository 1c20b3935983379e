"""The tiled CPU engine: FlashAttention-2's algorithm out of batched matrix products.

Who may read whom comes from the one M, ``p.pattern`` (:class:`causalattn.masks.Pattern`):
each query block reads only the key blocks inside ``Pattern.key_range``, and only tiles
that are partly readable (``Pattern.tile``) are masked. So a sliding window of w costs
O(T·w), packed documents and chunks the sum of their squares, padding nothing. Query
blocks never straddle a document, chunk or length edge. Score modifiers run in the tiles:
softcap c·tanh(S/c) (its derivative 1 - tanh² in the backward), ALiBi -slope·|i - j|; sinks
join the online softmax's denominator at the end of each row (and get their gradient from
out, lse and dout alone, :func:`sinks_grad`). Dropout regenerates each tile's keep pattern
from the seed and the tile's global (b, h, i, j) (:mod:`causalattn.dropout`), in the
forward and again in the backward: nothing T×T is stored, and every block size, thread
count and work split draws the same pattern.

A tile is (a chunk of heads, a query block, a key block): B·H is fused into the batch dim
of each product (one job per batch row when the pattern differs by row), as many heads per
tile as keep its scores in cache (see :func:`_plan`); grouped-query heads are stacked as
extra query rows of their key/value head, which also sums dK, dV over the group for
free. Independent tiles run on torch.get_num_threads() Python threads, each with
single-threaded torch ops (no OpenMP fork-join per small op); the backward's dQ partial
sums are a fixed number of lanes, so the bits do not depend on the thread count. Softmax
is online in fp32 (fp64 for fp64 inputs) and in base 2 (exp2 is the fast exponential
here): a running row max, row sum and accumulator rescaled per key block, so extra memory
is O(B·H·(block² + T·d)), never O(T_q·T_k).

Raw functions (no autograd), used by the ring-attention helper as well:

- ``fwd(p) -> (out, lse)``: out ``(B, H_q, T_q, d_v)`` in q's dtype, lse ``(B, H_q, T_q)``
  (fp32; fp64 for fp64 inputs), -inf where a row has no readable key (its out row is 0).
- ``bwd(p, out, lse, dout, dlse=None) -> (dq, dk, dv)``: recomputation from the GIVEN out
  and lse (D = rowsum(dout·out) - dlse), so a block pair can be differentiated against a
  global softmax; with dropout the same keep pattern is regenerated.

Causality is a guarantee: in masked tiles, blocked weights are exactly 0 and never meet
a NaN/inf row of the other operand (0·NaN = NaN would leak an unreadable value into a
readable row); see :func:`~.tiled_tiles._acc` and :func:`~.tiled_tiles._nonfinite_terms`.

The engine's modules: this one (the entry points, the block sizes of :func:`_plan`),
:mod:`.tiled_pool` (the threads and the split of the work), :mod:`.tiled_tiles` (which tiles
to touch, their masks, the non-finite guards), :mod:`.tiled_scores` (the score modifiers,
the per-head constants, the dropout keep pattern, the learned tensors' gradients),
:mod:`.tiled_fwd` and :mod:`.tiled_bwd` (one job's forward and backward pass).
"""

from __future__ import annotations

import sys

import torch

from . import autograd as _autograd
from .problem import Problem, compute_dtype
from .tiled_bwd import _bwd_job
from .tiled_fwd import _fwd_job
from .tiled_pool import _lanes, _workers
from .tiled_scores import _Grads, _Heads, _np
from .tiled_tiles import NEG_INF, _jobs

# Block sizes (tuned on a 2-core AVX2 machine; see _plan).
TILE_ELEMS = 1 << 17  # score elements per tile (all its heads): 512 KiB in fp32, fits L2
BLOCKS: tuple[int, int] | None = None  # (query block, key block) to force, for tests


def _plan(N: int, m: int, n: int, d: int, bwd: bool = False) -> tuple[int, int, int]:
    """(heads per tile, query block, key block) from the shape.

    A tile of about TILE_ELEMS scores stays in cache between the product that writes it,
    the softmax passes and the product that reads it. Per-head products should not be
    tiny (BLAS efficiency), so query blocks have 64 to 128 rows and key blocks 256 to 512
    columns, and as many heads share a tile as fit. Partly readable tiles are computed in
    full and masked, which wastes about bq/T of the work under a causal diagonal. The
    backward uses square blocks (its key blocks are shared by many query blocks).
    """
    if BLOCKS is not None:
        bq, bk = BLOCKS
    elif bwd:
        bq = bk = 128 if d <= 128 else 64
    else:
        bq, bk = (128, 256) if d <= 128 else (128, 512)
    bq, bk = max(1, min(m, bq)), max(1, min(n, bk))
    nh = max(1, min(N, TILE_ELEMS // (bq * bk)))
    if not bwd and BLOCKS is None:  # few query rows (decoding): wider key blocks fill the tile
        bk = max(bk, min(n, TILE_ELEMS // (nh * bq)))
    return nh, bq, bk


def _job_plan(Q: torch.Tensor, n: int, bwd: bool = False) -> tuple[int, int, int]:
    """(key/value heads per tile, query block, key block) of a job's Q (N, g, m, d) against
    n keys: :func:`_plan` for its N·g query heads, the g query heads of one key/value head
    kept in one tile."""
    N, g, m, d = Q.shape
    nh, bq, bk = _plan(N * g, m, n, d, bwd)
    return max(1, nh // g), bq, bk


def _job_view(t: torch.Tensor, b0: int, b1: int, Hkv: int) -> torch.Tensor:
    """(B, H_q, T_q, e) -> job view (N, g, T_q, e) with N = batch rows · H_kv."""
    x = t[b0:b1]
    nb, H, T, e = x.shape
    return x.reshape(nb * Hkv, H // Hkv, T, e)


def _kv(t: torch.Tensor, b0: int, b1: int) -> torch.Tensor:
    """(B, H_kv, T_k, e) -> (N, T_k, e) for the job's batch rows."""
    x = t[b0:b1]
    return x.reshape(-1, x.shape[2], x.shape[3])


def fwd(p: Problem) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward without autograd: ``(out (B, H_q, T_q, d_v) in q's dtype, lse (B, H_q, T_q))``.

    lse is fp32 (fp64 for fp64 inputs), the sink's term included; -inf, with a zero out
    row, where no key is readable.
    """
    B, Hq, Tq, _ = p.q.shape
    Hkv, dv = p.k.shape[1], p.v.shape[3]
    cd = compute_dtype(p.q.dtype)
    q, k, v = (t.detach().to(cd) for t in (p.q, p.k, p.v))
    out = torch.zeros(B, Hq, Tq, dv, dtype=p.q.dtype, device=q.device)
    lse = torch.full((B, Hq, Tq, 1), NEG_INF, dtype=cd, device=q.device)
    workers = _workers(p)
    with torch.no_grad():
        for b0, b1 in _jobs(p):
            hd = _Heads(p, b0, b1, cd)
            Q = _job_view(q, b0, b1, Hkv)
            _fwd_job(
                p,
                Q,
                _kv(k, b0, b1),
                _kv(v, b0, b1),
                hd,
                b0,
                _job_view(out, b0, b1, Hkv),
                _job_view(lse, b0, b1, Hkv).squeeze(-1),
                workers,
                _job_plan(Q, k.shape[2]),
            )
    return out, lse.squeeze(-1)


def _D(p: Problem, out, dout, dlse, cd):
    """D = rowsum(dO ∘ O) - dlse, (B, H_q, T_q, 1): the softmax's backward row term."""
    D = (dout.detach().to(cd) * out.detach().to(cd)).sum(-1, keepdim=True)
    if dlse is not None:  # d lse_i / d S_ij = P_ij: enters as -D
        D = D - dlse.detach().to(cd).unsqueeze(-1)
    return D


def bwd(p: Problem, out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor, dlse=None):
    """FlashAttention-2 backward by recomputation from the given ``out`` and ``lse``: see
    :func:`bwd_grads` (this is it without the pattern tensors' gradients)."""
    return bwd_grads(p, out, lse, dout, dlse)[:3]


def bwd_grads(p: Problem, out, lse, dout, dlse=None, want: tuple = ()):
    """FlashAttention-2 backward by recomputation from the given ``out`` and ``lse``.

    ``dout`` ``(B, H_q, T_q, d_v)``; optional ``dlse`` ``(B, H_q, T_q)`` (gradient of the
    returned log-sum-exp). Returns ``(dq, dk, dv)`` in the inputs' dtypes; dk, dv are summed
    over each query-head group (grouped-query attention). Rows with lse = -inf (no readable
    key) get zero gradient. Learned sinks: :func:`sinks_grad`. ``want``: names of the
    pattern's learned tensors ("alibi_slopes", "bias", "rel_bias", "captured": the tensors
    the score_mod reads) whose gradients come back as a dict, the fourth result; they are
    summed per part of the work and the parts in order (no atomics: the same bits on any
    thread count). A score_mod's tile is differentiated by autograd.
    """
    B, _, Tq, _ = p.q.shape
    Hkv = p.k.shape[1]
    cd = compute_dtype(p.q.dtype)
    q, k, v = (t.detach().to(cd) for t in (p.q, p.k, p.v))
    dout = dout.detach().to(cd)
    lse = lse.detach().to(cd).unsqueeze(-1)
    D = _D(p, out, dout, dlse, cd)
    dq = torch.zeros(q.shape, dtype=cd)
    dk = torch.zeros(k.shape, dtype=cd)  # contiguous whatever k's layout: written through views
    dv = torch.zeros(v.shape, dtype=cd)
    workers, lanes = _workers(p), _lanes(p)
    total = _Grads(p, None, want, None)
    with torch.no_grad():
        for b0, b1 in _jobs(p):
            hd = _Heads(p, b0, b1, cd)
            Q = _job_view(q, b0, b1, Hkv)
            _bwd_job(
                p,
                Q,
                _kv(k, b0, b1),
                _kv(v, b0, b1),
                _job_view(dout, b0, b1, Hkv),
                _job_view(lse, b0, b1, Hkv).squeeze(-1),
                _job_view(D, b0, b1, Hkv).squeeze(-1),
                hd,
                b0,
                _job_view(dq, b0, b1, Hkv),
                _kv(dk, b0, b1),
                _kv(dv, b0, b1),
                workers,
                lanes,
                want,
                total,
                _job_plan(Q, k.shape[2], bwd=True),
            )
    return dq.to(p.q.dtype), dk.to(p.k.dtype), dv.to(p.v.dtype), total.result()


def sinks_grad(p: Problem, out, lse, dout, dlse=None) -> torch.Tensor:
    """d sinks (H_q,) from the given out, lse (sink included) and dout, dlse:
    d s_h = -Σ_{b,i} exp(s_h - lse_bhi)·D_bhi, D = rowsum(dO ∘ O) - dlse (the sink is a key
    with score s_h and no value). Rows with no readable key add nothing. O(B·H·T·d)."""
    cd = torch.float64
    D = _D(p, out, dout, dlse, cd).squeeze(-1)  # (B, H, T_q)
    s = torch.as_tensor(_np(p.pattern.sinks), dtype=cd)[None, :, None]
    L = lse.detach().to(cd)
    w = torch.exp(s - L).masked_fill(torch.isneginf(L), 0.0)
    return -(w * D).sum(dim=(0, 2))


def forward(p: Problem, return_lse: bool = False):
    """Engine entry: differentiable in q, k, v and learned sinks (:mod:`.autograd`)."""
    if p.q.device.type != "cpu":
        raise ValueError(f"engine 'tiled': runs on the CPU; q is on {p.q.device}")
    return _autograd.forward(sys.modules[__name__], p, return_lse)
