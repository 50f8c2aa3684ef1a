"""safetensors files and Hugging Face sharded folders in and out of a collection.

Import copies each tensor once, from the file straight into its extent in the store
(``Transaction.put_file_range``: the store reads each byte range at commit on its I/O
pool, hashing as it copies, with the GIL released; into a fresh segment file through a
small buffer and ``pwrite``, with no page fault). Every header is validated before the transaction starts, so a
truncated or hostile file leaves the store unchanged.

Export writes files that safetensors loads. For a file safetensors wrote, the export of
the imported version is byte-identical: the file layout (tensor order, ``__metadata__``
with its key order, shard membership, the index's ``metadata``) is kept in the commit's
metadata under ``LAYOUT_KEY``, and the header is written back with safetensors' own
serialization rules (compact JSON, ``__metadata__`` first, entries in file order, padded
with spaces to 8 bytes). A header those rules would not reproduce (another writer's
spacing or key order) is kept verbatim instead.
"""

from __future__ import annotations

import json
import os
import struct
import uuid
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import TYPE_CHECKING, Any

import torch

import storage_engine as se
from tensordb.catalog import Commit
from tensordb.errors import CorruptData, InvalidInput, NotFound

from ._model_files import FILES_ROW, folder_files, write_files
from ._puts import FileRange
from ._safetensors_format import (
    F4,
    LAYOUT_FORMAT,
    LAYOUT_KEY,
    SINGLE_NAME,
    ST_BY_TORCH,
    Header,
    Index,
    canonical_order,
    check_file_name,
    header_bytes,
    index_text,
    read_header,
    resolve_source,
)
from ._write import InPlaceFile

if TYPE_CHECKING:
    from ._database import Database
    from ._transaction import Transaction

__all__ = ["CommitInPlace", "export_safetensors", "import_safetensors", "run_export",
           "run_import"]

#: the one thing an import needs beyond the public API (the writer's, for an import in
#: place): commit ``files`` where they lie, as one version on the head it finds
#: (collection, files, names deleted, message, metadata, advance) -> the commit
CommitInPlace = Callable[[str, list[InPlaceFile], set[str], str, dict[str, str],
                          Callable[[int], None]], Commit]

_CHUNK = 64 << 20  # read/write granularity when a progress bar is shown


# -- progress --------------------------------------------------------------------------
@contextmanager
def progress_bar(enabled: bool | None, total: int, label: str) -> Iterator[Callable[[int], None]]:
    if not enabled:
        yield lambda n: None
        return
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    with Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                  TransferSpeedColumn(), TimeRemainingColumn()) as bar:
        task = bar.add_task(label, total=total)
        yield lambda n: bar.advance(task, n)  # rich's Progress is thread-safe


# -- import ----------------------------------------------------------------------------
def layout(headers: list[Header], index: Index | None) -> dict[str, Any]:
    files = []
    for h in headers:
        order = [e.name for e in h.entries]
        entry: dict[str, Any] = {"file": h.path.name, "metadata": h.metadata, "tensors": order}
        regenerated = header_bytes(h.metadata, [(e.name, e.st_dtype, e.st_shape, e.begin,
                                                  e.end) for e in h.entries])
        if regenerated != h.raw:  # not safetensors' own serialization: keep it verbatim
            entry["header"] = h.raw.decode("utf-8")
        files.append(entry)
    out: dict[str, Any] = {"format": LAYOUT_FORMAT, "files": files}
    if index is not None:
        idx: dict[str, Any] = {"file": index.path.name}
        if "metadata" in index.doc:
            idx["metadata"] = index.doc["metadata"]
        if index_text(index.doc) != index.raw:
            idx["raw"] = index.raw
        out["index"] = idx
    return out


