"""The client side of node-to-node transfers: a ``Transport`` ABC and its Arrow Flight
implementation.

A segment travels as a Flight stream of record batches, one ``large_binary`` value per
batch holding the next chunk of the segment's bytes, in order. The receiver hands each
chunk to a sink (which writes it straight into a local extent and hashes it there), so a
transfer cut half-way can resume from another holder at the byte it stopped at.

Failures are converted at this boundary: a node that cannot be reached, dies mid-stream
or stalls longer than ``timeout`` raises ``NodeUnavailable``; a refused token raises
``Unauthorized``; the server's own typed errors come back as the same types.
"""

from __future__ import annotations

import json
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.flight as fl

from tensordb.errors import (
    CorruptData,
    InvalidInput,
    NodeUnavailable,
    NotFound,
    StoreFull,
    TensorDBError,
    Unauthorized,
)

from ._auth import auth_headers, unauthorized
from ._dataplane import fetch_into

__all__ = ["Transport", "FlightTransport", "KVBlock", "DEFAULT_TIMEOUT", "SEGMENT_SCHEMA",
           "CHANNEL_OPTIONS",
           "chunk_batch", "error_kind", "raise_remote"]

#: seconds a dead address or a stalled stream may take to fail (connect, ping, gap
#: between two chunks of a stream)
DEFAULT_TIMEOUT = 5.0

# typed errors a server sends back as "tensordb.<Kind>: message"
_KINDS: dict[str, type[TensorDBError]] = {
    "NotFound": NotFound, "InvalidInput": InvalidInput, "CorruptData": CorruptData,
    "StoreFull": StoreFull, "NodeUnavailable": NodeUnavailable, "Unauthorized": Unauthorized,
}
_PREFIX = "tensordb."

#: gRPC settings of the client side of a stream (the receiver of segment bytes): the
#: largest HTTP/2 frames, and a flow-control window that lets the sender run 64 MiB
#: ahead instead of waiting for window updates every few hundred KiB. Bare do_get of
#: 1 GiB on loopback, 2 cores: 1.7 -> 2.5 GB/s
CHANNEL_OPTIONS = [("grpc.http2.max_frame_size", (1 << 24) - 1),
                   ("grpc.http2.lookahead_bytes", 64 << 20)]

#: a segment stream: one chunk of bytes per record batch
SEGMENT_SCHEMA = pa.schema([("data", pa.large_binary())])

#: one KV block as it travels: key, dtype name, shape, bytes (uint8), checksum
KVBlock = tuple[bytes, str, tuple[int, ...], np.ndarray, str]


def error_kind(exc: TensorDBError) -> str:
    """The text a server puts in a FlightServerError so the client can re-raise it."""
    kind = next((k for k, t in _KINDS.items() if type(exc) is t), "NodeUnavailable")
    return f"{_PREFIX}{kind}: {exc}"


def raise_remote(exc: BaseException, node: str, address: str) -> None:
    """Convert a Flight failure into the tensordb error it stands for, and raise it."""
    if isinstance(exc, TensorDBError):
        raise exc
    if isinstance(exc, fl.FlightUnauthenticatedError):
        raise unauthorized(node, address) from exc
    text = str(exc)
    at = text.find(_PREFIX)
    if at >= 0:
        kind, _, message = text[at + len(_PREFIX):].partition(": ")
        cls = _KINDS.get(kind)
        if cls is not None:
            # the server's message ends at the first gRPC detail line
            message = message.split(". Detail:")[0].split("\n")[0]
            raise cls(f"node {node!r}: {message}", node=node) from exc
    reason = text.splitlines()[0] if text else type(exc).__name__
    raise NodeUnavailable(f"node {node!r} at {address} failed: {reason}", node=node) from exc


