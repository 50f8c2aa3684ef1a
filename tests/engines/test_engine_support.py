"""The engine tests' skip guard, in the default run (no engine installed): only the
engine, missing or failing its own import, makes a skip; an error raised by our own
binding (``engine_bindings.vllm`` / ``engine_bindings.sglang``) propagates, so the tests
fail instead of reporting "skipped"."""

from __future__ import annotations

import importlib
import importlib.util
import types
from collections.abc import Callable

import pytest

from . import engine_support

ENGINES = ("vllm", "sglang")


def _fake_imports(monkeypatch: pytest.MonkeyPatch, *, installed: bool,
                  failing: dict[str, BaseException]) -> list[str]:
    """Stand the engines in: ``installed`` says whether their package is found, an
    import of a name in ``failing`` raises that; the names imported, in order."""
    real_find, real_import = importlib.util.find_spec, importlib.import_module
    imported: list[str] = []

    def find_spec(name: str, *args: object) -> object:
        if name in ENGINES:
            return object() if installed else None
        return real_find(name, *args)  # type: ignore[arg-type]

    def import_module(name: str, package: str | None = None) -> types.ModuleType:
        imported.append(name)
        if name in failing:
            raise failing[name]
        if name.split(".")[0] in ENGINES or name in {f"engine_bindings.{e}" for e in ENGINES}:
            return types.ModuleType(name)
        return real_import(name, package)

    monkeypatch.setattr(engine_support, "_reasons", {})
    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    monkeypatch.setattr(importlib, "import_module", import_module)
    return imported


@pytest.mark.parametrize("engine", ENGINES)
def test_a_missing_engine_is_a_skip(monkeypatch: pytest.MonkeyPatch, engine: str) -> None:
    imported = _fake_imports(monkeypatch, installed=False, failing={})
    reason = engine_support.why_not(engine)
    assert reason is not None and "is not installed" in reason
    assert imported == []


@pytest.mark.parametrize("engine", ENGINES)
def test_an_engine_failing_its_own_import_is_a_skip(monkeypatch: pytest.MonkeyPatch,
                                                   engine: str) -> None:
    first = engine_support._ENGINES[engine][1][0]
    imported = _fake_imports(monkeypatch, installed=True,
                             failing={first: ImportError("libtorch mismatch")})
    reason = engine_support.why_not(engine)
    assert reason is not None and "does not import here" in reason
    assert "libtorch mismatch" in reason
    assert f"engine_bindings.{engine}" not in imported  # ours is not blamed on the engine


ERRORS: dict[str, Callable[[str], BaseException]] = {
    "NameError": lambda e: NameError("name 'KVConnectorBase' is not defined"),
    "ImportError": lambda e: ImportError(
        f"cannot import name 'missing' from 'engine_bindings._{e}_parts'",
        name=f"engine_bindings._{e}_parts"),
}


@pytest.mark.parametrize("error", list(ERRORS))
@pytest.mark.parametrize("engine", ENGINES)
def test_an_error_in_our_binding_fails_instead_of_skipping(
        monkeypatch: pytest.MonkeyPatch, engine: str, error: str) -> None:
    exc = ERRORS[error](engine)
    _fake_imports(monkeypatch, installed=True, failing={f"engine_bindings.{engine}": exc})
    for _ in range(2):  # every test that asks fails: the error is not cached as a reason
        with pytest.raises(type(exc)) as info:
            engine_support.why_not(engine)
        assert info.value is exc


@pytest.mark.parametrize("engine", ENGINES)
def test_an_engine_and_binding_that_import_run(monkeypatch: pytest.MonkeyPatch,
                                               engine: str) -> None:
    imported = _fake_imports(monkeypatch, installed=True, failing={})
    assert engine_support.why_not(engine) is None
    assert imported == [*engine_support._ENGINES[engine][1], f"engine_bindings.{engine}"]
