"""safetensors import and export: byte-identical round trips, sharded folders, and hostile
files that must give a typed error and leave the store unchanged."""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

import engine_bindings
import tensordb
from engine_bindings import (
    INDEX_NAME,
    LAYOUT_KEY,
    SAFETENSORS_DTYPES,
    export_safetensors,
    import_safetensors,
)
from tensordb.client import _safetensors_format
from tensordb.errors import CorruptData, InvalidInput, TensorDBError


def _random(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Deterministic tensor of any dtype: random bytes viewed as ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    numel = 1
    for d in shape:
        numel *= d
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    raw = torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _writable(dtype: torch.dtype, tmp: Path) -> bool:
    """Whether the installed safetensors can write ``dtype`` (F4 and F8_E8M0 are recent)."""
    try:
        save_file({"t": torch.zeros(2, dtype=torch.uint8).view(dtype) if dtype.itemsize == 1
                   and dtype != torch.bool else torch.zeros(2, dtype=dtype)}, tmp / "probe")
    except (KeyError, ValueError, TypeError):
        return False
    return True


def _all_dtypes(tmp: Path) -> dict[str, torch.Tensor]:
    sd: dict[str, torch.Tensor] = {}
    for i, (st, dt) in enumerate(SAFETENSORS_DTYPES.items()):
        if not _writable(dt, tmp):
            continue
        base = st.lower()
        sd[f"model.{base}.weight"] = _random(dt, (3, 8), seed=i)
        sd[f"model.{base}.bias"] = _random(dt, (5,), seed=100 + i)
        sd[f"model.{base}.scalar"] = _random(dt, (), seed=200 + i) if st != "F4" else \
            _random(dt, (1,), seed=200 + i)
        sd[f"model.{base}.empty"] = _random(dt, (0, 4), seed=0)
    return sd


def _file_header(path: Path) -> dict[str, object]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n])


# -- round trips -----------------------------------------------------------------------
@pytest.mark.parametrize("metadata", [None, {"format": "pt", "b": "2", "a": "1", "zz": "é"}],
                         ids=["no-metadata", "metadata"])
def test_every_dtype_round_trips_byte_identical(db: tensordb.Database, tmp_path: Path,
                                                metadata: dict[str, str] | None) -> None:
    sd = _all_dtypes(tmp_path)
    assert {t.dtype for t in sd.values()} >= {
        torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
        torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.float8_e4m3fn,
        torch.float8_e5m2}
    src = tmp_path / "weights.safetensors"
    save_file(sd, src, metadata=metadata)
    c = import_safetensors(db, "all", src)
    assert (c.version, c.tensors, c.nbytes) == (1, len(sd), sum(t.nbytes for t in sd.values()))
    assert c.metadata is not None and LAYOUT_KEY in c.metadata
    assert {k: v for k, v in c.metadata.items() if k != LAYOUT_KEY} == (metadata or {})
    # safetensors' serialization is reproduced, not the header stored verbatim
    assert "header" not in json.loads(c.metadata[LAYOUT_KEY])["files"][0]
    with db.snapshot("all") as snap:
        got = snap.state_dict()
    assert set(got) == set(sd)
    for name, t in sd.items():
        assert _same(got[name], t), name
    paths = export_safetensors(db, "all", tmp_path / "out")
    assert paths == [tmp_path / "out" / "weights.safetensors"]
    assert paths[0].read_bytes() == src.read_bytes()
    back = load_file(paths[0])
    for name, t in sd.items():
        assert _same(back[name], t), name


def test_export_follows_safetensors_rules_for_a_collection_never_imported(
        db: tensordb.Database, tmp_path: Path) -> None:
    # one metadata key: safetensors' own output has a single possible key order
    sd = {k: v for k, v in _all_dtypes(tmp_path).items() if not k.endswith("scalar")}
    db.commit("plain", sd, metadata={"format": "pt"})
    (out,) = export_safetensors(db, "plain", tmp_path / "out")
    assert out.name == "model.safetensors"
    save_file(sd, tmp_path / "ref.safetensors", metadata={"format": "pt"})
    assert out.read_bytes() == (tmp_path / "ref.safetensors").read_bytes()


