"""Validation of collection, tensor and tag names, once, at the API edge."""

from __future__ import annotations

import unicodedata

from .errors import InvalidInput

__all__ = ["check_name"]

_MAX = {"collection": 255, "tensor": 1024, "tag": 255}


def check_name(kind: str, name: object, *, collection: str | None = None) -> str:
    """Return ``name`` if it is a usable ``kind`` name, else raise InvalidInput naming it.

    Names are opaque keys (never paths on disk), but path-like names (``../x``, ``/x``,
    ``a//b``) are refused: they are almost always a bug, and they would become one the
    day a name is used to build a path (export, replication).
    """
    what = f"{kind} name {name!r}"
    if not isinstance(name, str):
        raise InvalidInput(f"a {kind} name must be a str, not {type(name).__name__}",
                           collection=collection)
    if not name or not name.strip():
        raise InvalidInput(f"a {kind} name must not be empty", collection=collection)
    if len(name) > _MAX[kind]:
        raise InvalidInput(f"{what[:80]}... is longer than {_MAX[kind]} characters",
                           collection=collection)
    if not (name.isascii() and name.isprintable()) and any(
            unicodedata.category(ch) in ("Cc", "Cf", "Zl", "Zp") for ch in name):
        raise InvalidInput(f"{what} contains a control character", collection=collection)
    if name != name.strip():
        raise InvalidInput(f"{what} starts or ends with white space", collection=collection)
    if "\\" in name or name.startswith("/") or name.endswith("/"):
        raise InvalidInput(f"{what} looks like a path", collection=collection)
    if any(part in ("", ".", "..") for part in name.split("/")):
        raise InvalidInput(f"{what} looks like a path (empty, '.' or '..' component)",
                           collection=collection)
    return name
