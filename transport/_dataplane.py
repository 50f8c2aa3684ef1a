"""The bulk data plane: segment bytes over a plain TCP stream, set up through Flight.

Flight (gRPC) stays the control plane (ping, pull, KV blocks) and the fallback for
segment bytes. A segment range, the one transfer that moves gigabytes, goes over a
stream of its own because gRPC cannot carry it near the speed of the link on a small
host: its HTTP/2 framing and the reassembly of each message cost the receiver two more
copies of every byte than a socket does (measured on 2 cores: a bare Flight ``do_get``
moves 1.6-2.5 GB/s where ``recv_into`` moves 3.2-3.5). Here the sender writes straight
from the segment's mapping and the receiver reads straight into the replica's extent:
one kernel copy a side, the least TCP allows.

Each node server listens on a second port, bound to the same host as its Flight port,
and says which in its ``ping`` answer (``data_port``); a node that gives none is read
through Flight. One request per connection::

    client -> server   u32 length, JSON {"token", "id", "offset", "length"}
    server -> client   u32 length, JSON {"ok": true} or {"error": {error payload}}
                       then, on ok, exactly ``length`` bytes of the segment

(the error payload of ``_base.error_payload``: the error's classes, message and
attributes). The server half runs in the node's serving process, a thread per
connection; the client half (``fetch_into``) in the process that pulls.

The token is compared in constant time, as the Flight middleware does; a wrong one is
answered with ``Unauthorized`` and the connection closed. Checksums are the caller's
(``_pull`` hashes each extent as its bytes land), so a stream cut anywhere leaves a
prefix the next holder resumes from.
"""

from __future__ import annotations

import hmac
import json
import logging
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from tensordb.errors import InvalidInput, NodeUnavailable, TensorDBError, Unauthorized

from ._auth import TOKEN_ENV
from ._base import error_payload

__all__ = ["DataPlaneServer", "fetch_into", "MAX_HEADER"]

_LEN = struct.Struct(">I")
MAX_HEADER = 64 << 10  # a request or answer header is a small JSON object
_REPORT = 1 << 20  # hand received bytes to the caller (to hash, in cache) every MiB

_log = logging.getLogger("tensordb.transport")


def _send_frame(sock: socket.socket, obj: dict[str, Any]) -> None:
    body = json.dumps(obj).encode()
    sock.sendall(_LEN.pack(len(body)) + body)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError(f"the peer closed the stream after {got} of {n} bytes")
        got += k
    return bytes(buf)


def _recv_frame(sock: socket.socket) -> dict[str, Any]:
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    if n > MAX_HEADER:
        raise InvalidInput(f"a data-plane header of {n} bytes (at most {MAX_HEADER})")
    try:
        obj = json.loads(_recv_exact(sock, n))
    except ValueError as exc:
        raise InvalidInput(f"a data-plane header must be JSON: {exc}") from exc
    if not isinstance(obj, dict):
        raise InvalidInput("a data-plane header must be a JSON object")
    return obj