class Transport(ABC):
    """Moves bytes between nodes. Implementations are thread-safe; every method may
    block on the network and fails within the transport's timeout when the other end
    is dead or silent."""

    @abstractmethod
    def ping(self, node: str, address: str) -> dict[str, Any]:
        """The node's identity ({'node': name, 'tiers': [...]}); NodeUnavailable if it
        does not answer within the timeout."""

    @abstractmethod
    def read_segment(self, node: str, address: str, segment_id: str, offset: int, length: int,
                     sink: Callable[[memoryview], None]) -> None:
        """Stream bytes ``[offset, offset + length)`` of a segment the node holds to
        ``sink``, chunk by chunk in order. On a failure mid-stream the chunks already
        given to the sink stay given."""

    def read_segment_into(self, node: str, address: str, segment_id: str, offset: int,
                          dst: np.ndarray, on_bytes: Callable[[int], None]) -> None:
        """Receive bytes ``[offset, offset + len(dst))`` of a segment into ``dst`` (uint8,
        contiguous); ``on_bytes(n)`` says the next ``n`` bytes of ``dst`` are in, in order
        (also for what arrived before a failure). This default streams through
        ``read_segment`` and copies; a transport with a faster path overrides it."""
        pos = 0

        def sink(view: memoryview) -> None:
            nonlocal pos
            n = len(view)
            if pos + n > len(dst):
                raise CorruptData(f"node {node!r} sent more of segment {segment_id} than "
                                  f"asked", node=node)
            np.copyto(dst[pos : pos + n], np.frombuffer(view, np.uint8))
            pos += n
            on_bytes(n)

        self.read_segment(node, address, segment_id, offset, len(dst), sink)

    @abstractmethod
    def request_pull(self, node: str, address: str, segment_ids: Sequence[str],
                     source: str | None, streams: int | None = None) -> dict[str, Any]:
        """Tell a node to pull segments (from ``source`` first, then any holder; in
        ``streams`` parallel ranges, default the node's) and register its replicas;
        returns its report. Blocks until it is done."""

    @abstractmethod
    def read_kv(self, node: str, address: str, namespace: str, block_tokens: int,
                keys: Sequence[bytes]) -> list[KVBlock]:
        """The blocks of ``keys`` the node holds in ``namespace`` (absent ones skipped)."""

    def close(self) -> None:
        """Drop connections. Idempotent."""


class _Watchdog:
    """Cancels a stream when no chunk arrives for ``timeout`` seconds: a stalled peer
    must not hang its reader (a dead one resets the connection, a stopped one does not)."""

    def __init__(self, reader: fl.FlightStreamReader, timeout: float) -> None:
        self._reader = reader
        self._timeout = timeout
        self.last = time.monotonic()
        self.fired = False
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name="tensordb-transfer-watchdog")
        self._thread.start()

    def _run(self) -> None:
        while not self._done.wait(min(0.5, self._timeout / 4)):
            if time.monotonic() - self.last > self._timeout:
                self.fired = True
                self._reader.cancel()
                return

    def stop(self) -> None:
        self._done.set()
        self._thread.join()


