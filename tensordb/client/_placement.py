"""Where a node keeps bytes: its tiers, and the moves between them (pin, evict).

``Tiers`` is this node's set of tiers (host shared memory, disk, and a GPU tier when
the process owns one or a catalog row points at one). ``Placement`` moves a version's
segments between them: ``pin`` brings them up and keeps them there, ``evict`` moves
them down. Readers that mapped a segment before it moved keep their mapping.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

import storage_engine as se
from tensordb.catalog import Catalog
from tensordb.config import Config
from tensordb.errors import CorruptData, InvalidInput

from ._inputs import check_name

__all__ = ["ORDER", "EvictReport", "Placement", "Tiers", "check_tier_config",
           "device_of", "source_changed"]

#: tier names, fastest first: eviction moves bytes one step to the right
ORDER = ("gpu", "host", "disk")

#: what opening a segment gives: a private copy-on-write mapping of host or disk bytes,
#: or the shared CUDA IPC mapping of a GPU segment


@dataclass(frozen=True, slots=True)
class EvictReport:
    """What an eviction moved down a tier, and what it left because a pin holds it."""

    segments: int
    nbytes: int
    skipped_pinned: int


def source_changed(exc: se.SourceChanged, collection: str | None = None,
                   tensor: str | None = None) -> CorruptData:
    """The public error of a segment committed in place whose file changed: the version
    is not served (it names the file, and what changed)."""
    what = f"{collection}/{tensor}" if collection and tensor else \
        (collection or f"segment {exc.segment_id}")
    return CorruptData(f"{what}: {exc}", collection=collection, tensor=tensor)


def check_tier_config(config: Config) -> None:
    """Refuse a configuration naming a tier this node cannot have, before anything is
    opened."""
    if config.default_tier not in ("host", "disk", "gpu"):
        raise InvalidInput(f"default_tier must be 'host', 'disk' or 'gpu', not "
                           f"{config.default_tier!r}")
    if (config.default_tier == "gpu" or config.gpu_device is not None) \
            and not se.GpuTier.available():
        raise InvalidInput(f"the GPU tier is unavailable here: "
                           f"{se.GpuTier.unavailable_reason()}")


def device_of(device: str | torch.device | None, collection: str) -> torch.device | None:
    """``device`` checked and made definite (``cuda`` is the current CUDA device): where
    tensors are handed out, None for where they are stored."""
    if device is None:
        return None
    try:
        d = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise InvalidInput(f"device must be 'cpu', 'cuda' or 'cuda:N', not {device!r}",
                           collection=collection) from exc
    if d.type not in ("cpu", "cuda"):
        raise InvalidInput(f"device must be 'cpu' or a CUDA device, not {device!r}",
                           collection=collection)
    if d.type == "cuda":
        if not torch.cuda.is_available():
            raise InvalidInput(f"device {device!r}: this torch build has no CUDA device",
                               collection=collection)
        if d.index is None:
            d = torch.device("cuda", torch.cuda.current_device())
    return d


class Tiers(Mapping[str, se.Tier]):
    """This node's open tiers, by name (a mapping of those opened so far).

    The GPU tier is opened on first use: constructing it touches no CUDA, so a reader
    gets it the first time a row points at it; a process with ``Config.gpu_device``
    writes (and owns) GPU segments and opens it at once."""

    def __init__(self, config: Config,
                 sources: Callable[[str], se.SourceFile | None] | None = None,
                 extents: Callable[[str], Sequence[tuple[int, int, str, str]]] | None = None
                 ) -> None:
        self._config = config
        #: the integrity marks of the store (docs/storage.md, "Integrity model")
        self.marks = se.Marks(config.shm_dir / "integrity")
        #: this process's latency histograms of the host store (read by the exporter)
        self.latency = se.latency_log(config.shm_dir / "metrics")
        self._disk = se.DiskTier(config.data_dir, sources=sources, marks=self.marks,
                                 extents=extents)
        self._tiers: dict[str, se.Tier] = {
            "host": se.HostTier(config.shm_dir, capacity=config.host_capacity,
                                spare_bytes=config.spare_bytes,
                                pool_limit=config.pool_bytes, marks=self.marks),
            "disk": self._disk,
        }
        if config.gpu_device is not None:
            self._tiers["gpu"] = self._gpu()

    def __getitem__(self, name: str) -> se.Tier:
        return self._tiers[name]

    def __contains__(self, name: object) -> bool:
        return name in self._tiers

    def __iter__(self) -> Iterator[str]:
        return iter(self._tiers)

    def __len__(self) -> int:
        return len(self._tiers)

    @property
    def disk(self) -> se.DiskTier:
        """The disk tier, by the feature its callers use: segments committed in place
        (``adopt``), whose files ``sources`` (the catalog) records."""
        return self._disk

    @property
    def host(self) -> se.Prefaulting:
        """The host tier, by the optional feature the callers of this use: its spare."""
        tier = self._tiers["host"]
        assert isinstance(tier, se.Prefaulting)
        return tier

    def _gpu(self) -> se.Tier:
        tier = self._tiers.get("gpu")
        if tier is None:
            tier = self._tiers["gpu"] = se.GpuTier(
                self._config.shm_dir / "gpu", device=self._config.gpu_device or 0,
                capacity=self._config.gpu_capacity)
        return tier

    def store(self, name: str) -> se.Tier:
        """The tier a catalog row names (the GPU tier opened on first use)."""
        return self._gpu() if name == "gpu" else self._tiers[name]

    def open(self, name: str, segment_id: str) -> se.SegmentView:
        """A view of a segment of tier ``name`` (``SegmentMissing`` if not there)."""
        return self.store(name).open(segment_id)

    def tier(self, name: str) -> se.Tier:
        """The tier ``name`` to write to; InvalidInput for one this node lacks."""
        if name == "gpu" and "gpu" not in self._tiers and self._config.gpu_device is not None:
            return self._gpu()
        try:
            return self._tiers[name]
        except KeyError:
            raise InvalidInput(f"unknown tier {name!r}; this store has {sorted(self._tiers)}") from None

    def placement_tier(self, tier: str) -> str:
        """``tier`` checked as a place to pin in or evict from."""
        if tier not in ORDER:
            raise InvalidInput(f"unknown tier {tier!r}; tiers are {', '.join(ORDER)}")
        if tier not in self._tiers:
            raise InvalidInput(f"node {self._config.node!r} has no {tier} tier")
        return tier

    def below(self, tier: str) -> list[str]:
        """This node's tiers slower than ``tier``, fastest first."""
        return [t for t in ORDER[ORDER.index(tier) + 1 :] if t in self._tiers]

    def close(self) -> None:
        for tier in self._tiers.values():
            tier.close()
        self.marks.close()
        self.latency.release()  # mapped again, counts kept, at its next observation


