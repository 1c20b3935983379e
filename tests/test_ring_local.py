"""Ring attention's own logic in this process: P ranks as P threads over an in-memory ring.

``_Threads`` stands in for the few ``torch.distributed`` calls ring.py makes (P2POp,
isend/irecv through batch_isend_irecv, all_gather, get_global_rank): each message is a
copy put in the receiver's mailbox, in the order sent. What the ring computes — the block
pairs it plans, the steps it takes, the merge by log-sum-exp, the dK, dV that travel home,
the sinks' gradient, the FLOPs and bytes it counts — is then checked against one process,
with no gloo and no spawned process (test_ring.py runs the real transport). Bounded: every
wait gives up after a few seconds, so a ring that deadlocks fails instead of hanging.
"""

from __future__ import annotations

import queue
import threading
import types

import pytest
import torch

from causalattn.distributed import ring
from causalattn.distributed.layout import segments
from causalattn.engines import attention
from causalattn.masks import Pattern
from causalattn.shapes import BACKWARD_FACTOR, score_flops

F64 = torch.float64
WAIT_S = 20.0


class _Threads:
    """An in-memory process group of P ranks, one per thread (torch.distributed's calls)."""

    def __init__(self, P: int):
        self.P = P
        self.me = threading.local()
        self.boxes: dict = {}  # (to, frm, tag) -> tensors, in order
        self.boxes_lock = threading.Lock()
        self.barrier = threading.Barrier(P, timeout=WAIT_S)
        self.gathered: list = [None] * P
        self.sent: list = []  # (frm, to, tag, numel), in send order
        self.dist = types.SimpleNamespace(
            P2POp=lambda op, tensor, peer, group, tag: (op, tensor, peer, tag),
            isend="isend",
            irecv="irecv",
            batch_isend_irecv=self.batch_isend_irecv,
            all_gather=self.all_gather,
            get_global_rank=lambda group, r: r,
        )

    def rank_and_size(self, group=None):
        return self.me.rank, self.P

    def box(self, key) -> queue.Queue:
        # under a lock: a defaultdict lets a sender and a receiver that meet a new key at
        # once each make a Queue, and the message goes to the one that is then replaced
        with self.boxes_lock:
            return self.boxes.setdefault(key, queue.Queue())

    def batch_isend_irecv(self, ops):
        works = []
        for op, tensor, peer, tag in ops:
            assert 0 <= peer < self.P
            if op == "isend":
                self.box((peer, self.me.rank, tag)).put(tensor.detach().clone())
                self.sent.append((self.me.rank, peer, tag, tensor.numel()))
            else:
                box = self.box((self.me.rank, peer, tag))
                works.append(
                    types.SimpleNamespace(
                        wait=lambda b=box, t=tensor: t.copy_(b.get(timeout=WAIT_S))
                    )
                )
        return works

    def all_gather(self, every, mine, group=None):
        self.gathered[self.me.rank] = mine.clone()
        self.barrier.wait()
        for out, t in zip(every, self.gathered):
            out.copy_(t)
        self.barrier.wait()

    def run(self, fn):
        """fn(rank) on P threads; the results by rank (the first exception is raised)."""
        results, errors = [None] * self.P, []

        def one(r):
            self.me.rank = r
            try:
                results[r] = fn(r)
            except BaseException as exc:  # noqa: BLE001 - raised below, in the test
                errors.append(exc)
                self.barrier.abort()

        threads = [threading.Thread(target=one, args=(r,)) for r in range(self.P)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=4 * WAIT_S)
        assert not any(t.is_alive() for t in threads), "a rank is still running: deadlock?"
        if errors:
            raise errors[0]
        return results


@pytest.fixture
def ring_of(monkeypatch):
    def make(P):
        g = _Threads(P)
        monkeypatch.setattr(ring, "dist", g.dist)
        monkeypatch.setattr(ring, "rank_and_size", g.rank_and_size)
        return g

    return make


