"""vLLM 0.33: the ``tensordb`` load format and the worker extension, against vLLM's real
loader registry, model classes (a tiny Llama built on the CPU), weight loaders,
in-place reload and worker classes. Only the worker object around the model is a
stand-in: a vLLM worker needs a GPU (or vLLM's CPU kernels) to start."""

from __future__ import annotations

import copy
import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import tensordb
from tensordb.errors import InvalidInput, NotFound

from .engine_support import checkpoint, expected_params, mismatches, write_config

pytestmark = pytest.mark.engine("vllm")

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _extra(db: tensordb.Database, **ref: Any) -> dict[str, Any]:
    from engine_bindings._engines import StoreLocation

    return {"collection": "llama", **ref, **StoreLocation.of(db).as_dict()}


def _vllm_config(model_dir: Path, extra: dict[str, Any], tp: int = 1) -> Any:
    from vllm.config import LoadConfig, ModelConfig, ParallelConfig, VllmConfig

    return VllmConfig(
        model_config=ModelConfig(model=str(model_dir), skip_tokenizer_init=True,
                                 dtype="float32", enforce_eager=True),
        load_config=LoadConfig(load_format="tensordb", model_loader_extra_config=extra),
        parallel_config=ParallelConfig(tensor_parallel_size=tp))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_config(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def vllm_cpu(model_dir: Path) -> Iterator[None]:
    """vLLM's distributed state for one CPU worker (gloo), as a worker sets it up."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import (
        destroy_distributed_environment,
        destroy_model_parallel,
        ensure_model_parallel_initialized,
        init_distributed_environment,
    )

    with pytest.MonkeyPatch.context() as mp:
        if not torch.accelerator.is_available():
            # BaseModelLoader.load_model empties the accelerator cache; a CPU-only torch
            # has no accelerator and raises there
            mp.setattr(torch.accelerator, "empty_cache", lambda: None)
        with set_current_vllm_config(_vllm_config(model_dir, {"collection": "llama"})):
            init_distributed_environment(
                world_size=1, rank=0, local_rank=0, backend="gloo",
                distributed_init_method=f"tcp://127.0.0.1:{_free_port()}")
            ensure_model_parallel_initialized(1, 1)
        try:
            yield
        finally:
            destroy_model_parallel()
            destroy_distributed_environment()


def _build(model_dir: Path, extra: dict[str, Any]) -> tuple[torch.nn.Module, Any]:
    """vLLM's own get_model: our loader through vLLM's registry, then vLLM builds the
    model and post-processes it."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model

    vc = _vllm_config(model_dir, extra)
    with set_current_vllm_config(vc):
        return get_model(vllm_config=vc), vc


# -- the load format ---------------------------------------------------------------------
def test_load_format_resolves_through_vllm_registry(store: tensordb.Database) -> None:
    from vllm.config import LoadConfig
    from vllm.model_executor.model_loader import BaseModelLoader, get_model_loader

    from engine_bindings.vllm import LOAD_FORMAT, TensorDBModelLoader

    loader = get_model_loader(LoadConfig(load_format="TensorDB",
                                         model_loader_extra_config=_extra(store, version=2)))
    assert LOAD_FORMAT == "tensordb"
    assert isinstance(loader, TensorDBModelLoader) and isinstance(loader, BaseModelLoader)
    assert (loader.source.collection, loader.source.version) == ("llama", 2)
    assert loader.source.location.home == str(store.config.home)


@pytest.mark.parametrize("extra, needle", [
    ({"bucket": 1}, "'collection'"),
    ({"collection": "llama", "bucket": 1}, "'bucket'"),
    ({"collection": "llama", "version": 1, "tag": "t"}, "not both"),
    ({"collection": "llama", "version": "3"}, "version"),
    ({"collection": "llama", "verify": "yes"}, "verify"),
    ({"collection": "llama", "home": 5}, "'home'"),
], ids=["no-collection", "unknown-key", "version-and-tag", "version-str", "verify-str",
        "home-int"])
def test_bad_extra_config_is_a_value_error(extra: dict[str, Any], needle: str) -> None:
    from vllm.config import LoadConfig
    from vllm.model_executor.model_loader import get_model_loader

    with pytest.raises(ValueError, match=needle) as err:
        get_model_loader(LoadConfig(load_format="tensordb", model_loader_extra_config=extra))
    assert isinstance(err.value, InvalidInput)


def test_no_extra_config_reads_the_model_folders_marker_or_says_what_is_missing(
        store: tensordb.Database, model_dir: Path, tmp_path: Path) -> None:
    """With no extra config the version is the one the model folder's ``tensordb.json``
    (a ``tensordb checkout``) names; a folder without one is InvalidInput saying so."""
    from types import SimpleNamespace

    from vllm.config import LoadConfig
    from vllm.model_executor.model_loader import get_model_loader

    loader = get_model_loader(LoadConfig(load_format="tensordb"))
    with pytest.raises(InvalidInput, match="'collection'.*tensordb checkout"):
        loader.download_model(SimpleNamespace(model=str(model_dir)))  # type: ignore[arg-type]
    store.commit("llama", checkpoint(1))
    co = store.checkout("llama", tmp_path / "co")
    loader.download_model(SimpleNamespace(model=str(co)))  # type: ignore[arg-type]
    assert loader.source is not None and loader.source.collection == "llama"
    assert loader.source.version == 1


def test_download_model_checks_the_version_exists(store: tensordb.Database,
                                                  model_dir: Path) -> None:
    from vllm.config import LoadConfig
    from vllm.model_executor.model_loader import get_model_loader

    store.commit("llama", checkpoint(1))
    ok = get_model_loader(LoadConfig(load_format="tensordb",
                                     model_loader_extra_config=_extra(store)))
    ok.download_model(None)  # nothing to fetch
    missing = get_model_loader(LoadConfig(load_format="tensordb",
                                          model_loader_extra_config=_extra(store, version=9)))
    with pytest.raises(NotFound, match="version 9"):
        missing.download_model(None)


def test_vllm_builds_a_real_llama_from_a_version(store: tensordb.Database, model_dir: Path,
                                                 vllm_cpu: None) -> None:
    store.commit("llama", checkpoint(1))
    store.commit("llama", checkpoint(2))
    store.tag("llama", "first", version=1)
    for ref, seed in [({"version": 1}, 1), ({"tag": "first"}, 1), ({}, 2)]:
        model, _ = _build(model_dir, _extra(store, **ref))
        assert type(model).__name__ == "LlamaForCausalLM"
        assert mismatches(model, expected_params(checkpoint(seed))) == [], ref


def test_a_collection_missing_weights_fails_the_load(store: tensordb.Database,
                                                     model_dir: Path, vllm_cpu: None) -> None:
    partial = checkpoint(1)
    del partial["lm_head.weight"]
    store.commit("llama", partial)
    with pytest.raises(InvalidInput, match="lm_head.weight"):
        _build(model_dir, _extra(store))


def test_vllm_reload_weights_rereads_the_head(store: tensordb.Database, model_dir: Path,
                                              vllm_cpu: None) -> None:
    """vLLM's in-place reload (what ``collective_rpc("reload_weights")`` runs) asks the
    configured loader for its weights again: with no version pinned, the new head."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload.inplace import reload_weights

    store.commit("llama", checkpoint(1))
    model, vc = _build(model_dir, _extra(store))
    store.commit("llama", checkpoint(2))
    with set_current_vllm_config(vc):
        reload_weights(vc, model, weights_iterator=None, weights_path=None,
                       is_checkpoint_format=True)
    assert mismatches(model, expected_params(checkpoint(2))) == []


_TP_CHILD = """
import json, os, sys
import torch
from engine_support import checkpoint, expected_params, mismatches
rank, world, port, model_dir, extra = (int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]),
                                       sys.argv[4], json.loads(sys.argv[5]))
