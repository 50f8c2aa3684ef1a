"""What every transport shares: the ``Transport`` ABC, the ``NodeStore`` a node serves,
and the wire form of an error.

Which process runs what: a ``Transport`` runs in the process that needs bytes held by
another node (a client's ``Database`` reading a remote segment, or a node server told
to pull); its node-side half runs in the process that serves the node's store (one
``tensordb serve`` per host, or the test process for ``LocalTransport``). The node side
sees the store only through ``NodeStore``, the few members it uses; ``tensordb.Database``
has them all.

Errors cross as themselves. A node turns a ``tensordb.errors`` exception into a JSON
object (``error_payload``): its class and the classes of ``tensordb.errors`` above it,
its message and its plain attributes (collection, tensor, version, node, names, line,
...), never a traceback. The receiving side rebuilds it as the most specific of those
classes it knows (``error_from_payload``), so a newer node's new class arrives as its
nearest known base, and a kind nobody knows as ``TensorDBError``.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

import storage_engine as se
import tensordb.errors as errors
from tensordb.catalog import Catalog
from tensordb.config import Config
from tensordb.errors import CorruptData, TensorDBError

if TYPE_CHECKING:
    import torch
    from prometheus_client.registry import Collector

__all__ = ["DEFAULT_TIMEOUT", "ERROR_KINDS", "KVBlock", "KVBlocks", "NodeStore", "Transport",
           "error_from_payload", "error_from_text", "error_payload", "error_text"]

#: seconds a dead address or a stalled stream may take to fail (connect, ping, gap
#: between two chunks of a stream)
DEFAULT_TIMEOUT = 5.0

#: one KV block as it travels: key, dtype name, shape, bytes (uint8), checksum
KVBlock = tuple[bytes, str, tuple[int, ...], np.ndarray, str]


# -- the store a node serves -------------------------------------------------------------
class KVBlocks(Protocol):
    """The KV blocks of one namespace on the serving node (``Database.kv`` gives one)."""

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        """For each key, whether the block is held."""

    def get(self, keys: Sequence[bytes]) -> list[torch.Tensor]:
        """The blocks of ``keys`` (all held), with the dtype and shape they were put with."""

    def close(self) -> None:
        """Let go of the namespace (its blocks stay). Idempotent."""


@runtime_checkable
class NodeStore(Protocol):
    """What the node side of a transport uses of a store: ``tensordb.Database`` has it.

    Runs in the serving process; called from the server's threads, any number at once."""

    @property
    def config(self) -> Config:
        """The store's settings: ``node`` (its name), ``node_timeout``, ``host_capacity``."""

    @property
    def catalog(self) -> Catalog:
        """The catalog (``catalog.engine`` reaches the node directory)."""

    def tier(self, name: str) -> se.Tier:
        """This node's tier ``name`` ('host', 'disk', 'gpu'); InvalidInput if it has none."""

    def kv(self, namespace: str, block_tokens: int = ..., *, create: bool = ...
           ) -> KVBlocks:
        """The KV blocks of ``namespace`` on this node; the caller closes the handle.
        ``create=False`` (what a node asks): NotFound, and nothing made (no catalog
        row, directory or descriptor), when this node never opened the namespace."""

    def stats(self) -> dict[str, int]:
        """Counts of the store (``leases`` among them), for the metrics endpoint."""

    def transaction(self, collection: str, *, message: str | None = ...) -> Any:
        """A transaction on one collection (``tensordb.Transaction``: ``put_raw``,
        ``hasher``, ``result``); a Flight client's put commits through it."""

    def metrics_collector(self) -> Collector:
        """The host's metrics (KV namespaces, tiers, client latencies, catalog, scrub),
        read at scrape time: the node's metrics endpoint serves them beside its own."""


# -- the client side ---------------------------------------------------------------------
class Transport(ABC):
    """Moves bytes between nodes; runs in the process that needs them.

    Implementations are thread-safe; every method may block on the network and fails
    within the transport's timeout when the other end is dead or silent
    (``NodeUnavailable``). A refused token raises ``Unauthorized``; an error the node
    raised arrives as itself (see the module docstring). ``transport.testing`` holds the
    contract suite every implementation passes."""

    @abstractmethod
    def ping(self, node: str, address: str) -> dict[str, Any]:
        """The node's identity ({'node': name, 'tiers': [...]}); NodeUnavailable if it
        does not answer within the timeout."""

    @abstractmethod
    def read_segment(self, node: str, address: str, segment_id: str, offset: int, length: int,
                     sink: Callable[[memoryview], None]) -> None:
        """Stream bytes ``[offset, offset + length)`` of a segment the node holds to
        ``sink``, chunk by chunk in order. On a failure mid-stream the chunks already
        given to the sink stay given."""

    def read_segment_into(self, node: str, address: str, segment_id: str, offset: int,
                          dst: np.ndarray, on_bytes: Callable[[int], None]) -> None:
        """Receive bytes ``[offset, offset + len(dst))`` of a segment into ``dst`` (uint8,
        contiguous); ``on_bytes(n)`` says the next ``n`` bytes of ``dst`` are in, in order
        (also for what arrived before a failure). This default streams through
        ``read_segment`` and copies; a transport with a faster path overrides it."""
        pos = 0

        def sink(view: memoryview) -> None:
            nonlocal pos
            n = len(view)
            if pos + n > len(dst):
                raise CorruptData(f"node {node!r} sent more of segment {segment_id} than "
                                  f"asked", node=node)
            np.copyto(dst[pos : pos + n], np.frombuffer(view, np.uint8))
            pos += n
            on_bytes(n)

        self.read_segment(node, address, segment_id, offset, len(dst), sink)

    @abstractmethod
    def request_pull(self, node: str, address: str, segment_ids: Sequence[str],
                     source: str | None, streams: int | None = None) -> dict[str, Any]:
        """Tell a node to pull segments (from ``source`` first, then any holder; in
        ``streams`` parallel ranges, default the node's) and register its replicas;
        returns its report. Blocks until it is done."""

    @abstractmethod
    def read_kv(self, node: str, address: str, namespace: str, block_tokens: int,
                keys: Sequence[bytes]) -> list[KVBlock]:
        """The blocks of ``keys`` the node holds in ``namespace`` (absent ones skipped)."""

    def close(self) -> None:  # noqa: B027 - a no-op default: not every transport holds connections
        """Drop connections. Idempotent."""


