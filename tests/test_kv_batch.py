"""The KV store's batch paths (``put_batch``, ``read_into``, a batch given as one tensor)
against its one-block path, and the store's invariants under the batch paths, across
processes: first writer wins, a corrupt block is never served, pinned blocks and blocks
being read are never evicted, StoreFull at once when nothing can go."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import flip_byte, open_store
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from storage_engine import BlockStore, KVCorrupt
from tensordb import KVCache
from tensordb.errors import CorruptData, InvalidInput, NotFound, StoreFull

KiB = 1 << 10
CTX = mp.get_context("spawn")

# -- the batch path and the one-block path agree ------------------------------------------
KEYS = [b"key-%03d" % i for i in range(24)]
SIZES = (512, 1000, 4096, 8192)
OPS = st.one_of(
    st.tuples(st.just("put"), st.lists(st.tuples(st.sampled_from(KEYS),
                                                 st.sampled_from(SIZES),
                                                 st.integers(0, 255)), min_size=1, max_size=12)),
    st.tuples(st.just("read"), st.lists(st.sampled_from(KEYS), min_size=1, max_size=12)),
    st.tuples(st.just("delete"), st.lists(st.sampled_from(KEYS), min_size=1, max_size=6)),
    st.tuples(st.just("pin"), st.lists(st.sampled_from(KEYS[:4]), min_size=1, max_size=3)),
    st.tuples(st.just("unpin"), st.lists(st.sampled_from(KEYS[:4]), min_size=1, max_size=3)),
    st.tuples(st.just("match"), st.lists(st.sampled_from(KEYS), min_size=1, max_size=12)),
)


def _block(size: int, value: int) -> np.ndarray:
    return np.full(size, value, np.uint8)


def _apply_batch(store: BlockStore, op: str, arg: list) -> object:
    if op == "put":
        blocks = [_block(s, v) for _, s, v in arg]
        addrs = np.array([b.ctypes.data for b in blocks], np.uint64)
        sizes = np.array([b.size for b in blocks], np.uint64)
        return store.put_batch([k for k, _, _ in arg], addrs, sizes,
                               [b"m%d" % s for _, s, _ in arg]).tolist()
    if op == "read":
        return _read(store, arg)
    if op == "delete":
        return store.delete(arg)
    if op in ("pin", "unpin"):
        return getattr(store, op)(arg)
    return store.match(arg)


def _apply_one(store: BlockStore, op: str, arg: list) -> object:
    if op == "put":
        return [store.put([k], [_block(s, v)], [b"m%d" % s])[0] for k, s, v in arg]
    if op == "read":
        out: list = []
        for k in arg:
            out += _read(store, [k])
        return out
    if op == "delete":
        return sum(store.delete([k]) for k in arg)
    if op in ("pin", "unpin"):
        return sum(getattr(store, op)([k]) for k in arg)
    n = 0
    for k in arg:  # the leading run, key by key
        if store.match([k]) != 1:
            break
        n += 1
    return n


def _read(store: BlockStore, keys: list[bytes]) -> list:
    """Each key's bytes (read_into a buffer of its size), or None where absent."""
    metas = [store.meta(k) for k in keys]
    sizes = [int(m.decode()[1:]) if m else 1 for m in metas]
    outs = [np.zeros(s, np.uint8) for s in sizes]
    status = store.read_into(keys, np.array([o.ctypes.data for o in outs], np.uint64),
                             np.array(sizes, np.uint64))
    return [bytes(o) if s == 1 else None for o, s in zip(outs, status, strict=True)]


@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(OPS, min_size=1, max_size=25), st.sampled_from(["lru", "s3fifo"]))
def test_the_batch_path_and_the_one_block_path_agree(tmp_path: Path, ops: list,
                                                     eviction: str) -> None:
    """The same random workload, once in batches and once a block a call, into two
    stores of 128 KiB (evicting: 24 keys of up to 8 KiB do not fit): every result, the
    bytes read and the counters agree."""
    roots = [tmp_path / f"{eviction}-{len(ops)}-{i}-{id(ops)}" for i in range(2)]
    stores = [BlockStore(r, capacity_bytes=128 * KiB, slab_bytes=32 * KiB, eviction=eviction)
              for r in roots]
    try:
        for op, arg in ops:
            got = _apply_batch(stores[0], op, arg), _apply_one(stores[1], op, arg)
            assert got[0] == got[1], (op, arg)
            assert [stores[0].contains(KEYS), stores[0].stats().pinned] == \
                [stores[1].contains(KEYS), stores[1].stats().pinned]
        a, b = stores[0].stats(), stores[1].stats()
        assert (a.blocks, a.nbytes, a.evictions, a.bloom) == \
            (b.blocks, b.nbytes, b.evictions, b.bloom)
    finally:
        for s in stores:
            s.close()


