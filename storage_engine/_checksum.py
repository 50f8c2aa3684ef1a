"""Extent checksums: xxh3-64 over the tensor's bytes, written as 16 hex digits.

The write path copies and hashes in one pass over memory. The compiled extension
(``storage_engine._stream``, required) has XXH3 of the vendored xxHash (the release the
xxhash package ships; its digests are checked against the package's at import), and
hashes each 4 KiB piece of the source, which brings it into L1, and streams it
from there into the extent around the cache: the source crosses the memory bus once and
the destination is never read. Measured on a 2-core host, two threads, per GiB: 67 ms,
against 81 ms hashing and streaming 2 MiB pieces from Python and 102 ms copying with
memcpy, whose ordinary stores read every destination line first, then hashing the
destination. A source changed by another thread while it is copied can leave a piece
whose stored bytes differ from the bytes hashed; reads that verify then report the
extent as corrupt, which is what it is. Were the two digests ever to differ, pieces are
hashed from Python and streamed by the extension; a copy the
extension cannot stream (a strided or read-only buffer) goes through numpy, hashed
from the destination while it is still in cache.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import xxhash

from . import _stream
from ._stream import stream_copy as _stream_copy
from ._work import add_work


def _bind_copy_hash() -> Callable[[np.ndarray, np.ndarray], int] | None:
    """The extension's one-pass copy + xxh3 (the vendored xxHash,
    ``storage_engine/xxhash``), checked against the ``xxhash`` package's digests on the
    streamed and the one-shot paths before it is used; None where they differ."""
    ok = True
    for size in (256 * 1031, 8192, 100):
        probe = np.frombuffer(bytes(range(256)) * (size // 256 + 1), np.uint8)[:size]
        out = np.empty_like(probe)
        ok = ok and (_stream.stream_copy_hash(out, probe) == xxhash.xxh3_64_intdigest(probe)
                     and np.array_equal(out, probe))
    return _stream.stream_copy_hash if ok else None


_copy_hash = _bind_copy_hash()
#: the extension's batch of one-pass copies from raw addresses (``fill_from_addresses``):
#: there only where the extension's digests are the xxhash package's
copy_hash_many: Callable[..., None] | None = \
    _stream.copy_hash_many if _copy_hash is not None else None

__all__ = ["ALGORITHM", "HASH_PIECE", "Hasher", "checksum", "copy", "copy_and_checksum",
           "STREAMING"]

ALGORITHM = "xxh3_64"
_CHUNK = 1 << 20  # half an L2 (2 MiB here): 512 KiB-1 MiB measured best, 64 KiB half as fast
#: hash-then-stream pieces: small enough to stay in cache between the two passes on
#: every core at once, large enough that the per-call cost vanishes
_STREAM_PIECE = 2 << 20
#: bytes to write before hashing them while still in cache, for writers that fill
#: extents themselves (``Source`` callables that return the checksum)
HASH_PIECE = _CHUNK
#: an incremental hasher whose ``hexdigest`` equals ``checksum`` of the bytes fed to it
Hasher = xxhash.xxh3_64
#: whether copies stream around the cache: always, the compiled extension being
#: required (kept for callers that read it)
STREAMING = True
#: whether copy_and_checksum hashes and streams in one pass (the extension bound to
#: the xxhash package's XXH3)
ONE_PASS = _copy_hash is not None


def _streamable(dst: np.ndarray, src: np.ndarray) -> bool:
    return bool(dst.flags.c_contiguous and src.flags.c_contiguous and dst.flags.writeable)


def checksum(buf: np.ndarray | memoryview | bytes) -> str:
    """Checksum of a byte buffer (releases the GIL while hashing)."""
    add_work("bytes_hashed", memoryview(buf).nbytes)
    return xxhash.xxh3_64_hexdigest(buf)


def copy(dst: np.ndarray, src: np.ndarray) -> None:
    """Copy the uint8 array ``src`` into ``dst`` (same length), streamed around the cache
    where both are contiguous and ``dst`` is writable, else through numpy (releases the
    GIL)."""
    add_work("bytes_copied", src.nbytes)
    if not _streamable(dst, src):
        np.copyto(dst, src)
    else:
        _stream_copy(dst, src)


def copy_and_checksum(dst: np.ndarray, src: np.ndarray) -> str:
    """Copy the uint8 array ``src`` into ``dst`` (same length) and return its checksum."""
    n = src.shape[0]
    add_work("bytes_copied", src.nbytes)
    add_work("bytes_hashed", src.nbytes)
    if _copy_hash is not None and _streamable(dst, src):
        return f"{_copy_hash(dst, src):016x}"
    if _streamable(dst, src):
        if n <= _STREAM_PIECE:
            digest = xxhash.xxh3_64_hexdigest(src)
            _stream_copy(dst, src)
            return digest
        h = xxhash.xxh3_64()
        for lo in range(0, n, _STREAM_PIECE):
            s = src[lo : lo + _STREAM_PIECE]
            h.update(s)
            _stream_copy(dst[lo : lo + _STREAM_PIECE], s)
        return h.hexdigest()
    if n <= _CHUNK:
        np.copyto(dst, src)
        return xxhash.xxh3_64_hexdigest(dst)
    h = xxhash.xxh3_64()
    for lo in range(0, n, _CHUNK):
        hi = min(lo + _CHUNK, n)
        d = dst[lo:hi]
        np.copyto(d, src[lo:hi])
        h.update(d)
    return h.hexdigest()
