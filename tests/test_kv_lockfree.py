"""Nothing waits on another process's I/O: ``match`` and ``contains`` read the KV table
through its seqlock (``hdr_t.tseq``) instead of the namespace's process-shared mutex,
and a put makes its new slabs' files (allocating their pages) with the lock let go.

- A lookup answers while another process holds the lock (a put stopped at a fault point
  inside its hold): on a build whose lookups take the lock, it waits for the whole hold.
- Under churn (another process inserting and deleting keys around a set of keys that
  stay, so that deletions shift the buckets of the keys that stay, and growing the
  table), a lookup never misses a key that stays and never finds one that was never put.
- While another process makes a new slab (stopped at a fault point between making its
  file and taking the lock again), reads, puts and deletes of the namespace go on.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from storage_engine import BlockStore

CAPACITY, SLAB = 64 << 20, 1 << 20
HOLD_S = 4.0


def _key(i: int) -> bytes:
    return b"lf" + i.to_bytes(4, "little")


@pytest.fixture
def root() -> Path:
    r = Path("/dev/shm") / f"tensordb-kvlockfree-{os.getpid()}"
    shutil.rmtree(r, ignore_errors=True)
    yield r
    shutil.rmtree(r, ignore_errors=True)


def _run_child(code: str, *args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).resolve().parents[1] / "tools"), *sys.path])}
    return subprocess.Popen([sys.executable, "-c", code, *args], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _await(flag: Path, child: subprocess.Popen[str], why: str) -> None:
    """Until the child made ``flag`` (a failure naming ``why`` after 60 s)."""
    deadline = time.monotonic() + 60
    while not flag.exists():
        if child.poll() is not None:
            pytest.fail(f"the child ended: {child.communicate()}")
        if time.monotonic() > deadline:
            pytest.fail(why)
        time.sleep(0.01)


def _reap(child: subprocess.Popen[str]) -> None:
    if child.poll() is None:
        child.kill()
    child.communicate()  # and its pipes closed


_HOLDER = r"""
import os, sys, numpy as np
if os.environ.get("TENSORDB_ASAN_LIB"):
    import asan_plugin  # noqa: F401
from storage_engine import BlockStore, _stream
root, flag, done, hold_us = sys.argv[1:5]
store = BlockStore(root, capacity_bytes=64 << 20, slab_bytes=1 << 20)
_stream.set_fault("put.reserved", "sleep", int(hold_us), 1)  # inside the lock's hold
open(flag, "w").close()
store.put([b"held" + bytes(4)], [np.ones(4096, np.uint8)])
open(done, "w").close()
store.close()
"""


def test_match_and_contains_answer_while_another_process_holds_the_lock(
        root: Path, tmp_path: Path) -> None:
    store = BlockStore(root, capacity_bytes=CAPACITY, slab_bytes=SLAB)
    try:
        keys = [_key(i) for i in range(32)]
        store.put(keys, [np.full(4096, i, np.uint8) for i in range(32)])
        flag, done = tmp_path / "holding", tmp_path / "done"
        child = _run_child(_HOLDER, str(root), str(flag), str(done),
                           str(int(HOLD_S * 1e6)))
        try:
            _await(flag, child, "the holder never started its put")
            time.sleep(0.5)  # its put is inside the hold by now (it sleeps there)
            assert store.match(keys) == 32
            assert store.contains([*keys[:3], b"absent", b"held" + bytes(4)]) == [
                True, True, True, False, False]  # the held block is still being written
            assert store.match([b"held" + bytes(4)]) == 0
            answered_while_held = not done.exists()
            # the lock is still held: a call that takes it waits until the hold ends
            waited = threading.Event()
            t = threading.Thread(target=lambda: (store.delete([keys[0]]), waited.set()))
            t.start()
            still_held = not waited.wait(0.3) and not done.exists()
            t.join(60)
            assert answered_while_held and still_held, (
                "the lookups did not answer inside another process's hold of the lock")
            out, err = child.communicate(timeout=60)
            assert child.returncode == 0, err[-3000:]
        finally:
            _reap(child)
        assert store.match([b"held" + bytes(4)]) == 1  # published when the hold ended
        assert store.match(keys) == 0 and store.match(keys[1:]) == 31
    finally:
        store.close()


_CHURNER = r"""
import os, sys, numpy as np
if os.environ.get("TENSORDB_ASAN_LIB"):
    import asan_plugin  # noqa: F401
