"""Garbage collection of the catalog: dropping versions, and the rows and segments that
only dropped versions needed.

A version is kept while it is the head, tagged, pinned, leased by a live holder, or
within its collection's retention (``retain_last``). A tensor row is the interval
``[first_version, end_version)``: it goes once no kept version lies inside it. A
segment of this node goes once no row refers to it; its bytes are the caller's to
delete, after gc's transaction has committed.
"""

from __future__ import annotations

import bisect
from datetime import timedelta

from sqlalchemy import Connection, Engine, bindparam, delete, exists, select

from storage_engine import holder_alive

from ..errors import NotFound
from ._common import GcPlan, collection_info, gc_lock, now_utc
from ._groups import Groups
from ._sql import write_conn
from .schema import (
    collections,
    commits,
    group_parts,
    leases,
    pins,
    segments,
    tags,
    tensor_shards,
    tensors,
)

__all__ = ["GarbageCollector"]


def _held(conn: Connection) -> tuple[set[tuple[int, int]], list[str]]:
    """(collection id, version) pairs under a live lease, and the ids of dead leases."""
    t = now_utc()
    expired: list[str] = []
    held: set[tuple[int, int]] = set()
    for lid, cid, v, holder, exp in conn.execute(select(
            leases.c.id, leases.c.collection_id, leases.c.version, leases.c.holder,
            leases.c.expires_at)):
        alive = holder_alive(holder)
        if alive is False or (alive is None and exp < t):
            expired.append(lid)
        else:
            held.add((cid, v))
    return held, expired


def _collect(conn: Connection, cid: int, head: int, keep: int | None,
             spared: set[tuple[int, int]]) -> tuple[int, int]:
    """Drop one collection's versions past its retention (but those in ``spared``),
    then its rows no remaining version needs: (versions dropped, rows dropped)."""
    versions = sorted(conn.execute(select(commits.c.version)
                                   .where(commits.c.collection_id == cid)).scalars())
    dropped_versions = 0
    if keep is not None:
        drop = [v for v in versions if v <= head - keep and (cid, v) not in spared]
        if drop:
            conn.execute(delete(commits).where(commits.c.collection_id == cid,
                                               commits.c.version.in_(drop)))
            dropped_versions = len(drop)
            dropped = set(drop)
            versions = [v for v in versions if v not in dropped]
    # a closed row [first, end) is needed while some kept version lies in it
    t = tensors.c
    dead = []
    for name, first, end in conn.execute(select(t.name, t.first_version, t.end_version)
                                         .where(t.collection_id == cid,
                                                t.end_version.is_not(None))):
        i = bisect.bisect_left(versions, first)
        if i == len(versions) or versions[i] >= end:
            dead.append({"c": cid, "n": name, "f": first})
    if dead:
        conn.execute(delete(tensors).where(
            t.collection_id == bindparam("c"), t.name == bindparam("n"),
            t.first_version == bindparam("f")), dead)
        s = tensor_shards.c  # a sharded row's shards go with it
        conn.execute(delete(tensor_shards).where(
            s.collection_id == bindparam("c"), s.name == bindparam("n"),
            s.first_version == bindparam("f")), dead)
    return dropped_versions, len(dead)


class GarbageCollector:
    """Catalog gc and explicit version drops, over the catalog's SQL engine; ``node``
    is the node whose unused segments gc removes."""

    def __init__(self, engine: Engine, node: str, groups: Groups) -> None:
        self.engine = engine
        self.node = node
        self._groups = groups

    def gc(self) -> GcPlan:
        """Drop what no version, tag, lease or retention rule needs, in one transaction.

        Returns the segments whose rows were removed; the caller deletes their bytes
        after this transaction has committed.
        """
        with write_conn(self.engine) as conn:
            gc_lock(conn, shared=False)
            held, expired = _held(conn)
            if expired:
                conn.execute(delete(leases).where(leases.c.id.in_(expired)))
            spared = held | {(r[0], r[1]) for r in conn.execute(
                select(tags.c.collection_id, tags.c.version))}
            spared |= {(r[0], r[1]) for r in conn.execute(
                select(pins.c.collection_id, pins.c.version))}
            self._groups.reap(conn)  # ended groups' parts: their segments are garbage now
            dropped_versions = dropped_rows = 0
            for cid, head, keep in conn.execute(select(
                    collections.c.id, collections.c.head, collections.c.retain_last)).all():
                nv, nr = _collect(conn, cid, head, keep, spared)
                dropped_versions += nv
                dropped_rows += nr
            unused = select(segments.c.id, segments.c.tier, segments.c.nbytes).where(
                segments.c.node == self.node,
                ~exists().where(tensors.c.segment_id == segments.c.id),
                ~exists().where(tensor_shards.c.segment_id == segments.c.id),
                ~exists().where(group_parts.c.segment_id == segments.c.id))
            dead_segments = [(r[0], r[1], r[2]) for r in conn.execute(unused)]
            if dead_segments:
                conn.execute(delete(segments).where(
                    segments.c.id.in_([s[0] for s in dead_segments])))
        return GcPlan(dead_segments, dropped_versions, dropped_rows, len(expired))

    def drop_versions(self, name: str, keep_last: int | None,
                      older_than: timedelta | None) -> int:
        """Forget versions (never the head, a tagged, pinned or leased one); gc then
        reclaims what only they needed. Returns how many were dropped."""
        with write_conn(self.engine) as conn:
            gc_lock(conn, shared=False)
            info = collection_info(conn, name, lock=True)
            if info is None:
                raise NotFound(f"no collection {name!r}", collection=name)
            held, _ = _held(conn)
            keep = {v for c, v in held if c == info.id}
            keep |= set(conn.execute(select(tags.c.version).where(
                tags.c.collection_id == info.id)).scalars())
            keep |= set(conn.execute(select(pins.c.version).where(
                pins.c.collection_id == info.id)).scalars())
            keep.add(info.head)
            q = select(commits.c.version).where(commits.c.collection_id == info.id)
            if keep_last is not None:
                q = q.where(commits.c.version <= info.head - keep_last)
            if older_than is not None:
                q = q.where(commits.c.created_at < now_utc() - older_than)
            drop = [v for v in conn.execute(q).scalars() if v not in keep]
            if drop:
                conn.execute(delete(commits).where(commits.c.collection_id == info.id,
                                                   commits.c.version.in_(drop)))
            return len(drop)
