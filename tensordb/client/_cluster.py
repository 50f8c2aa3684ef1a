"""Cluster mode: this node's view of the others, and the bytes it pulls from them.

A read of a segment this node never wrote lands here (``map_replica``): the segment is
pulled from a node that holds it, verified, and registered as a replica. ``replicate``
fans a version out to other nodes as a cascade; ``pull_kv`` fetches KV blocks.

``transport``'s package face is lazy: ``import transport`` costs nothing, and Arrow
Flight (some 50 ms to load) loads on the first use of a name that needs it, so an
embedded store never loads it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch
from sqlalchemy import Engine

import storage_engine as se
import transport
from tensordb.catalog import Catalog, NodeDirectory
from tensordb.config import Config
from tensordb.errors import CorruptData, InvalidInput, NodeUnavailable, NotFound

from ._inputs import check_name
from ._kv_cache import KVCache
from ._placement import Tiers

if TYPE_CHECKING:
    from transport import CascadeReport, Transport

__all__ = ["Cluster"]


class Cluster:
    """This node among the others of the catalog: pulls, replicas and replication."""

    def __init__(self, config: Config, engine: Engine, catalog: Catalog, tiers: Tiers) -> None:
        self._config = config
        self._engine = engine
        self._catalog = catalog
        self._tiers = tiers
        self._nodes: NodeDirectory | None = None
        #: the node-to-node transport, made on first use (or put here before, by tests
        #: that run nodes in-process)
        self.flight: Transport | None = None
        self._kv_pulls: dict[tuple[str, int], KVCache] = {}
        #: what the last replicate() did, for inspection
        self.last_replication: CascadeReport | None = None

    def close(self) -> None:
        if self.flight is not None:
            self.flight.close()

    def directory(self) -> NodeDirectory:
        if self._nodes is None:
            self._nodes = NodeDirectory(self._engine)
        return self._nodes

    def transport(self) -> Transport:
        """The node-to-node transport, built on first use."""
        if self.flight is None:
            ca = transport.read_ca(self._config.tls_ca) if self._config.tls_ca else None
            self.flight = transport.FlightTransport(self._config.token,
                                                    self._config.node_timeout, tls_ca=ca)
        return self.flight

    def pull(self, segment_ids: Iterable[str], prefer: str | None = None) -> dict[str, str]:
        """Pull segments other nodes hold into this node's tiers (verified, then
        registered as replicas); segment id -> local tier."""
        tiers = {n: self._tiers[n] for n in ("host", "disk")}
        return {s: transport.pull_segment(self.directory(), self.transport(),
                                          self._config.node, tiers, s, prefer=prefer,
                                          on_pulled=self._pulled)
                for s in segment_ids}

    def _pulled(self, tier: str, nbytes: int, seconds: float) -> None:
        """One segment copied here: a pull in the host's latency histograms."""
        del tier, nbytes
        self._tiers.latency.observe("pull", seconds)

    def map_replica(self, segment_id: str, collection: str, tensor: str) -> se.SegmentView:
        """A mapping of another node's segment, held here as a replica or pulled now."""
        directory = self.directory()
        for _attempt in (1, 2):
            holders = directory.holders(segment_id)
            if not holders:
                raise NotFound(f"{collection}/{tensor} was removed while being read",
                               collection=collection, tensor=tensor)
            here = holders.get(self._config.node)
            if here is None:
                try:
                    here = self.pull([segment_id])[segment_id]
                except NodeUnavailable as exc:
                    raise NodeUnavailable(f"cannot read {collection}/{tensor}: {exc}",
                                          collection=collection, tensor=tensor,
                                          node=exc.node) from exc
                except NotFound as exc:
                    raise NotFound(f"{collection}/{tensor} was removed while being read",
                                   collection=collection, tensor=tensor) from exc
            try:
                return self._tiers.open(here, segment_id)
            except se.SourceChanged as exc:
                raise CorruptData(f"{collection}/{tensor}: {exc}", collection=collection,
                                  tensor=tensor) from exc
            except se.SegmentMissing:
                # a replica registered here whose file is gone (host memory lost in a
                # reboot): forget it and pull again, once
                directory.drop_replica(segment_id, self._config.node)
        raise CorruptData(f"the replica of {collection}/{tensor} (segment {segment_id}) "
                          f"vanished twice while being read", collection=collection,
                          tensor=tensor)

    def _targets(self, collection: str, targets: list[str]) -> list[str]:
        """The distinct nodes of ``targets``, each checked to be known and live."""
        me = self._config.node
        directory = self.directory()
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
        return targets

    def replicate(self, collection: str, version: int | None, to: Iterable[str]) -> list[str]:
        """Make the ``to`` nodes hold a version (default: the head); returns them. See
        ``Database.replicate``."""
        check_name("collection", collection)
        targets = [to] if isinstance(to, str) else list(to)
        if not targets:
            raise InvalidInput("replicate needs at least one target node", collection=collection)
        info, v = self._catalog.resolve(collection, version, None)
        targets = self._targets(collection, targets)
        directory = self.directory()
        segs = [sid for sid, _ in directory.version_segments(info.id, v)]
        held = directory.held_by(segs)
        if all(t in held[s] for s in segs for t in targets):
            return targets

        def pull_here(missing: Iterable[str], source: str | None) -> None:
            self.pull(missing, source)

        report = transport.cascade(directory, self.transport(), self._config.node, segs,
                                   targets, pull_here)
        self.last_replication = report
        if report.failed:
            node, why = next(iter(report.failed.items()))
            raise NodeUnavailable(f"replicating {collection} v{v} to {node!r} failed: {why}",
                                  collection=collection, version=v, node=node)
        return targets

    def pull_kv(self, namespace: str, keys: Iterable[bytes], block_tokens: int,
                nodes: Iterable[str] | None, open_kv: Callable[[str, int], KVCache]) -> int:
        """Fetch the KV blocks of ``keys`` this node lacks from other live nodes; returns
        how many arrived. ``open_kv(namespace, block_tokens)`` opens this node's namespace
        for them (once; the cache is kept for later pulls). See ``Database.pull_kv``."""
        wanted = list(keys)
        if not all(isinstance(k, bytes) and k for k in wanted):
            raise InvalidInput("keys must be non-empty bytes (from kv.keys)", collection=namespace)
        cache = self._kv_pulls.get((namespace, block_tokens))
        if cache is None:
            cache = self._kv_pulls[(namespace, block_tokens)] = open_kv(namespace, block_tokens)
        missing = [k for k, held in zip(wanted, cache.contains(wanted), strict=True) if not held]
        directory = self.directory()
        live = directory.live()
        sources = (list(nodes) if nodes is not None
                   else [n for n in directory.kv_nodes(namespace) if n != self._config.node])
        got = 0
        for node in sources:
            if not missing:
                break
            if node not in live:
                continue
            try:
                names = self._fetch_kv(cache, node, live[node].address or "", namespace,
                                       block_tokens, missing)
            except NotFound:  # the node never opened the namespace: a miss
                continue
            got += len(names)
            arrived = set(names)
            missing = [k for k in missing if k not in arrived]
        return got

    def _fetch_kv(self, cache: KVCache, node: str, address: str, namespace: str,
                  block_tokens: int, keys: list[bytes]) -> list[bytes]:
        """Read ``keys`` from ``node``, verify each block and put it in ``cache``; the keys
        that arrived.

        The peer is trusted with nothing: a block under a key that was not asked for
        (or twice), a dtype that is no torch dtype, a shape whose size is not the
        block's bytes, or bytes that fail their checksum make the whole answer
        CorruptData, and none of it is kept."""
        blocks = self.transport().read_kv(node, address, namespace, block_tokens, keys)
        asked = set(keys)
        tensors: list[torch.Tensor] = []
        names: list[bytes] = []
        for key, dtype, shape, data, digest_ in blocks:
            def bad(why: str, key: object = key) -> CorruptData:
                shown = key.hex()[:64] if isinstance(key, bytes) else repr(key)[:64]
                return CorruptData(f"KV block {shown} of {namespace!r} from node {node!r} "
                                   f"{why}; nothing of the answer kept",
                                   collection=namespace, node=node)

            if not isinstance(key, bytes) or key not in asked:
                raise bad("was never asked for")
            asked.discard(key)  # a second block under one key is not asked for either
            torch_dtype = getattr(torch, dtype, None) if isinstance(dtype, str) \
                and dtype.isidentifier() and not dtype.startswith("_") else None
            if not isinstance(torch_dtype, torch.dtype):
                raise bad(f"has dtype {str(dtype)[:40]!r}, which is no torch dtype")
            numel = span = 1
            for d in shape:
                numel *= d
                span *= max(d, 1)
            if span > 2**63 - 1:
                raise bad(f"has shape {list(shape)[:8]}, whose size overflows int64")
            if numel == 0:  # the store holds no empty block (its put refuses one)
                raise bad(f"is empty (shape {list(shape)[:8]})")
            if numel * torch_dtype.itemsize != data.nbytes:
                raise bad(f"has {data.nbytes} bytes, not the {numel * torch_dtype.itemsize} "
                          f"its {str(dtype)} shape {list(shape)[:8]} needs")
            if se.checksum(data) != digest_:
                raise bad("fails its checksum")
            tensors.append(torch.from_numpy(data.copy()).view(torch_dtype).reshape(shape))
            names.append(key)
        if names:
            cache.put(names, tensors)
        return names
