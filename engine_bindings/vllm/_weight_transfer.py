"""tensordb as a backend of vLLM's weight-transfer API, the flow RL frameworks call::

    llm = LLM(..., weight_transfer_config={"backend": "tensordb"})
    llm.init_weight_transfer_engine({"init_info": {"home": "/var/lib/tensordb"}})
    # the trainer: db.commit("llama", model.state_dict())  -> version 7
    llm.start_weight_update()
    llm.update_weights({"update_info": {"collection": "llama", "version": 7}})
    llm.finish_weight_update(weight_version="7")
    llm.reset_prefix_cache()          # cached KV was computed with the old weights

(``vllm serve`` exposes the same calls over HTTP.) Nothing but the collection's name
and version crosses a process boundary: each worker maps the version from the store
and feeds it, under vLLM's layerwise reload, to ``model.load_weights``; the reload
re-runs weight post-processing, so backends that repack weights (vLLM's CPU build,
quantized models) take the update too.

An update is all or nothing. Each part's tensors are checked whole (rows, integrity
marks, checksums) before the first is fed to the model, so a damaged or unreachable
tensor fails the part with the model untouched. A part that fails after the model took
tensors (this one's or an earlier part's) ends the update with the version the model
served before loaded back whole: that version is leased from ``start_weight_update``
until the update ends. ``weights_version`` is always the one version the model serves.

Runs in each vLLM worker process. ``register`` (this package's ``vllm.general_plugins``
entry point, run in every process vLLM starts) makes the ``tensordb`` backend known to
vLLM's ``WeightTransferEngineFactory`` where the installed vLLM has one (0.32 and later),
without importing this module until an engine is made.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

import tensordb
from tensordb.errors import InvalidInput

from .._engines import (
    LOCATION_KEYS,
    LoadSource,
    ServedLease,
    StoreLocation,
    Tally,
    check_ref,
    checked_tensors,
    note_served,
    now_served,
    open_store,
    select_names,
    served_by,
)
from ._loader import LOAD_FORMAT, WEIGHT_TRANSFER_BACKEND, parallel_ranks

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.config.weight_transfer import WeightTransferConfig

__all__ = [
    "WEIGHT_TRANSFER_BACKEND",
    "TensorDBWeightTransferEngine",
    "TensorDBWeightTransferInitInfo",
    "TensorDBWeightTransferUpdateInfo",
]

logger = logging.getLogger(__name__)



@dataclass
class TensorDBWeightTransferInitInfo(WeightTransferInitInfo):
    """``init_weight_transfer_engine``'s ``init_info``: where the store is (the
    arguments of ``tensordb.connect``; default: the store the model was loaded from
    with ``--load-format tensordb``, else ``$TENSORDB_HOME``) and the collection
    updates read when they name none (default: the one the model was loaded from)."""

    collection: str | None = None
    url: str | None = None
    home: str | None = None
    node: str | None = None
    data_dir: str | None = None


@dataclass
class TensorDBWeightTransferUpdateInfo(WeightTransferUpdateInfo):
    """``update_weights``' ``update_info``: the version (or tag; default: the head) of
    the collection to load, and optionally only some of its tensors (``names``: a
    trainer that sends an update in parts names each part's tensors; between
    ``start_weight_update`` and ``finish_weight_update`` the parts together must cover
    every tensor of each layer they touch)."""

    collection: str | None = None
    version: int | None = None
    tag: str | None = None
    names: list[str] | None = None


def _fields(cls: type, given: dict[str, Any], what: str) -> None:
    if not isinstance(given, dict):
        raise InvalidInput(f"{what} must be a mapping, not {type(given).__name__}")
    known = set(cls.__dataclass_fields__)  # type: ignore[attr-defined]
    unknown = sorted(set(given) - known)
    if unknown:
        raise InvalidInput(f"unexpected {what} keys {unknown} for the "
                           f"{WEIGHT_TRANSFER_BACKEND!r} weight transfer backend; expected "
                           f"some of {sorted(known)}")


class TensorDBWeightTransferEngine(
        WeightTransferEngine[TensorDBWeightTransferInitInfo,
                             TensorDBWeightTransferUpdateInfo]):
    """vLLM's ``WeightTransferEngine`` over a tensordb store (see the module
    docstring). One per worker; every call blocks the worker until it is done."""

    init_info_cls = TensorDBWeightTransferInitInfo
    update_info_cls = TensorDBWeightTransferUpdateInfo

    def __init__(self, config: WeightTransferConfig, vllm_config: VllmConfig,
                 device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.location = StoreLocation()
        self.collection: str | None = None
        load = vllm_config.load_config
        if load.load_format == LOAD_FORMAT:
            source = LoadSource.from_extra_config(load.model_loader_extra_config,
                                                  what=f"load format {LOAD_FORMAT!r}")
            self.location, self.collection = source.location, source.collection
        self._tally: Tally | None = None
        self.loaded: dict[str, Any] | None = None  # the last update: collection, version
        #: an update in progress: the version the model served before (leased), and
        #: the update's own version, names and whether the model took any tensor yet
        self._lease: ServedLease | None = None
        self._before: tensordb.Snapshot | None = None
        self._session: dict[str, Any] | None = None

    # -- the API's edges: typed errors (InvalidInput is a ValueError, as vLLM expects) --
    def parse_init_info(self, init_dict: dict[str, Any]) -> TensorDBWeightTransferInitInfo:
        _fields(TensorDBWeightTransferInitInfo, init_dict, "init_info")
        info = TensorDBWeightTransferInitInfo(**init_dict)
        StoreLocation.parse({k: getattr(info, k) for k in LOCATION_KEYS})
        if info.collection is not None:
            check_ref(info.collection, None, None)
        return info

    def parse_update_info(self, update_dict: dict[str, Any]
                          ) -> TensorDBWeightTransferUpdateInfo:
        _fields(TensorDBWeightTransferUpdateInfo, update_dict, "update_info")
        info = TensorDBWeightTransferUpdateInfo(**update_dict)
        collection = info.collection or self.collection
        if collection is None:
            raise InvalidInput("update_info names no collection, and the model was not "
                               f"loaded with --load-format {LOAD_FORMAT}")
        check_ref(collection, info.version, info.tag)
        if info.names is not None and (isinstance(info.names, str) or not all(
                isinstance(n, str) for n in info.names)):
            raise InvalidInput(f"update_info 'names' must be a list of tensor names, not "
                               f"{info.names!r}", collection=collection)
        info.collection = collection
        return info

    # -- the flow ---------------------------------------------------------------------
    def init_transfer_engine(self, init_info: TensorDBWeightTransferInitInfo) -> None:
        """Remember where updates come from; opens the store (nothing to rendezvous
        with: the trainer only commits)."""
        given = {k: getattr(init_info, k) for k in LOCATION_KEYS
                 if getattr(init_info, k) is not None}
        if given:
            self.location = StoreLocation.parse(given)
        if init_info.collection is not None:
            self.collection = init_info.collection
        open_store(self.location)

    def start_weight_update(self) -> None:
        """vLLM's layerwise reload: the parameters go back to their checkpoint form,
        and each layer is post-processed once all its tensors have arrived. The
        version the model serves is leased until the update ends (to put it back)."""
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        self._end_lease()
        self._lease = ServedLease(self.model)
        self._before = self._lease.__enter__()
        self._session = {"snap": None, "names": set(), "fed": False}
        self._tally = Tally()
        initialize_layerwise_reload(self.model)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Load one part of the update. A part that fails ends the update (vLLM's
        worker expects a new ``start_weight_update``): when nothing reached the model
        yet (a bad ``update_info``, a missing version, a damaged or unreachable
        tensor: all found before the first tensor is fed), vLLM's reload is finalized
        at once and every layer keeps its weights; when the model took tensors
        already, the version it served before is loaded back whole. The error is
        raised after that; the model serves one version either way."""
        try:
            self.receive_weights(self.parse_update_info(update_info))
        except BaseException as exc:
            if self._tally is not None:
                self._abort(exc)
            raise
        if torch.accelerator.is_available():  # vLLM's default; a CPU-only torch has none
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: TensorDBWeightTransferUpdateInfo) -> None:
        """Map the version, check its (selected) tensors whole, and load them. NotFound
        for a missing collection, version or tag, CorruptData or NodeUnavailable for a
        tensor that cannot be read, InvalidInput for a part naming another version than
        the update's earlier parts: all before any tensor is loaded."""
        assert update_info.collection is not None  # parse_update_info filled it in
        db = open_store(self.location)
        session = self._session
        tally = self._tally or Tally()
        with db.snapshot(update_info.collection, version=update_info.version,
                         tag=update_info.tag) as snap:
            version = snap.version
            first = None if session is None else session["snap"]
            if first is not None and (first.collection, first.version) != (
                    snap.collection, version):
                raise InvalidInput(
                    f"the parts of one weight update load one version: this one names "
                    f"{snap.collection} v{version}, an earlier one "
                    f"{first.collection} v{first.version}", collection=snap.collection,
                    version=version)
            pairs = checked_tensors(snap, update_info.names)  # the gate
            if session is not None:
                session["fed"] = True
                session["names"].update(select_names(snap, update_info.names))
                if first is None:  # kept for finish: the version the model is going to
                    session["snap"] = db.snapshot(snap.collection, version=version)
            self.model.load_weights(tally.wrap(pairs))
        if session is None:  # outside a session: the model was given the whole version
            note_served(self.model, now_served(self.location, snap, update_info.names,
                                               None))
        self.loaded = {"collection": update_info.collection, "version": version}

    def _abort(self, exc: BaseException) -> None:
        """End a failed update: finalize vLLM's reload, and where the model took
        tensors, load the version it served before back whole."""
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        session, before = self._session, self._before
        self._tally = None
        assert session is not None  # a session runs while there is a tally
        try:
            finalize_layerwise_reload(self.model, self.model_config)
            if not session["fed"]:
                return  # every layer got its own weights back: nothing changed
            if before is None:
                note_served(self.model, None)
                self.loaded = None
                exc.add_note("the model served no known tensordb version before this "
                             "update; it holds no one version now")
                return
            try:
                back = checked_tensors(before)
                initialize_layerwise_reload(self.model)
                try:
                    self.model.load_weights(back)
                finally:
                    finalize_layerwise_reload(self.model, self.model_config)
            except BaseException as undo:
                note_served(self.model, None)
                self.loaded = None
                exc.add_note(f"putting {before.collection} v{before.version} back failed "
                             f"too ({type(undo).__name__}: {undo}): the model holds no "
                             f"one version")
                return
            exc.add_note(f"the model is back on {before.collection} v{before.version}")
        finally:
            self._end_lease()

    def finish_weight_update(self) -> None:
        """Post-process the layers still waiting (attention, partly loaded ones); the
        model now serves the update's version (or, for parts that left tensors out
        whose bytes differ from the version before, no one version: reported None)."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        tally, self._tally = self._tally, None
        session = self._session
        if session is not None and session["snap"] is not None:
            snap = session["snap"]
            names = session["names"]
            served = now_served(self.location, snap,
                                None if names >= set(snap) else names, self._before)
            note_served(self.model, served)
            self.loaded = None if served is None else served.as_dict()
        self._end_lease()
        if tally is not None and self.loaded is not None:
            tally.stop()
            logger.info("weight update from tensordb %s v%d: %d tensors, %.1f MiB in "
                        "%.2f s %s", self.loaded["collection"], self.loaded["version"],
                        tally.tensors, tally.nbytes / 2**20, tally.seconds, parallel_ranks())

    def weights_version(self) -> dict[str, Any] | None:
        """The collection and version the model serves, or None (not loaded from the
        store, or an update that could not be put back)."""
        served = served_by(self.model)
        return None if served is None else served.as_dict()

    def _end_lease(self) -> None:
        """Release the version before and the update's own snapshot."""
        session = self._session
        if session is not None and session["snap"] is not None:
            session["snap"].close()
        self._session = None
        if self._lease is not None:
            self._lease.__exit__(None, None, None)
        self._lease = None
        self._before = None

    def shutdown(self) -> None:
        """Release an unfinished update's leases; the store stays open for the
        process's other users."""
        self._end_lease()
