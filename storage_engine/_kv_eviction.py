"""Eviction orders of the KV block store, with their state in the store's LMDB index.

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

__all__ = ["Eviction", "LRUEviction", "S3FIFOEviction"]

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


class S3FIFOEviction(Eviction):
    """S3-FIFO (Yang et al., SOSP 2023): a small FIFO that filters one-hit wonders, a
    main FIFO with lazy promotion, and a ghost FIFO of keys recently evicted from the
    small queue (a key seen in the ghost goes straight to main when it comes back).
    Sizes are counted in blocks; KV blocks of one namespace have one size."""

    name = "s3fifo"
    db_names = ("s3_pos", "s3_queue", "s3_ghost", "s3_ghostq")
    small_ratio = 0.1
    _POS = struct.Struct(">BQB")  # queue (0 small, 1 main), seq, freq (0..3)

    def _push(self, txn: Any, key: bytes, queue: int, freq: int = 0) -> None:
        seq = self.counter(txn, "policy_seq", 1)
        txn.put(key, self._POS.pack(queue, seq, freq), db=self.dbs["s3_pos"])
        txn.put(bytes([queue]) + _U64.pack(seq) + key, b"", db=self.dbs["s3_queue"])
        self.counter(txn, f"s3_len{queue}", 1)

    def _unlink(self, txn: Any, key: bytes) -> tuple[int, int] | None:
        raw = txn.pop(key, db=self.dbs["s3_pos"])
        if raw is None:
            return None
        queue, seq, freq = self._POS.unpack(raw)
        txn.delete(bytes([queue]) + _U64.pack(seq) + key, db=self.dbs["s3_queue"])
        self.counter(txn, f"s3_len{queue}", -1)
        return queue, freq

    def on_insert(self, txn: Any, key: bytes) -> None:
        self._unlink(txn, key)
        gseq = txn.pop(key, db=self.dbs["s3_ghost"])
        if gseq is not None:
            txn.delete(gseq + key, db=self.dbs["s3_ghostq"])
            self.counter(txn, "s3_ghost_len", -1)
            self._push(txn, key, 1)
        else:
            self._push(txn, key, 0)

    def on_access(self, txn: Any, key: bytes) -> None:
        raw = txn.get(key, db=self.dbs["s3_pos"])
        if raw is not None:
            queue, seq, freq = self._POS.unpack(raw)
            if freq < 3:
                txn.put(key, self._POS.pack(queue, seq, freq + 1), db=self.dbs["s3_pos"])

    def on_remove(self, txn: Any, key: bytes) -> None:
        self._unlink(txn, key)

    def _ghost(self, txn: Any, key: bytes) -> None:
        seq = _U64.pack(self.counter(txn, "policy_seq", 1))
        txn.put(key, seq, db=self.dbs["s3_ghost"])
        txn.put(seq + key, b"", db=self.dbs["s3_ghostq"])
        # the ghost remembers as many keys as the main queue holds
        limit = max(16, self.counter(txn, "s3_len1", 0) + self.counter(txn, "s3_len0", 0))
        if self.counter(txn, "s3_ghost_len", 1) > limit:
            cur = txn.cursor(db=self.dbs["s3_ghostq"])
            if cur.first():
                old = bytes(cur.key())
                cur.delete()
                txn.delete(old[8:], db=self.dbs["s3_ghost"])
                self.counter(txn, "s3_ghost_len", -1)

    def _head(self, txn: Any, queue: int) -> bytes | None:
        cur = txn.cursor(db=self.dbs["s3_queue"])
        if cur.set_range(bytes([queue])):
            k = bytes(cur.key())
            if k[0] == queue:
                return k[9:]
        return None

    def victim(self, txn: Any, evictable: Callable[[bytes], bool]) -> bytes | None:
        small = self.counter(txn, "s3_len0", 0)
        main = self.counter(txn, "s3_len1", 0)
        # each resident key is moved at most a few times (freq <= 3) before a verdict
        budget = 5 * (small + main) + 8
        refused: set[bytes] = set()
        while budget > 0:
            budget -= 1
            small = self.counter(txn, "s3_len0", 0)
            main = self.counter(txn, "s3_len1", 0)
            if small + main == 0:
                return None
            from_small = small > 0 and (small > self.small_ratio * (small + main) or main == 0)
            queue = 0 if from_small else 1
            key = self._head(txn, queue)
            if key is None:
                return None
            _, _, freq = self._POS.unpack(txn.get(key, db=self.dbs["s3_pos"]))
            if key in refused:
                if len(refused) >= small + main:
                    return None
                self._unlink(txn, key)
                self._push(txn, key, queue, freq)
                continue
            if queue == 0:
                if freq >= 1:  # touched while in probation: promote to main
                    self._unlink(txn, key)
                    self._push(txn, key, 1)
                    continue
                if evictable(key):
                    self._ghost(txn, key)
                    return key
            else:
                if freq > 0:  # lazy promotion: one more round in main
                    self._unlink(txn, key)
                    self._push(txn, key, 1, freq - 1)
                    continue
                if evictable(key):
                    return key
            refused.add(key)  # pinned or being read: rotate it to the tail
            self._unlink(txn, key)
            self._push(txn, key, queue, freq)
        return None


def make_eviction(eviction: str | Eviction) -> Eviction:
    """An eviction by name (``"lru"``, ``"s3fifo"``), or the one given."""
    if isinstance(eviction, Eviction):
        return eviction
    for cls in (LRUEviction, S3FIFOEviction):
        if eviction == cls.name:
            return cls()
    raise ValueError(f"unknown eviction {eviction!r}; known: 'lru', 's3fifo'")
