"""Large collections: commits that cost what they change (counted in statements and
rows, not timed), packed manifests of large versions, the lazy state_dict, and the
batched copy of a commit's tensors."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import flip_byte
from hypothesis import given, settings
from hypothesis import strategies as st
from sqlalchemy import event

import storage_engine as se
import tensordb
from tensordb.catalog import CHUNK_ROWS, PACK_MIN_ROWS, _versions
from tensordb.client._inputs import _problem, check_name
from tensordb.errors import InvalidInput, NotFound

BIG = PACK_MIN_ROWS + 500  # packed, and above the temporary-table threshold for names


def model(n: int, value: float = 0.0) -> dict[str, torch.Tensor]:
    return {f"experts.{i:05d}.w": torch.full((4,), value + i) for i in range(n)}


@contextmanager
def statements(db: tensordb.Database) -> Iterator[list[tuple[str, int]]]:
    """(SQL text, how many values its parameters carry) of every statement the catalog
    runs in the block, on both of its SQL engines."""
    seen: list[tuple[str, int]] = []

    def size(params: Any) -> int:
        if isinstance(params, (list, tuple)):
            return sum(size(p) for p in params)
        if isinstance(params, dict):
            return sum(size(v) for v in params.values())
        return 1

    def record(conn: Any, cursor: Any, stmt: str, params: Any, context: Any,
               many: bool) -> None:
        seen.append((stmt, size(params)))

    engines = {id(e): e for e in (db.catalog.engine, db.catalog.lease_engine)}.values()
    for e in engines:
        event.listen(e, "before_cursor_execute", record)
    try:
        yield seen
    finally:
        for e in engines:
            event.remove(e, "before_cursor_execute", record)


def drain(db: tensordb.Database) -> None:
    """Wait for the manifests being packed in the background."""
    assert db.catalog.manifests is not None
    db.catalog.manifests.close()


def one_change_cost(db: tensordb.Database, n: int) -> tuple[list[str], int, int]:
    """Commit n tensors, then 1 changed: (its statements, the values they carried, the
    head rows it read)."""
    db.commit(f"c{n}", model(n))
    drain(db)
    read: list[int] = []
    live = db.catalog.live

    def counting_live(cid: int, names: Any = None) -> Any:
        got = live(cid, names)
        read.append(len(got))
        return got

    db.catalog.live = counting_live  # type: ignore[method-assign]
    try:
        with statements(db) as seen:
            c = db.commit(f"c{n}", {"experts.00001.w": torch.full((4,), -1.0)})
    finally:
        del db.catalog.live
    assert c.tensors == n and c.written == 1
    return [s for s, _ in seen], sum(k for _, k in seen), sum(read)


def test_a_one_tensor_commit_costs_the_same_in_any_collection(db: tensordb.Database) -> None:
    small_sql, small_values, small_rows = one_change_cost(db, 20)
    big_sql, big_values, big_rows = one_change_cost(db, BIG)
    assert big_sql == small_sql  # the same statements ...
    assert big_values == small_values  # ... carrying as many values ...
    assert small_rows == big_rows == 1  # ... and one head row read, not the whole head
    with db.snapshot(f"c{BIG}") as snap:
        assert torch.equal(snap["experts.00001.w"], torch.full((4,), -1.0))
        assert torch.equal(snap["experts.00002.w"], torch.full((4,), 2.0))
        assert len(snap) == BIG


def test_a_first_commit_reads_no_rows_and_inserts_in_one_statement(
        db: tensordb.Database, monkeypatch: pytest.MonkeyPatch) -> None:
    copies: list[int] = []  # PostgreSQL's COPY runs on the driver's cursor, unseen by events
    copy_rows = _versions._copy_rows
    monkeypatch.setattr(_versions, "_copy_rows",
                        lambda conn, cid, v, puts: (copies.append(len(puts)),
                                                    copy_rows(conn, cid, v, puts)))
    with statements(db) as seen:
        db.commit("fresh", model(BIG))
    on_tensors = [s for s, _ in seen if re.search(r"\b(INTO|FROM|UPDATE)\s+tensors\b", s)]
    inserts = [s for s in on_tensors if s.lstrip().upper().startswith("INSERT")]
    assert len(inserts) + len(copies) == 1
    assert copies == ([BIG] if db.catalog.engine.dialect.name == "postgresql" else [])
    assert not [s for s in on_tensors if s.lstrip().upper().startswith(("SELECT", "UPDATE"))]


def test_commits_of_many_names_check_deletes_and_conflicts(db: tensordb.Database) -> None:
    db.commit("m", model(BIG))
    with pytest.raises(NotFound) as info, db.transaction("m") as tx:
        for name in model(BIG):
            tx.put(name, torch.zeros(4))
        tx.delete("no.such.tensor")
    assert info.value.tensor == "no.such.tensor"
    assert db.history("m")[0].version == 1  # nothing published
    with db.transaction("m") as tx:  # every name replaced: k = n, through the temp table
        tx.put_many({n: t + 1 for n, t in model(BIG).items()})
        tx.delete("experts.00000.w")
    assert tx.result is not None
    assert tx.result.tensors == BIG - 1 and tx.result.written == BIG - 1
    with db.snapshot("m") as snap:
        assert "experts.00000.w" not in snap
        assert torch.equal(snap["experts.00007.w"], torch.full((4,), 8.0))


def test_a_large_version_opens_from_its_packed_manifest(db: tensordb.Database) -> None:
    db.commit("p", model(BIG))
    db.commit("p", {"experts.00003.w": torch.full((4,), -3.0)})  # derived from v1's file
    drain(db)
    assert db.catalog.manifests is not None
    assert len(list(db.catalog.manifests.root.glob("*.manifest"))) == 2
    with statements(db) as seen:
        snap = db.snapshot("p")
    assert not [s for s, _ in seen if "FROM tensors" in s]  # rows from the file
    with snap:
        sd = snap.state_dict()
        assert len(sd) == BIG
        assert torch.equal(sd["experts.00003.w"], torch.full((4,), -3.0))
        assert torch.equal(sd["experts.00004.w"], torch.full((4,), 4.0))
        assert snap.nbytes == BIG * 16
    with db.snapshot("p", version=1) as old:
        assert torch.equal(old["experts.00003.w"], torch.full((4,), 3.0))
        assert set(old.keys()) == set(model(BIG))


@pytest.mark.parametrize("damage", ["flip", "truncate", "remove"])
@pytest.mark.parametrize("part", ["list", "chunk"])
def test_a_damaged_packed_manifest_is_never_believed(db: tensordb.Database, damage: str,
                                                     part: str) -> None:
    db.commit("d", model(BIG))
    drain(db)
    assert db.catalog.manifests is not None
    root = db.catalog.manifests.root
    files = sorted(root.glob("*.manifest" if part == "list" else "*.chunk"))
    path = files[-1]
    size = path.stat().st_size
    if damage == "flip":
        flip_byte(path, size // 2)
    elif damage == "truncate":
        with open(path, "r+b") as fh:
            fh.truncate(size // 3)
    else:
        path.unlink()
    with db.snapshot("d") as snap:
        got = dict(snap.state_dict())
    assert len(got) == BIG
    assert all(torch.equal(got[n], t) for n, t in model(BIG).items())
    assert path.stat().st_size == size  # rebuilt from SQL by the opener
    with statements(db) as seen, db.snapshot("d"):
        pass
    assert not [s for s, _ in seen if "FROM tensors" in s]


def test_a_one_change_commit_writes_one_chunk_and_shares_the_rest(
        db: tensordb.Database) -> None:
    n = 3 * CHUNK_ROWS
    db.commit("s", model(n))
    drain(db)
    assert db.catalog.manifests is not None
    root = db.catalog.manifests.root
    before = set(root.glob("*.chunk"))
    assert len(before) == 3
    db.commit("s", {"experts.00005.w": torch.full((4,), -5.0)})  # in the first chunk
    db.commit("s", {"zzz.new": torch.zeros(2)}, )  # after the last name: the last chunk
    drain(db)
    made = set(root.glob("*.chunk")) - before
    assert len(made) == 2 and len(list(root.glob("*.manifest"))) == 3
    with db.snapshot("s") as snap:
        assert snap.keys()[-1] == "zzz.new" and len(snap) == n + 1
        assert torch.equal(snap["experts.00005.w"], torch.full((4,), -5.0))
        assert torch.equal(snap["experts.05000.w"], torch.full((4,), 5000.0))
    with db.snapshot("s", version=1) as old:
        assert torch.equal(old["experts.00005.w"], torch.full((4,), 5.0))
        assert "zzz.new" not in old


def test_gc_deletes_the_manifests_of_dropped_versions(db: tensordb.Database) -> None:
    db.commit("g", model(BIG))
    db.commit("g", model(BIG, 1.0))
    drain(db)
    assert db.catalog.manifests is not None
    assert len(list(db.catalog.manifests.root.glob("*.manifest"))) == 2
    chunks = list(db.catalog.manifests.root.glob("*.chunk"))
    for p in chunks:  # older than a writer's window between its chunks and its list
        os.utime(p, (p.stat().st_atime - 60, p.stat().st_mtime - 60))
    db.drop_versions("g", keep_last=1)
    db.gc()
    (left,) = db.catalog.manifests.root.glob("*.manifest")
    # every chunk changed (every tensor did): the old version's chunks went with it
    assert len(list(db.catalog.manifests.root.glob("*.chunk"))) == len(chunks) // 2
    with db.snapshot("g") as snap:
        assert torch.equal(snap["experts.00002.w"], torch.full((4,), 3.0))
    assert left.exists()


def test_state_dict_is_a_lazy_mapping_that_outlives_its_snapshot(
        sqlite_db: tensordb.Database) -> None:
    db = sqlite_db
    src = model(BIG)
    db.commit("s", src)
    with db.snapshot("s") as snap:
        sd = snap.state_dict()
        assert not snap._cache  # nothing made yet
    # the snapshot is closed, its lease gone, and its version dropped: the mapping holds
    db.commit("s", model(BIG, 5.0))
    db.drop_versions("s", keep_last=1)
    db.gc()
    assert len(sd) == BIG and "experts.00001.w" in sd and "nope" not in sd
    assert torch.equal(sd["experts.00001.w"], src["experts.00001.w"])
    with pytest.raises(NotFound):
        sd["nope"]
    assert sd.get("nope") is None
    assert list(sd) == sorted(src)
    assert dict(sd.items()).keys() == src.keys()
    assert all(torch.equal(sd[n], t) for n, t in src.items())
    assert sd == {n: sd[n] for n in sd}
    with pytest.raises(TypeError):
        sd["x"] = torch.zeros(1)  # type: ignore[index]


def test_a_commit_copies_every_kind_of_tensor_right(sqlite_db: tensordb.Database) -> None:
    """The batched native copy (contiguous tensors) beside the per-tensor path
    (strided, lazily conjugated, put_raw) in one commit: every value and checksum."""
    db = sqlite_db
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    cplx = torch.randn(8, dtype=torch.complex64)
    tensors = {"plain": base.clone(), "strided": base.t(), "offset": base[1:],
               "conj": cplx.conj(), "neg": torch.randn(5, dtype=torch.complex64).conj().conj(),
               "big": torch.randn(3 << 20), "empty": torch.empty(0)}
    with db.transaction("k") as tx:
        tx.put_many(tensors)
        tx.put_raw("raw", torch.uint8, (100,), lambda dst: dst.__setitem__(slice(None), 7))
    with db.snapshot("k", verify=True) as snap:
        for name, t in tensors.items():
            assert torch.equal(snap[name], t.resolve_conj().resolve_neg()), name
        assert bool((snap["raw"] == 7).all())
    assert db.verify() == []


def test_fill_from_addresses_checks_every_range_before_copying() -> None:
    class Writer:  # a mapped segment's writer: no descriptor to write through
        buffer = np.zeros(256, np.uint8)
        write_fd = None

    src = np.arange(100, dtype=np.uint8)
    w = Writer()
    got = se.fill_from_addresses(w, [src.ctypes.data], [0], [100])  # type: ignore[arg-type]
    assert got == [se.checksum(src)] and bytes(w.buffer[:100]) == src.tobytes()
    w.buffer[:] = 0
    with pytest.raises(ValueError, match="does not fit"):
        se.fill_from_addresses(w, [src.ctypes.data] * 2, [0, 200], [10, 100])  # type: ignore[arg-type]
    assert not w.buffer.any()  # the first, valid range was not copied either


@settings(max_examples=400, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("ab./\\ \t_-é\x00")), max_size=12))
def test_the_name_fast_path_agrees_with_the_full_check(name: str) -> None:
    full_ok = _problem("tensor", name) is None
    try:
        check_name("tensor", name)
        fast_ok = True
    except InvalidInput:
        fast_ok = False
    assert fast_ok == full_ok


def test_manifest_files_are_private(sqlite_db: tensordb.Database, tmp_path: Path) -> None:
    sqlite_db.commit("m", model(BIG))
    drain(sqlite_db)
    assert sqlite_db.catalog.manifests is not None
    root = sqlite_db.catalog.manifests.root
    assert root.stat().st_mode & 0o777 == 0o700
    assert all(p.stat().st_mode & 0o777 == 0o600 for p in root.iterdir())


def test_postgres_statistics_follow_a_large_commit(pg_url: str, store_home: Path) -> None:
    """A commit of 10,000+ rows into a table the planner last saw (nearly) empty
    analyzes it, so a later look-up by name takes the head index (not the whole head)."""
    from conftest import open_store, remove_store
    from sqlalchemy import text

    db = open_store(store_home, pg_url)
    try:
        db.commit("big", model(10_000))
        with db.catalog.engine.connect() as conn:
            known = conn.execute(text("SELECT reltuples FROM pg_class "
                                      "WHERE oid = 'tensors'::regclass")).scalar()
            plan = "\n".join(r[0] for r in conn.execute(text(
                "EXPLAIN UPDATE tensors SET end_version = 9 WHERE collection_id = 1 AND "
                "end_version IS NULL AND name = ANY(ARRAY['experts.00001.w'])")))
        assert known is not None and known >= 10_000
        assert "uq_tensors_head" in plan and "ANY" in plan.split("Index Cond")[1].split("\n")[0]
    finally:
        remove_store(db)
