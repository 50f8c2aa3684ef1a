"""Filling a fresh segment file through its descriptor (``pwrite``) instead of a mapping.

A fresh shared-memory page written through a mapping costs a page fault: the kernel
allocates the page, zeroes it and maps it, and only then is it written. Written with
``pwrite``, the kernel allocates the page and copies the bytes in, with no fault, no
zeroing and no page-table entry (a reader maps the page later, as it would anyway).
Measured on the 2-core host, per 4 KiB page of CPU time: about 4.8 us to fault in and
write a fresh tmpfs page on one thread (the populate bound), 3.6 us for ``fallocate`` +
``MADV_POPULATE_WRITE`` + a streamed copy (the earlier first commit), 2.5-2.8 us for a
hashed ``pwrite``; a first commit went from 0.5 to 0.8-1.2 GB/s beside a bound of 0.5.

Writes into one tmpfs file take the inode's lock, so two threads write no faster than
one; the I/O threads still split the extents, so that one hashes (and, for an import,
reads) while the other writes. Each piece of an extent is hashed, which brings it into
cache, and written from there: one pass over the source, the copy is the kernel's.
Small extents are gathered into one piece-sized write (``_stream.c``).

A writer offers its descriptor (``SegmentWriter.write_fd``) only while nothing has
mapped the file; a full medium surfaces as OSError (ENOSPC), never as the SIGBUS a
write through the mapping of an unallocated file would be, and the writer's
``out_of_space`` gives the pool's files back (the caller writes again) or raises
TierFull.
"""

from __future__ import annotations

import errno
from collections.abc import Callable

import numpy as np

from ._stream import pread_pwrite_hash, pwrite_hash_many
from ._tier import SegmentWriter

__all__ = ["DIRECT", "read_file_direct", "write_direct"]

#: whether fills may write through a writer's descriptor: the extension always can, once
#: ``_checksum`` has bound it to xxhash at import, which is why the fills that use it also
#: ask for ``copy_hash_many`` (there only where that binding held)
DIRECT = True

#: no room on the medium: the writer may make some and the fill is written again
_NO_ROOM = (errno.ENOSPC, errno.EDQUOT)


def _by_offset(bins: list[list[int]], offsets: np.ndarray, sizes: np.ndarray
               ) -> list[np.ndarray]:
    """The extents of ``bins`` dealt again as as many runs of consecutive offsets, of
    about equal bytes each, in ascending offset order: each thread then writes a range
    of the file of its own, so that the small extents it gathers into one write are
    neighbours (the gaps the native side pads between them hold no other thread's
    bytes), where bins of even load interleave their extents across the file."""
    idx = np.concatenate([np.asarray(b, dtype=np.intp) for b in bins]) if bins else \
        np.empty(0, np.intp)
    idx = idx[np.argsort(offsets[idx], kind="stable")]
    if len(bins) <= 1 or len(idx) <= 1:
        return [idx]
    ends = np.cumsum(sizes[idx].astype(np.float64))
    cuts = np.searchsorted(ends, ends[-1] * np.arange(1, len(bins)) / len(bins))
    return [part for part in np.split(idx, cuts) if len(part)]


def _retrying(writer: SegmentWriter, run: Callable[[], None]) -> None:
    """``run`` the writes; where the medium is full, once more after the writer made
    room (the same bytes to the same offsets), else TierFull from the writer."""
    while True:
        try:
            run()
            return
        except OSError as exc:
            if exc.errno not in _NO_ROOM or not writer.out_of_space(exc):
                raise


def write_direct(writer: SegmentWriter, fd: int, addr: np.ndarray, offs: np.ndarray,
                 size: np.ndarray, digests: np.ndarray,
                 bins: Callable[[], list[list[int]]],
                 run_all: Callable[[list[Callable[[], None]]], None]) -> None:
    """``fill_from_addresses`` through ``fd`` (the writer's ``write_fd``): the digests
    into ``digests``. ``bins`` splits the extents over the I/O threads, ``run_all``
    runs one job per bin."""
    limit = writer.nbytes

    def job(idx: np.ndarray) -> Callable[[], None]:
        def run() -> None:
            got = np.empty(len(idx), dtype=np.uint64)
            pwrite_hash_many(fd, limit, addr[idx], size[idx], offs[idx], got)
            digests[idx] = got
        return run

    jobs = [job(idx) for idx in _by_offset(bins(), offs, size)]
    _retrying(writer, lambda: run_all(jobs))


def read_file_direct(writer: SegmentWriter, fd: int, src_fd: int, src: np.ndarray,
                     offs: np.ndarray, size: np.ndarray, digests: np.ndarray,
                     bins: Callable[[], list[list[int]]],
                     run_all: Callable[[list[Callable[[], None]]], None]) -> list[int]:
    """``fill_from_file`` through ``fd``: each byte range of ``src_fd`` read into a
    staging piece, hashed and written. Returns the indices of the sources the file ended
    inside (it shrank), whose digests are not set."""
    limit = writer.nbytes
    short: list[int] = []

    def job(idx: np.ndarray) -> Callable[[], None]:
        def run() -> None:
            got = np.empty(len(idx), dtype=np.uint64)
            at = pread_pwrite_hash(src_fd, fd, limit, src[idx], size[idx], offs[idx], got)
            if at >= 0:
                short.append(int(idx[at]))
            digests[idx] = got
        return run

    jobs = [job(idx) for idx in _by_offset(bins(), offs, size)]

    def run() -> None:
        short.clear()
        run_all(jobs)

    _retrying(writer, run)
    return short
