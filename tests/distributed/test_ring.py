"""Ring attention over gloo on loopback (127.0.0.1): 2 and 4 processes spawned here.

Each spawn runs every case (layouts, GQA, T not a multiple of 2P, padding lengths) and
sends rank 0's gathered results back; the tests compare them with the single-process
tiled engine and the float64 reference. Fault tests: a rank that raises mid-ring makes
its peer fail with RingError, within the process-group timeout, nothing hangs.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_mod
import time
import traceback
import zlib
from datetime import timedelta

import pytest
import torch

from causalattn.distributed.demo import free_port
from causalattn.engines import attention, contract, exact, make_problem

# free_port() then bind: one such test at a time across xdist workers (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("loopback_ports")

# name: (B, H_q, H_kv, T as a function of P, d_k, d_v, layout, lengths as a function of T)
CASES = {
    "zigzag": (2, 4, 2, lambda P: 8 * P, 8, 6, "zigzag", None),
    "contiguous": (2, 4, 2, lambda P: 8 * P, 8, 6, "contiguous", None),
    "zigzag-T-not-multiple": (1, 2, 2, lambda P: 6 * P + 3, 8, 8, "zigzag", None),
    "contiguous-T-not-multiple": (1, 2, 1, lambda P: 3 * P + 1, 8, 8, "contiguous", None),
    "zigzag-lengths": (3, 2, 1, lambda P: 8 * P, 8, 8, "zigzag", lambda T: [T, 5, 0]),
    "contiguous-lengths": (2, 2, 2, lambda P: 8 * P, 8, 8, "contiguous", lambda T: [T - 1, 7]),
    "zigzag-T-not-multiple-lengths": (
        2,
        2,
        1,
        lambda P: 4 * P + 1,
        8,
        8,
        "zigzag",
        lambda T: [T, 3],
    ),
    "zigzag-window": (2, 4, 2, lambda P: 8 * P, 8, 6, "zigzag", None),
    "contiguous-window-lengths": (
        2,
        2,
        2,
        lambda P: 8 * P,
        8,
        8,
        "contiguous",
        lambda T: [T - 1, 7],
    ),
    "zigzag-sinks": (2, 4, 2, lambda P: 8 * P, 8, 6, "zigzag", None),
    "zigzag-window-sinks-dropout": (1, 4, 2, lambda P: 8 * P, 8, 8, "zigzag", None),
}
# the pattern keywords beyond causal + lengths (sinks become a learned (H_q,) tensor)
EXTRA = {
    "zigzag-window": {"window": 5},
    "contiguous-window-lengths": {"window": 3},  # a window shorter than a shard: fewer steps
    "zigzag-sinks": {"sinks": [0.5, -1.0, 2.0, 0.0]},
    "zigzag-window-sinks-dropout": {"window": 6, "sinks": [0.0, 1.0, -2.0, 0.5], "dropout_p": 0.3},
}


def _extra(name: str):
    """(keywords, sinks tensor or None): a fresh leaf for sinks, a seeded generator for dropout."""
    kw = dict(EXTRA.get(name, {}))
    sinks = None
    if "sinks" in kw:
        sinks = kw["sinks"] = torch.tensor(kw["sinks"], requires_grad=True)
    if kw.get("dropout_p"):
        kw["generator"] = torch.Generator().manual_seed(7)
    return kw, sinks


NAMES = ("out", "lse", "dq", "dk", "dv")
# fork: children start at once with torch loaded (a fresh interpreter costs seconds per rank);
# workers set 1 torch thread before any op, so no inherited thread pool is used.
_START = "fork"
SPAWN_TIMEOUT = 120  # s; a healthy spawn takes a few seconds


def _inputs(name: str, P: int):
    B, H_q, H_kv, T_of, d_k, d_v, layout, len_of = CASES[name]
    T = T_of(P)
    g = torch.Generator().manual_seed(zlib.crc32(f"{name}/{P}".encode()))
    q = torch.randn(B, H_q, T, d_k, generator=g)
    k = torch.randn(B, H_kv, T, d_k, generator=g)
    v = torch.randn(B, H_kv, T, d_v, generator=g)
    dout = torch.randn(B, H_q, T, d_v, generator=g)
    lengths = None if len_of is None else torch.tensor(len_of(T))
    return q, k, v, dout, lengths, layout


def _init(rank, P, port, timeout_s):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=P,
        timeout=timedelta(seconds=timeout_s),
    )
    return dist


def _check_worker(rank, P, port, out_q):
    """Every case on this rank; rank 0 sends the gathered results back."""
    try:
        dist = _init(rank, P, port, 60)
        from causalattn.distributed import RingStats, positions, ring_attention, shard, unshard

        results = {}
        for name in CASES:
            q, k, v, dout, lengths, layout = _inputs(name, P)
            T = q.shape[2]
            ql, kl, vl = (shard(t, layout=layout).requires_grad_() for t in (q, k, v))
            kw, sinks = _extra(name)
            stats = RingStats()
            out, lse = ring_attention(
                ql, kl, vl, layout=layout, lengths=lengths, return_lse=True, stats=stats, **kw
            )
            (out * shard(dout, layout=layout)).sum().backward()
            got = {
                n: unshard(t, layout=layout, length=T)
                for n, t in zip(NAMES, (out, lse, ql.grad, kl.grad, vl.grad))
            }
            if sinks is not None:  # each rank's share of d sinks, summed as DDP would
                dist.all_reduce(sinks.grad)
                got["dsinks"] = sinks.grad
            if rank == 0:
                results[name] = {n: t.numpy() for n, t in got.items()}
                results[name]["steps"] = stats.steps
            if lengths is not None:  # NaN past each length must change nothing, gradients included
                bad = torch.arange(T)[None, :] >= lengths[:, None]  # (B, T)
                q, k, v = (t.masked_fill(bad[:, None, :, None], float("nan")) for t in (q, k, v))
                ql, kl, vl = (shard(t, layout=layout).requires_grad_() for t in (q, k, v))
                kw, _ = _extra(name)
                out, lse = ring_attention(
                    ql, kl, vl, layout=layout, lengths=lengths, return_lse=True, **kw
                )
                (out * shard(dout, layout=layout)).sum().backward()
                got = [
                    unshard(t, layout=layout, length=T)
                    for t in (out, lse, ql.grad, kl.grad, vl.grad)
                ]
                if rank == 0:
                    results[name + "-nan"] = {n: t.numpy() for n, t in zip(NAMES, got)}
        # bf16 in, fp32 merge: gathered output and gradients for the accuracy rule
        q, k, v, dout, _, _ = _inputs("zigzag", P)
        ql, kl, vl = (shard(t.bfloat16()).requires_grad_() for t in (q, k, v))
        out = ring_attention(ql, kl, vl)
        (out * shard(dout.bfloat16())).sum().backward()
        got = [unshard(t, length=q.shape[2]).float() for t in (out, ql.grad, kl.grad, vl.grad)]
        if rank == 0:
            results["bf16"] = {n: t.numpy() for n, t in zip(("out", "dq", "dk", "dv"), got)}
        # global positions of the local rows, as shard() lays them out
        for layout in ("zigzag", "contiguous"):
            results[f"positions-{layout}"] = torch.equal(
                positions(8, layout=layout), shard(torch.arange(8 * P), layout=layout, dim=0)
            )
        if P == 4:  # two rings of 2 on subgroups {0, 1} and {2, 3}: group ranks != global ranks
            pair = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
            q, k, v, dout, _, _ = _inputs("zigzag", 2)
            ql, kl, vl = (shard(t, group=pair).requires_grad_() for t in (q, k, v))
            out = ring_attention(ql, kl, vl, group=pair)
            (out * shard(dout, group=pair)).sum().backward()
            got = [unshard(t, group=pair) for t in (out, ql.grad, kl.grad, vl.grad)]
            results["subgroup"] = {n: t.numpy() for n, t in zip(("out", "dq", "dk", "dv"), got)}
        # refusals: an odd shard under zigzag, and shards that disagree across ranks
        errors = {}
        x = torch.randn(1, 2, 3, 4)
        try:
            ring_attention(x, x, x, layout="zigzag")
        except ValueError as exc:
            errors["odd"] = str(exc)
        y = torch.randn(1, 2, 4 + 2 * rank, 4)  # each rank a different T/P
        try:
            ring_attention(y, y, y, layout="zigzag")
        except ValueError as exc:
            errors["disagree"] = str(exc)
        m = torch.empty(1, 2, 4, 4, device="meta")
        try:
            ring_attention(m, m, m)
        except ValueError as exc:
            errors["device"] = str(exc)
        out_q.put((rank, "ok", results, errors))
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - report, the parent fails the tests
        out_q.put((rank, "error", traceback.format_exc(), {}))


def _fault_worker(rank, P, port, out_q, mode, release):
    """Rank 1 raises inside its second-step kernel; rank 0 must get a RingError."""
    try:
        _init(rank, P, port, 3 if mode == "alive" else 30)
        from causalattn.distributed import ring_attention, shard
        from causalattn.distributed.ring import _kernels

        if rank == 1:
            kernels = _kernels(torch.device("cpu"))  # the block kernels the ring calls
            real, calls = kernels.fwd, [0]

            def failing(p):
                calls[0] += 1
                if calls[0] > 3:  # step 0 (own block) needs 3 calls under zigzag
                    raise RuntimeError("injected failure on rank 1")
                return real(p)

            kernels.fwd = failing
        q = torch.randn(1, 2, 16, 8)
        ql, kl, vl = (shard(q).requires_grad_() for _ in range(3))
        t0 = time.monotonic()
        try:
            ring_attention(ql, kl, vl).sum().backward()
            out_q.put((rank, "finished", None, time.monotonic() - t0))
        except Exception as exc:  # noqa: BLE001
            out_q.put((rank, type(exc).__name__, str(exc), time.monotonic() - t0))
            if rank == 1 and mode == "alive":
                release.wait(30)  # stay alive and silent: the peer must time out
    except BaseException:  # noqa: BLE001
        out_q.put((rank, "error", traceback.format_exc(), 0.0))
    out_q.close()
    out_q.join_thread()  # flush the report before leaving
    os._exit(0)  # no teardown handshake with a dead ring


def _spawn(target, P, *extra, wait_for=None, timeout=SPAWN_TIMEOUT):
    """Run ``target(rank, P, port, queue, *extra)`` in P processes; the messages by rank."""
    ctx = mp.get_context(_START)
    out_q = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=target, args=(r, P, port, out_q, *extra), daemon=True) for r in range(P)
    ]
    for p in procs:
        p.start()
    got, deadline = {}, time.monotonic() + timeout
    try:
        while len(got) < (wait_for or P):
            try:
                msg = out_q.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue_mod.Empty:
                break
            got[msg[0]] = msg
    finally:
        if extra and hasattr(extra[-1], "set"):
            extra[-1].set()
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    return got


_RESULTS: dict[int, dict] = {}


def _results(P: int):
    if P not in _RESULTS:
        _RESULTS[P] = _spawn(_check_worker, P)
    got = _RESULTS[P]
    missing = [r for r in range(P) if r not in got]
    assert not missing, f"ranks {missing} sent nothing within {SPAWN_TIMEOUT} s"
    for r in range(P):
        assert got[r][1] == "ok", f"rank {r} failed:\n{got[r][2]}"
    return got


def _expected(name: str, P: int):
    """Single-process tiled engine and the float64 reference, with their gradients."""
    q, k, v, dout, lengths, _ = _inputs(name, P)
    res = {}
    for engine, dtype in (("tiled", torch.float32), ("reference", torch.float64)):
        qq, kk, vv = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
        kw, sinks = _extra(name)
        if sinks is not None:
            sinks = kw["sinks"] = sinks.detach().to(dtype).requires_grad_()
        out = attention(qq, kk, vv, lengths=lengths, engine=engine, **kw)
        # lse without dropout (dropout acts after the softmax, lse is the same)
        kw.pop("dropout_p", None), kw.pop("generator", None)
        lse = attention(
            qq.detach(),
            kk.detach(),
            vv.detach(),
            lengths=lengths,
            engine=engine,
            return_lse=True,
            **{**kw, "sinks": None if sinks is None else sinks.detach()},
        )[1]
        (out * dout.to(dtype)).sum().backward()
        res[engine] = dict(zip(NAMES, (out.detach(), lse, qq.grad, kk.grad, vv.grad)))
        if sinks is not None:
            res[engine]["dsinks"] = sinks.grad
    return res


def _close(got, want, what):
    got = torch.as_tensor(got).double()
    want = want.detach().double()
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    fin = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), fin), f"{what}: -inf rows differ"
    err = (got[fin] - want[fin]).abs().max().item() if fin.any() else 0.0
    tol = 2e-5 * (1 + want[fin].abs().max().item()) if fin.any() else 0.0
    assert err <= tol, f"{what}: max error {err:.3g} > {tol:.3g}"


@pytest.mark.parametrize("P", [2, 4])
@pytest.mark.parametrize("name", list(CASES))
def test_matches_single_process(P, name):
    got = _results(P)[0][2][name]
    want = _expected(name, P)
    for n in want["tiled"]:
        _close(got[n], want["tiled"][n], f"{name}, P={P}, {n} vs tiled")
        _close(got[n], want["reference"][n], f"{name}, P={P}, {n} vs float64 reference")


@pytest.mark.parametrize("P", [2, 4])
def test_a_window_shorter_than_a_shard_takes_fewer_ring_steps(P):
    """contiguous shards of 8 and window 3: queries read their own shard and the one before."""
    got = _results(P)[0][2]
    assert got["contiguous-window-lengths"]["steps"] == 2
    assert got["zigzag"]["steps"] == P


@pytest.mark.parametrize("P", [2, 4])
@pytest.mark.parametrize("name", [n for n in CASES if CASES[n][7] is not None])
def test_nan_past_lengths_changes_nothing(P, name):
    got = _results(P)[0][2][name + "-nan"]
    want = _expected(name, P)["tiled"]  # computed from the clean inputs
    for n in NAMES:
        _close(got[n], want[n], f"{name} with NaN padding, P={P}, {n}")


def _with_grads(forward, q, k, v, dout):
    """``forward(problem)`` on the causal problem of q, k, v: [out, dq, dk, dv]."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = forward(make_problem(q, k, v))
    out.backward(dout)
    return [out.detach(), q.grad, k.grad, v.grad]


