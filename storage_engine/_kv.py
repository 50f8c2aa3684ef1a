"""The KV block store: an LMDB index over a slab arena in POSIX shared memory.

One store per directory under /dev/shm, shared by every process on the host that opens
it. Blocks are many and small, so each is a chunk of a *slab* (a file of fixed-size
chunks of one size class), not a file of its own, and the index is LMDB, not the catalog:
``match`` over 1,000 keys is one LMDB read transaction.

Layout under ``root``::

    index/        the LMDB environment (lock=True: every process of the host shares it)
    slabs/*.slab  the arena: pre-allocated with posix_fallocate, so a full tmpfs is an
                  error at slab creation, never a SIGBUS at first write

Why the protocol looks as it does:

- *put* is two short write transactions around the copy. The first reserves a chunk
  (evicting if needed) under a ``WRITING`` record that names the writer; the copy and
  its checksum run outside the LMDB write lock, so writers copy in parallel; the second
  publishes. First writer wins: a put of a key that is present or being written is a
  no-op, never an error. A writer that dies between the two leaves a ``WRITING`` record
  of a dead holder, which the next writer takes over.
- *get* hands out views on private (copy-on-write) mappings of the chunk, one mapping
  per view: a reader's stray write changes its own pages only and never reaches the
  store or another view. A private mapping still sees later writes to the file where
  the reader did not write, so a chunk must not be reused while someone holds a view:
  each view holds a *read lease* on its chunk, recorded in LMDB under the reader's
  holder id, and released when the view is garbage collected (at this process's next
  call into the store). Leases of dead processes count as released.
- Pins are counters in the index, not tied to a process: they last until unpinned.
- Evicted blocks spill to ``disk_root`` (one file per block) when it is given, and are
  promoted back into the arena when read.
- Every block carries an xxh3-64 checksum. ``get`` and ``get_into`` verify it by default;
  a block that fails is dropped from the store and ``KVCorrupt`` is raised naming it, so
  it is never served and a later ``match`` reports it absent.
"""

from __future__ import annotations

import mmap
import os
import threading
import weakref
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lmdb
import numpy as np

from ._checksum import checksum, copy, copy_and_checksum
from ._kv_arena import _Arena
from ._kv_gpu import GPU_DB_NAMES, GpuBlockView, _GpuArena
from ._kv_policy import EvictionPolicy, LRUPolicy, S3FIFOPolicy, make_policy
from ._kv_types import (
    _CORRUPT,
    _DISK,
    _HOST,
    _I64,
    _ID,
    _LOC,
    _REC,
    _WRITING,
    PAGE,
    BlockView,
    KVCorrupt,
    KVStats,
    KVStoreFull,
    _as_bytes,
    _bloom_positions,
    _each,
    bloom_may_hold,
    size_class,
)
from ._procs import current_holder, holder_alive

__all__ = [
    "BlockStore",
    "BlockView",
    "GpuBlockView",
    "KVStats",
    "KVStoreFull",
    "KVCorrupt",
    "EvictionPolicy",
    "LRUPolicy",
    "S3FIFOPolicy",
    "size_class",
    "bloom_may_hold",
]


