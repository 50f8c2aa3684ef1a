"""The contract of ``transport.Transport``: a pytest suite every transport passes.

Subclass ``TransportTests`` in a test module and give it the hooks, which act on a node
without going through the transport under test::

    class TestMyTransport(TransportTests):
        @pytest.fixture
        def store(self, tmp_path):                   # the NodeStore a node serves
            ...                                      # (a tensordb.Database), closed after
        def serve(self, store, token): ...           # serve it, requiring token; its address
        def stop(self, node): ...                    # the node goes away (idempotent)
        def client(self, token): ...                 # a Transport carrying token
        def put_segment(self, store, data): ...      # commit bytes; their segment id
        def put_kv(self, store, namespace, block_tokens, keys, blocks): ...

The suite runs in the test process; ``serve`` may start a server there (a
``NodeServer`` on loopback) or register the store with an in-process transport
(``LocalTransport``). Each test serves a ``RaisingStore`` around ``store`` so it can make
the node raise any error of ``tensordb.errors`` and check that the caller gets the same
class, with the same attributes. This module is the only one of the package that imports
pytest (and torch, to make KV blocks).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import pytest
import torch

import storage_engine as se
from tensordb.catalog import Catalog
from tensordb.config import Config
from tensordb.errors import InvalidInput, NodeUnavailable, NotFound, TensorDBError, Unauthorized

from ._base import ERROR_KINDS, KVBlocks, NodeStore, Transport

__all__ = ["RaisingStore", "Served", "TransportTests", "sample_error"]

#: attribute values the sample errors carry (each class takes those its __init__ names)
_SAMPLES: dict[str, Any] = {
    "collection": "llama", "tensor": "embed.weight", "version": 3, "node": "elsewhere",
    "names": ["embed.weight", "lm_head.weight"], "base": 2, "head": 4,
    "line": 2, "column": 7, "expected": ["FROM", "WHERE"], "group": "step-100",
    "reason": "rank 1 died before committing its part",
}
_BASE_ATTRS = ("collection", "tensor", "version", "node")  # what TensorDBError takes


def sample_error(cls: type[TensorDBError]) -> TensorDBError:
    """An instance of ``cls`` with every attribute its constructor takes set (from the
    samples above). A new class whose constructor needs another argument fails here:
    add a sample for it."""
    params = dict(inspect.signature(cls.__init__).parameters)
    params.pop("self", None)
    open_kw = any(p.kind is p.VAR_KEYWORD for p in params.values())
    kw = {k: v for k, v in _SAMPLES.items() if k in params or (open_kw and k in _BASE_ATTRS)}
    return cls(f"a {cls.__name__} raised on the node", **kw)


class RaisingStore:
    """A ``NodeStore`` that passes every call to ``inner``, except that while ``error``
    is set, ``tier`` and ``kv`` raise it: the node then fails a segment or KV request
    with exactly that exception."""

    def __init__(self, inner: NodeStore) -> None:
        self.inner = inner
        self.error: BaseException | None = None

    @property
    def config(self) -> Config:
        return self.inner.config

    @property
    def catalog(self) -> Catalog:
        return self.inner.catalog

    def tier(self, name: str) -> se.Tier:
        if self.error is not None:
            raise self.error
        return self.inner.tier(name)

    def kv(self, namespace: str, block_tokens: int = 256, *, create: bool = True
           ) -> KVBlocks:
        if self.error is not None:
            raise self.error
        return self.inner.kv(namespace, block_tokens, create=create)

    def stats(self) -> dict[str, int]:
        return self.inner.stats()


@dataclass(frozen=True, slots=True)
class Served:
    """A node the suite serves: its name, address and the store it serves."""

    node: str
    address: str
    store: RaisingStore


class TransportTests:
    """The suite; see the module docstring for the hooks a subclass provides."""

    #: the token the served node requires (None: a node without one; the token tests skip)
    token: str | None = "contract-test-token"
    #: bytes of the segment the reads fetch: several chunks of any sensible chunk size
    segment_bytes: int = 300_007

    # -- hooks -----------------------------------------------------------------------
    @pytest.fixture
    def store(self) -> NodeStore:
        raise NotImplementedError("a subclass provides the store fixture")

    def serve(self, store: NodeStore, token: str | None) -> str:
        raise NotImplementedError(f"{type(self).__name__} must give serve()")

    def stop(self, node: str) -> None:
        raise NotImplementedError(f"{type(self).__name__} must give stop()")

    def client(self, token: str | None) -> Transport:
        raise NotImplementedError(f"{type(self).__name__} must give client()")

    def put_segment(self, store: NodeStore, data: np.ndarray) -> str:
        """Commit ``data`` (uint8) on the node; the segment holding it at offset 0."""
        raise NotImplementedError(f"{type(self).__name__} must give put_segment()")

    def put_kv(self, store: NodeStore, namespace: str, block_tokens: int,
               keys: Sequence[bytes], blocks: Sequence[torch.Tensor]) -> None:
        raise NotImplementedError(f"{type(self).__name__} must give put_kv()")

    # -- fixtures --------------------------------------------------------------------
    @pytest.fixture
    def served(self, store: NodeStore) -> Iterator[Served]:
        raising = RaisingStore(store)
        address = self.serve(raising, self.token)
        try:
            yield Served(store.config.node, address, raising)
        finally:
            self.stop(store.config.node)

    @pytest.fixture
    def transport(self, served: Served) -> Iterator[Transport]:
        t = self.client(self.token)
        try:
            yield t
        finally:
            t.close()

    @pytest.fixture
    def segment(self, served: Served) -> tuple[str, np.ndarray]:
        data = np.random.default_rng(7).integers(0, 256, self.segment_bytes, np.uint8)
        return self.put_segment(served.store.inner, data), data

    # -- identity --------------------------------------------------------------------
    def test_ping_names_the_node(self, served: Served, transport: Transport) -> None:
        answer = transport.ping(served.node, served.address)
        assert answer["node"] == served.node
        assert {"host", "disk"} <= set(answer["tiers"])

    # -- segments --------------------------------------------------------------------
    def test_read_segment_whole_in_order(self, served: Served, transport: Transport,
                                         segment: tuple[str, np.ndarray]) -> None:
        sid, data = segment
        chunks: list[bytes] = []
        transport.read_segment(served.node, served.address, sid, 0, data.size,
                               lambda view: chunks.append(bytes(view)))
        assert b"".join(chunks) == data.tobytes()

    def test_read_segment_range(self, served: Served, transport: Transport,
                                segment: tuple[str, np.ndarray]) -> None:
        sid, data = segment
        lo, hi = 1001, data.size - 999
        chunks: list[bytes] = []
        transport.read_segment(served.node, served.address, sid, lo, hi - lo,
                               lambda view: chunks.append(bytes(view)))
        assert b"".join(chunks) == data[lo:hi].tobytes()

    def test_read_segment_into(self, served: Served, transport: Transport,
                               segment: tuple[str, np.ndarray]) -> None:
        sid, data = segment
        for lo, hi in ((0, data.size), (4096, data.size // 2 + 3)):
            dst = np.zeros(hi - lo, np.uint8)
            seen: list[int] = []
            transport.read_segment_into(served.node, served.address, sid, lo, dst,
                                        seen.append)
            assert np.array_equal(dst, data[lo:hi]) and sum(seen) == hi - lo

    def test_unknown_segment_and_bad_range(self, served: Served, transport: Transport,
                                           segment: tuple[str, np.ndarray]) -> None:
        sid, data = segment
        with pytest.raises(NotFound) as info:
            transport.read_segment(served.node, served.address, "no-such-segment", 0, 8,
                                   lambda view: None)
        assert info.value.node == served.node
        with pytest.raises(NotFound):
            transport.read_segment_into(served.node, served.address, "no-such-segment", 0,
                                        np.zeros(8, np.uint8), lambda n: None)
        with pytest.raises(InvalidInput):
            transport.read_segment(served.node, served.address, sid, data.size, 8 << 20,
                                   lambda view: None)

    # -- KV blocks -------------------------------------------------------------------
    def test_read_kv_returns_the_blocks_held(self, served: Served,
                                             transport: Transport) -> None:
        keys = [bytes([i]) * 16 for i in range(1, 5)]
        blocks = [torch.full((2, 3, 4), float(i), dtype=torch.float16) for i in range(3)]
        self.put_kv(served.store.inner, "contract-kv", 4, keys[:3], blocks)
        got = transport.read_kv(served.node, served.address, "contract-kv", 4, keys)
        assert [g[0] for g in got] == keys[:3]  # the absent key is skipped
        for (_key, dtype, shape, data, digest), block in zip(got, blocks, strict=True):
            assert dtype == "float16" and shape == (2, 3, 4)
            assert data.tobytes() == block.numpy().tobytes()
            assert digest == se.checksum(data)
        assert transport.read_kv(served.node, served.address, "contract-kv", 4, keys[3:]) == []

    # -- refusals and failures -------------------------------------------------------
    @staticmethod
    def _reads(t: Transport, served: Served, sid: str, namespace: str
               ) -> dict[str, Callable[[], object]]:
        """One request of each kind that reaches the node's store."""
        node, address = served.node, served.address
        return {
            "segment stream": lambda: t.read_segment(node, address, sid, 0, 16,
                                                     lambda view: None),
            "segment into": lambda: t.read_segment_into(node, address, sid, 0,
                                                        np.zeros(16, np.uint8), lambda n: None),
            "kv": lambda: t.read_kv(node, address, namespace, 4, [b"k"]),
        }

    def test_wrong_token_is_unauthorized(self, served: Served,
                                         segment: tuple[str, np.ndarray]) -> None:
        if self.token is None:
            pytest.skip("the node requires no token")
        sid, _ = segment
        for token in (None, "wrong-token"):
            t = self.client(token)
            try:
                calls: dict[str, Callable[[], object]] = {
                    "ping": partial(t.ping, served.node, served.address),
                    **self._reads(t, served, sid, "contract-kv")}
                for what, call in calls.items():
                    with pytest.raises(Unauthorized) as info:
                        call()
                    assert info.value.node == served.node, what
            finally:
                t.close()

    def test_a_node_that_is_gone(self, served: Served, transport: Transport,
                                 segment: tuple[str, np.ndarray]) -> None:
        sid, _ = segment
        transport.ping(served.node, served.address)
        self.stop(served.node)
        calls: dict[str, Callable[[], object]] = {
            "ping": lambda: transport.ping(served.node, served.address),
            **self._reads(transport, served, sid, "contract-kv")}
        for what, call in calls.items():
            with pytest.raises(NodeUnavailable) as info:
                call()
            assert info.value.node == served.node, what

    @pytest.mark.parametrize("kind", sorted(ERROR_KINDS))
    def test_every_error_crosses_as_itself(self, kind: str, served: Served,
                                           transport: Transport,
                                           segment: tuple[str, np.ndarray]) -> None:
        sent = sample_error(ERROR_KINDS[kind])
        served.store.error = sent
        try:
            for path, call in self._reads(transport, served, segment[0], f"kv-{kind}").items():
                with pytest.raises(TensorDBError) as info:
                    call()
                got = info.value
                assert type(got) is type(sent), (path, got)
                assert sent.message in got.message and str(got) == got.message, path
                for name, value in vars(sent).items():
                    if name == "message":
                        continue
                    want = served.node if name == "node" and value is None else value
                    assert getattr(got, name) == want, (path, name)
        finally:
            served.store.error = None

    def test_an_unexpected_failure_arrives_without_its_details(
            self, served: Served, transport: Transport,
            segment: tuple[str, np.ndarray]) -> None:
        served.store.error = err = OSError(2, "No such file or directory", "/secret/place/x")
        try:
            for path, call in self._reads(transport, served, segment[0], "kv-os").items():
                with pytest.raises(NodeUnavailable) as info:
                    call()
                text = str(info.value)
                assert "/secret/place" not in text and "Traceback" not in text, path
                assert type(err).__name__ in text and info.value.node == served.node, path
        finally:
            served.store.error = None
