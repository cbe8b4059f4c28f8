# Fresh machine: `make run` (the default example end to end) and `make test` (the suite).
# Each creates .venv if missing, installs torch 2.13.0 (CPU) first, then proxima.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: install install-dev run test test-quick test-dist lint bench clean

$(PY):
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip

install: $(PY)
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e .

install-dev: $(PY)
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[dev]"

run: install
	$(VENV)/bin/proxima train

# The whole suite: unit, component and end-to-end tiers (pytest skips `slow` unless asked).
test: install-dev
	$(VENV)/bin/ruff check proxima tests benchmarks
	$(PY) -m pytest -m "slow or not slow" -p no:cacheprovider

test-quick: install-dev
	$(PY) -m pytest

# torchrun with 2 processes (gloo); part of `make test` too
test-dist: install-dev
	$(PY) -m pytest -m dist -p no:cacheprovider tests/distributed

lint: install-dev
	$(VENV)/bin/ruff check proxima tests benchmarks
	$(VENV)/bin/ruff format --check proxima tests benchmarks

bench: install-dev
	$(PY) benchmarks/bench_generation.py

clean:
	rm -rf $(VENV) runs .pytest_cache
