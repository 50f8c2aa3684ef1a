"""What the vLLM and SGLang bindings share: where a store is, one open store per process,
and a version's tensors walked as the ``(name, tensor)`` pairs engines load.

Engines load checkpoint-format weights through ``model.load_weights(iterable of (name,
tensor))``: each parameter's weight loader picks this rank's slice of a full tensor
(tensor parallelism) or fuses several tensors into one parameter (q/k/v). The pairs
given here are the store's zero-copy views, so a weight loader that narrows a tensor to
its rank's slice only ever touches the pages of that slice, and a tensor a rank skips
(another pipeline stage's layer) is never read at all.

Engine processes (vLLM workers, SGLang schedulers) are started by the engine, not by
the user: they are told *where* the store is (a ``StoreLocation``, a plain mapping that
pickles and travels as JSON) and open it themselves, once per process.

Uses the public ``tensordb`` API only.
"""

from __future__ import annotations

import json
import os
import threading
import time
import weakref
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

import torch

import tensordb
from tensordb.client import CHECKOUT_MARKER
from tensordb.errors import InvalidInput, TensorDBError

__all__ = [
    "LOCATION_KEYS",
    "LoadSource",
    "Served",
    "ServedLease",
    "StoreLocation",
    "Tally",
    "buckets",
    "check_ref",
    "checked_tensors",
    "close_stores",
    "named_tensors",
    "note_served",
    "now_served",
    "open_store",
    "select_names",
    "served_by",
    "store_of",
]

#: the keys of a store location in an engine's loader config (``connect``'s arguments)
LOCATION_KEYS = ("url", "home", "node", "data_dir")

LocationLike = Union["StoreLocation", Mapping[str, Any], str, os.PathLike, None]


@dataclass(frozen=True, slots=True)
class StoreLocation:
    """Where a store lives: the arguments of ``tensordb.connect``.

    All None: the embedded store of ``$TENSORDB_HOME`` (else ``./.tensordb``) of the
    process that opens it. Hashable; ``as_dict`` gives the JSON form engines carry.
    """

    url: str | None = None
    home: str | None = None
    node: str | None = None
    data_dir: str | None = None

    @classmethod
    def parse(cls, value: LocationLike) -> StoreLocation:
        """A location from a ``StoreLocation``, a mapping with keys of ``LOCATION_KEYS``,
        a catalog URL (``postgresql+psycopg://...``, ``sqlite:///...``), a store's home
        directory, or None (the default store). InvalidInput for anything else."""
        if value is None:
            return cls()
        if isinstance(value, StoreLocation):
            return value
        if isinstance(value, os.PathLike):
            return cls(home=os.fspath(value))
        if isinstance(value, str):
            if not value:
                raise InvalidInput("a store location must not be empty")
            return cls(url=value) if "://" in value else cls(home=value)
        if isinstance(value, Mapping):
            unknown = sorted(set(value) - set(LOCATION_KEYS))
            if unknown:
                raise InvalidInput(f"unknown store location keys {unknown}; expected some of "
                                   f"{list(LOCATION_KEYS)}")
            kw: dict[str, str | None] = {}
            for key in LOCATION_KEYS:
                v = value.get(key)
                if isinstance(v, os.PathLike):
                    v = os.fspath(v)
                if v is not None and not (isinstance(v, str) and v):
                    raise InvalidInput(f"store location {key!r} must be a non-empty string, "
                                       f"not {v!r}")
                kw[key] = v
            return cls(**kw)
        raise InvalidInput(f"a store location is a mapping, a URL or a directory, not "
                           f"{type(value).__name__}")

    @classmethod
    def of(cls, db: tensordb.Database) -> StoreLocation:
        """The location that opens the same store as ``db`` from another process."""
        cfg = db.config
        return cls(url=cfg.catalog_url, home=str(cfg.home), node=cfg.node,
                   data_dir=str(cfg.data_dir))

    def as_dict(self) -> dict[str, str]:
        return {k: v for k in LOCATION_KEYS if (v := getattr(self, k)) is not None}

    def connect(self) -> tensordb.Database:
        return tensordb.connect(self.url, node=self.node,
                                data_dir=Path(self.data_dir) if self.data_dir else None,
                                home=Path(self.home) if self.home else None)


_lock = threading.Lock()
_stores: dict[tuple[int, StoreLocation], tensordb.Database] = {}


def open_store(location: LocationLike = None) -> tensordb.Database:
    """This process's ``Database`` for ``location``, opened on first use and kept open
    for the process's life (engines ask for weights many times). A child process made by
    fork opens its own: a ``Database`` belongs to one process. Thread-safe."""
    loc = StoreLocation.parse(location)
    key = (os.getpid(), loc)
    with _lock:
        db = _stores.get(key)
        if db is None:
            db = _stores[key] = loc.connect()
        return db


