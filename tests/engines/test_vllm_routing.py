"""The routing benchmark on real engines (``benchmarks/routing.py --engine vllm``): two
vLLM CPU engine processes sharing the store through ``TensorDBConnector`` behind the
router, every routing policy run on them beside the simulator calibrated on them.

Skipped, saying why, where vLLM is not its CPU build (``make e2e-vllm``); an import
error of ours fails. A short run: a dozen sessions, one repeat, a small calibration
grid, no fit under load and no repeated runs (those are the benchmark's to do, at its
scale).
"""

from __future__ import annotations

import json

import pytest

import benchmarks.routing as bench
from benchmarks import vllm_engine

from .engine_support import why_no_forward

pytestmark = [
    pytest.mark.engine("vllm"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]

POLICIES = ("round_robin", "least_load", "cache_aware", "migrate")


@pytest.fixture(scope="module", autouse=True)
def cpu_engine() -> None:
    reason = why_no_forward()
    if reason:
        pytest.skip(reason)
    assert vllm_engine.why_not() is None  # the benchmark's own check agrees


def test_short_run_prints_every_policy_beside_the_simulator(
        capsys: pytest.CaptureFixture[str]) -> None:
    rc = bench.main(["--engine", "vllm", "--sessions", "12", "--repeats", "1",
                     "--load-sweep", "0.6", "--probe-contention", "--retries", "0",
                     "--calibration-grid", "32,128/0,256", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == (0 if all(g["met"] for g in out["goals"]) else 1)
    # judged on figures: no goal is left "not measured" where vLLM runs
    assert {g["state"] for g in out["goals"]} <= {"met", "missed"}
    e = out["vllm_engine"]
    assert e["vllm"] and e["cache_blocks"] >= 512 and e["threads"] == 1
    assert e["store_namespace"].startswith("vllm/")
    rows = {r["policy"]: r for r in out["rows"]}
    assert sorted(rows) == sorted(POLICIES)
    assert out["measured"]["load_per_block"] > 0  # the connector loaded from the store
    for r in rows.values():
        real, sim = r["real"], r["sim"]
        assert r["load"] == "0.60" and real["requests"] == sim["requests"] > 12
        for fig in (real, sim):
            assert 0 < fig["ttft_median"] <= fig["ttft_p90"] <= fig["ttft_p99"]
            assert 0 <= fig["local_hit_rate"] <= fig["hit_rate"] <= 1
            assert len(fig["busy"]) == 2 and all(0 <= b <= 1 for b in fig["busy"])
            assert 0 < sum(fig["busy"]) / 2 <= 1
        assert r["retried"] == 0 and r["disturbed"] in (0, 1)  # the host's, reported
        assert real["others"] is None or real["others"] >= 0
        assert r["err_median"] == pytest.approx(
            sim["ttft_median"] / real["ttft_median"] - 1)
    # sessions repeat their prefix: the policy that follows it hits the engine's own
    # prefix cache more than the one that deals requests out in turn, which loads the
    # rest from the store instead
    rr, ca = rows["round_robin"]["real"], rows["cache_aware"]["real"]
    assert ca["local_hit_rate"] > rr["local_hit_rate"]
    assert rr["hit_rate"] - rr["local_hit_rate"] > 0
    # the simulator sees the same routing: the same hits where no timing decides them
    assert rows["round_robin"]["sim"]["hit_rate"] == pytest.approx(rr["hit_rate"], abs=0.05)
    assert out["ordering"]["0.60"]["real"] and out["ordering"]["0.60"]["sim"]
