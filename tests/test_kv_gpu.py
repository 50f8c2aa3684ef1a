"""The KV block store's GPU tier: copies of hot blocks in device memory, shared through
CUDA IPC.

Two groups:
* everywhere: the tier's bookkeeping (copy up once then map, device-to-device reads
  and admission, LRU eviction that spares blocks being read, no room, forgetting copies
  of blocks that leave the store, corrupt host blocks, owners that exit, sharing across
  processes) against the stand-in CUDA runtime of ``cuda_standin``, whose "device
  memory" is shared-memory files, so pointers can be read back from the host;
* ``gpu`` marker, skipped without a CUDA device: through ``db.kv`` with torch CUDA
  tensors, another process reading the blocks zero-copy.
"""

from __future__ import annotations

import ctypes
import gc
import multiprocessing as mp
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from cuda_standin import FakeRuntime, install, installed

from storage_engine import BlockStore, GpuBlockView, KVCorrupt, _cuda

CTX = mp.get_context("spawn")  # a child of a CUDA process must not be forked
BLOCK = 4096


def _root(tmp: Path) -> Path:
    return Path("/dev/shm") / f"tensordb-kvgpu-{os.getpid()}-{tmp.name}"


@pytest.fixture
def fake(tmp_path: Path) -> Iterator[FakeRuntime]:
    with installed(tmp_path / "standin") as fake:
        yield fake


@pytest.fixture
def make(tmp_path: Path, fake: FakeRuntime) -> Iterator[object]:
    made: list[BlockStore] = []

    def make(**kw: object) -> BlockStore:
        opts: dict[str, object] = {"capacity_bytes": 1 << 20, "slab_bytes": 64 << 10,
                                   "gpu_device": 0, "gpu_capacity": 64 << 10}
        opts.update(kw)
        s = BlockStore(_root(tmp_path), **opts)  # type: ignore[arg-type]
        made.append(s)
        return s

    yield make
    gc.collect()
    for s in made:
        s.close()
    shutil.rmtree(_root(tmp_path), ignore_errors=True)


def _blocks(n: int, size: int = BLOCK, base: int = 0) -> list[np.ndarray]:
    return [np.full(size, (base + i) % 251, np.uint8) for i in range(n)]


def _keys(n: int, tag: str = "k") -> list[bytes]:
    return [f"{tag}{i}".encode() for i in range(n)]


def _read(ptr: int, n: int) -> bytes:
    return ctypes.string_at(ptr, n)


def _device_buffer(fake: FakeRuntime, n: int) -> int:
    err, ptr = fake.cudaMalloc(n)
    assert err == fake.OK and ptr is not None
    return ptr


def test_get_device_copies_up_once_then_maps(make: object, fake: FakeRuntime) -> None:
    store = make()  # type: ignore[operator]
    keys, blocks = _keys(3), _blocks(3)
    store.put(keys, blocks, [b"m0", b"m1", b"m2"])
    views = store.get_device(keys)
    assert all(isinstance(v, GpuBlockView) for v in views)
    for v, b in zip(views, blocks, strict=True):
        assert _read(v.ptr, v.nbytes) == b.tobytes() and bytes(v.to_host()) == b.tobytes()
        cai = v.__cuda_array_interface__
        assert cai["shape"] == (BLOCK,) and cai["typestr"] == "|u1" and cai["data"][0] == v.ptr
    assert [v.meta for v in views] == [b"m0", b"m1", b"m2"]
    assert len(fake.allocs) == 1  # one device slab holds them
    st = store.stats()
    assert (st.gpu_blocks, st.gpu_bytes, st.gpu_capacity) == (3, 3 * BLOCK, 64 << 10)
    assert st.gpu_arena_bytes == 64 << 10 and st.gpu_hits == 0
    again = store.get_device(keys)
    assert [v.ptr for v in again] == [v.ptr for v in views]  # mapped, not copied again
    assert store.stats().gpu_hits == 3 and store.stats().blocks == 3
    assert store.get_device([b"absent"]) == [None]


