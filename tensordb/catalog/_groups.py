"""Group commits: the ranks of a distributed job each commit a part of one version.

A group is a row of ``commit_groups`` (collection, group name, world size, the head it
started from, a deadline) and a row per rank in ``group_parts``. A rank *joins* when its
transaction begins, writes its bytes into a segment of its own, then commits its *part*
(its shards, whole tensors, deletes, metadata) in one SQL transaction, which registers
the segment and marks the part ready. The transaction that makes the last part ready
also checks that the parts fit together (every tensor's shards tile its global shape
exactly, one dtype and shape per tensor, no name both put and deleted) and publishes
the version with the ordinary commit statements (``Versions.publish_in``), in the same
SQL transaction: the version appears atomically, or not at all.

A group ends ``aborted`` (publishing nothing) when a rank aborts, a rank that joined is
found dead, the deadline passes, the parts do not fit, or the commit conflicts. The
parts' segments of an ended group are referenced by nothing once its parts are gone:
gc removes those rows and reclaims the bytes (``GarbageCollector``).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, NamedTuple

from sqlalchemy import Connection, Engine, and_, delete, select, update
from sqlalchemy.exc import SQLAlchemyError

import storage_engine as se

from ..errors import GroupAborted, InvalidInput, StoreFull, TensorDBError
from ._common import Commit, NewShard, NewTensor, collection_info, insert_ignore, now_utc
from ._quotas import check_quotas
from ._retry import RETRY_SECONDS, retry_call, retrying
from ._sql import write_conn
from ._versions import Versions
from .schema import commit_groups, group_parts, segments

__all__ = ["Groups", "GroupPart", "GroupState", "PartShard", "box_copies", "check_tiling",
           "combined_checksum"]

#: most ranks a group may have
MAX_WORLD_SIZE = 1 << 16
#: how long gc keeps the row of an aborted group past its deadline: a rank that arrives
#: late is told the group ended (rather than starting a new group of that name); a
#: published group's row is kept for good
ENDED_GROUP_KEPT = timedelta(days=1)


class PartShard(NamedTuple):
    """One box of a tensor a rank writes: ``offsets`` + ``shape`` within ``global_shape``,
    its bytes contiguous at ``offset`` of the rank's segment."""

    name: str
    dtype: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    nbytes: int
    checksum: str
    offset: int


@dataclass(frozen=True, slots=True)
class GroupPart:
    """What one rank commits."""

    shards: Sequence[PartShard]
    deletes: Sequence[str]
    meta: dict[str, str] | None
    message: str | None

    def to_json(self) -> str:
        return json.dumps({"s": [list(s) for s in self.shards], "d": list(self.deletes),
                           "m": self.meta, "msg": self.message}, separators=(",", ":"))

    @staticmethod
    def from_json(text: str) -> GroupPart:
        d = json.loads(text)
        return GroupPart([PartShard(s[0], s[1], tuple(s[2]), tuple(s[3]), tuple(s[4]), s[5],
                                    s[6], s[7]) for s in d["s"]], d["d"], d["m"], d["msg"])


@dataclass(frozen=True, slots=True)
class GroupState:
    """A group as a waiting rank sees it."""

    state: str  # 'open', 'published' or 'aborted'
    version: int | None
    reason: str | None
    base: int
    world_size: int
    expired: bool
    #: (rank, state, holder) of every rank that joined
    parts: list[tuple[int, str, str]]