# -- a batch given as one tensor --------------------------------------------------------------
@pytest.fixture
def kv(sqlite_db: object) -> KVCache:
    c = KVCache(sqlite_db, "batch", block_tokens=4, capacity_bytes=1 << 20,  # type: ignore
                slab_bytes=256 * KiB)
    yield c
    c.destroy()


def test_a_batch_tensor_round_trips_like_a_list(kv: KVCache) -> None:
    keys = kv.keys(list(range(4 * 10)))
    batch = torch.arange(10 * 2 * 4 * 8, dtype=torch.float32).view(10, 2, 4, 8)
    assert kv.put(keys[:5], batch[:5]) == 5
    assert kv.put(keys, list(batch.unbind(0))) == 5  # the first five were there already
    out = torch.zeros_like(batch)
    assert kv.get_into(keys, out) == 10 and torch.equal(out, batch)
    got = kv.get_batch(keys)
    assert got.dtype == torch.float32 and got.shape == (10, 2, 4, 8)
    assert torch.equal(got, batch)
    assert all(torch.equal(v, b) for v, b in zip(kv.get(keys), batch, strict=True))
    strided = torch.zeros(2, 10, 2, 4, 8).transpose(0, 1)[:, 0]  # not contiguous
    assert kv.get_into(keys, strided) == 10 and torch.equal(strided, batch)


def test_bad_batches_are_typed_errors_and_change_nothing(kv: KVCache) -> None:
    keys = kv.keys(list(range(4 * 4)))
    before = kv.stats()
    with pytest.raises(InvalidInput, match="first dimension"):
        kv.put(keys, torch.zeros(3, 8))  # 3 blocks for 4 keys
    with pytest.raises(InvalidInput, match="first dimension"):
        kv.put(keys, torch.tensor(1.0))
    with pytest.raises(InvalidInput, match="empty"):
        kv.put(keys, torch.zeros(4, 0))
    with pytest.raises(StoreFull, match="more than the arena"):
        kv.put(keys, torch.zeros(4, 1 << 19))  # 2 MiB blocks, a 1 MiB arena
    assert kv.stats().blocks == before.blocks == 0
    kv.put(keys, torch.ones(4, 8))
    with pytest.raises(InvalidInput, match="holds 32 bytes; its output buffer 64"):
        kv.get_into(keys, torch.zeros(4, 16))
    with pytest.raises(NotFound):
        kv.get_batch(kv.keys(list(range(100, 104))))
    with pytest.raises(NotFound):
        kv.get_into(keys + kv.keys(list(range(100, 104))), torch.zeros(5, 8))
    with pytest.raises(InvalidInput, match="no keys"):
        kv.get_batch([])
    assert kv.stats().blocks == 4 and kv.match(keys) == 4


# -- invariants under the batch paths, across processes --------------------------------------
def _batch_writer(home: str, keys: list[bytes], value: float, barrier: object,
                  out: mp.queues.Queue) -> None:
    db = open_store(Path(home))
    kv = KVCache(db, "race", block_tokens=4, capacity_bytes=8 << 20, slab_bytes=1 << 20)
    barrier.wait()  # type: ignore[attr-defined]
    stored = 0
    for lo in range(0, len(keys), 16):
        stored += kv.put(keys[lo:lo + 16], torch.full((len(keys[lo:lo + 16]), 2048), value))
    out.put(stored)
    kv.close()
    db.close()


