"""Collections, their versions and tags: resolving a reference to a version, reading a
version's manifest, and publishing a commit.

Each public method is one SQL transaction. A commit takes the write lock up front
(BEGIN IMMEDIATE on SQLite, SELECT ... FOR UPDATE on the collection row elsewhere), so
concurrent writers queue instead of failing, and versions stay consecutive.
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any, NamedTuple

from sqlalchemy import (
    Connection,
    Engine,
    Select,
    bindparam,
    delete,
    or_,
    select,
    text,
    update,
)
from sqlalchemy.exc import SQLAlchemyError

import storage_engine as se

from ..errors import CommitConflict, InvalidInput, NotFound
from ._common import (
    CollectionInfo,
    Commit,
    NewSegment,
    NewShard,
    NewTensor,
    ShardRow,
    TensorRow,
    collection_info,
    names_in,
    now_utc,
    parse_shape,
    shape_text,
    source_row,
    tensor_rows,
)
from ._manifests import Manifests
from ._quotas import check_quotas
from ._retry import RETRY_SECONDS, retry_call, retrying
from ._sql import notify_after_commit, write_conn
from .schema import (
    UTCDateTime,
    collections,
    commits,
    leases,
    segments,
    tags,
    tensor_shards,
    tensors,
)

__all__ = ["Versions", "Published", "DBAPI_HEAD_ROWS"]

_log = logging.getLogger("tensordb.catalog")

# The read path as plain text statements: a reader process pays SQLAlchemy's statement
# compilation on its first use of each Core construct (~4 ms for a snapshot's five),
# which is most of a fresh process's first snapshot; text() compiles in microseconds.
_MAX_VERSION = 2**63 - 1  # commits.version is a 64-bit integer
_SQL_TAG = text("SELECT version FROM tags WHERE collection_id = :cid AND name = :tag")
_SQL_HAS = text("SELECT version FROM commits WHERE collection_id = :cid AND version = :v")
_SQL_ROWS = ('SELECT name, dtype, shape, nbytes, checksum, segment_id, "offset", first_version '
             "FROM tensors WHERE collection_id = :cid AND ")
_SQL_HEAD_ROWS = text(_SQL_ROWS + "end_version IS NULL")
#: the head's rows for a DBAPI cursor (qmark style), for the lease's SQLite hot path
DBAPI_HEAD_ROWS = _SQL_ROWS.replace(":cid", "?") + "end_version IS NULL"
_SQL_VERSION_ROWS = text(
    _SQL_ROWS + "first_version <= :v AND (end_version IS NULL OR end_version > :v)")
_SQL_TIERS = text("SELECT id, tier FROM segments WHERE id IN :ids").bindparams(
    bindparam("ids", expanding=True))

_PG_INSERT_ROWS = (
    'INSERT INTO tensors (collection_id, name, first_version, dtype, shape, nbytes, '
    'checksum, segment_id, "offset") SELECT %(c)s, * FROM unnest(%(n)s::varchar[], '
    '%(f)s::integer[], %(d)s::varchar[], %(s)s::text[], %(b)s::bigint[], %(k)s::varchar[], '
    '%(g)s::varchar[], %(o)s::bigint[])'
)
_INSERT_ROWS = ('INSERT INTO tensors (collection_id, name, first_version, end_version, dtype, '
                'shape, nbytes, checksum, segment_id, "offset") '
                "VALUES (?, ?, ?, NULL, ?, ?, ?, ?, ?, ?)")


#: above this many rows a PostgreSQL commit sends them by COPY: psycopg dumps a text
#: array element by element in Python (a regular-expression test each: 250 ms of a
#: 10,000-row commit), where COPY takes one pre-formatted text stream
_PG_COPY_OVER = 1000
_PG_COPY = ('COPY tensors (collection_id, name, first_version, dtype, shape, nbytes, checksum, '
            'segment_id, "offset") FROM STDIN')
#: characters COPY's text format would need escaped; names never hold them (check_name
#: refuses control characters and backslashes), and a commit that did goes by unnest
_COPY_SPECIAL = re.compile(r"[\\\t\n\r]")


def _copyable(puts: Sequence[NewTensor]) -> bool:
    return _COPY_SPECIAL.search("".join([p.name for p in puts])
                                + "".join([p.dtype for p in puts])) is None


def _copy_rows(conn: Connection, cid: int, version: int, puts: Sequence[NewTensor]) -> None:
    """The rows as one COPY stream, in the commit's transaction."""
    head = f"{cid}\t"
    mid = f"\t{version}\t"
    text_rows = "".join([
        f"{head}{p.name}{mid}{p.dtype}\t{shape_text(p.shape)}\t{p.nbytes}\t{p.checksum}\t"
        f"{p.segment_id if p.segment_id is not None else chr(92) + 'N'}\t{p.offset}\n"
        for p in puts])
    dbapi = conn.connection.driver_connection
    assert dbapi is not None
    with dbapi.cursor() as cur, cur.copy(_PG_COPY) as copy:
        copy.write(text_rows)


