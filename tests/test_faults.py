"""Fault injection: bytes flipped and files cut on each tier, the KV store's slabs and
index, and the catalog file; a store on a full tmpfs; a PostgreSQL catalog restarted
under a writer; a shared-memory area whose store's home was deleted; tensors whose
size is refused before any byte of them is copied. Each fault ends in a typed error
from ``tensordb.errors`` (or is survived), the process lives on, and what the fault did
not touch is unchanged.

The small tmpfs is mounted by the test (root only: it skips, saying why, elsewhere) and
handed to the store through $TENSORDB_SHM_ROOT; the PostgreSQL server is the test's
own, started with ``initdb`` and ``pg_ctl`` as an unprivileged user on a private port and
socket directory (it skips where that cannot run), never the shared one. A holder
killed mid-transfer is ``test_transport.py::test_holder_killed_mid_transfer``; a cut
stream resumed at the next holder is ``test_transport_pull.py``."""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import flip_byte, open_store, remove_store
from typer.testing import CliRunner

import tensordb
from tensordb import cli
from tensordb.errors import CorruptData, InvalidInput, StoreFull

MiB = 1 << 20
SHM_ROOT_ENV = "TENSORDB_SHM_ROOT"


# -- helpers ----------------------------------------------------------------------------
def _mount_tmpfs(where: Path, nbytes: int) -> str | None:
    """Mount a tmpfs of ``nbytes`` at ``where``; None, or the reason it cannot be."""
    if os.geteuid() != 0:
        return "mounting a small tmpfs needs root"
    where.mkdir(parents=True, exist_ok=True)
    run = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={nbytes},mode=0700",
                          "tmpfs", str(where)], capture_output=True, text=True)
    if run.returncode != 0:
        return f"mount -t tmpfs failed here: {run.stderr.strip() or run.returncode}"
    return None


@pytest.fixture
def small_shm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
              ) -> Iterator[tuple[Path, int]]:
    """A 24 MiB tmpfs the stores of the test keep their shared memory in."""
    where, size = tmp_path / "shm", 24 * MiB
    reason = _mount_tmpfs(where, size)
    if reason is not None:
        pytest.skip(reason)
    monkeypatch.setenv(SHM_ROOT_ENV, str(where))
    try:
        yield where, size
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def _state(db: tensordb.Database) -> tuple[list[str], dict[str, list[tuple[int, str | None]]]]:
    names = db.collections()
    return names, {c: [(h.version, h.message) for h in db.history(c)] for c in names}


class PeakRSS:
    """The growth of this process's peak resident memory over a block, from the kernel's
    own high-water mark (``VmHWM``, reset through ``/proc/self/clear_refs``)."""

    def __enter__(self) -> PeakRSS:
        try:
            with open("/proc/self/clear_refs", "w") as fh:
                fh.write("5")
        except OSError as exc:
            pytest.skip(f"cannot reset the peak RSS here: {exc.strerror}")
        self.start = self._hwm()
        return self

    def __exit__(self, *exc: object) -> None:
        self.growth = self._hwm() - self.start

    @staticmethod
    def _hwm() -> int:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) << 10
        raise AssertionError("no VmHWM in /proc/self/status")


# -- sizes checked before any copy -------------------------------------------------------
def test_an_expanded_giant_is_refused_before_it_is_copied(tmp_path: Path) -> None:
    """torch.zeros(1).expand(10**9) is 4 bytes of memory and 4 GB of tensor: a commit
    to a tier that cannot hold it, and a KV put into an arena that cannot, refuse it
    (StoreFull) without making it contiguous first."""
    giant = torch.zeros(1).expand(10**9)
    db = open_store(tmp_path / "s", host_capacity=64 * MiB)
    try:
        db.commit("m", {"x": torch.ones(4)})
        before = _state(db)
        kv = db.kv("ns", block_tokens=4, capacity_bytes=16 * MiB, slab_bytes=MiB)
        keys = kv.keys(list(range(8)))
        with PeakRSS() as peak:
            with pytest.raises(StoreFull, match="64 ?MiB|67108864") as info:
                db.commit("m", {"x": giant})
            assert info.value.collection == "m"
            with pytest.raises(StoreFull, match="block 0") as kinfo:
                kv.put(keys[:1], [giant])
            assert kinfo.value.collection == "ns"
        assert peak.growth < 256 * MiB, peak.growth  # not 4 GB
        assert _state(db) == before and kv.match(keys) == 0 and db.verify() == []
    finally:
        remove_store(db)


