"""The node server: what a node answers (``NodeService``) and the Arrow Flight server
around it (``NodeServer``).

Runs in the process that owns the host's store: one ``tensordb serve`` per host
(``_node.start_node``), whose handlers run on Flight's threads and the data plane's,
any number at once. It serves the segments and KV blocks this node holds to other
nodes, and pulls segments from others when told to (the cascade of
``Database.replicate``). ``NodeService`` holds the handlers and opens no socket:
``NodeServer`` puts it on Flight and the TCP data plane, ``LocalTransport`` calls it in
process. Requests:

- ``do_get`` ticket ``{"kind": "segment", "id", "offset", "length"}``: the bytes of a
  segment range as record batches of one ``large_binary`` chunk each, sent straight
  from the segment's mapping (no copy in this process);
- ``do_get`` ticket ``{"kind": "kv", "namespace", "block_tokens", "keys": [hex]}``: the
  blocks of those keys this node holds, with dtype, shape and checksum (NotFound for a
  namespace this node never opened: a read creates nothing);
- ``do_get`` ticket with no ``kind``, ``{"collection", "version" | "tag"}`` (neither:
  the head): a version in the ``to_arrow`` layout, for any Flight client
  (``_version_reads``); ``list_flights`` and ``get_flight_info`` list and describe the
  versions;
- action ``ping``: the node's name and tiers (clients use it to fail fast), and the
  port of its data plane (``_dataplane``: segment ranges over a plain TCP stream, the
  way clients read them when they can);
- action ``pull`` ``{"segments": [...], "source": node}``: fetch and register replicas;
- ``do_put`` descriptor ``{"collection", "message"?}`` with the ``to_arrow`` layout:
  commit it as a version (``_version_writes``).

With a token, every request is checked against the grant of the token it carries
(``_auth``: the cluster's own, the ``node`` role; or a scoped token of the catalog):
its role must allow what it asks, and its scope cover the collection or namespace it
names (for segments: a collection whose rows point into the segment). A refusal is
``Unauthorized``, sent as Flight's ``FlightUnauthorizedError``.

A ``tensordb.errors`` exception goes back as ``FlightServerError`` whose text carries
its JSON payload (``_base.error_text``), and the client raises it as the same class
with the same attributes; any other failure is logged here and goes back as
``NodeUnavailable`` naming only its type.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.flight as fl
import xxhash

import storage_engine as se
from tensordb.catalog import Grant, NodeDirectory, TokenStore
from tensordb.errors import (
    CorruptData,
    InvalidInput,
    NodeUnavailable,
    NotFound,
    TensorDBError,
    Unauthorized,
)

from ._auth import (
    Authenticated,
    Authenticator,
    TokenMiddlewareFactory,
    check_access,
    check_token,
    require_token_for,
)
from ._base import DEFAULT_TIMEOUT, KVBlocks, NodeStore, Transport, error_text, terse
from ._dataplane import DataPlaneServer
from ._flight_client import KV_SCHEMA, SEGMENT_SCHEMA, FlightTransport, chunk_batch
from ._metrics import NodeMetrics
from ._pull import pull_segment
from ._tls import ServerTLS, read_ca
from ._version_reads import VersionReads, json_object, version_ticket
from ._version_writes import MAX_PUT_BYTES, answer, commit_stream, put_descriptor

__all__ = ["NodeServer", "NodeService", "THROTTLE_ENV", "CHUNK_BYTES", "block_bytes"]

#: bytes per record batch of a segment stream (measured: 1-8 MiB are alike on loopback)
CHUNK_BYTES = 4 << 20
#: test hook: cap each segment stream at this many bytes per second, so a test can kill
#: a holder while a transfer is surely in flight
THROTTLE_ENV = "TENSORDB_SERVE_THROTTLE"

_T = TypeVar("_T")
_log = logging.getLogger("tensordb.transport")


class NodeService:
    """The requests one node answers, without sockets. ``transport`` is how this node
    reaches others when told to pull; ``token`` the one its callers must carry.
    Thread-safe; ``close`` drops the KV handles it opened."""

    def __init__(self, db: NodeStore, transport: Transport, *, token: str | None = None,
                 metrics: NodeMetrics | None = None, chunk_bytes: int = CHUNK_BYTES) -> None:
        self.db = db
        self.node = db.config.node
        self.token = token
        self.directory = NodeDirectory(db.catalog.engine)
        self.transport = transport
        self.metrics = metrics or NodeMetrics(self.node)
        self.tiers: dict[str, se.Tier] = {n: db.tier(n) for n in ("host", "disk")}
        throttle = float(os.environ.get(THROTTLE_ENV, "") or 0)
        self.throttle = throttle if throttle > 0 else None
        self.chunk_bytes = (max(64 << 10, min(chunk_bytes, int(throttle / 20)))
                            if self.throttle else chunk_bytes)
        #: the port of the data plane serving this node's segments, told in pings
        self.data_port: int | None = None
        self._kv: dict[tuple[str, int], KVBlocks] = {}
        self._kv_lock = threading.Lock()
        #: whole versions for plain Flight clients; a segment held elsewhere is pulled
        self.versions = VersionReads(db, self.directory, self.pull_here)

    # -- requests ---------------------------------------------------------------------
    def authorized(self, token: str | None) -> bool:
        """Whether a caller with ``token`` may ask (compared in constant time)."""
        if self.token is None:
            return True
        return token is not None and hmac.compare_digest(token.encode(), self.token.encode())

    @staticmethod
    def request(raw: bytes) -> dict[str, Any]:
        """A request's JSON body as a dict (InvalidInput otherwise)."""
        try:
            req = json.loads(raw or b"{}")
        except ValueError as exc:
            raise InvalidInput(f"a request must be JSON: {exc}") from exc
        if not isinstance(req, dict):
            raise InvalidInput("a request must be a JSON object")
        return req

    def checked(self, kind: str, work: Callable[[], _T]) -> _T:
        """Run one request. A TensorDBError passes through; any other failure is logged
        here and raised as NodeUnavailable naming only its type (its text may hold
        paths of this host, its trace this process's code)."""
        try:
            return work()
        except TensorDBError:
            raise
        except Exception as exc:
            _log.exception("node %s failed on a %s request", self.node, kind)
            raise NodeUnavailable(f"node {self.node!r} failed on a {kind} request "
                                  f"({type(exc).__name__})", node=self.node) from exc

    def answer(self, kind: str, work: Callable[[], _T]) -> _T:
        """Run one request as ``checked`` does, and count it by its outcome."""
        try:
            out = self.checked(kind, work)
        except TensorDBError as exc:
            self.metrics.request(kind, type(exc).__name__)
            raise
        self.metrics.request(kind, "ok")
        return out

    def ping(self) -> dict[str, Any]:
        """The node's identity: name, tiers, pid, the bytes of its ready spare and the
        port of its data plane."""
        host = self.tiers.get("host")
        spare = host.spare_ready() if isinstance(host, se.Prefaulting) else 0
        return {"node": self.node, "tiers": sorted(self.tiers), "pid": os.getpid(),
                "spare_ready": spare, "data_port": self.data_port}

    # -- segments -------------------------------------------------------------------
    def segment_stream(self, req: dict[str, Any]) -> Iterator[memoryview]:
        """The chunks of the segment range ``req`` names, in order (checked now, sent
        as the iterator is read; counted once all are)."""
        data, offset, length, tier = self._segment_bytes(req)
        return self._chunks(data, offset, length, tier)

    def segment_range(self, req: dict[str, Any]
                      ) -> tuple[memoryview, Callable[[float], None]]:
        """A data-plane request: the bytes to send, and what to count once they are."""
        data, offset, length, tier = self._segment_bytes(req)
        return data[offset : offset + length], \
            lambda seconds: self.metrics.sent(tier, length, seconds)

    def _segment_bytes(self, req: dict[str, Any]) -> tuple[memoryview, int, int, str]:
        """The mapping of the segment a request names, the range asked and its tier;
        InvalidInput or NotFound when the request is bad or the bytes are not here."""
        sid, offset, length = req.get("id"), req.get("offset", 0), req.get("length")
        if not isinstance(sid, str) or not isinstance(offset, int) or offset < 0 \
                or not isinstance(length, int) or length < 0:
            raise InvalidInput(f"a segment ticket needs id (text), offset and length "
                               f"(integers >= 0), not {repr(req)[:200]}")
        tier = self.directory.local_tier(sid, self.node)
        if tier is None:
            raise NotFound(f"node {self.node!r} holds no segment {sid}", node=self.node)
        try:
            mm = self.db.tier(tier).open(sid)
        except se.SegmentMissing as exc:
            raise NotFound(f"node {self.node!r} lost the bytes of segment {sid}",
                           node=self.node) from exc
        except se.SourceChanged as exc:  # committed in place; the file changed since
            raise CorruptData(f"node {self.node!r} cannot serve segment {sid}: {exc}",
                              node=self.node) from exc
        data = memoryview(mm.host_bytes())  # a view on the host, a copy from a device
        if offset + length > len(data):
            info = self.directory.segment(sid)
            if info is not None and offset + length <= info.nbytes:
                # the catalog records more bytes than the file holds: damage, not a bad
                # request (the pulling node must not take it for one, nor keep anything)
                raise CorruptData(f"node {self.node!r} cannot serve segment {sid}: its "
                                  f"file holds {len(data)} of its {info.nbytes} bytes "
                                  f"(truncated)", node=self.node)
            raise InvalidInput(f"segment {sid} has {len(data)} bytes; asked for "
                               f"[{offset}, {offset + length})", node=self.node)
        return data, offset, length, tier

    def _chunks(self, data: memoryview, offset: int, length: int, tier: str
                ) -> Iterator[memoryview]:
        t0 = time.perf_counter()
        step = self.chunk_bytes
        end = offset + length
        for lo in range(offset, end, step):
            hi = min(lo + step, end)
            yield data[lo:hi]
            if self.throttle:
                time.sleep((hi - lo) / self.throttle)
        self.metrics.sent(tier, length, time.perf_counter() - t0)

    def pull(self, body: dict[str, Any]) -> dict[str, Any]:
        """Fetch the segments ``body`` names from other nodes and register the replicas;
        blocks for the transfers. Returns the tier each landed in."""
        segments, source, streams = body.get("segments"), body.get("source"), \
            body.get("streams")
        if not isinstance(segments, list) or not all(isinstance(s, str) for s in segments) \
                or not (source is None or isinstance(source, str)) \
                or not (streams is None or (isinstance(streams, int) and 1 <= streams <= 64)):
            raise InvalidInput(f"pull needs segments (a list of ids), source (a node name "
                               f"or null) and optionally streams (1-64), not {repr(body)[:200]}")
        t0 = time.perf_counter()
        tiers = {s: pull_segment(self.directory, self.transport, self.node, self.tiers, s,
                                 prefer=source, on_pulled=self.metrics.pulled,
                                 streams=streams)
                 for s in segments}
        return {"node": self.node, "segments": tiers, "seconds": time.perf_counter() - t0}

    def pull_here(self, segment_id: str) -> str:
        """Pull one segment to this node from any holder; the local tier it landed in."""
        return pull_segment(self.directory, self.transport, self.node, self.tiers, segment_id,
                            on_pulled=self.metrics.pulled)

    # -- KV blocks --------------------------------------------------------------------
    def _kv_cache(self, namespace: str, block_tokens: int) -> KVBlocks:
        with self._kv_lock:
            cache = self._kv.get((namespace, block_tokens))
            if cache is None:
                # a read makes nothing: a namespace this node never opened is NotFound
                cache = self._kv[(namespace, block_tokens)] = self.db.kv(
                    namespace, block_tokens, create=False)
            return cache

    def kv_table(self, req: dict[str, Any]) -> pa.Table:
        """The blocks of the keys ``req`` names that this node holds (``KV_SCHEMA``)."""
        namespace, block_tokens, keys = req.get("namespace"), req.get("block_tokens"), \
            req.get("keys")
        if not isinstance(namespace, str) or not isinstance(block_tokens, int) \
                or not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
            raise InvalidInput(f"a kv ticket needs namespace, block_tokens and keys (hex), "
                               f"not {repr(req)[:200]}")
        try:
            raw = [bytes.fromhex(k) for k in keys]
        except ValueError as exc:
            raise InvalidInput(f"kv keys must be hex: {exc}") from exc
        kv = self._kv_cache(namespace, block_tokens)
        present = [k for k, held in zip(raw, kv.contains(raw), strict=True) if held]
        cols: list[list[Any]] = [[], [], [], [], []]
        if present:
            for key, t in zip(present, kv.get(present), strict=True):
                data = block_bytes(t)
                cols[0].append(key)
                cols[1].append(str(t.dtype).removeprefix("torch."))
                cols[2].append(",".join(str(d) for d in t.shape))
                cols[3].append(data.tobytes())
                cols[4].append(xxhash.xxh3_64_hexdigest(data))
        batch = pa.RecordBatch.from_arrays(
            [pa.array(c, f.type) for c, f in zip(cols, KV_SCHEMA, strict=True)],
            schema=KV_SCHEMA)
        self.metrics.sent("kv", sum(len(d) for d in cols[3]), 0.0)
        return pa.Table.from_batches([batch])

    def close(self) -> None:
        """Drop the KV handles. Idempotent."""
        with self._kv_lock:
            caches, self._kv = list(self._kv.values()), {}
        for cache in caches:
            cache.close()