def _open_headers(files: list[Path], fds: list[int]) -> list[Header]:
    """Open every file (appending its descriptor to ``fds``, which the caller closes)
    and read its header."""
    headers: list[Header] = []
    for f in files:
        try:
            fds.append(os.open(f, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)))
        except OSError as exc:
            raise InvalidInput(f"{f}: cannot open: {exc.strerror}") from None
        headers.append(read_header(fds[-1], f))
    return headers


def owners(headers: list[Header], index: Index | None) -> dict[str, PurePath]:
    """tensor name -> the file holding it: each name in one file only, and exactly as
    the index's weight_map says."""
    owner: dict[str, PurePath] = {}
    for h in headers:
        for e in h.entries:
            if e.name in owner:
                raise CorruptData(f"{h.path}: tensor {e.name!r} is also in "
                                  f"{owner[e.name].name}", tensor=e.name)
            owner[e.name] = h.path
    if index is None:
        return owner
    for name, file in index.weight_map.items():
        if name not in owner:
            raise CorruptData(f"{index.path}: tensor {name!r} is mapped to {file!r}, "
                              f"which does not hold it", tensor=name)
        if owner[name].name != file:
            raise CorruptData(f"{index.path}: tensor {name!r} is mapped to {file!r} but"
                              f" lies in {owner[name].name!r}", tensor=name)
    for name, p in owner.items():
        if name not in index.weight_map:
            raise CorruptData(f"{index.path}: tensor {name!r} of {p.name!r} is missing "
                              f"from the weight_map", tensor=name)
    return owner


def version_plan(db: Database, collection: str, headers: list[Header], index: Index | None
                 ) -> tuple[dict[str, str], list[str]]:
    """What an import of ``headers`` commits beside the tensors: the commit's metadata
    (``__metadata__`` of the first file, and the layout), and the names of the head
    that the files lack (deleted in the new version; ``FILES_ROW`` where the head has
    files). CorruptData when the files and the index disagree."""
    owner = owners(headers, index)
    meta: dict[str, str] = dict(headers[0].metadata or {}) if headers else {}
    meta[LAYOUT_KEY] = json.dumps(layout(headers, index), separators=(",", ":"),
                                  ensure_ascii=False)
    stale: list[str] = []
    try:  # one catalog look-up, not a listing of every collection
        with db.snapshot(collection) as snap:
            stale = [n for n in snap if n not in owner]
            if snap.files():  # the head's files go too, unless the import brings its own
                stale.append(FILES_ROW)
    except NotFound:  # a new collection (or one with no version yet)
        pass
    return meta, stale


def finish_version(tx: Transaction, stale: list[str], files: dict[str, bytes]) -> None:
    """An import's last puts: delete the head's ``stale`` names (``version_plan``), and
    make ``files`` the version's files (none, where the head had some: ``FILES_ROW``
    among the stale)."""
    for name in stale:
        if name == FILES_ROW:
            tx.put_files({})
        else:
            tx.delete(name)
    if files:
        tx.put_files(files)


def import_safetensors(db: Database, collection: str, path: str | os.PathLike[str],
                       **options: Any) -> Commit:
    """``db.import_safetensors(collection, path, **options)``, as a function."""
    return db.import_safetensors(collection, path, **options)


def export_safetensors(db: Database, collection: str, out_dir: str | os.PathLike[str],
                       **options: Any) -> list[Path]:
    """``db.export_safetensors(collection, out_dir, **options)``, as a function."""
    return db.export_safetensors(collection, out_dir, **options)