def test_get_into_device_reads_the_best_copy_and_admits_nothing(
        make: object, fake: FakeRuntime) -> None:
    store = make()  # type: ignore[operator]
    keys, blocks = _keys(2), _blocks(2, base=7)
    store.put(keys, blocks)
    store.get_device(keys[:1])  # k0 on the GPU, k1 on the host only
    dsts = [_device_buffer(fake, BLOCK) for _ in keys]
    metas = store.get_into_device(keys + [b"absent"], [(d, BLOCK) for d in dsts] +
                                  [(dsts[0], BLOCK)])
    assert metas == [b"", b"", None]
    assert [_read(d, BLOCK) for d in dsts] == [b.tobytes() for b in blocks]
    st = store.stats()
    assert st.gpu_blocks == 1 and st.gpu_hits == 1
    with pytest.raises(ValueError, match="output buffer"):
        store.get_into_device(keys[1:], [(dsts[1], BLOCK - 1)])
    with pytest.raises(ValueError, match="output buffer"):
        store.get_into_device(keys[:1], [(dsts[0], BLOCK + 1)])
    assert store.stats().gpu_blocks == 1 and store.match(keys) == 2


def test_admit_device_copies_device_to_device(make: object, fake: FakeRuntime) -> None:
    store = make()  # type: ignore[operator]
    keys, blocks = _keys(2), _blocks(2, base=40)
    src = _device_buffer(fake, BLOCK)
    ctypes.memmove(src, blocks[0].ctypes.data, BLOCK)
    store.put(keys, blocks)
    # absent, wrong size and present-with-a-copy are skipped
    assert store.admit_device([b"absent"], [(src, BLOCK, 0)]) == 0
    assert store.admit_device(keys[:1], [(src, BLOCK - 8, 0)]) == 0
    assert store.admit_device(keys[:1], [(src, BLOCK, 0)]) == 1
    assert store.admit_device(keys[:1], [(src, BLOCK, 0)]) == 0
    loc = store.gpu_locate(keys[0])
    assert loc is not None and loc[2] == BLOCK
    (v,) = store.get_device(keys[:1])
    assert _read(v.ptr, BLOCK) == blocks[0].tobytes() and store.stats().gpu_hits == 1
    with pytest.raises(ValueError, match="sources"):
        store.admit_device(keys, [(src, BLOCK, 0)])


def test_lru_eviction_spares_blocks_being_read(make: object, fake: FakeRuntime) -> None:
    store = make(gpu_capacity=2 * BLOCK, slab_bytes=2 * BLOCK)  # type: ignore[operator]
    keys, blocks = _keys(3), _blocks(3, base=3)
    store.put(keys, blocks)
    (v0,) = store.get_device(keys[:1])  # held: being read
    store.get_device(keys[1:2])  # dropped at once: evictable
    gc.collect()
    (v2,) = store.get_device(keys[2:3])  # evicts k1, the only copy nobody reads
    assert store.gpu_locate(keys[1]) is None and store.gpu_locate(keys[0]) is not None
    assert _read(v0.ptr, BLOCK) == blocks[0].tobytes()
    assert _read(v2.ptr, BLOCK) == blocks[2].tobytes()
    st = store.stats()
    assert st.gpu_evictions == 1 and st.gpu_blocks == 2 and st.gpu_arena_bytes == 2 * BLOCK
    # both chunks being read: no room, k1 stays on the host and the caller reads it there
    assert store.get_device(keys[1:2]) == [None]
    assert store.match(keys) == 3 and store.stats().gpu_evictions == 1
    del v0, v2
    gc.collect()
    (v1,) = store.get_device(keys[1:2])  # the leases went with the views
    assert _read(v1.ptr, BLOCK) == blocks[1].tobytes()
    assert len(fake.allocs) == 1


def test_blocks_larger_than_the_tier_stay_on_the_host(make: object) -> None:
    store = make(gpu_capacity=BLOCK)  # type: ignore[operator]
    store.put([b"big"], [np.ones(2 * BLOCK, np.uint8)])
    assert store.get_device([b"big"]) == [None] and store.stats().gpu_arena_bytes == 0


