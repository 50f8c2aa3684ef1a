"""The worker processes' side of the KV connector (``TensorDBConnectorWorker``): it
holds the worker's paged KV caches and its rank's namespace, copies each step's stored
blocks into the caches before the forward, gathers the blocks to save from each layer
after its attention ran, and stores them at the end of the step. It reads and writes
only what the scheduler's metadata of the step names."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

import tensordb
from tensordb.errors import CorruptData, InvalidInput, NotFound, StoreFull

from .._engines import open_store
from ._kv_common import (
    CONNECTOR_NAME,
    NULL_BLOCK,
    ConnectorSettings,
    KVLoad,
    KVSave,
    TensorDBConnectorMetadata,
    natural_key,
)

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
    from vllm.forward_context import ForwardContext
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = ["TensorDBConnectorWorker"]

logger = logging.getLogger(__name__)


class TensorDBConnectorWorker:
    """The connector in one vLLM worker: its paged caches, its rank's namespace
    (``caches``: that one), the step's metadata, the blocks it failed to load and the
    blocks it is gathering to save. Loads and saves end within their step."""

    def __init__(self, settings: ConnectorSettings, kv_cache_config: KVCacheConfig) -> None:
        from ._loader import parallel_ranks

        self.settings = settings
        db = open_store(settings.location)
        ranks = parallel_ranks() or {"tp_rank": 0, "pp_rank": 0}
        self.caches: list[tensordb.KVCache] = [
            settings.open(db, ranks["tp_rank"], ranks["pp_rank"])]
        self._num_blocks = kv_cache_config.num_blocks
        self._meta: KVConnectorMetadata | None = None
        self._layers: list[str] = []
        self._kv: list[torch.Tensor] = []
        #: the KV cache group of each layer (hybrid models: several)
        self._group_of = {n: g for g, grp in enumerate(kv_cache_config.kv_cache_groups)
                          for n in grp.layer_names}
        self._layer_groups: list[int] = []
        self._ratio = 1
        self._failed: set[int] = set()
        self._failed_reqs: set[str] = set()  # this step's requests whose load failed
        self._received: set[str] = set()  # asynchronous loads done (or failed) ...
        self._failed_received: set[str] = set()  # ... and those of them that failed
        self._step_saves: list[KVSave] = []
        self._staging: torch.Tensor | None = None
        self._save_rows: list[torch.Tensor] = []
        self._saved_layers: set[int] = set()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Take the per-layer paged caches (``[blocks * r, *page]`` views, blocks
        first) of every KV cache group's layers. All layers must share shape, dtype and
        device (under vLLM's hybrid KV cache manager the groups share one block pool
        and page size)."""
        if not kv_caches:
            raise InvalidInput(f"{CONNECTOR_NAME}: no KV caches to register")
        names = sorted(kv_caches, key=natural_key)
        unknown = [n for n in names if n not in self._group_of]
        if unknown:
            raise InvalidInput(f"{CONNECTOR_NAME}: layers {unknown[:3]} are in no KV cache "
                               f"group of this engine")
        first = kv_caches[names[0]]
        num_blocks = self._num_blocks
        for name in names:
            t = kv_caches[name]
            if not isinstance(t, torch.Tensor) or t.ndim < 2 or t.shape != first.shape \
                    or t.dtype != first.dtype or t.device != first.device:
                raise InvalidInput(f"{CONNECTOR_NAME}: KV cache of layer {name!r} must be "
                                   f"a tensor like the first layer's {tuple(first.shape)} "
                                   f"{first.dtype} on {first.device}")
        if num_blocks <= 0 or first.shape[0] % num_blocks:
            raise InvalidInput(f"{CONNECTOR_NAME}: {first.shape[0]} kernel blocks per layer "
                               f"is not a multiple of {num_blocks} vLLM blocks")
        self._layers = names
        self._kv = [kv_caches[n] for n in names]
        self._layer_groups = [self._group_of[n] for n in names]
        self._ratio = first.shape[0] // num_blocks

    @property
    def block_shape(self) -> tuple[int, ...]:
        """The shape of one stored block on this worker."""
        first = self._kv[0]
        return (len(self._kv), self.settings.per_key * self._ratio, *first.shape[1:])

    def _ensure_registered(self, forward_context: ForwardContext | None) -> bool:
        if self._kv:
            return True
        if forward_context is None:
            return False
        layers = forward_context.no_compile_layers
        names = list(self._group_of)
        caches = {n: layers[n].kv_cache for n in names
                  if n in layers and isinstance(getattr(layers[n], "kv_cache", None),
                                                torch.Tensor)}
        if caches:
            self.register_kv_caches(caches)
        return bool(self._kv)

    def _rows(self, block_ids: Sequence[int], device: torch.device) -> torch.Tensor:
        r = self._ratio
        ids = torch.tensor(block_ids, dtype=torch.long)
        if r > 1:
            ids = (ids[:, None] * r + torch.arange(r)).reshape(-1)
        return ids.to(device)

    def _load_rows(self, skip: int, block_ids: Sequence[int], device: torch.device
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """Which kernel blocks of a load's stored blocks (flattened) go into which
        kernel blocks of the paged cache, for one group: its vLLM blocks from sub-block
        ``skip`` on, less the null blocks (outside a sliding window: not needed)."""
        r = self._ratio
        keep = [i for i, b in enumerate(block_ids) if b != NULL_BLOCK]
        src = torch.tensor([(skip + i) * r + k for i in keep for k in range(r)],
                           dtype=torch.long)
        return src, self._rows([block_ids[i] for i in keep], device)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """A new step: its metadata, and no request of it has failed a load yet. (vLLM
        calls ``start_load_kv`` after the forward in a step without loads, so the
        step's state cannot be reset there.)"""
        self._meta = connector_metadata
        self._failed_reqs = set()

    def clear_connector_metadata(self) -> None:
        """The step is over: no metadata until the next one is bound."""
        self._meta = None

    def _metadata(self) -> TensorDBConnectorMetadata:
        """The step's metadata: only between ``bind_connector_metadata`` and
        ``clear_connector_metadata``."""
        meta = self._meta
        assert isinstance(meta, TensorDBConnectorMetadata)
        return meta

    def start_load_kv(self, forward_context: ForwardContext | None) -> None:
        """Copy this step's stored blocks into the paged caches, every layer. A block
        that is gone or damaged leaves its vLLM blocks (and the request's later ones)
        to ``get_block_ids_with_load_errors``."""
        meta = self._metadata()
        if not meta.loads:
            return
        if not self._ensure_registered(forward_context):  # nowhere to load to: failed
            logger.warning("KV loads failed: no KV caches registered")
            for load in meta.loads:
                self._load_failed(load)
            return
        kv = self.caches[0]
        device = self._kv[0].device
        # with a GPU tier: views of the blocks' device copies (copied up once, shared by
        # the host's engines), so the copies below stay on the device
        where = device if device.type == "cuda" and kv.gpu_enabled else None
        jobs: list[tuple[Any, list[tuple[torch.Tensor, torch.Tensor]]]] = []
        for load in meta.loads:
            try:
                if where is None:  # one batch read into one tensor: no object per block
                    views: Any = torch.empty((len(load.keys), *self.block_shape),
                                             dtype=self._kv[0].dtype)
                    kv.get_into(load.keys, views)
                else:
                    views = kv.get(load.keys, device=where)
            except (NotFound, CorruptData, InvalidInput) as exc:
                logger.warning("KV load of %s failed: %s", load.req_id, exc)
                self._load_failed(load)
                continue
            if not isinstance(views, torch.Tensor) and any(
                    v.shape != self.block_shape or v.dtype != self._kv[0].dtype
                    for v in views):
                logger.warning("KV load of %s: stored blocks are not %s %s", load.req_id,
                               self.block_shape, self._kv[0].dtype)
                self._load_failed(load)
                continue
            if self.settings.async_loads:
                self._received.add(load.req_id)
            jobs.append((views, [self._load_rows(load.skip, ids, device)
                                 for ids in load.block_ids]))
        for layer, cache in enumerate(self._kv):
            group = self._layer_groups[layer]
            for views, per_group in jobs:
                rows, ids = per_group[group]
                if not len(ids):
                    continue
                src = views[:, layer].flatten(0, 1) if isinstance(views, torch.Tensor) \
                    else torch.cat([v[layer] for v in views])
                cache.index_copy_(0, ids, src[rows.to(src.device)].to(device))

    def _load_failed(self, load: KVLoad) -> None:
        """A load that failed: its blocks (synchronous loads: vLLM recomputes them or
        fails the request), or its request (asynchronous: vLLM recomputes all of it or
        fails it)."""
        if self.settings.async_loads:
            self._received.add(load.req_id)
            self._failed_received.add(load.req_id)
        else:
            self._failed.update(_real(load.block_ids))
            self._failed_reqs.add(load.req_id)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: ``start_load_kv`` issued every layer's copies on the
        forward's own stream before the forward, so each layer's attention comes after
        them in stream order (and on the CPU they are done)."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor) -> None:
        """Gather this layer's part of every block saved this step into a staging
        tensor on the cache's device (asynchronous there); ``wait_for_save`` stores
        them. Layers that are not the worker's registered ones are ignored. A request
        whose load failed in this step saves nothing: its new KV was computed against
        prefix blocks that never arrived."""
        meta = self._metadata()
        if not meta.saves or not self._ensure_registered(_forward_context()):
            return
        try:
            layer = self._layers.index(layer_name)
        except ValueError:
            return
        if self._staging is None:
            self._step_saves = [s for s in meta.saves if s.req_id not in self._failed_reqs]
            if not self._step_saves:
                return
            count = sum(len(s.keys) for s in self._step_saves)
            self._staging = torch.empty((count, *self.block_shape), dtype=self._kv[0].dtype,
                                        device=kv_layer.device)
            self._save_rows = [self._rows([b for s in self._step_saves for b in s.block_ids[g]],
                                          kv_layer.device)
                               for g in range(len(self._step_saves[0].block_ids))]
            self._saved_layers = set()
        dst = self._staging[:, layer]
        rows = self._save_rows[self._layer_groups[layer]]
        dst.copy_(kv_layer.index_select(0, rows).view(dst.shape))
        self._saved_layers.add(layer)

    def wait_for_save(self) -> None:
        """Store this step's gathered blocks (first writer wins), then return: vLLM
        may reuse their vLLM blocks at once. Blocks whose layers were not all gathered
        are not stored, nor those of a request whose load failed this step; a full
        store is logged (a future miss, not an error)."""
        staging, self._staging = self._staging, None
        saves, self._step_saves = self._step_saves, []
        if staging is None:
            return
        if len(self._saved_layers) != len(self._layers):
            logger.warning("KV save skipped: %d of %d layers gathered",
                           len(self._saved_layers), len(self._layers))
            return
        keys = [k for s in saves for k in s.keys]
        kv = self.caches[0]
        # with a GPU tier the device blocks go in as they are (put copies each down, and
        # keeps a device-to-device copy); else one copy down of them all
        blocks = staging if staging.device.type == "cuda" and kv.gpu_enabled \
            else staging.cpu()  # .cpu(): waits for the gathers
        info = [x for s in saves for x in (s.info or [None] * len(s.keys))]
        try:
            kv.put(keys, blocks, info=info)  # the batch path: the blocks are rows of one tensor
        except StoreFull as exc:
            logger.warning("KV save of %d blocks skipped: %s", len(keys), exc)

    def get_finished(self) -> tuple[set[str] | None, set[str] | None]:
        """Nothing is in flight between steps: loads and saves end within theirs."""
        return None, None

    def get_transfer_results(self) -> Any:
        """The asynchronous loads (hybrid engines) this step did: every one finished,
        and those that failed, which vLLM then recomputes from the start
        (``recompute``) or fails."""
        from vllm.distributed.kv_transfer.kv_connector.v1.base import (
            KVConnectorTransferResults,
        )

        done, self._received = self._received, set()
        failed, self._failed_received = self._failed_received, set()
        return KVConnectorTransferResults(finished_recving=done, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed = self._failed, set()
        return failed

    def shutdown(self) -> None:
        for kv in self.caches:
            kv.close()


def _real(block_ids: tuple[list[int], ...]) -> set[int]:
    """The vLLM blocks of every group, less the null block."""
    return {b for ids in block_ids for b in ids if b != NULL_BLOCK}


def _forward_context() -> ForwardContext | None:
    from vllm.forward_context import get_forward_context, is_forward_context_available

    return get_forward_context() if is_forward_context_available() else None
