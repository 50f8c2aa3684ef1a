"""The byte-moving paths of the KV block store: copies run outside LMDB's write lock.

``HostCopies``: a put is two short write transactions around the copy (reserve, then
publish), so writers copy in parallel; a read leases the chunks in one write
transaction, then maps or copies them, verifying checksums, and gives the leases back.
``DeviceCopies``: the same for the GPU tier.

* ``get_device``: a block read for the GPU is copied up (host to device, its checksum
  verified on the host first) and kept, so the next reader on the host maps it with no
  copy at all;
* ``admit_device``: blocks an engine stored from device memory are copied device to
  device beside the host copy ``put`` made;
* ``get_into_device`` copies into an engine's own device buffers (its paged KV) from
  the GPU copy when there is one, else from the host arena, and admits nothing. When
  the tier has no room (every chunk being read) a block stays host-only and
  ``get_device`` returns None for it: the caller copies from the host.

The caller (``BlockStore``) holds the store's lock and has checked the inputs.
"""

from __future__ import annotations

import weakref

import numpy as np

from ._checksum import checksum, copy, copy_and_checksum
from ._cuda import memcpy, on_device, synchronize
from ._kv_arena import HostArena
from ._kv_blocks import BlockTable
from ._kv_gpu import GpuBlockCache, GpuBlockView
from ._kv_index import KVIndex, ReadLeases
from ._kv_types import Alive, BlockView, KVCorrupt, Leased, each

__all__: list[str] = []  # parts of BlockStore, nothing public

#: blocks that failed their checksum: (key, (slab, chunk))
Bad = list[tuple[bytes, tuple[int, int]]]


class HostCopies:
    """Copies between callers' host buffers and the host arena."""

    def __init__(self, index: KVIndex, leases: ReadLeases, arena: HostArena,
                 blocks: BlockTable) -> None:
        self._index = index
        self._leases = leases
        self._arena = arena
        self._blocks = blocks

    def flush_releases(self) -> None:
        """Drop from the index the leases of views this process let go of."""
        if self._leases.pending:
            with self._index.write():
                pass

    def put(self, keys: list[bytes], srcs: list[np.ndarray], metas: list[bytes]
            ) -> list[bool]:
        """Store a batch that fits the arena: True where this call stored the key."""
        alive: Alive = {}
        sizes = [s.size for s in srcs]
        with self._index.write() as txn:
            reserved = self._blocks.reserve(txn, keys, sizes, metas, alive)
        if not reserved:
            return [False] * len(keys)
        sums: list[bytes] = []
        try:
            dsts = self._blocks.destinations(reserved, sizes)
            pairs = [(dst, srcs[i]) for (i, *_), dst in zip(reserved, dsts, strict=True)]
            sums = [bytes.fromhex(h) for h in each(
                copy_and_checksum, pairs, sum(d.size for d in dsts))]
        finally:
            with self._index.write() as txn:
                self._blocks.publish(txn, reserved, sizes, metas, sums, alive)
        stored = [False] * len(keys)
        for i, *_ in reserved:
            stored[i] = True
        return stored

    def get(self, keys: list[bytes], verify: bool) -> list[BlockView | None]:
        found, bad_promotions = self._blocks.acquire(keys)
        arrs = [None if f is None else self._arena.private_bytes(f[0], f[2], f[3])
                for f in found]
        live = [a for a in arrs if a is not None]
        sums = iter(each(checksum, [(a,) for a in live], sum(a.size for a in live))
                    if verify else [])
        out: list[BlockView | None] = []
        bad: Bad = []
        for key, f, arr in zip(keys, found, arrs, strict=True):
            if f is None or arr is None:
                out.append(None)
                continue
            slab, chunk, _, _, csum, meta = f
            if verify and bytes.fromhex(next(sums)) != csum:
                bad.append((key, (slab, chunk)))
                self._leases.release((slab, chunk))
                out.append(None)
                continue
            weakref.finalize(arr, self._leases.release, (slab, chunk))
            out.append(BlockView(arr, meta))
        if bad:
            self._blocks.drop_corrupt(bad)
        if bad or bad_promotions:
            raise KVCorrupt(bad_promotions + [k for k, _ in bad])
        return out

    def get_into(self, keys: list[bytes], dsts: list[np.ndarray], verify: bool
                 ) -> list[bytes | None]:
        found, bad_promotions = self._blocks.acquire(keys)
        metas: list[bytes | None] = []
        bad: Bad = []
        try:
            jobs: list[tuple[np.ndarray, np.ndarray]] = []
            for key, f, dst in zip(keys, found, dsts, strict=True):
                if f is None:
                    metas.append(None)
                    continue
                nbytes, meta = f[3], f[5]
                if dst.size != nbytes:
                    raise ValueError(f"block {key.hex()} holds {nbytes} bytes; its "
                                     f"output buffer {dst.size}")
                jobs.append((dst, self._arena.shared_bytes(f[0], f[2], nbytes)))
                metas.append(meta)
            total = sum(d.size for d, _ in jobs)
            if verify:
                sums = iter(each(copy_and_checksum, jobs, total))
                for key, f in zip(keys, found, strict=True):
                    if f is not None and bytes.fromhex(next(sums)) != f[4]:
                        bad.append((key, f[:2]))
            else:
                each(copy, jobs, total)
        finally:
            self.end_reads(found, bad, bad_promotions)
        return metas

    def leased_bytes(self, f: Leased) -> np.ndarray:
        """The bytes of a chunk leased by ``acquire`` (``f`` is its entry), through this
        process's shared mapping of the slab."""
        return self._arena.shared_bytes(f[0], f[2], f[3])

    def end_reads(self, found: list[Leased | None], bad: Bad, bad_promotions: list[bytes],
                  *, flush: bool = True) -> None:
        """After reading chunks leased by ``acquire``: give the leases back (at once
        with ``flush``, else at the next write), drop the blocks in ``bad`` that failed
        their checksum, and raise KVCorrupt naming them and the disk blocks that failed
        on their way up."""
        for f in found:
            if f is not None:
                self._leases.release(f[:2])
        if bad:
            self._blocks.drop_corrupt(bad)
        elif flush:
            self.flush_releases()
        if bad or bad_promotions:
            raise KVCorrupt(bad_promotions + [k for k, _ in bad])


