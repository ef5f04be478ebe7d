# Sourced by the GPU evidence scripts (repo root, on a GPU host whose python3 has torch and
# triton): $OUT for results, the pure-Python wheels of .whl installed offline on PYTHONPATH, and
# the machine and software versions written to $LOG ($OUT/log.txt), which the scripts' text
# output is appended to: one log, and JSON beside it, because the device machine returns at most
# 8 files of $OUT.
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
LOG=$OUT/log.txt
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
{
  date -u; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
  python3 -c 'import torch, triton, platform; print("torch", torch.__version__, "triton", triton.__version__, "python", platform.python_version())'
} 2>&1 | tee -a "$LOG"
