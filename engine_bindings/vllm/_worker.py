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

import tensordb
from tensordb.errors import InvalidInput

from .._engines import (
    LoadSource,
    LocationLike,
    NameFilter,
    ServedLease,
    StoreLocation,
    Tally,
    check_ref,
    checked_tensors,
    note_served,
    now_served,
    open_store,
    served_by,
)
from ._loader import LOAD_FORMAT, parallel_ranks

__all__ = ["TensorDBWorkerExtension", "repacked_parameters"]

logger = logging.getLogger(__name__)

_VIA = ("auto", "load_weights", "reload_weights")


def repacked_parameters(model: torch.nn.Module) -> list[str]:
    """Parameters a backend emptied after loading because it moved their values into
    kernel-format buffers of its own (vLLM's CPU backend does so for linear layers:
    their ``weight`` reads as a tensor of size 0). ``model.load_weights`` cannot copy
    into them; vLLM's in-place reload restores them and re-runs the repacking."""
    return [n for n, p in model.named_parameters() if p.numel() == 0]


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
                                     via: str = "auto") -> dict[str, Any]:
        """Load ``version`` (or ``tag``; the head by default) of ``collection`` into this
        worker's model, in place. Returns what was loaded: ``collection``, ``version``,
        ``tensors``, ``bytes`` (as stored, before tensor-parallel slicing), ``seconds``
        and, inside an engine, this worker's ``tp_rank``/``pp_rank``.

        ``names``: only these tensors (names or a predicate), e.g. the ones a trainer
        changed. ``via``: ``"load_weights"`` copies into the parameters in place
        (``model.load_weights``); ``"reload_weights"`` goes through vLLM's in-place
        reload (``model_runner.reload_weights``), which re-runs weight post-processing
        (needed for quantized models and for backends that repack weights, such as
        vLLM's CPU backend) and resets LoRA and encoder caches; it expects every tensor
        of the model. ``"auto"`` (the default) takes the reload where the backend
        repacked parameters (``repacked_parameters``), else ``load_weights``. The
        summary says which ran (``via``). Blocks the worker until the copy is done;
        call it between steps (``collective_rpc`` does). Raises NotFound for a missing
        collection, version or tag, InvalidInput for a ``via`` or ``names`` the
        model cannot take, and CorruptData or NodeUnavailable (naming the tensor) for a
        version that cannot be read whole: every tensor is checked before the first
        is loaded, so the model is untouched. A load that fails after that puts the
        version the model served before back (leased for the whole update) before the
        error is raised; ``tensordb_weights_version`` names the one version served.
        """
        check_ref(collection, version, tag)
        if via not in _VIA:
            raise InvalidInput(f"via must be one of {list(_VIA)}, not {via!r}",
                               collection=collection)
        via = self._tensordb_via(collection, via, names)
        location = self._tensordb_location(location)
        db = open_store(location)
        model = self._tensordb_model()
        tally = Tally()
        with db.snapshot(collection, version=version, tag=tag) as snap, \
                ServedLease(model) as before:
            got = snap.version
            # the gate: the whole selection checked before the model sees one tensor
            weights = tally.wrap(checked_tensors(snap, names))
            try:
                if via == "reload_weights":
                    self._tensordb_reload(weights)
                else:
                    with torch.no_grad():
                        model.load_weights(weights)
                if torch.cuda.is_available() and torch.cuda.is_initialized():
                    torch.cuda.synchronize()  # the copies are done when the caller hears
            except BaseException as exc:
                self._tensordb_put_back(before, names, via, exc)
                raise
            note_served(model, now_served(location, snap, names, before))
        tally.stop()
        self._tensordb_loaded = (collection, got)
        summary = {"collection": collection, "version": got, "tensors": tally.tensors,
                   "bytes": tally.nbytes, "seconds": tally.seconds, "via": via,
                   **parallel_ranks()}
        logger.info("updated weights from tensordb %s v%d: %d tensors, %.1f MiB in %.2f s",
                    collection, got, tally.tensors, tally.nbytes / 2**20, tally.seconds)
        return summary

    def _tensordb_put_back(self, before: tensordb.Snapshot | None, names: NameFilter,
                           via: str, exc: BaseException) -> None:
        """After a load that failed part-way: the version the model served before,
        loaded again by the same path (the tensors the update named), so the model
        serves one version. Where it cannot be (unknown, or failing too), the model is
        reported as serving none."""
        model = self._tensordb_model()
        if via == "reload_weights":  # vLLM's reload stops where it failed: end it first
            try:
                self._tensordb_end_reload()
            except Exception:  # noqa: BLE001 - the put-back below rewrites every layer
                logger.exception("ending vLLM's interrupted reload failed")
        if before is None:
            note_served(model, None)
            exc.add_note("the model served no known tensordb version before this update; "
                         "it holds no one version now")
            return
        try:
            back = checked_tensors(before, None if via == "reload_weights" else names)
            if via == "reload_weights":
                self._tensordb_reload(iter(back))
            else:
                with torch.no_grad():
                    model.load_weights(back)
        except BaseException as undo:
            note_served(model, None)
            exc.add_note(f"putting {before.collection} v{before.version} back failed too "
                         f"({type(undo).__name__}: {undo}): the model holds no one version")
            return
        exc.add_note(f"the model is back on {before.collection} v{before.version}")

    def _tensordb_end_reload(self) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        config = self.vllm_config  # type: ignore[attr-defined]
        with set_current_vllm_config(config):
            finalize_layerwise_reload(self._tensordb_model(), config.model_config)

    def _tensordb_reload(self, weights: Any) -> None:
        """vLLM's in-place reload: the model runner's (which also resets LoRA and
        encoder caches), else vLLM's own function on the model."""
        reload = getattr(self.model_runner, "reload_weights", None)  # type: ignore[attr-defined]
        if callable(reload):
            reload(weights_iterator=weights, is_checkpoint_format=True)
            return
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload.inplace import reload_weights

        config = self.vllm_config  # type: ignore[attr-defined]
        with set_current_vllm_config(config):
            reload_weights(config, self._tensordb_model(), weights_iterator=weights,
                           weights_path=None, is_checkpoint_format=True)

    def _tensordb_via(self, collection: str, via: str, names: NameFilter) -> str:
        """The path an update takes; InvalidInput where the model cannot take it."""
        repacked = repacked_parameters(self._tensordb_model())
        if not repacked:
            return "load_weights" if via == "auto" else via
        if via == "load_weights" or names is not None:
            what = "via='load_weights'" if via == "load_weights" else "names=..."
            raise InvalidInput(
                f"{what} copies into the parameters in place, but this backend repacked "
                f"{len(repacked)} of them into kernel buffers (e.g. {repacked[0]!r}); "
                f"update every tensor through via='reload_weights' (or 'auto')",
                collection=collection)
        return "reload_weights"

    def tensordb_weights_version(self) -> dict[str, Any] | None:
        """The collection and version this worker's model serves (the load's, or the
        last update's), or None: not loaded from the store, or an update that failed
        part-way could not be put back."""
        served = served_by(self._tensordb_model())
        return None if served is None else served.as_dict()

