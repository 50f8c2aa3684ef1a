"""A version's files: a model folder's non-tensor files (config, tokenizer, chat
template) imported beside its tensors, versioned with them, shown by ``snap.files()``,
exported and checked out byte-identical, never shown as tensors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import tensordb
from tensordb.client._model_files import FILES_ROW, file_bytes, pack_files, read_index
from tensordb.errors import CorruptData, InvalidInput, NotFound

safetensors_torch = pytest.importorskip("safetensors.torch")

FILES = {
    "config.json": b'{"architectures": ["LlamaForCausalLM"], "hidden_size": 64}\n',
    "generation_config.json": b'{"max_new_tokens": 8}\n',
    "tokenizer.json": json.dumps({"version": "1.0", "model": {"vocab": {"a": 0}}}).encode(),
    "tokenizer_config.json": b'{"chat_template": "{{ messages }}"}',
    "chat_template.jinja": "{% for m in messages %}{{ m['content'] }} \u2603{% endfor %}"
                           .encode(),
    "README.md": b"# a tiny model\n",
}


def _folder(dst: Path, files: dict[str, bytes] = FILES) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    safetensors_torch.save_file({"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(3)},
                                str(dst / "model.safetensors"), metadata={"format": "pt"})
    for n, data in files.items():
        (dst / n).write_bytes(data)
    return dst


def test_a_folder_import_keeps_its_files_beside_the_tensors_and_exports_them(
        db: tensordb.Database, tmp_path: Path) -> None:
    folder = _folder(tmp_path / "m")
    c = db.import_safetensors("m", folder)
    with db.snapshot("m") as snap:
        assert sorted(snap) == ["b", "w"] and len(snap) == 2  # the files are no tensor
        assert FILES_ROW not in snap and sorted(snap.state_dict()) == ["b", "w"]
        assert sorted(snap.info()) == ["b", "w"]
        assert snap.nbytes == 9 * 4
        assert snap.files() == {n: len(b) for n, b in FILES.items()}
        for n, b in FILES.items():
            assert snap.file(n) == b
        with pytest.raises(NotFound, match="tokenizer.model"):
            snap.file("tokenizer.model")
        with pytest.raises(NotFound):
            snap[FILES_ROW]
    assert c.tensors == 3  # the commit counts the version's rows: the files' one too
    out = db.export_safetensors("m", tmp_path / "out")
    assert sorted(p.name for p in out) == sorted(["model.safetensors", *FILES])
    for p in (tmp_path / "m").iterdir():
        assert (tmp_path / "out" / p.name).read_bytes() == p.read_bytes(), p.name
    # a later commit of tensors keeps the files; a new import replaces them
    db.commit("m", {"extra": torch.zeros(2)})
    with db.snapshot("m") as snap:
        assert snap.version == 2 and snap.file("config.json") == FILES["config.json"]
    changed = {**FILES, "config.json": b'{"hidden_size": 128}'}
    del changed["README.md"]
    (folder / "README.md").unlink()
    (folder / "config.json").write_bytes(changed["config.json"])
    db.import_safetensors("m", folder)
    with db.snapshot("m") as snap:
        assert snap.files() == {n: len(b) for n, b in changed.items()}
        assert snap.file("config.json") == changed["config.json"]
    with db.snapshot("m", version=1) as snap:  # versioned with the tensors
        assert snap.file("config.json") == FILES["config.json"]
    # a single file import holds exactly that file's tensors, and no files
    db.import_safetensors("m", folder / "model.safetensors")
    with db.snapshot("m") as snap:
        assert snap.files() == {} and sorted(snap) == ["b", "w"]


def test_files_in_a_transaction_are_checked_and_a_refusal_changes_nothing(
        db: tensordb.Database) -> None:
    db.commit("t", {"x": torch.ones(2)})
    before = db.history("t")
    for bad, why in (({"a/b.json": b"{}"}, "plain file name"),
                     ({".hidden": b""}, "plain file name"),
                     ({"model.safetensors": b""}, "weight file"),
                     ({"config.json": "text"}, "bytes"),
                     ("config.json", "mapping")):
        with pytest.raises(InvalidInput, match=why):
            with db.transaction("t") as tx:
                tx.put("y", torch.zeros(1))
                tx.put_files(bad)  # type: ignore[arg-type]
    assert db.history("t") == before
    with db.snapshot("t") as snap:
        assert sorted(snap) == ["x"] and snap.files() == {}
    with db.transaction("t") as tx:
        tx.put_files({"config.json": b"{}", "empty.txt": b""})
    with db.snapshot("t") as snap:
        assert snap.files() == {"config.json": 2, "empty.txt": 0}
        assert snap.file("empty.txt") == b""
    with db.transaction("t") as tx:
        tx.put_files({})
    with db.snapshot("t") as snap:
        assert snap.files() == {} and sorted(snap) == ["x"]


def test_a_damaged_pack_is_corrupt_data_never_other_bytes() -> None:
    pack = pack_files({"a.json": b"{}", "b.txt": b"hello"})
    start, entries = read_index(pack, "t")
    assert file_bytes(pack, "b.txt", "t") == b"hello"
    bad = pack.copy()
    bad[start + entries["b.txt"].offset] ^= 0xFF
    with pytest.raises(CorruptData, match="checksum"):
        file_bytes(bad, "b.txt", "t")
    assert file_bytes(bad, "a.json", "t") == b"{}"  # the others stay readable
    for damage in (lambda p: p[:4], lambda p: np.concatenate([np.full(8, 0xFF, np.uint8),
                                                              p[8:]]),
                   lambda p: np.concatenate([p[:8], np.full(p.shape[0] - 8, 0x7B, np.uint8)])):
        with pytest.raises(CorruptData):
            read_index(damage(pack), "t")


def test_checkout_writes_the_files_and_a_marker_an_engine_loader_reads(
        db: tensordb.Database, tmp_path: Path) -> None:
    db.import_safetensors("m", _folder(tmp_path / "m"))
    db.tag("m", "prod")
    db.commit("m", {"x": torch.ones(1)})
    out = db.checkout("m", tmp_path / "co", tag="prod")
    assert out == tmp_path / "co"
    for n, b in FILES.items():
        assert (out / n).read_bytes() == b
    marker = json.loads((out / "tensordb.json").read_text())
    assert marker["collection"] == "m" and marker["version"] == 1
    assert not list(out.glob("*.safetensors"))  # no weight file: they stay in the store
    from engine_bindings._engines import LoadSource
    src = LoadSource.from_folder(out, what="test")
    assert (src.collection, src.version) == ("m", 1)
    with pytest.raises(NotFound):
        db.checkout("nope", tmp_path / "co2")
    assert not (tmp_path / "co2").exists()


def test_the_cli_checks_out_a_folder(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from tensordb import cli

    home = tmp_path / "store"
    env = {"COLUMNS": "200", "TENSORDB_HOME": None}
    r = CliRunner(env=env).invoke(cli.app, ["--home", str(home), "import", "m",
                                            str(_folder(tmp_path / "m"))])
    assert r.exit_code == 0, r.output
    r = CliRunner(env=env).invoke(cli.app, ["--home", str(home), "checkout", "m",
                                            str(tmp_path / "co")])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "co" / "config.json").read_bytes() == FILES["config.json"]
    assert json.loads((tmp_path / "co" / "tensordb.json").read_text())["version"] == 1
