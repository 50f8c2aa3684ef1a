"""Retrying catalog calls across lost connections.

A cluster's catalog is a PostgreSQL server that may restart, fail over, or have its
backends terminated (``pg_terminate_backend``) while clients work. Each ``Catalog``
method is one SQL transaction, so a call whose connection died rolled back as a whole
and can run again, with one exception: a COMMIT whose answer was lost may have landed.
``Catalog.commit`` therefore tags each commit with an id of its own and, on a retry,
first looks for that id (see ``_versions.Versions.commit``): a commit lands once.

Only transient errors are retried: a dropped or refused connection, an administrator
shutdown, a serialization failure. A constraint violation or a bad statement is a bug
or a conflict, never retried. After ``RETRY_SECONDS`` without success the caller gets
``NodeUnavailable`` naming the catalog, not a driver exception.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, TypeVar

import tenacity
from sqlalchemy import Connection
from sqlalchemy.exc import DBAPIError, OperationalError

from ..errors import NodeUnavailable

__all__ = ["RETRY_SECONDS", "is_transient", "retry_call", "retrying"]

log = logging.getLogger("tensordb.catalog")

#: how long a catalog call keeps retrying a lost catalog before giving up
RETRY_SECONDS = 30.0

# PostgreSQL SQLSTATEs worth a retry: connection exceptions (class 08), operator
# intervention (57P01 admin shutdown, 57P02 crash shutdown, 57P03 cannot connect now),
# serialization failure and deadlock (40001, 40P01)
_TRANSIENT_STATES = ("08", "57P01", "57P02", "57P03", "40001", "40P01")

F = TypeVar("F", bound=Callable[..., Any])


def is_transient(exc: BaseException) -> bool:
    """Whether ``exc`` is a lost or refused catalog connection (or a serialization
    failure): the transaction did not happen, or its outcome is unknown."""
    if not isinstance(exc, DBAPIError):
        return False
    if exc.connection_invalidated:
        return True
    state = getattr(exc.orig, "sqlstate", None) or getattr(exc.orig, "pgcode", None)
    if isinstance(state, str):
        return state.startswith(_TRANSIENT_STATES)
    # a refused connection carries no SQLSTATE; SQLite's errors are never connection loss
    return (isinstance(exc, OperationalError)
            and type(exc.orig).__module__.startswith("psycopg"))


def _give_up(state: tenacity.RetryCallState) -> None:
    exc = state.outcome.exception() if state.outcome is not None else None
    raise NodeUnavailable(
        f"the catalog did not answer for {state.seconds_since_start:.1f} s "
        f"({state.attempt_number} attempts): {exc}", node="catalog") from exc


def _log_retry(state: tenacity.RetryCallState) -> None:
    exc = state.outcome.exception() if state.outcome is not None else None
    log.warning("catalog connection lost (%s); retry %d", exc, state.attempt_number)


def retry_call(seconds: float, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, run again on a transient error for up to ``seconds``
    (waits 20 ms doubling to 1 s between attempts), then NodeUnavailable."""
    retryer = tenacity.Retrying(
        retry=tenacity.retry_if_exception(is_transient),
        stop=tenacity.stop_after_delay(seconds),
        wait=tenacity.wait_exponential(multiplier=0.02, max=1.0),
        before_sleep=_log_retry,
        retry_error_callback=_give_up,
    )
    return retryer(fn, *args, **kwargs)


def retrying(fn: F) -> F:
    """Run a ``Catalog`` method again when its connection is lost. The method must be
    one transaction, safe to run again after a rollback (reads; idempotent writes).
    A call handed the caller's ``Connection`` runs once: retrying belongs to the
    caller's transaction, which is lost as a whole."""

    @functools.wraps(fn)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("conn") is not None or any(isinstance(a, Connection) for a in args):
            return fn(self, *args, **kwargs)
        return retry_call(getattr(self, "retry_seconds", RETRY_SECONDS), fn, self, *args,
                          **kwargs)

    return wrapper  # type: ignore[return-value]
