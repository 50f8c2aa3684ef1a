"""The connector with the models users run, end to end on this CPU (vLLM's CPU build):
a hybrid Llama (full-attention and sliding-window layers: two KV cache groups under
vLLM's hybrid KV cache manager) and a DeepSeek-V2-style model with multi-head latent
attention (MLA: the CPU build's latent cache of 576 = kv_lora_rank 512 + rope 64).

The hybrid model: a second engine loads the prefix a first engine saved and answers
exactly like an engine without the connector. The MLA model: its blocks are saved, and
not loaded: vLLM's CPU build runs MLA with prefix caching off, since its MLA prefill
over an already computed prefix answers otherwise than a whole prefill (vLLM's own
example connector, loading the same bytes, gets those other answers too); a GPU
engine's loads of MLA blocks are tested on vLLM's real scheduler in
test_vllm_hybrid_kv.py. Weights are generated and served from the store
(``load_format="tensordb"``); nothing is downloaded. Skipped, saying why, where vLLM is
not its CPU build. The blocks, group by group and rank by rank, are compared in
test_vllm_hybrid_kv.py on vLLM's real scheduler.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import tensordb

from .engine_support import HYBRID, MLA, mla_checkpoint, serving_checkpoint, write_model_config
from .test_vllm_e2e import PROMPT, _kv, cpu_engine, generate, serving, tokens  # noqa: F401

pytestmark = [
    pytest.mark.engine("vllm"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]


def _groups(llm: Any) -> list[tuple[str, list[str]]]:
    """The engine's KV cache groups: (spec, layers) each, as its scheduler holds them."""
    config = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config
    return [(type(g.kv_cache_spec).__name__, list(g.layer_names))
            for g in config.kv_cache_groups]


def _second_engine_answers_like_none(store: tensordb.Database, model_dir: Path,
                                     block: int, loads: bool = True, **more: Any
                                     ) -> tuple[list[tuple[str, list[str]]], Any]:
    """A reference engine without the connector, then engines A and B with it: A saves
    the prompt's blocks, B loads all of them but the last token's (none: ``loads``
    False) and both answer like the reference. ``more``: the engines' other arguments.
    Returns the engines' KV cache groups, and the last engine's config and KV cache
    config."""
    hit = (len(PROMPT) - 1) // block * block if loads else 0
    groups = []
    with serving(model_dir, store, block_size=block, **more) as llm:
        want = tokens(generate(llm))
        groups.append(_groups(llm))
    for cached in (0, hit):
        with serving(model_dir, store, kv=_kv(store), block_size=block, **more) as llm:
            out = generate(llm)
            groups.append(_groups(llm))
            core = llm.llm_engine.engine_core.engine_core
            configs = (core.vllm_config, core.scheduler.kv_cache_config)
        assert (out.num_cached_tokens, tokens(out)) == (cached, want)
    assert len(set(map(repr, groups))) == 1  # the connector changed no group
    return groups[0], configs


def _stored_blocks(configs: Any) -> int:
    """How many of the prompt's leading blocks every rank's namespace of the engine
    (``configs``: its config and KV cache config) holds."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from engine_bindings.vllm import TensorDBConnector

    config, kv_cache_config = configs
    probe = TensorDBConnector(config, KVConnectorRole.SCHEDULER, kv_cache_config)
    try:
        keys = probe.caches[0].keys(PROMPT)
        return min(kv.match(keys) for kv in probe.caches)
    finally:
        probe.shutdown()


def test_hybrid_model_second_engine_loads_every_group(store: tensordb.Database,
                                                      tmp_path: Path) -> None:
    """A Llama with a sliding-window layer runs under vLLM's hybrid KV cache manager
    with the connector (two groups, vLLM does not turn it off); a second engine loads
    both groups' KV of the 288-token prefix and answers like an engine without it."""
    store.commit("llama", serving_checkpoint(1))
    groups, configs = _second_engine_answers_like_none(
        store, write_model_config(tmp_path / "hybrid", HYBRID), block=32)
    assert _stored_blocks(configs) == len(PROMPT) // 32
    assert groups == [("FullAttentionSpec", ["model.layers.0.self_attn.attn"]),
                      ("SlidingWindowSpec", ["model.layers.1.self_attn.attn"])]


def test_mla_model_saves_its_latent_cache_and_never_loads_it_on_the_cpu(
        store: tensordb.Database, tmp_path: Path) -> None:
    """A DeepSeek-V2-style MLA model (blocks of 16 tokens: the CPU MLA kernel's) saves
    its latent cache (the 18 blocks of the prompt are stored); a second engine on this
    CPU build loads none of it (its MLA cannot continue from a computed prefix) and
    answers like an engine without the connector."""
    store.commit("llama", mla_checkpoint(1))
    model_dir = write_model_config(tmp_path / "mla", MLA)
    # the reference MLA backend: on a CPU with AMX tiles vLLM would pick its AMX one,
    # which takes bfloat16 weights only (this model is float32)
    groups, configs = _second_engine_answers_like_none(
        store, model_dir, block=16, loads=False, attention_config={"backend": "CPU_MLA"})
    assert groups == [("MLAAttentionSpec", [f"model.layers.{i}.self_attn.attn"
                                            for i in range(2)])]
    assert _stored_blocks(configs) == len(PROMPT) // 16
