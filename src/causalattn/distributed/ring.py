"""Ring attention: one causal sequence spread over the P ranks of a process group.

Each rank keeps its query shard Q_r ``(B, H_q, T/P, d_k)`` and passes its key/value shard
around the ring: at step t rank r holds the K, V block of rank r−t, sends it on to r+1
while it computes ``softmax(Q_r K_{r−t}ᵀ·scale + M) V_{r−t}`` for the block pairs the
causal mask allows (earlier chunk: no mask; same chunk: causal; later chunk: skipped).
The partial outputs merge by their log-sum-exp in fp32, so the result is the exact
softmax over all T keys. Backward recomputes each block from the merged global output
and log-sum-exp (FlashAttention-2), keeps dQ local and sends dK, dV around the ring
with their block, so they arrive back at their owner after P steps.

Failure: every wait on a transfer is wrapped; a peer that raised, died or went silent
turns into :class:`RingError` on the other ranks — at once when its process is gone
(the connection closes), otherwise after the process group's timeout
(``init_process_group(timeout=...)``). With NCCL, a stuck peer is caught by NCCL's
watchdog after that same timeout, which aborts the process (TORCH_NCCL_ASYNC_ERROR_HANDLING).
"""

from __future__ import annotations

import importlib
import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..engines.problem import FLOAT_DTYPES, make_problem
from .layout import LAYOUTS, _positions, check_layout, rank_and_size, segments

FULL, DIAG, SKIP = "full", "diag", "skip"
_TAG_KV, _TAG_DKV = 71, 72  # gloo matches messages by tag; NCCL by order (same on all ranks)


class RingError(RuntimeError):
    """A transfer or collective of the ring failed: a peer raised, died or timed out."""


@dataclass
class RingStats:
    """What this rank did, summed over the ring_attention calls it was passed to.

    flops: block-pair FLOPs actually computed here (4·B·H·n·m·d per n×m block, halved on
    the causal diagonal; backward counts 2.5×). bytes_sent: payload this rank sent.
    wait_s: CPU time spent blocked on transfers (communication the compute did not hide;
    on CUDA transfers are asynchronous, so this is near zero there).
    """

    flops: float = 0.0
    bytes_sent: int = 0
    kernel_calls: int = 0
    wait_s: float = 0.0


@dataclass
class _Pair:
    """One kernel call: local query rows ``qs`` against local rows ``ks`` of a K, V block."""

    qs: slice
    ks: slice
    causal: bool
    q_lo: int  # smallest global query position in qs
    k_lo: int  # smallest / one past the largest global key position in ks
    k_hi: int
    units: float  # n·m, halved on the diagonal


def _relation(qseg, kseg) -> str:
    (a, n), (b, m) = qseg, kseg
    if (a, n) == (b, m):
        return DIAG
    if b + m <= a:
        return FULL
    if b >= a + n:
        return SKIP
    raise AssertionError(f"chunks {qseg} and {kseg} overlap partially")  # equal or disjoint by construction


def _runs(flags):
    """Maximal runs [i0, i1) of consecutive True."""
    out, start = [], None
    for i, f in enumerate([*flags, False]):
        if f and start is None:
            start = i
        elif not f and start is not None:
            out.append((start, i))
            start = None
    return out


