"""KV events decoded with vLLM's own decoder: a namespace's stream after a random
put / evict / spill / delete workload is the store's contents, and a real engine's
connector names its blocks as vLLM does (its block hashes, its tokens, their parent).

The stream is vLLM's wire format (``vllm.distributed.kv_events.KVEventBatch``, the
release the project pins); the engine test needs vLLM's CPU build (``make e2e``)."""

from __future__ import annotations

import random
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import free_tcp_endpoint, wait_until

import tensordb
from tensordb.client import KVBlockInfo

from .engine_support import serving_checkpoint, why_no_forward, write_serving_config

pytestmark = [
    pytest.mark.engine("vllm"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]




class _VllmSubscriber:
    """A subscriber that decodes with vLLM's decoder and keeps (hash, medium) held."""

    def __init__(self, endpoint: str) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import (
            AllBlocksCleared,
            BlockRemoved,
            BlockStored,
            KVEventBatch,
        )

        self.kinds = (AllBlocksCleared, BlockRemoved, BlockStored)
        self.decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(endpoint)
        self.held: set[tuple[Any, str | None]] = set()
        self.stored: list[Any] = []
        self.seqs: list[int] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        cleared, removed, stored = self.kinds
        while not self._stop.is_set():
            if not self.sock.poll(100):
                continue
            _, seq, payload = self.sock.recv_multipart()
            batch = self.decoder.decode(payload)
            with self._lock:
                self.seqs.append(int.from_bytes(seq, "big"))
                for e in batch.events:
                    if isinstance(e, cleared):
                        self.held.clear()
                    elif isinstance(e, stored):
                        self.stored.append(e)
                        self.held.update((h, e.medium) for h in e.block_hashes)
                    elif isinstance(e, removed):
                        self.held.difference_update((h, e.medium) for h in e.block_hashes)

    def snapshot(self) -> set[tuple[Any, str | None]]:
        with self._lock:
            return set(self.held)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close(linger=0)




def test_vllms_decoder_reads_the_stream_of_a_random_workload(tmp_path: Path) -> None:
    pytest.importorskip("vllm.distributed.kv_events", reason="vLLM is not installed here")
    endpoint = free_tcp_endpoint()
    db = tensordb.connect(home=tmp_path / "store")
    kv = db.kv("ns", 16, capacity_bytes=256 << 10, slab_bytes=64 << 10,
               disk_capacity=96 << 10, events=endpoint)
    assert kv.events is not None and kv.events.wait_publishing(10)
    sub = _VllmSubscriber(endpoint)
    time.sleep(0.3)
    n = 300
    keys = [b"key-%04d" % i for i in range(n)]
    name = {k: (i.to_bytes(32, "big") if i % 2 else k) for i, k in enumerate(keys)}
    rng = random.Random(3)
    for _ in range(400):
        ids = rng.sample(range(n), 4)
        r = rng.random()
        if r < 0.6:
            kv.put([keys[i] for i in ids], torch.ones(4, 1024),
                   info=[KVBlockInfo(token_ids=[i] * 16, block_hashes=[name[keys[i]]])
                         if i % 2 else None for i in ids])
        elif r < 0.8:
            for i in ids:
                if kv.contains([keys[i]])[0]:
                    kv.get([keys[i]])
        else:
            kv.delete([keys[i] for i in ids])

    def want() -> set[tuple[Any, str]]:
        return {(name[k], "CPU" if loc[0] == "host" else "STORAGE") for k in keys
                if (loc := kv.store.locate(k)) is not None}

    try:
        assert wait_until(lambda: sub.snapshot() == want()), sorted(sub.snapshot() ^ want())[:4]
        assert sub.seqs == list(range(sub.seqs[0], sub.seqs[0] + len(sub.seqs)))
        assert kv.stats().spills > 0
    finally:
        sub.close()
        kv.close()
        db.close()
        shutil.rmtree(db.config.shm_dir, ignore_errors=True)


def test_an_engines_saved_blocks_are_announced_as_vllm_names_them(
        store: tensordb.Database, tmp_path: Path) -> None:
    """A vLLM engine with the connector and ``events``: every block it saves is a
    ``BlockStored`` of medium CPU carrying the hashes the engine's own KV events give
    the same blocks (medium GPU: vLLM's prefix cache), their parent, their tokens."""
    reason = why_no_forward()
    if reason:
        pytest.skip(reason)
    from tests.engines.test_vllm_e2e import BLOCK, PROMPT, _kv, generate, serving

    model_dir = write_serving_config(tmp_path / "serving-llama")
    store.commit("llama", serving_checkpoint(1))
    ours, port = free_tcp_endpoint(), int(free_tcp_endpoint().rsplit(":", 1)[1])
    sub, engines = _VllmSubscriber(ours), _VllmSubscriber(f"tcp://127.0.0.1:{port}")
    full = (len(PROMPT) - 1) // BLOCK
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
            mp.setenv("VLLM_TARGET_DEVICE", "cpu")
            with serving(model_dir, store, kv=_kv(store, events=ours),
                         kv_events_config={"enable_kv_cache_events": True,
                                           "publisher": "zmq",
                                           "endpoint": f"tcp://*:{port}"}) as llm:
                time.sleep(0.5)  # the subscriptions reach both publishers
                generate(llm)
                assert wait_until(lambda: len(sub.stored) >= full), len(sub.stored)
                assert wait_until(lambda: sum(len(e.block_hashes) for e in engines.stored)
                              >= full)
    finally:
        sub.close()
        engines.close()
    stored = sub.stored[:full]
    assert [e.token_ids for e in stored] == [PROMPT[i * BLOCK:(i + 1) * BLOCK]
                                             for i in range(full)]
    assert all(e.medium == "CPU" and e.block_size == BLOCK and len(e.block_hashes) == 1
               for e in stored)
    assert stored[0].parent_block_hash is None
    assert [e.parent_block_hash for e in stored[1:]] == [e.block_hashes[0]
                                                         for e in stored[:-1]]
    gpu = [h for e in engines.stored for h in e.block_hashes]
    assert [e.block_hashes[0] for e in stored] == gpu[:full]
    assert all(e.medium == "GPU" for e in engines.stored)
