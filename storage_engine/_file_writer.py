"""A segment of a file tier being written: the ``SegmentWriter`` of ``_files``.

The writer owns the segment's file for the length of a commit: its locked descriptor,
its shared mapping once somebody asks for ``buffer``, and the order of the steps of
the tier protocol (``_tier``). What it needs of its tier is the narrow ``WriterTier``
below, not the tier's inner workings: the tier allocates pages, syncs its directory,
keeps or unmaps a mapping, pools or unlinks a dropped file, and is told when a segment
is written and when its writer lets go.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path
from typing import Protocol

import numpy as np

from ._errors import TierFull
from ._mapping import map_shared
from ._tier import SegmentWriter

__all__ = ["FileWriter", "WriterTier"]


class WriterTier(Protocol):
    """What a ``FileWriter`` asks of its tier (``FileTier`` is one)."""

    @property
    def name(self) -> str:
        """The tier's name, for ``TierFull``."""

    @property
    def persistent(self) -> bool:
        """Whether a finished segment is flushed and fsynced (its directory too)."""

    @property
    def capacity(self) -> int | None:
        """The tier's bound, for ``TierFull`` (None: the medium's)."""

    def used_bytes(self) -> int:
        """Bytes the tier's segments hold now, for ``TierFull``."""

    def trim_pool(self, limit: int | None = None) -> int:
        """Give pooled files back to the system (0: all); the bytes given back."""

    def allocate(self, fd: int, offset: int, nbytes: int) -> None:
        """Allocate the file's pages for real (``posix_fallocate``), giving the pool's
        files back first on a full medium; TierFull if that is not enough."""

    def sync_dir(self) -> None:
        """fsync the tier's directory (a new name in it is durable)."""

    def retire_mapping(self, map_fd: int, mm: mmap.mmap) -> None:
        """Take a writer's mapping it is done with (kept for the file's next turn from
        the pool, or unmapped in the background)."""

    def discard(self, path: Path, fd: int) -> None:
        """Drop the file at ``path``, exclusively locked by the caller through ``fd``:
        pooled where it fits, else unlinked."""

    def segment_written(self, segment_id: str, fd: int) -> None:
        """A writer finished a segment's bytes (the disk tier marks it verified)."""

    def writer_released(self) -> None:
        """A writer let go of its segment (the host tier refills its spare)."""


class FileWriter(SegmentWriter):
    """A segment being written. ``mm`` None: a fresh file nothing maps yet, written
    through ``write_fd`` (``_direct``) until someone asks for ``buffer``, which then
    allocates the rest of its pages and maps it as a fresh file was before."""

    def __init__(self, tier: WriterTier, segment_id: str, path: Path, fd: int,
                 map_fd: int | None, mm: mmap.mmap | None, nbytes: int) -> None:
        self._tier = tier
        self.segment_id = segment_id
        self.nbytes = nbytes
        self._path = path
        self._fd: int | None = fd
        self._map_fd = map_fd
        self._mm: mmap.mmap | None = mm
        self._done = False
        self._room_made = False
        self._buffer = np.frombuffer(mm, dtype=np.uint8, count=nbytes) if mm is not None \
            else None

    @property
    def buffer(self) -> np.ndarray:
        if self._buffer is None:  # a fresh file written through its descriptor so far
            assert self._fd is not None
            self._tier.allocate(self._fd, 0, self.nbytes)  # no SIGBUS on a full tmpfs
            self._map_fd, self._mm = map_shared(self._path, self.nbytes, "fresh")
            self._buffer = np.frombuffer(self._mm, dtype=np.uint8, count=self.nbytes)
        return self._buffer

    @property
    def write_fd(self) -> int | None:
        return self._fd if self._mm is None and not self._done else None

    def out_of_space(self, exc: OSError) -> bool:
        if not self._room_made:
            self._room_made = True
            if self._tier.trim_pool(0):
                return True
        raise TierFull(self._tier.name, self.nbytes, self._tier.used_bytes(),
                       self._tier.capacity or self._tier.used_bytes()) from exc

    def _unmap(self) -> None:
        self._done = True
        self._buffer = np.empty(0, np.uint8)
        if self._mm is not None:
            mm, self._mm = self._mm, None
            assert self._map_fd is not None
            # only once the catalog commit is done (release), never beside it: the
            # mapping is kept for the file's next turn from the pool, or unmapped in
            # the background
            self._tier.retire_mapping(self._map_fd, mm)

    def finish(self) -> None:
        if self._done or self._fd is None:
            return
        if self._tier.persistent and self._mm is not None:
            self._mm.flush()
        if os.fstat(self._fd).st_size != self.nbytes:
            os.ftruncate(self._fd, self.nbytes)  # a spare larger than the segment
        if self._tier.persistent:
            os.fsync(self._fd)
            self._tier.sync_dir()
        self._tier.segment_written(self.segment_id, self._fd)

    def release(self) -> None:
        self._unmap()
        if self._fd is not None:
            os.close(self._fd)  # closing drops the flock
            self._fd = None
            self._tier.writer_released()

    def abort(self) -> None:
        if self._fd is not None:
            # still locked by us, so nobody maps it: it may go to the pool
            self._tier.discard(self._path, self._fd)
        self._unmap()
        self.release()
