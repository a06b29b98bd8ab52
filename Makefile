# Two commands on a fresh machine with only Python 3.10+: `make train` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# pytest-xdist workers: one per core, at most 4 (`make test WORKERS=0`: one process, without xdist);
# tests/conftest.py gives each worker its share of the cores for torch's threads. worksteal: a worker
# that runs out takes queued tests from the other, so a few long tests do not leave a core idle
WORKERS ?= $(shell $(PYTHON) -c "import os; print(min(4, len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count() or 1))")
XDIST = -n $(WORKERS) --dist worksteal

.DEFAULT_GOAL := help
.PHONY: help install train test test-slow test-all test-gpu gpu-wheels llama-server lint bench clean

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-12s %s\n", $$1, $$2}'

install: $(STAMP) ## build .venv: CPU torch pinned by constraints.txt, lm editable, dev + hf + gguf + eval + serve extras

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -c constraints.txt -e '.[dev,hf,gguf,eval,serve]'
	touch $(STAMP)

train: install ## train the default model (nano MHA, Muon) on the standard-library corpus
	$(PY) scripts/train.py

test: install ## the test suite, without tests marked slow (a few minutes on 2 cores)
	$(PY) -m pytest -m "not slow" -q $(XDIST) --durations=15

test-slow: install ## the slow tier: end-to-end script runs, studies, benchmarks, kill-and-resume, DDP
	$(PY) -m pytest -m slow -q $(XDIST) --durations=15

test-all: install ## every test, slow ones included (installs llama-cpp-python, which compiles llama.cpp)
	$(PY) -m pip install -q -c constraints.txt -e '.[llama]'
	$(PY) -m pytest -q $(XDIST)

test-gpu: install ## the gpu tier (tests marked gpu: bf16, fused SDPA, CUDA graphs, trainer=gpu, FSDP); needs CUDA
	$(PY) -c "import sys, torch; sys.exit(None if torch.cuda.is_available() else 'error: torch sees no CUDA device')"
	$(PY) -m pytest -m gpu -q --durations=15

# llama.cpp's own server, for `bench.py serve`: built from the llama.cpp sources inside the llama-cpp-python
# release the `llama` extra installs, so the server and the Python binding are one version of llama.cpp
LLAMA_SRC := .cache/llama-server
llama-server: $(VENV)/bin/llama-server ## build llama.cpp's server into .venv/bin (cmake and a C++ compiler; minutes)

$(VENV)/bin/llama-server: | $(STAMP)
	$(PY) -m pip install -q -c constraints.txt -e '.[llama]'
	rm -rf $(LLAMA_SRC) && mkdir -p $(LLAMA_SRC)
	$(PY) -m pip download -q -c constraints.txt --no-deps --no-binary llama-cpp-python -d $(LLAMA_SRC) \
	  "llama-cpp-python==$$($(PY) -c "import importlib.metadata as m; print(m.version('llama-cpp-python'))")"
	tar xzf $(LLAMA_SRC)/llama_cpp_python-*.tar.gz -C $(LLAMA_SRC)
	cmake -S $(LLAMA_SRC)/llama_cpp_python-*/vendor/llama.cpp -B $(LLAMA_SRC)/build -DCMAKE_BUILD_TYPE=Release \
	  -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
	  -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON
	cmake --build $(LLAMA_SRC)/build --target llama-server -j $$(getconf _NPROCESSORS_ONLN)
	cp $(LLAMA_SRC)/build/bin/llama-server $@

gpu-wheels: ## .whl/: what a GPU machine with its own torch and no index lacks (gpu/wheels.txt), for `bash gpu/run`
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: -d .whl -r gpu/wheels.txt
	$(PYTHON) -m pip wheel -q --no-deps -w .whl antlr4-python3-runtime==4.9.3  # pure Python, source only

lint: install ## ruff
	$(VENV)/bin/ruff check lm scripts tests benchmarks

bench: install ## training and decoding against transformers' Llama, attention kinds against N
	$(PY) scripts/bench.py train
	$(PY) scripts/bench.py attention
	$(PY) scripts/bench.py generate

clean: ## remove the venv and caches (checkpoints are kept)
	rm -rf $(VENV) .cache .pytest_cache outputs multirun
