"""Processes racing on one KV namespace: two writers churn blocks of 600 B to 1 MiB
while two readers ``match`` / ``get`` / ``get_into`` the same keys.

The writers' size band moves with the clock (both writers in step), so the arena fills
with one chunk size, its slabs empty as those blocks are evicted or deleted, and come
back in the same table slots with another chunk size: the window in which a reader's
lock-free copy must not trust what the shared slab table says after it unlocked. Every
block's bytes are a function of its key, so a reader checks each byte it is served.
Every process loads the build the parent has (under ``make asan`` the instrumented one).

The default suite runs a few seconds; ``make asan`` (tools/asan.py) runs it longer with
every process on the instrumented build (``TENSORDB_KV_RACE_S``, 60 there).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

SECONDS = float(os.environ.get("TENSORDB_KV_RACE_S", "6"))
#: the readers' fault point "read.copy" sleeps this long between a batch's look-up and
#: its copies: the window in which the writers drop and remake slabs. On the build
#: before the copies took their addresses under the lock, both readers died of SIGSEGV
#: within 15 s (a chunk number times another slab's chunk size, outside the mapping)
WINDOW_US = 2000

_CODE = r"""
import json, os, sys, time
if os.environ.get("TENSORDB_ASAN_LIB"):
    import asan_plugin  # noqa: F401  (the instrumented build, as in the parent)
import numpy as np
from storage_engine import BlockStore
from storage_engine._kv_types import KVCorrupt

role, root, seconds, seed = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
WINDOW_US = int(sys.argv[5])
BANDS = (600, 1500, 5000, 9000, 40000, 130000, 600000, 1 << 20)
COUNT = (3072, 1024, 256, 256, 96, 96, 96, 96)  # small blocks many: high chunk numbers
FIRST = [sum(COUNT[:b]) for b in range(len(BANDS))]
rng = np.random.default_rng(seed)
store = BlockStore(root, capacity_bytes=16 << 20, slab_bytes=4 << 20)

def key(i):
    return b"race" + i.to_bytes(4, "little")

def size(i):
    return next(BANDS[b] for b in reversed(range(len(BANDS))) if i >= FIRST[b])

def block(i):
    b = np.full(size(i), i % 251, np.uint8)
    b[:4] = np.frombuffer(i.to_bytes(4, "little"), np.uint8)
    return b

def band_now():
    return int(time.monotonic() * 5) % len(BANDS)

if role == "reader":  # a long window between a read's look-up and its copies
    from storage_engine import _stream
    _stream.set_fault("read.copy", "sleep", WINDOW_US)
stats = {"ops": 0, "served": 0, "bad": 0, "full": 0}
end = time.monotonic() + seconds
while time.monotonic() < end:
    band = band_now()
    if role == "reader" and rng.random() < 0.5:
        band = int(rng.integers(0, len(BANDS)))
    ids = [int(x) for x in FIRST[band] + rng.choice(COUNT[band], 24, replace=False)]
    if role == "reader" and rng.random() < 0.5:  # large copies first: a long window
        ids = [int(x) for x in FIRST[7] + rng.choice(COUNT[7], 6, replace=False)] + ids
    keys = [key(i) for i in ids]
    stats["ops"] += 1
    if role == "writer":
        try:
            store.put(keys, [block(i) for i in ids])
        except Exception as exc:  # a full arena of pinned / leased blocks: try again
            if type(exc).__name__ != "KVStoreFull":
                raise
            stats["full"] += 1
        if rng.random() < 0.3:
            store.delete(keys[: int(rng.integers(1, len(keys)))])
        continue
    store.match(keys)
    store.contains(keys)
    try:
        if rng.random() < 0.5:
            views = store.get(keys)
            got = [(i, v.data) for i, v in zip(ids, views) if v is not None]
        else:
            outs = [np.empty(size(i), np.uint8) for i in ids]
            found = store.get_into(keys, outs)
            got = [(i, o) for i, o, f in zip(ids, outs, found) if f]
    except KVCorrupt as exc:
        stats["bad"] += len(exc.args[0]) if exc.args else 1
        continue
    for i, data in got:
        stats["served"] += 1
        if data.size != size(i) or not np.array_equal(data, block(i)):
            stats["bad"] += 1
    del got
