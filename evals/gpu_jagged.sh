#!/usr/bin/env bash
# The jagged transforms' GPU evidence in one call: their tests on the GPU, then every one of the
# four through kernels.ops at every timing shape beside torch's kernels (its port of FBGEMM's
# for the padded forms, the per-sample torch.cat that eager code writes for concat and split)
# and the plain reference, with result rows in $OUT/jagged_rows.jsonl. Each op's backward is
# its partner's forward, so the four forwards time training's passes too.
# Usage (repo root, on a GPU host whose python3 has torch and triton): bash evals/gpu_jagged.sh
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
export COLUMNS=160 RECFORGE_HOME=/tmp/recforge-home
python3 -m pytest -q -p no:cacheprovider tests/kernels/test_jagged_transforms.py 2>&1 | tee -a "$LOG" | tail -5
for op in jagged_to_padded_dense dense_to_jagged jagged_concat jagged_split; do
  python3 -m agent bench ops --op "$op" --output "$OUT/jagged_rows.jsonl" 2>&1 | tee -a "$LOG"
done