def test_copies_go_when_their_blocks_leave_the_store(make: object, tmp_path: Path) -> None:
    store = make(capacity_bytes=2 * BLOCK, slab_bytes=2 * BLOCK)  # type: ignore[operator]
    keys, blocks = _keys(4), _blocks(4)
    store.put(keys[:2], blocks[:2])
    store.get_device(keys[:2])
    assert store.delete(keys[:1]) == 1
    assert store.gpu_locate(keys[0]) is None and store.stats().gpu_blocks == 1
    gc.collect()
    store.put(keys[2:3], blocks[2:3])  # fills the host arena again
    store.put(keys[3:], blocks[3:])  # no spill: evicting k1 from the host drops it
    assert store.match(keys[1:2]) == 0 and store.gpu_locate(keys[1]) is None
    st = store.stats()
    assert st.gpu_blocks == 0 and st.gpu_bytes == 0 and st.evictions == 1
    # a process without the tier forgets copies too
    (v,) = store.get_device(keys[3:])
    del v
    gc.collect()
    assert _in_child(_plain_delete, str(store.root), keys[3:]) == 1
    assert store.gpu_locate(keys[3]) is None and store.stats().gpu_blocks == 0


def test_spilled_blocks_keep_their_copy(make: object, tmp_path: Path) -> None:
    store = make(capacity_bytes=2 * BLOCK, slab_bytes=2 * BLOCK,  # type: ignore[operator]
                 disk_root=tmp_path / "disk")
    keys, blocks = _keys(3), _blocks(3, base=90)
    store.put(keys[:1], blocks[:1])
    store.get_device(keys[:1])
    gc.collect()
    store.put(keys[1:], blocks[1:])  # k0 spills to disk
    assert store.locate(keys[0])[0] == "disk"
    (v,) = store.get_device(keys[:1])  # served by its GPU copy: no promotion
    assert _read(v.ptr, BLOCK) == blocks[0].tobytes()
    assert store.locate(keys[0])[0] == "disk" and store.stats().gpu_hits == 1


def test_corrupt_host_block_never_reaches_the_gpu(make: object, fake: FakeRuntime) -> None:
    store = make()  # type: ignore[operator]
    keys, blocks = _keys(2), _blocks(2, base=11)
    store.put(keys, blocks)
    _, path, offset, _ = store.locate(keys[1])
    with open(path, "r+b") as fh:
        fh.seek(offset + 100)
        fh.write(b"\xff")
    with pytest.raises(KVCorrupt) as info:
        store.get_device(keys)
    assert info.value.keys == [keys[1]]
    assert store.match(keys) == 1 and store.gpu_locate(keys[1]) is None
    dst = _device_buffer(fake, BLOCK)
    store.put(keys[1:], blocks[1:])
    with open(path, "r+b") as fh:  # the new copy landed in the freed chunk
        fh.seek(offset + 100)
        fh.write(b"\xfe")
    with pytest.raises(KVCorrupt):
        store.get_into_device(keys[1:], [(dst, BLOCK)])
    assert store.match(keys[1:]) == 0
    assert store.get_device(keys[1:], verify=False) == [None]


def test_bad_settings_and_a_store_without_the_tier(tmp_path: Path, make: object) -> None:
    with pytest.raises(ValueError, match="gpu_capacity"):
        BlockStore(_root(tmp_path) / "x", capacity_bytes=1 << 20, gpu_device=0)
    with pytest.raises(ValueError, match="positive"):
        BlockStore(_root(tmp_path) / "y", capacity_bytes=1 << 20, gpu_device=0,
                   gpu_capacity=0)
    store = make()  # type: ignore[operator]
    store.put([b"a"], [np.ones(BLOCK, np.uint8)])
    enabled, capacity, error = _in_child(_plain_look, str(store.root))
    assert not enabled and capacity == 64 << 10  # adopted from the store's settings
    assert "without a GPU tier" in error


