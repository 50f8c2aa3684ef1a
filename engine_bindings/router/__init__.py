"""Programmable routing: routing policies that send requests to where their KV is.

A routing policy is one subclass of :class:`RoutingPolicy`; defining it registers it
by name::

    from engine_bindings.router import Decision, RoutingPolicy, get_policy, simulate

    class ShortestQueue(RoutingPolicy):
        name = "shortest_queue"

        def route(self, request, view):
            return Decision(min(view.instances, key=lambda s: s.queued_tokens).instance)

    simulate(requests, get_policy("shortest_queue"), instances=4)

Built in: ``round_robin``, ``least_load`` (the load-aware baseline), ``cache_aware``
(prefix affinity with load-balance thresholds, as SGLang's router) and ``migrate``
(moves KV off an overloaded instance). To evaluate one on your own trace:
:func:`read_trace` (or :func:`generate` for a seeded agent workload), then
:func:`simulate` and :meth:`SimResult.summary`. A router over live engines builds its
views from the nodes' ``tensordb.KVNodeSummary`` with :func:`cluster_view`, or follows a
namespace's KV events (the stream external KV-aware routers read) with
:class:`KVEventIndex`.

The harness that calibrates the simulator against engine processes that prefill for
real (a toy engine) lives in ``benchmarks/toy_engine``; docs/routing.md covers both.
"""

from __future__ import annotations

from ._events import KVEventIndex
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
from ._views import BlockSummary, LoadTracker, cluster_view, instance_state
from ._workload import GAP_MEDIANS, WorkloadConfig, generate, read_trace, write_trace

__all__ = [
    "KVEventIndex",
    "GAP_MEDIANS",
    "SHARED_PREFIX",
    "BlockCache",
    "BlockSummary",
    "CacheAware",
    "ClusterView",
    "Costs",
    "Decision",
    "InstanceState",
    "LeastLoad",
    "LoadTracker",
    "MigrateWhenImbalanced",
    "Request",
    "RequestRecord",
    "RoundRobin",
    "RoutingPolicy",
    "SimResult",
    "WorkloadConfig",
    "available_policies",
    "cluster_view",
    "generate",
    "get_policy",
    "instance_state",
    "read_trace",
    "saturation_rate",
    "scaled_policy",
    "simulate",
    "write_trace",
]
