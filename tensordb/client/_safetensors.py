"""safetensors files and Hugging Face sharded folders in and out of a collection.

Import copies each tensor once, from the file straight into its extent in the store
(``Transaction.put_raw`` with ``os.preadv``, which releases the GIL; the store runs the
fills on its I/O pool). Every header is validated before the transaction starts, so a
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
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

import storage_engine as se
from tensordb.catalog import Commit
from tensordb.errors import CorruptData, InvalidInput, NotFound

if TYPE_CHECKING:
    from ._database import Database

__all__ = [
    "INDEX_NAME",
    "LAYOUT_KEY",
    "MAX_HEADER_SIZE",
    "SAFETENSORS_DTYPES",
    "export_safetensors",
    "import_safetensors",
]

#: the cap safetensors puts on the JSON header
MAX_HEADER_SIZE = 100_000_000
#: the reserved commit-metadata key holding the file layout (a JSON string)
LAYOUT_KEY = "tensordb.safetensors"
#: the index file of a sharded Hugging Face checkpoint
INDEX_NAME = "model.safetensors.index.json"
_SINGLE_NAME = "model.safetensors"
_LAYOUT_FORMAT = 1

# safetensors dtype -> (torch dtype attribute, rank in safetensors' ``Dtype`` enum). The
# writer orders tensors by descending rank, then by name; the ranks were checked against
# files written by safetensors 0.8. F6_E2M3 / F6_E3M2 have no torch dtype.
_ST: dict[str, tuple[str | None, int]] = {
    "BOOL": ("bool", 0), "F4": ("float4_e2m1fn_x2", 1), "F6_E2M3": (None, 2),
    "F6_E3M2": (None, 3), "U8": ("uint8", 4), "I8": ("int8", 5),
    "F8_E5M2": ("float8_e5m2", 6), "F8_E4M3": ("float8_e4m3fn", 7),
    "F8_E8M0": ("float8_e8m0fnu", 8), "F8_E4M3FNUZ": ("float8_e4m3fnuz", 9),
    "F8_E5M2FNUZ": ("float8_e5m2fnuz", 10), "I16": ("int16", 11), "U16": ("uint16", 12),
    "F16": ("float16", 13), "BF16": ("bfloat16", 14), "I32": ("int32", 15),
    "U32": ("uint32", 16), "F32": ("float32", 17), "C64": ("complex64", 18),
    "F64": ("float64", 19), "I64": ("int64", 20), "U64": ("uint64", 21),
}
#: safetensors dtype name -> torch dtype, for the dtypes this torch build has
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    st: getattr(torch, attr) for st, (attr, _) in _ST.items()
    if attr is not None and isinstance(getattr(torch, attr, None), torch.dtype)
}
_ST_BY_TORCH = {dt: st for st, dt in SAFETENSORS_DTYPES.items()}
_RANK = {st: rank for st, (_, rank) in _ST.items()}
_F4 = "F4"  # two 4-bit values per byte: torch's last dimension is half of safetensors'

_CHUNK = 64 << 20  # read/write granularity when a progress bar is shown


# -- headers ---------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class _Entry:
    """One tensor of a file's header. Offsets are relative to the data section."""

    name: str
    st_dtype: str
    st_shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def dtype(self) -> torch.dtype:
        return SAFETENSORS_DTYPES[self.st_dtype]

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape as torch sees it."""
        if self.st_dtype == _F4:
            return self.st_shape[:-1] + (self.st_shape[-1] // 2,)
        return self.st_shape


@dataclass(frozen=True, slots=True)
class _Header:
    path: Path
    data_start: int  # 8 + the header length
    metadata: dict[str, str] | None
    entries: tuple[_Entry, ...]  # in file (offset) order
    raw: bytes  # the header as written, padding included

    @property
    def nbytes(self) -> int:
        return self.entries[-1].end if self.entries else 0


def _pread_exact(fd: int, n: int, offset: int, path: Path, what: str) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    done = 0
    while done < n:
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            raise CorruptData(f"{path}: file ends inside the {what} (read {done} of {n} bytes)")
        done += got
    return bytes(buf)


class _Duplicate(Exception):
    pass


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise _Duplicate(k)
        out[k] = v
    return out


def _is_count(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _element_bytes(path: Path, name: str, st_dtype: str, shape: tuple[int, ...]) -> int:
    numel = 1
    for d in shape:
        numel *= d
    if st_dtype == _F4:
        if not shape or shape[-1] % 2:
            raise InvalidInput(f"{path}: tensor {name!r} is F4 with shape {list(shape)}: torch "
                               f"packs F4 in pairs along the last dimension, which must be even",
                               tensor=name)
        return numel // 2
    return numel * SAFETENSORS_DTYPES[st_dtype].itemsize


def _parse_entry(path: Path, name: str, info: object) -> _Entry:
    if not isinstance(info, dict):
        raise CorruptData(f"{path}: header entry of tensor {name!r} is not an object",
                          tensor=name)
    missing = [k for k in ("dtype", "shape", "data_offsets") if k not in info]
    if missing:
        raise CorruptData(f"{path}: header entry of tensor {name!r} lacks {', '.join(missing)}",
                          tensor=name)
    dtype, shape, offs = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(dtype, str):
        raise CorruptData(f"{path}: tensor {name!r} has dtype {dtype!r}, not a string",
                          tensor=name)
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise CorruptData(f"{path}: tensor {name!r} has shape {shape!r}, not a list of "
                          f"non-negative integers", tensor=name)
    if (not isinstance(offs, list) or len(offs) != 2 or not all(_is_count(o) for o in offs)):
        raise CorruptData(f"{path}: tensor {name!r} has data_offsets {offs!r}, not two "
                          f"non-negative integers", tensor=name)
    if dtype not in SAFETENSORS_DTYPES:
        known = "known to safetensors but" if dtype in _ST else "unknown to safetensors and"
        raise InvalidInput(f"{path}: tensor {name!r} has dtype {dtype!r}, {known} not "
                           f"supported; supported: {', '.join(SAFETENSORS_DTYPES)}", tensor=name)
    return _Entry(name, dtype, tuple(shape), offs[0], offs[1])


def _read_header(fd: int, path: Path) -> _Header:
    """Parse and validate one file's header as strictly as safetensors does (and refuse
    duplicate keys, which it would silently merge). Reads only the header."""
    size = os.fstat(fd).st_size
    if size < 8:
        raise CorruptData(f"{path}: {size} bytes is too small for a safetensors file (the "
                          f"header length alone takes 8)")
    (n,) = struct.unpack("<Q", _pread_exact(fd, 8, 0, path, "header length"))
    if n > MAX_HEADER_SIZE:
        raise CorruptData(f"{path}: header length {n:,} exceeds the cap of "
                          f"{MAX_HEADER_SIZE:,} bytes")
    if 8 + n > size:
        raise CorruptData(f"{path}: truncated header: it claims {n:,} bytes, the file holds "
                          f"{size - 8:,} after the length")
    raw = _pread_exact(fd, n, 8, path, "header")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CorruptData(f"{path}: header is not UTF-8 ({exc.reason} at byte {exc.start})") \
            from None
    try:
        doc = json.loads(text, object_pairs_hook=_no_duplicates)
    except _Duplicate as exc:
        raise CorruptData(f"{path}: header names {str(exc)!r} twice") from None
    except (ValueError, RecursionError) as exc:
        raise CorruptData(f"{path}: header is not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise CorruptData(f"{path}: header is a JSON {type(doc).__name__}, not an object")
    metadata = doc.pop("__metadata__", None)
    if metadata is not None and not (isinstance(metadata, dict) and all(
            isinstance(v, str) for v in metadata.values())):
        raise CorruptData(f"{path}: __metadata__ must map strings to strings")
    if metadata is not None and LAYOUT_KEY in metadata:
        raise InvalidInput(f"{path}: __metadata__ uses the key {LAYOUT_KEY!r}, which tensordb "
                           f"reserves")
    entries = sorted((_parse_entry(path, k, v) for k, v in doc.items()),
                     key=lambda e: (e.begin, e.end))
    data_len = size - 8 - n
    pos = 0
    prev: _Entry | None = None
    for e in entries:
        if e.end < e.begin:
            raise CorruptData(f"{path}: tensor {e.name!r} has data_offsets [{e.begin}, {e.end}]"
                              f" that end before they begin", tensor=e.name)
        if e.end > data_len:
            raise CorruptData(f"{path}: tensor {e.name!r} has data_offsets [{e.begin}, {e.end}]"
                              f" out of bounds: the data section holds {data_len:,} bytes "
                              f"(truncated file?)", tensor=e.name)
        need = _element_bytes(path, e.name, e.st_dtype, e.st_shape)
        if e.end - e.begin != need:
            raise CorruptData(f"{path}: tensor {e.name!r} spans {e.end - e.begin:,} bytes but "
                              f"{e.st_dtype} x {list(e.st_shape)} needs {need:,}", tensor=e.name)
        if e.begin < pos:
            assert prev is not None
            raise CorruptData(f"{path}: tensor {e.name!r} at [{e.begin}, {e.end}] overlaps "
                              f"{prev.name!r} at [{prev.begin}, {prev.end}]", tensor=e.name)
        if e.begin > pos:
            raise CorruptData(f"{path}: {e.begin - pos:,} bytes at data offset {pos} belong to "
                              f"no tensor (gap before {e.name!r})", tensor=e.name)
        pos, prev = e.end, e
    if pos != data_len:
        raise CorruptData(f"{path}: the tensors cover {pos:,} bytes of a {data_len:,}-byte "
                          f"data section")
    return _Header(path, 8 + n, metadata, tuple(entries), raw)


def _header_bytes(metadata: Mapping[str, str] | None,
                  entries: Sequence[tuple[str, str, Sequence[int], int, int]]) -> bytes:
    """A header as safetensors' writer makes it: compact JSON (serde_json), ``__metadata__``
    first, then (name, dtype, shape, begin, end) in the order given, padded with spaces
    to a multiple of 8 bytes."""
    doc: dict[str, Any] = {}
    if metadata is not None:
        doc["__metadata__"] = dict(metadata)
    for name, dtype, shape, begin, end in entries:
        doc[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [begin, end]}
    out = json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    return out + b" " * (-len(out) % 8)


def _canonical(items: list[tuple[str, str]]) -> list[str]:
    """safetensors' order: dtype alignment (its enum rank) descending, then name."""
    return [n for n, _ in sorted(items, key=lambda it: (-_RANK[it[1]], it[0].encode()))]


