"""A lost catalog connection costs a retry, never a lost or duplicated commit."""

from __future__ import annotations

import random
import threading
import time
from typing import Any

import psycopg
import pytest
import torch
from conftest import remove_store
from sqlalchemy.exc import IntegrityError, OperationalError

import tensordb
from tensordb.catalog._retry import is_transient
from tensordb.catalog._versions import Versions
from tensordb.errors import NodeUnavailable


def _lost(msg: str = "server closed the connection unexpectedly") -> OperationalError:
    return OperationalError("COMMIT", {}, Exception(msg), connection_invalidated=True)


def _versions(db: tensordb.Database, name: str) -> list[tuple[int, str | None]]:
    return [(c.version, c.message) for c in reversed(db.history(name))]


def test_transient_errors_are_told_apart() -> None:
    assert is_transient(_lost())
    admin = psycopg.errors.AdminShutdown("terminating connection due to administrator command")
    assert is_transient(OperationalError("SELECT 1", {}, admin))
    dup = psycopg.errors.UniqueViolation("duplicate key value")
    assert not is_transient(IntegrityError("INSERT", {}, dup))
    assert not is_transient(ValueError("not a database error"))


def test_commit_whose_answer_was_lost_lands_once(db: tensordb.Database,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    real = Versions._commit
    calls = []

    def commit_then_lose_the_answer(self: Versions, *args: Any) -> Any:
        calls.append(args[0])
        result = real(self, *args)
        if len(calls) == 1:  # the COMMIT landed; the client never heard back
            raise _lost()
        return result

    monkeypatch.setattr(Versions, "_commit", commit_then_lose_the_answer)
    c = db.commit("m", {"w": torch.full((4,), 1.0)}, message="step 1")
    assert c.version == 1 and len(calls) == 1  # the retry found it: no second attempt
    c2 = db.commit("m", {"w": torch.full((4,), 2.0)}, message="step 2")
    assert c2.version == 2
    assert _versions(db, "m") == [(1, "step 1"), (2, "step 2")]
    assert db.get("m", "w", version=1).tolist() == [1.0] * 4
    assert db.get("m", "w").tolist() == [2.0] * 4


def test_commit_lost_before_it_landed_is_made_again(db: tensordb.Database,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    real = Versions._commit
    calls = []

    def lose_first(self: Versions, *args: Any) -> Any:
        calls.append(args[0])
        if len(calls) == 1:  # the connection died before COMMIT: rolled back
            raise _lost()
        return real(self, *args)

    monkeypatch.setattr(Versions, "_commit", lose_first)
    c = db.commit("m", {"w": torch.arange(3.0)}, message="only")
    assert c.version == 1 and len(calls) == 2
    assert _versions(db, "m") == [(1, "only")]
    assert db.get("m", "w").tolist() == [0.0, 1.0, 2.0]


@pytest.mark.deadline
def test_catalog_gone_for_good_is_node_unavailable(db: tensordb.Database,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    db.commit("m", {"w": torch.zeros(2)})
    before = db.stats()

    def always_lost(self: Versions, *args: Any) -> Any:
        raise _lost("connection refused")

    monkeypatch.setattr(Versions, "_commit", always_lost)
    db.catalog.retry_seconds = 0.3
    t0 = time.monotonic()
    with pytest.raises(NodeUnavailable, match="catalog did not answer") as err:
        db.commit("m", {"w": torch.ones(2)})
    assert time.monotonic() - t0 < 5
    assert err.value.node == "catalog"
    monkeypatch.undo()
    assert _versions(db, "m") == [(1, None)]
    assert db.get("m", "w").tolist() == [0.0, 0.0]
    db.gc()  # the aborted commit's bytes are not kept
    assert db.stats()["segments"] == before["segments"]


def test_other_errors_are_not_retried(db: tensordb.Database,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def integrity(self: Versions, *args: Any) -> Any:
        calls.append(1)
        raise IntegrityError("INSERT", {}, Exception("duplicate key"))

    monkeypatch.setattr(Versions, "_commit", integrity)
    with pytest.raises(IntegrityError):
        db.commit("m", {"w": torch.zeros(2)})
    assert calls == [1]


@pytest.mark.postgres
def test_terminated_backends_lose_and_duplicate_nothing(pg_url: str, tmp_path: Any,
                                                        caplog: pytest.LogCaptureFixture
                                                        ) -> None:
    """A writer commits in a loop while another connection, every 0.1 to 0.3 s,
    terminates the backends that are in the middle of a statement or a transaction
    (pg_terminate_backend). The loop runs until at least 40 commits and 3 kills."""
    db = tensordb.connect(pg_url, home=tmp_path / "s", data_dir=tmp_path / "s" / "data")
    stop = threading.Event()
    killed = [0]
    rng = random.Random(7)
    dsn = pg_url.replace("postgresql+psycopg://", "postgresql://")

    def killer() -> None:
        with psycopg.connect(dsn, autocommit=True) as conn:
            while not stop.is_set():
                rows = conn.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE datname = current_database() AND pid <> pg_backend_pid() "
                    "AND state IN ('active', 'idle in transaction')").fetchall()
                killed[0] += sum(1 for (ok,) in rows if ok)
                time.sleep(rng.uniform(0.1, 0.3))

    n = 40
    caplog.set_level("WARNING", logger="tensordb.catalog")
    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    try:
        results = []
        while len(results) < n or (killed[0] < 3 and len(results) < 10 * n):
            i = len(results)
            results.append(db.commit("loop", {"w": torch.full((8,), float(i))},
                                     message=f"step {i}"))
        n = len(results)
    finally:
        stop.set()
        thread.join(10)
    try:
        retries = [r for r in caplog.records if "catalog connection lost" in r.getMessage()]
        assert killed[0] > 0 and retries, "no statement was cut: the test proved nothing"
        assert [r.version for r in results] == list(range(1, n + 1))
        assert _versions(db, "loop") == [(i + 1, f"step {i}") for i in range(n)]
        for i in (0, n // 2, n - 1):
            assert db.get("loop", "w", version=i + 1).tolist() == [float(i)] * 8
    finally:
        remove_store(db)


@pytest.mark.postgres
def test_watch_survives_a_dropped_listen_connection(pg_url: str, tmp_path: Any) -> None:
    db = tensordb.connect(pg_url, home=tmp_path / "s", data_dir=tmp_path / "s" / "data")
    dsn = pg_url.replace("postgresql+psycopg://", "postgresql://")
    try:
        db.commit("w", {"x": torch.zeros(2)})
        seen: list[Any] = []
        # poll longer than the test: only a notification (or the reconnect) wakes it
        it = db.watch("w", after=1, timeout=30, poll=60)
        reader = threading.Thread(target=lambda: seen.append(next(it)), daemon=True)
        reader.start()
        with psycopg.connect(dsn, autocommit=True) as admin:
            for _ in range(500):  # the watcher's LISTEN connection, once it is up
                pids = [p for (p,) in admin.execute(
                    "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
                    "AND query LIKE 'LISTEN%'").fetchall()]
                if pids:
                    break
                time.sleep(0.01)
            assert pids, "the watcher never listened"
            admin.execute("SELECT pg_terminate_backend(%s)", (pids[0],))
        db.commit("w", {"x": torch.ones(2)})
        reader.join(20)
        assert [c.version for c in seen] == [2]
        it.close()
    finally:
        remove_store(db)


@pytest.mark.parametrize("world", [1, 2])
def test_group_part_whose_answer_was_lost_lands_once(db: tensordb.Database,
                                                     monkeypatch: pytest.MonkeyPatch,
                                                     world: int) -> None:
    """A rank's part committed but its answer lost: the retry finds it (ready, with its
    segment) instead of registering the segment twice; where that part was the last,
    the version it published comes back."""
    from tensordb.catalog._groups import Groups

    real = Groups._commit_part
    calls: list[int] = []

    def commit_then_lose_the_answer(self: Groups, *args: Any) -> Any:
        calls.append(args[2])
        result = real(self, *args)
        if len(calls) == 1:  # the COMMIT landed; the client never heard back
            raise _lost()
        return result

    monkeypatch.setattr(Groups, "_commit_part", commit_then_lose_the_answer)
    w = torch.arange(8.0)
    done: dict[int, Any] = {}

    def rank(r: int) -> None:
        step = 8 // world
        with db.transaction("m", group="g", rank=r, world_size=world) as tx:
            tx.put_shard("w", w[r * step:(r + 1) * step], global_shape=(8,),
                         offsets=(r * step,))
        done[r] = tx.result

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(calls) == world  # no part ran twice
    assert {c.version for c in done.values()} == {1} and len(done) == world
    assert _versions(db, "m") == [(1, None)]
    assert torch.equal(db.get("m", "w"), w)
    assert db.stats()["segments"] == world
