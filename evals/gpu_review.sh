#!/usr/bin/env bash
# Kernel review on a GPU, whatever a campaign would accept: one knob setting of the embedding-bag
# template is evaluated and timed in the sandbox, registered in a fresh library and opened as a
# change in a fresh repository (as a campaign does, agent/nodes.py), then `recforge review
# approve` times it again against its evidence and merges it, and `recforge library verify` times
# it against the default kernel (keeping or demoting it). Logs go to $OUT/log.txt.
# Usage (repo root, on a GPU host whose python3 has torch and triton; RECFORGE_BWRAP may name a
# bubblewrap binary carried along): bash evals/gpu_review.sh [KNOBS_JSON]
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
export COLUMNS=200 RECFORGE_HOME=/tmp/recforge-review/home
work=/tmp/recforge-review
rm -rf "$work" && mkdir -p "$work/repo"
git -C "$work/repo" init -q && git -C "$work/repo" -c user.name=r -c user.email=r@localhost commit -q --allow-empty -m root
default_knobs='{"BLOCK_L": 16}'
python3 - "$work" "${1:-$default_knobs}" <<'PY' 2>&1 | tee -a "$LOG"
import json, sys
from pathlib import Path

from agent import review
from agent.incumbents import campaign_arch
from agent.population import serving_us
from kernels.registry import KernelLibrary
from sandbox.candidate import Candidate
from sandbox.local import LocalBackend
from search_space.template import get_template

work, knobs = Path(sys.argv[1]), json.loads(sys.argv[2])
template = get_template("embedding_bag")
source = template.render({**template.defaults(), **knobs})
candidate = Candidate(problem="embedding_bag", source=source, entry=template.entry, origin="template", knobs=knobs)
result = LocalBackend(timeout_s=300).evaluate(candidate, timing=True, trials=2)
print(f"evaluated {candidate.id} with {knobs}: {result.status.value} {result.message[:200]}")
if result.status.value != "ok":
    sys.exit(1)
library = KernelLibrary(work / "library")
dtype = "bf16" if any(t.dtype == "bf16" for t in result.timings) else result.timings[0].dtype
buckets = sorted({t.bucket for t in result.timings if t.dtype == dtype and t.bucket})
entry = library.add(
    op="embedding_bag", entry=candidate.entry, source=source, arch=result.device.arch, dtype=dtype,
    buckets=buckets, median_us=None,
    bucket_us={b: us for b in buckets if (us := serving_us(result, dtype, b)) is not None},
    interpreted=result.interpreted, evidence={"evaluation": result.model_dump(mode="json")},
    provenance={"candidate": candidate.id, "knobs": knobs},
)
change = review.open_change(
    work / "repo", entry=entry, source=source, evidence={"evaluation": result.model_dump(mode="json")},
    description=f"embedding_bag {dtype} {', '.join(buckets)}: knobs {knobs} (evals/gpu_review.sh)",
)
print(f"registered {entry.kernel_id} on {campaign_arch()} for {dtype} {buckets}; change {change.id}")
(work / "change").write_text(change.id)
PY
[ -f "$work/change" ] || exit 1
python3 -m agent review list --repo "$work/repo" 2>&1 | tee -a "$LOG"
timeout 300 python3 -m agent review approve "$(cat "$work/change")" --repo "$work/repo" 2>&1 | tee -a "$LOG" | tail -5
approved=${PIPESTATUS[0]}
timeout 300 python3 -m agent library verify --library "$work/library" 2>&1 | tee -a "$LOG" | tail -15
verified=${PIPESTATUS[0]}
echo "review approve exited $approved, library verify $verified" | tee -a "$LOG"
[ "$approved" = 0 ] && [ "$verified" = 0 ]
