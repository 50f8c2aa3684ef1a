"""The scheduler process's side of the KV connector (``TensorDBConnectorScheduler``):
it hashes each request's tokens into store keys, asks every rank's namespace how much
of the prefix it holds, and tells the workers, each step, which stored blocks go into
which vLLM blocks (loads) and which completed prompt blocks to store (saves). It never
touches a KV tensor; its only I/O is index lookups."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import xxhash

import tensordb
from tensordb.client import KVBlockInfo

from .._engines import open_store
from ._kv_common import (
    CONNECTOR_NAME,
    NULL_BLOCK,
    ConnectorSettings,
    KVLoad,
    KVSave,
    TensorDBConnectorMetadata,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["TensorDBConnectorScheduler"]

logger = logging.getLogger(__name__)


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


class TensorDBConnectorScheduler:
    """The connector in vLLM's scheduler process: what it matched, is loading and has
    saved of each request. ``caches``: every rank's namespace (a prefix is a hit only
    where all ranks hold it). Calls run in the scheduler's loop and never block on more
    than an index lookup per rank.
    """

    def __init__(self, vllm_config: VllmConfig, settings: ConnectorSettings) -> None:
        self.settings = settings
        transfer = vllm_config.kv_transfer_config
        # the role: ``kv_consumer`` only loads, ``kv_producer`` only saves
        self._loads = bool(transfer is not None and transfer.is_kv_consumer)
        self._saves = bool(transfer is not None and transfer.is_kv_producer)
        unusable = _why_no_loads(vllm_config)
        if self._loads and unusable:
            logger.warning("%s loads nothing on this engine (it still saves): %s",
                           CONNECTOR_NAME, unusable)
            self._loads = False
        db = open_store(settings.location)
        # KV events go to the first rank's namespace (every rank's holds the same
        # tokens); one scheduler process of the host's engines publishes, the others
        # stand by
        events = settings.events
        self.caches: list[tensordb.KVCache] = [
            settings.open(db, t, p, **({"events": events} if events and t == p == 0 else {}))
            for p in range(settings.pp_size) for t in range(settings.tp_size)]
        self._lookups: dict[str, tuple[int, list[bytes]]] = {}
        #: the keys of a request's full blocks, hashed once: a waiting request is looked
        #: up again at every step, and hashing its tokens was the lookup's cost
        self._keys_of: dict[str, list[bytes]] = {}
        self._pending: dict[str, KVLoad] = {}
        self._tracked: dict[str, _Tracked] = {}

    def request_ids(self) -> set[str]:
        """The requests of which this side holds anything (a lookup, a load to send,
        keys, saves to follow): none once vLLM has finished them all."""
        return set(self._lookups) | set(self._keys_of) | set(self._pending) \
            | set(self._tracked)

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
        (an index lookup per rank); loads are synchronous (second value False) but on
        a hybrid engine."""
        if not self._loads or not self._cacheable(request):
            return 0, False
        keys = self._request_keys(request)
        hits = min(kv.match(keys) for kv in self.caches) if keys else 0
        self._lookups[request.request_id] = (num_computed_tokens, keys[:hits])
        tokens = max(0, hits * self.settings.block_tokens - num_computed_tokens)
        return tokens, self.settings.async_loads and tokens > 0

    def _request_keys(self, request: Request) -> list[bytes]:
        """The keys of the request's full blocks of all tokens but the last, extended
        from those of its last lookup (its tokens only ever grow)."""
        bt = self.settings.block_tokens
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
        bs, m = self.settings.block_size, self.settings.per_key
        first, end = start // bs, (start + num_external_tokens) // bs
        self._pending[request.request_id] = KVLoad(
            req_id=request.request_id, keys=keys[first // m:-(-end // m)], skip=first % m,
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
        s = self.settings
        full = min(computed, len(t.prompt), held * s.block_size) // s.block_tokens
        if full <= t.saved:
            return None
        if t.keys is None:
            t.keys = self.caches[0].keys(t.prompt, parent=t.parent)
        lo, t.saved = t.saved, full
        keys = t.keys[lo:full]
        present = [all(c) for c in zip(*(kv.contains(keys) for kv in self.caches), strict=True)]
        m = s.per_key
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
        m, bt = self.settings.per_key, self.settings.block_tokens
        hashes = t.hashes[i * m:(i + 1) * m] if len(t.hashes) >= (i + 1) * m else ()
        return KVBlockInfo(
            token_ids=t.prompt[i * bt:(i + 1) * bt],
            block_hashes=[_event_hash(h) for h in hashes],
            parent_block_hash=_event_hash(t.hashes[i * m - 1]) if hashes and i else None,
            block_size=self.settings.block_size, lora_id=t.lora[0], lora_name=t.lora[1])

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
                t.saved = min(t.saved, min(hit) // self.settings.per_key)

    def request_finished(self, request: Request) -> None:
        """Forget the request."""
        for d in (self._tracked, self._lookups, self._pending, self._keys_of):
            d.pop(request.request_id, None)

    def shutdown(self) -> None:
        for kv in self.caches:
            kv.close()


def _event_hash(h: Any) -> bytes | int:
    """A vLLM block hash as its KV events carry it (bytes, or an int where
    VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES says so)."""
    try:
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
    except ImportError:  # older releases: the hash as it is
        return h if isinstance(h, (bytes, int)) else bytes(h)
    out: bytes | int = maybe_convert_block_hash(h)
    return out


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
