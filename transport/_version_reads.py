"""A version for any Flight client: the ``to_arrow`` layout as a record batch stream, and
the list of the versions a node can serve.

Runs in the serving process (``tensordb serve``), on Flight's threads, any number at
once; the node server calls it for a ``do_get`` ticket with no ``kind`` key
(``{"collection": c, "version": v}``, ``{"collection": c, "tag": t}``, or the collection
alone for its head) and for ``list_flights`` / ``get_flight_info``. docs/arrow.md
("Flight") is the client's side of it.

Each stream holds a snapshot lease on its version from the ticket's check to the last
batch (or the client's hang-up), so gc cannot reclaim the bytes being sent. The batches
are slices of the segments' mappings (``tensordb.arrow``): nothing is copied in this
process; gRPC copies each batch once into its send buffers (docs: "what is copied").
A segment this node does not hold is pulled first from a node that does (``pull_segment``,
as a tensordb client's read on this node would), then served from the local tier.

Integrity (docs/storage.md, "Integrity model"): the stream passes the gate a tensordb
client's read does. Each segment is opened through its tier, so a disk segment's first
open per boot hashes its extents (and marks those that fail) before anything is sliced;
then every extent is refused with ``CorruptData`` naming the collection and tensor when
it is marked corrupt on this host (by that first open, the scrub, ``verify``, a move, a
client's check) or lies past the end of its segment's file (truncated). A segment whose
file is gone is ``NotFound``. Those are raised before the first batch, so the client gets
an error and no bytes. The marks are looked at again before each batch is sent (a load
of the shared counter while no mark is made), so a mark made while a stream runs stops
it at the next marked tensor. A sharded row's shards are hashed as they are assembled.
A version is read whole: one refused tensor fails the stream, and the versions that do
not hold that extent (a later commit that replaced it) are still served.
"""

from __future__ import annotations

import json
import logging
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.flight as fl

import storage_engine as se
from tensordb.arrow import LAYOUT, TENSOR_SCHEMA, numpy_dtype, refuse, tensors_table
from tensordb.catalog import NodeDirectory, TensorRow, box_copies
from tensordb.errors import CorruptData, InvalidInput, NotFound, Unauthorized

from ._base import NodeStore

__all__ = ["MAX_BATCH_BYTES", "VERSION_KEYS", "VersionReads", "version_ticket"]

#: the keys a version ticket may have
VERSION_KEYS = ("collection", "version", "tag")
#: the largest tensor one record batch can carry: Arrow Flight refuses to send a batch
#: over 2 GiB (a gRPC message's length is a 32-bit integer), less room for its header
MAX_BATCH_BYTES = (1 << 31) - (1 << 20)

_log = logging.getLogger("tensordb.transport")

#: pulls a segment into this node and returns the local tier that holds it
Pull = Callable[[str], str]


def version_ticket(req: dict[str, Any]) -> tuple[str, int | None, str | None]:
    """(collection, version, tag) of a version ticket; InvalidInput naming what is wrong
    (an unknown key, a value of the wrong type, both a version and a tag)."""
    extra = sorted(set(req) - set(VERSION_KEYS))
    if extra:
        raise InvalidInput(f"a version ticket has the keys collection and version or tag; "
                           f"unknown: {', '.join(extra)}")
    collection, version, tag = req.get("collection"), req.get("version"), req.get("tag")
    if not isinstance(collection, str) or not collection:
        raise InvalidInput(f"a version ticket needs collection (a name), not {collection!r}")
    if version is not None and (isinstance(version, bool) or not isinstance(version, int)):
        raise InvalidInput(f"version must be an integer, not {version!r}",
                           collection=collection)
    if tag is not None and not isinstance(tag, str):
        raise InvalidInput(f"tag must be text, not {tag!r}", collection=collection)
    if version is not None and tag is not None:
        raise InvalidInput("give a version or a tag, not both", collection=collection)
    return collection, version, tag


