"""What the leading policy runner of a store holds: the leader lock and the APScheduler
jobs of its EVERY and CRON policies.

The lock is a file lock beside a SQLite catalog or a PostgreSQL session advisory lock;
both go with the process that holds them, so a dead leader's successor takes over
without any cleanup. Other dialects get no lock (one runner per store there).

The jobs live in the catalog database (``SQLAlchemyJobStore``, table ``apscheduler_jobs``),
so an interval keeps its phase and a missed run is made once (coalesced) across restarts.
The job store pickles a reference to each job's function; that function is the runner
module's and is handed in here, so its name in stored jobs does not move.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from datetime import datetime, timezone
from typing import Any

from apscheduler.executors.pool import ThreadPoolExecutor
from apscheduler.jobstores.base import BaseJobStore
from apscheduler.jobstores.sqlalchemy import SQLAlchemyJobStore
from apscheduler.schedulers.background import BackgroundScheduler
from apscheduler.triggers.base import BaseTrigger
from sqlalchemy import Connection, Engine, text
from sqlalchemy.exc import SQLAlchemyError

import storage_engine as se
from tensordb.catalog import write_conn

__all__ = ["JOB_TABLE", "CatalogJobStore", "Leadership", "PolicyJobs"]

log = logging.getLogger("tensordb.policies")

#: the APScheduler job store's table in the catalog database
JOB_TABLE = "apscheduler_jobs"

_JOB_PREFIX = "policy:"
_PG_LOCK_KEY = 0x7E75D9  # advisory lock id of the policy leader (migrations use ...D8)

#: the function of every job: (store key, policy name, spec=...) -> None
JobFunction = Callable[..., None]


class Leadership:
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
                fd = se.try_lock_file(f"{path}.policy-lock")
                if fd is None:
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


class CatalogJobStore(SQLAlchemyJobStore):
    """APScheduler's SQLAlchemy job store on the catalog's own engine.

    On SQLite every transaction takes the write lock up front (a deferred one that reads
    and then writes can fail with SQLITE_BUSY); ``shutdown`` leaves the engine, which
    belongs to the Database, alone.
    """

    def __init__(self, engine: Engine) -> None:
        if engine.dialect.name == "sqlite":
            engine = engine.execution_options(tensordb_write=True)
        super().__init__(engine=engine, tablename=JOB_TABLE)

    def start(self, scheduler: Any, alias: str) -> None:
        BaseJobStore.start(self, scheduler, alias)
        with write_conn(self.engine) as conn:
            self.jobs_t.create(conn, checkfirst=True)

    def shutdown(self) -> None:
        pass


class PolicyJobs:
    """The leader's scheduler: one job per EVERY or CRON policy, firing ``fire(store,
    policy, spec=...)`` in one of ``max_workers`` threads."""

    def __init__(self, engine: Engine, store: str, fire: JobFunction, max_workers: int) -> None:
        self._store = store
        self._fire = fire
        self.scheduler = BackgroundScheduler(
            jobstores={"default": CatalogJobStore(engine)},
            executors={"default": ThreadPoolExecutor(max_workers)},
            job_defaults={"coalesce": True, "max_instances": 1, "misfire_grace_time": None},
            timezone=timezone.utc, daemon=True)

    def start_paused(self) -> None:
        # paused until synced: a job of a policy dropped while no runner led is removed
        # before it can fire
        self.scheduler.start(paused=True)

    def resume(self) -> None:
        self.scheduler.resume()

    def sync(self, wanted: Mapping[str, tuple[BaseTrigger, str]]) -> None:
        """Make the jobs those of ``wanted`` (policy name -> its trigger and its spec,
        ``trigger|schedule``): remove the others, add or replace changed ones."""
        sched = self.scheduler
        jobs = {j.id: j for j in sched.get_jobs() if j.id.startswith(_JOB_PREFIX)}
        for jid in jobs:
            if jid[len(_JOB_PREFIX):] not in wanted:
                sched.remove_job(jid)
        for name, (trig, spec) in wanted.items():
            jid = _JOB_PREFIX + name
            job, args = jobs.get(jid), (self._store, name)
            if job is None or job.kwargs.get("spec") != spec or tuple(job.args) != args:
                sched.add_job(self._fire, trigger=trig, id=jid, name=name, args=args,
                              kwargs={"spec": spec}, replace_existing=True)

    def next_run_time(self, name: str) -> datetime | None:
        job = self.scheduler.get_job(_JOB_PREFIX + name)
        return job.next_run_time if job is not None else None

    def shutdown(self) -> None:
        """Stop the scheduler, waiting for the runs in progress."""
        if self.scheduler.running:
            self.scheduler.shutdown(wait=True)
