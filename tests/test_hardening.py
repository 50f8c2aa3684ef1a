"""The node server against hostile and careless clients, and hostile peers: the data
plane survives accept() failing, stalling and dripping connections, and caps what they
hold; KV read tickets make no state; the token stays secret and strong; a KV answer is
trusted with nothing. Most run a ``NodeServer`` in this process on an embedded (SQLite)
catalog; the last runs ``tensordb serve`` in a process of its own, to exhaust its
descriptors for real (``prlimit``)."""

from __future__ import annotations

import errno
import json
import os
import resource
import select
import shutil
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.flight as fl
import pytest
import torch
from conftest import open_store, remove_store
from sqlalchemy import func
from sqlalchemy import select as sql_select

import tensordb
import transport
from tensordb.catalog import NodeDirectory
from tensordb.catalog.schema import kv_namespaces
from tensordb.errors import CorruptData, InvalidInput, NodeUnavailable, NotFound
from transport import FlightTransport, NodeMetrics, NodeServer
from transport._dataplane import DataPlaneServer, _recv_frame, _send_frame, fetch_into
from transport._flight_client import KV_SCHEMA, kv_blocks

TOKEN = "hardening-test-token-0123"
_LEN = struct.Struct(">I")


@pytest.fixture
def store(tmp_path: Path) -> Iterator[tensordb.Database]:
    db = open_store(tmp_path / "n1", node="n1")
    try:
        yield db
    finally:
        remove_store(db)


@pytest.fixture
def server(store: tensordb.Database) -> Iterator[NodeServer]:
    srv = NodeServer(store, token=TOKEN, timeout=1.0)
    try:
        yield srv
    finally:
        srv.close()


def _segment(db: tensordb.Database, collection: str) -> str:
    info = db.catalog.require(collection)
    (seg,) = [s for s, _ in NodeDirectory(db.catalog.engine).version_segments(info.id,
                                                                              info.head)]
    return seg


def _kv_state(db: tensordb.Database) -> tuple[int, list[str], list[str]]:
    """What KV namespaces the node has made: catalog rows, shm and disk directories."""
    with db.catalog.engine.connect() as conn:
        rows = conn.execute(sql_select(func.count()).select_from(kv_namespaces)).scalar_one()
    dirs = [sorted(p.name for p in (root / "kv").glob("*")) if (root / "kv").exists() else []
            for root in (Path(db.config.shm_dir), Path(db.config.data_dir))]
    return int(rows), dirs[0], dirs[1]


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _pull_bytes(server: NodeServer, seg: str, n: int) -> np.ndarray:
    """Read a segment's first ``n`` bytes over the node's data plane, as a pull does."""
    t = FlightTransport(TOKEN, timeout=2.0)
    try:
        dst = np.zeros(n, np.uint8)
        t.read_segment_into("n1", f"127.0.0.1:{server.port}", seg, 0, dst, lambda k: None)
        return dst
    finally:
        t.close()


# -- the data plane: accept errors, stalls, caps -------------------------------------------
def test_accept_failing_with_emfile_does_not_end_the_data_plane(
        store: tensordb.Database, server: NodeServer) -> None:
    """accept() failing (no descriptor left) pauses the plane; it serves again after."""
    x = torch.arange(4096, dtype=torch.int32)
    store.commit("m", {"x": x})
    seg = _segment(store, "m")
    plane = server.data_plane
    assert plane is not None
    real, fails = plane._accept_one, [5]

    def exhausted() -> socket.socket:
        if fails[0] > 0:
            fails[0] -= 1
            raise OSError(errno.EMFILE, "Too many open files")
        return real()

    plane._accept_one = exhausted  # type: ignore[method-assign]
    got = _pull_bytes(server, seg, x.numel() * 4)
    assert fails[0] == 0 and plane.accept_errors == 5
    assert np.array_equal(got.view(np.int32), x.numpy())


