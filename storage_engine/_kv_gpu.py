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
of one size class. The index lives in the store's LMDB environment beside the host's::

    gpu_blocks      key -> slab, chunk, nbytes
    gpu_slabs       slab -> chunk size, chunks, chunks in use, owner (holder id)
    gpu_free        chunk size, slab, chunk (a cursor on the size finds a free one)
    gpu_slab_keys   slab + key: what to forget when a slab goes
    gpu_writing     slab, chunk -> holder: chunks reserved by a copy in flight
    gpu_lru_*       the tier's own LRU order

GPU slab ids have the top bit set, so read leases and deferred frees share the host's
tables and rules: a chunk that a process reads through a view is not reused until that
view is gone.

Blocks enter the tier two ways:

* ``get_device``: a block read for the GPU is copied up (host to device, its checksum
  verified on the host first) and kept, so the next reader on the host maps it with no
  copy at all;
* ``admit_device``: blocks an engine stored from device memory are copied device to
  device beside the host copy ``put`` made.

``get_into_device`` copies into an engine's own device buffers (its paged KV) from the
GPU copy when there is one, else from the host arena, and admits nothing. Eviction drops
a GPU copy (least recently used first, skipping chunks being read); pins are the
host's business, since the host copy is the one that must stay. When the tier has no
room (every chunk being read) a block stays host-only and ``get_device`` returns None
for it: the caller copies from the host.
"""

from __future__ import annotations

import struct
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from . import _gpu
from ._checksum import checksum
from ._errors import SegmentMissing, TierFull
from ._gpu import GpuError, GpuTier, GpuView
from ._kv_policy import LRUPolicy
from ._kv_types import _FREE, _ID, _LOC, _REC, _WRITING, _each, size_class
from ._procs import holder_alive

__all__ = ["GpuBlockView", "GPU_DB_NAMES"]

GPU_BIT = 0x8000_0000  # GPU slab ids: leases and zombies share the host's tables
_GREC = struct.Struct("<IIQ")  # slab, chunk, nbytes
_GSLAB = struct.Struct("<QII")  # chunk size, chunks, chunks in use; the owner follows
GPU_DB_NAMES = ("gpu_blocks", "gpu_slabs", "gpu_free", "gpu_slab_keys", "gpu_writing",
                "gpu_lru_pos", "gpu_lru_queue")


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
        with _gpu._on_device(self.device):
            _gpu._memcpy(out.ctypes.data, self.ptr, self.nbytes, "cudaMemcpyDeviceToHost")
        return out


def _sync(device: int) -> None:
    with _gpu._on_device(device):
        _gpu._check(_gpu._runtime().cudaDeviceSynchronize(), "cudaDeviceSynchronize")


class _GpuArena:
    """The GPU half of ``BlockStore`` (a mixin): every ``_gpu_*`` method that takes
    ``txn`` runs inside the caller's LMDB write transaction."""

    root: Path
    slab_bytes: int
    _db: dict[str, Any]
    _blocks: Any
    _holder: bytes
    _released: Any
    _created: list[Path]
    _doomed: list[Path]
    _lock: Any

    # provided by BlockStore / _Arena
    _write: Any
    _counter: Any
    _lease: Any
    _leased: Any
    _acquire: Any
    _reclaim_zombies: Any
    _leased_bytes: Any
    _end_reads: Any
    _check_pid: Any
    _check_keys: Any

    def _gpu_setup(self, device: int | None, capacity: int | None) -> None:
        """Before ``_open``: ``device`` is where this process puts GPU copies (None: the
        tier is off in this process, though it still forgets copies of blocks it
        deletes); ``capacity`` the tier's bytes, fixed by the first process to give it."""
        if capacity is not None and capacity <= 0:
            raise ValueError("gpu_capacity must be positive")
        if device is not None and capacity is None:
            raise ValueError("a GPU tier needs gpu_capacity")
        self.gpu_device = device
        self.gpu_capacity = capacity or 0
        self._gtier = GpuTier(self.root / "gpu", device=device or 0)
        self._gpolicy = LRUPolicy()
        self._gviews: dict[int, GpuView] = {}

    def _gpu_bind(self, txn: Any) -> None:
        """In ``_open``, once the databases are open: adopt the tier's capacity."""
        self._gviews = {}
        self._gpolicy.bind({"lru_pos": self._db["gpu_lru_pos"],
                            "lru_queue": self._db["gpu_lru_queue"]}, self._counter)
        db = self._db["settings"]
        raw = txn.get(b"gpu_capacity", db=db)
        if raw is None:
            if self.gpu_device is not None:
                txn.put(b"gpu_capacity", str(self.gpu_capacity).encode(), db=db)
        else:
            self.gpu_capacity = int(bytes(raw))

    @property
    def gpu_enabled(self) -> bool:
        return self.gpu_device is not None

    def _need_gpu(self) -> None:
        if not self.gpu_enabled:
            raise ValueError("this store was opened without a GPU tier (gpu_device)")

    # -- slabs -----------------------------------------------------------------------
    def _gslab(self, txn: Any, slab: int) -> tuple[int, int, int, bytes] | None:
        raw = txn.get(_ID.pack(slab), db=self._db["gpu_slabs"])
        if raw is None:
            return None
        csize, nchunks, used = _GSLAB.unpack_from(raw)
        return csize, nchunks, used, bytes(raw[_GSLAB.size:])

    def _gslab_live(self, txn: Any, slab: int, alive: dict[bytes, bool]
                    ) -> tuple[int, int, int, bytes] | None:
        """The slab's record if its owner lives; else forget the slab (its memory died
        with the owner) and return None."""
        info = self._gslab(txn, slab)
        if info is None:
            return None
        owner = info[3]
        ok = alive.get(owner)
        if ok is None:
            ok = alive[owner] = owner == self._holder or \
                holder_alive(owner.decode()) is not False
        if not ok:
            self._gpu_drop_slab(txn, slab, info)
            return None
        return info

    def _gview(self, slab: int) -> GpuView | None:
        """This process's mapping of a slab (the owner's own, or an IPC import)."""
        view = self._gviews.get(slab)
        if view is None:
            try:
                view = self._gtier.open(f"{slab:08x}")
            except SegmentMissing:
                return None
            self._gviews[slab] = view
        return view

    def _gpu_new_slab(self, txn: Any, csize: int) -> bool:
        used = self._counter(txn, "gpu_arena_bytes", 0)
        nchunks = min(max(1, self.slab_bytes // csize), (self.gpu_capacity - used) // csize)
        if nchunks < 1:
            return False
        slab = GPU_BIT | self._counter(txn, "gpu_slab_id", 1)
        seg = f"{slab:08x}"
        # a mapping cached under this id is of a slab whose creating transaction aborted
        # (the id came back with it): let go of it, so the sweep frees its memory, as it
        # frees what other processes dropped, before allocating more
        self._gviews.pop(slab, None)
        self._gtier.sweep()
        try:
            writer = self._gtier.create(seg, csize * nchunks)
        except TierFull:  # the device itself is out of memory
            return False
        self._created.append(self._gtier.path(seg))  # an abort unlinks it
        writer.release()
        self._gviews[slab] = self._gtier.open(seg)  # the owner's own view: no import
        txn.put(_ID.pack(slab), _GSLAB.pack(csize, nchunks, 0) + self._holder,
                db=self._db["gpu_slabs"])
        fdb = self._db["gpu_free"]
        for c in range(nchunks):
            txn.put(_FREE.pack(csize, slab, c), b"", db=fdb)
        self._counter(txn, "gpu_arena_bytes", csize * nchunks)
        return True

    def _gpu_drop_slab(self, txn: Any, slab: int, info: tuple[int, int, int, bytes]) -> None:
        """Forget a slab and every block copy in it (its owner exited, or it is empty
        and its memory is wanted for another size class)."""
        csize, nchunks, _, _ = info
        prefix = _ID.pack(slab)
        kdb = self._db["gpu_slab_keys"]
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
            rec = txn.pop(key, db=self._db["gpu_blocks"])
            if rec is not None:
                self._gpolicy.on_remove(txn, key)
                self._counter(txn, "gpu_blocks", -1)
                self._counter(txn, "gpu_bytes", -_GREC.unpack(rec)[2])
        fdb = self._db["gpu_free"]
        for c in range(nchunks):
            txn.delete(_FREE.pack(csize, slab, c), db=fdb)
            txn.delete(_LOC.pack(slab, c), db=self._db["gpu_writing"])
        txn.delete(prefix, db=self._db["gpu_slabs"])
        self._counter(txn, "gpu_arena_bytes", -csize * nchunks)
        self._counter(txn, "slab_drops", 1)  # other processes let go of their mappings
        self._doomed.append(self._gtier.path(f"{slab:08x}"))
        self._gviews.pop(slab, None)

    def _gpu_drop_empty_slab(self, txn: Any, keep: int) -> bool:
        for raw_id, raw in txn.cursor(db=self._db["gpu_slabs"]):
            csize, nchunks, used = _GSLAB.unpack_from(raw)
            if used == 0 and csize != keep:
                self._gpu_drop_slab(txn, _ID.unpack(raw_id)[0],
                                    (csize, nchunks, used, bytes(raw[_GSLAB.size:])))
                return True
        return False

    def _gpu_prune(self, txn: Any) -> None:
        """Let go of this process's mappings of slabs that were dropped."""
        db = self._db["gpu_slabs"]
        for slab in [s for s in self._gviews if txn.get(_ID.pack(s), db=db) is None]:
            del self._gviews[slab]

    # -- chunks ----------------------------------------------------------------------
    def _gpu_release_chunk(self, txn: Any, slab: int, chunk: int) -> None:
        """Back on the free list (called by ``_free_chunk`` once nobody reads it)."""
        info = self._gslab(txn, slab)
        if info is None:
            return  # the slab went meanwhile
        csize, nchunks, used, owner = info
        txn.put(_ID.pack(slab), _GSLAB.pack(csize, nchunks, used - 1) + owner,
                db=self._db["gpu_slabs"])
        txn.put(_FREE.pack(csize, slab, chunk), b"", db=self._db["gpu_free"])

    def _gpu_reclaim_dead_writers(self, txn: Any, alive: dict[bytes, bool]) -> int:
        freed = 0
        wdb = self._db["gpu_writing"]
        for loc, holder in list(txn.cursor(db=wdb).iternext()):
            holder = bytes(holder)
            if holder == self._holder or holder_alive(holder.decode()) is not False:
                continue
            txn.delete(loc, db=wdb)
            self._free_chunk(txn, *_LOC.unpack(loc), alive)
            freed += 1
        return freed

    def _gpu_allocate(self, txn: Any, nbytes: int, alive: dict[bytes, bool]
                      ) -> tuple[int, int, int] | None:
        """Reserve a chunk (slab, chunk, chunk size) for a copy of ``nbytes``, evicting
        GPU copies as needed; None when the tier has no room."""
        csize = size_class(nbytes)
        if csize > self.gpu_capacity:
            return None
        prefix = struct.pack(">Q", csize)
        fdb = self._db["gpu_free"]
        reclaimed = False
        while True:
            cur = txn.cursor(db=fdb)
            if cur.set_range(prefix) and bytes(cur.key())[:8] == prefix:
                fkey = bytes(cur.key())
                _, slab, chunk = _FREE.unpack(fkey)
                info = self._gslab_live(txn, slab, alive)
                if info is None:
                    continue  # its owner died: dropped with its free list
                txn.delete(fkey, db=fdb)
                txn.put(_ID.pack(slab), _GSLAB.pack(csize, info[1], info[2] + 1) + info[3],
                        db=self._db["gpu_slabs"])
                txn.put(_LOC.pack(slab, chunk), self._holder, db=self._db["gpu_writing"])
                return slab, chunk, csize
            if self._gpu_new_slab(txn, csize):
                continue
            if self._gpu_drop_empty_slab(txn, csize):
                continue
            if not reclaimed:
                reclaimed = True
                if self._reclaim_zombies(txn, alive) + \
                        self._gpu_reclaim_dead_writers(txn, alive):
                    continue
            victim = self._gpolicy.victim(
                txn, lambda k: self._gpu_evictable(txn, k, alive))
            if victim is None:
                return None
            self._gpu_forget(txn, victim, alive)
            self._counter(txn, "gpu_evictions", 1)

    def _gpu_evictable(self, txn: Any, key: bytes, alive: dict[bytes, bool]) -> bool:
        rec = txn.get(key, db=self._db["gpu_blocks"])
        if rec is None:
            return False
        slab, chunk, _ = _GREC.unpack(rec)
        return not self._leased(txn, _LOC.pack(slab, chunk), alive)

    def _gpu_forget(self, txn: Any, key: bytes, alive: dict[bytes, bool]) -> bool:
        """Drop a block's GPU copy, if it has one (its chunk is freed once unread)."""
        rec = txn.pop(key, db=self._db["gpu_blocks"])
        if rec is None:
            return False
        slab, chunk, nbytes = _GREC.unpack(rec)
        txn.delete(_ID.pack(slab) + key, db=self._db["gpu_slab_keys"])
        self._gpolicy.on_remove(txn, key)
        self._counter(txn, "gpu_blocks", -1)
        self._counter(txn, "gpu_bytes", -nbytes)
        self._free_chunk(txn, slab, chunk, alive)
        return True

    def _gpu_publish(self, txn: Any, key: bytes, slab: int, chunk: int, nbytes: int,
                     alive: dict[bytes, bool]) -> bool:
        """End a reservation: index the copy, unless the block went meanwhile or another
        process published a copy first (then the chunk goes back)."""
        txn.delete(_LOC.pack(slab, chunk), db=self._db["gpu_writing"])
        if self._gslab(txn, slab) is None:
            return False  # dropped under us (its owner died)
        rec = txn.get(key, db=self._blocks)
        if rec is None or rec[0] == _WRITING or _REC.unpack_from(rec)[3] != nbytes \
                or txn.get(key, db=self._db["gpu_blocks"]) is not None:
            self._free_chunk(txn, slab, chunk, alive)
            return False
        txn.put(key, _GREC.pack(slab, chunk, nbytes), db=self._db["gpu_blocks"])
        txn.put(_ID.pack(slab) + key, b"", db=self._db["gpu_slab_keys"])
        self._gpolicy.on_insert(txn, key)
        self._counter(txn, "gpu_blocks", 1)
        self._counter(txn, "gpu_bytes", nbytes)
        return True

    def _gpu_lease(self, txn: Any, key: bytes, alive: dict[bytes, bool]
                   ) -> GpuBlockView | None:
        """A view of the block's GPU copy, leased; None when it has none (or its slab
        is gone)."""
        raw = txn.get(key, db=self._db["gpu_blocks"])
        if raw is None:
            return None
        slab, chunk, nbytes = _GREC.unpack(raw)
        info = self._gslab_live(txn, slab, alive)
        if info is None:
            return None
        view = self._gview(slab)
        if view is None:  # its owner unlinked it or exited between two checks
            self._gpu_drop_slab(txn, slab, info)
            return None
        brec = txn.get(key, db=self._blocks)
        meta = bytes(brec[_REC.size:]) if brec is not None else b""
        self._lease(txn, (slab, chunk))
        self._gpolicy.on_access(txn, key)
        bv = GpuBlockView(view.ptr + chunk * info[0], nbytes, view.device, meta, view)
        weakref.finalize(bv, self._released.append, (slab, chunk))
        return bv

    def _gpu_lease_all(self, keys: list[bytes], *, hits: bool = True
                       ) -> list[GpuBlockView | None]:
        """Lease the GPU copies of ``keys`` (None where none); ``hits``: count them as
        reads served by the tier (not so for copies this call just made)."""
        alive: dict[bytes, bool] = {}
        out: list[GpuBlockView | None] = []
        with self._write() as txn:
            for key in keys:
                out.append(self._gpu_lease(txn, key, alive))
            if hits:
                self._counter(txn, "gpu_hits", sum(v is not None for v in out))
        return out

    # -- copies in and out -------------------------------------------------------------
    def _gpu_fill(self, keys: list[bytes], copy: Any) -> list[bool]:
        """Reserve a GPU chunk for each ``(key, nbytes)``, run ``copy(i, dst_ptr,
        device)`` for each reserved one outside the index lock, then publish. True
        where the block now has a GPU copy made by this call."""
        alive: dict[bytes, bool] = {}
        sizes = [n for _, n in keys]
        reserved: list[tuple[int, int, int, int]] = []  # index, slab, chunk, chunk size
        with self._write() as txn:
            for i, (key, n) in enumerate(keys):
                if txn.get(key, db=self._db["gpu_blocks"]) is not None:
                    continue
                got = self._gpu_allocate(txn, n, alive)
                if got is None:
                    break  # no room: the rest stay host-only
                reserved.append((i, *got))
        done: list[int] = []
        try:
            views = {slab: self._gview(slab) for _, slab, _, _ in reserved}
            for i, slab, chunk, csize in reserved:
                view = views[slab]
                if view is None:
                    continue
                copy(i, view.ptr + chunk * csize, view.device)
                done.append(i)
            for dev in {v.device for v in views.values() if v is not None}:
                _sync(dev)  # another process must find every byte there
        finally:
            ok = set(done)
            out = [False] * len(keys)
            with self._write() as txn:
                for i, slab, chunk, _ in reserved:
                    if i in ok:
                        out[i] = self._gpu_publish(txn, keys[i][0], slab, chunk,
                                                   sizes[i], alive)
                    else:
                        txn.delete(_LOC.pack(slab, chunk), db=self._db["gpu_writing"])
                        self._free_chunk(txn, slab, chunk, alive)
        return out

    def get_device(self, keys: Sequence[bytes], *, verify: bool = True
                   ) -> list[GpuBlockView | None]:
        """Views of the blocks' GPU copies, copying a block up from the host first where
        it has none (verifying its checksum there). None where the block is absent, or
        where the tier has no room for it (then read it from the host). Raises KVCorrupt
        as ``get`` does."""
        keys = self._check_keys(keys)
        self._need_gpu()
        with self._lock:
            self._check_pid()
            out = self._gpu_lease_all(keys)
            miss = [i for i, v in enumerate(out) if v is None]
            if not miss:
                return out
            found = self._acquire([keys[i] for i in miss])
            bad: list[tuple[bytes, tuple[int, int]]] = []
            try:
                fmap = {i: f for i, f in zip(miss, found) if f is not None}
                srcs = {i: self._leased_bytes(f) for i, f in fmap.items()}
                up = list(srcs)
                if verify and up:
                    sums = _each(checksum, [(srcs[i],) for i in up],
                                 sum(s.size for s in srcs.values()))
                    for i, s in zip(up, sums):
                        if bytes.fromhex(s) != fmap[i][4]:
                            bad.append((keys[i], fmap[i][:2]))
                            del srcs[i]
                    up = list(srcs)

                def copy(j: int, dst: int, device: int) -> None:
                    src = srcs[up[j]]
                    with _gpu._on_device(device):
                        _gpu._memcpy(dst, src.ctypes.data, src.size,
                                     "cudaMemcpyHostToDevice")

                self._gpu_fill([(keys[i], srcs[i].size) for i in up], copy)
            finally:
                self._end_reads(found, bad, flush=False)  # the next lease flushes them
            again = self._gpu_lease_all([keys[i] for i in miss], hits=False)
            for i, v in zip(miss, again):
                out[i] = v
            return out

    def admit_device(self, keys: Sequence[bytes], srcs: Sequence[tuple[int, int, int]]
                     ) -> int:
        """Give blocks already stored a GPU copy, copied device to device from
        ``(ptr, nbytes, device)`` (the tensors they were put from). Blocks absent from
        the store, of another size, or copied already are skipped; so is the rest when
        the tier has no room. Returns how many got a copy."""
        keys = self._check_keys(keys)
        self._need_gpu()
        if len(srcs) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(srcs)} sources")
        with self._lock:
            self._check_pid()

            def copy(j: int, dst: int, device: int) -> None:
                ptr, n, _ = srcs[j]
                with _gpu._on_device(device):
                    _gpu._memcpy(dst, ptr, n, "cudaMemcpyDeviceToDevice")

            return sum(self._gpu_fill([(k, int(s[1])) for k, s in zip(keys, srcs)], copy))

    def get_into_device(self, keys: Sequence[bytes], dsts: Sequence[tuple[int, int]], *,
                        verify: bool = True) -> list[bytes | None]:
        """Copy each block into device memory at ``(ptr, nbytes)``: from its GPU copy
        (device to device) where it has one, else from the host (checksum verified
        first). Returns each block's metadata, None where absent. Admits nothing."""
        keys = self._check_keys(keys)
        self._need_gpu()
        if len(dsts) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(dsts)} output buffers")
        with self._lock:
            self._check_pid()
            views = self._gpu_lease_all(keys)
            metas: list[bytes | None] = [None] * len(keys)
            try:
                devices = set()
                for i, v in enumerate(views):
                    if v is None:
                        continue
                    if dsts[i][1] != v.nbytes:
                        raise ValueError(f"block {keys[i].hex()} holds {v.nbytes} bytes; "
                                         f"its output buffer {dsts[i][1]}")
                    with _gpu._on_device(v.device):
                        _gpu._memcpy(dsts[i][0], v.ptr, v.nbytes, "cudaMemcpyDeviceToDevice")
                    devices.add(v.device)
                    metas[i] = v.meta
                for dev in devices:
                    _sync(dev)  # the chunks may be reused once the views go
            finally:
                del views
            miss = [i for i, m in enumerate(metas) if m is None]
            if miss:
                got = self._host_to_device([keys[i] for i in miss],
                                           [dsts[i] for i in miss], verify)
                for i, m in zip(miss, got):
                    metas[i] = m
            return metas

    def _host_to_device(self, keys: list[bytes], dsts: list[tuple[int, int]], verify: bool
                        ) -> list[bytes | None]:
        found = self._acquire(keys)
        metas: list[bytes | None] = []
        bad: list[tuple[bytes, tuple[int, int]]] = []
        try:
            for key, f, (ptr, n) in zip(keys, found, dsts):
                if f is None:
                    metas.append(None)
                    continue
                slab, chunk, _, nbytes, csum, meta = f
                if n != nbytes:
                    raise ValueError(f"block {key.hex()} holds {nbytes} bytes; its output "
                                     f"buffer {n}")
                src = self._leased_bytes(f)
                if verify and bytes.fromhex(checksum(src)) != csum:
                    bad.append((key, (slab, chunk)))
                    metas.append(None)
                    continue
                with _gpu._on_device(self.gpu_device or 0):
                    _gpu._memcpy(ptr, src.ctypes.data, nbytes, "cudaMemcpyHostToDevice")
                metas.append(meta)
        finally:
            self._end_reads(found, bad)
        return metas

    def gpu_locate(self, key: bytes) -> tuple[int, int, int] | None:
        """Where a block's GPU copy is: (slab, offset, nbytes), for tests and tools."""
        self._check_pid()
        with self.env.begin() as txn:  # type: ignore[attr-defined]
            raw = txn.get(key, db=self._db["gpu_blocks"])
            if raw is None:
                return None
            slab, chunk, nbytes = _GREC.unpack(raw)
            info = self._gslab(txn, slab)
            return None if info is None else (slab, chunk * info[0], nbytes)

    def _gpu_close(self) -> None:
        self._gviews = {}
        if self.gpu_enabled and _gpu._rt is not None:
            try:
                self._gtier.sweep()
            except GpuError:
                pass
