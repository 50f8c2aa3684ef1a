"""tensordb in vLLM: a model loader, a worker extension and a KV connector.

* ``--load-format tensordb`` with ``--model-loader-extra-config
  '{"collection": "llama", "home": "/var/lib/tensordb"}'`` loads the model's weights from
  a version of a collection (``TensorDBModelLoader``).
* ``--worker-extension-cls engine_bindings.vllm.TensorDBWorkerExtension`` adds
  ``update_weights_from_tensordb(collection, version=None, tag=None)``, called on every
  worker with ``llm.collective_rpc("update_weights_from_tensordb", args=(...))``.
* ``weight_transfer_config={"backend": "tensordb"}``: vLLM's weight-transfer flow
  (``init_weight_transfer_engine``, ``start_weight_update``, ``update_weights``,
  ``finish_weight_update``) reads each update from the store
  (``TensorDBWeightTransferEngine``).
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
from ._loader import (
    LOAD_FORMAT,
    WEIGHT_TRANSFER_BACKEND,
    LoadSource,
    TensorDBModelLoader,
    parallel_ranks,
    register,
    register_weight_transfer,
)
from ._lora import TensorDBLoRAResolver, register_lora_resolver
from ._worker import TensorDBWorkerExtension, repacked_parameters

__all__ = [
    "TensorDBLoRAResolver",
    "register_lora_resolver",
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
    "register_weight_transfer",
    "repacked_parameters",
    "WEIGHT_TRANSFER_BACKEND",
]

try:  # vLLM's weight-transfer API (0.32 and later)
    from ._weight_transfer import (
        TensorDBWeightTransferEngine,
        TensorDBWeightTransferInitInfo,
        TensorDBWeightTransferUpdateInfo,
    )
except ImportError:  # an older vLLM: the rest of the binding works without it
    pass
else:
    __all__ += ["TensorDBWeightTransferEngine", "TensorDBWeightTransferInitInfo",
                "TensorDBWeightTransferUpdateInfo"]

register()
