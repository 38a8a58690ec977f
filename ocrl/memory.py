"""Process memory as the operator sees it: resident size, and what the C heap holds (glibc's
mallinfo2: bytes in use vs freed but kept), plus giving freed heap back to the OS.

Why the heap matters here: torch's CPU tensors are plain malloc'd blocks. A training step
allocates activations and gradients of a size that changes with every batch, frees them, and
glibc keeps most freed blocks in its arenas (one per thread that allocated) instead of returning
them, so RSS climbs in steps although nothing is leaked. `trim()` (malloc_trim) hands the free
tops and whole free pages back. Elsewhere than glibc these are null operations.

`tune()` (at daemon start, unless --no-malloc-tune) narrows the churn at its source: every
decode step and tokenisation runs in whichever anyio worker thread is free, and glibc gives
threads their own arenas (up to 8 per core), so each arena grows to hold the working set and
keeps it; two arenas share one. Blocks from 8 MiB up (activations, logits, gradients of a step)
are mapped and unmapped on their own instead of being kept once freed (glibc would otherwise
raise that bound to 32 MiB after the first such free). `Trimmer` hands freed pages back every
few seconds in a worker thread, so memory the prefix cache evicted or a batch of decodes let
go does not wait for the next training step.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
import time


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def _libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
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


# mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8
ARENA_MAX = 2
MMAP_THRESHOLD = 8 << 20  # bytes: blocks this large are mapped on their own, unmapped when freed
TRIM_THRESHOLD = 32 << 20  # bytes of free heap top kept before giving it back
TRIM_EVERY = 10.0  # seconds between Trimmer's trims


def tune(arena_max: int = ARENA_MAX, mmap_threshold: int = MMAP_THRESHOLD, trim_threshold: int = TRIM_THRESHOLD) -> dict[str, int]:
    """Set glibc's arena count and mmap/trim thresholds (see the module's doc); returns what was
    set, {} off glibc. Arenas already created stay, so this runs before the model loads."""
    if _LIBC is None:
        return {}
    wanted = {"arena_max": (M_ARENA_MAX, arena_max), "mmap_threshold": (M_MMAP_THRESHOLD, mmap_threshold), "trim_threshold": (M_TRIM_THRESHOLD, trim_threshold)}
    return {name: value for name, (param, value) in wanted.items() if _LIBC.mallopt(param, value) == 1}


class Trimmer:
    """`trim()` every `every` seconds in a worker thread, for as long as `run` runs; counts the
    trims and their time."""

    def __init__(self, every: float = TRIM_EVERY):
        self.every = every
        self.trims = 0
        self.seconds = 0.0

    def trim(self) -> None:
        started = time.perf_counter()
        trim()
        self.seconds += time.perf_counter() - started
        self.trims += 1

    async def run(self) -> None:
        import anyio

        if _LIBC is None:
            return
        while True:
            await anyio.sleep(self.every)
            await anyio.to_thread.run_sync(self.trim)

    def stats(self) -> dict[str, float]:
        return {"trims": self.trims, "trim_ms_mean": round(1000 * self.seconds / self.trims, 1) if self.trims else 0.0}


def open_fds() -> int | None:
    """File descriptors this process holds open (sockets, files, pipes); None where unknown."""
    for folder in ("/proc/self/fd", "/dev/fd"):
        try:
            return len(os.listdir(folder)) - 1  # less the one listdir itself opened
        except OSError:
            continue
    return None
