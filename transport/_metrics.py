"""Prometheus metrics of a node server, on an HTTP port of their own.

Counters (bytes in and out per tier, requests per kind and outcome) and a histogram of
transfer latency are updated by the server as it works; the store's gauges (extents
and bytes per tier, leases) are read from the tiers and the catalog at scrape time.
All of it lives in the serving process (``tensordb serve``); the endpoint answers on a
daemon thread of its own. Bound off loopback on a node with a token, a scrape must
carry it (``authorization: Bearer <token>``, as Prometheus' ``authorization`` setting
sends it): the gauges name the node's tiers and sizes. On loopback it answers anyone
on the host.
"""

from __future__ import annotations

import logging
import socket
import ssl
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, Counter, Histogram, make_wsgi_app
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.registry import Collector

import storage_engine as se

from ._auth import Authenticator, is_loopback

__all__ = ["NodeMetrics"]

_log = logging.getLogger("tensordb.transport")
_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class _StoreCollector(Collector):
    """Gauges read at scrape time: a scrape never sees a stale count."""

    def __init__(self, node: str, tiers: Mapping[str, se.Tier],
                 leases: Callable[[], int]) -> None:
        self._node = node
        self._tiers = tiers
        self._leases = leases

    def collect(self) -> Iterator[GaugeMetricFamily]:
        extents = GaugeMetricFamily("tensordb_extents", "Segments (extent files) held per tier",
                                    labels=["node", "tier"])
        used = GaugeMetricFamily("tensordb_tier_bytes", "Bytes held per tier",
                                 labels=["node", "tier"])
        for name, tier in list(self._tiers.items()):
            try:
                extents.add_metric([self._node, name], sum(1 for _ in tier.segments()))
                used.add_metric([self._node, name], tier.used_bytes())
            except OSError as exc:  # a tier directory removed under us: skip it
                _log.warning("metrics: tier %s unreadable: %s", name, exc)
        yield extents
        yield used
        leases = GaugeMetricFamily("tensordb_leases", "Snapshot leases held in the catalog",
                                   labels=["node"])
        try:
            leases.add_metric([self._node], self._leases())
        except Exception as exc:  # noqa: BLE001 - the catalog down must not break scrapes
            _log.warning("metrics: catalog unreadable: %s", exc)
        yield leases


class NodeMetrics:
    """The metrics of one node server, in a registry of their own (not the global one,
    so two servers in one process, as in tests, do not collide)."""

    def __init__(self, node: str, tiers: Mapping[str, se.Tier] | None = None,
                 leases: Callable[[], int] | None = None,
                 collectors: Iterable[Collector] = ()) -> None:
        self.node = node
        self.registry = CollectorRegistry()
        self.bytes_out = Counter("tensordb_bytes_out", "Bytes sent to other nodes, per tier",
                                 ["node", "tier"], registry=self.registry)
        self.bytes_in = Counter("tensordb_bytes_in", "Bytes pulled from other nodes, per tier",
                                ["node", "tier"], registry=self.registry)
        self.requests = Counter("tensordb_requests", "Requests served, per kind and outcome",
                                ["node", "kind", "outcome"], registry=self.registry)
        self.transfer_seconds = Histogram(
            "tensordb_transfer_seconds", "Latency of one segment transfer, per direction",
            ["node", "direction"], buckets=_BUCKETS, registry=self.registry)
        if tiers is not None:
            self.registry.register(_StoreCollector(node, tiers, leases or (lambda: 0)))
        for collector in collectors:  # the host's view (tensordb.client's HostCollector)
            self.registry.register(collector)
        self._http: Any = None

    def sent(self, tier: str, nbytes: int, seconds: float) -> None:
        self.bytes_out.labels(self.node, tier).inc(nbytes)
        self.transfer_seconds.labels(self.node, "out").observe(seconds)

    def pulled(self, tier: str, nbytes: int, seconds: float) -> None:
        self.bytes_in.labels(self.node, tier).inc(nbytes)
        self.transfer_seconds.labels(self.node, "in").observe(seconds)

    def request(self, kind: str, outcome: str) -> None:
        self.requests.labels(self.node, kind, outcome).inc()

    def serve(self, port: int, host: str = "127.0.0.1", token: str | None = None, *,
              auth: Authenticator | None = None, tls: ssl.SSLContext | None = None) -> int:
        """Serve /metrics over HTTP (HTTPS with ``tls``) on a daemon thread; returns the
        bound port. Off loopback, with a ``token``, a scrape must carry it, or a token
        ``auth`` grants the admin action on every name (the node role's, an admin token
        of scope ``*``); else 401."""
        app = make_wsgi_app(self.registry)
        if token and not is_loopback(host):
            app = _bearer_only(app, auth or Authenticator(token))
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        server_class: type[ThreadingWSGIServer] = type(
            "_MetricsServer", (ThreadingWSGIServer,), {"address_family": family})
        server: ThreadingWSGIServer = make_server(host, port, app, server_class, handler_class=_QuietHandler)
        if tls is not None:  # the handshake runs on the request's thread, not accept's
            server.socket = tls.wrap_socket(server.socket, server_side=True,
                                            do_handshake_on_connect=False)
        threading.Thread(target=server.serve_forever, daemon=True,
                         name="tensordb-metrics").start()
        self._http = server
        return int(server.server_address[1])

    def close(self) -> None:
        if self._http is not None:
            server, self._http = self._http, None
            server.shutdown()
            server.server_close()


def _bearer_only(app: Callable[..., Iterable[bytes]], auth: Authenticator
                 ) -> Callable[..., Iterable[bytes]]:
    """``app`` behind a token that may read the node's metrics (exactly one
    authorization header): the node's, or an admin token of every name (the metrics
    name every tenant's collections and namespaces)."""

    def guarded(environ: dict[str, Any], start_response: Callable[..., Any]
                ) -> Iterable[bytes]:
        # WSGI folds repeated headers into one value joined by ", ": two never match
        got = environ.get("HTTP_AUTHORIZATION")
        grant = auth.header_grant([got.encode("latin-1")]) if got is not None else None
        if grant is not None and grant.may("admin") and grant.scope == "*":
            return app(environ, start_response)
        start_response("401 Unauthorized", [("Content-Type", "text/plain"),
                                            ("WWW-Authenticate", "Bearer")])
        return [b"this node requires its token (authorization: Bearer ...)\n"]

    return guarded


class _QuietHandler(WSGIRequestHandler):
    """No line on stderr per scrape."""

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        pass
