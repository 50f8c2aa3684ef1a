"""tensordb in SGLang: weights from a collection, at start and in place; KV pages.

* ``update_weights_from_tensordb(engine, store, collection, version)`` loads a version
  into a running engine through SGLang's tensor update path (pull: each scheduler reads
  the store itself, when the server runs with ``--custom-weight-loader
  engine_bindings.sglang.tensordb_weight_loader``; push: buckets of tensors otherwise),
  all or nothing (``served_version`` names the one version the model serves).
* ``TensorDBModelLoader``: ``sglang.Engine(..., load_format=TensorDBModelLoader,
  model_loader_extra_config='{"collection": "llama"}')`` loads the model from the store.
* ``TensorDBHiCacheStorage``: HiCache's storage tier (``--hicache-storage-backend
  dynamic`` with ``hicache_extra_config()`` as ``--hicache-storage-backend-extra-config``)
  keeps KV pages in the store, shared by every server of the host.
"""

from __future__ import annotations

from ._hicache import BACKEND_NAME, TensorDBHiCacheStorage, hicache_extra_config
from ._weights import (
    PULL_LOADER,
    TensorDBModelLoader,
    served_version,
    tensordb_weight_loader,
    update_weights_from_tensordb,
)

__all__ = [
    "BACKEND_NAME",
    "PULL_LOADER",
    "TensorDBHiCacheStorage",
    "TensorDBModelLoader",
    "hicache_extra_config",
    "served_version",
    "tensordb_weight_loader",
    "update_weights_from_tensordb",
]
