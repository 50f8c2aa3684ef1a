"""Catalog benchmark: a 1,000-tensor commit, metadata only, on SQLite and PostgreSQL.

What it measures, per backend:

* ``metadata commit (fresh)``: ``db.catalog.commit`` of N ``NewTensor`` rows into a new
  collection: the catalog transaction alone (no bytes; fake checksums, offsets and one
  fake segment id per commit);
* ``metadata commit (replace)``: the same, replacing all N names of an existing
  collection (closes N rows, inserts N);
* ``manifest read``: ``db.catalog.manifest(cid, version)`` of N rows;
* ``full db.commit``: for context, ``db.commit`` of N tiny tensors (bytes + metadata).

Each figure is the median and p90 of ``--reps`` runs (``--full-reps`` for db.commit),
printed beside the goals of DESIGN.md (SQLite <= 20 ms, PostgreSQL <= 50 ms for the
metadata commit). SQLite runs with ``sqlite_synchronous`` (default FULL: every commit
is fsynced); PostgreSQL in a throwaway database that is dropped at the end. The
PostgreSQL part's goals print "not measured" with the reason, and fail, if the server
does not answer (``_verdict``; the script exits 1 unless every goal is met).

``--cluster`` runs the catalog at cluster scale instead (PostgreSQL only): 1,000
simulated nodes heartbeating and registering replicas on the real node API while writer
processes commit, beside the server's durable-commit floor measured in the same run
(see ``_cluster_load``); goals: 1,000 heartbeats/s and 200 commits/s at once.

Run:  .venv/bin/python -m benchmarks.catalog [--tensors 1000] [--reps 30] [--json]
      .venv/bin/python -m benchmarks.catalog --cluster [--nodes 1000] [--duration 20] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from sqlalchemy import create_engine, text

import tensordb
from benchmarks import _perf, _verdict
from benchmarks._cluster_load import LoadPlan, run_cluster
from benchmarks._common import (
    PgUnavailable,
    remove_store,
    temp_pg_database,
    temp_pg_store,
)
from benchmarks._verdict import Verdict
from tensordb.catalog import NewTensor

GOALS_MS = {"sqlite": 20.0, "postgresql": 50.0}


def fake_rows(n: int, sid: str, tag: int) -> list[NewTensor]:
    return [NewTensor(f"model.layers.{i}.weight", "float32", (16,), 64,
                      f"{(tag * 1_000_003 + i) & (2**64 - 1):016x}", sid, i * 64)
            for i in range(n)]


def timed(fn: Callable[..., object], *args: Any, **kwargs: Any) -> float:
    """Seconds one call ``fn(*args, **kwargs)`` takes (arguments bound now, not in a
    closure over the caller's loop variables)."""
    t0 = time.perf_counter()
    fn(*args, **kwargs)
    return time.perf_counter() - t0


def bench_backend(db: tensordb.Database, n: int, reps: int, full_reps: int,
                  benches: list[Any] | None = None, backend: str = "") -> dict[str, object]:
    """Each steady-state loop's values become a pyperf benchmark (``_perf``): its median,
    p90 and spread are the figures, and ``benches`` collects them for --pyperf-json."""
    cat = db.catalog
    out: dict[str, object] = {}
    kept = [] if benches is None else benches

    def summary(op: str, values: list[float]) -> dict[str, float]:
        kept.append(_perf.benchmark(f"{backend} {op}".strip(), values))
        return _perf.summary(kept[-1])

    def meta_commit(coll: str, base: int, tag: int) -> None:
        sid = uuid.uuid4().hex
        cat.commit(coll, base, fake_rows(n, sid, tag), unchanged=[], deletes=[],
                   segment=(sid, "host", n * 64), message=f"bench {tag}")

    # warm-up: connection pool, statement caches, first-table-page allocation
    for w in range(3):
        meta_commit(f"warm-{w}", 0, w)

    # rows are built outside the timed region: only the catalog transaction counts
    fresh: list[float] = []
    for r in range(reps):
        sid = uuid.uuid4().hex
        rows = fake_rows(n, sid, r)
        fresh.append(timed(cat.commit, f"fresh-{r}", 0, rows, unchanged=[], deletes=[],
                           segment=(sid, "host", n * 64), message="fresh"))
    out["metadata commit (fresh)"] = summary("metadata commit (fresh)", fresh)

    meta_commit("replace", 0, 0)
    replace: list[float] = []
    for r in range(reps):
        sid = uuid.uuid4().hex
        rows = fake_rows(n, sid, r + 1)
        replace.append(timed(cat.commit, "replace", r + 1, rows, unchanged=[], deletes=[],
                             segment=(sid, "host", n * 64), message="replace"))
    out["metadata commit (replace)"] = summary("metadata commit (replace)", replace)

    info = cat.require("replace")
    assert len(cat.manifest(info.id, info.head)) == n
    for op, version in (("manifest read (mid-history)", info.head),
                        ("manifest read (v1)", 1)):
        cid = info.id if version == info.head else cat.require("fresh-0").id
        kept.append(_perf.time_calls(f"{backend} {op}".strip(),
                                     lambda c=cid, v=version: cat.manifest(c, v), reps))
        out[op] = _perf.summary(kept[-1])

    tiny = [{f"model.layers.{i}.weight": torch.full((16,), float(r * n + i))
             for i in range(n)} for r in range(full_reps + 1)]
    db.commit("full-warm", tiny[-1])
    full_fresh = [timed(db.commit, f"full-{r}", tiny[r]) for r in range(full_reps)]
    out["full db.commit (fresh)"] = summary("full db.commit (fresh)", full_fresh)
    db.commit("full-replace", tiny[-1])
    full_repl = [timed(db.commit, "full-replace", tiny[r]) for r in range(full_reps)]
    out["full db.commit (replace)"] = summary("full db.commit (replace)", full_repl)
    return out


def sqlite_part(args: argparse.Namespace) -> dict[str, object]:
    tmp = tempfile.mkdtemp(prefix="tensordb-bench-cat-", dir=args.tmp_dir)
    db = tensordb.connect(home=tmp, sqlite_synchronous=args.sqlite_synchronous)
    try:
        with db._engine.connect() as conn:
            level = conn.exec_driver_sql("PRAGMA synchronous").scalar()
            journal = conn.exec_driver_sql("PRAGMA journal_mode").scalar()
        names = {0: "OFF", 1: "NORMAL", 2: "FULL", 3: "EXTRA"}
        res = bench_backend(db, args.tensors, args.reps, args.full_reps, args.benches,
                            "sqlite")
        res["settings"] = {"sqlite_synchronous (config)": db.config.sqlite_synchronous,
                           "PRAGMA synchronous": names.get(level, str(level)),
                           "journal_mode": journal, "catalog": str(Path(tmp) / "catalog.db")}
        return res
    finally:
        remove_store(db)
        shutil.rmtree(tmp, ignore_errors=True)


def postgres_part(args: argparse.Namespace) -> dict[str, object]:
    try:
        with temp_pg_store(args.pg, "tensordb-bench-cat-pg-", args.tmp_dir) as (db, version):
            with db.catalog.engine.connect() as conn:
                sync = conn.execute(text("SHOW synchronous_commit")).scalar()
                fsync = conn.execute(text("SHOW fsync")).scalar()
            res = bench_backend(db, args.tensors, args.reps, args.full_reps, args.benches,
                                "postgresql")
            res["settings"] = {"server_version": version, "synchronous_commit": sync,
                               "fsync": fsync,
                               "database": db.catalog.engine.url.database}
            return res
    except PgUnavailable as exc:
        return {"skipped": str(exc)}


METADATA_OPS = ("metadata commit (fresh)", "metadata commit (replace)")


def goals(results: dict[str, dict[str, Any]]) -> list[Verdict]:
    """Each backend's metadata commits against DESIGN.md's goal; a backend that did not
    run: not measured, with the reason."""
    out = []
    for backend, res in results.items():
        for op in METADATA_OPS:
            g = GOALS_MS[backend]
            s = res.get(op)
            med = s["median_ms"] if isinstance(s, dict) else None
            out.append(_verdict.at_most(f"{backend}: {op} median <= {g:.0f} ms", med, g,
                                        "" if med is None else f"{med:.2f} ms",
                                        reason=str(res.get("skipped", "did not run"))))
    return out


def cluster_goals(res: dict[str, Any]) -> list[Verdict]:
    """The cluster load's two goals (``_cluster_load``); not measured if it did not run."""
    from benchmarks._cluster_load import GOAL_COMMITS, GOAL_HEARTBEATS

    hb = f"heartbeats/s >= {GOAL_HEARTBEATS:g} while writers commit"
    cm = f"commits/s >= {GOAL_COMMITS:g} beside the heartbeats"
    if "skipped" in res:
        return [_verdict.not_measured(hb, res["skipped"]),
                _verdict.not_measured(cm, res["skipped"])]
    g = res["goals"]
    return [_verdict.judge(hb, g["heartbeats_ok"], f"{res['heartbeats_per_s']:.1f}/s"),
            _verdict.judge(cm, g["commits_ok"], f"{res['commits_per_s']:.1f}/s")]


def print_table(results: dict[str, dict[str, object]], n: int,
                verdicts: list[Verdict]) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console(width=110)
    table = Table(title=f"catalog: {n}-tensor commits (ms per operation)")
    for col in ("backend", "operation", "median", "p90", "min", "runs", "goal"):
        table.add_column(col, justify="left" if col in ("backend", "operation") else "right")
    for backend, res in results.items():
        if "skipped" in res:
            table.add_row(backend, f"[yellow]not measured[/]: {escape(str(res['skipped']))}",
                          "", "", "", "", "[yellow]not measured[/]")
            table.add_section()
            continue
        for op, s in res.items():
            if op == "settings":
                continue
            assert isinstance(s, dict)
            goal = ""
            if op in METADATA_OPS:
                g = GOALS_MS[backend]
                goal = f"<= {g:.0f} {_verdict.judge('', s['median_ms'] <= g).mark()}"
            table.add_row(backend, op, f"{s['median_ms']:.2f}", f"{s['p90_ms']:.2f}",
                          f"{s['min_ms']:.2f}", str(s["n"]), goal)
        table.add_section()
    console.print(table)
    for backend, res in results.items():
        if "settings" in res:
            console.print(f"{backend} settings: " + ", ".join(
                f"{k}={v}" for k, v in res["settings"].items()))  # type: ignore[union-attr]
    _verdict.print_verdicts(console, verdicts)


def cluster_part(args: argparse.Namespace) -> dict[str, Any]:
    try:
        with temp_pg_database(args.pg) as (url, version):
            plan = LoadPlan(url=url, nodes=args.nodes, node_procs=args.node_procs,
                            node_conns=args.node_conns, heartbeat=args.heartbeat,
                            replica_every=args.replica_every, writer_procs=args.writer_procs,
                            writer_threads=args.writer_threads, commit_rate=args.commit_rate,
                            commit_tensors=args.commit_tensors,
                            collections=args.collections or args.writer_procs * args.writer_threads,
                            segments=args.segments, warmup=args.warmup, duration=args.duration)
            res = run_cluster(url, plan)
            engine = create_engine(url)
            with engine.connect() as conn:
                res["settings"] = {k: conn.execute(text(f"SHOW {k}")).scalar() for k in (
                    "synchronous_commit", "fsync", "wal_sync_method", "commit_delay",
                    "max_connections", "shared_buffers")}
            engine.dispose()
            res["settings"]["server_version"] = version
            return res
    except PgUnavailable as exc:
        return {"skipped": str(exc)}


def print_cluster(res: dict[str, Any]) -> None:
    from rich.console import Console

    console = Console(width=110)
    verdicts = cluster_goals(res)
    if "skipped" in res:
        _verdict.print_verdicts(console, verdicts)
        return
    plan, g = res["plan"], res["goals"]
    hb_v, cm_v = verdicts

    def lat(d: dict[str, float]) -> str:
        return f"p50 {d['p50_ms']:.2f} ms, p99 {d['p99_ms']:.2f} ms"

    console.print(f"[bold]catalog at cluster scale[/]: {plan['nodes']} nodes over "
                  f"{plan['node_procs']} processes x {plan['node_conns']} connections, beat "
                  f"every {plan['heartbeat']:g} s; {plan['writer_procs']} x "
                  f"{plan['writer_threads']} writers, {plan['commit_tensors']} tensors a commit, "
                  f"{plan['collections']} collections; {plan['duration']:g} s measured after "
                  f"{plan['warmup']:g} s")
    console.print(f"  heartbeats/s  {res['heartbeats_per_s']:8.1f} of "
                  f"{res['heartbeats_offered_per_s']:.0f} offered  (goal >= {g['heartbeats_per_s']:.0f}: "
                  f"{hb_v.mark()})   beat {lat(res['heartbeat'])}; "
                  f"late p99 {res['heartbeat_lag']['p99_ms']:.1f} ms")
    offered = res["commits_offered_per_s"]
    console.print(f"  commits/s     {res['commits_per_s']:8.1f} of "
                  f"{offered if offered else 'unlimited'} offered  (goal >= "
                  f"{g['commits_per_s']:.0f}: {cm_v.mark()})   commit {lat(res['commit'])}")
    console.print(f"  replica registrations/s {res['replica_registrations_per_s']:.1f}: "
                  f"{lat(res['replica_registration'])}")
    fb, fa = res["fsync_floor_before"], res["fsync_floor_after"]
    console.print(f"  server's durable-commit floor (1-row INSERT, synchronous_commit on): "
                  f"p50 {fb['sync_on_p50_ms']:.2f} / {fa['sync_on_p50_ms']:.2f} ms before/after, "
                  f"p99 {fb['sync_on_p99_ms']:.2f} / {fa['sync_on_p99_ms']:.2f}; "
                  f"off (round trip): p50 {fb['sync_off_p50_ms']:.2f} ms")
    nc = res["notify_ceiling_8_connections"]
    console.print(f"  8 connections committing 1-row INSERTs: {nc['plain_commits_per_s']:.0f}/s; "
                  f"with a NOTIFY inside {nc['notify_inside_commits_per_s']:.0f}/s; with it "
                  f"after the commit (as Catalog.commit) {nc['notify_after_commits_per_s']:.0f}/s")
    srv = res["server"]
    console.print(f"  server: {srv['wal_flushes_per_s']} WAL flushes/s (whole server), "
                  f"{srv['connections_max']} connections, "
                  f"{srv['active_backends_mean']} active on average; backends "
                  f"{srv['server_backend_cores']} cores, host {srv['host_cores_busy']} cores busy "
                  f"({srv['host_cpu_busy_pct']} %), clients {res['client_cores']} cores "
                  f"(nodes {res['node_client_cores']})")
    b, c = res["cpu_ms_per_beat"], res["cpu_ms_per_commit"]
    console.print(f"  CPU per beat: client {b['client']:.3f} ms + server {b['server']:.3f} ms; "
                  f"per commit: client {c['client']:.3f} ms + server {c['server']:.3f} ms")
    need = res["goal_load_needs_cores"]
    console.print(f"  at these costs the goal load needs {need['server']} server cores and "
                  f"{need['clients']} client cores (this host: {os.cpu_count()})")
    console.print("  wait events of active backends (per sample): " + ", ".join(
        f"{k} {v}" for k, v in srv["waits_per_sample"].items()))
    if res["errors"]:
        console.print(f"  [red]errors[/]: {res['errors']}")
    console.print("  settings: " + ", ".join(f"{k}={v}" for k, v in res["settings"].items()))
    _verdict.print_verdicts(console, verdicts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tensors", type=int, default=1000, help="rows per commit (1000)")
    p.add_argument("--reps", type=int, default=30, help="timed metadata commits of each kind (30)")
    p.add_argument("--full-reps", type=int, default=10, help="timed full db.commit runs (10)")
    p.add_argument("--sqlite-synchronous", default="FULL",
                   choices=["OFF", "NORMAL", "FULL", "EXTRA"])
    p.add_argument("--pg", default="postgres@127.0.0.1:5432",
                   help="PostgreSQL user@host:port; a throwaway database is created there")
    p.add_argument("--backends", default="sqlite,postgresql", help="comma-separated")
    p.add_argument("--tmp-dir", default=None, help="where the temporary stores go")
    p.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    p.add_argument("--pyperf-json", default=None, metavar="PATH",
                   help="write the steady-state loops as a pyperf suite (python -m pyperf "
                        "compare_to A.json B.json compares two runs)")
    c = p.add_argument_group("--cluster: the catalog under many nodes and writers (PostgreSQL)")
    c.add_argument("--cluster", action="store_true", help="run the cluster-scale load instead")
    c.add_argument("--nodes", type=int, default=1000, help="simulated nodes (1000)")
    c.add_argument("--node-procs", type=int, default=4, help="processes driving them (4)")
    c.add_argument("--node-conns", type=int, default=4,
                   help="threads (pooled connections) per node process (4)")
    c.add_argument("--heartbeat", type=float, default=1.0, help="seconds between beats (1)")
    c.add_argument("--replica-every", type=int, default=10,
                   help="a node records a replica every N beats (10; 0: never)")
    c.add_argument("--writer-procs", type=int, default=2, help="writer processes (2)")
    c.add_argument("--writer-threads", type=int, default=4, help="threads per writer (4)")
    c.add_argument("--commit-rate", type=float, default=200.0,
                   help="commits/s offered in all (200; 0: as fast as they go)")
    c.add_argument("--commit-tensors", type=int, default=4, help="tensors per commit (4)")
    c.add_argument("--collections", type=int, default=0,
                   help="collections the writers share (0: one per writer thread)")
    c.add_argument("--segments", type=int, default=200, help="segments nodes replicate (200)")
    c.add_argument("--warmup", type=float, default=3.0, help="seconds before measuring (3)")
    c.add_argument("--duration", type=float, default=20.0, help="seconds measured (20)")
    args = p.parse_args(argv)

    if args.cluster:
        res = cluster_part(args)
        verdicts = cluster_goals(res)
        if args.json:
            res["verdicts"] = _verdict.to_json(verdicts)
            print(json.dumps(res, indent=2, default=str))
        else:
            print_cluster(res)
        return _verdict.exit_code(verdicts)

    results: dict[str, dict[str, object]] = {}
    args.benches = []
    load_before = os.getloadavg()[0]
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    if "sqlite" in backends:
        results["sqlite"] = sqlite_part(args)
    if "postgresql" in backends:
        results["postgresql"] = postgres_part(args)
    load = (load_before, os.getloadavg()[0])
    verdicts = goals(results)
    if args.pyperf_json:
        _perf.dump(args.benches, args.pyperf_json)
    if args.json:
        print(json.dumps({"tensors": args.tensors, "reps": args.reps, "goals_ms": GOALS_MS,
                          "loadavg_before_after": load, "results": results,
                          "goals": _verdict.to_json(verdicts)}, indent=2, default=str))
    else:
        print(f"1-min load average before/after: {load[0]:.2f} / {load[1]:.2f} "
              "(other processes on the host skew the figures)")
        print_table(results, args.tensors, verdicts)
    return _verdict.exit_code(verdicts)


if __name__ == "__main__":
    sys.exit(main())
