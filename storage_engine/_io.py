"""Packing extents into a segment and filling it with parallel, GIL-free copies."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import TypeAlias

import numpy as np

from ._checksum import Hasher, checksum, copy_and_checksum, copy_hash_many
from ._direct import DIRECT, read_file_direct, write_direct
from ._tier import SegmentWriter
from ._work import add_work

__all__ = ["ALIGN", "pack", "fill_segment", "fill_from_addresses", "fill_from_file",
           "BATCH_FILL", "Source", "io_pool", "io_pool_workers"]

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
#: the threads ``_pool`` was made with (the executor keeps its own count private)
_pool_workers = 0


def io_workers() -> int:
    """The threads of ``io_pool``: one per core, 2 to 8."""
    return max(2, min(8, os.cpu_count() or 2))


def io_pool() -> ThreadPoolExecutor:
    """The process-wide pool for copies and hashes (numpy and xxhash release the GIL)."""
    global _pool, _pool_pid, _pool_workers
    if _pool is None or _pool_pid != os.getpid():
        _pool_workers = io_workers()
        _pool = ThreadPoolExecutor(_pool_workers, thread_name_prefix="tensordb-io")
        _pool_pid = os.getpid()
    return _pool


def io_pool_workers() -> int:
    """The threads of this process's ``io_pool`` (made first where it is not yet): what
    work is split over."""
    io_pool()
    return _pool_workers


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
    # a fresh file is written through its descriptor (``_direct``), not mapped
    fd = writer.write_fd if DIRECT else None
    buf = writer.buffer if fd is None else None
    total = int(size.sum())
    add_work("bytes_copied", total)
    add_work("bytes_hashed", total)
    if fd is not None:
        write_direct(writer, fd, addr, offs, size, digests,
                     lambda: _bins(sizes, total), _run_jobs)
    elif total < (8 << 20) or n == 1:
        copy_hash_many(buf, addr, size, offs, digests)
    else:
        def job(idx: np.ndarray) -> Callable[[], None]:
            def run() -> None:
                got = np.empty(len(idx), dtype=np.uint64)
                copy_hash_many(buf, addr[idx], size[idx], offs[idx], got)
                digests[idx] = got
            return run

        _run_all([job(np.asarray(b, dtype=np.intp))
                  for b in _lpt_bins(list(sizes), io_pool_workers())])
    return [f"{d:016x}" for d in digests.tolist()]


def _bins(sizes: Sequence[int], total: int) -> list[list[int]]:
    """The extents split over the I/O threads, or one bin under 8 MiB."""
    if total < (8 << 20) or len(sizes) == 1:
        return [list(range(len(sizes)))]
    return _lpt_bins(list(sizes), io_pool_workers())


def _run_jobs(jobs: list[Callable[[], None]]) -> None:
    """One job inline, more on the I/O pool (``_run_all``)."""
    if len(jobs) == 1:
        jobs[0]()
    else:
        _run_all(jobs)


#: bytes a ``fill_from_file`` read into a mapped segment hashes while they are in cache
_READ_PIECE = 1 << 20


def fill_from_file(writer: SegmentWriter, src_fd: int, src_offsets: Sequence[int],
                   offsets: Sequence[int], sizes: Sequence[int]) -> list[str]:
    """Copy ``sizes[i]`` bytes of the file open as ``src_fd``, from ``src_offsets[i]``, to
    ``offsets[i]`` of the segment, hashing as it copies, on the I/O threads (the kernel
    copies; the GIL is released), and return the checksums in order. A source the file
    ends inside (it shrank since its size was read) gets ``""``: the caller refuses the
    fill. A fresh file is written through its descriptor (``_direct``): each piece read
    into a small buffer, hashed, written; else each piece is read into the mapping
    (``preadv``) and hashed there."""
    n = len(sizes)
    src = np.asarray(src_offsets, dtype=np.uint64)
    offs = np.asarray(offsets, dtype=np.uint64)
    size = np.asarray(sizes, dtype=np.uint64)
    digests = np.zeros(n, dtype=np.uint64)
    total = int(size.sum())
    add_work("bytes_copied", total)
    add_work("bytes_hashed", total)
    fd = writer.write_fd if DIRECT and copy_hash_many is not None else None
    if fd is not None:
        short = set(read_file_direct(writer, fd, src_fd, src, offs, size, digests,
                                     lambda: _bins(sizes, total), _run_jobs))
        return ["" if i in short else f"{d:016x}" for i, d in enumerate(digests.tolist())]
    buf = writer.buffer
    out: list[str] = [""] * n

    def read(i: int) -> None:
        o, m, at = int(offs[i]), int(size[i]), int(src[i])
        view = memoryview(buf[o : o + m])
        h = Hasher()
        done = 0
        while done < m:
            got = os.preadv(src_fd, [view[done : min(m, done + _READ_PIECE)]], at + done)
            if got <= 0:
                return  # the file ended inside this source: no checksum
            h.update(view[done : done + got])
            done += got
        out[i] = h.hexdigest()

    def job(idx: list[int]) -> Callable[[], None]:
        def run() -> None:
            for i in idx:
                read(i)
        return run

    _run_jobs([job(b) for b in _bins(sizes, total)])
    return out


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

    _run_all([job(b) for b in _lpt_bins(sizes, io_pool_workers())])
    return out
