"""LoRA adapters of the store, for any engine: an adapter is a collection, a PEFT folder
imported as any model folder is (its ``adapter_model.safetensors`` as tensors, its
``adapter_config.json`` among the version's files), whose ``base_model_name_or_path``
names the base model's collection.

``adapter_folder`` checks one against the engine (its base must be the collection the
engine serves, its rank at most the engine's ``max_lora_rank``: InvalidInput naming
both otherwise) and writes the version's folder once into a cache, byte-identical to
what was imported, from which an engine's LoRA loader maps it: vLLM's resolver
(``engine_bindings.vllm.TensorDBLoRAResolver``) returns it as a ``LoRARequest``;
for SGLang, pass it to ``Engine.load_lora_adapter(name, folder)``.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path

import tensordb
from tensordb.errors import InvalidInput

__all__ = ["ADAPTER_CONFIG", "default_cache", "adapter_folder"]

ADAPTER_CONFIG = "adapter_config.json"


def default_cache() -> Path:
    """Where adapters are written by default: shared memory, one folder per user."""
    return Path(os.environ.get("TENSORDB_LORA_CACHE") or f"/dev/shm/tensordb-lora-{os.getuid()}")


def adapter_folder(db: tensordb.Database, name: str, *, base: str, max_lora_rank: int,
                   version: int | None = None, cache_dir: str | os.PathLike[str] | None = None
                   ) -> tuple[Path, int]:
    """The folder of adapter ``name`` (its head, or ``version``) checked for an engine
    serving ``base`` with ``max_lora_rank``, and the version: written into ``cache_dir``
    (default ``default_cache()``) the first time, beside its final name and renamed
    over it, so that a reader never sees half of it. NotFound where there is no such
    collection; InvalidInput where it is no LoRA adapter, or not one for this engine."""
    with db.snapshot(name, version=version) as snap:
        v = snap.version
        if ADAPTER_CONFIG not in snap.files():
            raise InvalidInput(f"collection {name!r} v{v} is no LoRA adapter: it has no "
                               f"{ADAPTER_CONFIG}", collection=name)
        try:
            cfg = json.loads(snap.file(ADAPTER_CONFIG))
            names_base, rank = cfg.get("base_model_name_or_path"), cfg["r"]
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise InvalidInput(f"{name!r} v{v}: {ADAPTER_CONFIG} is not a PEFT LoRA config: "
                               f"{exc!r}", collection=name) from None
    if names_base != base:
        raise InvalidInput(f"adapter {name!r} is for base {names_base!r}, but this engine "
                           f"serves {base!r}", collection=name)
    if not isinstance(rank, int) or isinstance(rank, bool) or rank > max_lora_rank:
        raise InvalidInput(f"adapter {name!r} has rank {rank!r}, more than this engine's "
                           f"max_lora_rank {max_lora_rank}", collection=name)
    cache = Path(cache_dir) if cache_dir is not None else default_cache()
    folder = cache / f"{name.replace('/', '%2F')}@v{v}"
    if not folder.is_dir():
        cache.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp = cache / f".{folder.name}.{os.getpid()}.{threading.get_ident()}"
        db.export_safetensors(name, tmp, version=v)
        try:
            os.rename(tmp, folder)
        except OSError:  # another process wrote it first: the same bytes
            shutil.rmtree(tmp, ignore_errors=True)
    return folder, v
