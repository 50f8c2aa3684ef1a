"""tensordb in vLLM: a model loader and a worker extension.

* ``--load-format tensordb`` with ``--model-loader-extra-config
  '{"collection": "llama", "home": "/var/lib/tensordb"}'`` loads the model's weights from
  a version of a collection (``TensorDBModelLoader``).
* ``--worker-extension-cls engine_bindings.vllm.TensorDBWorkerExtension`` adds
  ``update_weights_from_tensordb(collection, version=None, tag=None)``, called on every
  worker with ``llm.collective_rpc("update_weights_from_tensordb", args=(...))``.

Importing this package registers the load format in the importing process; vLLM
imports it in each worker when it is named as the worker extension. Without the
extension, make the workers import it through a ``vllm.general_plugins`` entry point
naming ``engine_bindings.vllm:register``.
"""

from __future__ import annotations

from ._loader import LOAD_FORMAT, LoadSource, TensorDBModelLoader, parallel_ranks, register
from ._worker import TensorDBWorkerExtension

__all__ = [
    "LOAD_FORMAT",
    "LoadSource",
    "TensorDBModelLoader",
    "TensorDBWorkerExtension",
    "parallel_ranks",
    "register",
]

register()