def ticket_bytes(collection: str, version: int) -> bytes:
    """The ticket (and command descriptor) of one version, as ``list_flights`` gives it."""
    return json.dumps({"collection": collection, "version": version}).encode()


class VersionReads:
    """The versions of ``db`` as Arrow streams for plain Flight clients. ``pull`` brings a
    segment held only elsewhere to this node. Thread-safe."""

    def __init__(self, db: NodeStore, directory: NodeDirectory, pull: Pull) -> None:
        self.db = db
        self.node = db.config.node
        self.directory = directory
        self.pull = pull

    # -- do_get -----------------------------------------------------------------------
    def stream(self, req: dict[str, Any],
               guard: Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]
               | None = None, *, may_pull: bool = True) -> fl.GeneratorStream:
        """The version a ticket names as a stream of one batch per tensor, under a lease
        released when the stream ends, fails or is dropped. Errors about the ticket (and
        a tensor too large for one batch) are raised here, before any batch is sent;
        ``guard`` wraps the batches (to turn a failure while they stream into a Flight
        error of the server's making). ``may_pull``: whether the asker may make this node
        pull a segment it holds no copy of (a read token may not: Unauthorized)."""
        collection, version, tag = version_ticket(req)
        lease, info, v, rows = self.db.catalog.open_snapshot(
            collection, version, tag, se.current_holder(), self.db.config.lease_ttl)
        try:
            listed = list(rows.values())
            table = self.table(listed, collection, v, info.id, may_pull=may_pull)
        except BaseException:
            self._release(lease)
            raise
        marks = self._marks()
        batches = _leased(table, listed, lambda row: _refuse_marked(collection, row, marks),
                          lambda: self._release(lease))
        return fl.GeneratorStream(table.schema, guard(batches) if guard else batches)

    def table(self, rows: list[TensorRow], collection: str, version: int,
              cid: int | None = None, *, may_pull: bool = True) -> pa.Table:
        """The ``to_arrow`` layout of ``rows``, over this node's mappings (``cid``: the
        collection's id, to find the shards of sharded rows)."""
        big = next((r for r in rows if r.nbytes > MAX_BATCH_BYTES), None)
        if big is not None:
            raise InvalidInput(f"tensor {big.name!r} has {big.nbytes} bytes: more than one "
                               f"Flight record batch carries ({MAX_BATCH_BYTES}); read it "
                               f"with a tensordb client", collection=collection,
                               version=version, tensor=big.name)
        sharded = [r for r in rows if r.segment_id is None and r.nbytes]
        shards = self.db.catalog.shards(cid, sharded) if sharded and cid is not None else {}
        marks = self._marks()
        first: dict[str, str] = {}  # segment id -> its first row: what errors name
        for r in rows:
            if r.segment_id is not None:
                first.setdefault(r.segment_id, r.name)

        def whole(row: TensorRow) -> pa.Buffer:
            """A sharded row assembled from its shards' bytes on this node."""
            dt, k = numpy_dtype(row.dtype)
            item = dt.itemsize * k
            got = shards.get(row.name)
            if not got:
                raise NotFound(f"the shards of {collection}/{row.name} are gone",
                               collection=collection, tensor=row.name)
            out = np.empty((*row.shape, item), np.uint8)
            for i, src, dst in box_copies([(s.offsets, s.shape) for s in got],
                                          (0,) * len(row.shape), row.shape):
                sh = got[i]
                assert sh.segment_id is not None
                view = self._segment(sh.segment_id, sh.tier or "host", collection, row.name,
                                     may_pull)
                refuse(collection, row.name, sh.segment_id, sh.offset, sh.nbytes, len(view),
                       marks.corrupt(sh.segment_id) if marks is not None else None)
                data = np.frombuffer(view.host_bytes(sh.offset, sh.nbytes), np.uint8)
                found = se.checksum(data)
                if found != sh.checksum:
                    why = f"{collection}/{row.name}: checksum {found} != {sh.checksum}"
                    if marks is not None:  # as a client's check: no read serves it now
                        marks.mark_corrupt(sh.segment_id, sh.offset, why)
                    raise CorruptData(f"{collection}/{row.name}: a shard's bytes fail their "
                                      f"checksum (expected {sh.checksum}, found {found}); "
                                      f"not served", collection=collection, tensor=row.name)
                out[dst] = data.reshape(*sh.shape, item)[src]
            return pa.py_buffer(out)

        return tensors_table(
            rows, lambda sid, tier: self._segment(sid, tier, collection, first[sid], may_pull),
            collection=collection, version=version, whole_of=whole,
            marked=marks.corrupt if marks is not None else None)

    def _marks(self) -> se.Marks | None:
        """The store's integrity marks: one set for every tier of a store (the GPU tier
        keeps none of its own), reached through the host tier."""
        marks = getattr(self.db.tier("host"), "marks", None)
        return marks if isinstance(marks, se.Marks) else None

    def _segment(self, segment_id: str, tier: str, collection: str, tensor: str,
                 may_pull: bool = True) -> se.SegmentView:
        """A segment's view on this node (pulled here first when another node holds
        it); ``tier`` is where its writer put it, not necessarily where it is here. A
        segment that moves between tiers meanwhile (an eviction) is looked up again.
        Opened through the tier, so a disk segment's first open per boot verifies it.
        Errors name ``collection``/``tensor`` (a tensor whose bytes are in it); without
        ``may_pull``, a segment held only elsewhere is Unauthorized, never pulled."""
        for _ in range(3):
            here = self.directory.local_tier(segment_id, self.node)
            if here is None and not may_pull:
                raise Unauthorized(f"{collection}/{tensor}: node {self.node!r} holds no copy "
                                   f"of segment {segment_id}, and this token may not make it "
                                   f"pull one: read the version from a node that holds it, "
                                   f"or with a token that may pull (write)",
                                   collection=collection, tensor=tensor, node=self.node)
            here = here or self.pull(segment_id)
            try:
                return self.db.tier(here).open(segment_id)
            except se.SegmentMissing:
                continue
            except se.SourceChanged as exc:  # committed in place; the file changed since
                raise CorruptData(f"{collection}/{tensor}: node {self.node!r} cannot serve "
                                  f"segment {segment_id}: {exc}; not served",
                                  collection=collection, tensor=tensor,
                                  node=self.node) from exc
        raise NotFound(f"{collection}/{tensor}: node {self.node!r} lost the bytes of "
                       f"segment {segment_id} (its file is gone)", collection=collection,
                       tensor=tensor, node=self.node)

    def _release(self, lease: str) -> None:
        try:
            self.db.catalog.release_lease(lease)
        except Exception:  # noqa: BLE001 - the lease then lapses with this process
            _log.exception("node %s could not release lease %s", self.node, lease)

    # -- list_flights / get_flight_info -----------------------------------------------
    def flights(self, criteria: bytes, visible: Callable[[str], bool] | None = None
                ) -> list[fl.FlightInfo]:
        """One FlightInfo per version of every collection (of one, when ``criteria`` is
        ``{"collection": c}``; of those ``visible`` accepts, when given), oldest version
        first; its descriptor is a command and its ticket the version's ticket, both
        ``{"collection": c, "version": v}``."""
        names = self.db.catalog.collection_names()
        if visible is not None:
            names = [n for n in names if visible(n)]
        if criteria:
            want = _criteria(criteria)
            names = [n for n in names if n == want]
        out = []
        for name in names:
            info = self.db.catalog.info(name)
            if info is None:  # dropped since it was listed
                continue
            tags: dict[int, list[str]] = {}
            for t, v in self.db.catalog.tags(name).items():
                tags.setdefault(v, []).append(t)
            for c in reversed(self.db.catalog.history(name)):
                out.append(_info(name, c.version, c.tensors, c.nbytes,
                                 {"head": c.version == info.head,
                                  "tags": tags.get(c.version, []),
                                  "message": c.message}))
        return out

    def flight_info(self, command: bytes) -> fl.FlightInfo:
        """The FlightInfo of the version a command descriptor names (a version ticket's
        JSON: a tag or the head resolved to its version)."""
        req = json_object(command, "a descriptor's command (a version ticket)")
        collection, version, tag = version_ticket(req)
        info, v = self.db.catalog.resolve(collection, version, tag)
        commit = self.db.catalog.commit_info(collection, v)
        tags = sorted(t for t, tv in self.db.catalog.tags(collection).items() if tv == v)
        return _info(collection, v, commit.tensors, commit.nbytes,
                     {"head": v == info.head, "tags": tags, "message": commit.message})


