"""The policy runner: EVERY / CRON / ON COMMIT policies, their run log, retries, sync,
leadership between runners, and a clean stop. Most tests inject a recording executor;
the last ones run real statements through the query language."""

from __future__ import annotations

import logging
import multiprocessing as mp
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pyarrow as pa
import pytest
import torch
from conftest import open_store, wait_for
from sqlalchemy import delete, insert, select, update

import query._policies
import tensordb
from query._policies import (
    JOB_TABLE,
    PolicyRunner,
    _fire,
    check_schedule,
    parse_interval,
)
from query._policy_log import bind_names, summary
from tensordb.catalog import write_conn
from tensordb.catalog.schema import policies
from tensordb.errors import InvalidInput, NotFound, QueryError

CTX = mp.get_context("forkserver")
CTX.set_forkserver_preload(["torch", "tensordb", "conftest"])

# -- helpers ----------------------------------------------------------------------------------

def add_policy(db: tensordb.Database, name: str, trigger: str, schedule: str,
               statement: str, *, enabled: bool = True) -> None:
    with write_conn(db.catalog.engine) as conn:
        conn.execute(insert(policies).values(
            name=name, trigger=trigger, schedule=schedule, statement=statement,
            enabled=enabled, created_at=datetime.now(timezone.utc)))


def drop_policy(db: tensordb.Database, name: str) -> None:
    with write_conn(db.catalog.engine) as conn:
        conn.execute(delete(policies).where(policies.c.name == name))


