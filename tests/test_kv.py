"""The KV block store: keys, sharing across processes, eviction, pins, corruption, spill."""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import lmdb
import numpy as np
import pytest
import torch
from conftest import flip_byte, open_store
from sqlalchemy import select

import tensordb
from storage_engine import BlockStore, Eviction, KVStoreFull, LRUEviction
from storage_engine._kv_types import size_class
from tensordb import KVCache
from tensordb.catalog.schema import kv_namespaces
from tensordb.errors import CorruptData, InvalidInput, NotFound, StoreFull

CTX = mp.get_context("forkserver")
CTX.set_forkserver_preload(["torch", "tensordb", "conftest"])

KiB = 1024


@pytest.fixture
def kv(sqlite_db: tensordb.Database) -> Iterator[KVCache]:
    cache = KVCache(sqlite_db, "model-a", block_tokens=4, capacity_bytes=256 * KiB,
                    slab_bytes=64 * KiB)
    try:
        yield cache
    finally:
        cache.destroy()


def _block(value: float, n: int = 4096, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.full((n // 4,), value, dtype=torch.float32).to(dtype)


def _store(tmp: Path, **kw: object) -> BlockStore:
    root = Path("/dev/shm") / f"tensordb-kvtest-{os.getpid()}-{tmp.name}"
    return BlockStore(root, **kw)  # type: ignore[arg-type]


@pytest.fixture
def make_store(tmp_path: Path) -> Iterator[object]:
    made: list[BlockStore] = []

    def make(**kw: object) -> BlockStore:
        s = _store(tmp_path / str(len(made)), **kw)
        made.append(s)
        return s

    yield make
    import shutil
    for s in made:
        s.close()
        shutil.rmtree(s.root, ignore_errors=True)


# -- keys ----------------------------------------------------------------------------
_KEYS_CODE = textwrap.dedent("""
    import sys, tensordb
    from tensordb import KVCache
    db = tensordb.connect(home=sys.argv[1], data_dir=sys.argv[1] + "/data")
    kv = KVCache(db, "model-a", block_tokens=4, capacity_bytes=1 << 20)
    print(",".join(k.hex() for k in kv.keys(list(range(1000, 1018)))))
    kv.close(); db.close()
""")


def test_keys_stable_across_processes_and_hash_seeds(kv: KVCache, store_home: Path) -> None:
    tokens = list(range(1000, 1018))
    keys = kv.keys(tokens)
    assert len(keys) == 4 and all(len(k) == 16 for k in keys)  # 18 tokens: 4 full blocks
    assert kv.keys(torch.tensor(tokens)) == keys == kv.keys(np.array(tokens, np.int32))
    assert kv.keys(tokens[4:], parent=keys[0]) == keys[1:]  # a chain names its prefix
    assert kv.keys([7] + tokens[1:])[0] != keys[0]
    assert kv.keys([7] + tokens[1:])[3] != keys[3]
    procs = [subprocess.Popen([sys.executable, "-c", _KEYS_CODE, str(store_home)],
                              env={**os.environ, "PYTHONHASHSEED": seed},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for seed in ("0", "12345")]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err
        assert out.strip().split(",") == [k.hex() for k in keys]


def test_keys_depend_on_namespace_and_block_size(sqlite_db: tensordb.Database) -> None:
    tokens = list(range(64))
    a = KVCache(sqlite_db, "ns-a", block_tokens=8, capacity_bytes=1 << 20)
    b = KVCache(sqlite_db, "ns-b", block_tokens=8, capacity_bytes=1 << 20)
    c = KVCache(sqlite_db, "ns-c", block_tokens=16, capacity_bytes=1 << 20)
    try:
        assert not set(a.keys(tokens)) & set(b.keys(tokens))
        assert len(c.keys(tokens)) == 4 and a.keys(tokens[:7]) == []
    finally:
        for x in (a, b, c):
            x.destroy()


# -- put / get -----------------------------------------------------------------------
def test_put_get_roundtrip_dtypes_shapes(kv: KVCache) -> None:
    blocks = [torch.arange(24, dtype=torch.bfloat16).view(2, 3, 4),
              torch.arange(10, dtype=torch.int64), torch.arange(15, dtype=torch.float16).view(3, 5).t()]
    keys = [bytes([i]) * 16 for i in range(3)]
    assert kv.put(keys, blocks) == 3
    assert kv.put(keys, blocks) == 0  # present: first writer wins, no error
    got = kv.get(keys)
    for g, b in zip(got, blocks, strict=True):
        assert g.dtype == b.dtype and g.shape == b.shape and torch.equal(g, b)
    g0 = got[0]
    g0.zero_()  # copy-on-write: the reader's copy only
    assert torch.equal(kv.get(keys[:1])[0], blocks[0])
    outs = [torch.empty_like(b).contiguous() for b in blocks]
    assert kv.get_into(keys, outs) == 3
    assert all(torch.equal(o, b) for o, b in zip(outs, blocks, strict=True))
    strided = torch.zeros(3, 5, dtype=torch.float16).t()  # a non-contiguous destination
    kv.get_into(keys[2:], [strided])
    assert torch.equal(strided, blocks[2])
    # contiguous, yet the size-1 last dim has a stride of 4; and a 0-d tensor
    odd = [torch.arange(4, dtype=torch.bfloat16).view(1, 4).t(), torch.tensor(7.0)]
    assert odd[0].is_contiguous() and odd[0].stride() == (1, 4)
    assert kv.put([b"o" * 16, b"z" * 16], odd) == 2
    outs = [torch.arange(4, 8, dtype=torch.bfloat16).view(1, 4).t(), torch.tensor(0.0)]
    assert kv.get_into([b"o" * 16, b"z" * 16], outs) == 2
    assert all(torch.equal(o, b) for o, b in zip(outs, odd, strict=True))
    assert [tuple(g.shape) for g in kv.get([b"o" * 16, b"z" * 16])] == [(4, 1), ()]
    # a block that requires grad, and blocks of one shape in other dtypes in one batch
    mixed = [torch.ones(2, 3, requires_grad=True), torch.full((2, 3), 2, dtype=torch.int32),
             torch.full((2, 3), 3.0, dtype=torch.float16)]
    mkeys = [bytes([0x80 + i]) * 16 for i in range(3)]
    assert kv.put(mkeys, mixed) == 3
    for g, b in zip(kv.get(mkeys), mixed, strict=True):
        assert g.dtype == b.dtype and g.shape == b.shape and torch.equal(g, b.detach())
    with pytest.raises(NotFound):
        kv.get([b"\xff" * 16])
    with pytest.raises(NotFound):
        kv.get_into([b"\xff" * 16], [torch.empty(4)])


def test_match_over_1000_keys(sqlite_db: tensordb.Database) -> None:
    kv = KVCache(sqlite_db, "many", block_tokens=2, capacity_bytes=8 << 20, slab_bytes=4 << 20)
    try:
        keys = kv.keys(list(range(2000)))
        assert len(keys) == 1000
        assert kv.put(keys[:600] + keys[601:], [_block(float(i)) for i in range(999)]) == 999
        assert kv.match(keys) == 600
        kv.put(keys[600:601], [_block(600.0)])
        assert kv.match(keys) == 1000
        best = min(_timed(kv.match, keys) for _ in range(20))
        assert best < 0.01  # the goal is 1 ms (benchmarks/kv.py); CI machines vary
        assert kv.contains([keys[5], b"\0" * 16]) == [True, False]
    finally:
        kv.destroy()


def _timed(fn: object, *args: object) -> float:
    t = time.perf_counter()
    fn(*args)  # type: ignore[operator]
    return time.perf_counter() - t


# -- across processes ----------------------------------------------------------------
def _reader(home: str, keys: list[bytes], out: mp.queues.Queue) -> None:
    db = open_store(Path(home))
    kv = KVCache(db, "model-a", block_tokens=4, capacity_bytes=256 * KiB, slab_bytes=64 * KiB)
    n = kv.match(keys)
    got = kv.get(keys[:n])
    slabs = str(kv.shm_dir / "slabs")
    spans = []
    with open("/proc/self/maps") as fh:
        for line in fh:
            if slabs in line:
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                spans.append((lo, hi))
    inside = sum(any(lo <= t.data_ptr() < hi for lo, hi in spans) for t in got)
    values = [float(t[0]) for t in got]
    got[0].fill_(-1.0)  # a stray write stays in this process
    kv.put([b"child".ljust(16, b"\0")], [_block(42.0)])
    out.put((n, inside, values))
    kv.close()
    db.close()


def test_block_written_by_one_process_read_zero_copy_by_another(
        kv: KVCache, store_home: Path) -> None:
    keys = kv.keys(list(range(12)))
    kv.put(keys, [_block(float(i)) for i in range(3)])
    out = CTX.Queue()
    proc = CTX.Process(target=_reader, args=(str(store_home), keys, out))
    proc.start()
    n, inside, values = out.get(timeout=60)
    proc.join(30)
    assert proc.exitcode == 0
    assert (n, inside, values) == (3, 3, [0.0, 1.0, 2.0])
    assert [float(t[0]) for t in kv.get(keys)] == [0.0, 1.0, 2.0]
    assert float(kv.get([b"child".ljust(16, b"\0")])[0][0]) == 42.0


def _put_same(home: str, keys: list[bytes], value: float, barrier: object,
              out: mp.queues.Queue) -> None:
    db = open_store(Path(home))
    kv = KVCache(db, "model-a", block_tokens=4, capacity_bytes=256 * KiB, slab_bytes=64 * KiB)
    barrier.wait()  # type: ignore[attr-defined]
    stored = 0
    for k in keys:
        stored += kv.put([k], [_block(value, 8192)])
    out.put(stored)
    kv.close()
    db.close()


def test_concurrent_puts_of_one_key_first_writer_wins(kv: KVCache, store_home: Path) -> None:
    keys = [bytes([i]) * 16 for i in range(20)]
    writers = 4
    barrier = CTX.Barrier(writers)
    out = CTX.Queue()
    procs = [CTX.Process(target=_put_same, args=(str(store_home), keys, float(w + 1),
                                                 barrier, out)) for w in range(writers)]
    [p.start() for p in procs]
    stored = [out.get(timeout=60) for _ in procs]
    [p.join(30) for p in procs]
    assert [p.exitcode for p in procs] == [0] * writers
    assert sum(stored) == len(keys)  # each key stored once, by one writer
    for t in kv.get(keys):
        assert float(t[0]) in (1.0, 2.0, 3.0, 4.0) and bool((t == t[0]).all())


def _hold_view(home: str, key: bytes, ready: mp.connection.Connection) -> None:
    db = open_store(Path(home))
    kv = KVCache(db, "model-a", block_tokens=4, capacity_bytes=256 * KiB, slab_bytes=64 * KiB)
    view = kv.get([key])[0]
    ready.send(float(view[0]))
    time.sleep(600)


def test_block_being_read_is_not_evicted_until_its_reader_dies(
        sqlite_db: tensordb.Database, store_home: Path) -> None:
    kv = KVCache(sqlite_db, "model-a", block_tokens=4, capacity_bytes=16 * KiB,
                 slab_bytes=16 * KiB, spill=False)
    try:
        keys = [bytes([i]) * 16 for i in range(8)]
        kv.put(keys[:4], [_block(float(i)) for i in range(4)])
        parent, child = CTX.Pipe()
        proc = CTX.Process(target=_hold_view, args=(str(store_home), keys[0], child))
        proc.start()
        assert parent.recv() == 0.0
        kv.put(keys[4:7], [_block(float(i)) for i in range(4, 7)])  # evicts 1, 2, 3
        assert kv.contains(keys) == [True, False, False, False, True, True, True, False]
        kv.pin(keys[4:7])
        with pytest.raises(StoreFull):
            kv.put(keys[7:], [_block(7.0)])
        proc.kill()
        proc.join(10)
        kv.put(keys[7:], [_block(7.0)])  # the dead reader's lease no longer counts
        assert kv.contains(keys)[0] is False and kv.match(keys[7:]) == 1
    finally:
        kv.destroy()


def _die_mid_put(home: str, key: bytes, ready: mp.connection.Connection) -> None:
    def stall() -> None:  # between the reservation and the copy
        ready.send("reserved")
        time.sleep(600)

    db = open_store(Path(home))
    kv = KVCache(db, "model-a", block_tokens=4, capacity_bytes=256 * KiB, slab_bytes=64 * KiB)
    kv.store.after_reserve = stall
    kv.put([key], [_block(1.0)])


def test_writer_killed_mid_put_leaves_no_block_and_no_lock(kv: KVCache,
                                                           store_home: Path) -> None:
    key = b"w" * 16
    parent, child = CTX.Pipe()
    proc = CTX.Process(target=_die_mid_put, args=(str(store_home), key, child))
    proc.start()
    assert parent.recv() == "reserved"
    assert kv.match([key]) == 0 and kv.put([key], [_block(2.0)]) == 0  # its writer lives
    proc.kill()
    proc.join(10)
    assert kv.match([key]) == 0  # never published
    assert kv.put([key], [_block(2.0)]) == 1  # the dead writer's claim is taken over
    assert float(kv.get([key])[0][0]) == 2.0


# -- capacity, pins, eviction --------------------------------------------------------
class _Workload:
    """Random operations on a store, and the model of what it must hold."""

    def __init__(self, store: BlockStore, rng: random.Random) -> None:
        self.store = store
        self.rng = rng
        self.content: dict[bytes, int] = {}
        self.pinned: set[bytes] = set()
        self.in_memory: set[bytes] = set()
        self.held: list[object] = []

    def step(self, step: int, k: bytes, op: float, sizes: list[int]) -> None:
        store = self.store
        if op < 0.5:
            n = self.rng.choice(sizes)
            try:
                ok = store.put([k], [np.full(n, step % 251, np.uint8)])[0]
                if ok:
                    self.content[k] = step % 251
            except KVStoreFull:
                assert self.pinned or self.held
        elif op < 0.7:
            v = store.get([k])[0]
            if v is not None:
                assert int(v.data[0]) == self.content[k] and int(v.data[-1]) == self.content[k]
                if self.rng.random() < 0.3:
                    self.held.append(v)
        elif op < 0.8:
            if len(self.pinned) < 6 and store.pin([k]):
                self.pinned.add(k)
                if store.locate(k)[0] == "host":  # type: ignore[index]
                    self.in_memory.add(k)  # pinning brings it back from disk where room allows
        elif op < 0.9:
            if k in self.pinned:
                store.unpin([k])
                self.pinned.discard(k)
                self.in_memory.discard(k)
        elif op < 0.95:
            if k not in self.pinned:
                store.delete([k])
        else:
            self.held.clear()
        if len(self.held) > 4:
            self.held.pop(0)

    def check(self, cap: int) -> None:
        s = self.store.stats()
        on_disk = sum(e.stat().st_blocks * 512 for e in os.scandir(self.store.root / "slabs"))
        assert s.arena_bytes <= cap and on_disk <= cap
        for p in self.pinned:  # never dropped, never moved out of memory
            loc = self.store.locate(p)
            assert loc is not None and (loc[0] == "host" or p not in self.in_memory)


@pytest.mark.parametrize("spill", [False, True], ids=["no-spill", "spill"])
def test_random_workload_stays_in_arena_and_keeps_pins(make_store: object, tmp_path: Path,
                                                       spill: bool) -> None:
    cap = 256 * KiB
    store: BlockStore = make_store(  # type: ignore[operator]
        capacity_bytes=cap, slab_bytes=64 * KiB, eviction="s3fifo" if spill else "lru",
        disk_root=tmp_path / "disk" if spill else None)
    rng = random.Random(7)
    sizes = [4 * KiB, 10 * KiB, 16 * KiB, 40 * KiB]
    universe = [bytes([i]) * 16 for i in range(60)]
    work = _Workload(store, rng)
    for step in range(600):
        k = rng.choice(universe)
        work.step(step, k, rng.random(), sizes)
        work.check(cap)
    assert store.stats().evictions > 0
    for k in work.content:
        v = store.get([k])[0]
        if v is not None:
            assert int(v.data[0]) == work.content[k]


@pytest.mark.deadline
def test_store_full_at_once_when_everything_is_pinned(kv: KVCache) -> None:
    keys = kv.keys(list(range(4 * 80)))
    n = 0
    while kv.stats().evictions == 0 and n < len(keys):  # fill until the first eviction
        kv.put(keys[n:n + 1], [_block(float(n), 16 * KiB)])
        n += 1
    present = [k for k in keys[:n] if kv.contains([k])[0]]
    assert kv.pin(present) == len(present)
    before = kv.stats()
    t = time.monotonic()
    with pytest.raises(StoreFull) as info:
        kv.put(keys[n:n + 2], [_block(1.0, 16 * KiB), _block(2.0, 16 * KiB)])
    assert time.monotonic() - t < 1.0
    assert info.value.collection == "model-a"
    after = kv.stats()
    assert (after.blocks, after.nbytes, after.evictions) == \
        (before.blocks, before.nbytes, before.evictions)
    assert kv.match(present) == len(present) and not any(kv.contains(keys[n:n + 2]))
    kv.unpin(present[:1])
    assert kv.put(keys[n:n + 1], [_block(1.0, 16 * KiB)]) == 1


def test_lru_and_s3fifo_evict_in_their_orders(make_store: object) -> None:
    def run(eviction: str, option: str = "eviction") -> list[bytes]:
        store: BlockStore = make_store(capacity_bytes=16 * KiB,  # type: ignore[operator]
                                       slab_bytes=16 * KiB, **{option: eviction})
        buf = np.zeros(4 * KiB, np.uint8)
        a, b, c, d, e, f = (bytes([x]) * 16 for x in b"ABCDEF")
        store.put([a, b, c], [buf] * 3)
        for _ in range(2):
            store.get([a, b, c])
        store.put([d], [buf])
        store.put([e], [buf])
        store.put([f], [buf])
        return [k[:1] for k in (a, b, c, d, e, f) if not store.contains([k])[0]]

    assert run("lru") == [b"A", b"B"]  # least recently used first
    assert run("s3fifo") == [b"D", b"E"]  # one-hit wonders leave from the small queue
    assert run("s3fifo", "policy") == [b"D", b"E"]  # the option's older name


class EvictionContract:
    """What every ``Eviction`` must do; a new eviction subclasses this suite."""

    eviction_cls: type[Eviction]

    @pytest.fixture
    def bound(self, tmp_path: Path) -> Iterator[tuple[lmdb.Environment, Eviction]]:
        env = lmdb.open(str(tmp_path / "eviction"), max_dbs=8, map_size=1 << 24)
        eviction = self.eviction_cls()
        counters = env.open_db(b"counters")

        def counter(txn: lmdb.Transaction, name: str, delta: int) -> int:
            raw = txn.get(name.encode(), db=counters)
            v = (int(raw) if raw else 0) + delta
            if delta:
                txn.put(name.encode(), str(v).encode(), db=counters)
            return v

        eviction.bind({n: env.open_db(n.encode()) for n in eviction.db_names}, counter)
        yield env, eviction
        env.close()

    def _drain(self, env: lmdb.Environment, eviction: Eviction,
               refuse: set[bytes] = frozenset()) -> list[bytes]:  # type: ignore[assignment]
        out = []
        with env.begin(write=True) as txn:
            while (k := eviction.victim(txn, lambda k: k not in refuse)) is not None:
                assert k not in refuse and k not in out
                eviction.on_remove(txn, k)
                out.append(k)
        return out

    def test_every_key_is_offered_once_then_none(self, bound: tuple) -> None:
        env, eviction = bound
        keys = [bytes([i]) * 16 for i in range(30)]
        with env.begin(write=True) as txn:
            for k in keys:
                eviction.on_insert(txn, k)
            for k in keys[::3]:
                eviction.on_access(txn, k)
        assert sorted(self._drain(env, eviction)) == keys

    def test_refused_and_removed_keys_are_never_offered(self, bound: tuple) -> None:
        env, eviction = bound
        keys = [bytes([i]) * 16 for i in range(20)]
        with env.begin(write=True) as txn:
            for k in keys:
                eviction.on_insert(txn, k)
            eviction.on_remove(txn, keys[0])
            eviction.on_remove(txn, keys[0])  # idempotent
        got = self._drain(env, eviction, refuse=set(keys[1:6]))
        assert sorted(got) == keys[6:]
        assert sorted(self._drain(env, eviction)) == keys[1:6]  # refused ones stay queued

    def test_reinsert_is_one_entry(self, bound: tuple) -> None:
        env, eviction = bound
        with env.begin(write=True) as txn:
            for _ in range(3):
                eviction.on_insert(txn, b"k" * 16)
        assert self._drain(env, eviction) == [b"k" * 16]


class TestLRUEviction(EvictionContract):
    eviction_cls = LRUEviction


def test_s3fifo_sends_a_key_seen_again_to_its_main_queue(make_store: object) -> None:
    """A key evicted from S3-FIFO's small queue is remembered (its ghost): put again, it
    goes to the main queue and outlives the one-hit wonders put after it."""
    store: BlockStore = make_store(capacity_bytes=16 * KiB,  # type: ignore[operator]
                                   slab_bytes=16 * KiB, eviction="s3fifo")
    buf = np.zeros(4 * KiB, np.uint8)
    a, *rest = (bytes([x]) * 16 for x in b"ABCDEFGHIJ")
    store.put([a, *rest[:3]], [buf] * 4)
    store.put(rest[3:4], [buf])  # the arena holds four: A, the oldest in small, goes
    assert store.contains([a]) == [False]
    store.put([a], [buf])  # a ghost hit: into main
    for k in rest[4:]:
        store.put([k], [buf])  # each evicts from the small queue, never A
    assert store.contains([a]) == [True]
    assert store.contains(rest[:3]) == [False] * 3


def test_spill_to_disk_and_read_back(kv: KVCache) -> None:
    keys = kv.keys(list(range(4 * 40)))
    blocks = [_block(float(i), 16 * KiB) for i in range(40)]  # 640 KiB into a 256 KiB arena
    kv.put(keys, blocks)
    s = kv.stats()
    assert s.spills > 0 and s.disk_blocks > 0 and s.host_bytes <= s.capacity
    assert kv.match(keys) == 40
    assert kv.store.locate(keys[0])[0] == "disk"  # type: ignore[index]
    files = list(kv.disk_dir.glob("*.blk")) + list((kv.shm_dir / "slabs").iterdir()) + \
        list(kv.shm_dir.glob("*.kvx"))
    assert files and all(f.stat().st_mode & 0o777 == 0o600 for f in files)  # owner only
    assert all(d.stat().st_mode & 0o777 == 0o700 for d in (kv.disk_dir, kv.shm_dir))
    got = kv.get(keys[:4])
    assert [float(t[0]) for t in got] == [0.0, 1.0, 2.0, 3.0]
    assert kv.store.locate(keys[0])[0] == "host"  # type: ignore[index]
    out = [torch.empty(4 * KiB) for _ in range(4)]
    kv.get_into(keys[10:14], out)
    assert [float(o[0]) for o in out] == [10.0, 11.0, 12.0, 13.0]


@pytest.fixture
def spilling(sqlite_db: tensordb.Database) -> Iterator[Callable[..., KVCache]]:
    """KV namespaces of an arena of 4 blocks of 16 KiB and a disk of ``disk_blocks``,
    used through the public API only (db.kv, put, pin, stats, contains, get): where a
    block lies is read from the counters, so the tests hold whatever the block store's
    internals become."""
    made: list[KVCache] = []

    def make(name: str, disk_blocks: int) -> KVCache:
        kv = sqlite_db.kv(name, block_tokens=4, capacity_bytes=64 * KiB, slab_bytes=64 * KiB,
                          eviction="lru", disk_capacity=disk_blocks * 16 * KiB)
        made.append(kv)
        return kv

    try:
        yield make
    finally:
        for kv in made:
            kv.destroy()


def _put_one_by_one(kv: KVCache, keys: list[bytes], n: int,
                    each: Callable[[int], None] = lambda i: None) -> None:
    """Blocks 0..n-1 (block i holds i), one put each; ``each(i)`` after each."""
    for i in range(n):
        kv.put(keys[i : i + 1], [_block(float(i), 16 * KiB)])
        each(i)


def test_a_pinned_block_on_disk_survives_a_trim_past_disk_capacity(
        spilling: Callable[..., KVCache]) -> None:
    kv = spilling("pins", disk_blocks=1)  # the disk is full with one spill
    keys = kv.keys(list(range(4 * 6)))
    _put_one_by_one(kv, keys, 5)
    s = kv.stats()  # the least recent, block 0, went to disk
    assert (s.host_blocks, s.disk_blocks, s.disk_bytes) == (4, 1, 16 * KiB)
    # with the arena all pinned, pinning the spilled block leaves it on disk
    assert kv.pin(keys[1:5]) == 4 and kv.pin(keys[:1]) == 1
    s = kv.stats()
    assert (s.host_blocks, s.disk_blocks, s.pinned) == (4, 1, 5)
    kv.unpin(keys[4:5])
    kv.put(keys[5:6], [_block(5.0, 16 * KiB)])  # spills block 4: the disk is over
    s = kv.stats()
    assert s.disk_blocks == 1 and s.disk_bytes == 16 * KiB and s.pinned == 4
    # the trim took the unpinned spill (block 4), not the older pinned one (block 0)
    assert kv.contains(keys[:6]) == [True, True, True, True, False, True]
    (got,) = kv.get(keys[:1])
    assert torch.equal(got, _block(0.0, 16 * KiB))


def test_a_read_with_no_room_to_bring_a_block_back_is_served_not_store_full(
        spilling: Callable[..., KVCache]) -> None:
    """A spilled block whose arena is all pinned cannot be mapped back: a read is still
    served (a copy from disk), the store is unchanged, and a damaged disk copy is
    CorruptData and dropped, never StoreFull: a read that finds no room is not a full
    store, and a reader (an engine's load) must not have to treat it as one."""
    kv = spilling("no-room", disk_blocks=4)
    keys = kv.keys(list(range(4 * 6)))
    _put_one_by_one(kv, keys, 6)  # blocks 0 and 1 spilled
    assert kv.pin(keys[2:6]) == 4
    before = kv.stats()
    assert (before.host_blocks, before.disk_blocks) == (4, 2)
    got = kv.get(keys[:3])
    assert [float(t[0]) for t in got] == [0.0, 1.0, 2.0]
    got[0].fill_(9.0)  # a copy of its own: the store's bytes are not the reader's
    after = kv.stats()
    assert (after.host_blocks, after.disk_blocks, after.blocks, after.pinned) == \
        (4, 2, 6, 4)
    assert torch.equal(kv.get(keys[:1])[0], _block(0.0, 16 * KiB))
    loc = kv.store.locate(keys[1])
    assert loc is not None and loc[0] == "disk"
    flip_byte(loc[1], 100)
    with pytest.raises(CorruptData):
        kv.get(keys[1:2])
    assert kv.contains(keys[:3]) == [True, False, True]  # dropped, the rest kept


def test_the_disk_stays_within_its_capacity_over_many_spills(
        spilling: Callable[..., KVCache]) -> None:
    # 40 puts spill 36 blocks, and each spill past the disk's capacity drops the oldest
    # spill (sequence numbers past 15 included: the trim matches each queued spill to
    # its file by its number)
    kv = spilling("many", disk_blocks=2)
    keys = kv.keys(list(range(4 * 40)))

    def within(i: int) -> None:
        s = kv.stats()
        assert s.disk_bytes <= 32 * KiB and s.disk_blocks <= 2, i

    _put_one_by_one(kv, keys, 40, within)
    s = kv.stats()
    assert (s.host_blocks, s.disk_blocks, s.disk_bytes) == (4, 2, 32 * KiB)
    assert s.spills == 36
    assert kv.contains(keys[:40]) == [False] * 34 + [True] * 6
    assert [float(t[0]) for t in kv.get(keys[36:40])] == [36.0, 37.0, 38.0, 39.0]


# -- corruption ----------------------------------------------------------------------
@pytest.mark.parametrize("reader", ["get", "get_into", "disk"])
def test_corrupt_block_is_detected_and_never_served(kv: KVCache, reader: str) -> None:
    keys = kv.keys(list(range(12)))
    kv.put(keys, [_block(float(i)) for i in range(3)])
    if reader == "disk":
        kv.put(kv.keys(list(range(100, 100 + 4 * 80))), [_block(9.0)] * 80)  # spill ours
    tier, path, offset, nbytes = kv.store.locate(keys[1])  # type: ignore[misc]
    assert tier == ("disk" if reader == "disk" else "host")
    flip_byte(path, offset + nbytes // 2)
    with pytest.raises(CorruptData):
        if reader == "get_into":
            kv.get_into(keys, [torch.empty(1024) for _ in keys])
        else:
            kv.get(keys)
    assert kv.match(keys) == 1  # dropped: a miss from now on
    with pytest.raises(NotFound):
        kv.get(keys[1:2])
    assert kv.stats().corrupt == 1
    assert float(kv.get(keys[:1])[0][0]) == 0.0


# -- inputs, stats, catalog ----------------------------------------------------------
def test_bad_inputs_give_typed_errors_and_change_nothing(kv: KVCache,
                                                         sqlite_db: tensordb.Database) -> None:
    keys = kv.keys(list(range(16)))
    kv.put(keys[:1], [_block(1.0)])
    before = kv.stats()
    for ns in ("", "../x", " x", 3):
        with pytest.raises(InvalidInput):
            KVCache(sqlite_db, ns, capacity_bytes=1 << 20)  # type: ignore[arg-type]
    for bt in (0, -1, True, 2.5):
        with pytest.raises(InvalidInput):
            KVCache(sqlite_db, "x", block_tokens=bt)  # type: ignore[arg-type]
    with pytest.raises(InvalidInput):
        KVCache(sqlite_db, "x", policy="fifo")
    with pytest.raises(InvalidInput):
        KVCache(sqlite_db, "x", eviction="fifo")
    for opts in ({"policy": ""}, {"eviction": ""}, {"eviction": "lru", "policy": "s3fifo"}):
        with pytest.raises(InvalidInput, match="eviction|policy"):
            KVCache(sqlite_db, "x", **opts)  # type: ignore[arg-type]
    with pytest.raises(InvalidInput):
        KVCache(sqlite_db, "model-a", block_tokens=8, capacity_bytes=1 << 20)  # was 4
    bad_puts = [
        ("key", [_block(1.0)]),  # one key, not a list
        (["str-key"], [_block(1.0)]),
        ([b""], [_block(1.0)]),
        ([b"k" * 300], [_block(1.0)]),
        (keys[1:3], [_block(1.0)]),  # 2 keys, 1 block
        (keys[1:2], [np.zeros(4)]),
        (keys[1:2], [torch.empty(0)]),
        (keys[1:3], [_block(2.0), "x"]),  # the first is valid: still nothing stored
        (keys[1:3], [_block(2.0), torch.empty(0)]),
        (keys[1:4], [_block(2.0), _block(3.0), torch.empty(2, 0)]),
    ]
    for ks, bs in bad_puts:
        with pytest.raises(InvalidInput):
            kv.put(ks, bs)  # type: ignore[arg-type]
    for tokens in ([1.5, 2.0], [[1, 2], [3, 4]], torch.ones(8), ["a"], [1 << 70]):
        with pytest.raises(InvalidInput):
            kv.keys(tokens)
    for call in (kv.match, kv.get, kv.pin, kv.unpin, kv.delete, kv.contains):
        with pytest.raises(InvalidInput):
            call([1234])  # type: ignore[list-item]
    with pytest.raises(InvalidInput):
        kv.get_into(keys[:1], [torch.empty(3)])  # wrong size
    with pytest.raises(InvalidInput):
        kv.get_into(keys[:1], [])
    after = kv.stats()
    assert (after.blocks, after.nbytes) == (before.blocks, before.nbytes) == (1, 4096)
    assert kv.match(keys) == 1 and float(kv.get(keys[:1])[0][0]) == 1.0


def test_block_tokens_past_the_catalog_column_rejected_store_unchanged(
        db: tensordb.Database) -> None:
    """block_tokens is kept in a 32-bit column: a larger one is InvalidInput naming it
    (PostgreSQL raised DataError), with no namespace row and no directory left behind."""
    def namespaces() -> list[tuple[str, int]]:
        with db.catalog.engine.connect() as conn:
            return sorted((r.name, r.block_tokens) for r in conn.execute(
                select(kv_namespaces.c.name, kv_namespaces.c.block_tokens)))

    kv_dirs = [Path(db.config.shm_dir) / "kv", Path(db.config.data_dir) / "kv"]
    for bt in (2**31, 2**40, 10**30):
        with pytest.raises(InvalidInput) as info:
            db.kv("big", block_tokens=bt, capacity_bytes=256 * KiB)
        assert "block_tokens must be a positive int below 2**31" in str(info.value)
        assert str(bt) in str(info.value) and info.value.collection == "big"
    assert namespaces() == [] and not any(d.exists() for d in kv_dirs)
    cache = db.kv("big", block_tokens=2**31 - 1, capacity_bytes=256 * KiB,
                  slab_bytes=64 * KiB)  # the largest the column holds
    try:
        assert namespaces() == [("big", 2**31 - 1)]
    finally:
        cache.destroy()


def test_a_namespace_registered_meanwhile_with_another_block_size_is_rejected(
        sqlite_db: tensordb.Database) -> None:
    """Another process registers the namespace between this one's look-up and its insert,
    with another block size: InvalidInput naming both (it used to pass unchecked), no
    store opened, the other's row unchanged."""
    from datetime import datetime, timezone

    from sqlalchemy import event, insert

    db = sqlite_db
    engine = db.catalog.engine
    done: list[bool] = []

    def meanwhile(conn: object, clause: object, *args: object) -> None:
        if done or "SELECT" not in str(clause) or "kv_namespaces" not in str(clause):
            return
        done.append(True)
        with engine.begin() as other:  # its own connection: committed at once
            other.execute(insert(kv_namespaces).values(
                name="raced", node=db.config.node, block_tokens=8, blocks=0, nbytes=0,
                created_at=datetime.now(timezone.utc)))

    event.listen(engine, "after_execute", meanwhile)
    try:
        with pytest.raises(InvalidInput, match="holds blocks of 8 tokens, not 16"):
            db.kv("raced", block_tokens=16, capacity_bytes=256 * KiB)
    finally:
        event.remove(engine, "after_execute", meanwhile)
    assert done and not (Path(db.config.shm_dir) / "kv" / "raced").exists()
    with db.catalog.engine.connect() as conn:
        assert conn.execute(select(kv_namespaces.c.block_tokens)
                            .where(kv_namespaces.c.name == "raced")).scalars().all() == [8]


def test_pins_unpins_deletes(kv: KVCache) -> None:
    keys = kv.keys(list(range(12)))
    kv.put(keys[:2], [_block(1.0), _block(2.0)])
    assert kv.pin(keys) == 2 and kv.stats().pinned == 2
    assert kv.unpin(keys) == 2 and kv.unpin(keys) == 0 and kv.stats().pinned == 0
    view = kv.get(keys[:1])[0]
    assert kv.delete(keys) == 2 and kv.delete(keys) == 0 and kv.match(keys) == 0
    kv.put(keys[:1], [_block(5.0)])  # the freed chunk is not reused while viewed
    assert float(view[0]) == 1.0 and float(kv.get(keys[:1])[0][0]) == 5.0


def test_closed_cache_raises_store_closed(sqlite_db: tensordb.Database) -> None:
    kv = KVCache(sqlite_db, "closing", block_tokens=4, capacity_bytes=1 << 20)
    again = KVCache(sqlite_db, "closing", block_tokens=4)  # one store per process, shared
    keys = kv.keys(list(range(8)))
    kv.put(keys, [_block(1.0), _block(2.0)])
    kv.close()
    kv.close()
    with pytest.raises(tensordb.errors.StoreClosed):
        kv.match(keys)
    assert again.match(keys) == 2 and kv.keys(list(range(8))) == keys
    again.destroy()


def test_a_handle_closed_during_a_call_is_store_closed_and_a_bad_buffer_invalid_input(
        sqlite_db: tensordb.Database) -> None:
    """The native index raises ValueError both for a buffer it cannot use and for a
    call on a closed index: the client keeps them apart by the handle's state."""
    kv = KVCache(sqlite_db, "closing-mid-call", block_tokens=4, capacity_bytes=1 << 20)
    keys = kv.keys(list(range(8)))
    kv.put(keys, [_block(1.0), _block(2.0)])
    with pytest.raises(tensordb.errors.InvalidInput, match="bytes"):
        kv.get_into(keys[:1], [torch.empty(3, dtype=torch.uint8)])  # the wrong size
    real = kv.store

    class ClosedUnderTheCall:
        """The store as a second thread's ``close`` leaves it during a ``match``."""

        def match(self, ks: list[bytes]) -> int:
            kv.close()  # the last handle of the process: the index itself closes
            return real.match(ks)

    kv.store = ClosedUnderTheCall()  # type: ignore[assignment]
    with pytest.raises(tensordb.errors.StoreClosed, match="closed during the call") as info:
        kv.match(keys)
    assert isinstance(info.value.__cause__, ValueError)
    assert "closed" in str(info.value.__cause__)
    again = KVCache(sqlite_db, "closing-mid-call", block_tokens=4)
    assert again.match(keys) == 2  # nothing lost
    again.destroy()


def test_stats_summarise_the_node_and_reach_the_catalog(kv: KVCache,
                                                        sqlite_db: tensordb.Database) -> None:
    keys = kv.keys(list(range(4 * 10)))
    kv.put(keys[:6], [_block(float(i)) for i in range(6)])
    kv.get(keys[:2])
    with pytest.raises(NotFound):
        kv.get(keys[6:7])
    s = kv.stats()
    assert (s.blocks, s.nbytes, s.capacity) == (6, 6 * 4096, 256 * KiB)
    assert s.node == "local" and s.namespace == "model-a" and s.block_tokens == 4
    assert s.hits == 2 and s.misses == 1 and 0 < s.load < 1
    assert all(s.may_hold(k) for k in keys[:6])
    assert sum(s.may_hold(bytes([i]) * 16) for i in range(200)) < 20
    assert s.prefix_hits(keys) >= 6
    with sqlite_db.catalog.engine.connect() as conn:
        row = conn.execute(select(kv_namespaces.c.block_tokens, kv_namespaces.c.blocks,
                                  kv_namespaces.c.nbytes)
                           .where(kv_namespaces.c.name == "model-a")).one()
    assert tuple(row) == (4, 6, 6 * 4096)


def test_size_classes() -> None:
    # under a page: power-of-two chunks from 512 bytes, sharing pages
    assert [size_class(n) for n in (1, 512, 513, 1024, 1025, 2048, 4095, 4096)] == \
        [512, 512, 1024, 1024, 2048, 2048, 4096, 4096]
    assert size_class(4097) == 8192
    assert size_class(1 << 20) == 1 << 20 and size_class(16 << 20) == 16 << 20
    assert size_class((1 << 20) + 1) == 1280 * KiB  # at most a quarter of slack
    for n in (5000, 70_000, 3 << 20, (512 << 10) + 7):
        c = size_class(n)
        assert n <= c <= n * 1.25 + 4096 and c % 4096 == 0


def test_database_kv_and_close(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import shutil as _shutil

    import tensordb as _tdb

    db = _tdb.connect(home=tmp_path / "s", data_dir=tmp_path / "s" / "data")
    try:
        kv = db.kv("ns", block_tokens=4, capacity_bytes=16 << 20)
        keys = kv.keys(list(range(8)))
        kv.put(keys, [torch.ones(4) for _ in keys])
        assert kv.match(keys) == 2
    finally:
        db.close()
        _shutil.rmtree(db.config.shm_dir, ignore_errors=True)
    with pytest.raises(_tdb.errors.StoreClosed):
        kv.match(keys)


def _lease_and_wait(root: str, key: bytes, conn: mp.connection.Connection) -> None:
    store = BlockStore(Path(root), capacity_bytes=256 * KiB, slab_bytes=64 * KiB)
    view = store.get([key])[0]
    conn.send(view is not None)
    time.sleep(600)


def test_a_batch_into_a_full_arena_scans_for_dead_processes_once(make_store: object
                                                                 ) -> None:
    """Every block of a batch into a full arena evicts; the search for a dead process's
    leases and chunks (a pass over the records) runs when an allocation finds no room,
    once per batch step, never once per block: per block it made a 50,000-block batch
    quadratic (54 s)."""
    store = make_store(capacity_bytes=256 * KiB, slab_bytes=64 * KiB)  # type: ignore[operator]
    block = np.zeros(1024, np.uint8)
    store.put([b"f%07d" % i for i in range(256)], [block] * 256)  # full
    parent, child = CTX.Pipe()
    proc = CTX.Process(target=_lease_and_wait, args=(str(store.root), b"f0000000", child))
    proc.start()
    assert parent.recv() is True
    proc.kill()
    proc.join(10)
    before = store.index_stats()["reclaim_scans"]
    keys = [b"n%07d" % i for i in range(256)]
    assert all(store.put(keys, [block] * 256))  # evicts every older block
    scans = store.index_stats()["reclaim_scans"] - before
    assert scans == 1  # the dead reader's slot is cleared by the first; no more needed
    assert all(store.contains(keys[-16:]))  # the batch landed, evicting older blocks
    assert not store.contains([b"f0000000"])[0]  # the dead reader's lease did not hold it


def test_small_blocks_share_pages(make_store: object) -> None:
    """1 KiB blocks take 1 KiB chunks (four to a page), each read zero-copy and verified,
    and a reader's stray write reaches neither the store nor the page's other blocks."""
    store = make_store(capacity_bytes=64 * KiB, slab_bytes=64 * KiB)  # type: ignore[operator]
    blocks = [np.full(1000, i, np.uint8) for i in range(64)]  # 64 x 1 KiB chunks fill it
    keys = [b"s%03d" % i for i in range(64)]
    assert all(store.put(keys, blocks))
    assert store.stats().evictions == 0 and store.match(keys) == 64
    views = store.get(keys)
    for i, v in enumerate(views):
        assert v is not None and bytes(v.data) == bytes(blocks[i])
    views[1].data[:] = 255  # a stray write into one block's view
    again = store.get(keys[:4])
    assert [bytes(v.data) for v in again if v is not None] == [bytes(b) for b in blocks[:4]]
    assert bytes(views[0].data) == bytes(blocks[0]) and bytes(views[2].data) == bytes(blocks[2])
    del views, again  # their leases end: the blocks may go
    import gc
    gc.collect()
    store.put([b"more"], [np.zeros(1000, np.uint8)])  # the arena is full: one eviction
    assert store.stats().evictions == 1