def _volume(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def check_tiling(name: str, global_shape: tuple[int, ...],
                 boxes: Sequence[tuple[int, tuple[int, ...], tuple[int, ...]]]) -> str | None:
    """Why the boxes (rank, offsets, shape) do not tile ``global_shape`` exactly, or
    None when they do: each inside the shape, no two overlapping, and together as many
    elements as the shape (so no gap)."""
    nd = len(global_shape)
    live = []
    for rank, off, shp in boxes:
        if len(off) != nd or len(shp) != nd:
            return (f"tensor {name!r}: rank {rank}'s shard has offsets {list(off)} and shape "
                    f"{list(shp)} for a {nd}-d global shape {list(global_shape)}")
        for d in range(nd):
            if off[d] < 0 or shp[d] < 0 or off[d] + shp[d] > global_shape[d]:
                return (f"tensor {name!r}: rank {rank}'s shard at offsets {list(off)} with shape "
                        f"{list(shp)} lies outside the global shape {list(global_shape)}")
        if _volume(shp):
            live.append((rank, off, shp))
    if nd == 0:
        if len(live) > 1:
            return (f"tensor {name!r}: ranks {live[0][0]} and {live[1][0]} both put this "
                    f"0-d tensor")
    elif len(live) > 1:
        # sweep along the dimension the boxes split most (a tensor-parallel split of
        # dim 1 shares every dim-0 start): after sorting by their start there, a box
        # can only meet the boxes that start before it ends, so typical layouts cost
        # O(k log k), not a comparison of every pair
        d0 = max(range(nd), key=lambda d: len({b[1][d] for b in live}))
        live.sort(key=lambda b: b[1][d0])
        for i, (ra, oa, sa) in enumerate(live):
            for rb, ob, sb in live[i + 1:]:
                if ob[d0] >= oa[d0] + sa[d0]:
                    break  # sorted: no later box starts inside this one along d0
                if all(oa[d] < ob[d] + sb[d] and ob[d] < oa[d] + sa[d] for d in range(nd)):
                    return (f"tensor {name!r}: the shards of rank {ra} (offsets {list(oa)}, "
                            f"shape {list(sa)}) and rank {rb} (offsets {list(ob)}, shape "
                            f"{list(sb)}) overlap")
    covered = sum(_volume(s) for _, _, s in live)
    if covered != _volume(global_shape):
        return (f"tensor {name!r}: its shards cover {covered:,} of its {_volume(global_shape):,} "
                f"elements (global shape {list(global_shape)}): a gap")
    return None


def box_copies(boxes: Sequence[tuple[Sequence[int], Sequence[int]]], offsets: Sequence[int],
               shape: Sequence[int]) -> list[tuple[int, tuple[slice, ...], tuple[slice, ...]]]:
    """How to read the region ``offsets`` + ``shape`` from stored boxes (offsets, shape):
    for each box that meets it, (its index, the slices of the box to read, the slices
    of the region they go to)."""
    out = []
    for i, (bo, bs) in enumerate(boxes):
        lo = [max(a, b) for a, b in zip(bo, offsets, strict=True)]
        hi = [min(a + n, b + m) for a, n, b, m in zip(bo, bs, offsets, shape, strict=True)]
        if any(h <= low for low, h in zip(lo, hi, strict=True)):
            continue
        out.append((i, tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, bo, strict=True)),
                    tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, offsets, strict=True))))
    return out


def combined_checksum(shards: Sequence[NewShard]) -> str:
    """A sharded row's checksum: of its shards' boxes and checksums (each shard's bytes
    are checked against its own)."""
    text = ";".join(f"{list(s.offsets)}{list(s.shape)}{s.checksum}" for s in shards)
    return se.checksum(text.encode())


