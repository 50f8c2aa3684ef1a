"""The integrity model's matrix: every read path x every damage kind x every place bytes
live, wherever the pair exists (docs/storage.md, "Integrity model").

In each cell the store first gets its usual chance to learn of the damage (the scrub of
the node that holds the bytes, the first open after a reboot of a disk segment, the
identity check of an in-place source), then every read path is asked for the damaged
tensor and for a good one. Each read must end in ``CorruptData`` (``NotFound`` or
``CorruptData`` for an unlinked file: the bytes are gone, not damaged) or return the
right bytes: damaged bytes served, in any cell, 0. A read that returns bytes is
compared with what was committed, byte for byte.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from conftest import open_store, remove_store
from safetensors.torch import load_file, save_file
from test_transport_pull import FaultyTransport

import tensordb
from tensordb.catalog import NodeDirectory
from tensordb.errors import CorruptData, NotFound

A = torch.arange(8192, dtype=torch.float32)  # the tensor that is damaged
B = torch.full((2048,), 7, dtype=torch.int64)  # the one after it in the same file
GOOD = {"a": A, "b": B}

PLACES = ("host", "disk", "host replica", "disk replica", "in-place source")
DAMAGES = ("flip, mtime kept", "flip, mtime changed", "truncate", "unlink")


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


#: a read path: (db, tensor name, scratch dir) -> the bytes it returned
Read = Callable[[tensordb.Database, str, Path], bytes]


def _export(db: tensordb.Database, name: str, tmp: Path) -> bytes:
    out = tmp / f"export-{len(list(tmp.iterdir()))}"
    db.export_safetensors("m", out)
    (path,) = out.iterdir()
    return _bytes(load_file(path)[name])


def _slice_out(db: tensordb.Database, name: str, _tmp: Path) -> bytes:
    good = GOOD[name]
    out = torch.empty(64, dtype=good.dtype)
    db.snapshot("m").slice(name, offsets=(100,), shape=(64,), out=out)
    return _bytes(out)


def _read_into(db: tensordb.Database, name: str, _tmp: Path) -> bytes:
    out = torch.empty_like(GOOD[name])
    db.snapshot("m").read_into({name: out})
    return _bytes(out)


def _to_arrow(db: tensordb.Database, name: str, _tmp: Path) -> bytes:
    data: bytes = db.snapshot("m").to_arrow([name]).column("data")[0].as_py()
    return data


def _dlpack(db: tensordb.Database, name: str, _tmp: Path) -> bytes:
    return _bytes(torch.from_dlpack(db.snapshot("m")[name]))


_TOKEN = "matrix-token-0123456789abcdef"


def _plain_flight(db: tensordb.Database, name: str, _tmp: Path) -> bytes:
    """A pyarrow client's do_get of the head from the node holding the bytes (its
    errors come back as Flight errors whose first line names the class)."""
    import json

    import pyarrow.flight as fl

    import transport

    srv = transport.NodeServer(db, token=_TOKEN, timeout=2.0)
    try:
        client = fl.FlightClient(f"grpc+tcp://127.0.0.1:{srv.port}")
        opts = fl.FlightCallOptions(headers=[(b"authorization", f"Bearer {_TOKEN}".encode())])
        try:
            table = client.do_get(fl.Ticket(json.dumps({"collection": "m"}).encode()),
                                  opts).read_all()
        except fl.FlightError as exc:
            first = str(exc).split(":", 1)[0].strip()
            if first == "CorruptData":
                raise CorruptData(str(exc)) from exc
            if first == "NotFound":
                raise NotFound(str(exc)) from exc
            raise
        finally:
            client.close()
    finally:
        srv.close()
    got = dict(zip(table.column("name").to_pylist(), table.column("data").to_pylist(),
                   strict=True))
    data: bytes = got[name]
    return data


READS: dict[str, Read] = {
    "get": lambda db, n, _t: _bytes(db.get("m", n)),
    "snapshot[name]": lambda db, n, _t: _bytes(db.snapshot("m")[n]),
    "state_dict": lambda db, n, _t: _bytes(db.snapshot("m").state_dict()[n]),
    "get(verify=True)": lambda db, n, _t: _bytes(db.get("m", n, verify=True)),
    "read_into": _read_into,
    "slice view": lambda db, n, _t: _bytes(db.snapshot("m").slice(n, offsets=(100,),
                                                                   shape=(64,))),
    "slice(out=)": _slice_out,
    "to_arrow": _to_arrow,
    "arrow": lambda db, n, _t: db.snapshot("m").arrow(n).to_numpy().tobytes(),
    "dlpack": _dlpack,
    "export_safetensors": _export,
    "plain Flight do_get": _plain_flight,
}

#: what each read path returns of a good tensor (a slice: its box)
EXPECTED = {name: {path: _bytes(t[100:164]) if path.startswith("slice") else _bytes(t)
                   for path in READS} for name, t in GOOD.items()}


class Cell:
    """One place x damage: the reading store (and the other node, for replicas), the
    damaged file, and the store's usual chance to learn of the damage."""

    def __init__(self, tmp: Path, place: str) -> None:
        self.tmp = tmp
        self.place = place
        url = f"sqlite:///{tmp / 'catalog.db'}"
        tier = "disk" if place in ("disk", "disk replica") else "host"
        self.writer = open_store(tmp / "w", url, node="w", default_tier=tier)
        self.stores = [self.writer]
        if place == "in-place source":
            src = tmp / "src" / "model.safetensors"
            src.parent.mkdir()
            save_file(GOOD, str(src))
            self.writer.import_safetensors("m", src, in_place=True)
        else:
            self.writer.commit("m", GOOD)
        self.reader = self.writer
        if place.endswith("replica"):
            self.reader = open_store(tmp / "r", url, node="r", default_tier=tier)
            self.stores.append(self.reader)
            self.reader._flight = FaultyTransport({"w": self.writer})
            NodeDirectory(self.writer.catalog.engine).register("w", "in-process",
                                                               ["host", "disk"], None)
            assert torch.equal(self.reader.get("m", "a"), A)  # a replica on r now
            sid = self.reader.snapshot("m").extents()["a"][0]
            assert NodeDirectory(self.reader.catalog.engine).holders(sid)["r"] == tier
        with self.reader.snapshot("m") as snap:
            sid, self.offset, _ = snap.extents()["a"]
        assert sid is not None
        if place == "in-place source":
            self.path = tmp / "src" / "model.safetensors"
        else:
            self.path = self.reader.tier(tier).path(sid)  # type: ignore[attr-defined]

    def damage(self, kind: str) -> None:
        st = os.stat(self.path)
        if kind.startswith("flip"):
            with open(self.path, "r+b") as fh:
                fh.seek(self.offset + 5)
                b = fh.read(1)
                fh.seek(self.offset + 5)
                fh.write(bytes([b[0] ^ 0xFF]))
            later = st.st_mtime_ns + (0 if kind.endswith("kept") else 10**9)
            os.utime(self.path, ns=(st.st_atime_ns, later))
        elif kind == "truncate":
            os.truncate(self.path, self.offset + 8)
        else:
            os.unlink(self.path)

    def chance(self) -> None:
        """What the store does by itself to learn of damage, where the bytes live."""
        db = self.reader
        if self.place in ("disk", "disk replica"):  # a reboot: the first open checks
            shutil.rmtree(db.config.shm_dir / "integrity")
            db.close()
            self.stores.remove(db)
            db = open_store(db.config.home, db.config.catalog_url, node=db.config.node,
                            default_tier=db.config.default_tier)
            self.stores.append(db)
            if self.place == "disk replica":
                db._flight = FaultyTransport({"w": self.writer})
            self.reader = db
        else:  # shared memory, or a source file: the (background) scrub
            db.scrub()

    def close(self) -> None:
        for db in self.stores:
            remove_store(db)