# -- errors on the wire ------------------------------------------------------------------
def _error_classes() -> dict[str, type[TensorDBError]]:
    return {name: cls for name, cls in vars(errors).items()
            if isinstance(cls, type) and issubclass(cls, TensorDBError)
            and cls.__module__ == errors.__name__}


#: every class of ``tensordb.errors`` by name: what a kind on the wire can stand for
#: (read from the module, so a class added there crosses the wire with no change here)
ERROR_KINDS: Mapping[str, type[TensorDBError]] = MappingProxyType(_error_classes())

_SCALARS = (str, int, float, bool, type(None))
_MARK = "tensordb.error:"  # where an error's JSON starts in a Flight error's text


def _plain(v: object) -> bool:
    return isinstance(v, _SCALARS) or (
        isinstance(v, (list, tuple)) and all(isinstance(x, _SCALARS) for x in v))


#: where a database driver's error text quotes the statement, its parameters or a link:
#: a message crossing the wire ends before the first of them
_SQL_TAILS = re.compile(r"\s*(\[SQL: |\[parameters: |\(Background on this error at: )")
#: the longest message that crosses the wire (a longer one is cut, saying so)
MAX_MESSAGE = 2000


def terse(message: str) -> str:
    """``message`` as it may leave the node: without the SQL text, parameters and
    links a database error quotes, and at most MAX_MESSAGE characters."""
    m = _SQL_TAILS.search(message)
    if m is not None:
        message = message[: m.start()] + " (details in the node's log)"
    if len(message) > MAX_MESSAGE:
        message = message[:MAX_MESSAGE] + "... (cut)"
    return message


def error_payload(exc: TensorDBError) -> dict[str, Any]:
    """The JSON object an error crosses the wire as: ``kinds`` (its class, then the
    classes above it up to TensorDBError), ``message`` (``terse``: never SQL text) and
    ``attrs`` (its public attributes whose values are plain JSON: text, numbers, lists
    of them)."""
    kinds = [c.__name__ for c in type(exc).__mro__
             if isinstance(c, type) and issubclass(c, TensorDBError)]
    attrs = {k: list(v) if isinstance(v, tuple) else v for k, v in vars(exc).items()
             if k != "message" and not k.startswith("_") and _plain(v)}
    return {"kinds": kinds, "message": terse(str(exc.message)), "attrs": attrs}


def error_from_payload(payload: object, node: str) -> TensorDBError | None:
    """The error ``payload`` stands for, raised by ``node``: the most specific class of
    its kinds that ``tensordb.errors`` has (TensorDBError when none), its message after
    the node's name, its attributes set as they were (``node`` defaults to the node that
    answered). None when ``payload`` is no error payload.

    The class's own ``__init__`` is not run: its attributes come from the wire, so a
    class that takes other arguments is rebuilt as faithfully as one that takes none."""
    if not isinstance(payload, dict):
        return None
    kinds, message, attrs = payload.get("kinds"), payload.get("message"), payload.get("attrs")
    if not isinstance(kinds, list) or not isinstance(message, str) \
            or not isinstance(attrs, dict):
        return None
    cls = next((ERROR_KINDS[k] for k in kinds if isinstance(k, str) and k in ERROR_KINDS),
               TensorDBError)
    exc = cls.__new__(cls)
    TensorDBError.__init__(exc, f"node {node!r}: {message}")
    for key, value in attrs.items():
        if isinstance(key, str) and key.isidentifier() and not key.startswith("_") \
                and key != "message" and _plain(value) and not callable(getattr(cls, key, None)):
            setattr(exc, key, value)
    if exc.node is None:
        exc.node = node
    return exc


def error_text(exc: TensorDBError) -> str:
    """An error as the text of a Flight error: a mark, then its payload as JSON."""
    return _MARK + json.dumps(error_payload(exc))


def error_from_text(text: str, node: str) -> TensorDBError | None:
    """The error in a Flight error's text (``error_text``, perhaps with gRPC's details
    after it); None when the text holds none."""
    at = text.find(_MARK)
    if at < 0:
        return None
    try:
        payload, _ = json.JSONDecoder().raw_decode(text, at + len(_MARK))
    except ValueError:
        return None
    return error_from_payload(payload, node)
