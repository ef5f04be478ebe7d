#!/usr/bin/env bash
# Training beyond one GPU, in one call on a host of two GPUs or more: the two-GPU tests
# (sharded lookups and fused updates against the unsharded tables, data-parallel training
# against one process; NCCL), then evals.bench_distributed: `recforge model train` on one GPU,
# on NPROC balanced by attention work, and on NPROC in consecutive blocks (examples per second
# and their ratio, MFU, the logged losses against one GPU's). Logs and JSON go to $OUT.
# Usage (repo root, on a multi-GPU host whose python3 has torch and triton):
#   bash evals/gpu_distributed.sh [CONFIG] [STEPS] [NPROC]    (default: large 40 2)
#   bash evals/gpu_distributed.sh small 300                   (the losses over a few hundred steps)
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
export COLUMNS=200 RECFORGE_HOME=$PWD/.recforge
CONFIG=${1:-large}
STEPS=${2:-40}
NPROC=${3:-2}
nvidia-smi -L | tee -a "$LOG"
python3 -m pytest tests/model/test_sharding.py -q -p no:cacheprovider -rs 2>&1 | tee -a "$LOG" | tail -6
python3 -m evals.bench_distributed --config "$CONFIG" --steps "$STEPS" --nproc "$NPROC" \
  --out "$OUT/distributed-$CONFIG" 2>&1 | tee -a "$LOG" | tail -8
