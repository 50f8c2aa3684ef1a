"""A vLLM model loader that materializes weights from a tensordb collection.

``--load-format tensordb`` picks it once ``register()`` has run in the worker processes
(importing ``engine_bindings.vllm`` runs it: through ``--worker-extension-cls
engine_bindings.vllm.TensorDBWorkerExtension``, or a ``vllm.general_plugins`` entry point
naming ``engine_bindings.vllm:register``). ``--model-loader-extra-config`` tells it what
to read::

    {"collection": "llama", "version": 3,            # or "tag": "ckpt-100"; default: head
     "home": "/var/lib/tensordb",                    # or "url" (+ "node", "data_dir")
     "verify": false}                                # checksum every tensor as it is read

The model itself is built by vLLM (``BaseModelLoader.load_model``: config, dtype, device,
quantization, post-processing); this loader only feeds ``model.load_weights`` the
version's tensors under their checkpoint names (a collection made by
``db.import_safetensors`` of a Hugging Face folder, or committed by a trainer with the
same names). The tensors are the store's zero-copy views: each worker's weight loaders
narrow them to the worker's tensor-parallel slice, so a rank touches only the pages of
its own slices, and a pipeline stage never reads another stage's layers.
"""

from __future__ import annotations

import logging
from collections.abc import Generator
from typing import Any

import torch
from torch import nn
from vllm.config import ModelConfig
from vllm.config.load import LoadConfig
from vllm.model_executor.model_loader import register_model_loader
from vllm.model_executor.model_loader.base_loader import BaseModelLoader

from tensordb.errors import InvalidInput

from .._engines import LoadSource, Served, Tally, checked_tensors, note_served

__all__ = ["LOAD_FORMAT", "WEIGHT_TRANSFER_BACKEND", "LoadSource", "TensorDBModelLoader",
           "parallel_ranks", "register", "register_weight_transfer"]

logger = logging.getLogger(__name__)

#: the name of the load format: ``--load-format tensordb``
LOAD_FORMAT = "tensordb"
#: the weight-transfer backend: ``weight_transfer_config={"backend": "tensordb"}``
WEIGHT_TRANSFER_BACKEND = "tensordb"


def parallel_ranks() -> dict[str, int]:
    """This worker's tensor- and pipeline-parallel rank and size from vLLM's parallel
    state; {} where it is not initialized (a model built outside an engine)."""
    from vllm.distributed import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return {}
    return {"tp_rank": ps.get_tensor_model_parallel_rank(),
            "tp_size": ps.get_tp_group().world_size,
            "pp_rank": ps.get_pipeline_model_parallel_rank(),
            "pp_size": ps.get_pp_group().world_size}


class TensorDBModelLoader(BaseModelLoader):
    """``--load-format tensordb``: weights from a version of a tensordb collection.

    Runs in each vLLM worker process. ``load_weights`` may block while the store maps
    the version (no byte is copied before the model's weight loaders copy their slice
    into the parameters). ``get_all_weights`` lets vLLM's ``reload_weights`` re-read the
    configured version (the head, when none is pinned) in place.
    """

    def __init__(self, load_config: LoadConfig) -> None:
        super().__init__(load_config)
        extra = load_config.model_loader_extra_config
        #: None until the model folder is known: a ``tensordb checkout`` folder's marker
        #: names the version where no extra config does (``source_for``)
        self.source: LoadSource | None = (
            LoadSource.from_extra_config(extra, what=f"load format {LOAD_FORMAT!r}") if extra else None)
        self.last_load: dict[str, Any] | None = None

    def source_for(self, model_config: ModelConfig) -> LoadSource:
        """The version to load: the extra config's, else the one the model folder's
        ``tensordb.json`` names (InvalidInput where it has none)."""
        if self.source is None:
            self.source = LoadSource.from_folder(model_config.model, what=f"load format {LOAD_FORMAT!r}")
        return self.source

    def download_model(self, model_config: ModelConfig) -> None:
        """Nothing to download: check that the version exists (NotFound otherwise)."""
        src = self.source_for(model_config)
        with src.snapshot():
            pass

    def get_all_weights(self, model_config: ModelConfig, model: nn.Module
                        ) -> Generator[tuple[str, torch.Tensor], None, None]:
        """The version's (name, tensor) pairs, zero-copy, under one snapshot lease.
        Every tensor is checked (rows, marks, checksums) before the first is handed
        out, so vLLM's in-place reload never stops part-way on a damaged or unreachable
        tensor (CorruptData, NodeUnavailable before the model is touched)."""
        src = self.source_for(model_config)
        with src.snapshot() as snap:
            pairs = checked_tensors(snap)
            yield from pairs
            note_served(model, Served(src.location, src.collection,
                                      snap.version))

    def load_weights(self, model: nn.Module, model_config: ModelConfig) -> None:
        src = self.source_for(model_config)
        tally = Tally()
        with src.snapshot() as snap:
            version = snap.version
            # checked whole before the model's weight loaders see the first tensor
            loaded = model.load_weights(tally.wrap(checked_tensors(snap)))
        tally.stop()
        note_served(model, Served(src.location, src.collection, version))
        self.last_load = {"collection": src.collection, "version": version,
                          "tensors": tally.tensors, "bytes": tally.nbytes,
                          "seconds": tally.seconds, **parallel_ranks()}
        logger.info("loaded %s v%d from tensordb: %d tensors, %.1f MiB in %.2f s",
                    src.collection, version, tally.tensors, tally.nbytes / 2**20,
                    tally.seconds)
        # as vLLM's default loader: an unquantized model that reports what it loaded
        # must have every parameter from the checkpoint
        if model_config.quantization is None and loaded is not None:
            missing = sorted({n for n, _ in model.named_parameters()} - set(loaded))
            if missing:
                raise InvalidInput(
                    f"{src.collection} v{version} leaves {len(missing)} parameters "
                    f"of the model unset: {missing[:10]}", collection=src.collection,
                    version=version)


_loader_registered = False


def register() -> None:
    """Make ``--load-format tensordb`` resolve to ``TensorDBModelLoader``, the
    ``tensordb`` weight-transfer backend to ``TensorDBWeightTransferEngine`` (where
    vLLM has the weight-transfer API), and the ``tensordb`` LoRA resolver
    (``TensorDBLoRAResolver``) be registered, in this process. Idempotent; usable as a
    ``vllm.general_plugins`` entry point."""
    global _loader_registered
    register_weight_transfer()
    from ._lora import register_lora_resolver

    register_lora_resolver()
    if _loader_registered:                      # vLLM's registry warns on a second one
        return
    register_model_loader(LOAD_FORMAT)(TensorDBModelLoader)
    _loader_registered = True


def register_weight_transfer() -> bool:
    """Make ``weight_transfer_config={"backend": "tensordb"}`` resolve to
    ``TensorDBWeightTransferEngine`` in this process, lazily (its module is imported
    when vLLM makes an engine). False where the installed vLLM has no weight-transfer
    API (before 0.32). Idempotent."""
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    except ImportError:
        return False
    try:
        WeightTransferEngineFactory.register_engine(
            WEIGHT_TRANSFER_BACKEND, "engine_bindings.vllm._weight_transfer",
            "TensorDBWeightTransferEngine")
    except ValueError as e:                     # the factory's "already registered"
        if "already registered" not in str(e):
            raise
    return True
