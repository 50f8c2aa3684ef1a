"""The cluster's directory in the catalog: node registration and heartbeats, and which
nodes hold which segments (the writer of each, plus its verified replicas).

PostgreSQL makes this durable and shared; tensordb runs no consensus of its own. A
node is *live* while its state is ``up`` and its last heartbeat is younger than the
lapse; whoever notices a lapsed heartbeat marks the node ``down``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import Connection, Engine, delete, exists, func, or_, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.exc import IntegrityError

from ..errors import NotFound
from ._common import now_utc
from ._segments import shards_of_rows
from ._sql import write_conn
from .schema import (
    collections,
    kv_namespaces,
    nodes,
    segment_replicas,
    segments,
    tensor_shards,
    tensors,
)

__all__ = ["Beat", "NodeDirectory", "NodeInfo", "SegmentInfo", "DEFAULT_LAPSE"]

#: seconds without a heartbeat after which a node counts as down
DEFAULT_LAPSE = float(os.environ.get("TENSORDB_NODE_LAPSE", "") or 10.0)


@dataclass(frozen=True, slots=True)
class NodeInfo:
    """One registered node as the catalog has it."""

    name: str
    address: str | None
    tiers: tuple[str, ...]
    capacity: int | None
    heartbeat_at: datetime | None
    state: str

    def live(self, lapse: float, now: datetime | None = None) -> bool:
        """Up, with an address, and heard from within ``lapse`` seconds."""
        if self.state != "up" or not self.address or self.heartbeat_at is None:
            return False
        return (now or now_utc()) - self.heartbeat_at <= timedelta(seconds=lapse)


@dataclass(frozen=True, slots=True)
class Beat:
    """What one heartbeat found: whether the node's row exists (False: register again),
    the nodes it marked down, and how many are up after it (None: it did not sweep)."""

    known: bool
    lapsed: list[str]
    up: int | None


@dataclass(frozen=True, slots=True)
class SegmentInfo:
    """A segment's writer, its tier there, its size, and the extents it holds
    (offset, nbytes, checksum), sorted by offset."""

    id: str
    node: str
    tier: str
    nbytes: int
    extents: tuple[tuple[int, int, str], ...]


# The soft state of heartbeats, as plain PostgreSQL statements run on their own
# (autocommit): set_config(..., true) turns synchronous_commit off for the statement's
# own transaction, so its commit does not wait for the WAL flush (the ``quiet`` CTE is
# referenced by the outer SELECT, so it runs). The lapse sweep rides in the same
# statement, one round trip: it skips the beating node itself, whose row the other CTE
# is renewing.
_PG_QUIET = "quiet AS (SELECT set_config('synchronous_commit', 'off', true) AS v)"
_PG_BEAT = (  # up: the nodes up before the sweep, less those it marks down
    f"WITH {_PG_QUIET}, "
    "mine AS (UPDATE nodes SET heartbeat_at = %(now)s, state = 'up' "
    "WHERE name = %(name)s RETURNING 1), "
    "lapsed AS (UPDATE nodes SET state = 'down' WHERE state = 'up' AND name <> %(name)s "
    "AND (heartbeat_at IS NULL OR heartbeat_at < %(cutoff)s) RETURNING name) "
    "SELECT (SELECT count(*) FROM mine), ARRAY(SELECT name FROM lapsed), "
    "(SELECT count(*) FROM nodes WHERE state = 'up' OR name = %(name)s) "
    "- (SELECT count(*) FROM lapsed), (SELECT v FROM quiet)"
)
_PG_HEARTBEAT = (
    f"WITH {_PG_QUIET}, "
    "mine AS (UPDATE nodes SET heartbeat_at = %(now)s, state = 'up' "
    "WHERE name = %(name)s RETURNING 1) "
    "SELECT (SELECT count(*) FROM mine), (SELECT v FROM quiet)"
)
_PG_MARK_LAPSED = (
    f"WITH {_PG_QUIET}, "
    "lapsed AS (UPDATE nodes SET state = 'down' WHERE state = 'up' "
    "AND (heartbeat_at IS NULL OR heartbeat_at < %(cutoff)s) RETURNING name) "
    "SELECT name FROM lapsed WHERE (SELECT v FROM quiet) IS NOT NULL"
)

# a replica, in one durable statement (a data-modifying CTE runs whether or not it is
# read): the writer's own segment is no replica of it; a segment gc dropped answers no
# row, and one gc is dropping fails the insert's foreign key check once gc commits
# (IntegrityError: False too)
_PG_ADD_REPLICA = (
    "WITH seg AS (SELECT node FROM segments WHERE id = %(sid)s::varchar), "
    "ins AS (INSERT INTO segment_replicas (segment_id, node, tier, created_at) "
    "SELECT %(sid)s::varchar, %(node)s::varchar, %(tier)s::varchar, %(now)s::timestamptz "
    "FROM seg WHERE seg.node <> %(node)s::varchar "
    "ON CONFLICT (segment_id, node) DO UPDATE SET tier = EXCLUDED.tier RETURNING 1) "
    "SELECT node FROM seg"
)


class NodeDirectory:
    """Node and replica metadata over the catalog's SQL engine. Thread-safe; any process."""

    def __init__(self, engine: Engine, lapse: float = DEFAULT_LAPSE) -> None:
        self.engine = engine
        self.lapse = lapse

    # -- nodes ---------------------------------------------------------------------
    def register(self, name: str, address: str, tiers: Sequence[str],
                 capacity: int | None) -> None:
        """Insert or refresh ``name`` as up at ``address``, heartbeat now. Idempotent."""
        values = {"address": address, "tiers": json.dumps(list(tiers)), "capacity": capacity,
                  "heartbeat_at": now_utc(), "state": "up"}
        with write_conn(self.engine) as conn:
            dialect = conn.dialect.name
            if dialect == "postgresql":  # one statement: no look before the write
                conn.execute(pg_insert(nodes).values(name=name, **values)
                             .on_conflict_do_update(index_elements=[nodes.c.name], set_=values))
            elif dialect == "sqlite":
                conn.execute(sqlite_insert(nodes).values(name=name, **values)
                             .on_conflict_do_update(index_elements=[nodes.c.name], set_=values))
            elif conn.execute(update(nodes).where(nodes.c.name == name)
                              .values(**values)).rowcount == 0:
                conn.execute(nodes.insert().values(name=name, **values))

    def beat(self, name: str, *, sweep: bool = True) -> Beat:
        """One heartbeat of ``name``: renew its row (and bring it back up) and, with
        ``sweep``, mark down every other up node whose heartbeat is older than the lapse
        and count the nodes left up.

        On PostgreSQL this is one statement in its own transaction, one round trip, that
        does not wait for its WAL flush: a heartbeat or a down mark lost to a server
        crash is written again by the next beat, a second later, and the lapse is many
        beats long. The sweep reads the whole table, so a cluster whose every node
        swept on every beat would do work growing with the square of its size: a node
        sweeps on some beats only (``transport.NodeRegistration``), and a reader never
        needs the mark anyway (``NodeInfo.live`` looks at the heartbeat's age)."""
        now = now_utc()
        cutoff = now - timedelta(seconds=self.lapse)
        if self.engine.dialect.name == "postgresql":
            with self.engine.connect() as conn:
                conn = conn.execution_options(isolation_level="AUTOCOMMIT")
                if not sweep:
                    known = conn.exec_driver_sql(_PG_HEARTBEAT, {"name": name, "now": now}
                                                 ).scalar() == 1
                    return Beat(known, [], None)
                row = conn.exec_driver_sql(_PG_BEAT, {"name": name, "now": now,
                                                      "cutoff": cutoff}).one()
            return Beat(row[0] == 1, sorted(row[1]), int(row[2]))
        with write_conn(self.engine) as conn:
            known = conn.execute(update(nodes).where(nodes.c.name == name).values(
                heartbeat_at=now, state="up")).rowcount == 1
            if not sweep:
                return Beat(known, [], None)
            lapsed = self._mark_lapsed(conn, cutoff)
            up = conn.execute(select(func.count()).select_from(nodes)
                              .where(nodes.c.state == "up")).scalar() or 0
            return Beat(known, lapsed, int(up))

    def heartbeat(self, name: str) -> bool:
        """Renew ``name``'s heartbeat (and bring it back up); False if it is unknown.
        On PostgreSQL one statement that does not wait for its WAL flush (``beat``)."""
        now = now_utc()
        if self.engine.dialect.name == "postgresql":
            with self.engine.connect() as conn:
                conn = conn.execution_options(isolation_level="AUTOCOMMIT")
                return conn.exec_driver_sql(_PG_HEARTBEAT, {"name": name, "now": now}
                                            ).scalar() == 1
        with write_conn(self.engine) as conn:
            return conn.execute(update(nodes).where(nodes.c.name == name).values(
                heartbeat_at=now, state="up")).rowcount == 1

    def deregister(self, name: str) -> None:
        """Mark ``name`` down (a clean shutdown); its rows and replicas stay."""
        with write_conn(self.engine) as conn:
            conn.execute(update(nodes).where(nodes.c.name == name).values(state="down"))

    def mark_lapsed(self) -> list[str]:
        """Mark down every up node whose heartbeat is older than the lapse; their names."""
        cutoff = now_utc() - timedelta(seconds=self.lapse)
        if self.engine.dialect.name == "postgresql":
            with self.engine.connect() as conn:
                conn = conn.execution_options(isolation_level="AUTOCOMMIT")
                return sorted(conn.exec_driver_sql(_PG_MARK_LAPSED, {"cutoff": cutoff})
                              .scalars())
        with write_conn(self.engine) as conn:
            return self._mark_lapsed(conn, cutoff)

    @staticmethod
    def _mark_lapsed(conn: Connection, cutoff: datetime) -> list[str]:
        names = sorted(conn.execute(select(nodes.c.name).where(
            nodes.c.state == "up",
            or_(nodes.c.heartbeat_at.is_(None), nodes.c.heartbeat_at < cutoff))).scalars())
        if names:
            conn.execute(update(nodes).where(nodes.c.name.in_(names)).values(state="down"))
        return names

    def nodes(self) -> dict[str, NodeInfo]:
        with self.engine.connect() as conn:
            rows = conn.execute(select(nodes.c.name, nodes.c.address, nodes.c.tiers,
                                       nodes.c.capacity, nodes.c.heartbeat_at,
                                       nodes.c.state)).all()
        return {r[0]: NodeInfo(r[0], r[1], tuple(json.loads(r[2] or "[]")), r[3], r[4], r[5])
                for r in rows}

    def node(self, name: str) -> NodeInfo:
        info = self.nodes().get(name)
        if info is None:
            raise NotFound(f"no node {name!r} in the catalog", node=name)
        return info

    def live(self) -> dict[str, NodeInfo]:
        """The live nodes by name."""
        now = now_utc()
        return {n: i for n, i in self.nodes().items() if i.live(self.lapse, now)}

    # -- segments and replicas ---------------------------------------------------------
    def segment(self, segment_id: str) -> SegmentInfo | None:
        """The segment's writer, tier, size and extents; None once it is gone."""
        with self.engine.connect() as conn:
            row = conn.execute(select(segments.c.node, segments.c.tier, segments.c.nbytes)
                               .where(segments.c.id == segment_id)).first()
            if row is None:
                return None
            t, sh = tensors.c, tensor_shards.c  # the rows' extents and the shards'
            ext = conn.execute(select(t.offset, t.nbytes, t.checksum)
                               .where(t.segment_id == segment_id)
                               .union(select(sh.offset, sh.nbytes, sh.checksum)
                                      .where(sh.segment_id == segment_id))).all()
        return SegmentInfo(segment_id, row[0], row[1], row[2],
                           tuple(sorted((int(o), int(n), c) for o, n, c in ext)))

    def holders(self, segment_id: str) -> dict[str, str]:
        """node -> tier for every node that holds the segment (writer and replicas)."""
        with self.engine.connect() as conn:
            out = dict(conn.execute(select(segments.c.node, segments.c.tier)
                                    .where(segments.c.id == segment_id)).all())
            out.update(conn.execute(select(segment_replicas.c.node, segment_replicas.c.tier)
                                    .where(segment_replicas.c.segment_id == segment_id)).all())
        return out

    def held_by(self, segment_ids: Iterable[str]) -> dict[str, set[str]]:
        """segment id -> the nodes that hold it, for many segments in two queries."""
        ids = list(segment_ids)
        out: dict[str, set[str]] = {s: set() for s in ids}
        if not ids:
            return out
        with self.engine.connect() as conn:
            for sid, node in conn.execute(select(segments.c.id, segments.c.node)
                                          .where(segments.c.id.in_(ids))):
                out[sid].add(node)
            for sid, node in conn.execute(select(segment_replicas.c.segment_id,
                                                 segment_replicas.c.node)
                                          .where(segment_replicas.c.segment_id.in_(ids))):
                out[sid].add(node)
        return out

    def local_tier(self, segment_id: str, node: str) -> str | None:
        """The tier where ``node`` holds the segment (as writer or replica), or None."""
        return self.holders(segment_id).get(node)

    def segment_collections(self, segment_ids: Sequence[str]) -> dict[str, set[str]]:
        """The collections whose tensor rows (or shards) point into each segment: what a
        scoped token's request for segment bytes is checked against. A segment no row
        points at (an orphan, or one a commit has not published yet) maps to an empty
        set.

        A commit dedupes against its own collection's head only, so a segment's rows are
        those of the collection that stored it (``segments.collection_id``): one
        statement over the segments asked, whatever the tensors in them. Only a segment
        that names no live collection (stored before migration 0011 with no row, or a
        group part not yet published) is looked up through the rows that point into it
        (two statements more, each served by its segment index)."""
        out: dict[str, set[str]] = {s: set() for s in segment_ids}
        if not out:
            return out
        ids = list(out)
        with self.engine.connect() as conn:
            for sid, name in conn.execute(
                    select(segments.c.id, collections.c.name)
                    .join(collections, collections.c.id == segments.c.collection_id)
                    .where(segments.c.id.in_(ids))):
                out[sid].add(name)
            rest = [s for s in ids if not out[s]]
            for table in (tensors, tensor_shards) if rest else ():
                rows = conn.execute(
                    select(table.c.segment_id, collections.c.name).distinct()
                    .join(collections, collections.c.id == table.c.collection_id)
                    .where(table.c.segment_id.in_(rest))).all()
                for sid, name in rows:
                    out[sid].add(name)
        return out

    def add_replica(self, segment_id: str, node: str, tier: str) -> bool:
        """Record that ``node`` now holds a verified copy in ``tier``, in one transaction
        that confirms the segment still exists; False if it was dropped meanwhile (the
        caller then deletes its copy). Idempotent.

        On PostgreSQL one statement, an upsert that reads the segment's row as it
        inserts (the foreign key holds that row against gc until it commits)."""
        try:
            if self.engine.dialect.name == "postgresql":
                with self.engine.connect() as conn:
                    conn = conn.execution_options(isolation_level="AUTOCOMMIT")
                    owner = conn.exec_driver_sql(_PG_ADD_REPLICA, {
                        "sid": segment_id, "node": node, "tier": tier,
                        "now": now_utc()}).scalar()
                return owner is not None
            with write_conn(self.engine) as conn:
                owner = conn.execute(select(segments.c.node)
                                     .where(segments.c.id == segment_id)).scalar()
                if owner is None:
                    return False
                if owner == node:
                    return True
                if conn.execute(update(segment_replicas).where(
                        segment_replicas.c.segment_id == segment_id,
                        segment_replicas.c.node == node).values(tier=tier)).rowcount == 0:
                    conn.execute(segment_replicas.insert().values(
                        segment_id=segment_id, node=node, tier=tier, created_at=now_utc()))
            return True
        except IntegrityError:  # the segment went between the look and the insert
            return False

    def drop_replica(self, segment_id: str, node: str) -> bool:
        """Forget ``node``'s copy (before deleting its file); False if none was recorded."""
        with write_conn(self.engine) as conn:
            return conn.execute(delete(segment_replicas).where(
                segment_replicas.c.segment_id == segment_id,
                segment_replicas.c.node == node)).rowcount > 0

    def replicas(self, node: str | None = None) -> list[tuple[str, str, str]]:
        """(segment id, node, tier) of every replica (of ``node``'s only, if given)."""
        q = select(segment_replicas.c.segment_id, segment_replicas.c.node,
                   segment_replicas.c.tier).order_by(segment_replicas.c.segment_id)
        if node is not None:
            q = q.where(segment_replicas.c.node == node)
        with self.engine.connect() as conn:
            return [(r[0], r[1], r[2]) for r in conn.execute(q)]

    def version_segments(self, collection_id: int, version: int) -> list[tuple[str, int]]:
        """(segment id, nbytes) of every segment a version's tensors live in, on any node.

        Asked segment by segment (does a live row of the version lie in it? one probe
        of the rows' segment index each), not row by row: a replication of a version
        one tensor past the last costs the catalog's segments, not the version's
        tensors (a join over its rows read all 200,000 of them: tests/test_costs.py)."""
        t, sh = tensors.c, tensor_shards.c
        live = (t.collection_id == collection_id, t.first_version <= version,
                or_(t.end_version.is_(None), t.end_version > version))
        in_rows = exists().where(t.segment_id == segments.c.id, *live)
        in_shards = exists(select(1).select_from(shards_of_rows())
                           .where(sh.segment_id == segments.c.id, *live))
        q = (select(segments.c.id, segments.c.nbytes).where(or_(in_rows, in_shards))
             .order_by(segments.c.id))
        with self.engine.connect() as conn:
            return [(r[0], r[1]) for r in conn.execute(q)]

    def kv_nodes(self, namespace: str) -> list[str]:
        """The nodes that have opened KV namespace ``namespace``, fullest first."""
        with self.engine.connect() as conn:
            return list(conn.execute(select(kv_namespaces.c.node)
                                     .where(kv_namespaces.c.name == namespace)
                                     .order_by(kv_namespaces.c.blocks.desc(),
                                               kv_namespaces.c.node)).scalars())
