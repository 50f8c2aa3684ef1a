"""Snapshots: one leased version of a collection, handed out as zero-copy tensors."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import torch

import storage_engine as se
from tensordb.arrow import LAYOUT, arrow_tensor, tensors_table
from tensordb.catalog import Commit, ShardRow, TensorRow, box_copies
from tensordb.errors import InvalidInput, NotFound, StoreClosed

from ._boxes import int_list, rank_box, run_of
from ._inputs import torch_dtype
from ._model_files import FILES_ROW, TensorRows, file_bytes, read_index
from ._read import Reader

__all__ = ["Shard", "Snapshot", "StateDict", "tensors_arrow"]


class Shard(NamedTuple):
    """A stored box of a tensor: ``offsets`` and ``shape`` within the global shape, and
    the rank of the group that wrote it (None for a tensor stored whole)."""

    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    rank: int | None


def _is_sharded(row: TensorRow) -> bool:
    """A sharded row has no segment of its own, and some bytes (in its shards)."""
    return row.segment_id is None and row.nbytes > 0


def _is_text(t: pa.DataType) -> bool:
    return bool(pa.types.is_string(t) or pa.types.is_large_string(t)
                or pa.types.is_string_view(t))


#: the columns ``tensors_arrow`` needs in a query result: (a test of its type, its name)
_QUERY_COLUMNS: dict[str, tuple[Callable[[pa.DataType], bool], str]] = {
    "collection": (_is_text, "a string"), "name": (_is_text, "a string"),
    "version": (pa.types.is_integer, "an integer")}


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
        #: the marks' count before any tensor of this snapshot was made: a tensor made
        #: earlier is looked at again when the count has moved since (a mark made after
        #: it was made refuses it, as a mark refuses a new read)
        self._gen = reader.marks_generation()
        self._counter = reader.marks_counter()
        self._store_open = store_open
        self.device = device
        self.collection = collection
        self._verify = verify
        self._lease, info, self.version, rows = self._catalog.open_snapshot(
            collection, version, tag, se.current_holder(), lease_ttl)
        self._rows = TensorRows(rows)  # the version's files are not among its tensors
        self._cache: dict[str, torch.Tensor] = {}
        self._maps: dict[str, se.SegmentView] = {}
        self._cid = info.id
        #: the shards of this version's sharded rows, looked up once for all of them
        self._shard_rows: dict[str, list[ShardRow]] | None = None
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
        return self._rows.nbytes

    def files(self) -> dict[str, int]:
        """The version's files (a model folder's configs, tokenizer, chat templates:
        ``Transaction.put_files``), name -> bytes. Maps nothing until one is read."""
        self._check()
        row = self._rows.files_row
        return {} if row is None else {
            n: e.nbytes for n, e in read_index(self._files_pack(row), self._where())[1].items()}

    def file(self, name: str) -> bytes:
        """One file's bytes, checked against its checksum (CorruptData); NotFound where
        the version has no such file."""
        self._check()
        row = self._rows.files_row
        if row is None:
            raise NotFound(f"{self._where()} has no file {name!r}", collection=self.collection,
                           version=self.version)
        return file_bytes(self._files_pack(row), name, self._where())

    def _files_pack(self, row: TensorRow) -> np.ndarray:
        got = self._reader.materialize(self.collection, [row], verify=self._verify,
                                       maps=self._maps, shards=None)[FILES_ROW]
        return got.numpy()

    def _where(self) -> str:
        return f"collection {self.collection!r} version {self.version}"

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
        if t is not None:
            c = self._counter  # a mark made since the snapshot opened: looked at again
            if (c[0] if c is not None else self._reader.marks_generation()) != self._gen:
                self._refuse_marked([name])
        else:
            row = self._rows.get(name)
            if row is None:
                raise NotFound(f"collection {self.collection!r} version {self.version} has no "
                               f"tensor {name!r}", collection=self.collection, tensor=name,
                               version=self.version)
            t = self._cache[name] = self._place(self._reader.materialize(
                self.collection, [row], verify=self._verify, maps=self._maps,
                shards=self._all_shards() if _is_sharded(row) else None)[name])
        return t

    def _marks_moved(self) -> bool:
        """Whether a corrupt mark was made on the host since the snapshot opened."""
        counter = self._counter
        now = counter[0] if counter is not None else self._reader.marks_generation()
        return bool(now != self._gen)

    def _refuse_marked(self, names: Iterable[str]) -> None:
        """CorruptData for the first of ``names`` (tensors this snapshot made earlier)
        whose extents, or any of whose shards, were marked corrupt since: no read begun
        after a mark returns its bytes, also from this snapshot's own cache."""
        marks: dict[str, dict[int, str] | None] = {}
        for name in names:
            row = self._rows[name]
            if _is_sharded(row):
                parts = [(sh.segment_id, sh.offset) for sh in self._shards_of(row)]
            else:
                parts = [(row.segment_id, row.offset)]
            self._refuse_extents(name, parts, marks)

    def _refuse_extents(self, name: str, extents: Iterable[tuple[str | None, int]],
                        marks: dict[str, dict[int, str] | None]) -> None:
        """CorruptData naming ``name`` when one of its ``extents`` (segment id, start) is
        marked corrupt; ``marks`` holds the segments' marks looked up so far."""
        for sid, offset in extents:
            if sid is None:
                continue
            if sid not in marks:
                marks[sid] = self._reader.marked(sid)
            self._reader.refuse(self.collection, name, sid, offset, marks[sid])

    def verified(self, name: str) -> torch.Tensor:
        """The tensor ``name`` with its bytes (each shard's, for a sharded tensor)
        checked against their checksums now, whatever the snapshot's ``verify``
        (CorruptData naming it)."""
        self._check()
        row = self._row(name)
        return self._place(self._reader.materialize(
            self.collection, [row], verify=True, maps=self._maps,
            shards=self._all_shards() if _is_sharded(row) else None)[name])

    def _all_shards(self) -> dict[str, list[ShardRow]]:
        """The shards of every sharded row of the version (one catalog query, the first
        time a sharded row is read)."""
        if self._shard_rows is None:
            sharded = self._rows.sharded_rows()
            self._shard_rows = self._catalog.shards(self._cid, sharded) if sharded else {}
        return self._shard_rows

    def _shards_of(self, row: TensorRow) -> list[ShardRow]:
        return self._all_shards().get(row.name, [])

    def shards(self, name: str) -> list[Shard]:
        """How the tensor is stored: its shards' boxes (offsets and shape in the global
        shape) and the ranks that wrote them; a tensor stored whole is one box covering
        it. Maps nothing."""
        self._check()
        row = self._row(name)
        if not _is_sharded(row):
            return [Shard((0,) * len(row.shape), row.shape, None)]
        return [Shard(s.offsets, s.shape, s.rank) for s in self._shards_of(row)]

    def slice(self, name: str, *, offsets: Sequence[int] | None = None,
              shape: Sequence[int] | None = None, rank: int | None = None,
              world_size: int | None = None, dim: int = 0,
              out: torch.Tensor | None = None) -> torch.Tensor:
        """A box of the tensor, reading only that box's bytes: ``offsets`` and ``shape``,
        or rank ``rank`` of ``world_size`` parts along ``dim`` (as torch.chunk splits
        it). A zero-copy view when the tensor is stored whole or one shard holds the box
        (strided where the box is); else a new tensor filled from the shards that meet
        it. ``out``: a contiguous CPU tensor of the box's dtype and shape to fill instead
        (returned): the parts of the box that are one run of bytes in their extent are
        read into it by the kernel, without mapping them here (no page faults on the
        source side), the rest copied from the views."""
        self._check()
        row = self._row(name)
        where = f"{self.collection}/{name}"
        nd = len(row.shape)
        if rank is not None or world_size is not None:
            if offsets is not None or shape is not None:
                raise InvalidInput(f"{where}: give offsets and shape, or rank and world_size, "
                                   f"not both", collection=self.collection, tensor=name)
            off, shp = rank_box(row.shape, rank, world_size, dim, where, self.collection)
        else:
            if offsets is None or shape is None:
                raise InvalidInput(f"{where}: slice needs offsets and shape (or rank and "
                                   f"world_size)", collection=self.collection, tensor=name)
            off = int_list("offsets", offsets, nd, where, self.collection)
            shp = int_list("shape", shape, nd, where, self.collection)
        for d in range(nd):
            if off[d] < 0 or shp[d] < 0 or off[d] + shp[d] > row.shape[d]:
                raise InvalidInput(f"{where}: the box at offsets {list(off)} with shape "
                                   f"{list(shp)} lies outside its shape {list(row.shape)}",
                                   collection=self.collection, tensor=name)
        if out is not None:
            return self._slice_into(row, off, shp, out)
        if not _is_sharded(row):
            return self[name][tuple(slice(o, o + n) for o, n in zip(off, shp, strict=True))]
        t = self._reader.region(self.collection, row, self._shards_of(row), off, shp,
                                verify=self._verify, maps=self._maps)
        return self._place(t)

    def _slice_into(self, row: TensorRow, off: tuple[int, ...], shp: tuple[int, ...],
                    out: torch.Tensor) -> torch.Tensor:
        """``slice(..., out=out)``: each stored extent's part of the box, by kernel read
        where it is one run of bytes in the extent and in ``out``, else by a copy."""
        where = f"{self.collection}/{row.name}"
        if not isinstance(out, torch.Tensor) or out.device.type != "cpu" \
                or not out.is_contiguous() or out.dtype != torch_dtype(row.dtype) \
                or tuple(out.shape) != shp:
            got = (f"{str(out.dtype).removeprefix('torch.')}{list(out.shape)} on {out.device}"
                   f"{'' if out.is_contiguous() else ', not contiguous'}"
                   if isinstance(out, torch.Tensor) else type(out).__name__)
            raise InvalidInput(f"{where}: out must be a contiguous CPU tensor of "
                               f"{row.dtype}{list(shp)}, not {got}",
                               collection=self.collection, tensor=row.name)
        if self._verify or not out.numel():  # a verified read checks whole extents
            with torch.no_grad():
                out.copy_(self.slice(row.name, offsets=off, shape=shp))
            return out
        item = out.element_size()
        if _is_sharded(row):
            shards = self._shards_of(row)
            boxes = [(sh.offsets, sh.shape, sh.segment_id, sh.offset, sh.tier) for sh in shards]
        else:
            boxes = [((0,) * len(row.shape), row.shape, row.segment_id, row.offset, row.tier)]
        flat = out.reshape(-1).view(torch.uint8).numpy()
        runs: list[tuple[TensorRow, Any]] = []
        copies: list[tuple[int, tuple[slice, ...], tuple[slice, ...]]] = []
        for i, src, dst in box_copies([(b[0], b[1]) for b in boxes], off, shp):
            bshape = boxes[i][1]
            s_run = run_of(bshape, src)
            d_run = run_of(shp, dst)
            if s_run is None or d_run is None:
                copies.append((i, src, dst))
                continue
            (s_start, n), (d_start, _) = s_run, d_run
            _, _, sid, base, tier = boxes[i]
            pseudo = TensorRow(row.name, row.dtype, (n,), n * item, "", sid,
                               base + s_start * item, tier, row.first_version)
            runs.append((pseudo, flat[d_start * item:(d_start + n) * item]))
        # the marks are keyed by whole extents (a run is part of one): looked up by the
        # extent's start before the read, and again after it, since the first open of a
        # disk segment (inside the read) may have marked the extent just now
        met = [(boxes[i][2], boxes[i][3])
               for i in {i for i, _, _ in box_copies([(b[0], b[1]) for b in boxes], off, shp)}]
        self._refuse_extents(row.name, met, {})
        left = {id(r) for r in self._reader.read_into(self.collection, runs, verify=False)}
        with torch.no_grad():
            for r, dst_bytes in runs:
                if id(r) in left:  # a tier that cannot read by the kernel: from a view
                    view = self._view(r).host_bytes(r.offset, r.nbytes)
                    dst_bytes[:] = np.frombuffer(view, np.uint8)
            for i, src, dst in copies:
                if _is_sharded(row):
                    sh = self._shards_of(row)[i]
                    piece = self._reader.shard_view(self.collection, row, sh, verify=False,
                                                    maps=self._maps)[src]
                else:
                    piece = self[row.name][src]
                out[dst].copy_(piece)
        self._refuse_extents(row.name, met, {})
        return out

    def _place(self, t: torch.Tensor) -> torch.Tensor:
        """The tensor on the snapshot's device: itself when it is there (zero-copy)."""
        if self.device is None or t.device == self.device:
            return t
        return t.to(self.device)

    def state_dict(self) -> StateDict:
        """Every tensor of the version, by name, zero-copy (copied once to ``device``
        for rows stored elsewhere): a read-only mapping whose tensors are made when first
        asked for (a version of 100,000 tensors hands its mapping out at once; walking
        it builds them in bulk). The version's segments are mapped now, so the mapping
        stays usable after the snapshot is closed, as the tensors do. A verifying
        snapshot makes (and so checks) every tensor now: CorruptData here, not later."""
        self._check()
        for r in self._rows.first_of_segments():
            self._view(r)
        if self._rows.has_sharded():
            # the shards' segments too, and where the shards are: the mapping must not
            # need the catalog (nor the lease) after the snapshot is closed
            for name, parts in self._all_shards().items():
                row = self._rows[name]
                for sh in parts:
                    if sh.segment_id is not None and sh.segment_id not in self._maps:
                        self._maps[sh.segment_id] = self._reader.map(
                            sh.segment_id, sh.tier or "host", self.collection, row.name)
        sd = StateDict(self, dict(self._maps))
        if self._verify:
            sd._all()
        return sd

    def _materialize(self, names: Sequence[str] | None, maps: dict[str, se.SegmentView]
                     ) -> None:
        """Make the tensors of ``names`` (None: every one) that are not made yet."""
        rows, cache = self._rows, self._cache
        with se.gc_paused():  # an object or two per tensor: see gc_paused
            if names is not None:
                missing: list[Any] = [rows[n] for n in names if n not in cache]
            else:
                # a walk over every name makes the rows mapped in place; a sharded row
                # (no segment, some bytes) is assembled only when asked for by name, as
                # a caller reading its slices never wants the whole of it
                missing = [t for t in rows.tuples()
                           if t[0] not in cache and (t[5] is not None or not t[3])]
            if not missing:
                return
            sharded = any(t[5] is None and t[3] for t in missing)
            got = self._reader.materialize(self.collection, missing, verify=self._verify,
                                           maps=maps,
                                           shards=self._all_shards() if sharded else None)
            if self.device is None:
                cache.update(got)
            else:
                cache.update((n, self._place(t)) for n, t in got.items())

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

    # -- Arrow (docs/arrow.md) ---------------------------------------------------------
    def to_arrow(self, names: Sequence[str] | None = None) -> pa.Table:
        """The version as an Arrow table, a row per tensor (``tensordb.arrow``'s layout:
        name, dtype, shape, nbytes, checksum, data). ``data`` values are slices of the
        same mappings the torch views use: no copy on the host (GPU-tier rows: a host
        copy). They stay valid after ``close``, as the torch views do. ``names``: those
        tensors only, in that order (NotFound naming any the version lacks)."""
        self._check()
        rows = self._select(names)
        views = self._views(rows)
        return tensors_table(rows, lambda segment_id, _tier: views[segment_id],
                             collection=self.collection, version=self.version,
                             whole_of=self._whole_bytes)

    def _whole_bytes(self, row: TensorRow) -> pa.Buffer:
        """A sharded row's bytes, assembled (on the host)."""
        t = self[row.name].cpu()
        return pa.py_buffer(t.reshape(-1).view(torch.uint8).numpy())

    def arrow(self, name: str) -> pa.Tensor:
        """One tensor as a ``pyarrow.Tensor`` over its stored bytes, no copy on the host.
        Dtypes Arrow has no tensor type for (bool, bfloat16, float8, float4, complex)
        come back as their bytes, unsigned integers of the element's width (complex128:
        a trailing dimension of 16 uint8); ``info()`` or ``to_arrow`` name the dtype."""
        self._check()
        row = self._row(name)
        if _is_sharded(row):
            return arrow_tensor(row, self._whole_bytes(row))
        if row.segment_id is None or row.nbytes == 0:
            return arrow_tensor(row, pa.py_buffer(b""))
        assert row.segment_id is not None
        data = pa.py_buffer(self._reader.checked_bytes(
            self.collection, row, self._view(row), verify=self._verify,
            bad=self._reader.marked(row.segment_id)))
        return arrow_tensor(row, data)

    def _row(self, name: object) -> TensorRow:
        row = self._rows.get(name) if isinstance(name, str) else None
        if row is None:
            if not isinstance(name, str):
                raise InvalidInput(f"a tensor name must be a str, not {type(name).__name__}",
                                   collection=self.collection)
            raise NotFound(f"collection {self.collection!r} version {self.version} has no "
                           f"tensor {name!r}", collection=self.collection, tensor=name,
                           version=self.version)
        return row

    def _select(self, names: Sequence[str] | None) -> list[TensorRow]:
        """The rows ``names`` picks, in its order (every row for None)."""
        if names is None:
            return list(self._rows.values())
        if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
            raise InvalidInput("names must be a list of tensor names (str), or None",
                               collection=self.collection)
        if len(set(names)) != len(names):
            dup = next(n for i, n in enumerate(names) if n in names[:i])
            raise InvalidInput(f"names lists {dup!r} twice", collection=self.collection,
                               tensor=dup)
        missing = [n for n in names if n not in self._rows]
        if missing:
            shown = ", ".join(repr(n) for n in missing[:5]) + (", ..." if len(missing) > 5 else "")
            raise NotFound(f"collection {self.collection!r} version {self.version} has no "
                           f"tensor {shown}", collection=self.collection, tensor=missing[0],
                           version=self.version)
        return [self._rows[n] for n in names]

    def _view(self, row: TensorRow) -> se.SegmentView:
        """The row's segment, mapped once per snapshot (the torch views share it)."""
        assert row.segment_id is not None
        mm = self._maps.get(row.segment_id)
        if mm is None:
            mm = self._maps[row.segment_id] = self._reader.map(
                row.segment_id, row.tier or "host", self.collection, row.name)
        return mm

    def _views(self, rows: Sequence[TensorRow]) -> dict[str, se.SegmentView]:
        """segment id -> its view, for the segments of ``rows`` (the snapshot's own
        mappings); each row's bytes checked against its checksum when the snapshot
        verifies."""
        out: dict[str, se.SegmentView] = {}
        marks: dict[str, dict[int, str] | None] = {}
        for row in rows:
            if row.segment_id is None or row.nbytes == 0:
                continue
            view = out.get(row.segment_id)
            if view is None:
                view = out[row.segment_id] = self._view(row)
                marks[row.segment_id] = self._reader.marked(row.segment_id)
            self._reader.checked_bytes(self.collection, row, view, verify=self._verify,
                                       bad=marks[row.segment_id])
        return out

    def info(self) -> dict[str, tuple[str, tuple[int, ...], int]]:
        """name -> (dtype, shape, nbytes), without mapping anything."""
        return {n: (r.dtype, r.shape, r.nbytes) for n, r in self._rows.items()}

    def extents(self) -> dict[str, tuple[str | None, int, str]]:
        """name -> (segment id, offset, checksum): where each tensor's bytes lie.

        Rows are immutable and a commit shares unchanged tensors' extents, so a tensor
        holds the same bytes in two versions exactly when its extent is the same (a
        tensor of no bytes has no segment). Maps nothing."""
        return {n: (r.segment_id, r.offset, r.checksum) for n, r in self._rows.items()}