def _flight_error(exc: TensorDBError) -> fl.FlightError:
    """The Flight error of ``exc``: its class and message first, for a plain client to
    read, then its payload, for ``FlightTransport`` to raise it as itself. A refused
    scope is Flight's own ``FlightUnauthorizedError`` (gRPC's PERMISSION_DENIED)."""
    kind = fl.FlightUnauthorizedError if isinstance(exc, Unauthorized) \
        else fl.FlightServerError
    return kind(f"{type(exc).__name__}: {terse(exc.message)}\n{error_text(exc)}")


class NodeServer(fl.FlightServerBase):
    """Serves one node's store over Flight, and its segment bytes over the data plane.
    Listening starts at construction; ``close`` stops it. Handlers run on the server's
    threads, any number at once."""

    def __init__(self, db: NodeStore, host: str = "127.0.0.1", port: int = 0, *,
                 token: str | None = None, metrics: NodeMetrics | None = None,
                 timeout: float = DEFAULT_TIMEOUT, chunk_bytes: int = CHUNK_BYTES,
                 data_plane: bool = True, data_port: int = 0,
                 tls: ServerTLS | None = None) -> None:
        require_token_for(host, token)
        if token is not None:
            check_token(token)
        #: who a request's token is: the cluster's own, or a scoped token of the catalog
        self.auth = Authenticator(token, TokenStore(db.catalog.engine)) if token else None
        middleware = {"auth": TokenMiddlewareFactory(self.auth)} if self.auth else None
        self.tls = tls
        if tls is not None:
            super().__init__(f"grpc+tls://{host}:{port}", middleware=middleware,
                             tls_certificates=[fl.CertKeyPair(tls.cert_pem, tls.key_pem)])
        else:
            super().__init__(f"grpc+tcp://{host}:{port}", middleware=middleware)
        self.host = host
        # this node reaches others (to pull) with its own token, trusting the store's CA
        ca = read_ca(db.config.tls_ca) if db.config.tls_ca else None
        self.service = NodeService(db, FlightTransport(token, timeout, tls_ca=ca),
                                   token=token, metrics=metrics, chunk_bytes=chunk_bytes)
        self.node = self.service.node
        self.metrics = self.service.metrics
        self.data_plane = DataPlaneServer(
            host, data_port, self._authorize_segment if self.auth else None, timeout,
            lambda req: self.service.checked("segment",
                                             lambda: self.service.segment_range(req)),
            lambda status: self.metrics.request("segment", status),
            chunk=self.service.chunk_bytes, throttle=self.service.throttle,
            node=self.service.node, tls=tls.context() if tls else None) if data_plane else None
        self.service.data_port = self.data_plane.port if self.data_plane else None

    def _answer(self, kind: str, work: Callable[[], _T]) -> _T:
        try:
            return self.service.answer(kind, work)
        except TensorDBError as exc:
            raise _flight_error(exc) from None

    # -- scoped access --------------------------------------------------------------
    @staticmethod
    def _grant(context: fl.ServerCallContext) -> Grant | None:
        """The grant of a call's token (None: this node runs without tokens)."""
        mw = context.get_middleware("auth")
        return mw.grant if isinstance(mw, Authenticated) else None

    def _check(self, grant: Grant | None, action: str, names: list[str], what: str) -> None:
        check_access(grant, action, names, self.node, what)

    def _check_segments(self, grant: Grant | None, action: str, ids: object,
                        what: str) -> None:
        """A request naming segments (``ids``: the id or list of ids it gives; what
        nodes ask of each other) is checked against the collections whose rows point
        into each: a scoped token may have a segment's bytes when its scope covers one
        of them. A token of scope ``*`` skips the look-up; what is not an id is the
        handler's to refuse."""
        self._check(grant, action, [], what)
        if grant is None or grant.scope == "*":
            return
        segment_ids = [ids] if isinstance(ids, str) else \
            [s for s in ids if isinstance(s, str)] if isinstance(ids, list) else []
        owners = self.service.directory.segment_collections(segment_ids)
        for sid, names in owners.items():
            if not any(grant.covers(n) for n in names):
                raise Unauthorized(f"this token's scope {grant.scope!r} covers no collection "
                                   f"of segment {sid} ({what}) on node {self.node!r}",
                                   node=self.node)

    def _authorize_segment(self, token: str | None, req: dict[str, Any]) -> None:
        """The data plane's check: the request's token, then its segment's scope."""
        grant = self.auth.grant(token) if self.auth is not None else None
        if self.auth is not None and grant is None:
            raise Unauthorized("this node refused the request: missing or wrong token "
                               "(give token= to connect, or set $TENSORDB_TOKEN)",
                               node=self.node)
        self._check_segments(grant, "read", req.get("id"), "segment bytes")

    def do_get(self, context: fl.ServerCallContext, ticket: fl.Ticket) -> fl.FlightDataStream:
        grant = self._grant(context)
        try:
            req = self.service.request(ticket.ticket)
        except TensorDBError as exc:
            raise _flight_error(exc) from None
        if "kind" not in req:  # a version, asked by any Flight client
            def version() -> fl.FlightDataStream:
                self._check(grant, "read", [version_ticket(req)[0]], "a version")
                return self.service.versions.stream(
                    req, lambda batches: self._guarded("version", batches),
                    may_pull=grant is None or grant.may("pull"))
            return self._answer("version", version)
        kind = str(req.get("kind"))

        def run() -> fl.FlightDataStream:
            if kind == "segment":
                self._check_segments(grant, "read", req.get("id"), "segment bytes")
                chunks = self.service.segment_stream(req)
                return fl.GeneratorStream(SEGMENT_SCHEMA, self._guarded(
                    kind, (chunk_batch(c) for c in chunks)))
            if kind == "kv":
                ns = req.get("namespace")
                self._check(grant, "read", [ns] if isinstance(ns, str) else [], "KV blocks")
                return fl.RecordBatchStream(self.service.kv_table(req))
            raise InvalidInput(f"unknown ticket kind {kind!r} (segment, kv; no kind: a version)")

        return self._answer(kind, run)

    def _guarded(self, kind: str, batches: Iterator[pa.RecordBatch]
                 ) -> Iterator[pa.RecordBatch]:
        """``batches``, with a failure while they stream turned into a Flight error as
        ``_answer`` makes it: raised from the generator as anything else, it would
        reach the client with its Python traceback (the paths of this host's code)."""
        try:
            yield from batches
        except TensorDBError as exc:
            raise _flight_error(exc) from None
        except Exception as exc:  # noqa: BLE001 - logged here, named by type there
            _log.exception("node %s failed while streaming a %s", self.node, kind)
            raise _flight_error(NodeUnavailable(
                f"node {self.node!r} failed while streaming a {kind} "
                f"({type(exc).__name__})", node=self.node)) from None

    def do_put(self, context: fl.ServerCallContext, descriptor: fl.FlightDescriptor,
               reader: fl.MetadataRecordBatchReader, writer: fl.FlightMetadataWriter) -> None:
        grant = self._grant(context)

        def run() -> dict[str, Any]:
            if descriptor.descriptor_type != fl.DescriptorType.CMD:
                raise InvalidInput("put a version with a command descriptor: "
                                   "{\"collection\": c}")
            collection, message = put_descriptor(json_object(
                descriptor.command, "a put descriptor's command"))
            self._check(grant, "write", [collection], "a commit")
            batches = (chunk.data for chunk in reader)
            cap = self.service.db.config.host_capacity
            return commit_stream(self.service.db, collection, message, batches,
                                 reader.schema, min(MAX_PUT_BYTES, cap or MAX_PUT_BYTES))

        writer.write(answer(self._answer("put", run)))

    def do_action(self, context: fl.ServerCallContext, action: fl.Action) -> Iterator[fl.Result]:
        kind = action.type
        grant = self._grant(context)

        def run() -> dict[str, Any]:
            body = self.service.request(action.body.to_pybytes() if action.body else b"")
            if kind == "ping":
                return self.service.ping()
            if kind == "pull":
                self._check_segments(grant, "pull", body.get("segments"), "a pull")
                return self.service.pull(body)
            raise InvalidInput(f"unknown action {kind!r} (ping, pull)")

        return iter([fl.Result(json.dumps(self._answer(kind, run)).encode())])

    def list_flights(self, context: fl.ServerCallContext, criteria: bytes
                     ) -> Iterator[fl.FlightInfo]:
        grant = self._grant(context)

        def run() -> list[fl.FlightInfo]:
            self._check(grant, "read", [], "a listing")
            # a scoped token sees the collections its scope covers, and no others
            return self.service.versions.flights(
                criteria, None if grant is None else grant.covers)

        return iter(self._answer("list", run))

    def get_flight_info(self, context: fl.ServerCallContext,
                        descriptor: fl.FlightDescriptor) -> fl.FlightInfo:
        grant = self._grant(context)

        def run() -> fl.FlightInfo:
            if descriptor.descriptor_type != fl.DescriptorType.CMD:
                raise InvalidInput("describe a version with a command descriptor: its "
                                   "ticket's JSON, {\"collection\": c, \"version\": v}")
            req = json_object(descriptor.command, "a descriptor's command (a version ticket)")
            self._check(grant, "read", [version_ticket(req)[0]], "a version's description")
            return self.service.versions.flight_info(descriptor.command)

        return self._answer("info", run)

    def list_actions(self, context: fl.ServerCallContext) -> list[tuple[str, str]]:
        return [("ping", "the node's name and tiers"),
                ("pull", "fetch segments from other nodes and register the replicas")]

    def close(self) -> None:
        """Stop serving (waits for calls in flight) and drop the KV handles. Idempotent."""
        if self.data_plane is not None:
            self.data_plane.close()
        self.shutdown()
        self.service.transport.close()
        self.service.close()


def block_bytes(t: Any) -> np.ndarray:
    """A tensor's bytes as a flat uint8 array (a view when it is contiguous)."""
    import torch

    return t.contiguous().view(-1).view(torch.uint8).numpy()
