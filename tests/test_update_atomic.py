"""All-or-nothing weight updates (``WeightUpdater``, and the gate the engine bindings
share): a version with a damaged tensor, or one whose node dies while it is read, is
refused before the module is touched; a copy that fails part-way is put back to the
version before; the updater always reports the one version the module holds."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import test_transport_pull
import torch
from conftest import flip_byte, open_store, remove_store

import tensordb
from engine_bindings._engines import (
    Served,
    StoreLocation,
    checked_tensors,
    note_served,
    served_by,
)
from engine_bindings._sync import WeightUpdater
from tensordb.errors import CorruptData, NodeUnavailable

NAMES = [f"layer{i}.weight" for i in range(6)]


class Stack(torch.nn.Module):
    """Six tensors, each in its own parameter, applied in the version's order."""

    def __init__(self) -> None:
        super().__init__()
        for i in range(6):
            setattr(self, f"layer{i}", torch.nn.Linear(64, 64, bias=False))


def state(value: float) -> dict[str, torch.Tensor]:
    return {n: torch.full((64, 64), value) for n in NAMES}


def values(module: torch.nn.Module) -> list[float]:
    """Each tensor's one value (nan where a tensor holds more than one)."""
    out = []
    for t in module.state_dict().values():
        u = t.float().unique()
        out.append(float(u[0]) if u.numel() == 1 else float("nan"))
    return out


@pytest.fixture(params=["host", "disk"])
def tier_db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tensordb.Database]:
    db = open_store(tmp_path / "store", default_tier=request.param)
    try:
        yield db
    finally:
        remove_store(db)


def _damage(db: tensordb.Database, version: int, name: str, how: str) -> None:
    """Damage tensor ``name`` of ``version`` where its bytes live: one byte of its
    extent flipped in the segment file, the store told (``verify`` marks it) or not."""
    with db.snapshot("w", version=version) as snap:
        sid, offset, _ = snap.extents()[name]
        tier = "disk" if db.config.default_tier == "disk" else "host"
    assert sid is not None
    flip_byte(db.tier(tier).path(sid), offset + 17)  # type: ignore[attr-defined]
    if how == "marked":
        assert [(p.collection, p.tensor) for p in db.verify()] == [("w", name)]


@pytest.mark.parametrize("how", ["flipped", "marked"])
@pytest.mark.parametrize("mode", ["copy", "swap"])
def test_a_damaged_tensor_fails_the_update_before_anything_is_applied(
        tier_db: tensordb.Database, mode: str, how: str) -> None:
    db = tier_db
    db.commit("w", state(1.0))
    db.commit("w", state(2.0))
    module = Stack()
    updater = WeightUpdater(db, "w", module, mode=mode)
    assert updater.apply(1).version == 1
    assert values(module) == [1.0] * 6
    last = list(db.snapshot("w", version=2))[-1]  # the last tensor applied
    _damage(db, 2, last, how)
    if mode == "swap" and how == "flipped" and db.config.default_tier == "host":
        # swap mode serves the store's own pages: a host flip no check has seen yet is
        # served zero-copy, as every view is (the integrity model's one window); once
        # the scrub marks it, the update is refused like any other read
        assert db.scrub().corrupt
    with pytest.raises(CorruptData) as info:
        updater.apply(2)
    assert info.value.tensor == last and info.value.collection == "w"
    assert values(module) == [1.0] * 6  # not one tensor of version 2
    assert updater.current_version == 1
    # the version after it is whole: applied, and reported
    db.commit("w", state(3.0))
    report = updater.apply()
    assert report.version == updater.current_version == 3
    assert values(module) == [3.0] * 6
    updater.close()


def _copies_failing_at(monkeypatch: pytest.MonkeyPatch, n: int) -> list[float]:
    """Make the ``n``-th tensor copy from now fail (a device error); returns the first
    value of each copy's source, in order, as the copies are made."""
    real = torch.Tensor.copy_
    calls: list[float] = []

    def flaky(self: torch.Tensor, src: torch.Tensor, *a: Any, **kw: Any) -> torch.Tensor:
        calls.append(float(src.flatten()[0]))
        if len(calls) == n:
            raise RuntimeError("device lost during the copy")
        return real(self, src, *a, **kw)

    monkeypatch.setattr(torch.Tensor, "copy_", flaky)
    return calls


