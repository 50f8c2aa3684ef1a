"""How KV blocks are named and laid out: chained block keys, and a block's record.

A key is 16 bytes of xxh3-128 chained over the previous key and the block's tokens, so
it names the whole prefix up to its block; ``KeyChain`` derives and checks them for one
namespace. A block is stored as its raw bytes plus a short record, ``b"<dtype>|<shape>"``,
from which ``decode_meta`` rebuilds the tensor's dtype and shape on read.

These run once per block on every put and get: each loop is kept to the few calls it
needs (see ``byte_view`` and the per-batch record cache of ``encode_blocks``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, cast

import numpy as np
import torch
import xxhash

from storage_engine import chain_keys, keys_fit
from tensordb.errors import CorruptData, InvalidInput, StoreFull

from ._inputs import dtype_name, torch_dtype

__all__ = ["MAX_KEY", "EncodedBlocks", "KeyChain", "block_meta", "byte_view", "decode_meta",
           "encode_blocks", "meta_fields"]

#: the longest key the block store's index takes
MAX_KEY = 255


class KeyChain:
    """The block keys of one namespace: seeded by its name and block size, so two
    namespaces (or block sizes) never share a key."""

    __slots__ = ("namespace", "block_tokens", "seed")

    def __init__(self, namespace: str, block_tokens: int) -> None:
        self.namespace = namespace
        self.block_tokens = block_tokens
        self.seed = xxhash.xxh3_128_digest(
            f"tensordb-kv\0{namespace}\0{block_tokens}".encode())

    def keys(self, token_ids: Any, parent: bytes | None = None) -> list[bytes]:
        """One key per *full* block of ``token_ids``, continuing from ``parent`` (a key
        returned earlier) when given."""
        tokens = self.tokens(token_ids)
        prev = self.seed if parent is None else self.check([parent])[0]
        return chain_keys(prev, tokens, self.block_tokens)

    def tokens(self, token_ids: Any) -> np.ndarray:
        """``token_ids`` (a tensor, array or sequence of ints) as contiguous
        little-endian int64, the bytes a key hashes; InvalidInput for anything else."""
        if isinstance(token_ids, torch.Tensor):
            if token_ids.is_floating_point() or token_ids.is_complex() \
                    or token_ids.dtype == torch.bool:
                raise InvalidInput(f"token ids must be integers, not {token_ids.dtype}",
                                   collection=self.namespace)
            token_ids = token_ids.detach().cpu().to(torch.int64).numpy()
        try:
            arr = np.asarray(token_ids)
            if arr.dtype.kind not in "iu" and arr.size:
                raise TypeError(f"dtype {arr.dtype}")
            arr = arr.astype("<i8", copy=False)
        except (TypeError, ValueError, OverflowError) as exc:
            raise InvalidInput(f"token ids must be a 1-D sequence of ints: {exc}",
                               collection=self.namespace) from exc
        if arr.ndim != 1:
            raise InvalidInput(f"token ids must be 1-D, not of shape {arr.shape}",
                               collection=self.namespace)
        return np.ascontiguousarray(arr)

    def check(self, keys: Sequence[bytes]) -> list[bytes]:
        """``keys`` as a list of bytes, each 1 to ``MAX_KEY`` long; InvalidInput for one
        key passed alone or a key of another type or length."""
        if keys_fit(keys):  # a list of keys the index takes as they are: one native pass
            return cast("list[bytes]", keys)
        if isinstance(keys, (bytes, bytearray, str)):
            raise InvalidInput("keys must be a sequence of keys, not one key",
                               collection=self.namespace)
        if not isinstance(keys, Iterable) or isinstance(keys, dict):
            raise InvalidInput(f"keys must be a sequence of keys (bytes), not "
                               f"{type(keys).__name__}", collection=self.namespace)
        out = []
        for k in keys:
            if type(k) is bytes and 0 < len(k) <= MAX_KEY:  # the usual case: no copy
                out.append(k)
            elif isinstance(k, (bytes, bytearray)) and 0 < len(k) <= MAX_KEY:
                out.append(bytes(k))
            else:
                raise InvalidInput(f"a KV key must be 1 to {MAX_KEY} bytes, not {k!r:.60}",
                                   collection=self.namespace)
        return out


def decode_meta(meta: bytes) -> tuple[torch.dtype, tuple[int, ...]]:
    """The dtype and shape a block's record names (the part before the block's engine
    info, if any: ``_kv_events``)."""
    return _decode_record(meta.partition(b"\0")[0])


@lru_cache(maxsize=1024)
def _decode_record(record: bytes) -> tuple[torch.dtype, tuple[int, ...]]:
    """Cached: a namespace's blocks share a handful of records."""
    name, shape = meta_fields(record)
    try:
        return torch_dtype(name), shape
    except KeyError:
        raise CorruptData(f"a KV block's record {record[:64]!r} names no dtype") from None


