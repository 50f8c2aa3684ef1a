"""The read path: catalog rows to zero-copy tensors, or to the caller's own buffers.

Each read maps the row's segment privately (copy-on-write, so a reader's writes never
reach the store or another snapshot of the same process) and hands out strided views
of it; GPU-tier rows are views of the segment's CUDA IPC mapping. A segment that moved
tier meanwhile is followed there; one this node never wrote comes from ``Cluster``.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from functools import lru_cache

import numpy as np
import torch

import storage_engine as se
from tensordb.arrow import refuse, truncated
from tensordb.catalog import Catalog, ShardRow, TensorRow, box_copies
from tensordb.errors import CorruptData, NodeUnavailable, NotFound

from ._cluster import Cluster
from ._inputs import check_name, torch_dtype
from ._placement import Tiers, source_changed

__all__ = ["Reader"]


def _corrupt(collection: str, tensor: str, expected: str, found: str) -> CorruptData:
    """The error of a read whose bytes fail the catalog's checksum."""
    return CorruptData(f"{collection}/{tensor}: stored bytes fail their checksum (expected "
                       f"{expected}, found {found}); not served", collection=collection,
                       tensor=tensor)


def _shard_name(name: str, shard: ShardRow) -> str:
    """How a shard of ``name`` is named in errors (as ``verify`` names it)."""
    return f"{name} (shard at {list(shard.offsets)})"


