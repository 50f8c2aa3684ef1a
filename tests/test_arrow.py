"""Arrow and DLPack: the tensors of a version (and KV blocks, and a query's selection) as
Arrow buffers over the same bytes as the torch views, and the torch views handed on,
zero-copy, to numpy, JAX and CuPy (docs/arrow.md)."""

from __future__ import annotations

import gc
import importlib.util
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch
from conftest import flip_byte, open_store, remove_store
from cuda_standin import installed

import tensordb
from storage_engine import _cuda
from tensordb import KVCache
from tensordb.arrow import BLOCK_SCHEMA, LAYOUT, TENSOR_SCHEMA, numpy_dtype
from tensordb.client._inputs import DTYPES
from tensordb.errors import CorruptData, InvalidInput, NotFound, StoreClosed

KiB = 1024
#: dtypes Arrow has tensors of; the others come back as their bytes (docs/arrow.md)
NATIVE = {"uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
          "float16", "float32", "float64"}
FALLBACK = {"bool": "uint8", "bfloat16": "uint16", "complex32": "uint32",
            "complex64": "uint64", "complex128": "uint8", "float8_e4m3fn": "uint8",
            "float8_e4m3fnuz": "uint8", "float8_e5m2": "uint8", "float8_e5m2fnuz": "uint8",
            "float8_e8m0fnu": "uint8", "float4_e2m1fn_x2": "uint8"}


def _tensor(dtype: torch.dtype, seed: int, shape: tuple[int, ...] = (3, 8)) -> torch.Tensor:
    """Random bytes viewed as ``dtype`` (any bit pattern: NaNs included, bools 0/1)."""
    n = int(np.prod(shape)) * dtype.itemsize
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 2 if dtype == torch.bool else 256, (n,), dtype=torch.uint8,
                        generator=g)
    return raw.view(dtype).reshape(shape)


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _model() -> dict[str, torch.Tensor]:
    out = {f"t.{name}": _tensor(dt, i) for i, (name, dt) in enumerate(DTYPES.items())}
    out["scalar"] = torch.tensor(2.5)
    out["empty"] = torch.zeros(0, 4)
    return out


def _data(table: pa.Table, i: int) -> pa.Buffer:
    """The data buffer of row ``i`` (its own chunk)."""
    return table.column("data").chunk(i).buffers()[2]


def _leases(db: tensordb.Database) -> list[tuple[str, int]]:
    return sorted((c, v) for _, c, v, _ in db.catalog.lease_holders())


def test_every_dtype_has_a_layout() -> None:
    assert set(DTYPES) <= NATIVE | set(FALLBACK)
    for name in DTYPES:
        np_dtype, tail = numpy_dtype(name)
        assert np_dtype.itemsize * tail == DTYPES[name].itemsize, name


# -- Snapshot.to_arrow --------------------------------------------------------------------
def test_to_arrow_is_the_torch_views_bytes_for_every_dtype(db: tensordb.Database) -> None:
    model = _model()
    db.commit("m", model)
    with db.snapshot("m") as snap:
        table = snap.to_arrow()
        sd = snap.state_dict()
        extents = snap.extents()
    assert table.schema.equals(TENSOR_SCHEMA)  # metadata aside
    assert table.schema.metadata == {b"tensordb.layout": LAYOUT.encode(),
                                     b"tensordb.collection": b"m", b"tensordb.version": b"1"}
    assert table.column("name").to_pylist() == sorted(model)
    assert table.column("data").num_chunks == len(model)  # one chunk per tensor
    for i, row in enumerate(table.drop_columns("data").to_pylist()):
        name, t = row["name"], model[row["name"]]
        assert row["dtype"] == str(t.dtype).removeprefix("torch."), name
        assert row["shape"] == list(t.shape) and row["nbytes"] == t.nbytes, name
        assert row["checksum"] == extents[name][2], name
        buf = _data(table, i)
        assert buf.to_pybytes() == _bytes(t), name
        if t.nbytes:  # no copy: the very bytes the torch view maps
            assert buf.address == sd[name].data_ptr(), name


def test_to_arrow_before_the_torch_views_shares_their_mapping(db: tensordb.Database) -> None:
    db.commit("m", {"a": torch.arange(100.0), "b": torch.ones(7, dtype=torch.int16)})
    with db.snapshot("m") as snap:
        table = snap.to_arrow()  # maps first: the views made after share the mapping
        assert [_data(table, i).address for i in range(2)] == \
            [snap["a"].data_ptr(), snap["b"].data_ptr()]
        again = snap.to_arrow()
        assert _data(again, 0).address == _data(table, 0).address


