"""A version's files: the non-tensor files of a model folder (``config.json``,
``generation_config.json``, the tokenizer, chat templates), kept beside the tensors and
versioned with them, so a store alone can start an engine and a version's config cannot
drift from its weights.

They are one row of the version, named ``FILES_ROW`` (``/files``: no tensor may be
named so, a name starting with ``/`` being refused), a uint8 tensor holding a small
self-describing pack: an 8-byte little-endian length, a JSON index (each file's name,
offset, size and xxh3 checksum, in name order) and the files' bytes. The row has its
checksum like any other, and each file its own: ``Snapshot.file`` checks it on every
read. Snapshots hide the row from their tensors (``__iter__``, ``info``,
``state_dict``, ...) and show it as ``files()`` and ``file(name)``.
"""

from __future__ import annotations

import json
import os
import struct
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

import storage_engine as se
from tensordb.catalog import Manifest, TensorRow
from tensordb.errors import CorruptData, InvalidInput, NotFound

from ._safetensors_format import check_file_name

__all__ = ["CHECKOUT_MARKER", "FILES_ROW", "MAX_FILE_BYTES", "MAX_FILES", "FileEntry", "TensorRows",
           "check_files", "file_bytes", "folder_files", "is_weight_file", "pack_files",
           "read_index", "write_files"]

#: the row of a version that holds its files
FILES_ROW = "/files"
#: the file ``Database.checkout`` writes beside the files: the version and the store, as
#: an engine loader's ``model_loader_extra_config`` (``LoadSource.from_folder``)
CHECKOUT_MARKER = "tensordb.json"
#: most bytes of one file, and files of one version: configs and tokenizers, not weights
MAX_FILE_BYTES = 64 << 20
MAX_FILES = 256
_FORMAT = "tensordb.files/1"
#: the weights of a folder, never taken as its files (the tensors are stored as such)
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5",
                    ".msgpack", ".safetensors.index.json", ".bin.index.json")


@dataclass(frozen=True, slots=True)
class FileEntry:
    name: str
    offset: int  # in the pack
    nbytes: int
    checksum: str


def is_weight_file(name: str) -> bool:
    return name.endswith(_WEIGHT_SUFFIXES)


def check_files(files: Mapping[str, object], where: str) -> dict[str, bytes]:
    """``files`` as name -> bytes, each name a plain file name, each within the caps;
    InvalidInput naming what is wrong."""
    if not isinstance(files, Mapping):
        raise InvalidInput(f"{where}: files must be a mapping of file name to bytes, not "
                           f"{type(files).__name__}")
    if len(files) > MAX_FILES:
        raise InvalidInput(f"{where}: {len(files)} files; a version keeps at most {MAX_FILES}")
    out: dict[str, bytes] = {}
    for name, data in files.items():
        try:
            check_file_name(name, where)
        except CorruptData as exc:  # the format's check, for files it reads
            raise InvalidInput(str(exc)) from None
        if is_weight_file(name):
            raise InvalidInput(f"{where}: {name!r} is a weight file: commit its tensors")
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise InvalidInput(f"{where}: file {name!r} must be bytes, not "
                               f"{type(data).__name__}")
        b = bytes(data)
        if len(b) > MAX_FILE_BYTES:
            raise InvalidInput(f"{where}: file {name!r} holds {len(b):,} bytes; a version's "
                               f"files hold at most {MAX_FILE_BYTES:,} each")
        out[name] = b
    return out


def pack_files(files: Mapping[str, bytes]) -> np.ndarray:
    """The pack of checked ``files`` (``check_files``): length, index, bytes."""
    names = sorted(files)
    entries, offset = [], 0
    for n in names:
        entries.append({"name": n, "offset": offset, "nbytes": len(files[n]),
                        "checksum": se.checksum(files[n])})
        offset += len(files[n])
    index = json.dumps({"format": _FORMAT, "files": entries}, separators=(",", ":"),
                       ensure_ascii=False).encode()
    out = np.empty(8 + len(index) + offset, np.uint8)
    out[:8] = np.frombuffer(struct.pack("<Q", len(index)), np.uint8)
    out[8:8 + len(index)] = np.frombuffer(index, np.uint8)
    at = 8 + len(index)
    for n in names:
        out[at:at + len(files[n])] = np.frombuffer(files[n], np.uint8)
        at += len(files[n])
    return out


