"""The runner's interpreter on a CPU, as a fresh runner process sets it up: helper calls without
the re-patching (sandbox/interpreter_calls.py) under the memory bounds (interpreter_memory.py),
whose launch wrapper stays outermost; a helper's access outside its launch's tensors still fails,
and one inside gives the interpreter's own result."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU's runner compiles its kernels")

CANDIDATE = """
import torch
import triton
import triton.language as tl


@triton.jit
def _at(ptr, offs, n):
    return tl.load(ptr + offs, mask=offs < n, other=0.0)


@triton.jit
def _kernel(x_ptr, out_ptr, n, reach, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = _at(x_ptr, offs, n) + _at(x_ptr + reach, offs, n)  # reach 0: inside; else past x
    tl.store(out_ptr + offs, tl.sum(tl.zeros([BLOCK], dtype=tl.float32), axis=0) + 2 * x, mask=offs < n)


def run(x, reach=0):
    out = torch.empty_like(x)
    _kernel[(triton.cdiv(x.numel(), 16),)](x, out, x.numel(), reach, BLOCK=16)
    return out
"""

# A runner as sandbox.runner.main makes one, loading the candidate as the judge's "load" asks.
SCRIPT = """
import json, os, socket, sys
os.environ["TRITON_INTERPRET"] = "1"
import torch
from triton.runtime import interpreter
from sandbox.runner import Runner

runner = Runner(socket.socketpair()[0])
reply = runner.op_load({"source_file": sys.argv[1], "entry": "run"}, [])
assert reply["ok"], reply
x = torch.arange(40, dtype=torch.float32)
inside = runner.fn(x)
try:
    runner.fn(x, reach=1 << 20)
    outside = "ran"
except Exception as exc:
    outside = f"{type(exc).__name__}: {exc}"
print(json.dumps({
    "skips_repatching": getattr(interpreter.InterpretedFunction.__call__, "skips_repatching", False),
    "bounded_outermost": getattr(interpreter.GridExecutor.__call__, "recforge_bounded", False),
    "inside": inside.tolist(),
    "outside": outside,
}))
"""


def test_a_cpu_runner_skips_repatching_under_the_memory_bounds(tmp_path: Path) -> None:
    source = tmp_path / "candidate.py"
    source.write_text(textwrap.dedent(CANDIDATE))
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(source)], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["skips_repatching"] is True and found["bounded_outermost"] is True, found
    assert found["inside"] == [4.0 * i for i in range(40)], found["inside"]
    assert "outside every tensor its launch was given" in found["outside"], found["outside"]