class FlightTransport(Transport):
    """Arrow Flight (gRPC) transport with bearer-token auth and bounded waits."""

    def __init__(self, token: str | None = None, timeout: float = DEFAULT_TIMEOUT, *,
                 data_plane: bool = True) -> None:
        if not timeout or timeout <= 0:
            raise InvalidInput(f"the node timeout must be a positive number of seconds, "
                               f"not {timeout!r}")
        self.timeout = float(timeout)
        self._token = token
        self.data_plane = data_plane  # False: segment bytes through Flight only
        self._headers = auth_headers(token)
        self._clients: dict[str, fl.FlightClient] = {}
        self._lock = threading.Lock()

    def _client(self, address: str) -> fl.FlightClient:
        with self._lock:
            client = self._clients.get(address)
            if client is None:
                client = self._clients[address] = fl.FlightClient(
                    f"grpc+tcp://{address}", generic_options=CHANNEL_OPTIONS)
            return client

    def _options(self, timeout: float | None) -> fl.FlightCallOptions:
        return fl.FlightCallOptions(timeout=timeout, headers=self._headers)

    def _action(self, node: str, address: str, kind: str, body: dict[str, Any],
                timeout: float | None) -> dict[str, Any]:
        try:
            results = list(self._client(address).do_action(
                fl.Action(kind, json.dumps(body).encode()), self._options(timeout)))
        except Exception as exc:  # noqa: BLE001 - converted to a typed error right here
            raise_remote(exc, node, address)
        return json.loads(results[0].body.to_pybytes()) if results else {}

    def ping(self, node: str, address: str) -> dict[str, Any]:
        return self._action(node, address, "ping", {}, self.timeout)

    def read_segment(self, node: str, address: str, segment_id: str, offset: int, length: int,
                     sink: Callable[[memoryview], None]) -> None:
        self.ping(node, address)  # a dead address fails here, within the timeout
        ticket = fl.Ticket(json.dumps({"kind": "segment", "id": segment_id, "offset": offset,
                                       "length": length}).encode())
        got = 0
        try:
            reader = self._client(address).do_get(ticket, self._options(None))
        except Exception as exc:  # noqa: BLE001
            raise_remote(exc, node, address)
        dog = _Watchdog(reader, self.timeout)
        try:
            while True:
                try:
                    chunk = reader.read_chunk()
                except StopIteration:
                    break
                dog.last = time.monotonic()
                buf = chunk.data.column(0).buffers()[2]
                if buf is None or buf.size == 0:
                    continue
                sink(memoryview(buf))
                got += buf.size
        except TensorDBError:
            raise
        except Exception as exc:  # noqa: BLE001
            if dog.fired:
                raise NodeUnavailable(f"node {node!r} at {address} stalled for more than "
                                      f"{self.timeout:g} s sending segment {segment_id}",
                                      node=node) from exc
            raise_remote(exc, node, address)
        finally:
            dog.stop()
        if got != length:
            raise NodeUnavailable(f"node {node!r} ended segment {segment_id} after {got} of "
                                  f"{length} bytes", node=node)

    def read_segment_into(self, node: str, address: str, segment_id: str, offset: int,
                          dst: np.ndarray, on_bytes: Callable[[int], None]) -> None:
        """Over the node's data plane (``_dataplane``: a plain TCP stream straight into
        ``dst``) when it has one, else through Flight."""
        port = self.ping(node, address).get("data_port") if self.data_plane else None
        if not isinstance(port, int) or port <= 0:
            super().read_segment_into(node, address, segment_id, offset, dst, on_bytes)
            return
        host = address.rsplit(":", 1)[0].strip("[]")

        def raise_error(text: str) -> None:
            if text.startswith(f"{_PREFIX}Unauthorized"):
                raise unauthorized(node, address)
            raise_remote(RuntimeError(text), node, address)

        fetch_into(node, host, port, self._token, segment_id, offset, dst, on_bytes,
                   self.timeout, raise_error)

    def request_pull(self, node: str, address: str, segment_ids: Sequence[str],
                     source: str | None, streams: int | None = None) -> dict[str, Any]:
        self.ping(node, address)
        return self._action(node, address, "pull", {"segments": list(segment_ids),
                                                    "source": source, "streams": streams},
                            None)

    def read_kv(self, node: str, address: str, namespace: str, block_tokens: int,
                keys: Sequence[bytes]) -> list[KVBlock]:
        self.ping(node, address)
        ticket = fl.Ticket(json.dumps({"kind": "kv", "namespace": namespace,
                                       "block_tokens": block_tokens,
                                       "keys": [k.hex() for k in keys]}).encode())
        out: list[KVBlock] = []
        try:
            table = self._client(address).do_get(ticket, self._options(self.timeout * 4)).read_all()
        except Exception as exc:  # noqa: BLE001
            raise_remote(exc, node, address)
        for batch in table.to_batches():
            keys_c, dtypes, shapes, datas, sums = (batch.column(i) for i in range(5))
            for i in range(batch.num_rows):
                shape = tuple(int(d) for d in shapes[i].as_py().split(",") if d)
                out.append((keys_c[i].as_py(), dtypes[i].as_py(), shape,
                            np.frombuffer(datas[i].as_buffer(), np.uint8), sums[i].as_py()))
        return out

    def close(self) -> None:
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
        for c in clients:
            c.close()


def chunk_batch(view: memoryview) -> pa.RecordBatch:
    """One chunk of segment bytes as a one-row record batch, without copying them."""
    data = pa.py_buffer(view)
    offsets = pa.py_buffer(np.array([0, data.size], np.int64))
    return pa.RecordBatch.from_arrays(
        [pa.Array.from_buffers(pa.large_binary(), 1, [None, offsets, data])], schema=SEGMENT_SCHEMA)
