"""Timing and memory helpers for benchmarks on a noisy machine.

This machine's speed drifts by ±30% from minute to minute, so a speed figure alone means
little: peers are timed in alternation (ours, peer, ours, peer, ...) and compared by the
median of the paired ratios, measured in the same run.

Peak extra memory is the rise of the process's resident-set high-water mark during one
call (Linux: VmHWM reset through /proc/self/clear_refs before the call, read after it),
with glibc's mmap threshold pinned at 64 KiB so every large tensor is mapped on allocation
and unmapped on free: memory freed by an earlier call cannot be reused silently and hide a
peak. It counts everything the call touches (outputs, saved tensors, BLAS buffers), not
only torch tensors (tracemalloc does not see torch; torch has no CPU allocator stats).
Where /proc is missing, the figure is None.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

from ..memory import pin_malloc, reset_peak, status_kib


def peak_extra_mib(fn: Callable[[], object]) -> tuple[float | None, object]:
    """Run ``fn`` once; return (peak resident memory above the start, in MiB, or None; its
    result)."""
    pin_malloc()
    if not reset_peak():
        return None, fn()
    base = status_kib("VmRSS")
    result = fn()
    peak = status_kib("VmHWM")
    if base is None or peak is None:
        return None, result
    return max(0.0, (peak - base) / 1024.0), result


def paired_times(
    fns: dict[str, Callable[[], object]], reps: int = 5, warmup: int = 1
) -> dict[str, list[float]]:
    """Seconds per call of each function, timed in alternation: a, b, c, a, b, c, ..."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return times


def median_ratio(peer: list[float], ours: list[float]) -> float:
    """Median over the alternation rounds of peer time / our time (> 1: ours is faster)."""
    return statistics.median(p / o for p, o in zip(peer, ours))


def median_ms(ts: list[float]) -> float:
    return 1000.0 * statistics.median(ts)


def reps_for(seconds_per_call: float, budget_s: float, lo: int = 3, hi: int = 15) -> int:
    """Alternation rounds that fit a time budget (at least ``lo`` for a median)."""
    if seconds_per_call <= 0:
        return hi
    return max(lo, min(hi, int(budget_s / seconds_per_call)))
