"""Pulling a segment from the nodes that hold it into a local tier, verified; and
fanning a version out to many nodes as a cascade of such pulls.

Both run in the process that wants the bytes moved: a client's ``Database`` (a remote
read, ``replicate``) or a node server answering a pull action. A pull blocks for its
transfer, on a thread per byte range.

The bytes stream straight into a new local segment file under a temporary name and are
hashed there, extent by extent, as they arrive. Only when every extent matches its
catalog checksum is the file renamed to the segment's name and the replica recorded,
in one SQL transaction that confirms the segment still exists. A transfer cut by a
holder's death resumes from the same byte at the next holder; if none is left, the
partial file is deleted and nothing is registered (a puller killed outright leaves an
unlocked temporary file that the tier's orphan reclaim deletes).

The cascade: round by round, every node that holds the version tells one node that
lacks it to pull from it, all pairs in parallel; each node that has received the
version serves it in the next round. N targets take ceil(log2(N + 1)) rounds from one
source instead of N transfers out of it.
"""

from __future__ import annotations

import bisect
import os
import random
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import xxhash

import storage_engine as se
from tensordb.catalog import NodeDirectory, SegmentInfo
from tensordb.errors import CorruptData, NodeUnavailable, NotFound, StoreFull, TensorDBError

from ._base import Transport

__all__ = ["CascadeReport", "ExtentHasher", "cascade", "pull_segment", "replica_tier",
           "split_ranges", "PullStats", "DEFAULT_STREAMS"]

