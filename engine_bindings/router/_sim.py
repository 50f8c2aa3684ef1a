"""A discrete-event simulator of N serving instances, driven by the routing policies.

Each instance runs prefills one at a time from a FIFO queue and keeps a bounded LRU
cache of KV blocks; decoding runs beside prefill (continuous batching) and only holds
KV. With ``shared_store`` every block an instance computes is also published to a shared
tier (the tensordb KV store), from which any instance can load a block it lacks.

A request's time to first token is::

    TTFT = dispatch_latency (the router's hand-off: it delays the request but does
                              not occupy the instance)
         + wait (queue; a migration's transfer overlaps it)
         + request_overhead
         + hit_per_block     * blocks in the instance's cache (or migrated there)
         + kv_load_per_block * further blocks loaded from the shared store
         + prefill_per_token * the remaining (uncached) prompt tokens
         + prefill_per_token_ctx * the attention pairs of those tokens (each new token
           with every token before it, cached or not)

and the instance stays busy ``request_tail`` after the first token (saving the new
blocks, bookkeeping): the next request in its queue starts that much later, but the
request's own TTFT does not include it.

With ``contention`` set, instances share the host's CPU (processor sharing): while
``k`` prefills run, each advances at ``1 / (1 + contention * (k - 1))`` of its own
speed, re-timed whenever one starts or ends.

The defaults are a model whose prefill is linear in the tokens it computes; the costs
fitted on the toy engine (``benchmarks.toy_engine.calibrate``, see docs/routing.md)
fill in all the terms.

Hits are taken when the prefill starts, against the cache as it is then. Blocks are
grouped into chains (the shared system prompt; a session's own context): a request
reads a prefix of each, and all blocks a request touches get the same recency, ties
evicted tail first (vLLM's free-queue order). So an instance's LRU over blocks is kept
exactly as one entry per chain with a count of its leading blocks, which is what makes
thousands of sessions run in seconds.

Events at the same instant run in this order: prefill ends, decode ends, transfers end,
tails end, then arrivals; arrivals in the order given. Nothing is random: a run is a
function of its inputs.
"""

from __future__ import annotations

import heapq
import math
import statistics
from collections import OrderedDict, deque
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tensordb.errors import InvalidInput

from ._policy import Chain, ClusterView, Decision, Request, RoutingPolicy, get_policy
from ._views import LoadTracker

__all__ = ["BlockCache", "Costs", "RequestRecord", "SimResult", "saturation_rate",
           "simulate"]


@dataclass(frozen=True, slots=True)
class Costs:
    """Seconds per unit of work. The defaults are a small decoder on CPU: prefill
    0.2 ms/token, so a 256-token block costs 51 ms to compute against 2 ms to load from
    the store and 4 ms to move between instances."""

    prefill_per_token: float = 2e-4
    kv_load_per_block: float = 2e-3     # from the shared store into an instance
    transfer_per_block: float = 4e-3    # from one instance to another (migration)
    decode_per_token: float = 5e-3
    block_tokens: int = 256
    cache_capacity_blocks: int = 8192   # per instance
    hit_per_block: float = 0.0          # a block already in the instance's cache
    prefill_per_token_ctx: float = 0.0  # per (new token, token before it) pair: attention
    request_overhead: float = 0.0       # per prefill, whatever its length
    contention: float = 0.0             # service stretch per other instance prefilling
    dispatch_latency: float = 0.0       # router -> instance hand-off; not busy time
    request_tail: float = 0.0           # busy after the first token; not in its TTFT

    def __post_init__(self) -> None:
        if self.block_tokens < 1 or self.cache_capacity_blocks < 0:
            raise InvalidInput(f"block_tokens must be >= 1 and cache_capacity_blocks >= 0, "
                               f"got {self.block_tokens}, {self.cache_capacity_blocks}")
        for name in ("prefill_per_token", "kv_load_per_block", "transfer_per_block",
                     "decode_per_token", "hit_per_block", "prefill_per_token_ctx",
                     "request_overhead", "contention", "dispatch_latency", "request_tail"):
            v = getattr(self, name)
            if not v >= 0 or math.isinf(v):
                raise InvalidInput(f"cost {name} must be a finite number >= 0, got {v}")

    def prefill(self, cached_tokens: int, new_tokens: int) -> float:
        """Seconds to compute ``new_tokens`` after ``cached_tokens`` whose KV is at hand
        (no per-block load costs)."""
        pairs = new_tokens * cached_tokens + new_tokens * (new_tokens + 1) / 2
        return (self.request_overhead + self.prefill_per_token * new_tokens
                + self.prefill_per_token_ctx * pairs)

    def service(self, prompt_tokens: int, hit_blocks: int, loaded_blocks: int) -> float:
        """Seconds an instance is busy with a prefill of ``prompt_tokens`` whose first
        ``hit_blocks`` blocks it holds and next ``loaded_blocks`` it loads from the
        store."""
        cached = (hit_blocks + loaded_blocks) * self.block_tokens
        return (self.hit_per_block * hit_blocks + self.kv_load_per_block * loaded_blocks
                + self.prefill(cached, prompt_tokens - cached))


