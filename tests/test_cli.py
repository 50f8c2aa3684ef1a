"""The ``tensordb`` command line, run against temporary stores."""

from __future__ import annotations

import re
import shutil
import sqlite3
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from conftest import flip_byte
from typer.testing import CliRunner, Result

import tensordb
from tensordb import cli
from tensordb.catalog import HEAD_REVISION, NodeDirectory
from tensordb.config import Config

# rich must not think it writes to a terminal, nor wrap the tables it prints
ENV = {"COLUMNS": "200", "TENSORDB_HOME": None, "FORCE_COLOR": None, "TTY_COMPATIBLE": None,
       "TTY_INTERACTIVE": None}


def invoke(home: Path, *args: str) -> Result:
    return CliRunner(env=ENV).invoke(cli.app, ["--home", str(home), *args])


def shm_of(home: Path, url: str | None = None, data_dir: Path | None = None) -> Path:
    return Config.resolve(url, home=home, data_dir=data_dir).shm_dir


@pytest.fixture
def store(home: Path) -> Path:
    """A store with 'llama' (2 versions) and 'qwen' (1 version)."""
    with tensordb.connect(home=home) as db:
        db.commit("llama", {"embed.weight": torch.randn(16, 8),
                            "lm_head.bias": torch.zeros(16, dtype=torch.bfloat16),
                            "step": torch.tensor(3)}, message="first [bold]one[/bold]")
        db.commit("llama", {"embed.weight": torch.randn(16, 8)}, message="second")
        db.commit("qwen", {"w": torch.ones(4, 4)}, message="only")
    return home


def rows(text: str) -> list[list[str]]:
    """The cells of a printed table, split on runs of 2+ spaces."""
    return [re.split(r"\s{2,}", line.strip()) for line in text.splitlines() if line.strip()]


def test_ls(store: Path) -> None:
    r = invoke(store, "ls")
    assert r.exit_code == 0, r.output
    table = rows(r.stdout)
    assert table[0][:5] == ["collection", "head", "tensors", "size", "versions"]
    assert ["llama", "2", "3", "552 B", "2"] in table
    assert ["qwen", "1", "1", "64 B", "1"] in table


def test_ls_empty_store(home: Path) -> None:
    r = invoke(home, "ls")
    assert r.exit_code == 0, r.output
    assert "no collections" in r.stdout


def test_log_is_newest_first(store: Path) -> None:
    r = invoke(store, "log", "llama")
    assert r.exit_code == 0, r.output
    table = rows(r.stdout)
    assert table[0][:3] == ["version", "created", "message"]
    body = [row for row in table[1:] if row[0].isdigit()]
    assert [row[0] for row in body] == ["2", "1"]
    assert body[0][2:] == ["second", "3", "552 B", "1 / 512 B"]
    # a message is printed as written, not read as rich markup
    assert body[1][2:] == ["first [bold]one[/bold]", "3", "552 B", "3 / 552 B"]


def test_show_head_version_and_tag(store: Path) -> None:
    r = invoke(store, "show", "llama")
    assert r.exit_code == 0, r.output
    assert "llama v2: 3 tensors, 552 B" in r.stdout
    table = rows(r.stdout)
    assert ["embed.weight", "float32", "(16, 8)", "512"] in table
    assert ["lm_head.bias", "bfloat16", "(16,)", "32"] in table
    assert ["step", "int64", "()", "8"] in table

    assert "llama v1:" in invoke(store, "show", "llama", "--version", "1").stdout
    assert invoke(store, "tag", "llama", "ckpt", "--version", "1").exit_code == 0
    assert "llama v1:" in invoke(store, "show", "llama", "--tag", "ckpt").stdout


def test_show_bad_references(store: Path) -> None:
    r = invoke(store, "show", "llama", "--version", "9")
    assert r.exit_code == 2
    assert r.stderr.strip() == "error: no version 9 of collection 'llama'"
    r = invoke(store, "show", "llama", "--version", "1", "--tag", "x")
    assert r.exit_code == 2
    assert "error: give a version or a tag, not both" in r.stderr
    for v in ("1000000000000000000000000000000", "9223372036854775808", "0", "-3"):
        r = invoke(store, "show", "llama", "--version", v)
        assert r.exit_code == 2, (v, r.output)
        assert r.stderr.strip() == f"error: version must be between 1 and 2**63-1, not {v}"
        assert "Traceback" not in r.output


def test_tag_and_delete(store: Path) -> None:
    r = invoke(store, "tag", "llama", "ckpt-1", "--version", "1")
    assert r.exit_code == 0, r.output
    assert "tagged llama v1 as 'ckpt-1'" in r.stdout
    r = invoke(store, "tag", "llama", "latest")
    assert "tagged llama v2 as 'latest'" in r.stdout
    with tensordb.connect(home=store) as db:
        assert db.tags("llama") == {"ckpt-1": 1, "latest": 2}
    log = rows(invoke(store, "log", "llama").stdout)
    assert log[0][-1] == "tags"
    assert [row[-1] for row in log[1:] if row[0].isdigit()] == ["latest", "ckpt-1"]

    r = invoke(store, "tag", "llama", "ckpt-1", "--delete")
    assert r.exit_code == 0, r.output
    assert "deleted tag 'ckpt-1'" in r.stdout
    r = invoke(store, "tag", "llama", "ckpt-1", "--delete")
    assert r.exit_code == 2
    assert r.stderr.startswith("error: no tag 'ckpt-1'")
    with tensordb.connect(home=store) as db:
        assert db.tags("llama") == {"latest": 2}


