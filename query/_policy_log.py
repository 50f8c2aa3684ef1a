"""The policy runner's side of the catalog: the ``policies`` table it reads and the
``policy_runs`` log it writes (one row per attempt), plus the short texts a run leaves.

A run's row is inserted with outcome ``running`` before the statement runs and updated to
``ok`` or ``error`` after it, so a row left ``running`` with no ``finished_at`` belongs to
a runner that died. Failing to write the log is logged and never fatal to the run: the
runner keeps scheduling whether or not its bookkeeping reaches the catalog.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from datetime import datetime, timezone
from functools import lru_cache

from sqlalchemy import Engine, insert, select, update
from sqlalchemy.exc import SQLAlchemyError

from tensordb.catalog import write_conn
from tensordb.catalog.schema import policies, policy_runs
from tensordb.errors import QueryError

__all__ = ["PolicyRun", "RunLog", "StoredPolicy", "bind_names", "describe", "now", "summary"]

log = logging.getLogger("tensordb.policies")

_DETAIL_MAX = 2000
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_VERSION_DETAIL = re.compile(r"version (\d+): ")


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


@dataclass(frozen=True, slots=True)
class StoredPolicy:
    """A row of the ``policies`` table, as the runner reads it."""

    name: str
    trigger: str
    schedule: str
    statement: str
    enabled: bool
    created_at: datetime


@lru_cache(maxsize=1024)
def bind_names(statement: str) -> frozenset[str]:
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


def summary(result: object) -> str:
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


def describe(exc: BaseException) -> str:
    """A run's error as its detail: the exception's type and message, clipped."""
    return _clip(f"{type(exc).__name__}: {exc}")


def now() -> datetime:
    return datetime.now(timezone.utc)


_POLICY_COLUMNS = (policies.c.name, policies.c.trigger, policies.c.schedule,
                   policies.c.statement, policies.c.enabled, policies.c.created_at)


class RunLog:
    """Reads the policies of one catalog and records their runs."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        # (name, trigger, schedule) of policies already reported unschedulable: a bad
        # policy is logged once, not once per sync
        self._reported: set[tuple[str, str, str]] = set()

    def policies(self) -> list[StoredPolicy]:
        """Every stored policy, by name."""
        with self._engine.connect() as conn:
            rows = conn.execute(select(*_POLICY_COLUMNS).order_by(policies.c.name)).all()
        return [StoredPolicy(*r) for r in rows]

    def policy(self, name: str) -> StoredPolicy | None:
        with self._engine.connect() as conn:
            row = conn.execute(select(*_POLICY_COLUMNS).where(policies.c.name == name)).first()
        return StoredPolicy(*row) if row else None

    def insert(self, name: str, attempt: int, started: datetime, finished: datetime | None,
               outcome: str, detail: str | None) -> int | None:
        """Record a run; its id, or None when the catalog could not take it."""
        try:
            with write_conn(self._engine) as conn:
                res = conn.execute(insert(policy_runs).values(
                    policy=name, attempt=attempt, started_at=started, finished_at=finished,
                    outcome=outcome, detail=detail))
                return int(res.inserted_primary_key[0])
        except SQLAlchemyError:
            log.exception("could not record a run of policy %r", name)
            return None

    def finish(self, run_id: int | None, name: str, attempt: int, started: datetime,
               outcome: str, detail: str) -> None:
        """Record the end of run ``run_id`` (None: its start was not recorded)."""
        if run_id is None:  # the start was not recorded: record the whole run
            self.insert(name, attempt, started, now(), outcome, detail)
            return
        try:
            with write_conn(self._engine) as conn:
                conn.execute(update(policy_runs).where(policy_runs.c.id == run_id)
                             .values(finished_at=now(), outcome=outcome, detail=detail))
        except SQLAlchemyError:
            log.exception("could not record the end of a run of policy %r", name)

    def report_unschedulable(self, p: StoredPolicy, exc: QueryError) -> None:
        """Log and record (once per schedule) that policy ``p`` cannot be scheduled."""
        key = (p.name, p.trigger, p.schedule)
        if key in self._reported:
            return
        self._reported.add(key)
        log.error("policy %r cannot be scheduled: %s", p.name, exc)
        at = now()
        self.insert(p.name, 1, at, at, "error", f"cannot schedule: {exc}")

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

    def last_version(self, p: StoredPolicy) -> int | None:
        """The version of the last finished commit-triggered run of ``p`` (made since it
        was created), from its detail ``version N: ...``; None if there is none."""
        c = policy_runs.c
        with self._engine.connect() as conn:
            detail = conn.execute(
                select(c.detail).where(c.policy == p.name, c.started_at >= p.created_at,
                                       c.finished_at.is_not(None), c.detail.like("version %"))
                .order_by(c.id.desc()).limit(1)).scalar()
        m = _VERSION_DETAIL.match(detail or "")
        return int(m.group(1)) if m else None