class BlockCache:
    """A bounded LRU of KV blocks kept as ``chain id -> leading blocks held``.

    ``capacity`` None: unbounded (the shared store)."""

    __slots__ = ("capacity", "used", "_chains")

    def __init__(self, capacity: int | None) -> None:
        self.capacity = capacity
        self.used = 0
        self._chains: OrderedDict[Hashable, int] = OrderedDict()

    def held(self, cid: Hashable) -> int:
        return self._chains.get(cid, 0)

    def match(self, chain: Chain) -> int:
        """How many leading blocks of ``chain`` are held."""
        n = 0
        get = self._chains.get
        for cid, count in chain:
            have = get(cid, 0)
            if have < count:
                return n + have
            n += count
        return n

    def touch(self, chain: Chain) -> None:
        """Hold all of ``chain`` as most recently used, evicting the least recent
        blocks beyond capacity (never ``chain``'s own, unless it alone is too big)."""
        d = self._chains
        for cid, count in chain:
            have = d.get(cid)
            if have is None:
                d[cid] = count
                self.used += count
            else:
                if count > have:
                    d[cid] = count
                    self.used += count - have
                d.move_to_end(cid)
        cap = self.capacity
        if cap is None or self.used <= cap:
            return
        touched = {cid for cid, _ in chain}
        while self.used > cap:
            cid = next(iter(d))
            if cid in touched:  # the request alone overflows: cut its own tail
                cid = next(reversed(d))
            n = d[cid]
            excess = self.used - cap
            if n <= excess:
                del d[cid]
                self.used -= n
            else:
                d[cid] = n - excess
                self.used -= excess


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """What happened to one request. Times in seconds; ``cached_tokens`` were in the
    instance's cache or migrated there, ``loaded_tokens`` came from the shared store."""

    session: Hashable
    turn: int
    arrival: float
    instance: int
    start: float
    ttft: float
    prompt_tokens: int
    cached_tokens: int
    loaded_tokens: int
    migrated_blocks: int
    queue: float = 0.0    # of ttft: waiting (for the instance, or a migration's transfer)
    kv_load: float = 0.0  # of ttft: taking cached blocks and loading the store's
    prefill: float = 0.0  # of ttft: computing the rest and the first token