def test_to_arrow_of_the_disk_tier_and_of_an_evicted_version(db: tensordb.Database) -> None:
    db.commit("d", {"a": torch.arange(100.0), "b": torch.ones(7, dtype=torch.int16)},
              tier="disk")
    db.commit("h", {"a": torch.arange(50.0)})
    db.evict("h", tier="host")  # its segment moves to the disk tier
    for name in ("d", "h"):
        with db.snapshot(name) as snap:
            assert {r.tier for r in snap._rows.values()} == {"disk"}
            table = snap.to_arrow()
            for i, row in enumerate(table.to_pylist()):
                t = snap[row["name"]]
                assert _data(table, i).address == t.data_ptr()
                assert row["data"] == _bytes(t)


def test_to_arrow_names_pick_rows_in_order(sqlite_db: tensordb.Database) -> None:
    db = sqlite_db
    db.commit("m", {"a": torch.arange(4.0), "b": torch.ones(2), "c": torch.zeros(3)})
    with db.snapshot("m") as snap:
        table = snap.to_arrow(["c", "a"])
        assert table.column("name").to_pylist() == ["c", "a"]
        assert _data(table, 0).to_pybytes() == _bytes(torch.zeros(3))
        assert _data(table, 1).address == snap["a"].data_ptr()
        assert snap.to_arrow([]).num_rows == 0
        assert snap.to_arrow(("b",)).column("name").to_pylist() == ["b"]


def test_to_arrow_bad_names_are_typed_errors_and_change_nothing(
        db: tensordb.Database) -> None:
    db.commit("m", {"a": torch.arange(4.0), "b": torch.ones(2)})
    snap = db.snapshot("m")
    before = _leases(db)
    with pytest.raises(NotFound) as info:
        snap.to_arrow(["a", "nope", "gone"])
    assert "'nope'" in str(info.value) and "'gone'" in str(info.value)
    assert info.value.tensor == "nope" and info.value.collection == "m"
    for bad in ("a", {"a": 1}, [1], ["a", None], 3):
        with pytest.raises(InvalidInput):
            snap.to_arrow(bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidInput, match="twice"):
        snap.to_arrow(["a", "b", "a"])
    with pytest.raises(NotFound):
        snap.arrow("nope")
    with pytest.raises(InvalidInput):
        snap.arrow(3)  # type: ignore[arg-type]
    assert _leases(db) == before and snap.to_arrow().num_rows == 2
    snap.close()
    with pytest.raises(StoreClosed):
        snap.to_arrow()
    with pytest.raises(StoreClosed):
        snap.arrow("a")


def test_arrow_buffers_outlive_close_drop_gc_and_db_close(db: tensordb.Database) -> None:
    model = _model()
    db.commit("m", model)
    snap = db.snapshot("m")
    table = snap.to_arrow()
    tensor = snap.arrow("t.float32")
    expected = [_data(table, i).to_pybytes() for i in range(table.num_rows)]
    snap.close()
    db.drop("m")
    report = db.gc()
    assert report.segments_deleted >= 1  # the bytes are gone from the store...
    db.commit("other", {f"x{i}": torch.full((4096,), 9.0) for i in range(8)})  # reuse
    gc.collect()
    # ...and the buffers still hold them, unchanged
    assert [_data(table, i).to_pybytes() for i in range(table.num_rows)] == expected
    assert np.array_equal(tensor.to_numpy(), model["t.float32"].numpy())
    db.close()
    assert [_data(table, i).to_pybytes() for i in range(table.num_rows)] == expected


def test_to_arrow_verify_catches_a_flipped_byte(sqlite_db: tensordb.Database) -> None:
    db = sqlite_db
    db.commit("cor", {"a": torch.ones(1024), "b": torch.zeros(1024)})
    (sid,) = list(db.tier("host").segments())
    flip_byte(db.tier("host").path(sid), 10)
    with db.snapshot("cor", verify=True) as snap:
        with pytest.raises(CorruptData) as info:
            snap.to_arrow()
        assert info.value.tensor == "a"
        with pytest.raises(CorruptData):
            snap.arrow("a")
        assert snap.to_arrow(["b"]).num_rows == 1
    with db.snapshot("cor") as snap:  # verify off: the damage found above is marked
        with pytest.raises(CorruptData) as info:
            snap.to_arrow()
        assert info.value.tensor == "a"
        assert snap.to_arrow(["b"]).num_rows == 1