def _plain_look(root: str) -> tuple[bool, int, str]:
    plain = BlockStore(Path(root), capacity_bytes=1 << 20)
    try:
        plain.get_device([b"a"])
    except ValueError as exc:
        return plain.gpu_enabled, plain.stats().gpu_capacity, str(exc)
    finally:
        plain.close()
    return plain.gpu_enabled, plain.stats().gpu_capacity, ""


def test_a_copy_that_loses_the_race_gives_its_chunk_back(make: object,
                                                        fake: FakeRuntime) -> None:
    # another writer publishes a copy of the block while this one is copying it (here:
    # from inside the copy, on the same thread): one copy is indexed, the loser's chunk
    # goes back to the free list
    store = make(gpu_capacity=2 * BLOCK, slab_bytes=2 * BLOCK)  # type: ignore[operator]
    keys, blocks = _keys(2), _blocks(2, base=12)
    store.put(keys, blocks)
    src = _device_buffer(fake, BLOCK)
    ctypes.memmove(src, blocks[0].ctypes.data, BLOCK)
    real = fake.cudaMemcpy
    raced: list[int] = []

    def racing(dst: int, s: int, n: int, kind: object) -> tuple[object]:
        fake.cudaMemcpy = real  # type: ignore[method-assign]
        raced.append(store.admit_device(keys[:1], [(src, BLOCK, 0)]))
        return real(dst, s, n, kind)

    fake.cudaMemcpy = racing  # type: ignore[method-assign]
    (view,) = store.get_device(keys[:1])
    assert raced == [1] and view is not None
    assert _read(view.ptr, BLOCK) == blocks[0].tobytes()
    assert store.stats().gpu_blocks == 1
    del view
    gc.collect()
    (other,) = store.get_device(keys[1:])  # the loser's chunk is free again: no eviction
    assert other is not None and store.stats().gpu_evictions == 0
    assert store.stats().gpu_blocks == 2


def test_a_failed_copy_gives_its_chunks_back(make: object, fake: FakeRuntime) -> None:
    from cuda_standin import _Err

    from storage_engine._gpu import GpuError

    store = make(gpu_capacity=2 * BLOCK, slab_bytes=2 * BLOCK)  # type: ignore[operator]
    keys, blocks = _keys(2), _blocks(2, base=30)
    store.put(keys, blocks)
    real = fake.cudaMemcpy
    fake.cudaMemcpy = lambda *a: (_Err.cudaErrorInvalidValue,)  # type: ignore[method-assign]
    with pytest.raises(GpuError, match="cudaMemcpy"):
        store.get_device(keys)
    fake.cudaMemcpy = real  # type: ignore[method-assign]
    st = store.stats()
    assert st.gpu_blocks == 0 and store.match(keys) == 2  # nothing half-copied is indexed
    views = store.get_device(keys)  # both chunks came back: the tier is not smaller
    assert [_read(v.ptr, BLOCK) for v in views] == [b.tobytes() for b in blocks]
    assert store.stats().gpu_evictions == 0


# -- across processes ---------------------------------------------------------------------
def _child(fn: object, args: tuple, conn: mp.connection.Connection) -> None:
    conn.send(fn(*args))  # type: ignore[operator]


def _in_child(fn: object, *args: object) -> object:
    """``fn(*args)`` in a fresh process (LMDB opens an environment once per process)."""
    parent, child = CTX.Pipe()
    p = CTX.Process(target=_child, args=(fn, args, child))
    p.start()
    try:
        return parent.recv()
    finally:
        p.join(60)


def _plain_delete(root: str, keys: list[bytes]) -> int:
    plain = BlockStore(Path(root), capacity_bytes=1 << 20)
    try:
        return plain.delete(keys)
    finally:
        plain.close()


def _reader(root: str, standin: str, keys: list[bytes], conn: mp.connection.Connection
            ) -> None:
    install(Path(standin))
    store = BlockStore(Path(root), capacity_bytes=1 << 20, gpu_device=0,
                       gpu_capacity=1 << 20)
    views = store.get_device(keys)
    fake: FakeRuntime = _cuda._rt
    conn.send(([_read(v.ptr, v.nbytes) for v in views],
               all(any(v.ptr >= p and v.ptr < p + len(mm) for p, (_, mm) in
                       fake.imports.items()) for v in views),
               store.stats().gpu_hits))
    conn.recv()
    del views
    store.close()


