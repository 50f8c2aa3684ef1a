"""The fuzzing campaign: hostile and careless inputs at every edge of the store, drawn
by hypothesis. Targets: safetensors headers and files (``import_safetensors``); names,
dtypes and shapes (``commit``, ``tag``, ``put_shard``, KV keys and blocks); query
statements (``db.query``); Flight tickets and actions and data-plane frames from a
hostile client, against a node server on loopback over an embedded SQLite catalog; KV
answers from a hostile peer (``pull_kv``).

Every case must end in a typed ``tensordb.errors`` error with a message (or succeed
legitimately, and then be readable), the process and the node server survive, and the
store is unchanged by a refused case (collections, history, ``verify() == []``; no KV
block under a key nobody asked for; no descriptor or thread left behind).

Bounded: each target runs ``DEFAULT_EXAMPLES`` derandomized cases (the file takes well
under a minute on 2 cores). ``TENSORDB_FUZZ_EXAMPLES=N`` runs N cases per target with
random seeds instead, for a longer campaign by hand; ``TENSORDB_FUZZ_REPORT=path``
writes the cases run per target and the untyped errors seen as JSON (docs/testing.md).
"""

from __future__ import annotations

import json
import os
import socket
import struct
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.flight as fl
import pytest
import torch
import xxhash
from conftest import open_store, remove_store
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tensordb
import transport
from tensordb.catalog import NodeDirectory
from tensordb.errors import TensorDBError
from transport import NodeServer
from transport._base import error_from_text
from transport._flight_client import KV_SCHEMA

TOKEN = "fuzzing-campaign-token-0123"
_LEN = struct.Struct(">I")
DEFAULT_EXAMPLES = 150
_LONG = int(os.environ.get("TENSORDB_FUZZ_EXAMPLES") or 0)

#: cases run per target, their outcomes (target: "ok" or the error's class), and the
#: untyped errors met (target, repr), for the report
CASES: Counter[str] = Counter()
OUTCOMES: dict[str, Counter[str]] = {}
UNTYPED: list[tuple[str, str]] = []


def _outcome(target: str, what: str) -> None:
    OUTCOMES.setdefault(target, Counter())[what] += 1


def fuzz_settings(examples: int = DEFAULT_EXAMPLES) -> settings:
    return settings(max_examples=_LONG or examples, deadline=None, derandomize=not _LONG,
                    database=None, print_blob=False,
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.filter_too_much])


@pytest.fixture(scope="module", autouse=True)
def _report() -> Iterator[None]:
    yield
    path = os.environ.get("TENSORDB_FUZZ_REPORT")
    if path:
        Path(path).write_text(json.dumps({"cases": dict(CASES), "outcomes": OUTCOMES,
                                          "untyped": sorted(set(map(tuple, UNTYPED)))},
                                         indent=1))


def _case(target: str, call: Callable[[], Any]) -> tuple[Any, TensorDBError | None]:
    """Run one case: its result, or the typed error it raised. Anything else is an
    untyped error: recorded, and raised (hypothesis then shrinks it)."""
    CASES[target] += 1
    try:
        got = call()
    except TensorDBError as exc:
        assert str(exc).strip(), f"{type(exc).__name__} without a message"
        _outcome(target, type(exc).__name__)
        return None, exc
    except Exception as exc:
        UNTYPED.append((target, f"{type(exc).__name__}: {exc}"[:300]))
        _outcome(target, "untyped")
        raise
    _outcome(target, "ok")
    return got, None


def _state(db: tensordb.Database) -> tuple[Any, ...]:
    names = db.collections()
    return (names, {c: [(h.version, h.message) for h in db.history(c)] for c in names},
            {c: db.tags(c) for c in names})


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture
def store(tmp_path: Path) -> Iterator[tensordb.Database]:
    db = open_store(tmp_path / "s", node="n1")
    try:
        yield db
    finally:
        remove_store(db)


# -- strategies -----------------------------------------------------------------------------
_ODD = ["", " ", ".", "..", "/", "a/../b", "/abs", "a//b", "a\\b", "x\x00y", "\ud800", "a\n",
        "\u202e", "é", "\t", "a" * 300, "a" * 1100, "con", "__metadata__", "%2e%2e"]
