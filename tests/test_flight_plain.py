"""Any Flight client reads a version: a node server on loopback over an embedded store,
read by plain ``pyarrow.flight`` (in a subprocess that cannot import tensordb, and in
this process for the error cases), with its token; the snapshot lease it holds while
streaming, gc meanwhile, a segment held by another node."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow.flight as fl
import pytest
import torch
from conftest import open_store, remove_store

import tensordb
import transport
from tensordb.catalog import NodeDirectory
from tensordb.errors import CorruptData, InvalidInput, NotFound, TensorDBError
from transport._base import error_from_text

TOKEN = "plain-flight-token"

# The plain client: pyarrow alone. tensordb and its packages (and torch) cannot be
# imported in it, whatever the path holds (the venv's editable install included).
PLAIN_CLIENT = textwrap.dedent("""
    import sys
    BLOCKED = {"tensordb", "storage_engine", "transport", "query", "engine_bindings", "torch"}

    class Block:
        @staticmethod
        def find_spec(name, path=None, target=None):
            if name.partition(".")[0] in BLOCKED:
                raise ImportError(f"{name} is not installed for this client")
            return None

    sys.meta_path.insert(0, Block)
    import hashlib, json
    import pyarrow.flight as fl

    args = json.loads(sys.argv[1])
    client = fl.FlightClient(args["location"])
    options = fl.FlightCallOptions(headers=[(b"authorization", f"Bearer {args['token']}".encode())])

    def rows(table):
        data = table.column("data")
        return [{"name": table.column("name")[i].as_py(), "dtype": table.column("dtype")[i].as_py(),
                 "shape": table.column("shape")[i].as_py(), "nbytes": table.column("nbytes")[i].as_py(),
                 "checksum": table.column("checksum")[i].as_py(),
                 "sha256": hashlib.sha256(data[i].as_buffer()).hexdigest()}
                for i in range(table.num_rows)]

    def read(ticket):
        table = client.do_get(fl.Ticket(ticket), options).read_all()
        meta = {k.decode(): v.decode() for k, v in table.schema.metadata.items()}
        return {"rows": rows(table), "metadata": meta}

    out = {"reads": [read(json.dumps(t).encode()) for t in args["tickets"]], "flights": []}
    for info in client.list_flights(options=options):
        out["flights"].append({"command": info.descriptor.command.decode(),
                               "ticket": info.endpoints[0].ticket.ticket.decode(),
                               "records": info.total_records, "bytes": info.total_bytes,
                               "app": json.loads(info.app_metadata),
                               "read": read(info.endpoints[0].ticket.ticket)})
    out["leaked"] = sorted(m for m in sys.modules if m.partition(".")[0] in BLOCKED)
    print(json.dumps(out))
