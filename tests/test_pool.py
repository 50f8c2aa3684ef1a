"""The host tier's pool of freed segment files: bounded, given back, never recycling a
file a reader maps, shared by processes, and what a steady trainer's commits reuse."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import open_store, remove_store

import storage_engine as se
import tensordb
from storage_engine import _pool
from tensordb.errors import InvalidInput

MiB = 1 << 20


def write(tier: se.Tier, sid: str, nbytes: int, value: int) -> None:
    w = tier.create(sid, nbytes)
    w.buffer[:] = value
    w.finish()
    w.release()


def pool_files(tier: se.FileTier) -> list[str]:
    d = tier.root / "pool"
    return sorted(n for n in os.listdir(d) if not n.startswith(".")) if d.exists() else []


@pytest.fixture
def tier(tmp_path: Path):  # type: ignore[no-untyped-def]
    t = se.HostTier(tmp_path / "host", pool_limit=3 * MiB)
    yield t
    t.close()


def test_the_pool_stays_within_its_bound_and_gives_back(tier: se.HostTier) -> None:
    for i in range(5):
        write(tier, f"s{i}", MiB, i)
    for i in range(5):
        assert tier.delete(f"s{i}") is True
    assert tier.pooled_bytes() == 3 * MiB and len(pool_files(tier)) == 3
    assert list(tier.segments()) == []  # the other two were unlinked
    assert tier.pool_counters()["pooled"] == 3
    tier.pool_limit = MiB  # a lower bound trims at once, oldest first
    assert tier.pooled_bytes() == MiB
    assert tier.trim_pool(0) == MiB
    assert tier.pooled_bytes() == 0 and pool_files(tier) == []
    assert tier.pool_counters()["released_bytes"] == 3 * MiB


def test_memory_pressure_gives_the_pool_back(tier: se.HostTier,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    write(tier, "a", MiB, 1)
    write(tier, "b", MiB, 2)
    tier.delete("a")
    assert tier.pooled_bytes() == MiB
    monkeypatch.setattr(_pool, "under_pressure", lambda: True)
    assert tier.delete("b") is True  # not pooled, and what was pooled is given back
    assert tier.pooled_bytes() == 0 and list(tier.segments()) == []
    monkeypatch.setattr(_pool, "under_pressure", lambda: False)
    write(tier, "c", MiB, 3)
    tier.delete("c")
    assert tier.pooled_bytes() == MiB
    monkeypatch.setattr(_pool, "under_pressure", lambda: True)
    assert tier.trim_pool() == MiB  # a trim to the bound gives everything back


def test_a_mapped_file_is_never_recycled(tier: se.HostTier) -> None:
    # the write that would reuse a recycled file comes right after the delete: if the
    # reader's file went to the pool, its private mapping would show the new bytes (a
    # private mapping of a shared file sees the file's later writes on pages it has not
    # written itself)
    write(tier, "old", MiB, 0x11)
    view = tier.open("old")
    arr = view.host_bytes()
    assert tier.delete("old") is True
    assert tier.pooled_bytes() == 0  # a reader maps it: unlinked, not pooled
    for i in range(4):
        write(tier, f"new{i}", MiB, 0x22)
    assert tier.pool_counters()["claimed"] == 0
    assert int(arr.min()) == int(arr.max()) == 0x11
    del arr, view
    # once the reader let go, a delete pools the file
    write(tier, "later", MiB, 0x33)
    assert tier.delete("later") and tier.pooled_bytes() == MiB


def test_a_view_of_a_view_keeps_the_lock(tier: se.HostTier) -> None:
    # a numpy view (a torch tensor, an Arrow buffer) holds the mapping, and with it the
    # lock, after the view object itself is gone
    write(tier, "x", MiB, 0x44)
    keep = np.frombuffer(tier.open("x"), np.uint8)
    tier.delete("x")
    write(tier, "y", MiB, 0x55)
    assert tier.pool_counters()["claimed"] == 0 and int(keep[12345]) == 0x44


def test_a_segment_moved_to_the_pool_is_missing_to_readers(tier: se.HostTier) -> None:
    write(tier, "gone", MiB, 1)
    tier.delete("gone")
    assert tier.pooled_bytes() == MiB
    with pytest.raises(se.SegmentMissing):
        tier.open("gone")
    with pytest.raises(se.SegmentMissing):
        tier.read_into("gone", [(0, np.zeros(8, np.uint8))])
    with pytest.raises(se.SegmentMissing):
        tier.peek("gone", [(0, 8)])


def test_a_reader_racing_a_recycle_gets_the_segment_or_missing(
        tier: se.HostTier, monkeypatch: pytest.MonkeyPatch) -> None:
    # the reader opens the file, then (before its lock) the file goes to the pool and
    # comes back as another segment: the reader must not map it as the old one
    from storage_engine import _files

    write(tier, "seg", MiB, 1)
    real_flock = _files.fcntl.flock
    moved = []

    def flock(fd: int, op: int) -> None:
        if not moved:
            moved.append(1)
            tier.delete("seg")  # nobody holds a lock yet: pooled
            write(tier, "other", MiB, 2)  # and claimed back under another name
        real_flock(fd, op)

    monkeypatch.setattr(_files.fcntl, "flock", flock)
    with pytest.raises(se.SegmentMissing):
        tier.open("seg")
    assert tier.pool_counters()["claimed"] == 1
    assert bytes(tier.open("other").host_bytes(0, 2)) == b"\2\2"


def test_a_bigger_pooled_file_is_cut_to_the_segment(tier: se.HostTier) -> None:
    write(tier, "big", 2 * MiB, 7)
    tier.delete("big")
    write(tier, "small", MiB // 2, 8)
    assert tier.pool_counters()["claimed"] == 1
    assert os.path.getsize(tier.path("small")) == MiB // 2
    assert os.stat(tier.path("small")).st_blocks * 512 == MiB // 2  # the tail given back
    assert bytes(tier.open("small").host_bytes(MiB // 2 - 2)) == b"\x08\x08"
    write(tier, "grown", 2 * MiB, 9)  # a smaller pooled file is extended (none here)
    tier.delete("small")
    write(tier, "grown2", 2 * MiB, 10)
    assert tier.pool_counters()["claimed"] == 2
    assert os.path.getsize(tier.path("grown2")) == 2 * MiB
    assert int(tier.open("grown2").host_bytes()[-1]) == 10


def test_abort_and_orphans_feed_the_pool(tier: se.HostTier) -> None:
    write(tier, "orphan", MiB, 1)  # released, never registered: its writer is gone
    w = tier.create("aborted", MiB)
    w.buffer[:] = 2  # a fresh file holds the pages written (here all of them)
    w.abort()
    assert tier.pooled_bytes() == MiB and list(tier.segments()) == ["orphan"]
    empty = tier.create("never-written", MiB)  # no page made: nothing worth pooling
    empty.abort()
    assert tier.pooled_bytes() == MiB and list(tier.segments()) == ["orphan"]
    assert tier.reclaim_orphans(lambda sid: False) == ["orphan"]
    assert tier.pooled_bytes() == 2 * MiB and list(tier.segments()) == []


_CLAIM = """
import os, sys
import storage_engine as se
from storage_engine import _pool
tier = se.HostTier(sys.argv[1], pool_limit=8 << 20)
mode = sys.argv[2]
if mode == "claim":
    w = tier.create("child", 1 << 20)
    w.buffer[:] = 5
    w.finish()
    print(tier.pool_counters()["claimed"], tier.pool_counters()["mapping_reused"])
    w.release()
