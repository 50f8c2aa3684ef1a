"""A KV namespace's place on this node: its options, catalog row, directories and store.

``KVNamespace`` checks a namespace's options, registers it in the catalog (table
``kv_namespaces``, one row per namespace and node, recording its block size and, as of
the last ``stats()``, its size), and opens its ``storage_engine.BlockStore`` under
``<shm_dir>/kv/<namespace>`` spilling to ``<data_dir>/kv/<namespace>``. The processes of
one host share that store's blocks; the KVCaches of one process share one BlockStore.
``KVNodeSummary`` is what the node reports of the namespace, for a router.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from sqlalchemy import bindparam, text, update
from sqlalchemy.exc import IntegrityError

from storage_engine import (
    BlockStore,
    FileTier,
    GpuError,
    GpuTier,
    KVCorrupt,
    KVIndexDamaged,
    KVStats,
    KVStoreFull,
    bloom_may_hold,
    kept_mappings,
)
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

from ._inputs import check_name

if TYPE_CHECKING:
    from storage_engine import Tier
    from tensordb.catalog import Catalog
    from tensordb.config import Config

__all__ = ["DEFAULT_CAPACITY", "KVNamespace", "KVNodeSummary", "typed_errors"]

#: the arena size when neither the call, ``Config.kv_capacity`` nor
#: $TENSORDB_KV_CAPACITY says: a quarter of the free shared memory, at most 4 GiB
DEFAULT_CAPACITY = 4 << 30
#: and at least this much (a fixed 64 MiB minimum made ``db.kv()`` fail on a small
#: /dev/shm: its first slab did not fit)
_MIN_CAPACITY = 1 << 20


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


_MAX_BLOCK_TOKENS = 2**31 - 1  # kv_namespaces.block_tokens is a 32-bit Integer

# the registration's statements, built once and as text: building and compiling them per
# call was half of ``db.kv()``, and compiling the Core constructs on a process's first
# call cost 3-5 ms of its first ``db.kv()`` (text compiles in a fraction of that)
_SELECT_ROW = text("SELECT block_tokens FROM kv_namespaces WHERE name = :name AND node = :node")
_INSERT_ROW = text(
    "INSERT INTO kv_namespaces (name, node, block_tokens, blocks, nbytes, created_at) "
    "VALUES (:name, :node, :block_tokens, :blocks, :nbytes, :created_at)"
).bindparams(bindparam("created_at", type_=kv_namespaces.c.created_at.type))


class KVNamespace:
    """One namespace opened on this node: registered, its directories named, its store
    open. ``close`` lets go of the store; ``remove_files`` deletes its blocks."""

    __slots__ = ("catalog", "host", "name", "block_tokens", "node", "shm_dir", "disk_dir",
                 "store")

    def __init__(self, config: Config, catalog: Catalog, host: Tier, name: str,
                 block_tokens: int, *,
                 capacity_bytes: int | None, eviction: str | None, slab_bytes: int,
                 spill: bool, disk_capacity: int | None, gpu_capacity: int | None,
                 policy: str | None, create: bool = True) -> None:
        check_name("collection", name)
        if not isinstance(create, bool):
            raise InvalidInput(f"create must be True or False, not {create!r}",
                               collection=name)
        if isinstance(block_tokens, bool) or not isinstance(block_tokens, int) \
                or not 0 < block_tokens <= _MAX_BLOCK_TOKENS:
            raise InvalidInput(f"block_tokens must be a positive int below 2**31 (the "
                               f"catalog's column), not {block_tokens!r}", collection=name)
        if eviction is not None and policy is not None and eviction != policy:
            raise InvalidInput(f"eviction={eviction!r} and policy={policy!r} disagree (policy "
                               f"is the option's older name: give one)", collection=name)
        eviction = eviction if eviction is not None else policy if policy is not None \
            else "lru"
        if eviction not in ("lru", "s3fifo"):
            raise InvalidInput(f"eviction (policy) must be 'lru' or 's3fifo', not "
                               f"{eviction!r}", collection=name)
        if gpu_capacity is None:
            gpu_capacity = _env_int("TENSORDB_KV_GPU_CAPACITY")
        for what, v in (("capacity_bytes", capacity_bytes), ("disk_capacity", disk_capacity),
                        ("gpu_capacity", gpu_capacity)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
                raise InvalidInput(f"{what} must be a positive int, not {v!r}",
                                   collection=name)
        self.catalog = catalog
        self.host = host  # the node's host tier, which takes the slabs of a destroyed one
        self.name = name
        self.block_tokens = block_tokens
        self.node: str = config.node
        self.shm_dir = Path(config.shm_dir) / "kv" / _dir_name(name)
        self.disk_dir = Path(config.data_dir) / "kv" / _dir_name(name)
        capacity = (capacity_bytes or getattr(config, "kv_capacity", None)
                    or _env_int("TENSORDB_KV_CAPACITY")
                    or _default_capacity(Path(config.shm_dir).parent))
        gpu_device = None
        if gpu_capacity is not None:
            reason = GpuTier.unavailable_reason()
            if reason is not None:
                raise InvalidInput(f"a KV GPU tier (gpu_capacity) needs a CUDA device: "
                                   f"{reason}", collection=name)
            gpu_device = config.gpu_device or 0
        self._register(create)
        try:
            self.store = _open_store(self.shm_dir, capacity_bytes=capacity,
                                     slab_bytes=slab_bytes, eviction=eviction,
                                     disk_root=self.disk_dir if spill else None,
                                     disk_capacity=disk_capacity, gpu_device=gpu_device,
                                     gpu_capacity=gpu_capacity,
                                     pool_dir=Path(config.shm_dir) / "pool")
        except KVIndexDamaged as exc:
            raise CorruptData(f"KV namespace {name!r}: {exc}", collection=name,
                              node=self.node) from exc
        except KVStoreFull as exc:  # every process slot of the index taken
            raise StoreFull(f"KV namespace {name!r}: {exc}", collection=name,
                            node=self.node) from exc

    def _register(self, create: bool) -> None:
        """Record the namespace on this node, or check its block size against the row
        another process (or an earlier run) recorded. ``create=False``: NotFound when
        there is no row, and nothing recorded. The row is written without an fsync
        (``durable=False``): it describes a store whose index lives in shared memory,
        which no block outlives a reboot without (the fsync was half of ``db.kv()``)."""
        engine = self.catalog.engine
        names = {"name": self.name, "node": self.node}
        with engine.connect() as conn:
            row = conn.execute(_SELECT_ROW, names).first()
        if row is None and not create:
            raise NotFound(f"node {self.node!r} holds no KV namespace {self.name!r}",
                           collection=self.name, node=self.node)
        if row is None:
            try:
                with write_conn(engine, durable=False) as conn:
                    conn.execute(_INSERT_ROW, {**names, "block_tokens": self.block_tokens,
                                               "blocks": 0, "nbytes": 0,
                                               "created_at": datetime.now(timezone.utc)})
                return
            except IntegrityError:  # another process registered it first: check its row
                with engine.connect() as conn:
                    row = conn.execute(_SELECT_ROW, names).first()
        if row is not None and row[0] != self.block_tokens:
            raise InvalidInput(
                f"KV namespace {self.name!r} holds blocks of {row[0]} tokens, not "
                f"{self.block_tokens}", collection=self.name)

    def summary(self) -> KVNodeSummary:
        """The store's counters as a summary; records blocks and bytes in the catalog."""
        s: KVStats = self.store.stats()
        t = kv_namespaces
        with write_conn(self.catalog.engine) as conn:
            conn.execute(update(t).where((t.c.name == self.name) & (t.c.node == self.node))
                         .values(blocks=s.blocks, nbytes=s.nbytes))
        return KVNodeSummary(
            namespace=self.name, node=self.node, block_tokens=self.block_tokens,
            blocks=s.blocks, nbytes=s.nbytes, capacity=s.capacity,
            load=s.host_bytes / s.capacity, host_blocks=s.host_blocks,
            host_bytes=s.host_bytes, disk_blocks=s.disk_blocks, disk_bytes=s.disk_bytes,
            pinned=s.pinned, hits=s.hits, misses=s.misses, evictions=s.evictions,
            spills=s.spills, corrupt=s.corrupt, bloom=s.bloom, bloom_hashes=s.bloom_hashes,
            gpu_blocks=s.gpu_blocks, gpu_bytes=s.gpu_bytes, gpu_capacity=s.gpu_capacity,
            gpu_hits=s.gpu_hits)

    def close(self) -> None:
        """Let go of this process's share of the store (once per KVNamespace)."""
        _close_store(self.store)

    def destroy(self) -> None:
        """Close the store and delete the namespace's blocks from this node (memory and
        disk). Where nobody else has it open and no view of a block is held, its slab
        files go to the host tier's pool: their pages are kept for the next writer (a
        new namespace's slabs, a commit's segments) instead of being faulted in again."""
        recycle = _last_user(self.store) and self.store.quiescent()
        host = self.host
        slabs = self.store.slab_files() if recycle else []
        if slabs and isinstance(host, FileTier):
            # this process keeps its mappings of the files it pools: a new namespace
            # here that claims them back takes them, page tables filled
            self.store.keep_mappings()
        self.close()
        if isinstance(host, FileTier):
            for path in slabs:
                host.pool_file(path)
        self.remove_files()
        if slabs:
            kept_mappings()  # closes the kept mappings of files the pool did not take

    def remove_files(self) -> None:
        """Delete the namespace's blocks from this node (memory and disk)."""
        shutil.rmtree(self.shm_dir, ignore_errors=True)
        shutil.rmtree(self.disk_dir, ignore_errors=True)