def test_an_unchanged_expanded_tensor_is_hashed_in_pieces(tmp_path: Path) -> None:
    """Recommitting a tensor equal to the head's, given as an expanded view: its digest
    is taken in pieces (the version shares the extent) and never costs its size."""
    n = 50_000_000  # 200 MB as a tensor, 4 bytes as an expanded view
    db = open_store(tmp_path / "s")
    try:
        db.commit("m", {"x": torch.zeros(n)})
        seg = db.stats()["segments"]
        with PeakRSS() as peak:
            c = db.commit("m", {"x": torch.zeros(1).expand(n)})
        assert c.version == 2 and db.stats()["segments"] == seg  # unchanged: shared
        assert peak.growth < 64 * MiB, peak.growth  # not the 200 MB of a whole copy
        assert db.verify() == []
    finally:
        remove_store(db)


# -- a full tmpfs -----------------------------------------------------------------------
def test_prefault_on_a_full_tmpfs_is_store_full(tmp_path: Path,
                                                small_shm: tuple[Path, int]) -> None:
    db = open_store(tmp_path / "s")
    try:
        db.commit("m", {"x": torch.ones(16)})
        before = _state(db)
        with pytest.raises(StoreFull, match="prefault"):
            db.prefault(64 * MiB)  # more than the whole tmpfs
        assert db.tier("host").spare_bytes == 0  # type: ignore[attr-defined]
        capped = open_store(tmp_path / "c", host_capacity=MiB)
        try:
            with pytest.raises(StoreFull, match="at most 1048576"):
                capped.prefault(8 * MiB)
        finally:
            remove_store(capped)
        db.prefault(MiB)  # one that fits is still made
        assert db.commit("m", {"y": torch.ones(1000)}).version == 2
        assert _state(db)[1]["m"][1:] == before[1]["m"] and db.verify() == []
    finally:
        remove_store(db)


def test_the_kv_arena_fits_a_small_shm(tmp_path: Path, small_shm: tuple[Path, int]) -> None:
    """With no capacity given, the arena is a quarter of the free shared memory, even
    where that is far below 64 MiB (it was at least 64 MiB, and every put failed)."""
    db = open_store(tmp_path / "s")
    try:
        kv = db.kv("ns", block_tokens=4)
        assert kv.store.capacity <= small_shm[1] // 4  # type: ignore[attr-defined]
        keys = kv.keys(list(range(16)))
        blocks = [torch.full((1024,), float(i)) for i in range(4)]
        assert kv.put(keys, blocks) == 4
        assert all(torch.equal(a, b) for a, b in zip(kv.get(keys), blocks, strict=True))
    finally:
        remove_store(db)


