"""What both sides of the KV connector share: the metadata the scheduler sends each
worker every step (``TensorDBConnectorMetadata`` of ``KVLoad`` and ``KVSave``), and the
settings both read from vLLM's configuration and ``kv_connector_extra_config``
(``ConnectorSettings``: checked once, before any namespace is opened).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import xxhash
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
)

import tensordb
from tensordb.client import KVBlockInfo
from tensordb.errors import InvalidInput

from .._engines import LOCATION_KEYS, StoreLocation

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = [
    "CONNECTOR_NAME",
    "NULL_BLOCK",
    "ConnectorSettings",
    "KVLoad",
    "KVSave",
    "TensorDBConnectorMetadata",
    "natural_key",
]

#: what ``kv_connector`` names (with ``kv_connector_module_path: "engine_bindings.vllm"``)
CONNECTOR_NAME = "TensorDBConnector"

#: vLLM's null block: the id a sliding-window group holds where a block left its window
NULL_BLOCK = 0

_OPTION_KEYS = ("namespace", "block_tokens", "capacity_bytes", "gpu_capacity", "events")

#: the KV cache specs whose blocks the connector stores: attention over token blocks
#: (full, sliding-window, chunked-local; MLA's latent cache); not Mamba state
_SPECS = (FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec, SlidingWindowMLASpec,
          ChunkedLocalAttentionSpec)


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


def natural_key(name: str) -> list[Any]:
    """Sort key of a layer name in its natural order (``layers.2`` before ``layers.10``)."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def _positive(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InvalidInput(f"kv_connector_extra_config {what!r} must be a positive int, "
                           f"not {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class ConnectorSettings:
    """The connector's configuration, the same in the scheduler and every worker:
    vLLM's block size, the stored block's tokens (``block_tokens``, a multiple of it),
    the namespace (the model's, and its KV layout's fingerprint), where the store is,
    the parallelism, the namespace options, and whether loads are asynchronous to vLLM
    (several KV cache groups: vLLM's scheduler takes no block-level load failure from
    a hybrid engine, only a failed request, and that only of a request waiting for its
    KV; such loads are done within the step that issues them and reported through
    ``get_transfer_results``)."""

    block_size: int
    block_tokens: int
    namespace: str
    location: StoreLocation
    tp_size: int
    pp_size: int
    #: ``capacity_bytes`` and ``gpu_capacity`` where given: what ``Database.kv`` takes
    options: Mapping[str, int]
    async_loads: bool
    #: KV events (extra config ``events``: an endpoint or ``{"endpoint", ...}``), or None
    events: Any = None

    @property
    def per_key(self) -> int:
        """vLLM blocks per stored block."""
        return self.block_tokens // self.block_size

    @classmethod
    def parse(cls, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None
              ) -> ConnectorSettings:
        """The settings of an engine's connector; InvalidInput for an unknown or bad
        extra-config key or a KV cache group the connector cannot store. Opens
        nothing."""
        transfer = vllm_config.kv_transfer_config
        extra = dict((transfer.kv_connector_extra_config if transfer else None) or {})
        unknown = sorted(set(extra) - set(_OPTION_KEYS) - set(LOCATION_KEYS))
        if unknown:
            raise InvalidInput(f"unexpected kv_connector_extra_config keys {unknown} for "
                               f"{CONNECTOR_NAME}; expected some of "
                               f"{list(_OPTION_KEYS + LOCATION_KEYS)}")
        groups = kv_cache_config.kv_cache_groups if kv_cache_config is not None else []
        block_size = int(vllm_config.cache_config.block_size)
        if not groups:
            raise InvalidInput(f"{CONNECTOR_NAME} needs at least one attention KV cache "
                               f"group, not none")
        for g in groups:
            spec = g.kv_cache_spec
            if type(spec) not in _SPECS or spec.block_size != block_size:
                raise InvalidInput(
                    f"{CONNECTOR_NAME} stores attention KV cache groups of vLLM's block "
                    f"size {block_size}; layers {list(g.layer_names)[:3]} have "
                    f"{type(spec).__name__} of block size {spec.block_size}")
        block_tokens = _positive(extra.get("block_tokens", block_size), "block_tokens")
        if block_tokens % block_size:
            raise InvalidInput(f"block_tokens {block_tokens} must be a multiple of "
                               f"vLLM's block_size {block_size}")
        options = {k: _positive(extra[k], k) for k in ("capacity_bytes", "gpu_capacity")
                   if extra.get(k) is not None}
        namespace = extra.get("namespace")
        if namespace is None:
            model = os.path.basename(str(vllm_config.model_config.model).rstrip("/"))
            namespace = f"vllm/{model or 'model'}"
        elif not isinstance(namespace, str) or not namespace:
            raise InvalidInput(f"kv_connector_extra_config 'namespace' must be a non-empty "
                               f"string, not {namespace!r}")
        location = StoreLocation.parse({k: extra[k] for k in LOCATION_KEYS if k in extra})
        layout = _layout(vllm_config, groups, block_size, block_tokens)
        par = vllm_config.parallel_config
        return cls(block_size=block_size, block_tokens=block_tokens,
                   namespace=f"{namespace}/{layout}", location=location,
                   tp_size=par.tensor_parallel_size, pp_size=par.pipeline_parallel_size,
                   options=options, async_loads=len(groups) > 1, events=extra.get("events"))

    def rank_namespace(self, tp_rank: int, pp_rank: int) -> str:
        """The KV namespace of one tensor-/pipeline-parallel rank."""
        return f"{self.namespace}/tp{tp_rank}of{self.tp_size}-pp{pp_rank}of{self.pp_size}"

    def open(self, db: tensordb.Database, tp_rank: int, pp_rank: int,
             **more: Any) -> tensordb.KVCache:
        """The namespace of one rank in ``db``, with the configured options."""
        return db.kv(self.rank_namespace(tp_rank, pp_rank), self.block_tokens,
                     **self.options, **more)


def _layout(vllm_config: VllmConfig, groups: Sequence[Any], block_size: int,
            block_tokens: int) -> str:
    """A fingerprint of what a stored block holds: the model, the KV geometry of each
    KV cache group (its layers and attention kind), the block and the parallelism. The
    fingerprint of a single full-attention group is the one it always was, so that
    upgraded engines keep their stored blocks."""
    mc = vllm_config.model_config
    spec = groups[0].kv_cache_spec
    facts: tuple[Any, ...] = (
        str(mc.model), str(mc.dtype), str(vllm_config.cache_config.cache_dtype),
        str(spec.dtype), spec.num_kv_heads, spec.head_size,
        getattr(spec, "head_size_v", None), block_size, block_tokens,
        mc.get_total_num_hidden_layers(),
        vllm_config.parallel_config.tensor_parallel_size,
        vllm_config.parallel_config.pipeline_parallel_size)
    if len(groups) > 1 or type(spec) is not FullAttentionSpec:
        facts += tuple((type(g.kv_cache_spec).__name__, sorted(g.layer_names, key=natural_key),
                        str(g.kv_cache_spec.dtype), g.kv_cache_spec.num_kv_heads,
                        g.kv_cache_spec.head_size,
                        getattr(g.kv_cache_spec, "sliding_window", None),
                        getattr(g.kv_cache_spec, "attention_chunk_size", None))
                       for g in groups)
    return xxhash.xxh3_64_hexdigest(repr(facts).encode())