names = st.one_of(st.sampled_from(_ODD), st.text(max_size=40),
                  st.text(st.characters(min_codepoint=0xD7F0, max_codepoint=0xE010),
                          max_size=6),
                  st.from_regex(r"[a-z][a-z0-9._/-]{0,20}", fullmatch=True))
big_ints = st.one_of(st.integers(-3, 70), st.sampled_from(
    [2**31, 2**32, 2**53, 2**62, 2**63 - 1, 2**63, 2**64, 2**70, -(2**63), 10**30]))
json_scalars = st.one_of(st.none(), st.booleans(), big_ints, st.floats(allow_nan=True),
                         st.text(max_size=12))
json_values = st.recursive(json_scalars, lambda kids: st.one_of(
    st.lists(kids, max_size=4), st.dictionaries(st.text(max_size=8), kids, max_size=4)),
    max_leaves=12)

_ST_DTYPES = ["F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "U16", "U32",
              "U64", "BOOL", "F8_E4M3", "F8_E5M2", "C64", "F4", "E8M0", "f32", ""]
st_entry = st.fixed_dictionaries({}, optional={
    "dtype": st.one_of(st.sampled_from(_ST_DTYPES), json_scalars),
    "shape": st.one_of(st.lists(big_ints, max_size=4), json_values),
    "data_offsets": st.one_of(st.lists(big_ints, min_size=2, max_size=2),
                              st.lists(big_ints, max_size=3), json_values),
    "extra": json_scalars})


@st.composite
def safetensors_files(draw: st.DrawFn) -> bytes:
    """A safetensors file as a hostile or broken writer makes one."""
    kind = draw(st.sampled_from(["header", "header", "header", "raw", "valid", "mutated",
                                 "mutated"]))
    if kind == "raw":
        return draw(st.binary(max_size=200))
    if kind in ("valid", "mutated"):  # well formed: offsets that tile the data
        header: dict[str, Any] = {}
        pos = 0
        for i in range(draw(st.integers(0, 3))):
            dt, size = draw(st.sampled_from([("F32", 4), ("I8", 1), ("F16", 2), ("BOOL", 1)]))
            shape = draw(st.lists(st.integers(0, 4), max_size=3))
            n = int(np.prod(shape)) * size
            header[f"t{i}"] = {"dtype": dt, "shape": shape, "data_offsets": [pos, pos + n]}
            pos += n
        data = draw(st.binary(min_size=pos, max_size=pos))
    else:
        header = draw(st.dictionaries(names, st.one_of(st_entry, json_values), max_size=4))
        if draw(st.booleans()):
            header["__metadata__"] = draw(st.one_of(
                st.dictionaries(st.text(max_size=6), st.text(max_size=6), max_size=3),
                json_values))
        data = draw(st.binary(max_size=128))
    raw = json.dumps(header).encode()
    raw += b" " * draw(st.integers(0, 9))
    length = len(raw)
    if kind != "valid" and draw(st.integers(0, 5)) == 0:
        length = draw(st.one_of(big_ints.filter(lambda v: 0 <= v < 2**64),
                                st.just(len(raw) + 1), st.just(max(0, len(raw) - 1))))
    blob = bytearray(struct.pack("<Q", length) + raw + data)
    if kind == "mutated":  # a valid file with bytes changed, or cut short
        for _ in range(draw(st.integers(1, 4))):
            at = draw(st.integers(0, len(blob) - 1))
            blob[at] = draw(st.sampled_from([0, 0x22, 0x2C, 0x30, 0x39, 0x5B, 0x5D, 0x7B,
                                             0x7D, 0xFF, blob[at] ^ 1]))
        if draw(st.booleans()):
            blob = blob[: draw(st.integers(0, len(blob)))]
    return bytes(blob)


_TORCH_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8,
                 torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool,
                 torch.complex64, torch.uint16, torch.uint32, torch.float8_e4m3fn,
                 torch.float8_e5m2]


