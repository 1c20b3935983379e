"""The tiled CPU engine: FlashAttention-2's algorithm out of batched matrix products.

Each query block reads only the key blocks it may read: blocks above the causal diagonal,
keys past a sequence's length and other packed sequences are never touched; only blocks
that cut the diagonal or a padding edge are masked. A tile is (a chunk of heads, a query
block, a key block): B·H is fused into the batch dim of each product, as many heads per
tile as keep its scores in cache (see :func:`_plan`); grouped-query heads are stacked as
extra query rows of their key/value head, which also sums dK, dV over the group for
free. Independent tiles run on torch.get_num_threads() Python threads, each with
single-threaded torch ops (no OpenMP fork-join per small op). Softmax is online in fp32
(fp64 for fp64 inputs) and in base 2 (exp2 is the fast exponential here): a running row
max, row sum and accumulator rescaled per key block, so extra memory is
O(B·H·(block² + T·d)), never O(T_q·T_k).

Raw functions (no autograd), used by the ring-attention helper as well:

- ``fwd(p) -> (out, lse)``: out ``(B, H_q, T_q, d_v)`` in q's dtype, lse ``(B, H_q, T_q)``
  (fp32; fp64 for fp64 inputs), -inf where a row has no readable key (its out row is 0).
- ``bwd(p, out, lse, dout) -> (dq, dk, dv)``: recomputation from the GIVEN out and lse
  (D = rowsum(dout·out)), so a block pair can be differentiated against a global softmax.

Causality is a guarantee: in masked tiles, blocked weights are exactly 0 and never meet
a NaN/inf row of the other operand (0·NaN = NaN would leak an unreadable value into a
readable row); see :func:`_acc` and :func:`_nonfinite_terms`.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import torch

from .problem import Problem

NEG_INF = float("-inf")
# exp2 is about twice as fast as exp here (torch's exp goes through MKL's VML, which has no
# fast path on some CPUs): scores are kept in base 2, S₂ = S·log₂e, and P = 2^(S₂ - m₂).
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


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
TILE_ELEMS = 1 << 17  # score elements per tile (all its heads): 512 KiB in fp32, fits L2


def _plan(N: int, m: int, n: int, d: int, bwd: bool = False) -> tuple[int, int, int]:
    """(heads per tile, query block, key block) from the shape.

    A tile of about TILE_ELEMS scores stays in cache between the product that writes it,
    the softmax passes and the product that reads it. Per-head products should not be
    tiny (BLAS efficiency), so query blocks have 64 to 128 rows and key blocks 256 to 512
    columns, and as many heads share a tile as fit. The diagonal block is computed in
    full and masked, which wastes about bq/T of the work. The backward uses square blocks
    (its key blocks are shared by many query blocks).
    """
    if bwd:
        bq = bk = 128 if d <= 128 else 64
    else:
        bq, bk = (128, 256) if d <= 128 else (128, 512)
    bq, bk = max(1, min(m, bq)), max(1, min(n, bk))
    nh = max(1, min(N, TILE_ELEMS // (bq * bk)))
    if not bwd:  # few query rows (decoding): wider key blocks fill the tile instead
        bk = max(bk, min(n, TILE_ELEMS // (nh * bq)))
    return nh, bq, bk


_POOL: ThreadPoolExecutor | None = None


def _parallel(tasks: list, run, workers: int) -> list:
    """Run ``run(part)`` for parts of ``tasks`` on ``workers`` threads; each thread runs
    single-threaded torch ops. Independent tiles in Python threads (torch releases the
    GIL) avoid one OpenMP fork-join per small op, which costs dearly on a busy machine."""
    global _POOL
    parts = [tasks[i::workers] for i in range(workers)]
    parts = [p for p in parts if p] or [tasks]
    n_threads = torch.get_num_threads()

    def one(part):
        torch.set_num_threads(1)  # this thread's OpenMP and MKL: small ops stay serial
        try:
            with torch.no_grad():
                return run(part)
        finally:
            torch.set_num_threads(n_threads)

    if len(parts) == 1:
        return [one(parts[0])]
    if _POOL is None or _POOL._max_workers < len(parts):
        _POOL = ThreadPoolExecutor(len(parts), thread_name_prefix="causalattn-tiled")
    return [f.result() for f in [_POOL.submit(one, p) for p in parts]]


def _balanced(tasks: list[tuple], cost, workers: int) -> list:
    """Order tasks so that dealing them round-robin gives each worker similar work."""
    tasks = sorted(tasks, key=cost, reverse=True)
    if workers <= 1:
        return tasks
    loads = [0.0] * workers
    bins: list[list] = [[] for _ in range(workers)]
    for t in tasks:  # greedy: the next largest task to the least loaded worker
        w = loads.index(min(loads))
        bins[w].append(t)
        loads[w] += cost(t)
    out = []
    for i in range(max(len(b) for b in bins)):
        out.extend(b[i] for b in bins if i < len(b))
    return out


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


def _acc(out, A, X, X0, flag: bool | None, masked: bool):
    """out += A @ X; in a masked tile the zero weights must not meet non-finite rows of X.

    ``flag``: None when X is finite everywhere, else whether this block of X holds a
    non-finite entry (X0 is X with those zeroed)."""
    if not masked or flag is None:
        out.baddbmm_(A, X)
        return
    out.baddbmm_(A, X0)
    if flag:
        _nonfinite_terms(out, A, X)


def _allowed(a: int, a2: int, c: int, c2: int, off: int, causal: bool, kmask, cache: dict):
    """Mask of query rows a:a2 against keys c:c2: (allowed (bq, bk) bool, additive bias
    0/-inf of the same shape, whether any entry may be read), or None when all may be.

    Adding the bias is an order of magnitude cheaper than masked_fill, but NaN + -inf is
    NaN: callers add it only where the key block is finite, and masked_fill elsewhere.
    Causal-only masks depend on (a + off - c, sizes) alone and are cached.
    """
    need_causal = causal and c2 - 1 > a + off
    km = None if kmask is None else kmask[c:c2]
    if km is not None and bool(km.all()):
        km = None
    if not need_causal and km is None:
        return None
    key = (a + off - c, a2 - a, c2 - c) if km is None else None
    if key is not None and key in cache:
        return cache[key]
    if need_causal:
        dev = kmask.device if kmask is not None else None
        i = torch.arange(a, a2, device=dev)[:, None] + off
        j = torch.arange(c, c2, device=dev)[None, :]
        m = j <= i
        m = m & km if km is not None else m
    else:
        m = km.expand(a2 - a, c2 - c)
    res = (m, torch.zeros(m.shape, dtype=cache["dtype"]).masked_fill_(~m, NEG_INF), bool(m.any()))
    if key is not None:
        cache[key] = res
    return res


def _mask_scores(S: torch.Tensor, mask, finite: bool, shape) -> None:
    """Blocked scores -> -inf in place (S viewed as ``shape`` = (M, g, bq, bk))."""
    allowed, bias, _ = mask
    if finite:
        S.view(shape).add_(bias)
    else:
        S.view(shape).masked_fill_(~allowed, NEG_INF)


def _reach(a2: int, n: int, off: int, causal: bool) -> int:
    """Keys a query block ending at row a2 may reach: 0 .. reach-1."""
    return max(0, min(n, a2 + off)) if causal else n


def _tile(buf: torch.Tensor, N: int, r: int, w: int) -> torch.Tensor:
    """A contiguous (N, r, w) view at the start of a reused flat buffer."""
    return buf[: N * r * w].view(N, r, w)


def _stack(x: torch.Tensor, N: int, r: int) -> torch.Tensor:
    """(N, g, bq, e) -> (N, g·bq, e): grouped-query heads as extra rows (a view when g = 1)."""
    return x.reshape(N, r, x.shape[-1])


def _fwd_job(Q, K, V, off, causal, scale, kmask, O_out, L_out, workers):
    """Q (N, g, m, d), K (N, n, d), V (N, n, d_v) -> writes O_out (N, g, m, d_v), L_out (N, g, m).

    Tasks are (head chunk, query block); each runs its key blocks with the online softmax:
    one GEMM for the scores, the mask only where the block needs one, the row max, exp in
    place, the row sum, one GEMM into the accumulator.
    """
    N, g, m, d = Q.shape
    n, dv = K.shape[1], V.shape[2]
    nh, bq, bk = _plan(N * g, m, n, d)
    nh = max(1, nh // g)
    dt = Q.dtype
    if kmask is not None or (causal and bq > 1):  # some blocks will be masked
        V0, vflags = _finite(V, bk)
        _, kflags = _finite(K, bk)
    else:  # no mask anywhere (decoding, full attention): no zero weights to guard
        V0, vflags, kflags = V, None, None
    cache = {"dtype": dt}
    tasks = [(h, min(N, h + nh), a, min(m, a + bq)) for h in range(0, N, nh) for a in range(0, m, bq)]
    tasks = _balanced(tasks, lambda t: (t[1] - t[0]) * (t[3] - t[2]) * _reach(t[3], n, off, causal), workers)

    def run(part):
        # per-worker buffers, reused by every task: fresh allocations would page-fault
        buf = torch.empty(nh * g * bq * bk, dtype=dt)
        qbuf = torch.empty(nh * g * bq * d, dtype=dt)
        abuf = torch.empty(nh * g * bq * dv, dtype=dt)
        lbuf = torch.empty(nh * g * bq, dtype=dt)
        for h, h2, a, a2 in part:
            M, r = h2 - h, g * (a2 - a)
            qs = torch.mul(Q[h:h2, :, a:a2], scale * LOG2E, out=qbuf[: M * r * d].view(M, g, a2 - a, d))
            qs = qs.view(M, r, d)
            l = lbuf[: M * r].view(M, r)
            acc = _tile(abuf, M, r, dv)
            mx = None  # running row max; the first block read writes l, acc instead of adding
            kend = _reach(a2, n, off, causal)
            for c in range(0, kend, bk):
                c2 = min(kend, c + bk)
                mask = _allowed(a, a2, c, c2, off, causal, kmask, cache)
                if mask is not None and not mask[2]:
                    continue
                S = torch.bmm(qs, K[h:h2, c:c2].transpose(1, 2), out=_tile(buf, M, r, c2 - c))
                if mask is not None:
                    kfin = kflags is None or not kflags[c // bk]
                    _mask_scores(S, mask, kfin, (M, g, a2 - a, c2 - c))
                bm = S.amax(-1)
                m_new = bm if mx is None else torch.maximum(mx, bm)
                if mask is None and mx is not None:  # an unmasked block: every row max is finite
                    m_safe = m_new
                else:  # rows with nothing read yet subtract 0 (their scores are all -inf)
                    m_safe = m_new.masked_fill(m_new == NEG_INF, 0.0)
                S.sub_(m_safe.unsqueeze(-1)).exp2_()  # S is now P, unnormalized
                flag = None if vflags is None else vflags[c // bk]
                if mx is None:
                    torch.sum(S, -1, out=l)
                    if mask is None or flag is None:
                        torch.bmm(S, V[h:h2, c:c2], out=acc)
                    else:
                        _acc(acc.zero_(), S, V[h:h2, c:c2], V0[h:h2, c:c2], flag, True)
                else:  # rescale what earlier key blocks accumulated
                    alpha = torch.exp2(mx - m_safe)
                    l.mul_(alpha).add_(S.sum(-1))
                    acc.mul_(alpha.unsqueeze(-1))
                    _acc(acc, S, V[h:h2, c:c2], V0[h:h2, c:c2], flag, mask is not None)
                mx = m_new
            if mx is None:  # no readable key at all
                l.zero_()
                acc.zero_()
                mx = torch.full((M, r), NEG_INF, dtype=dt)
            empty = l == 0
            acc.div_(l.masked_fill(empty, 1.0).unsqueeze(-1))
            O_out[h:h2, :, a:a2] = acc.view(M, g, a2 - a, dv)
            lse = torch.log2(l).add_(mx.masked_fill(empty, 0.0)).mul_(LN2).masked_fill_(empty, NEG_INF)
            L_out[h:h2, :, a:a2] = lse.view(M, g, a2 - a)

    _parallel(tasks, run, workers)


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


def _workers(p: Problem) -> int:
    """Threads for independent tiles: torch's thread count, one for tiny problems."""
    B, H, T_q, d = p.q.shape
    work = B * H * T_q * p.k.shape[2] * (d + p.v.shape[3])
    return torch.get_num_threads() if work >= (1 << 22) else 1


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
    workers = _workers(p)
    with torch.no_grad():
        for j in jobs:
            _fwd_job(
                _job_view(q, j, Hkv), _kv(k, j), _kv(v, j), j.off, p.causal, p.scale, j.kmask,
                _job_view(out, j, Hkv), _job_view(lse, j, Hkv).squeeze(-1), workers,
            )
    return out, lse.squeeze(-1)