def test_zero_d_and_empty_tensors(db: tensordb.Database, tmp_path: Path) -> None:
    sd = {"scalar": torch.tensor(2.5), "empty": torch.zeros(0, 3), "nothing": torch.zeros(0),
          "x": torch.arange(4, dtype=torch.int32)}
    save_file(sd, tmp_path / "s.safetensors")
    import_safetensors(db, "s", tmp_path / "s.safetensors")
    assert db.get("s", "scalar").shape == () and float(db.get("s", "scalar")) == 2.5
    assert db.get("s", "empty").shape == (0, 3) and db.get("s", "nothing").shape == (0,)
    (out,) = export_safetensors(db, "s", tmp_path / "out")
    assert out.read_bytes() == (tmp_path / "s.safetensors").read_bytes()


def test_hand_written_header_is_kept_verbatim(db: tensordb.Database, tmp_path: Path) -> None:
    # a writer other than safetensors: spaces, name order, unaligned offsets
    header = {"b": {"data_offsets": [0, 3], "dtype": "U8", "shape": [3]},
              "a": {"dtype": "F32", "shape": [2], "data_offsets": [3, 11]}}
    text = json.dumps(header, indent=1).encode()
    src = tmp_path / "odd.safetensors"
    src.write_bytes(struct.pack("<Q", len(text)) + text + bytes([1, 2, 3])
                    + struct.pack("<2f", 1.5, -2.0))
    c = import_safetensors(db, "odd", src)
    assert c.metadata is not None and "header" in json.loads(c.metadata[LAYOUT_KEY])["files"][0]
    assert db.get("odd", "a").tolist() == [1.5, -2.0]
    (out,) = export_safetensors(db, "odd", tmp_path / "out")
    assert out.read_bytes() == src.read_bytes()


def _write_sharded(folder: Path, n_shards: int = 3, *, hub_style: bool = False
                   ) -> dict[str, torch.Tensor]:
    folder.mkdir(parents=True, exist_ok=True)
    sd: dict[str, torch.Tensor] = {}
    weight_map: dict[str, str] = {}
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.int64]
    for s in range(n_shards):
        name = f"model-{s + 1:05d}-of-{n_shards:05d}.safetensors"
        part = {f"model.layers.{s}.{k}.weight": _random(dtypes[(s + j) % len(dtypes)],
                                                        (4 + j, 6), seed=10 * s + j)
                for j, k in enumerate(["q", "k", "v", "o"])}
        save_file(part, folder / name, metadata={"format": "pt"})
        sd.update(part)
        weight_map.update(dict.fromkeys(part, name))
    doc = {"metadata": {"total_size": sum(t.nbytes for t in sd.values())},
           "weight_map": weight_map}
    # transformers sorts keys and ends with a newline; another writer (here: unsorted, CRLF)
    # is kept verbatim
    text = (json.dumps(doc, indent=2).replace("\n", "\r\n") if hub_style
            else json.dumps(doc, indent=2, sort_keys=True) + "\n")
    (folder / INDEX_NAME).write_bytes(text.encode())
    return sd


@pytest.mark.parametrize("hub_style", [False, True], ids=["transformers-index", "hub-index"])
def test_sharded_folder_round_trips_in_one_commit(db: tensordb.Database, tmp_path: Path,
                                                  hub_style: bool) -> None:
    src = tmp_path / "ckpt"
    sd = _write_sharded(src, hub_style=hub_style)
    c = import_safetensors(db, "sharded", src)
    assert (c.version, c.tensors) == (1, len(sd)) and len(db.history("sharded")) == 1
    assert c.metadata is not None and c.metadata["format"] == "pt"
    for name, t in sd.items():
        assert _same(db.get("sharded", name), t)
    paths = export_safetensors(db, "sharded", tmp_path / "out")
    assert [p.name for p in paths] == sorted(p.name for p in src.iterdir() if
                                             p.suffix == ".safetensors") + [INDEX_NAME]
    for p in paths:
        assert p.read_bytes() == (src / p.name).read_bytes(), p.name
    # the index file itself is accepted as the path too
    c2 = import_safetensors(db, "again", src / INDEX_NAME)
    assert c2.tensors == len(sd)


