# Every target that trains takes the launchers' variables: MODEL_SIZE=nano make train
SHELL := /bin/bash
PY := .venv/bin/python
STAMP := .venv/.installed

.PHONY: help setup train baseline show-config test test-fast knobs lint clean sft sft-fast chat sft-bench find-batch doctor autotune compare compare-sft dpo compare-dpo grpo compare-grpo monitor bench bench-data gpu-report

help:
	@echo "make setup     create .venv and install requirements (only python3 needed)"
	@echo "make train     train with the optimized launcher (built-in corpus by default)"
	@echo "make baseline  train with the baseline launcher"
	@echo "make sft       SFT with ./train_sft_custom.sh (micro-batch 16; MODEL_PATH, DATA_PATH ...)"
	@echo "make sft-fast  SFT with ./quick_start_sft_fast.sh (16 x accumulation 2, length grouping)"
	@echo "make dpo       preference training with ./train_dpo.sh (8 pairs per micro-batch; DATA_PATH of pairs, MODEL_PATH ...)"
	@echo "make grpo      reward training with ./train_grpo.sh (4 prompts x 8 completions per micro-batch; built-in task or DATA_PATH)"
	@echo "make chat      chat with a trained model (MODEL=runs/<name>/final; default runs/latest/final; ARGS=\"--num_beams 4\")"
	@echo "make sft-bench the same SFT run three ways: plain padding, LENGTH_GROUPING=1, PACKING=1; padding and tokens/s"
	@echo "make show-config  DRY_RUN=1 of the optimized launcher: settings, numbers, memory estimate"
	@echo "make find-batch  fastest micro-batch that fits TARGET_VRAM (0.8), same effective batch"
	@echo "make doctor    short profiled run and what to change (ARGS=--apply tries the fix)"
	@echo "make autotune  timed trials; writes the winner to runs/autotune.env"
	@echo "make compare   baseline vs optimized launcher, same model/data/seed/COMPARE_SAMPLES (GPU: 4096, CPU: 1024); REPEAT=N; RESUME=1 continues one"
	@echo "make compare-sft  SFT with batch 1 vs quick_start_sft_fast.sh on the same conversations (GPU: 4096, CPU: 256), in tokens/s"
	@echo "make compare-dpo  DPO with one pair per step vs ./train_dpo.sh on the same pairs (DATA_PATH; CPU: 128 pairs)"
	@echo "make compare-grpo GRPO with one prompt per step vs ./train_grpo.sh on the same prompts (CPU: 32 prompts)"
	@echo "make monitor   live GPU table (GPU %, VRAM, power, clocks, temp) until Ctrl-C"
	@echo "make bench     time the real training loop vs a plain PyTorch loop (THREADS=1 MODEL_SIZE=nano ...)"
	@echo "make bench-data  pretraining data at 100 MB and 1 GB (JSONL, parquet): kit vs encode_batch tokens/s, RSS, first step"
	@echo "make gpu-report  on a CUDA GPU: find-batch, doctor, AUTO_BATCH, SFT grouped/packed, T5, DPO, GRPO, the peers (TRL, Seq2SeqTrainer), bench, one step of each profiled; writes bench/RESULTS.md's GPU table and bench/gpu_table.json"
	@echo "make test      run the test suite (CPU only; two pytest-xdist workers, TEST_WORKERS=N for more; 6 1/2 minutes on 2 quiet cores)"
	@echo "make test-fast the unit tests only: no test that starts a process or a whole run (tests/conftest.py)"
	@echo "make knobs     rewrite docs/knobs.md's tables and the launchers' knob lines from config.py"
	@echo "make lint      ruff check"
	@echo "make clean     remove runs/, caches and .venv"

setup: $(STAMP)

$(STAMP): requirements.txt scripts/setup.sh
	@bash scripts/setup.sh

train: $(STAMP)
	./run_single_gpu_optimized.sh

baseline: $(STAMP)
	./run_single_gpu.sh

sft: $(STAMP)
	./train_sft_custom.sh

sft-fast: $(STAMP)
	./quick_start_sft_fast.sh

dpo: $(STAMP)
	./train_dpo.sh

grpo: $(STAMP)
	./train_grpo.sh

MODEL ?= runs/latest/final
chat: $(STAMP)
	$(PY) -m train generate --model "$(MODEL)" --interactive $(ARGS)

sft-bench: $(STAMP)
	scripts/bench_sft.sh
show-config: $(STAMP)
	DRY_RUN=1 ./run_single_gpu_optimized.sh

# The launchers' variables (MODEL_SIZE, MAX_LENGTH, PRECISION, DATA_PATH, MAX_MEMORY_MB ...) over
# the optimized preset; PRESET=baseline for the other. ARGS: extra flags (doctor: --apply).
find-batch doctor autotune: $(STAMP)
	bash scripts/kit.sh $@ $${PRESET:-optimized} $(ARGS)

compare: $(STAMP)
	@bash scripts/compare.sh pretrain

compare-sft: $(STAMP)
	@bash scripts/compare.sh sft

compare-dpo: $(STAMP)
	@bash scripts/compare.sh dpo

compare-grpo: $(STAMP)
	@bash scripts/compare.sh grpo

monitor: $(STAMP)
	@$(PY) -m train monitor

bench: $(STAMP)
	bash scripts/bench.sh

bench-data: $(STAMP)
	bash bench/bench_data.sh

gpu-report: $(STAMP)
	@bash scripts/gpu_report.sh

# pytest-xdist's workers, two by default (TEST_WORKERS=N: one per core): a module's tests stay on one worker (loadfile),
# the longest modules first (tests/conftest.py's order, kept by --no-loadscope-reorder); each worker's
# progress shows as it goes. Ctrl-C or a SIGTERM to make stops every process of the suite (the
# controller's handler, tests/suite_control.py). TESTS: files or node ids instead of the whole suite.
TEST_WORKERS ?= 2
TEST_ARGS = -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(TESTS)
test: $(STAMP)
	@exec $(PY) -m pytest $(TEST_ARGS)

# The unit tests (no test that starts a process or a whole run), single-threaded each: two workers.
test-fast: $(STAMP)
	@exec $(PY) -m pytest -m "not integration" $(TEST_ARGS)

knobs: $(STAMP)
	$(PY) -m train knobs --write

lint: $(STAMP)
	$(PY) -m ruff check .

clean:
	rm -rf runs .cache .venv .pytest_cache .ruff_cache compare
