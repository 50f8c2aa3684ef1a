"""The toy engine (benchmarks/toy_engine), the harness that calibrates the routing
simulator: prefill over cached KV equals prefill from scratch, KV moves through the
tensordb store between instances (in one process and across toy engine processes), the
cost fits recover known costs, bad input; and the routing benchmark script."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import open_store, remove_store

import benchmarks.routing as bench
import benchmarks.toy_engine as toy_engine
import tensordb
from benchmarks.toy_engine import (
    Job,
    LocalCache,
    ModelConfig,
    PromptTokens,
    TinyDecoder,
    ToyCluster,
    ToyEngine,
    ToyEngineConfig,
    dispatch_overhead,
    fit_costs,
    fit_error,
    fit_records,
    fit_under_load,
    open_kv,
    recalibrate,
    split_blocks,
)
from engine_bindings.router import (
    ClusterView,
    Costs,
    Decision,
    Request,
    RoutingPolicy,
    WorkloadConfig,
    generate,
    simulate,
)
from tensordb.errors import InvalidInput

SMALL = ModelConfig(layers=2, d_model=64, heads=2, ffn=128, vocab=512, max_tokens=2048)
BT = 16


@pytest.fixture(scope="module")
def model() -> TinyDecoder:
    return TinyDecoder(SMALL)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[tensordb.Database]:
    db = open_store(tmp_path / "store")
    try:
        yield db
    finally:
        remove_store(db)


def test_public_surface() -> None:
    assert sorted(toy_engine.__all__) == sorted([
        "CONTENTION_GRID", "PROBE_REPS", "EngineCluster", "Job", "LocalCache", "ModelConfig", "PromptTokens",
        "Served", "TinyDecoder", "ToyCluster", "ToyEngine", "ToyEngineConfig", "calibrate",
        "clock", "dispatch_overhead", "fit_costs", "fit_error", "fit_records",
        "fit_under_load", "instance_main", "measure_toy_engine", "open_kv", "recalibrate",
        "split_blocks"])
    for name in toy_engine.__all__:
        assert getattr(toy_engine, name) is not None


def tokens(n: int, seed: int = 0) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).integers(0, SMALL.vocab, n))


def job(rid: int, toks: torch.Tensor, kv: object, migrated: bool = False) -> Job:
    arr = toks.numpy()
    return Job(rid, arr, tuple(kv.keys(arr)), 0.0, migrated)  # type: ignore[attr-defined]


# -- the model: cached KV is really used ------------------------------------------------
def test_prefill_over_cached_kv_equals_prefill_from_scratch(model: TinyDecoder) -> None:
    toks = tokens(5 * BT + 7)
    logits, kv = model.prefill(toks)
    assert kv.shape == (2, 2, 2, len(toks), 32)
    blocks = split_blocks(kv, 0, BT)
    assert len(blocks) == 5 and blocks[0].shape == SMALL.block_shape(BT)
    for cached in (1, 3, 5):
        l2, kv2 = model.prefill(toks[cached * BT:], torch.stack(blocks[:cached]))
        torch.testing.assert_close(l2, logits, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(kv2, kv[:, :, :, cached * BT:], atol=1e-5, rtol=1e-4)
    # the cached KV is what the answer is made of: other KV gives other logits
    wrong = [torch.randn_like(b) for b in blocks[:3]]
    l3, _ = model.prefill(toks[3 * BT:], torch.stack(wrong))
    assert (l3 - logits).abs().max() > 1e-3


def test_same_config_same_weights_and_bad_input(model: TinyDecoder) -> None:
    other = TinyDecoder(SMALL)
    toks = tokens(20)
    torch.testing.assert_close(other.prefill(toks)[0], model.prefill(toks)[0])
    with pytest.raises(InvalidInput, match="token ids"):
        model.prefill(torch.tensor([0, SMALL.vocab]))
    with pytest.raises(InvalidInput, match="1-D"):
        model.prefill(torch.zeros(2, 3, dtype=torch.int64))
    with pytest.raises(InvalidInput, match="does not fit"):
        model.prefill(toks, torch.zeros(1, 3, 2, 2, BT, 32))
    with pytest.raises(InvalidInput, match="max_tokens"):
        model.prefill(tokens(SMALL.max_tokens + 1))
    with pytest.raises(InvalidInput, match="block boundary"):
        split_blocks(torch.zeros(2, 2, 2, 20, 32), 3, BT)
    with pytest.raises(InvalidInput, match="heads"):
        ModelConfig(d_model=64, heads=3)
    with pytest.raises(InvalidInput, match="layers"):
        ModelConfig(layers=0)
    with pytest.raises(InvalidInput, match="cache_blocks"):
        ToyEngineConfig(cache_blocks=-1)
    with pytest.raises(InvalidInput, match="block_tokens"):
        ToyEngineConfig(block_tokens=0)


def test_local_cache_is_an_lru_evicting_a_prompts_tail_first() -> None:
    c = LocalCache(4)
    a = [b"a0", b"a1", b"a2"]
    assert c.reserve(a) == (a[::-1], [])
    assert c.lookup(a) == []  # reserved, not yet computed
    c.fill(a, [torch.zeros(1)] * 3)
    assert len(c.lookup(a)) == 3
    added, evicted = c.reserve([b"b0", b"b1"])
    assert sorted(added) == [b"b0", b"b1"] and evicted == [b"a2"]  # a's tail goes first
    assert len(c.lookup(a)) == 2


# -- one toy engine over the store------------------------------------------------------
def test_toy_engine_loads_what_another_saved(store: tensordb.Database, model: TinyDecoder
                                         ) -> None:
    cfg = ToyEngineConfig(model=SMALL, block_tokens=BT, cache_blocks=64, namespace="eng",
                       store_bytes=64 << 20)
    kv = open_kv(store, cfg)
    a, b = ToyEngine(cfg, kv, 0, model), ToyEngine(cfg, kv, 1, model)
    toks = tokens(4 * BT + 5, seed=1)
    first = a.serve(job(1, toks, kv))
    assert (first.local_blocks, first.loaded_blocks, first.computed_tokens,
            first.saved_blocks) == (0, 0, len(toks), 4)
    assert kv.match(kv.keys(toks.numpy())) == 4
    longer = torch.cat((toks, tokens(2 * BT, seed=2)))
    again = b.serve(job(2, longer, kv))  # b holds nothing: it loads a's four blocks
    assert (again.local_blocks, again.loaded_blocks, again.computed_tokens) == (
        0, 4, len(longer) - 4 * BT)
    assert again.first_token == int(model.prefill(longer)[0].argmax())
    third = b.serve(job(3, longer, kv))  # now all six are in b's own cache
    assert (third.local_blocks, third.loaded_blocks) == (6, 0)


def test_migration_moves_exactly_the_blocks_and_the_target_hits(
        store: tensordb.Database, model: TinyDecoder) -> None:
    # the store only carries migrations: what is in it is what moved
    cfg = ToyEngineConfig(model=SMALL, block_tokens=BT, cache_blocks=64, namespace="mig",
                       use_store=False, store_bytes=64 << 20)
    kv = open_kv(store, cfg)
    src, dst = ToyEngine(cfg, kv, 0, model), ToyEngine(cfg, kv, 1, model)
    toks = tokens(6 * BT + 3, seed=3)
    keys = kv.keys(toks.numpy())
    src.serve(job(1, toks, kv))
    assert kv.match(keys) == 0  # nothing published yet
    assert src.publish(keys[:4]) == 4
    assert kv.contains(keys) == [True] * 4 + [False] * 2
    assert dst.prefetch(7, keys[:4]) == 4
    served = dst.serve(job(7, toks, kv, migrated=True))
    assert (served.local_blocks, served.migrated_blocks, served.loaded_blocks,
            served.computed_tokens) == (0, 4, 0, len(toks) - 4 * BT)
    assert served.first_token == int(model.prefill(toks)[0].argmax())
    hit = dst.serve(job(8, toks, kv))
    assert (hit.local_blocks, hit.migrated_blocks) == (6, 0)
    assert src.publish(keys[:4]) == 0  # idempotent: the store has them


# -- toy engine processes and the router----------------------------------------------
class _Pinned(RoutingPolicy):
    """Turn 0 on instance 0; turn 1 on 1 with a migration from 0; then stay on 1."""

    name = "test_pinned_migration"

    def route(self, request: Request, view: ClusterView) -> Decision:
        if request.turn == 0:
            return Decision(0)
        if request.turn == 1:
            return Decision(1, migrate_from=0)
        return Decision(1)


class _Bad(RoutingPolicy):
    name = "test_bad_instance"

    def route(self, request: Request, view: ClusterView) -> Decision:
        return Decision(len(view.instances))


def test_toy_cluster_migrates_through_the_store_and_the_target_hits(tmp_path: Path) -> None:
    cfg = ToyEngineConfig(model=SMALL, block_tokens=BT, cache_blocks=64, use_store=False,
                       store_bytes=64 << 20)
    reqs = [Request("s", 0.0, 5 * BT + 4, turn=0), Request("s", 1.0, 7 * BT + 1, turn=1),
            Request("s", 2.0, 8 * BT + 9, turn=2)]
    with ToyCluster(2, cfg, home=tmp_path / "store", timeout=300) as cluster:
        res = cluster.run(reqs, "test_pinned_migration")
        r0, r1, r2 = res.records
        assert [r.instance for r in res.records] == [0, 1, 1]
        assert (r0.cached_tokens, r0.migrated_blocks) == (0, 0)
        assert (r1.migrated_blocks, r1.cached_tokens, r1.loaded_tokens) == (5, 5 * BT, 0)
        assert (r2.migrated_blocks, r2.cached_tokens) == (0, 7 * BT)  # the target hits
        keys = cluster.kv.keys(PromptTokens(SMALL.vocab)(reqs[1]))
        assert cluster.kv.contains(keys) == [True] * 5 + [False] * 2  # exactly those
        assert all(r.ttft > 0 and r.queue >= 0 and r.prefill > 0 for r in res.records)
        with pytest.raises(InvalidInput, match="chose instance 2"):
            cluster.run(reqs[:1], "test_bad_instance")
        with pytest.raises(InvalidInput, match="sorted by arrival"):
            cluster.run(reqs[::-1], "round_robin")
        # a failed run leaves no blocks behind: a new run starts on an empty store
        res = cluster.run(reqs[:1], "round_robin")
        assert res.records[0].cached_tokens == 0
        assert cluster.kv.match(keys) == 0
    with pytest.raises(InvalidInput, match="instances"):
        ToyCluster(0, cfg)
    for bad in (-1, 1.5, True):
        with pytest.raises(InvalidInput, match="warm_bytes"):
            ToyCluster(1, cfg, home=tmp_path / "never", warm_bytes=bad)  # type: ignore[arg-type]
    assert not (tmp_path / "never").exists()  # refused before anything was made


# -- calibration and the calibrated simulator -----------------------------------------
def test_fit_recovers_the_cost_model() -> None:
    overhead, a, b = 2e-3, 3e-4, 5e-7
    grid = [(n, p, overhead + a * n + b * (n * p + n * (n + 1) / 2))
            for n in (32, 128, 384) for p in (0, 256, 1024)]
    cfg = ToyEngineConfig(block_tokens=32, cache_blocks=100)
    costs = fit_costs({"prefill": grid, "hit_per_block": 1e-6, "stack_per_block": 2e-6,
                       "load_per_block": 5e-4, "transfer_per_block": 9e-4}, cfg, 0.5)
    assert math.isclose(costs.request_overhead, overhead, rel_tol=1e-6)
    assert math.isclose(costs.prefill_per_token, a, rel_tol=1e-6)
    assert math.isclose(costs.prefill_per_token_ctx, b, rel_tol=1e-6)
    assert math.isclose(costs.hit_per_block, 3e-6) and math.isclose(
        costs.kv_load_per_block, 5.02e-4)
    assert (costs.transfer_per_block, costs.cache_capacity_blocks, costs.block_tokens,
            costs.contention, costs.decode_per_token) == (9e-4, 100, 32, 0.5, 0.0)
    assert fit_error({"prefill": grid}, costs) < 1e-6
    with pytest.raises(InvalidInput, match="at least 4"):
        fit_costs({"prefill": grid[:3]}, cfg)


def test_dispatch_overhead_is_what_toy_engine_requests_take_beyond_the_model() -> None:
    cfg = ToyEngineConfig(block_tokens=32, cache_blocks=100)
    costs = Costs(prefill_per_token=1e-4, request_overhead=1e-3, block_tokens=32,
                  cache_capacity_blocks=100)
    seen: list[tuple[int, str]] = []

    def run(requests, policy):  # type: ignore[no-untyped-def]
        # the "real" engine: the simulator's times plus a 1 ms hand-off (a wait before
        # the start) and 2 ms of bookkeeping on most requests, one outlier
        seen.append((len(requests), policy))
        recs = simulate(requests, policy, instances=2, costs=costs, cache_output=False).records
        late = [dataclasses.replace(r, queue=r.queue + (0.001 if i else 0.2),
                                    ttft=r.ttft + (0.003 if i else 0.5))
                for i, r in enumerate(recs)]
        return SimpleNamespace(records=late)

    fake = SimpleNamespace(cfg=cfg, n=2, run=run)
    latency, busy = dispatch_overhead(fake, costs)
    assert math.isclose(latency, 0.001, rel_tol=1e-9)
    assert math.isclose(busy, 0.002, rel_tol=1e-9)
    assert seen == [(12, "round_robin")]
    faster = SimpleNamespace(cfg=cfg, n=2, run=lambda reqs, pol: SimpleNamespace(records=[
        dataclasses.replace(r, ttft=r.ttft / 2) for r in simulate(
            reqs, pol, instances=2, costs=costs, cache_output=False).records]))
    assert dispatch_overhead(faster, costs) == (0.0, 0.0)  # never negative


def _fit_case() -> tuple[ToyEngineConfig, Costs, Costs, list]:  # type: ignore[type-arg]
    """The load fit's test case: a toy engine config, the probed costs, the "real" costs
    (contention 0.4, compute 1.25 x slower, 2 ms of overhead against the probe's 3, a
    0.3 ms tail after each first token, a 0.5 ms hand-off) and a loaded workload."""
    costs = Costs(prefill_per_token=2e-4, request_overhead=3e-3, block_tokens=32,
                  cache_capacity_blocks=64, kv_load_per_block=1e-4)
    truth = dataclasses.replace(costs, contention=0.4, request_overhead=2e-3,
                                prefill_per_token=2.5e-4, kv_load_per_block=1.25e-4,
                                request_tail=3e-4, dispatch_latency=5e-4)
    work = generate(WorkloadConfig.small(sessions=16, rate=40.0, gap_median=0.05))
    return ToyEngineConfig(block_tokens=32, cache_blocks=64), costs, truth, work


def _assert_recovered(fitted: Costs, truth: Costs) -> None:
    assert fitted.contention == truth.contention
    for name in ("request_overhead", "prefill_per_token", "kv_load_per_block",
                 "request_tail", "dispatch_latency"):
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=1e-6), name


def test_fit_under_load_recovers_the_costs_of_a_loaded_run() -> None:
    """The "real" cluster is the simulator with the truth's costs on a light and a
    loaded workload: the fit on their records finds every term (the contention a grid
    value) exactly, records it, its per-request error is 0 and the fitted simulator
    reproduces the runs; recalibrate keeps the contention rather than the bare probe's;
    without rescale the costs keep their speed."""
    cfg, costs, truth, work = _fit_case()
    calls: list[str] = []

    def run(requests, policy):  # type: ignore[no-untyped-def]
        calls.append(policy)
        return simulate(requests, policy, instances=2, costs=truth, cache_output=False)

    def calibrate(_i, **spec):  # type: ignore[no-untyped-def]  # the probe: 20 ms alone
        return {"prefill": [(spec["new_tokens"][0], spec["past_tokens"][0], 0.02)]}

    fake = SimpleNamespace(cfg=cfg, n=2, run=run, reset=lambda: calls.append("reset"),
                           calibrate=calibrate,
                           calibrate_all=lambda **spec: [calibrate(0, **spec)] * 2)
    measured: dict = {"probe": (384, 1024), "probe_alone": 0.01, "spec": {}}
    light = generate(WorkloadConfig.small(sessions=16, rate=10.0, gap_median=0.05))
    fitted = fit_under_load(fake, costs, measured, [light, work])
    assert calls == ["reset", "round_robin"] * 3  # a warm-up, then one run per workload
    _assert_recovered(fitted, truth)
    fit = measured["load_fit"]
    assert (fit["contention"], fit["speed"]) == (0.4, pytest.approx(1.25))
    assert fit["requests"] == len(light) + len(work)
    assert len(fit["runs"]) == 2 and fit["workloads"] == [len(light), len(work)]
    assert fit["rel_error_p90"] == pytest.approx(0.0, abs=1e-9)
    assert fit["log_error"] == pytest.approx(0.0, abs=1e-6)
    assert measured["contention_probe"] == 0.0 and fit["overhead_probe"] == 3e-3
    now, drift = recalibrate(fake, fitted, measured)  # the host is now twice as slow
    assert drift["speed_factor"] == pytest.approx(2.0) and now.contention == 0.4
    assert now.prefill_per_token == pytest.approx(5e-4)
    same, drift = recalibrate(fake, fitted, measured, rescale=False)
    assert drift["speed_factor"] == pytest.approx(2.0) and not drift["rescaled"]
    assert same.prefill_per_token == pytest.approx(2.5e-4) and same.contention == 0.4
    with pytest.raises(InvalidInput, match="non-empty workload"):
        fit_under_load(fake, costs, measured, [])


def test_trimmed_fit_leaves_out_requests_the_host_preempted() -> None:
    """One request in twenty of a run with the truth's costs took 10 x its service
    (other work on the host preempted it): the least-squares fit on all of them is
    pulled off the truth; leaving out the tenth that fits worst finds it again."""
    _, costs, truth, work = _fit_case()
    light = generate(WorkloadConfig.small(sessions=16, rate=10.0, gap_median=0.05))
    runs = [simulate(w, "round_robin", instances=2, costs=truth, cache_output=False)
            for w in (light, work)]
    for res in runs:
        res.records = [dataclasses.replace(r, prefill=r.prefill * 10) if i % 20 == 7 else r
                       for i, r in enumerate(res.records)]
    plain, fit = fit_records(runs, costs, 2)
    assert fit["trimmed"] == 0
    assert plain.contention >= 1.0 > truth.contention  # the preempted few read as contention
    trimmed, fit = fit_records(runs, costs, 2, trim=0.1)
    assert fit["trim"] == 0.1 and fit["trimmed"] == pytest.approx(0.1 * fit["requests"], abs=1)
    assert trimmed.contention == pytest.approx(truth.contention, abs=0.05)
    assert trimmed.prefill_per_token == pytest.approx(truth.prefill_per_token, rel=0.05)
    assert trimmed.request_overhead == pytest.approx(truth.request_overhead, rel=0.1)
    with pytest.raises(InvalidInput, match="trim"):
        fit_records(runs, costs, 2, trim=0.5)


def test_fit_under_load_fits_every_repeat_and_compares_medians() -> None:
    """With repeats=3 every request of every run is fitted (the truth, exactly), and
    each workload's real figures are the medians over its runs: one run of three
    slowed 3 x (a noisy host) does not move them. Bad repeat counts are refused before
    anything runs."""
    cfg, costs, truth, work = _fit_case()
    light = generate(WorkloadConfig.small(sessions=16, rate=10.0, gap_median=0.05))
    slow = {id(light): [1, 1, 1, 3], id(work): [1, 1, 1, 3]}

    def run(requests, policy):  # type: ignore[no-untyped-def]
        f = slow[id(requests)].pop(0)  # the warm-up takes the first
        res = simulate(requests, policy, instances=2, costs=truth, cache_output=False)
        if f == 1:
            return res
        noisy = SimpleNamespace(records=res.records, summary=lambda: {
            **res.summary(), "ttft_median": res.summary()["ttft_median"] * f,
            "ttft_p90": res.summary()["ttft_p90"] * f})
        return noisy

    fake = SimpleNamespace(cfg=cfg, n=2, run=run, reset=lambda: None)
    measured: dict = {}
    with pytest.raises(InvalidInput, match="repeats"):
        fit_under_load(fake, costs, measured, [light, work], repeats=0)
    assert "load_fit" not in measured and len(slow[id(work)]) == 4
    slow[id(light)].pop(0)  # only the last workload is warmed up
    fitted = fit_under_load(fake, costs, measured, [light, work], repeats=3)
    assert slow == {id(light): [], id(work): []}
    _assert_recovered(fitted, truth)
    fit = measured["load_fit"]
    assert fit["repeats"] == 3 and fit["requests"] == 3 * (len(light) + len(work))
    assert fit["log_error"] == pytest.approx(0.0, abs=1e-6)


def test_fit_under_load_over_several_policies() -> None:
    """Each workload runs under each policy (after one warm-up of the first); the fit
    holds for all of them and records each run; an empty or non-string policy list is
    refused before anything runs, and too few requests to fit are refused."""
    cfg, costs, truth, work = _fit_case()
    calls: list[str] = []

    def run(requests, policy):  # type: ignore[no-untyped-def]
        calls.append(policy)
        return simulate(requests, policy, instances=2, costs=truth, cache_output=False)

    fake = SimpleNamespace(cfg=cfg, n=2, run=run, reset=lambda: None)
    measured: dict = {}
    for bad in ([], ["round_robin", 3]):
        with pytest.raises(InvalidInput, match="policy"):
            fit_under_load(fake, costs, measured, [work], policy=bad)
    assert calls == []
    fitted = fit_under_load(fake, costs, measured, [work],
                            policy=["round_robin", "cache_aware"])
    assert calls == ["round_robin", "round_robin", "cache_aware"]
    _assert_recovered(fitted, truth)
    fit = measured["load_fit"]
    assert fit["policy"] == ["round_robin", "cache_aware"]
    assert [r["policy"] for r in fit["runs"]] == ["round_robin", "cache_aware"]
    short = simulate(work[:2], "round_robin", instances=2, costs=truth, cache_output=False)
    with pytest.raises(InvalidInput, match="at least 3 requests"):
        fit_records([short], costs, 2)


def test_probed_contention_is_capped_at_the_fit_grid() -> None:
    """A probe in which the instances together ran 120 x slower than one alone (a slow
    spell caught by the probe, not contention) sets contention 1.5, the largest the fit
    tries, not 119; a probe at the same speed sets 0."""
    costs = Costs(prefill_per_token=2e-4, block_tokens=32, cache_capacity_blocks=64)
    measured: dict = {"probe": (384, 1024), "probe_alone": 0.01, "spec": {}}
    for together, want in ((1.2, 1.5), (0.01, 0.0)):
        def probe(t):  # type: ignore[no-untyped-def]
            return lambda _i=0, **spec: {"prefill": [(384, 1024, t)]}

        fake = SimpleNamespace(n=2, reset=lambda: None, calibrate=probe(0.01),
                               calibrate_all=lambda t=together, **spec: [probe(t)()] * 2)
        now, drift = recalibrate(fake, costs, measured)
        assert now.contention == want and drift["contention"] == want


# -- the routing benchmark script ----------------------------------------------------------
def test_benchmark_small_run(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main(["--sessions", "30", "--load-sweep", "0.3,0.6", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [(r["load"], r["policy"]) for r in out["rows"]] == [
        (load, p) for load in ("0.30", "0.60")
        for p in ("round_robin", "least_load", "cache_aware", "migrate")]
    g = out["goals"]
    assert g["peak_load"] == "0.60" and g["baseline"] == "least_load"
    # the verdicts are those of the peak load's rows
    peak = {r["policy"]: r for r in out["rows"] if r["load"] == "0.60"}
    best = min((r for p, r in peak.items() if p != "least_load"),
               key=lambda r: r["ttft_median"])
    reduction = 1 - best["ttft_median"] / peak["least_load"]["ttft_median"]
    assert g["best"] == best["policy"] and g["median_reduction"] == pytest.approx(reduction)
    assert (g["median_reduction_goal"], g["hit_rate_goal"]) == (0.932, 0.95)
    assert g["median_ok"] is (reduction >= 0.932)
    assert g["hit_ok"] is (best["local_hit_rate"] >= 0.95)
    assert g["p99_ok"] is (best["ttft_p99"] <= peak["least_load"]["ttft_p99"])
    toy = bench.parse_args(["--engine", "toy", "--sessions", "5"])
    assert (toy.instances, toy.sessions, toy.block_tokens, toy.load_sweep,
            toy.repeats) == (2, 5, 32, "0.5,0.8", 3)
    assert bench.parse_args([]).repeats == 1
    with pytest.raises(SystemExit):
        bench.parse_args(["--engine", "toy", "--repeats", "0"])
    assert bench.policy("migrate", toy).abs_gap == 1024  # scaled to a 256-token prompt


def _goal_row(load: str, policy: str, median: float, p99: float, local: float,
              hit: float) -> dict[str, object]:
    return {"load": load, "policy": policy, "ttft_median": median, "ttft_p99": p99,
            "local_hit_rate": local, "hit_rate": hit}


def test_benchmark_goals_verdicts_at_peak_load() -> None:
    """least_load's median is 100 ms at the peak load 0.80. cache_aware: 5 ms (a 95%
    reduction), 96% local hits, p99 no worse: every goal met. migrate: 50 ms, 90% local
    (99% with the store), p99 worse: none met. The lower load's rows are not judged."""
    low = [_goal_row("0.40", p, 0.001, 0.001, 1.0, 1.0) for p in ("least_load", "migrate")]
    base = _goal_row("0.80", "least_load", 0.100, 0.300, 0.50, 0.50)
    met = _goal_row("0.80", "cache_aware", 0.005, 0.200, 0.96, 0.97)
    unmet = _goal_row("0.80", "migrate", 0.050, 0.400, 0.90, 0.99)
    assert bench.goals([*low, base, met, unmet]) == {
        "peak_load": "0.80", "best": "cache_aware", "baseline": "least_load",
        "median_reduction": pytest.approx(0.95), "median_reduction_goal": 0.932,
        "median_ok": True, "local_hit_rate": 0.96, "hit_rate": 0.97, "hit_rate_goal": 0.95,
        "hit_ok": True, "p99": 0.200, "baseline_p99": 0.300, "p99_ok": True}
    g = bench.goals([*low, base, unmet])
    assert (g["best"], g["median_reduction"]) == ("migrate", pytest.approx(0.5))
    assert (g["median_ok"], g["hit_ok"], g["p99_ok"]) == (False, False, False)
    # without the baseline, or with it alone, there is no verdict to give
    for rows in ([*low, met, unmet], [*low, base]):
        assert bench.goals(rows) == {"peak_load": "0.80",
                                     "note": "needs least_load and another policy"}


