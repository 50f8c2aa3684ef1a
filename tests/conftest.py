"""Fixtures: stores parametrised over catalog backends (sqlite, postgres).

PostgreSQL tests use the server at $TENSORDB_TEST_PG (default
postgresql+psycopg://postgres@127.0.0.1:5432); each test gets a database of its own,
dropped afterwards. Where no server answers they skip, saying so; under CI ($CI set,
where the machine starts the server) they fail instead, so a missing server cannot pass
as a green run.
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

import tensordb

# The store's background scrub (one thread per store, hashing segments at 5 % of a core
# from 2 s after it opens) would race the tests that damage bytes on purpose or count
# the work a call does: the suite turns it off, for child processes too, and the tests
# of the scrub (test_integrity.py) turn it on where they use it.
os.environ["TENSORDB_SCRUB_CPU"] = "0"

PG_BASE = os.environ.get("TENSORDB_TEST_PG", "postgresql+psycopg://postgres@127.0.0.1:5432")
_pg_reason: str | None = None


def _pg_admin():  # type: ignore[no-untyped-def]
    return create_engine(f"{PG_BASE}/postgres", isolation_level="AUTOCOMMIT",
                         connect_args={"connect_timeout": 3})


def _pg_available() -> str | None:
    """None if PostgreSQL answers, else the reason to skip."""
    global _pg_reason
    if _pg_reason is None:
        try:
            eng = _pg_admin()
            with eng.connect() as c:
                c.execute(text("SELECT 1"))
            eng.dispose()
            _pg_reason = ""
        except Exception as exc:  # any failure to reach it means: skip
            _pg_reason = f"no PostgreSQL server answers at {PG_BASE}: {type(exc).__name__}"
    return _pg_reason or None


def require_pg() -> None:
    """Return if PostgreSQL answers; else skip, saying why (fail when $CI is set)."""
    reason = _pg_available()
    if reason is None:
        return
    if os.environ.get("CI"):
        pytest.fail(f"{reason}; $CI is set, and CI starts PostgreSQL, so the tests that "
                    f"need it fail instead of skipping", pytrace=False)
    pytest.skip(reason)


@pytest.fixture
def pg_url() -> Iterator[str]:
    require_pg()
    name = f"tensordb_test_{uuid.uuid4().hex[:12]}"
    eng = _pg_admin()
    with eng.connect() as c:
        c.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield f"{PG_BASE}/{name}"
    finally:
        with eng.connect() as c:
            c.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        eng.dispose()


def flip_byte(path: Path, offset: int) -> None:
    """Corrupt one byte of a file in place (every bit of it flipped)."""
    with open(path, "r+b") as fh:
        fh.seek(offset)
        b = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([b[0] ^ 0xFF]))


def wait_for(cond: Callable[[], object], timeout: float = 10.0, what: str = "") -> None:
    """Poll ``cond`` until it holds: a deadline for what a background thread does, not
    a timing assertion (the bound is many times what it needs)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or cond}")
        time.sleep(0.02)


def open_store(home: Path, url: str | None = None, **settings: object) -> tensordb.Database:
    return tensordb.connect(url, home=home, data_dir=home / "data", **settings)


def remove_store(db: tensordb.Database) -> None:
    db.close()
    shutil.rmtree(db.config.shm_dir, ignore_errors=True)


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def catalog_url(request: pytest.FixtureRequest, tmp_path: Path) -> str | None:
    if request.param == "sqlite":
        return None
    return request.getfixturevalue("pg_url")


@pytest.fixture
def home(tmp_path: Path) -> Iterator[Path]:
    """An empty embedded store's home; its shared-memory directory is removed after."""
    h = tmp_path / "store"
    try:
        yield h
    finally:
        shutil.rmtree(tensordb.Config.resolve(None, home=h).shm_dir, ignore_errors=True)


@pytest.fixture
def store_home(tmp_path: Path) -> Path:
    return tmp_path / "store"


@pytest.fixture
def db(catalog_url: str | None, store_home: Path) -> Iterator[tensordb.Database]:
    """A fresh store on each catalog backend."""
    database = open_store(store_home, catalog_url)
    try:
        yield database
    finally:
        remove_store(database)


@pytest.fixture
def sqlite_db(store_home: Path) -> Iterator[tensordb.Database]:
    database = open_store(store_home)
    try:
        yield database
    finally:
        remove_store(database)


def free_tcp_endpoint() -> str:
    """A loopback ``tcp://`` address whose port was free a moment ago."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def wait_until(pred: Callable[[], object], timeout: float = 20.0) -> bool:
    """Whether ``pred()`` became true within ``timeout`` seconds (polled every 20 ms)."""
    import time

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.02)
    return bool(pred())
