"""Benchmarks as library code: alternating peer timing, peak memory, the CPU table.

`causalattn bench` and ``benchmarks/bench_cpu.py`` are thin shells over :func:`cpu.run`
and :func:`cpu.render`; :mod:`.timing` is reusable for other benchmarks.
"""

from .timing import median_ms, median_ratio, paired_times, peak_extra_mib, reps_for

__all__ = ["paired_times", "median_ratio", "median_ms", "peak_extra_mib", "reps_for"]
