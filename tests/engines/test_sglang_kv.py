"""SGLang 0.5.23: ``TensorDBHiCacheStorage`` as HiCache's storage tier, built by SGLang's
own ``StorageBackendFactory`` for ``--hicache-storage-backend dynamic``, on SGLang's
real host memory pools (``MHATokenToKVPoolHost`` / ``MLATokenToKVPoolHost`` over a
device pool on the CPU) in each page layout, and driven through SGLang's cache
controller code: its page keys (``get_storage_hash_str``), its hit query
(``batch_exists``), and its page transfer functions (``_page_set_zero_copy`` /
``_page_get_zero_copy`` for ``interface_v1``, ``_generic_page_set`` /
``_generic_page_get`` otherwise). The stand-in is the controller object around those
functions: a real one starts threads and process groups around a GPU device pool."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import tensordb
from tensordb.errors import InvalidInput

pytestmark = pytest.mark.engine("sglang")

PAGE = 4
LAYERS, HEADS, HEAD_DIM = 3, 2, 8
DEVICE_TOKENS = 256
CAPACITY = 32 << 20


def _storage_config(db: tensordb.Database, *, rank: int = 0, size: int = 1, mla: bool = False,
                    **extra: Any) -> Any:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    from engine_bindings._engines import StoreLocation
    from engine_bindings.sglang import hicache_extra_config

    return HiCacheStorageConfig(
        tp_rank=rank, tp_size=size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=mla, enable_storage_metrics=False, is_page_first_layout=False,
        model_name="tiny-llama",
        extra_config=hicache_extra_config(location=StoreLocation.of(db),
                                          **{"capacity_bytes": CAPACITY, **extra}))


def _mha_host(layout: str) -> Any:
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    device = MHATokenToKVPool(DEVICE_TOKENS, PAGE, torch.float32, HEADS, HEAD_DIM, LAYERS,
                              "cpu", False, start_layer=0, end_layer=LAYERS)
    return MHATokenToKVPoolHost(
        device.get_device_pool_infos()[0].buffer_info, 2.0, 0, PAGE, layout, pin_memory=False,
        device_capacity_tokens=device.size, start_layer=0, end_layer=LAYERS)


def _backend(db: tensordb.Database, host: Any, **kw: Any) -> Any:
    """What SGLang's cache controller does on attach: the factory, then the pool."""
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    backend = StorageBackendFactory.create_backend("dynamic", _storage_config(db, **kw), host)
    backend.register_mem_pool_host(host)
    return backend


def _controller(backend: Any, host: Any) -> Any:
    """The attributes of SGLang's HiCacheController its page transfer functions use."""
    return SimpleNamespace(storage_backend=backend, storage_host_pool=host,
                           mem_pool_host=host, page_size=PAGE)


def _fill(host: Any, indices: torch.Tensor, seed: int) -> None:
    """Give the host pool's pages at ``indices`` values unique to seed and slot."""
    g = torch.Generator().manual_seed(seed)
    for start in indices[::PAGE].tolist():
        page = host.get_data_page(start, flat=False)
        page.copy_(torch.randn(page.shape, generator=g))


def _pages(host: Any, indices: torch.Tensor) -> list[torch.Tensor]:
    return [host.get_data_page(s, flat=False).clone() for s in indices[::PAGE].tolist()]


@pytest.fixture
def made() -> Iterator[list[Any]]:
    backends: list[Any] = []
    yield backends
    for b in backends:
        b.close()


TOKENS = list(range(500, 500 + 5 * PAGE))


