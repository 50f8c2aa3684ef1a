"""Stored policies, run on a schedule or on commit: the ``PolicyRunner``.

A policy is a row of the catalog's ``policies`` table (written by ``CREATE POLICY`` and
removed by ``DROP POLICY``): a trigger, a schedule and the statement to run.

- ``EVERY '<interval>'`` (trigger ``every``): an APScheduler ``IntervalTrigger``;
  intervals read like ``'10 minutes'``, ``'2 hours 30 minutes'``, ``'500 milliseconds'``
  (see ``parse_interval``), at least 100 milliseconds.
- ``CRON '<expr>'`` (trigger ``cron``): a five-field crontab expression (or ``@hourly``,
  ``@daily``, ``@weekly``, ``@monthly``, ``@yearly``), **in UTC**. Weekdays count as in
  crontab (0 and 7 are Sunday), not as in APScheduler 3 (where 0 is Monday). When both the
  day of month and the day of week are restricted, both must match (crontab fires on
  either).
- ``ON COMMIT TO <collection>`` (trigger ``commit``): once per new version of the
  collection, in version order, whichever process committed it. The statement may use
  the bind parameters ``:collection`` and ``:version`` (the triggering version); every
  statement may use ``:policy``. Only the parameters a statement names are passed.

How a store runs its policies
-----------------------------
A long-lived process (a trainer, an engine, or ``tensordb policies run``) calls
``PolicyRunner(db).start()`` and ``stop()`` at exit; the runner is also a context
manager. ``db`` is a ``PolicyStore`` (``tensordb.Database`` is one). In cluster mode,
start one on as many hosts as should be able to take over. Any number of runners may
be started on one store: they elect a leader (a file lock beside a SQLite catalog, a
PostgreSQL session advisory lock otherwise), only the leader schedules and runs
policies, and when it stops or dies another takes over within ``poll`` seconds. Other
dialects get no lock: start one runner per store there.

The leader runs an APScheduler 3 ``BackgroundScheduler`` whose jobs live in the catalog
database (``SQLAlchemyJobStore``, table ``apscheduler_jobs``), so an interval keeps its
phase and a missed run is made once (coalesced) across restarts. Every ``poll`` seconds it
reads the policies table (``sync``): new, changed, disabled and dropped policies take
effect whichever process created or dropped them. A thread per ON COMMIT policy watches
its collection's head every ``watch_poll`` seconds.

Runs
----
Every attempt is a row of ``policy_runs``: outcome ``running`` while it runs (a row left
``running`` with no ``finished_at`` belongs to a runner that died), then ``ok`` (detail: a
short summary of the result) or ``error`` (detail: the exception). A failing run is tried
again after ``retry_delay`` seconds, up to ``max_attempts`` attempts; it is never fatal to
the scheduler or to other policies. Details of commit-triggered runs start with
``version N:``; a restarted leader resumes each ON COMMIT policy after the last version
whose run finished (a run interrupted by a dying runner is made again), and a new policy
starts after the head it saw when it was created. Runs execute in scheduler threads, so
the store is shared between threads; ``stop`` waits for runs in progress. Stop the
runner before closing its store.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import re
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from functools import lru_cache
from typing import Any, NamedTuple

from apscheduler.executors.pool import ThreadPoolExecutor
from apscheduler.jobstores.base import BaseJobStore
from apscheduler.jobstores.sqlalchemy import SQLAlchemyJobStore
from apscheduler.schedulers.background import BackgroundScheduler
from apscheduler.triggers.base import BaseTrigger
from sqlalchemy import Connection, Engine, insert, select, text, update
from sqlalchemy.exc import SQLAlchemyError

from tensordb.catalog import write_conn
from tensordb.catalog.schema import policies, policy_runs
from tensordb.errors import InvalidInput, NotFound, QueryError, TensorDBError

from ._execute import PolicyStore, execute
from ._schedule import check_schedule, parse_interval, trigger_of

__all__ = ["PolicyRunner", "PolicyRun", "parse_interval", "check_schedule", "JOB_TABLE"]

log = logging.getLogger("tensordb.policies")

#: the APScheduler job store's table in the catalog database
JOB_TABLE = "apscheduler_jobs"

_JOB_PREFIX = "policy:"
_PG_LOCK_KEY = 0x7E75D9  # advisory lock id of the policy leader (migrations use ...D8)
_DETAIL_MAX = 2000

#: runs one statement of a policy: (store, statement, its parameters) -> result
Executor = Callable[[PolicyStore, str, Mapping[str, object] | None], Any]

# -- values -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PolicyRun:
    """One attempt at running a policy (a row of ``policy_runs``)."""

    id: int
    policy: str
    attempt: int
    started_at: datetime
    finished_at: datetime | None
    outcome: str  # 'running', 'ok' or 'error'
    detail: str | None


class _Policy(NamedTuple):
    name: str
    trigger: str
    schedule: str
    statement: str
    enabled: bool
    created_at: datetime


_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@lru_cache(maxsize=1024)
def _bind_names(statement: str) -> frozenset[str]:
    """The ``:name`` parameters a statement uses (outside quotes; ``::`` is no parameter)."""
    names: set[str] = set()
    i, n, quote = 0, len(statement), ""
    while i < n:
        ch = statement[i]
        if quote:
            if ch == quote:
                if statement[i + 1 : i + 2] == quote:
                    i += 2
                    continue
                quote = ""
        elif ch in "'\"":
            quote = ch
        elif ch == ":" and statement[i + 1 : i + 2] != ":" and (i == 0 or statement[i - 1] != ":"):
            m = _IDENT.match(statement, i + 1)
            if m:
                names.add(m.group())
                i = m.end()
                continue
        i += 1
    return frozenset(names)


def _clip(s: str, limit: int = _DETAIL_MAX) -> str:
    return s if len(s) <= limit else s[: limit - 3] + "..."


def _summary(result: object) -> str:
    """A short text for a run's result: a one-row table as k=v, else its row count."""
    if result is None:
        return "done"
    n = getattr(result, "num_rows", None)
    if isinstance(n, int) and hasattr(result, "to_pylist"):
        if n == 1:
            row = result.to_pylist()[0]
            return _clip(", ".join(f"{k}={v}" for k, v in row.items()), 500)
        return f"{n} rows"
    return _clip(repr(result), 500)


