"""The catalog: collections, versions, tensor rows, segments, tags, leases and nodes.

``Catalog`` is every read and write of a store's metadata; ``NodeDirectory`` the
cluster's nodes and segment replicas; ``schema`` (public) the tables. The functions of
``_sql`` make and migrate the SQL engines they run on.
"""

from __future__ import annotations

from ._catalog import Catalog
from ._common import (
    CollectionInfo,
    Commit,
    GcPlan,
    NewSegment,
    NewShard,
    NewTensor,
    ShardRow,
    TensorRow,
)
from ._groups import (
    GroupPart,
    GroupState,
    PartShard,
    box_copies,
    check_tiling,
    combined_checksum,
)
from ._manifests import CHUNK_ROWS, PACK_MIN_ROWS, Manifest
from ._nodes import Beat, NodeDirectory, NodeInfo, SegmentInfo
from ._quotas import Quota, Quotas, check_quotas
from ._sql import (
    current_revision,
    ensure_schema,
    make_engine,
    notify_after_commit,
    upgrade,
    write_conn,
)
from ._tokens import ACTIONS, NODE_ROLE, ROLES, Grant, TokenInfo, TokenStore, check_scope
from .schema import HEAD_REVISION, metadata

__all__ = [
    "HEAD_REVISION",
    "Quota",
    "Quotas",
    "check_quotas",
    "ACTIONS",
    "NODE_ROLE",
    "ROLES",
    "Grant",
    "TokenInfo",
    "TokenStore",
    "check_scope",
    "CHUNK_ROWS",
    "PACK_MIN_ROWS",
    "Beat",
    "Manifest",
    "Catalog",
    "CollectionInfo",
    "Commit",
    "GcPlan",
    "GroupPart",
    "GroupState",
    "NewSegment",
    "NewShard",
    "NewTensor",
    "PartShard",
    "ShardRow",
    "NodeDirectory",
    "NodeInfo",
    "SegmentInfo",
    "TensorRow",
    "box_copies",
    "check_tiling",
    "combined_checksum",
    "current_revision",
    "ensure_schema",
    "make_engine",
    "metadata",
    "notify_after_commit",
    "upgrade",
    "write_conn",
]