@st.composite
def tensors(draw: st.DrawFn) -> Any:
    kind = draw(st.integers(0, 9))
    if kind == 0:
        return draw(st.one_of(json_values, st.just(object()), st.just(np.array(["a"])),
                              st.just(np.array([1, None], dtype=object)),
                              st.just(np.zeros(3, "datetime64[s]")),
                              st.just(torch.zeros(2, device="meta")),
                              st.just(torch.zeros(3).to_sparse())))
    shape = draw(st.lists(st.integers(0, 4), max_size=4))
    dtype = draw(st.sampled_from(_TORCH_DTYPES))
    t = torch.zeros(shape, dtype=torch.float32).to(dtype) if dtype.is_floating_point or \
        dtype.is_complex else torch.zeros(shape, dtype=dtype)
    if kind == 1 and t.dim() >= 2:
        t = t.transpose(0, 1)  # strided
    if kind == 2:
        t = torch.zeros(1, dtype=dtype).expand(draw(st.integers(0, 64)))
    if kind == 3:
        return t.numpy() if dtype not in (torch.bfloat16, torch.float8_e4m3fn,
                                          torch.float8_e5m2, torch.uint16,
                                          torch.uint32) else t
    return t


# -- safetensors ------------------------------------------------------------------------------
def test_fuzz_safetensors_headers_and_files(store: tensordb.Database, tmp_path: Path) -> None:
    path = tmp_path / "f.safetensors"
    out = tmp_path / "out"
    seen = [0]

    @fuzz_settings()
    @given(safetensors_files())
    def case(blob: bytes) -> None:
        seen[0] += 1
        path.write_bytes(blob)
        before = _state(store)
        name = f"st{seen[0]}"
        got, err = _case("safetensors import", lambda: store.import_safetensors(name, path))
        if err is not None:
            assert _state(store) == before, blob[:200]
            return
        # committed: every tensor reads back, and exports
        with store.snapshot(name) as snap:
            for n in snap:
                snap[n]
            snap.state_dict()
        _case("safetensors import", lambda: store.export_safetensors(name, out / name))
        store.drop(name)

    case()
    assert CASES["safetensors import"] >= seen[0] > 0
    assert store.verify() == []


# -- names, dtypes and shapes -------------------------------------------------------------------
def test_fuzz_names_dtypes_and_shapes(store: tensordb.Database) -> None:
    store.commit("base", {"x": torch.ones(4)}, message="base")

    @fuzz_settings(250)
    @given(names, names, tensors(), names)
    def case(collection: str, name: str, value: Any, tag: str) -> None:
        before = _state(store)
        got, err = _case("names, dtypes, shapes",
                         lambda: store.commit(collection, {name: value}))
        if err is not None:
            assert _state(store) == before
        else:  # a legitimate commit: it reads back as given
            back = store.get(collection, name)
            src = value if isinstance(value, torch.Tensor) else torch.from_numpy(value)
            assert back.dtype == src.dtype and tuple(back.shape) == tuple(src.shape)
            store.drop(collection)
        before = _state(store)
        _, err = _case("names, dtypes, shapes", lambda: store.tag("base", tag, version=1))
        if err is not None:
            assert _state(store) == before
        else:
            store.untag("base", tag)

    case()
    assert store.verify() == []


shape_like = st.one_of(st.lists(big_ints, max_size=4), json_values,
                       st.just(torch.Size([2, 2])), st.just(np.array([2, 2])))


def test_fuzz_put_shard(store: tensordb.Database) -> None:
    @fuzz_settings()
    @given(tensors(), shape_like, shape_like)
    def case(value: Any, global_shape: Any, offsets: Any) -> None:
        before = _state(store)

        def put() -> None:
            with store.transaction("sharded") as tx:
                tx.put_shard("w", value, global_shape=global_shape, offsets=offsets)

        _, err = _case("put_shard", put)
        if err is not None:
            assert _state(store) == before
        else:
            store.get("sharded", "w")
            store.drop("sharded")

    case()
    assert store.verify() == []


def test_fuzz_kv_keys_and_blocks(store: tensordb.Database) -> None:
    kv = store.kv("ns", block_tokens=4, capacity_bytes=1 << 20, slab_bytes=64 << 10)
    held = kv.keys(list(range(8)))
    kv.put(held, [torch.ones(4), torch.zeros(4)])
    keyish = st.one_of(st.binary(max_size=80), json_scalars, st.just(held[0]))

    @fuzz_settings(250)
    @given(st.one_of(st.lists(big_ints, max_size=12), json_values,
                     st.just(np.arange(8, dtype=np.float32)), st.just(torch.arange(8))),
           st.one_of(st.lists(keyish, max_size=4), keyish),
           st.lists(tensors(), max_size=3))
    def case(tokens: Any, keys: Any, blocks: list[Any]) -> None:
        _case("kv keys and blocks", lambda: kv.keys(tokens))
        stored, err = _case("kv keys and blocks", lambda: kv.put(keys, blocks))
        if err is not None or not stored:
            assert kv.match(held) == 2
        _case("kv keys and blocks", lambda: kv.match(keys))
        _case("kv keys and blocks", lambda: kv.get(keys))

    case()
    assert [float(t[0]) for t in kv.get(held)] == [1.0, 0.0]


