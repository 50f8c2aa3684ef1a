"""Scale benchmark: the catalog and the snapshot path at 1,000 / 10,000 / 100,000 tensors,
on SQLite and PostgreSQL, beside the database's own bulk insert of the same rows and
beside safetensors, all in one run.

For each size (``--sizes``, default 1000,10000,100000) and backend, on a fresh store
(no ``prefault``, no environment variables), an MoE-like checkpoint of small tensors
(``layers.L.experts.E.w``, 16-64 float32 each: at these sizes the metadata is the cost,
not the bytes) is committed and then read:

* ``commit``: ``db.transaction`` + ``put_many`` of every tensor, the first version;
* ``1-change commit``: one tensor changed, committed on top (median of 15, or
  ``--reps`` if more; the first one beside it), and the process CPU (every thread) of
  that commit together with the manifest packing it queued (``1-change CPU``);
* ``open`` / ``state_dict()`` / ``touch all``: a snapshot of the head in this process,
  its ``state_dict()`` (a mapping that makes tensors on first access) and the walk that
  makes every tensor (``values()``), so a lazy mapping hides nothing;
* ``2nd process``: a fresh interpreter connects, opens the head and takes
  ``state_dict()`` (timed from the open), then touches every tensor (the time beside);
* ``history`` and ``gc`` (after retention dropped the first version).

Beside them, measured in the same run on the same server:

* ``bulk insert``: the rows of the first commit inserted by the database itself into a
  scratch table of the same definition (same keys and indexes): one ``executemany`` in
  one transaction on SQLite, ``COPY`` of one pre-formatted text stream on PostgreSQL
  (the formatting timed too: it is what any client pays). The commit's goal is stated
  against it: a commit within ``GOAL_BULK`` x its rows' bulk insert.
* ``safetensors``: ``save_file`` of the same tensors, and in a fresh process
  ``safe_open`` + ``get_tensor`` of each (what a user of plain files pays; mmap'd).

Goals: 100,000-tensor commit <= 3 x the bulk insert of its rows; a 1-change commit at
the largest size <= 1.5 x the one at the smallest, and its CPU with what it queued
<= 2 x the one at the smallest size with a packed manifest (2,000+ tensors: the packing
costs what changed); the second process's open +
``state_dict()`` at 100,000 tensors <= 50 ms. A backend that did not run (PostgreSQL
not answering) prints each of its goals "not measured" with the reason; such a goal
fails, as a missed one does, and the script exits 1 unless every goal is met.

Run:  .venv/bin/python -m benchmarks.scale [--sizes 1000,10000,100000]
      [--backends sqlite,postgresql] [--reps 5] [--json] [--png scale.png]
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from sqlalchemy import text

import tensordb
from benchmarks import _common, _verdict
from benchmarks._verdict import Verdict
from tensordb.catalog import PACK_MIN_ROWS

GOAL_BULK = 3.0
GOAL_ONE_CHANGE = 1.5
#: the process CPU of a 1-change commit and the manifest packing it queues: O(changed)
#: (the packing rewrote the whole manifest: 47 ms of CPU at 100,000 against 5 at 1,000)
GOAL_ONE_CHANGE_CPU = 2.0
GOAL_OPEN_MS = 50.0
COLLECTION = "moe"
#: 1-change commits timed per size (the first ones after a bulk load run beside the
#: database's own upkeep of it, PostgreSQL's autovacuum: the median is the steady cost,
#: the first is printed beside it)
ONE_CHANGE_REPS = 15


def checkpoint(n: int) -> dict[str, torch.Tensor]:
    """``n`` small float32 tensors named as an MoE's experts (16-64 elements each)."""
    return {f"layers.{i // 256}.experts.{i % 256}.w{i % 3}":
            torch.full((16 << (i % 3),), float(i)) for i in range(n)}


def _cpu_s() -> float:
    """CPU seconds this process used so far, every thread."""
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


# -- the database's own bulk insert ------------------------------------------------------
def _bulk_rows(db: tensordb.Database) -> list[tuple[Any, ...]]:
    with db.catalog.engine.connect() as conn:
        return [tuple(r) for r in conn.execute(text(
            'SELECT collection_id, name, first_version, end_version, dtype, shape, nbytes, '
            'checksum, segment_id, "offset" FROM tensors WHERE first_version = 1'))]


