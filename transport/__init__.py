"""Node server and client on Arrow Flight: cluster mode.

One ``NodeServer`` per host (in its ``tensordb serve`` process) owns that host's store
and serves its segments and KV blocks to other nodes: segment bytes over the TCP data
plane of ``_dataplane``, set up through Flight. ``pull_segment`` brings a segment held
elsewhere into a local tier (streamed, checksummed, then registered as a replica), in
whichever process needs it; ``cascade`` fans a version out to many nodes in O(log N)
rounds. Every request carries the node's token when it has one, and every error of
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

from ._auth import (
    MIN_TOKEN_LENGTH,
    TOKEN_ENV,
    TOKEN_FILE_ENV,
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
from ._version_reads import MAX_BATCH_BYTES, VersionReads, version_ticket

__all__ = [
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
