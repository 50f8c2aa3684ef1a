"""KV block store benchmark: put + get throughput of 256-token blocks and ``match``
latency over 1,000 keys, beside memcpy and the peers an engine would use instead.

What it measures, in one run on one host, from one process (the store spreads the
copies and checksums of a batch over 8 MiB across its I/O threads; memcpy is one thread):

* ``memcpy``: each block into a pre-touched buffer, one thread, the faster of numpy
  ``copyto`` (glibc's memcpy: ordinary stores at these sizes on hosts whose streaming
  threshold lies above them) and the store's streaming copy (``storage_engine.copy``,
  stores around the cache) -- both are printed: the physical limit of moving the bytes
  once;
* ``tensordb``: ``kv.put(kv.keys(tokens), blocks)`` of a batch of torch blocks (the
  tokens' hashing into block keys, the copy into the shared-memory arena and its xxh3
  checksum), then ``kv.get_into(kv.keys(tokens), outs)`` into pre-allocated tensors
  (checksum verified on the way, as by default) and ``kv.get(kv.keys(tokens))``
  (zero-copy views; verified, so every byte is read once). The hashing is inside every
  timer, as it is inside LMCache's ``store(tokens)`` / ``retrieve(tokens)``. The arena
  is warm (its slabs allocated), as it is in a running engine;
* ``lmcache``: LMCache's CPU backend (``LMCacheEngine.store`` / ``retrieve`` with
  ``local_cpu``, chunks of 256 tokens; see ``_Lmcache``); the host copy an engine's
  connector supplies moves a batch in one call (``torch._foreach_copy_``), as a GPU
  connector's kernel does, not a Python loop over chunks;
* ``mooncake``: Mooncake Store over TCP on loopback: ``mooncake_master`` and a store
  process holding the memory segment are started here; this process is a client with
  no segment of its own, moving blocks with ``batch_put_from`` / ``batch_get_into``
  of registered buffers (zero-copy on its side; see ``_Mooncake``);
* ``redis``: pipelined SET then GET of the block bytes at 127.0.0.1:6379.

A peer that is not installed, not reachable or fails is not measured: its goal at
every size where it did not run prints "not measured" with the reason and fails (the
script exits 1), it never drops out of the list. Peers: ``pip install -e '.[bench]'``; Mooncake's wheel also needs the host's
``libibverbs1`` (Debian: ``apt-get install libibverbs1``), even over TCP.

put + get throughput = block bytes / (put time + get time), best of ``--reps`` (each
peer, Redis included, gets one more untimed round first, to open connections and fault
in its pool; the store's arena is warmed the same way).
``match`` over 1,000 present keys: median of 200 calls (goal <= 1 ms), and
``kv.match(kv.keys(tokens))`` (the tokens hashed too) beside LMCache's ``lookup`` (of the
tokens: its API hashes them), Mooncake's ``batch_is_exist`` and a pipelined EXISTS on
Redis.

Goals (issue 4): put+get >= LMCache's, >= 10 x Mooncake over TCP and >= 10 x Redis at
every size (one verdict per peer and size, ``_verdict``); match over 1,000 keys <= 1 ms.

Run:  .venv/bin/python benchmarks/kv.py [--sizes-mib 0.5 2 8 16] [--skip PEER ...]
      [--json] [--png out.png]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import _verdict
import numpy as np
import torch
from _verdict import Verdict

import tensordb
from tensordb import KVCache

GB = 1e9
MiB = 1 << 20
BLOCK_TOKENS = 256
GOAL_MATCH_MS = 1.0
GOAL_X_REDIS = 10.0
GOAL_X_MOONCAKE = 10.0
GOAL_X_LMCACHE = 1.0


def blocks_for(size_mib: float) -> int:
    return 64 if size_mib <= 2 else 32 if size_mib <= 8 else 16


def make_blocks(nbytes: int, count: int) -> list[torch.Tensor]:
    # bfloat16 KV of 256 tokens: (2, 256, heads * head_dim) with the rest folded in
    elems = nbytes // 2
    return [torch.full((elems,), float(i % 7), dtype=torch.bfloat16).view(2, BLOCK_TOKENS, -1)
            for i in range(count)]


def measure_memcpy(blocks: list[torch.Tensor], reps: int) -> dict[str, float]:
    """Seconds to copy every block once, 1 thread, best of ``reps``: with numpy's copyto
    and with the store's streaming copy."""
    import storage_engine as se

    srcs = [b.view(-1).view(torch.uint8).numpy() for b in blocks]
    dsts = [np.ones_like(s) for s in srcs]
    out: dict[str, float] = {}
    for name, fn in (("numpy", np.copyto), ("streamed", se.copy)):
        best = float("inf")
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            for d, s in zip(dsts, srcs, strict=True):
                fn(d, s)
            best = min(best, time.perf_counter() - t0)
        out[name] = best
    return out


