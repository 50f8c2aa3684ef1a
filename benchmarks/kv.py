"""KV block store benchmark: put + get throughput of 256-token blocks and ``match``
latency over 1,000 keys, beside memcpy and the peers an engine would use instead.

What it measures, in one run on one host, from one process (the store spreads the
copies and checksums of a batch over 8 MiB across its I/O threads; memcpy is one thread):

* ``memcpy``: numpy ``copyto`` of each block into a pre-touched buffer: the physical
  limit of moving the bytes once;
* ``tensordb``: ``kv.put(keys, blocks)`` of a batch of torch blocks (the copy into the
  shared-memory arena and its xxh3 checksum), then ``kv.get_into(keys, outs)`` into
  pre-allocated tensors (checksum verified on the way, as by default) and
  ``kv.get(keys)`` (zero-copy views; verified, so every byte is read once). The arena
  is warm (its slabs allocated), as it is in a running engine;
* ``redis``: pipelined SET then GET of the block bytes at 127.0.0.1:6379 (skipped, with
  the reason, when it does not answer or the ``redis`` client is missing);
* ``lmcache`` / ``mooncake``: run only when installed; otherwise skipped with a reason.

put + get throughput = block bytes / (put time + get time), best of ``--reps``.
``match`` over 1,000 present keys: median of 200 calls (goal <= 1 ms), beside a
pipelined EXISTS of the same keys on Redis.

Run:  .venv/bin/python benchmarks/kv.py [--sizes-mib 0.5 2 8 16] [--json] [--png out.png]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import numpy as np
import torch

import tensordb
from tensordb._kv import KVCache

GB = 1e9
MiB = 1 << 20
BLOCK_TOKENS = 256
GOAL_MATCH_MS = 1.0
GOAL_X_REDIS = 10.0


def blocks_for(size_mib: float) -> int:
    return 64 if size_mib <= 2 else 32 if size_mib <= 8 else 16


def make_blocks(nbytes: int, count: int) -> list[torch.Tensor]:
    # bfloat16 KV of 256 tokens: (2, 256, heads * head_dim) with the rest folded in
    elems = nbytes // 2
    return [torch.full((elems,), float(i % 7), dtype=torch.bfloat16).view(2, BLOCK_TOKENS, -1)
            for i in range(count)]


def measure_memcpy(blocks: list[torch.Tensor], reps: int) -> float:
    srcs = [b.view(-1).view(torch.uint8).numpy() for b in blocks]
    dsts = [np.ones_like(s) for s in srcs]
    best = float("inf")
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        for d, s in zip(dsts, srcs):
            np.copyto(d, s)
        best = min(best, time.perf_counter() - t0)
    return best


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
        keys = kv.keys(np.arange(len(blocks) * BLOCK_TOKENS) + (tag << 32) + (rep << 24))
        t0 = time.perf_counter()
        stored = kv.put(keys, blocks)
        keep("put", time.perf_counter() - t0)
        assert stored == len(blocks)
        t0 = time.perf_counter()
        kv.get_into(keys, outs)
        keep("get_into", time.perf_counter() - t0)
        t0 = time.perf_counter()
        kv.get_into(keys, outs, verify=False)
        keep("get_into_noverify", time.perf_counter() - t0)
        t0 = time.perf_counter()
        views = kv.get(keys)
        keep("get_views", time.perf_counter() - t0)
        assert float(views[-1].view(-1)[-1]) == float(blocks[-1].view(-1)[-1])
        del views
        kv.delete(keys)
    assert all(torch.equal(o, b) for o, b in zip(outs, blocks))
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
    for rep in range(reps):
        keys = [f"tensordb-bench:{tag}:{rep}:{i}" for i in range(len(blocks))]
        t0 = time.perf_counter()
        p = r.pipeline(transaction=False)
        for k, v in zip(keys, payloads):
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


def peer_reasons() -> dict[str, str]:
    reasons = {}
    if importlib.util.find_spec("lmcache") is None:
        reasons["lmcache"] = ("not installed (pip install lmcache; its CPU backend needs "
                              "the CUDA build of its c_ops)")
    else:
        reasons["lmcache"] = "installed, but no driver for it in this script yet"
    if importlib.util.find_spec("mooncake") is None:
        reasons["mooncake"] = ("not installed (pip install mooncake-transfer-engine-non-cuda; "
                               "needs mooncake_master and a metadata server running)")
    else:
        reasons["mooncake"] = "installed, but no driver for it in this script yet"
    return reasons


def run(args: argparse.Namespace) -> dict[str, Any]:
    tmp = tempfile.mkdtemp(prefix="tensordb-kvbench-", dir=args.tmp_dir)
    r, redis_reason = redis_client()
    res: dict[str, Any] = {"sizes": [], "skipped": peer_reasons(), "reps": args.reps,
                           "loadavg_before": os.getloadavg()[0]}
    if redis_reason:
        res["skipped"]["redis"] = redis_reason
    db = tensordb.connect(home=tmp, data_dir=os.path.join(tmp, "data"))
    kv = KVCache(db, "bench", block_tokens=BLOCK_TOKENS, capacity_bytes=args.arena_mib * MiB)
    try:
        for i, size in enumerate(args.sizes_mib):
            nbytes = int(size * MiB)
            count = blocks_for(size)
            blocks = make_blocks(nbytes, count)
            total = nbytes * count
            row: dict[str, Any] = {"block_mib": size, "blocks": count, "bytes": total}
            mc = measure_memcpy(blocks, args.reps)
            row["memcpy_gbps"] = total / mc / GB
            t = measure_tensordb(kv, blocks, args.reps, i)
            row["tensordb"] = {k: total / v / GB for k, v in t.items()}
            row["tensordb"]["put_get"] = total / (t["put"] + t["get_into"]) / GB
            if r is not None:
                rt = measure_redis(r, blocks, args.reps, i)
                row["redis"] = {k: total / v / GB for k, v in rt.items()}
                row["redis"]["put_get"] = total / (rt["put"] + rt["get"]) / GB
                row["x_redis"] = row["tensordb"]["put_get"] / row["redis"]["put_get"]
            res["sizes"].append(row)
            del blocks
        res["match"] = measure_match(kv, r)
    finally:
        kv.destroy()
        db.close()
        shutil.rmtree(db.config.shm_dir, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)
    res["loadavg_after"] = os.getloadavg()[0]
    res["goals"] = {"match_1000_le_1ms": res["match"]["tensordb_median_s"] * 1e3
                    <= GOAL_MATCH_MS}
    if r is not None:
        res["goals"]["put_get_ge_10x_redis"] = all(
            row["x_redis"] >= GOAL_X_REDIS for row in res["sizes"])
    return res


def print_report(res: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console(width=140)
    con.print(f"[bold]KV blocks[/] of {BLOCK_TOKENS} tokens; GB/s with GB = 1e9 bytes; best of "
              f"{res['reps']}; one process; {os.cpu_count()} CPUs; memcpy: 1 thread, one copy "
              f"(put+get moves the bytes twice)")
    t = Table(title="throughput (GB/s)")
    for col in ("block", "blocks", "memcpy", "tensordb put", "get_into", "get_into (no verify)",
                "get (zero-copy views)", "tensordb put+get", "redis put", "redis get",
                "redis put+get", "x redis"):
        t.add_column(col, justify="right")
    for row in res["sizes"]:
        td, rd = row["tensordb"], row.get("redis")
        t.add_row(f"{row['block_mib']:g} MiB", str(row["blocks"]), f"{row['memcpy_gbps']:.2f}",
                  f"{td['put']:.2f}", f"{td['get_into']:.2f}", f"{td['get_into_noverify']:.2f}",
                  f"{td['get_views']:.2f}", f"{td['put_get']:.2f}",
                  f"{rd['put']:.2f}" if rd else "-", f"{rd['get']:.2f}" if rd else "-",
                  f"{rd['put_get']:.2f}" if rd else "-",
                  f"{row['x_redis']:.1f}" if rd else "-")
    con.print(t)
    m = res["match"]
    line = (f"match over 1,000 present keys: {m['tensordb_median_s'] * 1e3:.3f} ms median, "
            f"{m['tensordb_best_s'] * 1e3:.3f} ms best (goal <= {GOAL_MATCH_MS:g} ms: "
            f"{'ok' if res['goals']['match_1000_le_1ms'] else 'MISS'})")
    if "redis_median_s" in m:
        line += f"; redis pipelined EXISTS x 1,000: {m['redis_median_s'] * 1e3:.3f} ms"
    con.print(line)
    if "put_get_ge_10x_redis" in res["goals"]:
        con.print(f"put+get >= {GOAL_X_REDIS:g} x redis at every size: "
                  f"{'ok' if res['goals']['put_get_ge_10x_redis'] else 'MISS'}")
    for peer, reason in res["skipped"].items():
        con.print(f"skipped {peer}: {reason}")
    con.print(f"1-min load average before/after: {res['loadavg_before']:.2f} / "
              f"{res['loadavg_after']:.2f}")


def write_png(res: dict[str, Any], path: str) -> str | None:
    if importlib.util.find_spec("matplotlib") is None:
        return "matplotlib is not installed"
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{row['block_mib']:g} MiB" for row in res["sizes"]]
    series = {"memcpy": [row["memcpy_gbps"] for row in res["sizes"]],
              "tensordb put+get": [row["tensordb"]["put_get"] for row in res["sizes"]],
              "tensordb get (views)": [row["tensordb"]["get_views"] for row in res["sizes"]]}
    if all("redis" in row for row in res["sizes"]):
        series["redis put+get"] = [row["redis"]["put_get"] for row in res["sizes"]]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.8 / len(series)
    for j, (name, vals) in enumerate(series.items()):
        ax.bar([i + j * width for i in range(len(labels))], vals, width, label=name)
    ax.set_xticks([i + width * (len(series) - 1) / 2 for i in range(len(labels))], labels)
    ax.set_ylabel("GB/s")
    ax.set_title(f"KV blocks of {BLOCK_TOKENS} tokens; match(1,000 keys) = "
                 f"{res['match']['tensordb_median_s'] * 1e3:.2f} ms")
    ax.legend()
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
