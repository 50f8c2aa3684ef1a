"""KV cache blocks of one model/layout: ``db.kv(namespace, block_tokens=256)``.

A namespace is a ``storage_engine.BlockStore`` of its own, under the store's shared
memory (``<shm_dir>/kv/<namespace>``) spilling to its data directory
(``<data_dir>/kv/<namespace>``). Every process of the host that opens the namespace
shares its blocks: one writes, the others match and map them zero-copy.

Blocks are not catalog rows (there are too many, too short-lived); the catalog only
records each namespace per node (table ``kv_namespaces``) with its size as of the last
``stats()``. ``KVCache`` is the handle; the namespace's registration and store are
``KVNamespace``'s (``_kv_namespace``), the keys and block records ``_kv_encoding``'s.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import pyarrow as pa
import torch

from storage_engine import BlockStore, BlockView, GpuError
from tensordb.arrow import blocks_table
from tensordb.errors import CorruptData, InvalidInput, NotFound, StoreClosed, StoreFull

from ._kv_encoding import (
    EncodedBlocks,
    KeyChain,
    block_meta,
    decode_meta,
    encode_blocks,
    meta_fields,
)
from ._kv_events import (
    KVBlockInfo,
    KVEventPublisher,
    KVEvents,
    close_publisher,
    encode_info,
    join_meta,
    open_publisher,
)
from ._kv_namespace import KVNamespace, KVNodeSummary, typed_errors
from ._placement import device_of

if TYPE_CHECKING:
    from pathlib import Path

    from ._database import Database

__all__ = ["KVCache"]

log = logging.getLogger("tensordb.kv")


class KVCache:
    """The KV blocks of one namespace (model and layout) on this node.

    Open it with ``db.kv(namespace, block_tokens=...)``; one per process (a forked child
    reopens its own store transparently). Methods are thread-safe; ``match`` never
    blocks, the others hold the store's write lock for microseconds per block.
    """

    db: Database
    namespace: str
    block_tokens: int
    node: str
    shm_dir: Path
    disk_dir: Path
    store: BlockStore

    def __init__(self, db: Database, namespace: str, block_tokens: int = 256, *,
                 capacity_bytes: int | None = None, eviction: str | None = None,
                 slab_bytes: int = 64 << 20, spill: bool = True,
                 disk_capacity: int | None = None, gpu_capacity: int | None = None,
                 policy: str | None = None, create: bool = True,
                 events: str | KVEvents | dict[str, Any] | None = None) -> None:
        events_config = KVEvents.of(events, namespace)
        ns = KVNamespace(db.config, db.catalog, db.tier("host"), namespace, block_tokens,
                         capacity_bytes=capacity_bytes, eviction=eviction,
                         slab_bytes=slab_bytes, spill=spill, disk_capacity=disk_capacity,
                         gpu_capacity=gpu_capacity, policy=policy, create=create)
        self._ns = ns
        self._chain = KeyChain(namespace, block_tokens)
        # the public attributes, copied from the namespace: plain reads on every call
        self.db, self.namespace, self.block_tokens = db, namespace, block_tokens
        self.node, self.shm_dir, self.disk_dir = ns.node, ns.shm_dir, ns.disk_dir
        self.store = ns.store
        self._closed = False
        #: this process's publisher of the namespace's KV events (``events=``)
        self.events: KVEventPublisher | None = None
        if events_config is not None:
            try:
                self.events = open_publisher(ns.store, namespace, block_tokens, events_config)
            except BaseException:
                ns.close()
                raise

    # -- keys ----------------------------------------------------------------------
    def keys(self, token_ids: Any, *, parent: bytes | None = None) -> list[bytes]:
        """One 16-byte key per *full* block of ``token_ids``: xxh3-128 chained over the
        previous key and the block's tokens (little-endian int64), seeded by the
        namespace and block size, so a key names the whole prefix up to its block.
        ``parent`` continues a chain from a key returned earlier. Stable across
        processes, hosts and Python hash seeds."""
        return self._chain.keys(token_ids, parent)

    # -- blocks --------------------------------------------------------------------
    def put(self, keys: Sequence[bytes], blocks: Sequence[torch.Tensor] | torch.Tensor, *,
            info: Sequence[KVBlockInfo | None] | None = None) -> int:
        """Store one tensor per key (any dtype and shape; GPU tensors are copied down).
        ``blocks`` is a sequence of tensors, or one tensor whose first dimension runs
        over the keys (a batch: ``blocks[i]`` is key i's block; no Python object per
        block). First writer wins: a key already present is left as it is, without
        error. Returns how many blocks this call stored. Raises StoreFull, storing none
        of the batch, when the arena is full of pinned blocks and blocks being read.
        With a GPU tier, CUDA blocks also leave a copy there (device to device), for
        readers on the GPU. ``info``: what the engine knows of each block (its block
        hashes, tokens, parent), kept with the block for the namespace's KV events."""
        keys = self._chain.check(keys)
        infos = self._infos(keys, info)
        store = self._store()
        if isinstance(blocks, torch.Tensor):
            enc = self._stacked(keys, blocks, store.capacity)
        elif isinstance(blocks, (str, bytes)) or len(blocks) != len(keys):
            raise InvalidInput(f"put takes one tensor per key: {len(keys)} keys",
                               collection=self.namespace)
        else:
            enc = encode_blocks(blocks, self.namespace, store.capacity, self.node)
        if infos is not None:
            metas = enc.metas
            enc = dataclasses.replace(enc, metas=[
                join_meta(metas if isinstance(metas, bytes) else metas[i], raw)
                for i, raw in enumerate(infos)])
        with self._errors():  # StoreFull, CorruptData (damaged)
            stored = int(store.put_batch(keys, enc.addrs, enc.sizes, enc.metas).sum())
        del enc.keep[:]  # the copies are done
        if self.events is not None:
            self.events.wake()  # this process publishes: out at once, not at the poll
        on_gpu = enc.on_gpu
        if on_gpu and store.gpu_enabled:  # .cpu() in encode_blocks synchronised their stream
            try:
                store.admit_device([keys[i] for i, _ in on_gpu],
                                   [(t.data_ptr(), t.numel() * t.element_size(),
                                     t.device.index) for _, t in on_gpu])
            except GpuError as exc:  # the device copy is a cache: the blocks are stored
                log.warning("KV namespace %r: no GPU copies of %d blocks: %s",
                            self.namespace, len(on_gpu), exc)
        return stored

    def _infos(self, keys: list[bytes], info: Sequence[KVBlockInfo | None] | None
               ) -> list[bytes] | None:
        """Each block's info as the store keeps it (b"" for none); InvalidInput, before
        anything is stored, for a wrong count or a bad field."""
        if info is None:
            return None
        if isinstance(info, (str, bytes, KVBlockInfo)) or len(info) != len(keys):
            raise InvalidInput(f"put takes one info (or None) per key: {len(keys)} keys",
                               collection=self.namespace)
        return [b"" if x is None else encode_info(x, f"info[{i}]", self.block_tokens)
                for i, x in enumerate(info)]

    def _stacked(self, keys: list[bytes], blocks: torch.Tensor, limit: int) -> EncodedBlocks:
        """A batch given as one tensor (first dimension: the keys), as ``put`` stores it:
        one record for all, the blocks' addresses by arithmetic."""
        n = len(keys)
        if blocks.dim() < 1 or blocks.shape[0] != n or blocks.layout != torch.strided \
                or blocks.is_meta:
            raise InvalidInput(f"a batch of blocks is one dense tensor whose first dimension "
                               f"is the {n} keys, not of shape {tuple(blocks.shape)}",
                               collection=self.namespace)
        t = blocks.detach()
        on_gpu: list[tuple[int, torch.Tensor]] = []
        per = t[0].numel() * t.element_size() if n else 0
        if per > limit:
            raise StoreFull(f"KV namespace {self.namespace!r}: a block holds {per} bytes, "
                            f"more than the arena's {limit}", collection=self.namespace,
                            node=self.node)
        if t.device.type != "cpu":
            if t.device.type == "cuda":
                t = t.contiguous()
                on_gpu = [(i, t[i]) for i in range(n)]
            t = t.cpu()
        t = t.contiguous()
        meta = block_meta(t[0] if n else t.reshape(t.shape[1:]), self.namespace)
        addrs = np.arange(n, dtype=np.uint64) * np.uint64(per) + np.uint64(t.data_ptr())
        return EncodedBlocks([t], addrs, np.full(n, per, np.uint64), meta, on_gpu)

    @property
    def gpu_enabled(self) -> bool:
        """Whether this namespace has a GPU tier in this process (``gpu_capacity``)."""
        return self._store().gpu_enabled

    def match(self, keys: Sequence[bytes]) -> int:
        """How many leading keys are present (in memory or spilled to disk)."""
        keys = self._chain.check(keys)
        with self._errors():  # CorruptData: damaged files
            return self._store().match(keys)

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        """For each key, whether it is present (not only the leading run)."""
        keys = self._chain.check(keys)
        with self._errors():
            return self._store().contains(keys)

    def get(self, keys: Sequence[bytes], *, verify: bool = True,
            device: str | torch.device | None = None) -> list[torch.Tensor]:
        """Zero-copy tensors of the blocks, with the dtype and shape they were put with.
        Each maps its block copy-on-write: writing to it changes only the reader's copy.
        A block stays protected from eviction while its tensor is alive. Raises NotFound
        naming the first absent key, CorruptData when a block fails its checksum (the
        block is dropped from the store: a later ``match`` no longer counts it); never
        StoreFull: a spilled block the arena has no room to take back is served as a
        copy read from disk.

        ``device="cuda:N"``: tensors on the GPU. With a GPU tier they are zero-copy views
        of the blocks' GPU copies (made from the host copy on first read, then shared by
        every process of the host: read-only by convention); without one, or where the
        tier has no room, copies."""
        keys = self._chain.check(keys)
        if device is not None:
            dev = device_of(device, self.namespace)  # InvalidInput: not cpu/cuda, no CUDA
            if dev is not None and dev.type == "cuda":
                return self._get_cuda(keys, verify, dev)
        out = []
        for k, v in zip(keys, self._host_views(keys, verify), strict=True):
            try:
                dtype, shape = decode_meta(v.meta)
                out.append(torch.frombuffer(v.data, dtype=dtype).view(shape))
            except (CorruptData, ValueError, RuntimeError) as exc:  # a damaged record
                raise CorruptData(f"KV namespace {self.namespace!r}: block {k.hex()}: {exc}",
                                  collection=self.namespace, node=self.node,
                                  tensor=k.hex()) from exc
        return out

    def get_arrow(self, keys: Sequence[bytes], *, verify: bool = True) -> pa.Table:
        """The blocks as an Arrow table, a row per key: ``key`` (binary), ``dtype``,
        ``shape``, ``nbytes`` and ``data`` (large_binary, one chunk per block: the
        block's mapping, no copy). A block stays protected from eviction while its
        buffer is alive, as ``get``'s tensors keep it. Errors as ``get``."""
        keys = self._chain.check(keys)
        views = self._host_views(keys, verify)
        fields = [meta_fields(v.meta) for v in views]
        return blocks_table(keys, [f[0] for f in fields], [f[1] for f in fields],
                            [v.data for v in views], namespace=self.namespace)

    def _host_views(self, keys: list[bytes], verify: bool) -> list[BlockView]:
        """The blocks' host views (NotFound naming the first absent key)."""
        with self._errors():
            views = self._store().get(keys, verify=verify)
        for k, v in zip(keys, views, strict=True):
            if v is None:
                raise NotFound(f"KV block {k.hex()} is not in namespace {self.namespace!r}",
                               collection=self.namespace, tensor=k.hex())
        return cast("list[BlockView]", views)

    def _get_cuda(self, keys: list[bytes], verify: bool, dev: torch.device
                  ) -> list[torch.Tensor]:
        store = self._store()
        out: list[torch.Tensor | None] = [None] * len(keys)
        if store.gpu_enabled:
            with self._errors():
                views = store.get_device(keys, verify=verify)
            for i, v in enumerate(views):
                if v is not None:
                    dtype, shape = decode_meta(v.meta)
                    t = torch.as_tensor(v, device=f"cuda:{v.device}").view(dtype).view(shape)
                    out[i] = t if t.device == dev else t.to(dev)
        need = [i for i, t in enumerate(out) if t is None]
        if need:
            for i, t in zip(need, self.get([keys[i] for i in need], verify=verify), strict=True):
                out[i] = t.to(dev)
        return cast("list[torch.Tensor]", out)  # every slot is filled by now

    def get_batch(self, keys: Sequence[bytes], *, verify: bool = True) -> torch.Tensor:
        """The blocks as one new tensor whose first dimension runs over the keys (copied:
        no tensor or mapping per block), with the dtype and shape the first was put
        with. Raises NotFound naming the first absent key, InvalidInput when the blocks
        differ in size, CorruptData as ``get`` does."""
        keys = self._chain.check(keys)
        store = self._store()
        if not keys:
            raise InvalidInput("get_batch of no keys has no block shape",
                               collection=self.namespace)
        meta = store.meta(keys[0])
        if meta is None:
            raise NotFound(f"KV block {keys[0].hex()} is not in namespace "
                           f"{self.namespace!r}", collection=self.namespace,
                           tensor=keys[0].hex())
        dtype, shape = decode_meta(meta)
        out = torch.empty((len(keys), *shape), dtype=dtype)
        self.get_into(keys, out, verify=verify)
        return out

    def get_into(self, keys: Sequence[bytes], outs: Sequence[torch.Tensor] | torch.Tensor,
                 *, verify: bool = True) -> int:
        """Copy each block into its tensor in ``outs`` (same number of bytes; CPU or
        GPU, e.g. a slice of an engine's paged KV), or into one tensor whose first
        dimension runs over the keys (a batch: ``outs[i]`` gets key i's block, no Python
        object per block). Returns how many were copied; raises NotFound for an absent
        key and CorruptData as ``get`` does."""
        keys = self._chain.check(keys)
        if isinstance(outs, torch.Tensor) and outs.device.type == "cpu" \
                and outs.is_contiguous() and outs.dim() >= 1 and outs.shape[0] == len(keys):
            per = outs[0].numel() * outs.element_size() if keys else 0
            base = np.uint64(outs.data_ptr())
            addrs = np.arange(len(keys), dtype=np.uint64) * np.uint64(per) + base
            return self._read_into(keys, addrs, np.full(len(keys), per, np.uint64), verify)
        if isinstance(outs, torch.Tensor) and outs.dim() >= 1 and outs.shape[0] == len(keys):
            outs = list(outs.unbind(0))  # strided or on a GPU: a view per block
        if isinstance(outs, torch.Tensor) or len(outs) != len(keys):
            raise InvalidInput(f"get_into takes one output tensor per key: {len(keys)} keys",
                               collection=self.namespace)
        for i, o in enumerate(outs):
            if not isinstance(o, torch.Tensor):
                raise InvalidInput(f"output {i} must be a torch.Tensor",
                                   collection=self.namespace)
        store = self._store()
        if store.gpu_enabled and outs and all(
                o.device.type == "cuda" and o.is_contiguous() for o in outs):
            # from GPU copies (device to device), else the host
            with self._errors():
                metas = store.get_into_device(
                    keys, [(o.data_ptr(), o.numel() * o.element_size()) for o in outs],
                    verify=verify)
            self._found_all(keys, metas)
            return len(keys)
        direct = all(o.device.type == "cpu" and o.is_contiguous() for o in outs)
        if not direct:  # GPU or strided outs: map, then let torch copy
            for o, t in zip(outs, self.get(keys, verify=verify), strict=True):
                if o.numel() * o.element_size() != t.numel() * t.element_size():
                    raise InvalidInput(f"output of {o.numel() * o.element_size()} bytes for "
                                       f"a block of {t.numel() * t.element_size()}",
                                       collection=self.namespace)
                o.copy_(t.view(-1).view(torch.uint8).view(o.dtype).view(o.shape))
            return len(keys)
        addrs = np.fromiter((o.data_ptr() for o in outs), np.uint64, len(outs))
        sizes = np.fromiter((o.numel() * o.element_size() for o in outs), np.uint64,
                            len(outs))
        return self._read_into(keys, addrs, sizes, verify)

    def _read_into(self, keys: list[bytes], addrs: np.ndarray, sizes: np.ndarray,
                   verify: bool) -> int:
        with self._errors():
            status = self._store().read_into(keys, addrs, sizes, verify=verify)
        self._found_all(keys, [bool(s) for s in status] if not status.all() else None)
        return len(keys)

    def _found_all(self, keys: list[bytes], found: Sequence[object] | None) -> None:
        """NotFound naming the first key whose entry in ``found`` is falsy (None: all
        found)."""
        if found is None:
            return
        for k, m in zip(keys, found, strict=True):
            if not m:
                raise NotFound(f"KV block {k.hex()} is not in namespace {self.namespace!r}",
                               collection=self.namespace, tensor=k.hex())

    def pin(self, keys: Sequence[bytes]) -> int:
        """Protect blocks from eviction until ``unpin`` (counted; not tied to this
        process). Returns how many of the keys were present."""
        keys = self._chain.check(keys)
        with self._errors():
            return self._store().pin(keys)

    def unpin(self, keys: Sequence[bytes]) -> int:
        keys = self._chain.check(keys)
        with self._errors():
            return self._store().unpin(keys)

    def delete(self, keys: Sequence[bytes]) -> int:
        """Remove blocks (pinned ones too); tensors already handed out stay valid.
        Returns how many were present; idempotent."""
        keys = self._chain.check(keys)
        with self._errors():
            return self._store().delete(keys)

    def release(self) -> None:
        """Let go now of the eviction protection of tensors this process dropped."""
        self._store().release_pending()

    def stats(self) -> KVNodeSummary:
        """The node's summary for routing; also records blocks and bytes in the catalog."""
        self._store()  # StoreClosed once closed
        return self._ns.summary()

    def _errors(self) -> AbstractContextManager[None]:
        """The store's errors as the client's (``typed_errors``), knowing this handle."""
        return typed_errors(self.namespace, self.node, lambda: self._closed)

    def _store(self) -> BlockStore:
        if self._closed:
            raise StoreClosed(f"KV namespace {self.namespace!r} was closed",
                              collection=self.namespace)
        return self.store

    def close(self) -> None:
        """Let go of the namespace's store (idempotent); its blocks stay for others."""
        if not self._closed:
            self._closed = True
            self._stop_events()
            self._ns.close()

    def _stop_events(self, *, cleared: bool = False) -> None:
        if self.events is not None:
            self.events = None
            close_publisher(self.store, cleared=cleared)

    def destroy(self) -> None:
        """Close and remove the namespace's blocks from this node (memory and disk)."""
        if self._closed:
            self._ns.remove_files()
            return
        self._closed = True
        self._stop_events(cleared=True)
        self._ns.destroy()

    def __enter__(self) -> KVCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