@pytest.fixture
def cell(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Cell]:
    c = Cell(tmp_path, request.param)
    try:
        yield c
    finally:
        c.close()


def _outcome(db: tensordb.Database, path: str, name: str, tmp: Path) -> str:
    """"right", "refused" (the typed error), or "DAMAGED" (bytes not as committed)."""
    try:
        got = READS[path](db, name, tmp)
    except CorruptData:
        return "refused"
    except NotFound:
        return "gone"
    return "right" if got == EXPECTED[name][path] else "DAMAGED"


@pytest.mark.parametrize("damage", DAMAGES)
@pytest.mark.parametrize("cell", PLACES, indirect=True)
def test_no_read_begun_after_the_store_learns_of_damage_serves_it(cell: Cell,
                                                                  damage: str) -> None:
    cell.damage(damage)
    cell.chance()
    scratch = cell.tmp / "scratch"
    scratch.mkdir()
    outcomes = {(path, name): _outcome(cell.reader, path, name, scratch)
                for path in READS for name in GOOD}
    assert [k for k, v in outcomes.items() if v == "DAMAGED"] == []
    for path in READS:
        a = outcomes[(path, "a")]
        if damage == "unlink":
            # a replica's file gone is pulled again from the writer: the right bytes
            assert a in (("right",) if cell.place.endswith("replica")
                         else ("refused", "gone")), path
        else:
            assert a == "refused", path  # found: refused, never the damaged bytes
        if path in ("export_safetensors", "plain Flight do_get"):
            continue  # a whole version at once: refused as one when any tensor is
        if damage == "truncate" and cell.place != "in-place source" and \
                not cell.place.endswith("replica"):
            assert outcomes[(path, "b")] == "refused", path  # b lay past the new end
        elif cell.place == "in-place source" and damage != "flip, mtime kept":
            # the user's file changed under the store: none of it is trusted any more
            assert outcomes[(path, "b")] in ("refused", "gone"), path
        elif damage not in ("truncate", "unlink"):
            assert outcomes[(path, "b")] == "right", path  # one bad tensor only


