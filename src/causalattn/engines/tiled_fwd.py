"""The tiled engine's forward pass over one job: the online softmax, tile by tile. Part
of :mod:`causalattn.engines.tiled`.
"""

from __future__ import annotations

import torch

from ..constants import LN2, LOG2E
from .tiled_pool import _balanced, _parallel
from .tiled_scores import _keep, _modify
from .tiled_tiles import NEG_INF, _acc, _finite, _flag, _tile, _Tiles


def _fwd_job(p, Q, K, V, hd, b, O_out, L_out, workers, plan):
    """Q (N, g, m, d), K (N, n, d), V (N, n, d_v) -> writes O_out (N, g, m, d_v), L_out (N, g, m).

    Tasks are (head chunk, query block); each runs its readable key blocks with the online
    softmax: one GEMM for the scores, the modifiers, the mask only where the tile is partly
    readable, the row max, exp in place, the row sum, dropout, one GEMM into the accumulator.
    """
    N, g, m, d = Q.shape
    dv = V.shape[2]
    nh, bq, bk = plan  # key/value heads per tile, query block, key block (tiled._job_plan)
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
                    if _flag(kbad, c, c2) or _flag(qbad, a, a2) or hd.user:
                        S4.masked_fill_(~mask.pick(mask.allowed, heads), NEG_INF)
                    else:  # adding is far cheaper than masked_fill; NaN + -inf would be NaN
                        S4.add_(mask.pick(mask.bias, heads))
                bm = S.amax(-1)
                m_new = bm if mx is None else torch.maximum(mx, bm)
                if mask is None and mx is not None and not hd.user:  # every row max is finite
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
