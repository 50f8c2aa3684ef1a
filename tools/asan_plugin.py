"""pytest plugin of the sanitizer build (tools/asan.py): loads the instrumented C
extension named by $TENSORDB_ASAN_LIB as ``storage_engine._stream`` before anything
imports storage_engine, so every native call of the run goes through it."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys

_lib = os.environ.get("TENSORDB_ASAN_LIB")
if _lib:
    _loader = importlib.machinery.ExtensionFileLoader("storage_engine._stream", _lib)
    _spec = importlib.util.spec_from_file_location("storage_engine._stream", _lib,
                                                   loader=_loader)
    assert _spec is not None
    _mod = importlib.util.module_from_spec(_spec)
    _loader.exec_module(_mod)
    sys.modules["storage_engine._stream"] = _mod


def pytest_report_header() -> str:
    import storage_engine._stream as ext

    return f"native extension: {ext.__file__} (sanitizer build: {_lib is not None})"
