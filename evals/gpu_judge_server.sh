#!/usr/bin/env bash
# The judge fork server on a GPU host: judges forked from it use CUDA (the server never
# initialises it), and sandbox throughput with and without it, side by side in one call.
# Usage (repo root, on a GPU host whose python3 has torch and triton; RECFORGE_BWRAP may name a
# bubblewrap binary carried along): bash evals/gpu_judge_server.sh [tests|bench]
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
export COLUMNS=160 RECFORGE_HOME=/tmp/recforge-home
export RECFORGE_JUDGE_SERVER=1  # the server under test
if [ "${1:-tests}" = tests ]; then
  python3 -m pytest -q -p no:cacheprovider tests/sandbox/test_judge_server.py tests/sandbox/test_local_backend.py \
    tests/sandbox/test_judge.py tests/kernels/test_bundle.py 2>&1 | tee -a "$LOG" | tail -25
else
  for server in 1 0 1 0; do  # with and without the server, side by side
    echo "== RECFORGE_JUDGE_SERVER=$server"
    RECFORGE_JUDGE_SERVER=$server python3 -m agent bench sandbox --candidates 12 --parallel 6 2>&1 | tail -12
  done 2>&1 | tee -a "$LOG"
fi
