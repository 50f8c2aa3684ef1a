"""Running a node: the server, its registration and heartbeat, its metrics endpoint,
until a signal stops it (what ``tensordb serve`` does)."""

from __future__ import annotations

import json
import signal
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tensordb.catalog import NodeDirectory

from ._auth import resolve_token
from ._flight_client import DEFAULT_TIMEOUT
from ._metrics import NodeMetrics
from ._registry import DEFAULT_HEARTBEAT, NodeRegistration
from ._flight_server import NodeServer

if TYPE_CHECKING:
    from tensordb import Database

__all__ = ["RunningNode", "ready_line", "start_node"]


@dataclass
class RunningNode:
    """A started node: its server, registration and metrics. ``stop`` ends all three."""

    server: NodeServer
    registration: NodeRegistration
    metrics: NodeMetrics
    address: str
    metrics_port: int | None

    def stop(self) -> None:
        """Deregister, stop serving, close the metrics endpoint. Idempotent."""
        self.registration.stop()
        self.server.close()
        self.metrics.close()

    def wait(self, on_ready: Callable[[RunningNode], None] | None = None) -> None:
        """Block until SIGTERM or SIGINT (main thread only), then ``stop``."""
        done = threading.Event()
        previous = {s: signal.signal(s, lambda *_: done.set())
                    for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            if on_ready is not None:
                on_ready(self)
            while not done.wait(0.5):
                pass
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            self.stop()


def _advertised(host: str, port: int, advertise: str | None) -> str:
    if advertise:
        return advertise if ":" in advertise else f"{advertise}:{port}"
    if host in ("0.0.0.0", "::", ""):
        return f"{socket.getfqdn()}:{port}"
    return f"{host}:{port}"


def start_node(db: Database, *, host: str = "127.0.0.1", port: int = 0,
               token: str | None = None, metrics_port: int | None = None,
               advertise: str | None = None, heartbeat: float = DEFAULT_HEARTBEAT,
               timeout: float | None = None, data_port: int = 0) -> RunningNode:
    """Serve ``db``'s node: listen (refusing a non-loopback host without a token),
    register in the catalog with a heartbeat, and serve metrics on ``metrics_port``
    (None: no endpoint; 0: any free port). Segment bytes go out on a data plane at
    ``data_port`` (0: any free port), on the same host. Returns once all of it is up."""
    token = resolve_token(token)
    tiers = {n: db.tier(n) for n in ("host", "disk")}
    metrics = NodeMetrics(db.config.node, tiers, lambda: db.stats()["leases"])
    server = NodeServer(db, host, port, token=token, metrics=metrics,
                        timeout=timeout or db.config.node_timeout or DEFAULT_TIMEOUT,
                        data_port=data_port)
    address = _advertised(host, server.port, advertise)
    registration = NodeRegistration(
        NodeDirectory(db.catalog.engine), db.config.node, address, sorted(tiers),
        db.config.host_capacity, interval=heartbeat)
    try:
        registration.start()
        bound = metrics.serve(metrics_port, host) if metrics_port is not None else None
    except BaseException:
        registration.stop()
        server.close()
        raise
    return RunningNode(server, registration, metrics, address, bound)


def ready_line(node: RunningNode) -> str:
    """The one JSON line ``tensordb serve`` prints once it answers."""
    return json.dumps({"node": node.registration.name, "address": node.address,
                       "metrics_port": node.metrics_port})
