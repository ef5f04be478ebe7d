#!/usr/bin/env bash
# Attention-family GPU evidence in one call: environment, the GPU tests of the kernels, problems
# and model, then `bench ops` per attention op. Logs and JSONL rows go to $OUT (or ./gpu-out).
# Usage (repo root, on a GPU host whose python3 has torch and triton):
#   bash evals/gpu_attention.sh [tests|bench|all|campaign] [extra bench ops options...]
# `campaign` runs campaigns/attention-h200.toml (search over the attention tilings) instead.
# Where the tree is a copy without its git history, pass RECFORGE_COMMIT=<commit> for the rows.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
export COLUMNS=200
what=${1:-all}; shift || true
if [ "$what" = tests ] || [ "$what" = all ]; then
  python3 -m pytest -q -p no:cacheprovider -x -m gpu tests/kernels/test_attention.py tests/search_space/test_attention_problems.py \
    2>&1 | tee -a "$LOG" | tail -25
  python3 -m pytest -q -p no:cacheprovider tests/model 2>&1 | tee -a "$LOG" | tail -5
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  for op in jagged_attention gdpa target_attention; do
    python3 -m agent bench ops --op "$op" --output "$OUT/bench_rows.jsonl" "$@" 2>&1 | tee -a "$LOG"
  done
fi
if [ "$what" = campaign ]; then
  export RECFORGE_HOME=$PWD/.recforge
  python3 -m agent campaign run campaigns/attention-h200.toml 2>&1 | tee -a "$LOG"
  tar czf "$OUT/runs.tgz" runs/attention .recforge/store.db
fi
