"""The tiled CPU engine: FlashAttention-2's algorithm out of large batched matrix products.

Each query block reads only the key blocks it may read: blocks above the causal diagonal,
keys past a sequence's length and other packed sequences are never touched; only blocks
that cut the diagonal or a padding edge are masked. All heads of a job share one batched
product (B·H fused into the batch dim) so BLAS runs near its peak; grouped-query heads
are stacked as extra query rows of their key/value head, which also sums dK, dV over the
group for free. Softmax is online in fp32 (fp64 for fp64 inputs): a running row max m,
row sum l and accumulator rescaled per key block, so extra memory is
O(B·H·(block² + T·d)), never O(T_q·T_k).

Raw functions (no autograd), used by the ring-attention helper as well:

- ``fwd(p) -> (out, lse)``: out ``(B, H_q, T_q, d_v)`` in q's dtype, lse ``(B, H_q, T_q)``
  (fp32; fp64 for fp64 inputs), -inf where a row has no readable key (its out row is 0).
- ``bwd(p, out, lse, dout) -> (dq, dk, dv)``: recomputation from the GIVEN out and lse
  (D = rowsum(dout·out)), so a block pair can be differentiated against a global softmax.

Causality is a guarantee: products whose zero weights meet unreadable (possibly NaN or
inf) rows never multiply 0·NaN; see :func:`_mm_zero_safe`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .problem import Problem

NEG_INF = float("-inf")


@dataclass
class _Job:
    """One independent piece: batch rows ``b0:b1``, queries ``q0:q1`` against keys ``k0:k1``.

    ``off``: query row r (job-local) sits at job-local key position r + off (causal).
    ``kmask``: (k1-k0,) bool, True = may read, or None when every key in range may be read.
    """

    b0: int
    b1: int
    q0: int
    q1: int
    k0: int
    k1: int
    off: int
    kmask: torch.Tensor | None = None


def _jobs(p: Problem) -> list[_Job]:
    """Split the problem into jobs whose keys are a contiguous readable range."""
    B, _, T_q, _ = p.q.shape
    T_k = p.k.shape[2]
    off = T_k - T_q
    if p.cu_seqlens is not None:  # B == 1, T_q == T_k: each sequence on its own
        cu = p.cu_seqlens.tolist()
        return [_Job(0, 1, a, b, a, b, 0) for a, b in zip(cu, cu[1:]) if b > a]
    if p.lengths is None and p.key_padding_mask is None:
        return [_Job(0, B, 0, T_q, 0, T_k, off)] if B and T_q and T_k else []
    lengths = p.lengths.tolist() if p.lengths is not None else [T_k] * B
    kpm = p.key_padding_mask
    if kpm is None and all(L == T_k for L in lengths):
        return [_Job(0, B, 0, T_q, 0, T_k, off)] if B and T_q else []
    jobs: list[_Job] = []
    b = 0
    while b < B:
        L = lengths[b]
        km = kpm[b, :L] if kpm is not None else None
        if km is not None:
            idx = km.nonzero()
            if idx.numel() == 0:
                b += 1
                continue
            L = int(idx[-1]) + 1  # keys past the last readable one are never touched
            km = None if bool(km[:L].all()) else km[:L]
        n_q = min(T_q, lengths[b] - off)  # query i sits at position i + off; past length = padding
        e = b + 1
        if km is None:  # batch rows with the same extent share one batched job
            while e < B and lengths[e] == lengths[b] and kpm is None:
                e += 1
        if n_q > 0 and L > 0:
            jobs.append(_Job(b, e, 0, n_q, 0, L, off, km))
        b = e
    return jobs


# Block sizes (tuned on a 2-core AVX2 machine; see _blocks).
TILE_ELEMS = 1 << 20  # score elements per tile, all heads together: about 4 MiB in fp32


def _blocks(N: int, m: int, n: int, d: int, square: bool = False) -> tuple[int, int]:
    """Query and key block sizes from the shape: tiles of about TILE_ELEMS scores.

    Query blocks are a power of two from 32 to 128 rows, as large as lets all N heads
    share one tile (the diagonal, computed in full and masked, wastes bq/T of the work);
    key blocks are four times as wide in the forward (a query block clips its last one at
    its reach) and square in the backward (whose key blocks serve many query blocks).
    """
    b = 32
    while b < 128 and N * (2 * b) * (8 * b) <= TILE_ELEMS:
        b *= 2
    bq = max(1, min(m, b))
    bk = max(1, min(n, b if square else 4 * b))
    return bq, bk


def _finite(X: torch.Tensor, bs: int):
    """(X0, flags): X with non-finite entries zeroed and, per key block of size bs, whether it
    held one. The common all-finite case costs one read (a sum) and returns (X, None)."""
    if X.numel() == 0 or bool(torch.isfinite(X.sum())):
        return X, None
    bad_pos = ~torch.isfinite(X).all(-1).all(0)  # (n,)
    if not bool(bad_pos.any()):  # the sum overflowed, the entries are finite
        return X, None
    flags = [bool(bad_pos[c : c + bs].any()) for c in range(0, X.shape[1], bs)]
    return torch.nan_to_num(X, nan=0.0, posinf=0.0, neginf=0.0), flags


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


def _acc(out, A, X, X0, flags, i, masked):
    """out += A @ X; in a masked tile the zero weights must not meet non-finite rows of X."""
    if not masked or flags is None:
        out.baddbmm_(A, X)
        return
    out.baddbmm_(A, X0)
    if flags[i]:
        _nonfinite_terms(out, A, X)


def _allowed(a: int, a2: int, c: int, c2: int, off: int, causal: bool, kmask) -> torch.Tensor | None:
    """Mask (bq, bk) for query rows a:a2 against keys c:c2, or None when all may be read."""
    need_causal = causal and c2 - 1 > a + off
    km = None if kmask is None else kmask[c:c2]
    if km is not None and bool(km.all()):
        km = None
    if not need_causal and km is None:
        return None
    if need_causal:
        dev = kmask.device if kmask is not None else None
        i = torch.arange(a, a2, device=dev)[:, None] + off
        j = torch.arange(c, c2, device=dev)[None, :]
        m = j <= i
        return m & km if km is not None else m
    return km.expand(a2 - a, c2 - c)


def _reach(a2: int, n: int, off: int, causal: bool) -> int:
    """Keys a query block ending at row a2 may reach: 0 .. reach-1."""
    return max(0, min(n, a2 + off)) if causal else n


def _tile(buf: torch.Tensor, N: int, r: int, w: int) -> torch.Tensor:
    """A contiguous (N, r, w) view at the start of a reused flat buffer."""
    return buf[: N * r * w].view(N, r, w)


def _stack(x: torch.Tensor, N: int, r: int) -> torch.Tensor:
    """(N, g, bq, e) -> (N, g·bq, e): grouped-query heads as extra rows (a view when g = 1)."""
    return x.reshape(N, r, x.shape[-1])


def _fwd_tiles(Q, K, V, off, causal, scale, kmask, O_out, L_out):
    """Q (N, g, m, d), K (N, n, d), V (N, n, d_v) -> writes O_out (N, g, m, d_v), L_out (N, g, m).

    Per tile: one GEMM for the scores, the mask only where the tile needs one, the row max,
    exp in place, the row sum, one GEMM into the accumulator (online softmax, fp32).
    """
    N, g, m, d = Q.shape
    n, dv = K.shape[1], V.shape[2]
    bq, bk = _blocks(N * g, m, n, d)
    dt = Q.dtype
    V0, vflags = _finite(V, bk)
    buf = torch.empty(N * g * bq * bk, dtype=dt)
    for a in range(0, m, bq):
        a2 = min(m, a + bq)
        r = g * (a2 - a)
        qs = _stack(Q[:, :, a:a2] * scale, N, r)
        mx = torch.full((N, r), NEG_INF, dtype=dt)
        l = torch.zeros(N, r, dtype=dt)
        acc = torch.zeros(N, r, dv, dtype=dt)
        kend = _reach(a2, n, off, causal)
        for i, c in enumerate(range(0, kend, bk)):
            c2 = min(kend, c + bk)
            allowed = _allowed(a, a2, c, c2, off, causal, kmask)
            if allowed is not None and not bool(allowed.any()):
                continue
            S = torch.bmm(qs, K[:, c:c2].transpose(1, 2), out=_tile(buf, N, r, c2 - c))
            if allowed is not None:
                S.view(N, g, a2 - a, c2 - c).masked_fill_(~allowed, NEG_INF)
            m_new = torch.maximum(mx, S.amax(-1))
            m_safe = m_new.masked_fill(m_new == NEG_INF, 0.0)  # rows with nothing read yet
            S.sub_(m_safe.unsqueeze(-1)).exp_()  # S is now P, unnormalized
            if i:  # rescale what earlier key blocks accumulated
                alpha = torch.exp(mx - m_safe)
                l.mul_(alpha)
                acc.mul_(alpha.unsqueeze(-1))
            l.add_(S.sum(-1))
            _acc(acc, S, V[:, c:c2], V0[:, c:c2], vflags, i, allowed is not None)
            mx = m_new
        empty = l == 0
        acc.div_(l.masked_fill(empty, 1.0).unsqueeze(-1))
        O_out[:, :, a:a2] = acc.view(N, g, a2 - a, dv)
        lse = torch.log(l).add_(mx.masked_fill(empty, 0.0)).masked_fill_(empty, NEG_INF)
        L_out[:, :, a:a2] = lse.view(N, g, a2 - a)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _job_view(t: torch.Tensor, j: _Job, Hkv: int) -> torch.Tensor:
    """(B, H_q, T_q, e) -> job view (N, g, rows, e) with N = batch rows · H_kv."""
    x = t[j.b0 : j.b1]
    nb, H, T, e = x.shape
    return x.reshape(nb * Hkv, H // Hkv, T, e)[:, :, j.q0 : j.q1]


def _kv(t: torch.Tensor, j: _Job) -> torch.Tensor:
    """(B, H_kv, T_k, e) -> (N, n, e) for the job's batch rows and key range."""
    x = t[j.b0 : j.b1, :, j.k0 : j.k1]
    return x.reshape(-1, x.shape[2], x.shape[3])


