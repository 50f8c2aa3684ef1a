"""tensordb's storage engine: the bytes of tensors on tiers (host shm, disk).

Imports nothing else of tensordb. See ``_tier.Tier`` for the protocol every tier obeys.
"""

from __future__ import annotations

from ._checksum import (ALGORITHM, HASH_PIECE, STREAMING, Hasher, checksum, copy,
                        copy_and_checksum)
from ._errors import SegmentMissing, StorageError, TierFull
from ._files import DiskTier, FileTier, HostTier, shm_root
from ._gpu import GpuError, GpuTier, GpuView
from ._kv import BlockStore, bloom_may_hold
from ._kv_policy import EvictionPolicy, LRUPolicy, S3FIFOPolicy
from ._kv_types import BlockView, KVCorrupt, KVStats, KVStoreFull
from ._io import ALIGN, Source, fill_segment, io_pool, pack
from ._procs import boot_id, current_holder, holder_alive
from ._tier import SegmentWriter, Tier

__all__ = [
    "BlockStore",
    "BlockView",
    "EvictionPolicy",
    "KVCorrupt",
    "KVStats",
    "KVStoreFull",
    "LRUPolicy",
    "S3FIFOPolicy",
    "ALGORITHM",
    "ALIGN",
    "DiskTier",
    "FileTier",
    "GpuError",
    "GpuTier",
    "GpuView",
    "HASH_PIECE",
    "STREAMING",
    "Hasher",
    "HostTier",
    "SegmentMissing",
    "SegmentWriter",
    "Source",
    "StorageError",
    "Tier",
    "TierFull",
    "bloom_may_hold",
    "boot_id",
    "checksum",
    "copy",
    "copy_and_checksum",
    "current_holder",
    "fill_segment",
    "holder_alive",
    "io_pool",
    "pack",
    "shm_root",
]
