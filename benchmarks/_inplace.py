"""The in-place section of ``weights.py``: ``import_safetensors(..., in_place=True)``.

Kept apart from the copy import's figures so each can change without the other. For
the checkpoint ``weights.py`` wrote (page cache warm), in the same run:

* ``hash bound``: ``storage_engine.checksum`` over the file's bytes on 2 threads (the
  file mapped once and its pages touched beforehand, so it is the hash alone): the
  least an import that checksums every byte can cost;
* ``import in place``: each run in a fresh process on a cold store (a new store, no
  prefault, no environment variables), timed around ``db.import_safetensors(...,
  in_place=True)``; then, in the same process, a second import into that store (the
  steady state);
* ``safetensors load_file`` (mapped), in a fresh process: the peer, which gives
  copy-on-write tensors over the file and checks no byte;
* ``2nd process``: another process connects, opens the in-place version's snapshot,
  builds ``state_dict()`` and touches one element of every tensor; it checks each
  tensor's data lies in a mapping of the source file (``/proc/self/maps``): zero-copy.

Goal: import in place >= 0.8 x the hash bound (2 threads).

Run alone:  .venv/bin/python -m benchmarks.weights --in-place-only [--sizes 512M,2G]
"""

from __future__ import annotations

import gc
import json
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import benchmarks

GB = 1e9
GOAL_HASH = 0.8


def measure_fresh_hash(path: Path) -> float:
    """Seconds of ``storage_engine.checksum`` over the whole file on 2 threads through a
    mapping made just now (its page-table entries faulted in as it goes): the first pass
    over a file that a fresh process pays, which the import in place is."""
    import numpy as np

    import storage_engine as se

    n = path.stat().st_size
    half = n // 2
    fd = os.open(path, os.O_RDONLY)
    try:
        t0 = time.perf_counter()
        mm = mmap.mmap(fd, n, access=mmap.ACCESS_READ)
        data = np.frombuffer(mm, np.uint8)
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(se.checksum, [data[:half], data[half:]]))
        took = time.perf_counter() - t0
        del data
        mm.close()
    finally:
        os.close(fd)
    return took


def measure_hash_bound(path: Path, reps: int) -> float:
    """Best seconds of ``storage_engine.checksum`` over the whole file on 2 threads (a
    half each), over a mapping whose pages were touched first."""
    import numpy as np

    import storage_engine as se

    n = path.stat().st_size
    half = n // 2
    fd = os.open(path, os.O_RDONLY)
    try:
        mm = mmap.mmap(fd, n, access=mmap.ACCESS_READ)
    finally:
        os.close(fd)
    data = np.frombuffer(mm, np.uint8)
    best = float("inf")
    with ThreadPoolExecutor(2) as pool:
        for _ in range(reps + 1):  # the first pass touches the pages
            t0 = time.perf_counter()
            list(pool.map(se.checksum, [data[:half], data[half:]]))
            best = min(best, time.perf_counter() - t0)
    del data
    mm.close()
    return best


# -- children -------------------------------------------------------------------------------
def import_child(path: str, tmp_dir: str | None) -> dict[str, Any]:
    """A fresh process on a cold store: one import in place (the figure), then a second
    into the same store (steady state). Leaves the store for ``reader_child``."""
    import tensordb

    home = tempfile.mkdtemp(prefix="tensordb-bench-inplace-", dir=tmp_dir)
    db = tensordb.connect(home=home)
    t0 = time.perf_counter()
    c = db.import_safetensors("m", path, in_place=True)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    db.import_safetensors("again", path, in_place=True)
    again = time.perf_counter() - t0
    out = {"first_s": first, "again_s": again, "bytes": c.nbytes, "tensors": c.tensors,
           "home": home, "shm": str(db.config.shm_dir)}
    db.close()
    return out


def reader_child(home: str, path: str) -> dict[str, Any]:
    """A second process: snapshot + state_dict + one element of each tensor, timed (the
    start-up heap frozen first, as an engine does); zero-copy checked against the
    mappings of the source file."""
    import tensordb

    t0 = time.perf_counter()
    db = tensordb.connect(home=home)
    connect = time.perf_counter() - t0
    gc.collect()
    gc.freeze()
    t0 = time.perf_counter()
    snap = db.snapshot("m")
    sd = snap.state_dict()
    [t.reshape(-1)[0].item() for t in sd.values() if t.numel()]
    took = time.perf_counter() - t0
    real = os.path.realpath(path)
    maps = []
    with open("/proc/self/maps") as fh:
        for line in fh:
            parts = line.split(None, 5)
            if len(parts) == 6 and parts[5].strip() == real:
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                maps.append((lo, hi))
    inside = sum(any(lo <= t.data_ptr() < hi for lo, hi in maps)
                 for t in sd.values() if t.numel())
    res = {"ms": took * 1e3, "connect_ms": connect * 1e3,
           "tensors": sum(1 for t in sd.values() if t.numel()), "zero_copy": inside}
    snap.close()
    db.close()
    return res


def peer_child(path: str) -> dict[str, Any]:
    """safetensors ``load_file`` (mapped: copy-on-write tensors over the file)."""
    from safetensors.torch import load_file

    t0 = time.perf_counter()
    sd = load_file(path)
    took = time.perf_counter() - t0
    return {"s": took, "bytes": sum(t.nbytes for t in sd.values())}


def _run(args: list[str], timeout: float = 600) -> dict[str, Any]:
    out = subprocess.run(benchmarks.command(__spec__.name, *args), capture_output=True,
                         text=True, check=False, timeout=timeout, env=benchmarks.child_env())
    if out.returncode != 0:
        tail = (out.stderr or out.stdout).strip().splitlines()[-1:] or ["no output"]
        raise RuntimeError(f"exit {out.returncode}: {tail[0][:300]}")
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


