"""The disk tier: segments under the store's data directory, durable before they are
registered, checked once per boot, and files committed in place.

On top of the file tier (``_files``) it adds what only a disk has: a segment's first
open per boot (or after its file changed) hashes its extents against the catalog and
marks what fails (docs/storage.md, "Integrity model"); and ``adopt``, which makes a file
the caller already has the bytes of a segment without copying them, as a reflinked
clone where the filesystem shares extents, else as a reference to the file itself.
"""

from __future__ import annotations

import errno
import mmap
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from ._errors import SegmentMissing
from ._files import FileTier, HostView
from ._integrity import WHOLE, Extent, Marks, check_extents
from ._pool import lock_nb
from ._sources import SourceFile, check, reflink

__all__ = ["Adoption", "DiskTier"]


class Adoption:
    """A file being committed in place (``DiskTier.adopt``), until released or aborted.

    ``reflinked``: the segment is a clone in the tier (the store's own file, ``fd`` open
    on it and locked, as a writer's is); else it is a reference to ``source``, and
    ``fd`` is the caller's descriptor of that file. ``fd`` is what to hash the bytes
    from: the clone's bytes are the segment's, whatever happens to the original.
    ``source`` is the record of the file (for a clone: the original's path and the
    clone's own size and identity); ``nbytes`` the segment's size."""

    def __init__(self, tier: DiskTier, segment_id: str, source: SourceFile, fd: int,
                 reflinked: bool) -> None:
        self.segment_id = segment_id
        self.source = source
        self.nbytes = source.nbytes
        self.fd = fd
        self.reflinked = reflinked
        self._tier = tier
        self._open = reflinked

    def release(self) -> None:
        """Drop the clone's lock: call once the catalog references the segment."""
        if self._open:
            self._open = False
            os.close(self.fd)

    def abort(self) -> None:
        """Delete the clone (never the original). Idempotent."""
        if self.reflinked and self._open:
            try:
                os.unlink(self._tier.path(self.segment_id))
            except FileNotFoundError:
                pass
        self.release()


class DiskTier(FileTier):
    """Segments under the store's data directory, fsynced before they are registered;
    and segments committed in place (``adopt``): a reflinked clone in the directory,
    or a reference to a file elsewhere, which ``sources`` (segment id -> the recorded
    ``SourceFile``, or None) looks up when a segment has no file of its own here. It
    keeps no pool: a disk file's blocks cost little to allocate again."""

    def __init__(self, root: Path, *, capacity: int | None = None,
                 sources: Callable[[str], SourceFile | None] | None = None,
                 marks: Marks | None = None,
                 extents: Callable[[str], Sequence[Extent]] | None = None) -> None:
        super().__init__("disk", root, capacity=capacity, persistent=True, pool_limit=0,
                         marks=marks)
        self.sources = sources
        #: segment id -> its extents as the catalog records them: what a first open
        #: per boot checks (docs/storage.md, "Integrity model")
        self.extents = extents

    def segment_written(self, segment_id: str, fd: int) -> None:
        # bytes this boot wrote were hashed as they were copied in: no need to read
        # them back (a later write through the filesystem changes the identity)
        if self.marks is not None:
            self.marks.mark_verified(segment_id, os.fstat(fd))

    def _check_first_open(self, segment_id: str, fd: int, view: HostView | None) -> None:
        """The first open of a segment per boot (or after its file changed) hashes every
        extent against the catalog: each that fails is marked corrupt (readers refuse
        it); a segment with none is marked verified, so nobody hashes it again on this
        boot."""
        if self.marks is None or self.extents is None:
            return
        st = os.fstat(fd)
        if self.marks.verified(segment_id, st) or self.marks.corrupt(segment_id) is not None:
            return  # checked on this boot (the extents that failed are marked)
        extents = self.extents(segment_id)
        if not extents:
            return  # not (yet) recorded: nothing to check against
        mm = view if view is not None else (
            mmap.mmap(fd, 0, access=mmap.ACCESS_READ) if st.st_size else None)
        try:
            if mm is None:
                bad = [(WHOLE, "the file is empty (truncated)")]
            else:
                bad = check_extents(
                    lambda o, n: np.frombuffer(mm, np.uint8, count=n, offset=o),
                    len(mm), extents)
        finally:
            if view is None and mm is not None:
                mm.close()
        for offset, reason in bad:
            self.marks.mark_corrupt(segment_id, offset, reason)
        if not bad:
            self.marks.mark_verified(segment_id, st)

    def adopt(self, segment_id: str, fd: int, path: str) -> Adoption:
        """Make the regular file open as ``fd`` (at absolute ``path``) the bytes of a new
        segment, without copying them: a reflinked clone where the filesystem shares
        extents, else a reference, for the caller to record as ``Adoption.source`` in
        the same catalog transaction that registers the segment. OSError for a clone
        that fails for another reason than "unsupported" (nothing is left behind)."""
        st = os.fstat(fd)
        source = SourceFile.of(path, st)
        final = self.path(segment_id)
        dst = os.open(final, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o600)
        try:
            if not lock_nb(dst):  # nobody else can know this fresh name
                raise OSError(errno.EWOULDBLOCK, f"cannot lock new segment {final}")
            if reflink(dst, fd):
                os.fsync(dst)
                self.sync_dir()
                # the clone's own size: the bytes the segment holds, whatever the
                # original did since it was looked at
                clone = SourceFile.of(path, os.fstat(dst))
                # its bytes are hashed now, by the import: they are the checksums
                self.segment_written(segment_id, dst)
                return Adoption(self, segment_id, clone, dst, reflinked=True)
        except BaseException:
            os.close(dst)
            os.unlink(final)
            raise
        os.close(dst)
        os.unlink(final)
        self.segment_written(segment_id, fd)  # the file as it is recorded (see above)
        return Adoption(self, segment_id, source, fd, reflinked=False)

    def _open_ro(self, segment_id: str) -> int:
        """The segment's own file, else the file it references (checked against the
        record: ``SourceChanged`` when it differs or is gone)."""
        try:
            return os.open(self.path(segment_id), os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError as exc:
            source = self.sources(segment_id) if self.sources is not None else None
            if source is None:
                raise SegmentMissing(self.name, segment_id) from exc
        return check(self.name, segment_id, source)