def _keys(tokens: list[int]) -> list[str]:
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    return get_storage_hash_str(tokens, None, page_size=PAGE)


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_pages_written_by_one_server_are_read_by_another(
        store: tensordb.Database, made: list[Any], layout: str) -> None:
    from sglang.srt.managers.cache_controller import HiCacheController

    from engine_bindings.sglang import TensorDBHiCacheStorage

    host_a, host_b = _mha_host(layout), _mha_host(layout)
    a, b = _backend(store, host_a), _backend(store, host_b)
    made += [a, b]
    assert isinstance(a, TensorDBHiCacheStorage) and a.namespace == b.namespace
    keys = _keys(TOKENS)
    assert len(keys) == 5 and all(isinstance(k, str) for k in keys)
    src = host_a.alloc(len(keys) * PAGE)
    _fill(host_a, src, seed=1)
    assert HiCacheController._page_set_zero_copy(_controller(a, host_a), keys[:4], src[:4 * PAGE])
    # server b: the hit query, then the zero-copy read into its own host pages
    assert b.batch_exists(keys) == 4 and b.batch_exists(keys[1:]) == 3
    assert b.exists(keys[0]) and not b.exists(keys[4])
    dst = host_b.alloc(len(keys) * PAGE)
    op = SimpleNamespace(request_id="r", is_terminated=lambda: False)
    got = HiCacheController._page_get_zero_copy(_controller(b, host_b), op, keys, dst)
    assert got == 4
    for want, have in zip(_pages(host_a, src[:4 * PAGE]), _pages(host_b, dst[:4 * PAGE]), strict=True):
        assert torch.equal(want, have)
    assert a.batch_get_v1(keys, dst) == [True] * 4 + [False]


def test_generic_interface_round_trips_through_sglang_page_functions(
        store: tensordb.Database, made: list[Any]) -> None:
    from sglang.srt.managers.cache_controller import HiCacheController

    host_a, host_b = _mha_host("page_first"), _mha_host("page_first")
    a, b = _backend(store, host_a), _backend(store, host_b)
    made += [a, b]
    keys = _keys(TOKENS)[:3]
    src, dst = host_a.alloc(3 * PAGE), host_b.alloc(3 * PAGE)
    _fill(host_a, src, seed=2)
    assert HiCacheController._generic_page_set(_controller(a, host_a), keys, src)
    op = SimpleNamespace(request_id="r", is_terminated=lambda: False)
    assert HiCacheController._generic_page_get(_controller(b, host_b), op, keys, dst) == 3
    for want, have in zip(_pages(host_a, src), _pages(host_b, dst), strict=True):
        assert torch.equal(want, have)
    view = b.get(keys[0])  # no target: the stored page itself, zero-copy
    assert torch.equal(view.reshape(-1), host_a.get_data_page(src[0].item()).reshape(-1))
    assert b.get("f" * 64) is None and b.batch_get(["f" * 64]) == [None]


def test_layouts_and_ranks_use_separate_namespaces(store: tensordb.Database,
                                                   made: list[Any]) -> None:
    host_lf, host_pf = _mha_host("layer_first"), _mha_host("page_first")
    lf, pf = _backend(store, host_lf), _backend(store, host_pf)
    r1 = _backend(store, _mha_host("layer_first"), rank=1, size=2)
    r0 = _backend(store, _mha_host("layer_first"), rank=0, size=2)
    made += [lf, pf, r1, r0]
    assert len({lf.namespace, pf.namespace, r0.namespace, r1.namespace}) == 4
    assert "tp1of2" in r1.namespace and lf.namespace.startswith("sglang/tiny-llama/")
    keys = _keys(TOKENS)[:2]
    idx = host_lf.alloc(2 * PAGE)
    _fill(host_lf, idx, seed=3)
    assert lf.batch_set_v1(keys, idx) == [True, True]
    assert pf.batch_exists(keys) == 0 and r0.batch_exists(keys) == 0


def test_mla_pages_are_shared_by_tensor_parallel_ranks(store: tensordb.Database,
                                                       made: list[Any]) -> None:
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    def host() -> Any:
        device = MLATokenToKVPool(DEVICE_TOKENS, PAGE, torch.float32, 16, 8, LAYERS, "cpu",
                                  False, start_layer=0, end_layer=LAYERS)
        info = device.get_device_pool_infos()[0]
        return MLATokenToKVPoolHost(info.buffer_info, 2.0, 0, PAGE, "page_first",
                                    pin_memory=False, device_capacity_tokens=device.size,
                                    start_layer=0, end_layer=LAYERS, target_layer_num=LAYERS)

    h0, h1 = host(), host()
    r0 = _backend(store, h0, rank=0, size=2, mla=True)
    r1 = _backend(store, h1, rank=1, size=2, mla=True)
    made += [r0, r1]
    assert r0.namespace == r1.namespace
    keys = _keys(TOKENS)[:2]
    src, dst = h0.alloc(2 * PAGE), h1.alloc(2 * PAGE)
    _fill(h0, src, seed=4)
    assert r0.batch_set_v1(keys, src) == [True, True]
    assert r1.batch_get_v1(keys, dst) == [True, True]
    for want, have in zip(_pages(h0, src), _pages(h1, dst), strict=True):
        assert torch.equal(want, have)