@pytest.mark.parametrize("P", [2, 4])
def test_bf16_accuracy_rule(P):
    """docs/design.md: max|ring - ref64| <= 2·max|plain_bf16 - ref64| + floor, for H, dQ, dK, dV."""
    got = _results(P)[0][2]["bf16"]
    q, k, v, dout, _, _ = _inputs("zigzag", P)
    q, k, v, dout = (t.bfloat16() for t in (q, k, v, dout))
    ref = _with_grads(exact.forward, *(t.double() for t in (q, k, v, dout)))
    plain = _with_grads(lambda p: contract.plain(p, torch.bfloat16), q, k, v, dout)
    for n, g, r, p in zip(
        ("out", "dq", "dk", "dv"),
        (torch.as_tensor(got[n]) for n in ("out", "dq", "dk", "dv")),
        ref,
        plain,
    ):
        err = (g.double() - r).abs().max().item()
        bound = 2 * (p.double() - r).abs().max().item() + 1e-3
        assert err <= bound, f"bf16 P={P} {n}: ring error {err:.3g} > {bound:.3g}"


@pytest.mark.parametrize("P", [2, 4])
def test_positions_match_shard(P):
    got = _results(P)
    for r in range(P):
        assert got[r][2]["positions-zigzag"] and got[r][2]["positions-contiguous"], r