# -- sources: one file, or a sharded folder ---------------------------------------------
def _check_file_name(name: object, where: str) -> str:
    if (not isinstance(name, str) or not name or name in (".", "..") or "/" in name
            or "\\" in name or "\x00" in name or name.startswith(".")):
        raise CorruptData(f"{where}: {name!r} is not a plain file name in the same folder")
    return name


@dataclass(frozen=True, slots=True)
class _Index:
    path: Path
    doc: dict[str, Any]
    raw: str
    weight_map: dict[str, str]


def _index_text(doc: Mapping[str, Any]) -> str:
    # transformers' save_pretrained: sorted keys, indent 2, a final newline
    return json.dumps(doc, indent=2, sort_keys=True) + "\n"


def _read_index(path: Path) -> _Index:
    try:
        raw = path.read_bytes().decode("utf-8")  # no newline translation: kept byte for byte
    except UnicodeDecodeError as exc:
        raise CorruptData(f"{path}: not UTF-8 ({exc.reason})") from None
    try:
        doc = json.loads(raw, object_pairs_hook=_no_duplicates)
    except _Duplicate as exc:
        raise CorruptData(f"{path}: names {str(exc)!r} twice") from None
    except (ValueError, RecursionError) as exc:
        raise CorruptData(f"{path}: not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise CorruptData(f"{path}: a JSON {type(doc).__name__}, not an object")
    wm = doc.get("weight_map")
    if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
        raise CorruptData(f"{path}: 'weight_map' must map tensor names to file names")
    if "metadata" in doc and not isinstance(doc["metadata"], dict):
        raise CorruptData(f"{path}: 'metadata' must be an object")
    for file in set(wm.values()):
        _check_file_name(file, str(path))
    return _Index(path, doc, raw, wm)


def _resolve(path: str | os.PathLike[str]) -> tuple[list[Path], _Index | None]:
    p = Path(path)
    if not p.exists():
        raise InvalidInput(f"{p}: no such file or folder")
    index_path: Path | None = None
    if p.is_dir():
        if (p / INDEX_NAME).is_file():
            index_path = p / INDEX_NAME
        else:
            indexes = sorted(p.glob("*.safetensors.index.json"))
            files = sorted(f for f in p.glob("*.safetensors") if f.is_file())
            if len(indexes) == 1:
                index_path = indexes[0]
            elif not indexes and len(files) == 1:
                return files, None
            else:
                raise InvalidInput(f"{p}: a folder to import needs {INDEX_NAME} (or exactly one "
                                   f"*.safetensors file); found {len(indexes)} index file(s) "
                                   f"and {len(files)} .safetensors file(s)")
    elif p.name.endswith(".json"):
        index_path = p
    elif not p.is_file():
        raise InvalidInput(f"{p}: not a regular file")
    if index_path is None:
        return [p], None
    index = _read_index(index_path)
    names = sorted(set(index.weight_map.values()))
    files = [index_path.parent / n for n in names]
    for f in files:
        if not f.is_file():
            raise CorruptData(f"{index_path}: shard {f.name!r} is missing from {f.parent}")
    return files, index


# -- progress --------------------------------------------------------------------------
@contextmanager
def _progress(enabled: bool | None, total: int, label: str) -> Iterator[Callable[[int], None]]:
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
def _reader(fd: int, offset: int, nbytes: int, path: Path, name: str,
            advance: Callable[[int], None], chunk: int) -> Callable[[Any], str]:
    # pieces of half an L2: each is hashed right after the kernel wrote it, from cache
    piece = min(chunk, se.HASH_PIECE)

    def fill(dst: Any) -> str:
        # straight from the page cache (or disk) into the extent; preadv releases the GIL
        view = memoryview(dst)
        h = se.Hasher()
        done = 0
        while done < nbytes:
            got = os.preadv(fd, [view[done : min(nbytes, done + piece)]], offset + done)
            if got <= 0:
                raise CorruptData(f"{path}: the file shrank while tensor {name!r} was read "
                                  f"({done:,} of {nbytes:,} bytes)", tensor=name)
            h.update(view[done : done + got])
            done += got
            advance(got)
        return h.hexdigest()

    return fill


def _layout(headers: list[_Header], index: _Index | None) -> dict[str, Any]:
    files = []
    for h in headers:
        order = [e.name for e in h.entries]
        entry: dict[str, Any] = {"file": h.path.name, "metadata": h.metadata, "tensors": order}
        regenerated = _header_bytes(h.metadata, [(e.name, e.st_dtype, e.st_shape, e.begin,
                                                  e.end) for e in h.entries])
        if regenerated != h.raw:  # not safetensors' own serialization: keep it verbatim
            entry["header"] = h.raw.decode("utf-8")
        files.append(entry)
    out: dict[str, Any] = {"format": _LAYOUT_FORMAT, "files": files}
    if index is not None:
        idx: dict[str, Any] = {"file": index.path.name}
        if "metadata" in index.doc:
            idx["metadata"] = index.doc["metadata"]
        if _index_text(index.doc) != index.raw:
            idx["raw"] = index.raw
        out["index"] = idx
    return out


def import_safetensors(db: Database, collection: str, path: str | os.PathLike[str],
                       *, message: str | None = None, tier: str | None = None,
                       progress: bool | None = None) -> Commit:
    """Import one ``.safetensors`` file, or a Hugging Face folder with
    ``model.safetensors.index.json`` (all shards), as ONE new version of ``collection``.

    The new version holds exactly the file's tensors: names the head has and the file
    lacks are deleted in it. ``__metadata__`` becomes the commit's metadata (of the first
    shard, for a folder), beside the file layout under ``LAYOUT_KEY``. Every header is
    validated before anything is written: a malformed, truncated or inconsistent file
    raises ``CorruptData``, an unsupported dtype or a bad argument ``InvalidInput``, and
    the store is left unchanged. Blocks until the commit is published; ``progress=True``
    shows a rich progress bar (for the CLI).
    """
    files, index = _resolve(path)
    fds: list[int] = []
    try:
        headers: list[_Header] = []
        for f in files:
            try:
                fds.append(os.open(f, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)))
            except OSError as exc:
                raise InvalidInput(f"{f}: cannot open: {exc.strerror}") from None
            headers.append(_read_header(fds[-1], f))
        owner: dict[str, Path] = {}
        for h in headers:
            for e in h.entries:
                if e.name in owner:
                    raise CorruptData(f"{h.path}: tensor {e.name!r} is also in "
                                      f"{owner[e.name].name}", tensor=e.name)
                owner[e.name] = h.path
        if index is not None:
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
        meta: dict[str, str] = dict(headers[0].metadata or {}) if headers else {}
        meta[LAYOUT_KEY] = json.dumps(_layout(headers, index), separators=(",", ":"),
                                      ensure_ascii=False)
        source = index.path.parent if index is not None else files[0]
        stale: list[str] = []
        try:  # one catalog look-up, not a listing of every collection
            with db.snapshot(collection) as snap:
                stale = [n for n in snap if n not in owner]
        except NotFound:  # a new collection (or one with no version yet)
            pass
        total = sum(h.nbytes for h in headers)
        with _progress(progress, total, f"import {source.name}") as advance:
            chunk = _CHUNK if progress else 1 << 62
            with db.transaction(collection, message=message or f"import {source.name}",
                                tier=tier, metadata=meta) as tx:
                for h, fd in zip(headers, fds):
                    for e in h.entries:
                        tx.put_raw(e.name, e.dtype, e.shape,
                                   _reader(fd, h.data_start + e.begin, e.end - e.begin, h.path,
                                           e.name, advance, chunk))
                for name in stale:
                    tx.delete(name)
        assert tx.result is not None
        return tx.result
    finally:
        for fd in fds:
            os.close(fd)


