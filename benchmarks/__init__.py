"""The benchmarks: one script per job of the store, each run from the checkout's root as
``python -m benchmarks.NAME``, against the peers a user would pick instead;
``python -m benchmarks`` (``make bench``) runs them all at small sizes and sums up the
goals.

A package so that the scripts import their shared helpers by name (``from benchmarks
import _common, _verdict``), and so that harnesses the scripts share with the tests
import alike: ``benchmarks.toy_engine`` (the engine processes that calibrate the
routing simulator). Nothing in the library imports this package.
"""

from __future__ import annotations

import os
import sys

#: the checkout's root: the folder this package sits in
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def command(module: str, *args: str, python: str | None = None) -> list[str]:
    """The command line that runs ``module`` (``"benchmarks.kv"``) as a script in a child
    process: ``python -m`` by this interpreter (or ``python``), as every script here
    runs. A child started from the checkout's root, or with the parent's PYTHONPATH,
    finds the package as its parent did."""
    return [python or sys.executable, "-m", module, *args]


def child_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (else this process's environment) with the checkout's root first on
    PYTHONPATH, for a child whose working directory may lie elsewhere."""
    out = dict(os.environ if env is None else env)
    out["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, out.get("PYTHONPATH")) if p)
    return out