def test_gpu_tier_rows_come_back_as_host_copies(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """On the stand-in CUDA runtime (tests/cuda_standin.py): a GPU-tier row is copied to
    the host, that row's bytes only (not its segment), and the copy outlives the
    snapshot and the store."""
    # the process caches whether a GPU tier can run: probe again, on the stand-in
    monkeypatch.setattr(_cuda, "_probe_result", False)
    with installed(tmp_path / "fake-cuda"):
        db = open_store(tmp_path / "store", gpu_device=0)
        try:
            model = {"a": torch.arange(10.0), "b": _tensor(torch.bfloat16, 1)}
            db.commit("g", model, tier="gpu")
            with db.snapshot("g", verify=True) as snap:
                table = snap.to_arrow()
                bf = snap.arrow("b")
                one = snap.to_arrow(["b"])
                assert snap._maps and all(v.on_device for v in snap._maps.values())
            data = _data(one, 0)  # a buffer of the row's own bytes, not a slice of more
            assert data.parent is None and data.size == model["b"].nbytes
            assert [_data(table, i).to_pybytes() for i in range(2)] == \
                [_bytes(model["a"]), _bytes(model["b"])]
            assert str(bf.type) == "uint16" and bf.to_numpy().tobytes() == _bytes(model["b"])
        finally:
            remove_store(db)
        assert _data(table, 0).to_pybytes() == _bytes(model["a"])


# -- Snapshot.arrow -----------------------------------------------------------------------
def test_arrow_tensor_zero_copy_and_fallback_dtypes(db: tensordb.Database) -> None:
    model = _model()
    db.commit("m", model)
    with db.snapshot("m") as snap:
        for name, t in model.items():
            a = snap.arrow(name)
            dtype = str(t.dtype).removeprefix("torch.")
            arr = a.to_numpy()
            assert arr.tobytes() == _bytes(t), name
            if dtype in NATIVE:
                assert str(a.type) == {"float16": "halffloat", "float32": "float",
                                       "float64": "double"}.get(dtype, dtype), name
                assert a.shape == tuple(t.shape), name
                assert np.array_equal(arr, t.numpy()), name
            else:
                assert str(a.type) == FALLBACK[dtype], name
                tail = (16,) if dtype == "complex128" else ()
                assert a.shape == tuple(t.shape) + tail, name
            if t.nbytes:
                assert arr.ctypes.data == snap[name].data_ptr(), name
    # the fallback is the bytes: viewing them back gives the tensor
    with db.snapshot("m") as snap:
        bf = torch.from_numpy(snap.arrow("t.bfloat16").to_numpy().copy()).view(torch.bfloat16)
        assert torch.equal(bf.view(torch.int16), model["t.bfloat16"].view(torch.int16))


# -- KVCache.get_arrow --------------------------------------------------------------------
@pytest.fixture
def kv(sqlite_db: tensordb.Database) -> Iterator[KVCache]:
    cache = sqlite_db.kv("arrow-ns", block_tokens=4, capacity_bytes=256 * KiB,
                         slab_bytes=64 * KiB)
    try:
        yield cache
    finally:
        cache.destroy()


def test_kv_get_arrow_rows_are_the_blocks(kv: KVCache) -> None:
    keys = kv.keys(list(range(4 * len(DTYPES))))
    blocks = [_tensor(dt, i, (2, 16)) for i, dt in enumerate(DTYPES.values())]
    kv.put(keys, blocks)
    table = kv.get_arrow(keys)
    assert table.schema.equals(BLOCK_SCHEMA)
    assert table.schema.metadata[b"tensordb.namespace"] == b"arrow-ns"
    assert table.column("key").to_pylist() == keys
    assert table.column("dtype").to_pylist() == list(DTYPES)
    assert table.column("shape").to_pylist() == [[2, 16]] * len(keys)
    assert table.column("nbytes").to_pylist() == [b.nbytes for b in blocks]
    views = kv.get(keys)
    for i, b in enumerate(blocks):
        buf = _data(table, i)
        assert buf.to_pybytes() == _bytes(b)
        # over the block's shared mapping: its chunk of a slab (blocks under a page
        # share pages, in chunks of at least 512 bytes), where get's views are
        assert buf.address % 4096 == views[i].data_ptr() % 4096
        assert buf.address % 512 == 0
    assert kv.get_arrow(keys[2:3]).column("dtype").to_pylist() == [list(DTYPES)[2]]
    assert kv.get_arrow([]).num_rows == 0


def test_kv_get_arrow_bad_keys(kv: KVCache) -> None:
    keys = kv.keys(list(range(8)))
    kv.put(keys[:1], [torch.ones(16)])
    before = kv.stats()
    with pytest.raises(NotFound) as info:
        kv.get_arrow(keys)
    assert info.value.tensor == keys[1].hex()
    for bad in (b"", "text", [b""], [3]):
        with pytest.raises(InvalidInput):
            kv.get_arrow(bad)  # type: ignore[arg-type]
    after = kv.stats()
    assert (after.blocks, after.nbytes) == (before.blocks, before.nbytes)
    kv.close()
    with pytest.raises(StoreClosed):
        kv.get_arrow(keys[:1])


def test_kv_get_arrow_keeps_the_block_from_eviction(sqlite_db: tensordb.Database) -> None:
    kv = sqlite_db.kv("small", block_tokens=4, capacity_bytes=16 * KiB,
                      slab_bytes=16 * KiB, spill=False)
    try:
        keys = [bytes([i]) * 16 for i in range(8)]
        kv.put(keys[:4], [torch.full((1024,), float(i)) for i in range(4)])
        table = kv.get_arrow(keys[:1])
        kv.put(keys[4:7], [torch.full((1024,), float(i)) for i in range(4, 7)])
        assert kv.contains(keys) == [True, False, False, False, True, True, True, False]
        kv.delete(keys[:1])  # gone from the store: the buffer keeps its bytes
        kv.put(keys[7:], [torch.full((1024,), 7.0)])
        assert np.array_equal(np.frombuffer(_data(table, 0), np.float32),
                              np.zeros(1024, np.float32))
        del table
        gc.collect()
        kv.release()
    finally:
        kv.destroy()


# -- Database.tensors_arrow ---------------------------------------------------------------
def test_tensors_arrow_of_a_query(db: tensordb.Database) -> None:
    db.commit("m", {"a": torch.arange(10.0), "b": torch.ones(3, 4, dtype=torch.bfloat16)})
    db.commit("m", {"b": torch.zeros(3, 4, dtype=torch.bfloat16)})
    db.commit("n", {"x": torch.arange(3), "big": torch.ones(1000)})
    q = db.query("SELECT collection, name, version, nbytes FROM tensors "
                 "WHERE nbytes < 100 ORDER BY nbytes DESC, name")
    table = db.tensors_arrow(q)
    assert table.column_names == ["collection", "name", "version", "dtype", "shape", "nbytes",
                                  "checksum", "data"]
    assert table.select(["collection", "name", "version"]).to_pylist() == \
        q.select(["collection", "name", "version"]).to_pylist()
    assert [(r["collection"], r["name"], r["version"]) for r in table.to_pylist()] == \
        [("m", "a", 1), ("m", "b", 2), ("n", "x", 1)]
    for i, (c, n, v) in enumerate(zip(*(table.column(k).to_pylist()
                                        for k in ("collection", "name", "version")),
                                      strict=True)):
        assert _data(table, i).to_pybytes() == _bytes(db.get(c, n, version=v))
    assert table.schema.metadata == {b"tensordb.layout": LAYOUT.encode()}
    assert _leases(db) == []  # its snapshots are closed; the buffers keep the bytes
    # a version retention dropped: the head still holds the row that version wrote
    db.set_retention("m", 1)
    db.gc()
    assert [c.version for c in db.history("m")] == [2]
    again = db.tensors_arrow(db.query("SELECT collection, name, version FROM tensors "
                                      "WHERE collection = 'm' ORDER BY name"))
    assert again.column("version").to_pylist() == [1, 2]
    assert _data(again, 0).to_pybytes() == _bytes(torch.arange(10.0))
    assert db.tensors_arrow(q.slice(0, 0)).num_rows == 0


def test_tensors_arrow_bad_input(db: tensordb.Database) -> None:
    db.commit("m", {"a": torch.arange(10.0)})
    db.commit("m", {"a": torch.arange(5.0)})
    q = db.query("SELECT collection, name, version FROM tensors")
    with pytest.raises(InvalidInput, match="pyarrow.Table"):
        db.tensors_arrow(q.to_pylist())  # type: ignore[arg-type]
    for column in ("collection", "name", "version"):
        with pytest.raises(InvalidInput, match=repr(column)):
            db.tensors_arrow(q.drop_columns([column]))
    with pytest.raises(InvalidInput, match="'version'"):
        db.tensors_arrow(q.set_column(2, "version", pa.array(["1"])))
    with pytest.raises(InvalidInput, match="'name'.*nulls"):
        db.tensors_arrow(q.set_column(1, "name", pa.array([None], pa.string())))
    with pytest.raises(NotFound) as info:
        db.tensors_arrow(q.set_column(1, "name", pa.array(["nope"])))
    assert info.value.tensor == "nope"
    with pytest.raises(NotFound):
        db.tensors_arrow(q.set_column(0, "collection", pa.array(["none"])))
    with pytest.raises(NotFound):  # version 1 wrote another row of 'a'
        db.tensors_arrow(pa.table({"collection": ["m"], "name": ["a"], "version": [9]}))
    db.set_retention("m", 1)
    db.gc()
    with pytest.raises(NotFound, match="no longer holds"):
        db.tensors_arrow(pa.table({"collection": ["m"], "name": ["a"], "version": [1]}))
    assert _leases(db) == []
    assert db.tensors_arrow(q).num_rows == 1
    db.close()
    with pytest.raises(StoreClosed):
        db.tensors_arrow(q)


# -- DLPack: the torch views into numpy, JAX, CuPy ------------------------------------------
# numpy's DLPack has no bfloat16, float8, float4 or complex32 (use Snapshot.arrow's bytes)
NUMPY_DLPACK = NATIVE | {"bool", "complex64", "complex128"}
# JAX's has no complex32 and no packed float4 (lanes of 2)
JAX_DLPACK = set(DTYPES) - {"complex32", "float4_e2m1fn_x2"}


def test_dlpack_into_numpy_is_zero_copy(sqlite_db: tensordb.Database) -> None:
    model = _model()
    sqlite_db.commit("m", model)
    with sqlite_db.snapshot("m") as snap:
        for name, t in snap.state_dict().items():
            dtype = str(t.dtype).removeprefix("torch.")
            if dtype not in NUMPY_DLPACK:
                with pytest.raises(RuntimeError, match="Unsupported"):
                    np.from_dlpack(t)
                continue
            arr = np.from_dlpack(t)
            assert arr.__array_interface__["data"][0] == t.data_ptr() or not t.nbytes, name
            assert arr.tobytes() == _bytes(model[name]), name


@pytest.mark.skipif(importlib.util.find_spec("jax") is None,
                    reason="jax is not installed (pip install -e '.[test]' installs it)")
def test_dlpack_into_jax_on_the_cpu_is_zero_copy(sqlite_db: tensordb.Database) -> None:
    import jax
    import jax.numpy as jnp

    model = _model()
    sqlite_db.commit("m", model)
    x64 = jax.config.read("jax_enable_x64")
    # without x64, JAX turns 64-bit dtypes into 32-bit ones: a copy, by design
    jax.config.update("jax_enable_x64", True)
    try:
        with sqlite_db.snapshot("m") as snap:
            for name, t in snap.state_dict().items():
                if str(t.dtype).removeprefix("torch.") not in JAX_DLPACK or not t.nbytes:
                    continue
                assert t.data_ptr() % 64 == 0  # extents are 64-byte aligned, as XLA needs
                j = jax.dlpack.from_dlpack(t)
                assert j.unsafe_buffer_pointer() == t.data_ptr(), name
                assert jnp.from_dlpack(t).unsafe_buffer_pointer() == t.data_ptr(), name
                assert np.asarray(j).tobytes() == _bytes(model[name]), name
            # a view not 64-byte aligned is copied (XLA's CPU buffers must be aligned)
            unaligned = snap["t.float32"].reshape(-1)[1:]
            assert jax.dlpack.from_dlpack(unaligned).unsafe_buffer_pointer() != \
                unaligned.data_ptr()
    finally:
        jax.config.update("jax_enable_x64", x64)


@pytest.mark.gpu
def test_dlpack_into_cupy_on_the_gpu(sqlite_db: tensordb.Database) -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if importlib.util.find_spec("cupy") is None:
        pytest.skip("cupy is not installed")
    import cupy

    sqlite_db.commit("m", {"w": torch.arange(1024.0)})
    with sqlite_db.snapshot("m", device="cuda:0") as snap:
        t = snap["w"]
        c = cupy.from_dlpack(t)
        assert c.data.ptr == t.data_ptr()
        assert cupy.asnumpy(c).tobytes() == _bytes(torch.arange(1024.0))
