"""Several processes on one store: zero-copy readers, killed writers and readers,
many concurrent writers. Each child opens a store of its own."""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from conftest import open_store

import tensordb

# forkserver, not fork: a child forked from a process whose OpenMP pool has run (any
# torch op) can deadlock in its first parallel op; the server imports but never computes
CTX = mp.get_context("forkserver")
CTX.set_forkserver_preload(["torch", "tensordb", "conftest"])


def _kill(proc: mp.process.BaseProcess) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(10)


def test_second_process_reads_zero_copy(sqlite_db: tensordb.Database, store_home: Path) -> None:
    sd = {f"layer{i}": torch.full((1024,), float(i)) for i in range(50)}
    sqlite_db.commit("model", sd)
    code = textwrap.dedent(f"""
        import tensordb
        db = tensordb.connect(home={str(store_home)!r}, data_dir={str(store_home / 'data')!r})
        with db.snapshot("model") as snap:
            sd = snap.state_dict()
            assert all(float(sd[f"layer{{i}}"][0]) == i for i in range(50))
            spans = []
            with open("/proc/self/maps") as fh:
                for line in fh:
                    if {str(sqlite_db.config.shm_dir)!r} in line and line.rstrip().endswith(".seg"):
                        lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                        spans.append((lo, hi))
            inside = sum(any(lo <= t.data_ptr() < hi for lo, hi in spans) for t in sd.values())
            print("inside", inside, len(spans))
        db.close()
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    inside, nspans = out.stdout.split()[1:]
    assert inside == "50" and nspans == "1"  # one segment, one mapping, every tensor in it


def _writer_loop(home: str, ready: mp.connection.Connection, seed: int) -> None:
    rng = random.Random(seed)
    db = open_store(Path(home))
    ready.send("ready")
    while True:
        marker = rng.random()
        size = rng.choice([1 << 14, 1 << 17, 1 << 19])
        with db.transaction("k", message=repr(marker)) as tx:
            for name in ("a", "b", "c"):
                tx.put(name, torch.full((size,), marker, dtype=torch.float64))


def _check_versions(db: tensordb.Database) -> int:
    hist = db.history("k")
    assert [c.version for c in hist] == list(range(len(hist), 0, -1))
    for c in hist:
        with db.snapshot("k", version=c.version, verify=True) as snap:
            sd = snap.state_dict()
            assert sorted(sd) == ["a", "b", "c"]
            marker = float(c.message)  # type: ignore[arg-type]
            for t in sd.values():
                assert bool((t == marker).all())
    return len(hist)


def _registered_files(db: tensordb.Database) -> tuple[set[str], set[str]]:
    on_tier = {n for n in os.listdir(db.config.shm_dir) if n.endswith(".seg") or "spare" in n}
    registered = {f"{sid}.seg" for sid in db.tier("host").segments()
                  if db.catalog.segment_registered(sid)}
    return on_tier, registered


def _kill_writers(db: tensordb.Database, home: Path, kills: int) -> None:
    rng = random.Random(1234)
    # a version to check even when the host is so loaded that no killed writer commits
    db.commit("k", {n: torch.full((16,), 0.5, dtype=torch.float64) for n in ("a", "b", "c")},
              message=repr(0.5))
    for i in range(kills):
        parent, child = CTX.Pipe()
        proc = CTX.Process(target=_writer_loop, args=(str(home), child, i))
        proc.start()
        assert parent.recv() == "ready"
        time.sleep(rng.uniform(0, 0.04))
        _kill(proc)
    versions = _check_versions(db)
    assert versions > 0
    db.gc()
    on_tier, registered = _registered_files(db)
    assert on_tier == registered  # every orphan reclaimed, nothing registered lost
    assert db.verify() == []
    _check_versions(db)


def test_writer_killed_at_random_instants(sqlite_db: tensordb.Database, store_home: Path) -> None:
    _kill_writers(sqlite_db, store_home, 50)


@pytest.mark.slow
def test_writer_killed_at_random_instants_many(sqlite_db: tensordb.Database,
                                               store_home: Path) -> None:
    _kill_writers(sqlite_db, store_home, 300)


def _hold_snapshot(home: str, ready: mp.connection.Connection) -> None:
    db = open_store(Path(home))
    snap = db.snapshot("r", version=1)
    float(snap["w"].sum())
    ready.send("ready")
    time.sleep(600)


def test_killed_reader_lease_lapses(sqlite_db: tensordb.Database, store_home: Path) -> None:
    db = sqlite_db
    db.commit("r", {"w": torch.ones(1 << 16)})
    parent, child = CTX.Pipe()
    proc = CTX.Process(target=_hold_snapshot, args=(str(store_home), child))
    proc.start()
    assert parent.recv() == "ready"
    db.commit("r", {"w": torch.zeros(1 << 16)})
    db.set_retention("r", 1)
    report = db.gc()
    assert report.dropped_versions == 0 and report.segments_deleted == 0  # leased
    assert [c.version for c in db.history("r")] == [2, 1]
    _kill(proc)
    report = db.gc()
    assert report.expired_leases == 1 and report.dropped_versions == 1
    assert report.segments_deleted == 1 and report.bytes_freed >= (1 << 16) * 4
    assert [c.version for c in db.history("r")] == [2]


def _commit_many(home: str, url: str | None, writer: int, commits: int) -> None:
    db = open_store(Path(home), url)
    for j in range(commits):
        db.commit("multi", {f"w{writer}/t{j}": torch.full((64,), float(writer * 1000 + j))},
                  message=f"{writer}:{j}")
    db.close()


def _many_writers(db: tensordb.Database, home: Path, url: str | None, writers: int,
                  commits: int) -> None:
    procs = [CTX.Process(target=_commit_many, args=(str(home), url, w, commits))
             for w in range(writers)]
    [p.start() for p in procs]
    [p.join(600) for p in procs]
    assert [p.exitcode for p in procs] == [0] * writers
    total = writers * commits
    hist = db.history("multi")
    assert [c.version for c in hist] == list(range(total, 0, -1))
    assert sorted(c.message for c in hist) == sorted(  # type: ignore[type-var]
        f"{w}:{j}" for w in range(writers) for j in range(commits))
    with db.snapshot("multi", verify=True) as snap:
        sd = snap.state_dict()
    assert len(sd) == total
    for w in range(writers):
        for j in range(commits):
            assert float(sd[f"w{w}/t{j}"][0]) == w * 1000 + j


def test_eight_writers_hundred_commits_each(db: tensordb.Database, store_home: Path,
                                            catalog_url: str | None) -> None:
    _many_writers(db, store_home, catalog_url, 8, 100)


def _watch_versions(home: str, url: str | None, out: mp.queues.Queue, ready: mp.connection.Connection) -> None:
    db = open_store(Path(home), url)
    seen = []
    it = db.watch("w", after=0, timeout=10, poll=30.0)  # poll=30: only notifications wake it
    ready.send("ready")
    for c in it:
        with db.snapshot("w", version=c.version) as snap:
            values = {float(t[0]) for t in snap.state_dict().values()}
            seen.append((c.version, sorted(values) == [float(c.version)], len(snap)))
        if c.version == 30:
            break
    out.put(seen)
    db.close()


@pytest.mark.deadline
def test_watcher_sees_every_version_in_order_untorn(db: tensordb.Database, store_home: Path,
                                                    catalog_url: str | None) -> None:
    db.commit("w", {f"t{i}": torch.zeros(256) for i in range(8)})  # version 1... of zeros
    db.commit("w", {f"t{i}": torch.full((256,), 2.0) for i in range(8)})
    out = CTX.Queue()
    parent, child = CTX.Pipe()
    proc = CTX.Process(target=_watch_versions, args=(str(store_home), catalog_url, out, child))
    proc.start()
    assert parent.recv() == "ready"
    time.sleep(0.2)
    start = time.monotonic()
    for v in range(3, 31):
        db.commit("w", {f"t{i}": torch.full((256,), float(v)) for i in range(8)})
    seen = out.get(timeout=60)
    proc.join(30)
    assert [s[0] for s in seen] == list(range(1, 31))
    # version 1 holds zeros, not 1.0: every later version is whole and consistent
    assert all(ok for v, ok, n in seen if v > 2), seen
    assert all(n == 8 for _, _, n in seen)
    assert time.monotonic() - start < 20  # woken by notifications, not the 30 s poll



def test_a_new_catalog_opened_while_another_process_writes_it(tmp_path: Path) -> None:
    """The ranks of a job opening one new store at the same moment: one process's first
    connection holds the new catalog's lock (converting it to WAL, creating its schema)
    while another's switches it to WAL mode, which SQLite refuses at once ("database is
    locked", its busy handler does not wait for that). The switch now waits its turn."""
    import sqlite3
    import threading

    from tensordb.catalog import make_engine

    path = tmp_path / "catalog.db"
    other = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    other.execute("CREATE TABLE t (x)")
    other.execute("BEGIN IMMEDIATE")  # another process, in the middle of its first write
    other.execute("INSERT INTO t VALUES (1)")
    threading.Timer(0.3, lambda: other.execute("COMMIT")).start()
    engine = make_engine(f"sqlite:///{path}")
    with engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
    engine.dispose()
    other.close()