def test_benchmark_ordering_counts_only_pairs_the_simulator_separates() -> None:
    """Medians (ms) real / sim: a 10/10, b 12/10.5 (a tie in the simulator: within
    10%), c 20/30, d 25/15. Separated pairs: a-c, a-d, b-c, b-d, c-d; the toy engines
    order c-d the other way."""
    med = {"a": (10, 10), "b": (12, 10.5), "c": (20, 30), "d": (25, 15)}
    rows = [{"load": "0.50", "policy": p, "real": {"ttft_median": r / 1e3},
             "sim": {"ttft_median": m / 1e3}} for p, (r, m) in med.items()]
    o = bench.ordering(rows)["0.50"]
    assert o["real"] == ["a", "b", "c", "d"] and o["sim"] == ["a", "b", "d", "c"]
    assert (o["same"], o["same_best"]) == (False, True)
    assert o["separated_pairs"] == 5 and o["misordered_pairs"] == [("c", "d")]


def test_benchmark_repeats_median_and_spread() -> None:
    """Three runs of a policy: every numeric figure is the median over them, the rest
    is the first run's; the spread is (largest - smallest) / median."""
    runs = [{"policy": "a", "requests": 10, "ttft_median": 0.010, "ttft_p90": 0.030},
            {"policy": "a", "requests": 10, "ttft_median": 0.020, "ttft_p90": 0.025},
            {"policy": "a", "requests": 10, "ttft_median": 0.012, "ttft_p90": 0.090}]
    assert bench.median_summary(runs) == {"policy": "a", "requests": 10,
                                          "ttft_median": 0.012, "ttft_p90": 0.030}
    assert bench.spread([0.010, 0.020, 0.012]) == pytest.approx(0.010 / 0.012)
    assert bench.spread([0.5]) == 0.0


