"""Calibration: the simulator's cost model fitted on the toy engine.

``_instance.measure_toy_engine`` runs inside a toy engine instance (its process,
threads and store) and times the pieces a request's TTFT is made of: the prefill over a
grid of new and cached tokens, a local hit, a store load and a migration per block.

:func:`fit_costs` turns the measurements into :class:`Costs`: a least-squares fit, in
relative error, of ``prefill = overhead + a n + b (n p + n (n + 1) / 2) + c p`` (the
``c p`` term, stacking the cached blocks for attention, is charged to each cached block
as part of its hit or load cost), the measured per-block costs, and the toy engine's
cache capacity. :func:`calibrate` does both on a running :class:`EngineCluster` (the toy
engine's, or any whose instances answer ``calibrate`` with the same measurements:
``benchmarks.vllm_engine``'s).

A bare probe does not see what a loaded run gets on a host with no core to spare (the
router and the toy engines' saving threads take CPU too). :func:`fit_under_load` runs
loaded workloads on the cluster and :func:`fit_records` fits, on every request's record,
the contention, the per-request overhead, the compute speed and the hand-offs.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import statistics
from collections.abc import Sequence
from typing import Any

import numpy as np

from engine_bindings.router import Costs, Request, RequestRecord, SimResult, simulate
from tensordb.errors import InvalidInput

from ._cluster import EngineCluster
from ._engine import ToyEngineConfig

__all__ = ["CONTENTION_GRID", "PROBE_REPS", "calibrate", "dispatch_overhead", "fit_costs",
           "fit_error", "fit_records", "fit_under_load", "recalibrate"]


def fit_costs(measured: dict[str, Any], cfg: ToyEngineConfig, contention: float = 0.0
              ) -> Costs:
    """The simulator's costs for a toy engine of ``cfg`` from ``measure_toy_engine``'s
    result (see the module doc for the model fitted); ``contention``: how much longer
    a prefill takes per other instance prefilling beside it (instances sharing a CPU;
    0 when each has cores of its own)."""
    rows = np.array(measured["prefill"], dtype=np.float64)
    if len(rows) < 4:
        raise InvalidInput(f"fitting the prefill cost takes at least 4 measurements, got "
                           f"{len(rows)}")
    n, p, t = rows[:, 0], rows[:, 1], rows[:, 2]
    x = np.stack([np.ones_like(n), n, n * p + n * (n + 1) / 2], axis=1)
    w = 1.0 / t  # relative error: short prefills matter as much as long ones
    coef = np.linalg.lstsq(x * w[:, None], t * w, rcond=None)[0]
    if (coef < 0).any():  # a negative term is noise: fit again without it
        keep = coef >= 0
        sub = np.linalg.lstsq(x[:, keep] * w[:, None], t * w, rcond=None)[0]
        coef = np.zeros(3)
        coef[keep] = np.maximum(sub, 0.0)
    overhead, per_token, per_pair = (float(c) for c in coef)
    stack = measured["stack_per_block"]
    return Costs(
        prefill_per_token=per_token, prefill_per_token_ctx=per_pair,
        request_overhead=overhead,
        hit_per_block=measured["hit_per_block"] + stack,
        kv_load_per_block=measured.get("load_per_block", 0.0) + stack,
        transfer_per_block=measured.get("transfer_per_block", 0.0),
        decode_per_token=0.0, block_tokens=cfg.block_tokens,
        cache_capacity_blocks=cfg.cache_blocks, contention=contention)


def fit_error(measured: dict[str, Any], costs: Costs) -> float:
    """The largest relative error of ``costs``' prefill time against the
    measurements."""
    return max(abs(costs.prefill(int(p), int(n)) - t) / t for n, p, t in measured["prefill"])


#: contention values tried by :func:`fit_records`; a probe's is capped at the largest
CONTENTION_GRID = tuple(round(0.05 * i, 2) for i in range(31))


#: repetitions of a speed probe (the fastest is taken): enough to outlast the slow
#: spells of a shared host (docs/routing.md has the figures)
PROBE_REPS = 15


def _probe(cluster: EngineCluster, n: int, p: int, spec: dict[str, Any], *,
           together: bool = True) -> tuple[float, float | None]:
    """One grid point's prefill time (the fastest of ``PROBE_REPS``) in instance 0
    alone, then (``together``) in all at once: the mean over the instances of each
    one's fastest; None without ``together``."""
    probe = {**spec, "new_tokens": (n,), "past_tokens": (p,), "probe": True,
             "reps": max(PROBE_REPS, spec.get("reps", 0))}
    alone = cluster.calibrate(0, **probe)["prefill"][0][2]
    if not together:
        return alone, None
    if cluster.n == 1:
        return alone, alone
    return alone, statistics.mean(x["prefill"][0][2] for x in cluster.calibrate_all(**probe))


