"""Pulling segments between nodes, and the transport contract, in one process.

Two nodes share a catalog, and the transport is ``transport.LocalTransport`` (each
node's handlers called in process) with faults added (a damaged byte, a stream cut), so
checksums, resumption and registration are tested without a network. The contract suite
of ``transport.testing`` runs against ``LocalTransport`` and against ``FlightTransport``
on loopback to a ``NodeServer`` of this process. Real processes: test_transport.py."""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import open_store, remove_store

import tensordb
import tensordb.errors
import transport
from tensordb.catalog import NodeDirectory
from tensordb.errors import (
    CommitConflict,
    CorruptData,
    InvalidInput,
    NodeUnavailable,
    NotFound,
    QueryError,
    TensorDBError,
)
from transport import ExtentHasher, LocalTransport, NodeStore, pull_segment, split_ranges
from transport.testing import TransportTests


class FaultyTransport(LocalTransport):
    """The in-process transport over the nodes of ``stores``, streaming ``chunk`` bytes
    at a time; ``damage`` flips the byte at that offset of a segment, ``cut_after`` makes
    a stream die after that many bytes (once); ``reads`` records each segment read."""

    def __init__(self, stores: dict[str, tensordb.Database], chunk: int = 1000) -> None:
        super().__init__()
        self.chunk = chunk
        for db in stores.values():
            self.add(db, chunk_bytes=chunk)
        self.damage: int | None = None
        self.cut_after: int | None = None
        self.reads: list[tuple[str, int, int]] = []
        #: flip the first byte of the KV block of this key on its way out
        self.damage_kv: bytes | None = None
        #: rewrite a KV answer on its way out (a hostile peer)
        self.tamper_kv: Callable[[list[transport.KVBlock]], list[transport.KVBlock]] | None \
            = None

    def read_segment(self, node: str, address: str, segment_id: str, offset: int, length: int,
                     sink: Callable[[memoryview], None]) -> None:
        self.ping(node, address)
        self.reads.append((node, offset, length))
        pos, sent = offset, 0

        def faulty(view: memoryview) -> None:
            nonlocal pos, sent
            if self.cut_after is not None and sent >= self.cut_after:
                self.cut_after = None
                raise NodeUnavailable(f"node {node!r} died mid-stream", node=node)
            if self.damage is not None and pos <= self.damage < pos + len(view):
                bad = np.frombuffer(view, np.uint8).copy()
                bad[self.damage - pos] ^= 0xFF
                view = memoryview(bad)
            sink(view)
            pos += len(view)
            sent += len(view)

        super().read_segment(node, address, segment_id, offset, length, faulty)

    def read_kv(self, node: str, address: str, namespace: str, block_tokens: int,
                keys: Sequence[bytes]) -> list[transport.KVBlock]:
        blocks = super().read_kv(node, address, namespace, block_tokens, keys)
        out = []
        for key, dtype, shape, data, digest in blocks:
            if key == self.damage_kv:
                data = data.copy()
                data[0] ^= 0xFF
            out.append((key, dtype, shape, data, digest))
        return self.tamper_kv(out) if self.tamper_kv is not None else out


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[tuple[tensordb.Database, tensordb.Database, FaultyTransport]]:
    """Node "w" (the writer) and node "r" (the reader) on one SQLite catalog."""
    url = f"sqlite:///{tmp_path / 'catalog.db'}"
    w = open_store(tmp_path / "w", url, node="w")
    r = open_store(tmp_path / "r", url, node="r")
    fake = FaultyTransport({"w": w})
    r._flight = fake
    NodeDirectory(w.catalog.engine).register("w", "in-process", ["host", "disk"], None)
    try:
        yield w, r, fake
    finally:
        remove_store(r)
        remove_store(w)


def _segment(db: tensordb.Database, collection: str) -> str:
    (seg,) = [s for s, _ in NodeDirectory(db.catalog.engine).version_segments(
        db.catalog.require(collection).id, db.catalog.require(collection).head)]
    return seg


def _leftovers(db: tensordb.Database) -> list[str]:
    return sorted(p.name for t in ("host", "disk") for p in db.tier(t).root.glob("*.seg"))


