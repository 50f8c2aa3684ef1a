"""What a router keeps of each instance, and the views a routing policy is handed.

:class:`LoadTracker` is the router's bookkeeping of one instance's load: the
simulator keeps one per instance, and so does a live router.

Each node's tensordb KV namespace summarises itself for routers: ``db.kv(...).stats()``
returns a :class:`tensordb.KVNodeSummary` (a Bloom filter of the block keys the node
holds, block and byte counts, capacity, hit and eviction counters). A routing policy
sees a :class:`ClusterView`: per instance the prompt tokens whose KV it holds, its
queued and running tokens, their EWMA, and when it last served the session.
:func:`cluster_view` joins the two:

* ``prefix_hits`` comes from the summaries: the leading block keys of the request's
  prompt each node holds, times the block size;
* the load comes from the router's own :class:`LoadTracker` per instance: a KV store
  does not know what is queued on an engine (its summary's ``load`` is how full its
  memory is, which no routing policy here reads).

The Bloom filter has about 1 % false positives, so a summary can overstate a prefix
by a block now and then (never understate it). A summary is a snapshot: ``stats()``
also writes the namespace's size to the catalog, so a router polls it every so often,
not once per request.

Example, a router over engines that each keep their KV in their own node's store::

    summaries = [kv.stats() for kv in per_node_kv]        # every few seconds
    for t in trackers:
        t.advance(now, tau)
    view = cluster_view(summaries, request.block_keys, time=now, loads=trackers,
                        session=request.session)
    decision = policy.route(request, view)
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from typing import Protocol, runtime_checkable

from tensordb.errors import InvalidInput

from ._policy import ClusterView, InstanceState

__all__ = ["BlockSummary", "LoadTracker", "cluster_view", "instance_state"]


class LoadTracker:
    """The router's bookkeeping of one instance: queued and running tokens, their
    EWMA, and when it last served each session. The simulator keeps one per instance,
    and so does a live router (the toy engine's, or one over real engines with
    :func:`cluster_view`): it adds a request's uncached tokens to ``queued`` when it
    routes it and takes them off when its prefill ends. Not thread-safe."""

    __slots__ = ("queued", "running", "ewma", "ewma_t", "seen")

    def __init__(self) -> None:
        self.queued = 0
        self.running = 0
        self.ewma = 0.0
        self.ewma_t = 0.0
        self.seen: dict[Hashable, float] = {}

    def advance(self, now: float, tau: float) -> None:
        """Bring the EWMA of load up to ``now`` (load was constant since ewma_t)."""
        dt = now - self.ewma_t
        if dt > 0:
            load = self.queued + self.running
            self.ewma = load + (self.ewma - load) * math.exp(-dt / tau)
            self.ewma_t = now

    def state(self, instance: int, prefix_hits: int, session: Hashable) -> InstanceState:
        """What a routing policy sees of this instance for a request of ``session``."""
        return InstanceState(instance, prefix_hits, self.queued, self.running, self.ewma,
                             self.seen.get(session))


@runtime_checkable
class BlockSummary(Protocol):
    """What :func:`cluster_view` reads of a node's summary of the KV blocks it holds:
    their size in tokens and how many leading keys of a prompt it holds.
    :class:`tensordb.KVNodeSummary` is one."""

    @property
    def block_tokens(self) -> int: ...

    def prefix_hits(self, keys: Sequence[bytes]) -> int: ...


def instance_state(instance: int, summary: BlockSummary, keys: Sequence[bytes], *,
                   load: LoadTracker | None = None,
                   session: Hashable = None) -> InstanceState:
    """What a routing policy sees of instance ``instance`` for a prompt of block ``keys``:
    ``summary``'s prefix of them in tokens, and ``load``'s queued and running tokens,
    EWMA and last sight of ``session`` (all zero / never without ``load``)."""
    hits = summary.prefix_hits(keys) * summary.block_tokens
    if load is None:
        return InstanceState(instance, hits)
    return load.state(instance, hits, session)


def cluster_view(summaries: Sequence[BlockSummary], keys: Sequence[bytes], *,
                 time: float = 0.0, loads: Sequence[LoadTracker] | None = None,
                 session: Hashable = None) -> ClusterView:
    """The view a routing policy routes a request by: instance ``i`` is ``summaries[i]`` (its
    node's summary of one namespace, the same model on every node) with the load of
    ``loads[i]`` (brought up to ``time`` by the caller: ``advance``). ``keys``: the
    request's full-block keys, as the engines' KV connectors compute them. Raises
    InvalidInput for no summaries, summaries of different block sizes, or a load per
    instance missing."""
    if not summaries:
        raise InvalidInput("a cluster view needs at least one node's summary")
    bt = summaries[0].block_tokens
    for i, s in enumerate(summaries):
        if s.block_tokens != bt:
            raise InvalidInput(f"summary {i} counts blocks of {s.block_tokens} tokens, "
                               f"summary 0 of {bt}: one view covers one KV layout")
    if loads is not None and len(loads) != len(summaries):
        raise InvalidInput(f"{len(loads)} load trackers for {len(summaries)} summaries")
    return ClusterView(tuple(
        instance_state(i, s, keys, load=None if loads is None else loads[i],
                       session=session)
        for i, s in enumerate(summaries)), time, bt)