def test_export_of_a_later_version_keeps_the_layout(db: tensordb.Database,
                                                    tmp_path: Path) -> None:
    src = tmp_path / "ckpt"
    sd = _write_sharded(src)
    import_safetensors(db, "ft", src)
    changed = "model.layers.1.k.weight"
    new = sd[changed] + 1 if sd[changed].is_floating_point() else sd[changed] * 2
    db.commit("ft", {changed: new}, message="step")
    paths = export_safetensors(db, "ft", tmp_path / "v2")
    for p in paths:
        same = p.read_bytes() == (src / p.name).read_bytes()
        assert same == (p.name not in ("model-00002-of-00003.safetensors",)), p.name
    shard2 = tmp_path / "v2" / "model-00002-of-00003.safetensors"
    assert _file_header(shard2) == _file_header(src / shard2.name)
    assert _same(load_file(shard2)[changed], new)
    # tensors come and go: safetensors loads the result, the index follows
    with db.transaction("ft") as tx:
        tx.delete("model.layers.0.q.weight")
        tx.put("extra.bias", torch.ones(3))
    paths = export_safetensors(db, "ft", tmp_path / "v3")
    index = json.loads((tmp_path / "v3" / INDEX_NAME).read_text())
    assert "model.layers.0.q.weight" not in index["weight_map"]
    assert index["weight_map"]["extra.bias"] == "model-00003-of-00003.safetensors"
    loaded: dict[str, torch.Tensor] = {}
    for p in paths[:-1]:
        loaded.update(load_file(p))
    with db.snapshot("ft") as snap:
        assert set(loaded) == set(index["weight_map"]) == set(snap.keys())
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in loaded.values())
    # version 1 is still exported as imported
    for p in export_safetensors(db, "ft", tmp_path / "v1", version=1):
        assert p.read_bytes() == (src / p.name).read_bytes()


def test_import_replaces_the_collection_contents(db: tensordb.Database, tmp_path: Path) -> None:
    db.commit("r", {"old": torch.ones(2), "a": torch.zeros(2)})
    save_file({"a": torch.ones(2)}, tmp_path / "a.safetensors")
    c = import_safetensors(db, "r", tmp_path / "a.safetensors", message="re-import",
                           tier="disk")
    assert (c.version, c.tensors, c.message) == (2, 1, "re-import")
    with db.snapshot("r") as snap:
        assert list(snap) == ["a"]
    with db.snapshot("r", version=1) as snap:
        assert sorted(snap) == ["a", "old"]


def test_progress_bar(db: tensordb.Database, tmp_path: Path) -> None:
    save_file({"a": torch.ones(1000)}, tmp_path / "p.safetensors")
    import_safetensors(db, "p", tmp_path / "p.safetensors", progress=True)
    (out,) = export_safetensors(db, "p", tmp_path / "out", progress=True)
    assert out.read_bytes() == (tmp_path / "p.safetensors").read_bytes()


def test_public_surface() -> None:
    # the safetensors and torch bindings; other bindings add their own names beside them
    assert set(engine_bindings.__all__) >= {
        "INDEX_NAME", "LAYOUT_KEY", "MAX_HEADER_SIZE", "SAFETENSORS_DTYPES", "LoadReport",
        "commit_module", "export_safetensors", "import_safetensors", "load_module", "shard",
        "shard_bounds", "shard_state_dict"}
    assert all(hasattr(engine_bindings, n) for n in engine_bindings.__all__)
    assert engine_bindings.MAX_HEADER_SIZE == 100_000_000


# -- hostile files ---------------------------------------------------------------------
def _st_file(header: object, data: bytes, *, length: int | None = None,
             raw_header: bytes | None = None) -> bytes:
    text = raw_header if raw_header is not None else json.dumps(header).encode()
    return struct.pack("<Q", len(text) if length is None else length) + text + data


def _valid() -> bytes:
    return _st_file({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                     "b": {"dtype": "I64", "shape": [1], "data_offsets": [8, 16]}}, bytes(16))


def _entry(dtype: str, shape: list[int], begin: int, end: int) -> dict[str, object]:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