def test_benchmark_utilization_is_work_over_instance_time() -> None:
    """Two instances; requests at 0 s and 1 s, each 0.25 s of KV load + prefill, the
    last first token at 1.5 s: 0.5 s of work over 2 x 1.5 s."""
    recs = [SimpleNamespace(arrival=0.0, ttft=0.3, kv_load=0.05, prefill=0.2),
            SimpleNamespace(arrival=1.0, ttft=0.5, kv_load=0.0, prefill=0.25)]
    assert bench.utilization(SimpleNamespace(records=recs), 2) == pytest.approx(0.5 / 3.0)
    assert bench.utilization(SimpleNamespace(records=[]), 2) == 0.0


# -- the real engines' harness (benchmarks.vllm_engine): what runs without vLLM ---------
def test_vllm_harness_imports_without_vllm_and_its_migrations_are_routes() -> None:
    """The harness imports without vLLM (the benchmark says why it cannot run instead
    of failing); on engines that save every block to the store a migration is a plain
    route to the target, counted, in the simulator as on the engines."""
    from benchmarks import vllm_engine

    assert vllm_engine.VLLMEngineConfig().block_nbytes == 4 * 2 * 1 * 64 * 32 * 4
    with pytest.raises(InvalidInput):
        vllm_engine.VLLMEngineConfig(block_tokens=48)
    pol = vllm_engine.ThroughStore(bench.policy("migrate", bench.parse_args(
        ["--engine", "vllm"])))
    assert pol.name == "migrate"
    reqs = generate(WorkloadConfig.small(sessions=40, rate=40.0, gap_median=0.05, seed=2))
    costs = Costs(prefill_per_token=1e-3, block_tokens=32, cache_capacity_blocks=512)
    plain = simulate(reqs, bench.policy("migrate", bench.parse_args([])), instances=2,
                     costs=costs, cache_output=False, ewma_tau=0.1)
    through = simulate(reqs, pol, instances=2, costs=costs, cache_output=False,
                       ewma_tau=0.1)
    assert through.policy == "migrate" and pol.migrations > 0
    assert through.summary()["migrations"] == 0 < plain.summary()["migrations"]
    pol.reset()
    assert pol.migrations == 0
    a = bench.parse_args(["--engine", "vllm"])
    assert (a.instances, a.sessions, a.repeats, a.d_model, a.layers, a.max_num_seqs,
            a.load_sweep, a.fit_repeats, a.fit_trim) == (2, 160, 5, 256, 4, 1, "0.5,0.8", 2, 0.1)
    assert bench.grid(bench.parse_args(["--engine", "vllm", "--calibration-grid",
                                        "32,128/0,256"])) == {
        "new_tokens": (32, 128), "past_tokens": (0, 256)}
    toy = bench.parse_args(["--engine", "toy", "--repeats", "4"])
    assert (toy.fit_repeats, toy.fit_trim, toy.fit_policies) == (None, 0.0, "round_robin")
    for bad in (["--calibration-grid", "32,128"], ["--fit-trim", "0.5"], ["--fit-repeats", "0"]):
        with pytest.raises(SystemExit):
            bench.parse_args(["--engine", "vllm", *bad])