def _describe(exc: BaseException) -> str:
    return _clip(f"{type(exc).__name__}: {exc}")


def _now() -> datetime:
    return datetime.now(timezone.utc)


# -- plumbing: leader lock, job store, live runners -------------------------------------------


class _Leadership:
    """Who runs a store's policies: one holder at a time, released when its process dies."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._fd: int | None = None
        self._conn: Connection | None = None
        self.held = False

    def acquire(self) -> bool:
        if self.held:
            return True
        dialect = self._engine.dialect.name
        if dialect == "sqlite":
            path = self._engine.url.database
            if path and path != ":memory:":
                fd = os.open(f"{path}.policy-lock", os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(fd)
                    return False
                self._fd = fd
        elif dialect == "postgresql":
            conn = self._engine.connect().execution_options(isolation_level="AUTOCOMMIT")
            try:
                got = conn.execute(text("SELECT pg_try_advisory_lock(:k)"),
                                   {"k": _PG_LOCK_KEY}).scalar()
            except BaseException:
                conn.invalidate()
                conn.close()
                raise
            if not got:
                conn.close()
                return False
            self._conn = conn
        self.held = True
        return True

    def alive(self) -> bool:
        """False once a PostgreSQL lock's session is gone (the lock went with it)."""
        if self._conn is None:
            return self.held
        try:
            self._conn.execute(text("SELECT 1"))
            return True
        except SQLAlchemyError:
            log.warning("lost the connection that holds the policy leader lock")
            self.release()
            return False

    def release(self) -> None:
        self.held = False
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)  # closing the last descriptor drops the flock
        if self._conn is not None:
            conn, self._conn = self._conn, None
            try:
                conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": _PG_LOCK_KEY})
            except SQLAlchemyError:
                conn.invalidate()  # a closed session holds no lock
            conn.close()


