"""SGLang 0.5.23: weights from a collection, against SGLang's real ServerArgs, load-config
builder, model loader dispatch, Llama model (built on the CPU), WeightUpdater, request
classes, ``Engine`` methods and safe unpickler. The stand-in is the hop between the
engine and its scheduler process (``_Scheduler`` below does in-process what the
scheduler does with a request: deserialize its rank's payload and hand it to the
runner's WeightUpdater): a scheduler needs a GPU to start."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import tensordb
from tensordb.errors import InvalidInput, NotFound

from .engine_support import (
    checkpoint,
    expected_params,
    mismatches,
    sglang_rank,
    write_config,
)

pytestmark = pytest.mark.engine("sglang")


def _undo_reduction_patch() -> None:
    """SGLang's WeightUpdater patches torch's tensor pickling in its (scheduler) process;
    here engine and scheduler share one process, so undo it after each scheduler step."""
    from torch.multiprocessing import reductions

    original = getattr(reductions, "_reduce_tensor_original", None)
    if original is not None:
        reductions.reduce_tensor = original
        reductions.rebuild_cuda_tensor = reductions._rebuild_cuda_tensor_original
        del reductions._reduce_tensor_original, reductions._rebuild_cuda_tensor_original
        reductions.init_reductions()


@pytest.fixture(scope="module")
def mstore(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tensordb.Database]:
    """One store for the module: SGLang's process-wide config names it once."""
    import shutil

    from engine_bindings._engines import close_stores

    db = tensordb.connect(home=tmp_path_factory.mktemp("sglang") / "store")
    try:
        yield db
    finally:
        close_stores()
        db.close()
        shutil.rmtree(db.config.shm_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def sglang_cpu(mstore: tensordb.Database, tmp_path_factory: pytest.TempPathFactory
               ) -> Iterator[Any]:
    """SGLang's process config and distributed state for one CPU rank, as a scheduler
    publishes them: the server loads the "llama" collection with TensorDBModelLoader and
    accepts pull updates. Yields the ServerArgs."""
    from sglang.srt.server_args import ServerArgs

    from engine_bindings._engines import StoreLocation
    from engine_bindings.sglang import PULL_LOADER, TensorDBModelLoader

    extra = {"collection": "llama", **StoreLocation.of(mstore).as_dict()}
    server_args = ServerArgs(
        model_path=str(write_config(tmp_path_factory.mktemp("tiny-llama"))), device="cpu",
        dtype="float32", skip_tokenizer_init=True, load_format=TensorDBModelLoader,
        model_loader_extra_config=json.dumps(extra), custom_weight_loader=[PULL_LOADER])
    try:
        with sglang_rank(server_args):
            yield server_args
    finally:
        _undo_reduction_patch()


def _model_config(server_args: Any) -> Any:
    from sglang.srt.configs.model_config import ModelConfig

    return ModelConfig.from_server_args(server_args)


def _load(server_args: Any, load_config: Any) -> torch.nn.Module:
    from sglang.srt.configs.device_config import DeviceConfig
    from sglang.srt.model_loader import get_model

    return get_model(model_config=_model_config(server_args), load_config=load_config,
                     device_config=DeviceConfig("cpu"))


def _extra(db: tensordb.Database, collection: str, **ref: Any) -> str:
    from engine_bindings._engines import StoreLocation

    return json.dumps({"collection": collection, **ref, **StoreLocation.of(db).as_dict()})


def _updater(server_args: Any, model: torch.nn.Module) -> Any:
    """SGLang's own WeightUpdater, as ModelRunner.init_weight_updater builds it."""
    from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater

    return WeightUpdater(tp_rank=0, device="cpu", gpu_id=0,
                         model_config=_model_config(server_args),
                         custom_weight_loaders=server_args.custom_weight_loader,
                         get_model=lambda: model, update_model_fields=lambda *a, **k: None,
                         recapture_cuda_graph=lambda: None, get_model_runner=lambda: None)


@pytest.fixture
def llama(sglang_cpu: Any, mstore: tensordb.Database) -> tuple[torch.nn.Module, Any]:
    """A fresh "llama" collection (v1) and a real SGLang Llama loaded from it through the
    server's own load config (load_format=TensorDBModelLoader). Returns the model and
    its WeightUpdater."""
    from sglang.srt.model_executor.model_runner_components.load_model_utils import (
        build_load_config,
    )

    from engine_bindings.sglang import TensorDBModelLoader

    if "llama" in mstore.collections():
        mstore.drop("llama")
    mstore.commit("llama", checkpoint(1))
    load_config = build_load_config(
        server_args=sglang_cpu, tp_rank=0, remote_instance_weight_transporter_engine=None,
        remote_instance_weight_transporter_session_id="", draft_model_idx=None,
        weight_cache_mode="off", weight_cache_socket=None)
    assert load_config.load_format is TensorDBModelLoader
    model = _load(sglang_cpu, load_config)
    return model, _updater(sglang_cpu, model)


# -- the initial load --------------------------------------------------------------------
def test_server_args_load_a_real_llama_from_the_store(llama: tuple[torch.nn.Module, Any]
                                                      ) -> None:
    model, _ = llama
    assert type(model).__name__ == "LlamaForCausalLM"
    assert mismatches(model, expected_params(checkpoint(1))) == []


def test_loader_class_reads_a_version_or_tag(sglang_cpu: Any,
                                             mstore: tensordb.Database) -> None:
    from sglang.srt.configs.load_config import LoadConfig

    from engine_bindings.sglang import TensorDBModelLoader

    mstore.commit("tagged", checkpoint(1))
    mstore.commit("tagged", checkpoint(2))
    mstore.tag("tagged", "first", version=1)
    for ref, seed in [({"version": 2}, 2), ({"tag": "first"}, 1)]:
        model = _load(sglang_cpu, LoadConfig(load_format=TensorDBModelLoader,
                                             model_loader_extra_config=_extra(mstore, "tagged",
                                                                              **ref)))
        assert mismatches(model, expected_params(checkpoint(seed))) == [], ref


@pytest.mark.parametrize("extra, error, needle", [
    ({}, InvalidInput, "'collection'"),
    ({"collection": "llama", "pattern": "x"}, InvalidInput, "'pattern'"),
    ({"collection": "nothing-here"}, NotFound, "nothing-here"),
], ids=["no-collection", "unknown-key", "missing-collection"])
def test_loader_config_errors(sglang_cpu: Any, mstore: tensordb.Database,
                              extra: dict[str, Any], error: type[Exception], needle: str
                              ) -> None:
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.model_loader import get_model_loader

    from engine_bindings._engines import StoreLocation
    from engine_bindings.sglang import TensorDBModelLoader

    config = json.dumps({**extra, **StoreLocation.of(mstore).as_dict()})
    with pytest.raises(error, match=needle):
        loader = get_model_loader(LoadConfig(load_format=TensorDBModelLoader,
                                             model_loader_extra_config=config))
        loader.download_model(None)


# -- updates in the scheduler process ----------------------------------------------------
@pytest.mark.parametrize("via", ["weight_updater", "model_runner"])
def test_update_in_process_in_buckets(llama: tuple[torch.nn.Module, Any],
                                      mstore: tensordb.Database, via: str) -> None:
    from engine_bindings.sglang import update_weights_from_tensordb

    model, updater = llama
    v2 = checkpoint(2)
    mstore.commit("llama", v2)
    target = updater if via == "weight_updater" else SimpleNamespace(weight_updater=updater)
    summary = update_weights_from_tensordb(target, mstore, "llama", 2, bucket_bytes=100_000)
    assert mismatches(model, expected_params(v2)) == []
    nbytes = sum(t.nbytes for t in v2.values())
    assert {k: summary[k] for k in ("collection", "version", "tensors", "bytes", "mode")} == {
        "collection": "llama", "version": 2, "tensors": len(v2), "bytes": nbytes,
        "mode": "direct"}
    assert summary["buckets"] >= nbytes // 100_000


def test_missing_version_leaves_the_model_alone(llama: tuple[torch.nn.Module, Any],
                                                mstore: tensordb.Database) -> None:
    from engine_bindings.sglang import update_weights_from_tensordb

    model, updater = llama
    with pytest.raises(NotFound):
        update_weights_from_tensordb(updater, mstore, "llama", 7)
    with pytest.raises(InvalidInput, match="mode"):
        update_weights_from_tensordb(updater, mstore, "llama", mode="fast")
    with pytest.raises(InvalidInput, match="target"):
        update_weights_from_tensordb(object(), mstore, "llama")
    assert mismatches(model, expected_params(checkpoint(1))) == []


def test_a_damaged_version_leaves_the_model_on_its_own(llama: tuple[torch.nn.Module, Any],
                                                       mstore: tensordb.Database) -> None:
    """One tensor of the new version damaged in the store (its bytes flipped, the store
    not told): CorruptData before the first bucket reaches the model, which keeps (and
    reports) the version it had."""
    from engine_bindings.sglang import served_version, update_weights_from_tensordb
    from tensordb.errors import CorruptData

    model, updater = llama
    have = mstore.commit("llama", checkpoint(1)).version
    update_weights_from_tensordb(updater, mstore, "llama", have)
    new = mstore.commit("llama", checkpoint(6)).version
    with mstore.snapshot("llama", version=new) as snap:
        last = list(snap)[-1]
        sid, offset, _ = snap.extents()[last]
    with open(mstore.tier("host").path(sid), "r+b") as fh:  # type: ignore[attr-defined]
        fh.seek(offset + 3)
        b = fh.read(1)
        fh.seek(offset + 3)
        fh.write(bytes([b[0] ^ 0xFF]))
    with pytest.raises(CorruptData, match=last):
        update_weights_from_tensordb(updater, mstore, "llama", new, bucket_bytes=100_000)
    assert mismatches(model, expected_params(checkpoint(1))) == []
    assert served_version(updater) == {"collection": "llama", "version": have}


# -- updates through an Engine -----------------------------------------------------------
class _Scheduler:
    """The tokenizer manager's side of a weight update, with the scheduler in-process:
    each request is handled as SchedulerWeightUpdater does (session checks, the rank's
    payload deserialized with SGLang's safe unpickler, the runner's WeightUpdater)."""

    def __init__(self, updater: Any) -> None:
        self.updater = updater
        self.session = False
        self.requests: list[Any] = []

    async def begin_weight_update(self, obj: Any, request: Any) -> tuple[bool, str]:
        if self.session:
            return False, "a weight-update session is already open"
        self.updater.begin_weight_update()
        self.session, self.loaded = True, False
        return True, "Success"

    async def update_weights_from_tensor(self, obj: Any, request: Any) -> tuple[bool, str]:
        from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput
        from sglang.srt.utils import MultiprocessingSerializer

        assert isinstance(obj, UpdateWeightsFromTensorReqInput)
        if not self.session:
            return False, "update_weights_from_tensor must run between begin and end"
        self.requests.append(obj)
        named = MultiprocessingSerializer.deserialize(obj.serialized_named_tensors[0])
        try:
            ok, msg = self.updater.update_weights_from_tensor(named_tensors=named,
                                                              load_format=obj.load_format)
        finally:
            _undo_reduction_patch()
        self.loaded = self.loaded or ok
        return ok, msg

    async def end_weight_update(self, obj: Any, request: Any) -> tuple[bool, str]:
        if not self.session:
            return False, "no weight-update session is open"
        self.updater.end_weight_update(run_post_load=not self.loaded)
        self.session = False
        return True, "Success"


@pytest.fixture
def engine(llama: tuple[torch.nn.Module, Any], sglang_cpu: Any) -> Iterator[Any]:
    """A sglang Engine whose scheduler runs in this process (no GPU to start one)."""
    from sglang.srt.entrypoints.engine import Engine

    eng = object.__new__(Engine)
    eng.server_args = SimpleNamespace(tp_size=1, custom_weight_loader=[])
    eng.tokenizer_manager = _Scheduler(llama[1])
    eng.loop = asyncio.new_event_loop()
    try:
        yield eng
    finally:
        eng.loop.close()


def test_engine_push_sends_flattened_buckets(engine: Any, llama: tuple[torch.nn.Module, Any],
                                             mstore: tensordb.Database) -> None:
    from engine_bindings.sglang import update_weights_from_tensordb

    model, _ = llama
    v2 = checkpoint(2)
    mstore.commit("llama", v2)
    summary = update_weights_from_tensordb(engine, mstore, "llama", bucket_bytes=150_000)
    assert mismatches(model, expected_params(v2)) == []
    reqs = engine.tokenizer_manager.requests
    assert summary["mode"] == "push" and summary["buckets"] == len(reqs) > 1
    assert {r.load_format for r in reqs} == {"flattened_bucket"}
    assert [r.flush_cache for r in reqs] == [False] * (len(reqs) - 1) + [True]
    assert [r.weight_version for r in reqs][-1] == "llama@2"
    assert not engine.tokenizer_manager.session


def test_engine_pull_has_the_scheduler_read_the_store(engine: Any,
                                                      llama: tuple[torch.nn.Module, Any],
                                                      mstore: tensordb.Database) -> None:
    from engine_bindings.sglang import PULL_LOADER, update_weights_from_tensordb

    model, _ = llama
    with pytest.raises(InvalidInput, match="custom-weight-loader"):
        update_weights_from_tensordb(engine, mstore, "llama", mode="pull")
    engine.server_args.custom_weight_loader = [PULL_LOADER]
    v2 = checkpoint(2)
    mstore.commit("llama", v2)
    location = str(mstore.config.home)  # the helper may be told where, not given a store
    summary = update_weights_from_tensordb(engine, location, "llama", weight_version="step-2")
    assert mismatches(model, expected_params(v2)) == []
    (req,) = engine.tokenizer_manager.requests
    assert (req.load_format, req.weight_version, req.flush_cache) == (PULL_LOADER, "step-2",
                                                                       True)
    assert len(req.serialized_named_tensors[0]) < 2000  # a name, not the weights
    assert summary["mode"] == "pull" and summary["tensors"] == len(v2)
    assert summary["bytes"] == sum(t.nbytes for t in v2.values())

    # only some tensors, back to version 1
    summary = update_weights_from_tensordb(engine, mstore, "llama", 1,
                                           names=["lm_head.weight"])
    assert summary["tensors"] == 1
    want = expected_params(v2)
    want["lm_head.weight"] = checkpoint(1)["lm_head.weight"]
    assert mismatches(model, want) == []


def test_http_server_adapter_pulls(llama: tuple[torch.nn.Module, Any], sglang_cpu: Any,
                                  mstore: tensordb.Database) -> None:
    """A server started with ``sglang.launch_server``, driven through SGLang's
    HttpServerEngineAdapter: its requests reach the scheduler as the HTTP endpoints
    build them (the payload arrives base64-encoded)."""
    from sglang.srt.entrypoints.http_server_engine import HttpServerEngineAdapter
    from sglang.srt.managers.io_struct import (
        BeginWeightUpdateReqInput,
        EndWeightUpdateReqInput,
        UpdateWeightsFromTensorReqInput,
    )

    from engine_bindings.sglang import PULL_LOADER, update_weights_from_tensordb

    model, updater = llama
    scheduler, loop = _Scheduler(updater), asyncio.new_event_loop()
    endpoints = {"begin_weight_update": (BeginWeightUpdateReqInput,
                                         scheduler.begin_weight_update),
                 "update_weights_from_tensor": (UpdateWeightsFromTensorReqInput,
                                                scheduler.update_weights_from_tensor),
                 "end_weight_update": (EndWeightUpdateReqInput, scheduler.end_weight_update)}

    def post(endpoint: str, payload: dict[str, Any] | None = None) -> dict[str, Any]:
        req_cls, handler = endpoints[endpoint]
        ok, msg = loop.run_until_complete(handler(req_cls(**(payload or {})), None))
        return {"success": ok, "message": msg}

    adapter = object.__new__(HttpServerEngineAdapter)
    adapter.server_args = sglang_cpu  # started with --custom-weight-loader PULL_LOADER
    adapter._make_request = post
    mstore.commit("llama", checkpoint(2))
    try:
        summary = update_weights_from_tensordb(adapter, mstore, "llama")
    finally:
        loop.close()
    assert summary["mode"] == "pull" and summary["version"] == 2
    assert [r.load_format for r in scheduler.requests] == [PULL_LOADER]
    assert mismatches(model, expected_params(checkpoint(2))) == []


def test_engine_failure_closes_the_session(engine: Any, llama: tuple[torch.nn.Module, Any],
                                           mstore: tensordb.Database) -> None:
    from engine_bindings.sglang import update_weights_from_tensordb

    bad = checkpoint(2)
    bad["model.layers.0.mlp.up_proj.weight"] = torch.zeros(3, 3)  # wrong shape
    mstore.commit("llama", bad)
    with pytest.raises((AssertionError, RuntimeError, ValueError)):  # SGLang's weight loader
        update_weights_from_tensordb(engine, mstore, "llama")
    assert not engine.tokenizer_manager.session  # end_weight_update ran
    mstore.commit("llama", checkpoint(3))
    update_weights_from_tensordb(engine, mstore, "llama")
    assert mismatches(llama[0], expected_params(checkpoint(3))) == []


def test_payloads_survive_sglangs_tensor_pickling_patch() -> None:
    """SGLang patches torch's tensor pickling for CUDA IPC in processes that load
    weights; host tensors must still serialize for the engine's safe unpickler."""
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

    from engine_bindings.sglang._weights import _flattened_payload, _serialize

    bucket = [("a", torch.arange(6, dtype=torch.float32).view(2, 3)),
              ("b", torch.tensor([1, 2, 3], dtype=torch.int8)),
              ("c", torch.ones(4, dtype=torch.bfloat16))]
    monkey_patch_torch_reductions()
    try:
        got = MultiprocessingSerializer.deserialize(_serialize(_flattened_payload(bucket)))
    finally:
        _undo_reduction_patch()
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    tensors = dict(FlattenedTensorBucket(flattened_tensor=got["flattened_tensor"],
                                         metadata=got["metadata"]).reconstruct_tensors())
    assert set(tensors) == {"a", "b", "c"}
    for name, t in bucket:
        assert torch.equal(tensors[name], t)
