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
readable row); see :func:`_acc` and :func:`_nonfinite_terms`.
"""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import torch

from . import autograd as _autograd
from .problem import LOG2E, Problem, compute_dtype

NEG_INF = float("-inf")
# exp2 is about twice as fast as exp here (torch's exp goes through MKL's VML, which has no
# fast path on some CPUs): scores are kept in base 2, S₂ = S·log₂e, and P = 2^(S₂ - m₂).
LN2 = 0.6931471805599453

# Block sizes (tuned on a 2-core AVX2 machine; see _plan).
TILE_ELEMS = 1 << 17  # score elements per tile (all its heads): 512 KiB in fp32, fits L2
BLOCKS: tuple[int, int] | None = None  # (query block, key block) to force, for tests
LANES = 4  # backward: dQ partial sums per job, a fixed number whatever the thread count


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


_POOL: ThreadPoolExecutor | None = None


def _parallel(parts: list[list], run, workers: int) -> list:
    """``[run(part) for part in parts]`` on up to ``workers`` threads, results in part order;
    each thread runs single-threaded torch ops. Independent tiles in Python threads (torch
    releases the GIL) avoid one OpenMP fork-join per small op, which costs dearly on a busy
    machine. A part's result never depends on the number of workers."""
    global _POOL
    n_threads = torch.get_num_threads()

    def one(part):
        with torch.no_grad():
            return run(part)

    workers = min(workers, len(parts))
    # torch.set_num_threads is process-wide: set once around the whole parallel region (a
    # worker restoring it while another still runs would hand that one a multi-threaded
    # reduction, whose summation order, and so whose bits, depend on the timing)
    torch.set_num_threads(1)  # OpenMP and MKL: small ops stay serial
    try:
        if workers <= 1:
            return [one(p) for p in parts]
        if _POOL is None or _POOL._max_workers < workers:
            _POOL = ThreadPoolExecutor(workers, thread_name_prefix="causalattn-tiled")
        return [f.result() for f in [_POOL.submit(one, p) for p in parts]]
    finally:
        torch.set_num_threads(n_threads)


def _balanced(tasks: list[tuple], cost, n: int) -> list[list]:
    """Deal tasks into ``n`` parts of similar cost (greedy: the next largest task to the
    least loaded part); deterministic in the tasks, whatever the thread count."""
    tasks = sorted(tasks, key=cost, reverse=True)
    n = max(1, min(n, len(tasks)))
    loads = [0.0] * n
    bins: list[list] = [[] for _ in range(n)]
    for t in tasks:
        w = loads.index(min(loads))
        bins[w].append(t)
        loads[w] += cost(t)
    return [b for b in bins if b]


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
        )
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
        t = p.pattern.tile(*p.dims, a, a2, c, c2, like=_CPU, batch=[self.b])[0]  # (H'|1, r, c)
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


