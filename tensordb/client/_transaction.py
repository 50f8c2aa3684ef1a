"""Transactions: puts and deletes on one collection, published as one commit."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, cast

import numpy as np
import torch

import storage_engine as se
from tensordb.catalog import Commit
from tensordb.errors import InvalidInput

from ._inputs import DTYPES, check_name, dtype_name, numpy_to_torch, torch_dtype
from ._model_files import FILES_ROW, check_files, pack_files
from ._puts import FileRange, GroupSpec, RawPut, ShardPut

if TYPE_CHECKING:
    from ._write import Writer

__all__ = ["Hasher", "Transaction", "as_tensor"]


class Hasher(Protocol):
    """An incremental hasher: ``hexdigest`` is the store's checksum of the bytes fed to
    ``update`` (what a ``put_raw`` fill may return)."""

    def update(self, data: Any, /) -> None: ...

    def hexdigest(self) -> str: ...


def as_tensor(value: object, name: str) -> torch.Tensor:
    """Normalise a user's tensor once: CPU, strided, detached, a supported dtype."""
    if type(value) is torch.Tensor and value.is_cpu and value.layout == torch.strided \
            and not value.requires_grad and not value.is_quantized and not value.is_complex():
        # the common case, in a few attribute reads (a 100,000-tensor commit runs this
        # per tensor): a plain CPU tensor that no autograd graph holds
        dtype_name(value.dtype, tensor=name)
        return value
    if isinstance(value, np.generic):
        value = np.asarray(value)
    if isinstance(value, np.ndarray):
        t = numpy_to_torch(value, tensor=name)
    elif isinstance(value, torch.Tensor):
        t = value
        if t.layout != torch.strided:
            raise InvalidInput(f"tensor {name!r} has layout {t.layout}; store it dense",
                               tensor=name)
        if t.is_quantized:
            raise InvalidInput(f"tensor {name!r} is quantized ({t.dtype}); unsupported",
                               tensor=name)
        if t.is_meta:
            raise InvalidInput(f"tensor {name!r} is on the meta device and has no data",
                               tensor=name)
        t = t.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        if t.is_conj() or t.is_neg():  # a lazy conjugate's memory holds other values
            t = t.resolve_conj().resolve_neg()
    else:
        raise InvalidInput(
            f"tensor {name!r} must be a torch.Tensor or numpy.ndarray, not "
            f"{type(value).__name__}", tensor=name)
    dtype_name(t.dtype, tensor=name)
    return t


_SHAPE_TYPES = (tuple, list, torch.Size)
_INT_LIMIT = 2**63


def _dims(what: str, value: object, name: str, collection: str) -> tuple[int, ...]:
    """A shape-like argument as a tuple of non-negative ints, or InvalidInput."""
    if type(value) in _SHAPE_TYPES:  # the common case, in a few checks per dimension
        plain: tuple[int, ...] = tuple(cast(Iterable[int], value))
        if all(type(d) is int and 0 <= d < _INT_LIMIT for d in plain):
            return plain
    try:
        items = tuple(cast(Iterable[object], value))
        if not all(isinstance(d, (int, np.integer)) and not isinstance(d, bool)
                   for d in items):
            raise TypeError
        dims = tuple(int(cast(int, d)) for d in items)
    except TypeError:
        raise InvalidInput(f"{what} of {name!r} must be a sequence of integers, not {value!r}",
                           collection=collection, tensor=name) from None
    if any(d < 0 or d >= 2**63 for d in dims):
        raise InvalidInput(f"{what} of {name!r} must be integers in 0 .. 2**63-1: {list(dims)}",
                           collection=collection, tensor=name)
    return dims


def _check_text(what: str, value: str, collection: str) -> None:
    """Refuse text the catalog cannot keep as it was given: a NUL character (PostgreSQL
    text refuses it) or a lone surrogate (no UTF-8 for it)."""
    if "\x00" in value:
        raise InvalidInput(f"{what} contains a NUL character (at position {value.index(chr(0))})",
                           collection=collection)
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InvalidInput(f"{what} is not valid Unicode (lone surrogate at position {exc.start})",
                               collection=collection) from None


