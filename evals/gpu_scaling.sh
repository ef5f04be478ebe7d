#!/usr/bin/env bash
# Campaign evaluations on every GPU of a host, in one call on a host of two GPUs or more: the
# two-GPU tests of the local backend (one timing worker per GPU, each judge on its own GPU),
# then evals.bench_scaling: the same candidates on 1 GPU and on 2, evaluations per hour and
# their ratio (the figure BENCHMARKS.md records; the target is 1.8x or more on two). Logs and
# JSON go to $OUT.
# Usage (repo root, on a multi-GPU host whose python3 has torch and triton; RECFORGE_BWRAP may
# name a bubblewrap binary carried along): bash evals/gpu_scaling.sh [CANDIDATES] [COUNTS] [PARALLEL]
#   (default: 24 1,2 1; e.g. `bash evals/gpu_scaling.sh 24 1,2,4` on four GPUs)
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
export COLUMNS=160 RECFORGE_HOME=/tmp/recforge-home
CANDIDATES=${1:-24}
COUNTS=${2:-1,2}
PARALLEL=${3:-1}
nvidia-smi -L | tee -a "$LOG"
python3 -m pytest tests/sandbox/test_gpu_places.py -q -p no:cacheprovider -rs 2>&1 | tee -a "$LOG" | tail -6
python3 -m evals.bench_scaling --gpus "$COUNTS" --candidates "$CANDIDATES" --parallel "$PARALLEL" \
  --json "$OUT/scaling.json" 2>&1 | tee -a "$LOG"
