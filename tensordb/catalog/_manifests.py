"""Packed manifests: a large version's rows as Arrow IPC chunks, mapped zero-copy.

A snapshot of a 100,000-tensor version read its rows from SQL in 300-700 ms (the
database hands out a Python tuple per row, and a ``TensorRow`` was built from each).
Versions are immutable, so the rows of one can be packed once into files and mapped
by every later opener on the host, as Lance keeps its manifests: opening is then a
constant number of small queries (resolve, lease, the commit's id, its segments' tiers)
and a map, whatever the version's size. The ``tensors`` table stays the truth, and the
rows stay queryable there; the files are a cache of them:

* a version's rows, in name order, are cut into *chunks* of about ``CHUNK_ROWS`` rows,
  each an Arrow IPC file named by the xxh3-128 of its bytes (``<digest>.chunk``), so a
  chunk is shared by every version whose rows in that name range are the same;
* a version's *list* (``<txn_id>.manifest``, keyed by the commit's ``txn_id``: unique
  per commit, never reused) names its chunks in order with what an opener needs
  without reading them: each one's first name, rows, bytes, sharded rows and the
  first row of each segment in it;
* every file is written whole under a temporary name and renamed into place; a list's
  last 16 bytes are the xxh3 of the rest and a chunk's name is the hash of its bytes,
  both checked at every load, so a torn or damaged file is rebuilt from SQL, never
  believed;
* only for versions of at least ``PACK_MIN_ROWS`` rows: smaller ones come from SQL as
  fast as from a file;
* a commit's list is derived by the writer after its commit (in the background: the
  commit returns first) from the previous version's list: only the chunks whose name
  range holds a changed name are rewritten, so the work a commit leaves queued costs
  what it changed (a chunk per changed name at most), not what the version holds;
  the first opener that finds no list packs one from SQL;
* the segments' tiers are not in them (a segment moves tiers); the opener reads them;
* ``prune`` deletes the lists of commits gc dropped and the chunks no list names.

The manifest an opener holds (``Manifest``) turns the chunks' columns into Python
values only where asked: ``len``, ``nbytes``, the segments and a look-up by name cost
the list plus the one chunk the name falls in, never a row per tensor of the version.
"""

from __future__ import annotations

import bisect
import functools
import json
import os
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import xxhash

import storage_engine as se

from ._common import NewTensor, TensorRow, parse_shape, shape_text

__all__ = ["CHUNK_ROWS", "ChunkRef", "Manifest", "Manifests", "PACK_MIN_ROWS", "PackedVersion"]

#: versions with fewer rows are read from SQL (a 1,000-row version takes ~5 ms there)
PACK_MIN_ROWS = 2000
#: rows a chunk is cut to; a chunk that grows past twice this is split
CHUNK_ROWS = 2048

_SCHEMA = pa.schema([
    ("name", pa.string()), ("dtype", pa.string()), ("shape", pa.string()),
    ("nbytes", pa.int64()), ("checksum", pa.string()), ("segment_id", pa.string()),
    ("offset", pa.int64()), ("first_version", pa.int64())])
_TRAILER = 16  # hex digits of the xxh3-64 of a list's bytes before them
_LIST = ".manifest"
_CHUNK = ".chunk"
_FORMAT = 1


def _is_sharded_cells(segment_id: str | None, nbytes: int) -> bool:
    """A sharded row has no segment of its own, and some bytes (in its shards)."""
    return segment_id is None and nbytes > 0


@dataclass(frozen=True)
class ChunkRef:
    """One chunk of a version as its list names it: the hash of its file, its first
    name, its rows, their bytes, how many are sharded, and (segment id, index of the
    segment's first row in the chunk) for each segment its rows lie in."""

    digest: str
    first: str
    rows: int
    nbytes: int
    sharded: int
    segments: tuple[tuple[str, int], ...]

    def to_json(self) -> list[Any]:
        return [self.digest, self.first, self.rows, self.nbytes, self.sharded,
                [list(s) for s in self.segments]]

    @classmethod
    def from_json(cls, v: Any) -> ChunkRef:
        digest, first, rows, nbytes, sharded, segs = v
        if not (isinstance(digest, str) and isinstance(first, str) and isinstance(rows, int)
                and isinstance(nbytes, int) and isinstance(sharded, int)
                and isinstance(segs, list)):
            raise ValueError("a chunk reference of the wrong shape")
        return cls(digest, first, rows, nbytes, sharded,
                   tuple((str(sid), int(i)) for sid, i in segs))


