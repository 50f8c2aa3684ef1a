"""safetensors files and sharded folders imported from object storage (``s3://``).

Every header (and the index) is read with ranged GETs and validated before anything is
fetched, as the local import does. The tensors' bytes then go straight into the store's
extents: one fill per batch (``RawPut.many``, ``_fetch_batch``) submits every GET at once
to the object store's pool (``max_concurrency`` in flight), neighbouring tensors in runs
of up to ``WHOLE_PARTS`` parts (one GET each, each tensor hashed as its bytes stream
in), a larger tensor in ``part_size`` parts hashed in order once they land.

An import is resumable. Its tensors are committed in batches of about ``batch_bytes``,
each batch a part of one group commit (``Writer.commit_part``): the version appears,
atomically, with the last batch, and until then the batches that landed are a *pending
import* in the catalog, invisible to readers. A failed import keeps them; the next
``import_safetensors(..., resume=True)`` of the same objects (same keys, sizes and ETags)
into the same collection fetches only the batches that had not landed. An import
without ``resume`` drops any pending import of the same source first. A pending import
expires ``pending_ttl`` seconds after it began (a day by default); ``gc`` then reclaims
its bytes.
"""

from __future__ import annotations

import functools
import hashlib
import json
import threading
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import Future, wait
from typing import TYPE_CHECKING, Any, Protocol, cast

import numpy as np
import torch

import storage_engine as se
from tensordb.catalog import Commit
from tensordb.errors import CorruptData, InvalidInput, NotFound

from ._model_files import (
    CHECKOUT_MARKER,
    FILES_ROW,
    MAX_FILE_BYTES,
    check_files,
    is_weight_file,
    pack_files,
)
from ._object_store import ObjectInfo, ObjectStore
from ._puts import Extents, GroupSpec, RawPut, ShardPut
from ._safetensors import finish_version, progress_bar, version_plan
from ._safetensors_format import INDEX_NAME, Entry, Header, Index, parse_header, parse_index

if TYPE_CHECKING:
    from ._database import Database

__all__ = ["BATCH_BYTES", "HEAD_READ", "PENDING_TTL", "PartCommits", "run_object_import"]

#: bytes of tensors per resumable batch (one segment and one part each)
BATCH_BYTES = 256 << 20
#: seconds a pending import is kept for a resume; gc reclaims it after
PENDING_TTL = 86400.0
#: the name of an import's group: this prefix, the source's digest, a random tail
_GROUP_PREFIX = "import:"
#: bytes of an object read first, for its header: a model's shard has a header of tens
#: of KiB (a longer one costs a second GET)
HEAD_READ = 128 << 10
#: the largest index read (a real one of 100,000 tensors is a few MB)
_MAX_INDEX = 64 << 20


class PartCommits(Protocol):
    """What an object import needs beyond the public API: the writer's group parts,
    committed one at a time without waiting, kept open when one fails (``Writer``)."""

    default_tier: str

    def join_group(self, collection: str, group: GroupSpec) -> int: ...

    def commit_part(self, collection: str, group: GroupSpec,
                    puts: Mapping[str, torch.Tensor | RawPut],
                    shards: Mapping[str, list[ShardPut]], deletes: set[str],
                    message: str | None, tier_name: str, meta: dict[str, str] | None, *,
                    keep_open: bool = False) -> Commit | None: ...

    def abort_group(self, collection: str, group: GroupSpec, reason: str) -> None: ...

    def open_groups(self, collection: str, prefix: str) -> list[str]: ...

    def ready_ranks(self, collection: str, group: str) -> set[int] | None: ...


