#!/usr/bin/env bash
# The sandbox's GPU evidence in one call: the host-compute watch, the judge's cases, the
# adversarial suite and the runner's channel on the GPU, then sandbox throughput now and, where
# .tools/before.tgz holds an earlier commit's tree (git archive COMMIT | gzip), the same
# benchmark on it, side by side. Logs go to $OUT.
# Usage (repo root, on a GPU host whose python3 has torch and triton; RECFORGE_BWRAP may name a
# bubblewrap binary carried along): bash evals/gpu_sandbox.sh
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
export COLUMNS=160 RECFORGE_HOME=/tmp/recforge-home
# The host-compute watch on compiled launches first: every incumbent must run clean under it.
python3 -m pytest -q -p no:cacheprovider tests/sandbox/test_host_ops.py tests/sandbox/test_channel.py \
  tests/sandbox/test_judge.py tests/sandbox/test_adversarial.py 2>&1 | tail -25 | tee "$OUT/pytest.txt"
python3 -m agent bench sandbox --candidates 30 --parallel 6 2>&1 | tee "$OUT/bench_after.txt"
if [ -f .tools/before.tgz ]; then
  rm -rf /tmp/before && mkdir -p /tmp/before && tar xzf .tools/before.tgz -C /tmp/before
  (cd /tmp/before && PYTHONPATH=/tmp/site:/tmp/before python3 -m agent bench sandbox --candidates 30 --parallel 6) \
    2>&1 | tee "$OUT/bench_before.txt"
fi
