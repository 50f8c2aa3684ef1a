"""KV blocks into GPU memory: the GPU tier of ``db.kv`` beside the copies it saves.

Needs a CUDA device (and cuda-python: ``pip install -e '.[gpu]'``); without one it says
why and exits 0. What it measures, for 256-token bfloat16 blocks of several sizes, a
batch at a time, best of ``--reps``:

* physical limits, in the same run: ``torch`` device-to-device copy of the batch (the
  device's memcpy) and host-to-device from pinned memory (the PCIe link);
* ``get_into`` GPU outs, block not on the GPU: what an engine pays without a GPU tier
  (host arena to device, checksum verified on the host);
* ``get_into`` GPU outs from the GPU tier (device to device);
* ``get(device="cuda")`` from the GPU tier: zero-copy views, no bytes move (latency per
  batch);
* the peer a user would pick for host-resident KV: LMCache-style host pool to device is
  the first line (a pageable host copy), so it is printed as ``host -> GPU``.

Goal (issue 4): reads served by the GPU tier at the device's copy speed (>= 0.8 x the
device-to-device line), and faster than any read from host memory can be.

Run:  .venv/bin/python -m benchmarks.kv_gpu [--sizes-mib 0.5 2 8 16] [--reps 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time

import torch

from benchmarks import _verdict

MiB = 1 << 20
GB = 1e9
BLOCK_TOKENS = 256


def _best(fn, reps: int) -> float:  # type: ignore[no-untyped-def]
    best = float("inf")
    for _ in range(reps + 1):  # one untimed warm-up round
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def run(sizes: list[float], reps: int) -> dict[str, object]:
    import tensordb

    home = tempfile.mkdtemp(prefix="tensordb-kvgpu-bench-")
    res: dict[str, object] = {"device": torch.cuda.get_device_name(0), "sizes": []}
    try:
        total_max = int(max(sizes) * MiB) * (64 if max(sizes) <= 2 else 32)
        db = tensordb.connect(home=home, data_dir=home + "/data")
        kv = db.kv("bench-gpu", block_tokens=BLOCK_TOKENS, capacity_bytes=4 * total_max,
                   gpu_capacity=4 * total_max)
        try:
            for k, size in enumerate(sizes):
                nbytes = int(size * MiB)
                count = 64 if size <= 2 else 32 if size <= 8 else 16
                elems = nbytes // 2
                blocks = [torch.full((2, BLOCK_TOKENS, elems // (2 * BLOCK_TOKENS)),
                                     float(i % 7), dtype=torch.bfloat16) for i in range(count)]
                total = sum(b.numel() * 2 for b in blocks)
                gpu_src = [b.cuda() for b in blocks]
                outs = [torch.empty_like(g) for g in gpu_src]
                pinned = [b.pin_memory() for b in blocks]
                d2d = _best(lambda outs=outs, gpu_src=gpu_src: [
                    o.copy_(g) for o, g in zip(outs, gpu_src, strict=True)], reps)
                h2d = _best(lambda outs=outs, pinned=pinned: [o.copy_(p, non_blocking=True)
                                     for o, p in zip(outs, pinned, strict=True)], reps)
                cold = kv.keys(torch.arange(count * BLOCK_TOKENS) + (k << 40))
                kv.put(cold, blocks)  # host only: put from CPU tensors admits nothing
                host = _best(lambda cold=cold, outs=outs: kv.get_into(cold, outs), reps)
                warm = kv.keys(torch.arange(count * BLOCK_TOKENS) + (k << 40) + (1 << 36))
                kv.put(warm, gpu_src)  # from the GPU: a device-to-device copy is kept
                tier = _best(lambda warm=warm, outs=outs: kv.get_into(warm, outs), reps)
                assert all(torch.equal(o, g) for o, g in zip(outs, gpu_src, strict=True))
                views = _best(lambda warm=warm: kv.get(warm, device="cuda:0"), reps)
                row = {"block_mib": size, "blocks": count,
                       "d2d_GBps": total / d2d / GB, "h2d_pinned_GBps": total / h2d / GB,
                       "host_to_gpu_GBps": total / host / GB,
                       "gpu_tier_GBps": total / tier / GB, "views_ms": views * 1e3}
                row["x_d2d"] = row["gpu_tier_GBps"] / row["d2d_GBps"]
                row["x_host"] = row["gpu_tier_GBps"] / row["host_to_gpu_GBps"]
                res["sizes"].append(row)  # type: ignore[attr-defined]
                kv.delete(cold + warm)
            st = kv.stats()
            res["stats"] = {"gpu_hits": st.gpu_hits, "gpu_blocks": st.gpu_blocks,
                            "gpu_evictions": st.gpu_evictions}
        finally:
            kv.destroy()
            db.close()
    finally:
        shutil.rmtree(home, ignore_errors=True)
    return res


def goals(res: dict[str, object]) -> list[_verdict.Verdict]:
    """The goal's two halves at each block size: the GPU tier's reads at >= 0.8 x the
    device-to-device copy, and faster than pinned host to device (the PCIe link, which
    bounds any read from host memory). Not measured where the run did not happen."""
    out: list[_verdict.Verdict] = []
    rows = res.get("sizes") or [{"block_mib": s} for s in res.get("asked_mib", [])]
    for r in rows:  # type: ignore[union-attr]
        g1 = f"GPU tier get_into >= 0.8 x device memcpy, {r['block_mib']:g} MiB blocks"
        g2 = f"GPU tier get_into faster than pinned host to device, {r['block_mib']:g} MiB"
        if "x_d2d" not in r:
            why = str(res.get("skipped") or "not run")
            out += [_verdict.not_measured(g1, why), _verdict.not_measured(g2, why)]
            continue
        x_pin = r["gpu_tier_GBps"] / r["h2d_pinned_GBps"]
        out.append(_verdict.at_least(g1, r["x_d2d"], 0.8, f"{r['x_d2d']:.2f} x"))
        out.append(_verdict.at_least(g2, x_pin, 1.0, f"{x_pin:.2f} x"))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes-mib", type=float, nargs="+", default=[0.5, 2, 8, 16])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    from storage_engine import GpuTier

    if not torch.cuda.is_available() or not GpuTier.available():
        why = GpuTier.unavailable_reason() or "torch sees no CUDA device"
        if args.json:  # the goals, each not measured, saying why
            skipped = {"skipped": f"no GPU here ({why})", "asked_mib": args.sizes_mib}
            print(json.dumps({**skipped, "goals": _verdict.to_json(goals(skipped))},
                             indent=2))
        else:
            print(f"kv_gpu: skipped, no GPU here ({why})")
        return 0
    res = run(args.sizes_mib, args.reps)
    vs = goals(res)
    res["goals"] = _verdict.to_json(vs)
    if args.json:
        print(json.dumps(res, indent=2))
        return _verdict.exit_code(vs)
    print(f"KV blocks into GPU memory on {res['device']} (GB/s of block bytes; best of "
          f"{args.reps})")
    cols = ("block", "d2d (limit)", "h2d pinned", "host -> GPU", "GPU tier", "x d2d",
            "x host", "views ms")
    print("  ".join(f"{c:>12}" for c in cols))
    for r in res["sizes"]:  # type: ignore[union-attr]
        print("  ".join(f"{v:>12}" for v in (
            f"{r['block_mib']:g} MiB", f"{r['d2d_GBps']:.1f}", f"{r['h2d_pinned_GBps']:.1f}",
            f"{r['host_to_gpu_GBps']:.1f}", f"{r['gpu_tier_GBps']:.1f}",
            f"{r['x_d2d']:.2f}", f"{r['x_host']:.1f}", f"{r['views_ms']:.3f}")))
    print(f"tier counters: {res['stats']}")
    from rich.console import Console

    _verdict.print_verdicts(Console(), vs)
    return _verdict.exit_code(vs)


if __name__ == "__main__":
    sys.exit(main())
