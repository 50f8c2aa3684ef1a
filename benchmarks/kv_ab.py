"""A/B of the KV block store's native library: a base revision's build against the
working tree's, alternated in one run.

What it runs: the native extension (``storage_engine._stream``) of ``--base`` (a git
revision; default ``HEAD``) and of the working tree, each compiled here by the same
``gcc`` command (-O2, the flags of pyproject.toml) into a temporary directory. Then
``--rounds`` rounds, each a fresh process per build in turn (the order swapped every
round), loading that build in place of the installed one. A process opens a fresh store
and times, at each size of ``benchmarks/kv.py`` (8 KiB to 8 MiB blocks, 64 MiB a
batch at most), put + get_into of a batch into a warm arena (its slabs made by a first
put + delete), best of ``--reps``. A round's paired ratio is the base's time over the
new one's (above 1: the new build is faster).

Goal (the KV native core's "no regression"): the median paired ratio >= 0.95 at every
size. Printed beside it: the memcpy rate of the same batch in the same processes (the
bound both builds share), so a round whose host was busy shows as such.

Run:  .venv/bin/python -m benchmarks.kv_ab [--base REV] [--rounds 8] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from benchmarks import _verdict

ROOT = Path(__file__).resolve().parents[1]
KiB = 1 << 10
MiB = 1 << 20
SIZES_KIB = (8, 64, 256, 2048, 8192)
BATCH_BYTES = 64 * MiB
GOAL_RATIO = 0.95
FLAGS = ["-shared", "-fPIC", "-O2", "-fwrapv", "-DNDEBUG", "-fvisibility=hidden"]


def _sources(tree: Path) -> list[str]:
    """The C files of the extension in a source tree (of any revision's layout)."""
    se = tree / "storage_engine"
    files = [se / "_stream.c"]
    files += [se / "_kvindex.c"] if (se / "_kvindex.c").exists() else sorted(
        (se / "kv").glob("*.c"))
    if (se / "xxhash" / "xxh_x86dispatch.c").exists():
        files.append(se / "xxhash" / "xxh_x86dispatch.c")
    return [str(f) for f in files]


def build(tree: Path, out: Path) -> Path:
    """The extension of ``tree`` compiled into ``out``."""
    lib = out / f"_stream{sysconfig.get_config_var('EXT_SUFFIX')}"
    cmd = ["gcc", *FLAGS, f"-I{sysconfig.get_paths()['include']}", *_sources(tree),
           "-o", str(lib)]
    subprocess.run(cmd, check=True)
    return lib


def checkout(rev: str, out: Path) -> Path:
    """``storage_engine/`` of revision ``rev`` unpacked under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "storage_engine"],
                             check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(out)], input=archive, check=True)
    return out


_CHILD = r"""
import importlib.machinery, importlib.util, json, shutil, sys, tempfile, time
lib, reps, sizes, batch = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3]), int(sys.argv[4])
loader = importlib.machinery.ExtensionFileLoader("storage_engine._stream", lib)
spec = importlib.util.spec_from_file_location("storage_engine._stream", lib, loader=loader)
mod = importlib.util.module_from_spec(spec)
loader.exec_module(mod)
sys.modules["storage_engine._stream"] = mod
import numpy as np, torch
import tensordb
from benchmarks._common import remove_store
out = {}
home = tempfile.mkdtemp(prefix="tensordb-ab-")
db = tensordb.connect(home=home, data_dir=home + "/data")
try:
    for kib in sizes:
        nbytes = kib << 10
        n = max(1, min(512, batch // nbytes))
        blocks = torch.randint(0, 255, (n, nbytes), dtype=torch.uint8)
        outs = torch.empty_like(blocks)
        outs.fill_(1)
        kv = db.kv(f"ab{kib}", block_tokens=16, capacity_bytes=4 * n * nbytes + (64 << 20))
        warm = kv.keys(np.arange(n * 16) + (1 << 40))
        kv.put(warm, blocks)
        kv.delete(warm)
        best = copy = float("inf")
        for rep in range(reps):
            keys = kv.keys(np.arange(n * 16) + (rep << 30))
            t0 = time.perf_counter()
            kv.put(keys, blocks)
            kv.get_into(keys, outs)
            best = min(best, time.perf_counter() - t0)
            kv.delete(keys)
            t0 = time.perf_counter()
            outs.copy_(blocks)
            copy = min(copy, time.perf_counter() - t0)
        assert torch.equal(outs, blocks)
        out[kib] = {"s": best, "memcpy_gbps": n * nbytes / copy / 1e9, "bytes": n * nbytes}
        kv.destroy()
finally:
    remove_store(db)
    shutil.rmtree(home, ignore_errors=True)
print(json.dumps(out))
"""


def _child(lib: Path, reps: int, sizes: list[int]) -> dict[str, Any]:
    got = subprocess.run([sys.executable, "-c", _CHILD, str(lib), str(reps),
                          json.dumps(sizes), str(BATCH_BYTES)],
                         cwd=ROOT, check=False, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    if got.returncode != 0:
        raise SystemExit(f"the A/B process of {lib} failed ({got.returncode}):\n"
                         f"{got.stderr[-3000:]}")
    return json.loads(got.stdout.strip().splitlines()[-1])


@contextmanager
def builds(base: str) -> Iterator[dict[str, Path]]:
    """The native library of ``base`` and of the working tree, each built by ``build``
    into a temporary directory: {"base": path, "new": path}, removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="tensordb-ab-build-") as tmp:
        t = Path(tmp)
        (t / "a").mkdir()
        (t / "b").mkdir()
        yield {"base": build(checkout(base, t / "src"), t / "a"),
               "new": build(ROOT, t / "b")}


def run(base: str, rounds: int, reps: int, sizes: list[int]) -> dict[str, Any]:
    with builds(base) as libs:
        ratios: dict[int, list[float]] = {k: [] for k in sizes}
        memcpy: dict[int, list[float]] = {k: [] for k in sizes}
        secs: dict[str, dict[int, list[float]]] = {"base": {k: [] for k in sizes},
                                                   "new": {k: [] for k in sizes}}
        for r in range(rounds):
            order = ("base", "new") if r % 2 == 0 else ("new", "base")
            got = {which: _child(libs[which], reps, sizes) for which in order}
            for k in sizes:
                a, b = got["base"][str(k)], got["new"][str(k)]
                ratios[k].append(a["s"] / b["s"])
                memcpy[k].append(min(a["memcpy_gbps"], b["memcpy_gbps"]))
                secs["base"][k].append(a["s"])
                secs["new"][k].append(b["s"])
        return {"base": base, "rounds": rounds, "reps": reps,
                "sizes": {k: {"median_ratio": statistics.median(ratios[k]),
                              "ratios": ratios[k],
                              "base_gbps": got["base"][str(k)]["bytes"]
                              / statistics.median(secs["base"][k]) / 1e9,
                              "new_gbps": got["new"][str(k)]["bytes"]
                              / statistics.median(secs["new"][k]) / 1e9,
                              "memcpy_gbps": statistics.median(memcpy[k])}
                          for k in sizes}}


def verdicts(res: dict[str, Any]) -> dict[str, _verdict.Verdict]:
    return {f"{k} KiB": _verdict.at_least(
        f"put + get_into, new / {res['base']} >= {GOAL_RATIO} (median of paired rounds), "
        f"{k} KiB", v["median_ratio"], GOAL_RATIO, f"{v['median_ratio']:.3f}")
        for k, v in res["sizes"].items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="HEAD", help="the git revision to compare against")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--sizes-kib", type=int, nargs="+", default=list(SIZES_KIB))
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    res = run(args.base, args.rounds, args.reps, args.sizes_kib)
    ver = verdicts(res)
    if args.json:
        print(json.dumps({**res, "verdicts": [v.to_json() for v in ver.values()]}))
        return 0
    print(f"native A/B: {res['base']} (base) against the working tree (new), "
          f"{res['rounds']} rounds alternated, best of {res['reps']} put + get_into each")
    print(f"{'block':>8} {'median ratio':>13} {'base GB/s':>10} {'new GB/s':>9} "
          f"{'memcpy GB/s':>12}  rounds (base / new)            goal >= {GOAL_RATIO}")
    for k, v in res["sizes"].items():
        rs = " ".join(f"{x:.2f}" for x in v["ratios"])
        print(f"{k:>5} KiB {v['median_ratio']:>13.3f} {v['base_gbps']:>10.2f} "
              f"{v['new_gbps']:>9.2f} {v['memcpy_gbps']:>12.2f}  {rs}  "
              f"{ver[f'{k} KiB'].state}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