class DataPlaneServer:
    """The listening half, owned by a ``NodeServer``: ``serve(req)`` turns a request into
    (bytes to send, done callback) or raises a TensorDBError, which goes back as its
    payload; ``chunk``/``throttle`` pace the stream as the Flight path does."""

    def __init__(self, host: str, port: int, token: str | None, timeout: float,
                 serve: Callable[[dict[str, Any]], tuple[memoryview, Callable[[float], None]]],
                 on_request: Callable[[str], None], *, chunk: int,
                 throttle: float | None) -> None:
        self._expected = token.encode() if token else None
        self._timeout = timeout
        self._serve = serve
        self._on_request = on_request
        self._chunk = chunk
        self._throttle = throttle
        self._sock = socket.create_server((host, port), backlog=64)
        self.port = int(self._sock.getsockname()[1])
        self._closed = False
        self._thread = threading.Thread(target=self._accept, name="tensordb-dataplane",
                                        daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._handle, args=(conn,), daemon=True,
                             name="tensordb-dataplane-conn").start()

    def _handle(self, conn: socket.socket) -> None:
        answered = False
        try:
            conn.settimeout(self._timeout)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                req = _recv_frame(conn)
                got = req.get("token")
                if self._expected is not None and not (
                        isinstance(got, str)
                        and hmac.compare_digest(got.encode(), self._expected)):
                    raise Unauthorized(f"this node refused the request: missing or wrong "
                                       f"token (give token= to connect, or set ${TOKEN_ENV})")
                data, done = self._serve(req)
            except TensorDBError as exc:
                self._on_request(type(exc).__name__)
                _send_frame(conn, {"error": error_payload(exc)})
                answered = True
                return
            _send_frame(conn, {"ok": True})
            answered = True
            t0 = time.perf_counter()
            for lo in range(0, len(data), self._chunk):
                hi = min(lo + self._chunk, len(data))
                conn.sendall(data[lo:hi])
                if self._throttle:
                    time.sleep((hi - lo) / self._throttle)
            done(time.perf_counter() - t0)
            self._on_request("ok")
        except (OSError, ConnectionError):
            pass  # the client went away or stalled: it resumes elsewhere
        except Exception as exc:  # noqa: BLE001 - a bug must not kill the listener
            # the details stay in this node's log: the client learns the kind, not a trace
            _log.exception("the data plane failed on a request")
            if not answered:
                try:
                    _send_frame(conn, {"error": error_payload(NodeUnavailable(
                        f"the data plane failed on the request ({type(exc).__name__})"))})
                except OSError:
                    pass
        finally:
            conn.close()

    def close(self) -> None:
        """Stop listening (streams in flight finish or fail on their own). Idempotent."""
        if not self._closed:
            self._closed = True
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._sock.close()
            self._thread.join(5)


def fetch_into(node: str, host: str, port: int, token: str | None, segment_id: str,
               offset: int, dst: np.ndarray, on_bytes: Callable[[int], None],
               timeout: float, raise_error: Callable[[object], None]) -> None:
    """Receive bytes ``[offset, offset + len(dst))`` of a segment straight into ``dst``
    (uint8, contiguous). ``on_bytes(n)``: the next ``n`` bytes of ``dst`` are in (called
    every MiB, and for what arrived before a failure). ``raise_error(payload)`` raises
    the typed error a server's error payload stands for. Fails with NodeUnavailable when the
    node does not answer, stalls longer than ``timeout`` or ends the stream early."""
    length = len(dst)
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except OSError as exc:
        raise NodeUnavailable(f"node {node!r}: its data port {host}:{port} refused or did "
                              f"not answer ({exc})", node=node) from exc
    got = reported = 0
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        try:
            _send_frame(sock, {"token": token, "id": segment_id, "offset": offset,
                               "length": length})
            answer = _recv_frame(sock)
        except (OSError, ConnectionError) as exc:
            raise NodeUnavailable(f"node {node!r} dropped the request for segment "
                                  f"{segment_id}: {exc}", node=node) from exc
        except InvalidInput as exc:  # a broken or hostile holder: the next one may serve
            raise NodeUnavailable(f"node {node!r} answered the request for segment "
                                  f"{segment_id} with a malformed header: {exc}",
                                  node=node) from exc
        if "error" in answer:
            raise_error(answer["error"])
        if answer.get("ok") is not True:
            raise NodeUnavailable(f"node {node!r} answered {answer!r}", node=node)
        view = memoryview(dst)
        while got < length:
            try:
                k = sock.recv_into(view[got:])
            except TimeoutError as exc:
                raise NodeUnavailable(f"node {node!r} stalled for more than {timeout:g} s "
                                      f"sending segment {segment_id}", node=node) from exc
            except OSError as exc:
                raise NodeUnavailable(f"node {node!r} broke the stream of segment "
                                      f"{segment_id}: {exc}", node=node) from exc
            if k == 0:
                raise NodeUnavailable(f"node {node!r} ended segment {segment_id} after "
                                      f"{got} of {length} bytes", node=node)
            got += k
            if got - reported >= _REPORT or got == length:
                n, reported = got - reported, got
                on_bytes(n)
    finally:
        if got > reported:  # what arrived before a failure is good: the next holder resumes
            n, reported = got - reported, got
            on_bytes(n)
        sock.close()
