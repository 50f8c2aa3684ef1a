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
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import xxhash
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

import tensordb
from tensordb.client import KVBlockInfo
from tensordb.errors import CorruptData, InvalidInput, NotFound, StoreFull

from .._engines import LOCATION_KEYS, StoreLocation, open_store

if TYPE_CHECKING:
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

logger = logging.getLogger(__name__)

#: what ``kv_connector`` names (with ``kv_connector_module_path: "engine_bindings.vllm"``)
CONNECTOR_NAME = "TensorDBConnector"

_OPTION_KEYS = ("namespace", "block_tokens", "capacity_bytes", "gpu_capacity", "events")


@dataclass(frozen=True, slots=True)
class KVLoad:
    """Stored blocks one request reads this step: sub-block ``skip`` of ``keys[0]``
    onwards goes, in order, into vLLM blocks ``block_ids[g]`` of each KV cache group
    ``g`` (the sub-blocks before ``skip`` were already in vLLM's prefix cache; a null
    block, id 0, is one a sliding-window group does not need, and is not written)."""

    req_id: str
    keys: list[bytes]
    skip: int
    block_ids: tuple[list[int], ...]


@dataclass(frozen=True, slots=True)
class KVSave:
    """Stored blocks one request writes this step: ``keys[i]`` is made of vLLM blocks
    ``block_ids[g][i * per_key:(i + 1) * per_key]`` of each KV cache group ``g``."""

    req_id: str
    keys: list[bytes]
    block_ids: tuple[list[int], ...]
    #: what vLLM knows of each block (its block hashes, tokens, parent), for KV events
    info: list[KVBlockInfo] | None = None


@dataclass
class TensorDBConnectorMetadata(KVConnectorMetadata):
    """What the scheduler tells the workers for one step (pickled to each worker)."""

    loads: list[KVLoad] = field(default_factory=list)
    saves: list[KVSave] = field(default_factory=list)


@dataclass(slots=True)
class _Tracked:
    """Scheduler-side state of one running request."""

    prompt: list[int]
    parent: bytes | None
    block_ids: list[list[int]]  # per KV cache group
    num_computed: int = 0
    saved: int = 0  # leading prompt blocks already saved, or found in the store
    keys: list[bytes] | None = None
    #: vLLM's block hashes of the request (its own list, which grows), and its adapter
    hashes: Sequence[Any] = ()
    lora: tuple[int | None, str | None] = (None, None)


def _event_hash(h: Any) -> bytes | int:
    """A vLLM block hash as its KV events carry it (bytes, or an int where
    VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES says so)."""
    try:
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
    except ImportError:  # older releases: the hash as it is
        return h if isinstance(h, (bytes, int)) else bytes(h)
    out: bytes | int = maybe_convert_block_hash(h)
    return out


def _natural(name: str) -> list[Any]:
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


#: vLLM's null block: the id a sliding-window group holds where a block left its window
NULL_BLOCK = 0

#: the KV cache specs whose blocks the connector stores: attention over token blocks
#: (full, sliding-window, chunked-local; MLA's latent cache); not Mamba state
_SPECS = (FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec, SlidingWindowMLASpec,
          ChunkedLocalAttentionSpec)


