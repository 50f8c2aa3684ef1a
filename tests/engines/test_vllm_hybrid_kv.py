"""The connector with the models users run, on vLLM's real classes: a hybrid model
(full-attention and sliding-window layers: two KV cache groups under vLLM's hybrid KV
cache manager, ``SupportsHMA``), an MLA model's latent cache as a GPU engine moves it
(vLLM's CPU build never loads it: test_vllm_models_e2e.py), and tensor-parallel ranks
of two engines (TP=2, each rank's worker connector in a process of its own with vLLM's
real parallel state).

The scheduler is vLLM's own and runs whole request lifetimes (schedule -> the worker's
connector calls around a forward -> ``update_from_output``); the forward is a stand-in
that writes each token's KV where attention would, in every group's blocks, so that
what a second engine loads can be compared with what the first one computed, block by
block. Forward passes of such models are in test_vllm_models_e2e.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import tensordb
from tensordb.errors import InvalidInput

from .engine_support import free_port, write_config
from .test_vllm_kv import BLOCK, HEAD, KV_HEADS, NUM_BLOCKS, _config, _extra, kv_value
from .test_vllm_kv import LAYERS as TP_LAYERS  # the TP engines' model: one group
from .test_vllm_scheduler_loop import LoopEngine, _request

pytestmark = pytest.mark.engine("vllm")

WINDOW = 20  # tokens of the sliding-window layers' window: a bit more than a block
FULL = ["model.layers.0.self_attn.attn", "model.layers.2.self_attn.attn"]
SLIDING = ["model.layers.1.self_attn.attn", "model.layers.3.self_attn.attn"]
LAYERS = sorted(FULL + SLIDING)
PROMPT = list(range(3000, 3000 + 4 * BLOCK + 5))  # 4 full blocks and a tail
HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_config(tmp_path_factory.mktemp("tiny-llama"))


def hybrid_cache_config() -> Any:
    """Two KV cache groups, as vLLM's hybrid manager groups a model whose layers
    alternate full and sliding-window attention; one block pool for both."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        SlidingWindowSpec,
    )

    full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD,
                             dtype=torch.float32)
    sliding = SlidingWindowSpec(block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD,
                                dtype=torch.float32, sliding_window=WINDOW)
    return KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(list(FULL), full),
                                          KVCacheGroupSpec(list(SLIDING), sliding)])


class HybridEngine(LoopEngine):
    """One engine: vLLM's scheduler over two KV cache groups, and one worker's
    connector with its paged caches. As in vLLM, a full layer and a sliding one share
    one cache tensor (the groups' blocks come from one pool, never the same block)."""

    def __init__(self, vllm_config: Any) -> None:
        super().__init__(vllm_config, kv_cache_config=hybrid_cache_config())
        shared = [torch.zeros(NUM_BLOCKS, KV_HEADS, BLOCK, 2 * HEAD) for _ in FULL]
        self.caches = {name: shared[i] for names in (FULL, SLIDING)
                       for i, name in enumerate(names)}
        self.worker.register_kv_caches(self.caches)

    def ids_of(self, req_id: str, layer: str) -> list[int]:
        groups = self.scheduler.kv_cache_manager.get_block_ids(req_id)
        return list(groups[0 if layer in FULL else 1])


