"""The cluster directory at the catalog level: registration, beats and their lapse
sweep, replicas, and the commit notification sent after a commit; on SQLite and
PostgreSQL. (tests/test_transport.py runs the same through real node servers.)"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import psycopg
import pytest
from sqlalchemy import Engine, select, update

from tensordb.catalog import (
    Beat,
    Catalog,
    NewTensor,
    NodeDirectory,
    ensure_schema,
    make_engine,
    notify_after_commit,
    write_conn,
)
from tensordb.catalog.schema import nodes, segment_replicas
from tensordb.errors import NotFound
from transport import NodeRegistration


@pytest.fixture
def engine(catalog_url: str | None, tmp_path: Path) -> Iterator[Engine]:
    eng = make_engine(catalog_url or f"sqlite:///{tmp_path / 'catalog.db'}")
    ensure_schema(eng)
    try:
        yield eng
    finally:
        eng.dispose()


def _age(engine: Engine, name: str, seconds: float) -> None:
    """Set ``name``'s last heartbeat ``seconds`` into the past."""
    with write_conn(engine) as conn:
        conn.execute(update(nodes).where(nodes.c.name == name)
                     .values(heartbeat_at=datetime.now(timezone.utc) - timedelta(seconds=seconds)))


def _rows(engine: Engine) -> dict[str, tuple[Any, ...]]:
    with engine.connect() as conn:
        return {r[0]: tuple(r) for r in conn.execute(select(nodes))}


def _segment(engine: Engine, node: str = "writer") -> str:
    """A segment of ``node``'s, committed with one tensor in it."""
    cat = Catalog(engine, node)
    info = cat.info("c")
    sid = uuid.uuid4().hex
    cat.commit("c", info.head if info else 0,
               [NewTensor(f"t{sid[:6]}", "float32", (4,), 16, "0" * 16, sid, 0)],
               unchanged=[], deletes=[], segment=(sid, "host", 16), message=None)
    return sid


def test_register_is_an_upsert(engine: Engine) -> None:
    d = NodeDirectory(engine)
    d.register("a", "h:1", ["host"], 10)
    d.deregister("a")
    d.register("a", "h:2", ["disk", "host"], None)
    info = d.node("a")
    assert (info.address, info.tiers, info.capacity, info.state) == (
        "h:2", ("disk", "host"), None, "up")
    assert list(_rows(engine)) == ["a"]


def test_beat_renews_and_brings_back_up(engine: Engine) -> None:
    d = NodeDirectory(engine, lapse=5)
    d.register("a", "h:1", ["host"], None)
    d.deregister("a")
    _age(engine, "a", 60)
    got = d.beat("a", sweep=False)
    assert got == Beat(known=True, lapsed=[], up=None)
    info = d.node("a")
    assert info.state == "up" and info.live(5)


def test_beat_of_an_unknown_node_writes_nothing(engine: Engine) -> None:
    d = NodeDirectory(engine)
    d.register("a", "h:1", ["host"], None)
    before = _rows(engine)
    for sweep in (False, True):
        got = d.beat("ghost", sweep=sweep)
        assert not got.known and got.lapsed == []
    assert d.heartbeat("ghost") is False
    assert _rows(engine) == before


def test_beat_sweep_marks_lapsed_others_down_and_counts_the_up(engine: Engine) -> None:
    d = NodeDirectory(engine, lapse=5)
    for n in ("a", "b", "c", "d"):
        d.register(n, f"{n}:1", ["host"], None)
    _age(engine, "a", 60)  # the beating node itself, lapsed: its beat renews it
    _age(engine, "b", 60)
    _age(engine, "c", 60)
    d.deregister("d")
    _age(engine, "d", 60)  # down already: not marked again
    assert d.beat("a", sweep=False).lapsed == []  # no sweep: b and c stay up
    assert {n for n, i in d.nodes().items() if i.state == "up"} == {"a", "b", "c"}
    got = d.beat("a")
    assert got == Beat(known=True, lapsed=["b", "c"], up=1)
    assert {n: i.state for n, i in d.nodes().items()} == {
        "a": "up", "b": "down", "c": "down", "d": "down"}
    assert d.beat("b") == Beat(known=True, lapsed=[], up=2)  # b is back


