"""The arena half of the KV block store: slabs, chunks, read leases, eviction, spill.

A mixin of ``BlockStore`` (``_kv``): every method runs inside the caller's LMDB write
transaction ``txn`` and uses the store's databases and counters. ``alive`` caches, for
the length of one transaction, which lease holders are alive.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import errno
import mmap
import os
import struct
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ._kv_gpu import GPU_BIT
from ._kv_policy import EvictionPolicy
from ._kv_types import (
    _DISK,
    _FREE,
    _HOST,
    _ID,
    _LOC,
    _POPULATE,
    _REC,
    _SLAB,
    MAX_KEY,
    KVStoreFull,
    size_class,
)
from ._procs import holder_alive

__all__: list[str] = []  # a mixin of BlockStore, nothing public


class _Arena(ABC):
    root: Path
    disk_root: Path | None
    disk_capacity: int | None
    capacity: int
    slab_bytes: int
    policy: EvictionPolicy
    _db: dict[str, Any]
    _blocks: Any
    _holder: bytes
    _leases: dict[tuple[int, int], int]
    _released: deque[tuple[int, int]]
    _rfds: dict[int, int]
    _wmaps: dict[int, mmap.mmap]
    _created: list[Path]
    _doomed: list[Path]

    @abstractmethod
    def _counter(self, txn: Any, name: str, delta: int) -> int:
        """Add ``delta`` to a named counter in ``txn``; the new value (BlockStore)."""

    @abstractmethod
    def _write(self) -> Any:
        """A write transaction on the index (BlockStore)."""

    @abstractmethod
    def _gpu_forget(self, txn: Any, key: bytes, alive: dict[bytes, bool]) -> bool:
        """Drop the block's GPU copy, if any (_GpuArena): a block leaving the store."""

    @abstractmethod
    def _gpu_release_chunk(self, txn: Any, slab: int, chunk: int) -> None:
        """Put a GPU chunk back on its free list (_GpuArena)."""

    def _slab_path(self, slab: int) -> Path:
        return self.root / "slabs" / f"{slab:08x}.slab"

    def _disk_path(self, key: bytes, rec: bytes) -> Path:
        """A spilled block's file: named by key and spill number (kept in the record's
        slab and chunk fields), so a file doomed by one spill's promotion is never a
        later spill's of the same key."""
        assert self.disk_root is not None
        _, hi, lo = _REC.unpack_from(rec)[:3]
        return self.disk_root / f"{key.hex()}-{hi << 32 | lo:x}.blk"

    def _slab_info(self, txn: Any, slab: int) -> tuple[int, int, int]:
        return _SLAB.unpack(txn.get(_ID.pack(slab), db=self._db["slabs"]))

    def _wmap(self, slab: int, size: int) -> mmap.mmap:
        mm = self._wmaps.get(slab)
        if mm is None:
            fd = os.open(self._slab_path(slab), os.O_RDWR | os.O_CLOEXEC)
            try:
                mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | _POPULATE,
                               prot=mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(fd)
            self._wmaps[slab] = mm
        return mm

    def _chunk(self, txn: Any, slab: int, chunk: int, nbytes: int,
               info: tuple[int, int, int] | None = None) -> np.ndarray:
        """A writable view of the chunk's first ``nbytes``; ``info`` is the slab's
        ``_slab_info`` when the caller has it already."""
        csize, nchunks, _ = info if info is not None else self._slab_info(txn, slab)
        mm = self._wmap(slab, csize * nchunks)
        return np.frombuffer(mm, dtype=np.uint8, count=nbytes, offset=chunk * csize)

    def _rfd(self, slab: int) -> int:
        fd = self._rfds.get(slab)
        if fd is None:
            fd = os.open(self._slab_path(slab), os.O_RDONLY | os.O_CLOEXEC)
            self._rfds[slab] = fd
        return fd

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

    @staticmethod
    def _check_keys(keys: Sequence[bytes]) -> list[bytes]:
        out = []
        for k in keys:
            if not isinstance(k, (bytes, bytearray)) or not 0 < len(k) <= MAX_KEY:
                raise ValueError(f"a block key must be 1 to {MAX_KEY} bytes, not {k!r:.60}")
            out.append(bytes(k))
        return out

    # -- leases ----------------------------------------------------------------------
    def _lease(self, txn: Any, loc: tuple[int, int]) -> None:
        n = self._leases.get(loc, 0)
        if n == 0:
            txn.put(_LOC.pack(*loc) + self._holder, b"", db=self._db["leases"])
        self._leases[loc] = n + 1

    def _unlease(self, txn: Any, loc: tuple[int, int]) -> None:
        n = self._leases.get(loc, 0) - 1
        if n <= 0:
            self._leases.pop(loc, None)
            txn.delete(_LOC.pack(*loc) + self._holder, db=self._db["leases"])
        else:
            self._leases[loc] = n

    def _flush_releases(self, txn: Any = None) -> list[tuple[int, int]]:
        if not self._released:
            return []
        if txn is None:
            with self._write():
                pass
            return []
        flushed = []
        while self._released:
            loc = self._released.popleft()
            self._unlease(txn, loc)
            flushed.append(loc)
        return flushed

    def release_pending(self) -> None:
        """Drop the read leases of views this process no longer holds (else done at its
        next call into the store)."""
        with self._lock:
            self._check_pid()
            self._flush_releases()

    def _leased(self, txn: Any, loc: bytes, alive: dict[bytes, bool]) -> bool:
        """Whether a live process holds a view of the chunk at ``loc``; drops the leases
        of dead ones."""
        cur = txn.cursor(db=self._db["leases"])
        if not cur.set_range(loc):
            return False
        dead = []
        live = False
        for k in cur.iternext(keys=True, values=False):
            k = bytes(k)
            if not k.startswith(loc):
                break
            holder = k[len(loc):]
            ok = alive.get(holder)
            if ok is None:
                ok = alive[holder] = holder == self._holder or \
                    holder_alive(holder.decode()) is not False
            if ok:
                live = True
                break
            dead.append(k)
        for k in dead:
            txn.delete(k, db=self._db["leases"])
        return live

    # -- allocation ----------------------------------------------------------------
    def _free_chunk(self, txn: Any, slab: int, chunk: int, alive: dict[bytes, bool]) -> None:
        loc = _LOC.pack(slab, chunk)
        if self._leased(txn, loc, alive):  # a reader maps it: free it once they are gone
            txn.put(loc, b"", db=self._db["zombies"])
            return
        if slab & GPU_BIT:
            self._gpu_release_chunk(txn, slab, chunk)
            return
        csize, nchunks, used = self._slab_info(txn, slab)
        txn.put(_ID.pack(slab), _SLAB.pack(csize, nchunks, used - 1), db=self._db["slabs"])
        txn.put(_FREE.pack(csize, slab, chunk), b"", db=self._db["free"])

    def _reclaim_zombies(self, txn: Any, alive: dict[bytes, bool]) -> int:
        freed = 0
        cur = txn.cursor(db=self._db["zombies"])
        for loc in list(cur.iternext(keys=True, values=False)):
            loc = bytes(loc)
            if not self._leased(txn, loc, alive):
                txn.delete(loc, db=self._db["zombies"])
                self._free_chunk(txn, *_LOC.unpack(loc), alive)
                freed += 1
        return freed

    def _reclaim_dead_writers(self, txn: Any, alive: dict[bytes, bool]) -> int:
        freed = 0
        cur = txn.cursor(db=self._db["writing"])
        for key, holder in list(cur.iternext()):
            holder = bytes(holder)
            if holder == self._holder or holder_alive(holder.decode()) is not False:
                continue
            self._drop_writing(txn, bytes(key), alive)
            freed += 1
        return freed

    def _drop_writing(self, txn: Any, key: bytes, alive: dict[bytes, bool]) -> None:
        rec = txn.pop(key, db=self._blocks)
        txn.delete(key, db=self._db["writing"])
        if rec is not None:
            _, slab, chunk, _, _, _ = _REC.unpack_from(rec)
            self._free_chunk(txn, slab, chunk, alive)

    def _new_slab(self, txn: Any, csize: int) -> bool:
        used = self._counter(txn, "arena_bytes", 0)
        nchunks = min(max(1, self.slab_bytes // csize), (self.capacity - used) // csize)
        if nchunks < 1:
            return False
        slab = self._counter(txn, "slab_id", 1)
        path = self._slab_path(slab)
        path.unlink(missing_ok=True)  # left by a creator killed in its transaction
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o600)
        try:
            self._created.append(path)
            os.posix_fallocate(fd, 0, csize * nchunks)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                raise KVStoreFull(f"shared memory is full: no room for a slab of "
                                  f"{csize * nchunks} bytes under {self.root}",
                                  needed=csize * nchunks, capacity=self.capacity) from exc
            raise
        finally:
            os.close(fd)
        txn.put(_ID.pack(slab), _SLAB.pack(csize, nchunks, 0), db=self._db["slabs"])
        fdb = self._db["free"]
        for c in range(nchunks):
            txn.put(_FREE.pack(csize, slab, c), b"", db=fdb)
        self._counter(txn, "arena_bytes", csize * nchunks)
        return True

    def _drop_empty_slab(self, txn: Any, keep: int) -> bool:
        for raw_id, raw in txn.cursor(db=self._db["slabs"]):
            csize, nchunks, used = _SLAB.unpack(raw)
            if used == 0 and csize != keep:
                slab = _ID.unpack(raw_id)[0]
                for c in range(nchunks):
                    txn.delete(_FREE.pack(csize, slab, c), db=self._db["free"])
                txn.delete(raw_id, db=self._db["slabs"])
                self._counter(txn, "arena_bytes", -csize * nchunks)
                self._counter(txn, "slab_drops", 1)
                self._doomed.append(self._slab_path(slab))
                self._forget_slab(slab)
                return True
        return False

    def _evictable(self, txn: Any, key: bytes, alive: dict[bytes, bool]) -> bool:
        rec = txn.get(key, db=self._blocks)
        if rec is None:
            return False
        state, slab, chunk, _, _, pins = _REC.unpack_from(rec)
        return state == _HOST and pins == 0 and \
            not self._leased(txn, _LOC.pack(slab, chunk), alive)

    def _allocate(self, txn: Any, nbytes: int, alive: dict[bytes, bool]) -> tuple[int, int]:
        csize = size_class(nbytes)
        if csize > self.capacity:
            raise KVStoreFull(f"a block of {nbytes} bytes is larger than the arena "
                              f"({self.capacity} bytes)", needed=nbytes,
                              capacity=self.capacity)
        prefix = struct.pack(">Q", csize)
        fdb = self._db["free"]
        reclaimed = False
        while True:
            cur = txn.cursor(db=fdb)
            if cur.set_range(prefix) and bytes(cur.key())[:8] == prefix:
                _, slab, chunk = _FREE.unpack(cur.key())
                cur.delete()
                s_csize, nchunks, used = self._slab_info(txn, slab)
                txn.put(_ID.pack(slab), _SLAB.pack(s_csize, nchunks, used + 1),
                        db=self._db["slabs"])
                return slab, chunk
            if self._new_slab(txn, csize):
                continue
            if self._drop_empty_slab(txn, csize):
                continue
            if not reclaimed:
                reclaimed = True
                if self._reclaim_zombies(txn, alive) + self._reclaim_dead_writers(txn, alive):
                    continue
            victim = self.policy.victim(txn, lambda k: self._evictable(txn, k, alive))
            if victim is None:
                raise KVStoreFull(
                    f"the KV arena under {self.root} is full ({self.capacity} bytes) and "
                    f"every block in it is pinned or being read", needed=nbytes,
                    capacity=self.capacity)
            self._evict(txn, victim, alive)

    def _evict(self, txn: Any, key: bytes, alive: dict[bytes, bool]) -> None:
        rec = txn.get(key, db=self._blocks)
        state, slab, chunk, nbytes, csum, pins = _REC.unpack_from(rec)
        meta = bytes(rec[_REC.size:])
        self.policy.on_remove(txn, key)
        self._counter(txn, "evictions", 1)
        self._counter(txn, "host_blocks", -1)
        self._counter(txn, "host_bytes", -nbytes)
        if self.disk_root is not None and (self.disk_capacity is None
                                           or nbytes <= self.disk_capacity):
            seq = self._counter(txn, "disk_seq", 1)
            new = _REC.pack(_DISK, seq >> 32, seq & 0xFFFFFFFF, nbytes, csum, pins) + meta
            path = self._disk_path(key, new)
            # O_TRUNC: a file of this name is one a writer killed in its transaction left
            fd = os.open(path, os.O_CREAT | os.O_TRUNC | os.O_WRONLY | os.O_CLOEXEC, 0o600)
            self._created.append(path)
            try:
                view = memoryview(self._chunk(txn, slab, chunk, nbytes))
                while view:
                    view = view[os.write(fd, view):]
            finally:
                os.close(fd)
            txn.put(key, new, db=self._blocks)  # a GPU copy stays: the disk has the block
            txn.put(struct.pack(">Q", seq) + key, b"", db=self._db["disk"])
            self._counter(txn, "spills", 1)
            self._counter(txn, "disk_blocks", 1)
            if self._counter(txn, "disk_bytes", nbytes) > (self.disk_capacity or 1 << 62):
                self._trim_disk(txn)
        else:
            txn.delete(key, db=self._blocks)
            self._gpu_forget(txn, key, alive)
        self._free_chunk(txn, slab, chunk, alive)

    def _trim_disk(self, txn: Any) -> None:
        limit = self.disk_capacity or 1 << 62
        for qkey in list(txn.cursor(db=self._db["disk"]).iternext(values=False)):
            if self._counter(txn, "disk_bytes", 0) <= limit:
                break
            qkey = bytes(qkey)
            key = qkey[8:]
            rec = txn.get(key, db=self._blocks)
            if rec is not None and rec[0] == _DISK and \
                    self._disk_path(key, rec).name.endswith(f"-{int(qkey[:8].hex(), 16):x}.blk"):
                if _REC.unpack_from(rec)[5]:  # pinned (it found no room in memory)
                    continue
                self._drop_disk(txn, key, bytes(rec))
            txn.delete(qkey, db=self._db["disk"])  # that spill is gone, or this is it

    def _drop_disk(self, txn: Any, key: bytes, rec: bytes) -> None:
        nbytes, _, pins = _REC.unpack_from(rec)[3:]
        if pins:
            self._counter(txn, "pinned", -1)
        txn.delete(key, db=self._blocks)
        self._gpu_forget(txn, key, {})
        self._unlist_disk(txn, key, rec)

    def _unlist_disk(self, txn: Any, key: bytes, rec: bytes) -> None:
        self._counter(txn, "disk_blocks", -1)
        self._counter(txn, "disk_bytes", -_REC.unpack_from(rec)[3])
        self._doomed.append(self._disk_path(key, rec))

    def _reclaim_orphan_slabs(self, txn: Any) -> None:
        """Slab and spill files no index entry names (their creator died inside its
        transaction). Runs when a process opens the store, under the write lock."""
        known = {self._slab_path(_ID.unpack(k)[0]).name
                 for k in txn.cursor(db=self._db["slabs"]).iternext(values=False)}
        for entry in os.scandir(self.root / "slabs"):
            if entry.name.endswith(".slab") and entry.name not in known:
                Path(entry.path).unlink(missing_ok=True)
        if self.disk_root is None:
            return
        # spill files likewise: named by key and spill number, kept only if the index
        # record of that key names them
        for entry in os.scandir(self.disk_root):
            if not entry.name.endswith(".blk"):
                continue
            try:
                key = bytes.fromhex(entry.name.split("-", 1)[0])
            except ValueError:
                continue
            rec = txn.get(key, db=self._blocks) if key else None
            if rec is None or rec[0] != _DISK or \
                    self._disk_path(key, bytes(rec)).name != entry.name:
                Path(entry.path).unlink(missing_ok=True)