class Placement:
    """Pins and evictions: a version's segments moved between this node's tiers and
    repointed in the catalog."""

    def __init__(self, catalog: Catalog, tiers: Tiers) -> None:
        self._catalog = catalog
        self._tiers = tiers

    def pin(self, collection: str, version: int | None, tag: str | None, tier: str) -> int:
        """Keep a version's bytes in ``tier`` (moving them there now); returns the
        pinned version. Idempotent."""
        check_name("collection", collection)
        tier = self._tiers.placement_tier(tier)
        had = set(self._catalog.pins())
        v = self._catalog.pin(collection, version, tag, tier)
        cid = self._catalog.require(collection).id
        try:
            for sid, at, _ in self._catalog.version_segments(cid, v):
                if at != tier:
                    self.move(sid, at, tier)
        except BaseException:  # a segment that cannot move (a changed in-place file)
            if (collection, v, tier) not in had:
                self._catalog.unpin(collection, v, None, tier)
            raise
        return v

    def unpin(self, collection: str, version: int | None, tag: str | None, tier: str) -> bool:
        check_name("collection", collection)
        return self._catalog.unpin(collection, version, tag, self._tiers.placement_tier(tier))

    def evict(self, collection: str, version: int | None, tag: str | None,
              tier: str) -> EvictReport:
        """Move a version's bytes from ``tier`` down to the next tier, except those a
        pin in ``tier`` holds."""
        check_name("collection", collection)
        tier = self._tiers.placement_tier(tier)
        below = self._tiers.below(tier)
        if not below:
            raise InvalidInput(f"cannot evict from the {tier} tier: no tier lies below it",
                               collection=collection)
        info, v = self._catalog.resolve(collection, version, tag)
        pinned = self._catalog.pinned_segments(tier)
        moved = nbytes = skipped = 0
        for sid, at, size in self._catalog.version_segments(info.id, v):
            if at != tier:
                continue
            if sid in pinned:
                skipped += 1
            elif self.move(sid, tier, below[0]):
                moved += 1
                nbytes += size
        return EvictReport(moved, nbytes, skipped)

    def move(self, segment_id: str, src: str, dst: str) -> bool:
        """Copy a segment to another tier, repoint the catalog, delete the old copy.

        Every extent is hashed as it is copied and compared with the catalog's checksum:
        the new copy is recorded as verified only for the bytes that matched, and an
        extent that fails is marked corrupt (the move still frees the old tier; the
        damage is refused in the new one). Readers that mapped the old copy keep it;
        readers that look the segment up after the move find it in ``dst``."""
        source = self._tiers.store(src)
        try:
            mm = self._tiers.open(src, segment_id)
        except se.SegmentMissing:
            return False
        except se.SourceChanged as exc:
            raise source_changed(exc) from exc
        extents = self._catalog.segment_extents(segment_id)
        writer = self._tiers.store(dst).create(segment_id, len(mm))
        try:
            bad = _copy_checked(writer.buffer, mm.host_bytes(), extents)
            del mm
            writer.finish()
            moved = self._catalog.move_segment(segment_id, src, dst)
        except BaseException:
            writer.abort()
            raise
        for offset, why in bad:  # found on the way: never served, in either tier
            self._tiers.marks.mark_corrupt(segment_id, offset, why)
        if not moved:  # someone else moved or dropped it first
            writer.abort()
            return False
        writer.release()
        source.delete(segment_id)
        return True


