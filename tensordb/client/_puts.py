"""What a transaction hands the write path: the value types of its puts (a tensor's
byte source, a file's byte range, a shard's box, the group a rank commits in) and the
checksum of a tensor's bytes. Below both ``_transaction`` (which makes them) and
``_write`` (which stores them)."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

import storage_engine as se
from tensordb.errors import InvalidInput

__all__ = ["Extents", "FileRange", "GROUP_TIMEOUT", "GroupSpec", "ManyFill", "RawPut", "ShardPut", "digest",
           "group_spec", "source"]


@dataclass(frozen=True, slots=True)
class FileRange:
    """A put's bytes as a byte range of a file, read at commit by the storage engine
    (``se.fill_from_file``): ``fd`` open on the file at ``path``, from ``offset``;
    ``advance`` is told the bytes once they are in (a progress bar)."""

    fd: int
    offset: int
    path: str
    advance: Callable[[int], None]


class Extents:
    """Where a ``many`` fill writes its puts' bytes: a segment, by offset. A fresh file
    is written through its descriptor (``pwrite``: the kernel makes each page as it is
    written, where a mapping would fault it in and zero it first), any other segment
    through its mapping. Thread-safe: the writes of one fill run on many threads."""

    def __init__(self, writer: se.SegmentWriter) -> None:
        self._writer = writer
        self.fd = writer.write_fd
        self._buf = writer.buffer if self.fd is None else None

    def write(self, offset: int, data: memoryview) -> None:
        """``data`` at ``offset`` of the segment."""
        if self._buf is not None:
            self._buf[offset:offset + data.nbytes] = np.frombuffer(data, np.uint8)
            return
        assert self.fd is not None
        done = 0
        while done < data.nbytes:
            try:
                done += os.pwrite(self.fd, data[done:], offset + done)
            except OSError as exc:
                if exc.errno not in (errno.ENOSPC, errno.EDQUOT) or \
                        not self._writer.out_of_space(exc):
                    raise

    def view(self, offset: int, nbytes: int) -> np.ndarray | None:
        """The extent's bytes in place (None where the segment is written through its
        descriptor: ``read`` them)."""
        return None if self._buf is None else self._buf[offset:offset + nbytes]

    def read(self, offset: int, out: memoryview) -> None:
        """The bytes at ``offset`` into ``out`` (to hash what was written)."""
        if self._buf is not None:
            np.frombuffer(out, np.uint8)[:] = self._buf[offset:offset + out.nbytes]
            return
        assert self.fd is not None
        done = 0
        while done < out.nbytes:
            got = os.preadv(self.fd, [out[done:]], offset + done)
            if got <= 0:
                raise OSError(errno.EIO, f"segment ends at {offset + done}")
            done += got


#: fills the extents of several puts in one call: given each put's (tag, offset in the
#: segment, nbytes), in the segment's order, and the segment's ``Extents``, returns their
#: checksums (an import from an object store, whose GETs for every tensor of a batch
#: are in flight together)
ManyFill = Callable[[list[tuple[object, int, int]], Extents], list[str]]


@dataclass(frozen=True, slots=True)
class RawPut:
    """A tensor whose bytes a function writes straight into the extent at commit; or,
    with ``file``, that the store reads from a file's byte range; or, with ``many``,
    that one call fills together with the other puts naming the same ``many`` (given
    this put's ``tag``). ``fill`` is then not called."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int
    fill: Callable[[np.ndarray], str | None]
    file: FileRange | None = None
    many: ManyFill | None = None
    tag: object = None


@dataclass(frozen=True, slots=True)
class ShardPut:
    """A box of a tensor: ``tensor`` holds the part at ``offsets`` of ``global_shape``."""

    tensor: torch.Tensor
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class GroupSpec:
    """The group transaction a rank takes part in."""

    name: str
    rank: int
    world_size: int
    timeout: float


#: seconds a group transaction waits for its last part before it aborts
GROUP_TIMEOUT = 600.0


def group_spec(collection: str, group: object, rank: object, world_size: object,
               timeout: object) -> GroupSpec | None:
    """The group arguments of ``Database.transaction`` checked, or None for none."""
    if group is None:
        if rank is not None or world_size is not None:
            raise InvalidInput("rank and world_size need a group name (group=...)",
                               collection=collection)
        return None
    if not isinstance(group, str) or not group or len(group) > 255 or not group.isprintable():
        raise InvalidInput(f"group must be a printable name of 1-255 characters, not {group!r}",
                           collection=collection)
    for what, v in (("rank", rank), ("world_size", world_size)):
        if not isinstance(v, int) or isinstance(v, bool):
            raise InvalidInput(f"a group transaction needs {what} as an int, not {v!r}",
                               collection=collection)
    assert isinstance(rank, int) and isinstance(world_size, int)
    if world_size < 1 or not 0 <= rank < world_size:
        raise InvalidInput(f"rank {rank} is out of range for world_size {world_size}",
                           collection=collection)
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) \
            or not 0 < timeout <= 7 * 86400:
        raise InvalidInput(f"timeout must be a number of seconds in (0, 604800], not "
                           f"{timeout!r}", collection=collection)
    return GroupSpec(group, rank, world_size, float(timeout))


def source(t: torch.Tensor | RawPut) -> se.Source:
    if isinstance(t, RawPut):
        return t.fill
    if t.is_contiguous():
        return t.reshape(-1).view(torch.uint8).numpy()

    def fill(dst: np.ndarray, t: torch.Tensor = t) -> None:
        torch.from_numpy(dst).view(t.dtype).view(t.shape).copy_(t)

    return fill


def digest(t: torch.Tensor) -> str:
    """The checksum of a tensor's bytes in C order. A strided tensor is hashed in
    pieces of about ``se.HASH_PIECE`` bytes, never copied whole: an expanded tensor of
    10**9 elements (4 bytes of memory) would otherwise take 4 GB to hash."""
    if t.is_contiguous():
        return se.checksum(t.reshape(-1).view(torch.uint8).numpy())
    h = se.Hasher()
    for piece in _pieces(t, se.HASH_PIECE):
        h.update(piece.reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def _pieces(t: torch.Tensor, piece: int) -> Iterator[torch.Tensor]:
    """Contiguous copies of consecutive parts of ``t`` (in C order), each of at most
    ``piece`` bytes unless one row of the last dimension is larger."""
    if t.dim() <= 1:
        step = max(1, piece // max(1, t.element_size()))
        flat = t.reshape(-1) if t.dim() == 0 else t
        for lo in range(0, flat.shape[0], step):
            yield flat[lo : lo + step].contiguous()
        return
    row = t[0].numel() * t.element_size()
    if row > piece:
        for i in range(t.shape[0]):
            yield from _pieces(t[i], piece)
        return
    step = max(1, piece // max(1, row))
    for lo in range(0, t.shape[0], step):
        yield t[lo : lo + step].contiguous()
