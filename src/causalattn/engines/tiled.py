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


def _blocks(N: int, m: int, n: int, d: int, dv: int) -> tuple[int, int]:
    """Query and key block sizes from the shape: a score tile of about 2^21 elements."""
    budget = 1 << 21
    bk = max(1, min(n, 512))
    bq = max(1, min(m, 256, budget // max(1, N * bk)))
    return bq, bk


def _finite0(x: torch.Tensor) -> torch.Tensor:
    """A fresh copy of x with non-finite entries set to 0 (so 0·x stays 0)."""
    return torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)


def _mm_zero_safe(A: torch.Tensor, X: torch.Tensor) -> torch.Tensor:
    """``A @ X`` where an exact zero in A contributes nothing even against a NaN/inf row of X.

    A plain product would turn 0·NaN into NaN and leak an unreadable value into a readable
    row. X is multiplied with its non-finite entries zeroed; where a non-zero weight meets
    a non-finite entry, that term is added back on its own (a rare, slower path).
    """
    out = torch.bmm(A, _finite0(X))
    bad = ~torch.isfinite(X)
    if not bool(bad.any()):
        return out
    cols = bad.any(-1).any(0).nonzero().squeeze(-1)  # key rows with a non-finite entry
    Xb = torch.where(bad[:, cols], X[:, cols], 0.0)  # only the non-finite entries
    step = max(1, (1 << 22) // max(1, A.shape[0] * A.shape[1] * X.shape[-1]))
    for s in range(0, cols.numel(), step):
        a = A[:, :, cols[s : s + step]].unsqueeze(-1)  # (N, r, c, 1)
        x = Xb[:, s : s + step].unsqueeze(1)  # (N, 1, c, d)
        out += torch.where(a != 0, a * x, 0.0).sum(-2)
    return out


def _allowed(a: int, a2: int, c: int, c2: int, off: int, causal: bool, kmask) -> torch.Tensor | None:
    """Mask (bq, bk) for query rows a:a2 against keys c:c2, or None when all may be read."""
    need_causal = causal and c2 - 1 > a + off
    km = None if kmask is None else kmask[c:c2]
    if km is not None and bool(km.all()):
        km = None
    if not need_causal and km is None:
        return None
    dev = kmask.device if kmask is not None else None
    if need_causal:
        i = torch.arange(a, a2, device=dev)[:, None] + off
        j = torch.arange(c, c2, device=dev)[None, :]
        m = j <= i
        return m & km if km is not None else m
    return km.expand(a2 - a, c2 - c)


def _key_range(a2: int, n: int, off: int, causal: bool) -> int:
    """Keys a query block ending at row a2 may reach."""
    return min(n, a2 + off) if causal else n


def _fwd_tiles(Q, K, V, off, causal, scale, kmask, O_out, L_out):
    """Q (N, g, m, d), K (N, n, d), V (N, n, d_v) -> writes O_out (N, g, m, d_v), L_out (N, g, m)."""
    N, g, m, d = Q.shape
    n, dv = K.shape[1], V.shape[2]
    bq, bk = _blocks(N * g, m, n, d, dv)
    dt = Q.dtype
    for a in range(0, m, bq):
        a2 = min(m, a + bq)
        r = g * (a2 - a)
        qs = (Q[:, :, a:a2] * scale).reshape(N, r, d)
        mx = torch.full((N, r), NEG_INF, dtype=dt)
        l = torch.zeros(N, r, dtype=dt)
        acc = torch.zeros(N, r, dv, dtype=dt)
        kend = _key_range(a2, n, off, causal)
        for c in range(0, kend, bk):
            c2 = min(kend, c + bk)
            allowed = _allowed(a, a2, c, c2, off, causal, kmask)
            if allowed is not None and not bool(allowed.any()):
                continue
            S = torch.bmm(qs, K[:, c:c2].transpose(1, 2))  # (N, r, bk)
            if allowed is not None:
                S.view(N, g, a2 - a, c2 - c).masked_fill_(~allowed, NEG_INF)
            m_new = torch.maximum(mx, S.amax(-1))
            m_safe = torch.where(m_new == NEG_INF, 0.0, m_new)
            S.sub_(m_safe.unsqueeze(-1)).exp_()  # S is now P (unnormalized)
            alpha = torch.exp(mx - m_safe)
            l.mul_(alpha).add_(S.sum(-1))
            acc.mul_(alpha.unsqueeze(-1))
            if allowed is None:
                acc.baddbmm_(S, V[:, c:c2])
            else:
                acc += _mm_zero_safe(S, V[:, c:c2])
            mx = m_new
        empty = l == 0
        acc.div_(torch.where(empty, 1.0, l).unsqueeze(-1))
        O_out[:, :, a:a2] = acc.view(N, g, a2 - a, dv)
        lse = torch.where(empty, NEG_INF, torch.where(empty, 0.0, mx) + torch.log(l))
        L_out[:, :, a:a2] = lse.view(N, g, a2 - a)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _job_views(t: torch.Tensor, j: _Job, Hkv: int, rows: tuple[int, int]) -> torch.Tensor:
    """(B, H, T, e) -> job view (N, H/Hkv, rows, e) with N = batch rows · H_kv."""
    x = t[j.b0 : j.b1]
    nb, H, T, e = x.shape
    return x.reshape(nb * Hkv, H // Hkv, T, e)[:, :, rows[0] : rows[1]]


def fwd(p: Problem) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward without autograd: ``(out (B, H_q, T_q, d_v) in q's dtype, lse (B, H_q, T_q))``."""
    B, Hq, Tq, _ = p.q.shape
    Hkv, dv = p.k.shape[1], p.v.shape[3]
    cd = _compute_dtype(p.q.dtype)
    q, k, v = (t.detach().to(cd) for t in (p.q, p.k, p.v))
    out = torch.zeros(B, Hq, Tq, dv, dtype=cd, device=q.device)
    lse = torch.full((B, Hq, Tq), NEG_INF, dtype=cd, device=q.device)
    with torch.no_grad():
        for j in _jobs(p):
            Q = _job_views(q, j, Hkv, (j.q0, j.q1))
            K = _kv(k, j, Hkv)
            V = _kv(v, j, Hkv)
            O = _job_views(out, j, Hkv, (j.q0, j.q1))
            L = _job_views(lse.unsqueeze(-1), j, Hkv, (j.q0, j.q1)).squeeze(-1)
            _fwd_tiles(Q, K, V, j.off, p.causal, p.scale, j.kmask, O, L)
    return out.to(p.q.dtype), lse


def _kv(t: torch.Tensor, j: _Job, Hkv: int) -> torch.Tensor:
    """(B, H_kv, T_k, e) -> (N, n, e) for the job's batch rows and key range."""
    x = t[j.b0 : j.b1, :, j.k0 : j.k1]
    return x.reshape(-1, x.shape[2], x.shape[3])


def _bwd_tiles(Q, K, V, dO, LSE, D, off, causal, scale, kmask, dQ_out, dK, dV):
    """Gradients of one job; dQ_out (N, g, m, d) written, dK (N, n, d), dV (N, n, d_v) accumulated."""
    N, g, m, d = Q.shape
    n, dv = K.shape[1], V.shape[2]
    bq, bk = _blocks(N * g, m, n, d, dv)
    for a in range(0, m, bq):
        a2 = min(m, a + bq)
        r = g * (a2 - a)
        qs = (Q[:, :, a:a2] * scale).reshape(N, r, d)
        do = dO[:, :, a:a2].reshape(N, r, dv)
        lse = LSE[:, :, a:a2].reshape(N, r)
        lse = torch.where(lse == NEG_INF, float("inf"), lse).unsqueeze(-1)  # empty rows: P = 0
        Dr = D[:, :, a:a2].reshape(N, r).unsqueeze(-1)
        dq = torch.zeros(N, r, d, dtype=Q.dtype)
        kend = _key_range(a2, n, off, causal)
        for c in range(0, kend, bk):
            c2 = min(kend, c + bk)
            allowed = _allowed(a, a2, c, c2, off, causal, kmask)
            if allowed is not None and not bool(allowed.any()):
                continue
            Kc, Vc = K[:, c:c2], V[:, c:c2]
            S = torch.bmm(qs, Kc.transpose(1, 2))
            if allowed is not None:
                S.view(N, g, a2 - a, c2 - c).masked_fill_(~allowed, NEG_INF)
            P = S.sub_(lse).exp_()
            dP = torch.bmm(do, Vc.transpose(1, 2))
            dS = dP.sub_(Dr).mul_(P)
            if allowed is None:
                dV[:, c:c2].baddbmm_(P.transpose(1, 2), do)
                dq.baddbmm_(dS, Kc)
                dK[:, c:c2].baddbmm_(dS.transpose(1, 2), qs)
            else:
                dS.view(N, g, a2 - a, c2 - c).masked_fill_(~allowed, 0.0)
                dV[:, c:c2] += _mm_zero_safe(P.transpose(1, 2), do)
                dq += _mm_zero_safe(dS, Kc)
                dK[:, c:c2] += _mm_zero_safe(dS.transpose(1, 2), qs)
        dQ_out[:, :, a:a2] = (dq * scale).view(N, g, a2 - a, d)


def bwd(p: Problem, out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor, dlse=None):
    """FlashAttention-2 backward by recomputation from the given ``out`` and ``lse``.

    ``dout`` ``(B, H_q, T_q, d_v)``; optional ``dlse`` ``(B, H_q, T_q)`` (gradient of the
    returned log-sum-exp). Returns ``(dq, dk, dv)`` in the inputs' dtypes; dk, dv are summed
    over each query-head group (grouped-query attention).
    """
    B, Hq, Tq, _ = p.q.shape
    Hkv = p.k.shape[1]
    cd = _compute_dtype(p.q.dtype)
    q, k, v = (t.detach().to(cd) for t in (p.q, p.k, p.v))
    out, dout = out.detach().to(cd), dout.detach().to(cd)
    lse = lse.detach().to(cd)
    D = (dout * out).sum(-1)  # (B, H_q, T_q): rowsum(dO ∘ O)
    if dlse is not None:  # d lse_i / d S_ij = P_ij, so it enters as -D
        D = D - dlse.detach().to(cd)
    dq = torch.zeros_like(q)
    dk = torch.zeros_like(k)
    dv = torch.zeros_like(v)
    with torch.no_grad():
        for j in _jobs(p):
            rows = (j.q0, j.q1)
            _bwd_tiles(
                _job_views(q, j, Hkv, rows), _kv(k, j, Hkv), _kv(v, j, Hkv),
                _job_views(dout, j, Hkv, rows),
                _job_views(lse.unsqueeze(-1), j, Hkv, rows).squeeze(-1),
                _job_views(D.unsqueeze(-1), j, Hkv, rows).squeeze(-1),
                j.off, p.causal, p.scale, j.kmask,
                _job_views(dq, j, Hkv, rows), _kv(dk, j, Hkv), _kv(dv, j, Hkv),
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
