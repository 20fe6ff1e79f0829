#!/usr/bin/env bash
# make bench-data: the data pipeline at size, offline. Generates its own corpora (shuffled lines
# of this Python's standard library) under BENCH_DATA_DIR, then times pretraining's token cache
# against the tokenizer's own encode_batch (bench/data_pretrain.py) and, where it exists, SFT's
# cache (bench/data_sft.py). Both write their tables into bench/RESULTS.md.
# Usage: [BENCH_DATA_SIZES=100,1000] [BENCH_DATA_DIR=.cache/bench] bench/bench_data.sh
#   The 1 GB corpora take minutes per run on a 2-core machine (and ~3 GB of disk).
set -euo pipefail
cd "$(dirname "$0")/.."

BENCH_DATA_SIZES=${BENCH_DATA_SIZES:-100,1000}   # MB per generated corpus
BENCH_DATA_DIR=${BENCH_DATA_DIR:-.cache/bench}   # corpora, tokenizer and caches (reused)
BENCH_DATA_NOTE=${BENCH_DATA_NOTE:-}             # a sentence for RESULTS.md (load on the machine ...)
PY="$(source scripts/common.sh && kit_python)"

"$PY" bench/data_pretrain.py --sizes "$BENCH_DATA_SIZES" --work "$BENCH_DATA_DIR" --note "$BENCH_DATA_NOTE"
if [ -f bench/data_sft.py ]; then
  "$PY" bench/data_sft.py
fi