elif mode == "crash-after-rename":
    got = tier._pool.claim(1 << 20, tier.path("crashed"), set())
    assert got is not None
    os._exit(0)  # dies holding the claimed file, renamed but never registered
elif mode == "crash-holding-lock":
    name = [n for n in os.listdir(tier._pool.dir) if not n.startswith(".")][0]
    fd = os.open(tier._pool.dir / name, os.O_RDWR)
    assert _pool.lock_nb(fd)
    os._exit(0)  # dies between its lock and its rename
"""


def run_child(root: Path, mode: str) -> str:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(_CLAIM), str(root), mode],
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_a_second_process_reuses_pooled_files(tier: se.HostTier) -> None:
    write(tier, "mine", MiB, 1)
    tier.delete("mine")
    assert len(pool_files(tier)) == 1
    # another process claims it: its counters say so, and it did not have our mapping
    assert run_child(tier.root, "claim").split() == ["1", "0"]
    assert pool_files(tier) == [] and bytes(tier.open("child").host_bytes(0, 1)) == b"\5"


def test_a_crash_mid_claim_leaves_what_gc_reclaims(tier: se.HostTier) -> None:
    write(tier, "a", MiB, 1)
    write(tier, "b", MiB, 2)
    tier.delete("a")
    tier.delete("b")
    run_child(tier.root, "crash-holding-lock")  # its lock died with it: still claimable
    assert len(pool_files(tier)) == 2
    run_child(tier.root, "crash-after-rename")
    assert list(tier.segments()) == ["crashed"] and len(pool_files(tier)) == 1
    assert tier.reclaim_orphans(lambda sid: False) == ["crashed"]
    assert list(tier.segments()) == [] and tier.pooled_bytes() == 2 * MiB
    assert tier.trim_pool(0) == 2 * MiB and pool_files(tier) == []


def test_a_forked_child_does_not_use_its_parents_mappings(
        tier: se.HostTier, monkeypatch: pytest.MonkeyPatch) -> None:
    # seen from another pid (a forked child: os.fork itself is refused beside the
    # threads other tests start), the kept mappings are not there, and a claim maps anew
    from storage_engine import _mapping

    write(tier, "p", MiB, 1)
    tier.delete("p")
    assert len(tier._maps.inodes()) == 1
    parent = os.getpid()
    monkeypatch.setattr(_mapping.os, "getpid", lambda: parent + 1)
    assert tier._maps.inodes() == set()
    write(tier, "child", MiB, 2)
    c = tier.pool_counters()
    assert c["claimed"] == 1 and c["mapping_reused"] == 0
    assert bytes(tier.open("child").host_bytes(0, 1)) == b"\2"


# -- through the client -------------------------------------------------------------------
def test_steady_commits_with_retention_reuse_pooled_extents(tmp_path: Path) -> None:
    db = open_store(tmp_path / "store")
    try:
        sd = {f"w{i}": torch.zeros(64 * 1024) for i in range(4)}  # 1 MiB a version
        db.commit("model", {k: v + 1 for k, v in sd.items()})
        db.set_retention("model", 2)
        host = db.tier("host")
        assert isinstance(host, se.FileTier)
        inodes: set[int] = set()
        for step in range(2, 12):
            db.commit("model", {k: v + step for k, v in sd.items()})
            report = db.gc()
            inodes |= {os.stat(host.path(s)).st_ino for s in host.segments()}
            assert report.pool_bytes == host.pooled_bytes()
        counters = host.pool_counters()
        # after the first commits, every commit takes the file gc freed three steps ago;
        # a file's first turn maps it (its first write went through its descriptor, no
        # mapping), every later turn takes the mapping kept since
        assert counters["claimed"] >= 7
        assert counters["mapping_reused"] >= counters["claimed"] - 4
        assert len(inodes) <= 4  # three live versions and one in the pool, reused
        got = db.snapshot("model").state_dict()
        assert all(float(t[0]) == 11 for t in got.values())
    finally:
        remove_store(db)


def test_a_tensor_of_a_closed_snapshot_keeps_its_bytes(tmp_path: Path) -> None:
    # the docs: tensors "stay valid after the snapshot is closed"; gc then frees their
    # version, and later commits must not write into the file the tensor maps
    db = open_store(tmp_path / "store")
    try:
        db.commit("m", {"w": torch.full((256 * 1024,), 1.0)})
        db.set_retention("m", 1)
        with db.snapshot("m") as snap:
            held = snap["w"]
        for step in range(2, 6):
            db.commit("m", {"w": torch.full((256 * 1024,), float(step))})
            db.gc()
        assert float(held.min()) == float(held.max()) == 1.0
    finally:
        remove_store(db)


def test_gc_trims_the_pool_and_gives_it_all_back(tmp_path: Path) -> None:
    db = open_store(tmp_path / "store", pool_bytes=2 * MiB)
    try:
        for i in range(4):
            db.commit(f"c{i}", {"w": torch.full((256 * 1024,), float(i))})  # 1 MiB each
        for i in range(4):
            db.drop(f"c{i}")
        report = db.gc()
        assert report.segments_deleted == 4 and report.pool_bytes == 2 * MiB
        assert db.stats()["host_pool_bytes"] == 2 * MiB
        with pytest.raises(InvalidInput, match="keep_pool"):
            db.gc(keep_pool="no")  # type: ignore[arg-type]
        assert db.stats()["host_pool_bytes"] == 2 * MiB  # unchanged by the refusal
        report = db.gc(keep_pool=False)
        assert report.pool_released == 2 * MiB and report.pool_bytes == 0
        assert db.stats()["host_pool_bytes"] == 0
    finally:
        remove_store(db)


def test_no_pool_when_asked(tmp_path: Path) -> None:
    db = open_store(tmp_path / "store", pool_bytes=0)
    try:
        db.commit("c", {"w": torch.ones(1024)})
        db.drop("c")
        assert db.gc().pool_bytes == 0
        assert not (db.config.shm_dir / "pool").exists()
    finally:
        remove_store(db)


def test_the_default_pool_bound_follows_the_host(tmp_path: Path) -> None:
    t = se.HostTier(tmp_path / "d")
    total = _pool.meminfo().get("MemTotal", 4 << 30)
    assert t.pool_limit == total // 4
    assert se.HostTier(tmp_path / "c", capacity=MiB).pool_limit == MiB
    assert se.DiskTier(tmp_path / "disk").pool_limit == 0
    t.close()
    assert isinstance(t, se.Pooling)
    assert tensordb.Config.resolve(home=tmp_path / "h").pool_bytes is None
