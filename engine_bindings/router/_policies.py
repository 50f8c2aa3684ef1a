"""The built-in routing policies.

* ``round_robin``: instances in turn, blind to cache and load;
* ``least_load``: the load-aware baseline, fewest queued + running tokens;
* ``cache_aware``: prefix affinity with load-balance thresholds, after SGLang's
  cache-aware router;
* ``migrate``: prefix affinity on an EWMA of load that, when the instance holding the
  prefix is overloaded, routes to a less-loaded instance and moves the KV there.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from typing import Any

from tensordb.errors import InvalidInput

from ._policy import ClusterView, Decision, InstanceState, Request, RoutingPolicy, get_policy

__all__ = ["CacheAware", "LeastLoad", "MigrateWhenImbalanced", "RoundRobin", "scaled_policy"]


def _imbalanced(high: float, low: float, abs_gap: float, rel_gap: float) -> bool:
    """Both gaps pass: ``high - low > abs_gap`` and ``high > rel_gap * low``."""
    return high - low > abs_gap and high > rel_gap * low


class RoundRobin(RoutingPolicy):
    """Instance 0, 1, ..., n-1, 0, ... in arrival order."""

    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def route(self, request: Request, view: ClusterView) -> Decision:
        i = self._next % len(view.instances)
        self._next = i + 1
        return Decision(i)

    def reset(self) -> None:
        self._next = 0


class LeastLoad(RoutingPolicy):
    """The instance with the fewest queued + running tokens (ties: lowest id). This is
    the load-aware baseline: it ignores where KV is."""

    name = "least_load"

    def route(self, request: Request, view: ClusterView) -> Decision:
        return Decision(view.least_loaded().instance)


class CacheAware(RoutingPolicy):
    """Prefix affinity with load-balance thresholds, as SGLang's cache-aware router.

    If the cluster is imbalanced (``max load - min load > balance_abs_threshold`` and
    ``max load > balance_rel_threshold * min load``, loads in tokens), the least-loaded
    instance. Otherwise the instance with the longest prefix match, unless its match
    covers no more than ``cache_threshold`` of the prompt: then the least-loaded one.

    SGLang counts load in requests; here it is tokens, running ones included (a decoding
    agent turn holds ~10k), so the absolute threshold is a few dozen requests' worth.
    """

    name = "cache_aware"

    def __init__(self, cache_threshold: float = 0.3, balance_abs_threshold: float = 262_144,
                 balance_rel_threshold: float = 1.5) -> None:
        if not 0.0 <= cache_threshold <= 1.0:
            raise InvalidInput(f"cache_threshold must be in [0, 1], got {cache_threshold}")
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold

    def route(self, request: Request, view: ClusterView) -> Decision:
        insts = view.instances
        loads = [s.load for s in insts]
        if _imbalanced(max(loads), min(loads), self.balance_abs_threshold,
                       self.balance_rel_threshold):
            return Decision(view.least_loaded().instance)
        best = view.best_prefix()
        if best.prefix_hits > self.cache_threshold * request.input_tokens:
            return Decision(best.instance)
        return Decision(view.least_loaded().instance)


class MigrateWhenImbalanced(RoutingPolicy):
    """Prefix affinity that moves KV off an overloaded instance.

    The *holder* is the instance with the longest prefix match. If no instance holds more
    of the prompt than the others (a new session: only the shared system prompt), the
    least-loaded instance. If the holder's ``load_ewma`` exceeds the least-loaded
    instance's by both ``abs_gap`` tokens and a factor ``rel_gap``, each instance that
    the holder outweighs by both gaps is a candidate, scored::

        w_cache  * prefix_hits / input_tokens                (KV it already holds)
      + w_recent * exp(-(now - last_seen) / recent_horizon)  (served this session lately)
      - w_load   * load_ewma / holder's load_ewma
      - w_repeat * exp(-(now - last migration of this session) / repeat_horizon)

    and the holder itself is scored the same way without the repeat penalty. If a
    candidate wins, the request goes there with a migration of the holder's blocks;
    otherwise it stays on the holder.
    """

    name = "migrate"

    def __init__(self, abs_gap: float = 16_384, rel_gap: float = 1.5, w_cache: float = 1.0,
                 w_recent: float = 0.25, recent_horizon: float = 60.0, w_load: float = 1.0,
                 w_repeat: float = 1.0, repeat_horizon: float = 120.0) -> None:
        if abs_gap < 0 or rel_gap < 1.0:
            raise InvalidInput(f"abs_gap must be >= 0 and rel_gap >= 1, got {abs_gap}, "
                               f"{rel_gap}")
        self.abs_gap = abs_gap
        self.rel_gap = rel_gap
        self.w_cache = w_cache
        self.w_recent = w_recent
        self.recent_horizon = recent_horizon
        self.w_load = w_load
        self.w_repeat = w_repeat
        self.repeat_horizon = repeat_horizon
        self._migrated: dict[Hashable, float] = {}

    def reset(self) -> None:
        self._migrated.clear()

    def _score(self, s: InstanceState, request: Request, now: float, ref_load: float) -> float:
        score = self.w_cache * s.prefix_hits / request.input_tokens
        if s.last_seen is not None:
            score += self.w_recent * math.exp(-(now - s.last_seen) / self.recent_horizon)
        return score - self.w_load * s.load_ewma / ref_load

    def route(self, request: Request, view: ClusterView) -> Decision:
        insts = view.instances
        holder = view.best_prefix()
        if holder.prefix_hits <= min(s.prefix_hits for s in insts):
            return Decision(view.least_loaded().instance)
        low = view.least_loaded("load_ewma")
        if not _imbalanced(holder.load_ewma, low.load_ewma, self.abs_gap, self.rel_gap):
            return Decision(holder.instance)
        now = view.time
        ref = max(holder.load_ewma, 1e-9)
        best, best_score = holder, self._score(holder, request, now, ref)
        last = self._migrated.get(request.session)
        repeat = (self.w_repeat * math.exp(-(now - last) / self.repeat_horizon)
                  if last is not None else 0.0)
        for s in insts:
            if s is holder or not _imbalanced(holder.load_ewma, s.load_ewma, self.abs_gap,
                                              self.rel_gap):
                continue
            score = self._score(s, request, now, ref) - repeat
            if score > best_score:
                best, best_score = s, score
        if best is holder:
            return Decision(holder.instance)
        self._migrated[request.session] = now
        if best.prefix_hits >= holder.prefix_hits:
            return Decision(best.instance)
        return Decision(best.instance, migrate_from=holder.instance)


def scaled_policy(name: str, system_prompt_tokens: int = 4096, gap_median: float = 8.2,
                  **kw: Any) -> RoutingPolicy:
    """Routing policy ``name`` with its thresholds scaled to a workload: the built-ins'
    defaults are set for a 4,096-token system prompt (token gaps of a few requests'
    worth of load) and 8.2 s between a session's turns (time horizons); a workload of
    shorter prompts and turns needs them as much smaller. ``kw`` goes to the routing
    policy as is. Pair it with an EWMA time constant scaled the same way: ``5 * gap_median /
    8.2`` seconds."""
    tokens, time_ = system_prompt_tokens / 4096, gap_median / 8.2
    if name == "cache_aware":
        kw.setdefault("balance_abs_threshold", 262_144 * tokens)
    elif name == "migrate":
        kw.setdefault("abs_gap", 16_384 * tokens)
        kw.setdefault("recent_horizon", 60.0 * time_)
        kw.setdefault("repeat_horizon", 120.0 * time_)
    return get_policy(name, **kw)
