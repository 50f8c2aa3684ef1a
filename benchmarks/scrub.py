"""The background scrub at its default budget: how long a new user's store takes to find
a flipped byte, and what share of a core the scrub takes meanwhile.

A fresh store with the default settings (no environment variables: a round at most every
60 s, 5 % of one core, 256 MB/s) is filled with ``--gib`` GiB of tensors in shared
memory; then one byte of a random tensor is flipped, as bad RAM or a stray writer would,
and a reader asks for that tensor every 0.1 s until the store refuses it. Printed beside
it, measured in the same run:

- the hash bound (xxh3 over 256 MiB in one thread, GB/s) and what a round at the budget
  must take at least (the store's bytes at ``scrub_rate``, or its hashing at 5 % of a core);
- ``db.verify()`` of the whole store, the on-demand check a user would run instead;
- the scrub thread's CPU over the wait (from /proc), against the 5 % budget.

Run:  .venv/bin/python -m benchmarks.scrub [--gib 4] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import threading
import time
from typing import Any

import numpy as np
import torch

import storage_engine as se
import tensordb
from benchmarks import _verdict
from tensordb.errors import CorruptData

_TENSOR = 256 << 20  # bytes a tensor


def _thread_cpu(native_id: int) -> float:
    """CPU seconds (user + system) of one thread of this process, from /proc."""
    with open(f"/proc/self/task/{native_id}/stat") as fh:
        st = fh.read().rsplit(")", 1)[1].split()
    return (int(st[11]) + int(st[12])) / os.sysconf("SC_CLK_TCK")


def _hash_gbps() -> float:
    buf = np.random.default_rng(0).integers(0, 255, _TENSOR, dtype=np.uint8)
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        se.checksum(buf)
        best = min(best, time.perf_counter() - t)
    return _TENSOR / best / 1e9


def run(gib: float, tmp_dir: str | None) -> dict[str, Any]:
    os.environ.pop("TENSORDB_SCRUB_CPU", None)  # what a new user gets
    os.environ.pop("TENSORDB_SCRUB_INTERVAL", None)
    os.environ.pop("TENSORDB_SCRUB_RATE", None)
    home = tempfile.mkdtemp(prefix="tdb-scrub-", dir=tmp_dir)
    db = tensordb.connect(home=home)
    try:
        count = max(1, int(gib * (1 << 30)) // _TENSOR)
        t0 = time.perf_counter()
        with db.transaction("m") as tx:
            for i in range(count):  # distinct bytes: nothing shared by dedupe
                tx.put(f"t{i}", torch.full((_TENSOR // 4,), float(i)))
        commit_s = time.perf_counter() - t0
        nbytes = count * _TENSOR
        cfg = db.config
        scrubber = next((t for t in threading.enumerate() if t.name == "tensordb-scrub"),
                        None)
        if scrubber is None or scrubber.native_id is None:
            raise SystemExit("the store started no background scrub")
        name = f"t{random.randrange(count)}"
        with db.snapshot("m") as snap:
            sid, offset, _ = snap.extents()[name]
        assert sid is not None
        path = db.tier("host").path(sid)  # type: ignore[attr-defined]
        at = offset + random.randrange(_TENSOR)
        cpu0, wall0 = _thread_cpu(scrubber.native_id), time.perf_counter()
        with open(path, "r+b") as fh:
            fh.seek(at)
            b = fh.read(1)
            fh.seek(at)
            fh.write(bytes([b[0] ^ 0xFF]))
        found_s = None
        deadline = wall0 + cfg.scrub_interval * 3 + nbytes / cfg.scrub_rate * 3 + 60
        while time.perf_counter() < deadline:
            try:
                db.get("m", name)
            except CorruptData:
                found_s = time.perf_counter() - wall0
                break
            time.sleep(0.1)
        wall = time.perf_counter() - wall0
        cpu_share = (_thread_cpu(scrubber.native_id) - cpu0) / wall
        stats = db.stats()
        t = time.perf_counter()
        problems = db.verify()
        verify_s = time.perf_counter() - t
        hash_gbps = _hash_gbps()
        round_floor_s = max(nbytes / cfg.scrub_rate, nbytes / (hash_gbps * 1e9) / cfg.scrub_cpu)
        return {"gib": nbytes / (1 << 30), "tensors": count, "commit_s": commit_s,
                "scrub_interval_s": cfg.scrub_interval, "scrub_cpu": cfg.scrub_cpu,
                "scrub_rate": cfg.scrub_rate, "found_s": found_s, "cpu_share": cpu_share,
                "round_floor_s": round_floor_s, "hash_gbps": hash_gbps, "verify_s": verify_s,
                "verify_found": len(problems), "scrub_found": stats["scrub_found"],
                "scrub_pid_is_this": stats["scrub_pid"] == os.getpid()}
    finally:
        db.close()
        shutil.rmtree(db.config.shm_dir, ignore_errors=True)
        shutil.rmtree(home, ignore_errors=True)


def goals(res: dict[str, Any]) -> list[_verdict.Verdict]:
    limit = res["scrub_interval_s"] + 2 * res["round_floor_s"] + 5
    found = res["found_s"]
    return [
        _verdict.at_most(
            f"a flipped byte found by the default background scrub within one interval and "
            f"two paced rounds ({limit:.0f} s)", found, limit,
            f"{found:.1f} s" if found is not None else "",
            reason="not found before the deadline"),
        _verdict.at_most(f"the scrub's share of one core <= {res['scrub_cpu'] * 1.1:.3f} "
                         f"(the {res['scrub_cpu']:g} budget, /proc's tick resolution)",
                         res["cpu_share"], res["scrub_cpu"] * 1.1, f"{res['cpu_share']:.4f}"),
        _verdict.judge("verify() finds the same damage", res["verify_found"] == 1,
                       f"{res['verify_found']} found"),
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=4.0, help="GiB of tensors in the store (4)")
    p.add_argument("--tmp-dir", default=None, help="where the temporary store goes")
    p.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    args = p.parse_args(argv)
    res = run(args.gib, args.tmp_dir)
    verdicts = goals(res)
    if args.json:
        print(json.dumps({**res, "goals": _verdict.to_json(verdicts)}, indent=2))
        return 0
    from rich.console import Console

    console = Console()
    found = "not found" if res["found_s"] is None else f"{res['found_s']:.1f} s"
    console.print(f"store: {res['gib']:.2f} GiB in {res['tensors']} tensors (host tier), "
                  f"committed in {res['commit_s']:.1f} s")
    console.print(f"defaults: a round at most every {res['scrub_interval_s']:g} s, "
                  f"{res['scrub_cpu']:.0%} of a core, {res['scrub_rate'] / 1e6:.0f} MB/s")
    console.print(f"flipped byte found by the background scrub after [bold]{found}[/]; "
                  f"a paced round takes at least {res['round_floor_s']:.1f} s "
                  f"(hash bound {res['hash_gbps']:.1f} GB/s one thread)")
    console.print(f"scrub thread's share of one core over the wait: {res['cpu_share']:.2%}")
    console.print(f"on demand instead: db.verify() of the store {res['verify_s']:.2f} s, "
                  f"found {res['verify_found']}")
    _verdict.print_verdicts(console, verdicts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
