"""The catalog's SQL engines: SQLite (embedded, WAL) or any SQLAlchemy URL (PostgreSQL),
their write transactions, and the schema migrations.

Migrations run on connect: a store at an older revision is upgraded under a lock (a
file lock for SQLite, an advisory lock for PostgreSQL), a store at a revision this code
does not know is refused with IncompatibleStore. A catalog with no tables at all (a new
store) is created from ``schema.metadata`` and stamped at HEAD_REVISION in one
transaction under the same lock, without Alembic (tests/test_migrations.py checks that
the two schemas are the same).
"""

from __future__ import annotations

import fcntl
import logging
import os
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import (
    Column,
    Connection,
    Engine,
    MetaData,
    PrimaryKeyConstraint,
    String,
    Table,
    create_engine,
    event,
    inspect,
    text,
)
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.pool import NullPool

import migrations

from ..errors import IncompatibleStore, InvalidInput
from .schema import HEAD_REVISION, metadata

__all__ = ["make_engine", "current_revision", "upgrade", "ensure_schema", "write_conn",
           "notify_after_commit"]

_log = logging.getLogger("tensordb.catalog")
_KNOWN = ("0001", "0002", "0003", "0004", "0005", "0006", "0007", "0008", "0009", "0010",
          "0011")
_PG_LOCK_KEY = 0x7E75D8  # advisory lock id for migrations

#: Alembic's version table as ``alembic stamp`` creates it (MigrationContext's
#: ``_version``: the constraint name is Alembic's), for a catalog created without Alembic
_alembic_version = Table(
    "alembic_version",
    MetaData(),
    Column("version_num", String(32), nullable=False),
    PrimaryKeyConstraint("version_num", name="alembic_version_pkc"),
)


def _set_wal(cur: Any) -> None:
    """Put the database in WAL mode. Switching takes an exclusive lock, which SQLite's
    busy handler does not wait for: processes opening a new store at the same moment
    (the ranks of a job) got "database is locked" at once. The switch is retried for as
    long as the busy timeout; a database already in WAL mode needs none."""
    deadline = time.monotonic() + 60
    pause = 0.005
    while True:
        try:
            if cur.execute("PRAGMA journal_mode").fetchone()[0].lower() != "wal":
                cur.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) and "busy" not in str(exc) or \
                    time.monotonic() > deadline:
                raise
            time.sleep(pause)
            pause = min(pause * 2, 0.2)


def make_engine(url: str, *, synchronous: str = "FULL") -> Engine:
    """A SQL engine for the catalog at ``url``; SQLite connections get WAL, the
    ``synchronous`` pragma and a 60 s busy timeout, and write transactions that take
    the write lock up front."""
    if url.startswith("sqlite"):
        path = url.split("///", 1)[1] if "///" in url else ""
        if path and path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        engine = create_engine(url, poolclass=NullPool if not path else None,
                               connect_args={"timeout": 60, "check_same_thread": False})
        sync = synchronous.upper()
        if sync not in ("OFF", "NORMAL", "FULL", "EXTRA"):
            raise InvalidInput(f"sqlite_synchronous must be OFF/NORMAL/FULL/EXTRA, not {synchronous!r}")

        @event.listens_for(engine, "connect")
        def _on_connect(dbapi_conn: Any, _record: Any) -> None:
            dbapi_conn.isolation_level = None  # we issue BEGIN ourselves, below
            cur = dbapi_conn.cursor()
            _set_wal(cur)
            cur.execute(f"PRAGMA synchronous={sync}")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA busy_timeout=60000")
            cur.close()

        @event.listens_for(engine, "begin")
        def _on_begin(conn: Connection) -> None:
            # a writer takes the write lock up front: a deferred transaction that later
            # wants to write can fail with SQLITE_BUSY instead of waiting its turn
            opts = conn.get_execution_options()
            immediate = opts.get("tensordb_write", False)
            if immediate and sync in ("FULL", "EXTRA"):
                # a commit whose bytes went to a tier that does not survive a reboot
                # (host shared memory) needs no fsync of its catalog row either: WAL with
                # synchronous=NORMAL stays atomic and survives a process crash, and after
                # a power loss the version it would keep is gone with its bytes anyway
                durable = opts.get("tensordb_durable", True)
                conn.exec_driver_sql(f"PRAGMA synchronous={sync if durable else 'NORMAL'}")
            conn.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")

        if path and path != ":memory:" and engine.url.database:
            _owner_only(engine.url.database)
        return engine
    try:
        return create_engine(url, pool_pre_ping=True, pool_size=4, max_overflow=8)
    except (SQLAlchemyError, ImportError, ValueError) as exc:
        raise InvalidInput(f"cannot use catalog URL {url!r}: {exc}") from exc


def _owner_only(path: str) -> None:
    """Make the SQLite file at ``path`` owner-only (0600) before SQLite opens it.

    SQLite creates the ``-wal`` and ``-shm`` side files with the mode of the database
    file itself, so a database file created here 0600 (not left for SQLite to create
    under the process umask) gives side files 0600 too, with no umask change (which
    would race other threads). Side files left by an older store are tightened."""
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC, 0o600))
    except FileExistsError:
        pass
    for name in (path, f"{path}-wal", f"{path}-shm"):
        try:
            os.chmod(name, 0o600)
        except FileNotFoundError:
            pass


