#!/usr/bin/env bash
# Run any `python -m train` command with the launchers' variables mapped to flags (common.sh).
# Usage: [VAR=value ...] scripts/kit.sh COMMAND [PRESET] [--any_flag value ...]
#   e.g. MODEL_SIZE=small MAX_LENGTH=1024 scripts/kit.sh find-batch
#        BATCH_SIZE=4 scripts/kit.sh doctor optimized --apply
# PRESET defaults to optimized, the launcher `make train` runs.
set -euo pipefail

[ $# -ge 1 ] || { echo "usage: scripts/kit.sh COMMAND [PRESET] [flags...]" >&2; exit 2; }
command=$1
shift
preset=optimized
if [ $# -ge 1 ] && [[ $1 != -* ]]; then
  preset=$1
  shift
fi
source "$(dirname "$0")/common.sh"
kit_launch "$command" "$preset" "$@"
