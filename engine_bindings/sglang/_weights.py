"""SGLang weights from a tensordb collection: the initial load and in-place updates.

Updates go through SGLang's tensor update path (``update_weights_from_tensor`` between
``begin_weight_update`` and ``end_weight_update``), in one of two ways:

* **pull** (the server was started with ``--custom-weight-loader
  engine_bindings.sglang.tensordb_weight_loader``): the request carries only *which*
  version to load; every tensor-parallel scheduler process opens the store itself and
  feeds the version's zero-copy tensors to ``model.load_weights``, whose weight loaders
  copy each rank's slice into place. No tensor crosses a process boundary.
* **push** (a ``sglang.Engine`` started without that loader): this process packs the
  version into buckets of about ``bucket_bytes`` in shared memory (one copy) and sends
  them as SGLang's ``flattened_bucket`` payloads; each scheduler maps the bucket and
  loads it. (An HTTP server, through SGLang's ``HttpServerEngineAdapter``, takes pull
  requests only: the bucket handles do not travel over HTTP.)

In the scheduler process itself (a ``ModelRunner`` or its ``WeightUpdater``) the
zero-copy tensors are handed to the updater directly, bucket by bucket.

The initial load: ``TensorDBModelLoader`` is a SGLang ``BaseModelLoader``; pass the
class as ``load_format`` (SGLang's ``get_model_loader`` instantiates a class given
there) with ``model_loader_extra_config`` naming the collection.
"""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from sglang.srt.configs.device_config import DeviceConfig
from sglang.srt.configs.load_config import LoadConfig
from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.model_loader.loader import (
    BaseModelLoader,
    DefaultModelLoader,
    _get_quantization_config,
    _initialize_model,
    set_default_torch_dtype,
)
from torch import nn

import tensordb
from tensordb.errors import InvalidInput

from .._engines import (
    LoadSource,
    LocationLike,
    NameFilter,
    Served,
    ServedLease,
    StoreLocation,
    Tally,
    buckets,
    check_ref,
    checked_tensors,
    note_served,
    now_served,
    open_store,
    select_names,
    store_of,
)

__all__ = [
    "PULL_LOADER",
    "TensorDBModelLoader",
    "served_version",
    "tensordb_weight_loader",
    "update_weights_from_tensordb",
]

logger = logging.getLogger(__name__)

#: what ``--custom-weight-loader`` names for pull updates, and the ``load_format`` the
#: update requests carry
PULL_LOADER = "engine_bindings.sglang.tensordb_weight_loader"
_REQUEST_PREFIX = "tensordb:"
_MODES = ("auto", "pull", "push")
_ALIGN = 16  # bucket entries start at offsets any dtype can be viewed at


# -- the initial load ------------------------------------------------------------------
class TensorDBModelLoader(BaseModelLoader):
    """A SGLang model loader reading a version of a collection.

    ``sglang.Engine(model_path=<folder with config.json and tokenizer>,
    load_format=TensorDBModelLoader, model_loader_extra_config=json.dumps({"collection":
    "llama", "home": "/var/lib/tensordb"}))``. The model is built by SGLang (config,
    dtype, quantization); its ``load_weights`` gets the store's zero-copy tensors and
    each tensor-parallel rank's weight loaders copy out its slice.
    """

    def __init__(self, load_config: LoadConfig) -> None:
        super().__init__(load_config)
        extra = load_config.model_loader_extra_config
        #: None until the model folder is known: a ``tensordb checkout`` folder's marker
        #: names the version where no extra config does (``source_for``)
        self.source: LoadSource | None = (
            LoadSource.from_extra_config(extra, what="TensorDBModelLoader") if extra else None)
        self.last_load: dict[str, Any] | None = None

    def source_for(self, model_config: ModelConfig) -> LoadSource:
        """The version to load: the extra config's, else the one the model folder's
        ``tensordb.json`` names (InvalidInput where it has none)."""
        if self.source is None:
            self.source = LoadSource.from_folder(model_config.model_path,
                                                 what="TensorDBModelLoader")
        return self.source

    def download_model(self, model_config: ModelConfig) -> None:
        """Nothing to download: check that the version exists (NotFound otherwise)."""
        src = self.source_for(model_config)
        with src.snapshot():
            pass

    def load_model(self, *, model_config: ModelConfig, device_config: DeviceConfig
                   ) -> nn.Module:
        src = self.source_for(model_config)
        target_device = torch.device(device_config.device)
        quant_config = _get_quantization_config(model_config, self.load_config)
        tally = Tally()
        with set_default_torch_dtype(model_config.dtype):
            with target_device:
                model = _initialize_model(model_config, self.load_config, quant_config)
            with src.snapshot() as snap:
                version = snap.version
                DefaultModelLoader.load_weights_and_postprocess(
                    model, tally.wrap(checked_tensors(snap)), target_device)
        tally.stop()
        note_served(model, Served(src.location, src.collection, version))
        self.last_load = {"collection": src.collection, "version": version,
                          "tensors": tally.tensors, "bytes": tally.nbytes,
                          "seconds": tally.seconds}
        logger.info("loaded %s v%d from tensordb: %d tensors, %.1f MiB in %.2f s",
                    src.collection, version, tally.tensors, tally.nbytes / 2**20,
                    tally.seconds)
        return model.eval()