class _CatalogJobStore(SQLAlchemyJobStore):
    """APScheduler's SQLAlchemy job store on the catalog's own engine.

    On SQLite every transaction takes the write lock up front (a deferred one that reads
    and then writes can fail with SQLITE_BUSY); ``shutdown`` leaves the engine, which
    belongs to the Database, alone.
    """

    def __init__(self, engine: Engine) -> None:
        if engine.dialect.name == "sqlite":
            engine = engine.execution_options(tensordb_write=True)  # type: ignore[assignment]
        super().__init__(engine=engine, tablename=JOB_TABLE)

    def start(self, scheduler: Any, alias: str) -> None:
        BaseJobStore.start(self, scheduler, alias)
        with write_conn(self.engine) as conn:
            self.jobs_t.create(conn, checkfirst=True)

    def shutdown(self) -> None:
        pass


_LIVE: dict[str, PolicyRunner] = {}
_LIVE_LOCK = threading.Lock()


def _store_key(engine: Engine) -> str:
    u = engine.url
    ident = f"{u.get_backend_name()}://{u.host or ''}:{u.port or ''}/{u.database or ''}"
    return hashlib.blake2b(ident.encode(), digest_size=8).hexdigest()


def _fire(store: str, policy: str, spec: str = "") -> None:
    """The function of every scheduled job (the job store pickles a reference to it and
    these arguments): run ``policy`` on the leading runner of ``store`` in this process."""
    with _LIVE_LOCK:
        runner = _LIVE.get(store)
    if runner is None:
        log.info("policy %r fired with no runner for its store in this process", policy)
        return
    runner._scheduled(policy)


# -- the runner -------------------------------------------------------------------------------


class _Watcher(NamedTuple):
    spec: str
    stop: threading.Event
    thread: threading.Thread