@dataclass(slots=True)
class SimResult:
    policy: str
    records: list[RequestRecord] = field(default_factory=list)

    def ttfts(self) -> np.ndarray:
        return np.fromiter((r.ttft for r in self.records), dtype=np.float64,
                           count=len(self.records))

    def summary(self) -> dict[str, Any]:
        """Median / p90 / p99 TTFT (s), hit rate ((cached + loaded) / prompt tokens),
        local hit rate (cached / prompt), migrations and blocks migrated."""
        t = self.ttfts()
        prompt = sum(r.prompt_tokens for r in self.records) or 1
        cached = sum(r.cached_tokens for r in self.records)
        loaded = sum(r.loaded_tokens for r in self.records)
        q = (np.percentile(t, [50, 90, 99]) if len(t) else np.zeros(3)).tolist()
        return {
            "policy": self.policy,
            "requests": len(self.records),
            "ttft_median": q[0], "ttft_p90": q[1], "ttft_p99": q[2],
            "ttft_mean": float(t.mean()) if len(t) else 0.0,
            "hit_rate": (cached + loaded) / prompt,
            "local_hit_rate": cached / prompt,
            "migrations": sum(1 for r in self.records if r.migrated_blocks),
            "migrated_blocks": sum(r.migrated_blocks for r in self.records),
        }

    @staticmethod
    def median_summary(summaries: Sequence[dict[str, Any]]) -> dict[str, Any]:
        """Summaries of repeated runs of one workload and routing policy as one: each numeric
        figure is its median over the runs, the rest is the first run's (one run on a
        busy host is off by more than a simulator is held to)."""
        out = dict(summaries[0])
        for k, v in summaries[0].items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                out[k] = statistics.median(r[k] for r in summaries)
        return out


class _Job:
    __slots__ = ("req", "chain", "inst", "est", "ready", "cover", "moved", "index", "left",
                 "live", "started", "work", "kv", "hits")

    def __init__(self, req: Request, chain: Chain, inst: int, est: int, ready: float,
                 cover: int, moved: int, index: int) -> None:
        self.req = req
        self.chain = chain
        self.inst = inst
        self.est = est        # tokens counted in the instance's queued_tokens
        self.ready = ready    # when a migration's transfer has landed
        self.cover = cover    # leading blocks present after that migration
        self.moved = moved
        self.index = index
        # under contention (processor sharing): work left at full speed, the heap entry
        # that is current, when the prefill started, its work and KV part, its hits
        self.left = 0.0
        self.live = 0
        self.started = 0.0
        self.work = 0.0
        self.kv = 0.0
        self.hits = (0, 0)


class _Instance(LoadTracker):
    __slots__ = ("cache", "queue", "busy")

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.cache = BlockCache(capacity)
        self.queue: deque[_Job] = deque()
        self.busy = False


_PREFILL_DONE, _DECODE_DONE, _START, _RELEASE = 0, 1, 2, 3