# -- pull: the loader that runs in each scheduler ---------------------------------------
def _request_name(location: StoreLocation, collection: str, version: int,
                  names: list[str] | None) -> str:
    body = {"location": location.as_dict(), "collection": collection, "version": version}
    if names is not None:
        body["names"] = names
    return _REQUEST_PREFIX + json.dumps(body, separators=(",", ":"))


def tensordb_weight_loader(model: nn.Module,
                           named: Iterable[tuple[str, torch.Tensor]]) -> None:
    """SGLang custom weight loader (``--custom-weight-loader
    engine_bindings.sglang.tensordb_weight_loader``), run in each scheduler process:
    every entry whose name is a tensordb request loads that version of the collection
    into ``model`` with ``model.load_weights``, from the store the request names, opened
    once per process. Other entries are loaded as they are. Raises (the update fails)
    when the store or the version cannot be read: every tensor of the request is
    checked (rows, marks, checksums) before the first is loaded, so that failure
    leaves the model untouched."""
    plain: list[tuple[str, torch.Tensor]] = []
    for name, tensor in named:
        if not name.startswith(_REQUEST_PREFIX):
            plain.append((name, tensor))
            continue
        req = json.loads(name[len(_REQUEST_PREFIX):])
        db = open_store(StoreLocation.parse(req["location"]))
        tally = Tally()
        with db.snapshot(req["collection"], version=req["version"]) as snap:
            model.load_weights(tally.wrap(checked_tensors(snap, req.get("names"))))
            if req.get("names") is None:
                note_served(model, Served(StoreLocation.parse(req["location"]),
                                          req["collection"], snap.version))
        tally.stop()
        logger.info("updated weights from tensordb %s v%d: %d tensors, %.1f MiB in %.2f s",
                    req["collection"], req["version"], tally.tensors, tally.nbytes / 2**20,
                    tally.seconds)
    if plain:
        model.load_weights(plain)


