"""``LocalTransport``: the in-process transport, for tests and single-process set-ups.

Like httpx's ``MockTransport``, it is public API: it calls each node's ``NodeService``
(the handlers a ``NodeServer`` puts on Flight) directly, with no socket, in the calling
process and thread. Everything else behaves as over the wire: the caller's token is
checked, a node that is not served answers ``NodeUnavailable``, and an error the node
raises is turned into its JSON payload and rebuilt on the way back, exactly as Flight
carries it, so a test of error handling against it holds against a real cluster.

Nodes are reached by name (the address is only quoted in errors). Transports built on
one ``nodes`` mapping see the same nodes: one per caller token, say, or the one each
served node pulls through.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

from tensordb.errors import NodeUnavailable, TensorDBError

from ._auth import unauthorized
from ._base import KVBlock, NodeStore, Transport, error_from_payload, error_payload
from ._flight_client import kv_blocks
from ._flight_server import CHUNK_BYTES, NodeService
from ._metrics import NodeMetrics

__all__ = ["LocalTransport"]

_T = TypeVar("_T")


class LocalTransport(Transport):
    """Calls the ``NodeService`` of each node in ``nodes`` in process, with ``token``.

    ``add(store)`` serves a store as its node (``store.config.node``), ``remove(node)``
    takes it away again. Thread-safe as the services are; ``close`` closes the
    services this transport added."""

    def __init__(self, nodes: dict[str, NodeService] | None = None, *,
                 token: str | None = None) -> None:
        self.nodes: dict[str, NodeService] = nodes if nodes is not None else {}
        self.token = token
        self._added: list[str] = []

    def add(self, store: NodeStore, *, token: str | None = None,
            metrics: NodeMetrics | None = None, chunk_bytes: int = CHUNK_BYTES
            ) -> NodeService:
        """Serve ``store`` as its node, requiring ``token`` of its callers; the node
        pulls from others through a transport on the same nodes, with that token."""
        service = NodeService(store, LocalTransport(self.nodes, token=token), token=token,
                              metrics=metrics, chunk_bytes=chunk_bytes)
        self.nodes[service.node] = service
        self._added.append(service.node)
        return service

    def remove(self, node: str) -> None:
        """Stop serving ``node``: later requests to it answer NodeUnavailable."""
        service = self.nodes.pop(node, None)
        if service is not None:
            service.close()

    def _call(self, node: str, address: str, kind: str,
              work: Callable[[NodeService], _T]) -> _T:
        """One request, as a server would answer it: token, handler, error payload."""
        service = self.nodes.get(node)
        if service is None:
            raise NodeUnavailable(f"node {node!r} at {address} does not answer (not served "
                                  f"in this process)", node=node)
        if not service.authorized(self.token):
            raise unauthorized(node, address)
        try:
            return service.answer(kind, lambda: work(service))
        except TensorDBError as exc:
            typed = error_from_payload(error_payload(exc), node)
            assert typed is not None  # a payload of our own making
            raise typed from None

    def ping(self, node: str, address: str) -> dict[str, Any]:
        return self._call(node, address, "ping", lambda s: s.ping())

    def read_segment(self, node: str, address: str, segment_id: str, offset: int, length: int,
                     sink: Callable[[memoryview], None]) -> None:
        req = {"kind": "segment", "id": segment_id, "offset": offset, "length": length}
        chunks: Iterator[memoryview] = self._call(node, address, "segment",
                                                  lambda s: s.segment_stream(req))
        for chunk in chunks:
            sink(chunk)

    def request_pull(self, node: str, address: str, segment_ids: Sequence[str],
                     source: str | None, streams: int | None = None) -> dict[str, Any]:
        body = {"segments": list(segment_ids), "source": source, "streams": streams}
        return self._call(node, address, "pull", lambda s: s.pull(body))

    def read_kv(self, node: str, address: str, namespace: str, block_tokens: int,
                keys: Sequence[bytes]) -> list[KVBlock]:
        req = {"kind": "kv", "namespace": namespace, "block_tokens": block_tokens,
               "keys": [k.hex() for k in keys]}
        return kv_blocks(self._call(node, address, "kv", lambda s: s.kv_table(req)), node)

    def close(self) -> None:
        """Close the services this transport added (they stop answering). Idempotent."""
        added, self._added = self._added, []
        for node in added:
            self.remove(node)
