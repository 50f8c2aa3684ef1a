"""The client API of section 3 of DESIGN.md: the Database (Transaction and Snapshot
live in their own modules).

A ``Database`` belongs to one process; open another in a child process (connections
and pre-faulted buffers are not carried across fork).
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from datetime import timedelta
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from sqlalchemy.exc import OperationalError

import storage_engine as se

from tensordb._dtypes import dtype_name, torch_dtype
from ._kv_cache import KVCache
from tensordb._names import check_name
from ._notify import Notifier, PgNotifier, SocketNotifier
from ._safetensors import export_safetensors, import_safetensors
from ._snapshot import Snapshot, device_of
from ._transaction import RawPut, Transaction, digest, source
from tensordb.catalog import (
    Catalog,
    Commit,
    NewTensor,
    NodeDirectory,
    TensorRow,
    ensure_schema,
    make_engine,
)
from tensordb.config import Config
from tensordb.errors import (
    CorruptData,
    InvalidInput,
    NodeUnavailable,
    NotFound,
    StoreClosed,
    StoreFull,
)

if TYPE_CHECKING:
    import pyarrow as pa

__all__ = ["Database", "GcReport", "Corruption", "EvictReport"]

_EMPTY_CHECKSUM = se.checksum(b"")


@dataclass(frozen=True, slots=True)
class GcReport:
    dropped_versions: int
    dropped_rows: int
    expired_leases: int
    segments_deleted: int
    bytes_freed: int
    orphans_reclaimed: int


@dataclass(frozen=True, slots=True)
class EvictReport:
    """What an eviction moved down a tier, and what it left because a pin holds it."""

    segments: int
    nbytes: int
    skipped_pinned: int


@dataclass(frozen=True, slots=True)
class Corruption:
    """A stored tensor whose bytes are missing or do not match their checksum."""

    collection: str
    first_version: int
    tensor: str
    segment_id: str
    tier: str
    reason: str


def _corrupt(collection: str, tensor: str, expected: str, found: str) -> CorruptData:
    """The error of a read whose bytes fail the catalog's checksum."""
    return CorruptData(f"{collection}/{tensor}: stored bytes fail their checksum (expected "
                       f"{expected}, found {found}); not served", collection=collection,
                       tensor=tensor)