# -- export ----------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class _OutFile:
    name: str
    header: bytes
    tensors: list[tuple[str, int, int]]  # name, offset in the file, nbytes


def _st_dtype_shape(name: str, dtype: str, shape: tuple[int, ...],
                    collection: str) -> tuple[str, tuple[int, ...]]:
    dt = getattr(torch, dtype, None)
    st = _ST_BY_TORCH.get(dt) if isinstance(dt, torch.dtype) else None
    if st is None:
        raise InvalidInput(f"{collection}/{name}: safetensors has no dtype for {dtype}",
                           collection=collection, tensor=name)
    if st == _F4:
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
        assert layout["format"] == _LAYOUT_FORMAT and isinstance(layout["files"], list)
        for f in layout["files"]:
            _check_file_name(f["file"], f"layout of {collection}")
            assert isinstance(f["tensors"], list)
        if "index" in layout:
            _check_file_name(layout["index"]["file"], f"layout of {collection}")
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


def _plan(collection: str, info: dict[str, tuple[str, tuple[int, ...], int]],
          layout: dict[str, Any] | None, commit_meta: dict[str, str] | None
          ) -> tuple[list[_OutFile], tuple[str, str] | None]:
    """The files to write (and the index's (name, text)), from the version's tensors and
    the layout recorded at import."""
    st = {n: _st_dtype_shape(n, d, s, collection) for n, (d, s, _) in info.items()}

    def canonical(names: list[str]) -> list[str]:
        return _canonical([(n, st[n][0]) for n in names])

    if layout is None:
        meta = {k: v for k, v in (commit_meta or {}).items() if k != LAYOUT_KEY} or None
        groups = [_Group(_SINGLE_NAME, meta, canonical(list(info)), None)]
        index_spec = None
    else:
        groups = [_Group(f["file"], f.get("metadata"), [n for n in f["tensors"] if n in info], f)
                  for f in layout["files"]]
        placed = {n for g in groups for n in g.names}
        new = [n for n in info if n not in placed]
        if new:  # tensors added since the import go to the last file
            if not groups:
                groups.append(_Group(_SINGLE_NAME, None, [], None))
            groups[-1].names += new
        for g in groups:
            if g.recorded is None or g.names != g.recorded["tensors"]:
                g.names, g.recorded = canonical(g.names), None  # safetensors' own order
        if len(groups) > 1:
            groups = [g for g in groups if g.names]
        index_spec = layout.get("index")
    out: list[_OutFile] = []
    for g in groups:
        entries, pos = [], 0
        for n in g.names:
            nbytes = info[n][2]
            entries.append((n, st[n][0], st[n][1], pos, pos + nbytes))
            pos += nbytes
        header = _header_bytes(g.metadata, entries)
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
        out.append(_OutFile(g.file, header, [(n, 8 + len(header) + b, e - b)
                                           for n, _, _, b, e in entries]))
    index: tuple[str, str] | None = None
    if index_spec is not None:
        weight_map = {n: f.name for f in out for n, _, _ in f.tensors}
        doc: dict[str, Any] = {}
        if "metadata" in index_spec:
            doc["metadata"] = dict(index_spec["metadata"])
            if "total_size" in doc["metadata"]:
                doc["metadata"]["total_size"] = sum(v[2] for v in info.values())
        doc["weight_map"] = weight_map
        text = _index_text(doc)
        raw_index = index_spec.get("raw")
        if raw_index is not None:  # another writer's index: verbatim while it still holds
            try:
                old = json.loads(raw_index)
                if old.get("weight_map") == weight_map and old.get("metadata") == doc.get(
                        "metadata"):
                    text = raw_index
            except (ValueError, AttributeError):
                pass
        index = (index_spec["file"], text)
    return out, index


