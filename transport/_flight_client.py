"""The client half of Arrow Flight: ``FlightTransport``, and the Flight wire format
both halves share.

Runs in the process that needs another node's bytes: a client's ``Database`` (remote
reads, ``replicate``, ``pull_kv``) or a node server told to pull. Each call pings the
node first, so a dead address fails within ``timeout``; segment bytes then take the
node's TCP data plane (``_dataplane``) when it has one, else a Flight stream of record
batches, one ``large_binary`` chunk each, handed to a sink in order (which writes it
straight into a local extent and hashes it there), so a transfer cut half-way can
resume from another holder at the byte it stopped at.

Failures are converted at this boundary: a node that cannot be reached, dies mid-stream
or stalls longer than ``timeout`` raises ``NodeUnavailable``; a refused token raises
``Unauthorized``; an error the node raised arrives as itself, with its attributes
(``_base``: its JSON payload after a mark in the Flight error's text).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.flight as fl

from tensordb.errors import CorruptData, InvalidInput, NodeUnavailable, TensorDBError

from ._auth import auth_headers, unauthorized
from ._base import DEFAULT_TIMEOUT, KVBlock, Transport, error_from_payload, error_from_text
from ._dataplane import MIN_RATE_ENV, fetch_into, min_transfer_rate
from ._tls import client_context

__all__ = ["FlightTransport", "SEGMENT_SCHEMA", "KV_SCHEMA", "CHANNEL_OPTIONS", "chunk_batch",
           "kv_blocks", "raise_remote"]

#: gRPC settings of the client side of a stream (the receiver of segment bytes): the
#: largest HTTP/2 frames, and a flow-control window that lets the sender run 64 MiB
#: ahead instead of waiting for window updates every few hundred KiB. Bare do_get of
#: 1 GiB on loopback, 2 cores: 1.7 -> 2.5 GB/s
CHANNEL_OPTIONS = [("grpc.http2.max_frame_size", (1 << 24) - 1),
                   ("grpc.http2.lookahead_bytes", 64 << 20)]

#: a segment stream: one chunk of bytes per record batch
SEGMENT_SCHEMA = pa.schema([("data", pa.large_binary())])

#: KV blocks as they travel: a row per block held
KV_SCHEMA = pa.schema([("key", pa.binary()), ("dtype", pa.string()), ("shape", pa.string()),
                       ("data", pa.large_binary()), ("checksum", pa.string())])


def raise_remote(exc: BaseException, node: str, address: str) -> None:
    """Convert a Flight failure into the tensordb error it stands for, and raise it."""
    if isinstance(exc, TensorDBError):
        raise exc
    if isinstance(exc, fl.FlightUnauthenticatedError):
        raise unauthorized(node, address) from exc
    text = str(exc)
    typed = error_from_text(text, node)
    if typed is not None:
        raise typed from exc
    reason = text.splitlines()[0] if text else type(exc).__name__
    raise NodeUnavailable(f"node {node!r} at {address} failed: {reason}", node=node) from exc


_MAX_DIM = 2**63 - 1


def _kv_shape(text: object, node: str) -> tuple[int, ...]:
    """A block's shape as it travels ("2,3,4"; "" for a scalar): CorruptData unless
    every dimension is a plain decimal that fits int64."""
    if not isinstance(text, str) or len(text) > 1024:
        raise CorruptData(f"node {node!r} sent a KV block whose shape is not a short "
                          f"text", node=node)
    dims = text.split(",") if text else []
    if not all(d.isascii() and d.isdigit() and int(d) <= _MAX_DIM for d in dims):
        raise CorruptData(f"node {node!r} sent a KV block with shape {text[:80]!r}: not "
                          f"comma-separated integers below 2**63", node=node)
    return tuple(int(d) for d in dims)


def kv_blocks(table: pa.Table, node: str = "") -> list[KVBlock]:
    """The blocks of a ``KV_SCHEMA`` table (their bytes viewed, not copied). A table of
    another layout, a null cell or a shape that is no list of integers is CorruptData
    naming ``node`` (what a hostile or broken peer sends must not raise anything else);
    what the dtype, shape and bytes mean together is the receiver's to check."""
    if not table.schema.equals(KV_SCHEMA):
        raise CorruptData(f"node {node!r} answered a KV request with columns "
                          f"{table.schema.names[:8]}, not {KV_SCHEMA.names}", node=node)
    out: list[KVBlock] = []
    for batch in table.to_batches():
        if any(batch.column(i).null_count for i in range(5)):
            raise CorruptData(f"node {node!r} sent a KV block with a null field", node=node)
        keys_c, dtypes, shapes, datas, sums = (batch.column(i) for i in range(5))
        for i in range(batch.num_rows):
            shape = _kv_shape(shapes[i].as_py(), node)
            out.append((keys_c[i].as_py(), dtypes[i].as_py(), shape,
                        np.frombuffer(datas[i].as_buffer(), np.uint8), sums[i].as_py()))
    return out