def test_hybrid_model_groups_are_saved_and_loaded_block_for_block(
        store: tensordb.Database, model_dir: Path) -> None:
    """vLLM leaves its hybrid KV cache manager on with the connector. Engine A prefills
    a prompt in chunks: each stored block holds every group's layers. Engine B then
    loads the four stored blocks: the full layers' blocks equal A's KV, every
    sliding-window block vLLM kept for the window equals A's, the blocks that left the
    window are vLLM's null block and are not written (it stays zero), and the request
    runs to its end in both engines with nothing left behind."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import supports_hma

    config = _config(model_dir, _extra(store), chunk=24)
    assert not config.scheduler_config.disable_hybrid_kv_cache_manager
    a = HybridEngine(config)
    assert supports_hma(a.scheduler.connector)
    _request(a, "r1", PROMPT, seed=3, max_tokens=2)
    saves = [[len(s.keys) for s in step.kv_connector_metadata.saves] for step in a.run()]
    assert [n for n in saves if n] == [[1], [2], [1]]  # chunks of 24 tokens complete them
    assert {r: str(f) for r, f in a.finished.items()} == {"r1": "length"}
    kv = a.worker.caches[0]
    keys = kv.keys(PROMPT)[:4]
    assert kv.match(keys) == 4
    stored = kv.get(keys)
    for i, block in enumerate(stored):  # [layers, 1, heads, BLOCK, 2 * head], all layers
        for layer in range(len(LAYERS)):
            want = torch.stack([kv_value(3, layer, p) for p in range(i * BLOCK, (i + 1) * BLOCK)])
            assert torch.equal(block[layer, 0].permute(1, 0, 2), want), (i, layer)

    b = HybridEngine(_config(model_dir, _extra(store), chunk=128))
    _request(b, "r2", PROMPT, seed=99, max_tokens=2)  # its forward would write other values
    # a hybrid engine's loads are asynchronous to vLLM: a step loads, the next computes
    first = b.run_step()
    (load,) = first.kv_connector_metadata.loads
    assert len(load.keys) == 4 and first.num_scheduled_tokens == {}
    assert b.transfers.finished_recving == {"r2"} and not b.transfers.failed_recving
    full_ids, sliding_ids = load.block_ids
    # the window of the next token reaches back into block 2: blocks 0 and 1 are null
    assert 0 not in full_ids and sliding_ids[:2] == [0, 0] and 0 not in sliding_ids[2:]
    assert torch.count_nonzero(b.caches[FULL[0]][0]) == 0  # the null block: never written
    for layer, name in enumerate(LAYERS):
        ids = b.ids_of("r2", name)
        for pos in range(4 * BLOCK):
            if ids[pos // BLOCK] == 0:
                continue
            got = b.caches[name][ids[pos // BLOCK], :, pos % BLOCK]
            assert torch.equal(got, kv_value(3, layer, pos)), (name, pos)
    second = b.run_step()
    assert second.scheduled_new_reqs[0].num_computed_tokens == 4 * BLOCK
    assert second.kv_connector_metadata.saves == []  # its blocks are all stored
    b.run()
    assert {r: str(f) for r, f in b.finished.items()} == {"r2": "length"}
    for e in (a, b):
        assert not e.scheduler.requests and not e.scheduler.connector.request_ids()
        assert e.scheduler.kv_cache_manager.block_pool.free_block_queue.num_free_blocks \
            == NUM_BLOCKS - 1
        e.close()


def test_a_block_whose_window_kv_is_gone_is_not_saved(store: tensordb.Database,
                                                      model_dir: Path) -> None:
    """A request served from vLLM's own prefix cache holds vLLM's null block for the
    sliding-window blocks left behind by the window: the stored blocks the store lacks
    there are not saved (their sliding layers' KV is gone), those it can fill whole
    are, as computed."""
    a = HybridEngine(_config(model_dir, _extra(store), chunk=128))
    _request(a, "r1", PROMPT, seed=3, max_tokens=2)
    a.run()
    kv = a.worker.caches[0]
    longer = PROMPT[:4 * BLOCK] + list(range(8000, 8000 + 2 * BLOCK + 3))
    keys = kv.keys(longer)
    kv.delete(keys[:3])  # the store lost blocks 0-2; vLLM's prefix cache holds them
    _request(a, "r3", longer, seed=3, max_tokens=2)
    first = a.run_step()
    assert first.scheduled_new_reqs[0].num_computed_tokens == 4 * BLOCK  # a local hit
    assert a.ids_of("r3", SLIDING[0])[:2] == [0, 0]
    (save,) = first.kv_connector_metadata.saves
    assert save.keys == [keys[2], keys[4], keys[5]]  # not blocks 0 and 1; 3 is stored
    a.run()
    assert kv.contains(keys) == [False, False, True, True, True, True]
    block = kv.get(keys[2:3])[0]
    for layer in range(len(LAYERS)):
        want = torch.stack([kv_value(3, layer, p) for p in range(2 * BLOCK, 3 * BLOCK)])
        assert torch.equal(block[layer, 0].permute(1, 0, 2), want), layer
    a.close()


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_hybrid_load_failure_fails_the_request_not_the_engine(
        store: tensordb.Database, model_dir: Path, policy: str) -> None:
    """A stored block deleted between the match and the load of a hybrid engine (whose
    scheduler takes no failed blocks, only failed requests): the request's load is
    reported failed and nothing of it is saved; ``recompute``: vLLM computes the whole
    prompt again and its blocks are saved, the lost one too, as the first engine
    computed it; ``fail``: the request ends with an error and the store keeps its hole."""
    a = HybridEngine(_config(model_dir, _extra(store), chunk=128))
    _request(a, "r1", PROMPT, seed=6, max_tokens=2)
    a.run()
    kv = a.worker.caches[0]
    keys = kv.keys(PROMPT)[:4]
    b = HybridEngine(_config(model_dir, _extra(store), policy=policy, chunk=128))
    _request(b, "r2", PROMPT, seed=6, max_tokens=2)
    out = b.scheduler.schedule()
    assert [len(load.keys) for load in out.kv_connector_metadata.loads] == [4]
    kv.delete(keys[1:2])  # as an eviction by another engine would
    b.run_step(out)
    assert b.transfers.failed_recving == {"r2"} and b.last[2] == set()
    assert kv.contains(keys) == [True, False, True, True]
    b.run()
    if policy == "recompute":
        assert {r: str(f) for r, f in b.finished.items()} == {"r2": "length"}
        assert kv.contains(keys) == [True] * 4
        block = kv.get(keys[1:2])[0]
        for layer in range(len(LAYERS)):
            want = torch.stack([kv_value(6, layer, p) for p in range(BLOCK, 2 * BLOCK)])
            assert torch.equal(block[layer, 0].permute(1, 0, 2), want), layer
    else:
        assert {r: str(f) for r, f in b.finished.items()} == {"r2": "error"}
        assert kv.contains(keys) == [True, False, True, True]
    assert not b.scheduler.requests and not b.scheduler.connector.request_ids()
    a.close()
    b.close()


def test_hybrid_namespace_is_apart_from_the_single_group_one(store: tensordb.Database,
                                                           model_dir: Path) -> None:
    """The same model under one KV cache group and under two stores its blocks apart
    (a stored block holds every group's layers: the layouts differ), and a block of a
    group that is not attention (Mamba state) is refused, typed, opening nothing."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, MambaSpec

    from engine_bindings.vllm import TensorDBConnector

    from .test_vllm_kv import _cache_config, _namespaces

    config = _config(model_dir, _extra(store))
    hybrid = TensorDBConnector(config, KVConnectorRole.SCHEDULER, hybrid_cache_config())
    single = TensorDBConnector(config, KVConnectorRole.SCHEDULER, _cache_config())
    assert hybrid.namespace != single.namespace
    before = _namespaces(store)
    mamba = MambaSpec(block_size=BLOCK, shapes=((4, 8),), dtypes=(torch.float32,))
    groups = hybrid_cache_config().kv_cache_groups + [KVCacheGroupSpec(["m.0"], mamba)]
    with pytest.raises(InvalidInput, match="MambaSpec"):
        TensorDBConnector(config, KVConnectorRole.SCHEDULER,
                          KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[],
                                        kv_cache_groups=groups))
    assert _namespaces(store) == before
    worker = TensorDBConnector(config, KVConnectorRole.WORKER, hybrid_cache_config())
    with pytest.raises(InvalidInput, match="no KV cache group"):
        worker.register_kv_caches({"model.layers.9.self_attn.attn":
                                   torch.zeros(NUM_BLOCKS, KV_HEADS, BLOCK, 2 * HEAD)})
    for c in (hybrid, single, worker):
        c.shutdown()


# -- MLA ------------------------------------------------------------------------------------
LATENT = 576  # kv_lora_rank 512 + rope 64: one latent vector per token, all heads


class MLAEngine(LoopEngine):
    """An engine of an MLA model as a GPU runs it (prefix caching on): one KV cache
    group of ``MLAAttentionSpec``, per layer a paged cache ``[blocks, block_size,
    576]``; a token's latent vector is its KV stand-in, flattened."""

    def __init__(self, vllm_config: Any) -> None:
        from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, MLAAttentionSpec

        spec = MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=LATENT,
                                dtype=torch.float32)
        config = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[],
                               kv_cache_groups=[KVCacheGroupSpec(list(TP_LAYERS), spec)])
        super().__init__(vllm_config, kv_cache_config=config)
        self.caches = {n: torch.zeros(NUM_BLOCKS, BLOCK, LATENT) for n in TP_LAYERS}
        self.worker.register_kv_caches(self.caches)

    def write_kv(self, layer: str, block: int, slot: int, value: torch.Tensor) -> None:
        self.caches[layer][block, slot] = latent(value)


