"""Cost contracts: every speed promise of the form O(1), O(changed) or O(touched),
held by counting the work at two sizes 100 x apart, never by timing it.

Each contract runs one operation on a collection of ``SMALL`` and of ``BIG`` tensors
(``BIG = 100 * SMALL``) and counts, around it:

* the SQL statements the catalog runs (SQLite's own trace, so the DBAPI fast paths
  are seen too; SQLAlchemy's events on PostgreSQL) and, on SQLite, the virtual
  machine instructions they took (a progress handler: a scan of the collection's rows
  shows as a count that grows with it, where a look-up through an index does not);
* the rows the PostgreSQL server returned;
* the work the store counts itself (``storage_engine.counting``): ``TensorRow``s and
  names built, bytes copied and hashed, manifest rows packed in the background;
* minor page faults the process took (``getrusage``), per page written.

and asserts the count does not grow with the collection (or stays under a cap that
does not depend on its size). A change that breaks a promise fails here, whatever
the host's speed. docs/testing.md lists the contracts; benchmarks/ time the same paths.
"""

from __future__ import annotations

import re
import resource
import sqlite3
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import test_transport_pull
import torch
from conftest import open_store, remove_store, require_pg
from sqlalchemy import event

import storage_engine as se
import tensordb
from tensordb.catalog import CHUNK_ROWS, PACK_MIN_ROWS

SMALL = PACK_MIN_ROWS  # packed: the smallest version a packed manifest holds
BIG = 100 * SMALL
#: SQLite VM instructions between two calls of the progress handler
VM_STEP = 1


def model(n: int, value: float = 0.0) -> dict[str, torch.Tensor]:
    return {f"experts.{i:06d}.w": torch.full((4,), value + i) for i in range(n)}


def runs(statements: list[str]) -> list[str]:
    """Statements with repeats in a row made one (SQLite traces each row of an
    ``executemany``: one statement with many rows, to the database as to a reader)."""
    return [s for i, s in enumerate(statements) if i == 0 or statements[i - 1] != s]


@dataclass
class Cost:
    """What one operation cost."""

    statements: list[str] = field(default_factory=list)
    vm_steps: int = 0
    returned: int = 0
    work: dict[str, int] = field(default_factory=dict)
    faults: int = 0

    def __getitem__(self, kind: str) -> int:
        return self.work.get(kind, 0)


def _shape(stmt: str) -> str:
    """A statement with its values taken out (SQLite's trace shows them bound)."""
    return re.sub(r"'(?:[^']|'')*'|\b\d+(?:\.\d+)?\b", "?", " ".join(stmt.split()))


@contextmanager
def cost_of(db: tensordb.Database) -> Iterator[Cost]:
    """Count the work of the block: its statements, SQLite VM steps, rows returned,
    the store's own counters and page faults (every thread of this process)."""
    cost = Cost()
    engines = list({id(e): e for e in (db.catalog.engine, db.catalog.lease_engine)}.values())
    traced: list[sqlite3.Connection] = []

    def vm_step() -> int:
        cost.vm_steps += VM_STEP
        return 0

    def trace(stmt: str) -> None:
        cost.statements.append(_shape(stmt))

    def checkout(dbapi_conn: Any, _rec: Any, _proxy: Any) -> None:
        raw = getattr(dbapi_conn, "driver_connection", dbapi_conn)
        if isinstance(raw, sqlite3.Connection) and raw not in traced:
            raw.set_trace_callback(trace)
            raw.set_progress_handler(vm_step, VM_STEP)
            traced.append(raw)

    def before(conn: Any, cursor: Any, stmt: str, *_: Any) -> None:
        if conn.dialect.name != "sqlite":
            cost.statements.append(_shape(stmt))

    def after(conn: Any, cursor: Any, stmt: str, *_: Any) -> None:
        if conn.dialect.name != "sqlite" and stmt.lstrip().upper().startswith("SELECT"):
            cost.returned += max(0, cursor.rowcount)

    with ExitStack() as stack:
        for e in engines:
            event.listen(e, "checkout", checkout)
            event.listen(e, "before_cursor_execute", before)
            event.listen(e, "after_cursor_execute", after)
            stack.callback(event.remove, e, "checkout", checkout)
            stack.callback(event.remove, e, "before_cursor_execute", before)
            stack.callback(event.remove, e, "after_cursor_execute", after)
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        with se.counting() as work:
            yield cost
        cost.faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
        cost.work = dict(work)
        for raw in traced:
            raw.set_trace_callback(None)
            raw.set_progress_handler(None, 0)