""")


def _v1() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"embed": torch.randn(4 << 20, generator=g),  # 16 MiB: over gRPC's 4 MiB default
            "norm": torch.randn(3, 5, generator=g).to(torch.bfloat16),
            "scalar": torch.tensor(7, dtype=torch.int64),
            "empty": torch.zeros(0, 4),
            "mask": torch.tensor([True, False, True]),
            "half": torch.arange(12, dtype=torch.float16).reshape(2, 2, 3)}


def _sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
                          ).hexdigest()


def _expected(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[str, list[int], str]]:
    return {n: (str(t.dtype).removeprefix("torch."), list(t.shape), _sha(t))
            for n, t in tensors.items()}


def _got(read: dict[str, Any]) -> dict[str, tuple[str, list[int], str]]:
    assert all(isinstance(r["nbytes"], int) for r in read["rows"])
    return {r["name"]: (r["dtype"], r["shape"], r["sha256"]) for r in read["rows"]}


@pytest.fixture
def store(tmp_path: Path) -> Iterator[tuple[tensordb.Database, dict[int, dict[str, torch.Tensor]]]]:
    """Node n1 with "m": v1 (tagged prod), v2 (norm replaced, embed shared, new bias)."""
    db = open_store(tmp_path / "n1", node="n1")
    v1 = _v1()
    v2 = {**v1, "norm": torch.ones(3, 5, dtype=torch.bfloat16), "bias": torch.arange(9.0)}
    try:
        db.commit("m", v1)
        db.tag("m", "prod")
        db.commit("m", {"norm": v2["norm"], "bias": v2["bias"]})  # the rest carried over
        yield db, {1: v1, 2: v2}
    finally:
        remove_store(db)


@pytest.fixture
def server(store: tuple[tensordb.Database, Any]) -> Iterator[transport.NodeServer]:
    srv = transport.NodeServer(store[0], token=TOKEN, timeout=2.0)
    try:
        yield srv
    finally:
        srv.close()


def _client(server: transport.NodeServer) -> fl.FlightClient:
    return fl.FlightClient(f"grpc+tcp://127.0.0.1:{server.port}")


def _options(token: str | None = TOKEN) -> fl.FlightCallOptions:
    return fl.FlightCallOptions(
        headers=[(b"authorization", f"Bearer {token}".encode())] if token else [])


def _ticket(req: dict[str, Any]) -> fl.Ticket:
    return fl.Ticket(json.dumps(req).encode())


def test_a_pyarrow_only_process_reads_versions_and_lists_them(store, server) -> None:  # type: ignore[no-untyped-def]
    db, versions = store
    args = {"location": f"grpc+tcp://127.0.0.1:{server.port}", "token": TOKEN,
            "tickets": [{"collection": "m", "version": 1}, {"collection": "m", "tag": "prod"},
                        {"collection": "m"}]}
    # -I: no PYTHONPATH, no user site, not this directory; the script blocks the rest
    proc = subprocess.run([sys.executable, "-I", "-c", PLAIN_CLIENT, json.dumps(args)],
                          capture_output=True, text=True, timeout=120, cwd="/")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["leaked"] == []
    v1, by_tag, head = out["reads"]
    assert _got(v1) == _expected(versions[1])
    assert _got(by_tag) == _expected(versions[1])
    assert _got(head) == _expected(versions[2])
    assert [v1["metadata"]["tensordb.version"], by_tag["metadata"]["tensordb.version"],
            head["metadata"]["tensordb.version"]] == ["1", "1", "2"]
    assert head["metadata"]["tensordb.collection"] == "m"
    assert head["metadata"]["tensordb.layout"] == "1"
    # the rows are ordered by name and carry the catalog's checksums
    rows = {r.name: r for r in db.catalog.manifest(db.catalog.require("m").id, 2)}
    assert [r["name"] for r in head["rows"]] == sorted(versions[2])
    assert {r["name"]: r["checksum"] for r in head["rows"]} == \
        {n: r.checksum for n, r in rows.items()}
    assert {r["name"]: r["nbytes"] for r in head["rows"]} == \
        {n: t.numel() * t.element_size() for n, t in versions[2].items()}
    # one FlightInfo per version, oldest first; its ticket reads that version back
    flights = out["flights"]
    assert [(f["app"]["collection"], f["app"]["version"]) for f in flights] == [("m", 1), ("m", 2)]
    assert [json.loads(f["ticket"]) for f in flights] == \
        [{"collection": "m", "version": 1}, {"collection": "m", "version": 2}]
    assert [f["command"] for f in flights] == [f["ticket"] for f in flights]
    assert [f["app"]["tags"] for f in flights] == [["prod"], []]
    assert [f["app"]["head"] for f in flights] == [False, True]
    assert [f["records"] for f in flights] == [len(versions[1]), len(versions[2])]
    assert flights[1]["bytes"] == sum(r["nbytes"] for r in head["rows"])
    assert _got(flights[0]["read"]) == _expected(versions[1])
    assert _got(flights[1]["read"]) == _expected(versions[2])
    assert db.catalog.lease_holders() == []


def _flight_error(server: transport.NodeServer, raw: bytes) -> fl.FlightServerError:
    with _client(server) as client, pytest.raises(fl.FlightServerError) as info:
        client.do_get(fl.Ticket(raw), _options()).read_all()
    return info.value


@pytest.mark.parametrize(("raw", "kind", "says"), [
    (b"not json", InvalidInput, "must be JSON"),
    (b"[1, 2]", InvalidInput, "JSON object"),
    (b'"m"', InvalidInput, "JSON object"),
    (b"{}", InvalidInput, "needs collection"),
    (b'{"collection": "nothing"}', NotFound, "no collection 'nothing'"),
    (b'{"collection": "m", "version": 9}', NotFound, "no version 9 of collection 'm'"),
    (b'{"collection": "m", "version": "1"}', InvalidInput, "version must be an integer"),
    (b'{"collection": "m", "version": true}', InvalidInput, "version must be an integer"),
    (b'{"collection": "m", "version": 1.5}', InvalidInput, "version must be an integer"),
    (b'{"collection": 3}', InvalidInput, "needs collection"),
    (b'{"collection": "m", "tag": 1}', InvalidInput, "tag must be text"),
    (b'{"collection": "m", "tag": "nope"}', NotFound, "no tag 'nope' in collection 'm'"),
    (b'{"collection": "m", "version": 1, "tag": "prod"}', InvalidInput, "not both"),
    (b'{"collection": "m", "names": ["a"]}', InvalidInput, "unknown: names"),
    (b'{"kind": "weights", "collection": "m"}', InvalidInput, "unknown ticket kind 'weights'"),
])
def test_a_bad_ticket_is_a_flight_error_naming_what_was_wrong(  # type: ignore[no-untyped-def]
        store, server, raw: bytes, kind: type[TensorDBError], says: str) -> None:
    err = _flight_error(server, raw)
    text = str(err)
    first = text.splitlines()[0]
    assert first.startswith(f"{kind.__name__}: ") and says in first, text
    assert "Traceback" not in text and 'File "' not in text
    typed = error_from_text(text, "n1")  # what FlightTransport raises from it
    assert isinstance(typed, kind) and says in str(typed)
    assert store[0].catalog.lease_holders() == []


def test_the_existing_tickets_still_answer(store, server) -> None:  # type: ignore[no-untyped-def]
    db = store[0]
    (seg, _), *_ = NodeDirectory(db.catalog.engine).version_segments(db.catalog.require("m").id, 1)
    with _client(server) as client:
        table = client.do_get(_ticket({"kind": "segment", "id": seg, "offset": 0, "length": 8}),
                              _options()).read_all()
        assert table.schema.names == ["data"] and len(table.column(0)[0].as_py()) == 8
        db.kv("held", block_tokens=16, capacity_bytes=1 << 20, slab_bytes=64 << 10).close()
        kv = client.do_get(_ticket({"kind": "kv", "namespace": "held", "block_tokens": 16,
                                    "keys": []}), _options()).read_all()
        assert kv.num_rows == 0
        # a namespace this node never opened: NotFound, and a read makes none
        with pytest.raises(fl.FlightServerError, match="NotFound: node 'n1' holds no KV"):
            client.do_get(_ticket({"kind": "kv", "namespace": "none", "block_tokens": 16,
                                   "keys": []}), _options()).read_all()
        assert NodeDirectory(db.catalog.engine).kv_nodes("none") == []


@pytest.mark.parametrize("token", [None, "wrong-token"])
def test_a_missing_or_wrong_token_is_unauthenticated(server, token: str | None) -> None:  # type: ignore[no-untyped-def]
    with _client(server) as client:
        with pytest.raises(fl.FlightUnauthenticatedError, match="requires a token"):
            client.do_get(_ticket({"collection": "m"}), _options(token)).read_all()
        with pytest.raises(fl.FlightUnauthenticatedError):
            list(client.list_flights(options=_options(token)))
        with pytest.raises(fl.FlightUnauthenticatedError):
            client.get_flight_info(fl.FlightDescriptor.for_command(b'{"collection": "m"}'),
                                   _options(token))


def test_list_flights_criteria_and_flight_info(store, server) -> None:  # type: ignore[no-untyped-def]
    db = store[0]
    db.commit("other", {"x": torch.ones(2)})
    with _client(server) as client:
        every = [json.loads(f.endpoints[0].ticket.ticket) for f in client.list_flights(
            options=_options())]
        assert every == [{"collection": "m", "version": 1}, {"collection": "m", "version": 2},
                         {"collection": "other", "version": 1}]
        only = [json.loads(f.app_metadata)["version"] for f in client.list_flights(
            b'{"collection": "m"}', _options())]
        assert only == [1, 2]
        with pytest.raises(fl.FlightServerError, match="InvalidInput: list_flights criteria"):
            list(client.list_flights(b"m", _options()))
        info = client.get_flight_info(
            fl.FlightDescriptor.for_command(b'{"collection": "m", "tag": "prod"}'), _options())
        assert json.loads(info.endpoints[0].ticket.ticket) == {"collection": "m", "version": 1}
        assert info.schema.metadata[b"tensordb.version"] == b"1"
        with pytest.raises(fl.FlightServerError, match="command descriptor"):
            client.get_flight_info(fl.FlightDescriptor.for_path("m"), _options())
        with pytest.raises(fl.FlightServerError, match="NotFound: no version 5"):
            client.get_flight_info(
                fl.FlightDescriptor.for_command(b'{"collection": "m", "version": 5}'), _options())


def _await_no_leases(db: tensordb.Database, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while db.catalog.lease_holders() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert db.catalog.lease_holders() == []


#: a version larger than gRPC buffers between the two ends, so a stream is surely in
#: flight while the client holds back: 48 tensors of 1 MiB
BIG = {f"layer.{i:02d}": torch.full((1 << 18,), float(i)) for i in range(48)}


def test_the_lease_lasts_as_long_as_the_stream(store, server) -> None:  # type: ignore[no-untyped-def]
    db = store[0]
    db.commit("big", BIG)
    with _client(server) as client:
        client.do_get(_ticket({"collection": "m"}), _options()).read_all()
        assert db.catalog.lease_holders() == []
        reader = client.do_get(_ticket({"collection": "big", "version": 1}), _options())
        reader.read_chunk()
        (lease,) = db.catalog.lease_holders()
        assert lease[1:3] == ("big", 1)
        reader.cancel()  # the client hangs up half-way
        del reader
    _await_no_leases(db)


def test_a_tensor_too_large_for_one_batch_is_refused_and_the_lease_released(  # type: ignore[no-untyped-def]
        store, server, monkeypatch: pytest.MonkeyPatch) -> None:
    import transport._version_reads as reads

    monkeypatch.setattr(reads, "MAX_BATCH_BYTES", 1 << 20)
    err = _flight_error(server, b'{"collection": "m"}')
    assert "InvalidInput: tensor 'embed' has 16777216 bytes" in str(err)
    assert store[0].catalog.lease_holders() == []


def test_gc_during_a_stream_leaves_its_version(store, server) -> None:  # type: ignore[no-untyped-def]
    db = store[0]
    v3 = BIG
    db.commit("big", v3)
    db.commit("big", {k: t + 1 for k, t in v3.items()})
    with _client(server) as client:
        reader = client.do_get(_ticket({"collection": "big", "version": 1}), _options())
        first = reader.read_chunk().data
        assert db.drop_versions("big", keep_last=1) == 0  # leased: kept
        db.gc()
        rest = reader.read_all()
    names = [first.column("name")[0].as_py()] + rest.column("name").to_pylist()
    datas = [first.column("data")[0].as_buffer()] + \
        [rest.column("data")[i].as_buffer() for i in range(rest.num_rows)]
    assert {n: hashlib.sha256(d).hexdigest() for n, d in zip(names, datas, strict=True)} == \
        {n: s for n, (_, _, s) in _expected(v3).items()}
    _await_no_leases(db)
    assert db.drop_versions("big", keep_last=1) == 1  # now the lease is gone
    db.gc()
    with _client(server) as client, pytest.raises(fl.FlightServerError, match="no version 1"):
        client.do_get(_ticket({"collection": "big", "version": 1}), _options()).read_all()


def test_a_segment_held_by_another_node_is_pulled_first(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'catalog.db'}"
    w = open_store(tmp_path / "w", url, node="w")
    r = open_store(tmp_path / "r", url, node="r")
    servers: list[transport.NodeServer] = []
    try:
        for db in (w, r):
            servers.append(transport.NodeServer(db, token=TOKEN, timeout=2.0))
            NodeDirectory(db.catalog.engine).register(
                db.config.node, f"127.0.0.1:{servers[-1].port}", ["host", "disk"], None)
        tensors = {"a": torch.randn(1000), "b": torch.arange(10, dtype=torch.int32)}
        w.commit("m", tensors)
        directory = NodeDirectory(w.catalog.engine)
        (seg, _), = directory.version_segments(w.catalog.require("m").id, 1)
        assert directory.local_tier(seg, "r") is None
        with _client(servers[1]) as client:
            table = client.do_get(_ticket({"collection": "m"}), _options()).read_all()
        got = {table.column("name")[i].as_py():
               hashlib.sha256(table.column("data")[i].as_buffer()).hexdigest()
               for i in range(table.num_rows)}
        assert got == {n: s for n, (_, _, s) in _expected(tensors).items()}
        assert directory.local_tier(seg, "r") is not None  # a replica, registered
        # with its only holder gone, the read names the segment and the holder
        w.commit("n", {"c": torch.ones(3)})
        (seg2, _), = directory.version_segments(w.catalog.require("n").id, 1)
        servers[0].close()
        with _client(servers[1]) as client, pytest.raises(fl.FlightServerError) as info:
            client.do_get(_ticket({"collection": "n"}), _options()).read_all()
        first = str(info.value).splitlines()[0]
        assert first.startswith("NodeUnavailable: ") and seg2 in first and "w" in first
        assert r.catalog.lease_holders() == []
    finally:
        for srv in servers:
            srv.close()
        remove_store(r)
        remove_store(w)


# -- damage: the integrity gate (docs/storage.md, "Integrity model") ---------------------
# A pyarrow-only process reads each ticket and reports its rows, or the Flight error it
# got: its class and the first line of its message (what such a user sees).
PLAIN_DAMAGE_CLIENT = PLAIN_CLIENT.split("out = {")[0] + textwrap.dedent("""
    out = {"reads": []}
    for t in args["tickets"]:
        try:
            out["reads"].append(read(json.dumps(t).encode()))
        except fl.FlightError as exc:
            out["reads"].append({"error": type(exc).__name__, "text": str(exc)})
    out["leaked"] = sorted(m for m in sys.modules if m.partition(".")[0] in BLOCKED)
    print(json.dumps(out))
