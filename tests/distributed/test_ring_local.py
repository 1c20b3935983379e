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
import time
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
    """An in-memory process group of P ranks, one per thread (torch.distributed's calls).

    ``group``: the ranks form a subgroup whose rank r is global rank ``offset + r`` (the
    peers of P2POp are global ranks, as in torch.distributed). ``fail`` = (rank, n): that
    rank's n-th batch_isend_irecv (from 0) raises, and what it would have sent arrives at
    its peers as an error, as a backend reports a peer that died."""

    def __init__(self, P: int, group=None, offset: int = 0, fail=None, fail_gather=None, delay=0.0):
        self.P, self.group, self.offset, self.fail = P, group, offset, fail
        self.fail_gather, self.delay = fail_gather, delay  # a rank whose all_gather raises
        self.me = threading.local()
        self.boxes: dict = {}  # (to, frm, tag) -> tensors, in order
        self.boxes_lock = threading.Lock()
        self.barrier = threading.Barrier(P, timeout=WAIT_S)
        self.gathered: list = [None] * P
        self.sent: list = []  # (frm, to, tag, numel), in send order (group ranks)
        self.calls = [0] * P  # batch_isend_irecv calls by rank
        self.gathers = 0  # all_gather calls, all ranks
        self.dist = types.SimpleNamespace(
            P2POp=self.p2p_op,
            isend="isend",
            irecv="irecv",
            batch_isend_irecv=self.batch_isend_irecv,
            all_gather=self.all_gather,
            get_global_rank=self.get_global_rank,
        )

    def p2p_op(self, op, tensor, peer, group, tag):
        assert op in ("isend", "irecv") and group is self.group, (op, group)
        assert tag in (ring._TAG_KV, ring._TAG_DKV), tag
        return (op, tensor, peer - self.offset, tag)

    def get_global_rank(self, group, r):
        assert group is not None and group is self.group, "the default group needs no mapping"
        assert isinstance(r, int) and 0 <= r < self.P, r
        return self.offset + r

    def rank_and_size(self, group=None):
        assert group is self.group, group
        return self.me.rank, self.P

    def box(self, key) -> queue.Queue:
        # under a lock: a defaultdict lets a sender and a receiver that meet a new key at
        # once each make a Queue, and the message goes to the one that is then replaced
        with self.boxes_lock:
            return self.boxes.setdefault(key, queue.Queue())

    def batch_isend_irecv(self, ops):
        me = self.me.rank
        n, self.calls[me] = self.calls[me], self.calls[me] + 1
        if self.fail == (me, n):
            for op, _, peer, tag in ops:
                if op == "isend":
                    self.box((peer, me, tag)).put(ConnectionError())
            raise RuntimeError("Connection reset by peer\n(a second line, not shown)")
        works = []
        for op, tensor, peer, tag in ops:
            assert 0 <= peer < self.P
            if op == "isend":
                self.box((peer, me, tag)).put(tensor.detach().clone())
                self.sent.append((me, peer, tag, tensor.numel()))
            else:
                works.append(
                    types.SimpleNamespace(wait=self._receiver(self.box((me, peer, tag)), tensor))
                )
        return works

    def _receiver(self, box, tensor):
        def wait():
            time.sleep(self.delay)
            got = box.get(timeout=WAIT_S)
            if isinstance(got, BaseException):
                raise got
            tensor.copy_(got)

        return wait

    def all_gather(self, every, mine, group=None):
        assert group is self.group, group
        if self.fail_gather == self.me.rank:
            self.barrier.abort()  # the others, waiting for this rank, are told at once
            raise RuntimeError("gloo: Connection closed by peer\n(a second line)")
        self.gathers += 1
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
    def make(P, **kw):
        g = _Threads(P, **kw)
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
        (2, "contiguous", 1, 1),  # each query reads itself: one step, dK, dV already home
    ],
)
def test_steps_bytes_kernel_calls_and_flops_are_what_the_plan_says(
    ring_of, P, layout, window, steps
):
    """RingStats: the steps a window leaves (every rank the same), the bytes each rank sends
    (k, v each step but the last, dK, dV every step when there are two or more; one step
    leaves them home), one kernel call and
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
        sent = 2 * (steps - 1) * kv * 8 + (steps * kv * 8 if steps > 1 else 0)
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
    assert g.sent == [] and g.gathers == 0


def test_a_ring_over_a_subgroup_sends_to_the_global_ranks_of_its_peers(ring_of):
    """torch.distributed's P2POp takes global ranks: a subgroup's rank r is mapped through
    get_global_rank, and the group goes with every operation."""
    P, layout, shape, kw = CASES["zigzag-3-gqa"]
    q, k, v, dout = _inputs(*shape, seed=11)
    sub = object()
    g = ring_of(P, group=sub, offset=5)
    got, _, _ = _ring_run(g, q, k, v, dout, layout, group=sub, **kw)
    want, _ = _one_process(q, k, v, dout, **kw)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    assert {(frm, to) for frm, to, tag, _ in g.sent if tag == ring._TAG_KV} == {
        (r, (r + 1) % P) for r in range(P)
    }


def _failing_run(g, P, layout="contiguous"):
    """Every rank's ring_attention (forward and backward) on its shard; its RingError."""
    q, k, v, dout = _inputs(1, 2, 2, 4 * P, 4, 4, seed=P)

    def rank(r):
        leaves = [_local(t, r, P, layout).clone().requires_grad_() for t in (q, k, v)]
        try:
            out = ring.ring_attention(*leaves, layout=layout)
            (out * _local(dout, r, P, layout)).sum().backward()
        except ring.RingError as exc:
            return exc
        return None

    return g.run(rank)


