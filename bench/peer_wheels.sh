#!/usr/bin/env bash
# The peers' wheels for a GPU machine that reaches no package index: TRL 1.16 and what it needs
# that the machine lacks, downloaded here (pip works here) into .whl/ (git-ignored), carried to the
# machine with the working tree, and installed there by scripts/gpu_report.sh's peer parts with
#   pip install --no-index --no-deps --target /tmp/site .whl/*.whl   (then PYTHONPATH=/tmp/site)
# Never the kit's requirements: the peers are bench/'s (bench/peer_sft.py, bench/dpo_trl_side.py,
# bench/peer_seq2seq.py), and train/ imports none of them.
#
# Which wheels (Requires-Dist of trl 1.16.0 and datasets 5.2.0, without extras, against the GPU
# machine's package list): accelerate, huggingface-hub, jinja2, numpy, packaging, pandas, psutil,
# pyarrow, pyyaml, transformers, filelock, tqdm, xxhash and fsspec are there; datasets, dill and
# multiprocess are not. All four are pure Python (multiprocess's wheel is per Python version:
# py312, the machine's 3.12). About 1.8 MB together.
# Usage: bash bench/peer_wheels.sh [FOLDER]   (default .whl at the repository's root)
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${1:-.whl}
WHEELS=(trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19)
mkdir -p "$DEST"
# one version of each: a second (an older download) would stop the install on the machine
for w in "${WHEELS[@]}"; do
  name=${w%%==*}
  find "$DEST" -maxdepth 1 -type f -name "${name}-*.whl" ! -name "${name}-${w#*==}-*" -delete
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$DEST" "${WHEELS[@]}" 2> >(grep -v '^WARNING: Location' >&2)
n=$(find "$DEST" -maxdepth 1 -type f -name '*.whl' | wc -l)
[ "$n" -eq "${#WHEELS[@]}" ] || { echo "peer_wheels: expected ${#WHEELS[@]} wheels in $DEST, found $n" >&2; exit 1; }
echo "peer_wheels: $n wheels in $DEST, $(du -ch "$DEST"/*.whl | tail -n 1 | cut -f1) together"