@contextmanager
def write_conn(engine: Engine, *, durable: bool = True) -> Iterator[Connection]:
    """A connection in a write transaction (BEGIN IMMEDIATE on SQLite), committed on exit.

    ``durable=False`` (SQLite): the commit is not fsynced, for rows that describe bytes
    which do not outlive a reboot themselves; it stays atomic and crash-safe.
    Notifications queued with ``notify_after_commit`` are sent once it has committed.
    """
    with engine.connect() as conn:
        conn = conn.execution_options(tensordb_write=True, tensordb_durable=durable)
        notes: list[tuple[str, str]] = []
        conn.info[_NOTES] = notes
        try:
            with conn.begin():
                yield conn
        finally:
            conn.info.pop(_NOTES, None)
        if notes:
            _send_notes(conn, notes)


_NOTES = "tensordb_notify_after_commit"
_PG_NOTIFY = ("SELECT set_config('synchronous_commit', 'off', true), "
              "pg_notify(%(channel)s, %(payload)s)")


def notify_after_commit(conn: Connection, channel: str, payload: str) -> None:
    """On PostgreSQL, NOTIFY ``channel`` once the transaction of ``conn`` (a
    ``write_conn``) has committed, and only if it does; elsewhere nothing.

    Not inside the transaction: PostgreSQL serialises the commits of all transactions
    that notify, across the whole server, under one lock held through each one's WAL
    flush, so writers into different collections could commit no faster together than
    one alone (about one fsync each). Sent after, in a transaction of its own that does
    not wait for a flush, the lock is held for microseconds. A notification lost with
    its sender between the two is a watcher's poll late (``client._notify``), nothing
    more."""
    if conn.dialect.name == "postgresql":
        conn.info[_NOTES].append((channel, payload))


def _send_notes(conn: Connection, notes: list[tuple[str, str]]) -> None:
    try:
        auto = conn.execution_options(isolation_level="AUTOCOMMIT")
        for channel, payload in notes:
            auto.exec_driver_sql(_PG_NOTIFY, {"channel": channel, "payload": payload})
    except SQLAlchemyError as exc:  # the commit stands; watchers poll
        _log.warning("commit notification not sent: %s", exc)


def current_revision(conn: Connection) -> str | None:
    if not inspect(conn).has_table("alembic_version"):
        if inspect(conn).has_table("collections"):
            raise IncompatibleStore("the catalog has tensordb tables but no schema revision")
        return None
    return conn.execute(text("SELECT version_num FROM alembic_version")).scalar()


def upgrade(engine: Engine, revision: str = "head") -> None:
    """Run the Alembic migrations up to ``revision`` on the SQL engine ``engine``."""
    # imported here, not at the top: Alembic costs ~110 ms to import, and only a store
    # that needs migrating pays it
    from alembic import command
    from alembic.config import Config as AlembicConfig

    cfg = AlembicConfig()
    cfg.set_main_option("script_location", str(Path(migrations.__file__).parent))
    with write_conn(engine) as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, revision)


@contextmanager
def _migration_lock(engine: Engine) -> Iterator[None]:
    if engine.dialect.name == "sqlite":
        path = engine.url.database
        if not path or path == ":memory:":
            yield
            return
        fd = os.open(f"{path}.migrate-lock", os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)
    elif engine.dialect.name == "postgresql":
        with engine.connect() as conn:
            conn.execute(text("SELECT pg_advisory_lock(:k)"), {"k": _PG_LOCK_KEY})
            conn.commit()
            try:
                yield
            finally:
                conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": _PG_LOCK_KEY})
                conn.commit()
    else:
        yield


def _check(rev: str | None) -> bool:
    if rev == HEAD_REVISION:
        return True
    if rev is not None and rev not in _KNOWN:
        raise IncompatibleStore(
            f"the catalog is at schema revision {rev!r}, newer than this tensordb knows "
            f"(up to {HEAD_REVISION!r}); upgrade tensordb to open it"
        )
    return False


def _create_fresh(engine: Engine) -> bool:
    """Create the catalog's tables from ``schema.metadata`` and stamp HEAD_REVISION (what
    ``alembic stamp head`` writes), in one transaction, if the database has no tables at
    all; False, and nothing done, if it has any.

    Nine migrations run one by one cost a new store 150-230 ms (Alembic's import, then
    each revision's operations) and left ~15,000 more long-lived objects for every
    later full cyclic collection to walk; this is a few milliseconds. Any failure rolls
    the whole transaction back: a catalog is never stamped with part of its schema.
    Callers hold the migration lock; on SQLite the transaction holds the write lock
    too, so the emptiness check cannot go stale."""
    with write_conn(engine) as conn:
        if inspect(conn).get_table_names():
            return False
        metadata.create_all(conn, checkfirst=False)
        _alembic_version.create(conn, checkfirst=False)
        conn.execute(_alembic_version.insert().values(version_num=HEAD_REVISION))
    return True


def ensure_schema(engine: Engine) -> None:
    """Bring the catalog to HEAD_REVISION, or refuse a newer one. Cheap when current.

    A database with no tables is created at HEAD_REVISION directly (``_create_fresh``);
    one with any table (an older store, or a database shared with other tables) goes
    through Alembic's migrations."""
    with engine.connect() as conn:
        if _check(current_revision(conn)):
            return
    with _migration_lock(engine):
        with engine.connect() as conn:
            if _check(current_revision(conn)):
                return
        if not _create_fresh(engine):
            upgrade(engine)
