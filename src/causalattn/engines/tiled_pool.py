"""The tiled engine's scheduler: independent tiles on a pool of Python threads, each
running single-threaded torch ops, and the work dealt into parts of similar cost. Part of
:mod:`causalattn.engines.tiled`.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from .problem import Problem

LANES = 4  # backward: dQ partial sums per job, a fixed number whatever the thread count

_POOL: ThreadPoolExecutor | None = None
_POOL_WORKERS = 0  # _POOL's thread count: kept here, as the executor has no public getter


def _parallel(parts: list[list], run, workers: int) -> list:
    """``[run(part) for part in parts]`` on up to ``workers`` threads, results in part order;
    each thread runs single-threaded torch ops. Independent tiles in Python threads (torch
    releases the GIL) avoid one OpenMP fork-join per small op, which costs dearly on a busy
    machine. A part's result never depends on the number of workers."""
    global _POOL, _POOL_WORKERS
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
        if _POOL is None or _POOL_WORKERS < workers:
            _POOL = ThreadPoolExecutor(workers, thread_name_prefix="causalattn-tiled")
            _POOL_WORKERS = workers
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