def _covers_all(jobs: list[_Job], B: int, T_q: int) -> bool:
    return sum((j.b1 - j.b0) * (j.q1 - j.q0) for j in jobs) == B * T_q


def fwd(p: Problem) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward without autograd: ``(out (B, H_q, T_q, d_v) in q's dtype, lse (B, H_q, T_q))``.

    lse is fp32 (fp64 for fp64 inputs); -inf, with a zero out row, where no key is readable.
    """
    B, Hq, Tq, _ = p.q.shape
    Hkv, dv = p.k.shape[1], p.v.shape[3]
    cd = _compute_dtype(p.q.dtype)
    q, k, v = (t.detach().to(cd) for t in (p.q, p.k, p.v))
    jobs = _jobs(p)
    full = _covers_all(jobs, B, Tq)
    out = (torch.empty if full else torch.zeros)(B, Hq, Tq, dv, dtype=p.q.dtype, device=q.device)
    lse = torch.empty(B, Hq, Tq, 1, dtype=cd, device=q.device)
    if not full:
        lse.fill_(NEG_INF)
    with torch.no_grad():
        for j in jobs:
            _fwd_tiles(
                _job_view(q, j, Hkv), _kv(k, j), _kv(v, j), j.off, p.causal, p.scale, j.kmask,
                _job_view(out, j, Hkv), _job_view(lse, j, Hkv).squeeze(-1),
            )
    return out, lse.squeeze(-1)


def _bwd_tiles(Q, K, V, dO, LSE, D, off, causal, scale, kmask, dQ_out, dK, dV):
    """Gradients of one job: writes dQ_out (N, g, m, d), dK (N, n, d), dV (N, n, d_v).

    Key blocks outside, query blocks inside, so dK and dV accumulate in contiguous
    per-block buffers and dQ in one contiguous buffer per query block.
    """
    N, g, m, d = Q.shape
    n, dv = K.shape[1], V.shape[2]
    bq, bk = _blocks(N * g, m, n, d, square=True)
    dt = Q.dtype
    K0, kflags = _finite(K, bk)
    qs, qs0, qfl, do, do0, dfl, lse, Dr, dq = ([] for _ in range(9))
    for a in range(0, m, bq):
        a2 = min(m, a + bq)
        r = g * (a2 - a)
        x = _stack(Q[:, :, a:a2] * scale, N, r)
        x0, xf = _finite(x.transpose(0, 1), r)  # blocks over the batch dim: one flag
        y = _stack(dO[:, :, a:a2].contiguous(), N, r)
        y0, yf = _finite(y.transpose(0, 1), r)
        qs.append(x)
        qs0.append(x0.transpose(0, 1))
        qfl.append(xf)
        do.append(y)
        do0.append(y0.transpose(0, 1))
        dfl.append(yf)
        L = _stack(LSE[:, :, a:a2].unsqueeze(-1), N, r)
        lse.append(L.masked_fill(L == NEG_INF, float("inf")))  # rows with no key: P = 0
        Dr.append(_stack(D[:, :, a:a2].unsqueeze(-1), N, r))
        dq.append(torch.zeros(N, r, d, dtype=dt))
    bufS = torch.empty(N * g * bq * bk, dtype=dt)
    bufP = torch.empty_like(bufS)
    for ci, c in enumerate(range(0, n, bk)):
        c2 = min(n, c + bk)
        w = c2 - c
        Kc, Vc = K[:, c:c2], V[:, c:c2]
        dk = torch.zeros(N, w, d, dtype=dt)
        dvb = torch.zeros(N, w, dv, dtype=dt)
        for ai, a in enumerate(range(0, m, bq)):
            a2 = min(m, a + bq)
            if _reach(a2, n, off, causal) <= c:
                continue
            allowed = _allowed(a, a2, c, c2, off, causal, kmask)
            if allowed is not None and not bool(allowed.any()):
                continue
            r = g * (a2 - a)
            masked = allowed is not None
            S = torch.bmm(qs[ai], Kc.transpose(1, 2), out=_tile(bufS, N, r, w))
            if masked:
                S.view(N, g, a2 - a, w).masked_fill_(~allowed, NEG_INF)
            P = S.sub_(lse[ai]).exp_()
            dS = torch.bmm(do[ai], Vc.transpose(1, 2), out=_tile(bufP, N, r, w))
            dS.sub_(Dr[ai]).mul_(P)  # dS = P ∘ (dP - D)
            if masked:  # P is 0 there, but dP may be NaN (an unreadable v)
                dS.view(N, g, a2 - a, w).masked_fill_(~allowed, 0.0)
            Pt, dSt = P.transpose(1, 2), dS.transpose(1, 2)
            _acc(dvb, Pt, do[ai], do0[ai], dfl[ai], 0, masked)
            _acc(dk, dSt, qs[ai], qs0[ai], qfl[ai], 0, masked)
            _acc(dq[ai], dS, Kc, K0[:, c:c2], kflags, ci, masked)
        dK[:, c:c2] = dk
        dV[:, c:c2] = dvb
    for ai, a in enumerate(range(0, m, bq)):
        a2 = min(m, a + bq)
        dQ_out[:, :, a:a2] = dq[ai].mul_(scale).view(N, g, a2 - a, d)


def bwd(p: Problem, out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor, dlse=None):
    """FlashAttention-2 backward by recomputation from the given ``out`` and ``lse``.

    ``dout`` ``(B, H_q, T_q, d_v)``; optional ``dlse`` ``(B, H_q, T_q)`` (gradient of the
    returned log-sum-exp). Returns ``(dq, dk, dv)`` in the inputs' dtypes; dk, dv are summed
    over each query-head group (grouped-query attention). Rows with lse = -inf (no readable
    key) get zero gradient.
    """
    B, _, Tq, _ = p.q.shape
    Hkv = p.k.shape[1]
    cd = _compute_dtype(p.q.dtype)
    q, k, v = (t.detach().to(cd) for t in (p.q, p.k, p.v))
    dout = dout.detach().to(cd)
    lse = lse.detach().to(cd).unsqueeze(-1)
    D = (dout * out.detach().to(cd)).sum(-1, keepdim=True)  # (B, H_q, T_q, 1): rowsum(dO ∘ O)
    if dlse is not None:  # d lse_i / d S_ij = P_ij: enters as -D
        D = D - dlse.detach().to(cd).unsqueeze(-1)
    jobs = _jobs(p)
    dq = (torch.empty if _covers_all(jobs, B, Tq) else torch.zeros)(q.shape, dtype=cd)
    dk = torch.zeros_like(k)
    dv = torch.zeros_like(v)
    with torch.no_grad():
        for j in jobs:
            _bwd_tiles(
                _job_view(q, j, Hkv), _kv(k, j), _kv(v, j), _job_view(dout, j, Hkv),
                _job_view(lse, j, Hkv).squeeze(-1), _job_view(D, j, Hkv).squeeze(-1),
                j.off, p.causal, p.scale, j.kmask,
                _job_view(dq, j, Hkv), _kv(dk, j), _kv(dv, j),
            )
    return dq.to(p.q.dtype), dk.to(p.k.dtype), dv.to(p.v.dtype)


class _TiledAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, p):
        p = replace(p, q=q, k=k, v=v)
        out, lse = fwd(p)
        ctx.p = replace(p, q=None, k=None, v=None)
        ctx.save_for_backward(q, k, v, out, lse)
        return out, lse.float()

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        p = replace(ctx.p, q=q, k=k, v=v)
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv = bwd(p, out, lse, dout, dlse)
        return dq, dk, dv, None


def forward(p: Problem, return_lse: bool = False):
    """Engine entry: differentiable in q, k, v."""
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (p.q, p.k, p.v))
    if needs_grad:
        out, lse = _TiledAttention.apply(p.q, p.k, p.v, p)
    else:
        out, lse = fwd(p)
        lse = lse.float()
    return (out, lse) if return_lse else out
