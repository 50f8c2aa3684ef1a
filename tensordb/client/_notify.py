"""Commit notifications, so ``db.watch`` waits instead of polling SQL.

- Embedded store: each watcher binds a Unix datagram socket in the store's
  shared-memory directory (``watch/<id>.sock``, mode 0600); a committing process sends
  ``collection LF version`` (names hold no control characters) to every socket there. A socket whose owner died refuses
  the datagram and the sender removes it.
- PostgreSQL catalog: the commit sends ``pg_notify`` once its transaction has
  committed, and only then, on the same connection (``catalog.notify_after_commit``),
  to every host; watchers LISTEN on a connection of their own.

A notification only says "look again": watchers always re-read the catalog, so a lost
or duplicated datagram costs latency, never correctness (``watch``).
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import threading
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sqlalchemy import Engine

from tensordb.catalog import Catalog, Commit
from tensordb.errors import NotFound

__all__ = ["Notifier", "SocketNotifier", "PgNotifier", "Subscription", "PG_CHANNEL",
           "notifier_for", "watch"]

PG_CHANNEL = "tensordb_commit"


class Subscription(ABC):
    """An open subscription."""

    @abstractmethod
    def wait(self, timeout: float | None) -> set[str] | None:
        """Block up to ``timeout`` s; the collections notified meanwhile, None if none."""

    @abstractmethod
    def close(self) -> None:
        """End the subscription."""


class Notifier(ABC):
    """One way commits reach watchers."""

    def publish(self, collection: str, version: int) -> None:  # noqa: B027 - optional hook
        """Tell watchers ``collection`` moved, after the commit is durable (a no-op where
        the commit itself notifies)."""

    @abstractmethod
    def subscribe(self) -> Subscription:
        """Start receiving notifications; subscribe before reading the state to watch."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release the notifier's resources."""


def _decode(payload: bytes) -> str:
    return payload.split(b"\n", 1)[0].decode("utf-8", "replace")


class _SocketSubscription(Subscription):
    def __init__(self, sock: socket.socket, path: Path) -> None:
        self._sock = sock
        self._path = path

    def wait(self, timeout: float | None) -> set[str] | None:
        ready, _, _ = select.select([self._sock], [], [], timeout)
        if not ready:
            return None
        names: set[str] = set()
        while True:  # drain: one wake-up for a burst of commits
            try:
                names.add(_decode(self._sock.recv(4096)))
            except BlockingIOError:
                return names

    def close(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._path)
        self._sock.close()


class SocketNotifier(Notifier):
    """Notifications between the processes of one host, over Unix datagram sockets."""

    def __init__(self, root: Path) -> None:
        self.dir = Path(root) / "watch"
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._out: socket.socket | None = None
        self._pid = 0
        self._lock = threading.Lock()

    def _sender(self) -> socket.socket:
        out = self._out
        if out is not None and self._pid == os.getpid():
            return out
        # committing threads race here: one socket, or the others' are dropped unclosed
        with self._lock:
            if self._out is None or self._pid != os.getpid():
                if self._out is not None:  # the parent's, inherited by fork: our fd copy
                    self._out.close()
                out = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                out.setblocking(False)
                self._out, self._pid = out, os.getpid()
            return self._out

    def publish(self, collection: str, version: int) -> None:
        payload = f"{collection}\n{version}".encode()
        out = self._sender()
        try:
            entries = list(os.scandir(self.dir))
        except FileNotFoundError:
            return
        for entry in entries:
            if not entry.name.endswith(".sock"):
                continue
            try:
                out.sendto(payload, entry.path)
            except (ConnectionRefusedError, FileNotFoundError):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)  # its watcher is gone
            except (BlockingIOError, OSError):
                pass  # a full queue: that watcher has a wake-up pending anyway

    def subscribe(self) -> Subscription:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        path = self.dir / f"{uuid.uuid4().hex}.sock"
        old = os.umask(0o177)
        try:
            sock.bind(str(path))
        finally:
            os.umask(old)
        sock.setblocking(False)
        return _SocketSubscription(sock, path)

    def close(self) -> None:
        if self._out is not None and self._pid == os.getpid():
            self._out.close()
        self._out = None


class _PgSubscription(Subscription):
    """A LISTEN connection. When the server drops it (restart, pg_terminate_backend),
    ``wait`` listens again on a new one and answers None, so the watcher re-reads the
    catalog: notifications sent while no one listened are not lost, only late."""

    def __init__(self, conninfo: str) -> None:
        self._conninfo = conninfo
        self._conn: Any = None
        self._listen()

    def _listen(self) -> None:
        import psycopg

        self._conn = psycopg.connect(self._conninfo, autocommit=True, connect_timeout=5)
        self._conn.execute(f"LISTEN {PG_CHANNEL}")

    def wait(self, timeout: float | None) -> set[str] | None:
        import psycopg

        started = time.monotonic()
        try:
            if self._conn is None or self._conn.closed:
                self._listen()
            names = {_decode(n.payload.encode()) for n in
                     self._conn.notifies(timeout=timeout, stop_after=1)}
            if not names:
                return None
            # take whatever else is queued without waiting
            names |= {_decode(n.payload.encode()) for n in self._conn.notifies(timeout=0)}
            return names
        except psycopg.OperationalError:
            if self._conn is not None:
                self._conn.close()
            self._conn = None  # listen again on the next wait
            # a server that is down refuses at once: do not spin on it
            left = 0.2 if timeout is None else timeout - (time.monotonic() - started)
            time.sleep(max(0.0, min(0.2, left)))
            return None

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()


class PgNotifier(Notifier):
    """Notifications through PostgreSQL LISTEN/NOTIFY; the catalog's commit sends them."""

    def __init__(self, conninfo: str) -> None:
        self._conninfo = conninfo

    def subscribe(self) -> Subscription:
        return _PgSubscription(self._conninfo)


def notifier_for(engine: Engine, shm_dir: Path) -> Notifier:
    """LISTEN/NOTIFY with a PostgreSQL catalog (it reaches every host), else the sockets
    of this host's store."""
    if engine.dialect.name == "postgresql":
        return PgNotifier(
            engine.url.set(drivername="postgresql").render_as_string(hide_password=False))
    return SocketNotifier(shm_dir)


def watch(catalog: Catalog, notifier: Notifier, collection: str, after: int | None,
          timeout: float | None, poll: float) -> Iterator[Commit]:
    """Each new commit of ``collection`` in order, as it lands (see ``Database.watch``):
    sleeps until a notification names it, re-reading the catalog at least every
    ``poll`` seconds; ends after ``timeout`` seconds without a new commit."""
    sub = notifier.subscribe()  # before the first look: no commit slips between
    try:
        if after is None:
            info = catalog.info(collection)
            after = info.head if info else 0
        deadline = None if timeout is None else time.monotonic() + timeout
        check = True
        while True:
            if check:
                try:
                    new = catalog.commits_after(collection, after)
                except NotFound:  # not created yet
                    new = []
                if new:
                    for c in new:
                        after = c.version
                        yield c
                    if timeout is not None:
                        deadline = time.monotonic() + timeout
                    continue
            wait = poll
            if deadline is not None:
                wait = min(wait, deadline - time.monotonic())
                if wait <= 0:
                    return
            names = sub.wait(wait)
            check = names is None or collection in names
    finally:
        sub.close()