#: parallel streams per large segment: one gRPC stream is bound by one core, so a host
#: with cores to spare splits; on 2 cores (sender and receiver on one host) splitting
#: measured no gain
DEFAULT_STREAMS = int(os.environ.get("TENSORDB_PULL_STREAMS", "")
                      or max(1, min(4, (os.cpu_count() or 2) // 2)))
#: segments smaller than this travel as one stream
MIN_SPLIT = 64 << 20

#: bytes pulled into a tier: (tier, nbytes, seconds)
PullStats = Callable[[str, int, float], None]

_locks: dict[str, threading.Lock] = {}
_locks_guard = threading.Lock()


def _segment_lock(segment_id: str) -> threading.Lock:
    """One pull per segment at a time in a process: a second reader waits for the first."""
    with _locks_guard:
        lock = _locks.get(segment_id)
        if lock is None:
            lock = _locks[segment_id] = threading.Lock()
        return lock


class ExtentHasher:
    """Checks a segment's extents against their checksums while its bytes arrive in
    order, hashing each chunk where it was written (still in cache)."""

    def __init__(self, extents: Sequence[tuple[int, int, str]]) -> None:
        self._extents = [e for e in extents if e[1] > 0]
        self._i = 0
        self._h = xxhash.xxh3_64()
        self.bad: list[tuple[int, str, str]] = []  # (offset, expected, found)

    def feed(self, pos: int, buf: np.ndarray) -> None:
        """Account for bytes ``[pos, pos + len(buf))``; calls must come in order."""
        end = pos + len(buf)
        while self._i < len(self._extents):
            off, n, want = self._extents[self._i]
            if off >= end:
                return
            lo, hi = max(off, pos), min(off + n, end)
            if hi > lo:
                self._h.update(buf[lo - pos : hi - pos])
            if off + n > end:
                return
            got = self._h.hexdigest()
            if got != want:
                self.bad.append((off, want, got))
            self._h = xxhash.xxh3_64()
            self._i += 1

    @property
    def complete(self) -> bool:
        return self._i == len(self._extents)


def replica_tier(source_tier: str, tiers: Mapping[str, se.Tier]) -> str:
    """Where a pulled copy goes: the holder's tier when this node has it as files,
    else host memory (a GPU segment arrives in host memory)."""
    tier = tiers.get(source_tier)
    return source_tier if tier is not None and tier.file_backed else "host"


def _create(tiers: Mapping[str, se.Tier], first: str, part_id: str, nbytes: int,
            segment_id: str) -> tuple[se.FileTier, se.SegmentWriter]:
    order = [first] + [t for t in ("host", "disk") if t != first]
    last: Exception | None = None
    for name in order:
        tier = tiers.get(name)
        if tier is None or not tier.file_backed:
            continue
        try:
            return tier, tier.create(part_id, nbytes)
        except se.TierFull as exc:
            last = exc
    raise StoreFull(f"no tier of this node has room for segment {segment_id} "
                    f"({nbytes} bytes): {last}")


def pull_segment(directory: NodeDirectory, transport: Transport, me: str,
                 tiers: Mapping[str, se.Tier], segment_id: str, *,
                 prefer: str | None = None, on_pulled: PullStats | None = None,
                 streams: int | None = None) -> str:
    """Make node ``me`` hold ``segment_id``; returns the local tier that holds it.

    Blocks for the transfer. A large segment travels as ``streams`` byte ranges at once
    (cut at extent starts; default: $TENSORDB_PULL_STREAMS, else half the cores up to
    4, for segments of 64 MiB or more). Idempotent: a segment held already is not fetched again.
    Raises NotFound if the segment is gone, NodeUnavailable if no live holder can send
    it whole, CorruptData if every holder's bytes fail their checksums, StoreFull if no
    local tier has room. On any failure nothing is registered and no file is left.
    """
    with _segment_lock(segment_id):
        holders = directory.holders(segment_id)
        if not holders:
            raise NotFound(f"segment {segment_id} is not in the catalog (dropped and "
                           f"collected)")
        if me in holders:
            return holders[me]
        info = directory.segment(segment_id)
        if info is None:
            raise NotFound(f"segment {segment_id} was dropped while being pulled")
        live = directory.live()
        candidates = [n for n in holders if n in live and n != me]
        random.shuffle(candidates)  # spread readers over the holders
        if prefer in candidates:
            candidates.remove(prefer)
            candidates.insert(0, prefer)
        if not candidates:
            down = sorted(holders)
            raise NodeUnavailable(f"no live node holds segment {segment_id} (held by "
                                  f"{', '.join(down)}: down or not serving)", node=down[0])
        return _transfer(directory, transport, me, tiers, info, candidates,
                         {n: live[n].address or "" for n in candidates},
                         holders[candidates[0]], on_pulled,
                         streams or (DEFAULT_STREAMS if info.nbytes >= MIN_SPLIT else 1))


def split_ranges(extents: Sequence[tuple[int, int, str]], nbytes: int, parts: int
                 ) -> list[tuple[int, int, list[tuple[int, int, str]]]]:
    """Cut ``[0, nbytes)`` into up to ``parts`` ranges of about equal size, at extent
    starts only, so each range's extents can be hashed by the stream that writes them.
    Returns (start, end, extents inside) per range."""
    starts = sorted({e[0] for e in extents if e[0] > 0})
    cuts: list[int] = []
    for i in range(1, max(1, parts)):
        target = nbytes * i // parts
        at = bisect.bisect_left(starts, target)
        if at < len(starts) and starts[at] > (cuts[-1] if cuts else 0) \
                and starts[at] < nbytes:
            cuts.append(starts[at])
    bounds = [0, *dict.fromkeys(cuts), nbytes]
    return [(lo, hi, [e for e in extents if lo <= e[0] < hi])
            for lo, hi in zip(bounds, bounds[1:], strict=False) if hi > lo]


def _fetch_range(transport: Transport, segment_id: str, dst: np.ndarray, lo: int, hi: int,
                 extents: Sequence[tuple[int, int, str]], candidates: list[str],
                 addresses: dict[str, str]) -> tuple[int, ExtentHasher, list[str]]:
    """Stream ``[lo, hi)`` into ``dst``, resuming at the next holder after a failure;
    returns how far it got, its hasher and what failed."""
    pos = lo
    hasher = ExtentHasher(extents)

    def arrived(n: int) -> None:  # bytes [pos, pos + n) of dst are in: hash them in cache
        nonlocal pos
        hasher.feed(pos, dst[pos : pos + n])
        pos += n

    failures: list[str] = []
    for node in candidates:
        if pos == hi:
            break
        try:
            transport.read_segment_into(node, addresses[node], segment_id, pos, dst[pos:hi],
                                        arrived)
        except (NodeUnavailable, NotFound) as exc:
            failures.append(str(exc))  # dead, or dropped its copy: the next one resumes
    return pos, hasher, failures


def _transfer(directory: NodeDirectory, transport: Transport, me: str,
              tiers: Mapping[str, se.Tier], info: SegmentInfo, candidates: list[str],
              addresses: dict[str, str], source_tier: str, on_pulled: PullStats | None,
              streams: int) -> str:
    t0 = time.perf_counter()
    tier, writer = _create(tiers, replica_tier(source_tier, tiers),
                           f"{info.id}.part-{uuid.uuid4().hex[:12]}", info.nbytes, info.id)
    final = tier.path(info.id)
    renamed = False
    try:
        parts = split_ranges(info.extents, info.nbytes, streams)
        args = [(transport, info.id, writer.buffer, lo, hi, ext, candidates, addresses)
                for lo, hi, ext in parts]
        if len(args) == 1:
            results = [_fetch_range(*args[0])]
        else:
            # one stream per range at once: a single gRPC stream is bound by one core
            with ThreadPoolExecutor(len(args), thread_name_prefix="tensordb-pull") as pool:
                results = list(pool.map(lambda a: _fetch_range(*a), args))
        short = [(lo, hi, got) for (lo, hi, _), (got, _, _) in zip(parts, results, strict=True)
                 if got < hi]
        if short:
            failures = sorted({f for _, _, fs in results for f in fs})
            lo, hi, got = short[0]
            raise NodeUnavailable(
                f"no holder could send segment {info.id} whole (bytes [{lo}, {hi}) stopped "
                f"at {got}): {'; '.join(failures)}", node=candidates[-1])
        bad = [b for _, h, _ in results for b in h.bad]
        if bad or not all(h.complete for _, h, _ in results):
            off, want, got_sum = bad[0] if bad else (-1, "", "")
            raise CorruptData(f"segment {info.id} arrived damaged: the extent at offset "
                              f"{off} hashes to {got_sum}, the catalog says {want}; not kept")
        writer.finish()
        os.rename(tier.path(writer.segment_id), final)  # complete and verified: visible
        renamed = True
        if tier.marks is not None:  # verified as it arrived: no first-open hash needed
            tier.marks.rename(writer.segment_id, info.id)
        if not directory.add_replica(info.id, me, tier.name):
            raise NotFound(f"segment {info.id} was dropped while being pulled")
    except BaseException:
        writer.abort()
        if renamed:
            try:
                os.unlink(final)
            except FileNotFoundError:
                pass
        raise
    writer.release()
    if on_pulled is not None:
        on_pulled(tier.name, info.nbytes, time.perf_counter() - t0)
    return tier.name


# -- the cascade ------------------------------------------------------------------------
#: pull ``segments`` into the calling process's own node (from ``source`` first)
LocalPull = Callable[[Sequence[str], str | None], None]


@dataclass(slots=True)
class CascadeReport:
    """What a fan-out did: the (source, target) pairs of each round, its failures."""

    rounds: list[list[tuple[str, str]]] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)  # target -> why
    seconds: float = 0.0


def cascade(directory: NodeDirectory, transport: Transport, me: str,
            segments: Sequence[str], targets: Sequence[str], local_pull: LocalPull,
            ) -> CascadeReport:
    """Make every node of ``targets`` hold all of ``segments``.

    ``me`` is pulled in-process through ``local_pull`` (this node need not run a
    server); the others through their servers' pull action. A target whose pull fails
    is reported in ``failed``; the others still get the version. Raises
    NodeUnavailable when no live node holds the segments to start from.
    """
    t0 = time.perf_counter()
    report = CascadeReport()
    held = directory.held_by(segments)
    live = directory.live()
    pending = [t for t in dict.fromkeys(targets) if any(t not in held[s] for s in segments)]
    if not pending:
        return report
    whole = [n for n in live if all(n in held[s] for s in segments)]
    # no node holds every segment: start from nodes holding some (pulls fall back to
    # any holder for the others)
    sources = whole or [n for n in live if any(n in held[s] for s in segments)]
    if not sources:
        holders = sorted({n for s in segments for n in held[s]})
        raise NodeUnavailable(f"no live node holds the version's segments (held by "
                              f"{', '.join(holders) or 'nobody'})",
                              node=holders[0] if holders else None)

    def one(pair: tuple[str, str]) -> tuple[str, str | None]:
        source, target = pair
        missing = [s for s in segments if target not in held[s]]
        try:
            if target == me:
                local_pull(missing, source)
            elif target not in live:
                return target, f"node {target!r} is down or not serving"
            else:
                transport.request_pull(target, live[target].address or "", missing, source)
        except TensorDBError as exc:
            return target, str(exc)
        return target, None

    with ThreadPoolExecutor(max(1, min(len(pending), 32)),
                            thread_name_prefix="tensordb-cascade") as pool:
        while pending:
            pairs = list(zip(sources, pending, strict=False))  # as many pairs as sources
            report.rounds.append(pairs)
            pending = pending[len(pairs):]
            for target, error in pool.map(one, pairs):
                if error is None:
                    sources.append(target)
                else:
                    report.failed[target] = error
    report.seconds = time.perf_counter() - t0
    return report