def latent(value: torch.Tensor) -> torch.Tensor:
    """A token's latent vector made from its KV stand-in (unique per seed, layer and
    position, as the stand-in is)."""
    flat = value.flatten()
    return torch.cat([flat + 0.25 * k for k in range(LATENT // flat.numel())])


def test_mla_latent_blocks_are_saved_and_loaded_block_for_block(
        store: tensordb.Database, model_dir: Path) -> None:
    """MLA's latent cache (one 576-wide page row per token, no K/V halves): engine A
    prefills in chunks and saves each block once; engine B loads the four blocks into
    its own blocks exactly as A computed them, and its request runs to its end."""
    a = MLAEngine(_config(model_dir, _extra(store), chunk=24))
    _request(a, "r1", PROMPT, seed=4, max_tokens=2)
    a.run()
    kv = a.worker.caches[0]
    keys = kv.keys(PROMPT)[:4]
    assert kv.match(keys) == 4 and kv.get(keys[:1])[0].shape == (3, 1, BLOCK, LATENT)
    b = MLAEngine(_config(model_dir, _extra(store), chunk=128))
    _request(b, "r2", PROMPT, seed=77, max_tokens=2)
    first = b.run_step()
    assert first.scheduled_new_reqs[0].num_computed_tokens == 4 * BLOCK
    for layer, name in enumerate(TP_LAYERS):
        ids = b.ids_of("r2", name)
        got = torch.stack([b.caches[name][ids[p // BLOCK], p % BLOCK] for p in range(4 * BLOCK)])
        want = torch.stack([latent(kv_value(4, layer, p)) for p in range(4 * BLOCK)])
        assert torch.equal(got, want), name
    b.run()
    assert {r: str(f) for r, f in b.finished.items()} == {"r2": "length"}
    a.close()
    b.close()


# -- tensor parallelism ----------------------------------------------------------------------
# one rank of a TP=2 engine: vLLM's parallel state over gloo, the scheduler on rank 0
# (its output goes to every rank pickled, as vLLM's executor sends it), the rank's
# worker connector and its own paged cache; engine A computes, then engine B loads
_TP_RANK = r"""
import json, sys
import torch
import torch.distributed as dist
from vllm.config import set_current_vllm_config
from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
from vllm.distributed.parallel_state import get_world_group
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.forward_context import get_forward_context, set_forward_context
from tests.engines.test_vllm_kv import (BLOCK, HEAD, KV_HEADS, LAYERS, NUM_BLOCKS, Engine,
                                        _cache_config, _config, kv_value)
rank, port, model_dir, extra = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4])
PROMPT = json.loads(sys.argv[5])
def config():
    return _config(model_dir, extra, tp=2)
with set_current_vllm_config(config()):
    init_distributed_environment(world_size=2, rank=rank, local_rank=rank, backend="gloo",
                                 distributed_init_method=f"tcp://127.0.0.1:{port}")
    ensure_model_parallel_initialized(2, 1)
group = get_world_group().cpu_group
def engine_step(seed):
    cfg = config()
    with set_current_vllm_config(cfg):
        worker = KVConnectorFactory.create_connector(cfg, KVConnectorRole.WORKER, _cache_config())
    caches = {n: torch.zeros(NUM_BLOCKS, KV_HEADS, BLOCK, 2 * HEAD) for n in LAYERS}
    worker.register_kv_caches(caches)
    sent = [None]
    if rank == 0:
        engine = Engine.__new__(Engine)
        cfg.cache_config.num_gpu_blocks = NUM_BLOCKS
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.structured_output import StructuredOutputManager
        engine.scheduler = Scheduler(vllm_config=cfg, kv_cache_config=_cache_config(),
                                     structured_output_manager=StructuredOutputManager(cfg),
                                     block_size=BLOCK, log_stats=False)
        Engine.add(engine, "r", PROMPT)
        sent = [engine.scheduler.schedule()]
    dist.broadcast_object_list(sent, src=0, group=group)
    out = sent[0]
    new = out.scheduled_new_reqs[0]
    ids = new.block_ids[0]
    worker.bind_connector_metadata(out.kv_connector_metadata)
    with set_forward_context({n: object() for n in LAYERS}, cfg):
        worker.start_load_kv(get_forward_context())
        for layer, name in enumerate(LAYERS):
            start = new.num_computed_tokens
            for pos in range(start, start + out.num_scheduled_tokens["r"]):
                # the rank's own heads: its KV differs from the other rank's
                caches[name][ids[pos // BLOCK], :, pos % BLOCK] = kv_value(seed + 100 * rank, layer, pos)
            worker.save_kv_layer(name, caches[name], object())
        worker.wait_for_save()
        errors = worker.get_block_ids_with_load_errors()
    worker.clear_connector_metadata()
    dist.barrier(group=group)  # every rank's saves are in before the next engine looks
    loaded = new.num_computed_tokens
    got = [[caches[n][ids[p // BLOCK], :, p % BLOCK].tolist() for p in range(loaded)]
           for n in LAYERS]
    namespace = worker.caches[0].namespace
    worker.shutdown()
    return {"loaded": loaded, "kv": got, "errors": sorted(errors), "namespace": namespace}
a = engine_step(seed=1)
b = engine_step(seed=50)
print("RESULT " + json.dumps({"rank": rank, "a": a, "b": b}))
"""


def test_tensor_parallel_ranks_of_two_engines_share_blocks_rank_by_rank(
        store: tensordb.Database, model_dir: Path) -> None:
    """Two engines of TP=2, each rank a process with vLLM's real parallel state: rank r
    of engine A saves its own KV in its own namespace; engine B's scheduler finds the
    prefix in both ranks' namespaces, and rank r of B loads exactly what rank r of A
    saved (not the other rank's KV, which differs)."""
    port = free_port()
    root = HERE.parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get(
        "PYTHONPATH", "")]), "VLLM_TARGET_DEVICE": "cpu", "PYTHONWARNINGS": "ignore",
        "VLLM_DIST_IDENT": f"tensordb-kv-{port}"}
    procs = [subprocess.Popen([sys.executable, "-c", _TP_RANK, str(rank), str(port),
                               str(model_dir), json.dumps(_extra(store)), json.dumps(PROMPT)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env, cwd=root)
             for rank in range(2)]
    results = {}
    for p in procs:
        out, err = p.communicate(timeout=300)
        lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
        assert p.returncode == 0 and lines, err[-3000:]
        r = json.loads(lines[-1][len("RESULT "):])
        results[r["rank"]] = r
    assert sorted(results) == [0, 1]
    hit = 4 * BLOCK
    for rank, r in results.items():
        a, b = r["a"], r["b"]
        assert a["loaded"] == 0 and b["loaded"] == hit and b["errors"] == []
        assert a["namespace"] == b["namespace"] and a["namespace"].endswith(f"/tp{rank}of2-pp0of1")
        assert len(b["kv"]) == len(TP_LAYERS)
        for layer in range(len(TP_LAYERS)):
            want = [kv_value(1 + 100 * rank, layer, p).tolist() for p in range(hit)]
            assert b["kv"][layer] == want, (rank, layer)
    assert results[0]["b"]["kv"] != results[1]["b"]["kv"]
    ranks = [store.kv(results[rank]["a"]["namespace"], BLOCK) for rank in (0, 1)]
    keys = ranks[0].keys(PROMPT)[:4]
    assert [kv.match(keys) for kv in ranks] == [4, 4]
    for kv in ranks:
        kv.close()