def test_another_process_maps_the_copies_zero_copy(make: object, tmp_path: Path) -> None:
    store = make()  # type: ignore[operator]
    keys, blocks = _keys(3), _blocks(3, base=60)
    store.put(keys, blocks)
    store.get_device(keys)
    parent, child = CTX.Pipe()
    p = CTX.Process(target=_reader, args=(str(store.root), str(tmp_path / "standin"), keys,
                                          child))
    p.start()
    try:
        got, imported, hits = parent.recv()
        assert got == [b.tobytes() for b in blocks]
        assert imported  # views of the owner's slab through its IPC handle
        assert hits == 3  # no copy up in the reader
        parent.send("done")
    finally:
        p.join(60)
    assert p.exitcode == 0


def _owner(root: str, standin: str, keys: list[bytes], conn: mp.connection.Connection
           ) -> None:
    install(Path(standin))
    store = BlockStore(Path(root), capacity_bytes=1 << 20, gpu_device=0,
                       gpu_capacity=1 << 20)
    store.get_device(keys)
    conn.send(store.gpu_locate(keys[0])[0])
    store.close()  # and exits: its device memory goes with it


def test_copies_in_the_slab_of_an_exited_owner_fall_back(make: object, tmp_path: Path,
                                                         fake: FakeRuntime) -> None:
    store = make(gpu_capacity=1 << 20)  # type: ignore[operator]
    keys, blocks = _keys(2), _blocks(2, base=5)
    store.put(keys, blocks)
    parent, child = CTX.Pipe()
    p = CTX.Process(target=_owner, args=(str(store.root), str(tmp_path / "standin"), keys,
                                         child))
    p.start()
    slab = parent.recv()
    p.join(60)
    assert p.exitcode == 0
    assert store.stats().gpu_blocks == 2  # recorded, but their memory is gone
    views = store.get_device(keys)  # the dead owner's slab is forgotten; copied up again
    assert [_read(v.ptr, BLOCK) for v in views] == [b.tobytes() for b in blocks]
    loc = store.gpu_locate(keys[0])
    assert loc is not None and loc[0] != slab
    st = store.stats()
    assert st.gpu_blocks == 2 and st.gpu_arena_bytes == 64 << 10
    ((base, (_, _, size)),) = fake.allocs.items()  # the new slab is this process's
    assert all(base <= v.ptr < base + size for v in views)


def _dies_mid_copy(root: str, standin: str, keys: list[bytes],
                   conn: mp.connection.Connection) -> None:
    fake = install(Path(standin))
    store = BlockStore(Path(root), capacity_bytes=1 << 20, gpu_device=0,
                       gpu_capacity=2 * BLOCK, slab_bytes=2 * BLOCK)

    def die(*a: object) -> None:  # the chunks are reserved; the copy never ends
        conn.send("reserved")
        os._exit(0)

    fake.cudaMemcpy = die  # type: ignore[method-assign]
    store.get_device(keys)


def test_chunks_reserved_by_a_dead_process_come_back(make: object, tmp_path: Path) -> None:
    store = make(gpu_capacity=2 * BLOCK, slab_bytes=2 * BLOCK)  # type: ignore[operator]
    keys, blocks = _keys(2), _blocks(2, base=77)
    store.put(keys, blocks)
    store.get_device(keys[:1])  # this process owns the one slab (the child dies)
    gc.collect()
    store.delete(keys[:1])
    store.put(keys[:1], blocks[:1])
    parent, child = CTX.Pipe()
    p = CTX.Process(target=_dies_mid_copy, args=(str(store.root), str(tmp_path / "standin"),
                                                 keys, child))
    p.start()
    assert parent.recv() == "reserved"
    p.join(60)
    # both chunks are held by the dead process's reservations: taking them back is the
    # only way to make room, since no block has a GPU copy to evict
    assert store.stats().gpu_blocks == 0
    views = store.get_device(keys)
    assert all(v is not None for v in views)
    assert [_read(v.ptr, BLOCK) for v in views] == [b.tobytes() for b in blocks]


