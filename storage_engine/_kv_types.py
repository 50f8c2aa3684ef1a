"""Values, errors and layouts of the KV block store (see ``_kv``)."""

from __future__ import annotations

import mmap
import struct
from collections.abc import Iterator
from concurrent.futures import wait
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from ._errors import StorageError
from ._io import io_pool

__all__ = ["BlockView", "KVCorrupt", "KVStats", "KVStoreFull", "bloom_may_hold", "size_class",
           "PAGE", "MAX_KEY"]

PAGE = mmap.ALLOCATIONGRANULARITY
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
MAX_KEY = 255

_WRITING, _HOST, _DISK = 1, 2, 3
# state, pad, slab, chunk, nbytes, checksum, pins; the block's metadata follows
_REC = struct.Struct("<BxxxIIQ8sI")
_SLAB = struct.Struct("<QII")  # chunk size, chunks, chunks in use
_ID = struct.Struct(">I")
_LOC = struct.Struct(">II")  # slab, chunk
_FREE = struct.Struct(">QII")  # chunk size, slab, chunk: a cursor on the size finds one
_I64 = struct.Struct("<q")
_CORRUPT = object()  # what _promote returns for a disk block that fails its checksum


class KVStoreFull(StorageError):
    """The arena has no room for a block and nothing in it can be evicted (every block
    is pinned or being read), or the shared memory itself is exhausted."""

    def __init__(self, message: str, *, needed: int = 0, capacity: int = 0) -> None:
        super().__init__(message)
        self.needed = needed
        self.capacity = capacity


class KVCorrupt(StorageError):
    """Blocks whose bytes no longer match their checksum; they were dropped."""

    def __init__(self, keys: list[bytes]) -> None:
        super().__init__(f"{len(keys)} KV block(s) failed their checksum and were dropped: "
                         + ", ".join(k.hex() for k in keys[:4]))
        self.keys = keys

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.keys,))


@dataclass(frozen=True, slots=True)
class BlockView:
    """A block handed out by ``get``: its bytes (a uint8 view on a private mapping,
    writable but copy-on-write) and the metadata given to ``put``."""

    data: np.ndarray
    meta: bytes


@dataclass(frozen=True, slots=True)
class KVStats:
    blocks: int  # readable blocks, host and disk
    nbytes: int
    host_blocks: int
    host_bytes: int
    disk_blocks: int
    disk_bytes: int
    capacity: int  # bytes the arena may hold
    arena_bytes: int  # bytes of slab files allocated now
    pinned: int
    hits: int
    misses: int
    evictions: int
    spills: int
    corrupt: int
    bloom: bytes  # a Bloom filter of the held keys, see ``bloom_may_hold``
    bloom_hashes: int
    gpu_blocks: int = 0  # blocks with a copy in the GPU tier (also counted above)
    gpu_bytes: int = 0
    gpu_capacity: int = 0  # bytes the GPU tier may hold (0: no GPU tier)
    gpu_arena_bytes: int = 0  # device bytes of GPU slabs allocated now
    gpu_hits: int = 0  # reads served by a GPU copy
    gpu_evictions: int = 0


def size_class(nbytes: int) -> int:
    """The chunk size a block of ``nbytes`` goes in: whole pages up to 64 KiB, then four
    classes per power of two (at most 25 % slack; KV blocks of a namespace usually sit
    exactly on one)."""
    n = max(PAGE, -(-nbytes // PAGE) * PAGE)
    if n <= 16 * PAGE:
        return n
    step = 1 << (n.bit_length() - 3)  # a quarter of the power of two below n
    return -(-n // step) * step


def _bloom_positions(key: bytes, nbits: int, k: int) -> Iterator[int]:
    h = xxhash.xxh3_128_intdigest(key)
    h1, h2 = h & 0xFFFFFFFFFFFFFFFF, (h >> 64) | 1
    for i in range(k):
        yield (h1 + i * h2) % nbits


def bloom_may_hold(bloom: bytes, hashes: int, key: bytes) -> bool:
    """Whether a node whose ``KVStats.bloom`` is ``bloom`` may hold ``key`` (no false
    negatives; about 1 % false positives at the filter's sizing)."""
    nbits = len(bloom) * 8
    return nbits > 0 and all(bloom[p >> 3] >> (p & 7) & 1
                             for p in _bloom_positions(key, nbits, hashes))


def _each(fn: Any, items: list[Any], nbytes: int) -> list[Any]:
    """``[fn(*item) for item in items]``, on the I/O pool when there is enough to share
    (copies and hashes release the GIL)."""
    if nbytes < (8 << 20) or len(items) < 2:
        return [fn(*item) for item in items]
    # one task per thread, over contiguous runs of items, the caller's thread taking the
    # first: a future per block cost more than the copy of a 0.5 MiB block (64 futures
    # and their wake-ups fought the copying threads for the GIL)
    pool = io_pool()
    k = min(pool._max_workers, len(items))
    step = -(-len(items) // k)
    groups = [items[i : i + step] for i in range(0, len(items), step)]

    def run(group: list[Any]) -> list[Any]:
        return [fn(*item) for item in group]

    rest = [pool.submit(run, g) for g in groups[1:]]
    try:
        out = run(groups[0])
    finally:
        wait(rest)  # never return (or raise) while a thread still writes the buffers
    for f in rest:
        out.extend(f.result())
    return out


def _as_bytes(buf: Any) -> np.ndarray:
    if isinstance(buf, np.ndarray):
        if not buf.flags.c_contiguous:
            raise ValueError("a block buffer must be C-contiguous")
        return buf.reshape(-1).view(np.uint8)
    return np.frombuffer(memoryview(buf).cast("B"), dtype=np.uint8)