def test_public_surface() -> None:
    assert set(transport.__all__) >= {"NodeServer", "FlightTransport", "Transport",
                                      "pull_segment", "cascade", "start_node", "NodeMetrics",
                                      "LocalTransport", "NodeService", "NodeStore",
                                      "KVBlocks", "ERROR_KINDS"}
    assert all(hasattr(transport, n) for n in transport.__all__)


def test_read_pulls_verifies_and_registers(pair) -> None:  # type: ignore[no-untyped-def]
    w, r, fake = pair
    tensors = {"a": torch.randn(300), "b": torch.arange(7, dtype=torch.int64),
               "c": torch.ones(2, 3, dtype=torch.bfloat16)}
    w.commit("m", tensors)
    with r.snapshot("m", verify=True) as snap:
        got = snap.state_dict()
    assert all(torch.equal(got[k], v) for k, v in tensors.items())
    seg = _segment(w, "m")
    assert NodeDirectory(r.catalog.engine).holders(seg) == {"w": "host", "r": "host"}
    reads = len(fake.reads)
    assert torch.equal(r.get("m", "a"), tensors["a"]) and len(fake.reads) == reads  # local now
    assert _leftovers(r) == [f"{seg}.seg"]


def test_damaged_bytes_are_never_registered(pair) -> None:  # type: ignore[no-untyped-def]
    w, r, fake = pair
    w.commit("m", {"a": torch.randn(1000)})
    fake.damage = 123
    with pytest.raises(CorruptData):
        r.get("m", "a")
    seg = _segment(w, "m")
    assert "r" not in NodeDirectory(r.catalog.engine).holders(seg) and _leftovers(r) == []
    fake.damage = None
    assert r.get("m", "a").shape == (1000,)


def test_a_kv_block_failing_its_checksum_is_never_kept(pair) -> None:  # type: ignore[no-untyped-def]
    w, r, fake = pair
    kv_w = w.kv("ns", block_tokens=4, capacity_bytes=1 << 20, slab_bytes=64 << 10)
    keys = kv_w.keys(list(range(8)))
    blocks = [torch.full((2, 4, 8), float(i), dtype=torch.float16) for i in range(2)]
    assert kv_w.put(keys, blocks) == 2
    fake.damage_kv = keys[1]
    with pytest.raises(CorruptData) as info:
        r.pull_kv("ns", keys, block_tokens=4, nodes=["w"])
    assert info.value.node == "w" and keys[1].hex() in str(info.value)
    kv_r = r.kv("ns", block_tokens=4)
    assert kv_r.contains(keys) == [False, False]  # neither block of the damaged batch
    fake.damage_kv = None
    assert r.pull_kv("ns", keys, block_tokens=4, nodes=["w"]) == 2
    got = kv_r.get(keys)
    assert all(torch.equal(g, b) for g, b in zip(got, blocks, strict=True))


