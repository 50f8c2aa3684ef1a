"""Programmable routing: policies that send requests to where their KV is.

A policy is one subclass of :class:`RoutingPolicy`; defining it registers it by name::

    from engine_bindings.router import Decision, RoutingPolicy, get_policy, simulate

    class ShortestQueue(RoutingPolicy):
        name = "shortest_queue"

        def route(self, request, view):
            return Decision(min(view.instances, key=lambda s: s.queued_tokens).instance)

    simulate(requests, get_policy("shortest_queue"), instances=4)

Built in: ``round_robin``, ``least_load`` (the load-aware baseline), ``cache_aware``
(prefix affinity with load-balance thresholds, as SGLang's router) and ``migrate``
(moves KV off an overloaded instance). The simulator (:func:`simulate`) and the
workload generator (:func:`generate`, :func:`read_trace`) need nothing but numpy.

The real engine runs the same policies over engine processes that prefill for real
with their KV in tensordb (imported on first use: they need torch)::

    from engine_bindings.router import Cluster, EngineConfig, calibrate

    with Cluster(3, EngineConfig()) as cluster:       # 3 engine processes, one store
        costs, _ = calibrate(cluster)                  # the simulator's costs, measured
        real = cluster.run(requests, "cache_aware")    # wall-clock arrivals, real TTFT
        sim = simulate(requests, "cache_aware", instances=3, costs=costs,
                       cache_output=False)
"""

from __future__ import annotations

import importlib
from typing import Any

from ._policies import CacheAware, LeastLoad, MigrateWhenImbalanced, RoundRobin, scaled_policy
from ._policy import (
    SHARED_PREFIX,
    ClusterView,
    Decision,
    InstanceState,
    Request,
    RoutingPolicy,
    available_policies,
    get_policy,
)
from ._sim import BlockCache, Costs, RequestRecord, SimResult, saturation_rate, simulate
from ._workload import GAP_MEDIANS, WorkloadConfig, generate, read_trace, write_trace

# the real engine needs torch: its names load on first use
_LAZY = {
    "Cluster": "._cluster", "PromptTokens": "._cluster",
    "Engine": "._engine", "EngineConfig": "._engine", "Job": "._engine",
    "LocalCache": "._engine", "Served": "._engine",
    "ModelConfig": "._model", "TinyDecoder": "._model",
    "calibrate": "._calibrate", "fit_costs": "._calibrate", "fit_records": "._calibrate",
    "fit_under_load": "._calibrate",
    "measure_engine": "._calibrate", "recalibrate": "._calibrate",
}


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(mod, __name__), name)
    globals()[name] = value
    return value


__all__ = [
    "GAP_MEDIANS",
    "SHARED_PREFIX",
    "BlockCache",
    "CacheAware",
    "Cluster",
    "ClusterView",
    "Costs",
    "Decision",
    "Engine",
    "EngineConfig",
    "InstanceState",
    "Job",
    "LocalCache",
    "ModelConfig",
    "PromptTokens",
    "LeastLoad",
    "MigrateWhenImbalanced",
    "Request",
    "RequestRecord",
    "RoundRobin",
    "RoutingPolicy",
    "Served",
    "SimResult",
    "TinyDecoder",
    "WorkloadConfig",
    "available_policies",
    "calibrate",
    "fit_costs",
    "fit_records",
    "fit_under_load",
    "generate",
    "get_policy",
    "measure_engine",
    "read_trace",
    "recalibrate",
    "saturation_rate",
    "scaled_policy",
    "simulate",
    "write_trace",
]