def test_stalled_connections_pin_no_thread_and_a_pull_still_completes(
        store: tensordb.Database, server: NodeServer) -> None:
    """Hundreds of connections that never finish their header: no thread each, the
    oldest closed past the cap, each closed at its deadline; a real read is served."""
    x = torch.randn(10_000)
    store.commit("m", {"x": x})
    seg = _segment(store, "m")
    plane = server.data_plane
    assert plane is not None
    threads = threading.active_count()
    stalled = []
    for i in range(300):
        s = socket.create_connection(("127.0.0.1", plane.port))
        if i % 2:
            s.sendall(_LEN.pack(100) + b'{"id"')  # half a header, then nothing
        stalled.append(s)
    try:
        got = _pull_bytes(server, seg, x.numel() * 4)
        assert np.array_equal(got.view(np.float32), x.numpy())
        assert threading.active_count() <= threads + 2  # the read's own thread, no more
        # past the cap (256 waiting) the oldest were closed, the rest at their deadline
        # (1 s after they were accepted): every stalled socket reads end-of-stream
        deadline = time.monotonic() + 30
        for s in stalled:
            s.settimeout(max(0.1, deadline - time.monotonic()))
            assert s.recv(1) == b""
    finally:
        for s in stalled:
            s.close()


def test_past_the_cap_a_new_connection_closes_the_oldest() -> None:
    data = memoryview(b"0123456789")
    plane = DataPlaneServer("127.0.0.1", 0, None, 60.0, lambda req: (data, lambda s: None),
                            lambda status: None, chunk=1 << 20, throttle=None,
                            max_connections=8)
    stalled = []
    try:
        for _ in range(20):
            stalled.append(socket.create_connection(("127.0.0.1", plane.port)))
            time.sleep(0.01)  # in order of arrival
        deadline = time.monotonic() + 30
        while plane.shed < 12 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert plane.shed == 12
        for s in stalled[:12]:  # the oldest: closed
            s.settimeout(30)
            assert s.recv(1) == b""
        readable, _, _ = select.select(stalled[12:], [], [], 0.2)
        assert readable == []  # the newest 8 still wait for their header (60 s)
        dst = np.zeros(10, np.uint8)
        fetch_into("n", "127.0.0.1", plane.port, None, "s", 0, dst, lambda n: None, 5.0,
                   lambda p: None)
        assert dst.tobytes() == b"0123456789"
    finally:
        for s in stalled:
            s.close()
        plane.close()


def test_transfers_are_capped_and_the_busy_answer_is_typed() -> None:
    """At most max_transfers run and as many wait; one more is refused NodeUnavailable."""
    release = threading.Event()
    started = threading.Semaphore(0)
    data = memoryview(bytes(64))

    def serve(req: dict[str, Any]) -> tuple[memoryview, Callable[[float], None]]:
        started.release()
        release.wait(20)
        return data, lambda s: None

    plane = DataPlaneServer("127.0.0.1", 0, None, 5.0, serve, lambda status: None,
                            chunk=1 << 20, throttle=None, node="n1", max_transfers=1)
    results: list[object] = []

    def read() -> None:
        try:
            fetch_into("n1", "127.0.0.1", plane.port, None, "s", 0, np.zeros(64, np.uint8),
                       lambda n: None, 20.0, lambda p: results.append(p))
            results.append("ok")
        except NodeUnavailable as exc:
            results.append(exc)

    try:
        readers = [threading.Thread(target=read) for _ in range(2)]
        for t in readers:
            t.start()
        assert started.acquire(timeout=20)  # one runs; the other is queued
        deadline = time.monotonic() + 20
        while plane._busy < 2 and time.monotonic() < deadline:
            time.sleep(0.01)

        def raise_error(payload: object) -> None:
            typed = transport.error_from_payload(payload, "n1")
            assert typed is not None, payload
            raise typed

        with pytest.raises(NodeUnavailable, match="is busy") as info:
            fetch_into("n1", "127.0.0.1", plane.port, None, "s", 0, np.zeros(64, np.uint8),
                       lambda n: None, 5.0, raise_error)
        assert info.value.node == "n1"
        release.set()
        for t in readers:
            t.join(20)
        assert results == ["ok", "ok"]
    finally:
        release.set()
        plane.close()


