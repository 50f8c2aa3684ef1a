"""How a ``WeightUpdater`` changes a module: which tensors, and by copy or by swap.

``identities`` names each stored tensor's extent, so two versions hold the same bytes
for a name exactly when they name the same extent (no byte read or hashed). ``plan``
checks a version against the module before anything is touched, and the updater then
checks every tensor it will apply (``checked_tensors``: rows, marks, checksums). Copy
mode writes those checked tensors into the module's memory (``copy_buckets``); swap
mode repoints the module's parameters at them (``repoint``), and ``SwapHold``
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
        """This rank's part of ``name`` (checked, when ``snap`` verifies: only the
        extents the part lies in are hashed)."""
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
                 sources: Mapping[str, torch.Tensor], bucket_bytes: int,
                 touched: list[str] | None = None) -> int:
    """Copy each named source (a checked tensor: ``checked_tensors``) into the module's
    tensor, in buckets of about ``bucket_bytes``; returns the bytes copied. A bucket's
    device copies are queued without waiting and synchronised once at its end (the
    source pages may be dropped then). ``touched`` collects each name as its copy
    starts: what a failure part-way must put back."""
    copied = 0
    size = 0
    devices: set[torch.device] = set()
    with torch.no_grad():
        for n in names:
            src = sources[n]
            dst = targets[n].detach()
            if touched is not None:
                touched.append(n)
            dst.copy_(src, non_blocking=dst.device.type == "cuda")
            if dst.device.type == "cuda":
                devices.add(dst.device)
            nbytes = dst.numel() * dst.element_size()
            size += nbytes
            copied += nbytes
            if size >= bucket_bytes:
                for d in devices:
                    torch.cuda.synchronize(d)
                devices.clear()
                size = 0
    for d in devices:
        torch.cuda.synchronize(d)
    return copied


def repoint(names: list[str], targets: dict[str, torch.Tensor],
            sources: Mapping[str, torch.Tensor]) -> None:
    """Point each named module tensor at its source (a checked zero-copy tensor of the
    new version): no byte copied. All or nothing: a failure part-way points the
    tensors already repointed back at what they held."""
    before: list[tuple[str, torch.Tensor]] = []
    with torch.no_grad():
        try:
            for n in names:
                before.append((n, targets[n].data))
                targets[n].data = sources[n]
        except BaseException:
            for n, t in reversed(before):
                targets[n].data = t
            raise


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