def test_a_kv_answer_is_trusted_with_nothing(pair) -> None:  # type: ignore[no-untyped-def]
    """A peer that plants a block under a key never asked for (a poisoned prefix hit
    later), sends one twice, names a dtype torch lacks, a shape its bytes do not fill,
    or bytes that fail their checksum: CorruptData naming the node, nothing kept."""
    from storage_engine import checksum

    w, r, fake = pair
    kv_w = w.kv("ns", block_tokens=4, capacity_bytes=1 << 20, slab_bytes=64 << 10)
    keys = kv_w.keys(list(range(12)))
    blocks = [torch.full((2, 4), float(i), dtype=torch.float16) for i in range(3)]
    assert kv_w.put(keys[:2], blocks[:2]) == 2
    kv_r = r.kv("ns", block_tokens=4)
    planted = np.frombuffer(torch.full((2, 4), 9.0, dtype=torch.float16).numpy().tobytes(),
                            np.uint8)

    def plant(out: list[transport.KVBlock]) -> list[transport.KVBlock]:
        return [*out, (keys[2], "float16", (2, 4), planted, checksum(planted))]

    def twice(out: list[transport.KVBlock]) -> list[transport.KVBlock]:
        return [*out, out[0]]

    def retype(dtype: str) -> Callable[[list[transport.KVBlock]], list[transport.KVBlock]]:
        return lambda out: [(k, dtype, s_, d, c) for k, _, s_, d, c in out]

    def reshape(out: list[transport.KVBlock]) -> list[transport.KVBlock]:
        return [(k, dt, (3, 4), d, c) for k, dt, _, d, c in out]

    def huge(out: list[transport.KVBlock]) -> list[transport.KVBlock]:
        return [(k, dt, (0, 2**62, 2**62), d[:0], checksum(d[:0])) for k, dt, _, d, _ in out]

    def flip(out: list[transport.KVBlock]) -> list[transport.KVBlock]:
        k, dt, s_, d, c = out[0]
        d = d.copy()
        d[0] ^= 1
        return [(k, dt, s_, d, c), *out[1:]]

    cases = {"planted": (plant, "never asked for"), "twice": (twice, "never asked for"),
             "no-dtype": (retype("float99"), "no torch dtype"),
             "attr": (retype("load"), "no torch dtype"),
             "dunder": (retype("__class__"), "no torch dtype"),
             "reshape": (reshape, "bytes, not the"), "overflow": (huge, "overflows int64"),
             "checksum": (flip, "fails its checksum")}
    for case, (tamper, says) in cases.items():
        fake.tamper_kv = tamper
        with pytest.raises(CorruptData, match=says) as info:
            r.pull_kv("ns", keys[:2], block_tokens=4, nodes=["w"])
        assert info.value.node == "w" and info.value.collection == "ns", case
        assert kv_r.contains(keys) == [False, False, False], case  # nothing of it kept
    fake.tamper_kv = None
    assert r.pull_kv("ns", keys[:2], block_tokens=4, nodes=["w"]) == 2
    assert all(torch.equal(g, b) for g, b in zip(kv_r.get(keys[:2]), blocks[:2], strict=True))
    # a node that never opened the namespace is a miss, not an error, and opens nothing
    assert r.pull_kv("other", keys[:2], block_tokens=4, nodes=["w"]) == 0
    assert NodeDirectory(w.catalog.engine).kv_nodes("other") == ["r"]


def test_cut_stream_resumes_at_the_next_holder(pair, tmp_path: Path  # type: ignore[no-untyped-def]
                                               ) -> None:
    w, r, fake = pair
    x = torch.randn(5000)
    w.commit("m", {"x": x})
    seg = _segment(w, "m")
    third = open_store(tmp_path / "t", w.config.catalog_url, node="t")
    try:
        third._flight = FaultyTransport({"w": w})
        third.get("m", "x")  # t holds a replica now
        NodeDirectory(w.catalog.engine).register("t", "in-process", ["host"], None)
        fake.add(third, chunk_bytes=fake.chunk)
        fake.cut_after = 8000
        tiers = {n: r.tier(n) for n in ("host", "disk")}
        assert pull_segment(NodeDirectory(r.catalog.engine), fake, "r", tiers, seg,
                            prefer="w") == "host"
        # the second read starts where the first stopped, at the other holder
        size = NodeDirectory(r.catalog.engine).segment(seg).nbytes  # type: ignore[union-attr]
        assert fake.reads[0][:2] == ("w", 0) and fake.reads[1] == ("t", 8000, size - 8000)
        assert torch.equal(r.get("m", "x"), x)
    finally:
        remove_store(third)


def test_no_live_holder_raises_node_unavailable(pair) -> None:  # type: ignore[no-untyped-def]
    w, r, fake = pair
    w.commit("m", {"a": torch.randn(10)})
    NodeDirectory(w.catalog.engine).deregister("w")
    with pytest.raises(NodeUnavailable) as info:
        r.get("m", "a")
    assert info.value.node == "w" and info.value.collection == "m"
    fake.remove("w")
    NodeDirectory(w.catalog.engine).register("w", "in-process", ["host"], None)
    with pytest.raises(NodeUnavailable):  # registered, but it does not answer
        r.get("m", "a")
    assert _leftovers(r) == []


def test_parallel_ranges_write_one_verified_segment(pair) -> None:  # type: ignore[no-untyped-def]
    w, r, fake = pair
    tensors = {f"t{i}": torch.randn(1000 + 37 * i) for i in range(9)}
    w.commit("m", tensors)
    seg = _segment(w, "m")
    tiers = {n: r.tier(n) for n in ("host", "disk")}
    pull_segment(NodeDirectory(r.catalog.engine), fake, "r", tiers, seg, streams=3)
    assert len({off for _, off, _ in fake.reads}) == 3
    with r.snapshot("m", verify=True) as snap:
        assert all(torch.equal(snap[k], v) for k, v in tensors.items())