def plan(q_segs, kv_segs) -> list[_Pair]:
    """The block pairs to compute for local queries ``q_segs`` against a K, V block ``kv_segs``.

    Segments are ``[(global start, length)]`` in local order. Fewest calls: query chunks
    that read the whole block fully share one call; then per key chunk; diagonals alone.
    """
    rel = [[_relation(qs, ks) for ks in kv_segs] for qs in q_segs]
    qo = [sum(n for _, n in q_segs[:i]) for i in range(len(q_segs) + 1)]
    ko = [sum(n for _, n in kv_segs[:j]) for j in range(len(kv_segs) + 1)]
    taken = [[False] * len(kv_segs) for _ in q_segs]
    pairs = []

    def add(i0, i1, j0, j1, causal):
        n, m = qo[i1] - qo[i0], ko[j1] - ko[j0]
        pairs.append(_Pair(
            slice(qo[i0], qo[i1]), slice(ko[j0], ko[j1]), causal,
            min(s for s, _ in q_segs[i0:i1]), min(s for s, _ in kv_segs[j0:j1]),
            max(s + L for s, L in kv_segs[j0:j1]), n * m / 2 if causal else n * m,
        ))
        for i in range(i0, i1):
            for j in range(j0, j1):
                taken[i][j] = True

    def runs(flags, m):  # a call may not have more query rows than keys (make_problem: T_q <= T_k)
        for i0, i1 in _runs(flags):
            yield from [(i0, i1)] if qo[i1] - qo[i0] <= m else [(i, i + 1) for i in range(i0, i1)]

    for i0, i1 in runs([all(r == FULL for r in row) for row in rel], ko[-1]):
        add(i0, i1, 0, len(kv_segs), False)
    for j in range(len(kv_segs)):
        for i0, i1 in runs([rel[i][j] == FULL and not taken[i][j] for i in range(len(q_segs))], ko[j + 1] - ko[j]):
            add(i0, i1, j, j + 1, False)
    for i in range(len(q_segs)):
        for j in range(len(kv_segs)):
            if rel[i][j] == DIAG:
                add(i, i + 1, j, j + 1, True)
    return pairs


@dataclass
class _Config:
    group: object
    rank: int
    P: int
    layout: str
    scale: float
    T_local: int
    lengths: torch.Tensor | None  # (B,) int64 on q's device
    len_min: int
    len_max: int
    stats: RingStats

    def __post_init__(self):
        gr = (lambda r: r) if self.group is None else (lambda r: dist.get_global_rank(self.group, r))
        self.next, self.prev = (self.rank + 1) % self.P, (self.rank - 1) % self.P
        self.next_global, self.prev_global = gr(self.next), gr(self.prev)
        self.q_segs = segments(self.rank, self.P, self.T_local, self.layout)
        self._plans = {}

    def pairs(self, src: int) -> list[_Pair]:
        if src not in self._plans:
            self._plans[src] = plan(self.q_segs, segments(src, self.P, self.T_local, self.layout))
        return self._plans[src]

    def kv_positions(self, src: int, device) -> torch.Tensor:
        return _positions(segments(src, self.P, self.T_local, self.layout), device)

    def key_mask(self, pair: _Pair, kv_pos: torch.Tensor):
        """(skip, key_padding_mask) for a pair under ``lengths``: keys >= length are blocked."""
        if self.lengths is None:
            return False, None
        if pair.q_lo >= self.len_max or pair.k_lo >= self.len_max:
            return True, None  # every query row (zeroed at the end) or every key is padding
        if pair.k_hi <= self.len_min:
            return False, None
        return False, kv_pos[pair.ks][None, :] < self.lengths[:, None]

    # -- communication -------------------------------------------------------------------
    def exchange(self, send: torch.Tensor, recv: torch.Tensor, tag: int, what: str, phase: str, step: int):
        """Start sending ``send`` to the next rank and receiving ``recv`` from the previous."""
        ops = [
            dist.P2POp(dist.isend, send, self.next_global, self.group, tag),
            dist.P2POp(dist.irecv, recv, self.prev_global, self.group, tag),
        ]
        try:
            works = dist.batch_isend_irecv(ops)
        except Exception as exc:  # noqa: BLE001 - any backend error becomes a RingError
            raise self._error(what, phase, step, exc) from exc
        self.stats.bytes_sent += send.numel() * send.element_size()
        return (works, what, phase, step)

    def wait(self, pending) -> None:
        if not pending:
            return
        works, what, phase, step = pending
        t0 = time.perf_counter()
        try:
            for w in works:
                w.wait()
        except Exception as exc:  # noqa: BLE001
            raise self._error(what, phase, step, exc) from exc
        self.stats.wait_s += time.perf_counter() - t0

    def _error(self, what, phase, step, exc) -> RingError:
        return RingError(
            f"ring_attention ({phase}, step {step + 1} of {self.P}): rank {self.rank} exchanging "
            f"{what} (receiving from rank {self.prev}, sending to rank {self.next}) failed: "
            f"{str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__}. "
            "Most likely another rank raised or died first (its own traceback says why); a "
            "silent peer is given up on after the process group's timeout "
            "(init_process_group(timeout=...))."
        )


