"""Compiles every kernel launch of some ops' default kernels for an H100/H200 (sm_90) on a
machine without a GPU: Triton's real compiler (its code generator, then ptxas) instead of the
interpreter, which checks neither loop-carried types nor what the GPU backend refuses.

    python tests/kernels/cuda_compile.py op1,op2,...      (TRITON_INTERPRET unset)

Each op's default runs on its problem's check-shape inputs (CPU tensors); every launch is
compiled instead of run, with the argument types and constexprs the launcher passed (the kit's
tile multiply-accumulate as a GPU's launcher picks it). Prints {"compiled": [...], "failed":
[[kernel, constexprs, error]]} as JSON.

For a kernel before its first run on a GPU: every op's default has now run on an H100 (their
GPU tests, and the sandbox's incumbents: BENCHMARKS.md), so the suite compiles only the GPU
launch configurations of embedding_bags and its update, which their own tests pick
(tests/kernels/test_embedding_bags.py, tests/kernels/test_embedding_bags_update.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

TARGET = GPUTarget("cuda", 90, 32)
TYPES = {
    torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64",
    torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8",
    torch.bool: "i1",
}  # fmt: skip


def type_of(value) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"a kernel argument of type {type(value).__name__}")


def main(ops: list[str], dtypes: tuple[str, ...] = ()) -> dict:
    """Every launch of `ops`' defaults at their check shapes (of `dtypes` only, where given)."""
    compiled: set[str] = set()
    failed: list[list[str]] = []
    seen: set[tuple[str, str]] = set()

    def compile_instead(self, *args, grid, warmup, **kwargs):
        options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages", "maxnreg") if k in kwargs}
        options = {k: v for k, v in options.items() if v is not None}
        values = dict(zip([p.name for p in self.params], args, strict=False)) | kwargs
        signature, constexprs = {}, {}
        for p in self.params:
            value = values.get(p.name)
            if p.is_constexpr or value is None:
                signature[p.name] = "constexpr"
                constexprs[p.name] = "tf32" if value == "via_fp32" else value  # a GPU launcher's choice
            else:
                signature[p.name] = type_of(value)
        name = f"{self.fn.__module__}.{self.fn.__name__}"
        key = (
            name,
            json.dumps([signature, {k: str(v) for k, v in constexprs.items()}, options], sort_keys=True),
        )
        if key in seen:  # the same specialization, from another shape: compiled once
            return
        seen.add(key)
        try:
            source = ASTSource(fn=self, signature=signature, constexprs=constexprs)
            triton.compile(source, target=TARGET, options=options)
            compiled.add(name)
        except Exception as exc:  # noqa: BLE001 - every failure is reported
            failed.append([name, json.dumps({k: str(v) for k, v in constexprs.items()}), str(exc)[-1500:]])

    JITFunction.run = compile_instead
    from search_space import get_problem
    from search_space.op import Op, get_op

    for name in ops:
        problem, op = get_problem(name), get_op(name)
        default = Op.resolve(op.default)
        for shape in [s for s in problem.check_shapes if not dtypes or s.dtype in dtypes]:
            inputs = problem.make_inputs(shape, 0, torch.device("cpu"))
            default(*inputs.args, **inputs.kwargs)
    return {"compiled": sorted(compiled), "failed": failed}


def in_subprocess(script: str) -> dict:
    """Runs `script` in a fresh interpreter with Triton's real compiler (TRITON_INTERPRET
    unset; this module importable as cuda_compile) and returns the JSON report it prints last,
    as main's. AssertionError with its stderr's tail if it fails."""
    here = Path(__file__).parent
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(here.parents[1]), str(here)])
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600
    )
    if done.returncode != 0:
        raise AssertionError(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1].split(","))))
