"""The safetensors file format: its dtypes, headers and Hugging Face index files.

Headers are parsed and validated as strictly as safetensors does (and duplicate keys,
which it would silently merge, are refused); ``header_bytes`` writes one with
safetensors' own serialization rules (compact JSON, ``__metadata__`` first, entries in
the order given, padded with spaces to 8 bytes). ``_safetensors`` moves the bytes.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import Any

import torch

from tensordb.errors import CorruptData, InvalidInput

__all__ = [
    "F4",
    "INDEX_NAME",
    "LAYOUT_FORMAT",
    "LAYOUT_KEY",
    "MAX_HEADER_SIZE",
    "MAX_METADATA_BYTES",
    "MAX_STORED_HEADER",
    "MAX_TENSORS_PER_FILE",
    "ReadAt",
    "SAFETENSORS_DTYPES",
    "SINGLE_NAME",
    "ST_BY_TORCH",
    "Entry",
    "Header",
    "Index",
    "canonical_order",
    "check_file_name",
    "header_bytes",
    "index_text",
    "parse_header",
    "parse_index",
    "read_header",
    "resolve_source",
]

#: the cap safetensors puts on the JSON header
MAX_HEADER_SIZE = 100_000_000
#: what one file's header may put in the catalog (it keeps the tensor names, the
#: metadata and, for a header safetensors' rules would not reproduce, the header
#: itself): a header of at most this many bytes (a real one of 100,000 tensors is
#: about 12 MB), at most this many tensors, ``__metadata__`` of at most this many bytes
#: of keys and values; larger is InvalidInput at import, nothing committed
MAX_STORED_HEADER = 16 << 20
MAX_TENSORS_PER_FILE = 100_000
MAX_METADATA_BYTES = 1 << 20
#: a dimension, and a shape's element count, must fit int64 (torch's sizes)
_MAX_INT64 = 2**63 - 1
#: the reserved commit-metadata key holding the file layout (a JSON string)
LAYOUT_KEY = "tensordb.safetensors"
#: the index file of a sharded Hugging Face checkpoint
INDEX_NAME = "model.safetensors.index.json"
#: the file a collection never imported is exported as
SINGLE_NAME = "model.safetensors"
#: the version of the layout record under LAYOUT_KEY
LAYOUT_FORMAT = 1

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
#: torch dtype -> safetensors dtype name
ST_BY_TORCH = {dt: st for st, dt in SAFETENSORS_DTYPES.items()}
_RANK = {st: rank for st, (_, rank) in _ST.items()}
F4 = "F4"  # two 4-bit values per byte: torch's last dimension is half of safetensors'


# -- headers ---------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Entry:
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
        if self.st_dtype == F4:
            return self.st_shape[:-1] + (self.st_shape[-1] // 2,)
        return self.st_shape


@dataclass(frozen=True, slots=True)
class Header:
    path: PurePath  # a local file's Path, or an object's ObjectPath
    data_start: int  # 8 + the header length
    metadata: dict[str, str] | None
    entries: tuple[Entry, ...]  # in file (offset) order
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


def _element_bytes(path: PurePath, name: str, st_dtype: str, shape: tuple[int, ...]) -> int:
    numel = 1
    for d in shape:
        numel *= d
    if st_dtype == F4:
        if not shape or shape[-1] % 2:
            raise InvalidInput(f"{path}: tensor {name!r} is F4 with shape {list(shape)}: torch "
                               f"packs F4 in pairs along the last dimension, which must be even",
                               tensor=name)
        return numel // 2
    return numel * SAFETENSORS_DTYPES[st_dtype].itemsize


def _parse_entry(path: PurePath, name: str, info: object) -> Entry:
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
    span = 1
    for d in shape:
        span *= max(d, 1)
    if any(d > _MAX_INT64 for d in shape) or span > _MAX_INT64:
        shown = [d if d <= _MAX_INT64 else f"2**{d.bit_length() - 1}+" for d in shape[:8]]
        raise InvalidInput(f"{path}: tensor {name!r} has shape {shown}: a dimension, and "
                           f"the element count, must fit int64 (below 2**63)", tensor=name)
    if (not isinstance(offs, list) or len(offs) != 2 or not all(_is_count(o) for o in offs)):
        raise CorruptData(f"{path}: tensor {name!r} has data_offsets {offs!r}, not two "
                          f"non-negative integers", tensor=name)
    if dtype not in SAFETENSORS_DTYPES:
        known = "known to safetensors but" if dtype in _ST else "unknown to safetensors and"
        raise InvalidInput(f"{path}: tensor {name!r} has dtype {dtype!r}, {known} not "
                           f"supported; supported: {', '.join(SAFETENSORS_DTYPES)}", tensor=name)
    return Entry(name, dtype, tuple(shape), offs[0], offs[1])


#: reads ``n`` bytes at ``offset`` of a file or object, naming ``what`` in its error
ReadAt = Callable[[int, int, str], bytes]


def _read_raw_header(read: ReadAt, path: PurePath, size: int) -> bytes:
    """The header's bytes (padding included), its length checked against the file."""
    if size < 8:
        raise CorruptData(f"{path}: {size} bytes is too small for a safetensors file (the "
                          f"header length alone takes 8)")
    (n,) = struct.unpack("<Q", read(8, 0, "header length"))
    if n > MAX_HEADER_SIZE:
        raise CorruptData(f"{path}: header length {n:,} exceeds the cap of "
                          f"{MAX_HEADER_SIZE:,} bytes")
    if 8 + n > size:
        raise CorruptData(f"{path}: truncated header: it claims {n:,} bytes, the file holds "
                          f"{size - 8:,} after the length")
    return read(n, 8, "header")