if not torch.accelerator.is_available():
    torch.accelerator.empty_cache = lambda: None
from vllm.config import LoadConfig, ModelConfig, ParallelConfig, VllmConfig, set_current_vllm_config
from vllm.distributed import (ensure_model_parallel_initialized, init_distributed_environment,
                              get_tensor_model_parallel_rank)
from vllm.model_executor.model_loader import get_model
import engine_bindings.vllm
vc = VllmConfig(model_config=ModelConfig(model=model_dir, skip_tokenizer_init=True,
                                         dtype="float32", enforce_eager=True),
                load_config=LoadConfig(load_format="tensordb", model_loader_extra_config=extra),
                parallel_config=ParallelConfig(tensor_parallel_size=world))
with set_current_vllm_config(vc):
    init_distributed_environment(world_size=world, rank=rank, local_rank=rank, backend="gloo",
                                 distributed_init_method=f"tcp://127.0.0.1:{port}")
    ensure_model_parallel_initialized(world, 1)
    model = get_model(vllm_config=vc)
    want = expected_params(checkpoint(1), get_tensor_model_parallel_rank(), world)
    # the layer's own partition (a backend that repacks weights empties the parameter)
    layer = model.model.layers[0].self_attn.qkv_proj
    qkv = (layer.output_size_per_partition, layer.input_size_per_partition)
    print("RESULT " + json.dumps({"rank": get_tensor_model_parallel_rank(),
                                  "bad": mismatches(model, want), "qkv": qkv}))
