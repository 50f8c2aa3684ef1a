"""Upkeep of a node's store: retention (``drop_versions``), ``gc``, ``verify``, ``scrub``,
``stats``.

``verify`` and ``scrub`` hash stored extents against the catalog and mark each segment
that fails corrupt (``Tiers.marks``), so no read begun afterwards serves it; the scrub
runs by default (docs/storage.md, "Integrity model").

All of it is safe while other processes read and write: gc frees only what the
catalog's plan says no version, tag, pin, lease or retention rule needs, and the
segments of writers that died before committing.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta

import storage_engine as se
from tensordb.catalog import Catalog, TensorRow
from tensordb.errors import InvalidInput

from ._inputs import check_name
from ._placement import Tiers

__all__ = ["Corruption", "GcReport", "Maintenance", "ScrubReport"]


@dataclass(frozen=True, slots=True)
class GcReport:
    dropped_versions: int
    dropped_rows: int
    expired_leases: int
    segments_deleted: int
    bytes_freed: int
    orphans_reclaimed: int
    #: bytes of freed host-tier files kept for later writes after this gc (the pool)
    pool_bytes: int = 0
    #: bytes the pool gave back to the system in this gc
    pool_released: int = 0


@dataclass(frozen=True, slots=True)
class Corruption:
    """A stored tensor whose bytes are missing or do not match their checksum."""

    collection: str
    first_version: int
    tensor: str
    segment_id: str
    tier: str
    reason: str


@dataclass(frozen=True, slots=True)
class ScrubReport:
    """What a scrub checked: segments and bytes hashed, the damage it found (each
    segment named there is now marked corrupt), and whether it went round the whole
    node (False: it stopped at its byte budget; the next scrub goes on from there)."""

    segments: int
    nbytes: int
    corrupt: list[Corruption] = field(default_factory=list)
    complete: bool = True


#: the tiers a scrub reads (the GPU tier's bytes live in the writing process)
_SCRUBBED = ("host", "disk")


def _by_segment(rows: list[tuple[str, int, TensorRow]]
                ) -> Iterator[tuple[str, str, list[tuple[str, int, TensorRow]]]]:
    """(segment id, tier, its rows) in segment order (``rows`` is in that order)."""
    group: list[tuple[str, int, TensorRow]] = []
    for item in rows:
        if group and group[0][2].segment_id != item[2].segment_id:
            yield group[0][2].segment_id or "", group[0][2].tier or "host", group
            group = []
        group.append(item)
    if group:
        yield group[0][2].segment_id or "", group[0][2].tier or "host", group


class Maintenance:
    """Retention, gc, verification, scrubs and usage figures over ``catalog`` and
    ``tiers`` (the store's background scrub is ``BackgroundScrub``'s, over ``scrub``)."""

    def __init__(self, catalog: Catalog, tiers: Tiers) -> None:
        self._catalog = catalog
        self._tiers = tiers

    def drop_versions(self, collection: str, keep_last: int | None,
                      older_than: timedelta | None) -> int:
        """Forget old versions, keeping the head and every tagged, pinned or leased
        version; returns how many were dropped."""
        check_name("collection", collection)
        if (keep_last is None) == (older_than is None):
            raise InvalidInput("give keep_last or older_than (exactly one)",
                               collection=collection)
        if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int)
                                      or keep_last < 1):
            raise InvalidInput(f"keep_last must be a positive integer, not {keep_last!r}",
                               collection=collection)
        if older_than is not None and (not isinstance(older_than, timedelta)
                                       or older_than.total_seconds() < 0):
            raise InvalidInput(f"older_than must be a non-negative timedelta, not {older_than!r}",
                               collection=collection)
        return self._catalog.drop_versions(collection, keep_last, older_than)

    def gc(self, keep_pool: bool = True) -> GcReport:
        """Reclaim what nothing needs, and the segments of writers that died before
        committing; then trim each tier's pool of freed files to its bound (to nothing
        unless ``keep_pool``)."""
        if not isinstance(keep_pool, bool):
            raise InvalidInput(f"keep_pool must be True or False, not {keep_pool!r}")
        plan = self._catalog.gc()
        freed = 0
        marks = self._tiers.marks
        for sid, tier_name, nbytes in plan.dead_segments:
            if self._tiers.store(tier_name).delete(sid):
                freed += nbytes
            marks.forget(sid)
        orphans = 0
        for tier in self._tiers.values():
            gone = tier.reclaim_orphans(self._catalog.segment_registered)
            orphans += len(gone)
            for sid in gone:
                marks.forget(sid)
        released = pooled = 0
        for tier in self._tiers.values():
            if isinstance(tier, se.Pooling):
                released += tier.trim_pool(None if keep_pool else 0)
                pooled += tier.pooled_bytes()
        return GcReport(plan.dropped_versions, plan.dropped_rows, plan.expired_leases,
                        len(plan.dead_segments), freed, orphans, pooled, released)

    def scrub(self, max_bytes: int | None = None, *, rate: int | None = None,
              stop: Callable[[], bool] | None = None,
              pace: Callable[[int, list[Corruption]], bool] | None = None) -> ScrubReport:
        """Hash the host- and disk-tier segments this node holds (its own and its
        replicas) against the catalog, from where the store's last scrub stopped,
        marking each extent that fails corrupt (no read begun afterwards serves it) and
        each good disk segment verified. ``max_bytes``: stop after about that many bytes
        (None: one full round); ``rate``: read at most that many bytes a second;
        ``stop``: asked between segments, True ends the scrub; ``pace``: called after
        each segment with its bytes and the damage found in it, True ends the scrub
        (the background scrubber sleeps in it to keep to its share of a core)."""
        if max_bytes is not None and (isinstance(max_bytes, bool)
                                      or not isinstance(max_bytes, int) or max_bytes < 0):
            raise InvalidInput(f"max_bytes must be a non-negative integer or None, not "
                               f"{max_bytes!r}")
        if rate is not None and (isinstance(rate, bool) or not isinstance(rate, int)
                                 or rate < 0):
            raise InvalidInput(f"rate must be a non-negative integer or None, not {rate!r}")
        marks = self._tiers.marks
        held = [(sid, tier) for sid, tier in self._catalog.held_segments()
                if tier in _SCRUBBED]
        last = marks.cursor()
        after = last[0] if last is not None else ""
        # from the segment after the cursor, round to it
        start = next((i for i, (sid, _) in enumerate(held) if sid > after), 0)
        order = held[start:] + held[:start]
        problems: list[Corruption] = []
        done = nbytes = 0
        began = time.monotonic()
        complete = True
        for sid, tier in order:
            if (max_bytes is not None and nbytes >= max_bytes) or (stop is not None
                                                                   and stop()):
                complete = False
                break
            rows = self._catalog.all_rows(sid)  # the segment's own rows, one query
            found = self._check_segment(sid, tier, rows, mark=True) if rows else []
            problems += found
            done += 1
            size = sum(r.nbytes for _, _, r in rows)
            nbytes += size
            marks.set_cursor(sid)
            if rate:
                ahead = nbytes / rate - (time.monotonic() - began)
                if ahead > 0:
                    time.sleep(ahead)
            if pace is not None and pace(size, found) and sid != order[-1][0]:
                complete = False
                break
        return ScrubReport(done, nbytes, problems, complete)

    def _check_segment(self, sid: str, tier: str, rows: list[tuple[str, int, TensorRow]],
                       *, mark: bool) -> list[Corruption]:
        """The damage in one segment's extents (its ``rows``); with ``mark``, a damaged
        segment is marked corrupt and a good disk segment verified."""
        marks = self._tiers.marks
        problems: list[Corruption] = []
        why = "missing"
        try:
            mm: se.SegmentView | None = self._tiers.store(tier).inspect(sid)
        except se.SegmentMissing:
            mm = None
        except se.SourceChanged as exc:  # committed in place; the file changed
            mm, why = None, str(exc)
        if mm is None:
            return [Corruption(coll, first, r.name, sid, tier, why) for coll, first, r in rows]
        bad: dict[int, Corruption] = {}  # offset -> the first row found bad there
        for coll, first, r in rows:
            if r.offset + r.nbytes > len(mm):
                problems.append(Corruption(coll, first, r.name, sid, tier, "truncated"))
            else:
                got = se.checksum(mm.host_bytes(r.offset, r.nbytes))
                if got == r.checksum:
                    continue
                problems.append(Corruption(coll, first, r.name, sid, tier,
                                           f"checksum {got} != {r.checksum}"))
            bad.setdefault(r.offset, problems[-1])
        if mark and problems:
            known = marks.corrupt(sid) or {}
            for off, p in bad.items():
                if off not in known:
                    marks.mark_corrupt(sid, off, f"{p.collection}/{p.tensor}: {p.reason}")
        elif mark and tier == "disk":
            disk = self._tiers.disk
            try:
                st = os.stat(disk.path(sid))
            except FileNotFoundError:
                st = None  # a file committed in place: its first open checks it
            if st is not None and st.st_size == len(mm):
                marks.mark_verified(sid, st)
        return problems

    def verify(self) -> list[Corruption]:
        """Check every stored extent this node holds (its own segments and its
        replicas) against its checksum; [] when all good. A host- or disk-tier segment
        that fails is marked corrupt (docs/storage.md)."""
        problems: list[Corruption] = []
        for sid, tier, rows in _by_segment(self._catalog.all_rows()):
            problems += self._check_segment(sid, tier, rows, mark=tier in _SCRUBBED)
        return problems

    def stats(self) -> dict[str, int]:
        """The catalog's counts, and the bytes each open tier of this node uses."""
        out = self._catalog.stats()
        for name, tier in self._tiers.items():
            out[f"{name}_bytes"] = tier.used_bytes()
            if isinstance(tier, se.Pooling):
                out[f"{name}_pool_bytes"] = tier.pooled_bytes()
        return out