HOSTILE: dict[str, tuple[Callable[[], bytes], type[TensorDBError], str | None]] = {
    "truncated-data": (lambda: _valid()[:-5], CorruptData, "b"),
    "truncated-header": (lambda: _valid()[:20], CorruptData, None),
    "tiny-file": (lambda: b"\x01\x00", CorruptData, None),
    "header-over-cap": (lambda: _st_file({}, b"", length=100_000_001), CorruptData, None),
    "header-length-past-eof": (lambda: _st_file({}, b"", length=4096), CorruptData, None),
    "overlapping-offsets": (lambda: _st_file({"a": _entry("F32", [2], 0, 8),
                                              "b": _entry("F32", [2], 4, 12)}, bytes(12)),
                            CorruptData, "b"),
    "gap-between-tensors": (lambda: _st_file({"a": _entry("F32", [2], 0, 8),
                                              "b": _entry("F32", [2], 12, 20)}, bytes(20)),
                            CorruptData, "b"),
    "size-lie": (lambda: _st_file({"a": _entry("F32", [3], 0, 8)}, bytes(8)), CorruptData, "a"),
    "offsets-out-of-bounds": (lambda: _st_file({"a": _entry("U8", [1 << 40], 0, 1 << 40)},
                                               bytes(8)), CorruptData, "a"),
    "end-before-begin": (lambda: _st_file({"a": _entry("U8", [0], 8, 0)}, bytes(8)),
                         CorruptData, "a"),
    "trailing-bytes": (lambda: _st_file({"a": _entry("F32", [2], 0, 8)}, bytes(12)),
                       CorruptData, None),
    "unknown-dtype": (lambda: _st_file({"a": _entry("Q7", [2], 0, 2)}, bytes(2)),
                      InvalidInput, "a"),
    "dtype-without-torch": (lambda: _st_file({"a": _entry("F6_E2M3", [4], 0, 3)}, bytes(3)),
                            InvalidInput, "a"),
    "header-not-json": (lambda: _st_file(None, b"", raw_header=b"{not json}      "),
                        CorruptData, None),
    "header-not-object": (lambda: _st_file([1, 2], b""), CorruptData, None),
    "header-not-utf8": (lambda: _st_file(None, b"", raw_header=b'{"\xff":1}'), CorruptData, None),
    "missing-field": (lambda: _st_file({"a": {"dtype": "F32", "shape": [2]}}, bytes(8)),
                      CorruptData, "a"),
    "negative-dim": (lambda: _st_file({"a": _entry("F32", [-2], 0, 8)}, bytes(8)),
                     CorruptData, "a"),
    "bool-dim": (lambda: _st_file({"a": _entry("U8", [True], 0, 1)}, bytes(1)), CorruptData, "a"),
    "duplicate-name": (lambda: _st_file(None, bytes(8), raw_header=(
        b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},'
        b'"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}')), CorruptData, None),
    "metadata-not-strings": (lambda: _st_file({"__metadata__": {"n": 1},
                                               "a": _entry("U8", [1], 0, 1)}, bytes(1)),
                             CorruptData, None),
    "reserved-metadata-key": (lambda: _st_file({"__metadata__": {LAYOUT_KEY: "x"},
                                                "a": _entry("U8", [1], 0, 1)}, bytes(1)),
                              InvalidInput, None),
    # an empty tensor whose other dimension does not fit int64: it needs 0 bytes, but
    # torch cannot hold its shape (it was committed, and every read raised TypeError)
    "dim-past-int64": (lambda: _st_file({"a": _entry("F32", [0, 2**70], 0, 0)}, b""),
                       InvalidInput, "a"),
    "dim-at-2**63": (lambda: _st_file({"a": _entry("U8", [2**63, 0], 0, 0)}, b""),
                     InvalidInput, "a"),
    "element-count-overflows": (lambda: _st_file({"a": _entry("U8", [0, 2**32, 2**32], 0, 0)},
                                                 b""), InvalidInput, "a"),
    # what a header may put in the catalog is bounded
    "metadata-too-large": (lambda: _st_file({"__metadata__": {"k": "x" * (1 << 20)},
                                             "a": _entry("U8", [1], 0, 1)}, bytes(1)),
                           InvalidInput, None),
    "too-many-tensors": (lambda: _st_file({f"t{i}": _entry("U8", [0], 0, 0)
                                           for i in range(100_001)}, b""), InvalidInput, None),
    "header-over-the-store-cap": (lambda: _st_file(
        None, bytes(1), raw_header=b'{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}'
        + b" " * (16 << 20)), InvalidInput, None),
}