class Transaction:
    """Puts and deletes on one collection, published as one commit when the block ends.

    Tensors are read when the block ends, not when ``put`` is called. An exception in
    the block publishes nothing and leaves ``result`` None.
    """

    #: bytes a ``put_raw`` fill writes before it feeds them to its ``hasher()``: few
    #: enough that they are still in cache, many enough that each call is cheap
    hash_piece: ClassVar[int] = se.HASH_PIECE

    def __init__(self, writer: Writer, collection: str, *, message: str | None,
                 tier: str | None, metadata: Mapping[str, str] | None,
                 check_open: Callable[[], None], group: GroupSpec | None = None) -> None:
        self._writer = writer
        self._group = group
        self._check_open = check_open
        self.collection = check_name("collection", collection)
        if message is not None:
            if not isinstance(message, str):
                raise InvalidInput(f"message must be a str, not {type(message).__name__}",
                                   collection=collection)
            _check_text("the commit message", message, collection)
        self._tier = tier or writer.default_tier
        writer.tiers.tier(self._tier)
        if metadata is not None:
            if not isinstance(metadata, Mapping) or not all(
                    isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
                raise InvalidInput("metadata must map str to str", collection=collection)
            for k, v in metadata.items():
                _check_text(f"metadata key {k!r}", k, collection)
                _check_text(f"the metadata value of {k!r}", v, collection)
            json.dumps(dict(metadata))
        self._meta = dict(metadata) if metadata else None
        self.message = message
        self._puts: dict[str, torch.Tensor | RawPut] = {}
        self._deletes: set[str] = set()
        self._shards: dict[str, list[ShardPut]] = {}
        self._base: int | None = None
        self._done = False
        self.result: Commit | None = None

    def __enter__(self) -> Transaction:
        self._check_open()
        self._started = time.perf_counter()
        g = self._group
        self._base = (self._writer.head(self.collection) if g is None else
                      self._writer.join_group(self.collection, g))
        return self

    def _check(self) -> None:
        if self._done:
            raise InvalidInput(f"the transaction on {self.collection!r} has already ended",
                               collection=self.collection)
        if self._base is None:
            raise InvalidInput("use the transaction in a with block", collection=self.collection)

    def put(self, name: str, tensor: torch.Tensor | np.ndarray) -> None:
        self._check()
        t = self._tensor(name, tensor)
        self._puts[name] = t
        self._deletes.discard(name)
        self._shards.pop(name, None)

    def put_shard(self, name: str, tensor: torch.Tensor | np.ndarray, *,
                  global_shape: Iterable[int], offsets: Iterable[int]) -> None:
        """Put one shard of tensor ``name``: ``tensor`` is the box of the global tensor
        (of ``global_shape``) that starts at ``offsets``. The shards of a name, from this
        transaction or (in a group transaction) from every rank's, must tile the global
        shape exactly (no overlap, no gap) when the version is published; a reader sees
        one tensor. Stored as given: each shard's bytes stay one extent."""
        self._check()
        t = self._tensor(name, tensor)
        gshape = _dims("global_shape", global_shape, name, self.collection)
        offs = _dims("offsets", offsets, name, self.collection)
        if len(offs) != len(gshape) or t.dim() != len(gshape):
            raise InvalidInput(
                f"shard of {name!r}: offsets {list(offs)}, a {t.dim()}-d tensor and a "
                f"{len(gshape)}-d global_shape {list(gshape)} must have as many dimensions",
                collection=self.collection, tensor=name)
        for d, (o, n, g) in enumerate(zip(offs, t.shape, gshape, strict=True)):
            if o + n > g:
                raise InvalidInput(
                    f"shard of {name!r} at offsets {list(offs)} with shape {list(t.shape)} "
                    f"lies outside the global shape {list(gshape)} (dimension {d})",
                    collection=self.collection, tensor=name)
        mine = self._shards.setdefault(name, [])
        if mine and (mine[0].global_shape != gshape or mine[0].tensor.dtype != t.dtype):
            raise InvalidInput(
                f"shards of {name!r} disagree: {mine[0].tensor.dtype} "
                f"{list(mine[0].global_shape)} and {t.dtype} {list(gshape)}",
                collection=self.collection, tensor=name)
        mine.append(ShardPut(t, gshape, offs))
        self._puts.pop(name, None)
        self._deletes.discard(name)

    def _tensor(self, name: str, value: object) -> torch.Tensor:
        """``value`` normalised (``as_tensor``) under a checked name; InvalidInput names
        this transaction's collection."""
        check_name("tensor", name, collection=self.collection)
        try:
            return as_tensor(value, name)
        except InvalidInput as exc:
            exc.collection = self.collection
            raise

    def put_raw(self, name: str, dtype: torch.dtype | str, shape: Iterable[int],
                fill: Callable[[np.ndarray], str | None]) -> None:
        """Put a tensor whose bytes ``fill(dst)`` writes into ``dst`` (a uint8 array of
        exactly the tensor's size, in the store) when the block ends: copy-once loaders
        read files straight into the extent (``os.preadv`` releases the GIL). ``fill``
        may run on a pool thread, beside the fills of other tensors. If it returns a str,
        that is taken as the checksum of what it wrote (a ``hasher()`` fed ``hash_piece``
        bytes at a time, each piece right after it was written, while it is in cache:
        one pass over the bytes); else the store hashes them."""
        self._check()
        check_name("tensor", name, collection=self.collection)
        dt = torch_dtype(dtype) if isinstance(dtype, str) and dtype in DTYPES else dtype
        if not isinstance(dt, torch.dtype):
            raise InvalidInput(f"unsupported dtype {dtype!r} for tensor {name!r}",
                               collection=self.collection, tensor=name)
        dtype_name(dt, tensor=name)
        try:
            dims = tuple(int(d) for d in shape)
        except (TypeError, ValueError):
            raise InvalidInput(f"shape of {name!r} must be a sequence of integers, not "
                               f"{shape!r}", collection=self.collection, tensor=name) from None
        if any(d < 0 for d in dims):
            raise InvalidInput(f"shape of {name!r} has a negative dimension: {dims}",
                               collection=self.collection, tensor=name)
        if not callable(fill):
            raise InvalidInput(f"fill for {name!r} must be callable", collection=self.collection,
                               tensor=name)
        numel = 1
        for d in dims:
            numel *= d
        self._puts[name] = RawPut(dt, dims, numel * dt.itemsize, fill)
        self._deletes.discard(name)
        self._shards.pop(name, None)

    def put_file_range(self, name: str, dtype: torch.dtype, shape: tuple[int, ...],
                       file: FileRange) -> None:
        """Put a tensor whose bytes are ``file``'s range from its offset (a loader's
        tensor in a file it opened and checked: the safetensors import), read by the
        store at commit straight into the extent, hashed as they are copied. The caller
        keeps the descriptor open until the block ends; a file that ends inside the
        range by then is CorruptData naming the tensor."""
        def fill(dst: np.ndarray) -> str | None:  # never called: the store reads the file
            raise AssertionError("a file range is read by the store")

        self.put_raw(name, dtype, shape, fill)
        put = self._puts[name]
        assert isinstance(put, RawPut)
        self._puts[name] = RawPut(put.dtype, put.shape, put.nbytes, fill, file)

    @staticmethod
    def hasher() -> Hasher:
        """A new incremental hasher for a ``put_raw`` fill: its ``hexdigest`` is the
        checksum the store records for the bytes fed to it."""
        return se.Hasher()

    def put_many(self, tensors: Mapping[str, Any] | Iterable[tuple[str, Any]]) -> None:
        """Put every (name, tensor); all are checked before any is taken."""
        self._check()
        items = list(tensors.items()) if isinstance(tensors, Mapping) else list(tensors)
        staged: dict[str, torch.Tensor] = {}
        with se.gc_paused():
            for item in items:
                if not (isinstance(item, tuple) and len(item) == 2):
                    raise InvalidInput("put_many takes a mapping or (name, tensor) pairs",
                                       collection=self.collection)
                name, value = item
                check_name("tensor", name, collection=self.collection)
                try:
                    staged[name] = as_tensor(value, name)
                except InvalidInput as exc:
                    exc.collection = self.collection
                    raise
            self._puts.update(staged)
            if self._deletes:
                self._deletes.difference_update(staged)
            if self._shards:
                for name in staged:
                    self._shards.pop(name, None)

    def put_files(self, files: Mapping[str, bytes]) -> None:
        """Make ``files`` (file name -> bytes: a model folder's ``config.json``, its
        tokenizer, chat templates) the version's files, in place of those it had; an
        empty mapping: none. Kept beside the tensors (``Snapshot.files``), each with its
        checksum; a plain file name each, no weight file (those are tensors), at most
        ``MAX_FILES`` of ``MAX_FILE_BYTES`` each, else InvalidInput."""
        self._check()
        checked = check_files(files, f"the files of {self.collection!r}")
        if checked:
            self._puts[FILES_ROW] = torch.from_numpy(pack_files(checked))
            self._deletes.discard(FILES_ROW)
        else:
            self._puts.pop(FILES_ROW, None)
            self._deletes.add(FILES_ROW)

    def delete(self, name: str) -> None:
        self._check()
        check_name("tensor", name, collection=self.collection)
        self._puts.pop(name, None)
        self._shards.pop(name, None)
        self._deletes.add(name)

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 *rest: object) -> None:
        self._done = True
        g = self._group
        if exc_type is not None:
            if g is not None and self._base is not None:
                # the other ranks must not wait for a part that will never come
                self._writer.abort_group(self.collection, g,
                                         f"rank {g.rank} raised {exc_type.__name__}: {exc}")
            return None
        if g is not None:
            try:
                self._check_open()
            except BaseException:
                self._writer.abort_group(self.collection, g,
                                         f"rank {g.rank}'s store was closed before its part")
                raise
            assert self._base is not None
            self.result = self._writer.publish_part(
                self.collection, g, self._puts, self._shards, self._deletes, self.message,
                self._tier, self._meta)
        else:
            self._check_open()
            assert self._base is not None
            self.result = self._writer.publish(self.collection, self._base, self._puts,
                                               self._deletes, self.message, self._tier,
                                               self._meta, self._shards)
        self._puts = {}
        self._shards = {}
        self._writer.tiers.latency.observe("commit", time.perf_counter() - self._started)
        return None