class PackedVersion:
    """A version's chunks as its list names them, each one's table mapped and checked."""

    def __init__(self, refs: Sequence[ChunkRef], tables: Sequence[pa.Table]) -> None:
        self.refs = list(refs)
        self.tables = list(tables)


class Manifest(Mapping[str, TensorRow]):
    """The rows of one version by name, in name order: from SQL (a dict of rows) or
    from a packed version (Arrow chunks, turned into ``TensorRow`` values only when
    asked for: ``len``, ``nbytes``, ``segment_ids`` and ``has_sharded`` cost nothing
    per row, a look-up by name the one chunk it falls in)."""

    def __init__(self, rows: Sequence[TensorRow] | None = None, *,
                 packed: PackedVersion | None = None,
                 tiers: Mapping[str, str] | None = None) -> None:
        self._packed = packed
        self._tiers = dict(tiers or {})
        self._rows: dict[str, TensorRow] | None = (
            {r.name: r for r in rows} if rows is not None else None)
        if packed is None and self._rows is None:
            self._rows = {}
        self._firsts = [r.first for r in packed.refs] if packed is not None else []
        self._chunk_names: dict[int, list[str]] = {}
        self._chunk_index: dict[int, dict[str, int]] = {}
        self._chunk_cols: dict[int, list[list[Any]]] = {}
        self._names: list[str] | None = None

    def set_tiers(self, tiers: Mapping[str, str]) -> None:
        """The tiers of the rows' segments (segment id -> tier), read after the rows: a
        packed file does not hold them, as a segment moves between tiers."""
        self._tiers = dict(tiers)

    @property
    def packed(self) -> bool:
        """Whether the rows come from packed files."""
        return self._packed is not None

    def __len__(self) -> int:
        if self._rows is not None:
            return len(self._rows)
        assert self._packed is not None
        return sum(r.rows for r in self._packed.refs)

    # -- the chunks, converted where asked ---------------------------------------------
    def _names_of(self, k: int) -> list[str]:
        got = self._chunk_names.get(k)
        if got is None:
            assert self._packed is not None
            got = self._chunk_names[k] = self._packed.tables[k].column(0).to_pylist()
            se.add_work("names_built", len(got))
        return got

    def _cols_of(self, k: int) -> list[list[Any]]:
        got = self._chunk_cols.get(k)
        if got is None:
            assert self._packed is not None
            t = self._packed.tables[k]
            got = self._chunk_cols[k] = [self._names_of(k)] + [
                t.column(j).to_pylist() for j in range(1, 8)]
        return got

    def _locate(self, name: object) -> tuple[int, int] | None:
        """(chunk, row in it) of ``name``, reading that chunk's names only."""
        if not isinstance(name, str) or not self._firsts:
            return None
        k = bisect.bisect_right(self._firsts, name) - 1
        if k < 0:
            return None
        index = self._chunk_index.get(k)
        if index is None:
            index = self._chunk_index[k] = {n: i for i, n in enumerate(self._names_of(k))}
        i = index.get(name)
        return None if i is None else (k, i)

    def names(self) -> list[str]:
        """The tensor names, in name order."""
        if self._rows is not None:
            return list(self._rows)
        if self._names is None:
            assert self._packed is not None
            out: list[str] = []
            for k in range(len(self._packed.tables)):
                out.extend(self._names_of(k))
            self._names = out
        return self._names

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __contains__(self, name: object) -> bool:
        if self._rows is not None:
            return name in self._rows
        return self._locate(name) is not None

    def _row(self, k: int, i: int) -> TensorRow:
        cols = self._chunk_cols.get(k)
        if cols is not None:
            name, dtype, shape, nbytes, csum, seg, off, first = (col[i] for col in cols)
        else:  # one row: its cells, without converting whole columns
            assert self._packed is not None
            t = self._packed.tables[k]
            name, dtype, shape, nbytes, csum, seg, off, first = (
                t.column(j)[i].as_py() for j in range(8))
        se.add_work("rows_built", 1)
        return TensorRow(name, dtype, parse_shape(shape), nbytes, csum, seg, off,
                         self._tiers.get(seg) if seg is not None else None, first)

    def __getitem__(self, name: str) -> TensorRow:
        if self._rows is not None:
            return self._rows[name]
        at = self._locate(name)
        if at is None:
            raise KeyError(name)
        return self._row(*at)

    def get(self, name: str, default: Any = None) -> Any:
        try:
            return self[name]
        except KeyError:
            return default

    def tuples(self) -> list[tuple[Any, ...]]:
        """Every row as a plain tuple in ``TensorRow``'s field order, built column by
        column (no ``TensorRow`` per row: what a bulk read iterates)."""
        if self._rows is not None:
            return list(self._rows.values())
        assert self._packed is not None
        out: list[tuple[Any, ...]] = []
        tiers = self._tiers.get
        for k in range(len(self._packed.tables)):
            n, d, s, b, c, g, o, f = self._cols_of(k)
            out.extend(zip(n, d, map(parse_shape, s), b, c, g, o, map(tiers, g), f,
                           strict=True))
        se.add_work("rows_built", len(out))
        return out

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
        assert self._packed is not None
        seen: set[str] = set()
        out: list[TensorRow] = []
        for k, ref in enumerate(self._packed.refs):
            for sid, i in ref.segments:
                if sid not in seen:
                    seen.add(sid)
                    out.append(self._row(k, i))
        return out

    def has_sharded(self) -> bool:
        """Whether any row is sharded (no segment of its own, some bytes)."""
        if self._rows is not None:
            return any(_is_sharded_cells(r.segment_id, r.nbytes) for r in self._rows.values())
        assert self._packed is not None
        return any(r.sharded for r in self._packed.refs)

    def sharded_rows(self) -> list[TensorRow]:
        """The sharded rows, built from the chunks that hold some (no others)."""
        if self._rows is not None:
            return [r for r in self._rows.values() if _is_sharded_cells(r.segment_id, r.nbytes)]
        assert self._packed is not None
        out: list[TensorRow] = []
        for k, ref in enumerate(self._packed.refs):
            if ref.sharded:
                t = self._packed.tables[k]
                mask = pc.and_(pc.is_null(t.column("segment_id")),
                               pc.greater(t.column("nbytes"), 0))
                out.extend(self._row(k, i) for i in
                           pc.indices_nonzero(mask).to_pylist())
        return out

    def values(self) -> Any:
        return self.rows().values()

    def items(self) -> Any:
        return self.rows().items()

    @property
    def nbytes(self) -> int:
        if self._rows is not None:
            return sum(r.nbytes for r in self._rows.values())
        assert self._packed is not None
        return sum(r.nbytes for r in self._packed.refs)

    def segment_ids(self) -> list[str]:
        """The distinct segments the rows lie in."""
        if self._rows is not None:
            return list({r.segment_id for r in self._rows.values() if r.segment_id is not None})
        assert self._packed is not None
        return list(dict.fromkeys(sid for ref in self._packed.refs for sid, _ in ref.segments))


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
        """The list of the commit ``txn_id``'s packed rows."""
        return self.root / f"{txn_id}{_LIST}"

    def _chunk_path(self, digest: str) -> Path:
        return self.root / f"{digest}{_CHUNK}"

    # -- reading -----------------------------------------------------------------------
    def _load_list(self, txn_id: str) -> list[ChunkRef] | None:
        """The chunk list of ``txn_id``, checked; None when there is none or it fails
        its checksum (it is then removed, to be rebuilt)."""
        path = self.path(txn_id)
        try:
            with open(path, "rb") as fh:
                raw = fh.read()
        except OSError:
            return None
        body, trailer = raw[:-_TRAILER], raw[-_TRAILER:]
        se.add_work("bytes_hashed", len(body))
        try:
            if len(raw) <= _TRAILER or trailer.decode("ascii") != xxhash.xxh3_64_hexdigest(body):
                raise ValueError("checksum")
            doc = json.loads(body)
            if not isinstance(doc, dict) or doc.get("format") != _FORMAT:
                raise ValueError("format")
            refs = [ChunkRef.from_json(v) for v in doc["chunks"]]
            if not refs or any(r.rows <= 0 for r in refs):
                raise ValueError("chunks")
        except (ValueError, KeyError, TypeError, UnicodeDecodeError):
            self._remove(path)
            return None
        return refs

    def _load_chunk(self, ref: ChunkRef) -> pa.Table | None:
        """The chunk ``ref`` names, mapped; None when it is missing, is not the bytes
        its name hashes, or does not hold the rows its reference says."""
        path = self._chunk_path(ref.digest)
        try:
            buf = pa.memory_map(str(path)).read_buffer()
        except (FileNotFoundError, OSError):
            return None
        se.add_work("bytes_hashed", buf.size)
        if xxhash.xxh3_128_hexdigest(memoryview(buf)) != ref.digest:
            self._remove(path)
            return None
        try:
            table = pa.ipc.open_file(buf).read_all()
        except pa.ArrowInvalid:
            table = None
        if table is None or table.schema != _SCHEMA or table.num_rows != ref.rows:
            self._remove(path)
            return None
        return table

    def load(self, txn_id: str) -> PackedVersion | None:
        """The packed rows of the commit ``txn_id``: its list and every chunk it names,
        mapped and checked; None when any of them is missing or damaged (the list is
        then removed, to be rebuilt)."""
        self._wait_pending(txn_id)
        refs = self._load_list(txn_id)
        if refs is None:
            return None
        tables = []
        for ref in refs:
            table = self._load_chunk(ref)
            if table is None:
                self._remove(self.path(txn_id))
                return None
            tables.append(table)
        return PackedVersion(refs, tables)

    # -- writing -----------------------------------------------------------------------
    def _write(self, path: Path, parts: Sequence[Any]) -> None:
        """Write ``parts`` as the file ``path``, whole or not at all (0600)."""
        if not self._made:
            self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
            self._made = True
        tmp = self.root / f".{path.name}.{uuid.uuid4().hex}.tmp"
        fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC, 0o600)
        try:
            with os.fdopen(fd, "wb", closefd=True) as fh:
                for part in parts:
                    fh.write(part)
            os.replace(tmp, path)
        except BaseException:
            self._remove(tmp)
            raise

    def _store_chunk(self, table: pa.Table) -> ChunkRef:
        """Write one chunk (rows in name order) unless a file of the same bytes is
        there, and return its reference."""
        sink = pa.BufferOutputStream()
        with pa.ipc.new_file(sink, _SCHEMA) as out:
            out.write_table(table)
        body = sink.getvalue()
        se.add_work("bytes_hashed", body.size)
        se.add_work("manifest_rows_packed", table.num_rows)
        digest = xxhash.xxh3_128_hexdigest(memoryview(body))
        path = self._chunk_path(digest)
        if not path.exists():
            self._write(path, [memoryview(body)])
        segs: dict[str, int] = {}
        for i, sid in enumerate(table.column("segment_id").to_pylist()):
            if sid is not None and sid not in segs:
                segs[sid] = i
        sharded = pc.sum(pc.and_(pc.is_null(table.column("segment_id")),
                                 pc.greater(table.column("nbytes"), 0))).as_py() or 0
        return ChunkRef(digest, table.column("name")[0].as_py(), table.num_rows,
                        int(pc.sum(table.column("nbytes")).as_py() or 0), int(sharded),
                        tuple(segs.items()))

    def _store_list(self, txn_id: str, refs: Sequence[ChunkRef]) -> None:
        body = json.dumps({"format": _FORMAT, "chunks": [r.to_json() for r in refs]},
                          separators=(",", ":")).encode()
        self._write(self.path(txn_id), [body, xxhash.xxh3_64_hexdigest(body).encode("ascii")])

    def _store_chunks(self, table: pa.Table) -> list[ChunkRef]:
        """``table`` (rows in name order) cut into chunks of ``CHUNK_ROWS`` rows and
        written; their references, in order."""
        n = table.num_rows
        cuts = max(1, -(-n // CHUNK_ROWS))
        step = -(-n // cuts)
        return [self._store_chunk(table.slice(lo, step)) for lo in range(0, n, step)]

    def store(self, txn_id: str, table: pa.Table) -> None:
        """Write ``table`` (rows in name order) as the packed rows of ``txn_id``: its
        chunks, then its list (the list last: a list names only chunks written)."""
        if table.num_rows == 0:
            return
        self._store_list(txn_id, self._store_chunks(table))

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
        """The list of ``txn_id`` from its base's: the base's chunks whose name range
        holds a replaced or new name are rewritten (less the replaced rows, plus the new
        ones; split when over twice ``CHUNK_ROWS``, dropped when empty), every other
        chunk is named again as it is. Reads and writes O(changed chunks) rows."""
        new = _table_of_rows([(p.name, p.dtype, shape_text(p.shape), p.nbytes, p.checksum,
                               p.segment_id, p.offset, version) for p in puts])
        if base_txn is None:
            self.store(txn_id, new)
            return
        refs = self._load_list(base_txn)
        if refs is None:
            return  # the first opener packs it from SQL
        firsts = [r.first for r in refs]

        def chunk_of(name: str) -> int:
            return max(0, bisect.bisect_right(firsts, name) - 1)

        gone: dict[int, list[str]] = {}
        for name in replaced:
            gone.setdefault(chunk_of(name), []).append(name)
        added: dict[int, list[int]] = {}
        for i, name in enumerate(new.column("name").to_pylist()):
            added.setdefault(chunk_of(name), []).append(i)
        out: list[ChunkRef] = []
        for k, ref in enumerate(refs):
            if k not in gone and k not in added:
                out.append(ref)
                continue
            table = self._load_chunk(ref)
            if table is None:
                return  # damaged: the first opener packs it from SQL
            if k in gone:
                table = table.filter(pc.invert(pc.is_in(
                    table.column("name"), value_set=pa.array(gone[k], pa.string()))))
            if k in added:
                table = pa.concat_tables([table, new.take(pa.array(added[k], pa.int64()))])
                table = table.take(pc.sort_indices(table, [("name", "ascending")]))
            if table.num_rows == 0:
                continue
            out.extend(self._store_chunks(table) if table.num_rows > 2 * CHUNK_ROWS
                       else [self._store_chunk(table)])
        if out:
            self._store_list(txn_id, out)

    # -- upkeep ------------------------------------------------------------------------
    def prune(self, keep: set[str]) -> int:
        """Delete the lists of commits not in ``keep``, the chunks no remaining list
        names, files of an older layout, and stale temporary files; returns how many
        went."""
        removed = 0
        try:
            entries = list(os.scandir(self.root))
        except FileNotFoundError:
            return 0
        with self._lock:
            busy = set(self._pending)
        chunks: list[os.DirEntry[str]] = []
        named: set[str] = set()
        for entry in entries:
            name = entry.name
            if name.endswith(_CHUNK):
                chunks.append(entry)
                continue
            txn = name[:-len(_LIST)] if name.endswith(_LIST) else None
            stale_tmp = name.endswith(".tmp") and _age(entry) > 600  # a writer died mid-way
            old_layout = name.endswith(".arrow")  # one file a version, no longer read
            if (txn is not None and txn not in keep and txn not in busy) or stale_tmp \
                    or old_layout:
                if self._remove(Path(entry.path)):
                    removed += 1
            elif txn is not None:
                refs = self._load_list(txn)
                named.update(r.digest for r in refs or ())
        if busy:  # a derive still writing may name chunks no list names yet
            return removed
        for entry in chunks:
            if entry.name[:-len(_CHUNK)] not in named and _age(entry) > 1.0:
                if self._remove(Path(entry.path)):
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