def test_split_ranges_cut_at_extent_starts() -> None:
    ext = [(i * 100, 90, "x") for i in range(10)]
    parts = split_ranges(ext, 1000, 4)
    assert [(lo, hi) for lo, hi, _ in parts] == [(0, 300), (300, 500), (500, 800), (800, 1000)]
    assert sum(len(e) for _, _, e in parts) == 10
    assert [(lo, hi) for lo, hi, _ in split_ranges([(0, 1000, "x")], 1000, 4)] == [(0, 1000)]
    # any extent start past 0 may be a cut, the smallest too
    assert split_ranges([(0, 1, "a"), (1, 1, "b")], 2, 2) == [(0, 1, [(0, 1, "a")]),
                                                             (1, 2, [(1, 1, "b")])]


def test_extent_hasher_checks_in_order() -> None:
    data = np.arange(300, dtype=np.uint8)
    from storage_engine import checksum

    ext = [(0, 100, checksum(data[:100])), (128, 50, checksum(data[128:178]))]
    h = ExtentHasher(ext)
    for lo in range(0, 300, 7):
        h.feed(lo, data[lo : lo + 7])
    assert h.complete and h.bad == []
    bad = ExtentHasher([(0, 100, "0" * 16)])
    bad.feed(0, data[:100])
    assert bad.complete and bad.bad[0][0] == 0


def test_bad_settings_are_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidInput):
        transport.FlightTransport(None, timeout=0)
    with pytest.raises(InvalidInput):
        transport.require_token_for("0.0.0.0", None)
    transport.require_token_for("127.0.0.1", None)
    transport.require_token_for("localhost", None)  # a name that resolves to loopback only
    transport.require_token_for("0.0.0.0", "t")  # its strength is checked at start
    assert [transport.is_loopback(h) for h in ("127.0.0.1", "::1", "localhost", "0.0.0.0",
                                               "10.1.2.3")] == [True, True, True, False, False]
    db = open_store(tmp_path / "s")
    try:
        with pytest.raises(InvalidInput):
            transport.NodeServer(db, host="0.0.0.0", port=0)
        with pytest.raises(NotFound):
            db.replicate("nothing", to=["local"])
    finally:
        remove_store(db)


# -- the data plane's stream, against a hand-written peer ----------------------------------
def _peer(behave: Callable[[Any], None]) -> tuple[int, Any]:
    import socket
    import threading

    from transport._dataplane import _recv_frame

    srv = socket.create_server(("127.0.0.1", 0))

    def run() -> None:
        conn, _ = srv.accept()
        try:
            _recv_frame(conn)
            behave(conn)
        finally:
            conn.close()
            srv.close()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return srv.getsockname()[1], t


def _no_error(payload: object) -> None:
    raise AssertionError(f"unexpected error answer {payload!r}")


@pytest.mark.deadline
def test_data_plane_cut_stream_hands_over_what_arrived() -> None:
    import time

    from transport._dataplane import _send_frame, fetch_into

    def cut(conn: Any) -> None:
        _send_frame(conn, {"ok": True})
        conn.sendall(b"x" * 3000)

    port, t = _peer(cut)
    dst = np.zeros(10_000, np.uint8)
    seen: list[int] = []
    with pytest.raises(NodeUnavailable, match="after 3000 of 10000"):
        fetch_into("n", "127.0.0.1", port, None, "s", 0, dst, seen.append, 5.0, _no_error)
    assert sum(seen) == 3000 and bytes(dst[:3000]) == b"x" * 3000 and not dst[3000:].any()
    t.join(5)

    def stall(conn: Any) -> None:
        _send_frame(conn, {"ok": True})
        conn.sendall(b"y" * 10)
        time.sleep(2.0)

    port, t = _peer(stall)
    t0 = time.monotonic()
    with pytest.raises(NodeUnavailable, match="stalled"):
        fetch_into("n", "127.0.0.1", port, None, "s", 0, np.zeros(100, np.uint8),
                   lambda n: None, 0.5, _no_error)
    assert time.monotonic() - t0 < 1.5
    t.join(5)

    def lies(conn: Any) -> None:
        conn.sendall(b"\xff\xff\xff\xff")  # a header longer than any real one

    port, t = _peer(lies)
    with pytest.raises(NodeUnavailable, match="malformed header"):  # the next holder serves
        fetch_into("n", "127.0.0.1", port, None, "s", 0, np.zeros(8, np.uint8),
                   lambda n: None, 5.0, _no_error)
    t.join(5)


