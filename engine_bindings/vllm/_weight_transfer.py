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

from tensordb.errors import InvalidInput

from .._engines import (
    LOCATION_KEYS,
    LoadSource,
    StoreLocation,
    Tally,
    check_ref,
    named_tensors,
    open_store,
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
        and each layer is post-processed once all its tensors have arrived."""
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        self._tally = Tally()
        initialize_layerwise_reload(self.model)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Load one part of the update. A part that fails (a bad ``update_info``, a
        missing version) ends the update: vLLM's reload is finalized at once, so the
        layers that received nothing keep their weights and the engine keeps serving
        (the worker expects a new ``start_weight_update``)."""
        try:
            self.receive_weights(self.parse_update_info(update_info))
        except BaseException:
            if self._tally is not None:
                self.finish_weight_update()
            raise
        if torch.accelerator.is_available():  # vLLM's default; a CPU-only torch has none
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: TensorDBWeightTransferUpdateInfo) -> None:
        """Map the version and load its (selected) tensors. NotFound for a missing
        collection, version or tag, before any tensor is loaded."""
        assert update_info.collection is not None  # parse_update_info filled it in
        db = open_store(self.location)
        tally = self._tally or Tally()
        with db.snapshot(update_info.collection, version=update_info.version,
                         tag=update_info.tag) as snap:
            version = snap.version
            self.model.load_weights(tally.wrap(named_tensors(snap, update_info.names)))
        self.loaded = {"collection": update_info.collection, "version": version}

    def finish_weight_update(self) -> None:
        """Post-process the layers still waiting (attention, partly loaded ones)."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        tally, self._tally = self._tally, None
        if tally is not None and self.loaded is not None:
            tally.stop()
            logger.info("weight update from tensordb %s v%d: %d tensors, %.1f MiB in "
                        "%.2f s %s", self.loaded["collection"], self.loaded["version"],
                        tally.tensors, tally.nbytes / 2**20, tally.seconds, parallel_ranks())

    def shutdown(self) -> None:
        """Nothing to release: the store stays open for the process's other users."""
