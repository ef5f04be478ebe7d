#!/usr/bin/env bash
# GPU evidence in one call: environment, GPU tests, op benchmark, the demo campaign on real
# shapes, then the benchmark again with the campaign's library. Logs go to $OUT (or ./gpu-out).
# Usage (repo root, on a GPU host whose python3 has torch and triton): bash evals/gpu_evidence.sh [quick]
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
export COLUMNS=160 RECFORGE_HOME=$PWD/.recforge
rf() { python3 -m agent "$@"; }
python3 -m pytest tests/kernels tests/sandbox/test_protocol.py tests/model -q -p no:cacheprovider 2>&1 | tee -a "$LOG" | tail -15
rf bench ops --op embedding_bag 2>&1 | tee -a "$LOG"
[ "${1:-}" = quick ] && exit 0
rf campaign run campaigns/demo.toml 2>&1 | tee -a "$LOG"
rf bench ops --op embedding_bag --library runs/demo/library --output "$OUT/bench_rows.jsonl" 2>&1 | tee -a "$LOG"
tar czf "$OUT/runs.tgz" runs .recforge/store.db
