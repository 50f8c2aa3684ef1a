"""A version from any Flight client: ``do_put`` of the ``to_arrow`` layout commits it.

Runs in the serving process (``tensordb serve``), on Flight's threads. The descriptor is
a command, ``{"collection": c}`` (optionally ``"message"``); the stream is record
batches with the columns ``name`` (string), ``dtype`` (tensordb's dtype name), ``shape``
(list of int64) and ``data`` (binary or large_binary), and optionally ``checksum`` (xxh3-64
hex: a tensor whose bytes do not match is ``CorruptData``) and ``nbytes``. Every other
column is refused, as is a tensor whose bytes do not fill its shape. The tensors are
committed as one version when the stream ends, in one transaction: a stream that
fails or is cut leaves the store unchanged. The answer (``put`` metadata) is the
version's JSON, ``{"collection", "version", "tensors", "written_nbytes"}``.

The received batches are held until the commit, and each tensor's bytes are copied
once, from them into its extent (``Transaction.put_raw``), hashed there while in cache.
So a stream may hold at most ``MAX_PUT_BYTES`` of tensor bytes (less where the node's
host tier is smaller): a larger one is refused (InvalidInput) as soon as it passes the
limit, before anything is written; commit larger versions through a tensordb client.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa

from tensordb.arrow import numpy_dtype
from tensordb.errors import CorruptData, InvalidInput

from ._base import NodeStore

__all__ = ["MAX_PUT_BYTES", "PUT_KEYS", "answer", "commit_stream", "put_descriptor"]

#: the most tensor bytes one Flight put may hold in memory until it commits
MAX_PUT_BYTES = 4 << 30

#: the keys a put descriptor may have
PUT_KEYS = ("collection", "message")
_REQUIRED = {"name": pa.string(), "dtype": pa.string(), "shape": pa.list_(pa.int64())}
_OPTIONAL = {"checksum": pa.string(), "nbytes": pa.int64()}
_DATA = (pa.binary(), pa.large_binary())


def put_descriptor(req: dict[str, Any]) -> tuple[str, str | None]:
    """(collection, message) of a put descriptor's JSON; InvalidInput naming the fault."""
    extra = sorted(set(req) - set(PUT_KEYS))
    if extra:
        raise InvalidInput(f"a put descriptor has the keys collection and message; "
                           f"unknown: {', '.join(extra)}")
    collection, message = req.get("collection"), req.get("message")
    if not isinstance(collection, str) or not collection:
        raise InvalidInput(f"a put descriptor needs collection (a name), not {collection!r}")
    if message is not None and not isinstance(message, str):
        raise InvalidInput(f"message must be text, not {message!r}", collection=collection)
    return collection, message


def _check_schema(schema: pa.Schema, collection: str) -> None:
    names = schema.names
    if len(set(names)) != len(names):
        raise InvalidInput(f"a put stream names a column twice: {names}",
                           collection=collection)
    for col, kind in _REQUIRED.items():
        if col not in names or schema.field(col).type != kind:
            raise InvalidInput(f"a put stream needs the column {col!r} of type {kind} "
                               f"(the to_arrow layout); it has {schema}",
                               collection=collection)
    if "data" not in names or schema.field("data").type not in _DATA:
        raise InvalidInput("a put stream needs the column 'data' (binary or large_binary)",
                           collection=collection)
    for col in names:
        if col in _REQUIRED or col == "data":
            continue
        if col not in _OPTIONAL or schema.field(col).type != _OPTIONAL[col]:
            raise InvalidInput(f"a put stream's column {col!r} is not one of the layout's "
                               f"(name, dtype, shape, data, checksum, nbytes)",
                               collection=collection)


def _rows(batch: pa.RecordBatch, collection: str
          ) -> Iterator[tuple[str, str, list[int], pa.Buffer, str | None, int | None]]:
    cols = {n: batch.column(i) for i, n in enumerate(batch.schema.names)}
    for n in ("name", "dtype", "shape", "data"):
        if cols[n].null_count:
            raise InvalidInput(f"a put stream's column {n!r} holds a null",
                               collection=collection)
    names, dtypes, shapes = (cols[n].to_pylist() for n in ("name", "dtype", "shape"))
    sums = cols["checksum"].to_pylist() if "checksum" in cols else [None] * batch.num_rows
    sizes = cols["nbytes"].to_pylist() if "nbytes" in cols else [None] * batch.num_rows
    data = cols["data"]
    for i in range(batch.num_rows):
        value = data[i].as_buffer()
        yield names[i], dtypes[i], shapes[i], value, sums[i], sizes[i]