def _kernels(device: torch.device):
    """The block kernels, with the contract ``fwd(p) -> (out, lse)`` and
    ``bwd(p, out, lse, dout) -> (dq, dk, dv)``: the tiled engine on CPU, the triton engine
    on CUDA (the tiled engine allocates on the CPU)."""
    if device.type == "cpu":
        return importlib.import_module("causalattn.engines.tiled")
    if device.type == "cuda":
        try:
            mod = importlib.import_module("causalattn.engines.triton")
        except ImportError:
            mod = None
        if mod is not None and callable(getattr(mod, "fwd", None)) and callable(getattr(mod, "bwd", None)):
            return mod
    raise ValueError(
        f"ring_attention: no block kernels for {device.type} tensors here: the tiled engine runs "
        "on CPU only, and CUDA tensors need the triton engine (pip install 'causalattn[gpu]')"
    )


def _pack(k, v) -> torch.Tensor:
    """K and V in one flat buffer: one message per ring step."""
    return torch.cat([k.reshape(-1), v.reshape(-1)])


def _unpack(buf, k_shape, v_shape):
    nk = math.prod(k_shape)
    return buf[:nk].view(k_shape), buf[nk:].view(v_shape)


def _acc_dtype(q) -> torch.dtype:
    """Merge and accumulate in fp32 (fp64 for fp64 inputs), as the tiled engine does."""
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _merge(out, lse, o, l) -> None:
    """Fold a partial result (o, l) into (out, lse) in place, by log-sum-exp."""
    new = torch.logaddexp(lse, l)
    safe = torch.where(torch.isneginf(new), torch.zeros_like(new), new)  # both -inf: keep 0
    out.mul_(torch.exp(lse - safe).unsqueeze(-1)).add_(o.to(out.dtype) * torch.exp(l - safe).unsqueeze(-1))
    lse.copy_(new)


def _count(cfg: _Config, pair: _Pair, q, v, factor=1.0) -> None:
    """FLOPs of one block pair (DESIGN.md's convention: 4·B·H·n·m·d, halved on the diagonal)."""
    B, H, _, d_k = q.shape
    cfg.stats.flops += 2.0 * B * H * pair.units * (d_k + v.shape[-1]) * factor
    cfg.stats.kernel_calls += 1


def _block_problems(cfg: _Config, q, kc, vc, src: int):
    """(pair, Problem) for each block pair of the local queries against rank src's k, v
    block that has a readable key: the same pairs in the forward and the backward."""
    kv_pos = cfg.kv_positions(src, q.device) if cfg.lengths is not None else None
    for pair in cfg.pairs(src):
        skip, kpm = cfg.key_mask(pair, kv_pos)
        if skip:
            continue
        yield pair, make_problem(q[:, :, pair.qs], kc[:, :, pair.ks], vc[:, :, pair.ks],
                                 causal=pair.causal, key_padding_mask=kpm, scale=cfg.scale)


def _forward(q, k, v, cfg: _Config):
    kern = _kernels(q.device)
    B, H_q, T, _ = q.shape
    cd = _acc_dtype(q)
    out = torch.zeros(B, H_q, T, v.shape[-1], dtype=cd, device=q.device)
    lse = torch.full((B, H_q, T), float("-inf"), dtype=cd, device=q.device)
    bufs = [_pack(k, v), None]
    for step in range(cfg.P):
        src = (cfg.rank - step) % cfg.P
        cur = bufs[step % 2]
        pending = None
        if step < cfg.P - 1:  # start passing this block on before computing with it
            if bufs[(step + 1) % 2] is None:
                bufs[(step + 1) % 2] = torch.empty_like(cur)
            pending = cfg.exchange(cur, bufs[(step + 1) % 2], _TAG_KV, "the k, v block", "forward", step)
        kc, vc = _unpack(cur, k.shape, v.shape)
        for pair, p in _block_problems(cfg, q, kc, vc, src):
            o, l = kern.fwd(p)
            _merge(out[:, :, pair.qs], lse[:, :, pair.qs], o, l)
            _count(cfg, pair, q, v)
        cfg.wait(pending)
    lse_public = lse
    if cfg.lengths is not None:  # query rows past the length are padding: zero output
        valid = _valid_rows(cfg, q)
        out.masked_fill_(~valid[:, None, :, None], 0.0)
        lse_public = lse.masked_fill(~valid[:, None, :], float("-inf"))
    return out.to(q.dtype), lse_public.float(), lse


