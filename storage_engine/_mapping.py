"""Shared mappings of segment files for writers: populating them fast, and keeping a
process's mappings for the files it will write again (the pool's files).

A fresh shared-memory page costs its allocation, its zeroing and a page fault (and, in a
virtual machine, often the host's fault too): about 1.3-1.9 GB/s for one thread here.
The faults of distinct pages of one file run in parallel, so a large fresh mapping is
populated by ``MADV_POPULATE_WRITE`` on one slice per I/O worker (the call releases the
GIL: it goes through ctypes), about twice as fast on two cores. Pages a file already
holds (a pooled file) cost only their page-table entries, which one ``MAP_POPULATE``
sets fastest; a mapping this process still holds of that very file costs nothing.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ._io import io_workers

__all__ = ["MapCache", "close_in_background", "map_shared", "populate"]

_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
#: Linux 5.14+; older kernels answer EINVAL and the page walk below does the job
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
#: below this a mapping is populated by one MAP_POPULATE (threads cost more than they save)
PARALLEL_MIN = 32 << 20

_libc: ctypes.CDLL | None = None
_madvise_ok = True
_pool: ThreadPoolExecutor | None = None
_pool_pid = 0
_pool_lock = threading.Lock()


def _threads() -> ThreadPoolExecutor:
    """Threads of its own (not the I/O pool: a create may run on an I/O thread)."""
    global _pool, _pool_pid
    with _pool_lock:
        if _pool is None or _pool_pid != os.getpid():
            _pool = ThreadPoolExecutor(io_workers(), thread_name_prefix="tensordb-populate")
            _pool_pid = os.getpid()
        return _pool


def _madvise(addr: int, length: int) -> int:
    """MADV_POPULATE_WRITE over [addr, addr + length): 0, or the errno."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _libc.madvise.restype = ctypes.c_int
    if _libc.madvise(addr, length, _MADV_POPULATE_WRITE) == 0:
        return 0
    return ctypes.get_errno()


def _walk(pages: np.ndarray) -> int:
    pages[:: mmap.PAGESIZE] = 0  # numpy's strided fill releases the GIL
    return 0


def populate(mm: mmap.mmap, nbytes: int) -> None:
    """Fault in the first ``nbytes`` of a shared writable mapping, one slice per I/O
    worker. The file's pages must be allocated already (fallocate): then nothing can
    fail but the call itself, raised as OSError."""
    global _madvise_ok
    # the array's export of the mapping ends with this frame (the caller may close it)
    buf = np.frombuffer(mm, np.uint8, count=nbytes)
    workers = io_workers()
    step = -(-nbytes // workers // mmap.PAGESIZE) * mmap.PAGESIZE
    spans = [(lo, min(nbytes, lo + step)) for lo in range(0, nbytes, step)]
    base = buf.ctypes.data
    if _madvise_ok:
        codes = list(_threads().map(lambda s: _madvise(base + s[0], s[1] - s[0]), spans))
        if all(c == 0 for c in codes):
            return
        bad = [c for c in codes if c not in (0, errno.EINVAL, errno.ENOSYS)]
        if bad:
            raise OSError(bad[0], f"populating a mapping: {os.strerror(bad[0])}")
        _madvise_ok = False  # an older kernel: walk the pages instead
    list(_threads().map(lambda s: _walk(buf[s[0] : s[1]]), spans))


def map_shared(path: os.PathLike[str] | str, nbytes: int, how: str) -> tuple[int, mmap.mmap]:
    """A shared writable mapping of ``nbytes`` of the file at ``path``, through an open
    file description of its own (the caller's may hold a lock that must not live as long
    as the mapping). ``how``: ``"fresh"`` (pages just allocated: populated in parallel
    when large), ``"resident"`` (pages the file holds: one MAP_POPULATE), ``"lazy"``
    (no populate). Returns the mapping's descriptor (kept: it names the file for
    ``MapCache``) and the mapping."""
    map_fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    try:
        parallel = how == "fresh" and nbytes >= PARALLEL_MIN and io_workers() > 1
        flags = mmap.MAP_SHARED | (_POPULATE if how != "lazy" and not parallel else 0)
        mm = mmap.mmap(map_fd, nbytes, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        if parallel:
            try:
                populate(mm, nbytes)
            except BaseException:
                mm.close()
                raise
    except BaseException:
        os.close(map_fd)
        raise
    return map_fd, mm


def _close(mm: mmap.mmap, map_fd: int) -> None:
    try:
        mm.close()
    except BufferError:  # a caller still holds a view: the mapping goes with it
        pass
    os.close(map_fd)


def close_in_background(mm: mmap.mmap, map_fd: int) -> None:
    """Unmap off the caller's path: munmap of a large populated mapping takes ~35-70
    ms/GiB and holds the process's mmap lock all along, stalling every page fault of the
    other threads (SQLite's included)."""
    threading.Thread(target=_close, args=(mm, map_fd), daemon=True).start()


class MapCache:
    """A process's writable mappings of files it may write again, by inode, most recent
    last; at most ``entries`` of them.

    A mapping kept here of a file that was since unlinked would keep the file's pages
    alive: ``prune`` (run at every take and keep) closes those, and the pool truncates a
    file to nothing before it unlinks it, which frees the pages of every mapping."""

    def __init__(self, entries: int = 8) -> None:
        self.entries = entries
        self._maps: OrderedDict[int, tuple[int, mmap.mmap]] = OrderedDict()
        self._lock = threading.Lock()
        self._pid = os.getpid()

    def _mine(self) -> None:
        if self._pid != os.getpid():  # a forked child: its parent's mappings are not its own
            self._maps, self._pid = OrderedDict(), os.getpid()

    def inodes(self) -> set[int]:
        with self._lock:
            self._mine()
            return set(self._maps)

    def take(self, ino: int, nbytes: int) -> tuple[int, mmap.mmap] | None:
        """The kept mapping of inode ``ino`` if it covers ``nbytes``, handed over (it
        leaves the cache); None otherwise."""
        self.prune()
        with self._lock:
            got = self._maps.pop(ino, None)
        if got is not None and len(got[1]) < nbytes:
            close_in_background(got[1], got[0])
            return None
        return got

    def keep(self, map_fd: int, mm: mmap.mmap) -> None:
        """Keep a writer's mapping for when its file comes back from the pool."""
        st = os.fstat(map_fd)
        if st.st_nlink == 0 or self.entries <= 0:
            close_in_background(mm, map_fd)
            return
        with self._lock:
            self._mine()
            old = self._maps.pop(st.st_ino, None)
            self._maps[st.st_ino] = (map_fd, mm)
        if old is not None:
            close_in_background(old[1], old[0])
        self.prune()

    def forget(self, ino: int) -> None:
        with self._lock:
            got = self._maps.pop(ino, None)
        if got is not None:
            close_in_background(got[1], got[0])

    def prune(self) -> None:
        """Close the mappings of files that are gone, and the oldest past ``entries``."""
        drop: list[tuple[int, mmap.mmap]] = []
        with self._lock:
            self._mine()
            for ino, (fd, _mm) in list(self._maps.items()):
                if os.fstat(fd).st_nlink == 0:
                    drop.append(self._maps.pop(ino))
            while len(self._maps) > max(0, self.entries):
                drop.append(self._maps.popitem(last=False)[1])
        for fd, mm in drop:
            close_in_background(mm, fd)

    def close(self) -> None:
        with self._lock:
            mine = self._pid == os.getpid()
            maps, self._maps = self._maps, OrderedDict()
        if mine:
            for fd, mm in maps.values():
                close_in_background(mm, fd)