def run_import(db: Database, commit_in_place: CommitInPlace, collection: str,
               path: str | os.PathLike[str], *, message: str | None = None,
               tier: str | None = None, progress: bool | None = None,
               in_place: bool = False) -> Commit:
    """Import one ``.safetensors`` file, or a Hugging Face folder with
    ``model.safetensors.index.json`` (all shards), as ONE new version of ``collection``.

    The new version holds exactly the file's tensors: names the head has and the file
    lacks are deleted in it. ``__metadata__`` becomes the commit's metadata (of the first
    shard, for a folder), beside the file layout under ``LAYOUT_KEY``. Every header is
    validated before anything is written: a malformed, truncated or inconsistent file
    raises ``CorruptData``, an unsupported dtype or a bad argument ``InvalidInput``, and
    the store is left unchanged. Blocks until the commit is published; ``progress=True``
    shows a rich progress bar (for the CLI).

    ``in_place=True`` (opt-in; the copy is the default) commits the files without
    copying them (``_import_in_place``, through ``commit_in_place``): the caller promises
    to keep them unchanged. Everything else goes through ``db``'s public API.
    """
    if not isinstance(in_place, bool):
        raise InvalidInput(f"in_place must be True or False, not {in_place!r}",
                           collection=collection)
    if in_place and tier not in (None, "disk"):
        raise InvalidInput(f"an import in place is held by the disk tier, not {tier!r}",
                           collection=collection)
    # the headers, the layout and the rows are an object per tensor: a cyclic gc
    # collection falling in them walks the whole heap (after torch's imports, ~225,000
    # objects, 106-128 ms here: a third of a fresh process's first import of 368 MB)
    with se.gc_paused():
        return _import(db, commit_in_place, collection, path, message, tier, progress,
                       in_place)


def _import(db: Database, commit_in_place: CommitInPlace, collection: str,
            path: str | os.PathLike[str],
            message: str | None, tier: str | None, progress: bool | None,
            in_place: bool) -> Commit:
    files, index = resolve_source(path)
    fds: list[int] = []
    try:
        headers = _open_headers(files, fds)
        meta, stale = version_plan(db, collection, headers, index)
        source = index.path.parent if index is not None else files[0]
        folder = Path(path) if Path(path).is_dir() else \
            Path(index.path.parent) if index is not None else None
        extra = folder_files(folder) if folder is not None and not in_place else {}
        total = sum(h.nbytes for h in headers)
        if in_place:
            return _import_in_place(commit_in_place, collection, headers, fds, stale,
                                    meta, message or f"import {source.name} in place",
                                    progress, f"import {source.name} in place")
        with progress_bar(progress, total, f"import {source.name}") as advance:
            with db.transaction(collection, message=message or f"import {source.name}",
                                tier=tier, metadata=meta) as tx:
                for h, fd in zip(headers, fds, strict=True):
                    for e in h.entries:
                        # read by the store at commit, hashed as it is copied
                        tx.put_file_range(e.name, e.dtype, e.shape,
                                          FileRange(fd, h.data_start + e.begin, str(h.path),
                                                    advance))
                finish_version(tx, stale, extra)
        assert tx.result is not None
        return tx.result
    finally:
        for fd in fds:
            os.close(fd)


def _import_in_place(commit_in_place: CommitInPlace, collection: str,
                     headers: list[Header], fds: list[int], stale: list[str],
                     meta: dict[str, str], message: str, progress: bool | None,
                     label: str) -> Commit:
    """Commit validated files without a copy: each file is one disk-tier segment, a
    reflinked clone where the filesystem has it, else a reference to the file (its path,
    size, mtime, inode and device recorded; every open checks them, and a changed file
    is refused with CorruptData). One checksum pass over the bytes, on the I/O pool."""
    files = []
    for h, fd in zip(headers, fds, strict=True):
        real = os.path.realpath(h.path)  # the file itself, not a link that may move
        files.append(InPlaceFile(real, fd, [(e.name, e.dtype, e.shape, h.data_start + e.begin,
                                             e.end - e.begin) for e in h.entries],
                                 h.data_start + h.nbytes))
    with progress_bar(progress, sum(h.nbytes for h in headers), label) as advance:
        return commit_in_place(collection, files, set(stale), message, meta, advance)


# -- export ----------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class _OutFile:
    name: str
    header: bytes
    tensors: list[tuple[str, int, int]]  # name, offset in the file, nbytes


