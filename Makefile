# Two commands for a fresh machine (Python 3.11 only needed):
#   make demo   - installs into .venv, runs the main job (train on 4 ranks, resume on 2, prove bit-identity)
#   make test   - installs into .venv, runs lint (ruff, mypy) and the whole test suite (the CI gate)
#   make test-fast - the unit tier only (tests/unit: no processes, no slow tests), for every edit
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin

.PHONY: setup demo test test-fast lint bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# the CPU build of torch (a local wheel here); installed first so nothing pulls a CUDA build
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[test]'
	# torchtitan's integration test: without its deps (they would downgrade huggingface_hub and
	# fsspec under the test extra's transformers); only what its checkpointer/model/optimizer need
	$(BIN)/python -m pip install -q --no-deps 'torchtitan==0.3.0' 'spmd_types==0.2.3' tyro==1.0.17 docstring_parser==0.18.0 typeguard==4.6.1 einops==0.8.2 triton==3.9.0
	touch $@

demo: setup
	$(BIN)/unickpt demo

test: setup lint
	$(BIN)/python -m pytest -q --durations=30

# tiers: tests/tiers.py (markers distributed and slow; tests/unit starts no process)
test-fast: setup
	$(BIN)/python -m pytest -q tests/unit -m "not distributed and not slow"

lint: setup
	$(BIN)/ruff check src tests bench
	$(BIN)/ruff format --check src tests bench
	$(BIN)/mypy

bench: setup
	$(BIN)/python bench/save_load.py
	$(BIN)/python bench/async_stall.py

clean:
	rm -rf $(VENV) demo_out bench_out .pytest_cache
