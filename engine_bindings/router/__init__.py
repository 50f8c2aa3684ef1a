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
"""

from __future__ import annotations

from ._policies import CacheAware, LeastLoad, MigrateWhenImbalanced, RoundRobin
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

__all__ = [
    "GAP_MEDIANS",
    "SHARED_PREFIX",
    "BlockCache",
    "CacheAware",
    "ClusterView",
    "Costs",
    "Decision",
    "InstanceState",
    "LeastLoad",
    "MigrateWhenImbalanced",
    "Request",
    "RequestRecord",
    "RoundRobin",
    "RoutingPolicy",
    "SimResult",
    "WorkloadConfig",
    "available_policies",
    "generate",
    "get_policy",
    "read_trace",
    "saturation_rate",
    "simulate",
    "write_trace",
]