# -- the transport contract ----------------------------------------------------------------
class _StoreHooks(TransportTests):
    """The suite's hooks on a tensordb store: node "n1" on its own SQLite catalog."""

    @pytest.fixture
    def store(self, tmp_path: Path) -> Iterator[tensordb.Database]:
        db = open_store(tmp_path / "n1", node="n1")
        try:
            yield db
        finally:
            remove_store(db)

    def put_segment(self, store: NodeStore, data: np.ndarray) -> str:
        assert isinstance(store, tensordb.Database)
        store.commit("contract", {"bytes": torch.from_numpy(data.copy())})
        info = store.catalog.require("contract")
        (sid,) = [s for s, _ in NodeDirectory(store.catalog.engine).version_segments(
            info.id, info.head)]
        assert np.array_equal(store.get("contract", "bytes").numpy(), data)
        return sid

    def put_kv(self, store: NodeStore, namespace: str, block_tokens: int,
               keys: Sequence[bytes], blocks: Sequence[torch.Tensor]) -> None:
        assert isinstance(store, tensordb.Database)
        kv = store.kv(namespace, block_tokens, capacity_bytes=1 << 20, slab_bytes=64 << 10)
        assert kv.put(keys, blocks) == len(keys)


class TestLocalTransportContract(_StoreHooks):
    nodes: LocalTransport

    def serve(self, store: NodeStore, token: str | None) -> str:
        self.nodes = LocalTransport()
        self.nodes.add(store, token=token, chunk_bytes=64 << 10)
        return "in-process"

    def stop(self, node: str) -> None:
        self.nodes.remove(node)

    def client(self, token: str | None) -> transport.Transport:
        return LocalTransport(self.nodes.nodes, token=token)


class TestFlightTransportContract(_StoreHooks):
    server: transport.NodeServer | None = None

    def serve(self, store: NodeStore, token: str | None) -> str:
        self.server = transport.NodeServer(store, token=token, chunk_bytes=64 << 10,
                                           timeout=2.0)
        return f"127.0.0.1:{self.server.port}"

    def stop(self, node: str) -> None:
        if self.server is not None:
            server, self.server = self.server, None
            server.close()

    def client(self, token: str | None) -> transport.Transport:
        return transport.FlightTransport(token, timeout=2.0)


def test_the_store_is_a_node_store(tmp_path: Path) -> None:
    db = open_store(tmp_path / "s")
    try:
        assert isinstance(db, transport.NodeStore)
    finally:
        remove_store(db)


# -- errors on the wire --------------------------------------------------------------------
def test_every_error_class_has_a_wire_kind() -> None:
    classes = {name for name, cls in inspect.getmembers(tensordb.errors, inspect.isclass)
               if issubclass(cls, TensorDBError)}
    assert set(transport.ERROR_KINDS) == classes
    assert set(transport.ERROR_KINDS) >= set(tensordb.errors.__all__)


def test_error_payloads_are_plain_json_and_rebuild_the_class() -> None:
    import json

    exc = CommitConflict("head moved", collection="c", names=["a"], base=1, head=2)
    payload = json.loads(json.dumps(transport.error_payload(exc)))
    assert payload["kinds"] == ["CommitConflict", "TensorDBError"]
    got = transport.error_from_payload(payload, "n")
    assert type(got) is CommitConflict and got.message == "node 'n': head moved"
    assert (got.collection, got.names, got.base, got.head, got.node) == ("c", ["a"], 1, 2, "n")
    q = transport.error_from_payload(transport.error_payload(
        QueryError("bad", line=3, column=4, expected=["FROM"], node="m")), "n")
    assert type(q) is QueryError and (q.line, q.column, q.expected, q.node) == (3, 4, ["FROM"], "m")