#: commits of at least this many rows may leave PostgreSQL's statistics of the tensors
#: table stale (``_refresh_statistics``)
_ANALYZE_OVER = 10_000


def _refresh_statistics(engine: Engine, inserted: int) -> None:
    """ANALYZE the tensors table on PostgreSQL when a commit just inserted more than a
    tenth of the rows its statistics know of (what autovacuum waits for, up to a minute,
    before it analyzes). Until then the planner takes a table that was empty when last
    analyzed for a tiny one, and reads a head row by name through the collection's
    whole head: a 1-tensor commit into a fresh 100,000-tensor collection cost 60 ms
    against 11 ms at 1,000 tensors. ANALYZE samples a fixed number of rows (~0.1 s) and
    blocks no reader or writer; a failure only leaves it to autovacuum."""
    try:
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as c:
            known = c.exec_driver_sql(
                "SELECT reltuples FROM pg_class WHERE oid = 'tensors'::regclass").scalar()
            if known is None or known < 0 or inserted > 0.1 * known:
                c.exec_driver_sql("ANALYZE tensors")
    except SQLAlchemyError as exc:
        _log.warning("ANALYZE after a large commit failed: %s", exc)


def _pg_publish(conn: Connection, cid: int, version: int, puts: Sequence[NewTensor],
                segs: Sequence[tuple[str, str, str, int]], commit: dict[str, Any],
                created: datetime) -> None:
    """PostgreSQL: the segments, the tensor rows, the commit row and the head move as
    ONE statement (data-modifying WITH clauses): each statement of a commit cost its
    client a round trip through SQLAlchemy and psycopg (a 4-tensor commit: 4 ms of
    client CPU over 9 statements), which is what bounded commits/s, not the server."""
    params: dict[str, Any] = {"c": cid, "v": version, "created": created, **commit}
    parts = []
    if segs:
        values = []
        for k, (sid, node, tier, nbytes) in enumerate(segs):
            params.update({f"s{k}": sid, f"sn{k}": node, f"st{k}": tier, f"sb{k}": nbytes})
            values.append(f"(%(s{k})s, %(sn{k})s, %(st{k})s, %(sb{k})s, %(created)s, %(c)s)")
        parts.append("s AS (INSERT INTO segments (id, node, tier, nbytes, created_at, "
                     "collection_id) VALUES "
                     + ", ".join(values) + ")")
    if puts:
        parts.append(f"r AS ({_PG_INSERT_ROWS})")
        params.update(_unnest_params(cid, version, puts))
    parts.append(
        "m AS (INSERT INTO commits (collection_id, version, parent, message, created_at, "
        "n_tensors, nbytes, n_written, written_nbytes, meta, txn_id) VALUES (%(c)s, %(v)s, "
        "%(parent)s, %(message)s, %(created)s, %(n_tensors)s, %(nbytes)s, %(n_written)s, "
        "%(written_nbytes)s, %(meta)s, %(txn_id)s))")
    conn.exec_driver_sql("WITH " + ", ".join(parts)
                         + " UPDATE collections SET head = %(v)s WHERE id = %(c)s", params)


def _unnest_params(cid: int, version: int, puts: Sequence[NewTensor]) -> dict[str, Any]:
    return {"c": cid, "n": [p.name for p in puts], "f": [version] * len(puts),
            "d": [p.dtype for p in puts], "s": [shape_text(p.shape) for p in puts],
            "b": [p.nbytes for p in puts], "k": [p.checksum for p in puts],
            "g": [p.segment_id for p in puts], "o": [p.offset for p in puts]}


