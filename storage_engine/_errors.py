"""Errors raised by the storage engine.

The storage engine imports nothing of ours, so it has its own small hierarchy; the
client facade converts these into ``tensordb.errors`` at its boundary.
"""

from __future__ import annotations

__all__ = ["StorageError", "SegmentMissing", "TierFull"]


class StorageError(Exception):
    """Base class of every storage-engine failure."""


class SegmentMissing(StorageError, FileNotFoundError):
    """A segment the caller asked for is not on this tier (never written, or reclaimed)."""

    def __init__(self, tier: str, segment_id: str) -> None:
        super().__init__(f"segment {segment_id} is not on the {tier} tier")
        self.tier = tier
        self.segment_id = segment_id


class TierFull(StorageError):
    """Writing would take a tier past its configured capacity."""

    def __init__(self, tier: str, needed: int, used: int, capacity: int) -> None:
        super().__init__(
            f"the {tier} tier holds {used} of {capacity} bytes; {needed} more do not fit"
        )
        self.tier = tier
        self.needed = needed
        self.used = used
        self.capacity = capacity
