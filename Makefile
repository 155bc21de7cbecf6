# The two commands of the README: `make demo` (train the bundled demo) and `make test`.
# Both create .venv on first use and install what they need; nothing else is assumed.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-main test-vllm setup setup-vllm lint clean gpu-wheels gpu-suite gpu-suite-dry

setup: $(STAMP)

# torch==2.13.0 first and explicitly: on machines with the CPU wheel on disk pip takes it
# instead of pulling a multi-GB CUDA build; on a GPU machine it is the regular CUDA wheel.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev,tensorboard]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/leangrpo train examples/demo.yaml --set run.overwrite=true

test: test-main test-vllm

test-main: $(STAMP)
	bash scripts/run_tests.sh $(BIN)/pytest -q

setup-vllm:
	bash scripts/setup_vllm_venv.sh

test-vllm: setup-vllm
	bash scripts/run_tests.sh .venv-vllm/bin/pytest -q -m vllm tests/rollout/test_vllm.py

# GPU suite (benchmarks/RESULTS.md, "GPU suite"): wheels for the GPU machine, the run
# itself on a CUDA machine, and its CPU dry run (tiny shapes; also a test).
gpu-wheels: $(STAMP)
	PYTHON=$(BIN)/python bash scripts/fetch_gpu_wheels.sh

gpu-suite:
	PYTHONUNBUFFERED=1 bash benchmarks/gpu_suite.sh

gpu-suite-dry: $(STAMP)
	PYTHON=$(BIN)/python PYTHONUNBUFFERED=1 bash benchmarks/gpu_suite.sh --dry-run

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks scripts

clean:
	rm -rf $(VENV) .venv-vllm runs
