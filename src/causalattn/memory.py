"""This process's resident memory, for demos and benchmarks that report peak memory.

Linux only (/proc/self/status and glibc's mallopt); elsewhere the readings are None and
pinning does nothing. Kept in the core layer so that the ring demo (distributed) and the
benchmarks (bench) share one copy without crossing the layers of docs/design.md.
"""

from __future__ import annotations

import ctypes

_MALLOC_PINNED = False


def pin_malloc() -> None:
    """Make glibc map large blocks directly (and unmap them on free), once per process."""
    global _MALLOC_PINNED
    if _MALLOC_PINNED:
        return
    _MALLOC_PINNED = True
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD: fixed, which also stops its growth
        libc.mallopt(-1, 128 * 1024)  # M_TRIM_THRESHOLD: give freed heap tops back
    except (OSError, AttributeError):
        pass


def status_kib(field: str) -> int | None:
    """A field of /proc/self/status in KiB (VmRSS, VmHWM), or None where it cannot be read."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def reset_peak() -> bool:
    """Reset VmHWM to the current resident set (Linux: /proc/self/clear_refs); False where
    that cannot be done (the high-water mark then stays the lifetime peak)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True