_TAIL = (
    ". Most likely another rank raised or died first (its own traceback says why); a silent "
    "peer is given up on after the process group's timeout (init_process_group(timeout=...))."
)


@pytest.mark.parametrize(
    "fail, phase, step, what",
    [
        (0, "forward", 1, "the k, v block"),  # the first call: forward's first step
        (1, "backward", 1, "the k, v block"),  # the second: backward's first k, v
        (2, "backward", 1, "the dk, dv gradients"),
        (3, "backward", 2, "the dk, dv gradients"),  # the last, sending them home
    ],
)
def test_a_failed_transfer_names_the_phase_step_what_and_both_peers(
    ring_of, fail, phase, step, what
):
    """The rank whose transfer fails says what it was exchanging, when, and with whom (the
    first line of the backend's message); its peer, left waiting for what it would have
    sent, says the same with the backend's error name."""
    g = ring_of(2, fail=(1, fail))
    errors = _failing_run(g, 2)
    own = f"ring_attention ({phase}, step {step} of 2): rank 1 exchanging {what} "
    assert str(errors[1]) == (
        own + "(receiving from rank 0, sending to rank 0) failed: Connection reset by peer" + _TAIL
    )
    assert isinstance(errors[1].__cause__, RuntimeError)
    assert str(errors[0]) == (
        f"ring_attention ({phase}, step {step} of 2): rank 0 exchanging {what} "
        "(receiving from rank 1, sending to rank 1) failed: ConnectionError" + _TAIL
    )
    assert isinstance(errors[0].__cause__, ConnectionError)


def test_wait_time_adds_up_over_every_transfer(ring_of):
    g = ring_of(2, delay=0.02)
    t0 = time.perf_counter()
    _, _, stats = _ring_run(g, *_inputs(1, 2, 2, 8, 4, 4), "zigzag")
    wall = time.perf_counter() - t0
    for r, st in enumerate(stats):
        assert g.calls[r] == 4  # forward's k, v; backward's k, v and two dK, dV
        assert 0.02 * g.calls[r] <= st.wait_s <= wall


def test_stats_add_up_over_calls(ring_of):
    q, k, v, _ = _inputs(1, 2, 2, 8, 4, 4)
    g = ring_of(2)
    once, twice = [ring.RingStats() for _ in range(2)], [ring.RingStats() for _ in range(2)]

    def rank(r):
        x = [_local(t, r, 2, "zigzag") for t in (q, k, v)]
        ring.ring_attention(*x, stats=once[r])
        for _ in range(2):
            ring.ring_attention(*x, stats=twice[r])

    g.run(rank)
    for a, b in zip(once, twice):
        assert a.steps == 2 and b.steps == 4
        assert (b.kernel_calls, b.bytes_sent, b.flops) == (
            2 * a.kernel_calls,
            2 * a.bytes_sent,
            2 * a.flops,
        )