def _st_dtype_shape(name: str, dtype: str, shape: tuple[int, ...],
                    collection: str) -> tuple[str, tuple[int, ...]]:
    dt = getattr(torch, dtype, None)
    st = ST_BY_TORCH.get(dt) if isinstance(dt, torch.dtype) else None
    if st is None:
        raise InvalidInput(f"{collection}/{name}: safetensors has no dtype for {dtype}",
                           collection=collection, tensor=name)
    if st == F4:
        if not shape:
            raise InvalidInput(f"{collection}/{name}: a 0-d {dtype} tensor has no safetensors "
                               f"shape", collection=collection, tensor=name)
        shape = shape[:-1] + (shape[-1] * 2,)
    return st, shape


def _find_layout(db: Database, collection: str, version: int,
                 commit: Commit) -> dict[str, Any] | None:
    meta = commit.metadata or {}
    text = meta.get(LAYOUT_KEY)
    if text is None:  # a later commit (a fine-tune step, a module commit) keeps the layout
        for c in db.history(collection):
            if c.version < version and c.metadata and LAYOUT_KEY in c.metadata:
                text = c.metadata[LAYOUT_KEY]
                break
    if text is None:
        return None
    try:
        layout = json.loads(text)
        assert layout["format"] == LAYOUT_FORMAT and isinstance(layout["files"], list)
        for f in layout["files"]:
            check_file_name(f["file"], f"layout of {collection}")
            assert isinstance(f["tensors"], list)
        if "index" in layout:
            check_file_name(layout["index"]["file"], f"layout of {collection}")
    except (ValueError, KeyError, TypeError, AssertionError, CorruptData) as exc:
        raise CorruptData(f"{collection}: the safetensors layout in the commit metadata is "
                          f"unreadable: {exc!r}", collection=collection) from None
    return layout


@dataclass(slots=True)
class _Group:
    """The tensors of one output file, before offsets are known."""

    file: str
    metadata: dict[str, str] | None
    names: list[str]
    recorded: dict[str, Any] | None  # its layout entry, while its tensors are unchanged


def _groups(info: Mapping[str, tuple[str, tuple[int, ...], int]],
            layout: dict[str, Any] | None, commit_meta: dict[str, str] | None,
            canonical: Callable[[list[str]], list[str]]
            ) -> tuple[list[_Group], dict[str, Any] | None]:
    """The output files' tensors (and the index's layout entry), from the layout
    recorded at import: the recorded order while a file's tensors are unchanged."""
    if layout is None:
        meta = {k: v for k, v in (commit_meta or {}).items() if k != LAYOUT_KEY} or None
        return [_Group(SINGLE_NAME, meta, canonical(list(info)), None)], None
    groups = [_Group(f["file"], f.get("metadata"), [n for n in f["tensors"] if n in info], f)
              for f in layout["files"]]
    placed = {n for g in groups for n in g.names}
    new = [n for n in info if n not in placed]
    if new:  # tensors added since the import go to the last file
        if not groups:
            groups.append(_Group(SINGLE_NAME, None, [], None))
        groups[-1].names += new
    for g in groups:
        if g.recorded is None or g.names != g.recorded["tensors"]:
            g.names, g.recorded = canonical(g.names), None  # safetensors' own order
    if len(groups) > 1:
        groups = [g for g in groups if g.names]
    return groups, layout.get("index")