def _write_all(fd: int, data: Any, offset: int, advance: Callable[[int], None],
               chunk: int) -> None:
    view = memoryview(data).cast("B")
    done = 0
    while done < len(view):
        n = os.pwrite(fd, view[done : done + chunk], offset + done)
        done += n
        advance(n)


def export_safetensors(db: Database, collection: str,
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
    renamed into place, so a reader never sees half a file.
    """
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise InvalidInput(f"{out}: exists and is not a folder", collection=collection)
    with db.snapshot(collection, version=version) as snap:
        commit = snap.commit
        layout = _find_layout(db, collection, snap.version, commit)
        files, index = _plan(collection, snap.info(), layout, commit.metadata)
        tensors = snap.state_dict()
    out.mkdir(parents=True, exist_ok=True)
    total = sum(n for f in files for _, _, n in f.tensors)
    written: list[Path] = []
    with _progress(progress, total, f"export {collection}") as advance, \
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
                jobs = [pool.submit(_write_all, fd,
                                    tensors[n].reshape(-1).view(torch.uint8).numpy(), off,
                                    advance, chunk)
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
        if index is not None:
            final = out / index[0]
            tmp = out / f".{index[0]}.{uuid.uuid4().hex[:8]}.tmp"
            tmp.write_bytes(index[1].encode("utf-8"))
            os.replace(tmp, final)
            written.append(final)
    return written
