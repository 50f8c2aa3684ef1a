"""Pins, eviction between tiers, dropping versions, replication in the embedded store."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch

import tensordb
from tensordb.errors import InvalidInput, NodeUnavailable, NotFound


def _tiers(db: tensordb.Database) -> tuple[list[str], list[str]]:
    return sorted(db.tier("host").segments()), sorted(db.tier("disk").segments())


def test_evict_moves_to_disk_and_reads_follow(db: tensordb.Database) -> None:
    db.commit("e", {"w": torch.arange(4096, dtype=torch.float32)})
    held = db.get("e", "w")  # mapped before the move: stays valid
    report = db.evict("e")
    assert (report.segments, report.skipped_pinned) == (1, 0) and report.nbytes >= 4096 * 4
    host, disk = _tiers(db)
    assert host == [] and len(disk) == 1
    assert torch.equal(db.get("e", "w", verify=True), torch.arange(4096, dtype=torch.float32))
    assert torch.equal(held, torch.arange(4096, dtype=torch.float32))
    assert db.verify() == []
    assert db.evict("e").segments == 0  # nothing left in host


def test_pin_promotes_and_protects(db: tensordb.Database) -> None:
    db.commit("p", {"w": torch.ones(1024)}, tier="disk")
    assert db.pin("p") == 1
    host, disk = _tiers(db)
    assert len(host) == 1 and disk == []  # promoted to the pinned tier
    assert db.pins() == [("p", 1, "host")]
    report = db.evict("p")
    assert (report.segments, report.skipped_pinned) == (0, 1)
    assert db.unpin("p") is True and db.unpin("p") is False
    assert db.evict("p").segments == 1


def test_pinned_versions_survive_retention(db: tensordb.Database) -> None:
    for v in range(1, 5):
        db.commit("r", {"w": torch.full((256,), float(v))})
    db.pin("r", version=2)
    db.set_retention("r", 1)
    db.gc()
    assert [c.version for c in db.history("r")] == [4, 2]
    assert float(db.get("r", "w", version=2)[0]) == 2.0
    db.unpin("r", version=2)
    db.gc()
    assert [c.version for c in db.history("r")] == [4]


def test_drop_versions(db: tensordb.Database) -> None:
    for v in range(1, 7):
        db.commit("d", {"w": torch.full((256,), float(v))})
    db.tag("d", "t", version=1)
    assert db.drop_versions("d", keep_last=2) == 3  # 2, 3, 4 (1 is tagged)
    assert [c.version for c in db.history("d")] == [6, 5, 1]
    report = db.gc()
    assert report.segments_deleted == 3
    assert db.drop_versions("d", older_than=timedelta(days=1)) == 0
    assert db.drop_versions("d", older_than=timedelta(0)) == 1  # 5; 6 is the head, 1 tagged
    assert [c.version for c in db.history("d")] == [6, 1]


def test_placement_bad_inputs(db: tensordb.Database) -> None:
    db.commit("b", {"w": torch.ones(2)})
    before = (db.pins(), _tiers(db), [c.version for c in db.history("b")])
    for call, err in [
        (lambda: db.evict("b", tier="disk"), InvalidInput),
        (lambda: db.evict("b", tier="tape"), InvalidInput),
        (lambda: db.pin("b", tier="gpu"), InvalidInput),
        (lambda: db.pin("b", version=9), NotFound),
        (lambda: db.pin("nope"), NotFound),
        (lambda: db.evict("b", tag="nope"), NotFound),
        (lambda: db.drop_versions("b"), InvalidInput),
        (lambda: db.drop_versions("b", keep_last=0), InvalidInput),
        (lambda: db.drop_versions("b", keep_last=1, older_than=timedelta(1)), InvalidInput),
        (lambda: db.drop_versions("nope", keep_last=1), NotFound),
        (lambda: db.replicate("b", to=[]), InvalidInput),
        (lambda: db.replicate("b", to=["elsewhere"]), NotFound),
        (lambda: db.replicate("b", version=7, to=["local"]), NotFound),
    ]:
        with pytest.raises(err):
            call()
    assert (db.pins(), _tiers(db), [c.version for c in db.history("b")]) == before


def test_replicate_in_embedded_store(db: tensordb.Database) -> None:
    db.commit("rep", {"w": torch.ones(2)})
    assert db.replicate("rep", to=["local"]) == ["local"]
    from tensordb.catalog.schema import nodes

    with db.catalog.engine.begin() as conn:
        conn.execute(nodes.insert().values(name="far", address="10.0.0.9:7000", tiers="[]",
                                           state="up"))
    with pytest.raises(NodeUnavailable) as info:
        db.replicate("rep", to=["far"])
    assert info.value.node == "far"
