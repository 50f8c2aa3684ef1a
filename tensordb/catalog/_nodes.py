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

from sqlalchemy import Engine, delete, or_, select, update
from sqlalchemy.exc import IntegrityError

from ..errors import NotFound
from ._common import now_utc
from ._sql import write_conn
from .schema import kv_namespaces, nodes, segment_replicas, segments, tensors

__all__ = ["NodeDirectory", "NodeInfo", "SegmentInfo", "DEFAULT_LAPSE"]

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
class SegmentInfo:
    """A segment's writer, its tier there, its size, and the extents it holds
    (offset, nbytes, checksum), sorted by offset."""

    id: str
    node: str
    tier: str
    nbytes: int
    extents: tuple[tuple[int, int, str], ...]


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
            if conn.execute(update(nodes).where(nodes.c.name == name)
                            .values(**values)).rowcount == 0:
                conn.execute(nodes.insert().values(name=name, **values))

    def heartbeat(self, name: str) -> bool:
        """Renew ``name``'s heartbeat (and bring it back up); False if it is unknown."""
        with write_conn(self.engine) as conn:
            return conn.execute(update(nodes).where(nodes.c.name == name).values(
                heartbeat_at=now_utc(), state="up")).rowcount == 1

    def deregister(self, name: str) -> None:
        """Mark ``name`` down (a clean shutdown); its rows and replicas stay."""
        with write_conn(self.engine) as conn:
            conn.execute(update(nodes).where(nodes.c.name == name).values(state="down"))

    def mark_lapsed(self) -> list[str]:
        """Mark down every up node whose heartbeat is older than the lapse."""
        cutoff = now_utc() - timedelta(seconds=self.lapse)
        with write_conn(self.engine) as conn:
            names = list(conn.execute(select(nodes.c.name).where(
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
            t = tensors.c
            ext = conn.execute(select(t.offset, t.nbytes, t.checksum).distinct()
                               .where(t.segment_id == segment_id)).all()
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

    def add_replica(self, segment_id: str, node: str, tier: str) -> bool:
        """Record that ``node`` now holds a verified copy in ``tier``, in one transaction
        that confirms the segment still exists; False if it was dropped meanwhile (the
        caller then deletes its copy). Idempotent."""
        try:
            with write_conn(self.engine) as conn:
                q = select(segments.c.node).where(segments.c.id == segment_id)
                if conn.dialect.name == "postgresql":
                    q = q.with_for_update(read=True)  # gc cannot delete it under us
                owner = conn.execute(q).scalar()
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
        """(segment id, nbytes) of every segment a version's tensors live in, on any node."""
        t = tensors.c
        q = (select(segments.c.id, segments.c.nbytes).distinct()
             .select_from(tensors.join(segments, segments.c.id == t.segment_id))
             .where(t.collection_id == collection_id, t.first_version <= version,
                    or_(t.end_version.is_(None), t.end_version > version))
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
