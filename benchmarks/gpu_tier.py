"""The KV block store's GPU tier through the CUDA runtime alone (no torch CUDA): what
the tier adds to the device's own copies, a batch of blocks at a time.

Runs on a CUDA device through cuda-python, or (``--standin``) on the stand-in runtime
of tests/cuda_standin.py, whose "device memory" is host memory: there the flow and
every figure run, and the goals are not measured (no device copy to judge).

Figures per block size, best of ``--reps`` (one untimed round first), GB/s of block
bytes:

* bounds, same run: ``cudaMemcpy`` device to device and host to device (pageable) of
  the batch, one call per block, as the tier copies;
* ``get_device`` cold (copy up: checksum on the host, host to device, index) and warm
  (the blocks' GPU copies mapped: no bytes move; milliseconds per batch);
* ``get_into_device`` from the GPU tier (device to device) and from the host arena;
* ``admit_device`` (device to device, beside the host copy).

Goals (issue 4, as benchmarks/kv_gpu.py): reads served by the GPU tier at >= 0.8 x the
device's own copy of the same blocks, and faster than the host-to-device copy any read
from host memory pays.

Run:  python -m benchmarks.gpu_tier [--sizes-kib 512 2048 8192 16384] [--reps 5] [--json]
      python -m benchmarks.gpu_tier --standin --sizes-kib 64 --blocks 8
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import _verdict

KiB = 1 << 10
GB = 1e9
ROOT = Path(__file__).resolve().parents[1]
DEFAULT_SIZES_KIB = [512.0, 2048.0, 8192.0, 16384.0]
X_D2D = 0.8
STANDIN_WHY = ("the stand-in runtime (tests/cuda_standin.py) copies host memory: no "
               "device copy to judge")


def _count(size_kib: float) -> int:
    return 64 if size_kib <= 2048 else 32 if size_kib <= 8192 else 16


def _best(fn: Callable[[], object], reps: int, sync: Callable[[], None],
          setup: Callable[[], object] | None = None) -> float:
    best = float("inf")
    for _ in range(reps + 1):  # one untimed warm-up round
        if setup is not None:
            setup()
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def _device_name(rt: Any) -> str:
    try:
        err, prop = rt.cudaGetDeviceProperties(0)
        name = prop.name
        return (name.split(b"\0", 1)[0].decode() if isinstance(name, bytes) else str(name))
    except Exception:  # the stand-in, or an older binding
        return "device 0"


def _size_row(store: Any, rt: Any, k: int, size_kib: float, count: int, reps: int,
              alloc: Callable[[int], int]) -> dict[str, Any]:
    from storage_engine import _cuda

    n = int(size_kib * KiB)
    total = n * count
    host = [np.full(n, (i + 3 * k) % 251, np.uint8) for i in range(count)]
    src = [alloc(n) for _ in range(count)]
    dst = [alloc(n) for _ in range(count)]
    for h, s in zip(host, src, strict=True):
        _cuda.memcpy(s, h.ctypes.data, n, "cudaMemcpyHostToDevice")

    def sync() -> None:
        _cuda.synchronize(0)

    d2d = _best(lambda: [_cuda.memcpy(d, s, n, "cudaMemcpyDeviceToDevice")
                         for d, s in zip(dst, src, strict=True)], reps, sync)
    h2d = _best(lambda: [_cuda.memcpy(d, h.ctypes.data, n, "cudaMemcpyHostToDevice")
                         for d, h in zip(dst, host, strict=True)], reps, sync)
    keys = [f"b{k}-{i}".encode() for i in range(count)]
    outs = [(d, n) for d in dst]

    def fresh() -> None:  # host copies only: the next get_device copies them up
        store.delete(keys)
        store.put(keys, host)

    def copy_up() -> None:
        assert all(v is not None for v in store.get_device(keys)), \
            "the GPU tier had no room for the batch"

    cold = _best(copy_up, reps, sync, fresh)
    warm = _best(lambda: store.get_device(keys), reps, sync)
    tier = _best(lambda: store.get_into_device(keys, outs), reps, sync)
    back = np.empty(n, np.uint8)
    for d, h in zip(dst, host, strict=True):  # what the tier copied is the block
        _cuda.memcpy(back.ctypes.data, d, n, "cudaMemcpyDeviceToHost")
        assert np.array_equal(back, h), "get_into_device copied other bytes"
    host_keys = [f"h{k}-{i}".encode() for i in range(count)]
    store.put(host_keys, host)
    from_host = _best(lambda: store.get_into_device(host_keys, outs), reps, sync)
    srcs = [(s, n, 0) for s in src]

    def host_only() -> None:
        store.delete(host_keys)
        store.put(host_keys, host)

    def admit_all() -> None:
        assert store.admit_device(host_keys, srcs) == count, "the GPU tier had no room"

    admit = _best(admit_all, reps, sync, host_only)
    store.delete(keys + host_keys)
    row = {"block_kib": size_kib, "blocks": count,
           "d2d_GBps": total / d2d / GB, "h2d_GBps": total / h2d / GB,
           "get_device_cold_GBps": total / cold / GB, "get_device_warm_ms": warm * 1e3,
           "tier_get_into_GBps": total / tier / GB,
           "host_get_into_GBps": total / from_host / GB, "admit_GBps": total / admit / GB}
    row["x_d2d"] = row["tier_get_into_GBps"] / row["d2d_GBps"]
    row["x_h2d"] = row["tier_get_into_GBps"] / row["h2d_GBps"]
    return row


def run(sizes_kib: list[float], reps: int, blocks: int | None = None,
        standin: bool = False) -> dict[str, Any]:
    from storage_engine import BlockStore, _cuda

    scratch = Path(tempfile.mkdtemp(prefix="tensordb-gputier-bench-", dir="/dev/shm"))
    if standin:  # the tests' stand-in runtime, loaded from its file (no sys.path edit)
        import importlib.util

        spec = importlib.util.spec_from_file_location("cuda_standin",
                                                      ROOT / "tests" / "cuda_standin.py")
        assert spec is not None and spec.loader is not None
        standin_mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(standin_mod)
        standin_mod.install(scratch / "standin")
    rt = _cuda.runtime()
    res: dict[str, Any] = {"runtime": "stand-in" if standin else "cuda-python",
                           "device": "stand-in (host memory)" if standin else
                           _device_name(rt), "standin": standin, "reps": reps, "sizes": []}
    allocs: list[int] = []

    def alloc(n: int) -> int:
        ptr = int(_cuda.check(rt.cudaMalloc(n), "cudaMalloc"))
        allocs.append(ptr)
        return ptr

    biggest = max(int(s * KiB) * (blocks or _count(s)) for s in sizes_kib)
    store = BlockStore(scratch / "kv", capacity_bytes=4 * biggest,
                       slab_bytes=max(1 << 20, biggest), gpu_device=0,
                       gpu_capacity=2 * biggest)
    try:
        for k, size in enumerate(sizes_kib):
            res["sizes"].append(_size_row(store, rt, k, size, blocks or _count(size),
                                          reps, alloc))
            for ptr in allocs:
                rt.cudaFree(ptr)
            allocs.clear()
        st = store.stats()
        res["stats"] = {"gpu_hits": st.gpu_hits, "gpu_blocks": st.gpu_blocks,
                        "gpu_evictions": st.gpu_evictions}
    finally:
        for ptr in allocs:
            rt.cudaFree(ptr)
        store.close()
        shutil.rmtree(scratch, ignore_errors=True)
    return res


def goals(res: dict[str, Any]) -> list[_verdict.Verdict]:
    """Two goals a block size: the tier's reads at >= 0.8 x device to device, and
    faster than host to device. Not measured on the stand-in, or where it did not run."""
    out: list[_verdict.Verdict] = []
    rows = res.get("sizes") or [{"block_kib": s, "blocks": _count(s)}
                                for s in res.get("asked_kib", DEFAULT_SIZES_KIB)]
    why = STANDIN_WHY if res.get("standin") else res.get("skipped", "")
    for r in rows:
        what = f"{r['block_kib']:g} KiB x {r['blocks']}"
        g1 = f"get_into_device from the GPU tier >= {X_D2D:g} x device memcpy, {what}"
        g2 = f"get_into_device from the GPU tier faster than host to device, {what}"
        if why or "x_d2d" not in r:
            out += [_verdict.not_measured(g1, why), _verdict.not_measured(g2, why)]
            continue
        out.append(_verdict.at_least(g1, r["x_d2d"], X_D2D, f"{r['x_d2d']:.2f} x"))
        out.append(_verdict.at_least(g2, r["x_h2d"], 1.0, f"{r['x_h2d']:.2f} x"))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes-kib", type=float, nargs="+", default=DEFAULT_SIZES_KIB)
    ap.add_argument("--blocks", type=int, help="blocks a batch (default: by size)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--standin", action="store_true",
                    help="the stand-in CUDA runtime of tests/cuda_standin.py")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if not args.standin:
        from storage_engine import GpuTier

        why = GpuTier.unavailable_reason()
        if why is not None:
            res: dict[str, Any] = {"skipped": f"no GPU here ({why})",
                                   "asked_kib": args.sizes_kib}
            res["goals"] = _verdict.to_json(goals(res))
            print(json.dumps(res, indent=2) if args.json else f"gpu_tier: skipped, {why}")
            return 0
    res = run(args.sizes_kib, args.reps, args.blocks, args.standin)
    vs = goals(res)
    res["goals"] = _verdict.to_json(vs)
    if args.json:
        print(json.dumps(res, indent=2))
        return 0 if args.standin else _verdict.exit_code(vs)
    print(f"KV GPU tier through the runtime on {res['device']} (GB/s of block bytes; "
          f"best of {args.reps})")
    cols = ("block", "d2d", "h2d", "get_device", "warm ms", "tier get_into",
            "host get_into", "admit", "x d2d", "x h2d")
    print("  ".join(f"{c:>13}" for c in cols))
    for r in res["sizes"]:
        print("  ".join(f"{v:>13}" for v in (
            f"{r['block_kib']:g} KiB", f"{r['d2d_GBps']:.1f}", f"{r['h2d_GBps']:.1f}",
            f"{r['get_device_cold_GBps']:.1f}", f"{r['get_device_warm_ms']:.3f}",
            f"{r['tier_get_into_GBps']:.1f}", f"{r['host_get_into_GBps']:.1f}",
            f"{r['admit_GBps']:.1f}", f"{r['x_d2d']:.2f}", f"{r['x_h2d']:.2f}")))
    print(f"tier counters: {res['stats']}")
    from rich.console import Console

    _verdict.print_verdicts(Console(), vs)
    return 0 if args.standin else _verdict.exit_code(vs)


if __name__ == "__main__":
    sys.exit(main())
