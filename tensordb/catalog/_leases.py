"""Leases and pins: what keeps a version from gc.

A snapshot holds a *lease* on its version from open to close: the version, its rows and
their segments stay until the lease is released or its holder process is gone. A *pin*
keeps a version's bytes in one tier until it is unpinned: gc and eviction leave it alone.

Leases die with their holders, so their rows need no fsync: they go through the lease
SQL engine (on SQLite one with ``synchronous=NORMAL``; on PostgreSQL the transaction sets
``synchronous_commit`` off).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone
from typing import Any

from sqlalchemy import Connection, Engine, bindparam, delete, select, text

from ..errors import NotFound
from ._common import (
    CollectionInfo,
    TensorRow,
    gc_lock,
    insert_ignore,
    now_utc,
    shape_text,
    tensor_rows,
)
from ._manifests import PACK_MIN_ROWS, Manifest
from ._retry import RETRY_SECONDS, retry_call, retrying
from ._sql import write_conn
from ._versions import DBAPI_HEAD_ROWS, Versions
from .schema import UTCDateTime, collections, leases, pins

__all__ = ["Leases", "Opened"]

#: what opening a snapshot returns: (lease id, collection, version, manifest)
Opened = tuple[str, CollectionInfo, int, Manifest]

#: a version's commit id (the packed manifest's key): for the SQLite cursor's hot path,
#: and as a text statement for the others
_SQL_TXN = "SELECT txn_id FROM commits WHERE collection_id = ? AND version = ?"
_SQL_TXN_TEXT = text("SELECT txn_id FROM commits WHERE collection_id = :cid AND version = :v")

_SQL_LEASE = text(
    "INSERT INTO leases (id, collection_id, version, holder, node, created_at, expires_at) "
    "VALUES (:id, :cid, :v, :holder, :node, :created, :expires)"
).bindparams(bindparam("created", type_=UTCDateTime()), bindparam("expires", type_=UTCDateTime()))


def _sqlite_time(t: datetime) -> str:
    """A UTC datetime as SQLAlchemy stores UTCDateTime in SQLite (naive, microseconds)."""
    return t.astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M:%S.%f")


def _ephemeral(conn: Connection) -> None:
    """On PostgreSQL, do not wait for this transaction's WAL flush."""
    if conn.dialect.name == "postgresql":
        conn.exec_driver_sql("SET LOCAL synchronous_commit TO OFF")


@contextmanager
def _sqlite_write(engine: Engine) -> Iterator[Any]:
    """A DBAPI cursor in a BEGIN IMMEDIATE transaction, on a pooled connection of a SQL
    engine over SQLite (its pragmas set when it was opened), committed on exit and
    rolled back on an error."""
    raw = engine.raw_connection()
    try:
        assert raw.driver_connection is not None  # a pooled connection that is open
        cur = raw.driver_connection.cursor()
        try:
            cur.execute("BEGIN IMMEDIATE")
            try:
                yield cur
            except BaseException:
                cur.execute("ROLLBACK")
                raise
            cur.execute("COMMIT")
        finally:
            cur.close()
    finally:
        raw.close()