@lru_cache(maxsize=4096)
def _strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Contiguous strides of ``shape``, in elements."""
    out, acc = [], 1
    for d in reversed(shape):
        out.append(acc)
        acc *= d
    return tuple(reversed(out))


class Database:
    """A connection to a store: the embedded one, or a node's store in cluster mode."""

    def __init__(self, config: Config) -> None:
        self.config = config
        if config.default_tier not in ("host", "disk", "gpu"):
            raise InvalidInput(f"default_tier must be 'host', 'disk' or 'gpu', not "
                               f"{config.default_tier!r}")
        if (config.default_tier == "gpu" or config.gpu_device is not None) \
                and not se.GpuTier.available():
            raise InvalidInput(f"the GPU tier is unavailable here: "
                               f"{se.GpuTier.unavailable_reason()}")
        self._engine = make_engine(config.catalog_url, synchronous=config.sqlite_synchronous)
        try:
            ensure_schema(self._engine)
        except OperationalError as exc:
            self._engine.dispose()
            raise NodeUnavailable(f"the catalog at {self._engine.url!r} does not answer: "
                                  f"{exc.orig}") from exc
        except BaseException:
            self._engine.dispose()
            raise
        self._lease_engine = (make_engine(config.catalog_url, synchronous="NORMAL")
                              if self._engine.dialect.name == "sqlite" else self._engine)
        self.catalog = Catalog(self._engine, config.node, lease_engine=self._lease_engine)
        if self._lease_engine is not self._engine:  # open its pooled connection now
            self._lease_engine.connect().close()
        self._tiers: dict[str, se.Tier] = {
            "host": se.HostTier(config.shm_dir, capacity=config.host_capacity,
                                spare_bytes=config.spare_bytes),
            "disk": se.DiskTier(config.data_dir),
        }
        if config.gpu_device is not None:  # this process writes (and owns) GPU segments
            self._tiers["gpu"] = self._gpu_tier()
        if self._engine.dialect.name == "postgresql":
            self._notifier: Notifier = PgNotifier(
                self._engine.url.set(drivername="postgresql").render_as_string(hide_password=False))
        else:
            self._notifier = SocketNotifier(config.shm_dir)
        self._kv_caches: list[KVCache] = []
        self._nodes: NodeDirectory | None = None
        self._flight: Any = None  # the node-to-node transport, made on first use
        self._kv_pulls: dict[tuple[str, int], KVCache] = {}
        #: what the last replicate() did (a transport.CascadeReport), for inspection
        self.last_replication: Any = None
        self._closed = False

    # -- plumbing ----------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosed(f"the store at {self.config.home} is closed")

    def _gpu_tier(self) -> se.Tier:
        """The GPU tier, made on first use: constructing it touches no CUDA, so a reader
        gets it the first time a row points at it."""
        tier = self._tiers.get("gpu")
        if tier is None:
            tier = self._tiers["gpu"] = se.GpuTier(
                self.config.shm_dir / "gpu", device=self.config.gpu_device or 0,
                capacity=self.config.gpu_capacity)
        return tier

    def _store(self, name: str) -> se.Tier:
        """The tier a catalog row names (the GPU tier opened on first use)."""
        return self._gpu_tier() if name == "gpu" else self._tiers[name]

    def tier(self, name: str) -> se.Tier:
        if name == "gpu" and "gpu" not in self._tiers and self.config.gpu_device is not None:
            return self._gpu_tier()
        try:
            return self._tiers[name]
        except KeyError:
            raise InvalidInput(f"unknown tier {name!r}; this store has {sorted(self._tiers)}") from None

    def __enter__(self) -> Database:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Release this process's resources. Tensors already handed out stay valid."""
        if self._closed:
            return
        self._closed = True
        for cache in self._kv_caches:
            cache.close()
        if self._flight is not None:
            self._flight.close()
        for tier in self._tiers.values():
            tier.close()
        self._notifier.close()
        self._engine.dispose()
        self._lease_engine.dispose()

    def prefault(self, nbytes: int) -> None:
        """Pre-fault a host-tier spare so a commit of ``nbytes`` of tensors is a memcpy.

        The spare is a little larger than ``nbytes`` (``HostTier.spare_for``): a segment
        pads each extent, and a commit that did not fit its spare would fault every page
        in instead."""
        self._check_open()
        if isinstance(nbytes, bool) or not isinstance(nbytes, (int, np.integer)) or nbytes < 0:
            raise InvalidInput(f"nbytes must be a non-negative int, not {nbytes!r}")
        tier = self._tiers["host"]
        assert isinstance(tier, se.Prefaulting)
        nbytes = int(nbytes)
        if nbytes:
            tier.prefault(tier.spare_for(nbytes), wait=True)

    # -- writing -----------------------------------------------------------------------
    def transaction(self, collection: str, *, message: str | None = None,
                    tier: str | None = None, metadata: Mapping[str, str] | None = None
                    ) -> Transaction:
        """A transaction on one collection: nothing is visible before its block ends."""
        self._check_open()
        return Transaction(self, collection, message=message, tier=tier, metadata=metadata)

    def commit(self, collection: str, tensors: Mapping[str, Any], *, message: str | None = None,
               tier: str | None = None, metadata: Mapping[str, str] | None = None) -> Commit:
        """Shorthand for a transaction that puts every tensor of ``tensors``."""
        with self.transaction(collection, message=message, tier=tier, metadata=metadata) as tx:
            tx.put_many(tensors)
        assert tx.result is not None
        return tx.result

    def _publish(self, collection: str, base: int, puts: dict[str, torch.Tensor],
                 deletes: set[str], message: str | None, tier_name: str,
                 meta: dict[str, str] | None) -> Commit:
        info = self.catalog.info(collection)
        live = self.catalog.live(info.id) if info is not None else {}
        for name in sorted(deletes):
            if name not in live:
                raise NotFound(f"cannot delete {name!r}: collection {collection!r} has no such "
                               f"tensor", collection=collection, tensor=name)
        # a put equal to the head's tensor is not stored again: it keeps sharing the extent
        candidates = [n for n, t in puts.items()
                      if not isinstance(t, RawPut)
                      and (row := live.get(n)) is not None and row.nbytes == t.nbytes
                      and row.dtype == dtype_name(t.dtype) and row.shape == tuple(t.shape)]
        candidates = self._sampled_equal(puts, live, candidates)
        unchanged: list[str] = []
        if candidates:
            pool = se.io_pool()
            step = max(1, -(-len(candidates) // pool._max_workers))
            batches = [candidates[i : i + step] for i in range(0, len(candidates), step)]
            digests = [d for batch in pool.map(lambda b: [digest(puts[n]) for n in b], batches)
                       for d in batch]
            unchanged = [n for n, d in zip(candidates, digests) if d == live[n].checksum]
        skip = set(unchanged)
        changed = [(n, t) for n, t in puts.items() if n not in skip]
        stored = [(n, t) for n, t in changed if t.nbytes > 0]
        sizes = [t.nbytes for _, t in stored]
        offsets, total = se.pack(sizes)
        tier = self.tier(tier_name)
        writer: se.SegmentWriter | None = None
        if total:
            try:
                writer = tier.create(uuid.uuid4().hex, total)
            except se.TierFull as exc:
                raise StoreFull(f"cannot commit {total} bytes to {collection!r}: {exc}; run "
                                f"gc, or commit to the disk tier", collection=collection) from exc
        try:
            checksums: dict[str, str] = {}
            if writer is not None:
                sums = se.fill_segment(writer, [source(t) for _, t in stored], offsets, sizes)
                writer.finish()
                checksums = {n: s for (n, _), s in zip(stored, sums)}
            where = dict(zip((n for n, _ in stored), offsets))
            new = [NewTensor(n, dtype_name(t.dtype), tuple(t.shape), t.nbytes,
                             checksums.get(n, _EMPTY_CHECKSUM),
                             writer.segment_id if n in where and writer else None,
                             where.get(n, 0)) for n, t in changed]
            result = self.catalog.commit(
                collection, base, new, unchanged, deletes,
                (writer.segment_id, tier.name, total) if writer else None, message, meta,
                durable=writer is None or tier.persistent)
        except BaseException:
            if writer is not None:
                writer.abort()
            raise
        if writer is not None:
            writer.release()
        self._notifier.publish(collection, result.version)
        return result

    _SAMPLE = 64  # bytes compared at a tensor's start, then at its middle and end

    def _sampled_equal(self, puts: Mapping[str, Any], live: Mapping[str, TensorRow],
                       names: list[str]) -> list[str]:
        """The names whose tensor may equal the head's: a few bytes at its start (then,
        for those equal there, at its middle and end) are compared with the head's
        extent first, so a changed tensor (every tensor of a weight update) costs one
        small read, no full digest. Where the head's bytes are not cheaply readable
        here, the name stays a candidate (the digest decides)."""
        k = self._SAMPLE
        left = list(names)
        for spots in ((0.0,), (0.5, 1.0)):
            left = self._differ_at(puts, live, left, spots, k)
        return left

    def _differ_at(self, puts: Mapping[str, Any], live: Mapping[str, TensorRow],
                   names: list[str], spots: tuple[float, ...], k: int) -> list[str]:
        """``names`` less those whose bytes differ from the head's at ``spots`` (0: the
        start, 0.5: the middle, 1: the end; ``k`` bytes each)."""
        by_segment: dict[tuple[str, str], list[str]] = {}
        for n in names:
            row = live[n]
            if row.segment_id is not None and row.tier is not None \
                    and row.tier in self._tiers and puts[n].is_contiguous() and row.nbytes > 0:
                by_segment.setdefault((row.segment_id, row.tier), []).append(n)
        differ: set[str] = set()
        for (segment_id, tier), group in by_segment.items():
            ranges: list[tuple[int, int]] = []
            spans: list[list[tuple[int, int]]] = []
            for n in group:
                nb = live[n].nbytes
                m = min(k, nb)
                mine = sorted({(int((nb - m) * f), m) for f in spots})
                spans.append(mine)
                ranges.extend((live[n].offset + o, m) for o, m in mine)
            try:
                got = self._tiers[tier].peek(segment_id, ranges)
            except se.SegmentMissing:
                got = None
            if got is None:
                continue
            pos = 0
            for n, mine in zip(group, spans):
                flat = puts[n].reshape(-1).view(torch.uint8).numpy()
                for o, m in mine:
                    if got[pos] != flat[o : o + m].tobytes():
                        differ.add(n)
                    pos += 1
        return [n for n in names if n not in differ]

    # -- reading -----------------------------------------------------------------------
    def _map(self, segment_id: str, tier: str, collection: str, tensor: str
             ) -> se.SegmentView:
        # a fresh private mapping per read: a reader's writes into one snapshot's tensors
        # must not show through another snapshot in the same process (GPU views are
        # shared, read-only by convention)
        try:
            return self._store(tier).open(segment_id)
        except se.GpuError as exc:
            raise NodeUnavailable(f"cannot map {collection}/{tensor} from the GPU tier: {exc}",
                                  collection=collection, tensor=tensor) from exc
        except se.SegmentMissing as exc:
            moved_to = self.catalog.segment_tier(segment_id)
            if moved_to is not None and moved_to != tier:  # evicted or promoted meanwhile
                return self._map(segment_id, moved_to, collection, tensor)
            if moved_to is not None:
                raise CorruptData(
                    f"the bytes of {collection}/{tensor} (segment {segment_id}) are "
                    f"missing from the {tier} tier", collection=collection,
                    tensor=tensor) from exc
            # not written here: another node's segment, held here as a replica or
            # pulled now (cluster mode)
            return self._map_replica(segment_id, collection, tensor)

    # -- cluster mode ------------------------------------------------------------------
    def _directory(self) -> NodeDirectory:
        if self._nodes is None:
            self._nodes = NodeDirectory(self._engine)
        return self._nodes

    def _transport(self) -> Any:
        """The node-to-node transport, imported and built on first use: an embedded
        store never loads it."""
        if self._flight is None:
            from transport import FlightTransport

            self._flight = FlightTransport(self.config.token, self.config.node_timeout)
        return self._flight

    def _pull(self, segment_ids: Iterable[str], prefer: str | None = None) -> dict[str, str]:
        """Pull segments other nodes hold into this node's tiers (verified, then
        registered as replicas); segment id -> local tier."""
        from transport import pull_segment

        tiers = {n: self._tiers[n] for n in ("host", "disk")}
        return {s: pull_segment(self._directory(), self._transport(), self.config.node, tiers,
                                s, prefer=prefer) for s in segment_ids}

    def _map_replica(self, segment_id: str, collection: str, tensor: str
                     ) -> se.SegmentView:
        directory = self._directory()
        for attempt in (1, 2):
            holders = directory.holders(segment_id)
            if not holders:
                raise NotFound(f"{collection}/{tensor} was removed while being read",
                               collection=collection, tensor=tensor)
            here = holders.get(self.config.node)
            if here is None:
                try:
                    here = self._pull([segment_id])[segment_id]
                except NodeUnavailable as exc:
                    raise NodeUnavailable(f"cannot read {collection}/{tensor}: {exc}",
                                          collection=collection, tensor=tensor,
                                          node=exc.node) from exc
                except NotFound as exc:
                    raise NotFound(f"{collection}/{tensor} was removed while being read",
                                   collection=collection, tensor=tensor) from exc
            try:
                return self._store(here).open(segment_id)
            except se.SegmentMissing:
                # a replica registered here whose file is gone (host memory lost in a
                # reboot): forget it and pull again, once
                directory.drop_replica(segment_id, self.config.node)
        raise CorruptData(f"the replica of {collection}/{tensor} (segment {segment_id}) "
                          f"vanished twice while being read", collection=collection,
                          tensor=tensor)

    def _materialize(self, collection: str, rows: Iterable[TensorRow], *, verify: bool,
                     maps: dict[str, se.SegmentView] | None = None) -> dict[str, torch.Tensor]:
        """Zero-copy tensors over the segments' copy-on-write mappings (``maps``: the
        mappings already made for this snapshot)."""
        out: dict[str, torch.Tensor] = {}
        if maps is None:
            maps = {}
        bases: dict[tuple[str, str], tuple[torch.Tensor, int]] = {}
        # a fresh process's state_dict of a whole model runs this per tensor: fields are
        # unpacked once, not read through the row's attributes (a fifth of its time)
        for name, dtype, shape, nbytes, csum, segment_id, offset, tier, _ in rows:
            if segment_id is None:
                out[name] = torch.empty(shape, dtype=torch_dtype(dtype))
                continue
            found = bases.get((segment_id, dtype))
            if found is None or verify:
                mm = maps.get(segment_id)
                if mm is None:
                    mm = maps[segment_id] = self._map(segment_id, tier or "host", collection,
                                                      name)
                if verify:
                    got = se.checksum(mm.host_bytes(offset, nbytes))  # no copy on the host
                    if got != csum:
                        raise _corrupt(collection, name, csum, got)
            if found is None:
                dt = torch_dtype(dtype)
                if mm is not None and mm.on_device:  # the IPC mapping itself: no copy
                    base = torch.as_tensor(mm, device=f"cuda:{mm.device}").view(dt)
                else:
                    base = torch.frombuffer(mm, dtype=dt)
                found = bases[(segment_id, dtype)] = (base, dt.itemsize)
            base, size = found
            out[name] = base.as_strided(shape, _strides(shape), offset // size)
        return out

    def _read_into(self, collection: str, pairs: list[tuple[TensorRow, np.ndarray]], *,
                   verify: bool) -> list[TensorRow]:
        """Kernel reads of rows' bytes into caller buffers (uint8, contiguous), grouped by
        segment; returns the rows whose tier could not (the caller copies those from a
        mapping). Verified against the catalog's checksums when ``verify``."""
        by_segment: dict[tuple[str, str], list[tuple[TensorRow, np.ndarray]]] = {}
        left: list[TensorRow] = []
        for row, out in pairs:
            if row.segment_id is None or row.nbytes == 0:
                continue
            by_segment.setdefault((row.segment_id, row.tier or "host"), []).append((row, out))
        for (segment_id, tier), group in by_segment.items():
            try:
                done = tier in self._tiers and self._tiers[tier].read_into(
                    segment_id, [(r.offset, out) for r, out in group])
            except se.SegmentMissing:
                done = False  # moved or remote meanwhile: the mapping path finds it
            if not done:
                left.extend(r for r, _ in group)
                continue
            if verify:
                for r, out in group:
                    got = se.checksum(out)
                    if got != r.checksum:
                        raise _corrupt(collection, r.name, r.checksum, got)
        return left

    def get(self, collection: str, name: str, *, version: int | None = None,
            tag: str | None = None, verify: bool = False) -> torch.Tensor:
        """One tensor of the head (or of ``version`` / ``tag``), zero-copy."""
        self._check_open()
        check_name("collection", collection)
        check_name("tensor", name, collection=collection)
        info, v = self.catalog.resolve(collection, version, tag)
        rows = self.catalog.manifest(info.id, v, [name])
        if not rows:
            raise NotFound(f"collection {collection!r} version {v} has no tensor {name!r}",
                           collection=collection, tensor=name, version=v)
        return self._materialize(collection, rows, verify=verify)[name]

    def snapshot(self, collection: str, *, version: int | None = None, tag: str | None = None,
                 verify: bool = False, device: str | torch.device | None = None) -> Snapshot:
        """A leased, consistent view of one version (the head unless told otherwise).

        ``device``: where its tensors are handed out. None: where they are stored (host
        views; CUDA IPC views for GPU-tier rows). "cuda:N": GPU-tier rows of that device
        zero-copy, every other row copied there once per snapshot. "cpu": host views,
        GPU-tier rows copied to the host."""
        self._check_open()
        check_name("collection", collection)
        if tag is not None:
            check_name("tag", tag, collection=collection)
        return Snapshot(self, collection, version, tag, verify, device_of(device, collection))

    # -- metadata ----------------------------------------------------------------------
    def history(self, collection: str) -> list[Commit]:
        """Every retained commit of ``collection``, newest first."""
        self._check_open()
        check_name("collection", collection)
        return self.catalog.history(collection)

    def collections(self) -> list[str]:
        self._check_open()
        return self.catalog.collection_names()

    def tag(self, collection: str, tag: str, *, version: int | None = None) -> int:
        """Point ``tag`` at ``version`` (default: the head); returns the version. A tag
        keeps its version from retention and gc."""
        self._check_open()
        check_name("collection", collection)
        check_name("tag", tag, collection=collection)
        return self.catalog.tag(collection, tag, version)

    def untag(self, collection: str, tag: str) -> None:
        self._check_open()
        self.catalog.untag(check_name("collection", collection), tag)

    def tags(self, collection: str) -> dict[str, int]:
        self._check_open()
        return self.catalog.tags(check_name("collection", collection))

    def set_retention(self, collection: str, keep_last: int | None) -> None:
        """Keep only the last ``keep_last`` versions (plus tagged and leased ones) at gc."""
        self._check_open()
        self.catalog.set_retention(check_name("collection", collection), keep_last)

    def drop(self, collection: str) -> None:
        """Remove a collection with all its versions and tags; gc reclaims the bytes."""
        self._check_open()
        self.catalog.drop(check_name("collection", collection))

    def watch(self, collection: str, *, after: int | None = None,
              timeout: float | None = None, poll: float = 1.0) -> Iterator[Commit]:
        """Yield each new commit of ``collection`` in order, as it lands.

        ``after``: the last version the caller has (default: the current head). The
        iterator ends when ``timeout`` seconds pass without a new commit. It sleeps
        until a commit notification arrives (a socket on this host; LISTEN/NOTIFY with
        a PostgreSQL catalog) and re-reads the catalog at least every ``poll`` seconds.
        """
        self._check_open()
        check_name("collection", collection)
        sub = self._notifier.subscribe()  # before the first look: no commit slips between
        try:
            if after is None:
                info = self.catalog.info(collection)
                after = info.head if info else 0
            deadline = None if timeout is None else time.monotonic() + timeout
            check = True
            while True:
                if check:
                    try:
                        new = self.catalog.commits_after(collection, after)
                    except NotFound:  # not created yet
                        new = []
                    if new:
                        for c in new:
                            after = c.version
                            yield c
                        if timeout is not None:
                            deadline = time.monotonic() + timeout
                        continue
                wait = poll
                if deadline is not None:
                    wait = min(wait, deadline - time.monotonic())
                    if wait <= 0:
                        return
                names = sub.wait(wait)
                check = names is None or collection in names
        finally:
            sub.close()

    # -- placement -------------------------------------------------------------------
    _ORDER = ("gpu", "host", "disk")  # fastest first

    def _placement_tier(self, tier: str) -> str:
        if tier not in self._ORDER:
            raise InvalidInput(f"unknown tier {tier!r}; tiers are {', '.join(self._ORDER)}")
        if tier not in self._tiers:
            raise InvalidInput(f"node {self.config.node!r} has no {tier} tier")
        return tier

    def _move(self, segment_id: str, src: str, dst: str) -> bool:
        """Copy a segment to another tier, repoint the catalog, delete the old copy.

        Readers that mapped the old copy keep it; readers that look the segment up
        after the move find it in ``dst``."""
        source = self._store(src)
        try:
            mm = source.open(segment_id)
        except se.SegmentMissing:
            return False
        writer = self._store(dst).create(segment_id, len(mm))
        try:
            se.copy(writer.buffer, mm.host_bytes())
            del mm
            writer.finish()
            moved = self.catalog.move_segment(segment_id, src, dst)
        except BaseException:
            writer.abort()
            raise
        if not moved:  # someone else moved or dropped it first
            writer.abort()
            return False
        writer.release()
        source.delete(segment_id)
        return True

    def pin(self, collection: str, *, version: int | None = None, tag: str | None = None,
            tier: str = "host") -> int:
        """Keep a version's bytes in ``tier`` (moving them there now): eviction skips
        them and gc keeps the version. Returns the pinned version. Idempotent."""
        self._check_open()
        check_name("collection", collection)
        tier = self._placement_tier(tier)
        v = self.catalog.pin(collection, version, tag, tier)
        cid = self.catalog.require(collection).id
        for sid, at, _ in self.catalog.version_segments(cid, v):
            if at != tier:
                self._move(sid, at, tier)
        return v

    def unpin(self, collection: str, *, version: int | None = None, tag: str | None = None,
              tier: str = "host") -> bool:
        """Remove a pin; False if there was none."""
        self._check_open()
        check_name("collection", collection)
        return self.catalog.unpin(collection, version, tag, self._placement_tier(tier))

    def pins(self) -> list[tuple[str, int, str]]:
        """(collection, version, tier) of every pin."""
        self._check_open()
        return self.catalog.pins()

    def evict(self, collection: str, *, version: int | None = None, tag: str | None = None,
              tier: str = "host") -> EvictReport:
        """Move a version's bytes from ``tier`` down to the next tier (host to disk),
        except those a pin in ``tier`` holds."""
        self._check_open()
        check_name("collection", collection)
        tier = self._placement_tier(tier)
        below = [t for t in self._ORDER[self._ORDER.index(tier) + 1 :] if t in self._tiers]
        if not below:
            raise InvalidInput(f"cannot evict from the {tier} tier: no tier lies below it",
                               collection=collection)
        info, v = self.catalog.resolve(collection, version, tag)
        pinned = self.catalog.pinned_segments(tier)
        moved = nbytes = skipped = 0
        for sid, at, size in self.catalog.version_segments(info.id, v):
            if at != tier:
                continue
            if sid in pinned:
                skipped += 1
            elif self._move(sid, tier, below[0]):
                moved += 1
                nbytes += size
        return EvictReport(moved, nbytes, skipped)

    def drop_versions(self, collection: str, *, keep_last: int | None = None,
                      older_than: timedelta | None = None) -> int:
        """Forget old versions, keeping the head and every tagged, pinned or leased
        version; ``gc`` then frees their bytes. Returns how many were dropped."""
        self._check_open()
        check_name("collection", collection)
        if (keep_last is None) == (older_than is None):
            raise InvalidInput("give keep_last or older_than (exactly one)",
                               collection=collection)
        if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int)
                                      or keep_last < 1):
            raise InvalidInput(f"keep_last must be a positive integer, not {keep_last!r}",
                               collection=collection)
        if older_than is not None and (not isinstance(older_than, timedelta)
                                       or older_than.total_seconds() < 0):
            raise InvalidInput(f"older_than must be a non-negative timedelta, not {older_than!r}",
                               collection=collection)
        return self.catalog.drop_versions(collection, keep_last, older_than)

    def replicate(self, collection: str, *, version: int | None = None,
                  to: Iterable[str]) -> list[str]:
        """Make the ``to`` nodes hold a version (default: the head); returns them.

        Blocks until every target holds it. Other nodes pull over their node servers
        as a cascade (each node that has the version serves it onward: ceil(log2(N+1))
        rounds for N targets); this node pulls in-process. A target that is unknown
        raises NotFound, one that is down NodeUnavailable, before anything moves; a
        target whose pull fails raises NodeUnavailable after the others are done. The
        embedded store is one node and holds every version already."""
        self._check_open()
        check_name("collection", collection)
        targets = [to] if isinstance(to, str) else list(to)
        if not targets:
            raise InvalidInput("replicate needs at least one target node", collection=collection)
        info, v = self.catalog.resolve(collection, version, None)
        me = self.config.node
        directory = self._directory()
        known = directory.nodes()
        for node in targets:
            if not isinstance(node, str) or (node not in known and node != me):
                raise NotFound(f"no node {node!r} in the catalog", collection=collection,
                               node=str(node))
        targets = list(dict.fromkeys(targets))
        live = directory.live()
        for node in targets:
            if node != me and node not in live:
                raise NodeUnavailable(f"node {node!r} is down or not serving (no heartbeat "
                                      f"within {directory.lapse:g} s)", collection=collection,
                                      node=node)
        segs = [sid for sid, _ in directory.version_segments(info.id, v)]
        held = directory.held_by(segs)
        if all(t in held[s] for s in segs for t in targets):
            return targets
        from transport import cascade

        def pull_here(missing: Iterable[str], source: str | None) -> None:
            self._pull(missing, source)

        report = cascade(directory, self._transport(), me, segs, targets, pull_here)
        self.last_replication = report
        if report.failed:
            node, why = next(iter(report.failed.items()))
            raise NodeUnavailable(f"replicating {collection} v{v} to {node!r} failed: {why}",
                                  collection=collection, version=v, node=node)
        return targets

    def pull_kv(self, namespace: str, keys: Iterable[bytes], *, block_tokens: int = 256,
                nodes: Iterable[str] | None = None) -> int:
        """Fetch the KV blocks of ``keys`` this node lacks from other live nodes (those
        that hold ``namespace``, or ``nodes``), verify their checksums and put them in
        this node's namespace. Returns how many blocks arrived. Blocks no node holds
        are skipped (a cache miss is not an error)."""
        self._check_open()
        wanted = list(keys)
        if not all(isinstance(k, bytes) and k for k in wanted):
            raise InvalidInput("keys must be non-empty bytes (from kv.keys)", collection=namespace)
        cache = self._kv_pulls.get((namespace, block_tokens))
        if cache is None:
            cache = self._kv_pulls[(namespace, block_tokens)] = self.kv(namespace, block_tokens)
        missing = [k for k, held in zip(wanted, cache.contains(wanted)) if not held]
        directory = self._directory()
        live = directory.live()
        sources = (list(nodes) if nodes is not None
                   else [n for n in directory.kv_nodes(namespace) if n != self.config.node])
        got = 0
        for node in sources:
            if not missing:
                break
            if node not in live:
                continue
            blocks = self._transport().read_kv(node, live[node].address or "", namespace,
                                               block_tokens, missing)
            tensors, names = [], []
            for key, dtype, shape, data, digest_ in blocks:
                if se.checksum(data) != digest_:
                    raise CorruptData(f"KV block {key.hex()} of {namespace!r} from node "
                                      f"{node!r} fails its checksum; not kept",
                                      collection=namespace, node=node)
                tensors.append(torch.from_numpy(data.copy()).view(getattr(torch, dtype))
                               .reshape(shape))
                names.append(key)
            if names:
                cache.put(names, tensors)
                got += len(names)
                arrived = set(names)
                missing = [k for k in missing if k not in arrived]
        return got

    # -- maintenance -------------------------------------------------------------------
    def gc(self) -> GcReport:
        """Reclaim what no version, tag, lease or retention rule needs, and the segments
        of writers that died before committing. Safe while others read and write."""
        self._check_open()
        plan = self.catalog.gc()
        freed = 0
        for sid, tier, nbytes in plan.dead_segments:
            if self._store(tier).delete(sid):
                freed += nbytes
        orphans = 0
        for tier in self._tiers.values():
            orphans += len(tier.reclaim_orphans(self.catalog.segment_registered))
        return GcReport(plan.dropped_versions, plan.dropped_rows, plan.expired_leases,
                        len(plan.dead_segments), freed, orphans)

    def verify(self) -> list[Corruption]:
        """Check every stored extent of this node against its checksum; [] when all good."""
        self._check_open()
        problems: list[Corruption] = []
        current: tuple[str, se.SegmentView | None] | None = None
        for coll, first, r in self.catalog.all_rows():
            assert r.segment_id is not None and r.tier is not None
            if current is None or current[0] != r.segment_id:
                try:
                    current = (r.segment_id, self._store(r.tier).open(r.segment_id))
                except se.SegmentMissing:
                    current = (r.segment_id, None)
            mm = current[1]
            if mm is None:
                problems.append(Corruption(coll, first, r.name, r.segment_id, r.tier, "missing"))
                continue
            if r.offset + r.nbytes > len(mm):
                problems.append(Corruption(coll, first, r.name, r.segment_id, r.tier, "truncated"))
                continue
            got = se.checksum(mm.host_bytes(r.offset, r.nbytes))
            if got != r.checksum:
                problems.append(Corruption(coll, first, r.name, r.segment_id, r.tier,
                                           f"checksum {got} != {r.checksum}"))
        return problems

    def stats(self) -> dict[str, int]:
        self._check_open()
        out = self.catalog.stats()
        for name, tier in self._tiers.items():
            out[f"{name}_bytes"] = tier.used_bytes()
        return out

    def import_safetensors(self, collection: str, path: str | os.PathLike[str], *,
                           message: str | None = None, tier: str | None = None,
                           progress: bool = False) -> Commit:
        """Commit a .safetensors file, or a Hugging Face folder with
        model.safetensors.index.json, as one version of ``collection``: read straight
        into the store's extents, headers checked as strictly as safetensors does
        (CorruptData / InvalidInput, and nothing committed, for a bad file)."""
        self._check_open()

        return import_safetensors(self, collection, path, message=message, tier=tier,
                                  progress=progress)

    def export_safetensors(self, collection: str, out_dir: str | os.PathLike[str], *,
                           version: int | None = None, progress: bool = False) -> list[Path]:
        """Write a version as safetensors files (byte-identical to the imported ones,
        with the index of a sharded folder); returns the paths written."""
        self._check_open()

        return export_safetensors(self, collection, out_dir, version=version,
                                  progress=progress)

    def kv(self, namespace: str, block_tokens: int = 256, **opts: Any) -> KVCache:
        """The KV block store of ``namespace`` on this node (one model / KV layout):
        blocks shared by every process of the host, in a pre-faulted shared-memory arena
        with eviction (``policy="lru"|"s3fifo"``) and spill to disk. ``opts``:
        ``capacity_bytes``, ``policy``, ``slab_bytes``, ``spill``, ``disk_capacity``,
        ``gpu_capacity`` (a GPU tier of that many bytes on ``Config.gpu_device``, for
        ``get(..., device="cuda")``: copies of hot blocks shared by the host's processes
        through CUDA IPC; also $TENSORDB_KV_GPU_CAPACITY)."""
        self._check_open()
        cache = KVCache(self, namespace, block_tokens, **opts)
        self._kv_caches.append(cache)
        return cache

    def query(self, text: str, params: Mapping[str, object] | None = None
              ) -> pa.Table:
        """Run one statement of the query language (see the ``query`` package): a
        pyarrow.Table of rows for SELECT, one summary row for an action. ``params``:
        values of its ``:name`` parameters. Raises QueryError for a bad statement."""
        self._check_open()
        from query import execute

        return execute(self, text, params)