def _contention(instances: int, alone: float, together: float) -> float:
    """How much longer a prefill takes per other instance prefilling beside it."""
    if instances < 2:
        return 0.0
    # capped: a probe that caught a slow spell of one instance must not set a whole run
    return min(max(CONTENTION_GRID), max(0.0, (together / alone - 1) / (instances - 1)))


def calibrate(cluster: EngineCluster, **spec: Any) -> tuple[Costs, dict[str, Any]]:
    """Measure ``cluster``'s toy engines and fit the simulator's costs; returns ``(costs,
    measurements)``. The grid is measured in instance 0 alone; then its longest point
    (the least noisy) alone and in every instance at once: how much slower the latter
    is, spread over the other instances, is ``Costs.contention`` (the host's CPU as the
    instances really get it, other processes on it included); :func:`fit_under_load`
    can then fit it, and the rest, on loaded runs."""
    m = cluster.calibrate(0, **spec)
    n, p, _ = max(m["prefill"], key=lambda r: r[2])
    alone, together = _probe(cluster, n, p, spec)
    assert together is not None
    m.update(probe=(n, p), probe_alone=alone, contended_prefill=together, spec=spec)
    costs = fit_costs(m, cluster.cfg, _contention(cluster.n, alone, together))
    m["fit_max_rel_error"] = fit_error(m, costs)
    latency, extra = dispatch_overhead(cluster, costs)
    m["dispatch_latency"], m["dispatch_overhead"] = latency, extra
    costs = dataclasses.replace(costs, request_overhead=costs.request_overhead + extra,
                                dispatch_latency=latency)
    return costs, m


def dispatch_overhead(cluster: EngineCluster, costs: Costs, *, requests: int = 12,
                      spacing: float = 0.05) -> tuple[float, float]:
    """What a request costs beyond its prefill, measured end to end: a few requests
    that never queue (``spacing`` apart, round robin, fresh sessions: nothing cached)
    through the router into the instance processes, against the simulator's TTFT for
    the same requests with ``costs``. Returns ``(latency, busy)``: ``latency``, the
    median wait before an idle instance starts a request (the hand-off from the router
    to its worker thread: a delay, not work), and ``busy``, the median of what the
    rest of the real TTFT exceeds the simulator's by (the toy engine's bookkeeping
    around the prefill, which the prefill grid does not see), never below 0."""
    bt = cluster.cfg.block_tokens
    sizes = (2 * bt + 5, 5 * bt + 3, 9 * bt + 1)
    probe = [Request(f"calibration-{i}", i * spacing, sizes[i % len(sizes)])
             for i in range(requests)]
    real = cluster.run(probe, "round_robin").records
    sim = simulate(probe, "round_robin", instances=cluster.n, costs=costs,
                   shared_store=cluster.cfg.use_store, cache_output=False).records
    latency = max(0.0, statistics.median(r.queue for r in real))
    busy = max(0.0, statistics.median(r.ttft - r.queue - s.ttft
                                      for r, s in zip(real, sim, strict=True)))
    return latency, busy


