"""Segments that are a file the store did not write: a reflinked clone, or a reference.

``DiskTier.adopt`` turns a local file into a segment without copying its bytes. Where
the filesystem can share extents (``FICLONE``: btrfs, XFS with reflink, bcachefs, ...)
the segment is a clone in the tier's directory: the store's own file, which later edits
of the original never reach. Elsewhere (ext4, tmpfs, across filesystems) the segment is
a *reference*: the catalog records the file's path, size, mtime and identity (inode,
device), and every open of the segment checks the file against that record first
(``check``), refusing it with ``SourceChanged`` when any of them differ. What the check
cannot see (a write that restores the mtime, a change made after a reader mapped the
file) the checksums of a verifying read can; a reader that mapped the file before a
change may see the change, as with any mapping of a file (safetensors' own included).
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat as stat_mod
from dataclasses import dataclass

from ._errors import SourceChanged

__all__ = ["SourceFile", "FICLONE", "REFLINK_UNSUPPORTED", "reflink", "check"]

#: ``ioctl(dst, FICLONE, src)``: share all of ``src``'s extents with the empty ``dst``
FICLONE = 0x40049409
#: errnos meaning "this filesystem (or this pair of files) cannot share extents": the
#: caller falls back to a reference; any other error is a real failure
REFLINK_UNSUPPORTED = frozenset({errno.EOPNOTSUPP, errno.ENOTSUP, errno.EXDEV, errno.EINVAL,
                                 errno.ENOTTY, errno.ENOSYS, errno.EPERM})


@dataclass(frozen=True, slots=True)
class SourceFile:
    """What the store recorded of a file it references: its absolute path, size,
    modification time (ns) and identity (inode, device)."""

    path: str
    nbytes: int
    mtime_ns: int
    inode: int
    dev: int

    @classmethod
    def of(cls, path: str, st: os.stat_result) -> SourceFile:
        return cls(path, st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev)

    def differences(self, st: os.stat_result) -> list[str]:
        """What differs between this record and ``st`` of the file now ([] if none)."""
        out: list[str] = []
        if (st.st_ino, st.st_dev) != (self.inode, self.dev):
            out.append(f"replaced: inode {self.inode} on device {self.dev} is now inode "
                       f"{st.st_ino} on device {st.st_dev}")
        if st.st_size != self.nbytes:
            out.append(f"size {self.nbytes:,} -> {st.st_size:,} bytes")
        if st.st_mtime_ns != self.mtime_ns:
            out.append(f"mtime_ns {self.mtime_ns} -> {st.st_mtime_ns}")
        if not stat_mod.S_ISREG(st.st_mode):
            out.append("not a regular file")
        return out


def check(tier: str, segment_id: str, source: SourceFile) -> int:
    """A read-only descriptor of the referenced file, after checking it is the file that
    was committed (size, mtime, inode, device); ``SourceChanged`` naming what differs,
    or that it is gone."""
    try:
        fd = os.open(source.path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise SourceChanged(tier, segment_id, source.path, "deleted") from None
    except OSError as exc:
        raise SourceChanged(tier, segment_id, source.path,
                            f"cannot open: {exc.strerror}") from None
    try:
        diff = source.differences(os.fstat(fd))
    except BaseException:
        os.close(fd)
        raise
    if diff:
        os.close(fd)
        raise SourceChanged(tier, segment_id, source.path, "; ".join(diff))
    return fd


def reflink(dst_fd: int, src_fd: int) -> bool:
    """Clone ``src_fd``'s bytes into the empty file ``dst_fd`` (no bytes copied); False
    where the filesystem cannot (``REFLINK_UNSUPPORTED``), OSError for anything else."""
    try:
        fcntl.ioctl(dst_fd, FICLONE, src_fd)
    except OSError as exc:
        if exc.errno in REFLINK_UNSUPPORTED:
            return False
        raise
    return True
