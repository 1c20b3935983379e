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
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from ..engines.problem import FLOAT_DTYPES, compute_dtype, make_problem
from ..masks import DEFAULTS, Pattern, check_lengths, keywords_of, takes_pattern
from ..shapes import BACKWARD_FACTOR, score_flops
from .layout import LAYOUTS, check_layout, rank_and_size, segments

_TAG_KV, _TAG_DKV = 71, 72  # gloo matches messages by tag; NCCL by order (same on all ranks)


class RingError(RuntimeError):
    """A transfer or collective of the ring failed: a peer raised, died or timed out."""


@dataclass
class RingStats:
    """What this rank did, summed over the ring_attention calls it was passed to.

    flops: block-pair FLOPs actually computed here (4·B·H·n·m·d per n×m block, halved for a
    partly readable one; backward counts 2.5×). bytes_sent: payload this rank sent.
    wait_s: CPU time spent blocked on transfers (communication the compute did not hide;
    on CUDA transfers are asynchronous, so this is near zero there). steps: ring steps
    taken (P, or fewer when a window leaves the far blocks unread).
    """

    flops: float = 0.0
    bytes_sent: int = 0
    kernel_calls: int = 0
    wait_s: float = 0.0
    steps: int = 0


@dataclass
class _Pair:
    """One kernel call: local query rows ``qs`` against local rows ``ks`` of a K, V block,
    read through ``pattern`` (the ring's M placed at the two chunks' global positions)."""

    qs: slice
    ks: slice
    pattern: Pattern
    units: float  # n·m, halved when only partly readable


def plan(pattern: Pattern, q_segs, kv_segs, B: int = 1) -> list[_Pair]:
    """The block pairs to compute for local query chunks ``q_segs`` against a K, V block made
    of chunks ``kv_segs`` (``[(global start, length)]`` in local order).

    Each (query chunk, key chunk) pair is placed at its global positions and asked what M
    leaves of it. Under the causal mask with zigzag chunks there are three cases:

        =====================  =========================  ===================
        key chunk vs query     what M leaves              the call
        =====================  =========================  ===================
        the same chunk         lower triangle             masked ("partial")
        an earlier chunk       every key                  unmasked ("full")
        a later chunk          nothing                    skipped
        =====================  =========================  ===================

    A window turns far earlier chunks into "skipped" and the near ones into "partial";
    lengths are left to the call (they differ per sequence). A ``mask_mod`` (which may read
    b) is asked for each of the B batch rows: a pair is skipped only when no row reads it.
    """
    structure = replace(pattern, lengths=None)  # what holds for every sequence of the batch
    pairs, qo = [], 0
    for qa, n in q_segs:
        ko = 0
        for ka, m in kv_segs:
            placed = replace(pattern, q_start=qa, k_start=ka)
            at = replace(structure, q_start=qa, k_start=ka)
            rows = range(B) if pattern.mask_mod is not None else (0,)
            kinds = {at.block_kind(b, 0, n, 0, m, n, m) for b in rows}
            kind = kinds.pop() if len(kinds) == 1 else "partial"
            if kind != "skip" and n and m:
                units = n * m if kind == "full" else n * m / 2
                pairs.append(_Pair(slice(qo, qo + n), slice(ko, ko + m), placed, units))
            ko += m
        qo += n
    return pairs