def test_full_store_answers_false_and_stores_nothing(store: tensordb.Database,
                                                     made: list[Any],
                                                     caplog: pytest.LogCaptureFixture) -> None:
    host = _mha_host("page_first")
    backend = _backend(store, host)
    made.append(backend)
    before = backend.kv.stats()
    big = torch.zeros(CAPACITY + (1 << 20), dtype=torch.uint8)  # more than the whole arena
    with caplog.at_level(logging.WARNING):
        assert backend.set("b" * 64, big) is False
        after = backend.kv.stats()
        assert backend.batch_set(["c" * 64, "d" * 64], [torch.ones(4), big]) is False
    assert "not stored" in caplog.text
    assert (after.blocks, after.nbytes) == (before.blocks, before.nbytes)
    assert not backend.exists("b" * 64) and not backend.exists("d" * 64)
    keys = _keys(TOKENS)[:2]
    assert backend.batch_set_v1(keys, host.alloc(2 * PAGE)) == [True, True]


def test_bad_inputs_are_typed_errors_and_change_nothing(store: tensordb.Database,
                                                        made: list[Any]) -> None:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    from engine_bindings.sglang import TensorDBHiCacheStorage

    host = _mha_host("page_first")
    backend = _backend(store, host)
    made.append(backend)
    keys = _keys(TOKENS)[:2]
    idx = host.alloc(2 * PAGE)
    before = backend.kv.stats()
    bad_calls = [
        lambda: backend.batch_set_v1(keys, idx[:PAGE]),  # one page of slots for 2 keys
        lambda: backend.batch_set_v1(keys, idx[1:1 + 2 * PAGE]),  # not a page start
        lambda: backend.batch_set_v1(keys, idx.view(2, -1)),
        lambda: backend.batch_set_v1([1, 2], idx),  # type: ignore[list-item]
        lambda: backend.batch_set_v1(keys[0], idx),  # type: ignore[arg-type]
        lambda: backend.batch_get_v1(keys, torch.tensor([10 ** 9] * (2 * PAGE))),
        lambda: backend.set(keys[0], "not a tensor"),
        lambda: backend.set("", torch.ones(3)),
        lambda: backend.batch_set(keys, [torch.ones(3)]),
        lambda: backend.get(keys[0], target_location=[0.0]),
        lambda: backend.batch_exists([b"raw"]),  # type: ignore[list-item]
    ]
    for call in bad_calls:
        with pytest.raises(InvalidInput):
            call()
    after = backend.kv.stats()
    assert (after.blocks, after.nbytes) == (before.blocks, before.nbytes)
    cfg = _storage_config(store, namespace="")
    with pytest.raises(InvalidInput, match="namespace"):
        TensorDBHiCacheStorage(cfg, {})
    cfg = _storage_config(store, capacity_bytes=-1)
    with pytest.raises(InvalidInput, match="capacity_bytes"):
        TensorDBHiCacheStorage(cfg, {})
    unregistered = TensorDBHiCacheStorage(_storage_config(store), {})
    with pytest.raises(InvalidInput, match="register_mem_pool_host"):
        unregistered.batch_exists(keys)
    with pytest.raises(InvalidInput):
        TensorDBHiCacheStorage(SimpleNamespace(), {})  # type: ignore[arg-type]
    with pytest.raises(InvalidInput):
        unregistered.register_mem_pool_host(object())
    assert isinstance(cfg, HiCacheStorageConfig)


def test_public_surface() -> None:
    import engine_bindings.sglang as binding

    assert {"TensorDBHiCacheStorage", "hicache_extra_config", "BACKEND_NAME"} <= set(
        binding.__all__)
    assert all(hasattr(binding, n) for n in binding.__all__)
    extra = binding.hicache_extra_config(namespace="ns")
    assert extra["module_path"] == "engine_bindings.sglang" and extra["interface_v1"] == 1
