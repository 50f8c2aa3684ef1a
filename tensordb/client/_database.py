"""The client API of section 3 of DESIGN.md: ``Database``, the facade over the jobs of
a store's connection, each in a module of its own.

- ``_write``: transactions published as commits (dedupe against the head);
- ``_read``: rows to zero-copy tensors (``get``, snapshots);
- ``_placement``: the node's tiers, pins and evictions;
- ``_cluster``: other nodes (replicas, ``replicate``, ``pull_kv``);
- ``_maintenance``: retention, ``gc``, ``verify``, ``stats``;
- ``_notify``: commit notifications (``watch``).

A ``Database`` belongs to one process; open another in a child process (connections
and pre-faulted buffers are not carried across fork).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from sqlalchemy import Engine
from sqlalchemy.exc import DatabaseError, OperationalError

import query
import storage_engine as se
from tensordb.catalog import (
    Catalog,
    Commit,
    NodeDirectory,
    Quota,
    Quotas,
    ensure_schema,
    make_engine,
)
from tensordb.config import Config
from tensordb.errors import CorruptData, InvalidInput, NodeUnavailable, StoreClosed, StoreFull

from ._cluster import Cluster
from ._inputs import check_name
from ._kv_cache import KVCache
from ._kv_namespace import kv_counters
from ._maintenance import Corruption, GcReport, Maintenance, ScrubReport
from ._metrics import HostCollector
from ._model_files import CHECKOUT_MARKER, write_files
from ._notify import notifier_for, watch
from ._object_store import is_object_url
from ._orphans import record_owner
from ._placement import EvictReport, Placement, Tiers, check_tier_config, device_of
from ._puts import GROUP_TIMEOUT, group_spec
from ._read import Reader
from ._safetensors import run_export, run_import
from ._safetensors_objects import BATCH_BYTES, PENDING_TTL, run_object_import
from ._scrubber import BackgroundScrub, check_scrub_config, scrub_status
from ._snapshot import Snapshot, tensors_arrow
from ._transaction import Transaction
from ._write import InPlaceFile, Writer

if TYPE_CHECKING:
    import pyarrow as pa

    from transport import CascadeReport, Transport

__all__ = ["Database"]


def _open_catalog(config: Config) -> tuple[Engine, Engine]:
    """The catalog's engine (schema ensured) and the one leases are written through:
    with SQLite, a second engine that does not sync each lease to disk."""
    engine = make_engine(config.catalog_url, synchronous=config.sqlite_synchronous)
    try:
        ensure_schema(engine)
    except OperationalError as exc:
        engine.dispose()
        raise NodeUnavailable(f"the catalog at {engine.url!r} does not answer: "
                              f"{exc.orig}") from exc
    except DatabaseError as exc:  # SQLite: the file is not a database, or is malformed
        engine.dispose()
        if engine.dialect.name != "sqlite":
            raise
        raise CorruptData(f"the catalog {engine.url.database} is damaged ({exc.orig}); "
                          f"restore it from a backup") from None
    except BaseException:
        engine.dispose()
        raise
    lease_engine = (make_engine(config.catalog_url, synchronous="NORMAL")
                    if engine.dialect.name == "sqlite" else engine)
    return engine, lease_engine


class Database:
    """A connection to a store: the embedded one, or a node's store in cluster mode."""

    def __init__(self, config: Config) -> None:
        self.config = config
        check_tier_config(config)
        check_scrub_config(config)
        self._engine, self._lease_engine = _open_catalog(config)
        self.catalog = Catalog(self._engine, config.node, lease_engine=self._lease_engine,
                               manifest_dir=config.home / "manifests")
        if self._lease_engine is not self._engine:  # open its pooled connection now
            self._lease_engine.connect().close()
        self._tiers = Tiers(config, sources=self.catalog.segment_source,
                            extents=self.catalog.segment_extents)
        record_owner(config)  # so `tensordb orphans` can tell the area is this store's
        self._notifier = notifier_for(self._engine, config.shm_dir)
        self._kv_caches: list[KVCache] = []
        self._cluster = Cluster(config, self._engine, self.catalog, self._tiers)
        self._reader = Reader(self.catalog, self._tiers, self._cluster)
        self._writer = Writer(self.catalog, self._tiers, self._notifier,
                              default_tier=config.default_tier, workers=se.io_workers())
        self._placement = Placement(self.catalog, self._tiers)
        self._maintenance = Maintenance(self.catalog, self._tiers)
        self._scrub = BackgroundScrub(self._maintenance, self._tiers.marks.root,
                                      interval=config.scrub_interval,
                                      rate=config.scrub_rate, cpu=config.scrub_cpu,
                                      node=config.node)
        self._closed = False
        self._scrub.start()

    # -- plumbing ----------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosed(f"the store at {self.config.home} is closed")

    def _is_open(self) -> bool:
        return not self._closed

    def _commit_in_place(self, collection: str, files: list[InPlaceFile], deletes: set[str],
                         message: str, meta: dict[str, str],
                         advance: Callable[[int], None]) -> Commit:
        """One version whose tensors are ``files``' bytes where they lie (the safetensors
        import in place, which is handed this method): a commit of the writer's, on the
        head it finds."""
        self._check_open()
        check_name("collection", collection)
        return self._writer.publish_in_place(collection, self._writer.head(collection), files,
                                             deletes, message, meta, advance)

    def tier(self, name: str) -> se.Tier:
        return self._tiers.tier(name)

    def __enter__(self) -> Database:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Release this process's resources. Tensors already handed out stay valid."""
        if self._closed:
            return
        self._closed = True
        self._scrub.stop()
        for cache in self._kv_caches:
            cache.close()
        self._cluster.close()
        self._tiers.close()
        self._notifier.close()
        self.catalog.close()
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
        tier = self._tiers.host
        nbytes = int(nbytes)
        if not nbytes:
            return
        spare = tier.spare_for(nbytes)
        capacity = getattr(tier, "capacity", None)
        if capacity is not None and spare > capacity:
            raise StoreFull(f"cannot prefault a spare of {spare} bytes for commits of "
                            f"{nbytes} bytes: the host tier holds at most {capacity}")
        try:
            tier.prefault(spare, wait=True)
        except se.TierFull as exc:  # shared memory itself has no room for it
            raise StoreFull(f"cannot prefault a spare of {spare} bytes for commits of "
                            f"{nbytes} bytes: {exc}; run gc, or commit to the disk "
                            f"tier") from exc

    # -- writing -----------------------------------------------------------------------
    def transaction(self, collection: str, *, message: str | None = None,
                    tier: str | None = None, metadata: Mapping[str, str] | None = None,
                    group: str | None = None, rank: int | None = None,
                    world_size: int | None = None, timeout: float = GROUP_TIMEOUT
                    ) -> Transaction:
        """A transaction on one collection: nothing is visible before its block ends.

        ``group``, ``rank``, ``world_size``: this process's part of a group transaction
        (the ranks of a distributed job each put their shards): the version appears,
        atomically, when every rank has committed its part, and the block of each rank
        waits for that (its ``result`` is the version's Commit). A rank that raises in
        its block, or dies, or ``timeout`` seconds passing before the last part, aborts
        the group (GroupAborted on the other ranks): nothing is published."""
        self._check_open()
        spec = group_spec(collection, group, rank, world_size, timeout)
        return Transaction(self._writer, collection, message=message, tier=tier,
                           metadata=metadata, check_open=self._check_open, group=spec)

    def commit(self, collection: str, tensors: Mapping[str, Any], *, message: str | None = None,
               tier: str | None = None, metadata: Mapping[str, str] | None = None) -> Commit:
        """Shorthand for a transaction that puts every tensor of ``tensors``."""
        with self.transaction(collection, message=message, tier=tier, metadata=metadata) as tx:
            tx.put_many(tensors)
        assert tx.result is not None
        return tx.result

    # -- reading -----------------------------------------------------------------------
    def get(self, collection: str, name: str, *, version: int | None = None,
            tag: str | None = None, verify: bool = False) -> torch.Tensor:
        """One tensor of the head (or of ``version`` / ``tag``), zero-copy."""
        self._check_open()
        return self._reader.get(collection, name, version, tag, verify)

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
        return Snapshot(self._reader, collection, version, tag, verify,
                        device_of(device, collection), lease_ttl=self.config.lease_ttl,
                        store_open=self._is_open)

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
        yield from watch(self.catalog, self._notifier, collection, after, timeout, poll)

    # -- placement -------------------------------------------------------------------
    def pin(self, collection: str, *, version: int | None = None, tag: str | None = None,
            tier: str = "host") -> int:
        """Keep a version's bytes in ``tier`` (moving them there now): eviction skips
        them and gc keeps the version. Returns the pinned version. Idempotent."""
        self._check_open()
        return self._placement.pin(collection, version, tag, tier)

    def unpin(self, collection: str, *, version: int | None = None, tag: str | None = None,
              tier: str = "host") -> bool:
        """Remove a pin; False if there was none."""
        self._check_open()
        return self._placement.unpin(collection, version, tag, tier)

    def pins(self) -> list[tuple[str, int, str]]:
        """(collection, version, tier) of every pin."""
        self._check_open()
        return self.catalog.pins()

    def evict(self, collection: str, *, version: int | None = None, tag: str | None = None,
              tier: str = "host") -> EvictReport:
        """Move a version's bytes from ``tier`` down to the next tier (host to disk),
        except those a pin in ``tier`` holds."""
        self._check_open()
        return self._placement.evict(collection, version, tag, tier)

    # -- cluster mode ------------------------------------------------------------------
    # the two private seams tests of cluster mode use: an in-process transport put in
    # place of Flight, and a pull into this node's tiers
    @property
    def _flight(self) -> Transport | None:
        return self._cluster.flight

    @_flight.setter
    def _flight(self, transport: Transport | None) -> None:
        self._cluster.flight = transport

    def _pull(self, segment_ids: Iterable[str], prefer: str | None = None) -> dict[str, str]:
        return self._cluster.pull(segment_ids, prefer)

    @property
    def last_replication(self) -> CascadeReport | None:
        """What the last replicate() did (a transport.CascadeReport), for inspection."""
        return self._cluster.last_replication

    @last_replication.setter
    def last_replication(self, report: CascadeReport | None) -> None:
        self._cluster.last_replication = report

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
        return self._cluster.replicate(collection, version, to)

    def pull_kv(self, namespace: str, keys: Iterable[bytes], *, block_tokens: int = 256,
                nodes: Iterable[str] | None = None) -> int:
        """Fetch the KV blocks of ``keys`` this node lacks from other live nodes (those
        that hold ``namespace``, or ``nodes``), verify their checksums and put them in
        this node's namespace. Returns how many blocks arrived. Blocks no node holds
        are skipped (a cache miss is not an error)."""
        self._check_open()
        return self._cluster.pull_kv(namespace, keys, block_tokens, nodes, self.kv)

    # -- maintenance -------------------------------------------------------------------
    def drop_versions(self, collection: str, *, keep_last: int | None = None,
                      older_than: timedelta | None = None) -> int:
        """Forget old versions, keeping the head and every tagged, pinned or leased
        version; ``gc`` then frees their bytes. Returns how many were dropped."""
        self._check_open()
        return self._maintenance.drop_versions(collection, keep_last, older_than)

    def gc(self, *, keep_pool: bool = True) -> GcReport:
        """Reclaim what no version, tag, lease or retention rule needs, and the segments
        of writers that died before committing. Safe while others read and write.

        Freed host-tier files that no reader maps go to the store's pool, where later
        writes reuse their pages without page faults; gc trims the pool to its bound
        (``Config.pool_bytes``), and ``keep_pool=False`` gives all of it back."""
        self._check_open()
        return self._maintenance.gc(keep_pool)

    def verify(self) -> list[Corruption]:
        """Check every stored extent of this node against its checksum; [] when all good."""
        self._check_open()
        return self._maintenance.verify()

    def scrub(self, max_bytes: int | None = None, *, rate: int | None = None,
              stop: Callable[[], bool] | None = None) -> ScrubReport:
        """Hash this node's host- and disk-tier segments against their checksums, from
        where the last scrub of the store stopped (``max_bytes``: about that many, None:
        one full round; ``rate``: bytes a second at most; ``stop``: asked between
        segments), marking each that fails corrupt: no read begun afterwards returns
        its bytes (docs/storage.md, "Integrity model"). The store's background scrub
        (one process per host, ``Config.scrub_cpu`` of a core) runs it by default."""
        self._check_open()
        return self._maintenance.scrub(max_bytes, rate=rate, stop=stop)

    def metrics_collector(self) -> HostCollector:
        """The host's metrics as a ``prometheus_client`` collector (docs/operations.md):
        what ``tensordb metrics`` and the node server's metrics endpoint serve."""
        return HostCollector(self)

    def set_quota(self, scope: str, max_bytes: int) -> None:
        """Limit the bytes the collections whose names ``scope`` matches (a glob of ``*``
        and ``?``, as a token's scope: a tenant) store together: a commit that would
        pass it raises StoreFull naming the quota and changes nothing. Replaces the
        scope's quota if it has one; what is stored already stays."""
        self._check_open()
        Quotas(self.catalog.engine).set(scope, max_bytes)

    def drop_quota(self, scope: str) -> None:
        """End the quota of ``scope`` (NotFound when it has none)."""
        self._check_open()
        Quotas(self.catalog.engine).drop(scope)

    def quotas(self) -> list[Quota]:
        """Every quota with the bytes its tenant's collections store now (the segments
        their commits stored: a shared extent once, a replica not at all)."""
        self._check_open()
        return Quotas(self.catalog.engine).list()

    def kv_counters(self, namespace: str) -> tuple[dict[str, int], int] | None:
        """The shared counters of a KV namespace on this host (hits, misses, evictions,
        spills, corrupt; blocks and bytes per medium; arena bytes) and its capacity;
        None where it has no store on this host; CorruptData where its files are
        damaged. Opens nothing for writing and creates nothing: for the metrics and the
        console."""
        self._check_open()
        return kv_counters(self.config, namespace)

    def holdings(self, collection: str, *, version: int | None = None
                 ) -> tuple[int, int, dict[str, int]]:
        """What each node holds of a version (default: the head): (version, bytes of its
        segments, node -> bytes of them it holds, as owner or replica). NotFound for a
        collection or version that does not exist."""
        self._check_open()
        info, v = self.catalog.resolve(collection, version)
        directory = NodeDirectory(self.catalog.engine)
        sizes = dict(directory.version_segments(info.id, v))
        held: dict[str, int] = {}
        for sid, nodes in directory.held_by(sizes).items():
            for node in nodes:
                held[node] = held.get(node, 0) + sizes[sid]
        return v, sum(sizes.values()), held

    def stats(self) -> dict[str, int]:
        """The catalog's counts, the bytes of each tier of this node, and the host's
        background scrub (``scrub_*``: the scrubbing process's pid, rounds completed,
        bytes and segments of the current round, damage found, when the last round
        ended, in Unix seconds)."""
        self._check_open()
        return {**self._maintenance.stats(), **scrub_status(self._tiers.marks.root)}

    # -- formats and the other interfaces ------------------------------------------------
    def import_safetensors(self, collection: str, path: str | os.PathLike[str], *,
                           message: str | None = None, tier: str | None = None,
                           progress: bool = False, in_place: bool = False,
                           storage_options: Mapping[str, Any] | None = None,
                           resume: bool = False, batch_bytes: int = BATCH_BYTES,
                           pending_ttl: float = PENDING_TTL) -> Commit:
        """Commit a .safetensors file, or a Hugging Face folder with
        model.safetensors.index.json, as one version of ``collection``: read straight
        into the store's extents, headers checked as strictly as safetensors does
        (CorruptData / InvalidInput, and nothing committed, for a bad file).

        ``path`` may be an object URL, ``s3://bucket/prefix/`` (a folder) or
        ``s3://bucket/key.safetensors``, read with parallel ranged GETs;
        ``storage_options`` as fsspec's (``key``, ``secret``, ``endpoint_url``, ...).
        Missing objects are NotFound, denied ones Unauthorized, truncated or changed
        ones CorruptData, an endpoint that stops answering NodeUnavailable; no version
        appears on any of them. What landed stays as a pending import, in batches of
        ``batch_bytes``: ``resume=True`` goes on from it; it expires ``pending_ttl``
        seconds after the import began (a day), and gc then reclaims it.

        ``in_place=True`` (opt-in) commits the local files without copying them: a
        reflinked clone where the filesystem can, else a reference to the files, which
        the caller must keep unchanged. One checksum pass; readers map the page cache.
        A change the store can see (size, mtime, inode on open; the checksum on a
        verifying read) makes the version refuse to be served (CorruptData); a reader
        that mapped the file before a change may see the change (docs/storage.md)."""
        self._check_open()
        if is_object_url(path):
            if in_place:
                raise InvalidInput("an import from object storage cannot be in place",
                                   collection=collection)
            return run_object_import(
                self, self._writer, collection, str(path),
                storage_options=storage_options, message=message, tier=tier,
                progress=progress, resume=resume, batch_bytes=batch_bytes,
                pending_ttl=pending_ttl)
        if storage_options is not None or resume:
            raise InvalidInput(f"storage_options and resume are for object URLs (s3://), "
                               f"not the local path {str(path)!r}", collection=collection)
        return run_import(self, self._commit_in_place, collection, path, message=message,
                          tier=tier, progress=progress, in_place=in_place)

    def export_safetensors(self, collection: str, out_dir: str | os.PathLike[str], *,
                           version: int | None = None, progress: bool = False) -> list[Path]:
        """Write a version as safetensors files (byte-identical to the imported ones,
        with the index of a sharded folder); returns the paths written."""
        self._check_open()
        return run_export(self, self._tiers.marks, collection, out_dir, version=version,
                          progress=progress)

    def checkout(self, collection: str, out_dir: str | os.PathLike[str], *,
                 version: int | None = None, tag: str | None = None) -> Path:
        """Write a version's files (its config, tokenizer, chat templates) into
        ``out_dir`` and a marker, ``tensordb.json``, naming the version and this store:
        an engine started on the folder with ``--load-format tensordb`` reads the
        weights from the store, with no weight file on disk. Returns the folder."""
        self._check_open()
        with self.snapshot(collection, version=version, tag=tag) as snap:
            files = {n: snap.file(n) for n in snap.files()}  # checked: CorruptData
            v = snap.version
        out = Path(out_dir)
        if out.exists() and not out.is_dir():
            raise InvalidInput(f"{out}: exists and is not a folder", collection=collection)
        c = self.config
        marker = {"collection": collection, "version": v, "url": c.catalog_url,
                  "home": str(c.home), "data_dir": str(c.data_dir), "node": c.node}
        out.mkdir(parents=True, exist_ok=True)
        write_files(out, {**files, CHECKOUT_MARKER: json.dumps(marker, indent=2).encode()})
        return out

    def kv(self, namespace: str, block_tokens: int = 256, **opts: Any) -> KVCache:
        """The KV block store of ``namespace`` on this node (one model / KV layout):
        blocks shared by every process of the host, in a pre-faulted shared-memory arena
        with eviction (``eviction="lru"|"s3fifo"``; ``policy=`` is its older name) and
        spill to disk. ``opts``: ``capacity_bytes``, ``eviction``, ``slab_bytes``, ``spill``, ``disk_capacity``,
        ``gpu_capacity`` (a GPU tier of that many bytes on ``Config.gpu_device``, for
        ``get(..., device="cuda")``: copies of hot blocks shared by the host's processes
        through CUDA IPC; also $TENSORDB_KV_GPU_CAPACITY), ``create`` (False: open only a
        namespace this node has opened before, NotFound otherwise, creating nothing)."""
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
        return query.execute(self, text, params)  # the parser loads on first use

    def tensors_arrow(self, result: pa.Table, *, verify: bool = False) -> pa.Table:
        """The tensors a ``query`` result's ``collection``, ``name`` and ``version`` columns
        name, row for row, as ``Snapshot.to_arrow`` gives them (docs/arrow.md)."""
        self._check_open()
        return tensors_arrow(lambda c, v: self.snapshot(c, version=v, verify=verify), result)
