"""LoRA adapters from the store: vLLM's LoRA resolver (``vllm.lora.resolver``).

An adapter is a collection: a PEFT folder imported as any model folder is
(``tensordb import my-adapter /adapters/my-adapter``): its tensors
(``adapter_model.safetensors``) and its ``adapter_config.json`` (kept among the version's
files), whose ``base_model_name_or_path`` names the base model's collection.

``TensorDBLoRAResolver.resolve_lora(base_model_name, lora_name)`` looks ``lora_name`` up
as a collection of the store, checks it against the engine (its base must be the
collection the engine serves, its rank at most the engine's ``max_lora_rank``:
InvalidInput naming both otherwise), writes the version's folder once into a cache on
shared memory (``adapter_config.json`` and ``adapter_model.safetensors``, byte-identical
to what was imported; vLLM's LoRA loader maps it from there) and returns the
``LoRARequest``. A name resolved before comes from the cache without a look at the store's
files: one catalog look-up of the head, so a new version of the adapter is picked up.

The base is what the engine's model folder names: the ``tensordb.json`` of a
``tensordb checkout`` folder (the collection, and the store). vLLM asks the resolvers
of its OpenAI server (``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``) when a request names an
unknown model; ``register_lora_resolver`` (run by the ``tensordb`` plugin) registers
this one as ``tensordb``, its settings from the environment: ``TENSORDB_LORA_MAX_RANK``
(the engine's ``--max-lora-rank``, default 16) and ``TENSORDB_LORA_CACHE`` (default
``/dev/shm/tensordb-lora-<uid>``).
"""

from __future__ import annotations

import os
import threading
import zlib
from pathlib import Path
from typing import Any

from vllm.lora.request import LoRARequest
from vllm.lora.resolver import LoRAResolver, LoRAResolverRegistry

import tensordb
from tensordb.errors import InvalidInput, NotFound

from .._adapters import adapter_folder, default_cache
from .._engines import LoadSource, StoreLocation, open_store

__all__ = ["RESOLVER_NAME", "TensorDBLoRAResolver", "register_lora_resolver"]

RESOLVER_NAME = "tensordb"


class TensorDBLoRAResolver(LoRAResolver):
    """Resolves a request's adapter name to a LoRA of the store (see the module)."""

    def __init__(self, *, max_lora_rank: int, location: Any = None,
                 cache_dir: str | os.PathLike[str] | None = None) -> None:
        if not isinstance(max_lora_rank, int) or max_lora_rank <= 0:
            raise InvalidInput(f"max_lora_rank must be a positive int, not {max_lora_rank!r}")
        self.max_lora_rank = max_lora_rank
        self.location = StoreLocation.parse(location) if location is not None else None
        self.cache_dir = Path(cache_dir) if cache_dir is not None else default_cache()
        self._lock = threading.Lock()
        #: (base, adapter name) -> (version, the request)
        self._resolved: dict[tuple[str, str], tuple[int, LoRARequest]] = {}

    async def resolve_lora(self, base_model_name: str, lora_name: str) -> LoRARequest | None:
        """vLLM's ``LoRAResolver`` call: the ``LoRARequest``, or None where the store has
        no collection ``lora_name`` (the next resolver is asked)."""
        return self.resolve(base_model_name, lora_name)

    def resolve(self, base_model_name: str, lora_name: str) -> LoRARequest | None:
        """``resolve_lora``, called directly (an offline ``LLM`` passes the request to
        ``generate``)."""
        src = LoadSource.from_folder(base_model_name, what="the LoRA resolver")
        base, location = src.collection, self.location or src.location
        db = open_store(location)
        try:
            head = db.history(lora_name)[0].version
        except NotFound:
            return None
        with self._lock:
            hit = self._resolved.get((base, lora_name))
            if hit is not None and hit[0] == head:
                return hit[1]
            req = self._load(db, base, lora_name, head)
            self._resolved[(base, lora_name)] = (head, req)
            return req

    def _load(self, db: tensordb.Database, base: str, name: str, version: int
              ) -> LoRARequest:
        folder, v = adapter_folder(db, name, base=base, max_lora_rank=self.max_lora_rank,
                                   version=version, cache_dir=self.cache_dir)
        return LoRARequest(lora_name=name, lora_int_id=_int_id(name, v),
                           lora_path=str(folder), base_model_name=base)


def _int_id(name: str, version: int) -> int:
    """A stable positive id of an adapter version (vLLM's server renumbers them)."""
    return 1 + zlib.crc32(f"{name}@{version}".encode()) % (1 << 30)


def register_lora_resolver() -> bool:
    """Register ``TensorDBLoRAResolver`` as vLLM's ``tensordb`` LoRA resolver in this
    process (settings from the environment: see the module). Idempotent."""
    if RESOLVER_NAME in LoRAResolverRegistry.get_supported_resolvers():
        return True
    rank = os.environ.get("TENSORDB_LORA_MAX_RANK", "16")
    if not rank.isdigit() or int(rank) <= 0:
        raise InvalidInput(f"TENSORDB_LORA_MAX_RANK must be a positive int, not {rank!r}")
    LoRAResolverRegistry.register_resolver(RESOLVER_NAME,
                                           TensorDBLoRAResolver(max_lora_rank=int(rank)))
    return True