def test_an_unknown_error_kind_degrades_safely() -> None:
    class Newer(NotFound):  # a class only a newer node has
        pass

    got = transport.error_from_payload(transport.error_payload(Newer("gone", tensor="t")), "n")
    assert type(got) is NotFound and got.tensor == "t" and isinstance(got, KeyError)
    got = transport.error_from_payload({"kinds": ["FromTheFuture"], "message": "hm",
                                        "attrs": {"node": "x", "_secret": 1, "get": 2}}, "n")
    assert type(got) is TensorDBError and got.node == "x" and not hasattr(got, "_secret")
    for junk in (None, "text", {"kinds": "NotFound"}, {"kinds": [], "message": 1, "attrs": {}}):
        assert transport.error_from_payload(junk, "n") is None
    import pyarrow.flight as fl

    from transport._flight_client import raise_remote

    for text in ("boom", "tensordb.error: {not json", 'tensordb.error: {"kinds": 1}'):
        with pytest.raises(NodeUnavailable) as info:  # a Flight error with no payload
            raise_remote(fl.FlightServerError(text), "n", "127.0.0.1:1")
        assert info.value.node == "n"


def test_a_group_across_nodes_keeps_shards_where_written(pair) -> None:  # type: ignore[no-untyped-def]
    """Rank 0 on node w, rank 1 on node r, one catalog: each rank's shards stay on its
    node; a reader on r pulls w's (verified) and reads its own in place."""
    w, r, fake = pair
    full = torch.randn(8, 6)
    got: dict[int, object] = {}

    def rank(db: tensordb.Database, i: int) -> None:
        try:
            with db.transaction("ckpt", group="s1", rank=i, world_size=2, timeout=30) as tx:
                tx.put_shard("w", full[i * 4:(i + 1) * 4], global_shape=(8, 6),
                             offsets=(i * 4, 0))
            got[i] = tx.result
        except Exception as exc:  # noqa: BLE001 - inspected below
            got[i] = exc

    threads = [threading.Thread(target=rank, args=(db, i)) for i, db in enumerate((w, r))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(isinstance(c, tensordb.Commit) and c.version == 1 for c in got.values()), got
    assert len(_leftovers(r)) == 1 and len(_leftovers(w)) == 1  # nothing copied yet
    fake.damage = 5  # w's shard arrives damaged: never served, never registered
    with pytest.raises(CorruptData):
        with r.snapshot("ckpt") as snap:
            snap["w"]
    fake.damage = None
    with r.snapshot("ckpt") as snap:
        assert torch.equal(snap.slice("w", rank=1, world_size=2, dim=0), full[4:])
        assert len(_leftovers(r)) == 1  # its own shard: read in place, no pull
        assert torch.equal(snap["w"], full)
    assert len(_leftovers(r)) == 2  # w's shard is now a verified replica on r


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_a_replica_is_checked_as_the_writers_own_segments_are(pair, tier: str  # type: ignore[no-untyped-def]
                                                              ) -> None:
    """A replica's bytes are in the integrity model: its first open per boot (disk),
    the scrub and verify hash it against the catalog, and its damage is refused."""
    from conftest import flip_byte

    w, r, _ = pair
    a, b = torch.arange(4096, dtype=torch.float32), torch.full((512,), 3.0)
    with w.transaction("m", tier=tier) as tx:
        tx.put("a", a)
        tx.put("b", b)
    assert torch.equal(r.get("m", "a"), a)  # pulled: r holds a replica now
    seg = _segment(w, "m")
    assert NodeDirectory(r.catalog.engine).holders(seg) == {"w": tier, "r": tier}
    assert [e[3] for e in r.catalog.segment_extents(seg)] == ["m/a", "m/b"]
    offset = r.snapshot("m").extents()["a"][1]
    flip_byte(r.tier(tier).path(seg), offset + 4)  # type: ignore[attr-defined]
    if tier == "disk":  # after a reboot: the replica's first open checks it
        (r.config.shm_dir / "integrity" / f"{seg}.ok").unlink()
        with pytest.raises(CorruptData) as info:
            r.get("m", "a")
    else:  # shared memory: the scrub finds it
        assert torch.equal(r.get("m", "a")[:1], a[:1])  # not seen yet (element 1 flipped)
        report = r.scrub()
        assert [(c.tensor, c.segment_id) for c in report.corrupt] == [("a", seg)]
        with pytest.raises(CorruptData) as info:
            r.get("m", "a")
    assert info.value.tensor == "a"
    assert torch.equal(r.get("m", "b"), b)
    assert [(p.tensor, p.segment_id) for p in r.verify()] == [("a", seg)]
    assert torch.equal(w.get("m", "a"), a) and w.verify() == []  # the writer's copy is good
