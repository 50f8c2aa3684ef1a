"""Snapshots: one leased version of a collection, handed out as zero-copy tensors."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

import torch

import storage_engine as se
from tensordb.catalog import Commit
from tensordb.errors import InvalidInput, NotFound, StoreClosed

from ._inputs import torch_dtype
from ._read import Reader

__all__ = ["Snapshot"]


class Snapshot:
    """One version of a collection, leased until ``close`` so gc keeps it.

    Tensors are zero-copy views, created when first asked for; they stay valid after
    the snapshot is closed.
    """

    def __init__(self, reader: Reader, collection: str, version: int | None, tag: str | None,
                 verify: bool, device: torch.device | None, *, lease_ttl: float,
                 store_open: Callable[[], bool]) -> None:
        self._reader = reader
        self._catalog = reader.catalog
        self._store_open = store_open
        self.device = device
        self.collection = collection
        self._verify = verify
        self._lease, _, self.version, rows = self._catalog.open_snapshot(
            collection, version, tag, se.current_holder(), lease_ttl)
        self._rows = {r.name: r for r in rows}
        self._cache: dict[str, torch.Tensor] = {}
        self._maps: dict[str, se.SegmentView] = {}
        self._closed = False

    def __enter__(self) -> Snapshot:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """End the lease. Idempotent."""
        if not self._closed:
            self._closed = True
            self._maps = {}  # tensors handed out keep their own mapping alive
            if self._store_open():
                self._catalog.release_lease(self._lease)

    def __iter__(self) -> Iterator[str]:
        return iter(self._rows)

    def __len__(self) -> int:
        return len(self._rows)

    def __contains__(self, name: object) -> bool:
        return name in self._rows

    def keys(self) -> list[str]:
        return list(self._rows)

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self._rows.values())

    @property
    def commit(self) -> Commit:
        return self._catalog.commit_info(self.collection, self.version)

    def _check(self) -> None:
        if self._closed:
            raise StoreClosed(f"the snapshot of {self.collection!r} v{self.version} is closed",
                              collection=self.collection, version=self.version)

    def __getitem__(self, name: str) -> torch.Tensor:
        self._check()
        t = self._cache.get(name)
        if t is None:
            row = self._rows.get(name)
            if row is None:
                raise NotFound(f"collection {self.collection!r} version {self.version} has no "
                               f"tensor {name!r}", collection=self.collection, tensor=name,
                               version=self.version)
            t = self._cache[name] = self._place(self._reader.materialize(
                self.collection, [row], verify=self._verify, maps=self._maps)[name])
        return t

    def _place(self, t: torch.Tensor) -> torch.Tensor:
        """The tensor on the snapshot's device: itself when it is there (zero-copy)."""
        if self.device is None or t.device == self.device:
            return t
        return t.to(self.device)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Every tensor of the version, by name, zero-copy (copied once to ``device``
        for rows stored elsewhere)."""
        self._check()
        missing = [r for n, r in self._rows.items() if n not in self._cache]
        if missing:
            got = self._reader.materialize(self.collection, missing, verify=self._verify,
                                           maps=self._maps)
            self._cache.update((n, self._place(t)) for n, t in got.items())
        return {n: self._cache[n] for n in self._rows}

    def read_into(self, outs: Mapping[str, torch.Tensor]) -> int:
        """Copy tensors of this version into the caller's own host tensors, by name, and
        return the bytes copied.

        Each ``out`` must be a contiguous CPU tensor of the stored dtype and shape. The
        bytes are read from the tier by the kernel, in parallel, without mapping the
        version into this process: no page faults on the source side, which is what a
        copy from the zero-copy views pays. Nothing is written before every name and
        buffer has been checked (NotFound, InvalidInput naming the tensor).
        """
        self._check()
        if not isinstance(outs, Mapping):
            raise InvalidInput(f"outs must map tensor names to tensors, not "
                               f"{type(outs).__name__}", collection=self.collection)
        pairs = []
        for name, out in outs.items():
            row = self._rows.get(name)
            if row is None:
                raise NotFound(f"collection {self.collection!r} version {self.version} has "
                               f"no tensor {name!r}", collection=self.collection,
                               tensor=name, version=self.version)
            where = f"{self.collection}/{name}"
            if not isinstance(out, torch.Tensor) or out.device.type != "cpu" \
                    or not out.is_contiguous():
                raise InvalidInput(f"{where}: read_into needs a contiguous CPU tensor to fill",
                                   collection=self.collection, tensor=name)
            if out.dtype != torch_dtype(row.dtype) or tuple(out.shape) != tuple(row.shape):
                raise InvalidInput(
                    f"{where}: stored as {row.dtype}{list(row.shape)}, the buffer is "
                    f"{str(out.dtype).removeprefix('torch.')}{list(out.shape)}",
                    collection=self.collection, tensor=name, version=self.version)
            pairs.append((row, out))
        flat = [(row, out.detach().reshape(-1).view(torch.uint8).numpy()) for row, out in pairs]
        left = {r.name for r in self._reader.read_into(self.collection, flat,
                                                       verify=self._verify)}
        total = 0
        for row, out in pairs:
            if row.name in left:
                with torch.no_grad():
                    out.copy_(self[row.name])
            total += row.nbytes
        return total

    def info(self) -> dict[str, tuple[str, tuple[int, ...], int]]:
        """name -> (dtype, shape, nbytes), without mapping anything."""
        return {n: (r.dtype, r.shape, r.nbytes) for n, r in self._rows.items()}

    def extents(self) -> dict[str, tuple[str | None, int, str]]:
        """name -> (segment id, offset, checksum): where each tensor's bytes lie.

        Rows are immutable and a commit shares unchanged tensors' extents, so a tensor
        holds the same bytes in two versions exactly when its extent is the same (a
        tensor of no bytes has no segment). Maps nothing."""
        return {n: (r.segment_id, r.offset, r.checksum) for n, r in self._rows.items()}
