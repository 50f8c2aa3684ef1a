"""tensordb in SGLang: weights from a collection, at start and in place.

* ``update_weights_from_tensordb(engine, store, collection, version)`` loads a version
  into a running engine through SGLang's tensor update path (pull: each scheduler reads
  the store itself, when the server runs with ``--custom-weight-loader
  engine_bindings.sglang.tensordb_weight_loader``; push: buckets of tensors otherwise).
* ``TensorDBModelLoader``: ``sglang.Engine(..., load_format=TensorDBModelLoader,
  model_loader_extra_config='{"collection": "llama"}')`` loads the model from the store.
"""

from __future__ import annotations

from ._weights import (
    PULL_LOADER,
    TensorDBModelLoader,
    tensordb_weight_loader,
    update_weights_from_tensordb,
)

__all__ = [
    "PULL_LOADER",
    "TensorDBModelLoader",
    "tensordb_weight_loader",
    "update_weights_from_tensordb",
]