"""


def test_tensor_parallel_ranks_load_their_own_slices(store: tensordb.Database,
                                                     model_dir: Path) -> None:
    """Two vLLM tensor-parallel workers (gloo, one process each) load the same version:
    each rank's fused, split parameters hold exactly its slices."""
    store.commit("llama", checkpoint(1))
    port, world = _free_port(), 2
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), str(ROOT)]),
           "VLLM_TARGET_DEVICE": "cpu", "PYTHONWARNINGS": "ignore",
           # vLLM's CPU build names the ranks' shared-memory group with it
           "VLLM_DIST_IDENT": f"tensordb-test-{port}"}
    procs = [subprocess.Popen([sys.executable, "-c", _TP_CHILD, str(rank), str(world), str(port),
                               str(model_dir), json.dumps(_extra(store))],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for rank in range(world)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
        assert p.returncode == 0 and lines, err[-3000:]
        results.append(json.loads(lines[-1][len("RESULT "):]))
    assert sorted(r["rank"] for r in results) == [0, 1]
    for r in results:
        assert r["bad"] == [], r
        assert r["qkv"] == [(4 + 2 + 2) * 16 // 2, 64]  # half of q, k and v on each rank


# -- the worker extension ----------------------------------------------------------------
class _Worker:
    """What the extension uses of a vLLM worker: ``model_runner`` and ``vllm_config``."""

    def __init__(self, model: torch.nn.Module, vllm_config: Any, reload: Any = None) -> None:
        self.model_runner = SimpleNamespace(model=model)
        if reload is not None:
            self.model_runner.reload_weights = reload
        self.vllm_config = vllm_config


def _worker(model: torch.nn.Module, vllm_config: Any, reload: Any = None) -> Any:
    from engine_bindings.vllm import TensorDBWorkerExtension

    # mixed in as vLLM does it: the extension becomes a base of the worker class
    cls = type("Worker", (_Worker,), {})
    cls.__bases__ = cls.__bases__ + (TensorDBWorkerExtension,)
    return cls(model, vllm_config, reload)


def test_extension_updates_the_live_model_to_a_version(store: tensordb.Database,
                                                       model_dir: Path,
                                                       vllm_cpu: None) -> None:
    store.commit("llama", checkpoint(1))
    model, vc = _build(model_dir, _extra(store))
    v2 = checkpoint(2)
    store.commit("llama", v2)
    worker = _worker(model, vc)
    # the version the loader loaded
    assert worker.tensordb_weights_version() == {"collection": "llama", "version": 1}

    # the store is the one the model was loaded from (--load-format tensordb)
    summary = worker.update_weights_from_tensordb("llama", version=2)

    assert mismatches(model, expected_params(v2)) == []
    assert {k: summary[k] for k in ("collection", "version", "tensors", "bytes")} == {
        "collection": "llama", "version": 2, "tensors": len(v2),
        "bytes": sum(t.nbytes for t in v2.values())}
    assert (summary["tp_rank"], summary["tp_size"]) == (0, 1)
    assert worker.tensordb_weights_version() == {"collection": "llama", "version": 2}

    # back to 1 by tag, from a store named explicitly
    store.tag("llama", "first", version=1)
    from vllm.config import LoadConfig

    worker.vllm_config = copy.copy(vc)  # a model not loaded from the store
    worker.vllm_config.load_config = LoadConfig(load_format="auto")
    summary = worker.update_weights_from_tensordb("llama", tag="first",
                                                  location=str(store.config.home))
    assert summary["version"] == 1
    assert mismatches(model, expected_params(checkpoint(1))) == []


def test_extension_loads_only_the_named_tensors(store: tensordb.Database, model_dir: Path,
                                                vllm_cpu: None) -> None:
    from engine_bindings.vllm import repacked_parameters

    store.commit("llama", checkpoint(1))
    model, vc = _build(model_dir, _extra(store))
    v2 = checkpoint(2)
    store.commit("llama", v2)
    names = {"lm_head.weight", "model.layers.1.self_attn.k_proj.weight"}
    if repacked_parameters(model):
        # vLLM's CPU build repacked the linear weights: a part of a layer cannot be
        # copied in place, and the update says so before touching the model
        with pytest.raises(InvalidInput, match="repacked"):
            _worker(model, vc).update_weights_from_tensordb("llama", names=names)
        with pytest.raises(InvalidInput, match="repacked"):
            _worker(model, vc).update_weights_from_tensordb("llama", via="load_weights")
        assert mismatches(model, expected_params(checkpoint(1))) == []
        return
    summary = _worker(model, vc).update_weights_from_tensordb("llama", names=names)
    assert summary["tensors"] == 2
    want = expected_params(checkpoint(1))
    want["lm_head.weight"] = v2["lm_head.weight"]
    qkv = "model.layers.1.self_attn.qkv_proj.weight"
    want[qkv] = want[qkv].clone()
    want[qkv][64:96] = v2["model.layers.1.self_attn.k_proj.weight"]  # k: after q's 64 rows
    assert mismatches(model, want) == []


def test_extension_through_vllm_reload_weights(store: tensordb.Database, model_dir: Path,
                                               vllm_cpu: None) -> None:
    """``via="reload_weights"``: vLLM's in-place reload (layerwise post-processing)
    consumes the version's tensors."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload.inplace import reload_weights

    store.commit("llama", checkpoint(1))
    model, vc = _build(model_dir, _extra(store))
    store.commit("llama", checkpoint(2))
    store.commit("llama", checkpoint(3))

    def reload(weights_iterator: Any, is_checkpoint_format: bool) -> None:
        with set_current_vllm_config(vc):  # as GPUModelRunner.reload_weights does
            reload_weights(vc, model, weights_iterator=weights_iterator, weights_path=None,
                           is_checkpoint_format=is_checkpoint_format)

    summary = _worker(model, vc, reload).update_weights_from_tensordb(
        "llama", version=2, via="reload_weights")
    assert summary["version"] == 2
    assert mismatches(model, expected_params(checkpoint(2))) == []


def test_extension_errors_leave_the_model_alone(store: tensordb.Database, model_dir: Path,
                                                vllm_cpu: None) -> None:
    store.commit("llama", checkpoint(1))
    model, vc = _build(model_dir, _extra(store))
    worker = _worker(model, vc)
    with pytest.raises(NotFound):
        worker.update_weights_from_tensordb("llama", version=5)
    with pytest.raises(NotFound):
        worker.update_weights_from_tensordb("other")
    with pytest.raises(InvalidInput, match="not both"):
        worker.update_weights_from_tensordb("llama", version=1, tag="x")
    with pytest.raises(InvalidInput, match="via"):
        worker.update_weights_from_tensordb("llama", via="magic")
    assert mismatches(model, expected_params(checkpoint(1))) == []


# -- all or nothing ----------------------------------------------------------------------
def _flip_last(db: tensordb.Database, version: int) -> str:
    """Flip one byte of the last tensor of ``version`` in its host segment (the store is
    not told); returns its name."""
    with db.snapshot("llama", version=version) as snap:
        name = list(snap)[-1]
        sid, offset, _ = snap.extents()[name]
    assert sid is not None
    path = db.tier("host").path(sid)  # type: ignore[attr-defined]
    with open(path, "r+b") as fh:
        fh.seek(offset + 3)
        b = fh.read(1)
        fh.seek(offset + 3)
        fh.write(bytes([b[0] ^ 0xFF]))
    return name


def _fails_after(model: torch.nn.Module, k: int, monkeypatch: pytest.MonkeyPatch
                 ) -> list[str]:
    """Make the model's next ``load_weights`` fail after it took ``k`` tensors (an
    error in a weight loader, after the store's checks passed); the names it took."""
    real = model.load_weights
    took: list[str] = []

    def once(weights: Any) -> Any:
        monkeypatch.setattr(model, "load_weights", real)

        def feed() -> Iterator[tuple[str, torch.Tensor]]:
            for name, t in weights:
                if len(took) == k:
                    raise RuntimeError("a weight loader failed")
                took.append(name)
                yield name, t

        return real(feed())

    monkeypatch.setattr(model, "load_weights", once)
    return took


@pytest.mark.parametrize("via", ["auto", "reload_weights"])
def test_extension_refuses_a_damaged_version_before_touching_the_model(
        store: tensordb.Database, model_dir: Path, vllm_cpu: None, via: str) -> None:
    from tensordb.errors import CorruptData

    store.commit("llama", checkpoint(1))
    model, vc = _build(model_dir, _extra(store))
    store.commit("llama", checkpoint(2))
    bad = _flip_last(store, 2)
    worker = _worker(model, vc)
    with pytest.raises(CorruptData) as info:
        worker.update_weights_from_tensordb("llama", version=2, via=via)
    assert info.value.tensor == bad
    assert mismatches(model, expected_params(checkpoint(1))) == []
    assert worker.tensordb_weights_version() == {"collection": "llama", "version": 1}
    store.commit("llama", checkpoint(3))
    assert worker.update_weights_from_tensordb("llama", via=via)["version"] == 3
    assert mismatches(model, expected_params(checkpoint(3))) == []
    assert worker.tensordb_weights_version() == {"collection": "llama", "version": 3}


@pytest.mark.parametrize("via", ["auto", "reload_weights"])
def test_extension_puts_the_version_before_back_after_a_failure_part_way(
        store: tensordb.Database, model_dir: Path, vllm_cpu: None, via: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload.inplace import reload_weights

    store.commit("llama", checkpoint(1))
    model, vc = _build(model_dir, _extra(store))
    store.commit("llama", checkpoint(2))

    def reload(weights_iterator: Any, is_checkpoint_format: bool) -> None:
        with set_current_vllm_config(vc):
            reload_weights(vc, model, weights_iterator=weights_iterator, weights_path=None,
                           is_checkpoint_format=is_checkpoint_format)

    worker = _worker(model, vc, reload)
    took = _fails_after(model, 12, monkeypatch)
    with pytest.raises(RuntimeError, match="a weight loader failed") as info:
        worker.update_weights_from_tensordb("llama", version=2, via=via)
    assert len(took) == 12  # layer 0 and more had version 2 when it failed
    assert "back on llama v1" in "".join(getattr(info.value, "__notes__", []))
    assert mismatches(model, expected_params(checkpoint(1))) == []
    assert worker.tensordb_weights_version() == {"collection": "llama", "version": 1}


def _transfer_engine(model: torch.nn.Module, vc: Any) -> Any:
    from vllm.config.weight_transfer import WeightTransferConfig

    from engine_bindings.vllm._weight_transfer import TensorDBWeightTransferEngine

    return TensorDBWeightTransferEngine(WeightTransferConfig(backend="tensordb"), vc,
                                        torch.device("cpu"), model)


def test_weight_transfer_update_is_all_or_nothing(store: tensordb.Database,
                                                  model_dir: Path, vllm_cpu: None,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's weight-transfer flow on the backend's own engine object (what each worker
    runs): a damaged tensor of the new version, a version gone mid-way through the
    parts, and a weight loader failing part-way all leave the model on version 1, and
    the backend says so; a clean update reports version 2."""
    from vllm.config import set_current_vllm_config

    from tensordb.errors import CorruptData, NotFound

    store.commit("llama", checkpoint(1))
    model, vc = _build(model_dir, _extra(store))
    store.commit("llama", checkpoint(2))
    store.commit("llama", checkpoint(3))
    bad = _flip_last(store, 3)
    v1 = expected_params(checkpoint(1))
    names = list(checkpoint(1))
    first, rest = names[:len(names) // 2], names[len(names) // 2:]
    with set_current_vllm_config(vc):
        wt = _transfer_engine(model, vc)
        assert wt.weights_version() == {"collection": "llama", "version": 1}

        wt.start_weight_update()  # the damaged version: refused before the first tensor
        with pytest.raises(CorruptData) as info:
            wt.update_weights({"version": 3})
        assert info.value.tensor == bad
        assert mismatches(model, v1) == [] and wt.weights_version()["version"] == 1

        # the first part loads, the second fails (its version is unknown): the first
        # part's layers get version 1 back
        wt.start_weight_update()
        wt.update_weights({"version": 2, "names": first})
        with pytest.raises(NotFound):
            wt.update_weights({"version": 9, "names": rest})
        assert mismatches(model, v1) == [] and wt.weights_version()["version"] == 1

        wt.start_weight_update()  # parts naming two versions: refused
        wt.update_weights({"version": 2, "names": first})
        with pytest.raises(InvalidInput, match="one version"):
            wt.update_weights({"version": 1, "names": rest})
        assert mismatches(model, v1) == [] and wt.weights_version()["version"] == 1

        wt.start_weight_update()  # a weight loader failing after 10 tensors
        took = _fails_after(model, 10, monkeypatch)
        with pytest.raises(RuntimeError, match="a weight loader failed"):
            wt.update_weights({"version": 2})
        assert len(took) == 10
        assert mismatches(model, v1) == [] and wt.weights_version()["version"] == 1

        wt.start_weight_update()  # and a clean one, in two parts
        wt.update_weights({"version": 2, "names": first})
        assert wt.weights_version()["version"] == 1  # not before the update ends
        wt.update_weights({"version": 2, "names": rest})
        wt.finish_weight_update()
        assert mismatches(model, expected_params(checkpoint(2))) == []
        assert wt.weights_version() == {"collection": "llama", "version": 2}
        wt.shutdown()


@pytest.mark.parametrize("qualname", ["vllm.v1.worker.gpu_worker.Worker",
                                      "vllm.v1.worker.cpu_worker.CPUWorker"])
def test_extension_mixes_into_vllm_workers(qualname: str) -> None:
    """What vLLM's WorkerWrapperBase.init_worker does with --worker-extension-cls: resolve
    the name, refuse a clash with the worker's attributes, add it as a base class."""
    from vllm.config import LoadConfig
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.utils.import_utils import resolve_obj_by_qualname

    ext = resolve_obj_by_qualname("engine_bindings.vllm.TensorDBWorkerExtension")
    base = resolve_obj_by_qualname(qualname)
    worker_cls = type("W", (base,), {})
    # the worker's own classes (an engine started in this process has mixed the
    # extension into the worker class itself, in place, as vLLM does)
    clashes = [a for a in vars(ext) if not a.startswith("__")
               and any(a in vars(c) for c in base.__mro__ if c is not ext)]
    assert clashes == []
    worker_cls.__bases__ = worker_cls.__bases__ + (ext,)
    assert callable(worker_cls.update_weights_from_tensordb)
    # importing the extension registered the load format in the worker's process
    from engine_bindings.vllm import TensorDBModelLoader
    assert isinstance(get_model_loader(LoadConfig(load_format="tensordb")),
                      TensorDBModelLoader)
