"""Latency histograms of a host store's client processes, kept where an exporter reads
them: one small shared file per process under ``<shm_dir>/metrics/``.

Commits, reads and pulls are timed in whichever process makes them (an engine, a
trainer, a loader), not in the node server, and none of those processes runs an HTTP
endpoint of its own. Each process writes its own file (``lat-<holder>.f64``: float64
slots, one row per operation of ``OPS``: a count per bucket of ``BUCKETS`` and one past
the last, then the sum of the seconds and the count), so there is one writer per file
and no cross-process lock on the hot path: an observation is an in-process lock and
three aligned 8-byte stores. The exporter (``read_latencies``) sums every file it can
check. A dead process's file is folded into ``retired.f64`` (under ``fold.lock``) when
a process starts its file or an exporter reads, so the counts stay monotonic and the
directory holds one file per live process.

Every file is checked before its values are used: the header (magic, layout version,
row and bucket counts), its size, and each value (finite, not negative, bucket counts
whole numbers that add up to the count). A file that fails is skipped and counted in
``LatencySums.skipped``; it is never trusted, and a damaged ``retired.f64`` is set
aside (renamed ``retired.f64.damaged``) rather than folded into.
"""

from __future__ import annotations

import fcntl
import math
import mmap
import os
import threading
from bisect import bisect_left
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ._procs import current_holder, holder_alive

__all__ = ["BUCKETS", "OPS", "LatencyLog", "LatencySums", "latency_log", "read_latencies"]

#: what is timed: a commit (the transaction's publish), a read (one tensor of a version
#: handed out), a pull (a segment copied from another node)
OPS = ("commit", "read", "pull")
#: histogram bucket bounds, seconds (Prometheus' ``le``); one more bucket past the last
BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
           0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_MAGIC = float(0x7464626C6174)  # "tdblat"
_VERSION = 1.0
_HEAD = 4  # magic, version, rows, buckets
_ROW = len(BUCKETS) + 1 + 2  # the buckets, +Inf, sum, count
_SLOTS = _HEAD + len(OPS) * _ROW
_SIZE = _SLOTS * 8
_RETIRED = "retired.f64"


def _row(data: np.ndarray, op: int) -> np.ndarray:
    return data[_HEAD + op * _ROW: _HEAD + (op + 1) * _ROW]


def _blank() -> np.ndarray:
    data = np.zeros(_SLOTS, np.float64)
    data[:_HEAD] = (_MAGIC, _VERSION, len(OPS), len(BUCKETS))
    return data


def _checked(raw: bytes) -> np.ndarray | None:
    """The file's values, or None where anything in it cannot be."""
    if len(raw) != _SIZE:
        return None
    data = np.frombuffer(raw, np.float64).copy()
    if tuple(data[:_HEAD]) != (_MAGIC, _VERSION, len(OPS), len(BUCKETS)):
        return None
    body = data[_HEAD:]
    if not np.isfinite(body).all() or (body < 0).any():
        return None
    for op in range(len(OPS)):
        row = _row(data, op)
        counts = row[: len(BUCKETS) + 1]
        if (counts != np.floor(counts)).any() or counts.sum() != row[-1]:
            return None
    return data


@dataclass
class LatencySums:
    """The host's histograms: per operation, the count in each bucket (not cumulative;
    the last is past ``BUCKETS[-1]``), the sum of the seconds and the count."""

    buckets: dict[str, list[float]] = field(default_factory=dict)
    sums: dict[str, float] = field(default_factory=dict)
    counts: dict[str, float] = field(default_factory=dict)
    #: files that failed their checks (skipped)
    skipped: int = 0
    #: live processes' files read
    processes: int = 0


def _holder_of(name: str) -> str | None:
    if not (name.startswith("lat-") and name.endswith(".f64")):
        return None
    return name[4:-4].replace("_", ":")


