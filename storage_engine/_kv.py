"""The KV block store: an LMDB index over a slab arena in POSIX shared memory.

One store per directory under /dev/shm, shared by every process on the host that opens
it. Blocks are many and small, so each is a chunk of a *slab* (a file of fixed-size
chunks of one size class), not a file of its own, and the index is LMDB, not the catalog:
``match`` over 1,000 keys is one LMDB read transaction.

Layout under ``root``::

    index/        the LMDB environment (lock=True: every process of the host shares it)
    slabs/*.slab  the arena: pre-allocated with posix_fallocate, so a full tmpfs is an
                  error at slab creation, never a SIGBUS at first write
    gpu/          the GPU tier's slabs (CUDA IPC handles), when a process gives one

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

``BlockStore`` is a facade over its parts, each in its own module: ``KVIndex`` and
``ReadLeases`` (``_kv_index``), ``HostArena`` (``_kv_arena``), ``DiskSpill``
(``_kv_spill``), ``GpuSlabs`` and ``GpuBlockCache`` (``_kv_gpu``), ``BlockTable``
(``_kv_blocks``, the records and their moves between tiers), ``HostCopies`` and
``DeviceCopies`` (``_kv_copies``, the byte copies), and an ``Eviction``
(``_kv_eviction``).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lmdb
import numpy as np

from ._kv_arena import HostArena
from ._kv_blocks import BlockTable
from ._kv_copies import DeviceCopies, HostCopies
from ._kv_eviction import Eviction, make_eviction
from ._kv_gpu import GpuBlockCache, GpuBlockView, GpuSlabs
from ._kv_index import KVIndex, ReadLeases
from ._kv_spill import DiskSpill
from ._kv_types import (
    GPU_BIT,
    PAGE,
    BlockView,
    KVIndexDamaged,
    KVStats,
    as_bytes,
    bloom_filter,
    check_keys,
    size_class,
)

__all__ = ["BlockStore"]

#: the store-wide counters ``stats`` reports
_COUNTERS = ("host_blocks", "host_bytes", "disk_blocks", "disk_bytes", "arena_bytes",
             "pinned", "hits", "misses", "evictions", "spills", "corrupt", "gpu_blocks",
             "gpu_bytes", "gpu_arena_bytes", "gpu_hits", "gpu_evictions")


class BlockStore:
    """A host's store of KV blocks; see the module docstring for the protocol.

    Open one per process (after a fork, the child reopens its own: LMDB environments do
    not survive a fork, and this object notices). Methods are thread-safe (one lock).
    ``put``, ``get``, ``pin``, ``unpin`` and ``delete`` take LMDB's write lock for a few
    microseconds per block (longer when they evict to disk); ``match`` never blocks.

    ``eviction`` orders the host arena (``"lru"``, ``"s3fifo"`` or an ``Eviction``;
    ``policy`` is its older name). ``gpu_device`` and ``gpu_capacity`` give this process
    the store's GPU tier (copies of hot blocks in device memory, see ``_kv_gpu``):
    ``get_device``, ``get_into_device`` and ``admit_device``.
    """

    def __init__(self, root: Path, *, capacity_bytes: int, slab_bytes: int = 64 << 20,
                 eviction: str | Eviction | None = None, disk_root: Path | None = None,
                 disk_capacity: int | None = None, map_size: int = 1 << 34,
                 gpu_device: int | None = None, gpu_capacity: int | None = None,
                 policy: str | Eviction | None = None) -> None:
        if capacity_bytes <= 0:
            raise ValueError("capacity_bytes must be positive")
        if slab_bytes < PAGE:
            raise ValueError(f"slab_bytes must be at least {PAGE}")
        if eviction is not None and policy is not None and eviction != policy:
            raise ValueError("give eviction= or its older name policy=, not both")
        self.root = Path(root)
        self.disk_root = Path(disk_root) if disk_root is not None else None
        self.disk_capacity = disk_capacity
        self._lock = threading.RLock()
        for d in (self.root, self.root / "slabs", self.root / "index", self.disk_root):
            if d is not None:
                d.mkdir(parents=True, exist_ok=True, mode=0o700)
                os.chmod(d, 0o700)
        GpuSlabs.check_options(gpu_device, gpu_capacity)
        self._index = KVIndex(self.root / "index", map_size=map_size)
        try:
            self._index.open()
            self._pid = os.getpid()
            self.capacity, self.slab_bytes, self.eviction = self._adopt_settings(
                int(capacity_bytes), int(slab_bytes),
                make_eviction(eviction or policy or "lru"))
        except lmdb.Error as exc:  # not LMDB any more (truncated, overwritten), or corrupt
            env = getattr(self._index, "env", None)
            if env is not None:
                env.close()
            raise KVIndexDamaged(str(self.root / "index"),
                                 f"{type(exc).__name__}: {str(exc).rsplit(': ', 1)[-1]}"
                                 ) from exc
        self._leases = ReadLeases(self._index, release=self._release_chunk)
        self._arena = HostArena(self._index, self.root / "slabs", capacity=self.capacity,
                                slab_bytes=self.slab_bytes)
        self._spill = DiskSpill(self._index, self.disk_root, disk_capacity)
        self._gpu_slabs = GpuSlabs(self._index, self.root / "gpu", device=gpu_device,
                                   capacity=gpu_capacity, slab_bytes=self.slab_bytes)
        self._gpu = GpuBlockCache(self._index, self._leases, self._gpu_slabs)
        self._blocks = BlockTable(self._index, self._leases, self._arena, self._spill,
                                  self._gpu, self.eviction)
        self._host = HostCopies(self._index, self._leases, self._arena, self._blocks)
        self._device = DeviceCopies(self._host, self._blocks, self._gpu)
        # every write transaction first drops released leases, then stale mappings
        self._index.hooks = [self._leases, self._gpu_slabs, self._arena]
        self._bind()

    # -- environment ---------------------------------------------------------------
    def _adopt_settings(self, capacity: int, slab_bytes: int, eviction: Eviction
                        ) -> tuple[int, int, Eviction]:
        """The first process to create the store fixes its capacity, slab size and
        eviction; later ones adopt them (two evictions over one arena would each see
        half of it, and two capacities would let the larger one overfill it)."""
        with self._index.env.begin(write=True) as txn:
            raw = self._index.setting(
                txn, b"settings", f"{capacity} {slab_bytes} {eviction.name}".encode())
        assert raw is not None
        cap, slab, name = raw.decode().split()
        return int(cap), int(slab), eviction if name == eviction.name else make_eviction(name)

    def _bind(self) -> None:
        """Open the index's databases and let the parts take their state from them."""
        index = self._index
        index.open_dbs(["counters", "settings", *ReadLeases.DB_NAMES, *HostArena.DB_NAMES,
                        *BlockTable.DB_NAMES, *DiskSpill.DB_NAMES, *GpuSlabs.DB_NAMES,
                        *GpuBlockCache.DB_NAMES, *self.eviction.db_names])
        self.eviction.bind({n: index.dbs[n] for n in self.eviction.db_names}, index.counter)
        self._gpu.bind()
        with index.env.begin(write=True) as txn:
            self._gpu_slabs.bind(txn)
            self._blocks.reclaim_orphans(txn)

    def _check_pid(self) -> None:
        if os.getpid() != self._pid:  # forked: the parent's environment is not ours
            self._pid = os.getpid()
            self._index.open()
            self._leases.reset()
            self._arena.reset()
            self._bind()

    def _release_chunk(self, txn: lmdb.Transaction, slab: int, chunk: int) -> None:
        """A chunk nobody reads any more goes back to its arena's free list."""
        (self._gpu_slabs if slab & GPU_BIT else self._arena).release_chunk(txn, slab, chunk)

    def close(self) -> None:
        with self._lock:
            if os.getpid() == self._pid:
                self._host.flush_releases()
                self._index.close()
                self._arena.close()
                self._gpu_slabs.close()
            else:
                self._arena.reset()

    def __enter__(self) -> BlockStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- host blocks -----------------------------------------------------------------
    def put(self, keys: Sequence[bytes], buffers: Sequence[Any],
            metas: Sequence[bytes] | None = None) -> list[bool]:
        """Store each buffer under its key; True where this call stored it, False where
        the key was present or being written by someone else (first writer wins).
        Raises KVStoreFull when the arena cannot make room: a batch of up to a quarter
        of the arena is stored whole or not at all; a larger one goes in slices of that
        size, and the slices before the one that found no room stay stored. ValueError
        on bad input, before anything changes."""
        keys = check_keys(keys)
        if len(buffers) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(buffers)} buffers")
        srcs = [as_bytes(b) for b in buffers]
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
            with self._lock:
                self._check_pid()
                stored += self._host.put(keys[lo:hi], srcs[lo:hi], metas[lo:hi])
            lo = hi
        return stored

    def match(self, keys: Sequence[bytes]) -> int:
        """How many leading keys are readable (on the host or on disk). Never blocks."""
        self._check_pid()
        return self._blocks.match(keys)

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        """For each key, whether it is readable."""
        self._check_pid()
        return self._blocks.contains(keys)

    def get(self, keys: Sequence[bytes], *, verify: bool = True) -> list[BlockView | None]:
        """Zero-copy views of the blocks (None where absent). Each view maps its chunk
        privately and holds a read lease until it is garbage collected. With ``verify``
        (the default) each block's checksum is checked first: failing blocks are dropped
        from the store and KVCorrupt is raised."""
        keys = check_keys(keys)
        with self._lock:
            self._check_pid()
            return self._host.get(keys, verify)

    def get_into(self, keys: Sequence[bytes], outs: Sequence[np.ndarray], *,
                 verify: bool = True) -> list[bytes | None]:
        """Copy each block into the uint8 array of its size in ``outs``; returns each
        block's metadata, None where absent (that out is left alone). Corrupt blocks
        are dropped and raise KVCorrupt (their outs then hold the bad bytes)."""
        keys = check_keys(keys)
        if len(outs) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(outs)} output buffers")
        dsts = [as_bytes(o) for o in outs]
        with self._lock:
            self._check_pid()
            return self._host.get_into(keys, dsts, verify)

    def _adjust_pins(self, keys: Sequence[bytes], delta: int) -> int:
        keys = check_keys(keys)
        with self._lock:
            self._check_pid()
            return self._blocks.adjust_pins(keys, delta)

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
        keys = check_keys(keys)
        with self._lock:
            self._check_pid()
            return self._blocks.delete(keys)

    def locate(self, key: bytes) -> tuple[str, Path, int, int] | None:
        """Where a block's bytes are: (tier, file, offset, nbytes), for tests and tools."""
        self._check_pid()
        return self._blocks.locate(key)

    def release_pending(self) -> None:
        """Drop the read leases of views this process no longer holds (else done at its
        next call into the store)."""
        with self._lock:
            self._check_pid()
            self._host.flush_releases()

    def stats(self, *, bloom_fp: float = 0.01) -> KVStats:
        """Counters shared by every process of the store, and a Bloom filter of its keys."""
        with self._lock:
            self._check_pid()
            self._host.flush_releases()
            index = self._index
            with index.env.begin(db=index.dbs["blocks"]) as txn:
                c = {name: index.counter(txn, name, 0) for name in _COUNTERS}
                n = c["host_blocks"] + c["disk_blocks"]
                bloom, k = bloom_filter(self._blocks.readable(txn), n, bloom_fp)
        return KVStats(blocks=n, nbytes=c["host_bytes"] + c["disk_bytes"],
                       host_blocks=c["host_blocks"], host_bytes=c["host_bytes"],
                       disk_blocks=c["disk_blocks"], disk_bytes=c["disk_bytes"],
                       capacity=self.capacity, arena_bytes=c["arena_bytes"],
                       pinned=c["pinned"], hits=c["hits"], misses=c["misses"],
                       evictions=c["evictions"], spills=c["spills"], corrupt=c["corrupt"],
                       bloom=bloom, bloom_hashes=k, gpu_blocks=c["gpu_blocks"],
                       gpu_bytes=c["gpu_bytes"], gpu_capacity=self._gpu.capacity,
                       gpu_arena_bytes=c["gpu_arena_bytes"], gpu_hits=c["gpu_hits"],
                       gpu_evictions=c["gpu_evictions"])

    # -- the GPU tier ------------------------------------------------------------------
    @property
    def gpu_enabled(self) -> bool:
        return self._gpu.enabled

    @property
    def gpu_device(self) -> int | None:
        return self._gpu.device

    @property
    def gpu_capacity(self) -> int:
        return self._gpu.capacity

    def get_device(self, keys: Sequence[bytes], *, verify: bool = True
                   ) -> list[GpuBlockView | None]:
        """Views of the blocks' GPU copies, copying a block up from the host first where
        it has none (verifying its checksum there). None where the block is absent, or
        where the tier has no room for it (then read it from the host). Raises KVCorrupt
        as ``get`` does."""
        keys = check_keys(keys)
        self._gpu.need()
        with self._lock:
            self._check_pid()
            return self._device.get_device(keys, verify)

    def admit_device(self, keys: Sequence[bytes], srcs: Sequence[tuple[int, int, int]]
                     ) -> int:
        """Give blocks already stored a GPU copy, copied device to device from
        ``(ptr, nbytes, device)`` (the tensors they were put from). Blocks absent from
        the store, of another size, or copied already are skipped; so is the rest when
        the tier has no room. Returns how many got a copy."""
        keys = check_keys(keys)
        self._gpu.need()
        if len(srcs) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(srcs)} sources")
        with self._lock:
            self._check_pid()
            return self._device.admit_device(keys, list(srcs))

    def get_into_device(self, keys: Sequence[bytes], dsts: Sequence[tuple[int, int]], *,
                        verify: bool = True) -> list[bytes | None]:
        """Copy each block into device memory at ``(ptr, nbytes)``: from its GPU copy
        (device to device) where it has one, else from the host (checksum verified
        first). Returns each block's metadata, None where absent. Admits nothing."""
        keys = check_keys(keys)
        self._gpu.need()
        if len(dsts) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(dsts)} output buffers")
        with self._lock:
            self._check_pid()
            return self._device.get_into_device(keys, list(dsts), verify)

    def gpu_locate(self, key: bytes) -> tuple[int, int, int] | None:
        """Where a block's GPU copy is: (slab, offset, nbytes), for tests and tools."""
        self._check_pid()
        return self._gpu.locate(key)
