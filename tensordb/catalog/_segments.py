"""Segments: the files of tensor bytes, as the catalog records them.

A commit registers its segment (id, node, tier, size) in the same transaction as its
rows; eviction skips the segments a pin holds, and eviction and promotion move a
segment between tiers here after moving its file; gc deletes the rows of segments no
tensor row refers to any more. Replicas of a segment on other nodes are
``NodeDirectory``'s.
"""

from __future__ import annotations

from sqlalchemy import Engine, Join, and_, delete, func, or_, select, text, update

import storage_engine as se

from ._common import TensorRow, parse_shape, source_of
from ._retry import RETRY_SECONDS, retrying
from ._sql import write_conn
from .schema import (
    collections,
    leases,
    pins,
    segment_replicas,
    segment_sources,
    segments,
    tensor_shards,
    tensors,
)

__all__ = ["Segments", "shards_of_rows"]


def shards_of_rows() -> Join:
    """``tensor_shards`` joined to the row each shard belongs to (``tensors``): a
    version's segments are those of its rows and of its sharded rows' shards."""
    t, s = tensors.c, tensor_shards.c
    return tensor_shards.join(tensors, and_(t.collection_id == s.collection_id,
                                            t.name == s.name,
                                            t.first_version == s.first_version))

#: a reader's look-up of a file committed in place, as text: a fresh process's first use
#: of a Core construct pays its compilation (milliseconds), text() microseconds
_SQL_SOURCE = text(
    "SELECT s.path, s.nbytes, s.mtime_ns, s.inode, s.dev FROM segment_sources s "
    "JOIN segments g ON g.id = s.segment_id WHERE s.segment_id = :sid AND g.node = :node")