def test_a_client_that_stops_reading_frees_its_thread_at_the_deadline() -> None:
    """A reader that takes the answer and then reads nothing: the send fails once the
    transfer's deadline (timeout + length / min_rate) passes, and its thread is free."""
    data = memoryview(bytes(64 << 20))  # far more than the socket buffers hold
    done: list[float] = []
    plane = DataPlaneServer("127.0.0.1", 0, None, 0.5, lambda req: (data, done.append),
                            lambda status: None, chunk=1 << 20, throttle=None,
                            max_transfers=1, min_rate=float(1 << 40))
    try:
        s = socket.create_connection(("127.0.0.1", plane.port))
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
        _send_frame(s, {"id": "s", "offset": 0, "length": len(data)})
        assert _recv_frame(s) == {"ok": True}
        deadline = time.monotonic() + 30
        while plane._busy and time.monotonic() < deadline:
            time.sleep(0.05)
        assert plane._busy == 0 and done == []  # given up on, not counted as sent
        s.close()
    finally:
        plane.close()


def test_a_dripping_holder_fails_at_the_transfer_deadline() -> None:
    """A holder that sends a byte now and then, never stalling for the timeout: the
    read fails once timeout + length / min_rate seconds have passed."""
    srv = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def drip() -> None:
        conn, _ = srv.accept()
        try:
            _recv_frame(conn)
            _send_frame(conn, {"ok": True})
            while not stop.wait(0.1):
                conn.sendall(b"x")
        except OSError:
            pass
        finally:
            conn.close()

    t = threading.Thread(target=drip, daemon=True)
    t.start()
    try:
        seen: list[int] = []
        with pytest.raises(NodeUnavailable, match="the most a transfer that size may take"):
            fetch_into("n", "127.0.0.1", srv.getsockname()[1], None, "s", 0,
                       np.zeros(1000, np.uint8), seen.append, 1.0, lambda p: None,
                       min_rate=1000.0)  # 1 + 1000 / 1000: 2 s for what drips in 100
        assert 0 < sum(seen) < 1000  # what arrived was handed over, to resume from
    finally:
        stop.set()
        t.join(5)
        srv.close()