def test_subgroups():
    """Ranks {0, 1} and {2, 3} of a 4-process world each run their own ring of 2."""
    got = _results(4)
    want = _expected("zigzag", 2)["tiled"]
    for r in (0, 2):
        for n in ("out", "dq", "dk", "dv"):
            _close(got[r][2]["subgroup"][n], want[n], f"subgroup ring on rank {r}, {n}")


@pytest.mark.parametrize("P", [2, 4])
def test_refuses_clearly(P):
    got = _results(P)
    for r in range(P):
        errors = got[r][3]
        assert "T/P = 3" in errors.get("odd", "") and f"2P = {2 * P}" in errors["odd"], errors
        assert (
            "disagree" in errors.get("disagree", "")
            and "rank 1: q (1, 2, 6, 4)" in errors["disagree"]
        ), errors
        assert "no block kernels for meta tensors" in errors.get("device", ""), errors


@pytest.mark.parametrize("mode", ["alive", "exit"])
def test_failing_rank_fails_peer(mode):
    """Rank 1 raises mid-ring. 'alive': it stays up and silent, so rank 0 gives up after the
    3 s process-group timeout. 'exit': its process ends, so rank 0 fails as soon as the
    connection drops, long before its 30 s timeout."""
    release = mp.get_context(_START).Event()
    t0 = time.monotonic()
    got = _spawn(_fault_worker, 2, mode, release, timeout=40)
    assert time.monotonic() - t0 < 40
    assert got.get(1, (None, None))[1:3] == ("RuntimeError", "injected failure on rank 1"), got
    assert 0 in got, f"rank 0 reported nothing: {got}"
    _, kind, msg, elapsed = got[0]
    assert kind == "RingError", got[0]
    assert "ring_attention" in msg and "rank 0" in msg and "another rank" in msg, msg
    if mode == "alive":
        assert 2.5 < elapsed < 15 and "Timed out" in msg, (elapsed, msg)
    else:
        assert elapsed < 10, f"rank 0 took {elapsed:.1f} s to fail"


