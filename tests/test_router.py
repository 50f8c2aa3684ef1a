"""The router library: routing-policy decisions on hand-built views, a routing policy
plugged in from here, the simulator against hand-computed schedules (its calibrated
terms too), migrations, the workload generator and trace replay, and views built from
the store's own node summaries (tensordb.KVNodeSummary)."""

from __future__ import annotations

import itertools
import json
import math
import statistics
import subprocess
import sys
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import open_store, remove_store

import engine_bindings.router as router
import tensordb
from engine_bindings.router import (
    SHARED_PREFIX,
    BlockCache,
    BlockSummary,
    CacheAware,
    ClusterView,
    Costs,
    Decision,
    InstanceState,
    LeastLoad,
    LoadTracker,
    MigrateWhenImbalanced,
    Request,
    RoundRobin,
    RoutingPolicy,
    WorkloadConfig,
    available_policies,
    cluster_view,
    generate,
    get_policy,
    instance_state,
    read_trace,
    saturation_rate,
    simulate,
    write_trace,
)
from tensordb.errors import InvalidInput, NotFound


def view(*states: tuple[int, int, int] | tuple[int, int, int, float], time: float = 0.0,
         seen: dict[int, float] | None = None) -> ClusterView:
    """Instances from ``(prefix_hits, queued, running[, load_ewma])`` tuples."""
    seen = seen or {}
    return ClusterView(tuple(
        InstanceState(i, s[0], s[1], s[2], float(s[3]) if len(s) > 3 else 0.0,
                      seen.get(i))
        for i, s in enumerate(states)), time)


REQ = Request(session="a", arrival=0.0, input_tokens=10_000, output_tokens=100)


# -- the public surface and the registry --------------------------------------------------
def test_public_surface() -> None:
    assert sorted(router.__all__) == sorted([
        "GAP_MEDIANS", "SHARED_PREFIX", "BlockCache", "CacheAware", "ClusterView", "Costs",
        "Decision", "InstanceState", "LeastLoad", "MigrateWhenImbalanced", "Request",
        "RequestRecord", "RoundRobin", "RoutingPolicy", "SimResult", "WorkloadConfig",
        "available_policies", "generate", "get_policy", "read_trace", "saturation_rate",
        "scaled_policy", "simulate", "write_trace",
        # views from the store's node summaries, and the load bookkeeping beside them
        "BlockSummary", "LoadTracker", "cluster_view", "instance_state",
        # a view of a KV-event stream (a namespace's, or an engine's own)
        "KVEventIndex"])
    for name in router.__all__:
        assert getattr(router, name) is not None
    # the toy engine is a harness in benchmarks/, not the library's
    for name in ("Cluster", "ToyCluster", "Engine", "EngineConfig", "TinyDecoder",
                 "calibrate", "fit_costs", "measure_engine"):
        assert not hasattr(router, name), name