def _refuse_marked(collection: str, row: TensorRow, marks: se.Marks | None) -> None:
    """The gate again, as a row's batch is about to be sent: CorruptData when its extent
    was marked since the table was made (a load of the shared counter and a dict look-up
    while no mark is made; the file's length was looked at when the table was made)."""
    if marks is None or row.segment_id is None or not row.nbytes:
        return  # no marks kept, no bytes, or a sharded row: assembled and hashed already
    bad = marks.corrupt(row.segment_id)
    if bad:
        refuse(collection, row.name, row.segment_id, row.offset, row.nbytes, None, bad)


def _leased(table: pa.Table, rows: list[TensorRow], gate: Callable[[TensorRow], None],
            release: Callable[[], None]) -> Iterator[pa.RecordBatch]:
    """The table's batches (one per tensor: the ``data`` column has a chunk per row),
    each sent after ``gate`` passed its rows (``rows``: the table's, in order);
    ``release`` runs once, when the last is sent, the stream fails, or Flight drops the
    generator before or while it runs (the finalizer covers a generator never started)."""
    done = None

    def batches() -> Iterator[pa.RecordBatch]:
        try:
            pos = 0
            for batch in table.to_batches():
                for row in rows[pos : pos + batch.num_rows]:
                    gate(row)
                pos += batch.num_rows
                yield batch
        finally:
            assert done is not None
            done()

    gen = batches()
    done = weakref.finalize(gen, release)
    return gen


