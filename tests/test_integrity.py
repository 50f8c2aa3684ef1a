"""The integrity model (docs/storage.md, "Integrity model"): a corrupt extent is never
served by a read begun after the store knows of it, on the disk tier (verified at the
first open per boot) and in shared memory (scrubbed by default); exports verify the
bytes as they copy them; a truncated segment is CorruptData; the store is otherwise
unchanged, and ``tensordb verify`` reports the damage."""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import flip_byte, open_store, remove_store, wait_for
from typer.testing import CliRunner

import storage_engine as se
import tensordb
from tensordb import cli
from tensordb.errors import CorruptData

A = torch.arange(4096, dtype=torch.float32)
B = torch.full((1024,), 7, dtype=torch.int64)


@pytest.fixture
def home(tmp_path: Path) -> Path:
    return tmp_path / "store"


@pytest.fixture
def host_db(home: Path) -> Iterator[tensordb.Database]:
    db = open_store(home)
    try:
        yield db
    finally:
        remove_store(db)


def _state(db: tensordb.Database) -> tuple[object, ...]:
    """What a corruption must leave unchanged: collections, history, heads' layout."""
    return (db.collections(), [(c.version, c.nbytes, c.tensors) for c in db.history("m")],
            sorted(db.snapshot("m").extents().items()))


def _flip(db: tensordb.Database, tier: str, name: str, delta: int = 5) -> Path:
    """Flip one byte of tensor ``name``'s extent in its segment file; returns the file."""
    with db.snapshot("m") as snap:
        sid, offset, _ = snap.extents()[name]
    assert sid is not None
    path = db.tier(tier).path(sid)  # type: ignore[attr-defined]
    flip_byte(path, offset + delta)
    return path


def _reads_refuse(db: tensordb.Database, name: str, tmp: Path) -> None:
    """Every read path refuses ``name`` with CorruptData naming it; the export leaves
    no file."""
    calls = {
        "get": lambda: db.get("m", name),
        "snapshot[...]": lambda: db.snapshot("m")[name],
        "state_dict": lambda: db.snapshot("m").state_dict()[name],
        "read_into": lambda: db.snapshot("m").read_into({name: torch.empty_like(A)}),
        "arrow": lambda: db.snapshot("m").arrow(name),
        "to_arrow": lambda: db.snapshot("m").to_arrow([name]),
    }
    for what, call in calls.items():
        with pytest.raises(CorruptData) as info:
            call()
        assert info.value.tensor == name, what
        assert info.value.collection == "m", what
    out = tmp / f"export-{name}"
    with pytest.raises(CorruptData) as info:
        db.export_safetensors("m", out)
    assert info.value.tensor == name
    assert not out.exists() or list(out.iterdir()) == []  # no file, no half file


def _cli_verify(home: Path, data: Path) -> tuple[int, str]:
    r = CliRunner().invoke(cli.app, ["--home", str(home), "--data-dir", str(data),
                                     "verify"])
    return r.exit_code, r.stdout


def test_disk_flip_is_refused_at_first_open_per_boot(home: Path, tmp_path: Path) -> None:
    db = open_store(home, default_tier="disk")
    try:
        db.commit("m", {"a": A, "b": B})
        before = _state(db)
        with db.snapshot("m") as snap:
            sid = snap.extents()["a"][0]
        marks = db.config.shm_dir / "integrity"
        assert (marks / f"{sid}.ok").exists()  # written this boot: hashed on the way in
        db.close()
        # a reboot clears the shared-memory area, marks included; the disk keeps the
        # segment, and a byte of it goes bad while the host is down
        shutil.rmtree(marks)
        db = open_store(home, default_tier="disk")
        _flip(db, "disk", "a")
        _reads_refuse(db, "a", tmp_path)
        assert torch.equal(db.get("m", "b"), B)  # the good extent is still served
        assert (marks / f"{sid}.corrupt").exists() and not (marks / f"{sid}.ok").exists()
        assert _state(db) == before
        assert [(p.collection, p.tensor) for p in db.verify()] == [("m", "a")]
        code, out = _cli_verify(home, home / "data")
        assert code == 1 and "1 problem(s)" in out and " a " in out
    finally:
        remove_store(db)


def test_disk_segment_verified_once_per_boot(home: Path) -> None:
    db = open_store(home, default_tier="disk")
    try:
        db.commit("m", {"a": A})
        sid = db.snapshot("m").extents()["a"][0]
        ok = db.config.shm_dir / "integrity" / f"{sid}.ok"
        db.close()
        ok.unlink()  # as after a reboot
        db = open_store(home, default_tier="disk")
        assert torch.equal(db.get("m", "a"), A)
        assert ok.exists()  # the first open hashed it and marked it verified
        stamp = ok.stat().st_mtime_ns
        assert torch.equal(db.get("m", "a"), A)
        assert ok.stat().st_mtime_ns == stamp  # the second open did not hash it again
    finally:
        remove_store(db)