class BlockStore(_GpuArena, _Arena):
    """A host's store of KV blocks; see the module docstring for the protocol.

    Open one per process (after a fork, the child reopens its own: LMDB environments do
    not survive a fork, and this object notices). Methods are thread-safe (one lock).
    ``put``, ``get``, ``pin``, ``unpin`` and ``delete`` take LMDB's write lock for a few
    microseconds per block (longer when they evict to disk); ``match`` never blocks.

    ``gpu_device`` and ``gpu_capacity`` give this process the store's GPU tier (copies
    of hot blocks in device memory, see ``_kv_gpu``): ``get_device``,
    ``get_into_device`` and ``admit_device``.
    """

    def __init__(self, root: Path, *, capacity_bytes: int, slab_bytes: int = 64 << 20,
                 policy: str | EvictionPolicy = "lru", disk_root: Path | None = None,
                 disk_capacity: int | None = None, map_size: int = 1 << 34,
                 gpu_device: int | None = None, gpu_capacity: int | None = None) -> None:
        if capacity_bytes <= 0:
            raise ValueError("capacity_bytes must be positive")
        if slab_bytes < PAGE:
            raise ValueError(f"slab_bytes must be at least {PAGE}")
        self.root = Path(root)
        self.capacity = int(capacity_bytes)
        self.slab_bytes = int(slab_bytes)
        self.disk_root = Path(disk_root) if disk_root is not None else None
        self.disk_capacity = disk_capacity
        self.policy = make_policy(policy)
        self._map_size = map_size
        self._lock = threading.RLock()
        self._released: deque[tuple[int, int]] = deque()
        self._leases: dict[tuple[int, int], int] = {}
        for d in (self.root, self.root / "slabs", self.root / "index", self.disk_root):
            if d is not None:
                d.mkdir(parents=True, exist_ok=True, mode=0o700)
                os.chmod(d, 0o700)
        self._pid = -1
        self._gpu_setup(gpu_device, gpu_capacity)
        self._open()

    # -- environment ---------------------------------------------------------------
    def _open(self) -> None:
        self._pid = os.getpid()
        self._holder = current_holder().encode()
        self._leases.clear()
        self._released.clear()
        self._rfds: dict[int, int] = {}  # slab -> read-only fd (private views map it)
        self._wmaps: dict[int, mmap.mmap] = {}  # slab -> shared mapping (put, get_into)
        self._seen_drops = -1
        self._created: list[Path] = []
        self._doomed: list[Path] = []
        self._wtxn: Any = None  # the transaction of ``_write`` while it runs
        self._pending: dict[str, int] = {}  # its counters, written at its commit
        self.env = lmdb.open(str(self.root / "index"), map_size=self._map_size, max_dbs=32,
                             lock=True, sync=False, metasync=False, readahead=False,
                             max_readers=4096, mode=0o600)
        with self.env.begin(write=True) as txn:
            self._adopt_settings(txn)
        names = ["blocks", "slabs", "free", "leases", "writing", "zombies", "counters",
                 "disk", "settings", *GPU_DB_NAMES, *self.policy.db_names]
        with self.env.begin(write=True) as txn:
            self._db = {n: self.env.open_db(n.encode(), txn=txn) for n in names}
        self._blocks = self._db["blocks"]
        self.policy.bind({n: self._db[n] for n in self.policy.db_names}, self._counter)
        with self.env.begin(write=True) as txn:
            self._gpu_bind(txn)
            self._reclaim_orphan_slabs(txn)

    def _adopt_settings(self, txn: Any) -> None:
        """The first process to create the store fixes its capacity, slab size and
        policy; later ones adopt them (two policies over one arena would each see half
        of it, and two capacities would let the larger one overfill it)."""
        db = self.env.open_db(b"settings", txn=txn)
        raw = txn.get(b"settings", db=db)
        if raw is None:
            txn.put(b"settings", f"{self.capacity} {self.slab_bytes} {self.policy.name}"
                    .encode(), db=db)
            return
        cap, slab, policy = bytes(raw).decode().split()
        self.capacity, self.slab_bytes = int(cap), int(slab)
        if policy != self.policy.name:
            self.policy = make_policy(policy)

    def _check_pid(self) -> None:
        if os.getpid() != self._pid:  # forked: the parent's environment is not ours
            self._open()

    def close(self) -> None:
        with self._lock:
            if os.getpid() == self._pid:
                self._flush_releases()
                self.env.close()
                for fd in self._rfds.values():
                    os.close(fd)
                for mm in self._wmaps.values():
                    try:
                        mm.close()
                    except BufferError:
                        pass
                self._gpu_close()
            self._rfds, self._wmaps = {}, {}

    def __enter__(self) -> BlockStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- small helpers -------------------------------------------------------------
    def _counter(self, txn: Any, name: str, delta: int) -> int:
        """Add ``delta`` to a shared counter and return its new value. Inside the write
        transaction of ``_write`` the value is kept in a dict and written once, at
        commit: a put of a batch touches the same few counters once per block, and an
        LMDB get and put per touch was a fifth of a small block's cost."""
        pend = self._pending if txn is self._wtxn else None
        if pend is not None and name in pend:
            value = pend[name] + delta
        else:
            raw = txn.get(name.encode(), db=self._db["counters"])
            value = (_I64.unpack(raw)[0] if raw is not None else 0) + delta
        if pend is not None:
            pend[name] = value
        elif delta:
            txn.put(name.encode(), _I64.pack(value), db=self._db["counters"])
        return value

    @contextmanager
    def _write(self) -> Iterator[Any]:
        """A write transaction whose file effects follow its fate: files it created are
        removed if it aborts (before the abort: the names come from counters that the
        abort rolls back, and the next writer will reuse them), files it dooms are
        removed only once it commits (their names are never reused)."""
        self._created = []
        self._doomed = []
        flushed: list[tuple[int, int]] = []
        txn = self.env.begin(write=True)
        self._wtxn, self._pending = txn, {}
        try:
            flushed = self._flush_releases(txn)
            self._prune_caches(txn)
            yield txn
            pend, self._wtxn = self._pending, None
            db = self._db["counters"]
            for name, value in pend.items():
                txn.put(name.encode(), _I64.pack(value), db=db)
        except BaseException:
            self._wtxn = None
            for path in self._created:
                path.unlink(missing_ok=True)
            self._created = []
            txn.abort()
            if flushed:  # the lease records it deleted came back with the abort
                with self.env.begin(write=True) as t:
                    for loc in flushed:
                        if loc not in self._leases:
                            t.delete(_LOC.pack(*loc) + self._holder, db=self._db["leases"])
            raise
        txn.commit()
        self._created = []
        doomed, self._doomed = self._doomed, []
        for path in doomed:
            path.unlink(missing_ok=True)  # mappings of a slab keep their pages

    def _prune_caches(self, txn: Any) -> None:
        """Close this process's handles on slabs another process dropped: an unlinked
        file's pages live as long as someone maps it."""
        drops = self._counter(txn, "slab_drops", 0)
        if drops == self._seen_drops:
            return
        self._seen_drops = drops
        self._gpu_prune(txn)
        for slab in set(self._rfds) | set(self._wmaps):
            if txn.get(_ID.pack(slab), db=self._db["slabs"]) is None:
                self._forget_slab(slab)

    # -- the API -------------------------------------------------------------------
    def put(self, keys: Sequence[bytes], buffers: Sequence[Any],
            metas: Sequence[bytes] | None = None) -> list[bool]:
        """Store each buffer under its key; True where this call stored it, False where
        the key was present or being written by someone else (first writer wins).
        Raises KVStoreFull when the arena cannot make room: a batch of up to a quarter
        of the arena is stored whole or not at all; a larger one goes in slices of that
        size, and the slices before the one that found no room stay stored. ValueError
        on bad input, before anything changes."""
        keys = self._check_keys(keys)
        if len(buffers) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(buffers)} buffers")
        srcs = [_as_bytes(b) for b in buffers]
        if any(s.size == 0 for s in srcs):
            raise ValueError("a block holds at least one byte")
        metas = [bytes(m) for m in metas] if metas is not None else [b""] * len(keys)
        if len(metas) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(metas)} metas")
        stored: list[bool] = []
        # a batch larger than the arena goes in slices that fit beside what is there
        budget = max(self.capacity // 4, 1)
        lo = 0
        while lo < len(keys):
            hi, size = lo, 0
            while hi < len(keys) and (hi == lo or size + size_class(srcs[hi].size) <= budget):
                size += size_class(srcs[hi].size)
                hi += 1
            stored += self._put(keys[lo:hi], srcs[lo:hi], metas[lo:hi])
            lo = hi
        return stored

    def _put(self, keys: list[bytes], srcs: list[np.ndarray], metas: list[bytes]
             ) -> list[bool]:
        with self._lock:
            self._check_pid()
            reserved: list[tuple[int, bytes, int, int]] = []
            alive: dict[bytes, bool] = {}
            with self._write() as txn:
                for i, key in enumerate(keys):
                    rec = txn.get(key, db=self._blocks)
                    if rec is not None:
                        if rec[0] != _WRITING:
                            continue
                        holder = txn.get(key, db=self._db["writing"])
                        if holder is None or bytes(holder) == self._holder or \
                                holder_alive(bytes(holder).decode()) is not False:
                            continue
                        self._drop_writing(txn, key, alive)  # its writer died
                    slab, chunk = self._allocate(txn, srcs[i].size, alive)
                    txn.put(key, _REC.pack(_WRITING, slab, chunk, srcs[i].size,
                                           bytes(8), 0) + metas[i], db=self._blocks)
                    txn.put(key, self._holder, db=self._db["writing"])
                    reserved.append((i, key, slab, chunk))
            if not reserved:
                return [False] * len(keys)
            sums = []
            try:
                with self.env.begin() as rtxn:
                    # the batch's chunks sit in a few slabs: look each slab up once
                    info = {slab: self._slab_info(rtxn, slab) for _, _, slab, _ in reserved}
                    dsts = [self._chunk(rtxn, slab, chunk, srcs[i].size, info[slab])
                            for i, _, slab, chunk in reserved]
                pairs = [(dst, srcs[i]) for (i, *_), dst in zip(reserved, dsts)]
                sums = [bytes.fromhex(h) for h in _each(
                    copy_and_checksum, pairs, sum(d.size for d in dsts))]
            finally:
                with self._write() as txn:
                    for j, (i, key, slab, chunk) in enumerate(reserved):
                        txn.delete(key, db=self._db["writing"])
                        if j >= len(sums):  # the copy failed: give the chunk back
                            self._drop_writing(txn, key, alive)
                            continue
                        txn.put(key, _REC.pack(_HOST, slab, chunk, srcs[i].size, sums[j], 0)
                                + metas[i], db=self._blocks)
                        self.policy.on_insert(txn, key)
                        self._counter(txn, "host_blocks", 1)
                        self._counter(txn, "host_bytes", srcs[i].size)
            stored = [False] * len(keys)
            for i, *_ in reserved:
                stored[i] = True
            return stored

    def match(self, keys: Sequence[bytes]) -> int:
        """How many leading keys are readable (on the host or on disk). Never blocks."""
        self._check_pid()
        n = 0
        with self.env.begin(db=self._blocks, buffers=True) as txn:
            get = txn.get
            for k in keys:
                rec = get(k)
                if rec is None or rec[0] == _WRITING:
                    break
                n += 1
        return n

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        """For each key, whether it is readable."""
        self._check_pid()
        with self.env.begin(db=self._blocks, buffers=True) as txn:
            return [(r := txn.get(k)) is not None and r[0] != _WRITING for k in keys]

    def _acquire(self, keys: list[bytes]) -> list[tuple[int, int, int, int, bytes, bytes] | None]:
        """Lease each readable key's chunk (promoting disk blocks); one write txn.
        Disk blocks that failed their checksum on the way up are in _bad_promotions."""
        self._bad_promotions: list[bytes] = []
        out: list[tuple[int, int, int, int, bytes, bytes] | None] = []
        alive: dict[bytes, bool] = {}
        try:
            with self._write() as txn:
                hits = 0
                # chunk sizes of the slabs seen: a leased chunk keeps its slab alive
                csizes: dict[int, int] = {}
                for key in keys:
                    rec = txn.get(key, db=self._blocks)
                    if rec is not None and rec[0] == _DISK:
                        rec = self._promote(txn, key, bytes(rec), alive)
                        if rec is _CORRUPT:
                            self._bad_promotions.append(key)
                    if rec is None or rec is _CORRUPT or rec[0] != _HOST:
                        out.append(None)
                        continue
                    _, slab, chunk, nbytes, csum, _ = _REC.unpack_from(rec)
                    csize = csizes.get(slab)
                    if csize is None:
                        csize = csizes[slab] = self._slab_info(txn, slab)[0]
                    self._lease(txn, (slab, chunk))
                    self.policy.on_access(txn, key)
                    out.append((slab, chunk, chunk * csize, nbytes, bytes(csum),
                                bytes(rec[_REC.size:])))
                    hits += 1
                self._counter(txn, "hits", hits)
                self._counter(txn, "misses", len(keys) - hits)
        except BaseException:
            for loc in out:
                if loc is not None:
                    n = self._leases.get(loc[:2], 0) - 1
                    if n <= 0:
                        self._leases.pop(loc[:2], None)
                    else:
                        self._leases[loc[:2]] = n
            raise
        return out

    def _promote(self, txn: Any, key: bytes, rec: bytes, alive: dict[bytes, bool]) -> Any:
        _, _, _, nbytes, csum, pins = _REC.unpack_from(rec)
        meta = bytes(rec[_REC.size:])
        path = self._disk_path(key, rec)
        try:
            slab, chunk = self._allocate(txn, nbytes, alive)
        except KVStoreFull:
            return None  # no room to bring it back: a miss, it stays on disk
        dst = self._chunk(txn, slab, chunk, nbytes)
        try:
            with open(path, "rb", buffering=0) as fh:
                got = fh.readinto(memoryview(dst))
        except FileNotFoundError:
            got = -1
        if got != nbytes or bytes.fromhex(checksum(dst)) != bytes(csum):
            self._free_chunk(txn, slab, chunk, alive)
            self._drop_disk(txn, key, rec)
            self._counter(txn, "corrupt", 1)
            return _CORRUPT
        self._unlist_disk(txn, key, rec)
        new = _REC.pack(_HOST, slab, chunk, nbytes, csum, pins) + meta
        txn.put(key, new, db=self._blocks)
        self.policy.on_insert(txn, key)
        self._counter(txn, "host_blocks", 1)
        self._counter(txn, "host_bytes", nbytes)
        return new

    def _drop_corrupt(self, bad: list[tuple[bytes, tuple[int, int]]]) -> None:
        alive: dict[bytes, bool] = {}
        with self._write() as txn:
            for key, loc in bad:
                rec = txn.get(key, db=self._blocks)
                if rec is None or rec[0] != _HOST or _REC.unpack_from(rec)[1:3] != loc:
                    continue
                self._remove_host(txn, key, rec, alive)
                self._counter(txn, "corrupt", 1)

    def _remove_host(self, txn: Any, key: bytes, rec: bytes, alive: dict[bytes, bool]) -> None:
        _, slab, chunk, nbytes, _, pins = _REC.unpack_from(rec)
        if pins:
            self._counter(txn, "pinned", -1)
        txn.delete(key, db=self._blocks)
        self._gpu_forget(txn, key, alive)
        self.policy.on_remove(txn, key)
        self._counter(txn, "host_blocks", -1)
        self._counter(txn, "host_bytes", -nbytes)
        self._free_chunk(txn, slab, chunk, alive)

    def get(self, keys: Sequence[bytes], *, verify: bool = True) -> list[BlockView | None]:
        """Zero-copy views of the blocks (None where absent). Each view maps its chunk
        privately and holds a read lease until it is garbage collected. With ``verify``
        (the default) each block's checksum is checked first: failing blocks are dropped
        from the store and KVCorrupt is raised."""
        keys = self._check_keys(keys)
        with self._lock:
            self._check_pid()
            found = self._acquire(keys)
            arrs = [None if f is None else np.frombuffer(
                mmap.mmap(self._rfd(f[0]), f[3], offset=f[2], access=mmap.ACCESS_COPY),
                dtype=np.uint8) for f in found]
            live = [a for a in arrs if a is not None]
            sums = iter(_each(checksum, [(a,) for a in live], sum(a.size for a in live))
                        if verify else [])
            out: list[BlockView | None] = []
            bad: list[tuple[bytes, tuple[int, int]]] = []
            for key, f, arr in zip(keys, found, arrs):
                if f is None or arr is None:
                    out.append(None)
                    continue
                slab, chunk, _, _, csum, meta = f
                if verify and bytes.fromhex(next(sums)) != csum:
                    bad.append((key, (slab, chunk)))
                    self._released.append((slab, chunk))
                    out.append(None)
                    continue
                weakref.finalize(arr, self._released.append, (slab, chunk))
                out.append(BlockView(arr, meta))
            if bad:
                self._drop_corrupt(bad)
            if bad or self._bad_promotions:
                raise KVCorrupt(self._bad_promotions + [k for k, _ in bad])
            return out

    def get_into(self, keys: Sequence[bytes], outs: Sequence[np.ndarray], *,
                 verify: bool = True) -> list[bytes | None]:
        """Copy each block into the uint8 array of its size in ``outs``; returns each
        block's metadata, None where absent (that out is left alone). Corrupt blocks
        are dropped and raise KVCorrupt (their outs then hold the bad bytes)."""
        keys = self._check_keys(keys)
        if len(outs) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(outs)} output buffers")
        dsts = [_as_bytes(o) for o in outs]
        with self._lock:
            self._check_pid()
            found = self._acquire(keys)
            metas: list[bytes | None] = []
            bad: list[tuple[bytes, tuple[int, int]]] = []
            try:
                jobs: list[tuple[np.ndarray, np.ndarray]] = []
                for key, f, dst in zip(keys, found, dsts):
                    if f is None:
                        metas.append(None)
                        continue
                    slab, chunk, offset, nbytes, csum, meta = f
                    if dst.size != nbytes:
                        raise ValueError(f"block {key.hex()} holds {nbytes} bytes; its "
                                         f"output buffer {dst.size}")
                    jobs.append((dst, self._leased_bytes(f)))
                    metas.append(meta)
                total = sum(d.size for d, _ in jobs)
                if verify:
                    sums = iter(_each(copy_and_checksum, jobs, total))
                    for key, f in zip(keys, found):
                        if f is not None and bytes.fromhex(next(sums)) != f[4]:
                            bad.append((key, f[:2]))
                else:
                    _each(copy, jobs, total)
            finally:
                self._end_reads(found, bad)
            return metas

    def _leased_bytes(self, f: tuple[int, int, int, int, bytes, bytes]) -> np.ndarray:
        """The bytes of a chunk leased by ``_acquire`` (``f`` is its entry), through this
        process's shared mapping of the slab."""
        mm = self._wmaps.get(f[0])
        if mm is None:
            mm = self._map_for(f[0])
        return np.frombuffer(mm, dtype=np.uint8, count=f[3], offset=f[2])

    def _end_reads(self, found: list[Any], bad: list[tuple[bytes, tuple[int, int]]],
                   *, flush: bool = True) -> None:
        """After reading chunks leased by ``_acquire``: give the leases back (at once
        with ``flush``, else at the next write), drop the blocks in ``bad`` (key, chunk)
        that failed their checksum, and raise KVCorrupt naming them and any disk block
        that failed on its way up."""
        for f in found:
            if f is not None:
                self._released.append(f[:2])
        if bad:
            self._drop_corrupt(bad)
        elif flush:
            self._flush_releases()
        if bad or self._bad_promotions:
            raise KVCorrupt(self._bad_promotions + [k for k, _ in bad])

    def _map_for(self, slab: int) -> mmap.mmap:
        with self.env.begin() as txn:
            csize, nchunks, _ = self._slab_info(txn, slab)
        return self._wmap(slab, csize * nchunks)

    def _adjust_pins(self, keys: Sequence[bytes], delta: int) -> int:
        keys = self._check_keys(keys)
        n = 0
        alive: dict[bytes, bool] = {}
        with self._lock:
            self._check_pid()
            with self._write() as txn:
                for key in keys:
                    rec = txn.get(key, db=self._blocks)
                    if rec is not None and rec[0] == _DISK and delta > 0:
                        self._promote(txn, key, bytes(rec), alive)  # pinned: in memory
                        rec = txn.get(key, db=self._blocks)
                    if rec is None or rec[0] == _WRITING:
                        continue
                    state, slab, chunk, nbytes, csum, pins = _REC.unpack_from(rec)
                    if pins + delta < 0:
                        continue
                    txn.put(key, _REC.pack(state, slab, chunk, nbytes, csum, pins + delta)
                            + bytes(rec[_REC.size:]), db=self._blocks)
                    self._counter(txn, "pinned", 1 if pins == 0 else -1 if pins + delta == 0
                                  else 0)
                    n += 1
        return n

    def pin(self, keys: Sequence[bytes]) -> int:
        """Protect the blocks from eviction (counted: each pin needs an unpin). Pins are
        not tied to the process. Returns how many keys were present and pinned."""
        return self._adjust_pins(keys, 1)

    def unpin(self, keys: Sequence[bytes]) -> int:
        """Undo one pin of each key; returns how many were pinned."""
        return self._adjust_pins(keys, -1)

    def delete(self, keys: Sequence[bytes]) -> int:
        """Remove the blocks (pinned ones too); views already handed out stay valid.
        Returns how many were present. Idempotent."""
        keys = self._check_keys(keys)
        n = 0
        alive: dict[bytes, bool] = {}
        with self._lock:
            self._check_pid()
            with self._write() as txn:
                for key in keys:
                    rec = txn.get(key, db=self._blocks)
                    if rec is None or rec[0] == _WRITING:
                        continue
                    if rec[0] == _HOST:
                        self._remove_host(txn, key, rec, alive)
                    else:
                        self._drop_disk(txn, key, rec)
                    n += 1
        return n

    def locate(self, key: bytes) -> tuple[str, Path, int, int] | None:
        """Where a block's bytes are: (tier, file, offset, nbytes), for tests and tools."""
        self._check_pid()
        with self.env.begin() as txn:
            rec = txn.get(key, db=self._blocks)
            if rec is None or rec[0] == _WRITING:
                return None
            state, slab, chunk, nbytes, _, _ = _REC.unpack_from(rec)
            if state == _DISK:
                return "disk", self._disk_path(key, rec), 0, nbytes
            return "host", self._slab_path(slab), chunk * self._slab_info(txn, slab)[0], nbytes

    def iter_keys(self) -> Iterator[bytes]:
        """The readable keys (a snapshot: one read transaction)."""
        self._check_pid()
        with self.env.begin(db=self._blocks) as txn:
            for k, v in txn.cursor():
                if v[0] != _WRITING:
                    yield bytes(k)

    def stats(self, *, bloom_fp: float = 0.01) -> KVStats:
        """Counters shared by every process of the store, and a Bloom filter of its keys."""
        with self._lock:
            self._check_pid()
            self._flush_releases()
            with self.env.begin(db=self._blocks) as txn:
                c = {name: self._counter(txn, name, 0) for name in (
                    "host_blocks", "host_bytes", "disk_blocks", "disk_bytes", "arena_bytes",
                    "pinned", "hits", "misses", "evictions", "spills", "corrupt",
                    "gpu_blocks", "gpu_bytes", "gpu_arena_bytes", "gpu_hits",
                    "gpu_evictions")}
                n = c["host_blocks"] + c["disk_blocks"]
                # m = -n ln p / ln^2 2 bits, k = m/n ln 2 hashes
                nbits = max(1024, int(-max(n, 1) * np.log(bloom_fp) / (np.log(2) ** 2)))
                nbits = -(-nbits // 8) * 8
                k = max(1, round(nbits / max(n, 1) * np.log(2)))
                k = min(k, 16)
                bits = bytearray(nbits // 8)
                for key, v in txn.cursor():
                    if v[0] != _WRITING:
                        for p in _bloom_positions(bytes(key), nbits, k):
                            bits[p >> 3] |= 1 << (p & 7)
        return KVStats(blocks=n, nbytes=c["host_bytes"] + c["disk_bytes"],
                       host_blocks=c["host_blocks"], host_bytes=c["host_bytes"],
                       disk_blocks=c["disk_blocks"], disk_bytes=c["disk_bytes"],
                       capacity=self.capacity, arena_bytes=c["arena_bytes"],
                       pinned=c["pinned"], hits=c["hits"], misses=c["misses"],
                       evictions=c["evictions"], spills=c["spills"], corrupt=c["corrupt"],
                       bloom=bytes(bits), bloom_hashes=k, gpu_blocks=c["gpu_blocks"],
                       gpu_bytes=c["gpu_bytes"], gpu_capacity=self.gpu_capacity,
                       gpu_arena_bytes=c["gpu_arena_bytes"], gpu_hits=c["gpu_hits"],
                       gpu_evictions=c["gpu_evictions"])
