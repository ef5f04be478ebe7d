#!/usr/bin/env bash
# The sandbox's GPU evidence in one call: the host-compute watch, the judge's cases, the
# adversarial suite and the runner's channel on the GPU, then sandbox throughput now and, where
# .tools/before.tgz holds an earlier commit's tree (git archive COMMIT | gzip), the same
# benchmark on it, side by side. Logs go to $OUT/log.txt.
# Usage (repo root, on a GPU host whose python3 has torch and triton; RECFORGE_BWRAP may name a
# bubblewrap binary carried along): bash evals/gpu_sandbox.sh
# SANDBOX_TESTS (the test files), BENCH_CANDIDATES (30) and RECFORGE_CORPUS_PARALLEL (the corpus's
# evaluations side by side, 6 here) size the call to the device time at hand. TIMING_LOCKS, a
# list of RECFORGE_TIMING_LOCK modes, runs the benchmark once per mode in that order; the first
# run also fills the compile caches, so to compare modes on equal terms end with the first one
# again ("shape batch shape").
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
export COLUMNS=160 RECFORGE_HOME=/tmp/recforge-home RECFORGE_CORPUS_PARALLEL=${RECFORGE_CORPUS_PARALLEL:-6}
candidates=${BENCH_CANDIDATES:-30}
# The host-compute watch on compiled launches first: every incumbent must run clean under it.
# shellcheck disable=SC2086
python3 -m pytest -q -p no:cacheprovider -rA ${SANDBOX_TESTS:-tests/sandbox/test_host_ops.py \
  tests/sandbox/test_channel.py tests/sandbox/test_judge.py tests/sandbox/test_adversarial.py} 2>&1 \
  | tee -a "$LOG" | tail -40
for mode in ${TIMING_LOCKS:-shape}; do
  echo "== bench sandbox, RECFORGE_TIMING_LOCK=$mode" | tee -a "$LOG"
  RECFORGE_TIMING_LOCK=$mode python3 -m agent bench sandbox --candidates "$candidates" --parallel 6 2>&1 | tee -a "$LOG"
done
if [ -f .tools/before.tgz ]; then
  rm -rf /tmp/before && mkdir -p /tmp/before && tar xzf .tools/before.tgz -C /tmp/before
  (cd /tmp/before && PYTHONPATH=/tmp/site:/tmp/before python3 -m agent bench sandbox --candidates "$candidates" \
    --parallel 6) 2>&1 | tee -a "$LOG"
fi