def _out_file(g: _Group, info: Mapping[str, tuple[str, tuple[int, ...], int]],
              st: Mapping[str, tuple[str, tuple[int, ...]]]) -> _OutFile:
    """One output file: its tensors laid end to end, under safetensors' header (or the
    header recorded verbatim, while it still describes these tensors)."""
    entries, pos = [], 0
    for n in g.names:
        nbytes = info[n][2]
        entries.append((n, st[n][0], st[n][1], pos, pos + nbytes))
        pos += nbytes
    header = header_bytes(g.metadata, entries)
    verbatim = g.recorded.get("header") if g.recorded else None
    if verbatim is not None:
        kept = verbatim.encode("utf-8")
        try:  # still the header of these tensors? (values may change, not layout)
            parsed = json.loads(kept)
            same = [(k, v["dtype"], tuple(v["shape"]), *v["data_offsets"])
                    for k, v in sorted(((k, v) for k, v in parsed.items()
                                        if k != "__metadata__"),
                                       key=lambda kv: tuple(kv[1]["data_offsets"]))]
            if same == [(n, d, tuple(s), b, e) for n, d, s, b, e in entries]:
                header = kept
        except (ValueError, KeyError, TypeError, AttributeError):
            pass
    return _OutFile(g.file, header, [(n, 8 + len(header) + b, e - b)
                                     for n, _, _, b, e in entries])


def _index_file(index_spec: dict[str, Any], out: list[_OutFile],
                info: Mapping[str, tuple[str, tuple[int, ...], int]]) -> tuple[str, str]:
    """The index's (file name, text): transformers' format, or the recorded text of
    another writer's index while it still holds."""
    weight_map = {n: f.name for f in out for n, _, _ in f.tensors}
    doc: dict[str, Any] = {}
    if "metadata" in index_spec:
        doc["metadata"] = dict(index_spec["metadata"])
        if "total_size" in doc["metadata"]:
            doc["metadata"]["total_size"] = sum(v[2] for v in info.values())
    doc["weight_map"] = weight_map
    text = index_text(doc)
    raw_index = index_spec.get("raw")
    if raw_index is not None:  # another writer's index: verbatim while it still holds
        try:
            old = json.loads(raw_index)
            if old.get("weight_map") == weight_map and old.get("metadata") == doc.get(
                    "metadata"):
                text = raw_index
        except (ValueError, AttributeError):
            pass
    return index_spec["file"], text


def _plan(collection: str, info: dict[str, tuple[str, tuple[int, ...], int]],
          layout: dict[str, Any] | None, commit_meta: dict[str, str] | None
          ) -> tuple[list[_OutFile], tuple[str, str] | None]:
    """The files to write (and the index's (name, text)), from the version's tensors and
    the layout recorded at import."""
    st = {n: _st_dtype_shape(n, d, s, collection) for n, (d, s, _) in info.items()}

    def canonical(names: list[str]) -> list[str]:
        return canonical_order([(n, st[n][0]) for n in names])

    groups, index_spec = _groups(info, layout, commit_meta, canonical)
    out = [_out_file(g, info, st) for g in groups]
    index = _index_file(index_spec, out, info) if index_spec is not None else None
    return out, index


#: bytes an export hashes and then writes: small enough that the kernel's copy into the
#: file reads them from cache
_HASH_PIECE = 1 << 20


def _write_all(fd: int, data: Any, offset: int, advance: Callable[[int], None],
               chunk: int, hasher: Any = None) -> None:
    """Write ``data`` at ``offset``; with ``hasher``, each piece is hashed first (the
    copy the kernel then makes reads it from cache)."""
    view = memoryview(data).cast("B")
    step = min(chunk, _HASH_PIECE) if hasher is not None else chunk
    done = 0
    while done < len(view):
        piece = view[done : done + step]
        if hasher is not None:
            hasher.update(piece)
        put = 0
        while put < len(piece):
            n = os.pwrite(fd, piece[put:], offset + done + put)
            put += n
            advance(n)
        done += put


def _write_checked(marks: se.Marks, collection: str, fd: int, data: Any, offset: int,
                   advance: Callable[[int], None], chunk: int,
                   extent: tuple[str | None, int, str] | None, name: str) -> None:
    """Write one tensor's bytes, verifying them against their checksum as they go out
    (``extent``: segment, offset, checksum; None: already verified): an exported file
    never carries damage. A failure marks the segment corrupt (CorruptData)."""
    if extent is None or extent[0] is None:
        _write_all(fd, data, offset, advance, chunk)
        return
    h = se.Hasher()
    _write_all(fd, data, offset, advance, chunk, h)
    got = h.hexdigest()
    if got != extent[2]:
        reason = f"{collection}/{name}: checksum {got} != {extent[2]}"
        marks.mark_corrupt(extent[0], extent[1], reason)
        raise CorruptData(f"{collection}/{name}: stored bytes fail their checksum "
                          f"(expected {extent[2]}, found {got}); not exported",
                          collection=collection, tensor=name)


