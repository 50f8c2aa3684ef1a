"""Values, errors and record layouts of the KV block store (see ``_kv``).

The layouts are shared by the store's parts (index, arena, spill, GPU cache), so they
have plain names here; the package exports only the values and errors.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Callable, Iterator
from concurrent.futures import wait
from dataclasses import dataclass
from typing import Any, TypeAlias

import numpy as np
import xxhash

from ._errors import StorageError
from ._io import io_pool, io_pool_workers
from ._kv_keys import index_key

__all__ = ["EVENT_CLEARED", "EVENT_REMOVED", "EVENT_STORED", "MEDIUM_DISK", "MEDIUM_HOST",
           "BlockView", "KVCorrupt", "KVStats", "KVStoreFull", "RawEvent", "bloom_may_hold"]

PAGE = mmap.ALLOCATIONGRANULARITY

SLAB_ID = struct.Struct(">I")
LOC = struct.Struct(">II")  # slab, chunk
FREE = struct.Struct(">QII")  # chunk size, slab, chunk: a cursor on the size finds one
I64 = struct.Struct("<q")
#: GPU slab ids have this bit set, so read leases and deferred frees share the host's
#: tables and rules
GPU_BIT = 0x8000_0000

#: what an event of the store's event ring says (``BlockStore.events_read``), and the
#: tier the block entered or left
EVENT_STORED, EVENT_REMOVED, EVENT_CLEARED = 1, 2, 3
MEDIUM_HOST, MEDIUM_DISK = 0, 1
#: (type, medium, key, meta) of one event
RawEvent: TypeAlias = tuple[int, int, bytes, bytes]

#: a chunk: (slab, chunk)
Loc: TypeAlias = tuple[int, int]
#: which lease holders are alive, cached for the length of one transaction
Alive: TypeAlias = dict[bytes, bool]


class KVStoreFull(StorageError):
    """The arena has no room for a block and nothing in it can be evicted (every block
    is pinned or being read), or the shared memory itself is exhausted."""

    def __init__(self, message: str, *, needed: int = 0, capacity: int = 0) -> None:
        super().__init__(message)
        self.needed = needed
        self.capacity = capacity


class KVIndexDamaged(StorageError):
    """The block store's index cannot be read: its file is not an index of this version
    any more (truncated, overwritten), or the GPU tier's LMDB environment is corrupt. The blocks are a cache:
    removing the store's directory starts it empty."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"the KV block index at {path} is damaged ({reason}); its blocks "
                         f"are a cache: remove {path.rsplit('/', 1)[0]} to start it empty")
        self.path = path


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


#: the smallest chunk: blocks under a page share pages, in power-of-two chunks
MIN_CHUNK = 512


def size_class(nbytes: int) -> int:
    """The chunk size a block of ``nbytes`` goes in: a power of two from 512 bytes below a
    page (small blocks share pages: a 1 KiB block took a 4 KiB chunk, 4 x its memory),
    whole pages up to 64 KiB, then four classes per power of two (at most 25 % slack; KV
    blocks of a namespace usually sit exactly on one)."""
    if nbytes < PAGE:
        return max(MIN_CHUNK, 1 << max(0, nbytes - 1).bit_length())
    n = -(-nbytes // PAGE) * PAGE
    if n <= 16 * PAGE:
        return n
    step = 1 << (n.bit_length() - 3)  # a quarter of the power of two below n
    return -(-n // step) * step


def as_bytes(buf: Any) -> np.ndarray:
    """A C-contiguous buffer as a flat uint8 array over the same memory."""
    if isinstance(buf, np.ndarray):
        if not buf.flags.c_contiguous:
            raise ValueError("a block buffer must be C-contiguous")
        return buf.reshape(-1).view(np.uint8)
    return np.frombuffer(memoryview(buf).cast("B"), dtype=np.uint8)


def bloom_positions(key: bytes, nbits: int, k: int) -> Iterator[int]:
    h = xxhash.xxh3_128_intdigest(key)
    h1, h2 = h & 0xFFFFFFFFFFFFFFFF, (h >> 64) | 1
    for i in range(k):
        yield (h1 + i * h2) % nbits


def bloom_size(n: int, fp: float) -> tuple[int, int]:
    """The bits and hashes of a Bloom filter of about ``n`` keys at false-positive rate
    ``fp``: m = -n ln p / ln^2 2 bits (a multiple of 8), k = m/n ln 2 hashes."""
    nbits = max(1024, int(-max(n, 1) * np.log(fp) / (np.log(2) ** 2)))
    nbits = -(-nbits // 8) * 8
    return nbits, min(max(1, round(nbits / max(n, 1) * np.log(2))), 16)


def bloom_may_hold(bloom: bytes, hashes: int, key: bytes) -> bool:
    """Whether a node whose ``KVStats.bloom`` is ``bloom`` may hold ``key`` (no false
    negatives; about 1 % false positives at the filter's sizing)."""
    nbits = len(bloom) * 8
    return nbits > 0 and all(bloom[p >> 3] >> (p & 7) & 1
                             for p in bloom_positions(index_key(key), nbits, hashes))


def each(fn: Callable[..., Any], items: list[Any], nbytes: int) -> list[Any]:
    """``[fn(*item) for item in items]``, on the I/O pool when there is enough to share
    (copies and hashes release the GIL)."""
    if nbytes < (8 << 20) or len(items) < 2:
        return [fn(*item) for item in items]
    # one task per thread, over contiguous runs of items, the caller's thread taking the
    # first: a future per block cost more than the copy of a 0.5 MiB block (64 futures
    # and their wake-ups fought the copying threads for the GIL)
    pool = io_pool()
    k = min(io_pool_workers(), len(items))
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