def bulk_insert(db: tensordb.Database) -> float:
    """Seconds the database takes to insert the first commit's rows into a scratch
    table of the ``tensors`` table's definition, in one transaction, by its own bulk
    path (removed afterwards)."""
    rows = _bulk_rows(db)
    engine = db.catalog.engine
    if engine.dialect.name == "sqlite":
        with engine.connect() as conn:
            ddl = [r[0] for r in conn.exec_driver_sql(
                "SELECT sql FROM sqlite_master WHERE tbl_name = 'tensors' AND sql IS NOT NULL")]
        raw = engine.raw_connection()
        try:
            cur = raw.driver_connection.cursor()  # type: ignore[union-attr]
            for stmt in ddl:  # the table, then its indexes, renamed
                cur.execute(stmt.replace("tensors", "bulk_tensors"))
            t0 = time.perf_counter()
            cur.execute("BEGIN IMMEDIATE")
            cur.executemany("INSERT INTO bulk_tensors VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                            rows)
            cur.execute("COMMIT")
            took = time.perf_counter() - t0
            cur.execute("DROP TABLE bulk_tensors")
        finally:
            raw.close()
        return took
    raw = engine.raw_connection()
    try:
        conn = raw.driver_connection
        assert conn is not None
        with conn.cursor() as cur:
            cur.execute("CREATE TABLE bulk_tensors (LIKE tensors INCLUDING ALL)")
            conn.commit()
            t0 = time.perf_counter()
            # COPY's text format in one stream: the fastest a Python client loads rows
            payload = "".join("\t".join("\\N" if v is None else str(v) for v in r) + "\n"
                              for r in rows)
            with cur.copy('COPY bulk_tensors (collection_id, name, first_version, end_version, '
                          'dtype, shape, nbytes, checksum, segment_id, "offset") FROM STDIN') as cp:
                cp.write(payload)
            conn.commit()
            took = time.perf_counter() - t0
            cur.execute("DROP TABLE bulk_tensors")
            conn.commit()
    finally:
        raw.close()
    return took


# -- child processes -----------------------------------------------------------------------
_CHILD = f"""
import json, sys, time
import tensordb
url, home = sys.argv[1], sys.argv[2]
db = tensordb.connect(url or None, home=home, data_dir=home + "/data")
t0 = time.perf_counter()
snap = db.snapshot({COLLECTION!r})
opened = time.perf_counter()
sd = snap.state_dict()
mapped = time.perf_counter()
n = sum(1 for t in sd.values() if t.numel() > 0)
touched = time.perf_counter()
print(json.dumps({{"open_s": opened - t0, "state_dict_s": mapped - opened,
                  "touch_s": touched - mapped, "tensors": n, "n": len(sd)}}))
"""

_SAFETENSORS_CHILD = """
import json, sys, time
import torch  # imported before the clock starts, as the store's child has it
from safetensors import safe_open
t0 = time.perf_counter()
with safe_open(sys.argv[1], framework="pt") as f:
    keys = list(f.keys())
    opened = time.perf_counter()
    sd = {k: f.get_tensor(k) for k in keys}
done = time.perf_counter()
print(json.dumps({"open_s": opened - t0, "all_s": done - opened, "n": len(sd)}))
"""


def run_child(code: str, *args: str) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                         timeout=600, check=False)
    if out.returncode != 0:
        return {"error": (out.stderr.strip().splitlines() or ["failed"])[-1]}
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def safetensors_peer(sd: dict[str, torch.Tensor], work: Path) -> dict[str, Any]:
    try:
        from safetensors.torch import save_file
    except ImportError as exc:
        return {"skipped": f"safetensors is not installed ({exc})"}
    path = work / "peer.safetensors"
    took, _ = timed(lambda: save_file(sd, str(path)))
    got = run_child(_SAFETENSORS_CHILD, str(path))
    path.unlink()
    return {"save_s": took, **got}