def run_export(db: Database, marks: se.Marks, collection: str,
               out_dir: str | os.PathLike[str], *, version: int | None = None,
               progress: bool | None = None) -> list[Path]:
    """Write a version (default: the head) of ``collection`` as safetensors into
    ``out_dir`` (created if missing) and return the paths written, index last.

    A version imported by ``import_safetensors`` comes back in its recorded layout: the
    same files (shards and ``model.safetensors.index.json``), tensor order and
    ``__metadata__``; byte-identical to what safetensors wrote, as long as the tensors'
    values are unchanged. A file whose tensors came or went since takes safetensors'
    own order. A collection never imported becomes one ``model.safetensors`` with the
    commit's metadata as ``__metadata__``. Each file is written beside its final name and
    renamed into place, so a reader never sees half a file. Bytes that fail their
    checksum on the way out mark their extent in ``marks`` (the node's) and raise
    CorruptData.
    """
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise InvalidInput(f"{out}: exists and is not a folder", collection=collection)
    with db.snapshot(collection, version=version) as snap:
        commit = snap.commit
        layout = _find_layout(db, collection, snap.version, commit)
        files, index = _plan(collection, snap.info(), layout, commit.metadata)
        state = snap.state_dict()
        info = snap.info()
        extents: dict[str, tuple[str | None, int, str] | None] = {}
        # a sharded tensor (no segment of its own, some bytes) is assembled with each
        # shard checked now; every other one is checked as it is written
        sharded = {n: snap.verified(n) for n, (sid, _, _) in snap.extents().items()
                   if sid is None and info[n][2]}
        tensors: Mapping[str, torch.Tensor] = {**state, **sharded} if sharded else state
        for n, ext in snap.extents().items():
            extents[n] = None if n in sharded else ext
        model_files = {n: snap.file(n) for n in snap.files()}  # checked: CorruptData
    out.mkdir(parents=True, exist_ok=True)
    total = sum(n for f in files for _, _, n in f.tensors)
    written: list[Path] = []
    with progress_bar(progress, total, f"export {collection}") as advance, \
            ThreadPoolExecutor(max(2, min(8, os.cpu_count() or 2))) as pool:
        chunk = _CHUNK if progress else 1 << 30
        for f in files:
            final = out / f.name
            tmp = out / f".{f.name}.{uuid.uuid4().hex[:8]}.tmp"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0),
                         0o644)
            try:
                size = 8 + len(f.header) + sum(n for _, _, n in f.tensors)
                os.ftruncate(fd, size)
                _write_all(fd, struct.pack("<Q", len(f.header)) + f.header, 0, lambda n: None,
                           chunk)
                jobs = [pool.submit(_write_checked, marks, collection, fd,
                                    tensors[n].reshape(-1).view(torch.uint8).numpy(), off,
                                    advance, chunk, extents[n], n)
                        for n, off, nbytes in f.tensors if nbytes]
                for j in jobs:
                    j.result()
                os.fsync(fd)
            except BaseException:
                os.close(fd)
                tmp.unlink(missing_ok=True)
                raise
            os.close(fd)
            os.replace(tmp, final)
            written.append(final)
        written += write_files(out, model_files)
        if index is not None:
            final = out / index[0]
            tmp = out / f".{index[0]}.{uuid.uuid4().hex[:8]}.tmp"
            tmp.write_bytes(index[1].encode("utf-8"))
            os.replace(tmp, final)
            written.append(final)
    return written