# -- query statements ------------------------------------------------------------------------
_WORDS = ["SELECT", "name", "version", "nbytes", "collection", "dtype", "tier", "FROM",
          "tensors", "versions", "collections", "commits", "nodes", "WHERE", "=", "<", ">=",
          "!=", "AND", "OR", "NOT", "(", ")", "'m'", "1", "0", "-1", "10000000000000000000000",
          "1e309", "1.5", "NULL", "TRUE", "LIKE", "'%'", "BETWEEN", "ORDER", "BY", "DESC",
          "LIMIT", "OFFSET", "GROUP", "HAVING", "count(*)", "sum(nbytes)", "*", ",", ";",
          "'", '"', "--", "/*", ":p", ":q", "DISTINCT", "EXPLAIN", "SHOW", "TABLES", "x" * 300,
          "'\x00'", "\ud800", "max(", "))))"]
statements = st.one_of(st.text(max_size=80),
                       st.lists(st.sampled_from(_WORDS), max_size=16).map(" ".join),
                       st.just("SELECT " + "(" * 500 + "1" + ")" * 500 + " FROM tensors"),
                       st.just("SELECT name FROM tensors WHERE " + " OR ".join(
                           ["version = 1"] * 3000)))


def test_fuzz_query_statements(store: tensordb.Database) -> None:
    store.commit("m", {"x": torch.ones(4), "y": torch.zeros(2)}, message="one")
    before = _state(store)

    @fuzz_settings(300)
    @given(statements, st.one_of(st.none(), st.dictionaries(
        st.sampled_from(["p", "q", "r"]), json_scalars, max_size=2)))
    def case(text: str, params: dict[str, Any] | None) -> None:
        got, err = _case("query statements", lambda: store.query(text, params))
        assert err is not None or isinstance(got, pa.Table)
        assert _state(store) == before

    case()
    assert store.verify() == []


# -- a hostile Flight client ------------------------------------------------------------------
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


@st.composite
def tickets(draw: st.DrawFn, seg: str) -> bytes:
    kind = draw(st.integers(0, 4))
    if kind == 0:
        return draw(st.binary(max_size=120))
    fields = {
        "kind": st.one_of(st.sampled_from(["segment", "kv", "version", ""]), json_scalars),
        "id": st.one_of(st.just(seg), st.just("../" + seg), names, json_scalars),
        "offset": st.one_of(big_ints, json_scalars), "length": st.one_of(big_ints, json_scalars),
        "collection": st.one_of(st.just("m"), names, json_scalars),
        "version": st.one_of(big_ints, json_scalars), "tag": st.one_of(names, json_scalars),
        "namespace": st.one_of(st.just("held"), names, json_scalars),
        "block_tokens": st.one_of(big_ints, json_scalars),
        "keys": st.one_of(st.lists(st.text(max_size=40), max_size=3), json_values),
        "names": st.one_of(st.lists(names, max_size=3), json_values),
        "verify": json_scalars}
    ticket = draw(st.fixed_dictionaries({}, optional=fields))
    if kind == 1:
        return json.dumps(draw(json_values)).encode()
    return json.dumps(ticket).encode()


def _flight_case(target: str, call: Callable[[], Any]) -> None:
    """A Flight call from a hostile client: it succeeds, or fails with a Flight error
    whose text carries a typed error (never a traceback)."""
    CASES[target] += 1
    try:
        call()
        _outcome(target, "ok")
    except fl.FlightError as exc:
        text = str(exc)
        typed = error_from_text(text, "n1")
        if typed is None or "Traceback" in text or 'File "' in text:
            UNTYPED.append((target, text[:300]))
            raise AssertionError(f"an untyped Flight error: {text[:500]}") from None
        _outcome(target, type(typed).__name__)
    except Exception as exc:
        UNTYPED.append((target, f"{type(exc).__name__}: {exc}"[:300]))
        raise