@contextmanager
def _folding(root: Path) -> Iterator[None]:
    """The host's fold lock: dead files are folded, and a reader sums, under it (a file
    is never counted both in retired.f64 and on its own)."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / "fold.lock", "a+b") as lk:
        fcntl.flock(lk.fileno(), fcntl.LOCK_EX)
        yield


def _fold_dead(root: Path) -> int:
    """Fold the files of processes that are gone into retired.f64 (under the fold
    lock): returns the count of files that failed their checks (removed, not folded)."""
    bad = 0
    dead = [path for path in root.glob("lat-*.f64")
            if (holder := _holder_of(path.name)) is not None and holder_alive(holder) is False]
    if not dead:
        return 0
    retired_path = root / _RETIRED
    retired = None
    try:
        retired = _checked(retired_path.read_bytes())
        if retired is None:  # damaged: set aside, never added to
            os.replace(retired_path, root / (_RETIRED + ".damaged"))
            bad += 1
    except FileNotFoundError:
        pass
    total = retired if retired is not None else _blank()
    for path in dead:
        try:
            got = _checked(path.read_bytes())
        except FileNotFoundError:
            continue
        if got is None:
            bad += 1
        else:
            total[_HEAD:] += got[_HEAD:]
    tmp = root / f".{_RETIRED}.{os.getpid()}"
    tmp.write_bytes(total.tobytes())
    os.replace(tmp, retired_path)  # the sum lands before the files it holds go
    for path in dead:
        path.unlink(missing_ok=True)
    return bad


def _read_live(path: Path) -> np.ndarray | None:
    """A live process's file: read again where an observation was under way (its
    bucket counted, its count not yet)."""
    got = None
    for _ in range(3):
        got = _checked(path.read_bytes())
        if got is not None:
            break
    return got


class LatencyLog:
    """This process's latency file of one host store (see the module docstring)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self._lock = threading.Lock()
        self._pid = -1
        self._data: memoryview[float] | None = None
        self._map: mmap.mmap | None = None

    def _open(self) -> memoryview[float]:
        with _folding(self.root):
            _fold_dead(self.root)
        holder = current_holder()
        path = self.root / f"lat-{holder.replace(':', '_')}.f64"
        try:  # this process's own file, released before (see release): go on with it
            ours = _checked(path.read_bytes())
        except FileNotFoundError:
            ours = None
        if ours is None:
            tmp = path.with_suffix(".tmp")
            tmp.write_bytes(_blank().tobytes())
            os.replace(tmp, path)  # whole before an exporter can see it
        with open(path, "r+b") as fh:
            self._map = mmap.mmap(fh.fileno(), _SIZE)
        self._pid = os.getpid()
        return memoryview(self._map).cast("d")  # plain float64 slots: ~0.1 us a store

    def release(self) -> None:
        """Unmap the file (a store closing: nothing of the host's shared memory stays
        mapped by a process that has no store open); the next observation maps it
        again, its counts kept."""
        with self._lock:
            if self._data is not None:
                self._data.release()
            if self._map is not None:
                self._map.close()
            self._data = self._map = None

    def observe(self, op: str, seconds: float) -> None:
        """Count one ``op`` (one of ``OPS``) that took ``seconds``. Never raises for a
        bad figure (a clock step backwards counts as 0 s): timing must not break work."""
        i = OPS.index(op)
        s = seconds if math.isfinite(seconds) and seconds > 0 else 0.0
        b = bisect_left(BUCKETS, s)
        with self._lock:
            if self._data is None or self._pid != os.getpid():  # first use, or forked
                try:
                    self._data = self._open()
                except OSError:
                    return  # the host's shared memory full or gone: no figure, no error
            d, at = self._data, _HEAD + i * _ROW
            d[at + b] += 1.0  # the bucket first, the count last (see _read_live)
            d[at + _ROW - 2] += s
            d[at + _ROW - 1] += 1.0


_LOGS: dict[Path, LatencyLog] = {}
_LOGS_LOCK = threading.Lock()


def latency_log(root: Path) -> LatencyLog:
    """The process's one LatencyLog of the host store whose metrics live in ``root``."""
    key = Path(root)
    with _LOGS_LOCK:
        log = _LOGS.get(key)
        if log is None:
            log = _LOGS[key] = LatencyLog(key)
        return log


def read_latencies(root: Path) -> LatencySums:
    """The sum of every checked file under ``root`` (dead processes' folded first)."""
    root = Path(root)
    out = LatencySums(buckets={op: [0.0] * (len(BUCKETS) + 1) for op in OPS},
                      sums=dict.fromkeys(OPS, 0.0), counts=dict.fromkeys(OPS, 0.0))
    if not root.is_dir():
        return out
    total = _blank()
    with _folding(root):
        out.skipped += _fold_dead(root)
        for path in [root / _RETIRED, *root.glob("lat-*.f64")]:
            try:
                got = _read_live(path)
            except FileNotFoundError:
                continue
            if got is None:
                out.skipped += 1
                continue
            out.processes += path.name != _RETIRED
            total[_HEAD:] += got[_HEAD:]
    for k, op in enumerate(OPS):
        row = _row(total, k)
        out.buckets[op] = [float(x) for x in row[: len(BUCKETS) + 1]]
        out.sums[op] = float(row[-2])
        out.counts[op] = float(row[-1])
    return out
