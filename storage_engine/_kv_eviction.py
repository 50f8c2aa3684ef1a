"""The eviction order of the KV store's GPU tier, with its state in the tier's LMDB index.

(The host arena's orders, LRU and S3-FIFO, run in the native index, ``storage_engine/kv/evict.c``.)
The state lives in LMDB, not in a process, so every process attached to one store
shares one eviction order. Each method runs inside the caller's LMDB write transaction
(``txn``) and must not open one of its own. An eviction only orders blocks resident in
the host arena; pins and read leases are the store's business: ``victim`` asks the
store's ``evictable`` callback and skips what it refuses.

The shared sequence counter keeps its stored name, ``policy_seq``: stores made before
the rename to "eviction" count on in it.
"""

from __future__ import annotations

import struct
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

__all__ = ["Eviction", "LRUEviction"]

_U64 = struct.Struct(">Q")  # big-endian: LMDB orders keys bytewise, so seq order = age order


class Eviction(ABC):
    """Orders the host-resident blocks for eviction.

    ``dbs`` are the named LMDB databases the eviction may use (opened by the store from
    ``db_names``); ``counter(txn, name, delta)`` is the store's shared counter.
    """

    #: the name given to ``BlockStore(eviction=...)``
    name: str = ""
    #: the LMDB databases this eviction keeps its state in
    db_names: tuple[str, ...] = ()

    def bind(self, dbs: dict[str, Any], counter: Callable[[Any, str, int], int]) -> None:
        self.dbs = dbs
        self.counter = counter

    @abstractmethod
    def on_insert(self, txn: Any, key: bytes) -> None:
        """``key`` became resident in the host arena."""

    @abstractmethod
    def on_access(self, txn: Any, key: bytes) -> None:
        """``key`` was read."""

    @abstractmethod
    def on_remove(self, txn: Any, key: bytes) -> None:
        """``key`` left the host arena (evicted, deleted or dropped as corrupt)."""

    @abstractmethod
    def victim(self, txn: Any, evictable: Callable[[bytes], bool]) -> bytes | None:
        """The next key to evict, or None when no resident key is evictable. The eviction
        may reorder its state on the way (promotions); the caller then evicts the key and
        calls ``on_remove``."""


class LRUEviction(Eviction):
    """Least recently used: a queue keyed by a shared sequence number."""

    name = "lru"
    db_names = ("lru_pos", "lru_queue")

    def _push(self, txn: Any, key: bytes) -> None:
        seq = _U64.pack(self.counter(txn, "policy_seq", 1))
        txn.put(key, seq, db=self.dbs["lru_pos"])
        txn.put(seq + key, b"", db=self.dbs["lru_queue"])

    def on_insert(self, txn: Any, key: bytes) -> None:
        self.on_remove(txn, key)
        self._push(txn, key)

    def on_access(self, txn: Any, key: bytes) -> None:
        self.on_insert(txn, key)

    def on_remove(self, txn: Any, key: bytes) -> None:
        seq = txn.pop(key, db=self.dbs["lru_pos"])
        if seq is not None:
            txn.delete(seq + key, db=self.dbs["lru_queue"])

    def victim(self, txn: Any, evictable: Callable[[bytes], bool]) -> bytes | None:
        cur = txn.cursor(db=self.dbs["lru_queue"])
        for qkey in cur.iternext(keys=True, values=False):
            key = bytes(qkey[8:])
            if evictable(key):
                return key
        return None
