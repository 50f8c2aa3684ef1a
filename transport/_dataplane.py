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
attributes). The server half runs in the node's serving process: one thread reads the
headers of every connection, a bounded pool of threads streams the answers
(``DataPlaneServer``: its limits, and how it survives accept() failing); the client
half (``fetch_into``) runs in the process that pulls. Each transfer of n bytes must end
within ``timeout + n / min_rate`` seconds on both ends (``min_transfer_rate``).

The token is checked as the Flight middleware checks it (``_auth.Authenticator``: the
cluster's token, or a scoped token of the catalog whose scope covers a collection of the
segment); a wrong one is answered with ``Unauthorized`` and the connection closed. The
token is dropped from the request before anything handles it, so no error can quote it.
With TLS (``tensordb serve --tls-cert``) every connection is a TLS stream: its handshake
runs in the header loop, non-blocking, so a connection that stalls in it pins no
thread. Checksums are the caller's
(``_pull`` hashes each extent as its bytes land), so a stream cut anywhere leaves a
prefix the next holder resumes from.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import selectors
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tensordb.errors import InvalidInput, NodeUnavailable, TensorDBError

from ._base import error_payload

__all__ = ["Authorize", "DataPlaneServer", "fetch_into", "MAX_HEADER", "MAX_CONNECTIONS", "MAX_TRANSFERS",
           "MIN_RATE", "MIN_RATE_ENV", "min_transfer_rate"]

_LEN = struct.Struct(">I")
MAX_HEADER = 64 << 10  # a request or answer header is a small JSON object
_REPORT = 1 << 20  # hand received bytes to the caller (to hash, in cache) every MiB
#: connections a node keeps waiting for their request header at once (each holds a
#: descriptor, no thread); one more closes the oldest
MAX_CONNECTIONS = 256
#: transfers a node streams at once, each on a thread (as many more may queue)
MAX_TRANSFERS = 32
#: the slowest average rate a transfer may keep, bytes/s: a transfer of n bytes must end
#: within timeout + n / rate seconds, on both ends (a peer sending a byte a second
#: fails instead of holding its reader for ever)
MIN_RATE = float(1 << 20)
MIN_RATE_ENV = "TENSORDB_TRANSFER_MIN_RATE"
#: accept() failed: pause this long, doubling up to _BACKOFF_MAX while it keeps failing
_BACKOFF_MIN, _BACKOFF_MAX = 0.05, 1.0
_EXHAUSTED = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}
_BACKLOG = 4096  # the kernel caps it at net.core.somaxconn


def min_transfer_rate() -> float:
    """The floor rate of transfers: $TENSORDB_TRANSFER_MIN_RATE (bytes/s), else MIN_RATE."""
    raw = os.environ.get(MIN_RATE_ENV, "")
    try:
        rate = float(raw) if raw else MIN_RATE
    except ValueError:
        raise InvalidInput(f"${MIN_RATE_ENV} must be a number of bytes per second, not "
                           f"{raw!r}") from None
    if not rate > 0:
        raise InvalidInput(f"${MIN_RATE_ENV} must be positive, not {raw!r}")
    return rate

_log = logging.getLogger("tensordb.transport")

#: checks a request's token against what it asks (``token``, request): raises
#: Unauthorized when it may not; the node server's is ``NodeServer._authorize_segment``
Authorize = Callable[[str | None, dict[str, Any]], None]


def _send_frame(sock: socket.socket, obj: dict[str, Any]) -> None:
    body = json.dumps(obj).encode()
    sock.sendall(_LEN.pack(len(body)) + body)


