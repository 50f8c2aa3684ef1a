"""Import in place: a local safetensors file (or a sharded folder) committed without a copy.

The store holds a reference to the file (or, where the filesystem has it, a reflinked
clone). A change the store can see makes the version refuse to be served on every read
path; a change it cannot see by stat is caught by a verifying read and ``verify``; gc
forgets a reference and never deletes the user's file; a second process maps the file
zero-copy; another node pulls the bytes through the holder's tier."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import flip_byte, open_store, remove_store
from safetensors.torch import load_file, save_file
from sqlalchemy import func, select

import storage_engine as se
import tensordb
from tensordb.catalog import NodeDirectory
from tensordb.catalog.schema import segment_sources, segments
from tensordb.errors import CorruptData, InvalidInput, NotFound
from transport import LocalTransport

FICLONE = 0x40049409


def _model(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(64, 32, generator=g).to(torch.bfloat16),
        "layers.0.w": torch.randn(32, 32, generator=g),
        "layers.0.norm": torch.randn(32, generator=g).half(),
        "layers.0.mask": torch.randint(0, 2, (5,), generator=g).bool(),  # odd sizes after it
        "layers.0.i8": torch.randint(-100, 100, (7,), dtype=torch.int8, generator=g),
        "position_ids": torch.arange(9, dtype=torch.int64),
        "empty": torch.empty(0, 4),
    }


@pytest.fixture
def model_file(tmp_path: Path) -> Path:
    path = tmp_path / "src" / "model.safetensors"
    path.parent.mkdir()
    save_file(_model(), path, metadata={"format": "pt"})
    return path


def _sharded(folder: Path) -> dict[str, torch.Tensor]:
    sd = _model(1)
    names = sorted(sd)
    shards = {"model-00001-of-00002.safetensors": names[:3],
              "model-00002-of-00002.safetensors": names[3:]}
    folder.mkdir(parents=True)
    weight_map = {}
    for file, part in shards.items():
        save_file({n: sd[n] for n in part}, folder / file, metadata={"format": "pt"})
        weight_map.update({n: file for n in part})
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": sum(t.nbytes for t in sd.values())},
         "weight_map": weight_map}, indent=2))
    return sd


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
        and torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8))
        for k in a)


def _counts(db: tensordb.Database) -> tuple[int, int, list[str]]:
    """Catalog segments and references, and the files the store's tiers hold."""
    with db.catalog.engine.connect() as conn:
        n_seg = conn.execute(select(func.count()).select_from(segments)).scalar() or 0
        n_src = conn.execute(select(func.count()).select_from(segment_sources)).scalar() or 0
    files = sorted(p.name for t in ("host", "disk") for p in db.tier(t).root.glob("*.seg"))
    return n_seg, n_src, files


# -- the happy path ------------------------------------------------------------------------
def test_in_place_import_holds_no_bytes_and_reads_back(db: tensordb.Database,
                                                       model_file: Path) -> None:
    before = model_file.read_bytes()
    c = db.import_safetensors("m", model_file, in_place=True)
    assert c.version == 1 and c.tensors == len(_model()) and c.metadata["format"] == "pt"
    assert _counts(db) == (1, 1, [])  # one segment, a reference, no file of the store's
    src = db.catalog.segment_source(db.catalog.version_segments(
        db.catalog.require("m").id, 1)[0][0])
    assert src is not None and src.path == str(model_file.resolve())
    assert src.nbytes == model_file.stat().st_size
    with db.snapshot("m", verify=True) as snap:
        assert _same(snap.state_dict(), load_file(model_file))
        outs = {n: torch.empty_like(t) for n, t in load_file(model_file).items()}
        snap.read_into(outs)
        assert _same(outs, load_file(model_file))
        table = snap.to_arrow()
        got = dict(zip(table.column("name").to_pylist(), table.column("data").to_pylist(),
                       strict=True))
        assert got["position_ids"] == np.arange(9, dtype=np.int64).tobytes()
    assert db.verify() == []
    # the export of the version is the file itself, byte for byte
    out = db.export_safetensors("m", model_file.parent.parent / "out")
    assert [p.read_bytes() for p in out] == [before]
    assert model_file.read_bytes() == before  # never written