""")

A = torch.arange(8192, dtype=torch.float32)  # the tensor that is damaged
B = torch.full((2048,), 7, dtype=torch.int64)  # after it in the same segment
A2 = A * 2
OTHER = {"x": torch.linspace(0, 1, 300)}


def _plain_reads(server: transport.NodeServer, tickets: list[dict[str, Any]]
                 ) -> list[dict[str, Any]]:
    args = {"location": f"grpc+tcp://127.0.0.1:{server.port}", "token": TOKEN,
            "tickets": tickets}
    proc = subprocess.run([sys.executable, "-I", "-c", PLAIN_DAMAGE_CLIENT, json.dumps(args)],
                          capture_output=True, text=True, timeout=120, cwd="/")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["leaked"] == []
    reads: list[dict[str, Any]] = out["reads"]
    return reads


def _extent(db: tensordb.Database, collection: str, name: str, version: int = 1
            ) -> tuple[str, int]:
    with db.snapshot(collection, version=version) as snap:
        sid, offset, _ = snap.extents()[name]
    assert sid is not None
    return sid, offset


def _flip(path: Path, at: int, *, mtime_kept: bool) -> None:
    st = os.stat(path)
    with open(path, "r+b") as fh:
        fh.seek(at)
        b = fh.read(1)
        fh.seek(at)
        fh.write(bytes([b[0] ^ 0xFF]))
    later = st.st_mtime_ns + (0 if mtime_kept else 10**9)
    os.utime(path, ns=(st.st_atime_ns, later))


def _refused(read: dict[str, Any], kind: type[TensorDBError], tensor: str, says: str) -> None:
    """The read got a Flight error whose first line names the class, the collection and
    tensor and ``says``; its payload rebuilds the typed error; no traceback."""
    assert "rows" not in read, f"damaged bytes served: {read}"
    assert read["error"] == "FlightServerError", read
    text = read["text"]
    first = text.splitlines()[0]
    assert first.startswith(f"{kind.__name__}: {tensor}: ") and says in first, text
    assert "Traceback" not in text and 'File "' not in text
    typed = error_from_text(text, "n1")
    assert isinstance(typed, kind)
    assert f"{typed.collection}/{typed.tensor}" == tensor  # type: ignore[attr-defined]


DAMAGE_CASES = [
    # (tier, damage, how the store learns of it)
    ("host", "flip", "scrub"),
    ("disk", "flip, mtime changed", "first open"),
    ("host", "truncate", "read"),
    ("disk", "truncate", "first open"),
    ("host", "unlink", "read"),
    ("disk", "unlink", "read"),
]


@pytest.mark.parametrize(("tier", "damage", "found_by"), DAMAGE_CASES)
def test_a_pyarrow_only_client_never_gets_damaged_bytes(  # type: ignore[no-untyped-def]
        tmp_path: Path, tier: str, damage: str, found_by: str) -> None:
    """v1 = {a, b} in one segment, a damaged; v2 replaced a and kept b's extent; "other"
    lies in a segment of its own. A version is read whole: one refused extent fails
    its stream (before any batch), and every version without that extent is served."""
    db = open_store(tmp_path / "n1", node="n1", default_tier=tier)
    srv = None
    try:
        db.commit("m", {"a": A, "b": B})
        db.commit("m", {"a": A2})  # b carried over: the same extent as v1's
        db.commit("other", OTHER)
        sid, offset = _extent(db, "m", "a")
        assert _extent(db, "m", "b", 2)[0] == sid and _extent(db, "m", "a", 2)[0] != sid
        path = db.tier(tier).path(sid)  # type: ignore[attr-defined]
        marks = db.tier("host").marks  # type: ignore[attr-defined]
        if damage.startswith("flip"):
            _flip(path, offset + 5, mtime_kept=damage == "flip")
        elif damage == "truncate":
            os.truncate(path, offset + 8)
        else:
            os.unlink(path)
        if found_by == "scrub":
            assert db.scrub().corrupt  # the check that finds a host-tier flip
            assert offset in marks.corrupt(sid)
        else:
            assert marks.corrupt(sid) is None  # nothing knows yet: the read finds out
        srv = transport.NodeServer(db, token=TOKEN, timeout=2.0)
        v1, v1_again, v2, other = _plain_reads(srv, [
            {"collection": "m", "version": 1}, {"collection": "m", "version": 1},
            {"collection": "m", "version": 2}, {"collection": "other"}])
        assert _got(other) == _expected(OTHER)
        if damage == "unlink":
            for read, tensor in ((v1, "m/a"), (v1_again, "m/a"), (v2, "m/b")):
                _refused(read, NotFound, tensor, "its file is gone")
        elif damage == "truncate":
            for read, tensor in ((v1, "m/a"), (v1_again, "m/a"), (v2, "m/b")):
                # found by the read (host) or marked by the first open (disk)
                _refused(read, CorruptData, tensor, "truncated" if tier == "host"
                         else "not served")
            assert (marks.corrupt(sid) is not None) == (tier == "disk")
        else:
            _refused(v1, CorruptData, "m/a", "fail their checksum")
            _refused(v1_again, CorruptData, "m/a", "fail their checksum")
            assert _got(v2) == _expected({"a": A2, "b": B})  # b's extent is good
            assert set(marks.corrupt(sid)) == {offset}  # the first open marked a only
        _await_no_leases(db)
    finally:
        if srv is not None:
            srv.close()
        remove_store(db)


def test_a_mark_made_while_a_stream_runs_stops_it_at_that_tensor(store, server) -> None:  # type: ignore[no-untyped-def]
    """A stream begun before the mark sends what it sent; the next batch of a marked
    tensor is refused, through the same Flight error."""
    db = store[0]
    db.commit("big", BIG)
    sid, offset = _extent(db, "big", "layer.47")
    with _client(server) as client:
        reader = client.do_get(_ticket({"collection": "big", "version": 1}), _options())
        first = reader.read_chunk().data
        assert first.column("name")[0].as_py() == "layer.00"
        _flip(db.tier("host").path(sid), offset + 3, mtime_kept=True)  # type: ignore[attr-defined]
        assert db.scrub().corrupt
        with pytest.raises(fl.FlightServerError) as info:
            reader.read_all()
    first_line = str(info.value).splitlines()[0]
    assert first_line.startswith("CorruptData: big/layer.47: stored bytes fail their checksum")
    _await_no_leases(db)
    with _client(server) as client, pytest.raises(fl.FlightServerError, match="big/layer.47"):
        client.do_get(_ticket({"collection": "big"}), _options()).read_all()


def test_a_damaged_shard_is_refused_and_marked(store, server) -> None:  # type: ignore[no-untyped-def]
    """A sharded tensor is assembled from its shards, each hashed: a flip no check has
    seen is found by the stream itself and marked; a marked shard is refused before it
    is read."""
    db = store[0]
    w = torch.arange(120, dtype=torch.float32).reshape(12, 10)
    with db.transaction("s") as tx:
        tx.put_shard("w", w[:, :4], global_shape=(12, 10), offsets=(0, 0))
        tx.put_shard("w", w[:, 4:], global_shape=(12, 10), offsets=(0, 4))
    with _client(server) as client:
        table = client.do_get(_ticket({"collection": "s"}), _options()).read_all()
        assert hashlib.sha256(table.column("data")[0].as_buffer()).hexdigest() == _sha(w)
        cid = db.catalog.require("s").id
        (row,) = db.catalog.manifest(cid, 1)
        shard = db.catalog.shards(cid, [row])["w"][1]
        assert shard.segment_id is not None
        marks = db.tier("host").marks  # type: ignore[attr-defined]
        _flip(db.tier("host").path(shard.segment_id), shard.offset + 2,  # type: ignore[attr-defined]
              mtime_kept=True)
        assert marks.corrupt(shard.segment_id) is None
        with pytest.raises(fl.FlightServerError) as info:
            client.do_get(_ticket({"collection": "s"}), _options()).read_all()
        assert str(info.value).startswith("CorruptData: s/w: a shard's bytes fail their "
                                          "checksum")
        assert shard.offset in marks.corrupt(shard.segment_id)  # the stream marked it
        with pytest.raises(fl.FlightServerError) as info:
            client.do_get(_ticket({"collection": "s"}), _options()).read_all()
        assert str(info.value).startswith("CorruptData: s/w: stored bytes fail their "
                                          "checksum (segment ")  # refused by its mark
    _await_no_leases(db)
