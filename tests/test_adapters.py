"""LoRA adapters as collections (``engine_bindings.adapter_folder``), without an engine:
the checks an engine's resolver makes (base, rank) and the cached folder it maps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import tensordb
from engine_bindings import adapter_folder
from tensordb.errors import InvalidInput, NotFound

safetensors_torch = pytest.importorskip("safetensors.torch")


def _adapter(dst: Path, *, base: str, rank: int = 8) -> Path:
    """A PEFT LoRA folder as peft writes one: the config and the A/B matrices."""
    dst.mkdir(parents=True)
    p = "base_model.model.model.layers.0.self_attn.q_proj."
    safetensors_torch.save_file({p + "lora_A.weight": torch.randn(rank, 16),
                                 p + "lora_B.weight": torch.randn(16, rank)},
                                str(dst / "adapter_model.safetensors"))
    (dst / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": ["q_proj"],
        "base_model_name_or_path": base, "task_type": "CAUSAL_LM", "bias": "none"}))
    return dst


def test_an_adapter_folder_is_checked_cached_and_byte_identical(
        sqlite_db: tensordb.Database, tmp_path: Path) -> None:
    db = sqlite_db
    src = _adapter(tmp_path / "a", base="llama")
    db.import_safetensors("a", src)
    db.import_safetensors("other", _adapter(tmp_path / "o", base="mistral"))
    db.import_safetensors("wide", _adapter(tmp_path / "w", base="llama", rank=64))
    db.commit("plain", {"x": torch.ones(1)})
    cache = tmp_path / "cache"
    folder, v = adapter_folder(db, "a", base="llama", max_lora_rank=16, cache_dir=cache)
    assert v == 1 and sorted(p.name for p in folder.iterdir()) == sorted(
        p.name for p in src.iterdir())
    for p in src.iterdir():
        assert (folder / p.name).read_bytes() == p.read_bytes(), p.name
    ino = folder.stat().st_ino
    again, _ = adapter_folder(db, "a", base="llama", max_lora_rank=16, cache_dir=cache)
    assert again == folder and folder.stat().st_ino == ino  # not written again
    with pytest.raises(InvalidInput, match="'mistral'.*'llama'"):
        adapter_folder(db, "other", base="llama", max_lora_rank=16, cache_dir=cache)
    with pytest.raises(InvalidInput, match="rank 64.*max_lora_rank 16"):
        adapter_folder(db, "wide", base="llama", max_lora_rank=16, cache_dir=cache)
    with pytest.raises(InvalidInput, match="no LoRA adapter"):
        adapter_folder(db, "plain", base="llama", max_lora_rank=16, cache_dir=cache)
    with pytest.raises(NotFound):
        adapter_folder(db, "none", base="llama", max_lora_rank=16, cache_dir=cache)
    assert [p.name for p in cache.iterdir()] == [folder.name]  # nothing half-written left