def json_object(raw: bytes, what: str) -> dict[str, Any]:
    """The JSON object of a descriptor's command or of criteria (``what`` names it in
    the error); InvalidInput otherwise."""
    try:
        req = json.loads(raw)
    except ValueError as exc:
        raise InvalidInput(f"{what} must be JSON: {exc}") from exc
    if not isinstance(req, dict):
        raise InvalidInput(f"{what} must be a JSON object, not {type(req).__name__}")
    return req


def _criteria(raw: bytes) -> str:
    req = json_object(raw, "list_flights criteria ({\"collection\": name}, or none)")
    name = req.get("collection")
    if set(req) != {"collection"} or not isinstance(name, str):
        raise InvalidInput(f"list_flights takes no criteria or {{\"collection\": name}}, "
                           f"not {raw.decode(errors='replace')!r}")
    return name


def _info(collection: str, version: int, tensors: int, nbytes: int,
          meta: dict[str, Any]) -> fl.FlightInfo:
    ticket = ticket_bytes(collection, version)
    schema = TENSOR_SCHEMA.with_metadata({"tensordb.layout": LAYOUT,
                                          "tensordb.collection": collection,
                                          "tensordb.version": str(version)})
    return fl.FlightInfo(schema, fl.FlightDescriptor.for_command(ticket),
                         [fl.FlightEndpoint(ticket, [])], total_records=tensors,
                         total_bytes=nbytes, ordered=True,
                         app_metadata=json.dumps({"collection": collection,
                                                  "version": version, **meta}).encode())