class StateDict(Mapping[str, torch.Tensor]):
    """``Snapshot.state_dict()``: a version's tensors by name, made on first access.

    A mapping, not a dict: ``len``, ``in`` and iterating the names cost nothing per
    tensor; ``sd[name]`` makes one tensor; ``values()``, ``items()`` and a walk over
    many names make them all at once, column by column, which is what a caller that
    touches everything pays (``dict(sd)`` is a plain dict of them). It holds the
    version's mappings, so it works after the snapshot is closed."""

    #: single look-ups after which the rest are made in one go (a walk by name)
    _BULK_AFTER = 64

    def __init__(self, snap: Snapshot, maps: dict[str, se.SegmentView]) -> None:
        self._snap = snap
        self._maps = maps
        self._misses = 0

    def __len__(self) -> int:
        return len(self._snap._rows)

    def __iter__(self) -> Iterator[str]:
        return iter(self._snap._rows)

    def __contains__(self, name: object) -> bool:
        return name in self._snap._rows

    def __getitem__(self, name: str) -> torch.Tensor:
        snap = self._snap
        t = snap._cache.get(name)
        if t is not None:
            c = snap._counter  # a mark made since the snapshot opened: looked at again
            if (c[0] if c is not None else snap._reader.marks_generation()) != snap._gen:
                snap._refuse_marked([name])
            return t
        if name not in snap._rows:
            raise NotFound(f"collection {snap.collection!r} version {snap.version} has no "
                           f"tensor {name!r}", collection=snap.collection, tensor=name,
                           version=snap.version)
        self._misses += 1
        bulk = self._misses > self._BULK_AFTER
        snap._materialize(None if bulk else [name], self._maps)
        t = snap._cache.get(name)
        if t is None:  # sharded: made by name only; a walk by name makes them all at once
            snap._materialize([n for n in snap._rows if n not in snap._cache] if bulk
                              else [name], self._maps)
            t = snap._cache[name]
        return t

    def _all(self) -> dict[str, torch.Tensor]:
        snap = self._snap
        if snap._cache and snap._marks_moved():
            snap._refuse_marked(list(snap._cache))  # made before a mark
        snap._materialize(None, self._maps)
        cache = snap._cache
        if len(cache) < len(snap._rows):  # the sharded rows, assembled
            snap._materialize([n for n in snap._rows if n not in cache], self._maps)
        if len(cache) == len(snap._rows) and not self._misses:
            return dict(cache)  # made in one go, in the manifest's (name) order
        return {n: cache[n] for n in snap._rows}

    def values(self) -> Any:
        return self._all().values()

    def items(self) -> Any:
        return self._all().items()

    def __eq__(self, other: object) -> bool:
        if isinstance(other, StateDict):
            other = other._all()
        return self._all() == other if isinstance(other, Mapping) else NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return (f"StateDict({self._snap.collection!r} v{self._snap.version}, "
                f"{len(self)} tensors)")


