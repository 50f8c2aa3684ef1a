# Set-up on a fresh machine is part of both targets: a venv, torch's CPU build first
# (pinned, from local disk where it lies there), then the project.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
LINT_STAMP := $(VENV)/.lint-installed

.PHONY: run test lint mutate clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml storage_engine/_stream.c
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

# mutation testing of the modules that keep the promises (by hand, not in CI: every
# mutant takes hours on 2 cores; ARGS="--sample 10" about half an hour; tools/mutate.py
# --help for one module or a few mutants)
mutate: $(STAMP)
	$(BIN)/python tools/mutate.py $(ARGS)

clean:
	rm -rf $(VENV) .tensordb
