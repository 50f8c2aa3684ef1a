"""Packing extents into a segment and filling it with parallel, GIL-free copies."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import TypeAlias

import numpy as np

from ._checksum import checksum, copy_and_checksum
from ._tier import SegmentWriter

__all__ = ["ALIGN", "pack", "fill_segment", "Source", "io_pool"]

#: extent alignment inside a segment: enough for every dtype and for cache lines
ALIGN = 64

#: a source is the tensor's bytes as a uint8 array, or a function that writes them into
#: the destination it is given (used for non-contiguous tensors: one strided copy, and by
#: loaders reading files into the extent). A function may return the checksum of what it
#: wrote (``Hasher`` over the bytes, fed while they were in cache); else they are hashed
#: after it returns
Source: TypeAlias = "np.ndarray | Callable[[np.ndarray], str | None]"

_pool: ThreadPoolExecutor | None = None
_pool_pid = 0


def io_workers() -> int:
    """The threads of ``io_pool``: one per core, 2 to 8."""
    return max(2, min(8, os.cpu_count() or 2))


def io_pool() -> ThreadPoolExecutor:
    """The process-wide pool for copies and hashes (numpy and xxhash release the GIL)."""
    global _pool, _pool_pid
    if _pool is None or _pool_pid != os.getpid():
        _pool = ThreadPoolExecutor(io_workers(), thread_name_prefix="tensordb-io")
        _pool_pid = os.getpid()
    return _pool


def pack(sizes: Sequence[int]) -> tuple[list[int], int]:
    """Offsets of extents of the given sizes laid end to end, each ALIGN-aligned."""
    offsets: list[int] = []
    pos = 0
    for n in sizes:
        offsets.append(pos)
        pos += (n + ALIGN - 1) // ALIGN * ALIGN
    return offsets, pos


def _fill_one(dst: np.ndarray, src: Source) -> str:
    if isinstance(src, np.ndarray):
        return copy_and_checksum(dst, src)
    got = src(dst)
    return got if isinstance(got, str) else checksum(dst)


def fill_segment(writer: SegmentWriter, sources: Sequence[Source], offsets: Sequence[int],
                 sizes: Sequence[int]) -> list[str]:
    """Copy every source to its offset and return the checksums, in order.

    Work is split across the I/O pool, largest extents first (longest-processing-time
    order keeps the threads evenly loaded); small segments are done inline.
    """
    buf = writer.buffer
    n = len(sources)
    total = sum(sizes)
    if total < (8 << 20) or n == 1:
        return [_fill_one(buf[o : o + s], src) for src, o, s in zip(sources, offsets, sizes, strict=True)]
    pool = io_pool()
    workers = pool._max_workers
    order = sorted(range(n), key=lambda i: -sizes[i])
    bins: list[list[int]] = [[] for _ in range(workers)]
    loads = [0] * workers
    for i in order:
        k = loads.index(min(loads))
        bins[k].append(i)
        loads[k] += sizes[i] + 4096  # a per-extent cost keeps many tiny ones spread too
    out: list[str] = [""] * n

    def run(idx: list[int]) -> None:
        for i in idx:
            o = offsets[i]
            out[i] = _fill_one(buf[o : o + sizes[i]], sources[i])

    futures = [pool.submit(run, b) for b in bins if b]
    wait(futures)  # all done before any error surfaces: the caller may unmap the buffer
    for f in futures:
        f.result()
    return out