def _json_object(raw: bytes, where: str) -> dict[str, Any]:
    """``raw`` as a JSON object, strictly (UTF-8, no name twice); CorruptData whose
    message starts with ``where`` (the file, and what of it) otherwise."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CorruptData(f"{where}is not UTF-8 ({exc.reason} at byte {exc.start})") \
            from None
    try:
        doc = json.loads(text, object_pairs_hook=_no_duplicates)
    except _Duplicate as exc:
        raise CorruptData(f"{where}names {str(exc)!r} twice") from None
    except (ValueError, RecursionError) as exc:
        raise CorruptData(f"{where}is not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise CorruptData(f"{where}is a JSON {type(doc).__name__}, not an object")
    return doc


def _parse_header(path: PurePath, raw: bytes) -> tuple[dict[str, str] | None, list[Entry]]:
    """The header's ``__metadata__`` and its entries in file order (not yet checked
    against each other or the data section)."""
    doc = _json_object(raw, f"{path}: header ")
    metadata = doc.pop("__metadata__", None)
    if metadata is not None and not (isinstance(metadata, dict) and all(
            isinstance(v, str) for v in metadata.values())):
        raise CorruptData(f"{path}: __metadata__ must map strings to strings")
    if metadata is not None and LAYOUT_KEY in metadata:
        raise InvalidInput(f"{path}: __metadata__ uses the key {LAYOUT_KEY!r}, which tensordb "
                           f"reserves")
    if metadata is not None:
        size = sum(len(k.encode("utf-8", "surrogatepass")) + len(v.encode("utf-8", "surrogatepass"))
                   for k, v in metadata.items())
        if size > MAX_METADATA_BYTES:
            raise InvalidInput(f"{path}: __metadata__ holds {size:,} bytes of keys and values; "
                               f"the store keeps at most {MAX_METADATA_BYTES:,}")
    if len(doc) > MAX_TENSORS_PER_FILE:
        raise InvalidInput(f"{path}: the header lists {len(doc):,} tensors; the store takes "
                           f"at most {MAX_TENSORS_PER_FILE:,} per file")
    entries = sorted((_parse_entry(path, k, v) for k, v in doc.items()),
                     key=lambda e: (e.begin, e.end))
    return metadata, entries


def read_header(fd: int, path: Path) -> Header:
    """Parse and validate one file's header as strictly as safetensors does (and refuse
    duplicate keys, which it would silently merge). Reads only the header."""
    return parse_header(path, os.fstat(fd).st_size,
                        lambda n, offset, what: _pread_exact(fd, n, offset, path, what))


def parse_header(path: PurePath, size: int, read: ReadAt) -> Header:
    """``read_header`` of a file or object of ``size`` bytes that ``read`` reads."""
    raw = _read_raw_header(read, path, size)
    if len(raw) > MAX_STORED_HEADER:
        raise InvalidInput(f"{path}: a header of {len(raw):,} bytes; the store takes at most "
                           f"{MAX_STORED_HEADER:,} (what a header puts in the catalog is "
                           f"bounded)")
    metadata, entries = _parse_header(path, raw)
    _check_extents(path, entries, size - 8 - len(raw))
    return Header(path, 8 + len(raw), metadata, tuple(entries), raw)


def _check_extents(path: PurePath, entries: list[Entry], data_len: int) -> None:
    """Each entry spans the bytes its dtype and shape need, and the entries tile the
    data section exactly: no overlap, no gap, nothing past its end."""
    pos = 0
    prev: Entry | None = None
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


def header_bytes(metadata: Mapping[str, str] | None,
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


def canonical_order(items: list[tuple[str, str]]) -> list[str]:
    """safetensors' order: dtype alignment (its enum rank) descending, then name."""
    return [n for n, _ in sorted(items, key=lambda it: (-_RANK[it[1]], it[0].encode()))]


# -- sources: one file, or a sharded folder ---------------------------------------------
def check_file_name(name: object, where: str) -> str:
    if (not isinstance(name, str) or not name or name in (".", "..") or "/" in name
            or "\\" in name or "\x00" in name or name.startswith(".")):
        raise CorruptData(f"{where}: {name!r} is not a plain file name in the same folder")
    return name


@dataclass(frozen=True, slots=True)
class Index:
    path: PurePath
    doc: dict[str, Any]
    raw: str
    weight_map: dict[str, str]


def index_text(doc: Mapping[str, Any]) -> str:
    # transformers' save_pretrained: sorted keys, indent 2, a final newline
    return json.dumps(doc, indent=2, sort_keys=True) + "\n"


def _read_index(path: Path) -> Index:
    # bytes: no newline translation, the text kept byte for byte
    return parse_index(path, path.read_bytes())


def parse_index(path: PurePath, data: bytes) -> Index:
    """A sharded checkpoint's index from its bytes."""
    doc = _json_object(data, f"{path}: ")
    raw = data.decode("utf-8")
    wm = doc.get("weight_map")
    if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
        raise CorruptData(f"{path}: 'weight_map' must map tensor names to file names")
    if "metadata" in doc and not isinstance(doc["metadata"], dict):
        raise CorruptData(f"{path}: 'metadata' must be an object")
    for file in set(wm.values()):
        check_file_name(file, str(path))
    return Index(path, doc, raw, wm)


def resolve_source(path: str | os.PathLike[str]) -> tuple[list[Path], Index | None]:
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
