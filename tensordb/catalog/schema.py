"""The catalog schema (SQLAlchemy Core). Alembic revisions in migrations/ build it.

Tensor rows are version intervals: a row is part of every version v with
``first_version <= v < end_version`` (``end_version`` NULL: still in the head). A
commit that changes 1 tensor of 1,000 closes 1 row and adds 1; the other 999 rows are
shared with the previous version, and so are their extents.
"""

from __future__ import annotations

from datetime import datetime, timezone

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    DateTime,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    text,
    true,
)
from sqlalchemy.types import TypeDecorator

__all__ = [
    "metadata",
    "collections",
    "commits",
    "tensors",
    "segments",
    "tags",
    "leases",
    "nodes",
    "pins",
    "policies",
    "policy_runs",
    "kv_namespaces",
    "segment_replicas",
    "segment_sources",
    "tensor_shards",
    "commit_groups",
    "group_parts",
    "access_tokens",
    "UTCDateTime",
    "HEAD_REVISION",
]

#: the Alembic revision this code writes and reads
HEAD_REVISION = "0011"


class UTCDateTime(TypeDecorator[datetime]):
    """Timezone-aware UTC datetimes on every backend (SQLite stores them naive)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: object) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            value = value.replace(tzinfo=timezone.utc)
        value = value.astimezone(timezone.utc)
        return value.replace(tzinfo=None) if getattr(dialect, "name", "") == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: object) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=timezone.utc) if value.tzinfo is None else value


metadata = MetaData(
    naming_convention={
        "ix": "ix_%(table_name)s_%(column_0_N_name)s",
        "uq": "uq_%(table_name)s_%(column_0_name)s",
        "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
        "pk": "pk_%(table_name)s",
    }
)

collections = Table(
    "collections",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("name", String(255), nullable=False, unique=True),
    Column("head", Integer, nullable=False, server_default="0"),
    Column("created_at", UTCDateTime, nullable=False),
    # keep the last N versions (NULL: keep all); added by revision 0002
    Column("retain_last", Integer, nullable=True),
)

commits = Table(
    "commits",
    metadata,
    Column("collection_id", Integer, ForeignKey("collections.id", ondelete="CASCADE"),
           primary_key=True),
    Column("version", Integer, primary_key=True),
    Column("parent", Integer, nullable=True),
    Column("message", Text, nullable=True),
    Column("created_at", UTCDateTime, nullable=False),
    Column("n_tensors", Integer, nullable=False),
    Column("nbytes", BigInteger, nullable=False),
    Column("n_written", Integer, nullable=False),
    Column("written_nbytes", BigInteger, nullable=False),
    # JSON text the writer attached (e.g. safetensors __metadata__); added by 0002
    Column("meta", Text, nullable=True),
    # the writer's id for this commit: a retry after a lost connection finds it (0006)
    Column("txn_id", String(32), nullable=True),
    Index("uq_commits_txn_id", "txn_id", unique=True),
)

tensors = Table(
    "tensors",
    metadata,
    Column("collection_id", Integer, ForeignKey("collections.id", ondelete="CASCADE"),
           primary_key=True),
    Column("name", String(1024), primary_key=True),
    Column("first_version", Integer, primary_key=True),
    Column("end_version", Integer, nullable=True),
    Column("dtype", String(32), nullable=False),
    Column("shape", Text, nullable=False),  # "4096,4096"; "" for a 0-d tensor
    Column("nbytes", BigInteger, nullable=False),
    Column("checksum", String(32), nullable=False),
    Column("segment_id", String(32), nullable=True),  # NULL for a tensor of no bytes
    Column("offset", BigInteger, nullable=False),
    # closed rows by collection and end (gc, version manifests); head rows are served by
    # uq_tensors_head below: revision 0008 says why the two do not overlap
    Index("ix_tensors_closed", "collection_id", "end_version",
          sqlite_where=text("end_version IS NOT NULL"),
          postgresql_where=text("end_version IS NOT NULL")),
    Index("ix_tensors_segment", "segment_id"),
    # the head's rows: one per name; added by revision 0003
    Index("uq_tensors_head", "collection_id", "name", unique=True,
          sqlite_where=text("end_version IS NULL"),
          postgresql_where=text("end_version IS NULL")),
)

segments = Table(
    "segments",
    metadata,
    Column("id", String(32), primary_key=True),
    Column("node", String(255), nullable=False),
    Column("tier", String(16), nullable=False),
    Column("nbytes", BigInteger, nullable=False),
    Column("created_at", UTCDateTime, nullable=False),
    # the collection whose commit stored it (NULL: stored before 0011 and pointed to by
    # no row); no foreign key: a dropped collection's segments wait for gc
    Column("collection_id", Integer, nullable=True),
    Index("ix_segments_collection", "collection_id", "nbytes"),  # the sums read it alone
)

tags = Table(
    "tags",
    metadata,
    Column("collection_id", Integer, ForeignKey("collections.id", ondelete="CASCADE"),
           primary_key=True),
    Column("name", String(255), primary_key=True),
    Column("version", Integer, nullable=False),
    Column("created_at", UTCDateTime, nullable=False),
)

leases = Table(
    "leases",
    metadata,
    Column("id", String(32), primary_key=True),
    Column("collection_id", Integer, ForeignKey("collections.id", ondelete="CASCADE"),
           nullable=False),
    Column("version", Integer, nullable=False),
    Column("holder", String(255), nullable=False),  # boot_id:pid:start_ticks
    Column("node", String(255), nullable=False),
    Column("created_at", UTCDateTime, nullable=False),
    Column("expires_at", UTCDateTime, nullable=False),
    Index("ix_leases_collection", "collection_id", "version"),
)

nodes = Table(
    "nodes",
    metadata,
    Column("name", String(255), primary_key=True),
    Column("address", String(255), nullable=True),
    Column("tiers", Text, nullable=False, server_default="[]"),
    Column("capacity", BigInteger, nullable=True),
    Column("heartbeat_at", UTCDateTime, nullable=True),
    Column("state", String(16), nullable=False, server_default="up"),
)

# -- revision 0004 ------------------------------------------------------------------------

#: a pinned version keeps its bytes in ``tier``: gc and eviction leave it alone
pins = Table(
    "pins",
    metadata,
    Column("collection_id", Integer, ForeignKey("collections.id", ondelete="CASCADE"),
           primary_key=True),
    Column("version", Integer, primary_key=True),
    Column("tier", String(16), primary_key=True),
    Column("created_at", UTCDateTime, nullable=False),
)

#: stored policies: trigger is 'every' (schedule: an interval such as '10 minutes'),
#: 'cron' (schedule: a crontab expression) or 'commit' (schedule: a collection name)
policies = Table(
    "policies",
    metadata,
    Column("name", String(255), primary_key=True),
    Column("trigger", String(16), nullable=False),
    Column("schedule", Text, nullable=False),
    Column("statement", Text, nullable=False),
    Column("enabled", Boolean, nullable=False, server_default=true()),
    Column("created_at", UTCDateTime, nullable=False),
)

#: one row per policy run: outcome 'ok' or 'error' (detail: the error), attempt from 1
policy_runs = Table(
    "policy_runs",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("policy", String(255), nullable=False),
    Column("attempt", Integer, nullable=False, server_default="1"),
    Column("started_at", UTCDateTime, nullable=False),
    Column("finished_at", UTCDateTime, nullable=True),
    Column("outcome", String(16), nullable=False),
    Column("detail", Text, nullable=True),
    Index("ix_policy_runs_policy", "policy", "started_at"),
)

#: KV block stores per node (filled by the KV store)
kv_namespaces = Table(
    "kv_namespaces",
    metadata,
    Column("name", String(255), primary_key=True),
    Column("block_tokens", Integer, nullable=False),
    Column("node", String(255), primary_key=True),
    Column("blocks", BigInteger, nullable=False, server_default="0"),
    Column("nbytes", BigInteger, nullable=False, server_default="0"),
    Column("created_at", UTCDateTime, nullable=False),
)

# -- revision 0005 ------------------------------------------------------------------------

#: copies of a segment on nodes other than the one that wrote it (cluster mode): a row
#: is added once the copy's checksums are verified, and goes with its segment
segment_replicas = Table(
    "segment_replicas",
    metadata,
    Column("segment_id", String(32), ForeignKey("segments.id", ondelete="CASCADE"),
           primary_key=True),
    Column("node", String(255), primary_key=True),
    Column("tier", String(16), nullable=False),
    Column("created_at", UTCDateTime, nullable=False),
    Index("ix_segment_replicas_node", "node"),
)

# -- revision 0007 ------------------------------------------------------------------------

#: segments committed in place by reference: the file the segment's bytes are, and what
#: was recorded of it at the commit (size, mtime, inode, device: every open compares
#: them); the row goes with its segment. ``inode`` and ``dev`` are stored as signed
#: 64-bit (values past 2**63 wrap), compared after the same conversion
segment_sources = Table(
    "segment_sources",
    metadata,
    Column("segment_id", String(32), ForeignKey("segments.id", ondelete="CASCADE"),
           primary_key=True),
    Column("path", Text, nullable=False),
    Column("nbytes", BigInteger, nullable=False),
    Column("mtime_ns", BigInteger, nullable=False),
    Column("inode", BigInteger, nullable=False),
    Column("dev", BigInteger, nullable=False),
    Column("created_at", UTCDateTime, nullable=False),
)

# -- revision 0009 ------------------------------------------------------------------------

#: the shards of a sharded tensor row (its ``segment_id`` NULL, its ``nbytes`` the whole
#: tensor's): each shard is a box of the global shape (``offsets``, ``shape``, as text
#: like the row's shape) whose bytes lie at ``offset`` of ``segment_id``, contiguous, with
#: their own checksum; ``rank``: the rank of the group that wrote it. The shards of a row
#: tile its global shape exactly (checked when the group publishes)
tensor_shards = Table(
    "tensor_shards",
    metadata,
    Column("collection_id", Integer, ForeignKey("collections.id", ondelete="CASCADE"),
           primary_key=True),
    Column("name", String(1024), primary_key=True),
    Column("first_version", Integer, primary_key=True),
    Column("idx", Integer, primary_key=True),
    Column("rank", Integer, nullable=False),
    Column("offsets", Text, nullable=False),
    Column("shape", Text, nullable=False),
    Column("nbytes", BigInteger, nullable=False),
    Column("checksum", String(32), nullable=False),
    Column("segment_id", String(32), nullable=True),  # NULL for a shard of no bytes
    Column("offset", BigInteger, nullable=False),
    Index("ix_tensor_shards_segment", "segment_id"),
)

#: group transactions: the ranks of a job each commit a part; the version appears when
#: the last part lands. ``state``: 'open', 'published' (``version`` set) or 'aborted'
#: (``reason`` says why). Keyed by collection name: a group may create its collection
commit_groups = Table(
    "commit_groups",
    metadata,
    Column("collection", String(255), primary_key=True),
    Column("name", String(255), primary_key=True),
    Column("world_size", Integer, nullable=False),
    Column("base", Integer, nullable=False),
    Column("state", String(16), nullable=False),
    Column("version", Integer, nullable=True),
    Column("reason", Text, nullable=True),
    Column("created_at", UTCDateTime, nullable=False),
    Column("deadline", UTCDateTime, nullable=False),
)

#: one row per rank of a group: 'joined' when its transaction began (``holder`` names the
#: process, so a dead rank aborts the group), 'ready' when its part is written: its bytes
#: in ``segment_id`` (registered in ``segments``, kept by this row until the group ends)
#: and ``part`` (JSON: the rank's shards, whole tensors, deletes and metadata)
group_parts = Table(
    "group_parts",
    metadata,
    Column("collection", String(255), primary_key=True),
    Column("group_name", String(255), primary_key=True),
    Column("rank", Integer, primary_key=True),
    Column("holder", String(255), nullable=False),
    Column("node", String(255), nullable=False),
    Column("state", String(16), nullable=False),
    Column("segment_id", String(32), nullable=True),
    Column("part", Text, nullable=True),
    Column("created_at", UTCDateTime, nullable=False),
    Index("ix_group_parts_segment", "segment_id"),
)

# -- revision 0010 ------------------------------------------------------------------------

#: scoped access tokens of the node servers' network API: ``id`` is the token's public
#: part, ``secret_hash`` the SHA-256 of its secret (hex; the secret itself is printed
#: once, when the token is made, and kept nowhere), ``role`` one of read / write / admin,
#: ``scope`` a glob over collection and KV namespace names; a revoked token keeps its row
#: (``revoked_at`` set) so that listing shows it
#: byte quotas per tenant: a scope glob over collection names (``*`` and ``?`` only)
quotas = Table(
    "quotas",
    metadata,
    Column("scope", String(255), primary_key=True),
    Column("max_bytes", BigInteger, nullable=False),
    Column("created_at", UTCDateTime, nullable=False),
)

access_tokens = Table(
    "access_tokens",
    metadata,
    Column("id", String(32), primary_key=True),
    Column("secret_hash", String(64), nullable=False),
    Column("role", String(16), nullable=False),
    Column("scope", String(255), nullable=False),
    Column("note", Text, nullable=True),
    Column("created_at", UTCDateTime, nullable=False),
    Column("revoked_at", UTCDateTime, nullable=True),
)
