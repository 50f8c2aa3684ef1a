"""The node server: an Arrow Flight server that owns its host's store.

One per host (``tensordb serve``). It serves the segments and KV blocks this node holds
to other nodes, and pulls segments from others when told to (the cascade of
``Database.replicate``). Requests:

- ``do_get`` ticket ``{"kind": "segment", "id", "offset", "length"}``: the bytes of a
  segment range as record batches of one ``large_binary`` chunk each, sent straight
  from the segment's mapping (no copy in this process);
- ``do_get`` ticket ``{"kind": "kv", "namespace", "block_tokens", "keys": [hex]}``: the
  blocks of those keys this node holds, with dtype, shape and checksum;
- action ``ping``: the node's name and tiers (clients use it to fail fast), and the
  port of its data plane (``_dataplane``: segment ranges over a plain TCP stream, the
  way clients read them when they can);
- action ``pull`` ``{"segments": [...], "source": node}``: fetch and register replicas.

Typed errors go back as ``FlightServerError("tensordb.<Kind>: ...")`` and are raised as
the same types by the client.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.flight as fl
import xxhash

import storage_engine as se
from tensordb.catalog import NodeDirectory
from tensordb.errors import InvalidInput, NotFound, TensorDBError

from ._auth import TokenMiddlewareFactory, require_token_for
from ._flight_client import DEFAULT_TIMEOUT, SEGMENT_SCHEMA, FlightTransport, chunk_batch, error_kind
from ._dataplane import DataPlaneServer
from ._metrics import NodeMetrics
from ._pull import pull_segment

if TYPE_CHECKING:
    from tensordb import Database

__all__ = ["NodeServer", "KV_SCHEMA", "THROTTLE_ENV", "CHUNK_BYTES"]

#: bytes per record batch of a segment stream (measured: 1-8 MiB are alike on loopback)
CHUNK_BYTES = 4 << 20
#: test hook: cap each segment stream at this many bytes per second, so a test can kill
#: a holder while a transfer is surely in flight
THROTTLE_ENV = "TENSORDB_SERVE_THROTTLE"

_T = TypeVar("_T")

KV_SCHEMA = pa.schema([("key", pa.binary()), ("dtype", pa.string()), ("shape", pa.string()),
                       ("data", pa.large_binary()), ("checksum", pa.string())])


def _flight_error(exc: TensorDBError) -> fl.FlightServerError:
    return fl.FlightServerError(error_kind(exc))


class NodeServer(fl.FlightServerBase):
    """Serves one node's store over Flight. Listening starts at construction; ``close``
    stops it. Handlers run on the server's threads, any number at once."""

    def __init__(self, db: Database, host: str = "127.0.0.1", port: int = 0, *,
                 token: str | None = None, metrics: NodeMetrics | None = None,
                 timeout: float = DEFAULT_TIMEOUT, chunk_bytes: int = CHUNK_BYTES,
                 data_plane: bool = True, data_port: int = 0) -> None:
        require_token_for(host, token)
        middleware = {"auth": TokenMiddlewareFactory(token)} if token else None
        super().__init__(f"grpc+tcp://{host}:{port}", middleware=middleware)
        self.db = db
        self.node = db.config.node
        self.host = host
        self.directory = NodeDirectory(db.catalog.engine)
        self.transport = FlightTransport(token, timeout)
        self.metrics = metrics or NodeMetrics(self.node)
        self.tiers: dict[str, se.Tier] = {n: db.tier(n) for n in ("host", "disk")}
        throttle = float(os.environ.get(THROTTLE_ENV, "") or 0)
        self.throttle = throttle if throttle > 0 else None
        self.chunk_bytes = (max(64 << 10, min(chunk_bytes, int(throttle / 20)))
                            if self.throttle else chunk_bytes)
        self._kv: dict[tuple[str, int], Any] = {}
        self._kv_lock = threading.Lock()
        self.data_plane = DataPlaneServer(
            host, data_port, token, timeout, self._segment_range, error_kind,
            lambda status: self.metrics.request("segment", status),
            chunk=self.chunk_bytes, throttle=self.throttle) if data_plane else None

    # -- requests ---------------------------------------------------------------------
    @staticmethod
    def _request(raw: bytes) -> dict[str, Any]:
        try:
            req = json.loads(raw or b"{}")
        except ValueError as exc:
            raise InvalidInput(f"a request must be JSON: {exc}") from exc
        if not isinstance(req, dict):
            raise InvalidInput("a request must be a JSON object")
        return req

    def _answer(self, kind: str, work: Callable[[], _T]) -> _T:
        """Run one request: count it, and turn a typed error into a Flight error."""
        try:
            out = work()
        except TensorDBError as exc:
            self.metrics.request(kind, type(exc).__name__)
            raise _flight_error(exc) from None
        self.metrics.request(kind, "ok")
        return out

    def do_get(self, context: fl.ServerCallContext, ticket: fl.Ticket) -> fl.FlightDataStream:
        try:
            req = self._request(ticket.ticket)
        except TensorDBError as exc:
            raise _flight_error(exc) from None
        kind = str(req.get("kind"))
        handlers = {"segment": self._segment, "kv": self._kv_blocks}

        def run() -> fl.FlightDataStream:
            if kind not in handlers:
                raise InvalidInput(f"unknown ticket kind {kind!r} (segment, kv)")
            return handlers[kind](req)

        return self._answer(kind, run)

    def do_action(self, context: fl.ServerCallContext, action: fl.Action) -> Iterator[fl.Result]:
        kind = action.type

        def run() -> dict[str, Any]:
            body = self._request(action.body.to_pybytes() if action.body else b"")
            if kind == "ping":
                host = self.tiers.get("host")
                spare = host.spare_ready() if isinstance(host, se.Prefaulting) else 0
                return {"node": self.node, "tiers": sorted(self.tiers), "pid": os.getpid(),
                        "spare_ready": spare,
                        "data_port": self.data_plane.port if self.data_plane else None}
            if kind == "pull":
                return self._pull(body)
            raise InvalidInput(f"unknown action {kind!r} (ping, pull)")

        return iter([fl.Result(json.dumps(self._answer(kind, run)).encode())])

    def list_actions(self, context: fl.ServerCallContext) -> list[tuple[str, str]]:
        return [("ping", "the node's name and tiers"),
                ("pull", "fetch segments from other nodes and register the replicas")]

    # -- segments -------------------------------------------------------------------
    def _segment(self, req: dict[str, Any]) -> fl.FlightDataStream:
        data, offset, length, tier = self._segment_bytes(req)
        return fl.GeneratorStream(SEGMENT_SCHEMA, self._chunks(data, offset, length, tier))

    def _segment_range(self, req: dict[str, Any]
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
                               f"(integers >= 0), not {req!r}")
        tier = self.directory.local_tier(sid, self.node)
        if tier is None:
            raise NotFound(f"node {self.node!r} holds no segment {sid}", node=self.node)
        try:
            mm = self.db.tier(tier).open(sid)
        except se.SegmentMissing as exc:
            raise NotFound(f"node {self.node!r} lost the bytes of segment {sid}",
                           node=self.node) from exc
        data = memoryview(mm.host_bytes())  # a view on the host, a copy from a device
        if offset + length > len(data):
            raise InvalidInput(f"segment {sid} has {len(data)} bytes; asked for "
                               f"[{offset}, {offset + length})", node=self.node)
        return data, offset, length, tier

    def _chunks(self, data: memoryview, offset: int, length: int, tier: str
                ) -> Iterator[pa.RecordBatch]:
        t0 = time.perf_counter()
        step = self.chunk_bytes
        end = offset + length
        for lo in range(offset, end, step):
            hi = min(lo + step, end)
            yield chunk_batch(data[lo:hi])
            if self.throttle:
                time.sleep((hi - lo) / self.throttle)
        self.metrics.sent(tier, length, time.perf_counter() - t0)

    def _pull(self, body: dict[str, Any]) -> dict[str, Any]:
        segments, source, streams = body.get("segments"), body.get("source"), \
            body.get("streams")
        if not isinstance(segments, list) or not all(isinstance(s, str) for s in segments) \
                or not (source is None or isinstance(source, str)) \
                or not (streams is None or (isinstance(streams, int) and 1 <= streams <= 64)):
            raise InvalidInput(f"pull needs segments (a list of ids), source (a node name "
                               f"or null) and optionally streams (1-64), not {body!r}")
        t0 = time.perf_counter()
        tiers = {s: pull_segment(self.directory, self.transport, self.node, self.tiers, s,
                                 prefer=source, on_pulled=self.metrics.pulled,
                                 streams=streams)
                 for s in segments}
        return {"node": self.node, "segments": tiers, "seconds": time.perf_counter() - t0}

    # -- KV blocks --------------------------------------------------------------------
    def _kv_cache(self, namespace: str, block_tokens: int) -> Any:
        with self._kv_lock:
            cache = self._kv.get((namespace, block_tokens))
            if cache is None:
                cache = self._kv[(namespace, block_tokens)] = self.db.kv(namespace,
                                                                         block_tokens)
            return cache

    def _kv_blocks(self, req: dict[str, Any]) -> fl.FlightDataStream:
        namespace, block_tokens, keys = req.get("namespace"), req.get("block_tokens"), \
            req.get("keys")
        if not isinstance(namespace, str) or not isinstance(block_tokens, int) \
                or not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
            raise InvalidInput(f"a kv ticket needs namespace, block_tokens and keys (hex), "
                               f"not {req!r}")
        try:
            raw = [bytes.fromhex(k) for k in keys]
        except ValueError as exc:
            raise InvalidInput(f"kv keys must be hex: {exc}") from exc
        kv = self._kv_cache(namespace, block_tokens)
        present = [k for k, held in zip(raw, kv.contains(raw)) if held]
        cols: list[list[Any]] = [[], [], [], [], []]
        if present:
            for key, t in zip(present, kv.get(present)):
                data = block_bytes(t)
                cols[0].append(key)
                cols[1].append(str(t.dtype).removeprefix("torch."))
                cols[2].append(",".join(str(d) for d in t.shape))
                cols[3].append(data.tobytes())
                cols[4].append(xxhash.xxh3_64_hexdigest(data))
        batch = pa.RecordBatch.from_arrays([pa.array(c, f.type) for c, f in zip(cols, KV_SCHEMA)],
                                           schema=KV_SCHEMA)
        self.metrics.sent("kv", sum(len(d) for d in cols[3]), 0.0)
        return fl.RecordBatchStream(pa.Table.from_batches([batch]))

    # -- life ---------------------------------------------------------------------------
    def close(self) -> None:
        """Stop serving (waits for calls in flight) and drop the KV handles. Idempotent."""
        if self.data_plane is not None:
            self.data_plane.close()
        self.shutdown()
        self.transport.close()
        with self._kv_lock:
            caches, self._kv = list(self._kv.values()), {}
        for cache in caches:
            cache.close()


def block_bytes(t: Any) -> np.ndarray:
    """A tensor's bytes as a flat uint8 array (a view when it is contiguous)."""
    import torch

    return t.contiguous().view(-1).view(torch.uint8).numpy()