def test_fuzz_flight_tickets_and_actions(store: tensordb.Database, server: NodeServer) -> None:
    store.commit("m", {"x": torch.arange(64, dtype=torch.float32)}, message="one")
    kv = store.kv("held", block_tokens=4, capacity_bytes=1 << 20, slab_bytes=64 << 10)
    kv.put(kv.keys(list(range(8))), [torch.ones(4), torch.zeros(4)])
    seg = _segment(store, "m")
    before = _state(store)
    client = fl.FlightClient(f"grpc+tcp://127.0.0.1:{server.port}")
    auth = fl.FlightCallOptions(headers=[(b"authorization", f"Bearer {TOKEN}".encode())],
                                timeout=10)
    kv_rows = len(NodeDirectory(store.catalog.engine).kv_nodes("held"))
    fds, threads = _fds(), threading.active_count()

    @fuzz_settings(300)
    @given(tickets(seg), st.sampled_from(["ping", "pull", "", "x", "get"]),
           st.one_of(st.binary(max_size=60), json_values.map(lambda v: json.dumps(v).encode())))
    def case(ticket: bytes, action: str, body: bytes) -> None:
        _flight_case("flight tickets", lambda: client.do_get(fl.Ticket(ticket), auth).read_all())
        _flight_case("flight tickets", lambda: list(client.do_action(fl.Action(action, body),
                                                                     auth)))
        _flight_case("flight tickets", lambda: client.get_flight_info(
            fl.FlightDescriptor.for_command(ticket), auth))

    try:
        case()
        with pytest.raises(fl.FlightUnauthenticatedError):  # and no token: refused
            client.do_get(fl.Ticket(b"{}")).read_all()
    finally:
        client.close()
    assert _state(store) == before and store.verify() == []
    assert len(NodeDirectory(store.catalog.engine).kv_nodes("held")) == kv_rows
    assert sorted(p.name for p in (Path(store.config.shm_dir) / "kv").iterdir()) == ["held"]
    t = transport.FlightTransport(TOKEN, timeout=5.0)
    try:  # the node still serves a legitimate read
        got = np.zeros(256, np.uint8)
        t.read_segment_into("n1", f"127.0.0.1:{server.port}", seg, 0, got, lambda n: None)
        assert np.array_equal(got.view(np.float32), np.arange(64, dtype=np.float32))
    finally:
        t.close()
    assert _fds() <= fds + 16 and threading.active_count() <= threads + 8


@st.composite
def frames(draw: st.DrawFn, seg: str) -> bytes:
    kind = draw(st.integers(0, 5))
    if kind == 0:
        return draw(st.binary(max_size=64))
    req = draw(st.fixed_dictionaries({}, optional={
        "id": st.one_of(st.just(seg), names, json_scalars),
        "offset": st.one_of(big_ints, json_scalars),
        "length": st.one_of(big_ints, json_scalars),
        "token": st.one_of(st.just(TOKEN), st.text(max_size=30), json_scalars)}))
    body = json.dumps(req if kind > 1 else draw(json_values)).encode()
    if kind == 5:
        body = body[: draw(st.integers(0, len(body)))]  # cut short
    length = len(body) if draw(st.integers(0, 4)) else draw(big_ints.filter(
        lambda v: 0 <= v < 2**32))
    return _LEN.pack(length) + body


