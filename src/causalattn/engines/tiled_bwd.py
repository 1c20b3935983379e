"""The tiled engine's backward pass over one job: FlashAttention-2's recomputation, key
block by key block. Part of :mod:`causalattn.engines.tiled`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..constants import LN2, LOG2E
from .tiled_pool import _balanced, _parallel
from .tiled_scores import _Grads, _keep, _modify
from .tiled_tiles import NEG_INF, _acc, _finite, _flag, _stack, _tile, _Tiles


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


def _bwd_job(
    p, Q, K, V, dO, LSE, D, hd, b, dQ_out, dK, dV, workers, lanes, want, total_grads, plan
):
    """Gradients of one job: writes dQ_out (N, g, m, d), dK (N, n, d), dV (N, n, d_v).

    Tasks are (head chunk, key block): each accumulates its dK, dV block in a contiguous
    buffer over the query blocks that read it; dQ accumulates per lane (a fixed split of
    the tasks) and the lanes are summed in order.
    """
    N, g, m, d = Q.shape
    n, dv = K.shape[1], V.shape[2]
    nh, bq, bk = plan  # key/value heads per tile, query block, key block (tiled._job_plan)
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
        grads = _Grads(p, hd, want, dcache)  # this part's sums
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
                tape = _modify(S.view(shape), hd, h, h2, a, a2, c, c2, p, dcache, T, grad=True)
                # P mixes rows into dV: its blocked entries must be exactly 0, even where a
                # query row, a key or the given lse is NaN (then the mask goes on P itself)
                fast = not kflag and not rows[ai].q_flag and not rows[ai].lse_nan and not hd.user
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
                    vfin and rows[ai].d_finite and not hd.user
                ):  # P is 0 there, dP or D is not finite
                    dS.view(shape).masked_fill_(~mask.pick(mask.allowed, heads), 0.0)
                if tape is not None or grads.wanted:  # d score_mod, biases, slopes
                    grads.tile(dS.view(shape), tape, mask, heads, h, h2, a, a2, c, c2)
                if soft:  # through the cap: d tanh = 1 - tanh²
                    T.mul_(T).neg_().add_(1.0)
                    dS.view(shape).mul_(T)
                    if masked and (kflag or rows[ai].q_flag):  # tanh(NaN) at blocked cells too
                        dS.view(shape).masked_fill_(~mask.pick(mask.allowed, heads), 0.0)
                if drop:  # the values saw P ∘ Z (and dO is scaled)
                    P.view(shape).mul_(keep)
                Pt, dSt = P.transpose(1, 2), dS.transpose(1, 2)
                zeros = masked or drop > 0
                _acc(dvb, Pt, rows[ai].dout[h:h2], rows[ai].dout0[h:h2], rows[ai].dout_flag, zeros)
                _acc(dk, dSt, rows[ai].q[h:h2], rows[ai].q0[h:h2], rows[ai].q_flag, masked)
                _acc(dq[ai][h:h2], dS, Kc, K0c, kflag, masked)
            torch.mul(dk, LN2, out=dK[h:h2, c:c2])
            dV[h:h2, c:c2] = dvb
        return dq, grads

    results = _parallel(_balanced(tasks, cost, lanes), run, workers) if tasks else []
    parts = [r[0] for r in results]
    for r in results:  # in part order: the same sums on any thread count
        total_grads.add(r[1])
    for ai, (a, a2) in enumerate(blocks):
        if not parts:
            dQ_out[:, :, a:a2] = 0.0
            continue
        total = parts[0][ai]
        for other in parts[1:]:
            total += other[ai]
        dQ_out[:, :, a:a2] = total.mul_(p.scale).view(N, g, a2 - a, d)
