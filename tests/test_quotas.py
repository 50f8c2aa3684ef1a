"""Byte quotas per tenant (a scope glob over collection names): what counts (the segments
a collection's commits stored: an extent several versions share once), a commit past a
quota refused with StoreFull naming it and the store unchanged, gc giving the room
back, group commits, two tenants' concurrent commits, bad settings, and the cost of the
check (one statement per commit where no quota covers the collection)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from conftest import wait_for
from sqlalchemy import event

import tensordb
from tensordb.errors import InvalidInput, NotFound, StoreFull

ONE = 64 * 64 * 4  # bytes of one tensor of these tests


def layers(values: dict[int, float]) -> dict[str, torch.Tensor]:
    return {f"layers.{i}.w": torch.full((64, 64), float(v)) for i, v in values.items()}


def state(db: tensordb.Database) -> tuple[Any, ...]:
    """What a refused commit must leave as it was."""
    st = db.stats()
    return ({c: [(x.version, x.nbytes) for x in db.history(c)] for c in db.collections()},
            st["segments"], st["host_bytes"], st["disk_bytes"],
            sorted(s for s in db.tier("host").segments()))


def used(db: tensordb.Database, scope: str) -> int:
    return next(q.used_bytes for q in db.quotas() if q.scope == scope)


def test_a_commit_past_its_tenants_quota_is_store_full_and_changes_nothing(
        db: tensordb.Database) -> None:
    db.set_quota("team-a/*", 5 * ONE)
    db.commit("team-a/m", layers({0: 0, 1: 1, 2: 2, 3: 3}))
    assert used(db, "team-a/*") == 4 * ONE
    before = state(db)
    with pytest.raises(StoreFull, match=r"quota 'team-a/\*' is") as info:
        db.commit("team-a/other", layers({0: 5, 1: 6}))
    assert info.value.collection == "team-a/other"
    assert state(db) == before
    assert db.catalog.info("team-a/other") is None
    # another tenant is not limited by it; the tenant's own small commit still fits
    db.commit("team-b/m", layers({0: 9, 1: 8, 2: 7, 3: 6, 4: 5, 5: 4}))
    db.commit("team-a/other", layers({0: 5}))
    assert used(db, "team-a/*") == 5 * ONE


def test_an_extent_shared_by_versions_counts_once_and_gc_gives_room_back(
        db: tensordb.Database) -> None:
    db.set_quota("m*", 6 * ONE)
    db.commit("m", layers({0: 0, 1: 1, 2: 2, 3: 3}))
    db.commit("m", layers({0: 10, 1: 1, 2: 2, 3: 3}))      # one tensor changed
    db.commit("m", layers({0: 20, 1: 1, 2: 2, 3: 3}))      # the same one again
    # three versions of 4 tensors each, 6 extents stored: the quota is full
    assert used(db, "m*") == 6 * ONE
    before = state(db)
    with pytest.raises(StoreFull):
        db.commit("m", layers({0: 20, 1: 1, 2: 12, 3: 3}))
    assert state(db) == before
    # dropping the old versions frees the segment no retained row points into (v2's);
    # v1's stays whole while the head still reads three of its four extents
    assert db.drop_versions("m", keep_last=1) == 2
    db.gc()
    assert used(db, "m*") == 5 * ONE
    db.commit("m", layers({0: 20, 1: 1, 2: 12, 3: 3}))
    assert used(db, "m*") == 6 * ONE
    with db.snapshot("m") as snap:
        assert float(snap["layers.2.w"][0, 0]) == 12.0


def test_nested_quotas_both_hold(db: tensordb.Database) -> None:
    db.set_quota("*", 4 * ONE)
    db.set_quota("team-a/*", 2 * ONE)
    db.commit("team-a/x", layers({0: 0, 1: 1}))
    with pytest.raises(StoreFull, match="team-a"):
        db.commit("team-a/y", layers({0: 5}))
    db.commit("team-b/x", layers({0: 2, 1: 3}))
    with pytest.raises(StoreFull, match=r"quota '\*'"):
        db.commit("team-b/y", layers({0: 4}))
    assert [(q.scope, q.max_bytes, q.used_bytes) for q in db.quotas()] == [
        ("*", 4 * ONE, 4 * ONE), ("team-a/*", 2 * ONE, 2 * ONE)]
    db.set_quota("*", 10 * ONE)  # raised: replaced, not added
    db.commit("team-b/y", layers({0: 4}))
    db.drop_quota("*")
    assert [q.scope for q in db.quotas()] == ["team-a/*"]


def test_a_group_commit_counts_its_parts(db: tensordb.Database) -> None:
    db.set_quota("g*", 3 * ONE)
    w = torch.arange(64 * 64 * 4, dtype=torch.float32).reshape(256, 64)  # 4 * ONE

    def rank(r: int, out: dict[int, Any], group: str) -> None:
        try:
            with db.transaction("g", group=group, rank=r, world_size=2) as tx:
                tx.put_shard("w", w.narrow(0, 128 * r, 128), global_shape=w.shape,
                             offsets=[128 * r, 0])
            out[r] = tx.result
        except Exception as exc:  # noqa: BLE001 - each rank's outcome is checked
            out[r] = exc
    before = state(db)
    out: dict[int, Any] = {}
    threads = [threading.Thread(target=rank, args=(r, out, "one")) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    # the rank that publishes gets the quota's StoreFull, the others the group's end
    assert sum(isinstance(v, StoreFull) for v in out.values()) == 1, out
    assert all("quota 'g*'" in str(v) for v in out.values()), out
    assert db.catalog.info("g") is None or db.catalog.info("g").head == 0
    assert state(db)[0] == before[0]
    db.set_quota("g*", 4 * ONE)
    out.clear()
    threads = [threading.Thread(target=rank, args=(r, out, "two")) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(isinstance(v, tensordb.Commit) for v in out.values()), out
    assert used(db, "g*") == 4 * ONE


def test_a_groups_parts_count_as_they_land_not_only_when_it_publishes(
        db: tensordb.Database) -> None:
    db.set_quota("g*", 4 * ONE)
    w = torch.arange(64 * 64 * 3, dtype=torch.float32).reshape(192, 64)  # 3 parts of ONE
    out: dict[int, Any] = {}

    def rank(r: int) -> None:
        try:
            with db.transaction("g", group="slow", rank=r, world_size=3) as tx:
                tx.put_shard("w", w.narrow(0, 64 * r, 64), global_shape=w.shape,
                             offsets=[64 * r, 0])
            out[r] = tx.result
        except Exception as exc:  # noqa: BLE001 - each rank's outcome is checked
            out[r] = exc

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    wait_for(lambda: used(db, "g*") == 2 * ONE, what="two parts counted while pending")
    before = state(db)[0]
    with pytest.raises(StoreFull, match=r"quota 'g\*'"):  # 2 pending + 3 > 4
        db.commit("g-other", layers({0: 1, 1: 2, 2: 3}))
    assert state(db)[0] == before
    last = threading.Thread(target=rank, args=(2,))
    last.start()
    for t in [*threads, last]:
        t.join(60)
    assert all(isinstance(v, tensordb.Commit) for v in out.values()), out
    assert used(db, "g*") == 3 * ONE  # counted once, as the group's now


def test_a_dropped_collections_bytes_go_to_no_one(db: tensordb.Database) -> None:
    from tensordb.catalog import NodeDirectory

    db.commit("team-a/x", layers({0: 1, 1: 2, 2: 3, 3: 4}))
    sid = db.query("SELECT segment FROM extents WHERE collection = 'team-a/x'"
                   ).column("segment")[0].as_py()
    db.drop("team-a/x")
    db.set_quota("team-b/*", 3 * ONE)
    # SQLite gives the next collection the dropped one's id: it is charged nothing
    db.commit("team-b/y", layers({0: 5}))
    assert used(db, "team-b/*") == ONE
    # and a scoped token for it is given nothing of the dropped collection's segment
    assert NodeDirectory(db.catalog.engine).segment_collections([sid]) == {sid: set()}


def test_two_tenants_committing_at_once_keep_their_quotas_and_lose_nothing(
        db: tensordb.Database) -> None:
    cap = 6 * ONE
    for team in ("team-a", "team-b"):
        db.set_quota(f"{team}/*", cap)
    done: dict[str, list[tuple[str, float]]] = {"team-a": [], "team-b": []}
    refused: dict[str, int] = {"team-a": 0, "team-b": 0}

    def writer(team: str, worker: int) -> None:
        for k in range(6):
            name, value = f"{team}/w{worker}", float(100 * worker + k)
            try:
                db.commit(name, {"t": torch.full((64, 64), value)})
            except StoreFull:
                refused[team] += 1
            else:
                done[team].append((name, value))

    threads = [threading.Thread(target=writer, args=(t, w))
               for t in ("team-a", "team-b") for w in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for team in ("team-a", "team-b"):
        # every commit stored one new extent: exactly the quota's worth landed
        assert len(done[team]) == 6 and refused[team] == 6
        assert used(db, f"{team}/*") == cap
        # nothing acknowledged is lost: every version of every commit reads back
        by_name: dict[str, list[float]] = {}
        for name, value in done[team]:
            by_name.setdefault(name, []).append(value)
        for name, values in by_name.items():
            hist = db.history(name)
            assert len(hist) == len(values)
            got = sorted(float(db.get(name, "t", version=c.version, verify=True)[0, 0])
                         for c in hist)
            assert got == sorted(values)
    assert db.verify() == []


@pytest.mark.parametrize("scope,max_bytes", [
    ("team-[ab]/*", 10), ("", 10), (" x", 10), ("x" * 256, 10), ("a/*", -1),
    ("a/*", True), ("a/*", 1.5), ("a/*", "10"),
])
def test_bad_quota_settings_are_refused_and_change_nothing(
        db: tensordb.Database, scope: str, max_bytes: Any) -> None:
    db.set_quota("kept/*", 1 << 20)
    with pytest.raises(InvalidInput):
        db.set_quota(scope, max_bytes)
    assert [(q.scope, q.max_bytes) for q in db.quotas()] == [("kept/*", 1 << 20)]
    with pytest.raises(NotFound):
        db.drop_quota("no-such/*")
    assert len(db.quotas()) == 1


def test_a_quota_that_covers_nothing_costs_a_commit_one_statement(
        sqlite_db: tensordb.Database) -> None:
    db = sqlite_db
    seen: list[str] = []

    @event.listens_for(db.catalog.engine, "before_cursor_execute")
    def count(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        seen.append(statement)

    def commit_cost(name: str, value: float) -> list[str]:
        seen.clear()
        db.commit(name, {"t": torch.full((8,), value)})
        return list(seen)

    commit_cost("m", 0.0)
    none = commit_cost("m", 1.0)
    for i in range(30):
        db.set_quota(f"other-{i}/*", 1 << 30)
    many = commit_cost("m", 2.0)
    assert sum("quotas" in q for q in none) == 1  # the one look, with no quota at all
    assert len(many) == len(none) and sum("quotas" in q for q in many) == 1
    db.set_quota("m*", 1 << 30)
    covered = commit_cost("m", 3.0)
    assert len(covered) == len(none) + 2  # the covering quota's sums: stored, pending
    event.remove(db.catalog.engine, "before_cursor_execute", count)


@pytest.fixture
def cli_home(tmp_path: Any) -> Iterator[Any]:
    yield tmp_path / "store"


def test_quota_cli_sets_lists_and_drops(cli_home: Any) -> None:
    from typer.testing import CliRunner

    from tensordb.cli import app

    runner = CliRunner()
    with tensordb.connect(home=cli_home) as db:
        db.commit("team-a/m", layers({0: 1}))
    r = runner.invoke(app, ["--home", str(cli_home), "quota", "set", "team-a/*", "1GiB"])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["--home", str(cli_home), "quota", "list"])
    assert r.exit_code == 0 and "team-a/*" in r.output and "1.0 GiB" in r.output
    assert "16.0 KiB" in r.output
    r = runner.invoke(app, ["--home", str(cli_home), "quota", "set", "team-a/*", "lots"])
    assert r.exit_code == 2 and "lots" in r.output
    r = runner.invoke(app, ["--home", str(cli_home), "quota", "drop", "team-a/*"])
    assert r.exit_code == 0, r.output
    with tensordb.connect(home=cli_home) as db:
        assert db.quotas() == []


@pytest.mark.postgres
def test_postgres_checks_one_tenants_commits_one_after_the_other(
        catalog_url: str | None, store_home: Any) -> None:
    """The quota row is locked from one commit's check to its end: a second commit of
    the tenant waits there (here: its lock times out) instead of summing the tenant's
    bytes beside it, and so cannot pass the quota together with the first."""
    if catalog_url is None:
        pytest.skip("PostgreSQL only: SQLite runs one writer at a time")
    from sqlalchemy import text
    from sqlalchemy.exc import OperationalError

    from tensordb.catalog import check_quotas

    db = tensordb.connect(catalog_url, home=store_home)
    try:
        db.set_quota("team-a/*", 1 << 20)
        db.set_quota("team-b/*", 1 << 20)
        engine = db.catalog.engine
        with engine.connect() as first, engine.connect() as second:
            first.begin()
            check_quotas(first, "team-a/x", 10)
            second.begin()
            second.execute(text("SET LOCAL lock_timeout = '300ms'"))
            check_quotas(second, "team-b/x", 10)  # another tenant: no wait
            with pytest.raises(OperationalError, match="lock"):
                check_quotas(second, "team-a/y", 10)
            second.rollback()
            first.rollback()
    finally:
        db.close()