class _Heads:
    """Per head chunk of a job (N = batch rows · H_kv heads, g query heads each): the query
    head indices, the batch rows, and the per-head modifier constants in base 2."""

    def __init__(self, p: Problem, b0: int, b1: int, dt):
        B, Hq, _, _ = p.dims
        Hkv, g = p.k.shape[1], p.group
        n = torch.arange((b1 - b0) * Hkv)
        self.qhead = (n % Hkv)[:, None] * g + torch.arange(g)[None, :]  # (N, g)
        self.batch = (b0 + n // Hkv)[:, None].expand(-1, g)  # (N, g)
        pt = p.pattern
        self.slopes = None
        if pt.alibi_slopes is not None:
            sl = torch.as_tensor(_np(pt.alibi_slopes), dtype=torch.float64)
            sl = sl[None].expand(B, Hq) if sl.dim() == 1 else sl
            self.slopes = (sl[self.batch, self.qhead] * LOG2E).to(dt)  # (N, g)
            self.slope_list = self.slopes.tolist()
        self.sinks = None
        if pt.sinks is not None:
            s = torch.as_tensor(_np(pt.sinks), dtype=torch.float64)
            self.sinks = (s[self.qhead] * LOG2E).to(dt)  # (N, g)
        self.softcap = None if pt.softcap is None else pt.softcap * LOG2E  # in base-2 units


def _np(x):
    return x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else x


def _dist(p: Problem, a: int, a2: int, c: int, c2: int, cache: dict, dt) -> torch.Tensor:
    """|pos(i) - j| for the tile (rows, cols) in dtype dt, from the pattern's ALiBi (unit
    slope): the same for every tile on one diagonal offset, so computed once per offset."""
    key = (a - c, a2 - a, c2 - c, dt)
    if key not in cache:
        unit = replace(p.pattern, softcap=None, sinks=None, alibi_slopes=[1.0])
        B, H, T_q, T_k = p.dims
        z = torch.zeros(1, 1, a2 - a, c2 - c, dtype=torch.float64)
        cache[key] = (-unit.modify_scores(z, a, c, T_q, T_k)[0, 0]).to(dt)
    return cache[key]


def _modify(S4: torch.Tensor, hd: _Heads, h: int, h2: int, a, a2, c, c2, p, cache, T=None):
    """softcap, then ALiBi, in place on base-2 scores S4 (M, g, rows, cols). With softcap and
    ``T`` (a buffer like S4), T receives tanh(S/c) for the backward; without T, S4 comes
    already divided by c (the forward folds 1/c into the query scale)."""
    if hd.softcap is not None:
        cap = hd.softcap
        if T is not None:
            torch.div(S4, cap, out=T).tanh_()
            torch.mul(T, cap, out=S4)
        else:
            S4.tanh_().mul_(cap)
    if hd.slopes is not None:  # one fused pass per head: S -= slope·dist
        dist = _dist(p, a, a2, c, c2, cache, S4.dtype)
        for mi, row in enumerate(hd.slope_list[h:h2]):
            for gi, slope in enumerate(row):
                S4[mi, gi].sub_(dist, alpha=slope)


def _keep(p: Problem, hd: _Heads, h, h2, a, a2, c, c2) -> torch.Tensor:
    """The dropout keep pattern of one tile, (M, g, rows, cols) bool, from global positions."""
    return p.keep(hd.batch[h:h2], hd.qhead[h:h2], a, a2, c, c2)


def _workers(p: Problem) -> int:
    """Threads for independent tiles: torch's thread count, one for tiny problems."""
    B, H, T_q, d = p.q.shape
    work = B * H * T_q * p.k.shape[2] * (d + p.v.shape[3])
    return torch.get_num_threads() if work >= (1 << 22) else 1


def _lanes(p: Problem) -> int:
    """dQ partial sums in the backward: fixed by the shape, never by the thread count, so
    the gradients are the same bits on any machine."""
    B, H, T_q, d = p.q.shape
    return LANES if B * H * T_q * p.k.shape[2] * (d + p.v.shape[3]) >= (1 << 22) else 1


# ---- forward ---------------------------------------------------------------------------------
def _fwd_job(p, Q, K, V, hd, b, O_out, L_out, workers):
    """Q (N, g, m, d), K (N, n, d), V (N, n, d_v) -> writes O_out (N, g, m, d_v), L_out (N, g, m).

    Tasks are (head chunk, query block); each runs its readable key blocks with the online
    softmax: one GEMM for the scores, the modifiers, the mask only where the tile is partly
    readable, the row max, exp in place, the row sum, dropout, one GEMM into the accumulator.
    """
    N, g, m, d = Q.shape
    n, dv = K.shape[1], V.shape[2]
    nh, bq, bk = _plan(N * g, m, n, d)
    nh = max(1, nh // g)
    dt = Q.dtype
    tiles = _Tiles(p, b, bq, bk, dt, aligned=False)
    masked_any = any(t[2] is not None for _, _, ts in tiles.blocks for t in ts)
    drop = p.dropout_p
    if masked_any or drop:  # zero weights will meet V; -inf will meet the scores
        V0, vbad = _finite(V)
        _, kbad = _finite(K)
        _, qbad = _finite(Q.reshape(N * g, m, d))
    else:  # no zero weight anywhere (decoding, full attention): nothing to guard
        V0, vbad, kbad, qbad = V, None, None, None
    dcache: dict = {}
    tasks = [(h, min(N, h + nh), ai) for h in range(0, N, nh) for ai in range(len(tiles.blocks))]
    cost = lambda t: (t[1] - t[0]) * tiles.work(t[2])  # noqa: E731

    def run(part):
        # per-worker buffers, reused by every task: fresh allocations would page-fault
        buf = torch.empty(nh * g * bq * bk, dtype=dt)
        qbuf = torch.empty(nh * g * bq * d, dtype=dt)
        abuf = torch.empty(nh * g * bq * dv, dtype=dt)
        lbuf = torch.empty(nh * g * bq, dtype=dt)
        for h, h2, ai in part:
            a, a2, row_tiles = tiles.blocks[ai]
            M, r = h2 - h, g * (a2 - a)
            qs = torch.mul(Q[h:h2, :, a:a2], scale2, out=qbuf[: M * r * d].view(M, g, a2 - a, d))
            qs = qs.view(M, r, d)
            l = lbuf[: M * r].view(M, r)  # noqa: E741
            acc = _tile(abuf, M, r, dv)
            mx = None  # running row max; the first block read writes l, acc instead of adding
            heads = hd.qhead[h:h2]
            for c, c2, mask in row_tiles:
                S = torch.bmm(qs, K[h:h2, c:c2].transpose(1, 2), out=_tile(buf, M, r, c2 - c))
                S4 = S.view(M, g, a2 - a, c2 - c)
                _modify(S4, hd, h, h2, a, a2, c, c2, p, dcache)
                if mask is not None:
                    if _flag(kbad, c, c2) or _flag(qbad, a, a2):
                        S4.masked_fill_(~mask.pick(mask.allowed, heads), NEG_INF)
                    else:  # adding is far cheaper than masked_fill; NaN + -inf would be NaN
                        S4.add_(mask.pick(mask.bias, heads))
                bm = S.amax(-1)
                m_new = bm if mx is None else torch.maximum(mx, bm)
                if mask is None and mx is not None:  # an unmasked block: every row max is finite
                    m_safe = m_new
                else:  # rows with nothing read yet subtract 0 (their scores are all -inf)
                    m_safe = m_new.masked_fill(m_new == NEG_INF, 0.0)
                S.sub_(m_safe.unsqueeze(-1)).exp2_()  # S is now P, unnormalized
                if mx is None:
                    torch.sum(S, -1, out=l)
                else:  # rescale what earlier key blocks accumulated
                    alpha = torch.exp2(mx - m_safe)
                    l.mul_(alpha).add_(S.sum(-1))
                    acc.mul_(alpha.unsqueeze(-1))
                if drop:  # the row sum counts every weight; the values only the kept ones
                    S4.mul_(_keep(p, hd, h, h2, a, a2, c, c2))
                zeros = mask is not None or drop > 0
                flag = _flag(vbad, c, c2)
                if mx is None and (not zeros or flag is None):
                    torch.bmm(S, V[h:h2, c:c2], out=acc)
                else:
                    if mx is None:
                        acc.zero_()
                    _acc(acc, S, V[h:h2, c:c2], V0[h:h2, c:c2], flag, zeros)
                mx = m_new
            if mx is None:  # no readable key at all
                l.zero_()
                acc.zero_()
                mx = torch.full((M, r), NEG_INF, dtype=dt)
            empty = l == 0
            if hd.sinks is not None:  # the sink joins the denominator: l·2^mx + 2^s
                s = hd.sinks[h:h2, :, None].expand(M, g, a2 - a).reshape(M, r)
                m2 = torch.maximum(mx, s).masked_fill_(empty, 0.0)
                alpha = torch.exp2(mx - m2)
                l.mul_(alpha).add_(torch.exp2(s - m2).masked_fill_(empty, 0.0))
                acc.mul_(alpha.unsqueeze(-1))
                mx = m2
            acc.div_(l.masked_fill(empty, 1.0).unsqueeze(-1))
            if drop:
                acc.mul_(1.0 / (1.0 - drop) if drop < 1 else 0.0)
            O_out[h:h2, :, a:a2] = acc.view(M, g, a2 - a, dv)
            lse = torch.log2(l).add_(mx.masked_fill(empty, 0.0)).mul_(LN2)
            L_out[h:h2, :, a:a2] = lse.masked_fill_(empty, NEG_INF).view(M, g, a2 - a)

    scale2 = p.scale * LOG2E / (hd.softcap or 1.0)  # softcap: S/c straight from the GEMM
    _parallel(_balanced(tasks, cost, workers), run, workers)


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
            _fwd_job(
                p,
                _job_view(q, b0, b1, Hkv),
                _kv(k, b0, b1),
                _kv(v, b0, b1),
                hd,
                b0,
                _job_view(out, b0, b1, Hkv),
                _job_view(lse, b0, b1, Hkv).squeeze(-1),
                workers,
            )
    return out, lse.squeeze(-1)


# ---- backward --------------------------------------------------------------------------------
@dataclass
class _QueryRows:
    """One query block of the backward, (N, g·rows, ·) each, prepared once for all the key
    blocks that read it: Q in base 2 (q) with its non-finite rows zeroed (q0) and whether it
    has any (q_flag: None = finite everywhere); dO likewise (dout, dout0, dout_flag); the
    lse in base 2 (+inf where no key is readable, so P = 0) and whether it holds NaN; the
    row term D, and whether dO and D are finite (then blocked entries of dS are exactly 0)."""

    q: torch.Tensor
    q0: torch.Tensor
    q_flag: bool | None
    dout: torch.Tensor
    dout0: torch.Tensor
    dout_flag: bool | None
    lse: torch.Tensor
    lse_nan: bool
    D: torch.Tensor
    d_finite: bool


def _bwd_job(p, Q, K, V, dO, LSE, D, hd, b, dQ_out, dK, dV, workers, lanes):
    """Gradients of one job: writes dQ_out (N, g, m, d), dK (N, n, d), dV (N, n, d_v).

    Tasks are (head chunk, key block): each accumulates its dK, dV block in a contiguous
    buffer over the query blocks that read it; dQ accumulates per lane (a fixed split of
    the tasks) and the lanes are summed in order.
    """
    N, g, m, d = Q.shape
    n, dv = K.shape[1], V.shape[2]
    nh, bq, bk = _plan(N * g, m, n, d, bwd=True)
    nh = max(1, nh // g)
    dt = Q.dtype
    drop = p.dropout_p
    tiles = _Tiles(p, b, bq, bk, dt, aligned=True)
    K0, kbad = _finite(K)
    _, vbad = _finite(V)
    dcache: dict = {}
    blocks = [(a, a2) for a, a2, _ in tiles.blocks]
    readers: dict[int, list] = {}  # key block start -> [(query block index, mask)]
    for ai, (_, _, ts) in enumerate(tiles.blocks):
        for c, _, mask in ts:
            readers.setdefault(c, []).append((ai, mask))
    zscale = 1.0 / (1.0 - drop) if drop < 1 else 0.0  # dropout's Z = keep / (1 - p)
    rows = []  # per query block: what every key block reading it needs (_QueryRows)
    for a, a2 in blocks:
        r = g * (a2 - a)
        x = _stack(Q[:, :, a:a2] * (p.scale * LOG2E), N, r)  # base-2 scores; dK·ln2 at the end
        x0, xb = _finite(x)
        y = _stack(dO[:, :, a:a2] * zscale if drop else dO[:, :, a:a2].contiguous(), N, r)
        y0, yb = _finite(y)
        L = _stack(LSE[:, :, a:a2].unsqueeze(-1), N, r)
        Dr = _stack(D[:, :, a:a2].unsqueeze(-1), N, r)
        rows.append(
            _QueryRows(
                q=x,
                q0=x0,
                q_flag=_flag(xb, 0, r),  # one block: one flag for the whole block
                dout=y,
                dout0=y0,
                dout_flag=_flag(yb, 0, r),
                lse=L.masked_fill(L == NEG_INF, float("inf")).mul_(LOG2E),  # no key: P = 0
                lse_nan=bool(torch.isnan(L).any()),
                D=Dr,
                # dS = P ∘ (dP - D) is 0 at blocked entries unless dP or D is non-finite there
                d_finite=yb is None and bool(torch.isfinite(Dr).all()),
            )
        )
    tasks = [(h, min(N, h + nh), c, min(n, c + bk)) for h in range(0, N, nh) for c in readers]

    def cost(t):
        return (
            (t[1] - t[0])
            * (t[3] - t[2])
            * sum(blocks[ai][1] - blocks[ai][0] for ai, _ in readers[t[2]])
        )

    soft = hd.softcap is not None

    def run(part):
        dq = [torch.zeros(N, g * (a2 - a), d, dtype=dt) for a, a2 in blocks]
        bufS = torch.empty(nh * g * bq * bk, dtype=dt)
        bufP = torch.empty_like(bufS)
        bufT = torch.empty_like(bufS) if soft else None
        kbuf = torch.empty(nh * bk * d, dtype=dt)  # per-worker dK, dV block accumulators
        vbuf = torch.empty(nh * bk * dv, dtype=dt)
        for h, h2, c, c2 in part:
            M, w = h2 - h, c2 - c
            Kc, Vc, K0c = K[h:h2, c:c2], V[h:h2, c:c2], K0[h:h2, c:c2]
            kflag = _flag(kbad, c, c2)
            vfin = not _flag(vbad, c, c2)
            dk = _tile(kbuf, M, w, d).zero_()
            dvb = _tile(vbuf, M, w, dv).zero_()
            heads = hd.qhead[h:h2]
            for ai, mask in readers[c]:
                a, a2 = blocks[ai]
                r = g * (a2 - a)
                masked = mask is not None
                shape = (M, g, a2 - a, w)
                S = torch.bmm(rows[ai].q[h:h2], Kc.transpose(1, 2), out=_tile(bufS, M, r, w))
                T = _tile(bufT, M, r, w).view(shape) if soft else None
                _modify(S.view(shape), hd, h, h2, a, a2, c, c2, p, dcache, T)
                # P mixes rows into dV: its blocked entries must be exactly 0, even where a
                # query row, a key or the given lse is NaN (then the mask goes on P itself)
                fast = not kflag and not rows[ai].q_flag and not rows[ai].lse_nan
                if masked and fast:
                    S.view(shape).add_(mask.pick(mask.bias, heads))
                P = S.sub_(rows[ai].lse[h:h2]).exp2_()
                if masked and not fast:
                    P.view(shape).masked_fill_(~mask.pick(mask.allowed, heads), 0.0)
                dS = torch.bmm(rows[ai].dout[h:h2], Vc.transpose(1, 2), out=_tile(bufP, M, r, w))
                keep = None
                if drop:  # dP ∘ Z, Z = keep / (1 - p): dO came scaled by 1 / (1 - p)
                    keep = _keep(p, hd, h, h2, a, a2, c, c2)
                    dS.view(shape).mul_(keep)
                dS.sub_(rows[ai].D[h:h2]).mul_(P)  # dS = P ∘ (dP·Z - D)
                if masked and not (
                    vfin and rows[ai].d_finite
                ):  # P is 0 there, dP or D is not finite
                    dS.view(shape).masked_fill_(~mask.pick(mask.allowed, heads), 0.0)
                if soft:  # through the cap: d tanh = 1 - tanh²
                    T.mul_(T).neg_().add_(1.0)
                    dS.view(shape).mul_(T)
                if drop:  # the values saw P ∘ Z (and dO is scaled)
                    P.view(shape).mul_(keep)
                Pt, dSt = P.transpose(1, 2), dS.transpose(1, 2)
                zeros = masked or drop > 0
                _acc(dvb, Pt, rows[ai].dout[h:h2], rows[ai].dout0[h:h2], rows[ai].dout_flag, zeros)
                _acc(dk, dSt, rows[ai].q[h:h2], rows[ai].q0[h:h2], rows[ai].q_flag, masked)
                _acc(dq[ai][h:h2], dS, Kc, K0c, kflag, masked)
            torch.mul(dk, LN2, out=dK[h:h2, c:c2])
            dV[h:h2, c:c2] = dvb
        return dq

    parts = _parallel(_balanced(tasks, cost, lanes), run, workers) if tasks else []
    for ai, (a, a2) in enumerate(blocks):
        if not parts:
            dQ_out[:, :, a:a2] = 0.0
            continue
        total = parts[0][ai]
        for other in parts[1:]:
            total += other[ai]
        dQ_out[:, :, a:a2] = total.mul_(p.scale).view(N, g, a2 - a, d)


def _D(p: Problem, out, dout, dlse, cd):
    """D = rowsum(dO ∘ O) - dlse, (B, H_q, T_q, 1): the softmax's backward row term."""
    D = (dout.detach().to(cd) * out.detach().to(cd)).sum(-1, keepdim=True)
    if dlse is not None:  # d lse_i / d S_ij = P_ij: enters as -D
        D = D - dlse.detach().to(cd).unsqueeze(-1)
    return D


def bwd(p: Problem, out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor, dlse=None):
    """FlashAttention-2 backward by recomputation from the given ``out`` and ``lse``.

    ``dout`` ``(B, H_q, T_q, d_v)``; optional ``dlse`` ``(B, H_q, T_q)`` (gradient of the
    returned log-sum-exp). Returns ``(dq, dk, dv)`` in the inputs' dtypes; dk, dv are summed
    over each query-head group (grouped-query attention). Rows with lse = -inf (no readable
    key) get zero gradient. Learned sinks: :func:`sinks_grad`.
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
    with torch.no_grad():
        for b0, b1 in _jobs(p):
            hd = _Heads(p, b0, b1, cd)
            _bwd_job(
                p,
                _job_view(q, b0, b1, Hkv),
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
            )
    return dq.to(p.q.dtype), dk.to(p.k.dtype), dv.to(p.v.dtype)


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


def refusal(f) -> str:
    """Features it cannot run ("" for every CPU call: the registry checks the device)."""
    return ""


def forward(p: Problem, return_lse: bool = False):
    """Engine entry: differentiable in q, k, v and learned sinks (:mod:`.autograd`)."""
    if p.q.device.type != "cpu":
        raise ValueError(f"engine 'tiled': runs on the CPU; q is on {p.q.device}")
    return _autograd.forward(sys.modules[__name__], p, return_lse)