class PolicyRunner:
    """Runs the stored policies of one store (see the module docstring).

    ``executor(db, statement, params)`` runs one statement (default ``query.execute``).
    ``retry_delay`` seconds between attempts, at most ``max_attempts`` attempts per run;
    ``poll`` seconds between reads of the policies table (and, for a standby runner,
    between attempts to become the leader); ``watch_poll`` seconds between looks at the
    heads of ON COMMIT policies' collections.
    """

    def __init__(self, db: PolicyStore, *, executor: Executor | None = None,
                 retry_delay: float = 5.0, max_attempts: int = 3, poll: float = 5.0,
                 watch_poll: float = 0.25, max_workers: int = 8) -> None:
        if not isinstance(max_attempts, int) or isinstance(max_attempts, bool) or max_attempts < 1:
            raise InvalidInput(f"max_attempts must be a positive integer, not {max_attempts!r}")
        for what, v in (("retry_delay", retry_delay), ("poll", poll), ("watch_poll", watch_poll)):
            if not isinstance(v, (int, float)) or v < 0 or (v == 0 and what != "retry_delay"):
                raise InvalidInput(f"{what} must be a positive number of seconds, not {v!r}")
        self.db = db
        self.retry_delay = float(retry_delay)
        self.max_attempts = max_attempts
        self.poll = float(poll)
        self.watch_poll = float(watch_poll)
        self._max_workers = max_workers
        self._executor: Executor = executor or execute
        self._engine: Engine = db.catalog.engine
        self._key = _store_key(self._engine)
        self._mutex = threading.RLock()
        self._running = False
        self._stopping = threading.Event()
        self._term = threading.Event()  # set while this runner does not lead
        self._term.set()
        self._lock: _Leadership | None = None
        self._scheduler: BackgroundScheduler | None = None
        self._watchers: dict[str, _Watcher] = {}
        self._thread: threading.Thread | None = None
        self._reported: set[tuple[str, str, str]] = set()

    # -- life cycle ------------------------------------------------------------------------
    def start(self) -> PolicyRunner:
        """Start: lead now if no other runner of this store does (then the policies are
        synced before this returns), else stand by. Idempotent; returns self."""
        with self._mutex:
            if self._running:
                return self
            self._stopping = threading.Event()
            self._lock = _Leadership(self._engine)
            self._running = True
            try:
                self._try_lead()
            except BaseException:
                self._running = False
                self._lock.release()
                self._lock = None
                raise
            self._thread = threading.Thread(target=self._loop, name="tensordb-policies",
                                            daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop scheduling, wait for runs in progress, hand leadership over. Idempotent."""
        with self._mutex:
            if not self._running:
                return
            self._running = False
            self._stopping.set()
            thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        with self._mutex:
            self._step_down()
            self._lock = None

    close = stop

    def __enter__(self) -> PolicyRunner:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def running(self) -> bool:
        return self._running

    @property
    def is_leader(self) -> bool:
        """Whether this runner schedules the store's policies now."""
        return self._scheduler is not None

    @property
    def scheduler(self) -> BackgroundScheduler | None:
        """The APScheduler scheduler while this runner leads, else None."""
        return self._scheduler

    def next_run_time(self, name: str) -> datetime | None:
        """When an EVERY or CRON policy fires next (None: not scheduled by this runner)."""
        sched = self._scheduler
        job = sched.get_job(_JOB_PREFIX + name) if sched is not None else None
        return job.next_run_time if job is not None else None

    def _loop(self) -> None:
        while not self._stopping.wait(self.poll):
            try:
                with self._mutex:
                    if self._stopping.is_set():
                        return
                    if self._scheduler is None:
                        self._try_lead()
                    elif self._lock is not None and not self._lock.alive():
                        self._step_down()
                    else:
                        self._sync_locked()
            except Exception:
                log.exception("the policy runner could not sync; trying again in %ss", self.poll)

    def _try_lead(self) -> None:
        assert self._lock is not None
        if not self._lock.acquire():
            return
        self._term = threading.Event()
        sched = BackgroundScheduler(
            jobstores={"default": _CatalogJobStore(self._engine)},
            executors={"default": ThreadPoolExecutor(self._max_workers)},
            job_defaults={"coalesce": True, "max_instances": 1, "misfire_grace_time": None},
            timezone=timezone.utc, daemon=True)
        with _LIVE_LOCK:
            _LIVE[self._key] = self
        self._scheduler = sched
        try:
            # paused until synced: a job of a policy dropped while no runner led is
            # removed before it can fire
            sched.start(paused=True)
            self._sync_locked()
            sched.resume()
        except BaseException:
            self._step_down()
            raise

    def _step_down(self) -> None:
        with _LIVE_LOCK:
            if _LIVE.get(self._key) is self:
                del _LIVE[self._key]
        self._term.set()
        self._stop_watchers(list(self._watchers))
        sched, self._scheduler = self._scheduler, None
        if sched is not None and sched.running:
            sched.shutdown(wait=True)
        if self._lock is not None:
            self._lock.release()

    # -- syncing with the policies table ----------------------------------------------------
    def sync(self) -> bool:
        """Bring jobs and commit watchers in line with the policies table: schedule new
        and changed policies, unschedule disabled and dropped ones. A standby runner tries
        to become the leader first. Returns whether this runner leads (and so synced).
        Idempotent; the runner calls it every ``poll`` seconds."""
        with self._mutex:
            if not self._running:
                raise InvalidInput("the policy runner is not started; call start() first")
            if self._scheduler is None:
                self._try_lead()
            else:
                self._sync_locked()
            return self._scheduler is not None

    def _sync_locked(self) -> None:
        sched = self._scheduler
        assert sched is not None
        wanted: dict[str, tuple[_Policy, BaseTrigger, str]] = {}
        watch: dict[str, tuple[_Policy, str]] = {}
        for p in self._policies():
            if not p.enabled:
                continue
            try:
                trig = trigger_of(p.trigger, p.schedule)
            except QueryError as exc:
                self._report_bad(p, exc)
                continue
            spec = f"{p.trigger}|{p.schedule}"
            if trig is None:
                watch[p.name] = (p, f"{spec}|{p.created_at.isoformat()}")
            else:
                wanted[_JOB_PREFIX + p.name] = (p, trig, spec)
        jobs = {j.id: j for j in sched.get_jobs() if j.id.startswith(_JOB_PREFIX)}
        for jid in jobs:
            if jid not in wanted:
                sched.remove_job(jid)
        for jid, (p, trig, spec) in wanted.items():
            job, args = jobs.get(jid), (self._key, p.name)
            if job is None or job.kwargs.get("spec") != spec or tuple(job.args) != args:
                sched.add_job(_fire, trigger=trig, id=jid, name=p.name, args=args,
                              kwargs={"spec": spec}, replace_existing=True)
        self._stop_watchers([n for n, w in self._watchers.items()
                             if n not in watch or watch[n][1] != w.spec])
        for name, (p, spec) in watch.items():
            if name not in self._watchers:
                stop = threading.Event()
                t = threading.Thread(target=self._watch, args=(p, stop),
                                     name=f"tensordb-policy-{name}"[:60], daemon=True)
                self._watchers[name] = _Watcher(spec, stop, t)
                t.start()

    def _stop_watchers(self, names: list[str]) -> None:
        gone = [self._watchers.pop(n) for n in names]
        for w in gone:
            w.stop.set()
        for w in gone:
            if w.thread is not threading.current_thread():
                w.thread.join()

    def _report_bad(self, p: _Policy, exc: QueryError) -> None:
        key = (p.name, p.trigger, p.schedule)
        if key in self._reported:
            return
        self._reported.add(key)
        log.error("policy %r cannot be scheduled: %s", p.name, exc)
        now = _now()
        self._insert_run(p.name, 1, now, now, "error", f"cannot schedule: {exc}")

    # -- catalog access -------------------------------------------------------------------
    def _policies(self) -> list[_Policy]:
        c = policies.c
        with self._engine.connect() as conn:
            rows = conn.execute(select(c.name, c.trigger, c.schedule, c.statement, c.enabled,
                                       c.created_at).order_by(c.name)).all()
        return [_Policy(*r) for r in rows]

    def _policy(self, name: str) -> _Policy | None:
        c = policies.c
        with self._engine.connect() as conn:
            row = conn.execute(select(c.name, c.trigger, c.schedule, c.statement, c.enabled,
                                      c.created_at).where(c.name == name)).first()
        return _Policy(*row) if row else None

    def _insert_run(self, name: str, attempt: int, started: datetime,
                    finished: datetime | None, outcome: str, detail: str | None) -> int | None:
        try:
            with write_conn(self._engine) as conn:
                res = conn.execute(insert(policy_runs).values(
                    policy=name, attempt=attempt, started_at=started, finished_at=finished,
                    outcome=outcome, detail=detail))
                return int(res.inserted_primary_key[0])  # type: ignore[index]
        except SQLAlchemyError:
            log.exception("could not record a run of policy %r", name)
            return None

    def _finish_run(self, run_id: int | None, name: str, attempt: int, started: datetime,
                    outcome: str, detail: str) -> None:
        if run_id is None:  # the start was not recorded: record the whole run
            self._insert_run(name, attempt, started, _now(), outcome, detail)
            return
        try:
            with write_conn(self._engine) as conn:
                conn.execute(update(policy_runs).where(policy_runs.c.id == run_id)
                             .values(finished_at=_now(), outcome=outcome, detail=detail))
        except SQLAlchemyError:
            log.exception("could not record the end of a run of policy %r", name)

    def runs(self, name: str | None = None, limit: int | None = 100) -> list[PolicyRun]:
        """Recorded runs (of policy ``name``, or all), newest first."""
        c = policy_runs.c
        q = select(c.id, c.policy, c.attempt, c.started_at, c.finished_at, c.outcome,
                   c.detail).order_by(c.id.desc())
        if name is not None:
            q = q.where(c.policy == name)
        if limit is not None:
            q = q.limit(int(limit))
        with self._engine.connect() as conn:
            return [PolicyRun(*r) for r in conn.execute(q)]

    # -- running --------------------------------------------------------------------------
    def _execute(self, statement: str, params: Mapping[str, object] | None) -> Any:
        return self._executor(self.db, statement, params)

    def _attempt(self, p: _Policy, attempt: int, available: Mapping[str, object],
                 prefix: str) -> Any:
        used = _bind_names(p.statement)
        params = {k: v for k, v in available.items() if k in used}
        started = _now()
        run_id = self._insert_run(p.name, attempt, started, None, "running", None)
        try:
            result = self._execute(p.statement, params or None)
        except Exception as exc:
            log.warning("policy %r failed (attempt %d): %s", p.name, attempt, _describe(exc))
            self._finish_run(run_id, p.name, attempt, started, "error", prefix + _describe(exc))
            raise
        self._finish_run(run_id, p.name, attempt, started, "ok", prefix + _summary(result))
        return result

    def _run_with_retries(self, name: str, term: threading.Event,
                          extra: Mapping[str, object], prefix: str) -> None:
        for attempt in range(1, self.max_attempts + 1):
            p = self._policy(name)
            if p is None or not p.enabled:
                return  # dropped or disabled since it was scheduled
            try:
                self._attempt(p, attempt, {"policy": name, **extra}, prefix)
                return
            except Exception:
                if attempt == self.max_attempts or term.wait(self.retry_delay):
                    return

    def _scheduled(self, name: str) -> None:
        """A job fired (in a scheduler thread): run the policy, retrying; never raises."""
        term = self._term
        if term.is_set():
            return
        try:
            self._run_with_retries(name, term, {}, "")
        except Exception:  # the catalog itself failed: log, and keep the scheduler alive
            log.exception("policy %r could not be run", name)

    def run_now(self, name: str) -> Any:
        """Run policy ``name`` once, now, in this thread (whether or not the runner is
        started or leads), record the run, and return its result or raise its error.
        An ON COMMIT policy runs with ``:version`` the collection's head."""
        p = self._policy(name)
        if p is None:
            raise NotFound(f"no policy {name!r}")
        available: dict[str, object] = {"policy": name}
        if p.trigger == "commit":
            info = self.db.catalog.info(p.schedule)
            available.update(collection=p.schedule, version=info.head if info else 0)
        return self._attempt(p, 1, available, "run now: ")

    # -- ON COMMIT --------------------------------------------------------------------------
    def _initial_cursor(self, p: _Policy) -> int:
        """The last version of the collection this policy has handled."""
        c = policy_runs.c
        with self._engine.connect() as conn:
            detail = conn.execute(
                select(c.detail).where(c.policy == p.name, c.started_at >= p.created_at,
                                       c.finished_at.is_not(None), c.detail.like("version %"))
                .order_by(c.id.desc()).limit(1)).scalar()
        m = re.match(r"version (\d+): ", detail or "")
        if m:
            return int(m.group(1))
        try:
            history = self.db.catalog.history(p.schedule)
        except NotFound:
            return 0
        return max((x.version for x in history if x.created_at <= p.created_at), default=0)

    def _watch(self, p: _Policy, stop: threading.Event) -> None:
        coll = p.schedule
        cursor: int | None = None
        while not stop.is_set():
            try:
                if cursor is None:
                    cursor = self._initial_cursor(p)
                info = self.db.catalog.info(coll)
                head = info.head if info is not None else 0
                if head < cursor:  # dropped and created again: its versions restart at 1
                    cursor = 0
                if head > cursor:
                    for commit in self.db.catalog.commits_after(coll, cursor):
                        if stop.is_set():
                            return
                        self._run_with_retries(
                            p.name, stop, {"collection": coll, "version": commit.version},
                            f"version {commit.version}: ")
                        cursor = commit.version
                    continue
            except (SQLAlchemyError, TensorDBError):
                log.exception("policy %r could not follow %r; trying again", p.name, coll)
            stop.wait(self.watch_poll)
