"""How a ``WeightUpdater`` changes a module: which tensors, and by copy or by swap.

``identities`` names each stored tensor's extent, so two versions hold the same bytes
for a name exactly when they name the same extent (no byte read or hashed). ``plan``
checks a version against the module before anything is touched. Copy mode writes the
changed tensors into the module's memory (``copy_buckets``); swap mode repoints the
module's parameters at the version's zero-copy tensors (``repoint``), and ``SwapHold``
keeps the lease of the version in use while it retires the ones before in the
background.

Uses the public tensordb API only.
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

import tensordb
from tensordb.errors import InvalidInput

from ._torch import plan_dim, shard_bounds

__all__ = ["Ident", "Slicing", "SwapHold", "copy_buckets", "identities", "plan", "repoint"]


@dataclass(frozen=True, slots=True)
class Slicing:
    """An engine rank's part of each tensor: rank ``rank`` of ``world_size`` along the
    dim ``plan`` gives the name (torch.chunk's split), or the whole tensor (None). It
    reads only its part's bytes (``Snapshot.slice``), however the version was stored."""

    rank: int
    world_size: int
    plan: Mapping[str, int | None]

    def dim(self, name: str) -> int | None:
        return plan_dim(self.plan, name)

    def shape(self, name: str, shape: tuple[int, ...], collection: str = "") -> tuple[int, ...]:
        """The shape of this rank's part of a tensor of ``shape``; InvalidInput when the
        plan splits it along a dim it does not have."""
        d = self.dim(name)
        if d is None:
            return shape
        if not -len(shape) <= d < len(shape):
            raise InvalidInput(f"{collection}/{name}: the plan splits it along dim {d}, and "
                               f"it has shape {tuple(shape)}", collection=collection,
                               tensor=name)
        d %= len(shape)
        length = shard_bounds(shape[d], self.rank, self.world_size)[1]
        return tuple(length if i == d else n for i, n in enumerate(shape))

    def read(self, snap: tensordb.Snapshot, name: str) -> torch.Tensor:
        d = self.dim(name)
        if d is None:
            return snap[name]
        return snap.slice(name, rank=self.rank, world_size=self.world_size, dim=d)

#: (segment, offset, checksum, dtype, shape) of a stored tensor; an unknown one (None)
#: matches nothing, so its tensor is always applied
Ident = tuple[str | None, int, str, str, tuple[int, ...]] | None


def identities(snap: tensordb.Snapshot) -> dict[str, Ident]:
    """name -> (segment, offset, checksum, dtype, shape) of each tensor of ``snap``."""
    info = snap.info()
    return {n: (sid, off, csum, info[n][0], info[n][1])
            for n, (sid, off, csum) in snap.extents().items()}


def plan(snap: tensordb.Snapshot, targets: dict[str, torch.Tensor], *, collection: str,
         strict: bool, swap: bool, slicing: Slicing | None = None) -> list[str]:
    """The names to update; raises InvalidInput (naming the tensor) before anything
    is touched when the module and the version do not fit."""
    info = snap.info()
    names = [n for n in targets if n in info]
    if strict:
        missing = [n for n in targets if n not in info]
        extra = [n for n in info if n not in targets]
        if missing or extra:
            bad = (missing or extra)[0]
            raise InvalidInput(
                f"{collection} v{snap.version} does not match the module: missing "
                f"{missing[:10]}, unexpected {extra[:10]}", collection=collection,
                tensor=bad, version=snap.version)
    for n in names:
        dtype, shape, _ = info[n]
        if slicing is not None:
            shape = slicing.shape(n, tuple(shape), collection)
        cur = targets[n]
        if tuple(cur.shape) != tuple(shape):
            raise InvalidInput(
                f"{collection}/{n}: v{snap.version} has shape {tuple(shape)}, the "
                f"module's tensor {tuple(cur.shape)}", collection=collection,
                tensor=n, version=snap.version)
        if swap:
            if cur.device.type != "cpu":
                raise InvalidInput(
                    f"{collection}/{n}: swap mode repoints the module at host "
                    f"tensors, but the module's is on {cur.device}; use mode='copy'",
                    collection=collection, tensor=n, version=snap.version)
            if str(cur.dtype).removeprefix("torch.") != dtype:
                raise InvalidInput(
                    f"{collection}/{n}: swap mode cannot convert the stored "
                    f"{dtype} to the module's {cur.dtype}; use mode='copy'",
                    collection=collection, tensor=n, version=snap.version)
    return names


def copy_buckets(names: list[str], targets: dict[str, torch.Tensor],
                 snap: tensordb.Snapshot, bucket_bytes: int,
                 slicing: Slicing | None = None) -> int:
    """Copy in buckets of about ``bucket_bytes``; returns the bytes copied. Host tensors
    of the stored dtype are filled by ``Snapshot.read_into`` (kernel reads from the tier
    in parallel: the new version is never mapped here, so its pages cost no faults); the
    rest copy from the zero-copy views, a bucket's device copies queued without waiting
    and synchronised once at the bucket's end."""
    copied = 0
    bucket: list[str] = []
    size = 0
    info = snap.info()

    def flush() -> None:
        devices = set()
        direct: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for n in bucket:
                dst = targets[n].detach()
                if slicing is not None and slicing.dim(n) is not None:
                    dst.copy_(slicing.read(snap, n), non_blocking=dst.device.type == "cuda")
                    if dst.device.type == "cuda":
                        devices.add(dst.device)
                    continue
                if (dst.device.type == "cpu" and dst.is_contiguous()
                        and str(dst.dtype).removeprefix("torch.") == info[n][0]):
                    direct[n] = dst
                    continue
                dst.copy_(snap[n], non_blocking=dst.device.type == "cuda")
                if dst.device.type == "cuda":
                    devices.add(dst.device)
            if direct:
                snap.read_into(direct)
        for d in devices:  # the source pages may be dropped once the bucket is done
            torch.cuda.synchronize(d)

    for n in names:
        bucket.append(n)
        nbytes = info[n][2] if slicing is None or slicing.dim(n) is None else \
            targets[n].numel() * targets[n].element_size()
        size += nbytes
        copied += nbytes
        if size >= bucket_bytes:
            flush()
            bucket, size = [], 0
    if bucket:
        flush()
    return copied


def repoint(names: list[str], targets: dict[str, torch.Tensor],
            snap: tensordb.Snapshot, slicing: Slicing | None = None) -> None:
    """Point each named module tensor at ``snap``'s zero-copy tensor: no byte copied
    (a rank's part of a tensor stored in shards that split it otherwise is assembled)."""
    if slicing is not None:
        with torch.no_grad():
            for n in names:
                targets[n].data = slicing.read(snap, n)
        return
    stored = snap.state_dict()
    with torch.no_grad():
        for n in names:
            targets[n].data = stored[n]


class SwapHold:
    """Swap mode's leases: the snapshot of the version the module points at, and a
    background thread that closes the versions before it.

    Retiring happens off the apply path: releasing a lease is a catalog write, and
    dropping a version's tensors unmaps pages the module had faulted in (about 10 ms
    per GiB of page tables), neither of which the new version needs. Not locked: the
    updater calls it under its own lock.
    """

    __slots__ = ("snap", "retirer")

    def __init__(self) -> None:
        self.snap: tensordb.Snapshot | None = None
        self.retirer: ThreadPoolExecutor | None = None

    def hold(self, snap: tensordb.Snapshot) -> None:
        """Make ``snap`` the version in use; retire the one it replaces."""
        prev, self.snap = self.snap, snap
        if prev is not None:
            self._retire(prev)

    def detach(self) -> tuple[tensordb.Snapshot | None, ThreadPoolExecutor | None]:
        """Hand over the version in use and the retiring thread (for the caller to
        close outside its lock); the hold is empty afterwards."""
        snap, self.snap = self.snap, None
        retirer, self.retirer = self.retirer, None
        return snap, retirer

    def _retire(self, snap: tensordb.Snapshot) -> None:
        """Close ``snap`` and drop its tensors in the background (serially, in order)."""
        if self.retirer is None:
            self.retirer = ThreadPoolExecutor(1, thread_name_prefix="tensordb-retire")
        self.retirer.submit(snap.close)
        # the executor's work item holds the last reference: the snapshot, its cached
        # tensors and their mappings go when the close is done, in that thread