from storage_engine import BlockStore
root, seconds = sys.argv[1], float(sys.argv[2])
import time
store = BlockStore(root, capacity_bytes=64 << 20, slab_bytes=1 << 20)
buf = np.ones(600, np.uint8)
end, n, rounds = time.monotonic() + seconds, 0, 0
while time.monotonic() < end:
    # churn keys beside the ones that stay: inserts grow the table, deletes shift buckets
    batch = [b"churn" + (n + j).to_bytes(4, "little") for j in range(64)]
    store.put(batch, [buf] * 64)
    store.delete(batch[::2])
    if n > 20000:
        store.delete([b"churn" + j.to_bytes(4, "little") for j in range(n - 20000, n - 19936)])
    n += 64
    rounds += 1
print(rounds, flush=True)
store.close()
"""


def test_lookups_under_churn_and_growth_never_miss_a_key_that_stays(root: Path) -> None:
    store = BlockStore(root, capacity_bytes=CAPACITY, slab_bytes=SLAB)
    try:
        stay = [_key(i) for i in range(200)]
        never = [b"never" + i.to_bytes(4, "little") for i in range(200)]
        store.put(stay, [np.full(600, i % 251, np.uint8) for i in range(200)])
        cap0 = store.index_stats()["record_capacity"]
        child = _run_child(_CHURNER, str(root), "4")
        try:
            lookups = 0
            while child.poll() is None:
                assert store.match(stay) == 200, "a key that stays was missed"
                got = store.contains([*stay[::7], *never[::7]])
                assert all(got[:len(stay[::7])]) and not any(got[len(stay[::7]):])
                lookups += 1
            out, err = child.communicate()
            assert child.returncode == 0, err[-3000:]
            assert int(out) > 10, "the churner did too little to test anything"
            assert lookups > 10
        finally:
            _reap(child)
        # the table grew under the lookups (they remapped to each new one)
        assert store.index_stats()["record_capacity"] >= 8 * cap0
    finally:
        store.close()


_MAKER = r"""
import os, sys, numpy as np
if os.environ.get("TENSORDB_ASAN_LIB"):
    import asan_plugin  # noqa: F401
from storage_engine import BlockStore, _stream
root, flag, done, hold_us = sys.argv[1:5]
store = BlockStore(root, capacity_bytes=64 << 20, slab_bytes=1 << 20)
_stream.set_fault("slab.made", "sleep", int(hold_us), 1)  # its file made, not yet live
open(flag, "w").close()
store.put([b"made" + bytes(4)], [np.ones(100_000, np.uint8)])  # a size class of its own
open(done, "w").close()
store.close()
"""


def test_a_slab_being_made_holds_no_lock(root: Path, tmp_path: Path) -> None:
    store = BlockStore(root, capacity_bytes=CAPACITY, slab_bytes=SLAB)
    try:
        keys = [_key(i) for i in range(32)]
        store.put(keys, [np.full(4096, i, np.uint8) for i in range(32)])
        slabs = store.index_stats()["arena_bytes"]
        flag, done = tmp_path / "making", tmp_path / "done"
        child = _run_child(_MAKER, str(root), str(flag), str(done), str(int(HOLD_S * 1e6)))
        try:
            _await(flag, child, "the maker never started its put")
            time.sleep(0.5)  # inside the fault point by now
            # its slab is counted already: the arena's bytes went up by one slab
            assert store.index_stats()["arena_bytes"] > slabs
            outs = [np.empty(4096, np.uint8) for _ in keys]
            assert all(store.get_into(keys, outs))  # each of these takes the lock
            assert all(int(o[0]) == i for i, o in enumerate(outs))
            store.put([_key(100)], [np.full(4096, 7, np.uint8)])
            assert store.delete([keys[0]]) == 1
            assert store.match([b"made" + bytes(4)]) == 0
            assert not done.exists(), "the maker's put ended before the reads did"
            out, err = child.communicate(timeout=60)
            assert child.returncode == 0, err[-3000:]
        finally:
            _reap(child)
        assert store.match([b"made" + bytes(4)]) == 1
        assert store._ix.check() == []
    finally:
        store.close()


_PROMOTER = r"""
import os, sys, numpy as np
if os.environ.get("TENSORDB_ASAN_LIB"):
    import asan_plugin  # noqa: F401
from storage_engine import BlockStore, _stream
root, disk, flag, done, hold_us, key, op = sys.argv[1:8]
store = BlockStore(root, capacity_bytes=2 << 20, slab_bytes=256 << 10, disk_root=disk,
                   disk_capacity=64 << 20)
_stream.set_fault("promote.read", "sleep", int(hold_us), 1)  # its file read, not yet HOST
open(flag, "w").close()
if op == "pin":  # a pin promotes a spilled block too, in memory if it fits
    print(store.pin([bytes.fromhex(key)]), flush=True)
