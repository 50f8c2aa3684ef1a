"""What every part of the catalog shares: its values and a few SQL helpers.

The values are what the catalog hands its callers (``Commit``, ``TensorRow``, ...);
the helpers are statements more than one part runs (a collection's row, the gc lock)
and the dialect differences they hide (one array parameter for ``IN`` on PostgreSQL,
``INSERT ... ON CONFLICT DO NOTHING``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from functools import lru_cache
from typing import Any, NamedTuple

from sqlalchemy import Connection, String, Table, any_, func, literal, select, text
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.exc import IntegrityError

import storage_engine as se

from .schema import collections

__all__ = [
    "Commit",
    "CollectionInfo",
    "TensorRow",
    "NewTensor",
    "NewSegment",
    "NewShard",
    "ShardRow",
    "GcPlan",
    "collection_info",
    "gc_lock",
    "insert_ignore",
    "is_in",
    "names_in",
    "now_utc",
    "parse_shape",
    "shape_text",
    "source_of",
    "source_row",
    "tensor_rows",
]


def now_utc() -> datetime:
    """The current time, in UTC: the catalog stores no other."""
    return datetime.now(timezone.utc)


@dataclass(frozen=True, slots=True)
class Commit:
    """One published version of a collection.

    ``tensors`` / ``nbytes``: the whole version's rows (its tensors, and the one row of
    its files where it has any: ``Snapshot.files``); ``written`` / ``written_nbytes``:
    what this commit stored anew (the rest is shared with the parent version).
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
    """A collection's row: its id, name, head version (0: none yet) and retention."""

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