class Leases:
    """Snapshot leases and tier pins.

    ``engine`` holds pins, ``lease_engine`` leases (the same SQL engine, or one that does
    not fsync); ``node`` is recorded on each lease; ``versions`` resolves references and
    reads manifests inside the lease's own transaction."""

    def __init__(self, engine: Engine, lease_engine: Engine, node: str,
                 versions: Versions) -> None:
        self.engine = engine
        self.lease_engine = lease_engine
        self.node = node
        self.versions = versions
        #: how long a call keeps retrying a lost catalog connection (``_retry``)
        self.retry_seconds = RETRY_SECONDS

    # -- leases ------------------------------------------------------------------------
    def open_snapshot(self, name: str, version: int | None, tag: str | None, holder: str,
                      ttl: float) -> Opened:
        """Resolve a version, lease it and read its manifest in one transaction, so gc
        cannot slip between the look-up and the lease."""
        lease_id = uuid.uuid4().hex
        if version is None and tag is None and self.lease_engine.dialect.name == "sqlite":
            # SQLite's errors are never a lost connection: nothing to retry
            return self._open_head_sqlite(lease_id, name, holder, now_utc(), ttl)
        attempts = 0

        def once() -> Opened:
            nonlocal attempts
            attempts += 1
            return self._open_snapshot(lease_id, attempts > 1, name, version, tag, holder, ttl)

        return retry_call(self.retry_seconds, once)

    def _open_snapshot(self, lease_id: str, retry: bool, name: str, version: int | None,
                       tag: str | None, holder: str, ttl: float) -> Opened:
        created = now_utc()
        with write_conn(self.lease_engine) as conn:
            _ephemeral(conn)
            gc_lock(conn, shared=True)
            if retry:  # an attempt whose answer was lost may have taken the lease
                conn.execute(delete(leases).where(leases.c.id == lease_id))
            info, v = self.versions.resolve(name, version, tag, conn)
            conn.execute(_SQL_LEASE, {
                "id": lease_id, "cid": info.id, "v": v, "holder": holder, "node": self.node,
                "created": created, "expires": created + timedelta(seconds=ttl)})
            txn = conn.execute(_SQL_TXN_TEXT, {"cid": info.id, "v": v}).scalar()
            rows = None
            if not self._has_packed(txn):
                # the live-rows shortcut needs one snapshot for both statements: SQLite's
                # write transaction is one; PostgreSQL's READ COMMITTED is not, and a
                # commit landing between them would hand out the next version's rows
                rows = self.versions.manifest(
                    info.id, v, None, conn, head=(v == info.head and conn.dialect.name == "sqlite"))
        return lease_id, info, v, self._manifest(info.id, v, txn, rows)

    def _open_head_sqlite(self, lease_id: str, name: str, holder: str, created: datetime,
                          ttl: float) -> Opened:
        """``_open_snapshot`` of the head on SQLite, the reader's hot path: the same
        statements in one write transaction, on the lease SQL engine's DBAPI connection.
        SQLAlchemy's connection and statement handling were most of a fresh process's
        first open (2.5 of 3.5 ms for a 221-tensor model); this takes about 1 ms."""
        rows = None
        with _sqlite_write(self.lease_engine) as cur:
            row = cur.execute("SELECT id, name, head, retain_last FROM collections "
                              "WHERE name = ?", (name,)).fetchone()
            if row is None:
                raise NotFound(f"no collection {name!r}", collection=name)
            info = CollectionInfo(*row)
            if info.head == 0:
                raise NotFound(f"collection {name!r} has no version yet", collection=name)
            cur.execute("INSERT INTO leases (id, collection_id, version, holder, node, "
                        "created_at, expires_at) VALUES (?, ?, ?, ?, ?, ?, ?)",
                        (lease_id, info.id, info.head, holder, self.node, _sqlite_time(created),
                         _sqlite_time(created + timedelta(seconds=ttl))))
            found = cur.execute(_SQL_TXN, (info.id, info.head)).fetchone()
            txn = found[0] if found else None
            if not self._has_packed(txn):
                raw = cur.execute(DBAPI_HEAD_ROWS, (info.id,)).fetchall()
                seg_ids = list({r[5] for r in raw if r[5] is not None})
                tiers = dict(cur.execute(
                    f"SELECT id, tier FROM segments WHERE id IN ({','.join('?' * len(seg_ids))})",
                    seg_ids).fetchall()) if seg_ids else {}
                rows = tensor_rows(raw, tiers)
        return lease_id, info, info.head, self._manifest(info.id, info.head, txn, rows)

    def _has_packed(self, txn: str | None) -> bool:
        manifests = self.versions.manifests
        return manifests is not None and txn is not None and manifests.path(txn).exists()

    def _manifest(self, cid: int, version: int, txn: str | None,
                  rows: list[TensorRow] | None) -> Manifest:
        """The manifest of a leased version: its packed file when the transaction saw
        one (``rows`` None), else ``rows`` (read from SQL in the lease's transaction),
        packed now for the next opener when the version is large. A packed file that
        fails to load is rebuilt from SQL: the lease keeps the version's rows."""
        manifests = self.versions.manifests
        if rows is None:
            assert manifests is not None and txn is not None
            packed = manifests.load(txn)
            if packed is not None:
                manifest = Manifest(packed=packed)
                manifest.set_tiers(self.versions.segment_tiers(manifest.segment_ids()))
                return manifest
            rows = self.versions.manifest(cid, version)
        if manifests is not None and txn is not None and len(rows) >= PACK_MIN_ROWS:
            try:
                manifests.store_rows(txn, [(r.name, r.dtype, shape_text(r.shape), r.nbytes,
                                            r.checksum, r.segment_id, r.offset,
                                            r.first_version) for r in rows])
            except OSError:  # a cache: the next opener tries again
                pass
        return Manifest(rows)

    def release_lease(self, lease_id: str) -> None:
        if self.lease_engine.dialect.name == "sqlite":
            with _sqlite_write(self.lease_engine) as cur:
                cur.execute("DELETE FROM leases WHERE id = ?", (lease_id,))
            return
        retry_call(self.retry_seconds, self._release_lease, lease_id)

    def _release_lease(self, lease_id: str) -> None:
        with write_conn(self.lease_engine) as conn:
            _ephemeral(conn)
            conn.execute(delete(leases).where(leases.c.id == lease_id))

    @retrying
    def lease_holders(self) -> list[tuple[str, str, int, str]]:
        """(lease id, collection, version, holder) of every lease."""
        with self.engine.connect() as conn:
            return [(r[0], r[1], r[2], r[3]) for r in conn.execute(
                select(leases.c.id, collections.c.name, leases.c.version, leases.c.holder)
                .join(collections, collections.c.id == leases.c.collection_id))]

    # -- pins ---------------------------------------------------------------------------
    def pin(self, name: str, version: int | None, tag: str | None, tier: str) -> int:
        with write_conn(self.engine) as conn:
            info, v = self.versions.resolve(name, version, tag, conn)
            insert_ignore(conn, pins, {"collection_id": info.id, "version": v, "tier": tier,
                                       "created_at": now_utc()})
            return v

    def unpin(self, name: str, version: int | None, tag: str | None, tier: str) -> bool:
        with write_conn(self.engine) as conn:
            info, v = self.versions.resolve(name, version, tag, conn)
            return conn.execute(delete(pins).where(
                pins.c.collection_id == info.id, pins.c.version == v,
                pins.c.tier == tier)).rowcount > 0

    @retrying
    def pins(self) -> list[tuple[str, int, str]]:
        """(collection, version, tier) of every pin."""
        with self.engine.connect() as conn:
            return [(r[0], r[1], r[2]) for r in conn.execute(
                select(collections.c.name, pins.c.version, pins.c.tier)
                .join(collections, collections.c.id == pins.c.collection_id)
                .order_by(collections.c.name, pins.c.version))]