class _Simulation:
    """One run of :func:`simulate`: the instances, the shared store, the event heap.

    Heap entries are ``(time, kind, seq, job)``: ``kind`` orders events at the same
    instant (see the module doc) and ``seq``, unique, keeps them in push order."""

    def __init__(self, policy: RoutingPolicy, instances: int, costs: Costs,
                 shared_store: bool, ewma_tau: float, cache_output: bool,
                 requests: int) -> None:
        self.pol = policy
        self.n = instances
        self.costs = costs
        self.bt = costs.block_tokens
        self.tau = ewma_tau
        self.cache_output = cache_output
        self.insts = [_Instance(costs.cache_capacity_blocks) for _ in range(instances)]
        self.store = BlockCache(None) if shared_store else None
        self.records: list[RequestRecord | None] = [None] * requests
        self.heap: list[tuple[float, int, int, _Job]] = []
        self.seq = 0
        self.running: list[_Job] = []  # prefills in progress, when they share the CPU
        self.shared_t = 0.0

    def push(self, t: float, kind: int, job: _Job) -> int:
        """Schedule ``kind`` for ``job`` at ``t``; returns the entry's ``seq``."""
        self.seq += 1
        heapq.heappush(self.heap, (t, kind, self.seq, job))
        return self.seq

    def drain(self, until: float = math.inf) -> None:
        """Run every event due by ``until``, in order."""
        heap = self.heap
        while heap and heap[0][0] <= until:
            t, kind, entry, job = heapq.heappop(heap)
            if kind == _START:
                self.start(job, t)
            elif kind == _RELEASE:  # the tail after a first token is over
                self.release(job, t)
            elif kind == _PREFILL_DONE:
                if entry == job.live:  # else re-timed since: a later entry ends it
                    self.prefill_done(job, t)
            else:
                self.decode_done(job, t)

    # -- processor sharing ---------------------------------------------------------------
    def speed(self) -> float:
        return 1.0 / (1.0 + self.costs.contention * max(0, len(self.running) - 1))

    def share(self, now: float, job: _Job | None = None, add: bool = True) -> None:
        """Charge the running prefills for the time since the last change at the speed
        they had, add or remove ``job``, re-time their ends."""
        done = (now - self.shared_t) * self.speed()
        for j in self.running:
            j.left -= done
        self.shared_t = now
        if job is not None:
            (self.running.append if add else self.running.remove)(job)
        sp = self.speed()
        for j in self.running:
            j.live = self.push(now + max(0.0, j.left) / sp, _PREFILL_DONE, j)

    # -- one instance's work -------------------------------------------------------------
    def record(self, job: _Job, start: float, end: float, kv: float) -> None:
        req = job.req
        cover, loaded = job.hits
        bt = self.bt
        self.records[job.index] = RequestRecord(
            req.session, req.turn, req.arrival, job.inst, start, end - req.arrival,
            req.input_tokens, cover * bt, loaded * bt, job.moved, queue=start - req.arrival,
            kv_load=kv, prefill=end - start - kv)

    def start(self, job: _Job, now: float) -> None:
        """The prefill of ``job`` starts: hits are taken against the caches as they are."""
        costs, store = self.costs, self.store
        inst = self.insts[job.inst]
        cover = max(inst.cache.match(job.chain), job.cover)
        loaded = max(0, store.match(job.chain) - cover) if store is not None else 0
        job.hits = (cover, loaded)
        kv = costs.hit_per_block * cover + costs.kv_load_per_block * loaded
        work = costs.service(job.req.input_tokens, cover, loaded)
        inst.cache.touch(job.chain)
        if costs.contention:
            job.started, job.work, job.kv, job.left = now, work, kv, work
            self.share(now, job)
            return
        self.record(job, now, now + work, kv)
        job.live = self.push(now + work, _PREFILL_DONE, job)

    def try_start(self, i: int, now: float) -> None:
        inst = self.insts[i]
        if inst.busy or not inst.queue:
            return
        job = inst.queue.popleft()
        inst.busy = True
        if job.ready > now:
            self.push(job.ready, _START, job)
        else:
            self.start(job, now)

    def release(self, job: _Job, now: float) -> None:
        self.insts[job.inst].busy = False
        self.try_start(job.inst, now)

    def prefill_done(self, job: _Job, now: float) -> None:
        costs = self.costs
        inst = self.insts[job.inst]
        req = job.req
        if costs.contention:
            self.share(now, job, add=False)
            elapsed = now - job.started
            self.record(job, job.started, now,
                        job.kv * elapsed / job.work if job.work else 0.0)
        inst.advance(now, self.tau)
        inst.queued -= job.est
        inst.running += req.input_tokens + req.output_tokens
        if self.store is not None:
            self.store.touch(job.chain)
        self.push(now + costs.decode_per_token * req.output_tokens, _DECODE_DONE, job)
        if costs.request_tail:
            self.push(now + costs.request_tail, _RELEASE, job)
        else:
            self.release(job, now)

    def decode_done(self, job: _Job, now: float) -> None:
        """The output's KV now extends the session's context."""
        inst = self.insts[job.inst]
        req = job.req
        inst.advance(now, self.tau)
        inst.running -= req.input_tokens + req.output_tokens
        if not self.cache_output:
            return
        full = req.chain(self.bt, req.input_tokens + req.output_tokens)
        inst.cache.touch(full)
        if self.store is not None:
            self.store.touch(full)

    # -- the router ----------------------------------------------------------------------
    def route(self, req: Request, chain: Chain, now: float) -> tuple[Decision, list[int]]:
        """The routing policy's decision for ``req`` (checked) and each instance's leading
        blocks of ``chain``."""
        bt = self.bt
        states = []
        matches = []
        for i, inst in enumerate(self.insts):
            inst.advance(now, self.tau)
            m = inst.cache.match(chain)
            matches.append(m)
            states.append(inst.state(i, m * bt, req.session))
        dec = self.pol.route(req, ClusterView(tuple(states), now, bt))
        n = self.n
        if not 0 <= dec.instance < n or (
                dec.migrate_from is not None and not 0 <= dec.migrate_from < n):
            raise InvalidInput(f"policy {self.pol.name!r} chose instance {dec.instance} "
                               f"(migrating from {dec.migrate_from}) of {n}")
        return dec, matches

    def arrive(self, index: int, req: Request) -> None:
        """Run what is due by ``req``'s arrival, route it and queue it."""
        now = req.arrival
        self.drain(now)
        chain = req.chain(self.bt)
        dec, matches = self.route(req, chain, now)
        costs = self.costs
        target = dec.instance
        cover, moved, ready = matches[target], 0, now + costs.dispatch_latency
        if dec.migrate_from is not None:
            moved = max(0, matches[dec.migrate_from] - cover)
            if dec.blocks:
                moved = min(moved, dec.blocks)
            cover += moved
            # the source is told, publishes, the router hears and tells the target,
            # which prefetches: three hand-offs beside the transfer
            ready = now + (3 * costs.dispatch_latency if moved else costs.dispatch_latency) \
                + moved * costs.transfer_per_block
        est = req.input_tokens - cover * self.bt
        inst = self.insts[target]
        inst.queued += est
        inst.seen[req.session] = now
        inst.queue.append(_Job(req, chain, target, est, ready, cover, moved, index))
        self.try_start(target, now)


