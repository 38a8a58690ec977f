"""Process memory as the operator sees it: resident size, and what the C heap holds (glibc's
mallinfo2: bytes in use vs freed but kept), plus giving freed heap back to the OS.

Why the heap matters here: torch's CPU tensors are plain malloc'd blocks. A training step
allocates activations and gradients of a size that changes with every batch, frees them, and
glibc keeps most freed blocks in its arenas (one per thread that allocated) instead of returning
them, so RSS climbs in steps although nothing is leaked. `trim()` (malloc_trim) hands the free
tops and whole free pages back. Elsewhere than glibc these are null operations.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def _libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        return libc
    except (OSError, AttributeError):  # not glibc, or a glibc older than 2.33
        return None


_LIBC = _libc()


def rss_mb() -> float:
    """This process's resident memory in MiB (Linux: now; elsewhere: the peak so far)."""
    try:
        with open("/proc/self/statm") as f:
            return round(int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20, 1)
    except OSError:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return round(peak / 2**20 if sys.platform == "darwin" else peak / 2**10, 1)


def heap() -> dict[str, float]:
    """MiB the C heap holds in use, holds freed (kept for reuse), and maps directly; {} off glibc."""
    if _LIBC is None:
        return {}
    info = _LIBC.mallinfo2()
    mb = lambda n: round(n / 2**20, 1)  # noqa: E731
    return {"heap_in_use_mb": mb(info.uordblks), "heap_free_mb": mb(info.fordblks), "heap_mmap_mb": mb(info.hblkhd)}


def trim() -> None:
    """Give freed heap back to the OS (glibc malloc_trim); a no-op elsewhere."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)
