"""Upkeep of a node's store: retention (``drop_versions``), ``gc``, ``verify``, ``stats``.

All of it is safe while other processes read and write: gc frees only what the
catalog's plan says no version, tag, pin, lease or retention rule needs, and the
segments of writers that died before committing.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import storage_engine as se
from tensordb.catalog import Catalog
from tensordb.errors import InvalidInput

from ._inputs import check_name
from ._placement import Tiers

__all__ = ["Corruption", "GcReport", "Maintenance"]


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


class Maintenance:
    """Retention, gc, verification and usage figures over ``catalog`` and ``tiers``."""

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
        for sid, tier_name, nbytes in plan.dead_segments:
            if self._tiers.store(tier_name).delete(sid):
                freed += nbytes
        orphans = 0
        for tier in self._tiers.values():
            orphans += len(tier.reclaim_orphans(self._catalog.segment_registered))
        released = pooled = 0
        for tier in self._tiers.values():
            if isinstance(tier, se.Pooling):
                released += tier.trim_pool(None if keep_pool else 0)
                pooled += tier.pooled_bytes()
        return GcReport(plan.dropped_versions, plan.dropped_rows, plan.expired_leases,
                        len(plan.dead_segments), freed, orphans, pooled, released)

    def verify(self) -> list[Corruption]:
        """Check every stored extent of this node against its checksum; [] when all good."""
        problems: list[Corruption] = []
        current: tuple[str, se.SegmentView | None] | None = None
        for coll, first, r in self._catalog.all_rows():
            assert r.segment_id is not None and r.tier is not None
            if current is None or current[0] != r.segment_id:
                why = "missing"
                try:
                    current = (r.segment_id, self._tiers.open(r.tier, r.segment_id))
                except se.SegmentMissing:
                    current = (r.segment_id, None)
                except se.SourceChanged as exc:  # committed in place; the file changed
                    current, why = (r.segment_id, None), str(exc)
            mm = current[1]
            if mm is None:
                problems.append(Corruption(coll, first, r.name, r.segment_id, r.tier, why))
                continue
            if r.offset + r.nbytes > len(mm):
                problems.append(Corruption(coll, first, r.name, r.segment_id, r.tier, "truncated"))
                continue
            got = se.checksum(mm.host_bytes(r.offset, r.nbytes))
            if got != r.checksum:
                problems.append(Corruption(coll, first, r.name, r.segment_id, r.tier,
                                           f"checksum {got} != {r.checksum}"))
        return problems

    def stats(self) -> dict[str, int]:
        """The catalog's counts, and the bytes each open tier of this node uses."""
        out = self._catalog.stats()
        for name, tier in self._tiers.items():
            out[f"{name}_bytes"] = tier.used_bytes()
            if isinstance(tier, se.Pooling):
                out[f"{name}_pool_bytes"] = tier.pooled_bytes()
        return out
