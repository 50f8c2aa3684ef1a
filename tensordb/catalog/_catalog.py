"""Catalog operations: every read and write of metadata goes through ``Catalog``.

Each public method is one SQL transaction. Writes take the write lock up front (BEGIN
IMMEDIATE on SQLite, SELECT ... FOR UPDATE on the collection row elsewhere), so
concurrent writers queue instead of failing, and versions stay consecutive.
"""

from __future__ import annotations

import bisect
import json
import uuid
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from functools import lru_cache
from typing import Any, NamedTuple

from sqlalchemy import (
    Connection,
    text,
    Engine,
    String,
    any_,
    bindparam,
    delete,
    exists,
    func,
    literal,
    or_,
    select,
    update,
)
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.exc import IntegrityError

from storage_engine import holder_alive

from ..errors import CommitConflict, InvalidInput, NotFound
from ._engine import write_conn
from ._retry import RETRY_SECONDS, retry_call, retrying
from .schema import (
    UTCDateTime,
    collections,
    commits,
    leases,
    nodes,
    pins,
    segments,
    tags,
    tensors,
)

__all__ = ["Catalog", "CollectionInfo", "Commit", "TensorRow", "NewTensor", "GcPlan"]


def _now() -> datetime:
    return datetime.now(timezone.utc)


@dataclass(frozen=True, slots=True)
class Commit:
    """One published version of a collection.

    ``tensors`` / ``nbytes``: the whole version; ``written`` / ``written_nbytes``: what
    this commit stored anew (the rest is shared with the parent version).
    """

    collection: str
    version: int
    created_at: datetime
    message: str | None
    tensors: int
    nbytes: int
    parent: int | None = None
    written: int = 0
    written_nbytes: int = 0
    metadata: dict[str, str] | None = None


@dataclass(frozen=True, slots=True)
class CollectionInfo:
    id: int
    name: str
    head: int
    retain_last: int | None


