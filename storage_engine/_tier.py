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

Readers ``open`` a segment as a ``SegmentView``. On a host tier it is a private
copy-on-write mapping: their writes never reach the tier, and the mapping stays valid
and unchanged after the segment is deleted (a file tier recycles a deleted file only
when no reader maps it). On the GPU tier it is shared device memory, read-only by
convention, also valid after a delete. Callers read the view's ``on_device`` rather
than its type, and the tier's capability properties rather than the tier's type.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from typing import Protocol, runtime_checkable

import numpy as np
import pyarrow as pa

__all__ = ["Tier", "SegmentWriter", "SegmentView", "Prefaulting", "Pooling", "arrow_buffer"]


@runtime_checkable
class SegmentView(Protocol):
    """The bytes of one open segment, on the host or on a device (zarr's one ``Buffer``
    type for CPU and GPU bytes).

    A host view also has the buffer protocol (``torch.frombuffer``/``np.frombuffer``
    map it with no copy); a device view has ``__cuda_array_interface__``.
    """

    @property
    def on_device(self) -> bool:
        """The bytes are in device memory (then ``host_bytes`` copies them)."""

    @property
    def device(self) -> int | None:
        """The CUDA ordinal, in this process, of a device view; None on the host."""

    def __len__(self) -> int:
        """The segment's size in bytes."""

    def host_bytes(self, offset: int = 0, nbytes: int | None = None) -> np.ndarray:
        """``nbytes`` from ``offset`` (default: to the end) as a uint8 array on the host:
        a view over the mapping (no copy) for a host view, a new copy for a device view.
        ValueError (device) when the range lies outside the segment."""


def arrow_buffer(view: SegmentView, offset: int = 0, nbytes: int | None = None) -> pa.Buffer:
    """``nbytes`` of a segment from ``offset`` (default: to the end) as a
    ``pyarrow.Buffer``: over the mapping itself for a host view (no copy; the buffer
    holds the mapping, which stays valid while the buffer lives, whatever happens to the
    segment's file), a host copy of a device view (Arrow's CUDA buffers need a CUDA
    build of pyarrow)."""
    return pa.py_buffer(view.host_bytes(offset, nbytes))


@runtime_checkable
class Prefaulting(Protocol):
    """An optional feature of a tier: a pre-faulted *spare* file, so that the next
    segment that fits is written at memcpy speed (the host tier has it)."""

    def prefault(self, nbytes: int, *, wait: bool = True) -> None:
        """Allocate and map a spare of ``nbytes`` (``wait``: block until it is ready)."""

    def spare_ready(self) -> int:
        """Bytes of the spare ready now (0: none, or still being faulted)."""

    def spare_for(self, nbytes: int) -> int:
        """The spare size that holds a segment of ``nbytes`` of tensors."""


@runtime_checkable
class Pooling(Protocol):
    """An optional feature of a tier: a *pool* of freed segment files, shared by the
    store's processes, that later writes reuse without page faults (the host tier has
    it). A delete pools a file only when no reader maps it; the pool holds at most
    ``pool_limit`` bytes and gives them back under memory pressure and when trimmed."""

    @property
    def pool_limit(self) -> int:
        """Bytes the pool may hold (0: the tier does not pool)."""

    def pooled_bytes(self) -> int:
        """Bytes of pages the pool holds now."""

    def trim_pool(self, limit: int | None = None) -> int:
        """Give pooled files back until at most ``limit`` bytes remain (default: the
        bound; 0: all); returns the bytes given back."""

    def pool_counters(self) -> dict[str, int]:
        """This process's figures: files claimed by writes, pooled by deletes, given back."""


class SegmentWriter(ABC):
    """A segment being written; holds the segment's lock until released or aborted."""

    segment_id: str
    nbytes: int

    @property
    @abstractmethod
    def buffer(self) -> np.ndarray:
        """The segment's bytes as a writable uint8 array of length ``nbytes``."""

    @property
    def write_fd(self) -> int | None:
        """A descriptor to ``pwrite`` the segment's bytes through instead of filling
        ``buffer``, while that costs less: a fresh file nothing has mapped yet, whose
        pages the kernel makes as they are written (``buffer`` would fault each one in
        and zero it first). None (the default): fill ``buffer``. The fills use it
        (``fill_from_addresses``, ``fill_from_file``); a write through it that finds the
        medium full is handed to ``out_of_space``."""
        return None

    def out_of_space(self, exc: OSError) -> bool:
        """A write through ``write_fd`` found the medium full (``exc``): True when room
        was made for writing again (the tier gave back its pool), else TierFull."""
        raise exc

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
    """One place for segment bytes (host shared memory, disk, GPU memory).

    Capability properties, read by callers instead of the tier's type: ``supports_gpu``
    (views are on a device), ``persistent`` (segments survive a reboot), ``file_backed``
    (segments are files, one each, at ``path(segment_id)``). The contract every tier
    passes is ``storage_engine.testing.TierTests``.
    """

    name: str
    #: the tier's views live in GPU memory (``SegmentView.on_device``)
    supports_gpu: bool = False
    #: segments survive a reboot of the host
    persistent: bool = False
    #: each segment is a file of its own, ``path(segment_id)``, that a caller may write
    #: and rename into place (a pulled replica arrives that way)
    file_backed: bool = False

    @abstractmethod
    def create(self, segment_id: str, nbytes: int) -> SegmentWriter:
        """Start a new segment of ``nbytes`` (> 0). Raises TierFull past capacity."""

    @abstractmethod
    def open(self, segment_id: str) -> SegmentView:
        """A view of a segment (see the module docstring); raises SegmentMissing. Safe
        from any process."""

    @abstractmethod
    def delete(self, segment_id: str) -> bool:
        """Delete a segment; existing views stay valid. False if it was not there."""

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

    def inspect(self, segment_id: str) -> SegmentView:
        """A view of a segment for checking its bytes against their checksums: as
        ``open``, but a file tier consults no integrity mark and verifies nothing (the
        scrub and ``verify`` read through it)."""
        return self.open(segment_id)

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

    def close(self) -> None:  # noqa: B027 - a no-op default: most tiers hold nothing
        """Release process-local resources (spare buffers, threads). Idempotent."""