def test_fuzz_data_plane_frames(store: tensordb.Database, server: NodeServer) -> None:
    store.commit("m", {"x": torch.arange(64, dtype=torch.float32)})
    seg = _segment(store, "m")
    plane = server.data_plane
    assert plane is not None
    fds, threads = _fds(), threading.active_count()

    @fuzz_settings(300)
    @given(frames(seg))
    def case(frame: bytes) -> None:
        CASES["data-plane frames"] += 1
        with socket.create_connection(("127.0.0.1", plane.port), timeout=10) as s:
            try:
                s.sendall(frame)
                s.shutdown(socket.SHUT_WR)  # all there is: the node must not wait for more
            except OSError:
                pass  # answered and closed before all of it was sent
            answer = b""
            try:
                while chunk := s.recv(1 << 16):
                    answer += chunk
            except ConnectionResetError:
                pass
        if len(answer) < _LEN.size:
            _outcome("data-plane frames", "closed")
            return  # closed without a word: allowed for an incomplete frame
        (n,) = _LEN.unpack(answer[:4])
        head = json.loads(answer[4 : 4 + n])
        if "error" in head:
            typed = transport.error_from_payload(head["error"], "n1")
            if typed is None or "Traceback" in json.dumps(head) or \
                    "failed on the request" in typed.message:  # an exception of its own
                UNTYPED.append(("data-plane frames", json.dumps(head)[:300]))
                raise AssertionError(f"an untyped data-plane error: {head}")
            assert TOKEN not in json.dumps(head)
            _outcome("data-plane frames", type(typed).__name__)
        else:
            assert head == {"ok": True}
            _outcome("data-plane frames", "ok")

    case()
    t = transport.FlightTransport(TOKEN, timeout=5.0)
    try:
        got = np.zeros(256, np.uint8)
        t.read_segment_into("n1", f"127.0.0.1:{server.port}", seg, 0, got, lambda n: None)
        assert np.array_equal(got.view(np.float32), np.arange(64, dtype=np.float32))
    finally:
        t.close()
    assert plane.accept_errors == 0
    assert _fds() <= fds + 16 and threading.active_count() <= threads + 8


# -- KV answers from a hostile peer -------------------------------------------------------------
class HostilePeer(fl.FlightServerBase):  # type: ignore[misc]
    """A node that answers every KV ticket with ``self.answer`` (a table)."""

    def __init__(self) -> None:
        super().__init__("grpc+tcp://127.0.0.1:0")
        self.answer: pa.Table = pa.table({"x": [1]})
        self.pong = b'{"node": "evil"}'
        self.asked: list[bytes] = []

    def do_action(self, context: fl.ServerCallContext, action: fl.Action
                  ) -> Iterator[fl.Result]:
        return iter([fl.Result(self.pong)])

    def do_get(self, context: fl.ServerCallContext, ticket: fl.Ticket) -> fl.RecordBatchStream:
        req = json.loads(ticket.ticket)
        self.asked = [bytes.fromhex(k) for k in req.get("keys", []) if isinstance(k, str)]
        return fl.RecordBatchStream(self.answer)


@st.composite
def kv_answers(draw: st.DrawFn, asked: list[bytes], keys_of: Callable[[int], bytes]
               ) -> pa.Table:
    kind = draw(st.integers(0, 6))
    if kind == 0:  # another layout
        return pa.table({draw(st.text(min_size=1, max_size=5)): draw(
            st.lists(st.integers(0, 5), min_size=1, max_size=3))})
    rows = []
    for _ in range(draw(st.integers(0, 4))):
        key = draw(st.one_of(st.sampled_from(asked), st.binary(min_size=1, max_size=40),
                             st.just(keys_of(10_000))))
        dtype = draw(st.one_of(st.sampled_from(["float32", "float16", "int8", "bool",
                                                "bfloat16"]), st.text(max_size=10)))
        shape = draw(st.one_of(st.sampled_from(["4", "2,2", "", "0", "8"]),
                               st.text(max_size=8), big_ints.map(str)))
        data = draw(st.one_of(st.binary(max_size=40), st.just(bytes(16))))
        digest = draw(st.one_of(st.just(""), st.text(max_size=20),
                                st.just(xxhash.xxh3_64_hexdigest(data))))
        rows.append((key, dtype, shape, data, digest))
        if kind == 1 and rows:  # a well-formed block: right key, shape and digest
            data = np.ones(4, np.float32).tobytes()
            rows[-1] = (asked[0], "float32", "4", data, xxhash.xxh3_64_hexdigest(data))
    if not rows:
        return KV_SCHEMA.empty_table()
    cols = list(zip(*rows, strict=True))
    return pa.Table.from_arrays([pa.array(list(c), f.type) for c, f in zip(cols, KV_SCHEMA,
                                                                          strict=True)],
                                schema=KV_SCHEMA)


