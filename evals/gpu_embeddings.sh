#!/usr/bin/env bash
# The embedding stack's GPU evidence in one call: its tests on the GPU (the kernels on every
# timing shape), then each op through kernels.ops at every timing shape beside torch (the
# per-feature F.embedding_bag calls, its sparse backward plus the optimizer's step), the plain
# reference and torch.compile of it, with GB/s and the fraction of the copy bandwidth measured
# in the same run; result rows in $OUT/embedding_rows.jsonl. The single-table embedding_bag
# comes first: its short-bag bf16 shapes are the ones the table-batched lookup must beat.
# Usage (repo root, on a GPU host whose python3 has torch and triton): bash evals/gpu_embeddings.sh
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
export COLUMNS=180 RECFORGE_HOME=/tmp/recforge-home
python3 -m pytest -q -p no:cacheprovider tests/kernels/test_embedding_bag.py tests/kernels/test_embedding_bags.py \
  tests/kernels/test_embedding_bags_update.py tests/kernels/test_history_gather.py 2>&1 | tee -a "$LOG" | tail -5
for op in embedding_bag embedding_bags embedding_bags_backward embedding_bags_update history_gather history_gather_backward; do
  python3 -m agent bench ops --op "$op" --output "$OUT/embedding_rows.jsonl" 2>&1 | tee -a "$LOG"
done