def test_tag_delete_takes_no_version(store: Path) -> None:
    r = invoke(store, "tag", "llama", "x", "--delete", "--version", "1")
    assert r.exit_code == 2
    assert "--delete takes no --version" in r.output


def test_unknown_collection(store: Path) -> None:
    for args in (["log", "nope"], ["show", "nope"], ["tag", "nope", "t"]):
        r = invoke(store, *args)
        assert r.exit_code == 2, (args, r.output)
        assert r.stderr == "error: no collection 'nope'\n"
        assert r.stdout == ""
        assert not isinstance(r.exception, tensordb.errors.TensorDBError)


def test_invalid_name_is_an_error_line(store: Path) -> None:
    r = invoke(store, "log", "bad name/..")
    assert r.exit_code == 2
    assert r.stderr.startswith("error: ") and len(r.stderr.splitlines()) == 1


def test_gc_reports_what_it_freed(store: Path) -> None:
    r = invoke(store, "gc")
    assert r.exit_code == 0, r.output
    assert re.search(r"segments deleted\s+0\n", r.stdout)
    with tensordb.connect(home=store) as db:
        db.drop("qwen")
    r = invoke(store, "gc")
    assert r.exit_code == 0, r.output
    assert re.search(r"segments deleted\s+1\n", r.stdout)
    assert re.search(r"bytes freed\s+64 B\n", r.stdout)
    assert "qwen" not in invoke(store, "ls").stdout


def test_verify_ok_then_corrupt(store: Path) -> None:
    r = invoke(store, "verify")
    assert r.exit_code == 0, r.output
    assert "no problems" in r.stdout

    with tensordb.connect(home=store) as db:
        shm = db.config.shm_dir
        (c1,) = [c for c in db.history("qwen")]
    segs = sorted(shm.glob("*.seg"))
    assert len(segs) == 3
    # qwen's segment is the one holding 64 bytes; its first byte is w's first byte
    seg = next(s for s in segs if s.stat().st_size == c1.nbytes)
    flip_byte(seg, 0)
    r = invoke(store, "verify")
    assert r.exit_code == 1, r.output
    assert "1 problem(s)" in r.stdout
    (bad,) = [row for row in rows(r.stdout) if row[0] == "qwen"]
    assert bad[1:3] == ["1", "w"]
    assert bad[-1].startswith("checksum")
    assert "fail their check" in r.stderr


def test_db_upgrade(home: Path) -> None:
    r = invoke(home, "db", "upgrade")
    assert r.exit_code == 0, r.output
    assert f"revision none (empty catalog) -> {HEAD_REVISION}" in r.stdout
    r = invoke(home, "db", "upgrade")
    assert r.exit_code == 0, r.output
    assert f"revision {HEAD_REVISION}: already current" in r.stdout


def test_db_upgrade_refuses_a_newer_catalog(store: Path) -> None:
    con = sqlite3.connect(store / "catalog.db")
    with con:
        con.execute("UPDATE alembic_version SET version_num = '9999'")
    con.close()
    for args in (["db", "upgrade"], ["ls"]):
        r = invoke(store, *args)
        assert r.exit_code == 2, r.output
        assert r.stderr.startswith("error: the catalog is at schema revision '9999'")


def test_catalog_data_dir_and_node_options(tmp_path: Path) -> None:
    home, url = tmp_path / "h", f"sqlite:///{tmp_path / 'elsewhere.db'}"
    data = tmp_path / "disk"
    try:
        with tensordb.connect(url, home=home, data_dir=data) as db:
            db.commit("m", {"a": torch.ones(3)})
        base = ["--catalog", url, "--data-dir", str(data)]
        r = invoke(home, *base, "ls")
        assert r.exit_code == 0, r.output
        assert ["m", "1", "1", "12 B", "1"] in rows(r.stdout)
        assert not (home / "catalog.db").exists()
        assert "no collections" in invoke(home, "ls").stdout  # the default catalog
        assert "ok: 1 segments" in invoke(home, *base, "verify").stdout
        # another node's view of the same catalog holds none of this node's bytes
        r = invoke(home, *base, "--node", "other", "verify")
        assert r.exit_code == 0 and "ok: 0 segments" in r.stdout
    finally:
        shutil.rmtree(shm_of(home, url, data), ignore_errors=True)
        shutil.rmtree(shm_of(home, url, None), ignore_errors=True)
        shutil.rmtree(shm_of(home), ignore_errors=True)


def test_bad_catalog_url(home: Path) -> None:
    r = invoke(home, "--catalog", "nosuchdb://x/y", "ls")
    assert r.exit_code == 2
    assert r.stderr.startswith("error: cannot use catalog URL 'nosuchdb://x/y'")


