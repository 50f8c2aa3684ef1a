"""The GPU tier of the KV block store: copies of hot blocks in device memory, mapped by
every process of the host through CUDA IPC.

The tier is *inclusive*: a block on the GPU is also in the host arena or spilled to
disk, so losing a GPU copy loses nothing. That is what makes CUDA's ownership rule
workable for a shared cache: device memory belongs to the process that allocated it
and dies with it. When that process exits, its slabs' blocks simply fall back to their
host copies (the next process that looks finds the owner gone and forgets the slab).
So a long-running process (an engine's main process, ``tensordb serve``) should be the
one that first fills the tier.

Device memory comes in slabs like the host arena's: one ``cudaMalloc`` per slab (a
segment of a ``GpuTier`` under ``<root>/gpu``, named by its slab id), cut into chunks
of one size class. The tier's index is an LMDB environment (``<root>/index``; the host's
blocks are in the store's native index, which the tier asks for a block's size and
metadata)::

    gpu_blocks      key -> slab, chunk, nbytes
    gpu_slabs       slab -> chunk size, chunks, chunks in use, owner (holder id)
    gpu_free        chunk size, slab, chunk (a cursor on the size finds a free one)
    gpu_slab_keys   slab + key: what to forget when a slab goes
    gpu_writing     slab, chunk -> holder: chunks reserved by a copy in flight
    gpu_lru_*       the tier's own LRU order

GPU slab ids have the top bit set (``GPU_BIT``), so read leases and deferred frees
share the host's tables and rules: a chunk that a process reads through a view is not
reused until that view is gone.

``GpuSlabs`` keeps the device slabs (the GPU's ``HostArena``), ``GpuBlockCache`` the
block copies in them. How blocks enter the tier and leave it (``get_device``,
``admit_device``, ``get_into_device``) is in ``_kv_gpu_part``. Eviction drops a GPU copy
(least recently used first, skipping chunks being read); pins are the host's business,
since the host copy is the one that must stay.
"""

from __future__ import annotations

import struct
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lmdb
import numpy as np

from ._cuda import GpuError, loaded, memcpy, on_device, synchronize
from ._errors import SegmentMissing, TierFull
from ._gpu import GpuTier, GpuView
from ._kv_eviction import LRUEviction
from ._kv_index import KVIndex, ReadLeases
from ._kv_types import FREE, GPU_BIT, LOC, SLAB_ID, Alive, size_class

__all__ = ["GpuBlockView"]

GREC = struct.Struct("<IIQ")  # slab, chunk, nbytes
GSLAB = struct.Struct("<QII")  # chunk size, chunks, chunks in use; the owner follows

#: copies a block into a reserved chunk: (index in the batch, device pointer, device)
CopyIn = Callable[[int, int, int], None]
#: the host's record of a readable block: (nbytes, meta), None when it has none
HostRecord = Callable[[bytes], "tuple[int, bytes] | None"]


class GpuBlockView:
    """A block's bytes in device memory as a 1-D uint8 ``__cuda_array_interface__``
    (``torch.as_tensor(view, device=f"cuda:{view.device}")`` is a zero-copy tensor).
    Shared with every reader on the host: read-only by convention. The block's chunk is
    not reused while the view (or a tensor made from it) lives."""

    __slots__ = ("ptr", "nbytes", "device", "meta", "_keep", "__weakref__")

    def __init__(self, ptr: int, nbytes: int, device: int, meta: bytes, keep: object) -> None:
        self.ptr = ptr
        self.nbytes = nbytes
        self.device = device
        self.meta = meta
        self._keep = keep  # the slab's mapping

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {"shape": (self.nbytes,), "typestr": "|u1", "data": (self.ptr, False),
                "strides": None, "version": 3}

    def to_host(self) -> np.ndarray:
        """Copy the block into a new host uint8 array."""
        out = np.empty(self.nbytes, np.uint8)
        with on_device(self.device):
            memcpy(out.ctypes.data, self.ptr, self.nbytes, "cudaMemcpyDeviceToHost")
        return out