def _valid_rows(cfg: _Config, q) -> torch.Tensor:
    """(B, T/P) bool: local query rows inside their sequence's length."""
    return _positions(cfg.q_segs, q.device)[None, :] < cfg.lengths[:, None]


def _backward(dout, q, k, v, out, lse, cfg: _Config):
    kern = _kernels(q.device)
    if cfg.lengths is not None:
        dout = dout.masked_fill(~_valid_rows(cfg, q)[:, None, :, None], 0.0)
    cd = _acc_dtype(q)
    dq = torch.zeros(q.shape, dtype=cd, device=q.device)
    kv = [_pack(k, v), None]
    n = k.numel() + v.numel()
    acc = [torch.zeros(n, dtype=cd, device=q.device), None]  # this step's dK, dV
    inbox = torch.empty(n, dtype=cd, device=q.device) if cfg.P > 1 else None
    sent = None  # the dK, dV transfer started last step
    for step in range(cfg.P):
        src = (cfg.rank - step) % cfg.P
        cur = kv[step % 2]
        pending = None
        if step < cfg.P - 1:
            if kv[(step + 1) % 2] is None:
                kv[(step + 1) % 2] = torch.empty_like(cur)
            pending = cfg.exchange(cur, kv[(step + 1) % 2], _TAG_KV, "the k, v block", "backward", step)
        kc, vc = _unpack(cur, k.shape, v.shape)
        mine = acc[step % 2]
        if mine is None:
            mine = acc[step % 2] = torch.zeros(n, dtype=cd, device=q.device)
        else:
            mine.zero_()
        dk_p, dv_p = _unpack(mine, k.shape, v.shape)
        for pair, p in _block_problems(cfg, q, kc, vc, src):
            dq_i, dk_j, dv_j = kern.bwd(p, out[:, :, pair.qs], lse[:, :, pair.qs], dout[:, :, pair.qs])
            dq[:, :, pair.qs] += dq_i
            dk_p[:, :, pair.ks] += dk_j
            dv_p[:, :, pair.ks] += dv_j
            _count(cfg, pair, q, v, 2.5)
        if cfg.P > 1:
            if step > 0:  # the gradients other ranks already gave this block travel with it
                cfg.wait(sent)
                mine += inbox
            # after the last step this reaches the block's owner
            sent = cfg.exchange(mine, inbox, _TAG_DKV, "the dk, dv gradients", "backward", step)
        cfg.wait(pending)
    cfg.wait(sent)
    own = inbox if cfg.P > 1 else acc[0]
    dk, dv = _unpack(own, k.shape, v.shape)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cfg):
        if cfg.lengths is not None:
            # padding query rows still read keys inside the length (only keys are masked per
            # block); zeroed, whatever they held (even NaN) stays out of the sums of dK, dV
            q = q.masked_fill(~_valid_rows(cfg, q)[:, None, :, None], 0.0)
        out, lse_public, lse = _forward(q, k, v, cfg)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cfg = cfg
        ctx.mark_non_differentiable(lse_public)
        return out, lse_public

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _backward(dout, q, k, v, out, lse, ctx.cfg)
        return dq, dk, dv, None