@contextmanager
def typed_errors(namespace: str, node: str, closed: Callable[[], bool] = lambda: False
                 ) -> Iterator[None]:
    """The block store's errors as the client's: a corrupt block or file is CorruptData, no room
    StoreFull, a failed GPU tier NodeUnavailable. A ValueError is the index's: a bad buffer
    (InvalidInput) or, where ``closed()`` says the handle was closed meanwhile (by another
    thread, during the call), the closed index (StoreClosed): never a bad input."""
    try:
        yield
    except (KVCorrupt, KVIndexDamaged) as exc:  # damaged blocks; damaged files
        raise CorruptData(f"KV namespace {namespace!r}: {exc}",
                          collection=namespace, node=node) from exc
    except KVStoreFull as exc:
        raise StoreFull(f"KV namespace {namespace!r}: {exc}", collection=namespace,
                        node=node) from exc
    except ValueError as exc:
        if closed():
            raise StoreClosed(f"KV namespace {namespace!r} was closed during the call",
                              collection=namespace) from exc
        raise InvalidInput(str(exc), collection=namespace) from exc
    except GpuError as exc:  # as a snapshot's GPU reads report it
        raise NodeUnavailable(f"KV namespace {namespace!r}: the GPU tier failed: "
                              f"{exc}", collection=namespace, node=node) from exc