def _bwd_job(Q, K, V, dO, LSE, D, off, causal, scale, kmask, dQ_out, dK, dV, workers):
    """Gradients of one job: writes dQ_out (N, g, m, d), dK (N, n, d), dV (N, n, d_v).

    Tasks are (head chunk, key block): each accumulates its dK, dV block in a contiguous
    buffer over the query blocks that reach it; dQ accumulates per worker and is summed.
    """
    N, g, m, d = Q.shape
    n, dv = K.shape[1], V.shape[2]
    nh, bq, bk = _plan(N * g, m, n, d, bwd=True)
    nh = max(1, nh // g)
    dt = Q.dtype
    K0, kflags = _finite(K, bk)
    _, vflags = _finite(V, bk)
    cache = {"dtype": dt}
    blocks = list(range(0, m, bq))
    qs, qs0, qfl, do, do0, dfl, lse, lnan, Dr, dfin = ([] for _ in range(10))
    for a in blocks:
        a2 = min(m, a + bq)
        r = g * (a2 - a)
        x = _stack(Q[:, :, a:a2] * (scale * LOG2E), N, r)  # base-2 scores for P; dK·ln2 at the end
        x0, xf = _finite(x, r)  # one block: one flag for the whole query block
        y = _stack(dO[:, :, a:a2].contiguous(), N, r)
        y0, yf = _finite(y, r)
        qs.append(x)
        qs0.append(x0)
        qfl.append(None if xf is None else xf[0])
        do.append(y)
        do0.append(y0)
        dfl.append(None if yf is None else yf[0])
        L = _stack(LSE[:, :, a:a2].unsqueeze(-1), N, r)
        lse.append(L.masked_fill(L == NEG_INF, float("inf")).mul_(LOG2E))  # no key: P = 0
        lnan.append(bool(torch.isnan(L).any()))
        Dr.append(_stack(D[:, :, a:a2].unsqueeze(-1), N, r))
        # dS = P ∘ (dP - D) is 0 at blocked entries unless dP or D is non-finite there
        dfin.append(yf is None and bool(torch.isfinite(Dr[-1]).all()))
    tasks = [(h, min(N, h + nh), c, min(n, c + bk)) for h in range(0, N, nh) for c in range(0, n, bk)]

    def reached(c):  # query blocks whose rows reach key c
        return [ai for ai, a in enumerate(blocks) if _reach(min(m, a + bq), n, off, causal) > c]

    tasks = _balanced(tasks, lambda t: (t[1] - t[0]) * (t[3] - t[2]) * len(reached(t[2])), workers)

    def run(part):
        dq = [torch.zeros(N, g * (min(m, a + bq) - a), d, dtype=dt) for a in blocks]
        bufS = torch.empty(nh * g * bq * bk, dtype=dt)
        bufP = torch.empty_like(bufS)
        kbuf = torch.empty(nh * bk * d, dtype=dt)  # per-worker dK, dV block accumulators
        vbuf = torch.empty(nh * bk * dv, dtype=dt)
        for h, h2, c, c2 in part:
            M, w = h2 - h, c2 - c
            Kc, Vc, K0c = K[h:h2, c:c2], V[h:h2, c:c2], K0[h:h2, c:c2]
            kflag = None if kflags is None else kflags[c // bk]
            vfin = vflags is None or not vflags[c // bk]
            dk = _tile(kbuf, M, w, d).zero_()
            dvb = _tile(vbuf, M, w, dv).zero_()
            for ai in reached(c):
                a = blocks[ai]
                a2 = min(m, a + bq)
                mask = _allowed(a, a2, c, c2, off, causal, kmask, cache)
                if mask is not None and not mask[2]:
                    continue
                r = g * (a2 - a)
                masked = mask is not None
                shape = (M, g, a2 - a, w)
                S = torch.bmm(qs[ai][h:h2], Kc.transpose(1, 2), out=_tile(bufS, M, r, w))
                # P mixes rows into dV: its blocked entries must be exactly 0, even where a
                # query row, a key or the given lse is NaN (then the mask goes on P itself)
                fast = not kflag and not qfl[ai] and not lnan[ai]
                if masked and fast:
                    _mask_scores(S, mask, True, shape)
                P = S.sub_(lse[ai][h:h2]).exp2_()
                if masked and not fast:
                    P.view(shape).masked_fill_(~mask[0], 0.0)
                dS = torch.bmm(do[ai][h:h2], Vc.transpose(1, 2), out=_tile(bufP, M, r, w))
                dS.sub_(Dr[ai][h:h2]).mul_(P)  # dS = P ∘ (dP - D)
                if masked and not (vfin and dfin[ai]):  # P is 0 there, dP or D is not finite
                    dS.view(shape).masked_fill_(~mask[0], 0.0)
                Pt, dSt = P.transpose(1, 2), dS.transpose(1, 2)
                _acc(dvb, Pt, do[ai][h:h2], do0[ai][h:h2], dfl[ai], masked)
                _acc(dk, dSt, qs[ai][h:h2], qs0[ai][h:h2], qfl[ai], masked)
                _acc(dq[ai][h:h2], dS, Kc, K0c, kflag, masked)
            torch.mul(dk, LN2, out=dK[h:h2, c:c2])
            dV[h:h2, c:c2] = dvb
        return dq

    parts = _parallel(tasks, run, workers)
    for ai, a in enumerate(blocks):
        a2 = min(m, a + bq)
        total = parts[0][ai]
        for other in parts[1:]:
            total += other[ai]
        dQ_out[:, :, a:a2] = total.mul_(scale).view(N, g, a2 - a, d)


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
    dk = torch.zeros(k.shape, dtype=cd)  # contiguous whatever k's layout: written through views
    dv = torch.zeros(v.shape, dtype=cd)
    workers = _workers(p)
    with torch.no_grad():
        for j in jobs:
            _bwd_job(
                _job_view(q, j, Hkv), _kv(k, j), _kv(v, j), _job_view(dout, j, Hkv),
                _job_view(lse, j, Hkv).squeeze(-1), _job_view(D, j, Hkv).squeeze(-1),
                j.off, p.causal, p.scale, j.kmask,
                _job_view(dq, j, Hkv), _kv(dk, j), _kv(dv, j), workers,
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


def supports(p: Problem, return_lse: bool = False) -> bool:
    return p.is_legacy


def forward(p: Problem, return_lse: bool = False):
    """Engine entry: differentiable in q, k, v."""
    if not supports(p, return_lse):
        raise ValueError(
            f"engine 'tiled': {p.pattern.describe()} (dropout_p={p.dropout_p}) is not supported "
            "yet; use engine='reference'"
        )
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (p.q, p.k, p.v))
    if needs_grad:
        out, lse = _TiledAttention.apply(p.q, p.k, p.v, p)
    else:
        out, lse = fwd(p)
        lse = lse.float()
    return (out, lse) if return_lse else out