def _agree(cfg: _Config, q, k, v, lengths_list) -> None:
    """One small all_gather: every rank must hold shards of the same problem."""
    meta = [*q.shape, k.shape[1], v.shape[-1], FLOAT_DTYPES.index(q.dtype), LAYOUTS.index(cfg.layout),
            -1 if lengths_list is None else len(lengths_list),
            0 if lengths_list is None else sum((i + 1) * x for i, x in enumerate(lengths_list)) % 1_000_003]
    mine = torch.tensor(meta, dtype=torch.int64, device=q.device)
    every = [torch.empty_like(mine) for _ in range(cfg.P)]
    try:
        dist.all_gather(every, mine, group=cfg.group)
    except Exception as exc:  # noqa: BLE001
        raise RingError(
            f"ring_attention: rank {cfg.rank} could not check its shard against the other ranks "
            f"(all_gather failed: {str(exc).strip().splitlines()[0] if str(exc).strip() else exc!r}). "
            "Another rank probably raised before calling ring_attention, or died."
        ) from exc
    rows = [tuple(t.tolist()) for t in every]
    if len(set(rows)) > 1:
        def describe(r):
            B, H, T, d_k, H_kv, d_v, dt, lay, nl, ls = r
            return (f"q ({B}, {H}, {T}, {d_k}), k ({B}, {H_kv}, {T}, {d_k}), v (…, {d_v}), "
                    f"{FLOAT_DTYPES[dt]}, layout {LAYOUTS[lay]!r}, lengths {'none' if nl < 0 else f'checksum {ls}'}")
        lines = "; ".join(f"rank {i}: {describe(r)}" for i, r in enumerate(rows))
        raise ValueError(
            f"ring_attention: the ranks' shards disagree ({lines}); every rank must pass its shard "
            "(B, H, T/P, d) of the same sequence, with the same layout and lengths"
        )


def ring_attention(q, k, v, *, group=None, layout: str = "zigzag", lengths=None, scale=None,
                   return_lse: bool = False, stats: RingStats | None = None):
    """Causal self-attention over a sequence sharded across the ranks of ``group``.

    q: ``(B, H_q, T/P, d_k)``, k: ``(B, H_kv, T/P, d_k)``, v: ``(B, H_kv, T/P, d_v)`` — this
    rank's shard, in ``layout`` (see :func:`shard`). ``lengths`` ``(B,)``: real length of each
    global sequence (the same on every rank); keys past it are blocked and query rows past
    it are padding (zero output and gradient). Returns this rank's shard of
    H ``(B, H_q, T/P, d_v)`` in q's dtype (and, with ``return_lse``, its fp32 log-sum-exp
    ``(B, H_q, T/P)``, -inf on padding rows). Differentiable in q, k, v.

    Collective: every rank of the group must call it with the same shapes. A failing peer
    raises :class:`RingError` here (see the module docstring).
    """
    check_layout(layout)
    rank, P = rank_and_size(group)
    make_problem(q, k, v, causal=True, scale=scale)  # local shapes, dtypes, devices
    _kernels(q.device)  # refuse a device without block kernels before any communication
    if q.shape[2] != k.shape[2]:
        raise ValueError(
            f"ring_attention: q has T/P = {q.shape[2]} positions but k has {k.shape[2]}; ring "
            "attention is self-attention, every rank holds the same positions of q, k and v"
        )
    T_local = q.shape[2]
    segments(rank, P, T_local, layout)  # zigzag needs an even shard
    T = T_local * P
    lengths_list = None
    if lengths is not None:
        lengths = torch.as_tensor(lengths, device=q.device)
        B = q.shape[0]
        if lengths.dim() != 1 or lengths.shape[0] != B or lengths.dtype.is_floating_point or lengths.dtype == torch.bool:
            raise ValueError(
                f"lengths: expected an integer tensor of shape (B,) = ({B},), got shape "
                f"{tuple(lengths.shape)} and dtype {lengths.dtype}"
            )
        lengths = lengths.to(torch.int64)
        lengths_list = lengths.tolist()
        if any(not 0 <= x <= T for x in lengths_list):
            raise ValueError(f"lengths: each length must lie in [0, T={T}] (T = P·T/P = {P}·{T_local}), got {lengths_list}")
    scale = float(scale) if scale is not None else (1.0 / math.sqrt(q.shape[-1]) if q.shape[-1] else 1.0)
    cfg = _Config(group, rank, P, layout, scale, T_local, lengths,
                  min(lengths_list) if lengths_list else 0, max(lengths_list) if lengths_list else 0,
                  stats if stats is not None else RingStats())
    _agree(cfg, q, k, v, lengths_list)
    out, lse = _RingAttention.apply(q, k, v, cfg)
    return (out, lse) if return_lse else out
