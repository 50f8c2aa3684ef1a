"""The host arena of the KV block store: slabs of fixed-size chunks in shared memory.

Blocks are many and small, so each is a chunk of a *slab* (a file of chunks of one size
class, ``<root>/slabs/<id>.slab``), not a file of its own. Slabs are pre-allocated
with posix_fallocate, so a full tmpfs is an error at slab creation, never a SIGBUS at
first write. The index holds, per slab, its chunk size and how many chunks are in use
(``slabs``), and the free chunks by size (``free``: a cursor on a size finds one).

The arena knows chunks, not blocks: which block a chunk holds, and when a chunk may be
freed, is ``BlockTable``'s business. Every method that takes ``txn`` runs inside the
caller's write transaction.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import struct
from pathlib import Path

import lmdb
import numpy as np

from ._kv_index import KVIndex
from ._kv_types import FREE, POPULATE, SLAB, SLAB_ID, KVStoreFull

__all__: list[str] = []  # a part of BlockStore, nothing public

log = logging.getLogger(__name__)


class HostArena:
    """The slab files of one store and this process's mappings of them."""

    DB_NAMES = ("slabs", "free")

    def __init__(self, index: KVIndex, root: Path, *, capacity: int, slab_bytes: int
                 ) -> None:
        self._index = index
        self.root = root  # the slabs directory
        self.capacity = capacity
        self.slab_bytes = slab_bytes
        self._rfds: dict[int, int] = {}  # slab -> read-only fd (private views map it)
        self._wmaps: dict[int, mmap.mmap] = {}  # slab -> shared mapping (put, get_into)
        self._seen_drops = -1

    def reset(self) -> None:
        """After a fork: the parent's descriptors and mappings stay the parent's."""
        self._rfds, self._wmaps = {}, {}
        self._seen_drops = -1

    def close(self) -> None:
        for fd in self._rfds.values():
            os.close(fd)
        for mm in self._wmaps.values():
            try:
                mm.close()
            except BufferError:
                pass
        self._rfds, self._wmaps = {}, {}

    # -- files and mappings ----------------------------------------------------------
    def slab_path(self, slab: int) -> Path:
        return self.root / f"{slab:08x}.slab"

    def slab_info(self, txn: lmdb.Transaction, slab: int) -> tuple[int, int, int]:
        """(chunk size, chunks, chunks in use) of a slab."""
        raw = txn.get(SLAB_ID.pack(slab), db=self._index.dbs["slabs"])
        assert raw is not None, f"slab {slab} has no record"
        return SLAB.unpack(raw)

    def restore(self, slab: int, size: int) -> None:
        """Give a slab file cut shorter than ``size`` (its end truncated by another
        process or a user) its pages back: a mapping's access past the end of its file
        is a SIGBUS that kills the process, where the restored pages read zeros, which
        fail their blocks' checksums (the blocks are dropped as corrupt). One stat per
        call; KVStoreFull when shared memory has no room for the pages."""
        path = self.slab_path(slab)
        try:
            if os.stat(path).st_size >= size:
                return
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:  # deleted: recreated empty, its blocks fail as above
            fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
        try:
            if os.fstat(fd).st_size < size:
                log.warning("KV slab %s is %d bytes, not %d: truncated outside the store; "
                            "restored (its blocks past the cut fail their checksums)",
                            path, os.fstat(fd).st_size, size)
                os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                raise KVStoreFull(f"shared memory is full: no room to restore the "
                                  f"truncated slab {path}", needed=size) from exc
            raise
        finally:
            os.close(fd)

    def _wmap(self, slab: int, size: int) -> mmap.mmap:
        mm = self._wmaps.get(slab)
        if mm is None:
            fd = os.open(self.slab_path(slab), os.O_RDWR | os.O_CLOEXEC)
            try:
                mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | POPULATE,
                               prot=mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(fd)
            self._wmaps[slab] = mm
        return mm

    def chunk(self, txn: lmdb.Transaction, slab: int, chunk: int, nbytes: int,
              info: tuple[int, int, int] | None = None) -> np.ndarray:
        """A writable view of the chunk's first ``nbytes`` on the shared mapping;
        ``info`` is the slab's ``slab_info`` when the caller has it already."""
        csize, nchunks, _ = info if info is not None else self.slab_info(txn, slab)
        mm = self._wmap(slab, csize * nchunks)
        return np.frombuffer(mm, dtype=np.uint8, count=nbytes, offset=chunk * csize)

    def shared_bytes(self, slab: int, offset: int, nbytes: int) -> np.ndarray:
        """The bytes of a leased chunk through this process's shared mapping of the slab
        (a read transaction of its own when the slab is not mapped yet)."""
        self.restore(slab, offset + nbytes)
        mm = self._wmaps.get(slab)
        if mm is None:
            with self._index.env.begin() as txn:
                csize, nchunks, _ = self.slab_info(txn, slab)
            mm = self._wmap(slab, csize * nchunks)
        return np.frombuffer(mm, dtype=np.uint8, count=nbytes, offset=offset)

    def private_bytes(self, slab: int, offset: int, nbytes: int) -> np.ndarray:
        """A new private (copy-on-write) mapping of a leased chunk's bytes: a reader's
        stray write changes its own pages only. A chunk smaller than a page shares its
        page with others: the mapping covers the whole pages, the view only the chunk."""
        self.restore(slab, offset + nbytes)
        fd = self._rfds.get(slab)
        if fd is None:
            fd = self._rfds[slab] = os.open(self.slab_path(slab), os.O_RDONLY | os.O_CLOEXEC)
        base = offset - offset % mmap.ALLOCATIONGRANULARITY
        mm = mmap.mmap(fd, offset + nbytes - base, offset=base, access=mmap.ACCESS_COPY)
        return np.frombuffer(mm, dtype=np.uint8, count=nbytes, offset=offset - base)

    def _forget_slab(self, slab: int) -> None:
        fd = self._rfds.pop(slab, None)
        if fd is not None:
            os.close(fd)
        mm = self._wmaps.pop(slab, None)
        if mm is not None:
            try:
                mm.close()
            except BufferError:  # a view of a get_into source still alive: let gc do it
                pass

    def begin(self, txn: lmdb.Transaction) -> None:
        """Close this process's handles on slabs another process dropped: an unlinked
        file's pages live as long as someone maps it (a WriteHooks step)."""
        drops = self._index.counter(txn, "slab_drops", 0)
        if drops == self._seen_drops:
            return
        self._seen_drops = drops
        for slab in set(self._rfds) | set(self._wmaps):
            if txn.get(SLAB_ID.pack(slab), db=self._index.dbs["slabs"]) is None:
                self._forget_slab(slab)

    def aborted(self) -> None:
        """Nothing to undo (a WriteHooks step)."""

    # -- allocation ------------------------------------------------------------------
    def take_free(self, txn: lmdb.Transaction, csize: int) -> tuple[int, int] | None:
        """A free chunk of size class ``csize`` as (slab, chunk), now in use; None when
        no slab of that size has one."""
        prefix = struct.pack(">Q", csize)
        cur = txn.cursor(db=self._index.dbs["free"])
        if not (cur.set_range(prefix) and bytes(cur.key())[:8] == prefix):
            return None
        _, slab, chunk = FREE.unpack(cur.key())
        cur.delete()
        s_csize, nchunks, used = self.slab_info(txn, slab)
        txn.put(SLAB_ID.pack(slab), SLAB.pack(s_csize, nchunks, used + 1),
                db=self._index.dbs["slabs"])
        return slab, chunk

    def release_chunk(self, txn: lmdb.Transaction, slab: int, chunk: int) -> None:
        """Back on the free list (once nobody reads it: see ``ReadLeases.free``)."""
        csize, nchunks, used = self.slab_info(txn, slab)
        txn.put(SLAB_ID.pack(slab), SLAB.pack(csize, nchunks, used - 1),
                db=self._index.dbs["slabs"])
        txn.put(FREE.pack(csize, slab, chunk), b"", db=self._index.dbs["free"])

    def new_slab(self, txn: lmdb.Transaction, csize: int) -> bool:
        """Add a slab of chunks of ``csize`` if the capacity allows one; False if not.
        KVStoreFull when shared memory itself has no room for it."""
        index = self._index
        used = index.counter(txn, "arena_bytes", 0)
        nchunks = min(max(1, self.slab_bytes // csize), (self.capacity - used) // csize)
        if nchunks < 1:
            return False
        slab = index.counter(txn, "slab_id", 1)
        path = self.slab_path(slab)
        path.unlink(missing_ok=True)  # left by a creator killed in its transaction
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o600)
        try:
            index.created(path)
            os.posix_fallocate(fd, 0, csize * nchunks)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                raise KVStoreFull(f"shared memory is full: no room for a slab of "
                                  f"{csize * nchunks} bytes under {self.root.parent}",
                                  needed=csize * nchunks, capacity=self.capacity) from exc
            raise
        finally:
            os.close(fd)
        txn.put(SLAB_ID.pack(slab), SLAB.pack(csize, nchunks, 0), db=index.dbs["slabs"])
        fdb = index.dbs["free"]
        for c in range(nchunks):
            txn.put(FREE.pack(csize, slab, c), b"", db=fdb)
        index.counter(txn, "arena_bytes", csize * nchunks)
        return True

    def drop_empty_slab(self, txn: lmdb.Transaction, keep: int) -> bool:
        """Drop one slab with no chunk in use whose size is not ``keep`` (its memory is
        wanted for another size class); False when there is none."""
        index = self._index
        for raw_id, raw in txn.cursor(db=index.dbs["slabs"]):
            csize, nchunks, used = SLAB.unpack(raw)
            if used == 0 and csize != keep:
                slab = SLAB_ID.unpack(raw_id)[0]
                for c in range(nchunks):
                    txn.delete(FREE.pack(csize, slab, c), db=index.dbs["free"])
                txn.delete(raw_id, db=index.dbs["slabs"])
                index.counter(txn, "arena_bytes", -csize * nchunks)
                index.counter(txn, "slab_drops", 1)
                index.doom(self.slab_path(slab))
                self._forget_slab(slab)
                return True
        return False

    def reclaim_orphans(self, txn: lmdb.Transaction) -> None:
        """Remove slab files no index entry names (their creator died inside its
        transaction). Runs when a process opens the store, under the write lock."""
        known = {self.slab_path(SLAB_ID.unpack(k)[0]).name
                 for k in txn.cursor(db=self._index.dbs["slabs"]).iternext(values=False)}
        for entry in os.scandir(self.root):
            if entry.name.endswith(".slab") and entry.name not in known:
                Path(entry.path).unlink(missing_ok=True)