class TensorRow(NamedTuple):
    """Where one tensor of one version lives (a tuple: manifests build thousands)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    checksum: str
    segment_id: str | None
    offset: int
    tier: str | None
    first_version: int


@dataclass(frozen=True, slots=True)
class NewTensor:
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    checksum: str
    segment_id: str | None
    offset: int


@dataclass(frozen=True, slots=True)
class GcPlan:
    """What a catalog gc removed: the segments whose files may now be deleted."""

    dead_segments: list[tuple[str, str, int]]  # (segment id, tier, nbytes)
    dropped_versions: int
    dropped_rows: int
    expired_leases: int


def shape_text(shape: Sequence[int]) -> str:
    return ",".join(str(int(d)) for d in shape)


@lru_cache(maxsize=4096)
def parse_shape(s: str) -> tuple[int, ...]:
    return tuple(int(d) for d in s.split(",")) if s else ()


def _tensor_rows(raw: Sequence[Sequence[Any]], tiers: dict[str, str]) -> list[TensorRow]:
    """Manifest rows (the columns of ``_SQL_ROWS``) as TensorRows, ordered by name."""
    rows = [TensorRow(r[0], r[1], parse_shape(r[2]), r[3], r[4], r[5], r[6],
                      tiers.get(r[5]), r[7]) for r in raw]
    rows.sort()
    return rows


def _sqlite_time(t: datetime) -> str:
    """A UTC datetime as SQLAlchemy stores UTCDateTime in SQLite (naive, microseconds)."""
    return t.astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M:%S.%f")


def _in(conn: Connection, col: Any, values: Sequence[str]) -> Any:
    """``col IN values``; on PostgreSQL one array parameter instead of one per value."""
    if conn.dialect.name == "postgresql":
        return col == any_(literal(list(values), ARRAY(String)))
    return col.in_(list(values))




def _insert_ignore(conn: Connection, table, values: dict) -> None:  # type: ignore[no-untyped-def]
    name = conn.dialect.name
    if name in ("sqlite", "postgresql"):
        if name == "sqlite":
            from sqlalchemy.dialects.sqlite import insert
        else:
            from sqlalchemy.dialects.postgresql import insert
        conn.execute(insert(table).values(**values).on_conflict_do_nothing())
        return
    try:
        with conn.begin_nested():
            conn.execute(table.insert().values(**values))
    except IntegrityError:
        pass


_PG_INSERT_ROWS = (
    'INSERT INTO tensors (collection_id, name, first_version, dtype, shape, nbytes, '
    'checksum, segment_id, "offset") SELECT %(c)s, * FROM unnest(%(n)s::varchar[], '
    '%(f)s::integer[], %(d)s::varchar[], %(s)s::text[], %(b)s::bigint[], %(k)s::varchar[], '
    '%(g)s::varchar[], %(o)s::bigint[])'
)


def _insert_rows(conn: Connection, cid: int, version: int, puts: Sequence[NewTensor]) -> None:
    """Insert a commit's tensor rows in one statement.

    PostgreSQL: one INSERT ... SELECT FROM unnest(arrays), 10 parameters whatever the
    count (a multi-row VALUES list of 10,000 parameters took 32 ms for 1,000 rows, this
    takes a few); elsewhere an executemany.
    """
    if conn.dialect.name == "postgresql":
        conn.exec_driver_sql(_PG_INSERT_ROWS, {
            "c": cid, "n": [p.name for p in puts], "f": [version] * len(puts),
            "d": [p.dtype for p in puts], "s": [shape_text(p.shape) for p in puts],
            "b": [p.nbytes for p in puts], "k": [p.checksum for p in puts],
            "g": [p.segment_id for p in puts], "o": [p.offset for p in puts]})
        return
    # elsewhere (SQLite) the DBAPI's executemany of plain tuples: SQLAlchemy's per-row
    # parameter processing was most of an import's catalog time (2 of 4.8 ms, 221 rows)
    conn.exec_driver_sql(_INSERT_ROWS, [
        (cid, p.name, version, p.dtype, shape_text(p.shape), p.nbytes, p.checksum,
         p.segment_id, p.offset) for p in puts])


_INSERT_ROWS = ('INSERT INTO tensors (collection_id, name, first_version, end_version, dtype, '
                'shape, nbytes, checksum, segment_id, "offset") '
                "VALUES (?, ?, ?, NULL, ?, ?, ?, ?, ?, ?)")


# The read path as plain text statements: a reader process pays SQLAlchemy's statement
# compilation on its first use of each Core construct (~4 ms for a snapshot's five),
# which is most of a fresh process's first snapshot; text() compiles in microseconds.
_SQL_INFO = text("SELECT id, name, head, retain_last FROM collections WHERE name = :name")
_SQL_TAG = text("SELECT version FROM tags WHERE collection_id = :cid AND name = :tag")
_SQL_HAS = text("SELECT version FROM commits WHERE collection_id = :cid AND version = :v")
_SQL_LEASE = text(
    "INSERT INTO leases (id, collection_id, version, holder, node, created_at, expires_at) "
    "VALUES (:id, :cid, :v, :holder, :node, :created, :expires)"
).bindparams(bindparam("created", type_=UTCDateTime()), bindparam("expires", type_=UTCDateTime()))
_SQL_ROWS = ('SELECT name, dtype, shape, nbytes, checksum, segment_id, "offset", first_version '
             "FROM tensors WHERE collection_id = :cid AND ")
_SQL_HEAD_ROWS = text(_SQL_ROWS + "end_version IS NULL")
_DBAPI_HEAD_ROWS = _SQL_ROWS.replace(":cid", "?") + "end_version IS NULL"  # qmark style
_SQL_VERSION_ROWS = text(_SQL_ROWS + "first_version <= :v AND (end_version IS NULL OR end_version > :v)")
_SQL_TIERS = text("SELECT id, tier FROM segments WHERE id IN :ids").bindparams(
    bindparam("ids", expanding=True))

_GC_LOCK_KEY = 0x7E75DA  # advisory lock between lease takers and version droppers (policies: ...D9)


class Catalog:
    """Metadata of one store, over a SQLAlchemy engine. Thread-safe; any process."""

    def __init__(self, engine: Engine, node: str, *, lease_engine: Engine | None = None) -> None:
        self.engine = engine
        self.node = node
        #: how long a call keeps retrying a lost catalog connection (``_retry``)
        self.retry_seconds = RETRY_SECONDS
        # leases die with their holders: they need no fsync (SQLite: a NORMAL-sync engine)
        self.lease_engine = lease_engine or engine

    # -- collections ---------------------------------------------------------------
    def _info(self, conn: Connection, name: str, *, lock: bool = False) -> CollectionInfo | None:
        if not lock or conn.dialect.name == "sqlite":
            row = conn.execute(_SQL_INFO, {"name": name}).first()
            return CollectionInfo(*row) if row else None
        q = select(collections.c.id, collections.c.name, collections.c.head,
                   collections.c.retain_last).where(collections.c.name == name)
        if lock and conn.dialect.name != "sqlite":
            q = q.with_for_update()
        row = conn.execute(q).first()
        return CollectionInfo(*row) if row else None

    @retrying
    def info(self, name: str) -> CollectionInfo | None:
        with self.engine.connect() as conn:
            return self._info(conn, name)

    def require(self, name: str) -> CollectionInfo:
        info = self.info(name)
        if info is None:
            raise NotFound(f"no collection {name!r}", collection=name)
        return info

    @retrying
    def collection_names(self) -> list[str]:
        with self.engine.connect() as conn:
            return list(conn.execute(select(collections.c.name).order_by(collections.c.name)).scalars())

    @retrying
    def set_retention(self, name: str, keep_last: int | None) -> None:
        if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
            raise InvalidInput(f"keep_last must be a positive integer or None, not {keep_last!r}",
                               collection=name)
        with write_conn(self.engine) as conn:
            res = conn.execute(update(collections).where(collections.c.name == name)
                               .values(retain_last=keep_last))
            if res.rowcount == 0:
                raise NotFound(f"no collection {name!r}", collection=name)

    def drop(self, name: str) -> None:
        with write_conn(self.engine) as conn:
            info = self._info(conn, name, lock=True)
            if info is None:
                raise NotFound(f"no collection {name!r}", collection=name)
            for table in (tensors, commits, tags, leases):
                conn.execute(delete(table).where(table.c.collection_id == info.id))
            conn.execute(delete(collections).where(collections.c.id == info.id))

    # -- versions --------------------------------------------------------------------
    def _has_version(self, conn: Connection, cid: int, version: int) -> bool:
        return conn.execute(_SQL_HAS, {"cid": cid, "v": version}).first() is not None

    @retrying
    def resolve(self, name: str, version: int | None = None, tag: str | None = None,
                conn: Connection | None = None) -> tuple[CollectionInfo, int]:
        """The collection and the version a (version | tag | head) reference names."""
        if conn is None:
            with self.engine.connect() as c:
                return self.resolve(name, version, tag, c)
        info = self._info(conn, name)
        if info is None:
            raise NotFound(f"no collection {name!r}", collection=name)
        if version is not None and tag is not None:
            raise InvalidInput("give a version or a tag, not both", collection=name)
        if tag is not None:
            v = conn.execute(_SQL_TAG, {"cid": info.id, "tag": tag}).scalar()
            if v is None:
                raise NotFound(f"no tag {tag!r} in collection {name!r}", collection=name)
            return info, int(v)
        if version is None:
            if info.head == 0:
                raise NotFound(f"collection {name!r} has no version yet", collection=name)
            return info, info.head
        if isinstance(version, bool) or not isinstance(version, int):
            raise InvalidInput(f"version must be an integer, not {version!r}", collection=name)
        if not self._has_version(conn, info.id, version):
            raise NotFound(f"no version {version} of collection {name!r}", collection=name,
                           version=version)
        return info, version

    @staticmethod
    def _manifest_query(cid: int, version: int | None) -> Any:
        t = tensors.c
        q = (select(t.name, t.dtype, t.shape, t.nbytes, t.checksum, t.segment_id, t.offset,
                    t.first_version).where(t.collection_id == cid))
        if version is None:  # the head: the partial index on live rows answers it
            return q.where(t.end_version.is_(None))
        return q.where(t.first_version <= version,
                       or_(t.end_version.is_(None), t.end_version > version))

    @staticmethod
    def _rows(conn: Connection, result: Any) -> list[TensorRow]:
        raw = result.all()
        # a version spans few segments: look their tiers up once instead of joining
        # every row (a third of the manifest's cost at 1,000 rows)
        seg_ids = list({r[5] for r in raw if r[5] is not None})
        tiers = dict(conn.execute(_SQL_TIERS, {"ids": seg_ids}).all()) if seg_ids else {}
        return _tensor_rows(raw, tiers)

    @retrying
    def manifest(self, cid: int, version: int, names: Sequence[str] | None = None,
                 conn: Connection | None = None, *, head: bool = False) -> list[TensorRow]:
        """The tensors of one version (or those of ``names``), ordered by name.

        ``head``: ``version`` is the head as seen in the same snapshot as ``conn``'s
        (a cheaper lookup through the live-rows index)."""
        if conn is None:
            with self.engine.connect() as c:
                return self.manifest(cid, version, names, c, head=head)
        if names is None:  # a whole version: the reader's hot path
            if head:
                return self._rows(conn, conn.execute(_SQL_HEAD_ROWS, {"cid": cid}))
            return self._rows(conn, conn.execute(_SQL_VERSION_ROWS, {"cid": cid, "v": version}))
        q = self._manifest_query(cid, None if head else version)
        q = q.where(_in(conn, tensors.c.name, names))
        return self._rows(conn, conn.execute(q))

    @retrying
    def live(self, cid: int) -> dict[str, TensorRow]:
        """The head's rows by name."""
        with self.engine.connect() as conn:
            # the text statement: a Core construct's cache-key walk was most of this call
            return {r.name: r for r in self._rows(conn, conn.execute(_SQL_HEAD_ROWS,
                                                                     {"cid": cid}))}

    def commit(self, name: str, base: int, puts: Sequence[NewTensor], unchanged: Iterable[str],
               deletes: Iterable[str], segment: tuple[str, str, int] | None,
               message: str | None, meta: dict[str, str] | None = None, *,
               durable: bool = True) -> Commit:
        """Publish a new version in one SQL transaction.

        ``base`` is the head the transaction started from; if the head moved since, the
        commit still lands unless a name it touches (put, unchanged put or delete) was
        written or deleted after ``base``: then CommitConflict. ``segment`` is (id, tier,
        nbytes) of the bytes already written for ``puts``. ``durable=False`` skips the
        embedded catalog's fsync, for a segment on a tier that a reboot clears anyway.

        A lost catalog connection is retried (``_retry``); the commit carries an id of
        its own, and a retry whose first attempt did land returns that commit instead of
        making a second one.
        """
        unchanged, deletes = list(unchanged), list(deletes)
        txn_id = uuid.uuid4().hex
        attempts = 0

        def once() -> Commit:
            nonlocal attempts
            attempts += 1
            if attempts > 1:
                landed = self._commit_by_txn(name, txn_id)
                if landed is not None:
                    return landed
            return self._commit(name, base, puts, unchanged, deletes, segment, message,
                                meta, txn_id, durable)

        return retry_call(self.retry_seconds, once)

    def _commit_by_txn(self, name: str, txn_id: str) -> Commit | None:
        with self.engine.connect() as conn:
            v = conn.execute(select(commits.c.version).where(commits.c.txn_id == txn_id)).scalar()
        return None if v is None else self.commit_info(name, v)

    def _commit(self, name: str, base: int, puts: Sequence[NewTensor], unchanged: list[str],
                deletes: list[str], segment: tuple[str, str, int] | None,
                message: str | None, meta: dict[str, str] | None, txn_id: str,
                durable: bool) -> Commit:
        touched = {p.name for p in puts} | set(unchanged) | set(deletes)
        now = _now()
        with write_conn(self.engine, durable=durable) as conn:
            info = self._info(conn, name, lock=True)
            if info is None:
                _insert_ignore(conn, collections, {"name": name, "head": 0, "created_at": now})
                info = self._info(conn, name, lock=True)
                assert info is not None
            head = info.head
            if head != base:
                t = tensors.c
                moved = set(conn.execute(select(t.name).where(
                    t.collection_id == info.id,
                    or_(t.first_version > base, t.end_version > base))).scalars())
                clash = sorted(moved & touched)
                if clash:
                    shown = ", ".join(repr(n) for n in clash[:5])
                    raise CommitConflict(
                        f"collection {name!r} moved from version {base} to {head} under this "
                        f"transaction, and both changed {shown}"
                        + (f" and {len(clash) - 5} more" if len(clash) > 5 else ""),
                        collection=name, names=clash, base=base, head=head)
            version = head + 1
            t = tensors.c
            replace = [p.name for p in puts] + deletes
            removed_n = removed_bytes = 0
            if replace:
                close = (update(tensors).where(t.collection_id == info.id,
                                               t.end_version.is_(None),
                                               _in(conn, t.name, replace))
                         .values(end_version=version))
                if conn.dialect.update_returning:
                    old = conn.execute(close.returning(t.name, t.nbytes)).all()
                else:
                    old = conn.execute(select(t.name, t.nbytes).where(
                        t.collection_id == info.id, t.end_version.is_(None),
                        _in(conn, t.name, replace))).all()
                    conn.execute(close)
                found = {r[0] for r in old}
                missing = [d for d in deletes if d not in found]
                if missing:  # raising rolls the whole transaction back
                    raise NotFound(f"cannot delete {missing[0]!r}: collection {name!r} has no "
                                   f"such tensor", collection=name, tensor=missing[0])
                removed_n, removed_bytes = len(old), sum(r[1] for r in old)
            if segment is not None:
                sid, tier, snb = segment
                conn.execute(segments.insert().values(id=sid, node=self.node, tier=tier,
                                                      nbytes=snb, created_at=now))
            if puts:
                _insert_rows(conn, info.id, version, puts)
            prev = conn.execute(select(commits.c.n_tensors, commits.c.nbytes).where(
                commits.c.collection_id == info.id, commits.c.version == head)).first()
            n_prev, b_prev = (prev[0], prev[1]) if prev else (0, 0)
            written_bytes = sum(p.nbytes for p in puts)
            result = Commit(
                collection=name, version=version, created_at=now, message=message,
                tensors=n_prev - removed_n + len(puts), nbytes=b_prev - removed_bytes + written_bytes,
                parent=head or None, written=len(puts), written_nbytes=written_bytes,
                metadata=meta)
            conn.execute(commits.insert().values(
                collection_id=info.id, version=version, parent=result.parent, message=message,
                created_at=now, n_tensors=result.tensors, nbytes=result.nbytes,
                n_written=result.written, written_nbytes=written_bytes,
                meta=json.dumps(meta) if meta else None, txn_id=txn_id))
            conn.execute(update(collections).where(collections.c.id == info.id)
                         .values(head=version))
            if conn.dialect.name == "postgresql":  # delivered to watchers if this commits
                conn.execute(select(func.pg_notify("tensordb_commit", f"{name}\n{version}")))
        return result

    @retrying
    def history(self, name: str, *, after: int | None = None,
                version: int | None = None) -> list[Commit]:
        """Commits of ``name``, newest first: all, those after ``after``, or ``version``
        alone (the filters run in SQL: a follower's look costs what is new, not the
        collection's whole history)."""
        info = self.require(name)
        c = commits.c
        q = (select(c.version, c.created_at, c.message, c.n_tensors, c.nbytes, c.parent,
                    c.n_written, c.written_nbytes, c.meta)
             .where(c.collection_id == info.id).order_by(c.version.desc()))
        if after is not None:
            q = q.where(c.version > after)
        if version is not None:
            q = q.where(c.version == version)
        with self.engine.connect() as conn:
            rows = conn.execute(q)
            return [Commit(name, r[0], r[1], r[2], r[3], r[4], r[5], r[6], r[7],
                           json.loads(r[8]) if r[8] else None) for r in rows]

    def commit_info(self, name: str, version: int) -> Commit:
        found = self.history(name, version=version)
        if not found:
            raise NotFound(f"no version {version} of collection {name!r}", collection=name,
                           version=version)
        return found[0]

    def commits_after(self, name: str, after: int) -> list[Commit]:
        return self.history(name, after=after)[::-1]

    # -- tags --------------------------------------------------------------------------
    @retrying
    def tag(self, name: str, tag: str, version: int | None) -> int:
        with write_conn(self.engine) as conn:
            info, v = self.resolve(name, version, None, conn)
            conn.execute(delete(tags).where(tags.c.collection_id == info.id, tags.c.name == tag))
            conn.execute(tags.insert().values(collection_id=info.id, name=tag, version=v,
                                              created_at=_now()))
            return v

    @retrying
    def untag(self, name: str, tag: str) -> None:
        with write_conn(self.engine) as conn:
            info = self._info(conn, name)
            if info is None:
                raise NotFound(f"no collection {name!r}", collection=name)
            if conn.execute(delete(tags).where(tags.c.collection_id == info.id,
                                               tags.c.name == tag)).rowcount == 0:
                raise NotFound(f"no tag {tag!r} in collection {name!r}", collection=name)

    @retrying
    def tags(self, name: str) -> dict[str, int]:
        info = self.require(name)
        with self.engine.connect() as conn:
            return dict(conn.execute(select(tags.c.name, tags.c.version)
                                     .where(tags.c.collection_id == info.id).order_by(tags.c.name)).all())

    # -- leases ------------------------------------------------------------------------
    @staticmethod
    def _gc_lock(conn: Connection, *, shared: bool) -> None:
        """On PostgreSQL, snapshot openers (shared) and version droppers (exclusive)
        exclude each other, so a lease never lands on a version being dropped.
        SQLite's write transactions are serialised already."""
        if conn.dialect.name == "postgresql":
            fn = "pg_advisory_xact_lock_shared" if shared else "pg_advisory_xact_lock"
            conn.execute(select(getattr(func, fn)(_GC_LOCK_KEY)))

    @staticmethod
    def _ephemeral(conn: Connection) -> None:
        if conn.dialect.name == "postgresql":
            conn.exec_driver_sql("SET LOCAL synchronous_commit TO OFF")

    def open_snapshot(self, name: str, version: int | None, tag: str | None, holder: str,
                      ttl: float) -> tuple[str, CollectionInfo, int, list[TensorRow]]:
        """Resolve a version, lease it and read its manifest in one transaction, so gc
        cannot slip between the look-up and the lease."""
        lease_id = uuid.uuid4().hex
        if version is None and tag is None and self.lease_engine.dialect.name == "sqlite":
            # SQLite's errors are never a lost connection: nothing to retry
            return self._open_head_sqlite(lease_id, name, holder, _now(), ttl)
        attempts = 0

        def once() -> tuple[str, CollectionInfo, int, list[TensorRow]]:
            nonlocal attempts
            attempts += 1
            return self._open_snapshot(lease_id, attempts > 1, name, version, tag, holder, ttl)

        return retry_call(self.retry_seconds, once)

    def _open_snapshot(self, lease_id: str, retry: bool, name: str, version: int | None,
                       tag: str | None, holder: str, ttl: float
                       ) -> tuple[str, CollectionInfo, int, list[TensorRow]]:
        now = _now()
        with write_conn(self.lease_engine) as conn:
            self._ephemeral(conn)
            self._gc_lock(conn, shared=True)
            if retry:  # an attempt whose answer was lost may have taken the lease
                conn.execute(delete(leases).where(leases.c.id == lease_id))
            info, v = self.resolve(name, version, tag, conn)
            conn.execute(_SQL_LEASE, {
                "id": lease_id, "cid": info.id, "v": v, "holder": holder, "node": self.node,
                "created": now, "expires": now + timedelta(seconds=ttl)})
            # the live-rows shortcut needs one snapshot for both statements: SQLite's
            # write transaction is one; PostgreSQL's READ COMMITTED is not, and a commit
            # landing between them would hand out the next version's rows
            rows = self.manifest(info.id, v, None, conn,
                                 head=(v == info.head and conn.dialect.name == "sqlite"))
        return lease_id, info, v, rows

    def _open_head_sqlite(self, lease_id: str, name: str, holder: str, now: datetime,
                          ttl: float) -> tuple[str, CollectionInfo, int, list[TensorRow]]:
        """``_open_snapshot`` of the head on SQLite, the reader's hot path: the same
        statements in one write transaction, on the lease engine's DBAPI connection.
        SQLAlchemy's connection and statement handling were most of a fresh process's
        first open (2.5 of 3.5 ms for a 221-tensor model); this takes about 1 ms."""
        with self._sqlite_write(self.lease_engine) as cur:
            row = cur.execute("SELECT id, name, head, retain_last FROM collections "
                              "WHERE name = ?", (name,)).fetchone()
            if row is None:
                raise NotFound(f"no collection {name!r}", collection=name)
            info = CollectionInfo(*row)
            if info.head == 0:
                raise NotFound(f"collection {name!r} has no version yet", collection=name)
            cur.execute("INSERT INTO leases (id, collection_id, version, holder, node, "
                        "created_at, expires_at) VALUES (?, ?, ?, ?, ?, ?, ?)",
                        (lease_id, info.id, info.head, holder, self.node, _sqlite_time(now),
                         _sqlite_time(now + timedelta(seconds=ttl))))
            raw = cur.execute(_DBAPI_HEAD_ROWS, (info.id,)).fetchall()
            seg_ids = list({r[5] for r in raw if r[5] is not None})
            tiers = dict(cur.execute(
                f"SELECT id, tier FROM segments WHERE id IN ({','.join('?' * len(seg_ids))})",
                seg_ids).fetchall()) if seg_ids else {}
        return lease_id, info, info.head, _tensor_rows(raw, tiers)

    @staticmethod
    @contextmanager
    def _sqlite_write(engine: Engine) -> Iterator[Any]:
        """A DBAPI cursor in a BEGIN IMMEDIATE transaction of a SQLite engine's pooled
        connection (its pragmas set when it was opened), committed on exit and rolled
        back on an error."""
        raw = engine.raw_connection()
        try:
            cur = raw.driver_connection.cursor()  # type: ignore[union-attr]
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

    def release_lease(self, lease_id: str) -> None:
        if self.lease_engine.dialect.name == "sqlite":
            with self._sqlite_write(self.lease_engine) as cur:
                cur.execute("DELETE FROM leases WHERE id = ?", (lease_id,))
            return
        retry_call(self.retry_seconds, self._release_lease, lease_id)

    def _release_lease(self, lease_id: str) -> None:
        with write_conn(self.lease_engine) as conn:
            self._ephemeral(conn)
            conn.execute(delete(leases).where(leases.c.id == lease_id))

    @retrying
    def lease_holders(self) -> list[tuple[str, str, int, str]]:
        with self.engine.connect() as conn:
            return [tuple(r) for r in conn.execute(  # type: ignore[misc]
                select(leases.c.id, collections.c.name, leases.c.version, leases.c.holder)
                .join(collections, collections.c.id == leases.c.collection_id))]

    # -- pins ---------------------------------------------------------------------------
    def pin(self, name: str, version: int | None, tag: str | None, tier: str) -> int:
        with write_conn(self.engine) as conn:
            info, v = self.resolve(name, version, tag, conn)
            _insert_ignore(conn, pins, {"collection_id": info.id, "version": v, "tier": tier,
                                        "created_at": _now()})
            return v

    def unpin(self, name: str, version: int | None, tag: str | None, tier: str) -> bool:
        with write_conn(self.engine) as conn:
            info, v = self.resolve(name, version, tag, conn)
            return conn.execute(delete(pins).where(
                pins.c.collection_id == info.id, pins.c.version == v,
                pins.c.tier == tier)).rowcount > 0

    @retrying
    def pins(self) -> list[tuple[str, int, str]]:
        with self.engine.connect() as conn:
            return [(r[0], r[1], r[2]) for r in conn.execute(
                select(collections.c.name, pins.c.version, pins.c.tier)
                .join(collections, collections.c.id == pins.c.collection_id)
                .order_by(collections.c.name, pins.c.version))]

    @retrying
    def pinned_segments(self, tier: str) -> set[str]:
        """Segments that hold bytes of a version pinned in ``tier``."""
        t = tensors.c
        q = (select(t.segment_id).distinct()
             .select_from(tensors.join(pins, pins.c.collection_id == t.collection_id))
             .where(pins.c.tier == tier, t.segment_id.is_not(None),
                    t.first_version <= pins.c.version,
                    or_(t.end_version.is_(None), t.end_version > pins.c.version)))
        with self.engine.connect() as conn:
            return set(conn.execute(q).scalars())

    @retrying
    def version_segments(self, cid: int, version: int) -> list[tuple[str, str, int]]:
        """(segment id, tier, nbytes) of the segments one version's tensors live in."""
        t = tensors.c
        q = (select(segments.c.id, segments.c.tier, segments.c.nbytes).distinct()
             .select_from(tensors.join(segments, segments.c.id == t.segment_id))
             .where(t.collection_id == cid, t.first_version <= version,
                    or_(t.end_version.is_(None), t.end_version > version),
                    segments.c.node == self.node))
        with self.engine.connect() as conn:
            return [(r[0], r[1], r[2]) for r in conn.execute(q)]

    def move_segment(self, segment_id: str, src: str, dst: str) -> bool:
        """Record that a segment now lives in ``dst``; False if it was not in ``src``."""
        with write_conn(self.engine) as conn:
            return conn.execute(update(segments).where(
                segments.c.id == segment_id, segments.c.tier == src,
                segments.c.node == self.node).values(tier=dst)).rowcount == 1

    @retrying
    def segment_tier(self, segment_id: str) -> str | None:
        with self.engine.connect() as conn:
            return conn.execute(select(segments.c.tier).where(
                segments.c.id == segment_id, segments.c.node == self.node)).scalar()

    def drop_versions(self, name: str, keep_last: int | None,
                      older_than: timedelta | None) -> int:
        """Forget versions (never the head, a tagged, pinned or leased one); gc then
        reclaims what only they needed. Returns how many were dropped."""
        with write_conn(self.engine) as conn:
            self._gc_lock(conn, shared=False)
            info = self._info(conn, name, lock=True)
            if info is None:
                raise NotFound(f"no collection {name!r}", collection=name)
            held, _ = self._held(conn)
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
                q = q.where(commits.c.created_at < _now() - older_than)
            drop = [v for v in conn.execute(q).scalars() if v not in keep]
            if drop:
                conn.execute(delete(commits).where(commits.c.collection_id == info.id,
                                                   commits.c.version.in_(drop)))
            return len(drop)

    @retrying
    def node_names(self) -> set[str]:
        with self.engine.connect() as conn:
            return set(conn.execute(select(nodes.c.name)).scalars())

    # -- segments ----------------------------------------------------------------------
    @retrying
    def segment_registered(self, segment_id: str) -> bool:
        with self.engine.connect() as conn:
            return conn.execute(select(segments.c.id).where(segments.c.id == segment_id)).first() is not None

    @retrying
    def all_rows(self) -> list[tuple[str, int, TensorRow]]:
        """Every stored tensor row (collection name, first version, row) of this node."""
        t = tensors.c
        q = (select(collections.c.name, t.name, t.dtype, t.shape, t.nbytes, t.checksum,
                    t.segment_id, t.offset, segments.c.tier, t.first_version)
             .select_from(tensors.join(collections, collections.c.id == t.collection_id)
                          .join(segments, segments.c.id == t.segment_id))
             .where(segments.c.node == self.node)
             .order_by(t.segment_id, t.offset))
        with self.engine.connect() as conn:
            return [(r[0], r[9], TensorRow(r[1], r[2], parse_shape(r[3]), r[4], r[5], r[6], r[7],
                                           r[8], r[9])) for r in conn.execute(q)]

    # -- gc ----------------------------------------------------------------------------
    @staticmethod
    def _held(conn: Connection) -> tuple[set[tuple[int, int]], list[str]]:
        """(collection id, version) pairs under a live lease, and the ids of dead leases."""
        now = _now()
        expired: list[str] = []
        held: set[tuple[int, int]] = set()
        for lid, cid, v, holder, exp in conn.execute(select(
                leases.c.id, leases.c.collection_id, leases.c.version, leases.c.holder,
                leases.c.expires_at)):
            alive = holder_alive(holder)
            if alive is False or (alive is None and exp < now):
                expired.append(lid)
            else:
                held.add((cid, v))
        return held, expired

    def gc(self) -> GcPlan:
        """Drop what no version, tag, lease or retention rule needs, in one transaction.

        Returns the segments whose rows were removed; the caller deletes their bytes
        after this transaction has committed.
        """
        with write_conn(self.engine) as conn:
            self._gc_lock(conn, shared=False)
            held, expired = self._held(conn)
            if expired:
                conn.execute(delete(leases).where(leases.c.id.in_(expired)))
            tagged = {(r[0], r[1]) for r in conn.execute(select(tags.c.collection_id, tags.c.version))}
            tagged |= {(r[0], r[1]) for r in conn.execute(select(pins.c.collection_id, pins.c.version))}
            dropped_versions = dropped_rows = 0
            for cid, head, keep in conn.execute(select(
                    collections.c.id, collections.c.head, collections.c.retain_last)).all():
                versions = sorted(conn.execute(select(commits.c.version)
                                               .where(commits.c.collection_id == cid)).scalars())
                if keep is not None:
                    drop = [v for v in versions if v <= head - keep and (cid, v) not in held
                            and (cid, v) not in tagged]
                    if drop:
                        conn.execute(delete(commits).where(commits.c.collection_id == cid,
                                                           commits.c.version.in_(drop)))
                        dropped_versions += len(drop)
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
                    dropped_rows += len(dead)
            unused = select(segments.c.id, segments.c.tier, segments.c.nbytes).where(
                segments.c.node == self.node,
                ~exists().where(tensors.c.segment_id == segments.c.id))
            dead_segments = [(r[0], r[1], r[2]) for r in conn.execute(unused)]
            if dead_segments:
                conn.execute(delete(segments).where(
                    segments.c.id.in_([s[0] for s in dead_segments])))
        return GcPlan(dead_segments, dropped_versions, dropped_rows, len(expired))

    @retrying
    def stats(self) -> dict[str, int]:
        with self.engine.connect() as conn:
            return {
                "collections": conn.execute(select(func.count()).select_from(collections)).scalar() or 0,
                "segments": conn.execute(select(func.count()).select_from(segments)
                                         .where(segments.c.node == self.node)).scalar() or 0,
                "segment_bytes": conn.execute(select(func.coalesce(func.sum(segments.c.nbytes), 0))
                                              .where(segments.c.node == self.node)).scalar() or 0,
                "leases": conn.execute(select(func.count()).select_from(leases)).scalar() or 0,
            }