def store_of(db_or_location: tensordb.Database | LocationLike) -> tensordb.Database:
    """``db_or_location`` itself when it is a ``Database``, else ``open_store`` of it."""
    if isinstance(db_or_location, tensordb.Database):
        return db_or_location
    return open_store(db_or_location)


def close_stores() -> None:
    """Close the stores ``open_store`` opened in this process. Tensors already handed
    out stay valid; the next ``open_store`` opens a store again."""
    with _lock:
        mine = [k for k in _stores if k[0] == os.getpid()]
        dbs = [_stores.pop(k) for k in mine]
    for db in dbs:
        db.close()


def check_ref(collection: object, version: object, tag: object) -> None:
    """Type checks of a (collection, version | tag) reference, at the engine's API edge,
    before anything is sent to another process."""
    if not isinstance(collection, str) or not collection:
        raise InvalidInput(f"collection must be a non-empty string, not {collection!r}")
    if version is not None and (isinstance(version, bool) or not isinstance(version, int)):
        raise InvalidInput(f"version must be an int or None, not {version!r}",
                           collection=collection)
    if tag is not None and not isinstance(tag, str):
        raise InvalidInput(f"tag must be a str or None, not {tag!r}", collection=collection)
    if version is not None and tag is not None:
        raise InvalidInput("give a version or a tag, not both", collection=collection)


NameFilter = Callable[[str], bool] | Iterable[str] | None


def _name_filter(names: NameFilter) -> Callable[[str], bool] | None:
    if names is None:
        return None
    if callable(names):
        return names
    if isinstance(names, str):
        raise InvalidInput("names must be a collection of tensor names or a predicate, "
                           "not one string")
    wanted = frozenset(names)
    return wanted.__contains__


def select_names(snap: tensordb.Snapshot, names: NameFilter = None) -> list[str]:
    """The snapshot's tensor names, in the version's order, that ``names`` selects (a
    collection of names, or a predicate on a name; None: all). Maps nothing."""
    keep = _name_filter(names)
    return [n for n in snap if keep is None or keep(n)]


