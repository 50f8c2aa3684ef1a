"""Sharded tensors and group commits: the ranks of a job each put their shards of one
version, which appears atomically when the last part lands; readers see one tensor per
name and read their own slices. Ranks here are threads (each with its own transaction;
the catalog sees them as one process) on both catalog backends; tests/test_shards_procs
runs them as real processes in a gloo process group."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from conftest import flip_byte

import tensordb
from tensordb.errors import CommitConflict, CorruptData, GroupAborted, InvalidInput, NotFound


class _Abort(Exception):
    """Ends a transaction's block without a commit."""


W = torch.arange(12 * 10, dtype=torch.float32).reshape(12, 10)


def _ranks(n: int, body: Callable[[int], Any]) -> dict[int, Any]:
    """Run ``body(rank)`` for n ranks at once; rank -> result or the exception raised."""
    out: dict[int, Any] = {}

    def run(r: int) -> None:
        try:
            out[r] = body(r)
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            out[r] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(out) == n, "a rank hung"
    return out


def _bounds(size: int, r: int, n: int) -> tuple[int, int]:
    step = -(-size // n)
    start = min(r * step, size)
    return start, max(0, min(step, size - start))


def _save(db: tensordb.Database, n: int, dim: int, group: str, collection: str = "m",
          **kw: Any) -> dict[int, Any]:
    def body(r: int) -> tensordb.Commit | None:
        start, length = _bounds(W.shape[dim], r, n)
        offsets = [0, 0]
        offsets[dim] = start
        with db.transaction(collection, group=group, rank=r, world_size=n, **kw) as tx:
            tx.put_shard("w", W.narrow(dim, start, length), global_shape=W.shape,
                         offsets=offsets)
            if r == 0:
                tx.put("bias", torch.ones(3))
        return tx.result
    return _ranks(n, body)


def _store_state(db: tensordb.Database) -> tuple[Any, ...]:
    return (db.collections(),
            {c: [x.version for x in db.history(c)] for c in db.collections()},
            db.stats()["segments"])


@pytest.mark.parametrize("n,dim", [(2, 0), (4, 0), (2, 1), (4, 1)])
def test_group_commit_readers_of_any_width(db: tensordb.Database, n: int, dim: int) -> None:
    got = _save(db, n, dim, group=f"g{n}{dim}")
    commits = list(got.values())
    assert all(isinstance(c, tensordb.Commit) for c in commits), got
    assert {c.version for c in commits} == {1}  # every rank sees the one version
    assert commits[0].tensors == 2 and commits[0].nbytes == W.nbytes + 12
    with db.snapshot("m") as snap:
        assert sorted(snap) == ["bias", "w"]
        assert torch.equal(snap["w"], W)
        assert [s.rank for s in snap.shards("w")] == list(range(n))
        assert snap.shards("bias") == [tensordb.Shard((0,), (3,), None)]
        for readers in (1, 2, 3):
            for d in (0, 1):
                parts = [snap.slice("w", rank=r, world_size=readers, dim=d)
                         for r in range(readers)]
                assert torch.equal(torch.cat(parts, d), W)
        sd = snap.state_dict()
        assert torch.equal(sd["w"], W) and torch.equal(sd["bias"], torch.ones(3))
        table = snap.to_arrow()
        data = table.column("data").to_pylist()[table.column("name").to_pylist().index("w")]
        assert data == W.numpy().tobytes()
    assert torch.equal(db.get("m", "w"), W)
    assert db.verify() == []


def test_slice_is_zero_copy_where_one_shard_holds_it(db: tensordb.Database) -> None:
    _save(db, 2, 0, group="z")
    with db.snapshot("m") as snap:
        inside = snap.slice("w", offsets=(1, 2), shape=(3, 5))  # within rank 0's rows
        assert torch.equal(inside, W[1:4, 2:7])
        # a view of the shard's mapping, not a copy of the box
        assert inside.untyped_storage().nbytes() > inside.numel() * 4
        across = snap.slice("w", offsets=(4, 0), shape=(4, 10))  # rows of both ranks
        assert torch.equal(across, W[4:8])
        assert across.untyped_storage().nbytes() == across.numel() * 4
        whole = snap.slice("bias", offsets=(1,), shape=(2,))
        assert torch.equal(whole, torch.ones(2))


def test_put_shard_in_one_transaction(db: tensordb.Database) -> None:
    with db.transaction("one") as tx:
        tx.put_shard("w", W[:, :4], global_shape=(12, 10), offsets=(0, 0))
        tx.put_shard("w", W[:, 4:], global_shape=(12, 10), offsets=(0, 4))
        tx.put_shard("whole", W, global_shape=(12, 10), offsets=(0, 0))
        tx.put_shard("strided", W.t()[2:5], global_shape=(3, 12), offsets=(0, 0))
    with db.snapshot("one") as snap:
        assert torch.equal(snap["w"], W)
        assert len(snap.shards("w")) == 2
        assert snap.shards("whole") == [tensordb.Shard((0, 0), (12, 10), None)]  # stored whole
        assert torch.equal(snap["strided"], W.t()[2:5])


def test_a_later_commit_replaces_a_sharded_row_and_gc_reclaims_its_shards(
        db: tensordb.Database) -> None:
    _save(db, 2, 1, group="a")
    segs = db.stats()["segments"]
    assert segs == 2  # one segment per rank
    db.commit("m", {"w": W * 2})
    db.drop_versions("m", keep_last=1)
    report = db.gc()
    assert report.segments_deleted == 1  # rank 1's segment held only shards of w
    assert torch.equal(db.get("m", "w"), W * 2)
    assert torch.equal(db.get("m", "bias"), torch.ones(3))  # rank 0's segment lives on
    assert db.verify() == []


def test_shards_keep_each_version(db: tensordb.Database) -> None:
    _save(db, 2, 0, group="v1")
    w2 = W + 1
    def body(r: int) -> None:
        with db.transaction("m", group="v2", rank=r, world_size=2) as tx:
            tx.put_shard("w", w2[:, r * 5:(r + 1) * 5], global_shape=W.shape, offsets=(0, r * 5))
    _ranks(2, body)
    with db.snapshot("m", version=1) as old, db.snapshot("m") as new:
        assert torch.equal(old["w"], W) and torch.equal(new["w"], w2)
        assert [s.shape for s in old.shards("w")] == [(6, 10), (6, 10)]
        assert [s.shape for s in new.shards("w")] == [(12, 5), (12, 5)]
        assert torch.equal(new["bias"], torch.ones(3))  # untouched names carry over


@pytest.mark.parametrize("case", ["overlap", "gap", "dtype", "global_shape", "put_and_delete",
                                  "metadata"])
def test_parts_that_do_not_fit_publish_nothing(db: tensordb.Database, case: str) -> None:
    db.commit("m", {"old": torch.zeros(2)})
    before = _store_state(db)

    def body(r: int) -> None:
        rows = [(0, 6), (6, 6)]
        if case == "overlap":
            rows = [(0, 7), (6, 6)]
        if case == "gap":
            rows = [(0, 5), (6, 6)]
        start, length = rows[r]
        t = W[start:start + length]
        if case == "dtype" and r == 1:
            t = t.double()
        gshape = (13, 10) if case == "global_shape" and r == 1 else (12, 10)
        meta = {"step": str(r)} if case == "metadata" else None
        with db.transaction("m", group="bad", rank=r, world_size=2, metadata=meta) as tx:
            tx.put_shard("w", t, global_shape=gshape, offsets=(start, 0))
            if case == "put_and_delete":
                if r == 0:
                    tx.put("old", torch.ones(2))
                else:
                    tx.delete("old")
    got = _ranks(2, body)
    errors = list(got.values())
    assert any(isinstance(e, InvalidInput) for e in errors), got
    assert all(isinstance(e, (InvalidInput, GroupAborted)) for e in errors), got
    assert any(case_word in str(e) for e in errors
               for case_word in ("overlap", "gap", "float", "global", "deleted", "metadata",
                                 "disagree"))
    assert _store_state(db)[:2] == before[:2]  # no version, no collection
    db.gc()
    assert _store_state(db) == before  # the parts' bytes are reclaimed
    assert db.verify() == []


def test_world_sizes_that_disagree(db: tensordb.Database) -> None:
    with pytest.raises(GroupAborted, match="world_size"):  # rank 0 finds the group aborted
        with db.transaction("m", group="ws", rank=0, world_size=2) as tx:
            tx.put("a", torch.ones(2))
            with pytest.raises(InvalidInput, match="world_size 3"):
                with db.transaction("m", group="ws", rank=1, world_size=3):
                    pass
            with pytest.raises(GroupAborted, match="world_size"):
                with db.transaction("m", group="ws", rank=1, world_size=2):
                    pass
    assert db.collections() == []
    db.gc()
    assert db.stats()["segments"] == 0


def test_a_rank_that_raises_aborts_the_group(db: tensordb.Database) -> None:
    def body(r: int) -> None:
        with db.transaction("m", group="boom", rank=r, world_size=3) as tx:
            tx.put_shard("w", W[r * 4:(r + 1) * 4], global_shape=W.shape, offsets=(r * 4, 0))
            if r == 2:
                time.sleep(0.2)
                raise RuntimeError("out of memory on rank 2")
    got = _ranks(3, body)
    assert isinstance(got[2], RuntimeError)
    for r in (0, 1):
        assert isinstance(got[r], GroupAborted) and isinstance(got[r], CommitConflict)
        assert "rank 2 raised RuntimeError" in got[r].reason
    assert db.collections() == []
    db.gc()
    assert db.stats()["segments"] == 0 and db.stats()["host_bytes"] == 0


@pytest.mark.deadline
def test_a_deadline_aborts_a_group_whose_ranks_never_come(db: tensordb.Database) -> None:
    t0 = time.monotonic()
    with pytest.raises(GroupAborted, match="deadline") as info:
        with db.transaction("m", group="late", rank=0, world_size=2, timeout=0.5) as tx:
            tx.put("a", torch.ones(4))
    assert 0.4 < time.monotonic() - t0 < 10
    assert "[1]" in info.value.reason  # names the rank that never came
    assert db.collections() == []
    db.gc()
    assert db.stats()["segments"] == 0
    # a rank arriving after the end is told so, and publishes nothing
    with pytest.raises(GroupAborted):
        with db.transaction("m", group="late", rank=1, world_size=2):
            pass


def test_a_group_conflicts_like_a_transaction(db: tensordb.Database) -> None:
    db.commit("m", {"w": W})
    def body(r: int) -> None:
        with db.transaction("m", group="c", rank=r, world_size=2) as tx:
            tx.put_shard("w", W[r * 6:(r + 1) * 6] * 3, global_shape=W.shape,
                         offsets=(r * 6, 0))
            if r == 0:
                db.commit("m", {"w": W * 5})  # the head moves under the group
    got = _ranks(2, body)
    assert all(isinstance(e, GroupAborted) for e in got.values()), got
    assert any("both changed 'w'" in e.reason for e in got.values())
    assert [c.version for c in db.history("m")] == [2, 1]
    assert torch.equal(db.get("m", "w"), W * 5)


def test_group_names_are_used_once(db: tensordb.Database) -> None:
    _save(db, 2, 0, group="once")
    with pytest.raises(InvalidInput, match="already published version 1"):
        with db.transaction("m", group="once", rank=0, world_size=2):
            pass


def test_metadata_and_message_of_the_ranks(db: tensordb.Database) -> None:
    def body(r: int) -> tensordb.Commit | None:
        with db.transaction("m", group="meta", rank=r, world_size=2,
                            message="step 7" if r == 0 else None,
                            metadata={"step": "7", f"rank{r}": "x"}) as tx:
            tx.put_shard("w", W[r * 6:(r + 1) * 6], global_shape=W.shape, offsets=(r * 6, 0))
        return tx.result
    got = _ranks(2, body)
    c = got[1]
    assert isinstance(c, tensordb.Commit)
    assert c.message == "step 7" and c.metadata == {"step": "7", "rank0": "x", "rank1": "x"}
    assert db.history("m")[0].metadata == c.metadata


def test_bad_group_arguments_are_typed_errors(db: tensordb.Database) -> None:
    db.commit("m", {"a": torch.ones(1)})
    before = _store_state(db)
    for kw in ({"rank": 0}, {"group": "g", "rank": 2, "world_size": 2},
               {"group": "g", "rank": 0, "world_size": 0},
               {"group": "g", "rank": "0", "world_size": 1},
               {"group": "", "rank": 0, "world_size": 1},
               {"group": "g", "rank": 0, "world_size": 1, "timeout": -1}):
        with pytest.raises(InvalidInput):
            db.transaction("m", **kw)
    with pytest.raises(_Abort), db.transaction("m") as tx:  # ends without a commit
        for args in (dict(global_shape=(4,), offsets=(2,)),       # out of the shape
                     dict(global_shape=(4, 1), offsets=(0,)),     # dimensions differ
                     dict(global_shape=(4,), offsets=(-1,)),
                     dict(global_shape=("4",), offsets=(0,)),
                     dict(global_shape=(2**70,), offsets=(0,))):
            with pytest.raises(InvalidInput):
                tx.put_shard("s", torch.ones(3), **args)
        tx.put_shard("s", torch.ones(2), global_shape=(4,), offsets=(0,))
        with pytest.raises(InvalidInput, match="disagree"):
            tx.put_shard("s", torch.ones(2, dtype=torch.int8), global_shape=(4,), offsets=(2,))
        raise _Abort
    with pytest.raises(InvalidInput, match="gap"):
        with db.transaction("m") as tx:
            tx.delete("a")
            tx.put_shard("s", torch.ones(2), global_shape=(4,), offsets=(0,))
            tx.put_shard("s", torch.ones(1), global_shape=(4,), offsets=(3,))  # a gap at 2
    assert _store_state(db) == before
    with db.snapshot("m") as snap:
        with pytest.raises(InvalidInput, match="outside"):
            snap.slice("a", offsets=(1,), shape=(1,))
        with pytest.raises(InvalidInput):
            snap.slice("a", offsets=(0,))
        with pytest.raises(InvalidInput):
            snap.slice("a", rank=1, world_size=1)
        with pytest.raises(InvalidInput):
            snap.slice("a", rank=0, world_size=1, dim=1)
        with pytest.raises(NotFound):
            snap.slice("nope", offsets=(0,), shape=(1,))


def test_a_corrupt_shard_is_never_served(sqlite_db: tensordb.Database) -> None:
    db = sqlite_db
    with db.transaction("m", tier="disk") as tx:
        tx.put_shard("w", W[:6], global_shape=W.shape, offsets=(0, 0))
        tx.put_shard("w", W[6:], global_shape=W.shape, offsets=(6, 0))
    seg = next(iter(db.config.data_dir.rglob("*.seg")), None) or next(
        p for p in db.config.data_dir.rglob("*") if p.is_file() and p.stat().st_size >= W.nbytes)
    flip_byte(seg, W.nbytes - 8)  # inside the second shard
    problems = db.verify()
    assert len(problems) == 1 and problems[0].tensor.startswith("w (shard at [6, 0])")
    with pytest.raises(CorruptData):
        with db.snapshot("m", verify=True) as snap:
            snap["w"]


class _Engine(torch.nn.Module):
    """An engine rank's module: its part of ``w`` (split along dim 1) and all of bias."""

    def __init__(self, rank: int, world: int) -> None:
        super().__init__()
        start, length = _bounds(W.shape[1], rank, world)
        self.w = torch.nn.Parameter(torch.zeros(W.shape[0], length), requires_grad=False)
        self.bias = torch.nn.Parameter(torch.zeros(3), requires_grad=False)
        self.cols = slice(start, start + length)


@pytest.mark.parametrize("mode", ["copy", "swap"])
def test_engine_ranks_follow_group_versions_reading_their_slices(
        db: tensordb.Database, mode: str) -> None:
    from engine_bindings import WeightUpdater, shard, shard_state_dict

    _save(db, 2, 0, group="t1")  # the trainer splits rows; the engine splits columns
    engines = [_Engine(r, 3) for r in range(3)]
    ups = [WeightUpdater(db, "m", e, mode=mode, rank=r, world_size=3, plan={"w": 1})
           for r, e in enumerate(engines)]
    for e, up in zip(engines, ups, strict=True):
        report = up.apply()
        assert report.version == 1 and sorted(report.changed) == ["bias", "w"]
        assert torch.equal(e.w, W[:, e.cols]) and torch.equal(e.bias, torch.ones(3))

    def body(r: int) -> None:  # version 2 from the trainer: only w changes
        with db.transaction("m", group="t2", rank=r, world_size=2) as tx:
            tx.put_shard("w", (W * 2)[r * 6:(r + 1) * 6], global_shape=W.shape,
                         offsets=(r * 6, 0))
    _ranks(2, body)
    for e, up in zip(engines, ups, strict=True):
        report = up.apply()
        assert report.version == 2 and report.changed == ["w"]
        assert torch.equal(e.w, (W * 2)[:, e.cols])
        up.close()
    assert torch.equal(shard(db, "m", "w", rank=1, world_size=2, dim=1), (W * 2)[:, 5:])
    sd = shard_state_dict(db, "m", rank=2, world_size=3, plan={"w": 0})
    assert torch.equal(sd["w"], (W * 2)[8:]) and torch.equal(sd["bias"], torch.ones(3))
    with pytest.raises(InvalidInput):
        WeightUpdater(db, "m", engines[0], rank=3, world_size=3, plan={"w": 1})
    with pytest.raises(InvalidInput):
        WeightUpdater(db, "m", engines[0], rank=0, world_size=3, plan={"w": "1"})
    with pytest.raises(InvalidInput, match="shape"):  # a module of the wrong width
        WeightUpdater(db, "m", engines[0], rank=0, world_size=2, plan={"w": 1}).apply()


def test_check_tiling_names_what_is_wrong() -> None:
    """The tiling check alone, on boxes a hostile part could carry (put_shard refuses
    most of them before they reach it)."""
    from tensordb.catalog import check_tiling

    g = (12, 10)
    assert check_tiling("w", g, [(0, (0, 0), (6, 10)), (1, (6, 0), (6, 10))]) is None
    assert check_tiling("w", g, [(0, (0, 0), (12, 10))]) is None
    assert check_tiling("e", (0, 4), []) is None  # nothing to cover
    assert check_tiling("w", g, [(0, (0, 0), (12, 10)), (1, (3, 0), (0, 10))]) is None
    cases = {
        "overlap": [(0, (0, 0), (6, 10)), (1, (5, 0), (6, 10))],  # the sizes add up
        "a gap": [(0, (0, 0), (6, 10)), (1, (7, 0), (5, 10))],
        "outside": [(0, (0, 0), (6, 10)), (1, (6, 0), (7, 10))],
    }
    for want, boxes in cases.items():
        assert want in (check_tiling("w", g, boxes) or ""), want
    for boxes in ([(0, (0,), (12, 10))], [(0, (0, 0), (12,))], [(0, (-1, 0), (12, 10))],
                  [(0, (0, 0), (-12, 10))], [(0, (0, 1), (12, 10))]):
        assert check_tiling("w", g, boxes) is not None, boxes
    # boxes side by side in the second dimension that overlap only there
    assert "overlap" in (check_tiling("w", g, [(0, (0, 0), (12, 6)), (1, (0, 5), (12, 5))])
                         or "")
    # three boxes where only the first and the last overlap
    assert "overlap" in (check_tiling("w", (9,), [(0, (0,), (3,)), (1, (3,), (3,)),
                                                   (2, (2,), (1,))]) or "")


def test_a_rank_failing_to_write_its_part_aborts_the_group_at_once(
        db: tensordb.Database) -> None:
    def body(r: int) -> float:
        t0 = time.monotonic()
        with db.transaction("m", group="fill", rank=r, world_size=2, timeout=60) as tx:
            tx.put_shard("w", W[r * 6:(r + 1) * 6], global_shape=W.shape, offsets=(r * 6, 0))
            if r == 1:
                def fill(dst: Any) -> None:
                    raise OSError("the source file went away")
                tx.put_raw("x", torch.float32, (4,), fill)
        return time.monotonic() - t0
    got = _ranks(2, body)
    assert isinstance(got[1], OSError)
    assert isinstance(got[0], GroupAborted) and "rank 1 failed to commit its part" in \
        got[0].reason
    assert db.collections() == []
    db.gc()
    assert db.stats()["segments"] == 0


def test_two_ranks_putting_one_scalar_is_an_overlap(db: tensordb.Database) -> None:
    def body(r: int) -> None:
        with db.transaction("m", group="scalar", rank=r, world_size=2, timeout=60) as tx:
            tx.put("step", torch.tensor(r))
    got = _ranks(2, body)
    assert sorted(type(e).__name__ for e in got.values()) == ["GroupAborted", "InvalidInput"]
    assert any("both put this 0-d tensor" in str(e) for e in got.values())
    assert db.collections() == []


def test_a_state_dict_outlives_its_snapshot_and_gc(db: tensordb.Database) -> None:
    _save(db, 2, 1, group="sd")
    with db.snapshot("m") as snap:
        sd = snap.state_dict()
    db.commit("m", {"w": W * 3})
    db.drop_versions("m", keep_last=1)
    db.gc()
    assert torch.equal(sd["w"], W)  # its shards' mappings were taken with it


def test_a_published_group_name_stays_taken_after_gc(db: tensordb.Database) -> None:
    from datetime import datetime, timedelta, timezone

    from sqlalchemy import update

    from tensordb.catalog.schema import commit_groups

    _save(db, 2, 0, group="kept")
    with db.catalog.engine.begin() as conn:  # its deadline long past, as gc will see it
        conn.execute(update(commit_groups).values(
            deadline=datetime.now(timezone.utc) - timedelta(days=30)))
    db.gc()
    with pytest.raises(InvalidInput, match="already published"):
        with db.transaction("m", group="kept", rank=0, world_size=2):
            pass


def test_many_tensor_parallel_shards(db: tensordb.Database) -> None:
    big = torch.arange(4 * 512, dtype=torch.int16).reshape(4, 512)
    with db.transaction("tp") as tx:
        for c in range(512):
            tx.put_shard("w", big[:, c:c + 1], global_shape=big.shape, offsets=(0, c))
    with db.snapshot("tp") as snap:
        assert len(snap.shards("w")) == 512 and torch.equal(snap["w"], big)
        assert torch.equal(snap.slice("w", offsets=(1, 100), shape=(2, 300)), big[1:3, 100:400])


def test_query_rows_of_sharded_tensors_as_arrow(db: tensordb.Database) -> None:
    _save(db, 2, 0, group="q")
    rows = db.query("SELECT collection, name, version FROM tensors WHERE collection = 'm' "
                    "ORDER BY name")
    table = db.tensors_arrow(rows)
    data = dict(zip(table.column("name").to_pylist(), table.column("data").to_pylist(),
                    strict=True))
    assert data["w"] == W.numpy().tobytes() and len(data["bias"]) == 12


def test_an_engine_plan_naming_a_missing_dim_touches_nothing(db: tensordb.Database) -> None:
    from engine_bindings import WeightUpdater

    _save(db, 2, 0, group="plan")
    e = _Engine(0, 2)
    up = WeightUpdater(db, "m", e, rank=0, world_size=2, plan={"w": 1, "bias": 1})
    with pytest.raises(InvalidInput, match="dim 1"):
        up.apply()
    assert not e.w.any() and not e.bias.any()  # nothing was written


@pytest.mark.parametrize("sharded", [False, True])
def test_slice_into_a_buffer_of_ones_own(db: tensordb.Database, sharded: bool) -> None:
    if sharded:
        _save(db, 3, 0, group="into")
    else:
        db.commit("m", {"w": W})
    with db.snapshot("m") as snap:
        for off, shp in (((2, 0), (7, 10)), ((5, 0), (1, 10)), ((3, 4), (1, 3)),
                         ((0, 2), (12, 5)), ((0, 0), (12, 10)), ((4, 9), (8, 1))):
            out = torch.full(shp, -1.0)
            got = snap.slice("w", offsets=off, shape=shp, out=out)
            assert got is out
            assert torch.equal(out, W[off[0]:off[0] + shp[0], off[1]:off[1] + shp[1]]), off
        for bad in (torch.zeros(3, 10), torch.zeros(7, 10, dtype=torch.float64),
                    torch.zeros(10, 7).t(), "buffer"):
            with pytest.raises(InvalidInput, match="out must be"):
                snap.slice("w", offsets=(2, 0), shape=(7, 10), out=bad)  # type: ignore[arg-type]