class Recorder:
    """A fake executor: records (statement, params, time); 'FAIL...' raises, 'FLAKY n'
    raises on its first n calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, object], float]] = []
        self._lock = threading.Lock()

    def __call__(self, db: tensordb.Database, statement: str,
                 params: dict[str, object] | None = None) -> str:
        assert isinstance(db, tensordb.Database)
        with self._lock:
            self.calls.append((statement, dict(params or {}), time.monotonic()))
            seen = sum(1 for s, _, _ in self.calls if s == statement)
        if statement.startswith("FAIL"):
            raise RuntimeError(f"boom: {statement}")
        if statement.startswith("FLAKY") and seen <= int(statement.split()[1]):
            raise RuntimeError("not yet")
        return f"did {statement}"

    def of(self, statement: str) -> list[tuple[dict[str, object], float]]:
        with self._lock:
            return [(p, t) for s, p, t in self.calls if s == statement]


@pytest.fixture
def runners() -> Iterator[list[PolicyRunner]]:
    """Runners made by a test; each is stopped at its end, whatever happened."""
    made: list[PolicyRunner] = []
    yield made
    for r in made:
        r.stop()


def make(runners: list[PolicyRunner], db: tensordb.Database, rec: Callable[..., object],
         **kw: object) -> PolicyRunner:
    kw = {"poll": 0.1, "watch_poll": 0.05, "retry_delay": 0.05, **kw}
    r = PolicyRunner(db, executor=rec, **kw)  # type: ignore[arg-type]
    runners.append(r)
    return r


def _commit_in_child(home: str, url: str | None, collection: str, values: list[float]) -> None:
    db = open_store(Path(home), url)
    for v in values:
        db.commit(collection, {"w": torch.full((4,), v)}, message=f"child {v}")
    db.close()


# -- schedules -------------------------------------------------------------------------------

@pytest.mark.parametrize("text, seconds", [
    ("10 minutes", 600), ("2 hours", 7200), ("1 day", 86400), ("30 seconds", 30),
    ("500 milliseconds", 0.5), ("1 minute", 60), ("1h 30m", 5400), ("1.5 hours", 5400),
    ("2 weeks", 14 * 86400), ("  5 sec  ", 5), ("1 hour, 15 minutes", 4500), ("250ms", 0.25),
])
def test_parse_interval(text: str, seconds: float) -> None:
    assert parse_interval(text) == timedelta(seconds=seconds)


@pytest.mark.parametrize("text", [
    "", "soon", "10", "10 fortnights", "0 seconds", "5 minutes and", "-5 minutes",
    "1e3 seconds", "200 years",
])
def test_parse_interval_rejects(text: str) -> None:
    with pytest.raises(QueryError) as info:
        parse_interval(text)
    assert info.value.expected  # says what an interval looks like
    assert repr(text) in str(info.value)


def test_check_schedule() -> None:
    check_schedule("every", "10 minutes")
    check_schedule("cron", "*/5 * * * *")
    check_schedule("cron", "0 3 * * mon-fri")
    check_schedule("cron", "@daily")
    check_schedule("commit", "llama")
    for trigger, schedule in [("every", "50 milliseconds"), ("every", "often"),
                              ("cron", "* * * *"), ("cron", "61 * * * *"),
                              ("cron", "0 0 * * 8"), ("cron", "0 0 * * fri-mon"),
                              ("commit", " "), ("hourly", "1 hour")]:
        with pytest.raises(QueryError):
            check_schedule(trigger, schedule)


def test_bind_names() -> None:
    assert bind_names("SNAPSHOT c AT VERSION :version AS TAG 'v:tag'") == {"version"}
    assert bind_names("SELECT x::int FROM t WHERE a = :collection AND b = ':x'") == {
        "collection"}
    assert bind_names("SELECT 'it''s :not' , \"q:uoted\" FROM t") == set()


def test_runner_checks_its_arguments(sqlite_db: tensordb.Database) -> None:
    for kw in ({"max_attempts": 0}, {"poll": 0}, {"retry_delay": -1}, {"watch_poll": "x"}):
        with pytest.raises(InvalidInput):
            PolicyRunner(sqlite_db, **kw)  # type: ignore[arg-type]
    with pytest.raises(InvalidInput, match="not started"):
        PolicyRunner(sqlite_db).sync()


# -- EVERY and CRON ---------------------------------------------------------------------------

def test_every_policy_fires_on_schedule_and_is_recorded(
        db: tensordb.Database, runners: list[PolicyRunner]) -> None:
    rec = Recorder()
    add_policy(db, "tick", "every", "200 milliseconds", "TICK :policy")
    runner = make(runners, db, rec).start()
    assert runner.is_leader
    wait_for(lambda: len(rec.of("TICK :policy")) >= 3, what="three runs of an EVERY policy")
    runner.stop()
    calls = rec.of("TICK :policy")
    assert all(p == {"policy": "tick"} for p, _ in calls)
    # fire times are start + k * interval: runs keep to it, late or not
    span = calls[-1][1] - calls[0][1]
    assert span >= 0.2 * (len(calls) - 1) - 0.15, [t for _, t in calls]
    runs = runner.runs("tick")
    assert len(runs) == len(calls)
    assert [r.id for r in runs] == sorted((r.id for r in runs), reverse=True)
    for r in runs:
        assert (r.policy, r.attempt, r.outcome) == ("tick", 1, "ok")
        assert r.detail == "'did TICK :policy'"
        assert r.finished_at is not None and r.started_at <= r.finished_at
        assert r.started_at.tzinfo is not None


def test_cron_policy_is_scheduled_at_its_next_fire_time(
        sqlite_db: tensordb.Database, runners: list[PolicyRunner]) -> None:
    add_policy(sqlite_db, "five", "cron", "*/5 * * * *", "FIVE")
    add_policy(sqlite_db, "sunday", "cron", "30 4 * * 0", "SUNDAY")  # crontab: 0 is Sunday
    add_policy(sqlite_db, "weekdays", "cron", "0 9 * * 1-5", "WEEKDAYS")
    add_policy(sqlite_db, "daily", "cron", "@daily", "DAILY")
    add_policy(sqlite_db, "broken", "cron", "99 * * * *", "BROKEN")
    before = datetime.now(timezone.utc)
    runner = make(runners, sqlite_db, Recorder()).start()

    five = runner.next_run_time("five")
    assert five is not None and five.utcoffset() == timedelta(0)
    assert five.minute % 5 == 0 and five.second == 0 and five.microsecond == 0
    assert before < five <= before + timedelta(minutes=5, seconds=1)

    sunday = runner.next_run_time("sunday")
    assert sunday is not None
    assert (sunday.weekday(), sunday.hour, sunday.minute) == (6, 4, 30)
    assert before < sunday <= before + timedelta(days=7)

    weekdays = runner.next_run_time("weekdays")
    assert weekdays is not None and weekdays.weekday() < 5 and weekdays.hour == 9

    daily = runner.next_run_time("daily")
    assert daily is not None and (daily.hour, daily.minute) == (0, 0)
    assert before < daily <= before + timedelta(days=1)

    assert runner.next_run_time("broken") is None
    bad = runner.runs("broken")
    assert len(bad) == 1 and bad[0].outcome == "error"
    assert bad[0].detail is not None and bad[0].detail.startswith("cannot schedule:")
    runner.sync()
    assert len(runner.runs("broken")) == 1  # reported once, not at every sync


def test_schedules_live_in_the_catalog_and_survive_a_restart(
        sqlite_db: tensordb.Database, runners: list[PolicyRunner]) -> None:
    add_policy(sqlite_db, "daily", "every", "1 day", "DAILY")
    first = make(runners, sqlite_db, Recorder()).start()
    when = first.next_run_time("daily")
    assert when is not None
    first.stop()
    with sqlite_db.catalog.engine.connect() as conn:
        ids = conn.execute(select(first_table_id()).select_from(job_table())).scalars().all()
    assert ids == ["policy:daily"]
    time.sleep(0.05)
    second = make(runners, sqlite_db, Recorder()).start()
    assert second.next_run_time("daily") == when  # kept its phase: not rescheduled
    with write_conn(sqlite_db.catalog.engine) as conn:
        conn.execute(update(policies).where(policies.c.name == "daily")
                     .values(schedule="2 days"))
    second.sync()
    moved = second.next_run_time("daily")
    assert moved is not None and moved > when + timedelta(hours=23)


def job_table():  # type: ignore[no-untyped-def]
    from sqlalchemy import table
    return table(JOB_TABLE)


def first_table_id():  # type: ignore[no-untyped-def]
    from sqlalchemy import column
    return column("id")


# -- ON COMMIT --------------------------------------------------------------------------------

def test_on_commit_policy_fires_once_per_commit_in_order(
        db: tensordb.Database, catalog_url: str | None, store_home: Path,
        runners: list[PolicyRunner]) -> None:
    db.commit("llama", {"w": torch.zeros(4)})  # v1: before the policy, never fires
    add_policy(db, "on_llama", "commit", "llama",
               "SNAPSHOT :collection AT VERSION :version")
    add_policy(db, "other", "commit", "other", "OTHER")
    rec = Recorder()
    runner = make(runners, db, rec).start()
    db.commit("llama", {"w": torch.ones(4)})  # v2
    db.commit("llama", {"w": torch.full((4,), 2.0)})  # v3
    proc = CTX.Process(target=_commit_in_child,
                       args=(str(store_home), catalog_url, "llama", [3.0, 4.0]))  # v4, v5
    proc.start()
    proc.join(60)
    assert proc.exitcode == 0
    stmt = "SNAPSHOT :collection AT VERSION :version"
    wait_for(lambda: len(rec.of(stmt)) >= 4, what="four commit runs")
    time.sleep(0.2)
    assert [p for p, _ in rec.of(stmt)] == [{"collection": "llama", "version": v}
                                            for v in (2, 3, 4, 5)]
    assert rec.of("OTHER") == []
    runs = runner.runs("on_llama")
    assert [r.detail for r in reversed(runs)] == [f"version {v}: 'did {stmt}'"
                                                 for v in (2, 3, 4, 5)]
    assert all(r.outcome == "ok" and r.attempt == 1 for r in runs)

    # commits made while no runner runs fire when one starts again; nothing fires twice
    runner.stop()
    db.commit("llama", {"w": torch.full((4,), 5.0)})  # v6
    db.commit("other", {"w": torch.zeros(1)})  # v1 of another collection
    rec2 = Recorder()
    make(runners, db, rec2).start()
    wait_for(lambda: rec2.of(stmt) and rec2.of("OTHER"), what="runs after a restart")
    time.sleep(0.2)
    assert [p["version"] for p, _ in rec2.of(stmt)] == [6]
    assert [p for p, _ in rec2.of("OTHER")] == [{}]


def test_on_commit_policy_sees_commits_of_a_second_database_in_a_thread(
        sqlite_db: tensordb.Database, store_home: Path, runners: list[PolicyRunner]) -> None:
    add_policy(sqlite_db, "p", "commit", "k", "RUN :version")
    rec = Recorder()
    make(runners, sqlite_db, rec).start()
    other = open_store(store_home)
    try:
        t = threading.Thread(target=lambda: [other.commit("k", {"x": torch.full((2,), float(i))})
                                             for i in range(5)])
        t.start()
        t.join()
    finally:
        other.close()
    wait_for(lambda: len(rec.of("RUN :version")) >= 5, what="five commit runs")
    assert [p["version"] for p, _ in rec.of("RUN :version")] == [1, 2, 3, 4, 5]


# -- failures ---------------------------------------------------------------------------------

def test_failing_policy_is_logged_retried_and_others_keep_running(
        sqlite_db: tensordb.Database, runners: list[PolicyRunner]) -> None:
    add_policy(sqlite_db, "bad", "every", "300 milliseconds", "FAIL always")
    add_policy(sqlite_db, "flaky", "every", "1 day", "FLAKY 2")
    add_policy(sqlite_db, "good", "every", "200 milliseconds", "GOOD")
    add_policy(sqlite_db, "bad_commit", "commit", "c", "FAIL :version")
    rec = Recorder()
    runner = make(runners, sqlite_db, rec, max_attempts=3, retry_delay=0.05).start()
    sqlite_db.commit("c", {"x": torch.zeros(1)})
    sqlite_db.commit("c", {"x": torch.ones(1)})
    wait_for(lambda: len([r for r in runner.runs("bad") if r.finished_at]) >= 3
             and len(rec.of("GOOD")) >= 4 and len(rec.of("FAIL :version")) >= 6,
             what="failing and healthy runs")
    bad = [r for r in reversed(runner.runs("bad")) if r.finished_at][:3]
    assert [r.attempt for r in bad] == [1, 2, 3]
    assert all(r.outcome == "error" and r.detail == "RuntimeError: boom: FAIL always"
               for r in bad)
    assert all(r.outcome == "ok" for r in runner.runs("good") if r.finished_at)
    # the commit policy tried each version max_attempts times, then moved on, in order
    wait_for(lambda: len([r for r in runner.runs("bad_commit") if r.finished_at]) >= 6)
    rows = [r for r in reversed(runner.runs("bad_commit"))][:6]
    assert [(r.attempt, r.detail.split(":")[0]) for r in rows] == [  # type: ignore[union-attr]
        (1, "version 1"), (2, "version 1"), (3, "version 1"),
        (1, "version 2"), (2, "version 2"), (3, "version 2")]
    assert [p["version"] for p, _ in rec.of("FAIL :version")][:6] == [1, 1, 1, 2, 2, 2]

    # a run that fails, then succeeds on a later attempt
    runner.scheduler.modify_job("policy:flaky",  # type: ignore[union-attr]
                                next_run_time=datetime.now(timezone.utc))
    wait_for(lambda: any(r.outcome == "ok" for r in runner.runs("flaky")), what="flaky ok")
    assert [(r.attempt, r.outcome) for r in reversed(runner.runs("flaky"))] == [
        (1, "error"), (2, "error"), (3, "ok")]
    assert runner.is_leader and runner.scheduler.running  # type: ignore[union-attr]


def test_run_now(sqlite_db: tensordb.Database, runners: list[PolicyRunner]) -> None:
    add_policy(sqlite_db, "ok", "cron", "0 0 1 1 *", "HELLO")
    add_policy(sqlite_db, "bad", "every", "1 day", "FAIL now")
    add_policy(sqlite_db, "c", "commit", "coll", "AT :version OF :collection")
    sqlite_db.commit("coll", {"x": torch.zeros(1)})
    sqlite_db.commit("coll", {"x": torch.ones(1)})
    rec = Recorder()
    runner = make(runners, sqlite_db, rec)  # works without start()
    assert runner.run_now("ok") == "did HELLO"
    with pytest.raises(RuntimeError, match="boom"):
        runner.run_now("bad")
    assert runner.run_now("c") == "did AT :version OF :collection"
    assert rec.of("AT :version OF :collection")[0][0] == {"version": 2, "collection": "coll"}
    with pytest.raises(NotFound):
        runner.run_now("missing")
    got = {r.policy: (r.attempt, r.outcome, r.detail) for r in runner.runs()}
    assert got == {"ok": (1, "ok", "run now: 'did HELLO'"),
                   "bad": (1, "error", "run now: RuntimeError: boom: FAIL now"),
                   "c": (1, "ok", "run now: 'did AT :version OF :collection'")}
    assert len(runner.runs(limit=2)) == 2


# -- sync, leadership, stop ------------------------------------------------------------------

def test_dropped_and_disabled_policies_stop_after_sync(
        sqlite_db: tensordb.Database, runners: list[PolicyRunner]) -> None:
    add_policy(sqlite_db, "a", "every", "200 milliseconds", "A")
    add_policy(sqlite_db, "b", "every", "200 milliseconds", "B")
    add_policy(sqlite_db, "c", "commit", "coll", "C :version")
    add_policy(sqlite_db, "off", "every", "200 milliseconds", "OFF", enabled=False)
    rec = Recorder()
    runner = make(runners, sqlite_db, rec, poll=60).start()  # only explicit syncs
    assert runner.next_run_time("off") is None
    sqlite_db.commit("coll", {"x": torch.zeros(1)})
    wait_for(lambda: rec.of("A") and rec.of("B") and rec.of("C :version"))
    drop_policy(sqlite_db, "a")
    drop_policy(sqlite_db, "c")
    with write_conn(sqlite_db.catalog.engine) as conn:
        conn.execute(update(policies).where(policies.c.name == "b").values(enabled=False))
    add_policy(sqlite_db, "d", "every", "200 milliseconds", "D")
    assert runner.sync() is True
    assert runner.next_run_time("a") is None and runner.next_run_time("b") is None
    assert runner.next_run_time("d") is not None
    n = {s: len(rec.of(s)) for s in ("A", "B", "C :version")}
    sqlite_db.commit("coll", {"x": torch.ones(1)})
    wait_for(lambda: len(rec.of("D")) >= 2)
    time.sleep(0.3)
    assert {s: len(rec.of(s)) for s in n} == n
    assert rec.of("OFF") == []
    jobs = sorted(j.id for j in runner.scheduler.get_jobs())  # type: ignore[union-attr]
    assert jobs == ["policy:d"]


def test_the_runner_syncs_on_its_own(sqlite_db: tensordb.Database,
                                     runners: list[PolicyRunner]) -> None:
    rec = Recorder()
    make(runners, sqlite_db, rec, poll=0.1).start()
    add_policy(sqlite_db, "late", "every", "200 milliseconds", "LATE")  # as another process would
    wait_for(lambda: rec.of("LATE"), what="a policy created after start to fire")
    drop_policy(sqlite_db, "late")
    time.sleep(0.3)
    n = len(rec.of("LATE"))
    time.sleep(0.5)
    assert len(rec.of("LATE")) == n


def test_one_leader_per_store_and_a_standby_takes_over(
        db: tensordb.Database, catalog_url: str | None, store_home: Path,
        runners: list[PolicyRunner]) -> None:
    add_policy(db, "tick", "every", "200 milliseconds", "TICK")
    other = open_store(store_home, catalog_url)
    try:
        rec_a, rec_b = Recorder(), Recorder()
        a = make(runners, db, rec_a).start()
        b = make(runners, other, rec_b).start()
        assert a.is_leader and not b.is_leader
        assert b.sync() is False and b.next_run_time("tick") is None
        wait_for(lambda: len(rec_a.of("TICK")) >= 2)
        assert rec_b.of("TICK") == []
        a.stop()
        wait_for(lambda: b.is_leader, what="the standby to lead")
        wait_for(lambda: len(rec_b.of("TICK")) >= 2, what="the new leader to run")
        b.stop()
    finally:
        other.close()


@pytest.mark.deadline
def test_stop_leaves_no_threads_and_is_idempotent(
        sqlite_db: tensordb.Database, runners: list[PolicyRunner]) -> None:
    add_policy(sqlite_db, "t", "every", "200 milliseconds", "T")
    add_policy(sqlite_db, "c", "commit", "coll", "C")
    add_policy(sqlite_db, "slow", "every", "1 day", "FAIL slow")
    sqlite_db.commit("coll", {"x": torch.zeros(1)})  # fires once the runner starts
    before = set(threading.enumerate())
    rec = Recorder()
    with make(runners, sqlite_db, rec, retry_delay=30, max_attempts=5) as runner:
        assert runner.running
        runner.scheduler.modify_job("policy:slow",  # type: ignore[union-attr]
                                    next_run_time=datetime.now(timezone.utc))
        wait_for(lambda: rec.of("T") and rec.of("C") and rec.of("FAIL slow"))
        assert set(threading.enumerate()) - before
        started = time.monotonic()
    assert time.monotonic() - started < 5  # a retry waiting 30 s does not hold up stop
    assert not runner.running and not runner.is_leader
    # none left behind (a thread of the store's that was ending at "before" may be gone)
    assert set(threading.enumerate()) <= before
    runner.stop()
    runner.stop()
    assert set(threading.enumerate()) <= before
    # and it can start again
    runner.start()
    assert runner.is_leader
    runner.stop()
    assert set(threading.enumerate()) <= before


def test_a_job_of_an_unknown_store_is_ignored(monkeypatch: pytest.MonkeyPatch,
                                             caplog: pytest.LogCaptureFixture) -> None:
    # a job left in a job store by another process (or a stopped runner) fires here: no
    # runner of its store, so nothing runs, nothing raises, and the log says why
    fired: list[tuple[str, str]] = []

    class Live:
        def __init__(self, store: str) -> None:
            self.store = store

        def _scheduled(self, policy: str) -> None:
            fired.append((self.store, policy))

    monkeypatch.setattr(query._policies, "_LIVE", {"a-store": Live("a-store")})
    with caplog.at_level(logging.INFO, logger="tensordb.policies"):
        assert _fire("no-such-store", "p", "every|1 day") is None
    assert fired == []
    assert [r.getMessage() for r in caplog.records] == [
        "policy 'p' fired with no runner for its store in this process"]
    _fire("a-store", "p", "every|1 day")  # the store's own runner does get its job
    assert fired == [("a-store", "p")]


# -- with the statement language ---------------------------------------------------------------

def _q(db: tensordb.Database, statement: str) -> object:
    # no guard: the statement language is part of the package, and an ImportError in it
    # must fail these tests, never skip them
    return db.query(statement)


def test_created_policies_run_real_statements(
        db: tensordb.Database, runners: list[PolicyRunner]) -> None:
    db.commit("llama", {"a": torch.zeros(2), "b": torch.ones(2)})
    _q(db, "CREATE POLICY count_llama EVERY '200 milliseconds' "
           "DO SELECT count(*) AS n FROM tensors WHERE collection = 'llama'")
    _q(db, "CREATE POLICY tag_llama ON COMMIT TO llama "
           "DO SNAPSHOT llama AT VERSION :version AS TAG 'latest'")
    runner = PolicyRunner(db, poll=0.1, watch_poll=0.05, retry_delay=0.05)
    runners.append(runner)
    runner.start()
    db.commit("llama", {"a": torch.full((2,), 2.0)})  # v2
    db.commit("llama", {"b": torch.full((2,), 3.0)})  # v3
    def finished(name: str) -> list:  # type: ignore[type-arg]
        return [r for r in runner.runs(name) if r.finished_at is not None]

    wait_for(lambda: len(finished("tag_llama")) >= 2 and finished("count_llama"),
             what="real policies to run")
    wait_for(lambda: db.tags("llama").get("latest") == 3, what="the tag to follow the head")
    assert all(r.outcome == "ok" for r in finished("tag_llama")), runner.runs("tag_llama")
    count = finished("count_llama")[0]
    assert (count.outcome, count.detail) == ("ok", "n=2")
    _q(db, "DROP POLICY count_llama")
    runner.sync()
    assert runner.next_run_time("count_llama") is None


def test_create_policy_rejects_a_bad_schedule(sqlite_db: tensordb.Database) -> None:
    with pytest.raises(QueryError):
        _q(sqlite_db, "CREATE POLICY p EVERY 'soon' DO SELECT name FROM collections")
    with pytest.raises(QueryError):
        _q(sqlite_db, "CREATE POLICY p CRON '* * *' DO SELECT name FROM collections")


def test_run_details_summarise_tables() -> None:
    assert summary(pa.table({"n": [2], "name": ["x"]})) == "n=2, name=x"
    assert summary(pa.table({"a": [1, 2, 3]})) == "3 rows"
    assert summary(None) == "done"
    assert len(summary("x" * 5000)) == 500