def test_busy_is_each_instances_serving_time_over_the_run() -> None:
    """Instance 0 serves 0-0.2 s and (batched beside it) 0.1-0.3 s: 0.3 s of the 1 s
    run; instance 1 serves 0.5-1.0 s."""
    recs = [SimpleNamespace(arrival=0.0, start=0.0, ttft=0.2, kv_load=0.0, prefill=0.2,
                            instance=0),
            SimpleNamespace(arrival=0.1, start=0.1, ttft=0.2, kv_load=0.05, prefill=0.15,
                            instance=0),
            SimpleNamespace(arrival=0.5, start=0.5, ttft=0.5, kv_load=0.0, prefill=0.5,
                            instance=1)]
    assert bench.busy(SimpleNamespace(records=recs), 2) == pytest.approx([0.3, 0.5])
    assert bench.busy(SimpleNamespace(records=[]), 2) == [0.0, 0.0]


def test_other_cores_is_the_hosts_cpu_less_ours_over_the_wall_time() -> None:
    """Over 2 s the host's busy CPU grew by 4 s and ours by 1 s: the others kept 1.5
    cores busy; /proc readings of this process are plausible."""
    from benchmarks._common import cpu_seconds, other_cores

    assert other_cores((10.0, 2.0), (14.0, 3.0), 2.0) == pytest.approx(1.5)
    assert other_cores(None, (1.0, 1.0), 1.0) is None
    assert other_cores((1.0, 1.0), (1.0, 1.5), 1.0) == 0.0  # never below 0
    now = cpu_seconds([os.getpid()])
    if now is not None:  # Linux
        assert now[0] > 0 and 0 < now[1] <= now[0]


