"""The catalog: collections, versions, tensor rows, segments, tags, leases and nodes."""

from __future__ import annotations

from ._catalog import Catalog, CollectionInfo, Commit, GcPlan, NewTensor, TensorRow
from ._nodes import NodeDirectory, NodeInfo, SegmentInfo
from ._engine import current_revision, ensure_schema, make_engine, upgrade, write_conn
from .schema import HEAD_REVISION, metadata

__all__ = [
    "HEAD_REVISION",
    "Catalog",
    "CollectionInfo",
    "Commit",
    "GcPlan",
    "NewTensor",
    "NodeDirectory",
    "NodeInfo",
    "SegmentInfo",
    "TensorRow",
    "current_revision",
    "ensure_schema",
    "make_engine",
    "metadata",
    "upgrade",
    "write_conn",
]
