"""The write path: a transaction's puts and deletes, published as one commit.

A put equal to the head's tensor is not stored again (it keeps sharing the head's
extent); the others are packed into one new segment, filled by the I/O pool in one
copy-and-checksum pass, and the segment is registered by the same SQL transaction that
publishes the commit. Bytes are written (and synced, on disk) before that commit.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

import torch

import storage_engine as se
from tensordb.catalog import Catalog, Commit, NewTensor, TensorRow
from tensordb.errors import NotFound, StoreFull

from ._inputs import dtype_name
from ._notify import Notifier
from ._placement import Tiers
from ._transaction import RawPut, digest, source

__all__ = ["Writer"]

_EMPTY_CHECKSUM = se.checksum(b"")
#: bytes compared at a tensor's start, then at its middle and end
_SAMPLE = 64


def _fill(writer: se.SegmentWriter, stored: list[tuple[str, torch.Tensor | RawPut]],
          offsets: list[int], sizes: list[int]) -> dict[str, str]:
    """Copy the stored tensors into the segment and return their checksums by name.

    Contiguous tensors go in one native call per I/O thread, straight from their
    memory (``fill_from_addresses``; the transaction holds them until the commit ends);
    the rest (strided tensors, ``put_raw`` fills) through their own ``Source``."""
    batch: list[int] = []
    addresses: list[int] = []
    other: list[int] = []
    for i, (_, t) in enumerate(stored):
        if se.BATCH_FILL and not isinstance(t, RawPut) and t.is_contiguous():
            batch.append(i)
            addresses.append(t.data_ptr())
        else:
            other.append(i)
    sums: list[str] = [""] * len(stored)
    if batch:
        got = se.fill_from_addresses(writer, addresses, [offsets[i] for i in batch],
                                     [sizes[i] for i in batch])
        for i, s in zip(batch, got, strict=True):
            sums[i] = s
    if other:
        got = se.fill_segment(writer, [source(stored[i][1]) for i in other],
                              [offsets[i] for i in other], [sizes[i] for i in other])
        for i, s in zip(other, got, strict=True):
            sums[i] = s
    return {n: s for (n, _), s in zip(stored, sums, strict=True)}


class Writer:
    """Publishes commits of this node: dedupe against the head, fill a segment of
    ``tiers``, commit in ``catalog``, then tell watchers through ``notifier``."""

    def __init__(self, catalog: Catalog, tiers: Tiers, notifier: Notifier, *,
                 default_tier: str, workers: int) -> None:
        self.catalog = catalog
        self.tiers = tiers
        self.default_tier = default_tier
        self._notifier = notifier
        self._workers = workers

    def head(self, collection: str) -> int:
        """The version a transaction starts from (0 for a new collection)."""
        info = self.catalog.info(collection)
        return info.head if info else 0

    def publish(self, collection: str, base: int, puts: Mapping[str, torch.Tensor | RawPut],
                deletes: set[str], message: str | None, tier_name: str,
                meta: dict[str, str] | None) -> Commit:
        with se.gc_paused():  # a row object per tensor: see gc_paused
            result = self._publish(collection, base, puts, deletes, message, tier_name, meta)
        self._notifier.publish(collection, result.version)
        return result

    def _publish(self, collection: str, base: int, puts: Mapping[str, torch.Tensor | RawPut],
                 deletes: set[str], message: str | None, tier_name: str,
                 meta: dict[str, str] | None) -> Commit:
        info = self.catalog.info(collection)
        # the head's rows of the names this commit touches, not the whole head: a commit
        # of k tensors reads k rows whatever the collection's size
        live = (self.catalog.live(info.id, [*puts, *deletes])
                if info is not None and info.head else {})
        for name in sorted(deletes):
            if name not in live:
                raise NotFound(f"cannot delete {name!r}: collection {collection!r} has no such "
                               f"tensor", collection=collection, tensor=name)
        unchanged = self._unchanged(puts, live) if live else []
        skip = set(unchanged)
        changed = [(n, t) for n, t in puts.items() if n not in skip]
        stored = [(n, t) for n, t in changed if t.nbytes > 0]
        sizes = [t.nbytes for _, t in stored]
        offsets, total = se.pack(sizes)
        tier = self.tiers.tier(tier_name)
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
                checksums = _fill(writer, stored, offsets, sizes)
                writer.finish()
            where = dict(zip((n for n, _ in stored), offsets, strict=True))
            sid = writer.segment_id if writer is not None else None
            new = [NewTensor(n, dtype_name(t.dtype), tuple(t.shape), t.nbytes,
                             checksums.get(n, _EMPTY_CHECKSUM),
                             sid if n in where else None, where.get(n, 0))
                   for n, t in changed]
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
        return result

    def _unchanged(self, puts: Mapping[str, Any], live: Mapping[str, TensorRow]) -> list[str]:
        """The puts whose bytes equal the head's tensor of that name: same dtype, shape,
        sampled bytes and digest."""
        candidates = [n for n, t in puts.items()
                      if not isinstance(t, RawPut)
                      and (row := live.get(n)) is not None and row.nbytes == t.nbytes
                      and row.dtype == dtype_name(t.dtype) and row.shape == tuple(t.shape)]
        candidates = self._sampled_equal(puts, live, candidates)
        if not candidates:
            return []
        pool = se.io_pool()
        step = max(1, -(-len(candidates) // self._workers))
        batches = [candidates[i : i + step] for i in range(0, len(candidates), step)]
        digests = [d for batch in pool.map(lambda b: [digest(puts[n]) for n in b], batches)
                   for d in batch]
        return [n for n, d in zip(candidates, digests, strict=True) if d == live[n].checksum]

    def _sampled_equal(self, puts: Mapping[str, Any], live: Mapping[str, TensorRow],
                       names: list[str]) -> list[str]:
        """The names whose tensor may equal the head's: a few bytes at its start (then,
        for those equal there, at its middle and end) are compared with the head's
        extent first, so a changed tensor (every tensor of a weight update) costs one
        small read, no full digest. Where the head's bytes are not cheaply readable
        here, the name stays a candidate (the digest decides)."""
        left = list(names)
        for spots in ((0.0,), (0.5, 1.0)):
            left = self._differ_at(puts, live, left, spots, _SAMPLE)
        return left

    def _differ_at(self, puts: Mapping[str, Any], live: Mapping[str, TensorRow],
                   names: list[str], spots: tuple[float, ...], k: int) -> list[str]:
        """``names`` less those whose bytes differ from the head's at ``spots`` (0: the
        start, 0.5: the middle, 1: the end; ``k`` bytes each)."""
        by_segment: dict[tuple[str, str], list[str]] = {}
        for n in names:
            row = live[n]
            if row.segment_id is not None and row.tier is not None \
                    and row.tier in self.tiers and puts[n].is_contiguous() and row.nbytes > 0:
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
                got = self.tiers[tier].peek(segment_id, ranges)
            except se.SegmentMissing:
                got = None
            if got is None:
                continue
            pos = 0
            for n, mine in zip(group, spans, strict=True):
                flat = puts[n].reshape(-1).view(torch.uint8).numpy()
                for o, m in mine:
                    if got[pos] != flat[o : o + m].tobytes():
                        differ.add(n)
                    pos += 1
        return [n for n in names if n not in differ]