def _local(x, r, P, layout):
    """Rank r's shard of x (B, H, T, d) in the layout."""
    segs = segments(r, P, x.shape[2] // P, layout)
    return torch.cat([x[:, :, s : s + n] for s, n in segs], dim=2)


def _whole(parts, P, layout):
    """The shards (by rank) back in global order along the sequence axis."""
    T = parts[0].shape[2] * P
    out = parts[0].new_zeros(*parts[0].shape[:2], T, *parts[0].shape[3:])
    for r, part in enumerate(parts):
        off = 0
        for s, n in segments(r, P, T // P, layout):
            out[:, :, s : s + n] = part[:, :, off : off + n]
            off += n
    return out


def _inputs(B, H_q, H_kv, T, d_k, d_v, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H_q, T, d_k, generator=g, dtype=F64)
    k = torch.randn(B, H_kv, T, d_k, generator=g, dtype=F64)
    v = torch.randn(B, H_kv, T, d_v, generator=g, dtype=F64)
    dout = torch.randn(B, H_q, T, d_v, generator=g, dtype=F64)
    return q, k, v, dout


def _ring_run(g, q, k, v, dout, layout, sinks=None, **kw):
    """Every rank's ring_attention on its shard; (out, lse, dq, dk, dv) whole, d sinks summed,
    and each rank's RingStats."""
    P = g.P

    def rank(r):
        leaves = [_local(t, r, P, layout).clone().requires_grad_() for t in (q, k, v)]
        s = None if sinks is None else sinks.clone().requires_grad_()
        stats = ring.RingStats()
        out, lse = ring.ring_attention(
            *leaves, layout=layout, sinks=s, return_lse=True, stats=stats, **kw
        )
        assert out.dtype == q.dtype and lse.dtype == torch.float32
        (out * _local(dout, r, P, layout)).sum().backward()
        return (
            (out.detach(), lse, *(t.grad for t in leaves)),
            (None if s is None else s.grad),
            stats,
        )

    res = g.run(rank)
    whole = [_whole([r[0][i] for r in res], P, layout) for i in range(5)]
    dsinks = None if sinks is None else sum(r[1] for r in res)
    return whole, dsinks, [r[2] for r in res]


def _one_process(q, k, v, dout, sinks=None, **kw):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    s = None if sinks is None else sinks.clone().requires_grad_()
    out, lse = attention(*leaves, engine="tiled", sinks=s, return_lse=True, **kw)
    (out * dout).sum().backward()
    return [out.detach(), lse, *(t.grad for t in leaves)], (None if s is None else s.grad)


CASES = {  # name: (P, layout, (B, H_q, H_kv, T, d_k, d_v), keywords)
    "zigzag-2": (2, "zigzag", (2, 4, 2, 16, 8, 6), {}),
    "zigzag-3-gqa": (3, "zigzag", (1, 6, 2, 24, 4, 4), {}),
    "contiguous-4": (4, "contiguous", (2, 2, 1, 12, 4, 5), {}),
    "zigzag-4-lengths": (4, "zigzag", (3, 2, 1, 32, 4, 4), {"lengths": [32, 9, 0]}),
    "contiguous-3-window": (3, "contiguous", (1, 2, 2, 18, 4, 4), {"window": 4}),
    "zigzag-2-window-lengths": (
        2,
        "zigzag",
        (2, 2, 1, 20, 4, 4),
        {"window": 3, "lengths": [17, 6]},
    ),
    "zigzag-3-sinks": (3, "zigzag", (2, 3, 1, 12, 4, 4), {"sinks": [0.5, -1.0, 2.0]}),
    "contiguous-2-scale": (2, "contiguous", (1, 2, 2, 10, 4, 4), {"scale": 0.3}),
    "zigzag-1": (1, "zigzag", (1, 2, 1, 8, 4, 4), {"window": 5}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_the_ring_in_threads_equals_one_process(ring_of, name):
    """out, lse, dQ, dK, dV (and d sinks, summed over the ranks) of P ranks equal one
    process's tiled engine, for each layout, GQA, padding lengths, a window, sinks, scale."""
    P, layout, shape, kw = CASES[name]
    q, k, v, dout = _inputs(*shape, seed=len(name))
    kw = dict(kw)
    sinks = torch.tensor(kw.pop("sinks"), dtype=F64) if "sinks" in kw else None
    got, dsinks, _ = _ring_run(ring_of(P), q, k, v, dout, layout, sinks=sinks, **kw)
    want, wsinks = _one_process(q, k, v, dout, sinks=sinks, **kw)
    for n, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        assert torch.equal(torch.isneginf(a), torch.isneginf(b)), n
        fin = torch.isfinite(b)
        torch.testing.assert_close(
            a[fin], b[fin], atol=1e-6 if n == "lse" else 1e-10, rtol=1e-6, msg=n
        )
    if sinks is not None:
        torch.testing.assert_close(dsinks, wsinks, atol=1e-10, rtol=1e-10)


def test_dropout_in_the_ring_is_one_processs_pattern(ring_of):
    """Rank 0's (seed, offset) goes to every rank (the others' generators are not read):
    P ranks drop what one process drops."""
    q, k, v, _ = _inputs(2, 2, 1, 16, 4, 4, seed=3)
    kw = {"window": 6, "dropout_p": 0.4}

    def rank(r):
        gen = torch.Generator().manual_seed(5 if r == 0 else 100 + r)
        return ring.ring_attention(
            *(_local(t, r, 2, "zigzag") for t in (q, k, v)), generator=gen, **kw
        )

    got = _whole(ring_of(2).run(rank), 2, "zigzag")
    want = attention(q, k, v, engine="tiled", generator=torch.Generator().manual_seed(5), **kw)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
    assert not torch.allclose(want, attention(q, k, v, engine="tiled", window=6))


@pytest.mark.parametrize(
    "P,layout,window,steps",
    [
        (4, "contiguous", None, 4),
        (4, "zigzag", None, 4),
        (4, "contiguous", 3, 2),
        (4, "contiguous", 6, 2),
        (4, "contiguous", 10, 3),
        (3, "zigzag", 2, 3),
        (1, "zigzag", None, 1),
    ],
)
def test_steps_bytes_kernel_calls_and_flops_are_what_the_plan_says(
    ring_of, P, layout, window, steps
):
    """RingStats: the steps a window leaves (every rank the same), the bytes each rank sends
    (k, v each step but the last, dK, dV every step when P > 1), one kernel call and
    score_flops per planned block pair (backward 2.5×), the transfers go to rank + 1 (dK, dV
    home on the last step)."""
    B, H, T, d_k, d_v = 1, 2, 8 * P, 4, 3
    q, k, v, dout = _inputs(B, H, H, T, d_k, d_v, seed=P)
    g = ring_of(P)
    got, _, stats = _ring_run(g, q, k, v, dout, layout, window=window)
    want, _ = _one_process(q, k, v, dout, window=window)
    torch.testing.assert_close(got[0], want[0], atol=1e-10, rtol=1e-10)
    T_local = T // P
    pattern = Pattern(window=window)
    kv = B * H * T_local * (d_k + d_v)  # elements of one k, v block
    for r, st in enumerate(stats):
        assert st.steps == steps
        pairs = [
            pair
            for t in range(steps)
            for pair in ring.plan(
                pattern, segments(r, P, T_local, layout), segments((r - t) % P, P, T_local, layout)
            )
        ]
        assert st.kernel_calls == 2 * len(pairs)
        units = sum(p.units for p in pairs)
        assert st.flops == pytest.approx(
            score_flops(B * H * units, d_k, d_v) * (1 + BACKWARD_FACTOR)
        )
        sent = 2 * (steps - 1) * kv * 8 + (steps * kv * 8 if P > 1 else 0)
        assert st.bytes_sent == sent
        assert st.wait_s >= 0
    for frm, to, tag, _ in g.sent:
        assert to == (frm + 1) % P or tag == ring._TAG_DKV, (frm, to, tag)


@pytest.mark.parametrize(
    "q_segs,kv_segs,window,kinds",
    [
        ([(0, 4)], [(0, 4)], None, ["partial"]),  # the same chunk: lower triangle
        ([(4, 4)], [(0, 4)], None, ["full"]),  # an earlier chunk: every key
        ([(0, 4)], [(4, 4)], None, []),  # a later chunk: skipped
        ([(0, 2), (6, 2)], [(2, 2), (4, 2)], None, ["full", "full"]),  # zigzag: 2 of 4 pairs
        ([(8, 4)], [(0, 4)], 3, []),  # a window: far earlier chunks are skipped
        ([(4, 4)], [(0, 4)], 3, ["partial"]),  # ... and near ones partly readable
        ([(4, 0)], [(0, 4)], None, []),  # an empty chunk: nothing to call
    ],
)
def test_plan_places_each_chunk_pair_and_keeps_what_M_leaves(q_segs, kv_segs, window, kinds):
    pairs = ring.plan(Pattern(window=window, lengths=[3]), q_segs, kv_segs)

    def starts(segs):  # local offset of each chunk -> its global start
        offs = [sum(n for _, n in segs[:i]) for i in range(len(segs))]
        return {o: a for o, (a, _) in zip(offs, segs)}

    got = []
    for p in pairs:
        n, m = p.qs.stop - p.qs.start, p.ks.stop - p.ks.start
        got.append("full" if p.units == n * m else "partial" if p.units == n * m / 2 else "?")
        assert p.pattern.lengths.tolist() == [3]  # lengths are left to the call
        assert p.pattern.q_start == starts(q_segs)[p.qs.start]
        assert p.pattern.k_start == starts(kv_segs)[p.ks.start]
        assert (n, m) in {(a, b) for _, a in q_segs for _, b in kv_segs}
        assert p.pattern.window == window and p.pattern.causal
    assert got == kinds
    if len(pairs) == 2:  # zigzag: the later query chunk (local rows 2:4) reads both key chunks
        assert [(p.qs, p.ks) for p in pairs] == [
            (slice(2, 4), slice(0, 2)),
            (slice(2, 4), slice(2, 4)),
        ]


def test_merge_folds_partials_by_log_sum_exp_and_keeps_empty_rows_zero():
    g = torch.Generator().manual_seed(0)
    o1, o2 = (
        torch.randn(2, 3, 4, generator=g, dtype=F64),
        torch.randn(2, 3, 4, generator=g, dtype=F64),
    )
    l1, l2 = torch.randn(2, 3, generator=g, dtype=F64), torch.randn(2, 3, generator=g, dtype=F64)
    l1[0, 0] = l2[0, 0] = float("-inf")  # a row neither part reads
    l2[1, 1] = float("-inf")  # a row only the first part reads
    out, lse = torch.zeros(2, 3, 4, dtype=F64), torch.full((2, 3), float("-inf"), dtype=F64)
    ring._merge(out, lse, o1, l1)
    ring._merge(out, lse, o2, l2)
    w = torch.logaddexp(l1, l2)
    want = torch.where(
        torch.isneginf(w)[..., None],
        0.0,
        (l1 - w).exp().nan_to_num(0.0)[..., None] * o1
        + (l2 - w).exp().nan_to_num(0.0)[..., None] * o2,
    )
    torch.testing.assert_close(out, want, atol=1e-14, rtol=1e-14)
    assert torch.equal(lse, w) and torch.equal(out[0, 0], torch.zeros(4, dtype=F64))
    torch.testing.assert_close(out[1, 1], o1[1, 1], atol=1e-15, rtol=0)


def test_pack_and_unpack_are_inverse():
    k, v = torch.randn(2, 3, 4, 5), torch.randn(2, 3, 4, 6)
    buf = ring._pack(k, v)
    assert buf.shape == (k.numel() + v.numel(),)
    k2, v2 = ring._unpack(buf, k.shape, v.shape)
    assert torch.equal(k2, k) and torch.equal(v2, v)
    assert k2.data_ptr() == buf.data_ptr()  # views of the one message, no copy


def test_shards_that_disagree_are_refused_naming_every_rank(ring_of):
    g = ring_of(2)

    def rank(r):
        x = torch.randn(1, 2, 4 + 2 * r, 4)
        with pytest.raises(ValueError) as e:
            ring.ring_attention(x, x, x, window=2 + r)
        return str(e.value)

    for msg in g.run(rank):
        assert "the ranks' shards disagree" in msg
        assert "rank 0: q (1, 2, 4, 4)" in msg and "rank 1: q (1, 2, 6, 4)" in msg
        assert "window 2" in msg and "window 3" in msg


def test_refusals_before_any_transfer(ring_of):
    g = ring_of(2)
    x, y = torch.randn(1, 2, 4, 4), torch.randn(1, 2, 6, 4)

    def rank(r):
        msgs = []
        for call in (
            lambda: ring.ring_attention(x[:, :, :3], x[:, :, :3], x[:, :, :3]),  # odd zigzag shard
            lambda: ring.ring_attention(x, y, y),  # q and k shards differ
            lambda: ring.ring_attention(x, x, x, layout="diagonal"),
            lambda: ring.ring_attention(x, x, x, lengths=[9]),  # T = 8
        ):
            with pytest.raises(ValueError) as e:
                call()
            msgs.append(str(e.value))
        return msgs

    for odd, differ, layout, lengths in g.run(rank):
        assert "zigzag" in odd and "2P = 4" in odd
        assert "q has T/P = 4 positions but k has 6" in differ
        assert "diagonal" in layout
        assert "ring_attention" in lengths and "T = P·T/P = 2·4" in lengths
    assert g.sent == []