@pytest.mark.parametrize("damage", ("flip, mtime kept", "truncate"))
@pytest.mark.parametrize("cell", ("host", "disk"), indirect=True)
def test_another_node_never_takes_damaged_bytes_in_a_pull(cell: Cell, damage: str) -> None:
    """A pull from a holder whose copy is damaged, before the holder knows: the pulling
    node hashes what arrives and keeps none of it (a replication pull's own check)."""
    other = open_store(cell.tmp / "o", cell.writer.config.catalog_url, node="o")
    cell.stores.append(other)
    other._flight = FaultyTransport({"w": cell.writer})
    NodeDirectory(cell.writer.catalog.engine).register("w", "in-process", ["host", "disk"],
                                                       None)
    cell.damage(damage)
    with pytest.raises(CorruptData):
        other.get("m", "a")
    sid = cell.writer.snapshot("m").extents()["a"][0]
    assert "o" not in NodeDirectory(other.catalog.engine).holders(sid or "")


@pytest.mark.parametrize("cell", ("host",), indirect=True)
def test_a_host_flip_no_check_has_seen_is_still_served_zero_copy(cell: Cell) -> None:
    """The model's one window, as documented: shared memory is not hashed per read, so a
    flip no check has seen yet is served until the scrub reaches it (benchmarks/scrub.py
    measures how long the default background scrub takes); after that, refused."""
    cell.damage("flip, mtime kept")
    got = cell.reader.get("m", "a")
    assert _bytes(got) != _bytes(A) and torch.equal(got[2:], A[2:])
    cell.chance()
    with pytest.raises(CorruptData):
        cell.reader.get("m", "a")


def test_the_matrix_covers_every_pair() -> None:
    cells = len(PLACES) * len(DAMAGES) * len(READS)
    assert cells == 240  # the figure docs/testing.md gives
    assert len(set(PLACES)) == len(PLACES) and len(set(READS)) == len(READS)
