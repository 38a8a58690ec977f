"""The allocator controls (ocrl/memory.py): what `tune` sets, that a trim gives freed heap back
to the OS, and the open file-descriptor count the soak reports."""

from __future__ import annotations

import ctypes
import os
import sys

import anyio
import pytest

from ocrl import memory

glibc = pytest.mark.skipif(memory._LIBC is None, reason="glibc's malloc only (mallopt, mallinfo2, malloc_trim)")


@glibc
def test_tune_sets_the_arena_count_and_both_thresholds():
    assert memory.tune() == {"arena_max": memory.ARENA_MAX, "mmap_threshold": memory.MMAP_THRESHOLD, "trim_threshold": memory.TRIM_THRESHOLD}


@glibc
def test_a_trim_hands_freed_heap_pages_back():
    # many small blocks kept in the heap (under any mmap threshold), every other one freed, so
    # the heap's top cannot shrink and only a trim of the free pages inside it lowers RSS
    memory.tune()
    malloc, free = memory._LIBC.malloc, memory._LIBC.free
    malloc.restype, malloc.argtypes, free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
    blocks = [malloc(64 * 1024) for _ in range(4096)]  # 256 MiB
    try:
        for b in blocks:
            ctypes.memset(b, 1, 64 * 1024)  # resident
        for b in blocks[::2]:
            free(b)
        before = memory.rss_mb()
        trimmer = memory.Trimmer()
        trimmer.trim()
        after = memory.rss_mb()
        assert before - after > 64, f"RSS {before} -> {after} MiB after the trim"
        assert trimmer.stats()["trims"] == 1
    finally:
        for b in blocks[1::2]:
            free(b)


@glibc
async def test_the_trimmer_trims_every_interval_until_cancelled():
    trimmer = memory.Trimmer(every=0.05)
    with anyio.move_on_after(0.6):
        await trimmer.run()
    assert trimmer.trims >= 3


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd") and not os.path.isdir("/dev/fd"), reason="no fd folder")
def test_open_fds_counts_a_newly_opened_file():
    before = memory.open_fds()
    with open(sys.executable, "rb"):
        assert memory.open_fds() == before + 1
    assert memory.open_fds() == before