def test_a_copy_failing_part_way_puts_the_version_before_back(
        sqlite_db: tensordb.Database, monkeypatch: pytest.MonkeyPatch) -> None:
    """A failure after the check (a device error on the 4th copy): the three tensors
    copied already get version 1 back before the error is raised."""
    db = sqlite_db
    db.commit("w", state(1.0))
    db.commit("w", state(2.0))
    module = Stack()
    updater = WeightUpdater(db, "w", module, bucket_bytes=1)
    updater.apply(1)
    calls = _copies_failing_at(monkeypatch, 4)
    with pytest.raises(RuntimeError, match="device lost") as info:
        updater.apply(2)
    monkeypatch.undo()
    assert calls[:4] == [2.0] * 4  # three tensors held version 2 when it failed
    assert calls[4:] == [1.0] * 4  # and were put back (with the one that failed)
    assert "back on v1" in "".join(getattr(info.value, "__notes__", []))
    assert values(module) == [1.0] * 6
    assert updater.current_version == 1
    assert updater.apply(2).version == 2 and values(module) == [2.0] * 6
    updater.close()


def test_a_copy_that_cannot_be_put_back_reports_no_version(
        sqlite_db: tensordb.Database, monkeypatch: pytest.MonkeyPatch) -> None:
    """The version before is gone (dropped) when a copy fails part-way: the updater
    says it holds no one version, and the next apply copies every tensor."""
    db = sqlite_db
    db.commit("w", state(1.0))
    module = Stack()
    updater = WeightUpdater(db, "w", module, bucket_bytes=1)
    updater.apply(1)
    db.commit("w", state(2.0))
    db.drop_versions("w", keep_last=1)
    db.gc()
    _copies_failing_at(monkeypatch, 3)
    with pytest.raises(RuntimeError, match="device lost") as info:
        updater.apply(2)
    monkeypatch.undo()
    assert "no one version" in "".join(getattr(info.value, "__notes__", []))
    assert updater.current_version is None
    report = updater.apply()
    assert report.version == 2 and len(report.changed) == 6 and values(module) == [2.0] * 6
    updater.close()


# -- a node that dies while the version is read ------------------------------------------
#: node "w" commits; node "r" runs the module and pulls w's segments through the pull
#: tests' in-process transport, which can lose the node
pair = test_transport_pull.pair


@pytest.mark.parametrize("mode", ["copy", "swap"])
def test_a_node_lost_mid_update_leaves_the_module_on_its_version(pair: Any,
                                                                 mode: str) -> None:
    w, r, fake = pair
    r.commit("w", state(1.0))  # version 1: r's own bytes
    # version 3 lies in two of w's segments: half its tensors from v2, half from v3
    w.commit("w", {n: torch.full((64, 64), 2.0) for n in NAMES[:3]})
    w.commit("w", {n: torch.full((64, 64), 2.0) for n in NAMES[3:]})
    module = Stack()
    updater = WeightUpdater(r, "w", module, mode=mode)
    updater.apply(1)

    segments: set[str] = set()
    real_read = fake.read_segment

    def dies_after_one_segment(node: str, address: str, segment_id: str, *a: Any) -> None:
        if segments and segment_id not in segments:
            fake.remove("w")  # the node is gone before the second segment is read
        segments.add(segment_id)
        real_read(node, address, segment_id, *a)

    fake.read_segment = dies_after_one_segment
    with pytest.raises(NodeUnavailable):
        updater.apply(3)
    assert len(segments) == 2  # the first segment came over: the failure was mid-way
    assert values(module) == [1.0] * 6
    assert updater.current_version == 1

    fake.read_segment = real_read
    fake.add(w, chunk_bytes=fake.chunk)  # the node is back
    assert updater.apply(3).version == updater.current_version == 3
    assert values(module) == [2.0] * 6
    updater.close()


# -- the gate itself ---------------------------------------------------------------------
def test_the_gate_checks_every_tensor_before_handing_one_on(
        sqlite_db: tensordb.Database) -> None:
    db = sqlite_db
    db.commit("w", state(1.0))
    with db.snapshot("w") as snap:
        pairs = checked_tensors(snap)
        assert [n for n, _ in pairs] == list(snap)
        assert all(bool((t == 1.0).all()) for _, t in pairs)
        assert [n for n, _ in checked_tensors(snap, {NAMES[2]})] == [NAMES[2]]
        _damage(db, 1, NAMES[4], "flipped")
        handed: list[str] = []
        with pytest.raises(CorruptData):
            handed.extend(n for n, _ in checked_tensors(snap))
        assert handed == []  # not even the tensors before the damaged one


def test_served_versions_are_per_model() -> None:
    a, b = torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)
    here = Served(StoreLocation(home="/x"), "w", 3)
    note_served(a, here)
    assert served_by(a) == here and served_by(b) is None
    assert here.as_dict() == {"collection": "w", "version": 3}
    note_served(a, None)
    assert served_by(a) is None