def test_fuzz_kv_answers_from_a_hostile_peer(store: tensordb.Database) -> None:
    peer = HostilePeer()
    directory = NodeDirectory(store.catalog.engine)
    kv = store.kv("ns", block_tokens=4, capacity_bytes=1 << 20, slab_bytes=64 << 10)
    step = [0]

    def keys_of(i: int) -> bytes:
        return kv.keys(list(range(4 * i, 4 * i + 4)))[0]

    asked = [keys_of(i) for i in range(3)]
    unasked = keys_of(10_000)
    try:
        @fuzz_settings(250)
        @given(kv_answers(asked, keys_of), st.one_of(
            st.just(b'{"node": "evil"}'), st.just(b'{"node": "evil"}'),
            st.binary(max_size=20), json_values.map(lambda v: json.dumps(v).encode())))
        def case(table: pa.Table, pong: bytes) -> None:
            step[0] += 1
            peer.answer, peer.pong = table, pong
            directory.register("evil", f"127.0.0.1:{peer.port}", ["host"], None)
            had = kv.contains(asked)
            got, err = _case("kv answers", lambda: store.pull_kv(
                "ns", asked, block_tokens=4, nodes=["evil"]))
            assert kv.contains([unasked]) == [False]  # nothing planted, ever
            if err is not None:
                assert kv.contains(asked) == had  # none of a refused answer kept
                assert err.node == "evil", err
            else:
                assert got == sum(kv.contains(asked)) - sum(had)
                for k, held in zip(asked, kv.contains(asked), strict=True):
                    if held:
                        kv.get([k])  # readable, its checksum good
                kv.delete(asked)

        case()
    finally:
        peer.shutdown()
    assert step[0] > 0 and store.verify() == []


# -- what the campaign found, kept as plain regressions ------------------------------------------
def test_a_peer_that_answers_ping_with_junk_is_node_unavailable(
        store: tensordb.Database) -> None:
    """A peer whose ping answer is not a JSON object (bytes that are not UTF-8, text
    that is not JSON, a JSON list): NodeUnavailable naming it, not a JSONDecodeError."""
    peer = HostilePeer()
    NodeDirectory(store.catalog.engine).register("evil", f"127.0.0.1:{peer.port}", ["host"],
                                                 None)
    kv = store.kv("ns", block_tokens=4, capacity_bytes=1 << 20, slab_bytes=64 << 10)
    keys = kv.keys(list(range(8)))
    try:
        for pong in (b"\x80\xff", b"not json", b"[1, 2]", b'"x"', b""):
            peer.pong = pong
            with pytest.raises(tensordb.errors.NodeUnavailable, match="not a JSON object") \
                    as info:
                store.pull_kv("ns", keys, block_tokens=4, nodes=["evil"])
            assert info.value.node == "evil"
        assert kv.contains(keys) == [False, False]
    finally:
        peer.shutdown()


def test_kv_keys_that_are_no_sequence_are_invalid_input(store: tensordb.Database) -> None:
    kv = store.kv("ns", block_tokens=4, capacity_bytes=1 << 20, slab_bytes=64 << 10)
    for keys in (None, 5, 1.5, object(), {b"k": 1}):
        for call in (kv.match, kv.get, lambda k: kv.put(k, [])):
            with pytest.raises(tensordb.errors.InvalidInput, match="sequence of keys"):
                call(keys)


def test_an_empty_block_from_a_peer_is_corrupt_data(store: tensordb.Database) -> None:
    """A block of shape (0,) and no bytes, its checksum right: CorruptData (torch could
    not view it, a RuntimeError), none of the answer kept."""
    peer = HostilePeer()
    NodeDirectory(store.catalog.engine).register("evil", f"127.0.0.1:{peer.port}", ["host"],
                                                 None)
    kv = store.kv("ns", block_tokens=4, capacity_bytes=1 << 20, slab_bytes=64 << 10)
    keys = kv.keys(list(range(8)))
    good = np.ones(4, np.float32).tobytes()
    rows = [(keys[0], "float32", "4", good, xxhash.xxh3_64_hexdigest(good)),
            (keys[1], "float32", "0", b"", xxhash.xxh3_64_hexdigest(b""))]
    cols = list(zip(*rows, strict=True))
    peer.answer = pa.Table.from_arrays([pa.array(list(c), f.type) for c, f in
                                        zip(cols, KV_SCHEMA, strict=True)], schema=KV_SCHEMA)
    try:
        with pytest.raises(tensordb.errors.CorruptData, match="is empty") as info:
            store.pull_kv("ns", keys, block_tokens=4, nodes=["evil"])
        assert info.value.node == "evil" and kv.contains(keys) == [False, False]
    finally:
        peer.shutdown()