def test_library_and_demo_import_no_toy_engine() -> None:
    """Neither the router library nor the demo (an application layer) loads anything of
    benchmarks/, the toy engine included."""
    code = ("import sys, engine_bindings.router, tensordb._demo; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'benchmarks'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_builtins_registered() -> None:
    names = set(available_policies())
    assert {"round_robin", "least_load", "cache_aware", "migrate"} <= names
    assert isinstance(get_policy("cache_aware", cache_threshold=0.5), CacheAware)
    assert get_policy("cache_aware", cache_threshold=0.5).cache_threshold == 0.5
    with pytest.raises(NotFound, match="no routing policy named 'nope'"):
        get_policy("nope")


def test_name_clash_rejected() -> None:
    with pytest.raises(InvalidInput, match="taken"):
        class Clash(RoutingPolicy):  # noqa: F841
            name = "least_load"

            def route(self, request: Request, view: ClusterView) -> Decision:
                return Decision(0)


def test_decision_validated() -> None:
    with pytest.raises(InvalidInput):
        Decision(1, migrate_from=1)
    with pytest.raises(InvalidInput):
        Decision(1, blocks=-1)
    with pytest.raises(InvalidInput):
        ClusterView((InstanceState(1),))


# -- built-in policies on hand-built views -------------------------------------------------
def test_round_robin() -> None:
    p = RoundRobin()
    v = view((0, 0, 0), (0, 0, 0), (0, 0, 0))
    assert [p.route(REQ, v).instance for _ in range(5)] == [0, 1, 2, 0, 1]
    p.reset()
    assert p.route(REQ, v).instance == 0


def test_least_load() -> None:
    p = LeastLoad()
    assert p.route(REQ, view((9000, 500, 500), (0, 100, 800), (0, 300, 0))).instance == 2
    assert p.route(REQ, view((0, 10, 0), (0, 0, 10))).instance == 0  # tie: lowest id


def test_cache_aware_prefers_longest_prefix_when_balanced() -> None:
    p = CacheAware(cache_threshold=0.3, balance_abs_threshold=1000, balance_rel_threshold=1.5)
    # loads 1500 / 1000 / 1200: gap 500 <= 1000, so balanced: the longest prefix wins
    d = p.route(REQ, view((2000, 1500, 0), (8000, 1000, 500), (0, 1200, 0)))
    assert d == Decision(1)


def test_cache_aware_shortest_queue_when_imbalanced() -> None:
    p = CacheAware(cache_threshold=0.3, balance_abs_threshold=1000, balance_rel_threshold=1.5)
    # loads 5000 / 1000: gap 4000 > 1000 and 5000 > 1.5 * 1000: imbalanced
    assert p.route(REQ, view((8000, 5000, 0), (0, 1000, 0))) == Decision(1)
    # the absolute gap passes but not the relative one: still affinity
    assert p.route(REQ, view((8000, 15000, 0), (0, 11000, 0))) == Decision(0)
    # the relative gap passes but not the absolute one: still affinity
    assert p.route(REQ, view((8000, 900, 0), (0, 100, 0))) == Decision(0)


def test_cache_aware_falls_back_below_cache_threshold() -> None:
    p = CacheAware(cache_threshold=0.3, balance_abs_threshold=1000, balance_rel_threshold=1.5)
    # best match 3000 of 10000 tokens is not above 30%: least load
    assert p.route(REQ, view((3000, 900, 0), (0, 400, 0), (0, 600, 0))) == Decision(1)
    assert p.route(REQ, view((3001, 900, 0), (0, 400, 0), (0, 600, 0))) == Decision(0)


def test_migrate_new_session_goes_to_least_loaded() -> None:
    p = MigrateWhenImbalanced()
    # every instance holds the shared system prompt only
    assert p.route(REQ, view((4096, 900, 0, 0), (4096, 100, 0, 0), (4096, 500, 0, 0))) \
        == Decision(1)


def test_migrate_stays_when_gaps_not_both_passed() -> None:
    p = MigrateWhenImbalanced(abs_gap=20_000, rel_gap=1.5)
    # EWMA 100k vs 90k: relative gap fails
    assert p.route(REQ, view((8000, 0, 0, 100_000), (0, 0, 0, 90_000))) == Decision(0)
    # EWMA 30k vs 15k: absolute gap (15k) fails
    assert p.route(REQ, view((8000, 0, 0, 30_000), (0, 0, 0, 15_000))) == Decision(0)


def test_migrate_moves_kv_off_overloaded_holder() -> None:
    p = MigrateWhenImbalanced(abs_gap=20_000, rel_gap=1.5, w_cache=1.0, w_recent=0.0,
                              w_load=1.0, w_repeat=1.0, repeat_horizon=100.0)
    # holder: 0.8 - 1.0 = -0.2; instance 1: 0 - 0.1 = -0.1; instance 2: 0 - 0.5 = -0.5;
    # instance 3 is not a candidate (gaps to the holder fail)
    v = view((8000, 0, 0, 100_000), (0, 0, 0, 10_000), (0, 0, 0, 50_000),
             (2000, 0, 0, 90_000), time=5.0)
    assert p.route(REQ, v) == Decision(1, migrate_from=0)
    # the same session again at once: the repeat penalty (1.0) keeps it on the holder
    assert p.route(REQ, v) == Decision(0)
    # much later the penalty has faded
    v_late = view((8000, 0, 0, 100_000), (0, 0, 0, 10_000), time=2000.0)
    assert p.route(REQ, v_late) == Decision(1, migrate_from=0)
    p.reset()
    assert p.route(REQ, v) == Decision(1, migrate_from=0)


def test_migrate_scores_cached_tokens_and_recent_activity() -> None:
    p = MigrateWhenImbalanced(abs_gap=20_000, rel_gap=1.5, w_cache=1.0, w_recent=0.5,
                              recent_horizon=10.0, w_load=1.0)
    # candidates 1 and 2 equally loaded; 2 holds part of the prefix: it wins, and still
    # receives the holder's blocks it lacks
    v = view((9000, 0, 0, 100_000), (0, 0, 0, 10_000), (4000, 0, 0, 10_000))
    assert p.route(REQ, v) == Decision(2, migrate_from=0)
    # recent activity: instance 1 served this session just now
    p.reset()
    v = view((9000, 0, 0, 100_000), (0, 0, 0, 10_000), (1000, 0, 0, 10_000), time=50.0,
             seen={1: 50.0})
    assert p.route(REQ, v) == Decision(1, migrate_from=0)


# -- a policy plugged in from this module -----------------------------------------------
class SendToLast(RoutingPolicy):
    """Every request to the highest-numbered instance."""

    name = "test_send_to_last"

    def __init__(self) -> None:
        self.calls = 0

    def route(self, request: Request, view: ClusterView) -> Decision:
        self.calls += 1
        return Decision(len(view.instances) - 1)


class Scripted(RoutingPolicy):
    """Decisions read from a list, one per request."""

    def __init__(self, decisions: list[Decision]) -> None:
        self.decisions = decisions
        self.views: list[ClusterView] = []

    def route(self, request: Request, view: ClusterView) -> Decision:
        self.views.append(view)
        return self.decisions[len(self.views) - 1]


def test_plugged_in_policy_found_and_simulated() -> None:
    assert "test_send_to_last" in available_policies()
    assert "scripted" in available_policies()  # the default name: the class's, snake case
    pol = get_policy("test_send_to_last")
    assert isinstance(pol, SendToLast)
    reqs = generate(WorkloadConfig(sessions=5, rate=1.0, seed=3))
    res = simulate(reqs, pol, instances=3)
    assert res.policy == "test_send_to_last"
    assert pol.calls == len(reqs) == len(res.records)
    assert {r.instance for r in res.records} == {2}
    assert {r.instance for r in simulate(reqs, "test_send_to_last", instances=2).records} \
        == {1}


# -- the simulator against hand-computed schedules ----------------------------------------
COSTS = Costs(prefill_per_token=0.01, kv_load_per_block=0.05, transfer_per_block=0.1,
              decode_per_token=0.1, block_tokens=10, cache_capacity_blocks=100,
              hit_per_block=0.02)


def test_schedule_by_hand() -> None:
    reqs = [
        Request("a", 0.0, 25, 5),   # -> 0: no cache, prefill 25 x 0.01 = 0.25
        Request("b", 0.1, 40, 2),   # -> 1: prefill 0.40
        Request("a", 0.2, 35, 1, turn=1),
        # -> 0 (round robin), waits for 0 until 0.25; a's 2 full blocks are cached:
        # 0.05 wait + 2 x 0.02 hit + 15 x 0.01 prefill = 0.24
    ]
    res = simulate(reqs, "round_robin", instances=2, costs=COSTS, shared_store=False)
    got = [(r.instance, r.start, r.ttft, r.cached_tokens, r.loaded_tokens)
           for r in res.records]
    assert got == [
        (0, 0.0, pytest.approx(0.25, abs=1e-12), 0, 0),
        (1, 0.1, pytest.approx(0.40, abs=1e-12), 0, 0),
        (0, 0.25, pytest.approx(0.24, abs=1e-12), 20, 0),
    ]
    s = res.summary()
    assert s["ttft_median"] == pytest.approx(0.25)
    assert s["hit_rate"] == pytest.approx(20 / 100)
    assert s["migrations"] == 0


def test_schedule_by_hand_with_shared_store() -> None:
    # a's turn 1 goes to instance 1, which lacks a's blocks; the store has the 3 blocks of
    # turn 0's prompt and output (published when its decode ended at 0.25 + 5 x 0.1)
    reqs = [
        Request("a", 0.0, 25, 5),              # -> 0: 0.25
        Request("a", 1.0, 38, 1, turn=1),      # -> 1: 3 x 0.05 load + 8 x 0.01 = 0.23
        Request("b", 1.1, 30, 1),              # -> 0: prefill 0.30
    ]
    res = simulate(reqs, "round_robin", instances=2, costs=COSTS, shared_store=True)
    got = [(r.instance, r.ttft, r.cached_tokens, r.loaded_tokens) for r in res.records]
    assert got == [
        (0, pytest.approx(0.25, abs=1e-12), 0, 0),
        (1, pytest.approx(0.23, abs=1e-12), 0, 30),
        (0, pytest.approx(0.30, abs=1e-12), 0, 0),
    ]
    assert res.summary()["local_hit_rate"] == 0.0
    assert res.summary()["hit_rate"] == pytest.approx(30 / 93)


def test_views_report_hits_and_load() -> None:
    reqs = [Request("a", 0.0, 25, 5), Request("b", 0.1, 40, 2),
            Request("a", 10.0, 47, 3, turn=1)]
    pol = Scripted([Decision(0), Decision(0), Decision(1)])
    simulate(reqs, pol, instances=2, costs=COSTS, shared_store=False)
    v1, v2 = pol.views[1], pol.views[2]
    # at 0.1 instance 0 is prefilling a (25 uncached tokens queued)
    assert (v1.instances[0].queued_tokens, v1.instances[0].running_tokens) == (25, 0)
    assert v1.instances[0].last_seen is None  # b never seen
    # at 10.0 all done; instance 0 holds a's prompt and output: 30 tokens
    assert [s.prefix_hits for s in v2.instances] == [30, 0]
    assert v2.instances[0].last_seen == 0.0
    assert v2.instances[0].load == 0


def test_migration_moves_blocks_and_target_hits_next_turn() -> None:
    reqs = [
        Request("a", 0.0, 25, 5),              # -> 0; after decode 0 holds 3 blocks
        Request("a", 10.0, 47, 3, turn=1),     # -> 1, migrating a's 3 blocks from 0
        Request("a", 20.0, 60, 1, turn=2),     # -> 1: holds 47 + 3 = 50 tokens: 5 blocks
    ]
    pol = Scripted([Decision(0), Decision(1, migrate_from=0), Decision(1)])
    res = simulate(reqs, pol, instances=2, costs=COSTS, shared_store=False)
    r0, r1, r2 = res.records
    assert r1.instance == 1 and r1.migrated_blocks == 3 and r1.cached_tokens == 30
    # the transfer (3 x 0.1) before the prefill; 3 x 0.02 hits + 17 x 0.01 prefill
    assert r1.start == pytest.approx(10.3) and r1.ttft == pytest.approx(0.3 + 0.06 + 0.17)
    assert r2.instance == 1 and r2.cached_tokens == 50 and r2.migrated_blocks == 0
    assert r2.ttft == pytest.approx(5 * 0.02 + 10 * 0.01)
    assert res.summary()["migrations"] == 1
    assert res.summary()["migrated_blocks"] == 3
    # at most ``blocks`` move; the rest is prefilled
    pol = Scripted([Decision(0), Decision(1, migrate_from=0, blocks=2), Decision(1)])
    r1 = simulate(reqs, pol, instances=2, costs=COSTS, shared_store=False).records[1]
    assert (r1.migrated_blocks, r1.cached_tokens) == (2, 20)
    assert r1.ttft == pytest.approx(0.2 + 0.04 + 0.27)


def test_builtin_migrate_policy_migrates_in_simulation() -> None:
    # one long session pinned to instance 0 by affinity while other sessions load it
    reqs = generate(WorkloadConfig(sessions=300, rate=2.0, gap_median=2.0, seed=1))
    costs = Costs(cache_capacity_blocks=4096)
    res = simulate(reqs, MigrateWhenImbalanced(abs_gap=4096, rel_gap=1.2), instances=4,
                   costs=costs)
    s = res.summary()
    assert s["migrations"] > 0
    assert s["migrated_blocks"] >= s["migrations"]


def test_simulation_is_deterministic_and_policies_differ() -> None:
    cfg = WorkloadConfig(sessions=200, rate=1.0, gap_median=8.2, seed=7)
    reqs = generate(cfg)
    rate = saturation_rate(reqs, Costs(), 4)
    assert rate > 0
    a = simulate(reqs, "cache_aware", instances=4)
    b = simulate(generate(cfg), get_policy("cache_aware"), instances=4)
    assert a.records == b.records
    ll = simulate(reqs, "least_load", instances=4).summary()
    ca = a.summary()
    assert ca["local_hit_rate"] > ll["local_hit_rate"]
    assert len(a.records) == len(reqs)


def test_simulate_rejects_bad_decisions() -> None:
    pol = Scripted([Decision(5)])
    with pytest.raises(InvalidInput, match="chose instance 5"):
        simulate([Request("a", 0.0, 10)], pol, instances=2)
    with pytest.raises(InvalidInput, match="sorted by arrival"):
        simulate([Request("a", 1.0, 10), Request("b", 0.5, 10)], "round_robin")


# -- the block cache and request structure ------------------------------------------------
def test_request_chain() -> None:
    r = Request("s", 0.0, 1000, shared_prefix_tokens=300)
    # 3 full blocks of 100 shared; block 3 straddles nothing (300 is a boundary)
    assert r.chain(100) == ((SHARED_PREFIX, 3), (("s", 0), 7))
    assert r.chain(256) == ((SHARED_PREFIX, 1), (("s", 0), 2))
    assert r.chain(100, 350) == ((SHARED_PREFIX, 3),)
    assert len(r.keys(100)) == 10
    with pytest.raises(InvalidInput):
        Request("s", 0.0, 0)


def test_block_cache_lru_evicts_tail_first() -> None:
    c = BlockCache(10)
    c.touch((("x", 4),))
    c.touch(((SHARED_PREFIX, 2), ("y", 3)))
    assert c.used == 9
    c.touch((("z", 3),))  # 12 > 10: x (least recent) loses its last 2 blocks
    assert (c.held("x"), c.held("y"), c.held("z"), c.used) == (2, 3, 3, 10)
    assert c.match((("x", 4),)) == 2
    c.touch(((SHARED_PREFIX, 2), ("y", 6)))  # +3: x goes, then z loses 1
    assert (c.held("x"), c.held("z"), c.held("y"), c.used) == (0, 2, 6, 10)
    c.touch((("w", 15),))  # alone too big: keeps its first 10
    assert (c.held("w"), c.used) == (10, 10)


# -- the simulator's calibrated terms, by hand ---------------------------------------------
def test_request_tail_keeps_the_instance_busy_but_is_not_in_the_ttft() -> None:
    """One instance, 1 ms per token, a 2 ms tail: A (10 tokens at t=0) has its first
    token at 10 ms; B (10 tokens at 5 ms) starts after A's tail, at 12 ms, and ends at
    22; C (at 30 ms) finds the instance idle and starts at once. A negative tail is
    refused."""

    costs = Costs(prefill_per_token=1e-3, block_tokens=32, cache_capacity_blocks=10,
                  request_tail=2e-3)
    reqs = [Request("a", 0.0, 10), Request("b", 0.005, 10), Request("c", 0.030, 10)]
    a, b, c = simulate(reqs, "round_robin", instances=1, costs=costs, shared_store=False,
                       cache_output=False).records
    assert (a.start, a.ttft) == pytest.approx((0.0, 0.010))
    assert (b.start, b.ttft, b.queue) == pytest.approx((0.012, 0.017, 0.007))
    assert (c.start, c.ttft) == pytest.approx((0.030, 0.010))
    with pytest.raises(InvalidInput, match="request_tail"):
        Costs(request_tail=-1e-3)


def test_dispatch_latency_delays_requests_without_occupying_the_instance() -> None:
    """One instance, 1 ms per token, a 2 ms hand-off: A (10 tokens at t=0) starts at
    2 ms and ends at 12; B (10 tokens at 5 ms) reached the instance at 7 ms, waits for
    A and runs 12-22 ms. Without the latency being busy time, B does not wait 2 ms more
    after A. A negative latency is refused."""

    costs = Costs(prefill_per_token=1e-3, block_tokens=32, cache_capacity_blocks=10,
                  dispatch_latency=2e-3)
    reqs = [Request("a", 0.0, 10), Request("b", 0.005, 10)]
    a, b = simulate(reqs, "round_robin", instances=1, costs=costs, shared_store=False,
                    cache_output=False).records
    assert (a.start, a.ttft, a.queue) == pytest.approx((0.002, 0.012, 0.002))
    assert (b.start, b.ttft, b.queue) == pytest.approx((0.012, 0.017, 0.007))
    with pytest.raises(InvalidInput, match="dispatch_latency"):
        Costs(dispatch_latency=-1e-3)


def test_calibrated_simulator_hand_checked_schedule() -> None:
    """Two instances on one core (processor sharing: two prefills at once each run at
    half speed, contention 1), blocks of 10 tokens; costs (ms): overhead 1, per token
    0.1, per attention pair 0.001, hit 0.5 and store load 2 per block.

    t=0     a0 (25 tok) -> inst 0: work 1 + 2.5 + 0.001 * 325 = 3.825
    t=1     b0 (25 tok) -> inst 1: work 3.825; a0 has 2.825 left, both at half speed:
            a0 ends at 1 + 2 * 2.825 = 6.65, by when b0 has done 2.825: 1.0 left
            alone, so b0 ends at 7.65 (ttft 6.65)
    t=10    a1 (35 tok) -> inst 0 (round robin), holds a's 2 blocks: hit 2 * 0.5 = 1;
            15 new tokens after 20: 1 + 1.5 + 0.001 * (15*20 + 120) = 2.92; work 3.92
    t=11    b1 (35 tok) -> inst 1, same work; a1 has 2.92 left: ends at 11 + 5.84 =
            16.84 (ttft 6.84); b1 then has 1.0 left: ends 17.84 (ttft 6.84)
    """
    costs = Costs(prefill_per_token=1e-4, prefill_per_token_ctx=1e-6, request_overhead=1e-3,
                  hit_per_block=5e-4, kv_load_per_block=2e-3, decode_per_token=0.0,
                  block_tokens=10, cache_capacity_blocks=10, contention=1.0)
    reqs = [Request("a", 0.0, 25), Request("b", 1e-3, 25), Request("a", 10e-3, 35, turn=1),
            Request("b", 11e-3, 35, turn=1)]
    res = simulate(reqs, "round_robin", instances=2, costs=costs, cache_output=False)
    got = [(r.instance, round(r.ttft * 1e3, 6), r.cached_tokens) for r in res.records]
    assert got == [(0, 6.65, 0), (1, 6.65, 0), (0, 6.84, 20), (1, 6.84, 20)]
    # the KV part of a1's time is stretched as its whole prefill was
    assert math.isclose(res.records[2].kv_load, 1e-3 * 6.84 / 3.92)
    # alone, a1 on the other instance: a's two blocks come from the shared store, 2 ms
    # each
    res = simulate([reqs[0], reqs[2]], "round_robin", instances=2, costs=costs,
                   cache_output=False)
    r = res.records[1]
    assert (r.instance, r.cached_tokens, r.loaded_tokens) == (1, 0, 20)
    assert math.isclose(r.ttft, 4e-3 + 2.92e-3) and math.isclose(r.kv_load, 4e-3)
    with pytest.raises(InvalidInput, match="contention"):
        Costs(contention=-1.0)


# -- the workload generator and trace replay ----------------------------------------------
def test_workload_seeded_and_shaped() -> None:
    cfg = WorkloadConfig(sessions=300, rate=0.5, gap_median=20.1, seed=11)
    a, b = generate(cfg), generate(cfg)
    assert a == b
    assert generate(WorkloadConfig(sessions=300, rate=0.5, gap_median=20.1, seed=12)) != a
    by_session: dict[object, list[Request]] = defaultdict(list)
    for r in a:
        by_session[r.session].append(r)
    assert len(by_session) == 300
    gaps: list[float] = []
    for reqs in by_session.values():
        assert 10 <= len(reqs) <= 60
        assert [r.turn for r in reqs] == list(range(len(reqs)))
        for prev, cur in itertools.pairwise(reqs):
            assert cur.input_tokens > prev.input_tokens + prev.output_tokens  # append-only
            gaps.append(cur.arrival - prev.arrival)
        assert all(r.shared_prefix_tokens == cfg.system_prompt_tokens for r in reqs)
    assert statistics.median(gaps) == pytest.approx(20.1, rel=0.05)
    assert [r.arrival for r in a] == sorted(r.arrival for r in a)
    # a faster rate replays the same sessions, started closer together
    fast = generate(WorkloadConfig(sessions=300, rate=5.0, gap_median=20.1, seed=11))
    key = lambda r: (r.session, r.turn)  # noqa: E731
    assert sorted((key(r), r.input_tokens) for r in fast) == \
        sorted((key(r), r.input_tokens) for r in a)
    assert max(r.arrival for r in fast if r.turn == 0) < max(r.arrival for r in a
                                                             if r.turn == 0)


@pytest.mark.parametrize("median", [8.2, 60.3])
def test_workload_gap_medians(median: float) -> None:
    reqs = generate(WorkloadConfig(sessions=150, gap_median=median, seed=2))
    last: dict[object, float] = {}
    gaps = []
    for r in reqs:
        if r.session in last:
            gaps.append(r.arrival - last[r.session])
        last[r.session] = r.arrival
    assert statistics.median(gaps) == pytest.approx(median, rel=0.06)


def test_trace_round_trip(tmp_path: Path) -> None:
    cfg = WorkloadConfig(sessions=40, seed=5)
    reqs = generate(cfg)
    path = tmp_path / "trace.jsonl"
    assert write_trace(reqs, path) == len(reqs)
    first = json.loads(path.read_text().splitlines()[0])
    assert set(first) == {"session", "arrival", "input_tokens", "output_tokens"}
    back = read_trace(path, shared_prefix_tokens=cfg.system_prompt_tokens)
    assert back == reqs
    assert simulate(back, "cache_aware").records == simulate(reqs, "cache_aware").records


def test_trace_replay_new_context_and_errors(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(
        '{"session": "x", "arrival": 2.0, "input_tokens": 900, "output_tokens": 10}\n'
        '{"session": "x", "arrival": 1.0, "input_tokens": 500, "output_tokens": 10}\n'
        "\n"
        '{"session": "x", "arrival": 3.0, "input_tokens": 300, "output_tokens": 10}\n')
    got = read_trace(path, shared_prefix_tokens=400)
    assert [(r.turn, r.context, r.input_tokens, r.shared_prefix_tokens) for r in got] == \
        [(0, 0, 500, 400), (1, 0, 900, 400), (2, 1, 300, 300)]
    path.write_text('{"session": "x", "arrival": 1.0}\n')
    with pytest.raises(InvalidInput, match=r"t\.jsonl:1"):
        read_trace(path)


# -- views from the store's node summaries -------------------------------------------------
BT = 16


@pytest.fixture
def two_nodes(tmp_path: Path) -> Iterator[tuple[tensordb.KVCache, tensordb.KVCache]]:
    """One KV namespace on each of two nodes (two stores): the same model, so the same
    block keys."""
    dbs = [open_store(tmp_path / name) for name in ("a", "b")]
    try:
        yield tuple(db.kv("llm", block_tokens=BT, capacity_bytes=4 << 20,  # type: ignore[misc]
                          slab_bytes=1 << 20) for db in dbs)
    finally:
        for db in dbs:
            remove_store(db)


def test_cluster_view_from_the_stores_node_summaries(
        two_nodes: tuple[tensordb.KVCache, tensordb.KVCache]) -> None:
    """Node a holds blocks 0, 1 and 3 of a six-block prompt, node b blocks 0-4: their
    tensordb.KVNodeSummary gives instance 0 a prefix of 2 blocks (block 2 is missing)
    and instance 1 one of 5, in tokens; the load and the session's last sight come from
    the router's trackers; a routing policy routes on the result."""
    a, b = two_nodes
    tokens = np.arange(6 * BT + 3, dtype=np.int64)
    keys = a.keys(tokens)
    assert len(keys) == 6 and b.keys(tokens) == keys
    a.put([keys[0], keys[1], keys[3]], [torch.zeros(8)] * 3)
    b.put(keys[:5], [torch.zeros(8)] * 5)
    summaries = [a.stats(), b.stats()]
    assert all(isinstance(s, tensordb.KVNodeSummary) and isinstance(s, BlockSummary)
               for s in summaries)
    assert [s.prefix_hits(keys) for s in summaries] == [2, 5]

    view = cluster_view(summaries, keys, time=3.0)  # no trackers: no load known
    assert view.time == 3.0 and view.block_tokens == BT
    assert [(s.instance, s.prefix_hits, s.load, s.last_seen) for s in view.instances] == [
        (0, 2 * BT, 0, None), (1, 5 * BT, 0, None)]

    busy, idle = LoadTracker(), LoadTracker()
    busy.queued, busy.running, busy.ewma, busy.seen["s"] = 300, 40, 250.0, 1.5
    view = cluster_view(summaries, keys, time=3.0, loads=[idle, busy], session="s")
    assert [(s.queued_tokens, s.running_tokens, s.load_ewma, s.last_seen)
            for s in view.instances] == [(0, 0, 0.0, None), (300, 40, 250.0, 1.5)]
    assert instance_state(1, summaries[1], keys, load=busy, session="s") == view.instances[1]
    req = Request("s", 3.0, len(tokens), shared_prefix_tokens=0)
    assert CacheAware().route(req, view) == Decision(1)  # the longer prefix, balanced
    assert LeastLoad().route(req, view) == Decision(0)


def test_cluster_view_refuses_what_does_not_fit(
        two_nodes: tuple[tensordb.KVCache, tensordb.KVCache], tmp_path: Path) -> None:
    a, _ = two_nodes
    other = open_store(tmp_path / "c")
    try:
        wide = other.kv("llm-wide", block_tokens=2 * BT, capacity_bytes=4 << 20,
                        slab_bytes=1 << 20).stats()
        with pytest.raises(InvalidInput, match="one view covers one KV layout"):
            cluster_view([a.stats(), wide], [])
    finally:
        remove_store(other)
    with pytest.raises(InvalidInput, match="at least one"):
        cluster_view([], [])
    with pytest.raises(InvalidInput, match="1 load trackers for 2 summaries"):
        cluster_view([a.stats(), a.stats()], [], loads=[LoadTracker()])