# The rest of a commit's statements as text, typed where a value needs it: a writer
# process paid SQLAlchemy's compilation of each Core construct on its first commit
# (about 1.5 ms each, 10 of a fresh process's first 19-ms commit); text() compiles in
# microseconds. The statements are the same on every backend; PostgreSQL runs the
# segments, commit and head ones inside ``_pg_publish`` instead.
_SQL_SEGMENT = text(
    "INSERT INTO segments (id, node, tier, nbytes, created_at, collection_id) "
    "VALUES (:id, :node, :tier, :nbytes, :created, :cid)"
).bindparams(bindparam("created", type_=UTCDateTime()))
_SQL_SOURCE = text(
    "INSERT INTO segment_sources (segment_id, path, nbytes, mtime_ns, inode, dev, created_at) "
    "VALUES (:segment_id, :path, :nbytes, :mtime_ns, :inode, :dev, :created)"
).bindparams(bindparam("created", type_=UTCDateTime()))
_SQL_COMMIT = text(
    "INSERT INTO commits (collection_id, version, parent, message, created_at, n_tensors, "
    "nbytes, n_written, written_nbytes, meta, txn_id) VALUES (:cid, :v, :parent, :message, "
    ":created, :n_tensors, :nbytes, :n_written, :written_nbytes, :meta, :txn_id)"
).bindparams(bindparam("created", type_=UTCDateTime()))
_SQL_MOVE_HEAD = text("UPDATE collections SET head = :v WHERE id = :cid")
#: a new collection's row, unless a concurrent writer's made it first (SQLite 3.24+ and
#: PostgreSQL both take ON CONFLICT ... DO NOTHING)
_SQL_NEW_COLLECTION = text(
    "INSERT INTO collections (name, head, created_at) VALUES (:name, 0, :created) "
    "ON CONFLICT (name) DO NOTHING"
).bindparams(bindparam("created", type_=UTCDateTime()))

#: a collection's row with its head commit's counts, in one look-up
_SQL_HEAD_COMMIT = (
    "SELECT c.id, c.name, c.head, c.retain_last, m.n_tensors, m.nbytes, m.txn_id "
    "FROM collections c LEFT JOIN commits m ON m.collection_id = c.id AND m.version = c.head "
    "WHERE c.name = :name")


def _lock_head(conn: Connection, name: str
               ) -> tuple[CollectionInfo, int, int, str | None] | None:
    """The collection (its row lock held to the end of the transaction on PostgreSQL;
    SQLite's write transaction holds the lock) and its head commit's tensor count,
    bytes and txn id; None when there is no such collection."""
    lock = " FOR UPDATE OF c" if conn.dialect.name == "postgresql" else ""
    row = conn.execute(text(_SQL_HEAD_COMMIT + lock), {"name": name}).first()
    if row is None:
        return None
    return CollectionInfo(*row[:4]), row[4] or 0, row[5] or 0, row[6]


def _insert_rows(conn: Connection, cid: int, version: int, puts: Sequence[NewTensor]) -> None:
    """Insert a commit's tensor rows on SQLite: the DBAPI's executemany of plain tuples
    (SQLAlchemy's per-row parameter processing was most of an import's catalog time, 2
    of 4.8 ms for 221 rows). PostgreSQL's rows go in the publish statement
    (``_pg_publish``: INSERT ... SELECT FROM unnest(arrays), 10 parameters whatever the
    count) or, past ``_PG_COPY_OVER`` rows, by COPY (``_copy_rows``)."""
    conn.exec_driver_sql(_INSERT_ROWS, [
        (cid, p.name, version, p.dtype, shape_text(p.shape), p.nbytes, p.checksum,
         p.segment_id, p.offset) for p in puts])


_INSERT_SHARDS = ('INSERT INTO tensor_shards (collection_id, name, first_version, idx, rank, '
                  'offsets, shape, nbytes, checksum, segment_id, "offset") VALUES '
                  "(?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)")