@pytest.mark.parametrize("P", [2, 4, 8])
def test_zigzag_is_the_documented_layout_and_balances_the_causal_work(P):
    """Rank r holds chunks r and 2P-1-r; under the causal mask every rank then computes the
    same number of score entries, while contiguous shards leave the last rank 2P-1 times the
    first one's work (layout.py's docstring)."""
    from causalattn.distributed.layout import segments
    from causalattn.distributed.ring import plan
    from causalattn.masks import Pattern

    c = 4
    for r in range(P):
        assert segments(r, P, 2 * c, "zigzag") == [(r * c, c), ((2 * P - 1 - r) * c, c)]
        assert segments(r, P, 2 * c, "contiguous") == [(r * 2 * c, 2 * c)]

    def work(layout):
        return [
            sum(
                pair.units
                for src in range(P)
                for pair in plan(
                    Pattern(), segments(r, P, 2 * c, layout), segments(src, P, 2 * c, layout)
                )
            )
            for r in range(P)
        ]

    zig, cont = work("zigzag"), work("contiguous")
    assert len(set(zig)) == 1, zig
    assert cont[-1] == (2 * P - 1) * cont[0], cont
    assert sum(zig) == sum(cont) == (2 * P * c) ** 2 / 2  # diagonal blocks counted as halves