def test_host_flip_is_refused_after_the_scrub(host_db: tensordb.Database,
                                              tmp_path: Path) -> None:
    db = host_db
    db.commit("m", {"a": A, "b": B})
    before = _state(db)
    held = db.get("m", "a")  # a view handed out before the damage
    early = db.snapshot("m")
    early.state_dict()  # mapped before the damage
    _flip(db, "host", "a", delta=0)
    assert held[0].item() != 0  # a holder of a view sees the flip: documented
    report = db.scrub()
    assert report.complete and report.segments == 1
    assert [(c.collection, c.tensor) for c in report.corrupt] == [("m", "a")]
    _reads_refuse(db, "a", tmp_path)
    with pytest.raises(CorruptData):  # a kernel read of part of the extent
        db.snapshot("m").slice("a", offsets=(8,), shape=(4,), out=torch.empty(4))
    with pytest.raises(CorruptData):  # a read begun after the mark, on an old mapping
        early["a"]
    assert torch.equal(early["b"], B) and torch.equal(db.get("m", "b"), B)
    assert _state(db) == before
    assert [(p.collection, p.tensor) for p in db.verify()] == [("m", "a")]
    code, out = _cli_verify(db.config.home, db.config.data_dir)
    assert code == 1 and "1 problem(s)" in out
    early.close()


def test_export_verifies_as_it_copies(host_db: tensordb.Database, tmp_path: Path) -> None:
    db = host_db
    db.commit("m", {"a": A, "b": B})
    good = tmp_path / "good"
    db.export_safetensors("m", good)
    _flip(db, "host", "b", delta=3)  # no scrub has run
    out = tmp_path / "out"
    with pytest.raises(CorruptData) as info:
        db.export_safetensors("m", out)
    assert info.value.tensor == "b"
    assert list(out.iterdir()) == []  # the damaged file was never put in place
    with pytest.raises(CorruptData):  # found while exporting: marked for every read
        db.get("m", "b")
    assert torch.equal(db.get("m", "a"), A)
    assert (good / "model.safetensors").exists()


def test_verify_true_marks_for_later_reads(host_db: tensordb.Database) -> None:
    db = host_db
    db.commit("m", {"a": A, "b": B})
    _flip(db, "host", "a")
    assert db.get("m", "a")[0].item() == 0  # unscrubbed: the flip is past element 0
    with pytest.raises(CorruptData):
        db.get("m", "a", verify=True)
    with pytest.raises(CorruptData):
        db.get("m", "a")  # a plain read refuses it now too


def test_truncated_host_segment_is_corrupt_data(host_db: tensordb.Database) -> None:
    db = host_db
    db.commit("m", {"a": A, "b": B})
    before = _state(db)
    with db.snapshot("m") as snap:
        sid, offset, _ = snap.extents()["b"]
    path = db.tier("host").path(sid)  # type: ignore[attr-defined]
    os.truncate(path, offset + 8)  # b's extent now ends past the file
    # Arrow first: a later read may be refused by a mark an earlier one left, before
    # its own check of the extent against the file runs
    with pytest.raises(CorruptData) as info:
        db.snapshot("m").arrow("b")
    assert info.value.tensor == "b"
    assert (f"its extent ends at byte {offset + B.nbytes} of segment {sid}, "
            f"which holds {offset + 8} (truncated)") in str(info.value)
    for call in (lambda: db.get("m", "b"), lambda: db.snapshot("m").state_dict()["b"],
                 lambda: db.snapshot("m").to_arrow(),
                 lambda: db.snapshot("m").read_into({"b": torch.empty_like(B)})):
        with pytest.raises(CorruptData) as info:
            call()
        assert info.value.tensor == "b"
    assert torch.equal(db.get("m", "a"), A)
    assert _state(db) == before
    assert [(p.tensor, p.reason) for p in db.verify()] == [("b", "truncated")]
    os.truncate(path, 0)  # nothing left
    for call in (lambda: db.get("m", "a"), lambda: db.snapshot("m").to_arrow(),
                 lambda: db.snapshot("m").read_into({"a": torch.empty_like(A)})):
        with pytest.raises(CorruptData) as info:
            call()
        assert info.value.tensor == "a"
    assert _state(db) == before


