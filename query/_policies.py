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

import hashlib
import logging
import threading
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any

from apscheduler.schedulers.background import BackgroundScheduler
from apscheduler.triggers.base import BaseTrigger
from sqlalchemy import Engine

from tensordb.errors import InvalidInput, NotFound, QueryError

from ._commit_watch import CommitWatchers
from ._execute import PolicyStore, execute
from ._leader import JOB_TABLE, Leadership, PolicyJobs
from ._policy_log import PolicyRun, RunLog, StoredPolicy, bind_names, describe, now, summary
from ._schedule import check_schedule, parse_interval, trigger_of

__all__ = ["PolicyRunner", "PolicyRun", "parse_interval", "check_schedule", "JOB_TABLE"]

log = logging.getLogger("tensordb.policies")

#: runs one statement of a policy: (store, statement, its parameters) -> result
Executor = Callable[[PolicyStore, str, Mapping[str, object] | None], Any]

# -- the leading runner of each store in this process -----------------------------------------

_LIVE: dict[str, PolicyRunner] = {}
_LIVE_LOCK = threading.Lock()


def _store_key(engine: Engine) -> str:
    u = engine.url
    ident = f"{u.get_backend_name()}://{u.host or ''}:{u.port or ''}/{u.database or ''}"
    return hashlib.blake2b(ident.encode(), digest_size=8).hexdigest()


def _fire(store: str, policy: str, spec: str = "") -> None:
    """The function of every scheduled job (the job store pickles a reference to it and
    these arguments, so it stays here under this name): run ``policy`` on the leading
    runner of ``store`` in this process."""
    with _LIVE_LOCK:
        runner = _LIVE.get(store)
    if runner is None:
        log.info("policy %r fired with no runner for its store in this process", policy)
        return
    runner._scheduled(policy)


# -- the runner -------------------------------------------------------------------------------


class PolicyRunner:
    """Runs the stored policies of one store (see the module docstring).

    ``executor(db, statement, params)`` runs one statement (default ``query.execute``).
    ``retry_delay`` seconds between attempts, at most ``max_attempts`` attempts per run;
    ``poll`` seconds between reads of the policies table (and, for a standby runner,
    between attempts to become the leader); ``watch_poll`` seconds between looks at the
    heads of ON COMMIT policies' collections.

    The runner owns the life cycle and the runs; its collaborators do the rest: the
    leader lock (``Leadership``), the leader's APScheduler jobs (``PolicyJobs``), the ON
    COMMIT watcher threads (``CommitWatchers``) and the catalog's policies and run log
    (``RunLog``).
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
        self._log = RunLog(self._engine)
        self._watchers = CommitWatchers(db, self._log, self._run_with_retries,
                                        lambda: self.watch_poll)
        self._mutex = threading.RLock()
        self._running = False
        self._stopping = threading.Event()
        self._term = threading.Event()  # set while this runner does not lead
        self._term.set()
        self._lock: Leadership | None = None
        self._jobs: PolicyJobs | None = None  # while this runner leads
        self._thread: threading.Thread | None = None

    # -- life cycle ------------------------------------------------------------------------
    def start(self) -> PolicyRunner:
        """Start: lead now if no other runner of this store does (then the policies are
        synced before this returns), else stand by. Idempotent; returns self."""
        with self._mutex:
            if self._running:
                return self
            self._stopping = threading.Event()
            self._lock = Leadership(self._engine)
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
        return self._jobs is not None

    @property
    def scheduler(self) -> BackgroundScheduler | None:
        """The APScheduler scheduler while this runner leads, else None."""
        jobs = self._jobs
        return jobs.scheduler if jobs is not None else None

    def next_run_time(self, name: str) -> datetime | None:
        """When an EVERY or CRON policy fires next (None: not scheduled by this runner)."""
        jobs = self._jobs
        return jobs.next_run_time(name) if jobs is not None else None

    def _loop(self) -> None:
        while not self._stopping.wait(self.poll):
            try:
                with self._mutex:
                    if self._stopping.is_set():
                        return
                    if self._jobs is None:
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
        jobs = PolicyJobs(self._engine, self._key, _fire, self._max_workers)
        with _LIVE_LOCK:
            _LIVE[self._key] = self
        self._jobs = jobs
        try:
            jobs.start_paused()
            self._sync_locked()
            jobs.resume()
        except BaseException:
            self._step_down()
            raise

    def _step_down(self) -> None:
        with _LIVE_LOCK:
            if _LIVE.get(self._key) is self:
                del _LIVE[self._key]
        self._term.set()
        self._watchers.stop_all()
        jobs, self._jobs = self._jobs, None
        if jobs is not None:
            jobs.shutdown()
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
            if self._jobs is None:
                self._try_lead()
            else:
                self._sync_locked()
            return self._jobs is not None

    def _sync_locked(self) -> None:
        jobs = self._jobs
        assert jobs is not None
        wanted: dict[str, tuple[BaseTrigger, str]] = {}
        watch: dict[str, tuple[StoredPolicy, str]] = {}
        for p in self._log.policies():
            if not p.enabled:
                continue
            try:
                trig = trigger_of(p.trigger, p.schedule)
            except QueryError as exc:
                self._log.report_unschedulable(p, exc)
                continue
            spec = f"{p.trigger}|{p.schedule}"
            if trig is None:
                watch[p.name] = (p, f"{spec}|{p.created_at.isoformat()}")
            else:
                wanted[p.name] = (trig, spec)
        jobs.sync(wanted)
        self._watchers.sync(watch)

    def runs(self, name: str | None = None, limit: int | None = 100) -> list[PolicyRun]:
        """Recorded runs (of policy ``name``, or all), newest first."""
        return self._log.runs(name, limit)

    # -- running --------------------------------------------------------------------------
    def _execute(self, statement: str, params: Mapping[str, object] | None) -> Any:
        return self._executor(self.db, statement, params)

    def _attempt(self, p: StoredPolicy, attempt: int, available: Mapping[str, object],
                 prefix: str) -> Any:
        used = bind_names(p.statement)
        params = {k: v for k, v in available.items() if k in used}
        started = now()
        run_id = self._log.insert(p.name, attempt, started, None, "running", None)
        try:
            result = self._execute(p.statement, params or None)
        except Exception as exc:
            log.warning("policy %r failed (attempt %d): %s", p.name, attempt, describe(exc))
            self._log.finish(run_id, p.name, attempt, started, "error", prefix + describe(exc))
            raise
        self._log.finish(run_id, p.name, attempt, started, "ok", prefix + summary(result))
        return result

    def _run_with_retries(self, name: str, term: threading.Event,
                          extra: Mapping[str, object], prefix: str) -> None:
        for attempt in range(1, self.max_attempts + 1):
            p = self._log.policy(name)
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
        p = self._log.policy(name)
        if p is None:
            raise NotFound(f"no policy {name!r}")
        available: dict[str, object] = {"policy": name}
        if p.trigger == "commit":
            info = self.db.catalog.info(p.schedule)
            available.update(collection=p.schedule, version=info.head if info else 0)
        return self._attempt(p, 1, available, "run now: ")