@lru_cache(maxsize=4096)
def _strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Contiguous strides of ``shape``, in elements."""
    out, acc = [], 1
    for d in reversed(shape):
        out.append(acc)
        acc *= d
    return tuple(reversed(out))


class Reader:
    """Reads rows of ``catalog`` from this node's ``tiers`` (or, for segments other nodes
    wrote, through ``cluster``)."""

    def __init__(self, catalog: Catalog, tiers: Tiers, cluster: Cluster) -> None:
        self.catalog = catalog
        self._tiers = tiers
        self._cluster = cluster

    def get(self, collection: str, name: str, version: int | None, tag: str | None,
            verify: bool) -> torch.Tensor:
        """One tensor of the head (or of ``version`` / ``tag``), zero-copy."""
        check_name("collection", collection)
        check_name("tensor", name, collection=collection)
        info, v = self.catalog.resolve(collection, version, tag)
        rows = self.catalog.manifest(info.id, v, [name])
        if not rows:
            raise NotFound(f"collection {collection!r} version {v} has no tensor {name!r}",
                           collection=collection, tensor=name, version=v)
        return self.materialize(collection, rows, verify=verify)[name]

    def marks_generation(self) -> int:
        """The host's count of corrupt marks so far: a look-up made when it was lower
        must look at the marks again (a load from a shared mapping)."""
        return self._tiers.marks.generation()

    def marks_counter(self) -> memoryview | None:
        """The shared counter as a one-item view (``view[0]``: ``marks_generation``
        now), the cheapest look there is, for a snapshot that looks on every access to
        a tensor it made; None where there is no such view (``marks_generation``)."""
        return self._tiers.marks.counter()

    def marked(self, segment_id: str) -> dict[int, str] | None:
        """The segment's extents marked corrupt (offset -> why), by any process of the
        host; None when none is. Read once per segment per read."""
        return self._tiers.marks.corrupt(segment_id)

    @staticmethod
    def refuse(collection: str, tensor: str, segment_id: str, offset: int,
               bad: Mapping[int, str] | None) -> None:
        """CorruptData when the extent at ``offset`` is among the marked ``bad`` ones:
        no read begun after the mark returns its bytes (``tensordb.arrow.refuse``, which
        every read path shares, plain Flight's included)."""
        if bad:
            refuse(collection, tensor, segment_id, offset, 0, None, bad)

    def checked_bytes(self, collection: str, row: TensorRow, view: se.SegmentView, *,
                      verify: bool, bad: Mapping[int, str] | None) -> np.ndarray:
        """A row's bytes in ``view`` (its segment's mapping), refused when they lie past
        the end of the file (truncated) or are marked corrupt (``bad``: the segment's
        marks), and checked against the checksum when ``verify``."""
        assert row.segment_id is not None
        if row.offset + row.nbytes > len(view):
            raise truncated(collection, row.name, row.segment_id, row.offset + row.nbytes,
                            len(view))
        self.refuse(collection, row.name, row.segment_id, row.offset, bad)
        data = view.host_bytes(row.offset, row.nbytes)
        if verify:
            self._check_extent(collection, row.name, row.segment_id, view, row.offset,
                               row.nbytes, row.checksum)
        return data

    def map(self, segment_id: str, tier: str, collection: str, tensor: str) -> se.SegmentView:
        # a fresh private mapping per read: a reader's writes into one snapshot's tensors
        # must not show through another snapshot in the same process (GPU views are
        # shared, read-only by convention)
        try:
            return self._tiers.open(tier, segment_id)
        except se.GpuError as exc:
            raise NodeUnavailable(f"cannot map {collection}/{tensor} from the GPU tier: {exc}",
                                  collection=collection, tensor=tensor) from exc
        except se.SourceChanged as exc:  # committed in place, and the file changed since
            raise source_changed(exc, collection, tensor) from exc
        except se.SegmentMissing as exc:
            moved_to = self.catalog.segment_tier(segment_id)
            if moved_to is not None and moved_to != tier:  # evicted or promoted meanwhile
                return self.map(segment_id, moved_to, collection, tensor)
            if moved_to is not None:
                raise CorruptData(
                    f"the bytes of {collection}/{tensor} (segment {segment_id}) are "
                    f"missing from the {tier} tier", collection=collection,
                    tensor=tensor) from exc
            # not written here: another node's segment, held here as a replica or
            # pulled now (cluster mode)
            return self._cluster.map_replica(segment_id, collection, tensor)

    def shards(self, collection: str, rows: Sequence[TensorRow]) -> dict[str, list[ShardRow]]:
        """The shards of sharded rows (no segment, some bytes) of ``collection``."""
        info = self.catalog.info(collection)
        if info is None:
            raise NotFound(f"no collection {collection!r}", collection=collection)
        return self.catalog.shards(info.id, rows)

    def shard_view(self, collection: str, row: TensorRow, shard: ShardRow, *, verify: bool,
                   maps: dict[str, se.SegmentView]) -> torch.Tensor:
        """One shard of a sharded row, zero-copy (a row of its own, as ``materialize``
        makes it)."""
        name = _shard_name(row.name, shard)
        pseudo = TensorRow(name, row.dtype, shard.shape, shard.nbytes, shard.checksum,
                           shard.segment_id, shard.offset, shard.tier, row.first_version)
        return self.materialize(collection, [pseudo], verify=verify, maps=maps)[name]

    def region(self, collection: str, row: TensorRow, shards: Sequence[ShardRow],
               offsets: Sequence[int], shape: Sequence[int], *, verify: bool,
               maps: dict[str, se.SegmentView]) -> torch.Tensor:
        """The box ``offsets`` + ``shape`` of a sharded row: a zero-copy view when one
        shard holds it all, else a new tensor filled from the shards that meet it (only
        their bytes in the box are read)."""
        for sh in shards:
            if all(so <= o and o + n <= so + sn for so, sn, o, n
                   in zip(sh.offsets, sh.shape, offsets, shape, strict=True)):
                view = self.shard_view(collection, row, sh, verify=verify, maps=maps)
                return view[tuple(slice(o - so, o - so + n) for so, o, n
                                  in zip(sh.offsets, offsets, shape, strict=True))]
        out = torch.empty(tuple(shape), dtype=torch_dtype(row.dtype))
        for i, src, dst in box_copies([(sh.offsets, sh.shape) for sh in shards], offsets,
                                      shape):
            view = self.shard_view(collection, row, shards[i], verify=verify, maps=maps)
            out[dst].copy_(view[src])
        return out

    def _segment(self, segment_id: str, tier: str | None, collection: str, name: str,
                 maps: dict[str, se.SegmentView], bad: dict[str, dict[int, str]]
                 ) -> se.SegmentView:
        """The segment's view (mapped now, or this snapshot's earlier mapping), its
        corrupt marks looked at (a mark made after the mapping still refuses the extents
        it names; ``bad`` collects the segments that have some)."""
        mm = maps.get(segment_id)
        if mm is None:
            mm = maps[segment_id] = self.map(segment_id, tier or "host", collection, name)
        marks = self.marked(segment_id)
        if marks:
            bad[segment_id] = marks
        return mm

    def _check_extent(self, collection: str, name: str, segment_id: str,
                      mm: se.SegmentView, offset: int, nbytes: int, csum: str) -> None:
        """CorruptData unless the extent matches its checksum; a failure is marked, so
        reads that do not verify refuse the segment from now on."""
        if offset + nbytes > len(mm):
            raise truncated(collection, name, segment_id, offset + nbytes, len(mm))
        got = se.checksum(mm.host_bytes(offset, nbytes))  # no copy on the host
        if got != csum:
            self._tiers.marks.mark_corrupt(segment_id, offset,
                                           f"{collection}/{name}: checksum {got} != {csum}")
            raise _corrupt(collection, name, csum, got)

    def materialize(self, collection: str, rows: Iterable[TensorRow], *, verify: bool,
                    maps: dict[str, se.SegmentView] | None = None,
                    shards: Mapping[str, list[ShardRow]] | None = None
                    ) -> dict[str, torch.Tensor]:
        """``_materialize``, timed: one read in the host's latency histograms."""
        t0 = time.perf_counter()
        out = self._materialize(collection, rows, verify=verify, maps=maps, shards=shards)
        self._tiers.latency.observe("read", time.perf_counter() - t0)
        return out

    def _materialize(self, collection: str, rows: Iterable[TensorRow], *, verify: bool,
                     maps: dict[str, se.SegmentView] | None = None,
                     shards: Mapping[str, list[ShardRow]] | None = None
                     ) -> dict[str, torch.Tensor]:
        """Zero-copy tensors over the segments' copy-on-write mappings (``maps``: the
        mappings already made for this snapshot). A sharded row is assembled into a new
        tensor from its shards (``shards``: those known already, by name)."""
        out: dict[str, torch.Tensor] = {}
        maps = {} if maps is None else maps
        sharded: list[TensorRow] = []
        bases: dict[tuple[str, str], tuple[torch.Tensor, int]] = {}
        bad: dict[str, dict[int, str]] = {}  # segments with extents marked corrupt
        name, segment_id, offset, nbytes = "", None, 0, 0
        try:
            # a fresh process's state_dict of a whole model runs this per tensor: fields
            # are unpacked once, not read through the row's attributes (a fifth of its
            # time); the checks of the integrity model cost nothing per row where no
            # mark is (a truncated segment surfaces as torch's bounds error, below)
            for name, dtype, shape, nbytes, csum, segment_id, offset, tier, first in rows:
                if segment_id is None:  # a sharded row (assembled below), or no bytes
                    if nbytes:
                        sharded.append(TensorRow(name, dtype, shape, nbytes, csum,
                                                 segment_id, offset, tier, first))
                    else:
                        out[name] = torch.empty(shape, dtype=torch_dtype(dtype))
                    continue
                found = bases.get((segment_id, dtype))
                if found is not None and offset % found[1]:
                    found = None  # an odd offset (a file committed in place): its own base
                if found is None or verify:
                    mm = self._segment(segment_id, tier, collection, name, maps, bad)
                    if verify:
                        self._check_extent(collection, name, segment_id, mm, offset, nbytes,
                                           csum)
                if bad:
                    self.refuse(collection, name, segment_id, offset, bad.get(segment_id))
                if found is None:
                    dt = torch_dtype(dtype)
                    size = dt.itemsize
                    if mm.on_device:  # the IPC mapping itself: no copy
                        base = torch.as_tensor(mm, device=f"cuda:{mm.device}").view(dt)
                    elif offset % size or len(mm) % size:
                        # a segment committed in place is the user's file: its tensors
                        # lie where the file put them, and its length is the file's
                        skew = offset % size
                        base = torch.frombuffer(mm, dtype=dt,
                                                count=(len(mm) - skew) // size, offset=skew)
                        if not skew:
                            bases[(segment_id, dtype)] = (base, size)
                        out[name] = base.as_strided(shape, _strides(shape), offset // size)
                        continue
                    else:
                        base = torch.frombuffer(mm, dtype=dt)
                    found = bases[(segment_id, dtype)] = (base, size)
                base, size = found
                out[name] = base.as_strided(shape, _strides(shape), offset // size)
        except (RuntimeError, ValueError) as exc:
            view = maps.get(segment_id or "")
            if view is None or offset + nbytes <= len(view):
                raise
            raise truncated(collection, name, segment_id or "", offset + nbytes,
                            len(view)) from exc  # the file was truncated
        if sharded:
            self._assemble(collection, sharded, shards or {}, verify, maps, out)
        return out

    def _assemble(self, collection: str, rows: Sequence[TensorRow],
                  known: Mapping[str, list[ShardRow]], verify: bool,
                  maps: dict[str, se.SegmentView], out: dict[str, torch.Tensor]) -> None:
        """Sharded ``rows`` assembled into ``out`` (``known``: shards already looked up):
        every shard's view made in one ``materialize`` (one base per segment), then one
        copy per shard."""
        lack = [r for r in rows if r.name not in known]
        found = {**known, **self.shards(collection, lack)} if lack else known
        pseudo: list[TensorRow] = []
        for r in rows:
            parts = found.get(r.name)
            if not parts:
                raise CorruptData(f"{collection}/{r.name}: the catalog lost the shards of "
                                  f"this sharded tensor", collection=collection, tensor=r.name)
            pseudo.extend(TensorRow(_shard_name(r.name, sh), r.dtype, sh.shape, sh.nbytes,
                                    sh.checksum, sh.segment_id, sh.offset, sh.tier,
                                    r.first_version) for sh in parts)
        views = self.materialize(collection, pseudo, verify=verify, maps=maps)
        for r in rows:
            parts = found[r.name]
            t = torch.empty(r.shape, dtype=torch_dtype(r.dtype))
            for i, src, dst in box_copies([(sh.offsets, sh.shape) for sh in parts],
                                          (0,) * len(r.shape), r.shape):
                t[dst].copy_(views[_shard_name(r.name, parts[i])][src])
            out[r.name] = t

    def read_into(self, collection: str, pairs: list[tuple[TensorRow, np.ndarray]], *,
                  verify: bool) -> list[TensorRow]:
        """Kernel reads of rows' bytes into caller buffers (uint8, contiguous), grouped by
        segment; returns the rows whose tier could not (the caller copies those from a
        mapping). Verified against the catalog's checksums when ``verify``."""
        by_segment: dict[tuple[str, str], list[tuple[TensorRow, np.ndarray]]] = {}
        left: list[TensorRow] = []
        for row, out in pairs:
            if row.segment_id is None or row.nbytes == 0:
                if row.nbytes:  # sharded: assembled from a mapping by the caller
                    left.append(row)
                continue
            by_segment.setdefault((row.segment_id, row.tier or "host"), []).append((row, out))
        for (segment_id, tier), group in by_segment.items():
            try:
                done = tier in self._tiers and self._tiers[tier].read_into(
                    segment_id, [(r.offset, out) for r, out in group])
            except se.SegmentMissing:
                done = False  # moved or remote meanwhile: the mapping path finds it
            except se.SourceChanged as exc:  # a changed in-place file, or marked corrupt
                raise source_changed(exc, collection, group[0][0].name) from exc
            if not done:
                left.extend(r for r, _ in group)
                continue
            bad = self.marked(segment_id)  # after the read: a first open may have marked
            for r, _ in group:
                self.refuse(collection, r.name, segment_id, r.offset, bad)
            if verify:
                for r, out in group:
                    got = se.checksum(out)
                    if got != r.checksum:
                        raise _corrupt(collection, r.name, r.checksum, got)
        return left