def _recv_exact(sock: socket.socket, n: int, deadline: float | None = None,
                stall: float | None = None) -> bytes:
    """``n`` bytes; with a ``deadline`` (monotonic), TimeoutError once it passes, each
    recv waiting at most ``stall``."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the header did not arrive in time")
            sock.settimeout(left if stall is None else min(stall, left))
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError(f"the peer closed the stream after {got} of {n} bytes")
        got += k
    return bytes(buf)


def _parse_frame(body: bytes) -> dict[str, Any]:
    try:
        obj = json.loads(body)
    except ValueError as exc:
        raise InvalidInput(f"a data-plane header must be JSON: {exc}") from exc
    if not isinstance(obj, dict):
        raise InvalidInput("a data-plane header must be a JSON object")
    return obj


def _recv_frame(sock: socket.socket, deadline: float | None = None,
                stall: float | None = None) -> dict[str, Any]:
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size, deadline, stall))
    if n > MAX_HEADER:
        raise InvalidInput(f"a data-plane header of {n} bytes (at most {MAX_HEADER})")
    return _parse_frame(_recv_exact(sock, n, deadline, stall))


@dataclass(slots=True)
class _Pending:
    """A connection whose request header is still arriving."""

    deadline: float
    buf: bytearray = field(default_factory=bytearray)
    handshaken: bool = False  # TLS: the handshake is done


class DataPlaneServer:
    """The listening half, owned by a ``NodeServer``: ``serve(req)`` turns a request into
    (bytes to send, done callback) or raises a TensorDBError, which goes back as its
    payload; ``chunk``/``throttle`` pace the stream as the Flight path does.

    One thread accepts connections and reads their request headers, all at once through
    a selector: a connection that sends nothing pins no thread, and is closed when its
    header has not arrived ``timeout`` seconds after it was accepted. At most
    ``max_connections`` wait so at once: a new one then closes the oldest. A request
    whose header is in goes to one of ``max_transfers`` threads (as many more may
    queue; beyond that it is answered NodeUnavailable, busy); its stream must end within
    ``timeout + length / min_rate`` seconds, and no send may stall longer than
    ``timeout``. accept() failing (EMFILE: no descriptor left) closes the oldest waiting
    connections and pauses accepting for a moment, then goes on: the plane serves again
    as soon as descriptors are free."""

    def __init__(self, host: str, port: int, authorize: Authorize | None, timeout: float,
                 serve: Callable[[dict[str, Any]], tuple[memoryview, Callable[[float], None]]],
                 on_request: Callable[[str], None], *, chunk: int,
                 throttle: float | None, node: str = "",
                 max_connections: int = MAX_CONNECTIONS, max_transfers: int = MAX_TRANSFERS,
                 min_rate: float | None = None, tls: ssl.SSLContext | None = None) -> None:
        self._authorize = authorize
        self._tls = tls
        self._timeout = timeout
        self._serve = serve
        self._on_request = on_request
        self._chunk = chunk
        self._throttle = throttle
        self._node = node
        self._max_connections = max(1, max_connections)
        self._max_transfers = max(1, max_transfers)
        self._min_rate = min_rate or min_transfer_rate()
        # a deep backlog: a burst of connections (hundreds that stall, say) must not
        # overflow it, or the kernel drops the handshake of the next real one for a second
        self._sock = socket.create_server((host, port), backlog=_BACKLOG)
        self._sock.setblocking(False)
        self.port = int(self._sock.getsockname()[1])
        self._closed = False
        self._pending: dict[socket.socket, _Pending] = {}  # oldest first
        self._busy = 0  # requests handed to the pool, running or queued
        self._busy_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(self._max_transfers,
                                        thread_name_prefix="tensordb-dataplane-conn")
        #: what the accept loop has survived, for tests and logs
        self.accept_errors = 0
        self.shed = 0
        self._wake_r, self._wake_w = socket.socketpair()
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._sel.register(self._sock, selectors.EVENT_READ, "listen")
        self._listening = True
        self._paused_until = 0.0
        self._backoff = _BACKOFF_MIN
        self._thread = threading.Thread(target=self._loop, name="tensordb-dataplane",
                                        daemon=True)
        self._thread.start()

    # -- the accept and header loop ------------------------------------------------
    def _accept_one(self) -> socket.socket:
        """One connection from the listening socket (a test may make it fail)."""
        conn, _ = self._sock.accept()
        return conn

    def _loop(self) -> None:
        while not self._closed:
            try:
                if self._step():
                    return
            except Exception:  # noqa: BLE001 - a bug must not end the plane for good
                _log.exception("the data plane's accept loop failed; going on")
                time.sleep(_BACKOFF_MIN)

    def _step(self) -> bool:
        """One turn of the loop: accept, read headers, expire; True once woken to stop."""
        now = time.monotonic()
        if not self._listening and now >= self._paused_until:
            self._sel.register(self._sock, selectors.EVENT_READ, "listen")
            self._listening = True
        wait = 1.0
        if self._pending:
            wait = min(wait, next(iter(self._pending.values())).deadline - now)
        if not self._listening:
            wait = min(wait, self._paused_until - now)
        events = self._sel.select(max(0.0, wait))
        for key, _ in events:
            if key.data == "wake":
                return True
            if key.data == "listen":
                self._accept_some()
            else:
                self._read_header(key.fileobj)  # type: ignore[arg-type]
        self._expire(time.monotonic())
        return self._closed

    def _accept_some(self) -> None:
        for _ in range(64):  # then read headers again, whatever keeps arriving
            try:
                conn = self._accept_one()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if self._closed:
                    return
                self._accept_failed(exc)
                return
            self._backoff = _BACKOFF_MIN
            if len(self._pending) >= self._max_connections:
                self._shed(1)
            try:
                conn.setblocking(False)
                if self._tls is not None:  # the handshake runs in _read_header
                    conn = self._tls.wrap_socket(conn, server_side=True,
                                                 do_handshake_on_connect=False)
                self._sel.register(conn, selectors.EVENT_READ, "conn")
            except (OSError, ValueError):
                conn.close()
                continue
            self._pending[conn] = _Pending(time.monotonic() + self._timeout)

    def _accept_failed(self, exc: OSError) -> None:
        """accept() failed: out of descriptors (or memory), or a connection that was
        reset before it was taken. Free what waits longest and pause a moment."""
        self.accept_errors += 1
        if exc.errno in _EXHAUSTED:
            self._shed(max(1, len(self._pending) // 4))
        if self.accept_errors in (1, 10, 100) or self.accept_errors % 1000 == 0:
            _log.warning("the data plane could not accept a connection (%s; %d so far): "
                         "pausing %.2f s", exc, self.accept_errors, self._backoff)
        if self._listening:
            self._sel.unregister(self._sock)
            self._listening = False
        self._paused_until = time.monotonic() + self._backoff
        self._backoff = min(_BACKOFF_MAX, self._backoff * 2)

    def _drop(self, conn: socket.socket) -> None:
        self._pending.pop(conn, None)
        try:
            self._sel.unregister(conn)
        except (KeyError, ValueError):
            pass
        conn.close()

    def _shed(self, n: int) -> None:
        """Close the ``n`` connections that have waited longest for their header."""
        for conn in list(self._pending)[:n]:
            self.shed += 1
            self._drop(conn)

    def _expire(self, now: float) -> None:
        for conn, p in list(self._pending.items()):
            if p.deadline > now:
                break  # in order of arrival, so of deadline
            self._drop(conn)

    def _read_header(self, conn: socket.socket) -> None:
        if isinstance(conn, ssl.SSLSocket):
            p = self._pending.get(conn)
            if p is None:
                return
            if not p.handshaken:
                try:
                    conn.do_handshake()
                except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
                    return
                except (OSError, ValueError):  # not TLS, or a certificate refused
                    self._drop(conn)
                    return
                p.handshaken = True
            # a TLS record may hold more than one recv takes: read on while the
            # connection holds decrypted bytes, which no selector sees
            while self._read_some(conn) and conn in self._pending and conn.pending():
                pass
            return
        self._read_some(conn)

    def _read_some(self, conn: socket.socket) -> bool:
        """One recv of a header; True when it took bytes and the header is not whole."""
        p = self._pending.get(conn)
        if p is None:
            return False
        have = len(p.buf)
        need = _LEN.size if have < _LEN.size else _LEN.size + _LEN.unpack(p.buf[:_LEN.size])[0]
        try:
            got = conn.recv(need - have)
        except (BlockingIOError, InterruptedError, ssl.SSLWantReadError,
                ssl.SSLWantWriteError):
            return False
        except OSError:
            self._drop(conn)
            return False
        if not got:
            self._drop(conn)
            return False
        p.buf += got
        if len(p.buf) < _LEN.size:
            return True
        (n,) = _LEN.unpack(p.buf[:_LEN.size])
        if n > MAX_HEADER:
            self._answer_now(conn, InvalidInput(
                f"a data-plane header of {n} bytes (at most {MAX_HEADER})"))
            return False
        if len(p.buf) < _LEN.size + n:
            return True
        try:
            req = _parse_frame(bytes(p.buf[_LEN.size:]))
        except InvalidInput as exc:
            self._answer_now(conn, exc)
            return False
        self._pending.pop(conn)
        self._sel.unregister(conn)
        with self._busy_lock:
            busy = self._busy >= 2 * self._max_transfers
            if not busy:
                self._busy += 1
        if busy:
            self._on_request("NodeUnavailable")
            self._answer_inline(conn, NodeUnavailable(
                f"node {self._node!r} is busy: {2 * self._max_transfers} data-plane requests "
                f"are running or queued; read from another holder or later",
                node=self._node or None))
            return False
        try:
            self._pool.submit(self._handle, conn, req)
        except RuntimeError:  # closing: the pool takes no more
            self._release()
            conn.close()
        return False

    def _answer_now(self, conn: socket.socket, exc: TensorDBError) -> None:
        self._pending.pop(conn, None)
        try:
            self._sel.unregister(conn)
        except (KeyError, ValueError):
            pass
        self._on_request(type(exc).__name__)
        self._answer_inline(conn, exc)

    @staticmethod
    def _answer_inline(conn: socket.socket, exc: TensorDBError) -> None:
        """Answer ``exc`` without waiting (a small frame fits any fresh socket's buffer)
        and close."""
        try:
            body = json.dumps({"error": error_payload(exc)}).encode()
            conn.send(_LEN.pack(len(body)) + body)
            conn.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        finally:
            conn.close()

    def _release(self) -> None:
        with self._busy_lock:
            self._busy -= 1

    # -- one request, on a pool thread ----------------------------------------------
    def _handle(self, conn: socket.socket, req: dict[str, Any]) -> None:
        answered = False
        try:
            conn.setblocking(True)
            conn.settimeout(self._timeout)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            got = req.pop("token", None)  # never echoed, not even in an error's text
            try:
                if self._authorize is not None:
                    self._authorize(got if isinstance(got, str) else None, req)
                data, done = self._serve(req)
            except TensorDBError as exc:
                self._on_request(type(exc).__name__)
                _send_frame(conn, {"error": error_payload(exc)})
                answered = True
                return
            _send_frame(conn, {"ok": True})
            answered = True
            t0 = time.perf_counter()
            deadline = time.monotonic() + self._timeout + len(data) / self._min_rate
            for lo in range(0, len(data), self._chunk):
                hi = min(lo + self._chunk, len(data))
                _send_by(conn, data[lo:hi], deadline, self._timeout)
                if self._throttle:
                    time.sleep((hi - lo) / self._throttle)
            done(time.perf_counter() - t0)
            self._on_request("ok")
        except (OSError, ConnectionError):
            pass  # the client went away, stalled or dripped: it resumes elsewhere
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
            self._release()

    def close(self) -> None:
        """Stop listening (streams in flight finish or fail on their own). Idempotent."""
        if not self._closed:
            self._closed = True
            try:
                self._wake_w.send(b"x")
            except OSError:
                pass
            self._thread.join(5)
            for conn in list(self._pending):
                self._drop(conn)
            self._sel.close()
            self._sock.close()
            self._wake_r.close()
            self._wake_w.close()
            self._pool.shutdown(wait=False)


def _send_by(conn: socket.socket, data: memoryview, deadline: float, stall: float) -> None:
    """Send all of ``data`` before ``deadline`` (monotonic), no send waiting longer than
    ``stall``: TimeoutError otherwise."""
    pos = 0
    while pos < len(data):
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the transfer ran past its deadline")
        conn.settimeout(min(stall, left))
        pos += conn.send(data[pos:])


def _connect(node: str, host: str, port: int, timeout: float,
             tls: ssl.SSLContext | None) -> socket.socket:
    """A connection to a node's data port, TLS when ``tls`` (NodeUnavailable when it
    cannot be made or the handshake fails: a certificate this process does not trust)."""
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except OSError as exc:
        raise NodeUnavailable(f"node {node!r}: its data port {host}:{port} refused or did "
                              f"not answer ({exc})", node=node) from exc
    if tls is None:
        return sock
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        return tls.wrap_socket(sock, server_hostname=host)
    except (OSError, ValueError) as exc:
        sock.close()
        raise NodeUnavailable(f"node {node!r}: the TLS handshake with its data port "
                              f"{host}:{port} failed ({exc})", node=node) from exc


def fetch_into(node: str, host: str, port: int, token: str | None, segment_id: str,
               offset: int, dst: np.ndarray, on_bytes: Callable[[int], None],
               timeout: float, raise_error: Callable[[object], None], *,
               min_rate: float | None = None, tls: ssl.SSLContext | None = None) -> None:
    """Receive bytes ``[offset, offset + len(dst))`` of a segment straight into ``dst``
    (uint8, contiguous). ``on_bytes(n)``: the next ``n`` bytes of ``dst`` are in (called
    every MiB, and for what arrived before a failure). ``raise_error(payload)`` raises
    the typed error a server's error payload stands for. Fails with NodeUnavailable when the
    node does not answer, stalls longer than ``timeout``, has not sent everything within
    ``timeout + len(dst) / min_rate`` seconds (default ``min_transfer_rate()``), or
    ends the stream early."""
    length = len(dst)
    rate = min_rate or min_transfer_rate()
    allowed = timeout + length / rate
    sock = _connect(node, host, port, timeout, tls)
    got = reported = 0
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        try:
            _send_frame(sock, {"token": token, "id": segment_id, "offset": offset,
                               "length": length})
            answer = _recv_frame(sock, time.monotonic() + timeout, timeout)
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
            raise NodeUnavailable(f"node {node!r} answered {repr(answer)[:200]}", node=node)
        view = memoryview(dst)
        deadline = time.monotonic() + allowed  # for the bytes, once the answer is in
        while got < length:
            limit = min(timeout, deadline - time.monotonic())
            try:
                if limit <= 0:
                    raise TimeoutError
                sock.settimeout(limit)
                k = sock.recv_into(view[got:])
            except TimeoutError as exc:
                if limit < timeout:  # the whole transfer's time ran out, not one wait
                    raise NodeUnavailable(
                        f"node {node!r} sent {got} of {length} bytes of segment "
                        f"{segment_id} in {allowed:.3g} s, the most a transfer that size "
                        f"may take (${MIN_RATE_ENV}: {rate:.3g} bytes/s)",
                        node=node) from exc
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
