"""Running a node: the server, its registration and heartbeat, its metrics endpoint,
until a signal stops it. This is the main of the ``tensordb serve`` process, one per
host; the heartbeat runs on a daemon thread of it.

A node's presence lives in the catalog: it registers on start, heartbeats while it runs,
deregisters on shutdown, and on every beat marks down the nodes whose heartbeat lapsed.
PostgreSQL holds the truth; there is no election and no consensus: any node that sees a
heartbeat older than the lapse may mark that node down, and a node that beats again
comes back up.
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import socket
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tensordb.catalog import NodeDirectory

from ._auth import resolve_token
from ._base import DEFAULT_TIMEOUT, NodeStore
from ._flight_server import NodeServer
from ._metrics import NodeMetrics
from ._tls import ServerTLS

__all__ = ["DEFAULT_HEARTBEAT", "NodeRegistration", "RunningNode", "ready_line", "start_node"]

#: seconds between two heartbeats (the lapse is several of them)
DEFAULT_HEARTBEAT = 1.0
#: lapse sweeps the whole cluster runs per heartbeat interval, about (``beat``)
SWEEPS_PER_INTERVAL = 2

_log = logging.getLogger("tensordb.transport")


class NodeRegistration:
    """Keeps one node registered while ``start``-ed; ``stop`` deregisters it.

    The heartbeat runs on a daemon thread; a catalog that does not answer for a beat is
    logged and retried on the next one (the node then lapses if it stays away)."""

    def __init__(self, directory: NodeDirectory, name: str, address: str,
                 tiers: Sequence[str], capacity: int | None, *,
                 interval: float = DEFAULT_HEARTBEAT) -> None:
        self.directory = directory
        self.name = name
        self.address = address
        self.tiers = list(tiers)
        self.capacity = capacity
        self.interval = interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: beats left before the next sweep, and the beats between two (``beat``)
        self._sweep_every = 1
        self._until_sweep = 1
        self._swept = False

    def start(self) -> None:
        """Register now (raises if the catalog refuses), then beat in the background."""
        self.directory.register(self.name, self.address, self.tiers, self.capacity)
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name="tensordb-heartbeat")
        self._thread.start()

    def beat(self) -> list[str]:
        """One heartbeat: renew this node's row (registering it again if someone removed
        it) and, on some beats, mark down the nodes whose heartbeat lapsed; returns those.

        A sweep reads every node's row, so each node sweeps once every ceil(up /
        SWEEPS_PER_INTERVAL) beats, its first beat at a random one of them: the cluster
        sweeps about SWEEPS_PER_INTERVAL times an interval whatever its size (1,000
        nodes sweeping on every beat were a million row reads a second), and a lapsed
        node is marked down within a fraction of an interval after its lapse."""
        self._until_sweep -= 1
        sweep = self._until_sweep <= 0
        got = self.directory.beat(self.name, sweep=sweep)
        if not got.known:  # someone removed our row
            self.directory.register(self.name, self.address, self.tiers, self.capacity)
        if got.up is not None:
            every = self._sweep_every = max(1, -(-got.up // SWEEPS_PER_INTERVAL))
            # after the first sweep a random phase: nodes started together spread out
            self._until_sweep = every if self._swept else random.randint(1, every)
            self._swept = True
        if got.lapsed:
            _log.warning("marked down (heartbeat lapsed): %s", ", ".join(got.lapsed))
        return got.lapsed

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.beat()
            except Exception as exc:  # noqa: BLE001 - the next beat retries
                _log.warning("heartbeat of node %s failed: %s", self.name, exc)

    def stop(self) -> None:
        """Stop beating and mark the node down. Idempotent."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        try:
            self.directory.deregister(self.name)
        except Exception as exc:  # noqa: BLE001 - it lapses instead
            _log.warning("could not deregister node %s: %s", self.name, exc)


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


def start_node(db: NodeStore, *, host: str = "127.0.0.1", port: int = 0,
               token: str | None = None, metrics_port: int | None = None,
               advertise: str | None = None, heartbeat: float = DEFAULT_HEARTBEAT,
               timeout: float | None = None, data_port: int = 0,
               token_file: str | os.PathLike[str] | None = None,
               tls: ServerTLS | None = None) -> RunningNode:
    """Serve ``db``'s node: listen (refusing a non-loopback host without a token, and a
    weak token anywhere), register in the catalog with a heartbeat, and serve metrics
    on ``metrics_port`` (None: no endpoint; 0: any free port; off loopback it needs the
    token). Segment bytes go out on a data plane at ``data_port`` (0: any free port),
    on the same host. The token: ``token``, else the file ``token_file``, else the
    environment's (``resolve_token``). With ``tls`` (a certificate and key) Flight, the
    data plane and the metrics endpoint speak TLS only. The node's segments are scrubbed by its store's
    background scrub, as every store's are (``Config.scrub_interval``, ``scrub_rate``,
    ``scrub_cpu``). Returns once all of it is up."""
    token = resolve_token(token, token_file)
    tiers = {n: db.tier(n) for n in ("host", "disk")}
    metrics = NodeMetrics(db.config.node, tiers, lambda: db.stats()["leases"],
                          collectors=[db.metrics_collector()])
    server = NodeServer(db, host, port, token=token, metrics=metrics,
                        timeout=timeout or db.config.node_timeout or DEFAULT_TIMEOUT,
                        data_port=data_port, tls=tls)
    address = _advertised(host, server.port, advertise)
    registration = NodeRegistration(
        NodeDirectory(db.catalog.engine), db.config.node, address, sorted(tiers),
        db.config.host_capacity, interval=heartbeat)
    try:
        registration.start()
        bound = metrics.serve(metrics_port, host, token, auth=server.auth,
                              tls=tls.context() if tls else None) \
            if metrics_port is not None else None
    except BaseException:
        registration.stop()
        server.close()
        raise
    return RunningNode(server, registration, metrics, address, bound)


def ready_line(node: RunningNode) -> str:
    """The one JSON line ``tensordb serve`` prints once it answers."""
    return json.dumps({"node": node.registration.name, "address": node.address,
                       "metrics_port": node.metrics_port,
                       "tls": node.server.tls is not None})