def _query_rows(result: object) -> list[tuple[str, str, int]]:
    """(collection, name, version) of each row of a query result; InvalidInput naming
    the column that is missing, of the wrong type or null."""
    if not isinstance(result, pa.Table):
        raise InvalidInput(f"tensors_arrow takes the pyarrow.Table of a query, not "
                           f"{type(result).__name__}")
    for column, (type_ok, kind) in _QUERY_COLUMNS.items():
        if column not in result.column_names:
            raise InvalidInput(f"the query result has no {column!r} column (it needs "
                               f"collection, name and version; columns: "
                               f"{', '.join(result.column_names) or 'none'})")
        col = result.column(column)
        if not type_ok(col.type):
            raise InvalidInput(f"the query result's {column!r} column is {col.type}, not "
                               f"{kind}")
        if col.null_count:
            raise InvalidInput(f"the query result's {column!r} column has nulls")
    return list(zip(*(result.column(c).to_pylist() for c in _QUERY_COLUMNS), strict=True))


def _rows_of(open_snapshot: Callable[[str, int | None], Snapshot], collection: str,
             version: int, names: list[str]
             ) -> tuple[dict[str, TensorRow], dict[str, se.SegmentView], dict[str, pa.Buffer]]:
    """The rows ``names`` of (collection, version), their segments' views and the bytes
    of the sharded ones among them, assembled. A version
    retention has dropped is read from the head where the head still holds the same row
    (the one that version wrote: same first version), as the ``tensors`` table shows it."""
    try:
        snap = open_snapshot(collection, version)
        from_head = False
    except NotFound as exc:
        if exc.version != version or exc.tensor is not None:
            raise
        snap, from_head = open_snapshot(collection, None), True
    with snap:
        rows = snap._select(names)
        if from_head:
            gone = [r.name for r in rows if r.first_version != version]
            if gone:
                raise NotFound(f"version {version} of collection {collection!r} is gone and "
                               f"the head no longer holds its {gone[0]!r}",
                               collection=collection, tensor=gone[0], version=version)
        wholes = {r.name: snap._whole_bytes(r) for r in rows if _is_sharded(r)}
        return {r.name: r for r in rows}, snap._views(rows), wholes