def test_sharded_folder_in_place(sqlite_db: tensordb.Database, tmp_path: Path) -> None:
    sd = _sharded(tmp_path / "hf")
    c = sqlite_db.import_safetensors("m", tmp_path / "hf", in_place=True)
    assert c.tensors == len(sd)
    assert _counts(sqlite_db)[:2] == (2, 2)  # a segment (a reference) per shard
    assert _same(sqlite_db.snapshot("m").state_dict(), sd)
    out = sqlite_db.export_safetensors("m", tmp_path / "out")
    assert sorted(p.name for p in out) == sorted(p.name for p in (tmp_path / "hf").iterdir())
    for p in out:
        assert p.read_bytes() == (tmp_path / "hf" / p.name).read_bytes()


def test_in_place_version_replaces_the_head_and_deletes_stale_names(
        sqlite_db: tensordb.Database, model_file: Path) -> None:
    sqlite_db.commit("m", {"old": torch.ones(3), "layers.0.w": torch.zeros(2)})
    c = sqlite_db.import_safetensors("m", model_file, in_place=True)
    assert c.version == 2
    with sqlite_db.snapshot("m") as snap:
        assert sorted(snap) == sorted(_model())
    assert torch.equal(sqlite_db.get("m", "old", version=1), torch.ones(3))


def test_cli_import_in_place(tmp_path: Path, model_file: Path) -> None:
    from typer.testing import CliRunner

    from tensordb import cli

    home = tmp_path / "store"
    env = {"COLUMNS": "200", "TENSORDB_HOME": None}
    r = CliRunner(env=env).invoke(cli.app, ["--home", str(home), "import", "m",
                                            str(model_file), "--in-place"])
    assert r.exit_code == 0, r.output
    with tensordb.connect(home=home) as db:
        assert _counts(db)[:2] == (1, 1)
        assert _same(db.snapshot("m").state_dict(), load_file(model_file))
    flip_byte(model_file, model_file.stat().st_size - 1)  # the last tensor's last byte
    r = CliRunner(env=env).invoke(cli.app, ["--home", str(home), "verify"])
    assert r.exit_code == 1 and "changed since it was committed" in " ".join(r.output.split())
    shutil.rmtree(tensordb.connect(home=home).config.shm_dir, ignore_errors=True)


# -- a changed source file is never served ------------------------------------------------
def _modify(p: Path) -> None:
    flip_byte(p, p.stat().st_size - 1)


def _truncate(p: Path) -> None:
    os.truncate(p, p.stat().st_size - 5)


def _delete(p: Path) -> None:
    p.unlink()


def _replace(p: Path) -> None:  # the same bytes, another file (a re-save, a re-download)
    tmp = p.with_suffix(".tmp")
    shutil.copyfile(p, tmp)
    os.replace(tmp, p)


def _touch(p: Path) -> None:
    st = p.stat()
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))


CHANGES: dict[str, Callable[[Path], None]] = {"modified": _modify, "truncated": _truncate,
                                               "deleted": _delete, "replaced": _replace,
                                               "touched": _touch}


def _read_paths(db: tensordb.Database, out: Path) -> dict[str, Callable[[], Any]]:
    def read_into() -> None:
        with db.snapshot("m") as snap:
            snap.read_into({"layers.0.w": torch.empty(32, 32)})

    def getitem() -> None:
        with db.snapshot("m") as snap:
            snap["layers.0.w"]

    def state_dict() -> None:
        with db.snapshot("m") as snap:
            snap.state_dict()

    def to_arrow() -> None:
        with db.snapshot("m") as snap:
            snap.to_arrow()

    def arrow() -> None:
        with db.snapshot("m") as snap:
            snap.arrow("layers.0.w")

    return {"get": lambda: db.get("m", "layers.0.w"),
            "get verified": lambda: db.get("m", "embed.weight", verify=True),
            "snapshot[name]": getitem, "state_dict": state_dict, "read_into": read_into,
            "to_arrow": to_arrow, "arrow": arrow,
            "export_safetensors": lambda: db.export_safetensors("m", out),
            "pin to host": lambda: db.pin("m", tier="host")}


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_a_changed_source_is_never_served(db: tensordb.Database, model_file: Path,
                                          tmp_path: Path, change: str) -> None:
    db.import_safetensors("m", model_file, in_place=True)
    assert db.get("m", "layers.0.w").shape == (32, 32)  # mapped once before the change
    CHANGES[change](model_file)
    for path, read in _read_paths(db, tmp_path / "out").items():
        with pytest.raises(CorruptData) as info:
            read()
        msg = str(info.value)
        assert str(model_file.resolve()) in msg and "changed since it was committed" in msg, \
            (path, msg)
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())
    assert db.pins() == [] and _counts(db)[:2] == (1, 1)  # the failed pin moved nothing
    problems = db.verify()
    assert {p.tensor for p in problems} == {n for n, t in _model().items() if t.nbytes}
    assert all(str(model_file.resolve()) in p.reason for p in problems)


