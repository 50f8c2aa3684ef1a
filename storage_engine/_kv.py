"""The KV block store: a native index and slab arena in POSIX shared memory.

One store per directory under /dev/shm, shared by every process on the host that opens
it. Blocks are many and small, so each is a chunk of a *slab* (a file of fixed-size
chunks of one size class), not a file of its own, and the index is a hash table in
shared memory, not the catalog (``storage_engine/kv/``, the ``BlockIndex`` of the compiled
``_stream`` extension): ``match`` over 1,000 keys is 1,000 probes and no lock (the
table's seqlock), flat however many blocks the store holds.

Layout under ``root``::

    index.kvx       the header: settings, counters, the lock, who reads what
    table-<n>.kvx   the hash table (grown by doubling, its buckets moved a few at a time)
    records-<n>.kvx the block records (never moved: a growth extends the file)
    slabs/*.slab    the arena: pre-allocated with posix_fallocate, so a full tmpfs is an
                    error at slab creation, never a SIGBUS at first write
    index/          the GPU tier's LMDB index, when a process gives the store a GPU
    gpu/            the GPU tier's slabs (CUDA IPC handles)

Why the protocol looks as it does:

- *put* of a batch is one lock to reserve a chunk per new key (evicting if needed)
  under a WRITING record that names the writer, the copies and their checksums outside
  the lock and the GIL (writers copy in parallel), and one lock to publish. First
  writer wins: a key present or being written is skipped, never an error. A writer
  that dies between the two leaves WRITING records of a dead process, which the next
  writer of the key, or the next allocation that finds no room, takes over.
- *read_into* (``get_into``) copies without a lease and then checks, under the lock,
  that each block still sits where it was copied from (a seqlock): a block evicted
  meanwhile is read again.
- *get* hands out views on private (copy-on-write) mappings of the chunk, one mapping
  per view: a reader's stray write changes its own pages only. A private mapping still
  sees later writes to the file where the reader did not write, so a chunk must not be
  reused while someone holds a view: each view holds a *read lease* on its record (a
  bit per process in the shared record), given back when the view is garbage
  collected (at this process's next call into the store; ``_kv_views``). A dead
  process's leases are cleared when an allocation finds no room.
- Pins are counters in the records, not tied to a process: they last until unpinned.
- Evicted blocks spill to ``disk_root`` (one file per block) when it is given, and are
  promoted back into the arena when read; past ``disk_capacity`` the oldest unpinned
  spills go.
- Every block carries an xxh3-64 checksum. ``get`` and ``get_into`` verify it by default;
  a block that fails is dropped from the store and ``KVCorrupt`` is raised naming it, so
  it is never served and a later ``match`` reports it absent.
"""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ._kv_eviction import Eviction
from ._kv_gpu import GpuBlockView
from ._kv_gpu_part import GpuPart
from ._kv_keys import call_native, check_keys
from ._kv_types import (
    PAGE,
    BlockView,
    KVCorrupt,
    KVIndexDamaged,
    KVStats,
    KVStoreFull,
    RawEvent,
    as_bytes,
    bloom_size,
)
from ._kv_views import HostViews, restore_slab
from ._procs import current_holder
from ._stream import E_NOSPACE, E_OK, E_TOO_BIG, BlockIndex, set_damage_error
from ._stream import kept_maps as _kept_maps

# what the native index raises for a damaged namespace: KVIndexDamaged(path, reason),
# the file whose check failed (CorruptData to the client)
set_damage_error(KVIndexDamaged)

__all__ = ["BlockStore", "kept_mappings"]

#: the evictions the native index runs, by name
EVICTIONS = {"lru": 0, "s3fifo": 1}
_EVICTION_NAMES = {v: k for k, v in EVICTIONS.items()}
_NO_LIMIT = (1 << 63) - 1


