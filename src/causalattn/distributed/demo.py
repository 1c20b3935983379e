"""One causal sequence split over N processes; per-rank memory and time, checked at small sizes.

    torchrun --nproc_per_node 4 --master_addr 127.0.0.1 --master_port 29512 \\
        -m causalattn.distributed.demo --T 4096

Without torchrun it runs as a single process (P = 1). gloo on CPU; NCCL (one GPU per process)
when CUDA is there and has block kernels (see ring._kernels). ``--check`` (default for T <= 4096)
compares the gathered output and
gradients with the single-process engine on rank 0.
"""

from __future__ import annotations

import argparse
import os
import resource
import socket
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from ..memory import pin_malloc, reset_peak, status_kib
from .layout import LAYOUTS, shard, unshard
from .ring import RingStats, _kernels, ring_attention


class PeakMemory:
    """Peak memory of this process while inside the ``with`` block, above its level at entry.

    CUDA: the caching allocator's peak. CPU: the resident set's high-water mark (reset via
    /proc/self/clear_refs where Linux allows it; otherwise the lifetime peak).
    """

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.bytes = 0

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
        else:
            reset_peak()  # where it cannot, VmHWM stays the lifetime peak
            self.base = (status_kib("VmRSS") or 0) * 1024
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)
        else:
            peak = (status_kib("VmHWM") or 0) * 1024 or resource.getrusage(
                resource.RUSAGE_SELF
            ).ru_maxrss * 1024
        self.bytes = max(0, peak - self.base)
        return False


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (for MASTER_PORT; demo, tests, benchmarks)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _has_kernels(device: torch.device) -> bool:
    try:
        _kernels(device)
    except ValueError:
        return False
    return True


def _setup(timeout_s: float) -> torch.device:
    if "RANK" not in os.environ:  # plain `python -m`: a group of one on loopback
        os.environ.update(
            RANK="0",
            WORLD_SIZE="1",
            LOCAL_RANK="0",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(free_port()),
        )
        print("(single process; run under `torchrun --nproc_per_node N` to split over N processes)")
    if torch.cuda.is_available() and _has_kernels(torch.device("cuda")):
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)  # NCCL needs one GPU per process
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
        pin_malloc()
        local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    return device


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m causalattn.distributed.demo",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--T", type=int, default=2048, help="global sequence length")
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--H", type=int, default=8, help="query heads")
    ap.add_argument(
        "--H-kv", type=int, default=None, help="key/value heads (grouped-query); default H"
    )
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--layout", choices=LAYOUTS, default="zigzag")
    ap.add_argument(
        "--dtype", choices=["float32", "bfloat16", "float16", "float64"], default="float32"
    )
    ap.add_argument(
        "--steps", type=int, default=3, help="timed forward+backward steps (after one warm-up)"
    )
    ap.add_argument(
        "--check",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="compare with the single-process engine (default: when T <= 4096)",
    )
    ap.add_argument("--timeout", type=float, default=60.0, help="process-group timeout, seconds")
    a = ap.parse_args(argv)
    device = _setup(a.timeout)
    try:
        return _run(a, device)
    finally:
        dist.destroy_process_group()


def _run(a, device) -> int:
    rank, P = dist.get_rank(), dist.get_world_size()
    dtype = getattr(torch, a.dtype)
    H_kv = a.H_kv or a.H
    check = a.check if a.check is not None else a.T <= 4096
    g = torch.Generator().manual_seed(0)
    shapes = [
        (a.B, a.H, a.T, a.d),
        (a.B, H_kv, a.T, a.d),
        (a.B, H_kv, a.T, a.d),
        (a.B, a.H, a.T, a.d),
    ]
    if check:  # the full sequence on every rank (small sizes), then this rank's part
        full = [torch.randn(s, generator=g).to(device, dtype) for s in shapes]
        local = [shard(x, layout=a.layout) for x in full]
    else:  # only this rank's part ever exists here, so memory is what one rank needs
        gl = torch.Generator().manual_seed(1 + rank)
        local = [
            torch.randn(*s[:2], -(-s[2] // (2 * P)) * 2, s[3], generator=gl).to(device, dtype)
            for s in shapes
        ]
    q, k, v, dout = local
    stats, times = RingStats(), []
    for step in range(a.steps + 1):  # step 0 warms up (one-time allocations); the rest are measured
        ql, kl, vl = (t.detach().requires_grad_() for t in (q, k, v))
        dist.barrier()
        with PeakMemory(device) as m:
            t0 = time.perf_counter()
            out = ring_attention(ql, kl, vl, layout=a.layout, stats=stats if step else None)
            out.backward(dout)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            dt = time.perf_counter() - t0
        if step:
            times.append(dt)
            mem = m
    mine = dict(
        rank=rank,
        T_local=q.shape[2],
        peak_mb=mem.bytes / 2**20,
        step_s=sorted(times)[len(times) // 2],
        sent_mb=stats.bytes_sent / a.steps / 2**20,
        gflop=stats.flops / a.steps / 1e9,
        wait_s=stats.wait_s / a.steps,
    )
    rows = [None] * P
    dist.all_gather_object(rows, mine)
    ok = True
    if check:
        got = [
            unshard(t, layout=a.layout, length=a.T)
            for t in (out.detach(), ql.grad, kl.grad, vl.grad)
        ]
        if rank == 0:
            ok = _compare(full, got, dtype)
    if rank == 0:
        print(
            f"ring attention: T={a.T} over P={P} ranks ({a.layout}), B={a.B}, H={a.H}/{H_kv}, "
            f"d={a.d}, "
            f"{a.dtype}, {dist.get_backend()} on {device.type}"
        )
        print(
            f"{'rank':>4} {'T/P':>6} {'peak MB':>8} {'step s':>8} {'sent MB':>8} {'GFLOP':>8} "
            f"{'wait s':>7}"
        )
        for r in rows:
            print(
                f"{r['rank']:>4} {r['T_local']:>6} {r['peak_mb']:>8.1f} {r['step_s']:>8.3f} "
                f"{r['sent_mb']:>8.2f} {r['gflop']:>8.2f} {r['wait_s']:>7.3f}"
            )
        fl = [r["gflop"] for r in rows]
        print(f"work balance (max/min block-pair FLOPs): {max(fl) / max(min(fl), 1e-12):.2f}")
    return 0 if ok else 1


def _compare(full, got, dtype) -> bool:
    from ..engines import attention

    q, k, v, dout = (t.detach().requires_grad_() for t in full)
    ref = attention(q, k, v, engine="tiled" if q.device.type == "cpu" else "auto")
    ref.backward(dout)
    tol = 2e-5 if dtype in (torch.float32, torch.float64) else 2e-2
    ok = True
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, (ref.detach(), q.grad, k.grad, v.grad)):
        err = (a.double() - b.double()).abs().max().item()
        bound = tol * (1 + b.double().abs().max().item())
        ok &= err <= bound
        print(
            f"check {name}: max |ring - single process| = {err:.2e} "
            f"({'ok' if err <= bound else 'FAIL'}, bound {bound:.1e})"
        )
    return ok


if __name__ == "__main__":
    raise SystemExit(main())