def test_empty_shards_take_one_step_and_give_empty_outputs(ring_of):
    g = ring_of(2)
    stats = [ring.RingStats() for _ in range(2)]

    def rank(r):
        x = torch.zeros(1, 2, 0, 4, dtype=F64)
        return ring.ring_attention(x, x, x, layout="contiguous", stats=stats[r])

    assert [tuple(o.shape) for o in g.run(rank)] == [(1, 2, 0, 4)] * 2
    assert [st.steps for st in stats] == [1, 1] and g.sent == []


def test_a_bfloat16_ring_returns_bfloat16_close_to_one_process(ring_of):
    q, k, v, _ = _inputs(1, 2, 2, 16, 4, 4, seed=4)
    half = [t.to(torch.bfloat16) for t in (q, k, v)]

    def rank(r):
        return ring.ring_attention(*(_local(t, r, 2, "zigzag") for t in half))

    got = _whole(ring_of(2).run(rank), 2, "zigzag")
    assert got.dtype == torch.bfloat16
    want = attention(*half, engine="tiled")
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


def test_a_mask_mod_that_reads_b_is_planned_for_every_sequence(ring_of):
    """Sequence 0 reads only its own position, sequence 1 every earlier one: the blocks only
    sequence 1 reads must still be computed."""

    def mask_mod(b, h, q_idx, kv_idx):
        return (b == 1) | (q_idx == kv_idx)

    q, k, v, dout = _inputs(2, 1, 1, 16, 4, 4, seed=6)
    got, _, _ = _ring_run(ring_of(2), q, k, v, dout, "contiguous", mask_mod=mask_mod)
    want, _ = _one_process(q, k, v, dout, mask_mod=mask_mod)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    pattern = Pattern(mask_mod=mask_mod)
    two = ring.plan(pattern, [(8, 8)], [(0, 8)], B=2)  # rank 1 against rank 0's block
    assert len(two) == 1 and two[0].units == 8 * 8 / 2  # "partial": the rows disagree
    assert ring.plan(pattern, [(8, 8)], [(0, 8)]) == []  # one row (b = 0): nothing read
    assert (
        ring.plan(Pattern(mask_mod=lambda b, h, q, kv: b == 0), [(8, 8)], [(0, 8)], B=2)[0].units
        == 8 * 8 / 2
    )


def test_plan_places_chunks_at_their_local_offsets():
    pairs = ring.plan(Pattern(), [(8, 2), (10, 3), (13, 1)], [(0, 2), (2, 3), (5, 3)])
    assert [(p.qs, p.ks) for p in pairs] == [
        (slice(a, b), slice(c, d))
        for a, b in ((0, 2), (2, 5), (5, 6))
        for c, d in ((0, 2), (2, 5), (5, 8))
    ]
    assert all(p.units == (p.qs.stop - p.qs.start) * (p.ks.stop - p.ks.start) for p in pairs)
    # a window that reaches the chunk's first key only from its first query: partial
    (near,) = ring.plan(Pattern(window=7), [(4, 4)], [(0, 4)])
    assert near.units == 4 * 4 / 2


def _readable_pairs(P, layout, T, pattern, B):
    """Per rank: the planned block pairs (over the ring steps) with any readable cell."""
    allowed = pattern.allowed(B, 1, T, T)[:, 0]
    T_local, out = T // P, []
    for r in range(P):
        q_segs = segments(r, P, T_local, layout)
        q_pos = torch.cat([torch.arange(s, s + n) for s, n in q_segs])
        count = 0
        for t in range(P):
            kv_segs = segments((r - t) % P, P, T_local, layout)
            k_pos = torch.cat([torch.arange(s, s + n) for s, n in kv_segs])
            for pair in ring.plan(Pattern(), q_segs, kv_segs):
                cells = allowed[:, q_pos[pair.qs]][:, :, k_pos[pair.ks]]
                count += bool(cells.any())
        out.append(count)
    return out


