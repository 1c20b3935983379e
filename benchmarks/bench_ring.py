"""Ring attention on this machine: 1, 2 and 4 processes over gloo on loopback.

    .venv/bin/python benchmarks/bench_ring.py [--T 8192 --H 4 --d 64 --steps 2]

Per configuration: peak memory per rank (a forward+backward after a warm-up one, shards
included, above the level before it), payload bytes each rank sends per step, time per
forward+backward
step (slowest rank, median of the timed steps), block-pair FLOPs each rank computed (from
RingStats) and their max/min — the zigzag/contiguous balance —, the time ranks sat
blocked on transfers (max over ranks), and the CPU seconds all ranks used together with the
FLOP rate per CPU second (compute efficiency, independent of how the cores were shared). One torch
thread per rank, so P ranks use up to P cores; on a machine
with fewer free cores than P the time column measures sharing, not speed-up.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue as queue_mod
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from causalattn.distributed import RingStats, ring_attention
from causalattn.distributed.demo import PeakMemory, free_port
from causalattn.memory import pin_malloc


def _worker(rank, P, port, layout, a, out_q):
    try:
        torch.set_num_threads(1)
        pin_malloc()
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=P,
            timeout=timedelta(seconds=300),
        )
        T_local = a.T // P
        g = torch.Generator().manual_seed(rank)

        def step(stats):
            ql, kl, vl = (t.requires_grad_() for t in (q, k, v))
            out = ring_attention(ql, kl, vl, layout=layout, stats=stats)
            out.backward(dout)
            return ql, kl, vl

        def shards():
            return (torch.randn(1, a.H, T_local, a.d, generator=g) for _ in range(4))

        q, k, v, dout = shards()
        step(None)  # warm-up: one-time allocations (BLAS, gloo, imports) stay out of the peak
        del q, k, v, dout
        dist.barrier()
        with PeakMemory("cpu") as mem:  # shards are created inside: they are O(T/P) too
            q, k, v, dout = shards()
            step(None)
        stats, times, cpu = RingStats(), [], []
        for _ in range(a.steps):
            q, k, v = (t.detach() for t in (q, k, v))
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            step(stats)
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        bw = _pingpong(rank) if P == 2 and layout == "zigzag" else None
        out_q.put(
            (
                rank,
                dict(
                    peak=mem.bytes,
                    step=sorted(times)[len(times) // 2],
                    cpu=sum(cpu) / a.steps,
                    sent=stats.bytes_sent / a.steps,
                    flops=stats.flops / a.steps,
                    wait=stats.wait_s / a.steps,
                    bw=bw,
                ),
            )
        )
        dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001
        out_q.put((rank, f"{type(exc).__name__}: {exc}"))


def _pingpong(rank, mb=32, reps=5) -> float:
    """Loopback gloo bandwidth, GB/s: a 32 MiB tensor back and forth."""
    x = torch.ones(mb * 2**20 // 4)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(reps):
        if rank == 0:
            dist.send(x, 1)
            dist.recv(x, 1)
        else:
            dist.recv(x, 0)
            dist.send(x, 0)
    return 2 * reps * x.numel() * 4 / (time.perf_counter() - t0) / 1e9


def run(P, layout, a):
    ctx = mp.get_context("fork")  # children inherit the imported torch
    out_q, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_worker, args=(r, P, port, layout, a, out_q)) for r in range(P)]
    for p in procs:
        p.start()
    rows = {}
    try:
        while len(rows) < P:
            r, res = out_q.get(timeout=900)
            if isinstance(res, str):
                raise RuntimeError(f"P={P} {layout}: rank {r} failed: {res}")
            rows[r] = res
    except queue_mod.Empty:
        raise RuntimeError(
            f"P={P} {layout}: ranks {sorted(set(range(P)) - set(rows))} gave no result"
        ) from None
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return [rows[r] for r in range(P)]


def main():
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--T", type=int, default=8192)
    ap.add_argument("--H", type=int, default=4)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--P", type=int, nargs="+", default=[1, 2, 4])
    a = ap.parse_args()
    for P in a.P:
        if a.T % (2 * P):
            raise SystemExit(f"--T {a.T} must be a multiple of 2P = {2 * P}")
    print(
        f"ring attention, gloo on 127.0.0.1: B=1, H={a.H}, T={a.T}, d={a.d}, fp32, causal; "
        f"1 thread/rank; {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at start"
    )
    head = (
        f"{'P':>2} {'layout':<10} {'T/P':>5} {'peak MB/rank':>12} {'x P=1':>6} "
        f"{'MB sent/rank':>12} "
        f"{'step s':>7} {'GFLOP/rank min-max':>19} {'balance':>7} {'wait s':>6} {'CPU s':>6} "
        f"{'GFLOP/CPU s':>11}"
    )
    print(head)
    print("-" * len(head))
    base, bw = None, None
    for P in a.P:
        for layout in ["zigzag"] if P == 1 else ["zigzag", "contiguous"]:
            rows = run(P, layout, a)
            peak = max(r["peak"] for r in rows) / 2**20
            base = base or peak
            fl = [r["flops"] / 1e9 for r in rows]
            bw = bw or next((r["bw"] for r in rows if r["bw"]), None)
            print(
                f"{P:>2} {layout if P > 1 else '-':<10} {a.T // P:>5} {peak:>12.1f} "
                f"{peak / base:>6.2f} "
                f"{max(r['sent'] for r in rows) / 2**20:>12.1f} "
                f"{max(r['step'] for r in rows):>7.2f} "
                f"{min(fl):>9.2f}-{max(fl):<9.2f} {max(fl) / min(fl):>7.2f} "
                f"{max(r['wait'] for r in rows):>6.2f} "
                f"{sum(r['cpu'] for r in rows):>6.2f} "
                f"{sum(fl) / sum(r['cpu'] for r in rows):>11.1f}",
                flush=True,
            )
    if bw:
        print(f"gloo loopback bandwidth (32 MiB ping-pong, P=2): {bw:.2f} GB/s")
    print(f"load average {os.getloadavg()[0]:.1f} at the end (other jobs share these cores)")


if __name__ == "__main__":
    main()