def run_object_import(db: Database, parts: PartCommits, collection: str, url: str, *, storage_options: Mapping[str, Any] | None,
                      message: str | None, tier: str | None, progress: bool | None,
                      resume: bool, batch_bytes: int = BATCH_BYTES,
                      pending_ttl: float = PENDING_TTL) -> Commit:
    """``Database.import_safetensors`` of an ``s3://`` URL (see the module)."""
    if not isinstance(resume, bool):
        raise InvalidInput(f"resume must be True or False, not {resume!r}",
                           collection=collection)
    if not isinstance(batch_bytes, int) or isinstance(batch_bytes, bool) or batch_bytes <= 0:
        raise InvalidInput(f"batch_bytes must be a positive int, not {batch_bytes!r}",
                           collection=collection)
    if not isinstance(pending_ttl, (int, float)) or isinstance(pending_ttl, bool) \
            or not 0 < pending_ttl <= 30 * 86400:
        raise InvalidInput(f"pending_ttl must be seconds in (0, 2592000], not "
                           f"{pending_ttl!r}", collection=collection)
    with ObjectStore(url, storage_options) as store, se.gc_paused():
        objects, index, extras = _resolve(store)
        heads = [store.prefetched(o.key) or store.pool.submit(_header, store, o)
                 for o in objects]
        headers = [cast(Header, f.result()) for f in heads]
        meta, stale = version_plan(db, collection, headers, index)
        files = _fetch_files(store, extras, url) if extras else {}
        if files:  # the folder's files replace the head's
            stale = [n for n in stale if n != FILES_ROW]
        batches = _batches(objects, headers, batch_bytes)
        if not batches:  # no tensor has bytes to fetch: one ordinary commit
            with db.transaction(collection, message=message or f"import {url}", tier=tier,
                                metadata=meta) as tx:
                finish_version(tx, stale, files)
            assert tx.result is not None
            return tx.result
        tier = tier or parts.default_tier
        digest = _source_digest(collection, url, [*objects, *extras.values()], tier)
        prefix = f"{_GROUP_PREFIX}{digest}:"
        pending = parts.open_groups(collection, prefix)
        name, done = None, set()
        for old in pending:
            ready = parts.ready_ranks(collection, old) if resume else None
            if resume and ready is not None and name is None:
                name, done = old, ready
            else:  # a fresh import drops what an earlier one of the same source left
                parts.abort_group(collection, GroupSpec(old, 0, 1, pending_ttl),
                                  "a new import of the same source replaced it")
        if name is None:
            name = f"{prefix}{uuid.uuid4().hex}"
        label = f"import {url}"
        todo = [i for i in range(len(batches)) if i not in done]
        total = sum(sum(e.end - e.begin for _, _, e in batches[i]) for i in todo)
        result: Commit | None = None
        with progress_bar(progress, total, label) as advance:
            for i in todo:
                spec = GroupSpec(name, i, max(1, len(batches)), float(pending_ttl))
                parts.join_group(collection, spec)
                fetch = _fetch_batch(store, advance)
                puts: dict[str, torch.Tensor | RawPut] = {
                    e.name: RawPut(e.dtype, e.shape, e.end - e.begin, _never, many=fetch,
                                   tag=(o, h.data_start + e.begin, e.name))
                    for o, h, e in batches[i]}
                first = i == 0
                if first and files:
                    puts[FILES_ROW] = torch.from_numpy(pack_files(files))
                result = parts.commit_part(
                    collection, spec, puts, {}, set(stale) if first else set(),
                    (message or label) if first else None, tier,
                    meta if first else None, keep_open=True)
        if result is None:  # every batch had landed before: the group published then
            raise CorruptData(f"{collection}: the pending import {name!r} of {url} has "
                              f"all its parts but published no version",
                              collection=collection)
        return result


def _source_digest(collection: str, url: str, objects: list[ObjectInfo], tier: str) -> str:
    """What makes two imports the same one: the collection, the tier, and every
    object's key, size and ETag."""
    doc = [collection, url.rstrip("/"), tier, [[o.key, o.size, o.etag] for o in objects]]
    return hashlib.sha256(json.dumps(doc).encode()).hexdigest()[:32]


def _resolve(store: ObjectStore) -> tuple[list[ObjectInfo], Index | None,
                                          dict[str, ObjectInfo]]:
    """The objects to import: one ``.safetensors`` object, or a folder (a prefix ending
    in ``/``, or naming one) with its index or exactly one ``.safetensors`` object; and
    a folder's other objects (its files: config, tokenizer) by name."""
    prefix = store.prefix
    if prefix and not prefix.endswith("/"):
        if prefix.endswith(".safetensors"):
            return [store.head(prefix)], None, {}
        if prefix.endswith(".json"):
            folder = prefix.rpartition("/")[0]
            listed = _listed(store, folder + "/")
            return (*_sharded(store, store.head(prefix), folder, listed),
                    _extras(listed))
        prefix += "/"
    listed = _listed(store, prefix)
    if not listed:
        raise NotFound(f"s3://{store.bucket}/{prefix}: no such object or folder")
    if INDEX_NAME in listed:
        return (*_sharded(store, listed[INDEX_NAME], prefix.rstrip("/"), listed),
                _extras(listed))
    indexes = sorted(k for k in listed if k.endswith(".safetensors.index.json"))
    files = sorted(k for k in listed if k.endswith(".safetensors"))
    if len(indexes) == 1:
        return (*_sharded(store, listed[indexes[0]], prefix.rstrip("/"), listed),
                _extras(listed))
    if not indexes and len(files) == 1:
        return [listed[files[0]]], None, _extras(listed)
    raise InvalidInput(f"s3://{store.bucket}/{prefix}: a folder to import needs {INDEX_NAME} "
                       f"(or exactly one *.safetensors object); found {len(indexes)} index "
                       f"object(s) and {len(files)} .safetensors object(s)")