# -- the parent -------------------------------------------------------------------------------
def bench(path: Path, nbytes: int, reps: int, child_runs: int,
          tmp_dir: str | None) -> dict[str, Any]:
    """The in-place figures for the (warm) checkpoint at ``path``; see the module."""
    res: dict[str, Any] = {"file_bytes": path.stat().st_size}
    imports, peers, bound, fresh = [], [], [], []
    for _ in range(reps):
        # the bound beside each run, so a busy spell of the host weighs on both alike
        bound.append(measure_hash_bound(path, 1))
        fresh.append(measure_fresh_hash(path))
        got = _run(["import", str(path), tmp_dir or ""])
        imports.append(got)
        if got is not imports[0]:  # one store is kept for the readers
            shutil.rmtree(got["home"], ignore_errors=True)
            shutil.rmtree(got["shm"], ignore_errors=True)
        try:
            peers.append(_run(["peer", str(path)]))
        except (RuntimeError, subprocess.TimeoutExpired, ValueError) as exc:
            res["peer_skipped"] = str(exc)[:200]
    kept = imports[0]
    try:
        readers = [_run(["reader", kept["home"], str(path)]) for _ in range(child_runs)]
    finally:
        shutil.rmtree(kept["home"], ignore_errors=True)
        shutil.rmtree(kept["shm"], ignore_errors=True)
    assert all(i["bytes"] == nbytes for i in imports), (imports[0]["bytes"], nbytes)
    res["hash_2t_s"] = min(bound)
    res["hash_2t_runs_s"] = bound
    res["hash_fresh_2t_s"] = min(fresh)
    res["import_first_s"] = [i["first_s"] for i in imports]
    res["import_again_s"] = [i["again_s"] for i in imports]
    if peers:
        res["peer_s"] = [p["s"] for p in peers]
    res["reader_ms"] = [r["ms"] for r in readers]
    res["reader_connect_ms"] = [r["connect_ms"] for r in readers]
    res["reader_zero_copy"] = [f"{r['zero_copy']}/{r['tensors']}" for r in readers]
    best = min(res["import_first_s"])
    res["x_hash"] = res["hash_2t_s"] / best
    res["x_hash_again"] = res["hash_2t_s"] / min(res["import_again_s"])
    return res


def section(res: dict[str, Any], path: Path, nbytes: int, args: Any) -> bool:
    """``weights.py``'s hook: the figures into ``res["in_place"]`` (unless
    ``--no-in-place``); True when they are all that was asked (``--in-place-only``: the
    checkpoint is removed, the caller returns)."""
    if args.in_place:
        res["in_place"] = bench(path, nbytes, args.reps, args.child_runs, args.tmp_dir)
    if args.in_place_only:
        path.unlink()
        return True
    return False


def goal_of(s: dict[str, Any]) -> Any:
    """The section's goal as a ``_verdict.Verdict``: the first import (fresh process,
    cold store) >= GOAL_HASH x the hash bound."""
    from benchmarks import _verdict

    x = s["in_place"]["x_hash"]
    return _verdict.at_least(f"import in place, cold >= {GOAL_HASH} x the hash bound", x,
                             GOAL_HASH, f"{x:.2f} x")


def table(s: dict[str, Any]) -> Any:
    """The section's rows for ``weights.py``'s report (a rich Table)."""
    from rich.table import Table

    r = s["in_place"]
    n = r["file_bytes"]
    t = Table(title="import in place (opt-in; the copy stays the default)", title_justify="left")
    for col in ("loader", "best ms", "median ms", "best GB/s", "x hash", "goal"):
        t.add_column(col, justify="left" if col == "loader" else "right", no_wrap=True)
    h = r["hash_2t_s"]
    t.add_row("hash bound (checksum, 2 threads)", f"{h * 1e3:.1f}",
              f"{statistics.median(r['hash_2t_runs_s']) * 1e3:.1f}",
              f"{n / h / GB:.2f}", "1.00", "")
    hf = r.get("hash_fresh_2t_s")
    if hf is not None:
        t.add_row("  first pass: the same over a fresh mapping", f"{hf * 1e3:.1f}", "",
                  f"{n / hf / GB:.2f}", f"{h / hf:.2f}", "")
    for key, label in (("import_first_s", "in place: fresh process, cold store"),
                       ("import_again_s", "in place: again, same process")):
        xs = r[key]
        goal = ""
        if key == "import_first_s":
            goal = f">= {GOAL_HASH} x hash {goal_of(s).mark()}"
        t.add_row(label, f"{min(xs) * 1e3:.1f}", f"{statistics.median(xs) * 1e3:.1f}",
                  f"{n / min(xs) / GB:.2f}", f"{h / min(xs):.2f}", goal)
    if "peer_s" in r:
        xs = r["peer_s"]
        t.add_row("safetensors load_file (mapped)", f"{min(xs) * 1e3:.1f}",
                  f"{statistics.median(xs) * 1e3:.1f}", f"{n / min(xs) / GB:.2f}",
                  f"{h / min(xs):.2f}", "(checks no byte)")
    ms = r["reader_ms"]
    zc = sorted(set(r["reader_zero_copy"]))
    t.add_row("2nd process: snapshot + state_dict", f"{min(ms):.2f}",
              f"{statistics.median(ms):.2f}", "", "", f"zero-copy {', '.join(zc)}")
    return t


def main(argv: list[str]) -> int:
    kind, *rest = argv
    if kind == "import":
        out = import_child(rest[0], rest[1] or None)
    elif kind == "reader":
        out = reader_child(rest[0], rest[1])
    elif kind == "peer":
        out = peer_child(rest[0])
    else:
        raise SystemExit(f"unknown child {kind}")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
