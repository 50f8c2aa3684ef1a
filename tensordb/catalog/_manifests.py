"""Packed manifests: a large version's rows as one Arrow IPC file, mapped zero-copy.

A snapshot of a 100,000-tensor version read its rows from SQL in 300-700 ms (the
database hands out a Python tuple per row, and a ``TensorRow`` was built from each).
Versions are immutable, so the rows of one can be packed once into a file and mapped
by every later opener on the host, as Lance keeps its manifests: opening is then a
constant number of small queries (resolve, lease, the commit's id, its segments' tiers)
and a map, whatever the version's size. The ``tensors`` table stays the truth, and the
rows stay queryable there; the file is a cache of them:

* keyed by the commit's ``txn_id`` (unique per commit, never reused; a version dropped
  and written again is another commit), so a file can never describe other rows;
* written whole under a temporary name and renamed into place; its last 16 bytes are
  the xxh3 of the rest, checked at every load, so a torn or damaged file is rebuilt
  from SQL, never believed;
* only for versions of at least ``PACK_MIN_ROWS`` rows: smaller ones come from SQL as
  fast as from a file;
* built by the writer after its commit, from the previous version's file and the rows
  it changed (in the background: the commit returns first and costs what it changed),
  or by the first opener that finds none;
* the segments' tiers are not in it (a segment moves tiers); the opener reads them;
* files of commits gc dropped are deleted by ``prune``.
"""

from __future__ import annotations

import functools
import os
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import xxhash

from ._common import NewTensor, TensorRow, parse_shape, shape_text

__all__ = ["Manifest", "Manifests", "PACK_MIN_ROWS"]

#: versions with fewer rows are read from SQL (a 1,000-row version takes ~5 ms there)
PACK_MIN_ROWS = 2000

_SCHEMA = pa.schema([
    ("name", pa.string()), ("dtype", pa.string()), ("shape", pa.string()),
    ("nbytes", pa.int64()), ("checksum", pa.string()), ("segment_id", pa.string()),
    ("offset", pa.int64()), ("first_version", pa.int64())])
_TRAILER = 16  # hex digits of the xxh3-64 of the IPC bytes before them


class Manifest(Mapping[str, TensorRow]):
    """The rows of one version by name, in name order: from SQL (a dict of rows) or
    from a packed file (Arrow columns, turned into ``TensorRow`` values only when asked
    for: ``len``, ``nbytes`` and ``segment_ids`` cost nothing per row)."""

    def __init__(self, rows: Sequence[TensorRow] | None = None, *,
                 table: pa.Table | None = None, tiers: Mapping[str, str] | None = None) -> None:
        self._table = table
        self._tiers = dict(tiers or {})
        self._rows: dict[str, TensorRow] | None = (
            {r.name: r for r in rows} if rows is not None else None)
        self._index: dict[str, int] | None = None
        self._names: list[str] | None = None
        self._columns: list[list[Any]] | None = None

    def set_tiers(self, tiers: Mapping[str, str]) -> None:
        """The tiers of the rows' segments (segment id -> tier), read after the rows: a
        packed file does not hold them, as a segment moves between tiers."""
        self._tiers = dict(tiers)

    @property
    def packed(self) -> bool:
        """Whether the rows come from a packed file."""
        return self._table is not None

    def __len__(self) -> int:
        if self._rows is not None:
            return len(self._rows)
        assert self._table is not None
        return self._table.num_rows

    def names(self) -> list[str]:
        """The tensor names, in name order."""
        if self._rows is not None:
            return list(self._rows)
        if self._names is None:
            assert self._table is not None
            self._names = self._table.column("name").to_pylist()
        return self._names

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __contains__(self, name: object) -> bool:
        if self._rows is not None:
            return name in self._rows
        return isinstance(name, str) and name in self._name_index()

    def _name_index(self) -> dict[str, int]:
        if self._index is None:
            self._index = {n: i for i, n in enumerate(self.names())}
        return self._index

    def _row(self, i: int) -> TensorRow:
        cols = self._columns
        if cols is not None:
            name, dtype, shape, nbytes, csum, seg, off, first = (col[i] for col in cols)
        else:  # one row: its cells, without converting whole columns
            assert self._table is not None
            name, dtype, shape, nbytes, csum, seg, off, first = (
                self._table.column(k)[i].as_py() for k in range(8))
        return TensorRow(name, dtype, parse_shape(shape), nbytes, csum, seg, off,
                         self._tiers.get(seg) if seg is not None else None, first)

    def __getitem__(self, name: str) -> TensorRow:
        if self._rows is not None:
            return self._rows[name]
        i = self._name_index().get(name) if isinstance(name, str) else None
        if i is None:
            raise KeyError(name)
        return self._row(i)

    def get(self, name: str, default: Any = None) -> Any:
        try:
            return self[name]
        except KeyError:
            return default

    def _cols(self) -> list[list[Any]]:
        if self._columns is None:
            assert self._table is not None
            self._columns = [self._table.column(k).to_pylist() for k in range(8)]
            self._names = self._columns[0]
        return self._columns

    def tuples(self) -> list[tuple[Any, ...]]:
        """Every row as a plain tuple in ``TensorRow``'s field order, built column by
        column (no ``TensorRow`` per row: what a bulk read iterates)."""
        if self._rows is not None:
            return list(self._rows.values())
        n, d, s, b, c, g, o, f = self._cols()
        return list(zip(n, d, map(parse_shape, s), b, c, g, o, map(self._tiers.get, g), f,
                        strict=True))

    def rows(self) -> dict[str, TensorRow]:
        """Every row by name, built at once (column by column, not cell by cell)."""
        if self._rows is None:
            make = TensorRow._make
            self._rows = {t[0]: make(t) for t in self.tuples()}
        return self._rows

    def first_of_segments(self) -> list[TensorRow]:
        """One row of each segment the rows lie in."""
        if self._rows is not None:
            first: dict[str, TensorRow] = {}
            for r in self._rows.values():
                if r.segment_id is not None and r.segment_id not in first:
                    first[r.segment_id] = r
            return list(first.values())
        assert self._table is not None
        seg = self._table.column("segment_id")
        return [self._row(pc.index(seg, sid).as_py()) for sid in self.segment_ids()]

    def values(self) -> Any:
        return self.rows().values()

    def items(self) -> Any:
        return self.rows().items()

    @property
    def nbytes(self) -> int:
        if self._rows is not None:
            return sum(r.nbytes for r in self._rows.values())
        assert self._table is not None
        return int(pc.sum(self._table.column("nbytes")).as_py() or 0)

    def segment_ids(self) -> list[str]:
        """The distinct segments the rows lie in."""
        if self._rows is not None:
            return list({r.segment_id for r in self._rows.values() if r.segment_id is not None})
        assert self._table is not None
        return [s for s in pc.unique(self._table.column("segment_id")).to_pylist()
                if s is not None]


