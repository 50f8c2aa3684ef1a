"""Node server and client on Arrow Flight: cluster mode.

One ``NodeServer`` per host (in its ``tensordb serve`` process) owns that host's store
and serves its segments and KV blocks to other nodes: segment bytes over the TCP data
plane of ``_dataplane``, set up through Flight. ``pull_segment`` brings a segment held
elsewhere into a local tier (streamed, checksummed, then registered as a replica), in
whichever process needs it; ``cascade`` fans a version out to many nodes in O(log N)
rounds. Every request carries a token when the node has one (the cluster's, or a scoped
token of the catalog: ``_auth``), over TLS when the node serves it (``_tls``), and every error of
``tensordb.errors`` a node raises reaches the caller as itself.

This package never sees a ``Database``: the node side uses a ``NodeStore`` (the few
members it needs, which ``tensordb.Database`` has), the client side a ``Transport``
(``FlightTransport`` between hosts, ``LocalTransport`` in one process).
A node also serves whole versions to any Flight client, in the ``tensordb.arrow``
layout (``VersionReads``; docs/arrow.md). ``transport.testing`` is the contract suite
of ``Transport``. The client facade imports
this package only when a read or a replication needs another node.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tensordb.lazy import lazy_face

if TYPE_CHECKING:
    from ._auth import (
        GRANT_TTL,
        MIN_TOKEN_LENGTH,
        TOKEN_ENV,
        TOKEN_FILE_ENV,
        Authenticator,
        check_token,
        is_loopback,
        require_token_for,
        resolve_token,
    )
    from ._base import (
        DEFAULT_TIMEOUT,
        ERROR_KINDS,
        KVBlock,
        KVBlocks,
        NodeStore,
        Transport,
        error_from_payload,
        error_payload,
    )
    from ._flight_client import FlightTransport
    from ._flight_server import THROTTLE_ENV, NodeServer, NodeService
    from ._local import LocalTransport
    from ._metrics import NodeMetrics
    from ._node import (
        DEFAULT_HEARTBEAT,
        NodeRegistration,
        RunningNode,
        ready_line,
        start_node,
    )
    from ._pull import (
        DEFAULT_STREAMS,
        CascadeReport,
        ExtentHasher,
        cascade,
        pull_segment,
        split_ranges,
    )
    from ._tls import ServerTLS, read_ca
    from ._version_reads import MAX_BATCH_BYTES, VersionReads, version_ticket
    from ._version_writes import MAX_PUT_BYTES

#: each name of the face and the module that defines it, loaded on first use
_LAZY = {
    "GRANT_TTL": "._auth",
    "MIN_TOKEN_LENGTH": "._auth",
    "Authenticator": "._auth",
    "TOKEN_ENV": "._auth",
    "TOKEN_FILE_ENV": "._auth",
    "check_token": "._auth",
    "is_loopback": "._auth",
    "require_token_for": "._auth",
    "resolve_token": "._auth",
    "DEFAULT_TIMEOUT": "._base",
    "ERROR_KINDS": "._base",
    "KVBlock": "._base",
    "KVBlocks": "._base",
    "NodeStore": "._base",
    "Transport": "._base",
    "error_from_payload": "._base",
    "error_payload": "._base",
    "FlightTransport": "._flight_client",
    "THROTTLE_ENV": "._flight_server",
    "NodeServer": "._flight_server",
    "NodeService": "._flight_server",
    "LocalTransport": "._local",
    "NodeMetrics": "._metrics",
    "DEFAULT_HEARTBEAT": "._node",
    "NodeRegistration": "._node",
    "RunningNode": "._node",
    "ready_line": "._node",
    "start_node": "._node",
    "DEFAULT_STREAMS": "._pull",
    "CascadeReport": "._pull",
    "ExtentHasher": "._pull",
    "cascade": "._pull",
    "pull_segment": "._pull",
    "split_ranges": "._pull",
    "ServerTLS": "._tls",
    "read_ca": "._tls",
    "MAX_BATCH_BYTES": "._version_reads",
    "MAX_PUT_BYTES": "._version_writes",
    "VersionReads": "._version_reads",
    "version_ticket": "._version_reads",
}

__all__ = [
    "GRANT_TTL",
    "Authenticator",
    "ServerTLS",
    "read_ca",
    "DEFAULT_HEARTBEAT",
    "DEFAULT_STREAMS",
    "DEFAULT_TIMEOUT",
    "ERROR_KINDS",
    "THROTTLE_ENV",
    "TOKEN_ENV",
    "TOKEN_FILE_ENV",
    "CascadeReport",
    "ExtentHasher",
    "FlightTransport",
    "KVBlock",
    "KVBlocks",
    "LocalTransport",
    "MAX_BATCH_BYTES",
    "MAX_PUT_BYTES",
    "MIN_TOKEN_LENGTH",
    "NodeMetrics",
    "NodeRegistration",
    "NodeServer",
    "NodeService",
    "NodeStore",
    "RunningNode",
    "Transport",
    "VersionReads",
    "cascade",
    "check_token",
    "error_from_payload",
    "error_payload",
    "is_loopback",
    "pull_segment",
    "ready_line",
    "require_token_for",
    "resolve_token",
    "split_ranges",
    "start_node",
    "version_ticket",
]


__getattr__, __dir__ = lazy_face(__name__, _LAZY, __all__)