def simulate(requests: Iterable[Request], policy: str | RoutingPolicy, *, instances: int = 4,
             costs: Costs | None = None, shared_store: bool = True,
             ewma_tau: float = 5.0, cache_output: bool = True) -> SimResult:
    """Run ``requests`` (sorted by arrival) through ``instances`` instances routed by
    ``policy`` (a name or an object; it is ``reset()`` first). Returns a record per
    request, in arrival order. ``cache_output``: the KV of the tokens an instance
    decodes joins its cache (an engine that stops at the first token, as the toy
    engine does, has none). Pure computation: blocks only for the CPU it takes."""
    costs = costs or Costs()
    if instances < 1 or ewma_tau <= 0:
        raise InvalidInput(f"instances must be >= 1 and ewma_tau > 0, got {instances}, "
                           f"{ewma_tau}")
    pol = get_policy(policy)
    pol.reset()
    reqs: Sequence[Request] = requests if isinstance(requests, Sequence) else list(requests)
    sim = _Simulation(pol, instances, costs, shared_store, ewma_tau, cache_output, len(reqs))
    last_arrival = -math.inf
    for index, req in enumerate(reqs):
        if req.arrival < last_arrival:
            raise InvalidInput(f"requests must be sorted by arrival: request {index} "
                               f"(session {req.session!r}) arrives at {req.arrival} after "
                               f"one at {last_arrival}")
        last_arrival = req.arrival
        sim.arrive(index, req)
    sim.drain()
    return SimResult(pol.name, [r for r in sim.records if r is not None])


def saturation_rate(requests: Sequence[Request], costs: Costs | None = None,
                    instances: int = 4, cache_output: bool = True) -> float:
    """Sessions per second at which ``instances`` are fully busy with the work no
    routing policy can avoid: each turn's new tokens (beyond the previous turn's prompt
    and output, and beyond the shared system prompt) prefilled, every reused block a hit
    in the instance's own cache, instances slowed by each other's ``contention``. Past this
    rate every routing policy's queues grow without bound; a load sweep is expressed as
    fractions of it."""
    costs = costs or Costs()
    bt = costs.block_tokens
    prev: dict[tuple[Hashable, int], int] = {}
    work = 0.0
    for r in requests:
        key = (r.session, r.context)
        reused = max(r.shared_prefix_tokens, min(r.input_tokens, prev.get(key, 0))) // bt
        work += costs.service(r.input_tokens, reused, 0)
        prev[key] = r.input_tokens + (r.output_tokens if cache_output else 0)
    sessions = len({r.session for r in requests})
    if not work or not sessions:
        raise InvalidInput("saturation_rate needs a workload with some work in it")
    # instances sharing a CPU do the work of fewer when all are busy
    busy = instances / (1.0 + costs.contention * (instances - 1))
    return busy / (work / sessions)
