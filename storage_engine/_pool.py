"""The pool of freed segment files a file tier keeps for later writes, shared by every
process of the store (see docs/storage.md, "The pool", for why it is sound).

A pooled file is a former segment (or an aborted write, or an orphan) moved into
``root/pool/`` under a fresh name: its pages stay allocated, so the next writer that
claims it pays page-table entries, not page faults. Every step that moves a file holds
an exclusive ``flock`` on it and then checks that the path still names the file it
locked (a pool name or a segment id is never used twice), so two processes never move
the same file and a file is never moved under a reader: readers hold a shared lock for
as long as they map a segment (``FileTier.open``), and a file whose exclusive lock
cannot be taken is unlinked instead of pooled, as before.
"""

from __future__ import annotations

import errno
import fcntl
import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Pool", "PoolFile", "default_pool_limit", "lock_nb", "meminfo", "same_file"]

_LOCK = ".lock"
#: under memory pressure (MemAvailable below this share of MemTotal) the pool takes no
#: more files and gives back what it holds
PRESSURE = 1 / 8


def lock_nb(fd: int) -> bool:
    """An exclusive flock on ``fd`` if nobody holds one (no wait)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        raise


def try_lock_file(path: str | os.PathLike[str]) -> int | None:
    """A descriptor of ``path`` (created if missing) holding an exclusive flock on it,
    or None when another open file holds one (no wait): a role one process of many
    takes, given up by closing the descriptor (or by the holder's death)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        if lock_nb(fd):
            return fd
    except BaseException:
        os.close(fd)
        raise
    os.close(fd)
    return None


def same_file(fd: int, path: Path) -> bool:
    """``path`` names the file open as ``fd`` (not moved or replaced since)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (st.st_ino, st.st_dev) == (mine.st_ino, mine.st_dev)


def meminfo() -> dict[str, int]:
    """MemTotal and MemAvailable in bytes (empty where /proc/meminfo is missing)."""
    out: dict[str, int] = {}
    try:
        with open("/proc/meminfo", "rb") as fh:
            for line in fh:
                key, _, rest = line.partition(b":")
                if key in (b"MemTotal", b"MemAvailable"):
                    out[key.decode()] = int(rest.split()[0]) * 1024
                    if len(out) == 2:
                        break
    except OSError:
        pass
    return out


def under_pressure() -> bool:
    m = meminfo()
    return "MemAvailable" in m and m["MemAvailable"] < m["MemTotal"] * PRESSURE


def default_pool_limit(capacity: int | None) -> int:
    """A quarter of the host's memory, at most the tier's capacity."""
    total = meminfo().get("MemTotal", 0) // 4 or (1 << 30)
    return min(total, capacity) if capacity is not None else total


@dataclass(slots=True)
class PoolFile:
    """A file claimed from the pool, renamed to its segment's path and locked by ``fd``."""

    fd: int
    ino: int
    size: int  # its size as claimed, before the caller resizes it
    allocated: int  # bytes of pages it holds


class Pool:
    """``directory`` of freed files, holding at most ``limit`` bytes of pages."""

    def __init__(self, directory: Path, limit: int) -> None:
        self.dir = Path(directory)
        self.limit = limit
        #: this process's figures: files claimed (and their bytes), files pooled, bytes
        #: given back
        self.counters = {"claimed": 0, "claimed_bytes": 0, "pooled": 0, "pooled_bytes": 0,
                         "released_bytes": 0}

    @contextmanager
    def _locked(self) -> Iterator[None]:
        """The pool's own lock: puts and trims in all processes take turns, so the
        bound holds; claims need no lock (each file has its own)."""
        self.dir.mkdir(mode=0o700, exist_ok=True)
        fd = os.open(self.dir / _LOCK, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def _entries(self) -> list[tuple[str, int, int, int, float]]:
        """(name, inode, size, allocated bytes, ctime) of each pooled file."""
        out = []
        try:
            with os.scandir(self.dir) as it:
                for e in it:
                    if e.name.startswith("."):
                        continue
                    try:
                        st = e.stat()
                    except FileNotFoundError:
                        continue
                    out.append((e.name, st.st_ino, st.st_size, st.st_blocks * 512,
                                st.st_ctime))
        except FileNotFoundError:
            pass
        return out

    def pooled_bytes(self) -> int:
        return sum(e[3] for e in self._entries())

    def put(self, path: Path, fd: int) -> bool:
        """Move the file at ``path``, exclusively locked by the caller through ``fd``,
        into the pool if it fits the bound and memory is not short; False: the caller
        unlinks it."""
        if self.limit <= 0:
            return False
        size = os.fstat(fd).st_blocks * 512
        if size <= 0 or size > self.limit:
            return False
        with self._locked():
            if under_pressure():
                self._trim(0)
                return False
            if self.pooled_bytes() + size > self.limit:
                return False
            if not same_file(fd, path):
                return False
            os.rename(path, self.dir / uuid.uuid4().hex)
        self.counters["pooled"] += 1
        self.counters["pooled_bytes"] += size
        return True

    def claim(self, nbytes: int, target: Path, prefer: set[int]) -> PoolFile | None:
        """A pooled file for a segment of ``nbytes``, renamed to ``target`` and locked:
        first one whose inode is in ``prefer`` (this process still maps it) and that is
        large enough, then the smallest that is large enough, then the largest (the
        caller extends it). None when the pool is empty."""
        entries = [e for e in self._entries() if e[3] > 0]
        if not entries:
            return None
        big = [e for e in entries if e[2] >= nbytes]
        order = sorted((e for e in big if e[1] in prefer), key=lambda e: e[2])
        order += sorted((e for e in big if e[1] not in prefer), key=lambda e: e[2])
        order += sorted((e for e in entries if e[2] < nbytes), key=lambda e: -e[2])
        for name, _, _, _, _ in order:
            p = self.dir / name
            try:
                fd = os.open(p, os.O_RDWR | os.O_CLOEXEC)
            except FileNotFoundError:
                continue  # claimed or trimmed by another process meanwhile
            try:
                if not lock_nb(fd) or not same_file(fd, p):
                    os.close(fd)
                    continue
                os.rename(p, target)  # under our lock: the file is ours
            except BaseException:
                os.close(fd)
                raise
            st = os.fstat(fd)
            self.counters["claimed"] += 1
            self.counters["claimed_bytes"] += st.st_blocks * 512
            return PoolFile(fd, st.st_ino, st.st_size, st.st_blocks * 512)
        return None

    def trim(self, limit: int | None = None) -> int:
        """Give back pooled files, oldest first, until the pool holds at most ``limit``
        bytes (default: its bound; everything under memory pressure); returns the bytes
        given back."""
        if not self.dir.is_dir():  # nothing was ever pooled here
            return 0
        with self._locked():
            return self._trim(self.limit if limit is None else limit)

    def _trim(self, limit: int) -> int:
        if under_pressure():
            limit = 0
        entries = sorted(self._entries(), key=lambda e: e[4])
        total = sum(e[3] for e in entries)
        freed = 0
        for name, _, _, allocated, _ in entries:
            if total <= limit:
                break
            p = self.dir / name
            try:
                fd = os.open(p, os.O_RDWR | os.O_CLOEXEC)
            except FileNotFoundError:
                total -= allocated
                continue
            try:
                if not lock_nb(fd) or not same_file(fd, p):
                    continue  # being claimed right now
                # truncate first: it frees the pages even where a process still keeps a
                # mapping of the file for reuse (nobody reads a pooled file)
                os.ftruncate(fd, 0)
                os.unlink(p)
            finally:
                os.close(fd)
            total -= allocated
            freed += allocated
        self.counters["released_bytes"] += freed
        return freed