# -- one size on one backend ------------------------------------------------------------
def bench_store(db: tensordb.Database, url: str, home: str, n: int, reps: int
                ) -> dict[str, Any]:
    sd = checkpoint(n)
    res: dict[str, Any] = {}

    def commit_all() -> None:
        with db.transaction(COLLECTION) as tx:
            tx.put_many(sd)

    res["commit_s"], _ = timed(commit_all)
    res["bulk_insert_s"] = bulk_insert(db)
    assert db.catalog.manifests is not None
    db.catalog.manifests.close()  # the background packing of the first version, done
    ones, cpus = [], []
    name = next(iter(sd))
    for i in range(max(ONE_CHANGE_REPS, reps)):
        c0 = _cpu_s()
        took, _ = timed(lambda i=i: db.commit(COLLECTION, {name: torch.full_like(sd[name],
                                                                              -1.0 - i)}))
        ones.append(took)
        db.catalog.manifests.close()  # not the next commit's cost: see docs/catalog.md
        cpus.append(_cpu_s() - c0)  # the commit and the packing it queued, every thread
    res["one_change_commit_s"] = statistics.median(ones)
    res["one_change_first_s"] = ones[0]
    res["one_change_cpu_s"] = statistics.median(cpus)
    opens, sds, touches = [], [], []
    for _ in range(reps):
        t_open, snap = timed(lambda: db.snapshot(COLLECTION))
        t_sd, got = timed(snap.state_dict)
        t_touch, k = timed(lambda got=got: sum(1 for _ in got.values()))
        assert k == n
        snap.close()
        opens.append(t_open)
        sds.append(t_sd)
        touches.append(t_touch)
    res["open_s"] = statistics.median(opens)
    res["state_dict_s"] = statistics.median(sds)
    res["touch_all_s"] = statistics.median(touches)
    children = [run_child(_CHILD, url, home) for _ in range(max(1, reps // 2))]
    good = [c for c in children if "error" not in c]
    if good:
        res["second_process"] = {k: statistics.median(c[k] for c in good)
                                 for k in ("open_s", "state_dict_s", "touch_s")}
        res["second_process"]["values_ok"] = all(c["n"] == n for c in good)
    else:
        res["second_process"] = {"error": children[0]["error"]}
    res["history_s"], _ = timed(lambda: db.history(COLLECTION))
    db.drop_versions(COLLECTION, keep_last=1)
    res["gc_s"], report = timed(db.gc)
    res["gc_dropped_rows"] = report.dropped_rows
    return res


def bench_backend(backend: str, sizes: list[int], args: argparse.Namespace,
                  work: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for n in sizes:
        if backend == "sqlite":
            home = tempfile.mkdtemp(prefix="scale-", dir=work)
            db = tensordb.connect(home=home)
            try:
                out[str(n)] = bench_store(db, "", home, n, args.reps)
            finally:
                _common.remove_store(db)
                shutil.rmtree(home, ignore_errors=True)
            continue
        try:
            with _common.temp_pg_database(args.pg) as (url, version):
                home = tempfile.mkdtemp(prefix="scale-pg-", dir=work)
                db = tensordb.connect(url, home=home, data_dir=home + "/data")
                try:
                    out[str(n)] = bench_store(db, url, home, n, args.reps)
                    out["server_version"] = version
                finally:
                    _common.remove_store(db)
                    shutil.rmtree(home, ignore_errors=True)
        except _common.PgUnavailable as exc:
            return {"skipped": str(exc)}
    return out


def goals(res: dict[str, Any], sizes: list[int]) -> list[Verdict]:
    """Every goal of every backend asked for, each named with its backend; a backend
    (or a second process) that did not run: its goals not measured, with the reason."""
    out: list[Verdict] = []
    big, small = str(max(sizes)), str(min(sizes))
    # the CPU goal compares versions that both have a packed manifest (a smaller one is
    # read from SQL and queues nothing), where the sizes allow
    packed = str(min((n for n in sizes if n >= PACK_MIN_ROWS and str(n) != big),
                     default=int(small)))
    for backend, r in res["backends"].items():
        what = [f"{backend}: {big}-tensor commit <= {GOAL_BULK:g} x the bulk insert of its rows"]
        if big != small:
            what.append(f"{backend}: 1-change commit at {big} <= {GOAL_ONE_CHANGE:g} x the "
                        f"one at {small}")
            what.append(f"{backend}: CPU of a 1-change commit and the work it queues at "
                        f"{big} <= {GOAL_ONE_CHANGE_CPU:g} x the one at {packed}")
        what.append(f"{backend}: 2nd-process open + state_dict() of {big} <= "
                    f"{GOAL_OPEN_MS:g} ms, every tensor there")
        if "skipped" in r:
            out += [_verdict.not_measured(w, r["skipped"]) for w in what]
            continue
        b = r[big]
        ratio = b["commit_s"] / b["bulk_insert_s"]
        out.append(_verdict.at_most(what[0], ratio, GOAL_BULK,
                                    f"{b['commit_s'] * 1e3:.0f} ms = {ratio:.2f} x "
                                    f"{b['bulk_insert_s'] * 1e3:.0f} ms"))
        if big != small:
            one = b["one_change_commit_s"] / r[small]["one_change_commit_s"]
            out.append(_verdict.at_most(
                what[1], one, GOAL_ONE_CHANGE,
                f"{b['one_change_commit_s'] * 1e3:.1f} ms median (the first "
                f"{b['one_change_first_s'] * 1e3:.1f} ms) = {one:.2f} x"))
            base = r[packed]["one_change_cpu_s"]
            cpu = b["one_change_cpu_s"] / base
            out.append(_verdict.at_most(
                what[2], cpu, GOAL_ONE_CHANGE_CPU,
                f"{b['one_change_cpu_s'] * 1e3:.1f} ms against {base * 1e3:.1f} ms of CPU, "
                f"medians = {cpu:.2f} x"))
        sp = b["second_process"]
        if "error" in sp:
            out.append(_verdict.not_measured(what[-1], str(sp["error"])))
        else:
            ms = (sp["open_s"] + sp["state_dict_s"]) * 1e3
            out.append(_verdict.judge(
                what[-1], ms <= GOAL_OPEN_MS and bool(sp["values_ok"]),
                f"{ms:.1f} ms, values right {bool(sp['values_ok'])}; touching every tensor "
                f"after: {sp['touch_s'] * 1e3:.0f} ms"))
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    sizes = [int(s) for s in args.sizes.split(",")]
    work = Path(tempfile.mkdtemp(prefix="tensordb-scale-", dir=args.tmp_dir))
    res: dict[str, Any] = {"sizes": sizes, "loadavg_before": os.getloadavg()[0],
                           "backends": {}, "safetensors": {}}
    try:
        for backend in args.backends.split(","):
            res["backends"][backend] = bench_backend(backend, sizes, args, work)
        for n in sizes:
            res["safetensors"][str(n)] = safetensors_peer(checkpoint(n), work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    res["loadavg_after"] = os.getloadavg()[0]
    res["goals"] = _verdict.to_json(goals(res, sizes))
    return res


def print_report(res: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=140)
    table = Table(title="scale: ms per operation (fresh store, no prefault)")
    cols = ("backend", "tensors", "commit", "bulk insert", "1-change", "1-change CPU", "open",
            "state_dict",
            "touch all", "2nd open+sd", "2nd touch", "history", "gc")
    for c in cols:
        table.add_column(c, justify="left" if c == "backend" else "right")
    for backend, r in res["backends"].items():
        if "skipped" in r:
            table.add_row(backend, f"skipped: {r['skipped']}", *[""] * (len(cols) - 2))
            continue
        for n in res["sizes"]:
            b = r[str(n)]
            sp = b["second_process"]
            two = ("error" if "error" in sp else
                   f"{(sp['open_s'] + sp['state_dict_s']) * 1e3:.1f}")
            table.add_row(backend, f"{n:,}", *(f"{b[k] * 1e3:.1f}" for k in (
                "commit_s", "bulk_insert_s", "one_change_commit_s", "one_change_cpu_s",
                "open_s", "state_dict_s", "touch_all_s")), two, "" if "error" in sp else f"{sp['touch_s'] * 1e3:.0f}",
                f"{b['history_s'] * 1e3:.1f}", f"{b['gc_s'] * 1e3:.1f}")
        table.add_section()
    for n, p in res["safetensors"].items():
        if "skipped" in p or "error" in p:
            table.add_row("safetensors", f"{n}: {p.get('skipped') or p.get('error')}",
                          *[""] * (len(cols) - 2))
            continue
        table.add_row("safetensors", f"{int(n):,}", f"{p['save_s'] * 1e3:.1f} (save_file)",
                      "", "", "", "", "", "", f"{p['open_s'] * 1e3:.1f}",
                      f"{p['all_s'] * 1e3:.0f} (get_tensor)", "", "")
    console.print(table)
    console.print(f"1-min load average before/after: {res['loadavg_before']:.2f} / "
                  f"{res['loadavg_after']:.2f} (other processes skew the figures)")
    _verdict.print_verdicts(console, _verdict.from_json(res["goals"]))


def plot(res: dict[str, Any], path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    sizes = res["sizes"]
    for backend, r in res["backends"].items():
        if "skipped" in r:
            continue
        for key, label, ax in (("commit_s", "commit", 0), ("bulk_insert_s", "bulk insert", 0),
                               ("one_change_commit_s", "1-change commit", 0),
                               ("open_s", "open", 1), ("state_dict_s", "state_dict()", 1),
                               ("touch_all_s", "touch all", 1)):
            axes[ax].plot(sizes, [r[str(n)][key] * 1e3 for n in sizes], marker="o",
                          label=f"{backend}: {label}")
    for ax, title in zip(axes, ("writes", "reads"), strict=True):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("tensors in the version")
        ax.set_ylabel("ms")
        ax.set_title(title)
        ax.legend(fontsize=7)
        ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="1000,10000,100000")
    p.add_argument("--backends", default="sqlite,postgresql")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--pg", default="postgres@127.0.0.1:5432")
    p.add_argument("--tmp-dir", default=None)
    p.add_argument("--json", action="store_true")
    p.add_argument("--png", default=None, help="write the growth curves here")
    args = p.parse_args(argv)
    res = run(args)
    if args.png and not plot(res, args.png):
        print("matplotlib is not installed: no PNG", file=sys.stderr)
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        print_report(res)
    return _verdict.exit_code(_verdict.from_json(res["goals"]))


if __name__ == "__main__":
    sys.exit(main())
