"""The console's HTTP server: uvicorn on a socket of its own, on a daemon thread.

``serve_console`` binds the port first (0: any free one, read back before it returns),
then runs uvicorn on that socket in a thread with its own event loop, so a node server
or a CLI command keeps its main thread. With ``tls`` (the node's ``ssl.SSLContext``)
the console speaks HTTPS only. Bound off loopback, it needs a token
(``Authenticator``): a console is a view of every tensor's name and size.
"""

from __future__ import annotations

import logging
import socket
import ssl
import threading
import time
from typing import TYPE_CHECKING

import uvicorn

import transport
from tensordb.errors import InvalidInput, NodeUnavailable

from ._app import make_app
from ._series import KVSeries

if TYPE_CHECKING:
    from tensordb.client import Database
    from transport import Authenticator

__all__ = ["ConsoleServer", "serve_console"]

_log = logging.getLogger("tensordb.console")
_START_TIMEOUT = 30.0


class ConsoleServer:
    """A running console: ``port``, ``url``; ``close`` stops it and its sampler."""

    def __init__(self, server: uvicorn.Server, thread: threading.Thread, sock: socket.socket,
                 series: KVSeries, scheme: str) -> None:
        self._server = server
        self._thread = thread
        self._sock = sock
        self.series = series
        host, port = sock.getsockname()[:2]
        self.host = str(host)
        self.port = int(port)
        self.url = f"{scheme}://{'[' + self.host + ']' if ':' in self.host else self.host}:{self.port}"

    def close(self) -> None:
        """Stop serving (open requests finish first) and stop sampling. Idempotent."""
        self.series.stop()
        self._server.should_exit = True
        self._thread.join(timeout=15)
        self._sock.close()


def serve_console(db: Database, port: int = 0, host: str = "127.0.0.1", *,
                  auth: Authenticator | None = None, tls: ssl.SSLContext | None = None,
                  sample_interval: float = 5.0) -> ConsoleServer:
    """Serve ``db``'s console on ``host:port`` behind ``auth`` (None: no sign-in, which
    only a loopback bind allows), over TLS with ``tls``; KV counters are sampled every
    ``sample_interval`` seconds for the charts. Returns once it answers."""
    if auth is None and not transport.is_loopback(host):
        raise InvalidInput(f"refusing to serve the console on {host!r} without a token: "
                           f"give the node a token (--token-file), or bind loopback")
    if not 0 <= port <= 65535:
        raise InvalidInput(f"the console's port must be 0-65535, not {port}")
    series = KVSeries(db, sample_interval)
    app = make_app(db, auth, series, secure=tls is not None, hosts=[host])
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise InvalidInput(f"the console cannot bind {host}:{port}: {exc.strerror}") from None
    sock.listen(128)
    sock.set_inheritable(False)
    config = uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False,
                            server_header=False, timeout_graceful_shutdown=5)
    config.load()
    config.ssl = tls  # the node's context: uvicorn's own would read files again
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True,
                              name="tensordb-console")
    series.start()
    thread.start()
    deadline = time.monotonic() + _START_TIMEOUT
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            series.stop()
            server.should_exit = True
            sock.close()
            raise NodeUnavailable("the console's server did not start")
        time.sleep(0.01)
    return ConsoleServer(server, thread, sock, series, "https" if tls else "http")