def _listed(store: ObjectStore, folder: str) -> dict[str, ObjectInfo]:
    return {o.key.rpartition("/")[2]: o for o in store.children(folder)}


def _extras(listed: dict[str, ObjectInfo]) -> dict[str, ObjectInfo]:
    """A folder's objects that are files of the version, not weights."""
    return {n: o for n, o in listed.items()
            if n and not n.startswith(".") and not is_weight_file(n) and n != CHECKOUT_MARKER}


def _fetch_files(store: ObjectStore, extras: dict[str, ObjectInfo], where: str
                 ) -> dict[str, bytes]:
    """The folder's files, fetched in parallel and checked (``check_files``)."""
    for o in extras.values():
        if o.size > MAX_FILE_BYTES:
            raise InvalidInput(f"{o.path}: {o.size:,} bytes; a version's files hold at most "
                               f"{MAX_FILE_BYTES:,} each")
    names = sorted(extras)
    got = list(store.pool.map(lambda n: store.read(extras[n], 0, extras[n].size, "file"),
                              names))
    return check_files(dict(zip(names, got, strict=True)), where)


def _sharded(store: ObjectStore, obj: ObjectInfo, folder: str,
             listed: dict[str, ObjectInfo]) -> tuple[list[ObjectInfo], Index | None]:
    """The shards the index ``obj`` names, each one of the folder's objects ``listed``."""
    if obj.size > _MAX_INDEX:
        raise InvalidInput(f"{obj.path}: an index of {obj.size:,} bytes; at most "
                           f"{_MAX_INDEX:,} are read")
    # the shards' heads read while the index is: one round trip fewer before the data
    for n, o in listed.items():
        if n.endswith(".safetensors"):
            store.prefetch(o.key, functools.partial(_header, store, o))
    index = parse_index(obj.path, store.read(obj, 0, obj.size, "index"))
    out = []
    for n in sorted(set(index.weight_map.values())):
        if n not in listed:
            raise CorruptData(f"{obj.path}: shard {n!r} is missing from "
                              f"s3://{store.bucket}/{folder}/")
        out.append(listed[n])
    return out, index


def _header(store: ObjectStore, obj: ObjectInfo) -> Header:
    """The object's header, checked: one GET of its first ``HEAD_READ`` bytes holds
    the length word and the header of any but the largest (a second GET reads the
    rest of one that is longer)."""
    head = store.read(obj, 0, min(obj.size, HEAD_READ), "header") if obj.size else b""

    def read(n: int, offset: int, what: str) -> bytes:
        if offset + n > obj.size:
            raise CorruptData(f"{obj.path}: the object ends inside the {what} (it holds "
                              f"{obj.size} bytes)")
        if offset + n <= len(head):
            return head[offset:offset + n]
        return store.read(obj, offset, n, what)

    return parse_header(obj.path, obj.size, read)


#: a tensor to fetch: its object, the object's header, its entry
_Item = tuple[ObjectInfo, Header, Entry]


def _batches(objects: list[ObjectInfo], headers: list[Header], batch_bytes: int
             ) -> list[list[_Item]]:
    """The tensors in file order, cut into batches of about ``batch_bytes`` (a tensor
    larger than that is a batch of its own). Fixed by the headers alone, so a resume
    cuts the same batches."""
    out: list[list[_Item]] = [[]]
    size = 0
    for o, h in zip(objects, headers, strict=True):
        for e in h.entries:
            n = e.end - e.begin
            if out[-1] and size + n > batch_bytes:
                out.append([])
                size = 0
            out[-1].append((o, h, e))
            size += n
    return out if out[0] else []


def _fetch_batch(store: ObjectStore, advance: Callable[[int], None]
                 ) -> Callable[[list[tuple[object, int, int]], Extents], list[str]]:
    """The fill of one batch's extents (``RawPut.many``), every GET submitted at once to
    the object store's pool (``max_concurrency`` in flight). Tensors that lie next to
    each other in one object go in runs of up to ``WHOLE_PARTS`` parts, one GET each,
    streamed into their extents and each tensor hashed as its bytes stream in (a GET
    costs the server more than its bytes: a model's small tensors must not take one
    each). A larger tensor is fetched in ``part_size`` parts in parallel and hashed in
    order once they land. Returns (or raises) only once no GET is writing into the
    segment."""

    def fill(items: list[tuple[object, int, int]], extents: Extents) -> list[str]:
        futs: list[Future[Any]] = []
        try:
            plan = _submit(store, items, extents, futs)
            sums: list[str] = []
            scratch = memoryview(bytearray(se.HASH_PIECE))
            for run_f, cuts, at, nbytes in plan:
                if run_f is not None:
                    sums.extend(run_f.result())
                    advance(nbytes)
                    continue
                hasher = se.Hasher()
                for lo, hi, f in cuts:
                    f.result()
                    for a in range(lo, hi, se.HASH_PIECE):
                        n = min(se.HASH_PIECE, hi - a)
                        view = extents.view(at + a, n)
                        if view is None:  # written through the descriptor: read back
                            extents.read(at + a, scratch[:n])
                            hasher.update(scratch[:n])
                        else:
                            hasher.update(view)
                    advance(hi - lo)
                sums.append(hasher.hexdigest())
            return sums
        except BaseException:
            for f in futs:
                f.cancel()
            wait(futs)  # no GET may go on writing into a segment being dropped
            raise

    return fill