class GpuSlabs:
    """The device slabs of one store and this process's mappings of them. Methods that
    take ``txn`` run inside the caller's write transaction.

    ``device`` is where this process allocates (None: the tier is off in this process,
    though it still forgets copies of blocks it deletes); ``capacity`` is the tier's
    bytes, fixed by the first process to give it (``bind``).
    """

    DB_NAMES = ("gpu_slabs", "gpu_free", "gpu_writing")

    def __init__(self, index: KVIndex, root: Path, *, device: int | None,
                 capacity: int | None, slab_bytes: int) -> None:
        self._index = index
        self.device = device
        self.capacity = capacity or 0
        self.slab_bytes = slab_bytes
        self._tier = GpuTier(root, device=device or 0)
        self._views: dict[int, GpuView] = {}
        self._seen_drops = -1

    @staticmethod
    def check_options(device: int | None, capacity: int | None) -> None:
        """ValueError for GPU options that make no tier (before anything is opened)."""
        if capacity is not None and capacity <= 0:
            raise ValueError("gpu_capacity must be positive")
        if device is not None and capacity is None:
            raise ValueError("a GPU tier needs gpu_capacity")

    def bind(self, txn: lmdb.Transaction) -> None:
        """Once the index's databases are open (again after a fork): adopt the tier's
        capacity; the parent's mappings are not this process's."""
        self._views = {}
        self._seen_drops = -1
        raw = self._index.setting(txn, b"gpu_capacity", None if self.device is None
                                  else str(self.capacity).encode())
        if raw is not None:
            self.capacity = int(raw)

    def close(self) -> None:
        self._views = {}
        if self.device is not None and loaded():
            try:
                self._tier.sweep()
            except GpuError:
                pass

    def info(self, txn: lmdb.Transaction, slab: int) -> tuple[int, int, int, bytes] | None:
        """(chunk size, chunks, chunks in use, owner) of a slab; None if it is gone."""
        raw = txn.get(SLAB_ID.pack(slab), db=self._index.dbs["gpu_slabs"])
        if raw is None:
            return None
        csize, nchunks, used = GSLAB.unpack_from(raw)
        return csize, nchunks, used, bytes(raw[GSLAB.size:])

    def view(self, slab: int) -> GpuView | None:
        """This process's mapping of a slab (the owner's own, or an IPC import)."""
        view = self._views.get(slab)
        if view is None:
            try:
                view = self._tier.open(f"{slab:08x}")
            except SegmentMissing:
                return None
            self._views[slab] = view
        return view

    def new(self, txn: lmdb.Transaction, csize: int) -> bool:
        """Allocate a slab of chunks of ``csize`` if the capacity and the device allow."""
        index = self._index
        used = index.counter(txn, "gpu_arena_bytes", 0)
        nchunks = min(max(1, self.slab_bytes // csize), (self.capacity - used) // csize)
        if nchunks < 1:
            return False
        slab = GPU_BIT | index.counter(txn, "gpu_slab_id", 1)
        seg = f"{slab:08x}"
        # a mapping cached under this id is of a slab whose creating transaction aborted
        # (the id came back with it): let go of it, so the sweep frees its memory, as it
        # frees what other processes dropped, before allocating more
        self._views.pop(slab, None)
        self._tier.sweep()
        try:
            writer = self._tier.create(seg, csize * nchunks)
        except TierFull:  # the device itself is out of memory
            return False
        index.created(self._tier.path(seg))  # an abort unlinks it
        writer.release()
        self._views[slab] = self._tier.open(seg)  # the owner's own view: no import
        txn.put(SLAB_ID.pack(slab), GSLAB.pack(csize, nchunks, 0) + index.holder,
                db=index.dbs["gpu_slabs"])
        fdb = index.dbs["gpu_free"]
        for c in range(nchunks):
            txn.put(FREE.pack(csize, slab, c), b"", db=fdb)
        index.counter(txn, "gpu_arena_bytes", csize * nchunks)
        return True

    def drop(self, txn: lmdb.Transaction, slab: int, info: tuple[int, int, int, bytes]
             ) -> None:
        """Forget a slab, its free chunks and its reservations (the copies in it are the
        cache's to forget first)."""
        index, dbs = self._index, self._index.dbs
        csize, nchunks, _, _ = info
        fdb = dbs["gpu_free"]
        for c in range(nchunks):
            txn.delete(FREE.pack(csize, slab, c), db=fdb)
            txn.delete(LOC.pack(slab, c), db=dbs["gpu_writing"])
        txn.delete(SLAB_ID.pack(slab), db=dbs["gpu_slabs"])
        index.counter(txn, "gpu_arena_bytes", -csize * nchunks)
        index.counter(txn, "slab_drops", 1)  # other processes let go of their mappings
        index.doom(self._tier.path(f"{slab:08x}"))
        self._views.pop(slab, None)

    def empty(self, txn: lmdb.Transaction, keep: int
              ) -> tuple[int, tuple[int, int, int, bytes]] | None:
        """A slab with no chunk in use whose size is not ``keep`` (its memory is wanted
        for another size class), with its info; None when there is none."""
        for raw_id, raw in txn.cursor(db=self._index.dbs["gpu_slabs"]):
            csize, nchunks, used = GSLAB.unpack_from(raw)
            if used == 0 and csize != keep:
                return SLAB_ID.unpack(raw_id)[0], (csize, nchunks, used,
                                                   bytes(raw[GSLAB.size:]))
        return None

    def take(self, txn: lmdb.Transaction, fkey: bytes,
             info: tuple[int, int, int, bytes]) -> tuple[int, int]:
        """Reserve the free chunk ``fkey`` (a ``gpu_free`` key) of a live slab for a copy
        by this process: (slab, chunk)."""
        dbs = self._index.dbs
        csize, slab, chunk = FREE.unpack(fkey)
        txn.delete(fkey, db=dbs["gpu_free"])
        txn.put(SLAB_ID.pack(slab), GSLAB.pack(csize, info[1], info[2] + 1) + info[3],
                db=dbs["gpu_slabs"])
        txn.put(LOC.pack(slab, chunk), self._index.holder, db=dbs["gpu_writing"])
        return slab, chunk

    def release_chunk(self, txn: lmdb.Transaction, slab: int, chunk: int) -> None:
        """Back on the free list (once nobody reads it: see ``ReadLeases.free``)."""
        info = self.info(txn, slab)
        if info is None:
            return  # the slab went meanwhile
        csize, nchunks, used, owner = info
        txn.put(SLAB_ID.pack(slab), GSLAB.pack(csize, nchunks, used - 1) + owner,
                db=self._index.dbs["gpu_slabs"])
        txn.put(FREE.pack(csize, slab, chunk), b"", db=self._index.dbs["gpu_free"])

    def begin(self, txn: lmdb.Transaction) -> None:
        """Let go of this process's mappings of slabs that were dropped (a WriteHooks
        step, like the host arena's)."""
        drops = self._index.counter(txn, "slab_drops", 0)
        if drops == self._seen_drops:
            return
        self._seen_drops = drops
        db = self._index.dbs["gpu_slabs"]
        for slab in [s for s in self._views if txn.get(SLAB_ID.pack(s), db=db) is None]:
            del self._views[slab]

    def aborted(self) -> None:
        """Nothing to undo (a WriteHooks step)."""


class GpuBlockCache:
    """The GPU tier's block copies, in ``GpuSlabs``. Methods that take ``txn`` run
    inside the caller's write transaction; ``lease_all`` and ``fill`` open their own."""

    DB_NAMES = ("gpu_blocks", "gpu_slab_keys", "gpu_lru_pos", "gpu_lru_queue")

    def __init__(self, index: KVIndex, leases: ReadLeases, slabs: GpuSlabs,
                 host: HostRecord) -> None:
        self._index = index
        self._leases = leases
        self.slabs = slabs
        self._host = host
        self._order = LRUEviction()
        self._reclaimed_in = -1  # the write epoch of the last reclaim scan

    def bind(self) -> None:
        """Once the index's databases are open (again after a fork)."""
        dbs = self._index.dbs
        self._order.bind({"lru_pos": dbs["gpu_lru_pos"], "lru_queue": dbs["gpu_lru_queue"]},
                         self._index.counter)

    @property
    def device(self) -> int | None:
        return self.slabs.device

    @property
    def capacity(self) -> int:
        return self.slabs.capacity

    @property
    def enabled(self) -> bool:
        return self.slabs.device is not None

    def need(self) -> None:
        if not self.enabled:
            raise ValueError("this store was opened without a GPU tier (gpu_device)")

    # -- slabs and the copies in them -------------------------------------------------
    def _slab_live(self, txn: lmdb.Transaction, slab: int, alive: Alive
                   ) -> tuple[int, int, int, bytes] | None:
        """The slab's record if its owner lives; else forget the slab (its memory died
        with the owner) and return None."""
        info = self.slabs.info(txn, slab)
        if info is None:
            return None
        if not self._index.live(info[3], alive):
            self._drop_slab(txn, slab, info)
            return None
        return info

    def _drop_slab(self, txn: lmdb.Transaction, slab: int,
                   info: tuple[int, int, int, bytes]) -> None:
        """Forget a slab and every block copy in it (its owner exited, or it is empty
        and its memory is wanted for another size class)."""
        index, dbs = self._index, self._index.dbs
        prefix = SLAB_ID.pack(slab)
        kdb = dbs["gpu_slab_keys"]
        cur = txn.cursor(db=kdb)
        gone: list[bytes] = []
        if cur.set_range(prefix):
            for k in cur.iternext(keys=True, values=False):
                k = bytes(k)
                if not k.startswith(prefix):
                    break
                gone.append(k)
        for k in gone:
            txn.delete(k, db=kdb)
            key = k[len(prefix):]
            rec = txn.pop(key, db=dbs["gpu_blocks"])
            if rec is not None:
                self._order.on_remove(txn, key)
                index.counter(txn, "gpu_blocks", -1)
                index.counter(txn, "gpu_bytes", -GREC.unpack(rec)[2])
        self.slabs.drop(txn, slab, info)

    def _reclaim_dead_writers(self, txn: lmdb.Transaction, alive: Alive) -> int:
        freed = 0
        wdb = self._index.dbs["gpu_writing"]
        for loc, holder in list(txn.cursor(db=wdb).iternext()):
            if self._index.live(bytes(holder)):
                continue
            txn.delete(loc, db=wdb)
            slab, chunk = LOC.unpack(loc)
            self._leases.free(txn, slab, chunk, alive)
            freed += 1
        return freed

    def _allocate(self, txn: lmdb.Transaction, nbytes: int, alive: Alive
                  ) -> tuple[int, int, int] | None:
        """Reserve a chunk (slab, chunk, chunk size) for a copy of ``nbytes``, evicting
        GPU copies as needed; None when the tier has no room."""
        csize = size_class(nbytes)
        if csize > self.slabs.capacity:
            return None
        prefix = struct.pack(">Q", csize)
        fdb = self._index.dbs["gpu_free"]
        reclaimed = False
        while True:
            cur = txn.cursor(db=fdb)
            if cur.set_range(prefix) and bytes(cur.key())[:8] == prefix:
                fkey = bytes(cur.key())
                info = self._slab_live(txn, FREE.unpack(fkey)[1], alive)
                if info is None:
                    continue  # its owner died: dropped with its free list
                return (*self.slabs.take(txn, fkey, info), csize)
            if self.slabs.new(txn, csize):
                continue
            empty = self.slabs.empty(txn, csize)
            if empty is not None:
                self._drop_slab(txn, *empty)
                continue
            if not reclaimed and self._reclaimed_in != self._index.write_epoch:
                reclaimed = True  # once per write transaction, as the host arena does
                self._reclaimed_in = self._index.write_epoch
                if self._leases.reclaim_zombies(txn, alive) + \
                        self._reclaim_dead_writers(txn, alive):
                    continue
            victim = self._order.victim(txn, lambda k: self._evictable(txn, k, alive))
            if victim is None:
                return None
            self.forget(txn, victim, alive)
            self._index.counter(txn, "gpu_evictions", 1)

    def _evictable(self, txn: lmdb.Transaction, key: bytes, alive: Alive) -> bool:
        rec = txn.get(key, db=self._index.dbs["gpu_blocks"])
        if rec is None:
            return False
        slab, chunk, _ = GREC.unpack(rec)
        return not self._leases.leased(txn, LOC.pack(slab, chunk), alive)

    def forget(self, txn: lmdb.Transaction, key: bytes, alive: Alive) -> bool:
        """Drop a block's GPU copy, if it has one (its chunk is freed once unread)."""
        index = self._index
        rec = txn.pop(key, db=index.dbs["gpu_blocks"])
        if rec is None:
            return False
        slab, chunk, nbytes = GREC.unpack(rec)
        txn.delete(SLAB_ID.pack(slab) + key, db=index.dbs["gpu_slab_keys"])
        self._order.on_remove(txn, key)
        index.counter(txn, "gpu_blocks", -1)
        index.counter(txn, "gpu_bytes", -nbytes)
        self._leases.free(txn, slab, chunk, alive)
        return True

    def _publish(self, txn: lmdb.Transaction, key: bytes, slab: int, chunk: int,
                 nbytes: int, alive: Alive) -> bool:
        """End a reservation: index the copy, unless the block went meanwhile or another
        process published a copy first (then the chunk goes back)."""
        index, dbs = self._index, self._index.dbs
        txn.delete(LOC.pack(slab, chunk), db=dbs["gpu_writing"])
        if self.slabs.info(txn, slab) is None:
            return False  # dropped under us (its owner died)
        rec = self._host(key)
        if rec is None or rec[0] != nbytes or txn.get(key, db=dbs["gpu_blocks"]) is not None:
            self._leases.free(txn, slab, chunk, alive)
            return False
        txn.put(key, GREC.pack(slab, chunk, nbytes), db=dbs["gpu_blocks"])
        txn.put(SLAB_ID.pack(slab) + key, b"", db=dbs["gpu_slab_keys"])
        self._order.on_insert(txn, key)
        index.counter(txn, "gpu_blocks", 1)
        index.counter(txn, "gpu_bytes", nbytes)
        return True

    def _lease(self, txn: lmdb.Transaction, key: bytes, alive: Alive) -> GpuBlockView | None:
        """A view of the block's GPU copy, leased; None when it has none (or its slab
        is gone)."""
        dbs = self._index.dbs
        raw = txn.get(key, db=dbs["gpu_blocks"])
        if raw is None:
            return None
        slab, chunk, nbytes = GREC.unpack(raw)
        info = self._slab_live(txn, slab, alive)
        if info is None:
            return None
        view = self.slabs.view(slab)
        if view is None:  # its owner unlinked it or exited between two checks
            self._drop_slab(txn, slab, info)
            return None
        brec = self._host(key)
        meta = brec[1] if brec is not None else b""
        self._leases.lease(txn, (slab, chunk))
        self._order.on_access(txn, key)
        bv = GpuBlockView(view.ptr + chunk * info[0], nbytes, view.device, meta, view)
        weakref.finalize(bv, self._leases.release, (slab, chunk))
        return bv

    def lease_all(self, keys: list[bytes], *, hits: bool = True) -> list[GpuBlockView | None]:
        """Lease the GPU copies of ``keys`` (None where none); ``hits``: count them as
        reads served by the tier (not so for copies this call just made)."""
        alive: Alive = {}
        out: list[GpuBlockView | None] = []
        with self._index.write() as txn:
            for key in keys:
                out.append(self._lease(txn, key, alive))
            if hits:
                self._index.counter(txn, "gpu_hits", sum(v is not None for v in out))
        return out

    def fill(self, keys: list[tuple[bytes, int]], copy: CopyIn) -> list[bool]:
        """Reserve a GPU chunk for each ``(key, nbytes)``, run ``copy(i, dst_ptr,
        device)`` for each reserved one outside the index lock, then publish. True
        where the block now has a GPU copy made by this call."""
        alive: Alive = {}
        index = self._index
        reserved: list[tuple[int, int, int, int]] = []  # index, slab, chunk, chunk size
        with index.write() as txn:
            for i, (key, n) in enumerate(keys):
                if txn.get(key, db=index.dbs["gpu_blocks"]) is not None:
                    continue
                got = self._allocate(txn, n, alive)
                if got is None:
                    break  # no room: the rest stay host-only
                reserved.append((i, *got))
        done: list[int] = []
        try:
            views = {slab: self.slabs.view(slab) for _, slab, _, _ in reserved}
            for i, slab, chunk, csize in reserved:
                view = views[slab]
                if view is None:
                    continue
                copy(i, view.ptr + chunk * csize, view.device)
                done.append(i)
            for dev in {v.device for v in views.values() if v is not None}:
                synchronize(dev)  # another process must find every byte there
        finally:
            ok = set(done)
            out = [False] * len(keys)
            with index.write() as txn:
                for i, slab, chunk, _ in reserved:
                    if i in ok:
                        key, n = keys[i]
                        out[i] = self._publish(txn, key, slab, chunk, n, alive)
                    else:
                        txn.delete(LOC.pack(slab, chunk), db=index.dbs["gpu_writing"])
                        self._leases.free(txn, slab, chunk, alive)
        return out

    def locate(self, key: bytes) -> tuple[int, int, int] | None:
        """Where a block's GPU copy is: (slab, offset, nbytes), for tests and tools."""
        with self._index.env.begin() as txn:
            raw = txn.get(key, db=self._index.dbs["gpu_blocks"])
            if raw is None:
                return None
            slab, chunk, nbytes = GREC.unpack(raw)
            info = self.slabs.info(txn, slab)
            return None if info is None else (slab, chunk * info[0], nbytes)
