"""Byte quotas per tenant: a scope glob over collection names (as a token's scope) and
the most bytes its collections may store together.

A collection's stored bytes are the bytes of the segments its commits stored
(``segments.collection_id``): an extent that several versions share lies in one segment
and counts once, to the collection that stored it; a replica on another node is the
same bytes and counts not at all; a version dropped and collected stops counting when
gc frees its segments; a dropped collection at once. A group commit's parts count to
its tenant as each lands (checked then), before the group publishes. ``check`` runs inside a commit's write transaction, after its
head is locked: a commit that would take a tenant past a quota it falls under raises
``StoreFull`` naming the quota, and the transaction (the whole commit) is rolled back.
On PostgreSQL the matching quota rows are locked (in scope order) for the rest of the
transaction, so two commits of one tenant are checked one after the other and cannot
pass a quota together; SQLite's writers are one at a time already.

Scopes here take ``*`` and ``?`` only (no ``[...]`` classes), so that the SQL that sums a
tenant's bytes (SQLite's GLOB, PostgreSQL's LIKE, both case-sensitive) matches exactly
the names ``fnmatch`` does.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, Engine, and_, delete, func, literal, select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert

from tensordb.errors import InvalidInput, NotFound, StoreFull

from ._common import now_utc
from ._sql import write_conn
from ._tokens import check_scope
from .schema import collections, commit_groups, group_parts, quotas, segments

__all__ = ["Quota", "Quotas", "check_quotas"]


@dataclass(frozen=True, slots=True)
class Quota:
    """One tenant's quota and what its collections store now."""

    scope: str
    max_bytes: int
    used_bytes: int


def _check_quota_scope(scope: object) -> str:
    scope = check_scope(scope)
    if "[" in scope or "]" in scope:
        raise InvalidInput(f"a quota's scope is a glob of '*' and '?' only, not {scope!r}")
    return scope


def _pattern(conn: Connection, scope: str, name: Any = collections.c.name) -> Any:
    """A condition on a name column equal to ``fnmatchcase(name, scope)``."""
    if conn.dialect.name == "sqlite":
        return name.op("GLOB")(scope)
    escaped = scope.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return name.like(escaped.replace("*", "%").replace("?", "_"), escape="\\")


def _used(conn: Connection, scope: str) -> int:
    """The bytes the tenant's collections store, and the parts of its open group commits
    that have landed and wait for their group to publish (an aborted group's parts are
    gc's to free, and count no more)."""
    total = 0
    for q in (
        select(func.coalesce(func.sum(segments.c.nbytes), literal(0)))
        .select_from(segments.join(collections, collections.c.id == segments.c.collection_id))
        .where(_pattern(conn, scope)),
        select(func.coalesce(func.sum(segments.c.nbytes), literal(0)))
        .select_from(segments.join(group_parts, group_parts.c.segment_id == segments.c.id)
                     .join(commit_groups, and_(
                         commit_groups.c.collection == group_parts.c.collection,
                         commit_groups.c.name == group_parts.c.group_name)))
        .where(segments.c.collection_id.is_(None), commit_groups.c.state == "open",
               _pattern(conn, scope, group_parts.c.collection)),
    ):
        total += int(conn.execute(q).scalar() or 0)
    return total


def check_quotas(conn: Connection, collection: str, adding: int) -> None:
    """Raise StoreFull, in a commit's write transaction ``conn``, when storing ``adding``
    more bytes for ``collection`` takes a tenant it falls under past its quota. One
    statement (reading every quota row) when none covers the collection; three more
    per quota that does (its lock on PostgreSQL, the sums of its stored and pending
    bytes, by index: O(the tenant's segments))."""
    rows = conn.execute(select(quotas.c.scope, quotas.c.max_bytes)
                        .order_by(quotas.c.scope)).all()
    for scope, cap in rows:
        if not fnmatch.fnmatchcase(collection, scope):
            continue
        if conn.dialect.name == "postgresql":  # one tenant's commits, one at a time
            conn.execute(select(quotas.c.scope).where(quotas.c.scope == scope)
                         .with_for_update())
        used = _used(conn, scope)
        if used + adding > cap:
            raise StoreFull(f"quota {scope!r} is {cap} bytes: its collections store {used}, "
                            f"and this commit of {collection!r} would store {adding} more",
                            collection=collection)


class Quotas:
    """The catalog's quotas: set, drop, list with what each tenant stores."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def set(self, scope: str, max_bytes: int) -> None:
        """Give the tenant ``scope`` a quota of ``max_bytes`` (replacing its quota if it
        has one). What is stored already stays, over the quota or not: only commits
        are refused."""
        scope = _check_quota_scope(scope)
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise InvalidInput(f"a quota is a number of bytes >= 0, not {max_bytes!r}")
        with write_conn(self.engine) as conn:
            ins = (pg_insert if conn.dialect.name == "postgresql" else sqlite_insert)(quotas)
            conn.execute(ins.values(scope=scope, max_bytes=max_bytes, created_at=now_utc())
                         .on_conflict_do_update(index_elements=["scope"],
                                                set_={"max_bytes": max_bytes}))

    def drop(self, scope: str) -> None:
        """End the tenant's quota; NotFound when it has none."""
        with write_conn(self.engine) as conn:
            if conn.execute(delete(quotas).where(quotas.c.scope == scope)).rowcount == 0:
                raise NotFound(f"no quota on {scope!r}")

    def list(self) -> list[Quota]:
        """Every quota, by scope, with the bytes its tenant's collections store now."""
        with self.engine.connect() as conn:
            rows = conn.execute(select(quotas.c.scope, quotas.c.max_bytes)
                                .order_by(quotas.c.scope)).all()
            return [Quota(s, int(m), _used(conn, s)) for s, m in rows]
