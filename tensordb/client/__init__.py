"""The client facade: ``Database`` and the handles it gives out.

This is the layer above ``query`` and ``transport`` (see docs/architecture.md): it
drives the catalog and the storage engine, and is the only part of ``tensordb`` that
may import those two packages. Users reach it through ``tensordb.connect``.
"""

from __future__ import annotations

from ._database import Database
from ._kv_cache import KVCache
from ._kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVBlockInfo,
    KVEventBatch,
    KVEventPublisher,
    KVEvents,
)
from ._kv_namespace import KVNodeSummary
from ._maintenance import Corruption, GcReport, ScrubReport
from ._model_files import CHECKOUT_MARKER
from ._orphans import ShmArea, find_areas, remove_area
from ._placement import EvictReport
from ._safetensors import export_safetensors, import_safetensors
from ._safetensors_format import INDEX_NAME, LAYOUT_KEY, MAX_HEADER_SIZE, SAFETENSORS_DTYPES
from ._snapshot import Shard, Snapshot
from ._transaction import Transaction

__all__ = [
    "CHECKOUT_MARKER",
    "INDEX_NAME",
    "LAYOUT_KEY",
    "MAX_HEADER_SIZE",
    "SAFETENSORS_DTYPES",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "KVBlockInfo",
    "KVEventBatch",
    "KVEventPublisher",
    "KVEvents",
    "Corruption",
    "Database",
    "EvictReport",
    "GcReport",
    "ScrubReport",
    "KVCache",
    "KVNodeSummary",
    "Shard",
    "ShmArea",
    "Snapshot",
    "Transaction",
    "export_safetensors",
    "find_areas",
    "import_safetensors",
    "remove_area",
]