def _age(entry: os.DirEntry[str]) -> float:
    try:
        return time.time() - entry.stat().st_mtime
    except FileNotFoundError:
        return 0.0


def _table_of_rows(rows: Sequence[Sequence[Any]]) -> pa.Table:
    """Raw manifest rows (name, dtype, shape text, nbytes, checksum, segment id, offset,
    first version) as a packed table, ordered by name."""
    cols = list(zip(*rows, strict=True)) if rows else [()] * 8
    table = pa.Table.from_arrays([pa.array(c, type=f.type) for c, f in zip(cols, _SCHEMA,
                                                                             strict=True)],
                                 schema=_SCHEMA)
    return table.take(pc.sort_indices(table, [("name", "ascending")]))


class Manifests:
    """The packed manifests of one host, in ``root`` (mode 0700, files 0600)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self._made = False
        self._lock = threading.Lock()
        self._pending: dict[str, Future[None]] = {}
        self._queued: list[tuple[str, str | None, int, list[str], list[NewTensor]]] = []
        self._pool: ThreadPoolExecutor | None = None
        self._pid = os.getpid()

    def path(self, txn_id: str) -> Path:
        return self.root / f"{txn_id}.arrow"

    # -- reading -----------------------------------------------------------------------
    def load(self, txn_id: str) -> pa.Table | None:
        """The packed rows of the commit ``txn_id``, mapped; None when there is no file
        or it fails its checksum (it is then removed, to be rebuilt)."""
        self._wait_pending(txn_id)
        path = self.path(txn_id)
        try:
            buf = pa.memory_map(str(path)).read_buffer()
        except (FileNotFoundError, OSError):
            return None
        body = buf.slice(0, max(0, buf.size - _TRAILER))
        trailer = buf.slice(body.size).to_pybytes()
        try:
            ok = trailer.decode("ascii") == xxhash.xxh3_64_hexdigest(memoryview(body))
            table = pa.ipc.open_file(body).read_all() if ok else None
        except (UnicodeDecodeError, pa.ArrowInvalid):
            table = None
        if table is None or table.schema != _SCHEMA:
            self._remove(path)
            return None
        return table

    # -- writing -----------------------------------------------------------------------
    def store(self, txn_id: str, table: pa.Table) -> None:
        """Write ``table`` as the packed rows of ``txn_id`` (atomically)."""
        if not self._made:
            self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
            self._made = True
        sink = pa.BufferOutputStream()
        with pa.ipc.new_file(sink, _SCHEMA) as out:
            out.write_table(table, max_chunksize=1 << 20)
        body = sink.getvalue()
        tmp = self.root / f".{txn_id}.{uuid.uuid4().hex}.tmp"
        fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC, 0o600)
        try:
            with os.fdopen(fd, "wb", closefd=True) as fh:
                fh.write(memoryview(body))
                fh.write(xxhash.xxh3_64_hexdigest(memoryview(body)).encode("ascii"))
            os.replace(tmp, self.path(txn_id))
        except BaseException:
            self._remove(tmp)
            raise

    def store_rows(self, txn_id: str, rows: Sequence[Sequence[Any]]) -> None:
        """``store`` of raw manifest rows (what the SQL read returned)."""
        self.store(txn_id, _table_of_rows(rows))

    def derive_later(self, txn_id: str, base_txn: str | None, version: int,
                     replaced: Sequence[str], puts: Sequence[NewTensor],
                     n_rows: int) -> None:
        """Queue the packing of commit ``txn_id`` (version ``version``, ``n_rows`` rows):
        those of ``base_txn``'s file (the previous version; None for a collection's
        first) less ``replaced``, plus ``puts``. ``start`` runs the queue in the
        background; the writer calls it once its commit has returned everything it
        owes its caller, so the packing (O(rows), some of it holding the GIL) never
        lengthens a commit. Nothing is packed when the base has no file (the first
        opener packs it from SQL) or the version is small."""
        if n_rows < PACK_MIN_ROWS:
            return
        with self._lock:
            if self._pid != os.getpid():  # a forked child: its parent's jobs are not its
                self._pool, self._pending, self._queued, self._pid = None, {}, [], os.getpid()
            self._queued.append((txn_id, base_txn, version, list(replaced), list(puts)))

    def start(self) -> None:
        """Run the queued packings, in order, on the background thread."""
        with self._lock:
            if not self._queued or self._pid != os.getpid():
                return
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="tensordb-manifest")
            jobs, self._queued = self._queued, []
            started = []
            for job in jobs:
                fut = self._pool.submit(self._derive, *job)
                self._pending[job[0]] = fut
                started.append((job[0], fut))
        for txn_id, fut in started:
            fut.add_done_callback(functools.partial(self._done, txn_id))

    def _done(self, txn_id: str, _fut: object = None) -> None:
        with self._lock:
            self._pending.pop(txn_id, None)

    def _wait_pending(self, txn_id: str) -> None:
        self.start()
        with self._lock:
            fut = self._pending.get(txn_id) if self._pid == os.getpid() else None
        if fut is not None:
            try:
                fut.result()
            except Exception:  # a failed derive costs only speed: the opener packs it
                pass

    def _derive(self, txn_id: str, base_txn: str | None, version: int,
                replaced: list[str], puts: list[NewTensor]) -> None:
        base = None
        if base_txn is not None:
            base = self.load(base_txn)
            if base is None:
                return
        new = _table_of_rows([(p.name, p.dtype, shape_text(p.shape), p.nbytes, p.checksum,
                               p.segment_id, p.offset, version) for p in puts])
        if base is not None:
            if replaced:
                keep = pc.invert(pc.is_in(base.column("name"),
                                          value_set=pa.array(replaced, pa.string())))
                base = base.filter(keep)
            new = pa.concat_tables([base, new])
            new = new.take(pc.sort_indices(new, [("name", "ascending")]))
        self.store(txn_id, new)

    # -- upkeep ------------------------------------------------------------------------
    def prune(self, keep: set[str]) -> int:
        """Delete the files of commits not in ``keep`` (and stale temporary files);
        returns how many went."""
        removed = 0
        try:
            entries = list(os.scandir(self.root))
        except FileNotFoundError:
            return 0
        for entry in entries:
            name = entry.name
            txn = name[:-len(".arrow")] if name.endswith(".arrow") else None
            stale_tmp = name.endswith(".tmp") and _age(entry) > 600  # a writer died mid-way
            if (txn is not None and txn not in keep) or stale_tmp:
                with self._lock:
                    busy = txn is not None and txn in self._pending
                if not busy and self._remove(Path(entry.path)):
                    removed += 1
        return removed

    def close(self) -> None:
        """Run what is queued and wait for it (a process that commits and exits leaves
        its versions packed)."""
        self.start()
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None and self._pid == os.getpid():
            pool.shutdown(wait=True)

    @staticmethod
    def _remove(path: Path) -> bool:
        try:
            os.unlink(path)
            return True
        except FileNotFoundError:
            return False