class _Link:
    """The ring's point-to-point transfers: start a send and a receive, wait for them, and
    turn any backend failure into a :class:`RingError` that says who and when."""

    def __init__(self, group, rank: int, P: int, stats: RingStats):
        self.group, self.rank, self.P, self.stats = group, rank, P, stats

    def _global(self, r: int) -> int:
        return r if self.group is None else dist.get_global_rank(self.group, r)

    def exchange(self, send, recv, tag: int, what: str, phase: str, step: int, hop: int = 1):
        """Start sending ``send`` to rank + hop and receiving ``recv`` from rank - hop."""
        to, frm = (self.rank + hop) % self.P, (self.rank - hop) % self.P
        ops = [
            dist.P2POp(dist.isend, send, self._global(to), self.group, tag),
            dist.P2POp(dist.irecv, recv, self._global(frm), self.group, tag),
        ]
        try:
            works = dist.batch_isend_irecv(ops)
        except Exception as exc:  # noqa: BLE001 - any backend error becomes a RingError
            raise self._error(what, phase, step, frm, to, exc) from exc
        self.stats.bytes_sent += send.numel() * send.element_size()
        return (works, what, phase, step, frm, to)

    def wait(self, pending) -> None:
        if not pending:
            return
        works, what, phase, step, frm, to = pending
        t0 = time.perf_counter()
        try:
            for w in works:
                w.wait()
        except Exception as exc:  # noqa: BLE001
            raise self._error(what, phase, step, frm, to, exc) from exc
        self.stats.wait_s += time.perf_counter() - t0

    def _error(self, what, phase, step, frm, to, exc) -> RingError:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return RingError(
            f"ring_attention ({phase}, step {step + 1} of {self.P}): rank {self.rank} exchanging "
            f"{what} (receiving from rank {frm}, sending to rank {to}) failed: {first}. "
            "Most likely another rank raised or died first (its own traceback says why); a "
            "silent peer is given up on after the process group's timeout "
            "(init_process_group(timeout=...))."
        )


@dataclass
class _Config:
    """One ring_attention call: the layout, M (without sinks), the plan cache."""

    rank: int
    P: int
    layout: str
    scale: float
    T_local: int
    pattern: Pattern  # causal, window, lengths; global positions
    sinks: torch.Tensor | None  # (H_q,)
    dropout_p: float
    dropout_seed: tuple[int, int] | None
    link: _Link
    B: int = 1  # batch rows (a mask_mod's block kinds are asked per row)

    def __post_init__(self):
        self._plans: dict[tuple[int, int], list[_Pair]] = {}
        # ring steps that any rank needs: past them every rank's block pairs are skipped
        self.steps = 1 + max(
            (t for t in range(self.P) for r in range(self.P) if self._pairs(r, (r - t) % self.P)),
            default=0,
        )

    @property
    def stats(self) -> RingStats:
        return self.link.stats

    def _pairs(self, rank: int, src: int) -> list[_Pair]:
        key = (rank, src)
        if key not in self._plans:
            self._plans[key] = plan(
                self.pattern,
                segments(rank, self.P, self.T_local, self.layout),
                segments(src, self.P, self.T_local, self.layout),
                self.B,
            )
        return self._plans[key]

    def pairs(self, src: int) -> list[_Pair]:
        return self._pairs(self.rank, src)


def _kernels(device: torch.device):
    """The block kernels, with the contract ``fwd(p) -> (out, lse)`` and
    ``bwd(p, out, lse, dout) -> (dq, dk, dv)``: on CPU the native engine where it is built
    (else the tiled one), on CUDA the triton engine."""
    from ..engines import registry

    if device.type == "cpu":
        f = registry.Features("cpu", "float32", 1, 1, 1, 1, 1, 1)
        name = "cpp" if not registry.refusal("cpp", f) else "tiled"
        return registry.engine(name).load()
    if device.type == "cuda":
        try:
            mod = importlib.import_module("causalattn.engines.triton")
        except ImportError:
            mod = None
        if (
            mod is not None
            and callable(getattr(mod, "fwd", None))
            and callable(getattr(mod, "bwd", None))
        ):
            return mod
    raise ValueError(
        f"ring_attention: no block kernels for {device.type} tensors here: the cpp and tiled "
        "engines run on CPU only, and CUDA tensors need the triton engine "
        "(pip install 'causalattn[gpu]')"
    )


def _pack(k, v) -> torch.Tensor:
    """K and V in one flat buffer: one message per ring step."""
    return torch.cat([k.reshape(-1), v.reshape(-1)])


def _unpack(buf, k_shape, v_shape):
    nk = math.prod(k_shape)
    return buf[:nk].view(k_shape), buf[nk:].view(v_shape)


def _merge(out, lse, o, l) -> None:
    """Fold a partial result (o, l) into (out, lse) in place, by log-sum-exp."""
    new = torch.logaddexp(lse, l)
    safe = torch.where(torch.isneginf(new), torch.zeros_like(new), new)  # both -inf: keep 0
    out.mul_(torch.exp(lse - safe).unsqueeze(-1)).add_(
        o.to(out.dtype) * torch.exp(l - safe).unsqueeze(-1)
    )
    lse.copy_(new)