def kept_mappings() -> dict[str, int]:
    """This process's kept mappings of slab files it gave the pool (``keep_mappings``),
    after closing those of files since unlinked: ``mappings`` and their ``bytes`` now,
    how many were ever ``kept`` and ``reused`` by a new slab."""
    n, nbytes, kept, reused = _kept_maps(True)
    return {"mappings": n, "bytes": nbytes, "kept": kept, "reused": reused}


def _u64(values: Any, n: int, what: str) -> np.ndarray:
    arr = np.ascontiguousarray(values, dtype=np.uint64).reshape(-1)
    if arr.size != n:
        raise ValueError(f"{n} keys but {arr.size} {what}")
    return arr


class BlockStore:
    """A host's store of KV blocks; see the module docstring for the protocol.

    Open one per process (after a fork, the child reopens its own and this object
    notices). Methods are thread-safe. ``put``, ``get``, ``pin``, ``unpin`` and
    ``delete`` hold the store's lock for well under a microsecond per block (longer when
    they evict to disk); ``match`` and ``contains`` take it for the probes only.

    ``eviction`` orders the host arena (``"lru"`` or ``"s3fifo"``; ``policy`` is its
    older name). ``pool_dir`` is the store's pool of freed files (``Pool``): a new slab
    takes a pooled file first, whose pages exist already, so a new namespace in a store
    that has freed memory pays page-table entries, not page faults. ``gpu_device`` and ``gpu_capacity`` give this process the store's GPU
    tier (copies of hot blocks in device memory, see ``_kv_gpu``): ``get_device``,
    ``get_into_device`` and ``admit_device``.

    The batch paths take no Python object per block: ``put_batch`` and ``read_into``
    move blocks between the arena and raw addresses given as arrays.
    """

    def __init__(self, root: Path, *, capacity_bytes: int, slab_bytes: int = 64 << 20,
                 eviction: str | Eviction | None = None, disk_root: Path | None = None,
                 disk_capacity: int | None = None, map_size: int = 1 << 34,
                 gpu_device: int | None = None, gpu_capacity: int | None = None,
                 policy: str | Eviction | None = None, pool_dir: Path | None = None
                 ) -> None:
        if capacity_bytes <= 0:
            raise ValueError("capacity_bytes must be positive")
        if slab_bytes < PAGE:
            raise ValueError(f"slab_bytes must be at least {PAGE}")
        if eviction is not None and policy is not None and eviction != policy:
            raise ValueError("give eviction= or its older name policy=, not both")
        ev = eviction or policy or "lru"
        name = ev.name if isinstance(ev, Eviction) else ev
        if name not in EVICTIONS:
            raise ValueError(f"unknown eviction {name!r}; known: 'lru', 's3fifo' (the "
                             f"host arena's order runs in the shared index)")
        GpuPart.check_options(gpu_device, gpu_capacity)
        self.root = Path(root)
        self.disk_root = Path(disk_root) if disk_root is not None else None
        self.disk_capacity = disk_capacity
        self._lock = threading.RLock()
        for d in (self.root, self.root / "slabs", self.disk_root):
            if d is not None:
                d.mkdir(parents=True, exist_ok=True, mode=0o700)
                os.chmod(d, 0o700)
        self._asked = (int(capacity_bytes), int(slab_bytes), EVICTIONS[name])
        self.pool_dir = Path(pool_dir) if pool_dir is not None else None
        self._map_size = map_size
        self._gpu_opts = (gpu_device, gpu_capacity)
        self._views = HostViews()
        self._paths: dict[tuple[int, int], str] = {}
        #: called by a put between its reservation and its copies (tests stop one there)
        self.after_reserve: Any = None
        self._ix = self._open()
        cap, slab, ev_code, _ = self._ix.settings()
        self.capacity, self.slab_bytes = int(cap), int(slab)
        self.eviction = _EVICTION_NAMES[ev_code]
        self._gpu: GpuPart | None = None
        if gpu_device is not None:
            self._gpu_part()

    # -- environment ---------------------------------------------------------------
    def _open(self) -> BlockIndex:
        """This process's handle on the index (the first process to create the store
        fixes its capacity, slab size and eviction; later ones adopt them)."""
        self._pid = os.getpid()
        _, pid, ticks = current_holder().rsplit(":", 2)
        path = self.root / "index.kvx"
        cap, slab, ev = self._asked
        try:
            ix = BlockIndex(str(self.root), cap, slab, ev, int(pid), int(ticks))
        except ValueError as exc:  # not an index any more (truncated, overwritten)
            raise KVIndexDamaged(str(path), str(exc).split(": ", 1)[-1]) from exc
        except OverflowError as exc:
            raise KVStoreFull(f"KV store {self.root}: {exc}") from exc
        ix.set_spill(str(self.disk_root) if self.disk_root is not None else None,
                     self.disk_capacity if self.disk_capacity is not None else _NO_LIMIT)
        ix.set_pool(str(self.pool_dir) if self.pool_dir is not None else None)
        ix.reclaim_orphans()
        return ix

    def _gpu_part(self) -> GpuPart:
        """The GPU tier's index (LMDB), opened when this process has a tier or first
        has to forget GPU copies of blocks that left the store."""
        if self._gpu is None:
            device, capacity = self._gpu_opts
            self._gpu = GpuPart(self.root, self._map_size, device=device, capacity=capacity,
                                slab_bytes=self.slab_bytes, host=self._host_record,
                                reads=self)
            if device is not None:
                self._ix.mark_gpu()
        return self._gpu

    def _check_pid(self) -> None:
        if os.getpid() != self._pid:  # forked: the parent's handle is not ours
            self._ix.abandon()
            self._views.reset()
            self._paths = {}
            self._ix = self._open()
            if self._gpu is not None:
                self._gpu.reopen()

    def _forget_left(self) -> None:
        """Drop the GPU copies of blocks the last call removed from the store."""
        left = self._ix.take_left()
        if left:
            self._gpu_part().forget(left)

    def _host_record(self, key: bytes) -> tuple[int, bytes] | None:
        """(nbytes, meta) of a readable block, for the GPU tier."""
        loc = self._ix.locate(key)
        return None if loc is None else (int(loc[4]), loc[6])

    def close(self) -> None:
        with self._lock:
            if os.getpid() == self._pid:
                self._views.flush(self._ix)
                self._ix.close()
                self._views.close()
                if self._gpu is not None:
                    self._gpu.close()
            else:
                self._ix.abandon()

    def __enter__(self) -> BlockStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _full(self, err: int, needed: int) -> KVStoreFull:
        if err == E_TOO_BIG:
            return KVStoreFull(f"a block of {needed} bytes is larger than the arena "
                               f"({self.capacity} bytes)", needed=needed,
                               capacity=self.capacity)
        if err == E_NOSPACE:
            return KVStoreFull(f"shared memory is full: no room for a slab under "
                               f"{self.root}", needed=needed, capacity=self.capacity)
        return KVStoreFull(f"the KV arena under {self.root} is full ({self.capacity} bytes) "
                           f"and every block in it is pinned or being read", needed=needed,
                           capacity=self.capacity)

    # -- host blocks -----------------------------------------------------------------
    def put(self, keys: Sequence[bytes], buffers: Sequence[Any],
            metas: Sequence[bytes] | bytes | None = None) -> list[bool]:
        """Store each buffer under its key; True where this call stored it, False where
        the key was present or being written by someone else (first writer wins).
        Raises KVStoreFull when the arena cannot make room: a batch of up to a quarter
        of the arena is stored whole or not at all; a larger one goes in slices of that
        size, and the slices before the one that found no room stay stored. ValueError
        on bad input, before anything changes. ``metas``: one per key, or one for all."""
        keys = check_keys(keys)
        if len(buffers) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(buffers)} buffers")
        srcs = [as_bytes(b) for b in buffers]
        sizes = np.fromiter((s.size for s in srcs), np.uint64, len(srcs))
        if len(srcs) and not sizes.all():
            raise ValueError("a block holds at least one byte")
        addrs = np.fromiter((s.ctypes.data for s in srcs), np.uint64, len(srcs))
        # the sources stay alive (``srcs``) until the copies are done
        stored = self.put_batch(keys, addrs, sizes, metas)
        del srcs
        return stored.tolist()

    def put_batch(self, keys: Sequence[bytes], addrs: Any, sizes: Any,
                  metas: Sequence[bytes] | bytes | None = None) -> np.ndarray:
        """``put`` of blocks given as raw addresses and sizes (uint64 arrays, one per
        key): no Python object per block. The caller keeps the bytes alive and
        unchanged during the call. Returns a bool array: stored by this call."""
        if not isinstance(keys, list):
            keys = check_keys(keys)
        n = len(keys)
        addrs = _u64(addrs, n, "addresses")
        sizes = _u64(sizes, n, "sizes")
        if metas is None:
            metas = b""
        elif not isinstance(metas, bytes):
            metas = [bytes(m) for m in metas]
            if len(metas) != n:
                raise ValueError(f"{n} keys but {len(metas)} metas")
        if n and not sizes.all():
            raise ValueError("a block holds at least one byte")
        out = np.zeros(n, dtype=bool)
        # a batch larger than the arena goes in slices that fit beside what is there
        budget = max(self.capacity // 4, 1)
        lo = 0
        while lo < n:
            hi = self._slice_end(sizes, lo, budget)
            part = metas if isinstance(metas, bytes) else metas[lo:hi]
            with self._lock:
                self._check_pid()
                self._views.flush(self._ix)
                stored, err, needed = call_native(self._ix.put, keys[lo:hi], addrs[lo:hi],
                                              sizes[lo:hi], part, self.after_reserve)
                self._forget_left()
            if err != E_OK:
                raise self._full(err, needed)
            out[lo:hi] = np.frombuffer(stored, dtype=np.uint8).astype(bool)
            lo = hi
        return out

    @staticmethod
    def _slice_end(sizes: np.ndarray, lo: int, budget: int) -> int:
        """The end of the slice of the batch from ``lo`` whose chunks fit ``budget``."""
        n = sizes.size
        if n - lo <= 1:
            return n
        from ._stream import size_class

        first = int(sizes[lo])
        if int(sizes[lo:].min()) == first == int(sizes[lo:].max()):  # the usual batch
            return min(n, lo + max(1, budget // size_class(first)))
        total, hi = 0, lo
        while hi < n:
            c = size_class(int(sizes[hi]))
            if hi > lo and total + c > budget:
                break
            total += c
            hi += 1
        return hi

    def match(self, keys: Sequence[bytes]) -> int:
        """How many leading keys are readable (on the host or on disk)."""
        self._check_pid()
        return int(call_native(self._ix.match, keys))

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        """For each key, whether it is readable."""
        self._check_pid()
        return [b == 1 for b in call_native(self._ix.contains, keys)]

    def get(self, keys: Sequence[bytes], *, verify: bool = True) -> list[BlockView | None]:
        """Zero-copy views of the blocks (None where absent). Each view maps its chunk
        privately and holds a read lease until it is garbage collected. A block spilled
        to disk is mapped back into the arena; where the arena has no room (everything
        in it pinned or being read) its view is a copy read from disk instead, so a read
        never fails for want of room. With ``verify`` (the default) each block's
        checksum is checked first: failing blocks are dropped from the store and
        KVCorrupt is raised."""
        keys = check_keys(keys)
        with self._lock:
            self._check_pid()
            self._views.flush(self._ix)
            found = self._ix.lease(keys)
            self._forget_left()
            bad: list[bytes] = [k for k, f in zip(keys, found, strict=True) if f == -1]
            spilled = [i for i, f in enumerate(found) if f == -2]
            try:
                out, failed, drop = self._views.hand_out(keys, found, self._slab_path, verify)
            except BaseException:
                self._release_now([f for f in found if isinstance(f, tuple)])
                raise
            bad.extend(failed)
            if drop:
                for idx, gen in drop:
                    self._ix.drop_corrupt(idx, gen)
                self._release_now([(i, g) for i, g in drop])
                self._forget_left()
        for i in spilled:  # on disk, and no room in the arena to map it back: a copy
            try:
                out[i] = self._copy_out(keys[i], verify)
            except KVCorrupt:  # its disk copy failed its checksum: dropped
                bad.append(keys[i])
        if bad:
            raise KVCorrupt(bad)
        return out

    def _copy_out(self, key: bytes, verify: bool) -> BlockView | None:
        """A spilled block that has no room in the arena, read from its disk copy into
        memory of its own (``read_into``: no chunk of the arena taken). None where it
        went meanwhile, or was rewritten at another size (a miss, as a later ``get``
        would find)."""
        loc = self._ix.locate(key)
        if loc is None:
            return None
        buf = np.empty(int(loc[4]), np.uint8)
        try:
            status = self.read_into([key], np.array([buf.ctypes.data], np.uint64),
                                    np.array([buf.size], np.uint64), verify=verify)
        except ValueError:  # its size changed between the look and the read
            return None
        return BlockView(buf, bytes(loc[6])) if status[0] == 1 else None

    def _release_now(self, leases: Sequence[tuple[int, ...]]) -> None:
        if leases:
            self._ix.release(np.array([f[0] for f in leases], np.uint64),
                             np.array([f[1] for f in leases], np.uint64))

    def _slab_path(self, slab: int, gen: int) -> str:
        path = self._paths.get((slab, gen))
        if path is None:
            path = self._paths[(slab, gen)] = self._ix.slab_file(slab, gen)
        return path

    def get_into(self, keys: Sequence[bytes], outs: Sequence[np.ndarray], *,
                 verify: bool = True) -> list[bool]:
        """Copy each block into the uint8 array of its size in ``outs``; returns for each
        key whether it was found (an absent key's out is left alone). Corrupt blocks
        are dropped and raise KVCorrupt (their outs then hold the bad bytes)."""
        keys = check_keys(keys)
        if len(outs) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(outs)} output buffers")
        dsts = [as_bytes(o) for o in outs]
        for d in dsts:
            if not d.flags.writeable:
                raise ValueError("an output buffer is read-only")
        addrs = np.fromiter((d.ctypes.data for d in dsts), np.uint64, len(dsts))
        sizes = np.fromiter((d.size for d in dsts), np.uint64, len(dsts))
        status = self.read_into(keys, addrs, sizes, verify=verify)
        del dsts
        return (status == 1).tolist()

    def read_into(self, keys: Sequence[bytes], addrs: Any, sizes: Any, *,
                  verify: bool = True) -> np.ndarray:
        """Copy each block to ``sizes[i]`` bytes at the raw address ``addrs[i]`` (uint64
        arrays; no Python object per block). Returns a uint8 array: 1 copied, 0 absent
        (its destination untouched). ValueError, before anything is copied, for a block
        whose size is not its destination's; KVCorrupt for blocks that failed their
        checksums (dropped). The caller keeps the destinations alive during the call."""
        n = len(keys)
        addrs = _u64(addrs, n, "addresses")
        sizes = _u64(sizes, n, "sizes")
        with self._lock:
            self._check_pid()
            self._views.flush(self._ix)
            raw, bad_size = call_native(self._ix.read_into, keys, addrs, sizes, verify)
            self._forget_left()
        if bad_size >= 0:
            loc = self._ix.locate(check_keys([keys[bad_size]])[0])
            held = loc[4] if loc is not None else "another number of"
            raise ValueError(f"block {keys[bad_size].hex()} holds {held} bytes; its output "
                             f"buffer {int(sizes[bad_size])}")
        status = np.frombuffer(raw, dtype=np.uint8)
        if (status == 2).any():
            raise KVCorrupt([keys[int(i)] for i in np.flatnonzero(status == 2)])
        return status

    def _adjust_pins(self, keys: Sequence[bytes], delta: int) -> int:
        keys = check_keys(keys)
        with self._lock:
            self._check_pid()
            n = int(self._ix.pin(keys, delta))
            self._forget_left()
            return n

    def pin(self, keys: Sequence[bytes]) -> int:
        """Protect the blocks from eviction (counted: each pin needs an unpin). Pins are
        not tied to the process. A pin brings a spilled block back into memory where
        there is room. Returns how many keys were present and pinned."""
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
            self._views.flush(self._ix)
            n = int(self._ix.delete(keys))
            self._forget_left()
            return n

    def locate(self, key: bytes) -> tuple[str, Path, int, int] | None:
        """Where a block's bytes are: (tier, file, offset, nbytes), for tests and tools."""
        (key,) = check_keys([key])
        self._check_pid()
        loc = self._ix.locate(key)
        if loc is None:
            return None
        tier, slab, gen, offset, nbytes, spill, _ = loc
        if tier == "disk":
            return "disk", Path(spill), 0, int(nbytes)
        return "host", Path(self._slab_path(slab, gen)), int(offset), int(nbytes)

    def keep_mappings(self) -> int:
        """Hand this process's mappings of the slabs to its kept mappings of pooled files
        (``kept_mappings``): call it just before ``close`` when the slab files are going
        to the pool (``quiescent``). A slab of any store of this process that claims one
        of those files back takes its mapping as it is, page tables filled, instead of
        mapping the file again: half of a new namespace's first put + get otherwise.
        Returns how many were kept."""
        with self._lock:
            self._check_pid()
            return int(self._ix.keep_maps())

    def quiescent(self) -> bool:
        """Whether no other live process has the store open and no view of a block is
        held: then, once closed, its slab files may be recycled (``slab_files``)."""
        self._check_pid()
        with self._lock:
            self._views.flush(self._ix)
            return bool(self._ix.quiescent())

    def slab_files(self) -> list[Path]:
        """The arena's slab files."""
        return sorted((self.root / "slabs").glob("*.slab"))

    def meta(self, key: bytes) -> bytes | None:
        """The metadata a readable block was put with; None when absent."""
        (key,) = check_keys([key])
        self._check_pid()
        loc = self._ix.locate(key)
        return None if loc is None else bytes(loc[6])

    def release_pending(self) -> None:
        """Drop the read leases of views this process no longer holds (else done at its
        next call into the store)."""
        with self._lock:
            self._check_pid()
            self._views.flush(self._ix)

    def stats(self, *, bloom_fp: float = 0.01) -> KVStats:
        """Counters shared by every process of the store, and a Bloom filter of its keys."""
        with self._lock:
            self._check_pid()
            self._views.flush(self._ix)
            c = self._ix.stats()
            n = c["host_blocks"] + c["disk_blocks"]
            nbits, k = bloom_size(n, bloom_fp)
            bloom = self._ix.bloom(nbits, k)
            if self._gpu is None and self._ix.settings()[3]:  # another process has a tier
                self._gpu_part()
            g = self._gpu.counters() if self._gpu is not None else {}
        return KVStats(blocks=n, nbytes=c["host_bytes"] + c["disk_bytes"],
                       host_blocks=c["host_blocks"], host_bytes=c["host_bytes"],
                       disk_blocks=c["disk_blocks"], disk_bytes=c["disk_bytes"],
                       capacity=self.capacity, arena_bytes=c["arena_bytes"],
                       pinned=c["pinned"], hits=c["hits"], misses=c["misses"],
                       evictions=c["evictions"], spills=c["spills"], corrupt=c["corrupt"],
                       bloom=bloom, bloom_hashes=k, gpu_blocks=g.get("gpu_blocks", 0),
                       gpu_bytes=g.get("gpu_bytes", 0),
                       gpu_capacity=self._gpu.capacity if self._gpu is not None else 0,
                       gpu_arena_bytes=g.get("gpu_arena_bytes", 0),
                       gpu_hits=g.get("gpu_hits", 0),
                       gpu_evictions=g.get("gpu_evictions", 0))

    def index_stats(self) -> dict[str, int]:
        """The native index's own counters (``stats`` plus its records, their capacity
        and the scans for dead processes' leases and chunks), for tests and tools."""
        self._check_pid()
        return dict(self._ix.stats())

    # -- events ----------------------------------------------------------------------
    def events_claim(self) -> tuple[list[RawEvent], int, int, int] | None:
        """Become the store's event publisher (one process per store): from now on every
        block that enters or leaves the store is written to the store's event ring.
        None while another live process publishes. Else ``(snapshot, pos, lost, seq)``:
        every readable block as a stored event, the ring position it was taken at (read
        on from there), the count of lost events so far, and the sequence number the
        last publisher reached. Claiming again (the publisher itself) takes a fresh
        snapshot: after an overrun, a lost event or a cleared event."""
        with self._lock:
            self._check_pid()
            got = self._ix.events_claim()
        if got is None:
            return None
        snap, pos, lost, seq = got
        return snap, int(pos), int(lost), int(seq)

    def events_read(self, pos: int, max_bytes: int, seq: int
                    ) -> tuple[list[RawEvent], int, int, bool] | None:
        """The events since ring position ``pos`` (about ``max_bytes`` of them at most):
        ``(events, pos, lost, overrun)``, each event ``(type, medium, key, meta)`` with
        ``type`` one of ``EVENT_STORED``, ``EVENT_REMOVED``, ``EVENT_CLEARED`` and
        ``medium`` ``MEDIUM_HOST`` or ``MEDIUM_DISK``. ``overrun``: the ring was
        overwritten past ``pos``: claim again for a snapshot. None once this process is
        no longer the publisher. ``seq`` (the publisher's next sequence number) is kept
        for whoever publishes next."""
        with self._lock:
            self._check_pid()
            got = self._ix.events_read(pos, max_bytes, seq)
        if got is None:
            return None
        events, new_pos, lost, overrun = got
        return events, int(new_pos), int(lost), bool(overrun)

    def events_take(self, pos: int, max_events: int, seq: int
                    ) -> tuple[bytes, int, int, int, bool] | None:
        """``events_read`` in bulk: ``(records, count, pos, lost, overrun)``, the
        ``count`` events since ring position ``pos`` (at most ``max_events``) as the ring
        holds them, one bytes object of neutral records (``storage_engine/kv/layout.h``'s
        ``evh_t``: its length, the metadata's, type, medium and key length, then the key
        and the metadata, padded to 8 bytes), for a caller that encodes them in bulk
        (``tensordb.client._kv_wire``). None once this process is no longer the
        publisher."""
        with self._lock:
            self._check_pid()
            got = self._ix.events_take(pos, max_events, seq)
        if got is None:
            return None
        records, count, new_pos, lost, overrun = got
        return records, int(count), int(new_pos), int(lost), bool(overrun)

    def events_release(self) -> None:
        """Stop publishing (events are no longer written until a process claims)."""
        with self._lock:
            if os.getpid() == self._pid:
                self._ix.events_release()

    # -- host reads for the GPU tier ----------------------------------------------------
    def lease_host(self, keys: list[bytes]) -> tuple[list[Any], list[bytes]]:
        """Lease the host copies of ``keys`` (promoting spilled ones): per key None or
        (idx, gen, slab, slab_gen, offset, nbytes, csum, meta), and the keys whose
        spilled copy failed its checksum (dropped). Give them back with ``end_host``."""
        found = self._ix.lease(keys)
        self._forget_left()
        bad = [k for k, f in zip(keys, found, strict=True) if f == -1]
        return [f if isinstance(f, tuple) else None for f in found], bad

    def host_bytes(self, f: tuple[Any, ...]) -> np.ndarray:
        """The bytes of a chunk leased by ``lease_host``, through a shared mapping."""
        path = self._slab_path(f[2], f[3])
        restore_slab(path, f[4] + f[5])
        with open(path, "r+b") as fh:
            mm = mmap.mmap(fh.fileno(), f[4] + f[5], access=mmap.ACCESS_READ)
        return np.frombuffer(mm, dtype=np.uint8, count=f[5], offset=f[4])

    def end_host(self, found: list[Any], bad: list[tuple[bytes, Any]],
                 bad_promotions: list[bytes]) -> None:
        """Give back the leases of ``lease_host``, drop the blocks in ``bad`` (key, entry)
        that failed their checksum, and raise KVCorrupt naming them and the spilled
        blocks that failed on their way up."""
        for _, f in bad:
            self._ix.drop_corrupt(f[0], f[1])
        self._release_now([f for f in found if f is not None])
        self._forget_left()
        if bad or bad_promotions:
            raise KVCorrupt(bad_promotions + [k for k, _ in bad])

    # -- the GPU tier ------------------------------------------------------------------
    @property
    def gpu_enabled(self) -> bool:
        return self._gpu is not None and self._gpu.enabled

    @property
    def gpu_device(self) -> int | None:
        return self._gpu.device if self._gpu is not None else None

    @property
    def gpu_capacity(self) -> int:
        return self._gpu.capacity if self._gpu is not None else 0

    def _need_gpu(self) -> GpuPart:
        if not self.gpu_enabled:
            raise ValueError("this store was opened without a GPU tier (gpu_device)")
        assert self._gpu is not None
        return self._gpu

    def get_device(self, keys: Sequence[bytes], *, verify: bool = True
                   ) -> list[GpuBlockView | None]:
        """Views of the blocks' GPU copies, copying a block up from the host first where
        it has none (verifying its checksum there). None where the block is absent, or
        where the tier has no room for it (then read it from the host). Raises KVCorrupt
        as ``get`` does."""
        keys = check_keys(keys)
        gpu = self._need_gpu()
        with self._lock:
            self._check_pid()
            return gpu.get_device(keys, verify)

    def admit_device(self, keys: Sequence[bytes], srcs: Sequence[tuple[int, int, int]]
                     ) -> int:
        """Give blocks already stored a GPU copy, copied device to device from
        ``(ptr, nbytes, device)`` (the tensors they were put from). Blocks absent from
        the store, of another size, or copied already are skipped; so is the rest when
        the tier has no room. Returns how many got a copy."""
        keys = check_keys(keys)
        gpu = self._need_gpu()
        if len(srcs) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(srcs)} sources")
        with self._lock:
            self._check_pid()
            return gpu.admit_device(keys, list(srcs))

    def get_into_device(self, keys: Sequence[bytes], dsts: Sequence[tuple[int, int]], *,
                        verify: bool = True) -> list[bytes | None]:
        """Copy each block into device memory at ``(ptr, nbytes)``: from its GPU copy
        (device to device) where it has one, else from the host (checksum verified
        first). Returns each block's metadata, None where absent. Admits nothing."""
        keys = check_keys(keys)
        gpu = self._need_gpu()
        if len(dsts) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(dsts)} output buffers")
        with self._lock:
            self._check_pid()
            return gpu.get_into_device(keys, list(dsts), verify)

    def gpu_locate(self, key: bytes) -> tuple[int, int, int] | None:
        """Where a block's GPU copy is: (slab, offset, nbytes), for tests and tools."""
        self._check_pid()
        return self._gpu_part().locate(check_keys([key])[0])