def commit_stream(db: NodeStore, collection: str, message: str | None,
                  batches: Iterator[pa.RecordBatch], schema: pa.Schema,
                  max_bytes: int = MAX_PUT_BYTES) -> dict[str, Any]:
    """Commit the tensors of ``batches`` (of ``schema``) as one version of
    ``collection``; returns what the put answers. Raises before anything is published
    when any tensor is malformed (its bytes not those its dtype and shape take), named
    twice, or its bytes fail its checksum, or when the stream holds more than
    ``max_bytes`` of tensor bytes."""
    _check_schema(schema, collection)
    seen: set[str] = set()
    held = 0
    with db.transaction(collection, message=message) as tx:
        for batch in batches:
            for name, dtype, shape, value, checksum, nbytes in _rows(batch, collection):
                if name in seen:
                    raise InvalidInput(f"a put stream names the tensor {name!r} twice",
                                       collection=collection, tensor=name)
                seen.add(name)
                if nbytes is not None and nbytes != value.size:
                    raise InvalidInput(f"tensor {name!r}: the stream said {nbytes} bytes "
                                       f"and gave {value.size}", collection=collection,
                                       tensor=name)
                _check_size(collection, name, dtype, shape, value.size)
                held += value.size
                if held > max_bytes:
                    raise InvalidInput(f"a Flight put holds its tensors in memory until it "
                                       f"commits, at most {max_bytes} bytes on this node; "
                                       f"this stream passed it at {name!r}: commit it "
                                       f"through a tensordb client", collection=collection,
                                       tensor=name)
                if value.size == 0 and checksum is not None \
                        and checksum != tx.hasher().hexdigest():
                    raise CorruptData(f"tensor {name!r}: it has no bytes, which hash to "
                                      f"{tx.hasher().hexdigest()}; the stream said "
                                      f"{checksum[:40]!r}", collection=collection,
                                      tensor=name)
                tx.put_raw(name, dtype, shape, _filler(tx, collection, name, dtype, shape,
                                                       value, checksum))
    commit = tx.result
    if commit is None:  # nothing published: the block was told to abort
        raise InvalidInput("the put published nothing", collection=collection)
    return {"collection": collection, "version": commit.version, "tensors": commit.tensors,
            "written_nbytes": commit.written_nbytes}


def _check_size(collection: str, name: str, dtype: str, shape: list[int],
                size: int) -> None:
    """InvalidInput unless ``size`` bytes are exactly what a ``dtype`` of ``shape`` takes
    (checked before the store reserves room for the shape: a wild shape is a bad input,
    not a full store)."""
    try:
        np_dtype, trailing = numpy_dtype(dtype)
    except InvalidInput:
        raise InvalidInput(f"tensor {name!r}: unsupported dtype {dtype!r}",
                           collection=collection, tensor=name) from None
    if any(d < 0 for d in shape):
        raise InvalidInput(f"tensor {name!r}: its shape {shape} has a negative dimension",
                           collection=collection, tensor=name)
    want = np_dtype.itemsize * trailing
    for d in shape:
        want *= d
    if want != size:
        raise InvalidInput(f"tensor {name!r}: a {dtype} of shape {shape} has {want} bytes; "
                           f"the stream gave {size}", collection=collection, tensor=name)


def _filler(tx: Any, collection: str, name: str, dtype: str, shape: list[int],
            value: pa.Buffer, checksum: str | None) -> Any:
    def fill(dst: np.ndarray) -> str:
        src = np.frombuffer(value, np.uint8)
        if len(src) != len(dst):  # the extent is exactly the tensor's size
            raise InvalidInput(f"tensor {name!r}: a {dtype} of shape {shape} has "
                               f"{len(dst)} bytes; the stream gave {len(src)}",
                               collection=collection, tensor=name)
        h = tx.hasher()
        step = 1 << 20
        for lo in range(0, len(src), step):  # copy and hash a MiB at a time, in cache
            hi = min(lo + step, len(src))
            dst[lo:hi] = src[lo:hi]
            h.update(dst[lo:hi])
        digest: str = h.hexdigest()
        if checksum is not None and checksum != digest:
            raise CorruptData(f"tensor {name!r}: its bytes hash to {digest}, the stream said "
                              f"{checksum[:40]!r}", collection=collection, tensor=name)
        return digest

    return fill


def answer(result: dict[str, Any]) -> pa.Buffer:
    """The put's answer as Flight metadata."""
    return pa.py_buffer(json.dumps(result).encode())
