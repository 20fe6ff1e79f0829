# Every target that trains takes the launchers' variables: MODEL_SIZE=nano make train
SHELL := /bin/bash
PY := .venv/bin/python
STAMP := .venv/.installed

.PHONY: help setup train baseline bench test lint clean

help:
	@echo "make setup     create .venv and install requirements (only python3 needed)"
	@echo "make train     train with the optimized launcher (built-in corpus by default)"
	@echo "make baseline  train with the baseline launcher"
	@echo "make bench     time the real training loop vs a plain PyTorch loop (THREADS=1 MODEL_SIZE=nano ...)"
	@echo "make test      run the test suite (CPU only, a few minutes)"
	@echo "make lint      ruff check"
	@echo "make clean     remove runs/, caches and .venv"

setup: $(STAMP)

$(STAMP): requirements.txt scripts/setup.sh
	@bash scripts/setup.sh

train: $(STAMP)
	./run_single_gpu_optimized.sh

baseline: $(STAMP)
	./run_single_gpu.sh

bench: $(STAMP)
	bash scripts/bench.sh

test: $(STAMP)
	$(PY) -m pytest

lint: $(STAMP)
	$(PY) -m ruff check .

clean:
	rm -rf runs .cache .venv .pytest_cache .ruff_cache compare