def test_disturbed_runs_are_repeated_within_the_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """Other processes took 0.5, then 0.3, then 0.1 cores during successive runs: with
    0.15 allowed and 2 retries the third run is kept; with 1 retry the least disturbed
    of two, flagged; with no budget left, the first; without --max-others, the first."""
    seen: list[float] = []

    def fake_run(*_args):  # type: ignore[no-untyped-def]
        others = [0.5, 0.3, 0.1][len(seen)]
        seen.append(others)
        return {"real": {"others": others}}

    monkeypatch.setattr(bench, "one_run", fake_run)
    monkeypatch.setattr(bench, "wait_quiet", lambda *_: None)

    def kept(argv: list[str], budget: float = 60.0) -> tuple[float, int, int]:
        seen.clear()
        a = bench.parse_args(["--engine", "vllm", *argv])
        got = bench.quiet_run(None, [], "round_robin", a, None, {}, bench.RetryBudget(budget))
        return got["real"]["others"], got["retried"], got["disturbed"]

    assert kept([]) == (0.1, 2, 0)
    assert kept(["--retries", "1"]) == (0.3, 1, 1)
    assert kept([], budget=0.0) == (0.5, 0, 1)
    toy = bench.parse_args(["--engine", "toy"])
    seen.clear()
    got = bench.quiet_run(None, [], "round_robin", toy, None, {}, bench.RetryBudget(60.0))
    assert (got["real"]["others"], got["retried"], got["disturbed"]) == (0.5, 0, 0)
