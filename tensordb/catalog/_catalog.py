"""``Catalog``: every read and write of a store's metadata, in one place for its callers.

The work is done by four parts, one module each: ``Versions`` (collections, versions,
commits, tags), ``Leases`` (snapshot leases and pins), ``GarbageCollector`` (gc and
version drops) and ``Segments`` (this node's segments). ``Catalog`` builds them over
one SQL engine and hands each call to its part. Each public method is one SQL
transaction.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import timedelta
from pathlib import Path

from sqlalchemy import Connection, Engine, select

import storage_engine as se

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
from ._gc import GarbageCollector
from ._groups import GroupPart, Groups, GroupState
from ._leases import Leases, Opened
from ._manifests import Manifests
from ._segments import Segments
from ._versions import Versions
from .schema import commits

__all__ = ["Catalog"]


class Catalog:
    """Metadata of one store, over a SQL engine. Thread-safe; any process.

    ``node`` is this process's node: the one its segments and leases are recorded on.
    ``lease_engine``: a SQL engine for leases, which die with their holders and need no
    fsync (on SQLite, one with ``synchronous=NORMAL``); the main SQL engine if not given.
    ``manifest_dir``: where this host keeps packed manifests of large versions
    (``_manifests``); None reads every manifest from SQL.
    """

    def __init__(self, engine: Engine, node: str, *, lease_engine: Engine | None = None,
                 manifest_dir: Path | None = None) -> None:
        self.engine = engine
        self.node = node
        self.lease_engine = lease_engine or engine
        self.manifests = Manifests(manifest_dir) if manifest_dir is not None else None
        self._versions = Versions(engine, node, self.manifests)
        self._leases = Leases(engine, self.lease_engine, node, self._versions)
        self._segments = Segments(engine, node)
        self._groups = Groups(engine, node, self._versions)
        self._gc = GarbageCollector(engine, node, self._groups)

    @property
    def retry_seconds(self) -> float:
        """How long a call keeps retrying a lost catalog connection (``_retry``)."""
        return self._versions.retry_seconds

    @retry_seconds.setter
    def retry_seconds(self, seconds: float) -> None:
        for part in (self._versions, self._leases, self._segments, self._groups):
            # gc does not retry
            part.retry_seconds = seconds

    # -- collections, versions, commits, tags: Versions ---------------------------------
    def info(self, name: str) -> CollectionInfo | None:
        return self._versions.info(name)

    def require(self, name: str) -> CollectionInfo:
        """The collection's row; NotFound if there is none."""
        return self._versions.require(name)

    def collection_names(self) -> list[str]:
        return self._versions.collection_names()

    def set_retention(self, name: str, keep_last: int | None) -> None:
        self._versions.set_retention(name, keep_last)

    def drop(self, name: str) -> None:
        self._versions.drop(name)

    def resolve(self, name: str, version: int | None = None, tag: str | None = None,
                conn: Connection | None = None) -> tuple[CollectionInfo, int]:
        """The collection and the version a (version | tag | head) reference names."""
        return self._versions.resolve(name, version, tag, conn)

    def manifest(self, cid: int, version: int, names: Sequence[str] | None = None,
                 conn: Connection | None = None, *, head: bool = False) -> list[TensorRow]:
        """The tensors of one version (or those of ``names``), ordered by name."""
        return self._versions.manifest(cid, version, names, conn, head=head)

    def live(self, cid: int, names: Sequence[str] | None = None) -> dict[str, TensorRow]:
        """The head's rows by name (all, or those of ``names``)."""
        return self._versions.live(cid, names)

    def commit(self, name: str, base: int, puts: Sequence[NewTensor], unchanged: Iterable[str],
               deletes: Iterable[str], segment: tuple[str, str, int] | None,
               message: str | None, meta: dict[str, str] | None = None, *,
               durable: bool = True, more_segments: Sequence[NewSegment] = (),
               shards: Sequence[NewShard] = ()) -> Commit:
        """Publish a new version in one SQL transaction (``Versions.commit``). The packed
        manifest of a large version is queued: ``start_background`` runs it (the next
        commit does, if the caller never does). ``shards``: those of the sharded rows
        of ``puts`` (a row with no segment and some bytes)."""
        if self.manifests is not None:
            self.manifests.start()
        return self._versions.commit(name, base, puts, unchanged, deletes, segment, message,
                                     meta, durable=durable, more_segments=more_segments,
                                     shards=shards)

    def shards(self, cid: int, rows: Sequence[TensorRow]) -> dict[str, list[ShardRow]]:
        """The shards of sharded rows, by name."""
        return self._versions.shards(cid, rows)

    # -- group commits: Groups ----------------------------------------------------------
    def join_group(self, name: str, group: str, rank: int, world_size: int, holder: str,
                   timeout: float) -> int:
        """Enter ``rank`` into a group transaction; the head the group builds on."""
        return self._groups.join(name, group, rank, world_size, holder, timeout)

    def commit_part(self, name: str, group: str, rank: int, part: GroupPart,
                    segment: tuple[str, str, int] | None) -> Commit | None:
        """A rank's part; the Commit when it completed the group (``Groups.commit_part``)."""
        if self.manifests is not None:
            self.manifests.start()
        return self._groups.commit_part(name, group, rank, part, segment)

    def group_state(self, name: str, group: str) -> GroupState | None:
        return self._groups.state(name, group)

    def abort_group(self, name: str, group: str, reason: str) -> None:
        self._groups.abort(name, group, reason)

    def open_groups(self, name: str, prefix: str) -> list[str]:
        """The open groups of ``name`` whose names start with ``prefix``, oldest first."""
        return self._groups.open_named(name, prefix)

    def start_background(self) -> None:
        """Start the work a commit queued (packing its manifest), once the caller has
        what it waited for."""
        if self.manifests is not None:
            self.manifests.start()

    def history(self, name: str, *, after: int | None = None,
                version: int | None = None) -> list[Commit]:
        """Commits of ``name``, newest first: all, those after ``after``, or ``version``."""
        return self._versions.history(name, after=after, version=version)

    def commit_info(self, name: str, version: int) -> Commit:
        return self._versions.commit_info(name, version)

    def commits_after(self, name: str, after: int) -> list[Commit]:
        """The commits after version ``after``, oldest first."""
        return self._versions.commits_after(name, after)

    def tag(self, name: str, tag: str, version: int | None) -> int:
        return self._versions.tag(name, tag, version)

    def untag(self, name: str, tag: str) -> None:
        self._versions.untag(name, tag)

    def tags(self, name: str) -> dict[str, int]:
        return self._versions.tags(name)

    # -- leases and pins: Leases -----------------------------------------------------------
    def open_snapshot(self, name: str, version: int | None, tag: str | None, holder: str,
                      ttl: float) -> Opened:
        """Resolve a version, lease it and read its manifest in one transaction:
        (lease id, collection, version, rows)."""
        return self._leases.open_snapshot(name, version, tag, holder, ttl)

    def release_lease(self, lease_id: str) -> None:
        self._leases.release_lease(lease_id)

    def lease_holders(self) -> list[tuple[str, str, int, str]]:
        """(lease id, collection, version, holder) of every lease."""
        return self._leases.lease_holders()

    def pin(self, name: str, version: int | None, tag: str | None, tier: str) -> int:
        return self._leases.pin(name, version, tag, tier)

    def unpin(self, name: str, version: int | None, tag: str | None, tier: str) -> bool:
        return self._leases.unpin(name, version, tag, tier)

    def pins(self) -> list[tuple[str, int, str]]:
        """(collection, version, tier) of every pin."""
        return self._leases.pins()

    # -- this node's segments: Segments ---------------------------------------------------
    def version_segments(self, cid: int, version: int) -> list[tuple[str, str, int]]:
        """(segment id, tier, nbytes) of this node's segments one version lives in."""
        return self._segments.version_segments(cid, version)

    def pinned_segments(self, tier: str) -> set[str]:
        """Segments that hold bytes of a version pinned in ``tier``."""
        return self._segments.pinned_segments(tier)

    def move_segment(self, segment_id: str, src: str, dst: str) -> bool:
        """Record that a segment now lives in ``dst``; False if it was not in ``src``."""
        return self._segments.move_segment(segment_id, src, dst)

    def segment_tier(self, segment_id: str) -> str | None:
        return self._segments.segment_tier(segment_id)

    def segment_source(self, segment_id: str) -> se.SourceFile | None:
        """The file a segment of this node references in place (None: bytes of its own)."""
        return self._segments.segment_source(segment_id)

    def segment_registered(self, segment_id: str) -> bool:
        return self._segments.segment_registered(segment_id)

    def all_rows(self, segment_id: str | None = None) -> list[tuple[str, int, TensorRow]]:
        """Every stored tensor row (collection name, first version, row) of this node
        (of one segment, when ``segment_id`` is given)."""
        return self._segments.all_rows(segment_id)

    def held_segments(self) -> list[tuple[str, str]]:
        """(segment id, tier) of every segment this node holds, as writer or replica."""
        return self._segments.held_segments()

    def segment_extents(self, segment_id: str) -> list[tuple[int, int, str, str]]:
        """The extents of a segment of this node, as (offset, nbytes, checksum,
        "collection/tensor"): what a check of its bytes compares."""
        return [(r.offset, r.nbytes, r.checksum, f"{coll}/{r.name}")
                for coll, _, r in self._segments.all_rows(segment_id)]

    def stats(self) -> dict[str, int]:
        return self._segments.stats()

    # -- gc: GarbageCollector ---------------------------------------------------------------
    def gc(self) -> GcPlan:
        """Drop what no version, tag, lease or retention rule needs, in one transaction;
        the caller deletes the returned segments' bytes afterwards. Packed manifests of
        commits that are gone are deleted after it."""
        plan = self._gc.gc()
        self.prune_manifests()
        return plan

    def prune_manifests(self) -> int:
        """Delete the packed manifests of commits the catalog no longer has."""
        if self.manifests is None:
            return 0
        with self.engine.connect() as conn:
            keep = set(conn.execute(select(commits.c.txn_id)
                                    .where(commits.c.txn_id.is_not(None))).scalars())
        return self.manifests.prune(keep)

    def close(self) -> None:
        """Finish the manifests being packed in the background."""
        if self.manifests is not None:
            self.manifests.close()

    def drop_versions(self, name: str, keep_last: int | None,
                      older_than: timedelta | None) -> int:
        """Forget versions (never the head, a tagged, pinned or leased one)."""
        return self._gc.drop_versions(name, keep_last, older_than)