def read_index(pack: np.ndarray, where: str) -> tuple[int, dict[str, FileEntry]]:
    """The pack's data offset and its entries, every value checked against the pack's
    size (CorruptData naming ``where``)."""
    n = int(pack.shape[0])
    if n < 8:
        raise CorruptData(f"{where}: the files' pack is {n} bytes, too short for its index")
    (hlen,) = struct.unpack("<Q", pack[:8].tobytes())
    if hlen > n - 8:
        raise CorruptData(f"{where}: the files' index claims {hlen:,} bytes of {n - 8:,}")
    try:
        doc = json.loads(pack[8:8 + hlen].tobytes().decode("utf-8"))
        assert doc["format"] == _FORMAT and isinstance(doc["files"], list)
        entries = {}
        for e in doc["files"]:
            fe = FileEntry(check_file_name(e["name"], where), int(e["offset"]),
                           int(e["nbytes"]), str(e["checksum"]))
            assert 0 <= fe.offset and 0 <= fe.nbytes and fe.offset + fe.nbytes <= n - 8 - hlen
            assert fe.name not in entries
            entries[fe.name] = fe
    except (ValueError, KeyError, TypeError, AssertionError, UnicodeDecodeError) as exc:
        raise CorruptData(f"{where}: the files' index is damaged: {exc!r}") from None
    return 8 + hlen, entries


def folder_files(folder: Path) -> dict[str, bytes]:
    """The non-weight regular files right in ``folder`` (configs, tokenizer, chat
    templates, README), checked as ``check_files`` does."""
    files: dict[str, object] = {}
    for p in sorted(folder.iterdir()):
        if p.is_file() and not p.name.startswith(".") and not is_weight_file(p.name) \
                and p.name != CHECKOUT_MARKER:  # a checkout's marker names the store
            if p.stat().st_size > MAX_FILE_BYTES:
                raise InvalidInput(f"{p}: {p.stat().st_size:,} bytes; a version's files hold "
                                   f"at most {MAX_FILE_BYTES:,} each")
            files[p.name] = p.read_bytes()
    return check_files(files, str(folder))


class TensorRows(Mapping[str, TensorRow]):
    """A version's rows (its ``Manifest``) less the files' row: what a snapshot shows as
    its tensors. A look-up costs what the manifest's does; ``len`` and ``nbytes`` one
    look-up more, once."""

    def __init__(self, rows: Manifest) -> None:
        self.rows = rows
        self._files: TensorRow | None | bool = False  # False: not looked up yet

    @property
    def files_row(self) -> TensorRow | None:
        if self._files is False:
            self._files = self.rows.get(FILES_ROW) if FILES_ROW in self.rows else None
        return self._files  # type: ignore[return-value]

    def __len__(self) -> int:
        return len(self.rows) - (self.files_row is not None)

    def __iter__(self) -> Iterator[str]:
        return (n for n in self.rows if n != FILES_ROW)

    def __contains__(self, name: object) -> bool:
        return name != FILES_ROW and name in self.rows

    def __getitem__(self, name: str) -> TensorRow:
        if name == FILES_ROW:
            raise KeyError(name)
        return self.rows[name]

    def get(self, name: str, default: Any = None) -> Any:
        return default if name == FILES_ROW else self.rows.get(name, default)

    def values(self) -> Any:
        return [r for r in self.rows.values() if r.name != FILES_ROW]

    def items(self) -> Any:
        return [(n, r) for n, r in self.rows.items() if n != FILES_ROW]

    @property
    def nbytes(self) -> int:
        f = self.files_row
        return self.rows.nbytes - (f.nbytes if f is not None else 0)

    def first_of_segments(self) -> list[TensorRow]:
        # the files' row kept: mapping its segment maps the tensors that share it
        return self.rows.first_of_segments()

    def tuples(self) -> list[tuple[Any, ...]]:
        return [t for t in self.rows.tuples() if t[0] != FILES_ROW]

    def has_sharded(self) -> bool:
        return self.rows.has_sharded()

    def sharded_rows(self) -> list[TensorRow]:
        return self.rows.sharded_rows()


def file_bytes(pack: np.ndarray, name: str, where: str) -> bytes:
    """One file out of a version's pack, checked against its checksum (CorruptData)."""
    start, entries = read_index(pack, where)
    e = entries.get(name)
    if e is None:
        raise NotFound(f"{where} has no file {name!r}")
    data = pack[start + e.offset:start + e.offset + e.nbytes].tobytes()
    if se.checksum(data) != e.checksum:
        raise CorruptData(f"{where}: file {name!r} does not match its checksum")
    return data


def write_files(out: Path, files: Mapping[str, bytes]) -> list[Path]:
    """Write ``files`` into the folder ``out``, each beside its final name first and then
    renamed over it (a reader never sees half a file); the paths, in name order."""
    written = []
    for name in sorted(files):
        final = out / check_file_name(name, str(out))
        tmp = out / f".{name}.{uuid.uuid4().hex[:8]}.tmp"
        try:
            tmp.write_bytes(files[name])
            os.replace(tmp, final)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        written.append(final)
    return written
