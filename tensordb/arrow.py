"""The Arrow layout of a version: one row per tensor, its bytes zero-copy.

What ``Snapshot.to_arrow`` returns and what a node server streams to a plain Flight
client (docs/arrow.md), built in one place so the two cannot drift:

============  ==================  ===================================================
column        type                value
============  ==================  ===================================================
``name``      ``string``          the tensor's name
``dtype``     ``string``          tensordb's dtype name (``bfloat16``, ``float8_e4m3fn``)
``shape``     ``list<int64>``     its shape (``[]`` for a scalar)
``nbytes``    ``int64``           its size in bytes
``checksum``  ``string``          xxh3-64 of its bytes, hex
``data``      ``large_binary``    its bytes: a slice of the segment's mapping, no copy
============  ==================  ===================================================

Extents are padded to their alignment, so the values of one segment are not end to end
and a single ``binary`` array cannot point at them; ``binary_view`` could, but its values
are limited to 2 GiB and a model's embedding is often larger. So ``data`` is
``large_binary`` with **one chunk per tensor**, each chunk a one-value array whose data
buffer is the tensor's slice of the mapping. The other columns are one chunk each; a
record batch stream sends one batch per tensor (``Table.to_batches``). The table's
metadata names the layout (``tensordb.layout``: ``"1"``), the collection and the
version.

This module sits below the client facade and the transport (it knows catalog rows and
storage views, nothing above them) and needs no torch. A segment becomes an Arrow buffer
through ``storage_engine.arrow_buffer``.

The integrity gate of the layout (docs/storage.md, "Integrity model") is ``refuse``: an
extent past the end of its segment (a truncated file) or marked corrupt on this host is
``CorruptData`` naming the tensor, never a slice. ``tensors_table`` applies it to every
row it slices (the marks through ``marked``, when given), and a stream that sends the
table later applies it again per batch (``_version_reads``).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import pyarrow as pa

import storage_engine as se
from tensordb.catalog import TensorRow
from tensordb.errors import CorruptData, InvalidInput

__all__ = ["BLOCK_SCHEMA", "LAYOUT", "TENSOR_SCHEMA", "MarksOf", "ViewOf", "arrow_tensor",
           "blocks_table", "numpy_dtype", "refuse", "tensors_table", "truncated"]

#: the version of the layout, in the table's metadata
LAYOUT = "1"

TENSOR_SCHEMA = pa.schema([
    pa.field("name", pa.string(), nullable=False),
    pa.field("dtype", pa.string(), nullable=False),
    pa.field("shape", pa.list_(pa.int64()), nullable=False),
    pa.field("nbytes", pa.int64(), nullable=False),
    pa.field("checksum", pa.string(), nullable=False),
    pa.field("data", pa.large_binary(), nullable=False),
])

#: the layout of ``KVCache.get_arrow``: a row per block, its bytes as in TENSOR_SCHEMA
BLOCK_SCHEMA = pa.schema([
    pa.field("key", pa.binary(), nullable=False),
    pa.field("dtype", pa.string(), nullable=False),
    pa.field("shape", pa.list_(pa.int64()), nullable=False),
    pa.field("nbytes", pa.int64(), nullable=False),
    pa.field("data", pa.large_binary(), nullable=False),
])

# tensordb dtype name -> the numpy dtype an Arrow tensor of it has. Arrow has no
# bfloat16, float8, float4, complex or bool tensors: those come back as their bytes,
# as unsigned integers of the same width (a trailing dimension of 16 bytes for
# complex128, which has no such integer), and the dtype column says what they are.
_NUMPY = {
    "uint8": "u1", "int8": "i1", "int16": "i2", "int32": "i4", "int64": "i8",
    "uint16": "u2", "uint32": "u4", "uint64": "u8",
    "float16": "f2", "float32": "f4", "float64": "f8",
}
_FALLBACK = {
    "bool": "u1", "bfloat16": "u2", "complex32": "u4", "complex64": "u8",
    "float8_e4m3fn": "u1", "float8_e4m3fnuz": "u1", "float8_e5m2": "u1",
    "float8_e5m2fnuz": "u1", "float8_e8m0fnu": "u1", "float4_e2m1fn_x2": "u1",
}

#: a segment's view on this node, given (segment id, the tier its row names)
ViewOf = Callable[[str, str], se.SegmentView]
#: a segment's extents marked corrupt on this host (offset -> why; ``storage_engine.WHOLE``:
#: all of them), or None when none is (``storage_engine.Marks.corrupt``)
MarksOf = Callable[[str], Mapping[int, str] | None]


def truncated(collection: str, name: str, segment_id: str, end: int,
              size: int) -> CorruptData:
    """The error of a read whose extent ends at ``end``, past the ``size`` bytes its
    segment's file holds."""
    return CorruptData(f"{collection}/{name}: its extent ends at byte {end} of segment "
                       f"{segment_id}, which holds {size} (truncated); not served",
                       collection=collection, tensor=name)


