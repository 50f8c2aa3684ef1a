"""Integrity marks of a store's segments, shared by the processes of a host.

A mark is a small file in the store's shared-memory area (``<shm_dir>/integrity``), so
every process of the host sees it and a reboot clears it:

- ``<id>.corrupt``: extents of the segment whose bytes failed their checksums, a line
  each (offset, reason; offset -1: the whole segment), appended by whoever finds them;
  readers refuse those extents from then on;
- ``<id>.ok``: a disk segment whose extents matched their checksums on this boot, with
  the identity (boot id, device, inode, size, mtime) of the file checked, so a file
  written or replaced since is checked again;
- ``scrub.cursor``: where the last scrub of the store stopped;
- ``generation``: a counter every new corrupt mark bumps (after writing the mark).

Readers keep the counter mapped (8 bytes, read-only, shared) and the marks they last
listed: checking a segment costs a load of the counter and a dict look-up while no mark
is made (about 0.2 µs: cheap enough to check on every access to a tensor a snapshot
already made), and one listing of the directory after one is.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import struct
import sys
import threading
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from ._checksum import checksum
from ._io import io_pool
from ._procs import boot_id

__all__ = ["WHOLE", "Extent", "Marks", "check_extents"]

#: the offset of a mark that covers every extent of its segment
WHOLE = -1

#: the shared counter's layout: one little-endian 64-bit count
_COUNTER = struct.Struct("<Q")

#: (offset, nbytes, checksum, what): one extent of a segment as the catalog records it;
#: ``what`` names it in an error (collection/tensor)
Extent = tuple[int, int, str, str]


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, text.encode("utf-8", "replace"))
    finally:
        os.close(fd)
    os.replace(tmp, path)


def _read(path: Path) -> str | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        return os.read(fd, 4096).decode("utf-8", "replace")
    finally:
        os.close(fd)


class Marks:
    """The integrity marks of one store (see the module docstring), under ``root``."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._boot = boot_id()
        self._lock = threading.Lock()
        self._gen_path = self.root / "generation"
        fd = os.open(self._gen_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            if os.fstat(fd).st_size < 8:
                fcntl.flock(fd, fcntl.LOCK_EX)
                if os.fstat(fd).st_size < 8:
                    os.ftruncate(fd, 8)
                fcntl.flock(fd, fcntl.LOCK_UN)
        except BaseException:
            os.close(fd)
            raise
        try:
            gen_map = mmap.mmap(fd, 8, mmap.MAP_SHARED, mmap.PROT_READ)
        except BaseException:
            os.close(fd)
            raise
        #: the counter as one native 64-bit integer (the file's layout is little-endian):
        #: ``counter()[0]`` is the cheapest look there is, for readers that look per access
        self._gen_view: memoryview | None = (memoryview(gen_map).cast("Q")
                                             if sys.byteorder == "little" else None)
        self._gen_map: mmap.mmap | None = gen_map
        self._gen_fd: int | None = fd
        self._seen = -1  # the generation the cache below was listed at
        self._marked: dict[str, dict[int, str]] = {}
        self._ok: set[tuple[str, str]] = set()  # verified marks this process read

    def close(self) -> None:
        """Let go of the counter's descriptor (later looks open the file). Idempotent."""
        with self._lock:
            fd, self._gen_fd = self._gen_fd, None
            # the mapping is let go of, not closed: a snapshot may still hold its view
            # (``counter``) and look at it after the store closed; it goes with the view
            self._gen_map = self._gen_view = None
        if fd is not None:
            os.close(fd)

    def counter(self) -> memoryview | None:
        """The shared counter as a one-item view (``view[0]``: the count now), for a
        reader that looks per access; None on a closed store or a big-endian host
        (use ``generation``)."""
        return self._gen_view

    def generation(self) -> int:
        """The counter of corrupt marks made in the store so far (this boot)."""
        view = self._gen_view
        if view is not None:
            return int(view[0])
        gen_map = self._gen_map
        if gen_map is not None:
            return int(_COUNTER.unpack_from(gen_map)[0])
        # closed: tensors of a closed store may still be read
        fd = os.open(self._gen_path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            return int(struct.unpack("<Q", os.pread(fd, 8, 0).ljust(8, b"\0"))[0])
        finally:
            os.close(fd)

    def _bump(self) -> None:
        fd = os.open(self._gen_path, os.O_RDWR | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            n = int(struct.unpack("<Q", os.pread(fd, 8, 0).ljust(8, b"\0"))[0])
            os.pwrite(fd, struct.pack("<Q", n + 1), 0)
        finally:
            os.close(fd)

    # -- corrupt -------------------------------------------------------------------
    def corrupt(self, segment_id: str) -> dict[int, str] | None:
        """The marked extents of a segment (offset -> why; ``WHOLE``: all of them), or
        None when none is marked. Costs a read of the shared counter while no new mark
        was made since this process last listed them."""
        gen = self.generation()
        if gen != self._seen:
            self._relist(gen)
        return self._marked.get(segment_id)

    def _relist(self, gen: int) -> None:
        """List every corrupt mark (``gen``: the counter read before the listing, so a
        mark made during it makes the next look list again)."""
        marked: dict[str, dict[int, str]] = {}
        with os.scandir(self.root) as it:
            names = [e.name for e in it if e.name.endswith(".corrupt")]
        for name in names:
            text = _read(self.root / name)
            if text is None:
                continue
            out: dict[int, str] = {}
            for line in text.splitlines():
                off, _, why = line.partition("\t")
                try:
                    out.setdefault(int(off), why)
                except ValueError:  # a torn line: the segment stays refused as a whole
                    out.setdefault(WHOLE, why or "marked corrupt")
            marked[name[: -len(".corrupt")]] = out or {WHOLE: "marked corrupt"}
        with self._lock:
            self._marked, self._seen = marked, gen

    def mark_corrupt(self, segment_id: str, offset: int, reason: str) -> None:
        """Mark an extent of a segment corrupt (``WHOLE``: all of them): no read of it
        succeeds from now on, in any process of the host. One appended line (atomic)."""
        line = f"{offset}\t{' '.join(reason.split())[:1000]}\n".encode("utf-8", "replace")
        fd = os.open(self.root / f"{segment_id}.corrupt",
                     os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)
        try:
            os.unlink(self.root / f"{segment_id}.ok")
        except FileNotFoundError:
            pass
        self._ok = {k for k in self._ok if k[0] != segment_id}
        self._bump()  # after the mark: a reader that sees the new count lists it

    # -- verified ------------------------------------------------------------------
    def _identity(self, st: os.stat_result) -> str:
        return f"{self._boot} {st.st_dev} {st.st_ino} {st.st_size} {st.st_mtime_ns}"

    def verified(self, segment_id: str, st: os.stat_result) -> bool:
        """Whether the segment's file (``st``: its stat now) was verified on this boot
        and has not changed since."""
        key = (segment_id, self._identity(st))
        if key in self._ok:
            return True
        if _read(self.root / f"{segment_id}.ok") == key[1]:
            self._ok.add(key)
            return True
        return False

    def mark_verified(self, segment_id: str, st: os.stat_result) -> None:
        """Record that the file ``st`` describes holds the segment's good bytes."""
        ident = self._identity(st)
        _write_atomic(self.root / f"{segment_id}.ok", ident)
        self._ok.add((segment_id, ident))

    def rename(self, old_id: str, new_id: str) -> None:
        """A file written as ``old_id`` was renamed to be segment ``new_id`` (a pulled
        replica): its verified mark follows it (the identity is the inode's)."""
        try:
            os.replace(self.root / f"{old_id}.ok", self.root / f"{new_id}.ok")
        except FileNotFoundError:
            pass

    def forget(self, segment_id: str) -> None:
        """Drop a deleted segment's marks."""
        self._ok = {k for k in self._ok if k[0] != segment_id}
        for suffix in (".ok", ".corrupt"):
            try:
                os.unlink(self.root / f"{segment_id}{suffix}")
            except FileNotFoundError:
                pass

    # -- the scrub's cursor ----------------------------------------------------------
    def cursor(self) -> tuple[str, float] | None:
        """(the segment the last scrub stopped after, when it ran), or None: never."""
        path = self.root / "scrub.cursor"
        text = _read(path)
        if text is None:
            return None
        try:
            return text, os.stat(path).st_mtime
        except FileNotFoundError:
            return None

    def set_cursor(self, segment_id: str) -> None:
        _write_atomic(self.root / "scrub.cursor", segment_id)


def check_extents(data: Callable[[int, int], np.ndarray], size: int,
                  extents: Sequence[Extent]) -> list[tuple[int, str]]:
    """The extents of a segment of ``size`` bytes (whose bytes ``data(offset, nbytes)``
    gives) that fail their checksums, as (offset, reason naming the extent); [] when
    every one matches. Large segments are hashed on the I/O pool (xxh3 releases the
    GIL)."""
    def one(ext: Extent) -> tuple[int, str] | None:
        offset, nbytes, expected, what = ext
        if offset < 0 or offset + nbytes > size:
            return offset, (f"{what}: extent [{offset}, {offset + nbytes}) lies past the "
                            f"end of its {size}-byte segment (truncated)")
        got = checksum(data(offset, nbytes))
        if got != expected:
            return offset, f"{what}: checksum {got} != {expected}"
        return None

    seen: set[tuple[int, int]] = set()
    todo = []
    for ext in extents:
        if ext[1] and (ext[0], ext[1]) not in seen:
            seen.add((ext[0], ext[1]))
            todo.append(ext)
    total = sum(e[1] for e in todo)
    if total < (64 << 20) or len(todo) < 2:
        results = list(map(one, todo))
    else:
        results = list(io_pool().map(one, todo))
    return [r for r in results if r is not None]
