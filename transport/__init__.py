"""Node server and client on Arrow Flight: cluster mode.

One ``NodeServer`` per host owns that host's store and serves its segments and KV
blocks to other nodes (segment bytes over the TCP data plane of ``_dataplane``, set up
through Flight); ``pull_segment`` brings a segment held elsewhere into a local
tier (streamed, checksummed, then registered as a replica); ``cascade`` fans a version
out to many nodes in O(log N) rounds. Every request carries the node's token when it
has one. The client facade (``tensordb.Database``) imports this package only when a
read or a replication needs another node.
"""

from __future__ import annotations

from ._auth import TOKEN_ENV, is_loopback, require_token_for, resolve_token
from ._cascade import CascadeReport, cascade
from ._flight_client import DEFAULT_TIMEOUT, FlightTransport, KVBlock, Transport
from ._metrics import NodeMetrics
from ._pull import DEFAULT_STREAMS, ExtentHasher, pull_segment, split_ranges
from ._registry import DEFAULT_HEARTBEAT, NodeRegistration
from ._node import RunningNode, ready_line, start_node
from ._flight_server import THROTTLE_ENV, NodeServer

__all__ = [
    "DEFAULT_HEARTBEAT",
    "DEFAULT_STREAMS",
    "DEFAULT_TIMEOUT",
    "THROTTLE_ENV",
    "TOKEN_ENV",
    "CascadeReport",
    "ExtentHasher",
    "FlightTransport",
    "KVBlock",
    "NodeMetrics",
    "NodeRegistration",
    "NodeServer",
    "RunningNode",
    "Transport",
    "cascade",
    "is_loopback",
    "pull_segment",
    "ready_line",
    "split_ranges",
    "require_token_for",
    "resolve_token",
    "start_node",
]