def test_sharded_tensor_shard_flip(host_db: tensordb.Database, tmp_path: Path) -> None:
    db = host_db
    w = torch.arange(64, dtype=torch.float32).reshape(8, 8)
    with db.transaction("m") as tx:
        tx.put_shard("w", w[:4], global_shape=(8, 8), offsets=(0, 0))
        tx.put_shard("w", w[4:], global_shape=(8, 8), offsets=(4, 0))
        tx.put("a", A)
    assert torch.equal(db.get("m", "w"), w)
    (sid,) = {s for s, _, _ in db.snapshot("m").extents().values() if s is not None}
    rows = [r for _, _, r in db.catalog.all_rows(sid) if "shard at [4, 0]" in r.name]
    flip_byte(db.tier("host").path(sid), rows[0].offset + 1)  # type: ignore[attr-defined]
    out = tmp_path / "out"
    with pytest.raises(CorruptData) as info:  # an export assembles it with shards checked
        db.export_safetensors("m", out)
    assert info.value.tensor in ("w", "w (shard at [4, 0])")  # names the shard
    db.scrub()
    with pytest.raises(CorruptData) as info:
        db.get("m", "w")
    assert info.value.tensor in ("w", "w (shard at [4, 0])")  # names the shard
    with db.snapshot("m") as snap:
        assert torch.equal(snap.slice("w", offsets=(0, 0), shape=(4, 8)), w[:4])
        got = torch.empty(4, 8)
        assert torch.equal(snap.slice("w", offsets=(0, 0), shape=(4, 8), out=got), w[:4])
        with pytest.raises(CorruptData):
            snap.slice("w", offsets=(4, 0), shape=(4, 8))
        with pytest.raises(CorruptData) as info:  # a kernel read of part of the shard
            snap.slice("w", offsets=(5, 0), shape=(2, 8), out=torch.empty(2, 8))
        assert info.value.tensor in ("w", "w (shard at [4, 0])")  # names the shard
    assert torch.equal(db.get("m", "a"), A)


def test_scrub_resumes_where_it_stopped(host_db: tensordb.Database) -> None:
    db = host_db
    db.commit("m", {"a": A})
    db.commit("n", {"b": B})
    first = db.scrub(max_bytes=1)
    assert not first.complete and first.segments == 1
    second = db.scrub(max_bytes=1)
    assert second.segments == 1
    assert first.nbytes + second.nbytes == A.numel() * 4 + B.numel() * 8  # both covered
    with pytest.raises(tensordb.errors.InvalidInput):
        db.scrub(max_bytes=-1)


def _refused(db: tensordb.Database, name: str) -> bool:
    try:
        db.get("m", name)
    except CorruptData:
        return True
    return False