def drain(db: tensordb.Database) -> None:
    """Wait for the background work a commit queued (its manifest's packing)."""
    assert db.catalog.manifests is not None
    db.catalog.manifests.close()


def store_of(sizes: tuple[int, ...], home: Path, url: str | None = None
             ) -> tensordb.Database:
    db = open_store(home, url)
    for n in sizes:
        db.commit(f"c{n}", model(n))
    drain(db)
    return db


@pytest.fixture(scope="module")
def sized(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tensordb.Database]:
    """One embedded store holding a SMALL and a BIG collection (built once: a BIG
    commit takes seconds); contracts that change them run in this file's order."""
    db = store_of((SMALL, BIG), tmp_path_factory.mktemp("costs"))
    yield db
    remove_store(db)


def both(db: tensordb.Database, op: Callable[[tensordb.Database, int], Any]
         ) -> tuple[Cost, Cost]:
    """The cost of ``op(db, n)`` on the SMALL and on the BIG collection."""
    out = []
    for n in (SMALL, BIG):
        drain(db)  # what an earlier step queued is not this one's
        with cost_of(db) as c:
            op(db, n)
        out.append(c)
    return out[0], out[1]


def assert_flat(small: Cost, big: Cost, *, vm_slack: float = 1.05, ordered: bool = True
                ) -> None:
    """The same statements (``ordered``: in the same order), no more rows built or
    returned, and as many VM steps (within ``vm_slack``) at BIG as at SMALL."""
    if ordered:
        assert runs(big.statements) == runs(small.statements)
    else:  # the same kinds, no more of them
        assert set(runs(big.statements)) == set(runs(small.statements))
        assert len(runs(big.statements)) <= len(runs(small.statements))
    assert big.returned <= small.returned
    assert big["rows_built"] <= small["rows_built"]
    assert big["commits_built"] <= small["commits_built"]
    assert big.vm_steps <= small.vm_steps * vm_slack + 8, (small.vm_steps, big.vm_steps)


# -- commit ---------------------------------------------------------------------------
def one_change(db: tensordb.Database, n: int, value: float = -1.0) -> None:
    c = db.commit(f"c{n}", {"experts.000001.w": torch.full((4,), value)})
    assert c.tensors == n and c.written == 1


def test_a_one_change_commit_and_what_it_queues_cost_the_same_in_any_collection(
        sized: tensordb.Database) -> None:
    """The commit, and the packing it leaves queued (its version's manifest: the chunk
    its changed name falls in is rewritten, not the version's rows), counted together:
    the background work runs on its own thread, so the block waits for it."""
    def commit_and_queued(db: tensordb.Database, n: int) -> None:
        one_change(db, n, -2.0)
        drain(db)

    small, big = both(sized, commit_and_queued)
    assert_flat(small, big)
    for c in (small, big):
        assert c["rows_built"] == 1  # the head row of the one name, nothing else
        assert c["bytes_copied"] == 16  # the changed tensor's bytes, once
        assert 0 < c["manifest_rows_packed"] <= 2 * CHUNK_ROWS
        assert c["names_built"] <= CHUNK_ROWS
    # the new bytes, the chunk read and written, and the version's list of chunks (a
    # line per CHUNK_ROWS rows: the one part that grows, ~150 bytes a chunk)
    assert big["bytes_hashed"] <= small["bytes_hashed"] * 1.1 + 200 * BIG // CHUNK_ROWS
    with sized.snapshot(f"c{BIG}") as snap:  # and the packed version is right
        assert snap.commit.written == 1
        assert torch.equal(snap["experts.000001.w"], torch.full((4,), -2.0))
        assert torch.equal(snap["experts.000002.w"], torch.full((4,), 2.0))
        assert len(snap) == BIG


def test_a_one_change_commit_alone_costs_the_same_in_any_collection(
        sized: tensordb.Database) -> None:
    small, big = both(sized, lambda db, n: one_change(db, n, -3.0))
    assert_flat(small, big)