def measure_tensordb(kv: KVCache, blocks: list[torch.Tensor], reps: int, tag: int
                     ) -> dict[str, float]:
    outs = [torch.empty_like(b) for b in blocks]
    for o in outs:
        o.view(-1).view(torch.uint8).numpy()[:: 4096] = 0  # pre-touched, like an engine's
    best: dict[str, float] = {}

    def keep(name: str, t: float) -> None:
        best[name] = min(best.get(name, float("inf")), t)

    warm = kv.keys(np.arange(len(blocks) * BLOCK_TOKENS) + (tag << 32) + (1 << 40))
    kv.put(warm, blocks)  # allocates the slabs: the arena of a running engine is warm
    kv.delete(warm)
    for rep in range(reps):
        # the tokens' hashing into keys is timed with each call, as LMCache's is
        tokens = np.arange(len(blocks) * BLOCK_TOKENS) + (tag << 32) + (rep << 24)
        t0 = time.perf_counter()
        stored = kv.put(kv.keys(tokens), blocks)
        keep("put", time.perf_counter() - t0)
        assert stored == len(blocks)
        t0 = time.perf_counter()
        kv.get_into(kv.keys(tokens), outs)
        keep("get_into", time.perf_counter() - t0)
        t0 = time.perf_counter()
        kv.get_into(kv.keys(tokens), outs, verify=False)
        keep("get_into_noverify", time.perf_counter() - t0)
        t0 = time.perf_counter()
        views = kv.get(kv.keys(tokens))
        keep("get_views", time.perf_counter() - t0)
        assert float(views[-1].view(-1)[-1]) == float(blocks[-1].view(-1)[-1])
        del views
        kv.delete(kv.keys(tokens))
    assert all(torch.equal(o, b) for o, b in zip(outs, blocks, strict=True))
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
    payloads = [b.view(-1).view(torch.uint8).numpy() for b in blocks]
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
    keys = kv.keys(np.arange(1000 * BLOCK_TOKENS))
    tiny = torch.zeros(16, dtype=torch.bfloat16)
    kv.put(keys, [tiny] * len(keys))
    assert kv.match(keys) == 1000
    times = []
    for _ in range(200):
        t0 = time.perf_counter()
        kv.match(keys)
        times.append(time.perf_counter() - t0)
    out = {"tensordb_median_s": statistics.median(times), "tensordb_best_s": min(times)}
    tokens = np.arange(1000 * BLOCK_TOKENS)
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