@pytest.mark.parametrize(
    "P, layout, B, H, lengths",
    [
        (2, "zigzag", 2, 1, [6, 10]),
        (2, "contiguous", 3, 1, [2, 3, 16]),  # more sequences than heads; the last is whole
        (4, "zigzag", 2, 2, [5, 30]),
        (3, "contiguous", 2, 1, [0, 7]),
    ],
)
def test_block_pairs_that_padding_leaves_empty_are_not_computed(ring_of, P, layout, B, H, lengths):
    T = 8 * P
    q, k, v, dout = _inputs(B, H, H, T, 4, 4, seed=P + B)
    got, _, stats = _ring_run(ring_of(P), q, k, v, dout, layout, lengths=lengths)
    want, _ = _one_process(q, k, v, dout, lengths=lengths)
    for a, b in zip(got[:1] + got[2:], want[:1] + want[2:]):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)
    calls = _readable_pairs(P, layout, T, Pattern(lengths=lengths), B)
    assert [st.kernel_calls for st in stats] == [2 * c for c in calls]  # forward and backward


def test_the_cpu_block_kernels_are_the_native_engines_where_it_is_built(monkeypatch):
    from causalattn.engines import cpp, registry

    cpu = torch.device("cpu")
    want = "tiled" if cpp.unavailable() else "cpp"
    assert ring._kernels(cpu) is registry.engine(want).load()
    monkeypatch.setattr(registry, "refusal", lambda name, f: "no build here")
    assert ring._kernels(cpu) is registry.engine("tiled").load()


def test_cuda_block_kernels_are_the_triton_engines_and_other_devices_are_refused(monkeypatch):
    import importlib

    cuda = types.SimpleNamespace(type="cuda")
    kernels = types.SimpleNamespace(fwd=lambda p: None, bwd=lambda *a: None)
    asked = []

    def fake_import(name, mods={}):  # noqa: B006 - the modules "installed"
        asked.append(name)
        if name not in mods:
            raise ImportError(name)
        return mods[name]

    monkeypatch.setattr(
        importlib, "import_module", lambda n: fake_import(n, {"causalattn.engines.triton": kernels})
    )
    assert ring._kernels(cuda) is kernels and asked == ["causalattn.engines.triton"]
    message = (
        "ring_attention: no block kernels for {} tensors here: the cpp and tiled engines run "
        "on CPU only, and CUDA tensors need the triton engine (pip install 'causalattn[gpu]')"
    )
    for mods in (
        {},
        {"causalattn.engines.triton": types.SimpleNamespace(fwd=kernels.fwd)},
        {"causalattn.engines.triton": types.SimpleNamespace(bwd=kernels.bwd)},
    ):
        monkeypatch.setattr(importlib, "import_module", lambda n, m=mods: fake_import(n, m))
        with pytest.raises(ValueError) as e:
            ring._kernels(cuda)
        assert str(e.value) == message.format("cuda")
    with pytest.raises(ValueError) as e:
        ring._kernels(torch.device("meta"))
    assert str(e.value) == message.format("meta")


def test_a_failed_all_gather_names_the_rank_and_the_backends_first_line(ring_of):
    g = ring_of(2, fail_gather=1)

    def rank(r):
        x = torch.zeros(1, 2, 4, 4, dtype=F64)
        with pytest.raises(ring.RingError) as e:
            ring.ring_attention(x, x, x)
        return str(e.value)

    tail = "). Another rank probably raised before calling ring_attention, or died."
    mine, peer = g.run(rank)[::-1]
    assert mine == (
        "ring_attention: rank 1 could not check its shard against the other ranks "
        "(all_gather failed: gloo: Connection closed by peer" + tail
    )
    assert peer == (
        "ring_attention: rank 0 could not check its shard against the other ranks "
        "(all_gather failed: BrokenBarrierError()" + tail
    )


