"""Block keys as the KV store's native index holds them, and the chain that names a
token prefix block by block.

A key is 1 to ``MAX_KEY`` bytes; the index holds keys of up to ``INDEX_KEY`` bytes as
they are and a longer one by its BLAKE2b-256 (``index_key``). A batch goes to the index
as it is where every key fits (``keys_fit``, one native pass; ``call_native``), else
through ``check_keys``, which hashes the long ones and names a bad one.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import xxhash

from . import _checksum  # binds the xxhash functions the extension's chain uses
from ._stream import chain_keys as _chain_keys
from ._stream import keys_fit

__all__ = ["INDEX_KEY", "MAX_KEY", "call_native", "chain_keys", "check_keys", "index_key",
           "keys_fit"]

MAX_KEY = 255
#: keys up to this many bytes are held as they are; longer ones by their BLAKE2b-256
INDEX_KEY = 32


def index_key(key: bytes) -> bytes:
    """The key the index holds: the key itself up to INDEX_KEY bytes, else its
    BLAKE2b-256 (a key of 64 hex digits costs no more than its 32 bytes would)."""
    return key if len(key) <= INDEX_KEY else \
        hashlib.blake2b(key, digest_size=INDEX_KEY).digest()


def check_keys(keys: Sequence[bytes]) -> list[bytes]:
    """The keys as the index holds them (``index_key``); ValueError for one that is not
    1 to MAX_KEY bytes."""
    out = []
    for k in keys:
        if type(k) is not bytes:
            if not isinstance(k, (bytes, bytearray)):
                raise ValueError(f"a block key must be 1 to {MAX_KEY} bytes, not {k!r:.60}")
            k = bytes(k)
        n = len(k)
        if not 0 < n <= MAX_KEY:
            raise ValueError(f"a block key must be 1 to {MAX_KEY} bytes, not {k!r:.60}")
        out.append(k if n <= INDEX_KEY else index_key(k))
    return out


def chain_keys(prev: bytes, tokens: np.ndarray, block_tokens: int) -> list[bytes]:
    """For each full block of ``tokens`` (contiguous little-endian int64), the xxh3-128
    digest of the previous key (``prev`` for the first) followed by the block's tokens:
    keys that name the whole prefix up to their block. One native call for the chain
    where the extension has the xxhash functions bound (a Python hash per block was a
    quarter of a small block's put), else the same hashes in Python."""
    if len(prev) == 16 and _checksum.ONE_PASS:
        keys: list[bytes] = _chain_keys(prev, tokens, block_tokens)
        return keys
    out = []
    for lo in range(0, len(tokens) - block_tokens + 1, block_tokens):
        h = xxhash.xxh3_128(prev)
        h.update(tokens[lo:lo + block_tokens].data)
        prev = h.digest()
        out.append(prev)
    return out


def call_native(fn: Any, keys: Sequence[bytes], *args: Any) -> Any:
    """``fn(keys, *args)`` of the native index, which takes keys of 1 to 32 bytes as they
    are; keys of other types or lengths are normalised (``check_keys``: ValueError for
    a bad one) and the call made again. No Python loop over the keys when they fit."""
    try:
        return fn(keys, *args)
    except ValueError as exc:
        if "key" not in str(exc):
            raise
        return fn(check_keys(keys), *args)
