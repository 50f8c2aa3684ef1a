"""Packing extents into a segment and filling it with parallel, GIL-free copies."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import TypeAlias

import numpy as np

from ._checksum import checksum, copy_and_checksum, copy_hash_many
from ._tier import SegmentWriter
from ._work import add_work

__all__ = ["ALIGN", "pack", "fill_segment", "fill_from_addresses", "BATCH_FILL", "Source",
           "io_pool"]

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
    if len(sizes) > 64:  # a 100,000-tensor commit: one numpy pass, not a Python loop
        padded = (np.asarray(sizes, dtype=np.int64) + (ALIGN - 1)) // ALIGN * ALIGN
        ends = np.cumsum(padded)
        return (ends - padded).tolist(), int(ends[-1])
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


#: whether ``fill_from_addresses`` can run (the compiled extension, bound to xxhash)
BATCH_FILL = copy_hash_many is not None


def _lpt_bins(sizes: Sequence[int], workers: int) -> list[list[int]]:
    """Indices in ``workers`` bins of even load, largest first (longest-processing-time
    order); a per-extent cost keeps many tiny ones spread too."""
    order = sorted(range(len(sizes)), key=lambda i: -sizes[i])
    bins: list[list[int]] = [[] for _ in range(workers)]
    loads = [0] * workers
    for i in order:
        k = loads.index(min(loads))
        bins[k].append(i)
        loads[k] += sizes[i] + 4096
    return [b for b in bins if b]


def _run_all(jobs: list[Callable[[], None]]) -> None:
    """Run the jobs on the I/O pool; every one is over before an error surfaces (the
    caller may unmap the buffer they write)."""
    futures = [io_pool().submit(job) for job in jobs]
    wait(futures)
    for f in futures:
        f.result()


def fill_from_addresses(writer: SegmentWriter, addresses: Sequence[int],
                        offsets: Sequence[int], sizes: Sequence[int]) -> list[str]:
    """Copy ``sizes[i]`` bytes from the raw address ``addresses[i]`` to ``offsets[i]`` of
    the segment and return the checksums, in order: one native call per I/O thread for
    all of them, instead of a Python call per extent (which was most of a commit of
    100,000 small tensors). The caller keeps every source alive and unchanged during
    the call (the tensors of the commit it publishes). Needs ``BATCH_FILL``."""
    if copy_hash_many is None:
        raise RuntimeError("fill_from_addresses needs the compiled extension (BATCH_FILL)")
    n = len(addresses)
    addr = np.asarray(addresses, dtype=np.uint64)
    offs = np.asarray(offsets, dtype=np.uint64)
    size = np.asarray(sizes, dtype=np.uint64)
    digests = np.empty(n, dtype=np.uint64)
    buf = writer.buffer
    total = int(size.sum())
    add_work("bytes_copied", total)
    add_work("bytes_hashed", total)
    if total < (8 << 20) or n == 1:
        copy_hash_many(buf, addr, size, offs, digests)
    else:
        def job(idx: np.ndarray) -> Callable[[], None]:
            def run() -> None:
                got = np.empty(len(idx), dtype=np.uint64)
                copy_hash_many(buf, addr[idx], size[idx], offs[idx], got)
                digests[idx] = got
            return run

        _run_all([job(np.asarray(b, dtype=np.intp))
                  for b in _lpt_bins(list(sizes), io_pool()._max_workers)])
    return [f"{d:016x}" for d in digests.tolist()]


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
    out: list[str] = [""] * n

    def job(idx: list[int]) -> Callable[[], None]:
        def run() -> None:
            for i in idx:
                o = offsets[i]
                out[i] = _fill_one(buf[o : o + sizes[i]], sources[i])
        return run

    _run_all([job(b) for b in _lpt_bins(sizes, io_pool()._max_workers)])
    return out