def named_tensors(snap: tensordb.Snapshot, names: NameFilter = None
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    """The snapshot's tensors that ``names`` selects as (name, zero-copy tensor), in the
    version's order, each mapped only when the consumer asks for the next one."""
    for name in select_names(snap, names):
        yield name, snap[name]


def checked_tensors(snap: tensordb.Snapshot, names: NameFilter = None, *,
                    read: Callable[[str], torch.Tensor] | None = None
                    ) -> list[tuple[str, torch.Tensor]]:
    """The gate of an all-or-nothing update: every tensor ``names`` selects, known
    readable before the first one is handed to the engine.

    One pass over the selection, in the version's order: each tensor's row, its
    segment mapped (a disk segment's first-open check, a replica pulled from the node
    that holds it), its integrity marks refused, and its bytes hashed against their
    checksum (``Snapshot.verified``, or ``read`` of a snapshot opened with
    ``verify=True``: the bytes that will be loaded). Returns (name, tensor) pairs of
    those checked tensors, zero-copy: the engine's copy reads the pages the hash just
    read. Raises the store's typed error (CorruptData, NodeUnavailable, NotFound)
    naming the tensor, and then nothing has been handed on."""
    get = snap.verified if read is None else read
    return [(name, get(name)) for name in select_names(snap, names)]


@dataclass(frozen=True, slots=True)
class Served:
    """The one version of a collection an engine's model holds (whole: an update that
    failed part-way was put back)."""

    location: StoreLocation
    collection: str
    version: int

    def as_dict(self) -> dict[str, Any]:
        return {"collection": self.collection, "version": self.version}


#: model (or engine handle) -> the version it serves, set by the loaders and the
#: updates of this process
_served: weakref.WeakKeyDictionary[Any, Served] = weakref.WeakKeyDictionary()


def note_served(model: Any, served: Served | None) -> None:
    """Record the version ``model`` (a module, or an engine handle that updates go
    through) serves (None: no one version, or not known)."""
    with _lock:
        if served is None:
            _served.pop(model, None)
        else:
            _served[model] = served


def served_by(model: Any) -> Served | None:
    """The version ``model`` serves, as the last load or update in this process left it;
    None when unknown (loaded from elsewhere, or an update could not be put back)."""
    with _lock:
        return _served.get(model)


class ServedLease:
    """The version ``model`` serves, leased while an update runs so a failure part-way
    can put it back (``__enter__`` gives its snapshot; None when it is unknown or was
    dropped)."""

    def __init__(self, model: Any, served: Served | None = None,
                 db: tensordb.Database | None = None) -> None:
        self.served = served_by(model) if served is None else served
        self.db = db  # the store, when the caller has it open (else the location's)
        self.snap: tensordb.Snapshot | None = None

    def __enter__(self) -> tensordb.Snapshot | None:
        served = self.served
        if served is not None:
            db = self.db if self.db is not None else open_store(served.location)
            try:
                self.snap = db.snapshot(served.collection, version=served.version)
            except TensorDBError:
                self.snap = None  # dropped meanwhile: an update cannot be put back
        return self.snap

    def __exit__(self, *exc: object) -> None:
        if self.snap is not None:
            self.snap.close()


def now_served(location: StoreLocation, snap: tensordb.Snapshot, names: NameFilter,
                before: tensordb.Snapshot | None) -> Served | None:
    """What the model serves after loading ``names`` of ``snap``: that version when it
    got all of it, or when the tensors it did not get hold the same bytes in the
    version before (an update of only the changed tensors); else no one version."""
    if names is None:
        return Served(location, snap.collection, snap.version)
    if before is None or before.collection != snap.collection:
        return None
    loaded = set(select_names(snap, names))
    new, old = snap.extents(), before.extents()
    if set(new) != set(old) or any(new[n] != old[n] for n in new if n not in loaded):
        return None
    return Served(location, snap.collection, snap.version)


@dataclass(slots=True)
class Tally:
    """Counts the tensors and bytes that pass through ``wrap`` (what an engine actually
    consumed), and the time from creation to ``stop``."""

    tensors: int = 0
    nbytes: int = 0
    started: float = field(default_factory=time.perf_counter)
    seconds: float = 0.0

    def wrap(self, pairs: Iterable[tuple[str, torch.Tensor]]
             ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in pairs:
            self.tensors += 1
            self.nbytes += t.numel() * t.element_size()
            yield name, t

    def stop(self) -> Tally:
        self.seconds = time.perf_counter() - self.started
        return self


def buckets(pairs: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
            ) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """``pairs`` grouped in lists of about ``bucket_bytes`` each (a tensor larger than
    that is a bucket of its own). Order is kept."""
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1:
        raise InvalidInput(f"bucket_bytes must be a positive int, not {bucket_bytes!r}")
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in pairs:
        n = t.numel() * t.element_size()
        if bucket and size + n > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += n
    if bucket:
        yield bucket


_SOURCE_KEYS = ("collection", "version", "tag", "verify")


@dataclass(frozen=True, slots=True)
class LoadSource:
    """What an engine's loader reads: one version (``version``, ``tag`` or the head) of
    a collection in the store at ``location``; ``verify`` checksums each tensor read."""

    collection: str
    version: int | None = None
    tag: str | None = None
    verify: bool = False
    location: StoreLocation = StoreLocation()

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None, *, what: str) -> LoadSource:
        """Parse an engine's ``model_loader_extra_config`` (``what`` names the loader in
        messages). InvalidInput (a ValueError, as the engines' own loaders raise) naming
        the key that is wrong."""
        if extra is not None and not isinstance(extra, Mapping):
            raise InvalidInput(f"{what} needs model_loader_extra_config to be a mapping, not "
                               f"{type(extra).__name__}")
        extra = dict(extra or {})
        unknown = sorted(set(extra) - set(_SOURCE_KEYS) - set(LOCATION_KEYS))
        if unknown:
            raise InvalidInput(f"unexpected model_loader_extra_config keys {unknown} for "
                               f"{what}; expected some of {list(_SOURCE_KEYS + LOCATION_KEYS)}")
        if "collection" not in extra:
            raise InvalidInput(f"{what} needs model_loader_extra_config with a 'collection' "
                               f"(and optionally 'version' or 'tag', and where the store is: "
                               f"{list(LOCATION_KEYS)})")
        collection, version, tag = extra["collection"], extra.get("version"), extra.get("tag")
        check_ref(collection, version, tag)
        verify = extra.get("verify", False)
        if not isinstance(verify, bool):
            raise InvalidInput(f"verify must be true or false, not {verify!r}",
                               collection=collection)
        location = StoreLocation.parse({k: extra[k] for k in LOCATION_KEYS if k in extra})
        return cls(collection, version, tag, verify, location)

    @classmethod
    def from_folder(cls, folder: str | os.PathLike[str], *, what: str) -> LoadSource:
        """The source a ``tensordb checkout`` folder names (its ``tensordb.json``), for an
        engine started on the folder with no ``model_loader_extra_config``. InvalidInput
        where the folder has no marker, or an unreadable one."""
        marker = Path(folder) / CHECKOUT_MARKER
        try:
            extra = json.loads(marker.read_text())
        except FileNotFoundError:
            raise InvalidInput(f"{what} needs model_loader_extra_config with a 'collection', "
                               f"or a model folder made by `tensordb checkout` ({marker} "
                               f"is missing)") from None
        except (OSError, ValueError) as exc:
            raise InvalidInput(f"{marker}: unreadable: {exc}") from None
        return cls.from_extra_config(extra, what=f"{what} ({marker})")

    def open(self) -> tensordb.Database:
        return open_store(self.location)

    @contextmanager
    def snapshot(self) -> Generator[tensordb.Snapshot, None, None]:
        """The version, leased while the block runs. NotFound when it does not exist."""
        with self.open().snapshot(self.collection, version=self.version, tag=self.tag,
                                  verify=self.verify) as snap:
            yield snap