def _insert_shards(conn: Connection, cid: int, version: int,
                   shards: Sequence[NewShard]) -> None:
    """The shards of a commit's sharded rows: one executemany of plain tuples (the
    DBAPI's paramstyle; SQLAlchemy's per-row parameter processing cost 16 µs a row)."""
    sql = _INSERT_SHARDS if conn.dialect.paramstyle == "qmark" else \
        _INSERT_SHARDS.replace("?", "%s")
    conn.exec_driver_sql(sql, [
        (cid, s.name, version, s.idx, s.rank, shape_text(s.offsets), shape_text(s.shape),
         s.nbytes, s.checksum, s.segment_id, s.offset) for s in shards])


_SQL_SHARDS = select(
    tensor_shards.c.name, tensor_shards.c.offsets, tensor_shards.c.shape,
    tensor_shards.c.nbytes, tensor_shards.c.checksum, tensor_shards.c.segment_id,
    tensor_shards.c.offset, tensor_shards.c.rank, tensor_shards.c.first_version,
    tensor_shards.c.idx).order_by(tensor_shards.c.name, tensor_shards.c.first_version,
                                  tensor_shards.c.idx)


class Published(NamedTuple):
    """A commit's statements run (``Versions.publish_in``), not yet committed."""

    result: Commit
    txn_id: str
    prev_txn: str | None
    head: int
    replace: list[str]
    puts: Sequence[NewTensor]


def _check_conflict(conn: Connection, info: CollectionInfo, base: int,
                    touched: set[str]) -> None:
    """CommitConflict if a name in ``touched`` was written or deleted after ``base``."""
    t = tensors.c
    moved = set(conn.execute(select(t.name).where(
        t.collection_id == info.id,
        or_(t.first_version > base, t.end_version > base))).scalars())
    clash = sorted(moved & touched)
    if clash:
        shown = ", ".join(repr(n) for n in clash[:5])
        raise CommitConflict(
            f"collection {info.name!r} moved from version {base} to {info.head} under this "
            f"transaction, and both changed {shown}"
            + (f" and {len(clash) - 5} more" if len(clash) > 5 else ""),
            collection=info.name, names=clash, base=base, head=info.head)


def _close_rows(conn: Connection, info: CollectionInfo, version: int, replace: list[str],
                deletes: list[str]) -> tuple[int, int]:
    """End the live rows of ``replace`` at ``version``: (how many, their nbytes).
    NotFound (which rolls the commit back) if a name of ``deletes`` had no live row."""
    t = tensors.c
    named = names_in(conn, t.name, replace)
    close = (update(tensors).where(t.collection_id == info.id, t.end_version.is_(None), named)
             .values(end_version=version))
    if conn.dialect.update_returning:
        old = conn.execute(close.returning(t.name, t.nbytes)).all()
    else:
        old = conn.execute(select(t.name, t.nbytes).where(
            t.collection_id == info.id, t.end_version.is_(None), named)).all()
        conn.execute(close)
    found = {r[0] for r in old}
    missing = [d for d in deletes if d not in found]
    if missing:
        raise NotFound(f"cannot delete {missing[0]!r}: collection {info.name!r} has no "
                       f"such tensor", collection=info.name, tensor=missing[0])
    return len(old), sum(r[1] for r in old)


def _manifest_query(cid: int, version: int | None) -> Select[Any]:
    t = tensors.c
    q = (select(t.name, t.dtype, t.shape, t.nbytes, t.checksum, t.segment_id, t.offset,
                t.first_version).where(t.collection_id == cid))
    if version is None:  # the head: the partial index on live rows answers it
        return q.where(t.end_version.is_(None))
    return q.where(t.first_version <= version,
                   or_(t.end_version.is_(None), t.end_version > version))


def _rows(conn: Connection, result: Any) -> list[TensorRow]:
    raw = result.all()
    # a version spans few segments: look their tiers up once instead of joining
    # every row (a third of the manifest's cost at 1,000 rows)
    seg_ids = list({r[5] for r in raw if r[5] is not None})
    tiers: dict[str, str] = (dict(conn.execute(_SQL_TIERS, {"ids": seg_ids}).all())
                             if seg_ids else {})
    return tensor_rows(raw, tiers)


