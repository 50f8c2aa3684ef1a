"""The CLI's server commands: ``tensordb serve`` (a node server, and its console with
--console-port), ``tensordb console`` (the web console of an embedded store),
``tensordb metrics`` (an embedded host's metrics) and ``tensordb ping``.

Part of the CLI application layer: registered on ``tensordb.cli.app`` when that module
loads. Each server command prints one JSON line once it answers, then serves until
SIGTERM or Ctrl-C.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import sys
import threading
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape

import transport

from . import connect
from .catalog import TokenStore
from .cli import _console, _where, app
from .console import ConsoleServer, serve_console
from .errors import InvalidInput

__all__ = ["console_command", "metrics_command", "ping_command", "serve_command"]

_Home = Annotated[Path | None, typer.Option(
    "--home", help="The embedded store's directory (default: the one before the command, "
    "else $TENSORDB_HOME, else ./.tensordb).", show_default=False)]
_ConsolePort = Annotated[int | None, typer.Option(
    "--console-port", min=0, max=65535, help="Serve the web console on this HTTP port "
    "(0: any free port), behind the node's token and the catalog's scoped tokens.",
    show_default=False)]


@app.command("serve")
def serve_command(
    ctx: typer.Context,
    port: Annotated[int, typer.Option(help="The Flight port (0: any free port).")],
    catalog: Annotated[str | None, typer.Option(
        "--catalog", metavar="URL", help="The cluster's catalog (default: the global "
        "--catalog).", show_default=False)] = None,
    node: Annotated[str | None, typer.Option(
        "--node", help="This host's node name (default: the global --node).",
        show_default=False)] = None,
    data_dir: Annotated[Path | None, typer.Option(
        "--data-dir", help="This node's disk tier (default: the global --data-dir).",
        show_default=False)] = None,
    host: Annotated[str, typer.Option(help="Address to bind; anything but loopback "
                                      "needs a token.")] = "127.0.0.1",
    token: Annotated[str | None, typer.Option(
        help="Token every request must carry, 16 characters or more (default: "
        "$TENSORDB_TOKEN). Every local user can read a command line: prefer "
        "--token-file.", show_default=False)] = None,
    token_file: Annotated[Path | None, typer.Option(
        "--token-file", metavar="PATH", help="Read the token from this file (its text, "
        "without the final newline; default: $TENSORDB_TOKEN_FILE).",
        show_default=False)] = None,
    metrics_port: Annotated[int | None, typer.Option(
        help="Serve Prometheus metrics on this HTTP port (0: any free port).",
        show_default=False)] = None,
    advertise: Annotated[str | None, typer.Option(
        help="HOST[:PORT] other nodes reach this one at (default: the bound address).",
        show_default=False)] = None,
    heartbeat: Annotated[float, typer.Option(help="Seconds between heartbeats.")] = 1.0,
    data_port: Annotated[int, typer.Option(
        min=0, max=65535, help="TCP port of the data plane, the stream segment bytes take "
        "to other nodes (0: any free port; nodes learn it from a ping).")] = 0,
    spare_bytes: Annotated[int | None, typer.Option(
        "--spare-bytes", min=0, help="Keep a pre-faulted shared-memory spare this large "
        "for incoming replicas: a pulled segment that fits lands at copy speed instead "
        "of faulting every page in (default: $TENSORDB_SPARE_BYTES, else none).",
        show_default=False)] = None,
    tls_cert: Annotated[Path | None, typer.Option(
        "--tls-cert", metavar="PATH", help="Serve TLS only, with this certificate chain "
        "(PEM; it must name the advertised host): Flight, the data plane and metrics.",
        show_default=False)] = None,
    tls_key: Annotated[Path | None, typer.Option(
        "--tls-key", metavar="PATH", help="The certificate's private key (PEM).",
        show_default=False)] = None,
    tls_ca: Annotated[Path | None, typer.Option(
        "--tls-ca", metavar="PATH", help="The CA bundle this node trusts when it pulls "
        "from other nodes over TLS (default: $TENSORDB_TLS_CA).", show_default=False)
    ] = None,
    console_port: _ConsolePort = None,
) -> None:
    """Run this host's node server: serve its store to other nodes over Arrow Flight
    (segment bytes over a TCP data plane beside it, on --data-port).

    Registers the node in the catalog with a heartbeat, and deregisters it on SIGTERM
    or Ctrl-C. Prints one JSON line (node, address, metrics_port, tls, console_port)
    once it answers.
    With a token, scoped tokens of the catalog ('tensordb token create') open it too.
    """
    if (tls_cert is None) != (tls_key is None):
        raise InvalidInput("TLS needs both --tls-cert and --tls-key")
    tls = transport.ServerTLS.load(tls_cert, tls_key) \
        if tls_cert is not None and tls_key is not None else None
    w = _where(ctx)
    extra: dict[str, Any] = {} if spare_bytes is None else {"spare_bytes": spare_bytes}
    if tls_ca is not None:
        transport.read_ca(tls_ca)  # a bad bundle fails now, not at the first pull
        extra["tls_ca"] = tls_ca.resolve()
    db = connect(catalog or w.catalog, home=w.home, node=node or w.node,
                 data_dir=data_dir or w.data_dir, **extra)
    console: ConsoleServer | None = None
    try:
        running = transport.start_node(db, host=host, port=port, token=token,
                                       token_file=token_file, metrics_port=metrics_port,
                                       advertise=advertise, heartbeat=heartbeat,
                                       data_port=data_port, tls=tls)
        if console_port is not None:
            try:
                console = serve_console(db, console_port, host, auth=running.server.auth,
                                        tls=tls.context() if tls else None)
            except BaseException:
                running.stop()
                raise

        def ready(n: transport.RunningNode) -> None:
            line = json.loads(transport.ready_line(n))
            line["console_port"] = console.port if console is not None else None
            print(json.dumps(line), flush=True)

        running.wait(on_ready=ready)
    finally:
        if console is not None:
            console.close()
        db.close()
    _console(stderr=True).print(f"node {escape(repr(db.config.node))} stopped")


@app.command("ping")
def ping_command(
    address: Annotated[str, typer.Argument(help="HOST:PORT of a node server's Flight port.")],
    token: Annotated[str | None, typer.Option(
        help="The node's token (default: $TENSORDB_TOKEN).", show_default=False)] = None,
    token_file: Annotated[Path | None, typer.Option(
        "--token-file", metavar="PATH", help="Read the token from this file (default: "
        "$TENSORDB_TOKEN_FILE).", show_default=False)] = None,
    timeout: Annotated[float, typer.Option(min=0.1, help="Seconds to wait.")] = 5.0,
    tls_ca: Annotated[Path | None, typer.Option(
        "--tls-ca", metavar="PATH", help="Speak TLS, trusting this CA bundle (default: "
        "$TENSORDB_TLS_CA).", show_default=False)] = None,
) -> None:
    """Ask a node server whether it answers (a container's health check): prints its
    reply as one JSON line; NodeUnavailable (a non-zero exit) when it does not answer in
    time."""
    ca_path = tls_ca or os.environ.get("TENSORDB_TLS_CA") or None
    flight = transport.FlightTransport(transport.resolve_token(token, token_file), timeout,
                                       tls_ca=transport.read_ca(ca_path) if ca_path else None)
    try:
        print(json.dumps(flight.ping(address, address), sort_keys=True), flush=True)
    finally:
        flight.close()


@app.command("metrics")
def metrics_command(
    ctx: typer.Context,
    home: _Home = None,
    port: Annotated[int, typer.Option(
        min=0, max=65535, help="HTTP port of /metrics (0: any free port).")] = 9464,
    host: Annotated[str, typer.Option(help="Address to bind; anything but loopback "
                                      "needs a token.")] = "127.0.0.1",
    token: Annotated[str | None, typer.Option(
        help="Token a scrape must carry off loopback (authorization: Bearer; default: "
        "$TENSORDB_TOKEN).", show_default=False)] = None,
    token_file: Annotated[Path | None, typer.Option(
        "--token-file", metavar="PATH", help="Read the token from this file.",
        show_default=False)] = None,
    once: Annotated[bool, typer.Option(
        "--once", help="Print the metrics once (Prometheus' text format) and exit.")
    ] = False,
) -> None:
    """Export this host's metrics for Prometheus: the KV namespaces' shared counters,
    the tiers' bytes, the latency of the commits, reads and pulls of every process of
    the host, the catalog's collections and policy runs, and the scrubber's progress.

    For a host with no node server (an embedded store); a node server serves the same
    beside its own on --metrics-port. Prints one JSON line (metrics_port) once it
    answers, then serves until SIGTERM or Ctrl-C.
    """
    w = _where(ctx)
    db = connect(w.catalog, home=home or w.home, node=w.node, data_dir=w.data_dir)
    try:
        if once:
            from prometheus_client import CollectorRegistry, generate_latest

            registry = CollectorRegistry()
            registry.register(db.metrics_collector())
            sys.stdout.write(generate_latest(registry).decode())
            return
        secret = transport.resolve_token(token, token_file)
        if not transport.is_loopback(host) and secret is None:
            raise InvalidInput(f"metrics on {host} (off loopback) need a token: give "
                               f"--token-file or $TENSORDB_TOKEN")
        if secret is not None:
            transport.check_token(secret)
        metrics = transport.NodeMetrics(db.config.node, collectors=[db.metrics_collector()])
        bound = metrics.serve(port, host, secret)
        try:
            print(json.dumps({"node": db.config.node, "metrics_port": bound}), flush=True)
            _wait_for_signal()
        finally:
            metrics.close()
    finally:
        db.close()


@app.command("console")
def console_command(
    ctx: typer.Context,
    home: _Home = None,
    port: Annotated[int, typer.Option(
        min=0, max=65535, help="HTTP port of the console (0: any free port).")] = 8470,
    host: Annotated[str, typer.Option(help="Address to bind.")] = "127.0.0.1",
    token: Annotated[str | None, typer.Option(
        help="A token that opens the console beside the catalog's scoped tokens (default: "
        "$TENSORDB_TOKEN, else a new random one, printed in the sign-in URL).",
        show_default=False)] = None,
    token_file: Annotated[Path | None, typer.Option(
        "--token-file", metavar="PATH", help="Read that token from this file.",
        show_default=False)] = None,
    sample_interval: Annotated[float, typer.Option(
        min=0.05, help="Seconds between samples of the KV counters for the charts.")] = 5.0,
    tls_cert: Annotated[Path | None, typer.Option(
        "--tls-cert", metavar="PATH", help="Serve HTTPS only, with this certificate chain "
        "(PEM).", show_default=False)] = None,
    tls_key: Annotated[Path | None, typer.Option(
        "--tls-key", metavar="PATH", help="The certificate's private key (PEM).",
        show_default=False)] = None,
) -> None:
    """Serve the web console of this host's store: collections and their history, the
    tensors of a version, tiers, KV namespaces over time, nodes and replication,
    policies, and a query box for read statements. Read-only.

    It opens with the catalog's tokens ('tensordb token create', any role: a scoped
    token sees the names its scope covers) or with the console's own token. With no
    token given it makes one and prints a sign-in URL that carries it. Prints one JSON
    line (node, console_port, url) once it answers, then serves until SIGTERM or Ctrl-C.
    """
    if (tls_cert is None) != (tls_key is None):
        raise InvalidInput("TLS needs both --tls-cert and --tls-key")
    tls = transport.ServerTLS.load(tls_cert, tls_key) \
        if tls_cert is not None and tls_key is not None else None
    if tls is None and not transport.is_loopback(host):
        _console(stderr=True).print(f"warning: the console on {escape(host)} speaks clear "
                                    f"text: its token and sessions cross the network "
                                    f"unencrypted (give --tls-cert and --tls-key)")
    secret = transport.resolve_token(token, token_file)
    made = secret is None
    if made:
        secret = "tdbc_" + secrets.token_urlsafe(32)
    assert secret is not None
    transport.check_token(secret)
    w = _where(ctx)
    db = connect(w.catalog, home=home or w.home, node=w.node, data_dir=w.data_dir)
    try:
        auth = transport.Authenticator(secret, TokenStore(db.catalog.engine))
        console = serve_console(db, port, host, auth=auth, sample_interval=sample_interval,
                                tls=tls.context() if tls else None)
        try:
            line = {"node": db.config.node, "console_port": console.port,
                    "url": console.url + (f"/login?token={secret}" if made else "/")}
            print(json.dumps(line), flush=True)
            _wait_for_signal()
        finally:
            console.close()
    finally:
        db.close()


def _wait_for_signal() -> None:
    """Block until SIGTERM or SIGINT."""
    done = threading.Event()
    previous = {s: signal.signal(s, lambda *_: done.set())
                for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        while not done.wait(0.5):
            pass
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
