"""The host's metrics (tensordb/client/_metrics.py, storage_engine/_latency.py): what
``tensordb metrics --home DIR`` exports after a workload of this process and of another
process of the host, read back with Prometheus' own parser; the latency files' checks;
and the Grafana dashboard's queries against what the exporter emits."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from typer.testing import CliRunner

import storage_engine as se
import tensordb
from tensordb import cli
from tensordb.client._metrics import METRICS
from tensordb.config import Config
from transport import NodeMetrics

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "deploy" / "grafana" / "tensordb.json"


def scrape(home: Path) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """``tensordb metrics --once`` in a fresh process: sample (name, labels) -> value."""
    r = subprocess.run([sys.executable, "-m", "tensordb.cli", "metrics", "--home", str(home),
                        "--once"], capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    out = {}
    for fam in text_string_to_metric_families(r.stdout):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def sample_names(families: list[tuple[str, str]]) -> set[str]:
    """The sample names a query may use of (family, type) pairs."""
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"),
                "gauge": ("",)}
    return {name + x for name, kind in families for x in suffixes[kind]}


def families_of(home: Path) -> list[tuple[str, str]]:
    r = subprocess.run([sys.executable, "-m", "tensordb.cli", "metrics", "--home", str(home),
                        "--once"], capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    return [(f.name, f.type) for f in text_string_to_metric_families(r.stdout)]


def value(samples: dict, name: str, **labels: str) -> float:
    key = (name, tuple(sorted(labels.items())))
    assert key in samples, f"{name}{labels} not exported: {sorted(k for k in samples if k[0] == name)}"
    return samples[key]


_CHILD = r"""
import sys, numpy as np, torch, tensordb
db = tensordb.connect(home=sys.argv[1])
db.commit("other", {"w": torch.ones(64)})
db.get("other", "w")
kv = db.kv("chat", block_tokens=16)
kv.put([b"c" * 16], [torch.ones(256)])
kv.get([b"c" * 16])
db.close()
"""


def test_the_exporter_reads_back_this_and_another_processes_work(home: Path) -> None:
    db = tensordb.connect(home=home)
    try:
        db.commit("llama", {"a": torch.randn(1000), "b": torch.zeros(10)})
        db.commit("llama", {"a": torch.randn(1000)})
        db.get("llama", "a")
        with db.snapshot("llama") as snap:
            snap["a"], snap["b"], snap["a"]  # two reads: the third is the snapshot's cache
        kv = db.kv("chat", block_tokens=16)
        keys = [bytes([i]) * 16 for i in range(5)]
        kv.put(keys, [torch.full((512,), float(i)) for i in range(5)])
        kv.get(keys[:3])
        assert kv.match([b"\xff" * 16]) == 0
        r = subprocess.run([sys.executable, "-c", _CHILD, str(home)], capture_output=True,
                           text=True, timeout=120, check=False)
        assert r.returncode == 0, r.stderr
        shared = kv.stats()
        s = scrape(home)
    finally:
        db.close()
    # the KV counters are the namespace's shared ones: this process's and the child's
    for c in ("hits", "misses", "evictions", "spills", "corrupt"):
        assert value(s, f"tensordb_kv_{c}_total", node="local", namespace="chat") == \
            getattr(shared, c), c
    assert shared.hits >= 4  # 3 blocks here, 1 in the child
    assert value(s, "tensordb_kv_blocks", node="local", namespace="chat", medium="host") == 6
    assert value(s, "tensordb_kv_bytes", node="local", namespace="chat", medium="host") == \
        shared.host_bytes > 0
    cap = value(s, "tensordb_kv_capacity_bytes", node="local", namespace="chat")
    assert cap == shared.capacity
    assert value(s, "tensordb_kv_occupancy_ratio", node="local", namespace="chat") == \
        pytest.approx(shared.host_bytes / cap)
    # latencies of both processes (the child's file folded in after it exited)
    assert value(s, "tensordb_commit_seconds_count", node="local") == 3
    assert value(s, "tensordb_read_seconds_count", node="local") == 4  # 3 here, 1 in the child
    assert value(s, "tensordb_commit_seconds_bucket", node="local", le="+Inf") == 3
    assert value(s, "tensordb_commit_seconds_sum", node="local") > 0
    assert value(s, "tensordb_pull_seconds_count", node="local") == 0
    assert value(s, "tensordb_latency_files_skipped", node="local") == 0
    # the catalog's view: heads, and nothing to pull on the only node
    assert value(s, "tensordb_head_version", collection="llama") == 2
    assert value(s, "tensordb_head_version", collection="other") == 1
    assert value(s, "tensordb_replication_lag_bytes", node="local", collection="llama") == 0
    assert value(s, "tensordb_store_bytes", node="local", tier="host") > 0
    assert value(s, "tensordb_scrub_rounds_total", node="local") >= 0
    # one live file at most remains (this process's); the child's was folded
    files = list((Config.resolve(None, home=home).shm_dir / "metrics").glob("lat-*.f64"))
    assert len(files) <= 1


def test_policy_runs_are_counted_per_outcome(home: Path) -> None:
    with tensordb.connect(home=home) as db:
        db.commit("llama", {"a": torch.ones(4)})
    runner = CliRunner()
    r = runner.invoke(cli.app, ["--home", str(home), "query",
                                "CREATE POLICY tick EVERY '200 milliseconds' "
                                "DO SELECT count(*) AS n FROM collections"])
    assert r.exit_code == 0, r.output
    r = runner.invoke(cli.app, ["--home", str(home), "policies", "run", "--duration", "1.0"])
    assert r.exit_code == 0, r.output
    s = scrape(home)
    n = value(s, "tensordb_policy_runs_total", policy="tick", outcome="ok")
    assert n >= 2
    assert value(s, "tensordb_policy_last_run_seconds", policy="tick") > 1.7e9


def test_damaged_latency_files_are_skipped_never_trusted(tmp_path: Path) -> None:
    root = tmp_path / "metrics"
    log = se.LatencyLog(root)
    log.observe("commit", 0.002)
    log.observe("commit", float("nan"))  # a bad figure counts as 0 s, never raises
    (live,) = root.glob("lat-*.f64")
    got = se.read_latencies(root)
    assert got.counts["commit"] == 2 and got.processes == 1 and got.skipped == 0
    assert got.sums["commit"] == pytest.approx(0.002)
    # a file of another (dead) process, damaged in each way the checks look for
    good = live.read_bytes()
    cases = {"short": good[:-8], "magic": b"\0" * 8 + good[8:]}
    arr = np.frombuffer(good, np.float64).copy()
    arr[-1] = -1.0
    cases["negative"] = arr.tobytes()
    arr = np.frombuffer(good, np.float64).copy()
    arr[4 + 3] += 0.5  # a fractional bucket count
    cases["fraction"] = arr.tobytes()
    arr = np.frombuffer(good, np.float64).copy()
    arr[4] = np.inf
    cases["infinite"] = arr.tobytes()
    boot = se.current_holder().rsplit(":", 2)[0]
    dead = root / f"lat-{boot}_{(1 << 22) + 7}_1.f64"  # a pid past pid_max: gone
    for name, raw in cases.items():
        dead.write_bytes(raw)
        got = se.read_latencies(root)
        assert got.skipped == 1, name
        assert got.counts["commit"] == 2, name  # the damaged file added nothing
        assert not dead.exists(), name  # removed, not folded
    # a whole file of a dead process is folded in once, and stays counted
    dead.write_bytes(good)
    assert se.read_latencies(root).counts["commit"] == 4
    assert not dead.exists() and (root / "retired.f64").exists()
    assert se.read_latencies(root).counts["commit"] == 4
    # a damaged retired.f64 is set aside, never added to
    (root / "retired.f64").write_bytes(b"junk")
    got = se.read_latencies(root)
    assert got.skipped == 1 and got.counts["commit"] == 2
    dead.write_bytes(good)  # the next fold sets the damaged sum aside and starts anew
    got = se.read_latencies(root)
    assert got.skipped == 1 and got.counts["commit"] == 4
    assert (root / "retired.f64.damaged").read_bytes() == b"junk"


def test_a_released_log_goes_on_counting(tmp_path: Path) -> None:
    """A store closing unmaps the process's file; its next observation maps the same
    file again and adds to it."""
    log = se.LatencyLog(tmp_path)
    log.observe("read", 0.01)
    log.release()
    log.observe("read", 0.01)
    got = se.read_latencies(tmp_path)
    assert got.counts["read"] == 2 and got.processes == 1


def test_every_dashboard_panel_queries_a_metric_the_exporter_emits(home: Path) -> None:
    with tensordb.connect(home=home) as db:
        db.commit("llama", {"a": torch.ones(4)})
        db.kv("chat", block_tokens=16).put([b"k" * 16], [torch.ones(8)])
    families = families_of(home)
    assert dict(families) == METRICS  # every family, even empty, of its type
    emitted = sample_names(families)
    # the node server's own transfer metrics (transport/_metrics.py), same endpoint
    node_own = sample_names([(f.name, f.type) for f in NodeMetrics("n").registry.collect()])
    dash = json.loads(DASHBOARD.read_text())
    assert dash["panels"]
    seen = set()
    for panel in dash["panels"]:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            names = set(re.findall(r"\btensordb_[a-z_]+", target["expr"]))
            assert names, (panel["title"], target["expr"])
            for name in names:
                assert name in emitted or name in node_own, (panel["title"], name)
                seen.add(re.sub(r"(_total|_bucket|_sum|_count)$", "", name))
    # and every family the exporter has is on some panel, except the checks' own count
    missing = set(METRICS) - seen - {"tensordb_latency_files_skipped",
                                     "tensordb_kv_arena_bytes", "tensordb_kv_blocks",
                                     "tensordb_scrub_round_segments"}
    assert not missing, missing


def test_metrics_off_loopback_without_a_token_is_refused(home: Path) -> None:
    r = CliRunner().invoke(cli.app, ["metrics", "--home", str(home), "--host", "0.0.0.0"],
                           env={"TENSORDB_TOKEN": "", "TENSORDB_TOKEN_FILE": ""})
    assert r.exit_code != 0
    assert "need a token" in r.output