class Segments:
    """Segments over the catalog's SQL engine: where this node's are, which a pin holds,
    what they hold, and the store's counts. ``node``: the node whose segments
    ``version_segments``, ``move_segment``, ``segment_tier`` and ``all_rows`` see."""

    def __init__(self, engine: Engine, node: str) -> None:
        self.engine = engine
        self.node = node
        #: how long a call keeps retrying a lost catalog connection (``_retry``)
        self.retry_seconds = RETRY_SECONDS

    @retrying
    def version_segments(self, cid: int, version: int) -> list[tuple[str, str, int]]:
        """(segment id, tier, nbytes) of the segments one version's tensors live in."""
        t = tensors.c
        live = (t.collection_id == cid, t.first_version <= version,
                or_(t.end_version.is_(None), t.end_version > version),
                segments.c.node == self.node)
        rows = (select(segments.c.id, segments.c.tier, segments.c.nbytes)
                .select_from(tensors.join(segments, segments.c.id == t.segment_id)).where(*live))
        q = rows.union(select(segments.c.id, segments.c.tier, segments.c.nbytes)
                       .select_from(shards_of_rows().join(
                           segments, segments.c.id == tensor_shards.c.segment_id)).where(*live))
        with self.engine.connect() as conn:
            return [(r[0], r[1], r[2]) for r in conn.execute(q)]

    @retrying
    def pinned_segments(self, tier: str) -> set[str]:
        """Segments that hold bytes of a version pinned in ``tier``."""
        t = tensors.c
        q = (select(t.segment_id).distinct()
             .select_from(tensors.join(pins, pins.c.collection_id == t.collection_id))
             .where(pins.c.tier == tier, t.segment_id.is_not(None),
                    t.first_version <= pins.c.version,
                    or_(t.end_version.is_(None), t.end_version > pins.c.version)))
        q2 = (select(tensor_shards.c.segment_id)
              .select_from(shards_of_rows().join(
                  pins, pins.c.collection_id == t.collection_id))
              .where(pins.c.tier == tier, tensor_shards.c.segment_id.is_not(None),
                     t.first_version <= pins.c.version,
                     or_(t.end_version.is_(None), t.end_version > pins.c.version)))
        with self.engine.connect() as conn:
            return set(conn.execute(q).scalars()) | set(conn.execute(q2).scalars())

    def move_segment(self, segment_id: str, src: str, dst: str) -> bool:
        """Record that a segment now lives in ``dst``; False if it was not in ``src``. A
        segment committed in place stops referencing its file: ``dst`` holds a copy."""
        with write_conn(self.engine) as conn:
            moved: bool = conn.execute(update(segments).where(
                segments.c.id == segment_id, segments.c.tier == src,
                segments.c.node == self.node).values(tier=dst)).rowcount == 1
            if moved:
                conn.execute(delete(segment_sources)
                             .where(segment_sources.c.segment_id == segment_id))
            return moved

    @retrying
    def segment_source(self, segment_id: str) -> se.SourceFile | None:
        """The file a segment of this node references in place, as recorded at its
        commit; None for a segment with bytes of its own (or not this node's)."""
        with self.engine.connect() as conn:
            r = conn.execute(_SQL_SOURCE, {"sid": segment_id, "node": self.node}).first()
        return None if r is None else source_of(r[0], r[1], r[2], r[3], r[4])

    @retrying
    def segment_tier(self, segment_id: str) -> str | None:
        """The tier this node holds the segment in; None if it holds none such."""
        with self.engine.connect() as conn:
            tier: str | None = conn.execute(select(segments.c.tier).where(
                segments.c.id == segment_id, segments.c.node == self.node)).scalar()
            return tier

    @retrying
    def segment_registered(self, segment_id: str) -> bool:
        """Whether any node's catalog row names the segment (a file without one is an
        orphan)."""
        with self.engine.connect() as conn:
            return conn.execute(select(segments.c.id)
                                .where(segments.c.id == segment_id)).first() is not None

    @retrying
    def all_rows(self, segment_id: str | None = None) -> list[tuple[str, int, TensorRow]]:
        """Every stored tensor row (collection name, first version, row) whose bytes this
        node holds, as the writer or as a replica (of the segment ``segment_id`` only,
        when given), in the order of its bytes (segment, offset); a row's tier is where
        this node holds it. Replicas are in the integrity model like the writer's own
        segments: their first open, the scrub and ``verify`` check them the same way."""
        t = tensors.c
        rep = segment_replicas.c
        here = or_(segments.c.node == self.node, rep.node.is_not(None))
        tier = func.coalesce(rep.tier, segments.c.tier)  # a writer has no replica row

        def held(j: Join) -> Join:
            return j.outerjoin(segment_replicas, and_(rep.segment_id == segments.c.id,
                                                      rep.node == self.node))

        q = (select(collections.c.name, t.name, t.dtype, t.shape, t.nbytes, t.checksum,
                    t.segment_id, t.offset, tier, t.first_version)
             .select_from(held(tensors.join(collections, collections.c.id == t.collection_id)
                               .join(segments, segments.c.id == t.segment_id)))
             .where(here)
             .order_by(t.segment_id, t.offset))
        sh = tensor_shards.c
        q2 = (select(collections.c.name, t.name, t.dtype, sh.offsets, sh.shape, sh.nbytes,
                     sh.checksum, sh.segment_id, sh.offset, tier, t.first_version)
              .select_from(held(shards_of_rows().join(
                  collections, collections.c.id == t.collection_id)
                  .join(segments, segments.c.id == sh.segment_id)))
              .where(here))
        if segment_id is not None:
            q = q.where(t.segment_id == segment_id)
            q2 = q2.where(sh.segment_id == segment_id)
        with self.engine.connect() as conn:
            out = [(r[0], r[9], TensorRow(r[1], r[2], parse_shape(r[3]), r[4], r[5], r[6], r[7],
                                          r[8], r[9])) for r in conn.execute(q)]
            # a shard of a sharded row: checked as a row of its own, named by its box
            out += [(r[0], r[10], TensorRow(f"{r[1]} (shard at {list(parse_shape(r[3]))})",
                                            r[2], parse_shape(r[4]), r[5], r[6], r[7], r[8],
                                            r[9], r[10])) for r in conn.execute(q2)]
        out.sort(key=lambda x: (x[2].segment_id or "", x[2].offset))
        return out

    @retrying
    def held_segments(self) -> list[tuple[str, str]]:
        """(segment id, tier) of every segment whose bytes this node holds, written here
        or replicated here, by id: what a scrub walks (its rows asked segment by
        segment, so a step of it costs its segments, not the node's every row)."""
        rep = segment_replicas.c
        with self.engine.connect() as conn:
            out = [(r[0], r[1]) for r in conn.execute(
                select(segments.c.id, segments.c.tier).where(segments.c.node == self.node))]
            out += [(r[0], r[1]) for r in conn.execute(
                select(rep.segment_id, rep.tier).where(rep.node == self.node))]
        out.sort()
        return out

    @retrying
    def stats(self) -> dict[str, int]:
        """Counts of the store: collections, this node's segments and their bytes, leases."""
        mine = segments.c.node == self.node
        with self.engine.connect() as conn:
            return {
                "collections": conn.execute(select(func.count())
                                            .select_from(collections)).scalar() or 0,
                "segments": conn.execute(select(func.count()).select_from(segments)
                                         .where(mine)).scalar() or 0,
                "segment_bytes": conn.execute(select(func.coalesce(func.sum(segments.c.nbytes), 0))
                                              .where(mine)).scalar() or 0,
                "leases": conn.execute(select(func.count()).select_from(leases)).scalar() or 0,
            }
