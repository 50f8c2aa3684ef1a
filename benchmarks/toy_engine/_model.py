"""A tiny decoder-only transformer whose prefill really reuses cached KV.

The toy engine needs TTFT to be made of real work: a prefill that computes only the
tokens whose KV it does not hold, and KV blocks that are real tensors a later request
(on this instance or another) can load instead of recomputing. This model is
Llama-shaped (RMSNorm, rotary positions, SwiGLU MLP, no biases) and small enough to run
on a CPU core: random weights drawn from ``ModelConfig.seed``, so every process that
builds the same config holds the same weights and the same KV for the same tokens.

KV layout. A *block* of ``block_tokens`` tokens is one contiguous float tensor of shape
``[layers, 2, heads, block_tokens, head_dim]`` (K then V). A prefill takes the cached
blocks of the prompt's leading full blocks as one block-major tensor
``[blocks, layers, 2, heads, block_tokens, head_dim]`` (so that each block is a
contiguous slice a KV store can copy straight into) and returns the K/V of the tokens
it computed as ``[layers, 2, heads, tokens, head_dim]``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tensordb.errors import InvalidInput

__all__ = ["ModelConfig", "TinyDecoder", "split_blocks"]


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The shape of the model. ``d_model`` must divide into ``heads``; the head size
    must be even (rotary positions rotate pairs)."""

    layers: int = 2
    d_model: int = 256
    heads: int = 4
    ffn: int = 768
    vocab: int = 4096
    max_tokens: int = 16_384
    rope_theta: float = 10_000.0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("layers", "d_model", "heads", "ffn", "vocab", "max_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InvalidInput(f"model config {name} must be a positive int, not {v!r}")
        if self.d_model % self.heads or (self.d_model // self.heads) % 2:
            raise InvalidInput(f"model config: d_model {self.d_model} must split into "
                               f"{self.heads} heads of an even size")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.heads

    def block_shape(self, block_tokens: int) -> tuple[int, int, int, int, int]:
        """The shape of one KV block."""
        return (self.layers, 2, self.heads, block_tokens, self.head_dim)

    def block_nbytes(self, block_tokens: int) -> int:
        return math.prod(self.block_shape(block_tokens)) * 4  # float32


class _RMSNorm(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class _Layer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.attn_norm = _RMSNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.o = nn.Linear(d, d, bias=False)
        self.mlp_norm = _RMSNorm(d)
        self.gate_up = nn.Linear(d, 2 * cfg.ffn, bias=False)
        self.down = nn.Linear(cfg.ffn, d, bias=False)


class TinyDecoder(nn.Module):
    """The model. ``prefill`` is the only entry point the toy engine needs: inference only,
    float32, on the CPU; it runs in the calling thread and holds no state between
    calls (the KV lives with the caller)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.d_model)
        self.layers = nn.ModuleList(_Layer(cfg) for _ in range(cfg.layers))
        self.norm = _RMSNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        g = torch.Generator().manual_seed(cfg.seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if "norm" not in name:  # norms stay at one
                    p.normal_(0.0, 0.02 if p.dim() > 1 and "embed" not in name else 1.0,
                              generator=g)
        half = cfg.head_dim // 2
        inv = cfg.rope_theta ** (-torch.arange(half, dtype=torch.float64) / half)
        ang = torch.arange(cfg.max_tokens, dtype=torch.float64)[:, None] * inv[None, :]
        self.register_buffer("_cos", ang.cos().float(), persistent=False)
        self.register_buffer("_sin", ang.sin().float(), persistent=False)
        self.eval()
        self.requires_grad_(False)

    def _rope(self, x: torch.Tensor, pos0: int) -> torch.Tensor:
        """Rotate ``x`` ([heads, n, head_dim]) for positions ``pos0 ..``."""
        n = x.shape[1]
        cos, sin = self._cos[pos0:pos0 + n], self._sin[pos0:pos0 + n]
        a, b = x[..., 0::2], x[..., 1::2]
        return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)

    @torch.inference_mode()
    def prefill(self, tokens: torch.Tensor, past: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Compute ``tokens`` (int64, 1-D, n >= 1) after a cached prefix whose KV is
        ``past`` (block-major, see the module doc; None or 0 blocks: no prefix).

        Returns ``(logits, kv)``: the next-token logits after the last token
        (``[vocab]``) and the K/V of the n computed tokens (``[layers, 2, heads, n,
        head_dim]``). The same prompt gives the same logits (within float rounding)
        whatever part of it came from ``past``."""
        cfg = self.cfg
        n = int(tokens.shape[0])
        if tokens.dim() != 1 or n < 1:
            raise InvalidInput(f"prefill takes a 1-D tensor of at least one token id, got "
                               f"shape {tuple(tokens.shape)}")
        H, D = cfg.heads, cfg.head_dim
        if past is not None and past.shape[0]:
            nb, bt = past.shape[0], past.shape[4]
            if tuple(past.shape[1:]) != cfg.block_shape(bt):
                raise InvalidInput(f"past KV of shape {tuple(past.shape)} does not fit the "
                                   f"model's blocks {cfg.block_shape(bt)}")
            p0 = nb * bt
            # block-major -> per layer [2, heads, p0, head_dim]: one gather, as a paged
            # attention kernel's block table would do
            prev = past.permute(1, 2, 3, 0, 4, 5).reshape(cfg.layers, 2, H, p0, D)
        else:
            p0, prev = 0, None
        if p0 + n > cfg.max_tokens:
            raise InvalidInput(f"prompt of {p0 + n} tokens exceeds the model's "
                               f"max_tokens {cfg.max_tokens}")
        if int(tokens.min()) < 0 or int(tokens.max()) >= cfg.vocab:
            raise InvalidInput(f"token ids must lie in [0, {cfg.vocab})")
        x = self.embed(tokens)
        kv_out = torch.empty(cfg.layers, 2, H, n, D)
        mask = None
        if p0:  # query i sits at position p0 + i: it sees every cached key and its own past
            mask = torch.ones(n, p0 + n, dtype=torch.bool).tril_(diagonal=p0)
        for li, layer in enumerate(self.layers):
            h = layer.attn_norm(x)
            q, k, v = layer.qkv(h).view(n, 3, H, D).permute(1, 2, 0, 3)
            q, k = self._rope(q, p0), self._rope(k, p0)
            kv_out[li, 0] = k
            kv_out[li, 1] = v
            if prev is not None:
                k = torch.cat((prev[li, 0], k), dim=1)
                v = torch.cat((prev[li, 1], v), dim=1)
            # batched (4-D) inputs: torch's CPU flash-attention kernel takes them, masks
            # included; 3-D ones fall back to the slower math path (docs/routing.md)
            a = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask,
                                               is_causal=mask is None)[0]
            x = x + layer.o(a.transpose(0, 1).reshape(n, cfg.d_model))
            g, u = layer.gate_up(layer.mlp_norm(x)).chunk(2, dim=-1)
            x = x + layer.down(F.silu(g) * u)
        logits = self.lm_head(self.norm(x[-1]))
        return logits, kv_out


def split_blocks(kv: torch.Tensor, first_pos: int, block_tokens: int) -> list[torch.Tensor]:
    """The full blocks inside ``kv`` (a prefill's output for tokens at positions
    ``first_pos ..``; ``first_pos`` a multiple of ``block_tokens``) as contiguous block
    tensors, in order; a trailing partial block is left out."""
    if first_pos % block_tokens:
        raise InvalidInput(f"computed KV must start on a block boundary, not at token "
                           f"{first_pos} (blocks of {block_tokens})")
    n = kv.shape[3]
    return [kv[:, :, :, lo:lo + block_tokens].contiguous()
            for lo in range(0, n - block_tokens + 1, block_tokens)]
