"""The connector through whole request lifetimes of vLLM's real scheduler: schedule ->
the worker's connector calls around a forward -> ``update_from_output`` with the model
runner's output, step after step, until the requests finish. Chunked prefill (a prompt
over several steps), decode, finish, and load failures under both policies.

The loop is the one vLLM's own connector tests drive (their ``create_vllm_config``,
``create_scheduler``, ``create_request``, ``create_model_runner_output``); the forward
is a stand-in that writes each token's KV where attention would (a forward pass of a
real model is in test_vllm_e2e.py, where vLLM's CPU build is installed).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import tensordb

from .engine_support import write_config
from .test_vllm_kv import (
    BLOCK,
    LAYERS,
    NUM_BLOCKS,
    Engine,
    _config,
    _extra,
    expected_layer,
    kv_value,
)

pytestmark = pytest.mark.engine("vllm")

CHUNK = 24  # tokens per step: a prompt of 55 tokens takes three
PROMPT = list(range(2000, 2000 + 3 * BLOCK + 7))
EOS = 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_config(tmp_path_factory.mktemp("tiny-llama"))


class LoopEngine(Engine):
    """``Engine`` whose stand-in attention also writes the tokens of requests in their
    second and later steps (chunked prefill, decode), and whose steps end as the model
    runner's do: ``update_from_output`` with the sampled tokens and the connector's
    output."""

    def __init__(self, vllm_config: Any, scheduler: str = "Scheduler",
                 kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, scheduler=scheduler, kv_cache_config=kv_cache_config)
        self.seeds: dict[str, int] = {}
        self.finished: dict[str, Any] = {}

    def _attention(self, out: Any, layer: int, name: str, seeds: dict[str, int]) -> None:
        starts = {n.req_id: n.num_computed_tokens for n in out.scheduled_new_reqs}
        cached = out.scheduled_cached_reqs
        starts.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        for req_id, start in starts.items():
            seed = self.seeds.get(req_id)
            if seed is None:
                continue
            ids = self.ids_of(req_id, name)
            for pos in range(start, start + out.num_scheduled_tokens[req_id]):
                assert ids[pos // BLOCK] != 0, "a token computed into vLLM's null block"
                self.write_kv(name, ids[pos // BLOCK], pos % BLOCK, kv_value(seed, layer, pos))

    def write_kv(self, layer: str, block: int, slot: int, value: torch.Tensor) -> None:
        """Write one token's KV (``[heads, 2 * head_size]``) into its slot."""
        self.caches[layer][block, :, slot] = value

    def ids_of(self, req_id: str, layer: str) -> list[int]:
        """The request's vLLM blocks of ``layer``'s KV cache group."""
        return self.blocks_of(req_id)

    def run_step(self, out: Any = None, token: int = 7) -> Any:
        """One step (``out``: one already scheduled): the worker's calls, then the
        scheduler hears the model runner's output (a token for each request whose
        prompt is done; none for a prefill chunk that ends inside the prompt)."""
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        out = self.step(out=out)
        _, _, errors = self.last
        req_ids = list(out.num_scheduled_tokens)
        sampled = []
        for req_id in req_ids:
            req = self.scheduler.requests[req_id]
            done = req.num_computed_tokens >= req.num_prompt_tokens
            sampled.append([token] if done else [])
        runner = ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled, logprobs=None, prompt_logprobs_dict={},
            pooler_output=None,
            kv_connector_output=KVConnectorOutput(
                invalid_block_ids=errors, finished_recving=self.transfers.finished_recving,
                failed_recving=self.transfers.failed_recving))
        outputs = self.scheduler.update_from_output(out, runner)
        for eco in outputs.values():
            for o in eco.outputs:
                if o.finish_reason is not None:
                    self.finished[o.request_id] = o.finish_reason
        return out

    def run(self, limit: int = 20) -> list[Any]:
        steps = []
        while self.scheduler.has_requests() and len(steps) < limit:
            steps.append(self.run_step())
        assert not self.scheduler.has_requests(), "requests left after the step limit"
        return steps


def _request(engine: LoopEngine, req_id: str, prompt: list[int], seed: int,
             max_tokens: int = 3) -> Any:
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    req = Request(req_id, list(prompt), params, None,
                  block_hasher=get_request_block_hasher(BLOCK, sha256))
    engine.scheduler.add_request(req)
    engine.seeds[req_id] = seed
    return req


def _assert_empty(engine: LoopEngine) -> None:
    """Nothing leaked: vLLM's scheduler and our connector forgot every request."""
    s = engine.scheduler
    assert not s.requests and not s.running and not s.waiting
    pool = s.kv_cache_manager.block_pool
    assert pool.free_block_queue.num_free_blocks == NUM_BLOCKS - 1
    assert not s.connector.request_ids()


def _keys(engine: LoopEngine, prompt: list[int]) -> list[bytes]:
    return engine.worker.caches[0].keys(prompt)