def _dir_name(namespace: str) -> str:
    q = quote(namespace, safe="")  # "a/b" must not nest under "a"
    if len(q) > 200:
        q = q[:150] + "-" + hashlib.blake2b(namespace.encode(), digest_size=16).hexdigest()
    return q


# KVCaches of one namespace in one process share one BlockStore (the first one's settings
# win; each open handle takes one of the index's process slots)
_STORES: dict[tuple[int, Path], list[Any]] = {}
_STORES_LOCK = threading.Lock()


def _open_store(root: Path, **kw: Any) -> BlockStore:
    with _STORES_LOCK:
        entry = _STORES.get((os.getpid(), root))
        if entry is None:
            entry = _STORES[(os.getpid(), root)] = [BlockStore(root, **kw), 0]
        entry[1] += 1
        return entry[0]


def _last_user(store: BlockStore) -> bool:
    """Whether one KVNamespace of this process holds ``store``."""
    with _STORES_LOCK:
        entry = _STORES.get((os.getpid(), store.root))
        return entry is not None and entry[0] is store and entry[1] == 1


def _close_store(store: BlockStore) -> None:
    with _STORES_LOCK:
        entry = _STORES.get((os.getpid(), store.root))
        if entry is None or entry[0] is not store:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del _STORES[(os.getpid(), store.root)]
            store.close()


def kv_counters(config: Config, name: str) -> tuple[dict[str, int], int] | None:
    """The shared counters of namespace ``name`` on this host and its capacity, for
    the metrics (this process's handle where it has one open; else one opened for the
    read and closed); None where the namespace has no store on this host. Creates
    nothing. CorruptData where its files are damaged."""
    root = Path(config.shm_dir) / "kv" / _dir_name(name)
    if not (root / "index.kvx").is_file():
        return None
    with typed_errors(name, config.node):  # damaged files: CorruptData naming them
        store = _open_store(root, capacity_bytes=1,  # an existing store's settings win
                            disk_root=Path(config.data_dir) / "kv" / _dir_name(name))
        try:
            return store.index_stats(), store.capacity
        finally:
            _close_store(store)


def _env_int(name: str) -> int | None:
    v = os.environ.get(name)
    return int(v) if v else None


def _default_capacity(shm: Path) -> int:
    try:
        st = os.statvfs(shm)
        free = st.f_bavail * st.f_frsize
    except OSError:
        return DEFAULT_CAPACITY
    return max(_MIN_CAPACITY, min(DEFAULT_CAPACITY, free // 4))