def test_a_full_commit_copies_and_hashes_each_byte_once(tmp_path: Path) -> None:
    db = open_store(tmp_path)
    try:
        costs = []
        for n in (SMALL // 20, SMALL * 5):  # 100 x apart
            tensors = model(n)
            nbytes = sum(t.nbytes for t in tensors.values())
            with cost_of(db) as c:
                db.commit(f"full{n}", tensors)
            assert c["bytes_copied"] == nbytes
            assert c["bytes_hashed"] == nbytes
            assert c["rows_built"] == 0  # a first commit reads no rows
            costs.append(c)
        small, big = costs
        assert runs(big.statements) == runs(small.statements)
    finally:
        remove_store(db)


def test_an_import_copies_and_hashes_each_byte_once(tmp_path: Path) -> None:
    """A safetensors import of 10 and of 1,000 tensors: each byte of the file is read
    into the store and hashed once (the store reads the tensors' byte ranges itself)."""
    from safetensors.torch import save_file

    for n in (10, 1000):
        path = tmp_path / f"m{n}.safetensors"
        save_file({f"w{i}": torch.full((1024,), float(i)) for i in range(n)}, str(path))
        db = open_store(tmp_path / f"s{n}")
        try:
            with cost_of(db) as c:
                db.import_safetensors("m", path)
            assert c["bytes_copied"] == c["bytes_hashed"] == n * 4096
        finally:
            remove_store(db)


# -- snapshot ---------------------------------------------------------------------------
def open_touch_one(db: tensordb.Database, n: int) -> None:
    with db.snapshot(f"c{n}") as snap:
        sd = snap.state_dict()
        assert len(sd) == n and "experts.000007.w" in sd
        assert torch.equal(sd["experts.000007.w"], torch.full((4,), 7.0))


def test_open_state_dict_and_one_tensor_cost_the_same_in_any_collection(
        sized: tensordb.Database) -> None:
    open_touch_one(sized, SMALL)  # this process's first open of each pays for itself
    open_touch_one(sized, BIG)
    small, big = both(sized, open_touch_one)
    assert_flat(small, big)
    # a row per segment and the one touched: never a row per tensor of the version
    assert small["rows_built"] == big["rows_built"] <= 4
    # the names of the one chunk the touched name falls in
    assert big["names_built"] <= CHUNK_ROWS
    assert big["manifest_rows_packed"] == 0


def test_walking_every_tensor_builds_each_row_once(sized: tensordb.Database) -> None:
    """O(touched): a walk of the whole version builds one row per tensor, not more."""
    def walk(db: tensordb.Database, n: int) -> None:
        with db.snapshot(f"c{n}") as snap:
            assert sum(1 for _ in snap.state_dict().values()) == n

    small, big = both(sized, walk)
    assert small["rows_built"] <= SMALL + 4
    assert big["rows_built"] <= BIG + 4


# -- history and gc ------------------------------------------------------------------------
def test_history_costs_its_versions_not_their_tensors(sized: tensordb.Database) -> None:
    def history(db: tensordb.Database, n: int) -> None:
        assert [c.version for c in db.history(f"c{n}")] == [3, 2, 1]

    small, big = both(sized, history)
    assert_flat(small, big)
    assert small["commits_built"] == big["commits_built"] == 3


def test_gc_costs_what_it_drops(sized: tensordb.Database) -> None:
    """Dropping the versions before the head and collecting them: the rows that only
    they held (two of each collection), whatever the collection holds."""
    def gc(db: tensordb.Database, n: int) -> None:
        assert db.drop_versions(f"c{n}", keep_last=1) == 2
        report = db.gc()
        assert report.dropped_rows == 2, report

    sized.gc()  # the first gc of a process also starts its scrub's cursor
    small, big = both(sized, gc)
    # gc walks every collection in id order, and checks each segment file of the host
    # against the catalog (a look-up a file, as many at either size)
    assert_flat(small, big, ordered=False)
    with sized.snapshot(f"c{BIG}") as snap:
        assert torch.equal(snap["experts.000001.w"], torch.full((4,), -3.0))
        assert [c.version for c in sized.history(f"c{BIG}")] == [3]


# -- PostgreSQL -------------------------------------------------------------------------
@pytest.mark.postgres
def test_postgres_one_change_commit_and_open_cost_the_same_at_any_size(
        pg_url: str, tmp_path: Path) -> None:
    require_pg()
    db = store_of((SMALL, BIG), tmp_path, pg_url)
    try:
        small, big = both(db, one_change)
        assert_flat(small, big)
        assert small["rows_built"] == big["rows_built"] == 1
        drain(db)
        open_touch_one(db, SMALL)
        open_touch_one(db, BIG)
        small, big = both(db, open_touch_one)
        assert_flat(small, big)
        assert big.returned <= 8  # the lock, the lease's look-ups, the segments' tiers
        assert small["rows_built"] == big["rows_built"] <= 4
    finally:
        remove_store(db)


# -- page faults ---------------------------------------------------------------------------
PAGE = resource.getpagesize()
#: faults a commit takes besides its pages' (its own Python objects, the catalog's)
FAULT_FLOOR = 400


@pytest.mark.parametrize("fresh", [True, False], ids=["fresh-store", "steady-state"])
def test_a_commit_faults_at_most_once_a_page_and_not_at_all_once_warm(
        tmp_path: Path, fresh: bool) -> None:
    """Minor faults a commit of 2 MiB and of 200 MiB takes (``getrusage``, every
    thread): into a fresh store at most one a page written (the kernel's populate of
    new shared memory, never twice); in the steady state (the segment a dropped
    version freed is reused) at most one per 16 pages (the kernel's fault-around
    window, 64 KiB: 3,200 at 200 MiB where a fresh store takes 51,200)."""
    for nbytes in (2 << 20, 200 << 20):
        db = open_store(tmp_path / f"s{nbytes}")
        try:
            tensor = torch.ones(nbytes // 4)
            if not fresh:  # a version of the same size, dropped: its segment is pooled
                db.commit("w", {"w": torch.zeros(nbytes // 4)})
                db.commit("w", {"w": torch.full((nbytes // 4,), 2.0)})
                db.drop_versions("w", keep_last=1)
                db.gc()
            with cost_of(db) as c:
                db.commit("w", {"w": tensor})
            pages = nbytes // PAGE
            limit = pages * (1.02 if fresh else 1 / 16) + FAULT_FLOOR
            assert c.faults <= limit, (nbytes, c.faults, pages)
            assert c["bytes_copied"] == nbytes
        finally:
            remove_store(db)


# -- replication ------------------------------------------------------------------------
#: the writer node "w" and the replica "r" of the pull tests, "r" reading "w" through the
#: in-process transport that records each read
pair = test_transport_pull.pair


def test_a_replication_pull_costs_what_changed(pair: tuple[Any, Any, Any]) -> None:
    """Replicating a version one tensor past the last one replicated: the new segment's
    bytes cross, and the catalog work is the same at 200 or 20,000 tensors."""
    w, r, fake = pair
    sizes = (200, 20_000)
    for n in sizes:
        w.commit(f"c{n}", model(n))
        r.replicate(f"c{n}", to=["r"])
        w.commit(f"c{n}", {"experts.000001.w": torch.full((4,), -1.0)})
    costs = []
    for n in sizes:
        drain(w)
        drain(r)
        fake.reads.clear()
        with cost_of(r) as c:
            r.replicate(f"c{n}", to=["r"])
        c.work["bytes_pulled"] = sum(length for _, _, length in fake.reads)
        costs.append(c)
    small, big = costs
    # the new segment: its one 16-byte tensor, padded to the extent alignment
    assert small["bytes_pulled"] == big["bytes_pulled"] == se.ALIGN
    assert_flat(small, big)
    with r.snapshot(f"c{sizes[1]}") as snap:
        assert torch.equal(snap["experts.000001.w"], torch.full((4,), -1.0))


# -- KV lookups -------------------------------------------------------------------------
def _syscalls() -> tuple[int, int]:
    """(read-like, write-like) system calls this process made so far (/proc)."""
    with open("/proc/self/io") as f:
        got = dict(line.split(": ") for line in f.read().splitlines())
    return int(got["syscr"]), int(got["syscw"])


def test_kv_lookups_cost_the_same_in_any_namespace(sqlite_db: tensordb.Database) -> None:
    """``match`` / ``contains`` (what the vLLM connector's get_num_new_matched_tokens and
    SGLang's batch_exists call, once per lookup) and a ``get`` of the blocks found, in a
    namespace of 100 and of 10,000 blocks: no SQL statement, no read or write system
    call, nothing built, copied or hashed but the blocks got."""
    costs = []
    for n in (100, 10_000):
        kv = tensordb.KVCache(sqlite_db, f"kv{n}", block_tokens=4,
                              capacity_bytes=n * 2 * 1024 + (8 << 20), slab_bytes=4 << 20)
        try:
            keys = kv.keys(list(range(4 * n)))
            for lo in range(0, n, 1000):
                kv.put(keys[lo:lo + 1000],
                       [torch.full((256,), float(i)) for i in range(lo, min(n, lo + 1000))])
            probe = keys[n // 2:n // 2 + 16]
            kv.match(probe)  # this process's first look at the namespace maps it
            s0 = _syscalls()
            with cost_of(sqlite_db) as c:
                assert kv.match(probe) == 16
                assert kv.contains(probe) == [True] * 16
                got = kv.get(probe)
            s1 = _syscalls()
            assert torch.equal(got[3], torch.full((256,), float(n // 2 + 3)))
            e0 = _syscalls()
            e1 = _syscalls()  # what reading the counters itself costs
            c.work["syscalls"] = sum(s1) - sum(s0) - (sum(e1) - sum(e0))
            costs.append(c)
        finally:
            kv.destroy()
    small, big = costs
    for c in (small, big):
        assert c.statements == []
        assert c["syscalls"] == 0
        assert c["rows_built"] == c["bytes_copied"] == 0
    assert big["bytes_hashed"] == small["bytes_hashed"]  # the 16 blocks' checksums
    assert big.faults <= small.faults + 16


def _growth_moves(root: Path, blocks: int) -> dict[str, int]:
    """Fill a fresh KV index with ``blocks`` live blocks, 64 a batch, and count what
    each batch moved of a growth's old table (``buckets_to_move`` before and after), and
    the bytes of the index's files each batch allocated (the next table and the records'
    room, made ahead in steps)."""
    import numpy as np

    def index_bytes() -> int:
        return sum(p.stat().st_blocks * 512 for p in root.iterdir() if p.is_file())

    store = se.BlockStore(root, capacity_bytes=blocks * 512 + (8 << 20), slab_bytes=4 << 20)
    try:
        buf = np.ones(500, np.uint8)
        st = store.index_stats()
        cap, left = st["record_capacity"], st["buckets_to_move"]
        most = growths = unfinished = most_made = 0
        had = index_bytes()
        for lo in range(0, blocks, 64):
            keys = [b"g" + i.to_bytes(4, "little") for i in range(lo, min(blocks, lo + 64))]
            store.put(keys, [buf] * len(keys))
            now = index_bytes()
            most_made, had = max(most_made, now - had), now
            st = store.index_stats()
            if st["record_capacity"] != cap:  # a growth: the old table's buckets wait
                growths += 1
                unfinished += left != 0  # a move the growth had to finish at once
                moved = cap * 2 - st["buckets_to_move"]  # the old table has 2 x cap
            else:
                moved = left - st["buckets_to_move"]
            most = max(most, moved)
            cap, left = st["record_capacity"], st["buckets_to_move"]
        assert store.match([b"g" + i.to_bytes(4, "little") for i in range(blocks)]) == blocks
        assert store._ix.check() == []
        return {"most_moved": most, "growths": growths, "unfinished": unfinished,
                "most_made": most_made}
    finally:
        store.close()


def test_a_kv_table_grows_a_few_buckets_at_a_time(tmp_path: Path) -> None:
    """The KV table grows incrementally: a growth moves no bucket, and each batch moves
    at most REHASH_STEP (4) buckets of the old table a record it makes, at 1,000 and at
    100,000 blocks alike; the move is over before the next growth, which never has to
    finish one at once (an O(n) step under the lock). The files a growth needs are made
    ahead in steps: no batch allocates more than one step (8 MiB) of them, although the
    last growth at 100,000 blocks needs 46 MiB (2^18 records and 2^19 buckets)."""
    small = _growth_moves(tmp_path / "small", 1_000)
    big = _growth_moves(tmp_path / "big", 100_000)
    assert (small["growths"], big["growths"]) == (2, 9)  # 256 records, doubled to 2^17
    for c in (small, big):
        assert 0 < c["most_moved"] <= 4 * 64
        assert c["unfinished"] == 0
    assert 0 < big["most_made"] <= 8 << 20


_FILL_CODE = """
import sys, torch, tensordb
db = tensordb.connect(home=sys.argv[1], data_dir=sys.argv[1] + "/data")
kv = tensordb.KVCache(db, "fill", block_tokens=4, capacity_bytes=512 << 20,
                      slab_bytes=64 << 20)
blocks = [torch.full((1 << 18,), float(i)) for i in range(64)]  # 64 x 1 MiB a batch
for b in range(int(sys.argv[2])):
    keys = kv.keys(list(range(b * 256, (b + 1) * 256)))
    kv.put(keys, blocks)
print("done", flush=True)
kv.destroy(); db.close()
import shutil; shutil.rmtree(db.config.shm_dir, ignore_errors=True)  # its pool too
"""


def test_filling_a_kv_arena_maps_each_new_slab_once(tmp_path: Path) -> None:
    """Puts of new 1 MiB blocks, 64 a batch, into a fresh 512 MiB namespace with 64 MiB
    slabs: the shared mappings the KV puts make (strace) are the slabs they create (7
    for 7 batches more) and at most one growth of the index (two maps: its new table and
    the records file's extension), beside what a process's
    start and its first put map. Only MAP_SHARED calls are counted: the anonymous ones
    are the allocator's and the interpreter's, and their number moves from run to run."""
    import shutil
    import subprocess
    import sys

    if shutil.which("strace") is None:
        pytest.skip("strace is not installed")

    def shared_maps(batches: int) -> tuple[int, int]:
        home = tmp_path / f"b{batches}"
        out = subprocess.run(["strace", "-f", "-e", "trace=mmap", "-o",
                              str(home) + ".strace", sys.executable, "-c", _FILL_CODE,
                              str(home), str(batches)], capture_output=True, text=True,
                             timeout=600, check=True)
        assert "done" in out.stdout
        calls = [line for line in Path(str(home) + ".strace").read_text().splitlines()
                 if "mmap(" in line and "MAP_SHARED" in line]
        slabs = sum(1 for line in calls if f"mmap(NULL, {64 << 20}," in line)
        return len(calls), slabs

    base, base_slabs = shared_maps(1)
    full, full_slabs = shared_maps(8)  # 512 MiB: every slab of the arena made
    assert (base_slabs, full_slabs) == (1, 8)
    assert 7 <= full - base <= 9


_OBSERVE_CODE = """
import json, sys
from pathlib import Path
import storage_engine as se
FILE_EVENTS = {"open", "mmap.__new__", "os.listdir", "os.scandir", "os.replace",
               "os.rename", "os.remove", "fcntl.flock", "os.truncate"}
seen = []
sys.addaudithook(lambda event, args: seen.append(event) if event in FILE_EVENTS else None)
log = se.LatencyLog(Path(sys.argv[1]))
out = {}
for label, n in (("first", 1), ("next", 1), ("many", int(sys.argv[2]))):
    seen.clear()
    for _ in range(n):
        log.observe("commit", 0.003)
    out[label] = sorted(seen)
log.release()
seen.clear()
log.observe("read", 0.001)
out["after_release"] = sorted(seen)
print(json.dumps(out))
"""


@pytest.mark.parametrize("n", [100, 10_000])
def test_a_latency_observation_touches_no_file_after_the_first(tmp_path: Path, n: int
                                                               ) -> None:
    """The hot path of every commit, read and pull (storage_engine.LatencyLog.observe):
    after a process's first observation maps its file, an observation is a lock and
    three stores into that mapping, with no open, map, scan, rename or lock of a file,
    at 100 observations or 10,000 (audit events of the interpreter, counted in a child
    process). The first maps one file; one after ``release`` maps it again."""
    import json
    import subprocess
    import sys

    root = tmp_path / "metrics"
    root.mkdir()
    out = subprocess.run([sys.executable, "-c", _OBSERVE_CODE, str(root), str(n)],
                         capture_output=True, text=True, timeout=120, check=True)
    got = json.loads(out.stdout)
    assert got["first"].count("mmap.__new__") == 1 and "fcntl.flock" in got["first"]
    assert got["next"] == [] and got["many"] == []
    assert got["after_release"].count("mmap.__new__") == 1


def test_a_scoped_segment_check_costs_its_segments_not_their_tensors(
        sized: tensordb.Database) -> None:
    """What a node asks the catalog before it serves a scoped token segment bytes
    (``NodeDirectory.segment_collections``): one statement over the segments asked, the
    same for a segment of SMALL tensors as for one of BIG, never a walk of the rows that
    point into it."""
    from tensordb.catalog import NodeDirectory

    directory = NodeDirectory(sized.catalog.engine)

    def check(db: tensordb.Database, n: int) -> None:
        ids = [r["segment"] for r in db.query(
            "SELECT segment FROM extents WHERE collection = :c", {"c": f"c{n}"}).to_pylist()]
        assert ids
        with cost_of(db) as c:
            got = directory.segment_collections(ids[:1])
        assert got == {ids[0]: {f"c{n}"}}
        costs.append(c)

    costs: list[Cost] = []
    for n in (SMALL, BIG):
        check(sized, n)
    small, big = costs
    for c in (small, big):
        assert [q for q in c.statements if q.startswith("SELECT")] == [
            "SELECT segments.id, collections.name FROM segments JOIN collections ON "
            "collections.id = segments.collection_id WHERE segments.id IN (?)"]
    assert_flat(small, big)
