"""Bindings of tensordb into engines: torch, safetensors, vLLM, SGLang, the router.

Bindings use the public ``tensordb`` API only.
"""

from __future__ import annotations

from tensordb.client import (  # the format lives in the store; re-exported here
    INDEX_NAME,
    LAYOUT_KEY,
    MAX_HEADER_SIZE,
    SAFETENSORS_DTYPES,
    export_safetensors,
    import_safetensors,
)

from ._adapters import adapter_folder
from ._sync import UpdateReport, WeightUpdater
from ._torch import (
    LoadReport,
    commit_module,
    load_module,
    shard,
    shard_bounds,
    shard_state_dict,
)

__all__ = [
    "adapter_folder",
    "INDEX_NAME",
    "LAYOUT_KEY",
    "MAX_HEADER_SIZE",
    "SAFETENSORS_DTYPES",
    "LoadReport",
    "UpdateReport",
    "WeightUpdater",
    "commit_module",
    "export_safetensors",
    "import_safetensors",
    "load_module",
    "shard",
    "shard_bounds",
    "shard_state_dict",
]