@pytest.mark.parametrize("scheduler", ["Scheduler", "AsyncScheduler"])
def test_chunked_prefill_decode_and_finish(store: tensordb.Database, model_dir: Path,
                                           scheduler: str) -> None:
    """A 55-token prompt in chunks of 24: each step saves the blocks its chunk
    completed (1, then 2, then none: the tail is not a block); decode steps save
    nothing; the request finishes after its tokens and nothing is left behind. A
    second engine then loads all three blocks, as the first engine computed them.
    Under vLLM's scheduler and its async one (which schedules a step ahead of the
    previous step's output)."""
    a = LoopEngine(_config(model_dir, _extra(store), chunk=CHUNK), scheduler)
    _request(a, "r1", PROMPT, seed=3)
    steps = [step for step in a.run() if step.num_scheduled_tokens]
    saves = [[len(s.keys) for s in step.kv_connector_metadata.saves] for step in steps]
    scheduled = [step.num_scheduled_tokens.get("r1", 0) for step in steps]
    assert scheduled == [24, 24, 7, 1, 1]  # three prefill chunks, then two decodes
    assert saves == [[1], [2], [], [], []]
    assert a.finished == {"r1": a.finished["r1"]} and str(a.finished["r1"]) == "length"
    _assert_empty(a)
    assert a.worker.caches[0].match(_keys(a, PROMPT)) == 3

    b = LoopEngine(_config(model_dir, _extra(store), chunk=CHUNK), scheduler)
    _request(b, "r2", PROMPT, seed=99)  # its own forward would write other values
    first = b.run_step()
    (load,) = first.kv_connector_metadata.loads
    assert len(load.keys) == 3 and first.scheduled_new_reqs[0].num_computed_tokens == 3 * BLOCK
    assert first.num_scheduled_tokens["r2"] == len(PROMPT) - 3 * BLOCK
    cache = b.caches[LAYERS[1]]
    ids = b.blocks_of("r2")
    got = torch.stack([cache[ids[p // BLOCK], :, p % BLOCK] for p in range(3 * BLOCK)])
    assert torch.equal(got, expected_layer(3, 1, 3 * BLOCK))
    b.run()
    _assert_empty(b)
    a.close()
    b.close()


def test_two_requests_share_steps_and_blocks(store: tensordb.Database,
                                            model_dir: Path) -> None:
    """Two requests with one prefix in the same engine, chunked: vLLM's own prefix
    cache serves the second, and each stored block is saved once."""
    a = LoopEngine(_config(model_dir, _extra(store), chunk=64))
    _request(a, "r1", PROMPT, seed=1)
    _request(a, "r2", PROMPT[:2 * BLOCK] + list(range(9000, 9000 + 2 * BLOCK)), seed=1)
    steps = a.run()
    keys = [k for step in steps for s in step.kv_connector_metadata.saves for k in s.keys]
    assert len(keys) == len(set(keys))  # never the same block twice
    assert a.worker.caches[0].match(_keys(a, PROMPT)) == 3
    _assert_empty(a)
    a.close()


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_load_failure_through_the_scheduler(store: tensordb.Database, model_dir: Path,
                                            policy: str) -> None:
    """A stored block deleted between the match and the load. The failed step saves
    nothing of the request. ``recompute``: vLLM recomputes from the first failed block
    and the request's blocks are saved then (the lost one too); ``fail``: the request
    ends with an error and no block of it is stored."""
    a = LoopEngine(_config(model_dir, _extra(store), chunk=128))
    _request(a, "r1", PROMPT[:2 * BLOCK + 3], seed=5)
    a.run()
    prompt = PROMPT[:2 * BLOCK] + list(range(7000, 7000 + 2 * BLOCK + 5))
    keys = _keys(a, prompt)
    kv = a.worker.caches[0]
    assert kv.contains(keys) == [True, True, False, False]

    b = LoopEngine(_config(model_dir, _extra(store), policy=policy, chunk=128))
    _request(b, "r2", prompt, seed=5)
    out = b.scheduler.schedule()  # matched the two stored blocks
    assert out.scheduled_new_reqs[0].num_computed_tokens == 2 * BLOCK
    assert [len(s.keys) for s in out.kv_connector_metadata.saves] == [2]
    loaded = set(b.blocks_of("r2")[:2])
    kv.delete(keys[1:2])  # as an eviction by another engine would
    b.run_step(out)
    assert b.last[2] == loaded  # the load failed
    assert kv.contains(keys) == [True, False, False, False]  # and saved nothing
    b.run()
    if policy == "recompute":
        assert str(b.finished["r2"]) == "length"
        assert kv.contains(keys) == [True, True, True, True]
        got = kv.get(keys)
        for i, block in enumerate(got):
            for layer in range(len(LAYERS)):
                want = torch.stack([kv_value(5, layer, p)
                                    for p in range(i * BLOCK, (i + 1) * BLOCK)])
                assert torch.equal(block[layer, 0].permute(1, 0, 2), want), (i, layer)
    else:
        assert str(b.finished["r2"]) == "error"
        assert kv.contains(keys) == [True, False, False, False]
    _assert_empty(b)
    a.close()
    b.close()
