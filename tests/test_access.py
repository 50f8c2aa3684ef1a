"""Scoped tokens and TLS on the node server: the role x scope x operation matrix through
pyarrow's own Flight client, Flight and the data plane over TLS trusting a test CA, a
clear-text client refused, commits through ``do_put`` (and their bad inputs, which
change nothing), the token CLI."""

from __future__ import annotations

import json
import socket
import ssl
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.flight as fl
import pytest
import torch
import xxhash
from typer.testing import CliRunner

import tensordb
import transport
from tensordb.catalog import TokenStore
from tensordb.cli import app
from tensordb.errors import CorruptData, InvalidInput, NodeUnavailable, NotFound, Unauthorized

trustme = pytest.importorskip("trustme")

NODE_TOKEN = "node-token-0123456789abcdef"


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture(scope="module")
def tls_files(ca: trustme.CA, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("tls")
    cert = ca.issue_cert("127.0.0.1", "localhost")
    paths = {"ca": d / "ca.pem", "cert": d / "cert.pem", "key": d / "key.pem"}
    ca.cert_pem.write_to_path(str(paths["ca"]))
    cert.private_key_pem.write_to_path(str(paths["key"]))
    with open(paths["cert"], "wb") as f:
        for blob in cert.cert_chain_pems:
            f.write(blob.bytes())
    return paths


def _fill(db: tensordb.Database) -> None:
    for team in ("team-a", "team-b"):
        with db.transaction(f"{team}/x") as tx:
            tx.put("w", torch.arange(1024, dtype=torch.float32))


@pytest.fixture
def served(sqlite_db: tensordb.Database) -> Iterator[tuple[tensordb.Database, str]]:
    _fill(sqlite_db)
    server = transport.NodeServer(sqlite_db, token=NODE_TOKEN)
    try:
        yield sqlite_db, f"127.0.0.1:{server.port}"
    finally:
        server.close()


def _options(token: str | None) -> fl.FlightCallOptions:
    headers = [(b"authorization", f"Bearer {token}".encode())] if token else []
    return fl.FlightCallOptions(timeout=10, headers=headers)


def _put_table(name: str = "w", n: int = 16) -> pa.Table:
    data = np.arange(n, dtype=np.float32).tobytes()
    return pa.table({"name": [name], "dtype": ["float32"],
                     "shape": pa.array([[n]], pa.list_(pa.int64())),
                     "checksum": [xxhash.xxh3_64_hexdigest(data)],
                     "data": pa.array([data], pa.large_binary())})


def _put(client: fl.FlightClient, token: str | None, collection: str,
         table: pa.Table | None = None) -> dict[str, object]:
    table = table if table is not None else _put_table()
    desc = fl.FlightDescriptor.for_command(json.dumps({"collection": collection}))
    writer, meta = client.do_put(desc, table.schema, _options(token))
    writer.write_table(table)
    writer.done_writing()
    got = meta.read()
    writer.close()
    return json.loads(got.to_pybytes())


def _segment_of(db: tensordb.Database, collection: str) -> str:
    return next(r.segment_id for c, _, r in db.catalog.all_rows()
                if c == collection and r.segment_id)


def _attempt(fn: object) -> str:
    try:
        fn()  # type: ignore[operator]
    except fl.FlightUnauthorizedError:
        return "refused"
    except fl.FlightUnauthenticatedError:
        return "unauthenticated"
    return "ok"


# -- the token store -------------------------------------------------------------------------
def test_tokens_are_stored_hashed_scoped_and_revocable(sqlite_db: tensordb.Database) -> None:
    store = TokenStore(sqlite_db.catalog.engine)
    tid, token = store.create("read", "team-a/*", note="ci")
    grant = store.grant(token)
    assert grant is not None and (grant.role, grant.scope, grant.token_id) == \
        ("read", "team-a/*", tid)
    assert grant.allows("read", "team-a/x") and not grant.allows("read", "team-b/x")
    assert not grant.allows("write", "team-a/x")
    with sqlite_db.catalog.engine.connect() as conn:
        stored = conn.exec_driver_sql("SELECT secret_hash FROM access_tokens").scalars().all()
    secret = token.split("_", 2)[2]  # the secret may hold "_" itself (urlsafe base64)
    assert stored and all(secret not in h for h in stored)  # hashed only
    assert store.grant(token[:-1] + ("A" if token[-1] != "A" else "B")) is None  # wrong secret
    assert store.grant("tdb_nonsense") is None and store.grant("") is None
    store.revoke(tid)
    assert store.grant(token) is None
    store.revoke(token)  # idempotent, by the whole token too
    assert [(t.id, t.role, t.revoked_at is not None) for t in store.list()] == \
        [(tid, "read", True)]
    with pytest.raises(NotFound):
        store.revoke("0123456789abcdef")


@pytest.mark.parametrize("role,scope", [("owner", "*"), ("read", ""), ("read", " a*"),
                                        ("write", "x" * 256), ("admin", "caf\u00e9/*")])
def test_bad_token_settings_are_refused_and_store_nothing(
        sqlite_db: tensordb.Database, role: str, scope: str) -> None:
    store = TokenStore(sqlite_db.catalog.engine)
    with pytest.raises(InvalidInput):
        store.create(role, scope)
    assert store.list() == []


def test_a_scoped_token_cannot_be_a_nodes_own_token(sqlite_db: tensordb.Database) -> None:
    _, scoped = TokenStore(sqlite_db.catalog.engine).create("read", "team-a/*")
    with pytest.raises(InvalidInput, match="scoped token"):
        transport.check_token(scoped)
    with pytest.raises(InvalidInput, match="scoped token"):
        transport.NodeServer(sqlite_db, token=scoped)


# -- the matrix --------------------------------------------------------------------------
#: role -> operation -> (on team-a/x, on team-b/x), for a token scoped to team-a/*
EXPECTED = {
    "read": {"read": ("ok", "refused"), "info": ("ok", "refused"),
             "segment": ("ok", "refused"), "commit": ("refused", "refused")},
    "write": {"read": ("ok", "refused"), "info": ("ok", "refused"),
              "segment": ("ok", "refused"), "commit": ("ok", "refused")},
    "admin": {"read": ("ok", "refused"), "info": ("ok", "refused"),
              "segment": ("ok", "refused"), "commit": ("ok", "refused")},
}


def test_scoped_token_matrix(served: tuple[tensordb.Database, str]) -> None:
    db, address = served
    store = TokenStore(db.catalog.engine)
    client = fl.FlightClient(f"grpc+tcp://{address}")
    heads = {c: db.catalog.info(c).head for c in ("team-a/x", "team-b/x")}
    got: dict[str, dict[str, tuple[str, ...]]] = {}
    for role in EXPECTED:
        _, token = store.create(role, "team-a/*")
        ops: dict[str, tuple[str, ...]] = {}
        for op in EXPECTED[role]:
            cells = []
            for coll in ("team-a/x", "team-b/x"):
                ticket = json.dumps({"collection": coll}).encode()
                seg = json.dumps({"kind": "segment", "id": _segment_of(db, coll),
                                  "offset": 0, "length": 64}).encode()
                fn = {
                    "read": lambda t=ticket, k=token: client.do_get(
                        fl.Ticket(t), _options(k)).read_all(),
                    "info": lambda t=ticket, k=token: client.get_flight_info(
                        fl.FlightDescriptor.for_command(t), _options(k)),
                    "segment": lambda s=seg, k=token: client.do_get(
                        fl.Ticket(s), _options(k)).read_all(),
                    "commit": lambda c=coll, k=token: _put(client, k, c),
                }[op]
                cells.append(_attempt(fn))
            ops[op] = tuple(cells)
        got[role] = ops
        # a listing shows the collections the scope covers, and no others
        listed = {json.loads(i.descriptor.command)["collection"]
                  for i in client.list_flights(b"", _options(token))}
        assert listed == {"team-a/x"}, role
    assert got == EXPECTED
    # refused commits changed nothing; each write and admin commit made one version
    assert db.catalog.info("team-b/x").head == heads["team-b/x"]
    assert db.catalog.info("team-a/x").head == heads["team-a/x"] + 2
    # the node's own token reads anything and commits nothing
    assert _attempt(lambda: client.do_get(fl.Ticket(json.dumps(
        {"collection": "team-b/x"}).encode()), _options(NODE_TOKEN)).read_all()) == "ok"
    assert _attempt(lambda: _put(client, NODE_TOKEN, "team-a/x")) == "refused"
    # no token, a made-up token, a revoked one: unauthenticated
    tid, token = store.create("admin", "*")
    store.revoke(tid)
    auth = transport.Authenticator(NODE_TOKEN, store, ttl=0.0)
    assert auth.grant(token) is None
    for bad in (None, "tdb_0123456789abcdef_" + "x" * 43, "not-a-token-at-all-123"):
        assert _attempt(lambda b=bad: client.do_get(fl.Ticket(json.dumps(
            {"collection": "team-a/x"}).encode()), _options(b)).read_all()) \
            == "unauthenticated"
    client.close()


def test_refused_scope_reaches_a_tensordb_client_as_unauthorized(
        served: tuple[tensordb.Database, str]) -> None:
    db, address = served
    _, token = TokenStore(db.catalog.engine).create("read", "team-a/*")
    flight = transport.FlightTransport(token, 5.0)
    try:
        sid = _segment_of(db, "team-b/x")
        with pytest.raises(Unauthorized, match="team-a/\\*"):  # over the data plane
            flight.read_segment_into("n", address, sid, 0, np.empty(64, np.uint8),
                                     lambda n: None)
        with pytest.raises(Unauthorized):  # and over Flight
            flight.read_segment("n", address, sid, 0, 64, lambda v: None)
        with pytest.raises(Unauthorized):  # pulls need write
            flight.request_pull("n", address, [_segment_of(db, "team-a/x")], None)
        out = np.empty(64, np.uint8)
        flight.read_segment_into("n", address, _segment_of(db, "team-a/x"), 0, out,
                                 lambda n: None)
        assert out.view(np.float32).tolist() == list(range(16))
    finally:
        flight.close()


# -- commits through do_put ------------------------------------------------------------
def test_a_plain_flight_client_commits_a_version(served: tuple[tensordb.Database, str]
                                                 ) -> None:
    db, address = served
    _, token = TokenStore(db.catalog.engine).create("write", "*")
    client = fl.FlightClient(f"grpc+tcp://{address}")
    got = _put(client, token, "fresh", _put_table("layer.0", 256))
    assert got["version"] == 1 and got["tensors"] == 1
    assert torch.equal(db.get("fresh", "layer.0", verify=True),
                       torch.arange(256, dtype=torch.float32))
    # what do_get streams back is a valid put: a round trip
    table = client.do_get(fl.Ticket(b'{"collection": "fresh"}'), _options(token)).read_all()
    assert _put(client, token, "fresh", table.select(["name", "dtype", "shape", "nbytes",
                                                      "checksum", "data"]))["version"] == 2
    client.close()


def _bad_tables() -> dict[str, pa.Table]:
    good = _put_table()
    bad_sum = good.set_column(good.schema.get_field_index("checksum"), "checksum",
                              pa.array(["0" * 16]))
    short = good.set_column(good.schema.get_field_index("shape"), "shape",
                            pa.array([[17]], pa.list_(pa.int64())))
    twice = pa.concat_tables([good, good])
    extra = good.append_column("owner", pa.array(["me"]))
    no_dtype = good.drop_columns(["dtype"])
    bad_dtype = good.set_column(1, "dtype", pa.array(["float99"]))
    # no bytes for a shape that needs them; a shape no store could hold (a bad input,
    # not a full store); an empty tensor whose checksum is not that of no bytes
    empty = good.set_column(good.schema.get_field_index("data"), "data",
                            pa.array([b""], pa.large_binary()))
    huge = good.set_column(good.schema.get_field_index("shape"), "shape",
                           pa.array([[1 << 40, 1 << 20]], pa.list_(pa.int64())))
    zero = pa.table({"name": ["z"], "dtype": ["float32"],
                     "shape": pa.array([[0, 4]], pa.list_(pa.int64())),
                     "checksum": ["0" * 16], "data": pa.array([b""], pa.large_binary())})
    zero_with_bytes = good.set_column(good.schema.get_field_index("shape"), "shape",
                                      pa.array([[0]], pa.list_(pa.int64())))
    return {"checksum": bad_sum, "short": short, "twice": twice, "extra": extra,
            "no_dtype": no_dtype, "bad_dtype": bad_dtype, "empty": empty, "huge": huge,
            "zero_checksum": zero, "zero_with_bytes": zero_with_bytes}


@pytest.mark.parametrize("case", sorted(_bad_tables()))
def test_a_bad_put_is_refused_and_changes_nothing(served: tuple[tensordb.Database, str],
                                                  case: str) -> None:
    db, address = served
    _, token = TokenStore(db.catalog.engine).create("write", "*")
    client = fl.FlightClient(f"grpc+tcp://{address}")
    before = db.catalog.info("team-a/x").head
    with pytest.raises(fl.FlightServerError) as info:
        _put(client, token, "team-a/x", _bad_tables()[case])
    kind = (CorruptData if "checksum" in case else InvalidInput).__name__
    assert str(info.value).startswith(kind), info.value
    assert db.catalog.info("team-a/x").head == before
    assert db.catalog.info("nothing") is None
    client.close()


def test_a_put_larger_than_the_node_holds_in_memory_is_refused_unwritten(
        store_home: Path) -> None:
    db = tensordb.connect(home=store_home, host_capacity=1 << 20)
    server = transport.NodeServer(db, token=NODE_TOKEN)
    try:
        _, token = TokenStore(db.catalog.engine).create("write", "*")
        client = fl.FlightClient(f"grpc+tcp://127.0.0.1:{server.port}")
        big = pa.concat_tables([_put_table(f"w{i}", 1 << 16) for i in range(5)])  # 1.25 MiB
        with pytest.raises(fl.FlightServerError) as info:
            _put(client, token, "big", big)
        assert str(info.value).startswith("InvalidInput") and "'w4'" in str(info.value)
        assert db.catalog.info("big") is None and db.stats()["host_bytes"] == 0
        # a zero-size tensor with the checksum of no bytes is a tensor like any other
        empty = pa.table({"name": ["z"], "dtype": ["float32"],
                          "shape": pa.array([[0, 4]], pa.list_(pa.int64())),
                          "checksum": [xxhash.xxh3_64_hexdigest(b"")],
                          "data": pa.array([b""], pa.large_binary())})
        assert _put(client, token, "small", empty)["version"] == 1
        assert db.get("small", "z").shape == (0, 4)
        client.close()
    finally:
        server.close()
        db.close()


# -- TLS -------------------------------------------------------------------------------
@pytest.fixture
def tls_served(sqlite_db: tensordb.Database, tls_files: dict[str, Path]
               ) -> Iterator[tuple[tensordb.Database, str]]:
    _fill(sqlite_db)
    server = transport.NodeServer(sqlite_db, token=NODE_TOKEN, tls=transport.ServerTLS.load(
        tls_files["cert"], tls_files["key"]))
    try:
        yield sqlite_db, f"127.0.0.1:{server.port}"
    finally:
        server.close()


def test_pyarrow_flight_client_reads_over_tls_trusting_the_ca(
        tls_served: tuple[tensordb.Database, str], tls_files: dict[str, Path]) -> None:
    db, address = tls_served
    client = fl.FlightClient(f"grpc+tls://{address}",
                             tls_root_certs=tls_files["ca"].read_bytes())
    table = client.do_get(fl.Ticket(b'{"collection": "team-a/x"}'),
                          _options(NODE_TOKEN)).read_all()
    assert table.column("name").to_pylist() == ["w"]
    assert np.frombuffer(table.column("data")[0].as_buffer(), np.float32).tolist() == \
        list(range(1024))
    client.close()


def test_clear_text_and_untrusting_clients_are_refused(
        tls_served: tuple[tensordb.Database, str]) -> None:
    _, address = tls_served
    plain = fl.FlightClient(f"grpc+tcp://{address}")
    with pytest.raises(fl.FlightError):
        list(plain.do_action(fl.Action("ping", b"{}"), _options(NODE_TOKEN)))
    plain.close()
    other = trustme.CA()  # a client that trusts another CA refuses the server
    stranger = fl.FlightClient(f"grpc+tls://{address}",
                               tls_root_certs=other.cert_pem.bytes())
    with pytest.raises(fl.FlightError):
        list(stranger.do_action(fl.Action("ping", b"{}"), _options(NODE_TOKEN)))
    stranger.close()


def test_the_data_plane_speaks_tls_only(tls_served: tuple[tensordb.Database, str],
                                        tls_files: dict[str, Path]) -> None:
    db, address = tls_served
    ca = transport.read_ca(tls_files["ca"])
    flight = transport.FlightTransport(NODE_TOKEN, 5.0, tls_ca=ca)
    try:
        port = flight.ping("n", address)["data_port"]
        sid = _segment_of(db, "team-a/x")
        out = np.empty(4096, np.uint8)
        flight.read_segment_into("n", address, sid, 0, out, lambda n: None)
        assert out.view(np.float32).tolist() == list(range(1024))
    finally:
        flight.close()
    # a clear-text request on the data port gets no bytes: the server wants a handshake
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        body = json.dumps({"token": NODE_TOKEN, "id": sid, "offset": 0,
                           "length": 64}).encode()
        s.sendall(len(body).to_bytes(4, "big") + body)
        s.settimeout(5)
        try:
            answer = s.recv(1 << 16)
        except (ConnectionError, TimeoutError):
            answer = b""
        assert np.arange(16, dtype=np.float32).tobytes()[:16] not in answer
    # a client trusting another CA fails the handshake: NodeUnavailable, no bytes
    other = transport.FlightTransport(NODE_TOKEN, 5.0, tls_ca=trustme.CA().cert_pem.bytes())
    try:
        with pytest.raises(NodeUnavailable):
            other.read_segment_into("n", address, sid, 0, np.empty(64, np.uint8),
                                    lambda n: None)
    finally:
        other.close()


def test_bad_tls_files_are_refused(tmp_path: Path, tls_files: dict[str, Path]) -> None:
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate")
    with pytest.raises(InvalidInput, match="junk.pem"):
        transport.ServerTLS.load(junk, tls_files["key"])
    with pytest.raises(InvalidInput, match="absent"):
        transport.ServerTLS.load(tls_files["cert"], tmp_path / "absent.pem")
    with pytest.raises(InvalidInput):  # a key of another certificate
        other = trustme.CA().issue_cert("127.0.0.1")
        key = tmp_path / "other.key"
        other.private_key_pem.write_to_path(str(key))
        transport.ServerTLS.load(tls_files["cert"], key)
    with pytest.raises(InvalidInput, match="junk.pem"):
        transport.read_ca(junk)
    assert isinstance(transport.ServerTLS.load(tls_files["cert"], tls_files["key"]).context(),
                      ssl.SSLContext)


# -- the CLI ---------------------------------------------------------------------------
def test_token_cli_creates_lists_and_revokes(home: Path) -> None:
    runner = CliRunner()
    r = runner.invoke(app, ["--home", str(home), "token", "create", "--role", "read",
                            "--scope", "team-a/*", "--note", "dashboards"])
    assert r.exit_code == 0, r.output
    token = r.stdout.strip().splitlines()[0]
    assert token.startswith("tdb_")
    r = runner.invoke(app, ["--home", str(home), "token", "list"])
    assert r.exit_code == 0 and "team-a/*" in r.stdout and token not in r.stdout
    tid = token.split("_")[1]
    assert runner.invoke(app, ["--home", str(home), "token", "revoke", tid]).exit_code == 0
    db = tensordb.connect(home=home)
    try:
        assert TokenStore(db.catalog.engine).grant(token) is None
    finally:
        db.close()
    r = runner.invoke(app, ["--home", str(home), "token", "create", "--role", "root",
                            "--scope", "*"])
    assert r.exit_code == 2 and "read, write, admin" in r.output


def test_nodes_pull_from_each_other_over_tls(tmp_path: Path, tls_files: dict[str, Path],
                                             ca: trustme.CA) -> None:
    """Two nodes that serve TLS and trust the CA: b pulls a's segment (Flight control,
    data plane bytes, both TLS), and a scoped read token's pull request is refused."""
    url = f"sqlite:///{tmp_path / 'catalog.db'}"
    tls = transport.ServerTLS.load(tls_files["cert"], tls_files["key"])
    dbs = {n: tensordb.connect(url, home=tmp_path / n, node=n, data_dir=tmp_path / n / "d",
                               tls_ca=tls_files["ca"], token=NODE_TOKEN, scrub_interval=0)
           for n in ("a", "b")}
    nodes = {n: transport.start_node(db, token=NODE_TOKEN, tls=tls, heartbeat=0.2)
             for n, db in dbs.items()}
    client = transport.FlightTransport(NODE_TOKEN, 10.0,
                                       tls_ca=transport.read_ca(tls_files["ca"]))
    try:
        _fill(dbs["a"])
        sid = _segment_of(dbs["a"], "team-a/x")
        _, reader = TokenStore(dbs["a"].catalog.engine).create("read", "*")
        scoped = transport.FlightTransport(reader, 10.0,
                                           tls_ca=transport.read_ca(tls_files["ca"]))
        with pytest.raises(Unauthorized):
            scoped.request_pull("b", nodes["b"].address, [sid], "a")
        scoped.close()
        # nor may a read token's read of the version make b pull what it lacks
        plain = fl.FlightClient(f"grpc+tls://{nodes['b'].address}",
                                tls_root_certs=tls_files["ca"].read_bytes())
        with pytest.raises(fl.FlightError, match="may not make it pull"):
            plain.do_get(fl.Ticket(b'{"collection": "team-a/x"}'), _options(reader)).read_all()
        plain.close()
        from tensordb.catalog import NodeDirectory

        assert NodeDirectory(dbs["b"].catalog.engine).local_tier(sid, "b") is None
        got = client.request_pull("b", nodes["b"].address, [sid], "a")
        assert got["segments"] == {sid: "host"}
        assert torch.equal(dbs["b"].get("team-a/x", "w", verify=True),
                           torch.arange(1024, dtype=torch.float32))
        assert NodeDirectory(dbs["b"].catalog.engine).local_tier(sid, "b") == "host"
    finally:
        client.close()
        for n in nodes.values():
            n.stop()
        for db in dbs.values():
            db.close()


def test_kv_reads_are_scoped_by_namespace(served: tuple[tensordb.Database, str]) -> None:
    db, address = served
    for ns in ("team-a/kv", "team-b/kv"):
        kv = db.kv(ns, block_tokens=4, capacity_bytes=8 << 20)
        kv.put([b"k" * 16], [torch.ones(4)])
        kv.close()
    _, token = TokenStore(db.catalog.engine).create("read", "team-a/*")
    flight = transport.FlightTransport(token, 5.0)
    try:
        assert len(flight.read_kv("n", address, "team-a/kv", 4, [b"k" * 16])) == 1
        with pytest.raises(Unauthorized, match="team-b/kv"):
            flight.read_kv("n", address, "team-b/kv", 4, [b"k" * 16])
    finally:
        flight.close()


def test_metrics_off_loopback_take_the_node_and_admin_tokens_only(
        sqlite_db: tensordb.Database) -> None:
    from transport._metrics import _bearer_only

    store = TokenStore(sqlite_db.catalog.engine)
    app_ = _bearer_only(lambda env, start: (start("200 OK", []), [b"m 1\n"])[1],
                        transport.Authenticator(NODE_TOKEN, store))
    status: list[str] = []

    def scrape(token: str | None) -> str:
        env = {"HTTP_AUTHORIZATION": f"Bearer {token}"} if token else {}
        app_(env, lambda s, h: status.append(s))
        return status[-1].split()[0]

    _, admin = store.create("admin", "*")
    _, reader = store.create("read", "*")
    _, tenant_admin = store.create("admin", "team-a/*")  # the metrics name every tenant
    assert [scrape(t) for t in (NODE_TOKEN, admin, reader, tenant_admin, None,
                                "wrong-token-1234567")] \
        == ["200", "200", "401", "401", "401", "401"]