class DeviceCopies:
    """Copies into, out of and through the GPU tier (see the module docstring)."""

    def __init__(self, host: HostCopies, blocks: BlockTable, gpu: GpuBlockCache) -> None:
        self._host = host
        self._blocks = blocks
        self._gpu = gpu

    def get_device(self, keys: list[bytes], verify: bool) -> list[GpuBlockView | None]:
        out = self._gpu.lease_all(keys)
        miss = [i for i, v in enumerate(out) if v is None]
        if not miss:
            return out
        found, bad_promotions = self._blocks.acquire([keys[i] for i in miss])
        bad: Bad = []
        try:
            fmap = {i: f for i, f in zip(miss, found, strict=True) if f is not None}
            srcs = {i: self._host.leased_bytes(f) for i, f in fmap.items()}
            up = list(srcs)
            if verify and up:
                sums = each(checksum, [(srcs[i],) for i in up],
                            sum(s.size for s in srcs.values()))
                for i, s in zip(up, sums, strict=True):
                    if bytes.fromhex(s) != fmap[i][4]:
                        bad.append((keys[i], fmap[i][:2]))
                        del srcs[i]
                up = list(srcs)

            def copy_up(j: int, dst: int, device: int) -> None:
                src = srcs[up[j]]
                with on_device(device):
                    memcpy(dst, src.ctypes.data, src.size, "cudaMemcpyHostToDevice")

            self._gpu.fill([(keys[i], srcs[i].size) for i in up], copy_up)
        finally:  # the next lease flushes the leases given back
            self._host.end_reads(found, bad, bad_promotions, flush=False)
        again = self._gpu.lease_all([keys[i] for i in miss], hits=False)
        for i, v in zip(miss, again, strict=True):
            out[i] = v
        return out

    def admit_device(self, keys: list[bytes], srcs: list[tuple[int, int, int]]) -> int:
        def copy_across(j: int, dst: int, device: int) -> None:
            ptr, n, _ = srcs[j]
            with on_device(device):
                memcpy(dst, ptr, n, "cudaMemcpyDeviceToDevice")

        return sum(self._gpu.fill([(k, int(s[1])) for k, s in zip(keys, srcs, strict=True)],
                                  copy_across))

    def get_into_device(self, keys: list[bytes], dsts: list[tuple[int, int]], verify: bool
                        ) -> list[bytes | None]:
        views = self._gpu.lease_all(keys)
        metas: list[bytes | None] = [None] * len(keys)
        try:
            devices = set()
            for i, v in enumerate(views):
                if v is None:
                    continue
                if dsts[i][1] != v.nbytes:
                    raise ValueError(f"block {keys[i].hex()} holds {v.nbytes} bytes; "
                                     f"its output buffer {dsts[i][1]}")
                with on_device(v.device):
                    memcpy(dsts[i][0], v.ptr, v.nbytes, "cudaMemcpyDeviceToDevice")
                devices.add(v.device)
                metas[i] = v.meta
            for dev in devices:
                synchronize(dev)  # the chunks may be reused once the views go
        finally:
            del views
        miss = [i for i, m in enumerate(metas) if m is None]
        if miss:
            got = self._host_to_device([keys[i] for i in miss], [dsts[i] for i in miss],
                                       verify)
            for i, m in zip(miss, got, strict=True):
                metas[i] = m
        return metas

    def _host_to_device(self, keys: list[bytes], dsts: list[tuple[int, int]], verify: bool
                        ) -> list[bytes | None]:
        found, bad_promotions = self._blocks.acquire(keys)
        metas: list[bytes | None] = []
        bad: Bad = []
        try:
            for key, f, (ptr, n) in zip(keys, found, dsts, strict=True):
                if f is None:
                    metas.append(None)
                    continue
                slab, chunk, _, nbytes, csum, meta = f
                if n != nbytes:
                    raise ValueError(f"block {key.hex()} holds {nbytes} bytes; its output "
                                     f"buffer {n}")
                src = self._host.leased_bytes(f)
                if verify and bytes.fromhex(checksum(src)) != csum:
                    bad.append((key, (slab, chunk)))
                    metas.append(None)
                    continue
                with on_device(self._gpu.device or 0):
                    memcpy(ptr, src.ctypes.data, nbytes, "cudaMemcpyHostToDevice")
                metas.append(meta)
        finally:
            self._host.end_reads(found, bad, bad_promotions)
        return metas
