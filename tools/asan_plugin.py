"""pytest plugin of the sanitizer build (tools/asan.py): loads the instrumented C
extension named by $TENSORDB_ASAN_LIB as ``storage_engine._stream`` (and
$TENSORDB_ASAN_WIRE_LIB as ``tensordb.client._kv_wire``) before anything imports them,
so every native call of the run goes through it."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys


def _load(name: str, lib: str) -> None:
    loader = importlib.machinery.ExtensionFileLoader(name, lib)
    spec = importlib.util.spec_from_file_location(name, lib, loader=loader)
    assert spec is not None
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    sys.modules[name] = mod


_lib = os.environ.get("TENSORDB_ASAN_LIB")
if _lib:
    _load("storage_engine._stream", _lib)
if os.environ.get("TENSORDB_ASAN_WIRE_LIB"):
    _load("tensordb.client._kv_wire", os.environ["TENSORDB_ASAN_WIRE_LIB"])

def pytest_report_header() -> str:
    import storage_engine._stream as ext

    return f"native extension: {ext.__file__} (sanitizer build: {_lib is not None})"
