# Two commands for a fresh machine (Python 3.11 only needed):
#   make demo   - installs torch and unickpt into .venv, runs the main job (train on 4 ranks, resume on 2, prove bit-identity)
#   make test   - installs everything the tests need into .venv, runs lint (ruff, mypy) and the whole test suite (the CI gate)
#   make test-fast - the unit tier only (tests/unit: no processes, no slow tests), for every edit
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin

.PHONY: setup setup-demo demo test test-fast lint bench bench-deps bench-three-way clean

# Two set-ups into the same .venv, each with its stamp: the demo's (torch + the package) and the
# test suite's (everything: the test extras, megatron-core, transformers, SeaweedFS, torchtitan),
# a superset built on top of the demo's.
setup-demo: $(VENV)/.installed-demo
setup: $(VENV)/.installed $(VENV)/azurite/.installed

# Azurite, Azure Storage's emulator (tests/fixtures/azurite.py starts it), from the npm registry (node >= 18)
$(VENV)/azurite/.installed: $(VENV)/.installed-demo
	mkdir -p $(VENV)/azurite
	cd $(VENV)/azurite && npm install --no-audit --no-fund --silent azurite@3.37.0
	touch $@

$(VENV)/.installed-demo: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# the CPU build of torch (a local wheel here); installed first so nothing pulls a CUDA build
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e .
	touch $@

$(VENV)/.installed: $(VENV)/.installed-demo pyproject.toml
	# the bench extra: tests/integration/tools/test_bench_three_way_processes.py runs its peers too
	$(BIN)/python -m pip install -q -e '.[test,bench]'
	# torchtitan's integration test: without its deps (they would downgrade huggingface_hub and
	# fsspec under the test extra's transformers); only what its checkpointer/model/optimizer need
	$(BIN)/python -m pip install -q --no-deps 'torchtitan==0.3.0' 'spmd_types==0.2.3' tyro==1.0.17 docstring_parser==0.18.0 typeguard==4.6.1 einops==0.8.2 triton==3.9.0
	# its Trainer (tests/integration/integrations/test_torchtitan_trainer.py, CUDA only) also imports
	# torchdata (the test extra), datasets (below) and tensorboard
	$(BIN)/python -m pip install -q tensorboard==2.21.0
	# verl's integration test: without its deps (they would pin transformers < 5.11 and pull vLLM,
	# wandb, ...); what importing verl.utils.checkpoint and its FSDP engine module needs (verl's
	# package __init__ imports ray and tensordict; verl.utils.checkpoint imports the engine)
	$(BIN)/python -m pip install -q --no-deps 'verl==0.9.1' 'ray==2.60.0' msgpack==1.2.4 protobuf==7.36.2 'tensordict==0.10.0' cloudpickle==3.1.2 orjson==3.13.0 pyvers==0.1.0 peft==0.21.2 codetiming==1.4.0
	$(BIN)/python -m pip install -q jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1 omegaconf==2.4.0 datasets==5.2.0 pandas==3.1.1 pyarrow==26.0.1 dill==0.4.1 multiprocess==0.70.19 xxhash==4.1.0
	touch $@

demo: setup-demo
	$(BIN)/python examples/demo.py

test: setup lint
	HYPOTHESIS_PROFILE=ci $(BIN)/python -m pytest -q --durations=30

# tiers: tests/tiers.py (markers distributed and slow; tests/unit starts no process)
test-fast: setup
	HYPOTHESIS_PROFILE=fast $(BIN)/python -m pytest -q tests/unit -m "not distributed and not slow"

lint: setup
	$(BIN)/ruff check src tests bench examples
	$(BIN)/ruff format --check src tests bench examples
	$(BIN)/mypy

bench: setup
	$(BIN)/python bench/save_load.py
	$(BIN)/python bench/async_stall.py

# the peers of the three-way benchmark (torch-checkpointing 0.1.1; it leaves torch as it is)
bench-deps: setup-demo
	$(BIN)/python -m pip install -q -e '.[bench]'

# unickpt vs DCP vs torch-checkpointing vs raw bytes (est. ~10 min on a quiet 2-core VM; --quick: a smoke run)
bench-three-way: bench-deps
	mkdir -p bench_out
	PYTHONPATH=src $(BIN)/python bench/three_way.py --json bench_out/three_way.json

clean:
	rm -rf $(VENV) demo_out bench_out .pytest_cache