def test_every_store_scrubs_in_the_background_by_default(home: Path,
                                                         monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    monkeypatch.delenv("TENSORDB_SCRUB_CPU", raising=False)  # what a new user gets
    db = tensordb.connect(home=home, data_dir=home / "data")  # embedded, no gc, no server
    try:
        assert (db.config.scrub_cpu, db.config.scrub_interval) == (0.05, 60.0)
        db.commit("m", {"a": A, "b": B})
        _flip(db, "host", "a")
        assert db.get("m", "a")[0].item() == 0  # not found yet (the flip is past [0])
        wait_for(lambda: _refused(db, "a"), 60, "the background scrub to find the flip")
        assert torch.equal(db.get("m", "b"), B)
        stats = db.stats()
        assert stats["scrub_pid"] == os.getpid() and stats["scrub_found"] == 1
        assert stats["scrub_segments"] >= 1 and stats["scrub_bytes"] >= A.nbytes
    finally:
        remove_store(db)


_HOLDER = """
import sys, time, tensordb
db = tensordb.connect(home=sys.argv[1], data_dir=sys.argv[1] + "/data", scrub_cpu=0.05,
                      scrub_interval=0.2)
print("open", flush=True)
time.sleep(600)
"""


def test_one_process_per_host_scrubs_and_another_takes_over(home: Path) -> None:
    import signal
    import subprocess
    import sys

    db = open_store(home, scrub_cpu=0.05, scrub_interval=0.2)
    db.commit("m", {"a": A})
    db.close()
    child = subprocess.Popen([sys.executable, "-c", _HOLDER, str(home)],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "open"
        watch = open_store(home, scrub_cpu=0.0)  # looks, never scrubs
        wait_for(lambda: watch.stats()["scrub_pid"] == child.pid, 60, "the child to scrub")
        watch.close()
        db = open_store(home, scrub_cpu=0.05, scrub_interval=0.2)
        names = [t.name for t in threading.enumerate()]
        assert "tensordb-scrub" in names  # it tries for the lock, and waits
        rounds = db.stats()["scrub_rounds"]
        wait_for(lambda: db.stats()["scrub_rounds"] > rounds + 2, 60, "the child to go on")
        assert db.stats()["scrub_pid"] == child.pid  # still the only scrubber
        child.send_signal(signal.SIGKILL)  # its lock goes with it
        child.wait()
        wait_for(lambda: db.stats()["scrub_pid"] == os.getpid(), 60,
                 "this process to take over")
    finally:
        child.kill()
        child.wait()
        if child.stdout is not None:
            child.stdout.close()
    remove_store(db)


def test_the_background_scrub_can_be_turned_off_and_refuses_bad_settings(home: Path
                                                                         ) -> None:
    before = {t.ident for t in threading.enumerate() if t.name == "tensordb-scrub"}
    for off in ({"scrub_cpu": 0.0}, {"scrub_interval": 0.0}):
        db = open_store(home, **off)
        now = {t.ident for t in threading.enumerate() if t.name == "tensordb-scrub"}
        assert now == before, off  # no scrub thread at all
        db.close()
    for bad in ({"scrub_cpu": 1.5}, {"scrub_cpu": -0.1}, {"scrub_interval": -1.0},
                {"scrub_rate": -5}, {"scrub_cpu": "fast"}, {"scrub_rate": 1.5}):
        with pytest.raises(tensordb.errors.InvalidInput) as info:
            open_store(home, **bad)
        assert next(iter(bad)) in str(info.value)


def test_a_tensor_made_before_a_mark_is_refused_after_it(host_db: tensordb.Database) -> None:
    db = host_db
    db.commit("m", {"a": A, "b": B})
    snap = db.snapshot("m")
    sd = snap.state_dict()
    held = sd["a"]  # made now, cached by the snapshot
    assert torch.equal(snap["a"], A)
    _flip(db, "host", "a")
    assert [c.tensor for c in db.scrub().corrupt] == ["a"]
    for call in (lambda: sd["a"], lambda: snap["a"], lambda: dict(sd.items()),
                 lambda: list(sd.values())):
        with pytest.raises(CorruptData) as info:
            call()
        assert info.value.tensor == "a"
    assert torch.equal(sd["b"], B) and torch.equal(snap["b"], B)
    assert held[1].item() != 1.0  # the view handed out before is the reader's own mapping
    snap.close()


def test_a_move_between_tiers_hashes_what_it_copies(host_db: tensordb.Database) -> None:
    db = host_db
    db.commit("m", {"a": A, "b": B})
    _flip(db, "host", "a")  # no scrub has seen it
    with se.counting() as work:
        report = db.evict("m", tier="host")
    assert report.segments == 1
    assert work["bytes_hashed"] == A.nbytes + B.nbytes  # each extent once, as copied
    with db.snapshot("m") as snap:
        sid = snap.extents()["a"][0]
    marks = db.config.shm_dir / "integrity"
    assert (marks / f"{sid}.corrupt").exists() and not (marks / f"{sid}.ok").exists()
    with pytest.raises(CorruptData) as info:
        db.get("m", "a")
    assert "moving tiers" in str(info.value)
    assert torch.equal(db.get("m", "b"), B)  # the good extent moved and is served
    assert [p.tensor for p in db.verify()] == ["a"]


def test_a_slice_into_a_buffer_refuses_what_its_own_first_open_finds(home: Path) -> None:
    db = open_store(home, default_tier="disk")
    try:
        db.commit("m", {"a": A, "b": B})
        db.close()
        shutil.rmtree(db.config.shm_dir / "integrity")  # a reboot
        db = open_store(home, default_tier="disk")
        _flip(db, "disk", "a", delta=4)  # element 1; the slice reads elements 100-107
        with pytest.raises(CorruptData) as info:
            db.snapshot("m").slice("a", offsets=(100,), shape=(8,), out=torch.empty(8))
        assert info.value.tensor == "a"
        got = torch.empty(8, dtype=torch.int64)
        assert torch.equal(db.snapshot("m").slice("b", offsets=(8,), shape=(8,), out=got),
                           B[8:16])
    finally:
        remove_store(db)


def test_commit_never_shares_a_marked_extent(host_db: tensordb.Database) -> None:
    db = host_db
    db.commit("m", {"a": A, "b": B})
    _flip(db, "host", "a")
    db.scrub()
    with pytest.raises(CorruptData):
        db.get("m", "a")
    db.commit("m", {"a": A, "b": B})  # the good values again
    assert torch.equal(db.get("m", "a"), A)  # fresh bytes, not the damaged extent
    v1, v2 = db.snapshot("m", version=1).extents(), db.snapshot("m").extents()
    assert v1["a"] != v2["a"] and v1["b"] == v2["b"]  # b still shared
    assert db.verify() and {p.first_version for p in db.verify()} == {1}


def test_a_mark_made_by_another_process_is_seen(host_db: tensordb.Database,
                                                home: Path) -> None:
    db = host_db
    db.commit("m", {"a": A, "b": B})
    assert torch.equal(db.get("m", "a"), A)  # this process has listed the marks (none)
    _flip(db, "host", "a")
    other = open_store(home)  # marks of its own, as another process has
    try:
        assert [c.tensor for c in other.scrub().corrupt] == ["a"]
    finally:
        other.close()
    with pytest.raises(CorruptData):
        db.get("m", "a")
    assert torch.equal(db.get("m", "b"), B)
