"""The write path: a transaction's puts and deletes, published as one commit.

A put equal to the head's tensor is not stored again (it keeps sharing the head's
extent); the others are packed into one new segment, filled by the I/O pool in one
copy-and-checksum pass, and the segment is registered by the same SQL transaction that
publishes the commit. Bytes are written (and synced, on disk) before that commit.
"""

from __future__ import annotations

import mmap
import os
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch

import storage_engine as se
from tensordb.catalog import (
    Catalog,
    Commit,
    GroupPart,
    NewSegment,
    NewShard,
    NewTensor,
    PartShard,
    TensorRow,
    check_tiling,
    combined_checksum,
)
from tensordb.errors import CorruptData, GroupAborted, InvalidInput, NotFound, StoreFull

from ._inputs import dtype_name
from ._model_files import FILES_ROW
from ._notify import Notifier
from ._placement import Tiers
from ._puts import Extents, FileRange, GroupSpec, RawPut, ShardPut, digest, source

__all__ = ["InPlaceFile", "Writer"]

_EMPTY_CHECKSUM = se.checksum(b"")
#: bytes compared at a tensor's start, then at its middle and end
_SAMPLE = 64


def _fill(writer: se.SegmentWriter, stored: list[tuple[str, torch.Tensor | RawPut]],
          offsets: list[int], sizes: list[int]) -> dict[str, str]:
    """Copy the stored tensors into the segment and return their checksums by name.

    Contiguous tensors go in one native call per I/O thread, straight from their
    memory (``fill_from_addresses``; the transaction holds them until the commit ends);
    byte ranges of files (an import) likewise from the files (``fill_from_file``); the
    rest (strided tensors, ``put_raw`` fills) through their own ``Source``. A fresh
    segment file is written through its descriptor rather than a mapping (``se``'s
    ``write_fd``). StoreFull when the tier fills up meanwhile."""
    batch, files, many, other = _by_kind(stored)
    addresses = [cast(torch.Tensor, stored[i][1]).data_ptr() for i in batch]
    sums: list[str] = [""] * len(stored)
    if batch:
        got = se.fill_from_addresses(writer, addresses, [offsets[i] for i in batch],
                                     [sizes[i] for i in batch])
        for i, s in zip(batch, got, strict=True):
            sums[i] = s
    for fd, idx in files.items():
        for part in _batches(idx, sizes):
            ranges = [cast(FileRange, cast(RawPut, stored[i][1]).file) for i in part]
            got = se.fill_from_file(writer, fd, [r.offset for r in ranges],
                                    [offsets[i] for i in part], [sizes[i] for i in part])
            for i, r, s in zip(part, ranges, got, strict=True):
                if not s:
                    name = stored[i][0]
                    raise CorruptData(f"{r.path}: the file shrank while tensor {name!r} was "
                                      f"read (it ends inside its {sizes[i]:,} bytes)",
                                      tensor=name)
                sums[i] = s
                r.advance(sizes[i])
    for idx in many.values():
        for i, s in zip(idx, _fill_many(writer, [cast(RawPut, stored[i][1]) for i in idx],
                                        [offsets[i] for i in idx], [sizes[i] for i in idx]),
                        strict=True):
            sums[i] = s
    if other:
        got = se.fill_segment(writer, [source(stored[i][1]) for i in other],
                              [offsets[i] for i in other], [sizes[i] for i in other])
        for i, s in zip(other, got, strict=True):
            sums[i] = s
    return {n: s for (n, _), s in zip(stored, sums, strict=True)}


def _by_kind(stored: list[tuple[str, torch.Tensor | RawPut]]
             ) -> tuple[list[int], dict[int, list[int]], dict[int, list[int]], list[int]]:
    """The indices of ``stored`` by how they are filled: contiguous tensors (from their
    memory), file ranges by descriptor, ``many`` fills by their fill, the rest."""
    batch: list[int] = []
    files: dict[int, list[int]] = {}
    many: dict[int, list[int]] = {}
    other: list[int] = []
    for i, (_, t) in enumerate(stored):
        if isinstance(t, RawPut):
            if t.many is not None:
                many.setdefault(id(t.many), []).append(i)
            elif t.file is not None:
                files.setdefault(t.file.fd, []).append(i)
            else:
                other.append(i)
        elif se.BATCH_FILL and t.is_contiguous():
            batch.append(i)
        else:
            other.append(i)
    return batch, files, many, other


