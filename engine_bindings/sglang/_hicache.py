"""An SGLang HiCache storage backend (the L3 tier) on tensordb's KV block store.

Turn it on with::

    python -m sglang.launch_server --model-path MODEL --enable-hierarchical-cache \\
        --hicache-mem-layout page_first --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{"backend_name": "tensordb",
            "module_path": "engine_bindings.sglang", "class_name": "TensorDBHiCacheStorage",
            "interface_v1": 1, "home": "/var/lib/tensordb"}'

SGLang's cache controller names each page of KV by a chained hash of its tokens (its
own keys, strings); this backend stores one block per page in a tensordb KV namespace,
so every SGLang server of the host (and any process that opens the store) shares the
pages one of them wrote. ``interface_v1: 1`` makes SGLang call ``batch_get_v1`` /
``batch_set_v1``: pages are copied straight between the store's shared memory and the
pages of SGLang's host memory pool, with no staging page between them (without it,
SGLang goes through ``batch_get`` / ``batch_set`` and copies each page once more).

**Blocks.** One stored block is one page of the host pool, in the pool's own page
layout (``get_data_page(index, flat=False)``: ``[2, layers, page, heads, head_dim]``
for an MHA pool in ``layer_first``, ``[2, page, layers, heads, head_dim]`` in
``page_first``, ``[layers, page, 1, dim]`` for MLA ...), the format SGLang's own
file backend writes. The namespace ``{namespace}/{layout}/{shard}`` carries a
fingerprint of that layout (pool class, memory layout, dtype, page shape), so servers
whose pages differ never read each other's; ``shard`` is the tensor- and
pipeline-parallel rank (MLA pages are the same on every tensor-parallel rank and
shared by them).

Extra-config keys read here (SGLang's own ones are left to SGLang): where the store is
(``home``, or ``url`` with ``node`` and ``data_dir``; default ``$TENSORDB_HOME``),
``namespace`` (default ``sglang/`` and the model's name) and ``capacity_bytes`` (the KV
arena's size when this process creates it).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

import torch
import xxhash
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)

import tensordb
from tensordb.errors import CorruptData, InvalidInput, NotFound, StoreFull

from .._engines import LOCATION_KEYS, StoreLocation, open_store

__all__ = ["BACKEND_NAME", "TensorDBHiCacheStorage", "hicache_extra_config"]

logger = logging.getLogger(__name__)

#: the ``backend_name`` of the dynamic backend's extra config
BACKEND_NAME = "tensordb"
_MAX_KEY = 255


class TensorDBHiCacheStorage(HiCacheStorage):
    """``HiCacheStorage`` over a tensordb KV namespace (see the module docstring).

    SGLang builds it as ``TensorDBHiCacheStorage(storage_config, kwargs)`` in each
    scheduler process, then calls ``register_mem_pool_host`` with its host pool; the
    page methods need that pool. Methods are called from SGLang's prefetch and backup
    threads at once: they are thread-safe, and block only for the copies. A full
    store makes ``set`` calls answer False (SGLang retries later); a missing or damaged
    page reads as absent. Bad arguments raise ``InvalidInput``.
    """

    def __init__(self, storage_config: HiCacheStorageConfig,
                 kwargs: dict[str, Any] | None = None) -> None:
        if not isinstance(storage_config, HiCacheStorageConfig):
            raise InvalidInput(f"{type(self).__name__} needs a HiCacheStorageConfig, not "
                               f"{type(storage_config).__name__}")
        self.storage_config = storage_config
        extra = dict(storage_config.extra_config or {})
        namespace = extra.get("namespace")
        if namespace is None:
            model = os.path.basename(str(storage_config.model_name or "model").rstrip("/"))
            namespace = f"sglang/{model or 'model'}"
        elif not isinstance(namespace, str) or not namespace:
            raise InvalidInput(f"hicache extra config 'namespace' must be a non-empty "
                               f"string, not {namespace!r}")
        self.base_namespace = namespace
        capacity = extra.get("capacity_bytes")
        if capacity is not None and (isinstance(capacity, bool) or not isinstance(
                capacity, int) or capacity <= 0):
            raise InvalidInput(f"hicache extra config 'capacity_bytes' must be a positive "
                               f"int, not {capacity!r}")
        self._opts = {} if capacity is None else {"capacity_bytes": capacity}
        self.location = StoreLocation.parse({k: extra[k] for k in LOCATION_KEYS if k in extra})
        self.db = open_store(self.location)
        self.kv: Any = None
        self.namespace: str | None = None

    # -- the host pool -----------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Take SGLang's host memory pool and open the namespace of its page layout.
        Registering a pool of another layout later opens that layout's namespace."""
        for attr in ("page_size", "layout", "dtype", "get_data_page"):
            if not hasattr(mem_pool_host, attr):
                raise InvalidInput(f"a host memory pool has {attr!r}; "
                                   f"{type(mem_pool_host).__name__} has not")
        super().register_mem_pool_host(mem_pool_host)
        page = mem_pool_host.get_data_page(0, flat=False)
        facts = (type(mem_pool_host).__name__, str(mem_pool_host.layout),
                 str(mem_pool_host.dtype), int(mem_pool_host.page_size), tuple(page.shape))
        cfg = self.storage_config
        tp = "" if cfg.is_mla_model else f"tp{cfg.tp_rank}of{cfg.tp_size}-"
        cp = f"-cp{cfg.attn_cp_rank}of{cfg.attn_cp_size}" if cfg.attn_cp_size > 1 else ""
        namespace = (f"{self.base_namespace}/{xxhash.xxh3_64_hexdigest(repr(facts).encode())}"
                     f"/{tp}pp{cfg.pp_rank}of{cfg.pp_size}{cp}")
        if namespace != self.namespace:
            old, self.kv = self.kv, self.db.kv(namespace, int(mem_pool_host.page_size),
                                               **self._opts)
            self.namespace = namespace
            if old is not None:
                old.close()
        self.page_size = int(mem_pool_host.page_size)

    def _cache(self) -> Any:
        if self.kv is None:
            raise InvalidInput(f"{type(self).__name__}: register_mem_pool_host first")
        return self.kv

    @staticmethod
    def _key(key: object) -> bytes:
        if not isinstance(key, str) or not key:
            raise InvalidInput(f"a HiCache key must be a non-empty str, not {key!r:.60}")
        if len(key) == 64:  # SGLang's keys: 64 hex digits, held as their 32 bytes
            try:
                return bytes.fromhex(key)
            except ValueError:
                pass
        raw = key.encode()
        # a longer key is named by its hash
        return raw if len(raw) <= _MAX_KEY else xxhash.xxh3_128_digest(raw)

    def _keys(self, keys: Sequence[str]) -> list[bytes]:
        if isinstance(keys, (str, bytes)) or not isinstance(keys, Sequence):
            raise InvalidInput(f"keys must be a list of str, not {type(keys).__name__}")
        try:  # the usual batch: SGLang's hex keys, one conversion each, no other check
            out = [bytes.fromhex(k) for k in keys]
            if all(len(b) == 32 for b in out) and all(len(k) == 64 for k in keys):
                return out
        except (TypeError, ValueError):
            pass
        return [self._key(k) for k in keys]

    def _pages(self, keys: Sequence[str], host_indices: torch.Tensor) -> list[torch.Tensor]:
        """Views of the host pool's pages that ``host_indices`` (token slots, a page
        each ``page_size``) name, one per key."""
        pool = getattr(self, "mem_pool_host", None)
        if pool is None:
            raise InvalidInput(f"{type(self).__name__}: register_mem_pool_host first")
        if not isinstance(host_indices, torch.Tensor) or host_indices.ndim != 1:
            raise InvalidInput("host_indices must be a 1-D tensor of host token slots")
        if host_indices.numel() != len(keys) * self.page_size:
            raise InvalidInput(f"host_indices has {host_indices.numel()} slots for "
                               f"{len(keys)} pages of {self.page_size}")
        starts = host_indices[::self.page_size].tolist() if len(keys) else []
        if any(s < 0 or s % self.page_size or s >= pool.size for s in starts):
            raise InvalidInput(f"host_indices must start pages inside the host pool "
                               f"(multiples of {self.page_size} below {pool.size})")
        return [pool.get_data_page(s, flat=False) for s in starts]

    # -- the zero-copy page interface ----------------------------------------------------
    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Copy each present page straight from the store into its host-pool page.
        Returns, per key, whether its page was filled."""
        bkeys = self._keys(keys)
        pages = self._pages(keys, host_indices)
        kv = self._cache()
        present = kv.contains(bkeys)
        got = [i for i, p in enumerate(present) if p]
        try:
            kv.get_into([bkeys[i] for i in got], [pages[i] for i in got])
        except (NotFound, CorruptData):  # gone since contains: page by page
            for i in got:
                present[i] = self._get_into(bkeys[i], pages[i]) is not None
        return present

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Store each host-pool page under its key (a page already stored is kept).
        Returns, per key, whether its page is in the store now."""
        bkeys = self._keys(keys)
        pages = self._pages(keys, host_indices)
        return [self._put(bkeys, pages)] * len(keys)

    # -- the tensor interface -----------------------------------------------------------
    def get(self, key: str, target_location: Any | None = None,
            target_sizes: Any | None = None) -> torch.Tensor | None:
        """The page stored under ``key``: copied into ``target_location`` (a tensor of
        the page's size, returned) or, without one, a zero-copy read-only view. None
        when absent (or damaged)."""
        k = self._key(key)
        if target_location is not None:
            if not isinstance(target_location, torch.Tensor):
                raise InvalidInput(f"target_location must be a tensor, not "
                                   f"{type(target_location).__name__}")
            return self._get_into(k, target_location)
        try:
            return self._cache().get([k])[0]
        except (NotFound, CorruptData):
            return None

    def batch_get(self, keys: list[str], target_locations: Any | None = None,
                  target_sizes: Any | None = None) -> list[torch.Tensor | None]:
        if target_locations is not None and len(target_locations) != len(keys):
            raise InvalidInput(f"{len(keys)} keys and {len(target_locations)} targets")
        targets = target_locations if target_locations is not None else [None] * len(keys)
        return [self.get(k, t) for k, t in zip(keys, targets, strict=True)]

    def set(self, key: str, value: Any | None = None, target_location: Any | None = None,
            target_sizes: Any | None = None) -> bool:
        """Store ``value`` (a tensor) under ``key``; True once it is in the store (also
        when it was already), False when the store is full."""
        return self._put([self._key(key)], [value])

    def batch_set(self, keys: list[str], values: Any | None = None,
                  target_locations: Any | None = None, target_sizes: Any | None = None
                  ) -> bool:
        bkeys = self._keys(keys)
        if values is None or isinstance(values, torch.Tensor) or len(values) != len(bkeys):
            raise InvalidInput(f"batch_set takes one tensor per key: {len(bkeys)} keys")
        return self._put(bkeys, list(values))

    def exists(self, key: str) -> bool:
        return self._cache().contains([self._key(key)])[0]

    def batch_exists(self, keys: list[str],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """How many leading keys are stored (SGLang's keys are a chain)."""
        return self._cache().match(self._keys(keys))

    def clear(self) -> bool:
        """Pages are shared with every engine of the host, so one engine's flush
        leaves them (False). To drop them, delete their namespace (``db.kv(...).destroy``)
        or give the servers a new ``namespace``, e.g. after a weight update."""
        logger.info("tensordb HiCache storage: clear leaves the shared namespace %s",
                    self.namespace)
        return False

    def close(self) -> None:
        """Let go of the namespace (its pages stay for the others). Idempotent."""
        if self.kv is not None:
            self.kv.close()
            self.kv = None
            self.namespace = None

    # -- helpers --------------------------------------------------------------------------
    def _get_into(self, key: bytes, out: torch.Tensor) -> torch.Tensor | None:
        try:
            self._cache().get_into([key], [out])
        except (NotFound, CorruptData) as exc:
            if isinstance(exc, CorruptData):
                logger.warning("tensordb HiCache storage: %s", exc)
            return None
        return out

    def _put(self, keys: list[bytes], values: list[Any]) -> bool:
        for i, v in enumerate(values):
            if not isinstance(v, torch.Tensor):
                raise InvalidInput(f"value {i} must be a torch.Tensor, not {type(v).__name__}")
        try:
            self._cache().put(keys, values)
        except StoreFull as exc:
            logger.warning("tensordb HiCache storage: %d pages not stored: %s", len(keys), exc)
            return False
        return True


def hicache_extra_config(*, namespace: str | None = None,
                         location: Any | None = None, **options: Any) -> dict[str, Any]:
    """The ``--hicache-storage-backend-extra-config`` mapping (with
    ``--hicache-storage-backend dynamic``) that selects this backend."""
    extra: dict[str, Any] = {"backend_name": BACKEND_NAME,
                             "module_path": "engine_bindings.sglang",
                             "class_name": TensorDBHiCacheStorage.__name__, "interface_v1": 1,
                             **_location(location).as_dict()}
    if namespace is not None:
        extra["namespace"] = namespace
    extra.update(options)
    return extra


def _location(location: Any) -> StoreLocation:
    """A ``Database`` (this process's store) or anything ``StoreLocation.parse`` takes."""
    if isinstance(location, tensordb.Database):
        return StoreLocation.of(location)
    return StoreLocation.parse(location)