def _busy_shares(records: Sequence[RequestRecord], instances: int) -> np.ndarray:
    """``T[j, m]``: seconds of request ``j``'s service (its start to its first token)
    during which ``m`` other instances were serving too, from one run's records."""
    edges = []
    for j, r in enumerate(records):
        edges.append((r.start, 1, j))
        edges.append((r.start + r.kv_load + r.prefill, 0, j))  # ends first at a tie
    edges.sort()
    shares = np.zeros((len(records), instances))
    active: set[int] = set()
    last = 0.0
    for t, kind, j in edges:
        if active and t > last:
            m = min(len(active) - 1, instances - 1)
            for a in active:
                shares[a, m] += t - last
        last = t
        (active.add if kind else active.discard)(j)
    return shares


def _handoffs(records: Sequence[RequestRecord]) -> tuple[list[float], list[float]]:
    """From one run's records: the tails (an instance's time from a first token to the
    start of a request that arrived before that one started: long in its queue, so
    nothing but the tail delays it) and the hand-offs (an idle instance's time from a
    request's arrival to its start: arrived after the last request's tail). Requests
    that waited for a migration are in neither."""
    by: dict[int, list[RequestRecord]] = {}
    for r in sorted(records, key=lambda r: r.start):
        by.setdefault(r.instance, []).append(r)
    tails: list[float] = []
    pairs: list[tuple[float, RequestRecord]] = []
    for lst in by.values():
        if not lst[0].migrated_blocks:
            pairs.append((-math.inf, lst[0]))
        for p, q in itertools.pairwise(lst):
            end = p.start + p.kv_load + p.prefill
            if q.migrated_blocks:
                continue
            if q.arrival < p.start:
                tails.append(max(0.0, q.start - end))
            elif q.arrival >= end:
                pairs.append((end, q))
    tail = statistics.mean(tails) if tails else 0.0
    lat = [q.start - q.arrival for end, q in pairs if q.arrival >= end + tail]
    return tails, lat