def refuse(collection: str, name: str, segment_id: str, offset: int, nbytes: int,
           size: int | None, bad: Mapping[int, str] | None) -> None:
    """CorruptData naming ``collection``/``name`` when its extent (``offset``, ``nbytes``)
    ends past the ``size`` bytes its segment holds (a truncated file; None: not looked
    at) or is among the segment's marked extents ``bad``: no slice of it is made. The
    client's reader words the same refusals the same way."""
    end = offset + nbytes
    if size is not None and end > size:
        raise truncated(collection, name, segment_id, end, size)
    if bad:
        why = bad.get(offset) or bad.get(se.WHOLE)
        if why is not None:
            what = "fail their checksum" if "checksum" in why else "are corrupt"
            raise CorruptData(f"{collection}/{name}: stored bytes {what} (segment "
                              f"{segment_id}, marked by an earlier check: {why}); "
                              f"not served", collection=collection, tensor=name)


def numpy_dtype(dtype: str) -> tuple[np.dtype, int]:
    """The numpy dtype of an Arrow tensor of ``dtype`` and the trailing dimension its
    bytes take (1, except complex128: 16 uint8 per element). InvalidInput for a name
    tensordb does not store."""
    code = _NUMPY.get(dtype) or _FALLBACK.get(dtype)
    if code is not None:
        return np.dtype(code), 1
    if dtype == "complex128":
        return np.dtype("u1"), 16
    raise InvalidInput(f"no Arrow layout for dtype {dtype!r}")


def _check_rows(rows: Sequence[TensorRow]) -> None:
    for dtype in {r.dtype for r in rows}:
        numpy_dtype(dtype)  # a dtype with no layout is refused before any work


def _int64s(values: np.ndarray) -> pa.Array:
    """An int64 array over ``values`` (no copy). Not ``pa.array``: given a numpy array it
    imports ``numpy.ma`` on first use, 15 ms of a fresh process's first ``to_arrow``."""
    return pa.Array.from_buffers(pa.int64(), len(values), [None, pa.py_buffer(values)])


def _strings(values: Sequence[str] | Sequence[bytes], kind: pa.DataType | None = None
             ) -> pa.Array:
    """A string (or binary) array of ``values`` from one joined buffer: ``pa.array`` of
    Python strings sets up its converters on first use, a millisecond of a fresh
    process's first ``to_arrow``."""
    kind = pa.string() if kind is None else kind
    encoded = [v.encode() if isinstance(v, str) else v for v in values]
    n = len(encoded)
    offsets = np.zeros(n + 1, np.int32)
    np.cumsum(np.fromiter(map(len, encoded), np.int32, count=n), out=offsets[1:])
    return pa.Array.from_buffers(kind, n, [None, pa.py_buffer(offsets),
                                           pa.py_buffer(b"".join(encoded))])


def _shapes(shapes: Sequence[tuple[int, ...]]) -> pa.Array:
    """The ``list<int64>`` column of ``shapes``, built from numpy buffers: ``pa.array`` of
    Python lists costs a millisecond more on a fresh process's first call."""
    n = len(shapes)
    offsets = np.zeros(n + 1, np.int32)
    np.cumsum(np.fromiter(map(len, shapes), np.int32, count=n), out=offsets[1:])
    dims = np.fromiter(itertools.chain.from_iterable(shapes), np.int64, count=int(offsets[-1]))
    return pa.Array.from_buffers(pa.list_(pa.int64()), n, [None, pa.py_buffer(offsets)],
                                 children=[_int64s(dims)])


def _chunk_per_value(datas: Sequence[pa.Buffer], sizes: np.ndarray) -> pa.ChunkedArray:
    """A large_binary column of one chunk per value, each chunk's data buffer the value's
    own buffer (no copy)."""
    # every chunk's offsets are [0, nbytes]: one buffer of pairs, sliced per chunk
    pairs = np.zeros((len(datas), 2), np.int64)
    pairs[:, 1] = sizes
    offsets = pa.py_buffer(pairs)
    chunks = [pa.Array.from_buffers(pa.large_binary(), 1, [None, offsets.slice(16 * i, 16), d])
              for i, d in enumerate(datas)]
    return pa.chunked_array(chunks, pa.large_binary())


