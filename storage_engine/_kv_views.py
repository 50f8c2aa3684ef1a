"""This process's zero-copy views of host blocks in the KV store (``BlockStore.get``).

A view is a private (copy-on-write) mapping of its chunk, one per view, so a reader's
stray write changes its own pages only. A private mapping still sees later writes to
the file where the reader did not write, so each view holds a *read lease* on its
record: counted here per record, recorded in the shared record once, given back by
the view's finalizer (no lock, no call into the index) and flushed to the index at the
process's next call into the store. A slab file cut short outside the store gets its
pages back before anything maps it (``restore_slab``).
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ._checksum import checksum
from ._kv_types import BlockView, KVStoreFull, each
from ._stream import BlockIndex

__all__ = ["HostViews", "restore_slab"]

log = logging.getLogger(__name__)


def restore_slab(path: str, size: int) -> None:
    """Give a slab file cut shorter than ``size`` (or deleted) outside the store its pages
    back before a mapping touches it: an access past the end of a file is a SIGBUS,
    where restored pages read zeros and fail their blocks' checksums."""
    try:
        if os.stat(path).st_size >= size:
            return
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
    try:
        if os.fstat(fd).st_size < size:
            log.warning("KV slab %s is %d bytes, not %d: damaged outside the store; "
                        "restored (its blocks past the cut fail their checksums)",
                        path, os.fstat(fd).st_size, size)
            os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            raise KVStoreFull(f"shared memory is full: no room to restore {path}",
                              needed=size) from exc
        raise
    finally:
        os.close(fd)


class HostViews:
    """This process's zero-copy views of host blocks: a lease per record, counted here,
    recorded in the shared record once; views give theirs back through ``give_back``
    (a finalizer: no lock, no call into the index), and the next call flushes them."""

    def __init__(self) -> None:
        self.held: dict[tuple[int, int], int] = {}
        self.given: deque[tuple[int, int]] = deque()
        self.give_back = self.given.append
        self._fds: dict[tuple[int, int], int] = {}

    def reset(self) -> None:
        self.held.clear()
        self.given.clear()
        self.close()

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}

    def flush(self, ix: BlockIndex) -> None:
        """Give the index back the leases whose last view here is gone."""
        if not self.given:
            return
        done: list[tuple[int, int]] = []
        while self.given:
            lease = self.given.popleft()
            n = self.held.get(lease, 0) - 1
            if n <= 0:
                self.held.pop(lease, None)
                done.append(lease)
            else:
                self.held[lease] = n
        if done:
            ix.release(np.array([d[0] for d in done], np.uint64),
                       np.array([d[1] for d in done], np.uint64))

    def private(self, path: str, slab: tuple[int, int], offset: int, nbytes: int
                ) -> np.ndarray:
        """A new private (copy-on-write) mapping of a leased chunk's bytes. A chunk under
        a page shares its page with others: the mapping covers the whole pages, the
        view only the chunk."""
        restore_slab(path, offset + nbytes)
        fd = self._fds.get(slab)
        if fd is None:
            fd = self._fds[slab] = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        base = offset - offset % mmap.ALLOCATIONGRANULARITY
        mm = mmap.mmap(fd, offset + nbytes - base, offset=base, access=mmap.ACCESS_COPY)
        return np.frombuffer(mm, dtype=np.uint8, count=nbytes, offset=offset - base)

    def hand_out(self, keys: Sequence[bytes], found: Sequence[Any],
                 slab_path: Callable[[int, int], str], verify: bool
                 ) -> tuple[list[BlockView | None], list[bytes], list[tuple[int, int]]]:
        """Views of the records ``found`` leased for ``keys`` (per key a lease tuple,
        (idx, gen, slab, slab_gen, offset, nbytes, csum, meta), or anything else for
        none), each on a private mapping of its chunk and holding its lease until it is
        garbage collected. With ``verify`` each block's checksum is checked first: one
        that fails gets None, and its key and (idx, gen) come back for the caller to
        drop; so does every lease of a call that raises (no view then holds one)."""
        arrs: list[np.ndarray | None] = [
            None if not isinstance(f, tuple) else
            self.private(slab_path(f[2], f[3]), (f[2], f[3]), f[4], f[5]) for f in found]
        live = [a for a in arrs if a is not None]
        sums = iter(each(checksum, [(a,) for a in live], sum(a.size for a in live))
                    if verify else [])
        out: list[BlockView | None] = []
        bad: list[bytes] = []
        drop: list[tuple[int, int]] = []
        for key, f, arr in zip(keys, found, arrs, strict=True):
            if not isinstance(f, tuple) or arr is None:
                out.append(None)
                continue
            idx, gen, _, _, _, _, csum, meta = f
            if verify and int(next(sums), 16) != csum:
                bad.append(key)
                drop.append((idx, gen))
                out.append(None)
                continue
            self.held[(idx, gen)] = self.held.get((idx, gen), 0) + 1
            weakref.finalize(arr, self.give_back, (idx, gen))
            out.append(BlockView(arr, meta))
        return out, bad, drop
