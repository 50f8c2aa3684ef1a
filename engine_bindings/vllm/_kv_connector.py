"""A vLLM KV connector: prefix KV blocks shared through tensordb's KV block store.

Turn it on with::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "TensorDBConnector",
        "kv_connector_module_path": "engine_bindings.vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {"home": "/var/lib/tensordb"}}'

Every engine on the host that names the same store and model shares the blocks: what
one engine computed for a prompt prefix, the next one loads instead of recomputing it.

**Keys.** The scheduler hashes a request's tokens with ``KVCache.keys`` (xxh3-128,
chained: a key names the whole prefix up to its block; LoRA adapter and cache salt
seed the chain), and asks the store how many leading blocks it holds (``match``).
**Blocks.** One stored block is ``block_tokens`` tokens of *all* the worker's layers,
K and V: a tensor ``[layers, block_tokens // block_size * r, *page]`` where ``page``
is one kernel block of vLLM's per-layer cache view (``[heads, block_size / r, 2 *
head_size]`` for FlashAttention and the CPU backend, K then V on the last axis) and
``r`` the kernel blocks per vLLM block (1 unless the attention kernel splits blocks).
Layers are in the natural order of their names. **Hybrid models** (vLLM's hybrid KV
cache manager: ``SupportsHMA``; full-attention and sliding-window or chunked-local
layers in several KV cache groups, one block pool): a stored block holds every group's
layers, each read from and written to its own group's vLLM blocks; a group's null block
(a sliding-window block outside the window) is neither loaded nor saved, and a stored
block that would need one is not saved. A hybrid engine's loads are asynchronous to
vLLM (``get_num_new_matched_tokens`` says so: the request waits a step, in which the
worker loads its blocks and reports it through ``get_transfer_results``), since vLLM's
scheduler takes a failed load from a hybrid engine only as a failed request: it then
recomputes the whole request or fails it. **MLA**: the latent cache is one page per
block (``[block_size, kv_lora_rank + rope]``), stored the same way; vLLM's CPU build
(MLA without its AMX kernels) cannot continue a request from a computed prefix, so
there the connector saves and never loads. Each
tensor-parallel / pipeline rank
has its own namespace ``{namespace}/{layout}/tp{rank}of{size}-pp{rank}of{size}``
(``layout`` fingerprints model, dtype and block geometry): the same token keys, the
rank's own slice of the KV.

``block_tokens`` (extra config; default: vLLM's ``block_size``) must be a multiple of
the block size, so that a stored block is a whole number of vLLM blocks. Equal is the
finest granularity (a hit is as long as vLLM's own prefix cache could find); a larger
multiple means fewer, larger store entries (less index work per token) but hits
rounded down to it.

**Calls.** Scheduler process: ``get_num_new_matched_tokens`` (the store's hit beyond
vLLM's local prefix cache; side-effect free), ``update_state_after_alloc`` (the blocks
to fill), ``build_connector_meta`` (loads, and the prompt blocks completed this step
that the store lacks). Worker processes: ``start_load_kv`` copies the stored blocks
into every layer's paged cache (the loads are synchronous, so vLLM calls it before the
forward, and on a GPU the copies precede the layers' kernels on the forward's stream:
``wait_for_layer_load`` has nothing left to wait for), ``save_kv_layer`` gathers the
blocks to save from each layer after its attention ran, ``wait_for_save`` puts them
(first writer wins; a full store only costs a future miss). A block that cannot be
loaded (evicted since the match, corrupt) is reported through
``get_block_ids_with_load_errors``; vLLM then recomputes it (``kv_load_failure_policy:
"recompute"``) or fails the request. What is saved: the full blocks of each prompt
(generated tokens are not). Multimodal and prompt-embedding requests are neither
loaded nor saved: their tokens do not name their KV.

**Rooms.** As vLLM's own connectors are, this one is two: ``TensorDBConnector`` is the
class vLLM makes (once per role) and hands each call to the side of its role, the
scheduler's (``_kv_scheduler.TensorDBConnectorScheduler``: keys, lookups, what to load
and save) or a worker's (``_kv_worker.TensorDBConnectorWorker``: the paged caches, the
copies); what both read is ``_kv_common`` (the settings, checked once, and the step's
metadata).
"""


from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

import tensordb

from .._engines import StoreLocation
from ._kv_common import (
    CONNECTOR_NAME,
    ConnectorSettings,
    KVLoad,
    KVSave,
    TensorDBConnectorMetadata,
)
from ._kv_scheduler import TensorDBConnectorScheduler
from ._kv_worker import TensorDBConnectorWorker

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = [
    "CONNECTOR_NAME",
    "KVLoad",
    "KVSave",
    "TensorDBConnector",
    "TensorDBConnectorMetadata",
    "kv_transfer_config",
]


