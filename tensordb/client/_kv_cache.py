"""KV cache blocks of one model/layout: ``db.kv(namespace, block_tokens=256)``.

A namespace is a ``storage_engine.BlockStore`` of its own, under the store's shared
memory (``<shm_dir>/kv/<namespace>``) spilling to its data directory
(``<data_dir>/kv/<namespace>``). Every process of the host that opens the namespace
shares its blocks: one writes, the others match and map them zero-copy.

Blocks are not catalog rows (there are too many, too short-lived); the catalog only
records each namespace per node (table ``kv_namespaces``) with its size as of the last
``stats()``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast
from urllib.parse import quote

import numpy as np
import torch
import xxhash
from sqlalchemy import insert, select, update
from sqlalchemy.exc import IntegrityError

from storage_engine import (
    BlockStore,
    GpuError,
    GpuTier,
    KVCorrupt,
    KVStats,
    KVStoreFull,
    bloom_may_hold,
)
from tensordb._dtypes import dtype_name, torch_dtype
from tensordb._names import check_name
from tensordb.catalog import write_conn
from tensordb.catalog.schema import kv_namespaces
from tensordb.errors import (
    CorruptData,
    InvalidInput,
    NodeUnavailable,
    NotFound,
    StoreClosed,
    StoreFull,
)

from ._placement import device_of

if TYPE_CHECKING:
    from ._database import Database

__all__ = ["KVCache", "KVNodeSummary", "DEFAULT_CAPACITY"]

log = logging.getLogger("tensordb.kv")

#: the arena size when neither the call, ``Config.kv_capacity`` nor
#: $TENSORDB_KV_CAPACITY says: a quarter of the free shared memory, at most 4 GiB
DEFAULT_CAPACITY = 4 << 30
MAX_KEY = 255


@dataclass(frozen=True, slots=True)
class KVNodeSummary:
    """What a node holds of a namespace and how loaded it is, for a router.

    ``bloom`` is a Bloom filter of the held block keys (about 1 % false positives):
    ``may_hold(key)`` tests one key, ``prefix_hits(keys)`` how many leading keys of a
    request it probably holds. Counters are the node's, over every process.
    """

    namespace: str
    node: str
    block_tokens: int
    blocks: int
    nbytes: int
    capacity: int
    load: float  # host bytes / capacity
    host_blocks: int
    host_bytes: int
    disk_blocks: int
    disk_bytes: int
    pinned: int
    hits: int
    misses: int
    evictions: int
    spills: int
    corrupt: int
    bloom: bytes
    bloom_hashes: int
    gpu_blocks: int = 0  # blocks with a copy in the GPU tier (counted in blocks too)
    gpu_bytes: int = 0
    gpu_capacity: int = 0  # 0: the namespace has no GPU tier
    gpu_hits: int = 0

    def may_hold(self, key: bytes) -> bool:
        return bloom_may_hold(self.bloom, self.bloom_hashes, key)

    def prefix_hits(self, keys: Sequence[bytes]) -> int:
        n = 0
        for k in keys:
            if not self.may_hold(k):
                break
            n += 1
        return n


@lru_cache(maxsize=1024)
def _decode_meta(meta: bytes) -> tuple[torch.dtype, tuple[int, ...]]:
    name, _, shape = meta.decode().partition("|")
    return torch_dtype(name), tuple(int(d) for d in shape.split(",") if d)


def _byte_view(t: torch.Tensor) -> np.ndarray:
    """The bytes of a contiguous CPU tensor as a flat uint8 array (no copy). One torch
    view, not two: torch's view calls cost microseconds each, per block."""
    if t.dim() == 0 or t.stride(-1) != 1:  # a size-1 last dim may have any stride
        t = t.reshape(-1)
    return t.view(torch.uint8).numpy().reshape(-1)


def _dir_name(namespace: str) -> str:
    q = quote(namespace, safe="")  # "a/b" must not nest under "a"
    if len(q) > 200:
        q = q[:150] + "-" + hashlib.blake2b(namespace.encode(), digest_size=16).hexdigest()
    return q


