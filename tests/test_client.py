"""The client API contract (DESIGN.md section 3) on every catalog backend."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from conftest import flip_byte

import tensordb
from tensordb.errors import (
    CommitConflict,
    InvalidInput,
    NotFound,
    StoreClosed,
    TensorDBError,
)

DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
          torch.uint16, torch.uint32, torch.uint64, torch.float16, torch.bfloat16,
          torch.float32, torch.float64, torch.complex64, torch.complex128,
          torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz]


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _sample(dtype: torch.dtype, shape: tuple[int, ...] = (3, 5)) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    raw = torch.randint(0, 256, (int(np.prod(shape)) * dtype.itemsize,), dtype=torch.uint8,
                        generator=g)
    if dtype == torch.bool:
        return (raw[: int(np.prod(shape))] % 2).bool().reshape(shape)
    return raw.view(dtype).reshape(shape)


def _snapshot_state(db: tensordb.Database) -> tuple:
    """Everything a reader can see, to check a failed call changed nothing."""
    out = []
    for c in db.collections():
        hist = db.history(c)
        with db.snapshot(c) as s:
            out.append((c, [h.version for h in hist],
                        {n: _bytes(t) for n, t in s.state_dict().items()}, db.tags(c)))
    return tuple(out)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_roundtrips_bit_exact(db: tensordb.Database, dtype: torch.dtype) -> None:
    tensors = {"m": _sample(dtype), "scalar": _sample(dtype, ()), "empty": _sample(dtype, (0, 4))}
    db.commit("dt", tensors)
    with db.snapshot("dt") as s:
        got = s.state_dict()
    for name, t in tensors.items():
        assert got[name].dtype == dtype and got[name].shape == t.shape
        assert _bytes(got[name]) == _bytes(t)


def test_numpy_in_torch_out_and_noncontiguous(db: tensordb.Database) -> None:
    a = np.arange(24, dtype=np.float64).reshape(4, 6)
    nc = torch.arange(30, dtype=torch.float32).reshape(5, 6).t()
    db.commit("np", {"a": a, "nc": nc, "rev": a[::-1], "bigendian": a.astype(">i4")})
    assert torch.equal(db.get("np", "a"), torch.from_numpy(a))
    assert torch.equal(db.get("np", "nc"), nc)
    assert db.get("np", "nc").is_contiguous()
    assert torch.equal(db.get("np", "rev"), torch.from_numpy(a[::-1].copy()))
    assert torch.equal(db.get("np", "bigendian"), torch.from_numpy(a.astype(np.int32)))


def test_reads_are_zero_copy_and_copy_on_write(db: tensordb.Database) -> None:
    db.commit("z", {"w": torch.ones(1000)})
    a = db.get("z", "w")
    # the tensor's memory is a mapping of the store's shared-memory segment: no copy
    with open("/proc/self/maps") as fh:
        maps = fh.read()
    seg_lines = [ln for ln in maps.splitlines() if str(db.config.shm_dir) in ln]
    ptr = a.data_ptr()
    assert any(int(ln.split()[0].split("-")[0], 16) <= ptr < int(ln.split()[0].split("-")[1], 16)
               for ln in seg_lines)
    a[:10] = 42.0  # a reader's write: private to the reader, never reaches the store
    with db.snapshot("z") as s:
        assert float(s["w"].sum()) == 1000.0
    assert float(db.get("z", "w", verify=True).sum()) == 1000.0


def test_versions_are_consecutive_and_unchanged_tensors_share(db: tensordb.Database) -> None:
    sd = {f"t{i}": torch.full((256,), float(i)) for i in range(20)}
    c1 = db.commit("v", sd, message="one")
    sd2 = dict(sd)
    sd2["t7"] = torch.zeros(256)
    c2 = db.commit("v", sd2, message="two")
    assert (c1.version, c2.version) == (1, 2)
    assert c1.written == 20 and c2.written == 1
    assert c2.written_nbytes == 256 * 4 and c2.nbytes == 20 * 256 * 4
    with db.snapshot("v", version=1) as s1, db.snapshot("v") as s2:
        assert s2.version == 2
        assert float(s1["t7"][0]) == 7.0 and float(s2["t7"][0]) == 0.0
        assert s1["t3"].data_ptr() - s1["t0"].data_ptr() == s2["t3"].data_ptr() - s2["t0"].data_ptr()
    cid = db.catalog.require("v").id
    rows1 = {r.name: r for r in db.catalog.manifest(cid, 1)}
    rows2 = {r.name: r for r in db.catalog.manifest(cid, 2)}
    assert (rows1["t3"].segment_id, rows1["t3"].offset) == (rows2["t3"].segment_id, rows2["t3"].offset)
    assert rows1["t7"].segment_id != rows2["t7"].segment_id
    assert [c.version for c in db.history("v")] == [2, 1]
    assert db.history("v")[0].message == "two"


def test_unchanged_detection_is_exact_beyond_the_sampled_bytes(db: tensordb.Database) -> None:
    # a changed tensor is told apart from the head's by a few sampled bytes first (start,
    # middle, end); one whose change lies elsewhere must still be stored, and an equal
    # one still shared
    base = torch.arange(4096, dtype=torch.float32)
    db.commit("s", {"same": base.clone(), "inner": base.clone(), "edge": base.clone(),
                    "tiny": torch.ones(3)})
    inner = base.clone()
    inner[100] = -1.0  # away from bytes 0..63, the middle 64 and the last 64
    edge = base.clone()
    edge[-1] = -1.0
    c = db.commit("s", {"same": base.clone(), "inner": inner, "edge": edge,
                        "tiny": torch.ones(3)})
    assert c.written == 2 and c.nbytes == 3 * 4096 * 4 + 12
    with db.snapshot("s") as snap:
        assert torch.equal(snap["inner"], inner) and torch.equal(snap["edge"], edge)
    cid = db.catalog.require("s").id
    r1 = {r.name: r for r in db.catalog.manifest(cid, 1)}
    r2 = {r.name: r for r in db.catalog.manifest(cid, 2)}
    assert r1["same"].segment_id == r2["same"].segment_id
    assert r1["tiny"].segment_id == r2["tiny"].segment_id
    assert r1["inner"].segment_id != r2["inner"].segment_id


def test_host_commits_skip_the_catalog_fsync_disk_commits_keep_it(
        db: tensordb.Database) -> None:
    from sqlalchemy import event

    if db._engine.dialect.name != "sqlite":
        pytest.skip("the synchronous pragma is the embedded catalog's")
    seen: list[str] = []

    def on_exec(conn, cursor, statement, *rest):  # type: ignore[no-untyped-def]
        if statement.startswith("PRAGMA synchronous"):
            seen.append(statement)

    event.listen(db._engine, "before_cursor_execute", on_exec)
    try:
        db.commit("d", {"a": torch.ones(4)}, tier="host")
        host = list(seen)
        seen.clear()
        db.commit("d", {"a": torch.zeros(4)}, tier="disk")
        disk = list(seen)
    finally:
        event.remove(db._engine, "before_cursor_execute", on_exec)
    assert host == ["PRAGMA synchronous=NORMAL"]
    assert disk == [f"PRAGMA synchronous={db.config.sqlite_synchronous.upper()}"]


def test_prefault_bad_sizes_rejected(db: tensordb.Database) -> None:
    for bad in (-1, "1", 1.5, True, None):
        with pytest.raises(InvalidInput, match="nbytes"):
            db.prefault(bad)  # type: ignore[arg-type]
    db.prefault(0)  # nothing to do
    db.prefault(1000)
    c = db.commit("p", {"t": torch.ones(250)})  # fits the spare
    assert c.written == 1


def test_transaction_put_delete_and_abort(db: tensordb.Database) -> None:
    with db.transaction("tx", message="m") as tx:
        tx.put("a", torch.ones(2))
        tx.put_many({"b": torch.zeros(3), "c": torch.ones(1)})
    assert tx.result is not None and tx.result.tensors == 3
    with db.transaction("tx") as tx:
        tx.delete("c")
        tx.put("d", torch.ones(4))
    assert tx.result.version == 2
    with db.snapshot("tx") as s:
        assert sorted(s) == ["a", "b", "d"]
    with pytest.raises(RuntimeError):
        with db.transaction("tx") as tx3:
            tx3.put("e", torch.ones(1))
            raise RuntimeError("boom")
    assert tx3.result is None
    assert db.history("tx")[0].version == 2
    with pytest.raises(InvalidInput):
        tx3.put("f", torch.ones(1))


def test_conflict_on_same_names_and_disjoint_changes_land(db: tensordb.Database) -> None:
    db.commit("cc", {"a": torch.zeros(2), "b": torch.zeros(2)})
    t1 = db.transaction("cc").__enter__()
    t2 = db.transaction("cc").__enter__()
    t3 = db.transaction("cc").__enter__()
    t1.put("a", torch.ones(2))
    t2.put("b", torch.ones(2))
    t3.put("a", torch.full((2,), 3.0))
    t1.__exit__(None, None, None)
    t2.__exit__(None, None, None)  # disjoint: lands on top of t1
    with pytest.raises(CommitConflict) as info:
        t3.__exit__(None, None, None)
    assert info.value.names == ["a"] and info.value.collection == "cc"
    assert "'a'" in str(info.value)
    assert db.history("cc")[0].version == 3
    with db.snapshot("cc") as s:
        assert float(s["a"][0]) == 1.0 and float(s["b"][0]) == 1.0
    assert db.gc().orphans_reclaimed == 0  # the loser's bytes were removed at once
    assert len(list(db.tier("host").segments())) == db.stats()["segments"]


def _open_two(db: tensordb.Database, name: str) -> tuple[tensordb.Transaction,
                                                           tensordb.Transaction]:
    """Two transactions of ``name`` that start from the same head (the base)."""
    return db.transaction(name).__enter__(), db.transaction(name).__enter__()


def test_a_put_of_a_name_deleted_after_the_base_conflicts(db: tensordb.Database) -> None:
    # only the deleted row's end_version says that "a" moved: no row of it starts later
    db.commit("cd", {"a": torch.zeros(2), "b": torch.zeros(2)})
    deleter, writer = _open_two(db, "cd")
    deleter.delete("a")
    writer.put("a", torch.ones(2))
    deleter.__exit__(None, None, None)
    with pytest.raises(CommitConflict) as info:
        writer.__exit__(None, None, None)
    assert info.value.names == ["a"] and (info.value.base, info.value.head) == (1, 2)
    with db.snapshot("cd") as s:
        assert sorted(s) == ["b"]  # the deleted tensor does not come back
    assert db.history("cd")[0].version == 2


def test_a_delete_of_a_name_changed_after_the_base_conflicts(db: tensordb.Database) -> None:
    db.commit("cd", {"a": torch.zeros(2), "b": torch.zeros(2)})
    writer, deleter = _open_two(db, "cd")
    writer.put("a", torch.ones(2))
    deleter.delete("a")
    writer.__exit__(None, None, None)
    with pytest.raises(CommitConflict) as info:
        deleter.__exit__(None, None, None)
    assert info.value.names == ["a"]
    with db.snapshot("cd") as s:  # the newer value stands, not deleted unseen
        assert sorted(s) == ["a", "b"] and float(s["a"][0]) == 1.0
    assert db.history("cd")[0].version == 2


def test_an_unchanged_put_of_a_name_changed_after_the_base_conflicts(
        db: tensordb.Database) -> None:
    # the late put equals the head's bytes, so dedupe drops it from the rows it writes;
    # it still read a base where "a" differed, and must not land as if it saw the change
    db.commit("cd", {"a": torch.zeros(2), "b": torch.zeros(2)})
    first, second = _open_two(db, "cd")
    first.put("a", torch.ones(2))
    second.put_many({"a": torch.ones(2), "c": torch.ones(3)})
    first.__exit__(None, None, None)
    with pytest.raises(CommitConflict) as info:
        second.__exit__(None, None, None)
    assert info.value.names == ["a"]
    with db.snapshot("cd") as s:
        assert sorted(s) == ["a", "b"]  # nothing of the loser landed
    assert db.history("cd")[0].version == 2


def test_disjoint_deletes_and_puts_land_after_the_base_moved(db: tensordb.Database) -> None:
    db.commit("cd", {"a": torch.zeros(2), "b": torch.zeros(2), "c": torch.zeros(2)})
    first, second = _open_two(db, "cd")
    first.delete("a")
    second.delete("b")
    second.put("c", torch.zeros(2))  # unchanged, untouched by the first
    first.__exit__(None, None, None)
    second.__exit__(None, None, None)
    assert second.result is not None and second.result.version == 3
    with db.snapshot("cd") as s:
        assert sorted(s) == ["c"]


def test_a_conflict_over_many_names_shows_five_and_counts_the_rest(
        db: tensordb.Database) -> None:
    names = [f"w{i}" for i in range(7)]
    db.commit("cm", {n: torch.zeros(2) for n in names})
    first, second = _open_two(db, "cm")
    first.put_many({n: torch.ones(2) for n in names})
    second.put_many({n: torch.full((2,), 2.0) for n in names})
    first.__exit__(None, None, None)
    with pytest.raises(CommitConflict) as info:
        second.__exit__(None, None, None)
    assert info.value.names == names  # every name, in order
    message = str(info.value)
    assert "both changed 'w0', 'w1', 'w2', 'w3', 'w4' and 2 more" in message
    assert "'w5'" not in message
    # five names exactly: all shown, no count
    db.commit("c5", {n: torch.zeros(2) for n in names[:5]})
    first, second = _open_two(db, "c5")
    first.put_many({n: torch.ones(2) for n in names[:5]})
    second.put_many({n: torch.full((2,), 2.0) for n in names[:5]})
    first.__exit__(None, None, None)
    with pytest.raises(CommitConflict) as info:
        second.__exit__(None, None, None)
    assert str(info.value).endswith("both changed 'w0', 'w1', 'w2', 'w3', 'w4'")


def test_the_catalog_refuses_a_delete_of_a_name_its_head_lacks(db: tensordb.Database) -> None:
    # the client checks deletes against the base first; the catalog's own commit is the
    # last line (its callers include tools and benchmarks): NotFound, nothing published
    db.commit("cn", {"a": torch.zeros(2)})
    head = db.history("cn")[0].version
    with pytest.raises(NotFound) as info:
        db.catalog.commit("cn", head, [], unchanged=[], deletes=["a", "nope"], segment=None,
                          message=None)
    assert info.value.tensor == "nope" and info.value.collection == "cn"
    assert "'nope'" in str(info.value)
    assert db.history("cn")[0].version == head
    with db.snapshot("cn") as s:
        assert sorted(s) == ["a"]  # the delete of "a" rolled back with it
    # a delete as a new collection's first version: NotFound, and no collection
    with pytest.raises(NotFound) as info:
        db.catalog.commit("fresh", 0, [], unchanged=[], deletes=["x"], segment=None,
                          message=None)
    assert (info.value.collection, info.value.tensor) == ("fresh", "x")
    assert "fresh" not in db.collections()


def test_concurrent_threads_disjoint(db: tensordb.Database) -> None:
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            for j in range(5):
                db.commit("thr", {f"w{i}.{j}": torch.full((8,), float(i * 10 + j))})
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert not errors
    assert [c.version for c in db.history("thr")] == list(range(20, 0, -1))
    with db.snapshot("thr") as s:
        assert len(s) == 20 and float(s["w3.4"][0]) == 34.0


def test_tags_and_snapshot_by_tag(db: tensordb.Database) -> None:
    db.commit("tg", {"x": torch.zeros(1)})
    db.commit("tg", {"x": torch.ones(1)})
    assert db.tag("tg", "first", version=1) == 1
    assert db.tag("tg", "latest") == 2
    assert db.tags("tg") == {"first": 1, "latest": 2}
    with db.snapshot("tg", tag="first") as s:
        assert s.version == 1 and float(s["x"][0]) == 0.0
    assert float(db.get("tg", "x", tag="latest")[0]) == 1.0
    db.untag("tg", "latest")
    assert db.tags("tg") == {"first": 1}
    with pytest.raises(NotFound):
        db.snapshot("tg", tag="latest")


def test_retention_gc_keeps_tagged_and_leased(db: tensordb.Database) -> None:
    for v in range(1, 7):
        db.commit("ret", {"w": torch.full((4096,), float(v))})
    db.tag("ret", "keep", version=2)
    snap = db.snapshot("ret", version=3)
    db.set_retention("ret", 2)
    report = db.gc()
    assert report.dropped_versions == 2  # versions 1 and 4
    assert [c.version for c in db.history("ret")] == [6, 5, 3, 2]
    assert report.segments_deleted == 2 and report.bytes_freed >= 2 * 4096 * 4
    assert float(snap["w"][0]) == 3.0
    snap.close()
    report = db.gc()
    assert report.dropped_versions == 1
    assert [c.version for c in db.history("ret")] == [6, 5, 2]
    with pytest.raises(NotFound):
        db.snapshot("ret", version=3)
    assert db.verify() == []


def test_head_and_numbered_snapshots_lease_alike(db: tensordb.Database) -> None:
    # on SQLite the head is opened through the DBAPI cursor, a numbered version through
    # SQLAlchemy: both must take the same lease and read the same rows
    from sqlalchemy import select

    from tensordb.catalog.schema import leases

    db.commit("ls", {"a": torch.ones(3), "b": torch.zeros(2, 2)})
    db.commit("ls", {"a": torch.full((3,), 2.0)})
    head, numbered = db.snapshot("ls"), db.snapshot("ls", version=2)
    assert head.version == numbered.version == 2
    assert head._rows == numbered._rows and sorted(head) == ["a", "b"]
    with db.catalog.engine.connect() as conn:
        rows = conn.execute(select(leases.c.version, leases.c.holder, leases.c.created_at,
                                   leases.c.expires_at)).all()
    assert len(rows) == 2 and {r[0] for r in rows} == {2} and len({r[1] for r in rows}) == 1
    for _, _, created, expires in rows:
        assert created.tzinfo is not None and expires.tzinfo is not None
        assert abs((expires - created).total_seconds() - db.config.lease_ttl) < 1e-3
    assert {float(t[0]) for t in (head["a"], numbered["a"])} == {2.0}
    head.close()
    numbered.close()
    assert db.catalog.lease_holders() == []


def test_tensor_stays_valid_whatever_gc_does(db: tensordb.Database) -> None:
    db.commit("held", {"w": torch.arange(10000, dtype=torch.float32)})
    t = db.get("held", "w")
    db.drop("held")
    report = db.gc()
    assert report.segments_deleted == 1
    db.commit("other", {"w": torch.zeros(10000)})  # new bytes, possibly the same memory
    assert torch.equal(t, torch.arange(10000, dtype=torch.float32))
    assert db.collections() == ["other"]
    with pytest.raises(NotFound):
        db.get("held", "w")


def test_disk_tier(db: tensordb.Database) -> None:
    db.commit("dk", {"w": torch.arange(100)}, tier="disk")
    files = list(db.tier("disk").segments())
    assert len(files) == 1 and list(db.tier("host").segments()) == []
    assert torch.equal(db.get("dk", "w", verify=True), torch.arange(100))


def test_watch_delivers_new_commits_in_order(db: tensordb.Database) -> None:
    db.commit("wt", {"a": torch.zeros(1)})
    got: list[int] = []

    def writer() -> None:
        for i in range(3):
            db.commit("wt", {"a": torch.full((1,), float(i))})

    th = threading.Thread(target=writer)
    th.start()
    for c in db.watch("wt", after=1, timeout=5):
        got.append(c.version)
        if c.version == 4:
            break
    th.join()
    assert got == [2, 3, 4]


def test_flipped_byte_is_caught(db: tensordb.Database) -> None:
    db.commit("cor", {"a": torch.ones(1024), "b": torch.zeros(1024)})
    (sid,) = list(db.tier("host").segments())
    path = db.tier("host").path(sid)
    flip_byte(path, 10)
    problems = db.verify()
    assert [(p.collection, p.tensor) for p in problems] == [("cor", "a")]
    with pytest.raises(tensordb.errors.CorruptData) as info:
        db.get("cor", "a", verify=True)
    assert info.value.tensor == "a"
    with pytest.raises(tensordb.errors.CorruptData):
        db.snapshot("cor", verify=True).state_dict()
    assert torch.equal(db.get("cor", "b", verify=True), torch.zeros(1024))


BAD_NAMES = ["", "   ", "../x", "/abs", "a/../b", "a//b", "x/", "a\\b", "bad\x00name", "tab\tname",
             "a\udc80", "\ud800x", "ok/\udfff/b"]


@pytest.mark.parametrize("name", BAD_NAMES, ids=repr)
def test_bad_names_rejected_store_unchanged(db: tensordb.Database, name: str) -> None:
    db.commit("ok", {"a": torch.ones(2)})
    before = _snapshot_state(db)
    calls = [lambda: db.commit("ok", {name: torch.ones(2)}),
             lambda: db.commit(name, {"a": torch.ones(2)}),
             lambda: db.tag("ok", name)]
    for call in calls:
        with pytest.raises(InvalidInput) as info:
            call()
        assert repr(name) in str(info.value) or not name.strip()  # names the culprit
    assert _snapshot_state(db) == before


@pytest.mark.parametrize("value", [
    [1.0, 2.0], 3.0, "tensor", None, np.array(["a", "b"]), np.array([object()]),
    torch.ones(2).to_sparse(),
    torch.empty(2, device="meta"),
], ids=lambda v: type(v).__name__ if not isinstance(v, torch.Tensor) else str(v.layout) + str(v.dtype) + str(v.device))
def test_bad_tensors_rejected_store_unchanged(db: tensordb.Database, value: object) -> None:
    db.commit("ok", {"a": torch.ones(2)})
    before = _snapshot_state(db)
    with pytest.raises(InvalidInput) as info:
        db.commit("ok", {"good": torch.ones(1), "bad": value})
    assert info.value.tensor == "bad" and info.value.collection == "ok"
    assert _snapshot_state(db) == before


def test_unknown_things_are_not_found(db: tensordb.Database) -> None:
    db.commit("nf", {"a": torch.ones(2)})
    before = _snapshot_state(db)
    cases = [
        lambda: db.get("missing", "a"),
        lambda: db.get("nf", "missing"),
        lambda: db.get("nf", "a", version=99),
        lambda: db.get("nf", "a", tag="nope"),
        lambda: db.snapshot("missing"),
        lambda: db.snapshot("nf", version=2),
        lambda: db.history("missing"),
        lambda: db.tag("nf", "t", version=5),
        lambda: db.drop("missing"),
        lambda: db.untag("nf", "nope"),
        lambda: db.set_retention("missing", 3),
    ]
    for case in cases:
        with pytest.raises(NotFound) as info:
            case()
        assert isinstance(info.value, KeyError) and isinstance(info.value, TensorDBError)
        assert info.value.collection in ("nf", "missing")
    with pytest.raises(NotFound) as info:
        with db.transaction("nf") as tx:
            tx.delete("ghost")
    assert info.value.tensor == "ghost"
    assert _snapshot_state(db) == before


def test_other_bad_arguments(db: tensordb.Database) -> None:
    db.commit("arg", {"a": torch.ones(2)})
    before = _snapshot_state(db)
    with pytest.raises(InvalidInput):
        db.get("arg", "a", version="1")  # type: ignore[arg-type]
    with pytest.raises(InvalidInput):
        db.get("arg", "a", version=1, tag="x")
    with pytest.raises(InvalidInput):
        db.commit("arg", {"a": torch.ones(2)}, tier="tape")
    with pytest.raises(InvalidInput):
        db.set_retention("arg", 0)
    with pytest.raises(InvalidInput):
        db.commit("arg", {"a": torch.ones(2)}, metadata={"k": 1})  # type: ignore[dict-item]
    with pytest.raises(InvalidInput):
        db.commit("arg", {"a": torch.ones(2)}, message=5)  # type: ignore[arg-type]
    with pytest.raises(InvalidInput):
        db.transaction("arg").put("a", torch.ones(1))  # outside a with block
    assert _snapshot_state(db) == before


@pytest.mark.parametrize(("message", "metadata", "says"), [
    ("x\x00y", None, "the commit message contains a NUL character (at position 1)"),
    ("x\udc80", None, "the commit message is not valid Unicode (lone surrogate at position 1)"),
    (None, {"k\x00": "v"}, "metadata key 'k\\x00' contains a NUL character (at position 1)"),
    (None, {"k": "\x00"}, "the metadata value of 'k' contains a NUL character (at position 0)"),
    (None, {"\ud800": "v"}, "metadata key '\\ud800' is not valid Unicode"),
    (None, {"k": "v\udfff"}, "the metadata value of 'k' is not valid Unicode"),
], ids=["nul-message", "surrogate-message", "nul-key", "nul-value", "surrogate-key",
        "surrogate-value"])
def test_commit_text_the_catalog_cannot_keep_rejected_store_unchanged(
        db: tensordb.Database, message: str | None, metadata: dict[str, str] | None,
        says: str) -> None:
    db.commit("txt", {"a": torch.ones(2)})
    before = _snapshot_state(db)
    with pytest.raises(InvalidInput) as info:
        db.commit("txt", {"a": torch.zeros(2)}, message=message, metadata=metadata)
    assert str(info.value).startswith(says) and info.value.collection == "txt"
    with pytest.raises(InvalidInput):
        db.commit("new", {"a": torch.zeros(2)}, message=message, metadata=metadata)
    assert _snapshot_state(db) == before
    assert db.commit("txt", {"a": torch.zeros(2)}, message="ok \u00e9",
                     metadata={"k\u00e9": "v"}).version == 2  # other text is fine


@pytest.mark.parametrize("version", [0, -1, 2**63, 10**30, -(2**64)])
def test_out_of_range_versions_rejected_store_unchanged(db: tensordb.Database,
                                                        version: int) -> None:
    """A version outside 1 .. 2**63-1 (the catalog's int64) can name nothing: refused with
    InvalidInput naming it, on every path that resolves a version; one in range that does
    not exist stays NotFound."""
    db.commit("rng", {"a": torch.ones(2)})
    before = _snapshot_state(db)
    cases = [
        lambda: db.get("rng", "a", version=version),
        lambda: db.snapshot("rng", version=version),
        lambda: db.tag("rng", "t", version=version),
        lambda: db.pin("rng", version=version),
        lambda: db.evict("rng", version=version),
    ]
    for case in cases:
        with pytest.raises(InvalidInput) as info:
            case()
        assert str(info.value) == f"version must be between 1 and 2**63-1, not {version}"
        assert info.value.collection == "rng"
    with pytest.raises(NotFound):
        db.get("rng", "a", version=2**63 - 1)
    assert _snapshot_state(db) == before


def test_closed_store_and_snapshot(db: tensordb.Database) -> None:
    db.commit("cl", {"a": torch.ones(2)})
    snap = db.snapshot("cl")
    t = snap["a"]
    snap.close()
    with pytest.raises(StoreClosed):
        snap["a"]
    db.close()
    for call in (lambda: db.get("cl", "a"), lambda: db.commit("cl", {"a": torch.ones(1)}),
                 lambda: db.collections(), lambda: db.gc()):
        with pytest.raises(StoreClosed):
            call()
    assert float(t.sum()) == 2.0  # handed-out tensors outlive the store handle


def test_drop_and_collections(db: tensordb.Database) -> None:
    db.commit("b", {"a": torch.ones(2)})
    db.commit("a", {"a": torch.ones(2)})
    assert db.collections() == ["a", "b"]
    db.drop("b")
    assert db.collections() == ["a"]
    assert db.gc().segments_deleted == 1
    db.commit("b", {"a": torch.zeros(2)})
    assert [c.version for c in db.history("b")] == [1]


def test_commit_metadata_kept(db: tensordb.Database) -> None:
    c = db.commit("meta", {"a": torch.ones(2)}, metadata={"format": "pt"})
    assert c.metadata == {"format": "pt"}
    assert db.history("meta")[0].metadata == {"format": "pt"}


def test_store_full(store_home, catalog_url) -> None:  # type: ignore[no-untyped-def]
    from conftest import open_store, remove_store

    db = open_store(store_home, catalog_url, host_capacity=1 << 20)
    try:
        db.commit("f", {"a": torch.zeros(100_000)})
        before = _snapshot_state(db)
        with pytest.raises(tensordb.errors.StoreFull):
            db.commit("f", {"b": torch.zeros(300_000)})
        assert _snapshot_state(db) == before
        db.commit("f", {"b": torch.zeros(300_000)}, tier="disk")
    finally:
        remove_store(db)


def test_public_surface() -> None:
    import storage_engine

    assert set(tensordb.__all__) >= {"connect", "Database", "Transaction", "Snapshot", "Commit",
                                     "errors"}
    assert set(tensordb.errors.__all__) >= {
        "TensorDBError", "NotFound", "InvalidInput", "CommitConflict", "StoreFull",
        "CorruptData", "QueryError", "Unauthorized", "NodeUnavailable"}
    for mod in (tensordb, tensordb.errors, storage_engine):
        for name in mod.__all__:
            assert hasattr(mod, name), name
    assert issubclass(tensordb.errors.NotFound, KeyError)
    assert issubclass(tensordb.errors.InvalidInput, ValueError)


def test_put_raw_fills_the_extent_in_place(db: tensordb.Database, tmp_path) -> None:  # type: ignore[no-untyped-def]
    import os

    data = torch.arange(1000, dtype=torch.float32)
    path = tmp_path / "raw.bin"
    path.write_bytes(data.numpy().tobytes())
    seen: list[int] = []

    def fill(dst: np.ndarray) -> None:
        seen.append(dst.size)
        fd = os.open(path, os.O_RDONLY)
        try:
            assert os.preadv(fd, [dst], 0) == dst.size
        finally:
            os.close(fd)

    with db.transaction("raw") as tx:
        tx.put_raw("w", "float32", (10, 100), fill)
        tx.put_raw("empty", torch.int8, (0,), fill)
    assert seen == [4000]  # the empty tensor has no bytes to fill
    assert torch.equal(db.get("raw", "w", verify=True), data.reshape(10, 100))
    assert db.get("raw", "empty").shape == (0,)
    with pytest.raises(InvalidInput):
        with db.transaction("raw") as tx:
            tx.put_raw("x", "float128", (1,), fill)
    with pytest.raises(InvalidInput):
        with db.transaction("raw") as tx:
            tx.put_raw("x", "float32", (-1,), fill)
    with pytest.raises(RuntimeError):
        with db.transaction("raw") as tx:
            tx.put_raw("bad", "float32", (4,), lambda dst: (_ for _ in ()).throw(RuntimeError("io")))
    assert [c.version for c in db.history("raw")] == [1]
    assert db.gc().orphans_reclaimed == 0 and db.verify() == []


def test_snapshot_read_into_fills_caller_buffers(db: tensordb.Database) -> None:
    # large enough to be read in several pieces on the I/O pool, plus odd sizes and dtypes
    sd = {"big": torch.randn(5_000_000),
          "half": torch.randn(33, 17).to(torch.bfloat16),
          "flags": torch.tensor([True, False, True]),
          "scalar": torch.tensor(3.5, dtype=torch.float64),
          "empty": torch.empty(0, 4)}
    db.commit("ri", sd)
    outs = {n: torch.zeros_like(t) for n, t in sd.items()}
    with db.snapshot("ri", verify=True) as snap:
        n = snap.read_into(outs)
        assert snap.read_into({"half": outs["half"]}) == sd["half"].nbytes
    assert n == sum(t.nbytes for t in sd.values())
    for name, t in sd.items():
        assert torch.equal(outs[name], t), name


def test_snapshot_read_into_bad_buffers_write_nothing(db: tensordb.Database) -> None:
    db.commit("rb", {"a": torch.ones(8), "b": torch.ones(2, 3)})
    with db.snapshot("rb") as snap:
        good = torch.zeros(8)
        cases = [({"a": good, "zz": torch.zeros(8)}, NotFound),
                 ({"a": good, "b": torch.zeros(3, 2)}, InvalidInput),
                 ({"a": good, "b": torch.zeros(2, 3, dtype=torch.float64)}, InvalidInput),
                 ({"a": good, "b": torch.zeros(3, 2).t()}, InvalidInput),
                 ({"a": good, "b": [0.0] * 6}, InvalidInput),
                 ([good], InvalidInput)]
        for outs, err in cases:
            with pytest.raises(err):
                snap.read_into(outs)  # type: ignore[arg-type]
            assert torch.equal(good, torch.zeros(8))  # untouched: checked before any read
    with pytest.raises(StoreClosed):
        snap.read_into({"a": good})


def test_snapshot_read_into_verifies(db: tensordb.Database) -> None:
    db.commit("rv", {"a": torch.ones(1024), "b": torch.zeros(1024)})
    (sid,) = list(db.tier("host").segments())
    flip_byte(db.tier("host").path(sid), 10)
    out = torch.empty(1024)
    with db.snapshot("rv") as snap:
        snap.read_into({"a": out})  # unverified: the flipped byte comes through
    assert not torch.equal(out, torch.ones(1024))
    with db.snapshot("rv", verify=True) as snap:
        with pytest.raises(tensordb.errors.CorruptData) as info:
            snap.read_into({"a": torch.empty(1024)})
        assert info.value.tensor == "a"
        b = torch.ones(1024)
        snap.read_into({"b": b})
        assert torch.equal(b, torch.zeros(1024))


def test_put_raw_fill_may_hand_back_its_checksum(db: tensordb.Database) -> None:
    import storage_engine as se

    data = torch.arange(300_000, dtype=torch.float32)  # several hash pieces
    raw = data.numpy().view(np.uint8)

    def fill(dst: np.ndarray) -> str:
        h = se.Hasher()
        for lo in range(0, raw.size, se.HASH_PIECE):
            dst[lo : lo + se.HASH_PIECE] = raw[lo : lo + se.HASH_PIECE]
            h.update(dst[lo : lo + se.HASH_PIECE])
        return h.hexdigest()

    def lying(dst: np.ndarray) -> str:
        dst[:] = raw
        return "0" * 16

    with db.transaction("hb") as tx:
        tx.put_raw("ok", "float32", (300_000,), fill)
        tx.put_raw("bad", "float32", (300_000,), lying)
    assert torch.equal(db.get("hb", "ok", verify=True), data)
    # the checksum handed back is what is recorded: a wrong one is caught on read
    assert [p.tensor for p in db.verify()] == ["bad"]
    with pytest.raises(tensordb.errors.CorruptData):
        db.get("hb", "bad", verify=True)


def test_put_raw_fill_hashes_with_the_transactions_hasher(db: tensordb.Database) -> None:
    """A fill needs no storage_engine import: ``tx.hasher()`` fed ``tx.hash_piece`` bytes at
    a time gives the checksum the store records for the bytes."""
    import storage_engine as se

    data = torch.arange(300_000, dtype=torch.float32)
    raw = data.numpy().view(np.uint8)
    with db.transaction("hh") as tx:
        piece = tx.hash_piece

        def fill(dst: np.ndarray) -> str:
            h = tx.hasher()
            for lo in range(0, raw.size, piece):
                dst[lo : lo + piece] = raw[lo : lo + piece]
                h.update(dst[lo : lo + piece])
            return h.hexdigest()

        tx.put_raw("w", "float32", (300_000,), fill)
    assert 0 < piece < raw.size  # several pieces
    with db.snapshot("hh") as snap:
        assert snap.extents()["w"][2] == se.checksum(raw)
    assert torch.equal(db.get("hh", "w", verify=True), data)
    assert db.verify() == []


def test_snapshot_read_into_follows_bytes_to_another_tier(db: tensordb.Database) -> None:
    sd = {"w": torch.randn(300, 700), "b": torch.arange(7, dtype=torch.int32)}
    db.commit("ev", sd)
    with db.snapshot("ev", verify=True) as snap:
        db.evict("ev")  # host -> disk while the snapshot holds the version
        outs = {n: torch.empty_like(t) for n, t in sd.items()}
        assert snap.read_into(outs) == sum(t.nbytes for t in sd.values())
    assert all(torch.equal(outs[n], t) for n, t in sd.items())
    with db.snapshot("ev") as snap:  # rows now name the disk tier
        out = torch.empty_like(sd["w"])
        snap.read_into({"w": out})
    assert torch.equal(out, sd["w"])


def test_sqlite_catalog_side_files_are_owner_only(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The WAL and shared-memory files SQLite creates beside the catalog are 0600 like the
    database itself, whatever the umask, also in a home directory that already exists."""
    import os
    import stat

    from conftest import open_store, remove_store

    home = tmp_path / "existing"
    home.mkdir(mode=0o755)
    old = os.umask(0o022)
    try:
        db = open_store(home)
    finally:
        os.umask(old)
    try:
        db.commit("perm", {"a": torch.ones(2)})
        files = [home / n for n in ("catalog.db", "catalog.db-wal", "catalog.db-shm")]
        assert {f.name: oct(stat.S_IMODE(f.stat().st_mode)) for f in files} == {
            f.name: "0o600" for f in files}
    finally:
        remove_store(db)