def tensors_table(rows: Sequence[TensorRow], view_of: ViewOf, *, collection: str,
                  version: int, whole_of: Callable[[TensorRow], pa.Buffer] | None = None,
                  marked: MarksOf | None = None) -> pa.Table:
    """The layout above for ``rows``; ``view_of`` gives a segment's view on this node
    (called once per segment). Zero-copy on the host: each ``data`` value is a slice of
    one Arrow buffer over the segment's mapping. A device view's rows are copied to the
    host one by one, never its whole segment. ``whole_of`` gives the bytes of a sharded
    row (no segment of its own, some bytes), assembled from its shards.

    Every row passes ``refuse`` before it is sliced: CorruptData for an extent past the
    end of its segment, or one of those ``marked`` reports (looked at once per segment,
    after ``view_of``, whose first open of a disk segment may just have marked some)."""
    _check_rows(rows)
    sizes = np.fromiter((r.nbytes for r in rows), np.int64, count=len(rows))
    empty = pa.py_buffer(b"")
    views: dict[str, se.SegmentView] = {}
    bads: dict[str, Mapping[int, str] | None] = {}
    buffers: dict[str, pa.Buffer] = {}
    datas = []
    for r in rows:
        if r.segment_id is None or r.nbytes == 0:
            if r.nbytes:  # sharded
                if whole_of is None:
                    raise InvalidInput(f"{collection}/{r.name} is sharded and this reader "
                                       f"cannot assemble it", collection=collection,
                                       tensor=r.name)
                datas.append(whole_of(r))
                continue
            datas.append(empty)
            continue
        view = views.get(r.segment_id)
        if view is None:
            view = views[r.segment_id] = view_of(r.segment_id, r.tier or "host")
            bads[r.segment_id] = marked(r.segment_id) if marked is not None else None
        bad = bads[r.segment_id]
        if bad or r.offset + r.nbytes > len(view):  # the common case costs no call
            refuse(collection, r.name, r.segment_id, r.offset, r.nbytes, len(view), bad)
        buf = buffers.get(r.segment_id)
        if buf is None:
            if view.on_device:  # this row's bytes come up, not the segment's
                datas.append(se.arrow_buffer(view, r.offset, r.nbytes))
                continue
            buf = buffers[r.segment_id] = se.arrow_buffer(view)
        datas.append(buf.slice(r.offset, r.nbytes))
    columns = [
        _strings([r.name for r in rows]),
        _strings([r.dtype for r in rows]),
        _shapes([r.shape for r in rows]),
        _int64s(sizes),
        _strings([r.checksum for r in rows]),
        _chunk_per_value(datas, sizes),
    ]
    meta = {"tensordb.layout": LAYOUT, "tensordb.collection": collection,
            "tensordb.version": str(version)}
    return pa.Table.from_arrays(columns, schema=TENSOR_SCHEMA.with_metadata(meta))


def blocks_table(keys: Sequence[bytes], dtypes: Sequence[str],
                 shapes: Sequence[tuple[int, ...]], datas: Sequence[np.ndarray], *,
                 namespace: str) -> pa.Table:
    """KV blocks in the layout of ``BLOCK_SCHEMA``: ``datas`` are the blocks' bytes
    (uint8 arrays), wrapped with no copy; each buffer keeps its array, and whatever
    that array keeps alive (a block's read lease), for as long as it lives."""
    sizes = np.fromiter((d.nbytes for d in datas), np.int64, count=len(datas))
    columns = [
        _strings(keys, pa.binary()),
        _strings(dtypes),
        _shapes(shapes),
        _int64s(sizes),
        _chunk_per_value([pa.py_buffer(d) for d in datas], sizes),
    ]
    meta = {"tensordb.layout": LAYOUT, "tensordb.namespace": namespace}
    return pa.Table.from_arrays(columns, schema=BLOCK_SCHEMA.with_metadata(meta))


def arrow_tensor(row: TensorRow, data: pa.Buffer) -> pa.Tensor:
    """One tensor as a ``pyarrow.Tensor`` over ``data`` (its bytes), no copy. Dtypes
    Arrow lacks come back as their bytes (see ``numpy_dtype``)."""
    np_dtype, tail = numpy_dtype(row.dtype)
    shape = tuple(row.shape) + ((tail,) if tail > 1 else ())
    arr = np.frombuffer(data, np_dtype, count=row.nbytes // np_dtype.itemsize)
    return pa.Tensor.from_numpy(arr.reshape(shape))
