"""tensordb's storage engine: the bytes of tensors on tiers (host shm, disk, GPU) and
the KV block store.

Imports nothing else of tensordb. ``Tier`` is the ABC every tier implements, with
capability properties (``supports_gpu``, ``persistent``, ``file_backed``) that callers
read instead of the tier's type; ``SegmentView`` is what ``Tier.open`` returns, on the
host or on a device. ``storage_engine.testing.TierTests`` is the contract suite a tier
passes. See docs/storage.md.

The compiled extension ``storage_engine._stream`` (``_stream.c`` and the KV library ``kv/*.c``: the
streaming copies and the KV store's native index) is required: without it the package
does not import, and says how to build it.
"""

from __future__ import annotations

try:
    from . import _stream  # noqa: F401 - the gate: every module below needs it
except ImportError as _exc:
    raise ImportError(
        "storage_engine's C extension storage_engine._stream (storage_engine/_stream.c, "
        "kv/*.c: the streaming copies and the KV store's native index) is not built "
        f"or does not load ({_exc}); it is required. Rebuild it with a C compiler "
        "installed (gcc): pip install -e . (or make test, which does)"
    ) from _exc

from ._checksum import ALGORITHM, HASH_PIECE, STREAMING, Hasher, checksum, copy, copy_and_checksum
from ._cuda import GpuError
from ._disk import Adoption, DiskTier
from ._errors import SegmentMissing, SourceChanged, StorageError, TierFull
from ._files import FileTier, HostTier, HostView, shm_root
from ._gpu import GpuTier, GpuView
from ._integrity import WHOLE, Marks, check_extents
from ._io import (
    ALIGN,
    BATCH_FILL,
    Source,
    fill_from_addresses,
    fill_from_file,
    fill_segment,
    io_pool,
    io_workers,
    pack,
)
from ._kv import BlockStore, kept_mappings
from ._kv_eviction import Eviction, LRUEviction
from ._kv_gpu import GpuBlockView
from ._kv_keys import chain_keys, keys_fit
from ._kv_types import (
    EVENT_CLEARED,
    EVENT_REMOVED,
    EVENT_STORED,
    MEDIUM_DISK,
    MEDIUM_HOST,
    BlockView,
    KVCorrupt,
    KVIndexDamaged,
    KVStats,
    KVStoreFull,
    RawEvent,
    bloom_may_hold,
)
from ._latency import BUCKETS, OPS, LatencyLog, LatencySums, latency_log, read_latencies
from ._pool import try_lock_file
from ._procs import boot_id, current_holder, gc_paused, holder_alive
from ._sources import SourceFile
from ._tier import Pooling, Prefaulting, SegmentView, SegmentWriter, Tier, arrow_buffer
from ._work import WorkCounts, add_work, counting, work_counts

__all__ = [
    "BUCKETS",
    "OPS",
    "LatencyLog",
    "LatencySums",
    "latency_log",
    "read_latencies",
    "ALGORITHM",
    "EVENT_CLEARED",
    "EVENT_REMOVED",
    "EVENT_STORED",
    "MEDIUM_DISK",
    "MEDIUM_HOST",
    "RawEvent",
    "ALIGN",
    "Adoption",
    "BATCH_FILL",
    "BlockStore",
    "BlockView",
    "DiskTier",
    "Eviction",
    "FileTier",
    "GpuBlockView",
    "GpuError",
    "GpuTier",
    "GpuView",
    "HASH_PIECE",
    "Hasher",
    "HostTier",
    "HostView",
    "KVCorrupt",
    "KVIndexDamaged",
    "KVStats",
    "KVStoreFull",
    "LRUEviction",
    "Marks",
    "Pooling",
    "Prefaulting",
    "STREAMING",
    "SegmentMissing",
    "SegmentView",
    "SegmentWriter",
    "SourceChanged",
    "SourceFile",
    "Source",
    "StorageError",
    "Tier",
    "TierFull",
    "WHOLE",
    "WorkCounts",
    "add_work",
    "arrow_buffer",
    "bloom_may_hold",
    "boot_id",
    "chain_keys",
    "check_extents",
    "checksum",
    "copy",
    "copy_and_checksum",
    "counting",
    "try_lock_file",
    "current_holder",
    "fill_from_addresses",
    "fill_from_file",
    "fill_segment",
    "gc_paused",
    "holder_alive",
    "io_pool",
    "io_workers",
    "kept_mappings",
    "keys_fit",
    "pack",
    "shm_root",
    "work_counts",
]
