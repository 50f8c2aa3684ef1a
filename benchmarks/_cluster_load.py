"""The catalog at cluster scale (``catalog.py --cluster``): many simulated nodes beat and
register replicas on the real node API while writers commit, all on one PostgreSQL.

Processes, each spawned fresh (its own SQL engine and connection pool, as a node or a
client process is):

* node processes (``--node-procs``), each driving its share of ``--nodes`` nodes over
  ``--node-conns`` threads (one pooled connection each). Every node beats once per
  ``--heartbeat`` seconds through ``transport.NodeRegistration.beat`` (what a
  ``tensordb serve`` process runs: renew its row, mark lapsed nodes down), the beats of
  a process spread evenly over the interval; every ``--replica-every``-th beat a node
  also records a replica of one of the store's segments (``NodeDirectory.add_replica``,
  what a pull registers).
* writer processes (``--writer-procs`` x ``--writer-threads``), each thread a client
  committing ``--commit-tensors`` small tensors at a time through ``Catalog.commit``
  (metadata only: a new segment row and its tensor rows, replacing the previous ones),
  into ``--collections`` collections; the offered rate is ``--commit-rate`` commits/s
  in all (0: as fast as they go).

Both loads are open-loop: an operation due while its thread is still busy runs late,
so a catalog that cannot keep up shows as a rate below the offered one and a growing
lag, not as a shorter queue. Only operations that finish inside the measured window
(after ``--warmup`` seconds) count.

Beside the figures: the server's durable-commit floor, measured on the same server in
the same run (a loop of single-row INSERT commits with ``synchronous_commit`` on, in a
scratch table, before and after the load; with it off, the round trip alone), and what
the server was doing meanwhile (``pg_stat_activity`` sampled every 50 ms: connections,
the wait events of active backends; host CPU split between the server and the clients).
"""

from __future__ import annotations

import collections
import itertools
import multiprocessing as mp
import os
import queue
import random
import statistics
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

from sqlalchemy import create_engine, text

GOAL_HEARTBEATS = 1000.0
GOAL_COMMITS = 200.0


@dataclass(frozen=True)
class LoadPlan:
    url: str
    nodes: int
    node_procs: int
    node_conns: int
    heartbeat: float
    replica_every: int
    writer_procs: int
    writer_threads: int
    commit_rate: float
    commit_tensors: int
    collections: int
    segments: int
    warmup: float
    duration: float


# -- worker processes -------------------------------------------------------------------

def _pool_engine(url: str) -> Any:
    """The catalog's own SQL engine (``make_engine``: a pool of 4 connections, 8 more
    opened and closed under a burst), as every tensordb process makes it."""
    from tensordb.catalog import make_engine

    return make_engine(url)


def _named(url: str, app: str) -> str:
    """``url`` with an application_name, so the server's backends of each kind of process
    can be told apart."""
    return f"{url}{'&' if '?' in url else '?'}application_name={app}"


def _window(plan: LoadPlan, t0: float) -> tuple[float, float]:
    return t0 + plan.warmup, t0 + plan.warmup + plan.duration


class _WindowCpu(threading.Thread):
    """This process's CPU seconds inside the measured window [lo, hi)."""

    def __init__(self, lo: float, hi: float) -> None:
        super().__init__(daemon=True)
        self.lo, self.hi, self.seconds = lo, hi, 0.0
        self.start()

    def run(self) -> None:
        time.sleep(max(0.0, self.lo - time.time()))
        c0 = sum(os.times()[:2])
        time.sleep(max(0.0, self.hi - time.time()))
        self.seconds = sum(os.times()[:2]) - c0