class Groups:
    """Group transactions over the catalog's SQL engine; ``versions`` publishes."""

    def __init__(self, engine: Engine, node: str, versions: Versions) -> None:
        self.engine = engine
        self.node = node
        self._versions = versions
        #: how long a call keeps retrying a lost catalog connection (``_retry``)
        self.retry_seconds = RETRY_SECONDS

    def _group(self, conn: Connection, collection: str, group: str, *,
               lock: bool) -> Any:
        g = commit_groups.c
        q = select(g.world_size, g.base, g.state, g.version, g.reason, g.deadline).where(
            g.collection == collection, g.name == group)
        if lock and conn.dialect.name == "postgresql":
            q = q.with_for_update()
        return conn.execute(q).first()

    def _aborted(self, collection: str, group: str, reason: str, base: int = 0
                 ) -> GroupAborted:
        return GroupAborted(f"group {group!r} of {collection!r} aborted: {reason}; nothing "
                            f"was published", collection=collection, group=group,
                            reason=reason, base=base)

    def _set_aborted(self, conn: Connection, collection: str, group: str, reason: str) -> None:
        g = commit_groups.c
        conn.execute(update(commit_groups).where(
            g.collection == collection, g.name == group, g.state == "open")
            .values(state="aborted", reason=reason))

    @retrying
    def join(self, collection: str, group: str, rank: int, world_size: int, holder: str,
             timeout: float) -> int:
        """Enter ``rank`` into the group (creating it, with a deadline ``timeout`` seconds
        on); the head the group builds on."""
        if not 1 <= world_size <= MAX_WORLD_SIZE:
            raise InvalidInput(f"world_size must be between 1 and {MAX_WORLD_SIZE}, not "
                               f"{world_size}", collection=collection)
        if not 0 <= rank < world_size:
            raise InvalidInput(f"rank {rank} is out of range for world_size {world_size}",
                               collection=collection)
        now = now_utc()
        with write_conn(self.engine) as conn:
            row = self._group(conn, collection, group, lock=True)
            if row is None:
                info = collection_info(conn, collection)
                base = info.head if info else 0
                insert_ignore(conn, commit_groups, {  # another rank may be creating it
                    "collection": collection, "name": group, "world_size": world_size,
                    "base": base, "state": "open", "created_at": now,
                    "deadline": now + timedelta(seconds=timeout)})
                row = self._group(conn, collection, group, lock=True)
            ws, base, state, version, reason, deadline = row
            if state == "published":
                raise InvalidInput(f"group {group!r} of {collection!r} has already published "
                                   f"version {version}; name a new group",
                                   collection=collection)
            if state == "aborted":
                raise self._aborted(collection, group, reason or "aborted", base)
            if ws != world_size:
                why = (f"rank {rank} joined with world_size {world_size}, the group has "
                       f"{ws}")
                self._set_aborted(conn, collection, group, why)
                aborted = self._aborted(collection, group, why, base)
            else:
                aborted = None
                p = group_parts.c
                mine = conn.execute(select(p.state, p.holder).where(
                    p.collection == collection, p.group_name == group, p.rank == rank)).first()
                if mine is not None:
                    if mine[0] == "ready":
                        raise InvalidInput(f"rank {rank} of group {group!r} has already "
                                           f"committed its part", collection=collection)
                    if se.holder_alive(mine[1]) is not False and mine[1] != holder:
                        raise InvalidInput(f"rank {rank} of group {group!r} is already taken "
                                           f"by a live process", collection=collection)
                    conn.execute(update(group_parts).where(
                        p.collection == collection, p.group_name == group, p.rank == rank)
                        .values(holder=holder, node=self.node, created_at=now))
                else:
                    conn.execute(group_parts.insert().values(
                        collection=collection, group_name=group, rank=rank, holder=holder,
                        node=self.node, state="joined", created_at=now))
        if aborted is not None:
            raise InvalidInput(aborted.message, collection=collection)
        return int(base)

    @retrying
    def state(self, collection: str, group: str) -> GroupState | None:
        with self.engine.connect() as conn:
            row = self._group(conn, collection, group, lock=False)
            if row is None:
                return None
            p = group_parts.c
            parts = [(r[0], r[1], r[2]) for r in conn.execute(select(p.rank, p.state, p.holder)
                     .where(p.collection == collection, p.group_name == group))]
        ws, base, state, version, reason, deadline = row
        return GroupState(state, version, reason, base, ws, deadline < now_utc(), parts)

    @retrying
    def open_named(self, collection: str, prefix: str) -> list[str]:
        """The open groups of ``collection`` whose names start with ``prefix``, oldest
        first (a resumable import's pending group)."""
        g = commit_groups.c
        with self.engine.connect() as conn:
            rows = conn.execute(select(g.name, g.created_at).where(
                g.collection == collection, g.state == "open",
                g.name.startswith(prefix, autoescape=True))).all()
        return [r[0] for r in sorted(rows, key=lambda r: r[1])]

    @retrying
    def abort(self, collection: str, group: str, reason: str) -> None:
        """End the group unpublished (if it is still open)."""
        with write_conn(self.engine) as conn:
            self._set_aborted(conn, collection, group, reason)

    def commit_part(self, collection: str, group: str, rank: int, part: GroupPart,
                    segment: tuple[str, str, int] | None) -> Commit | None:
        """Record ``rank``'s part (its bytes already in ``segment``: id, tier, nbytes) in
        one SQL transaction; the Commit when it was the last part and the version is
        published, None while other parts are missing. GroupAborted when the group had
        ended, its deadline passed, or the parts do not fit together (the group then
        ends aborted, and nothing is published).

        A lost catalog connection is retried; a retry whose first attempt did land (the
        part is ready with this segment) reports what it did instead of running again."""
        attempts = 0

        def once() -> Commit | None:
            nonlocal attempts
            attempts += 1
            if attempts > 1:
                landed = self._landed(collection, group, rank, segment)
                if landed is not None:
                    return landed[0]
            return self._commit_part(collection, group, rank, part, segment)

        result: Commit | None = retry_call(self.retry_seconds, once)
        return result

    def _landed(self, collection: str, group: str, rank: int,
                segment: tuple[str, str, int] | None) -> tuple[Commit | None] | None:
        """(the Commit, or None while the group is open) when ``rank``'s part is already
        recorded with ``segment``; None when it is not."""
        with self.engine.connect() as conn:
            p = group_parts.c
            row = conn.execute(select(p.state, p.segment_id).where(
                p.collection == collection, p.group_name == group, p.rank == rank)).first()
            g = self._group(conn, collection, group, lock=False)
        if row is None or row[0] != "ready" or row[1] != (segment[0] if segment else None):
            return None
        if g is not None and g[2] == "published":
            return (self._versions.commit_info(collection, g[3]),)
        return (None,)

    def _commit_part(self, collection: str, group: str, rank: int, part: GroupPart,
                     segment: tuple[str, str, int] | None) -> Commit | None:
        failure: TensorDBError | None = None
        published = None
        # durable whatever this rank's tier: the transaction may publish the version,
        # whose other parts may be on disk
        with write_conn(self.engine, durable=True) as conn:
            row = self._group(conn, collection, group, lock=True)
            if row is None:
                raise self._aborted(collection, group, "no such group (it was never joined, "
                                    "or gc removed it after it ended)")
            ws, base, state, version, reason, deadline = row
            if state != "open":
                raise self._aborted(collection, group, reason or state, base)
            if deadline < now_utc():
                self._set_aborted(conn, collection, group, "its deadline passed")
                failure = self._aborted(collection, group, "its deadline passed", base)
            else:
                now = now_utc()
                if segment is not None:
                    # a part's bytes count to its tenant as it lands (pending until the
                    # group publishes), not only once the last part comes
                    check_quotas(conn, collection, segment[2])
                    conn.execute(segments.insert().values(
                        id=segment[0], node=self.node, tier=segment[1], nbytes=segment[2],
                        created_at=now))
                p = group_parts.c
                conn.execute(update(group_parts).where(
                    p.collection == collection, p.group_name == group, p.rank == rank)
                    .values(state="ready", part=part.to_json(),
                            segment_id=segment[0] if segment else None))
                ready = conn.execute(select(p.rank, p.segment_id, p.part).where(
                    p.collection == collection, p.group_name == group,
                    p.state == "ready")).all()
                if len(ready) == ws:
                    try:
                        with conn.begin_nested():
                            published = self._publish(conn, collection, group, base, ready)
                    except (SQLAlchemyError, MemoryError):
                        raise  # the whole transaction is lost: the part is not recorded
                    except Exception as exc:  # noqa: BLE001 - the group ends with its reason
                        why = exc.message if isinstance(exc, TensorDBError) else \
                            f"{type(exc).__name__}: {exc}"
                        self._set_aborted(conn, collection, group, why)
                        failure = exc if isinstance(exc, (InvalidInput, StoreFull)) else \
                            self._aborted(collection, group, why, base)
                    else:
                        g = commit_groups.c
                        conn.execute(update(commit_groups).where(
                            g.collection == collection, g.name == group)
                            .values(state="published", version=published.result.version))
        if failure is not None:
            raise failure
        return self._versions.after_publish(published) if published is not None else None

    def _publish(self, conn: Connection, collection: str, group: str, base: int,
                 ready: Sequence[Any]) -> Any:
        """Check that the parts fit together, then run the commit's statements."""
        parts = sorted((r[0], r[1], GroupPart.from_json(r[2])) for r in ready)
        deletes: dict[str, int] = {}
        by_name: dict[str, list[tuple[int, str | None, PartShard]]] = {}
        meta: dict[str, str] = {}
        message: str | None = None
        for rank, sid, part in parts:
            for d in part.deletes:
                deletes.setdefault(d, rank)
            for s in part.shards:
                by_name.setdefault(s.name, []).append((rank, sid, s))
            for k, v in (part.meta or {}).items():
                if meta.setdefault(k, v) != v:
                    raise InvalidInput(f"group {group!r}: ranks disagree on metadata {k!r} "
                                       f"({meta[k]!r} against {v!r})", collection=collection)
            if message is None:
                message = part.message
        both = sorted(set(deletes) & set(by_name))
        if both:
            raise InvalidInput(f"group {group!r}: tensor {both[0]!r} is deleted by rank "
                               f"{deletes[both[0]]} and put by rank {by_name[both[0]][0][0]}",
                               collection=collection, tensor=both[0])
        puts: list[NewTensor] = []
        shards: list[NewShard] = []
        for name in sorted(by_name):
            got = by_name[name]
            first = got[0][2]
            for rank, _, s in got:
                if s.dtype != first.dtype or s.global_shape != first.global_shape:
                    raise InvalidInput(
                        f"group {group!r}: tensor {name!r} is {first.dtype} "
                        f"{list(first.global_shape)} on rank {got[0][0]} but {s.dtype} "
                        f"{list(s.global_shape)} on rank {rank}", collection=collection,
                        tensor=name)
            why = check_tiling(name, first.global_shape,
                               [(rank, s.offsets, s.shape) for rank, _, s in got])
            if why is not None:
                raise InvalidInput(f"group {group!r}: {why}", collection=collection,
                                   tensor=name)
            full = [(rank, sid, s) for rank, sid, s in got if s.shape == first.global_shape]
            if full:  # one shard holds the whole tensor: an ordinary row, read zero-copy
                rank, sid, s = full[0]
                puts.append(NewTensor(name, s.dtype, s.global_shape, s.nbytes, s.checksum,
                                      sid if s.nbytes else None, s.offset if s.nbytes else 0))
                continue
            mine = [NewShard(name, i, rank, s.offsets, s.shape, s.nbytes, s.checksum,
                             sid if s.nbytes else None, s.offset if s.nbytes else 0)
                    for i, (rank, sid, s) in enumerate(
                        sorted((g for g in got if g[2].nbytes), key=lambda g: g[2].offsets))]
            total = sum(s.nbytes for s in mine)
            puts.append(NewTensor(name, first.dtype, first.global_shape, total,
                                  combined_checksum(mine), None, 0))
            shards.extend(mine)
        return self._versions.publish_in(conn, collection, base, puts, [], sorted(deletes),
                                         None, message, meta or None, uuid.uuid4().hex,
                                         shards=shards,
                                         claimed=sorted({sid for _, sid, _ in parts if sid}))

    def reap(self, conn: Connection) -> None:
        """For gc (in its transaction): end open groups past their deadline, drop the
        parts of ended groups (so their segments are referenced by nothing unless the
        published version's rows use them), and the rows of groups that aborted long
        enough ago that no rank still waits on them (published ones stay)."""
        g, p = commit_groups.c, group_parts.c
        now = now_utc()
        conn.execute(update(commit_groups).where(g.state == "open", g.deadline < now)
                     .values(state="aborted", reason="its deadline passed"))
        ended = select(commit_groups.c.name).where(
            g.collection == p.collection, g.name == p.group_name, g.state != "open")
        conn.execute(delete(group_parts).where(ended.exists()))
        # a published group's row stays (a few bytes): its name is never used twice
        conn.execute(delete(commit_groups).where(and_(g.state == "aborted",
                                                      g.deadline < now - ENDED_GROUP_KEPT)))
