"""LoRA adapters from the store on vLLM's CPU engine: an adapter made with peft for the
serving Llama, imported as a collection, resolved by ``TensorDBLoRAResolver`` and served
with the same outputs as the same adapter loaded from its folder; a wrong base or a rank
over the engine's limit refused, naming both.

Requests go one at a time: vLLM CPU 0.32's LoRA kernels (``torch_ops.bgmv_*``) index the
adapter slots with -1 for a request without one, which picks the last slot when a
request without a LoRA shares a batch with one (not this store's to fix)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch

import tensordb
from tensordb.errors import InvalidInput

from .engine_support import make_adapter, serving_checkpoint, why_no_forward, write_serving_config
from .test_vllm_e2e import PROMPT, serving

pytestmark = [
    pytest.mark.engine("vllm"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]


@pytest.fixture(scope="module", autouse=True)
def cpu_engine() -> Any:
    reason = why_no_forward()
    if reason:
        pytest.skip(reason)
    pytest.importorskip("peft", reason="the adapter is made with peft (make e2e-vllm)")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        mp.setenv("VLLM_TARGET_DEVICE", "cpu")
        yield


def test_an_adapter_resolved_from_the_store_serves_as_from_its_folder(
        store: tensordb.Database, tmp_path: Path) -> None:
    from safetensors.torch import save_file
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    from engine_bindings.vllm import TensorDBLoRAResolver

    base = write_serving_config(tmp_path / "base")
    save_file(serving_checkpoint(3), str(base / "model.safetensors"))
    store.import_safetensors("llama", base)
    adapter = make_adapter(tmp_path / "adapter", base="llama")
    store.import_safetensors("my-lora", adapter)
    store.import_safetensors("other-base", make_adapter(tmp_path / "a2", base="mistral"))
    store.import_safetensors("too-big", make_adapter(tmp_path / "a3", base="llama", rank=16))
    co = store.checkout("llama", tmp_path / "co")

    resolver = TensorDBLoRAResolver(max_lora_rank=8, cache_dir=tmp_path / "cache")
    req = resolver.resolve(str(co), "my-lora")
    assert req is not None and req.lora_name == "my-lora"
    for f in adapter.iterdir():  # the cache holds the adapter's folder, byte-identical
        assert (Path(req.lora_path) / f.name).read_bytes() == f.read_bytes(), f.name
    assert resolver.resolve(str(co), "my-lora") is req  # cached
    assert resolver.resolve(str(co), "no-such-adapter") is None
    with pytest.raises(InvalidInput, match="mistral.*llama"):
        resolver.resolve(str(co), "other-base")
    with pytest.raises(InvalidInput, match="rank 16.*max_lora_rank 8"):
        resolver.resolve(str(co), "too-big")

    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)

    def gen(llm: Any, lora: Any = None) -> list[int]:
        (out,) = llm.generate([TokensPrompt(prompt_token_ids=PROMPT)], params,
                              use_tqdm=False, lora_request=lora)
        return list(out.outputs[0].token_ids)

    with serving(co, load_format="tensordb", enable_lora=True, max_lora_rank=8,
                 max_loras=2) as llm:
        plain = gen(llm)
        from_store = gen(llm, req)
        from_folder = gen(llm, LoRARequest("from-folder", 99, str(adapter)))
    assert from_store == from_folder and from_store != plain


def test_resolve_time_first_and_cached_with_a_thousand_adapters(
        store: tensordb.Database, tmp_path: Path) -> None:
    """Not a timed assertion: prints the figures (the issue asks for them); holds only
    that a cached resolve builds no folder."""
    from engine_bindings.vllm import TensorDBLoRAResolver

    base = write_serving_config(tmp_path / "base")
    store.commit("llama", {"w": torch.zeros(1)})
    store.import_safetensors("adapter-0", make_adapter(tmp_path / "a0", base="llama"))
    cfg = (tmp_path / "a0" / "adapter_config.json").read_bytes()
    w = {f"base_model.model.model.layers.0.self_attn.q_proj.lora_{x}.weight": torch.zeros(8, 8)
         for x in "AB"}
    for i in range(1, 1000):  # 999 more adapters: small ones, each a collection
        with store.transaction(f"adapter-{i}") as tx:
            tx.put_many(w)
            tx.put_files({"adapter_config.json": cfg})
    co = store.checkout("llama", tmp_path / "co")
    del base
    resolver = TensorDBLoRAResolver(max_lora_rank=8, cache_dir=tmp_path / "cache")
    t0 = time.perf_counter()
    req = resolver.resolve(str(co), "adapter-0")
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    again = resolver.resolve(str(co), "adapter-0")
    cached = time.perf_counter() - t0
    assert again is req and len(list((tmp_path / "cache").iterdir())) == 1
    print(f"\nLoRA resolve with 1,000 adapters in the store: first {first * 1e3:.1f} ms, "
          f"cached {cached * 1e3:.2f} ms")