class KVCache:
    """The KV blocks of one namespace (model and layout) on this node.

    Open it with ``db.kv(namespace, block_tokens=...)``; one per process (a forked child
    reopens its own store transparently). Methods are thread-safe; ``match`` never
    blocks, the others hold the store's write lock for microseconds per block.
    """

    def __init__(self, db: Database, namespace: str, block_tokens: int = 256, *,
                 capacity_bytes: int | None = None, eviction: str | None = None,
                 slab_bytes: int = 64 << 20, spill: bool = True,
                 disk_capacity: int | None = None, gpu_capacity: int | None = None,
                 policy: str | None = None) -> None:
        check_name("collection", namespace)
        if isinstance(block_tokens, bool) or not isinstance(block_tokens, int) \
                or block_tokens <= 0:
            raise InvalidInput(f"block_tokens must be a positive int, not {block_tokens!r}",
                               collection=namespace)
        eviction = eviction or policy or "lru"  # policy=: the option's older name
        if eviction not in ("lru", "s3fifo"):
            raise InvalidInput(f"eviction (policy) must be 'lru' or 's3fifo', not "
                               f"{eviction!r}", collection=namespace)
        if gpu_capacity is None:
            gpu_capacity = _env_int("TENSORDB_KV_GPU_CAPACITY")
        for what, v in (("capacity_bytes", capacity_bytes), ("disk_capacity", disk_capacity),
                        ("gpu_capacity", gpu_capacity)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
                raise InvalidInput(f"{what} must be a positive int, not {v!r}",
                                   collection=namespace)
        self.db = db
        self.namespace = namespace
        self.block_tokens = block_tokens
        self.node = db.config.node
        self.shm_dir = Path(db.config.shm_dir) / "kv" / _dir_name(namespace)
        self.disk_dir = Path(db.config.data_dir) / "kv" / _dir_name(namespace)
        capacity = capacity_bytes or getattr(db.config, "kv_capacity", None) or \
            _env_capacity() or _default_capacity(Path(db.config.shm_dir).parent)
        self._seed = xxhash.xxh3_128_digest(
            f"tensordb-kv\0{namespace}\0{block_tokens}".encode())
        gpu_device = None
        if gpu_capacity is not None:
            reason = GpuTier.unavailable_reason()
            if reason is not None:
                raise InvalidInput(f"a KV GPU tier (gpu_capacity) needs a CUDA device: "
                                   f"{reason}", collection=namespace)
            gpu_device = db.config.gpu_device or 0
        self._register()
        self.store = _open_store(self.shm_dir, capacity_bytes=capacity, slab_bytes=slab_bytes,
                                 eviction=eviction,
                                 disk_root=self.disk_dir if spill else None,
                                 disk_capacity=disk_capacity, gpu_device=gpu_device,
                                 gpu_capacity=gpu_capacity)
        self._closed = False

    # -- catalog -------------------------------------------------------------------
    def _register(self) -> None:
        t = kv_namespaces
        where = (t.c.name == self.namespace) & (t.c.node == self.node)
        with self.db.catalog.engine.connect() as conn:
            row = conn.execute(select(t.c.block_tokens).where(where)).first()
        if row is not None:
            if row[0] != self.block_tokens:
                raise InvalidInput(
                    f"KV namespace {self.namespace!r} holds blocks of {row[0]} tokens, not "
                    f"{self.block_tokens}", collection=self.namespace)
            return
        try:
            with write_conn(self.db.catalog.engine) as conn:
                conn.execute(insert(t).values(
                    name=self.namespace, node=self.node, block_tokens=self.block_tokens,
                    blocks=0, nbytes=0, created_at=datetime.now(timezone.utc)))
        except IntegrityError:  # another process registered it first
            pass

    # -- keys ----------------------------------------------------------------------
    def keys(self, token_ids: Any, *, parent: bytes | None = None) -> list[bytes]:
        """One 16-byte key per *full* block of ``token_ids``: xxh3-128 chained over the
        previous key and the block's tokens (little-endian int64), seeded by the
        namespace and block size, so a key names the whole prefix up to its block.
        ``parent`` continues a chain from a key returned earlier. Stable across
        processes, hosts and Python hash seeds."""
        tokens = self._tokens(token_ids)
        prev = self._seed if parent is None else self._check_keys([parent])[0]
        out = []
        bt = self.block_tokens
        for lo in range(0, len(tokens) - bt + 1, bt):
            h = xxhash.xxh3_128(prev)
            h.update(tokens[lo:lo + bt].data)
            prev = h.digest()
            out.append(prev)
        return out

    def _tokens(self, token_ids: Any) -> np.ndarray:
        if isinstance(token_ids, torch.Tensor):
            if token_ids.is_floating_point() or token_ids.is_complex() \
                    or token_ids.dtype == torch.bool:
                raise InvalidInput(f"token ids must be integers, not {token_ids.dtype}",
                                   collection=self.namespace)
            token_ids = token_ids.detach().cpu().to(torch.int64).numpy()
        try:
            arr = np.asarray(token_ids)
            if arr.dtype.kind not in "iu" and arr.size:
                raise TypeError(f"dtype {arr.dtype}")
            arr = arr.astype("<i8", copy=False)
        except (TypeError, ValueError, OverflowError) as exc:
            raise InvalidInput(f"token ids must be a 1-D sequence of ints: {exc}",
                               collection=self.namespace) from exc
        if arr.ndim != 1:
            raise InvalidInput(f"token ids must be 1-D, not of shape {arr.shape}",
                               collection=self.namespace)
        return np.ascontiguousarray(arr)

    def _check_keys(self, keys: Sequence[bytes]) -> list[bytes]:
        if isinstance(keys, (bytes, bytearray, str)):
            raise InvalidInput("keys must be a sequence of keys, not one key",
                               collection=self.namespace)
        out = []
        for k in keys:
            if type(k) is bytes and 0 < len(k) <= MAX_KEY:  # the usual case: no copy
                out.append(k)
            elif isinstance(k, (bytes, bytearray)) and 0 < len(k) <= MAX_KEY:
                out.append(bytes(k))
            else:
                raise InvalidInput(f"a KV key must be 1 to {MAX_KEY} bytes, not {k!r:.60}",
                                   collection=self.namespace)
        return out

    # -- blocks --------------------------------------------------------------------
    def put(self, keys: Sequence[bytes], blocks: Sequence[torch.Tensor]) -> int:
        """Store one tensor per key (any dtype and shape; GPU tensors are copied down).
        First writer wins: a key already present is left as it is, without error.
        Returns how many blocks this call stored. Raises StoreFull, storing none of the
        batch, when the arena is full of pinned blocks and blocks being read. With a GPU
        tier, CUDA blocks also leave a copy there (device to device), for readers on
        the GPU."""
        keys = self._check_keys(keys)
        if isinstance(blocks, torch.Tensor) or len(blocks) != len(keys):
            raise InvalidInput(f"put takes one tensor per key: {len(keys)} keys",
                               collection=self.namespace)
        bufs, metas = [], []
        on_gpu: list[tuple[int, torch.Tensor]] = []
        # a batch's blocks share dtype and shape: their record is built once (the checks
        # and the string were a quarter of a 64 KiB block's put)
        seen: dict[tuple[torch.dtype, torch.Size], bytes] = {}
        for i, b in enumerate(blocks):
            if not isinstance(b, torch.Tensor) or b.layout != torch.strided or b.is_meta:
                raise InvalidInput(f"block {i} must be a dense torch.Tensor, not "
                                   f"{type(b).__name__}", collection=self.namespace)
            t = b.detach() if b.requires_grad else b
            if t.device.type != "cpu":
                if t.device.type == "cuda":
                    on_gpu.append((i, t.contiguous()))
                t = t.cpu()
            if not t.is_contiguous():
                t = t.contiguous()
            meta = seen.get((t.dtype, t.shape))
            if meta is None:
                if t.numel() == 0:
                    raise InvalidInput(f"block {i} is empty", collection=self.namespace)
                name = dtype_name(t.dtype, tensor=f"block {i}")
                meta = seen[(t.dtype, t.shape)] = \
                    f"{name}|{','.join(map(str, t.shape))}".encode()
            bufs.append(_byte_view(t))
            metas.append(meta)
        store = self._store()
        try:
            stored = sum(store.put(keys, bufs, metas))
        except KVStoreFull as exc:
            raise StoreFull(f"KV namespace {self.namespace!r}: {exc}",
                            collection=self.namespace, node=self.node) from exc
        if on_gpu and store.gpu_enabled:  # .cpu() above synchronised their stream
            try:
                store.admit_device([keys[i] for i, _ in on_gpu],
                                   [(t.data_ptr(), t.numel() * t.element_size(),
                                     t.device.index) for _, t in on_gpu])
            except GpuError as exc:  # the device copy is a cache: the blocks are stored
                log.warning("KV namespace %r: no GPU copies of %d blocks: %s",
                            self.namespace, len(on_gpu), exc)
        return stored

    @property
    def gpu_enabled(self) -> bool:
        """Whether this namespace has a GPU tier in this process (``gpu_capacity``)."""
        return self._store().gpu_enabled

    def match(self, keys: Sequence[bytes]) -> int:
        """How many leading keys are present (in memory or spilled to disk)."""
        return self._store().match(self._check_keys(keys))

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        """For each key, whether it is present (not only the leading run)."""
        return self._store().contains(self._check_keys(keys))

    def get(self, keys: Sequence[bytes], *, verify: bool = True,
            device: str | torch.device | None = None) -> list[torch.Tensor]:
        """Zero-copy tensors of the blocks, with the dtype and shape they were put with.
        Each maps its block copy-on-write: writing to it changes only the reader's copy.
        A block stays protected from eviction while its tensor is alive. Raises NotFound
        naming the first absent key, CorruptData when a block fails its checksum (the
        block is dropped from the store: a later ``match`` no longer counts it).

        ``device="cuda:N"``: tensors on the GPU. With a GPU tier they are zero-copy views
        of the blocks' GPU copies (made from the host copy on first read, then shared by
        every process of the host: read-only by convention); without one, or where the
        tier has no room, copies."""
        keys = self._check_keys(keys)
        if device is not None:
            dev = device_of(device, self.namespace)  # InvalidInput: not cpu/cuda, no CUDA
            if dev is not None and dev.type == "cuda":
                return self._get_cuda(keys, verify, dev)
        with self._typed_errors():
            views = self._store().get(keys, verify=verify)
        out = []
        for k, v in zip(keys, views, strict=True):
            if v is None:
                raise NotFound(f"KV block {k.hex()} is not in namespace {self.namespace!r}",
                               collection=self.namespace, tensor=k.hex())
            dtype, shape = _decode_meta(v.meta)
            out.append(torch.frombuffer(v.data, dtype=dtype).view(shape))
        return out

    def _get_cuda(self, keys: list[bytes], verify: bool, dev: torch.device
                  ) -> list[torch.Tensor]:
        store = self._store()
        out: list[torch.Tensor | None] = [None] * len(keys)
        if store.gpu_enabled:
            with self._typed_errors():
                views = store.get_device(keys, verify=verify)
            for i, v in enumerate(views):
                if v is not None:
                    dtype, shape = _decode_meta(v.meta)
                    t = torch.as_tensor(v, device=f"cuda:{v.device}").view(dtype).view(shape)
                    out[i] = t if t.device == dev else t.to(dev)
        need = [i for i, t in enumerate(out) if t is None]
        if need:
            for i, t in zip(need, self.get([keys[i] for i in need], verify=verify), strict=True):
                out[i] = t.to(dev)
        return cast("list[torch.Tensor]", out)  # every slot is filled by now

    def get_into(self, keys: Sequence[bytes], outs: Sequence[torch.Tensor], *,
                 verify: bool = True) -> int:
        """Copy each block into its tensor in ``outs`` (same number of bytes; CPU or
        GPU, e.g. a slice of an engine's paged KV). Returns how many were copied;
        raises NotFound for an absent key and CorruptData as ``get`` does."""
        keys = self._check_keys(keys)
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
            with self._typed_errors():  # from GPU copies (device to device), else the host
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
        dsts = [_byte_view(o.detach()) for o in outs]
        with self._typed_errors():
            metas = self._store().get_into(keys, dsts, verify=verify)
        self._found_all(keys, metas)
        return len(keys)

    @contextmanager
    def _typed_errors(self) -> Iterator[None]:
        """The block store's errors as the client's: a corrupt block is CorruptData, a
        bad buffer InvalidInput."""
        try:
            yield
        except KVCorrupt as exc:
            raise CorruptData(f"KV namespace {self.namespace!r}: {exc}",
                              collection=self.namespace, node=self.node) from exc
        except ValueError as exc:
            raise InvalidInput(str(exc), collection=self.namespace) from exc
        except GpuError as exc:  # as a snapshot's GPU reads report it
            raise NodeUnavailable(f"KV namespace {self.namespace!r}: the GPU tier failed: "
                                  f"{exc}", collection=self.namespace,
                                  node=self.node) from exc

    def _found_all(self, keys: list[bytes], metas: list[bytes | None]) -> None:
        for k, m in zip(keys, metas, strict=True):
            if m is None:
                raise NotFound(f"KV block {k.hex()} is not in namespace {self.namespace!r}",
                               collection=self.namespace, tensor=k.hex())

    def pin(self, keys: Sequence[bytes]) -> int:
        """Protect blocks from eviction until ``unpin`` (counted; not tied to this
        process). Returns how many of the keys were present."""
        return self._store().pin(self._check_keys(keys))

    def unpin(self, keys: Sequence[bytes]) -> int:
        return self._store().unpin(self._check_keys(keys))

    def delete(self, keys: Sequence[bytes]) -> int:
        """Remove blocks (pinned ones too); tensors already handed out stay valid.
        Returns how many were present; idempotent."""
        return self._store().delete(self._check_keys(keys))

    def release(self) -> None:
        """Let go now of the eviction protection of tensors this process dropped."""
        self._store().release_pending()

    def stats(self) -> KVNodeSummary:
        """The node's summary for routing; also records blocks and bytes in the catalog."""
        s: KVStats = self._store().stats()
        t = kv_namespaces
        with write_conn(self.db.catalog.engine) as conn:
            conn.execute(update(t).where((t.c.name == self.namespace) & (t.c.node == self.node))
                         .values(blocks=s.blocks, nbytes=s.nbytes))
        return KVNodeSummary(
            namespace=self.namespace, node=self.node, block_tokens=self.block_tokens,
            blocks=s.blocks, nbytes=s.nbytes, capacity=s.capacity,
            load=s.host_bytes / s.capacity, host_blocks=s.host_blocks,
            host_bytes=s.host_bytes, disk_blocks=s.disk_blocks, disk_bytes=s.disk_bytes,
            pinned=s.pinned, hits=s.hits, misses=s.misses, evictions=s.evictions,
            spills=s.spills, corrupt=s.corrupt, bloom=s.bloom, bloom_hashes=s.bloom_hashes,
            gpu_blocks=s.gpu_blocks, gpu_bytes=s.gpu_bytes, gpu_capacity=s.gpu_capacity,
            gpu_hits=s.gpu_hits)

    def _store(self) -> BlockStore:
        if self._closed:
            raise StoreClosed(f"KV namespace {self.namespace!r} was closed",
                              collection=self.namespace)
        return self.store

    def close(self) -> None:
        """Let go of the namespace's store (idempotent); its blocks stay for others."""
        if not self._closed:
            self._closed = True
            _close_store(self.store)

    def destroy(self) -> None:
        """Close and remove the namespace's blocks from this node (memory and disk)."""
        self.close()
        shutil.rmtree(self.shm_dir, ignore_errors=True)
        shutil.rmtree(self.disk_dir, ignore_errors=True)

    def __enter__(self) -> KVCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# LMDB opens an environment once per process: KVCaches of one namespace in one process
# share one BlockStore (the first one's settings win)
_STORES: dict[tuple[int, Path], list[Any]] = {}
_STORES_LOCK = threading.Lock()


def _open_store(root: Path, **kw: Any) -> BlockStore:
    with _STORES_LOCK:
        entry = _STORES.get((os.getpid(), root))
        if entry is None:
            entry = _STORES[(os.getpid(), root)] = [BlockStore(root, **kw), 0]
        entry[1] += 1
        return entry[0]


def _close_store(store: BlockStore) -> None:
    with _STORES_LOCK:
        entry = _STORES.get((os.getpid(), store.root))
        if entry is None or entry[0] is not store:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del _STORES[(os.getpid(), store.root)]
            store.close()


def _env_int(name: str) -> int | None:
    v = os.environ.get(name)
    return int(v) if v else None


def _env_capacity() -> int | None:
    return _env_int("TENSORDB_KV_CAPACITY")


def _default_capacity(shm: Path) -> int:
    try:
        st = os.statvfs(shm)
        free = st.f_bavail * st.f_frsize
    except OSError:
        return DEFAULT_CAPACITY
    return max(64 << 20, min(DEFAULT_CAPACITY, free // 4))