print(json.dumps({**stats, "slab_drops": store.index_stats().get("slab_drops", -1)}))
store.close()
"""


def _reap(procs: list[subprocess.Popen[str]], root: Path) -> None:
    """Kill what still runs, wait for every child (no pipe or process left to the
    collector), and remove the namespace."""
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.communicate()
    shutil.rmtree(root, ignore_errors=True)


def test_readers_racing_churning_writers_are_served_only_whole_blocks(tmp_path: Path
                                                                       ) -> None:
    root = Path("/dev/shm") / f"tensordb-kvrace-{os.getpid()}"
    shutil.rmtree(root, ignore_errors=True)
    script = tmp_path / "race.py"
    script.write_text(_CODE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).resolve().parents[1] / "tools"), *sys.path])}
    roles = ["writer", "writer", "reader", "reader"]
    procs: list[subprocess.Popen[str]] = []
    try:
        procs = [subprocess.Popen([sys.executable, str(script), role, str(root),
                                   str(SECONDS), str(seed), str(WINDOW_US)],
                                  stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, env=env)
                 for seed, role in enumerate(roles)]
        # every process's outcome before any verdict: the first failure's cause may be
        # another process's (one that found damage marks the namespace for all)
        ended = [(role, *p.communicate(timeout=SECONDS * 4 + 120), p.returncode)
                 for p, role in zip(procs, roles, strict=True)]
    finally:
        _reap(procs, root)
    failed = [f"a {role} ended with {rc}:\n{err[-3000:]}"
              for role, _out, err, rc in ended if rc != 0]
    assert not failed, "\n".join(failed)
    results = [(role, json.loads(out.strip().splitlines()[-1]))
               for role, out, _err, _rc in ended]
    readers = [r for role, r in results if role == "reader"]
    writers = [r for role, r in results if role == "writer"]
    assert all(r["bad"] == 0 for r in readers), results
    assert all(r["served"] > 0 for r in readers), results
    assert all(w["ops"] > 0 for w in writers), results
    # the churn did what it is for: slabs emptied and came back with other sizes
    assert max(r["slab_drops"] for _, r in results) > 0, results


_CREATE = r"""
import os, sys, time
if os.environ.get("TENSORDB_ASAN_LIB"):
    import asan_plugin  # noqa: F401
from storage_engine import BlockStore
root, at = sys.argv[1], float(sys.argv[2])
while time.time() < at:  # every creator starts at the same instant
    pass
store = BlockStore(root, capacity_bytes=8 << 20, slab_bytes=1 << 20)
store.put([b"k" + str(os.getpid()).encode()], [bytes(4096)])
store.close()
"""


def test_creators_racing_on_a_new_namespace_share_one_table(tmp_path: Path) -> None:
    """Processes that open one new namespace at the same instant all find it whole: a
    creator that loses the race to publish its index removes only the files it made,
    never the winner's table (a later opener once found the table missing, and marked
    the namespace damaged for every process)."""
    script = tmp_path / "create.py"
    script.write_text(_CREATE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).resolve().parents[1] / "tools"), *sys.path])}
    from storage_engine import BlockStore
    for round_ in range(8):
        root = Path("/dev/shm") / f"tensordb-kvcreate-{os.getpid()}-{round_}"
        shutil.rmtree(root, ignore_errors=True)
        at = time.time() + 1.5
        procs = [subprocess.Popen([sys.executable, str(script), str(root), str(at)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, env=env) for _ in range(4)]
        try:
            ended = [(*p.communicate(timeout=120), p.returncode) for p in procs]
            failed = [err[-2000:] for _out, err, rc in ended if rc != 0]
            assert not failed, "\n".join(failed)
            assert len(list(root.glob("table-*.kvx"))) == 1
            store = BlockStore(root, capacity_bytes=8 << 20, slab_bytes=1 << 20)
            try:
                assert store.match([b"k" + str(p.pid).encode() for p in procs]) == 4
                assert store._ix.check() == []
            finally:
                store.close()
        finally:
            _reap(procs, root)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