def _count(cfg: _Config, pair: _Pair, q, v, factor=1.0) -> None:
    """FLOPs of one block pair (shapes.score_flops over its units: n·m, halved on the
    diagonal)."""
    B, H, _, d_k = q.shape
    cfg.stats.flops += score_flops(B * H * pair.units, d_k, v.shape[-1]) * factor
    cfg.stats.kernel_calls += 1


def _block_problems(cfg: _Config, q, kc, vc, src: int):
    """(pair, Problem) for each block pair of the local queries against rank src's k, v
    block that has a readable key: the same pairs in the forward and the backward."""
    B = q.shape[0]
    for pair in cfg.pairs(src):
        n, m = pair.qs.stop - pair.qs.start, pair.ks.stop - pair.ks.start
        if all(pair.pattern.key_range(b, 0, n, n, m) == (0, 0) for b in range(B)):
            continue  # every sequence's rows here are padding, or its keys are
        p = make_problem(
            q[:, :, pair.qs],
            kc[:, :, pair.ks],
            vc[:, :, pair.ks],
            pattern=pair.pattern,
            scale=cfg.scale,
        )
        if cfg.dropout_p:
            p = replace(p, dropout_p=cfg.dropout_p, dropout_seed=cfg.dropout_seed)
        yield pair, p


def _forward(q, k, v, cfg: _Config):
    kern = _kernels(q.device)
    B, H_q, T, _ = q.shape
    cd = compute_dtype(q.dtype)
    out = torch.zeros(B, H_q, T, v.shape[-1], dtype=cd, device=q.device)
    lse = torch.full((B, H_q, T), float("-inf"), dtype=cd, device=q.device)
    bufs = [_pack(k, v), None]
    for step in range(cfg.steps):
        src = (cfg.rank - step) % cfg.P
        cur = bufs[step % 2]
        pending = None
        if step < cfg.steps - 1:  # start passing this block on before computing with it
            if bufs[(step + 1) % 2] is None:
                bufs[(step + 1) % 2] = torch.empty_like(cur)
            pending = cfg.link.exchange(
                cur, bufs[(step + 1) % 2], _TAG_KV, "the k, v block", "forward", step
            )
        kc, vc = _unpack(cur, k.shape, v.shape)
        for pair, p in _block_problems(cfg, q, kc, vc, src):
            o, l = kern.fwd(p)
            _merge(out[:, :, pair.qs], lse[:, :, pair.qs], o, l)
            _count(cfg, pair, q, v)
        cfg.link.wait(pending)
    cfg.stats.steps += cfg.steps
    if cfg.sinks is not None:  # each head's sink joins every readable row's denominator
        s = cfg.sinks.detach().to(cd)[None, :, None]
        with_sink = torch.where(torch.isneginf(lse), lse, torch.logaddexp(lse, s))
        out.mul_(torch.exp(lse - with_sink).nan_to_num(0.0).unsqueeze(-1))
        lse = with_sink
    return out.to(q.dtype), lse.float(), lse


