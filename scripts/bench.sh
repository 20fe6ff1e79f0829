#!/usr/bin/env bash
# `make bench`: time the real training loop (python -m train bench), warm-up excluded, against a
# plain PyTorch loop on the same model and batches. Every launcher variable applies.
# Usage: [VAR=value ...] bash scripts/bench.sh [--any_flag value ...]
#   e.g. THREADS=1 MODEL_SIZE=nano make bench          (the CPU workload of bench/RESULTS.md)
#        MODEL_SIZE=small ENABLE_BF16=1 COMPILE=1 PRESET=optimized VS_PLAIN=0 make bench
set -euo pipefail

PRESET=${PRESET:-baseline}  # baseline | optimized: the launcher whose settings are timed
ROUNDS=${ROUNDS:-5}         # kit/plain rounds, alternated; medians are reported
THREADS=${THREADS:-}        # torch threads on CPU; empty: torch's default
VS_PLAIN=${VS_PLAIN:-1}     # 1: also time the plain loop and print the ratio
MAX_STEPS=${MAX_STEPS:-}    # steps per round; empty: 10 on CPU, 50 on a GPU

source "$(dirname "$0")/common.sh"
extra=(--rounds "$ROUNDS")
if [ -n "$THREADS" ]; then extra+=(--threads "$THREADS"); fi
case "${VS_PLAIN,,}" in
  1 | true | yes | on) extra+=(--vs-plain) ;;
  "" | 0 | false | no | off) ;;
  *) kit_fail "VS_PLAIN must be 1 or 0, got '$VS_PLAIN'" ;;
esac
kit_launch bench "$PRESET" "${extra[@]}" "$@"