def test_first_writer_wins_between_batch_writers(sqlite_db: object, store_home: Path) -> None:
    """Three processes put overlapping batches of the same keys at once: each key is stored
    once, by one of them, whole (its block holds one writer's value throughout)."""
    kv = KVCache(sqlite_db, "race", block_tokens=4, capacity_bytes=8 << 20,  # type: ignore
                 slab_bytes=1 << 20)
    try:
        keys = [bytes([i % 256, i // 256]) * 8 for i in range(300)]
        barrier = CTX.Barrier(3)
        out = CTX.Queue()
        procs = [CTX.Process(target=_batch_writer, args=(str(store_home), keys[s:], float(v),
                                                        barrier, out))
                 for v, s in ((1, 0), (2, 100), (3, 50))]
        for p in procs:
            p.start()
        stored = [out.get(timeout=120) for _ in procs]
        for p in procs:
            p.join(30)
            assert p.exitcode == 0
        assert sum(stored) == len(keys) and kv.match(keys) == len(keys)
        got = kv.get_batch(keys)
        firsts = got[:, 0]
        assert bool((got == firsts[:, None]).all())  # no block mixes two writers
        assert set(firsts.tolist()) <= {1.0, 2.0, 3.0}
    finally:
        kv.destroy()


def test_a_corrupt_block_is_never_served_by_a_batch_read(kv: KVCache) -> None:
    keys = kv.keys(list(range(4 * 8)))
    kv.put(keys, torch.arange(8 * 256, dtype=torch.float32).view(8, 256))
    _, path, offset, nbytes = kv.store.locate(keys[3])  # type: ignore[misc]
    flip_byte(path, offset + nbytes // 2)
    out = torch.zeros(8, 256)
    with pytest.raises(CorruptData) as info:
        kv.get_into(keys, out)
    assert keys[3].hex() in str(info.value)
    assert kv.contains(keys) == [True] * 3 + [False] + [True] * 4  # dropped
    with pytest.raises(NotFound):
        kv.get_batch(keys)
    assert kv.stats().corrupt == 1


def test_pinned_and_leased_blocks_survive_batches_into_a_full_arena(sqlite_db: object) -> None:
    kv = KVCache(sqlite_db, "full", block_tokens=4, capacity_bytes=256 * KiB,  # type: ignore
                 slab_bytes=64 * KiB, spill=False)
    try:
        keys = kv.keys(list(range(4 * 32)))
        kv.put(keys, torch.ones(32, 2048))  # 8 KiB each: the arena is full
        assert kv.pin(keys[:4]) == 4
        view = kv.get(keys[4:6])  # being read
        every = list(keys)
        for r in range(4):  # every block of these batches evicts another
            more = kv.keys(list(range(1000 + r * 64, 1000 + (r + 1) * 64)))
            assert kv.put(more, torch.full((16, 2048), float(r))) == 16
            every += more
        assert kv.contains(keys[:6]) == [True] * 6
        assert float(view[0][0]) == 1.0
        present = [k for k, c in zip(every, kv.contains(every), strict=True) if c]
        assert len(present) == 32 and kv.pin(present) == 32  # now nothing can go
        survivors = kv.stats()
        with pytest.raises(StoreFull):  # at once, and nothing of the batch stored
            kv.put(kv.keys(list(range(5000, 5000 + 16 * 4))), torch.zeros(16, 2048))
        assert kv.stats().blocks == survivors.blocks
    finally:
        kv.destroy()


def test_the_index_holds_long_keys_by_their_digest(tmp_path: Path) -> None:
    store = BlockStore(tmp_path / "long", capacity_bytes=1 << 20)
    try:
        long_keys = [b"x" * 64 + bytes([i]) for i in range(3)]
        assert store.put(long_keys, [_block(100, i) for i in range(3)]) == [True] * 3
        assert store.match(long_keys) == 3 and store.match([b"x" * 64]) == 0
        (v,) = store.get(long_keys[1:2])
        assert v is not None and bytes(v.data) == bytes(_block(100, 1))
        with pytest.raises(ValueError, match="1 to 255 bytes"):
            store.match([b"y" * 256])
        with pytest.raises(ValueError, match="1 to 255 bytes"):
            store.put([b""], [_block(1, 0)])
    finally:
        store.close()


def test_corrupt_reads_through_views_and_batches_name_the_key(tmp_path: Path) -> None:
    store = BlockStore(tmp_path / "c", capacity_bytes=1 << 20)
    try:
        store.put([b"a", b"b"], [_block(5000, 1), _block(5000, 2)])
        _, path, offset, _ = store.locate(b"b")  # type: ignore[misc]
        flip_byte(path, offset + 10)
        with pytest.raises(KVCorrupt) as info:
            store.get([b"a", b"b"])
        assert info.value.keys == [b"b"] and store.contains([b"a", b"b"]) == [True, False]
    finally:
        store.close()


# -- cold memory --------------------------------------------------------------------------
def test_a_new_namespace_takes_the_pages_a_destroyed_one_gave_back(sqlite_db: object) -> None:
    """A namespace destroyed while nobody reads it gives its slabs to the store's pool; a
    new namespace's slabs are those files (their pages exist: no page faults), and a
    namespace destroyed while a view is held keeps its pages from the pool."""
    import os

    db = sqlite_db
    pool = Path(db.config.shm_dir) / "pool"  # type: ignore[attr-defined]
    a = db.kv("cold-a", block_tokens=4, capacity_bytes=4 << 20,  # type: ignore[attr-defined]
              slab_bytes=1 << 20)
    a.put(a.keys(list(range(4 * 64))), torch.ones(64, 4096))  # 1 MiB: one slab
    inodes = {p.stat().st_ino for p in a.store.slab_files()}
    a.destroy()
    pooled = {p.stat().st_ino: p.stat().st_blocks * 512 for p in pool.iterdir()
              if not p.name.startswith(".")}
    assert inodes and inodes <= set(pooled) and all(pooled[i] >= 1 << 20 for i in inodes)
    b = db.kv("cold-b", block_tokens=4, capacity_bytes=4 << 20,  # type: ignore[attr-defined]
              slab_bytes=1 << 20)
    b.put(b.keys(list(range(4 * 8))), torch.full((8, 4096), 2.0))
    taken = {p.stat().st_ino for p in b.store.slab_files()}
    assert taken & inodes  # the new slab is a pooled file
    assert not any(p.stat().st_ino in taken for p in pool.iterdir())
    assert os.stat(b.store.slab_files()[0]).st_mode & 0o777 == 0o600
    assert torch.equal(b.get_batch(b.keys(list(range(4 * 8)))), torch.full((8, 4096), 2.0))
    view = b.get(b.keys(list(range(4))))
    b.destroy()  # a view is held: the pages must not be handed to another writer
    assert not any(p.stat().st_ino in taken for p in pool.iterdir())
    assert float(view[0][0]) == 2.0


def test_a_new_namespace_takes_this_process_s_mapping_of_a_pooled_slab(
        sqlite_db: object) -> None:
    """A namespace destroyed here keeps this process's mappings of the slabs it pooled;
    a new namespace that claims one of those files back takes the mapping (no page-table
    fill) and reads back what it wrote, checksums verified. A mapping of a file the pool
    then gives back is closed, and the pages go."""
    from storage_engine import kept_mappings

    db = sqlite_db
    host = db._tiers["host"]  # type: ignore[attr-defined]
    host.trim_pool(0)
    before = kept_mappings()
    a = db.kv("keep-a", block_tokens=4, capacity_bytes=4 << 20,  # type: ignore[attr-defined]
              slab_bytes=1 << 20)
    a.put(a.keys(list(range(4 * 64))), torch.ones(64, 4096))  # 1 MiB: one slab
    inodes = {p.stat().st_ino for p in a.store.slab_files()}
    a.destroy()
    after = kept_mappings()
    assert after["kept"] == before["kept"] + 1 and after["mappings"] >= 1
    b = db.kv("keep-b", block_tokens=4, capacity_bytes=4 << 20,  # type: ignore[attr-defined]
              slab_bytes=1 << 20)
    keys = b.keys(list(range(4 * 64)))
    b.put(keys, torch.full((64, 4096), 3.0))
    assert {p.stat().st_ino for p in b.store.slab_files()} == inodes
    assert kept_mappings()["reused"] == before["reused"] + 1
    assert torch.equal(b.get_batch(keys), torch.full((64, 4096), 3.0))
    out = torch.zeros(64, 4096)
    assert b.get_into(keys, out) == 64 and torch.equal(out, torch.full((64, 4096), 3.0))
    b.destroy()
    assert kept_mappings()["mappings"] >= 1
    host.trim_pool(0)  # the pool gives its files back: their kept mappings close
    assert kept_mappings()["mappings"] == 0 and kept_mappings()["bytes"] == 0


def _run_forked(target: object, *args: object) -> object:
    """``target(*args, queue)`` in a forked child (these tests are about what a child
    inherits), and what it put in the queue. JAX, once another test imported it, warns
    at every fork: not this test's concern."""
    import warnings

    ctx = mp.get_context("fork")
    q = ctx.Queue()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        p = ctx.Process(target=target, args=(*args, q))  # type: ignore[attr-defined]
        p.start()
    p.join(60)
    assert p.exitcode == 0
    return q.get(timeout=5)


def _child_kept(q: object) -> None:
    from storage_engine import kept_mappings

    q.put(kept_mappings()["mappings"])  # type: ignore[attr-defined]


def test_a_forked_child_drops_its_parent_s_kept_mappings(sqlite_db: object) -> None:
    """A forked child never writes through its parent's kept mappings: it closes them."""
    from storage_engine import kept_mappings

    db = sqlite_db
    a = db.kv("keep-fork", block_tokens=4, capacity_bytes=4 << 20,  # type: ignore[attr-defined]
              slab_bytes=1 << 20)
    a.put(a.keys(list(range(4 * 8))), torch.ones(8, 4096))
    a.destroy()
    assert kept_mappings()["mappings"] >= 1
    assert _run_forked(_child_kept) == 0
    assert kept_mappings()["mappings"] >= 1
    db._tiers["host"].trim_pool(0)  # type: ignore[attr-defined]


def test_keys_fit_takes_lists_of_short_bytes_only() -> None:
    """The client's one-pass check of a batch's keys: a list of bytes of 1 to 32 bytes
    goes to the index as it is; anything else takes the checking path (long keys are
    hashed, bad ones are InvalidInput)."""
    from storage_engine import keys_fit

    assert keys_fit([b"a", b"x" * 32]) and keys_fit([])
    for bad in ([b"x" * 33], [b""], [bytearray(b"a")], (b"a",), [b"a", 1], b"ab", "ab"):
        assert not keys_fit(bad)


def test_long_and_bad_keys_still_take_the_checking_path(sqlite_db: object) -> None:
    kv = sqlite_db.kv("long-keys", block_tokens=4,  # type: ignore[attr-defined]
                      capacity_bytes=1 << 20, slab_bytes=64 * KiB)
    try:
        keys = [b"k" * 100 + bytes([i]) for i in range(4)] + [bytearray(b"short")]
        assert kv.put(keys, torch.arange(5 * 16, dtype=torch.float32).view(5, 16)) == 5
        out = torch.zeros(5, 16)
        assert kv.get_into(keys, out) == 5
        assert torch.equal(out, torch.arange(5 * 16, dtype=torch.float32).view(5, 16))
        for bad in ([b""], [b"x" * 256], [b"a", 3], b"one-key"):
            with pytest.raises(InvalidInput):
                kv.get_into(bad, torch.zeros(1, 16))  # type: ignore[arg-type]
        assert kv.stats().blocks == 5
    finally:
        kv.destroy()


def _big_batches(store: BlockStore, tag: int, rounds: int) -> bool:
    """Large batches (copied on the copy workers) put and read back: all equal."""
    n, size = 64, 128 * KiB  # 8 MiB a batch
    src = np.empty((n, size), np.uint8)
    src[:] = (np.arange(n, dtype=np.uint8) + tag)[:, None]
    dst = np.zeros_like(src)
    ok = True
    for r in range(rounds):
        keys = [b"t%d-r%d-%d" % (tag, r, i) for i in range(n)]
        addrs = np.array([src[i].ctypes.data for i in range(n)], np.uint64)
        store.put_batch(keys, addrs, np.full(n, size, np.uint64))
        daddrs = np.array([dst[i].ctypes.data for i in range(n)], np.uint64)
        status = store.read_into(keys, daddrs, np.full(n, size, np.uint64))
        ok = ok and bool(status.all()) and bool(np.array_equal(src, dst))
        dst[:] = 0
        store.delete(keys)
    return ok


def _forked_batches(root: str, q: object) -> None:
    store = BlockStore(Path(root), capacity_bytes=64 << 20)
    try:
        q.put(_big_batches(store, 9, 3))  # type: ignore[attr-defined]
    finally:
        store.close()


def test_copy_workers_serve_concurrent_batches_and_forked_children(tmp_path: Path) -> None:
    """Batches of 4 MiB and more copy on the process's copy workers; two threads copying
    at once (one on the workers, one on threads of its own) and a forked child (which
    starts its own) all read back what they wrote."""
    import threading

    store = BlockStore(tmp_path / "w", capacity_bytes=64 << 20)
    try:
        assert _big_batches(store, 0, 2)  # the workers exist now
        results: list[bool] = []
        threads = [threading.Thread(target=lambda t=t: results.append(
            _big_batches(store, t, 6))) for t in (1, 2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert results == [True, True]
        assert _run_forked(_forked_batches, str(tmp_path / "w")) is True
        assert _big_batches(store, 3, 2)
    finally:
        store.close()


def test_small_blocks_of_a_large_batch_round_trip_streamed(tmp_path: Path) -> None:
    """A batch of 4 MiB or more is copied around the cache block by block, small blocks
    too (from 1 KiB): blocks of odd sizes from unaligned sources, written and read that
    way, come back byte for byte and pass the read's checksum, in a batch and one by one."""
    rng = np.random.default_rng(5)
    sizes = rng.integers(900, 9000, 1200)  # about 5.6 MiB
    assert sizes.sum() >= 4 << 20
    pool = rng.integers(0, 256, int(sizes.sum()) + 64 * len(sizes), dtype=np.uint8)
    offs = np.concatenate([[3], 3 + np.cumsum(sizes + 61)[:-1]])  # odd, unaligned
    keys = [b"s%d" % i for i in range(len(sizes))]
    store = BlockStore(tmp_path / "s", capacity_bytes=256 << 20, slab_bytes=8 << 20)
    try:
        base = pool.ctypes.data
        stored = store.put_batch(keys, (base + offs).astype(np.uint64),
                                 sizes.astype(np.uint64))
        assert stored.all()
        outs = np.zeros(int(sizes.sum()) + 64 * len(sizes), np.uint8)
        status = store.read_into(keys, (outs.ctypes.data + offs + 1).astype(np.uint64),
                                 sizes.astype(np.uint64))
        assert status.all()
        for i in range(0, len(sizes), 97):
            o, n = int(offs[i]), int(sizes[i])
            assert np.array_equal(outs[o + 1:o + 1 + n], pool[o:o + n])
            one = np.zeros(n, np.uint8)  # a small read: copied through the cache
            assert store.read_into([keys[i]], np.array([one.ctypes.data], np.uint64),
                                   np.array([n], np.uint64)).all()
            assert np.array_equal(one, pool[o:o + n])
    finally:
        store.close()


def test_a_read_larger_than_the_arena_reads_spilled_blocks_from_disk(sqlite_db: object
                                                                     ) -> None:
    """get_into reads spilled blocks straight from their files (a read never evicts), so
    a batch larger than the arena reads whole. Zero-copy views of it cannot all be
    mapped at once: ``get`` hands the spilled ones out as copies read from disk, never
    StoreFull (a read that needs room is not a full store), and no block is lost."""
    kv = KVCache(sqlite_db, "big-read", block_tokens=4,  # type: ignore[arg-type]
                 capacity_bytes=64 * KiB, slab_bytes=64 * KiB)
    try:
        keys = kv.keys(list(range(4 * 8)))
        for i in range(8):  # 16 KiB each: four in the arena, four spilled
            kv.put(keys[i:i + 1], torch.full((1, 4096), float(i)))
        assert kv.stats().disk_blocks == 4
        out = torch.zeros(8, 4096)
        assert kv.get_into(keys, out) == 8
        assert out[:, 0].tolist() == [float(i) for i in range(8)]
        assert kv.stats().disk_blocks == 4 and kv.stats().evictions == 4  # nothing moved
        views = kv.get(keys)
        assert [float(v.flatten()[0]) for v in views] == [float(i) for i in range(8)]
        assert kv.stats().blocks == 8 and kv.stats().disk_blocks == 4  # none lost
        assert kv.get_into(keys[4:], [torch.zeros(4096) for _ in range(4)]) == 4
        del views
        assert torch.equal(kv.get_batch(keys[4:]), out[4:])
    finally:
        kv.destroy()


def test_the_index_holds_64_handles_and_refuses_the_next_with_store_full(
        tmp_path: Path) -> None:
    """A read lease is a bit per process slot: 64 handles may have a store open at once;
    the next is KVStoreFull naming the limit, and a closed handle's slot is free again."""
    from storage_engine import KVStoreFull

    root = tmp_path / "slots"
    stores = [BlockStore(root, capacity_bytes=1 << 20) for _ in range(64)]
    try:
        with pytest.raises(KVStoreFull, match="64 processes"):
            BlockStore(root, capacity_bytes=1 << 20)
        stores.pop().close()
        stores.append(BlockStore(root, capacity_bytes=1 << 20))
        assert stores[-1].put([b"k"], [_block(10, 1)]) == [True]
        assert stores[0].match([b"k"]) == 1
    finally:
        for s in stores:
            s.close()