def test_a_dripping_flight_stream_fails_at_the_transfer_deadline(
        store: tensordb.Database, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same deadline on the Flight path (a node without a data plane)."""
    monkeypatch.setenv(transport.THROTTLE_ENV, str(32 << 10))  # 64 KiB every 2 s
    store.commit("m", {"x": torch.zeros(256 << 10, dtype=torch.uint8)})
    seg = _segment(store, "m")
    srv = NodeServer(store, timeout=3.0, data_plane=False)
    t = FlightTransport(None, timeout=3.0, min_rate=float(1 << 20))
    try:  # 8 s to send, 3.25 s allowed, and never 3 s without a chunk
        with pytest.raises(NodeUnavailable, match="the most a transfer that size may take"):
            t.read_segment("n1", f"127.0.0.1:{srv.port}", seg, 0, 256 << 10, lambda v: None)
        with pytest.raises(InvalidInput, match="min_rate"):
            FlightTransport(None, min_rate=0)
    finally:
        t.close()
        srv.close()


# -- KV read tickets make nothing -----------------------------------------------------------
def test_kv_tickets_for_unknown_namespaces_make_no_state(
        store: tensordb.Database, server: NodeServer) -> None:
    address = f"127.0.0.1:{server.port}"
    t = FlightTransport(TOKEN, timeout=2.0)
    try:
        t.ping("n1", address)
        before, fds = _kv_state(store), _open_fds()
        for i in range(200):
            with pytest.raises(NotFound) as info:
                t.read_kv("n1", address, f"ns-{i}", 16, [b"k" * 16])
            assert info.value.node == "n1" and f"'ns-{i}'" in str(info.value)
        assert _kv_state(store) == before == (0, [], [])
        assert _open_fds() <= fds + 16  # not 3 descriptors per namespace
        # a namespace the node has opened still answers, and an unknown one is a miss
        # for pull_kv, not an error
        kv = store.kv("held", block_tokens=4, capacity_bytes=1 << 20, slab_bytes=64 << 10)
        keys = kv.keys(list(range(8)))
        kv.put(keys, [torch.ones(4), torch.zeros(4)])
        assert [b[0] for b in t.read_kv("n1", address, "held", 4, keys)] == keys
    finally:
        t.close()


def test_flight_errors_carry_no_sql_text(store: tensordb.Database) -> None:
    """A catalog error quoting its statement reaches the client typed, without the SQL."""
    from transport.testing import RaisingStore

    store.commit("m", {"x": torch.ones(8)})
    seg = _segment(store, "m")
    raising = RaisingStore(store)
    srv = NodeServer(raising, timeout=2.0)
    raising.error = NodeUnavailable(
        "the catalog did not answer for 5.0 s (3 attempts): (psycopg.OperationalError) "
        "connection refused\n[SQL: SELECT secret_column FROM nodes WHERE name = %(n)s]\n"
        "[parameters: {'n': 'a'}]\n(Background on this error at: https://sqlalche.me/e/20/e3q8)",
        node="catalog")
    t = FlightTransport(None, timeout=2.0)
    plain = fl.FlightClient(f"grpc+tcp://127.0.0.1:{srv.port}")
    try:
        address = f"127.0.0.1:{srv.port}"
        calls: dict[str, Callable[[], object]] = {
            "segment": lambda: t.read_segment("n1", address, seg, 0, 8, lambda v: None),
            "into": lambda: t.read_segment_into("n1", address, seg, 0,
                                                np.zeros(8, np.uint8), lambda n: None),
            "kv": lambda: t.read_kv("n1", address, "ns", 4, [b"k"])}
        for what, call in calls.items():
            with pytest.raises(NodeUnavailable) as info:
                call()
            text = str(info.value)
            assert "connection refused" in text and info.value.node == "catalog", what
            assert "SELECT" not in text and "secret_column" not in text, what
        with pytest.raises(fl.FlightServerError) as raw:
            plain.do_get(fl.Ticket(json.dumps({"kind": "segment", "id": seg, "offset": 0,
                                               "length": 8}).encode())).read_all()
        assert "NodeUnavailable: " in str(raw.value) and "SELECT" not in str(raw.value)
    finally:
        plain.close()
        t.close()
        srv.close()


def test_a_failure_mid_stream_arrives_without_its_traceback(
        store: tensordb.Database, server: NodeServer, monkeypatch: pytest.MonkeyPatch) -> None:
    store.commit("m", {"x": torch.ones(8)})
    seg = _segment(store, "m")

    def broken(*args: object) -> None:
        raise OSError(2, "No such file or directory", "/secret/place/x")

    monkeypatch.setattr(server.service.metrics, "sent", broken)  # after the last chunk
    t = FlightTransport(TOKEN, timeout=2.0, data_plane=False)
    try:
        with pytest.raises(NodeUnavailable) as info:
            t.read_segment("n1", f"127.0.0.1:{server.port}", seg, 0, 32, lambda v: None)
        text = str(info.value)
        assert "OSError" in text or "FileNotFoundError" in text
        assert "Traceback" not in text and "/secret/place" not in text and 'File "' not in text
    finally:
        t.close()


# -- tokens ---------------------------------------------------------------------------------
def test_weak_tokens_are_refused_at_start(store: tensordb.Database) -> None:
    for weak in ("t", "a" * 15, " " * 20, "\t" * 16, " padded-token-of-20 ",
                 "token-with-a-newline\n", "tøken-not-ascii-1234"):
        with pytest.raises(InvalidInput) as info:
            NodeServer(store, token=weak)
        assert len(weak.strip()) < 4 or weak.strip() not in str(info.value)  # not echoed
    NodeServer(store, token="x" * 16).close()


def test_token_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    assert transport.resolve_token(None, path) == TOKEN
    monkeypatch.delenv("TENSORDB_TOKEN", raising=False)
    monkeypatch.setenv(transport.TOKEN_FILE_ENV, str(path))
    assert transport.resolve_token(None) == TOKEN
    assert tensordb.Config.resolve(home=tmp_path / "s").token == TOKEN
    path.write_text("  \n")
    with pytest.raises(InvalidInput, match="is empty"):
        transport.resolve_token(None)
    with pytest.raises(InvalidInput, match="cannot read"):
        transport.resolve_token(None, tmp_path / "absent")
    with pytest.raises(InvalidInput, match="not both"):
        transport.resolve_token(TOKEN, path)
    with pytest.raises(InvalidInput, match="is empty"):  # clients read the file too
        tensordb.Config.resolve(home=tmp_path / "s")
    assert tensordb.Config.resolve(home=tmp_path / "s", token=TOKEN).token == TOKEN


def test_two_authorization_headers_are_refused(server: NodeServer) -> None:
    client = fl.FlightClient(f"grpc+tcp://127.0.0.1:{server.port}")
    good = (b"authorization", f"Bearer {TOKEN}".encode())
    try:
        list(client.do_action(fl.Action("ping", b"{}"), fl.FlightCallOptions(headers=[good])))
        for extra in (good, (b"authorization", b"Bearer wrong")):
            with pytest.raises(fl.FlightUnauthenticatedError):
                list(client.do_action(fl.Action("ping", b"{}"),
                                      fl.FlightCallOptions(headers=[good, extra])))
    finally:
        client.close()


def test_the_token_is_never_echoed_by_the_data_plane(server: NodeServer) -> None:
    plane = server.data_plane
    assert plane is not None
    for req in ({"token": TOKEN, "id": 5, "offset": "x", "length": None},
                {"token": TOKEN + "-wrong", "id": "s", "offset": 0, "length": 8}):
        with socket.create_connection(("127.0.0.1", plane.port), timeout=5) as s:
            _send_frame(s, req)
            answer = _recv_frame(s)
        assert "error" in answer and TOKEN not in json.dumps(answer)


def test_metrics_off_loopback_need_the_token() -> None:
    metrics = NodeMetrics("n1")
    port = metrics.serve(0, "0.0.0.0", TOKEN)
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            with pytest.raises(urllib.error.HTTPError) as info:
                urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10)
            assert info.value.code == 401
            info.value.close()
        req = urllib.request.Request(url, headers={"Authorization": f"Bearer {TOKEN}"})
        with urllib.request.urlopen(req, timeout=10) as r:
            assert b"tensordb_requests" in r.read()
    finally:
        metrics.close()
    local = NodeMetrics("n1")  # on loopback: the host's users may scrape
    port = local.serve(0, "127.0.0.1", TOKEN)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            assert r.status == 200
    finally:
        local.close()


# -- a KV answer from a hostile peer ----------------------------------------------------------
def _kv_table(rows: list[tuple[Any, Any, Any, Any, Any]]) -> pa.Table:
    cols = list(zip(*rows, strict=True))
    return pa.Table.from_arrays([pa.array(list(c), f.type) for c, f in zip(cols, KV_SCHEMA,
                                                                          strict=True)],
                                schema=KV_SCHEMA)


def test_kv_answers_with_bad_shapes_or_layouts_are_corrupt_data() -> None:
    good = (b"k" * 16, "float16", "2,3", bytes(12), "0")
    assert kv_blocks(_kv_table([good]), "p")[0][2] == (2, 3)
    for shape in ("a,b", "-1,2", "2,,3", str(2**64), "1e3", " 2", "٣"):
        with pytest.raises(CorruptData) as info:
            kv_blocks(_kv_table([(b"k" * 16, "float16", shape, bytes(12), "0")]), "p")
        assert info.value.node == "p"
    with pytest.raises(CorruptData, match="null"):
        kv_blocks(_kv_table([(b"k" * 16, None, "2", bytes(4), "0")]), "p")
    with pytest.raises(CorruptData, match="columns"):
        kv_blocks(pa.table({"key": [b"k"]}), "p")


# -- the node server survives abuse, in a process of its own ---------------------------------
READY_S = 240.0  # a loaded 2-core machine takes tens of seconds to import torch


def _await_ready(proc: subprocess.Popen[str], log: Path) -> dict[str, Any]:
    assert proc.stdout is not None
    deadline = time.monotonic() + READY_S
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 1.0)
        if ready:
            line = proc.stdout.readline()
            if line:
                return dict(json.loads(line))
            break
        if proc.poll() is not None:
            break
    raise RuntimeError(f"the node did not start (exit {proc.poll()}): {log.read_text()}")


def _proc_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_the_node_server_keeps_serving_after_abuse(tmp_path: Path) -> None:
    """500 connections that stall, 200 KV read tickets for new namespaces and descriptor
    exhaustion (accept() failing EMFILE): a legitimate pull still completes after."""
    url = f"sqlite:///{tmp_path / 'catalog.db'}"
    home = tmp_path / "a"
    home.mkdir()
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    env = {k: v for k, v in os.environ.items()
           if k not in ("TENSORDB_TOKEN", transport.THROTTLE_ENV)}
    cmd = [sys.executable, "-m", "tensordb.cli", "--home", str(home), "serve", "--catalog",
           url, "--node", "a", "--data-dir", str(home / "data"), "--port", "0",
           "--token-file", str(token_file), "--heartbeat", "0.5"]
    log = home / "serve.log"
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
    a = r = None
    try:
        info = _await_ready(proc, log)
        cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes()
        assert TOKEN.encode() not in cmdline  # the token is read from its file
        a = tensordb.connect(url, node="a", home=home, data_dir=home / "data",
                             token=TOKEN, node_timeout=2.0)
        w = torch.randn(1 << 20)  # 4 MiB
        a.commit("m", {"w": w})
        t = FlightTransport(TOKEN, timeout=2.0)
        address = info["address"]
        data_port = int(t.ping("a", address)["data_port"])

        # 200 KV read tickets for namespaces that do not exist: NotFound, nothing made
        fds = _proc_fds(proc.pid)
        for i in range(200):
            with pytest.raises(NotFound):
                t.read_kv("a", address, f"probe-{i}", 16, [b"k" * 16])
        assert _kv_state(a) == (0, [], [])
        assert _proc_fds(proc.pid) <= fds + 8

        # descriptor exhaustion: the server may open only a few more, and 500
        # connections arrive that never send a header
        soft, hard = resource.prlimit(proc.pid, resource.RLIMIT_NOFILE)
        resource.prlimit(proc.pid, resource.RLIMIT_NOFILE, (_proc_fds(proc.pid) + 16, hard))
        stalled = []
        try:
            for _ in range(500):  # connect without waiting: the backlog fills up
                s = socket.socket()
                s.setblocking(False)
                s.connect_ex(("127.0.0.1", data_port))
                stalled.append(s)
            deadline = time.monotonic() + 60
            while "could not accept" not in log.read_text() and time.monotonic() < deadline:
                time.sleep(0.1)
            assert "could not accept" in log.read_text()  # accept() did fail, EMFILE
        finally:
            resource.prlimit(proc.pid, resource.RLIMIT_NOFILE, (soft, hard))
        for s in stalled[1::2]:  # half of them send the start of a header, then stall
            try:
                s.send(_LEN.pack(100))
            except OSError:
                pass  # not connected yet, or closed by the node already
        # descriptors are free again (the stalled clients still hold their sockets)
        directory = NodeDirectory(a.catalog.engine)
        deadline = time.monotonic() + 30
        while "a" not in directory.live() and time.monotonic() < deadline:
            time.sleep(0.2)  # a beat that failed for want of a descriptor comes back
        r = tensordb.connect(url, node="r", home=tmp_path / "r", data_dir=tmp_path / "r" / "d",
                             token=TOKEN, node_timeout=2.0)
        t0 = time.perf_counter()
        got = r.get("m", "w")
        seconds = time.perf_counter() - t0
        assert torch.equal(got, w)
        assert directory.holders(_segment(a, "m")) == {"a": "host", "r": "host"}
        for s in stalled:
            s.close()
        t.close()
        print(f"\nlegitimate pull of 4 MiB after the abuse: {seconds * 1000:.0f} ms")
        assert proc.poll() is None
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
        for db in (a, r):
            if db is not None:
                db.close()
                shutil.rmtree(db.config.shm_dir, ignore_errors=True)
