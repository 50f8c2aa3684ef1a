"""The errors of tensordb: one base, ``TensorDBError``, and a class per kind of failure.

Each error names what it is about (``collection``, ``tensor``, ``version``, ``node``)
both in its message and as attributes, so callers can react without parsing text.
"""

from __future__ import annotations

__all__ = [
    "TensorDBError",
    "NotFound",
    "InvalidInput",
    "CommitConflict",
    "GroupAborted",
    "StoreFull",
    "CorruptData",
    "QueryError",
    "Unauthorized",
    "NodeUnavailable",
    "IncompatibleStore",
    "StoreClosed",
]


class TensorDBError(Exception):
    """Base of every error tensordb raises on purpose."""

    def __init__(self, message: str, *, collection: str | None = None,
                 tensor: str | None = None, version: int | None = None,
                 node: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.collection = collection
        self.tensor = tensor
        self.version = version
        self.node = node

    def __str__(self) -> str:  # KeyError would otherwise print the repr of the message
        return self.message


class NotFound(TensorDBError, KeyError):
    """An unknown collection, tensor, version, tag, node or segment."""


class InvalidInput(TensorDBError, ValueError):
    """An argument tensordb cannot accept: bad name, non-tensor, unsupported dtype..."""


class CommitConflict(TensorDBError):
    """The collection's head moved under a transaction that touched the same names."""

    def __init__(self, message: str, *, collection: str, names: list[str],
                 base: int, head: int) -> None:
        super().__init__(message, collection=collection)
        self.names = names
        self.base = base
        self.head = head


class GroupAborted(CommitConflict):
    """A group transaction ended without publishing: a rank aborted or died, its deadline
    passed, its parts did not fit together, or its commit conflicted. ``group`` names it,
    ``reason`` says why."""

    def __init__(self, message: str, *, collection: str, group: str, reason: str,
                 base: int = 0, head: int = 0, names: list[str] | None = None) -> None:
        super().__init__(message, collection=collection, names=names or [], base=base,
                         head=head)
        self.group = group
        self.reason = reason


class StoreFull(TensorDBError):
    """A tier has no room for the bytes and nothing can be evicted."""


class CorruptData(TensorDBError):
    """Stored bytes do not match their checksum, or a file is malformed."""


class QueryError(TensorDBError):
    """A statement that cannot be parsed or run; carries the position in the text."""

    def __init__(self, message: str, *, line: int | None = None, column: int | None = None,
                 expected: list[str] | None = None, **kw: object) -> None:
        super().__init__(message, **kw)  # type: ignore[arg-type]
        self.line = line
        self.column = column
        self.expected = expected or []


class Unauthorized(TensorDBError):
    """A request without the node's token."""


class NodeUnavailable(TensorDBError):
    """No node that holds the bytes answers."""


class IncompatibleStore(TensorDBError):
    """The store's catalog schema is newer than this code (or not a tensordb catalog)."""


class StoreClosed(TensorDBError):
    """The Database (or Snapshot) was used after close()."""