class TensorDBConnector(KVConnectorBase_V1, SupportsHMA):
    """``KVConnectorBase_V1`` over a tensordb KV namespace (see the module docstring).

    ``kv_connector_extra_config`` keys: where the store is (``home``, or ``url`` with
    ``node`` and ``data_dir``; default ``$TENSORDB_HOME``), ``namespace`` (default:
    ``vllm/`` and the model's name), ``block_tokens``, ``capacity_bytes`` (of the
    store's KV arena, when this process creates it), ``gpu_capacity`` (a GPU tier of
    that many bytes: blocks saved from the GPU keep a device copy there, and loads
    copy device to device from it, shared with the host's other engines; needs
    cuda-python). ``kv_role``: ``kv_both`` loads and saves, ``kv_consumer`` only loads,
    ``kv_producer`` only saves.

    The scheduler process's connector holds a ``scheduler``, a worker's a ``worker``;
    a call of the other role's is an error of vLLM's, and raises ``AssertionError``.
    """

    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        #: checked before any namespace is opened: a bad key opens nothing
        self.settings = ConnectorSettings.parse(vllm_config, kv_cache_config)
        self.scheduler: TensorDBConnectorScheduler | None = None
        self.worker: TensorDBConnectorWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = TensorDBConnectorScheduler(vllm_config, self.settings)
        else:
            self.worker = TensorDBConnectorWorker(self.settings, kv_cache_config)

    # -- both sides ------------------------------------------------------------------
    @property
    def namespace(self) -> str:
        """The model's namespace (each rank's is below it: ``rank_namespace``)."""
        return self.settings.namespace

    def rank_namespace(self, tp_rank: int, pp_rank: int) -> str:
        """The KV namespace of one tensor-/pipeline-parallel rank."""
        return self.settings.rank_namespace(tp_rank, pp_rank)

    @property
    def caches(self) -> list[tensordb.KVCache]:
        """The namespaces this side reads: every rank's (scheduler), its own (worker)."""
        side = self.scheduler or self.worker
        assert side is not None
        return side.caches

    def request_ids(self) -> set[str]:
        """The requests the scheduler side holds anything of (none on a worker)."""
        return self.scheduler.request_ids() if self.scheduler is not None else set()

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a save that never happens is a future miss, not a loss

    def shutdown(self) -> None:
        side = self.scheduler or self.worker
        if side is not None:
            side.shutdown()

    # -- scheduler side --------------------------------------------------------------
    def _sched(self) -> TensorDBConnectorScheduler:
        assert self.scheduler is not None, "a scheduler call on a worker's connector"
        return self.scheduler

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        return self._sched().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        self._sched().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput
                             ) -> TensorDBConnectorMetadata:
        return self._sched().build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._sched().update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        """Forget the request. Saves finish within their step, so vLLM may free the
        request's blocks at once (False)."""
        self._sched().request_finished(request)
        return False, None

    def request_finished_all_groups(self, request: Request,
                                    block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        """``request_finished`` under vLLM's hybrid KV cache manager (``SupportsHMA``):
        the same, whatever the groups."""
        return self.request_finished(request, block_ids[0] if block_ids else [])

    # -- worker side -----------------------------------------------------------------
    def _work(self) -> TensorDBConnectorWorker:
        assert self.worker is not None, "a worker call on the scheduler's connector"
        return self.worker

    @property
    def block_shape(self) -> tuple[int, ...]:
        """The shape of one stored block on this worker."""
        return self._work().block_shape

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._work().register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self._work().bind_connector_metadata(connector_metadata)

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        self._work().clear_connector_metadata()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._work().start_load_kv(forward_context)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._work().wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        self._work().save_kv_layer(layer_name, kv_layer)

    def wait_for_save(self) -> None:
        self._work().wait_for_save()

    def get_finished(self, finished_req_ids: set[str]
                     ) -> tuple[set[str] | None, set[str] | None]:
        return self._work().get_finished()

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        return self._work().get_transfer_results()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._work().get_block_ids_with_load_errors()


def kv_transfer_config(*, namespace: str | None = None, block_tokens: int | None = None,
                       location: Any = None,
                       kv_role: str = "kv_both", **options: Any) -> dict[str, Any]:
    """The ``--kv-transfer-config`` mapping that turns the connector on."""
    extra: dict[str, Any] = dict(_location(location).as_dict())
    if namespace is not None:
        extra["namespace"] = namespace
    if block_tokens is not None:
        extra["block_tokens"] = block_tokens
    extra.update(options)
    return {"kv_connector": CONNECTOR_NAME, "kv_connector_module_path": "engine_bindings.vllm",
            "kv_role": kv_role, "kv_connector_extra_config": extra}


def _location(location: Any) -> StoreLocation:
    """A ``Database`` (this process's store) or anything ``StoreLocation.parse`` takes."""
    if isinstance(location, tensordb.Database):
        return StoreLocation.of(location)
    return StoreLocation.parse(location)
