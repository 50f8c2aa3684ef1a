"""Real engines behind the router: vLLM's CPU build, one engine process per instance,
each with its prefix cache (the instance's local cache) and ``TensorDBConnector`` on
one shared store, to calibrate the routing simulator against and to compare the
routing policies on.

:class:`VLLMCluster` runs N of them behind the router of
``benchmarks.toy_engine.EngineCluster`` (the toy engine's: the same routing policies,
live views, records and calibration)::

    from benchmarks.toy_engine import calibrate
    from benchmarks.vllm_engine import ThroughStore, VLLMCluster, VLLMEngineConfig

    with VLLMCluster(2, VLLMEngineConfig()) as cluster:   # 2 vLLM processes, one store
        costs, _ = calibrate(cluster)
        real = cluster.run(requests, ThroughStore("cache_aware"))

What the policies see of an engine is vLLM's own: its KV cache events (the blocks its
prefix cache holds) in the router's keys, and the router's count of the tokens it
queued there. A migration is a load from the store (:class:`ThroughStore`). It is a
harness, not product; ``benchmarks/routing.py --engine vllm`` runs it and
docs/routing.md describes it. Importing it needs no vLLM; :func:`why_not` says whether
vLLM's CPU build runs here.
"""

from __future__ import annotations

from ._cluster import ThroughStore, VLLMCluster
from ._engine import VLLMEngine, VLLMEngineConfig, why_not, write_model
from ._instance import vllm_instance_main

__all__ = ["ThroughStore", "VLLMCluster", "VLLMEngine", "VLLMEngineConfig",
           "vllm_instance_main", "why_not", "write_model"]