def test_shards_that_disagree_are_refused_with_every_ranks_problem_in_full(ring_of):
    """Shapes, dtype, layout, the lengths' checksum (order-sensitive, modulo 1,000,003) and
    the window, every rank's, in the one message every rank raises."""
    many = [200] * 100  # Σ (i + 1)·200 = 1,010,000: past the modulus
    kw = [
        dict(dtype=F64, H_kv=1, d_v=3, layout="contiguous", lengths=[3, 7], window=3),
        dict(dtype=torch.float32, H_kv=2, d_v=5, layout="zigzag", lengths=None, window=None),
    ]

    def problem(r, B=2, T=4):
        a = kw[r]
        q = torch.zeros(B, 2, T, 4, dtype=a["dtype"])
        k = torch.zeros(B, a["H_kv"], T, 4, dtype=a["dtype"])
        v = torch.zeros(B, a["H_kv"], T, a["d_v"], dtype=a["dtype"])
        return q, k, v

    def rank(r):
        q, k, v = problem(r)
        a = kw[r]
        with pytest.raises(ValueError) as e:
            ring.ring_attention(
                q, k, v, layout=a["layout"], lengths=a["lengths"], window=a["window"]
            )
        return str(e.value)

    msgs = ring_of(2).run(rank)
    want = (
        "ring_attention: the ranks' shards disagree (rank 0: q (2, 2, 4, 4), k (2, 1, 4, 4), "
        "v (…, 3), torch.float64, layout 'contiguous', lengths checksum 17, window 3; "
        "rank 1: q (2, 2, 4, 4), k (2, 2, 4, 4), v (…, 5), torch.float32, layout 'zigzag', "
        "lengths none, window none); every rank must pass its shard (B, H, T/P, d) of the same "
        "sequence, with the same layout, lengths and window"
    )
    assert msgs == [want, want]
    # the same lengths in another order, and lengths past the modulus
    kw[:] = [dict(kw[0], lengths=[7, 3]), dict(kw[0], lengths=[3, 7], window=None)]
    m = ring_of(2).run(rank)[0]
    assert "rank 0: q (2, 2, 4, 4), k (2, 1, 4, 4), v (…, 3), torch.float64, layout " in m
    assert "lengths checksum 13, window 3; rank 1:" in m and "checksum 17, window none)" in m
    kw[:] = [dict(kw[0], lengths=many), dict(kw[0], lengths=many, window=4)]

    def big(r):
        q = torch.zeros(100, 1, 100, 2, dtype=F64)
        with pytest.raises(ValueError) as e:
            ring.ring_attention(q, q, q, layout="contiguous", lengths=many, window=kw[r]["window"])
        return str(e.value)

    m = ring_of(2).run(big)[0]
    assert "lengths checksum 9997, window 3; rank 1:" in m and "checksum 9997, window 4)" in m

    # no sequences: lengths [] is a checksum of 0, beside a rank that gives none
    def empty(r):
        x = torch.zeros(0, 2, 4, 4, dtype=F64)
        with pytest.raises(ValueError) as e:
            ring.ring_attention(x, x, x, lengths=[] if r == 0 else None)
        return str(e.value)

    m = ring_of(2).run(empty)[0]
    assert "float64, layout 'zigzag', lengths checksum 0, window none; rank 1:" in m
    assert m.count("lengths none") == 1
    # a window on one rank and none on another disagree too
    kw[:] = [dict(kw[0], lengths=None, window=1), dict(kw[0], lengths=None, window=None)]
    assert "window 1; rank 1:" in ring_of(2).run(rank)[0]


@pytest.mark.parametrize(
    "call, message",
    [
        (
            lambda x, y: ring.ring_attention(x, y, y),
            "ring_attention: q has T/P = 4 positions but k has 6; ring attention is "
            "self-attention, every rank holds the same positions of q, k and v",
        ),
        (
            lambda x, y: ring.ring_attention(x, x, x, lengths=[4]),
            "ring_attention: lengths must be a 1-D integer array (B,) = (2,), got shape (1,) and "
            "dtype int64",
        ),
        (
            lambda x, y: ring.ring_attention(x, x, x, sinks=torch.zeros(3)),
            "sinks: expected one logit per head, shape (H,) = (2,), got (3,)",
        ),
        (
            lambda x, y: ring.ring_attention(x, x, x, window=0),
            "mask: window must be >= 1, got 0",
        ),
    ],
)
def test_local_refusals_in_full(ring_of, call, message):
    g = ring_of(2)
    x, y = torch.zeros(2, 2, 4, 3, dtype=F64), torch.zeros(2, 2, 6, 3, dtype=F64)

    def rank(r):
        with pytest.raises(ValueError) as e:
            call(x, y)
        return str(e.value)

    assert g.run(rank) == [message, message] and g.sent == [] and g.gathers == 0