def test_hostile_files_give_typed_errors_and_no_collection(db: tensordb.Database,
                                                          tmp_path: Path) -> None:
    # one store for all cases: a case that left anything behind fails the ones after it too
    db.commit("existing", {"x": torch.ones(2)})
    before, used = db.collections(), db.stats()["host_bytes"]
    for case, (make, error, tensor) in HOSTILE.items():
        bad = tmp_path / f"{case}.safetensors"
        bad.write_bytes(make())
        with pytest.raises(error) as info:
            import_safetensors(db, "victim", bad)
        assert type(info.value) is error, case
        assert str(bad) in str(info.value), case
        if tensor is not None:
            assert info.value.tensor == tensor and repr(tensor) in str(info.value), case
        assert db.collections() == before, case
        # into an existing collection: its head does not move
        with pytest.raises(error):
            import_safetensors(db, "existing", bad)
        assert [c.version for c in db.history("existing")] == [1], case
    assert db.collections() == before
    assert db.stats()["host_bytes"] == used  # not even orphan bytes


def test_a_header_over_the_cap_fails_on_the_cap_not_on_truncation(
        db: tensordb.Database, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A header the file really holds, longer than the cap (lowered here to keep the file
    small): refused for its length, before it is read."""
    path = tmp_path / "big-header.safetensors"
    save_file({f"t{i}": torch.ones(1) for i in range(8)}, path)
    (length,) = struct.unpack("<Q", path.read_bytes()[:8])
    import_safetensors(db, "fits", path)  # under the real cap it imports
    cap = length - 1
    monkeypatch.setattr(_safetensors_format, "MAX_HEADER_SIZE", cap)
    with pytest.raises(CorruptData) as info:
        import_safetensors(db, "victim", path)
    message = str(info.value)
    assert f"header length {length:,} exceeds the cap of {cap:,} bytes" in message
    assert str(path) in message and "truncated" not in message
    assert "victim" not in db.collections()
    # a length past the real cap that the file does not hold: the cap speaks first too
    liar = tmp_path / "liar.safetensors"
    liar.write_bytes(_st_file({}, b"", length=engine_bindings.MAX_HEADER_SIZE + 1))
    monkeypatch.undo()
    with pytest.raises(CorruptData, match=r"exceeds the cap of 100,000,000 bytes"):
        import_safetensors(db, "victim", liar)


def test_hostile_files_name_what_is_wrong(sqlite_db: tensordb.Database,
                                          tmp_path: Path) -> None:
    """The error says what is wrong, not only that something is: the size a tensor spans
    against the size its dtype and shape need, F4's even last dimension, a file no
    longer than its header length (8 bytes hold the length: the empty header is read)."""
    cases: dict[str, tuple[bytes, type[TensorDBError], str]] = {
        "spans": (_st_file({"a": _entry("F32", [1], 0, 4), "b": _entry("F32", [1], 4, 12)},
                           bytes(12)),
                  CorruptData, "tensor 'b' spans 8 bytes but F32 x [1] needs 4"),
        "f4-odd": (_st_file({"a": _entry("F4", [3], 0, 2)}, bytes(2)), InvalidInput,
                   "tensor 'a' is F4 with shape [3]: torch packs F4 in pairs"),
        "f4-0d": (_st_file({"a": _entry("F4", [], 0, 1)}, bytes(1)), InvalidInput,
                  "tensor 'a' is F4 with shape []: torch packs F4 in pairs"),
        "length-only": (struct.pack("<Q", 0), CorruptData, "header is not valid JSON"),
        "seven-bytes": (bytes(7), CorruptData,
                        "7 bytes is too small for a safetensors file"),
    }
    for case, (content, error, says) in cases.items():
        bad = tmp_path / f"{case}.safetensors"
        bad.write_bytes(content)
        with pytest.raises(error) as info:
            import_safetensors(sqlite_db, "victim", bad)
        assert type(info.value) is error and says in str(info.value), (case, info.value)
    assert sqlite_db.collections() == []


@pytest.mark.parametrize("pooled", [False, True], ids=["fresh-file", "pooled-file"])
def test_file_truncated_during_import(db: tensordb.Database, tmp_path: Path,
                                      monkeypatch: pytest.MonkeyPatch, pooled: bool) -> None:
    """A file cut short after its header was read, while the store reads its tensors
    (another process rewriting it): CorruptData naming the file and the tensor, no
    collection, no bytes left; into a fresh segment file (read through a buffer and
    written with pwrite) and into a pooled one (read into its mapping) alike."""
    import storage_engine as se

    src = tmp_path / "m.safetensors"
    save_file({"a": torch.ones(1 << 20), "b": torch.full((1 << 20,), 2.0),
               "c": torch.full((1 << 20,), 3.0)}, str(src))
    db.commit("existing", {"x": torch.ones(2)})
    if pooled:  # a freed file of the import's size waits in the pool
        db.commit("freed", {"w": torch.zeros(3 << 20)})
        db.drop("freed")
        db.gc()
    host = db.tier(db.config.default_tier)
    claimed = host.pool_counters()["claimed"] if isinstance(host, se.Pooling) else 0
    before, used = db.collections(), db.stats()["host_bytes"]
    real = se.fill_from_file

    def fill_from_file(writer: Any, fd: int, *args: Any) -> list[str]:
        with open(src, "r+b") as f:  # cut to its header once it was checked
            f.truncate(64)
        return real(writer, fd, *args)

    monkeypatch.setattr(se, "fill_from_file", fill_from_file)
    with pytest.raises(CorruptData, match="shrank") as info:
        import_safetensors(db, "victim", src)
    assert str(src) in str(info.value) and info.value.tensor in ("a", "b", "c")
    assert db.collections() == before
    assert db.stats()["host_bytes"] == used
    if isinstance(host, se.Pooling) and host.pool_limit:
        assert (host.pool_counters()["claimed"] > claimed) == pooled


def test_hostile_sharded_folders(db: tensordb.Database, tmp_path: Path) -> None:
    before = db.collections()

    def folder(name: str) -> Path:
        _write_sharded(tmp_path / name)
        return tmp_path / name

    missing = folder("missing")
    (missing / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(CorruptData, match="model-00002-of-00003.safetensors"):
        import_safetensors(db, "v", missing)

    lying = folder("lying")
    idx = json.loads((lying / INDEX_NAME).read_text())
    idx["weight_map"]["model.layers.0.q.weight"] = "model-00002-of-00003.safetensors"
    (lying / INDEX_NAME).write_text(json.dumps(idx))
    with pytest.raises(CorruptData) as info:
        import_safetensors(db, "v", lying)
    assert info.value.tensor == "model.layers.0.q.weight"

    escaping = folder("escaping")
    idx = json.loads((escaping / INDEX_NAME).read_text())
    idx["weight_map"]["model.layers.0.q.weight"] = "../missing/model-00001-of-00003.safetensors"
    (escaping / INDEX_NAME).write_text(json.dumps(idx))
    with pytest.raises(CorruptData, match="plain file name"):
        import_safetensors(db, "v", escaping)

    unlisted = folder("unlisted")
    idx = json.loads((unlisted / INDEX_NAME).read_text())
    del idx["weight_map"]["model.layers.2.v.weight"]
    (unlisted / INDEX_NAME).write_text(json.dumps(idx))
    with pytest.raises(CorruptData, match="weight_map"):
        import_safetensors(db, "v", unlisted)

    one_bad = folder("one-bad")
    shard = one_bad / "model-00003-of-00003.safetensors"
    shard.write_bytes(shard.read_bytes()[:-1])
    with pytest.raises(CorruptData, match=re.escape(str(shard))):
        import_safetensors(db, "v", one_bad)

    broken_index = folder("broken-index")
    (broken_index / INDEX_NAME).write_text('{"weight_map": [1, 2]}')
    with pytest.raises(CorruptData, match="weight_map"):
        import_safetensors(db, "v", broken_index)
    assert db.collections() == before


def test_bad_arguments(db: tensordb.Database, tmp_path: Path) -> None:
    with pytest.raises(InvalidInput, match="no such file"):
        import_safetensors(db, "v", tmp_path / "nope.safetensors")
    (tmp_path / "empty").mkdir()
    with pytest.raises(InvalidInput, match="index"):
        import_safetensors(db, "v", tmp_path / "empty")
    save_file({"a": torch.ones(1)}, tmp_path / "ok.safetensors")
    with pytest.raises(InvalidInput):
        import_safetensors(db, "../bad name", tmp_path / "ok.safetensors")
    save_file({"../a": torch.ones(1)}, tmp_path / "badname.safetensors")
    with pytest.raises(InvalidInput):
        import_safetensors(db, "v", tmp_path / "badname.safetensors")
    assert db.collections() == []
    db.commit("c128", {"z": torch.zeros(2, dtype=torch.complex128)})
    with pytest.raises(InvalidInput, match="complex128"):
        export_safetensors(db, "c128", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    with pytest.raises(InvalidInput, match="not a folder"):
        export_safetensors(db, "c128", tmp_path / "ok.safetensors")
