"""Cluster mode with real processes: node servers on loopback ports sharing a catalog,
remote reads, the replication cascade, token auth, failures.

Three node servers (``tensordb serve``) start once per catalog: a, b and c, whose
outgoing streams are throttled so a test can kill it mid-transfer. The test process
attaches clients to their stores, as a process on each host would. The catalog is an
embedded SQLite file the processes of this host share (so token checks and replication
run without a PostgreSQL server), then a real PostgreSQL where one answers.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from conftest import PG_BASE, _pg_admin, require_pg
from sqlalchemy import text

import tensordb
from tensordb.catalog import NodeDirectory
from tensordb.errors import InvalidInput, NodeUnavailable, NotFound, Unauthorized
from transport import THROTTLE_ENV, FlightTransport, pull_segment

TOKEN = "cluster-test-token"
THROTTLE = 4 << 20  # bytes/s out of node c: an 8 MiB segment takes 2 s
READY_S = 240.0  # a loaded 2-core machine takes tens of seconds to import torch


@dataclass
class Node:
    name: str
    home: Path
    data: Path
    proc: subprocess.Popen[str]
    address: str = ""
    metrics_port: int = 0

    def connect(self, url: str, **kw: object) -> tensordb.Database:
        return tensordb.connect(url, node=self.name, home=self.home, data_dir=self.data,
                                token=TOKEN, node_timeout=2.0, **kw)


@dataclass
class Cluster:
    url: str
    nodes: dict[str, Node]
    clients: dict[str, tensordb.Database]

    def db(self, name: str) -> tensordb.Database:
        if name not in self.clients:
            self.clients[name] = self.nodes[name].connect(self.url)
        return self.clients[name]


SPARE = 4 << 20  # node b keeps a pre-faulted spare this large for incoming replicas


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


DATA_PORT_A = _free_port()  # node a's data plane listens where --data-port says


def _spawn(url: str, name: str, root: Path, env: dict[str, str], *extra: str) -> Node:
    home = root / name
    home.mkdir(parents=True)
    cmd = [sys.executable, "-m", "tensordb.cli", "--home", str(home), "serve",
           "--catalog", url, "--node", name, "--data-dir", str(home / "data"), "--port", "0",
           "--token", TOKEN, "--metrics-port", "0", "--heartbeat", "0.5", *extra]
    with open(home / "serve.log", "w") as log:  # read when a test fails
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
    return Node(name, home, home / "data", proc)


def _await_ready(node: Node, deadline: float) -> None:
    assert node.proc.stdout is not None
    while time.monotonic() < deadline:
        ready, _, _ = select.select([node.proc.stdout], [], [], 1.0)
        if ready:
            line = node.proc.stdout.readline()
            if not line:
                break
            info = json.loads(line)
            node.address, node.metrics_port = info["address"], info["metrics_port"]
            return
        if node.proc.poll() is not None:
            break
    raise RuntimeError(f"node {node.name} did not start (exit {node.proc.poll()})")


@pytest.fixture(scope="module", params=["sqlite", pytest.param(
    "postgres", marks=pytest.mark.postgres)])
def catalog(request: pytest.FixtureRequest,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The cluster's catalog URL: a SQLite file, or a fresh PostgreSQL database."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path_factory.mktemp('catalog') / 'catalog.db'}"
        return
    require_pg()
    name = f"tensordb_test_{uuid.uuid4().hex[:12]}"
    admin = _pg_admin()
    with admin.connect() as c:
        c.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield f"{PG_BASE}/{name}"
    finally:
        with admin.connect() as c:
            c.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@pytest.fixture(scope="module")
def cluster(catalog: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    url = catalog
    root = tmp_path_factory.mktemp("cluster")
    base = {**os.environ, "TENSORDB_KV_CAPACITY": str(16 << 20)}
    base.pop(THROTTLE_ENV, None)
    tensordb.connect(url, node="setup", home=root / "setup").close()  # migrate once
    nodes = {"a": _spawn(url, "a", root, base, "--data-port", str(DATA_PORT_A)),
             "b": _spawn(url, "b", root, base, "--spare-bytes", str(SPARE))}
    nodes["c"] = _spawn(url, "c", root, {**base, THROTTLE_ENV: str(THROTTLE)})
    cl = Cluster(url, nodes, {})
    try:
        deadline = time.monotonic() + READY_S
        for node in nodes.values():
            _await_ready(node, deadline)
        yield cl
    finally:
        for node in nodes.values():
            if node.proc.poll() is None:
                node.proc.kill()
            node.proc.wait()
            if node.proc.stdout is not None:
                node.proc.stdout.close()
        for db in cl.clients.values():
            db.close()
        for n in ("setup", *nodes):
            cfg = tensordb.Config.resolve(url, home=root / n,
                                          data_dir=root / n / "data" if n != "setup" else None)
            shutil.rmtree(cfg.shm_dir, ignore_errors=True)


def _metrics(node: Node) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{node.metrics_port}/metrics",
                                timeout=10) as r:
        return r.read().decode()


def _metric(body: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in body.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line
                                                for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _part_files(db: tensordb.Database) -> list[str]:
    return [p.name for t in ("host", "disk") for p in db.tier(t).root.glob("*.part-*")]


# -- tests ---------------------------------------------------------------------------------
def test_nodes_register_with_address_tiers_and_heartbeat(cluster: Cluster) -> None:
    directory = NodeDirectory(cluster.db("a").catalog.engine)
    live = directory.live()
    assert {"a", "b", "c"} <= set(live)
    for name in ("a", "b", "c"):
        info = live[name]
        assert info.address == cluster.nodes[name].address and info.state == "up"
        assert set(info.tiers) == {"host", "disk"}
    before = live["a"].heartbeat_at
    deadline = time.monotonic() + 20  # beats every 0.5 s; a loaded host may stall a few
    while directory.live()["a"].heartbeat_at == before and time.monotonic() < deadline:
        time.sleep(0.2)
    logs = (cluster.nodes["a"].home / "serve.log").read_text()
    assert directory.live()["a"].heartbeat_at > before, logs  # type: ignore[operator]


def test_commit_on_one_node_read_on_another(cluster: Cluster) -> None:
    a, b = cluster.db("a"), cluster.db("b")
    w = torch.randn(256, 64)
    h = torch.arange(10, dtype=torch.bfloat16)
    a.commit("remote", {"w": w, "h": h, "empty": torch.empty(0)})
    assert torch.equal(b.get("remote", "w"), w)
    with b.snapshot("remote", verify=True) as snap:
        got = snap.state_dict()
    assert torch.equal(got["h"], h) and got["empty"].numel() == 0
    (seg,) = {r for r, _ in NodeDirectory(b.catalog.engine).version_segments(
        b.catalog.require("remote").id, 1)}
    assert ("b" in NodeDirectory(b.catalog.engine).holders(seg)
            and (seg, "b", "host") in NodeDirectory(b.catalog.engine).replicas("b"))
    assert _part_files(b) == []
    body = _metrics(cluster.nodes["a"])
    assert _metric(body, "tensordb_bytes_out_total", node="a", tier="host") >= w.nbytes
    assert _metric(body, "tensordb_extents", node="a", tier="host") >= 1
    assert "tensordb_transfer_seconds_bucket" in body and "tensordb_leases" in body
    # the host's view beside the node's own: b's client pulled (its latency file is
    # read by b's server), b holds the head and c does not (replication lag)
    body_b, body_c = _metrics(cluster.nodes["b"]), _metrics(cluster.nodes["c"])
    assert _metric(body_b, "tensordb_pull_seconds_count", node="b") >= 1
    assert 'tensordb_replication_lag_bytes{collection="remote",node="b"} 0.0' in body_b \
        or 'tensordb_replication_lag_bytes{node="b",collection="remote"} 0.0' in body_b
    assert _metric(body_c, "tensordb_replication_lag_bytes", node="c",
                   collection="remote") >= w.nbytes
    assert _metric(body_b, "tensordb_head_version", collection="remote") == 1
    # served locally from then on: the bytes come from b's own tier
    assert b.tier("host").open(seg) is not None


def _spare_ready(cluster: Cluster, node: str, at_least: int) -> int:
    transport = FlightTransport(TOKEN, timeout=10)
    try:
        deadline = time.monotonic() + 60
        while (ready := transport.ping(node, cluster.nodes[node].address)["spare_ready"]) \
                < at_least and time.monotonic() < deadline:
            time.sleep(0.05)
        return ready
    finally:
        transport.close()


def test_node_server_keeps_a_spare_for_replicas(cluster: Cluster) -> None:
    a = cluster.db("a")
    assert _spare_ready(cluster, "b", SPARE) == SPARE
    assert _spare_ready(cluster, "a", 0) == 0  # started without one
    x = torch.randn(512, 1024)  # 2 MiB: fits the spare
    a.commit("spare-use", {"x": x})
    a.replicate("spare-use", to=["b"])
    # the replica landed in b's spare, renamed into place; b refills it in the background
    (seg,) = {r for r, _ in NodeDirectory(a.catalog.engine).version_segments(
        a.catalog.require("spare-use").id, 1)}
    assert "b" in NodeDirectory(a.catalog.engine).holders(seg)
    assert _spare_ready(cluster, "b", SPARE) == SPARE
    assert torch.equal(cluster.db("b").get("spare-use", "x"), x)


def test_replicate_is_a_cascade(cluster: Cluster) -> None:
    a, c = cluster.db("a"), cluster.db("c")
    a.commit("fan", {"x": torch.arange(100_000, dtype=torch.int32)})
    a.commit("fan", {"x": torch.arange(100_000, dtype=torch.int32), "y": torch.ones(7)})
    assert a.replicate("fan", to=["b", "c"]) == ["b", "c"]
    report = a.last_replication
    assert len(report.rounds) == 2 and report.rounds[0] == [("a", "b")]
    assert sorted(report.rounds[1]) == [("a", "c")] and not report.failed
    directory = NodeDirectory(a.catalog.engine)
    segs = [s for s, _ in directory.version_segments(a.catalog.require("fan").id, 2)]
    assert len(segs) == 2 and all({"a", "b", "c"} <= set(directory.holders(s)) for s in segs)
    b_pulled = _metric(_metrics(cluster.nodes["b"]), "tensordb_bytes_in_total", node="b")
    assert b_pulled >= 100_000 * 4
    assert torch.equal(c.get("fan", "y"), torch.ones(7))
    # idempotent: holders are not sent the version again
    a.last_replication = None
    assert a.replicate("fan", to="c") == ["c"] and a.last_replication is None


def test_replicate_bad_input_changes_nothing(cluster: Cluster) -> None:
    a = cluster.db("a")
    a.commit("strict", {"x": torch.ones(4)})
    directory = NodeDirectory(a.catalog.engine)
    directory.register("ghost", "127.0.0.1:9", ["host"], None)
    directory.deregister("ghost")
    before = directory.replicas()
    for call, err in [
        (lambda: a.replicate("strict", to=[]), InvalidInput),
        (lambda: a.replicate("strict", to=["nowhere"]), NotFound),
        (lambda: a.replicate("strict", version=9, to=["b"]), NotFound),
        (lambda: a.replicate("strict", to=["b", "ghost"]), NodeUnavailable),
        (lambda: a.pull_kv("ns", ["not-bytes"]), InvalidInput),  # type: ignore[list-item]
    ]:
        with pytest.raises(err):
            call()
    assert directory.replicas() == before


def test_request_without_token_is_refused(cluster: Cluster) -> None:
    addr = cluster.nodes["a"].address
    for token in (None, "wrong-token"):
        with pytest.raises(Unauthorized) as info:
            FlightTransport(token, timeout=5).ping("a", addr)
        assert info.value.node == "a"
    assert FlightTransport(TOKEN, timeout=5).ping("a", addr)["node"] == "a"


def test_segment_bytes_take_the_data_plane(cluster: Cluster) -> None:
    import numpy as np

    from transport._dataplane import fetch_into

    a = cluster.db("a")
    w = torch.randn(1 << 18)  # 1 MiB: more than one report of received bytes
    a.commit("plane", {"w": w})
    (seg,) = {r for r, _ in NodeDirectory(a.catalog.engine).version_segments(
        a.catalog.require("plane").id, 1)}
    addr = cluster.nodes["a"].address
    good = FlightTransport(TOKEN, timeout=5)
    port = good.ping("a", addr)["data_port"]
    assert port == DATA_PORT_A
    want = np.frombuffer(w.numpy().tobytes(), np.uint8)
    for transport in (good, FlightTransport(TOKEN, timeout=5, data_plane=False)):
        dst = np.zeros(want.size, np.uint8)
        seen: list[int] = []
        transport.read_segment_into("a", addr, seg, 0, dst, seen.append)
        assert np.array_equal(dst, want) and sum(seen) == want.size
    # a range from the middle, as a resumed stream asks
    dst = np.zeros(1000, np.uint8)
    good.read_segment_into("a", addr, seg, 4096, dst, lambda n: None)
    assert np.array_equal(dst, want[4096:5096])

    def errors(payload: object) -> None:  # the error payload, as the data plane sent it
        raise RuntimeError(payload)

    host = addr.rsplit(":", 1)[0]
    for token, sid, offset, needle in ((None, seg, 0, "Unauthorized"),
                                       ("wrong", seg, 0, "Unauthorized"),
                                       (TOKEN, "no-such-segment", 0, "NotFound"),
                                       (TOKEN, seg, want.size, "InvalidInput")):
        with pytest.raises(RuntimeError, match=needle):
            fetch_into("a", host, port, token, sid, offset, np.zeros(16, np.uint8),
                       lambda n: None, 5.0, errors)
    with pytest.raises(NotFound):  # typed on the way out of the transport
        good.read_segment_into("a", addr, "no-such-segment", 0, np.zeros(8, np.uint8),
                               lambda n: None)
    good.close()


@pytest.mark.deadline
def test_dead_address_fails_fast(cluster: Cluster) -> None:
    with socket.socket() as s:  # a loopback port nobody listens on
        s.bind(("127.0.0.1", 0))
        closed = f"127.0.0.1:{s.getsockname()[1]}"
    for address, limit in ((closed, 3.0), ("10.255.255.1:7000", 3.0)):
        t0 = time.monotonic()
        with pytest.raises(NodeUnavailable):
            FlightTransport(TOKEN, timeout=1.0).ping("gone", address)
        assert time.monotonic() - t0 < limit
    # a node registered live whose server is gone: replicate fails within the timeout
    a = cluster.db("a")
    a.commit("dead-target", {"x": torch.ones(3)})
    NodeDirectory(a.catalog.engine).register("zombie", closed, ["host"], None)
    t0 = time.monotonic()
    with pytest.raises(NodeUnavailable) as info:
        a.replicate("dead-target", to=["zombie"])
    assert info.value.node == "zombie" and time.monotonic() - t0 < 5.0
    NodeDirectory(a.catalog.engine).deregister("zombie")


@pytest.mark.deadline
def test_lapsed_heartbeat_marks_node_down(cluster: Cluster) -> None:
    directory = NodeDirectory(cluster.db("a").catalog.engine, lapse=0.2)
    directory.register("brief", "127.0.0.1:9", ["host"], None)
    assert "brief" in directory.live()
    time.sleep(0.4)
    assert "brief" not in directory.live()
    assert "brief" in directory.mark_lapsed()
    assert directory.node("brief").state == "down"
    # with so short a lapse the real node servers (heartbeat every 0.5 s) were marked
    # down too: their next heartbeat brings them back, before the next test runs
    running = {n for n, node in cluster.nodes.items() if node.proc.poll() is None}
    deadline = time.monotonic() + 10
    while not running <= set(NodeDirectory(cluster.db("a").catalog.engine).live()):
        assert time.monotonic() < deadline, "a node server did not come back up"
        time.sleep(0.05)


def test_kv_blocks_by_key_from_another_node(cluster: Cluster) -> None:
    a, b = cluster.db("a"), cluster.db("b")
    kv_a = a.kv("qwen-test", block_tokens=4)
    keys = kv_a.keys(list(range(12)))
    blocks = [torch.full((2, 4, 8), float(i), dtype=torch.float16) for i in range(3)]
    kv_a.put(keys[:2], blocks[:2])
    assert b.pull_kv("qwen-test", keys, block_tokens=4, nodes=["a"]) == 2
    got = b.kv("qwen-test", block_tokens=4).get(keys[:2])
    assert all(torch.equal(g, x) for g, x in zip(got, blocks[:2], strict=True))
    assert b.pull_kv("qwen-test", keys[:2], block_tokens=4) == 0  # held already


def test_gc_keeps_registered_replicas_and_drops_them_with_their_segment(cluster: Cluster
                                                                       ) -> None:
    a, b = cluster.db("a"), cluster.db("b")
    a.commit("short-lived", {"x": torch.ones(1000)})
    b.get("short-lived", "x")
    directory = NodeDirectory(a.catalog.engine)
    (seg,) = [s for s, _ in directory.version_segments(a.catalog.require("short-lived").id, 1)]
    path = b.tier("host").path(seg)
    b.gc()
    assert path.exists()  # registered here: kept
    a.drop("short-lived")
    a.gc()
    assert directory.holders(seg) == {}  # the replica row went with its segment
    b.gc()
    assert not path.exists()


def test_holder_killed_mid_transfer(cluster: Cluster) -> None:
    """Two pulls stream from the throttled node c when it is killed: the one with another
    holder finishes from there, the other raises NodeUnavailable; neither leaves a
    half replica registered or a partial file."""
    a, b, c = cluster.db("a"), cluster.db("b"), cluster.db("c")
    only = torch.randn(2 << 20)  # 8 MiB each
    shared = torch.randn(2 << 20)
    c.commit("only-c", {"x": only})
    c.commit("shared", {"x": shared})
    directory = NodeDirectory(b.catalog.engine)
    (seg_only,) = [s for s, _ in directory.version_segments(b.catalog.require("only-c").id, 1)]
    (seg_shared,) = [s for s, _ in directory.version_segments(b.catalog.require("shared").id, 1)]
    a._pull([seg_shared])  # a holds it too (a throttled 2 s)
    tiers = {n: b.tier(n) for n in ("host", "disk")}
    results: dict[str, object] = {}

    def read_only() -> None:
        try:
            results["only"] = b.get("only-c", "x")
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            results["only"] = exc

    def read_shared() -> None:
        try:
            results["shared"] = pull_segment(directory, FlightTransport(TOKEN, 2.0), "b",
                                             tiers, seg_shared, prefer="c")
        except Exception as exc:  # noqa: BLE001
            results["shared"] = exc

    threads = [threading.Thread(target=read_only), threading.Thread(target=read_shared)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while len(_part_files(b)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)  # both streams are now well under way, nowhere near done
    assert len(_part_files(b)) == 2
    os.kill(cluster.nodes["c"].proc.pid, signal.SIGKILL)
    for t in threads:
        t.join(60)
    assert isinstance(results["only"], NodeUnavailable), results["only"]
    assert results["shared"] == "host"
    assert torch.equal(b.get("shared", "x"), shared)
    assert "b" not in directory.holders(seg_only)
    assert not b.tier("host").path(seg_only).exists() and _part_files(b) == []


def test_clean_shutdown_deregisters(cluster: Cluster) -> None:
    node = cluster.nodes["b"]
    node.proc.send_signal(signal.SIGTERM)
    assert node.proc.wait(60) == 0
    info = NodeDirectory(cluster.db("a").catalog.engine).node("b")
    assert info.state == "down"
    a = cluster.db("a")
    a.commit("after-b", {"x": torch.ones(2)})
    with pytest.raises(NodeUnavailable):
        a.replicate("after-b", to=["b"])