class _Watchdog:
    """Cancels a stream when no chunk arrives for ``timeout`` seconds, or when it is
    still running at ``deadline`` (monotonic): a stalled or dripping peer must not hang
    its reader (a dead one resets the connection, a stopped one does not)."""

    def __init__(self, reader: fl.FlightStreamReader, timeout: float,
                 deadline: float = float("inf")) -> None:
        self._reader = reader
        self._timeout = timeout
        self._deadline = deadline
        self.last = time.monotonic()
        self.fired = False
        self.overdue = False
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name="tensordb-transfer-watchdog")
        self._thread.start()

    def _run(self) -> None:
        while not self._done.wait(min(0.5, self._timeout / 4)):
            now = time.monotonic()
            if now - self.last > self._timeout or now > self._deadline:
                self.overdue = now > self._deadline
                self.fired = True
                self._reader.cancel()
                return

    def stop(self) -> None:
        self._done.set()
        self._thread.join()


class FlightTransport(Transport):
    """Arrow Flight (gRPC) transport with bearer-token auth and bounded waits. One per
    process is enough: it keeps a client per address, shared by its threads. With
    ``tls_ca`` (a PEM bundle) every node is reached over TLS, Flight and data plane,
    and its certificate must chain to that CA and name the host dialled."""

    def __init__(self, token: str | None = None, timeout: float = DEFAULT_TIMEOUT, *,
                 data_plane: bool = True, min_rate: float | None = None,
                 tls_ca: bytes | None = None) -> None:
        if not timeout or timeout <= 0:
            raise InvalidInput(f"the node timeout must be a positive number of seconds, "
                               f"not {timeout!r}")
        if min_rate is not None and not (isinstance(min_rate, (int, float))
                                         and min_rate > 0):
            raise InvalidInput(f"min_rate must be a positive number of bytes per second, "
                               f"not {min_rate!r}")
        self.timeout = float(timeout)
        #: the slowest average rate a segment transfer may keep (bytes/s): one of n bytes
        #: fails once it has taken timeout + n / min_rate seconds
        self.min_rate = float(min_rate) if min_rate is not None else min_transfer_rate()
        self._token = token
        self.data_plane = data_plane  # False: segment bytes through Flight only
        self._headers = auth_headers(token)
        #: the CA this process trusts: given, every node is reached over TLS
        self._ca = tls_ca
        self._tls = client_context(tls_ca) if tls_ca else None
        self._clients: dict[str, fl.FlightClient] = {}
        self._lock = threading.Lock()

    def _client(self, address: str) -> fl.FlightClient:
        with self._lock:
            client = self._clients.get(address)
            if client is None:
                client = self._clients[address] = fl.FlightClient(
                    f"grpc+tls://{address}", tls_root_certs=self._ca,
                    generic_options=CHANNEL_OPTIONS) if self._ca else fl.FlightClient(
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
        if not results:
            return {}
        raw = results[0].body.to_pybytes()
        try:
            answer = json.loads(raw)
        except ValueError:  # not JSON, or not text at all: a broken or hostile peer
            answer = None
        if not isinstance(answer, dict):
            raise NodeUnavailable(f"node {node!r} at {address} answered {kind!r} with "
                                  f"{raw[:60]!r}, not a JSON object", node=node)
        return answer

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
        allowed = self.timeout + length / self.min_rate
        dog = _Watchdog(reader, self.timeout, time.monotonic() + allowed)
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
            if dog.fired and dog.overdue:
                raise NodeUnavailable(f"node {node!r} at {address} sent {got} of {length} "
                                      f"bytes of segment {segment_id} in {allowed:.3g} s, "
                                      f"the most a transfer that size may take "
                                      f"(${MIN_RATE_ENV}: {self.min_rate:.3g} bytes/s)",
                                      node=node) from exc
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
        if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
            super().read_segment_into(node, address, segment_id, offset, dst, on_bytes)
            return
        host = address.rsplit(":", 1)[0].strip("[]")

        def raise_error(payload: object) -> None:
            typed = error_from_payload(payload, node)
            if typed is None:
                raise NodeUnavailable(f"node {node!r} at {address} answered a malformed "
                                      f"error for segment {segment_id}", node=node)
            raise typed

        fetch_into(node, host, port, self._token, segment_id, offset, dst, on_bytes,
                   self.timeout, raise_error, min_rate=self.min_rate, tls=self._tls)

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
        try:
            table = self._client(address).do_get(ticket, self._options(self.timeout * 4)).read_all()
        except Exception as exc:  # noqa: BLE001
            raise_remote(exc, node, address)
        return kv_blocks(table, node)

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