def _fill_many(writer: se.SegmentWriter, puts: list[RawPut], offsets: list[int],
               sizes: list[int]) -> list[str]:
    """Puts of one ``many`` fill: one call fills every extent, its own work (an object
    store's GETs) in flight at once; their checksums."""
    fill = puts[0].many
    assert fill is not None
    return fill([(p.tag, o, n) for p, o, n in zip(puts, offsets, sizes, strict=True)],
                Extents(writer))


#: bytes of file ranges read per ``fill_from_file`` call: a progress bar moves at each
_FILE_BATCH = 256 << 20


def _batches(idx: list[int], sizes: list[int]) -> list[list[int]]:
    """``idx`` in runs of about ``_FILE_BATCH`` bytes."""
    out: list[list[int]] = [[]]
    held = 0
    for i in idx:
        if out[-1] and held + sizes[i] > _FILE_BATCH:
            out.append([])
            held = 0
        out[-1].append(i)
        held += sizes[i]
    return out


def _check_fits(collection: str, tier: se.Tier, puts: Mapping[str, torch.Tensor | RawPut],
                sharded: Mapping[str, list[ShardPut]], live: Mapping[str, TensorRow]) -> None:
    """StoreFull, before any byte is read or copied, when the tensors that cannot be
    unchanged (no head row of their name, dtype and shape) hold more than the tier's
    capacity: hashing an expanded tensor of 10**9 elements to find it changed, then
    refusing it, cost seconds and its size in memory."""
    capacity = getattr(tier, "capacity", None)
    if capacity is None:
        return
    new = sum(p.tensor.nbytes for parts in sharded.values() for p in parts)
    for n, t in puts.items():
        row = live.get(n)
        if row is None or isinstance(t, RawPut) or row.nbytes != t.nbytes \
                or row.shape != tuple(t.shape):
            new += t.nbytes
    if new > capacity:
        raise StoreFull(f"cannot commit {new} bytes to {collection!r}: the {tier.name} tier "
                        f"holds at most {capacity}; commit to the disk tier",
                        collection=collection)


def _shard_key(name: str, i: int) -> str:
    """The key of shard ``i`` of ``name`` among a segment's stored items (no tensor name
    holds a NUL)."""
    return f"{name}\x00{i}"


def _whole_shards(collection: str, puts: Mapping[str, torch.Tensor | RawPut],
                  shards: Mapping[str, list[ShardPut]]
                  ) -> tuple[Mapping[str, torch.Tensor | RawPut], dict[str, list[ShardPut]]]:
    """A transaction's shards checked (each name's tile its global shape) and split: a
    name of one shard that covers it is an ordinary put; the others stay sharded."""
    if not shards:
        return puts, {}
    out = dict(puts)
    sharded: dict[str, list[ShardPut]] = {}
    for name, parts in shards.items():
        why = check_tiling(name, parts[0].global_shape,
                           [(0, p.offsets, tuple(p.tensor.shape)) for p in parts])
        if why is not None:
            raise InvalidInput(why, collection=collection, tensor=name)
        full = [p for p in parts if tuple(p.tensor.shape) == p.global_shape]
        if full:  # tiled, so the only shard with elements: an ordinary row
            out[name] = full[0].tensor
            continue
        sharded[name] = parts
    return out, sharded