def _copy_checked(dst: np.ndarray, src: np.ndarray,
                  extents: Sequence[tuple[int, int, str, str]]) -> list[tuple[int, str]]:
    """Copy ``src`` into ``dst`` (uint8, same length), hashing each extent (offset,
    nbytes, checksum, what) as it is copied; the bytes between extents are copied as
    they are. Returns (offset, why) of each extent that fails, or lies past the end."""
    bad: list[tuple[int, str]] = []
    size = src.shape[0]
    pos = 0
    seen: set[tuple[int, int]] = set()
    for offset, nbytes, expected, what in sorted(extents):
        if not nbytes or (offset, nbytes) in seen:
            continue
        seen.add((offset, nbytes))
        if offset + nbytes > size:
            bad.append((offset, f"{what}: extent [{offset}, {offset + nbytes}) ends past "
                                f"the {size}-byte segment (truncated)"))
            continue
        if offset > pos:
            se.copy(dst[pos:offset], src[pos:offset])
        got = se.copy_and_checksum(dst[offset:offset + nbytes], src[offset:offset + nbytes])
        if got != expected:
            bad.append((offset, f"{what}: checksum {got} != {expected} (found while "
                                f"moving tiers)"))
        pos = max(pos, offset + nbytes)  # extents never overlap; were one to, it is recopied
    if pos < size:
        se.copy(dst[pos:size], src[pos:size])
    return bad
