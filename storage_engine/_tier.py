"""The tier ABC: where the bytes of segments live.

A *segment* is the unit a tier stores: the bytes one commit writes to one tier, packed
tensor after tensor (each extent 64-byte aligned). The catalog records which tensor
lies at which offset of which segment; a tier knows nothing of tensors.

Protocol for a writer (any process):
  1. ``w = tier.create(segment_id, nbytes)``: a new segment, exclusively locked by the
     calling process for as long as ``w`` is open, writable through ``w.buffer``;
  2. fill ``w.buffer``; ``w.finish()`` makes the bytes durable for the tier;
  3. register the segment in the catalog (one SQL transaction);
  4. ``w.release()`` drops the lock (or ``w.abort()`` deletes the segment).
A writer that dies anywhere in 1-3 leaves an unregistered segment whose lock died with
it: ``reclaim_orphans`` deletes exactly those, never one whose writer still runs.

Readers ``open`` a segment as a private copy-on-write mapping: their writes never reach
the tier, and the mapping stays valid after the segment is deleted.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator

import numpy as np

__all__ = ["Tier", "SegmentWriter"]


class SegmentWriter(ABC):
    """A segment being written; holds the segment's lock until released or aborted."""

    segment_id: str
    nbytes: int

    @property
    @abstractmethod
    def buffer(self) -> np.ndarray:
        """The segment's bytes as a writable uint8 array of length ``nbytes``."""

    @abstractmethod
    def finish(self) -> None:
        """Make the written bytes durable on the tier (fsync on disk). Keeps the lock."""

    @abstractmethod
    def release(self) -> None:
        """Drop the lock: call once the catalog references the segment."""

    @abstractmethod
    def abort(self) -> None:
        """Delete the segment and drop the lock. Idempotent."""


class Tier(ABC):
    """One place for segment bytes (host shared memory, disk, GPU memory)."""

    name: str
    #: the tier's mappings live in GPU memory
    supports_gpu: bool = False
    #: segments survive a reboot of the host
    persistent: bool = False

    @abstractmethod
    def create(self, segment_id: str, nbytes: int) -> SegmentWriter:
        """Start a new segment of ``nbytes`` (> 0). Raises TierFull past capacity."""

    @abstractmethod
    def open(self, segment_id: str) -> memoryview | object:
        """Map a segment copy-on-write; raises SegmentMissing. Safe from any process."""

    @abstractmethod
    def delete(self, segment_id: str) -> bool:
        """Delete a segment; existing mappings stay valid. False if it was not there."""

    @abstractmethod
    def segments(self) -> Iterator[str]:
        """The ids of the segments on this tier (registered or not)."""

    @abstractmethod
    def reclaim_orphans(self, is_registered: Callable[[str], bool]) -> list[str]:
        """Delete segments whose writer died before registering them; return their ids.

        ``is_registered`` is asked again after the segment's lock has been taken, so a
        writer that registers concurrently never loses its segment.
        """

    @abstractmethod
    def used_bytes(self) -> int:
        """Bytes held by segments on this tier."""

    def peek(self, segment_id: str, ranges: list[tuple[int, int]]) -> list[bytes] | None:
        """A few small byte ranges ``(offset, length)`` of a segment, read without mapping
        it; None where the tier cannot do that cheaply (the caller then does without).
        Raises SegmentMissing."""
        return None

    def read_into(self, segment_id: str, items: list[tuple[int, np.ndarray]]) -> bool:
        """Copy bytes of a segment into caller buffers: each ``(offset, out)`` fills the
        contiguous uint8 array ``out`` from ``offset``, without mapping the segment in
        the caller (no page faults on the source side). False where the tier cannot
        (the caller then copies from a mapping). Raises SegmentMissing."""
        return False

    def close(self) -> None:
        """Release process-local resources (spare buffers, threads). Idempotent."""
