"""The toy engine: engine processes that prefill for real, to calibrate the routing
simulator (``engine_bindings.router.simulate``) against.

A toy engine instance is a process with a tiny decoder (:class:`TinyDecoder`, random
weights from a seed, so every instance computes the same KV), a bounded LRU of KV
blocks in front of the shared tensordb KV store, and a worker that prefills one request
at a time. :class:`ToyCluster` runs N of them behind a router that takes the same
routing policies as the simulator::

    from benchmarks.toy_engine import ToyCluster, ToyEngineConfig, calibrate
    from engine_bindings.router import WorkloadConfig, generate, simulate

    requests = generate(WorkloadConfig.small(sessions=12, rate=2.0))
    with ToyCluster(3, ToyEngineConfig()) as cluster:   # 3 processes, one store
        costs, _ = calibrate(cluster)                    # the simulator's costs, fitted
        real = cluster.run(requests, "cache_aware")      # wall-clock arrivals, real TTFT
    sim = simulate(requests, "cache_aware", instances=3, costs=costs, cache_output=False)

It is a harness, not a product: "engine" alone means vLLM or SGLang. docs/routing.md
says how the calibration works; ``benchmarks/routing.py --engine toy`` runs it.
"""

from __future__ import annotations

from ._calibrate import (
    CONTENTION_GRID,
    PROBE_REPS,
    calibrate,
    dispatch_overhead,
    fit_costs,
    fit_error,
    fit_records,
    fit_under_load,
    recalibrate,
)
from ._cluster import EngineCluster, PromptTokens, ToyCluster
from ._engine import Job, LocalCache, Served, ToyEngine, ToyEngineConfig, clock, open_kv
from ._instance import instance_main, measure_toy_engine
from ._model import ModelConfig, TinyDecoder, split_blocks

__all__ = [
    "CONTENTION_GRID",
    "PROBE_REPS",
    "EngineCluster",
    "Job",
    "LocalCache",
    "ModelConfig",
    "PromptTokens",
    "Served",
    "TinyDecoder",
    "ToyCluster",
    "ToyEngine",
    "ToyEngineConfig",
    "calibrate",
    "clock",
    "dispatch_overhead",
    "fit_costs",
    "fit_error",
    "fit_records",
    "fit_under_load",
    "instance_main",
    "measure_toy_engine",
    "open_kv",
    "recalibrate",
    "split_blocks",
]