def fit_records(results: Sequence[SimResult], costs: Costs, instances: int, *,
                trim: float = 0.0) -> tuple[Costs, dict[str, Any]]:
    """The simulator's costs fitted on the records of loaded runs (real ones, of
    ``instances`` instances): ``costs``' per-token and per-block terms give each
    request's compute ``M`` for the hits it had; its service time ``S`` (start to first
    token) is, under the simulator's processor sharing with contention ``c``, work
    ``W(c) = sum over m of T[m] / (1 + c m)`` (``T[m]``: its time with ``m`` other
    instances serving, from the other records). For each ``c`` of ``CONTENTION_GRID``
    a least-squares fit of ``W(c) = overhead + speed * M`` (in seconds, so the fitted
    services add up to the real ones); the ``c`` that fits best wins. So the fit sees
    what a bare probe cannot: the CPU the router and the toy engines' saving threads
    take, the per-request overhead, and how much slower compute runs on a loaded host,
    on every request of the runs. Beside it, from the same records: ``request_tail``, the
    mean time a backlogged instance takes from a first token to its next start, and
    ``dispatch_latency``, the mean time an idle instance takes from an arrival to the
    start. ``trim`` (0 to 0.5) leaves the fraction of requests that fit worst out of each
    ``c``'s fit (least trimmed squares: fitted on all, then again on the rest, judged on
    the rest): on a host that other work shares, a request whose prefill that work
    preempted is the host's, not the engine's, and one in ten of them was enough to
    triple the fitted contention of vLLM's engines. Returns ``(costs, fit)``."""
    if not 0.0 <= trim < 0.5:
        raise InvalidInput(f"trim must be in [0, 0.5), got {trim}")
    bt = costs.block_tokens
    bare = dataclasses.replace(costs, request_overhead=0.0)
    service, compute, shares, tails, lat = [], [], [], [], []
    for res in results:
        recs = res.records
        if not recs:
            continue
        shares.append(_busy_shares(recs, instances))
        for r in recs:
            service.append(r.kv_load + r.prefill)
            compute.append(bare.service(r.prompt_tokens, r.cached_tokens // bt,
                                        r.loaded_tokens // bt))
        t, d = _handoffs(recs)
        tails += t
        lat += d
    if len(service) < 3:
        raise InvalidInput(f"fitting costs on runs takes at least 3 requests, got "
                           f"{len(service)}")
    m_ = np.array(compute)
    t_ = np.concatenate(shares)
    # least squares in seconds, not relative: with the overhead term the fitted services
    # add up to the real ones, so the simulated instances are as busy as the real were
    x = np.stack([np.ones_like(m_), m_], axis=1)
    best: tuple[float, float, float, float, np.ndarray, np.ndarray] | None = None
    everyone = np.ones(len(m_), dtype=bool)
    for c in CONTENTION_GRID:
        work = (t_ / (1.0 + c * np.arange(instances))).sum(axis=1)
        overhead, speed = _fit_line(x, work, everyone)
        keep = everyone
        if trim:
            res = np.abs(overhead + speed * m_ - work)
            keep = res <= np.quantile(res, 1.0 - trim)
            overhead, speed = _fit_line(x, work, keep)
        err = float(np.sum((overhead + speed * m_[keep] - work[keep]) ** 2))
        if best is None or err < best[0]:
            best = (err, c, overhead, speed, work, keep)
    assert best is not None
    _, c, overhead, speed, work, keep = best
    tail = statistics.mean(tails) if tails else 0.0
    # the mean: a hand-off's slow tail (the instance's threads waiting for a core)
    # delays requests as much as its usual time does
    latency = statistics.mean(lat) if lat else costs.dispatch_latency
    fitted = dataclasses.replace(
        costs, contention=c, request_overhead=overhead, request_tail=tail,
        dispatch_latency=max(0.0, latency),
        prefill_per_token=costs.prefill_per_token * speed,
        prefill_per_token_ctx=costs.prefill_per_token_ctx * speed,
        hit_per_block=costs.hit_per_block * speed,
        kv_load_per_block=costs.kv_load_per_block * speed)
    rel = np.abs((overhead + speed * m_) / np.maximum(work, 1e-9) - 1)
    return fitted, {"contention": c, "speed": speed, "overhead": overhead, "tail": tail,
                    "dispatch_latency": fitted.dispatch_latency, "requests": len(service),
                    "rel_error_median": float(np.median(rel)),
                    "rel_error_p90": float(np.percentile(rel, 90)),
                    "trim": trim, "trimmed": int(len(keep) - keep.sum())}


def _fit_line(x: np.ndarray, work: np.ndarray, keep: np.ndarray) -> tuple[float, float]:
    """``(overhead, speed)``: least squares of ``work`` on ``x``'s rows ``keep``, the
    overhead never below 0 (a negative term is noise: fitted again without it)."""
    overhead, speed = np.linalg.lstsq(x[keep], work[keep], rcond=None)[0]
    if overhead < 0:
        overhead, speed = 0.0, float(np.linalg.lstsq(x[keep, 1:], work[keep],
                                                     rcond=None)[0][0])
    return float(overhead), max(float(speed), 1e-6)


def fit_under_load(cluster: EngineCluster, costs: Costs, measured: dict[str, Any],
                   workloads: Sequence[Sequence[Request]], *,
                   policy: str | Sequence[str] = "round_robin", repeats: int = 1,
                   trim: float = 0.0) -> Costs:
    """``costs`` fitted on loaded real runs (:func:`fit_records`): on a host with no core
    to spare, what a bare probe sees of the contention, the per-request overhead, the
    compute speed and the hand-offs is not what a loaded run gets. Each of ``workloads``
    (calibration workloads, never ones that are compared) goes through ``cluster`` with
    ``policy`` (or with each of several routing policies: ones that balance load and
    ones that pile sessions onto their instance load the cores differently),
    ``repeats`` times in turn, and every request of every run is fitted (but the
    ``trim`` fraction that fits worst: :func:`fit_records`). The last
    workload runs once untimed first, as a warm-up. The fit is recorded in
    ``measured["load_fit"]``, with each
    workload's real median and p90 TTFT (medians over the repeats) beside the
    simulator's with the fitted costs; :func:`recalibrate` keeps it."""
    if not workloads or not all(workloads):
        raise InvalidInput("fit_under_load needs at least one non-empty workload")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise InvalidInput(f"repeats must be an integer >= 1, got {repeats!r}")
    policies = [policy] if isinstance(policy, str) else list(policy)
    if not policies or not all(isinstance(p, str) for p in policies):
        raise InvalidInput(f"policy must be a policy name or a list of them, got {policy!r}")
    # one untimed run first: the toy engines' first loaded run faults in the memory their
    # caches and the store's slabs will reuse, which every later run finds ready
    cluster.reset()
    cluster.run(workloads[-1], policies[0])
    cases = [(work, pol) for work in workloads for pol in policies]
    runs: list[list[SimResult]] = [[] for _ in cases]
    for _ in range(repeats):
        for i, (work, pol) in enumerate(cases):
            cluster.reset()
            runs[i].append(cluster.run(work, pol))
    fitted, fit = fit_records([r for got in runs for r in got], costs, cluster.n,
                              trim=trim)
    reals = [SimResult.median_summary([r.summary() for r in got]) for got in runs]
    sims = [simulate(work, pol, instances=cluster.n, costs=fitted,
                     shared_store=cluster.cfg.use_store, cache_output=False).summary()
            for work, pol in cases]
    err = sum(abs(float(np.log(sim[k] / real[k])))
              for sim, real in zip(sims, reals, strict=True) for k in ("ttft_median", "ttft_p90"))
    measured["contention_probe"] = costs.contention
    measured["load_fit"] = {
        **fit, "policy": policies[0] if len(policies) == 1 else policies,
        "workloads": [len(w) for w in workloads], "repeats": repeats,
        "overhead_probe": costs.request_overhead, "log_error": err,
        "runs": [{"policy": pol, "requests": len(work),
                  "real_median": r["ttft_median"], "real_p90": r["ttft_p90"],
                  "sim_median": s_["ttft_median"], "sim_p90": s_["ttft_p90"]}
                 for (work, pol), r, s_ in zip(cases, reals, sims, strict=True)]}
    return fitted


def recalibrate(cluster: EngineCluster, costs: Costs, measured: dict[str, Any], *,
                rescale: bool = True) -> tuple[Costs, dict[str, float]]:
    """``costs`` brought up to the host's speed now: the probe point of
    :func:`calibrate` measured again (a second or two), the compute terms scaled by
    how much slower or faster it runs alone, the contention measured afresh (unless
    :func:`fit_under_load` fitted it: then it is kept, and not probed). On a
    host whose other load changes, this keeps the simulator on the machine it is
    compared with, without looking at any request of the run. The instances are reset
    first (queues drained, blocks still being saved in the store, caches emptied), so
    the probe sees the host as a run starts, not the tail of the last one. Without
    ``rescale`` the speed is measured and reported but the costs keep their speed."""
    cluster.reset()
    n, p = measured["probe"]
    fitted = "load_fit" in measured  # fitted on loaded runs: a bare probe cannot see it
    alone, together = _probe(cluster, n, p, measured.get("spec", {}), together=not fitted)
    f = alone / measured["probe_alone"]
    contention = costs.contention if together is None else \
        _contention(cluster.n, alone, together)
    g = f if rescale else 1.0
    return dataclasses.replace(
        costs, request_overhead=costs.request_overhead * g,
        prefill_per_token=costs.prefill_per_token * g,
        prefill_per_token_ctx=costs.prefill_per_token_ctx * g,
        contention=contention), {"speed_factor": f, "rescaled": rescale,
                                 "contention": contention}