def node_proc(plan: LoadPlan, index: int, names: list[str], segment_ids: list[str],
              ready: Any, start: Any, out: Any) -> None:
    """Drive ``names`` as nodes: register each, then beat on schedule until the end."""
    from tensordb.catalog import NodeDirectory
    from transport import NodeRegistration
    engine = _pool_engine(_named(plan.url, "bench-node"))
    directory = NodeDirectory(engine)
    regs = [NodeRegistration(directory, n, f"10.0.{index}.{i % 250}:{8815 + i // 250}",
                             ["disk", "host"], 1 << 36, interval=plan.heartbeat)
            for i, n in enumerate(names)]
    for r in regs:
        directory.register(r.name, r.address, r.tiers, r.capacity)
    ready.put(index)
    t0 = start.get()
    lo, hi = _window(plan, t0)
    cpu = _WindowCpu(lo, hi)
    n = len(regs)
    counter = itertools.count()
    lock = threading.Lock()
    rng = random.Random(index)
    phase = [rng.randrange(plan.replica_every) for _ in range(n)] if plan.replica_every else []
    beats: list[float] = []
    lags: list[float] = []
    replicas: list[float] = []
    errors = collections.Counter[str]()

    def run() -> None:
        local_rng = random.Random()
        while True:
            with lock:
                b = next(counter)
            due = t0 + b * plan.heartbeat / n
            if due >= hi:
                return
            wait = due - time.time()
            if wait > 0:
                time.sleep(wait)
            reg = regs[b % n]
            started = time.time()
            try:
                reg.beat()
                done = time.time()
                if lo <= done < hi:
                    beats.append(done - started)
                    lags.append(max(0.0, started - due))
                if plan.replica_every and (b // n) % plan.replica_every == phase[b % n]:
                    t = time.time()
                    directory.add_replica(local_rng.choice(segment_ids), reg.name, "host")
                    done = time.time()
                    if lo <= done < hi:
                        replicas.append(done - t)
            except Exception as exc:  # noqa: BLE001 - counted and shown
                errors[type(exc).__name__] += 1

    threads = [threading.Thread(target=run) for _ in range(plan.node_conns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    cpu.join()
    out.put({"kind": "node", "beats": beats, "lags": lags, "replicas": replicas,
             "errors": dict(errors), "cpu_s": cpu.seconds})
    engine.dispose()


def writer_proc(plan: LoadPlan, index: int, ready: Any, start: Any, out: Any) -> None:
    """``writer_threads`` clients committing small commits on schedule until the end."""
    from tensordb.catalog import Catalog, NewTensor

    engine = _pool_engine(_named(plan.url, "bench-writer"))
    catalog = Catalog(engine, f"writer-{index}")
    ready.put(index)
    t0 = start.get()
    lo, hi = _window(plan, t0)
    cpu = _WindowCpu(lo, hi)
    total_threads = plan.writer_procs * plan.writer_threads
    period = total_threads / plan.commit_rate if plan.commit_rate > 0 else 0.0
    latencies: list[float] = []
    lags: list[float] = []
    errors = collections.Counter[str]()

    def run(thread: int) -> None:
        me = index * plan.writer_threads + thread
        coll = f"job-{me % plan.collections}"
        names = [f"w{me}.layers.{j}.weight" for j in range(plan.commit_tensors)]
        info = catalog.info(coll)
        base = info.head if info else 0
        for k in itertools.count():
            due = t0 + (k + me / total_threads) * period
            now = time.time()
            if max(now, due) >= hi:
                return
            if due > now:
                time.sleep(due - now)
            sid = uuid.uuid4().hex
            puts = [NewTensor(nm, "float32", (64,), 256, f"{(k * 131 + j) & 0xFFFF:016x}",
                              sid, j * 256) for j, nm in enumerate(names)]
            started = time.time()
            try:
                base = catalog.commit(coll, base, puts, unchanged=[], deletes=[],
                                      segment=(sid, "host", 256 * len(puts)),
                                      message=None).version
                done = time.time()
                if lo <= done < hi:
                    latencies.append(done - started)
                    lags.append(max(0.0, started - due) if period else 0.0)
            except Exception as exc:  # noqa: BLE001 - counted and shown
                errors[type(exc).__name__] += 1
                got = catalog.info(coll)
                base = got.head if got else 0

    threads = [threading.Thread(target=run, args=(t,)) for t in range(plan.writer_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    cpu.join()
    out.put({"kind": "writer", "commits": latencies, "lags": lags, "errors": dict(errors),
             "cpu_s": cpu.seconds})
    engine.dispose()


# -- the server, measured in the same run --------------------------------------------

def fsync_floor(url: str, n: int = 200) -> dict[str, float]:
    """Per-commit latency of single-row INSERTs in a scratch table, each its own
    transaction, with synchronous_commit on (waits for the WAL flush: the floor of a
    durable commit) and off (the round trip alone)."""
    engine = create_engine(url, isolation_level="AUTOCOMMIT")
    out: dict[str, float] = {}
    try:
        with engine.connect() as conn:
            conn.execute(text("CREATE TABLE IF NOT EXISTS bench_fsync_probe "
                              "(id bigserial PRIMARY KEY, v integer NOT NULL)"))
            for mode in ("on", "off"):
                conn.execute(text(f"SET synchronous_commit TO {mode}"))
                ins = text("INSERT INTO bench_fsync_probe (v) VALUES (:v)")
                for i in range(10):
                    conn.execute(ins, {"v": i})
                xs = []
                for i in range(n):
                    t = time.perf_counter()
                    conn.execute(ins, {"v": i})
                    xs.append(time.perf_counter() - t)
                xs.sort()
                out[f"sync_{mode}_p50_ms"] = statistics.median(xs) * 1e3
                out[f"sync_{mode}_p99_ms"] = xs[int(0.99 * (len(xs) - 1))] * 1e3
            conn.execute(text("DROP TABLE bench_fsync_probe"))
    finally:
        engine.dispose()
    return out


def notify_ceiling(url: str, threads: int = 8, seconds: float = 2.0) -> dict[str, float]:
    """Commits/s of ``threads`` connections each committing single-row INSERTs into a
    scratch table as fast as they go: plain; with a NOTIFY inside the transaction (the
    server serialises every notifying commit, its WAL flush included, under one lock);
    and with the NOTIFY sent after the commit in a transaction that waits for no flush
    (what ``Catalog.commit`` does)."""
    import psycopg

    dsn = url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute("CREATE TABLE IF NOT EXISTS bench_notify_probe "
                  "(id bigserial PRIMARY KEY, v integer NOT NULL)")
    out: dict[str, float] = {}
    for mode in ("plain", "notify_inside", "notify_after"):
        stop = time.time() + seconds
        counts = [0] * threads

        def run(i: int, mode: str = mode, stop: float = stop, counts: list[int] = counts
                ) -> None:
            with psycopg.connect(dsn) as c:
                while time.time() < stop:
                    c.execute("INSERT INTO bench_notify_probe (v) VALUES (%s)", (i,))
                    if mode == "notify_inside":
                        c.execute("SELECT pg_notify('bench_probe', 'x')")
                    c.commit()
                    if mode == "notify_after":
                        c.execute("SELECT set_config('synchronous_commit', 'off', true), "
                                  "pg_notify('bench_probe', 'x')")
                        c.commit()
                    counts[i] += 1

        ts = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        out[f"{mode}_commits_per_s"] = round(sum(counts) / seconds, 1)
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute("DROP TABLE bench_notify_probe")
    return out


def _proc_cpu(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def _host_cpu() -> tuple[float, float]:
    """(busy, total) jiffies of the whole host."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    idle = v[3] + v[4]
    return sum(v) - idle, sum(v)


def _wal(conn: Any) -> tuple[int, float]:
    """(WAL flushes, milliseconds spent in them) of the whole server so far (PostgreSQL
    14+; the time only with track_wal_io_timing)."""
    try:
        row = conn.execute(text("SELECT wal_sync, wal_sync_time FROM pg_stat_wal")).one()
        return int(row[0]), float(row[1])
    except Exception:  # noqa: BLE001 - an older server: no figure
        return 0, 0.0


class ServerSampler(threading.Thread):
    """Samples the server every 50 ms inside the measured window: our database's
    connections and the wait events of its active backends; the CPU of its backends
    (by pid, from /proc when the server is on this host)."""

    def __init__(self, url: str, lo: float, hi: float) -> None:
        super().__init__(daemon=True)
        self.engine = create_engine(url, isolation_level="AUTOCOMMIT", pool_size=1)
        self.lo, self.hi = lo, hi
        self.samples = 0
        self.conns: list[int] = []
        self.active: list[int] = []
        self.waits = collections.Counter[str]()
        self._prev: dict[int, float] = {}
        #: CPU seconds each backend (by pid) spent while sampled, and its application
        self.cpu_s: dict[int, float] = {}
        self.apps: dict[int, str] = {}
        self.host0 = self.host1 = (0.0, 0.0)
        self.wal0 = self.wal1 = (0, 0.0)

    def run(self) -> None:
        q = text("SELECT pid, state, wait_event_type, wait_event, application_name "
                 "FROM pg_stat_activity WHERE datname = current_database() "
                 "AND pid <> pg_backend_pid()")
        with self.engine.connect() as conn:
            while time.time() < self.lo:
                time.sleep(0.01)
            self.host0 = _host_cpu()
            self.wal0 = _wal(conn)
            while time.time() < self.hi:
                rows = conn.execute(q).all()
                for r in rows:  # a backend that appears later counts from then on
                    cpu = _proc_cpu(r[0])
                    prev = self._prev.get(r[0])
                    if prev is None:
                        self.apps[r[0]] = r[4] or ""
                    elif cpu >= prev:
                        self.cpu_s[r[0]] = self.cpu_s.get(r[0], 0.0) + cpu - prev
                    else:  # the pid is a new backend's
                        self.cpu_s[r[0]] = self.cpu_s.get(r[0], 0.0) + cpu
                    self._prev[r[0]] = cpu
                self.samples += 1
                self.conns.append(len(rows))
                act = [r for r in rows if r[1] == "active"]
                self.active.append(len(act))
                for r in act:
                    self.waits[f"{r[2]}:{r[3]}" if r[2] else "CPU (no wait event)"] += 1
                time.sleep(0.05)
            self.host1 = _host_cpu()
            self.wal1 = _wal(conn)
        self.engine.dispose()

    def report(self, seconds: float) -> dict[str, Any]:
        ticks = os.sysconf("SC_CLK_TCK")
        busy = self.host1[0] - self.host0[0]
        total = self.host1[1] - self.host0[1]
        by_app = collections.Counter[str]()
        for p, c in self.cpu_s.items():
            by_app[self.apps.get(p, "")] += c
        backends = sum(by_app.values())
        n = max(1, self.samples)
        waits = {k: round(v / n, 2) for k, v in self.waits.most_common(8)}
        return {
            "samples": self.samples,
            "connections_max": max(self.conns, default=0),
            "active_backends_mean": round(sum(self.active) / n, 2),
            "waits_per_sample": waits,
            "host_cpu_busy_pct": round(100.0 * busy / total, 1) if total else None,
            "host_cores_busy": round(busy / ticks / seconds, 2) if seconds else None,
            "server_backend_cores": round(backends / seconds, 2) if seconds else None,
            "wal_flushes_per_s": round((self.wal1[0] - self.wal0[0]) / seconds, 1)
            if seconds else None,
            "server_cpu_s_by_app": {k: round(v, 3) for k, v in by_app.items()},
        }


# -- the run ----------------------------------------------------------------------------

def _seed(url: str, plan: LoadPlan) -> list[str]:
    """A store with ``plan.segments`` committed segments (the ones nodes replicate)."""
    from tensordb.catalog import Catalog, NewTensor, ensure_schema, make_engine

    engine = make_engine(url)
    ensure_schema(engine)
    cat = Catalog(engine, "seed-node")
    ids = []
    for i in range(plan.segments):
        sid = uuid.uuid4().hex
        cat.commit(f"seed-{i % 8}", cat.info(f"seed-{i % 8}").head if i >= 8 else 0,
                   [NewTensor(f"seed.{i}", "float32", (64,), 256, f"{i:016x}", sid, 0)],
                   unchanged=[], deletes=[], segment=(sid, "host", 256), message=None)
        ids.append(sid)
    engine.dispose()
    return ids


def _lat(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {"p50_ms": float("nan"), "p99_ms": float("nan"), "n": 0}
    s = sorted(xs)
    return {"p50_ms": statistics.median(s) * 1e3, "p99_ms": s[int(0.99 * (len(s) - 1))] * 1e3,
            "n": len(s)}


def _per_op(client_cpu: float, sampler: ServerSampler, app: str, ops: int
            ) -> dict[str, float]:
    """CPU milliseconds an operation costs the client process and the server backend
    (its replica registrations included for a beat): a figure other load on the host
    does not move, unlike the rates."""
    server = sum(c for p, c in sampler.cpu_s.items() if sampler.apps.get(p) == app)
    n = max(1, ops)
    return {"client": round(client_cpu / n * 1e3, 3), "server": round(server / n * 1e3, 3)}


def _needs(node_cpu: float, writer_cpu: float, sampler: ServerSampler, beats: int,
           commits: int) -> dict[str, float]:
    b = _per_op(node_cpu, sampler, "bench-node", beats)
    c = _per_op(writer_cpu, sampler, "bench-writer", commits)
    return {"server": round((GOAL_HEARTBEATS * b["server"] + GOAL_COMMITS * c["server"]) / 1e3, 2),
            "clients": round((GOAL_HEARTBEATS * b["client"] + GOAL_COMMITS * c["client"]) / 1e3,
                             2)}


def _kept_up(achieved: float, offered: float, lags: list[float], interval: float,
             goal: float) -> bool:
    """Whether a load of at least ``goal`` per second was offered and carried: the
    achieved rate within 1 % of the offered one, and (for beats) 99 % of them run less
    than one interval late."""
    late = bool(lags) and sorted(lags)[int(0.99 * (len(lags) - 1))] >= interval
    return offered >= goal and achieved >= 0.99 * offered and not late


def run_cluster(url: str, plan: LoadPlan) -> dict[str, Any]:
    segment_ids = _seed(url, plan)
    floor_before = fsync_floor(url)
    ctx = mp.get_context("spawn")
    ready, out = ctx.Queue(), ctx.Queue()
    starts = []
    procs = []
    names = [f"node-{i:05d}" for i in range(plan.nodes)]
    for p in range(plan.node_procs):
        q = ctx.Queue()
        starts.append(q)
        procs.append(ctx.Process(target=node_proc, args=(
            plan, p, names[p::plan.node_procs], segment_ids, ready, q, out)))
    for w in range(plan.writer_procs):
        q = ctx.Queue()
        starts.append(q)
        procs.append(ctx.Process(target=writer_proc, args=(plan, w, ready, q, out)))
    for p in procs:
        p.start()
    waiting = len(procs)
    deadline = time.time() + 300
    while waiting:
        try:
            ready.get(timeout=1)
            waiting -= 1
        except queue.Empty:
            dead = [p for p in procs if p.exitcode is not None]
            if dead or time.time() > deadline:
                for p in procs:
                    p.kill()
                raise RuntimeError(f"a load process failed to start (exit codes "
                                   f"{[p.exitcode for p in procs]})") from None
    t0 = time.time() + 0.5
    lo, hi = _window(plan, t0)
    sampler = ServerSampler(url, lo, hi)
    sampler.start()
    for q in starts:
        q.put(t0)
    results = [out.get(timeout=plan.warmup + plan.duration + 600) for _ in procs]
    for p in procs:
        p.join()
    sampler.join()
    floor_after = fsync_floor(url)
    ceiling = notify_ceiling(url)

    beats = [x for r in results if r["kind"] == "node" for x in r["beats"]]
    beat_lags = [x for r in results if r["kind"] == "node" for x in r["lags"]]
    reps = [x for r in results if r["kind"] == "node" for x in r["replicas"]]
    commits = [x for r in results if r["kind"] == "writer" for x in r["commits"]]
    errors: collections.Counter[str] = collections.Counter()
    for r in results:
        errors.update(r["errors"])
    client_cpu = sum(r["cpu_s"] for r in results)
    node_cpu = sum(r["cpu_s"] for r in results if r["kind"] == "node")
    hb_rate = len(beats) / plan.duration
    commit_rate = len(commits) / plan.duration
    offered_commits = plan.commit_rate or None
    return {
        "plan": {k: v for k, v in plan.__dict__.items() if k != "url"},
        "heartbeats_per_s": round(hb_rate, 1),
        "heartbeats_offered_per_s": round(plan.nodes / plan.heartbeat, 1),
        "heartbeat": _lat(beats),
        "heartbeat_lag": _lat(beat_lags),
        "replica_registrations_per_s": round(len(reps) / plan.duration, 1),
        "replica_registration": _lat(reps),
        "commits_per_s": round(commit_rate, 1),
        "commits_offered_per_s": offered_commits,
        "commit": _lat(commits),
        "errors": dict(errors),
        "fsync_floor_before": floor_before,
        "fsync_floor_after": floor_after,
        "notify_ceiling_8_connections": ceiling,
        "server": sampler.report(plan.duration),
        "client_cores": round(client_cpu / plan.duration, 2),
        "cpu_ms_per_beat": _per_op(node_cpu, sampler, "bench-node", len(beats)),
        "cpu_ms_per_commit": _per_op(client_cpu - node_cpu, sampler, "bench-writer",
                                     len(commits)),
        "node_client_cores": round(node_cpu / plan.duration, 2),
        # what the goal load would need at these per-operation costs: the server's share
        # is what a real deployment's PostgreSQL host carries (clients are on their hosts)
        "goal_load_needs_cores": _needs(node_cpu, client_cpu - node_cpu, sampler, len(beats),
                                        len(commits)),
        "goals": {
            "heartbeats_per_s": GOAL_HEARTBEATS, "commits_per_s": GOAL_COMMITS,
            "heartbeats_ok": _kept_up(hb_rate, plan.nodes / plan.heartbeat, beat_lags,
                                      plan.heartbeat, GOAL_HEARTBEATS),
            "commits_ok": _kept_up(commit_rate, plan.commit_rate or commit_rate, [],
                                   0.0, GOAL_COMMITS),
        },
    }
