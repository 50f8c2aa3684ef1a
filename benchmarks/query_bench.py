"""Query benchmark: a filtered aggregate through ``db.query`` beside the same query in
SQLAlchemy Core, over a catalog of 100,000 tensor rows, on SQLite and PostgreSQL.

The catalog is filled with metadata only: ``db.catalog.commit`` of ``NewTensor`` rows in
chunks of 10,000 (fake checksums and segment ids, no bytes), spread over ``--collections``
collections with a mix of dtypes and sizes. Then, alternating, ``--reps`` runs each of

* ``db.query``: ``SELECT dtype, count(*), sum(nbytes) FROM tensors WHERE collection = 'c3'
  AND nbytes > 1000 GROUP BY dtype`` -> a pyarrow.Table (parse and plan cached by text);
* ``direct``: the same query built once with SQLAlchemy Core (tensors JOIN collections,
  head rows, the two filters, GROUP BY dtype), executed on the same engine, rows fetched;
* ``db.query, cold``: ``db.query`` with the parse and plan caches cleared before each run
  (for context: what a statement costs the first time).

Each figure is the median (and p90) in milliseconds; the ratio db.query / direct is
printed beside the goal (<= 1.2 x). The results of the two are checked to be equal.
PostgreSQL runs in a throwaway database, dropped at the end; if the server does not
answer, or a backend is left out of ``--backends``, its goal prints "not measured" with
the reason and fails (exit 1), as a missed one does.

Run:  .venv/bin/python -m benchmarks.query_bench [--rows 100000] [--reps 50] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from typing import Any

from sqlalchemy import func, select, text

import tensordb
from benchmarks import _verdict
from benchmarks._common import PgUnavailable, summary, temp_pg_store
from benchmarks._verdict import Verdict
from query import _execute, _parser, _plan
from tensordb.catalog import NewTensor
from tensordb.catalog.schema import collections, tensors

GOAL_RATIO = 1.2
CHUNK = 10_000
DTYPES = (("float32", 4), ("bfloat16", 2), ("float16", 2), ("int64", 8))
STATEMENT = ("SELECT dtype, count(*), sum(nbytes) FROM tensors WHERE collection = 'c3' "
             "AND nbytes > 1000 GROUP BY dtype")


def fill(db: tensordb.Database, rows: int, n_collections: int) -> None:
    """``rows`` head rows over ``n_collections`` collections, ``CHUNK`` rows a commit."""
    per = rows // n_collections
    k = 0
    for c in range(n_collections):
        done = 0
        while done < per:
            n = min(CHUNK, per - done)
            sid = uuid.uuid4().hex
            puts = []
            for i in range(done, done + n):
                dtype, size = DTYPES[(i * 7 + c) % len(DTYPES)]
                elems = (i * 2654435761 + c) % 4096  # 0 .. 4095 elements: some <= 1000 bytes
                puts.append(NewTensor(f"layers.{i}.weight", dtype, (elems,), elems * size,
                                      f"{(k * 1_000_003 + i) & (2**64 - 1):016x}", sid, 0))
            info = db.catalog.info(f"c{c}")
            db.catalog.commit(f"c{c}", info.head if info else 0, puts, unchanged=[],
                              deletes=[], segment=(sid, "host", 0), message=f"chunk {k}")
            done += n
            k += 1


def direct_query() -> Any:
    t, c = tensors.c, collections.c
    return (select(t.dtype, func.count(), func.sum(t.nbytes))
            .select_from(tensors.join(collections, c.id == t.collection_id))
            .where(t.end_version.is_(None), c.name == "c3", t.nbytes > 1000)
            .group_by(t.dtype))


def clear_caches() -> None:
    _parser._parse_one.cache_clear()
    _plan.plan_select.cache_clear()
    _execute._prepared.cache_clear()


def bench(db: tensordb.Database, reps: int) -> dict[str, Any]:
    engine = db.catalog.engine
    stmt = direct_query()

    def ours() -> Any:
        return db.query(STATEMENT)

    def direct() -> Any:
        with engine.connect() as conn:
            return conn.execute(stmt).all()

    def cold() -> Any:
        clear_caches()
        return db.query(STATEMENT)

    got = sorted(tuple(r.values()) for r in ours().to_pylist())
    want = sorted(tuple(int(v) if not isinstance(v, str) else v for v in r) for r in direct())
    assert got == want, (got, want)
    runs: dict[str, list[float]] = {"db.query": [], "direct": [], "db.query, cold": []}
    fns: dict[str, Callable[[], Any]] = {"db.query": ours, "direct": direct,
                                         "db.query, cold": cold}
    for _ in range(3):  # warm-up: pool connections, SQLAlchemy's statement cache, pages
        for fn in fns.values():
            fn()
    for _ in range(reps):  # interleaved, so that drift in the host hits all alike
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            runs[name].append(time.perf_counter() - t0)
    out: dict[str, Any] = {name: summary(xs) for name, xs in runs.items()}
    ratio = statistics.median(runs["db.query"]) / statistics.median(runs["direct"])
    out["ratio"] = ratio
    out["groups"] = len(got)
    with engine.connect() as conn:
        out["tensor rows"] = conn.execute(select(func.count()).select_from(tensors)).scalar()
    return out


def sqlite_part(args: argparse.Namespace) -> dict[str, Any]:
    tmp = tempfile.mkdtemp(prefix="tensordb-bench-query-", dir=args.tmp_dir)
    db = tensordb.connect(home=tmp)
    try:
        t0 = time.perf_counter()
        fill(db, args.rows, args.collections)
        fill_s = time.perf_counter() - t0
        res = bench(db, args.reps)
        res["fill_s"] = fill_s
        return res
    finally:
        db.close()
        shutil.rmtree(db.config.shm_dir, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)


def postgres_part(args: argparse.Namespace) -> dict[str, Any]:
    try:
        with temp_pg_store(args.pg, "tensordb-bench-query-pg-", args.tmp_dir) as (db, _):
            t0 = time.perf_counter()
            fill(db, args.rows, args.collections)
            with db.catalog.engine.connect() as conn:  # fresh statistics, as autovacuum would
                conn.execute(text("ANALYZE"))
                conn.commit()
            fill_s = time.perf_counter() - t0
            res = bench(db, args.reps)
            res["fill_s"] = fill_s
            return res
    except PgUnavailable as exc:
        return {"skipped": str(exc)}


BACKENDS: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
    "sqlite": sqlite_part, "postgresql": postgres_part}


def goals(results: dict[str, dict[str, Any]]) -> list[Verdict]:
    """db.query <= GOAL_RATIO x direct on each backend asked for; a backend that did
    not run is not measured (failed), with the reason."""
    out = []
    for backend, res in results.items():
        goal = f"{backend}: db.query <= {GOAL_RATIO} x direct"
        ratio = res.get("ratio")
        out.append(_verdict.at_most(goal, ratio, GOAL_RATIO,
                                    "" if ratio is None else f"{ratio:.2f} x",
                                    reason=str(res.get("skipped", "did not run"))))
    return out


def print_table(results: dict[str, dict[str, Any]], rows: int, load: tuple[float, float],
                verdicts: list[Verdict]) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console(width=110)
    table = Table(title=f"query: filtered aggregate over {rows:,} tensor rows (ms per query)")
    for col in ("backend", "path", "median", "p90", "min", "runs", "ratio", "goal"):
        table.add_column(col, justify="left" if col in ("backend", "path") else "right")
    for backend, res in results.items():
        if "skipped" in res:
            table.add_row(backend, f"[yellow]not measured[/]: {escape(res['skipped'])}",
                          "", "", "", "", "", "[yellow]not measured[/]")
            table.add_section()
            continue
        for path in ("db.query", "direct", "db.query, cold"):
            s = res[path]
            ratio = goal = ""
            if path == "db.query":
                ratio = f"{res['ratio']:.2f} x"
                mark = _verdict.judge("", res["ratio"] <= GOAL_RATIO).mark()
                goal = f"<= {GOAL_RATIO} x {mark}"
            table.add_row(backend, path, f"{s['median_ms']:.3f}", f"{s['p90_ms']:.3f}",
                          f"{s['min_ms']:.3f}", str(s["n"]), ratio, goal)
        table.add_section()
    console.print(table)
    console.print(f"statement: {STATEMENT}", markup=False)
    for backend, res in results.items():
        if "skipped" not in res:
            console.print(f"{backend}: {res['tensor rows']:,} tensor rows, {res['groups']} "
                          f"groups, catalog filled in {res['fill_s']:.1f} s")
    console.print(f"1-min load average before/after: {load[0]:.2f} / {load[1]:.2f} "
                  "(other processes on the host skew the figures)")
    _verdict.print_verdicts(console, verdicts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=100_000, help="tensor rows (100000)")
    p.add_argument("--collections", type=int, default=10, help="collections c0.. (10)")
    p.add_argument("--reps", type=int, default=100, help="timed runs of each path (100)")
    p.add_argument("--pg", default="postgres@127.0.0.1:5432",
                   help="PostgreSQL user@host:port; a throwaway database is created there")
    p.add_argument("--backends", default="sqlite,postgresql", help="comma-separated")
    p.add_argument("--tmp-dir", default=None, help="where the temporary stores go")
    p.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    args = p.parse_args(argv)
    if args.collections < 4:
        p.error("--collections must be at least 4 (the statement reads c3)")

    results: dict[str, dict[str, Any]] = {}
    load_before = os.getloadavg()[0]
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = set(backends) - set(BACKENDS)
    if unknown:
        p.error(f"unknown backends {sorted(unknown)}; known: {','.join(BACKENDS)}")
    for backend, part in BACKENDS.items():  # one left out is listed, not measured
        results[backend] = (part(args) if backend in backends
                            else {"skipped": "not asked for (--backends)"})
    load = (load_before, os.getloadavg()[0])
    verdicts = goals(results)
    if args.json:
        print(json.dumps({"rows": args.rows, "reps": args.reps, "statement": STATEMENT,
                          "goal_ratio": GOAL_RATIO, "loadavg_before_after": load,
                          "results": results, "goals": _verdict.to_json(verdicts)},
                         indent=2, default=str))
    else:
        print_table(results, args.rows, load, verdicts)
    return _verdict.exit_code(verdicts)


if __name__ == "__main__":
    sys.exit(main())
