"""vLLM 0.33: the ``TensorDBConnector`` KV connector, loaded by vLLM's own connector
factory from ``kv_connector_module_path`` and driven by vLLM's real ``Scheduler`` (which
calls get_num_new_matched_tokens -> update_state_after_alloc -> build_connector_meta)
with real ``Request`` objects. The worker side gets the call sequence of vLLM's model
runner (bind_connector_metadata -> start_load_kv -> per layer wait_for_layer_load and
save_kv_layer -> wait_for_save -> get_finished) on paged KV caches of the shapes vLLM's
CPU and FlashAttention backends allocate; a stand-in writes each layer's KV where the
attention kernel would (a worker needs a GPU, or vLLM's CPU kernels, to run one)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import tensordb
from tensordb.errors import InvalidInput

from .engine_support import write_config

pytestmark = pytest.mark.engine("vllm")

BLOCK = 16  # vLLM's block size in these tests
KV_HEADS, HEAD = 2, 16
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(3)]
NUM_BLOCKS = 64
CAPACITY = 32 << 20


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_config(tmp_path_factory.mktemp("tiny-llama"))


def _extra(db: tensordb.Database, **more: Any) -> dict[str, Any]:
    from engine_bindings._engines import StoreLocation

    return {**StoreLocation.of(db).as_dict(), "capacity_bytes": CAPACITY, **more}


def _config(model_dir: Path, extra: dict[str, Any], role: str = "kv_both", *,
            policy: str = "fail", chunk: int = 512, tp: int = 1) -> Any:
    """vLLM's config of an engine with the connector; ``chunk``: tokens per step (a
    prompt longer than that is prefilled in chunks), ``policy``: what vLLM does with a
    block that failed to load, ``tp``: its tensor-parallel size."""
    from vllm.config import (
        CacheConfig,
        KVTransferConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
        VllmConfig,
    )

    return VllmConfig(
        model_config=ModelConfig(model=str(model_dir), skip_tokenizer_init=True,
                                 dtype="float32", enforce_eager=True, max_model_len=128),
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
        scheduler_config=SchedulerConfig(max_num_batched_tokens=chunk, max_num_seqs=8,
                                         max_model_len=128, enable_chunked_prefill=True,
                                         is_encoder_decoder=False),
        parallel_config=ParallelConfig(tensor_parallel_size=tp),
        kv_transfer_config=KVTransferConfig(
            kv_connector="TensorDBConnector", kv_connector_module_path="engine_bindings.vllm",
            kv_role=role, kv_connector_extra_config=extra, kv_load_failure_policy=policy))


def _cache_config() -> Any:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD,
                             dtype=torch.float32)
    return KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), spec)])


class Engine:
    """One vLLM engine's scheduler (vLLM's own) and one worker's connector and paged
    KV caches (per layer ``[blocks, heads, block_size, 2 * head_size]``, the CPU and
    FlashAttention backends' standardized view; ``layout="NHD"`` stores it token-major
    underneath, as FlashAttention's NHD layout does)."""

    def __init__(self, vllm_config: Any, layout: str = "HND",
                 scheduler: str = "Scheduler", kv_cache_config: Any = None) -> None:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.structured_output import StructuredOutputManager

        self.config = vllm_config
        vllm_config.cache_config.num_gpu_blocks = NUM_BLOCKS  # what profiling would set
        kv_cache_config = kv_cache_config or _cache_config()
        #: the model's attention layers, every KV cache group's, in the natural order
        self.layers = sorted(n for g in kv_cache_config.kv_cache_groups for n in g.layer_names)
        cls = {"Scheduler": Scheduler, "AsyncScheduler": AsyncScheduler}[scheduler]
        self.scheduler = cls(vllm_config=vllm_config, kv_cache_config=kv_cache_config,
                             structured_output_manager=StructuredOutputManager(vllm_config),
                             block_size=BLOCK, log_stats=False)
        self.worker = KVConnectorFactory.create_connector(vllm_config, KVConnectorRole.WORKER,
                                                          kv_cache_config)
        if layout == "NHD":
            self.caches = {n: torch.zeros(NUM_BLOCKS, BLOCK, KV_HEADS, 2 * HEAD)
                           .permute(0, 2, 1, 3) for n in self.layers}
        else:
            self.caches = {n: torch.zeros(NUM_BLOCKS, KV_HEADS, BLOCK, 2 * HEAD)
                           for n in self.layers}
        self.worker.register_kv_caches(self.caches)

    def add(self, req_id: str, tokens: list[int]) -> Any:
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.request import Request

        init_none_hash(sha256)
        req = Request(req_id, list(tokens), SamplingParams(max_tokens=4), None,
                      block_hasher=get_request_block_hasher(BLOCK, sha256))
        self.scheduler.add_request(req)
        return req

    def step(self, compute: dict[str, int] | None = None, out: Any = None) -> Any:
        """One engine step: the scheduler's output (``out``, else a new schedule), then
        the worker's connector calls in the model runner's order around a forward that
        writes, for each scheduled request, KV values derived from its tokens
        (``compute`` gives a seed)."""
        from vllm.forward_context import set_forward_context

        out = self.scheduler.schedule() if out is None else out
        w = self.worker
        w.bind_connector_metadata(out.kv_connector_metadata)
        with set_forward_context({n: object() for n in self.layers}, self.config):
            from vllm.forward_context import get_forward_context

            w.start_load_kv(get_forward_context())
            for layer, name in enumerate(self.layers):
                w.wait_for_layer_load(name)
                self._attention(out, layer, name, compute or {})
                w.save_kv_layer(name, self.caches[name], object())
            w.wait_for_save()
            finished = w.get_finished(out.finished_req_ids)
            self.transfers = w.get_transfer_results(out.finished_req_ids)
            errors = w.get_block_ids_with_load_errors()
        w.clear_connector_metadata()
        self.last = (out, finished, errors)
        return out

    def _attention(self, out: Any, layer: int, name: str, seeds: dict[str, int]) -> None:
        """Write the KV of each scheduled token into its slot, as attention does."""
        for new in out.scheduled_new_reqs:
            seed = seeds.get(new.req_id)
            if seed is None:
                continue
            start, n = new.num_computed_tokens, out.num_scheduled_tokens[new.req_id]
            for pos in range(start, start + n):
                blk = new.block_ids[0][pos // BLOCK]
                self.caches[name][blk, :, pos % BLOCK] = kv_value(seed, layer, pos)

    def blocks_of(self, req_id: str) -> list[int]:
        return list(self.scheduler.kv_cache_manager.get_block_ids(req_id)[0])

    def close(self) -> None:
        self.scheduler.shutdown()
        self.worker.shutdown()


def kv_value(seed: int, layer: int, pos: int) -> torch.Tensor:
    """The K|V of one token of one layer: [heads, 2 * head_size], unique per input."""
    base = float(seed * 1_000_000 + layer * 10_000 + pos * 10)
    return base + torch.arange(KV_HEADS * 2 * HEAD, dtype=torch.float32).view(KV_HEADS, -1)


def expected_layer(seed: int, layer: int, tokens: int) -> torch.Tensor:
    return torch.stack([kv_value(seed, layer, p) for p in range(tokens)])


def paged(engine: Engine, req_id: str, layer: int, tokens: int) -> torch.Tensor:
    cache = engine.caches[LAYERS[layer]]
    ids = engine.blocks_of(req_id)
    return torch.stack([cache[ids[p // BLOCK], :, p % BLOCK] for p in range(tokens)])


@pytest.fixture
def engines(store: tensordb.Database, model_dir: Path) -> Iterator[list[Engine]]:
    made: list[Engine] = []
    yield made
    for e in made:
        e.close()


PROMPT = list(range(1000, 1000 + 3 * BLOCK + 7))  # 3 full blocks and a tail


def test_connector_loads_through_vllm_factory_and_module_path(store: tensordb.Database,
                                                              model_dir: Path) -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    import engine_bindings.vllm as binding
    from engine_bindings.vllm import TensorDBConnector

    config = _config(model_dir, _extra(store))
    cls = KVConnectorFactory.get_connector_class(config.kv_transfer_config)
    assert cls is TensorDBConnector and issubclass(cls, KVConnectorBase_V1)
    from vllm.distributed.kv_transfer.kv_connector.v1.base import supports_hma

    # the connector supports vLLM's hybrid KV cache manager, which vLLM then leaves on
    assert supports_hma(cls) and not config.scheduler_config.disable_hybrid_kv_cache_manager
    assert binding.kv_transfer_config(location=store)["kv_connector"] == "TensorDBConnector"
    assert {"TensorDBConnector", "TensorDBConnectorMetadata", "KVLoad", "KVSave",
            "kv_transfer_config", "CONNECTOR_NAME"} <= set(binding.__all__)
    assert all(hasattr(binding, n) for n in binding.__all__)


def test_prefix_saved_by_one_engine_is_loaded_by_another(engines: list[Engine],
                                                         store: tensordb.Database,
                                                         model_dir: Path) -> None:
    a = Engine(_config(model_dir, _extra(store)))
    engines.append(a)
    a.add("r1", PROMPT)
    out = a.step({"r1": 7})
    meta = out.kv_connector_metadata
    assert meta.loads == [] and len(meta.saves) == 1 and len(meta.saves[0].keys) == 3
    assert meta.saves[0].block_ids == (a.blocks_of("r1")[:3],)
    assert a.last[1] == (None, None) and a.last[2] == set()
    ns = a.worker.caches[0]
    assert ns.match(meta.saves[0].keys) == 3
    assert ns.get(meta.saves[0].keys[:1])[0].shape == (3, 1, KV_HEADS, BLOCK, 2 * HEAD)

    # a second engine (its own scheduler, worker and paged cache, NHD underneath)
    b = Engine(_config(model_dir, _extra(store)), layout="NHD")
    engines.append(b)
    b.add("r2", PROMPT + [5, 6, 7])
    out = b.step()
    new = out.scheduled_new_reqs[0]
    assert new.num_computed_tokens == 3 * BLOCK  # the store's hit, as vLLM counts it
    assert out.num_scheduled_tokens["r2"] == len(PROMPT) + 3 - 3 * BLOCK
    assert out.has_sync_kv_loads and len(out.kv_connector_metadata.loads) == 1
    assert out.kv_connector_metadata.saves == []  # its full blocks are in the store
    assert b.last[2] == set()
    for layer in range(len(LAYERS)):
        assert torch.equal(paged(b, "r2", layer, 3 * BLOCK),
                           expected_layer(7, layer, 3 * BLOCK)), layer


def test_longer_prompt_saves_only_the_new_blocks_and_misses_diverge(
        engines: list[Engine], store: tensordb.Database, model_dir: Path) -> None:
    a = Engine(_config(model_dir, _extra(store)))
    engines.append(a)
    a.add("r1", PROMPT)
    first = a.step({"r1": 1}).kv_connector_metadata.saves[0].keys
    b = Engine(_config(model_dir, _extra(store)))
    engines.append(b)
    b.add("r2", PROMPT[:3 * BLOCK] + list(range(5000, 5000 + 2 * BLOCK)))
    b.add("r3", [9] + PROMPT[1:])  # differs in the first token: no hit at all
    out = b.step({"r2": 2, "r3": 3})
    num_computed = {n.req_id: n.num_computed_tokens for n in out.scheduled_new_reqs}
    assert num_computed == {"r2": 3 * BLOCK, "r3": 0}
    saves = {s.req_id: s for s in out.kv_connector_metadata.saves}
    assert len(saves["r2"].keys) == 2  # blocks 4 and 5 only: blocks 1-3 are stored
    assert len(saves["r3"].keys) == 3 and not set(saves["r3"].keys) & set(first)
    assert saves["r2"].block_ids == (b.blocks_of("r2")[3:5],)


def test_partial_local_hit_loads_the_rest_of_a_stored_block(
        engines: list[Engine], store: tensordb.Database, model_dir: Path) -> None:
    """block_tokens = 2 vLLM blocks: vLLM's local prefix cache holds the first vLLM
    block, the store the first two stored blocks; only vLLM blocks 1-3 are loaded."""
    a = Engine(_config(model_dir, _extra(store, block_tokens=2 * BLOCK)))
    engines.append(a)
    prompt = list(range(100, 100 + 4 * BLOCK + 3))
    a.add("r1", prompt)
    meta = a.step({"r1": 4}).kv_connector_metadata
    assert len(meta.saves[0].keys) == 2 and len(meta.saves[0].block_ids[0]) == 4
    b = Engine(_config(model_dir, _extra(store, block_tokens=2 * BLOCK)))
    engines.append(b)
    b.add("warm", prompt[:BLOCK] + [1, 2, 3])  # fills vLLM's local cache with block 0
    b.step({"warm": 4})
    b.add("r2", prompt)
    out = b.step()
    (load,) = out.kv_connector_metadata.loads
    assert load.req_id == "r2" and load.skip == 1 and len(load.keys) == 2
    assert load.block_ids == (b.blocks_of("r2")[1:4],)
    for layer in range(len(LAYERS)):
        assert torch.equal(paged(b, "r2", layer, 4 * BLOCK), expected_layer(4, layer, 4 * BLOCK))


def test_evicted_block_is_reported_as_a_load_error(engines: list[Engine],
                                                   store: tensordb.Database,
                                                   model_dir: Path) -> None:
    a = Engine(_config(model_dir, _extra(store)))
    engines.append(a)
    a.add("r1", PROMPT)
    keys = a.step({"r1": 5}).kv_connector_metadata.saves[0].keys
    b = Engine(_config(model_dir, _extra(store)))
    engines.append(b)
    b.add("r2", PROMPT)
    b_out = b.scheduler.schedule()  # matched: 3 blocks
    assert b_out.scheduled_new_reqs[0].num_computed_tokens == 3 * BLOCK
    a.worker.caches[0].delete(keys[1:2])  # gone between the match and the load
    w = b.worker
    w.bind_connector_metadata(b_out.kv_connector_metadata)
    w.start_load_kv(None)
    assert w.get_block_ids_with_load_errors() == set(b.blocks_of("r2")[:3])
    assert w.get_block_ids_with_load_errors() == set()
    w.clear_connector_metadata()


def test_consumer_does_not_save_and_producer_does_not_load(
        engines: list[Engine], store: tensordb.Database, model_dir: Path) -> None:
    c = Engine(_config(model_dir, _extra(store), role="kv_consumer"))
    engines.append(c)
    c.add("r1", PROMPT)
    assert c.step({"r1": 6}).kv_connector_metadata.saves == []
    p = Engine(_config(model_dir, _extra(store), role="kv_producer"))
    engines.append(p)
    p.add("r1", PROMPT)
    assert len(p.step({"r1": 6}).kv_connector_metadata.saves) == 1
    p.add("r2", PROMPT)
    out = p.step()
    assert out.kv_connector_metadata.loads == []


def test_cache_salt_separates_prefixes(engines: list[Engine], store: tensordb.Database,
                                       model_dir: Path) -> None:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    a = Engine(_config(model_dir, _extra(store)))
    engines.append(a)
    a.add("r1", PROMPT)
    a.step({"r1": 8})
    sched = a.scheduler.connector
    salted = Request("s", list(PROMPT), SamplingParams(max_tokens=1), None, cache_salt="x")
    plain = Request("p", list(PROMPT), SamplingParams(max_tokens=1), None)
    assert sched.get_num_new_matched_tokens(plain, 0) == (3 * BLOCK, False)
    assert sched.get_num_new_matched_tokens(plain, BLOCK) == (2 * BLOCK, False)
    assert sched.get_num_new_matched_tokens(salted, 0) == (0, False)
    short = Request("q", PROMPT[:3 * BLOCK], SamplingParams(max_tokens=1), None)
    # never the whole prompt: vLLM must compute at least its last token
    assert sched.get_num_new_matched_tokens(short, 0) == (2 * BLOCK, False)


@pytest.mark.parametrize("extra, needle", [
    ({"block_tokens": 24}, "multiple"),
    ({"block_tokens": 0}, "block_tokens"),
    ({"namespace": ""}, "namespace"),
    ({"capacity_bytes": "1G"}, "capacity_bytes"),
    ({"gpu_capacity": 0}, "gpu_capacity"),
    ({"gpu_capacity": 1 << 20}, "needs a CUDA device"),  # this CPU host has none
    ({"bucket": 1}, "'bucket'"),
    ({"home": 5}, "'home'"),
], ids=["block-tokens-not-multiple", "block-tokens-zero", "namespace-empty",
        "capacity-str", "gpu-capacity-zero", "gpu-tier-without-gpu", "unknown-key",
        "home-int"])
def test_bad_extra_config_is_a_typed_error(store: tensordb.Database, model_dir: Path,
                                           extra: dict[str, Any], needle: str) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from engine_bindings.vllm import TensorDBConnector
    from storage_engine import GpuTier

    if needle == "needs a CUDA device" and GpuTier.available():
        pytest.skip("a CUDA device is present: the GPU tier opens")
    before = _namespaces(store)
    with pytest.raises(InvalidInput, match=needle):
        TensorDBConnector(_config(model_dir, {**_extra(store), **extra}),
                          KVConnectorRole.SCHEDULER, _cache_config())
    assert _namespaces(store) == before  # no namespace was opened


def _namespaces(db: tensordb.Database) -> list[str]:
    from sqlalchemy import select

    from tensordb.catalog.schema import kv_namespaces

    with db.catalog.engine.connect() as conn:
        return sorted(conn.execute(select(kv_namespaces.c.name)).scalars())


def test_bad_paged_caches_are_typed_errors(store: tensordb.Database, model_dir: Path) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from engine_bindings.vllm import TensorDBConnector

    w = TensorDBConnector(_config(model_dir, _extra(store)), KVConnectorRole.WORKER,
                          _cache_config())
    good = torch.zeros(NUM_BLOCKS, KV_HEADS, BLOCK, 2 * HEAD)
    for caches in ({}, {LAYERS[0]: good, LAYERS[1]: torch.zeros(NUM_BLOCKS, 1, BLOCK, HEAD)},
                   {LAYERS[0]: torch.zeros(NUM_BLOCKS + 1, KV_HEADS, BLOCK, 2 * HEAD)},
                   {LAYERS[0]: good, LAYERS[1]: good.double()}):
        with pytest.raises(InvalidInput):
            w.register_kv_caches(caches)
    w.register_kv_caches({n: good for n in LAYERS})
    assert w.block_shape == (3, 1, KV_HEADS, BLOCK, 2 * HEAD)
    w.shutdown()


def test_a_lookup_costs_the_same_in_any_namespace(engines: list[Engine],
                                                  store: tensordb.Database,
                                                  model_dir: Path) -> None:
    """The cost contract of the scheduler's lookup (tests/test_costs.py counts the
    store's side): get_num_new_matched_tokens in a namespace of 20 blocks and of 2,000
    asks each rank's namespace once (one ``match``), runs no SQL statement and no read
    or write system call, and builds, copies and hashes nothing."""
    from sqlalchemy import event
    from sqlalchemy.pool import Pool
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    import storage_engine as se

    a = Engine(_config(model_dir, _extra(store)))
    engines.append(a)
    a.add("r1", PROMPT)
    a.step({"r1": 4})
    sched = a.scheduler.connector
    ns = a.worker.caches[0]
    shape = ns.get(ns.keys(PROMPT[:BLOCK]))[0].shape

    def fill(n: int, seed: int) -> None:
        keys = ns.keys(list(range(seed, seed + n * BLOCK)))
        ns.put(keys, [torch.full(shape, float(i)) for i in range(n)])

    def syscalls() -> int:
        with open("/proc/self/io") as f:
            got = dict(line.split(": ") for line in f.read().splitlines())
        return int(got["syscr"]) + int(got["syscw"])

    statements: list[object] = []
    matches: list[int] = []
    match = type(ns).match

    def checkout(dbapi_conn: object, *_: object) -> None:
        statements.append(dbapi_conn)  # any catalog connection taken at all

    def counted(self: object, keys: object) -> int:
        matches.append(1)
        return match(self, keys)  # type: ignore[arg-type]

    costs = []
    for i, more in enumerate((20, 1980)):  # 20 blocks beside the prompt's, then 2,000
        fill(more, 100_000 * (i + 1))
        req = Request(f"q{i}", list(PROMPT), SamplingParams(max_tokens=1), None)
        statements.clear()
        matches.clear()
        event.listen(Pool, "checkout", checkout)
        type(ns).match = counted  # type: ignore[method-assign]
        try:
            e0 = syscalls()
            e1 = syscalls()
            with se.counting() as work:
                got = sched.get_num_new_matched_tokens(req, 0)
            s1 = syscalls()
        finally:
            type(ns).match = match  # type: ignore[method-assign]
            event.remove(Pool, "checkout", checkout)
        assert got == (3 * BLOCK, False)
        costs.append((len(statements), len(matches), s1 - e1 - (e1 - e0), dict(work)))
    small, big = costs
    assert small == big == (0, 1, 0, {})