#: what a batch's fill waits on, in segment order: a run's GET (its tensors'
#: checksums) and its bytes, or a large tensor's parts (lo, hi, GET), its offset and size
_Plan = list[tuple[Future[list[str]] | None, list[tuple[int, int, Future[Any]]], int, int]]


def _submit(store: ObjectStore, items: list[tuple[object, int, int]], extents: Extents,
            futs: list[Future[Any]]) -> _Plan:
    """Every GET of a batch submitted (each also appended to ``futs``), in runs and
    parts as ``_fetch_batch`` says."""
    part = store.part_size
    whole = WHOLE_PARTS * part
    plan: _Plan = []
    run: list[tuple[int, int]] = []  # (at, nbytes) of the tensors of the run so far
    run_obj: ObjectInfo | None = None
    run_start = run_end = 0

    def close_run() -> None:
        if run:
            assert run_obj is not None
            f = store.pool.submit(_get_run, store, run_obj, run_start, list(run), extents)
            futs.append(f)
            plan.append((f, [], 0, sum(n for _, n in run)))
            run.clear()

    for tag, at, nbytes in items:
        obj, start, _ = cast(tuple[ObjectInfo, int, str], tag)
        if nbytes > whole:  # in parts, in parallel
            close_run()
            cuts = []
            for lo in range(0, nbytes, part):
                hi = min(lo + part, nbytes)
                f = store.pool.submit(_get_run, store, obj, start + lo, [(at + lo, hi - lo)],
                                      extents, hash_it=False)
                futs.append(f)
                cuts.append((lo, hi, f))
            plan.append((None, cuts, at, nbytes))
            continue
        if run and (obj is not run_obj or start != run_end
                    or run_end - run_start + nbytes > whole):
            close_run()
        if not run:
            run_obj, run_start, run_end = obj, start, start
        run.append((at, nbytes))
        run_end += nbytes
    close_run()
    return plan


#: a tensor of at most this many parts is fetched whole, in a run with its neighbours
#: (one GET, hashed as it streams in); a larger one in parts
WHOLE_PARTS = 4

#: bytes a GET streams through its thread's buffer (a buffer per pool thread, made
#: once: its pages fault in once)
_PIPE = 4 << 20
_pipes = threading.local()


def _pipe() -> memoryview:
    buf = getattr(_pipes, "buf", None)
    if buf is None:
        buf = _pipes.buf = memoryview(bytearray(_PIPE))
    return cast(memoryview, buf)


def _get_run(store: ObjectStore, obj: ObjectInfo, start: int, dests: list[tuple[int, int]],
             extents: Extents, *, hash_it: bool = True) -> list[str]:
    """One ranged GET of the tensors lying from ``start`` in ``obj``, one after the
    other, into their extents (``dests``: at, nbytes), each hashed as it streams in
    (unless not ``hash_it``: a part of a tensor, hashed once all its parts landed);
    their checksums."""
    hashers = [se.Hasher() for _ in dests]
    bounds = []  # the stream position each tensor begins at
    pos = 0
    for _, n in dests:
        bounds.append(pos)
        pos += n
    k = 0

    def put(p: int, data: memoryview) -> None:
        nonlocal k
        while data.nbytes:
            while p >= bounds[k] + dests[k][1]:  # a tensor of 0 bytes, or one done
                k += 1
            at, n = dests[k]
            take = min(data.nbytes, bounds[k] + n - p)
            piece = data[:take]
            extents.write(at + p - bounds[k], piece)
            if hash_it:
                hashers[k].update(piece)
            data, p = data[take:], p + take

    store.read_stream(obj, start, pos, _pipe(), put, f"{len(dests)} tensor(s)")
    return [h.hexdigest() for h in hashers]


def _never(dst: np.ndarray) -> str:  # a put filled with its batch (``many``)
    raise AssertionError("filled by its batch")