@dataclass(frozen=True, slots=True)
class InPlaceFile:
    """A local file to commit in place: ``fd`` open on it (at absolute ``path``), and its
    tensors as (name, dtype, shape, offset in the file, nbytes)."""

    path: str
    fd: int
    tensors: Sequence[tuple[str, torch.dtype, tuple[int, ...], int, int]]
    #: the file's size when its header was read (its tensors tile it exactly)
    nbytes: int


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

    def _live(self, collection: str, names: Sequence[str],
              deletes: set[str]) -> dict[str, TensorRow]:
        """The head's rows of ``names`` and ``deletes``, after checking every name to
        delete is one of them."""
        info = self.catalog.info(collection)
        # the head's rows of the names this commit touches, not the whole head: a commit
        # of k tensors reads k rows whatever the collection's size
        live = (self.catalog.live(info.id, [*names, *deletes])
                if info is not None and info.head else {})
        if FILES_ROW in deletes and FILES_ROW not in live:  # no files to drop: nothing to do
            deletes.discard(FILES_ROW)
        for name in sorted(deletes):
            if name not in live:
                raise NotFound(f"cannot delete {name!r}: collection {collection!r} has no such "
                               f"tensor", collection=collection, tensor=name)
        return live

    def publish(self, collection: str, base: int, puts: Mapping[str, torch.Tensor | RawPut],
                deletes: set[str], message: str | None, tier_name: str,
                meta: dict[str, str] | None,
                shards: Mapping[str, list[ShardPut]] | None = None) -> Commit:
        with se.gc_paused():  # a row object per tensor: see gc_paused
            result = self._publish(collection, base, puts, deletes, message, tier_name, meta,
                                   shards or {})
        self._notifier.publish(collection, result.version)
        self.catalog.start_background()  # after the commit's last step, not beside it
        return result

    def _publish(self, collection: str, base: int, puts: Mapping[str, torch.Tensor | RawPut],
                 deletes: set[str], message: str | None, tier_name: str,
                 meta: dict[str, str] | None, shards: Mapping[str, list[ShardPut]]) -> Commit:
        puts, sharded = _whole_shards(collection, puts, shards)
        live = self._live(collection, [*puts, *sharded], deletes)
        tier = self.tiers.tier(tier_name)
        _check_fits(collection, tier, puts, sharded, live)
        unchanged = self._unchanged(puts, live) if live else []
        skip = set(unchanged)
        changed = [(n, t) for n, t in puts.items() if n not in skip]
        stored: list[tuple[str, torch.Tensor | RawPut]] = [
            (n, t) for n, t in changed if t.nbytes > 0]
        stored += [(_shard_key(n, i), p.tensor) for n, parts in sharded.items()
                   for i, p in enumerate(parts) if p.tensor.nbytes > 0]
        writer, checksums, where, total = self._write_segment(collection, tier, stored)
        try:
            sid = writer.segment_id if writer is not None else None
            new = [NewTensor(n, dtype_name(t.dtype), tuple(t.shape), t.nbytes,
                             checksums.get(n, _EMPTY_CHECKSUM),
                             sid if n in where else None, where.get(n, 0))
                   for n, t in changed]
            new_shards: list[NewShard] = []
            for n, parts in sharded.items():
                mine = [NewShard(n, i, 0, p.offsets, tuple(p.tensor.shape), p.tensor.nbytes,
                                 checksums[k], sid, where[k])
                        for i, p in enumerate(parts)
                        if (k := _shard_key(n, i)) in where]
                mine.sort(key=lambda x: x.offsets)
                mine = [x._replace(idx=i) for i, x in enumerate(mine)]
                new.append(NewTensor(n, dtype_name(parts[0].tensor.dtype), parts[0].global_shape,
                                     sum(x.nbytes for x in mine), combined_checksum(mine),
                                     None, 0))
                new_shards.extend(mine)
            result = self.catalog.commit(
                collection, base, new, unchanged, deletes,
                (writer.segment_id, tier.name, total) if writer else None, message, meta,
                durable=writer is None or tier.persistent, shards=new_shards)
        except BaseException:
            if writer is not None:
                writer.abort()
            raise
        if writer is not None:
            writer.release()
        return result

    def _write_segment(self, collection: str, tier: se.Tier,
                       stored: list[tuple[str, torch.Tensor | RawPut]]
                       ) -> tuple[se.SegmentWriter | None, dict[str, str], dict[str, int], int]:
        """The ``stored`` items (key, tensor) packed into one new segment of ``tier``,
        filled and finished: (its writer, None when nothing has bytes; checksum and
        offset by key; its size). StoreFull when the tier has no room; on a failure
        here the segment is gone. The caller aborts or releases the writer."""
        sizes = [t.nbytes for _, t in stored]
        offsets, total = se.pack(sizes)
        if not total:
            return None, {}, {}, 0
        try:
            writer = tier.create(uuid.uuid4().hex, total)
        except se.TierFull as exc:
            raise StoreFull(f"cannot commit {total} bytes to {collection!r}: {exc}; run "
                            f"gc, or commit to the disk tier", collection=collection) from exc
        try:
            checksums = _fill(writer, stored, offsets, sizes)
            writer.finish()
        except se.TierFull as exc:  # filled up by another writer since the create
            writer.abort()
            raise StoreFull(f"cannot commit {total} bytes to {collection!r}: {exc}; run "
                            f"gc, or commit to the disk tier", collection=collection) from exc
        except BaseException:
            writer.abort()
            raise
        return writer, checksums, dict(zip((k for k, _ in stored), offsets, strict=True)), total

    # -- group commits ------------------------------------------------------------------
    def join_group(self, collection: str, group: GroupSpec) -> int:
        """Enter this process as ``group.rank``; the head the group builds on."""
        return self.catalog.join_group(collection, group.name, group.rank, group.world_size,
                                       se.current_holder(), group.timeout)

    def abort_group(self, collection: str, group: GroupSpec, reason: str) -> None:
        self.catalog.abort_group(collection, group.name, reason)

    def open_groups(self, collection: str, prefix: str) -> list[str]:
        """The open groups of ``collection`` named ``prefix...``, oldest first."""
        return self.catalog.open_groups(collection, prefix)

    def ready_ranks(self, collection: str, group: str) -> set[int] | None:
        """The ranks whose parts are committed, while the group is open (else None)."""
        st = self.catalog.group_state(collection, group)
        if st is None or st.state != "open" or st.expired:
            return None
        return {r for r, state, _ in st.parts if state == "ready"}

    def publish_part(self, collection: str, group: GroupSpec,
                     puts: Mapping[str, torch.Tensor | RawPut],
                     shards: Mapping[str, list[ShardPut]], deletes: set[str],
                     message: str | None, tier_name: str,
                     meta: dict[str, str] | None) -> Commit:
        """Write this rank's part into a segment of its own, commit the part, and wait
        until the group publishes (the Commit) or aborts (GroupAborted)."""
        result = self.commit_part(collection, group, puts, shards, deletes, message,
                                  tier_name, meta)
        return result if result is not None else self._await_group(collection, group)

    def commit_part(self, collection: str, group: GroupSpec,
                    puts: Mapping[str, torch.Tensor | RawPut],
                    shards: Mapping[str, list[ShardPut]], deletes: set[str],
                    message: str | None, tier_name: str, meta: dict[str, str] | None, *,
                    keep_open: bool = False) -> Commit | None:
        """Write this rank's part into a segment of its own and commit it, without
        waiting for the others: the Commit when it completed the group, else None. A
        failure aborts the group (the other ranks must not wait out its deadline)
        unless ``keep_open``: a resumable import's part fails alone, and the group's
        ready parts wait for it to be tried again."""
        items: list[tuple[str, str, tuple[int, ...], tuple[int, ...], tuple[int, ...],
                          torch.Tensor | RawPut]] = []
        for n, t in puts.items():
            items.append((n, dtype_name(t.dtype), tuple(t.shape), (0,) * len(t.shape),
                          tuple(t.shape), t))
        for n, parts in shards.items():
            for p in parts:
                items.append((n, dtype_name(p.tensor.dtype), p.global_shape, p.offsets,
                              tuple(p.tensor.shape), p.tensor))
        stored = [(str(i), it[5]) for i, it in enumerate(items) if it[5].nbytes > 0]
        tier = self.tiers.tier(tier_name)
        writer: se.SegmentWriter | None = None
        try:
            with se.gc_paused():
                writer, checksums, where, total = self._write_segment(collection, tier, stored)
            part = GroupPart(
                [PartShard(n, dt, g, o, shp, t.nbytes,
                           checksums.get(str(i), _EMPTY_CHECKSUM), where.get(str(i), 0))
                 for i, (n, dt, g, o, shp, t) in enumerate(items)],
                sorted(deletes), meta, message)
            result = self.catalog.commit_part(
                collection, group.name, group.rank, part,
                (writer.segment_id, tier.name, total) if writer else None)
        except BaseException as exc:
            landed = writer is not None and self.catalog.segment_registered(writer.segment_id)
            if writer is not None:
                if landed:
                    writer.release()  # its part was recorded: gc reclaims it with the group
                else:
                    writer.abort()
            if not landed and not isinstance(exc, GroupAborted) and not keep_open:
                # the other ranks must not wait out the deadline for this part
                self.abort_group(collection, group, f"rank {group.rank} failed to commit its "
                                 f"part: {type(exc).__name__}: {exc}")
            raise
        if writer is not None:
            writer.release()
        if result is not None:  # this rank completed the group
            self._notifier.publish(collection, result.version)
            self.catalog.start_background()
        return result

    def _await_group(self, collection: str, group: GroupSpec) -> Commit:
        """Wait for the group to end: the Commit once published; GroupAborted when it
        aborts, a rank that joined on this host has died, or the deadline passes."""
        pause = 0.002
        while True:
            st = self.catalog.group_state(collection, group.name)
            if st is None:
                raise GroupAborted(f"group {group.name!r} of {collection!r} is gone",
                                   collection=collection, group=group.name, reason="gone")
            if st.state == "published":
                assert st.version is not None
                return self.catalog.commit_info(collection, st.version)
            if st.state == "aborted":
                reason = st.reason or "aborted"
                raise GroupAborted(f"group {group.name!r} of {collection!r} aborted: {reason}; "
                                   f"nothing was published", collection=collection,
                                   group=group.name, reason=reason, base=st.base)
            why = None
            if st.expired:
                joined = sorted(r for r, _, _ in st.parts)
                missing = [r for r in range(st.world_size) if r not in joined]
                waiting = sorted(r for r, state, _ in st.parts if state != "ready")
                why = (f"its deadline passed with ranks {missing + waiting} not committed")
            for r, state, holder in st.parts:
                if state != "ready" and se.holder_alive(holder) is False:
                    why = f"rank {r} died before committing its part"
            if why is not None:
                self.catalog.abort_group(collection, group.name, why)
                continue  # read the state again: another rank may have published first
            time.sleep(pause)
            pause = min(pause * 2, 0.05)

    def publish_in_place(self, collection: str, base: int, files: Sequence[InPlaceFile],
                         deletes: set[str], message: str | None, meta: dict[str, str] | None,
                         advance: Callable[[int], None]) -> Commit:
        """Commit files' tensors without copying them: each file becomes a disk-tier
        segment of its own (a reflinked clone, else a reference the catalog records),
        its tensors rows at their offsets in the file, checksummed in one pass over the
        bytes on the I/O pool (``advance`` is told the bytes hashed). A file that
        changes while it is hashed fails the commit (CorruptData); on any failure
        nothing is registered and no clone is left."""
        self._live(collection, [], deletes)
        disk = self.tiers.disk
        adoptions: list[se.Adoption | None] = []
        try:
            for f in files:
                if not any(n for *_, n in f.tensors):
                    adoptions.append(None)  # no bytes to hold: no segment
                    continue
                try:
                    adoptions.append(adopted := disk.adopt(uuid.uuid4().hex, f.fd, f.path))
                except OSError as exc:
                    raise InvalidInput(f"{f.path}: cannot commit in place: {exc}",
                                       collection=collection) from exc
                if adopted.nbytes != f.nbytes:  # the bytes hashed: those the header tiles
                    raise CorruptData(f"{f.path}: changed while it was committed in place "
                                      f"(size {f.nbytes:,} -> {adopted.nbytes:,} bytes); nothing "
                                      f"was committed", collection=collection)
            sums = _hash_in_place(files, adoptions, advance)
            for f, a in zip(files, adoptions, strict=True):
                if a is not None and not a.reflinked:
                    _check_unchanged(collection, f, a.source)
            new: list[NewTensor] = []
            for f, a in zip(files, adoptions, strict=True):
                for name, dt, shape, offset, nbytes in f.tensors:
                    sid = a.segment_id if a is not None and nbytes > 0 else None
                    new.append(NewTensor(name, dtype_name(dt), shape, nbytes,
                                         sums.get(name, _EMPTY_CHECKSUM), sid,
                                         offset if sid else 0))
            segs = [NewSegment(a.segment_id, disk.name, a.nbytes,
                               None if a.reflinked else a.source)
                    for a in adoptions if a is not None]
            result = self.catalog.commit(collection, base, new, [], deletes, None, message,
                                         meta, more_segments=segs)
        except BaseException:
            for a in adoptions:
                if a is not None:
                    a.abort()
            raise
        for a in adoptions:
            if a is not None:
                a.release()
        self._notifier.publish(collection, result.version)
        self.catalog.start_background()
        return result

    def _unchanged(self, puts: Mapping[str, Any], live: Mapping[str, TensorRow]) -> list[str]:
        """The puts whose bytes equal the head's tensor of that name: same dtype, shape,
        sampled bytes and digest."""
        candidates = [n for n, t in puts.items()
                      if not isinstance(t, RawPut)
                      and (row := live.get(n)) is not None and row.nbytes == t.nbytes
                      and row.dtype == dtype_name(t.dtype) and row.shape == tuple(t.shape)]
        candidates = self._sampled_equal(puts, live, self._not_marked(live, candidates))
        if not candidates:
            return []
        pool = se.io_pool()
        step = max(1, -(-len(candidates) // self._workers))
        batches = [candidates[i : i + step] for i in range(0, len(candidates), step)]
        digests = [d for batch in pool.map(lambda b: [digest(puts[n]) for n in b], batches)
                   for d in batch]
        return [n for n, d in zip(candidates, digests, strict=True) if d == live[n].checksum]

    def _not_marked(self, live: Mapping[str, TensorRow], names: list[str]) -> list[str]:
        """``names`` less those whose head extent is marked corrupt: a commit never
        shares damaged bytes (the values are stored anew). One look per segment."""
        marks: dict[str, dict[int, str] | None] = {}
        out = []
        for n in names:
            row = live[n]
            sid = row.segment_id
            if sid is not None:
                if sid not in marks:
                    marks[sid] = self.tiers.marks.corrupt(sid)
                bad = marks[sid]
                if bad and (row.offset in bad or se.WHOLE in bad):
                    continue
            out.append(n)
        return out

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
            except se.SegmentMissing:  # the digest decides
                got = None
            except se.SourceChanged:  # a file committed in place changed: its rows are
                differ.update(group)  # no longer servable, so these bytes are stored anew
                continue
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


def _hash_in_place(files: Sequence[InPlaceFile], adoptions: Sequence[se.Adoption | None],
                   advance: Callable[[int], None]) -> dict[str, str]:
    """Each tensor's checksum, read from a mapping of its segment's bytes (the clone, or
    the file itself): one pass, on the I/O pool's threads (xxhash releases the GIL).
    The tensors are dealt into one batch per thread, largest first to the lightest
    batch, so the threads finish together and a model of 1,000 tensors costs a few
    tasks, not a thousand."""
    maps: list[mmap.mmap] = []
    jobs: list[tuple[str, int, int, int]] = []  # name, map, offset, nbytes
    for f, a in zip(files, adoptions, strict=True):
        if a is not None:
            maps.append(mmap.mmap(a.fd, a.nbytes, access=mmap.ACCESS_READ))
            jobs.extend((name, len(maps) - 1, off, n) for name, _, _, off, n in f.tensors if n)
    jobs.sort(key=lambda j: -j[3])
    batches: list[list[tuple[str, int, int, int]]] = [[] for _ in range(se.io_workers())]
    loads = [0] * len(batches)
    for job in jobs:
        i = loads.index(min(loads))
        batches[i].append(job)
        loads[i] += job[3]

    def run(batch: list[tuple[str, int, int, int]]) -> list[tuple[str, str]]:
        out = []
        for name, m, off, n in batch:
            out.append((name, se.checksum(memoryview(maps[m])[off : off + n])))
            advance(n)
        return out

    try:
        return {name: got for part in se.io_pool().map(run, [b for b in batches if b])
                for name, got in part}
    finally:
        for mm in maps:
            try:
                mm.close()
            except BufferError:  # a hash still running after another failed: it keeps it
                pass


def _check_unchanged(collection: str, f: InPlaceFile, source: se.SourceFile) -> None:
    """CorruptData when the file referenced in place changed while it was hashed (its
    descriptor's size or mtime, or the path now naming another file)."""
    for st in (os.fstat(f.fd), _stat_or_none(f.path)):
        diff = ["deleted"] if st is None else source.differences(st)
        if diff:
            raise CorruptData(f"{f.path}: changed while it was committed in place "
                              f"({'; '.join(diff)}); nothing was committed",
                              collection=collection)


def _stat_or_none(path: str) -> os.stat_result | None:
    try:
        return os.stat(path)
    except FileNotFoundError:
        return None
