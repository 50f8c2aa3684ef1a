"""SGLang 0.5.23: ``TensorDBHiCacheStorage`` under SGLang's real ``HiCacheController``,
its storage threads running: the backup thread writes a server's host pages to the
store; on a second server's controller the prefetch thread asks the store what it holds
and the I/O thread reads the pages into that server's host pool.

What stands in for SGLang's scheduler thread is the step it takes between the two
threads (``HiRadixCache`` allocates host pages for the hit and hands the operation to
the I/O thread); a live engine with HiCache needs CUDA in this version (its host pools
are pinned with ``cudaHostRegister``), the controller does not.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import tensordb

from .engine_support import sglang_rank, write_config
from .test_sglang_kv import DEVICE_TOKENS, HEAD_DIM, HEADS, LAYERS, PAGE, _fill, _pages

pytestmark = pytest.mark.engine("sglang")

TOKENS = list(range(800, 800 + 6 * PAGE))


@pytest.fixture(scope="module")
def tp_group(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """SGLang's state for one CPU rank; yields its tensor-parallel group (gloo)."""
    from sglang.srt.runtime_context import get_parallel
    from sglang.srt.server_args import ServerArgs

    server_args = ServerArgs(model_path=str(write_config(tmp_path_factory.mktemp("llama"))),
                             device="cpu", dtype="float32", skip_tokenizer_init=True)
    with sglang_rank(server_args):
        yield get_parallel().tp_group.cpu_group


class Server:
    """One server's KV memory (SGLang's device pool on the CPU, its allocator and its
    host pool) and SGLang's HiCacheController over them, with the store attached as its
    storage backend (``--hicache-storage-backend dynamic``)."""

    def __init__(self, db: tensordb.Database, group: Any, layout: str) -> None:
        from sglang.srt.managers.cache_controller import HiCacheController
        from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
        from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

        from engine_bindings._engines import StoreLocation
        from engine_bindings.sglang import hicache_extra_config

        device = MHATokenToKVPool(DEVICE_TOKENS, PAGE, torch.float32, HEADS, HEAD_DIM, LAYERS,
                                  "cpu", False, start_layer=0, end_layer=LAYERS)
        self.host = MHATokenToKVPoolHost(
            device.get_device_pool_infos()[0].buffer_info, 2.0, 0, PAGE, layout,
            pin_memory=False, device_capacity_tokens=device.size, start_layer=0,
            end_layer=LAYERS)
        allocator = PagedTokenToKVPoolAllocator(DEVICE_TOKENS, PAGE, torch.float32, "cpu",
                                                device, need_sort=False)
        extra = hicache_extra_config(location=StoreLocation.of(db), capacity_bytes=32 << 20)
        self.controller = HiCacheController(
            allocator, self.host, PAGE, group, threading.Event(), io_backend="direct",
            storage_backend="dynamic", model_name="tiny-llama",
            storage_backend_extra_config=json.loads(json.dumps(extra)))

    def close(self) -> None:
        self.controller.detach_storage_backend()


def _wait(queue: Any, what: str, timeout: float = 30.0) -> Any:
    from queue import Empty

    try:
        return queue.get(timeout=timeout)
    except Empty:
        raise AssertionError(f"no {what} within {timeout} s") from None


@pytest.fixture
def servers() -> Iterator[list[Server]]:
    made: list[Server] = []
    yield made
    for s in made:
        s.close()


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_controller_threads_back_up_and_prefetch_through_the_store(
        store: tensordb.Database, tp_group: Any, servers: list[Server],
        layout: str) -> None:
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    from engine_bindings.sglang import TensorDBHiCacheStorage

    a = Server(store, tp_group, layout)
    servers.append(a)
    assert isinstance(a.controller.storage_backend, TensorDBHiCacheStorage)
    assert a.controller.backup_thread.is_alive() and a.controller.prefetch_thread.is_alive()

    # server a: 5 of the prompt's 6 pages are in its host pool; the backup thread
    # writes them to the store
    src = a.host.alloc(5 * PAGE)
    _fill(a.host, src, seed=7)
    hashes = get_storage_hash_str(TOKENS, None, page_size=PAGE)
    a.controller.write_storage(src, TOKENS[:5 * PAGE], hash_value=hashes[:5])
    done = _wait(a.controller.ack_backup_queue, "backup ack")
    assert done.completed_tokens == 5 * PAGE

    # server b: the prefetch thread's hit query, then (as the scheduler thread does)
    # host pages for the hit, then the I/O thread's reads
    b = Server(store, tp_group, layout)
    servers.append(b)
    op = b.controller.prefetch("r1", TOKENS)
    hit = _wait(b.controller.prefetch_hit_queue, "prefetch hit query")
    assert hit is op and op.storage_hit_count == 5 * PAGE and op.hash_value == hashes[:5]
    op.host_indices = b.host.alloc(op.storage_hit_count)
    b.controller.prefetch_buffer.put(op)
    deadline = time.monotonic() + 30
    acks = []
    while not (acks and acks[-1].completed_req):
        acks.append(_wait(b.controller.ack_prefetch_queue, "prefetch ack",
                          max(0.1, deadline - time.monotonic())))
    # each batch's ack counts the tokens read so far (all ranks agreeing)
    assert max(a.completed_tokens or 0 for a in acks) == 5 * PAGE
    for want, got in zip(_pages(a.host, src), _pages(b.host, op.host_indices), strict=True):
        assert torch.equal(want, got)

    # a prompt the store does not hold: no hit, nothing read
    miss = b.controller.prefetch("r2", [t + 10_000 for t in TOKENS])
    assert _wait(b.controller.prefetch_hit_queue, "prefetch hit query") is miss
    assert miss.storage_hit_count == 0 and miss.hash_value == []
