# pasto: `make run` starts the controller with a live demo, `make test` runs the whole suite.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   ?= .venv
BIN    := $(VENV)/bin
PYTEST_ARGS ?=
# Worker processes of `make test` (pytest-xdist); tests sharing an expensive fixture stay in one worker
# (tests/conftest.py). More workers than cores: much of the suite waits on live servers, subprocesses
# and real-time rounds, and a waiting worker leaves its core to another one.
# `make test PYTEST_WORKERS=0` runs the suite in this one process.
PYTEST_WORKERS ?= 6
# `make run PORT=8001` when 8000 is taken.
PORT   ?= 8000

.PHONY: run test install install-test bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# The service needs the `service` extra; a bare `pip install .` is the core and the client only (README).
$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install --quiet -e '.[service]'
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(BIN)/python -m pip install --quiet -e '.[service,warehouse,test]'
	touch $@

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

# PASTO_DEMO_COMMAND: the demo's stop message says to run this again to resume.
run: install
	PASTO_DEMO_COMMAND="make run$(if $(filter-out 8000,$(PORT)), PORT=$(PORT))" $(BIN)/pasto demo --port $(PORT)

# PYTHONDONTWRITEBYTECODE is emptied for the suite: each worker, server and CLI subprocess then loads the
# compiled (and, for test modules, pytest's assertion-rewritten) modules instead of compiling them again.
# The collection pass before the run writes them once (about half of each worker's collection time);
# without it the workers, starting together, would all rewrite every test module themselves. A collection
# error is reported by the run itself.
test: install-test
	PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest --collect-only -qq $(PYTEST_ARGS) >/dev/null || true
	PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist loadgroup $(PYTEST_ARGS)

bench: install
	$(BIN)/python -m pip install --quiet -e '.[service,warehouse,bench]'
	$(BIN)/python bench/convergence.py
	$(BIN)/python bench/client.py --write-docs
	$(BIN)/python bench/serve.py --write-docs
	$(BIN)/python bench/scale.py --write-docs

clean:
	rm -rf $(VENV) instance .pytest_cache test-output
