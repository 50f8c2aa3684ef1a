"""ON COMMIT policies: a thread per policy follows its collection's head and runs the
policy once per new version, in version order, whichever process committed it.

Where a watcher starts: after the version of the policy's last finished commit-triggered
run (its detail starts ``version N:``), so a restarted leader makes an interrupted run
again and skips none; a policy that never ran starts after the head it saw when it was
created. A collection dropped and created again restarts its versions at 1, and so does
the watcher.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from sqlalchemy.exc import SQLAlchemyError

from tensordb.errors import NotFound, TensorDBError

from ._execute import PolicyStore
from ._policy_log import RunLog, StoredPolicy

__all__ = ["CommitWatchers", "RunPolicy"]

log = logging.getLogger("tensordb.policies")

#: runs a policy with retries: (name, event that ends it, parameters, detail prefix)
RunPolicy = Callable[[str, threading.Event, Mapping[str, object], str], None]


@dataclass(frozen=True, slots=True)
class _Watcher:
    spec: str  # trigger|schedule|created_at: a policy created again gets a new watcher
    stop: threading.Event
    thread: threading.Thread


class CommitWatchers:
    """The watcher threads of a leading runner, one per enabled ON COMMIT policy; each
    looks at its collection's head every ``poll()`` seconds (read at each look)."""

    def __init__(self, db: PolicyStore, runs: RunLog, run: RunPolicy,
                 poll: Callable[[], float]) -> None:
        self._db = db
        self._runs = runs
        self._run = run
        self._poll = poll
        self._watchers: dict[str, _Watcher] = {}

    def sync(self, wanted: Mapping[str, tuple[StoredPolicy, str]]) -> None:
        """Watch exactly the policies of ``wanted`` (name -> policy and its spec): stop
        the watchers of the others and of changed ones, start the missing ones."""
        self.stop([n for n, w in self._watchers.items()
                   if n not in wanted or wanted[n][1] != w.spec])
        for name, (p, spec) in wanted.items():
            if name not in self._watchers:
                stop = threading.Event()
                t = threading.Thread(target=self._watch, args=(p, stop),
                                     name=f"tensordb-policy-{name}"[:60], daemon=True)
                self._watchers[name] = _Watcher(spec, stop, t)
                t.start()

    def stop(self, names: list[str]) -> None:
        """Stop the watchers of ``names`` and wait for their runs in progress."""
        gone = [self._watchers.pop(n) for n in names]
        for w in gone:
            w.stop.set()
        for w in gone:
            if w.thread is not threading.current_thread():
                w.thread.join()

    def stop_all(self) -> None:
        self.stop(list(self._watchers))

    def _initial_cursor(self, p: StoredPolicy) -> int:
        """The last version of the collection this policy has handled."""
        done = self._runs.last_version(p)
        if done is not None:
            return done
        try:
            history = self._db.catalog.history(p.schedule)
        except NotFound:
            return 0
        return max((x.version for x in history if x.created_at <= p.created_at), default=0)

    def _watch(self, p: StoredPolicy, stop: threading.Event) -> None:
        coll = p.schedule
        cursor: int | None = None
        while not stop.is_set():
            try:
                if cursor is None:
                    cursor = self._initial_cursor(p)
                info = self._db.catalog.info(coll)
                head = info.head if info is not None else 0
                if head < cursor:  # dropped and created again: its versions restart at 1
                    cursor = 0
                if head > cursor:
                    for commit in self._db.catalog.commits_after(coll, cursor):
                        if stop.is_set():
                            return
                        self._run(p.name, stop, {"collection": coll, "version": commit.version},
                                  f"version {commit.version}: ")
                        cursor = commit.version
                    continue
            except (SQLAlchemyError, TensorDBError):
                log.exception("policy %r could not follow %r; trying again", p.name, coll)
            stop.wait(self._poll())  # read each time: the runner's watch_poll may change
