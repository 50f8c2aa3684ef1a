"""Errors raised by the storage engine.

The storage engine imports nothing of ours, so it has its own small hierarchy; the
client facade converts these into ``tensordb.errors`` at its boundary.
"""

from __future__ import annotations

__all__ = ["StorageError", "SegmentMissing", "SourceChanged", "TierFull"]


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


class SourceChanged(StorageError):
    """The file a segment references in place (``DiskTier.adopt``) is not the file that
    was committed any more: deleted, replaced, truncated, grown or written since. The
    segment is not served; ``what`` says which of its recorded facts differ."""

    def __init__(self, tier: str, segment_id: str, path: str, what: str) -> None:
        super().__init__(f"{path}: the file segment {segment_id} references in place has "
                         f"changed since it was committed ({what}); not served")
        self.tier = tier
        self.segment_id = segment_id
        self.path = path
        self.what = what
