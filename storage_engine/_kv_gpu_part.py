"""The GPU tier of a KV block store, as one part: its LMDB index, read leases, device
slabs and block copies, and the copies into, out of and through it.

* ``get_device``: a block read for the GPU is copied up (host to device, its checksum
  verified on the host first) and kept, so the next reader on the host maps it with no
  copy at all;
* ``admit_device``: blocks an engine stored from device memory are copied device to
  device beside the host copy ``put`` made;
* ``get_into_device`` copies into an engine's own device buffers (its paged KV) from
  the GPU copy when there is one, else from the host arena, and admits nothing. When
  the tier has no room (every chunk being read) a block stays host-only and
  ``get_device`` returns None for it: the caller copies from the host.

The host copies are the store's (``HostReads``: leases on the native index's records);
the caller (``BlockStore``) holds the store's lock and has checked the inputs.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import lmdb
import numpy as np

from ._checksum import checksum
from ._cuda import memcpy, on_device, synchronize
from ._kv_gpu import GpuBlockCache, GpuBlockView, GpuSlabs, HostRecord
from ._kv_index import KVIndex, ReadLeases
from ._kv_types import GPU_BIT, Alive, KVIndexDamaged, each

__all__: list[str] = []  # a part of BlockStore, nothing public

_COUNTERS = ("gpu_blocks", "gpu_bytes", "gpu_arena_bytes", "gpu_hits", "gpu_evictions")


class HostReads(Protocol):
    """The host side a GPU copy is made from (``BlockStore``)."""

    def lease_host(self, keys: list[bytes]) -> tuple[list[Any], list[bytes]]: ...

    def host_bytes(self, f: tuple[Any, ...]) -> np.ndarray: ...

    def end_host(self, found: list[Any], bad: list[tuple[bytes, Any]],
                 bad_promotions: list[bytes]) -> None: ...


class GpuPart:
    """The GPU tier of one store in this process (see the module docstring)."""

    check_options: Callable[[int | None, int | None], None] = \
        staticmethod(GpuSlabs.check_options)

    def __init__(self, root: Path, map_size: int, *, device: int | None,
                 capacity: int | None, slab_bytes: int, host: HostRecord,
                 reads: HostReads) -> None:
        (root / "index").mkdir(exist_ok=True, mode=0o700)
        self._index = KVIndex(root / "index", map_size=map_size)
        self._reads = reads
        try:
            self._index.open()
        except lmdb.Error as exc:  # not LMDB any more (truncated, overwritten)
            raise KVIndexDamaged(str(root / "index"), type(exc).__name__) from exc
        self._leases = ReadLeases(self._index, release=self._release_chunk)
        self._slabs = GpuSlabs(self._index, root / "gpu", device=device, capacity=capacity,
                               slab_bytes=slab_bytes)
        self._cache = GpuBlockCache(self._index, self._leases, self._slabs, host)
        self._index.hooks = [self._leases, self._slabs]
        self._bind()

    def _bind(self) -> None:
        index = self._index
        index.open_dbs(["counters", "settings", *ReadLeases.DB_NAMES, *GpuSlabs.DB_NAMES,
                        *GpuBlockCache.DB_NAMES])
        self._cache.bind()
        with index.env.begin(write=True) as txn:
            self._slabs.bind(txn)

    def reopen(self) -> None:
        """After a fork: LMDB environments do not survive one."""
        self._index.open()
        self._leases.reset()
        self._bind()

    def _release_chunk(self, txn: lmdb.Transaction, slab: int, chunk: int) -> None:
        assert slab & GPU_BIT, "the tier's leases are on device chunks only"
        self._slabs.release_chunk(txn, slab, chunk)

    def close(self) -> None:
        self._index.close()
        self._slabs.close()

    @property
    def enabled(self) -> bool:
        return self._cache.enabled

    @property
    def device(self) -> int | None:
        return self._cache.device

    @property
    def capacity(self) -> int:
        return self._cache.capacity

    def counters(self) -> dict[str, int]:
        if self._leases.pending:
            with self._index.write():
                pass
        index = self._index
        with index.env.begin() as txn:
            return {name: index.counter(txn, name, 0) for name in _COUNTERS}

    def forget(self, keys: list[bytes]) -> None:
        """Drop the GPU copies of blocks that left the store."""
        alive: Alive = {}
        with self._index.write() as txn:
            for key in keys:
                self._cache.forget(txn, key, alive)

    def locate(self, key: bytes) -> tuple[int, int, int] | None:
        return self._cache.locate(key)

    # -- copies ----------------------------------------------------------------------
    def get_device(self, keys: list[bytes], verify: bool) -> list[GpuBlockView | None]:
        out = self._cache.lease_all(keys)
        miss = [i for i, v in enumerate(out) if v is None]
        if not miss:
            return out
        found, bad_promotions = self._reads.lease_host([keys[i] for i in miss])
        bad: list[tuple[bytes, Any]] = []
        try:
            fmap = {i: f for i, f in zip(miss, found, strict=True) if f is not None}
            srcs = {i: self._reads.host_bytes(f) for i, f in fmap.items()}
            up = list(srcs)
            if verify and up:
                sums = each(checksum, [(srcs[i],) for i in up],
                            sum(s.size for s in srcs.values()))
                for i, s in zip(up, sums, strict=True):
                    if int(s, 16) != fmap[i][6]:
                        bad.append((keys[i], fmap[i]))
                        del srcs[i]
                up = list(srcs)

            def copy_up(j: int, dst: int, device: int) -> None:
                src = srcs[up[j]]
                with on_device(device):
                    memcpy(dst, src.ctypes.data, src.size, "cudaMemcpyHostToDevice")

            self._cache.fill([(keys[i], srcs[i].size) for i in up], copy_up)
        finally:
            self._reads.end_host(found, bad, bad_promotions)
        again = self._cache.lease_all([keys[i] for i in miss], hits=False)
        for i, v in zip(miss, again, strict=True):
            out[i] = v
        return out

    def admit_device(self, keys: list[bytes], srcs: list[tuple[int, int, int]]) -> int:
        def copy_across(j: int, dst: int, device: int) -> None:
            ptr, n, _ = srcs[j]
            with on_device(device):
                memcpy(dst, ptr, n, "cudaMemcpyDeviceToDevice")

        return sum(self._cache.fill([(k, int(s[1])) for k, s in zip(keys, srcs, strict=True)],
                                    copy_across))

    def get_into_device(self, keys: list[bytes], dsts: list[tuple[int, int]], verify: bool
                        ) -> list[bytes | None]:
        views = self._cache.lease_all(keys)
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
        found, bad_promotions = self._reads.lease_host(keys)
        metas: list[bytes | None] = []
        bad: list[tuple[bytes, Any]] = []
        try:
            for key, f, (ptr, n) in zip(keys, found, dsts, strict=True):
                if f is None:
                    metas.append(None)
                    continue
                nbytes, csum, meta = f[5], f[6], f[7]
                if n != nbytes:
                    raise ValueError(f"block {key.hex()} holds {nbytes} bytes; its output "
                                     f"buffer {n}")
                src = self._reads.host_bytes(f)
                if verify and int(checksum(src), 16) != csum:
                    bad.append((key, f))
                    metas.append(None)
                    continue
                with on_device(self._cache.device or 0):
                    memcpy(ptr, src.ctypes.data, nbytes, "cudaMemcpyHostToDevice")
                metas.append(meta)
        finally:
            self._reads.end_host(found, bad, bad_promotions)
        return metas