# -- the update helper -----------------------------------------------------------------
def _flattened_payload(bucket: list[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    """One bucket as SGLang's flattened_bucket payload: one uint8 tensor in shared memory
    (so serializing it sends a handle, not the bytes) and each entry's place in it."""
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorMetadata

    offsets, total = [], 0
    for _, t in bucket:
        total = -(-total // _ALIGN) * _ALIGN
        offsets.append(total)
        total += t.numel() * t.element_size()
    flat = torch.empty(total, dtype=torch.uint8).share_memory_()
    meta = []
    for (name, t), start in zip(bucket, offsets, strict=True):
        n = t.numel() * t.element_size()
        if n:
            flat[start:start + n].view(t.dtype).view(t.shape).copy_(t)
        meta.append(FlattenedTensorMetadata(name=name, shape=t.shape, dtype=t.dtype,
                                            start_idx=start, end_idx=start + n, numel=n))
    return {"flattened_tensor": flat, "metadata": meta}


def _check(result: Any, what: str, collection: str) -> None:
    """SGLang answers (success, message) tuples, or dicts / objects with .success."""
    if isinstance(result, tuple) and len(result) >= 1:
        ok, msg = result[0], (result[1] if len(result) > 1 else "")
    elif isinstance(result, dict):
        ok, msg = result.get("success", True), result.get("message", "")
    else:
        ok, msg = getattr(result, "success", True), getattr(result, "message", "")
    if not ok:
        raise RuntimeError(f"SGLang {what} failed for {collection!r}: {msg}")


@contextmanager
def _session_end(end: Callable[[], object]) -> Iterator[None]:
    """Close a weight-update session however the block ends; an error in the block wins
    over an error in closing."""
    try:
        yield
    except BaseException:
        try:
            end()
        except Exception:
            logger.exception("closing the SGLang weight-update session failed")
        raise
    end()


def _serialize(obj: Any) -> bytes:
    """``MultiprocessingSerializer.serialize`` with torch's own tensor reducer. SGLang
    swaps in a CUDA-only one in processes that have loaded weights
    (``monkey_patch_torch_reductions``); it fails on host tensors."""
    from multiprocessing.reduction import ForkingPickler

    from torch.multiprocessing import reductions

    buf = io.BytesIO()
    pickler = ForkingPickler(buf)
    original = getattr(reductions, "_reduce_tensor_original", None)
    if original is not None:
        for cls in (torch.Tensor, torch.nn.Parameter):
            if cls in pickler.dispatch_table:
                pickler.dispatch_table[cls] = original
    pickler.dump(obj)
    return buf.getvalue()


def _send(engine: Any, payload: Any, load_format: str, flush_cache: bool,
          weight_version: str | None, collection: str) -> None:
    """One ``update_weights_from_tensor`` request, the same payload for every TP rank:
    built as ``Engine.update_weights_from_tensor`` builds it, plus the weight version,
    where the engine has SGLang's tokenizer manager; through that public method
    otherwise."""
    manager, loop = getattr(engine, "tokenizer_manager", None), getattr(engine, "loop", None)
    if manager is None or loop is None:
        if load_format == "flattened_bucket":
            payload = [_serialize(payload)] * _tp_size(engine)
        result = engine.update_weights_from_tensor(named_tensors=payload,
                                                   load_format=load_format,
                                                   flush_cache=flush_cache)
    else:
        from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput

        req = UpdateWeightsFromTensorReqInput(
            serialized_named_tensors=[_serialize(payload)] * _tp_size(engine),
            load_format=load_format, flush_cache=flush_cache, weight_version=weight_version)
        result = loop.run_until_complete(manager.update_weights_from_tensor(req, None))
    _check(result, "update_weights_from_tensor", collection)


def _tp_size(engine: Any) -> int:
    server_args = getattr(engine, "server_args", None)
    return int(getattr(server_args, "tp_size", 1) or 1)


def _pull_enabled(engine: Any) -> bool:
    server_args = getattr(engine, "server_args", None)
    return PULL_LOADER in (getattr(server_args, "custom_weight_loader", None) or [])


def _updater_of(target: Any) -> Any | None:
    """The SGLang WeightUpdater of an in-process target (a ModelRunner or the updater)."""
    updater = getattr(target, "weight_updater", None)
    if updater is not None:
        return updater
    if all(callable(getattr(target, m, None)) for m in
           ("begin_weight_update", "end_weight_update", "update_weights_from_tensor")) \
            and getattr(target, "get_model", None) is not None:
        return target
    return None


def update_weights_from_tensordb(target: Any, db_or_location: tensordb.Database | LocationLike,
                                 collection: str, version: int | None = None, *,
                                 tag: str | None = None, names: NameFilter = None,
                                 mode: str = "auto", bucket_bytes: int = 512 << 20,
                                 flush_cache: bool = True, weight_version: str | None = None,
                                 current: int | None = None) -> dict[str, Any]:
    """Load ``version`` (or ``tag``; the head by default) of ``collection`` into a
    running SGLang model, in place, through SGLang's tensor update path.

    ``target``: a ``sglang.Engine`` (or anything with its ``begin_weight_update`` /
    ``update_weights_from_tensor`` / ``end_weight_update`` methods), or, inside the
    scheduler process, a ``ModelRunner`` or its ``WeightUpdater``. ``db_or_location``:
    an open ``tensordb.Database`` or where the store is (a catalog URL, a home
    directory, a mapping of ``connect`` arguments). ``names``: only these tensors.
    ``mode`` (Engine only): "pull" has each scheduler read the store itself (the server
    must run with ``--custom-weight-loader`` ``PULL_LOADER``, and reach the same
    store); "push" sends the tensors in ``flattened_bucket`` payloads of about
    ``bucket_bytes``; "auto" pulls when the server allows it. ``flush_cache``: drop
    the radix cache, computed with the old weights, after the last bucket.
    ``weight_version``: the label SGLang reports for the new weights (default
    ``"<collection>@<version>"``; Engine only). ``current``: the version of
    ``collection`` the model serves now, where neither the loader nor an earlier
    update of this process recorded it (``served_version`` says what is recorded).

    All or nothing. The version is resolved here, once: every scheduler loads the
    same immutable version whatever is committed meanwhile. Every tensor is checked
    (rows, marks, checksums) before the first is sent (push, in-process) or loaded
    (pull: by each scheduler, before it loads any). A step that fails after SGLang
    may have taken tensors puts the version the model served before back (leased for
    the whole update), then raises. Returns ``collection``, ``version``, ``tensors``,
    ``bytes``, ``buckets`` (requests sent), ``mode`` and ``seconds``. Raises NotFound,
    CorruptData or NodeUnavailable before touching the model when the version does
    not exist or cannot be read, and RuntimeError when SGLang reports a failed step.
    """
    check_ref(collection, version, tag)
    if mode not in _MODES:
        raise InvalidInput(f"mode must be one of {list(_MODES)}, not {mode!r}",
                           collection=collection)
    if current is not None and (isinstance(current, bool) or not isinstance(current, int)):
        raise InvalidInput(f"current must be an int or None, not {current!r}",
                           collection=collection)
    db = store_of(db_or_location)
    updater = _updater_of(target)
    engine = None
    if updater is None:
        if not all(callable(getattr(target, m, None)) for m in
                   ("begin_weight_update", "update_weights_from_tensor", "end_weight_update")):
            raise InvalidInput(f"target must be a sglang Engine, ModelRunner or "
                               f"WeightUpdater, not {type(target).__name__}",
                               collection=collection)
        engine = target
    if mode == "pull" and engine is None:
        raise InvalidInput("mode='pull' needs a sglang Engine; in the scheduler process the "
                           "tensors are handed over directly", collection=collection)
    if mode == "pull" and not _pull_enabled(engine):
        raise InvalidInput(f"mode='pull' needs the server started with "
                           f"--custom-weight-loader {PULL_LOADER}", collection=collection)
    use = ("pull" if engine is not None and _pull_enabled(engine) else "push") \
        if mode == "auto" else mode
    key = _served_key(target, updater)
    location = StoreLocation.of(db)
    told = None if current is None else Served(location, collection, current)
    tally = Tally()
    with db.snapshot(collection, version=version, tag=tag) as snap, \
            ServedLease(key, told, db) as before:
        got = snap.version
        label = weight_version if weight_version is not None else f"{collection}@{got}"

        def run(source: tensordb.Snapshot, count: Tally, tag_as: str) -> int:
            """One whole session loading ``source``'s selection; the requests sent."""
            if updater is not None:
                return _session_direct(updater, source, names, bucket_bytes, count)
            return _session_engine(engine, db, source, names, use, bucket_bytes,
                                   flush_cache, tag_as, count)

        try:
            sent = run(snap, tally, label)
        except _Reached as failed:
            exc = failed.__cause__ or failed
            _put_back(run, before, key, exc)
            raise exc from None
    tally.stop()
    note_served(key, now_served(location, snap, names, before))
    summary = {"collection": collection, "version": got, "tensors": tally.tensors,
               "bytes": tally.nbytes, "buckets": sent,
               "mode": "direct" if updater is not None else use, "seconds": tally.seconds}
    logger.info("SGLang weights <- tensordb %s v%d (%s): %d tensors, %.1f MiB, %d requests, "
                "%.2f s", collection, got, summary["mode"], tally.tensors,
                tally.nbytes / 2**20, sent, tally.seconds)
    return summary


def served_version(target: Any) -> dict[str, Any] | None:
    """The collection and version ``target`` (an Engine, ModelRunner or WeightUpdater)
    serves as this process knows it: its loader's, or the last update's; None when not
    known (or an update that failed part-way could not be put back)."""
    from .._engines import served_by

    served = served_by(_served_key(target, _updater_of(target)))
    return None if served is None else served.as_dict()


class _Reached(Exception):
    """A session failed after SGLang may have taken tensors (the cause says why)."""


def _served_key(target: Any, updater: Any | None) -> Any:
    """What the served version is recorded under: the model in the scheduler process
    (where the loader records it), else the engine handle."""
    if updater is not None:
        get_model = getattr(updater, "get_model", None) or getattr(target, "get_model", None)
        model = get_model() if callable(get_model) else getattr(target, "model", None)
        if model is not None:
            return model
    return target


def _put_back(run: Callable[[tensordb.Snapshot, Tally, str], int],
              before: tensordb.Snapshot | None, key: Any, exc: BaseException) -> None:
    """Load the version served before back, whole, after a failed session; the model
    is reported as serving no one version where that is not possible."""
    if before is None:
        note_served(key, None)
        exc.add_note("the model served no known tensordb version before this update; it "
                     "holds no one version now (pass current= to let it be put back)")
        return
    try:
        run(before, Tally(), f"{before.collection}@{before.version}")
    except BaseException as undo:
        note_served(key, None)
        cause = undo.__cause__ if isinstance(undo, _Reached) else undo
        exc.add_note(f"putting {before.collection} v{before.version} back failed too "
                     f"({type(cause).__name__}: {cause}): the model holds no one version")
        return
    exc.add_note(f"the model is back on {before.collection} v{before.version}")


def _session_direct(updater: Any, snap: tensordb.Snapshot, names: NameFilter,
                    bucket_bytes: int, tally: Tally) -> int:
    """In the scheduler process: the checked tensors to the updater, bucket by bucket.
    Raises the gate's error as it is (nothing sent), ``_Reached`` after."""
    pairs = checked_tensors(snap, names)  # the gate, before the session begins
    sent = 0
    updater.begin_weight_update()
    try:
        with _session_end(lambda: updater.end_weight_update(run_post_load=sent == 0)):
            for bucket in buckets(tally.wrap(pairs), bucket_bytes):
                _check(updater.update_weights_from_tensor(named_tensors=bucket,
                                                          load_format=None),
                       "update_weights_from_tensor", snap.collection)
                sent += 1
    except BaseException as exc:
        raise _Reached() from exc
    return sent


def _session_engine(engine: Any, db: tensordb.Database, snap: tensordb.Snapshot,
                    names: NameFilter, use: str, bucket_bytes: int, flush_cache: bool,
                    label: str, tally: Tally) -> int:
    """Through an Engine: one pull request (each scheduler checks, then loads), or the
    checked tensors pushed in buckets. Raises the gate's error as it is (nothing sent),
    ``_Reached`` once a request may have reached a scheduler."""
    collection, got = snap.collection, snap.version
    if use == "pull":
        info = snap.info()
        chosen = select_names(snap, names)
        tally.tensors = len(chosen)
        tally.nbytes = sum(info[n][2] for n in chosen)
        request = [(_request_name(StoreLocation.of(db), collection, got,
                                  None if names is None else chosen), torch.empty(0))]
        groups = None
    else:
        groups = list(buckets(tally.wrap(checked_tensors(snap, names)), bucket_bytes))
    sent = 0
    _check(engine.begin_weight_update(), "begin_weight_update", collection)
    try:
        with _session_end(lambda: _check(engine.end_weight_update(), "end_weight_update",
                                         collection)):
            if groups is None:
                sent = 1
                _send(engine, request, PULL_LOADER, flush_cache, label, collection)
            else:
                for i, bucket in enumerate(groups):
                    last = i == len(groups) - 1
                    sent += 1
                    _send(engine, _flattened_payload(bucket), "flattened_bucket",
                          flush_cache and last, label if last else None, collection)
    except BaseException as exc:
        raise _Reached() from exc
    return sent