class _Lmcache:
    """LMCache's CPU backend as an engine drives it: ``LMCacheEngine.store`` /
    ``retrieve`` of token chunks (chunk_size = the block's 256 tokens, ``local_cpu``
    on), its storage manager allocating each chunk in LMCache's host memory pool.
    The engine's device connector is the only part an engine supplies; on a GPU it is a
    CUDA kernel, here a host one that copies the block's bytes (the same copy as ours).
    One engine per block size: its chunk shape is fixed at creation."""

    def __init__(self, nbytes: int, pool_bytes: int, name: str) -> None:
        os.environ.setdefault("LMCACHE_LOG_LEVEL", "ERROR")
        # LMCache reports usage to its vendor's server unless told not to
        os.environ["LMCACHE_TRACK_USAGE"] = "false"
        os.environ["DO_NOT_TRACK"] = "1"
        from lmcache.utils import mock_up_broadcast_fn, mock_up_broadcast_object_fn
        from lmcache.v1.cache_engine import LMCacheEngineBuilder
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface
        from lmcache.v1.metadata import LMCacheMetadata

        row = 2 * 2 * BLOCK_TOKENS * 128  # K and V, bfloat16, head_dim 128: one head
        if nbytes % row:
            raise ValueError(f"a block of {nbytes} bytes is not whole heads of "
                             f"(2, {BLOCK_TOKENS}, 128) bfloat16")
        shape = (1, 2, BLOCK_TOKENS, nbytes // row, 128)

        class HostConnector(GPUConnectorInterface):  # type: ignore[misc]
            """Moves a chunk between a host tensor and LMCache's memory object."""

            def from_gpu(self, memory_obj: Any, start: int, end: int, **kw: Any) -> None:
                src = kw["blocks"][start // BLOCK_TOKENS].reshape(-1).view(torch.uint8)
                memory_obj.tensor.reshape(-1).view(torch.uint8)[:src.numel()].copy_(src)

            def to_gpu(self, memory_obj: Any, start: int, end: int, **kw: Any) -> None:
                dst = kw["outs"][start // BLOCK_TOKENS].view(-1).view(torch.uint8)
                dst.copy_(memory_obj.tensor.reshape(-1).view(torch.uint8)[:dst.numel()])

            # a batch in one call, as a GPU connector's kernel moves it: torch loops over
            # the pairs in C++ (no Python per chunk)
            def batched_from_gpu(self, objs: Any, starts: Any, ends: Any, **kw: Any) -> None:
                srcs = [kw["blocks"][s // BLOCK_TOKENS].reshape(-1).view(torch.uint8)
                        for s in starts]
                dsts = [o.tensor.reshape(-1).view(torch.uint8)[:src.numel()]
                        for o, src in zip(objs, srcs, strict=True)]
                torch._foreach_copy_(dsts, srcs)

            def batched_to_gpu(self, objs: Any = None, starts: Any = None, ends: Any = None,
                               **kw: Any) -> None:
                dsts = [kw["outs"][s // BLOCK_TOKENS].view(-1).view(torch.uint8)
                        for s in starts]
                srcs = [o.tensor.reshape(-1).view(torch.uint8)[:dst.numel()]
                        for o, dst in zip(objs, dsts, strict=True)]
                torch._foreach_copy_(dsts, srcs)

            def get_shape(self, num_tokens: int) -> torch.Size:
                return torch.Size([shape[0], shape[1], num_tokens, shape[3], shape[4]])

        cfg = LMCacheEngineConfig.from_defaults(
            chunk_size=BLOCK_TOKENS, local_cpu=True, save_unfull_chunk=False,
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


def measure_lmcache(blocks: list[torch.Tensor], reps: int, tag: int) -> dict[str, float]:
    nbytes = blocks[0].numel() * blocks[0].element_size()
    total = nbytes * len(blocks)
    lm = _Lmcache(nbytes, total * 2 + (64 << 20), f"bench-{tag}")
    outs = [torch.empty_like(b) for b in blocks]
    for o in outs:
        o.view(-1).view(torch.uint8).numpy()[:: 4096] = 0
    best: dict[str, float] = {}
    try:
        for rep in range(reps + 1):  # the first allocates LMCache's pool: not counted
            tokens = torch.arange(len(blocks) * BLOCK_TOKENS) + (tag << 32) + (rep << 24)
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
    nb = 2 * 2 * BLOCK_TOKENS * 128  # the smallest block it takes here: one head
    lm = _Lmcache(nb, keys_n * nb * 3 // 2 + (64 << 20), "bench-match")
    try:
        tiny = [torch.zeros(nb // 2, dtype=torch.bfloat16)] * keys_n
        tokens = torch.arange(keys_n * BLOCK_TOKENS)
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


def measure_mooncake(mc: _Mooncake, blocks: list[torch.Tensor], reps: int, tag: int
                     ) -> dict[str, float]:
    nbytes = blocks[0].numel() * blocks[0].element_size()
    outs = [torch.empty_like(b) for b in blocks]
    src = [b.data_ptr() for b in blocks]
    dst = [o.data_ptr() for o in outs]
    sizes = [nbytes] * len(blocks)
    best: dict[str, float] = {}
    mc.register(blocks + outs)
    try:
        for rep in range(reps + 1):  # the first opens the TCP connections: not counted
            keys = [f"bench:{tag}:{rep}:{i}" for i in range(len(blocks))]
            t0 = time.perf_counter()
            rc = mc.store.batch_put_from(keys, src, sizes)
            put = time.perf_counter() - t0
            t0 = time.perf_counter()
            got = mc.store.batch_get_into(keys, dst, sizes)
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
    if importlib.util.find_spec("lmcache") is None:
        reasons["lmcache"] = "not installed (pip install -e '.[bench]')"
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
    db = tensordb.connect(home=tmp, data_dir=os.path.join(tmp, "data"))
    kv = KVCache(db, "bench", block_tokens=BLOCK_TOKENS, capacity_bytes=args.arena_mib * MiB)
    sizes = [(size, int(size * MiB), blocks_for(size)) for size in args.sizes_mib]
    largest = max(n * c for _, n, c in sizes)
    mc = _peer(res, "mooncake", _Mooncake, 2 * largest + (64 << 20), tmp)
    try:
        for i, (size, nbytes, count) in enumerate(sizes):
            blocks = make_blocks(nbytes, count)
            total = nbytes * count
            row: dict[str, Any] = {"block_mib": size, "blocks": count, "bytes": total}
            mcpy = measure_memcpy(blocks, args.reps)
            row["memcpy_numpy_gbps"] = total / mcpy["numpy"] / GB
            row["memcpy_streamed_gbps"] = total / mcpy["streamed"] / GB
            row["memcpy_gbps"] = total / min(mcpy.values()) / GB
            t = measure_tensordb(kv, blocks, args.reps, i)
            row["tensordb"] = {k: total / v / GB for k, v in t.items()}
            row["tensordb"]["put_get"] = total / (t["put"] + t["get_into"]) / GB
            peers = {"lmcache": _peer(res, "lmcache", measure_lmcache, blocks, args.reps, i),
                     "mooncake": None if mc is None else
                     _peer(res, "mooncake", measure_mooncake, mc, blocks, args.reps, i),
                     "redis": None if r is None else
                     _peer(res, "redis", measure_redis, r, blocks, args.reps, i)}
            for name, pt in peers.items():
                if pt is not None:
                    row[name] = {k: total / v / GB for k, v in pt.items()}
                    row[name]["put_get"] = total / (pt["put"] + pt["get"]) / GB
                    row[f"x_{name}"] = row["tensordb"]["put_get"] / row[name]["put_get"]
            res["sizes"].append(row)
            del blocks
        res["match"] = measure_match(kv, r)
        if "lmcache" not in res["skipped"]:
            v = _peer(res, "lmcache", lmcache_match, 1000)
            if v is not None:
                res["match"]["lmcache_median_s"] = v
        if mc is not None:
            v = _peer(res, "mooncake", mooncake_match, mc, 1000)
            if v is not None:
                res["match"]["mooncake_median_s"] = v
    finally:
        if mc is not None:
            mc.close()
        kv.destroy()
        db.close()
        shutil.rmtree(db.config.shm_dir, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)
    res["loadavg_after"] = os.getloadavg()[0]
    res["goals"] = _verdict.to_json(goals(res))
    return res


def goals(res: dict[str, Any]) -> list[Verdict]:
    """The match goal, then put+get against each peer at each size: one verdict per
    peer and size, "not measured" (failed) with the reason where the peer did not run."""
    m = res["match"]["tensordb_median_s"] * 1e3
    out = [_verdict.at_most(f"match over 1,000 keys <= {GOAL_MATCH_MS:g} ms", m,
                            GOAL_MATCH_MS, f"{m:.3f} ms median")]
    for name in PEERS:
        for row in res["sizes"]:
            peer = row.get(name, {}).get("put_get")
            reason = res["skipped"].get(name, "did not run at this size")
            out.append(_verdict.faster_than_peer(
                f"put+get >= {GOAL_X[name]:g} x {name}, {row['block_mib']:g} MiB blocks",
                row["tensordb"]["put_get"], peer, GOAL_X[name], reason))
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

    con = Console(width=160)
    con.print(f"[bold]KV blocks[/] of {BLOCK_TOKENS} tokens; GB/s with GB = 1e9 bytes; best of "
              f"{res['reps']}; one process; {os.cpu_count()} CPUs; memcpy: 1 thread, one copy "
              f"(put+get moves the bytes twice)")
    t = Table(title="tensordb (GB/s); memcpy: the faster, under it numpy copyto / streamed")
    for col in ("block", "blocks", "memcpy", "put", "get_into", "get_into (no verify)",
                "get (zero-copy views)", "put+get"):
        t.add_column(col, justify="right")
    for row in res["sizes"]:
        t.add_row(f"{row['block_mib']:g} MiB", str(row["blocks"]),
                  f"{_f(row, 'memcpy_gbps')}\n{_f(row, 'memcpy_numpy_gbps')} / "
                  f"{_f(row, 'memcpy_streamed_gbps')}",
                  _f(row, "tensordb", "put"), _f(row, "tensordb", "get_into"),
                  _f(row, "tensordb", "get_into_noverify"), _f(row, "tensordb", "get_views"),
                  _f(row, "tensordb", "put_get"))
    con.print(t)
    t = Table(title="put+get GB/s beside the peers (put GB/s / get GB/s under each)")
    for col in ("block", "memcpy", "tensordb", "lmcache (CPU)", "mooncake (TCP)", "redis",
                f"x lmcache (>= {GOAL_X_LMCACHE:g})", f"x mooncake (>= {GOAL_X_MOONCAKE:g})",
                f"x redis (>= {GOAL_X_REDIS:g})"):
        t.add_column(col, justify="right")
    for row in res["sizes"]:
        cells = [f"{row['block_mib']:g} MiB", _f(row, "memcpy_gbps")]
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
    con.print(f"match over 1,000 present keys: {m['tensordb_median_s'] * 1e3:.3f} ms median, "
              f"{m['tensordb_best_s'] * 1e3:.3f} ms best")
    for key, what in (("tensordb_tokens_median_s",
                       "tensordb kv.match(kv.keys(tokens)) (tokens in)"),
                      ("lmcache_median_s", "lmcache LMCacheEngine.lookup (tokens in)"),
                      ("mooncake_median_s", "mooncake batch_is_exist"),
                      ("redis_median_s", "redis pipelined EXISTS")):
        if key in m:
            con.print(f"  {what} x 1,000: {m[key] * 1e3:.3f} ms median")
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
    labels = [f"{row['block_mib']:g} MiB" for row in rows]
    series = {"memcpy (1 copy)": [row["memcpy_gbps"] for row in rows],
              "tensordb put+get": [row["tensordb"]["put_get"] for row in rows],
              "tensordb get (views)": [row["tensordb"]["get_views"] for row in rows]}
    for name, label in (("lmcache", "LMCache CPU put+get"),
                        ("mooncake", "Mooncake TCP put+get"), ("redis", "Redis put+get")):
        if rows and all(name in row for row in rows):
            series[label] = [row[name]["put_get"] for row in rows]
    fig, ax = plt.subplots(figsize=(10, 5))
    width = 0.8 / len(series)
    for j, (name, vals) in enumerate(series.items()):
        bars = ax.bar([i + j * width for i in range(len(labels))], vals, width, label=name)
        ax.bar_label(bars, fmt="%.2f", fontsize=6, rotation=90, padding=2)
    ax.set_xticks([i + width * (len(series) - 1) / 2 for i in range(len(labels))], labels)
    ax.set_yscale("log")
    ax.set_ylabel("GB/s (log scale)")
    m = res["match"]
    title = (f"KV blocks of {BLOCK_TOKENS} tokens, {os.cpu_count()} CPUs; match(1,000 keys): "
             f"tensordb {m['tensordb_median_s'] * 1e3:.2f} ms")
    for key, name in (("lmcache_median_s", "LMCache"), ("mooncake_median_s", "Mooncake"),
                      ("redis_median_s", "Redis")):
        if key in m:
            title += f", {name} {m[key] * 1e3:.2f} ms"
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.08), ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes-mib", type=float, nargs="+", default=[0.5, 2, 8, 16],
                   help="block sizes in MiB (0.5 2 8 16)")
    p.add_argument("--reps", type=int, default=3, help="repetitions; the best is kept (3)")
    p.add_argument("--arena-mib", type=int, default=1024, help="the arena's size (1024)")
    p.add_argument("--tmp-dir", default=None, help="where the temporary store goes")
    p.add_argument("--skip", nargs="*", default=[], choices=PEERS,
                   help="peers to leave out")
    p.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    p.add_argument("--png", default=None, help="write a bar chart to this PNG file")
    args = p.parse_args(argv)
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
