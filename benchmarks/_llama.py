"""A Llama of random weights that vLLM's CPU build serves, for the benchmarks that run
real engines (engines_e2e.py, routing.py --engine vllm): its config.json and a
checkpoint in Hugging Face names. Nothing is downloaded.

Heads are 64 wide (vLLM's CPU attention takes head sizes of 32 and up), a quarter as
many KV heads as query heads (at least one), weights small enough (x 0.05) that
activations stay finite through many layers.

Scripts and packages import it as ``benchmarks._llama``; torch only.
"""

from __future__ import annotations

from typing import Any

import torch

HEAD_DIM = 64


def config(hidden: int, layers: int, max_len: int, vocab: int = 4096) -> dict[str, Any]:
    """The config.json of a Llama of ``hidden`` (a multiple of 64) x ``layers`` serving
    up to ``max_len`` positions."""
    heads = hidden // HEAD_DIM
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "hidden_size": hidden, "intermediate_size": hidden * 11 // 4,
            "num_attention_heads": heads, "num_key_value_heads": max(1, heads // 4),
            "head_dim": HEAD_DIM, "num_hidden_layers": layers, "vocab_size": vocab,
            "max_position_embeddings": max_len, "rms_norm_eps": 1e-6,
            "torch_dtype": "float32", "tie_word_embeddings": False, "bos_token_id": 1,
            "eos_token_id": 2}


def checkpoint(cfg: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """A full checkpoint of ``cfg``'s Llama; every tensor depends on ``seed``."""
    h, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    q = cfg["num_attention_heads"] * HEAD_DIM
    kv = cfg["num_key_value_heads"] * HEAD_DIM
    g = torch.Generator().manual_seed(seed)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.05

    sd = {"model.embed_tokens.weight": r(vocab, h), "model.norm.weight": torch.ones(h),
          "lm_head.weight": r(vocab, h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        sd.update({p + "self_attn.q_proj.weight": r(q, h), p + "self_attn.k_proj.weight": r(kv, h),
                   p + "self_attn.v_proj.weight": r(kv, h), p + "self_attn.o_proj.weight": r(h, q),
                   p + "mlp.gate_proj.weight": r(inter, h), p + "mlp.up_proj.weight": r(inter, h),
                   p + "mlp.down_proj.weight": r(h, inter),
                   p + "input_layernorm.weight": torch.ones(h),
                   p + "post_attention_layernorm.weight": torch.ones(h)})
    return sd
