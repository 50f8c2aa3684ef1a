"""Counts of the work this process did, by kind: what the cost contracts count.

A speed promise (a commit costs what it changed, an open costs the same at any size)
is held by a test that counts the work done at two sizes 100 x apart and asserts that
the count does not grow (``tests/test_costs.py``), never by a timed test. The counters
are the work those tests count, kept where the work is done:

* ``bytes_copied`` / ``bytes_hashed``: bytes the storage engine copied into extents
  and hashed (a checksum computed, on a copy or on its own);
* ``rows_built``: ``TensorRow`` values the catalog built (one per tensor of a
  manifest turned into rows: what a reader pays per tensor in Python);
* ``names_built``: tensor names turned from a packed manifest's column into Python
  strings;
* ``manifest_rows_packed``: rows written into packed manifest files, in the
  background after a commit or by an opener (the CPU work a commit leaves queued);
* ``commits_built``: ``Commit`` values a history built.

Every count is per batch or per call, not per byte, and costs one locked add. The
counters only grow; ``counting()`` hands out what a block added.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

__all__ = ["WorkCounts", "add_work", "counting", "work_counts"]

_lock = threading.Lock()
_counts: dict[str, int] = {}


def add_work(kind: str, n: int = 1) -> None:
    """Count ``n`` units of work of ``kind`` (from any thread)."""
    with _lock:
        _counts[kind] = _counts.get(kind, 0) + n


def work_counts() -> dict[str, int]:
    """Every counter of this process so far."""
    with _lock:
        return dict(_counts)


class WorkCounts(Mapping[str, int]):
    """What was counted between the start of a ``counting()`` block and now (or its
    end): a mapping of kind -> units, 0 for a kind nothing counted."""

    def __init__(self, start: Mapping[str, int]) -> None:
        self._start = dict(start)
        self._end: dict[str, int] | None = None

    def _now(self) -> dict[str, int]:
        return self._end if self._end is not None else work_counts()

    def _delta(self) -> dict[str, int]:
        now = self._now()
        return {k: v - self._start.get(k, 0) for k, v in now.items()
                if v != self._start.get(k, 0)}

    def __getitem__(self, kind: str) -> int:
        return self._delta().get(kind, 0)

    def __iter__(self) -> Iterator[str]:
        return iter(self._delta())

    def __len__(self) -> int:
        return len(self._delta())

    def stop(self) -> None:
        """Freeze the counts at this instant (the block's end does it)."""
        if self._end is None:
            self._end = work_counts()

    def __repr__(self) -> str:
        return f"WorkCounts({self._delta()!r})"


@contextmanager
def counting() -> Iterator[WorkCounts]:
    """The work this process counts inside the block (every thread's)."""
    got = WorkCounts(work_counts())
    try:
        yield got
    finally:
        got.stop()
