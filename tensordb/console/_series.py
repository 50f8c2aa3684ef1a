"""KV namespaces over time: the console's charts of hit rate and occupancy.

The shared counters in each namespace's index say what happened since it was made, not
when. ``KVSeries`` reads them every ``interval`` seconds on a daemon thread of the
console's process and keeps the last ``keep`` samples per namespace in memory (at the
defaults, an hour at 5 s). A chart's hit rate is that of each interval (hits over the
lookups between two samples, None where there were none), its occupancy the host
blocks' bytes over the arena's capacity at each sample. A namespace made anew (its
counters went down) starts a new series. Samples live as long as the console does.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tensordb.errors import CorruptData, InvalidInput, StoreClosed

if TYPE_CHECKING:
    from tensordb.client import Database

__all__ = ["KVSeries", "Sample"]

_log = logging.getLogger("tensordb.console")


@dataclass(frozen=True, slots=True)
class Sample:
    """One namespace's counters at one moment (Unix seconds)."""

    t: float
    hits: int
    misses: int
    host_bytes: int
    disk_bytes: int
    capacity: int


class KVSeries:
    """Samples of this node's KV namespaces' counters (see the module docstring)."""

    def __init__(self, db: Database, interval: float = 5.0, keep: int = 720) -> None:
        if not interval > 0 or keep < 2:
            raise InvalidInput(f"a KV series samples every interval > 0 seconds and keeps >= 2 "
                               f"samples, not interval={interval!r}, keep={keep!r}")
        self._db = db
        self.interval = interval
        self._keep = keep
        self._samples: dict[str, deque[Sample]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Take a sample now, then one every ``interval`` seconds until ``stop``. A
        first sample that fails (a catalog not answering) is logged, not raised: the
        console starts, and its charts begin at the next sample."""
        try:
            self.sample()
        except Exception as exc:  # noqa: BLE001 - the console serves without it
            _log.warning("console: KV sample failed: %s", exc)
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name="tensordb-console-kv")
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.sample()
            except StoreClosed:  # the store closed under the console: nothing to sample
                return
            except Exception as exc:  # noqa: BLE001 - a missed sample, not a dead chart
                _log.warning("console: KV sample failed: %s", exc)

    def sample(self) -> None:
        """Read every namespace of this node once and append what it says."""
        db = self._db
        now = time.time()
        names = [r["name"] for r in db.query(
            "SELECT name FROM kv_namespaces WHERE node = :n", {"n": db.config.node}
        ).to_pylist()]
        with self._lock:  # namespaces dropped since: their series go
            for gone in set(self._samples) - set(names):
                del self._samples[gone]
        for name in names:
            try:
                got = db.kv_counters(name)
            except CorruptData as exc:  # no point for it; the others are still sampled
                _log.warning("console: %s", exc)
                continue
            if got is None:
                continue
            c, capacity = got
            s = Sample(now, c["hits"], c["misses"], c["host_bytes"], c["disk_bytes"],
                       capacity)
            with self._lock:
                q = self._samples.get(name)
                if q is None or (q and (s.hits < q[-1].hits or s.misses < q[-1].misses)):
                    q = self._samples[name] = deque(maxlen=self._keep)
                q.append(s)

    def series(self, name: str) -> dict[str, list[Any]]:
        """The chart's points for ``name``: times (Unix seconds), each interval's hit
        rate (None: no lookups in it; the first point has none before it), occupancy,
        and host and disk bytes. Empty lists for a namespace never sampled."""
        with self._lock:
            pts = list(self._samples.get(name, ()))
        rates: list[float | None] = [None]
        for a, b in zip(pts, pts[1:], strict=False):
            looked = (b.hits - a.hits) + (b.misses - a.misses)
            rates.append((b.hits - a.hits) / looked if looked > 0 else None)
        return {"t": [p.t for p in pts], "hit_rate": rates[:len(pts)],
                "occupancy": [p.host_bytes / p.capacity if p.capacity else 0.0 for p in pts],
                "host_bytes": [p.host_bytes for p in pts],
                "disk_bytes": [p.disk_bytes for p in pts]}