def meta_fields(meta: bytes) -> tuple[str, tuple[int, ...]]:
    """The dtype name and shape a block's record names (CorruptData: a record that names
    none, damaged in the store's files)."""
    try:
        name, _, shape = meta.partition(b"\0")[0].decode().partition("|")
        return name, tuple(int(d) for d in shape.split(",") if d)
    except ValueError as exc:  # UnicodeDecodeError is one
        raise CorruptData(f"a KV block's record {meta[:64]!r} is damaged: {exc}") from exc


def byte_view(t: torch.Tensor) -> np.ndarray:
    """The bytes of a contiguous CPU tensor as a flat uint8 array (no copy). One torch
    view, not two: torch's view calls cost microseconds each, per block."""
    if t.dim() == 0 or t.stride(-1) != 1:  # a size-1 last dim may have any stride
        t = t.reshape(-1)
    return t.view(torch.uint8).numpy().reshape(-1)


@dataclass(frozen=True, slots=True)
class EncodedBlocks:
    """A batch of blocks ready for ``BlockStore.put_batch``: where each block's host bytes
    are (``addrs``, ``sizes``: uint64 arrays; ``keep`` holds the copies made here, CPU or
    contiguous ones, alive: the caller's own blocks live through its call), the record of each (one ``bytes`` for all when they share dtype and shape),
    and the CUDA blocks by position (contiguous), for a copy into the GPU tier."""

    keep: list[torch.Tensor]
    addrs: np.ndarray
    sizes: np.ndarray
    metas: bytes | list[bytes]
    on_gpu: list[tuple[int, torch.Tensor]]


def encode_blocks(blocks: Sequence[torch.Tensor], namespace: str,
                  limit: int | None = None, node: str | None = None) -> EncodedBlocks:
    """The host bytes and records of ``blocks`` (GPU tensors copied down, strided ones
    made contiguous); InvalidInput, naming the block, for a non-tensor, an empty block
    or a dtype the store cannot name; StoreFull for a block of more than ``limit``
    bytes (the arena's capacity), before any copy (an expanded tensor of 10**9 elements
    would otherwise be made contiguous, 4 GB, to be refused after)."""
    keep: list[torch.Tensor] = []
    metas: list[bytes] = []
    ptrs: list[int] = []
    nbytes: list[int] = []
    on_gpu: list[tuple[int, torch.Tensor]] = []
    # a batch's blocks share dtype and shape: their record is built once (the checks
    # and the string were a quarter of a 64 KiB block's put). Per block, only the
    # cheapest of torch's attributes (a list of 1,024 blocks of 8 KiB: ``device.type``
    # and ``numel() * element_size()`` took 0.35 of its 1.1 us a block, against 5.4 us
    # to populate the block's pages)
    seen: dict[tuple[torch.dtype, torch.Size], bytes] = {}
    strided = torch.strided
    for i, b in enumerate(blocks):
        if not isinstance(b, torch.Tensor) or b.layout != strided or b.is_meta:
            raise InvalidInput(f"block {i} must be a dense torch.Tensor, not "
                               f"{type(b).__name__}", collection=namespace)
        t = b.detach() if b.requires_grad else b
        size = t.nbytes
        if limit is not None and size > limit:
            raise StoreFull(f"KV namespace {namespace!r}: block {i} holds {size} bytes, "
                            f"more than the arena's {limit}", collection=namespace,
                            node=node)
        if not t.is_cpu:
            if t.is_cuda:
                on_gpu.append((i, t.contiguous()))
            t = t.cpu()
        if not t.is_contiguous():
            t = t.contiguous()
        key = (t.dtype, t.shape)
        meta = seen.get(key)
        if meta is None:
            meta = seen[key] = block_meta(t, namespace, f"block {i}")
        if t is not b:  # a copy made here (the caller's own blocks live through the call)
            keep.append(t)
        metas.append(meta)
        ptrs.append(t.data_ptr())
        nbytes.append(size)
    n = len(ptrs)
    addrs = np.array(ptrs, np.uint64) if n else np.zeros(0, np.uint64)
    sizes = np.array(nbytes, np.uint64) if n else np.zeros(0, np.uint64)
    one = len(seen) == 1 and n > 0
    return EncodedBlocks(keep, addrs, sizes, metas[0] if one else metas, on_gpu)


def block_meta(t: torch.Tensor, namespace: str, what: str = "a block") -> bytes:
    """The record of blocks of ``t``'s dtype and shape (InvalidInput, naming ``what``,
    for an empty block or a dtype the store cannot name)."""
    if t.numel() == 0:
        raise InvalidInput(f"{what} is empty", collection=namespace)
    name = dtype_name(t.dtype, tensor=what)
    return f"{name}|{','.join(map(str, t.shape))}".encode()