class NewTensor(NamedTuple):
    """A tensor row a commit adds: its bytes are already at ``offset`` of the segment
    (a tuple: a commit of 100,000 tensors builds 100,000)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    checksum: str
    segment_id: str | None
    offset: int


class NewShard(NamedTuple):
    """A shard of a sharded row a commit adds (the row is a ``NewTensor`` with no
    segment and the whole tensor's size): the box ``offsets`` + ``shape`` of the global
    shape, its bytes contiguous at ``offset`` of ``segment_id``."""

    name: str
    idx: int
    rank: int
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    nbytes: int
    checksum: str
    segment_id: str | None
    offset: int


class ShardRow(NamedTuple):
    """Where one shard of a sharded row lives, and which rank wrote it."""

    name: str
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    nbytes: int
    checksum: str
    segment_id: str | None
    offset: int
    tier: str | None
    rank: int


@dataclass(frozen=True, slots=True)
class NewSegment:
    """A segment a commit registers beside its rows: ``source`` is the file it references
    in place (None: the tier holds the segment's own bytes)."""

    id: str
    tier: str
    nbytes: int
    source: se.SourceFile | None = None


@dataclass(frozen=True, slots=True)
class GcPlan:
    """What a catalog gc removed: the segments whose files may now be deleted."""

    dead_segments: list[tuple[str, str, int]]  # (segment id, tier, nbytes)
    dropped_versions: int
    dropped_rows: int
    expired_leases: int


def _signed64(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v


def source_row(src: se.SourceFile) -> dict[str, Any]:
    """A ``segment_sources`` row's columns for a referenced file (inode and device as
    signed 64-bit: BIGINT has no unsigned kind)."""
    return {"path": src.path, "nbytes": src.nbytes, "mtime_ns": src.mtime_ns,
            "inode": _signed64(src.inode), "dev": _signed64(src.dev)}


def source_of(path: str, nbytes: int, mtime_ns: int, inode: int, dev: int) -> se.SourceFile:
    """The referenced file a ``segment_sources`` row records."""
    return se.SourceFile(path, nbytes, mtime_ns, inode % (1 << 64), dev % (1 << 64))


@lru_cache(maxsize=4096)
def _shape_text(shape: tuple[int, ...]) -> str:
    return ",".join(str(int(d)) for d in shape)


def shape_text(shape: Sequence[int]) -> str:
    """A shape as the ``tensors.shape`` column stores it: ``"4096,4096"``, ``""`` for 0-d
    (cached: a model repeats a few shapes many times)."""
    return _shape_text(shape if isinstance(shape, tuple) else tuple(shape))


@lru_cache(maxsize=4096)
def parse_shape(s: str) -> tuple[int, ...]:
    """The inverse of ``shape_text``; cached, as a model repeats a few shapes many times."""
    return tuple(int(d) for d in s.split(",")) if s else ()


def tensor_rows(raw: Sequence[Sequence[Any]], tiers: Mapping[str, str]) -> list[TensorRow]:
    """Manifest rows (name, dtype, shape, nbytes, checksum, segment id, offset, first
    version) as TensorRows, with their segment's tier, ordered by name."""
    rows = [TensorRow(r[0], r[1], parse_shape(r[2]), r[3], r[4], r[5], r[6],
                      tiers.get(r[5]), r[7]) for r in raw]
    se.add_work("rows_built", len(rows))
    rows.sort()
    return rows


def is_in(conn: Connection, col: Any, values: Sequence[str]) -> Any:
    """``col IN values``; on PostgreSQL one array parameter instead of one per value."""
    if conn.dialect.name == "postgresql":
        return col == any_(literal(list(values), ARRAY(String)))
    return col.in_(list(values))


#: above this many names, SQLite takes them from a temporary table instead of one bound
#: parameter each (its statements hold at most 32,766 of them on some builds, and
#: parsing 100,000 took most of a second)
_TEMP_NAMES_OVER = 500


def names_in(conn: Connection, col: Any, names: Sequence[str]) -> Any:
    """``col IN names`` for a list of any length: ``is_in`` for a few names, and on
    SQLite a per-connection temporary table for many (filled by one executemany, read
    by the statement through its primary key), so a commit of k tensors costs O(k)
    whatever k is."""
    if conn.dialect.name != "sqlite" or len(names) <= _TEMP_NAMES_OVER:
        return is_in(conn, col, names)
    conn.exec_driver_sql("CREATE TEMP TABLE IF NOT EXISTS td_names (name TEXT PRIMARY KEY) "
                         "WITHOUT ROWID")
    conn.exec_driver_sql("DELETE FROM temp.td_names")
    conn.exec_driver_sql("INSERT OR IGNORE INTO temp.td_names (name) VALUES (?)",
                         [(n,) for n in names])
    return col.in_(text("SELECT name FROM temp.td_names"))


def insert_ignore(conn: Connection, table: Table, values: dict[str, Any]) -> None:
    """Insert a row unless one with its key exists (a concurrent writer's, say)."""
    name = conn.dialect.name
    if name == "sqlite":
        conn.execute(sqlite_insert(table).values(**values).on_conflict_do_nothing())
    elif name == "postgresql":
        conn.execute(pg_insert(table).values(**values).on_conflict_do_nothing())
    else:
        try:
            with conn.begin_nested():
                conn.execute(table.insert().values(**values))
        except IntegrityError:
            pass


# a text statement: a reader process pays SQLAlchemy's compilation on its first use of
# each Core construct, and text() compiles in microseconds
_SQL_INFO = text("SELECT id, name, head, retain_last FROM collections WHERE name = :name")


def collection_info(conn: Connection, name: str, *, lock: bool = False) -> CollectionInfo | None:
    """The collection's row, or None. ``lock``: hold its row lock to the end of the
    transaction (SELECT ... FOR UPDATE; SQLite's write transaction holds the lock)."""
    if not lock or conn.dialect.name == "sqlite":
        row = conn.execute(_SQL_INFO, {"name": name}).first()
        return CollectionInfo(*row) if row else None
    c = collections.c
    row = conn.execute(select(c.id, c.name, c.head, c.retain_last)
                       .where(c.name == name).with_for_update()).first()
    return CollectionInfo(*row) if row else None


# advisory lock id between lease takers and version droppers (migrations use ...D8,
# the policy leader ...D9)
_GC_LOCK_KEY = 0x7E75DA


def gc_lock(conn: Connection, *, shared: bool) -> None:
    """On PostgreSQL, snapshot openers (shared) and version droppers (exclusive)
    exclude each other, so a lease never lands on a version being dropped.
    SQLite's write transactions are serialised already."""
    if conn.dialect.name == "postgresql":
        fn = "pg_advisory_xact_lock_shared" if shared else "pg_advisory_xact_lock"
        conn.execute(select(getattr(func, fn)(_GC_LOCK_KEY)))
