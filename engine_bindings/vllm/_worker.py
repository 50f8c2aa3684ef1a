"""A vLLM worker extension that loads a version of a collection into the live model.

Start vLLM with ``--worker-extension-cls engine_bindings.vllm.TensorDBWorkerExtension``
(``LLM(..., worker_extension_cls=...)``); vLLM mixes the class into every worker, and
the driver calls the method on all of them at once::

    llm.collective_rpc("update_weights_from_tensordb", args=("llama",),
                       kwargs={"version": 7})
    llm.reset_prefix_cache()      # cached KV was computed with the old weights

Each worker opens the store itself (the one the model was loaded from with
``--load-format tensordb``, else ``location``, else ``$TENSORDB_HOME``), maps the
version zero-copy and feeds it to ``model.load_weights``: its weight loaders copy this
rank's slices into the parameters in place. Nothing is serialized or sent between
processes but the collection's name. A version is immutable and leased while it is
read, so every worker loads exactly the same bytes, whatever a trainer commits
meanwhile.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from tensordb.errors import InvalidInput

from .._engines import (
    LoadSource,
    LocationLike,
    NameFilter,
    StoreLocation,
    Tally,
    check_ref,
    named_tensors,
    open_store,
)
from ._loader import LOAD_FORMAT, parallel_ranks

__all__ = ["TensorDBWorkerExtension"]

logger = logging.getLogger(__name__)

_VIA = ("load_weights", "reload_weights")


class TensorDBWorkerExtension:
    """Methods vLLM adds to its worker class (names must not clash with the worker's:
    everything here starts with ``tensordb``/``_tensordb`` or names the store)."""

    def _tensordb_location(self, location: LocationLike) -> StoreLocation:
        if location is not None:
            return StoreLocation.parse(location)
        load_config = getattr(getattr(self, "vllm_config", None), "load_config", None)
        if load_config is not None and load_config.load_format == LOAD_FORMAT:
            return LoadSource.from_extra_config(load_config.model_loader_extra_config,
                                                what=f"load format {LOAD_FORMAT!r}").location
        return StoreLocation()

    def _tensordb_model(self) -> torch.nn.Module:
        runner = self.model_runner  # type: ignore[attr-defined]
        get_model = getattr(runner, "get_model", None)
        return get_model() if callable(get_model) else runner.model

    def update_weights_from_tensordb(self, collection: str, version: int | None = None,
                                     tag: str | None = None, *,
                                     location: LocationLike = None, names: NameFilter = None,
                                     via: str = "load_weights") -> dict[str, Any]:
        """Load ``version`` (or ``tag``; the head by default) of ``collection`` into this
        worker's model, in place. Returns what was loaded: ``collection``, ``version``,
        ``tensors``, ``bytes`` (as stored, before tensor-parallel slicing), ``seconds``
        and, inside an engine, this worker's ``tp_rank``/``pp_rank``.

        ``names``: only these tensors (names or a predicate), e.g. the ones a trainer
        changed. ``via="reload_weights"``: through vLLM's in-place reload
        (``model_runner.reload_weights``), which re-runs weight post-processing (needed
        for quantized models) and resets LoRA and encoder caches; it expects every
        tensor of the model. Blocks the worker until the copy is done; call it between
        steps (``collective_rpc`` does). Raises NotFound for a missing collection,
        version or tag, before the model is touched.
        """
        check_ref(collection, version, tag)
        if via not in _VIA:
            raise InvalidInput(f"via must be one of {list(_VIA)}, not {via!r}",
                               collection=collection)
        db = open_store(self._tensordb_location(location))
        tally = Tally()
        with db.snapshot(collection, version=version, tag=tag) as snap:
            got = snap.version
            weights = tally.wrap(named_tensors(snap, names))
            if via == "reload_weights":
                self.model_runner.reload_weights(  # type: ignore[attr-defined]
                    weights_iterator=weights, is_checkpoint_format=True)
            else:
                model = self._tensordb_model()
                with torch.no_grad():
                    model.load_weights(weights)
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()  # the copies are done when the caller hears back
        tally.stop()
        self._tensordb_loaded = (collection, got)
        summary = {"collection": collection, "version": got, "tensors": tally.tensors,
                   "bytes": tally.nbytes, "seconds": tally.seconds, **parallel_ranks()}
        logger.info("updated weights from tensordb %s v%d: %d tensors, %.1f MiB in %.2f s",
                    collection, got, tally.tensors, tally.nbytes / 2**20, tally.seconds)
        return summary

    def tensordb_weights_version(self) -> dict[str, Any] | None:
        """The collection and version the last ``update_weights_from_tensordb`` loaded
        into this worker, or None."""
        loaded = getattr(self, "_tensordb_loaded", None)
        return None if loaded is None else {"collection": loaded[0], "version": loaded[1]}
