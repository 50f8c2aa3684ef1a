"""Garbage images of a KV namespace's files, opened and used in this process: random
byte flips, words set to edge values, truncations, zeroed ranges and runs of 0xff in
the table and records files, ``index.kvx``, the event ring and a slab (seeded: the same cases every
run). No case may crash the process, and every failure must be a ``tensordb.errors``
class as the client maps it (``typed_errors``), never InvalidInput: the inputs are
valid, only the files are damaged.

In this process, not a child: under ``make asan`` (tools/asan.py lists this file) the
sanitizers see every native call of every case. ``TENSORDB_KV_FUZZ_CASES`` runs more.
"""

from __future__ import annotations

import os
import random
import shutil
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from storage_engine import BlockStore
from tensordb.client._kv_namespace import typed_errors
from tensordb.errors import CorruptData, InvalidInput, TensorDBError

CASES = int(os.environ.get("TENSORDB_KV_FUZZ_CASES", "320"))
NBLOCKS = 120
EDGE = (0, 1, 2, 0x7F, 0x80, 0xFF, 0x100, 0xFFFF, 0x7FFF_FFFF, 0x8000_0000, 0xFFFF_FFFE,
        0xFFFF_FFFF)


def _keys() -> list[bytes]:
    return [bytes([7, i % 256, i // 256]) * 5 for i in range(NBLOCKS)]


def _blocks() -> list[np.ndarray]:
    rng = np.random.default_rng(3)
    return [rng.integers(0, 256, int(n), dtype=np.uint8)
            for n in rng.choice([600, 1500, 4096, 9000], NBLOCKS)]


def _metas() -> list[bytes]:
    return [(b"m" * (10 if i % 2 else 90)) + bytes([i % 256]) for i in range(NBLOCKS)]


def _open(root: Path) -> BlockStore:
    return BlockStore(root / "shm", capacity_bytes=384 << 10, slab_bytes=64 << 10,
                      disk_root=root / "disk", disk_capacity=8 << 20)


@pytest.fixture(scope="module")
def image() -> Iterator[Path]:
    """The namespace the cases damage copies of: blocks in the arena and spilled,
    metadata in records and in chunks, events in the ring; closed."""
    root = Path("/dev/shm") / f"tensordb-kvfuzz-{os.getpid()}"
    shutil.rmtree(root, ignore_errors=True)
    store = _open(root)
    store.events_claim()
    keys, blocks, metas = _keys(), _blocks(), _metas()
    for lo in range(0, NBLOCKS, 20):
        store.put(keys[lo:lo + 20], blocks[lo:lo + 20], metas[lo:lo + 20])
    store.delete(keys[:6])
    st = store.stats()
    assert st.host_blocks and st.disk_blocks, st
    store.events_release()
    store.close()
    yield root
    shutil.rmtree(root, ignore_errors=True)


def _mutate(path: Path, rng: random.Random) -> str:
    size = path.stat().st_size
    kind = rng.choice(("flip", "word", "word", "truncate", "zero", "ff"))
    with open(path, "r+b") as fh:
        if kind == "flip":
            n = rng.randint(1, 16)
            for _ in range(n):
                at = rng.randrange(size)
                fh.seek(at)
                b = fh.read(1)
                fh.seek(at)
                fh.write(bytes([b[0] ^ (1 << rng.randrange(8))]))
            return f"{n} bit flips"
        if kind == "word":  # where the fields are: the header's start, the table's
            at = rng.randrange(min(size, 512) if rng.random() < 0.3 else size) & ~3
            value = rng.choice(EDGE) if rng.random() < 0.7 else rng.getrandbits(32)
            fh.seek(at)
            fh.write(value.to_bytes(4, "little")[:max(0, size - at)])
            return f"word {value:#x} at {at}"
        if kind == "truncate":
            cut = rng.randrange(size)
            fh.truncate(cut)
            return f"cut to {cut}"
        at, n = rng.randrange(size), rng.choice((8, 64, 512, 4096))
        fh.seek(at)
        fh.write((b"\0" if kind == "zero" else b"\xff") * min(n, size - at))
        return f"{kind} x {n} at {at}"


def _target(shm: Path, which: str, rng: random.Random) -> Path:
    if which == "table":
        return rng.choice(sorted([*shm.glob("table-*.kvx"), *shm.glob("records-*.kvx")]))
    if which == "slab":
        return rng.choice(sorted((shm / "slabs").glob("*.slab")))
    return shm / ("index.kvx" if which == "index" else "events.kvx")


def _use(root: Path, rng: random.Random, seen: list[str]) -> None:
    """Open the damaged copy and run every kind of call on it, each on its own."""
    keys, blocks = _keys(), _blocks()

    def call(op: str, fn: Callable[[], Any]) -> Any:
        try:
            with typed_errors("fuzz", "local"):
                value = fn()
        except TensorDBError as exc:
            seen.append(f"{op}:{type(exc).__name__}")
            return None
        seen.append(f"{op}:ok")
        return value

    store = call("open", lambda: _open(root))
    if store is None:
        return
    try:
        call("match", lambda: store.match(keys))
        call("contains", lambda: store.contains(keys))
        for lo in range(0, NBLOCKS, 20):  # views let go of between: room to promote
            call("get", lambda lo=lo: [v is not None and int(v.data.sum())
                                       for v in store.get(keys[lo:lo + 20])])
        pick = rng.sample(range(NBLOCKS), 24)
        outs = [np.empty_like(blocks[i]) for i in pick]
        call("get_into", lambda: store.get_into([keys[i] for i in pick], outs))
        call("events", lambda: (store.events_claim(), store.events_read(0, 1 << 24, 0),
                                store.events_take(0, 1 << 20, 0)))
        new = [bytes([9, i]) * 4 for i in range(40)]
        call("put", lambda: store.put(new, [np.full(3000, i, np.uint8) for i in range(40)],
                                      b"n" * 60))
        call("pin", lambda: (store.pin(keys[::9]), store.unpin(keys[::9])))
        call("delete", lambda: store.delete(keys[::5]))
        call("stats", lambda: store.stats())
        call("locate", lambda: store.locate(keys[50]))
    finally:
        store.close()


def test_garbage_images_fail_typed(image: Path, tmp_path: Path) -> None:
    seen: list[str] = []
    per_file: Counter[str] = Counter()
    for case in range(CASES):
        rng = random.Random(case)
        which = ("table", "index", "ring", "slab")[case % 4]
        root = Path("/dev/shm") / f"tensordb-kvfuzz-{os.getpid()}-case"
        shutil.rmtree(root, ignore_errors=True)
        shutil.copytree(image, root)
        try:
            _mutate(_target(root / "shm", which, rng), rng)
            _use(root, rng, seen)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        per_file[which] += 1
    outcomes = Counter(seen)
    print(f"{CASES} cases ({dict(per_file)}): {dict(sorted(outcomes.items()))}")
    assert not [o for o in seen if o.endswith(":" + InvalidInput.__name__)], outcomes
    # the mutations reached the checks: some cases found damage, some still served
    assert any(o.endswith(":CorruptData") for o in seen), outcomes
    assert outcomes["get:ok"] > 0, outcomes


def test_an_undamaged_image_serves(image: Path) -> None:
    root = Path("/dev/shm") / f"tensordb-kvfuzz-{os.getpid()}-clean"
    shutil.rmtree(root, ignore_errors=True)
    shutil.copytree(image, root)
    try:
        seen: list[str] = []
        _use(root, random.Random(0), seen)
        assert all(o.endswith(":ok") for o in seen), seen
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_a_lock_word_naming_no_thread_is_damage(image: Path) -> None:
    """A lock word damaged to name a thread that does not exist would make every locker
    wait forever: after 30 s unchanged it is damage (CorruptData), not a hang."""
    root = Path("/dev/shm") / f"tensordb-kvfuzz-{os.getpid()}-lock"
    shutil.rmtree(root, ignore_errors=True)
    shutil.copytree(image, root)
    try:
        pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
        tid = next(t for t in range(pid_max - 1, 1, -1) if not Path(f"/proc/{t}").exists())
        with open(root / "shm" / "index.kvx", "r+b") as fh:
            fh.seek(16)  # magic, version and ready mark, then the mutex: its lock word
            fh.write(tid.to_bytes(4, "little"))
        with pytest.raises(CorruptData, match="does not exist"), typed_errors("f", "local"):
            _open(root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