def test_mark_lapsed_and_heartbeat(engine: Engine) -> None:
    d = NodeDirectory(engine, lapse=5)
    for n in ("b", "a", "c"):
        d.register(n, f"{n}:1", ["host"], None)
    _age(engine, "b", 60)
    _age(engine, "a", 60)
    assert d.mark_lapsed() == ["a", "b"]
    assert d.mark_lapsed() == []
    assert d.heartbeat("a") is True
    assert d.node("a").state == "up" and d.node("b").state == "down"


class _Counting(NodeDirectory):
    """A directory that records which beats swept."""

    def __init__(self, engine: Engine) -> None:
        super().__init__(engine)
        self.sweeps: list[bool] = []

    def beat(self, name: str, *, sweep: bool = True) -> Beat:
        self.sweeps.append(sweep)
        return super().beat(name, sweep=sweep)


def test_registration_sweeps_on_some_beats_only(engine: Engine) -> None:
    d = _Counting(engine)
    for i in range(9):
        d.register(f"n{i}", f"n{i}:1", ["host"], None)
    reg = NodeRegistration(d, "n0", "n0:1", ["host"], None)
    for _ in range(40):
        reg.beat()
    swept = [i for i, s in enumerate(d.sweeps) if s]
    # 9 up: one sweep every ceil(9 / 2) = 5 beats, the first at once, the second at a
    # random one of the next 5 (a phase of its own), then every 5th
    assert swept[0] == 0 and 1 <= swept[1] <= 5
    assert all(b - a == 5 for a, b in zip(swept[1:], swept[2:], strict=False)), swept
    assert len(swept) >= 8


def test_registration_registers_again_when_its_row_is_gone(engine: Engine) -> None:
    d = NodeDirectory(engine)
    reg = NodeRegistration(d, "a", "a:1", ["host"], 7)
    reg.beat()  # no row: the beat finds none and registers
    assert d.node("a").address == "a:1" and d.node("a").capacity == 7
    with write_conn(engine) as conn:
        conn.execute(nodes.delete())
    reg.beat()
    assert d.node("a").address == "a:1" and d.node("a").state == "up"


def test_add_replica(engine: Engine) -> None:
    d = NodeDirectory(engine)
    sid = _segment(engine)
    assert d.add_replica(sid, "b", "host") is True
    assert d.add_replica(sid, "b", "disk") is True  # idempotent: the tier moves
    assert d.replicas() == [(sid, "b", "disk")]
    assert d.add_replica(sid, "writer", "host") is True  # the writer's own: no replica
    assert d.holders(sid) == {"writer": "host", "b": "disk"}
    assert d.add_replica("0" * 32, "b", "host") is False  # no such segment
    assert d.replicas() == [(sid, "b", "disk")]
    with engine.connect() as conn:
        assert conn.execute(select(segment_replicas.c.node)).scalars().all() == ["b"]


@pytest.mark.postgres
def test_commit_notifies_after_it_commits_and_only_then(pg_url: str) -> None:
    engine = make_engine(pg_url)
    ensure_schema(engine)
    cat = Catalog(engine, "w")
    dsn = pg_url.replace("postgresql+psycopg://", "postgresql://")
    try:
        with psycopg.connect(dsn, autocommit=True) as listener:
            listener.execute("LISTEN tensordb_commit")
            sid = uuid.uuid4().hex
            cat.commit("c", 0, [NewTensor("t", "float32", (4,), 16, "0" * 16, sid, 0)],
                       unchanged=[], deletes=[], segment=(sid, "host", 16), message=None)
            got = [n.payload for n in listener.notifies(timeout=5, stop_after=1)]
            assert got == ["c\n1"]
            with pytest.raises(NotFound):  # rolled back: nothing is sent
                cat.commit("c", 1, [], unchanged=[], deletes=["nope"], segment=None,
                           message=None)
            with pytest.raises(RuntimeError), write_conn(engine) as conn:
                notify_after_commit(conn, "tensordb_commit", "x\n9")
                raise RuntimeError("rolled back")
            assert [n.payload for n in listener.notifies(timeout=0.5)] == []
            assert cat.require("c").head == 1
    finally:
        engine.dispose()


def test_notify_after_commit_is_nothing_on_sqlite(tmp_path: Path) -> None:
    engine = make_engine(f"sqlite:///{tmp_path / 'c.db'}")
    ensure_schema(engine)
    try:
        with write_conn(engine) as conn:
            notify_after_commit(conn, "tensordb_commit", "c\n1")
            conn.execute(nodes.insert().values(name="a", state="up"))
        assert list(_rows(engine)) == ["a"]
    finally:
        engine.dispose()
