"""tensordb in vLLM: a model loader, a worker extension and a KV connector.

* ``--load-format tensordb`` with ``--model-loader-extra-config
  '{"collection": "llama", "home": "/var/lib/tensordb"}'`` loads the model's weights from
  a version of a collection (``TensorDBModelLoader``).
* ``--worker-extension-cls engine_bindings.vllm.TensorDBWorkerExtension`` adds
  ``update_weights_from_tensordb(collection, version=None, tag=None)``, called on every
  worker with ``llm.collective_rpc("update_weights_from_tensordb", args=(...))``.
* ``--kv-transfer-config '{"kv_connector": "TensorDBConnector",
  "kv_connector_module_path": "engine_bindings.vllm", "kv_role": "kv_both"}'`` shares
  prefix KV blocks between engines through the store (``TensorDBConnector``).

Importing this package registers the load format in the importing process; vLLM
imports it in each worker when it is named as the worker extension. Without the
extension, make the workers import it through a ``vllm.general_plugins`` entry point
naming ``engine_bindings.vllm:register``.
"""

from __future__ import annotations

from ._kv_connector import (
    CONNECTOR_NAME,
    KVLoad,
    KVSave,
    TensorDBConnector,
    TensorDBConnectorMetadata,
    kv_transfer_config,
)
from ._loader import LOAD_FORMAT, LoadSource, TensorDBModelLoader, parallel_ranks, register
from ._worker import TensorDBWorkerExtension

__all__ = [
    "CONNECTOR_NAME",
    "KVLoad",
    "KVSave",
    "LOAD_FORMAT",
    "LoadSource",
    "TensorDBConnector",
    "TensorDBConnectorMetadata",
    "TensorDBModelLoader",
    "TensorDBWorkerExtension",
    "kv_transfer_config",
    "parallel_ranks",
    "register",
]

register()