def _backward(dout, q, k, v, out, lse, cfg: _Config):
    kern = _kernels(q.device)
    cd = compute_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=cd, device=q.device)
    kv = [_pack(k, v), None]
    n = k.numel() + v.numel()
    acc = [torch.zeros(n, dtype=cd, device=q.device), None]  # this step's dK, dV
    inbox = torch.empty(n, dtype=cd, device=q.device) if cfg.P > 1 else None
    sent = None  # the dK, dV transfer started last step
    steps = cfg.steps
    for step in range(steps):
        src = (cfg.rank - step) % cfg.P
        cur = kv[step % 2]
        pending = None
        if step < steps - 1:
            if kv[(step + 1) % 2] is None:
                kv[(step + 1) % 2] = torch.empty_like(cur)
            pending = cfg.link.exchange(
                cur, kv[(step + 1) % 2], _TAG_KV, "the k, v block", "backward", step
            )
        kc, vc = _unpack(cur, k.shape, v.shape)
        mine = acc[step % 2]
        if mine is None:
            mine = acc[step % 2] = torch.zeros(n, dtype=cd, device=q.device)
        else:
            mine.zero_()
        dk_p, dv_p = _unpack(mine, k.shape, v.shape)
        for pair, p in _block_problems(cfg, q, kc, vc, src):
            dq_i, dk_j, dv_j = kern.bwd(
                p, out[:, :, pair.qs], lse[:, :, pair.qs], dout[:, :, pair.qs]
            )
            dq[:, :, pair.qs] += dq_i
            dk_p[:, :, pair.ks] += dk_j
            dv_p[:, :, pair.ks] += dv_j
            _count(cfg, pair, q, v, BACKWARD_FACTOR)
        if cfg.P > 1:
            if step > 0:  # the gradients other ranks already gave this block travel with it
                cfg.link.wait(sent)
                mine += inbox
            # each step passes them on; the last sends them home to their owner, rank - step
            # (the next rank when the ring went all the way round)
            hop = 1 if step < steps - 1 else (-step) % cfg.P
            if hop == 0:  # one step only: this rank's own block, already home
                sent = None
                inbox.copy_(mine)
            else:
                sent = cfg.link.exchange(
                    mine, inbox, _TAG_DKV, "the dk, dv gradients", "backward", step, hop=hop
                )
        cfg.link.wait(pending)
    cfg.link.wait(sent)
    own = inbox if cfg.P > 1 else acc[0]
    dk, dv = _unpack(own, k.shape, v.shape)
    dsinks = None
    if cfg.sinks is not None:  # d s_h = -Σ_i exp(s_h - lse_i)·D_i, D_i = rowsum(dH∘H)
        D = (dout.to(cd) * out.to(cd)).sum(-1)
        P_sink = torch.exp(cfg.sinks.detach().to(cd)[None, :, None] - lse).nan_to_num(0.0)
        dsinks = -(P_sink * D).sum(dim=(0, 2)).to(cfg.sinks.dtype)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsinks


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, cfg):
        out, lse_public, lse = _forward(q, k, v, cfg)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cfg = cfg
        ctx.mark_non_differentiable(lse_public)
        return out, lse_public

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv, dsinks = _backward(dout, q, k, v, out, lse, ctx.cfg)
        return dq, dk, dv, dsinks, None


def _agree(link: _Link, layout: str, q, k, v, lengths_list, window, seed) -> tuple[int, int]:
    """One small all_gather: every rank must hold shards of the same problem. Returns rank 0's
    dropout (seed, offset), which every rank then uses."""
    meta = [
        *q.shape,
        k.shape[1],
        v.shape[-1],
        FLOAT_DTYPES.index(q.dtype),
        LAYOUTS.index(layout),
        -1 if lengths_list is None else len(lengths_list),
        0
        if lengths_list is None
        else sum((i + 1) * x for i, x in enumerate(lengths_list)) % 1_000_003,
        window or 0,
    ]
    mine = torch.tensor([*meta, *seed], dtype=torch.int64, device=q.device)
    every = [torch.empty_like(mine) for _ in range(link.P)]
    try:
        dist.all_gather(every, mine, group=link.group)
    except Exception as exc:  # noqa: BLE001
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
        raise RingError(
            f"ring_attention: rank {link.rank} could not check its shard against the other ranks "
            f"(all_gather failed: {first}). Another rank probably raised before calling "
            "ring_attention, or died."
        ) from exc
    rows = [tuple(t.tolist()[:-2]) for t in every]
    if len(set(rows)) > 1:

        def describe(r):
            B, H, T, d_k, H_kv, d_v, dt, lay, nl, ls, w = r
            return (
                f"q ({B}, {H}, {T}, {d_k}), k ({B}, {H_kv}, {T}, {d_k}), v (…, {d_v}), "
                f"{FLOAT_DTYPES[dt]}, layout {LAYOUTS[lay]!r}, "
                f"lengths {'none' if nl < 0 else f'checksum {ls}'}, window {w or 'none'}"
            )

        lines = "; ".join(f"rank {i}: {describe(r)}" for i, r in enumerate(rows))
        raise ValueError(
            f"ring_attention: the ranks' shards disagree ({lines}); every rank must pass its shard "
            "(B, H, T/P, d) of the same sequence, with the same layout, lengths and window"
        )
    s0, o0 = every[0].tolist()[-2:]
    return int(s0), int(o0)


