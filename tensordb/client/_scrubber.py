"""The background scrub of a host's store: one scrubber per store per host, in whichever
of its processes holds the scrub lock, at a bounded share of one core.

Every ``Database`` that holds bytes starts a ``BackgroundScrub`` (a daemon thread). The
thread tries, without waiting, for an exclusive ``flock`` on ``<shm_dir>/integrity/
scrub.lock``: the process that gets it is the host's scrubber for the store, the others
try again every ``_RETRY`` seconds, so when the scrubbing process exits (or dies: the
kernel drops its lock) another takes over within that time. Ten processes of a store
scrub it once, not ten times.

The scrubber walks the segments this node holds (its own and its replicas, host and
disk tiers) with ``Maintenance.scrub``, from the store's cursor. After each segment it
sleeps long enough that the thread's CPU time stays at most ``cpu`` of the wall time
(``Config.scrub_cpu``, 5 % of one core by default), and it reads at most ``rate`` bytes a
second (``Config.scrub_rate``). A round starts at most every ``interval`` seconds
(``Config.scrub_interval``); ``scrub_cpu=0`` or ``scrub_interval=0`` turns it off. The
first round starts ``_START`` seconds after the store opens, so a short-lived process
(a script that reads one tensor) never pays for it.

What it did is kept beside the marks (``scrub.status``, JSON, rewritten after each
segment), so ``db.stats()`` in any process of the host reports the host's scrubber:
its pid, rounds completed, bytes and segments checked in the current round, the damage
it found, and when its last round ended.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import weakref
from pathlib import Path

import storage_engine as se
from tensordb.config import Config
from tensordb.errors import InvalidInput

from ._maintenance import Corruption, Maintenance

__all__ = ["BackgroundScrub", "check_scrub_config", "scrub_status"]

_log = logging.getLogger("tensordb.scrub")

#: seconds after a store opens before its first round (a short-lived process pays nothing)
_START = 2.0

#: seconds between two tries for the scrub lock by a process that does not hold it
_RETRY = 5.0

_STATUS = "scrub.status"

#: every live scrubber of this process: a forked child lets go of their locks
_LIVE: weakref.WeakSet[BackgroundScrub] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for scrub in list(_LIVE):
        scrub._forked()


os.register_at_fork(after_in_child=_after_fork_in_child)


def check_scrub_config(config: Config) -> None:
    """InvalidInput naming the setting, for a scrub setting out of its range."""
    for name, low, high in (("scrub_interval", 0.0, None), ("scrub_cpu", 0.0, 1.0),
                            ("scrub_rate", 0, None)):
        value = getattr(config, name)
        if (isinstance(value, bool) or not isinstance(value, (int, float))
                or value != value or value < low or (high is not None and value > high)):
            bound = f"between {low} and {high}" if high is not None else f"at least {low}"
            raise InvalidInput(f"{name} must be a number {bound}, not {value!r}")
    if isinstance(config.scrub_rate, float):
        raise InvalidInput(f"scrub_rate must be a whole number of bytes a second, not "
                           f"{config.scrub_rate!r}")


def scrub_status(root: Path) -> dict[str, int]:
    """The host's scrubber's report, as ``db.stats()`` gives it (keys ``scrub_*``);
    zeros where no scrubber has run on this boot."""
    out = {"scrub_pid": 0, "scrub_rounds": 0, "scrub_bytes": 0, "scrub_segments": 0,
           "scrub_found": 0, "scrub_last_round_end": 0}
    try:
        with open(root / _STATUS, encoding="utf-8") as fh:
            got = json.load(fh)
    except (OSError, ValueError):
        return out
    if isinstance(got, dict):
        for key in out:
            value = got.get(key)
            if isinstance(value, int) and not isinstance(value, bool):
                out[key] = value
    return out


class BackgroundScrub:
    """The store's background scrub in this process (see the module docstring):
    ``start`` once, ``stop`` when the store closes."""

    def __init__(self, maintenance: Maintenance, root: Path, *, interval: float,
                 rate: int, cpu: float, node: str) -> None:
        # a weak reference: a store dropped without ``close`` ends its scrub thread
        # instead of being kept alive by it
        self._maintenance = weakref.ref(maintenance)
        self._root = root
        self.interval = interval
        self.rate = rate
        self.cpu = cpu
        self._node = node
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._fd: int | None = None
        #: the host's figures, read again when this process takes the lock
        self._status = scrub_status(root)

    @property
    def enabled(self) -> bool:
        return self.interval > 0 and self.cpu > 0

    def start(self) -> None:
        if not self.enabled or self._thread is not None:
            return
        _LIVE.add(self)
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name="tensordb-scrub")
        self._thread.start()

    def stop(self) -> None:
        """Stop scrubbing (a segment being hashed is finished first) and let go of the
        lock. Idempotent."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        self._unlock()
        _LIVE.discard(self)

    def _forked(self) -> None:
        # a child of fork has no scrub thread: it must not keep the parent's lock alive
        fd, self._fd = self._fd, None
        self._thread = None
        if fd is not None:
            os.close(fd)

    # -- the lock ----------------------------------------------------------------------
    def _try_lock(self) -> bool:
        if self._fd is not None:
            return True
        try:
            self._fd = se.try_lock_file(self._root / "scrub.lock")
        except OSError:  # the area went away (the store was removed)
            return False
        if self._fd is None:
            return False
        self._status = scrub_status(self._root)  # go on from the last holder's figures
        return True

    def _unlock(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)  # closing drops the flock

    # -- the loop ----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop()
        finally:
            self._unlock()

    def _loop(self) -> None:
        if self._stop.wait(_START):
            return
        while not self._stop.is_set() and self._maintenance() is not None:
            if not self._try_lock():
                self._stop.wait(_RETRY)
                continue
            began = time.monotonic()
            try:
                complete = self._round()
            except Exception as exc:  # noqa: BLE001 - the next round tries again
                _log.warning("scrub of node %s failed: %s", self._node, exc)
                complete = False
            if complete:
                self._status["scrub_rounds"] += 1
                self._status["scrub_last_round_end"] = int(time.time())
                self._write_status()
            self._stop.wait(max(0.0, self.interval - (time.monotonic() - began)))

    def _round(self) -> bool:
        """One round over the node's segments, paced; True when it went all the way."""
        st = self._status
        st["scrub_pid"] = os.getpid()
        st["scrub_bytes"] = st["scrub_segments"] = 0
        mark = [time.monotonic(), time.thread_time()]

        def pace(nbytes: int, found: list[Corruption]) -> bool:
            for c in found:
                _log.error("scrub: %s/%s (segment %s, %s tier) is corrupt: %s; not served",
                           c.collection, c.tensor, c.segment_id, c.tier, c.reason)
            st["scrub_bytes"] += nbytes
            st["scrub_segments"] += 1
            st["scrub_found"] += len(found)
            self._write_status()
            # keep this thread's CPU (hashing and the catalog's queries) to its share
            # and its reads to ``rate`` (here, not in ``scrub``: this wait ends at close)
            used = time.thread_time() - mark[1]
            least = max(used / self.cpu, nbytes / self.rate if self.rate else 0.0)
            wait = least - (time.monotonic() - mark[0])
            stopped = self._stop.wait(wait) if wait > 0 else self._stop.is_set()
            mark[0], mark[1] = time.monotonic(), time.thread_time()
            return stopped

        maintenance = self._maintenance()
        if maintenance is None:  # the store is gone
            return False
        report = maintenance.scrub(stop=self._stop.is_set, pace=pace)
        return report.complete and not self._stop.is_set()

    def _write_status(self) -> None:
        tmp = self._root / f".{_STATUS}.{os.getpid()}"
        try:
            tmp.write_text(json.dumps(self._status), encoding="utf-8")
            os.replace(tmp, self._root / _STATUS)
        except OSError as exc:  # the area went away (the store was removed)
            _log.debug("scrub status not written: %s", exc)