class Versions:
    """Collections, versions, commits and tags over the catalog's SQL engine.

    ``node`` is the node that a commit's new segment is recorded on."""

    def __init__(self, engine: Engine, node: str, manifests: Manifests | None = None) -> None:
        self.engine = engine
        self.node = node
        #: the host's packed manifests (``_manifests``), or None to read every one from SQL
        self.manifests = manifests
        #: how long a call keeps retrying a lost catalog connection (``_retry``)
        self.retry_seconds = RETRY_SECONDS

    # -- collections ---------------------------------------------------------------
    @retrying
    def info(self, name: str) -> CollectionInfo | None:
        with self.engine.connect() as conn:
            return collection_info(conn, name)

    def require(self, name: str) -> CollectionInfo:
        info = self.info(name)
        if info is None:
            raise NotFound(f"no collection {name!r}", collection=name)
        return info

    @retrying
    def collection_names(self) -> list[str]:
        with self.engine.connect() as conn:
            return list(conn.execute(select(collections.c.name)
                                     .order_by(collections.c.name)).scalars())

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
            info = collection_info(conn, name, lock=True)
            if info is None:
                raise NotFound(f"no collection {name!r}", collection=name)
            for table in (tensors, commits, tags, leases):
                conn.execute(delete(table).where(table.c.collection_id == info.id))
            # its segments wait for gc, stored by no collection: a later collection
            # that gets the same id (SQLite reuses them) is neither charged for them by
            # quotas nor given them by a scoped token's segment check
            conn.execute(update(segments).where(segments.c.collection_id == info.id)
                         .values(collection_id=None))
            conn.execute(delete(collections).where(collections.c.id == info.id))

    # -- versions --------------------------------------------------------------------
    @retrying
    def resolve(self, name: str, version: int | None = None, tag: str | None = None,
                conn: Connection | None = None) -> tuple[CollectionInfo, int]:
        """The collection and the version a (version | tag | head) reference names."""
        if conn is None:
            with self.engine.connect() as c:
                return self.resolve(name, version, tag, c)
        info = collection_info(conn, name)
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
        if not 1 <= version <= _MAX_VERSION:  # versions count from 1; the column is int64
            raise InvalidInput(f"version must be between 1 and 2**63-1, not {version}",
                               collection=name)
        if conn.execute(_SQL_HAS, {"cid": info.id, "v": version}).first() is None:
            raise NotFound(f"no version {version} of collection {name!r}", collection=name,
                           version=version)
        return info, version

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
                return _rows(conn, conn.execute(_SQL_HEAD_ROWS, {"cid": cid}))
            return _rows(conn, conn.execute(_SQL_VERSION_ROWS, {"cid": cid, "v": version}))
        q = _manifest_query(cid, None if head else version)
        q = q.where(names_in(conn, tensors.c.name, names))
        return _rows(conn, conn.execute(q))

    @retrying
    def segment_tiers(self, segment_ids: Sequence[str]) -> dict[str, str]:
        """segment id -> the tier it is in now, for the given segments."""
        if not segment_ids:
            return {}
        with self.engine.connect() as conn:
            return dict(conn.execute(_SQL_TIERS, {"ids": list(segment_ids)}).all())

    @retrying
    def live(self, cid: int, names: Sequence[str] | None = None) -> dict[str, TensorRow]:
        """The head's rows by name: all of them, or those of ``names`` only (what a
        commit of those names needs: O(len(names)) whatever the collection's size)."""
        with self.engine.connect() as conn:
            if names is None:
                # the text statement: a Core construct's cache-key walk was most of this
                return {r.name: r for r in _rows(conn, conn.execute(_SQL_HEAD_ROWS,
                                                                    {"cid": cid}))}
            if not names:
                return {}
            q = _manifest_query(cid, None).where(names_in(conn, tensors.c.name, names))
            return {r.name: r for r in _rows(conn, conn.execute(q))}

    # -- commits -----------------------------------------------------------------------
    def commit(self, name: str, base: int, puts: Sequence[NewTensor], unchanged: Iterable[str],
               deletes: Iterable[str], segment: tuple[str, str, int] | None,
               message: str | None, meta: dict[str, str] | None = None, *,
               durable: bool = True, more_segments: Sequence[NewSegment] = (),
               shards: Sequence[NewShard] = ()) -> Commit:
        """Publish a new version in one SQL transaction.

        ``base`` is the head the transaction started from; if the head moved since, the
        commit still lands unless a name it touches (put, unchanged put or delete) was
        written or deleted after ``base``: then CommitConflict. ``segment`` is (id, tier,
        nbytes) of the bytes already written for ``puts``. ``durable=False`` skips the
        embedded catalog's fsync, for a segment on a tier that a reboot clears anyway.
        ``more_segments``: further segments the rows point into (an import in place
        registers one per file), each with the file it references, if any.

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
                                meta, txn_id, durable, more_segments, shards)

        return retry_call(self.retry_seconds, once)

    def _commit_by_txn(self, name: str, txn_id: str) -> Commit | None:
        with self.engine.connect() as conn:
            v = conn.execute(select(commits.c.version).where(commits.c.txn_id == txn_id)).scalar()
        return None if v is None else self.commit_info(name, v)

    def _commit(self, name: str, base: int, puts: Sequence[NewTensor], unchanged: list[str],
                deletes: list[str], segment: tuple[str, str, int] | None,
                message: str | None, meta: dict[str, str] | None, txn_id: str,
                durable: bool, more_segments: Sequence[NewSegment],
                shards: Sequence[NewShard] = ()) -> Commit:
        """One attempt of ``commit``: close the replaced rows, insert the new ones and the
        segment, add the commit row and move the head, all in one SQL transaction."""
        with write_conn(self.engine, durable=durable) as conn:
            done = self.publish_in(conn, name, base, puts, unchanged, deletes, segment,
                                   message, meta, txn_id, more_segments, shards)
        return self.after_publish(done)

    def publish_in(self, conn: Connection, name: str, base: int, puts: Sequence[NewTensor],
                   unchanged: list[str], deletes: list[str],
                   segment: tuple[str, str, int] | None, message: str | None,
                   meta: dict[str, str] | None, txn_id: str,
                   more_segments: Sequence[NewSegment] = (),
                   shards: Sequence[NewShard] = (),
                   claimed: Sequence[str] = ()) -> Published:
        """The statements of a commit, in the caller's write transaction ``conn`` (a
        group commit runs them in the transaction of its last part); ``shards``: the
        shards of the sharded rows of ``puts``; ``claimed``: segments registered before
        (a group's parts, checked against the quotas as each landed) that this commit
        stores, made the collection's here.
        ``after_publish`` runs once it has committed. StoreFull naming a quota when the
        commit's segments would take a tenant past it (``_quotas``)."""
        created = now_utc()
        pg = self.engine.dialect.name == "postgresql"
        locked = _lock_head(conn, name)
        if locked is None:
            conn.execute(_SQL_NEW_COLLECTION, {"name": name, "created": created})
            locked = _lock_head(conn, name)
            assert locked is not None
        info, n_prev, b_prev, prev_txn = locked
        head = info.head
        if head != base:
            _check_conflict(conn, info, base,
                            {p.name for p in puts} | set(unchanged) | set(deletes))
        version = head + 1
        replace = [p.name for p in puts] + deletes
        # a collection's first version replaces nothing: no statement to find that out
        removed_n, removed_bytes = (_close_rows(conn, info, version, replace, deletes)
                                    if replace and head else (0, 0))
        if deletes and not head:
            raise NotFound(f"cannot delete {deletes[0]!r}: collection {name!r} has no "
                           f"such tensor", collection=name, tensor=deletes[0])
        segs = [(sid, self.node, tier, snb) for sid, tier, snb in ([segment] if segment
                                                                    else [])]
        segs += [(seg.id, self.node, seg.tier, seg.nbytes) for seg in more_segments]
        # a group's parts (``claimed``) were checked and counted as they landed
        stored = sum(snb for *_, snb in segs)
        if stored:
            check_quotas(conn, name, stored)
        if claimed:
            conn.execute(update(segments).where(segments.c.id.in_(claimed))
                         .values(collection_id=info.id))
        written_bytes = sum(p.nbytes for p in puts)
        result = Commit(
            collection=name, version=version, created_at=created, message=message,
            tensors=n_prev - removed_n + len(puts),
            nbytes=b_prev - removed_bytes + written_bytes, parent=head or None,
            written=len(puts), written_nbytes=written_bytes, metadata=meta)
        row = {"parent": result.parent, "message": message, "n_tensors": result.tensors,
               "nbytes": result.nbytes, "n_written": result.written,
               "written_nbytes": written_bytes,
               "meta": json.dumps(meta) if meta else None, "txn_id": txn_id}
        copied = pg and len(puts) > _PG_COPY_OVER and _copyable(puts)
        if copied:
            _copy_rows(conn, info.id, version, puts)
        if pg:
            _pg_publish(conn, info.id, version, [] if copied else puts, segs, row, created)
        else:
            for sid, node, tier, snb in segs:
                conn.execute(_SQL_SEGMENT, {"id": sid, "node": node, "tier": tier,
                                            "nbytes": snb, "created": created,
                                            "cid": info.id})
            if puts:
                _insert_rows(conn, info.id, version, puts)
            conn.execute(_SQL_COMMIT, {"cid": info.id, "v": version, "created": created,
                                       **row})
            conn.execute(_SQL_MOVE_HEAD, {"cid": info.id, "v": version})
        if shards:
            _insert_shards(conn, info.id, version, shards)
        for seg in more_segments:
            if seg.source is not None:
                conn.execute(_SQL_SOURCE, {"segment_id": seg.id, "created": created,
                                           **source_row(seg.source)})
        # watchers hear of it once it has committed (not inside: see the helper)
        notify_after_commit(conn, "tensordb_commit", f"{name}\n{version}")
        return Published(result, txn_id, prev_txn, head, replace, puts)

    def after_publish(self, done: Published) -> Commit:
        """What follows a commit's SQL transaction: statistics, the packed manifest."""
        result, puts = done.result, done.puts
        if len(puts) >= _ANALYZE_OVER and self.engine.dialect.name == "postgresql":
            _refresh_statistics(self.engine, len(puts))
        if self.manifests is not None and (done.prev_txn is not None or not done.head):
            # packed off the commit's path: the commit costs what it changed
            self.manifests.derive_later(done.txn_id, done.prev_txn, result.version,
                                        done.replace, puts, result.tensors)
        return result

    @retrying
    def shards(self, cid: int, rows: Sequence[TensorRow]) -> dict[str, list[ShardRow]]:
        """The shards of sharded ``rows`` (those with no segment and some bytes), by
        name, in the order they were stored."""
        want = {r.name: r.first_version for r in rows}
        if not want:
            return {}
        out: dict[str, list[ShardRow]] = {}
        with self.engine.connect() as conn:
            raw = conn.execute(_SQL_SHARDS.where(
                tensor_shards.c.collection_id == cid,
                names_in(conn, tensor_shards.c.name, list(want)))).all()
            seg_ids = list({r[5] for r in raw if r[5] is not None})
            tiers: dict[str, str] = (dict(conn.execute(_SQL_TIERS, {"ids": seg_ids}).all())
                                     if seg_ids else {})
        for name, offsets, shape, nbytes, csum, sid, off, rank, first, _ in raw:
            if want.get(name) == first:
                out.setdefault(name, []).append(ShardRow(
                    name, parse_shape(offsets), parse_shape(shape), nbytes, csum, sid, off,
                    tiers.get(sid) if sid else None, rank))
        return out

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
            out = [Commit(name, r[0], r[1], r[2], r[3], r[4], r[5], r[6], r[7],
                          json.loads(r[8]) if r[8] else None) for r in rows]
        se.add_work("commits_built", len(out))
        return out

    def commit_info(self, name: str, version: int) -> Commit:
        found = self.history(name, version=version)
        if not found:
            raise NotFound(f"no version {version} of collection {name!r}", collection=name,
                           version=version)
        return found[0]

    def commits_after(self, name: str, after: int) -> list[Commit]:
        """The commits after version ``after``, oldest first."""
        return self.history(name, after=after)[::-1]

    # -- tags --------------------------------------------------------------------------
    @retrying
    def tag(self, name: str, tag: str, version: int | None) -> int:
        with write_conn(self.engine) as conn:
            info, v = self.resolve(name, version, None, conn)
            conn.execute(delete(tags).where(tags.c.collection_id == info.id, tags.c.name == tag))
            conn.execute(tags.insert().values(collection_id=info.id, name=tag, version=v,
                                              created_at=now_utc()))
            return v

    @retrying
    def untag(self, name: str, tag: str) -> None:
        with write_conn(self.engine) as conn:
            info = collection_info(conn, name)
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
                                     .where(tags.c.collection_id == info.id)
                                     .order_by(tags.c.name)).all())
