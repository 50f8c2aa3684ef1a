"""The block records of the KV block store, and how blocks move between its tiers.

Each key has one record in the ``blocks`` database (layout ``REC``: state, slab, chunk,
nbytes, checksum, pins, then the block's metadata). Its state says where the bytes
are: WRITING (a chunk reserved by a put in flight, whose writer is named in
``writing``), HOST (a chunk of the host arena) or DISK (a spill file). Every method
here that takes ``txn`` runs inside the caller's write transaction; ``alive`` caches,
for the length of one transaction, which lease holders are alive.

A block leaving the host arena is evicted (in the eviction's order, never a pinned or
leased one) to disk when the store spills, else dropped; a read promotes a spilled
block back. Any block that leaves the store also loses its GPU copy.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import lmdb
import numpy as np

from ._checksum import checksum
from ._kv_arena import HostArena
from ._kv_eviction import Eviction
from ._kv_gpu import GpuBlockCache
from ._kv_index import KVIndex, ReadLeases
from ._kv_spill import DiskSpill
from ._kv_types import DISK, HOST, LOC, REC, WRITING, Alive, KVStoreFull, Leased, size_class

__all__: list[str] = []  # a part of BlockStore, nothing public

#: (index in the batch, key, slab, chunk) of a chunk reserved by a put
Reserved = tuple[int, bytes, int, int]


class BlockTable:
    """The records of one store's blocks over its host arena, disk spill and GPU cache."""

    DB_NAMES = ("blocks", "writing")

    def __init__(self, index: KVIndex, leases: ReadLeases, arena: HostArena,
                 spill: DiskSpill, gpu: GpuBlockCache, eviction: Eviction) -> None:
        self._index = index
        self._leases = leases
        self._arena = arena
        self._spill = spill
        self._gpu = gpu
        self.eviction = eviction
        self._reclaimed_in = -1  # the write epoch of the last reclaim scan

    # -- reads of the index (no write lock) -------------------------------------------
    def match(self, keys: Sequence[bytes]) -> int:
        n = 0
        with self._index.env.begin(db=self._index.dbs["blocks"], buffers=True) as txn:
            get = txn.get
            for k in keys:
                rec = get(k)
                if rec is None or rec[0] == WRITING:
                    break
                n += 1
        return n

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        with self._index.env.begin(db=self._index.dbs["blocks"], buffers=True) as txn:
            return [(r := txn.get(k)) is not None and r[0] != WRITING for k in keys]

    def readable(self, txn: lmdb.Transaction) -> Iterator[bytes]:
        """The readable keys, in ``txn`` (a read transaction on ``blocks``)."""
        for key, v in txn.cursor():
            if v[0] != WRITING:
                yield bytes(key)

    def locate(self, key: bytes) -> tuple[str, Path, int, int] | None:
        with self._index.env.begin() as txn:
            rec = txn.get(key, db=self._index.dbs["blocks"])
            if rec is None or rec[0] == WRITING:
                return None
            state, slab, chunk, nbytes, _, _ = REC.unpack_from(rec)
            if state == DISK:
                return "disk", self._spill.path(key, rec), 0, nbytes
            return ("host", self._arena.slab_path(slab),
                    chunk * self._arena.slab_info(txn, slab)[0], nbytes)

    # -- put: reserve, copy (the caller's, outside the lock), publish ---------------------
    def reserve(self, txn: lmdb.Transaction, keys: list[bytes], sizes: list[int],
                metas: list[bytes], alive: Alive) -> list[Reserved]:
        """Reserve a chunk for each key that is neither present nor being written by a
        live writer (first writer wins), under a WRITING record naming this process."""
        dbs, holder = self._index.dbs, self._index.holder
        reserved: list[Reserved] = []
        for i, key in enumerate(keys):
            rec = txn.get(key, db=dbs["blocks"])
            if rec is not None:
                if rec[0] != WRITING:
                    continue
                other = txn.get(key, db=dbs["writing"])
                if other is None or self._index.live(bytes(other)):
                    continue
                self._drop_writing(txn, key, alive)  # its writer died
            slab, chunk = self._allocate(txn, sizes[i], alive)
            txn.put(key, REC.pack(WRITING, slab, chunk, sizes[i], bytes(8), 0) + metas[i],
                    db=dbs["blocks"])
            txn.put(key, holder, db=dbs["writing"])
            reserved.append((i, key, slab, chunk))
        return reserved

    def destinations(self, reserved: list[Reserved], sizes: list[int]) -> list[np.ndarray]:
        """The reserved chunks as writable arrays (one read transaction)."""
        with self._index.env.begin() as rtxn:
            # the batch's chunks sit in a few slabs: look each slab up once
            info = {slab: self._arena.slab_info(rtxn, slab) for _, _, slab, _ in reserved}
            for slab, (csize, nchunks, _) in info.items():
                self._arena.restore(slab, csize * nchunks)  # a write past a cut: SIGBUS
            return [self._arena.chunk(rtxn, slab, chunk, sizes[i], info[slab])
                    for i, _, slab, chunk in reserved]

    def publish(self, txn: lmdb.Transaction, reserved: list[Reserved], sizes: list[int],
                metas: list[bytes], sums: list[bytes], alive: Alive) -> None:
        """Make the reserved blocks readable; those past ``len(sums)`` (their copy
        failed) give their chunk back."""
        index, dbs = self._index, self._index.dbs
        for j, (i, key, slab, chunk) in enumerate(reserved):
            txn.delete(key, db=dbs["writing"])
            if j >= len(sums):
                self._drop_writing(txn, key, alive)
                continue
            txn.put(key, REC.pack(HOST, slab, chunk, sizes[i], sums[j], 0) + metas[i],
                    db=dbs["blocks"])
            self.eviction.on_insert(txn, key)
            index.counter(txn, "host_blocks", 1)
            index.counter(txn, "host_bytes", sizes[i])

    def _drop_writing(self, txn: lmdb.Transaction, key: bytes, alive: Alive) -> None:
        rec = txn.pop(key, db=self._index.dbs["blocks"])
        txn.delete(key, db=self._index.dbs["writing"])
        if rec is not None:
            _, slab, chunk, _, _, _ = REC.unpack_from(rec)
            self._leases.free(txn, slab, chunk, alive)

    def _reclaim_dead_writers(self, txn: lmdb.Transaction, alive: Alive) -> int:
        freed = 0
        for key, holder in list(txn.cursor(db=self._index.dbs["writing"]).iternext()):
            if self._index.live(bytes(holder)):
                continue
            self._drop_writing(txn, bytes(key), alive)
            freed += 1
        return freed

    # -- room in the arena -------------------------------------------------------------
    def _allocate(self, txn: lmdb.Transaction, nbytes: int, alive: Alive) -> tuple[int, int]:
        arena = self._arena
        csize = size_class(nbytes)
        if csize > arena.capacity:
            raise KVStoreFull(f"a block of {nbytes} bytes is larger than the arena "
                              f"({arena.capacity} bytes)", needed=nbytes,
                              capacity=arena.capacity)
        reclaimed = False
        while True:
            got = arena.take_free(txn, csize)
            if got is not None:
                return got
            if arena.new_slab(txn, csize):
                continue
            if arena.drop_empty_slab(txn, csize):
                continue
            if not reclaimed and self._reclaimed_in != self._index.write_epoch:
                # dead readers' leases and dead writers' chunks, looked for once per
                # write transaction: a batch that fills a full arena evicts for every
                # block, and a scan per block was quadratic in the batch
                reclaimed = True
                self._reclaimed_in = self._index.write_epoch
                if self._leases.reclaim_zombies(txn, alive) + \
                        self._reclaim_dead_writers(txn, alive):
                    continue
            victim = self.eviction.victim(txn, lambda k: self._evictable(txn, k, alive))
            if victim is None:
                raise KVStoreFull(
                    f"the KV arena under {arena.root.parent} is full ({arena.capacity} "
                    f"bytes) and every block in it is pinned or being read", needed=nbytes,
                    capacity=arena.capacity)
            self._evict(txn, victim, alive)

    def _evictable(self, txn: lmdb.Transaction, key: bytes, alive: Alive) -> bool:
        rec = txn.get(key, db=self._index.dbs["blocks"])
        if rec is None:
            return False
        state, slab, chunk, _, _, pins = REC.unpack_from(rec)
        return state == HOST and pins == 0 and \
            not self._leases.leased(txn, LOC.pack(slab, chunk), alive)

    def _evict(self, txn: lmdb.Transaction, key: bytes, alive: Alive) -> None:
        index = self._index
        rec = txn.get(key, db=index.dbs["blocks"])
        assert rec is not None, "an eviction candidate has a record"
        _, slab, chunk, nbytes, csum, pins = REC.unpack_from(rec)
        meta = bytes(rec[REC.size:])
        self.eviction.on_remove(txn, key)
        index.counter(txn, "evictions", 1)
        index.counter(txn, "host_blocks", -1)
        index.counter(txn, "host_bytes", -nbytes)
        if self._spill.takes(nbytes):  # a GPU copy stays: the disk has the block
            self._spill.spill(txn, key, self._arena.chunk(txn, slab, chunk, nbytes), nbytes,
                              csum, pins, meta, self._drop_disk)
        else:
            txn.delete(key, db=index.dbs["blocks"])
            self._gpu.forget(txn, key, alive)
        self._leases.free(txn, slab, chunk, alive)

    # -- reads ---------------------------------------------------------------------------
    def acquire(self, keys: list[bytes]) -> tuple[list[Leased | None], list[bytes]]:
        """Lease each readable key's chunk (promoting disk blocks); one write
        transaction. Also returns the disk blocks that failed their checksum on the way
        up (dropped)."""
        index, dbs = self._index, self._index.dbs
        bad: list[bytes] = []
        out: list[Leased | None] = []
        alive: Alive = {}
        try:
            with index.write() as txn:
                hits = 0
                # chunk sizes of the slabs seen: a leased chunk keeps its slab alive
                csizes: dict[int, int] = {}
                for key in keys:
                    rec = txn.get(key, db=dbs["blocks"])
                    if rec is not None and rec[0] == DISK:
                        rec, corrupt = self._promote(txn, key, bytes(rec), alive)
                        if corrupt:
                            bad.append(key)
                    if rec is None or rec[0] != HOST:
                        out.append(None)
                        continue
                    _, slab, chunk, nbytes, csum, _ = REC.unpack_from(rec)
                    csize = csizes.get(slab)
                    if csize is None:
                        csize = csizes[slab] = self._arena.slab_info(txn, slab)[0]
                    self._leases.lease(txn, (slab, chunk))
                    self.eviction.on_access(txn, key)
                    out.append((slab, chunk, chunk * csize, nbytes, bytes(csum),
                                bytes(rec[REC.size:])))
                    hits += 1
                index.counter(txn, "hits", hits)
                index.counter(txn, "misses", len(keys) - hits)
        except BaseException:
            self._leases.forget(f[:2] for f in out if f is not None)
            raise
        return out, bad

    def _promote(self, txn: lmdb.Transaction, key: bytes, rec: bytes, alive: Alive
                 ) -> tuple[bytes | None, bool]:
        """Bring a spilled block back into the arena: its new record (None when there
        is no room: a miss, it stays on disk), and whether it failed its checksum (then
        it is dropped)."""
        _, _, _, nbytes, csum, pins = REC.unpack_from(rec)
        meta = bytes(rec[REC.size:])
        try:
            slab, chunk = self._allocate(txn, nbytes, alive)
        except KVStoreFull:
            return None, False
        dst = self._arena.chunk(txn, slab, chunk, nbytes)
        if not self._spill.read(key, rec, dst) or bytes.fromhex(checksum(dst)) != bytes(csum):
            self._leases.free(txn, slab, chunk, alive)
            self._drop_disk(txn, key, rec)
            self._index.counter(txn, "corrupt", 1)
            return None, True
        self._spill.unlist(txn, key, rec)
        new = REC.pack(HOST, slab, chunk, nbytes, csum, pins) + meta
        txn.put(key, new, db=self._index.dbs["blocks"])
        self.eviction.on_insert(txn, key)
        self._index.counter(txn, "host_blocks", 1)
        self._index.counter(txn, "host_bytes", nbytes)
        return new, False

    def drop_corrupt(self, bad: list[tuple[bytes, tuple[int, int]]]) -> None:
        """Drop the blocks (key, chunk) that failed their checksum, where the key still
        names that chunk."""
        alive: Alive = {}
        with self._index.write() as txn:
            for key, loc in bad:
                rec = txn.get(key, db=self._index.dbs["blocks"])
                if rec is None or rec[0] != HOST or REC.unpack_from(rec)[1:3] != loc:
                    continue
                self._remove_host(txn, key, rec, alive)
                self._index.counter(txn, "corrupt", 1)

    # -- leaving the store -----------------------------------------------------------------
    def _remove_host(self, txn: lmdb.Transaction, key: bytes, rec: bytes, alive: Alive
                     ) -> None:
        index = self._index
        _, slab, chunk, nbytes, _, pins = REC.unpack_from(rec)
        if pins:
            index.counter(txn, "pinned", -1)
        txn.delete(key, db=index.dbs["blocks"])
        self._gpu.forget(txn, key, alive)
        self.eviction.on_remove(txn, key)
        index.counter(txn, "host_blocks", -1)
        index.counter(txn, "host_bytes", -nbytes)
        self._leases.free(txn, slab, chunk, alive)

    def _drop_disk(self, txn: lmdb.Transaction, key: bytes, rec: bytes) -> None:
        nbytes, _, pins = REC.unpack_from(rec)[3:]
        if pins:
            self._index.counter(txn, "pinned", -1)
        txn.delete(key, db=self._index.dbs["blocks"])
        self._gpu.forget(txn, key, {})
        self._spill.unlist(txn, key, rec)

    def adjust_pins(self, keys: list[bytes], delta: int) -> int:
        """Add ``delta`` to each present key's pins (a pin brings a spilled block back
        into memory where there is room); how many were changed."""
        n = 0
        alive: Alive = {}
        dbs = self._index.dbs
        with self._index.write() as txn:
            for key in keys:
                rec = txn.get(key, db=dbs["blocks"])
                if rec is not None and rec[0] == DISK and delta > 0:
                    self._promote(txn, key, bytes(rec), alive)  # pinned: in memory
                    rec = txn.get(key, db=dbs["blocks"])
                if rec is None or rec[0] == WRITING:
                    continue
                state, slab, chunk, nbytes, csum, pins = REC.unpack_from(rec)
                if pins + delta < 0:
                    continue
                txn.put(key, REC.pack(state, slab, chunk, nbytes, csum, pins + delta)
                        + bytes(rec[REC.size:]), db=dbs["blocks"])
                self._index.counter(txn, "pinned", 1 if pins == 0 else -1
                                    if pins + delta == 0 else 0)
                n += 1
        return n

    def delete(self, keys: list[bytes]) -> int:
        n = 0
        alive: Alive = {}
        with self._index.write() as txn:
            for key in keys:
                rec = txn.get(key, db=self._index.dbs["blocks"])
                if rec is None or rec[0] == WRITING:
                    continue
                if rec[0] == HOST:
                    self._remove_host(txn, key, rec, alive)
                else:
                    self._drop_disk(txn, key, rec)
                n += 1
        return n

    def reclaim_orphans(self, txn: lmdb.Transaction) -> None:
        """Slab and spill files no index entry names (their creator died inside its
        transaction). Runs when a process opens the store, under the write lock."""
        self._arena.reclaim_orphans(txn)
        self._spill.reclaim_orphans(txn)