def tensors_arrow(open_snapshot: Callable[[str, int | None], Snapshot], result: object
                  ) -> pa.Table:
    """``Database.tensors_arrow``: the to_arrow layout of the rows a query selected,
    with ``collection`` and ``version`` columns, in the query's row order. One snapshot
    per (collection, version), closed before returning: the buffers keep their
    mappings, as torch views do."""
    wanted = _query_rows(result)
    groups: dict[tuple[str, int], list[str]] = {}
    for c, n, v in wanted:
        names = groups.setdefault((c, v), [])
        if n not in names:
            names.append(n)
    found: dict[tuple[str, int], dict[str, TensorRow]] = {}
    views: dict[str, se.SegmentView] = {}
    wholes: dict[int, pa.Buffer] = {}  # by id of the row: the same name may be in two
    for (c, v), names in groups.items():
        found[(c, v)], got, assembled = _rows_of(open_snapshot, c, v, names)
        views.update(got)  # a segment id names one segment, whatever the collection
        wholes.update((id(found[(c, v)][n]), b) for n, b in assembled.items())
    rows = [found[(c, v)][n] for c, n, v in wanted]
    table = tensors_table(rows, lambda segment_id, _tier: views[segment_id],
                          collection="", version=0, whole_of=lambda r: wholes[id(r)])
    table = table.add_column(0, pa.field("collection", pa.string(), nullable=False),
                             pa.array([c for c, _, _ in wanted], pa.string()))
    table = table.add_column(2, pa.field("version", pa.int64(), nullable=False),
                             pa.array([v for _, _, v in wanted], pa.int64()))
    return table.replace_schema_metadata({"tensordb.layout": LAYOUT})
