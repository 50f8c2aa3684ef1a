"""Disk spill of the KV block store: blocks evicted from the host arena, one file each.

When the store has a ``disk_root``, an evicted block is written to
``<disk_root>/<key hex>-<spill number>.blk`` and its record becomes a DISK record that
keeps the spill number in its slab and chunk fields; a read promotes it back into the
arena. The ``disk`` database queues spills oldest first, so when the spilled bytes pass
``disk_capacity`` the oldest go first. A file doomed by one spill's promotion is never a
later spill's of the same key: their spill numbers differ.

Every method that takes ``txn`` runs inside the caller's write transaction.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable
from pathlib import Path

import lmdb
import numpy as np

from ._kv_index import KVIndex
from ._kv_types import DISK, REC

__all__: list[str] = []  # a part of BlockStore, nothing public

#: drops a spilled block from the store (its record, its GPU copy, its file)
DropSpilled = Callable[[lmdb.Transaction, bytes, bytes], None]


class DiskSpill:
    """The spill files of one store; ``root`` None: evicted blocks are dropped."""

    DB_NAMES = ("disk",)

    def __init__(self, index: KVIndex, root: Path | None, capacity: int | None) -> None:
        self._index = index
        self.root = root
        self.capacity = capacity

    def takes(self, nbytes: int) -> bool:
        """Whether an evicted block of ``nbytes`` goes to disk (else it is dropped)."""
        return self.root is not None and (self.capacity is None or nbytes <= self.capacity)

    def path(self, key: bytes, rec: bytes | memoryview) -> Path:
        """A spilled block's file: named by key and spill number (kept in the record's
        slab and chunk fields)."""
        assert self.root is not None
        _, hi, lo = REC.unpack_from(rec)[:3]
        return self.root / f"{key.hex()}-{hi << 32 | lo:x}.blk"

    def spill(self, txn: lmdb.Transaction, key: bytes, src: np.ndarray, nbytes: int,
              csum: bytes, pins: int, meta: bytes, drop: DropSpilled) -> bytes:
        """Write a block evicted from the arena (its bytes ``src``) to its file and
        return its new DISK record (the caller stores it). Past ``capacity`` the oldest
        spills are dropped with ``drop``."""
        index = self._index
        seq = index.counter(txn, "disk_seq", 1)
        new = REC.pack(DISK, seq >> 32, seq & 0xFFFFFFFF, nbytes, csum, pins) + meta
        path = self.path(key, new)
        # O_TRUNC: a file of this name is one a writer killed in its transaction left
        fd = os.open(path, os.O_CREAT | os.O_TRUNC | os.O_WRONLY | os.O_CLOEXEC, 0o600)
        index.created(path)
        try:
            view = memoryview(src)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
        txn.put(key, new, db=index.dbs["blocks"])
        txn.put(struct.pack(">Q", seq) + key, b"", db=index.dbs["disk"])
        index.counter(txn, "spills", 1)
        index.counter(txn, "disk_blocks", 1)
        if index.counter(txn, "disk_bytes", nbytes) > (self.capacity or 1 << 62):
            self._trim(txn, drop)
        return new

    def _trim(self, txn: lmdb.Transaction, drop: DropSpilled) -> None:
        index = self._index
        limit = self.capacity or 1 << 62
        blocks = index.dbs["blocks"]
        for qkey in list(txn.cursor(db=index.dbs["disk"]).iternext(values=False)):
            if index.counter(txn, "disk_bytes", 0) <= limit:
                break
            qkey = bytes(qkey)
            key = qkey[8:]
            rec = txn.get(key, db=blocks)
            if rec is not None and rec[0] == DISK and \
                    self.path(key, rec).name.endswith(f"-{int(qkey[:8].hex(), 16):x}.blk"):
                if REC.unpack_from(rec)[5]:  # pinned (it found no room in memory)
                    continue
                drop(txn, key, bytes(rec))
            txn.delete(qkey, db=index.dbs["disk"])  # that spill is gone, or this is it

    def read(self, key: bytes, rec: bytes, dst: np.ndarray) -> bool:
        """Read a spilled block into ``dst`` (its size); False if the file is missing
        or short."""
        try:
            with open(self.path(key, rec), "rb", buffering=0) as fh:
                got = fh.readinto(memoryview(dst))
        except FileNotFoundError:
            return False
        return got == dst.size

    def unlist(self, txn: lmdb.Transaction, key: bytes, rec: bytes) -> None:
        """A spilled block leaves the disk (promoted or dropped): uncount it and remove
        its file once the transaction commits."""
        self._index.counter(txn, "disk_blocks", -1)
        self._index.counter(txn, "disk_bytes", -REC.unpack_from(rec)[3])
        self._index.doom(self.path(key, rec))

    def reclaim_orphans(self, txn: lmdb.Transaction) -> None:
        """Remove spill files that the index record of their key does not name (their
        writer died inside its transaction). Runs when a process opens the store."""
        if self.root is None:
            return
        blocks = self._index.dbs["blocks"]
        for entry in os.scandir(self.root):
            if not entry.name.endswith(".blk"):
                continue
            try:
                key = bytes.fromhex(entry.name.split("-", 1)[0])
            except ValueError:
                continue
            rec = txn.get(key, db=blocks) if key else None
            if rec is None or rec[0] != DISK or self.path(key, bytes(rec)).name != entry.name:
                Path(entry.path).unlink(missing_ok=True)