def test_main_turns_errors_into_exit_2(store: Path, capsys: pytest.CaptureFixture[str],
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["--home", str(store), "log", "nope"])
    assert exc.value.code == 2
    assert capsys.readouterr().err == "error: no collection 'nope'\n"

    def boom(**kw: object) -> None:  # an error outside any command
        raise tensordb.errors.StoreClosed("the store is closed")

    monkeypatch.setattr(cli, "app", boom)
    with pytest.raises(SystemExit) as exc:
        cli.main([])
    assert exc.value.code == 2
    assert capsys.readouterr().err == "error: the store is closed\n"


def test_console_script_process(store: Path) -> None:
    """As a user runs it: one red line, no traceback, exit status 2."""
    env = {"PATH": "/usr/bin:/bin", "COLUMNS": "200"}
    p = subprocess.run([sys.executable, "-m", "tensordb.cli", "--home", str(store),
                        "show", "nope"], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 2
    assert p.stderr == "error: no collection 'nope'\n"
    p = subprocess.run([sys.executable, "-m", "tensordb.cli", "--home", str(store), "ls"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "llama" in p.stdout


def test_demo_end_to_end(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[str] = []
    real = tempfile.mkdtemp

    def spy(*args: object, **kw: object) -> str:
        path = real(*args, **kw)  # type: ignore[arg-type]
        made.append(path)
        return path

    monkeypatch.setattr(tempfile, "mkdtemp", spy)
    try:
        r = CliRunner(env=ENV).invoke(cli.app, ["demo"])
        assert r.exit_code == 0, r.output
        out = r.stdout
        assert "219 of 219 tensors' data pointers lie inside" in out
        assert "match what was committed: yes" in out
        assert "the store never saw the write" in out
        assert "wrote 1 tensor" in out and "shares the other 218" in out
        assert "history of demo-llm" in out and "GB/s" in out
        hist = [row for row in rows(out) if row[0] in ("1", "2")]
        assert [row[0] for row in hist] == ["2", "1"]
        assert len(made) == 1
        demo_home = Path(made[0])
        assert not demo_home.exists()
        assert not shm_of(demo_home).exists()
    finally:
        for path in made:
            shutil.rmtree(path, ignore_errors=True)
            shutil.rmtree(shm_of(Path(path)), ignore_errors=True)


def test_policies_run_and_log(store: Path) -> None:
    r = invoke(store, "query", "CREATE POLICY tick EVERY '200 milliseconds' "
                               "DO SELECT count(*) AS n FROM collections")
    assert r.exit_code == 0, r.output
    r = invoke(store, "policies", "run", "--duration", "1.2")
    assert r.exit_code == 0, r.output
    r = invoke(store, "policies", "log", "tick")
    assert r.exit_code == 0, r.output
    runs = [row for row in rows(r.output) if row and row[0] == "tick"]
    assert runs and all("ok" in row for row in runs)
    assert invoke(store, "policies", "log", "--limit", "x").exit_code == 2


def test_import_export_roundtrip(home: Path, tmp_path: Path) -> None:
    from safetensors.torch import save_file

    src = tmp_path / "m.safetensors"
    save_file({"a": torch.randn(3, 4), "b": torch.arange(5)}, str(src), metadata={"k": "v"})
    r = invoke(home, "import", "m", str(src), "-m", "first")
    assert r.exit_code == 0, r.output
    assert "m version 1: 2 tensors" in r.output
    r = invoke(home, "export", "m", str(tmp_path / "out"))
    assert r.exit_code == 0, r.output
    (out,) = list((tmp_path / "out").glob("*.safetensors"))
    assert out.read_bytes() == src.read_bytes()
    r = invoke(home, "import", "m2", str(tmp_path / "missing.safetensors"))
    assert r.exit_code == 2 and "error:" in r.output


def test_serve_refuses_a_weak_empty_or_doubled_token(home: Path, tmp_path: Path) -> None:
    """The token's checks run before the node listens or registers: exit 2, one line
    naming the problem, never the token, and no node in the catalog."""
    empty = tmp_path / "empty-token"
    empty.write_text("\n")
    strong = tmp_path / "token"
    strong.write_text("a-strong-enough-token\n")
    cases = {("--token", "weak-token"): "too weak",
             ("--token", " " * 20): "no whitespace at either end",
             ("--token-file", str(empty)): "is empty",
             ("--token-file", str(tmp_path / "absent")): "cannot read the token file",
             ("--token", "a-strong-enough-token", "--token-file", str(strong)): "not both"}
    for args, says in cases.items():
        result = invoke(home, "serve", "--port", "0", *args)
        assert result.exit_code == 2, (args, result.output)
        assert says in result.output and "Traceback" not in result.output, args
        assert "weak-token" not in result.output  # the token is never echoed
        assert "a-strong-enough-token" not in result.output
    with tensordb.connect(home=home) as db:
        assert NodeDirectory(db.catalog.engine).nodes() == {}