else:
    views = store.get([bytes.fromhex(key)])
    print("none" if views[0] is None else int(views[0].data[0]), flush=True)
    del views
open(done, "w").close()
store.close()
"""


@pytest.mark.parametrize("op", ["get", "pin"])
@pytest.mark.parametrize("meanwhile", ["read", "delete"])
def test_a_promotion_reads_its_spill_file_with_the_lock_let_go(root: Path, tmp_path: Path,
                                                              meanwhile: str, op: str) -> None:
    disk = tmp_path / "disk"
    store = BlockStore(root, capacity_bytes=2 << 20, slab_bytes=256 << 10, disk_root=disk,
                       disk_capacity=64 << 20)
    try:
        keys = [_key(i) for i in range(64)]
        for i, k in enumerate(keys):  # 4 MiB into a 2 MiB arena: the first ones spill
            store.put([k], [np.full(64 << 10, i, np.uint8)])
        spilled = [k for k in keys if store.locate(k)[0] == "disk"]
        assert len(spilled) >= 8
        target, other = spilled[0], spilled[1]
        flag, done = tmp_path / "promoting", tmp_path / "done"
        child = _run_child(_PROMOTER, str(root), str(disk), str(flag), str(done),
                           str(int(HOLD_S * 1e6)), target.hex(), op)
        try:
            _await(flag, child, f"the promoter never started its {op}")
            time.sleep(0.5)  # inside the fault point by now: the chunk filled, not HOST
            assert store.locate(target)[0] == "disk"  # still spilled, and readable
            assert store.match([target, other]) == 2
            # calls that take the lock go on: reads (a copy of the one being promoted,
            # the other promoted here), puts
            out = np.empty(64 << 10, np.uint8)
            assert store.get_into([target], [out]) == [True]
            assert int(out[0]) == keys.index(target)
            views = store.get([other])
            assert int(views[0].data[0]) == keys.index(other)
            del views
            store.put([_key(200)], [np.full(64 << 10, 9, np.uint8)])
            if meanwhile == "delete":
                assert store.delete([target]) == 1
            assert not done.exists(), f"the promoter's {op} ended before the reads did"
            got, err = child.communicate(timeout=60)
            assert child.returncode == 0, err[-3000:]
        finally:
            _reap(child)
        if meanwhile == "delete":  # deleted while promoted: gone, its chunk given back
            assert got.split() == ["0" if op == "pin" else "none"]
            assert store.match([target]) == 0
        else:
            assert got.split() == ["1" if op == "pin" else str(keys.index(target))]
            assert store.locate(target)[0] == "host"  # promoted by the other process
            if op == "pin":  # and pinned: puts that fill the arena twice over leave it
                for i in range(64):
                    store.put([_key(300 + i)], [np.full(64 << 10, 5, np.uint8)])
                assert store.locate(target)[0] == "host"
        assert store._ix.check() == []
    finally:
        store.close()


def test_the_next_table_is_made_ahead_and_taken_by_its_growth(root: Path) -> None:
    """Puts from the table half full on make the next table's file outside the lock, a
    step each, and name it only once whole; the growth takes that file (the same inode)
    instead of making one in the lock, and every block is found after it."""
    store = BlockStore(root, capacity_bytes=CAPACITY, slab_bytes=SLAB)
    try:
        cap = store.index_stats()["record_capacity"]
        buf = np.ones(600, np.uint8)
        n, first, ahead = 0, None, None
        while store.index_stats()["record_capacity"] == cap:
            store.put([_key(n)], [buf])
            n += 1
            tables = sorted(root.glob("table-*.kvx"), key=lambda p: int(p.stem[6:]))
            if len(tables) == 2 and ahead is None:
                first, ahead = tables
                inode = ahead.stat().st_ino
                assert n * 2 >= cap  # made from half full on, not before
                # named whole: twice the buckets, beside its 64-byte header
                assert ahead.stat().st_size - 64 == (first.stat().st_size - 64) * 2
        assert ahead is not None, "no table was made ahead of the growth"
        assert ahead.stat().st_ino == inode  # the growth took it
        # the old table stays beside it while its buckets move, a few at each record
        assert store.index_stats()["buckets_to_move"] > 0
        assert len(list(root.glob("table-*.kvx"))) == 2
        assert store.match([_key(i) for i in range(n)]) == n
        assert store._ix.check() == []
        while store.index_stats()["buckets_to_move"]:
            store.put([_key(n)], [buf])
            n += 1
        assert first is not None and not first.exists()  # the old one went
        assert ahead.stat().st_ino == inode
        assert store.match([_key(i) for i in range(n)]) == n
        assert store._ix.check() == []
    finally:
        store.close()