# -- through db.kv --------------------------------------------------------------------------
def test_db_kv_gpu_options_are_checked_first(sqlite_db: object) -> None:
    import torch

    from storage_engine import GpuTier
    from tensordb.catalog.schema import kv_namespaces
    from tensordb.errors import InvalidInput

    db = sqlite_db
    for bad in (0, -1, 1.5, True):
        with pytest.raises(InvalidInput, match="gpu_capacity"):
            db.kv("gpu-kv", gpu_capacity=bad)  # type: ignore[attr-defined]
    if not GpuTier.available():
        with pytest.raises(InvalidInput, match="needs a CUDA device"):
            db.kv("gpu-kv", gpu_capacity=1 << 20)  # type: ignore[attr-defined]
    with db.catalog.engine.connect() as conn:  # type: ignore[attr-defined]
        assert conn.execute(kv_namespaces.select()).first() is None  # nothing was made
    kv = db.kv("gpu-kv", block_tokens=4, capacity_bytes=1 << 20)  # type: ignore[attr-defined]
    try:
        keys = kv.keys(list(range(4)))
        kv.put(keys, [torch.ones(8)])
        with pytest.raises(InvalidInput, match="device"):
            kv.get(keys, device="tpu")
        if not torch.cuda.is_available():
            with pytest.raises(InvalidInput, match="no CUDA device"):
                kv.get(keys, device="cuda:0")
        assert torch.equal(kv.get(keys, device="cpu")[0], torch.ones(8))
        assert kv.stats().gpu_capacity == 0 and kv.stats().gpu_blocks == 0
    finally:
        kv.destroy()


# -- the real thing -----------------------------------------------------------------------
def _cuda_reader(home: str, keys: list[bytes], conn: mp.connection.Connection) -> None:

    import tensordb

    db = tensordb.connect(home=home, data_dir=home + "/data")
    kv = db.kv("gpu-kv", block_tokens=4, gpu_capacity=64 << 20)
    ts = kv.get(keys, device="cuda:0")
    conn.send(([t.cpu() for t in ts], kv.stats().gpu_hits,
               all(t.device.type == "cuda" for t in ts)))
    conn.recv()
    del ts
    kv.close()
    db.close()


@pytest.mark.gpu
def test_cuda_blocks_through_db_kv(tmp_path: Path) -> None:
    from storage_engine import GpuTier

    if not GpuTier.available():
        pytest.skip(f"GPU tier unavailable: {GpuTier.unavailable_reason()}")
    import torch

    import tensordb

    home = str(tmp_path / "home")
    db = tensordb.connect(home=home, data_dir=home + "/data")
    kv = db.kv("gpu-kv", block_tokens=4, gpu_capacity=64 << 20)
    try:
        blocks = [torch.randn(2, 4, 64, device="cuda:0").to(torch.bfloat16) for _ in range(4)]
        keys = kv.keys(list(range(16)))
        assert kv.put(keys, blocks) == 4  # host copy, and a device-to-device GPU copy
        st = kv.stats()
        assert st.gpu_blocks == 4 and st.gpu_capacity == 64 << 20
        ts = kv.get(keys, device="cuda:0")
        assert all(torch.equal(t, b) for t, b in zip(ts, blocks, strict=True))
        assert kv.stats().gpu_hits == 4
        outs = [torch.empty_like(b) for b in blocks]
        assert kv.get_into(keys, outs) == 4
        assert all(torch.equal(o, b) for o, b in zip(outs, blocks, strict=True))
        parent, child = CTX.Pipe()
        p = CTX.Process(target=_cuda_reader, args=(home, keys, child))
        p.start()
        got, hits, on_gpu = parent.recv()
        parent.send("done")
        p.join(120)
        assert p.exitcode == 0 and on_gpu and hits >= 8
        assert all(torch.equal(g, b.cpu()) for g, b in zip(got, blocks, strict=True))
    finally:
        kv.destroy()
        db.close()
