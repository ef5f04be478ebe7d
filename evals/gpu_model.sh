#!/usr/bin/env bash
# The GEM-class model on a GPU, in one call: the model tests, then the large config's training
# step on the library's kernels (the tables stepped in their backward), unfused (a dense table
# gradient, then the optimizer), on the reference ops and compiled (examples per second and MFU
# side by side), its serving latency against candidates per request beside the naive path, and
# where the training and serving steps spend their time. Logs and JSON go to $OUT.
# Usage (repo root, on a GPU host whose python3 has torch and triton):
#   bash evals/gpu_model.sh [CONFIG] [STEPS]        (default: large 40)
# STAGES (default "tests train serve profile") picks the parts to run, VARIANTS (default
# "library unfused reference compiled"; also reference_compiled) the training variants (on the
# reference ops: REFERENCE_STEPS, default 3, each logged), and STAGE_S (default 300) bounds each
# command's seconds, so one call fits the device time at hand. REFERENCE_S (default 450) bounds
# the reference variants instead: on an H100 a step of the large config takes about 98 s on the
# reference ops, after the compile where there is one.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
export COLUMNS=200 RECFORGE_HOME=$PWD/.recforge
CONFIG=${1:-large}
STEPS=${2:-40}
STAGES=${STAGES:-tests train serve profile}
VARIANTS=${VARIANTS:-library unfused reference compiled}
rf() { timeout "${STAGE_S:-300}" python3 -m agent "$@"; }
has() { [[ " $STAGES " == *" $1 "* ]]; }
has tests && timeout "${STAGE_S:-300}" python3 -m pytest tests/model tests/agent/test_model_campaign.py -q \
  -p no:cacheprovider -rf 2>&1 | tee -a "$LOG" | tail -15
has train && for variant in $VARIANTS; do
  steps=$STEPS every=10 bound=${STAGE_S:-300}
  case $variant in
    library) extra=() ;;
    unfused) extra=(--embedding-update unfused) ;;
    # Seconds a step: a few steps, each logged (the first holds the warm-up).
    reference) extra=(--reference-ops) steps=${REFERENCE_STEPS:-3} every=1 bound=${REFERENCE_S:-450} ;;
    compiled) extra=(--compile) ;;
    reference_compiled) extra=(--reference-ops --compile) steps=${REFERENCE_STEPS:-3} every=1 bound=${REFERENCE_S:-450} ;;
    *) echo "unknown variant $variant (library, unfused, reference, compiled, reference_compiled)" | tee -a "$LOG" >&2
       continue ;;
  esac
  timeout "$bound" python3 -m agent model train --config "$CONFIG" --steps "$steps" --log-every "$every" --no-save \
    --json "$OUT/train_$variant.json" "${extra[@]}" 2>&1 | tee -a "$LOG" | tail -4
done
has serve && rf model serve-bench --config "$CONFIG" --json "$OUT/serve.json" 2>&1 | tee -a "$LOG" | tail -20
has profile && for graph in train serve; do
  rf model profile --graph "$graph" --config "$CONFIG" --json "$OUT/profile_$graph.json" 2>&1 | tee -a "$LOG" | tail -30
done
has train || exit 0
python3 - "$OUT" $VARIANTS <<'PY' 2>&1 | tee -a "$LOG"
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
print("variant             examples/s   MFU     loss")
for variant in sys.argv[2:]:
    path = out / f"train_{variant}.json"
    if not path.exists():
        print(f"{variant:<19} (no result: see the log)")
        continue
    result = json.loads(path.read_text())
    steps = result["steps"][1:]  # the first window holds warm-up and compiles
    cut = "" if result.get("complete", True) else "  (cut short: the steps it logged)"
    if not steps:
        print(f"{variant:<19} (too few steps)")
        continue
    rate = sum(s["examples_per_s"] for s in steps) / len(steps)
    mfu = [s["mfu"] for s in steps if s["mfu"] is not None]
    mean_mfu = sum(mfu) / len(mfu) if mfu else float("nan")
    print(f"{variant:<19} {rate:>10,.0f}   {mean_mfu:6.1%}  {steps[-1]['loss']:.4f}{cut}")
print("MFU target: 40% or more (published GEM-class systems report 20% to 37%)")
PY