# the pattern keywords ring attention runs (causal always; it refuses the others by name)
RING_KEYWORDS = ("causal", "lengths", "window", "sinks", "mask_mod")


@takes_pattern
def ring_attention(
    q,
    k,
    v,
    *,
    group=None,
    layout: str = "zigzag",
    pattern: Pattern | None = None,
    scale=None,
    dropout_p: float = 0.0,
    generator=None,
    return_lse: bool = False,
    stats: RingStats | None = None,
    **keywords,
):
    """Causal self-attention over a sequence sharded across the ranks of ``group``.

    q: ``(B, H_q, T/P, d_k)``, k: ``(B, H_kv, T/P, d_k)``, v: ``(B, H_kv, T/P, d_v)`` — this
    rank's shard, in ``layout`` (see :func:`shard`). ``lengths`` ``(B,)``: real length of each
    global sequence (the same on every rank); keys past it are blocked and query rows past
    it are padding (zero output and gradient). ``window``: each query reads its last
    ``window`` positions; ring steps that no rank's queries can read are not taken.
    ``sinks`` ``(H_q,)``: one logit per head joining every row's softmax denominator
    (differentiable). ``dropout_p``: attention dropout with the counter-based pattern of
    :mod:`causalattn.dropout` at global positions, so P ranks drop what one process drops
    for the same seed (rank 0 draws it from ``generator`` or torch's RNG). Returns this
    rank's shard of H ``(B, H_q, T/P, d_v)`` in q's dtype (and, with ``return_lse``, its
    fp32 log-sum-exp ``(B, H_q, T/P)``, -inf on padding rows). Differentiable in q, k, v.
    ``mask_mod(b, h, q_idx, kv_idx)`` (:mod:`causalattn.masks_mod`): any further rule, at
    global positions (the same function on every rank); block pairs it leaves empty are
    skipped.

    The pattern is ``pattern`` or its keywords (:func:`causalattn.attention`'s); it runs
    those of :data:`RING_KEYWORDS` and refuses the others by name.

    Collective: every rank of the group must call it with the same shapes. A failing peer
    raises :class:`RingError` here (see the module docstring).
    """
    kw = keywords_of(pattern, keywords, "ring_attention")
    others = [n for n in kw if n not in RING_KEYWORDS and kw[n] is not DEFAULTS[n]]
    if others or kw["causal"] is not True:
        raise ValueError(
            f"ring_attention: {', '.join(others) or 'causal=False'} is not supported; it runs "
            f"causal attention with {', '.join(RING_KEYWORDS[1:])}"
        )
    lengths, window, sinks, mask_mod = (kw[n] for n in RING_KEYWORDS[1:])
    check_layout(layout)
    rank, P = rank_and_size(group)
    # local shapes, dtypes, devices, scale, window, sinks and dropout_p, checked as attention's
    local = make_problem(
        q,
        k,
        v,
        causal=True,
        window=window,
        sinks=sinks,
        scale=scale,
        dropout_p=dropout_p,
        generator=generator,
    )
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
        lengths_list = check_lengths(
            lengths, T, "ring_attention", B=q.shape[0], note=f" (T = P·T/P = {P}·{T_local})"
        ).tolist()
    link = _Link(group, rank, P, stats if stats is not None else RingStats())
    seed = _agree(link, layout, q, k, v, lengths_list, window, local.dropout_seed or (0, 0))
    pattern = Pattern.from_kwargs(
        where="ring_attention", window=window, lengths=lengths_list, mask_mod=mask_mod
    )
    cfg = _Config(
        rank,
        P,
        layout,
        local.scale,
        T_local,
        pattern,
        sinks,
        local.dropout_p,
        seed if local.dropout_p else None,
        link,
        q.shape[0],
    )
    out, lse = _RingAttention.apply(q, k, v, sinks, cfg)
    return (out, lse) if return_lse else out
