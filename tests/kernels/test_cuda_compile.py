"""The default kernels compile for an H100/H200 (sm_90) with Triton's real compiler, on any
machine: the interpreter, which CPU tests run, checks neither loop-carried types nor what the
GPU backend refuses (tests/kernels/cuda_compile.py)."""

from __future__ import annotations

import pytest
from cuda_compile import in_subprocess

pytestmark = pytest.mark.slow

# The kernels that have not yet run on a GPU (the others ran on an H200: BENCHMARKS.md); any op
# can be added, at about 20 s a kernel the first time (Triton caches what it compiled). Left out:
# embedding_bags and embedding_bags_update, whose own tests compile their GPU launch
# configurations (tests/kernels/test_embedding_bags.py, tests/kernels/test_embedding_bags_update.py).
GROUPS = {
    "gemm": "grouped_gemm,grouped_gemm_weight_grad,wukong_fm",
    "history": "history_gather,history_gather_backward",
}


@pytest.mark.parametrize("ops", list(GROUPS.values()), ids=list(GROUPS))
def test_every_launch_compiles_for_sm90(ops: str) -> None:
    script = f"import json, cuda_compile; print(json.dumps(cuda_compile.main({ops.split(',')!r})))"
    report = in_subprocess(script)
    assert report["failed"] == [], report["failed"]
    assert report["compiled"], "no kernel was launched"