def test_a_change_stat_cannot_see_is_caught_by_checksums(sqlite_db: tensordb.Database,
                                                         model_file: Path) -> None:
    sqlite_db.import_safetensors("m", model_file, in_place=True)
    st = model_file.stat()
    offset = model_file.stat().st_size - 1  # the last byte of the last tensor in the file
    flip_byte(model_file, offset)
    os.utime(model_file, ns=(st.st_atime_ns, st.st_mtime_ns))  # the same size and mtime
    bad = [p for p in sqlite_db.verify()]
    assert len(bad) == 1 and bad[0].reason.startswith("checksum")
    with pytest.raises(CorruptData, match="fail their checksum"):
        sqlite_db.get("m", bad[0].tensor, verify=True)
    with pytest.raises(CorruptData), sqlite_db.snapshot("m", verify=True) as snap:
        snap.state_dict()


def test_a_file_changed_while_it_is_hashed_is_not_committed(
        sqlite_db: tensordb.Database, model_file: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    from tensordb.client import _write

    hash_in_place = _write._hash_in_place

    def then_touch(*args: Any) -> dict[str, str]:
        out = hash_in_place(*args)
        _touch(model_file)
        return out

    monkeypatch.setattr(_write, "_hash_in_place", then_touch)
    with pytest.raises(CorruptData, match="changed while it was committed in place"):
        sqlite_db.import_safetensors("m", model_file, in_place=True)
    assert sqlite_db.collections() == [] and _counts(sqlite_db) == (0, 0, [])


# -- bad inputs: a typed error, and the store unchanged -----------------------------------
def test_bad_inputs_leave_the_store_unchanged(db: tensordb.Database, model_file: Path,
                                             tmp_path: Path) -> None:
    db.commit("m", {"w": torch.ones(2)})
    before = (_counts(db), db.history("m"))
    empty = tmp_path / "empty"
    empty.mkdir()
    two = tmp_path / "two"
    two.mkdir()
    for n in ("a", "b"):
        save_file({"x": torch.ones(1)}, two / f"{n}.safetensors")
    bad_header = tmp_path / "bad.safetensors"
    bad_header.write_bytes((1 << 40).to_bytes(8, "little") + b"{}")
    fifo = tmp_path / "fifo.safetensors"
    os.mkfifo(fifo)
    cases: list[tuple[type[Exception], str, Callable[[], Any]]] = [
        (InvalidInput, "in_place must be True or False",
         lambda: db.import_safetensors("m", model_file, in_place="yes")),  # type: ignore[arg-type]
        (InvalidInput, "held by the disk tier",
         lambda: db.import_safetensors("m", model_file, in_place=True, tier="host")),
        (InvalidInput, "no such file",
         lambda: db.import_safetensors("m", "hf://org/model", in_place=True)),
        (InvalidInput, "no such file",
         lambda: db.import_safetensors("m", tmp_path / "nope.safetensors", in_place=True)),
        (InvalidInput, "needs model.safetensors.index.json",
         lambda: db.import_safetensors("m", empty, in_place=True)),
        (InvalidInput, "needs model.safetensors.index.json",
         lambda: db.import_safetensors("m", two, in_place=True)),
        (InvalidInput, "not a regular file",
         lambda: db.import_safetensors("m", fifo, in_place=True)),
        (CorruptData, "header", lambda: db.import_safetensors("m", bad_header, in_place=True)),
        (InvalidInput, "collection",
         lambda: db.import_safetensors("", model_file, in_place=True)),
    ]
    for kind, text, call in cases:
        with pytest.raises(kind, match=text):
            call()
        assert (_counts(db), db.history("m")) == before
    assert model_file.exists()


# -- gc, pins ------------------------------------------------------------------------------
def test_gc_forgets_a_reference_and_never_deletes_the_file(db: tensordb.Database,
                                                          model_file: Path) -> None:
    before = model_file.read_bytes()
    db.import_safetensors("m", model_file, in_place=True)
    db.import_safetensors("n", model_file, in_place=True)  # two versions, one file
    db.drop("m")
    report = db.gc()
    assert report.segments_deleted == 1 and report.bytes_freed == 0
    assert _counts(db)[:2] == (1, 1) and model_file.read_bytes() == before
    assert _same(db.snapshot("n").state_dict(), load_file(model_file))
    db.drop("n")
    db.gc()
    assert _counts(db) == (0, 0, []) and model_file.read_bytes() == before


def test_a_pin_copies_the_bytes_in_and_drops_the_reference(sqlite_db: tensordb.Database,
                                                           model_file: Path) -> None:
    sqlite_db.import_safetensors("m", model_file, in_place=True)
    sqlite_db.pin("m", tier="host")
    n_seg, n_src, files = _counts(sqlite_db)
    assert (n_seg, n_src, len(files)) == (1, 0, 1)  # the store's own copy, in shm
    _modify(model_file)  # the store no longer depends on it
    assert sqlite_db.verify() == []
    assert sqlite_db.get("m", "layers.0.w", verify=True).shape == (32, 32)


# -- reflink: the clone is the store's own file --------------------------------------------
def _fake_ioctl(result: int | None) -> Callable[..., Any]:
    """An ``fcntl.ioctl`` whose FICLONE fails with ``result`` (an errno), or, for None,
    clones by copying the bytes (what a reflink looks like from above)."""
    real = fcntl.ioctl

    def ioctl(fd: int, request: int, arg: Any = 0, *rest: Any) -> Any:
        if request != FICLONE:
            return real(fd, request, arg, *rest)
        if result is not None:
            raise OSError(result, os.strerror(result))
        size = os.fstat(arg).st_size
        done = 0
        while done < size:
            done += os.copy_file_range(arg, fd, size - done, done, done)
        return 0

    return ioctl


def test_a_reflinked_import_is_the_stores_own_copy(sqlite_db: tensordb.Database,
                                                   model_file: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fcntl, "ioctl", _fake_ioctl(None))
    before = model_file.read_bytes()
    sqlite_db.import_safetensors("m", model_file, in_place=True)
    n_seg, n_src, files = _counts(sqlite_db)
    assert (n_seg, n_src) == (1, 0) and len(files) == 1  # a clone in the disk tier
    clone = sqlite_db.tier("disk").root / files[0]
    assert clone.read_bytes() == before and clone.stat().st_mode & 0o777 == 0o600
    _modify(model_file)  # later edits of the original never reach the clone
    _touch(model_file)
    assert sqlite_db.verify() == []
    assert _same(sqlite_db.snapshot("m", verify=True).state_dict(), _model())
    sqlite_db.drop("m")
    assert sqlite_db.gc().bytes_freed == len(before)  # the clone is deleted ...
    assert _counts(sqlite_db) == (0, 0, []) and model_file.exists()  # ... the original kept


@pytest.mark.parametrize("err", [errno.EOPNOTSUPP, errno.EXDEV, errno.EINVAL, errno.ENOTTY])
def test_no_reflink_falls_back_to_a_reference(sqlite_db: tensordb.Database, model_file: Path,
                                              monkeypatch: pytest.MonkeyPatch,
                                              err: int) -> None:
    monkeypatch.setattr(fcntl, "ioctl", _fake_ioctl(err))
    sqlite_db.import_safetensors("m", model_file, in_place=True)
    assert _counts(sqlite_db) == (1, 1, [])


def test_a_reflink_that_fails_otherwise_leaves_nothing(sqlite_db: tensordb.Database,
                                                       model_file: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fcntl, "ioctl", _fake_ioctl(errno.EIO))
    with pytest.raises(InvalidInput, match="cannot commit in place"):
        sqlite_db.import_safetensors("m", model_file, in_place=True)
    assert sqlite_db.collections() == [] and _counts(sqlite_db) == (0, 0, [])


# -- the storage engine's part ----------------------------------------------------------
def test_disk_tier_references(tmp_path: Path, model_file: Path) -> None:
    records: dict[str, se.SourceFile] = {}
    tier = se.DiskTier(tmp_path / "disk", sources=records.get)
    fd = os.open(model_file, os.O_RDONLY)
    try:
        a = tier.adopt("ref1", fd, str(model_file))
    finally:
        os.close(fd)
    assert not a.reflinked and a.nbytes == model_file.stat().st_size
    with pytest.raises(se.SegmentMissing):
        tier.open("ref1")  # not recorded (yet): not a segment of this tier
    records["ref1"] = a.source
    a.release()
    data = model_file.read_bytes()
    view = tier.open("ref1")
    assert bytes(view) == data and isinstance(view, se.HostView)
    view[0] = 0  # copy-on-write: the reader's write stays in its own pages
    assert model_file.read_bytes() == data
    assert tier.peek("ref1", [(0, 8)]) == [data[:8]]
    out = np.empty(16, np.uint8)
    assert tier.read_into("ref1", [(8, out)]) and out.tobytes() == data[8:24]
    assert list(tier.segments()) == [] and tier.used_bytes() == 0  # holds no bytes
    _touch(model_file)
    for call in (lambda: tier.open("ref1"), lambda: tier.peek("ref1", [(0, 1)]),
                 lambda: tier.read_into("ref1", [(0, out)])):
        with pytest.raises(se.SourceChanged, match="mtime_ns") as info:
            call()
        assert info.value.path == str(model_file) and info.value.segment_id == "ref1"
    assert tier.delete("ref1") is False and model_file.exists()  # never the user's file
    model_file.unlink()
    with pytest.raises(se.SourceChanged, match="deleted"):
        tier.open("ref1")


# -- other processes, other nodes ----------------------------------------------------------
_CHILD = r"""
import json, sys
import tensordb
db = tensordb.connect(home=sys.argv[1])
with db.snapshot("m") as snap:
    sd = snap.state_dict()
maps = []
with open("/proc/self/maps") as fh:
    for line in fh:
        parts = line.split(None, 5)
        if len(parts) == 6 and parts[5].strip() == sys.argv[2]:
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            maps.append((lo, hi))
inside = sum(any(lo <= t.data_ptr() < hi for lo, hi in maps) for t in sd.values() if t.numel())
print(json.dumps({"tensors": sum(1 for t in sd.values() if t.numel()), "inside": inside,
                  "sum": float(sd["layers.0.w"].sum())}))
db.close()
"""


def test_a_second_process_maps_the_file_zero_copy(tmp_path: Path, model_file: Path) -> None:
    home = tmp_path / "store"
    with tensordb.connect(home=home) as db:
        db.import_safetensors("m", model_file, in_place=True)
        shm = db.config.shm_dir
    try:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        out = subprocess.run([sys.executable, "-c", _CHILD, str(home),
                              str(model_file.resolve())], capture_output=True, text=True,
                             check=True, env=env, timeout=120)
        got = json.loads(out.stdout.strip().splitlines()[-1])
        assert got["tensors"] == got["inside"] == sum(1 for t in _model().values()
                                                       if t.numel())
        assert got["sum"] == pytest.approx(float(_model()["layers.0.w"].sum()))
    finally:
        shutil.rmtree(shm, ignore_errors=True)


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[tuple[tensordb.Database, tensordb.Database,
                                             tensordb.Database]]:
    """Node "w" imports in place; nodes "r" and "s" read through it (one catalog)."""
    url = f"sqlite:///{tmp_path / 'catalog.db'}"
    w = open_store(tmp_path / "w", url, node="w")
    r = open_store(tmp_path / "r", url, node="r")
    s = open_store(tmp_path / "s", url, node="s")
    fake = LocalTransport()
    fake.add(w)
    r._flight = s._flight = fake
    NodeDirectory(w.catalog.engine).register("w", "in-process", ["host", "disk"], None)
    try:
        yield w, r, s
    finally:
        for db in (s, r, w):
            remove_store(db)


def test_another_node_pulls_the_bytes_through_the_reference(nodes, model_file: Path  # type: ignore[no-untyped-def]
                                                            ) -> None:
    w, r, s = nodes
    w.import_safetensors("m", model_file, in_place=True)
    assert _same(r.snapshot("m", verify=True).state_dict(), load_file(model_file))
    (seg,) = [sid for sid, _ in NodeDirectory(w.catalog.engine).version_segments(
        w.catalog.require("m").id, 1)]
    assert NodeDirectory(r.catalog.engine).holders(seg) == {"w": "disk", "r": "disk"}
    assert r.catalog.segment_source(seg) is None  # r's copy is its own file
    assert (r.tier("disk").root / f"{seg}.seg").read_bytes() == model_file.read_bytes()
    _modify(model_file)
    assert r.verify() == [] and r.get("m", "layers.0.w", verify=True).shape == (32, 32)
    with pytest.raises(CorruptData, match="changed since it was committed"):
        w.get("m", "layers.0.w")
    with pytest.raises(CorruptData, match="changed since it was committed"):
        s.get("m", "layers.0.w")  # the holder refuses to send a changed file
    assert NodeDirectory(s.catalog.engine).holders(seg) == {"w": "disk", "r": "disk"}
    assert list(s.tier("disk").root.glob("*.seg")) == []
    with pytest.raises(NotFound):
        s.get("m", "nope")


def test_tensors_at_odd_offsets_are_served_where_they_lie(sqlite_db: tensordb.Database,
                                                         tmp_path: Path) -> None:
    # another writer's file: no padding, an f32 tensor 3 bytes into the data, f16 at 19
    a = np.arange(3, dtype=np.int8)
    b = np.arange(4, dtype=np.float32) + 0.5
    c = np.arange(5, dtype=np.float16)
    header = json.dumps({"a": {"dtype": "I8", "shape": [3], "data_offsets": [0, 3]},
                         "b": {"dtype": "F32", "shape": [4], "data_offsets": [3, 19]},
                         "c": {"dtype": "F16", "shape": [5], "data_offsets": [19, 29]}},
                        separators=(",", ":")).encode()
    path = tmp_path / "odd.safetensors"
    path.write_bytes(len(header).to_bytes(8, "little") + header + a.tobytes() + b.tobytes()
                     + c.tobytes())
    sqlite_db.import_safetensors("odd", path, in_place=True)
    with sqlite_db.snapshot("odd", verify=True) as snap:
        got = snap.state_dict()
    assert got["a"].tolist() == a.tolist() and got["b"].tolist() == b.tolist()
    assert got["c"].tolist() == c.tolist()
    assert sqlite_db.export_safetensors("odd", tmp_path / "out")[0].read_bytes() \
        == path.read_bytes()


def test_a_commit_after_the_source_changed_stores_its_bytes_anew(
        sqlite_db: tensordb.Database, model_file: Path) -> None:
    sqlite_db.import_safetensors("m", model_file, in_place=True)
    same = load_file(model_file)
    c = sqlite_db.commit("m", {"layers.0.w": same["layers.0.w"].clone()})
    assert c.written == 0  # unchanged bytes share the in-place extent while the file holds
    _touch(model_file)
    c = sqlite_db.commit("m", {"layers.0.w": same["layers.0.w"].clone()})
    assert c.written == 1  # not deduplicated against a segment that is not served
    assert torch.equal(sqlite_db.get("m", "layers.0.w", verify=True), same["layers.0.w"])


def test_a_file_that_grew_after_its_header_was_read_is_not_committed(
        sqlite_db: tensordb.Database, model_file: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    adopt = se.DiskTier.adopt

    def grow_first(self: se.DiskTier, segment_id: str, fd: int, path: str) -> se.Adoption:
        with open(path, "ab") as fh:
            fh.write(b"\0" * 10)
        return adopt(self, segment_id, fd, path)

    monkeypatch.setattr(se.DiskTier, "adopt", grow_first)
    with pytest.raises(CorruptData, match="changed while it was committed in place"):
        sqlite_db.import_safetensors("m", model_file, in_place=True)
    assert sqlite_db.collections() == [] and _counts(sqlite_db) == (0, 0, [])


def test_flight_and_the_data_plane_send_a_reference_or_refuse_it(tmp_path: Path,
                                                                 model_file: Path) -> None:
    import transport

    db = open_store(tmp_path / "w", node="w")
    server = transport.NodeServer(db, chunk_bytes=64 << 10, timeout=5.0)
    client = transport.FlightTransport(None, timeout=5.0)
    try:
        db.import_safetensors("m", model_file, in_place=True)
        info = db.catalog.require("m")
        (sid,) = [s for s, _ in NodeDirectory(db.catalog.engine).version_segments(info.id, 1)]
        address = f"127.0.0.1:{server.port}"
        data = model_file.read_bytes()
        got: list[bytes] = []
        client.read_segment("w", address, sid, 0, len(data), lambda v: got.append(bytes(v)))
        assert b"".join(got) == data  # Flight
        dst = np.empty(len(data), np.uint8)
        client.read_segment_into("w", address, sid, 0, dst, lambda n: None)
        assert dst.tobytes() == data  # the data plane
        _touch(model_file)
        with pytest.raises(CorruptData, match="changed since it was committed"):
            client.read_segment("w", address, sid, 0, len(data), lambda v: None)
        with pytest.raises(CorruptData, match="changed since it was committed"):
            client.read_segment_into("w", address, sid, 0, dst, lambda n: None)
    finally:
        client.close()
        server.close()
        remove_store(db)
