"""Materialization benchmark: commit ~1 GiB of tensors, then map them from a second process.

What it measures:

* ``memcpy``: numpy ``copyto`` of the same number of bytes into a pre-touched
  destination, with 1 thread and with 2 threads (the physical limit, same run);
* ``commit``: ``db.commit`` of ``--count`` float32 tensors totalling ``--total-mib`` to
  (a) the host tier of a writer that pre-faulted its spare (``db.prefault``; the designed
  fast path), (a') the same with the background refill of the next spare switched off,
  to show what that refill costs the commit it runs beside, (b) the host tier with no
  spare (cold: page faults of first touch), (c) the disk tier (fsynced). GB/s (1e9
  bytes/s) and the fraction of 1-thread memcpy; best of ``--reps`` (median shown too);
* ``child``: a second process (this script with ``--child``) connects to the same store,
  opens the head snapshot, builds ``state_dict()`` with every tensor made (it is a lazy
  mapping: ``dict(sd.items())``) and reads one element of every tensor,
  timed from snapshot open to done (start-up+import and connect are reported apart); then
  sums every tensor (all bytes, 1 thread, first pass and again) as GB/s. It checks that each
  tensor's data_ptr lies in a mapping of the store's shm directory (/proc/self/maps):
  zero-copy. Median of ``--child-runs`` processes.

* ``to_arrow``: the same in other fresh processes (``--child --arrow``), with
  ``snap.to_arrow()`` (the Arrow table of every tensor, its data buffers over the same
  mappings, docs/arrow.md) in place of ``state_dict()``: the first call on a fresh
  snapshot of a fresh process (nothing mapped or pre-faulted), and the steady state (a
  fresh snapshot of the same process, median of ``STEADY_REPS``), beside ``state_dict()``'s
  same two figures, and their ratio. Each buffer's address is checked to lie in a mapping
  of the store's shm directory, like the tensors'.

Goals printed beside: the child reads 1,000 tensors in <= 5 ms; commit >= 0.8 x memcpy;
``to_arrow`` takes at most 2 x the time of ``state_dict()`` with every tensor made.

Run:  .venv/bin/python -m benchmarks.materialize [--count 1000] [--total-mib 1024] [--json]
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
from typing import Any

import numpy as np
import torch

import benchmarks
import tensordb
from benchmarks import _common, _verdict

GB = 1e9
MiB = 1 << 20
GOAL_CHILD_MS = 5.0
GOAL_COMMIT_FRACTION = 0.8
GOAL_ARROW_RATIO = 2.0
STEADY_REPS = 7


def name_of(i: int) -> str:
    return f"model.layers.{i:05d}.weight"


# -- child ------------------------------------------------------------------------------
def shm_mappings(shm_dir: str) -> list[tuple[int, int, str]]:
    out = []
    with open("/proc/self/maps") as fh:
        for line in fh:
            parts = line.split(None, 5)
            path = parts[5].strip() if len(parts) == 6 else ""
            if path.startswith(shm_dir + "/") and path.endswith(".seg"):  # segments only
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                out.append((lo, hi, parts[1]))
    return out


def child(args: argparse.Namespace) -> None:
    started = time.time()  # imports are done by now
    res: dict[str, Any] = {"startup_import_s": started - args.spawned_at}
    t0 = time.perf_counter()
    db = tensordb.connect(home=args.home)
    res["connect_ms"] = (time.perf_counter() - t0) * 1e3

    t0 = time.perf_counter()
    snap = db.snapshot(args.collection)
    t1 = time.perf_counter()
    sd = dict(snap.state_dict().items())  # every tensor made (state_dict() is lazy)
    t2 = time.perf_counter()
    firsts = [t.reshape(-1)[0].item() for t in sd.values()]
    t3 = time.perf_counter()
    res.update(snapshot_open_ms=(t1 - t0) * 1e3, state_dict_ms=(t2 - t1) * 1e3,
               touch_ms=(t3 - t2) * 1e3, materialize_ms=(t3 - t0) * 1e3, tensors=len(sd))
    res["values_ok"] = all(v == float(i) for i, v in enumerate(firsts))

    # zero-copy: every tensor's storage lies inside a private mapping of the store's shm
    maps = shm_mappings(str(db.config.shm_dir))
    inside = sum(any(lo <= t.data_ptr() < hi for lo, hi, _ in maps) for t in sd.values())
    res.update(zero_copy_tensors=inside, shm_mappings=len(maps),
               mapping_perms=sorted({p for _, _, p in maps}))

    nbytes = sum(t.nbytes for t in sd.values())
    torch.set_num_threads(1)  # compare with 1-thread memcpy; OpenMP stalls on a busy host
    for label in ("read_all_first", "read_all_again"):
        t0 = time.perf_counter()
        total = 0.0
        for t in sd.values():
            total += float(t.sum())
        res[f"{label}_gbps"] = nbytes / (time.perf_counter() - t0) / GB
    res["read_bytes"] = nbytes

    t0 = time.perf_counter()
    snap.close()
    res["snapshot_close_ms"] = (time.perf_counter() - t0) * 1e3
    t0 = time.perf_counter()  # a second snapshot in the same process: segments mapped
    with db.snapshot(args.collection) as s2:
        sd2 = s2.state_dict()
        [t.reshape(-1)[0].item() for t in sd2.values()]
    res["materialize_warm_ms"] = (time.perf_counter() - t0) * 1e3
    res["steady_ms"] = steady(db, args.collection, lambda s: dict(s.state_dict().items()))
    db.close()
    print(json.dumps(res))


def steady(db: tensordb.Database, collection: str, call: Any) -> float:
    """Median ms of ``call(snapshot)`` on fresh snapshots of a process that has mapped
    the version before (snapshot open and close not counted)."""
    times = []
    for _ in range(STEADY_REPS):
        with db.snapshot(collection) as snap:
            t0 = time.perf_counter()
            call(snap)
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def child_arrow(args: argparse.Namespace) -> None:
    """``child`` with ``to_arrow`` in place of ``state_dict``."""
    started = time.time()
    res: dict[str, Any] = {"startup_import_s": started - args.spawned_at}
    db = tensordb.connect(home=args.home)
    t0 = time.perf_counter()
    snap = db.snapshot(args.collection)
    t1 = time.perf_counter()
    table = snap.to_arrow()
    t2 = time.perf_counter()
    bufs = [c.buffers()[2] for c in table.column("data").chunks]
    firsts = [float(np.frombuffer(b, np.float32, count=1)[0]) for b in bufs]
    t3 = time.perf_counter()
    res.update(snapshot_open_ms=(t1 - t0) * 1e3, to_arrow_ms=(t2 - t1) * 1e3,
               touch_ms=(t3 - t2) * 1e3, rows=table.num_rows)
    res["values_ok"] = firsts == [float(i) for i in range(len(firsts))]
    maps = shm_mappings(str(db.config.shm_dir))
    res["zero_copy_buffers"] = sum(any(lo <= b.address < hi for lo, hi, _ in maps)
                                   for b in bufs)
    t0 = time.perf_counter()
    snap.to_arrow()
    res["again_ms"] = (time.perf_counter() - t0) * 1e3  # the same snapshot: mapped
    snap.close()
    res["steady_ms"] = steady(db, args.collection, lambda s: s.to_arrow())
    db.close()
    print(json.dumps(res))


def run_child(module: str, home: str, collection: str, *extra: str) -> dict[str, Any]:
    spawned = time.time()
    out = subprocess.run(benchmarks.command(module, "--child", "--home", home, "--collection",
                                            collection, "--spawned-at", repr(spawned), *extra),
                         capture_output=True, text=True, check=False, env=benchmarks.child_env())
    if out.returncode != 0:
        raise RuntimeError(f"child failed ({out.returncode}):\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# -- parent -----------------------------------------------------------------------------
def measure_memcpy(nbytes: int, reps: int) -> dict[str, float]:
    best = _common.measure_memcpy(nbytes, reps)
    return {"memcpy_1t_gbps": nbytes / best["memcpy_1t_s"] / GB,
            "memcpy_2t_gbps": nbytes / best["memcpy_2t_s"] / GB}


def timed_commits(db: tensordb.Database, prefix: str, tensors: dict[str, torch.Tensor],
                  reps: int, *, tier: str = "host", prefault: int = 0, refill: bool = True,
                  keep_last: bool = False) -> dict[str, Any]:
    nbytes = sum(t.nbytes for t in tensors.values())
    times, prefaults = [], []
    for r in range(reps):
        if prefault:
            t0 = time.perf_counter()
            db.prefault(prefault)
            prefaults.append(time.perf_counter() - t0)
            if not refill:  # private knob: no background refill of the next spare
                db.tier("host").spare_bytes = 0
        t0 = time.perf_counter()
        c = db.commit(f"{prefix}{r}", tensors, tier=tier)
        times.append(time.perf_counter() - t0)
        assert c.nbytes == nbytes and c.tensors == len(tensors)
        if prefault and refill:
            db.prefault(prefault)  # wait for the background refill: keep the machine idle
        if not (keep_last and r == reps - 1):
            db.drop(f"{prefix}{r}")
            db.gc()
    best, med = min(times), statistics.median(times)
    out: dict[str, Any] = {"best_s": best, "median_s": med, "best_gbps": nbytes / best / GB,
                           "median_gbps": nbytes / med / GB, "runs": len(times)}
    if prefaults:  # the first call faults a whole spare in; later ones find it refilled
        out["prefault_gbps"] = prefault / max(prefaults) / GB
    return out


def parent(args: argparse.Namespace) -> dict[str, Any]:
    n = args.count
    per = max(1, args.total_mib * MiB // n // 4)
    tensors = {name_of(i): torch.empty(per, dtype=torch.float32).fill_(float(i)) for i in range(n)}
    nbytes = n * per * 4
    res: dict[str, Any] = {"tensors": n, "bytes": nbytes, "tensor_bytes": per * 4,
                           "loadavg_before": os.getloadavg()[0]}
    res.update(measure_memcpy(nbytes, args.reps))
    spare = nbytes + 64 * MiB
    homes: list[str] = []
    dbs: list[tensordb.Database] = []

    def open_store(**kw: object) -> tensordb.Database:
        homes.append(tempfile.mkdtemp(prefix="tensordb-bench-mat-", dir=args.tmp_dir))
        dbs.append(tensordb.connect(home=homes[-1], **kw))
        return dbs[-1]

    try:
        a = open_store()
        commits: dict[str, dict[str, Any]] = {}
        commits["(a) host, prefaulted spare"] = timed_commits(
            a, "a", tensors, args.reps, prefault=spare, keep_last=True)
        if not args.skip_norefill:
            x = open_store()
            commits["(a') host, prefaulted, no refill"] = timed_commits(
                x, "x", tensors, args.reps, prefault=spare, refill=False)
            x.close()
        # the child reads store (a): its writer stays open and idle meanwhile
        runs, arrow_runs = [], []
        for _ in range(args.child_runs):  # interleaved: the host's load skews both alike
            runs.append(run_child(__spec__.name, homes[0], f"a{args.reps - 1}"))
            arrow_runs.append(run_child(__spec__.name, homes[0], f"a{args.reps - 1}",
                                        "--arrow"))
        b = open_store()
        commits["(b) host, cold (no spare)"] = timed_commits(b, "b", tensors, args.reps)
        if not args.skip_disk:
            commits["(c) disk tier (fsync)"] = timed_commits(b, "c", tensors, args.reps,
                                                            tier="disk")
            res["disk_dir"] = str(b.config.data_dir)
    finally:
        for db in dbs:
            db.close()
            shutil.rmtree(db.config.shm_dir, ignore_errors=True)
        for h in homes:
            shutil.rmtree(h, ignore_errors=True)
    for c in commits.values():
        c["fraction_of_memcpy_1t"] = c["best_gbps"] / res["memcpy_1t_gbps"]
        c["fraction_of_memcpy_2t"] = c["best_gbps"] / res["memcpy_2t_gbps"]
    res["commits"] = commits
    keys = [k for k, v in runs[0].items() if type(v) in (int, float)]
    res["child_median"] = {k: statistics.median(r[k] for r in runs) for k in keys}
    res["child_min"] = {k: min(r[k] for r in runs) for k in keys}
    res["child_checks"] = {"values_ok": all(r["values_ok"] for r in runs),
                           "zero_copy_tensors": [r["zero_copy_tensors"] for r in runs],
                           "shm_mappings": runs[0]["shm_mappings"],
                           "mapping_perms": runs[0]["mapping_perms"]}
    res["child_runs"] = len(runs)
    res["child_each"] = runs
    res["arrow"] = arrow_summary(runs, arrow_runs)
    res["loadavg_after"] = os.getloadavg()[0]
    return res


def arrow_summary(runs: list[dict[str, Any]], arrow_runs: list[dict[str, Any]]
                  ) -> dict[str, Any]:
    """to_arrow beside state_dict, medians over the child processes."""
    def med(rs: list[dict[str, Any]], key: str) -> float:
        return statistics.median(r[key] for r in rs)

    out: dict[str, Any] = {
        "state_dict_first_ms": med(runs, "state_dict_ms"),
        "to_arrow_first_ms": med(arrow_runs, "to_arrow_ms"),
        "state_dict_steady_ms": med(runs, "steady_ms"),
        "to_arrow_steady_ms": med(arrow_runs, "steady_ms"),
        "to_arrow_same_snapshot_ms": med(arrow_runs, "again_ms"),
        "to_arrow_snapshot_open_ms": med(arrow_runs, "snapshot_open_ms"),
        "to_arrow_touch_ms": med(arrow_runs, "touch_ms"),
        "values_ok": all(r["values_ok"] for r in arrow_runs),
        "zero_copy_buffers": [r["zero_copy_buffers"] for r in arrow_runs],
        "rows": arrow_runs[0]["rows"], "each": arrow_runs}
    out["first_ratio"] = out["to_arrow_first_ms"] / out["state_dict_first_ms"]
    out["steady_ratio"] = out["to_arrow_steady_ms"] / out["state_dict_steady_ms"]
    return out


def print_arrow(con: Any, res: dict[str, Any]) -> None:
    from rich.table import Table

    a = res["arrow"]
    t = Table(title=f"to_arrow() beside state_dict(), {a['rows']} tensors (second processes, "
                    f"median of {res['child_runs']} each)")
    for col in ("call", "state_dict()", "to_arrow()", "ratio", "goal"):
        t.add_column(col, justify="left" if col == "call" else "right")
    for label, key in (("first call: fresh process, fresh snapshot", "first"),
                       ("steady state: fresh snapshot, version mapped before", "steady")):
        ratio = a[f"{key}_ratio"]
        t.add_row(label, f"{a[f'state_dict_{key}_ms']:.2f} ms", f"{a[f'to_arrow_{key}_ms']:.2f} ms",
                  f"{ratio:.2f} x", f"<= {GOAL_ARROW_RATIO:g} x {verdict(ratio <= GOAL_ARROW_RATIO)}")
    con.print(t)
    con.print(f"to_arrow: snapshot open {a['to_arrow_snapshot_open_ms']:.2f} ms; same "
              f"snapshot again {a['to_arrow_same_snapshot_ms']:.2f} ms; read one value of "
              f"each buffer {a['to_arrow_touch_ms']:.2f} ms; values ok={a['values_ok']}; "
              f"buffers inside the store's shm mappings per run {a['zero_copy_buffers']} "
              f"of {a['rows']}")


def verdict(ok: bool) -> str:
    return "[green]ok[/]" if ok else "[red]MISS[/]"


def goals(res: dict[str, Any]) -> list[_verdict.Verdict]:
    """The goals the report marks, as verdicts (in ``--json``; the exit status stays 0):
    each commit >= GOAL_COMMIT_FRACTION x memcpy, the second process <= GOAL_CHILD_MS,
    to_arrow() <= GOAL_ARROW_RATIO x state_dict(), first call and steady."""
    out = [_verdict.at_least(f"commit, {name} >= {GOAL_COMMIT_FRACTION} x memcpy 1 thread",
                             c["fraction_of_memcpy_1t"], GOAL_COMMIT_FRACTION,
                             f"{c['fraction_of_memcpy_1t']:.2f} x, {c['best_gbps']:.2f} GB/s")
           for name, c in res["commits"].items()]
    ms = res["child_median"]["materialize_ms"]
    out.append(_verdict.at_most(f"second process: snapshot open to done <= {GOAL_CHILD_MS:g} "
                                f"ms", ms, GOAL_CHILD_MS, f"{ms:.2f} ms median"))
    out.append(_verdict.judge("second process: values right, zero-copy",
                              bool(res["child_checks"]["values_ok"]),
                              f"values ok={res['child_checks']['values_ok']}"))
    a = res["arrow"]
    for key, label in (("first", "first call"), ("steady", "steady")):
        x = a[f"{key}_ratio"]
        out.append(_verdict.at_most(f"to_arrow() <= {GOAL_ARROW_RATIO:g} x state_dict(), "
                                    f"{label}", x, GOAL_ARROW_RATIO, f"{x:.2f} x"))
    return out


def print_report(res: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console(width=110)
    mc1, mc2 = res["memcpy_1t_gbps"], res["memcpy_2t_gbps"]
    con.print(f"[bold]materialize[/]: {res['tensors']} float32 tensors of {res['tensor_bytes']:,} B"
              f" = {res['bytes'] / GB:.3f} GB; GB = 1e9 bytes")
    t = Table(title="commit (best of runs; median beside)")
    for col in ("store", "best GB/s", "median GB/s", "x memcpy 1t", "x memcpy 2t", "goal"):
        t.add_column(col, justify="left" if col == "store" else "right")
    t.add_row("memcpy, 1 thread (best)", f"{mc1:.2f}", "", "1.00", f"{mc1 / mc2:.2f}", "")
    t.add_row("memcpy, 2 threads (best)", f"{mc2:.2f}", "", f"{mc2 / mc1:.2f}", "1.00", "")
    for name, c in res["commits"].items():
        ok = c["fraction_of_memcpy_1t"] >= GOAL_COMMIT_FRACTION
        t.add_row(name, f"{c['best_gbps']:.2f}", f"{c['median_gbps']:.2f}",
                  f"{c['fraction_of_memcpy_1t']:.2f}", f"{c['fraction_of_memcpy_2t']:.2f}",
                  f">= {GOAL_COMMIT_FRACTION} {verdict(ok)}")
    con.print(t)
    pf = [f"{k}: {c['prefault_gbps']:.2f} GB/s" for k, c in res["commits"].items()
          if "prefault_gbps" in c]
    if pf:
        con.print("prefault of the first spare (untimed; page-fault rate): " + "; ".join(pf))

    med, lo = res["child_median"], res["child_min"]
    t = Table(title=f"second process (median of {res['child_runs']} processes; min beside)")
    for col in ("step", "median", "min", "goal"):
        t.add_column(col, justify="left" if col == "step" else "right")
    ok = med["materialize_ms"] <= GOAL_CHILD_MS
    rows = [("interpreter start-up + imports", "startup_import_s", 1e3, "ms"),
            ("connect", "connect_ms", 1, "ms"),
            ("snapshot open (lease + manifest)", "snapshot_open_ms", 1, "ms"),
            ("state_dict() (map + views)", "state_dict_ms", 1, "ms"),
            ("touch one element of each", "touch_ms", 1, "ms"),
            ("= snapshot open to done", "materialize_ms", 1, "ms"),
            ("same again, segments already mapped", "materialize_warm_ms", 1, "ms"),
            ("snapshot close (release lease)", "snapshot_close_ms", 1, "ms"),
            ("read all bytes (sum, 1 thread), first pass", "read_all_first_gbps", 1, "GB/s"),
            ("read all bytes (sum, 1 thread), again", "read_all_again_gbps", 1, "GB/s")]
    for label, key, scale, unit in rows:
        goal = f"{med[key] / mc1:.2f} x memcpy 1t" if unit == "GB/s" else ""
        if key == "materialize_ms":
            goal = f"<= {GOAL_CHILD_MS:g} ms {verdict(ok)}"
        t.add_row(label, f"{med[key] * scale:.2f} {unit}", f"{lo[key] * scale:.2f} {unit}", goal)
    con.print(t)
    chk = res["child_checks"]
    con.print(f"child checks: values ok={chk['values_ok']}; zero-copy tensors per run "
              f"{chk['zero_copy_tensors']} of {res['tensors']} (data_ptr inside "
              f"{chk['shm_mappings']} mapping(s) of the store's shm dir, perms "
              f"{chk['mapping_perms']})")
    print_arrow(con, res)
    if "disk_dir" in res:
        con.print(f"disk tier directory: {res['disk_dir']}")
    con.print(f"1-min load average before/after: {res['loadavg_before']:.2f} / "
              f"{res['loadavg_after']:.2f} (other processes on the host skew the figures)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--count", type=int, default=1000, help="number of tensors (1000)")
    p.add_argument("--total-mib", type=int, default=1024, help="total size in MiB (1024)")
    p.add_argument("--reps", type=int, default=3, help="timed commits per store kind (3)")
    p.add_argument("--child-runs", type=int, default=3, help="reader processes (3)")
    p.add_argument("--skip-disk", action="store_true", help="skip the disk-tier commit")
    p.add_argument("--skip-norefill", action="store_true", help="skip the (a') variant")
    p.add_argument("--tmp-dir", default=None, help="where the temporary stores go")
    p.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--home", help=argparse.SUPPRESS)
    p.add_argument("--collection", help=argparse.SUPPRESS)
    p.add_argument("--spawned-at", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--arrow", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        (child_arrow if args.arrow else child)(args)
        return 0
    res = parent(args)
    if args.json:
        print(json.dumps({**res, "goals": _verdict.to_json(goals(res))}, indent=2))
    else:
        print_report(res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