def test_a_full_tmpfs_gives_store_full_and_the_store_recovers_after_gc(
        tmp_path: Path, small_shm: tuple[Path, int]) -> None:
    db = open_store(tmp_path / "s", pool_bytes=0)
    try:
        committed = 0
        with pytest.raises(StoreFull) as info:
            for i in range(20):  # 4 MiB each into 24 MiB: full within 6
                db.commit(f"c{i}", {"x": torch.full((MiB,), float(i))})
                committed += 1
        assert info.value.collection == f"c{committed}" and 0 < committed < 20
        before = _state(db)
        with pytest.raises(StoreFull):
            db.commit("again", {"x": torch.ones(MiB)})
        assert _state(db) == before and db.verify() == []
        # the KV store on the same full memory: an arena larger than what is left
        kv = db.kv("ns", block_tokens=4, capacity_bytes=64 * MiB, slab_bytes=4 * MiB)
        keys = kv.keys(list(range(4 * 64)))
        with pytest.raises(StoreFull) as kinfo:
            for i in range(0, len(keys), 4):
                kv.put(keys[i : i + 4], [torch.ones(MiB // 4)] * 4)
        assert kinfo.value.collection == "ns"
        stored = kv.match(keys)
        # free room: drop collections, gc; commits and puts work again
        for name in db.collections():
            db.drop(name)
        db.gc(keep_pool=False)
        assert db.commit("after", {"x": torch.ones(MiB)}).version == 1
        assert kv.put(keys[stored : stored + 4], [torch.ones(MiB // 4)] * 4) >= 1
        assert db.verify() == []
    finally:
        remove_store(db)


# -- bytes flipped and files cut ----------------------------------------------------------
def _segment_file(db: tensordb.Database, collection: str) -> Path:
    tier = "host" if collection.startswith("h") else "disk"
    root = Path(db.config.shm_dir if tier == "host" else db.config.data_dir)
    info = db.catalog.require(collection)
    from tensordb.catalog import NodeDirectory  # the directory of segments

    (seg,) = [s for s, _ in NodeDirectory(db.catalog.engine).version_segments(info.id,
                                                                              info.head)]
    (path,) = list(root.rglob(f"{seg}.seg"))
    return path


def test_verify_finds_flipped_and_cut_extents_on_each_tier_and_gc_commit_survive(
        tmp_path: Path) -> None:
    db = open_store(tmp_path / "s")
    try:
        for c, tier in (("h-flip", "host"), ("h-cut", "host"), ("d-flip", "disk"),
                        ("d-cut", "disk")):
            db.commit(c, {"x": torch.randn(10_000)}, tier=tier)
        db.commit("ok", {"x": torch.arange(100)})
        before = _state(db)
        for c in ("h-flip", "d-flip"):
            flip_byte(_segment_file(db, c), 1234)
        for c in ("h-cut", "d-cut"):
            os.truncate(_segment_file(db, c), 1000)
        found = {(p.collection, p.tier) for p in db.verify()}
        assert found == {("h-flip", "host"), ("h-cut", "host"), ("d-flip", "disk"),
                         ("d-cut", "disk")}
        report = db.gc()  # finds nothing to reclaim, and does not trip over them
        assert report.segments_deleted == 0
        assert db.commit("ok", {"y": torch.ones(3)}).version == 2
        assert torch.equal(db.get("ok", "x"), torch.arange(100))
        assert _state(db)[0] == before[0]
        run = CliRunner().invoke(cli.app, ["--home", str(db.config.home), "verify"])
        assert run.exit_code == 1 and "4 problem(s)" in run.output, run.output
    finally:
        remove_store(db)


def test_a_kv_slab_cut_under_the_store_is_survived(tmp_path: Path) -> None:
    """A slab file truncated by someone else: reads of the blocks past the cut are
    CorruptData (and dropped), a put that lands there works (it was a SIGBUS that
    killed the process), blocks before the cut are still served."""
    db = open_store(tmp_path / "s")
    try:
        kv = db.kv("ns", block_tokens=4, capacity_bytes=8 * MiB, slab_bytes=MiB)
        keys = kv.keys(list(range(16)))
        blocks = [torch.full((2048,), float(i)) for i in range(4)]
        kv.put(keys, blocks)
        _, path, offset, _ = kv.store.locate(keys[1])  # type: ignore[attr-defined]
        os.truncate(path, offset)
        with pytest.raises(CorruptData) as info:
            kv.get(keys)
        assert info.value.collection == "ns"
        assert kv.match(keys) == 1 and torch.equal(kv.get(keys[:1])[0], blocks[0])
        more = kv.keys(list(range(100, 116)))
        assert kv.put(more, blocks) == 4  # into the cut slab's chunks: no SIGBUS
        assert all(torch.equal(a, b) for a, b in zip(kv.get(more), blocks, strict=True))
    finally:
        remove_store(db)


@pytest.mark.parametrize("fault", ["cut in half", "emptied", "deleted", "flipped"])
def test_a_damaged_kv_spill_file_is_corrupt_data(tmp_path: Path, fault: str) -> None:
    """A block spilled to the disk tier whose file is cut, emptied, deleted or flipped:
    CorruptData and the block dropped (a miss from then on); the rest is served."""
    db = open_store(tmp_path / "s")
    try:
        kv = db.kv("ns", block_tokens=4, capacity_bytes=256 << 10, slab_bytes=64 << 10)
        keys = kv.keys(list(range(4 * 64)))
        for i in range(0, 64, 4):  # 1 MiB into a 256 KiB arena: the oldest spill
            kv.put(keys[i : i + 4], [torch.full((4096,), float(j)) for j in range(i, i + 4)])
        tier, path, offset, nbytes = kv.store.locate(keys[0])  # type: ignore[attr-defined]
        assert tier == "disk"
        if fault == "cut in half":
            os.truncate(path, offset + nbytes // 2)
        elif fault == "emptied":
            os.truncate(path, 0)
        elif fault == "deleted":
            os.unlink(path)
        else:
            flip_byte(path, offset + nbytes // 3)
        with pytest.raises(CorruptData) as info:
            kv.get(keys[:1])
        assert info.value.collection == "ns"
        assert kv.match(keys) == 0 and kv.contains(keys[1:2]) == [True]
        assert float(kv.get(keys[1:2])[0][0]) == 1.0
    finally:
        remove_store(db)


@pytest.mark.parametrize("fault", ["truncated", "overwritten"])
def test_a_damaged_kv_index_is_corrupt_data(tmp_path: Path, fault: str) -> None:
    db = open_store(tmp_path / "s")
    kv = db.kv("ns", block_tokens=4, capacity_bytes=8 * MiB, slab_bytes=MiB)
    kv.put(kv.keys(list(range(8))), [torch.ones(16)] * 2)
    index = Path(db.config.shm_dir) / "kv" / "ns" / "index.kvx"
    db.close()
    if fault == "truncated":
        os.truncate(index, 100)
    else:
        index.write_bytes(b"\x00garbage" * 512)
    db = open_store(tmp_path / "s")
    try:
        with pytest.raises(CorruptData, match="KV block index .* damaged") as info:
            db.kv("ns", block_tokens=4, capacity_bytes=8 * MiB, slab_bytes=MiB)
        assert info.value.collection == "ns"
        assert db.commit("m", {"x": torch.ones(2)}).version == 1  # the store works on
        shutil.rmtree(index.parent)  # what the message says to do
        kv = db.kv("ns", block_tokens=4, capacity_bytes=8 * MiB, slab_bytes=MiB)
        assert kv.match(kv.keys(list(range(8)))) == 0
    finally:
        remove_store(db)


@pytest.mark.parametrize("fault", ["truncated", "overwritten", "flipped"])
def test_a_damaged_sqlite_catalog(tmp_path: Path, fault: str) -> None:
    """A catalog file cut short or overwritten: connect raises CorruptData naming it.
    Bytes flipped in its pages: whatever SQLite still reads, or CorruptData; never a
    driver error."""
    db = open_store(tmp_path / "s")
    for i in range(20):
        db.commit("m", {"x": torch.randn(100)}, message=f"step {i}" * 20)
    remove_store(db)  # its shared memory too: a store that cannot open cannot remove it
    cat = tmp_path / "s" / "catalog.db"
    size = cat.stat().st_size
    if fault == "truncated":
        os.truncate(cat, size // 2)
    elif fault == "overwritten":
        cat.write_bytes(b"not a database" * 300)
    else:
        for off in range(100, size, 1531):
            flip_byte(cat, off)
    try:
        db = open_store(tmp_path / "s")
    except CorruptData as exc:
        assert str(cat) in str(exc) and "damaged" in str(exc)
        return
    try:
        assert fault == "flipped", "a cut or overwritten catalog was opened"
        try:
            db.history("m")
            db.verify()
        except (CorruptData, tensordb.errors.NotFound, InvalidInput):
            pass
    finally:
        remove_store(db)


# -- orphaned shared memory ---------------------------------------------------------------
def test_orphans_lists_and_removes_areas_whose_home_is_gone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "shmroot"
    root.mkdir()
    monkeypatch.setenv(SHM_ROOT_ENV, str(root))
    gone, kept, held = (open_store(tmp_path / n) for n in ("gone", "kept", "held"))
    for db in (gone, kept, held):
        db.commit("m", {"x": torch.ones(1000)})
    view = held.get("m", "x")  # a mapping of held's area stays in this process
    areas = {n: Path(db.config.shm_dir) for n, db in
             (("gone", gone), ("kept", kept), ("held", held))}
    for db in (gone, kept, held):
        db.close()
    shutil.rmtree(tmp_path / "gone")
    shutil.rmtree(tmp_path / "held")
    (root / "tensordb-unknown-0123").mkdir()  # no record: listed with --all, never removed
    runner = CliRunner(env={"COLUMNS": "300"})
    listed = runner.invoke(cli.app, ["orphans"])
    assert listed.exit_code == 0, listed.output
    assert areas["gone"].name in listed.output and areas["held"].name in listed.output
    assert areas["kept"].name not in listed.output
    assert all(p.exists() for p in areas.values())  # listing removes nothing
    every = runner.invoke(cli.app, ["orphans", "--all"])
    assert areas["kept"].name in every.output and "tensordb-unknown-0123" in every.output
    removed = runner.invoke(cli.app, ["orphans", "--remove"])
    assert removed.exit_code == 0, removed.output
    assert "removed 1 orphan" in removed.output and "open in process" in removed.output
    assert not areas["gone"].exists()
    assert areas["held"].exists() and areas["kept"].exists()
    assert (root / "tensordb-unknown-0123").exists()
    assert float(view.sum()) == 1000.0
    del view
    shutil.rmtree(areas["held"])
    shutil.rmtree(areas["kept"])


# -- PostgreSQL restarted under load ------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PrivatePostgres:
    """A PostgreSQL server of the test's own: initdb'd as ``nobody`` in a fresh
    directory, listening only on a Unix socket in that directory, on a free port."""

    def __init__(self) -> None:
        self.initdb = shutil.which("initdb") or "/usr/local/bin/initdb"
        self.pg_ctl = shutil.which("pg_ctl") or "/usr/local/bin/pg_ctl"
        self.dir = Path(tempfile.mkdtemp(prefix="tensordb-pgtest-", dir="/tmp"))
        self.port = _free_port()
        self.url = f"postgresql+psycopg://postgres@/tensordb?host={self.dir}&port={self.port}"

    def _as_user(self, *cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        user = pwd.getpwnam("nobody")
        prefix: list[str] = []
        if os.geteuid() == 0:
            prefix = ["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}",
                      "--clear-groups", "env", f"HOME={self.dir}"]
        return subprocess.run([*prefix, *cmd], capture_output=True, text=True, check=check,
                              timeout=120)

    def _opts(self) -> str:
        return f"-p {self.port} -k {self.dir} -c listen_addresses='' -c fsync=off"

    def start(self) -> str | None:
        """Start it; None, or why it cannot run here."""
        if not (os.path.exists(self.initdb) and os.path.exists(self.pg_ctl)):
            return "no initdb / pg_ctl on this host"
        if os.geteuid() == 0 and shutil.which("setpriv") is None:
            return "running as root without setpriv to drop to an unprivileged user"
        if os.geteuid() == 0:
            user = pwd.getpwnam("nobody")
            os.chown(self.dir, user.pw_uid, user.pw_gid)
        init = self._as_user(self.initdb, "-D", f"{self.dir}/data", "-A", "trust",
                             "-U", "postgres", "--no-sync", check=False)
        if init.returncode != 0:
            return f"initdb cannot run here: {init.stderr.strip()[-300:]}"
        self.ctl("start")
        from sqlalchemy import create_engine, text

        eng = create_engine(self.url.replace("/tensordb?", "/postgres?"),
                            isolation_level="AUTOCOMMIT")
        with eng.connect() as conn:
            conn.execute(text("CREATE DATABASE tensordb"))
        eng.dispose()
        return None

    def ctl(self, action: str) -> None:
        self._as_user(self.pg_ctl, "-D", f"{self.dir}/data", "-o", self._opts(),
                      "-l", f"{self.dir}/log", "-m", "fast", "-w", action)

    def close(self) -> None:
        self._as_user(self.pg_ctl, "-D", f"{self.dir}/data", "-m", "immediate", "-w",
                      "stop", check=False)
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def private_pg() -> Iterator[PrivatePostgres]:
    pg = PrivatePostgres()
    try:
        reason = pg.start()
        if reason is not None:
            pytest.skip(reason)
        yield pg
    finally:
        pg.close()


def test_commits_resume_across_postgres_restarts(tmp_path: Path,
                                                 private_pg: PrivatePostgres) -> None:
    """A writer commits in a loop while its catalog server is restarted (fast shutdown:
    every connection cut) three times: each commit lands exactly once, as consecutive
    versions, in order."""
    db = open_store(tmp_path / "s", private_pg.url, node="n1")
    n = 60
    done: list[int] = []
    errors: list[BaseException] = []

    def write() -> None:
        try:
            for i in range(n):
                c = db.commit("m", {"x": torch.full((256,), float(i))}, message=f"step {i}")
                done.append(c.version)
                time.sleep(0.01)
        except BaseException as exc:  # noqa: BLE001 - the test reports it
            errors.append(exc)

    writer = threading.Thread(target=write)
    writer.start()
    try:
        restarts = 0
        for at in (10, 25, 40):
            deadline = time.monotonic() + 60
            while len(done) < at and writer.is_alive() and time.monotonic() < deadline:
                time.sleep(0.01)
            private_pg.ctl("restart")
            restarts += 1
        writer.join(120)
        assert not writer.is_alive() and errors == [], errors
        assert restarts == 3 and done == list(range(1, n + 1))
        history = db.history("m")
        assert [(h.version, h.message) for h in reversed(history)] == \
            [(i + 1, f"step {i}") for i in range(n)]
        assert float(db.get("m", "x")[0]) == n - 1
        assert db.verify() == []
    finally:
        writer.join(120)
        remove_store(db)
