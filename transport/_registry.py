"""A node server's presence in the catalog: register on start, heartbeat while it runs,
deregister on shutdown; and, on every beat, mark down the nodes whose heartbeat lapsed.

PostgreSQL holds the truth; there is no election and no consensus: any node that sees
a heartbeat older than the lapse may mark that node down, and a node that beats again
comes back up.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

from tensordb.catalog import NodeDirectory

__all__ = ["NodeRegistration", "DEFAULT_HEARTBEAT"]

#: seconds between two heartbeats (the lapse is several of them)
DEFAULT_HEARTBEAT = 1.0

_log = logging.getLogger("tensordb.transport")


class NodeRegistration:
    """Keeps one node registered while ``start``-ed; ``stop`` deregisters it.

    The heartbeat runs on a daemon thread; a catalog that does not answer for a beat is
    logged and retried on the next one (the node then lapses if it stays away)."""

    def __init__(self, directory: NodeDirectory, name: str, address: str,
                 tiers: Sequence[str], capacity: int | None, *,
                 interval: float = DEFAULT_HEARTBEAT) -> None:
        self.directory = directory
        self.name = name
        self.address = address
        self.tiers = list(tiers)
        self.capacity = capacity
        self.interval = interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Register now (raises if the catalog refuses), then beat in the background."""
        self.directory.register(self.name, self.address, self.tiers, self.capacity)
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name="tensordb-heartbeat")
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                if not self.directory.heartbeat(self.name):  # someone removed our row
                    self.directory.register(self.name, self.address, self.tiers,
                                            self.capacity)
                lapsed = self.directory.mark_lapsed()
                if lapsed:
                    _log.warning("marked down (heartbeat lapsed): %s", ", ".join(lapsed))
            except Exception as exc:  # noqa: BLE001 - the next beat retries
                _log.warning("heartbeat of node %s failed: %s", self.name, exc)

    def stop(self) -> None:
        """Stop beating and mark the node down. Idempotent."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        try:
            self.directory.deregister(self.name)
        except Exception as exc:  # noqa: BLE001 - it lapses instead
            _log.warning("could not deregister node %s: %s", self.name, exc)