def _positive(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InvalidInput(f"kv_connector_extra_config {what!r} must be a positive int, "
                           f"not {value!r}")
    return value


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
    """

    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        unknown = sorted(set(extra) - set(_OPTION_KEYS) - set(LOCATION_KEYS))
        if unknown:
            raise InvalidInput(f"unexpected kv_connector_extra_config keys {unknown} for "
                               f"{CONNECTOR_NAME}; expected some of "
                               f"{list(_OPTION_KEYS + LOCATION_KEYS)}")
        groups = kv_cache_config.kv_cache_groups if kv_cache_config is not None else []
        self.block_size = int(vllm_config.cache_config.block_size)
        if not groups:
            raise InvalidInput(f"{CONNECTOR_NAME} needs at least one attention KV cache "
                               f"group, not none")
        for g in groups:
            spec = g.kv_cache_spec
            if type(spec) not in _SPECS or spec.block_size != self.block_size:
                raise InvalidInput(
                    f"{CONNECTOR_NAME} stores attention KV cache groups of vLLM's block "
                    f"size {self.block_size}; layers {list(g.layer_names)[:3]} have "
                    f"{type(spec).__name__} of block size {spec.block_size}")
        self.block_tokens = _positive(extra.get("block_tokens", self.block_size),
                                      "block_tokens")
        if self.block_tokens % self.block_size:
            raise InvalidInput(f"block_tokens {self.block_tokens} must be a multiple of "
                               f"vLLM's block_size {self.block_size}")
        self.per_key = self.block_tokens // self.block_size  # vLLM blocks per stored block
        self._opts = {k: _positive(extra[k], k) for k in ("capacity_bytes", "gpu_capacity")
                      if extra.get(k) is not None}
        namespace = extra.get("namespace")
        if namespace is None:
            model = os.path.basename(str(vllm_config.model_config.model).rstrip("/"))
            namespace = f"vllm/{model or 'model'}"
        elif not isinstance(namespace, str) or not namespace:
            raise InvalidInput(f"kv_connector_extra_config 'namespace' must be a non-empty "
                               f"string, not {namespace!r}")
        self.location = StoreLocation.parse({k: extra[k] for k in LOCATION_KEYS if k in extra})
        self.namespace = f"{namespace}/{self._layout(vllm_config, groups)}"
        #: several KV cache groups: loads are asynchronous to vLLM (done within the step
        #: that issues them, reported through ``get_transfer_results``), since vLLM's
        #: scheduler takes no block-level load failure from a hybrid engine, only a
        #: failed request, and that only of a request waiting for its KV
        self._async_loads = len(groups) > 1
        par = vllm_config.parallel_config
        self.tp_size, self.pp_size = par.tensor_parallel_size, par.pipeline_parallel_size
        self._loads = self._kv_transfer_config.is_kv_consumer
        unusable = _why_no_loads(vllm_config)
        if self._loads and unusable:
            logger.warning("%s loads nothing on this engine (it still saves): %s",
                           CONNECTOR_NAME, unusable)
            self._loads = False
        self._saves = self._kv_transfer_config.is_kv_producer
        db = open_store(self.location)
        if role == KVConnectorRole.SCHEDULER:
            # every rank's namespace: a prefix is a hit only where all ranks hold it
            # KV events (extra config "events": an endpoint or {"endpoint", ...}): the
            # first rank's namespace (every rank's holds the same tokens); one scheduler
            # process of the host's engines publishes, the others stand by
            events = extra.get("events")
            self.caches = [db.kv(self.rank_namespace(t, p), self.block_tokens, **self._opts,
                                 **({"events": events} if events and t == p == 0 else {}))
                           for p in range(self.pp_size) for t in range(self.tp_size)]
            self._lookups: dict[str, tuple[int, list[bytes]]] = {}
            #: the keys of a request's full blocks, hashed once: a waiting request is
            #: looked up again at every step, and hashing its tokens was the lookup's cost
            self._keys_of: dict[str, list[bytes]] = {}
            self._pending: dict[str, KVLoad] = {}
            self._tracked: dict[str, _Tracked] = {}
        else:
            from ._loader import parallel_ranks

            ranks = parallel_ranks() or {"tp_rank": 0, "pp_rank": 0}
            self.caches = [db.kv(self.rank_namespace(ranks["tp_rank"], ranks["pp_rank"]),
                                 self.block_tokens, **self._opts)]
            self._layers: list[str] = []
            self._kv: list[torch.Tensor] = []
            #: the KV cache group of each layer (hybrid models: several)
            self._group_of = {n: g for g, grp in enumerate(groups) for n in grp.layer_names}
            self._layer_groups: list[int] = []
            self._ratio = 1
            self._failed: set[int] = set()
            self._failed_reqs: set[str] = set()  # this step's requests whose load failed
            self._received: set[str] = set()  # asynchronous loads done (or failed) ...
            self._failed_received: set[str] = set()  # ... and those of them that failed
            self._step_saves: list[KVSave] = []
            self._staging: torch.Tensor | None = None
            self._saved_layers: set[int] = set()

    # -- naming ----------------------------------------------------------------------
    def _layout(self, vllm_config: VllmConfig, groups: Sequence[Any]) -> str:
        """A fingerprint of what a stored block holds: the model, the KV geometry of
        each KV cache group (its layers and attention kind), the block and the
        parallelism. The fingerprint of a single full-attention group is the one it
        always was, so that upgraded engines keep their stored blocks."""
        mc = vllm_config.model_config
        spec = groups[0].kv_cache_spec
        facts: tuple[Any, ...] = (
            str(mc.model), str(mc.dtype), str(vllm_config.cache_config.cache_dtype),
            str(spec.dtype), spec.num_kv_heads, spec.head_size,
            getattr(spec, "head_size_v", None), self.block_size, self.block_tokens,
            mc.get_total_num_hidden_layers(),
            vllm_config.parallel_config.tensor_parallel_size,
            vllm_config.parallel_config.pipeline_parallel_size)
        if len(groups) > 1 or type(spec) is not FullAttentionSpec:
            facts += tuple((type(g.kv_cache_spec).__name__, sorted(g.layer_names, key=_natural),
                            str(g.kv_cache_spec.dtype), g.kv_cache_spec.num_kv_heads,
                            g.kv_cache_spec.head_size,
                            getattr(g.kv_cache_spec, "sliding_window", None),
                            getattr(g.kv_cache_spec, "attention_chunk_size", None))
                           for g in groups)
        return xxhash.xxh3_64_hexdigest(repr(facts).encode())

    def rank_namespace(self, tp_rank: int, pp_rank: int) -> str:
        """The KV namespace of one tensor-/pipeline-parallel rank."""
        return f"{self.namespace}/tp{tp_rank}of{self.tp_size}-pp{pp_rank}of{self.pp_size}"

    # -- scheduler side --------------------------------------------------------------
    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a save that never happens is a future miss, not a loss

    @staticmethod
    def _parent(request: Request) -> bytes | None:
        lora = getattr(request, "lora_request", None)
        salt = getattr(request, "cache_salt", None)
        if lora is None and salt is None:
            return None
        name = getattr(lora, "lora_name", "") if lora is not None else ""
        return xxhash.xxh3_128_digest(f"tensordb-vllm\0{name}\0{salt or ''}".encode())

    @staticmethod
    def _cacheable(request: Request) -> bool:
        return not getattr(request, "mm_features", None) \
            and getattr(request, "prompt_embeds", None) is None \
            and request.prompt_token_ids is not None

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed_tokens`` whose KV every rank's namespace holds
        (whole stored blocks, at most all tokens but the last). Never blocks on I/O
        (an index lookup per rank); loads are synchronous (second value False)."""
        if not self._loads or not self._cacheable(request):
            return 0, False
        keys = self._request_keys(request)
        hits = min(kv.match(keys) for kv in self.caches) if keys else 0
        self._lookups[request.request_id] = (num_computed_tokens, keys[:hits])
        tokens = max(0, hits * self.block_tokens - num_computed_tokens)
        return tokens, self._async_loads and tokens > 0

    def _request_keys(self, request: Request) -> list[bytes]:
        """The keys of the request's full blocks of all tokens but the last, extended
        from those of its last lookup (its tokens only ever grow)."""
        bt = self.block_tokens
        full = (request.num_tokens - 1) // bt
        keys = self._keys_of.get(request.request_id, [])
        if len(keys) < full:
            parent = keys[-1] if keys else self._parent(request)
            keys = keys + self.caches[0].keys(
                request.all_token_ids[len(keys) * bt:full * bt], parent=parent)
            self._keys_of[request.request_id] = keys
        return keys[:full]

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        """Record the vLLM blocks that this step's load fills, and start following
        the request for saves."""
        start, keys = self._lookups.pop(request.request_id, (0, []))
        if self._saves and self._cacheable(request) and request.request_id not in self._tracked:
            lora = getattr(request, "lora_request", None)
            self._tracked[request.request_id] = _Tracked(
                prompt=list(request.prompt_token_ids or ()), parent=self._parent(request),
                block_ids=[], hashes=getattr(request, "block_hashes", None) or (),
                lora=(getattr(lora, "lora_int_id", None), getattr(lora, "lora_name", None))
                if lora is not None else (None, None))
        if num_external_tokens <= 0:
            return
        first, end = start // self.block_size, (start + num_external_tokens) // self.block_size
        self._pending[request.request_id] = KVLoad(
            req_id=request.request_id,
            keys=keys[first // self.per_key:-(-end // self.per_key)],
            skip=first % self.per_key,
            block_ids=tuple(list(ids[first:end]) for ids in blocks.get_block_ids()))

    def build_connector_meta(self, scheduler_output: SchedulerOutput
                             ) -> TensorDBConnectorMetadata:
        """This step's loads (from ``update_state_after_alloc``) and saves: the prompt
        blocks that this step completes and the store lacks. Resets the step's state."""
        meta = TensorDBConnectorMetadata(loads=list(self._pending.values()))
        self._pending.clear()
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            t = self._tracked.get(new.req_id)
            if t is not None:
                t.block_ids = [list(ids) for ids in new.block_ids]
                t.num_computed = new.num_computed_tokens
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            t = self._tracked.get(req_id)
            if t is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids and new_ids is not None:
                t.block_ids = [list(ids) for ids in new_ids]
            elif new_ids is not None:
                for mine, ids in zip(t.block_ids, new_ids, strict=True):
                    mine.extend(ids)
            t.num_computed = cached.num_computed_tokens[i]
        if self._saves:
            step: set[bytes] = set()  # two requests of one prefix in a step save it once
            for req_id, n in scheduled.items():
                t = self._tracked.get(req_id)
                if t is not None:
                    save = self._save_of(req_id, t, t.num_computed + n, step)
                    if save is not None:
                        meta.saves.append(save)
        return meta

    def _save_of(self, req_id: str, t: _Tracked, computed: int, step: set[bytes]
                 ) -> KVSave | None:
        """The stored blocks of the request that ``computed`` tokens complete and the
        store lacks. A stored block holding a null block of a sliding-window group
        (its KV left the window before this engine computed it: a local prefix hit)
        cannot be saved whole, and is left to an engine that computes it."""
        held = min(len(ids) for ids in t.block_ids)
        full = min(computed, len(t.prompt), held * self.block_size) // self.block_tokens
        if full <= t.saved:
            return None
        if t.keys is None:
            t.keys = self.caches[0].keys(t.prompt, parent=t.parent)
        lo, t.saved = t.saved, full
        keys = t.keys[lo:full]
        present = [all(c) for c in zip(*(kv.contains(keys) for kv in self.caches), strict=True)]
        m = self.per_key
        todo = [lo + i for i, p in enumerate(present) if not p and keys[i] not in step
                and all(NULL_BLOCK not in ids[(lo + i) * m:(lo + i + 1) * m]
                        for ids in t.block_ids)]
        if not todo:
            return None
        step.update(t.keys[i] for i in todo)
        return KVSave(req_id=req_id, keys=[t.keys[i] for i in todo],
                      block_ids=tuple([b for i in todo for b in ids[i * m:(i + 1) * m]]
                                      for ids in t.block_ids),
                      info=[self._info(t, i) for i in todo])

    def _info(self, t: _Tracked, i: int) -> KVBlockInfo:
        """Stored block ``i`` of a request as vLLM names it in its KV events: the hashes
        of its vLLM blocks, their parent, its tokens."""
        m, bt = self.per_key, self.block_tokens
        hashes = t.hashes[i * m:(i + 1) * m] if len(t.hashes) >= (i + 1) * m else ()
        return KVBlockInfo(
            token_ids=t.prompt[i * bt:(i + 1) * bt],
            block_hashes=[_event_hash(h) for h in hashes],
            parent_block_hash=_event_hash(t.hashes[i * m - 1]) if hashes and i else None,
            block_size=self.block_size, lora_id=t.lora[0], lora_name=t.lora[1])

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Blocks that failed to load on a worker: a request holding one saved nothing
        that step (the workers skip it), so its saves start again from the stored block
        holding the first failed one, once vLLM has recomputed it (``recompute``)."""
        invalid = connector_output.invalid_block_ids
        if not invalid:
            return
        for t in self._tracked.values():
            hit = [i for ids in t.block_ids for i, b in enumerate(ids) if b in invalid]
            if hit:
                t.saved = min(t.saved, min(hit) // self.per_key)

    def request_finished(self, request: Request, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        """Forget the request. Saves finish within their step, so vLLM may free the
        request's blocks at once (False)."""
        for d in (self._tracked, self._lookups, self._pending, self._keys_of):
            d.pop(request.request_id, None)
        return False, None

    def request_finished_all_groups(self, request: Request,
                                    block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        """``request_finished`` under vLLM's hybrid KV cache manager (``SupportsHMA``):
        the same, whatever the groups."""
        return self.request_finished(request, block_ids[0] if block_ids else [])

    # -- worker side -----------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Take the per-layer paged caches (``[blocks * r, *page]`` views, blocks
        first) of every KV cache group's layers. All layers must share shape, dtype and
        device (under vLLM's hybrid KV cache manager the groups share one block pool
        and page size)."""
        if not kv_caches:
            raise InvalidInput(f"{CONNECTOR_NAME}: no KV caches to register")
        names = sorted(kv_caches, key=_natural)
        unknown = [n for n in names if n not in self._group_of]
        if unknown:
            raise InvalidInput(f"{CONNECTOR_NAME}: layers {unknown[:3]} are in no KV cache "
                               f"group of this engine")
        first = kv_caches[names[0]]
        num_blocks = self._kv_cache_config.num_blocks
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
        return (len(self._kv), self.per_key * self._ratio, *first.shape[1:])

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
        """A new step: no request of it has failed a load yet. (vLLM calls
        ``start_load_kv`` after the forward in a step without loads, so the step's
        state cannot be reset there.)"""
        super().bind_connector_metadata(connector_metadata)
        self._failed_reqs = set()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Copy this step's stored blocks into the paged caches, every layer. A block
        that is gone or damaged leaves its vLLM blocks (and the request's later ones)
        to ``get_block_ids_with_load_errors``."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, TensorDBConnectorMetadata)
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
            if self._async_loads:
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
        if self._async_loads:
            self._received.add(load.req_id)
            self._failed_received.add(load.req_id)
        else:
            self._failed.update(_real(load.block_ids))
            self._failed_reqs.add(load.req_id)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: ``start_load_kv`` issued every layer's copies on the
        forward's own stream before the forward, so each layer's attention comes after
        them in stream order (and on the CPU they are done)."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        """Gather this layer's part of every block saved this step into a staging
        tensor on the cache's device (asynchronous there); ``wait_for_save`` stores
        them. Layers that are not the worker's registered ones are ignored. A request
        whose load failed in this step saves nothing: its new KV was computed against
        prefix blocks that never arrived."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, TensorDBConnectorMetadata)
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

    def get_finished(self, finished_req_ids: set[str]
                     ) -> tuple[set[str] | None, set[str] | None]:
        """Nothing is in flight between steps: loads and saves end within theirs."""
        return None, None

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
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


def _why_no_loads(vllm_config: VllmConfig) -> str | None:
    """Why this engine cannot start a request from a loaded prefix, or None. vLLM's
    CPU build turns prefix caching off for MLA models (unless its AMX kernels run
    them): its MLA prefill over an already computed prefix does not answer as a whole
    prefill does, whoever loaded the prefix (vLLM's own example connector included),
    so a loaded prefix would change the outputs."""
    from vllm.platforms import current_platform

    if vllm_config.model_config.use_mla and current_platform.is_cpu() \
            and not vllm_config.cache_config.enable_prefix_caching:
        return ("vLLM's CPU MLA backend cannot continue from a computed prefix (vLLM "
                "turned prefix caching off for it)")
    return None


def _real(block_ids: tuple[list[int], ...]) -> set[int]:
    """The vLLM blocks of every group, less the null block."""
    return {b for ids in block_ids for b in ids if b != NULL_BLOCK}


def _forward_context() -> ForwardContext | None:
    from vllm.forward_context import get_forward_context, is_forward_context_available

    return get_forward_context() if is_forward_context_available() else None


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
