"""Checkpoint benchmark: a model saved by 2 ranks through torch.distributed.checkpoint
(DCP) into tensordb, beside DCP's own FileSystemWriter and beside gathering to rank 0
and committing once; then a 2-rank engine reading its slices, beside whole tensors.

Two rank processes (a gloo group on this host) hold a model of ``--size`` bytes
(default 1 GiB; bfloat16 matrices of 4096 columns) as FSDP-style dim-0 DTensor shards,
half each. Each figure is rank 0's time from a barrier before the call to a barrier
after it (both ranks done), for every repeat (``--reps``); before each repeat every
tensor gets new values, so no save can skip a tensor it already holds. A fresh store,
no ``prefault``, no environment variables.

Saves, like for like (the same bytes, the same medium, the same durability):

* ``tensordb host tier``: ``dcp.save(sd, storage_writer=TensorDBWriter(db, c,
  tier="host"))``: one version through one group transaction, each rank's shards copied
  (and checksummed) into the store's shared memory; beside DCP's ``FileSystemWriter``
  into a directory in ``/dev/shm`` (its defaults: one file per rank, ``torch.save`` of
  each chunk; its ``sync_files`` fsync costs nothing on tmpfs);
* ``tensordb disk tier``: the same with ``tier="disk"`` (each segment fsynced before the
  commit), beside ``FileSystemWriter(sync_files=True)`` (each file fsynced, and the
  metadata file) into a directory on the same filesystem as the store's data
  (``--tmp-dir``);
* ``gather + commit``: what a trainer does without group commits: each shard gathered
  to rank 0 (``dist.gather`` over gloo), concatenated, one ``db.commit`` into the host
  tier.

The first save of each tensordb row lands in the fresh store (every page faults in);
later ones reuse the pages of versions that retention dropped (``set_retention(c, 1)``
and ``gc`` between repeats, as a trainer runs). A ``FileSystemWriter`` repeat writes a
new directory and the previous one is removed. Bounds in the same run: ``memcpy`` of
each rank's shard bytes (both ranks at once, one thread each, into pre-touched memory),
and for the disk rows ``write + fsync`` of each rank's bytes into one file each.

Reads, by both ranks at once, into buffers the engine owns (pre-touched), a fresh
snapshot each repeat; the slices from the host-tier version the DCP save wrote (each
tensor stored as two dim-0 shards):

* ``slice, dim 0``: ``snap.slice(name, rank=r, world_size=2, dim=0, out=dst)`` (what
  the DCP reader does with the planner's tensors): each rank's contiguous half (here
  exactly one stored shard), read into ``dst`` by the kernel, nothing mapped;
* ``slice, dim 1``: the same with ``dim=1``: strided columns across both shards (copied
  from the shards' views);
* ``whole tensors``: ``dst.copy_(snap[name])`` from the version the gather + commit
  wrote (each tensor stored whole, so ``snap[name]`` is a view): the full tensor, twice
  the bytes, which is what an engine with another layout read to cut its slice;

beside ``memcpy`` of the slice's bytes (both ranks at once), and, to show where the
time goes, the same memcpy out of a shared-memory file mapped beforehand (the store's
4 KiB pages; plain memcpy's buffers may get huge pages) and the dim-0 slice read again
in a snapshot whose segments are mapped already, as a view and a copy (a fresh
snapshot maps each segment, ``MAP_POPULATE`` of its resident pages, on first use).

Goals (``_verdict``; the script exits 1 unless every goal is met), each judged twice:
on the first save (tensordb's into the fresh store, the peer's first, each the first of
its kind in the process) and on the steady state (each one's best of the repeats): each
tensordb save >= 1 x its FileSystemWriter peer; the host-tier save >= 2 x gather +
commit; and the dim-0 slice read <= 1.2 x memcpy of the slice (best of repeats). The
strided read is reported, with no goal.

Run:  .venv/bin/python -m benchmarks.checkpoint [--size 1G] [--reps 4] [--tmp-dir DIR]
      [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import benchmarks
from benchmarks import _common, _verdict
from benchmarks._verdict import Verdict

GB = 1e9
MiB = 1 << 20
COLS = 4096
WORLD = 2
GOAL_FS = 1.0
GOAL_GATHER = 2.0
GOAL_SLICE = 1.2
SAVES = ("tdb_host", "fs_shm", "tdb_disk", "fs_disk", "gather_commit")
READS = ("slice_dim0", "slice_dim1", "whole")
LABELS = {
    "bound_memcpy": "bound: memcpy of each rank's shard (2 ranks at once)",
    "tdb_host": "tensordb host tier: dcp.save, TensorDBWriter",
    "fs_shm": "FileSystemWriter into /dev/shm",
    "gather_commit": "gather to rank 0 + db.commit (host tier)",
    "bound_fsync": "bound: write + fsync of each rank's bytes (2 ranks at once)",
    "tdb_disk": "tensordb disk tier (fsync): dcp.save, TensorDBWriter",
    "fs_disk": "FileSystemWriter into a local directory (fsync)",
    "bound_slice": "bound: memcpy of each rank's slice (2 ranks at once)",
    "bound_slice_shm": "  the same out of a mapped shared-memory file (4 KiB pages)",
    "bound_slice_pread": "  bound: the kernel's read of it from a shm file not mapped",
    "slice_dim0": "snap.slice(rank, world_size=2, dim=0, out=dst), contiguous",
    "slice_dim0_mapped": "  a view + copy in a snapshot whose segments are mapped",
    "slice_dim1": "snap.slice(rank, world_size=2, dim=1, out=dst), strided",
    "whole": "whole tensors (of the gathered version): snap[name] + copy, 2 x the bytes",
}


def parse_size(text: str) -> int:
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(float(text[:-1] if text[-1:] in "KMG" else text) * scale)


def model_spec(nbytes: int) -> list[tuple[str, tuple[int, int]]]:
    """bfloat16 matrices of COLS columns, rows a multiple of 2 * 64, about ``nbytes`` in
    all: 32 of them, fewer for a small size."""
    per_row = COLS * 2
    rows_total = max(128, nbytes // per_row // 128 * 128)
    count = max(1, min(32, rows_total // 128))
    rows = rows_total // count // 128 * 128
    return [(f"layers.{i}.weight", (rows, COLS)) for i in range(count)]


def value(k: int, i: int) -> float:
    """Tensor ``i``'s value in the ``k``-th save: an integer below 256, exact in bfloat16,
    and never the one the save before wrote."""
    return float(k % 200 + i % 56)


# -- the rank processes ----------------------------------------------------------------
class RankJob:
    """One rank's part of the run: its shards, its timers, its steps (each a method that
    every rank calls in the same order)."""

    def __init__(self, rank: int, run: str, nbytes: int, reps: int) -> None:
        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Shard

        import tensordb

        self.rank, self.reps, self.root = rank, reps, Path(run)
        # one core per rank, as torchrun sets it (OMP_NUM_THREADS=1) for several ranks a
        # host: the bounds run on one thread a rank too
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{self.root / 'pg'}", rank=rank,
                                world_size=WORLD, timeout=timedelta(seconds=600))
        mesh = init_device_mesh("cpu", (WORLD,))
        self.db = tensordb.connect(home=self.root / "store",
                                   data_dir=self.root / "store" / "data")
        self.spec = model_spec(nbytes)
        self.local = {n: torch.empty((rows // WORLD, cols), dtype=torch.bfloat16)
                      for n, (rows, cols) in self.spec}
        self.sd = {n: DTensor.from_local(t, mesh, [Shard(0)], run_check=False)
                   for n, t in self.local.items()}
        self.local_bytes = sum(t.nbytes for t in self.local.values())
        self.times: dict[str, list[float]] = {}
        self.k = 0  # saves so far: the k-th writes value(k, i)
        self.disk_dir = self.root / "disk"
        self.disk_dir.mkdir(exist_ok=True)

    def timed(self, key: str, fn: Any) -> None:
        import torch.distributed as dist

        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        self.times.setdefault(key, []).append(time.perf_counter() - t0)

    def fill(self) -> None:
        self.k += 1
        for i, t in enumerate(self.local.values()):
            t.fill_(value(self.k, i))

    def bounds(self, key: str, nbytes: int) -> None:
        """memcpy of ``nbytes`` on each rank at once (pre-touched both sides)."""
        import numpy as np

        src = np.ones(nbytes, np.uint8)
        dst = np.empty(nbytes, np.uint8)
        dst.fill(0)  # touched: np.zeros would leave its pages to fault in the first copy
        for _ in range(self.reps):
            self.timed(key, lambda: np.copyto(dst, src))

    def shm_bound(self, nbytes: int) -> None:
        """memcpy of ``nbytes`` out of a shared-memory file mapped (and faulted in)
        beforehand, 4 KiB pages as the store's: what reading the store's memory costs
        once its mapping is in place (no goal: the goal's bound is plain memcpy)."""
        import numpy as np

        dst = np.empty(nbytes, np.uint8)
        dst.fill(0)
        with _common.shm_scratch(nbytes) as src:
            for _ in range(self.reps):
                self.timed("bound_slice_shm", lambda: np.copyto(dst, src))

    def pread_bound(self, nbytes: int) -> None:
        """The kernel's copy of ``nbytes`` out of a shared-memory file this process has
        not mapped (``preadv`` in 8 MiB pieces on the store's I/O threads, as
        ``slice(out=)`` reads): the least a read from a fresh snapshot can cost, since
        copying from a mapping needs the mapping populated first (``MAP_POPULATE`` plus
        the copy measured slower here)."""
        import numpy as np

        import storage_engine as se

        dst = np.empty(nbytes, np.uint8)
        dst.fill(0)
        piece = 8 << 20
        fd, path = tempfile.mkstemp(prefix="tensordb-bench-pread-", dir="/dev/shm")
        try:
            os.write(fd, b"")  # filled below: pages of the file, not of this process
            ones = np.ones(piece, np.uint8)
            for lo in range(0, nbytes, piece):
                os.pwrite(fd, memoryview(ones[: min(piece, nbytes - lo)]), lo)

            def read(lo: int) -> None:
                os.preadv(fd, [memoryview(dst[lo:lo + piece])], lo)

            for _ in range(self.reps):
                self.timed("bound_slice_pread",
                           lambda: list(se.io_pool().map(read, range(0, nbytes, piece))))
        finally:
            os.close(fd)
            os.unlink(path)

    def fsync_bound(self) -> None:
        import numpy as np

        src = np.ones(self.local_bytes, np.uint8)
        path = self.disk_dir / f"bound-{self.rank}.bin"

        def write() -> None:
            with open(path, "wb") as f:
                f.write(memoryview(src))
                f.flush()
                os.fsync(f.fileno())
        for _ in range(self.reps):
            self.timed("bound_fsync", write)
            path.unlink()

    def save(self, key: str, shm_dir: Path, rep: int) -> None:
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemWriter

        from engine_bindings.dcp import TensorDBWriter

        self.fill()
        if key in ("tdb_host", "tdb_disk"):
            tier = key.removeprefix("tdb_")
            self.timed(key, lambda: dcp.save(self.sd, storage_writer=TensorDBWriter(
                self.db, f"ckpt-{tier}", tier=tier)))
        elif key in ("fs_shm", "fs_disk"):
            path = (shm_dir if key == "fs_shm" else self.disk_dir) / f"{key}-{rep}"
            self.timed(key, lambda: dcp.save(
                self.sd, storage_writer=FileSystemWriter(path, sync_files=True)))
            dist.barrier()
            if self.rank == 0:
                shutil.rmtree(path)
        else:
            self.timed(key, self.gather_commit)

    def gather_commit(self) -> None:
        import torch
        import torch.distributed as dist

        full: dict[str, torch.Tensor] = {}
        for n, t in self.local.items():
            raw = t.view(torch.uint8)  # gloo reduces no bfloat16; a gather moves bytes
            parts = [torch.empty_like(raw) for _ in range(WORLD)] if self.rank == 0 else None
            dist.gather(raw, parts, dst=0)
            if parts is not None:
                full[n] = torch.cat(parts).view(torch.bfloat16)
        if self.rank == 0:
            self.db.commit("gathered", full, tier="host")

    def saves(self) -> None:
        import torch.distributed as dist

        made = [tempfile.mkdtemp(prefix="tensordb-bench-dcp-", dir="/dev/shm")
                if self.rank == 0 else ""]
        dist.broadcast_object_list(made, src=0)
        shm_dir = Path(made[0])
        try:
            for rep in range(self.reps):
                for key in SAVES:
                    self.save(key, shm_dir, rep)
                dist.barrier()
                if self.rank == 0 and rep < self.reps - 1:
                    # a trainer's retention: dropped versions' pages go to the pool
                    for c in ("ckpt-host", "ckpt-disk", "gathered"):
                        self.db.set_retention(c, 1)
                    self.db.gc()
                dist.barrier()
        finally:
            if self.rank == 0:
                shutil.rmtree(shm_dir, ignore_errors=True)

    def reads(self) -> bool:
        """The read rows; whether every value read is the one its version holds."""
        import torch
        import torch.distributed as dist

        names = [n for n, _ in self.spec]
        shapes = [shape for _, shape in self.spec]
        bufs = {"slice_dim0": [torch.zeros((r // WORLD, c), dtype=torch.bfloat16)
                               for r, c in shapes],
                "slice_dim1": [torch.zeros((r, c // WORLD), dtype=torch.bfloat16)
                               for r, c in shapes],
                "whole": [torch.zeros((r, c), dtype=torch.bfloat16) for r, c in shapes]}
        self.slice_bytes = sum(t.nbytes for t in bufs["slice_dim0"])
        self.bounds("bound_slice", self.slice_bytes)
        self.shm_bound(self.slice_bytes)
        self.pread_bound(self.slice_bytes)

        def read(kind: str) -> None:
            with self.db.snapshot("gathered" if kind == "whole" else "ckpt-host") as snap:
                for n, dst in zip(names, bufs[kind], strict=True):
                    if kind == "whole":
                        dst.copy_(snap[n])
                    else:  # into the engine's buffer, as the DCP reader does
                        snap.slice(n, rank=self.rank, world_size=WORLD,
                                   dim=0 if kind == "slice_dim0" else 1, out=dst)

        def copy_again(snap: Any) -> None:
            for n, dst in zip(names, bufs["slice_dim0"], strict=True):
                dst.copy_(snap.slice(n, rank=self.rank, world_size=WORLD, dim=0))

        for _ in range(self.reps):
            for kind in READS:
                self.timed(kind, lambda kind=kind: read(kind))
            with self.db.snapshot("ckpt-host") as snap:  # the same, its segments mapped
                copy_again(snap)
                self.timed("slice_dim0_mapped", lambda snap=snap: copy_again(snap))
        # the last saves: the host tier's came 4 before the end, the gathered one last
        k = {"slice_dim0": self.k - (len(SAVES) - 1), "slice_dim1": self.k - (len(SAVES) - 1),
             "whole": self.k}
        ok = all(bool((b[i] == value(k[kind], i)).all())
                 for kind, b in bufs.items() for i in range(len(names)))
        bad = torch.tensor([int(not ok)])
        dist.all_reduce(bad)
        return int(bad) == 0

    def run(self) -> None:
        import torch.distributed as dist

        self.bounds("bound_memcpy", self.local_bytes)
        self.fsync_bound()
        self.saves()
        values_ok = self.reads()
        if self.rank == 0:
            with self.db.snapshot("ckpt-host") as snap:
                shards = {len(snap.shards(n)) for n, _ in self.spec}
            result = {"times": self.times, "tensors": len(self.spec),
                      "bytes": WORLD * self.local_bytes, "shape": list(self.spec[0][1]),
                      "slice_bytes": self.slice_bytes, "values_ok": values_ok,
                      "shards_per_tensor": sorted(shards)}
            (self.root / "result.json").write_text(json.dumps(result))
        dist.barrier()
        dist.destroy_process_group()
        self.db.close()


# -- the parent ------------------------------------------------------------------------
def run(args: argparse.Namespace) -> dict[str, Any]:
    import tensordb

    nbytes = parse_size(args.size)
    root = Path(tempfile.mkdtemp(prefix="tensordb-bench-ckpt-", dir=args.tmp_dir))
    res: dict[str, Any] = {"loadavg_before": os.getloadavg()[0], "cpus": os.cpu_count(),
                           "tmp_dir": str(root)}
    try:
        env = benchmarks.child_env(
            {**os.environ, "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo")})
        procs = [subprocess.Popen(benchmarks.command(__spec__.name, "--rank", str(r), str(root),
                                                     str(nbytes), str(args.reps)), env=env)
                 for r in range(WORLD)]
        rcs = [p.wait() for p in procs]
        if any(rcs):
            raise SystemExit(f"a rank process failed: exit codes {rcs}")
        res.update(json.loads((root / "result.json").read_text()))
    finally:
        if (root / "store").exists():
            db = tensordb.connect(home=root / "store", data_dir=root / "store" / "data")
            _common.remove_store(db)
        shutil.rmtree(root, ignore_errors=True)
    res["loadavg_after"] = os.getloadavg()[0]
    res["figures"] = figures(res)
    res["goals"] = [v.to_json() for v in goals(res)]
    return res


def figures(res: dict[str, Any]) -> dict[str, dict[str, float]]:
    out = {}
    for key, xs in res["times"].items():
        out[key] = {"first_s": xs[0], "best_s": min(xs), "median_s": statistics.median(xs)}
    return out


def goals(res: dict[str, Any]) -> list[Verdict]:
    """The verdicts, from ``res["figures"]`` (key -> first_s / best_s); a row that did
    not run is not measured."""
    f = res.get("figures", {})

    def speedup(ours: str, peer: str, factor: float, goal: str) -> list[Verdict]:
        out = []
        for when, key, what in (("first save, fresh store", "first_s", "first"),
                                ("steady, best of repeats", "best_s", "best")):
            g = f"{goal}, {when}"
            if ours not in f or peer not in f:
                out.append(_verdict.not_measured(g, f"{peer if ours in f else ours} did not run"))
                continue
            x = f[peer][key] / f[ours][key]
            out.append(_verdict.judge(g, x >= factor,
                                      f"{x:.2f} x: {f[ours][key] * 1e3:.0f} ms against "
                                      f"{f[peer][key] * 1e3:.0f} ms, each one's {what}"))
        return out

    out = [
        *speedup("tdb_host", "fs_shm", GOAL_FS,
                 f"DCP save, host tier >= {GOAL_FS:g} x FileSystemWriter into /dev/shm"),
        *speedup("tdb_disk", "fs_disk", GOAL_FS,
                 f"DCP save, disk tier (fsync) >= {GOAL_FS:g} x FileSystemWriter with fsync"),
        *speedup("tdb_host", "gather_commit", GOAL_GATHER,
                 f"DCP save, host tier >= {GOAL_GATHER:g} x gather to rank 0 + commit"),
    ]
    goal = f"contiguous slice read <= {GOAL_SLICE:g} x memcpy of the slice"
    if "slice_dim0" in f and "bound_slice" in f:
        x = f["slice_dim0"]["best_s"] / f["bound_slice"]["best_s"]
        bound = ""
        if "bound_slice_pread" in f:  # what the kernel's read alone costs, same run
            b = f["bound_slice_pread"]["best_s"] / f["bound_slice"]["best_s"]
            bound = (f"; the kernel's read of the bytes from a shm file not mapped is "
                     f"{b:.2f} x memcpy, so a fresh snapshot's read is bounded there; ours "
                     f"is {f['slice_dim0']['best_s'] / f['bound_slice_pread']['best_s']:.2f}"
                     f" x that bound")
        out.append(_verdict.at_most(goal, x, GOAL_SLICE, f"{x:.2f} x{bound}"))
    else:
        out.append(_verdict.not_measured(goal, "the slice read or its bound did not run"))
    if not res.get("values_ok", False):
        out.append(_verdict.judge("every value read back is the one saved", False,
                                  "a read returned other values"))
    return out


def print_report(res: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    con = Console(width=160)
    n, f = res["bytes"], res["figures"]
    con.print(f"[bold]checkpoint[/] of a {n / MiB:,.0f} MiB model ({res['tensors']} bfloat16 "
              f"tensors of {res['shape'][0]} x {res['shape'][1]}), 2 ranks (gloo, this host), "
              f"dim-0 DTensor shards; GB = 1e9 bytes; {res['cpus']} CPUs; fresh store, no "
              f"prefault, no environment variables; best of {len(res['times']['tdb_host'])}")
    t = Table()
    for col in ("", "first ms", "best ms", "median ms", "best GB/s", "x bound"):
        t.add_column(col, justify="left" if not col else "right", no_wrap=not col)

    def row(key: str, bound: str | None, nbytes: int) -> None:
        m = f[key]
        x = f"{m['best_s'] / f[bound]['best_s']:.2f}" if bound else ""
        t.add_row(escape(LABELS[key]), f"{m['first_s'] * 1e3:.1f}", f"{m['best_s'] * 1e3:.1f}",
                  f"{m['median_s'] * 1e3:.1f}", f"{nbytes / m['best_s'] / GB:.2f}", x)
    for key in ("bound_memcpy", "tdb_host", "fs_shm", "gather_commit"):
        row(key, None if key.startswith("bound") else "bound_memcpy", n)
    for key in ("bound_fsync", "tdb_disk", "fs_disk"):
        row(key, None if key.startswith("bound") else "bound_fsync", n)
    sb = res["slice_bytes"] * 2
    for key in ("bound_slice", "bound_slice_shm", "bound_slice_pread", "slice_dim0",
                "slice_dim0_mapped", "slice_dim1", "whole"):
        row(key, None if key == "bound_slice" else "bound_slice", sb)
    con.print(t)
    con.print(f"(the save rows' GB/s count the whole model; the read rows' the bytes both "
              f"ranks' slices hold, {sb / MiB:,.0f} MiB, also for whole tensors, which copy "
              f"twice that; x bound: time / the bound's time above it; stored shards per "
              f"tensor {res['shards_per_tensor']}; values read back right: "
              f"{res['values_ok']})")
    con.print(f"1-min load average before/after: {res['loadavg_before']:.2f} / "
              f"{res['loadavg_after']:.2f} (other processes on the host skew the figures)")
    _verdict.print_verdicts(con, goals(res))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="1G", help="model size (1G)")
    p.add_argument("--reps", type=int, default=4, help="repeats of each figure (4)")
    p.add_argument("--tmp-dir", default=None,
                   help="where the store and the FileSystemWriter's local directory go")
    p.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    p.add_argument("--rank", nargs=4, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rank:
        RankJob(int(args.rank[0]), args.rank[1], int(args.rank[2]), int(args.rank[3])).run()
        return 0
    if args.reps < 1:
        p.error("--reps must be at least 1")
    res = run(args)
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        print_report(res)
    return _verdict.exit_code(goals(res))


if __name__ == "__main__":
    sys.exit(main())
